"""The stages of an ``ipu_jax.jit`` compile: Traced -> Lowered -> Compiled.

As ``jax.stages`` has them, each stage is a small value made by the one
before it:

>>> import jax.numpy as jnp, ipu_jax
>>> f = ipu_jax.jit(lambda x, w: x @ w, target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16))
>>> x, w = jnp.ones((8, 4)), jnp.full((4, 2), 0.5)
>>> traced = f.trace(x, w)        # Traced: the jaxpr, avals, trees
>>> lowered = traced.lower()      # Lowered: tile program, profile, report
>>> compiled = lowered.compile()  # Compiled: the executor and its device state
>>> compiled(x, w)[0]
Array([2., 2.], dtype=float32)
>>> lowered.report.total_cycles > 0
True

* :class:`Traced` holds the closed jaxpr (dead code removed, the chip's
  rounding applied), the argument and result avals and trees, the host loop
  and the dead-code record. Immutable.
* :class:`Lowered` holds what lowering produced: the tile program
  (:class:`TileProgram`; None when it came from the executable cache), its
  profile and report (memory checked before it exists), and the
  :class:`Executable` to compile. Immutable. For the users of
  ``f.lower(...)`` it is also callable and carries the run-time methods
  (``lowered(*args)``, ``device_state``, ``set_seed``, ``apply`` ...): they
  go to the :class:`Compiled` its :meth:`Lowered.compile` makes on first use
  and keeps (one per ``Lowered``).
* :class:`Compiled` runs the program: its jitted executor, the constants'
  tile storages with the device state among them (the stochastic rounding
  generators, which each run advances), and the seed.

The Poplar-like ``graph.Engine`` builds a :class:`Lowered` of each of its
programs with :meth:`Lowered.from_program` and runs it through its
:class:`Compiled` too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import cached_program
from ipu_jax.compiled import (Compiled, Executable, Seeding, Signature, avals_bytes,
                              build_executable)
from ipu_jax import compile_progress
from ipu_jax import executable_cache
from ipu_jax import host_time
from ipu_jax import tracing
from ipu_jax.tracer_probes import cheap_tracer_probes
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering import host_io
from ipu_jax.lowering import host_memory
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering import program as P
from ipu_jax.lowering.analysis import check_memory, profile_program
from ipu_jax.lowering.constant_folding import fold_constants
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.dead_code import eliminate_dead_code
from ipu_jax.lowering.exchange import host_storage, to_storage
from ipu_jax.lowering.replica_axis import bound_axes
from ipu_jax.lowering.fp_exceptions import traps_from_options
from ipu_jax.lowering.fusion import fuse_elementwise
from ipu_jax.lowering.jax_compat import physical_shape_dtype
from ipu_jax.lowering.lower import lower_closed_jaxpr
from ipu_jax.lowering.size_check import check_program_size, offloaded_leaves
from ipu_jax.rounding import apply_floating_point_behaviour
from ipu_jax.lowering.tile_generators import PRNG_STATE

__all__ = ["Lowered", "Setup", "TileProgram", "Traced"]

# Programs whose per-tile cost arrays total at least this many entries hand
# the heap their lowering freed back to the system when they are compiled
# (small programs free too little to be worth it). Measured: the 8-layer
# width-256 step on four IPUs returns 640 MB of its 1,350 MB in 0.07 s; on one
# IPU it stays below the line. Not after lowering: a search or an estimate
# lowers program after program and never compiles, and every lowering after a
# trim faulted those pages in again (140k-210k page faults, 0.3-0.4 CPU s a
# lowering of the four-IPU step, more than the trim saved).
_TRIM_AT_TILE_STEPS = 1 << 22


# -- Traced --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
  """How a traced function is lowered (fixed by its ``ipu_jax.jit``).

  Attributes:
    name: the program's name (reports, errors).
    target: the IPU target.
    options: the ``LoweringOptions``.
    replication_factor: replicas its collectives are costed for.
    arg_names: the flat arguments' names (pytree paths).
    call_site: the user's ``file:line`` the arguments are attributed to.
    offload: ``(offloaded input leaves, offloaded outputs)`` or None
      (``ipu_jax/offload.py``).
    donated: flat indices of donated argument leaves.
  """

  name: str
  target: IPUTarget
  options: Any
  replication_factor: int = 1
  arg_names: tuple = ()
  call_site: str = ""
  offload: Optional[tuple] = None
  donated: tuple = ()


@dataclasses.dataclass(frozen=True)
class Traced:
  """A function traced for the IPU: :meth:`lower` makes the :class:`Lowered`.

  Attributes:
    jaxpr: the ``ClosedJaxpr`` to lower (dead code removed, rounding applied).
    signature: the flat avals and the argument and result trees.
    setup: how it is lowered (target, options, names ...).
    out_shape: the result pytree of ``ShapeDtypeStruct``.
    host_loop: the on-device loop over host data (``lowering/host_io.py``)
      or None.
    dead_code: the :class:`~ipu_jax.lowering.dead_code.DeadCode` removed.
    host: the :class:`~ipu_jax.host_time.HostTimes` of this compile.
  """

  jaxpr: Any
  signature: Signature
  setup: Setup
  out_shape: Any
  host_loop: Any
  dead_code: Any
  host: host_time.HostTimes

  @classmethod
  def trace(cls, fn: Callable, args_flat: Sequence, in_tree, setup: Setup,
            progress=None, host: Optional[host_time.HostTimes] = None) -> "Traced":
    """Trace ``fn`` (called as ``fn(*args, **kwargs)`` of ``in_tree``'s leaves)."""
    progress = progress or compile_progress.CompileProgress(setup.name, verbose=0)
    host = host or host_time.HostTimes()
    options = setup.options

    def flat_fn(*flat):
      args, kwargs = jax.tree_util.tree_unflatten(in_tree, flat)
      return fn(*args, **kwargs)

    with host_time.timer() as traced:
      progress.stage("tracing")
      # Operations that plan while traced (a BlockCSR's buckets) read the target here.
      # Flax NNX probes each assigned value's sharding: cheap_tracer_probes
      # keeps that linear in the model's size (ipu_jax/tracer_probes.py).
      with tracing.tracing_for(setup.target), cheap_tracer_probes():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*args_flat)
      # The on-device loop over host data, and which of its stacked outputs
      # go back to the host (outputs.mode; lowering/host_io.py).
      host_loop = host_io.find_host_loop(closed)
      closed = host_io.apply_output_mode(closed, host_loop, options.output_mode,
                                         options.output_return_period)
      if options.output_mode != "all":
        out_shape = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(out_shape),
            [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.outvars])
      # What no output or effect needs is dropped, as jax.jit's XLA drops it:
      # same inputs and outputs, fewer equations (lowering/dead_code.py).
      closed, dead_code = eliminate_dead_code(closed)
      # The chip's rounding (floating_point_behaviour); identity by default.
      closed = apply_floating_point_behaviour(closed, options)
    host.tracing_seconds = traced[0]
    signature = Signature(tuple(v.aval for v in closed.jaxpr.invars),
                          tuple(v.aval for v in closed.jaxpr.outvars), in_tree,
                          jax.tree_util.tree_structure(out_shape))
    return cls(closed, signature, setup, out_shape, host_loop, dead_code, host)

  def cache_key(self) -> str:
    """The executable cache's key of this traced program (executable_cache.py)."""
    setup = self.setup
    # Where reports are saved does not change the program; nor do source
    # lines (an edit above the model would otherwise miss): a loaded report
    # shows the lines of the process that stored it.
    options = dataclasses.replace(setup.options, report_directory=None)
    return executable_cache.program_key(
        self.jaxpr, name=setup.name, arg_names=tuple(setup.arg_names),
        in_tree=str(self.signature.in_tree), out_tree=str(self.signature.out_tree),
        target=setup.target, options=options, replicas=setup.replication_factor,
        offload=setup.offload, axes=bound_axes(),
        **({"donated": setup.donated} if setup.donated else {}))

  def lower(self, progress=None, cache_dir: Optional[str] = None) -> "Lowered":
    """Lower (or load from the executable cache in ``cache_dir``) this program.

    Raises:
      OutOfMemoryError: a tile is over its SRAM (unless allowed), before
        anything runs.
    """
    progress = progress or compile_progress.CompileProgress(self.setup.name, verbose=0)
    # Tracing and lowering keep tens of thousands of objects alive and make
    # almost no cyclic garbage: full cycle collections in between only walk
    # them (lowering/host_memory.py).
    with host_memory.cycle_collection_paused():
      key = None
      if cache_dir is not None:
        key = self.cache_key()
        hit = Lowered.from_cache(self, cache_dir, key, progress)
        if hit is not None:
          return hit
      with host_time.timer() as lowering:
        # Plans shared between this program's equations are dropped once it is
        # lowered (the tables would otherwise hold most of a gigabyte at BERT size).
        with plan_cache.lowering_session():
          lowered = _lower_traced(self, progress)
      self.host.lowering_seconds = lowering[0]
      if cache_dir is not None:
        lowered = lowered.stored(cache_dir, key)
      return lowered


