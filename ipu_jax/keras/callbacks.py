"""Callbacks for :meth:`ipu_jax.keras.Model.fit`, in the manner of Keras.

On the IPU the host sees the device once per execution (``steps_per_execution``
steps run on the device without it), so the batch hooks fire **once per
execution**, with the step counter at the last step of the execution and the
logs of that execution. Hooks::

    on_train_begin(logs)            on_train_end(logs)
    on_epoch_begin(epoch, logs)     on_epoch_end(epoch, logs)
    on_train_batch_begin(step, logs) on_train_batch_end(step, logs)
    on_test_begin / on_test_end / on_test_batch_begin / on_test_batch_end
    on_predict_begin / on_predict_end

Callbacks reach the model as ``self.model``; setting
``self.model.stop_training = True`` ends ``fit`` after the current execution.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable, Iterable, Optional

import numpy as np

__all__ = [
    "Callback", "CallbackList", "History", "ModelCheckpoint", "LambdaCallback",
    "EarlyStopping", "TerminateOnNaN", "latest_checkpoint",
]


class Callback:
  """Base class of callbacks; override the hooks you need."""

  def __init__(self):
    self.model = None
    self.params: dict = {}

  def set_model(self, model):
    self.model = model

  def set_params(self, params: dict):
    self.params = dict(params)

  def on_train_begin(self, logs=None): ...
  def on_train_end(self, logs=None): ...
  def on_epoch_begin(self, epoch, logs=None): ...
  def on_epoch_end(self, epoch, logs=None): ...
  def on_train_batch_begin(self, batch, logs=None): ...
  def on_train_batch_end(self, batch, logs=None): ...
  def on_test_begin(self, logs=None): ...
  def on_test_end(self, logs=None): ...
  def on_test_batch_begin(self, batch, logs=None): ...
  def on_test_batch_end(self, batch, logs=None): ...
  def on_predict_begin(self, logs=None): ...
  def on_predict_end(self, logs=None): ...


class CallbackList(Callback):
  """Calls every hook on each of a list of callbacks, in order."""

  def __init__(self, callbacks: Iterable[Callback] = (), model=None, params=None):
    super().__init__()
    self.callbacks = list(callbacks or [])
    for cb in self.callbacks:
      if not isinstance(cb, Callback):
        raise TypeError(f"callbacks must be ipu_jax.keras.callbacks.Callback "
                        f"instances; got {cb!r}.")
    if model is not None:
      self.set_model(model)
    if params is not None:
      self.set_params(params)

  def append(self, callback: Callback):
    self.callbacks.append(callback)
    if self.model is not None:
      callback.set_model(self.model)
    if self.params:
      callback.set_params(self.params)

  def set_model(self, model):
    super().set_model(model)
    for cb in self.callbacks:
      cb.set_model(model)

  def set_params(self, params):
    super().set_params(params)
    for cb in self.callbacks:
      cb.set_params(params)

  def _call(self, hook: str, *args):
    for cb in self.callbacks:
      getattr(cb, hook)(*args)

  def on_train_begin(self, logs=None): self._call("on_train_begin", logs)
  def on_train_end(self, logs=None): self._call("on_train_end", logs)
  def on_epoch_begin(self, epoch, logs=None): self._call("on_epoch_begin", epoch, logs)
  def on_epoch_end(self, epoch, logs=None): self._call("on_epoch_end", epoch, logs)
  def on_train_batch_begin(self, batch, logs=None): self._call("on_train_batch_begin", batch, logs)
  def on_train_batch_end(self, batch, logs=None): self._call("on_train_batch_end", batch, logs)
  def on_test_begin(self, logs=None): self._call("on_test_begin", logs)
  def on_test_end(self, logs=None): self._call("on_test_end", logs)
  def on_test_batch_begin(self, batch, logs=None): self._call("on_test_batch_begin", batch, logs)
  def on_test_batch_end(self, batch, logs=None): self._call("on_test_batch_end", batch, logs)
  def on_predict_begin(self, logs=None): self._call("on_predict_begin", logs)
  def on_predict_end(self, logs=None): self._call("on_predict_end", logs)


class History(Callback):
  """What ``fit`` returns: per-epoch logs and how the device was driven.

  Attributes:
    history: metric name -> list of per-epoch values (``loss``,
      ``accuracy``, ``val_loss``, ...).
    epoch: the epoch indices run.
    executions: executions of the tile program (each one host round trip)
      run by this ``fit``, all epochs together.
    executions_per_epoch: executions in each epoch.
    host_round_trips: host round trips, ``executions`` x the report's
      ``host_round_trips`` (one per execution).
    steps: micro-batch steps run (``executions`` x ``steps_per_execution``).
    params: fit's settings (epochs, steps, steps_per_execution, ...).
  """

  def __init__(self):
    super().__init__()
    self.history: dict = {}
    self.epoch: list = []
    self.executions = 0
    self.executions_per_epoch: list = []
    self.host_round_trips = 0
    self.steps = 0
    self._epoch_executions = 0

  def on_train_begin(self, logs=None):
    self.epoch = []
    self.history = {}

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch_executions = 0

  def on_train_batch_end(self, batch, logs=None):
    self._epoch_executions += 1
    self.executions += 1
    self.host_round_trips += int((logs or {}).get("host_round_trips", 1))
    self.steps += int(self.params.get("steps_per_execution", 1))

  def on_epoch_end(self, epoch, logs=None):
    self.epoch.append(epoch)
    self.executions_per_epoch.append(self._epoch_executions)
    for key, value in (logs or {}).items():
      self.history.setdefault(key, []).append(value)

  def __repr__(self):
    return (f"History(epochs={len(self.epoch)}, executions={self.executions}, "
            f"keys={sorted(self.history)})")


class LambdaCallback(Callback):
  """A callback from plain functions, e.g. ``LambdaCallback(on_epoch_end=f)``."""

  _HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
            "on_train_batch_begin", "on_train_batch_end", "on_test_begin",
            "on_test_end", "on_test_batch_begin", "on_test_batch_end",
            "on_predict_begin", "on_predict_end")

  def __init__(self, **hooks: Callable):
    super().__init__()
    for name, fn in hooks.items():
      if name not in self._HOOKS:
        raise TypeError(f"LambdaCallback has no hook {name!r}; hooks: "
                        f"{', '.join(self._HOOKS)}.")
      setattr(self, name, fn)


class TerminateOnNaN(Callback):
  """Stops training when the loss becomes NaN or infinite."""

  def on_train_batch_end(self, batch, logs=None):
    loss = (logs or {}).get("loss")
    if loss is not None and not np.isfinite(loss):
      print(f"Execution ending at step {batch}: invalid loss, terminating training")
      self.model.stop_training = True


class EarlyStopping(Callback):
  """Stops when ``monitor`` has not improved for ``patience`` epochs."""

  def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0,
               patience: int = 0, mode: str = "auto", verbose: int = 0):
    super().__init__()
    self.monitor, self.min_delta, self.patience = monitor, abs(min_delta), patience
    if mode not in ("auto", "min", "max"):
      raise ValueError(f"EarlyStopping mode must be 'auto', 'min' or 'max'; got {mode!r}.")
    if mode == "auto":
      mode = "max" if ("acc" in monitor or "accuracy" in monitor) else "min"
    self.mode, self.verbose = mode, verbose
    self.best, self.wait, self.stopped_epoch = None, 0, None

  def on_train_begin(self, logs=None):
    self.best, self.wait, self.stopped_epoch = None, 0, None

  def on_epoch_end(self, epoch, logs=None):
    value = (logs or {}).get(self.monitor)
    if value is None:
      return
    better = (self.best is None or
              (value < self.best - self.min_delta if self.mode == "min"
               else value > self.best + self.min_delta))
    if better:
      self.best, self.wait = value, 0
      return
    self.wait += 1
    if self.wait > self.patience:
      self.stopped_epoch = epoch
      self.model.stop_training = True
      if self.verbose:
        print(f"Epoch {epoch + 1}: early stopping")


class ModelCheckpoint(Callback):
  """Saves the model during ``fit``, atomically, with the epoch number.

  Each save writes a temporary file in the target directory and renames it
  over the target (``os.replace``), so a run killed at any moment leaves
  either the previous checkpoint or the new one, never a torn file. By
  default the optimizer state, step counter and epoch go in too, so::

      model.load_weights(path)                    # restores all of it
      model.fit(x, y, epochs=10, initial_epoch=model.checkpoint_epoch)

  resumes exactly where the checkpoint was taken.

  Args:
    filepath: where to write; may use ``{epoch}`` (1-based, as in Keras)
      and any key of the logs, e.g. ``"ckpt/weights-{epoch:03d}.msgpack"``.
    save_weights_only: only weights and model state, no optimizer state.
    save_freq: ``"epoch"``, or an int: every that many executions.
    monitor, save_best_only, mode: save only when ``monitor`` improves.
    verbose: print a line for each save.
  """

  def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0,
               save_best_only: bool = False, save_weights_only: bool = False,
               mode: str = "auto", save_freq="epoch"):
    super().__init__()
    self.filepath = os.fspath(filepath)
    self.monitor, self.verbose = monitor, verbose
    self.save_best_only, self.save_weights_only = save_best_only, save_weights_only
    if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
      raise ValueError(f"save_freq must be 'epoch' or a positive int; got {save_freq!r}.")
    self.save_freq = save_freq
    if mode not in ("auto", "min", "max"):
      raise ValueError(f"ModelCheckpoint mode must be 'auto', 'min' or 'max'; got {mode!r}.")
    if mode == "auto":
      mode = "max" if ("acc" in monitor or "accuracy" in monitor) else "min"
    self.mode = mode
    self.best = None
    self.last_saved: Optional[str] = None
    self._epoch = 0
    self._executions = 0

  def on_epoch_begin(self, epoch, logs=None):
    self._epoch = epoch

  def on_train_batch_end(self, batch, logs=None):
    self._executions += 1
    if self.save_freq != "epoch" and self._executions % self.save_freq == 0:
      # Mid-epoch: the epoch is not finished, so it resumes at its start.
      self._save(self._epoch, logs, completed_epochs=self._epoch)

  def on_epoch_end(self, epoch, logs=None):
    if self.save_freq == "epoch":
      self._save(epoch, logs, completed_epochs=epoch + 1)

  def _save(self, epoch, logs, completed_epochs):
    logs = dict(logs or {})
    if self.save_best_only:
      value = logs.get(self.monitor)
      if value is None:
        return
      if self.best is not None and not (value < self.best if self.mode == "min"
                                        else value > self.best):
        return
      self.best = value
    path = self.filepath.format(epoch=epoch + 1, **logs)
    self.model.save_weights(path, include_optimizer=not self.save_weights_only,
                            epoch=completed_epochs)
    self.last_saved = path
    if self.verbose:
      print(f"Epoch {epoch + 1}: saved checkpoint to {path}")


def latest_checkpoint(pattern_or_dir: str) -> Optional[str]:
  """The most recent checkpoint file matching a glob or in a directory.

  "Most recent" is the highest epoch stored in the file name's digits, then
  the modification time. Temporary files of unfinished writes are skipped.
  """
  pattern = os.fspath(pattern_or_dir)
  if os.path.isdir(pattern):
    pattern = os.path.join(pattern, "*")
  files = [f for f in glob.glob(pattern)
           if os.path.isfile(f) and ".tmp-" not in os.path.basename(f)]
  if not files:
    return None

  def key(f):
    digits = re.findall(r"\d+", os.path.basename(f))
    return (int(digits[-1]) if digits else -1, os.path.getmtime(f))

  return max(files, key=key)
