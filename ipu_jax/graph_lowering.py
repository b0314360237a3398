"""How an ``ipu_jax.graph.Engine`` turns graph programs into the tile program IR.

The control nodes are already the IR's (``lowering/program.py``); what needs
the graph is resolved here, once the Engine has frozen the tile mappings:

* ``Execute(cs)`` -> one superstep per compute set. Vertices are grouped by
  codelet and field shapes; every element a vertex reads (writes) is moved to
  (from) its tile, costed once per element and tile; the compute phase of a
  tile is its vertices' estimates spread over the worker contexts
  (``vertex_cycles_per_tile``). The exchange is planned on regions, not
  elements: each field of a group, over all its vertices at once, becomes
  pieces (runs of consecutive element ids of one vertex on one tile, cut
  where the engine's tile mappings change tile), and a read's cost is the
  length of the union of its pieces per receiving tile, per sending tile and
  per (sending tile, receiving IPU) (one sort of the pieces each); written
  pieces, where the first writer of an element decides, are expanded to
  elements and costed by ``movement_cost``. The step's ``fn`` concatenates the
  bases it reads into one flat buffer per dtype, gathers every field with
  index arrays fixed now, ``vmap``-s each codelet over its vertices and
  scatters the results back: no per-vertex Python at run time. A C++ vertex
  class (``ipu_jax/cpp_codelets/``) is such a codelet whose body is its XLA
  FFI call, so its vertices are one call per group.
* ``Copy`` between views -> a gather step into a temporary laid out like the
  source, then a scatter step into the destination's elements; a copy from
  or to a ``HostStream`` is a ``StreamCopy`` (through a landing tensor when
  the view is not a whole base tensor).
* A view used as a predicate, switch control or printed tensor that is not a
  whole base tensor is first gathered into a temporary of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.cpp_codelets.cost import work_estimate_notes
from ipu_jax.kernels.estimators import vertex_cycles_per_tile
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost, to_flat, to_storage
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["GraphLeaf", "GraphLowerer"]


class GraphLeaf:
  """A program leaf that needs the graph: the lowerer resolves it with ``resolve``."""

  def resolve(self, lowerer: "GraphLowerer"):
    raise NotImplementedError


class GraphLowerer:
  """Turns graph programs into the tile IR, building steps for compute sets."""

  def __init__(self, graph, ir: list):
    self.graph = graph
    self.ir = ir  # this engine's IR tensor of each graph base tensor
    self.target = graph.target
    self.streams = {}
    self.remote_buffers = {}  # this engine's IR buffer of each graph remote buffer
    self.cache = {}

  @functools.cached_property
  def tile_runs(self) -> "_TileRuns":
    """The graph's elements as runs on one tile, from the engine's frozen mappings."""
    return _tile_runs(self.graph, self.ir)

  def base_ir(self, b: int) -> P.Tensor:
    return self.ir[b]

  def split(self, index: np.ndarray):
    """``(base numbers, local indices)`` of global element indices."""
    flat = index.reshape(-1)
    bases = self.graph._base_of(flat)
    offsets = np.asarray(self.graph._offsets)[bases]
    return bases, flat - offsets

  def whole_base(self, view) -> Optional[P.Tensor]:
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
    """The program with its graph leaves and views resolved to IR steps and tensors."""
    if isinstance(program, (list, tuple)):
      return P.Sequence([self.lower(p) for p in program])
    if isinstance(program, P.Sequence):
      return P.Sequence([self.lower(p) for p in program.programs])
    if isinstance(program, GraphLeaf):
      return program.resolve(self)
    if isinstance(program, P.Repeat):
      return P.Repeat(int(program.count), self.lower(program.body))
    if isinstance(program, P.RepeatWhileTrue):
      pred, prep = self.materialise(program.predicate, "predicate")
      return P.RepeatWhileTrue(P.Sequence([self.lower(program.condition), prep]),
                               pred, self.lower(program.body))
    if isinstance(program, P.If):
      pred, prep = self.materialise(program.predicate, "predicate")
      return P.Sequence([prep, P.If(pred, self.lower(program.then),
                                    None if program.else_ is None else self.lower(program.else_))])
    if isinstance(program, P.Switch):
      control, prep = self.materialise(program.control, "control")
      return P.Sequence([prep, P.Switch(control, [(int(v), self.lower(p)) for v, p in program.cases],
                                        None if program.default is None else self.lower(program.default))])
    if isinstance(program, P.PrintTensor):
      tensor, prep = self.materialise(program.tensor, program.title)
      return P.Sequence([prep, P.PrintTensor(program.title, tensor)])
    if program is None:
      return P.Sequence()
    raise TypeError(f"not a graph program: {program!r}; programs are Sequence, Execute, "
                    "Copy, Repeat, RepeatWhileTrue, If, Switch and PrintTensor")

  def execute(self, cs) -> P.Superstep:
    """The step of a compute set; one executed twice is one step run twice."""
    if id(cs) not in self.cache:
      self.cache[id(cs)] = self.compute_set_step(cs)
    return self.cache[id(cs)]

  def materialise(self, view, name: str):
    """An IR tensor holding ``view``: the base itself or a copy of the view."""
    whole = self.whole_base(view)
    if whole is not None:
      return whole, P.Sequence()
    tiles = self.graph._element_tiles(view.index).reshape(-1)
    temp = P.Tensor(f"{name}.view", view.shape, view.dtype,
                    TileMapping.from_element_tiles(tiles), category="temporaries", op="view")
    return temp, self.gather_step(view, temp, f"view {name}")

  def gather_step(self, view, dst: P.Tensor, name: str) -> P.Superstep:
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
    if isinstance(src, P.HostStream) or isinstance(dst, P.HostStream):
      stream, view = (src, dst) if isinstance(src, P.HostStream) else (dst, src)
      ir_stream = self.streams.setdefault(stream.name, stream)
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

  def scatter_step(self, src: P.Tensor, view) -> P.Superstep:
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

  def compute_set_step(self, cs) -> P.Superstep:
    """One superstep for a compute set: exchange operands in, run vertices."""
    grouped = _group_vertices(cs)
    groups = [_vertex_group(self, cdl, fields, vertices)
              for (cdl, fields), vertices in grouped.items()]
    # C++ vertices priced by the work estimate say so (and warn, naming the class).
    notes = tuple(dict.fromkeys(note for (cdl, _), vertices in grouped.items()
                                for note in work_estimate_notes(cdl, vertices)))
    # Costed first, so the moves' arrays are freed before the step's own are made.
    exchange = _compute_set_exchange(self.target, groups)
    groups = [dataclasses.replace(g, moves=()) for g in groups]
    written = set().union(*(g.written_bases for g in groups))
    read_bases = sorted(set().union(*(g.read_bases for g in groups)) | written)
    written_bases = sorted(written)
    layout = _flat_layout(self.graph, read_bases)
    run = _ComputeSetRun(
        graph=self.graph, read_bases=tuple(read_bases),
        read_mappings=tuple(self.base_ir(b).mapping for b in read_bases),
        written_bases=tuple(written_bases),
        write_mappings=tuple(self.base_ir(b).mapping for b in written_bases),
        layout=layout,
        codelets=tuple((g.codelet, _field_positions(self, g, layout), len(g.tiles))
                       for g in groups))
    compute, vertices = _compute_set_cycles(self.target, groups)
    return P.Superstep(
        name=cs.name, op=f"Execute({cs.name})",
        reads=tuple(self.base_ir(b) for b in read_bases),
        writes=tuple(self.base_ir(b) for b in written_bases),
        fn=functools.partial(_run_compute_set, run), compute_cycles=compute,
        exchange=exchange, vertices=vertices,
        codelets=tuple(sorted({g.codelet.name for g in groups})),
        flops=sum(g.flops for g in groups), notes=notes)


# -- compute sets ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _VertexGroup:
  """The vertices of one compute set sharing a codelet and field shapes.

  Attributes:
    codelet: their codelet.
    stacked: field -> ``[vertices, *field shape]`` global element indices.
    tiles, cycles, supervisor: per vertex, its tile, its cycle estimate and
      whether it is a supervisor vertex.
    flops: of all the group's vertices.
    read_bases, written_bases: base tensor numbers the fields read / write.
    moves: per field, a :class:`_Moves` of every element a vertex reads (to
      its tile) or writes (from its tile).
  """

  codelet: object
  stacked: dict
  tiles: np.ndarray
  cycles: np.ndarray
  supervisor: np.ndarray
  flops: int
  read_bases: frozenset
  written_bases: frozenset
  moves: tuple


def _group_vertices(cs) -> dict:
  """``(codelet, ((field, shape, dtype), ...)) -> [vertices]``, in first-seen order."""
  groups = {}
  for v in cs.vertices:
    key = (v.codelet, tuple((f, v.connections[f].shape, v.connections[f].dtype)
                            for f in v.codelet.fields))
    groups.setdefault(key, []).append(v)
  return groups


@dataclasses.dataclass(frozen=True)
class _TileRuns:
  """The graph's elements (global ids) as runs held by one tile in one base.

  Attributes:
    start: ``[R]`` first global element id of each run, increasing.
    stop: ``[R]`` one past its last element.
    tile: ``[R]`` the tile holding the run.
    base: ``[R]`` the base tensor it belongs to.
  """

  start: np.ndarray
  stop: np.ndarray
  tile: np.ndarray
  base: np.ndarray


def _tile_runs(graph, ir) -> _TileRuns:
  """The runs of every base's frozen mapping (``TileMapping.runs``), in id order."""
  parts = [(base.offset + start, length, tensor.mapping.tiles[row], np.full(start.size, b))
           for b, (base, tensor) in enumerate(zip(graph._bases, ir))
           for start, length, row, _ in [tensor.mapping.runs]]
  start, length, tile, base = (np.concatenate([np.asarray(p[i], np.int64) for p in parts])
                               if parts else np.zeros(0, np.int64) for i in range(4))
  # Block-grid runs come block by block: order them by id for searchsorted.
  order = np.argsort(start, kind="stable")
  return _TileRuns(start[order], start[order] + length[order], tile[order], base[order])


