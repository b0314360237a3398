"""The progress bar of ``fit``: epoch, step, loss and metrics, host wall time
and the throughput the emulated IPU would reach.

One line per epoch, refreshed after every execution when the output is a
terminal (``verbose=1``); one summary line per epoch when it is not, or with
``verbose=2``. The emulated throughput is the samples of one execution over
the report's estimated seconds for it (cycles at the target's clock), so it
says how fast the IPU would train, independent of how fast the host
emulates it. Before the first epoch, a slow compile of the training program
shows its own progress (:mod:`ipu_jax.compile_progress`, same bar), which
``verbose=0`` silences too.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from ipu_jax.compile_progress import is_interactive, progress_bar
from ipu_jax.keras.callbacks import Callback

__all__ = ["ProgbarLogger", "format_logs", "format_rate"]


def format_rate(samples_per_second: Optional[float]) -> str:
  if not samples_per_second:
    return "?"
  for unit, scale in (("M", 1e6), ("k", 1e3)):
    if samples_per_second >= scale:
      return f"{samples_per_second / scale:.2f}{unit}"
  return f"{samples_per_second:.1f}"


def format_logs(logs: dict, skip=()) -> str:
  parts = []
  for key, value in logs.items():
    if key in skip or key.startswith("_"):
      continue
    if isinstance(value, float):
      parts.append(f"{key}: {value:.4f}")
    else:
      parts.append(f"{key}: {value}")
  return " - ".join(parts)


_INTERNAL = ("host_round_trips", "emulated_samples_per_second", "samples",
             "executions", "host_seconds", "emulated_seconds")


class ProgbarLogger(Callback):
  """Keras-like progress bar, once per execution.

  Args:
    verbose: 1 = a bar (refreshed in place on a terminal), 2 = one line per
      epoch.
    stream: where to write (default ``sys.stdout``).
    width: characters of the bar.
  """

  def __init__(self, verbose: int = 1, stream: Optional[TextIO] = None, width: int = 30):
    super().__init__()
    self.verbose = verbose
    self.stream = stream
    self.width = width
    self._start = 0.0
    self._emulated_seconds = 0.0
    self._samples = 0
    self._last_logs: dict = {}
    self._seen = 0

  @property
  def _out(self) -> TextIO:
    return self.stream if self.stream is not None else sys.stdout

  @property
  def _interactive(self) -> bool:
    return is_interactive(self._out)

  def on_epoch_begin(self, epoch, logs=None):
    self._start = time.perf_counter()
    self._emulated_seconds = 0.0
    self._samples = 0
    self._last_logs = {}
    self._seen = 0
    epochs = self.params.get("epochs")
    self._write(f"Epoch {epoch + 1}/{epochs}\n")

  def on_train_batch_end(self, batch, logs=None):
    logs = dict(logs or {})
    self._samples += int(logs.get("samples", 0))
    self._emulated_seconds += float(logs.get("emulated_seconds", 0.0))
    self._last_logs = logs
    self._seen = batch + 1
    if self.verbose == 1 and self._interactive:
      self._write("\r" + self._line(batch + 1, logs), flush=True)

  def on_epoch_end(self, epoch, logs=None):
    logs = dict(logs or {})
    line = self._line(self._seen, {**self._last_logs, **logs})
    if self.verbose == 1 and self._interactive:
      self._write("\r" + line + "\n", flush=True)
    else:
      self._write(line + "\n", flush=True)

  def _line(self, step, logs) -> str:
    steps = self.params.get("steps") or step or 1
    step = step or 0
    wall = time.perf_counter() - self._start
    digits = len(str(steps))
    rate = (self._samples / self._emulated_seconds) if self._emulated_seconds else None
    text = (f"{step:>{digits}}/{steps} {progress_bar(step, steps, self.width)} - "
            f"{wall:.2f}s host - "
            f"{format_rate(rate)} samples/s emulated")
    metrics = format_logs(logs, skip=_INTERNAL)
    return text + (" - " + metrics if metrics else "")

  def _write(self, text: str, flush: bool = False):
    self._out.write(text)
    if flush:
      self._out.flush()
