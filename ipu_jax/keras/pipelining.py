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

What this ``fit`` supports (checked before anything runs): array data, the
``History`` it returns, ``batch_size``, ``epochs``, ``shuffle`` and
``verbose``; models without mutable state (batch statistics) or dropout
randomness, and optimizers that update each weight from its own gradient.
Validation data, callbacks and metrics are not run on a pipelined model.

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

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.keras import loss_scaling
from ipu_jax.keras import programs

__all__ = ["set_pipelining_options", "set_pipeline_stage_assignment", "merged_options",
           "merged_assignment", "fit"]

_SCHEDULES = ("Grouped", "Interleaved", "Sequential")
# The batch entry carrying the loss scale to the loss stage (one per micro-batch).
_LOSS_SCALE = "loss_scale"


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


def _pipeline(model):
  from ipu_jax.pipelining import Pipeline
  options = model.pipelining_options
  adapter = model.adapter
  if jax.tree_util.tree_leaves(model.state) or adapter.needs_rng:
    raise NotImplementedError(
        "A pipelined fit supports models without mutable state (batch statistics) or "
        "dropout randomness; this model has "
        + ("state" if jax.tree_util.tree_leaves(model.state) else "randomness") + ".")
  cfg = _pipeline_config(model, options)
  state, rng_state = model.state, model.train_state.rng_state
  loss_fn = model.loss

  def loss(params, batch):
    y_pred, _ = adapter.apply(params, state, rng_state, batch["x"], True, None)
    value = jnp.mean(programs.per_sample_loss(loss_fn, batch["y"], y_pred))
    if _LOSS_SCALE in batch:  # gradients of the scaled loss, as plain fit takes them
      value = value * batch[_LOSS_SCALE].astype(value.dtype)
    return value

  return Pipeline(loss, model.optimizer, config=cfg,
                  device_mapping=options.get("device_mapping"),
                  stage_assignment=options.get("assignment"))


@dataclasses.dataclass
class _Trainer:
  """The pipelined fit's state between updates: the pipeline, the data and sizes."""
  model: object
  pipe: object
  x: np.ndarray
  y: np.ndarray
  micro: int
  scaled: bool  # the optimizer is a LossScaleOptimizer
  opt_state: object = None

  @property
  def rows(self) -> int:
    """Micro-batches per weight update: G x R."""
    return self.pipe.accumulation * self.pipe.replicas

  def batches(self, idx) -> dict:
    """The micro-batches of one update: samples ``idx`` as ``[G R, b, ...]``."""
    g_r, micro, x, y = self.rows, self.micro, self.x, self.y
    batches = {"x": jnp.asarray(x[idx].reshape((g_r, micro) + x.shape[1:])),
               "y": jnp.asarray(y[idx].reshape((g_r, micro) + y.shape[1:]))}
    if self.scaled:  # a batch entry for the loss stage (there from the first lowering on)
      batches[_LOSS_SCALE] = jnp.ones((g_r,), jnp.float32)
    return batches

  def update(self, idx) -> float:
    """One weight update on samples ``idx``; returns its loss.

    The model's training state (weights, step) and number formats follow
    every update.
    """
    model = self.model
    params = model.params
    batches = self.batches(idx)
    if self.opt_state is None:
      self.opt_state = self.pipe.init(params, batches)
    if self.scaled:
      scale = loss_scaling.loss_scale_of(self.opt_state[0])
      batches[_LOSS_SCALE] = batches[_LOSS_SCALE] * scale
    new_params, new_state, loss = self.pipe.step(params, self.opt_state, batches)
    if self.scaled:
      new_params, new_state = _one_skip_decision(params, self.opt_state, new_params, new_state)
      loss = loss / scale
    self.opt_state = new_state
    model.train_state = model.train_state.replace(params=new_params, step=model.step + 1)
    logs = loss_scaling.scaling_logs(new_state[0]) if new_state else {}
    model.record_number_formats(logs, self.pipe.report.program_report)
    return float(loss)


def fit(model, x, y, *, batch_size=None, epochs: int = 1, verbose=0, shuffle: bool = True,
        callbacks=None, validation_data=None):
  """Train ``model`` pipelined; returns a :class:`~ipu_jax.keras.callbacks.History`.

  Each weight update takes ``G x R`` micro-batches of ``batch_size``; samples
  that do not fill a whole update are left out of the epoch. It uses only the
  ``Model``'s public surface (the training-loop interface in ``model.py``).
  """
  from ipu_jax.keras.callbacks import History
  from ipu_jax.keras.model import NOT_COMPILED
  if not model.compiled:
    raise RuntimeError(NOT_COMPILED)
  if callbacks or validation_data is not None or model.metrics:
    raise NotImplementedError("A pipelined fit runs no callbacks, validation data or "
                              "metrics; leave them out (the loss is reported per epoch).")
  pipe = _pipeline(model)
  micro = int(batch_size or 32)
  g, r = pipe.accumulation, pipe.replicas
  x, y = np.asarray(x), np.asarray(y)
  per_update = micro * g * r
  updates = len(x) // per_update
  if updates == 0:
    raise ValueError(f"A pipelined step needs batch_size x G x R = {micro} x {g} x {r} = "
                     f"{per_update} samples; got {len(x)}.")
  scaled = isinstance(jax.eval_shape(model.optimizer.init, model.params),
                      loss_scaling.LossScaleState)
  trainer = _Trainer(model, pipe, x, y, micro, scaled)
  history = History()
  history.history = {"loss": []}
  for epoch in range(epochs):
    order = (np.random.default_rng([model.seed, epoch]).permutation(len(x)) if shuffle
             else np.arange(len(x)))
    losses = []
    for u in range(updates):
      losses.append(trainer.update(order[u * per_update:(u + 1) * per_update]))
    history.history["loss"].append(float(np.mean(losses)))
    history.epoch.append(epoch)
    if verbose:
      print(f"Epoch {epoch + 1}/{epochs} - loss: {history.history['loss'][-1]:.4f}")
  model.pipeline = pipe
  model.reports["train"] = pipe.report.program_report
  return history


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
