"""The tile programs of a Keras-like model: one execution of train, eval or predict.

Each ``*_execution`` function returns the pure JAX function that one call of
the device runs for ONE replica; :func:`build_program` lowers it with
``ipu_jax.jit`` (or plain JAX when not emulating) and wraps it for every
replica with :class:`~ipu_jax.keras.replication.Replication`.

* train: ``lax.scan`` over the U weight updates of the execution (lowered to a
  ``Repeat``); each update scans over its G micro-batches, accumulates the
  gradients (:mod:`ipu_jax.keras.accumulation`), all-reduces them over the R
  replicas and applies the optimizer. Returns the new training state and the
  summed loss/metric values ``[loss, metrics..., count]``.
* eval: ``lax.scan`` over the micro-batches summing masked loss and metrics
  (padding samples have mask 0, so every sample counts once).
* predict: ``lax.scan`` over the micro-batches stacking the outputs.

Arguments are either the same on every replica (``REPLICATED``: weights,
optimizer state) or split over them (``SHARDED``: data, replica ids).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ipu_jax.keras import accumulation as acc_lib
from ipu_jax.keras import loss_scaling
from ipu_jax.keras import offload as offload_lib
from ipu_jax.keras.replication import (GATHERED, REPLICATED, SHARDED, SUMMED, Replication,
                                       cross_replica_mean, cross_replica_sum)

__all__ = ["build_program", "train_execution", "eval_execution", "predict_execution",
           "per_sample_loss", "run_setup", "shape_key", "TRAIN_KINDS", "EVAL_KINDS",
           "PREDICT_KINDS", "sharded_train_kinds", "train_out_kinds", "eval_out_kinds", "predict_out_kinds"]

# How each argument of an execution is placed on the replicas, in order.
TRAIN_KINDS = (REPLICATED,) * 6 + (SHARDED,) * 3  # params, opt, state, rng, step, key | xs, ys, ids
EVAL_KINDS = (REPLICATED,) * 3 + (SHARDED,) * 3   # params, state, rng | xs, ys, mask
PREDICT_KINDS = (REPLICATED,) * 3 + (SHARDED,)    # params, state, rng | xs


def train_out_kinds(out_tree) -> list:
  """The new training state is replicated; the loss/metric sums are summed."""
  return [REPLICATED] * (out_tree.num_leaves - 1) + [SUMMED]


def sharded_train_kinds(params, opt_state):
  """Input kinds and output kinds of a training execution whose optimizer
  state is sharded over the replicas (each replica's shard comes back stacked)."""
  kinds = list(TRAIN_KINDS)
  kinds[1] = SHARDED
  n_params, n_opt = len(jax.tree.leaves(params)), len(jax.tree.leaves(opt_state))

  def out_kinds(out_tree):
    kinds_out = train_out_kinds(out_tree)
    kinds_out[n_params:n_params + n_opt] = [GATHERED] * n_opt
    return kinds_out

  return tuple(kinds), out_kinds


def eval_out_kinds(out_tree) -> list:
  return [SUMMED] * out_tree.num_leaves


def predict_out_kinds(out_tree) -> list:
  return [GATHERED] * out_tree.num_leaves


def shape_key(tree):
  """Shapes and dtypes of a pytree of arrays: part of a program's cache key."""
  return jax.tree.map(lambda a: (a.shape, str(a.dtype)), tree)


def _vector(scalars):
  """A float32 vector of scalars (concatenate, which every lowering knows)."""
  return jnp.concatenate([jnp.reshape(jnp.asarray(s, jnp.float32), (1,)) for s in scalars])


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def per_sample_loss(loss: Callable, y, y_pred):
  """``loss(y, y_pred)`` as one value per sample (a batch mean is broadcast)."""
  values = jnp.asarray(loss(y, y_pred))
  batch = jax.tree.leaves(y_pred)[0].shape[0]
  if values.ndim == 0:  # a callable giving the batch mean
    values = jnp.broadcast_to(values, (batch,))
  return values.reshape(batch, -1).mean(axis=1) if values.ndim > 1 else values


def train_execution(adapter, optimizer, loss: Callable, metric_fns: Sequence,
                    accumulation_steps: int, accumulation_reduction: str,
                    replicas: int, replica_reduction: str, *,
                    sharded_state: bool = False) -> Callable:
  """One training execution for one replica.

  With ``sharded_state`` (replicated tensor sharding) each replica holds 1/R
  of the optimizer state: gradients are reduce-scattered, each replica
  updates its shard and the new weights are all-gathered
  (:func:`ipu_jax.keras.offload.sharded_update`) instead of an all-reduce.

  Returns:
    ``execution(params, opt_state, state, rng_state, step, base_key, xs, ys,
    replica)`` with ``xs``/``ys`` laid out ``[U, G, b, ...]``; it returns
    ``(params, opt_state, state, step, sums)``.
  """
  G, R, method = accumulation_steps, replicas, accumulation_reduction
  needs_rng = adapter.needs_rng

  def execution(params, opt_state, state, rng_state, step, base_key, xs, ys, replica):
    def micro(params, state, x, y, micro_step, loss_scale):
      # Dropout keys differ per micro-batch and replica, and are reproducible.
      rng = (base_key, (micro_step, replica)) if needs_rng else None

      def objective(p):
        y_pred, new_state = adapter.apply(p, state, rng_state, x, True, rng)
        per_sample = per_sample_loss(loss, y, y_pred)
        objective_value = jnp.mean(per_sample)
        if loss_scale is not None:  # the optimizer is a LossScaleOptimizer
          objective_value = objective_value * loss_scale.astype(objective_value.dtype)
        return objective_value, (y_pred, new_state, per_sample)

      (_, (y_pred, new_state, per_sample)), grads = jax.value_and_grad(
          objective, has_aux=True)(params)
      sums = [jnp.sum(per_sample)] + [jnp.sum(m(y, y_pred)) for m in metric_fns]
      sums.append(jnp.asarray(per_sample.shape[0], jnp.float32))
      return grads, new_state, _vector(sums)

    def update(carry, batch):
      params, opt_state, state, step = carry
      xg, yg = batch
      scale = loss_scaling.loss_scale_of(opt_state)
      if G == 1:
        grads, state, sums = micro(params, state, jax.tree.map(lambda a: a[0], xg),
                                   yg[0], step, scale)
      else:
        def accumulate(c, inp):
          acc, state, sums = c
          k, x, y = inp
          grads, state, s = micro(params, state, x, y, step * G + k, scale)
          return (acc_lib.accumulate(acc, grads, k, method), state, sums + s), None

        zeros = jnp.zeros((len(metric_fns) + 2,), jnp.float32)
        (acc, state, sums), _ = jax.lax.scan(
            accumulate, (acc_lib.init(params), state, zeros),
            (jnp.arange(G, dtype=jnp.int32), xg, yg))
        grads = acc_lib.finalize(acc, G, method)
      if R > 1 and not sharded_state:
        grads = (cross_replica_mean(grads) if replica_reduction == "mean"
                 else cross_replica_sum(grads))
        if jax.tree.leaves(state):  # keep batch statistics equal on every replica
          state = jax.tree.map(
              lambda v: cross_replica_mean(v) if jnp.issubdtype(v.dtype, jnp.floating)
              else v, state)
      if sharded_state:
        params, opt_state = offload_lib.sharded_update(
            optimizer, grads, opt_state, params, replica, R, replica_reduction)
      else:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
      return (params, opt_state, state, step + 1), sums

    (params, opt_state, state, step), sums = jax.lax.scan(
        update, (params, opt_state, state, step), (xs, ys))
    return params, opt_state, state, step, jnp.sum(sums, axis=0)

  execution.__name__ = "train_step"
  return execution


def eval_execution(adapter, loss: Callable, metric_fns: Sequence) -> Callable:
  """``execution(params, state, rng_state, xs, ys, mask) -> [loss, metrics..., count]`` sums."""

  def execution(params, state, rng_state, xs, ys, mask):
    def body(sums, inp):
      x, y, m = inp
      y_pred, _ = adapter.apply(params, state, rng_state, x, False, None)
      values = [per_sample_loss(loss, y, y_pred)] + [mf(y, y_pred) for mf in metric_fns]
      s = [jnp.sum(v.astype(jnp.float32) * m) for v in values] + [jnp.sum(m)]
      return sums + _vector(s), None

    zeros = jnp.zeros((len(metric_fns) + 2,), jnp.float32)
    sums, _ = jax.lax.scan(body, zeros, (xs, ys, mask))
    return sums

  execution.__name__ = "eval_step"
  return execution


def predict_execution(adapter) -> Callable:
  """``execution(params, state, rng_state, xs) -> outputs`` stacked per micro-batch."""

  def execution(params, state, rng_state, xs):
    def body(carry, x):
      y_pred, _ = adapter.apply(params, state, rng_state, x, False, None)
      return carry, y_pred

    _, ys = jax.lax.scan(body, jnp.zeros((), jnp.int32), xs)
    return ys

  execution.__name__ = "predict_step"
  return execution


def build_program(execution: Callable, args: Sequence, in_kinds_per_arg: Sequence[str],
                  out_kinds_fn: Callable, *, replication: Replication, config,
                  emulate: bool, verbose=None, jit_options=None):
  """Lowers ``execution`` for one replica and wraps it for every replica.

  Args:
    execution: the per-replica function (see the ``*_execution`` builders).
    args: example arguments; sharded ones have a leading axis of this
      process's replicas.
    in_kinds_per_arg: ``REPLICATED`` or ``SHARDED`` per argument.
    out_kinds_fn: ``out_kinds_fn(out_tree)`` -> a kind per output leaf.
    replication: the replicas the program runs on.
    config: the ``IPUConfig`` to lower with (replication factor: all replicas).
    emulate: lower to the tile program (``False``: plain JAX, no report).
    verbose: compile progress (``0`` silences it; ``None``: the config's).
    jit_options: more keyword arguments for ``ipu_jax.jit`` (e.g. which
      arguments live in streaming memory).

  Returns:
    ``(run, lowered)``: ``run(*args)`` returns the output pytree;
    ``lowered`` is the ``ipu_jax.Lowered`` (``None`` when not emulating).
  """
  import ipu_jax  # the package imports keras: import at call time
  per_replica_args = [
      _abstract(a) if kind == REPLICATED else
      jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), a)
      for a, kind in zip(args, in_kinds_per_arg)]
  flat_example, in_tree = jax.tree_util.tree_flatten(list(per_replica_args))
  in_kinds = []
  for a, kind in zip(args, in_kinds_per_arg):
    in_kinds += [kind] * len(jax.tree.leaves(a))
  lowered = None
  num_state = 0
  if emulate:
    lowered = ipu_jax.jit(execution, config=config, verbose=verbose,
                          **(jit_options or {})).lower(*per_replica_args)
    out_tree = lowered.out_tree
    # The device state (stochastic rounding generators) goes in and out of
    # every execution, so the next one continues it as the chip would.
    num_state = len(lowered.device_state)

    def program(*flat):
      out, state = lowered.apply_with_state(flat[:num_state], *flat[num_state:])
      return jax.tree_util.tree_leaves(out) + state
  else:
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(execution, *per_replica_args))

    def program(*flat):
      return jax.tree_util.tree_leaves(execution(*jax.tree_util.tree_unflatten(in_tree, flat)))

  # Replica 0's generator state carries on (with esr "ON" each replica
  # perturbs it by its index when it draws).
  runner = replication.build(program, [REPLICATED] * num_state + in_kinds,
                             list(out_kinds_fn(out_tree)) + [REPLICATED] * num_state)

  def run(*args_):
    leaves = jax.tree_util.tree_leaves(list(args_))
    state = replication.replicate(lowered.device_state) if num_state else []
    outs = runner(*state, *leaves)
    if num_state:
      lowered.set_device_state(outs[len(outs) - num_state:])
      outs = outs[:len(outs) - num_state]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return run, lowered


