"""Window plans: how pooling and its gradients are cut over the tiles.

Tile plan. Like popnn's pooling planner, which splits the batch, the
channels and every output field axis, the result of a windowed reduction is
cut into a grid of boxes along *every* axis, one box per tile. Tile ``(i0,
i1, ...)`` computes its output box and receives the input box its windows
read: along an axis with window ``k``, stride ``s``, window dilation ``d``,
base dilation ``b`` and low padding ``lo``, output rows ``[o0, o1)`` read the
padded, base-dilated positions ``[o0*s, (o1-1)*s + (k-1)*d]``, i.e. the input
rows under them plus the *halo* a window reaches past the box (rows a
neighbouring box reads too are sent to both tiles). An axis the window does
not touch (``k = s = b = 1``, no padding: batch and channels of NHWC pooling)
has no halo, so a grid cut only along such axes exchanges each input element
to one tile, as the row-block plan this one replaces did.

The gradient of max pooling, ``select_and_scatter_add``, writes a result of
the operand's shape: its grid cuts the operand, and a tile receives the
windows that touch its box (their cotangents, the *source*) and every
operand element those windows read (to find each window's selected element),
a halo on both sides. Windows that touch two boxes are selected on both
tiles (the redundant work is costed); each tile keeps the scatter into its
own box. Ties go to the first maximum on every tile alike, so the result is
the one ``jax.jit`` gives.

Choosing the grid (:func:`plan_window`): for each axis a modest set of split
counts (``matmul_cost.split_candidates``) is combined into candidate grids of
at most ``num_tiles`` boxes, evaluated as NumPy arrays for the busiest tile
(full boxes), as popnn's planner evaluates its partitions:

* compute: outputs (or selected windows) times window elements times the
  per-element vector passes, split over the workers
  (``estimators.worker_split_cycles``, the per-vector model the rule used
  before, so costs of the plans it made are unchanged);
* exchange: the input box's bytes at the exchange bandwidth plus its latency,
  assuming nothing is in place (popnn's planner does the same; the emitted
  step counts the exact bytes);
* boxes of fewer than :data:`MIN_BLOCK_OUTPUTS` outputs are not made (the
  smallest per-tile piece ``builders.partitioned`` makes too), and grids whose
  input box plus output box fit a tile's memory are preferred.

Ties go to fewer tiles, then less memory, then more boxes along outer axes.
The best few grids are cached by target, geometry and work; the rule costs
each one's exact exchange against where its operands are (a linearly mapped
operand cut along its outer axis may need no exchange at all) and keeps the
cheapest.

Exchange is exact and by regions (:func:`pool_needs`, :func:`scatter_needs`):
per operand axis, every coordinate knows the contiguous range of boxes that
read it (from the first and last window reading it, :meth:`WindowGeometry.
readers`, closed-form in the window's arithmetic); the ranges are what
``matmul_grid.operand_exchange_cost`` takes, which overlaps them with the
operand's mapping by intervals (``lowering/block_overlap.py``). A tile
receives what its box needs and does not hold; an element is sent once if any
other tile needs it (multicast). Coordinates no window reads (strides longer
than the window) are not sent. With window dilation and boxes shorter than the
dilation, a box between two readers of an element counts it too (ranges).

Per-tile execution cuts each operand into the boxes' input windows with pad
and one take per axis (:func:`pool_cuts`, :func:`scatter_cuts` give the
starts); the rule vmaps the box computation over the grid.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.lowering.matmul_plan import GridPlan, covering
from ipu_jax.lowering.matmul_cost import ceil_div, grid_product, split_candidates
from ipu_jax.lowering.matmul_grid import edge_sizes

__all__ = ["WindowGeometry", "WindowWork", "WindowPlan", "window_geometry", "plan_window",
           "pool_needs", "scatter_needs", "block_work", "pool_cuts", "scatter_cuts",
           "MIN_BLOCK_OUTPUTS", "SHORTLIST"]

# About this many grids are evaluated per plan (a few milliseconds of NumPy).
_SEARCH_BUDGET = 100_000

# Grids whose exact exchange the rule compares (the best estimates).
SHORTLIST = 4

# Smallest output box worth a tile (as ``builders.partitioned`` cuts rows).
MIN_BLOCK_OUTPUTS = 64


@dataclasses.dataclass(frozen=True)
class WindowGeometry:
  """A windowed reduction's shapes and window arithmetic, per axis.

  Attributes:
    in_shape: the windowed operand's shape.
    out_shape: the shape of the windows (the pooled result).
    window, strides, base_dilation, window_dilation: per axis.
    padding: per axis ``(low, high)``.
  """

  in_shape: tuple
  out_shape: tuple
  window: tuple
  strides: tuple
  padding: tuple
  base_dilation: tuple
  window_dilation: tuple

  @property
  def ndim(self) -> int:
    return len(self.in_shape)

  @property
  def window_elements(self) -> int:
    return int(np.prod(self.window, dtype=np.int64))

  def reach(self, a: int) -> int:
    """Span of a window along axis ``a`` in padded, base-dilated positions."""
    return (self.window[a] - 1) * self.window_dilation[a] + 1

  def readers(self, a: int) -> tuple:
    """For each input coordinate along axis ``a``, the first and last window reading it.

    Input ``i`` sits at padded position ``p = lo + i*b``; window ``o`` reads
    ``o*s + j*d`` for taps ``j < k``. The taps ``j = r + t*(s/g)`` (``g =
    gcd(s, d)``) of one residue ``r`` reach ``p`` from windows ``(p - r*d)/s
    - t*(d/g)`` when ``s`` divides ``p - r*d``: per residue an arithmetic run,
    clipped to the windows that exist, so ``min(k, s/g)`` vector passes.

    Returns:
      ``(first, last)``, ``[in_shape[a]]`` int64 each; ``first > last`` for
      coordinates no window reads.
    """
    size, out = int(self.in_shape[a]), int(self.out_shape[a])
    k, s = int(self.window[a]), int(self.strides[a])
    d, b = int(self.window_dilation[a]), int(self.base_dilation[a])
    p = int(self.padding[a][0]) + np.arange(size, dtype=np.int64) * b
    first = np.full(size, out, np.int64)
    last = np.full(size, -1, np.int64)
    g = math.gcd(s, d)
    period, step = s // g, d // g
    for r in range(min(k, period)):
      q = p - r * d
      ok = (q >= 0) & (q % s == 0)
      base = q // s
      taps = (k - r - 1) // period + 1
      t_lo = np.maximum(0, ceil_div(base - (out - 1), step))
      t_hi = np.minimum(taps - 1, base // step)
      ok &= t_lo <= t_hi
      first = np.where(ok, np.minimum(first, base - t_hi * step), first)
      last = np.where(ok, np.maximum(last, base - t_lo * step), last)
    return first, last

  def window_extent(self, a: int) -> tuple:
    """Per window along ``a``, the first and last input coordinate it reads.

    Only for unit base and window dilation (``select_and_scatter_add``); a
    window reading padding only has ``first > last``.
    """
    o = np.arange(int(self.out_shape[a]), dtype=np.int64)
    start = o * int(self.strides[a]) - int(self.padding[a][0])
    end = start + int(self.window[a]) - 1
    return np.maximum(start, 0), np.minimum(end, int(self.in_shape[a]) - 1)


def window_geometry(in_shape, out_shape, window_dimensions, window_strides, padding,
                    base_dilation=None, window_dilation=None) -> WindowGeometry:
  nd = len(in_shape)
  return WindowGeometry(
      in_shape=tuple(int(x) for x in in_shape), out_shape=tuple(int(x) for x in out_shape),
      window=tuple(int(x) for x in window_dimensions),
      strides=tuple(int(x) for x in window_strides),
      padding=tuple((int(lo), int(hi)) for lo, hi in padding),
      base_dilation=tuple(int(x) for x in (base_dilation or (1,) * nd)),
      window_dilation=tuple(int(x) for x in (window_dilation or (1,) * nd)))


@dataclasses.dataclass(frozen=True)
class WindowWork:
  """What a tile does for its box, in the terms the planner costs.

  Attributes:
    scatter: ``select_and_scatter_add`` (the grid cuts the operand) rather
      than a pooling (the grid cuts the windows).
    cost: vector passes per window element (1 for a monoid, 2 to select and
      scatter, the equations of a generic computation).
    itemsize: element bytes the workers' vectors hold.
    in_bytes: bytes per element of the windowed operands, together.
    out_bytes: bytes per output element, all results together.
    source_bytes: ``select_and_scatter_add``: bytes per window of the source.
  """

  scatter: bool
  cost: int
  itemsize: int
  in_bytes: int
  out_bytes: int
  source_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WindowPlan(GridPlan):
  """How a windowed reduction's result is cut over tiles (a :class:`GridPlan`).

  ``grid`` has boxes along each axis of the result (the operand's axes for
  ``select_and_scatter_add``, which has the operand's shape); the
  temporaries are a box's input plus its output.
  """

  @property
  def label(self) -> str:
    """E.g. ``grid 4x8x8x1 boxes 2x16x16x64``."""
    return (f"grid {'x'.join(str(g) for g in self.grid)} "
            f"boxes {'x'.join(str(b) for b in self.block)}")


def _axis_estimates(geo: WindowGeometry, work: WindowWork, a: int, block: np.ndarray) -> tuple:
  """Per candidate box size along ``a``: ``(outputs, windows, input, source)``.

  The busiest (full) box's extent along the axis: its outputs, the windows
  it computes, the input coordinates it reads and the source windows it
  receives (``select_and_scatter_add``).
  """
  k, s = geo.window[a], geo.strides[a]
  if work.scatter:
    windows = np.minimum(geo.out_shape[a], (block + k - 2) // s + 1)
    inputs = np.minimum(geo.in_shape[a], (windows - 1) * s + k)
    return block, windows, inputs, windows
  first, last = geo.readers(a)
  read = int((first <= last).sum())
  span = ceil_div((block - 1) * s + geo.reach(a), geo.base_dilation[a])
  inputs = np.minimum(np.minimum(span, block * k), read)
  return block, block, inputs, np.ones_like(block)


def plan_window(target, geo: WindowGeometry, work: WindowWork,
                count: int = SHORTLIST) -> tuple:
  """The ``count`` best grids of a windowed reduction, best first (cached).

  The estimates assume nothing is in place; the rule costs the exact exchange
  of each against its operands' mappings and keeps the cheapest.
  """
  return _plan_cached(target, geo, work, int(count))


@functools.lru_cache(maxsize=512)
def _plan_cached(target, geo: WindowGeometry, work: WindowWork, count: int) -> tuple:
  shape = geo.in_shape if work.scatter else geo.out_shape
  limit = target.num_tiles
  active = sum(d > 1 for d in shape)
  budget = max(4, int(_SEARCH_BUDGET ** (1.0 / max(active, 1))))
  grid = grid_product([split_candidates(d, limit, budget) for d in shape], limit)
  outputs = np.ones_like(grid[0])
  windows, inputs, sources, tiles = (np.ones_like(grid[0]) for _ in range(4))
  for a, (d, g) in enumerate(zip(shape, grid)):
    o, w, i, src = _axis_estimates(geo, work, a, ceil_div(d, g))
    outputs, windows, inputs, sources = outputs * o, windows * w, inputs * i, sources * src
    tiles = tiles * g
  total = int(np.prod(shape, dtype=np.int64))
  compute = estimators.worker_split_cycles(
      target, windows * geo.window_elements * work.cost, 1, work.itemsize)
  in_bytes = inputs * work.in_bytes + (sources * work.source_bytes if work.scatter else 0)
  exchange = np.where(in_bytes > 0, in_bytes / target.exchange_bytes_per_cycle
                      + target.exchange_latency_cycles, 0.0)
  temp = in_bytes + outputs * work.out_bytes
  cycles = compute + exchange
  fits = temp <= target.bytes_per_tile
  # The all-ones grid has every output: at least one candidate stays.
  big_enough = outputs >= min(MIN_BLOCK_OUTPUTS, total)
  primary = np.where(big_enough & fits, cycles, np.inf) if (big_enough & fits).any() else (
      np.where(big_enough, temp, np.inf))
  # Last ties: more boxes along outer axes first (boxes of a row-major
  # layout's consecutive runs, where a linearly mapped operand already is).
  outer_first = tuple(-g for g in reversed(grid))
  order = np.lexsort(outer_first + (temp, tiles, cycles, primary))
  order = order[np.isfinite(primary[order])][:max(1, count)]
  return tuple(WindowPlan(
      grid=tuple(int(g[j]) for g in grid), block=tuple(int(ceil_div(d, g[j]))
                                                      for d, g in zip(shape, grid)),
      compute_cycles=float(compute[j]), exchange_cycles=float(exchange[j]),
      sync_cycles=float(target.sync_cycles_internal), exchange_bytes=int(in_bytes[j]),
      temp_bytes=int(temp[j]), fits=bool(fits[j]), candidates=int(grid[0].size))
      for j in order)


# -- exact needs of each box, by ranges ----------------------------------------


def _box_ranges(first: np.ndarray, last: np.ndarray, block: int) -> tuple:
  """Boxes ``[lo, hi)`` of ``block`` rows holding rows ``first..last`` (empty if none)."""
  some = first <= last
  lo = np.where(some, first // block, 0)
  hi = np.where(some, last // block + 1, 0)
  return lo, hi


def _product_over_grid(per_axis: Sequence[np.ndarray], grid: Sequence[int]) -> np.ndarray:
  """``[G]`` (row-major over the grid) product of per-axis ``[grid[a]]`` factors."""
  total = np.ones(int(np.prod(grid, dtype=np.int64)), np.int64)
  coords = np.unravel_index(np.arange(total.size), tuple(grid))
  for factor, c in zip(per_axis, coords):
    total = total * np.asarray(factor, np.int64)[c]
  return total


def pool_needs(geo: WindowGeometry, plan: WindowPlan) -> tuple:
  """Which boxes read each coordinate of a pooling's windowed operand.

  Returns:
    ``(needs, elements)``: per axis ``(axis, lo, hi)`` (the boxes ``lo[c] <=
    i < hi[c]`` read coordinate ``c``), as ``operand_exchange_cost`` takes
    them, and ``[G]`` elements each box reads.
  """
  needs, counts = [], []
  for a in range(geo.ndim):
    lo, hi = _box_ranges(*geo.readers(a), plan.block[a])
    needs.append((a, lo, hi))
    counts.append(covering(lo, hi, plan.grid[a]))
  return needs, _product_over_grid(counts, plan.grid)


def scatter_needs(geo: WindowGeometry, plan: WindowPlan) -> tuple:
  """Which boxes of ``select_and_scatter_add``'s result need each input.

  A box needs the windows touching it (the source) and every operand element
  those windows read: element ``i`` is needed from the box where its first
  reader starts to the box where its last reader ends.

  Returns:
    ``((source_needs, source_elements), (operand_needs, operand_elements))``
    as :func:`pool_needs` gives them.
  """
  src_needs, src_counts, op_needs, op_counts = [], [], [], []
  for a in range(geo.ndim):
    block, grid = plan.block[a], plan.grid[a]
    start, end = geo.window_extent(a)
    lo, hi = _box_ranges(start, end, block)
    src_needs.append((a, lo, hi))
    src_counts.append(covering(lo, hi, grid))
    # An element's boxes run from its first reader's first row to its last
    # reader's last row (the planner only runs this with windows to read).
    first, last = geo.readers(a)
    some = first <= last
    lo, hi = _box_ranges(np.where(some, start[np.where(some, first, 0)], 1),
                         np.where(some, end[np.where(some, last, 0)], 0), block)
    op_needs.append((a, lo, hi))
    op_counts.append(covering(lo, hi, grid))
  return ((src_needs, _product_over_grid(src_counts, plan.grid)),
          (op_needs, _product_over_grid(op_counts, plan.grid)))


def block_work(geo: WindowGeometry, plan: WindowPlan, scatter: bool) -> np.ndarray:
  """``[G]`` windows each box computes: its outputs, or (scatter) the windows touching it."""
  if not scatter:
    return _product_over_grid([edge_sizes(d, g, b) for d, g, b in
                               zip(geo.out_shape, plan.grid, plan.block)], plan.grid)
  (_, windows), _ = scatter_needs(geo, plan)
  return windows


# -- per-tile cuts ---------------------------------------------------------------


def pool_cuts(geo: WindowGeometry, plan: WindowPlan, a: int) -> tuple:
  """Box input windows along ``a``: ``(starts [grid], span)`` in padded positions."""
  s, block = geo.strides[a], plan.block[a]
  starts = np.arange(plan.grid[a], dtype=np.int64) * block * s
  return starts, (block - 1) * s + geo.reach(a)


def scatter_cuts(geo: WindowGeometry, plan: WindowPlan, a: int) -> tuple:
  """``select_and_scatter_add``'s per-box cut along ``a``.

  Box ``i`` (operand rows ``[i*B, i*B + B)``) takes ``count`` windows from
  ``first[i]``, which include every window touching it, and the operand rows
  they read, ``[first[i]*s - lo, first[i]*s - lo + span)``; its rows start at
  ``offset[i]`` of that span.

  Returns:
    ``(first [grid], count, op_starts [grid], span, offset [grid])``.
  """
  k, s, lo = geo.window[a], geo.strides[a], geo.padding[a][0]
  block, grid = plan.block[a], plan.grid[a]
  row0 = np.arange(grid, dtype=np.int64) * block
  # Windows ending at or after the box's first row start at or after this one.
  first = np.maximum((row0 + lo - (k - 1)) // s, 0)
  past = (row0 + block - 1 + lo) // s + 1  # windows starting at or before its last row
  covers = ceil_div(row0 + block - k + lo - first * s, s) + 1  # span reaching its last row
  count = int(max(1, np.max(past - first), np.max(covers)))
  op_starts = first * s - lo
  return first, count, op_starts, (count - 1) * s + k, row0 - op_starts
