"""PopLibs' published cycle estimators, evaluated in full: the calibration's references.

``experiments/calibration.py`` holds the emulator's vectorised models
(``kernels/amp.py``, ``kernels/reduce.py``, ``kernels/popops.py``) against
these: Graphcore's estimator functions written out case by case (per-worker
partition, short-row cases, state retention, supervisor loops), each naming
the PopLibs source it follows. ``tests/test_matmul_emitter.py`` holds the
matmul's staged partials reduction against poplin's reduction stages here.
"""

from __future__ import annotations

import math
import struct

# The static model's compute-set launch: poplin's supervisor non-loop overhead.
SUPERVISOR = 50

# ---------------------------------------------------------------------------
# The poplibs reference: the published ConvPartial1x1 estimator, in full.
# ---------------------------------------------------------------------------


def _worker_rows(rows: int, workers: int) -> list:
  base, extra = divmod(rows, workers)
  return [base + (i < extra) for i in range(workers)]


# poplibs at commit 7eac0f266ced5b064b3284a3cd90d491745b387c, file
# lib/poplin/PerformanceEstimation.hpp (``PE``), the AMP 1x1 vertex's estimator.
_POPLIBS_PE = "poplibs 7eac0f2 lib/poplin/PerformanceEstimation.hpp"


def _amp_1x1_path(half: bool, conv_units: int, float_partials: bool):
  """``(common, retention, zero_per_row)`` of the 1x1 AMP vertex's code path.

  ``common``: PE:418-419 (inner) and PE:592-593 (outer), the half-float
  8-unit path that half-half on 16 units shares
  (``conv_partial_1x1_half_float_8_and_half_half_h16.S``); half-half on 8
  units has its own path. ``retention``: PE:49-58
  (``conv1x1WorkerRetentionSavings``). ``zero_per_row``: PE:413-415
  (``zeroCyclesPerGroup``).
  """
  common = float_partials or (half and conv_units == 16)
  retention = (7, 3) if half and common else (0, 0)
  if not half and conv_units == 16:
    zero_per_row = 8
  else:
    zero_per_row = 4 if float_partials else 2
  return common, retention, zero_per_row


def _amp_1x1_worker(e: int, zeroing: bool, half: bool, common: bool, zero_per_row: int) -> int:
  """One worker's cycles for ``e`` rows before the retention saving (PE:430-478)."""
  z = int(zeroing)
  if not half:                                       # float activations, PE:441, 452, 465-466
    if e == 1:
      return 47 + (2 + zero_per_row) * z
    if e == 2:
      return 46 + (2 + zero_per_row * 2) * z
    return 46 + (2 + zero_per_row * e) * z + (e - 3) * 8
  if common:                                         # PE:444, 455, 470
    if e < 3:
      return {1: 31, 2: 40}[e] + (1 if zeroing else 2)
    return (37 if zeroing else 38) + (e - 3) * 4
  if e == 1:                                         # half-half, 8 units: PE:446, 458, 473
    return 39 + (2 + zero_per_row) * z
  if e == 2:
    return 40 + (2 + zero_per_row * 2) * z
  return 41 + (2 + zero_per_row * e) * z + (e - 3) * 4


