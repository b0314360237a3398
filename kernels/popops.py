"""Cycles of popops' vertices, from poplibs' published estimators.

Elementwise operations, casts, fills, scaled adds and dynamic slices follow
the structure and constants of poplibs' cycle estimators
(``lib/popops/popopsCycleEstimators.cpp`` and
``lib/popops/PerformanceEstimation.cpp``); reductions are in
:mod:`ipu_jax.kernels.reduce`. Each function takes ``[num_tiles]`` arrays of
per-tile work and returns ``[num_tiles]`` float64 cycles (0 where a tile has
no work).

Elementwise (``UnaryOp1D`` / ``BinaryOp1D``)
-------------------------------------------

For the common unary and binary operations on fp16 and fp32, the cost of a
tile follows the structure and per-operation figures of poplibs'
``UnaryOp1D`` / ``BinaryOp1D`` supervisor-vertex estimators
(``lib/popops/popopsCycleEstimators.{hpp,cpp}``, ``unaryOpPerfInfo`` and
``binaryOpPerfInfo``; Graphcore benchmarked or simulated each entry):

* the elements are split evenly over the worker contexts; each worker pays a
  fixed entry cost (unary 17 cycles, 33 for ``exp``; binary 29 for fp32, 26
  otherwise) plus its inner loop;
* the inner loop is either vectorised at the natural width (64 bits: 4 fp16
  or 2 fp32 per vector; per vector the table's cycles plus a load/store and
  loop overhead: 4 for unary ops, 2 for the binary ops with assembly codelets
  and 5 for the others), or unrolled by the table's factor at the table's
  cycles per unrolled group;
* the tile pays ``workers x worker cycles`` plus the supervisor's overhead
  (11 cycles, and 9 more for unary ops).

Operations or types not in the table keep the generic model of
``estimators.worker_split_cycles``; :func:`popops_elementwise_cycles` returns
``None`` for them.

Fused elementwise chains
------------------------

:func:`scaled_arithmetic_cycles` is poplibs' ScaledAdd / ScaledSubtract /
aXPlusbY / aXMinusbY supervisor estimate; :func:`map_expression_cycles` the
loop of a generated map codelet (``lib/popops/ExpressionGenerator.cpp``), fed
by :func:`map_member_element_cycles` (the tables above without the loads and
stores) and :func:`elementwise_overheads` (their fixed parts).
``lowering/fused_cost.py`` recognises the patterns and composes a chain's cost;
each figure's source is in ``ipu_jax.kernels.cost_model.FIGURE_SOURCES``
(``kernels.popops.*``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["UNARY", "BINARY", "popops_elementwise_cycles", "cast_cycles", "fill_cycles",
           "fill_vertex_cycles", "scaled_add_cycles", "scaled_arithmetic_cycles",
           "SCALED_OPERATIONS", "map_expression_cycles", "map_member_element_cycles",
           "map_vectorisable", "elementwise_overheads", "dynamic_slice_cycles",
           "NONLINEARITY", "nonlinearity_cycles", "BROADCAST_SCALAR",
           "broadcast_scalar_cycles"]

# (cycles per loop, natural vector width?, unroll factor) by op and width
# (2: fp16, 4: fp32), after poplibs' unaryOpPerfInfo / binaryOpPerfInfo.
UNARY = {
    "exp": {2: (4, False, 4), 4: (6, False, 2)},
    "exp2": {2: (4, False, 4), 4: (6, False, 2)},
    "log": {2: (4, False, 4), 4: (12, False, 2)},
    "tanh": {2: (4, False, 4), 4: (12, False, 2)},
    "logistic": {2: (6, False, 4), 4: (12, False, 2)},
    "sqrt": {2: (23, False, 4), 4: (10, False, 2)},
    "rsqrt": {2: (19, False, 4), 4: (8, False, 2)},
    "neg": {2: (2, False, 4), 4: (2, False, 2)},
    "abs": {2: (1, False, 0), 4: (1, False, 0)},
    "floor": {2: (2, True, 0), 4: (2, True, 0)},
    "ceil": {2: (2, True, 0), 4: (2, True, 0)},
    "round": {2: (2, True, 0), 4: (2, True, 0)},
    "sign": {2: (5, True, 0), 4: (5, True, 0)},
    "erf": {2: (13, False, 1), 4: (41, False, 1)},
    "expm1": {2: (5, True, 0), 4: (4, False, 0)},
    "log1p": {2: (18, True, 0), 4: (18, True, 0)},
}
BINARY = {
    "add": {2: (1, True, 0), 4: (1, True, 0)},
    "sub": {2: (1, True, 0), 4: (1, True, 0)},
    "mul": {2: (1, True, 0), 4: (1, True, 0)},
    "div": {2: (21, False, 4), 4: (10, False, 2)},
    "max": {2: (4, False, 4), 4: (3, False, 2)},
    "min": {2: (4, False, 4), 4: (3, False, 2)},
}
# Binary ops with hand-written assembly codelets: a cheaper loop overhead.
_ASSEMBLY_BINARY = ("add", "sub", "mul")
_SUPERVISOR = 11
_UNARY_SUPERVISOR_EXTRA = 9


def _inner_unary(n, entry, vector):
  cycles, natural, unroll = entry
  if not natural and unroll > 0:
    return -(-n // unroll) * cycles
  width = vector if natural else 1
  return -(-n // width) * (cycles + 4)


def _inner_binary(op, n, entry, vector):
  cycles, natural, unroll = entry
  if natural:
    overhead = 2 if op in _ASSEMBLY_BINARY else 5
    return -(-n // vector) * (cycles + overhead)
  return -(-n // max(unroll, 1)) * cycles


def popops_elementwise_cycles(target, elements, op_name: str, dtype):
  """Tile cycles of popops' vertex for ``op_name`` on ``elements`` per tile.

  Args:
    target: the IPU target (worker contexts, vector width).
    elements: ``[num_tiles]`` elements each tile computes.
    op_name: the JAX primitive name (``"add"``, ``"exp"``...).
    dtype: the element type.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has no elements), or
    ``None`` when the operation or type has no poplibs figure here.
  """
  dtype = np.dtype(dtype)
  if dtype.kind != "f" or dtype.itemsize not in (2, 4):
    return None
  if op_name in NONLINEARITY:
    return nonlinearity_cycles(target, elements, op_name, dtype)
  width = dtype.itemsize
  if op_name in UNARY:
    entry, unary = UNARY[op_name][width], True
  elif op_name in BINARY:
    entry, unary = BINARY[op_name][width], False
  else:
    return None
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  per_worker = -(-elements // w)
  vector = max(1, target.vector_width_bytes // width)
  if unary:
    start = 33 if op_name == "exp" else 17
    worker = start + _inner_unary(per_worker, entry, vector)
    cycles = w * worker + _SUPERVISOR + _UNARY_SUPERVISOR_EXTRA
  else:
    start = 29 if width == 4 else 26
    worker = start + _inner_binary(op_name, per_worker, entry, vector)
    cycles = w * worker + _SUPERVISOR
  return np.where(elements > 0, cycles, 0).astype(np.float64)


# popnn's non-linearity vertices (NonLinearity1DInPlace forward, NonLinearityGrad1D
# backward): cycles per operation by element width, from getNonLinearityOpCycles /
# getNonLinearityGradOpCycles in poplibs' lib/popnn/PerformanceEstimation.hpp (the
# same figure for a scalar and a 64-bit vector step: GELU 5 half, 10 float).
NONLINEARITY = {
    "gelu": {2: 5, 4: 10},
    "gelu_grad": {2: 5, 4: 10},
}
_NL_SUPERVISOR = 9


def nonlinearity_cycles(target, elements, op_name: str, dtype):
  """Tile cycles of popnn's non-linearity vertex for ``op_name`` on ``elements`` per tile.

  ``"gelu"``: ``nonLinearity1DCycleEstimator`` (NonLinearity1DInPlace, ONE_PTR
  data) and ``"gelu_grad"``: the ``NonLinearityGrad1D`` estimator, both in
  poplibs' ``lib/popnn/popnnCycleEstimators.cpp``: 9 supervisor cycles plus
  every worker's (the longest worker's vectors, 64-bit each, the remainder's
  32/16-bit steps) times the worker contexts.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has none), or ``None`` for
    an operation or type popnn has no figure for.
  """
  dtype = np.dtype(dtype)
  if op_name not in NONLINEARITY or dtype.kind != "f" or dtype.itemsize not in (2, 4):
    return None
  op = NONLINEARITY[op_name][dtype.itemsize]
  n = np.asarray(elements, np.int64)
  w = target.worker_contexts
  vector = max(1, _datapath_bytes(target) // dtype.itemsize)
  vectors, rem = n // vector, n % vector
  per_worker = -(-vectors // w)
  busy = per_worker > 0
  half = dtype.itemsize == 2
  if op_name == "gelu":
    # pointers and size 3, split 5, worker id 2, alignment 2, remainders 5, offsets 3
    worker = 20 + busy * (2 + op + (per_worker - 1) * op + 1 + op)
    if half:
      worker = worker + 4 + (rem & 2 > 0) * (2 + op) + (rem & 1) * (3 + op)
    else:
      worker = worker + 3 + (rem & 1) * (2 + op)
  else:
    # state 3, split 5, worker id 2, remaining vectors 3, offsets 3, pre-load 3, branch 1
    worker = 20 + busy * (4 + (per_worker - 1) * op + 1)
    if half:
      worker = worker + 6 + (rem & 2 > 0) * (op + 2) + (rem & 1) * (op + 4)
    else:
      worker = worker + 4 + (rem & 1) * (op + 1)
  cycles = _NL_SUPERVISOR + w * worker
  return np.where(n > 0, cycles, 0).astype(np.float64)


# -- helpers --------------------------------------------------------------------


def _ceil_div(a, b):
  return -(-np.asarray(a, np.int64) // b)


def _datapath_bytes(target) -> int:
  # poplar's Target::getDataPathWidth is 64 bits: a worker loads one 64-bit
  # word a cycle, the figure the presets call vector_width_bytes.
  return int(target.vector_width_bytes)


def _is_fp8(dtype) -> bool:
  return np.dtype(dtype).name.startswith("float8")


def _is_float(dtype) -> bool:
  """fp16/bf16/fp32 (and FP8): the types the IPU's float pipeline converts."""
  dtype = np.dtype(dtype)
  return (dtype.kind == "f" and dtype.itemsize in (2, 4)) or _is_fp8(dtype) or \
      dtype.name == "bfloat16"


