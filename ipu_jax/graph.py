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

Tensors (:class:`GraphTensor`, apart from the tile program's
``ipu_jax.lowering.Tensor``) are views: indexing, slicing, reshaping,
transposing and concatenating give new views of the same tile memory (index arrays into the
graph's elements), exactly as Poplar's tensor expressions do.

Programs are the tile program IR's own nodes (``lowering/program.py``):
``Sequence``, ``Repeat``, ``RepeatWhileTrue``, ``If``, ``Switch`` and
``PrintTensor`` are those classes, and a ``DataStream`` is a
``HostStream``. Only two leaves need the graph, so they are defined here:
:class:`Execute` (run a compute set) and :class:`Copy` (between views or
streams). Building an :class:`Engine` freezes the tile mappings and resolves
them (``ipu_jax/graph_lowering.py``), then takes each program through the
stages ``ipu_jax.jit`` uses (``ipu_jax/stages.py``: a ``Lowered`` with its
profile, report and memory check, compiled when it first runs, the graph's
tensors and streams as its device state): each compute set becomes one superstep
(exchange in, vertices ``vmap``-ed over tiles), each copy a gather/scatter
step, and each view a predicate, control or printed tensor names becomes a
tensor of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence as SequenceT

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.graph_lowering import GraphLeaf, GraphLowerer
from ipu_jax.kernels.codelet import Codelet, codelet
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import host_flat, host_storage
from ipu_jax.lowering.mapping import TileMapping, linear_chunk
from ipu_jax.stages import Lowered
from ipu_jax.kernels.target import IPUTarget

__all__ = [
    "Graph", "GraphTensor", "ComputeSet", "Vertex", "Engine", "codelet", "Codelet",
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


class GraphTensor:
  """A view of graph elements with a shape (Poplar's ``poplar::Tensor``).

  Named apart from the tile program's ``ipu_jax.lowering.Tensor`` (what a
  lowering rule reads and writes): a graph tensor is a view the engine
  resolves into such tensors when it freezes the tile mappings.

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
    return f"GraphTensor(shape={self.shape}, dtype={self.dtype.name})"

  def _view(self, index) -> "GraphTensor":
    return GraphTensor(self.graph, index, self.dtype)

  # views (Poplar's tensor expressions)
  def __getitem__(self, key) -> "GraphTensor":
    return self._view(self.index[key])

  def index_(self, i: int) -> "GraphTensor":
    return self._view(self.index[i])

  def slice(self, begin: int, end: int, dim: int = 0) -> "GraphTensor":
    size = self.shape[dim]
    if not 0 <= begin <= end <= size:  # Poplar refuses it; NumPy would clamp
      raise ValueError(f"slice({begin}, {end}) of dimension {dim} (size {size}) is out of "
                       f"range: need 0 <= begin <= end <= {size}.")
    key = [slice(None)] * self.rank
    key[dim] = slice(begin, end)
    return self._view(self.index[tuple(key)])

  def flatten(self) -> "GraphTensor":
    return self._view(self.index.reshape(-1))

  def reshape(self, *shape) -> "GraphTensor":
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
      shape = tuple(shape[0])
    return self._view(self.index.reshape(shape))

  def transpose(self, *perm) -> "GraphTensor":
    if len(perm) == 1 and isinstance(perm[0], (tuple, list)):
      perm = tuple(perm[0])
    return self._view(np.transpose(self.index, perm or None))

  dimshuffle = transpose

  @property
  def T(self) -> "GraphTensor":  # noqa: N802 - matches NumPy
    return self.transpose()

  def broadcast(self, times: int, dim: int) -> "GraphTensor":
    return self._view(np.repeat(self.index, times, axis=dim))

  def expand(self, dims: SequenceT[int]) -> "GraphTensor":
    return self._view(np.expand_dims(self.index, tuple(dims)))


def concatenate(tensors: SequenceT[GraphTensor], axis: int = 0) -> GraphTensor:
  """Join views along ``axis`` (Poplar's ``poplar::concat``)."""
  dtypes = {t.dtype for t in tensors}
  if len(dtypes) != 1:
    raise ValueError(f"concatenate needs one dtype, got {sorted(d.name for d in dtypes)}")
  index = np.concatenate([t.index for t in tensors], axis)
  return GraphTensor(tensors[0].graph, index, tensors[0].dtype)


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


# -- programs: the IR's control nodes, plus the two leaves that need a graph ---

Sequence = P.Sequence
Repeat = P.Repeat
RepeatWhileTrue = P.RepeatWhileTrue
If = P.If
Switch = P.Switch
PrintTensor = P.PrintTensor
DataStream = P.HostStream  # a host FIFO: graph.add_host_to_device_fifo / ..._device_to_host_fifo


@dataclasses.dataclass(eq=False)
class Execute(GraphLeaf):
  """Run the vertices of a compute set (one superstep once the Engine is built)."""
  compute_set: ComputeSet

  def resolve(self, lowerer: GraphLowerer):
    return lowerer.execute(self.compute_set)


@dataclasses.dataclass(eq=False)
class Copy(GraphLeaf):
  """Copy ``src`` to ``dst``: tensor to tensor, stream to tensor or back, or
  a remote buffer to a tensor or back (``offset``: first buffer row)."""
  src: Any
  dst: Any
  offset: Any = None

  def resolve(self, lowerer: GraphLowerer):
    from ipu_jax import remote_buffers
    if remote_buffers.is_handle(self.src) or remote_buffers.is_handle(self.dst):
      return remote_buffers.lower_copy(lowerer, self.src, self.dst, self.offset)
    if self.offset is not None:
      raise ValueError("Copy offset is only for copies to or from a remote buffer.")
    return lowerer.copy(self.src, self.dst)


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
    self.remote_buffers: dict = {}  # name -> handle (ipu_jax.remote_buffers)
    self.cpp_vertex_classes: dict = {}  # name -> (VertexClass, cycles), by add_codelets

  def _next_offset(self, base: _Base) -> int:
    offset = self._size
    self._bases.append(base)
    self._offsets.append(offset)
    self._size += base.size
    return offset

  def _new(self, dtype, shape, name, category, value=None) -> GraphTensor:
    base = _Base(self, dtype, shape, name, category, value)
    index = base.offset + np.arange(base.size, dtype=np.int64).reshape(base.shape)
    return GraphTensor(self, index, base.dtype)

  def add_variable(self, dtype, shape, name: str = "") -> GraphTensor:
    """A new variable (uninitialised, zeros in the emulator)."""
    return self._new(dtype, shape, name or f"var{len(self._bases)}", "variables")

  def add_constant(self, dtype, shape, value, name: str = "") -> GraphTensor:
    """A constant; ``value`` broadcasts to ``shape``."""
    value = np.broadcast_to(np.asarray(value, dtype=np.dtype(dtype)), tuple(shape)).copy()
    return self._new(dtype, shape, name or f"const{len(self._bases)}", "constants", value)

  def clone(self, tensor: GraphTensor, name: str = "") -> GraphTensor:
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

  def get_tile_mapping(self, tensor: GraphTensor) -> dict:
    """``{tile: [flat element indices of the view]}`` for the view."""
    tiles = self._element_tiles(tensor.index).reshape(-1)
    if tiles.size == 0:
      return {}
    # One stable sort groups the positions by tile, each group in order.
    order = np.argsort(tiles, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(tiles[order])) + 1)
    return {int(tiles[group[0]]): group.tolist() for group in groups}

  def map_tensor_linearly(self, tensor: GraphTensor, min_elements_per_tile: int = 0,
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

  def add_codelets(self, path_or_source, *, include_dirs=(), defines=(), cycles=None):
    """Compile a C++ codelet file and register every vertex class it defines.

    As Poplar's ``Graph::addCodelets``; see docs/cpp_codelets.md.

    Args:
      path_or_source: a ``.cpp`` path or the C++ source text.
      include_dirs, defines: more ``-I`` directories and ``-D`` macros.
      cycles: the author's estimate, ``cycles(fields) -> int`` (or an int),
        for every class, or a dict by class name; without one a class is
        priced by an estimate from its work (``ipu_jax/cpp_codelets/cost.py``).

    Returns:
      The :class:`ipu_jax.cpp_codelets.CodeletLibrary`.
    """
    from ipu_jax import cpp_codelets
    lib = cpp_codelets.compile_codelets(path_or_source, include_dirs=include_dirs,
                                        defines=defines)
    for name, vclass in lib.vertex_classes.items():
      estimate = cycles.get(name) if isinstance(cycles, dict) else cycles
      self.cpp_vertex_classes[name] = (vclass, estimate)
    return lib

  def add_vertex(self, compute_set: ComputeSet, codelet_, tile: int = 0,
                 **connections) -> Vertex:
    """Add a vertex running ``codelet_`` on ``tile``, fields connected to views.

    ``codelet_`` is a :class:`Codelet`, or the name of a C++ vertex class
    registered by :meth:`add_codelets` (as Poplar's ``addVertex``): its
    Input/Output/InOut fields connect to views (vectors flattened, lists as
    a list of views), plain members take values (``setInitialValue``);
    ``cycles=`` gives the class's estimate for this vertex unless it has a
    field of that name.
    """
    if not 0 <= tile < self.target.num_tiles:
      raise ValueError(f"tile {tile} is out of range; the target has tiles 0..{self.target.num_tiles - 1}")
    if isinstance(codelet_, str):
      codelet_, connections = self._cpp_vertex(codelet_, int(tile), connections)
    if not isinstance(codelet_, Codelet):
      raise TypeError("add_vertex needs a Codelet (decorate the function with @graph.codelet) "
                      "or the name of a C++ vertex class registered with add_codelets")
    missing = [f for f in codelet_.fields if f not in connections]
    unknown = [f for f in connections if f not in codelet_.fields]
    if missing or unknown:
      raise ValueError(f"vertex {codelet_.name}: fields {codelet_.fields}; "
                       f"missing {missing}, unknown {unknown}")
    for field, value in connections.items():
      if not isinstance(value, GraphTensor):
        raise TypeError(f"vertex {codelet_.name}: field {field!r} must be a GraphTensor")
    vertex = Vertex(codelet_, int(tile), dict(connections))
    compute_set.vertices.append(vertex)
    return vertex

  def _cpp_vertex(self, name: str, tile: int, connections: dict):
    """``(codelet, views)`` of a vertex of the registered C++ class ``name``."""
    from ipu_jax.cpp_codelets import graph_vertex
    from ipu_jax.cpp_codelets.build import normalise_name
    entry = self.cpp_vertex_classes.get(name) or next(
        (e for n, e in self.cpp_vertex_classes.items() if normalise_name(n) == normalise_name(name)),
        None)
    if entry is None:
      raise ValueError(f"no vertex class {name!r}: add_codelets registered "
                       f"{sorted(self.cpp_vertex_classes) or 'none'}")
    vclass, cycles = entry
    if "cycles" in connections and all(f.name != "cycles" for f in vclass.fields):
      connections = dict(connections)
      cycles = connections.pop("cycles")
    return graph_vertex.connect(self, vclass, tile, connections, cycles)

  def set_perf_estimate(self, vertex: Vertex, cycles: int) -> None:
    """The vertex's cycles, as Poplar's ``setPerfEstimate`` (overrides any estimator)."""
    if int(cycles) < 0:
      raise ValueError(f"set_perf_estimate: cycles must be >= 0; got {cycles}.")
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
    stream = DataStream(name, np.dtype(dtype), _stream_elements(name, num_elements), True)
    self.streams[name] = stream
    return stream

  def add_device_to_host_fifo(self, name: str, dtype, num_elements: int) -> DataStream:
    stream = DataStream(name, np.dtype(dtype), _stream_elements(name, num_elements), False)
    self.streams[name] = stream
    return stream


def _stream_elements(name: str, num_elements) -> int:
  """A FIFO's elements per transfer: an int >= 1."""
  if isinstance(num_elements, bool) or int(num_elements) != num_elements or num_elements < 1:
    raise ValueError(f"stream {name!r}: num_elements must be an int >= 1 (elements a transfer "
                     f"moves); got {num_elements!r}.")
  return int(num_elements)


# -- the engine: graph programs -> tile IR -> one jitted function each --------



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
    lowerer = GraphLowerer(graph, self._ir)
    programs = [lowerer.lower(p) for p in programs]
    self._streams = lowerer.streams
    from ipu_jax import remote_buffers
    self._remote_buffers = remote_buffers.engine_buffers(graph, lowerer)
    # Laid out on the host and transferred: an eager jnp.zeros compiles an XLA
    # program per storage shape.
    self._state = {}
    for t in self._ir:
      if t.value is not None:
        self._state[t.id] = jax.device_put(host_storage(np.asarray(t.value).reshape(-1), t.mapping))
      else:
        self._state[t.id] = jax.device_put(np.zeros(t.storage_shape, t.dtype))
    self._state.update(remote_buffers.initial_state(self._remote_buffers))
    # The device state each program runs on: the graph's tensors, the remote
    # buffers and the streams it uses (connected before it runs).
    self._keys = sorted(list(self._state) + [key for name in self._streams
                                             for key in _stream_keys(name)], key=str)
    self._lowered = [self._lower(p, f"{name}[{i}]", allow_out_of_memory)
                     for i, p in enumerate(programs)]
    self.profiles = [lowered.profile for lowered in self._lowered]
    self.allow_out_of_memory = allow_out_of_memory
    self.out_of_memory = any(lowered.out_of_memory for lowered in self._lowered)
    self._host_buffers = {}

  def _lower(self, program, name: str, allow_out_of_memory: bool):
    """``program`` as a :class:`~ipu_jax.stages.Lowered` over the engine's state."""
    tensors = {t.id: t for t in self._ir}
    for node, _, _ in P.iter_steps(program):
      for t in (list(node.reads) + list(node.writes) if isinstance(node, P.Superstep)
                else [node.tensor]):
        tensors[t.id] = t
    state = [(key, self._state.get(key)) for key in self._keys]
    return Lowered.from_program(program, self.target, name=name, tensors=tensors, state=state,
                                persistent=list(self._ir) + self._remote_buffers,
                                allow_out_of_memory=allow_out_of_memory)

  def connect_stream(self, name: str, buffer: np.ndarray) -> None:
    """Attach a host array to a stream (read from, or written into in place)."""
    if name not in self.graph.streams:
      raise KeyError(f"no stream named {name!r}; streams: {sorted(self.graph.streams)}")
    stream = self.graph.streams[name]
    buffer = np.asarray(buffer) if stream.to_device else buffer
    if not isinstance(buffer, np.ndarray):
      raise TypeError("device-to-host streams write into a NumPy array; pass one")
    self._host_buffers[name] = buffer
    buffer_key, cursor_key = _stream_keys(name)
    self._state[buffer_key] = jnp.asarray(buffer.reshape(-1))
    self._state[cursor_key] = jnp.int32(0)

  def run(self, index: int = 0) -> None:
    """Run program ``index`` (one host call)."""
    if self.out_of_memory:
      raise RuntimeError("this engine was lowered with allow_out_of_memory and a tile "
                         "is over its SRAM; it cannot run (read engine.report())")
    for name, stream in self._streams.items():
      if name not in self._host_buffers:
        raise RuntimeError(f"stream {name!r} is used but not connected (connect_stream)")
    missing = [k for k in self._keys if k not in self._state]
    if missing:
      raise RuntimeError(f"state keys missing: {missing}")
    if not 0 <= index < len(self._lowered):
      raise IndexError(f"Engine.run({index}): the engine has {len(self._lowered)} program(s), "
                       f"indices 0..{len(self._lowered) - 1}.")
    compiled = self._lowered[index].compile()
    compiled.set_device_state([self._state[k] for k in self._keys])
    compiled()
    self._state.update(zip(self._keys, compiled.device_state))
    for name, buffer in self._host_buffers.items():
      if not self.graph.streams[name].to_device:
        buffer.reshape(-1)[...] = np.asarray(self._state[f"stream:{name}:buffer"])

  def _flat(self, b: int):
    tensor = self._ir[b]
    return host_flat(self._state[tensor.id], tensor.mapping)

  def read_tensor(self, tensor: GraphTensor) -> np.ndarray:
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

  def write_tensor(self, tensor: GraphTensor, values) -> None:
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
      self._state[ir.id] = jax.device_put(host_storage(np.asarray(flat), ir.mapping))

  def report(self, index: int = 0):
    """The :class:`ipu_jax.Report` of program ``index``."""
    return self._lowered[index].report

  @property
  def profile(self):
    return self.profiles[0]


def _stream_keys(name: str) -> tuple:
  """The state keys of a connected stream (its host buffer and cursor)."""
  return (f"stream:{name}:buffer", f"stream:{name}:cursor")
