"""IPU-Link bytes of a block exchange on several IPUs, counted per cell of a grid.

Where an operand's elements cross IPUs to reach the grid blocks that need
them, the bytes each IPU sends over its links are counted without per-element
arrays: the elements each IPU holds are counted per cell of the grid cut at
the blocks' bounds (closed-form over the mapping's runs
where there are few enough cells, else directly per box,
``_ipu_box_counts``), and each block's count is a sum over the cells its
box covers; an element leaves its IPU once per other IPU
whose tiles need it. ``lowering/block_overlap.py`` builds the blocks' boxes
and the per-tile bytes these link bytes go with.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import numpy as np

from ipu_jax.lowering.block_counts import box_volumes, count_below

__all__ = ["LinkBlocks", "halo_link_bytes", "link_blocks", "link_bytes"]


def halo_link_bytes(target, tiles, sent, itemsize) -> np.ndarray:
  """IPU-Link bytes with halos, as ``grid_exchange_cost`` bounds them.

  Every element sent leaves for every other IPU the grid spans.
  """
  t, per = target.num_tiles, target.tiles_per_ipu
  spanned = np.unique(tiles // per)
  sent_per_ipu = np.bincount(np.arange(t) // per, weights=sent,
                             minlength=target.num_ipus)[:target.num_ipus].astype(np.int64)
  others = spanned.size - np.isin(np.arange(target.num_ipus), spanned)
  return (sent_per_ipu * others * itemsize).astype(np.int64)


# Most (IPUs x cells) counts the exact IPU-Link bytes may take.
_LINK_BUDGET = 1 << 22


def _cell_counts(shape, points, weights, owner, n_owners, cuts) -> np.ndarray:
  """Signed prefix counts of flat positions, per owner, in every cell of a grid.

  The cuts split each axis into intervals; a cell is one interval per axis.
  Each point ``x`` adds ``weight`` times the number of flat indices below
  ``x`` in the cell, to its owner's count of that cell. The prefix count
  recurses on the axes: below ``x`` lie whole slabs of the cell before
  ``x``'s digit along the outer axis, plus, when that digit is inside the
  cell's interval, the prefix of the rest of ``x`` in the rest of the cell.
  So per axis each point touches only the interval holding its digit (those
  below take it whole, by a cumulative sum), ``O(points + owners x cells)``
  work per axis, whatever the number of cells each point lies below.

  Args:
    shape: the tensor's shape (at least one axis).
    points: ``[P]`` flat positions, ``0 <= x <= prod(shape)``.
    weights: ``[P]`` int64 weights.
    owner: ``[P]`` owner of each point, ``< n_owners``.
    n_owners: how many owners.
    cuts: per axis, sorted unique cut points from 0 to the axis size.

  Returns:
    ``[n_owners, *cells]`` int64 sums, ``cells[a] = len(cuts[a]) - 1``.
  """
  ndim = len(shape)
  widths = [np.diff(c) for c in cuts]
  cells = tuple(w.size for w in widths)
  total = np.zeros((n_owners,) + cells, np.int64)
  stride = int(np.prod(shape, dtype=np.int64))
  prefix = np.zeros(points.shape, np.int64)  # cell index along the axes before a
  outer = 1  # cells along the axes before a
  for a in range(ndim):
    size = int(shape[a])
    stride //= max(size, 1)
    digit = points // stride if a == 0 else (points // stride) % max(size, 1)
    # Interval of the digit; the end of the tensor lies past the last one.
    j = np.searchsorted(cuts[a], digit, side="right") - 1
    n = cells[a]
    slot = (owner * outer + prefix) * (n + 1) + np.minimum(j, n)
    length = n_owners * outer * (n + 1)
    # Points in interval j count (digit - start_j); those past it count it
    # whole. Weighted bincounts are float64: exact below 2**53.
    into = np.bincount(slot, weights=weights * (digit - cuts[a][np.minimum(j, n)]),
                       minlength=length)[:length].reshape(n_owners, outer, n + 1)
    past = np.bincount(slot, weights=weights, minlength=length)[:length].reshape(
        n_owners, outer, n + 1)
    past = np.cumsum(past[..., ::-1], axis=-1)[..., ::-1][..., 1:]
    level = (into[..., :n] + past * widths[a]).astype(np.int64)
    # Each of those counts a whole cross-section of the cells' inner axes.
    inner = functools.reduce(np.multiply.outer, widths[a + 1:], np.int64(1))
    total += level.reshape((n_owners,) + cells[:a + 1] + (1,) * (ndim - a - 1)) * inner
    keep = j < n
    points, weights, owner = points[keep], weights[keep], owner[keep]
    prefix = prefix[keep] * n + j[keep]
    outer *= n
  return total


def _box_sums(counts: np.ndarray, cuts, lo, hi) -> np.ndarray:
  """``[owners, K]`` sums of per-cell counts over the cells of boxes ``[lo, hi)``."""
  ndim = counts.ndim - 1
  first = [np.searchsorted(cuts[a], lo[a]) for a in range(ndim)]
  if all(np.array_equal(np.searchsorted(cuts[a], hi[a]), first[a] + 1) for a in range(ndim)):
    # Every box is one cell (a matmul grid's blocks cut the tensor into its
    # cells): its sum is that cell's count, gathered without the
    # cumulative sums over every cell below.
    return counts.reshape(counts.shape[0], -1)[:, np.ravel_multi_index(first, counts.shape[1:])]
  # Cumulative sums along every cell axis, behind a leading zero per axis
  # (the zero layers stay zero under the other axes' sums).
  summed = counts
  for a in range(ndim):
    summed = np.cumsum(summed, axis=a + 1)
  padded = np.zeros((counts.shape[0],) + tuple(n + 1 for n in counts.shape[1:]), summed.dtype)
  padded[(slice(None),) + (slice(1, None),) * ndim] = summed
  # Each box's sum is the signed sum of the padded sums at its 2**ndim
  # corners: their flat indices side by side, gathered at once.
  dims = padded.shape[1:]
  strides = [math.prod(dims[a + 1:]) for a in range(ndim)]
  j_lo = [np.searchsorted(cuts[a], lo[a]) * strides[a] for a in range(ndim)]
  j_hi = [np.searchsorted(cuts[a], hi[a]) * strides[a] for a in range(ndim)]
  corners = np.zeros((1 << ndim, lo[0].size), np.int64)
  signs = np.empty(1 << ndim, np.int64)
  for corner in range(1 << ndim):
    for a in range(ndim):
      corners[corner] += j_hi[a] if corner >> a & 1 else j_lo[a]
    signs[corner] = -1 if (ndim - bin(corner).count("1")) % 2 else 1
  gathered = padded.reshape(counts.shape[0], -1)[:, corners]  # [owners, corners, boxes]
  return np.einsum("ock,c->ok", gathered, signs)


@dataclasses.dataclass(frozen=True)
class LinkBlocks:
  """The blocks of an exchange as :func:`link_bytes` counts them.

  They depend on the geometry only (shapes, window, grid, needs), not on
  where the tensor or the grid lie: cached with it (every matmul operand
  exchange on several IPUs counts its IPU-Link bytes).

  Attributes:
    shape: the (merged) tensor's shape, one axis of one element for a scalar.
    key: ``[G]`` the block of each grid index.
    lo, hi: per axis, ``[K]`` each block's box, clipped to the tensor.
    cuts: per axis, the sorted cut points the boxes' bounds make.
    cells: how many cells those cuts make.
  """

  shape: tuple
  key: np.ndarray
  lo: list
  hi: list
  cuts: list
  cells: int


def link_blocks(shape, boxes, needs, grid_shape) -> LinkBlocks:
  """:class:`LinkBlocks` of an exchange (uncached; see :func:`_geometry_link_bytes`)."""
  grid_shape = tuple(int(g) for g in grid_shape)
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  coords = np.unravel_index(np.arange(g_count), grid_shape)
  cut = [a for a, need in enumerate(needs) if need is not None]
  key = (np.ravel_multi_index([coords[a] for a in cut], [grid_shape[a] for a in cut])
         if cut else np.zeros(g_count, np.int64))
  # One grid index per block: the first along the axes needing everything.
  shared = [coords[a] == 0 for a in range(len(grid_shape)) if needs[a] is None]
  # With no such axis every grid index is its own block (np.all of nothing is
  # one True, not one per index).
  first = np.all(shared, axis=0) if shared else np.ones(g_count, bool)
  rep = np.flatnonzero(first)
  if not len(shape):  # a scalar: one axis of one element, in every block
    shape, boxes = (1,), (np.zeros((g_count, 1), np.int64), np.ones((g_count, 1), np.int64))
  # Only the part of a box inside the tensor counts.
  lo = [np.clip(np.ascontiguousarray(boxes[0][rep, a]), 0, int(shape[a]))
        for a in range(len(shape))]
  hi = [np.clip(np.ascontiguousarray(boxes[1][rep, a]), lo[a], int(shape[a]))
        for a in range(len(shape))]
  cuts = [np.unique(np.concatenate([[0, int(shape[a])], lo[a], hi[a]]))
          for a in range(len(shape))]
  cells = int(np.prod([c.size - 1 for c in cuts], dtype=np.int64))
  for table in [key] + lo + hi + cuts:
    table.setflags(write=False)
  return LinkBlocks(tuple(shape), key, lo, hi, cuts, cells)


def link_bytes(target, blocks: LinkBlocks, ipu_starts, ipu_of, num_elements, tiles,
               itemsize) -> Optional[np.ndarray]:
  """Exact IPU-Link bytes when every element has one block per needing axis.

  An element is multicast to the grid tiles of its block (every block along
  the axes needing all elements); it crosses once to each other IPU among
  them. So IPU ``i`` sends, per block, its elements in the block times the
  other IPUs the block's tiles span. Each IPU's elements per block are
  counted from the ends of its runs: run by run in every block where they
  are few (:func:`_ipu_box_counts`), else as its counts per cell of the grid
  that the blocks' bounds cut the tensor into (:func:`_cell_counts`),
  summed over the block's cells: work in IPU runs plus IPUs x cells, not
  runs x blocks. None when IPUs x cells is more than ``_LINK_BUDGET``.
  """
  per, n_ipus = target.tiles_per_ipu, target.num_ipus
  shape, lo, hi, n_blocks = blocks.shape, blocks.lo, blocks.hi, blocks.lo[0].size
  member = np.zeros((n_blocks, n_ipus), bool)
  member[blocks.key, tiles // per] = True
  # The tensor as runs of one IPU each (``ipu_starts``, ``ipu_of``).
  ipu_ends = np.append(ipu_starts[1:], num_elements)
  others = member.sum(axis=1)[None, :] - member.T  # [IPU, block]
  if 2 * ipu_starts.size * n_blocks <= _DIRECT_BUDGET:
    inside = _ipu_box_counts(shape, ipu_starts, ipu_ends, ipu_of, n_ipus, lo, hi)
  else:
    cuts = blocks.cuts
    if n_ipus * blocks.cells > _LINK_BUDGET:
      return None
    points = np.concatenate([ipu_ends, ipu_starts]).astype(np.int64)
    weights = np.concatenate([np.ones(ipu_ends.size, np.int64),
                              -np.ones(ipu_starts.size, np.int64)])
    counts = _cell_counts(shape, points, weights, np.concatenate([ipu_of, ipu_of]), n_ipus,
                          cuts)
    inside = _box_sums(counts, cuts, lo, hi)  # [IPU, block]
  return ((inside * others).sum(axis=1) * itemsize).astype(np.int64)


# Most (IPU runs x blocks) pairs counted one by one (:func:`_ipu_box_counts`).
_DIRECT_BUDGET = 1 << 14


def _ipu_box_counts(shape, starts, ends, ipu_of, n_ipus, lo, hi) -> np.ndarray:
  """``[n_ipus, K]`` elements of each IPU in each of ``K`` boxes, run by run.

  Most operands lie on a few IPU runs (a weight on consecutive tiles spans
  two or three IPUs): counting every run's two ends in every box directly
  is then a few thousand prefix counts, cheaper than the cells
  :func:`_cell_counts` cuts the tensor into. ``lo``, ``hi``: per axis,
  ``[K]`` bounds clipped to the tensor.
  """
  sizes = [int(d) for d in shape]
  ndim, r, k = len(sizes), starts.size, lo[0].size
  points = np.concatenate([ends, starts]).astype(np.int64)
  # Points down, boxes across: the digits are taken once per point and the
  # boxes' volumes once per box, broadcast only where they meet.
  x = points[:, None]
  los = [l[None, :] for l in lo]
  his = [h[None, :] for h in hi]
  members = [None] * ndim
  inner, volume = box_volumes(los, his, members)
  below = np.broadcast_to(count_below(x, sizes, los, his, members, inner, volume), (2 * r, k))
  per_run = below[:r] - below[r:]  # [run, box]
  inside = np.zeros((n_ipus, k), np.int64)
  np.add.at(inside, ipu_of, per_run)
  return inside
