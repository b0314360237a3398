"""Storage slots grouped by (tile row, key): shared by reductions and scans.

Both two-stage plans (:mod:`~ipu_jax.lowering.rules.reduction` and
:mod:`~ipu_jax.lowering.rules.cumulative`) start by grouping, on every tile,
the elements that share a key (the output element of a reduction, the line of
a scan) into a dense ``[rows, width, depth]`` table, so that one vertex per
tile can reduce or scan the last axis.

The key of an element is the ravelled index of its coordinates on the axes
that are *not* reduced, so the grouping is planned on regions rather than on
elements: the mapping's runs (consecutive elements in consecutive slots of one
storage row: one per row for linear mappings) are cut into *segments* at the
lines of the innermost (merged) axis. When that axis is reduced, a segment is
one key's consecutive members; when it is kept, a segment covers a range of
consecutive keys with one member each, and the members of a key on a tile are
counted by interval arithmetic (a sweep over the segments' end points). Either
way the work is proportional to segments and groups, not elements. The result
names rows, not tiles, and is cached by the layout's row structure, shape and
axes (:data:`GROUPS`, :func:`row_layout_key`), so a repeated layer reuses it
wherever its tensors are placed.

The per-element table (the slot of every member, :meth:`Groups.slots`) is
only needed by steps that gather by slot (the ``per_tile`` executor, the
contiguity check of scans); it is built on demand and never cached.

This module also holds the other helpers both plans use (monoid identities,
a gather with a fill slot and mappings built directly from rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import lax_internal
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.mapping import TileMapping, spread_runs

__all__ = ["GROUPS", "Groups", "Slots", "elements_tiles", "first_elements",
           "group_regions", "identity_of", "row_layout_key", "rows_mapping", "gather_or_fill"]

GROUPS = plan_cache.PlanCache("slot groups")


def identity_of(kind: str, dtype) -> np.ndarray:
  """The identity element of the monoid ``kind`` for ``dtype``."""
  dtype = np.dtype(dtype)
  if kind in ("add", "or", "xor"):
    return np.zeros((), dtype)
  if kind == "mul":
    return np.ones((), dtype)
  if kind == "max":
    return np.asarray(lax_internal._get_max_identity(dtype), dtype)
  if kind == "min":
    return np.asarray(lax_internal._get_min_identity(dtype), dtype)
  if kind == "and":
    return np.invert(np.zeros((), dtype))
  if kind == "logaddexp":
    return np.asarray(-np.inf, dtype)
  raise ValueError(f"no identity for {kind}")


def rows_mapping(num: int, row_tiles: np.ndarray, row_of: np.ndarray,
                  offset: np.ndarray, per_row: np.ndarray) -> TileMapping:
  """A mapping whose element ``i`` sits in row ``row_of[i]`` at ``offset[i]``.

  ``row_of`` must be non-decreasing and every row non-empty; rows are on
  ``row_tiles`` (unique). Built directly (no sort).
  """
  per_row = np.asarray(per_row, np.int64)
  chunk = int(per_row[0])
  if np.all(per_row[:-1] == chunk) and per_row[-1] <= chunk:
    return TileMapping(num, row_tiles, per_row, chunk=chunk)
  return TileMapping(num, row_tiles, per_row, element_row=row_of,
                     element_offset=offset)


def gather_or_fill(flat, index: np.ndarray, fill):
  """``flat[index]`` where ``index == flat.size`` takes ``fill``."""
  ext = jnp.concatenate([flat, jnp.reshape(jnp.asarray(fill, flat.dtype), (1,))])
  return ext[index]


# -- regions ------------------------------------------------------------------------


def _canonical_axes(shape, axes) -> tuple:
  """``shape`` as ``((size, kept), ...)``: size-1 axes dropped, neighbours of
  the same kind (reduced or kept) merged. Keys and flat order are unchanged."""
  axes = set(axes)
  dims = []
  for a, d in enumerate(shape):
    if d == 1:
      continue
    kept = a not in axes
    if dims and dims[-1][1] == kept:
      dims[-1] = (dims[-1][0] * int(d), kept)
    else:
      dims.append((int(d), kept))
  return tuple(dims) or ((1, True),)


def _num_keys(dims) -> int:
  return int(np.prod([d for d, kept in dims if kept], dtype=np.int64))


def _line_keys(lines: np.ndarray, prefix) -> np.ndarray:
  """Key (ravelled kept coordinates) of each line of the ``prefix`` axes."""
  key = np.zeros(lines.shape, np.int64)
  rem = lines
  mult = 1
  for size, kept in reversed(prefix):
    rem, coord = np.divmod(rem, size)
    if kept:
      key += coord * mult
      mult *= size
  return key


def first_elements(shape, axes) -> np.ndarray:
  """Flat index of the first element of every key, in key order."""
  strides = np.cumprod((1,) + tuple(int(d) for d in shape[::-1][:-1]))[::-1] if shape else ()
  index = np.zeros((), np.int64)
  for a, d in enumerate(shape):
    if a not in axes:
      index = index[..., None] + np.arange(int(d), dtype=np.int64) * int(strides[a])
  return index.reshape(-1)


def elements_tiles(mapping: TileMapping, index: np.ndarray) -> np.ndarray:
  """Tile of the flat elements ``index``, from the mapping's intervals."""
  starts, tiles = mapping.intervals
  return tiles[np.searchsorted(starts, index, side="right") - 1]


