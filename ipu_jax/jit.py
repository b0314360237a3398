"""``ipu_jax.jit``: run a JAX function as a tile program on the emulated IPU.

::

    f = ipu_jax.jit(lambda x, w: jnp.tanh(x @ w), target=IPUTarget.preset("ipu2"))
    y = f(x, w)                      # same numbers as jax.jit
    print(f.lower(x, w).report)      # cycles and memory per tile

The function is traced to a jaxpr, every equation is lowered by its rule
into supersteps, the cost and memory models run (an out-of-memory tile raises
before anything executes) and the program is compiled into one jitted JAX
function. Programs are cached by argument shapes, dtypes and static values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import cached_program
from ipu_jax import compile_progress
from ipu_jax.argument_names import argument_names
from ipu_jax import config as config_lib
from ipu_jax import executable_cache
from ipu_jax import host_time
from ipu_jax import recompilation
from ipu_jax.lowering.analysis import check_memory, profile_program
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.dead_code import eliminate_dead_code
from ipu_jax.lowering.exchange import to_flat, to_storage
from ipu_jax.lowering import fp_exceptions
from ipu_jax.lowering import host_io
from ipu_jax.lowering import host_memory
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.executor import build_function
from ipu_jax.lowering.fp_exceptions import traps_from_options
from ipu_jax.lowering.fusion import fuse_elementwise
from ipu_jax.lowering.jax_compat import physical_nbytes, physical_shape_dtype
from ipu_jax.lowering.lower import is_key_dtype, lower_closed_jaxpr, user_call_site
from ipu_jax.lowering.size_check import check_program_size, offloaded_leaves
from ipu_jax import tracing
from ipu_jax.rounding import apply_floating_point_behaviour
from ipu_jax.rounding import PRNG_STATE, prng_state_value
from ipu_jax.lowering.remote import is_remote
from ipu_jax.kernels.target import PRESETS, IPUTarget

__all__ = ["jit", "IPUFunction", "Lowered"]


# Lowerings whose per-tile cost arrays total at least this many entries hand
# the heap they freed back to the system (small programs free too little to
# be worth it). Measured: the 8-layer width-256 step on four IPUs returns
# 640 MB of its 1,350 MB in 0.07 s; on one IPU it stays below the line.
_TRIM_AFTER_TILE_STEPS = 1 << 22

logger = logging.getLogger(cached_program.LOGGER)


class Lowered:
  """A lowered and compiled program: its tile program, report and function.

  Attributes:
    program: the tile program (control program of supersteps).
    profile: the :class:`~ipu_jax.lowering.profile.ProgramProfile`.
    report: the :class:`ipu_jax.Report` (cycles, memory per tile, ...).
    target: the IPU target.
    jaxpr: the ``ClosedJaxpr`` lowered (dead code removed, rounding applied).
    dead_code: the :class:`~ipu_jax.lowering.dead_code.DeadCode` removed
      before lowering (also ``profile.dead_code`` and the report's).
    host: the :class:`~ipu_jax.host_time.HostTimes` measured on this machine
      (tracing, lowering, cache, compile, calls; the report's "Host side").
  """

  def __init__(self, fn: Callable, args_flat: Sequence, in_tree, name: str,
               target: IPUTarget, options, replication_factor: int = 1,
               arg_names: Sequence[str] = (), progress=None, call_site: str = "",
               offload=None, cache_dir: Optional[str] = None,
               compiled_because: str = "first call", donated: Sequence[int] = ()):
    progress = progress or compile_progress.CompileProgress(name, verbose=0)
    self.host = host_time.HostTimes(compiled_because=compiled_because)
    self._cached_program = None
    self._donated = tuple(donated)
    # Tracing and lowering keep tens of thousands of objects alive and make
    # almost no cyclic garbage: full cycle collections in between only walk
    # them (lowering/host_memory.py).
    with host_memory.cycle_collection_paused():
      self._trace_and_lower(fn, args_flat, in_tree, name, target, options, replication_factor,
                            arg_names, progress, call_site, offload, cache_dir)

  def _trace_and_lower(self, fn, args_flat, in_tree, name, target, options,
                       replication_factor, arg_names, progress, call_site, offload,
                       cache_dir) -> None:
    """Trace ``fn``, then load the program from the executable cache or lower it."""
    with host_time.timer() as traced:
      out_shape = self._trace(fn, args_flat, in_tree, target, options, replication_factor,
                              progress)
    self.host.tracing_seconds = traced[0]
    key = None
    if cache_dir is not None:
      key = self._cache_key(name, arg_names, offload)
      lower_fully = functools.partial(
          Lowered, fn, [_abstract_leaf(a) for a in args_flat],
          in_tree, name, target, options, replication_factor, arg_names,
          call_site=call_site, offload=offload, donated=self._donated)
      if cached_program.load_into(self, cache_dir, key, lower_fully, progress):
        return
    with host_time.timer() as lowering:
      # Plans shared between this program's equations are dropped once it is
      # lowered (the tables would otherwise hold most of a gigabyte at BERT size).
      with plan_cache.lowering_session():
        ctx = self._lower(target, options, arg_names, progress, call_site, offload, name,
                          out_shape)
        self._plan(ctx, name, progress)
    self.host.lowering_seconds = lowering[0]
    if len(self.profile.steps) * target.num_tiles >= _TRIM_AFTER_TILE_STEPS:
      host_memory.release_free_memory()
    if cache_dir is not None:
      cached_program.store_from(self, cache_dir, key, lower_fully)

  def _trace(self, fn, args_flat, in_tree, target, options, replication_factor,
             progress):
    """Trace ``fn`` to ``self.jaxpr`` (dead code removed, rounding applied)."""
    self.target = target
    # ``in_tree`` is the tree of the dynamic (args, kwargs) a caller passes.
    self._user_tree = in_tree
    self.options = options
    self.replication_factor = replication_factor
    def flat_fn(*flat):
      args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
      return fn(*args, **kwargs)

    progress.stage("tracing")
    # Operations that plan while traced (a BlockCSR's buckets) read the target here.
    with tracing.tracing_for(target):
      closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*args_flat)
    # The on-device loop over host data, and which of its stacked outputs
    # go back to the host (outputs.mode; lowering/host_io.py).
    self.host_loop = host_io.find_host_loop(closed)
    closed = host_io.apply_output_mode(closed, self.host_loop, options.output_mode,
                                       options.output_return_period)
    if options.output_mode != "all":
      out_shape = jax.tree_util.tree_unflatten(
          jax.tree_util.tree_structure(out_shape),
          [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.outvars])
    # What no output or effect needs is dropped, as jax.jit's XLA drops it:
    # same inputs and outputs, fewer equations (lowering/dead_code.py).
    closed, self.dead_code = eliminate_dead_code(closed)
    # The chip's rounding (floating_point_behaviour); identity by default.
    closed = apply_floating_point_behaviour(closed, options)
    self.jaxpr = closed
    self.out_tree = jax.tree_util.tree_structure(out_shape)
    self._in_avals = [v.aval for v in closed.jaxpr.invars]
    return out_shape

  def _cache_key(self, name, arg_names, offload) -> str:
    """The executable cache's key of this traced program (executable_cache.py)."""
    # Where reports are saved does not change the program; nor do source
    # lines (an edit above the model would otherwise miss): a loaded report
    # shows the lines of the process that stored it.
    options = dataclasses.replace(self.options, report_directory=None)
    return executable_cache.program_key(
        self.jaxpr, name=name, arg_names=tuple(arg_names),
        in_tree=str(self._user_tree), out_tree=str(self.out_tree), target=self.target,
        options=options, replicas=self.replication_factor, offload=offload,
        **({"donated": self._donated} if self._donated else {}))

  def _host_side(self) -> host_time.HostSide:
    return host_time.HostSide(self.host, _avals_bytes(self._in_avals),
                              _avals_bytes(self._out_avals))

  def __getattr__(self, name):
    # A program loaded from the executable cache lowers when its tile
    # program is asked for (ipu_jax/cached_program.py).
    cached = self.__dict__.get("_cached_program")
    if cached is not None and name in cached_program.TILE_PROGRAM_ATTRIBUTES:
      return getattr(cached.full(), name)
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

  def _lower(self, target, options, arg_names, progress, call_site, offload, name,
             out_shape) -> LoweringContext:
    """Lower every equation of ``self.jaxpr``, offload and fuse: ``self.program``."""
    closed = self.jaxpr
    if not options.allow_out_of_memory:  # a tensor no tiles can hold: refused before planning
      check_program_size(closed, target, arg_names=arg_names, what=f"'{name}'",
                         **offloaded_leaves(offload, out_shape))
    # Collectives cost a ring all-reduce over replication_factor replicas.
    ctx = LoweringContext(target, options, replication_factor=self.replication_factor)
    inputs = []
    for i, aval in enumerate(self._in_avals):
      arg_name = arg_names[i] if i < len(arg_names) else f"arg{i}"
      shape, dtype = physical_shape_dtype(aval)
      tensor = ctx.new_tensor(shape, dtype, name=arg_name, category="variables")
      inputs.append(tensor)
    ctx.donate([inputs[i] for i in self._donated])
    progress.stage("lowering")
    with ctx.at("argument", call_site):
      outputs = lower_closed_jaxpr(ctx, closed, inputs, progress=progress.equations)
    self._out_avals = [v.aval for v in closed.jaxpr.outvars]
    # Detached, so the unfused tree is freed once fusion has rewritten it.
    self.program = ctx.detach_program()
    if offload is not None:  # leaves kept in streaming memory (ipu_jax/offload.py)
      from ipu_jax import offload as offload_lib
      self.program, inputs, outputs = offload_lib.offload_program(
          self.program, inputs, outputs, offload[0], offload_lib.out_paths_of(out_shape),
          offload[1], name)
    if options.fuse_elementwise:
      self.program = fuse_elementwise(self.program, target, keep=outputs)
    self.inputs, self.outputs, self.constants = inputs, outputs, list(ctx.constants)
    # Constants the program updates and the next run starts from (device
    # state, as the tiles' generator registers): their constant indices.
    prng = {id(t) for key, t in ctx.program_states.items() if key[0] == PRNG_STATE}
    self._device_state = [i for i, c in enumerate(self.constants) if id(c) in prng]
    return ctx

  def _plan(self, ctx: LoweringContext, name: str, progress) -> None:
    """Cost and memory analysis, the report, the memory check and the executor."""
    target, options = self.target, self.options
    progress.stage("planning")
    self.profile = profile_program(self.program, target,
                                   persistent=self.inputs + self.constants,
                                   live_to_end=self.outputs, name=name)
    self.profile.dead_code = self.dead_code
    self.profile.host_io = self._host_io()
    self.profile.host_side = self._host_side()
    from ipu_jax.report import Report, maybe_auto_save
    self.report = Report(self.profile)
    if options.report_directory:
      maybe_auto_save(self.report, options.report_directory)
    progress.stage("memory check")
    check_memory(self.profile, allow_out_of_memory=options.allow_out_of_memory,
                 report=self.report, what=f"'{name}'")
    if self.profile.host_io is not None:
      host_io.check_io_memory(self.profile.host_io, target,
                              options.io_available_memory_proportion,
                              options.allow_out_of_memory, what=f"'{name}'")
    self.out_of_memory = bool(self.profile.memory.over_limit_tiles.size)
    progress.stage("building the executor")
    self._function = self._build(ctx)
    self._constant_values = [to_storage(jnp.asarray(c.value).reshape(-1), c.mapping)
                             for c in self.constants]

  def _host_io(self):
    """The host transfers of the program's on-device loop (None: no loop)."""
    loop = self.host_loop
    if loop is None:
      return None
    received = np.zeros(self.target.num_tiles, np.int64)
    for i in loop.input_args:
      mapping = self.inputs[i].mapping
      if mapping is not None and mapping.num_elements:
        np.add.at(received, mapping.tiles, mapping.counts * self.inputs[i].itemsize)
    received = -(-received // max(loop.iterations, 1))
    streamed = {self.inputs[i].id for i in loop.input_args}
    landing = host_io.landing_cycles(self.program, self.profile, streamed)
    return host_io.host_io_profile(
        loop, self.target, self.profile.total_cycles - landing,
        self.options.io_exchange_strategy,
        self.options.output_mode, self.options.output_return_period, received=received)

  def _build(self, ctx):
    tensors = dict(ctx.tensors)
    for t in self.inputs + self.outputs + self.constants:
      tensors[t.id] = t
    keys_in = [t.id for t in self.inputs] + [t.id for t in self.constants]
    keys_out = [t.id for t in self.outputs]
    keys_state = [self.constants[i].id for i in self._device_state]
    # Trapped floating-point exceptions: the record is the last output.
    self._traps = traps_from_options(self.options, self.program, self.profile.name)
    keys_record = [fp_exceptions.RECORD_KEY] if self._traps else []
    inner = build_function(self.program, tensors, keys_in, keys_out + keys_state + keys_record,
                           traps=self._traps, mode=self.options.executor_mode).__wrapped__
    num_out, num_state = len(keys_out), len(keys_state)
    in_avals, out_avals = self._in_avals, self._out_avals
    inputs, outputs = self.inputs, self.outputs

    def run(flat_args, constants):
      storages = []
      for arg, aval, tensor in zip(flat_args, in_avals, inputs):
        if is_key_dtype(aval.dtype):
          arg = jax.random.key_data(arg)
        storages.append(_to_storage(jnp.reshape(arg, (-1,)).astype(tensor.dtype), tensor))
      results = inner(*storages, *constants)
      results, device_state, record = (results[:num_out],
                                       results[num_out:num_out + num_state],
                                       results[num_out + num_state:])
      flat_out = []
      for value, aval, tensor in zip(results, out_avals, outputs):
        value = _to_flat(value, tensor).reshape(tensor.shape[1:] if is_remote(tensor)
                                                else tensor.shape)
        if is_key_dtype(aval.dtype):
          value = jax.random.wrap_key_data(value, impl=aval.dtype._impl)
        flat_out.append(value)
      return flat_out, list(device_state), (record[0] if record else None)

    self._pure = self._live_pure = run
    return jax.jit(run)

  def _check_runnable(self):
    if self.out_of_memory:
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
    with_paths, tree = jax.tree_util.tree_flatten_with_path((args, kwargs))
    if tree != self._user_tree:
      raise TypeError(_tree_mismatch(self._user_tree, tree))
    flat = [leaf for _, leaf in with_paths]
    names = [_argument_name(path) for path, _ in with_paths]
    check_arguments(self._in_avals, flat, names)
    return self.call_flat(flat)

  def call_flat(self, flat_args: Sequence[Any]):
    """Run on already-checked flat arguments (the leaves of the lowering)."""
    self._check_runnable()
    first = not getattr(self, "_has_run", False)
    flat_args = self.prepare_arguments(flat_args)
    with host_time.measuring(self.host, first=first):
      flat, device_state, record = self._function(flat_args, self._constant_values)
    self._has_run = True
    if record is not None:  # one read per run, only with exceptions trapped
      self._raise_trapped(record)
    self.set_device_state(device_state)  # the next run continues from here
    return jax.tree_util.tree_unflatten(self.out_tree, flat)

  def prepare_arguments(self, values: Sequence[Any]) -> list:
    """Arguments as this program's executor wants them, for a jitted call.

    A program run from its exported executor (the executable cache) gets
    them committed to the default device, so feeding its results back in
    compiles nothing new (``cached_program.committed``); others as given.
    """
    if self._cached_program is None:
      return list(values)
    return cached_program.committed(values)

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
    if len(device_state) != len(self._device_state):
      raise ValueError(f"apply_with_state: expected {len(self._device_state)} device state "
                       f"arrays (Lowered.device_state), got {len(device_state)}.")
    constants = list(self._constant_values)
    for i, value in zip(self._device_state, device_state):
      constants[i] = value
    flat, new_state, record = self._pure(list(args_flat), constants)
    if record is not None:
      # Traced: the check runs on the host when the computation does; the
      # runtime error it raises carries the FloatingPointException's message.
      jax.debug.callback(self._raise_trapped, record)
    return jax.tree_util.tree_unflatten(self.out_tree, flat), list(new_state)

  @property
  def device_state(self) -> list:
    """The state the program keeps on the device between runs (the tiles'
    stochastic rounding generators), as tile storage arrays; may be empty."""
    return [self._constant_values[i] for i in self._device_state]

  def set_device_state(self, values: Sequence[Any]) -> None:
    """Continue from ``values`` (as :meth:`apply_with_state` returns them)."""
    values = list(values)
    if len(values) != len(self._device_state):
      raise ValueError(f"set_device_state: expected {len(self._device_state)} arrays, "
                       f"got {len(values)}.")
    for i, value in zip(self._device_state, values):
      self._constant_values[i] = value

  def _raise_trapped(self, record):
    error = self._traps.error(record)
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
    if seed is None:
      seed = self.options.rounding_seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
      raise TypeError(f"set_seed: seed must be an int >= 0 (as "
                      f"floating_point_behaviour.seed); got {seed!r} of type "
                      f"{type(seed).__name__}.")
    if seed < 0:
      raise ValueError(f"set_seed: seed must be an int >= 0 (as "
                       f"floating_point_behaviour.seed); got {seed}.")
    for i in self._device_state:
      tensor = self.constants[i]
      value = prng_state_value(self.target.num_tiles, int(seed))
      self._constant_values[i] = to_storage(jnp.asarray(value).reshape(-1), tensor.mapping)

  @property
  def num_supersteps(self) -> int:
    return len(self.profile.steps)


def _abstract_leaf(x) -> jax.ShapeDtypeStruct:
  """An argument leaf as the shape, dtype and weak type it was traced with."""
  shape, dtype, weak = _cache_aval(x)
  return jax.ShapeDtypeStruct(shape, dtype, weak_type=weak)


def _avals_bytes(avals) -> int:
  """Bytes of arrays of these avals (a typed PRNG key counted as its key data)."""
  return sum(physical_nbytes(aval) for aval in avals)


def _to_storage(flat, tensor):
  """Storage of a program input; a remote buffer's is its rows (host memory)."""
  if is_remote(tensor):
    return jnp.reshape(flat, tensor.storage_shape)
  return to_storage(flat, tensor.mapping)


def _to_flat(storage, tensor):
  if is_remote(tensor):
    return jnp.reshape(storage, (-1,))
  return to_flat(storage, tensor.mapping)


def _cache_aval(x) -> tuple:
  """``(shape, dtype name, weak type)`` of an argument leaf, for the lowering cache.

  A NumPy array and a ``jax.Array`` of one shape and dtype give the same key.
  """
  dtype = getattr(x, "dtype", None)
  if dtype is not None:  # arrays (jax and NumPy), NumPy scalars: no conversions
    return tuple(x.shape), dtype, getattr(x, "weak_type", False)
  return tuple(np.shape(x)), np.dtype(jnp.result_type(x)), False


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


def _bound_replicas():
  """Size of the replica axis when traced under it (vmap/shard_map), else None.

  Part of the cache key: a program lowered under the axis costs its
  collectives for that many replicas.
  """
  try:
    return jax.lax.axis_size("replicas")
  except NameError:
    return None


def _tuple_of(value, kind: type, what: str) -> tuple:
  """``value`` (one ``kind`` or a sequence of them) as a tuple, else TypeError."""
  single = isinstance(value, kind) and not isinstance(value, bool)
  items = (value,) if single else value
  noun = {int: "an int or a sequence of ints", str: "a str or a sequence of str"}[kind]
  try:
    items = tuple(items)
  except TypeError:
    raise TypeError(f"ipu_jax.jit {what} must be {noun}, got {value!r}") from None
  if isinstance(value, str) and kind is not str or any(
      isinstance(i, bool) or not isinstance(i, kind) for i in items):
    raise TypeError(f"ipu_jax.jit {what} must be {noun}, got {value!r}")
  return items


def _positional_parameters(fn):
  """Names of ``fn``'s positional parameters, and whether it takes ``*args``.

  ``None`` when ``fn`` has no inspectable signature (then arguments are
  checked at the call).
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  names, varargs, varkw = [], False, False
  for p in signature.parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      names.append(p.name)
    elif p.kind == p.VAR_POSITIONAL:
      varargs = True
    elif p.kind == p.VAR_KEYWORD:
      varkw = True
  keyword_only = [p.name for p in signature.parameters.values() if p.kind == p.KEYWORD_ONLY]
  return names, varargs, varkw, keyword_only


def _resolve_target(target) -> Optional[IPUTarget]:
  if target is None or isinstance(target, IPUTarget):
    return target
  if isinstance(target, str):
    return IPUTarget.preset(target)  # an unknown name raises, listing the presets
  raise TypeError(f"ipu_jax.jit target must be an ipu_jax.IPUTarget or a preset name "
                  f"(one of {sorted(PRESETS)}), got {type(target).__name__}: {target!r}")


def _copy_metadata(wrapper, fn) -> None:
  """Name ``wrapper`` after ``fn`` without copying ``fn``'s ``__dict__``.

  ``functools.update_wrapper`` would copy the wrapped object's attributes
  (``lower``, ``trace``, ... of ``jax.jit``/``nnx.jit``/``jax.pmap``
  functions), which would shadow this object's own methods.
  """
  inner = fn.func if isinstance(fn, functools.partial) else fn
  for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
    value = getattr(inner, attr, None)
    if isinstance(value, str):
      setattr(wrapper, attr, value)
  if not isinstance(getattr(inner, "__name__", None), str):
    wrapper.__name__ = type(inner).__name__
  wrapper.__wrapped__ = fn


class IPUFunction:
  """The callable :func:`jit` returns."""

  def __init__(self, fn: Callable, target: Optional[IPUTarget], config,
               static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
               donate_argnums: Sequence[int] = (), donate_argnames: Sequence[str] = (),
               positional_names: Optional[Sequence[str]] = None,
               verbose: Optional[int] = None, offload_argnums: Sequence[int] = (),
               offload_outputs: Sequence[int] = ()):
    self.fn = fn
    self.offload_argnums = tuple(offload_argnums)
    self.offload_outputs = tuple(offload_outputs)
    self.verbose = verbose
    # Names of fn's positional parameters when its signature is known: a
    # static position not passed positionally may come by keyword or default.
    self._positional_names = positional_names
    self._target = target
    self._config = config
    self.static_argnums = tuple(sorted(set(static_argnums)))
    self.static_argnames = tuple(static_argnames)
    self.donate_argnums = tuple(donate_argnums)
    self.donate_argnames = tuple(donate_argnames)
    self._cache = {}
    _copy_metadata(self, fn)

  def __get__(self, instance, owner=None):
    # Decorating a method binds ``self`` like a plain function would.
    if instance is None:
      return self
    return functools.partial(self, instance)

  def _settings(self):
    config = self._config if self._config is not None else config_lib.get_default_config()
    target = self._target if self._target is not None else config.to_target()
    return target, config.lowering_options(), config.replication_factor

  def _cache_directory(self) -> Optional[str]:
    """The executable cache's directory (checked writable), or None; see executable_cache.py."""
    config = self._config if self._config is not None else config_lib.get_default_config()
    directory = executable_cache.cache_directory(config.executable_cache_dir)
    if directory is not None:
      executable_cache.enable_compilation_cache(directory)
    return directory

  def _split(self, args, kwargs):
    """Static values, dynamic (args, kwargs), and ``fn`` of the dynamic ones."""
    num_args = len(args)
    static_nums = set()
    for i in self.static_argnums:
      j = i + num_args if i < 0 else i
      if self._positional_names is not None and num_args <= j < len(self._positional_names):
        continue  # passed by keyword (static by name) or left at its default
      if not 0 <= j < num_args:
        raise ValueError(
            f"jitted function '{self.__name__}' has static_argnums={self.static_argnums}, "
            f"but was called with only {num_args} positional arguments.")
      static_nums.add(j)
    static_names = [k for k in self.static_argnames if k in kwargs]
    static = []
    for key in sorted(static_nums) + static_names:
      value = args[key] if isinstance(key, int) else kwargs[key]
      try:
        hash(value)
      except TypeError:
        where = f"argument {key}" if isinstance(key, int) else f"argument '{key}'"
        raise ValueError(
            f"Non-hashable static {where} of '{self.__name__}': {type(value).__name__} "
            f"{value!r}. Static arguments must be hashable (use a tuple for a list), "
            f"or pass it as a dynamic (array) argument.") from None
      static.append((key, type(value), value))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_nums)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
    static_kwargs = {k: kwargs[k] for k in static_names}

    def call(*dyn, **dyn_kw):
      it = iter(dyn)
      full = [args[i] if i in static_nums else next(it) for i in range(num_args)]
      return self.fn(*full, **dyn_kw, **static_kwargs)

    return tuple(static), (dyn_args, dyn_kwargs), call

  def lower(self, *args, **kwargs) -> Lowered:
    """Lower (or fetch from the cache) the program for these arguments.

    Raises:
      TypeError: an argument is a Flax NNX module or optimizer, whose in-place
        updates this function could not write back (use ``ipu_jax.nnx_jit``).
    """
    return self._lower(args, kwargs)[0]

  def _lower(self, args, kwargs):
    """:meth:`lower`, and the flat dynamic arguments (one flattening for a call)."""
    from ipu_jax.nnx_jit import reject_graph_nodes  # nnx_jit builds on this module
    reject_graph_nodes(tuple(args) + tuple(kwargs.values()), self.__name__)
    target, options, replicas = self._settings()
    static, dynamic, call = self._split(args, kwargs)
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path(dynamic)
    flat = [leaf for _, leaf in with_paths]
    avals = tuple(_cache_aval(x) for x in flat)
    offload = None
    if self.offload_argnums or self.offload_outputs:
      from ipu_jax import offload as offload_lib
      num_args = len(args)
      static_positions = {key for key, _, _ in static if isinstance(key, int)}
      dyn_positions = [i for i in range(num_args) if i not in static_positions]
      argnums = tuple(i % num_args if num_args else i for i in self.offload_argnums)
      offload = (tuple(offload_lib.offloaded_input_leaves(with_paths, argnums, dyn_positions)),
                 self.offload_outputs)
    donated = self._donated_leaves(with_paths, len(args), static)
    key = recompilation.CacheKey(in_tree, avals, static, target, options, replicas,
                                 _bound_replicas(), offload)
    lowered = self._cache.get(key)
    if lowered is None:
      cache_dir = self._cache_directory()  # checked before anything is lowered
      # Arguments are named by their pytree path: "params/Dense_0/kernel".
      arg_names = argument_names([path for path, _ in with_paths],
                                 self._dynamic_parameter_names(len(args), static))
      because = "first call"
      if self._cache:
        because = recompilation.reason(next(reversed(self._cache)), key, arg_names)
        logger.info("recompiling '%s' (%d programs so far): %s",
                    self.__name__, len(self._cache), because)
      with self._progress() as progress:
        lowered = Lowered(call, flat, in_tree, self.__name__, target, options,
                          call_site=user_call_site(),
                          replication_factor=replicas, arg_names=arg_names,
                          progress=progress, offload=offload, cache_dir=cache_dir,
                          compiled_because=because, donated=donated)
      self._cache[key] = lowered
    return lowered, flat

  def _donated_leaves(self, with_paths, num_args: int, static) -> tuple:
    """Flat indices of the leaves of the donated positional arguments."""
    if not self.donate_argnums:
      return ()
    from ipu_jax import offload as offload_lib  # the same leaf numbering
    static_positions = {key for key, _, _ in static if isinstance(key, int)}
    dyn_positions = [i for i in range(num_args) if i not in static_positions]
    argnums = tuple(i % num_args if num_args else i for i in self.donate_argnums)
    return tuple(i for i, _ in offload_lib.offloaded_input_leaves(with_paths, argnums,
                                                                  dyn_positions))

  def _dynamic_parameter_names(self, num_args: int, static) -> list:
    """The parameter name of each dynamic positional argument (None where unknown)."""
    names = self._positional_names or ()
    static_positions = {key for key, _, _ in static if isinstance(key, int)}
    return [names[i] if i < len(names) else None
            for i in range(num_args) if i not in static_positions]

  def __call__(self, *args, **kwargs):
    lowered, flat = self._lower(args, kwargs)
    if getattr(lowered, "_has_run", False):
      return lowered.call_flat(flat)
    with self._progress() as progress:
      progress.stage("compiling (XLA)")
      result = lowered.call_flat(flat)
    lowered._has_run = True
    return result

  def _progress(self) -> compile_progress.CompileProgress:
    """The progress display of a compile (shown only when it is slow)."""
    verbose = self.verbose
    config = self._config if self._config is not None else config_lib.get_default_config()
    if verbose is None and not config.report.progress:
      verbose = 0
    return compile_progress.CompileProgress(self.__name__, verbose=verbose)

  @property
  def cache_size(self) -> int:
    return len(self._cache)

  def set_seed(self, seed: Optional[int] = None) -> None:
    """:meth:`Lowered.set_seed` on every program compiled so far."""
    for lowered in self._cache.values():
      lowered.set_seed(seed)


@dataclasses.dataclass(frozen=True)
class _ArgumentOptions:
  """:func:`jit`'s argument options, checked and as tuples.

  ``positional_names`` is set once they are checked against ``fn``'s
  signature (when it is known and takes no ``*args``).
  """

  static_argnums: tuple
  static_argnames: tuple
  donate_argnums: tuple
  donate_argnames: tuple
  offload_argnums: tuple
  offload_outputs: tuple
  positional_names: Optional[tuple] = None


def _argument_options(static_argnums, static_argnames, donate_argnums, donate_argnames,
                      offload_argnums, offload_outputs) -> _ArgumentOptions:
  """The options as tuples (TypeError for a wrong type, ValueError for a
  negative ``offload_outputs``)."""
  static_argnums = _tuple_of(static_argnums, int, "static_argnums")
  donate_argnums = _tuple_of(donate_argnums, int, "donate_argnums")
  static_argnames = _tuple_of(static_argnames, str, "static_argnames")
  donate_argnames = _tuple_of(donate_argnames, str, "donate_argnames")
  offload_argnums = _tuple_of(offload_argnums, int, "offload_argnums")
  offload_outputs = _tuple_of(offload_outputs, int, "offload_outputs")
  bad = [i for i in offload_outputs if i < 0]
  if bad:
    raise ValueError(f"ipu_jax.jit: offload_outputs={offload_outputs} must be >= 0 "
                     "(elements of the returned tuple).")
  return _ArgumentOptions(static_argnums, static_argnames, donate_argnums, donate_argnames,
                          offload_argnums, offload_outputs)


def _check_config(config) -> None:
  if config is not None and not isinstance(config, config_lib.IPUConfig):
    raise TypeError(f"ipu_jax.jit config must be an ipu_jax.IPUConfig, got "
                    f"{type(config).__name__}: {config!r}")


def _check_positions(fn, names, options: _ArgumentOptions) -> None:
  """ValueError for an argument index ``fn`` (taking ``names``, no ``*args``) lacks."""
  for what, nums in (("static_argnums", options.static_argnums),
                     ("donate_argnums", options.donate_argnums),
                     ("offload_argnums", options.offload_argnums)):
    bad = [i for i in nums if not -len(names) <= i < len(names)]
    if bad:
      raise ValueError(
          f"ipu_jax.jit: {what}={nums} but '{getattr(fn, '__name__', fn)}' takes "
          f"{len(names)} positional arguments ({', '.join(names) or 'none'}).")


def _check_names(fn, known, options: _ArgumentOptions) -> None:
  """ValueError for an argument name not among ``known`` (``fn`` takes no ``**kwargs``)."""
  for what, given in (("static_argnames", options.static_argnames),
                      ("donate_argnames", options.donate_argnames)):
    bad = [n for n in given if n not in known]
    if bad:
      raise ValueError(
          f"ipu_jax.jit: {what} {bad} are not parameters of "
          f"'{getattr(fn, '__name__', fn)}' (its parameters: {sorted(known)}).")


def _against_signature(fn, options: _ArgumentOptions) -> _ArgumentOptions:
  """``options`` checked against ``fn``'s signature (when it has one).

  Static by position means static by name too, and the other way round.
  """
  params = _positional_parameters(fn)
  if params is None:
    return options
  names, varargs, varkw, keyword_only = params
  if not varargs:
    _check_positions(fn, names, options)
    static_argnames = tuple(dict.fromkeys(
        options.static_argnames + tuple(names[i] for i in options.static_argnums)))
    static_argnums = tuple(sorted(set(
        tuple(i % len(names) for i in options.static_argnums)
        + tuple(names.index(n) for n in static_argnames if n in names))))
    options = dataclasses.replace(options, positional_names=tuple(names),
                                  static_argnums=static_argnums,
                                  static_argnames=static_argnames)
  if not varkw:
    _check_names(fn, set(names) | set(keyword_only), options)
  return options


def _check_overlap(options: _ArgumentOptions) -> None:
  overlap = sorted(set(options.offload_argnums) & set(options.static_argnums))
  if overlap:
    raise ValueError(f"ipu_jax.jit: arguments {overlap} are both static and offloaded; "
                     "a static argument is a compile-time constant with no memory.")


def jit(fn: Callable = None, *, target=None, config=None,
        static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = (),
        verbose: Optional[int] = None, offload_argnums: int | Sequence[int] = (),
        offload_outputs: int | Sequence[int] = ()):
  """Compile ``fn`` into a tile program for the emulated IPU.

  Args:
    fn: a JAX-traceable callable (a function, ``functools.partial``, bound
      method, callable object, or another transform's result such as
      ``jax.jit(f)``); pytrees in, pytrees out.
    target: an :class:`IPUTarget` or a preset name (``"ipu2"``); default: the
      config's (``ipu2``).
    config: an :class:`ipu_jax.IPUConfig`; default: the active strategy
      scope's, or a default config.
    static_argnums: positional arguments treated as compile-time constants
      (hashable); an int or a sequence of ints, negative counting from the end.
    static_argnames: keyword arguments treated as compile-time constants.
    donate_argnums: checked like ``jax.jit``'s; a donated positional
      argument that nothing reads after an elementwise operation with its
      shape, dtype and layout holds that operation's result in its own memory
      (an in-place update, as a Poplar variable ``x += g``), so the memory
      figures count one copy, not two (docs/cost_model.md#the-memory-model).
    donate_argnames: checked like ``jax.jit``'s and otherwise without effect.
    verbose: 0 never shows compile progress; 1 shows it when tracing,
      lowering, planning and compiling take over 2 s; None (default) follows
      ``config.report.progress`` and :func:`ipu_jax.compile_progress.verbosity`.
    offload_argnums: positional arguments whose leaves live in streaming
      memory (e.g. optimizer state), streamed onto the tiles where they are
      used (see ``ipu_jax/offload.py``).
    offload_outputs: elements of the returned tuple written back to streaming
      memory; the k-th pairs with the k-th of ``offload_argnums`` (same buffers,
      an in-place update).

  Returns:
    An :class:`IPUFunction`: call it like ``fn``; ``.lower(*args)`` gives the
    :class:`Lowered` program with its ``.report``.

  Raises:
    TypeError: ``fn`` is not callable, or an argument has the wrong type.
    ValueError: a static or donated argument index or name ``fn`` does not
      have, or an unknown target preset.

  Example:

  >>> import jax.numpy as jnp, ipu_jax
  >>> f = ipu_jax.jit(lambda x, n: x * n, target="ipu2", static_argnums=1)
  >>> f(jnp.arange(3.0), 2)
  Array([0., 2., 4.], dtype=float32)
  """
  options = _argument_options(static_argnums, static_argnames, donate_argnums,
                              donate_argnames, offload_argnums, offload_outputs)
  target = _resolve_target(target)
  _check_config(config)
  if fn is None:
    return functools.partial(jit, target=target, config=config,
                             static_argnums=options.static_argnums,
                             static_argnames=options.static_argnames,
                             donate_argnums=options.donate_argnums,
                             donate_argnames=options.donate_argnames,
                             verbose=verbose, offload_argnums=options.offload_argnums,
                             offload_outputs=options.offload_outputs)
  if not callable(fn):
    raise TypeError(f"ipu_jax.jit expects a callable, got {type(fn).__name__}: {fn!r}")
  options = _against_signature(fn, options)
  _check_overlap(options)
  return IPUFunction(fn, target, config, options.static_argnums, options.static_argnames,
                     options.donate_argnums, options.donate_argnames,
                     options.positional_names, verbose, options.offload_argnums,
                     options.offload_outputs)
