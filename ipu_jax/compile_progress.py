"""Progress of turning a function into a tile program, for slow compiles.

Lowering a large model takes tens of seconds; this display says where the
time goes, in the style of Keras' progress bar::

    Compiling 'train_step': lowering 412/845 equations [=====>.....] - 6.1s

Stages: tracing -> lowering n/N equations -> planning (cost and memory
models) -> memory check -> building the executor, and, on the first call,
compiling (XLA). Nothing is printed unless the work is still running after
``delay`` seconds (2 by default): quick programs stay silent. On a terminal
one line is rewritten in place; elsewhere (logs, CI) a line is printed per
stage and per quarter of the equations once the display has started, so
logs stay short. A last line
gives the total and the time of each stage.

Silence it with ``verbose=0`` (``ipu_jax.jit(..., verbose=0)``,
``model.fit(..., verbose=0)``), ``config.report.progress = False``, the
:func:`verbosity` context manager, or ``IPU_JAX_PROGRESS=0`` in the
environment.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from typing import Iterator, Optional, TextIO

__all__ = ["CompileProgress", "verbosity", "progress_bar", "PROGRESS_ENV",
           "DEFAULT_DELAY_SECONDS"]

PROGRESS_ENV = "IPU_JAX_PROGRESS"
DEFAULT_DELAY_SECONDS = 2.0

_VERBOSITY: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "ipu_jax_compile_progress", default=None)


@contextlib.contextmanager
def verbosity(level: int) -> Iterator[None]:
  """Sets how much compile progress is shown inside the ``with`` block.

  Args:
    level: 0 silent; 1 (or more) show progress of slow compiles.
  """
  token = _VERBOSITY.set(int(level))
  try:
    yield
  finally:
    _VERBOSITY.reset(token)


def _resolved_verbose(verbose: Optional[int]) -> int:
  if verbose is not None:
    return int(verbose)
  scoped = _VERBOSITY.get()
  if scoped is not None:
    return scoped
  return 0 if os.environ.get(PROGRESS_ENV, "1").strip() in ("0", "false",
                                                              "False") else 1


def is_interactive(stream) -> bool:
  """Whether ``stream`` is a terminal, where progress redraws one line in
  place (a file or pipe gets whole lines instead)."""
  isatty = getattr(stream, "isatty", None)
  return bool(isatty and isatty())


def progress_bar(done: int, total: int, width: int = 30) -> str:
  """A Keras-style bar: ``[=====>......]``."""
  total = max(int(total), 1)
  filled = int(width * min(max(done, 0), total) / total)
  if filled >= width:
    return "[" + "=" * width + "]"
  return "[" + ("=" * (filled - 1) + ">" if filled else "").ljust(width, ".") + "]"


class CompileProgress:
  """The progress display of one compile; a context manager.

  Args:
    program: the program's name, shown on every line.
    verbose: 0 silent, 1 show; None follows :func:`verbosity`, then
      ``$IPU_JAX_PROGRESS``, else 1.
    stream: where to write (default ``sys.stderr``, so it never mixes with a
      program's stdout output).
    delay: seconds of work before anything is shown (default
      ``DEFAULT_DELAY_SECONDS``).

  Example::

    with CompileProgress("mlp") as progress:
      progress.stage("tracing")
      ...
      progress.stage("lowering")
      for i, eqn in enumerate(eqns):
        ...
        progress.equations(i + 1, len(eqns))
  """

  def __init__(self, program: str, verbose: Optional[int] = None,
               stream: Optional[TextIO] = None,
               delay: Optional[float] = None):
    self.program = program
    self.enabled = _resolved_verbose(verbose) > 0
    self.stream = stream
    self.delay = DEFAULT_DELAY_SECONDS if delay is None else delay
    self._start = time.perf_counter()
    self._stage: Optional[str] = None
    self._stage_start = self._start
    self._durations: list = []       # (stage, seconds) of finished stages
    self._done = self._total = 0
    self._quarter = -1
    self._shown = False
    self._closed = False
    self._last_draw = 0.0
    self._lock = threading.Lock()
    self._timer = None
    if self.enabled:
      # A stage without callbacks (tracing, XLA compiling) may be the slow
      # one: the timer shows it when the delay passes.
      self._timer = threading.Timer(self.delay, self._on_timer)
      self._timer.daemon = True
      self._timer.start()

  @property
  def _out(self) -> TextIO:
    return self.stream if self.stream is not None else sys.stderr

  @property
  def _interactive(self) -> bool:
    return is_interactive(self._out)

  def __enter__(self) -> "CompileProgress":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self.close(failed=exc_type is not None)

  def stage(self, name: str) -> None:
    """Ends the current stage and starts ``name``."""
    now = time.perf_counter()
    with self._lock:
      if self._stage is not None:
        self._durations.append((self._stage, now - self._stage_start))
      self._stage, self._stage_start = name, now
      self._done = self._total = 0
      self._quarter = -1
      self._refresh(now, new_stage=True)

  def equations(self, done: int, total: int) -> None:
    """Reports ``done`` of ``total`` equations lowered."""
    if not self.enabled:
      return
    now = time.perf_counter()
    with self._lock:
      self._done, self._total = done, total
      # Redraw at most 10 times a second: lowering calls this per equation.
      if now - self._last_draw >= 0.1 or done == total:
        self._refresh(now)

  def close(self, failed: bool = False) -> None:
    """Ends the display: a summary line if anything was shown."""
    now = time.perf_counter()
    with self._lock:
      if self._closed:
        return
      self._closed = True
      if self._timer is not None:
        self._timer.cancel()
      if self._stage is not None:
        self._durations.append((self._stage, now - self._stage_start))
        self._stage = None
      if not self._shown:
        return
      stages = ", ".join(f"{name} {seconds:.1f}s"
                         for name, seconds in self._durations)
      verb = "stopped after" if failed else "compiled in"
      line = (f"Compiling '{self.program}': {verb} {now - self._start:.1f}s "
              f"({stages})")
      self._write(("\r" + line.ljust(self._width()) if self._interactive
                   else line) + "\n")

  # -- drawing ----------------------------------------------------------------

  def _on_timer(self) -> None:
    with self._lock:
      if not self._closed:
        self._refresh(time.perf_counter(), new_stage=True)

  def _refresh(self, now: float, new_stage: bool = False) -> None:
    if not self.enabled or self._closed or self._stage is None:
      return
    if now - self._start < self.delay:
      return
    first = not self._shown
    self._shown = True
    self._last_draw = now
    if self._interactive:
      self._write("\r" + self._line(now).ljust(self._width()))
    else:
      # Logs get a line per stage and per quarter of the equations, not one
      # per equation.
      quarter = 4 * self._done // self._total if self._total else -1
      if new_stage or first or quarter > self._quarter:
        self._quarter = quarter
        self._write(self._line(now) + "\n")

  def _line(self, now: float) -> str:
    text = f"Compiling '{self.program}': {self._stage}"
    if self._total:
      text += (f" {self._done}/{self._total} equations "
               f"{progress_bar(self._done, self._total)}")
    return text + f" - {now - self._start:.1f}s"

  def _width(self) -> int:
    return 100

  def _write(self, text: str) -> None:
    self._out.write(text)
    self._out.flush()
