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

The vertex's input type and its output type may differ (poplibs'
``partialsType`` and ``outType``): the first stage of a float32 reduction of
float16 values (a batch norm's statistics, popnn's ``normStatistics``) loads
float16 inputs, 8 to an accumulator operation, and stores float32. The loads
follow the input type; the stores and the second stage follow the output type
(the single-input vertex's 5 cycles of conversion are paid unless the output
is fp32; a strided group's store costs poplibs' figure for a half input and
that output type: 1 + 7 into fp16, 1 + 6 into fp32 for ``add``).

The tile pays the busiest worker times the contexts plus the compute set's
launch (``supervisor_overhead_cycles``), like the other worker vertices.
When a tile has fewer outputs than workers, poplibs combines the workers'
partial results in a second on-tile compute set (``Reduce_Second_Stage``):
one worker per output reduces the ``workers`` partials, costed the same way
(its sync is not: it stays inside the step).

The operation changes the cost the way poplibs' estimators say:

* ``add`` runs on the accumulators (above), and so does ``square_add``
  (poplibs' ``SQUARE_ADD``, the sum of squares: the same loop with
  ``f16v8sqacc`` / ``f32v4sqacc``). poplibs' table of fp16-input store costs
  has no ``SQUARE_ADD`` row (its lookup yields 0, an omission): it takes
  ``add``'s, the other accumulating operation; with fp32 inputs its loop
  completion is 2 cycles, not ``add``'s 3 (``isOpAdd`` in the estimator);
* ``max``, ``min`` and ``mul`` use no accumulators: their vectors are one
  64-bit load wide (4 fp16 or 2 fp32), so a single-output worker's loop
  handles 4 fp16 / 2 fp32 inputs a cycle with a shorter remainder; a
  strided group's completion and store costs what ``add``'s does for fp16
  partials (1 + 7 into fp16) and 2 + 2 instead of 3 + 2 for fp32 partials.
  poplibs' table of fp16 store costs has no ``mul`` row (its lookup yields
  0, an omission); ``mul`` takes ``max``/``min``'s figure, the other
  operations without accumulators;
