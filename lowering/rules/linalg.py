"""Dense linear algebra: ``jnp.linalg``, ``jax.scipy.linalg`` and ``lax.linalg``.

Primitives: ``cholesky``, ``cholesky_update``, ``triangular_solve``, ``lu``,
``lu_pivots_to_permutation``, ``qr``, ``geqrf``, ``geqp3``,
``householder_product``, ``ormqr``, ``eigh``, ``svd``, ``eig``, ``schur``,
``hessenberg``, ``tridiagonal``, ``tridiagonal_solve``,
``symmetric_product``, and ``custom_linear_solve`` (what ``jnp.linalg.solve``
and ``inv`` wrap their LU solve in).

Tile plan. The batch axes of a linear-algebra primitive (every axis before its
matrix axes; all operands and results share them) number independent
problems, laid out by :func:`ipu_jax.lowering.problems.solve_problems`:
problems are cut into equal consecutive groups, one group per tile (linear
over the batch, so a batch that does not divide the tile count leaves the last
tile short); each operand is exchanged to the tiles of its problems, where one
vertex per problem solves it and writes the results in place. The vertex body
calls the same ``jax.lax.linalg`` primitive on the tile's local batch, so the
numbers equal ``jax.jit``'s to rounding. Each vertex is costed by the flops of
the algorithm the IPU would run (Cholesky, forward/back substitution,
right-looking LU with partial pivoting, Householder QR, cyclic Jacobi for
``eigh``, one-sided Jacobi for ``svd``...) at the tile's fp32 rate shared by
its workers (:mod:`ipu_jax.kernels.linalg`); QR, the eigensolvers and SVD
also hold a working copy of their matrix as scratch.

A single matrix is one problem on one tile: when its operands, results and
scratch do not fit in the tile's memory, the normal memory check raises
:class:`~ipu_jax.OutOfMemoryError` naming the tile. Tile-parallel blocked
factorisations of one matrix over many tiles (poplin's blocked Cholesky, a
tile-parallel Jacobi sweep) are out of scope here.

``eigh`` and ``svd`` with ``algorithm=JACOBI`` are accepted (it is the
algorithm costed) and computed by the host's default routine (eigenvectors
and singular vectors may differ from a Jacobi solver's in sign); modes that
``jax.jit`` on CPU rejects too (QDWH and polar algorithms, a partial
``subset_by_index``, half-precision operands of the LAPACK-backed
primitives) raise a :class:`~ipu_jax.LoweringError` naming the primitive and
the user's line. ``triangular_solve``, ``cholesky_update`` and
``symmetric_product`` take float16 and bfloat16 as ``jax.jit`` does (XLA
expands the solve in the operands' type; the vertex binds the same
primitive, so the bits are ``jax.jit``'s); they are costed at the fp32 rate
(the substitution is scalar work, which the IPU does at the same rate in
either width).

``custom_linear_solve`` lowers its ``solve`` jaxpr in place (its value; the
other jaxprs only define its derivatives, which JAX has already expanded into
the traced program).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from ipu_jax.lowering.jax_compat import control_flow, lax_linalg
from ipu_jax.kernels import linalg as K
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.lower import lower_closed_jaxpr
from ipu_jax.lowering.problems import solve_problems
from ipu_jax.lowering.registry import register_lowering

__all__ = ["LinalgSpec", "SPECS"]

_SUPPORTED_DTYPES = ("float32", "float64", "complex64", "complex128")
# 2-byte floats: jax.jit on CPU runs the primitives XLA expands itself
# (triangular_solve) or JAX writes as lax operations (cholesky_update,
# symmetric_product) in the operands' own type; the LAPACK-backed ones have
# no such routine and jax.jit refuses them too.
_HALF_DTYPES = ("float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LinalgSpec:
  """How a linear-algebra primitive is planned and costed.

  Attributes:
    core_ndim: trailing (non-batch) axes of the first operand.
    flops: ``flops(cores, params) -> real flops of one real problem``, where
      ``cores`` are the operands' non-batch shapes.
    steps: ``steps(cores, params) -> sequential steps of one problem``.
    workspace: matrices' worth of scratch per problem (a working copy of the
      first operand), besides operands and results.
    check: ``check(cores, params)`` raises ``NotImplementedError`` for modes
      the IPU lowering (and XLA on CPU) cannot run.
    host_params: ``host_params(params) -> params`` the vertex body binds.
    codelet: vertex type name for reports.
    float_operands: positions of the operands that must be float32/complex64
      (pivots and permutations are int32).
    half: float16 and bfloat16 operands are accepted too (computed in their
      own type, as ``jax.jit`` computes them).
  """

  core_ndim: int
  flops: Callable
  steps: Callable
  codelet: str
  workspace: int = 0
  check: Optional[Callable] = None
  host_params: Optional[Callable] = None
  float_operands: tuple = (0,)
  half: bool = False


def _check_dtypes(ctx, operands, spec: LinalgSpec):
  supported = _SUPPORTED_DTYPES + (_HALF_DTYPES if spec.half else ())
  for i in spec.float_operands:
    if i >= len(operands):
      continue
    dtype = np.dtype(operands[i].dtype)
    if dtype.name not in supported:
      raise NotImplementedError(
          f"operand {i} has dtype {dtype.name}; {ctx.op} runs on "
          f"{', '.join(supported)} (the 64-bit types with jax_enable_x64), as jax.jit "
          f"does on CPU (LAPACK has no {dtype.name} routine for it). Cast it, e.g. "
          f"x.astype(jnp.float32)")


def _rule(primitive, spec: LinalgSpec):
  def rule(ctx: RuleContext, *operands, **params):
    _check_dtypes(ctx, operands, spec)
    batch_ndim = len(operands[0].shape) - spec.core_ndim
    cores = [tuple(t.shape[batch_ndim:]) for t in operands]
    if spec.check is not None:
      spec.check(cores, params)
    scale = max(K.complex_factor(t.dtype) for t in operands)
    flops = float(spec.flops(cores, params)) * scale
    bind = spec.host_params(params) if spec.host_params else params

    def fn(*xs):
      if batch_ndim == 0:
        # One problem: the vertex runs the user's unbatched primitive (some,
        # like cholesky_update, take no batch axes).
        results = primitive.bind(*[x[0] for x in xs], **bind)
        if primitive.multiple_results:
          return [r[None] for r in results]
        return results[None]
      return primitive.bind(*xs, **bind)

    axes = tuple(range(batch_ndim))
    out_avals = [(a.shape, a.dtype) for a in ctx.out_avals]
    matrix_bytes = int(np.prod(cores[0], dtype=np.int64)) * operands[0].itemsize
    return solve_problems(
        ctx, fn, operands, out_avals, batch_axes=[axes] * len(operands),
        out_batch_axes=[axes] * len(out_avals), flops=flops,
        steps=int(spec.steps(cores, params)), workspace_bytes=spec.workspace * matrix_bytes,
        codelet=spec.codelet)
  return rule


# -- mode checks ---------------------------------------------------------------


def _full_subset(subset, k) -> bool:
  return subset is None or tuple(int(v) for v in subset) == (0, k)


def _check_eigh(cores, params):
  n = cores[0][-1]
  if not _full_subset(params.get("subset_by_index"), n):
    raise NotImplementedError(
        f"subset_by_index={params['subset_by_index']} (a subset of the eigenpairs) is not "
        f"supported; compute all {n} and slice")
  algorithm = params.get("algorithm")
  if algorithm is not None and algorithm.name not in ("QR", "JACOBI"):
    raise NotImplementedError(
        f"algorithm={algorithm} is not supported; valid: None, EighImplementation.QR, "
        f"EighImplementation.JACOBI")


def _host_algorithm(params):
  """Jacobi is the algorithm costed; the vertex computes with the host's default."""
  algorithm = params.get("algorithm")
  if algorithm is not None and algorithm.name == "JACOBI":
    return dict(params, algorithm=None)
  return params