# -- what lowering produces ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileProgram:
  """What lowering a jaxpr produced.

  Attributes:
    program: the control program of supersteps.
    inputs: the tensors of the flat arguments, in order.
    outputs: the tensors of the flat results, in order.
    constants: the program's constant tensors (their values start each run).
    proportions_read: the memory proportions (``LoweringOptions`` fields such
      as ``"available_memory_proportion"``) its matmul, convolution and sparse
      plans read; a program that read none is the same under any of them.
  """

  program: P.Program
  inputs: tuple
  outputs: tuple
  constants: tuple
  proportions_read: frozenset = frozenset()


def _check_and_report(program, target: IPUTarget, *, name: str, what: str,
                      persistent=(), live_to_end=(), allow_out_of_memory=False,
                      annotate: Optional[Callable] = None, report_directory=None,
                      progress=None):
  """The profile and report of ``program``, its memory checked: ``(profile, report)``.

  ``annotate(profile)`` adds what the report shows beyond the program's own
  figures before the report is made.
  """
  from ipu_jax.report import Report, maybe_auto_save  # the report reads these stages
  profile = profile_program(program, target, persistent=persistent,
                            live_to_end=live_to_end, name=name)
  if annotate is not None:
    annotate(profile)
  report = Report(profile)
  if report_directory:
    maybe_auto_save(report, report_directory)
  if progress is not None:
    progress.stage("memory check")
  check_memory(profile, allow_out_of_memory=allow_out_of_memory, report=report, what=what)
  return profile, report


