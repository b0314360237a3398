"""Data movement and constants from nothing: reshape, transpose, slice, pad...

Tile plan. Every primitive here copies elements without computing on them,
so its plan is a static map: for each output element, the flat index of the
input element it copies (or "fill" for padding and constants). Each rule
describes its map in closed form, as boxes of the output whose elements copy
affine positions of the source (:class:`~ipu_jax.lowering.copy_plan.BoxMap`:
a broadcast axis has source stride 0, a transpose permutes strides, a slice
offsets and scales them). :func:`move` plans the exchange from the boxes by
regions (rows cut at tile-run boundaries, in time proportional to runs,
``lowering/copy_plan.py``; a transpose of the innermost axis, whose rows are
single elements, from its tiles transposed like the data) and falls back to
the per-element planner :func:`exchange_plan` only for other maps with short
runs (a strided slice or reversal of the innermost axis); all give the same
figures.

* ``reshape``, ``squeeze`` (and ``broadcast_in_dim`` / ``transpose`` / ...
  whose map turns out to be the identity) change only the logical shape.
  A tile mapping is defined on the flattened, row-major tensor, so the same
  storage serves the new shape: the rule returns an *alias*, a Tensor with
  the new shape that shares the operand's id, mapping and storage. No
  superstep, no sync, no memory: like a Poplar view (``Tensor::reshape``).
* Everything else materialises a new tensor in one superstep. The result
  takes the mapping of a linearly mapped operand of its size (a transpose
  stays on its operand's tiles), else a linear mapping that starts on its
  largest operand's first tile. The exchange sends each element whose destination tile differs
  from its source tile; an element needed several times on one tile (a
  broadcast) crosses the exchange once per destination tile and is then
  replicated on the tile. The compute phase runs ``Copy`` vertices for the
  elements that did not arrive straight from the exchange (kept on their
  tile, or replicated) and ``Fill`` vertices for elements set to a constant
  (padding, ``jnp.zeros``...). A pad value held in a tensor is an ordinary
  source element, multicast to the tiles that need it.
* ``iota`` is a compute set of fill-like vertices writing each tile's own
  elements; no exchange.

In the executor, "batched" mode runs the primitive itself on logical arrays
(XLA fuses it into reshapes and slices); "per_tile" mode performs the static
gather the plan describes, its indices built from the boxes only when the
step is traced (no step holds per-element arrays). Both give the same bits.

(Longer than the ~600 lines a module usually keeps to: every rule here is the
same static-map movement, so they share one planner, :func:`move` with its
region and element planners, and each rule is only the few lines that build its
map; other rules reuse :func:`move`, :func:`alias` and :func:`broadcast_to`
from here. Splitting the rules out would scatter one concept.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering.jax_compat import lax_internal
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering import copy_plan
from ipu_jax.lowering.builders import storage, worker_vertices
from ipu_jax.lowering.copy_plan import exchange_plan
from ipu_jax.lowering.exchange import to_flat, to_storage
from ipu_jax.lowering.jax_compat import physical_shape_dtype
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.copy_plan import Box, BoxMap, row_major_strides
from ipu_jax.lowering.registry import register_lowering

__all__ = ["alias", "move", "exchange_plan", "broadcast_in_dim", "broadcast_to"]


# -- helpers -----------------------------------------------------------------


def _key_shape(ctx, i: int = 0) -> tuple:
  """Trailing key-data axes of a PRNG key result (``()`` for other dtypes)."""
  aval = ctx.out_avals[i]
  return physical_shape_dtype(aval)[0][len(aval.shape):]


def _out_aval(ctx, i: int = 0):
  """``(shape, dtype)`` of result ``i`` as held in tile memory.

  PRNG key arrays are held as their ``uint32`` key data, with the key's
  axes last, so movements of keys move whole keys.
  """
  return physical_shape_dtype(ctx.out_avals[i])


def _output_mapping(ctx, operands, shape, dtype) -> TileMapping:
  """Where a moved result lives: near its inputs, spread linearly.

  A result the size of a linearly mapped operand takes that operand's
  mapping (as popops maps results like their operand), so a transpose or
  reverse moves only the elements that change tile. Otherwise the result is
  mapped linearly; when it is too small to cover every tile it starts on its
  largest operand's first tile rather than on a fresh one.
  """
  size = int(np.prod(shape, dtype=np.int64))
  itemsize = np.dtype(dtype).itemsize
  live = [t for t in operands if t.category != "constants" and t.size and t.mapping.is_linear]
  for t in live:
    if t.size == size and t.itemsize == itemsize:
      return t.mapping
  if live and size:
    num_tiles = ctx.target.num_tiles
    mapping = TileMapping.linear(size, num_tiles, itemsize)
    if mapping.num_rows < num_tiles:
      start = int(max(live, key=lambda t: t.size).mapping.tiles[0])
      return TileMapping.blocks(size, mapping.chunk, num_tiles, start)
    return mapping
  return ctx.linear_mapping(shape, dtype)


def alias(tensor: P.Tensor, shape) -> P.Tensor:
  """``tensor`` seen with another shape of the same size, sharing its storage.

  The alias keeps the tensor's id, so the executor (which keys state by id)
  reads and writes the very same storage, and the memory analysis counts it
  once. Only rules whose output keeps the flat element order may use it.
  """
  shape = tuple(int(d) for d in shape)
  if shape == tuple(tensor.shape):
    return tensor
  if int(np.prod(shape, dtype=np.int64)) != tensor.size:
    raise ValueError(f"alias: {tensor.shape} has {tensor.size} elements, not {shape}")
  value = None if tensor.value is None else np.asarray(tensor.value).reshape(shape)
  return dataclasses.replace(tensor, shape=shape, value=value)


def _is_identity(source: np.ndarray) -> bool:
  n = source.size
  if n == 0:
    return True
  if source[0] != 0 or source[-1] != n - 1:
    return False
  return bool(np.array_equal(source, np.arange(n, dtype=source.dtype)))


def _uniform_value(tensor: P.Tensor):
  """The single value of a constant tensor whose elements are all equal."""
  if tensor.category != "constants" or tensor.value is None or tensor.size == 0:
    return None
  value = np.asarray(tensor.value, tensor.dtype).reshape(-1)
  if value.size > 1:
    # Compare bytes so that NaN == NaN and -0.0 != 0.0, as a fill would.
    raw = value.view(np.uint8).reshape(value.size, value.itemsize)
    if not (raw == raw[0]).all():
      return None
  return value[0]


@dataclasses.dataclass(frozen=True)
class _MoveIO:
  """The tensors of one movement step.

  Attributes:
    operands: as the rule passed them (one tensor may appear twice).
    unique: the step's reads, each tensor once (``concatenate(x, x)`` reads
      one source in memory).
    position: tensor id -> its index in ``unique``.
    results: the step's writes.
    logical_fn: the movement on logical arrays (see :func:`move`).
  """

  operands: tuple
  unique: tuple
  position: dict
  results: tuple
  logical_fn: Callable

  @property
  def num_sources(self) -> int:
    return int(sum(t.size for t in self.unique))


def _normalise_outputs(outputs) -> list:
  return [(tuple(int(d) for d in s), np.dtype(d), _realised(i)) for s, d, i in outputs]


def _realised(spec):
  """A map as planned: a BoxMap, or the ``[size]`` source index array (built
  by the map's function when given one)."""
  if isinstance(spec, BoxMap):
    return spec
  return np.asarray(spec() if callable(spec) else spec).reshape(-1)


def _kept(spec):
  """What a step's per-tile ``fn`` keeps of a map: boxes, or the function
  that builds the index (an index array the rule passed, a host table per
  element, is kept as given: rules pass functions)."""
  return spec if isinstance(spec, BoxMap) or callable(spec) else _realised(spec)


def _identity_alias(operands, outputs):
  """The alias a lone identity movement returns, else None."""
  if not (len(operands) == 1 and len(outputs) == 1 and outputs[0][1] == operands[0].dtype):
    return None
  shape, _, spec = outputs[0]
  size = int(np.prod(shape, dtype=np.int64))
  if size == operands[0].size and (spec.is_identity(size) if isinstance(spec, BoxMap)
                                   else _is_identity(spec)):
    return alias(operands[0], shape)
  return None


def _move_io(ctx, operands, outputs, logical_fn) -> _MoveIO:
  """The step's reads and its new result tensors, with the maps checked."""
  unique, position = [], {}
  for t in operands:
    position.setdefault(t.id, len(unique))
    if position[t.id] == len(unique):
      unique.append(t)
  results = []
  for shape, dtype, spec in outputs:
    out = ctx.new_tensor(shape, dtype, _output_mapping(ctx, operands, shape, dtype))
    results.append(out)
    if isinstance(spec, BoxMap):
      spec.check(out.size, int(sum(t.size for t in operands)), ctx.op)
    elif spec.size != out.size:
      raise ValueError(f"{ctx.op}: {spec.size} source indices for {shape}")
  return _MoveIO(tuple(operands), tuple(unique), position, tuple(results), logical_fn)


def _plan_move(target, io: _MoveIO, specs, one_to_one: bool):
  """``(copy plan, per-element gathers or None, specs)`` of the movement.

  By regions when every map is a box map over distinct operands; else by
  elements, the maps expanded to source indices (into ``io.unique``).
  """
  itemsize = io.results[0].itemsize
  if len(io.unique) == len(io.operands) and all(isinstance(s, BoxMap) for s in specs):
    plan = copy_plan.plan_copies(target, [t.mapping for t in io.unique],
                                 [(out.mapping, s) for out, s in zip(io.results, specs)],
                                 itemsize)
    if plan is not None:
      return plan, None, specs
  index_type = copy_plan.index_dtype(io.num_sources + 1)
  specs = [s.index(out.size, -1, index_type) if isinstance(s, BoxMap) else s
           for out, s in zip(io.results, specs)]
  if len(io.unique) != len(io.operands):
    # Point every source at the unique operand's elements.
    starts = np.cumsum([0] + [t.size for t in io.unique])
    remap = np.concatenate([np.arange(t.size) + starts[io.position[t.id]] for t in io.operands])
    specs = [np.where(i >= 0, remap[np.maximum(i, 0)], -1) for i in specs]
    one_to_one = False
  plan, gathers = copy_plan.plan_elements(
      target, [t.mapping for t in io.unique],
      [(out.mapping, s) for out, s in zip(io.results, specs)], itemsize, one_to_one)
  return plan, gathers, specs


@dataclasses.dataclass(frozen=True, eq=False)
class _MoveGathers:
  """What a movement's per-tile exchange gathers from.

  A plan by regions gathers by the rule's boxes; a plan by elements is
  planned again when traced: keeping the rule's maps instead of the planned
  per-element gathers costs the step no host memory per element.
  """

  target: object
  specs: tuple
  one_to_one: bool
  by_regions: bool

  def gathers(self, io: _MoveIO) -> list:
    """Per output, a BoxMap or the ``[size]`` source of each element."""
    specs = [_realised(spec) for spec in self.specs]
    if self.by_regions:
      return specs
    _, gathers, specs = _plan_move(self.target, io, specs, self.one_to_one)
    return specs if gathers is None else gathers


def _per_tile_move(io: _MoveIO, plan: _MoveGathers, fill_value, *storages):
  """The static exchange: every output element gathered from its source."""
  dtype = io.results[0].dtype
  flat = jnp.concatenate(
      [to_flat(s, t.mapping).astype(dtype) for s, t in zip(storages, io.unique)]
      + [jnp.full((1,), fill_value, dtype)])
  index = [_gather_index(g, out.size, io.num_sources)
           for g, out in zip(plan.gathers(io), io.results)]
  return tuple(jnp.zeros(out.storage_shape, out.dtype) if out.size == 0
               else to_storage(flat[g], out.mapping)
               for out, g in zip(io.results, index))


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _logical_move(io: _MoveIO, *arrays):
  """The step's logical form (arrays of the reads, one per unique operand)."""
  value = _as_tuple(io.logical_fn(*[arrays[io.position[t.id]].reshape(t.shape)
                                    for t in io.operands]))
  return tuple(jnp.reshape(v, out.shape) for v, out in zip(value, io.results))


def move(ctx, operands: Sequence[P.Tensor], outputs: Sequence, logical_fn: Callable,
         fill=None, name: str = "", one_to_one: bool = False) -> list:
  """Lower a static data movement into one superstep; returns the outputs.

  Args:
    ctx: the lowering context.
    operands: tensors whose flattened elements, concatenated, are the
      sources the maps refer to.
    outputs: ``[(shape, dtype, map)]``: ``map`` is a
      :class:`~ipu_jax.lowering.copy_plan.BoxMap` (planned by regions
      when its rows are long) or the ``[size]`` source index of each output
      element, ``-1`` for ``fill`` (or a function that returns it: the step
      then keeps the function, not a table per element).
    logical_fn: ``logical_fn(*logical_operands) -> result or tuple``, the
      same movement on logical arrays (the step's ``logical`` form).
    fill: the constant that unmapped (``-1``) elements take.
    name: step name (default: the primitive).
    one_to_one: no operand element is copied twice (see
      :func:`exchange_plan`).

  A lone output whose map is the identity on a lone operand is returned as
  an :func:`alias` (no step).
  """
  target = ctx.target
  kept = [_kept(spec) for _, _, spec in outputs]
  outputs = _normalise_outputs(outputs)
  same = _identity_alias(operands, outputs)
  if same is not None:
    return [same]
  io = _move_io(ctx, operands, outputs, logical_fn)
  if all(out.size == 0 for out in io.results):
    return list(io.results)  # all outputs empty: nothing to run
  plan, gathers, _ = _plan_move(target, io, [spec for _, _, spec in outputs], one_to_one)
  itemsize = io.results[0].itemsize
  copies, fills = plan.copies, plan.fills
  compute = (estimators.copy_cycles(target, copies, itemsize)
             + estimators.fill_cycles(target, fills, itemsize))
  codelets = tuple(c for c, n in ((vocab.COPY, copies.sum()), (vocab.FILL, fills.sum())) if n)
  fill_value = np.asarray(0 if fill is None else fill).astype(io.results[0].dtype)
  # Neither form holds per-element tables: the per-tile exchange keeps the
  # rule's maps (boxes, for region plans) and finds its gathers when traced;
  # the logical form is ``logical_fn``.
  gathers_from = _MoveGathers(target, tuple(kept), one_to_one, by_regions=gathers is None)
  fn = functools.partial(_per_tile_move, io, gathers_from, fill_value)
  ctx.emit(P.Superstep(
      name=name or ctx.op, op=ctx.op, reads=io.unique, writes=io.results, fn=fn,
      compute_cycles=compute if compute.any() else None, exchange=plan.exchange,
      vertices=worker_vertices(ctx, copies + fills), codelets=codelets,
      logical=functools.partial(_logical_move, io)))
  return list(io.results)


def _gather_index(spec, size: int, num_sources: int) -> np.ndarray:
  """Source of every output element, ``num_sources`` (the fill slot) for fill."""
  if isinstance(spec, BoxMap):
    return spec.index(size, num_sources, copy_plan.index_dtype(num_sources + 1))
  return spec


def _bind(primitive, params):
  def fn(*args):
    return primitive.bind(*args, **params)
  return fn


def _no_dynamic_shapes(dynamic):
  if dynamic:
    raise NotImplementedError("dynamic shapes are not supported; every dimension must be static")


# -- shape-only: aliases -----------------------------------------------------


@register_lowering(lax.reshape_p)
def _reshape(ctx, x, *dynamic, new_sizes, dimensions=None, **params):
  _no_dynamic_shapes(dynamic)
  shape, _ = _out_aval(ctx)
  if dimensions is not None and tuple(dimensions) != tuple(range(len(x.shape))):
    # Old-style reshape with a transpose first.
    x = _transpose_tensor(ctx, x, tuple(dimensions))
  return [alias(x, shape)]


@register_lowering(lax.squeeze_p)
def _squeeze(ctx, x, *, dimensions):
  del dimensions
  return [alias(x, _out_aval(ctx)[0])]


# -- movements ---------------------------------------------------------------


def broadcast_in_dim(ctx, x: P.Tensor, shape, broadcast_dimensions,
                     params=None) -> P.Tensor:
  """``x`` broadcast to ``shape`` as ``lax.broadcast_in_dim`` does.

  For other rules too (an elementwise operand with size-1 axes, say): returns
  an alias when only size-1 axes are added, a fill when ``x`` is a constant
  with a single value, otherwise one multicast superstep.

  Args:
    ctx: the lowering context.
    x: the operand (its tile-memory shape).
    shape: the result's shape.
    broadcast_dimensions: the result axis of each axis of ``x``.
    params: extra primitive params (``sharding``) for the logical function.
  """
  shape = tuple(int(d) for d in shape)
  broadcast_dimensions = tuple(int(d) for d in broadcast_dimensions)
  dtype = x.dtype
  size = int(np.prod(shape, dtype=np.int64))
  if size == x.size and list(broadcast_dimensions) == sorted(broadcast_dimensions):
    return alias(x, shape)  # only size-1 axes added: the same flat order
  full = dict(params or {}, shape=shape, broadcast_dimensions=broadcast_dimensions)
  full.setdefault("sharding", None)
  value = _uniform_value(x)
  if value is not None:
    # A constant everywhere (jnp.zeros, jnp.full): fill vertices, no exchange.
    return move(ctx, [], [(shape, dtype, BoxMap())],
                lambda: jnp.full(shape, value, dtype), fill=value, name="fill")[0]
  # A broadcast axis (new, or size 1 in ``x``) reads the same source: stride 0.
  src_strides = [0] * len(shape)
  for axis, (out_axis, stride) in enumerate(zip(broadcast_dimensions,
                                                row_major_strides(x.shape))):
    if x.shape[axis] == shape[out_axis]:
      src_strides[out_axis] = stride
  box = Box.make(shape, 0, row_major_strides(shape), 0, src_strides)
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
              _bind(lax.broadcast_in_dim_p, full), name="broadcast_in_dim")[0]