@dataclasses.dataclass(frozen=True)
class _Pieces:
  """A field over all vertices of a group as pieces, in the order of its elements.

  A piece is a run of consecutive global element ids that one vertex connects
  to, all held by one tile in one base.

  Attributes:
    start, stop: ``[P]`` the piece's ids ``[start, stop)``.
    tile: ``[P]`` the tile holding it.
    base: ``[P]`` its base tensor.
    vertex: ``[P]`` the vertex (position in the group) connecting it.
  """

  start: np.ndarray
  stop: np.ndarray
  tile: np.ndarray
  base: np.ndarray
  vertex: np.ndarray


def _field_pieces(runs: _TileRuns, stacked: np.ndarray) -> _Pieces:
  """The pieces of ``stacked`` (``[vertices, *field shape]`` global ids)."""
  flat = stacked.reshape(len(stacked), -1)
  if flat.size == 0:
    empty = np.zeros(0, np.int64)
    return _Pieces(empty, empty, empty, empty, empty)
  at = _run_starts(flat)
  start = flat.reshape(-1)[at]
  stop = start + np.diff(np.append(at, flat.size))
  return _cut_at_tiles(runs, start, stop, at // flat.shape[1])


# Elements compared at once when finding runs: the temporaries stay small
# (a field over all vertices can be tens of millions of elements).
_RUN_BLOCK_ELEMENTS = 1 << 20


def _run_starts(flat: np.ndarray) -> np.ndarray:
  """Positions in ``flat`` (``[vertices, n]``, row-major) where a run starts:
  a vertex's first element, or one whose id is not one more than the last."""
  rows = max(1, _RUN_BLOCK_ELEMENTS // flat.shape[1])
  starts = []
  for r in range(0, len(flat), rows):
    block = flat[r:r + rows]
    first = np.ones(block.shape, bool)
    np.not_equal(block[:, 1:] - block[:, :-1], 1, out=first[:, 1:])
    starts.append(np.flatnonzero(first) + r * flat.shape[1])
  return np.concatenate(starts)


def _cut_at_tiles(runs: _TileRuns, start, stop, vertex) -> _Pieces:
  """Runs ``[start, stop)`` cut where the tile runs change, in order."""
  first = np.searchsorted(runs.start, start, side="right") - 1
  last = np.searchsorted(runs.start, stop - 1, side="right") - 1
  count = last - first + 1
  run = first
  if count.max() > 1:
    which = np.repeat(np.arange(start.size), count)
    run = first[which] + np.arange(which.size) - np.repeat(np.cumsum(count) - count, count)
    start = np.maximum(start[which], runs.start[run])
    stop = np.minimum(stop[which], runs.stop[run])
    vertex = vertex[which]
  return _Pieces(start, stop, runs.tile[run], runs.base[run], vertex)


@dataclasses.dataclass(frozen=True)
class _Moves:
  """The pieces one field of a vertex group moves to or from its vertices' tiles.

  Attributes:
    src, dst: ``[P]`` int64 tiles each piece leaves and reaches.
    start, stop: ``[P]`` the piece's global element ids ``[start, stop)``.
    itemsize: bytes per element.
    key: ``(written, bases)``: whether the field is written, and the base
      tensors its elements belong to; fields whose keys share a base can move
      the same element and are costed together.
  """

  src: np.ndarray
  dst: np.ndarray
  start: np.ndarray
  stop: np.ndarray
  itemsize: int
  key: tuple


def _field_moves(lowerer, cdl, fields, stacked, tiles):
  """``(read bases, written bases, moves)`` of a group's fields (see _VertexGroup)."""
  read, written, moves = set(), set(), []
  itemsizes = {f: dtype.itemsize for f, _, dtype in fields}
  for f in cdl.fields:
    pieces = _field_pieces(lowerer.tile_runs, stacked[f])
    # The bases the field touches: counted, not sorted.
    present = np.bincount(pieces.base, minlength=len(lowerer.graph._bases))
    field_bases = frozenset(np.flatnonzero(present).tolist())
    if f in cdl.written_fields:
      written.update(field_bases)
    if f in cdl.read_fields:
      read.update(field_bases)
    vt = tiles[pieces.vertex]
    if f in cdl.read_fields:
      # A read piece already on its vertex's tile moves nothing, and every
      # other read of it by that tile is on the tile too: drop them here.
      away = np.flatnonzero(pieces.tile != vt)
      moves.append(_Moves(pieces.tile[away], vt[away], pieces.start[away], pieces.stop[away],
                          itemsizes[f], (False, field_bases)))
    if f in cdl.written_fields:
      moves.append(_Moves(vt, pieces.tile, pieces.start, pieces.stop, itemsizes[f],
                          (True, field_bases)))
  return frozenset(read), frozenset(written), tuple(moves)


def _vertex_group(lowerer, cdl, fields, vertices) -> _VertexGroup:
  tiles = np.array([v.tile for v in vertices], np.int64)
  stacked = {f: np.stack([v.connections[f].index for v in vertices]) for f in cdl.fields}
  read, written, moves = _field_moves(lowerer, cdl, fields, stacked, tiles)
  specs = [_Spec(shape, dtype) for _, shape, dtype in fields]
  estimate = cdl.estimate(*specs, target=lowerer.target)
  cycles = np.array([v.perf_estimate if v.perf_estimate is not None else estimate
                     for v in vertices], np.float64)
  flops = int(cdl.flops(*specs)) * len(vertices) if cdl.flops is not None else 0
  return _VertexGroup(cdl, stacked, tiles, cycles, np.full(len(vertices), bool(cdl.supervisor)),
                      flops, read, written, moves)


@dataclasses.dataclass(frozen=True)
class _FlatLayout:
  """Per dtype, one flat buffer of all the bases a compute set reads.

  Attributes:
    bases: dtype -> the base numbers concatenated into its buffer, in order.
    base_start: dtype -> ``[num bases]`` start of each base in its buffer
      (0 for bases not in it).
  """

  bases: dict
  base_start: dict


def _flat_layout(graph, read_bases) -> _FlatLayout:
  by_dtype = {}
  for b in read_bases:
    by_dtype.setdefault(graph._bases[b].dtype, []).append(b)
  base_start = {}
  for dtype, bs in by_dtype.items():
    sizes = [graph._bases[b].size for b in bs]
    starts = dict(zip(bs, np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)))
    base_start[dtype] = np.array([starts.get(b, 0) for b in range(len(graph._bases))], np.int64)
  return _FlatLayout(by_dtype, base_start)


@dataclasses.dataclass(frozen=True)
class _FieldPositions:
  """Where one field of a vertex group lives, as its step reads or writes it.

  Attributes:
    dtype: the field's dtype (its buffer in :class:`_FlatLayout`).
    index: read fields: ``[vertices, *field shape]`` positions in that buffer
      (int32 when they fit), else None.
    scatter: written fields: ``((base, positions in the flattened field
      values, indices in the base), ...)`` per base written, else ``()``.
  """

  dtype: np.dtype
  index: Optional[np.ndarray]
  scatter: tuple


def _field_positions(lowerer, group: _VertexGroup, layout: _FlatLayout) -> dict:
  """Field -> its :class:`_FieldPositions` (only what the step will use is kept)."""
  positions = {}
  cdl = group.codelet
  graph = lowerer.graph
  for f in cdl.fields:
    stacked = group.stacked[f]
    dtype = (graph._bases[int(graph._base_of(stacked.reshape(-1)[:1])[0])].dtype
             if stacked.size else np.dtype("float32"))
    index = scatter = None
    if f in cdl.read_fields:
      index = _buffer_positions(graph, stacked, layout.base_start[dtype])
    if f in cdl.written_fields:
      bases, local = lowerer.split(stacked)
      scatter = tuple((int(b), sel, local[sel])
                      for b in np.unique(bases) for sel in [np.nonzero(bases == b)[0]])
    positions[f] = _FieldPositions(dtype, index, scatter or ())
  return positions


def _buffer_positions(graph, stacked: np.ndarray, base_start: np.ndarray) -> np.ndarray:
  """``stacked``'s positions in its dtype's flat buffer (``id + base_start - offset``),
  int32 when they all fit.

  A vertex's field usually lies in one base: its shift is found from the
  field's least and greatest ids; only fields spanning bases look up each id.
  """
  flat = stacked.reshape(len(stacked), -1)
  if flat.size == 0:
    return stacked.astype(np.int64)
  shift = base_start - np.asarray(graph._offsets, np.int64)
  low, high = graph._base_of(flat.min(axis=1)), graph._base_of(flat.max(axis=1))
  # Positions are below the graph's element count: when int32 holds that,
  # they are written as int32 at once (no int64 copy of a large field).
  narrow = graph._size < np.iinfo(np.int32).max
  index = np.empty(flat.shape, np.int32 if narrow else np.int64)
  np.add(flat, shift[low][:, None], out=index, casting="unsafe")
  spanning = np.flatnonzero(low != high)
  if spanning.size:
    index[spanning] = flat[spanning] + shift[graph._base_of(flat[spanning])]
  if not narrow and index.max() < np.iinfo(np.int32).max:
    index = index.astype(np.int32)
  return index.reshape(stacked.shape)


@dataclasses.dataclass(frozen=True)
class _ComputeSetRun:
  """What a compute set's step runs: every codelet ``vmap``-ed over its vertices.

  Attributes:
    codelets: ``(codelet, field positions, vertices)`` per vertex group
      (:func:`_field_positions`).
  """

  graph: object
  read_bases: tuple
  read_mappings: tuple
  written_bases: tuple
  write_mappings: tuple
  layout: _FlatLayout
  codelets: tuple


def _run_codelet(cdl, positions, buffers, vertices: int):
  """The codelet on every vertex of its group: one value per written field."""
  operands = [buffers[positions[f].dtype][positions[f].index] for f in cdl.read_fields]
  # axis_size: a codelet may read no field (it only writes).
  results = jax.vmap(cdl.fn, axis_size=vertices)(*operands)
  if not isinstance(results, (tuple, list)):
    results = (results,)
  if len(results) != len(cdl.written_fields):
    raise ValueError(f"codelet {cdl.name} returned {len(results)} values for fields "
                     f"{cdl.written_fields}")
  return results


def _run_compute_set(run: _ComputeSetRun, *storages):
  """The step's function: gather the fields, run the codelets, scatter the results."""
  flats = {b: to_flat(s, m) for b, s, m in zip(run.read_bases, storages, run.read_mappings)}
  buffers = {dtype: jnp.concatenate([flats[b] for b in bs]) if bs else jnp.zeros((0,), dtype)
             for dtype, bs in run.layout.bases.items()}
  new_flats = {b: flats[b] for b in run.written_bases}
  for cdl, positions, vertices in run.codelets:
    for f, value in zip(cdl.written_fields, _run_codelet(cdl, positions, buffers, vertices)):
      value = jnp.reshape(value, (-1,))
      for b, sel, local in positions[f].scatter:
        tensor = run.graph._bases[b]
        new_flats[b] = new_flats[b].at[local].set(value[sel].astype(tensor.dtype))
  return tuple(to_storage(new_flats[b], m) for b, m in zip(run.written_bases, run.write_mappings))


def _compute_set_cycles(target, groups):
  """``(compute cycles, vertices)`` per tile: estimates spread over the workers."""
  vt = np.concatenate([g.tiles for g in groups]) if groups else np.zeros(0, np.int64)
  vc = np.concatenate([g.cycles for g in groups]) if groups else np.zeros(0)
  compute = vertex_cycles_per_tile(
      target, vt, vc,
      supervisor=np.concatenate([g.supervisor for g in groups]) if groups else None)
  return compute, np.bincount(vt, minlength=target.num_tiles)[:target.num_tiles]


def _compute_set_exchange(target, groups) -> Optional[ExchangeCost]:
  """Every element to (from) the tiles of the vertices reading (writing) it.

  Vertices on one tile share what it receives: an element moves to a tile
  once however many of its vertices read it. Fields that touch no common base
  move disjoint elements, whose costs add up, so each set of fields sharing
  bases is costed on its own (what keeps the arrays of a large compute set
  from being held all at once).
  """
  moves = [m for g in groups for m in g.moves]
  if not any(m.start.size for m in moves):
    return None if not moves else ExchangeCost.zeros(target)
  exchange = ExchangeCost.zeros(target)
  for part in _sharing_bases(moves):
    for size in sorted({m.itemsize for m in part}):
      exchange = exchange + _moves_cost(target, [m for m in part if m.itemsize == size], size)
  return exchange


def _sharing_bases(moves) -> list:
  """``moves`` in groups whose elements may coincide (the same direction and a
  common base, transitively), each in the order of ``moves``; the groups'
  element sets are disjoint."""
  groups = []
  for i, m in enumerate(moves):
    joined = [g for g in groups
              if any(moves[j].key[0] == m.key[0] and moves[j].key[1] & m.key[1] for j in g)]
    groups = [g for g in groups if not any(g is j for j in joined)]
    groups.append(sorted([i] + [j for g in joined for j in g]))
  return [[moves[j] for j in g] for g in groups]


def _moves_cost(target, moves, itemsize: int) -> ExchangeCost:
  """The exchange of ``moves`` (one direction, one itemsize), each (element,
  tile) pair once."""
  def joined(field):
    arrays = [getattr(m, field) for m in moves]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

  src, dst, start, stop = joined("src"), joined("dst"), joined("start"), joined("stop")
  if moves[0].key[0]:
    return _written_cost(target, src, dst, start, stop, itemsize)
  return _read_cost(target, src, dst, start, stop, itemsize)


def _read_cost(target, src, dst, start, stop, itemsize: int) -> ExchangeCost:
  """Read pieces (none already on its reader's tile): a tile receives each
  element it reads once, a tile sends each element read elsewhere once (the
  exchange multicasts), and an element crosses the links once per receiving
  IPU; each is the covered length of the pieces' union by that key."""
  t, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  bytes_in = _covered(dst, start, stop, t)
  bytes_out = _covered(src, start, stop, t)
  link = np.zeros(n_ipus, np.int64)
  crossing = np.flatnonzero(src // per_ipu != dst // per_ipu)
  if crossing.size:
    by_pair = _covered(src[crossing] * n_ipus + dst[crossing] // per_ipu,
                       start[crossing], stop[crossing], t * n_ipus)
    link = np.bincount(np.arange(t * n_ipus) // n_ipus // per_ipu, weights=by_pair,
                       minlength=n_ipus)[:n_ipus].astype(np.int64)
  return ExchangeCost(bytes_in * itemsize, bytes_out * itemsize, link * itemsize)


def _covered(key, start, stop, size: int) -> np.ndarray:
  """``[size]`` int64: per key, the elements in the union of its pieces."""
  if key.size == 0:
    return np.zeros(size, np.int64)
  # Each key's pieces on a line of their own, so one sort orders them all.
  span = np.int64(stop.max()) + 1
  lo, hi = key * span + start, key * span + stop
  order = np.argsort(lo, kind="stable")  # timsort: pieces often come sorted
  key, lo, hi = key[order], lo[order], hi[order]
  reach = np.maximum.accumulate(hi)
  # What each piece adds beyond everything before it on its line.
  seen = np.concatenate([lo[:1], reach[:-1]])
  added = np.maximum(hi - np.maximum(lo, seen), 0)
  # Weighted bincounts are float64: exact below 2**53 elements.
  return np.bincount(key, weights=added, minlength=size)[:size].astype(np.int64)


# Written elements costed at once: every figure of a move counts (element,
# tile) pairs or elements once, so elements cut by id ranges add up exactly,
# and a large compute set's dedup and cost need a bounded part of memory.
_CHUNK_ELEMENTS = 1 << 22


def _written_cost(target, src, dst, start, stop, itemsize: int) -> ExchangeCost:
  """Written pieces as elements: the first vertex writing an element (in the
  order of the fields and vertices) is where it leaves from."""
  length = stop - start
  ids = np.arange(int(length.sum()), dtype=np.int64) + np.repeat(
      start - (np.cumsum(length) - length), length)
  src, dst = np.repeat(src, length), np.repeat(dst, length)
  if ids.size <= _CHUNK_ELEMENTS:
    return _pairs_cost(target, src, dst, ids, itemsize)
  edges = np.linspace(ids.min(), ids.max() + 1, -(-ids.size // _CHUNK_ELEMENTS) + 1)
  exchange = ExchangeCost.zeros(target)
  for lo, hi in zip(edges[:-1].astype(np.int64), edges[1:].astype(np.int64)):
    part = np.flatnonzero((ids >= lo) & (ids < hi))
    exchange = exchange + _pairs_cost(target, src[part], dst[part], ids[part], itemsize)
  return exchange


def _pairs_cost(target, src, dst, ids, itemsize: int) -> ExchangeCost:
  # One (element, destination) pair once, first occurrence kept, in (id, tile) order.
  _, once = np.unique(ids * np.int64(target.num_tiles) + dst, return_index=True)
  return movement_cost(target, src[once], dst[once], itemsize, element_id=ids[once])


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