# -- Lowered -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Lowered:
  """A lowered program: its tile program, profile and report; :meth:`compile` runs it.

  ``f.lower(*args)`` gives one. It is immutable; the run-time surface
  (calling it, ``device_state``, ``set_device_state``, ``set_seed``,
  ``apply``, ``apply_with_state``, ``call_flat``, ``prepare_arguments``)
  goes to the :class:`Compiled` that :meth:`compile` makes on first use and
  keeps, so calling ``lowered(*args)`` twice continues one device state.

  A program loaded from the executable cache has its profile and report
  (stored with it) and its executor, but no tile program: ``tile`` (and
  ``program``, ``inputs``, ``outputs``, ``constants``) is None;
  :meth:`lower_uncached` lowers it.

  Attributes:
    traced: the :class:`Traced` it was lowered from (None for a graph
      engine's program).
    tile: the :class:`TileProgram`, or None (loaded from the cache).
    profile: the :class:`~ipu_jax.lowering.profile.ProgramProfile`.
    report: the :class:`ipu_jax.Report` (cycles, memory per tile, ...).
    executable: the :class:`Executable` :meth:`compile` compiles.
  """

  traced: Optional[Traced]
  tile: Optional[TileProgram]
  profile: Any
  report: Any
  executable: Executable
  _compiled: Optional["Compiled"] = dataclasses.field(default=None, init=False, repr=False)

  # -- construction --

  @classmethod
  def from_program(cls, program, target: IPUTarget, *, name: str, tensors: dict,
                   state: Sequence[tuple], persistent=(), allow_out_of_memory=False) -> "Lowered":
    """A program of tensors kept on the device, lowered (a graph engine's).

    It takes no arguments and returns nothing: every ``(key, value)`` of
    ``state`` is device state (tensor ids, stream keys), passed through
    :meth:`Compiled.set_device_state` before a run and read back after it.

    Raises:
      OutOfMemoryError: a tile is over its SRAM, unless allowed.
    """
    profile, report = _check_and_report(program, target, name=name, what=name,
                                        persistent=persistent,
                                        allow_out_of_memory=allow_out_of_memory)
    keys = [key for key, _ in state]
    out_of_memory = bool(profile.memory.over_limit_tiles.size)
    executable = build_executable(
        program, tensors, Signature.empty(), inputs=(), outputs=(), constant_keys=keys,
        constants=[value for _, value in state], state=tuple(range(len(keys))),
        traps=None, mode="batched", out_of_memory=out_of_memory)
    return cls(None, TileProgram(program, (), (), ()), profile, report, executable)

  @classmethod
  def from_cache(cls, traced: Traced, cache_dir: str, key: str,
                 progress=None) -> Optional["Lowered"]:
    """``traced``'s program loaded from the executable cache; None when it is not there."""
    loaded = cached_program.load(cache_dir, key, traced.signature, progress)
    if loaded is None:
      return None
    entry, seconds = loaded
    lowered = cls.from_cache_entry(traced, entry)
    traced.host.cache, traced.host.cache_seconds = "hit", seconds
    cached_program.announce_hit(progress, lowered.profile.name, key, seconds)
    return lowered

  @classmethod
  def from_cache_entry(cls, traced: Traced, entry: dict) -> "Lowered":
    """A ``Lowered`` of ``traced`` from an executable cache entry (no tile program)."""
    program = cached_program.CachedProgram(
        entry["exported"], lower_live=lambda: traced_uncached(traced).executable.run)
    seeding = Seeding(traced.setup.options.rounding_seed, traced.setup.target.num_tiles,
                      tuple(entry["device_state"]),
                      tuple(np.asarray(i) for i in entry["state_index"]))
    executable = Executable(program, tuple(cached_program.committed(entry["constants"])),
                            tuple(entry["device_state"]), seeding, entry["traps"],
                            exported=True, out_of_memory=entry["out_of_memory"])
    profile = entry["profile"]
    profile.host_side = _host_side(traced.host, entry["in_avals"], entry["out_avals"])
    from ipu_jax.report import Report, maybe_auto_save  # the report reads these stages
    report = Report(profile)
    if traced.setup.options.report_directory:
      maybe_auto_save(report, traced.setup.options.report_directory)
    return cls(traced, None, profile, report, executable)

  def stored(self, cache_dir: str, key: str) -> "Lowered":
    """This program written to the executable cache; the result runs its export.

    Running the exported form here too makes this process compile the same
    HLO a later process will, so XLA's persistent cache serves that one. A
    program that cannot be stored (host callbacks ...) is returned as it is.
    """
    program = cached_program.store(self, cache_dir, key)
    if program is None:
      return self
    executable = dataclasses.replace(
        self.executable, run=program, exported=True,
        constants=tuple(cached_program.committed(self.executable.constants)))
    return Lowered(self.traced, self.tile, self.profile, self.report, executable)

  def lower_uncached(self) -> "Lowered":
    """This program lowered again from its trace, without the cache (with its tile program)."""
    if self.tile is not None or self.traced is None:
      return self
    return traced_uncached(self.traced)

  # -- compile --

  def compile(self) -> "Compiled":
    """The :class:`Compiled` program (made on first call, then the same one)."""
    if self._compiled is None:
      if len(self.profile.steps) * self.target.num_tiles >= _TRIM_AT_TILE_STEPS:
        # The compiled step's large buffers cannot reuse the small blocks the
        # lowering freed; handed back, they do not count twice.
        host_memory.release_free_memory()
      host = self.traced.host if self.traced is not None else host_time.HostTimes()
      object.__setattr__(self, "_compiled", Compiled(self.executable, self.signature, host))
    return self._compiled

  # -- what the stages before hold --

  @property
  def signature(self) -> Signature:
    return self.traced.signature if self.traced is not None else Signature.empty()

  @property
  def jaxpr(self):
    """The ``ClosedJaxpr`` lowered (dead code removed, rounding applied)."""
    return self.traced.jaxpr if self.traced is not None else None

  @property
  def dead_code(self):
    """The :class:`~ipu_jax.lowering.dead_code.DeadCode` removed before lowering."""
    return self.profile.dead_code

  @property
  def host_loop(self):
    return self.traced.host_loop if self.traced is not None else None

  @property
  def host(self) -> Optional[host_time.HostTimes]:
    """The :class:`~ipu_jax.host_time.HostTimes` measured on this machine."""
    return self.traced.host if self.traced is not None else self.compile().host

  @property
  def target(self) -> IPUTarget:
    return self.profile.target if self.traced is None else self.traced.setup.target

  @property
  def options(self):
    return self.traced.setup.options if self.traced is not None else None

  @property
  def replication_factor(self) -> int:
    return self.traced.setup.replication_factor if self.traced is not None else 1

  @property
  def out_tree(self):
    return self.signature.out_tree

  @property
  def program(self):
    """The tile program (None when loaded from the cache: see :meth:`lower_uncached`)."""
    return self.tile.program if self.tile is not None else None

  @property
  def inputs(self):
    return self.tile.inputs if self.tile is not None else None

  @property
  def outputs(self):
    return self.tile.outputs if self.tile is not None else None

  @property
  def constants(self):
    return self.tile.constants if self.tile is not None else None

  @property
  def out_of_memory(self) -> bool:
    return self.executable.out_of_memory

  @property
  def num_supersteps(self) -> int:
    return len(self.profile.steps)

  # -- the run-time surface, on the Compiled --

  def __call__(self, *args, **kwargs):
    """:meth:`Compiled.__call__` of :meth:`compile`."""
    return self.compile()(*args, **kwargs)

  def call_flat(self, flat_args: Sequence[Any]):
    return self.compile().call_flat(flat_args)

  def prepare_arguments(self, values: Sequence[Any]) -> list:
    return self.compile().prepare_arguments(values)

  def apply(self, *args_flat):
    return self.compile().apply(*args_flat)

  def apply_with_state(self, device_state: Sequence[Any], *args_flat):
    return self.compile().apply_with_state(device_state, *args_flat)

  @property
  def device_state(self) -> list:
    return self.compile().device_state

  def set_device_state(self, values: Sequence[Any]) -> None:
    self.compile().set_device_state(values)

  def set_seed(self, seed: Optional[int] = None) -> None:
    self.compile().set_seed(seed)


