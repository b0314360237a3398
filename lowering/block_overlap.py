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
matmuls and convolutions (:func:`ipu_jax.lowering.matmul_grid.grid_exchange_cost`,
halos included) with the same bytes without a per-element array, for the
layouts where every block is a box; the callers keep the per-element path for
the rest. It runs in steps: each block's range per view axis
(:class:`_BlockRanges`), those ranges as boxes of the tensor
(:func:`~ipu_jax.lowering.block_counts.view_boxes`), the elements some block and exactly one
block need
(:class:`_NeededSets`), each grid tile's runs with its box
(:class:`_GridRuns`), then the bytes in, out and over the IPU-Links. The
prefix counts and views are ``lowering/block_counts.py``'s, the IPU-Link
counting per cell of a grid ``lowering/block_links.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.block_counts import (box_volumes, clipped_ranges, count_below, merge_axes,
                                           prefix_in_box, view_boxes)
from ipu_jax.lowering.block_links import halo_link_bytes, link_blocks, link_bytes

__all__ = ["block_exchange_cost", "block_link_bytes"]


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
  box_lo, box_hi = clipped_ranges([boxes[0][:, a] for a in range(ndim)],
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
    inner, volume = box_volumes(runs.run_lo, runs.run_hi, members)
    inside = (count_below(runs.ends, sizes, runs.run_lo, runs.run_hi, members, inner, volume)
              - count_below(runs.starts, sizes, runs.run_lo, runs.run_hi, members, inner,
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
    return halo_link_bytes(target, geo.tiles, sent, itemsize)
  blocks = plan_cache.cached(_LINK_BLOCKS, geo.key,
                             lambda: link_blocks(geo.shape, geo.boxes, needs, grid_shape))
  ipu_starts, ipu_of = mapping.ipu_runs(target.tiles_per_ipu)
  return link_bytes(target, blocks, ipu_starts, ipu_of, mapping.num_elements, geo.tiles,
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
  """:func:`~ipu_jax.lowering.matmul_grid.grid_exchange_cost` by intervals.

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
