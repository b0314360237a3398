"""The codelet vocabulary: every built-in vertex type, named once.

Lowering rules, builders, the built-in codelet library and the graph API name
the vertex types a compute set runs with these constants, never with ad-hoc
strings, so one vertex type has one name wherever it is reached from. Code
memory (``lowering/analysis.py``) is charged once per distinct vertex type per
tile, keyed by :func:`identity`; a type reached by two paths (say a fill from a
reduction over an empty axis and one from a gather of an empty table) is
charged once.

Names follow poplibs' ``library::Vertex<template arguments>`` form. The
library is the one that holds such vertices in poplibs (``popops``:
elementwise, data movement, reductions, indexing and sorting; ``poplin``:
matmuls, convolutions, linear algebra; ``popsparse``: sparse x dense
products; ``poprand``: random numbers), or
``ipu_jax`` for vertex types poplibs has no counterpart of (FFT, replica
indices). Template instances are distinct vertex types with their own code,
as on the IPU, where ``Fill<int>`` and ``Fill<float>`` are separate
codelets: build them with :func:`vertex` (``vertex(FILL, "int")``).
"""

from __future__ import annotations

__all__ = [
    "vertex", "identity",
    # popops: elementwise and data movement.
    "ELEMENTWISE", "MAP", "COPY", "FILL", "IOTA", "SELECT", "SCALED_ADD", "CAST",
    "CAST_STOCHASTIC_ROUND",
    # popops: reductions and scans.
    "REDUCE", "REDUCE_PARTIAL", "SCAN", "SCAN_FOLD", "POOL", "SELECT_AND_SCATTER",
    "SELECT_AND_GATHER",
    # popops: indexing and sorting.
    "DYNAMIC_SLICE", "DYNAMIC_UPDATE_SLICE", "MULTI_SLICE", "MULTI_UPDATE", "MULTI_UPDATE_OP",
    "SORT", "SORT_MERGE", "TOP_K",
    # poplin.
    "DOT", "MATMUL_BLOCK", "REDUCE_ADD", "CONV_PARTIAL",
    # poplin: dense linear algebra, one vertex per problem.
    "CHOLESKY", "CHOLESKY_UPDATE", "TRIANGULAR_SOLVE", "LU", "LU_PIVOTS_TO_PERMUTATION",
    "HOUSEHOLDER_QR", "GEQRF", "GEQP3", "HOUSEHOLDER_PRODUCT", "ORMQR", "JACOBI_EIGH",
    "JACOBI_SVD", "HESSENBERG_QR_EIG", "SCHUR", "HESSENBERG", "TRIDIAGONAL", "TRIDIAGONAL_SOLVE",
    "SYMMETRIC_PRODUCT",
    # popsparse.
    "SPARSE_DENSE_ELEMENTWISE", "SPARSE_DENSE_BLOCK", "STATIC_SPARSE_DENSE_ELEMENTWISE",
    "STATIC_SPARSE_DENSE_BLOCK",
    # poprand.
    "RANDOM", "POPRAND_UNIFORM", "POPRAND_BERNOULLI", "POPRAND_NORMAL",
    "POPRAND_TRUNCATED_NORMAL", "POPRAND_DROPOUT",
    # ipu_jax.
    "FFT", "AXIS_INDEX", "REPLICA_INDEX",
]

ELEMENTWISE = "popops::Elementwise"  # vertex(ELEMENTWISE, op), op a primitive name
MAP = "popops::Map"  # a fused chain, vertex(MAP, *its vertex types) (lowering/fusion.py)
COPY = "popops::Copy"
FILL = "popops::Fill"
IOTA = "popops::Iota"
SELECT = "popops::Select"
SCALED_ADD = "popops::ScaledAdd"
CAST = "popops::Cast"
CAST_STOCHASTIC_ROUND = "popops::CastStochasticRound"

REDUCE = "popops::Reduce"  # vertex(REDUCE, kind): add, max, min, or, argmax ...
REDUCE_PARTIAL = "popops::ReducePartial"
SCAN = "popops::Scan"
SCAN_FOLD = "popops::ScanFold"
POOL = "popops::Pool"
SELECT_AND_SCATTER = "popops::SelectAndScatter"
SELECT_AND_GATHER = "popops::SelectAndGather"