def traced_uncached(traced: Traced) -> Lowered:
  """``traced`` lowered without the cache, timed apart from its own compile."""
  fresh = dataclasses.replace(traced, host=host_time.HostTimes(
      compiled_because=traced.host.compiled_because))
  return fresh.lower(cache_dir=None)


# -- lowering a trace ------------------------------------------------------------


def _lower_traced(traced: Traced, progress) -> Lowered:
  """Lower ``traced``'s equations, then profile, report, check and build its executor."""
  tile, ctx, folded = _lower_to_tiles(traced, progress)
  setup, options = traced.setup, traced.setup.options
  progress.stage("planning")

  def annotate(profile):
    profile.dead_code = traced.dead_code
    profile.constant_folding = folded.as_dict()
    profile.host_io = _host_io(traced, tile, profile)
    profile.host_side = _host_side(traced.host, traced.signature.in_avals,
                                   traced.signature.out_avals)

  profile, report = _check_and_report(
      tile.program, setup.target, name=setup.name, what=f"'{setup.name}'",
      persistent=list(tile.inputs) + list(tile.constants), live_to_end=list(tile.outputs),
      allow_out_of_memory=options.allow_out_of_memory, annotate=annotate,
      report_directory=options.report_directory, progress=progress)
  if profile.host_io is not None:
    host_io.check_io_memory(profile.host_io, setup.target,
                            options.io_available_memory_proportion,
                            options.allow_out_of_memory, what=f"'{setup.name}'")
  progress.stage("building the executor")
  tensors = dict(ctx.tensors)
  for t in tile.inputs + tile.outputs + tile.constants:
    tensors[t.id] = t
  state = _device_state(ctx, tile.constants)
  executable = build_executable(
      tile.program, tensors, traced.signature, inputs=tile.inputs, outputs=tile.outputs,
      constant_keys=[c.id for c in tile.constants],
      constants=[_constant_storage(c.value, c.mapping) for c in tile.constants],
      state=state, traps=traps_from_options(options, tile.program, profile.name),
      mode=options.executor_mode, out_of_memory=bool(profile.memory.over_limit_tiles.size),
      seeding=Seeding(options.rounding_seed, setup.target.num_tiles, state,
                      tuple(_storage_index(tile.constants[i].mapping) for i in state)))
  return Lowered(traced, tile, profile, report, executable)


