"""The last stage of an ``ipu_jax.jit`` compile: a program ready to run.

:class:`Compiled` (what :meth:`ipu_jax.stages.Lowered.compile` returns) runs an
:class:`Executable`: the jitted executor built from a tile program
(:func:`build_executable`) or its export from the executable cache, the
constants' tile storages with the device state among them (the stochastic
rounding generators, which each run advances) and the seed. Arguments are
checked against the program's :class:`Signature` before anything runs, as
``jax.stages.Compiled`` checks them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import cached_program
from ipu_jax import host_time
from ipu_jax.lowering import fp_exceptions
from ipu_jax.lowering.exchange import to_flat
from ipu_jax.lowering.executor import build_function
from ipu_jax.lowering.jax_compat import physical_nbytes
from ipu_jax.lowering.lower import is_key_dtype
from ipu_jax.lowering.remote import is_remote
from ipu_jax.lowering.tile_generators import prng_state_value

__all__ = ["ArgumentMismatch", "Compiled", "Executable", "Seeding", "Signature",
           "avals_bytes", "build_executable", "check_arguments"]


@dataclasses.dataclass(frozen=True)
class Signature:
  """The flat arguments and results a program is checked and called with.

  ``in_tree`` is the tree of the dynamic ``(args, kwargs)`` a caller passes.
  """

  in_avals: tuple
  out_avals: tuple
  in_tree: Any
  out_tree: Any

  @classmethod
  def empty(cls) -> "Signature":
    """No arguments, no results (a graph engine's program: all device state)."""
    return cls((), (), jax.tree_util.tree_structure(((), {})),
               jax.tree_util.tree_structure(()))



@dataclasses.dataclass(frozen=True)
class Seeding:
  """How the generators' state is rebuilt for a seed.

  Attributes:
    default_seed: the seed ``set_seed(None)`` uses
      (``floating_point_behaviour.seed``).
    num_tiles: the tiles whose generators the state holds.
    positions: which constants are generator state.
    index: per position, its tile storage as flat element indices (-1:
      padding), so a seed's state is laid out without the tile mapping
      (which a program from the executable cache does not have).
  """

  default_seed: int = 0
  num_tiles: int = 0
  positions: tuple = ()
  index: tuple = ()


@dataclasses.dataclass(frozen=True)
class Executable:
  """A program's runnable form, what :meth:`Lowered.compile` compiles.

  Attributes:
    run: ``run(flat_args, constants) -> (flat results, device state,
      exception record or None)``, traceable: the executor built from the
      tile program, or its export (``cached_program.CachedProgram``).
    constants: the constants' initial tile storages.
    state: the constants the program updates and the next run starts from
      (device state), as positions in ``constants``.
    seeding: how the generator state is set for a seed.
    traps: the trapped floating-point exceptions' table, or None.
    exported: whether ``run`` is the exported form (arguments committed).
    out_of_memory: a tile is over its SRAM (lowered with
      ``allow_out_of_memory``): running is refused.
  """

  run: Callable
  constants: tuple
  state: tuple = ()
  seeding: Seeding = Seeding()
  traps: Any = None
  exported: bool = False
  out_of_memory: bool = False


def build_executable(program, tensors: dict, signature: Signature, *, inputs, outputs,
                      constant_keys, constants, state, traps, mode, out_of_memory,
                      seeding: Seeding = Seeding()) -> Executable:
  """The executor of ``program`` as one traceable function (see :class:`Executable`).

  Arguments come in as logical arrays and leave the same way; constants
  and device state stay in tile storage.
  """
  keys_in = [t.id for t in inputs] + list(constant_keys)
  keys_out = [t.id for t in outputs]
  keys_state = [constant_keys[i] for i in state]
  # Trapped floating-point exceptions: the record is the last output.
  keys_record = [fp_exceptions.RECORD_KEY] if traps else []
  # The arguments come in and the outputs leave as logical arrays (a
  # remote buffer's as its rows): the executor builds an argument's storage
  # only where it holds it as storage.
  logical_in = [i for i, t in enumerate(inputs) if not is_remote(t)]
  logical_out = [i for i, t in enumerate(outputs) if not is_remote(t)]
  inner = build_function(program, tensors, keys_in, keys_out + keys_state + keys_record,
                         traps=traps, mode=mode, logical_inputs=logical_in,
                         logical_outputs=logical_out).__wrapped__
  num_out, num_state = len(keys_out), len(keys_state)
  in_avals, out_avals = signature.in_avals, signature.out_avals

  def run(flat_args, constant_values):
    values = []
    for arg, aval, tensor in zip(flat_args, in_avals, inputs):
      if is_key_dtype(aval.dtype):
        arg = jax.random.key_data(arg)
      arg = jnp.asarray(arg).astype(tensor.dtype)
      # A remote buffer's storage is its rows (host memory).
      values.append(jnp.reshape(arg, tensor.storage_shape) if is_remote(tensor) else arg)
    results = inner(*values, *constant_values)
    results, device_state, record = (results[:num_out],
                                     results[num_out:num_out + num_state],
                                     results[num_out + num_state:])
    flat_out = []
    for value, aval, tensor in zip(results, out_avals, outputs):
      if is_remote(tensor):
        value = _to_flat(value, tensor).reshape(tensor.shape[1:])
      elif value.shape != tuple(tensor.shape):
        # An output aliasing another shape of its tensor id (a reshape of an input).
        value = value.reshape(tensor.shape)
      if is_key_dtype(aval.dtype):
        value = jax.random.wrap_key_data(value, impl=aval.dtype._impl)
      flat_out.append(value)
    return flat_out, list(device_state), (record[0] if record else None)

  return Executable(run, tuple(constants), tuple(state), seeding, traps,
                    exported=False, out_of_memory=out_of_memory)


# -- Compiled ----------------------------------------------------------------


class ArgumentMismatch(Exception):
  """A call's arguments differ from the lowering's in tree, shape, dtype or weak type.

  Raised by :meth:`Compiled.call_tree` while ``jax.jit`` traces the call,
  before anything runs: the caller lowers (or finds) the program for them.
  """


def _weak_types(flat_args) -> tuple:
  """Which leaves are weakly typed (a Python scalar, ``jnp.asarray(0.5)``)."""
  return tuple(bool(getattr(jax.typeof(x), "weak_type", False)) for x in flat_args)


def _tree_runner(executable: Executable, signature: Signature) -> Callable:
  """``run(constants, args, kwargs) -> (outputs, device state, record)``, traceable.

  The arguments are checked as traced values, so ``jax.jit`` of it checks
  each new tree, shape, dtype or weak type once, when it traces them; weak
  types count because ``IPUFunction`` keys its programs by them (a weakly
  typed argument can promote the function's other operands differently).
  """
  expected = [(tuple(a.shape), a.dtype, bool(getattr(a, "weak_type", False)))
              for a in signature.in_avals]

  def run(constants, args, kwargs):
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    if tree != signature.in_tree:
      raise ArgumentMismatch(f"arguments structured as {tree}, lowered for {signature.in_tree}")
    for leaf, want in zip(flat, expected):
      aval = jax.typeof(leaf)
      if (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False))) != want:
        raise ArgumentMismatch(f"an argument is {aval}, lowered as {want}")
    outputs, device_state, record = executable.run(flat, constants)
    return jax.tree_util.tree_unflatten(signature.out_tree, outputs), device_state, record

  return run


