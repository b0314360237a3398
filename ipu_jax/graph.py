"""A Poplar-like API for programming tiles directly.

Names follow Poplar in Python style. A tiny program (Poplar tutorial 3)::

    from ipu_jax import graph as g
    gr = g.Graph(ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4))
    v = gr.add_variable("float32", (4,), "v")
    gr.map_tensor_linearly(v)
    cs = gr.add_compute_set("double")

    @g.codelet(inputs=("x",), outputs=("y",), cycles=lambda x: 10)
    def double(x):
      return 2 * x

    gr.add_vertex(cs, double, tile=0, x=v, y=v)
    eng = g.Engine(gr, [g.Sequence([g.Execute(cs)])])
    eng.write_tensor(v, [1, 2, 3, 4]); eng.run(0); eng.read_tensor(v)

Tensors are views: indexing, slicing, reshaping, transposing and
concatenating give new views of the same tile memory (index arrays into the
graph's elements), exactly as Poplar's tensor expressions do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels.codelet import Codelet, codelet
from ipu_jax.kernels.estimators import vertex_cycles_per_tile
from ipu_jax.lowering import program as P
from ipu_jax.lowering.analysis import check_memory, profile_program
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost, to_flat, to_storage
from ipu_jax.lowering.executor import build_function
from ipu_jax.lowering.mapping import TileMapping, linear_chunk
from ipu_jax.target import IPUTarget

__all__ = [
    "Graph", "Tensor", "ComputeSet", "Vertex", "Engine", "codelet", "Codelet",
    "Sequence", "Execute", "Copy", "Repeat", "RepeatWhileTrue", "If", "Switch",
    "PrintTensor", "DataStream", "concatenate",
]


# -- tensors -----------------------------------------------------------------


class _Base:
  """Storage of a graph variable or constant: its elements and their tiles."""

  def __init__(self, graph, dtype, shape, name, category, value=None):
    self.graph = graph
    self.dtype = np.dtype(dtype)
    self.shape = tuple(int(d) for d in shape)
    self.size = int(np.prod(self.shape, dtype=np.int64))
    self.name = name
    self.category = category
    self.value = value
    self.element_tile = np.full(self.size, -1, np.int64)
    self.offset = graph._next_offset(self)


class Tensor:
  """A view of graph elements with a shape (Poplar's ``poplar::Tensor``).

  The view is an array of global element indices, so every view operation is
  a NumPy operation on that array and costs nothing on the device.
  """

  def __init__(self, graph: "Graph", index: np.ndarray, dtype):
    self.graph = graph
    self.index = np.asarray(index, np.int64)
    self.dtype = np.dtype(dtype)

  # shape queries
  @property
  def shape(self) -> tuple:
    return tuple(self.index.shape)

  @property
  def rank(self) -> int:
    return self.index.ndim

  def num_elements(self) -> int:
    return int(self.index.size)

  def __len__(self):
    return self.shape[0]

  def __repr__(self):
    return f"graph.Tensor(shape={self.shape}, dtype={self.dtype.name})"

  def _view(self, index) -> "Tensor":
    return Tensor(self.graph, index, self.dtype)

  # views (Poplar's tensor expressions)
  def __getitem__(self, key) -> "Tensor":
    return self._view(self.index[key])

  def index_(self, i: int) -> "Tensor":
    return self._view(self.index[i])

  def slice(self, begin: int, end: int, dim: int = 0) -> "Tensor":
    key = [slice(None)] * self.rank
    key[dim] = slice(begin, end)
    return self._view(self.index[tuple(key)])

  def flatten(self) -> "Tensor":
    return self._view(self.index.reshape(-1))

  def reshape(self, *shape) -> "Tensor":
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
      shape = tuple(shape[0])
    return self._view(self.index.reshape(shape))

  def transpose(self, *perm) -> "Tensor":
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
      perm = tuple(perm[0])
    return self._view(np.transpose(self.index, perm or None))

  dimshuffle = transpose

  @property
  def T(self) -> "Tensor":  # noqa: N802 - matches NumPy
    return self.transpose()

  def broadcast(self, times: int, dim: int) -> "Tensor":
    return self._view(np.repeat(self.index, times, axis=dim))

  def expand(self, dims: SequenceT[int]) -> "Tensor":
    return self._view(np.expand_dims(self.index, tuple(dims)))


def concatenate(tensors: SequenceT[Tensor], axis: int = 0) -> Tensor:
  """Join views along ``axis`` (Poplar's ``poplar::concat``)."""
  dtypes = {t.dtype for t in tensors}
  if len(dtypes) != 1:
    raise ValueError(f"concatenate needs one dtype, got {sorted(d.name for d in dtypes)}")
  return Tensor(tensors[0].graph, np.concatenate([t.index for t in tensors], axis), tensors[0].dtype)


# -- vertices and compute sets ------------------------------------------------


@dataclasses.dataclass(eq=False)
class Vertex:
  """A codelet instance on one tile with its field connections."""
  codelet: Codelet
  tile: int
  connections: dict
  perf_estimate: Optional[int] = None


@dataclasses.dataclass(eq=False)
class ComputeSet:
  """Vertices that run in parallel in one compute phase."""
  name: str
  vertices: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class DataStream:
  """A host FIFO (``graph.add_host_to_device_fifo`` / ``..._device_to_host_fifo``)."""
  name: str
  dtype: np.dtype
  num_elements: int
  to_device: bool


# -- programs (graph-level; the Engine turns them into the tile IR) -----------


class Sequence:
  def __init__(self, programs=(), *more):
    if not isinstance(programs, (list, tuple)):
      programs = (programs,)
    self.programs = list(programs) + list(more)

  def add(self, program):
    self.programs.append(program)
    return self


@dataclasses.dataclass(eq=False)
class Execute:
  compute_set: ComputeSet


@dataclasses.dataclass(eq=False)
class Copy:
  """Copy ``src`` to ``dst``: tensor to tensor, stream to tensor or back, or
  a remote buffer to a tensor or back (``offset``: first buffer row)."""
  src: Any
  dst: Any
  offset: Any = None


@dataclasses.dataclass(eq=False)
class Repeat:
  count: int
  body: Any


@dataclasses.dataclass(eq=False)
class RepeatWhileTrue:
  condition: Any
  predicate: Tensor
  body: Any


@dataclasses.dataclass(eq=False)
class If:
  predicate: Tensor
  then: Any
  else_: Any = None


@dataclasses.dataclass(eq=False)
class Switch:
  control: Tensor
  cases: list
  default: Any = None


@dataclasses.dataclass(eq=False)
class PrintTensor:
  title: str
  tensor: Tensor


# -- the graph ----------------------------------------------------------------


class Graph:
  """Tensors, their tile mappings, compute sets and vertices for a target."""

  def __init__(self, target: Optional[IPUTarget] = None):
    self.target = target if target is not None else IPUTarget.preset("ipu2")
    self._bases: list = []
    self._offsets: list = []
    self._size = 0
    self.compute_sets: list = []
    self.streams: dict = {}

  def _next_offset(self, base: _Base) -> int:
    offset = self._size
    self._bases.append(base)
    self._offsets.append(offset)
    self._size += base.size
    return offset

  def _new(self, dtype, shape, name, category, value=None) -> Tensor:
    base = _Base(self, dtype, shape, name, category, value)
    index = base.offset + np.arange(base.size, dtype=np.int64).reshape(base.shape)
    return Tensor(self, index, base.dtype)

  def add_variable(self, dtype, shape, name: str = "") -> Tensor:
    """A new variable (uninitialised, zeros in the emulator)."""
    return self._new(dtype, shape, name or f"var{len(self._bases)}", "variables")

  def add_constant(self, dtype, shape, value, name: str = "") -> Tensor:
    """A constant; ``value`` broadcasts to ``shape``."""
    value = np.broadcast_to(np.asarray(value, dtype=np.dtype(dtype)), tuple(shape)).copy()
    return self._new(dtype, shape, name or f"const{len(self._bases)}", "constants", value)

  def clone(self, tensor: Tensor, name: str = "") -> Tensor:
    """A new variable shaped and mapped like ``tensor``."""
    out = self.add_variable(tensor.dtype, tensor.shape, name)
    tiles = self._element_tiles(tensor.index)
    self._set_tiles(out.index, tiles)
    return out

  # bookkeeping of global element indices
  def _base_of(self, index: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.asarray(self._offsets), index, side="right") - 1

  def _element_tiles(self, index: np.ndarray) -> np.ndarray:
    flat = index.reshape(-1)
    out = np.empty(flat.size, np.int64)
    bases = self._base_of(flat)
    for b in np.unique(bases):
      base = self._bases[b]
      sel = bases == b
      out[sel] = base.element_tile[flat[sel] - base.offset]
    return out.reshape(index.shape)

  def _set_tiles(self, index: np.ndarray, tiles) -> None:
    flat = index.reshape(-1)
    tiles = np.broadcast_to(np.asarray(tiles, np.int64).reshape(-1) if np.ndim(tiles) else tiles, flat.shape)
    bases = self._base_of(flat)
    for b in np.unique(bases):
      base = self._bases[b]
      sel = bases == b
      base.element_tile[flat[sel] - base.offset] = tiles[sel]

  # mappings
  def set_tile_mapping(self, what, tile: int) -> None:
    """Map a tensor view's elements (or a vertex) to ``tile``."""
    if isinstance(what, Vertex):
      what.tile = int(tile)
      return
    if not 0 <= tile < self.target.num_tiles:
      raise ValueError(f"tile {tile} is out of range; the target has tiles 0..{self.target.num_tiles - 1}")
    self._set_tiles(what.index, int(tile))

  def get_tile_mapping(self, tensor: Tensor) -> dict:
    """``{tile: [flat element indices of the view]}`` for the view."""
    tiles = self._element_tiles(tensor.index).reshape(-1)
    return {int(t): np.nonzero(tiles == t)[0].tolist() for t in np.unique(tiles)}

  def map_tensor_linearly(self, tensor: Tensor, min_elements_per_tile: int = 0,
                          grain_size: int = 0) -> None:
    """Spread the view over tiles in equal chunks (``mapTensorLinearly``)."""
    n = tensor.num_elements()
    if n == 0:
      return
    itemsize = tensor.dtype.itemsize
    grain = grain_size or max(1, 8 // itemsize)
    # Without an explicit minimum, at least 128 bytes per tile, as Poplar.
    min_bytes = min_elements_per_tile * itemsize if min_elements_per_tile else 128
    chunk = linear_chunk(n, self.target.num_tiles, itemsize, grain * itemsize, min_bytes)
    self._set_tiles(tensor.index, np.arange(n) // chunk)

  # compute
  def add_compute_set(self, name: str = "") -> ComputeSet:
    cs = ComputeSet(name or f"cs{len(self.compute_sets)}")
    self.compute_sets.append(cs)
    return cs

  def add_vertex(self, compute_set: ComputeSet, codelet_: Codelet, tile: int = 0,
                 **connections) -> Vertex:
    """Add a vertex running ``codelet_`` on ``tile``, fields connected to views."""
    if not isinstance(codelet_, Codelet):
      raise TypeError("add_vertex needs a Codelet (decorate the function with @graph.codelet)")
    missing = [f for f in codelet_.fields if f not in connections]
    unknown = [f for f in connections if f not in codelet_.fields]
    if missing or unknown:
      raise ValueError(f"vertex {codelet_.name}: fields {codelet_.fields}; "
                       f"missing {missing}, unknown {unknown}")
    if not 0 <= tile < self.target.num_tiles:
      raise ValueError(f"tile {tile} is out of range; the target has tiles 0..{self.target.num_tiles - 1}")
    for field, value in connections.items():
      if not isinstance(value, Tensor):
        raise TypeError(f"vertex {codelet_.name}: field {field!r} must be a graph Tensor")
    vertex = Vertex(codelet_, int(tile), dict(connections))
    compute_set.vertices.append(vertex)
    return vertex

  def set_perf_estimate(self, vertex: Vertex, cycles: int) -> None:
    vertex.perf_estimate = int(cycles)

  # host streams
  def add_remote_buffer(self, name: str, dtype, shape, repeats: int = 1):
    """A buffer of ``repeats`` rows of ``shape`` in streaming memory.

    Copy it to and from tile tensors with ``Copy(buffer, tensor, offset)`` /
    ``Copy(tensor, buffer, offset)``; see :mod:`ipu_jax.remote_buffers`.
    """
    from ipu_jax import remote_buffers
    return remote_buffers.add_remote_buffer(self, name, dtype, shape, repeats)

  def add_host_to_device_fifo(self, name: str, dtype, num_elements: int) -> DataStream:
    stream = DataStream(name, np.dtype(dtype), int(num_elements), True)
    self.streams[name] = stream
    return stream

  def add_device_to_host_fifo(self, name: str, dtype, num_elements: int) -> DataStream:
    stream = DataStream(name, np.dtype(dtype), int(num_elements), False)
    self.streams[name] = stream
    return stream


# -- the engine: graph programs -> tile IR -> one jitted function each --------


class _Lowerer:
  """Turns graph programs into the tile IR, building steps for compute sets."""

  def __init__(self, graph: Graph, ir: list):
    self.graph = graph
    self.ir = ir  # this engine's IR tensor of each graph base tensor
    self.target = graph.target
    self.streams = {}
    self.cache = {}

  def base_ir(self, b: int) -> P.Tensor:
    return self.ir[b]

  def split(self, index: np.ndarray):
    """``(base numbers, local indices)`` of global element indices."""
    flat = index.reshape(-1)
    bases = self.graph._base_of(flat)
    offsets = np.asarray(self.graph._offsets)[bases]
    return bases, flat - offsets

  def whole_base(self, view: Tensor) -> Optional[P.Tensor]:
    """The base tensor if the view is exactly it, in order."""
    flat = view.index.reshape(-1)
    if flat.size == 0:
      return None
    b = int(self.graph._base_of(flat[:1])[0])
    base = self.graph._bases[b]
    if flat.size == base.size and np.array_equal(flat, base.offset + np.arange(base.size)):
      return self.ir[b]
    return None

  # programs
  def lower(self, program):
    if isinstance(program, Sequence):
      return P.Sequence([self.lower(p) for p in program.programs])
    if isinstance(program, (list, tuple)):
      return P.Sequence([self.lower(p) for p in program])
    if isinstance(program, Execute):
      key = id(program.compute_set)
      if key not in self.cache:
        self.cache[key] = self.compute_set_step(program.compute_set)
      return self.cache[key]
    if isinstance(program, Copy):
      from ipu_jax import remote_buffers
      if remote_buffers.is_handle(program.src) or remote_buffers.is_handle(program.dst):
        return remote_buffers.lower_copy(self, program.src, program.dst, program.offset)
      if program.offset is not None:
        raise ValueError("Copy offset is only for copies to or from a remote buffer.")
      return self.copy(program.src, program.dst)
    if isinstance(program, Repeat):
      return P.Repeat(int(program.count), self.lower(program.body))
    if isinstance(program, RepeatWhileTrue):
      pred, prep = self.materialise(program.predicate, "predicate")
      return P.RepeatWhileTrue(P.Sequence([self.lower(program.condition), prep]),
                               pred, self.lower(program.body))
    if isinstance(program, If):
      pred, prep = self.materialise(program.predicate, "predicate")
      return P.Sequence([prep, P.If(pred, self.lower(program.then),
                                    None if program.else_ is None else self.lower(program.else_))])
    if isinstance(program, Switch):
      control, prep = self.materialise(program.control, "control")
      return P.Sequence([prep, P.Switch(control, [(int(v), self.lower(p)) for v, p in program.cases],
                                        None if program.default is None else self.lower(program.default))])
    if isinstance(program, PrintTensor):
      tensor, prep = self.materialise(program.tensor, program.title)
      return P.Sequence([prep, P.PrintTensor(program.title, tensor)])
    if program is None:
      return P.Sequence()
    raise TypeError(f"not a graph program: {program!r}")

  def materialise(self, view: Tensor, name: str):
    """An IR tensor holding ``view``: the base itself or a copy of the view."""
    whole = self.whole_base(view)
    if whole is not None:
      return whole, P.Sequence()
    tiles = self.graph._element_tiles(view.index).reshape(-1)
    temp = P.Tensor(f"{name}.view", view.shape, view.dtype,
                    TileMapping.from_element_tiles(tiles), category="temporaries", op="view")
    return temp, self.gather_step(view, temp, f"view {name}")

  def gather_step(self, view: Tensor, dst: P.Tensor, name: str) -> P.Superstep:
    """Copy the elements of ``view`` into IR tensor ``dst``."""
    bases, local = self.split(view.index)
    used = np.unique(bases)
    reads = [self.base_ir(b) for b in used]
    starts = np.concatenate([[0], np.cumsum([t.size for t in reads])[:-1]]).astype(np.int64)
    position = starts[np.searchsorted(used, bases)] + local
    src_tiles = self.graph._element_tiles(view.index).reshape(-1)
    cost = movement_cost(self.target, src_tiles, dst.mapping.element_tile,
                         view.dtype.itemsize, element_id=view.index.reshape(-1))

    def fn(*storages):
      flat = jnp.concatenate([to_flat(s, t.mapping) for s, t in zip(storages, reads)])
      return (to_storage(flat[position].astype(dst.dtype), dst.mapping),)

    return P.Superstep(name=name, op="Copy", reads=tuple(reads), writes=(dst,), fn=fn,
                       exchange=cost)

  def copy(self, src, dst):
    if isinstance(src, DataStream) or isinstance(dst, DataStream):
      stream, view = (src, dst) if isinstance(src, DataStream) else (dst, src)
      ir_stream = self.streams.setdefault(stream.name, P.HostStream(
          stream.name, stream.dtype, stream.num_elements, stream.to_device))
      if view.num_elements() != stream.num_elements:
        raise ValueError(f"stream {stream.name} moves {stream.num_elements} elements "
                         f"but the tensor has {view.num_elements()}")
      whole = self.whole_base(view)
      if stream.to_device:
        if whole is not None:
          return P.StreamCopy(ir_stream, whole)
        tiles = self.graph._element_tiles(view.index).reshape(-1)
        temp = P.Tensor(f"{stream.name}.landing", view.shape, view.dtype,
                        TileMapping.from_element_tiles(tiles), op="StreamCopy")
        return P.Sequence([P.StreamCopy(ir_stream, temp), self.scatter_step(temp, view)])
      tensor, prep = self.materialise(view, stream.name)
      return P.Sequence([prep, P.StreamCopy(ir_stream, tensor)])
    if src.shape != dst.shape:
      raise ValueError(f"Copy needs equal shapes, got {src.shape} and {dst.shape}")
    temp, prep = self.materialise(src, "copy")
    return P.Sequence([prep, self.scatter_step(temp, dst)])

  def scatter_step(self, src: P.Tensor, view: Tensor) -> P.Superstep:
    """Write IR tensor ``src`` into the elements of ``view``."""
    bases, local = self.split(view.index)
    used = np.unique(bases)
    targets = [self.base_ir(b) for b in used]
    selections = [(np.nonzero(bases == b)[0], local[bases == b]) for b in used]
    dst_tiles = self.graph._element_tiles(view.index).reshape(-1)
    cost = movement_cost(self.target, src.mapping.element_tile, dst_tiles, src.itemsize)

    def fn(src_storage, *storages):
      values = to_flat(src_storage, src.mapping)
      outs = []
      for storage, tensor, (sel, idx) in zip(storages, targets, selections):
        flat = to_flat(storage, tensor.mapping).at[idx].set(values[sel].astype(tensor.dtype))
        outs.append(to_storage(flat, tensor.mapping))
      return tuple(outs)

    return P.Superstep(name=f"copy to {targets[0].name}", op="Copy",
                       reads=(src,) + tuple(targets), writes=tuple(targets), fn=fn,
                       exchange=cost)

  def compute_set_step(self, cs: ComputeSet) -> P.Superstep:
    """One superstep for a compute set: exchange operands in, run vertices."""
    target = self.target
    groups = {}
    for v in cs.vertices:
      key = (v.codelet, tuple((f, v.connections[f].shape, v.connections[f].dtype)
                              for f in v.codelet.fields))
      groups.setdefault(key, []).append(v)
    all_read_bases, all_written_bases = set(), set()
    plans = []
    src_tiles, dst_tiles, element_ids, itemsizes = [], [], [], []
    vertex_tiles, vertex_cycles = [], []
    flops = 0
    for (cdl, fields), vertices in groups.items():
      tiles = np.array([v.tile for v in vertices], np.int64)
      stacked = {f: np.stack([v.connections[f].index for v in vertices]) for f in cdl.fields}
      for f in cdl.fields:
        bases, _ = self.split(stacked[f])
        if f in cdl.written_fields:
          all_written_bases.update(np.unique(bases).tolist())
        if f in cdl.read_fields:
          all_read_bases.update(np.unique(bases).tolist())
        # Every element a vertex touches must reach its tile.
        el_tiles = self.graph._element_tiles(stacked[f]).reshape(len(vertices), -1)
        per_vertex = el_tiles.shape[1]
        vt = np.repeat(tiles, per_vertex)
        flat_ids = stacked[f].reshape(-1)
        itemsize = fields[[x[0] for x in fields].index(f)][2].itemsize
        if f in cdl.read_fields:
          src_tiles.append(el_tiles.reshape(-1)); dst_tiles.append(vt)
          element_ids.append(flat_ids); itemsizes.append(np.full(vt.size, itemsize))
        if f in cdl.written_fields:
          src_tiles.append(vt); dst_tiles.append(el_tiles.reshape(-1))
          element_ids.append(flat_ids + (1 << 40)); itemsizes.append(np.full(vt.size, itemsize))
      specs = [_Spec(shape, dtype) for _, shape, dtype in fields]
      estimate = cdl.estimate(*specs)
      per_vertex_cycles = np.array([v.perf_estimate if v.perf_estimate is not None else estimate
                                    for v in vertices], np.float64)
      vertex_tiles.append(tiles)
      vertex_cycles.append(per_vertex_cycles)
      if cdl.flops is not None:
        flops += int(cdl.flops(*specs)) * len(vertices)
      plans.append((cdl, stacked))

    read_bases = sorted(all_read_bases | all_written_bases)
    written_bases = sorted(all_written_bases)
    reads = [self.base_ir(b) for b in read_bases]
    writes = [self.base_ir(b) for b in written_bases]
    write_mappings = [t.mapping for t in writes]
    by_dtype = {}
    for b in read_bases:
      by_dtype.setdefault(self.graph._bases[b].dtype, []).append(b)
    # Per dtype: one flat buffer of all the bases read, and each field's
    # positions in it, fixed now.
    layout = {}
    for dtype, bs in by_dtype.items():
      sizes = [self.graph._bases[b].size for b in bs]
      starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
      layout[dtype] = (bs, dict(zip(bs, starts)))
    # Each field's positions in its dtype's buffer, fixed at compile time.
    base_start = {dtype: np.array([starts.get(b, 0) for b in range(len(self.graph._bases))],
                                  np.int64)
                  for dtype, (_, starts) in layout.items()}
    gathers = []
    for cdl, stacked in plans:
      positions = {}
      for f in cdl.fields:
        bases, local = self.split(stacked[f])
        dtype = self.graph._bases[int(bases[0])].dtype if bases.size else np.dtype("float32")
        index = (base_start[dtype][bases] + local).reshape(stacked[f].shape)
        positions[f] = (dtype, index, bases, local)
      gathers.append(positions)
    graph = self.graph

    def fn(*storages):
      flats = {b: to_flat(s, t.mapping) for b, s, t in zip(read_bases, storages, reads)}
      buffers = {dtype: jnp.concatenate([flats[b] for b in bs]) if bs else jnp.zeros((0,), dtype)
                 for dtype, (bs, _) in layout.items()}
      new_flats = {b: flats[b] for b in written_bases}
      for (cdl, stacked), positions in zip(plans, gathers):
        operands = [buffers[positions[f][0]][positions[f][1]] for f in cdl.read_fields]
        results = jax.vmap(cdl.fn)(*operands)
        if not isinstance(results, (tuple, list)):
          results = (results,)
        if len(results) != len(cdl.written_fields):
          raise ValueError(f"codelet {cdl.name} returned {len(results)} values for fields "
                           f"{cdl.written_fields}")
        for f, value in zip(cdl.written_fields, results):
          _, _, bases, local = positions[f]
          value = jnp.reshape(value, (-1,))
          for b in np.unique(bases):
            sel = np.nonzero(bases == b)[0]
            tensor = graph._bases[int(b)]
            new_flats[int(b)] = new_flats[int(b)].at[local[sel]].set(value[sel].astype(tensor.dtype))
      return tuple(to_storage(new_flats[b], m) for b, m in zip(written_bases, write_mappings))

    vt = np.concatenate(vertex_tiles) if vertex_tiles else np.zeros(0, np.int64)
    vc = np.concatenate(vertex_cycles) if vertex_cycles else np.zeros(0)
    compute = vertex_cycles_per_tile(target, vt, vc)
    vertices = np.bincount(vt, minlength=target.num_tiles)[:target.num_tiles]
    exchange = None
    if src_tiles:
      st, dt, ids, isz = (np.concatenate(x) for x in (src_tiles, dst_tiles, element_ids, itemsizes))
      # Vertices on one tile share what it receives: an element moves to a
      # tile once however many of its vertices read it.
      _, once = np.unique(np.stack([ids, dt]), axis=1, return_index=True)
      st, dt, ids, isz = st[once], dt[once], ids[once], isz[once]
      exchange = ExchangeCost.zeros(target)
      for size in np.unique(isz):
        sel = isz == size
        exchange = exchange + movement_cost(target, st[sel], dt[sel], int(size), element_id=ids[sel])
    return P.Superstep(name=cs.name, op=f"Execute({cs.name})", reads=tuple(reads), writes=tuple(writes),
                       fn=fn, compute_cycles=compute, exchange=exchange, vertices=vertices,
                       codelets=tuple(sorted({c.name for c, _ in plans})), flops=flops)


@dataclasses.dataclass
class _Spec:
  """Shape and dtype of a vertex field, given to cycle estimators."""
  shape: tuple
  dtype: np.dtype

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def ndim(self) -> int:
    return len(self.shape)


class Engine:
  """Compiles a graph's programs and runs them (``poplar::Engine``).

  Args:
    graph: the graph.
    programs: a program or a list of programs; ``run(i)`` runs the i-th.
    allow_out_of_memory: lower even if a tile overflows (then only the
      report can be read; running is refused).

  Raises:
    OutOfMemoryError: before anything runs, if a tile's peak exceeds its SRAM.
  """

  def __init__(self, graph: Graph, programs, *, allow_out_of_memory: bool = False,
               name: str = "graph"):
    self.graph = graph
    self.target = graph.target
    if not isinstance(programs, (list, tuple)):
      programs = [programs]
    for base in graph._bases:
      if base.size and (base.element_tile < 0).any():
        n = int((base.element_tile < 0).sum())
        raise ValueError(f"tensor {base.name!r} has {n} element(s) without a tile mapping; "
                         "call set_tile_mapping or map_tensor_linearly")
    # This engine's own IR tensors: mappings are frozen now, so changing the
    # graph afterwards (or building another engine on it) cannot affect it.
    self._ir = [P.Tensor(base.name, base.shape, base.dtype,
                         TileMapping.from_element_tiles(base.element_tile),
                         category=base.category, value=base.value, op="graph")
                for base in graph._bases]
    lowerer = _Lowerer(graph, self._ir)
    self._programs = [lowerer.lower(p) for p in programs]
    self._streams = lowerer.streams
    from ipu_jax import remote_buffers
    self._remote_buffers = remote_buffers.engine_buffers(graph, lowerer)
    self._persistent = list(self._ir) + self._remote_buffers
    self.profiles = [profile_program(p, self.target, persistent=self._persistent,
                                     name=f"{name}[{i}]")
                     for i, p in enumerate(self._programs)]
    self.allow_out_of_memory = allow_out_of_memory
    self.out_of_memory = False
    for profile in self.profiles:
      if profile.memory.over_limit_tiles.size:
        self.out_of_memory = True
      check_memory(profile, allow_out_of_memory=allow_out_of_memory,
                   report=_make_report(profile), what=profile.name)
    self._state = {}
    for t in self._ir:
      if t.value is not None:
        self._state[t.id] = to_storage(jnp.asarray(t.value.reshape(-1)), t.mapping)
      else:
        self._state[t.id] = jnp.zeros(t.storage_shape, t.dtype)
    self._state.update(remote_buffers.initial_state(self._remote_buffers))
    self._host_buffers = {}
    self._functions = {}

  def connect_stream(self, name: str, buffer: np.ndarray) -> None:
    """Attach a host array to a stream (read from, or written into in place)."""
    if name not in self.graph.streams:
      raise KeyError(f"no stream named {name!r}; streams: {sorted(self.graph.streams)}")
    stream = self.graph.streams[name]
    buffer = np.asarray(buffer) if stream.to_device else buffer
    if not isinstance(buffer, np.ndarray):
      raise TypeError("device-to-host streams write into a NumPy array; pass one")
    self._host_buffers[name] = buffer
    self._state[f"stream:{name}:buffer"] = jnp.asarray(buffer.reshape(-1))
    self._state[f"stream:{name}:cursor"] = jnp.int32(0)

  def _function(self, index: int):
    if index not in self._functions:
      tensors = {t.id: t for t in self._ir}
      for program in [self._programs[index]]:
        for node, _, _ in P.iter_steps(program):
          for t in (list(node.reads) + list(node.writes) if isinstance(node, P.Superstep)
                    else [node.tensor]):
            tensors[t.id] = t
      keys = sorted(self._state, key=str)
      self._functions[index] = (keys, build_function(self._programs[index], tensors, keys, keys))
    return self._functions[index]

  def run(self, index: int = 0) -> None:
    """Run program ``index`` (one host call)."""
    if self.out_of_memory:
      raise RuntimeError("this engine was lowered with allow_out_of_memory and a tile "
                         "is over its SRAM; it cannot run (read engine.report())")
    for name, stream in self._streams.items():
      if name not in self._host_buffers:
        raise RuntimeError(f"stream {name!r} is used but not connected (connect_stream)")
    keys, fn = self._function(index)
    missing = [k for k in keys if k not in self._state]
    if missing:
      raise RuntimeError(f"state keys missing: {missing}")
    outputs = fn(*[self._state[k] for k in keys])
    self._state = dict(zip(keys, outputs))
    for name, buffer in self._host_buffers.items():
      if not self.graph.streams[name].to_device:
        buffer.reshape(-1)[...] = np.asarray(self._state[f"stream:{name}:buffer"])

  def _flat(self, b: int):
    tensor = self._ir[b]
    return np.asarray(to_flat(self._state[tensor.id], tensor.mapping))

  def read_tensor(self, tensor: Tensor) -> np.ndarray:
    """The current value of a view (or of a remote buffer), as a NumPy array."""
    from ipu_jax import remote_buffers
    if remote_buffers.is_handle(tensor):
      return remote_buffers.read_buffer(self, tensor)
    bases = self.graph._base_of(tensor.index.reshape(-1))
    out = np.empty(tensor.index.size, tensor.dtype)
    for b in np.unique(bases):
      sel = bases == b
      out[sel] = self._flat(int(b))[tensor.index.reshape(-1)[sel] - self.graph._bases[b].offset]
    return out.reshape(tensor.shape)

  def write_tensor(self, tensor: Tensor, values) -> None:
    """Set a view's elements (or a remote buffer's rows) from host values."""
    from ipu_jax import remote_buffers
    if remote_buffers.is_handle(tensor):
      return remote_buffers.write_buffer(self, tensor, values)
    values = np.broadcast_to(np.asarray(values, tensor.dtype), tensor.shape).reshape(-1)
    flat_index = tensor.index.reshape(-1)
    bases = self.graph._base_of(flat_index)
    for b in np.unique(bases):
      base = self.graph._bases[int(b)]
      sel = bases == b
      flat = self._flat(int(b)).copy()
      flat[flat_index[sel] - base.offset] = values[sel]
      ir = self._ir[int(b)]
      self._state[ir.id] = to_storage(jnp.asarray(flat), ir.mapping)

  def report(self, index: int = 0):
    """The :class:`ipu_jax.Report` of program ``index``."""
    return _make_report(self.profiles[index])

  @property
  def profile(self):
    return self.profiles[0]


def _make_report(profile):
  try:
    from ipu_jax.report import Report
  except ImportError:  # the report module is optional for the core
    return profile
  return Report(profile)
