"""Prefix counts of the elements of a box, closed-form in the digits of a flat index.

A block of a grid laid over a *view* of a tensor (its axes merged into view
axes, as ``dot_general`` operands are seen as ``[B, M, K]``) is, when it is
aligned with the merged axes, a *box*: a range along every axis of the
tensor (:func:`merge_axes`, :func:`view_boxes`). The elements of the flat
range ``[0, x)`` inside a box (or inside a box within per-axis sets of
positions) are counted in closed form from the digits of ``x``
(:func:`prefix_in_box`, :func:`count_below`), so the elements of a run of a
tile mapping inside a box are a difference of two prefix counts: ``O(axes)``
NumPy work per run, whatever the number of elements. The block exchange
(``lowering/block_overlap.py``) and its IPU-Link bytes
(``lowering/block_links.py``) are built on these counts.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

__all__ = ["box_volumes", "clipped_ranges", "count_below", "merge_axes", "prefix_in_box",
           "view_boxes"]


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
    los, his = clipped_ranges(los, his, sizes)
  inner, volume = box_volumes(los, his, members)
  return count_below(x, sizes, los, his, members, inner, volume)


def box_volumes(los, his, members) -> tuple:
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


def count_below(x, sizes, los, his, members, inner, volume) -> np.ndarray:
  """:func:`_prefix` given the boxes' :func:`box_volumes` (bounds clipped)."""
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


def clipped_ranges(los, his, sizes) -> tuple:
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
