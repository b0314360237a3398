"""``BlockCSR``: a block-sparse matrix in compressed sparse rows of blocks.

The matrix ``[M, K]`` is cut into ``bm x bk`` blocks; the non-zero blocks are
listed row of blocks by row of blocks, each row's blocks in increasing
column order (CSR over blocks, as PopSparse's static format). The *pattern*
(shape, block shape, row offsets, column indices) is static: it is the
pytree's auxiliary data, so ``jit`` specialises on it and a static sparse
matmul is planned for it when lowering. The non-zero *values*
``[nnz_blocks, bm, bk]`` are the pytree's one leaf, so ``grad`` differentiates
with respect to them and ``vmap`` batches them (a leading axis).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels.popsparse import BLOCK_SIZES

__all__ = ["BlockCSR", "SparsityPattern"]


def _block_shape(block_shape) -> tuple:
  try:
    bm, bk = (int(b) for b in block_shape)
  except (TypeError, ValueError):
    raise ValueError(f"BlockCSR: block_shape must be a pair like (4, 4), got {block_shape!r}.")
  if bm != bk or bm not in BLOCK_SIZES:
    raise ValueError(f"BlockCSR: block_shape {(bm, bk)} is not supported; valid block shapes "
                     f"are {[(b, b) for b in BLOCK_SIZES]}.")
  return bm, bk


def _matrix_shape(shape, block) -> tuple:
  try:
    m, k = (int(d) for d in shape)
  except (TypeError, ValueError):
    raise ValueError(f"BlockCSR: shape must be a pair (M, K), got {shape!r}.")
  if m < 0 or k < 0:
    raise ValueError(f"BlockCSR: shape {(m, k)} has a negative dimension.")
  if m % block[0] or k % block[1]:
    raise ValueError(f"BlockCSR: block shape {block} does not divide the matrix shape "
                     f"{(m, k)}; pad the matrix to a multiple of the block.")
  return m, k


class SparsityPattern:
  """The static part of a :class:`BlockCSR`: where its non-zero blocks are.

  Hashable and comparable by content, so ``jit`` caches on it.

  Attributes:
    shape: ``(M, K)``.
    block: ``(bm, bk)``.
    row_offsets: ``[M / bm + 1]`` int32: blocks of block row ``r`` are
      ``row_offsets[r]:row_offsets[r + 1]``.
    col_indices: ``[nnz_blocks]`` int32 block column of each block.
  """

  def __init__(self, shape, block, row_offsets, col_indices):
    block = _block_shape(block)
    shape = _matrix_shape(shape, block)
    rows, cols = shape[0] // block[0], shape[1] // block[1]
    offsets = np.asarray(row_offsets)
    indices = np.asarray(col_indices)
    if offsets.ndim != 1 or offsets.size != rows + 1:
      raise ValueError(f"BlockCSR: row_offsets must have {rows + 1} entries (block rows + 1), "
                       f"got shape {offsets.shape}.")
    if indices.ndim != 1:
      raise ValueError(f"BlockCSR: col_indices must be a vector, got shape {indices.shape}.")
    for name, a in (("row_offsets", offsets), ("col_indices", indices)):
      if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"BlockCSR: {name} must be integers, got {a.dtype}.")
    offsets, indices = offsets.astype(np.int64), indices.astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != indices.size or np.any(np.diff(offsets) < 0):
      raise ValueError(f"BlockCSR: row_offsets must start at 0, never decrease and end at the "
                       f"number of blocks ({indices.size}); got {offsets.tolist()[:8]}...")
    if indices.size and (indices.min() < 0 or indices.max() >= cols):
      bad = int(indices[(indices < 0) | (indices >= cols)][0])
      raise ValueError(f"BlockCSR: column index {bad} is out of range; valid block columns "
                       f"are 0..{cols - 1}.")
    row = np.repeat(np.arange(rows), np.diff(offsets))
    same_row = row[1:] == row[:-1]
    if np.any(same_row & (indices[1:] <= indices[:-1])):
      r = int(row[1:][same_row & (indices[1:] <= indices[:-1])][0])
      raise ValueError(f"BlockCSR: column indices of block row {r} are unsorted or repeated; "
                       f"each row's columns must strictly increase.")
    self.shape, self.block = shape, block
    self.row_offsets = _frozen(offsets.astype(np.int32))
    self.col_indices = _frozen(indices.astype(np.int32))
    self._key = (shape, block, self.row_offsets.tobytes(), self.col_indices.tobytes())

  @property
  def grid(self) -> tuple:
    """``(block rows, block columns)``."""
    return self.shape[0] // self.block[0], self.shape[1] // self.block[1]

  @property
  def nnz_blocks(self) -> int:
    return int(self.col_indices.size)

  @property
  def density(self) -> float:
    """Non-zero blocks over all blocks (0 for an empty shape)."""
    total = self.grid[0] * self.grid[1]
    return self.nnz_blocks / total if total else 0.0

  @functools.cached_property
  def row_indices(self) -> np.ndarray:
    """``[nnz_blocks]`` block row of each block."""
    return _frozen(np.repeat(np.arange(self.grid[0], dtype=np.int32),
                             np.diff(self.row_offsets)))

  def transpose(self) -> tuple:
    """``(pattern of the transpose, order)``: block ``i`` of the transpose is block ``order[i]``."""
    order = np.lexsort((self.row_indices, self.col_indices))
    counts = np.bincount(self.col_indices, minlength=self.grid[1])
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return (SparsityPattern(self.shape[::-1], self.block[::-1], offsets,
                            self.row_indices[order]), order)

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, SparsityPattern) and self._key == other._key

  def __repr__(self):
    return (f"SparsityPattern(shape={self.shape}, block={self.block}, "
            f"nnz_blocks={self.nnz_blocks}, density={self.density:.4g})")


def _frozen(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  a.setflags(write=False)
  return a


@jax.tree_util.register_pytree_node_class
class BlockCSR:
  """A block-sparse ``[M, K]`` matrix: static pattern, traced values.

  Build one with :meth:`fromdense` or :meth:`from_coordinates`, or directly
  from CSR arrays. ``values`` is ``[nnz_blocks, bm, bk]`` (with leading axes
  under ``vmap``).
  """

  def __init__(self, values, row_offsets, col_indices, shape, block_shape=(1, 1)):
    pattern = SparsityPattern(shape, block_shape, row_offsets, col_indices)
    self.pattern = pattern
    self.values = _checked_values(values, pattern)

  @classmethod
  def from_pattern(cls, values, pattern: SparsityPattern) -> "BlockCSR":
    """New values (``[..., nnz_blocks, bm, bk]``) in an existing pattern."""
    if not isinstance(pattern, SparsityPattern):
      raise ValueError(f"BlockCSR.from_pattern: pattern must be a SparsityPattern, got "
                       f"{type(pattern).__name__}.")
    return cls._from_pattern(_checked_values(values, pattern), pattern)

  @classmethod
  def _from_pattern(cls, values, pattern: SparsityPattern) -> "BlockCSR":
    obj = cls.__new__(cls)
    obj.pattern, obj.values = pattern, values
    return obj

  # -- pytree ---------------------------------------------------------------

  def tree_flatten(self):
    return (self.values,), self.pattern

  @classmethod
  def tree_unflatten(cls, pattern, children):
    return cls._from_pattern(children[0], pattern)

  # -- construction ---------------------------------------------------------

  @classmethod
  def fromdense(cls, dense, mask=None, block_shape=(1, 1)) -> "BlockCSR":
    """The blocks of ``dense`` where ``mask`` holds (default: blocks with a non-zero).

    Args:
      dense: ``[M, K]`` array (traced values are fine when ``mask`` is given).
      mask: ``[M / bm, K / bk]`` boolean block mask, or ``[M, K]`` element
        mask (a block is kept if any of its elements is); must be concrete.
      block_shape: ``(bm, bk)``.
    """
    block = _block_shape(block_shape)
    if getattr(dense, "ndim", None) != 2:
      raise ValueError(f"BlockCSR.fromdense takes a matrix, got shape {np.shape(dense)}.")
    shape = _matrix_shape(dense.shape, block)
    grid = (shape[0] // block[0], shape[1] // block[1])
    if mask is None:
      if isinstance(dense, jax.core.Tracer):
        raise ValueError("BlockCSR.fromdense: a traced array needs an explicit (concrete) mask.")
      mask = np.asarray(dense) != 0
    mask = _block_mask(mask, shape, grid, block)
    rows, cols = np.nonzero(mask)
    offsets = np.concatenate([[0], np.cumsum(mask.sum(axis=1))])
    pattern = SparsityPattern(shape, block, offsets, cols)
    # A host array's blocks are picked on the host: the same values as the
    # jnp path, without an XLA program per shape for the reshape and gather.
    if isinstance(dense, jax.Array):
      blocks = dense.reshape(grid[0], block[0], grid[1], block[1])
      return cls._from_pattern(jnp.transpose(blocks, (0, 2, 1, 3))[rows, cols], pattern)
    dense = np.asarray(dense)
    blocks = dense.astype(jax.dtypes.canonicalize_dtype(dense.dtype), copy=False)
    blocks = blocks.reshape(grid[0], block[0], grid[1], block[1])
    return cls._from_pattern(jax.device_put(blocks.transpose(0, 2, 1, 3)[rows, cols]), pattern)

  @classmethod
  def from_coordinates(cls, rows, cols, values, shape, block_shape=(1, 1)) -> "BlockCSR":
    """From block coordinates in any order: block ``i`` is at ``(rows[i], cols[i])``.

    Raises:
      ValueError: a coordinate out of range, a repeated coordinate, or values
        not ``[len(rows), bm, bk]``.
    """
    block = _block_shape(block_shape)
    shape = _matrix_shape(shape, block)
    grid = (shape[0] // block[0], shape[1] // block[1])
    rows, cols = np.asarray(rows, np.int64).reshape(-1), np.asarray(cols, np.int64).reshape(-1)
    if rows.shape != cols.shape:
      raise ValueError(f"BlockCSR.from_coordinates: rows and cols differ in length "
                       f"({rows.size} and {cols.size}).")
    for name, idx, size in (("row", rows, grid[0]), ("column", cols, grid[1])):
      bad = (idx < 0) | (idx >= size)
      if bad.any():
        raise ValueError(f"BlockCSR.from_coordinates: block {name} index {int(idx[bad][0])} is "
                         f"out of range; valid block {name}s are 0..{size - 1}.")
    if np.shape(values) != (rows.size,) + block:
      raise ValueError(f"BlockCSR.from_coordinates: values must be {[rows.size, *block]}, got "
                       f"{list(np.shape(values))}.")
    order = np.lexsort((cols, rows))
    key = rows[order] * max(grid[1], 1) + cols[order]
    if np.any(key[1:] == key[:-1]):
      i = int(np.nonzero(key[1:] == key[:-1])[0][0])
      raise ValueError(f"BlockCSR.from_coordinates: block ({int(rows[order][i])}, "
                       f"{int(cols[order][i])}) is given twice.")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=grid[0]))])
    pattern = SparsityPattern(shape, block, offsets, cols[order])
    return cls._from_pattern(jnp.asarray(values)[order], pattern)

  # -- queries --------------------------------------------------------------

  @property
  def shape(self) -> tuple:
    return self.pattern.shape

  @property
  def block_shape(self) -> tuple:
    return self.pattern.block

  @property
  def dtype(self):
    return self.values.dtype

  @property
  def row_offsets(self) -> np.ndarray:
    return self.pattern.row_offsets

  @property
  def col_indices(self) -> np.ndarray:
    return self.pattern.col_indices

  @property
  def nnz_blocks(self) -> int:
    return self.pattern.nnz_blocks

  @property
  def density(self) -> float:
    return self.pattern.density

  def todense(self):
    """The ``[..., M, K]`` dense matrix (zeros outside the blocks)."""
    return blocks_todense(self.values, self.pattern)

  @property
  def T(self) -> "BlockCSR":
    """The transpose (a block-sparse ``[K, M]``)."""
    pattern, order = self.pattern.transpose()
    place = _host_placement(self.values)
    if place is not None:     # concrete: moved on the host, no XLA program per shape
      return BlockCSR._from_pattern(
          place(np.asarray(self.values)[..., order, :, :].swapaxes(-1, -2)), pattern)
    return BlockCSR._from_pattern(jnp.swapaxes(self.values[..., order, :, :], -1, -2), pattern)

  def __repr__(self):
    return (f"BlockCSR(shape={self.shape}, block_shape={self.block_shape}, "
            f"nnz_blocks={self.nnz_blocks}, dtype={getattr(self.values, 'dtype', None)})")


def _checked_values(values, pattern: SparsityPattern):
  want = (pattern.nnz_blocks,) + pattern.block
  shape = tuple(getattr(values, "shape", np.shape(values)))
  if len(shape) < 3 or shape[-3:] != want:
    raise ValueError(f"BlockCSR: values must be [nnz_blocks, bm, bk] = {list(want)}, got "
                     f"{list(shape)}.")
  return values


def _block_mask(mask, shape, grid, block) -> np.ndarray:
  if isinstance(mask, jax.core.Tracer):
    raise ValueError("BlockCSR: the mask must be concrete (a NumPy array), not traced: the "
                     "pattern of a static sparse matrix is known when lowering.")
  mask = np.asarray(mask, bool)
  if mask.shape == tuple(shape):
    return mask.reshape(grid[0], block[0], grid[1], block[1]).any(axis=(1, 3))
  if mask.shape == tuple(grid):
    return mask
  raise ValueError(f"BlockCSR: mask must be the matrix's shape {tuple(shape)} or its block "
                   f"grid's {tuple(grid)}, got {mask.shape}.")


def blocks_todense(values, pattern: SparsityPattern):
  """``[..., nnz, bm, bk]`` values placed in a dense ``[..., M, K]``."""
  (rb, cb), (bm, bk) = pattern.grid, pattern.block
  batch = tuple(values.shape[:-3])
  flat = pattern.row_indices.astype(np.int64) * cb + pattern.col_indices
  place = _host_placement(values)
  if place is not None:
    # Concrete values are placed on the host and the matrix put back where the
    # values were: the same matrix, without an XLA program per shape for the
    # scatter and the transposes.
    grid = np.zeros(batch + (rb * cb, bm, bk), values.dtype)
    grid[..., flat, :, :] = np.asarray(values)
    grid = grid.reshape(batch + (rb, cb, bm, bk)).swapaxes(-3, -2)
    return place(grid.reshape(batch + tuple(pattern.shape)))
  grid = jnp.zeros(batch + (rb * cb, bm, bk), values.dtype)
  grid = grid.at[..., flat, :, :].set(values) if pattern.nnz_blocks else grid
  grid = grid.reshape(batch + (rb, cb, bm, bk))
  return jnp.swapaxes(grid, -3, -2).reshape(batch + tuple(pattern.shape))


def _host_placement(values):
  """How to put a host copy of concrete ``values`` on the device: None for
  traced or committed values (the jnp path keeps their placement) and for a
  host dtype JAX would narrow."""
  if isinstance(values, jax.core.Tracer):
    return None
  if isinstance(values, jax.Array):
    return None if values.committed else jax.device_put   # uncommitted, as a jnp op's
  if isinstance(values, np.ndarray) and jax.dtypes.canonicalize_dtype(values.dtype) == values.dtype:
    return jax.device_put
  return None
