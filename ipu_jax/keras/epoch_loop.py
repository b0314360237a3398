"""The one host loop of ``fit``, ``evaluate`` and ``predict``, plain or pipelined.

``Model.fit`` runs :func:`fit` with a :class:`Trainer`, what one device
execution does: :class:`~ipu_jax.keras.plain_trainer.PlainTrainer` runs the
training program once (S micro-batch steps on the replicas);
``PipelinedTrainer`` (:mod:`ipu_jax.keras.pipelining`) runs the execution's
S / (G R) pipelined weight updates. Everything else is this loop's, so both
have the same points (docs/training.md#what-one-call-of-the-device-does):

* before anything runs: the sizes (:class:`~ipu_jax.keras.loop.FitPlan`), the
  labels against the loss and the model's output, and the trainer's
  ``prepare`` (lowered and compiled, so a program that cannot be lowered or
  does not fit fails before the first callback);
* ``on_train_begin``; per epoch ``on_epoch_begin``, then per execution
  ``on_train_batch_begin`` / ``on_train_batch_end`` (the step counter at the
  execution's first and last step; ``stop_training`` honoured after each);
  then ``validation_data`` through :func:`evaluate` (its test hooks on the
  fit's callbacks, ``val_`` logs), the module synced, ``on_epoch_end``;
  finally ``on_train_end``;
* the progress bar (``verbose``) and ``History`` after the user's callbacks;
  ``Model.executions`` counts executions.

:func:`evaluate` and :func:`predict` run the model's eval and predict programs
(:class:`~ipu_jax.keras.plain_trainer.Programs`) for plain and pipelined
models alike; each execution's outputs come back as ``outputs.mode`` says
(docs/host_side.md#output-modes).
"""

from __future__ import annotations

import numbers
import weakref
from typing import Optional, Protocol

import jax
import numpy as np

from ipu_jax.arguments import check_count
from ipu_jax.keras import callbacks as callbacks_lib
from ipu_jax.keras import loop
from ipu_jax.keras.data import ArrayData, as_arrays, is_array_like
from ipu_jax.keras.progress import ProgbarLogger
from ipu_jax.keras.validation import check_labels
from ipu_jax.lowering.host_io import select_outputs

__all__ = ["Trainer", "fit", "evaluate", "predict", "validate_labels"]


class Trainer(Protocol):
  """What one device execution of ``fit`` does (plain or pipelined).

  Attributes:
    accumulation: G, micro-batches per replica per weight update.
  """

  accumulation: int

  def prepare(self, plan: loop.FitPlan) -> None:
    """Lowers (and compiles) on the plan's example execution, before any callback."""

  def execution(self, plan: loop.FitPlan, xb, yb, running: loop.RunningSums) -> dict:
    """Trains on one execution's ``S b`` samples; adds their sums to ``running``
    and returns the execution's logs."""

  def end_epoch(self) -> None:
    """After an epoch's executions, before validation: the module in sync."""


def validate_labels(model, x, y) -> None:
  """Checks labels ``y`` against the loss and the model's output for ``x`` (nothing runs)."""
  leaves = jax.tree.leaves(_output_shapes(model, x))
  if len(leaves) == 1:
    check_labels(model.loss, y, leaves[0].shape)


# adapter (one per Model) -> {the arguments' shapes and dtypes: the output's}.
# The model is traced once per input signature, not at every call of fit (a
# third of a one-epoch fit's time on the digits MLP); the key holds the
# weights' shapes, so a model whose variables change shape is traced again.
_OUTPUT_SHAPES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _output_shapes(model, x):
  """The model's output shapes for one sample of ``x`` (``jax.eval_shape``, memoised)."""
  sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
  adapter, ts = model.adapter, model.train_state
  args = (ts.params, ts.state, ts.rng_state, sample)
  leaves, tree = jax.tree.flatten(args)
  key = (tree, tuple(jax.typeof(a) for a in leaves))
  known = _OUTPUT_SHAPES.setdefault(adapter, {})
  if key not in known:
    known[key] = jax.eval_shape(
        lambda p, s, r, xb: adapter.apply(p, s, r, xb, False, None)[0], *args)
  return known[key]


