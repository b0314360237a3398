"""A pipeline stage's weight update: optimizer state offloaded, sharded over replicas.

Two ``IPUConfig.streaming`` options reach :class:`~ipu_jax.pipelining.Pipeline`
as they reach the Keras-like ``fit`` (``ipu_jax/keras/offload.py``):

* ``offload_optimizer_state``: each stage's update program is lowered with its
  optimizer state (argument 1 and output 1 of the program) in streaming
  memory (``ipu_jax.jit(..., offload_argnums=1, offload_outputs=1)``,
  ``ipu_jax/offload.py``): streamed onto the stage's IPU for the update and
  back after it, so the stage's IPU holds no state between updates
  (TensorFlow-IPU's ``offload_weight_update_variables`` in a pipeline).
* ``replicated_tensor_sharding`` with ``replication_factor`` R > 1: the
  pipeline's R copies of a stage each hold one R-th of its state. The stage's
  gradients, all-reduced over the R copies without sharding, are instead
  reduce-scattered (each copy gets the reduced gradients of its shard); each
  copy updates its shard of the weights with its shard of the state; the new
  weights are all-gathered. The update program is the optimizer's own,
  interpreted on shards (:class:`ipu_jax.sharded_optimizer.ShardedUpdate`):
  a reduction over a whole weight (LAMB's trust ratio, a clip by global norm)
  is reduced on each shard and then across the copies by a scalar all-reduce
  inside the program, lowered for R replicas and costed by its tile rule. The
  program runs once per copy (``jax.vmap`` over the replica axis).

Order: the update is lowered weight by weight
(:func:`ipu_jax.lowering.update_order.in_chain_order`), as TensorFlow-IPU's
and PopART's liveness-minimising schedulers run it, not in optax's
operation-by-operation trace order; with the state offloaded, each weight's
state is then streamed in just before its chain and out right after it
(``lowering/remote.py``), so the tiles hold one weight's state at a time.
The numbers do not change (only the order does).

Costs: in the step's timeline, where the all-reduce of an unsharded
pipeline's gradients sits, a sharded stage spends one ring reduce-scatter and
one ring all-gather of its (padded) sharded weights, plus an all-reduce of its
scalar weights; each ring phase is (R - 1) steps moving (R - 1)/R of the
bytes, the two halves of :func:`~ipu_jax.pipelining.links.all_reduce_cycles`.
The numbers of the reduction are computed as the unsharded pipeline computes
its all-reduce (the R copies' accumulated gradients summed on the host), then
cut into shards: a reduce-scatter's result.

The optimizer acts on each stage's own weights, as without sharding: a norm
over "all" weights (a global-norm clip) is the norm over the stage's weights.
:func:`init_state` warns when the whole model's update would read across
stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import collectives
from ipu_jax.lowering.options import MEMORY_PROPORTIONS
from ipu_jax.lowering.update_order import in_chain_order
from ipu_jax.ops.collectives import REPLICA_AXIS
from ipu_jax.pipelining import cross_stage, links, stage_programs
from ipu_jax.sharded_optimizer import (ShardedUpdate, gather_leaf, is_sharded_leaf,
                                       shard_tree, sharded_bytes)

__all__ = ["ShardedStageUpdate", "SharedUpdates", "offloads_state", "shards_state", "lower_update",
           "init_state", "gradient_reduction_cycles", "ring_phase_cycles", "summary_lines"]


def offloads_state(pipeline) -> bool:
  return bool(pipeline.config.streaming.offload_optimizer_state)


def shards_state(pipeline) -> bool:
  """Replicated tensor sharding: on, with more than one replica."""
  return bool(pipeline.config.streaming.replicated_tensor_sharding) and pipeline.replicas > 1


def _jit_options(pipeline, state) -> dict:
  # A stateless optimizer (SGD) has nothing to stream.
  if not offloads_state(pipeline) or not jax.tree.leaves(state):
    return {}
  return {"offload_argnums": (1,), "offload_outputs": (1,)}


def _stack_sharded(shards):
  """Per-copy trees as one: sharded leaves stacked ``[R, n]``, scalar leaves once."""
  return jax.tree.map(lambda *xs: jnp.stack(xs) if np.ndim(xs[0]) else xs[0], *shards)


def _stacked_shards(tree, replicas: int):
  return _stack_sharded([shard_tree(tree, r, replicas) for r in range(replicas)])


def _copy_axes(tree):
  """``vmap`` axes of a stacked tree: 0 for the stacked shards, None for scalars."""
  return jax.tree.map(lambda x: 0 if np.ndim(x) else None, tree)


@dataclasses.dataclass
class ShardedStageUpdate:
  """A stage's update with replicated tensor sharding, run on its R copies.

  Called like the unsharded update program (``update(p_k, state, g_k)``), it
  takes the full weights, the stage's gradients reduced over the copies and
  the state in :meth:`init`'s layout; it cuts the weights and gradients into
  the copies' shards (what a reduce-scatter leaves each copy), runs the
  per-copy program ``lowered`` on every copy (``jax.vmap`` over the replica
  axis, so the norms' all-reduces run across the copies) and gathers the new
  weights (an all-gather).

  Attributes:
    lowered: the per-copy program, ``(param shards, state, grad shards,
      replica) -> (param shards, state)``, lowered for R replicas.
    program: the :class:`~ipu_jax.sharded_optimizer.ShardedUpdate` it runs.
    replicas: R.
  """
  lowered: Any
  program: ShardedUpdate
  replicas: int
  _jitted: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

  def __getattr__(self, name):
    # What the pipeline reads of a stage program (profile, report, dead code)
    # is the per-copy program's: every copy runs it.
    if name == "lowered":  # not yet set (copying): no recursion
      raise AttributeError(name)
    return getattr(self.lowered, name)

  def init(self, p_k):
    """The state: leaves with an axis as their R shards ``[R, n]``; scalar leaves
    (step counts, a loss scale) once, as every copy holds the same."""
    return _stack_sharded([self.program.init(p_k, r) for r in range(self.replicas)])

  def __call__(self, p_k, state, g_k):
    # One XLA program for the cut, the R copies' updates and the gather: run
    # eagerly, ``jax.vmap`` would dispatch (and compile) every primitive of
    # the per-copy program on its own, hundreds of compiles per stage.
    if self._jitted is None:
      self._jitted = jax.jit(self._update)
    # The device state (the stochastic rounding generators) is an argument:
    # read at every call, as the eager run read it, not fixed at the first trace.
    return self._jitted(p_k, state, g_k, list(self.lowered.device_state))

  def _update(self, p_k, state, g_k, device_state):
    r, lowered = self.replicas, self.lowered
    p_shards, g_shards = _stacked_shards(p_k, r), _stacked_shards(g_k, r)
    run = jax.vmap(lambda *args: lowered.apply_with_state(device_state,
                                                          *jax.tree.leaves(args))[0],
                   in_axes=(_copy_axes(p_shards), _copy_axes(state), _copy_axes(g_shards), 0),
                   axis_name=REPLICA_AXIS)
    p_shards, new_state = run(p_shards, state, g_shards, jnp.arange(r, dtype=jnp.int32))
    new_p = [gather_leaf(jnp.reshape(s, (-1,)), like) if is_sharded_leaf(like) else s[0]
             for s, like in zip(p_shards, p_k)]
    # Scalar leaves are equal on every copy: kept once.
    new_state = jax.tree.map(lambda x, old: x if np.ndim(old) else x[0], new_state, state)
    return new_p, new_state


def _sharded_function(program: ShardedUpdate):
  """The per-copy update: ``(param shards, state shards, grad shards, replica)``."""

  def update(p_shards, state, g_shards, replica):
    return program(g_shards, state, p_shards, replica)

  update.__name__ = "sharded_update"
  return update


def _shapes_key(tree) -> tuple:
  """What a lowering of ``tree``'s leaves depends on: its structure, shapes and dtypes."""
  leaves, structure = jax.tree.flatten(tree)
  return structure, tuple((tuple(np.shape(x)), np.dtype(x.dtype).name) for x in leaves)


class SharedUpdates:
  """One pipeline lowering's update functions, shared by the stages alike.

  Stages whose weights have the same shapes and dtypes, on IPUs with the
  same options, run the same update program (BERT's encoder stages): one
  ``ipu_jax.jit`` function per optimizer program and stage config serves them
  all, so its cache (keyed on the arguments' shapes, target and options)
  lowers that program once; a :class:`ShardedUpdate` is traced once per set
  of weight shapes. An update whose lowering read no memory proportion (no
  matmul: Adam, LAMB) also serves configs that differ only in the
  proportions, as a split search's probes do (:meth:`lowered`).

  Attributes:
    lowerings: how many update programs were lowered (the rest reused one).
  """

  def __init__(self):
    self._programs = {}  # (optimizer, R, _shapes_key(p_k)) -> ShardedUpdate
    self._functions = []  # (program or optimizer, lowering settings, options, jit function)
    self._sharded = {}  # id(lowered) -> ShardedStageUpdate (which holds the lowered alive)
    # (id(program), settings but the proportions, options, arguments' shapes) ->
    # (program, lowered): the lowerings that read no memory proportion (the
    # program held, so its id stays its own while the entry lives).
    self._proportion_free = {}
    self._lowered = {}  # id(lowered) -> lowered: the programs counted in ``lowerings``
    self.lowerings = 0

  def sharded(self, lowered, program: ShardedUpdate, replicas: int) -> ShardedStageUpdate:
    """The :class:`ShardedStageUpdate` running ``lowered``: one for the stages
    alike, so its R copies' program is compiled once for them all."""
    if id(lowered) not in self._sharded:
      self._sharded[id(lowered)] = ShardedStageUpdate(lowered, program, replicas)
    return self._sharded[id(lowered)]

  def program(self, optimizer, p_k, replicas: int) -> ShardedUpdate:
    """The :class:`ShardedUpdate` of weights shaped as ``p_k``.

    Not checked apart (``ShardedUpdate.check`` is a trace of the program on
    shards): :func:`lower_update` traces that same program on the same
    shards right after, which raises the same error before anything runs.
    """
    # Keyed by the optimizer too: pipelines of a split search share one of these.
    key = (optimizer, replicas, _shapes_key(p_k))
    if key not in self._programs:
      self._programs[key] = ShardedUpdate(optimizer, p_k, replicas)
    return self._programs[key]

  def lowered(self, program, make, cfg, options: dict, args: tuple):
    """``program``'s update lowered on ``args`` under ``cfg``: a lowering met before, or a new one.

    A lowering under a config that differs only in the memory proportions
    serves when it read none of them (``TileProgram.proportions_read``):
    without a matmul, convolution or sparse product the proportions change
    nothing of it. Arguments as :meth:`function` takes them.
    """
    from ipu_jax.pipelining.shared_stages import lowering_settings
    key = (id(program), lowering_settings(cfg, ignoring=MEMORY_PROPORTIONS),
           tuple(sorted(options.items())), _shapes_key(args))
    known = self._proportion_free.get(key)
    if known is not None:
      return known[1]
    lowered = self.function(program, make, cfg, options).lower(*args)
    if id(lowered) not in self._lowered:  # not the jit function's cached lowering
      self._lowered[id(lowered)] = lowered
      self.lowerings += 1
    if lowered.tile is not None and not lowered.tile.proportions_read:
      self._proportion_free[key] = (program, lowered)
    return lowered

  def function(self, program, make, cfg, options: dict):
    """The jitted ``make()`` of ``program`` under ``cfg``.

    ``program``: the :class:`ShardedUpdate`, or for the plain update the
    optimizer itself (compared by identity either way).
    """
    from ipu_jax.jit import jit
    from ipu_jax.pipelining.shared_stages import lowering_settings
    settings = lowering_settings(cfg)
    for known, known_settings, known_options, fn in self._functions:
      if known is program and known_options == options and known_settings == settings:
        return fn
    fn = jit(make(), config=cfg, **options)
    self._functions.append((program, settings, options, fn))
    return fn


def lower_update(pipeline, p_k, cfg, shared: SharedUpdates | None = None):
  """The update program of a stage with weights ``p_k`` (None without optimizer).

  ``shared``: the update functions of the stages lowered so far in this
  lowering of the pipeline, or in the pipelines of a split search (a stage
  alike reuses their programs); a fresh one when None.

  Returns:
    The lowered ``update(p_k, state, g_k) -> (p_k, state)``, or with sharding
    a :class:`ShardedStageUpdate` called the same way.

  Raises:
    ShardedOptimizerError: with sharding on, an optimizer whose update cannot
      run on shards (raised here, while the pipeline is lowered).
  """
  optimizer = pipeline.optimizer
  if optimizer is None:
    return None
  shared = SharedUpdates() if shared is None else shared
  if not shards_state(pipeline):
    state = optimizer.init(p_k)
    return shared.lowered(
        optimizer, lambda: in_chain_order(stage_programs.update_function(optimizer)), cfg,
        _jit_options(pipeline, state), (p_k, state, p_k))
  r = pipeline.replicas
  program = shared.program(optimizer, p_k, r)
  replicated = cfg.copy()  # the norms' all-reduces are over the R copies
  replicated.replication_factor = r
  state = program.init(p_k, 0)
  lowered = shared.lowered(
      program, lambda: in_chain_order(_sharded_function(program)), replicated,
      _jit_options(pipeline, state),
      (shard_tree(p_k, 0, r), state, shard_tree(p_k, 0, r), jnp.int32(0)))
  return shared.sharded(lowered, program, r)


def init_state(pipeline, flat_params) -> list:
  """Each stage's optimizer state (sharded: :meth:`ShardedStageUpdate.init`'s layout).

  Warns when the optimizer mixes weights across stages
  (:func:`~ipu_jax.pipelining.cross_stage.warn_if_mixing`): the pipeline's
  updates see one stage each.
  """
  cross_stage.warn_if_mixing(pipeline, flat_params)
  states = []
  for stage, programs in zip(pipeline.staged.stages, pipeline.stages):
    p_k = [flat_params[i] for i in stage.owned]  # tied weights: their owner's state only
    update = programs.update
    states.append(update.init(p_k) if isinstance(update, ShardedStageUpdate)
                  else pipeline.optimizer.init(p_k))
  return states


def ring_phase_cycles(target, replicas: int, nbytes: int, ipu: int = 0,
                      ipus_per_replica: int | None = None, gather: bool = False) -> float:
  """One ring phase (a reduce-scatter or an all-gather) of ``nbytes`` over ``replicas``.

  Half of :func:`~ipu_jax.pipelining.links.all_reduce_cycles`: ``R - 1``
  steps, each moving ``1/R`` of the bytes over the 2 links to the ring
  neighbour and ending in a sync. With ``target.system`` set, the phase
  between IPU ``ipu`` of every replica is priced over the system's links
  (:mod:`ipu_jax.kernels.collectives`).
  """
  if replicas <= 1 or nbytes <= 0:
    return 0.0
  if target.system is not None:
    groups = collectives.replica_groups(target.system, replicas,
                                        ipus_per_replica or target.num_ipus, [ipu])
    phase = collectives.all_gather if gather else collectives.reduce_scatter
    return phase(target, groups, nbytes).cycles
  steps = replicas - 1
  moved = nbytes * steps / replicas
  per_step = target.exchange_latency_cycles + target.ipu_sync_cycles(replicas)
  return moved / (2 * links.LINK_BYTES_PER_SECOND) * target.clock_hz + steps * per_step


def gradient_reduction_cycles(pipeline, programs, ipus_per_replica: int | None = None) -> float:
  """Cycles of a stage's gradient reduction over the replicas, per step.

  Unsharded: a ring all-reduce of its weights' bytes. Sharded: a
  reduce-scatter and an all-gather of its sharded weights (padded to
  multiples of R), and an all-reduce of its scalar weights. Between the
  stage's IPU in every replica (over the system's links when one is set).
  """
  target, r, ipu = pipeline.target, pipeline.replicas, programs.ipu
  if not isinstance(programs.update, ShardedStageUpdate):
    return links.all_reduce_cycles(target, r, programs.weight_bytes, ipu, ipus_per_replica)
  params = programs.update.program.params
  scalars = sum(np.dtype(p.dtype).itemsize for p in jax.tree.leaves(params)
                if not is_sharded_leaf(p))
  sharded = sharded_bytes(params, r)
  return (ring_phase_cycles(target, r, sharded, ipu, ipus_per_replica)
          + ring_phase_cycles(target, r, sharded, ipu, ipus_per_replica, gather=True)
          + links.all_reduce_cycles(target, r, scalars, ipu, ipus_per_replica))


def summary_lines(pipeline_report) -> list:
  """The summary's lines on where the state lives and how the update is sharded."""
  stages = [s for s in pipeline_report.stages if s.update is not None]
  if not stages:
    return []
  lines = []
  streaming = [s.update.profile.streaming for s in stages]
  if any(streaming):
    held = sum(s.total_bytes for s in streaming if s)
    lines.append(f"  optimizer state in streaming memory: {held:,d} B per replica "
                 f"(stage update programs; {pipeline_report.replicas} replica(s))")
  sharded = [s for s in stages if isinstance(s.update, ShardedStageUpdate)]
  if sharded:
    ops = {}  # op -> [steps, cycles] over the stages' update programs
    for s in sharded:
      for step in s.update.profile.steps:
        if (step.op or "").startswith("cross_replica"):
          entry = ops.setdefault(step.op, [0, 0.0])
          entry[0] += step.executions
          entry[1] += step.total_cycles * step.executions
    collectives = ", ".join(f"{n} x {op} ({c:,.0f} cycles)"
                            for op, (n, c) in sorted(ops.items())) or "none"
    lines.append(f"  replicated tensor sharding over {pipeline_report.replicas} replicas: "
                 f"gradients reduce-scattered, weights all-gathered; collectives inside the "
                 f"updates: {collectives}")
  return lines
