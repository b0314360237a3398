"""Helpers shared by the IPU custom primitives."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


# The reduced-precision float types (stochastic rounding targets, AMP inputs).
HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

not_mapped = None  # jax marks an unbatched operand with a None batch dim


def _aval(shape, dtype, like=None):
  """A ShapedArray of ``shape``/``dtype`` carrying ``like``'s mesh typing."""
  if like is not None and tuple(like.shape) == tuple(shape):
    return like.update(dtype=np.dtype(dtype), weak_type=False)
  return jax.core.ShapedArray(tuple(shape), np.dtype(dtype))


def _compiled(impl: Callable) -> Callable:
  """An eager impl that runs ``impl`` compiled (as jax's primitives do).

  Eager calls then cost one cached XLA dispatch instead of one per ``jnp``
  op; the parameters are hashable, so they are static arguments.
  """
  cached = functools.lru_cache(maxsize=256)(
      lambda items: jax.jit(functools.partial(impl, **dict(items))))

  def eager(*args, **params):
    return cached(tuple(sorted(params.items())))(*args)

  return eager
