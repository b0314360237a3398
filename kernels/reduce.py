"""Cycles of popops' reduction vertices, from poplibs' published estimators.

The structure and constants follow poplibs'
``lib/popops/reduction/CycleEstimationFunctions.cpp`` for the vectorised
(assembly) ``Reduce`` vertices of ``add``, ``mul``, ``max``, ``min``:

* a tile's outputs are dealt to its worker contexts (poplibs makes one
  reduce vertex per worker); when a tile has fewer outputs than workers,
  each worker reduces a share of every output's inputs instead;
* a worker with a single output runs the ``SCALAR_OUTPUT_SINGLE_INPUT``
  specialisation: 9 cycles of entry and setup, then the inputs at the
  accumulator width (8 fp16 or 4 fp32 a loop, a loop costing as many cycles
  as 64-bit loads it needs), 1 cycle per element left over, 8 to sum the
  accumulators (5 more unless the output is fp32);
* a worker with several outputs runs the ``STRIDED_REDUCE`` specialisation,
  poplibs' vertex for partials laid out as rows of the outputs: 16 cycles of
  entry and setup, then per group of outputs one 64-bit load wide (4 fp16 or
  2 fp32; fewer when the tile's row of outputs is not a multiple of it)
  3 cycles of loop, the group's completion and store (8 cycles for fp16
  partials, 5 otherwise), 3 more and 1 cycle per accumulated row after the
  first. Contiguous row reductions (``ALL_REGIONS_CONTINUOUS``) cost about
  the same per element, so the estimator does not need the layout; the
  general ``DEFAULT`` vertex, used only for irregular regions, is dearer;
* integer and other types have 1-element "vectors".

The tile pays the busiest worker times the contexts plus the compute set's
launch (``supervisor_overhead_cycles``), like the other worker vertices.
When a tile has fewer outputs than workers, poplibs combines the workers'
partial results in a second on-tile compute set (``Reduce_Second_Stage``):
one worker per output reduces the ``workers`` partials, costed the same way
(its sync is not: it stays inside the step).

The operation is not known here: every reduction is costed as ``add`` on the
accumulators (poplibs' ``max``/``min`` vertices differ by a cycle or two per
group of outputs).
"""

from __future__ import annotations

import numpy as np

__all__ = ["accumulator_width", "reduce_cycles", "reduce_vertex_cycles"]


def accumulator_width(dtype) -> int:
  """Elements one accumulator operation handles (poplibs' getAccVectorWidth)."""
  dtype = np.dtype(dtype)
  if dtype.kind == "f" and dtype.itemsize == 2:
    return 8
  if dtype.kind == "f" and dtype.itemsize == 4:
    return 4
  return 1


def _single_input(n, acc, path, is_fp32):
  """One worker reducing ``n`` contiguous inputs to one output."""
  per_cycle = min(acc, path)
  loads = acc // per_cycle
  per_loop = max(loads, 1)
  per_iteration = per_cycle * loads
  cycles = 3 + 6 + (per_loop * n) // per_iteration + 5 + n % per_iteration + 3
  return cycles + (0 if is_fp32 else 5)


def _strided(outputs, rows, acc, path, half, stride):
  """One worker's ``STRIDED_REDUCE`` vertex: ``rows`` partial rows onto ``outputs``.

  ``stride`` is the length of a partial row (the tile's outputs): a group
  must stay 64-bit aligned from row to row, so it is at most the largest
  common divisor of the load width and the stride.
  """
  # 5 cycles entry/exit, 11 of loop setup; per group of outputs loaded in one
  # cycle: 3 of loop, the result's completion and store (8 for fp16
  # partials, 5 otherwise), 3 more and one cycle per accumulated row after
  # the first.
  per_loop = np.gcd(min(acc, path), stride)
  post = 8 if half else 5
  outer = 3 + post + 3 + (rows - 1)
  return 5 + 11 + outer * -(-outputs // per_loop)


def reduce_vertex_cycles(target, outputs: int, rows: int, dtype) -> int:
  """One worker's reduce vertex: ``rows`` partials onto each of ``outputs`` outputs."""
  dtype = np.dtype(dtype)
  acc = accumulator_width(dtype)
  path = max(1, int(target.vector_width_bytes) // dtype.itemsize)
  rows = max(int(rows), 1)
  if outputs <= 1:
    return int(_single_input(rows, acc, path, dtype.kind == "f" and dtype.itemsize == 4))
  return int(_strided(int(outputs), rows, acc, path, dtype.kind == "f" and dtype.itemsize == 2,
                      int(outputs)))


def reduce_cycles(target, elements, outputs, dtype) -> np.ndarray:
  """Tile cycles of popops' ``Reduce`` vertices: ``elements`` inputs onto ``outputs``.

  Args:
    target: the IPU target (worker contexts, 64-bit data path).
    elements: ``[num_tiles]`` inputs each tile reduces.
    outputs: ``[num_tiles]`` outputs each tile produces, or ``None``: each
      worker reduces its share of the inputs to one value.
    dtype: the partials' type (the type accumulated in).

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has no inputs).
  """
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  dtype = np.dtype(dtype)
  acc = accumulator_width(dtype)
  path = max(1, int(target.vector_width_bytes) // dtype.itemsize)
  half = dtype.kind == "f" and dtype.itemsize == 2
  is_fp32 = dtype.kind == "f" and dtype.itemsize == 4
  if outputs is None:
    stride = np.ones_like(elements)
    shares = [(stride, -(-elements // w)), (stride, elements // w)]
  else:
    outputs = np.maximum(np.asarray(outputs, np.int64), 1)
    stride = outputs
    # Outputs per worker; with fewer outputs than workers, the inputs are
    # split. Workers get the ceiling or the floor of an even share, and a
    # smaller share can cost more (its remainder loop), so both are costed.
    rows = -(-elements // outputs)
    shares = [(np.where(outputs >= w, -(-outputs // w), outputs),
               np.where(outputs >= w, rows, -(-(-(-elements // w)) // outputs))),
              (np.where(outputs >= w, outputs // w, outputs),
               np.where(outputs >= w, rows, (elements // w) // outputs))]
  worker = np.zeros(elements.shape, np.int64)
  for worker_outputs, rows in shares:
    single = _single_input(rows, acc, path, is_fp32)
    several = _strided(worker_outputs, np.maximum(rows, 1), acc, path, half, stride)
    cycles = np.where(worker_outputs == 1, single, several)
    worker = np.maximum(worker, np.where((worker_outputs > 0) & (rows > 0), cycles, 0))
  cycles = w * worker + target.supervisor_overhead_cycles
  if outputs is not None:
    split = (outputs < w) & (elements > outputs)
    second = w * _single_input(np.full_like(elements, w), acc, path, is_fp32)
    cycles = cycles + np.where(split, second + target.supervisor_overhead_cycles, 0)
  return np.where(elements > 0, cycles, 0).astype(np.float64)
