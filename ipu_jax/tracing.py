"""The target a program is being traced for, for operations that plan while tracing.

Most IPU operations plan in their tile rule, where the rule context holds the
target. A few must plan before that, while the user's function is traced: a
dynamic sparse matmul given a ``BlockCSR`` encodes its pattern into buckets
sized for the target's tiles. ``ipu_jax.jit`` sets the target here while it
traces, so such an operation needs no ``target=`` of its own inside the jit.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

from ipu_jax.kernels.target import IPUTarget

__all__ = ["tracing_for", "tracing_target"]

_TARGET: contextvars.ContextVar[Optional[IPUTarget]] = contextvars.ContextVar(
    "ipu_jax_tracing_target", default=None)


def tracing_target() -> Optional[IPUTarget]:
  """The target of the innermost ``ipu_jax.jit`` tracing now, or None outside one."""
  return _TARGET.get()


@contextlib.contextmanager
def tracing_for(target: IPUTarget) -> Iterator[IPUTarget]:
  """Marks the ``with`` block as tracing a program for ``target`` (nests)."""
  token = _TARGET.set(target)
  try:
    yield target
  finally:
    _TARGET.reset(token)