def _check_svd(cores, params):
  m, n = cores[0][-2:]
  if not _full_subset(params.get("subset_by_index"), min(m, n)):
    raise NotImplementedError(
        f"subset_by_index={params['subset_by_index']} (a subset of the singular values) is "
        f"not supported; compute all {min(m, n)} and slice")
  algorithm = params.get("algorithm")
  if algorithm is not None and algorithm.name not in ("DEFAULT", "QR", "JACOBI",
                                                      "DIVIDE_AND_CONQUER"):
    raise NotImplementedError(
        f"algorithm={algorithm} is not supported; valid: None, SvdAlgorithm.DEFAULT, "
        f"SvdAlgorithm.QR, SvdAlgorithm.JACOBI, SvdAlgorithm.DIVIDE_AND_CONQUER")


# -- costs ---------------------------------------------------------------------


def _tri_solve_flops(cores, params):
  m = cores[0][-1]
  b = cores[1]
  k = b[-1] if params["left_side"] else b[-2]
  return K.triangular_solve_flops(m, k)


def _qr_flops(cores, params):
  m, n = cores[0][-2:]
  k = min(m, n)
  q_columns = m if params.get("full_matrices") else k
  return K.qr_flops(m, n) + K.form_q_flops(m, q_columns, k)


def _svd_steps(cores, params):
  k = min(cores[0][-2:])
  return max(1, K.jacobi_sweeps(k) * max(k - 1, 1))


def _eig_flops(cores, params):
  n = cores[0][-1]
  vectors = params.get("compute_left_eigenvectors") or params.get("compute_right_eigenvectors")
  return K.schur_flops(n, bool(vectors))


def _ormqr_flops(cores, params):
  # Applying k reflectors of length m to an m x n (left) matrix.
  k = cores[1][-1]
  c_rows, c_cols = cores[2][-2:]
  return 4.0 * c_rows * c_cols * k