def broadcast_to(ctx, x: P.Tensor, shape) -> P.Tensor:
  """``x`` broadcast to ``shape`` by NumPy's rules (see :func:`broadcast_in_dim`)."""
  shape = tuple(int(d) for d in shape)
  lead = len(shape) - len(x.shape)
  if lead < 0 or any(d != 1 and d != s for d, s in zip(x.shape, shape[lead:])):
    raise ValueError(f"cannot broadcast {x.shape} to {shape}")
  return broadcast_in_dim(ctx, x, shape, tuple(range(lead, len(shape))))


@register_lowering(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx, x, *dynamic, shape, broadcast_dimensions, **params):
  _no_dynamic_shapes(dynamic)
  # Key arrays carry their key-data axes last, untouched by the broadcast.
  key_axes = len(_key_shape(ctx))
  broadcast_dimensions = tuple(int(d) for d in broadcast_dimensions) + tuple(
      range(len(shape), len(shape) + key_axes))
  return [broadcast_in_dim(ctx, x, _out_aval(ctx)[0], broadcast_dimensions, params)]


def _whole(shape, src_shape=None, src_offset: int = 0, src_strides=None) -> Box:
  """A box covering all of an output of ``shape`` (row-major sources by default)."""
  if src_strides is None:
    src_strides = row_major_strides(src_shape or shape)
  return Box.make(shape, 0, row_major_strides(shape), src_offset, src_strides)


