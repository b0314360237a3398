"""The per-phase programs: load, forward, backward (recompute + VJP) and update.

Each kind of phase (see :meth:`PhasedModel.kinds`) gets up to four programs,
each traced for ONE replica and ONE micro-batch and lowered once through
``ipu_jax.jit``; batch serialisation runs the micro-batch programs G times
between one load of the phase's weights and one store, as PopXL's phased
examples loop over the micro-batches inside a phase:

* **load** (RTS only) ``(weight shards) -> weights``: the phase's 1/dp shards
  stream in from Streaming Memory (an offloaded argument) and are
  all-gathered over ``"replicas"`` (``ipu_jax.ops.cross_replica_all_gather``).
  Without RTS the weights arrive whole (priced by the estimate's traffic).
* **forward** ``(weights, x) -> (y,)``: one micro-batch. Its input is loaded
  from Streaming Memory and its output stored back per micro-batch
  (``remote_activations``), so the tiles only ever hold ONE micro-batch's
  activations next to the phase's weights (PopXL's ``remote_load`` /
  ``remote_store`` of the activation at the loop's index).
* **backward** ``(weights, acc, x, seed) -> (acc', dx[, loss])``: one
  micro-batch: the phase forward recomputed from its stored input and its
  VJP taken; the weight gradient accumulates on the tiles (``acc``) over the
  G micro-batches. ``seed`` is the output's cotangent (middle/first phases)
  or the labels (last phase: the cotangent is 1 on its loss, returned last);
  the first phase returns no ``dx``.
* **update** ``(weights, opt_state, acc) -> (weights', opt_state')``: the
  accumulated gradient reduced over the replicas (all-reduce, or
  reduce-scatter with replicated tensor sharding, then
  :class:`ipu_jax.sharded_optimizer.ShardedUpdate` on the shards) and the
  optimizer step. Weights and optimizer state are its offloaded arguments and
  outputs (``ipu_jax.jit(offload_argnums=, offload_outputs=)``, the IR's
  Streaming Memory, ``lowering/remote.py``).

No program holds the G micro-batches' activations at once: that would be
wrong for batch serialisation (PopXL keeps them in remote buffers) and, at
GPT-J size, a [G, 1024, 4096] tile tensor per phase.
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

__all__ = ["PhaseKind", "PhasePrograms", "load_fn", "forward_fn", "backward_fn", "update_fn",
           "shard_shapes", "program_args", "lower_programs", "mesh_runner", "bind_mesh_axes"]


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


def load_fn(kind: PhaseKind, replicas: int) -> Callable:
  """The RTS load program: ``(shards,) -> (weights,)``, all-gathered over the replicas."""
  def load(shards):
    return (_gathered(shards, kind.params, replicas),)
  return load


def forward_fn(kind: PhaseKind) -> Callable:
  """One micro-batch's forward of ``kind``: ``(weights, x) -> (y,)``."""
  def forward(weights, x):
    return (kind.apply(weights, x),)
  return forward


def backward_fn(kind: PhaseKind) -> Callable:
  """One micro-batch's backward of ``kind``: ``(weights, acc, x, seed) -> (acc', dx[, loss])``.

  The forward is recomputed from the stored input ``x`` (recomputation from
  the phase's start); ``seed`` is the output's cotangent, or for the last
  phase the tuple of its extras (labels). The first phase's input is the
  step's data: only the weights are differentiated.
  """
  role = kind.role

  def backward(weights, acc, x, seed):
    if role == "last":
      loss, vjp = jax.vjp(lambda w, v: kind.apply(w, v, *seed), weights, x)
      dw, dx = vjp(jnp.ones_like(loss))
    elif role == "first":
      _, vjp = jax.vjp(lambda w: kind.apply(w, x), weights)
      (dw,) = vjp(seed)
    else:
      _, vjp = jax.vjp(kind.apply, weights, x)
      dw, dx = vjp(seed)
    outputs = (jax.tree.map(jnp.add, acc, dw),)
    if role != "first":
      outputs += (dx,)
    if role == "last":
      outputs += (loss,)
    return outputs
  return backward


def update_fn(kind: PhaseKind, optimizer, replicas: int, rts: bool,
              micro_batches: int) -> Callable:
  """The update program: ``(weights, opt_state, acc) -> (weights', opt_state')``.

  ``acc`` is this replica's gradient summed over its G micro-batches; the
  replicas' sum is scaled to the mean over all ``G x replicas`` micro-batches.
  """
  scale = 1.0 / (micro_batches * replicas)
  sharded = ShardedUpdate(optimizer, kind.params, replicas) if rts else None

  def update(weights, opt_state, acc):
    if rts:
      shards = _scattered(acc, replicas, scale)
      return sharded(shards, opt_state, weights, ops.replica_index())
    grads = ops.cross_replica_sum(acc) if replicas > 1 else acc
    grads = jax.tree.map(lambda g: g * scale, grads)
    updates, new_state = optimizer.update(grads, opt_state, weights)
    return optax.apply_updates(weights, updates), new_state
  return update


