"""Cycles of a matrix-product block on a tile's AMP unit: the one estimator.

Every path that multiplies matrices on a tile (the ``dot_general`` and
convolution rules, :func:`ipu_jax.ops.matmul`, ``ipu_jax.poplibs.matmul`` and
the built-in ``matmul_block`` codelet run through ``tile_map`` or the graph
API) costs its per-tile work here, so identical work costs identical cycles.

The model is poplin's published estimator for its AMP convolution-partials
vertex with a 1x1 kernel (``ConvPartial1x1Out``; poplibs
``lib/poplin/PerformanceEstimation.hpp``, functions
``getConvPartial1x1SupervisorInnerLoopCycleEstimateHalfFloat`` and
``...OuterLoopCycleEstimateHalfFloat``), which is how poplin runs a matmul: a
block ``[G, M, K] x [G, K, N]`` is ``G`` convolution groups whose ``M`` rows
are field positions, ``K`` input channels and ``N`` output channels.

* The AMP takes ``in_chans`` input channels (16 for 2-byte inputs, 8 for
  fp32, poplibs' "weights per conv unit") and produces ``conv_units`` output
  channels per pass; ``K`` and ``N`` are padded to those groups.
* Each (input group, output group) pass deals the ``M`` rows to the worker
  contexts as ``partitionConvPartialByWorker`` does (``ceil`` or ``floor``
  of ``M / workers`` each). A worker pays an entry cost that depends on its
  rows (1, 2, 3 or more), on the code path (half-float and 16-unit
  half-half share one, 8-unit half-half and float have their own) and on
  whether the pass zeroes its partials (the first input group's passes),
  then ``core`` cycles per row beyond 3 (4 for 2-byte inputs, 8 for fp32;
  poplibs' ``coreCycles``). Workers issue round-robin, so a pass costs the
  busiest worker times the number of contexts, and at least the least busy
  one's plus 14 (the tag). Half inputs' state retention saves 7 cycles per
  worker per pass, paid back once per vertex.
* The supervisor pays a fixed entry (50 cycles), per-group and per-input-group
  loop overheads, 3 cycles per worker restoring retained state on each
  further input group, and the weight loads of every pass (``conv_units *
  32 bytes`` at 16 bytes per cycle).

Every case equals poplibs' estimate (``experiments/poplibs_reference.py``
evaluates it case by case; ``tests/test_cost_paths.py`` holds the two equal).

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

# poplibs 7eac0f2, lib/poplin/PerformanceEstimation.hpp ("PE"): the 1x1 AMP
# vertex's estimator, getConvPartial1x1Supervisor{Inner,Outer}LoopCycleEstimateHalfFloat.
_CORE_CYCLES = {2: 4, 4: 8}                  # PE:402, coreCycles (per row beyond 3)
_IN_CHANS = {2: 16, 4: 8}                    # getWeightsPerConvUnit: 16 half, 8 float
# A worker's entry for 1, 2 and 3+ rows, by code path (PE:439-475): "common" is
# half inputs with float partials or on 16 units (PE:418-419, the vertex
# conv_partial_1x1_half_float_8_and_half_half_h16.S), "half8" half-half on 8
# units, "float" float inputs.
_WORKER_ENTRY = {"common": (31, 40, 36),      # PE:444, 455, 470 (37 / 38 less the 1 / 2 below)
                 "half8": (39, 40, 41),       # PE:446, 458, 473
                 "float": (47, 46, 46)}       # PE:441, 452, 465
# Fixed cycles of a pass that zeroes its partials (the first input group's)
# and of one that does not: the common path's ``outputZeroing ? 1 : 2``
# (PE:444, 455, 470), the others' ``(2 + zeroCyclesPerGroup * rows)`` when
# zeroing (PE:441-473).
_ZEROING_FIXED = {"common": (1, 2), "half8": (2, 0), "float": (2, 0)}
# State retention (PE:49-58, conv1x1WorkerRetentionSavings): each worker saves
# 7 cycles a pass (PE:478), the supervisor pays them once per vertex and 3 per
# worker for every input group of every conv group but the vertex's first
# (PE:599-601: numInGroups * numConvGroups - 1).
_RETENTION = {"common": (7, 3), "half8": (0, 0), "float": (0, 0)}
# The tag: a pass costs at least its least busy worker's cycles plus 14 (PE:488).
_WORKER_TAG = 14
# Supervisor (PE:595-614): fixed entry; per conv group 12 (+1 on the common
# path); per further input group 15 (-1 on the common path) + 1; per output
# group 19 and per pass 6 before its weight loads (first input group: 10 + 1,
# 19 (-1 on the common path) and 7).
_SUPERVISOR_ENTRY = 50                        # PE:595, supervisorNonloopOverhead
_GROUP_ENTRY = 12                             # PE:603
_FURTHER_IN_GROUP = 15 + 1                    # PE:605-606, + excessInChanOverhead (PE:597)
_FIRST_IN_GROUP = 10 + 1                      # PE:610
_OUT_GROUP = 19                               # PE:607, 612
_FURTHER_PASS = 6                             # PE:608
_FIRST_PASS = 7                               # PE:596, outPassesOverhead
# Weight loads: weightBytesPerConvUnit (32: 16 half or 8 float weights,
# ConvModel.cpp:287-288) x units at 16 bytes a cycle (PE:559-570).
_WEIGHT_BYTES_PER_UNIT = 32
_COEFF_LOAD_BYTES_PER_CYCLE = 16
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


def _vertex_path(width: int, conv_units: int, float_partials: bool):
  """``(path, zero_per_row)``: the 1x1 vertex's code path and zeroing cycles a row.

  Float inputs always accumulate in float (poplin's ConvVertexType.cpp:250-252).
  ``zero_per_row`` is PE:413-415's ``zeroCyclesPerGroup``.
  """
  float_partials = float_partials or width == 4
  if width == 4:
    path = "float"
  elif float_partials or conv_units == 16:
    path = "common"
  else:
    path = "half8"
  if width == 4 and conv_units == 16:
    zero_per_row = 8
  else:
    zero_per_row = 4 if float_partials else 2
  return path, zero_per_row


def _worker_cycles(rows, zeroing: bool, path: str, zero_per_row: int, core: int):
  """One worker's cycles for ``rows`` rows of a pass, less the retention saving.

  A worker with no rows has an empty work list and costs 0 (PE:431-478).
  """
  e1, e2, e3 = _WORKER_ENTRY[path]
  entry = np.where(rows == 1, e1, np.where(rows == 2, e2, e3))
  fixed = _ZEROING_FIXED[path][0 if zeroing else 1]
  per_row = zero_per_row if (zeroing and path != "common") else 0
  cycles = (entry + fixed + per_row * rows + np.maximum(rows - 3, 0) * core
            - _RETENTION[path][0])
  return np.where(rows > 0, cycles, 0)


def _pass_cycles(rows, workers: int, zeroing: bool, path: str, zero_per_row: int, core: int):
  """A pass's cycles: the busiest worker's x ``workers``, at least the least busy one's + tag.

  The rows are dealt as partitionConvPartialByWorker deals them: some workers
  take ``ceil(rows / workers)``, the others ``floor`` (none when ``rows`` is
  a multiple; the floor is 0 when ``rows < workers``: idle workers cost 0).
  """
  most = _worker_cycles(_ceil(rows, workers), zeroing, path, zero_per_row, core)
  fewest = _worker_cycles(rows // workers, zeroing, path, zero_per_row, core)
  # The cost is not monotonic in rows (a float worker's 1 row costs more than 2).
  high = workers * np.maximum(most, fewest)
  low = workers * np.minimum(most, fewest)
  return np.maximum(high, low + _WORKER_TAG)


def _oriented_cycles(target, geo, width, float_partials, groups, rows, k, n):
  """PE's outer loop (PE:595-614) for ``groups`` conv groups of ``[rows, k] x [k, n]``."""
  w = target.worker_contexts
  path, zero_per_row = _vertex_path(width, geo.conv_units, float_partials)
  # PE:592-593's commonHalfAndFloatPartialsCodePath holds for float inputs
  # too (their partials are float): the supervisor's loops are the common path's.
  common = int(path != "half8")
  in_groups = _ceil(k, geo.in_chans)
  out_groups = _ceil(n, geo.conv_units)
  loads = geo.conv_units * _WEIGHT_BYTES_PER_UNIT // _COEFF_LOAD_BYTES_PER_CYCLE
  zeroing = _pass_cycles(rows, w, True, path, zero_per_row, geo.core_cycles)
  accumulating = _pass_cycles(rows, w, False, path, zero_per_row, geo.core_cycles)
  first_in = _FIRST_IN_GROUP + out_groups * (_OUT_GROUP - common + _FIRST_PASS + loads + zeroing)
  further_in = (in_groups - 1) * (_FURTHER_IN_GROUP - common
                                  + out_groups * (_OUT_GROUP + _FURTHER_PASS + loads
                                                  + accumulating))
  saved, restored = _RETENTION[path]
  retention = w * (saved + restored * (in_groups * groups - 1))
  return (_SUPERVISOR_ENTRY + retention
          + groups * (_GROUP_ENTRY + common + further_in + first_in))


def amp_block_cycles(target: IPUTarget, rows, k, n, itemsize: int, groups=1,
                     partials_itemsize: int = 4) -> np.ndarray:
  """Tile cycles of ``groups`` products ``[rows, k] x [k, n]`` on the AMP.

  Vectorised: ``rows``, ``k``, ``n`` and ``groups`` may be ``[tiles]`` arrays.
  Tiles with no work cost 0.

  Args:
    target: the IPU target (AMP rate, worker contexts).
    rows, k, n: the block's output rows, contraction length and columns.
    itemsize: bytes of an input element (2: fp16/bf16 rate, else fp32 rate).
    groups: independent products on the tile (a batch block): the conv groups
      of one vertex (PE's ``numConvGroups``).
    partials_itemsize: bytes of a partial sum (4: float32; 2: half partials,
      the full fp16 AMP rate).

  Returns:
    float64 cycles, the supervisor's and workers' together.
  """
  rows, k, n, groups = (np.asarray(x, np.int64) for x in (rows, k, n, groups))
  width = 2 if itemsize <= 2 else 4
  geo = amp_geometry(target, itemsize, partials_itemsize)
  float_partials = partials_itemsize >= 4
  straight = _oriented_cycles(target, geo, width, float_partials, groups, rows, k, n)
  swapped = _oriented_cycles(target, geo, width, float_partials, groups, n, k, rows)
  cycles = np.minimum(straight, swapped).astype(np.float64)
  busy = (rows > 0) & (k > 0) & (n > 0) & (groups > 0)
  return np.where(busy, cycles, 0.0)
