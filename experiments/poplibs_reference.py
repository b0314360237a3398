"""PopLibs' published cycle estimators, evaluated in full: the calibration's references.

``experiments/calibration.py`` holds the emulator's vectorised models
(``kernels/amp.py``, ``kernels/reduce.py``, ``kernels/popops.py``) against
these: Graphcore's estimator functions written out case by case (per-worker
partition, short-row cases, state retention, supervisor loops), each naming
the PopLibs source it follows.
"""

from __future__ import annotations

import math

# The static model's compute-set launch: poplin's supervisor non-loop overhead.
SUPERVISOR = 50

# ---------------------------------------------------------------------------
# The poplibs reference: the published ConvPartial1x1 estimator, in full.
# ---------------------------------------------------------------------------


def _worker_rows(rows: int, workers: int) -> list:
  base, extra = divmod(rows, workers)
  return [base + (i < extra) for i in range(workers)]


def poplibs_amp_matmul_cycles(rows: int, k: int, n: int, half: bool, conv_units: int,
                              workers: int = 6) -> int:
  """poplin's ConvPartial1x1 estimate of ``[rows, k] x [k, n]`` (fp32 partials).

  The structure and constants follow poplibs' published estimator for the
  AMP 1x1 convolution-partials vertex with float partials (input channel group
  16 for half, 8 for float; output group = ``conv_units``).
  """
  in_chans = 16 if half else 8
  in_groups = -(-k // in_chans)
  out_groups = -(-n // conv_units)
  common = True                     # float partials: the common code path
  retention = (7, 3) if half else (0, 0)
  zero_per_row = 8 if conv_units == 16 else 4

  def worker(e, zeroing):
    if e == 0:
      return 0
    if half:
      table = {1: 31, 2: 40}
      c = (table[e] + (1 if zeroing else 2)) if e < 3 else (
          (37 if zeroing else 38) + (e - 3) * 4)
    else:
      if e == 1:
        c = 47 + (2 + zero_per_row) * zeroing
      elif e == 2:
        c = 46 + (2 + zero_per_row * 2) * zeroing
      else:
        c = 46 + (2 + zero_per_row * e) * zeroing + (e - 3) * 8
    return c - retention[0]

  def inner(zeroing):
    cycles = [workers * worker(e, zeroing) for e in _worker_rows(rows, workers)]
    used = sum(e > 0 for e in _worker_rows(rows, workers))
    low = 0 if used < workers else min(cycles)
    return max(max(cycles), low + 14)

  loads = conv_units * 32 // 16
  c = int(common)
  inner_z, inner_nz = inner(True), inner(False)
  return (50 + workers * (retention[0] + retention[1] * (in_groups - 1))
          + 12 + c
          + (in_groups - 1) * (15 - c + 1 + out_groups * (19 + 6 + loads + inner_nz))
          + (10 + 1 + out_groups * (19 - c + 7 + loads + inner_z)))


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
