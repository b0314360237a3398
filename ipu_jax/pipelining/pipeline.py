"""``Pipeline``: train a model split into stages placed on IPUs.

The loss function is split at its ``pipeline_stage`` marks
(:mod:`~ipu_jax.pipelining.split`). Each stage gets three tile programs --
forward, backward and weight update (:mod:`~ipu_jax.pipelining.stage_programs`)
-- all lowered for one IPU of ``device.tiles_per_ipu`` tiles, so its tensors
live only on that IPU's tiles.

A step runs these programs in the schedule's order (every stage accumulates
its micro-batches in order 0..G-1, so the numbers equal plain gradient
accumulation). Time and memory come from the programs' profiles: the step is
laid out slot by slot (:mod:`~ipu_jax.pipelining.schedule`), values crossing
stages are costed over IPU-Links and syncs across IPUs
(:mod:`~ipu_jax.pipelining.links`), and each IPU's memory is its largest
program plus the activation sets the schedule keeps waiting (stash depth).

``device_mapping`` may put several stages on one IPU (``[0, 1, 2, 3, 0]``,
Grouped and Sequential schedules): they run in the slots the schedule gives
each, one after another within a slot, and share the IPU's tiles and memory
(the largest of their programs, beside what the others hold, plus all their
stashes). A weight read by several stages on one IPU (tied weights) lives
once: its first reader owns it (update, optimizer state), the others add
their gradient contributions into its accumulator; read across IPUs it is
refused. The rules: :mod:`~ipu_jax.pipelining.layout`.

With ``replication_factor`` R, R copies of the pipeline use R x N IPUs; each
stage's gradients are all-reduced over its R copies before its update
(reduce-scattered, and the weights all-gathered after it, with the state
sharded: :mod:`~ipu_jax.pipelining.weight_update`).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.arguments import check_optimizer
from ipu_jax import config as config_lib
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.pipelining import layout, links, schedule as schedule_lib, stage_programs
from ipu_jax.pipelining import shared_stages, weight_update
from ipu_jax.pipelining.micro_batches import MicroBatchInputs, StepTaps, one_of_stacked
from ipu_jax.pipelining.stage_programs import StagePrograms
from ipu_jax.pipelining.split import PipelineError, split_stages

__all__ = ["Pipeline", "StagePrograms", "StepResult", "check_steps_per_execution"]


class StepResult(NamedTuple):
  """What :meth:`Pipeline.step` returns, read by name (``result.params``).

  Always these five fields, whatever the pipeline's ``rng`` / ``mutable`` /
  ``has_aux``, so it does not unpack into three names: read the fields
  (``out = pipe.step(...); params, opt_state = out.params, out.opt_state``).

  Attributes:
    params: the updated weights (like the step's ``params``).
    opt_state: the stages' new optimizer states (one per stage).
    loss: the step's mean loss over its micro-batches.
    state: the new state after the step (``mutable``; else ``None``).
    aux: the loss's aux, stacked per micro-batch (``has_aux``; else ``None``).
  """
  params: Any
  opt_state: Any
  loss: Any
  state: Any = None
  aux: Any = None


def check_steps_per_execution(steps_per_execution: int, accumulation: int,
                              replicas: int) -> None:
  """Raise unless ``steps_per_execution`` is a positive multiple of ``G x R``."""
  if (isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, numbers.Integral)
      or steps_per_execution < 1):
    raise PipelineError(f"steps_per_execution must be a positive int (a multiple of "
                        f"gradient_accumulation_steps x replication_factor = "
                        f"{accumulation * replicas}); got {steps_per_execution!r}.")
  if steps_per_execution % (accumulation * replicas):
    raise PipelineError(
        f"steps_per_execution={steps_per_execution} must be a multiple of "
        f"gradient_accumulation_steps x replication_factor = {accumulation} x {replicas} = "
        f"{accumulation * replicas}: each execution runs whole pipeline steps.")


def _recomputation(config, index: int, num_stages: int) -> tuple:
  """``(recompute, recompute_tail)`` of stage ``index`` (stage_programs.stage_functions).

  Every stage but the last is recomputed whole under ``pipelining.recomputation``;
  the last one not (TF-IPU), or up to its last checkpoint (PopART) under
  ``last_stage_recomputation = "checkpoints"``.
  """
  options = config.pipelining
  if index < num_stages - 1:
    return bool(options.recomputation), True
  return bool(options.recomputation and options.last_stage_recomputation == "checkpoints"), False


def _state_hint(state_bytes: int) -> str:
  """What moves on-chip optimizer state off a tile (docs/streaming_memory.md)."""
  if not state_bytes:
    return ""
  return (f" The optimizer state on chip ({state_bytes:,d} B on this tile) can stay in "
          "streaming memory between updates (streaming.offload_optimizer_state = True) or be "
          "sharded over replicas (streaming.replicated_tensor_sharding = True with "
          "replication_factor > 1).")


def _lower_passes(stage, recompute: tuple, cfg, p_k, b_k, in_k) -> tuple:
  """The lowered ``(forward, backward)`` programs of ``stage`` under ``cfg``;
  ``recompute``: :func:`_recomputation`'s pair."""
  from ipu_jax.jit import jit
  forward, backward = stage_programs.stage_functions(stage, *recompute)
  fwd = jit(forward, config=cfg).lower(p_k, b_k, in_k)
  # Only shapes are lowered: the forward's outputs (its values, then its
  # residuals, all flat) as the traced program has them, not traced again.
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in fwd.jaxpr.out_avals]
  outs, vjp_zeros = avals[:len(stage.outputs)], avals[len(stage.outputs):]
  cts = [o for o in outs if stage_programs.differentiable(o)]
  acc = [jax.ShapeDtypeStruct(np.shape(p), p.dtype) for p in p_k]
  # The accumulators are updated in place (donated), as TF-IPU's are.
  bwd = jit(backward, config=cfg, donate_argnums=2).lower(vjp_zeros, cts, acc)
  return fwd, bwd


