"""Data movement and constants from nothing: reshape, transpose, slice, pad...

Tile plan. Every primitive here copies elements without computing on them,
so its plan is a static map: for each output element, the flat index of the
input element it copies (or "fill" for padding and constants). Each rule
describes its map in closed form, as boxes of the output whose elements copy
affine positions of the source (:class:`~ipu_jax.lowering.copy_plan.BoxMap`:
a broadcast axis has source stride 0, a transpose permutes strides, a slice
offsets and scales them). :func:`~ipu_jax.lowering.movement.move`
(``lowering/movement.py``) plans the exchange from the boxes by regions (rows
cut at tile-run boundaries, in time proportional to runs,
``lowering/copy_plan.py``; a transpose of the innermost axis, whose rows are
single elements, from its tiles transposed like the data) and falls back to
the per-element planner :func:`~ipu_jax.lowering.copy_elements.exchange_plan`
only for other maps with short runs (a strided slice or reversal of the
innermost axis); all give the same figures.

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import copy_plan
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.copy_plan import Box, BoxMap, row_major_strides
from ipu_jax.lowering.jax_compat import lax_internal, physical_shape_dtype
from ipu_jax.lowering.movement import (alias, bind_params, broadcast_in_dim, broadcast_view,
                                       move, uniform_value)
from ipu_jax.lowering.registry import register_lowering, register_view


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


def _no_dynamic_shapes(dynamic):
  if dynamic:
    raise NotImplementedError("dynamic shapes are not supported; every dimension must be static")


# -- shape-only: aliases -----------------------------------------------------


@register_lowering(lax.reshape_p)
def _reshape(ctx: RuleContext, x, *dynamic, new_sizes, dimensions=None, **params):
  _no_dynamic_shapes(dynamic)
  shape, _ = _out_aval(ctx)
  if dimensions is not None and tuple(dimensions) != tuple(range(len(x.shape))):
    # Old-style reshape with a transpose first.
    x = _transpose_tensor(ctx, x, tuple(dimensions))
  return [alias(x, shape)]


@register_lowering(lax.squeeze_p)
def _squeeze(ctx: RuleContext, x, *, dimensions):
  del dimensions
  return [alias(x, _out_aval(ctx)[0])]


# -- movements ---------------------------------------------------------------


@register_lowering(lax.broadcast_in_dim_p)
def _broadcast_in_dim(ctx: RuleContext, x, *dynamic, shape, broadcast_dimensions, **params):
  _no_dynamic_shapes(dynamic)
  # Key arrays carry their key-data axes last, untouched by the broadcast.
  key_axes = len(_key_shape(ctx))
  broadcast_dimensions = tuple(int(d) for d in broadcast_dimensions) + tuple(
      range(len(shape), len(shape) + key_axes))
  return [broadcast_in_dim(ctx, x, _out_aval(ctx)[0], broadcast_dimensions, params)]


def _broadcast_in_dim_view(x, *, shape, broadcast_dimensions, **params):
  """A ``broadcast_in_dim`` every reader reads broadcast: ``x`` as a view
  (popops reads a broadcast operand in place; ``lowering/lower.py``)."""
  del params
  return broadcast_view(x, shape, broadcast_dimensions)


register_view(lax.broadcast_in_dim_p, _broadcast_in_dim_view)


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
              bind_params(lax.transpose_p, {"permutation": tuple(permutation)}),
              name="transpose", one_to_one=True)[0]


@register_lowering(lax.transpose_p)
def _transpose(ctx: RuleContext, x, *, permutation):
  n = len(permutation)
  permutation = tuple(int(p) for p in permutation) + tuple(range(n, n + len(_key_shape(ctx))))
  return [_transpose_tensor(ctx, x, permutation)]


@register_lowering(lax.rev_p)
def _rev(ctx: RuleContext, x, *, dimensions):
  shape, dtype = _out_aval(ctx)
  # Reversed axes start at their last element and step backwards.
  flip = [a in set(int(d) for d in dimensions) for a in range(len(shape))]
  box = _window(x.shape, [n - 1 if f else 0 for n, f in zip(x.shape, flip)],
                [-1 if f else 1 for f in flip], shape)
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
              bind_params(lax.rev_p, {"dimensions": dimensions}), one_to_one=True)


@register_lowering(lax.slice_p)
def _slice(ctx: RuleContext, x, *, start_indices, limit_indices, strides):
  shape, dtype = _out_aval(ctx)
  key_shape = _key_shape(ctx)
  start_indices = tuple(start_indices) + (0,) * len(key_shape)
  limit_indices = tuple(limit_indices) + key_shape
  strides = None if strides is None else tuple(strides) + (1,) * len(key_shape)
  steps = strides or (1,) * len(x.shape)
  box = _window(x.shape, start_indices, steps, shape)
  params = {"start_indices": start_indices, "limit_indices": limit_indices,
            "strides": strides}
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))], bind_params(lax.slice_p, params),
              one_to_one=True)


@register_lowering(lax.concatenate_p)
def _concatenate(ctx: RuleContext, *operands, dimension):
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
              bind_params(lax.concatenate_p, {"dimension": dimension}), one_to_one=True)


_stack_p = lax_internal.stack_p


def _stack(ctx: RuleContext, *operands, axis):
  """``jnp.stack``: operands gain an axis of size 1 and are concatenated."""
  shape, dtype = _out_aval(ctx)
  offsets = np.cumsum([0] + [t.size for t in operands])
  out_strides = row_major_strides(shape)
  # Operand k is row k of the new axis (a size-1 axis of its own).
  boxes = [Box.make(np.insert(t.shape, axis, 1), k * out_strides[axis], out_strides, int(o),
                    np.insert(row_major_strides(t.shape), axis, 0))
           for k, (t, o) in enumerate(zip(operands, offsets))]
  return move(ctx, list(operands), [(shape, dtype, BoxMap(tuple(boxes)))],
              bind_params(_stack_p, {"axis": axis}), one_to_one=True)


register_lowering(_stack_p, _stack)


_unstack_p = lax_internal.unstack_p


def _unstack(ctx: RuleContext, x, *, axis):
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
  return move(ctx, [x], outputs, bind_params(_unstack_p, {"axis": axis}), one_to_one=True)


register_lowering(_unstack_p, _unstack)


_tile_p = lax_internal.tile_p


def _tile(ctx: RuleContext, x, *, reps):
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
              bind_params(_tile_p, {"reps": tuple(reps)}))


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
def _pad(ctx: RuleContext, x, pad_value, *, padding_config):
  if _key_shape(ctx):
    raise NotImplementedError("padding an array of PRNG keys")
  shape, dtype = _out_aval(ctx)
  config = tuple(tuple(int(v) for v in c) for c in padding_config)
  windows = [_pad_windows(n, lo, hi, k) for n, (lo, hi, k) in zip(x.shape, config)]
  constant = uniform_value(pad_value)
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
  return move(ctx, [x, pad_value], [(shape, dtype, index)], bind_params(lax.pad_p, params))


split_p = lax.split_p


@register_lowering(split_p)
def _split(ctx: RuleContext, x, *, sizes, axis):
  starts = np.cumsum([0] + [int(s) for s in sizes])[:-1]
  outputs = []
  for begin, size in zip(starts, sizes):
    shape = tuple(int(size) if a == axis else d for a, d in enumerate(x.shape))
    corner = [int(begin) if a == axis else 0 for a in range(len(shape))]
    outputs.append((shape, x.dtype, BoxMap((_window(x.shape, corner, [1] * len(shape),
                                                    shape),))))
  return move(ctx, [x], outputs,
              bind_params(split_p, {"sizes": tuple(sizes), "axis": axis}), one_to_one=True)


# -- constants from nothing --------------------------------------------------


@register_lowering(lax.iota_p)
def _iota(ctx: RuleContext, *dynamic, dtype, shape, dimension, **params):
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