@dataclasses.dataclass(frozen=True)
class _Runs:
  """A mapping's runs: flat ``[start, end)`` on storage ``row`` from ``slot``."""

  start: np.ndarray
  end: np.ndarray
  row: np.ndarray
  slot: np.ndarray


def _runs(mapping: TileMapping) -> _Runs:
  """Consecutive elements in consecutive slots of one row, in flat order.

  A general mapping's storage may have holes (a block grid's padded edge
  blocks) and rows that interleave runs (serial passes); the mapping finds
  its runs on regions (:attr:`TileMapping.runs`), not elements.
  """
  start, length, row, offset = mapping.runs
  return _Runs(start, start + length, row, row * mapping.row_size + offset)


@dataclasses.dataclass(frozen=True)
class _Segments:
  """Runs cut at the innermost axis's lines: ``[start, end)`` on ``row``,
  storage from ``slot``; ``key`` is the segment's key (reduced innermost axis)
  or its first key (kept innermost axis, one key per element)."""

  start: np.ndarray
  end: np.ndarray
  row: np.ndarray
  slot: np.ndarray
  key: np.ndarray


def _segments(mapping: TileMapping, dims) -> _Segments:
  runs = _runs(mapping)
  inner, inner_kept = dims[-1]
  first_line = runs.start // inner
  count = (runs.end - 1) // inner - first_line + 1
  run = np.repeat(np.arange(count.size), count)
  line = first_line[run] + np.arange(run.size) - np.repeat(np.cumsum(count) - count, count)
  start = np.maximum(runs.start[run], line * inner)
  end = np.minimum(runs.end[run], (line + 1) * inner)
  key = _line_keys(line, dims[:-1])
  if inner_kept:
    key = key * inner + (start - line * inner)
  return _Segments(start, end, runs.row[run], runs.slot[run] + (start - runs.start[run]), key)


@dataclasses.dataclass(frozen=True)
class Slots:
  """The per-element side of :class:`Groups` (built on demand, not cached).

  Attributes:
    dense: ``[rows, width, depth]`` storage slot of every member of every
      group (``rows * row_size`` marks padding).
    reshape_only: ``dense`` is the storage itself, reshaped.
    valid: ``[rows * row_size]`` slots that hold elements.
  """

  dense: np.ndarray
  reshape_only: bool
  valid: np.ndarray


