"""Planning static copies: the exchange and on-tile work of data movement.

A data-movement primitive (broadcast, transpose, slice, concatenate, pad...)
copies each output element from a source element known at compile time. Its
map is described here by :class:`Box` es: an output box whose element ``i``
(a multi-index) copies source element ``src_offset + sum(src_strides * i)``
into output position ``out_offset + sum(out_strides * i)``; output elements
in no box are filled with a constant.

:func:`plan_copies` plans by regions, in time proportional to runs: it finds
the same figures as the element-by-element planner
(``lowering/copy_elements.py``:
:func:`~ipu_jax.lowering.copy_elements.plan_elements`, with
:func:`~ipu_jax.lowering.copy_elements.exchange_plan`: bytes each tile
receives and sends, multicasts deduplicated, IPU-Link bytes; copies and fills
per tile) without an array per element. A box is cut into *rows* along its innermost axis when
that axis is contiguous in the output and copies either a contiguous source
run (stride 1) or one source element (stride 0, a broadcast); rows are cut
where the destination mapping's tile runs change, the source intervals each
destination tile needs are merged into their union, and those are cut where
the sources' tile runs change; the per-tile counts are unions of source
intervals. A broadcast of a ``[D]`` bias over ``[B, S, D]`` is ``B * S`` rows
instead of ``B * S * D`` elements, and its sources are cut once per
destination tile, not once per row. When even that passes the piece budget
(a ``[C]`` vector spread over many tiles, broadcast over an output on every
tile: C x tiles pieces) the figures are read from a ``[tiles, sources]``
table of which source elements each tile needs, when it is small. A
transpose that moves the innermost axis has rows of one element; it is
planned on boxes: each tile's (and IPU's) runs of the source and of the
output cut into boxes of the array and coalesced (a block layout's tile is
one box), and the elements that stay on their tile are the overlaps of the
two sides' boxes of that tile; where runs are so short that the boxes' pairs
would cost more (or under 2**21 elements), on the tile of every element,
transposed like the data (small integers, no index array, every source
copied once). A block grid's tile is a few boxes (one per block and pass)
however many short runs its rows make, so its boxes are taken from the grid
(:meth:`~ipu_jax.lowering.block_grid.BlockGrid.boxes`), not cut from runs.
Every plan is cached by its layouts counted from their first tile: a repeated
layer's copy between the same layouts moved along the tiles reuses the first
one's plan, its per-tile figures moved into place. On several IPUs such a
move seldom keeps which bytes cross an IPU-Link, so those are counted again
for each placement, on IPU runs (a few per tensor) rather than tiles: the
source intervals the outputs' tiles need, merged per IPU and cut at the
sources' IPU runs; a transpose's from the two sides' IPU runs as boxes. What
the outputs' tiles need of the sources (rows cut at the outputs' runs, merged
per tile) is cached by the outputs' layouts alone, counted from their first
tile: a bias broadcast over each layer's activation, whose position against
the bias changes from layer to layer, finds it once. Other maps with short
rows (strided slices of the innermost axis, reversals) fall back to the
element planner. All return a :class:`CopyPlan`.

The same boxes also build the per-element gather indices the ``per_tile``
executor mode needs, at trace time only, so no step holds them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.exchange import ExchangeCost, roll_tiles, shift_cost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["Box", "BoxMap", "CopyPlan", "plan_copies", "index_dtype", "row_major_strides"]

# A region plan is used when the rows are on average at least this long;
# shorter rows cost more in NumPy bookkeeping than the element planner.
MIN_MEAN_ROW = 8


def index_dtype(n: int):
  """The integer type of indices below ``n``."""
  # int32 indices halve the memory traffic of planning; int64 beyond 2**31.
  return np.int32 if n < 2**31 - 1 else np.int64


def row_major_strides(shape) -> tuple:
  """Flat-index stride of each axis of a row-major array of ``shape``."""
  strides, step = [], 1
  for d in reversed(tuple(int(d) for d in shape)):
    strides.append(step)
    step *= max(d, 1)
  return tuple(reversed(strides))


def _positions(axes, offset: int, which: int) -> np.ndarray:
  """``offset + sum(stride * i)`` over ``axes`` (row-major), flattened.

  ``axes`` are ``(extent, out_stride, src_stride)``; ``which`` picks the
  output (1) or source (2) stride.
  """
  value = np.full((), offset, np.int64)
  for axis in axes:
    value = value[..., None] + axis[which] * np.arange(axis[0], dtype=np.int64)
  return value.reshape(-1)


@dataclasses.dataclass(frozen=True)
class Box:
  """Output elements of one box and the source elements they copy.

  For every multi-index ``i`` with ``0 <= i[a] < extents[a]``, output element
  ``out_offset + sum(out_strides[a] * i[a])`` copies source element
  ``src_offset + sum(src_strides[a] * i[a])``. Strides may be zero (a
  broadcast axis) or negative (a reversal).
  """

  extents: tuple
  out_offset: int
  out_strides: tuple
  src_offset: int
  src_strides: tuple

  @classmethod
  def make(cls, extents, out_offset, out_strides, src_offset, src_strides) -> "Box":
    ints = lambda v: tuple(int(x) for x in v)
    extents, out_strides, src_strides = ints(extents), ints(out_strides), ints(src_strides)
    if not len(extents) == len(out_strides) == len(src_strides):
      raise ValueError(f"Box: extents {extents}, out_strides {out_strides} and src_strides "
                       f"{src_strides} must have one entry per axis")
    return cls(extents, int(out_offset), out_strides, int(src_offset), src_strides)

  @property
  def size(self) -> int:
    return int(np.prod(self.extents, dtype=np.int64))

  def _axes(self) -> list:
    """``[(extent, out_stride, src_stride)]`` with size-1 axes dropped and
    neighbours that step together merged (longest rows, fewest of them)."""
    merged = []
    for e, o, s in zip(self.extents, self.out_strides, self.src_strides):
      if e == 1:
        continue
      if merged and merged[-1][1] == o * e and merged[-1][2] == s * e:
        merged[-1] = (merged[-1][0] * e, o, s)
      else:
        merged.append((e, o, s))
    return merged

  def _row_axes(self):
    """``(outer axes, row length, source step)`` of :meth:`rows`."""
    axes = self._axes()
    if axes and axes[-1][1] == 1 and axes[-1][2] in (0, 1):
      return axes[:-1], axes[-1][0], axes[-1][2]
    return axes, 1, 1

  def rows(self):
    """``(out_starts, src_starts, length, src_step)``: runs of the box.

    Row ``r`` is output positions ``[out_starts[r], out_starts[r] + length)``
    copying source ``src_starts[r] + src_step * k``; ``src_step`` is 0 or 1.
    A box whose innermost axis is not such a run gives rows of length 1.
    """
    outer, length, step = self._row_axes()
    return (_positions(outer, self.out_offset, 1), _positions(outer, self.src_offset, 2),
            length, step)

  def num_rows(self) -> int:
    """Rows :meth:`rows` gives, without building them."""
    return int(np.prod([a[0] for a in self._row_axes()[0]], dtype=np.int64))

  def bounds(self, which: int) -> tuple:
    """``(lowest, highest)`` output (``which=1``) or source (``2``) position."""
    offset = self.out_offset if which == 1 else self.src_offset
    low = high = offset
    for e, o, s in zip(self.extents, self.out_strides, self.src_strides):
      stride = o if which == 1 else s
      reach = stride * (e - 1)
      low, high = low + min(reach, 0), high + max(reach, 0)
    return low, high


@dataclasses.dataclass(frozen=True)
class BoxMap:
  """One output's map: its boxes (disjoint in the output); the rest is fill.

  Hashable, so plans are cached by it (with the layouts' fingerprints).
  """

  boxes: tuple = ()

  def __post_init__(self):
    object.__setattr__(self, "boxes", tuple(b for b in self.boxes if b.size))

  def check(self, out_size: int, num_sources: int, what: str) -> None:
    """Raises ``ValueError`` when a box reaches outside the output or sources."""
    for box in self.boxes:
      lo, hi = box.bounds(1)
      if lo < 0 or hi >= out_size:
        raise ValueError(f"{what}: box {box} writes positions [{lo}, {hi}] outside an "
                         f"output of {out_size} elements")
      lo, hi = box.bounds(2)
      if lo < 0 or hi >= num_sources:
        raise ValueError(f"{what}: box {box} reads sources [{lo}, {hi}] outside "
                         f"{num_sources} source elements")

  def index(self, out_size: int, fill_index: int, dtype) -> np.ndarray:
    """``[out_size]`` source of every output element, ``fill_index`` for fill."""
    index = np.full(out_size, fill_index, dtype)
    for box in self.boxes:
      axes = box._axes()  # pylint: disable=protected-access
      index[_positions(axes, box.out_offset, 1)] = _positions(axes, box.src_offset, 2)
    return index

  def is_identity(self, out_size: int) -> bool:
    """Whether output element ``k`` copies source ``k`` for every ``k``."""
    if len(self.boxes) != 1:
      return out_size == 0 and not self.boxes
    box = self.boxes[0]
    axes = box._axes()  # pylint: disable=protected-access
    if box.size != out_size or box.out_offset or box.src_offset:
      return False
    return not axes or (len(axes) == 1 and axes[0][1] == 1 and axes[0][2] == 1)

  def num_rows(self) -> int:
    return sum(b.num_rows() for b in self.boxes)


@dataclasses.dataclass(frozen=True)
class CopyPlan:
  """Figures of a static copy: exchange and per-tile on-tile work.

  Attributes:
    exchange: the :class:`ExchangeCost` (``None`` when nothing moves).
    received: ``[num_tiles]`` source elements each tile receives (once per
      tile however many of its outputs copy them).
    copies: ``[num_tiles]`` output elements copied on their tile (kept, or
      replicated after arriving).
    fills: ``[num_tiles]`` output elements set to the fill constant.
  """

  exchange: Optional[ExchangeCost]
  received: np.ndarray
  copies: np.ndarray
  fills: np.ndarray


def _cut(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, total: int, budget: int):
  """Cuts intervals ``[lo, hi)`` where runs starting at ``starts`` change.

  Returns ``(parent, run, piece_lo, piece_hi)`` or ``None`` past ``budget``
  pieces.
  """
  first = np.searchsorted(starts, lo, side="right") - 1
  if lo.size and (hi - lo == 1).all():
    # One element each (a broadcast's pieces): in the run of its start.
    return np.arange(lo.size), first, lo, hi
  last = np.searchsorted(starts, hi - 1, side="right") - 1
  count = last - first + 1
  n = int(count.sum())
  if n > budget:
    return None
  parent = np.repeat(np.arange(lo.size), count)
  offsets = np.cumsum(count) - count
  run = np.arange(n, dtype=np.int64) - np.repeat(offsets - first, count)
  ends = np.append(starts[1:], total)
  return (parent, run, np.maximum(lo[parent], starts[run]),
          np.minimum(hi[parent], ends[run]))


def _union_lengths(group: np.ndarray, lo: np.ndarray, hi: np.ndarray, num_groups: int,
                   span: int) -> np.ndarray:
  """``[num_groups]`` length of the union of intervals ``[lo, hi)`` per group."""
  if group.size == 0:
    return np.zeros(num_groups, np.int64)
  if num_groups * (span + 1) < 1 << 62:
    # One sort of (group, start) packed into one key: half the work of a
    # two-key lexsort, on copies with tens of thousands of pieces.
    key = group.astype(np.int64) * (span + 1) + lo
    if (key[1:] >= key[:-1]).all():
      # Already in order (a broadcast's pieces, in output order onto a
      # linear layout): the sort would leave it as it is.
      start, end, group = key, key + (hi - lo), group
    else:
      order = np.argsort(key, kind="stable")
      start = key[order]
      end = start + (hi - lo)[order]
      group = group[order]
  else:
    order = np.lexsort((lo, group))
    group = group[order]
    base = group.astype(np.int64) * (span + 1)
    start, end = base + lo[order], base + hi[order]
  # Groups are sorted and separated by more than ``span``: a running maximum
  # of interval ends never carries from one group into the next.
  reached = np.maximum.accumulate(end)
  before = np.concatenate([start[:1], reached[:-1]])
  new = np.maximum(end - np.maximum(start, before), 0)
  # Weighted bincounts are float64: exact below 2**53 elements.
  return np.bincount(group, weights=new, minlength=num_groups)[:num_groups].astype(np.int64)


def _merged_intervals(group: np.ndarray, lo: np.ndarray, hi: np.ndarray, span: int):
  """``(group, lo, hi)``: the union of intervals ``[lo, hi)`` per group, as
  disjoint intervals sorted by group then start (touching ones joined).

  Intervals lie in ``[0, span]``; the covered set of each group is kept, so
  every union taken of them later is unchanged.
  """
  if group.size <= 1 or (int(group.max()) + 1) * (span + 1) >= 1 << 62:
    return group, lo, hi
  # Each group shifted past the previous one's reach: once sorted, a running
  # maximum of interval ends never carries from one group into the next.
  base = group.astype(np.int64) * (span + 1)
  start, end = base + lo, base + hi
  if not (start[1:] >= start[:-1]).all():
    order = np.argsort(start, kind="stable")
    start, end, group, base = start[order], end[order], group[order], base[order]
  reached = np.maximum.accumulate(end)
  first = np.flatnonzero(np.concatenate([[True], start[1:] > reached[:-1]]))
  last_end = reached[np.append(first[1:] - 1, reached.size - 1)]
  return group[first], start[first] - base[first], last_end - base[first]


def plan_copies(target, sources: Sequence[TileMapping], outputs: Sequence,
                itemsize: int) -> Optional[CopyPlan]:
  """The figures of a static copy from its boxes, or ``None`` if rows are short.

  Args:
    target: the IPU target.
    sources: the source tensors' mappings; their flattened elements,
      concatenated, are the source positions the boxes refer to.
    outputs: ``[(mapping, BoxMap)]`` per output.
    itemsize: bytes per element.

  Returns:
    A :class:`CopyPlan` equal, figure for figure, to the element planner's;
    ``None`` when the map's rows are too short for regions to pay and it is
    not a transpose (then the caller plans element by element).
  """
  mappings = list(sources) + [m for m, _ in outputs]
  if any(m.fingerprint[0] == "object" for m in mappings):
    # An irregular layout is unique to its tensor: nothing to share.
    return _plan(target, sources, outputs, itemsize)
  # A repeated layer copies between the same layouts moved along the tiles:
  # what each tile receives, sends, copies and fills only compares tile
  # identities, so the plan is kept counted from the first laid-out tile and
  # moved into place. Which bytes cross an IPU-Link depends on where the
  # IPUs' boundaries fall (a layer on several IPUs seldom lands whole IPUs
  # along), so on several IPUs those are counted afresh, on IPU runs.
  first = next((m for m in mappings if m.num_rows), None)
  base = int(first.tiles[0]) if first is not None else 0
  t = target.num_tiles
  key = (tuple(m.relative_fingerprint(base, t) for m in sources),
         tuple(m.relative_fingerprint(base, t) for m, _ in outputs),
         tuple(b for _, b in outputs), int(itemsize), target)
  fresh = []

  def relative():
    fresh.append(_plan(target, sources, outputs, itemsize))
    return _shifted(_without_link(fresh[0]), -base, target)

  relative = plan_cache.cached(_PLANS, key, relative)
  if fresh:  # planned here, in place: nothing to move
    return fresh[0]
  plan = _shifted(relative, base, target)
  if target.num_ipus == 1 or plan is None or plan.exchange is None:
    return plan
  link = _link_elements(target, sources, outputs)
  if link is None:
    return _plan(target, sources, outputs, itemsize)
  exchange = dataclasses.replace(plan.exchange, link_bytes_out=link * itemsize)
  return _frozen(dataclasses.replace(plan, exchange=exchange))


_PLANS = plan_cache.PlanCache("copy plans by regions", max_entries=2048)


def _shifted(plan: Optional[CopyPlan], tiles: int, target) -> Optional[CopyPlan]:
  """``plan`` with tile ``k``'s figures moved to tile ``k + tiles`` (cyclically)."""
  if plan is None:
    return None
  if tiles % max(target.num_tiles, 1) == 0:
    return plan
  return _frozen(CopyPlan(
      shift_cost(plan.exchange, tiles, target.tiles_per_ipu),
      roll_tiles(plan.received, tiles), roll_tiles(plan.copies, tiles),
      roll_tiles(plan.fills, tiles)))


def _without_link(plan: Optional[CopyPlan]) -> Optional[CopyPlan]:
  """``plan`` with zero IPU-Link bytes (they do not move with the tiles)."""
  if plan is None or plan.exchange is None or not plan.exchange.link_bytes_out.any():
    return plan
  link = np.zeros_like(plan.exchange.link_bytes_out)
  return _frozen(dataclasses.replace(
      plan, exchange=dataclasses.replace(plan.exchange, link_bytes_out=link)))


def _short_rows(outputs) -> bool:
  """Whether the outputs' rows are too short to plan on (a transpose, or no region plan)."""
  total_out = sum(m.num_elements for m, _ in outputs)
  return sum(b.num_rows() for _, b in outputs) * MIN_MEAN_ROW > max(total_out, 1)


def _piece_budget(target, outputs) -> int:
  """Most pieces a copy is cut into before it is planned on a table (or refused)."""
  total_out = sum(m.num_elements for m, _ in outputs)
  rows = sum(b.num_rows() for _, b in outputs)
  return max(4 * rows, total_out // MIN_MEAN_ROW) + 4 * target.num_tiles


def _source_runs(sources, runs_of) -> tuple:
  """``(starts, keys, num_sources)``: the sources' runs (``runs_of(mapping)``: their
  intervals or IPU runs), each shifted to its place in the concatenation."""
  offsets = np.cumsum([0] + [m.num_elements for m in sources])
  starts, keys = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
  for m, offset in zip(sources, offsets[:-1]):
    if m.num_elements:
      run_starts, run_keys = runs_of(m)
      starts.append(run_starts + offset)
      keys.append(run_keys)
  return np.concatenate(starts), np.concatenate(keys), int(offsets[-1])


def _plan(target, sources, outputs, itemsize) -> Optional[CopyPlan]:
  num_tiles = target.num_tiles
  if _short_rows(outputs):
    permutation = _permutation_box(sources, outputs)
    if permutation is None:
      return None
    return _plan_permutation(target, sources[0], outputs[0][0], permutation, itemsize)
  budget = _piece_budget(target, outputs)
  s_starts, s_tiles, num_sources = _source_runs(sources, lambda m: m.intervals)

  needs = _output_needs(target, outputs, budget, num_sources)
  if needs is None:
    return None
  written, fills, dst, first, last = needs
  nothing = np.zeros(num_tiles, np.int64)
  if dst is None:
    return _frozen(CopyPlan(None, nothing, written, fills))
  figures = _exchange_by_pieces(target, dst, first, last, s_starts, s_tiles, num_sources,
                                budget)
  if figures is None and num_tiles * num_sources <= _DENSE_CELLS:
    figures = _exchange_dense(target, dst, first, last, s_starts, s_tiles, num_sources)
  if figures is None:
    return None
  received, sent, link = figures
  if not received.any():
    return _frozen(CopyPlan(None, nothing, written, fills))
  cost = ExchangeCost(received * itemsize, sent * itemsize, link * itemsize)
  return _frozen(CopyPlan(cost, received, written - received, fills))


def _link_elements(target, sources, outputs) -> Optional[np.ndarray]:
  """``[num_ipus]`` source elements each IPU sends over its links, counted on IPU runs.

  The figure :func:`_plan` gives (an element crosses once to each other IPU
  with a tile needing it) without the tiles: the source intervals the
  outputs' tiles need (:func:`_output_needs`, cached by the outputs'
  layouts) merged per destination IPU and cut where the sources' IPU runs
  change, a few per tensor; a transpose's from the overlaps of the two
  sides' IPU runs as boxes. None where a transpose's boxes would cost more
  than planning it (the caller plans the copy whole).
  """
  if _short_rows(outputs):
    return _permutation_link(target, sources[0], outputs[0][0],
                             _permutation_box(sources, outputs))
  per = target.tiles_per_ipu
  starts, ipus, num_sources = _source_runs(sources, lambda m: m.ipu_runs(per))
  # The needs depend on the outputs' layouts alone: a plan that moves anything had some.
  _, _, dst, first, last = _output_needs(target, outputs, _piece_budget(target, outputs),
                                         num_sources)
  # Merged, one destination IPU's intervals are disjoint: their lengths add
  # up to their union (``_merged_intervals`` merges below 2**62 / IPUs sources).
  group, lo, hi = _merged_intervals(dst // per, first, last, num_sources)
  parent, run, a, b = _cut(lo, hi, starts, num_sources, np.iinfo(np.int64).max)
  src = ipus[run]
  away = src != group[parent]
  return np.bincount(src[away], weights=(b - a)[away],
                     minlength=target.num_ipus)[:target.num_ipus].astype(np.int64)


_NEEDS = plan_cache.PlanCache("copy destination needs", max_entries=2048)


def _output_needs(target, outputs, budget: int, num_sources: int) -> Optional[tuple]:
  """``(written, fills, dst, first, last)`` of a copy's outputs, shared by layouts moved along.

  What the outputs need depends on their layouts and boxes alone, not on
  where the sources lie: a bias broadcast over each layer's activation
  needs the same source intervals per tile whichever tiles hold the bias
  (its position against the activation differs from layer to layer, so
  whole plans seldom repeat). So these are kept counted from the outputs'
  first tile and moved into place: tile ids shift, source intervals stay.
  ``dst`` is None when no output copies anything; None past ``budget``.
  """
  laid = [m for m, _ in outputs if m.num_rows]
  if not laid or any(m.fingerprint[0] == "object" for m in laid):
    return _needs_of(target, outputs, budget, num_sources)
  start, t = int(laid[0].tiles[0]), target.num_tiles
  key = (tuple(m.relative_fingerprint(start, t) for m, _ in outputs),
         tuple(b for _, b in outputs), int(budget), int(num_sources), t)

  def relative():
    needs = _needs_of(target, outputs, budget, num_sources)
    return None if needs is None else _frozen_arrays(_moved_needs(needs, -start, t))

  needs = plan_cache.cached(_NEEDS, key, relative)
  return None if needs is None else _moved_needs(needs, start, t)


def _moved_needs(needs: tuple, tiles: int, num_tiles: int) -> tuple:
  """``needs`` (of :func:`_needs_of`) with tile ``k``'s part moved to tile ``k + tiles``."""
  written, fills, dst, first, last = needs
  if tiles % num_tiles == 0:
    return needs
  moved = None if dst is None else (dst + tiles) % num_tiles
  return roll_tiles(written, tiles), roll_tiles(fills, tiles), moved, first, last


def _frozen_arrays(values: tuple) -> tuple:
  """``values`` with read-only arrays: a cached value is shared, never edited."""
  for value in values:
    if isinstance(value, np.ndarray):
      value.setflags(write=False)
  return values


def _needs_of(target, outputs, budget: int, num_sources: int) -> Optional[tuple]:
  """:func:`_output_needs` planned in place: each output's rows cut at its tile
  runs, and the source intervals each destination tile needs merged."""
  num_tiles = target.num_tiles
  written = np.zeros(num_tiles, np.int64)
  fills = np.zeros(num_tiles, np.int64)
  needs = []  # per output: (dst tile, src lo, src hi) of its pieces
  for mapping, boxmap in outputs:
    if mapping.num_elements == 0:
      continue
    on_tile = mapping.elements_per_tile(num_tiles)
    if not boxmap.boxes:
      fills += on_tile
      continue
    need = _destination_needs(mapping, boxmap, budget)
    if need is None:
      return None
    covered = np.bincount(need[0], weights=need[3],
                          minlength=num_tiles)[:num_tiles].astype(np.int64)
    written += covered
    fills += on_tile - covered
    needs.append(need[:3])
  if not needs:
    return written, fills, None, None, None
  dst, first, last = needs[0] if len(needs) == 1 else (np.concatenate(p) for p in zip(*needs))
  # Every figure is a union of source intervals per destination tile: merge
  # them first, so a small operand repeated over many rows (a [C] bias over
  # [B, H, W, C]) is cut on its source runs once per tile, not once per row.
  dst, first, last = _merged_intervals(dst, first, last, num_sources)
  return written, fills, dst, first, last


def _destination_needs(mapping: TileMapping, boxmap: BoxMap, budget: int):
  """``(dst tile, src lo, src hi, count)`` of one output's rows cut at its tile runs.

  Piece ``k`` writes ``count[k]`` elements on tile ``dst[k]`` from sources
  ``[lo[k], hi[k])`` (a run, or one element a broadcast row repeats); ``None``
  past ``budget`` pieces.
  """
  parts = [b.rows() for b in boxmap.boxes]
  out_lo = np.concatenate([p[0] for p in parts])
  src_lo = np.concatenate([p[1] for p in parts])
  length = np.concatenate([np.full(p[0].size, p[2], np.int64) for p in parts])
  step = np.concatenate([np.full(p[0].size, p[3], np.int64) for p in parts])
  d_starts, d_tiles = mapping.intervals
  cut = _cut(out_lo, out_lo + length, d_starts, mapping.num_elements, budget)
  if cut is None:
    return None
  parent, run, lo, hi = cut
  count = hi - lo
  # Each piece's sources: a run (stride 1) or one element (stride 0).
  first = src_lo[parent] + step[parent] * (lo - out_lo[parent])
  last = first + np.where(step[parent] == 1, count, 1)
  return d_tiles[run], first, last, count


def _exchange_by_pieces(target, dst, first, last, s_starts, s_tiles, num_sources, budget):
  """``(received, sent, link)`` elements per tile / IPU from the source
  intervals each destination tile needs, cut at the sources' tile runs;
  ``None`` past ``budget`` pieces."""
  num_tiles = target.num_tiles
  cut = _cut(first, last, s_starts, num_sources, budget)
  if cut is None:
    return None
  owner, s_run, a, b = cut
  dst, src = dst[owner], s_tiles[s_run]
  moved = src != dst
  if not moved.any():
    return np.zeros(num_tiles, np.int64), None, None
  if not moved.all():
    kept = np.flatnonzero(moved)  # one pass for the four arrays
    dst, src, a, b = dst[kept], src[kept], a[kept], b[kept]
  received = _union_lengths(dst, a, b, num_tiles, num_sources)
  if num_sources <= _COVERAGE_RATIO * a.size:
    sent, link = _sent_by_coverage(target, dst, a, b, s_starts, s_tiles, num_sources)
  else:
    sent, link = _sent_by_unions(target, dst, src, a, b, num_sources)
  return received, sent, link


# Past its piece budget a copy is planned on a [tiles, sources] table of which
# source elements each tile needs when the table has at most this many cells
# (a [C] operand broadcast over an output on every tile: C x tiles).
_DENSE_CELLS = 1 << 24


def _exchange_dense(target, dst, lo, hi, s_starts, s_tiles, num_sources) -> tuple:
  """:func:`_exchange_by_pieces` on a ``[tiles, sources]`` table of needs.

  ``(dst, lo, hi)`` are disjoint, non-touching intervals per tile (from
  :func:`_merged_intervals`), so each is two marks in a difference table and
  a running sum along the sources gives which elements each tile needs: work
  in tiles x sources, however many source runs the intervals cross.
  """
  num_tiles, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  width = num_sources + 1
  marks = np.zeros(num_tiles * width, np.int8)
  row = dst.astype(np.int64) * width
  marks[row + lo] = 1
  marks[row + hi] = -1
  need = np.cumsum(marks.reshape(num_tiles, width), axis=1, dtype=np.int8)[:, :num_sources] > 0
  owner = np.repeat(s_tiles, np.diff(np.append(s_starts, num_sources)))
  need[owner, np.arange(num_sources)] = False  # an element on its own tile does not move
  received = need.sum(axis=1, dtype=np.int64)
  sent = np.bincount(owner[need.any(axis=0)], minlength=num_tiles)[:num_tiles].astype(np.int64)
  link = np.zeros(n_ipus, np.int64)
  if n_ipus > 1:
    # An element crosses the links once per other IPU with a tile needing it.
    owner_ipu = owner // per_ipu
    wanted = need.reshape(n_ipus, per_ipu, num_sources).any(axis=1)
    away = wanted & (owner_ipu[None, :] != np.arange(n_ipus)[:, None])
    link = np.bincount(owner_ipu, weights=away.sum(axis=0),
                       minlength=n_ipus)[:n_ipus].astype(np.int64)
  return received, sent, link


# What is sent is counted on the source elements (:func:`_sent_by_coverage`)
# when they are at most this many times the moved pieces, else by unions.
_COVERAGE_RATIO = 2


def _sent_by_unions(target, dst, src, a, b, num_sources) -> tuple:
  """``(sent, link)``: elements each tile sends and each IPU sends over its links,
  given the moved pieces (source ``[a, b)`` from tile ``src`` to tile ``dst``):
  per tile, and per source tile and destination IPU, unions of their intervals."""
  num_tiles, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  sent = _union_lengths(src, a, b, num_tiles, num_sources)
  link = np.zeros(n_ipus, np.int64)
  if n_ipus > 1:
    crossing = src // per_ipu != dst // per_ipu
    group = (dst[crossing] // per_ipu) * num_tiles + src[crossing]
    per_pair = _union_lengths(group, a[crossing], b[crossing], n_ipus * num_tiles, num_sources)
    source_ipu = (np.arange(n_ipus * num_tiles) % num_tiles) // per_ipu
    link = np.bincount(source_ipu, weights=per_pair, minlength=n_ipus)[:n_ipus].astype(np.int64)
  return sent, link


def _sent_by_coverage(target, dst, a, b, s_starts, s_tiles, num_sources) -> tuple:
  """:func:`_sent_by_unions` from which source elements the pieces cover.

  A source element lies on one tile, so the union of what a tile sends is
  every element of its own that some moved piece covers, and what crosses to
  an IPU once is every element some piece to that IPU covers, from another
  IPU. Covered elements are counted on the sources (a difference array per
  destination IPU): work in pieces plus source elements, no sort. Pays where
  the sources are small against the pieces (a bias broadcast over
  thousands of tiles).
  """
  num_tiles, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  span = num_sources + 1
  owner = np.repeat(s_tiles, np.diff(np.append(s_starts, num_sources)))
  # Pieces to IPU i mark source elements in layer i (one difference array per
  # IPU, laid end to end: each layer's marks add up to zero before the next).
  layer = dst // per_ipu * span
  size = n_ipus * span
  marks = (np.bincount(layer + a, minlength=size)[:size]
           - np.bincount(layer + b, minlength=size)[:size])
  covered = (np.cumsum(marks).reshape(n_ipus, span)[:, :num_sources] > 0)
  sent = np.bincount(owner[covered.any(axis=0)], minlength=num_tiles)[:num_tiles]
  link = np.zeros(n_ipus, np.int64)
  if n_ipus > 1:
    # Elements covered in another IPU's layer than their own leave it once each.
    owner_ipu = owner // per_ipu
    away = covered & (owner_ipu[None, :] != np.arange(n_ipus)[:, None])
    link = np.bincount(owner_ipu, weights=away.sum(axis=0),
                       minlength=n_ipus)[:n_ipus].astype(np.int64)
  return sent.astype(np.int64), link


def _permutation_box(sources, outputs) -> Optional[Box]:
  """The lone box of a transpose (every source element copied once), else None.

  A transpose is one source, one output of the same size, and one box over
  the whole output in row-major order whose source strides are the row-major
  strides of the source's axes in some order.
  """
  if len(sources) != 1 or len(outputs) != 1 or len(outputs[0][1].boxes) != 1:
    return None
  mapping, boxmap = outputs[0]
  box = boxmap.boxes[0]
  if (box.size != mapping.num_elements or box.size != sources[0].num_elements
      or box.out_offset or box.src_offset):
    return None
  axes = [(e, o, s) for e, o, s in zip(box.extents, box.out_strides, box.src_strides) if e > 1]
  extents = [e for e, _, _ in axes]
  if [o for _, o, _ in axes] != list(row_major_strides(extents)):
    return None
  # Source axes sorted by falling stride must be a row-major layout.
  by_stride = sorted(axes, key=lambda a: -a[2])
  if [s for _, _, s in by_stride] != list(row_major_strides([e for e, _, _ in by_stride])):
    return None
  return box


def _plan_permutation(target, source: TileMapping, mapping: TileMapping, box: Box,
                      itemsize: int) -> CopyPlan:
  """The figures of a transpose from its tiles' runs, transposed as boxes.

  A transpose that moves the innermost axis has rows of one element, so it
  is not planned on rows: each tile's runs, of the source and of the output,
  are cut into boxes of the array (a run of a row-major array is a few
  boxes), the source's boxes read in the output's axes, and the elements
  that stay on their tile (or IPU) are the overlaps of the two tiles' (IPUs')
  boxes: ``O(boxes)``, not ``O(elements)``. Where tiles hold so many short
  runs that the boxes' pairs outnumber a share of the elements, the tile of
  every element is compared instead (:func:`_elementwise_stays`); both count
  the same elements.
  """
  num_tiles = target.num_tiles
  n_ipus, per_ipu = target.num_ipus, target.tiles_per_ipu
  frame = _PermutedFrame(box)
  # Block layouts give their tiles' boxes directly (a few per tile, however
  # many short runs their rows make).
  src_boxes = _grid_boxes(source, frame.src_extents)
  dst_boxes = _grid_boxes(mapping, frame.extents)
  stays = frame.overlaps((source.intervals, src_boxes), (mapping.intervals, dst_boxes),
                         source.num_elements, num_tiles)
  on_ipu = None
  if n_ipus > 1:
    ipu = lambda b: None if b is None else (b[0] // per_ipu, b[1], b[2])  # noqa: E731
    on_ipu = frame.overlaps((source.ipu_runs(per_ipu), ipu(src_boxes)),
                            (mapping.ipu_runs(per_ipu), ipu(dst_boxes)),
                            source.num_elements, n_ipus)
  if stays is None or (n_ipus > 1 and on_ipu is None):
    stays, on_ipu = _elementwise_stays(target, source, mapping, box)
  written = mapping.elements_per_tile(num_tiles).astype(np.int64)
  fills = np.zeros(num_tiles, np.int64)
  # Every element moves but those already on their tile; as every source
  # element is copied once, counting those few gives both directions.
  received = written - stays
  if not received.any():
    return _frozen(CopyPlan(None, received, written, fills))
  held = source.elements_per_tile(num_tiles).astype(np.int64)
  sent = held - stays
  link = np.zeros(n_ipus, np.int64)
  if n_ipus > 1:
    # What leaves an IPU is all it holds but what stays on it.
    from_ipu = np.add.reduceat(held, np.arange(0, num_tiles, per_ipu))
    link = from_ipu - on_ipu
  cost = ExchangeCost(received * itemsize, sent * itemsize, link * itemsize)
  return _frozen(CopyPlan(cost, received, written - received, fills))


def _permutation_link(target, source: TileMapping, mapping: TileMapping,
                      box: Box) -> Optional[np.ndarray]:
  """:func:`_plan_permutation`'s IPU-Link elements alone: all each IPU holds but
  what stays on it, the overlaps of the two sides' IPU runs as boxes (a
  few per IPU, so boxes pay however small the transpose). None past a pair
  budget."""
  per, n_ipus = target.tiles_per_ipu, target.num_ipus
  frame = _PermutedFrame(box)
  if not frame.extents:
    return None  # one element: no axes to cut runs along (planned whole, at once)
  count = source.num_elements
  src = _run_boxes(*source.ipu_runs(per), count, frame.src_extents)
  dst = _run_boxes(*mapping.ipu_runs(per), count, frame.extents)
  src = (src[0], src[1][:, frame.to_output], src[2][:, frame.to_output])
  on_ipu = _overlaps_by_key(dst, src, n_ipus, max(frame.size // _PAIRS_PER_ELEMENT, 1 << 12))
  if on_ipu is None:
    return None
  starts, ipus = source.ipu_runs(per)
  held = np.bincount(ipus, weights=np.diff(np.append(starts, count)), minlength=n_ipus)
  return held[:n_ipus].astype(np.int64) - on_ipu


class _PermutedFrame:
  """A transpose's box as two row-major frames of one array: the output's and the source's.

  The output's axes (size-1 axes dropped) are row-major in the output; the
  same axes ordered by falling source stride are row-major in the source.
  """

  def __init__(self, box: Box):
    axes = [(e, s) for e, s in zip(box.extents, box.src_strides) if e > 1]
    self.extents = [e for e, _ in axes]
    order = sorted(range(len(axes)), key=lambda a: -axes[a][1])
    self.src_extents = [self.extents[a] for a in order]
    self.to_output = np.argsort(order)  # source frame's axis of each output axis
    self.size = int(np.prod(self.extents, dtype=np.int64))

  def overlaps(self, src: tuple, dst: tuple, num_elements: int, num_keys: int):
    """``[num_keys]`` output elements whose source run has their run's key (tile, IPU).

    Args:
      src, dst: ``((starts, keys), boxes)`` of the source and the output:
        their runs in their own flat orders, and their ``(key, lo, hi)``
        boxes in their own frames when known (block layouts), else None.
      num_elements: elements of each.
      num_keys: keys are below this.

    Returns:
      Counts per key, or ``None`` when the boxes' pairs would cost more than
      comparing elements.
    """
    pieces = sum(len(runs[0]) if boxes is None else boxes[0].size for runs, boxes in (src, dst))
    if self.size < _REGION_MIN_ELEMENTS or pieces > self.size // _RUNS_PER_ELEMENT:
      return None  # few elements, or runs so short that boxes cost more than elements
    if src[1] is None:
      src = (None, _coalesced(*_run_boxes(*src[0], num_elements, self.src_extents)))
    if dst[1] is None:
      dst = (None, _coalesced(*_run_boxes(*dst[0], num_elements, self.extents)))
    src, dst = src[1], dst[1]
    src = (src[0], src[1][:, self.to_output], src[2][:, self.to_output])
    return _overlaps_by_key(dst, src, num_keys, self.size // _PAIRS_PER_ELEMENT)


def _grid_boxes(mapping: TileMapping, extents) -> Optional[tuple]:
  """``(tile, lo, hi)``: a block-grid layout's boxes in the frame ``[extents]``.

  ``None`` unless ``mapping`` is a block grid (without pieces) whose shape,
  size-1 axes dropped, is ``extents``.
  """
  grid = mapping.grid
  if grid is None:
    return None
  shape = [int(d) for d in grid.shape]
  if [d for d in shape if d != 1] != [int(e) for e in extents]:
    return None
  boxes = grid.boxes()
  if boxes is None:
    return None
  row, lo, hi = boxes
  if row.size and int(row.max()) >= mapping.num_rows:
    return None  # a stored block beyond the rows: not this layout
  axes = [a for a, d in enumerate(shape) if d != 1]
  return mapping.tiles[row], lo[:, axes], hi[:, axes]


def _coalesced(key, lo, hi) -> tuple:
  """Boxes of one key that abut along an axis and match on the others, as one.

  A block layout's runs are its blocks' rows: coalesced, a tile's boxes are
  its blocks again. The union is the same elements, so overlaps are unchanged.
  """
  axes = lo.shape[1]
  for a in range(axes):
    rest = [b for b in range(axes) if b != a]
    order = np.lexsort([lo[:, a]] + [hi[:, b] for b in rest] + [lo[:, b] for b in rest] + [key])
    key, lo, hi = key[order], lo[order], hi[order]
    joins = (key[1:] == key[:-1]) & (lo[1:, a] == hi[:-1, a])
    for b in rest:
      joins &= (lo[1:, b] == lo[:-1, b]) & (hi[1:, b] == hi[:-1, b])
    if not joins.any():
      continue
    first = np.flatnonzero(np.append(True, ~joins))
    last = np.append(first[1:], key.size) - 1
    hi = np.concatenate([hi[first][:, :a], hi[last][:, a:a + 1], hi[first][:, a + 1:]], axis=1)
    key, lo = key[first], lo[first]
  return key, lo, hi


# A pair of boxes costs a few NumPy passes over ``[pairs, axes]``, an element
# one int16 compare: past one pair per this many elements (measured on BERT's
# transposes), the elements are compared; likewise past one run per
# ``_RUNS_PER_ELEMENT`` elements, whose boxes cost a sort each.
_PAIRS_PER_ELEMENT = 32
_RUNS_PER_ELEMENT = 16
# Below this many elements the compare takes a few milliseconds, about the
# boxes' fixed cost in NumPy calls (a 4-axis transpose of 2**20: 8 and 16 ms).
_REGION_MIN_ELEMENTS = 1 << 21


def _run_boxes(starts, keys, num_elements: int, extents) -> tuple:
  """``(key, lo, hi)``: the runs of a row-major ``[extents]`` array as boxes.

  Run ``i`` covers flat elements ``[starts[i], starts[i + 1])`` (the last to
  ``num_elements``); each is cut into at most ``2 * len(extents) - 1`` boxes
  (``lo``, ``hi``: ``[boxes, len(extents)]`` corners) that keep its key.
  """
  starts = np.asarray(starts, np.int64)
  ends = np.append(starts[1:], num_elements)
  strides = np.asarray(row_major_strides(extents), np.int64)
  pieces = []
  s = starts.copy()
  # Heads, innermost axis first: from the start up to the next boundary of
  # the axis above, or to the last whole row of this axis before the end.
  for k in range(len(extents) - 1, -1, -1):
    above = -(-s // strides[k - 1]) * strides[k - 1] if k else num_elements
    stop = np.minimum(ends // strides[k] * strides[k], above)
    s = _piece(pieces, k, s, stop)
  # Tails, outermost axis first: what is left before the end, row by row.
  for k in range(len(extents)):
    s = _piece(pieces, k, s, ends // strides[k] * strides[k])
  owner = np.concatenate([p[0] for p in pieces])
  level = np.concatenate([np.full(p[0].size, p[1], np.int64) for p in pieces])
  first = np.concatenate([p[2] for p in pieces])
  count = np.concatenate([p[3] for p in pieces])
  extents = np.asarray(extents, np.int64)
  axis = np.arange(extents.size)
  lo = first[:, None] // strides[None, :] % extents[None, :]
  # Axes above the box's level are fixed, its own spans ``count`` rows, those below are whole.
  span = np.where(axis[None, :] < level[:, None], 1,
                  np.where(axis[None, :] == level[:, None], (count // strides[level])[:, None],
                           extents[None, :]))
  lo = np.where(axis[None, :] > level[:, None], 0, lo)
  return np.asarray(keys, np.int64)[owner], lo, lo + span


def _piece(pieces: list, level: int, s, stop):
  """Records ``[s, stop)`` where not empty as boxes of ``level``; the new starts."""
  keep = stop > s
  if keep.any():
    owner = np.flatnonzero(keep)
    pieces.append((owner, level, s[owner], stop[owner] - s[owner]))
  return np.where(keep, stop, s)


def _overlaps_by_key(a: tuple, b: tuple, num_keys: int, budget: int):
  """``[num_keys]`` elements where a box of ``a`` meets a box of ``b`` of the same key.

  The boxes of each side are disjoint, so the overlaps of the pairs of one
  key add up to the elements both sides give that key. ``None`` past
  ``budget`` pairs.
  """
  a_key, a_lo, a_hi = a
  b_key, b_lo, b_hi = b
  order = np.argsort(b_key, kind="stable")
  b_per_key = np.bincount(b_key, minlength=num_keys)
  b_first = np.cumsum(b_per_key) - b_per_key
  pairs = b_per_key[a_key]
  total = int(pairs.sum())
  if total > budget:
    return None
  # Pair ``p`` of box ``i`` of ``a``: the ``p``-th box of ``b`` with its key.
  i = np.repeat(np.arange(a_key.size), pairs)
  p = np.arange(total) - np.repeat(np.cumsum(pairs) - pairs, pairs)
  j = order[b_first[a_key[i]] + p]
  sides = np.minimum(a_hi[i], b_hi[j]) - np.maximum(a_lo[i], b_lo[j])
  volume = np.prod(np.maximum(sides, 0), axis=1)
  return np.bincount(a_key[i], weights=volume, minlength=num_keys)[:num_keys].astype(np.int64)


def _elementwise_stays(target, source: TileMapping, mapping: TileMapping, box: Box) -> tuple:
  """``(stays per tile, stays per IPU)`` from the tile of every element.

  The source tiles, viewed with the box's strides, are the tile each output
  element comes from; small tile ids (int16) keep that one transposed copy
  cheap. Stays per IPU is ``None`` on one IPU.
  """
  num_tiles = target.num_tiles
  tile_type = np.int16 if num_tiles < 2**15 else np.int32
  src_starts, src_tiles = source.intervals
  src_lengths = np.diff(np.append(src_starts, source.num_elements))
  flat = np.repeat(src_tiles.astype(tile_type), src_lengths)
  src = np.lib.stride_tricks.as_strided(
      flat, shape=box.extents, strides=[s * flat.itemsize for s in box.src_strides],
      writeable=False).reshape(-1)
  dst_starts, dst_tiles = mapping.intervals
  dst = np.repeat(dst_tiles.astype(tile_type), np.diff(np.append(dst_starts, mapping.num_elements)))
  stays = np.bincount(dst[src == dst], minlength=num_tiles)[:num_tiles].astype(np.int64)
  n_ipus, per_ipu = target.num_ipus, target.tiles_per_ipu
  if n_ipus == 1:
    return stays, None
  # The output elements whose source tile lies in their destination IPU's
  # tile range: that IPU is constant on the destination's IPU runs, so the
  # range's first tile is spread over them, and "in range" is one
  # subtraction read unsigned (below the first tile wraps past any tile id).
  ipu_starts, ipus = mapping.ipu_runs(per_ipu)
  first_tile = np.repeat((ipus * per_ipu).astype(tile_type),
                         np.diff(np.append(ipu_starts, mapping.num_elements)))
  unsigned = np.uint16 if tile_type == np.int16 else np.uint32
  stays_on_ipu = (src - first_tile).view(unsigned) < per_ipu
  if ipu_starts.size <= _FEW_IPU_RUNS:  # counting set flags beats widening them to add
    bounds = np.append(ipu_starts, mapping.num_elements)
    per_run = np.array([np.count_nonzero(stays_on_ipu[a:b])
                        for a, b in zip(bounds[:-1], bounds[1:])], np.int64)
  else:
    per_run = np.add.reduceat(stays_on_ipu, ipu_starts, dtype=np.int64)
  same = np.bincount(ipus, weights=per_run, minlength=n_ipus)
  return stays, same[:n_ipus].astype(np.int64)


# A tensor's IPU runs counted one by one (a linear layout has one or two per IPU).
_FEW_IPU_RUNS = 64


def _frozen(plan: CopyPlan) -> CopyPlan:
  """``plan`` with read-only arrays: a cached plan is shared, never edited."""
  arrays = [plan.received, plan.copies, plan.fills]
  if plan.exchange is not None:
    arrays += [plan.exchange.bytes_in, plan.exchange.bytes_out, plan.exchange.link_bytes_out]
  for array in arrays:
    array.setflags(write=False)
  return plan