def _window(in_shape, starts, steps, out_shape) -> Box:
  """The output of a strided window of an ``in_shape`` array (a slice)."""
  in_strides = row_major_strides(in_shape)
  offset = sum(int(b) * s for b, s in zip(starts, in_strides))
  return _whole(out_shape, src_offset=offset,
                src_strides=[s * int(k) for s, k in zip(in_strides, steps)])


def _transpose_tensor(ctx, x, permutation):
  shape = tuple(x.shape[p] for p in permutation)
  in_strides = row_major_strides(x.shape)
  box = _whole(shape, src_strides=[in_strides[p] for p in permutation])
  return move(ctx, [x], [(shape, x.dtype, BoxMap((box,)))],
              _bind(lax.transpose_p, {"permutation": tuple(permutation)}),
              name="transpose", one_to_one=True)[0]


@register_lowering(lax.transpose_p)
def _transpose(ctx, x, *, permutation):
  n = len(permutation)
  permutation = tuple(int(p) for p in permutation) + tuple(range(n, n + len(_key_shape(ctx))))
  return [_transpose_tensor(ctx, x, permutation)]


@register_lowering(lax.rev_p)
def _rev(ctx, x, *, dimensions):
  shape, dtype = _out_aval(ctx)
  # Reversed axes start at their last element and step backwards.
  flip = [a in set(int(d) for d in dimensions) for a in range(len(shape))]
  box = _window(x.shape, [n - 1 if f else 0 for n, f in zip(x.shape, flip)],
                [-1 if f else 1 for f in flip], shape)
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
              _bind(lax.rev_p, {"dimensions": dimensions}), one_to_one=True)