@dataclasses.dataclass
class Groups:
  """A tensor's elements grouped by (storage row, key), per tile.

  Groups are held as *spans*: consecutive groups on one row with consecutive
  keys and one member count each (a vocabulary-sized reduction has millions
  of groups in thousands of spans). The per-group arrays (:attr:`row`,
  :attr:`key`, :attr:`local`, :attr:`count`, :attr:`first_slot`) are spread
  from them on first use; :meth:`at`, :meth:`first_slot_of` and
  :meth:`key_runs` answer for a few groups without them.

  Attributes:
    shape, axes: the grouped tensor's shape and the axes whose coordinates
      do not enter the key.
    num: groups.
    per_row: ``[rows]`` groups per row.
    width, depth: most groups of a row, most members of a group.
    first_of_key: ``[num_keys]`` index of the first group of every key.
    run_first: index of the first group of each *key run*: groups on one row
      with consecutive keys (what a row's partials cover, as intervals).
    span_first, span_row, span_key, span_count: ``[spans]`` the first group
      of each span, its row, its first key and the members of each of its
      groups (spans in group order).
    slot_runs: ``(first_group, slot)``: groups whose first members are
      consecutive storage slots from ``slot`` (group order), or ``None``
      when groups have several members that are not consecutive elements
      (then :meth:`slots` has them).
  """

  shape: tuple
  axes: tuple
  num: int
  per_row: np.ndarray
  width: int
  depth: int
  first_of_key: np.ndarray
  run_first: np.ndarray
  span_first: np.ndarray
  span_row: np.ndarray
  span_key: np.ndarray
  span_count: np.ndarray
  slot_runs: Optional[tuple]

  def _per_group(self, values: np.ndarray) -> np.ndarray:
    value = spread_runs(values, self.span_first, self.num)
    value.flags.writeable = False  # shared by every equation that hits the cache
    return value

  @functools.cached_property
  def row(self) -> np.ndarray:
    """``[num]`` storage row (tile) of each group, non-decreasing."""
    return self._per_group(self.span_row)

  @functools.cached_property
  def key(self) -> np.ndarray:
    """``[num]`` key of each group (ascending within a row)."""
    value = spread_runs(self.span_key - self.span_first, self.span_first, self.num)
    value += np.arange(self.num, dtype=np.int64)
    value.flags.writeable = False
    return value

  @functools.cached_property
  def count(self) -> np.ndarray:
    """``[num]`` members of each group."""
    return self._per_group(self.span_count)

  @functools.cached_property
  def local(self) -> np.ndarray:
    """``[num]`` position of the group within its row."""
    row_first = np.cumsum(self.per_row) - self.per_row
    value = np.arange(self.num, dtype=np.int64) - spread_runs(
        row_first[self.span_row], self.span_first, self.num)
    value.flags.writeable = False
    return value

  @functools.cached_property
  def first_slot(self) -> Optional[np.ndarray]:
    """``[num]`` storage slot of each group's first member (flat order), or
    ``None`` (see :attr:`slot_runs`)."""
    if self.slot_runs is None:
      return None
    first, slot = self.slot_runs
    value = spread_runs(slot - first, first, self.num)
    value += np.arange(self.num, dtype=np.int64)
    value.flags.writeable = False
    return value

  def at(self, index: np.ndarray) -> tuple:
    """``(row, key, local)`` of the groups ``index``, from the spans."""
    index = np.asarray(index, np.int64)
    span = np.searchsorted(self.span_first, index, side="right") - 1
    row = self.span_row[span]
    row_first = (np.cumsum(self.per_row) - self.per_row)[row]
    return row, self.span_key[span] + (index - self.span_first[span]), index - row_first

  def first_slot_of(self, index: np.ndarray) -> np.ndarray:
    """:attr:`first_slot` of the groups ``index`` (needs :attr:`slot_runs`)."""
    first, slot = self.slot_runs
    index = np.asarray(index, np.int64)
    run = np.searchsorted(first, index, side="right") - 1
    return slot[run] + (index - first[run])

  def key_runs(self) -> tuple:
    """``(row, first_key, length)`` of every key run."""
    length = np.diff(np.append(self.run_first, self.num))
    row, key, _ = self.at(self.run_first)
    return row, key, length

  def slots(self, mapping: TileMapping) -> Slots:
    """The slot of every member (``mapping`` has the grouped layout)."""
    rows, row_size = mapping.storage_shape
    total = rows * row_size
    dims = _canonical_axes(self.shape, self.axes)
    seg = _segments(mapping, dims)
    length = seg.end - seg.start
    within = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
    slot = np.repeat(seg.slot, length) + within
    key = np.repeat(seg.key, length) + (within if dims[-1][1] else 0)
    num_keys = _num_keys(dims)
    composite = np.repeat(seg.row, length) * num_keys + key
    gid = np.searchsorted(self.row * num_keys + self.key, composite)
    # Members keep flat order: rank = order of appearance within the group.
    sorted_ = gid.size < 2 or bool(np.all(gid[1:] >= gid[:-1]))
    order = np.arange(gid.size) if sorted_ else np.argsort(gid, kind="stable")
    rank = np.empty_like(gid)
    rank[order] = np.arange(gid.size) - np.repeat(np.cumsum(self.count) - self.count, self.count)
    position = (self.row[gid] * self.width + self.local[gid]) * self.depth + rank
    reshape_only = (self.width * self.depth == row_size
                    and bool(np.array_equal(position, slot)))
    dense = np.full(rows * self.width * self.depth, total, np.int64)
    dense[position] = slot
    valid = np.zeros(total, bool)
    valid[slot] = True
    return Slots(dense.reshape(rows, self.width, self.depth), reshape_only, valid)