def poplibs_amp_matmul_cycles(rows: int, k: int, n: int, half: bool, conv_units: int,
                              workers: int = 6, float_partials: bool = True,
                              groups: int = 1) -> int:
  """poplin's ConvPartial1x1 estimate of ``groups`` products ``[rows, k] x [k, n]`` on one tile.

  poplibs' ``getConvPartial1x1SupervisorCycleEstimate`` (``groups`` conv groups),
  case by case (see :data:`_POPLIBS_PE`): input channel group 16 for half,
  8 for float (``getWeightsPerConvUnit``); output group = ``conv_units``
  (one output pass per group, the planner's ``partialChansPerGroup`` =
  units; ConvVertexType.cpp:341-353); the rows dealt to the workers as
  ``partitionConvPartialByWorker`` does (ConvUtilInternal.cpp:78). Float
  activations always take float partials (ConvVertexType.cpp:250-252).

  Args:
    rows, k, n: field positions, input and output channels.
    half: 2-byte activations (else float).
    conv_units: the AMP units the vertex uses (IPU2: 16 for half-half,
      8 for half-float, ``kernels.amp.amp_geometry``).
    workers: the tile's worker contexts.
    float_partials: float32 partials (poplin's default) or half partials.
    groups: ``numConvGroups``, products of their own operands in one vertex
      (a batched block): the supervisor's loop runs once per group, the
      retention is restored on every input group but the vertex's first
      (PE:599-601, ``numInGroups * numConvGroups - 1``).
  """
  float_partials = float_partials or not half
  common, retention, zero_per_row = _amp_1x1_path(half, conv_units, float_partials)
  in_groups = -(-k // (16 if half else 8))
  out_groups = -(-n // conv_units)
  split = _worker_rows(rows, workers)

  def inner(zeroing):                                # PE:420-488
    cycles = [workers * (_amp_1x1_worker(e, zeroing, half, common, zero_per_row) - retention[0])
              if e else 0 for e in split]
    return max(max(cycles), min(cycles) + 14)

  # Weight loads: weightBytesPerConvUnit (32: 16 half or 8 float weights,
  # ConvModel.cpp:287-288) x units at 16 bytes a cycle (PE:559-568).
  loads = conv_units * 32 // 16
  c = int(common)
  inner_z, inner_nz = inner(True), inner(False)
  per_group = (12 + c                                                       # PE:603-614
               + (in_groups - 1) * (15 - c + 1 + out_groups * (19 + 6 + loads + inner_nz))
               + (10 + 1 + out_groups * (19 - c + 7 + loads + inner_z)))
  return (50 + workers * (retention[0] + retention[1] * (in_groups * groups - 1))  # PE:595-601
          + groups * per_group)


def _strided_reduce_vertex(outputs: int, partials: int, half: bool, stride: int,
                           op: str = "add") -> int:
  """poplibs' STRIDED_REDUCE estimate (not update, output type = partials type).

  ``add`` uses the accumulators (8 fp16 / 4 fp32 a vector), ``max``/``min``/
  ``mul`` 64-bit vectors (4 / 2); the completion and store of a group is
  1 + 7 for fp16 partials (poplibs' table has no fp16 ``mul`` row; max/min's
  figure is used) and (3 for add, else 2) + 2 for fp32.
  """
  accumulates = op == "add"
  cycles = 3 + 2 + 6 + 5
  post = (1 + 7) if half else ((3 if accumulates else 2) + 2)
  outer = 3 + post + (3 + 1 * (partials - 1))
  path = 4 if half else 2
  width = (8 if half else 4) if accumulates else path
  per_loop = math.gcd(min(width, path), stride)
  return cycles + outer * -(-outputs // per_loop)


def _single_input_reduce_vertex(partials: int, half: bool, op: str = "add") -> int:
  """poplibs' SCALAR_OUTPUT_SINGLE_INPUT estimate (output type = partials type)."""
  path = 4 if half else 2
  acc = ((8, 4) if half else (4, 2))[0] if op == "add" else path
  per_cycle = min(acc, path)
  loads = acc // per_cycle
  per_loop = max(loads, 1)
  per_iteration = per_cycle * loads
  cycles = 1 + 2 + 6 + per_loop * partials // per_iteration + 5 + partials % per_iteration + 3
  return cycles + (5 if half else 0)


def poplibs_reduce_cycles(rows: int, outputs: int, half: bool, workers: int = 6,
                          op: str = "add") -> int:
  """A tile reducing ``[rows, outputs]`` over its rows with ``op``, poplibs' way.

  The outputs are dealt to the workers (one STRIDED_REDUCE vertex each, the
  row stride being ``outputs``); a single output is split by rows over the
  workers (SCALAR_OUTPUT_SINGLE_INPUT vertices) and their partials combined
  in a second compute set. Each compute set costs the busiest worker times
  the workers plus the launch overhead.
  """
  if outputs >= workers:
    per_worker = [_strided_reduce_vertex(e, rows, half, outputs, op)
                  for e in _worker_rows(outputs, workers) if e]
    return workers * max(per_worker) + SUPERVISOR
  assert outputs == 1, "the reference covers column reductions and full reductions"
  first = max(_single_input_reduce_vertex(e, half, op) for e in _worker_rows(rows, workers) if e)
  second = _single_input_reduce_vertex(workers, half, op)
  return workers * first + SUPERVISOR + workers * second + SUPERVISOR


# ---------------------------------------------------------------------------
# poplin's partials reduction: its stages and ReduceAdd estimate, in full.
# poplibs 7eac0f2: lib/poplin/ConvReducePlan.cpp (``CRP``), ConvReducePlan.hpp
# (``CRPH``), PerformanceEstimation.hpp (``PE``), ConvModel.cpp (``CM``).
# ---------------------------------------------------------------------------


def _c_float(x: float) -> float:
  """``x`` rounded to a C ``float`` (poplin's costs are float)."""
  return struct.unpack("f", struct.pack("f", x))[0]


def poplin_num_reduce_stages(depth: int, multi_stage: bool = True) -> int:
  """CRP:10-27 getNumReduceStages: 3 from a depth of 125, 2 from 16, else 1."""
  if not multi_stage:
    return 1
  if depth >= 125:
    return 3
  if depth >= 16:
    return 2
  return 1


def poplin_multi_stage_plan(depth: int, stages: int) -> tuple:
  """CRP:36-57 getMultiStageReducePlanAndCost: ``(intermediate depths, cost)``.

  The cost is poplin's float (average messages a tile); on a tie the
  rounded-up depth wins (``roundDownCost < roundUpCost``, CRP:51).
  """
  f32 = _c_float
  if stages == 1:
    return [], f32(depth)
  down = int(math.pow(float(depth), (stages - 1.0) / stages))
  down_plan, down_cost = poplin_multi_stage_plan(down, stages - 1)
  down_cost = f32(down_cost + f32(f32(depth) / f32(down)))
  up_plan, up_cost = poplin_multi_stage_plan(down + 1, stages - 1)
  up_cost = f32(up_cost + f32(f32(depth) / f32(down + 1)))
  if down_cost < up_cost:
    return [down] + down_plan, down_cost
  return [down + 1] + up_plan, up_cost


def poplin_reduce_add_cycles(out_size: int, partials: int, float_out: bool,
                             float_partials: bool, single_input: bool,
                             data_path_width: int = 64, workers: int = 6) -> int:
  """PE:1560-1637 getReduceCycleEstimate (``constrainPartials`` false: fast reduce off)."""
  acc = 4 if float_partials else 8                                  # PE:1566
  in_path = data_path_width // ((4 if float_partials else 2) * 8)   # PE:1567-1569
  if single_input:
    per_loop = acc // min(acc, in_path)                             # PE:1579-1582
    loops = out_size // acc
    per_worker = loops // workers + (1 if loops % workers else 0)   # PE:1583-1587
    overhead = (8 if float_out else 7) if float_partials else (10 if float_out else 9)
    return (20 + (per_loop * partials + overhead) * per_worker) * workers + 33  # PE:1588-1596
  cycles = 32                                                       # PE:1600
  per_loop = acc // min(acc, in_path) + 1                           # PE:1609-1610
  loops = out_size // acc + sum(1 for i in range(int(math.log2(acc)))
                                if out_size & (1 << i))             # PE:1611-1616
  per_worker = loops // workers                                     # PE:1618
  if loops % workers:                                               # PE:1620-1625
    if out_size & (acc - 1):
      cycles += 2 * partials + (13 if float_partials else 11)
    else:
      per_worker += 1
  loop = (7 if float_partials else 9) if float_out else (6 if float_partials else 8)
  return (cycles + (per_loop * partials + loop) * per_worker) * workers  # PE:1629-1636


def _single_input_fits(partials_bytes: int, memory_bytes: int, element_bytes: int) -> bool:
  """CRPH:16-31 checkPartialsSizeForSingleInputReduce.

  poplar's ``memoryElementOffsets`` are not public: the memory is
  ``memory_bytes`` in elements of ``element_bytes``.
  """
  occupied = -(-partials_bytes // element_bytes)
  return occupied * element_bytes < memory_bytes // 16


def poplin_conv_reduce_stages(output_size: int, depth: int, float_out: bool,
                              float_partials: bool, memory_bytes: int,
                              element_bytes: int = 1) -> list:
  """PE:1836-1912 estimateConvReduceCycles, stage by stage (fast reduce off, CO:53).

  Args:
    output_size: outputs a tile writes (``ceil(partials per tile / depth)``, CM:1162).
    depth: partials an output sums.

  Returns:
    ``[(depth, outputs, cycles)]`` of each stage: its partials, the outputs
    a tile writes and its ReduceAdd estimate.
  """
  stages = []
  remaining, out = depth, output_size * depth                      # PE:1859-1861
  width = 4 if float_partials else 8                                # PE:1862
  p_bytes = 4 if float_partials else 2

  def stage(out, this_depth, is_float_out):
    single = (out % width == 0) and _single_input_fits(
        (this_depth - 1) * out * p_bytes, memory_bytes, element_bytes)  # PE:1872-1881
    return (this_depth, out, poplin_reduce_add_cycles(
        out, this_depth - single, is_float_out, float_partials, single))

  plan = poplin_multi_stage_plan(depth, poplin_num_reduce_stages(depth))[0]
  for d in plan:                                                    # PE:1864-1887
    this_depth = -(-remaining // d)
    remaining = -(-remaining // this_depth)
    out = -(-out // this_depth)
    stages.append(stage(out, this_depth, float_out if remaining == 1 else float_partials))
  if remaining > 1:                                                 # PE:1889-1909
    out = -(-out // remaining)
    stages.append(stage(out, remaining, float_out))
  return stages


def poplibs_scaled_arithmetic_cycles(elements: int, half: bool, operation: str = "add",
                                     workers: int = 6) -> int:
  """poplibs' getScaledArithmeticSupervisorCycleEstimate, worker by worker.

  Half or float ``A`` and ``B`` of one type, ``ONE_PTR`` operands, not
  memory-constrained; ``operation``: add (ScaledAdd), subtract
  (ScaledSubtract), axplusby, axminusby.
  """
  width = 4 if half else 2
  vectors, rem = divmod(elements, width)
  per_worker, rem_vectors = divmod(vectors, workers)
  supervisor = 21 + 11 + (7 if rem == 0 else 13) + 12 + 6
  supervisor += {"add": 0, "subtract": 7, "axplusby": 12, "axminusby": 0}[operation]
  float_axby = not half and operation in ("axplusby", "axminusby")
  busiest = 0
  for wid in range(workers):
    # poplibs gives every worker the even share (``remainingVectors < 0`` is
    # never true), so the remainder vectors are not counted.
    cycles = 16 if float_axby else 15
    if per_worker:
      cycles += 6 + 3 * (per_worker - 1)
    if not float_axby:
      cycles += 2
    if wid == rem_vectors:
      cycles += 1
      if rem:
        if float_axby:
          cycles += 5
        elif not half:
          cycles += 8
        else:
          cycles += 5 + (7 if rem >= 2 else 0) + (6 if rem == 3 else 0)
    busiest = max(busiest, cycles + 1)
  return supervisor + workers * busiest


def poplibs_map_codelet_estimate(elements: int, vector_inputs: int, fused_ops: int,
                                 half: bool, workers: int = 6) -> int:
  """The perf estimate popops sets on a generated map MultiVertex
  (lib/popops/ExpressionGenerator.cpp, ``executeCodelet``): 20, plus per
  input ``(n / vector + n mod vector) x fused ops``, rounded up to a multiple
  of the workers."""
  width = 4 if half else 2
  estimate = 20 + vector_inputs * (elements // width + elements % width) * fused_ops
  return -(-estimate // workers) * workers


def poplibs_ipu_sync_cycles(num_ipus: int, clock_hz: float) -> int:
  """IPUModel's global sync (poplibs_test setGlobalSyncLatency): 15 ns per hop,
  there and back, over one hop within a card plus one per pair of cards."""
  hops = 1 + (num_ipus // 2) // 2
  return math.ceil(15e-9 * clock_hz * hops * 2)