@register_lowering(lax.slice_p)
def _slice(ctx, x, *, start_indices, limit_indices, strides):
  shape, dtype = _out_aval(ctx)
  key_shape = _key_shape(ctx)
  start_indices = tuple(start_indices) + (0,) * len(key_shape)
  limit_indices = tuple(limit_indices) + key_shape
  strides = None if strides is None else tuple(strides) + (1,) * len(key_shape)
  steps = strides or (1,) * len(x.shape)
  box = _window(x.shape, start_indices, steps, shape)
  params = {"start_indices": start_indices, "limit_indices": limit_indices,
            "strides": strides}
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))], _bind(lax.slice_p, params),
              one_to_one=True)


@register_lowering(lax.concatenate_p)
def _concatenate(ctx, *operands, dimension):
  shape, dtype = _out_aval(ctx)
  # Empty operands hold nothing to move; concatenate(x, empty) is then x.
  operands = [t for t in operands if t.size] or list(operands[:1])
  offsets = np.cumsum([0] + [t.size for t in operands])
  out_strides = row_major_strides(shape)
  # Operand k fills its band of the concatenated axis.
  bands = np.cumsum([0] + [t.shape[dimension] for t in operands])
  boxes = [Box.make(t.shape, int(b) * out_strides[dimension], out_strides, int(o),
                    row_major_strides(t.shape))
           for t, b, o in zip(operands, bands, offsets)]
  return move(ctx, list(operands), [(shape, dtype, BoxMap(tuple(boxes)))],
              _bind(lax.concatenate_p, {"dimension": dimension}), one_to_one=True)


