"""Streaming memory: remote buffers and the copies between them and the tiles.

An IPU addresses, besides its tiles' SRAM, the Streaming Memory of its
IPU-Machine (DDR behind the gateway). Poplar exposes it as a ``RemoteBuffer``:
``repeats`` rows of ``element_shape``, written and read only by copies to and
from tile-mapped tensors at a row offset. Here:

* :class:`RemoteBuffer` is a :class:`~ipu_jax.lowering.program.Tensor` with no
  tile mapping. Its storage in the executor is ``[repeats, row_size]`` (host
  memory); it occupies no tile memory, so the memory model leaves it out and
  :func:`streaming_profile` accounts for it instead.
* :class:`RemoteCopy` is a superstep of one or more transfers, each moving
  ``rows`` whole rows between a buffer (from row ``offset``) and a tile tensor.
  Tile plan: each tile sends or receives exactly the bytes of the tensors it
  holds, nothing is computed.
  Cost: the busiest IPU's bytes at the streaming-memory bandwidth
  (``IPUTarget.streaming_memory_bytes_per_second``, all of one IPU's tiles
  share its gateway link), or the busiest tile's at the exchange rate if that
  is slower, plus the exchange latency; the step opens with a host sync
  (``IPUTarget.sync_cycles_host``), since the gateway takes part in it (as host transfers do).

The offload pass (:func:`offload_tensors`) moves chosen tile tensors of a
lowered program into remote buffers: inside the innermost loop body that
holds every use of a tensor, tensors whose spans of use overlap there are
copied onto their tiles in one step before the first use of any of them and
back in one step after the last, so between uses they cost no tile memory and
each such cluster pays one sync per direction (a weight update ordered weight
by weight streams one weight's state at a time).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.errors import LoweringError
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import to_flat, to_storage
from ipu_jax.lowering.profile import StepProfile
from ipu_jax.kernels.target import IPUTarget

__all__ = ["RemoteBuffer", "RemoteCopy", "CopySpec", "remote_copy", "remote_copies", "StreamingProfile",
           "StreamingBuffer", "streaming_profile", "offload_tensors", "is_remote"]


def is_remote(tensor) -> bool:
  """Whether ``tensor`` lives in streaming memory (a :class:`RemoteBuffer`)."""
  return isinstance(tensor, RemoteBuffer)


@dataclasses.dataclass(eq=False, repr=False)
class RemoteBuffer(P.Tensor):
  """A buffer in streaming memory: ``repeats`` rows of ``element_shape``.

  ``shape`` is ``(repeats, *element_shape)``; ``category`` is
  ``"streaming"``; ``mapping`` stays ``None`` (no tile holds it).
  """

  category: str = "streaming"
  repeats: int = 1

  def __post_init__(self):
    super().__post_init__()
    self.repeats = int(self.shape[0]) if self.shape else 1

  @property
  def element_shape(self) -> tuple:
    return self.shape[1:]

  @property
  def row_size(self) -> int:
    return int(np.prod(self.element_shape, dtype=np.int64))

  @property
  def storage_shape(self) -> tuple:
    return (self.repeats, self.row_size)

  def __repr__(self):
    return (f"RemoteBuffer({self.name!r}, {self.element_shape}, {self.dtype.name}, "
            f"repeats={self.repeats})")


@dataclasses.dataclass(frozen=True)
class CopySpec:
  """One buffer <-> tensor transfer of a :class:`RemoteCopy` step."""
  buffer: RemoteBuffer
  tensor: P.Tensor
  offset: int
  rows: int


@dataclasses.dataclass(eq=False)
class RemoteCopy(P.Superstep):
  """Copies between remote buffers and tile tensors, in one superstep.

  Attributes (besides :class:`~ipu_jax.lowering.program.Superstep`'s):
    copies: the transfers (:class:`CopySpec`), all in one direction; one
      sync opens them and every IPU's share goes through its gateway link.
    to_remote: True copies the tensors into the buffers, False the other way.
  """

  copies: tuple = ()
  to_remote: bool = False

  def step_profile(self, target: IPUTarget, executions: int) -> StepProfile:
    """Cycles and bytes of these copies (see the module docstring)."""
    t = target.num_tiles
    per_tile = np.zeros(t, np.int64)
    for copy in self.copies:
      mapping = copy.tensor.mapping
      if mapping is not None and mapping.num_elements:
        np.add.at(per_tile, mapping.tiles, mapping.counts * copy.tensor.itemsize)
    total = int(per_tile.sum())
    per_ipu = per_tile.reshape(target.num_ipus, target.tiles_per_ipu).sum(axis=1)
    gateway = per_ipu.max(initial=0) / target.streaming_bytes_per_cycle
    busiest = per_tile.max(initial=0) / target.exchange_bytes_per_cycle
    cycles = float(max(gateway, busiest) + target.exchange_latency_cycles) if total else 0.0
    zeros = np.zeros(t, np.int64)
    return StepProfile(
        name=self.name, op=self.op, source=self.source,
        compute_cycles=np.zeros(t, np.float64),
        exchange_bytes_in=zeros if self.to_remote else per_tile,
        exchange_bytes_out=per_tile if self.to_remote else zeros,
        exchange_cycles=cycles, sync_cycles=float(target.sync_cycles_host),
        executions=executions, vertices=zeros, streaming_bytes=total,
        scope=self.scope)


def _check_copy(buffer: RemoteBuffer, tensor: P.Tensor, offset: int) -> int:
  """Rows a copy moves; a clear ``ValueError`` for a copy that does not fit."""
  if not is_remote(buffer):
    raise TypeError(f"expected a remote buffer, got {buffer!r}")
  if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)):
    raise TypeError(f"remote copy offset must be an int, got {offset!r}")
  if np.dtype(tensor.dtype) != buffer.dtype:
    raise ValueError(
        f"remote copy between {buffer.name!r} ({buffer.dtype.name}) and tensor "
        f"{tensor.name!r} ({np.dtype(tensor.dtype).name}): dtypes differ.")
  row = buffer.row_size
  if row == 0 or tensor.size % row:
    raise ValueError(
        f"remote copy between {buffer.name!r} (rows of {row} elements, shape "
        f"{buffer.element_shape}) and tensor {tensor.name!r} {tensor.shape}: "
        f"{tensor.size} elements are not a whole number of rows.")
  rows = tensor.size // row
  if not 0 <= offset or offset + rows > buffer.repeats:
    raise ValueError(
        f"remote copy of {rows} row(s) at offset {offset} is beyond remote buffer "
        f"{buffer.name!r}, which has repeats={buffer.repeats}; valid offsets are "
        f"0..{buffer.repeats - rows}." if rows <= buffer.repeats else
        f"remote copy of tensor {tensor.name!r} {tensor.shape} ({rows} rows) is "
        f"larger than remote buffer {buffer.name!r} ({buffer.repeats} rows of "
        f"{buffer.element_shape}).")
  return int(rows)


def remote_copies(transfers, *, to_remote: bool, name: str = "", source: str = "",
                  scope: str = "") -> RemoteCopy:
  """One :class:`RemoteCopy` step for ``transfers`` (``(buffer, tensor, offset)``).

  Raises:
    ValueError: dtypes differ, a tensor is not whole rows, the rows at an
      offset are beyond its buffer's ``repeats``, or one buffer is written
      twice by the step.
  """
  specs = tuple(CopySpec(b, t, int(o), _check_copy(b, t, o)) for b, t, o in transfers)
  buffers = list({c.buffer.id: c.buffer for c in specs}.values())
  if to_remote and len(buffers) != len(specs):
    raise ValueError("one remote-copy step writes a buffer twice; use two steps.")
  tensors = list({c.tensor.id: c.tensor for c in specs}.values())
  b_index = {b.id: i for i, b in enumerate(buffers)}
  t_index = {t.id: i for i, t in enumerate(tensors)}
  if to_remote:
    def fn(*storages):
      bufs, tens = list(storages[:len(buffers)]), storages[len(buffers):]
      for c in specs:
        i = b_index[c.buffer.id]
        rows = to_flat(tens[t_index[c.tensor.id]], c.tensor.mapping).reshape(c.rows, -1)
        bufs[i] = bufs[i].at[c.offset:c.offset + c.rows].set(rows.astype(bufs[i].dtype))
      return tuple(bufs)
    reads, writes = tuple(buffers) + tuple(tensors), tuple(buffers)
  else:
    if len(tensors) != len(specs):
      raise ValueError("one remote-copy step writes a tensor twice; use two steps.")

    def fn(*bufs):
      return tuple(
          to_storage(jnp.reshape(bufs[b_index[c.buffer.id]][c.offset:c.offset + c.rows], (-1,)),
                     c.tensor.mapping) for c in specs)
    reads, writes = tuple(buffers), tuple(c.tensor for c in specs)
  names = ", ".join(dict.fromkeys(c.buffer.name for c in specs))
  if len(specs) > 3:
    names = f"{len(specs)} buffers"
  label = name or (f"to streaming memory: {names}" if to_remote
                   else f"from streaming memory: {names}")
  first = specs[0].tensor if specs else None
  return RemoteCopy(
      name=label, op="RemoteCopy", reads=reads, writes=writes, fn=fn,
      source=source or (first.source if first is not None else ""),
      scope=scope or (first.scope if first is not None else ""),
      copies=specs, to_remote=to_remote)


def remote_copy(buffer: RemoteBuffer, tensor: P.Tensor, *, to_remote: bool,
                offset: int = 0, name: str = "", source: str = "",
                scope: str = "") -> RemoteCopy:
  """A :class:`RemoteCopy` step of one tensor, checked before anything runs."""
  return remote_copies([(buffer, tensor, offset)], to_remote=to_remote, name=name,
                       source=source, scope=scope)


# -- what streaming memory holds, and what moving it costs -----------------------------


@dataclasses.dataclass
class StreamingBuffer:
  """One remote buffer in a report: its bytes on each IPU of a replica."""
  name: str
  shape: tuple
  dtype: str
  repeats: int
  bytes_per_ipu: np.ndarray
  source: str = ""
  scope: str = ""

  @property
  def total_bytes(self) -> int:
    return int(self.bytes_per_ipu.sum())


@dataclasses.dataclass
class StreamingProfile:
  """Streaming memory of one replica's program and its traffic per run.

  Attributes:
    buffers: the remote buffers (:class:`StreamingBuffer`).
    bytes_per_ipu: ``[num_ipus]`` bytes of streaming memory each IPU holds.
    capacity_per_ipu: the target's streaming memory per IPU.
    bytes_moved: bytes copied between tiles and streaming memory per run
      (both directions, every execution counted).
    cycles: cycles those copies cost per run (sync, transfer).
    copies: remote-copy supersteps executed per run.
  """
  buffers: list
  bytes_per_ipu: np.ndarray
  capacity_per_ipu: int
  bytes_moved: int = 0
  cycles: float = 0.0
  copies: int = 0

  @property
  def total_bytes(self) -> int:
    return int(self.bytes_per_ipu.sum())


def streaming_profile(target: IPUTarget, buffers: Sequence[RemoteBuffer], leaves,
                      steps) -> Optional[StreamingProfile]:
  """What streaming memory holds, and what the program's copies cost.

  A buffer lives with the IPU(s) whose tiles copy it, shared in proportion to
  the bytes each IPU's tiles move (all of it on IPU 0 if nothing copies it).

  Raises:
    LoweringError: an IPU's buffers exceed its streaming memory.
  """
  if not buffers and not any(isinstance(node, RemoteCopy) for node, _, _ in leaves):
    return None
  share = {}
  moved, cycles, copies = 0, 0.0, 0
  for (node, _, _), step in zip(leaves, steps):
    if not isinstance(node, RemoteCopy):
      continue
    moved += step.streaming_bytes * step.executions
    cycles += step.total_cycles * step.executions
    copies += step.executions
    for copy in node.copies:
      per_tile = np.zeros(target.num_tiles, np.int64)
      mapping = copy.tensor.mapping
      if mapping is not None and mapping.num_elements:
        np.add.at(per_tile, mapping.tiles, mapping.counts * copy.tensor.itemsize)
      per_ipu = per_tile.reshape(target.num_ipus, target.tiles_per_ipu).sum(axis=1)
      share[copy.buffer.id] = share.get(copy.buffer.id, 0) + per_ipu
  rows, by_ipu = [], np.zeros(target.num_ipus, np.int64)
  for buffer in {b.id: b for b in buffers}.values():
    weights = np.asarray(share.get(buffer.id, np.eye(target.num_ipus)[0]), np.float64)
    weights = weights / weights.sum() if weights.sum() else np.eye(target.num_ipus)[0]
    placed = np.floor(weights * buffer.nbytes).astype(np.int64)
    placed[int(np.argmax(weights))] += buffer.nbytes - int(placed.sum())
    by_ipu += placed
    rows.append(StreamingBuffer(
        name=buffer.name, shape=buffer.element_shape, dtype=buffer.dtype.name,
        repeats=buffer.repeats, bytes_per_ipu=placed, source=buffer.source,
        scope=buffer.scope))
  over = np.nonzero(by_ipu > target.streaming_memory_bytes)[0]
  if over.size:
    ipu = int(over[0])
    largest = sorted(rows, key=lambda r: -int(r.bytes_per_ipu[ipu]))[:5]
    raise LoweringError(
        f"Streaming memory of IPU {ipu} exhausted: its remote buffers need "
        f"{int(by_ipu[ipu]):,d} bytes but the {target.name} target has "
        f"{target.streaming_memory_bytes:,d} (IPUTarget.streaming_memory_bytes). "
        "Largest: " + ", ".join(f"{r.name} {int(r.bytes_per_ipu[ipu]):,d} B" for r in largest)
        + ". Shard the state over replicas (replicated tensor sharding) or use "
        "a target with more streaming memory.")
  return StreamingProfile(buffers=rows, bytes_per_ipu=by_ipu,
                          capacity_per_ipu=target.streaming_memory_bytes,
                          bytes_moved=int(moved), cycles=float(cycles), copies=int(copies))


# -- the offload pass ------------------------------------------------------------------


def _touching(sequence: P.Sequence, tensor_id, memo: dict, uses: dict) -> list:
  """Positions of ``sequence``'s children that read or write ``tensor_id``.

  One pass over the children's key sets builds, per sequence, an index from
  each key to the children using it (in ``uses``), so that looking up every
  offloaded tensor costs its own uses, not a scan of all the children.
  """
  index = uses.get(id(sequence))
  if index is None:
    index = {}
    for i, child in enumerate(sequence.programs):
      reads, writes = P.program_reads(child, memo), P.program_writes(child, memo)
      for key in reads | writes:
        index.setdefault(key, []).append(i)
    uses[id(sequence)] = index
  return index.get(tensor_id, [])


def _where(sequence: P.Sequence, tensor: P.Tensor, memo: dict, uses: dict):
  """``(sequence, first, last)`` holding every use of ``tensor``, innermost first.

  When every use is in one loop body (or sub-sequence), that body: there the
  tile copy lives only for the uses of one iteration, and the loop stops
  carrying it. ``None`` when nothing uses the tensor.
  """
  where = _touching(sequence, tensor.id, memo, uses)
  if not where:
    return None
  if len(where) == 1:
    child = sequence.programs[where[0]]
    body = child.body if isinstance(child, P.Repeat) else child
    if isinstance(body, P.Sequence):
      if isinstance(child, P.Repeat):
        child.local_ids = frozenset(child.local_ids) | {tensor.id}
      return _where(body, tensor, memo, uses)
  return sequence, where[0], where[-1]


def _clusters(entries: list) -> list:
  """``entries`` (``(first, last, ins, outs)`` in one sequence) merged where
  their use intervals overlap: ``[(first, last, ins, outs)]``, by position."""
  entries = sorted(entries, key=lambda e: e[0])
  merged = []
  for first, last, ins, outs in entries:
    if merged and first <= merged[-1][1]:
      top = merged[-1]
      merged[-1] = (top[0], max(top[1], last), top[2] + ins, top[3] + outs)
    else:
      merged.append((first, last, list(ins), list(outs)))
  return merged


def offload_tensors(program: P.Program, pairs: Sequence[tuple]) -> P.Sequence:
  """Move tile tensors of ``program`` into remote buffers.

  Args:
    program: the lowered control program (rewritten in place when it is a
      :class:`~ipu_jax.lowering.program.Sequence`; else wrapped in one).
    pairs: ``(tensor, buffer, copy_in, copy_out)``: ``copy_in`` streams the
      buffer onto the tensor's tiles before its first use (the tensor is an
      offloaded input), ``copy_out`` streams the tensor back after its last use
      (an offloaded output). Offloaded inputs stop being always-live variables:
      on tiles they are temporaries, live only between the copies.

  Tensors whose uses overlap in one sequence (the span from a tensor's first
  use to its last meets another's) are streamed together: one copy step (one
  sync) before the first use of any of them, one after the last. A weight
  update traced leaf by leaf for each operation (optax's order) thus loads
  all its state at once; one ordered weight by weight
  (``lowering/update_order.py``) streams each weight's state in just before
  its chain and out right after, so the tiles hold one weight's at a time.

  Returns:
    The rewritten program (a Sequence).
  """
  if not isinstance(program, P.Sequence):
    program = P.Sequence(program)
  memo, uses = {}, {}  # key sets per program; children using each key per sequence
  sequences = {}  # id(sequence) -> sequence
  spans = {}  # (id(sequence), buffer id) -> [first, last, ins, outs]
  for tensor, buffer, copy_in, copy_out in pairs:
    if tensor.category == "variables":
      tensor.category = "temporaries"
    found = _where(program, tensor, memo, uses)
    if found is None:
      continue
    sequence, first, last = found
    sequences[id(sequence)] = sequence
    # A buffer's old value and its new one (an updated variable) are on tiles
    # from the old one's first use to the new one's last: one span.
    span = spans.setdefault((id(sequence), buffer.id), [first, last, [], []])
    span[0], span[1] = min(span[0], first), max(span[1], last)
    if copy_in:
      span[2].append((buffer, tensor, 0))
    if copy_out:
      span[3].append((buffer, tensor, 0))
  entries = {}
  for (key, _), span in spans.items():
    entries.setdefault(key, []).append(tuple(span))
  for key, sequence_entries in entries.items():
    sequence = sequences[key]
    # From the last cluster back, so the positions of earlier ones still hold.
    for first, last, ins, outs in reversed(_clusters(sequence_entries)):
      if outs:
        sequence.programs.insert(last + 1, remote_copies(outs, to_remote=True))
      if ins:
        sequence.programs.insert(first, remote_copies(ins, to_remote=False))
  return program
