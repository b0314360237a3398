"""What every runner's entry point does around its work (no flags defined here).

* :func:`quiet_backend_probe`: pin JAX to the CPU where no accelerator plugin
  is installed, so no "Unable to initialize backend 'tpu'" line opens a run;
* :func:`reporting_errors`: an out-of-memory or lowering error printed as its
  message, exit status 1, not a traceback through the library.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

__all__ = ["quiet_backend_probe", "reporting_errors"]

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
