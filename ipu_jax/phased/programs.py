"""The per-phase programs: forward, backward (recompute + G micro-batches) and update.

Each kind of phase (see :meth:`PhasedModel.kinds`) gets at most two programs,
each traced for ONE replica and lowered once through ``ipu_jax.jit``:

* **forward** ``(weights, xs[G, ...]) -> ys[G, ...]``: the micro-batch loop
  (batch serialisation) runs inside the phase, so its weights are loaded
  once; each micro-batch's output is stored for the next phase.
* **backward** ``(weights, opt_state, xs[G], dys[G]) -> (weights', opt_state',
  dxs[G])``: per micro-batch the phase forward is recomputed from its stored
  input and its VJP taken; the weight gradient accumulates over the G
  micro-batches; then the gradient is reduced over the replicas
  (all-reduce, or reduce-scatter with replicated tensor sharding) and the
  optimizer updates the phase's weights, which are stored back with the
  optimizer state. The last phase's backward takes the labels in place of
  ``dys`` (it starts the backward from its loss, which it also returns); the
  first phase's returns no ``dxs``.

Weights and optimizer state are the programs' offloaded arguments and outputs
(``ipu_jax.jit(offload_argnums=, offload_outputs=)``): they live in the
IR's Streaming Memory (``lowering/remote.py``), copied onto the tiles once a
phase (the micro-batch loop carries them, so the copy sits outside it) and
back after the update. With RTS the weights arrive as 1/dp shards and the
program all-gathers them over ``"replicas"``
(``ipu_jax.ops.cross_replica_all_gather``); the gradients are
reduce-scattered and the optimizer runs on the shards
(:class:`ipu_jax.sharded_optimizer.ShardedUpdate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ipu_jax import ops
from ipu_jax.ops.collectives import REPLICA_AXIS
from ipu_jax.sharded_optimizer import (ShardedUpdate, gather_leaf, is_sharded_leaf,
                                       shard_length)

TP_AXIS = "tp"  # ipu_jax.parallel.TP_AXIS (the tensor-parallel shards of one replica)

__all__ = ["PhaseKind", "PhasePrograms", "forward_fn", "backward_fn", "shard_shapes",
           "program_args", "lower_programs", "mesh_runner", "bind_mesh_axes"]


@dataclasses.dataclass(frozen=True)
class PhaseKind:
  """What one kind of phase's programs are traced from.

  Attributes:
    role: ``"first"``, ``"middle"`` or ``"last"``.
    apply: the phases' function.
    params: the weights' shapes (``ShapeDtypeStruct`` pytree, full size).
    x: one micro-batch's input shape.
    extras: the last phase's extra inputs' shapes (labels), per micro-batch.
  """

  role: str
  apply: Callable
  params: Any
  x: Any
  extras: tuple = ()


def shard_shapes(params, replicas: int):
  """The RTS layout of ``params``: each leaf with an axis as its flat ``[n]`` shard."""
  return jax.tree.map(
      lambda a: (jax.ShapeDtypeStruct((shard_length(int(np.prod(a.shape)), replicas),), a.dtype)
                 if is_sharded_leaf(a) else a), params)


def _gathered(shards, like, replicas: int):
  """Full weights from this replica's RTS shards (all-gather over the replicas)."""
  def one(shard, leaf):
    if not is_sharded_leaf(leaf):
      return shard
    return gather_leaf(ops.cross_replica_all_gather(shard, replicas, REPLICA_AXIS), leaf)
  return jax.tree.map(one, shards, like)


def _scattered(grads, replicas: int, scale: float):
  """This replica's shard of the replicas' summed gradient, times ``scale``."""
  def one(g):
    if not is_sharded_leaf(g):
      return ops.cross_replica_sum(g) * scale
    n = shard_length(np.size(g), replicas)
    flat = jnp.pad(jnp.reshape(g, (-1,)), (0, n * replicas - np.size(g)))
    return ops.cross_replica_reduce_scatter(flat, replicas, REPLICA_AXIS) * scale
  return jax.tree.map(one, grads)


def forward_fn(kind: PhaseKind, replicas: int, rts: bool) -> Callable:
  """The forward program of ``kind`` for one replica: ``(w, xs) -> (ys,)``."""
  def forward(weights, xs):
    full = _gathered(weights, kind.params, replicas) if rts else weights

    def body(carry, x):
      return carry, kind.apply(carry, x)
    _, ys = jax.lax.scan(body, full, xs)
    return (ys,)
  return forward


