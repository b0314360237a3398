"""Checks of user arguments shared by the API's entry points.

The same mistakes reach several entry points -- a count below its least
value, an optimizer that is not an optax ``GradientTransformation``, tile ids
that are not integers -- and each is refused the same way wherever it arrives,
naming the argument and what it takes, before anything is traced or run.
"""

from __future__ import annotations

import numbers
from typing import Optional, Tuple, Type

import numpy as np

__all__ = ["check_count", "check_optimizer", "tile_ids"]


def check_count(what: str, value, least: int = 1, none: Optional[str] = None) -> None:
  """``value`` is an int ``>= least`` (or None, when ``none`` says what None means).

  Raises:
    ValueError: naming ``what``, its least value and what None means.
  """
  if value is None and none is not None:
    return
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
    also = f" (or None: {none})" if none is not None else ""
    raise ValueError(f"{what} must be an int >= {least}{also}; got {value!r}.")


def check_optimizer(optimizer, who: str = "", error: Type[Exception] = TypeError) -> None:
  """``optimizer`` is an optax ``GradientTransformation`` (has ``init`` and ``update``).

  Args:
    who: the entry point, the message's prefix (e.g. ``"Pipeline: "``).
    error: the exception type the entry point raises for its bad arguments.
  """
  if not (callable(getattr(optimizer, "init", None))
          and callable(getattr(optimizer, "update", None))):
    raise error(f"{who}optimizer must be an optax GradientTransformation (e.g. "
                f"optax.adam(1e-3)); got {type(optimizer).__name__}: {optimizer!r}.")


def tile_ids(tiles, who: str = "") -> Tuple[int, ...]:
  """``tiles`` (tuple, list, NumPy array of ints) as a tuple of Python ints.

  Raises:
    TypeError: ids that are not integers (a float would be truncated, a
      string parsed).
  """
  array = np.asarray(tiles)
  if array.size and not np.issubdtype(array.dtype, np.integer):
    raise TypeError(f"{who}tile ids must be integers; got {tiles!r}.")
  return tuple(int(t) for t in array.astype(np.int64).reshape(-1))
