"""A :class:`ipu_jax.Lowered` as an executable cache entry, and back.

What a lowered program needs to run and to report, and nothing else:

* the executor function (``Lowered._pure``: flat arguments and constant
  storages in; results, device state and the exception record out),
  exported by ``jax.export`` as StableHLO; the rules' closures it was built
  from are not kept (they cannot be pickled, and are not needed to run it);
* the constants' tile storages, as NumPy arrays, and which of them are
  device state (the stochastic rounding generators);
* the argument and result avals and trees the calls are checked against;
* the ``ProgramProfile`` (NumPy arrays and dataclasses) the report is made
  from, the dead code removed, the trapped exceptions' table.

A program loaded this way has no tile program in memory. What needs one
(``Lowered.program``, ``inputs``, ``outputs``, ``constants``, or running it
with the replica axis bound, whose collectives the export cannot carry) lowers
it then, once (:meth:`CachedProgram.full`). Differentiating through a loaded
program's :meth:`~ipu_jax.Lowered.apply` is not supported (JAX does not
serialize an export's derivative); lower without the cache for that.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax import export

from ipu_jax import executable_cache
from ipu_jax import host_time
from ipu_jax.lowering.replica_axis import REPLICA_AXIS, axis_is_bound

__all__ = ["CachedProgram", "committed", "entry_of", "exported_of", "export_executor",
           "load_into", "store_from"]

# The cache's log lines go with ipu_jax.jit's (recompilation notes).
LOGGER = "ipu_jax.jit"
logger = logging.getLogger(LOGGER)

# Attributes a Lowered from the cache gets by lowering after all.
TILE_PROGRAM_ATTRIBUTES = ("program", "inputs", "outputs", "constants")


def _abstract(value) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(np.shape(value), value.dtype)


def export_executor(pure: Callable, in_avals, constants) -> export.Exported:
  """``pure(flat_args, constants)`` exported for these avals and constants.

  Raises:
    Exception: whatever ``jax.export`` raises for a program it cannot export
      (host callbacks, ...); the caller does not cache such a program.
  """
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in in_avals]
  return export.export(jax.jit(pure))(args, [_abstract(c) for c in constants])


def _exported_fields(exported: export.Exported) -> dict:
  # ``_get_vjp`` is a closure of this process: not kept (see the module doc).
  return {f.name: getattr(exported, f.name) for f in dataclasses.fields(exported)
          if f.name != "_get_vjp"}


def exported_of(entry: dict) -> export.Exported:
  return export.Exported(**entry["exported"], _get_vjp=None)


def _report_profile(profile):
  """``profile`` without what only the running process needs.

  A fused compute set's members keep their own supersteps (closures, run
  when exceptions trap); the report reads only their names and sources.
  """
  steps = [dataclasses.replace(step, fused_ops=tuple(
               dataclasses.replace(op, step=None) for op in step.fused_ops))
           if step.fused_ops else step for step in profile.steps]
  return dataclasses.replace(profile, steps=steps, host_side=None)


def entry_of(lowered, exported: export.Exported) -> dict:
  """The cache entry of a freshly lowered program."""
  profile = _report_profile(lowered.profile)
  return {
      "name": profile.name,
      "profile": profile,
      "dead_code": lowered.dead_code,
      "constants": [np.asarray(c) for c in lowered._constant_values],
      "device_state": list(lowered._device_state),
      "in_avals": list(lowered._in_avals),
      "out_avals": list(lowered._out_avals),
      "out_tree": lowered.out_tree,
      "user_tree": lowered._user_tree,
      "traps": lowered._traps,
      "out_of_memory": lowered.out_of_memory,
      "exported": _exported_fields(exported),
  }


class CachedProgram:
  """The executor of a loaded (or stored) program, with its way back to lowering.

  Args:
    exported: the exported executor.
    lower_fully: builds the program's ``Lowered`` without the cache (traces
      and lowers again); called at most once, when something needs the tile
      program.
  """

  def __init__(self, exported: export.Exported, lower_fully: Callable[[], Any]):
    self.exported = exported
    self._lower_fully = lower_fully
    self._full = None

  def full(self):
    """The program lowered without the cache (once)."""
    if self._full is None:
      self._full = self._lower_fully()
    return self._full

  def __call__(self, flat_args, constants):
    """``Lowered._pure``'s contract, on the exported function."""
    if axis_is_bound(REPLICA_AXIS):
      # Replicas (vmap / shard_map): collectives need the axis, which the
      # export (made with none bound) does not have.
      return self.full()._live_pure(flat_args, constants)
    flat, state, record = self.exported.call(list(flat_args), list(constants))
    return list(flat), list(state), record


