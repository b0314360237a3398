"""``TileShardedArray``: a JAX array whose leading axis is sharded over tiles.

The TessellateIPU data model (graphcore-research/tessellate-ipu,
``tessellate_ipu/core/tile_array.py``): slice ``i`` of the leading axis lives
on tile ``tiles[i]``, contiguous there. Under :func:`ipu_jax.jit` the tile
placement is real (``tile_put_sharded`` and friends emit exchanges onto those
tiles, ``tile_map`` runs one vertex per tile); outside it the array is a plain
array with the tiles as static metadata.

The class is a pytree whose only child is the array, the tiles being static
auxiliary data, so it passes through ``jax.jit``, ``ipu_jax.jit``,
``lax.fori_loop`` and ``vmap`` unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence, Tuple, Union

import jax
import numpy as np

from ipu_jax.arguments import tile_ids

__all__ = ["TileShardedArray", "check_tile_array_multi_slice", "tiles_tuple"]

SliceType = Union[int, slice]


def tiles_tuple(tiles) -> Tuple[int, ...]:
  """``tiles`` (tuple, list, NumPy array of ints) as a tuple of Python ints
  (:func:`ipu_jax.arguments.tile_ids`: a TypeError for ids that are not ints)."""
  return tile_ids(tiles)


def check_tile_array_multi_slice(slices: tuple, shape) -> bool:
  """Whether ``slices`` keeps every tile's shard contiguous in its memory.

  Allowed: any slice of the tile axis; on the per-tile axes, unit-stride
  slices where every axis before the last sliced one is indexed by an int
  (as TessellateIPU allows). Raises ``ValueError`` naming the slicing
  otherwise.
  """
  if not isinstance(slices, tuple):
    raise TypeError(f"expected a tuple of slices, got {slices!r}")
  if len(slices) > len(shape):
    raise ValueError(f"Unsupported slicing `{slices}` on tile array of shape `{shape}`: "
                     "more indices than axes.")
  slices = slices + (slice(None),) * (len(shape) - len(slices))
  for s in slices[1:]:
    if isinstance(s, slice) and s.step not in (None, 1):
      raise ValueError(f"Unsupported strided slicing `{slices}` on tile array of shape "
                       f"`{shape}`: a tile's shard would not stay contiguous.")
  sliced = [i for i, (s, d) in enumerate(zip(slices, shape)) if d > 1 and s != slice(None)]
  last = max(sliced) if sliced else 0
  for axis in range(1, last):
    if not isinstance(slices[axis], int):
      raise ValueError(f"Unsupported slicing `{slices}` on tile array of shape `{shape}`: "
                       f"axis {axis} must be indexed by an int to keep shards contiguous.")
  return True


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TileShardedArray:
  """A JAX array sharded over IPU tiles along its leading axis.

  Attributes:
    array: the underlying array; ``array.shape[0] == len(tiles)``.
    tiles: the tile holding each slice of the leading axis (a tuple of ints).

  The constructor only records the placement; use
  :func:`~ipu_jax.tessellate.tile_put_sharded` /
  :func:`~ipu_jax.tessellate.tile_put_replicated` to move data onto tiles.
  """

  array: Any
  tiles: Tuple[int, ...]

  def __post_init__(self):
    tiles = tiles_tuple(self.tiles)
    if len(tiles) != np.shape(self.array)[0]:
      raise ValueError(f"TileShardedArray: the array's leading axis ({np.shape(self.array)}) "
                       f"must have one slice per tile; got {len(tiles)} tiles.")
    object.__setattr__(self, "tiles", tiles)

  def tree_flatten(self):
    return (self.array,), self.tiles

  @classmethod
  def tree_unflatten(cls, tiles, children):
    # Bypass the check: transformations put placeholders (tracers of another
    # shape, ``object()`` sentinels) in the array's slot.
    obj = object.__new__(cls)
    object.__setattr__(obj, "array", children[0])
    object.__setattr__(obj, "tiles", tiles)
    return obj

  @property
  def dtype(self):
    return self.array.dtype

  @property
  def shape(self) -> tuple:
    return tuple(self.array.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def aval(self):
    return jax.core.ShapedArray(self.shape, self.dtype)

  @property
  def num_tiles(self) -> int:
    return len(self.tiles)

  @property
  def tile_aval(self):
    """The abstract value of one tile's shard."""
    return jax.core.ShapedArray(self.shape[1:], self.dtype)

  @property
  def tile_shape(self) -> tuple:
    return self.shape[1:]

  @property
  def device_array(self):
    return self.array

  def reshape(self, shape) -> "TileShardedArray":
    """Reshape each shard; the leading (tile) axis must stay (or be ``-1``)."""
    shape = tuple(shape)
    if shape[0] not in (-1, self.num_tiles):
      raise ValueError(f"Can not reshape the tile axis of a TileShardedArray "
                       f"({self.num_tiles} tiles) to {shape}.")
    return TileShardedArray(self.array.reshape((self.num_tiles,) + shape[1:]), self.tiles)

  def tile_reshape(self, shape) -> "TileShardedArray":
    """Reshape every tile's shard to ``shape``."""
    return self.reshape((self.num_tiles,) + tuple(shape))

  def squeeze(self) -> "TileShardedArray":
    """Drop size-1 per-tile axes (the tile axis stays, even with one tile)."""
    axes = tuple(i for i, d in enumerate(self.shape) if d == 1 and i > 0)
    return TileShardedArray(self.array.reshape(
        tuple(d for i, d in enumerate(self.shape) if i not in axes)), self.tiles)

  def __len__(self) -> int:
    return self.shape[0]

  def __array__(self, dtype=None, copy=None):
    del copy
    return np.asarray(self.array, dtype=dtype)

  def __getitem__(self, key) -> "TileShardedArray":
    """Slice the tile axis (and contiguous per-tile ranges)."""
    if isinstance(key, (int, np.integer, slice)):
      key = (key,)
    if not isinstance(key, tuple):
      raise ValueError(f"Unsupported tile sharded array slicing key: {key!r}.")
    if isinstance(key[0], (int, np.integer)):
      if not -self.num_tiles <= int(key[0]) < self.num_tiles:  # NumPy's rule, not a wrap
        raise IndexError(f"tile index {int(key[0])} is out of range for a TileShardedArray of "
                         f"{self.num_tiles} tiles.")
      k = int(key[0]) % self.num_tiles
      key = (slice(k, k + 1),) + key[1:]
    check_tile_array_multi_slice(key, self.shape)
    return TileShardedArray(self.array[key], self.tiles[key[0]])

  @classmethod
  def concatenate(cls, arrays: Sequence["TileShardedArray"]) -> "TileShardedArray":
    """Concatenate tile sharded arrays along the tile axis."""
    if not all(isinstance(a, TileShardedArray) for a in arrays):
      raise TypeError("TileShardedArray.concatenate takes TileShardedArrays only.")
    out = jax.lax.concatenate([a.array for a in arrays], dimension=0)
    return cls(out, tuple(itertools.chain(*[a.tiles for a in arrays])))
