"""``tile_gather``: a static gather of leading-axis slices onto chosen tiles.

The one placement primitive of :mod:`ipu_jax.tessellate`: output slice ``i``
is input slice ``indices[i]``, placed on tile ``tiles[i]``. ``tile_put_sharded``
(``indices = range(n)``) and ``tile_put_replicated`` (every index 0 of a
stacked operand) are this primitive too, so every placement is priced the same
way: the exchange moves each element that is not already on its destination
tile (an element sent to several tiles leaves its tile once: the exchange
multicasts), and nothing is copied on a tile for a slice already in place
(TessellateIPU inserts no ``Memcpy`` vertex then) unless ``copy=True``.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import storage
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import movement_cost, take_or_fill, to_flat
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.primitive import define_primitive, not_mapped
from ipu_jax.tessellate.tile_array import TileShardedArray, tiles_tuple

__all__ = ["tile_gather", "tile_gather_p", "place"]

tile_gather_p = jcore.Primitive("tile_gather")


def _impl(x, *, indices, tiles, copy, name):
  del tiles, copy, name
  return jnp.take(x, np.asarray(indices, np.int32), axis=0)


def _abstract_eval(x, *, indices, tiles, copy, name):
  del tiles, copy, name
  return jax.core.ShapedArray((len(indices),) + tuple(x.shape[1:]), x.dtype)


def _transpose(ct, x, *, indices, tiles, copy, name):
  del tiles, copy, name
  ct = ad.instantiate_zeros(ct)
  zeros = jnp.zeros(x.aval.shape, x.aval.dtype)
  return [zeros.at[np.asarray(indices, np.int32)].add(ct)]


def _batch(args, dims, **params):
  # Batched placements run as plain gathers: the batch axis is not a tile axis.
  (x,), (d,) = args, dims
  x = jnp.moveaxis(x, d, 1) if d is not not_mapped else x
  return _impl(x, **params), (1 if d is not not_mapped else not_mapped)


define_primitive(tile_gather_p, _impl, _abstract_eval, batch=_batch)
ad.deflinear2(tile_gather_p, _transpose)


def place(x, indices: Sequence[int], tiles: Sequence[int], *, copy: bool = False,
          name: str = "tile_gather"):
  """Bind the placement primitive, checking its arguments first.

  Args:
    x: the operand; its leading axis is the one gathered.
    indices: the input slice each output slice takes.
    tiles: the tile of each output slice.
    copy: copy slices already on their tile (an on-tile ``Memcpy``).
    name: the step's name in reports.

  Raises:
    ValueError: ``indices`` and ``tiles`` differ in length, an index is out
      of range, or a tile id is negative.
  """
  indices, tiles = tiles_tuple(indices), tiles_tuple(tiles)
  if len(indices) != len(tiles):
    raise ValueError(f"{name}: {len(indices)} slices for {len(tiles)} tiles; give one tile "
                     "per slice.")
  if np.ndim(x) == 0:
    raise ValueError(f"{name}: the operand needs a leading axis to shard over tiles; "
                     "got a scalar.")
  n = np.shape(x)[0]
  bad = [i for i in indices if not 0 <= i < n]
  if bad:
    raise ValueError(f"{name}: slice indices {bad} out of range for a leading axis of {n}.")
  if any(t < 0 for t in tiles):
    raise ValueError(f"{name}: tile ids must be non-negative, got {tiles}.")
  return tile_gather_p.bind(x, indices=indices, tiles=tiles, copy=bool(copy), name=name)


def tile_gather(arr: Union[jax.Array, TileShardedArray], indices: Sequence[int],
                tiles: Sequence[int], copy: bool = False) -> TileShardedArray:
  """Gather slices of ``arr``'s leading axis onto tiles (TessellateIPU's ``tile_gather``).

  Output slice ``i`` is ``arr[indices[i]]`` on tile ``tiles[i]``. A slice
  already on its tile is not copied unless ``copy``.

  Args:
    arr: an array or a :class:`TileShardedArray`.
    indices: static indices into the leading axis.
    tiles: the tile of each output slice.
    copy: always copy, even slices already in place.

  Returns:
    The :class:`TileShardedArray` on ``tiles``.
  """
  data = arr.array if isinstance(arr, TileShardedArray) else jnp.asarray(arr)
  return TileShardedArray(place(data, indices, tiles, copy=copy), tiles_tuple(tiles))


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile plan: one superstep. Output slice i lives on tiles[i]; its elements
# come from input slice indices[i] wherever the input's mapping holds them.
# Exchange: every element not already on its destination tile (multicast for
# one element sent to several tiles). Compute: only ``copy=True`` copies the
# elements that stay on their tile (popops' Copy).


def slice_mapping(shape, tiles: np.ndarray) -> TileMapping:
  """Slice ``i`` of the leading axis of ``shape`` on ``tiles[i]``."""
  per = int(np.prod(shape[1:], dtype=np.int64))
  return TileMapping.from_element_tiles(np.repeat(np.asarray(tiles, np.int64), per))


def check_tiles(ctx: RuleContext, tiles: np.ndarray, what: str) -> None:
  """Raise before anything runs when a tile id is outside the target."""
  if tiles.size and tiles.max() >= ctx.target.num_tiles:
    raise ValueError(
        f"{what}: tile {int(tiles.max())} is outside the target, which has "
        f"{ctx.target.num_tiles} tiles (0..{ctx.target.num_tiles - 1}); use tile ids "
        "below that or a target with more tiles (IPUTarget tiles_per_ipu / num_ipus).")


@register_lowering(tile_gather_p)
def _tile_gather_rule(ctx: RuleContext, x, *, indices, tiles, copy, name):
  target = ctx.target
  tiles_arr = np.asarray(tiles, np.int64)
  check_tiles(ctx, tiles_arr, name)
  out_shape = ctx.out_avals[0].shape
  per = int(np.prod(out_shape[1:], dtype=np.int64))
  if per == 0 or not tiles:
    out = ctx.new_tensor(out_shape, x.dtype, ctx.linear_mapping(out_shape, x.dtype), name=name)
    ctx.emit(P.Superstep(name=name, op=ctx.op, reads=(), writes=(out,),
                         fn=lambda: (storage(jnp.zeros(out_shape, x.dtype), out),)))
    return [out]
  out = ctx.new_tensor(out_shape, x.dtype, slice_mapping(out_shape, tiles_arr), name=name)
  source = (np.asarray(indices, np.int64)[:, None] * per + np.arange(per)).reshape(-1)
  src_tile = x.mapping.element_tile[source]
  dst_tile = np.repeat(tiles_arr, per)
  exchange = movement_cost(target, src_tile, dst_tile, x.itemsize, element_id=source)
  local = np.bincount(dst_tile[src_tile == dst_tile], minlength=target.num_tiles)
  copies = local[:target.num_tiles] if copy else np.zeros(target.num_tiles, np.int64)
  compute = estimators.copy_cycles(target, copies, x.itemsize) if copies.any() else None
  idx = np.asarray(indices, np.int32)
  src_map, dtype = x.mapping, x.dtype

  def fn(s):
    flat = take_or_fill(to_flat(s, src_map), source, jnp.zeros((), dtype))
    return (storage(flat, out),)

  ctx.emit(P.Superstep(
      name=name, op=ctx.op, reads=(x,), writes=(out,), fn=fn, compute_cycles=compute,
      exchange=exchange if exchange.total_bytes else None,
      vertices=P.worker_vertices(ctx, copies), codelets=(vocab.COPY,) if copy else (),
      logical=lambda a: (jnp.take(a, idx, axis=0),)))
  return [out]
