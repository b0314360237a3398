"""Cycles of a matrix-product block on a tile's AMP unit: the one estimator.

Every path that multiplies matrices on a tile (the ``dot_general`` and
convolution rules, :func:`ipu_jax.ops.matmul`, ``ipu_jax.poplibs.matmul`` and
the built-in ``matmul_block`` codelet run through ``tile_map`` or the graph
API) costs its per-tile work here, so identical work costs identical cycles.

The model follows the structure of poplin's published estimator for its AMP
convolution-partials vertex with a 1x1 kernel (``ConvPartial1x1Out``; poplibs
``lib/poplin/PerformanceEstimation.hpp``, functions
``getConvPartial1x1SupervisorInnerLoopCycleEstimateHalfFloat`` and
``...OuterLoopCycleEstimateHalfFloat``), which is how poplin runs a matmul: a
block ``[G, M, K] x [G, K, N]`` is ``G`` convolution groups whose ``M`` rows
are field positions, ``K`` input channels and ``N`` output channels.

* The AMP takes ``in_chans`` input channels (16 for 2-byte inputs, 8 for
  fp32, poplibs' "weights per conv unit") and produces ``conv_units`` output
  channels per pass; ``K`` and ``N`` are padded to those groups.
* Each (input group, output group) pass splits the ``M`` rows evenly over the
  worker contexts. A worker pays a fixed entry cost and then ``core`` cycles
  per row (4 for 2-byte inputs, 8 for fp32; poplibs' ``coreCycles``). Workers
  issue round-robin, so the pass costs the busiest worker times the number of
  contexts.
* The supervisor pays a fixed entry (50 cycles), per-group loop overheads and
  the weight loads of every pass (``conv_units * 32 bytes`` at 16 bytes per
  cycle).

The AMP rate itself is the target's: ``conv_units`` is derived from
``fp16_flops_per_cycle`` / ``fp32_flops_per_cycle`` so that a full pass runs
at the datasheet's peak (IPU2 fp16: 16 input channels x 16 units per 4
cycles = 64 MACs/cycle = 128 FLOP/cycle, i.e. 250 TFLOPS over 1,472 tiles at
1.33 GHz). That peak is the half-partials one: 2-byte inputs with float32
partials run at most 8 units (poplibs' ``fp16InFp32OutConvUnitsPerTile``,
the AMP's pipeline depth of 4 times the two fp32 partials a 64-bit store
path writes a cycle, ``tools/single_conv_layer.cpp``; the IPU2 vertex is
``conv_partial_1x1_half_float_8_and_half_half_h16.S``: 8 units half-float,
16 half-half), half the rate. A product whose ``N`` is narrower than the units but whose ``M``
is wider is costed transposed (poplin's planner may swap the operands).

Float64 and complex products are not native (see ``estimators``): they keep
their emulation cost.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.kernels.target import IPUTarget

__all__ = ["AmpGeometry", "amp_geometry", "amp_block_cycles"]

# Worker cycles of the 1x1 AMP vertex, from poplibs (half / float inputs):
# the entry cost of a worker's pass with at least 3 rows (the core loop covers
# the rest). Passes of 1 or 2 rows cost about the same (32-41 in poplibs).
_WORKER_ENTRY = {2: 37, 4: 46}
_CORE_CYCLES = {2: 4, 4: 8}
_IN_CHANS = {2: 16, 4: 8}
# Supervisor: fixed entry, per-group entry, each further input group, each
# pass (output group) before its weight loads. Half inputs also spend 3
# cycles per worker restoring retained state on each further input group.
_SUPERVISOR_ENTRY = 50
_GROUP_ENTRY = 24
_IN_GROUP_OVERHEAD = 15
_RETENTION_PER_WORKER = {2: 3, 4: 0}
_PASS_OVERHEAD = 25
_WEIGHT_BYTES_PER_UNIT = 32
_COEFF_LOAD_BYTES_PER_CYCLE = 16
# Extra cycles the fp32-input path spends zeroing partials per row (first
# input group only): poplibs' zeroCyclesPerGroup.
_FLOAT_ZERO_PER_ROW = {8: 4, 16: 8}
# Units of a 2-byte-input AMP with float32 partials: poplibs'
# fp16InFp32OutConvUnitsPerTile = min(fp16InFp16OutConvUnitsPerTile,
# pipeline depth 4 x 2 fp32 stored per cycle) (tools/single_conv_layer.cpp;
# IPU2's vertex conv_partial_1x1_half_float_8_and_half_half_h16.S).
_FP32_PARTIALS_UNITS = 8


class AmpGeometry(tuple):
  """``(in_chans, conv_units, core_cycles)`` of the AMP for one input width."""

  __slots__ = ()

  def __new__(cls, in_chans: int, conv_units: int, core_cycles: int):
    return super().__new__(cls, (in_chans, conv_units, core_cycles))

  in_chans = property(lambda self: self[0])
  conv_units = property(lambda self: self[1])
  core_cycles = property(lambda self: self[2])


def amp_geometry(target: IPUTarget, itemsize: int, partials_itemsize: int = 4) -> AmpGeometry:
  """The AMP's channel groups for inputs of ``itemsize`` bytes on ``target``.

  ``partials_itemsize``: bytes of a partial sum (4: float32, poplin's
  default; 2: half partials). 2-byte inputs with float32 partials get at
  most :data:`_FP32_PARTIALS_UNITS` units (half the IPU2's fp16 peak).
  """
  width = 2 if itemsize <= 2 else 4
  flops = target.fp16_flops_per_cycle if width == 2 else target.fp32_flops_per_cycle
  core = _CORE_CYCLES[width]
  in_chans = _IN_CHANS[width]
  units = max(1, (flops // 2) * core // in_chans)
  if width == 2 and partials_itemsize >= 4:
    units = min(units, _FP32_PARTIALS_UNITS)
  return AmpGeometry(in_chans, units, core)


def _ceil(a, b):
  return -(-a // b)


def _oriented_cycles(target, geo, width, groups, rows, k, n):
  w = target.worker_contexts
  in_groups = _ceil(k, geo.in_chans)
  out_groups = _ceil(n, geo.conv_units)
  per_worker = _ceil(rows, w)
  worker = _WORKER_ENTRY[width] + np.maximum(per_worker - 3, 0) * geo.core_cycles
  passes = in_groups * out_groups
  zeroing = 0
  if width == 4:
    zeroing = out_groups * (2 + _FLOAT_ZERO_PER_ROW.get(geo.conv_units, 4) * per_worker)
  weight_loads = geo.conv_units * _WEIGHT_BYTES_PER_UNIT // _COEFF_LOAD_BYTES_PER_CYCLE
  further_in = (in_groups - 1) * (_IN_GROUP_OVERHEAD + w * _RETENTION_PER_WORKER[width])
  supervisor = (_SUPERVISOR_ENTRY
                + groups * (_GROUP_ENTRY + further_in + passes * (_PASS_OVERHEAD + weight_loads)))
  return supervisor + groups * w * (passes * worker + zeroing)


def amp_block_cycles(target: IPUTarget, rows, k, n, itemsize: int, groups=1,
                     partials_itemsize: int = 4) -> np.ndarray:
  """Tile cycles of ``groups`` products ``[rows, k] x [k, n]`` on the AMP.

  Vectorised: ``rows``, ``k``, ``n`` and ``groups`` may be ``[tiles]`` arrays.
  Tiles with no work cost 0.

  Args:
    target: the IPU target (AMP rate, worker contexts).
    rows, k, n: the block's output rows, contraction length and columns.
    itemsize: bytes of an input element (2: fp16/bf16 rate, else fp32 rate).
    groups: independent products on the tile (a batch block).
    partials_itemsize: bytes of a partial sum (4: float32; 2: half partials,
      the full fp16 AMP rate).

  Returns:
    float64 cycles, the supervisor's and workers' together.
  """
  rows, k, n, groups = (np.asarray(x, np.int64) for x in (rows, k, n, groups))
  width = 2 if itemsize <= 2 else 4
  geo = amp_geometry(target, itemsize, partials_itemsize)
  straight = _oriented_cycles(target, geo, width, groups, rows, k, n)
  swapped = _oriented_cycles(target, geo, width, groups, n, k, rows)
  cycles = np.minimum(straight, swapped).astype(np.float64)
  busy = (rows > 0) & (k > 0) & (n > 0) & (groups > 0)
  return np.where(busy, cycles, 0.0)