DYNAMIC_SLICE = "popops::DynamicSlice"
DYNAMIC_UPDATE_SLICE = "popops::DynamicUpdateSlice"
MULTI_SLICE = "popops::MultiSlice"
MULTI_UPDATE = "popops::MultiUpdate"
MULTI_UPDATE_OP = "popops::MultiUpdateOp"  # vertex(MULTI_UPDATE_OP, "add") ...
SORT = "popops::Sort"
SORT_MERGE = "popops::SortMerge"
TOP_K = "popops::TopK"

DOT = "poplin::Dot"
MATMUL_BLOCK = "poplin::MatMulBlock"  # vertex(MATMUL_BLOCK, in dtype, partials dtype)
# vertex(REDUCE_ADD, acc, out): adds a matmul's partials, and what a reduce-scatter receives.
REDUCE_ADD = "poplin::ReduceAdd"
CONV_PARTIAL = "poplin::ConvPartial"

# Dense linear algebra (lowering/rules/linalg.py): the algorithm each problem's vertex runs.
CHOLESKY = "poplin::Cholesky"
CHOLESKY_UPDATE = "poplin::CholeskyUpdate"
TRIANGULAR_SOLVE = "poplin::TriangularSolve"
LU = "poplin::LU"
LU_PIVOTS_TO_PERMUTATION = "poplin::LuPivotsToPermutation"
HOUSEHOLDER_QR = "poplin::HouseholderQR"
GEQRF = "poplin::Geqrf"
GEQP3 = "poplin::Geqp3"
HOUSEHOLDER_PRODUCT = "poplin::HouseholderProduct"
ORMQR = "poplin::Ormqr"
JACOBI_EIGH = "poplin::JacobiEigh"
JACOBI_SVD = "poplin::JacobiSVD"
HESSENBERG_QR_EIG = "poplin::HessenbergQREig"
SCHUR = "poplin::Schur"
HESSENBERG = "poplin::Hessenberg"
TRIDIAGONAL = "poplin::Tridiagonal"
TRIDIAGONAL_SOLVE = "poplin::TridiagonalSolve"
SYMMETRIC_PRODUCT = "poplin::SymmetricProduct"

# popsparse: vertex(SPARSE_DENSE_*, dtype, partials dtype).
SPARSE_DENSE_ELEMENTWISE = "popsparse::SparseDenseMatMulElementWise"
SPARSE_DENSE_BLOCK = "popsparse::SparseDenseMatMulBlock"
# popsparse::static_'s own vertices, vertex(STATIC_SPARSE_DENSE_*, dtype, partials dtype)
# (poplibs lib/popsparse/StaticMatMul.cpp:705-717).
STATIC_SPARSE_DENSE_ELEMENTWISE = "popsparse::StaticSparseDenseElementWise"
STATIC_SPARSE_DENSE_BLOCK = "popsparse::StaticSparseDenseMatMulBlock"

RANDOM = "poprand::Random"  # vertex(RANDOM, generator)
# poprand's samplers, vertex(POPRAND_*, dtype): a fused chain on the tiles'
# hardware bits priced as the one vertex poprand runs (lowering/fused_cost.py).
POPRAND_UNIFORM = "poprand::Uniform"
POPRAND_BERNOULLI = "poprand::Bernoulli"
POPRAND_NORMAL = "poprand::Normal"
POPRAND_TRUNCATED_NORMAL = "poprand::TruncatedNormal"
POPRAND_DROPOUT = "poprand::Dropout"

FFT = "ipu_jax::FFT"
AXIS_INDEX = "ipu_jax::AxisIndex"
REPLICA_INDEX = "ipu_jax::ReplicaIndex"


def vertex(name: str, *template_args) -> str:
  """A template instance: ``vertex(FILL, "int") == "popops::Fill<int>"``.

  Arguments may be strings or anything with a ``name`` (NumPy dtypes, enums).
  """
  if not template_args:
    return name
  args = ",".join(a if isinstance(a, str) else str(getattr(a, "name", a))
                  for a in template_args)
  return f"{name}<{args}>"


def identity(codelet) -> str:
  """The key code memory is charged by: a vertex type name or a ``Codelet``'s name.

  Raises:
    TypeError: for anything else, naming what was given.
  """
  if isinstance(codelet, str):
    return codelet
  name = getattr(codelet, "name", None)
  if isinstance(name, str) and callable(getattr(codelet, "fn", None)):
    return name
  raise TypeError(f"a step's codelets must be vertex type names (kernels.vocabulary) or "
                  f"Codelet objects; got {codelet!r}.")
