"""Identities, compiler hints and host callbacks.

Tile plan:

* ``optimization_barrier``, ``sharding_constraint``, ``device_put``,
  ``stop_gradient``, ``name`` (``checkpoint_name``), ``pvary``,
  ``random_clone``-like identities change nothing in tile memory: the result
  *is* the operand's tensor, so they cost nothing (no step, no copy). A tensor
  is never written after it is produced except as a loop carry, and loop
  rules copy carries explicitly, so sharing the tensor is safe.
* ``platform_index`` (``lax.platform_dependent``) is resolved at compile time
  to the branch of the platform the emulator runs on, so the numbers equal
  those of ``jax.jit`` on that platform.
* ``empty`` / ``empty2`` (uninitialised buffers, e.g. the residual
  placeholders of a differentiated ``cond``) allocate and write nothing.
* ``debug_callback`` / ``debug_print`` run as a step that reads the operands
  (as the IPU streams them to the host) and binds the primitive with the
  user's parameters, so ordering (``ordered=True``) and formatting are JAX's.
"""

from __future__ import annotations

import numpy as np

import jax

from ipu_jax.lowering.jax_compat import (ad_checkpoint, core, custom_derivatives, debugging, dispatch,
                                pjit, lax_internal, physical_shape_dtype)
from ipu_jax.lowering.jax_compat import control_flow as cf
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering


def _identity(ctx: RuleContext, *operands, **params):
  del ctx, params
  return list(operands)


def _platform_names() -> set:
  backend = jax.default_backend()
  names = {backend}
  if backend == "gpu":
    names |= {"cuda", "rocm"}
  return names


def _platform_index(ctx: RuleContext, *, platforms, **params):
  del params
  names = _platform_names()
  index = next((i for i, group in enumerate(platforms)
                if group is not None and names & set(group)), None)
  if index is None:
    index = next((i for i, group in enumerate(platforms) if group is None), None)
  if index is None:
    raise NotImplementedError(
        f"platform_dependent has no branch for platform(s) {sorted(names)} "
        f"and no default")
  return [ctx.constant(np.int32(index))]


def _empty(ctx: RuleContext, **params):
  """An uninitialised buffer (``lax.empty``, grad residual placeholders).

  It costs nothing on the IPU: memory is allocated, nothing is written. The
  executor reads never-written storage as zeros, which is what XLA gives on
  CPU for these buffers.
  """
  del params
  shape, dtype = physical_shape_dtype(ctx.out_avals[0])
  if int(np.prod(shape, dtype=np.int64)) <= 1:
    return [ctx.constant(np.zeros(shape, dtype))]
  return [ctx.new_tensor(shape, dtype, name="empty")]


def _host_callback_rule(primitive):
  """A step that hands the operands to the host and runs the callback."""

  def rule(ctx: RuleContext, *operands, **params):
    tensors = tuple(operands)

    def fn(*storages):
      args = [logical(s, t) for s, t in zip(storages, tensors)]
      primitive.bind(*args, **params)
      return ()

    # The host reads the operands where they lie; nothing moves between
    # tiles, so the step costs only its sync.
    ctx.emit(P.Superstep(name=primitive.name, op=ctx.op, reads=tensors, writes=(),
                         fn=fn))
    return [ctx.new_tensor(a.shape, a.dtype) for a in ctx.out_avals]

  return rule


def _register():
  identities = [
      cf.optimization_barrier_p,
      pjit.sharding_constraint_p,
      pjit.layout_constraint_p,
      pjit.reshard_p,
      dispatch.device_put_p,
      custom_derivatives.stop_gradient_p,
      ad_checkpoint.name_p,
      core.pvary_p,
  ]
  for prim in identities:
    register_lowering(prim, _identity)
  register_lowering(cf.platform_index_p, _platform_index)
  for prim in (lax_internal.empty_p, lax_internal.empty2_p):
    register_lowering(prim, _empty)
  for prim in (debugging.debug_callback_p, debugging.debug_print_p):
    register_lowering(prim, _host_callback_rule(prim))


_register()