class Pipeline:
  """A loss function pipelined over IPUs, one or more stages per IPU.

  ::

    def loss_fn(params, batch):
      h = layer(params["l0"], batch["x"])
      h = ipu_jax.ops.pipeline_stage(h, 1)       # stage 1 starts here
      ...
      return loss

    pipe = ipu_jax.pipelining.Pipeline(loss_fn, optax.sgd(0.1), config=cfg)
    out = pipe.step(params, opt_state, batches)   # a StepResult
    params, opt_state = out.params, out.opt_state
    print(pipe.report.summary())

  ``batches`` holds ``G x R`` micro-batches stacked on a leading axis (G =
  ``training.gradient_accumulation_steps``, R = ``replication_factor``).

  Args:
    loss_fn: ``loss_fn(params, micro_batch) -> scalar``, with
      :func:`ipu_jax.ops.pipeline_stage` marks.
    optimizer: an optax ``GradientTransformation`` applied to the weights
      each stage owns, on its IPU (so optimizers that mix weights across
      stages, e.g. global-norm clipping, see each stage's own weights); None
      to only compute gradients. ``config.streaming`` offloads and shards its
      state (:mod:`~ipu_jax.pipelining.weight_update`).
    config: the :class:`ipu_jax.IPUConfig`: ``auto_select_ipus`` IPUs per
      pipeline, ``device``, ``pipelining``, ``training`` and
      ``replication_factor``; default: the active default config.
    device_mapping: the IPU of each stage (default stage k on IPU k); an
      IPU may hold several stages (not with the Interleaved schedule).
    stage_assignment: ``{module path: stage}`` for models without marks
      (see :func:`~ipu_jax.pipelining.split_stages`).
    rng: ``loss_fn(params, batch, rng)``: each micro-batch gets its own key
      from the step's ``rng=`` (:mod:`~ipu_jax.pipelining.micro_batches`).
    has_aux: the loss returns ``(loss, aux)``; steps return ``aux`` stacked
      per micro-batch (:attr:`StepResult.aux`).
    mutable: ``loss_fn(params, batch, [rng,] state)`` returns ``(loss,
      new_state)`` (``(loss, (new_state, aux))`` with ``has_aux``); each state
      leaf is held and updated on its stage; steps take ``state=`` and
      return the new state (:attr:`StepResult.state`).

  Raises:
    PipelineError: bad stage marks, more stages than IPUs without a device
      mapping, a device mapping out of range (or repeating an IPU with the
      Interleaved schedule), a weight read by stages on different IPUs, or
      a G the schedule cannot run (when lowered).
  """

  def __init__(self, loss_fn: Callable, optimizer=None, *, config=None,
               device_mapping: Optional[Sequence[int]] = None,
               stage_assignment: Optional[dict] = None, rng: bool = False,
               has_aux: bool = False, mutable: bool = False):
    _check_arguments(loss_fn, optimizer, config, stage_assignment)
    self.loss_fn = loss_fn
    self.inputs = MicroBatchInputs(bool(rng), bool(mutable), bool(has_aux))
    self.optimizer = optimizer
    self.config = (config if config is not None else config_lib.get_default_config()).copy()
    # Any iterable of IPUs (a list, a NumPy array); anything else is refused when lowered.
    self.device_mapping = (
        tuple(device_mapping) if hasattr(device_mapping, "__iter__")
        and not isinstance(device_mapping, (str, bytes)) else device_mapping)
    self.stage_assignment = None if stage_assignment is None else dict(stage_assignment)
    self._lowered_key = None
    # Programs shared with other pipelines' lowerings (a split search's); None: its own.
    self.shared_lowerings: Optional[shared_stages.SharedLowerings] = None
    self.staged = None
    self.stages: list = []
    self.timeline = None

  # -- settings -------------------------------------------------------------

  @property
  def schedule(self) -> str:
    return self.config.pipelining.schedule

  @property
  def accumulation(self) -> int:
    return self.config.training.gradient_accumulation_steps

  @property
  def replicas(self) -> int:
    return self.config.replication_factor

  def _check_settings(self, num_stages: int) -> list:
    mapping = layout.check_mapping(self.device_mapping, num_stages,
                                   self.config.auto_select_ipus, self.schedule)
    minimum = schedule_lib.minimum_accumulation(self.schedule, num_stages)
    g = self.accumulation
    if g < minimum or g % minimum:
      rule = {"Grouped": "2 x stages", "Interleaved": "the number of stages"}[self.schedule]
      raise PipelineError(
          f"training.gradient_accumulation_steps={g} does not suit the {self.schedule} "
          f"schedule over {num_stages} stages: it must be a multiple of {minimum} ({rule}) "
          f"and at least {minimum}.")
    return mapping

  def _check_system(self) -> None:
    # The replicas' IPUs must fit the system (each stage is lowered with one replica).
    if self.config.system is not None:
      from ipu_jax.kernels.systems import check_capacity, system_preset
      try:
        check_capacity(system_preset(self.config.system), self.replicas,
                       self.config.auto_select_ipus)
      except ValueError as e:
        raise PipelineError(str(e)) from None

  def _stage_config(self, ipu: int = 0):
    # The stage's IPU's per-IPU options (available memory proportions) as numbers.
    cfg = self.config.for_ipu(ipu)
    cfg.auto_select_ipus = 1
    cfg.replication_factor = 1
    cfg.memory.allow_out_of_memory = True  # checked per IPU, stash included
    return cfg

  # -- lowering ---------------------------------------------------------------

  def lower(self, params, batches, opt_state=None, *, rng=None, state=None) -> "Pipeline":
    """Split, lower and cost every stage for these shapes (cached).

    ``rng`` and ``state``: as :meth:`step` takes them.

    Raises:
      PipelineError: see the class.
      OutOfMemoryError: an IPU's largest program plus its stash exceeds a
        tile's memory; names the IPU, stage and tile.
    """
    micro = self._micro_batch(batches, rng, state)
    key = (jax.tree_util.tree_structure((params, micro)),
           tuple((np.shape(x), str(np.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype))
                 for x in jax.tree_util.tree_leaves((params, micro))))
    if key == self._lowered_key:
      return self
    self._check_system()
    staged = split_stages(self.inputs.wrap(self.loss_fn), params, micro, self.stage_assignment,
                          free=self.inputs.free(micro), has_aux=self.inputs.extended)
    self.inputs.check_owners(staged, micro)
    mapping = self._check_settings(staged.num_stages)
    layout.check_tied_weights(staged, mapping)
    flat_params = jax.tree_util.tree_leaves(params)
    flat_micro = jax.tree_util.tree_leaves(micro)
    # Shapes the throughput estimate reads (optimizer state, host input bytes).
    self.param_avals = [jax.ShapeDtypeStruct(np.shape(p), p.dtype) for p in flat_params]
    self.micro_batch_avals = jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(np.shape(m), m.dtype), micro)
    target = self._stage_config().to_target()
    values, stages, all_reads = {}, [], []
    # Stages alike share their forward and backward programs and their update program.
    lowerings = self.shared_lowerings or shared_stages.SharedLowerings()
    shared = (lowerings.stages, lowerings.updates)
    # One plan session for every stage: a stage's backward replans its
    # recomputed forward's equations, and stages not alike (other neighbours,
    # other proportions) still hold the same layers' layouts. Plan keys hold
    # every figure they depend on (layouts, shapes, target), not the program.
    with plan_cache.lowering_session():
      for stage in staged.stages:
        programs, reads = self._lower_stage(stage, staged, mapping, values,
                                            (flat_params, flat_micro), target, shared)
        stages.append(programs)
        all_reads.append(reads)
    for stage, reads in zip(staged.stages, all_reads):
      for source, nbytes in reads.items():
        stages[source].sends[stage.index] = stages[source].sends.get(stage.index, 0) + nbytes
    slots = schedule_lib.slots(self.schedule, staged.num_stages, self.accumulation)
    for stage, depth in zip(stages, schedule_lib.stash_depths(slots, staged.num_stages)):
      stage.stash_depth = depth
    self.staged, self.stages, self._slots = staged, stages, slots
    self.target = target
    self._check_memory()
    self.timeline = self._simulate()
    self._lowered_key = key
    from ipu_jax.pipelining.report import PipelineReport
    self.report = PipelineReport(self)
    return self

  def _micro_batch(self, batches, rng, state):
    """The shapes and dtypes of one micro-batch of ``batches`` (packed with ``rng`` /
    ``state`` as the loss takes them), after checking they stack G x R micro-batches."""
    expected = self.accumulation * self.replicas
    batches = self.inputs.pack(batches, rng, state, expected)
    _check_stacked(batches, expected, "gradient_accumulation_steps x replication_factor")
    leading = {np.shape(b)[0] for b in jax.tree_util.tree_leaves(batches)}
    if leading != {expected}:
      raise PipelineError(
          f"batches must stack gradient_accumulation_steps x replication_factor = "
          f"{self.accumulation} x {self.replicas} = {expected} micro-batches on their leading "
          f"axis; got leading sizes {sorted(leading)}.")
    return one_of_stacked(batches)

  def _lower_stage(self, stage, staged, mapping, values: dict, flat, target, shared=None):
    """Lowers one stage's forward, backward and update on its IPU's config.

    Args:
      stage: the stage (``staged.stages[k]``).
      staged: every stage, as :func:`split_stages` gives them.
      mapping: the IPU of each stage.
      values: the shape of every value earlier stages produced, by variable; this
        stage's outputs are added.
      flat: ``(flat params, flat micro-batch)``.
      target: the stages' target (one IPU's tiles).
      shared: ``(SharedStages, SharedUpdates)``, the programs of the stages
        lowered before (:mod:`~ipu_jax.pipelining.shared_stages`,
        :class:`~ipu_jax.pipelining.weight_update.SharedUpdates`): a stage
        alike reuses them; fresh ones when None.

    Returns:
      ``(StagePrograms, reads)``: ``reads`` the bytes this stage reads from
      each earlier stage (its sends are filled in by the caller).
    """
    flat_params, flat_micro = flat
    stages, updates = shared or (shared_stages.SharedStages(), weight_update.SharedUpdates())
    cfg = self._stage_config(mapping[stage.index])
    p_k = [flat_params[i] for i in stage.params]
    b_k = [flat_micro[i] for i in stage.batch]
    in_k = [values[v] for v in stage.inputs]
    # TF-IPU never recomputes the last stage; PopART between its checkpoints (stage_programs).
    recompute = _recomputation(self.config, stage.index, staged.num_stages)
    (fwd, bwd), shared_with = stages.programs(
        stage, recompute, cfg, lambda: _lower_passes(stage, recompute, cfg, p_k, b_k, in_k))
    outs = [jax.ShapeDtypeStruct(a.shape, a.dtype)
            for a in fwd.jaxpr.out_avals[:len(stage.outputs)]]
    values.update(zip(stage.outputs, outs))
    # The stage updates the weights it owns (tied ones once, by their first reader).
    o_k = [flat_params[i] for i in stage.owned]
    update = weight_update.lower_update(self, o_k, cfg, updates)
    # Residuals that are the stage's own weights stay where they are.
    invars = fwd.jaxpr.jaxpr.invars[:len(p_k)]
    stashed = [len(outs) + i for i, v in enumerate(fwd.jaxpr.jaxpr.outvars[len(outs):])
               if not any(v is w for w in invars)]
    returns, reads = {}, {}
    for v, value in zip(stage.inputs, in_k):
      source = staged.producer(v)
      reads[source] = reads.get(source, 0) + stage_programs.nbytes([value])
      if stage_programs.differentiable(value):
        returns[source] = returns.get(source, 0) + stage_programs.nbytes([value])
    programs = stage_programs.StagePrograms(
        index=stage.index, ipu=mapping[stage.index], forward=fwd, backward=bwd,
        update=update, stash_bytes=stage_programs.per_tile_bytes(fwd, stashed, target.num_tiles),
        returns=returns, weight_bytes=stage_programs.nbytes(o_k),
        held_bytes=layout.held_bytes(fwd, bwd, stage, target.num_tiles, update),
        state_bytes=layout.state_bytes(update, target.num_tiles),
        accumulator_bytes=layout.accumulator_bytes(bwd, stage, target.num_tiles),
        shared_with=shared_with)
    return programs, reads

  def _check_memory(self) -> None:
    """Each IPU's peak (its stages' largest program, what the others hold,
    the on-chip optimizer state, all their stashes) against a tile's memory."""
    if self.config.memory.allow_out_of_memory:
      return
    limit = self.target.bytes_per_tile
    t = self.target.tiles_per_ipu
    for ipu, memory in layout.ipu_memory(self.stages).items():
      peak = memory.peak
      over = np.nonzero(peak > limit)[0]
      if over.size:
        tile = int(over[np.argmax(peak[over])])
        stages = ", ".join(map(str, memory.stage_indices))
        raise OutOfMemoryError(
            f"Out of memory on IPU {ipu} (pipeline stage{'s' * (len(memory.stages) > 1)} "
            f"{stages}), tile {tile}: it needs {int(peak[tile]):,d} bytes but has {limit:,d} "
            f"({over.size} tile(s) over): {memory.describe_tile(tile)} ({self.schedule} "
            "schedule). What may help: "
            + ("fewer stages on this IPU, more IPUs, pipelining.recomputation=True, or more "
               "tiles." if len(memory.stages) > 1 else
               "more stages (IPUs), pipelining.recomputation=True, the Interleaved schedule, "
               "or more tiles.") + _state_hint(memory.state_at(tile))
            + self._last_stage_hint(memory.stage_indices),
            tile=ipu * t + tile, bytes_needed=int(peak[tile]),
            bytes_available=limit, over_tiles=over + ipu * t,
            report=memory.programs[memory.chosen[tile]][2].report)

  def _last_stage_hint(self, stage_indices) -> str:
    """A hint for an IPU holding the last stage while it is not recomputed."""
    options = self.config.pipelining
    if (len(self.stages) - 1 not in stage_indices
        or (options.recomputation and options.last_stage_recomputation == "checkpoints")):
      return ""
    return (" The last stage keeps its whole forward's activations for its backward: "
            "pipelining.last_stage_recomputation='checkpoints' (with recomputation=True) "
            "recomputes it between its recomputation_checkpoint marks, as PopART does.")

  def copies(self, stage: int, kind: str) -> list:
    """The ``(src_ipu, dst_ipu, nbytes)`` IPU-Link copies after a pass of ``stage``.

    ``kind`` 'forward': its outputs to the stages that read them; 'backward':
    its input gradients to the stages that made the inputs.

    Raises:
      PipelineError: before the pipeline is lowered, a stage it does not have,
        or a kind other than those two.
    """
    if not self.stages:
      raise PipelineError("Pipeline.copies: lower the pipeline first (lower, init or step).")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < len(self.stages):
      raise PipelineError(f"Pipeline.copies: stage must be 0..{len(self.stages) - 1}; got "
                          f"{stage!r}.")
    if kind not in ("forward", "backward"):
      raise PipelineError(f"Pipeline.copies: kind must be 'forward' or 'backward'; got {kind!r}.")
    programs = self.stages[stage]
    to = programs.sends if kind == "forward" else programs.returns
    return [(programs.ipu, self.stages[k].ipu, nbytes) for k, nbytes in to.items()]

  def copy_cycles(self, stage: int, kind: str) -> float:
    """Cycles of the copies after a pass of ``stage`` if no other pass sent
    anything (copies sharing a link share its rate; see ``links``)."""
    return links.slot_copy_cycles(self.target, self.copies(stage, kind))

  def _simulate(self):
    stages = self.stages
    ipus = [s.ipu for s in stages]
    num_ipus = self.config.auto_select_ipus
    target = self.target
    return schedule_lib.simulate(
        self._slots, ipus,
        forward=[s.forward.profile.total_cycles for s in stages],
        backward=[s.backward.profile.total_cycles for s in stages],
        copies_forward=[self.copies(k, "forward") for k in range(len(stages))],
        copies_backward=[self.copies(k, "backward") for k in range(len(stages))],
        sync=target.ipu_sync_cycles(num_ipus),
        weight_update=[s.update.profile.total_cycles if s.update else 0.0 for s in stages],
        all_reduce=[weight_update.gradient_reduction_cycles(self, s, num_ipus) for s in stages],
        copy_cost=functools.partial(links.slot_copy_cycles, target))

  # -- running ----------------------------------------------------------------

  def gradients(self, params, batches, *, rng=None, state=None):
    """Accumulated gradients (like ``params``) and the mean loss of a step.

    The micro-batches are reduced as ``training.gradient_accumulation_reduction``
    ('sum', or 'mean' / 'running_mean' as a mean) and the replicas as
    ``training.replica_reduction``. With ``mutable`` / ``has_aux`` the new
    state and the aux follow (as :meth:`step`).
    """
    self.lower(params, batches, rng=rng, state=state)
    flat_params = jax.tree_util.tree_leaves(params)
    batches, taps = self.inputs.start_step(self.staged, batches, rng, state, self.accumulation,
                                           self.replicas)
    grads, losses = self._run(flat_params, batches, taps)
    return (jax.tree_util.tree_unflatten(self.staged.param_tree, grads),
            jnp.mean(jnp.stack(losses))) + StepTaps.extras(taps)

  def init(self, params, batches, *, rng=None, state=None):
    """The optimizer state: one state per stage (of the weights it owns), on its IPU."""
    if self.optimizer is None:
      raise PipelineError("Pipeline.init needs an optimizer; this pipeline has none.")
    self.lower(params, batches, rng=rng, state=state)
    flat = jax.tree_util.tree_leaves(params)
    return weight_update.init_state(self, flat)

  def step(self, params, opt_state, batches, *, rng=None, state=None):
    """One training step: G x R micro-batches, then each stage's update.

    Args:
      params, opt_state, batches: the weights, :meth:`init`'s state and the
        ``G x R`` stacked micro-batches.
      rng: with ``rng=True``: the step's PRNG key (micro-batch m gets
        ``micro_batch_key(rng, m)``), or values stacked per micro-batch.
      state: with ``mutable=True``: the state at the start of the step.

    Returns:
      a :class:`StepResult`: the new params and optimizer state, the mean
      loss, the new state (``mutable``) and the aux stacked per micro-batch
      (``has_aux``).
    """
    if self.optimizer is None:
      raise PipelineError("Pipeline.step needs an optimizer; use gradients() without one.")
    self.lower(params, batches, rng=rng, state=state)
    _check_opt_state(opt_state, len(self.stages))
    flat = list(jax.tree_util.tree_leaves(params))
    batches, taps = self.inputs.start_step(self.staged, batches, rng, state, self.accumulation,
                                           self.replicas)
    grads, losses = self._run(flat, batches, taps)
    new_state = []
    for stage, programs, state in zip(self.staged.stages, self.stages, opt_state):
      p_k = [flat[i] for i in stage.owned]
      g_k = [grads[i] for i in stage.owned]
      p_k, state = programs.update(p_k, state, g_k)
      for i, value in zip(stage.owned, p_k):
        flat[i] = value
      new_state.append(state)
    state, aux = taps.results() if taps is not None else (None, None)
    return StepResult(jax.tree_util.tree_unflatten(self.staged.param_tree, flat), new_state,
                      jnp.mean(jnp.stack(losses)), state=state, aux=aux)

  def run(self, params, opt_state, batches, steps_per_execution: int):
    """Run ``steps_per_execution`` micro-batches (over all replicas) as whole steps.

    ``batches`` stacks the ``steps_per_execution`` micro-batches; each run of
    ``G x R`` is one :meth:`step` (each replica's G contiguous), as the
    Keras-on-IPU rule that ``steps_per_execution`` be a multiple of
    ``G x R`` asks.

    Returns:
      ``(params, opt_state, losses)``: ``losses`` has one mean per step.

    Raises:
      PipelineError: ``steps_per_execution`` is not a multiple of ``G x R``
        (checked before anything runs), or ``batches`` holds another count.
    """
    check_steps_per_execution(steps_per_execution, self.accumulation, self.replicas)
    if self.inputs.extended:
      raise PipelineError("Pipeline.run drives a loss of (params, batch) only; with rng, "
                          "has_aux or mutable call step() once per weight update.")
    per_step = self.accumulation * self.replicas
    _check_stacked(batches, steps_per_execution, "steps_per_execution")
    leading = {np.shape(b)[0] for b in jax.tree_util.tree_leaves(batches)}
    if leading != {steps_per_execution}:
      raise PipelineError(
          f"batches must stack steps_per_execution={steps_per_execution} micro-batches; got "
          f"leading sizes {sorted(leading)}.")
    losses = []
    for start in range(0, steps_per_execution, per_step):
      chunk = jax.tree_util.tree_map(lambda b: b[start:start + per_step], batches)
      out = self.step(params, opt_state, chunk)
      params, opt_state = out.params, out.opt_state
      losses.append(out.loss)
    return params, opt_state, jnp.stack(losses)

  def _run(self, flat_params, batches, taps=None):
    g, r = self.accumulation, self.replicas
    flat_batches = jax.tree_util.tree_leaves(batches)
    training = self.config.training
    total = [None] * len(flat_params)
    losses = []
    for replica in range(r):
      if taps is not None:
        taps.begin_replica(replica)
      acc, replica_losses = self._run_replica(
          flat_params, [b[replica * g:(replica + 1) * g] for b in flat_batches], taps)
      losses += replica_losses
      scale = 1.0 if training.gradient_accumulation_reduction == "sum" else 1.0 / g
      for i, a in acc.items():
        # On the host, in the weight's dtype (each op rounds as XLA's does):
        # eager jnp ops would compile a program per operation and weight shape.
        a = np.asarray(a)
        a = a * np.asarray(scale, a.dtype) if scale != 1.0 else a
        total[i] = a if total[i] is None else total[i] + a
    if r > 1 and training.replica_reduction == "mean":
      total = [t / np.asarray(r, t.dtype) for t in total]
    total = [jnp.zeros_like(p) if t is None else jax.device_put(t)
             for p, t in zip(flat_params, total)]
    return total, losses

  def _run_replica(self, flat_params, flat_batches, taps=None):
    staged, stages = self.staged, self.stages
    last = staged.num_stages - 1
    # One accumulator per weight: a tied weight's readers all add into it.
    # Zeros from the host (an eager jnp.zeros compiles a program per shape).
    acc = {i: jax.device_put(np.zeros(np.shape(flat_params[i]), flat_params[i].dtype))
           for s in staged.stages for i in s.params}
    values, stash, cts, losses = {}, {}, {}, {}
    for slot in self._slots:
      for p in slot:
        stage, programs, m = staged.stages[p.stage], stages[p.stage], p.micro_batch
        p_k = [flat_params[i] for i in stage.params]
        if p.kind == "forward":
          b_k = [flat_batches[i][m] for i in stage.batch]
          if taps is not None:  # a state leaf: the value its stage holds now
            b_k = taps.inputs(stage.batch, b_k)
          in_k = [values[(v, m)] for v in stage.inputs]
          outs, vjp = programs.forward(p_k, b_k, in_k)
          if taps is not None:
            taps.forward(p.stage, m, outs)
          for v, o in zip(stage.outputs, outs):
            values[(v, m)] = o
          stash[(p.stage, m)] = vjp
          if p.stage == last:
            losses[m] = outs[-1]
        else:
          out_cts = []
          for v in filter(stage_programs.differentiable, stage.outputs):
            if p.stage == last and v is staged.loss_var:
              out_cts.append(jnp.ones((), values[(v, m)].dtype))
            else:
              c = cts.pop((v, m), None)
              out_cts.append(jnp.zeros_like(values[(v, m)]) if c is None else c)
          new_acc, in_cts = programs.backward(stash.pop((p.stage, m)), out_cts,
                                              [acc[i] for i in stage.params])
          acc.update(zip(stage.params, new_acc))
          for v, c in zip(filter(stage_programs.differentiable, stage.inputs), in_cts):
            cts[(v, m)] = c if (v, m) not in cts else cts[(v, m)] + c
    return acc, [losses[m] for m in sorted(losses)]


