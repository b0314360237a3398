"""Keras-like pipelining: ``Model.set_pipelining_options`` and stage assignment.

``model.set_pipeline_stage_assignment({"first": 0, "second": 1})`` places the
model's layers on pipeline stages by module path (the names reports use:
NNX attribute paths, linen module names), and
``model.set_pipelining_options(schedule="Grouped", ...)`` makes ``fit`` train
through an :class:`ipu_jax.pipelining.Pipeline`: each stage on its own IPU,
``G`` micro-batches per weight update, the numbers of plain accumulation.
``set_pipelining_options(device_mapping=[0, 1, 0])`` places stage k on IPU
``device_mapping[k]``; an IPU may take several stages (not with the
Interleaved schedule), and a weight read by stages on one IPU is tied
(updated once from the sum of their gradients); see
:mod:`ipu_jax.pipelining.layout`.

The pipelined ``fit`` trains what plain ``fit`` trains, and runs its loop
(:mod:`ipu_jax.keras.epoch_loop`; :class:`PipelinedTrainer` is what one
execution does): the same samples per execution (``steps_per_execution`` S, a multiple of
G x R as Keras on IPU asks; each execution is S / (G R) pipelined weight
updates), the same logs, callbacks and history. Checked against plain ``fit``
with G-step gradient accumulation in ``tests/test_pipelined_fit.py``:

* Dropout: each micro-batch gets plain ``fit``'s counters (the micro-batch
  step ``step x G + k`` and the replica) with the module's random streams and
  the dropout key; they are free values of the split
  (:mod:`ipu_jax.pipelining.micro_batches`), so each stage folds them into
  its own key and draws its own masks -- plain fit's masks, bit for bit, so
  the weights are plain fit's (measured on a 3-stage model: bit-equal after
  two epochs of Adam; batch statistics within 3e-8, as the stages' programs
  lay tensors out on other tiles and may reduce in another order).
* Batch statistics (any non-trainable module state): held on the stage whose
  layer reads and updates them; each forward pass there takes the value the
  previous micro-batch made, as plain fit's loop over micro-batches does.
  State read or updated on two stages is refused (``PipelineError`` naming
  it and the stages).
* Metrics and the loss: the last stage computes each micro-batch's
  ``[loss, metrics..., count]`` sums from its predictions (an auxiliary
  output of the pipelined loss); the host keeps plain fit's running means.
  The stage programs' reports cost them under plain fit's scopes (``loss``,
  ``loss/grad``, ``metrics``; :mod:`ipu_jax.keras.scopes`), and each stage's
  update under ``optimizer/<transform>``.
* ``validation_data``: plain ``evaluate`` on the trained weights after each
  epoch (``val_`` logs; the fit's callbacks see its test hooks). Evaluation
  is the inference function (dropout off, running statistics), not the
  training stages' forward-and-VJP programs, and its own program already
  spreads the model over the config's IPUs; so its numbers are
  ``evaluate``'s by construction. It is not pipelined (no schedule, no
  forward-only slots in the report).
* Callbacks (``History``, ``EarlyStopping``, ``ModelCheckpoint``,
  ``TerminateOnNaN``, ``LambdaCallback``, the progress bar) at plain fit's
  points: batch hooks once per execution, ``stop_training`` honoured after
  each; ``initial_epoch``, ``steps_per_epoch``, iterables of batches and
  ``validate_inputs`` as in plain ``fit``.

Refused before anything runs, naming the reason: ``compile(emulate=False)``
(the stages are tile programs on their own IPUs) and an S that is not a
multiple of G x R. The config's ``streaming`` options reach the pipeline:
each stage's optimizer state offloaded, and with R replicas sharded over
them (:mod:`ipu_jax.pipelining.weight_update`). The stages' optimizer
states are the model's ``TrainState.opt_state`` (``opt_layout``
``"stages"``), so ``ModelCheckpoint`` / ``save_weights(include_optimizer=True)``
save them (the shards, when sharded) and a loaded model's next pipelined
``fit`` restores them bit for bit once it has split the model. Lowering happens before the first callback, so
a model that cannot be split or does not fit raises first. Warned, not
mended: each stage's optimizer updates its own weights, so one that mixes
weights across stages (global-norm clipping) sees each stage's weights alone
(``Pipeline.init`` names the two weights: :mod:`ipu_jax.pipelining.cross_stage`).

Loss scaling (:class:`~ipu_jax.keras.LossScaleOptimizer`) works as in plain
``fit``: the loss stage multiplies the loss by the scale (it comes with each
micro-batch), each stage's optimizer unscales its own gradients, and one
decision holds for the whole model: when a stage's gradients overflow the
step is skipped on every stage (weights and optimizer state as before it,
the scale backed off everywhere). The scale, skipped steps and overflows go
into ``Model.number_formats`` after every weight update, and so into the
train report, as plain ``fit`` records them.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.keras import loss_scaling
from ipu_jax.keras import programs
from ipu_jax.keras import scopes
from ipu_jax.keras.train_state import STAGE_OPTIMIZERS
from ipu_jax.keras.weights import restore_flat

__all__ = ["set_pipelining_options", "set_pipeline_stage_assignment", "merged_options",
           "merged_assignment", "PipelinedTrainer", "trainer"]

_SCHEDULES = ("Grouped", "Interleaved", "Sequential")
# The batch entry carrying the loss scale to the loss stage (one per micro-batch).
_LOSS_SCALE = "loss_scale"


# The keywords of ``Model.set_pipelining_options`` (TF-IPU's names).
PIPELINING_OPTIONS = ("schedule", "gradient_accumulation_steps_per_replica", "recomputation",
                      "device_mapping")


def merged_options(current: Optional[dict], *, schedule: Optional[str] = None,
                   gradient_accumulation_steps_per_replica: Optional[int] = None,
                   recomputation: Optional[bool] = None, device_mapping=None) -> dict:
  """``current`` pipelining options with these set (those not ``None``).

  Raises:
    ValueError: an unknown schedule, a G below 1 or a device mapping that is
      not a sequence of IPU numbers (ints >= 0), naming the option. (Whether
      its IPUs exist and suit the schedule is checked when the pipeline is
      built, against the config's ``auto_select_ipus``.)
  """
  _check_device_mapping(device_mapping)
  if schedule is not None and schedule not in _SCHEDULES:
    raise ValueError(f"set_pipelining_options: schedule must be one of {_SCHEDULES}; got "
                     f"{schedule!r}.")
  g = gradient_accumulation_steps_per_replica
  if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
    raise ValueError("set_pipelining_options: gradient_accumulation_steps_per_replica must "
                     f"be an int >= 1; got {g!r}.")
  if recomputation is not None and not isinstance(recomputation, bool):  # "no": on
    raise ValueError(f"set_pipelining_options: recomputation must be True or False; got "
                     f"{recomputation!r}.")
  options = dict(current or {})
  options.update({k: v for k, v in dict(
      schedule=schedule, accumulation=g, recomputation=recomputation,
      device_mapping=None if device_mapping is None else tuple(device_mapping)).items()
      if v is not None})
  return options


def _check_device_mapping(device_mapping) -> None:
  if device_mapping is None:
    return
  if isinstance(device_mapping, (str, bytes)) or not hasattr(device_mapping, "__len__"):
    raise ValueError("set_pipelining_options: device_mapping must be a sequence with the IPU "
                     f"of each pipeline stage, e.g. [0, 1, 2, 3, 0]; got {device_mapping!r}.")
  for k, ipu in enumerate(device_mapping):
    if isinstance(ipu, bool) or not isinstance(ipu, (int, np.integer)) or ipu < 0:
      raise ValueError(f"set_pipelining_options: device_mapping[{k}]={ipu!r} is not an IPU "
                       "number (an int >= 0).")


def merged_assignment(current: Optional[dict], assignment) -> dict:
  """``current`` pipelining options with the stage assignment ``{module path: stage}``."""
  if not isinstance(assignment, dict) or not assignment:
    raise ValueError("set_pipeline_stage_assignment expects a non-empty dict of module path "
                     f"-> stage id, e.g. {{'layers_1': 1}}; got {assignment!r}.")
  options = dict(current or {})
  options["assignment"] = dict(assignment)
  return options


def set_pipelining_options(model, **options) -> None:
  """``model.set_pipelining_options(**options)`` (see the module docstring).

  Raises:
    ValueError: an unknown schedule, a G below 1 or a malformed device
      mapping, naming the option.
  """
  merged_options(None, **options)  # bad options raise before the model is touched
  model.set_pipelining_options(**options)


def set_pipeline_stage_assignment(model, assignment) -> None:
  """Place layers on stages: ``{module path: stage}``; pipelining turns on."""
  merged_assignment(None, assignment)
  model.set_pipeline_stage_assignment(assignment)


def _pipeline_config(model, options: dict):
  """The model's config with the pipelined fit's accumulation and schedule."""
  cfg = model.config.copy()
  cfg.training.gradient_accumulation_steps = options.get(
      "accumulation", model.gradient_accumulation_steps)
  cfg.training.gradient_accumulation_reduction = model.gradient_accumulation_reduction
  cfg.training.replica_reduction = model.replica_reduction
  if "schedule" in options:
    cfg.pipelining.schedule = options["schedule"]
  if "recomputation" in options:
    cfg.pipelining.recomputation = options["recomputation"]
  return cfg


def _check_supported(model) -> None:
  """Refuses, before anything runs, what the pipelined fit cannot train.

  Raises:
    RuntimeError: the model is not compiled.
    NotImplementedError: naming the setting and why.
  """
  from ipu_jax.keras.model import NOT_COMPILED
  if not model.compiled:
    raise RuntimeError(NOT_COMPILED)
  if not model.emulate:
    raise NotImplementedError(
        "A pipelined fit runs on the emulated IPUs only (compile(emulate=False) asks for "
        "plain JAX): each stage is a tile program on its own IPU. Drop "
        "set_pipelining_options to train with plain JAX.")


def _stacked(scalars):
  """A float32 vector of scalars: one micro-batch's ``[loss, metrics..., count]`` sums."""
  return jnp.stack([jnp.asarray(v, jnp.float32) for v in scalars])


def _pipelined_loss(model, *, rng: bool, mutable: bool):
  """The loss the pipeline splits: plain fit's objective of one micro-batch.

  ``loss(params, batch, [counters,] [state]) -> (loss, ([new_state,] sums))``:
  the module runs in training mode with plain fit's dropout counters
  (``counters``: the micro-batch step and the replica) and module state;
  the last stage computes the ``[loss, metrics..., count]`` sums from the
  predictions, as plain fit's step does.
  """
  adapter, loss_fn, metric_fns = model.adapter, model.loss, list(model.metrics)
  fixed_state, rng_state = model.train_state.state, model.train_state.rng_state

  def loss(params, batch, *extra):
    extra = list(extra)
    counters = extra.pop(0) if rng else None
    state = extra.pop(0) if mutable else fixed_state
    streams, key = rng_state, None
    if rng:  # the keys come with the counters: a typed key cannot be a program's constant
      streams, base = counters["keys"]
      key = (base, (counters["step"], counters["replica"]))
    y_pred, new_state = adapter.apply(params, state, streams, batch["x"], True, key)
    # Costed under plain fit's scopes (loss, its backward loss/grad, metrics).
    with scopes.scope(scopes.LOSS):
      per_sample = programs.per_sample_loss(loss_fn, batch["y"], y_pred)
      value = jnp.mean(per_sample)
      if _LOSS_SCALE in batch:  # gradients of the scaled loss, as plain fit takes them
        value = value * batch[_LOSS_SCALE].astype(value.dtype)
    with scopes.scope(scopes.METRICS):
      sums = _stacked([jnp.sum(per_sample)]
                      + [jnp.sum(m(batch["y"], y_pred)) for m in metric_fns]
                      + [per_sample.shape[0]])
    return value, ((new_state, sums) if mutable else sums)

  return loss


def _pipeline(model):
  from ipu_jax.pipelining import Pipeline
  options = model.pipelining_options
  rng = bool(model.adapter.needs_rng)
  mutable = bool(jax.tree_util.tree_leaves(model.train_state.state))
  return Pipeline(_pipelined_loss(model, rng=rng, mutable=mutable),
                  scopes.optimizer_in_scope(model.optimizer),
                  config=_pipeline_config(model, options),
                  device_mapping=options.get("device_mapping"),
                  stage_assignment=options.get("assignment"),
                  rng=rng, has_aux=True, mutable=mutable)


class PipelinedTrainer:
  """The pipelined ``fit``'s executions (:class:`~ipu_jax.keras.epoch_loop.Trainer`).

  Each execution is S / (G R) pipelined weight updates. The stages'
  optimizer states live in the model's
  :class:`~ipu_jax.keras.train_state.TrainState` (``opt_state``, laid out as
  ``STAGE_OPTIMIZERS``), so checkpoints save and restore them.

  Attributes:
    model: the :class:`~ipu_jax.keras.Model`.
    pipe: its :class:`~ipu_jax.pipelining.Pipeline`.
    scaled: the optimizer is a :class:`~ipu_jax.keras.LossScaleOptimizer`.
    micro: the micro-batch b (set by :meth:`prepare`).
  """

  def __init__(self, model, pipe, scaled: bool):
    self.model, self.pipe, self.scaled = model, pipe, scaled
    self.micro = 0

  @property
  def accumulation(self) -> int:
    """G, micro-batches per replica per weight update."""
    return self.pipe.accumulation

  @property
  def rows(self) -> int:
    """Micro-batches per weight update: G x R."""
    return self.pipe.accumulation * self.pipe.replicas

  def batches(self, x, y) -> dict:
    """One update's ``G R b`` samples (in order) as ``[G R, b, ...]`` micro-batches.

    Micro-batch ``r G + k`` is replica r's k-th, as plain fit's layout gives it.
    """
    def stack(a):
      a = np.asarray(a)
      return jnp.asarray(a.reshape((self.rows, self.micro) + a.shape[1:]))

    batches = {"x": jax.tree_util.tree_map(stack, x), "y": stack(y)}
    if self.scaled:  # a batch entry for the loss stage (there from the first lowering on)
      batches[_LOSS_SCALE] = jnp.ones((self.rows,), jnp.float32)
    return batches

  def counters(self) -> dict:
    """Plain fit's dropout counters of this update's micro-batches (step and
    replica) and the keys they fold into (the module's streams, the dropout key)."""
    g, ts = self.pipe.accumulation, self.model.train_state
    m = np.arange(self.rows)
    keys = jax.tree_util.tree_map(
        lambda a: jnp.broadcast_to(a[None], (self.rows,) + np.shape(a)),
        (ts.rng_state, ts.dropout_key))
    return {"step": jnp.asarray(self.model.step * g + m % g, jnp.int32),
            "replica": jnp.asarray(m // g, jnp.int32), "keys": keys}

  def extra_inputs(self) -> dict:
    """The step's ``rng`` (plain fit's dropout counters) and ``state`` (the module's)."""
    inputs = self.pipe.inputs
    return {"rng": self.counters() if inputs.rng else None,
            "state": self.model.train_state.state if inputs.mutable else None}

  def prepare(self, plan) -> None:
    """Split, lower and cost the stages on one update's samples, so a model
    that cannot be pipelined fails before any callback runs.

    The stages' optimizer states are the training state's when it holds
    states of this layout (a second ``fit`` goes on as plain ``fit`` does),
    or a loaded checkpoint's (``save_weights(include_optimizer=True)``),
    else new.
    """
    self.micro = plan.batch_size
    x, y = plan.source.example
    per_update = self.rows * self.micro
    batches = self.batches(jax.tree_util.tree_map(lambda a: a[:per_update], x), y[:per_update])
    fresh = self.pipe.init(self.model.params, batches, **self.extra_inputs())
    ts = self.model.train_state
    saved = self.model.pop_saved_stage_optimizers()
    kept = (restore_flat(fresh, saved, "pipeline_opt_state") if saved is not None
            else ts.opt_state if ts.opt_layout == STAGE_OPTIMIZERS else None)
    same = kept is not None and (jax.tree_util.tree_structure(kept)
                                 == jax.tree_util.tree_structure(fresh)) and all(
        np.shape(a) == np.shape(b) for a, b in zip(jax.tree_util.tree_leaves(kept),
                                                    jax.tree_util.tree_leaves(fresh)))
    self.model.train_state = ts.replace(opt_state=kept if same else fresh,
                                        opt_layout=STAGE_OPTIMIZERS)

  def update(self, x, y) -> np.ndarray:
    """One weight update on ``G R b`` samples; returns their ``[loss, metrics..., count]`` sums.

    The model's training state (weights, the stages' optimizer states,
    module state, step) follows every update.
    """
    model, pipe = self.model, self.pipe
    ts = model.train_state
    batches = self.batches(x, y)
    if self.scaled:
      scale = loss_scaling.loss_scale_of(ts.opt_state[0])
      batches[_LOSS_SCALE] = batches[_LOSS_SCALE] * scale
    out = pipe.step(ts.params, ts.opt_state, batches, **self.extra_inputs())
    new_params, new_opt = out.params, out.opt_state
    if self.scaled:  # a skipped step keeps the weights; the module state moves on, as in plain fit
      new_params, new_opt = _one_skip_decision(ts.params, ts.opt_state, new_params, new_opt)
    model.train_state = ts.replace(
        params=new_params, opt_state=new_opt, step=model.step + 1,
        state=out.state if pipe.inputs.mutable else ts.state)
    return np.asarray(jnp.sum(out.aux, axis=0), np.float64)

  def execution(self, plan, xb, yb, running) -> dict:
    """One execution's S / (G R) weight updates on its samples; returns its logs."""
    model = self.model
    per_update = self.rows * self.micro
    updates = plan.steps_per_execution // self.rows
    start = time.perf_counter()
    for u in range(updates):
      part = slice(u * per_update, (u + 1) * per_update)
      running.add(self.update(jax.tree_util.tree_map(lambda a: a[part], xb), yb[part]))
    logs = running.logs()
    report = self.pipe.report.program_report
    logs["host_round_trips"] = 1
    logs["emulated_seconds"] = updates * report.estimated_seconds
    logs.update(loss_scaling.scaling_logs(model.train_state.opt_state[0]))
    model.record_number_formats(logs, report)
    logs["samples"] = updates * per_update
    logs["host_seconds"] = time.perf_counter() - start
    model.pipeline, model.reports["train"] = self.pipe, report
    return logs

  def end_epoch(self) -> None:
    """Nothing: every update already wrote the model's variables into the module."""


def trainer(model) -> PipelinedTrainer:
  """The pipelined ``fit``'s trainer of ``model`` (its pipeline built, not yet lowered).

  Raises:
    RuntimeError: the model is not compiled.
    NotImplementedError: ``compile(emulate=False)``.
  """
  _check_supported(model)
  scaled = isinstance(jax.eval_shape(model.optimizer.init, model.params),
                      loss_scaling.LossScaleState)
  return PipelinedTrainer(model, _pipeline(model), scaled)


def _one_skip_decision(params, opt_state, new_params, new_state):
  """Skips the step on every stage when any stage's loss-scale optimizer did.

  Each stage's :class:`~ipu_jax.keras.LossScaleOptimizer` sees only its own
  gradients; the model's step is one decision (Keras semantics), so a skip
  anywhere restores every stage's weights and inner state and gives all of
  them the skipping stage's scale and counts.
  """
  skipped = [int(new.skipped_steps) > int(old.skipped_steps)
             for old, new in zip(opt_state, new_state)]
  if not any(skipped) or all(skipped):
    return new_params, new_state
  skipping = new_state[skipped.index(True)]
  restored = [old._replace(loss_scale=skipping.loss_scale, good_steps=skipping.good_steps,
                           skipped_steps=skipping.skipped_steps, overflows=skipping.overflows)
              for old in opt_state]
  return params, restored