class Compiled:
  """A compiled program: call it with the dynamic arguments it was lowered for.

  It holds the jitted executor and the constants' tile storages, among them
  the device state (the tiles' stochastic rounding generators): each run
  continues the random streams where the last ended, as on the chip.

  Attributes:
    executable: the :class:`Executable` compiled.
    signature: the :class:`Signature` arguments are checked against.
    host: the :class:`~ipu_jax.host_time.HostTimes` its calls are timed into.
  """

  __slots__ = ("executable", "signature", "host", "_function", "_loose", "_loose_calls",
               "_constants", "_has_run")

  def __init__(self, executable: Executable, signature: Signature,
               host: host_time.HostTimes):
    self.executable = executable
    self.signature = signature
    self.host = host
    self._function = jax.jit(_tree_runner(executable, signature))
    self._loose = None
    self._loose_calls = set()  # weak-type patterns only the plain executor takes
    self._constants = list(executable.constants)
    self._has_run = False

  @property
  def has_run(self) -> bool:
    """Whether it has run once (its first call compiles the XLA program)."""
    return self._has_run

  @property
  def out_tree(self):
    return self.signature.out_tree

  def _check_runnable(self):
    if self.executable.out_of_memory:
      raise RuntimeError("this program was lowered with allow_out_of_memory and a tile is "
                         "over its SRAM; it cannot run (read .report)")

  def __call__(self, *args, **kwargs):
    """Run the program on the arguments it was lowered for.

    Takes the function's dynamic arguments (static ones left out), as
    ``jax.stages.Compiled`` does, and checks their tree structure, shapes and
    dtypes against the lowering before anything runs.

    Raises:
      TypeError: an argument is missing, extra, or of another shape or dtype,
        naming it.
    """
    if self._has_run and not self.executable.exported and not self._takes_loose(args, kwargs):
      # A loop's call: jax.jit's dispatcher checks the arguments (see
      # call_tree); anything it refuses is checked below, named.
      try:
        return self.call_tree(args, kwargs)
      except ArgumentMismatch:
        pass
    with_paths, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    if tree != self.signature.in_tree:
      raise TypeError(_tree_mismatch(self.signature.in_tree, tree))
    flat = [leaf for _, leaf in with_paths]
    names = [_argument_name(path) for path, _ in with_paths]
    check_arguments(self.signature.in_avals, flat, names)
    return self.call_flat(flat)

  def _takes_loose(self, args, kwargs) -> bool:
    """Whether a call like this one ran on the plain executor before (see call_flat)."""
    return bool(self._loose_calls) and (
        _weak_types(jax.tree_util.tree_leaves((args, kwargs))) in self._loose_calls)

  def call_flat(self, flat_args: Sequence[Any]):
    """Run on already-checked flat arguments (the leaves of the lowering)."""
    self._check_runnable()
    flat_args = self.prepare_arguments(flat_args)
    weak = _weak_types(flat_args) if self._loose_calls else None
    if weak in self._loose_calls:
      return self._run_loose(flat_args)
    args, kwargs = jax.tree_util.tree_unflatten(self.signature.in_tree, flat_args)
    try:
      return self._run(args, kwargs)
    except ArgumentMismatch:
      # Checked without weak types (a Python scalar standing for a 0-d
      # array, as jax.stages.Compiled allows): the leaves run as given.
      # Calls like it go there directly: a refused trace is not cached by
      # jax.jit, and cost milliseconds a call (70x the call).
      self._loose_calls.add(_weak_types(flat_args))
      return self._run_loose(flat_args)

  def call_tree(self, args: tuple, kwargs: dict):
    """Run on the call's own ``(args, kwargs)``: a loop's repeat call.

    ``jax.jit``'s dispatcher flattens the arguments, finds the program traced
    for their tree, shapes, dtypes and weak types, and unflattens the results
    without Python work per leaf, as for a plain ``jax.jit`` function; a step
    of a millisecond spent a sixth of its time in ``call_flat``'s Python. It
    is the function ``call_flat`` runs: after a first call either way,
    nothing compiles again.

    Raises:
      ArgumentMismatch: the arguments are not those it was lowered for
        (found while tracing them, before anything runs).
      RuntimeError: the program is over a tile's memory (see ``call_flat``).
    """
    self._check_runnable()
    return self._run(args, kwargs)

  def _run(self, args, kwargs):
    """One run of the traced call on ``(args, kwargs)``, timed, the device state kept."""
    with host_time.measuring(self.host, first=not self._has_run):
      outputs, device_state, record = self._function(self._constants, args, kwargs)
    return self._finish(outputs, device_state, record)

  def _run_loose(self, flat_args):
    """:meth:`_run` of flat leaves whose weak types differ from the lowering's."""
    if self._loose is None:
      self._loose = jax.jit(self.executable.run)
    with host_time.measuring(self.host, first=not self._has_run):
      flat, device_state, record = self._loose(flat_args, self._constants)
    outputs = jax.tree_util.tree_unflatten(self.signature.out_tree, flat)
    return self._finish(outputs, device_state, record)

  def _finish(self, outputs, device_state, record):
    self._has_run = True
    if record is not None:  # one read per run, only with exceptions trapped
      self._raise_trapped(record)
    self.set_device_state(device_state)  # the next run continues from here
    return outputs

  def prepare_arguments(self, values: Sequence[Any]) -> list:
    """Arguments as this program's executor wants them, for a jitted call.

    A program run from its exported executor (the executable cache) gets
    them committed to the default device, so feeding its results back in
    compiles nothing new (``cached_program.committed``); others as given.
    """
    if not self.executable.exported:
      return list(values)
    return cached_program.committed(values)

  def lower_executor(self, flat_args: Sequence[Any]):
    """The executor's ``jax.stages.Lowered`` for these flat arguments and the
    current constants (its XLA program: ``.compile().memory_analysis()``)."""
    args, kwargs = jax.tree_util.tree_unflatten(self.signature.in_tree, list(flat_args))
    return self._function.lower(self._constants, args, kwargs)

  def apply(self, *args_flat):
    """Run the tile program as a traceable function of the flat arguments.

    Use it inside ``jax.jit``, ``jax.vmap`` or ``jax.shard_map`` (replicas run
    the same program this way); ``__call__`` is the jitted form. Being a
    pure function, it reads the device state (the stochastic rounding
    generators) as it is now and does not advance it; use
    :meth:`apply_with_state` to carry it.
    """
    return self.apply_with_state(self.device_state, *args_flat)[0]

  def apply_with_state(self, device_state: Sequence[Any], *args_flat):
    """:meth:`apply` with the device state passed in and returned.

    Args:
      device_state: as :attr:`device_state` gives it.
      *args_flat: the flat arguments.

    Returns:
      ``(outputs, new device state)``; give the latter to
      :meth:`set_device_state` (or the next call) to continue the generators.
    """
    self._check_runnable()
    device_state = list(device_state)
    positions = self.executable.state
    if len(device_state) != len(positions):
      raise ValueError(f"apply_with_state: expected {len(positions)} device state "
                       f"arrays (Lowered.device_state), got {len(device_state)}.")
    constants = list(self._constants)
    for i, value in zip(positions, device_state):
      constants[i] = value
    flat, new_state, record = self.executable.run(list(args_flat), constants)
    if record is not None:
      # Traced: the check runs on the host when the computation does; the
      # runtime error it raises carries the FloatingPointException's message.
      jax.debug.callback(self._raise_trapped, record)
    return jax.tree_util.tree_unflatten(self.signature.out_tree, flat), list(new_state)

  @property
  def device_state(self) -> list:
    """The state the program keeps on the device between runs (the tiles'
    stochastic rounding generators), as tile storage arrays; may be empty."""
    return [self._constants[i] for i in self.executable.state]

  def set_device_state(self, values: Sequence[Any]) -> None:
    """Continue from ``values`` (as :meth:`apply_with_state` returns them)."""
    values = list(values)
    positions = self.executable.state
    if len(values) != len(positions):
      raise ValueError(f"set_device_state: expected {len(positions)} arrays, "
                       f"got {len(values)}.")
    for i, value in zip(positions, values):
      self._constants[i] = value

  def _raise_trapped(self, record):
    error = self.executable.traps.error(record)
    if error is not None:
      raise error

  def set_seed(self, seed: Optional[int] = None) -> None:
    """Reseed the tiles' hardware generators (Poplar's ``setSeed``).

    The generators' state persists between runs of this program, as on the
    chip: each run continues the random streams where the last one ended, so
    two runs round differently. ``set_seed`` restarts them: the next run
    draws the bits the first run after lowering drew with that seed.

    Args:
      seed: an int >= 0; None: ``floating_point_behaviour.seed`` of the
        config this program was lowered with.

    Raises:
      TypeError / ValueError: ``seed`` is not an int >= 0.
    """
    seeding = self.executable.seeding
    if seed is None:
      seed = seeding.default_seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
      raise TypeError(f"set_seed: seed must be an int >= 0 (as "
                      f"floating_point_behaviour.seed); got {seed!r} of type "
                      f"{type(seed).__name__}.")
    if seed < 0:
      raise ValueError(f"set_seed: seed must be an int >= 0 (as "
                       f"floating_point_behaviour.seed); got {seed}.")
    for i, index in zip(seeding.positions, seeding.index):
      value = prng_state_value(seeding.num_tiles, int(seed)).reshape(-1)
      storage = np.where(index >= 0, value[np.maximum(index, 0)], 0).astype(value.dtype)
      self._constants[i] = jax.device_put(storage)


