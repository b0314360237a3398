"""Remote buffers on the graph API (Poplar's ``RemoteBuffer`` and its copies).

::

    buf = graph.add_remote_buffer("cache", np.float32, (64,), repeats=4)
    prog = Sequence(Copy(buf, x, offset=2),      # row 2 of the buffer -> x
                    Execute(cs),
                    Copy(x, buf, offset=3))      # x -> row 3
    engine = Engine(graph, prog)
    engine.write_tensor(buf, rows)               # host side, [4, 64]
    engine.run(); engine.read_tensor(buf)

A remote buffer lives in the Streaming Memory of the IPU-Machine, not on
tiles: the engine holds it in host memory, it costs no tile memory, and each
copy is its own superstep costed at the streaming-memory bandwidth plus a
host sync (``lowering/remote.py``). A tensor copied to or from a buffer
holds one or more whole rows (``element_shape``); ``offset`` is the first row.
Every copy is checked when the engine is built, before anything runs: the
dtype, whole rows, and ``offset + rows <= repeats``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering import program as P
from ipu_jax.lowering import remote
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["RemoteBufferHandle", "add_remote_buffer", "is_handle", "lower_copy",
           "engine_buffers", "read_buffer", "write_buffer"]


@dataclasses.dataclass(eq=False)
class RemoteBufferHandle:
  """A graph's remote buffer: ``repeats`` rows of ``shape`` (``dtype``)."""
  graph: object
  name: str
  dtype: np.dtype
  shape: tuple
  repeats: int = 1

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.repeats * np.dtype(self.dtype).itemsize

  def __repr__(self):
    return (f"RemoteBuffer({self.name!r}, {np.dtype(self.dtype).name}{list(self.shape)}, "
            f"repeats={self.repeats})")


def is_handle(value) -> bool:
  return isinstance(value, RemoteBufferHandle)


def add_remote_buffer(graph, name: str, dtype, shape, repeats: int = 1) -> RemoteBufferHandle:
  """Add a remote buffer to ``graph`` (see :meth:`ipu_jax.graph.Graph.add_remote_buffer`).

  Raises:
    ValueError: a duplicate or empty name, a bad shape or ``repeats``, or a
      target whose streaming memory cannot hold the graph's buffers.
  """
  buffers = graph.remote_buffers
  if not isinstance(name, str) or not name:
    raise ValueError(f"add_remote_buffer: name must be a non-empty string, got {name!r}.")
  if name in buffers:
    raise ValueError(f"add_remote_buffer: the graph already has a remote buffer {name!r}.")
  shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
  if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d <= 0
                      for d in shape):
    raise ValueError(f"add_remote_buffer({name!r}): shape must be positive ints, got {shape!r}.")
  if isinstance(repeats, bool) or not isinstance(repeats, (int, np.integer)) or repeats < 1:
    raise ValueError(f"add_remote_buffer({name!r}): repeats must be an int >= 1, got {repeats!r}.")
  handle = RemoteBufferHandle(graph, name, np.dtype(dtype), tuple(int(d) for d in shape),
                              int(repeats))
  target = graph.target
  total = sum(b.nbytes for b in buffers.values()) + handle.nbytes
  if total > target.streaming_memory_bytes * target.num_ipus:
    raise ValueError(
        f"add_remote_buffer({name!r}): the graph's remote buffers would need {total:,d} "
        f"bytes; the {target.name} target has {target.streaming_memory_bytes:,d} bytes of "
        f"streaming memory per IPU (IPUTarget.streaming_memory_bytes"
        f"{'; ipu1 systems have none' if target.streaming_memory_bytes == 0 else ''}).")
  buffers[name] = handle
  return handle


def _ir_buffer(lowerer, handle: RemoteBufferHandle) -> remote.RemoteBuffer:
  if handle.graph is not lowerer.graph:
    raise ValueError(f"remote buffer {handle.name!r} belongs to another graph.")
  cache = lowerer.remote_buffers
  if handle.name not in cache:
    cache[handle.name] = remote.RemoteBuffer(
        name=handle.name, shape=(handle.repeats,) + handle.shape, dtype=handle.dtype,
        op="RemoteBuffer")
  return cache[handle.name]


def lower_copy(lowerer, src, dst, offset) -> P.Sequence:
  """The tile program of ``Copy(buffer, tensor, offset)`` or ``Copy(tensor, buffer, offset)``.

  Raises:
    ValueError: both or neither are remote buffers, or the copy does not fit
      the buffer (see :func:`ipu_jax.lowering.remote.remote_copy`).
  """
  if is_handle(src) and is_handle(dst):
    raise ValueError(f"Copy({src.name!r}, {dst.name!r}): copies between two remote buffers "
                     "go through a tile tensor.")
  offset = 0 if offset is None else offset
  to_remote = is_handle(dst)
  handle, view = (dst, src) if to_remote else (src, dst)
  buffer = _ir_buffer(lowerer, handle)
  ends = ("tensor", repr(handle.name)) if to_remote else (repr(handle.name), "tensor")
  what = f"Copy({ends[0]} -> {ends[1]}, offset={offset})"
  whole = lowerer.whole_base(view)
  try:
    if to_remote:
      tensor, prep = lowerer.materialise(view, handle.name)
      return P.Sequence([prep, remote.remote_copy(buffer, tensor, to_remote=True,
                                                  offset=offset)])
    if whole is not None:
      return P.Sequence([remote.remote_copy(buffer, whole, to_remote=False, offset=offset)])
    tiles = lowerer.graph._element_tiles(view.index).reshape(-1)
    landing = P.Tensor(f"{handle.name}.landing", view.shape, view.dtype,
                       TileMapping.from_element_tiles(tiles), op="RemoteCopy")
    return P.Sequence([remote.remote_copy(buffer, landing, to_remote=False, offset=offset),
                       lowerer.scatter_step(landing, view)])
  except (TypeError, ValueError) as e:
    raise ValueError(f"{what}: {e}") from None


def engine_buffers(graph, lowerer) -> list:
  """IR buffers of every remote buffer of ``graph`` (also those no program copies)."""
  return [_ir_buffer(lowerer, h) for h in graph.remote_buffers.values()]


def initial_state(buffers) -> dict:
  return {b.id: jax.device_put(np.zeros(b.storage_shape, b.dtype)) for b in buffers}


def _engine_ir(engine, handle: RemoteBufferHandle) -> remote.RemoteBuffer:
  for buffer in engine._remote_buffers:
    if buffer.name == handle.name and handle.graph is engine.graph:
      return buffer
  raise KeyError(f"remote buffer {handle.name!r} is not part of this engine's graph.")


def read_buffer(engine, handle: RemoteBufferHandle) -> np.ndarray:
  """The buffer's contents, ``[repeats, *shape]``."""
  buffer = _engine_ir(engine, handle)
  return np.asarray(engine._state[buffer.id]).reshape((handle.repeats,) + handle.shape)


def write_buffer(engine, handle: RemoteBufferHandle, values) -> None:
  """Set the buffer's contents from host values (broadcast to ``[repeats, *shape]``)."""
  buffer = _engine_ir(engine, handle)
  values = np.broadcast_to(np.asarray(values, handle.dtype), (handle.repeats,) + handle.shape)
  engine._state[buffer.id] = jnp.asarray(values.reshape(buffer.storage_shape))
