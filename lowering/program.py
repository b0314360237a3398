"""The tile program IR: tile-mapped tensors, supersteps and control programs.

This mirrors Poplar's model. A :class:`Tensor` is a logical array plus its
:class:`~ipu_jax.lowering.mapping.TileMapping`. A :class:`Superstep` is one
BSP step: sync, then the exchange that brings every vertex's operands onto its
tile, then a compute phase of vertices running on their tiles; its ``fn`` does
the exchange and the ``vmap``-ed compute on tile storage arrays, its optional
``logical`` the same values on logical arrays, and its cost fields say what
the real chip would spend. Control programs (Sequence, Repeat,
RepeatWhileTrue, If, Switch, Replicated, host stream copies, PrintTensor)
arrange steps; :data:`Program` is the union of all these node types.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Callable, Optional, Sequence as SequenceT, Union

import numpy as np

from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping

__all__ = [
    "Tensor", "Superstep", "Sequence", "Repeat", "RepeatWhileTrue", "If",
    "Switch", "Replicated", "HostStream", "StreamCopy", "PrintTensor", "Program",
    "program_reads", "program_writes", "iter_steps", "children", "ElementwiseWork", "FusedOp",
    "worker_vertices",
]

_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Tensor:
  """A logical array held in tile memory.

  Attributes:
    name: a readable name.
    shape: logical shape.
    dtype: NumPy dtype.
    mapping: where each element lives (``None`` until mapped, graph API only).
    category: memory category: ``"variables"``, ``"constants"`` or
      ``"temporaries"``.
    value: initial value of constants (a NumPy array), else ``None``.
    op: the operation that produced it (for reports).
    source: the user's ``file:line`` (for reports).
    scope: the module path (name stack) of the operation (for reports).
  """

  name: str
  shape: tuple
  dtype: np.dtype
  mapping: Optional[TileMapping] = None
  category: str = "temporaries"
  value: Optional[np.ndarray] = None
  op: str = ""
  source: str = ""
  scope: str = ""
  id: int = dataclasses.field(default_factory=lambda: next(_ids))

  def __post_init__(self):
    self.shape = tuple(int(d) for d in self.shape)
    self.dtype = np.dtype(self.dtype)

  @property
  def size(self) -> int:
    # math.prod of the Python ints (``__post_init__``): asked tens of
    # thousands of times a program, where np.prod's array round trip was
    # most of the cost.
    return int(math.prod(self.shape))

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def nbytes(self) -> int:
    return self.size * self.itemsize

  @property
  def storage_shape(self) -> tuple:
    return self.mapping.storage_shape

  def __repr__(self):
    return f"Tensor({self.name!r}, {self.shape}, {self.dtype.name})"


@dataclasses.dataclass(eq=False)
class ElementwiseWork:
  """What the elementwise fusion pass needs to know of an elementwise step.

  Attributes:
    mapping: the layout every vertex of the step works on (its results').
    read_exchanges: per entry of the step's ``reads``, the exchange that
      brings it onto ``mapping`` (``None``: already there).
    cost_op: the elementwise estimator's key for the work per element
      (``estimators.elementwise_cycles``), so the step can be costed on
      another layout; ``""`` if it may not move.
    itemsize: bytes per element of the result (for that estimate).
    dtype, in_dtype: the result's and the first operand's dtypes, so a step
      costed on another layout pays what it pays at home (poplibs' figures
      per type; a cast's cost depends on both).
  """

  mapping: TileMapping
  read_exchanges: tuple = ()
  cost_op: str = ""
  itemsize: int = 0
  dtype: Optional[np.dtype] = None
  in_dtype: Optional[np.dtype] = None

  def __post_init__(self):
    # Held for the whole lowering, like a step's own figures (Superstep).
    self.read_exchanges = tuple(map(narrowed_cost, self.read_exchanges))


@dataclasses.dataclass(frozen=True)
class FusedOp:
  """One operation folded into a fused compute set (for reports).

  ``step`` is the operation's own superstep without its figures (those are
  the fused step's): what the executor runs, by its logical form in the
  batched mode, or on its own when it traps floating-point exceptions (to
  name the operation). The report reads the other fields.
  """

  name: str
  op: str
  source: str = ""
  scope: str = ""
  step: Optional["Superstep"] = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass(eq=False)
class Superstep:
  """One BSP superstep: sync, exchange, compute.

  Attributes:
    name: readable name (``"add"``, ``"dot_general/partials"``...).
    op: the JAX primitive or graph program that produced it.
    reads: tensors whose storage ``fn`` takes, in order.
    writes: tensors whose new storage ``fn`` returns, in order. A step that
      writes only part of a tensor also lists it in ``reads``.
    fn: ``fn(*read_storages) -> tuple of write_storages``: what the tiles
      do, the exchange (static gathers / reshapes) and the compute (codelets
      ``vmap``-ed over the tile axis). The ``"per_tile"`` executor runs it.
    logical: the step's form on logical arrays, or ``None``:
      ``logical(*read_arrays) -> tuple of write_arrays``, each array of its
      tensor's shape, equal on every element to ``to_flat`` of ``fn``'s
      result (results may be of another dtype: the executor casts, as for
      ``fn``), except on tensors that only the logical forms of the same
      operation's later steps read (a reduction's partials, a scan's
      pieces: the forms carry the whole result through them, so the two
      forms agree on the operation's results). Many steps (elementwise
      ops, data movements, matmuls, convolutions, reductions, windows,
      scans) compute their values on the logical arrays whatever the
      layouts. The ``"batched"`` executor keeps
      tensors logical between steps and runs this form, so XLA sees the
      program's arithmetic on the arrays ``jax.jit`` would, with no
      conversion to and from tile storage around each step (pads of short
      rows, block transposes, gathers of irregular layouts); where it must
      check storages (floating-point traps) it runs this form between them.
      Only the host-side representation changes: every cycle, byte and
      memory figure is the step's as lowered. The rule builds both forms;
      the executor chooses (``lowering/executor.py``), the same for every
      step of a program. Neither form may hold a table per element that
      the step did not need before (host memory is bounded per step): a
      per-tile ``fn`` builds such gathers when traced.
    compute_cycles: ``[num_tiles]`` compute-phase cycles, or ``None`` for a
      step with no compute (a pure exchange).
    exchange: bytes moved, or ``None``.
    vertices: ``[num_tiles]`` vertices per tile.
    codelets: vertex types run: names from ``kernels/vocabulary.py`` (or
      ``Codelet`` objects); code memory is charged once per type per tile.
    flops: floating point operations.
    scratch_bytes: ``[num_tiles]`` temporary bytes live only during the step.
    source: the user's ``file:line``.
    notes: remarks the report shows with the step, e.g. that its cost is
      that of a software emulation (float64 or complex products).
    scope: the module path (name stack), e.g. ``"Encoder/layers_0/attention"``.
    elementwise: set by elementwise steps, which the fusion pass
      (``lowering/fusion.py``) may merge; ``None`` for other steps.
    updates_base: the step's one result is its first read (the base tensor)
      with some elements replaced or added to, as popops' ``dynamicUpdate``
      and ``multiUpdate`` / ``multiUpdateAdd`` write into their base: the
      memory analysis lets the result take the base's memory where the base
      dies at this step, as it lets an elementwise result take a dying
      operand's.
    fused_ops: for a fused step, the operations it was made of.
    literals: the scalar constants folded into ``fn`` instead of read (an
      elementwise step's ``x * jnp.inf``), as NumPy scalars; the
      floating-point exception check counts them as inputs.
    flops_dtype: the dtype whose peak rate its FLOPs were costed at (a
      matmul's or convolution's operand type: float16, bfloat16 and FP8
      products run on the AMP units); None: its widest floating-point operand.
  """

  name: str
  op: str
  reads: tuple
  writes: tuple
  fn: Callable
  compute_cycles: Optional[np.ndarray] = None
  exchange: Optional[ExchangeCost] = None
  vertices: Optional[np.ndarray] = None
  codelets: tuple = ()
  flops: int = 0
  scratch_bytes: Optional[np.ndarray] = None
  source: str = ""
  notes: tuple = ()
  scope: str = ""
  elementwise: Optional[ElementwiseWork] = None
  updates_base: bool = False
  fused_ops: tuple = ()
  literals: tuple = ()
  logical: Optional[Callable] = dataclasses.field(default=None, repr=False)
  flops_dtype: Optional[np.dtype] = None

  def __post_init__(self):
    # A program holds several [num_tiles] arrays per superstep (11,776
    # entries on 8 IPUs, thousands of steps at BERT size): they are kept in
    # the narrowest dtype that holds every value exactly, so each figure
    # read back is the one computed.
    self.compute_cycles = narrowed(self.compute_cycles)
    self.vertices = narrowed(self.vertices)
    self.scratch_bytes = narrowed(self.scratch_bytes)
    self.exchange = narrowed_cost(self.exchange)
    if self.exchange is not None and self.exchange.link_notes:
      self.notes = tuple(dict.fromkeys(tuple(self.notes) + self.exchange.link_notes))


_NARROW = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}


def narrowed_cost(cost: Optional[ExchangeCost]) -> Optional[ExchangeCost]:
  """``cost`` with its per-tile bytes :func:`narrowed` (a new object; ``cost`` may be shared)."""
  if cost is None:
    return None
  bytes_in, bytes_out = narrowed(cost.bytes_in), narrowed(cost.bytes_out)
  if bytes_in is cost.bytes_in and bytes_out is cost.bytes_out:
    return cost
  return ExchangeCost(bytes_in, bytes_out, cost.link_bytes_out, cost.link_cycles,
                      cost.link_notes, cost.bus_shared_in)


def narrowed(values: Optional[np.ndarray]) -> Optional[np.ndarray]:
  """``values`` as float32 / int32 when that holds each value exactly, else unchanged.

  >>> narrowed(np.array([3.0, 1.5])).dtype
  dtype('float32')
  >>> narrowed(np.array([0.1])).dtype
  dtype('float64')
  """
  if not isinstance(values, np.ndarray):
    return values
  narrow = _NARROW.get(values.dtype)
  if narrow is None or values.size == 0:
    return values
  # Cast, then check every value came through (one pass each, no copies
  # kept when it did not).
  candidate = values.astype(narrow)
  return candidate if (candidate == values).all() else values


@dataclasses.dataclass(eq=False)
class Sequence:
  """Run programs one after another."""
  programs: list = dataclasses.field(default_factory=list)

  def __init__(self, *programs):
    if len(programs) == 1 and isinstance(programs[0], (list, tuple)):
      programs = tuple(programs[0])
    self.programs = list(programs)

  def add(self, program) -> "Sequence":
    self.programs.append(program)
    return self


@dataclasses.dataclass(eq=False)
class Repeat:
  """Run ``body`` ``count`` times (an on-device loop).

  ``local_ids`` names tensors that live only within one iteration of the
  body (written before read each time); the executor does not carry them.
  """
  count: int
  body: "Program"
  local_ids: frozenset = frozenset()

  def __post_init__(self):
    # Poplar's Repeat takes an unsigned count: a negative one would run nothing
    # and report negative cycles, a fractional one run its floor.
    if (isinstance(self.count, bool) or not isinstance(self.count, numbers.Integral)
        or self.count < 0):
      raise ValueError(f"Repeat: count must be an int >= 0 (the body's iterations); got "
                       f"{self.count!r}.")


@dataclasses.dataclass(eq=False)
class RepeatWhileTrue:
  """Run ``condition``, then ``body`` while the scalar ``predicate`` is true.

  ``condition`` is the program that computes ``predicate``; it runs before
  the first iteration and after every body.
  """
  condition: "Program"
  predicate: Tensor
  body: "Program"
  local_ids: frozenset = frozenset()


@dataclasses.dataclass(eq=False)
class If:
  """Run ``then`` when the scalar ``predicate`` is non-zero, else ``else_``."""
  predicate: Tensor
  then: "Program"
  else_: Optional["Program"] = None
  local_ids: frozenset = frozenset()


@dataclasses.dataclass(eq=False)
class Switch:
  """Run the case whose value equals the scalar ``control``, else ``default``."""
  control: Tensor
  cases: list  # [(value, Program)]
  default: Optional["Program"] = None
  local_ids: frozenset = frozenset()


@dataclasses.dataclass(eq=False)
class Replicated:
  """Run ``body`` once on each replica of a mesh (a ``shard_map``/``pmap`` body).

  ``axes`` is ``((name, size), ...)``: the replicas are the points of that
  mesh, and collectives in the body over those names reach across them. The
  body is one replica's program on the target's tiles (every replica runs the
  same one on its own IPUs), so it is costed once. Tensors the body writes
  that are not in ``local_ids`` come out of the region equal on every replica;
  replica 0's are kept.
  """
  body: "Program"
  axes: tuple
  local_ids: frozenset = frozenset()

  @property
  def num_replicas(self) -> int:
    return int(np.prod([size for _, size in self.axes], dtype=np.int64))


@dataclasses.dataclass(eq=False)
class HostStream:
  """A FIFO between host memory and the device.

  Attributes:
    name: the stream's handle.
    dtype: element type.
    num_elements: elements moved per copy.
    to_device: True for host-to-device, False for device-to-host.
  """
  name: str
  dtype: np.dtype
  num_elements: int
  to_device: bool = True

  @property
  def buffer_key(self) -> str:
    return f"stream:{self.name}:buffer"

  @property
  def cursor_key(self) -> str:
    return f"stream:{self.name}:cursor"


@dataclasses.dataclass(eq=False)
class StreamCopy:
  """Copy one transfer of ``stream`` into (or out of) ``tensor``."""
  stream: HostStream
  tensor: Tensor


@dataclasses.dataclass(eq=False)
class PrintTensor:
  """Print ``tensor`` on the host as Poplar's PrintTensor does."""
  title: str
  tensor: Tensor


# A tile program: a step (a ``remote.RemoteCopy`` is one) or a control
# program over programs.
Program = Union[Superstep, Sequence, Repeat, RepeatWhileTrue, If, Switch, Replicated,
                StreamCopy, PrintTensor]


def children(program: Program) -> SequenceT[Program]:
  """The programs a control program runs (none for a leaf)."""
  if isinstance(program, Sequence):
    return program.programs
  if isinstance(program, (Repeat, Replicated)):
    return [program.body]
  if isinstance(program, RepeatWhileTrue):
    return [program.condition, program.body]
  if isinstance(program, If):
    return [p for p in (program.then, program.else_) if p is not None]
  if isinstance(program, Switch):
    return [p for _, p in program.cases] + ([program.default] if program.default is not None else [])
  return []


def control_tensors(program: Program) -> list:
  """The tensors control programs read to choose a path (``RepeatWhileTrue``
  and ``If`` predicates, ``Switch`` controls), nested ones included, in
  program order."""
  out = []
  if isinstance(program, (RepeatWhileTrue, If)):
    out.append(program.predicate)
  if isinstance(program, Switch):
    out.append(program.control)
  for child in children(program):
    out.extend(control_tensors(child))
  return out


def _key_sets(program: Optional[Program], memo):
  """(read keys, written keys) of a program; keys are tensor ids or strings."""
  if program is None:
    return frozenset(), frozenset()
  cached = memo.get(id(program))
  if cached is not None:
    return cached
  reads, writes = set(), set()
  if isinstance(program, Superstep):
    reads.update(t.id for t in program.reads)
    writes.update(t.id for t in program.writes)
  elif isinstance(program, StreamCopy):
    keys = {program.stream.buffer_key, program.stream.cursor_key}
    reads |= keys
    if program.stream.to_device:
      writes.add(program.tensor.id)
      writes.add(program.stream.cursor_key)
    else:
      reads.add(program.tensor.id)
      writes |= keys
  elif isinstance(program, PrintTensor):
    reads.add(program.tensor.id)
  else:
    if isinstance(program, RepeatWhileTrue):
      reads.add(program.predicate.id)
    elif isinstance(program, If):
      reads.add(program.predicate.id)
    elif isinstance(program, Switch):
      reads.add(program.control.id)
    for child in children(program):
      r, w = _key_sets(child, memo)
      reads |= r
      writes |= w
  result = (frozenset(reads), frozenset(writes))
  memo[id(program)] = result
  return result


def program_reads(program: Program, memo=None) -> frozenset:
  return _key_sets(program, {} if memo is None else memo)[0]


def program_writes(program: Program, memo=None) -> frozenset:
  return _key_sets(program, {} if memo is None else memo)[1]


def iter_steps(program: Program, executions: int = 1):
  """Yield ``(node, executions, loop_path)`` for every leaf in program order.

  ``loop_path`` is a tuple of the enclosing loop nodes, so liveness can keep
  values touched inside a loop alive for the whole loop.
  """
  yield from _iter(program, executions, ())


def _iter(program: Optional[Program], executions, loops):
  if program is None:
    return
  if isinstance(program, (Superstep, StreamCopy, PrintTensor)):
    yield program, executions, loops
  elif isinstance(program, Sequence):
    for p in program.programs:
      yield from _iter(p, executions, loops)
  elif isinstance(program, Repeat):
    yield from _iter(program.body, executions * program.count, loops + (program,))
  elif isinstance(program, Replicated):
    # The replicas run side by side on their own IPUs: one replica's steps.
    yield from _iter(program.body, executions, loops)
  elif isinstance(program, RepeatWhileTrue):
    inner = loops + (program,)
    yield from _iter(program.condition, executions, inner)
    yield from _iter(program.body, executions, inner)
  elif isinstance(program, (If, Switch)):
    for child in children(program):
      yield from _iter(child, executions, loops)
  else:
    raise TypeError(f"not a tile program: {program!r}")


def worker_vertices(ctx, elements: np.ndarray) -> np.ndarray:
  """A step's ``vertices`` per tile when each tile's work is split over its workers."""
  return np.minimum(np.asarray(elements), ctx.target.worker_contexts)
