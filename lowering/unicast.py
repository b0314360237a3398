"""Bytes moved when runs of elements go, each to one destination, where a mapping holds them.

A reduction's partials (and other unicast movements planned on runs) leave
their tiles as runs ``[first, first + length)`` of the destination tensor.
:func:`unicast_cost` counts the exchange on runs and the destination's
intervals, not on their elements: what each destination interval receives is
the runs' coverage of it (the run ends placed among the intervals, running sums), what
stays is each run's overlap with its own tile's intervals, and what crosses
IPUs (:func:`unicast_link_elements`) each run's part outside its IPU's runs
of intervals. Used by the reduction plans (``lowering/rules/reduction.py``).
"""

from __future__ import annotations

import numpy as np

from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["unicast_cost", "unicast_link_elements"]


def _covered(first: np.ndarray, stop: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Elements of the runs ``[first[i], stop[i])`` below each ``x`` (all runs summed).

  ``x`` is ascending (a mapping's interval starts and its end): each run end
  is placed among the few points (a search of the runs into ``x``, not a sort
  of the runs: a reduction's partials are thousands of runs against a few
  hundred intervals), and a point counts, per end below it, its distance to
  that end. The distance is taken from the first point above the end, so the
  weighted sums stay below ``runs x interval length`` (float64 bincounts:
  exact below 2**53), and the rest is whole points' counts, in integers.
  """
  m = x.size
  total = np.zeros(m, np.int64)
  for ends, sign in ((first, 1), (stop, -1)):
    place = np.searchsorted(x, ends, side="right")  # x[j] > end for every j >= place
    counted = place < m
    ends, place = ends[counted], place[counted]
    # Per point: the ends first above it and their distances to it.
    count = np.bincount(place, minlength=m)[:m].astype(np.int64)
    gap = np.bincount(place, weights=x[place] - ends, minlength=m)[:m].astype(np.int64)
    # x_j - end = (x_j - x_place) + (x_place - end), summed over ends placed at or before j.
    below = np.cumsum(count)
    total += sign * (np.cumsum(gap) + x * below - np.cumsum(count * x))
  return total


def _overlap(group: np.ndarray, first: np.ndarray, stop: np.ndarray, interval_group: np.ndarray,
             starts: np.ndarray, ends: np.ndarray, size: int) -> np.ndarray:
  """Elements of each run ``[first[i], stop[i])`` in the intervals of its ``group[i]``.

  Intervals of one group are disjoint. Each run end is looked up among the
  intervals sorted by (group, start), against the running sum of their
  lengths: ``O((runs + intervals) log intervals)``.
  """
  key = interval_group * (size + 1) + starts
  if not (key[1:] > key[:-1]).all():  # a linear layout's intervals are in order already
    order = np.lexsort((starts, interval_group))
    interval_group, starts, ends, key = (
        interval_group[order], starts[order], ends[order], key[order])
  begin, length = starts, ends - starts
  through = np.cumsum(length)                       # lengths up to and with each

  def below(x):
    k = np.searchsorted(key, group * (size + 1) + x, side="right") - 1
    valid = k >= 0
    kk = np.maximum(k, 0)
    valid &= interval_group[kk] == group
    upto = np.where(k >= 0, through[kk], 0)
    # In the group's interval that starts at or before x: its part past x is not below.
    past = np.where(valid, length[kk] - np.minimum(x - begin[kk], length[kk]), 0)
    return upto - past
  return below(stop) - below(first)


def unicast_cost(target, src_tile: np.ndarray, first: np.ndarray, length: np.ndarray,
                 dst_mapping: TileMapping, itemsize: int, links: bool = True) -> tuple:
  """Bytes moved when runs of elements go to where ``dst_mapping`` holds them.

  Run ``i`` is elements ``[first[i], first[i] + length[i])`` of the
  destination tensor, now on ``src_tile[i]``; each element has a single
  destination (no multicast). Counted on runs and intervals, not on their
  pieces: what each destination interval receives is the runs' coverage of
  it, what stays is each run's overlap with its own tile's intervals, what
  crosses IPUs each run's part outside its IPU's intervals.

  Args:
    links: False leaves the IPU-Link bytes zero (a caller moving the tile
      figures along the tiles counts them afresh: :func:`unicast_link_elements`).

  Returns:
    ``(cost, received)``: the :class:`ExchangeCost` (``None`` when nothing
    moves) and ``[num_tiles]`` elements arriving at or staying on each tile.
  """
  t = target.num_tiles
  n = dst_mapping.num_elements
  starts, tiles = dst_mapping.intervals
  ends = np.append(starts[1:], n)
  first = np.asarray(first, np.int64)
  stop = first + np.asarray(length, np.int64)
  src = np.asarray(src_tile, np.int64)

  def per(where, weights, length_):
    return np.bincount(where, weights=weights, minlength=length_)[:length_].astype(np.int64)

  # Coverage below every interval's start and the tensor's end (ascending):
  # an interval receives the difference at its two ends.
  covered = _covered(first, stop, np.append(starts, n))
  received = per(tiles, np.diff(covered), t)
  stay = _overlap(src, first, stop, tiles, starts, ends, n)
  moved = (stop - first) - stay
  if not moved.any():
    return None, received
  staying = per(src, stay, t)
  link = np.zeros(target.num_ipus, np.int64)  # one IPU: nothing crosses a link
  if links and target.num_ipus > 1:
    link = unicast_link_elements(target, src, first, stop, dst_mapping)
  return ExchangeCost((received - staying) * itemsize, per(src, moved, t) * itemsize,
                      link * itemsize), received


def unicast_link_elements(target, src_tile: np.ndarray, first: np.ndarray, stop: np.ndarray,
                          dst_mapping: TileMapping) -> np.ndarray:
  """``[num_ipus]`` elements each IPU sends over its links in :func:`unicast_cost`.

  What stays on its IPU is each run's overlap with its IPU's runs of
  intervals (a few per tensor, not one per tile); the rest crosses.
  """
  per_ipu, n = target.tiles_per_ipu, dst_mapping.num_elements
  ipu_starts, ipus = dst_mapping.ipu_runs(per_ipu)
  ipu_ends = np.append(ipu_starts[1:], n)
  src_ipu = np.asarray(src_tile, np.int64) // per_ipu
  crossing = (stop - first) - _overlap(src_ipu, first, stop, ipus, ipu_starts, ipu_ends, n)
  return np.bincount(src_ipu, weights=crossing,
                     minlength=target.num_ipus)[:target.num_ipus].astype(np.int64)