_stack_p = lax_internal.stack_p


def _stack(ctx, *operands, axis):
  """``jnp.stack``: operands gain an axis of size 1 and are concatenated."""
  shape, dtype = _out_aval(ctx)
  offsets = np.cumsum([0] + [t.size for t in operands])
  out_strides = row_major_strides(shape)
  # Operand k is row k of the new axis (a size-1 axis of its own).
  boxes = [Box.make(np.insert(t.shape, axis, 1), k * out_strides[axis], out_strides, int(o),
                    np.insert(row_major_strides(t.shape), axis, 0))
           for k, (t, o) in enumerate(zip(operands, offsets))]
  return move(ctx, list(operands), [(shape, dtype, BoxMap(tuple(boxes)))],
              _bind(_stack_p, {"axis": axis}), one_to_one=True)


register_lowering(_stack_p, _stack)


_unstack_p = lax_internal.unstack_p


def _unstack(ctx, x, *, axis):
  """``unstack`` (the transpose of ``jnp.stack``): one result per row of ``axis``.

  All results come out of one superstep; each result element copies its
  operand element, so a result whose elements already sit on the right
  tiles costs only on-tile copies.
  """
  in_strides = row_major_strides(x.shape)
  outputs = []
  for i in range(len(ctx.out_avals)):
    shape, dtype = _out_aval(ctx, i)
    box = _whole(shape, src_offset=i * in_strides[axis],
                 src_strides=in_strides[:axis] + in_strides[axis + 1:])
    outputs.append((shape, dtype, BoxMap((box,))))
  return move(ctx, [x], outputs, _bind(_unstack_p, {"axis": axis}), one_to_one=True)