# -- Cast1D ---------------------------------------------------------------------


def _atom_loop(n, atom, fill_drain, per_loop, rem1, rem2, rem3):
  """poplibs' 8-bit cast loops: a pipelined loop over atoms, then 0-3 left over."""
  atoms = n // atom
  cycles = np.where(atoms > 0, fill_drain + (atoms - 1) * per_loop, 0)
  rem = n % atom
  tail = np.select([rem == 0, rem == 1, rem == 2, rem == 3], [2, rem1, rem2, rem3],
                   rem1 * rem)
  return cycles + tail


def _cast_worker_cycles(target, n, src, dst):
  """One worker's cast of ``n`` elements (poplibs' castWorkerCycles)."""
  n = np.asarray(n, np.int64)
  if dst.kind in "iu" and dst.itemsize == 8:
    per_element = 4 + int(src.kind in "iu" and src.itemsize <= 4)
    return 3 + n * per_element
  src8, dst8 = src.itemsize == 1 and not _is_fp8(src), dst.itemsize == 1 and not _is_fp8(dst)
  if src8 and dst.itemsize == 2 and _is_float(dst):          # char -> half
    return 4 + _atom_loop(n, 4, 14, 9, 12, 14, 22)
  if src.itemsize == 2 and _is_float(src) and dst8:          # half -> char (clamped)
    return 4 + 4 + _atom_loop(n, 4, 19, 16, 14, 21, 29)
  if _is_fp8(src) and dst8:
    return 4 + _atom_loop(n, 8, 0, 28, 5, 5, 5)
  if src8 and _is_fp8(dst):
    return 4 + _atom_loop(n, 8, 0, 37, 7, 7, 7)
  if _is_fp8(src) and _is_fp8(dst):
    return 4 + _atom_loop(n, 8, 0, 13, 5, 5, 5)
  path = _datapath_bytes(target)
  load = max(1, path // src.itemsize)      # elements of one 64-bit load
  store = max(1, path // dst.itemsize)     # elements of one 64-bit store
  # Float <-> float conversions run on the auxiliary pipeline, two 64-bit
  # reads and one 64-bit write a cycle; the others are C++ (one element a
  # time, one cycle more): poplibs' own rough guess for them.
  aux = _is_float(src) and _is_float(dst)
  width = min(2 * load, store) if aux else 1
  per_vector = max(width // min(width, load), width // min(width, store)) + int(not aux)
  cycles = 19 + per_vector * (n // width)
  rem = n % width
  bit = 1
  while bit < width:                       # remainder checks: ceil(log2(width)) bits
    cycles = cycles + 1 + 2 * ((rem & bit) > 0)
    bit <<= 1
  return cycles


def cast_cycles(target, elements, src_dtype, dst_dtype) -> np.ndarray:
  """Tile cycles of popops' ``Cast1D`` vertex converting ``elements`` per tile.

  The elements are split evenly over the worker contexts; each worker pays
  poplibs' per-worker cast cycles plus 18, the supervisor 12
  (``getCast1DCycleEstimate``). fp32 -> fp16 converts 4 elements per 2 cycles,
  fp16 -> fp32 2 per cycle, integer conversions one element per 2 cycles.
  """
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  worker = _cast_worker_cycles(target, _ceil_div(elements, w), np.dtype(src_dtype),
                               np.dtype(dst_dtype))
  return np.where(elements > 0, 12 + w * (worker + 18), 0).astype(np.float64)


# -- Fill -----------------------------------------------------------------------


def fill_vertex_cycles(target, n, itemsize):
  """poplibs' ``Fill`` vertex (one worker) writing ``n`` elements of ``itemsize``."""
  n = np.asarray(n, np.int64)
  if itemsize == 8:
    return 5 + n
  if itemsize == 1:
    return np.where(n < 64, 28 + n // 4, 39 + n // 8)
  width = _datapath_bytes(target) // itemsize
  if itemsize == 2:
    return np.select([n == 1, n == 2], [15, 21], 26 + n // width)
  return 16 + n // width + 6 + (n % width == 1) + 1


def fill_cycles(target, elements, itemsize) -> np.ndarray:
  """Tile cycles of filling ``elements`` per tile with a constant (``popops::fill``/``zero``).

  poplibs splits a tile's regions between its workers, one ``Fill`` vertex
  each; the tile pays the busiest worker times the contexts plus the
  compute set's launch (``supervisor_overhead_cycles``).
  """
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  worker = fill_vertex_cycles(target, _ceil_div(elements, w), int(itemsize))
  cycles = w * worker + target.supervisor_overhead_cycles
  return np.where(elements > 0, cycles, 0).astype(np.float64)


# -- BroadcastScalar2D: an operand with one scalar per region ----------------

# (cycles per loop, natural vector width?, unroll factor) by op and width, after
# poplibs' broadcastOpPerfInfo (lib/popops/popopsCycleEstimators.hpp).
BROADCAST_SCALAR = {
    "add": {2: (1, True, 0), 4: (1, True, 0)},
    "sub": {2: (1, True, 0), 4: (1, True, 0)},
    "mul": {2: (1, True, 0), 4: (1, True, 0)},
    "div": {2: (8, False, 2), 4: (6, False, 2)},
    "max": {2: (3, False, 4), 4: (3, False, 2)},
    "min": {2: (3, False, 4), 4: (3, False, 2)},
}
# broadcastArithmetic{1D,}CycleEstimate: the vertex's entry, each region's cost
# outside its loop (2D), and the per-vector load/store and loop overhead: 1 for
# the assembly codelets (add, sub, mul) in the 1D MultiVertex, 4 otherwise and
# in the 2D vertex whose scalar changes from region to region.
_BSCALAR_ENTRY = 20
_BSCALAR_PER_REGION = 28
_BSCALAR_LOOP_OVERHEAD = 4


def _bscalar_loop(target, op_name, dtype, one_d: bool) -> tuple:
  """``(elements per loop, cycles per loop)`` of a BroadcastScalar vertex."""
  cycles_per_loop, natural, unroll = BROADCAST_SCALAR[op_name][dtype.itemsize]
  if not natural:
    return unroll, cycles_per_loop
  overhead = 1 if one_d and op_name in _ASSEMBLY_BINARY else _BSCALAR_LOOP_OVERHEAD
  return max(1, target.vector_width_bytes // dtype.itemsize), cycles_per_loop + overhead


def broadcast_scalar_cycles(target, region_tiles, region_sizes, region_counts,
                            op_name: str, dtype):
  """Tile cycles of popops' BroadcastScalar vertices (``A op B``, one scalar ``B`` per region).

  popops' ``binaryOpBroadcastScalar`` (``lib/popops/ElementWise.cpp``) takes
  per tile the cheaper of two plans by poplibs' own estimators
  (``lib/popops/popopsCycleEstimators.cpp``):

  * ``BroadcastScalar1D``, one MultiVertex per region of ``n`` elements:
    ``workers * (20 + ceil(ceil(n / workers) / vector) * (loop + 1)) + 11``
    (``broadcastArithmetic1DCycleEstimate``, ``basicOpSupervisorOverhead``);
  * ``BroadcastScalar2D`` worker vertices over the regions split between the
    workers (``splitRegionsBetweenWorkers``): the busiest worker pays
    ``20 + sum over its regions (ceil(n / vector) * (loop + 4) + 28)``
    (``broadcastArithmeticCycleEstimate``), times the contexts. Here each
    worker takes an equal share of the elements, and a share of
    ``E / workers`` contiguous elements crosses ``ceil((R - 1) / workers)``
    region boundaries (an estimate of the split).

  Args:
    target: the IPU target (worker contexts, vector width).
    region_tiles, region_sizes, region_counts: ``[k]`` arrays: ``count``
      regions of ``size`` elements on ``tile``.
    op_name: the JAX primitive name.
    dtype: the element type.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has none), or ``None`` when
    poplibs has no BroadcastScalar figure for the operation or type.
  """
  dtype = np.dtype(dtype)
  if dtype.kind != "f" or dtype.itemsize not in (2, 4) or op_name not in BROADCAST_SCALAR:
    return None
  t, w = target.num_tiles, target.worker_contexts
  tiles = np.asarray(region_tiles, np.int64)
  sizes = np.asarray(region_sizes, np.int64)
  counts = np.asarray(region_counts, np.int64)
  per_loop, cycles_per_loop = _bscalar_loop(target, op_name, dtype, one_d=True)
  one_region = (w * (_BSCALAR_ENTRY + _ceil_div(_ceil_div(sizes, w), per_loop)
                     * cycles_per_loop) + _SUPERVISOR)
  one_d = np.bincount(tiles, weights=counts * one_region, minlength=t)[:t]
  elements = np.bincount(tiles, weights=counts * sizes, minlength=t)[:t].astype(np.int64)
  regions = np.bincount(tiles, weights=counts, minlength=t)[:t].astype(np.int64)
  per_loop, cycles_per_loop = _bscalar_loop(target, op_name, dtype, one_d=False)
  worker_regions = 1 + _ceil_div(np.maximum(regions, 1) - 1, w)
  # Each region of a worker may end in a partial vector.
  loops = _ceil_div(_ceil_div(elements, w), per_loop) + worker_regions - 1
  two_d = w * (_BSCALAR_ENTRY + worker_regions * _BSCALAR_PER_REGION + loops * cycles_per_loop)
  return np.where(elements > 0, np.minimum(one_d, two_d), 0).astype(np.float64)


# -- ScaledAddSupervisor and its family ------------------------------------------

# The operations of poplibs' scaled-arithmetic supervisor vertices
# (``ScaledArithmeticOp``): ScaledAdd ``A + b * B``, ScaledSubtract
# ``A - b * B``, aXPlusbY ``a * A + b * B`` and aXMinusbY ``a * A - b * B``.
SCALED_OPERATIONS = ("add", "subtract", "axplusby", "axminusby")
SCALED_VERTICES = {"add": "ScaledAddSupervisor", "subtract": "ScaledSubtractSupervisor",
                   "axplusby": "aXPlusbYSupervisor", "axminusby": "aXMinusbYSupervisor"}


def scaled_add_cycles(target, elements, dtype, b_dtype=None) -> np.ndarray:
  """Tile cycles of popops' ``ScaledAddSupervisor`` (``A += k * B``) on ``elements``.

  :func:`scaled_arithmetic_cycles` with ``operation="add"``.
  """
  return scaled_arithmetic_cycles(target, elements, dtype, "add", b_dtype)


def scaled_arithmetic_cycles(target, elements, dtype, operation: str = "add",
                             b_dtype=None) -> np.ndarray:
  """Tile cycles of popops' scaled-arithmetic supervisor vertex on ``elements``.

  After ``getScaledArithmeticSupervisorCycleEstimate`` (poplibs
  ``lib/popops/PerformanceEstimation.cpp``) for float data, not
  memory-constrained, with ``ONE_PTR`` operands (no pointer unpacking):
  vectors of the natural width dealt evenly to the workers (15 cycles of
  worker prologue, 6 of loop setup, 3 a vector: 1.5 cycles per float32
  element and 0.75 per float16 one on a tile), the worker holding the
  remainder a few cycles more, and a supervisor part of about 60 cycles
  (``subtract`` 7 more, ``axplusby`` 12 more). Float aXPlusbY / aXMinusbY
  workers have their own prologue (16) and remainder (5). Integer data
  (``add``/``subtract`` only): poplibs' supervisor-only loop (26 cycles per
  3 elements).

  Args:
    target: the IPU target (worker contexts, vector width).
    elements: ``[num_tiles]`` elements of ``A`` per tile.
    dtype: ``A``'s type; ``b_dtype``: ``B``'s (default ``dtype``).
    operation: one of :data:`SCALED_OPERATIONS`.
  """
  if operation not in SCALED_OPERATIONS:
    raise ValueError(f"scaled arithmetic operation {operation!r}: expected one of "
                     f"{SCALED_OPERATIONS}")
  dtype = np.dtype(dtype)
  b_dtype = dtype if b_dtype is None else np.dtype(b_dtype)
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  if dtype.kind in "iu":
    cycles = 53 + 26 * (elements // 3) + np.where(elements % 3 == 0, 6, 6 + 26 * (elements % 3))
    cycles = cycles + 8 + 6 + int(operation == "subtract")
    return np.where(elements > 0, cycles, 0).astype(np.float64)
  width = max(1, _datapath_bytes(target) // dtype.itemsize)
  vectors, rem = elements // width, elements % width
  per_worker, rem_vectors = vectors // w, vectors % w
  supervisor = 21 + 11 + np.where(rem == 0, 7, 13) + 12 + 6
  supervisor = supervisor + {"add": 0, "subtract": 7, "axplusby": 12, "axminusby": 0}[operation]
  if dtype.itemsize == 2 and b_dtype.itemsize == 4:
    # Half data with float B: 5 cycles a vector; the first workers take one
    # remainder vector each, the next one the last elements.
    supervisor = supervisor + int(operation == "subtract")
    def worker(nv):
      return 16 + np.where(nv > 0, 9 + 5 * np.maximum(nv - 1, 0), 0) + 2 + 1
    tail = 1 + np.where(rem > 0, 2 + 5 * (rem >= 2) + 2 + 6 * (rem % 2), 0)
    busiest = np.maximum(np.where(rem_vectors > 0, worker(per_worker + 1), 0),
                         worker(per_worker) + tail)
  elif dtype.itemsize == 4 and operation in ("axplusby", "axminusby"):
    # Float aX + bY: prologue 16, 3 a vector, no remainder-worker check; the
    # worker holding the last float 5 more.
    base = 16 + np.where(per_worker > 0, 6 + 3 * np.maximum(per_worker - 1, 0), 0) + 1
    busiest = base + 1 + np.where(rem > 0, 5, 0)
  else:
    # poplibs counts only the even share of vectors per worker here; the
    # worker whose id equals the count of remainder vectors also does the
    # last elements, so it is the busiest.
    inner = 3 if dtype == b_dtype else 4
    base = 15 + np.where(per_worker > 0, 6 + inner * np.maximum(per_worker - 1, 0), 0) + 2 + 1
    if dtype.itemsize == 4:
      tail = 1 + np.where(rem > 0, 8, 0)
    else:
      tail = 1 + np.where(rem > 0, 5 + np.where(rem >= 2, 7 + 6 * (rem == 3), 0), 0)
    busiest = base + tail
  cycles = supervisor + w * busiest
  return np.where(elements > 0, cycles, 0).astype(np.float64)


# -- Map expressions (fused elementwise codelets) -----------------------------------

# popops' generated map codelets vectorise only when every value is half,
# float or bool, no operand is cast, and every unary operation has a vector
# form (``typeSupportsVectorization``, ``supportsVectorization`` in
# lib/popops/ExpressionGenerator.cpp and ExprOpUtil.cpp). The unary operations
# with no vector form, by JAX primitive name:
MAP_SCALAR_ONLY_OPS = frozenset({
    "cbrt", "erf", "erfc", "erf_inv", "is_finite", "not", "clz", "population_count",
    "sign", "convert_element_type", "reduce_precision", "lgamma", "digamma", "igamma",
    "bessel_i0e", "bessel_i1e", "random_bits", "threefry2x32", "nextafter",
    "shift_left", "shift_right_logical", "shift_right_arithmetic"})
# One cycle a vector for the generated loop's count-and-branch (an estimate:
# ``while (loopCount) { loopCount--; ... }`` compiles to one ``brnzdec``).
MAP_LOOP_CYCLES = 1
# One 64-bit load or store a cycle per worker (poplar's data-path width).
MAP_WORDS_PER_CYCLE = 1


def map_vectorisable(dtype) -> bool:
  """Whether a value of ``dtype`` lets a map codelet vectorise (half/float/bool)."""
  dtype = np.dtype(dtype)
  return (dtype.kind == "f" and dtype.itemsize in (2, 4)) or dtype.kind == "b"


def map_member_element_cycles(target, op_name: str, dtype, vector_inputs: int):
  """ALU cycles per element of ``op_name`` inside a map codelet, or ``None``.

  From popops' UnaryOp1D / BinaryOp1D tables, without the loads and stores
  the map codelet counts once for the whole expression: a natural-width
  entry's table cycles are the operation alone (the estimator adds the
  load/store/loop overhead apart); an unrolled entry's cycles cover its own
  loads of each input and its store of each group, which are taken off
  (one cycle per 64-bit word, at least one cycle left per group); an
  element-at-a-time entry is its cycles per element. ``None`` where poplibs
  has no figure (the caller's generic figure applies).
  """
  dtype = np.dtype(dtype)
  if dtype.kind != "f" or dtype.itemsize not in (2, 4):
    return None
  if op_name in NONLINEARITY:
    # popnn's vertex, not a popops expression: its loop's cycles per element.
    return NONLINEARITY[op_name][dtype.itemsize] / max(1, _datapath_bytes(target) // dtype.itemsize)
  table = UNARY if op_name in UNARY else BINARY if op_name in BINARY else None
  if table is None:
    return None
  cycles, natural, unroll = table[op_name][dtype.itemsize]
  if natural:
    return cycles / max(1, _datapath_bytes(target) // dtype.itemsize)
  if unroll > 0:
    words = -(-unroll * dtype.itemsize // _datapath_bytes(target))
    return max(1, cycles - (vector_inputs + 1) * words) / unroll
  return float(cycles)


def elementwise_overheads(target, op_name: str, dtype, in_dtype=None):
  """``(per worker, per tile)`` fixed cycles of ``op_name``'s own vertex, or ``None``.

  The parts of popops' estimators that do not grow with the elements: the
  UnaryOp1D / BinaryOp1D worker entry (unary 17, ``exp`` 33; binary 29 for
  float, 26 otherwise) and supervisor (11, unary 9 more); Cast1D's 18 per
  worker and 12 per tile. ``None`` where popops has no figure.
  """
  dtype = np.dtype(dtype)
  if op_name == "convert_element_type" and in_dtype is not None:
    return 18, 12
  if dtype.kind != "f" or dtype.itemsize not in (2, 4):
    return None
  if op_name in UNARY:
    return (33 if op_name == "exp" else 17), _SUPERVISOR + _UNARY_SUPERVISOR_EXTRA
  if op_name in NONLINEARITY:
    return 20, _NL_SUPERVISOR
  if op_name in BINARY:
    return (29 if dtype.itemsize == 4 else 26), _SUPERVISOR
  return None


def map_expression_cycles(target, elements, vector_cycles, width: int, worker_overhead,
                          supervisor_overhead) -> np.ndarray:
  """Tile cycles of a generated map codelet evaluating a fused expression.

  popops' expression generator (lib/popops/ExpressionGenerator.cpp) emits a
  MultiVertex whose workers take vectors of ``width`` elements in turn
  (worker ``i`` the vectors ``i, i + workers, ...``); each vector loads every
  input that is not a single value once, evaluates the expression in
  registers and stores the result once; the last worker then does the
  elements short of a whole vector one at a time, at the same cycles each.

  Args:
    target: the IPU target (worker contexts).
    elements: ``[num_tiles]`` elements per tile.
    vector_cycles: one worker's cycles for one vector (ALU of every member,
      loads, stores, loop).
    width: elements per vector (1 where the codelet does not vectorise).
    worker_overhead, supervisor_overhead: the fixed cycles, paid once.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has no elements).
  """
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  vectors, rem = elements // width, elements % width
  first = -(-vectors // w) * vector_cycles
  last = (vectors // w + rem) * vector_cycles
  cycles = w * (worker_overhead + np.maximum(first, last)) + supervisor_overhead
  return np.where(elements > 0, cycles, 0).astype(np.float64)


# -- DynamicSlice1D / DynamicUpdateSlice1D ------------------------------------------


def dynamic_slice_cycles(target, elements, itemsize, num_slices=1) -> np.ndarray:
  """Tile cycles of popops' ``DynamicSlice1D`` copying ``elements`` per tile.

  ``elements`` is the tile's region of one slice (poplibs' ``regionSize``),
  ``num_slices`` the slices copied (``numSubElements``). The supervisor pays
  25 cycles; each worker copies its share of the region at 64 bits per
  2 cycles, with 39 cycles of setup and 24 per slice (8-bit types: 76 and 72,
  4 elements a vector) (``getDynamicSlice1DEstimate``). ``DynamicUpdateSlice1D``
  has the same estimate.
  """
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  itemsize = int(itemsize)
  wide = itemsize == 8
  # 64-bit types move as twice as many 32-bit words.
  per_worker = _ceil_div(elements * (2 if wide else 1), w)
  width = 4 if itemsize == 1 else _datapath_bytes(target) // min(itemsize, 4)
  copies = per_worker // width
  if itemsize == 1:
    worker = 76 + (72 + 2 * copies) * num_slices
  else:
    worker = 39 + (24 + 2 * copies) * num_slices
  supervisor = 11 + 1 + 6 + 1 + 6
  return np.where(elements > 0, supervisor + w * worker, 0).astype(np.float64)
