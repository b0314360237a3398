"""Block-grid layouts: an array cut into a grid of blocks, one block per tile.

A :class:`BlockGrid` describes how a matmul or convolution operand (or
result) is laid out when each grid tile holds one block: the array's shape,
the grid, the block sizes, the tiles, and serial passes or pieces. Its
storage conversions are reshapes, pads and transposes, not gathers
(:meth:`BlockGrid.to_storage`, :meth:`BlockGrid.to_logical`); its per-element
layout (:meth:`BlockGrid.element_layout`) is derived on demand and shared by
fingerprint; :meth:`BlockGrid.runs` gives its maximal runs of one storage row
in closed form, O(runs), which planners use instead of elements. A
:class:`~ipu_jax.lowering.mapping.TileMapping` holds one when its layout is
a block grid.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

__all__ = ["BlockGrid"]


@dataclasses.dataclass(frozen=True)
class BlockGrid:
  """A regular block layout: the array cut into a grid of blocks, one per tile.

  Axis ``a`` is cut into ``grids[a]`` blocks of ``blocks[a]`` elements (edge
  blocks padded); block ``(i0, i1, ...)`` in row-major order is split into
  ``pieces`` equal runs, one storage row each. ``serial = (axis, count)``
  first cuts ``axis`` into ``count`` passes whose storage sits side by side.
  Both directions are pad / reshape / transpose / slice, which XLA fuses:
  no gathers.
  """

  shape: tuple
  grids: tuple
  blocks: tuple
  pieces: int = 1
  serial: tuple = (None, 1)
  rows: Optional[int] = None  # storage rows when trailing blocks are empty and unstored

  @property
  def _passes(self):
    axis, count = self.serial
    return (axis, count) if axis is not None and count > 1 else (None, 1)

  def to_storage(self, x):
    """Logical array of ``shape`` -> ``[rows, row_size]`` storage."""
    storage = self._to_storage(x)
    if self.rows is None:
      return storage
    from jax import lax
    return lax.slice_in_dim(storage, 0, self.rows, axis=0)

  def to_logical(self, storage):
    """``[rows, row_size]`` storage -> logical array of ``shape``."""
    full = self._counts()[0] * self.pieces
    if self.rows is not None and self.rows < full:
      storage = _pad_high(storage, (full - self.rows, 0))
    return self._to_logical(storage)

  def _to_storage(self, x):
    import jax
    import jax.numpy as jnp
    axis, count = self._passes
    if axis is not None:
      length = -(-x.shape[axis] // count)
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, count * length - x.shape[axis])
      x = jnp.moveaxis(jnp.pad(x, pad), axis, 0)
      x = jnp.moveaxis(x.reshape((count, length) + x.shape[1:]), 1, axis + 1)
      inner = dataclasses.replace(self, shape=x.shape[1:], serial=(None, 1), rows=None)
      per_pass = jax.vmap(inner.to_storage)(x)
      return jnp.transpose(per_pass, (1, 0, 2)).reshape(per_pass.shape[1], -1)
    # lax with explicit shapes (not jnp): the executor traces these for every
    # step's operands, and jnp's shape handling dominated that.
    from jax import lax
    ndim = x.ndim
    x = _pad_high(x, [int(g) * int(b) - int(d) for g, b, d in zip(self.grids, self.blocks, x.shape)])
    x = lax.reshape(x, tuple(v for g, b in zip(self.grids, self.blocks) for v in (int(g), int(b))))
    x = lax.transpose(x, tuple([2 * a for a in range(ndim)] + [2 * a + 1 for a in range(ndim)]))
    num_blocks, block_elements = self._counts()
    x = lax.reshape(x, (num_blocks, block_elements))
    if self.pieces > 1:
      piece = -(-block_elements // self.pieces)
      x = _pad_high(x, (0, piece * self.pieces - block_elements))
      x = lax.reshape(x, (num_blocks * self.pieces, piece))
    return x

  def _to_logical(self, storage):
    import jax
    import jax.numpy as jnp
    axis, count = self._passes
    if axis is not None:
      length = -(-self.shape[axis] // count)
      pass_shape = self.shape[:axis] + (length,) + self.shape[axis + 1:]
      inner = dataclasses.replace(self, shape=pass_shape, serial=(None, 1), rows=None)
      rows = storage.shape[0]
      per_pass = jnp.transpose(storage.reshape(rows, count, -1), (1, 0, 2))
      x = jax.vmap(inner.to_logical)(per_pass)           # [count, *pass_shape]
      x = jnp.moveaxis(x, 0, axis)                        # [.., count, length, ..]
      x = x.reshape(self.shape[:axis] + (count * length,) + self.shape[axis + 1:])
      return jax.lax.slice_in_dim(x, 0, self.shape[axis], axis=axis)
    from jax import lax
    ndim = len(self.shape)
    num_blocks, block_elements = self._counts()
    x = lax.reshape(storage, (num_blocks, storage.size // num_blocks))
    if x.shape[1] != block_elements:
      x = lax.slice_in_dim(x, 0, block_elements, axis=1)
    x = lax.reshape(x, tuple(int(g) for g in self.grids) + tuple(int(b) for b in self.blocks))
    forward = [2 * a for a in range(ndim)] + [2 * a + 1 for a in range(ndim)]
    x = lax.transpose(x, tuple(int(a) for a in np.argsort(forward)))
    x = lax.reshape(x, tuple(int(g) * int(b) for g, b in zip(self.grids, self.blocks)))
    if tuple(x.shape) != tuple(self.shape):
      x = lax.slice(x, (0,) * ndim, tuple(int(d) for d in self.shape))
    return x

  def _counts(self):
    return (int(np.prod(self.grids, dtype=np.int64)),
            int(np.prod(self.blocks, dtype=np.int64)))

  def _place(self, coords) -> tuple:
    """``(row, offset)`` of the elements at ``coords`` (one int64 array per
    axis, broadcastable): the closed form of :meth:`to_storage`."""
    shape = tuple(int(d) for d in self.shape)
    axis_of_passes, count = self._passes
    row = offset = passes = np.zeros((), np.int64)
    g_stride = b_stride = 1
    for a in reversed(range(len(shape))):
      idx = coords[a]
      if a == axis_of_passes:
        length = -(-shape[a] // count)
        passes = passes + idx // length
        idx = idx % length
      row = row + (idx // int(self.blocks[a])) * g_stride
      offset = offset + (idx % int(self.blocks[a])) * b_stride
      g_stride *= int(self.grids[a])
      b_stride *= int(self.blocks[a])
    return row, offset, passes

  def _piece(self) -> int:
    return -(-self._counts()[1] // self.pieces)

  def element_layout(self) -> tuple:
    """``(row, offset)``: the storage row and the place in it of every element.

    The closed form of :meth:`to_storage` on the flattened elements (``[n]``
    int64 each), so a mapping need not hold them. Planners that can work on
    regions use :meth:`runs` instead (its size is the number of runs).
    """
    shape = tuple(int(d) for d in self.shape)
    ndim = len(shape)
    coords = [np.arange(d, dtype=np.int64).reshape([-1 if i == a else 1 for i in range(ndim)])
              for a, d in enumerate(shape)]
    row, offset, passes = (np.broadcast_to(v, shape).reshape(-1) for v in self._place(coords))
    piece = self._piece()
    if self.pieces > 1:
      row = row * self.pieces + offset // piece
      offset = offset % piece
    if self._passes[1] > 1:
      offset = passes * piece + offset
    return row, offset

  def boxes(self) -> tuple:
    """``(row, lo, hi)``: the elements of each storage row as boxes of the array.

    Box ``i`` is the elements ``lo[i] <= index < hi[i]`` (``[boxes, ndim]``
    corners, in :attr:`shape`) held by storage row ``row[i]``: one box per
    block and pass (a block's passes sit side by side in its row), empty
    ones left out. ``None`` when blocks are split into pieces (a piece is a
    share of a block's row-major elements, not a box). A block layout's
    tile is a few boxes however many short runs its rows make, so a
    transpose out of one is planned on these.
    """
    shape = tuple(int(d) for d in self.shape)
    if self.pieces != 1 or not shape or 0 in shape:
      return None
    axis_of_passes, count = self._passes
    segments = []  # per axis: (block index, lo, hi) of each non-empty stretch
    for a, d in enumerate(shape):
      size, grid = int(self.blocks[a]), np.arange(int(self.grids[a]), dtype=np.int64)
      if a == axis_of_passes:
        length = -(-d // count)
        start = np.arange(count, dtype=np.int64)[:, None] * length
        lo = start + grid[None, :] * size
        hi = np.minimum(start + np.minimum((grid[None, :] + 1) * size, length), d)
        block = np.broadcast_to(grid, lo.shape)
      else:
        lo, block = grid * size, grid
        hi = np.minimum(lo + size, d)
      lo, hi, block = lo.reshape(-1), hi.reshape(-1), block.reshape(-1)
      keep = hi > lo
      segments.append((block[keep], lo[keep], hi[keep]))
    # Every combination of one stretch per axis: its row is the blocks' row-major index.
    index = np.indices([s[0].size for s in segments]).reshape(len(shape), -1)
    row = np.zeros(index.shape[1], np.int64)
    for a, (block, _, _) in enumerate(segments):
      row = row * int(self.grids[a]) + block[index[a]]
    lo = np.stack([s[1][index[a]] for a, s in enumerate(segments)], axis=1)
    hi = np.stack([s[2][index[a]] for a, s in enumerate(segments)], axis=1)
    return row, lo, hi

  def runs(self) -> tuple:
    """``(start, length, row, offset)``: the flattened elements as maximal runs
    of consecutive elements in consecutive places of one storage row.

    The same placement as :meth:`element_layout`, found in time proportional
    to the runs: the innermost axis is cut where a block, a pass or a piece
    ends, and the first element of every cut is placed by the closed form.
    """
    shape = tuple(int(d) for d in self.shape)
    empty = np.zeros(0, np.int64)
    if not shape:
      return np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64)
    if 0 in shape:
      return empty, empty, empty, empty
    axis_of_passes, count = self._passes
    ones = [a for a, d in enumerate(shape) if d == 1 and a != axis_of_passes]
    if ones and len(ones) < len(shape):
      # Size-one axes place nothing (one block of one element), but a trailing
      # one would make every element a line of its own ([1, H, W, 1] pooling).
      keep = [a for a in range(len(shape)) if a not in ones]
      serial = (None, 1) if axis_of_passes is None else (keep.index(axis_of_passes), count)
      return dataclasses.replace(
          self, shape=tuple(shape[a] for a in keep), grids=tuple(self.grids[a] for a in keep),
          blocks=tuple(self.blocks[a] for a in keep), serial=serial).runs()
    ndim = len(shape)
    last = shape[-1]
    block = int(self.blocks[-1])
    axis_of_passes, count = self._passes
    if axis_of_passes == ndim - 1:
      length = -(-last // count)
      pass_start = np.arange(count, dtype=np.int64) * length
      within = np.arange(0, length, block, dtype=np.int64)
      cuts = (pass_start[:, None] + within[None, :]).reshape(-1)
      cuts = cuts[cuts < last]
    else:
      cuts = np.arange(0, last, block, dtype=np.int64)
    cut_length = np.diff(np.append(cuts, last))
    prefix = shape[:-1]
    lines = int(np.prod(prefix, dtype=np.int64))
    coords = [c.reshape(-1, 1) for c in np.unravel_index(np.arange(lines, dtype=np.int64), prefix)] \
        if prefix else []
    row, offset, passes = (np.broadcast_to(v, (lines, cuts.size)).reshape(-1)
                           for v in self._place(coords + [cuts[None, :]]))
    start = (np.arange(lines, dtype=np.int64)[:, None] * last + cuts[None, :]).reshape(-1)
    size = np.broadcast_to(cut_length, (lines, cuts.size)).reshape(-1)
    piece = self._piece()
    if self.pieces > 1:
      # A block's pieces cut its row-major elements at multiples of ``piece``.
      first = offset // piece
      num = (offset + size - 1) // piece - first + 1
      cut = np.repeat(np.arange(num.size), num)
      which = first[cut] + np.arange(cut.size) - np.repeat(np.cumsum(num) - num, num)
      lo = np.maximum(offset[cut], which * piece)
      hi = np.minimum(offset[cut] + size[cut], (which + 1) * piece)
      start = start[cut] + (lo - offset[cut])
      size = hi - lo
      row = row[cut] * self.pieces + which
      offset = lo - which * piece
      passes = passes[cut] if passes.ndim else passes
    if count > 1:
      offset = passes * piece + offset
    # Neighbouring cuts that continue one another on one row are one run.
    new = np.ones(start.size, bool)
    new[1:] = (row[1:] != row[:-1]) | (offset[1:] != offset[:-1] + size[:-1])
    first = np.flatnonzero(new)
    total = np.add.reduceat(size, first)
    return start[first], total, row[first], offset[first]


def _pad_high(x, highs):
  """``x`` zero-padded at the end of each axis by ``highs`` (no-op when all 0)."""
  if not any(highs):
    return x
  import jax.numpy as jnp
  from jax import lax
  return lax.pad(x, jnp.zeros((), x.dtype), tuple((0, int(h), 0) for h in highs))