register_lowering(_unstack_p, _unstack)


_tile_p = lax_internal.tile_p


def _tile(ctx, x, *, reps):
  """``jnp.tile``: the operand repeated ``reps`` times along each axis.

  Each copy of an element on a tile other than its own crosses the exchange
  once per destination tile (a multicast); copies on the same tile are
  replicated by ``Copy`` vertices.
  """
  shape, dtype = _out_aval(ctx)
  key_reps = (1,) * len(_key_shape(ctx))
  all_reps = tuple(int(r) for r in reps) + key_reps
  # np.tile's rule: ``reps`` longer than the operand's rank adds leading axes.
  in_shape = (1,) * (len(all_reps) - len(x.shape)) + tuple(x.shape)
  all_reps = (1,) * (len(in_shape) - len(all_reps)) + all_reps
  out_strides, in_strides = row_major_strides(shape), row_major_strides(in_shape)
  # Each axis splits into (copy, element): copies read the same sources.
  box = Box.make([v for r, n in zip(all_reps, in_shape) for v in (r, n)], 0,
                 [v for o, n in zip(out_strides, in_shape) for v in (o * n, o)], 0,
                 [v for s in in_strides for v in (0, s)])
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
              _bind(_tile_p, {"reps": tuple(reps)}))


register_lowering(_tile_p, _tile)