def _check_arguments(loss_fn, optimizer, config, stage_assignment) -> None:
  """The constructor's arguments, checked when the pipeline is made (an optimizer
  of the wrong kind would otherwise fail after every stage was lowered)."""
  if not callable(loss_fn):
    raise PipelineError(f"Pipeline: loss_fn must be a function (params, batch) -> loss; got "
                        f"{type(loss_fn).__name__}.")
  if optimizer is not None:  # None: gradients only
    check_optimizer(optimizer, "Pipeline: ", PipelineError)
  if config is not None and not isinstance(config, config_lib.IPUConfig):
    raise PipelineError(f"Pipeline: config must be an ipu_jax.IPUConfig; got "
                        f"{type(config).__name__} (build one and set its fields, or "
                        f"IPUConfig.from_dict).")
  if stage_assignment is not None and not isinstance(stage_assignment, Mapping):
    raise PipelineError(f"Pipeline: stage_assignment must map module paths to stages, e.g. "
                        f"{{'layers_1': 1}}; got {type(stage_assignment).__name__}.")


def _check_stacked(batches, expected: int, what: str) -> None:
  """Every leaf of ``batches`` stacks micro-batches on a leading axis (a scalar or
  a Python number has none to read micro-batch ``m`` from)."""
  paths = jax.tree_util.tree_flatten_with_path(batches)[0]
  if not paths:
    raise PipelineError("Pipeline: batches hold no arrays; give the micro-batches stacked on "
                        "a leading axis.")
  for path, leaf in paths:
    if np.ndim(leaf) == 0:
      raise PipelineError(f"Pipeline: batches{jax.tree_util.keystr(path)} is a scalar; every "
                          f"leaf must stack {what} = {expected} micro-batches on its leading "
                          f"axis (broadcast a constant to shape [{expected}, ...]).")


def _check_opt_state(opt_state, num_stages: int) -> None:
  """``opt_state`` must be :meth:`Pipeline.init`'s: one optimizer state per stage
  (a shorter list would leave the last stages' weights as they are)."""
  if not isinstance(opt_state, (list, tuple)) or len(opt_state) != num_stages:
    got = (f"{len(opt_state)} entries" if isinstance(opt_state, (list, tuple))
           else type(opt_state).__name__)
    raise PipelineError(f"opt_state must be Pipeline.init's list of one optimizer state per "
                        f"stage ({num_stages}); got {got}.")
