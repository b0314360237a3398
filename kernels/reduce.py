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
* a worker with several outputs runs the ``DEFAULT`` specialisation: 59
  cycles of entry and per-reduction setup, then per vector of outputs a
  store (2 cycles per output-width element, 1 more for the accumulators) and
  a pointer fetch (10), and per vector per accumulated input row 9 cycles
  (a 64-bit-aligned accumulator load of 2 + 2 + loads, then 3); remainder
  outputs (fewer than a vector) cost the same per power-of-two piece;
* integer and other types have 1-element "vectors".

The tile pays the busiest worker times the contexts plus the compute set's
launch (``supervisor_overhead_cycles``), like the other worker vertices.
Combining the workers' partial results when a tile has fewer outputs than
workers is not costed (poplibs does it in its next reduction stage, at most
``workers x outputs`` elements).
"""

from __future__ import annotations

import numpy as np

__all__ = ["accumulator_width", "reduce_cycles"]


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


def _default(outputs, rows, acc, path, out_width):
  """One worker reducing ``rows`` input rows onto ``outputs`` contiguous outputs."""
  def store(width):
    return 2 * min(width, out_width) + 1

  vectors, rem = outputs // acc, outputs % acc
  load = 2 + 2 + acc // min(acc, path)
  cycles = 7 + 26 + 16 + 6 + 2
  cycles = cycles + vectors * (5 + store(acc) + 1 + 10) + vectors * rows * (load + 3)
  bit = 1
  while bit < acc:                       # remainder pieces: 1, 2, 4 ... elements
    cycles = cycles + 2                  # the check for this piece
    present = (rem & bit) > 0
    loads = bit // min(bit, path)
    cycles = cycles + np.where(present, 4 + store(bit) + 10 + rows * (2 + loads + 3), 0)
    bit <<= 1
  return cycles


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
  if outputs is None:
    worker_outputs = np.ones_like(elements)
    rows = -(-elements // w)
  else:
    outputs = np.maximum(np.asarray(outputs, np.int64), 1)
    # Outputs per worker; with fewer outputs than workers, the inputs are split.
    worker_outputs = np.where(outputs >= w, -(-outputs // w), outputs)
    rows = np.where(outputs >= w, -(-elements // outputs), -(-(-(-elements // w)) // outputs))
  rows = np.maximum(rows, 1)
  is_fp32 = dtype.kind == "f" and dtype.itemsize == 4
  single = _single_input(rows, acc, path, is_fp32)
  several = _default(worker_outputs, rows, acc, path, path)
  worker = np.where(worker_outputs == 1, single, several)
  cycles = w * worker + target.supervisor_overhead_cycles
  return np.where(elements > 0, cycles, 0).astype(np.float64)