def _pad_windows(in_size: int, lo: int, hi: int, interior: int):
  """(input slice, output slice) of the elements a pad keeps on one axis."""
  stride = interior + 1
  out_size = lo + hi + in_size + max(in_size - 1, 0) * interior
  if in_size == 0 or out_size <= 0:
    return slice(0, 0), slice(0, 0)
  # First kept input element: the first whose position lo + i * stride >= 0.
  first = (-lo + stride - 1) // stride if lo < 0 else 0
  last = min(in_size - 1, (out_size - 1 - lo) // stride)
  if last < first:
    return slice(0, 0), slice(0, 0)
  return (slice(first, last + 1),
          slice(lo + first * stride, lo + last * stride + 1, stride))


@register_lowering(lax.pad_p)
def _pad(ctx, x, pad_value, *, padding_config):
  if _key_shape(ctx):
    raise NotImplementedError("padding an array of PRNG keys")
  shape, dtype = _out_aval(ctx)
  config = tuple(tuple(int(v) for v in c) for c in padding_config)
  windows = [_pad_windows(n, lo, hi, k) for n, (lo, hi, k) in zip(x.shape, config)]
  constant = _uniform_value(pad_value)
  size = int(np.prod(shape, dtype=np.int64))
  # The kept input window lands on a strided window of the output (an empty
  # window makes an empty box: all padding).
  out_strides, in_strides = row_major_strides(shape), row_major_strides(x.shape)
  box = Box.make([w.stop - w.start for w, _ in windows],
                 sum(o.start * s for (_, o), s in zip(windows, out_strides)),
                 [(o.step or 1) * s for (_, o), s in zip(windows, out_strides)],
                 sum(w.start * s for (w, _), s in zip(windows, in_strides)), in_strides)
  params = {"padding_config": config}
  if constant is None and box.size == size:
    constant = 0  # only cropping: the pad value is never used
  if constant is not None:
    # A constant pad value is filled in place.
    return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
                lambda v: lax.pad_p.bind(v, jnp.asarray(constant, dtype), **params),
                fill=constant, one_to_one=True)
  # A computed one is a source element (index x.size) multicast to the tiles
  # that hold padding.
  index = functools.partial(BoxMap((box,)).index, size, x.size,
                            copy_plan.index_dtype(x.size + 1))
  return move(ctx, [x, pad_value], [(shape, dtype, index)], _bind(lax.pad_p, params))


split_p = lax.split_p


@register_lowering(split_p)
def _split(ctx, x, *, sizes, axis):
  starts = np.cumsum([0] + [int(s) for s in sizes])[:-1]
  outputs = []
  for begin, size in zip(starts, sizes):
    shape = tuple(int(size) if a == axis else d for a, d in enumerate(x.shape))
    corner = [int(begin) if a == axis else 0 for a in range(len(shape))]
    outputs.append((shape, x.dtype, BoxMap((_window(x.shape, corner, [1] * len(shape),
                                                    shape),))))
  return move(ctx, [x], outputs,
              _bind(split_p, {"sizes": tuple(sizes), "axis": axis}), one_to_one=True)


# -- constants from nothing --------------------------------------------------


@register_lowering(lax.iota_p)
def _iota(ctx, *dynamic, dtype, shape, dimension, **params):
  _no_dynamic_shapes(dynamic)
  shape, dtype = _out_aval(ctx)
  out = ctx.new_tensor(shape, dtype)
  if out.size == 0:
    return [out]
  target = ctx.target
  elements = out.mapping.elements_per_tile(target.num_tiles)
  mapping = out.mapping
  stride = int(np.prod(shape[dimension + 1:], dtype=np.int64))
  extent = int(shape[dimension])
  n = out.size
  full = dict(params, dtype=dtype, shape=shape, dimension=dimension)

  def logical_fn():
    return (lax.iota_p.bind(**full),)

  def fn():
    if mapping.is_linear:
      rows, row_size = mapping.storage_shape
      index_dtype = jnp.int32 if n < 2**31 - 1 else jnp.int64

      def tile(row):
        # Each tile computes its own elements' coordinate along `dimension`.
        flat = row * mapping.chunk + jnp.arange(row_size, dtype=index_dtype)
        value = lax.convert_element_type((flat // stride) % extent, dtype)
        return jnp.where(flat < n, value, jnp.zeros((), dtype))

      return (jax.vmap(tile)(jnp.arange(rows, dtype=index_dtype)),)
    return (storage(lax.iota_p.bind(**full), out),)

  ctx.emit(P.Superstep(
      name="iota", op=ctx.op, reads=(), writes=(out,), fn=fn, logical=logical_fn,
      compute_cycles=estimators.fill_cycles(target, elements, out.itemsize),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.IOTA,)))
  return [out]