def _accumulate(kind: PhaseKind, full, xs, seeds):
  """Summed weight gradients over the micro-batches, each input's gradient and losses.

  ``seeds`` are the output cotangents ``dys[G]`` (middle/first phases) or the
  labels ``extras[G]`` (last phase: the cotangent is 1 on its loss).
  """
  zeros = jax.tree.map(jnp.zeros_like, full)
  last = kind.role == "last"

  def body(carry, item):
    weights, acc = carry
    x, seed = item
    if last:
      loss, vjp = jax.vjp(lambda w, v: kind.apply(w, v, *seed), weights, x)
      dw, dx = vjp(jnp.ones_like(loss))
    else:
      loss = jnp.zeros((), jnp.float32)
      _, vjp = jax.vjp(kind.apply, weights, x)
      dw, dx = vjp(seed)
    acc = jax.tree.map(jnp.add, acc, dw)
    keep = dx if kind.role != "first" else jnp.zeros((), jnp.float32)
    return (weights, acc), (keep, loss)
  (_, grads), (dxs, losses) = jax.lax.scan(body, (full, zeros), (xs, seeds))
  return grads, dxs, losses


def backward_fn(kind: PhaseKind, optimizer, replicas: int, rts: bool,
                micro_batches: int) -> Callable:
  """The backward + update program of ``kind`` for one replica.

  Returns ``(weights', opt_state', dxs)`` (no ``dxs`` for the first phase) and
  the mean loss over the micro-batches last for the last phase.
  """
  scale = 1.0 / (micro_batches * replicas)
  sharded = ShardedUpdate(optimizer, kind.params, replicas) if rts else None

  def backward(weights, opt_state, xs, seeds):
    full = _gathered(weights, kind.params, replicas) if rts else weights
    grads, dxs, losses = _accumulate(kind, full, xs, seeds)
    if rts:
      shards = _scattered(grads, replicas, scale)
      new_w, new_state = sharded(shards, opt_state, weights, ops.replica_index())
    else:
      if replicas > 1:
        grads = ops.cross_replica_sum(grads)
      grads = jax.tree.map(lambda g: g * scale, grads)
      updates, new_state = optimizer.update(grads, opt_state, weights)
      new_w = optax.apply_updates(weights, updates)
    outputs = (new_w, new_state)
    if kind.role != "first":
      outputs += (dxs,)
    if kind.role == "last":
      outputs += (jnp.mean(losses),)
    return outputs
  return backward


@dataclasses.dataclass
class PhasePrograms:
  """A kind's lowered programs (one replica's; run by :func:`mesh_runner`).

  Attributes:
    kind: the :class:`PhaseKind`.
    forward: the forward's ``ipu_jax`` ``Lowered`` (None for the last phase).
    backward: the backward's ``Lowered``.
  """

  kind: PhaseKind
  forward: Any
  backward: Any


# -- lowering once per kind ------------------------------------------------------------------

# Lowered programs by what decides them, so a serial and a ping-pong trainer of
# one model (same programs, different schedules) lower each program once. The
# key names the optimizer and config by id, so each entry also holds them: an
# id is not reused while its object lives.
_LOWERED: dict = {}


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _stacked(tree, n: int):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + tuple(a.shape), a.dtype), tree)


def program_args(kind: PhaseKind, optimizer, layout) -> dict:
  """One replica's argument shapes: weights, optimizer state, xs, seeds (dys or labels)."""
  g, dp = layout.batch_serialisation, layout.dp
  state = jax.eval_shape(optimizer.init, kind.params)
  weights = shard_shapes(kind.params, dp) if layout.rts else kind.params
  if layout.rts:
    state = shard_shapes(state, dp)
  xs = _stacked(kind.x, g)
  if kind.role == "last":
    seeds = tuple(_stacked(e, g) for e in kind.extras)
  else:
    seeds = _stacked(jax.eval_shape(kind.apply, kind.params, kind.x), g)
  return {"weights": weights, "opt_state": state, "xs": xs, "seeds": seeds}


def _offload(layout, backward: bool) -> dict:
  remote = [0] if layout.remote_weights else []
  if backward and layout.remote_optimizer_state:
    remote.append(1)
  return {"offload_argnums": tuple(remote),
          "offload_outputs": tuple(remote) if backward else ()}


