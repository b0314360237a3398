"""Defining an IPU custom primitive: its impl, abstract eval, batching and lowering to XLA."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, batching, mlir


# The reduced-precision float types (stochastic rounding targets, AMP inputs).
HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

not_mapped = None  # jax marks an unbatched operand with a None batch dim


def shaped_like(shape, dtype, like=None):
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


def define_primitive(prim, impl: Callable, abstract_eval: Callable, *, jvp=None, batch=None,
                     fancy_batch=None, effectful=False, multiple_results=False):
  """Give ``prim`` its eager implementation, abstract evaluation, JVP and
  batching rules, and its XLA lowering.

  ``impl`` serves twice: compiled as the eager implementation, and as the
  XLA lowering (``mlir.lower_fun``), so ``jax.jit`` off the IPU computes what
  the IPU lowering must match. ``effectful`` marks an ``abstract_eval`` that
  also returns effects; ``fancy_batch`` is a batching rule that receives the
  vmapped axis's data first.
  """
  prim.def_impl(_compiled(impl))
  if effectful:
    prim.def_effectful_abstract_eval(abstract_eval)
  else:
    prim.def_abstract_eval(abstract_eval)
  if jvp is not None:
    ad.primitive_jvps[prim] = jvp
  if batch is not None:
    batching.primitive_batchers[prim] = batch
  if fancy_batch is not None:
    batching.fancy_primitive_batchers[prim] = fancy_batch
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))