def _lower_to_tiles(traced: Traced, progress):
  """Every equation of ``traced.jaxpr`` lowered, offloaded and fused.

  Returns ``(TileProgram, ctx, ConstantFolding)``.
  """
  setup = traced.setup
  # Equations of known operands are computed on the host, as XLA and PopART
  # fold them (lowering/constant_folding.py). Here, not at trace time: the
  # executable cache keys the traced jaxpr, folding is a function of it.
  closed, folded = fold_constants(traced.jaxpr)
  target, options, arg_names = setup.target, setup.options, setup.arg_names
  if not options.allow_out_of_memory:  # a tensor no tiles can hold: refused before planning
    check_program_size(closed, target, arg_names=arg_names, what=f"'{setup.name}'",
                       **offloaded_leaves(setup.offload, traced.out_shape))
  # Collectives cost a ring all-reduce over replication_factor replicas.
  ctx = LoweringContext(target, options, replication_factor=setup.replication_factor)
  inputs = []
  for i, aval in enumerate(traced.signature.in_avals):
    arg_name = arg_names[i] if i < len(arg_names) else f"arg{i}"
    shape, dtype = physical_shape_dtype(aval)
    inputs.append(ctx.new_tensor(shape, dtype, name=arg_name, category="variables"))
  ctx.donate([inputs[i] for i in setup.donated])
  progress.stage("lowering")
  with ctx.at("argument", setup.call_site):
    outputs = lower_closed_jaxpr(ctx, closed, inputs, progress=progress.equations)
  # Detached, so the unfused tree is freed once fusion has rewritten it.
  program = ctx.detach_program()
  if setup.offload is not None:  # leaves kept in streaming memory (ipu_jax/offload.py)
    from ipu_jax import offload as offload_lib  # offload builds on the stages' users
    program, inputs, outputs = offload_lib.offload_program(
        program, inputs, outputs, setup.offload[0],
        offload_lib.out_paths_of(traced.out_shape), setup.offload[1], setup.name)
  if options.fuse_elementwise:
    program = fuse_elementwise(program, target, keep=outputs)
  tile = TileProgram(program, tuple(inputs), tuple(outputs), tuple(ctx.constants),
                     ctx.proportions_read)
  return tile, ctx, folded


