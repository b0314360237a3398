"""A :class:`ipu_jax.Lowered` as an executable cache entry, and back.

What a lowered program needs to run and to report, and nothing else
(``ipu_jax/stages.py`` makes the ``Lowered`` of an entry,
``Lowered.from_cache_entry``, and runs a stored one's export,
``Lowered.stored``):

* the executor function (``Executable.run``: flat arguments and constant
  storages in; results, device state and the exception record out),
  exported by ``jax.export`` as StableHLO; the rules' closures it was built
  from are not kept (they cannot be serialised, and are not needed to run it);
* the constants' tile storages, as NumPy arrays, which of them are
  device state (the stochastic rounding generators) and how a seed's state
  is laid out in storage (so ``set_seed`` needs no tile mapping);
* the argument and result avals and trees the calls are checked against;
* the ``ProgramProfile`` (NumPy arrays and dataclasses) the report is made
  from, the dead code removed, the trapped exceptions' table.

On disk these are a JSON document and plain arrays (``ENTRY_CODEC``, an
:class:`~ipu_jax.executable_cache.EntryCodec`): the export field by field
(its StableHLO bytes, avals, trees as their structure), the profile's
dataclasses from the whitelist below, the avals and the exceptions' table by
explicit converters. Nothing is pickled, so reading an entry cannot run
code.

A program loaded this way has no tile program in memory: its
``Lowered.program`` (``inputs``, ``outputs``, ``constants``) is None, and
``Lowered.lower_uncached()`` lowers it. Running it with the replica axis
bound, whose collectives the export cannot carry, lowers it then, once
(:meth:`CachedProgram.live`). Differentiating through a loaded
program's :meth:`~ipu_jax.Lowered.apply` is not supported (JAX does not
serialize an export's derivative); lower without the cache for that.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
from typing import Callable, Optional

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

__all__ = ["CachedProgram", "ENTRY_CODEC", "announce_hit", "committed", "entry_of",
           "exported_of", "export_executor", "load", "store"]

# The cache's log lines go with ipu_jax.jit's (recompilation notes).
LOGGER = "ipu_jax.jit"
logger = logging.getLogger(LOGGER)

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
  """The cache entry of a freshly lowered program (an ``ipu_jax.stages.Lowered``)."""
  profile = _report_profile(lowered.profile)
  executable, signature = lowered.executable, lowered.signature
  return {
      "name": profile.name,
      "profile": profile,
      "dead_code": lowered.dead_code,
      "constants": [np.asarray(c) for c in executable.constants],
      "device_state": list(executable.state),
      # The generators' storage layout: a seed is set without the tile mapping.
      "state_index": [np.asarray(i) for i in executable.seeding.index],
      "in_avals": list(signature.in_avals),
      "out_avals": list(signature.out_avals),
      # Trees as text: what they are checked by (they are in the key too).
      "out_tree": str(signature.out_tree),
      "user_tree": str(signature.in_tree),
      "traps": executable.traps,
      "out_of_memory": executable.out_of_memory,
      "exported": exported,
  }


class CachedProgram:
  """The exported executor of a loaded (or stored) program.

  Called as the executor of an ``Executable`` (``ipu_jax/stages.py``) is.
  With the replica axis bound (``vmap`` / ``shard_map`` replicas), whose
  collectives the export (made with none bound) cannot carry, it runs the
  executor built from the tile program: ``live`` when the program was just
  lowered, else the one ``lower_live`` lowers (once, on the first such call).

  Args:
    exported: the exported executor.
    live: the executor built from the tile program, when there is one.
    lower_live: lowers the program without the cache and returns its
      executor (a loaded program).
  """

  def __init__(self, exported: export.Exported, live: Optional[Callable] = None,
               lower_live: Optional[Callable[[], Callable]] = None):
    self.exported = exported
    self._live = live
    self._lower_live = lower_live

  def live(self) -> Callable:
    """The executor built from the tile program (lowered once, if need be)."""
    if self._live is None:
      self._live = self._lower_live()
    return self._live

  def __call__(self, flat_args, constants):
    if axis_is_bound(REPLICA_AXIS):
      return self.live()(flat_args, constants)
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


def check_same_interface(signature, entry: dict) -> Optional[str]:
  """Why ``entry`` does not fit a program traced with ``signature`` (None when it does)."""
  if entry["out_tree"] != str(signature.out_tree):
    return "its result tree differs"
  if entry["user_tree"] != str(signature.in_tree):
    return "its argument tree differs"
  return None


def load(cache_dir: str, key: str, signature,
         progress: Optional[compile_progress.CompileProgress] = None) -> Optional[tuple]:
  """The entry of ``key`` and the seconds it took to read; None when it is not there.

  ``ipu_jax.stages.Lowered.from_cache_entry`` makes the program of it.

  Args:
    cache_dir: the cache directory.
    key: the program's key (``executable_cache.program_key``).
    signature: the traced program's ``ipu_jax.compiled.Signature`` (an entry
      of other trees is not used).
    progress: the compile's progress display.
  """
  if progress is not None:
    progress.stage("loading from the executable cache")
  with host_time.timer() as loading:
    entry = executable_cache.load(cache_dir, key, ENTRY_CODEC)
    why = entry and check_same_interface(signature, entry)
    if why:
      logger.warning("executable cache: entry %s does not fit (%s); lowering again",
                     key[:12], why)
  if not entry or why:
    return None
  return entry, loading[0]


def announce_hit(progress: Optional[compile_progress.CompileProgress], name: str, key: str,
                 seconds: float) -> None:
  """The log line of a hit, and its progress line (unless silenced)."""
  logger.info("executable cache: loaded '%s' (%s) in %.3f s instead of lowering it",
              name, key[:12], seconds)
  if progress is not None:
    _announce_hit(progress, f"loaded from the executable cache in {seconds:.3f}s "
                  f"(entry {key[:12]}), not lowered")


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


def store(lowered, cache_dir: str, key: str) -> Optional[CachedProgram]:
  """Export ``lowered``'s executor and write its entry: the exported program, or None.

  A program that cannot be exported or stored (host callbacks...) is not
  cached (None), and its host record says why.
  """
  name = lowered.profile.name
  host = lowered.host
  with host_time.timer() as storing:
    try:
      exported = export_executor(lowered.executable.run, lowered.signature.in_avals,
                                 lowered.executable.constants)
      path = executable_cache.store(cache_dir, key, entry_of(lowered, exported), ENTRY_CODEC)
    except Exception as error:  # pylint: disable=broad-except
      host.cache = f"not cached: {type(error).__name__}: {str(error)[:200]}"
      logger.info("executable cache: '%s' %s", name, host.cache)
      return None
  host.cache, host.cache_seconds = "stored", storing[0]
  logger.info("executable cache: stored '%s' in %s (%.3f s)", name, path, storing[0])
  return CachedProgram(exported, live=lowered.executable.run)