SPECS = {
    lax_linalg.cholesky_p: LinalgSpec(
        2, lambda c, p: K.cholesky_flops(c[0][-1]), lambda c, p: c[0][-1],
        vocab.CHOLESKY),
    lax_linalg.cholesky_update_p: LinalgSpec(
        2, lambda c, p: 6.0 * c[0][-1] ** 2, lambda c, p: c[0][-1],
        vocab.CHOLESKY_UPDATE, float_operands=(0, 1), half=True),
    lax_linalg.triangular_solve_p: LinalgSpec(
        2, _tri_solve_flops, lambda c, p: c[0][-1], vocab.TRIANGULAR_SOLVE,
        float_operands=(0, 1), half=True),
    lax_linalg.lu_p: LinalgSpec(
        2, lambda c, p: K.lu_flops(*c[0][-2:]), lambda c, p: min(c[0][-2:]), vocab.LU),
    lax_linalg.lu_pivots_to_permutation_p: LinalgSpec(
        1, lambda c, p: p["permutation_size"] + 2 * c[0][-1], lambda c, p: c[0][-1],
        vocab.LU_PIVOTS_TO_PERMUTATION, float_operands=()),
    lax_linalg.qr_p: LinalgSpec(
        2, _qr_flops, lambda c, p: min(c[0][-2:]), vocab.HOUSEHOLDER_QR, workspace=1),
    lax_linalg.geqrf_p: LinalgSpec(
        2, lambda c, p: K.qr_flops(*c[0][-2:]), lambda c, p: min(c[0][-2:]),
        vocab.GEQRF),
    lax_linalg.geqp3_p: LinalgSpec(
        2, lambda c, p: K.qr_flops(*c[0][-2:]) + 4.0 * c[0][-2] * c[0][-1],
        lambda c, p: min(c[0][-2:]), vocab.GEQP3),
    lax_linalg.householder_product_p: LinalgSpec(
        2, lambda c, p: K.form_q_flops(c[0][-2], c[0][-1], c[1][-1]),
        lambda c, p: c[1][-1], vocab.HOUSEHOLDER_PRODUCT, float_operands=(0, 1)),
    lax_linalg.ormqr_p: LinalgSpec(
        2, _ormqr_flops, lambda c, p: c[1][-1], vocab.ORMQR, float_operands=(0, 1, 2)),
    lax_linalg.eigh_p: LinalgSpec(
        2, lambda c, p: K.eigh_flops(c[0][-1]),
        lambda c, p: max(1, K.jacobi_sweeps(c[0][-1]) * max(c[0][-1] - 1, 1)),
        vocab.JACOBI_EIGH, workspace=1, check=_check_eigh, host_params=_host_algorithm),
    lax_linalg.svd_p: LinalgSpec(
        2, lambda c, p: K.svd_flops(*c[0][-2:], compute_uv=p.get("compute_uv", True)),
        _svd_steps, vocab.JACOBI_SVD, workspace=1, check=_check_svd,
        host_params=_host_algorithm),
    lax_linalg.eig_p: LinalgSpec(
        2, _eig_flops, lambda c, p: c[0][-1], vocab.HESSENBERG_QR_EIG, workspace=1),
    lax_linalg.schur_p: LinalgSpec(
        2, lambda c, p: K.schur_flops(c[0][-1], p.get("compute_schur_vectors", True)),
        lambda c, p: c[0][-1], vocab.SCHUR, workspace=1),
    lax_linalg.hessenberg_p: LinalgSpec(
        2, lambda c, p: K.hessenberg_flops(c[0][-1]), lambda c, p: c[0][-1],
        vocab.HESSENBERG),
    lax_linalg.tridiagonal_p: LinalgSpec(
        2, lambda c, p: K.tridiagonal_flops(c[0][-1]), lambda c, p: c[0][-1],
        vocab.TRIDIAGONAL),
    lax_linalg.tridiagonal_solve_p: LinalgSpec(
        1, lambda c, p: 3.0 * c[0][-1] + 5.0 * c[3][-2] * c[3][-1], lambda c, p: c[0][-1],
        vocab.TRIDIAGONAL_SOLVE, float_operands=(0, 1, 2, 3)),
    lax_linalg.symmetric_product_p: LinalgSpec(
        2, lambda c, p: float(c[0][-2]) ** 2 * c[0][-1] + 2.0 * c[1][-1] ** 2,
        lambda c, p: 1, vocab.SYMMETRIC_PRODUCT, float_operands=(0, 1), half=True),
}


def _custom_linear_solve(ctx: RuleContext, *operands, const_lengths, jaxprs, **params):
  """The value of a linear solve: its ``solve`` jaxpr, lowered in place."""
  del params
  counts = [const_lengths.matvec, const_lengths.vecmat, const_lengths.solve,
            const_lengths.transpose_solve]
  offsets = np.cumsum([0] + counts)
  solve_consts = operands[offsets[2]:offsets[3]]
  b = operands[offsets[4]:]
  return lower_closed_jaxpr(ctx.module, jaxprs.solve, list(solve_consts) + list(b))


def _register():
  for primitive, spec in SPECS.items():
    register_lowering(primitive, _rule(primitive, spec))
  register_lowering(control_flow.linear_solve_p, _custom_linear_solve)


_register()