def committed(values) -> list:
  """``values`` as arrays committed to the default device.

  An exported call's results are committed arrays. Fed back where the first
  call had uncommitted arguments, they would make the caller's ``jax.jit``
  compile a second program (the HLO differs by its arguments' shardings).
  Committing the first call's arguments too gives one program.
  """
  device = jax.devices()[0]
  return [v if getattr(v, "committed", False) else jax.device_put(v, device)
          for v in values]


def restore(lowered, entry: dict, program: CachedProgram) -> None:
  """Give ``lowered`` (traced, not lowered) what ``entry`` holds."""
  lowered.profile = entry["profile"]
  lowered.dead_code = entry["dead_code"]
  lowered._constant_values = committed(entry["constants"])
  lowered._device_state = list(entry["device_state"])
  lowered._in_avals = list(entry["in_avals"])
  lowered._out_avals = list(entry["out_avals"])
  lowered._traps = entry["traps"]
  lowered.out_of_memory = entry["out_of_memory"]
  lowered._cached_program = lowered._pure = program
  lowered._function = jax.jit(program)


def check_same_interface(lowered, entry: dict) -> Optional[str]:
  """Why ``entry`` does not fit the traced ``lowered`` (None when it does)."""
  if entry["out_tree"] != lowered.out_tree:
    return "its result tree differs"
  if entry["user_tree"] != lowered._user_tree:
    return "its argument tree differs"
  return None


def load_into(lowered, cache_dir: str, key: str, lower_fully: Callable[[], Any]) -> bool:
  """Restore the traced ``lowered`` from the cache; False when the entry is not there.

  Args:
    lowered: a ``Lowered`` traced (``jaxpr``, trees, avals set), not lowered.
    cache_dir: the cache directory.
    key: the program's key (``executable_cache.program_key``).
    lower_fully: builds the program lowered without the cache.
  """
  with host_time.timer() as loading:
    entry = executable_cache.load(cache_dir, key)
    why = entry and check_same_interface(lowered, entry)
    if why:
      logger.warning("executable cache: entry %s does not fit (%s); lowering again",
                     key[:12], why)
    if not entry or why:
      return False
    restore(lowered, entry, CachedProgram(exported_of(entry), lower_fully))
  name = lowered.profile.name
  lowered.host.cache, lowered.host.cache_seconds = "hit", loading[0]
  lowered.profile.host_side = lowered._host_side()  # pylint: disable=protected-access
  from ipu_jax.report import Report, maybe_auto_save  # pylint: disable=g-import-not-at-top
  lowered.report = Report(lowered.profile)
  if lowered.options.report_directory:
    maybe_auto_save(lowered.report, lowered.options.report_directory)
  logger.info("executable cache: loaded '%s' (%s) in %.3f s instead of lowering it",
              name, key[:12], loading[0])
  return True


def store_from(lowered, cache_dir: str, key: str, lower_fully: Callable[[], Any]) -> None:
  """Export ``lowered``'s executor and write its entry; it runs the export from now on.

  Running the exported form here too makes this process compile the same
  HLO a later process will, so XLA's persistent cache serves that one. A
  program that cannot be exported or pickled (host callbacks...) runs
  uncached, and its record says why.
  """
  name = lowered.profile.name
  with host_time.timer() as storing:
    try:
      exported = export_executor(lowered._pure, lowered._in_avals,  # pylint: disable=protected-access
                                 lowered._constant_values)  # pylint: disable=protected-access
      path = executable_cache.store(cache_dir, key, entry_of(lowered, exported))
    except Exception as error:  # pylint: disable=broad-except
      lowered.host.cache = f"not cached: {type(error).__name__}: {str(error)[:200]}"
      logger.info("executable cache: '%s' %s", name, lowered.host.cache)
      return
  program = CachedProgram(exported, lower_fully)
  program._full = lowered  # pylint: disable=protected-access  # the tile program is here
  lowered._cached_program = lowered._pure = program  # pylint: disable=protected-access
  lowered._function = jax.jit(program)  # pylint: disable=protected-access
  lowered._constant_values = committed(lowered._constant_values)  # pylint: disable=protected-access
  lowered.host.cache, lowered.host.cache_seconds = "stored", storing[0]
  logger.info("executable cache: stored '%s' in %s (%.3f s)", name, path, storing[0])