def _first_cover(lo: np.ndarray, hi: np.ndarray, size: int) -> np.ndarray:
  """For every point of ``[0, size)``, the first interval ``[lo[i], hi[i])``
  that holds it (``lo.size`` where none does).

  A segment tree over the points: each interval marks the ``O(log size)``
  nodes that tile it with its index (smallest wins), and every leaf takes the
  smallest mark on its path from the root, in ``O(intervals * log size +
  size)`` however long the intervals are.
  """
  num = int(lo.size)
  leaves = 1 << max(0, int(size - 1).bit_length())
  tree = np.full(2 * leaves, num, np.int64)
  left, right = lo + leaves, hi + leaves
  index = np.arange(num, dtype=np.int64)
  while index.size:
    take = ((left & 1) == 1) & (left < right)
    np.minimum.at(tree, left[take], index[take])
    left = left + take
    take = ((right & 1) == 1) & (left < right)
    right = right - take
    np.minimum.at(tree, right[take], index[take])
    left, right = left >> 1, right >> 1
    live = left < right
    left, right, index = left[live], right[live], index[live]
  level = 1
  while level < leaves:
    parents = tree[level:2 * level]
    children = tree[2 * level:4 * level].reshape(level, 2)
    np.minimum(children, parents[:, None], out=children)
    level *= 2
  return tree[leaves:leaves + size]


