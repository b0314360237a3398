"""Elements of a tile mapping inside blocks, by interval arithmetic.

A :class:`TileMapping` is a list of runs of the flattened tensor, one tile
each (:attr:`TileMapping.intervals`). A block of a grid laid over a *view* of
the tensor (its axes merged into view axes, as ``dot_general`` operands are
seen as ``[B, M, K]``) is, when it is aligned with the merged axes, a *box*: a
range along every axis of the tensor. The elements of a run inside a box are
a difference of two prefix counts, each closed-form in the digits of the
run's ends, so overlapping every run with a box costs ``O(axes)`` NumPy work
per run, whatever the number of elements.

:func:`block_exchange_cost` uses that to give the matmul's operand exchange
(:func:`ipu_jax.lowering.matmul_plan.grid_exchange_cost`) with the same bytes
without a per-element array, for the layouts where every block is a box.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["prefix_in_box", "merge_axes", "range_boxes", "view_boxes", "block_exchange_cost"]


def prefix_in_box(x: np.ndarray, shape: Sequence[int], lo: np.ndarray,
                  hi: np.ndarray) -> np.ndarray:
  """How many flat (row-major) indices below ``x`` lie in the box ``[lo, hi)``.

  Args:
    x: ``[R]`` flat positions, ``0 <= x <= prod(shape)``.
    shape: the tensor's shape.
    lo, hi: ``[R, ndim]`` (or ``[ndim]``) box bounds per axis; an empty
      range (``hi <= lo``) makes an empty box.

  Returns:
    ``[R]`` counts (int64).
  """
  x = np.asarray(x, np.int64)
  ndim = len(shape)
  lo = np.broadcast_to(np.asarray(lo, np.int64), x.shape + (ndim,))
  hi = np.broadcast_to(np.asarray(hi, np.int64), x.shape + (ndim,))
  # Per axis, contiguous: only the part of the box inside the tensor counts.
  los = [np.maximum(lo[..., a], 0) for a in range(ndim)]
  widths = [np.maximum(np.minimum(hi[..., a], int(shape[a])) - los[a], 0) for a in range(ndim)]
  total = int(np.prod(shape, dtype=np.int64))
  # x == total has no digits: every index lies below it.
  whole = x >= total
  x = np.minimum(x, max(total - 1, 0))
  inner = [None] * ndim  # box volume of the axes after a
  volume = np.ones(x.shape, np.int64)
  for a in reversed(range(ndim)):
    inner[a] = volume
    volume = volume * widths[a]
  count = np.zeros(x.shape, np.int64)
  inside = np.ones(x.shape, bool)
  stride = total
  for a, size in enumerate(shape):
    stride //= max(int(size), 1)
    digit = (x // stride) % max(int(size), 1)
    offset = digit - los[a]
    count += np.clip(offset, 0, widths[a]) * inner[a] * inside
    inside &= (offset >= 0) & (offset < widths[a])
  return np.where(whole, volume, count)


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


def range_boxes(lo: int, hi: int, sizes: Sequence[int]) -> list:
  """A range ``[lo, hi)`` of a merged index as boxes of its axes (outer first).

  Returns:
    A list of boxes, each a list of ``(lo, hi)`` per axis: a partial head, a
    run of whole inner blocks and a partial tail, recursively (at most
    ``2 * len(sizes) - 1`` boxes).
  """
  if hi <= lo:
    return []
  if len(sizes) <= 1:
    return [[(lo, hi)]] if sizes else [[]]
  inner = int(np.prod(sizes[1:], dtype=np.int64))
  first, last = lo // inner, (hi - 1) // inner
  if first == last:
    return [[(first, first + 1)] + box
            for box in range_boxes(lo % inner, (hi - 1) % inner + 1, sizes[1:])]
  boxes = []
  if lo % inner:
    boxes += [[(first, first + 1)] + box for box in range_boxes(lo % inner, inner, sizes[1:])]
    first += 1
  if hi // inner > first:
    boxes.append([(first, hi // inner)] + [(0, int(s)) for s in sizes[1:]])
  if hi % inner:
    boxes += [[(hi // inner, hi // inner + 1)] + box
              for box in range_boxes(0, hi % inner, sizes[1:])]
  return boxes


def _merged_ranges(lo: np.ndarray, hi: np.ndarray, sizes: Sequence[int]):
  """Ranges along merged axes (outer first) as one range per axis, if a box.

  Returns:
    ``(los, his, ok)``: per sub-axis ``[Q]`` bounds, and ``[Q]`` whether the
    range is a box (``los``/``his`` are meaningless where it is not).
  """
  lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
  empty = hi <= lo
  # An empty range is the empty box on the outermost axis.
  lo, hi = np.where(empty, 0, lo), np.where(empty, 1, hi)
  ok = np.ones(lo.shape, bool) if len(sizes) else ~empty
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
  return los, his, ok


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
  for axes, l, h in zip(groups, lo, hi):
    los, his, ok = _merged_ranges(np.broadcast_to(l, q), np.broadcast_to(h, q),
                                  [int(shape[a]) for a in axes])
    if not ok.all():
      return None
    for a, sub_lo, sub_hi in zip(axes, los, his):
      box_lo[..., a], box_hi[..., a] = sub_lo, sub_hi
  return box_lo, box_hi


def block_exchange_cost(target, mapping: TileMapping, shape: Sequence[int], itemsize: int,
                        groups: Sequence[Sequence[int]], window: Sequence[tuple],
                        grid_shape: Sequence[int], tiles: np.ndarray, cuts: Sequence,
                        block_elements: np.ndarray) -> Optional[tuple]:
  """``grid_exchange_cost`` of an operand cut into blocks, by intervals.

  The operand is seen through a view whose axis ``v`` merges tensor axes
  ``groups[v]``, of which the part ``window[v] = (start, stop)`` is taken (a
  serial pass). Grid axis ``a`` either cuts view axis ``cuts[a] = (v,
  block)``: view coordinate ``c`` (from ``start``) is needed by block ``c //
  block`` only; or is None: every block along it needs the element. A grid
  tile needs its box, receives what it does not hold, and a tile sends what
  it holds once if any other tile needs it (multicast).

  Returns:
    ``(ExchangeCost, local)`` exactly as
    :func:`~ipu_jax.lowering.matmul_plan.grid_exchange_cost` gives them, or
    None when it cannot be had by intervals: a block that is not a box of
    the tensor's axes, a target of several IPUs (the IPU-Link bytes follow
    each element's destinations), or grid tiles that repeat.
  """
  # Ranges along merged axes are ranges of one axis once those are merged.
  shape, groups = merge_axes(shape, groups)
  tiles = np.asarray(tiles, np.int64)
  t = target.num_tiles
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  if target.num_ipus > 1 or np.unique(tiles).size != tiles.size:
    return None
  window = [(int(a), int(b)) for a, b in window]
  if mapping.num_elements == 0 or g_count == 0:
    return None
  if any(b <= a for a, b in window):
    return None, np.zeros(g_count, np.int64)
  coords = np.unravel_index(np.arange(g_count), tuple(int(g) for g in grid_shape))
  lo = [np.full(g_count, a, np.int64) for a, _ in window]
  hi = [np.full(g_count, b, np.int64) for _, b in window]
  shared = 1  # blocks needing every element (multicast destinations)
  for a, cut in enumerate(cuts):
    if cut is None:
      shared *= int(grid_shape[a])
      continue
    v, block = cut
    start, stop = window[v]
    lo[v] = start + coords[a] * int(block)
    hi[v] = np.minimum(lo[v] + int(block), stop)
  boxes = view_boxes(shape, groups, lo, hi)
  if boxes is None:
    return None
  starts, run_tiles = mapping.intervals
  ends = np.append(starts[1:], mapping.num_elements)
  grid_of_tile = np.full(t, -1, np.int64)
  grid_of_tile[tiles] = np.arange(g_count)
  g = grid_of_tile[run_tiles]
  mine = g >= 0
  g = g[mine]
  both = np.concatenate([starts[mine], ends[mine]])
  g2 = np.concatenate([g, g])
  prefix = prefix_in_box(both, shape, boxes[0][g2], boxes[1][g2])
  inside = prefix[g.size:] - prefix[:g.size]
  # Weighted bincounts are float64: exact for any tensor below 2**53 elements.
  local = np.bincount(g, weights=inside, minlength=g_count)[:g_count].astype(np.int64)
  full = all(a == 0 and b == int(np.prod([shape[x] for x in axes], dtype=np.int64))
             for (a, b), axes in zip(window, groups))
  if full:
    held = mapping.elements_per_tile(t)
  else:
    # The part taken is a box along every view axis but (at most) a range of
    # a merged one: a few boxes of the tensor's axes.
    parts = [[]]
    for (a, b), axes in zip(window, groups):
      sub = range_boxes(a, b, [int(shape[x]) for x in axes])
      parts = [p + list(zip(axes, box)) for p in parts for box in sub]
    taken = np.zeros(starts.size, np.int64)
    for part in parts:
      part_lo = np.zeros(len(shape), np.int64)
      part_hi = np.ones(len(shape), np.int64)
      for axis, (a, b) in part:
        part_lo[axis], part_hi[axis] = a, b
      taken += (prefix_in_box(ends, shape, part_lo, part_hi)
                - prefix_in_box(starts, shape, part_lo, part_hi))
    held = np.bincount(run_tiles, weights=taken, minlength=t)[:t].astype(np.int64)
  sent = held.copy()
  if shared == 1:
    # The one block needing an element is its holder's: nothing to send.
    sent[tiles] -= local
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, tiles, (np.asarray(block_elements, np.int64) - local) * itemsize)
  cost = ExchangeCost(bytes_in, sent * itemsize, np.zeros(target.num_ipus, np.int64))
  return cost, local