# -- arguments -------------------------------------------------------------------


def avals_bytes(avals) -> int:
  """Bytes of arrays of these avals (a typed PRNG key counted as its key data)."""
  return sum(physical_nbytes(aval) for aval in avals)


def _to_flat(storage, tensor):
  if is_remote(tensor):
    return jnp.reshape(storage, (-1,))
  return to_flat(storage, tensor.mapping)


def _argument_name(path) -> str:
  """``args[0]['w']`` / ``kwargs['x']`` for a path into ``(args, kwargs)``."""
  first, *rest = path
  base = "args" if getattr(first, "idx", 0) == 0 else "kwargs"
  return base + jax.tree_util.keystr(tuple(rest))


def _tree_mismatch(expected, given) -> str:
  (exp_args, exp_kwargs) = jax.tree_util.tree_unflatten(expected, [0] * expected.num_leaves)
  (got_args, got_kwargs) = jax.tree_util.tree_unflatten(given, [0] * given.num_leaves)
  if len(got_args) != len(exp_args):
    what = (f"{len(got_args)} positional arguments where it was lowered for "
            f"{len(exp_args)}")
  elif set(got_kwargs) != set(exp_kwargs):
    what = (f"keyword arguments {sorted(got_kwargs)} where it was lowered for "
            f"{sorted(exp_kwargs)}")
  else:
    what = f"arguments structured as {given} where it was lowered for {expected}"
  return (f"Lowered program called with {what}. Call it with the dynamic arguments given "
          f"to .lower() (static arguments left out), or lower it again for the new ones.")


def _describe_aval(aval) -> str:
  return aval.str_short(short_dtypes=True) if hasattr(aval, "str_short") else str(aval)


def check_arguments(expected_avals: Sequence[Any], values: Sequence[Any],
                    names: Sequence[str]) -> None:
  """Raise ``TypeError`` unless ``values`` have the shapes and dtypes expected.

  Weak types are not compared, as ``jax.stages.Compiled`` does not compare
  them: a Python scalar may stand for a 0-d array of its dtype.
  """
  errors = []
  for aval, value, name in zip(expected_avals, values, names):
    try:
      got = jax.typeof(value)
    except TypeError:
      errors.append(f"{name} is a {type(value).__name__}, not an array: it was lowered as "
                    f"{_describe_aval(aval)}")
      continue
    if tuple(got.shape) != tuple(aval.shape) or got.dtype != aval.dtype:
      errors.append(f"{name} was lowered as {_describe_aval(aval)} and is now "
                    f"{_describe_aval(got)}")
  if errors:
    raise TypeError("Arguments differ from those the program was lowered for:\n  "
                    + "\n  ".join(errors))