* ``and``, ``or`` (poplibs' ``LOGICAL_AND``/``LOGICAL_OR``) have no assembly
  vertex: poplibs' C++ ``Reduce`` vertex costs 7 cycles of entry and exit, 24
  to load its two vector lists, 8 per output region, and per partials region
  22 plus 25 per element (24 of C++ overhead and the 1-cycle operation).
  ``xor`` has no poplibs reduction; it is costed like ``and``/``or``, the
  other bitwise combines.

Figures are for a reduction whose output type is its partials type, not an
update (poplibs' ``isUpdate``), as the lowering emits them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["REDUCE_OPS", "accumulator_width", "op_vector_width", "reduce_cycles",
           "reduce_vertex_cycles"]

# Operations on accumulators, on 64-bit vectors, and in C++ vertices.
_ACCUMULATING = ("add", "square_add")
_VECTOR = ("max", "min", "mul")
_LOGICAL = ("and", "or", "xor")
REDUCE_OPS = _ACCUMULATING + _VECTOR + _LOGICAL
"""The operations :func:`reduce_cycles` knows (``jax.lax`` monoid names)."""


def accumulator_width(dtype) -> int:
  """Elements one accumulator operation handles (poplibs' getAccVectorWidth)."""
  dtype = np.dtype(dtype)
  if dtype.kind == "f" and dtype.itemsize == 2:
    return 8
  if dtype.kind == "f" and dtype.itemsize == 4:
    return 4
  return 1


def op_vector_width(op: str, dtype, path: int) -> int:
  """Elements one operation of ``op`` handles (poplibs' opVectorWidth).

  ``path``: elements of ``dtype`` in one 64-bit load. Integer and other
  non-float types have 1-element vectors.
  """
  dtype = np.dtype(dtype)
  if op in _ACCUMULATING or dtype.kind != "f":
    return accumulator_width(dtype)
  return path


def _check_op(op):
  if op not in REDUCE_OPS:
    raise ValueError(f"reduce op {op!r} has no cost: expected one of {REDUCE_OPS}.")


def _strided_post(op, half, out_fp32=False):
  """Cycles completing and storing one strided group (poplibs' cyclesLoopPost).

  ``half``: the inputs are fp16; ``out_fp32``: the outputs are fp32.
  """
  if half:  # inner loop completion + store: add, max and min alike to fp16
    return 1 + (6 if out_fp32 and op in _ACCUMULATING else 7)
  return (3 if op == "add" else 2) + 2


def _logical(regions, elements):
  """poplibs' C++ ``Reduce`` vertex: ``elements`` inputs in ``regions`` onto one output region."""
  return 7 + 24 + 8 + regions * 22 + 25 * elements


def _single_input(n, acc, path, is_fp32):
  """One worker reducing ``n`` contiguous inputs to one output.

  ``acc``: the operation's vector width (:func:`op_vector_width`).
  """
  per_cycle = min(acc, path)
  loads = acc // per_cycle
  per_loop = max(loads, 1)
  per_iteration = per_cycle * loads
  cycles = 3 + 6 + (per_loop * n) // per_iteration + 5 + n % per_iteration + 3
  return cycles + (0 if is_fp32 else 5)


def _strided(outputs, rows, acc, path, post, stride):
  """One worker's ``STRIDED_REDUCE`` vertex: ``rows`` partial rows onto ``outputs``.

  ``acc``: the operation's vector width; ``post``: a group's completion and
  store (:func:`_strided_post`). ``stride`` is the length of a partial row
  (the tile's outputs): a group must stay 64-bit aligned from row to row, so
  it is at most the largest common divisor of the load width and the stride.
  """
  # 5 cycles entry/exit, 11 of loop setup; per group of outputs loaded in one
  # cycle: 3 of loop, the completion and store, 3 more and one cycle per
  # accumulated row after the first.
  per_loop = np.gcd(min(acc, path), stride)
  outer = 3 + post + 3 + (rows - 1)
  return 5 + 11 + outer * -(-outputs // per_loop)


def reduce_vertex_cycles(target, outputs: int, rows: int, dtype, op: str = "add",
                         out_dtype=None) -> int:
  """One worker's reduce vertex: ``rows`` partials of ``op`` onto each of ``outputs`` outputs.

  ``dtype``: the inputs' type; ``out_dtype``: the outputs' (default ``dtype``).
  """
  _check_op(op)
  dtype = np.dtype(dtype)
  out_fp32 = _is_fp32(dtype if out_dtype is None else out_dtype)
  path = max(1, int(target.vector_width_bytes) // dtype.itemsize)
  width = op_vector_width(op, dtype, path)
  rows = max(int(rows), 1)
  outputs = int(outputs)
  if op in _LOGICAL:
    return int(_logical(1 if outputs <= 1 else rows, max(outputs, 1) * rows))
  if outputs <= 1:
    return int(_single_input(rows, width, path, out_fp32))
  return int(_strided(outputs, rows, width, path,
                      _strided_post(op, _is_half(dtype), out_fp32), outputs))


def _is_fp32(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype.kind == "f" and dtype.itemsize == 4


def _is_half(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype.kind == "f" and dtype.itemsize == 2


def reduce_cycles(target, elements, outputs, dtype, op: str = "add",
                  out_dtype=None) -> np.ndarray:
  """Tile cycles of popops' ``Reduce`` vertices: ``elements`` inputs onto ``outputs``.

  Args:
    target: the IPU target (worker contexts, 64-bit data path).
    elements: ``[num_tiles]`` inputs each tile reduces.
    outputs: ``[num_tiles]`` outputs each tile produces, or ``None``: each
      worker reduces its share of the inputs to one value.
    dtype: the inputs' type (poplibs' ``partialsType`` of the vertex).
    op: the combining operation, one of :data:`REDUCE_OPS`.
    out_dtype: the outputs' type (poplibs' ``outType``), by default ``dtype``.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has no inputs).
  """
  _check_op(op)
  elements = np.asarray(elements, np.int64)
  dtype = np.dtype(dtype)
  out_dtype = dtype if out_dtype is None else np.dtype(out_dtype)
  if outputs is not None:
    outputs = np.asarray(outputs, np.int64)
  # Every figure is per tile and zero off the tiles with inputs: on several
  # IPUs most of a reduction's [num_tiles] arrays are idle tiles, so the
  # estimate runs on the busy ones only and is scattered back.
  if outputs is not None and outputs.shape != elements.shape:
    return _busy_reduce_cycles(target, elements, outputs, dtype, op, out_dtype)
  busy = np.flatnonzero(elements.reshape(-1) > 0)
  if busy.size == elements.size:
    return _distinct_reduce_cycles(target, elements.reshape(-1),
                                   None if outputs is None else outputs.reshape(-1), dtype,
                                   op, out_dtype).reshape(elements.shape)
  cycles = np.zeros(elements.size, np.float64)
  cycles[busy] = _distinct_reduce_cycles(target, elements.reshape(-1)[busy],
                                         None if outputs is None else outputs.reshape(-1)[busy],
                                         dtype, op, out_dtype)
  return cycles.reshape(elements.shape)


# Tiles past which the estimate is made once for the figures most of them share.
_DISTINCT_AFTER = 64


def _distinct_reduce_cycles(target, elements, outputs, dtype, op, out_dtype) -> np.ndarray:
  """:func:`_busy_reduce_cycles` on ``[n]`` tiles, once for the pair most share.

  The estimate of a tile depends on its own inputs and outputs only, and a
  reduction spread over thousands of tiles mostly holds one pair of them
  (equal shares, a shorter last one): when the first tile's pair is most
  tiles', its few dozen array passes run on that pair and on the other
  tiles only.
  """
  n = elements.size
  if n <= _DISTINCT_AFTER:
    return _busy_reduce_cycles(target, elements, outputs, dtype, op, out_dtype)
  same = elements == elements[0]
  if outputs is not None:
    same &= outputs == outputs[0]
  others = np.flatnonzero(~same)
  if 2 * others.size > n:
    return _busy_reduce_cycles(target, elements, outputs, dtype, op, out_dtype)
  pick = lambda a, where: None if a is None else a[where]
  cycles = np.empty(n, np.float64)
  cycles[:] = _busy_reduce_cycles(target, elements[:1], pick(outputs, slice(0, 1)), dtype, op,
                                  out_dtype)[0]
  if others.size:
    cycles[others] = _busy_reduce_cycles(target, elements[others], pick(outputs, others), dtype,
                                         op, out_dtype)
  return cycles


def _busy_reduce_cycles(target, elements, outputs, dtype, op, out_dtype) -> np.ndarray:
  """:func:`reduce_cycles` on int64 ``elements`` (``outputs``: int64 or None)."""
  w = target.worker_contexts
  path = max(1, int(target.vector_width_bytes) // dtype.itemsize)
  acc = op_vector_width(op, dtype, path)
  is_fp32 = _is_fp32(out_dtype)
  post = _strided_post(op, _is_half(dtype), is_fp32)
  logical = op in _LOGICAL
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
    if logical:  # one partials region per row, one for a single output's inputs
      cycles = _logical(np.where(worker_outputs == 1, 1, rows), worker_outputs * rows)
    else:
      single = _single_input(rows, acc, path, is_fp32)
      several = _strided(worker_outputs, np.maximum(rows, 1), acc, path, post, stride)
      cycles = np.where(worker_outputs == 1, single, several)
    worker = np.maximum(worker, np.where((worker_outputs > 0) & (rows > 0), cycles, 0))
  cycles = w * worker + target.supervisor_overhead_cycles
  if outputs is not None:
    split = (outputs < w) & (elements > outputs)
    partials = np.full_like(elements, w)
    # The workers' partials are of the output type.
    out_path = max(1, int(target.vector_width_bytes) // out_dtype.itemsize)
    second = w * (_logical(1, partials) if logical
                  else _single_input(partials, op_vector_width(op, out_dtype, out_path),
                                     out_path, is_fp32))
    cycles = cycles + np.where(split, second + target.supervisor_overhead_cycles, 0)
  return np.where(elements > 0, cycles, 0).astype(np.float64)