def _plan(model, trainer: Trainer, x, y, *, batch_size, epochs, verbose, initial_epoch,
          steps_per_epoch, shuffle, validation_data, validation_batch_size,
          validate_inputs) -> loop.FitPlan:
  """Checks ``fit``'s sizes and options (before anything runs) into a plan."""
  G, R, S = trainer.accumulation, model.num_replicas, model.steps_per_execution
  loop.check_steps_per_execution(S, G, R)
  for name, value in (("epochs", epochs), ("initial_epoch", initial_epoch)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise ValueError(f"{name} must be an int; got {value!r}.")
  if initial_epoch < 0 or epochs < initial_epoch:
    raise ValueError(f"need 0 <= initial_epoch <= epochs; got initial_epoch="
                     f"{initial_epoch}, epochs={epochs}.")
  source = loop.train_source(as_arrays(x), as_arrays(y), batch_size, steps_per_epoch, S,
                             model.seed)
  check_count("validation_batch_size", validation_batch_size, none="fit's batch_size")
  if validation_data is not None:
    batch = source.batch_size if validation_batch_size is None else validation_batch_size
    validation_data = _validation_arrays(model, source, validation_data, batch, validate_inputs)
  return loop.FitPlan(G, R, S, source, model.replication, verbose, shuffle=shuffle,
                      validation_data=validation_data,
                      validation_batch_size=validation_batch_size,
                      validate_inputs=validate_inputs)


def _validation_arrays(model, source: loop.TrainSource, validation_data, batch_size: int,
                       validate_inputs: bool) -> tuple:
  """``validation_data`` as ``(x, y)`` arrays, checked before the first step.

  It is evaluated after each epoch: a mistake in it (no labels, x and y of
  different lengths, samples of another shape than the training data's) would
  otherwise surface only after an epoch had changed the weights. An iterable
  is read once here, so every epoch validates on the same samples.
  """
  vx, vy = validation_data, None
  if isinstance(validation_data, tuple) and len(validation_data) == 2 and (
      is_array_like(validation_data[0])):  # as evaluate reads an (x, y) pair
    vx, vy = validation_data
  elif isinstance(validation_data, tuple) and hasattr(validation_data[0], "shape"):
    raise ValueError(f"validation_data must be (x_val, y_val) or an iterable of (x, y) "
                     f"batches; got a tuple of {len(validation_data)} arrays.")
  data = loop.eval_data(as_arrays(vx), as_arrays(vy), batch_size, None)
  if data.y is None:
    raise ValueError("validation_data needs labels: give (x_val, y_val).")
  train = jax.tree.map(lambda a: np.shape(a)[1:], source.example[0])
  val = jax.tree.map(lambda a: np.shape(a)[1:], data.x)
  if jax.tree.structure(train) != jax.tree.structure(val) or train != val:
    raise ValueError(f"validation_data's x has samples of shape {val}; the training data's "
                     f"are {train}.")
  if validate_inputs:
    validate_labels(model, data.x, data.y)
  return data.x, data.y


def _fit_callbacks(model, plan: loop.FitPlan, callbacks, epochs: int,
                   history) -> callbacks_lib.CallbackList:
  """The user's callbacks, then the progress bar (if verbose) and ``history``."""
  if isinstance(callbacks, callbacks_lib.Callback):
    raise ValueError(f"callbacks must be a list of callbacks; got one "
                     f"{type(callbacks).__name__} (pass [callback]).")
  cbs = list(callbacks or [])
  if plan.verbose:
    cbs.append(ProgbarLogger(verbose=plan.verbose))
  cbs.append(history)
  return callbacks_lib.CallbackList(cbs, model=model, params=plan.callback_params(epochs))


def fit(model, trainer: Trainer, programs, x, y, *, epochs: int, callbacks,
        initial_epoch: int, verbose: int, **options) -> callbacks_lib.History:
  """Trains ``model`` with ``trainer``'s executions; returns the ``History``.

  Args:
    model: the compiled :class:`~ipu_jax.keras.Model`.
    trainer: what one execution does.
    programs: the model's :class:`~ipu_jax.keras.plain_trainer.Programs`
      (validation evaluates with them).
    x, y, epochs, callbacks, initial_epoch: as ``Model.fit``.
    verbose: 0, 1 or 2 (``"auto"`` resolved).
    **options: ``batch_size``, ``shuffle``, ``steps_per_epoch``,
      ``validation_data``, ``validation_batch_size``, ``validate_inputs``.
  """
  programs.verbose = None if verbose else 0  # verbose=0 silences compile progress
  plan = _plan(model, trainer, x, y, epochs=epochs, verbose=verbose,
               initial_epoch=initial_epoch, **options)
  if plan.validate_inputs:
    validate_labels(model, plan.source.example[0], plan.source.labels)
  history = callbacks_lib.History()
  cb = _fit_callbacks(model, plan, callbacks, epochs, history)
  model.stop_training = False
  model.history = history
  trainer.prepare(plan)
  cb.on_train_begin()
  logs: dict = {}
  for epoch in range(initial_epoch, epochs):
    logs = _fit_epoch(model, trainer, programs, plan, cb, epoch)
    if model.stop_training:
      break
  trainer.end_epoch()
  cb.on_train_end(logs)
  return history


def _fit_epoch(model, trainer: Trainer, programs, plan: loop.FitPlan, cb, epoch: int) -> dict:
  """One epoch of ``fit`` (and its validation); returns the epoch's logs."""
  S = plan.steps_per_execution
  cb.on_epoch_begin(epoch)
  running = loop.RunningSums([m.name for m in model.metrics])
  for index, (xb, yb) in enumerate(plan.source.batches(epoch, plan.shuffle)):
    cb.on_train_batch_begin(index * S)
    logs = trainer.execution(plan, xb, yb, running)
    model.executions += 1
    cb.on_train_batch_end((index + 1) * S - 1, logs)
    if model.stop_training:
      break
  trainer.end_epoch()
  epoch_logs = running.logs()
  if plan.validation_data is not None and not model.stop_training:
    val = evaluate(model, programs, plan.validation_data, None,
                   plan.validation_batch_size or plan.batch_size, cb, verbose=0,
                   validate_inputs=plan.validate_inputs)
    epoch_logs.update({"val_" + k: v for k, v in val.items()})
  cb.on_epoch_end(epoch, epoch_logs)
  return epoch_logs


def evaluate(model, programs, x, y, batch_size: Optional[int], cb, verbose: int,
             steps: Optional[int] = None, validate_inputs: bool = True) -> dict:
  """Loss and metrics over ``(x, y)``; the last execution padded with masked samples."""
  if isinstance(x, tuple) and y is None and len(x) == 2 and is_array_like(x[0]):
    x, y = x
  data = loop.eval_data(as_arrays(x), as_arrays(y), batch_size, steps)
  if data.y is None:
    raise ValueError("evaluate needs labels y.")
  if validate_inputs:
    validate_labels(model, data.x, data.y)
  S, rep = model.steps_per_execution, model.replication
  programs.place()
  running = loop.RunningSums([m.name for m in model.metrics])
  cb.on_test_begin()
  executions = 0
  for e, (xs, ys, ms) in enumerate(loop.padded_batches(data, S, rep)):
    cb.on_test_batch_begin(e * S)
    program = programs.eval(xs, ys, ms)
    _, sums = program(model.placed_train_state, rep.feed(xs), rep.feed(ys), rep.feed(ms))
    running.add(programs.host_sums(program, rep.fetch(sums)))
    programs.record_report("eval", program.lowered, data.batch_size)
    cb.on_test_batch_end((e + 1) * S - 1, running.logs())
    executions += 1
  logs = running.logs()
  cb.on_test_end(logs)
  if verbose:
    print(f"{executions} executions - " + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()))
  return logs


