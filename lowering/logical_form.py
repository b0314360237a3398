"""A step's function on logical arrays: the form the batched executor runs.

A superstep's ``fn`` maps its reads' tile storages (``[rows, row_size]``) to
its writes' storages. Many steps (elementwise ops, data movements, batched
matmuls and reductions) compute the same values on the tensors' logical
arrays, whatever their layouts: a step's function may carry that form,
``logical_fn(*read_arrays) -> write_arrays`` (each array of its tensor's
shape). The executor keeps tensors logical between
steps (:mod:`~ipu_jax.lowering.executor`) and runs the logical form when a
step has one, so XLA sees the program's arithmetic on the same arrays
``jax.jit`` would, with no conversion to and from tile storage around each
step (pads of short rows, block transposes, gathers of irregular layouts).

Only the layout of the host-side arrays changes: the values are those the
storage function computes on the valid elements (tests compare both), and
every cycle, byte and memory figure comes from the step as lowered.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["attach", "of"]

_ATTRIBUTE = "logical_form"


def attach(fn: Callable, logical_fn: Callable) -> Callable:
  """Give ``fn`` (a step's storage function) its logical form; returns ``fn``.

  Args:
    fn: ``fn(*storages) -> tuple of storages``.
    logical_fn: ``logical_fn(*arrays) -> tuple of arrays``: takes the reads'
      logical arrays (each of its tensor's shape) and returns one per write,
      of its tensor's shape, equal to ``to_flat`` of ``fn``'s result on every
      element (results may be of another dtype: the executor casts, as for
      ``fn``).
  """
  setattr(fn, _ATTRIBUTE, logical_fn)
  return fn


def of(fn: Callable) -> Optional[Callable]:
  """``fn``'s logical form, or None when it has none."""
  return getattr(fn, _ATTRIBUTE, None)
