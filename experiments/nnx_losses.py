"""An NNX model's loss as a pure function a ``Pipeline`` (or ``jax.grad``) takes.

:func:`pure_loss` splits a Flax NNX model into its weights and the rest and
returns ``(loss_fn, params)``: the model is merged back on every call, inside
:func:`ipu_jax.nnx_scopes.module_scopes`, so its operations carry the module
paths a pipeline's ``stage_assignment`` places on stages. With dropout, the
loss takes a key and every random stream of the model (its ``nnx.Dropout``
layers) starts from it, so the loss stays a pure function of its arguments
(a ``Pipeline(..., rng=True)`` gives each micro-batch its own key, the key
plain accumulation gives it too). The BERT and GPT-2 runners share it.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import ipu_jax

__all__ = ["pure_loss"]


def _concrete_counter(value):
  """A random stream's counter as an array, also when the model is abstract.

  Under ``nnx.eval_shape`` (the runners' ``--estimate_only``) the counter is
  a ``jax.ShapeDtypeStruct``, which ``nnx.Dropout`` cannot read. It becomes a
  zero array made here, outside the loss's trace, so the traced program
  holds it as it holds a real model's counter (an array captured as a
  constant); made inside the trace it would be a fill step and a folded
  constant, and the estimate would differ from a run's. Keys are left: the
  loss's ``rng`` replaces them.
  """
  if isinstance(value, jax.ShapeDtypeStruct) and not jax.dtypes.issubdtype(
      value.dtype, jax.dtypes.prng_key):
    return jnp.zeros(value.shape, value.dtype)
  return value


def pure_loss(model: nnx.Module, loss_of: Callable, dropout: bool = False):
  """``(loss_fn, params)`` of ``model``.

  Args:
    model: a Flax NNX module called as ``model(batch, deterministic=...)``.
    loss_of: ``loss_of(outputs, batch) -> scalar``, ``outputs`` being what the
      model's call returns.
    dropout: draw the model's dropout masks (``deterministic=False``); then
      ``loss_fn(params, batch, rng)``, else ``loss_fn(params, batch)``.
  """
  graphdef, params, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  rng_state = jax.tree_util.tree_map(_concrete_counter, rng_state)

  def run(params, batch, rng_values):
    module = nnx.merge(graphdef, params, rng_values, rest)
    with ipu_jax.nnx_scopes.module_scopes(module):
      outputs = module(batch, deterministic=not dropout)
    return loss_of(outputs, batch)

  if not dropout:
    return (lambda params, batch: run(params, batch, rng_state)), params

  def loss_fn(params, batch, rng):
    keys = jax.tree_util.tree_map(
        lambda v: rng if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v, rng_state)
    return run(params, batch, keys)

  return loss_fn, params
