""":class:`PhasedTrainer`: a phased training step that really runs, and its estimate.

The weights and optimizer state of every phase are held on the host between
phases (the Streaming Memory of the emulation; inside a phase program they
are its offloaded arguments and outputs). A step runs the forward phases in
order, each over its G micro-batches, storing each micro-batch's output, then
the backward phases in reverse: each recomputes its forward from the stored
input, accumulates its weight gradient over the micro-batches, reduces it
over the data-parallel replicas, updates its weights and stores them back.
Ping-pong runs the same programs (the numbers do not depend on which IPU
group a phase runs on); only the estimate differs.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import host_time
from ipu_jax.arguments import check_optimizer
from ipu_jax.phased.estimate import PhasedEstimate, compose, program_cycles
from ipu_jax.phased.layout import PhasedLayout
from ipu_jax.phased.memory import check_peaks, check_streaming_memory, phase_peaks
from ipu_jax.phased.model import PhasedModel
from ipu_jax.phased.programs import PhaseKind, bind_mesh_axes, lower_programs, mesh_runner
from ipu_jax.phased.streaming import (PhaseShapes, phase_traffic,
                                      streaming_memory_per_group)
from ipu_jax.sharded_optimizer import ShardedUpdate, gather_leaf, shard_tree

__all__ = ["PhasedTrainer"]


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _strip(tree, n: int):
  """Shapes without ``n`` leading axes."""
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(np.shape(a))[n:], a.dtype), tree)


def _as_batch(batch) -> tuple:
  """``batch = (inputs, *extras)`` with NumPy-readable leaves as arrays, checked."""
  if not isinstance(batch, (tuple, list)) or not batch:
    raise TypeError(f"PhasedTrainer.step takes batch = (inputs, *extras) (e.g. (x, y)), a "
                    f"tuple; got {type(batch).__name__}.")
  return tuple(jax.tree.map(np.asarray, e) if isinstance(e, (list, tuple)) else e
               for e in batch)


class PhasedTrainer:
  """Trains a :class:`PhasedModel` phase by phase.

  Args:
    model: the :class:`PhasedModel`. With ``mesh.tp > 1`` each phase's
      weights are stacked tensor-parallel shards (leading ``[tp]`` axis, as
      ``ipu_jax.parallel.shard_columns`` makes them) and its ``apply`` uses
      the tensor-parallel ops on one shard.
    optimizer: an optax ``GradientTransformation``.
    layout: the :class:`PhasedLayout`.
    target: ONE IPU's target (an ``IPUTarget`` or a preset name); default
      the config's.
    config: an ``ipu_jax.IPUConfig`` to lower with.

  Raises:
    PhaseOutOfMemoryError: the phases' remote state overflows an IPU's
      Streaming Memory (before anything runs).
  """

  def __init__(self, model: PhasedModel, optimizer, layout: PhasedLayout, target=None,
               config=None):
    import ipu_jax
    if not isinstance(model, PhasedModel):
      raise TypeError(f"PhasedTrainer: model must be a PhasedModel (PhasedModel([Phase(...), "
                      f"...]) or PhasedModel.from_layers), got {type(model).__name__}.")
    check_optimizer(optimizer, "PhasedTrainer: ")
    if not isinstance(layout, PhasedLayout):
      raise TypeError(f"PhasedTrainer: layout must be a PhasedLayout, got {type(layout).__name__}.")
    self.model, self.optimizer, self.layout, self.config = model, optimizer, layout, config
    if isinstance(target, str):  # a preset name, as ipu_jax.jit takes one
      target = ipu_jax.IPUTarget.preset(target)
    elif target is not None and not isinstance(target, ipu_jax.IPUTarget):
      raise TypeError(f"PhasedTrainer: target must be an ipu_jax.IPUTarget or a preset name, "
                      f"got {type(target).__name__}.")
    target = target if target is not None else (config or ipu_jax.IPUConfig()).to_target()
    self.target = target.replace(num_ipus=1)
    self._lead = 1 if layout.tp > 1 else 0
    self._shard_params = [_strip(p.params, self._lead) for p in model.phases]
    # Weights given as shapes (jax.ShapeDtypeStruct): an estimate-only trainer.
    self.shapes_only = any(isinstance(leaf, jax.ShapeDtypeStruct)
                           for p in model.phases for leaf in jax.tree.leaves(p.params))
    self._weights = self._opt = None
    if not self.shapes_only:
      self._weights = [self._initial_weights(p.params) for p in model.phases]
      self._opt = [self._initial_state(p.params) for p in model.phases]
    self._runners = {}
    self._last_batch = None
    self.steps = 0
    # Weights and optimizer state alone must fit Streaming Memory: checked now.
    check_streaming_memory(self._held(None), layout, self.target)

  # -- state on the host ("remote") ---------------------------------------------------------

  def _per_tp(self, fn, params):
    """``fn`` applied to each tensor-parallel shard, stacked (or once for tp = 1)."""
    if not self._lead:
      return fn(params)
    shards = [fn(jax.tree.map(lambda a: a[t], params)) for t in range(self.layout.tp)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *shards)

  def _per_replica(self, fn, params):
    replicas = [self._per_tp(lambda p: fn(p, r), params) for r in range(self.layout.dp)]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *replicas)

  def _initial_weights(self, params):
    params = jax.tree.map(jnp.asarray, params)
    if not self.layout.rts:
      return params
    return self._per_replica(lambda p, r: shard_tree(p, r, self.layout.dp), params)

  def _initial_state(self, params):
    params = jax.tree.map(jnp.asarray, params)
    if not self.layout.rts:
      return self._per_tp(self.optimizer.init, params)
    sharded = ShardedUpdate(self.optimizer, _strip(params, self._lead), self.layout.dp)
    return self._per_replica(sharded.init, params)

  @property
  def params(self) -> list:
    """Each phase's current weights, whole (RTS shards gathered; with tp > 1
    the stacked ``[tp, ...]`` shards)."""
    if not self.layout.rts:
      return [jax.tree.map(np.asarray, w) for w in self._weights]
    out = []
    for w, like in zip(self._weights, self.model.phases):
      def whole(shards, leaf):
        leaf_shape = np.shape(leaf)[self._lead:]
        if not len(leaf_shape):
          return np.asarray(shards[0])
        one = jax.ShapeDtypeStruct(leaf_shape, leaf.dtype)
        if self._lead:
          return np.stack([np.asarray(gather_leaf(jnp.reshape(shards[:, t], (-1,)), one))
                           for t in range(self.layout.tp)])
        return np.asarray(gather_leaf(jnp.reshape(shards, (-1,)), one))
      out.append(jax.tree.map(whole, w, like.params))
    return out

  # -- programs ------------------------------------------------------------------------------

  def _kinds(self, x, extras):
    """Each phase's kind index and the :class:`PhaseKind` of each kind (one micro-batch)."""
    shard_model = PhasedModel([type(p)(p.name, p.apply, s)
                               for p, s in zip(self.model.phases, self._shard_params)])
    with bind_mesh_axes(self.layout):  # a TP phase's apply uses collectives over "tp"
      kinds = shard_model.kinds(x, *extras)
      avals = shard_model.input_avals(x, *extras)
    last = len(kinds) - 1
    table = {}
    for k, (phase, kind) in enumerate(zip(shard_model.phases, kinds)):
      if kind not in table:
        role = "first" if k == 0 else ("last" if k == last else "middle")
        table[kind] = PhaseKind(role, phase.apply, phase.params, avals[k],
                                tuple(_abstract(e) for e in extras) if k == last else ())
    return kinds, table, avals

  def _lower(self, x, extras, allow_out_of_memory=False):
    kinds, table, avals = self._kinds(x, extras)
    start = time.perf_counter()
    programs = {k: lower_programs(kind, self.optimizer, self.layout, self.target, self.config,
                                  allow_out_of_memory) for k, kind in table.items()}
    return kinds, table, avals, programs, time.perf_counter() - start

  def _runner(self, kind_index, which, lowered):
    """The mesh runner of one program; arguments in the host's layouts.

    Weights: on the host ``[(tp,) ...]`` (RTS: ``[dp, (tp,) ...]`` shards, and
    what the load program returns is stacked ``[dp, (tp,) ...]``); the
    gradient accumulator is stacked ``[dp, (tp,) ...]``; activations
    ``[dp, ...]``.
    """
    key = (kind_index, which, id(lowered))
    if key not in self._runners:
      tp = self._lead == 1
      state = (self.layout.rts, tp)
      stacked, data = (True, tp), (True, False)
      axes = {"load": [state], "forward": [state, data],
              "backward": [state, stacked, data, data],
              "update": [state, state, stacked]}[which]
      self._runners[key] = mesh_runner(lowered, self.layout.dp, self.layout.tp, axes)
    return self._runners[key]

  # -- one step ------------------------------------------------------------------------------

  def _split(self, batch):
    """``[dp, G, micro-batch, ...]`` of every array of the batch, checked first."""
    x, *extras = batch
    size = int(np.shape(x)[0]) if np.ndim(x) else 0
    mb = self.layout.check_batch(size)
    for i, e in enumerate(extras):
      if np.shape(e)[0] != size:
        raise ValueError(f"PhasedTrainer.step: batch element {i + 1} has {np.shape(e)[0]} "
                         f"samples, the inputs {size}.")
    shape = (self.layout.dp, self.layout.batch_serialisation, mb)
    split = lambda a: jnp.reshape(jnp.asarray(a), shape + tuple(np.shape(a)[1:]))  # noqa: E731
    return split(x), tuple(split(e) for e in extras)

  def _state_out(self, tree):
    """Program outputs stacked over the mesh back in the host's layout."""
    if self.layout.rts:
      return tree  # [dp, (tp,) ...]: each replica's shards
    return jax.tree.map(lambda a: a[0], tree)  # replicated: replica 0's

  def _act_out(self, a):
    return a[:, 0] if self._lead else a

  def _loaded(self, i, kind, programs):
    """Phase ``i``'s weights on the tiles for its micro-batch loop (RTS: gathered once)."""
    if programs.load is None:
      return self._weights[i]
    (full,) = self._runner(kind, "load", programs.load)(self._weights[i])
    return full

  def _zeros_like_loaded(self, weights):
    """A zero gradient accumulator per replica, ``[dp, (tp,) ...]``."""
    # Zeros from the host: an eager jnp.zeros compiles a program per shape.
    lead = () if self.layout.rts else (self.layout.dp,)
    return jax.tree.map(lambda a: jax.device_put(np.zeros(lead + np.shape(a), a.dtype)), weights)

  def _forward_phase(self, i, kind, programs, xs):
    """Phase ``i``'s forward over the G micro-batches ``xs[:, g]``: ``[dp, G, ...]`` outputs."""
    weights = self._loaded(i, kind, programs)
    run = self._runner(kind, "forward", programs.forward)
    ys = [self._act_out(run(weights, xs[:, g])[0]) for g in range(xs.shape[1])]
    return jnp.stack(ys, axis=1)

  def _backward_phase(self, i, kind, programs, xs, seeds):
    """Phase ``i``'s backward and update: its input gradients ``[dp, G, ...]`` and losses."""
    weights = self._loaded(i, kind, programs)
    acc = self._zeros_like_loaded(weights)
    run = self._runner(kind, "backward", programs.backward)
    dxs, losses = [], []
    for g in range(self.layout.batch_serialisation):
      seed = jax.tree.map(lambda a: a[:, g], seeds)
      out = run(weights, acc, xs[:, g], seed)
      acc = out[0]
      if programs.kind.role != "first":
        dxs.append(self._act_out(out[1]))
      if programs.kind.role == "last":
        losses.append(out[2])
    new = self._runner(kind, "update", programs.update)(self._weights[i], self._opt[i], acc)
    self._weights[i], self._opt[i] = self._state_out(new[0]), self._state_out(new[1])
    return (jnp.stack(dxs, axis=1) if dxs else None), losses

  def step(self, batch) -> float:
    """One training step on ``batch = (inputs, *extras)``; returns the mean loss.

    Each phase runs its micro-batch programs G times between one load of its
    weights and one store (batch serialisation); each micro-batch's
    activation is kept on the host (Streaming Memory) between phases.

    Raises:
      ValueError: the batch is not divisible by ``dp x batch_serialisation``.
    """
    if self.shapes_only:
      raise ValueError("PhasedTrainer.step: the model's weights are shapes "
                       "(jax.ShapeDtypeStruct), so it can only be estimated; give arrays "
                       "to train.")
    batch = _as_batch(batch)
    xs, extras = self._split(batch)
    micro = (_abstract(xs[0, 0]), tuple(_abstract(e[0, 0]) for e in extras))
    kinds, _, avals = self._kinds(*micro)
    check_streaming_memory(self._held((kinds, avals)), self.layout, self.target)
    kinds, table, _, programs, _ = self._lower(*micro)
    self._last_batch = tuple(_abstract(a) for a in batch)
    stored = []
    for i in range(len(kinds) - 1):
      stored.append(xs)
      xs = self._forward_phase(i, kinds[i], programs[kinds[i]], xs)
    seeds, losses = extras, None
    for i in reversed(range(len(kinds))):
      inputs = xs if i == len(kinds) - 1 else stored[i]
      dxs, phase_losses = self._backward_phase(i, kinds[i], programs[kinds[i]], inputs, seeds)
      seeds = dxs
      if i == len(kinds) - 1:
        losses = phase_losses
    self.steps += 1
    return float(np.mean([np.asarray(l) for l in losses]))

  # -- the estimate --------------------------------------------------------------------------

  def estimate(self, batch=None, raise_on_out_of_memory: bool = True) -> PhasedEstimate:
    """The step's estimate without running it.

    Args:
      batch: ``(inputs, *extras)`` (arrays or ``jax.ShapeDtypeStruct``s);
        ``None``: the shapes of the last batch :meth:`step` ran.
      raise_on_out_of_memory: raise :class:`PhaseOutOfMemoryError` (else
        report ``fits=False``).
    """
    if batch is None:
      if self._last_batch is None:
        raise ValueError("PhasedTrainer.estimate() needs a batch (or its shapes) before the "
                         "first step: estimate((inputs, *extras)).")
      batch = self._last_batch
    return self.estimate_from_shapes(*batch, raise_on_out_of_memory=raise_on_out_of_memory)

  def estimate_from_shapes(self, x, *extras, raise_on_out_of_memory: bool = True
                           ) -> PhasedEstimate:
    """The estimate from a batch's shapes (``jax.ShapeDtypeStruct``s are enough).

    Each distinct phase program is lowered once (identical layers share
    theirs), so the cost does not grow with the number of layers.
    """
    size = int(np.shape(x)[0])
    mb = self.layout.check_batch(size)
    micro = lambda a: jax.ShapeDtypeStruct((mb,) + tuple(np.shape(a)[1:]), a.dtype)  # noqa: E731
    kinds, table, avals, programs, seconds = self._lower(
        micro(x), tuple(micro(e) for e in extras), allow_out_of_memory=True)
    estimate = self._compose(kinds, table, avals, programs, raise_on_out_of_memory)
    estimate.lower_seconds = seconds
    estimate.samples_per_step = size
    estimate.peak_rss_bytes = host_time.peak_rss_bytes()
    return estimate

  def _held(self, kinds_avals) -> np.ndarray:
    """Streaming Memory per IPU of each group; weights and state only when no batch is known."""
    if kinds_avals is None:
      layout = self.layout
      n = len(self.model.phases)
      none = jax.ShapeDtypeStruct((0,), jnp.float32)
      shapes = [PhaseShapes.of(p.name, i, i, self._shard_params[i],
                               jax.eval_shape(self.optimizer.init, self._shard_params[i]),
                               none, none, layout) for i, p in enumerate(self.model.phases)]
      assert len(shapes) == n
      return streaming_memory_per_group(shapes, layout)
    kinds, avals = kinds_avals
    return streaming_memory_per_group(self._shapes(kinds, None, avals), self.layout)

  def _shapes(self, kinds, table, avals) -> list:
    shapes = []
    for i, phase in enumerate(self.model.phases):
      params = self._shard_params[i]
      state = jax.eval_shape(self.optimizer.init, params)
      y = avals[i + 1] if i < len(kinds) - 1 else jax.ShapeDtypeStruct((), jnp.float32)
      shapes.append(PhaseShapes.of(phase.name, i, kinds[i], params, state, avals[i], y,
                                   self.layout))
    return shapes

  def _compose(self, kinds, table, avals, programs, raise_oom) -> PhasedEstimate:
    layout, target = self.layout, self.target
    shapes = self._shapes(kinds, table, avals)
    traffic = phase_traffic(shapes, layout)
    g = layout.batch_serialisation
    distinct, index = [], {}
    executions, runs = [], []
    for t in traffic:
      used = programs[t.kind].of_execution(t.direction, g)
      for lowered, _ in used:
        if id(lowered) not in index:
          index[id(lowered)] = len(distinct)
          distinct.append(lowered.profile)
      executions.append((t.name, t.group, tuple(index[id(low)] for low, _ in used)))
      runs.append(tuple(n for _, n in used))
    figures = []
    for (_, _, used), counts in zip(executions, runs):
      cycles = [program_cycles(distinct[p]) for p in used]
      figures.append(tuple(sum(n * c[j] for n, c in zip(counts, cycles)) for j in (0, 1)))
    on_chip = 0 if layout.remote_activations else \
        sum(layout.batch_serialisation * s.input_bytes for s in shapes[1:])
    peaks = phase_peaks(executions, distinct, layout, target, on_chip)
    held = streaming_memory_per_group(shapes, layout)
    tiles_fit = all(float(t.max()) <= target.bytes_per_tile for _, t in peaks)
    streaming_fits = bool((held <= target.streaming_memory_bytes).all())
    if raise_oom:
      check_streaming_memory(held, layout, target)
      check_peaks(executions, peaks, layout, target)
    rows = compose(traffic, figures, layout, target, [p for p, _ in peaks])
    return PhasedEstimate(rows, layout, target, max(p for p, _ in peaks), int(held.max()),
                          tiles_fit and streaming_fits, programs_lowered=len(distinct))
