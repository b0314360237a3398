"""Putting data on tiles: ``tile_put_sharded``, ``tile_put_replicated``, constants.

TessellateIPU's placement functions (``tessellate_ipu/core/tile_array.py``).
Each is the placement primitive of :mod:`ipu_jax.tessellate.tile_gather`
(output slice ``i`` on tile ``tiles[i]``): under :func:`ipu_jax.jit` one
exchange superstep moves the data there, shown in the report as
``tile_put_sharded`` / ``tile_put_replicated``; outside it they are plain
array operations.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.tessellate.tile_array import TileShardedArray, tiles_tuple
from ipu_jax.tessellate.tile_gather import place

__all__ = ["TileShardingError", "tile_put_sharded", "tile_put_sharded_prim", "tile_put_replicated_prim", "tile_put_replicated", "tile_constant_sharded",
           "tile_constant_replicated"]


class TileShardingError(ValueError, AssertionError):
  """Shards and tiles do not match (an ``AssertionError`` too, as TessellateIPU raises)."""


def _as_constant(out):
  """Outside a trace a constant stays a NumPy array (as TessellateIPU's)."""
  return out if isinstance(out, jax.core.Tracer) else np.asarray(out)


def _check_sharded(shape, tiles, what: str) -> None:
  if len(shape) == 0:
    raise TileShardingError(f"{what}: a scalar has no leading axis to shard over tiles; use "
                     "tile_put_replicated.")
  if shape[0] != len(tiles):
    raise TileShardingError(f"{what}: the leading axis has {shape[0]} shards but {len(tiles)} tiles "
                     f"were given ({tiles}); give one tile per shard.")


def tile_put_sharded(array, tiles: Sequence[int]) -> TileShardedArray:
  """Shard ``array`` over ``tiles`` along its leading axis: shard ``i`` on ``tiles[i]``.

  Args:
    array: an array with ``len(tiles)`` entries on its leading axis.
    tiles: the tile ids.

  Returns:
    The :class:`TileShardedArray`.

  Raises:
    ValueError: the leading axis and the tiles differ in length, or a tile id
      is negative (a tile beyond the target is refused when the program lowers).
  """
  tiles = tiles_tuple(tiles)
  array = jnp.asarray(array)
  _check_sharded(array.shape, tiles, "tile_put_sharded")
  out = place(array, range(len(tiles)), tiles, name="tile_put_sharded")
  return TileShardedArray(out, tiles)


def tile_put_replicated(array, tiles: Sequence[int]) -> TileShardedArray:
  """A copy of ``array`` on every tile of ``tiles`` (result ``[len(tiles), *array.shape]``).

  The exchange multicasts: each element leaves its tile once.
  """
  tiles = tiles_tuple(tiles)
  array = jnp.asarray(array)
  out = place(array[None], (0,) * len(tiles), tiles, name="tile_put_replicated")
  return TileShardedArray(out, tiles)


def tile_constant_sharded(data, tiles: Sequence[int]) -> TileShardedArray:
  """A NumPy constant sharded over ``tiles`` (slice ``i`` on ``tiles[i]``).

  The constant is part of the program (as Poplar's graph constants), placed
  on its tiles by the same exchange as :func:`tile_put_sharded`.
  """
  data = np.asarray(data)
  tiles = tiles_tuple(tiles)
  _check_sharded(data.shape, tiles, "tile_constant_sharded")
  return TileShardedArray(_as_constant(place(jnp.asarray(data), range(len(tiles)), tiles,
                                             name="tile_constant_sharded")), tiles)


def tile_constant_replicated(data, tiles: Sequence[int]) -> TileShardedArray:
  """A NumPy constant replicated on every tile of ``tiles``."""
  data = np.asarray(data)
  tiles = tiles_tuple(tiles)
  return TileShardedArray(_as_constant(place(jnp.asarray(data)[None], (0,) * len(tiles), tiles,
                                             name="tile_constant_replicated")), tiles)


def tile_put_sharded_prim(x, tiles):
  """The raw placement of :func:`tile_put_sharded` (the array, not a TileShardedArray).

  Outside a trace it returns ``x`` itself (nothing to place).
  """
  tiles = tiles_tuple(tiles)
  _check_sharded(np.shape(x), tiles, "tile_put_sharded")
  if not isinstance(x, jax.core.Tracer):
    return x
  return place(x, range(len(tiles)), tiles, name="tile_put_sharded")


def tile_put_replicated_prim(x, tiles):
  """The raw placement of :func:`tile_put_replicated`."""
  return tile_put_replicated(x, tiles).array
