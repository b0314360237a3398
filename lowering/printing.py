"""Printing tensors on the host, as Poplar's ``PrintTensor`` does: the one printer.

Both ``ipu_jax.ops.print_tensor`` (under plain ``jax.jit``) and the executor's
``PrintTensor`` program (on the emulated IPU) print through
:func:`print_tensor`, so a tensor prints the same line wherever it runs:
``"{title}: [1.0000000 1.5000000]"``, floats with seven decimals, booleans
as ``true``/``false``, one row per line for matrices.
"""

from __future__ import annotations

import functools
import sys

import jax
import numpy as np

__all__ = ["format_tensor", "print_tensor"]


def format_tensor(value) -> str:
  """Format like Poplar's PrintTensor: ``[1.0000000 1.5000000]``."""
  value = np.asarray(value)
  if value.ndim == 0:
    return _format_scalar(value)
  if value.ndim == 1:
    return "[" + " ".join(_format_scalar(v) for v in value) + "]"
  return "[" + ",\n ".join(format_tensor(v) for v in value) + "]"


def _format_scalar(v) -> str:
  v = np.asarray(v)
  if np.issubdtype(v.dtype, np.floating):
    return f"{float(v):.7f}"
  if v.dtype == np.bool_:
    return "true" if bool(v) else "false"
  return str(int(v))


def _write_line(title, value):
  sys.stdout.write(f"{title}: {format_tensor(value)}\n")
  sys.stdout.flush()


def print_tensor(title: str, value) -> None:
  """Prints ``value`` (a traced array) on the host when the program runs.

  The callback is ordered, so prints come out in program order.
  """
  jax.debug.callback(functools.partial(_write_line, title), value, ordered=True)
