"""Cycle estimators for the built-in codelets, vectorised over tiles.

Each function takes ``[num_tiles]`` arrays of per-tile work and returns
``[num_tiles]`` compute-phase cycles. Work on a tile is split over the worker
contexts the way poplibs splits it (equal shares, rounded to the vector
width); the phase lasts as long as the busiest worker, and workers issue
round-robin, so a tile's cycles are the busiest worker's cycles times the
number of contexts, plus the supervisor's launch overhead.

Sourced parts: matmul and convolution blocks use the AMP estimator in
:mod:`ipu_jax.kernels.amp` (after poplin's ConvPartial1x1 estimator);
fp16/fp32 elementwise operations that poplibs publishes figures for, casts,
fills, scaled adds and dynamic slices use :mod:`ipu_jax.kernels.popops`
(popops' UnaryOp1D / BinaryOp1D, Cast1D, Fill, ScaledAddSupervisor and
DynamicSlice1D estimators); reductions with one vector op per input vector
use :mod:`ipu_jax.kernels.reduce` (popops' Reduce vertices). The rest
(on-tile copies, other elementwise ops and types, multi-op reductions such as
argmax) follows the shape of poplibs' estimators (a fixed per-worker overhead
plus a cost per vector of elements) with estimated constants.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.kernels import popops
from ipu_jax.kernels import reduce
from ipu_jax.kernels.target import IPUTarget

__all__ = [
    "worker_split_cycles", "elementwise_cycles", "reduce_cycles", "partials_reduce_cycles",
    "matmul_cycles", "copy_cycles", "fill_cycles", "scaled_add_cycles",
    "scaled_arithmetic_cycles", "map_member_element_cycles", "elementwise_overheads",
    "dot_product_cycles", "dynamic_slice_cycles", "vertex_cycles_per_tile",
    "ELEMENTWISE_COST",
    "COMPLEX_REAL_MACS", "FLOAT64_FP32_OPS_PER_MAC", "mac_cost_note",
]

# Cycles per vector of elements for elementwise ops, by primitive name.
# Transcendentals run on the tile's function unit, a few cycles per element.
ELEMENTWISE_COST = {
    "exp": 4, "exp2": 4, "log": 4, "log1p": 5, "expm1": 5, "tanh": 4,
    "logistic": 5, "sin": 6, "cos": 6, "tan": 8, "atan2": 10, "asin": 10,
    "acos": 10, "atan": 10, "sinh": 8, "cosh": 8, "asinh": 10, "acosh": 10,
    "atanh": 10, "erf": 8, "erfc": 8, "erf_inv": 12, "lgamma": 20,
    "digamma": 20, "igamma": 30, "rsqrt": 3, "sqrt": 3, "cbrt": 6, "pow": 8,
    "div": 3, "rem": 6, "integer_pow": 2, "threefry2x32": 40,
    "random_bits": 40, "nextafter": 4, "is_finite": 1,
    # Estimate (kernels.cost_model.FIGURE_SOURCES), scaled from
    # threefry2x32's: Threefry2x32-20 is 20 rounds of
    # add / rotate (two shifts and an or) / xor, about 100 integer
    # instructions per two words; Philox4x32-10 is 10 rounds of two 32x32
    # multiplies (the high half built from 16-bit partial products, about 9
    # instructions each), two xors and a key bump, about 240 instructions per
    # four words, so 1.2x threefry's per two words.
    "philox4x32": 48,
}
DEFAULT_ELEMENTWISE_COST = 1
WORKER_OVERHEAD = 12


def _vectors(elements, itemsize, vector_width_bytes):
  per_vector = max(1, vector_width_bytes // max(1, itemsize))
  return -(-elements // per_vector)


def worker_split_cycles(target: IPUTarget, elements: np.ndarray,
                        cycles_per_vector: float, itemsize: int,
                        overhead: int = WORKER_OVERHEAD) -> np.ndarray:
  """Cycles of a tile whose ``elements`` are split evenly over its workers."""
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  per_worker = -(-elements // w)
  busiest = overhead + _vectors(per_worker, itemsize, target.vector_width_bytes) * cycles_per_vector
  cycles = w * busiest + target.supervisor_overhead_cycles
  return np.where(elements > 0, cycles, 0).astype(np.float64)


def elementwise_cycles(target, elements, op_name: str, itemsize: int, dtype=None,
                       in_dtype=None):
  """A tile's elementwise vertex: ``elements`` of ``op_name`` per tile.

  With a floating ``dtype`` and an operation poplibs publishes figures for,
  the cost is poplibs' (:mod:`ipu_jax.kernels.popops`); a
  ``convert_element_type`` from ``in_dtype`` to ``dtype`` is popops' Cast1D;
  otherwise the generic per-vector model with :data:`ELEMENTWISE_COST` (an
  estimate).
  """
  if op_name == "convert_element_type" and dtype is not None and in_dtype is not None:
    return popops.cast_cycles(target, elements, in_dtype, dtype)
  if dtype is not None:
    sourced = popops.popops_elementwise_cycles(target, elements, op_name, dtype)
    if sourced is not None:
      return sourced
  cost = ELEMENTWISE_COST.get(op_name, DEFAULT_ELEMENTWISE_COST)
  return worker_split_cycles(target, elements, cost, itemsize)


def _float_of(itemsize: int) -> np.dtype:
  """The type a cost is read for when only the element size is known."""
  return np.dtype({2: np.float16, 4: np.float32, 8: np.float64}.get(int(itemsize), np.uint8))


def scaled_add_cycles(target, elements, itemsize, dtype=None):
  """``A += k * B`` on ``elements`` per tile: popops' ScaledAddSupervisor."""
  return popops.scaled_add_cycles(target, elements, _float_of(itemsize) if dtype is None else dtype)


