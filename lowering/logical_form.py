"""The older way to give a step its logical form: an attribute of its ``fn``.

A step's form on logical arrays is the declared field
:attr:`~ipu_jax.lowering.program.Superstep.logical` (its docstring says what
the form is and when the executor runs it). Steps built by
``lowering/builders.py`` (elementwise) and ``lowering/matmul_emit.py`` still
attach it to their ``fn`` here, in ``"batched"`` mode only; :func:`of_step`
reads both. This module goes once they set the field (``of_step(s)`` is then
``s.logical``).
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["attach", "of", "of_step"]

_ATTRIBUTE = "logical_form"


def attach(fn: Callable, logical_fn: Callable) -> Callable:
  """Give ``fn`` (a step's storage function) its logical form; returns ``fn``.

  Args:
    fn: ``fn(*storages) -> tuple of storages``.
    logical_fn: the form, as for ``Superstep.logical``.
  """
  setattr(fn, _ATTRIBUTE, logical_fn)
  return fn


def of(fn: Callable) -> Optional[Callable]:
  """``fn``'s logical form, or None when it has none."""
  return getattr(fn, _ATTRIBUTE, None)


def of_step(step) -> Optional[Callable]:
  """A superstep's logical form: its ``logical`` field, else one attached to its ``fn``."""
  return step.logical if step.logical is not None else of(step.fn)