def _key(kind: PhaseKind, optimizer, layout, target, config) -> tuple:
  sig = lambda t: (jax.tree.structure(t), tuple(  # noqa: E731
      (tuple(a.shape), np.dtype(a.dtype).name) for a in jax.tree.leaves(t)))
  return (kind.role, kind.apply, sig(kind.params), sig(kind.x), sig(kind.extras),
          id(optimizer), layout.dp, layout.rts, layout.batch_serialisation,
          layout.remote_weights, layout.remote_optimizer_state, target, id(config))


@contextlib.contextmanager
def bind_mesh_axes(layout):
  """With tensor parallelism, both mesh axes bound around what runs inside (as
  ``ipu_jax.parallel.spmd`` lowers): tracing a phase's apply (its shapes, its
  programs) sees ``"tp"`` and ``"replicas"`` as vmap axes, and the lowering
  prices collectives over them over their replica groups. Data parallelism
  alone is the replication factor, as the training layer lowers it."""
  if layout.tp == 1:
    yield
    return
  from ipu_jax.lowering.rules.parallel import binding_axes
  with binding_axes(((REPLICA_AXIS, layout.dp), (TP_AXIS, layout.tp))):
    yield


def lower_programs(kind: PhaseKind, optimizer, layout, target, config,
                   allow_out_of_memory: bool = False) -> PhasePrograms:
  """``kind``'s forward and backward programs, each lowered once (cached).

  Args:
    kind: the phase kind.
    optimizer: the optax optimizer.
    layout: the :class:`~ipu_jax.phased.PhasedLayout`.
    target: the per-IPU target one replica's phase program runs on.
    config: the ``IPUConfig`` (its replication factor is set to ``layout.dp``).
    allow_out_of_memory: lower a phase that does not fit (the estimate names
      the phase itself).
  """
  import ipu_jax  # the package imports this one lazily: import at call time

  key = _key(kind, optimizer, layout, target, config) + (allow_out_of_memory, layout.tp)
  if key in _LOWERED:
    return _LOWERED[key][0]
  given = config
  config = (config or ipu_jax.IPUConfig()).copy()
  config.replication_factor = layout.dp
  config.memory.allow_out_of_memory = bool(allow_out_of_memory)
  forward = None
  with bind_mesh_axes(layout):
    args = program_args(kind, optimizer, layout)
    if kind.role != "last":
      forward = ipu_jax.jit(forward_fn(kind, layout.dp, layout.rts), target=target,
                            config=config, **_offload(layout, False)).lower(
          args["weights"], args["xs"])
    backward_program = backward_fn(kind, optimizer, layout.dp, layout.rts,
                                   layout.batch_serialisation)
    backward = ipu_jax.jit(backward_program, target=target, config=config,
                           **_offload(layout, True)).lower(
        args["weights"], args["opt_state"], args["xs"], args["seeds"])
  programs = PhasePrograms(kind, forward, backward)
  _LOWERED[key] = (programs, optimizer, given)
  return programs


def mesh_runner(lowered, dp: int, tp: int, arg_axes: list):
  """``lowered`` run on every ``(dp, tp)`` point, ``"replicas"`` and ``"tp"`` bound by ``vmap``.

  As the training layer runs data-parallel replicas
  (``ipu_jax/keras/replication.py``) and ``ipu_jax.parallel.spmd`` runs a
  mesh: the collectives inside compute the real cross-replica values.

  Args:
    lowered: one point's ``Lowered`` program.
    dp, tp: the mesh.
    arg_axes: per positional argument, ``(over dp, over tp)``: whether the
      host passes it with a leading ``[dp]`` and/or ``[tp]`` axis.

  Returns:
    ``run(*args)``: the output pytree, every leaf stacked ``[dp, (tp,) ...]``
    (the tp axis only when ``tp > 1``).
  """
  def point(*flat):
    return jax.tree.leaves(lowered.apply(*flat))
  cache = {}

  def run(*args):
    flat, dp_axes, tp_axes = [], [], []
    for arg, (over_dp, over_tp) in zip(args, arg_axes):
      leaves = jax.tree.leaves(arg)
      flat += leaves
      dp_axes += [0 if over_dp else None] * len(leaves)
      tp_axes += [0 if over_tp and tp > 1 else None] * len(leaves)
    if "fn" not in cache:
      fn = point
      if tp > 1:
        fn = jax.vmap(fn, in_axes=tp_axes, axis_name=TP_AXIS, axis_size=tp)
      cache["fn"] = jax.jit(jax.vmap(fn, in_axes=dp_axes, axis_name=REPLICA_AXIS, axis_size=dp))
    return jax.tree.unflatten(lowered.out_tree, cache["fn"](*flat))
  return run
