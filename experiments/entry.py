"""What every runner's entry point does around its work (no flags defined here).

* :func:`quiet_backend_probe`: pin JAX to the CPU where no accelerator plugin
  is installed, so no "Unable to initialize backend 'tpu'" line opens a run;
* :func:`reporting_errors`: an out-of-memory or lowering error printed as its
  message, exit status 1, not a traceback through the library;
* :func:`prepare_outputs`: the files and directories a run writes at its end,
  made ready (or refused, naming the flag) before it starts.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Callable

__all__ = ["prepare_outputs", "quiet_backend_probe", "reporting_errors"]

# Packages through which JAX finds a TPU or GPU; with none installed there is
# nothing to probe for.
_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin",
                        "jax_rocm6_plugin", "jax_rocm7_plugin")


def quiet_backend_probe() -> None:
  """Pins JAX to the CPU when no accelerator plugin is installed.

  Otherwise JAX's first call probes for a TPU and a GPU and logs "Unable to
  initialize backend 'tpu'" on every CPU-only machine, as the first lines of
  every run. ``JAX_PLATFORMS`` (or ``jax_platforms``), when set, wins. Must
  run before anything touches a JAX backend.
  """
  import importlib.metadata
  import importlib.util
  import jax
  if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
    return
  if any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS):
    return
  if list(importlib.metadata.entry_points(group="jax_plugins")):
    return
  jax.config.update("jax_platforms", "cpu")


def reporting_errors(main: Callable) -> Callable:
  """``main`` printing an out-of-memory or lowering error as its message, exit status 1.

  These errors are the answer a run gives (the model does not fit; an
  operation has no tile lowering), raised before anything runs, and their
  messages say what to change: a traceback through the library would bury it.
  """

  @functools.wraps(main)
  def wrapped(argv):
    from ipu_jax.errors import LoweringError, OutOfMemoryError
    try:
      return main(argv)
    except (OutOfMemoryError, LoweringError) as error:
      sys.stdout.flush()
      print(f"{type(error).__name__}: {error}", file=sys.stderr)
      return 1

  return wrapped


def prepare_outputs(files=(), directories=()) -> None:
  """Make ready the places a run writes when it ends, before it starts.

  A run writes its JSON, plots and reports last, after minutes of lowering
  or training; a path it cannot write would fail only then. So the missing
  directories are made now (as a report directory is made when missing), and
  a path that cannot be written is refused now.

  Args:
    files: ``(flag, path)`` pairs of files written at the end (None: not
      asked for); their directories are made.
    directories: ``(flag, path)`` pairs of directories written at the end;
      they are made.

  Raises:
    ValueError: naming the flag, a file path that is a directory, or a path
      with a file where a directory must be.
  """
  def make(flag, directory, path):
    try:
      os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
      raise ValueError(f"{flag}={path}: {directory} is a file, not a directory.") from None

  for flag, path in files:
    if not path:
      continue
    if os.path.isdir(path):
      raise ValueError(f"{flag}={path} is a directory; give a file name.")
    make(flag, os.path.dirname(path) or ".", path)
  for flag, path in directories:
    if path:
      make(flag, path, path)


def write_outputs(report, results: dict, report_dir=None, json_out=None) -> None:
  """The end of a pipelined run, where :func:`prepare_outputs` made ready.

  Args:
    report: the pipeline's report, saved into ``report_dir`` (HTML, JSON,
      plots) when one is given.
    results: the run's figures, written to ``json_out`` when one is given.
  """
  if report_dir:
    report.save(report_dir)
    print(f"Reports written to {report_dir}")
  if json_out:
    with open(json_out, "w") as out:
      json.dump(results, out, indent=1)
