"""A :class:`ipu_jax.Lowered` as an executable cache entry, and back.

What a lowered program needs to run and to report, and nothing else:

* the executor function (``Lowered._pure``: flat arguments and constant
  storages in; results, device state and the exception record out),
  exported by ``jax.export`` as StableHLO; the rules' closures it was built
  from are not kept (they cannot be serialised, and are not needed to run it);
* the constants' tile storages, as NumPy arrays, and which of them are
  device state (the stochastic rounding generators);
* the argument and result avals and trees the calls are checked against;
* the ``ProgramProfile`` (NumPy arrays and dataclasses) the report is made
  from, the dead code removed, the trapped exceptions' table.

On disk these are a JSON document and plain arrays (``ENTRY_CODEC``, an
:class:`~ipu_jax.executable_cache.EntryCodec`): the export field by field
(its StableHLO bytes, avals, trees as their structure), the profile's
dataclasses from the whitelist below, the avals and the exceptions' table by
explicit converters. Nothing is pickled, so reading an entry cannot run
code.

A program loaded this way has no tile program in memory. What needs one
(``Lowered.program``, ``inputs``, ``outputs``, ``constants``, or running it
with the replica axis bound, whose collectives the export cannot carry) lowers
it then, once (:meth:`CachedProgram.full`). Differentiating through a loaded
program's :meth:`~ipu_jax.Lowered.apply` is not supported (JAX does not
serialize an export's derivative); lower without the cache for that.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax import export

from ipu_jax import compile_progress
from ipu_jax import executable_cache
from ipu_jax import host_time
from ipu_jax.kernels.systems import IPUSystem
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering import profile as profile_lib
from ipu_jax.lowering.dead_code import DeadCode
from ipu_jax.lowering.fp_exceptions import Traps
from ipu_jax.lowering.host_io import HostIOProfile
from ipu_jax.lowering.jax_compat import dtype_of_plain, dtype_plain
from ipu_jax.lowering.program import FusedOp
from ipu_jax.lowering.remote import StreamingBuffer, StreamingProfile
from ipu_jax.lowering.replica_axis import REPLICA_AXIS, axis_is_bound
from ipu_jax.lowering.run_setup import RunSetup

__all__ = ["CachedProgram", "ENTRY_CODEC", "committed", "entry_of", "exported_of",
           "export_executor", "load_into", "store_from"]

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


def exported_of(entry: dict) -> export.Exported:
  return entry["exported"]


# A trapped exception's superstep, as Traps.error reads it (index, name, op, source).
TrapStep = collections.namedtuple("TrapStep", "index name op source")


def _traps_plain(traps: Traps) -> dict:
  return {"enabled": dict(traps.enabled), "program_name": traps.program_name,
          "steps": [tuple(TrapStep(s.index, s.name, s.op, s.source)) for s in traps.steps]}


def _traps_of(plain: dict) -> Traps:
  enabled = plain["enabled"]
  traps = Traps(enabled["inv"], enabled["div0"], enabled["oflo"],
                program_name=plain["program_name"])
  traps.steps = [TrapStep(*step) for step in plain["steps"]]
  return traps


# Exported fields that must be empty to be stored: effects (host callbacks)
# and shardings have no plain form here (an export of abstract arguments on
# one device has none).
_EMPTY_EXPORT_FIELDS = ("ordered_effects", "unordered_effects", "disabled_safety_checks")
_UNSHARDED_EXPORT_FIELDS = ("_in_named_shardings", "_out_named_shardings",
                            "in_shardings_hlo", "out_shardings_hlo")


def _exported_plain(exported: export.Exported) -> dict:
  """An export's fields as plain values (its vjp closure is not kept).

  ``Exported.serialize`` would need the ``flatbuffers`` package; the fields
  are stored one by one instead.

  Raises:
    TypeError: effects or shardings, which this form does not carry.
  """
  fields = {f.name: getattr(exported, f.name) for f in dataclasses.fields(exported)
            if f.name != "_get_vjp"}
  for name in _EMPTY_EXPORT_FIELDS:
    if fields[name]:
      raise TypeError(f"the executable cache cannot store an export with {name} "
                      f"{fields[name]!r}")
  for name in _UNSHARDED_EXPORT_FIELDS:
    if any(s is not None for s in fields[name]):
      raise TypeError(f"the executable cache cannot store an export with {name}")
  fields["mlir_module_serialized"] = np.frombuffer(fields["mlir_module_serialized"], np.uint8)
  fields["in_tree"] = _tree_plain(fields["in_tree"])
  fields["out_tree"] = _tree_plain(fields["out_tree"])
  return fields


def _exported_of_plain(fields: dict) -> export.Exported:
  fields = dict(fields, mlir_module_serialized=fields["mlir_module_serialized"].tobytes(),
                in_tree=jax.tree_util.tree_structure(fields["in_tree"]),
                out_tree=jax.tree_util.tree_structure(fields["out_tree"]))
  return export.Exported(**fields, _get_vjp=None)


def _tree_plain(tree):
  """A tree of lists, tuples, dicts and None as that structure, 0 at its leaves."""
  structure = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
  if jax.tree_util.tree_structure(structure) != tree:
    raise TypeError(f"the executable cache cannot store the tree {tree} (custom nodes)")
  return structure


# What an entry may hold besides plain values: the profile's dataclasses (the
# whitelist; anything else is refused when stored and when loaded) and, by
# explicit converters, the export, avals and the exceptions' table.
ENTRY_CODEC = executable_cache.EntryCodec(
    classes=(profile_lib.ProgramProfile, profile_lib.StepProfile, profile_lib.TensorProfile,
             profile_lib.MemoryProfile, IPUTarget, IPUSystem, DeadCode, FusedOp,
             StreamingProfile, StreamingBuffer, HostIOProfile, RunSetup),
    converters=(
        executable_cache.Converter("Exported", export.Exported, _exported_plain,
                                   _exported_of_plain),
        executable_cache.Converter(
            "ShapedArray", jax.core.ShapedArray,
            lambda a: (tuple(a.shape), dtype_plain(a.dtype), bool(a.weak_type)),
            lambda p: jax.core.ShapedArray(p[0], dtype_of_plain(p[1]), weak_type=p[2])),
        executable_cache.Converter("Traps", Traps, _traps_plain, _traps_of),
    ))


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
      # Trees as text: what they are checked by (they are in the key too).
      "out_tree": str(lowered.out_tree),
      "user_tree": str(lowered._user_tree),
      "traps": lowered._traps,
      "out_of_memory": lowered.out_of_memory,
      "exported": exported,
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
  if entry["out_tree"] != str(lowered.out_tree):
    return "its result tree differs"
  if entry["user_tree"] != str(lowered._user_tree):
    return "its argument tree differs"
  return None


def load_into(lowered, cache_dir: str, key: str, lower_fully: Callable[[], Any],
              progress: Optional[compile_progress.CompileProgress] = None) -> bool:
  """Restore the traced ``lowered`` from the cache; False when the entry is not there.

  Args:
    lowered: a ``Lowered`` traced (``jaxpr``, trees, avals set), not lowered.
    cache_dir: the cache directory.
    key: the program's key (``executable_cache.program_key``).
    lower_fully: builds the program lowered without the cache.
    progress: the compile's progress display; a hit prints one line through
      it (unless it is silenced), as a compile does.
  """
  if progress is not None:
    progress.stage("loading from the executable cache")
  with host_time.timer() as loading:
    entry = executable_cache.load(cache_dir, key, ENTRY_CODEC)
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
  if progress is not None:
    _announce_hit(progress, f"loaded from the executable cache in {loading[0]:.3f}s "
                  f"(entry {key[:12]}), not lowered")
  return True


def _announce_hit(progress: compile_progress.CompileProgress, text: str) -> None:
  """One line, ``Compiling '<name>': <text>``, where the progress display writes.

  Unlike the display's stage lines it is not held back for slow compiles: a
  hit is quick, and the line is the only sign of it in a plain script. The
  display's switches (``verbose=0``, ``config.report.progress``,
  ``IPU_JAX_PROGRESS=0``) silence it.
  """
  if not progress.enabled:
    return
  stream = progress.stream if progress.stream is not None else sys.stderr
  line = f"Compiling '{progress.program}': {text}"
  if compile_progress.is_interactive(stream):
    # Over a stage line the display may have drawn in place (100 wide).
    line = "\r" + line.ljust(100)
  stream.write(line + "\n")
  stream.flush()


def store_from(lowered, cache_dir: str, key: str, lower_fully: Callable[[], Any]) -> None:
  """Export ``lowered``'s executor and write its entry; it runs the export from now on.

  Running the exported form here too makes this process compile the same
  HLO a later process will, so XLA's persistent cache serves that one. A
  program that cannot be exported or stored (host callbacks...) runs
  uncached, and its record says why.
  """
  name = lowered.profile.name
  with host_time.timer() as storing:
    try:
      exported = export_executor(lowered._pure, lowered._in_avals,  # pylint: disable=protected-access
                                 lowered._constant_values)  # pylint: disable=protected-access
      path = executable_cache.store(cache_dir, key, entry_of(lowered, exported), ENTRY_CODEC)
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