def _device_state(ctx: LoweringContext, constants) -> tuple:
  """Positions of the constants the program updates and the next run starts
  from (device state, as the tiles' generator registers)."""
  prng = {id(t) for key, t in ctx.program_states.items() if key[0] == PRNG_STATE}
  return tuple(i for i, c in enumerate(constants) if id(c) in prng)


def _constant_storage(value, mapping):
  """A constant's initial tile storage, laid out on the host (``host_storage``)."""
  if jax.dtypes.issubdtype(getattr(value, "dtype", np.float32), jax.dtypes.extended):
    return to_storage(jnp.asarray(value).reshape(-1), mapping)  # key arrays: JAX lays them out
  host = np.asarray(value)
  host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
  return jax.device_put(host_storage(host.reshape(-1), mapping))


def _storage_index(mapping) -> np.ndarray:
  """The tile storage of a tensor of ``mapping`` as flat element indices (-1: padding)."""
  source = mapping.storage_source  # padding holds num_elements
  index = np.where(source == mapping.num_elements, -1, source).astype(np.int32)
  return index.reshape(mapping.storage_shape)


def _host_io(traced: Traced, tile: TileProgram, profile):
  """The host transfers of the program's on-device loop (None: no loop)."""
  loop, target, options = traced.host_loop, traced.setup.target, traced.setup.options
  if loop is None:
    return None
  received = np.zeros(target.num_tiles, np.int64)
  for i in loop.input_args:
    mapping = tile.inputs[i].mapping
    if mapping is not None and mapping.num_elements:
      np.add.at(received, mapping.tiles, mapping.counts * tile.inputs[i].itemsize)
  received = -(-received // max(loop.iterations, 1))
  streamed = {tile.inputs[i].id for i in loop.input_args}
  landing = host_io.landing_cycles(tile.program, profile, streamed)
  return host_io.host_io_profile(
      loop, target, profile.total_cycles - landing, options.io_exchange_strategy,
      options.output_mode, options.output_return_period, received=received)


def _host_side(host: host_time.HostTimes, in_avals, out_avals) -> host_time.HostSide:
  return host_time.HostSide(host, avals_bytes(in_avals), avals_bytes(out_avals))