def _from_segments(mapping: TileMapping, shape, axes) -> Groups:
  dims = _canonical_axes(shape, axes)
  num_keys = _num_keys(dims)
  seg = _segments(mapping, dims)
  length = seg.end - seg.start
  # Groups are found as spans (consecutive keys on one row, one member count
  # each), in (row, key) order; nothing below is per group.
  if not dims[-1][1]:
    # Reduced innermost axis: a segment is consecutive members of one key.
    composite = seg.row * num_keys + seg.key
    if composite.size > 1 and not bool(np.all(composite[1:] >= composite[:-1])):
      order = np.argsort(composite, kind="stable")
      composite, length, seg_slot = composite[order], length[order], seg.slot[order]
    else:
      seg_slot = seg.slot
    new = np.ones(composite.size, bool)
    new[1:] = composite[1:] != composite[:-1]
    starts = np.flatnonzero(new)
    begin = composite[starts]
    span = np.ones(begin.size, np.int64)
    cover = np.add.reduceat(length, starts) if starts.size else length[:0]
    slot_runs = (np.arange(begin.size, dtype=np.int64), seg_slot[starts])
  else:
    # Kept innermost axis: a segment covers consecutive keys, one member
    # each; the members of a key on a row are the segments covering it.
    lo = seg.row * num_keys + seg.key
    events = np.concatenate([lo, lo + length])
    delta = np.concatenate([np.ones_like(lo), -np.ones_like(lo)])
    order = np.argsort(events, kind="stable")
    events, cover = events[order], np.cumsum(delta[order])
    span = np.diff(events)
    keep = (cover[:-1] > 0) & (span > 0)
    begin, span, cover = events[:-1][keep], span[keep], cover[:-1][keep]
    slot_runs = None
    if bool(np.all(cover == 1)):
      # Segments do not overlap: in key order, each is a run of groups
      # whose one members are consecutive slots.
      seg_order = np.argsort(lo, kind="stable")
      seg_length = length[seg_order]
      slot_runs = (np.cumsum(seg_length) - seg_length, seg.slot[seg_order])
  first = np.cumsum(span) - span
  num = int(span.sum())
  span_row = begin // num_keys
  span_key = begin - span_row * num_keys
  per_row = np.bincount(span_row, weights=span, minlength=mapping.num_rows).astype(np.int64)
  # The first group of a key is in the first span (group order) that holds it.
  span_of_key = _first_cover(span_key, span_key + span, num_keys)
  covered = span_of_key < begin.size
  first_of_key = np.full(num_keys, num, np.int64)
  keys = np.flatnonzero(covered)
  hit = span_of_key[covered]
  first_of_key[covered] = first[hit] + keys - span_key[hit]
  # A key run continues over spans on one row whose keys follow on.
  new_run = np.ones(begin.size, bool)
  new_run[1:] = (span_row[1:] != span_row[:-1]) | (begin[1:] != begin[:-1] + span[:-1])
  return Groups(shape=tuple(shape), axes=tuple(axes), num=num, per_row=per_row,
                width=int(per_row.max(initial=0)), depth=int(cover.max(initial=0)),
                first_of_key=first_of_key, run_first=first[new_run], span_first=first,
                span_row=span_row, span_key=span_key, span_count=cover, slot_runs=slot_runs)


def row_layout_key(mapping: TileMapping) -> tuple:
  """What the grouping depends on: the mapping's rows, not their tiles.

  Linear and block-grid layouts are keyed by their closed form alone, so a
  layout placed from another start tile (a repeated layer's tensors rotate
  over the tiles) shares its grouping; other mappings by their fingerprint.
  """
  kind = mapping.fingerprint[0]
  if kind == "linear":
    return ("linear", mapping.num_elements, int(mapping.chunk))
  if kind == "grid":
    return ("grid", mapping.num_elements, mapping.grid)
  return mapping.fingerprint


def group_regions(mapping: TileMapping, shape, axes) -> Groups:
  """Group the elements of ``mapping`` (a tensor of ``shape``) by (row, key).

  The key of an element is the ravelled index of its coordinates on the axes
  not in ``axes`` (the output element of a reduction over ``axes``, the line
  of a scan along them). Members of a group keep flat element order. Cached
  by row layout (:func:`row_layout_key`), shape and axes: a repeated layer
  reuses the grouping.
  """
  shape = tuple(int(d) for d in shape)
  axes = tuple(sorted(int(a) for a in axes))

  def compute():
    groups = _from_segments(mapping, shape, axes)
    for field in dataclasses.fields(groups):  # shared by every equation that hits
      value = getattr(groups, field.name)
      for array in (value if isinstance(value, tuple) else (value,)):
        if isinstance(array, np.ndarray):
          array.setflags(write=False)
    return groups

  return plan_cache.cached(GROUPS, (row_layout_key(mapping), shape, axes), compute)