def run_setup(program: str, config, params, *, micro_batch: int, replicas: int,
              accumulation_steps: int, accumulation_reduction: str,
              replica_reduction: str, steps_per_execution: int):
  """The :class:`~ipu_jax.lowering.run_setup.RunSetup` a program's report shows."""
  from ipu_jax.lowering.run_setup import RunSetup
  target = config.to_target()
  G = accumulation_steps if program == "train" else 1
  R, S = replicas, steps_per_execution
  dtypes = sorted({str(np.dtype(v.dtype)) for v in jax.tree.leaves(params)})
  return RunSetup(
      program=program, target=target.name, num_ipus=target.num_ipus,
      tiles_per_ipu=target.tiles_per_ipu, replicas=R, gradient_accumulation_steps=G,
      gradient_accumulation_reduction=accumulation_reduction,
      replica_reduction=replica_reduction, steps_per_execution=S,
      micro_batch=int(micro_batch), global_batch=int(micro_batch) * G * R,
      weight_updates_per_execution=S // (G * R) if program == "train" else 0,
      param_dtypes=tuple(dtypes), matmul_partials_type=config.matmuls.partials_type,
      matmul_available_memory_proportion=config.matmuls.available_memory_proportion,
      conv_available_memory_proportion=config.convolutions.available_memory_proportion)
