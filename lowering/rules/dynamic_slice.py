"""``dynamic_slice`` and ``dynamic_update_slice``: windows at run-time offsets.

A dynamic slice is a gather of one window: the start indices are broadcast to
the operand's tiles, which serve the window's elements (the served plan of
:mod:`~ipu_jax.lowering.indexing`); the result is mapped linearly. A
dynamic update overwrites the window in place on the operand's tiles. With
compile-time-constant starts both are static movements with exact exchange.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.indexing import (copy_of, is_constant, served_lookup, served_update,
                                       static_sources)


@register_lowering(lax.dynamic_slice_p)
def _dynamic_slice(ctx: RuleContext, operand, *indices, slice_sizes):
  """A window at run-time offsets: each operand tile serves its part."""
  params = dict(slice_sizes=slice_sizes)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype)
  if out.size == 0:
    return [out]
  static = None
  if all(is_constant(t) for t in indices):
    starts = [np.asarray(t.value).reshape(()) for t in indices]
    static = static_sources(
        lambda ids: lax.dynamic_slice(ids, [jnp.asarray(s) for s in starts], slice_sizes),
        operand.shape)
  served_lookup(ctx, lax.dynamic_slice_p, params, operand, indices, out,
                num_lookups=1, codelet=vocab.DYNAMIC_SLICE, static_source=static,
                estimator=estimators.dynamic_slice_cycles)
  return [out]


@register_lowering(lax.dynamic_update_slice_p)
def _dynamic_update_slice(ctx: RuleContext, operand, update, *indices):
  """Overwrite a window at run-time offsets, in place on the operand's tiles."""
  if operand.size == 0:
    return [ctx.like(operand)]
  if update.size == 0:
    return copy_of(ctx, operand)
  out = ctx.like(operand)
  static = None
  if all(is_constant(t) for t in indices):
    starts = [np.asarray(t.value).reshape(()) for t in indices]
    static = static_sources(
        lambda a, b: lax.dynamic_update_slice(a, b, [jnp.asarray(s) for s in starts]),
        operand.shape, update.shape)
  served_update(ctx, lax.dynamic_update_slice_p, {}, [operand, update, *indices], operand,
                list(indices), update, out, num_lookups=1,
                codelet=vocab.DYNAMIC_UPDATE_SLICE, static_source=static,
                estimator=estimators.dynamic_slice_cycles)
  return [out]
