"""The tile programs of a Keras-like model: one execution of train, eval or predict.

Each ``*_execution`` function returns the pure JAX function that one call of
the device runs for ONE replica; :func:`build_program` lowers it with
``ipu_jax.jit`` (or plain JAX when not emulating) and wraps it for every
replica with :class:`~ipu_jax.keras.replication.Replication`.

* train: ``lax.scan`` over the U weight updates of the execution (lowered to a
  ``Repeat``); each update scans over its G micro-batches, accumulates the
  gradients (:mod:`ipu_jax.keras.accumulation`), all-reduces them over the R
  replicas and applies the optimizer (``TrainState.apply_gradients``). Returns
  the trained fields of the state and the summed loss/metric values
  ``[loss, metrics..., count]``.
* eval: ``lax.scan`` over the micro-batches summing masked loss and metrics
  (padding samples have mask 0, so every sample counts once).
* predict: ``lax.scan`` over the micro-batches stacking the outputs.

An execution takes the :class:`~ipu_jax.keras.train_state.TrainState` by
name and its data; :func:`build_state_program` places each field as the state
says (``REPLICATED``: the same on every replica; ``SHARDED``: split over
them, as the data and replica ids are) and lowers it with the fields as
positional arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.keras import accumulation as acc_lib
from ipu_jax.keras import loss_scaling
from ipu_jax.keras import offload as offload_lib
from ipu_jax.keras import scopes
from ipu_jax.keras.replication import (GATHERED, REPLICATED, SHARDED, Replication,
                                       cross_replica_mean, cross_replica_sum)
from ipu_jax.keras.train_state import TRAINED_FIELDS, TrainState

__all__ = ["build_program", "build_state_program", "StateProgram", "TrainStep",
           "train_execution", "eval_execution", "predict_execution", "per_sample_loss",
           "run_setup", "shape_key"]


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


# -- train ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """What one training execution does, for one replica.

  Attributes:
    adapter: the module adapter (:mod:`ipu_jax.keras.adapters`).
    optimizer: the optax transformation.
    loss: ``loss(y_true, y_pred)``.
    metric_fns: the compiled metrics.
    accumulation_steps: G, micro-batches per weight update.
    accumulation_reduction: ``"sum"``, ``"mean"`` or ``"running_mean"``.
    replicas: R.
    replica_reduction: ``"sum"`` or ``"mean"`` over the replicas.
    sharded_state: replicated tensor sharding: each replica holds 1/R of the
      optimizer state; gradients are reduce-scattered, each replica updates
      its shard and the new weights are all-gathered
      (:func:`ipu_jax.keras.offload.sharded_update`) instead of an all-reduce.
  """
  adapter: Any
  optimizer: Any
  loss: Callable
  metric_fns: Sequence
  accumulation_steps: int
  accumulation_reduction: str
  replicas: int
  replica_reduction: str
  sharded_state: bool = False


def _micro_gradients(plan: TrainStep, fixed: TrainState, params, state, x, y, micro_step,
                     replica, loss_scale):
  """Gradients, new module state and ``[loss, metrics..., count]`` sums of one micro-batch."""
  # Dropout keys differ per micro-batch and replica, and are reproducible.
  rng = (fixed.dropout_key, (micro_step, replica)) if plan.adapter.needs_rng else None

  def objective(p):
    y_pred, new_state = plan.adapter.apply(p, state, fixed.rng_state, x, True, rng)
    with scopes.scope(scopes.LOSS):  # its backward pass is "loss/grad"
      per_sample = per_sample_loss(plan.loss, y, y_pred)
      objective_value = jnp.mean(per_sample)
      if loss_scale is not None:  # the optimizer is a LossScaleOptimizer
        objective_value = objective_value * loss_scale.astype(objective_value.dtype)
    return objective_value, (y_pred, new_state, per_sample)

  (_, (y_pred, new_state, per_sample)), grads = jax.value_and_grad(
      objective, has_aux=True)(params)
  with scopes.scope(scopes.METRICS):
    sums = [jnp.sum(per_sample)] + [jnp.sum(m(y, y_pred)) for m in plan.metric_fns]
    sums.append(jnp.asarray(per_sample.shape[0], jnp.float32))
    return grads, new_state, _vector(sums)


def _accumulated_gradients(plan: TrainStep, fixed: TrainState, carry: TrainState, xg, yg,
                           replica, loss_scale):
  """The reduced gradients of the G micro-batches of one update (``lax.scan`` over them)."""
  G, method = plan.accumulation_steps, plan.accumulation_reduction
  params, step = carry.params, carry.step
  if G == 1:
    return _micro_gradients(plan, fixed, params, carry.state,
                            jax.tree.map(lambda a: a[0], xg), yg[0], step, replica, loss_scale)

  def accumulate(c, inp):
    acc, state, sums = c
    k, x, y = inp
    grads, state, s = _micro_gradients(plan, fixed, params, state, x, y, step * G + k, replica,
                                       loss_scale)
    with scopes.scope(scopes.GRADIENT_ACCUMULATION):
      acc = acc_lib.accumulate(acc, grads, k, method)
    with scopes.scope(scopes.METRICS):
      return (acc, state, sums + s), None

  with scopes.scope(scopes.METRICS):
    zeros = jnp.zeros((len(plan.metric_fns) + 2,), jnp.float32)
  with scopes.scope(scopes.GRADIENT_ACCUMULATION):
    initial = acc_lib.init(params)
  (acc, state, sums), _ = jax.lax.scan(
      accumulate, (initial, carry.state, zeros), (jnp.arange(G, dtype=jnp.int32), xg, yg))
  with scopes.scope(scopes.GRADIENT_ACCUMULATION):
    return acc_lib.finalize(acc, G, method), state, sums


def _reduce_over_replicas(plan: TrainStep, grads, state):
  """Gradients all-reduced over the replicas; batch statistics averaged."""
  with scopes.scope(scopes.ALL_REDUCE):
    return _all_reduced(plan, grads, state)


def _all_reduced(plan: TrainStep, grads, state):
  grads = (cross_replica_mean(grads) if plan.replica_reduction == "mean"
           else cross_replica_sum(grads))
  if jax.tree.leaves(state):  # keep batch statistics equal on every replica
    state = jax.tree.map(
        lambda v: cross_replica_mean(v) if jnp.issubdtype(v.dtype, jnp.floating) else v,
        state)
  return grads, state


def _weight_update(plan: TrainStep, fixed: TrainState, replica, carry: TrainState, batch):
  """One weight update (the body of the loop over updates): the new trained fields."""
  xg, yg = batch
  scale = loss_scaling.loss_scale_of(carry.opt_state)
  grads, state, sums = _accumulated_gradients(plan, fixed, carry, xg, yg, replica, scale)
  if plan.replicas > 1 and not plan.sharded_state:
    grads, state = _reduce_over_replicas(plan, grads, state)
  optimizer = scopes.scoped_optimizer(plan.optimizer)
  with scopes.scope(scopes.OPTIMIZER):
    if plan.sharded_state:
      params, opt_state = offload_lib.sharded_update(
          optimizer, grads, carry.opt_state, carry.params, replica, plan.replicas,
          plan.replica_reduction)
      carry = carry.replace(params=params, opt_state=opt_state, state=state,
                            step=carry.step + 1)
    else:
      carry = carry.apply_gradients(grads, optimizer, state=state)
  return carry, sums


def train_execution(plan: TrainStep) -> Callable:
  """One training execution for one replica.

  Returns:
    ``execution(train_state, xs, ys, replica)`` with ``xs``/``ys`` laid out
    ``[U, G, b, ...]``; it returns ``(new, sums)``: ``new`` holds the trained
    fields of the :class:`TrainState` (the others ``None``), ``sums`` the
    ``[loss, metrics..., count]`` sums of each update, ``[U, k]``: the loop's
    stacked output, which ``outputs.mode`` selects from (``'sum'``: their
    sum on the device) and the host adds up.
  """

  def execution(train_state: TrainState, xs, ys, replica):
    # The loop carries only the fields training changes; the others are read.
    update = functools.partial(_weight_update, plan, train_state, replica)
    carry, sums = jax.lax.scan(update, train_state.only(TRAINED_FIELDS), (xs, ys))
    return carry, sums

  execution.__name__ = "train_step"
  return execution


# -- eval and predict ---------------------------------------------------------------


def eval_execution(adapter, loss: Callable, metric_fns: Sequence) -> Callable:
  """``execution(train_state, xs, ys, mask) -> (None, sums)``: the masked
  ``[loss, metrics..., count]`` sums of each step, ``[K, k]`` (the loop's
  stacked output, as in :func:`train_execution`)."""

  def execution(ts: TrainState, xs, ys, mask):
    def body(carry, inp):
      x, y, m = inp
      y_pred, _ = adapter.apply(ts.params, ts.state, ts.rng_state, x, False, None)
      with scopes.scope(scopes.LOSS):
        values = [per_sample_loss(loss, y, y_pred)]
      with scopes.scope(scopes.METRICS):
        values += [mf(y, y_pred) for mf in metric_fns]
        s = [jnp.sum(v.astype(jnp.float32) * m) for v in values] + [jnp.sum(m)]
        return carry, _vector(s)

    _, sums = jax.lax.scan(body, jnp.zeros((), jnp.int32), (xs, ys, mask))
    return None, sums

  execution.__name__ = "eval_step"
  return execution


def predict_execution(adapter) -> Callable:
  """``execution(train_state, xs) -> (None, outputs)`` stacked per micro-batch."""

  def execution(ts: TrainState, xs):
    def body(carry, x):
      y_pred, _ = adapter.apply(ts.params, ts.state, ts.rng_state, x, False, None)
      return carry, y_pred

    _, ys = jax.lax.scan(body, jnp.zeros((), jnp.int32), xs)
    return None, ys

  execution.__name__ = "predict_step"
  return execution


# -- programs of the training state ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StateProgram:
  """A compiled execution of the :class:`TrainState` and data, on every replica.

  The lowered function takes the state's ``in_fields`` as its leading
  positional arguments (its report names their leaves by field and pytree
  path, ``params/hidden1/kernel``; streaming memory addresses the optimizer
  state by its position)
  and returns the ``out_fields`` and then the result, as a flat tuple.

  Attributes:
    run: the replicated runner of :func:`build_program`.
    lowered: the ``ipu_jax.Lowered`` (``None`` when not emulating).
    in_fields: the state's fields the execution reads, in order.
    out_fields: the state's fields it returns, in order.
  """
  run: Callable
  lowered: Any
  in_fields: tuple
  out_fields: tuple

  def __call__(self, train_state: TrainState, *data):
    """``(new, result)``: ``new`` a TrainState holding ``out_fields`` (the rest ``None``)."""
    outs = self.run(*train_state.values(self.in_fields), *data)
    if not self.out_fields:
      return TrainState(), outs
    return TrainState(**dict(zip(self.out_fields, outs))), outs[len(self.out_fields)]


def _positional(execution: Callable, in_fields: tuple, out_fields: tuple) -> Callable:
  """``execution(train_state, *data)`` as a function of flat positional arguments."""

  def positional(*args):
    ts = TrainState(**dict(zip(in_fields, args[:len(in_fields)])))
    new, result = execution(ts, *args[len(in_fields):])
    if not out_fields:
      return result
    return tuple(new.values(out_fields)) + (result,)

  positional.__name__ = execution.__name__
  # Named parameters name the program's tensors: "params/hidden1/kernel",
  # "opt_state/mu/hidden1/kernel", "xs" (ipu_jax/argument_names.py).
  data_names = list(inspect.signature(execution).parameters)[1:]
  positional.__signature__ = inspect.Signature(
      [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
       for name in tuple(in_fields) + tuple(data_names)])
  return positional


def _out_kinds(out_fields: tuple, placements: dict, result_kind: str) -> Callable:
  """Output kinds per leaf: a sharded field comes back gathered, a replicated one as is."""
  as_output = {REPLICATED: REPLICATED, SHARDED: GATHERED}

  def kinds(out_tree) -> list:
    if not out_fields:
      return [result_kind] * out_tree.num_leaves
    parts = jax.tree_util.tree_unflatten(out_tree, [0] * out_tree.num_leaves)
    out = []
    for name, part in zip(out_fields, parts):
      out += [as_output[placements[name]]] * len(jax.tree.leaves(part))
    return out + [result_kind] * len(jax.tree.leaves(parts[len(out_fields)]))

  return kinds


def build_state_program(execution: Callable, train_state: TrainState, data: Sequence, *,
                        in_fields: tuple, out_fields: tuple, result_kind: str,
                        sharded_optimizer_state: bool = False, **build_options) -> StateProgram:
  """Lowers ``execution(train_state, *data) -> (new, result)`` for every replica.

  Args:
    execution: a ``*_execution`` function.
    train_state: the example state (fields placed on the replicas).
    data: example data arguments, each with a leading axis of this process's
      replicas.
    in_fields / out_fields: the state's fields the execution reads / returns.
    result_kind: how the result comes back (``SUMMED`` or ``GATHERED``).
    sharded_optimizer_state: the optimizer state is sharded over replicas.
    **build_options: the keyword arguments of :func:`build_program`; with
      ``IPUConfig.streaming.offload_optimizer_state`` a program that reads and
      returns the optimizer state keeps it in streaming memory.
  """
  placements = TrainState.placements(sharded_optimizer_state)
  args = train_state.values(in_fields) + list(data)
  kinds = [placements[name] for name in in_fields] + [SHARDED] * len(data)
  if "opt_state" in in_fields and "opt_state" in out_fields:
    build_options["jit_options"] = offload_lib.jit_options(
        build_options["config"], in_fields.index("opt_state"), out_fields.index("opt_state"))
  run, lowered = build_program(_positional(execution, in_fields, out_fields), args, kinds,
                               _out_kinds(out_fields, placements, result_kind),
                               **build_options)
  return StateProgram(run, lowered, tuple(in_fields), tuple(out_fields))


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
  from ipu_jax import host_time
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

  calls = [0]

  def run(*args_):
    leaves = jax.tree_util.tree_leaves(list(args_))
    state = replication.replicate(lowered.device_state) if num_state else []
    if lowered is None:
      outs = runner(*state, *leaves)
    else:  # host time of the program's calls (its report's "Host side")
      if replication.mode == "single":  # replicas place their own arguments
        state, leaves = lowered.prepare_arguments(state), lowered.prepare_arguments(leaves)
      with host_time.measuring(lowered.host, first=not calls[0]):
        outs = runner(*state, *leaves)
      calls[0] += 1
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