@dataclasses.dataclass
class PhasePrograms:
  """A kind's lowered programs (one replica's, one micro-batch's; run by :func:`mesh_runner`).

  Attributes:
    kind: the :class:`PhaseKind`.
    load: the RTS load's ``ipu_jax`` ``Lowered`` (None without RTS).
    forward: one micro-batch's forward (None for the last phase).
    backward: one micro-batch's backward.
    update: the reduction over the replicas and the optimizer step.
  """

  kind: PhaseKind
  load: Any
  forward: Any
  backward: Any
  update: Any

  def of_execution(self, direction: str, micro_batches: int) -> list:
    """``[(Lowered, runs)]`` one phase execution (``"forward"``/``"backward"``) runs."""
    runs = [(self.load, 1)] if self.load is not None else []
    if direction == "forward":
      return runs + [(self.forward, micro_batches)]
    return runs + [(self.backward, micro_batches), (self.update, 1)]


# -- lowering once per kind ------------------------------------------------------------------

# Lowered programs by what decides them, so a serial and a ping-pong trainer of
# one model (same programs, different schedules) lower each program once. The
# key names the optimizer and config by id, so each entry also holds them: an
# id is not reused while its object lives.
_LOWERED: dict = {}


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def program_args(kind: PhaseKind, optimizer, layout) -> dict:
  """One replica's, one micro-batch's argument shapes.

  ``stored``: the weights and optimizer state as Streaming Memory holds them
  (RTS shards); ``weights``: whole on the tiles; ``x``; ``seed`` (the output's
  cotangent, or the last phase's extras).
  """
  dp = layout.dp
  state = jax.eval_shape(optimizer.init, kind.params)
  stored = shard_shapes(kind.params, dp) if layout.rts else kind.params
  if layout.rts:
    state = shard_shapes(state, dp)
  if kind.role == "last":
    seed = tuple(kind.extras)
  else:
    seed = jax.eval_shape(kind.apply, kind.params, kind.x)
  return {"stored": stored, "opt_state": state, "weights": kind.params, "x": kind.x,
          "seed": seed}


def _offloaded(layout, update: bool, state=()) -> dict:
  """The load's shards, and the update's weights and optimizer state (when the
  optimizer has any, e.g. not plain SGD), live remote."""
  remote = [0] if layout.remote_weights else []
  if update and layout.remote_optimizer_state and jax.tree.leaves(state):
    remote.append(1)
  return {"offload_argnums": tuple(remote),
          "offload_outputs": tuple(remote) if update else ()}


def _key(kind: PhaseKind, optimizer, layout, target, config) -> tuple:
  sig = lambda t: (jax.tree.structure(t), tuple(  # noqa: E731
      (tuple(a.shape), np.dtype(a.dtype).name) for a in jax.tree.leaves(t)))
  return (kind.role, kind.apply, sig(kind.params), sig(kind.x), sig(kind.extras),
          id(optimizer), layout.dp, layout.rts, layout.batch_serialisation,
          layout.remote_weights, layout.remote_optimizer_state, target, id(config))


@contextlib.contextmanager
def bind_mesh_axes(layout):
  """The mesh axes bound around what runs inside (as ``ipu_jax.parallel.spmd``
  lowers): tracing a phase's apply (its shapes, its programs) sees ``"tp"``
  (and with tensor parallelism ``"replicas"``) as vmap axes, and the lowering
  prices collectives over them over their replica groups. Without tensor
  parallelism ``"tp"`` is bound with size 1, so a phase written with the
  tensor-parallel ops runs unsplit (its collectives over a group of one);
  data parallelism alone is the replication factor, as the training layer
  lowers it."""
  from ipu_jax.lowering.rules.parallel import binding_axes
  axes = ((REPLICA_AXIS, layout.dp), (TP_AXIS, layout.tp)) if layout.tp > 1 else \
      ((TP_AXIS, 1),)
  with binding_axes(axes):
    yield


def lower_programs(kind: PhaseKind, optimizer, layout, target, config,
                   allow_out_of_memory: bool = False) -> PhasePrograms:
  """``kind``'s load, forward, backward and update programs, each lowered once (cached).

  Args:
    kind: the phase kind (one micro-batch's input shape).
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

  def lower(fn, *args, **offload):
    return ipu_jax.jit(fn, target=target, config=config, **offload).lower(*args)

  load = forward = None
  with bind_mesh_axes(layout):
    a = program_args(kind, optimizer, layout)
    if layout.rts:
      load = lower(load_fn(kind, layout.dp), a["stored"], **_offloaded(layout, False))
    if kind.role != "last":
      forward = lower(forward_fn(kind), a["weights"], a["x"])
    backward = lower(backward_fn(kind), a["weights"], a["weights"], a["x"], a["seed"])
    update = lower(update_fn(kind, optimizer, layout.dp, layout.rts, layout.batch_serialisation),
                   a["stored"], a["opt_state"], a["weights"],
                   **_offloaded(layout, True, a["opt_state"]))
  programs = PhasePrograms(kind, load, forward, backward, update)
  _LOWERED[key] = (programs, optimizer, given)
  return programs


def _squeezed(fn):
  """``fn`` with its outputs' leading axis of one dropped."""
  def run(*args):
    return [a[0] for a in fn(*args)]
  return run


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
    (the tp axis only when ``tp > 1``; with ``tp = 1`` ``"tp"`` is still bound,
    as a group of one).
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
      fn = jax.vmap(point, in_axes=tp_axes, axis_name=TP_AXIS, axis_size=tp)
      if tp == 1:  # "tp" bound as a group of one (see bind_mesh_axes); no tp axis out
        fn = _squeezed(fn)
      cache["fn"] = jax.jit(jax.vmap(fn, in_axes=dp_axes, axis_name=REPLICA_AXIS, axis_size=dp))
    return jax.tree.unflatten(lowered.out_tree, cache["fn"](*flat))
  return run
