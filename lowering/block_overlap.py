"""Elements of a tile mapping inside blocks, by interval arithmetic.

A :class:`TileMapping` is a list of runs of the flattened tensor, one tile
each (:attr:`TileMapping.intervals`). A block of a grid laid over a *view* of
the tensor (its axes merged into view axes, as ``dot_general`` operands are
seen as ``[B, M, K]``) is, when it is aligned with the merged axes, a *box*: a
range along every axis of the tensor. The elements of a run inside a box are
a difference of two prefix counts, each closed-form in the digits of the
run's ends, so overlapping every run with a box costs ``O(axes)`` NumPy work
per run, whatever the number of elements.

:func:`block_exchange_cost` uses that to give the operand exchange of
matmuls and convolutions (:func:`ipu_jax.lowering.matmul_plan.grid_exchange_cost`,
halos included) with the same bytes without a per-element array, for the
layouts where every block is a box; the callers keep the per-element path for
the rest. It runs in steps: each block's range per view axis
(:class:`_BlockRanges`), those ranges as boxes of the tensor
(:func:`view_boxes`), the elements some block and exactly one block need
(:class:`_NeededSets`), each grid tile's runs with its box
(:class:`_GridRuns`), then the bytes in, out and over the IPU-Links.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["prefix_in_box", "merge_axes", "view_boxes", "block_exchange_cost",
           "block_link_bytes"]


def prefix_in_box(x: np.ndarray, shape: Sequence[int], lo: np.ndarray, hi: np.ndarray,
                  members: Optional[Sequence] = None) -> np.ndarray:
  """How many flat (row-major) indices below ``x`` lie in the box ``[lo, hi)``.

  Args:
    x: ``[R]`` flat positions, ``0 <= x <= prod(shape)``.
    shape: the tensor's shape.
    lo, hi: ``[R, ndim]`` (or ``[ndim]``) box bounds per axis; an empty
      range (``hi <= lo``) makes an empty box.
    members: optionally, per axis, None or a cumulative table ``[size + 1]``
      (``members[a][j]``: how many of the coordinates below ``j`` belong to a
      set): only indices whose coordinates all belong count (a box within a
      product of sets, e.g. the positions a strided window reads).

  Returns:
    ``[R]`` counts (int64).
  """
  x = np.asarray(x, np.int64)
  ndim = len(shape)
  lo = np.broadcast_to(np.asarray(lo, np.int64), x.shape + (ndim,))
  hi = np.broadcast_to(np.asarray(hi, np.int64), x.shape + (ndim,))
  return _prefix(x, shape, [lo[..., a] for a in range(ndim)], [hi[..., a] for a in range(ndim)],
                 members)


def _prefix(x, shape, los, his, members=None, clipped: bool = False) -> np.ndarray:
  """:func:`prefix_in_box` with the bounds given per axis (``[R]`` arrays).

  Below ``x`` lie, per axis ``a``, the whole slabs of the box before ``x``'s
  digit along ``a`` (when ``x``'s digits before ``a`` all lie in the box).
  The digits come from one ``unravel_index``, and the first axis's terms
  need no mask: on a grid laid over many tiles these arrays have one entry
  per run end, tens of thousands of them. ``clipped``: the bounds already
  lie inside the tensor, ``0 <= lo <= hi <= size`` (the caller clipped the
  boxes once, not every run's copy of them).
  """
  ndim = len(shape)
  x = np.asarray(x, np.int64)
  if ndim == 0:  # one element: below x when x >= 1
    return (x >= 1).astype(np.int64)
  members = [None] * ndim if members is None else list(members)
  sizes = [int(s) for s in shape]
  if not clipped:  # only the part of the box inside the tensor counts
    los, his = _clipped(los, his, sizes)
  inner, volume = _box_volumes(los, his, members)
  return _count_below(x, sizes, los, his, members, inner, volume)


def _box_volumes(los, his, members) -> tuple:
  """``(inner, volume)`` of boxes: per axis ``a`` the volume of the axes after
  ``a`` (None for the last), and the whole box's volume."""
  ndim = len(los)
  widths = [h - l if c is None else c[h] - c[l] for l, h, c in zip(los, his, members)]
  inner = [None] * ndim  # box volume of the axes after a (None: no axes)
  volume = None
  for a in reversed(range(ndim)):
    inner[a] = volume
    volume = widths[a] if volume is None else volume * widths[a]
  return inner, volume


def _count_below(x, sizes, los, his, members, inner, volume) -> np.ndarray:
  """:func:`_prefix` given the boxes' :func:`_box_volumes` (bounds clipped)."""
  ndim = len(sizes)
  total = math.prod(sizes)
  if total == 0:
    return np.zeros(x.shape, np.int64)
  # x == total has no digits: every index lies below it.
  whole = x >= total
  digits = np.unravel_index(np.minimum(x, total - 1), sizes)
  count = inside = None
  for a in range(ndim):
    digit, lo, hi, cum = digits[a], los[a], his[a], members[a]
    below = np.minimum(np.maximum(digit, lo), hi)
    term = below - lo if cum is None else cum[below] - cum[lo]
    if inner[a] is not None:
      term = term * inner[a]
    if inside is not None:
      term = term * inside
    count = term if count is None else count + term
    if a + 1 < ndim:
      now = (digit >= lo) & (digit < hi)
      if cum is not None:
        now &= cum[digit + 1] > cum[digit]
      inside = now if inside is None else inside & now
  # ``volume`` (the boxes' shape) broadcasts against ``x``'s.
  return np.where(whole, np.asarray(volume, np.int64), count).astype(np.int64, copy=False)


def _clipped(los, his, sizes) -> tuple:
  """Per-axis box bounds cut to the tensor: ``0 <= lo <= hi <= size``."""
  los = [np.clip(lo, 0, int(size)) for lo, size in zip(los, sizes)]
  his = [np.clip(hi, lo, int(size)) for lo, hi, size in zip(los, his, sizes)]
  return los, his


def merge_axes(shape: Sequence[int], groups: Sequence[Sequence[int]]) -> tuple:
  """The tensor with its axes merged where a view merges them, same flat order.

  Size-one axes are dropped; neighbouring axes that are neighbours of one
  group too (in its order) become one axis. A range along such a group is
  then a range along one axis, a box whatever its bounds.

  Returns:
    ``(shape, groups)`` of the merged tensor.
  """
  shape = [int(d) for d in shape]
  order = [[a for a in axes if shape[a] != 1] for axes in groups]
  where = {a: (v, i) for v, axes in enumerate(order) for i, a in enumerate(axes)}
  merged, first_of = [], []  # per merged axis: size, (group, position of its first axis)
  previous = None
  for a in range(len(shape)):
    if shape[a] == 1:
      continue
    v, i = where[a]
    if previous is not None and previous[0] == v and previous[1] == i - 1:
      merged[-1] *= shape[a]
    else:
      merged.append(shape[a])
      first_of.append((v, i))
    previous = (v, i)
  new_groups = [sorted((m for m, (v, _) in enumerate(first_of) if v == g),
                       key=lambda m: first_of[m][1]) for g in range(len(groups))]
  return tuple(merged), new_groups


def _merged_ranges(lo: np.ndarray, hi: np.ndarray, sizes: Sequence[int]):
  """Ranges along merged axes (outer first) as one range per axis, if a box.

  Returns:
    ``(los, his, ok, empty)``: per sub-axis ``[Q]`` bounds, ``[Q]`` whether
    the range is a box (``los``/``his`` are meaningless where it is not), and
    ``[Q]`` whether it is empty (with no sub-axes, only ``empty`` says so).
  """
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  empty = hi <= lo
  # An empty range is the empty box on the outermost axis.
  lo, hi = np.where(empty, 0, lo), np.where(empty, 1, hi)
  ok = np.ones(lo.shape, bool)
  los, his = [], []
  for i in range(len(sizes)):
    inner = int(np.prod(sizes[i + 1:], dtype=np.int64))
    if inner == 1:
      los.append(lo), his.append(hi)
      lo, hi = np.zeros_like(lo), np.ones_like(hi)
      continue
    # Either within one outer index, or whole inner ranges.
    one = lo // inner == (hi - 1) // inner
    aligned = (lo % inner == 0) & (hi % inner == 0)
    ok &= one | aligned
    los.append(lo // inner)
    his.append(np.where(one, lo // inner + 1, hi // inner))
    lo, hi = np.where(one, lo % inner, 0), np.where(one, (hi - 1) % inner + 1, inner)
  if los:
    his[0] = np.where(empty, los[0], his[0])
  return los, his, ok, empty


def view_boxes(shape: Sequence[int], groups: Sequence[Sequence[int]],
               lo: Sequence[np.ndarray], hi: Sequence[np.ndarray]) -> Optional[tuple]:
  """Boxes in the tensor's axes of ranges along the axes of a merged view.

  Args:
    shape: the tensor's shape.
    groups: per view axis, the tensor axes merged into it, outer first (every
      tensor axis in exactly one group).
    lo, hi: per view axis, ``[Q]`` ranges along its merged index.

  Returns:
    ``(lo, hi)``, ``[Q, ndim]`` bounds per tensor axis, or None when some
    range is not a box of the tensor's axes.
  """
  q = np.broadcast_shapes(*[np.shape(x) for x in list(lo) + list(hi)])
  box_lo = np.zeros(q + (len(shape),), np.int64)
  box_hi = np.ones(q + (len(shape),), np.int64)
  void = np.zeros(q, bool)  # empty ranges of view axes with no tensor axis
  for axes, l, h in zip(groups, lo, hi):
    los, his, ok, empty = _merged_ranges(np.broadcast_to(l, q), np.broadcast_to(h, q),
                                         [int(shape[a]) for a in axes])
    if not ok.all():
      return None
    if not axes:
      void |= empty
    for a, sub_lo, sub_hi in zip(axes, los, his):
      box_lo[..., a], box_hi[..., a] = sub_lo, sub_hi
  if void.any():
    if not len(shape):
      return None
    box_hi[..., 0] = np.where(void, box_lo[..., 0], box_hi[..., 0])
  return box_lo, box_hi


def _needed_ranges(lo: np.ndarray, hi: np.ndarray, grid: int) -> Optional[tuple]:
  """Per block ``i < grid``, the coordinates ``c`` with ``lo[c] <= i < hi[c]``.

  Returns:
    ``(first, end)``, ``[grid]`` each, when every block's set is a range
    ``[first, end)``; else None.
  """
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  i = np.arange(grid, dtype=np.int64)
  if lo.size * grid <= 1 << 22:
    needed = (lo[None, :] <= i[:, None]) & (i[:, None] < hi[None, :])
    any_ = needed.any(axis=1)
    first = np.where(any_, np.argmax(needed, axis=1), 0)
    end = np.where(any_, lo.size - np.argmax(needed[:, ::-1], axis=1), 0)
    if not np.array_equal(needed.sum(axis=1), end - first):
      return None
    return first, end
  if np.any(np.diff(lo) < 0) or np.any(np.diff(hi) < 0):
    return None
  # Monotone bounds: the blocks' sets are ranges, found by bisection.
  first = np.searchsorted(hi, i, side="right")
  end = np.searchsorted(lo, i, side="right")
  return first, np.maximum(end, first)


def _halo_link_bytes(target, tiles, sent, itemsize) -> np.ndarray:
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
class _LinkBlocks:
  """The blocks of an exchange as :func:`_link_bytes` counts them.

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


def _link_blocks(shape, boxes, needs, grid_shape) -> _LinkBlocks:
  """:class:`_LinkBlocks` of an exchange (uncached; see :func:`_geometry_link_bytes`)."""
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
  return _LinkBlocks(tuple(shape), key, lo, hi, cuts, cells)


def _link_bytes(target, blocks: _LinkBlocks, ipu_starts, ipu_of, num_elements, tiles,
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
  inner, volume = _box_volumes(los, his, members)
  below = np.broadcast_to(_count_below(x, sizes, los, his, members, inner, volume), (2 * r, k))
  per_run = below[:r] - below[r:]  # [run, box]
  inside = np.zeros((n_ipus, k), np.int64)
  np.add.at(inside, ipu_of, per_run)
  return inside


@dataclasses.dataclass(frozen=True)
class _BlockRanges:
  """Per view axis, the range of coordinates each grid block needs.

  Attributes:
    lo, hi: per view axis, ``[G]`` bounds (in the view, window offset added).
    widths: per view axis, None (no grid axis cuts it) or ``[n]`` how many
      blocks along the grid axis cutting it need each coordinate.
    shared: blocks along the grid axes that need every element.
    halo: some coordinate is needed by more than one block along an axis.
  """

  lo: tuple
  hi: tuple
  widths: tuple
  shared: int
  halo: bool


def _block_ranges(window, grid_shape, needs) -> Optional[_BlockRanges]:
  """The view ranges of every block, or None when a block's set is not a range."""
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  coords = np.unravel_index(np.arange(g_count), tuple(int(g) for g in grid_shape))
  lo = [np.full(g_count, a, np.int64) for a, _ in window]
  hi = [np.full(g_count, b, np.int64) for _, b in window]
  widths = [None] * len(window)  # per view axis: blocks needing each coordinate
  shared = 1  # blocks along the axes that need every element
  for a, need in enumerate(needs):
    if need is None:
      shared *= int(grid_shape[a])
      continue
    v, need_lo, need_hi = need
    ranges = _needed_ranges(need_lo, need_hi, int(grid_shape[a]))
    if ranges is None or widths[v] is not None:
      return None
    widths[v] = np.maximum(np.asarray(need_hi, np.int64) - np.asarray(need_lo, np.int64), 0)
    first, end = ranges
    lo[v] = window[v][0] + first[coords[a]]
    hi[v] = window[v][0] + end[coords[a]]
  halo = any(w is not None and w.size and w.max() > 1 for w in widths)
  return _BlockRanges(tuple(lo), tuple(hi), tuple(widths), shared, halo)


@dataclasses.dataclass(frozen=True)
class _NeededSets:
  """The elements some block needs, and those exactly one block needs.

  Attributes:
    some, one: per merged axis, None (every coordinate is in the set) or a
      cumulative table of the coordinates in it (as ``members`` of
      :func:`prefix_in_box`).
    some_all, one_all: whether the view axes of several (or no) merged
      axes, which need all their coordinates alike, are in each set.
  """

  some: tuple
  one: tuple
  some_all: bool
  one_all: bool


def _needed_sets(shape, groups, window, widths) -> Optional[_NeededSets]:
  """Elements needed by some block (``count >= 1``) and by exactly one (``count == 1``).

  None when a view axis of several (or no) merged axes does not need all
  its coordinates alike (cut by the window or read with gaps).
  """
  some, one = [None] * len(shape), [None] * len(shape)
  some_all = one_all = True
  for v, ((start, stop), axes) in enumerate(zip(window, groups)):
    width = widths[v]
    if len(axes) != 1:
      full = start == 0 and stop == int(np.prod([shape[x] for x in axes], dtype=np.int64))
      if width is not None and (not full or np.any(width != width[0])):
        return None
      if width is None and not full:
        return None
      w = 1 if width is None else int(width[0])
      some_all &= w >= 1
      one_all &= w == 1
      continue
    size = shape[axes[0]]
    if width is None:
      width = np.ones(stop - start, np.int64)
    padded = np.zeros(size, np.int64)
    padded[start:stop] = width
    if start > 0 or stop < size or np.any(width == 0):
      some[axes[0]] = np.concatenate([[0], np.cumsum(padded >= 1)])
    if np.any(width != 1):
      one[axes[0]] = np.concatenate([[0], np.cumsum(padded == 1)])
  return _NeededSets(tuple(some), tuple(one), some_all, one_all)


@dataclasses.dataclass(frozen=True)
class _GridRuns:
  """The runs of the mapping that lie on grid tiles, with their tile's box.

  Attributes:
    shape: the (merged) tensor's shape.
    g_count: grid tiles.
    g: ``[R]`` grid index of each such run.
    starts, ends: ``[R]`` their ends.
    run_lo, run_hi: per axis, ``[R]`` the box of each run's tile, clipped
      to the tensor (shared by both ends of the run).
  """

  shape: tuple
  g_count: int
  g: np.ndarray
  starts: np.ndarray
  ends: np.ndarray
  run_lo: list
  run_hi: list


def _grid_runs(t, starts, ends, run_tiles, geo: "_Geometry") -> _GridRuns:
  """The runs on grid tiles that reach into their tile's box, with that box.

  A run lying wholly before or after its box's first and last elements
  holds none of it (nor of any set within it): it is left out, so the
  prefix counts run only where a tile may hold part of its own block (on a
  grid laid over many tiles, a few of its runs).
  """
  shape, tiles = geo.shape, geo.tiles
  g_count = tiles.size
  grid_of_tile = np.full(t, -1, np.int64)
  grid_of_tile[tiles] = np.arange(g_count)
  g = grid_of_tile[run_tiles]
  mine = g >= 0
  bounds = plan_cache.cached(_BOX_BOUNDS, geo.key, lambda: _box_bounds(shape, geo.boxes))
  box_lo, box_hi, first, last = bounds
  if shape:
    mine &= (starts < last[np.maximum(g, 0)]) & (ends > first[np.maximum(g, 0)])
  g = g[mine]
  # Each run's box, per axis (contiguous gathers, not [runs, ndim] ones).
  run_lo = [lo[g] for lo in box_lo]
  run_hi = [hi[g] for hi in box_hi]
  return _GridRuns(shape, g_count, g, starts[mine], ends[mine], run_lo, run_hi)


def _box_bounds(shape, boxes) -> tuple:
  """``(lo, hi, first, last)`` of ``[G]`` boxes: per axis their bounds clipped to
  the tensor, and the flat positions of their first element and past their
  last (``first == last == 0`` for an empty box). Read-only (cached)."""
  ndim = len(shape)
  box_lo, box_hi = _clipped([boxes[0][:, a] for a in range(ndim)],
                            [boxes[1][:, a] for a in range(ndim)], shape)
  g_count = boxes[0].shape[0]
  first = np.zeros(g_count, np.int64)
  last = np.ones(g_count, np.int64)
  empty = np.zeros(g_count, bool)
  stride = 1
  for a in reversed(range(ndim)):
    first += box_lo[a] * stride
    last += (box_hi[a] - 1) * stride
    empty |= box_hi[a] <= box_lo[a]
    stride *= int(shape[a])
  first[empty] = 0
  last[empty] = 0
  for table in box_lo + box_hi + [first, last]:
    table.setflags(write=False)
  return box_lo, box_hi, first, last


_BOX_BOUNDS = plan_cache.PlanCache("block box bounds")


def _on_own_tile(runs: _GridRuns, sets) -> np.ndarray:
  """``[G]`` elements each grid tile holds of its box (and of ``sets``)."""
  if not runs.shape:  # one element: in the box when the run holds it
    inside = (runs.ends >= 1).astype(np.int64) - (runs.starts >= 1)
  else:
    # A run's elements in its box: the prefix counts at its two ends, with
    # the box's volumes found once for both.
    ndim = len(runs.shape)
    members = [None] * ndim if sets is None else list(sets)
    sizes = [int(d) for d in runs.shape]
    inner, volume = _box_volumes(runs.run_lo, runs.run_hi, members)
    inside = (_count_below(runs.ends, sizes, runs.run_lo, runs.run_hi, members, inner, volume)
              - _count_below(runs.starts, sizes, runs.run_lo, runs.run_hi, members, inner,
                             volume))
  # Weighted bincounts are float64: exact for any tensor below 2**53 elements.
  return np.bincount(runs.g, weights=inside,
                     minlength=runs.g_count)[:runs.g_count].astype(np.int64)


def _needed_per_tile(t, mapping: TileMapping, starts, ends, run_tiles, shape,
                     sets: _NeededSets) -> np.ndarray:
  """``[t]`` elements each tile holds that some block needs (each sent once).

  ``starts``, ``ends``, ``run_tiles``: ``mapping``'s runs.
  """
  if not sets.some_all:
    return np.zeros(t, np.int64)
  if all(c is None for c in sets.some):
    return mapping.elements_per_tile(t)
  prefix = prefix_in_box(np.concatenate([starts, ends]), shape, np.zeros(len(shape), np.int64),
                         np.asarray(shape, np.int64), sets.some)
  taken = prefix[starts.size:] - prefix[:starts.size]
  return np.bincount(run_tiles, weights=taken, minlength=t)[:t].astype(np.int64)


@dataclasses.dataclass(frozen=True)
class _Geometry:
  """An operand exchange's blocks as boxes of the (merged) tensor.

  Attributes:
    shape, groups: the tensor and view with neighbouring merged axes merged.
    tiles: ``[G]`` grid tiles.
    ranges: each block's view ranges.
    boxes: ``(lo, hi)``, ``[G, ndim]`` each block's box of the tensor.
    sets: the elements some block and exactly one block need.
    key: the geometry's cache key (what those depend on).
  """

  shape: tuple
  groups: tuple
  tiles: np.ndarray
  ranges: _BlockRanges
  boxes: tuple
  sets: _NeededSets
  key: tuple


def _geometry(target, mapping, shape, groups, window, grid_shape, tiles, needs):
  """The blocks of an exchange as boxes: a :class:`_Geometry`, or what
  :func:`block_exchange_cost` returns without one (None: intervals cannot
  give the costs; ``(None, zeros)``: an empty window, nothing moves)."""
  # Ranges along merged axes are ranges of one axis once those are merged.
  shape, groups = merge_axes(shape, groups)
  tiles = np.asarray(tiles, np.int64)
  t = target.num_tiles
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  # Grid tiles are tile indices: a bincount finds repeats without sorting.
  if mapping.num_elements == 0 or g_count == 0 or np.bincount(tiles, minlength=t).max() > 1:
    return None
  window = [(int(a), int(b)) for a, b in window]
  if any(b <= a for a, b in window):
    return None, np.zeros(g_count, np.int64)
  shape, groups = tuple(int(d) for d in shape), tuple(tuple(int(a) for a in g) for g in groups)
  key = (shape, groups, tuple(window), tuple(int(g) for g in grid_shape), _needs_key(needs))
  blocks = plan_cache.cached(_BLOCKS, key,
                             lambda: _block_boxes(shape, groups, window, grid_shape, needs))
  if blocks is None:
    return None
  return _Geometry(shape, groups, tiles, *blocks, key)


def _needs_key(needs) -> tuple:
  """A hashable key of an exchange's ``needs`` (halo tables by value)."""
  return tuple(None if need is None else
               (int(need[0]), plan_cache.array_key(np.asarray(need[1], np.int64)),
                plan_cache.array_key(np.asarray(need[2], np.int64)))
               for need in needs)


def _block_boxes(shape, groups, window, grid_shape, needs) -> Optional[tuple]:
  """``(ranges, boxes, sets)`` of :class:`_Geometry`, or None (see :func:`_geometry`).

  They depend on the shapes, the window and the blocks' grid only, not on
  where the tensor or the grid lie: cached (a repeated layer's exchanges,
  and every exchange costed again for its IPU-Link bytes, share them).
  Their arrays are read-only.
  """
  ranges = _block_ranges(window, grid_shape, needs)
  if ranges is None:
    return None
  boxes = view_boxes(shape, groups, ranges.lo, ranges.hi)
  if boxes is None:
    return None
  sets = _needed_sets(shape, groups, window, ranges.widths)
  if sets is None:
    return None
  for table in (*ranges.lo, *ranges.hi, *ranges.widths, *boxes, *sets.some, *sets.one):
    if isinstance(table, np.ndarray):
      table.setflags(write=False)
  return ranges, boxes, sets


_BLOCKS = plan_cache.PlanCache("block exchange geometries")


def _geometry_link_bytes(target, mapping, geo: _Geometry, grid_shape, needs, sent,
                         itemsize) -> Optional[np.ndarray]:
  """``[num_ipus]`` IPU-Link bytes of an exchange whose tiles send ``sent`` elements."""
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus == 1 or not sent.any():
    return link
  if geo.ranges.halo:
    return _halo_link_bytes(target, geo.tiles, sent, itemsize)
  blocks = plan_cache.cached(_LINK_BLOCKS, geo.key,
                             lambda: _link_blocks(geo.shape, geo.boxes, needs, grid_shape))
  ipu_starts, ipu_of = mapping.ipu_runs(target.tiles_per_ipu)
  return _link_bytes(target, blocks, ipu_starts, ipu_of, mapping.num_elements, geo.tiles,
                     itemsize)


_LINK_BLOCKS = plan_cache.PlanCache("block link geometries")


def block_link_bytes(target, mapping: TileMapping, shape: Sequence[int], itemsize: int,
                     groups: Sequence[Sequence[int]], window: Sequence[tuple],
                     grid_shape: Sequence[int], tiles: np.ndarray, needs: Sequence,
                     sent: np.ndarray) -> Optional[np.ndarray]:
  """The IPU-Link bytes of :func:`block_exchange_cost` alone, given what each tile sends.

  The bytes each tile sends and receives compare only tile identities, so
  a cost found for the same layouts placed elsewhere along the tiles gives
  them (moved); which bytes cross an IPU-Link depends on where the IPUs'
  boundaries fall, and is counted here afresh. Arguments as for
  :func:`block_exchange_cost`, with ``sent``: ``[num_tiles]`` elements each
  tile sends (its ``bytes_out / itemsize``).

  Returns:
    ``[num_ipus]`` bytes, exactly ``block_exchange_cost``'s, or None where
    ``block_exchange_cost`` gives None or no cost (the caller costs the
    whole exchange).
  """
  geo = _geometry(target, mapping, shape, groups, window, grid_shape, tiles, needs)
  if not isinstance(geo, _Geometry):
    return None
  return _geometry_link_bytes(target, mapping, geo, grid_shape, needs,
                              np.asarray(sent, np.int64), itemsize)


def block_exchange_cost(target, mapping: TileMapping, shape: Sequence[int], itemsize: int,
                        groups: Sequence[Sequence[int]], window: Sequence[tuple],
                        grid_shape: Sequence[int], tiles: np.ndarray, needs: Sequence,
                        block_elements: np.ndarray) -> Optional[tuple]:
  """:func:`~ipu_jax.lowering.matmul_plan.grid_exchange_cost` by intervals.

  The operand is seen through a view whose axis ``v`` merges tensor axes
  ``groups[v]`` (outer first), of which the part ``window[v] = (start,
  stop)`` is taken (a serial pass). ``needs`` are as ``grid_exchange_cost``
  takes them, over view coordinates counted from ``start``: per grid axis,
  None (every block along it needs the element) or ``(view_axis, lo, hi)``
  (coordinate ``c`` is needed by blocks ``lo[c] <= i < hi[c]``, e.g. a
  convolution's halo). A grid tile needs a box of the view, receives what it
  does not hold, and a tile sends what it holds once if any other tile needs
  it (multicast).

  Returns:
    ``(ExchangeCost, local)`` exactly as ``grid_exchange_cost`` gives them,
    or None when intervals cannot give them: a block's set along an axis is
    not a range, or not a box of the tensor's axes; a view axis merging
    tensor axes that are not neighbours, cut by a window or read with gaps;
    grid tiles that repeat; on several IPUs without halos, more IPUs
    times cells of the blocks' grid than ``_LINK_BUDGET`` (the IPU-Link
    bytes follow each block's destinations).
  """
  geo = _geometry(target, mapping, shape, groups, window, grid_shape, tiles, needs)
  if not isinstance(geo, _Geometry):
    return geo
  shape, tiles, sets, t = geo.shape, geo.tiles, geo.sets, target.num_tiles
  starts, run_tiles = mapping.intervals
  ends = np.append(starts[1:], mapping.num_elements)
  runs = _grid_runs(t, starts, ends, run_tiles, geo)
  local = _on_own_tile(runs, None)
  sent = _needed_per_tile(t, mapping, starts, ends, run_tiles, shape, sets).copy()
  if geo.ranges.shared == 1 and sets.one_all:
    # An element whose one block is its holder's is not sent.
    sent[tiles] -= local if all(c is None for c in sets.one) else _on_own_tile(runs, sets.one)
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, tiles, (np.asarray(block_elements, np.int64) - local) * itemsize)
  link = _geometry_link_bytes(target, mapping, geo, grid_shape, needs, sent, itemsize)
  if link is None:
    return None
  return ExchangeCost(bytes_in, sent * itemsize, link), local