def scaled_arithmetic_cycles(target, elements, dtype, operation: str):
  """``A + b * B`` and its family on ``elements`` per tile: popops' scaled-arithmetic
  supervisor vertices (:func:`ipu_jax.kernels.popops.scaled_arithmetic_cycles`)."""
  return popops.scaled_arithmetic_cycles(target, elements, dtype, operation)


def map_member_element_cycles(target, op_name: str, dtype, vector_inputs: int) -> float:
  """ALU cycles per element of one member of a fused map expression.

  popops' figure without the loads and stores
  (:func:`ipu_jax.kernels.popops.map_member_element_cycles`); for operations
  poplibs has no figure for, the generic model's cycles per vector
  (:data:`ELEMENTWISE_COST`) over the elements of a vector (an estimate).
  """
  sourced = popops.map_member_element_cycles(target, op_name, dtype, vector_inputs)
  if sourced is not None:
    return sourced
  per_vector = max(1, target.vector_width_bytes // max(1, np.dtype(dtype).itemsize))
  return ELEMENTWISE_COST.get(op_name, DEFAULT_ELEMENTWISE_COST) / per_vector


def elementwise_overheads(target, op_name: str, dtype, in_dtype=None) -> tuple:
  """``(per worker, per tile)`` fixed cycles of ``op_name``'s elementwise vertex.

  popops' figures where it has them
  (:func:`ipu_jax.kernels.popops.elementwise_overheads`), else the generic
  model's (:data:`WORKER_OVERHEAD` and the compute set's launch).
  """
  sourced = popops.elementwise_overheads(target, op_name, dtype, in_dtype)
  if sourced is not None:
    return sourced
  return WORKER_OVERHEAD, target.supervisor_overhead_cycles


def copy_cycles(target, elements, itemsize):
  """On-tile copies (an estimate: a 64-bit vector a cycle per worker).

  Poplar's on-tile copy is not among poplibs' published estimators.
  """
  return worker_split_cycles(target, elements, 1, itemsize, overhead=6)


def fill_cycles(target, elements, itemsize):
  """Filling ``elements`` per tile with a constant: popops' Fill vertex."""
  return popops.fill_cycles(target, elements, itemsize)


def reduce_cycles(target, elements, itemsize, outputs=None, cycles_per_vector=1, dtype=None,
                  op="add", out_dtype=None):
  """Partial reductions of ``elements`` inputs per tile onto ``outputs``.

  With one vector op per input vector (``op``: add, mul, max, min, and, or,
  xor, square_add), popops' Reduce vertices for that operation
  (:func:`ipu_jax.kernels.reduce.reduce_cycles`, on inputs of ``dtype``, by
  default the float type of ``itemsize``, into outputs of ``out_dtype``, by
  default ``dtype``).
  Reductions of several ops per vector (argmax, variadic ``reduce``) have no
  poplibs vertex: ``cycles_per_vector`` per input vector split over the
  workers plus 2 cycles per output (an estimate).
  """
  if cycles_per_vector == 1:
    return reduce.reduce_cycles(target, elements, outputs,
                                _float_of(itemsize) if dtype is None else dtype, op, out_dtype)
  cycles = worker_split_cycles(target, elements, cycles_per_vector, itemsize)
  if outputs is None:
    return cycles
  w = target.worker_contexts
  return cycles + np.where(np.asarray(elements) > 0, w * 2 * -(-np.asarray(outputs) // w), 0)


# poplin's ReduceAdd vertex (lib/poplin/PerformanceEstimation.hpp,
# getReduceCycleEstimate): the accumulator's vector (8 halves, 4 floats), the
# supervisor variant's fixed cycles and per-loop overheads, and the single-input
# variant's (its first partial read in place) supervisor cycles.
_RA_ACC_WIDTH = {2: 8, 4: 4}
_RA_ENTRY, _RA_SINGLE_ENTRY, _RA_SINGLE_SUPERVISOR = 32, 20, 33
_RA_LOOP_OVERHEAD = {(2, 2): 8, (2, 4): 9, (4, 2): 6, (4, 4): 7}  # (partials, out) bytes
_RA_SINGLE_LOOP_OVERHEAD = {(2, 2): 9, (2, 4): 10, (4, 2): 7, (4, 4): 8}
_RA_REMAINDER = {2: 11, 4: 13}
# Single-input reduce only while the exchanged partials take under 1/16 of the
# tile's memory (poplin ConvReducePlan.hpp checkPartialsSizeForSingleInputReduce;
# its rounding up to whole memory elements is left out: their size is not public).
_RA_SINGLE_MEMORY_FRACTION = 16


def partials_reduce_cycles(target, elements, itemsize, outputs, out_itemsize=None):
  """A tile's sum of a matmul's or convolution's partials: poplin's ``ReduceAdd``.

  poplin reduces the partials of a split contraction with its own vertex, not
  popops' Reduce (lib/poplin/ConvReduce.cpp, ``poplin::ReduceAdd``); its cost is
  ``getReduceCycleEstimate`` (lib/poplin/PerformanceEstimation.hpp) as the
  planner's ``estimateConvReduceCycles`` calls it for one stage: the
  single-input vertex when the outputs are whole accumulator vectors and the
  exchanged partials are small (``enableFastReduce`` off, poplin's default),
  else the supervisor vertex.

  Args:
    target: the IPU target (worker contexts, data path width).
    elements: ``[...]`` partial elements each tile sums (``depth * outputs``).
    itemsize: bytes of a partial (2: half, else float).
    outputs: ``[...]`` elements each tile writes.
    out_itemsize: bytes of an output (default ``itemsize``).
  """
  elements = np.asarray(elements, np.int64)
  outputs = np.broadcast_to(np.asarray(outputs, np.int64), elements.shape)
  p = 2 if itemsize <= 2 else 4
  o = p if out_itemsize is None else (2 if out_itemsize <= 2 else 4)
  w, acc = target.worker_contexts, _RA_ACC_WIDTH[p]
  in_path = max(1, target.vector_width_bytes // p)
  out = np.maximum(outputs, 1)
  depth = -(-elements // out)
  loops = out // acc
  for bit in range(int(np.log2(acc))):  # the vertex's tail of 4, 2, 1 elements
    loops = loops + ((out >> bit) & 1)
  per_worker = loops // w
  ragged = (loops % w) > 0
  tail = (out & (acc - 1)) > 0
  extra = np.where(ragged & tail, 2 * depth + _RA_REMAINDER[p], 0)
  per_worker = per_worker + (ragged & ~tail)
  multi = (_RA_ENTRY + extra + (acc // min(acc, in_path) + 1) * depth * per_worker
           + _RA_LOOP_OVERHEAD[(p, o)] * per_worker) * w
  s_loops = -(-(out // acc) // w)
  single = ((_RA_SINGLE_ENTRY + (acc // min(acc, in_path)) * (depth - 1) * s_loops
             + _RA_SINGLE_LOOP_OVERHEAD[(p, o)] * s_loops) * w + _RA_SINGLE_SUPERVISOR)
  small = ((depth - 1) * out * p) < target.bytes_per_tile // _RA_SINGLE_MEMORY_FRACTION
  use_single = (out % acc == 0) & small
  cycles = np.where(use_single, single, multi).astype(np.float64)
  return np.where((elements > 0) & (outputs > 0) & (depth > 1), cycles, 0.0)


def dynamic_slice_cycles(target, elements, itemsize, num_slices=1):
  """A tile's part of a dynamic slice or update: popops' DynamicSlice1D."""
  return popops.dynamic_slice_cycles(target, elements, itemsize, num_slices)


def dot_product_cycles(target, length, itemsize, vertices):
  """``vertices`` dot products of ``length`` on each tile, spread over workers."""
  w = target.worker_contexts
  vertices = np.asarray(vertices, np.int64)
  per_worker = -(-vertices // w)
  one = WORKER_OVERHEAD + _vectors(np.asarray(length), itemsize, target.vector_width_bytes)
  return np.where(vertices > 0, w * per_worker * one + target.supervisor_overhead_cycles, 0).astype(np.float64)


# The IPU has no complex unit: a complex multiply-accumulate is four real
# ones on the AMP (re = ar*br - ai*bi, im = ar*bi + ai*br: four real block
# products whose results are the ones XLA computes). Gauss' three-multiply
# trick would save a quarter of the MACs but adds block additions and changes
# the rounding, so it is not what is modelled.
COMPLEX_REAL_MACS = 4

# Nor has it a float64 unit: a float64 MAC would be emulated in software
# (double-float arithmetic: error-free TwoProd with an FMA, the two cross
# terms, a TwoSum into the accumulator and a renormalisation: about 20 fp32
# vector operations). Those run on the workers' vector units, not the AMP, at
# ``vector_width_bytes / 4`` fp32 operations per cycle per tile (the six
# workers issue in turn, each a 64-bit vector). On an IPU2 that is 10 cycles
# per float64 MAC against 1/16 of a cycle per fp32 MAC on the AMP: 160x.
FLOAT64_FP32_OPS_PER_MAC = 20


def mac_cost_note(dtype) -> str:
  """How a product in ``dtype`` is costed when it is not native ('' if it is)."""
  dtype = np.dtype(dtype)
  notes = []
  if dtype.kind == "c":
    notes.append(f"complex MAC costed as {COMPLEX_REAL_MACS} real MACs")
    dtype = np.dtype(f"f{dtype.itemsize // 2}")
  if dtype.kind == "f" and dtype.itemsize >= 8:
    notes.append(f"float64 emulated in software: {FLOAT64_FP32_OPS_PER_MAC} fp32 vector "
                 "ops per MAC")
  return "; ".join(notes)


def matmul_cycles(target, macs, itemsize, outputs=None, dtype=None, *, k=None, n=None,
                  groups=None, partials_itemsize=4):
  """A tile's matmul block on the AMP unit (:func:`ipu_jax.kernels.amp.amp_block_cycles`).

  The block is ``groups`` products ``[rows, k] x [k, n]`` with ``macs =
  groups * rows * k * n`` and ``outputs = groups * rows * n``. Callers that
  know only ``macs`` and ``outputs`` get ``k = macs / outputs`` and ``n`` one
  full group of the AMP's output channels (exact when the block's ``n`` is a
  multiple of it); giving ``n`` and ``groups`` makes the padding of narrow
  blocks and the per-group overheads exact.

  fp16/bf16 operands run at the fp16 rate, others at the fp32 rate. With
  ``dtype`` given, it sets the rate instead of ``itemsize``: complex MACs
  count as :data:`COMPLEX_REAL_MACS` real products, and float64 ones run as
  the software emulation described at :data:`FLOAT64_FP32_OPS_PER_MAC`.
  ``partials_itemsize`` is the partial sums' bytes: 2-byte inputs run the
  AMP's full rate with half partials (2) and half of it with float32 ones (4,
  poplin's default; :func:`ipu_jax.kernels.amp.amp_geometry`).
  """
  from ipu_jax.kernels.amp import amp_block_cycles, amp_geometry
  macs = np.asarray(macs, np.float64)
  products = 1
  emulated = False
  if dtype is not None:
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
      products = COMPLEX_REAL_MACS
      dtype = np.dtype(f"f{dtype.itemsize // 2}")
    itemsize = dtype.itemsize
    emulated = dtype.kind == "f" and dtype.itemsize >= 8
  if emulated:
    fp32_ops_per_cycle = max(1, target.vector_width_bytes // 4)
    cycles = np.ceil(macs * products * FLOAT64_FP32_OPS_PER_MAC / fp32_ops_per_cycle)
    overhead = target.worker_contexts * WORKER_OVERHEAD * 4 + target.supervisor_overhead_cycles
    return np.where(macs > 0, cycles + overhead, 0.0)
  fp8_speedup = 1
  if dtype is not None and target.has_fp8(dtype):
    # FP8 operands on FP8 AMP units (ipu21): each pass takes fp8_speedup times
    # the fp16 input channels. Elsewhere FP8 runs as fp16 (poplin's fallback).
    fp8_speedup = max(1, target.fp8_flops_per_cycle // target.fp16_flops_per_cycle)
    itemsize = 2
  geo = amp_geometry(target, itemsize, partials_itemsize)
  if outputs is None:
    outputs = np.ceil(macs / geo.in_chans)
  outputs = np.maximum(np.asarray(outputs, np.float64), 1.0)
  k = np.rint(macs / outputs) if k is None else np.asarray(k, np.float64)
  k = np.ceil(k / fp8_speedup)
  n = np.full(np.shape(macs), geo.conv_units) if n is None else np.asarray(n, np.float64)
  groups = np.ones(np.shape(macs)) if groups is None else np.asarray(groups, np.float64)
  rows = np.ceil(outputs / np.maximum(n * groups, 1.0))
  cycles = products * amp_block_cycles(target, rows.astype(np.int64), k.astype(np.int64),
                                       n.astype(np.int64), itemsize, groups.astype(np.int64),
                                       partials_itemsize)
  return np.where(macs > 0, cycles, 0.0)


def vertex_cycles_per_tile(target: IPUTarget, vertex_tiles: np.ndarray,
                           vertex_cycles: np.ndarray, supervisor=None) -> np.ndarray:
  """Compute-phase cycles per tile for arbitrary vertices.

  Vertices on a tile are dealt to the worker contexts longest-first
  (round-robin over the sorted list); a tile costs its busiest context times
  the number of contexts, plus the supervisor's overhead. Supervisor vertices
  (``supervisor[v]``, e.g. the AMP matmul) already count the whole tile's
  cycles and run one after another: their cycles add to the tile's.

  Args:
    target: the IPU target.
    vertex_tiles: ``[V]`` tile of each vertex.
    vertex_cycles: ``[V]`` cycles of each vertex.
    supervisor: optional ``[V]`` bools, which vertices are supervisor vertices.

  Returns:
    ``[num_tiles]`` cycles.
  """
  w = target.worker_contexts
  out = np.zeros(target.num_tiles, np.float64)
  vertex_tiles = np.asarray(vertex_tiles, np.int64)
  if vertex_tiles.size == 0:
    return out
  vertex_cycles = np.asarray(vertex_cycles, np.float64)
  if supervisor is not None:
    supervisor = np.asarray(supervisor, bool)
    np.add.at(out, vertex_tiles[supervisor], vertex_cycles[supervisor])
    vertex_tiles, vertex_cycles = vertex_tiles[~supervisor], vertex_cycles[~supervisor]
    if vertex_tiles.size == 0:
      return out
  order = np.lexsort((-vertex_cycles, vertex_tiles))
  tiles_sorted = vertex_tiles[order]
  first = np.searchsorted(tiles_sorted, tiles_sorted, side="left")
  rank = np.arange(tiles_sorted.size) - first
  context_cycles = np.zeros((target.num_tiles, w), np.float64)
  np.add.at(context_cycles, (tiles_sorted, rank % w), vertex_cycles[order])
  busy = np.zeros(target.num_tiles, bool)
  busy[vertex_tiles] = True
  workers = context_cycles.max(axis=1) * w
  return out + np.where(busy, workers + target.supervisor_overhead_cycles, 0.0)
