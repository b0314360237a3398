"""Tile lowering of :func:`ipu_jax.ops.tile_map` (a user codelet on chosen tiles).

Tile plan: slice ``i`` of every operand is exchanged onto tile ``tiles[i]``
(nothing moves for slices already there); each of those tiles runs one vertex
of the user's codelet, costed by the codelet's estimator (vertices on one tile
share its workers as in the graph API); results stay one slice per tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, storage
from ipu_jax.lowering.exchange import relayout, relayout_cost, to_flat
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.tile_map import (codelet_body, codelet_cycles, codelet_flops, is_supervisor,
                                  tile_map_p)


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


def _slice_mapping(ctx, shape, dtype, tiles: np.ndarray) -> TileMapping:
  """Slice ``i`` of the leading axis on ``tiles[i]``."""
  per = _size(shape[1:])
  if per == 0 or len(tiles) == 0:
    return ctx.linear_mapping(shape, dtype)
  return TileMapping.from_element_tiles(np.repeat(tiles, per))


@register_lowering(tile_map_p)
def _tile_map_rule(ctx, *args, codelet, tiles):
  target = ctx.target
  tiles_arr = np.asarray(tiles, np.int64)
  if tiles_arr.size and tiles_arr.max() >= target.num_tiles:
    raise NotImplementedError(
        f"tile_map on tile {int(tiles_arr.max())}, but the target has only "
        f"{target.num_tiles} tiles")
  in_maps = [_slice_mapping(ctx, t.shape, t.dtype, tiles_arr) for t in args]
  outs = [ctx.new_tensor(a.shape, a.dtype,
                         _slice_mapping(ctx, a.shape, a.dtype, tiles_arr),
                         name=codelet.name)
          for a in ctx.out_avals]
  cost = add_costs(*[relayout_cost(target, t.mapping, m, t.itemsize)
                     for t, m in zip(args, in_maps)])
  in_specs = [jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in args]
  out_specs = [jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in outs]
  n = tiles_arr.size
  cycles = codelet_cycles(codelet, in_specs, out_specs, target)
  compute = estimators.vertex_cycles_per_tile(target, tiles_arr, np.full(n, cycles, np.float64),
                                              supervisor=np.full(n, is_supervisor(codelet)))
  vertices = np.bincount(tiles_arr, minlength=target.num_tiles)[:target.num_tiles]
  body = codelet_body(codelet)

  def fn(*storages):
    # Exchange: every slice to its tile; compute: one vertex per tile, i.e.
    # the codelet vmapped over the tile axis.
    xs = [to_flat(relayout(s, t.mapping, m), m).reshape(t.shape)
          for s, t, m in zip(storages, args, in_maps)]
    results = jax.vmap(body)(*xs) if n else [jnp.zeros(o.shape, o.dtype) for o in outs]
    return tuple(storage(r, o) for r, o in zip(results, outs))

  ctx.emit(P.Superstep(
      name=f"tile_map<{codelet.name}>", op=ctx.op, reads=tuple(args), writes=tuple(outs),
      fn=fn, compute_cycles=compute if n else None, exchange=cost, vertices=vertices,
      codelets=(codelet.name,), flops=codelet_flops(codelet, in_specs, out_specs) * n))
  return outs