def predict(model, programs, x, batch_size: Optional[int], verbose: int, cb,
            steps: Optional[int] = None):
  """The model's outputs for every sample of ``x``, as NumPy."""
  check_count("steps", steps, none="all the data")
  if x is None:
    raise ValueError("predict needs x: an array (or pytree of arrays), or an iterable of "
                     "batches.")
  x = as_arrays(x)
  if not is_array_like(x):
    x = loop.eval_data(x, None, batch_size, steps).x
  data = ArrayData(x, None, 32 if batch_size is None else batch_size)
  rep = model.replication
  programs.place()
  cb.on_predict_begin()
  outputs = []
  # outputs.mode: which steps' outputs come back (docs/host_side.md#output-modes).
  mode, period = model.config.outputs.mode, model.config.outputs.return_period
  for xs, _, _ in loop.padded_batches(data, model.steps_per_execution, rep):
    program = programs.predict(xs)
    _, ys = program(model.placed_train_state, rep.feed(xs))
    if program.lowered is None and mode != "all":  # plain JAX: select as the device does
      ys = jax.tree.map(lambda a: select_outputs(np.asarray(a), mode, period, 1, np), ys)
    programs.record_report("predict", program.lowered, data.batch_size)
    outputs.append(loop.gather_selected_predictions(ys, rep, mode))
  cb.on_predict_end()
  # Padding samples are dropped only when every step's outputs return.
  keep = data.n if mode == "all" else None
  result = jax.tree.map(lambda *a: np.concatenate(a)[:keep], *outputs)
  if verbose:
    print(f"{len(outputs)} executions, {data.n} samples")
  return result
