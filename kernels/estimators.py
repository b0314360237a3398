"""Cycle estimators for the built-in codelets, vectorised over tiles.

Each function takes ``[num_tiles]`` arrays of per-tile work and returns
``[num_tiles]`` compute-phase cycles. Work on a tile is split over the worker
contexts the way poplibs splits it (equal shares, rounded to the vector
width); the phase lasts as long as the busiest worker, and workers issue
round-robin, so a tile's cycles are the busiest worker's cycles times the
number of contexts, plus the supervisor's launch overhead.

The per-element costs follow the shape of poplibs' estimators (a fixed
per-worker overhead plus a cost per vector of elements); absolute values are
estimates.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.target import IPUTarget

__all__ = [
    "worker_split_cycles", "elementwise_cycles", "reduce_cycles",
    "matmul_cycles", "copy_cycles", "fill_cycles", "scaled_add_cycles",
    "dot_product_cycles", "vertex_cycles_per_tile", "ELEMENTWISE_COST",
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


def elementwise_cycles(target, elements, op_name: str, itemsize: int):
  cost = ELEMENTWISE_COST.get(op_name, DEFAULT_ELEMENTWISE_COST)
  return worker_split_cycles(target, elements, cost, itemsize)


def scaled_add_cycles(target, elements, itemsize):
  return worker_split_cycles(target, elements, 2, itemsize)


def copy_cycles(target, elements, itemsize):
  return worker_split_cycles(target, elements, 1, itemsize, overhead=6)


def fill_cycles(target, elements, itemsize):
  return worker_split_cycles(target, elements, 1, itemsize, overhead=4)


def reduce_cycles(target, elements, itemsize, outputs=None):
  """Partial reductions: one vector op per vector of input, plus per output."""
  cycles = worker_split_cycles(target, elements, 1, itemsize)
  if outputs is not None:
    cycles = cycles + np.where(np.asarray(elements) > 0,
                               target.worker_contexts * 2 * -(-np.asarray(outputs) // target.worker_contexts), 0)
  return cycles


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


def matmul_cycles(target, macs, itemsize, outputs=None, dtype=None):
  """A tile's matmul block: ``macs`` multiply-accumulates at the AMP rate.

  fp16/bf16 operands run at the fp16 rate, others at the fp32 rate. The AMP
  unit is driven by all workers together, so the rate is per tile. With
  ``dtype`` given, it sets the rate instead of ``itemsize``: complex MACs
  count as :data:`COMPLEX_REAL_MACS` real ones, and float64 ones run as the
  software emulation described at :data:`FLOAT64_FP32_OPS_PER_MAC`.
  """
  macs = np.asarray(macs, np.float64)
  real_macs = macs
  emulated = False
  if dtype is not None:
    dtype = np.dtype(dtype)
    if dtype.kind == "c":
      real_macs = macs * COMPLEX_REAL_MACS
      dtype = np.dtype(f"f{dtype.itemsize // 2}")
    itemsize = dtype.itemsize
    emulated = dtype.kind == "f" and dtype.itemsize >= 8
  if emulated:
    fp32_ops_per_cycle = max(1, target.vector_width_bytes // 4)
    cycles = np.ceil(real_macs * FLOAT64_FP32_OPS_PER_MAC / fp32_ops_per_cycle)
  else:
    flops_per_cycle = (target.fp16_flops_per_cycle if itemsize <= 2
                       else target.fp32_flops_per_cycle)
    if dtype is not None and target.has_fp8(dtype):
      # lowprec: FP8 operands on a target with FP8 AMP units (ipu21).
      flops_per_cycle = target.fp8_flops_per_cycle
    cycles = np.ceil(2.0 * real_macs / flops_per_cycle)
  if outputs is not None:
    cycles = cycles + np.asarray(outputs) / max(1, target.vector_width_bytes // 4)
  overhead = target.worker_contexts * WORKER_OVERHEAD * 4 + target.supervisor_overhead_cycles
  return np.where(macs > 0, cycles + overhead, 0.0)


def vertex_cycles_per_tile(target: IPUTarget, vertex_tiles: np.ndarray,
                           vertex_cycles: np.ndarray) -> np.ndarray:
  """Compute-phase cycles per tile for arbitrary vertices.

  Vertices on a tile are dealt to the worker contexts longest-first
  (round-robin over the sorted list); a tile costs its busiest context times
  the number of contexts, plus the supervisor's overhead.

  Args:
    target: the IPU target.
    vertex_tiles: ``[V]`` tile of each vertex.
    vertex_cycles: ``[V]`` cycles of each vertex.

  Returns:
    ``[num_tiles]`` cycles.
  """
  w = target.worker_contexts
  out = np.zeros(target.num_tiles, np.float64)
  vertex_tiles = np.asarray(vertex_tiles, np.int64)
  if vertex_tiles.size == 0:
    return out
  vertex_cycles = np.asarray(vertex_cycles, np.float64)
  order = np.lexsort((-vertex_cycles, vertex_tiles))
  tiles_sorted = vertex_tiles[order]
  first = np.searchsorted(tiles_sorted, tiles_sorted, side="left")
  rank = np.arange(tiles_sorted.size) - first
  context_cycles = np.zeros((target.num_tiles, w), np.float64)
  np.add.at(context_cycles, (tiles_sorted, rank % w), vertex_cycles[order])
  busy = np.zeros(target.num_tiles, bool)
  busy[vertex_tiles] = True
  out = context_cycles.max(axis=1) * w
  return np.where(busy, out + target.supervisor_overhead_cycles, 0.0)
