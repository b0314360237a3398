"""The cost of a matmul plan's candidate grids, evaluated as NumPy arrays.

For each of ``B, M, N, K`` a modest set of split counts
(:func:`split_candidates`: powers of two, divisors and the full size,
deduplicated by the block size they give) is combined into candidate grids
(:func:`grid_product`), and :func:`evaluate_grid` prices them all at once, per
tile (the busiest, whose blocks are full): the block MACs on the AMP unit
(``estimators.matmul_cycles``), both operand blocks at the exchange bandwidth
(the A block at twice it when an even N split lets exchange-bus pairs share
it, as poplin's planner prices it), and, when ``gk > 1``, the reduction of the partials (a reduce-scatter, or a
tree of 1 to 3 stages, :func:`tree_fanins`, for blocks with fewer elements
than ``gk``), with the temporary memory each stage holds. The search over
these costs, and the serial passes, are ``lowering/matmul_plan.py``'s; the
window (convolution) planner reuses the split counts.

A reduce-scatter of 16 or more partials runs in poplin's stages
(:func:`poplin_reduce_levels`, :func:`staged_scatter_figures`): each stage
sums sections of partials, a section's sum spread over its tiles, and
the last stage leaves ``1/gk`` of the block on every tile, as one stage does.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering import plan_cache

__all__ = ["bus_shared_fraction", "ceil_div", "evaluate_grid", "grid_product",
           "balanced_bounds", "poplin_reduce_levels", "scatter_reduce_cost",
           "split_candidates", "stage_layout", "staged_scatter_figures", "tree_fanins"]


def ceil_div(a, b):
  """``ceil(a / b)`` for non-negative integers (works on arrays)."""
  return -(-a // b)


def _divisors(d: int) -> list:
  small = [i for i in range(1, int(d ** 0.5) + 1) if d % i == 0]
  return sorted(set(small + [d // i for i in small]))


def split_candidates(d: int, limit: int, budget: int = 64,
                     aligned_only: bool = False) -> np.ndarray:
  """Split counts worth trying for a dimension of size ``d``.

  Every count from 1 to ``limit`` is merged into the smallest grid giving the
  same block size (``ceil(d / ceil(d / g))``; those cost the same). When more
  than ``budget`` remain, the divisors of ``d`` (no ragged blocks) and the
  powers of two are kept first and the rest are sampled log-spaced.

  Args:
    d: dimension size.
    limit: the most blocks wanted (usually the tile count).
    budget: the most counts returned.
    aligned_only: only divisors of ``d`` (every block the same size).
  """
  limit = max(1, min(int(d), int(limit)))
  if d <= 1:
    return np.array([1], np.int64)
  if aligned_only:
    values = np.array([g for g in _divisors(d) if g <= limit], np.int64)
  else:
    g = np.arange(1, limit + 1, dtype=np.int64)
    values = np.unique(ceil_div(d, ceil_div(d, g)))
  if values.size <= budget:
    return values
  preferred = {g for g in _divisors(d) if g <= limit}
  preferred |= {1 << p for p in range(limit.bit_length()) if (1 << p) <= limit}
  preferred = {int(ceil_div(d, ceil_div(d, g))) for g in preferred} | {int(values[-1])}
  preferred = np.array(sorted(preferred), np.int64)
  if preferred.size >= budget:
    pick = np.unique(np.round(np.geomspace(1, preferred.size, budget)).astype(int) - 1)
    return preferred[pick]
  rest = np.setdiff1d(values, preferred)
  pick = np.unique(np.round(np.geomspace(1, rest.size, budget - preferred.size)).astype(int) - 1)
  return np.union1d(preferred, rest[pick])


def grid_product(lists: Sequence[np.ndarray], limit: int) -> list:
  """All combinations of per-dimension split counts whose product fits.

  Returns:
    One flat array per dimension, of equal length.
  """
  mesh = np.meshgrid(*lists, indexing="ij")
  flat = [g.reshape(-1) for g in mesh]
  total = np.ones_like(flat[0])
  for g in flat:
    total = total * g
  keep = total <= limit
  return [g[keep] for g in flat]


def _exchange_cycles(target: IPUTarget, nbytes: np.ndarray) -> np.ndarray:
  nbytes = np.asarray(nbytes, np.float64)
  return np.where(nbytes > 0, nbytes / target.exchange_bytes_per_cycle
                  + target.exchange_latency_cycles, 0.0)


def bus_shared_fraction(target: IPUTarget, out_split) -> np.ndarray:
  """The share of an input block's receive time (arrays over candidates): 1 / bus or 1.

  Poplin's ExchangeEstimator (lib/poplin/ExchangeEstimator.hpp, the
  constructor and getInputElementCycles) receives input elements at
  ``exchangeBytesPerCycle * 2`` when ``outChanSplit.parallel %
  getTilesPerSharedExchangeBus() == 0``: its tile order
  (``linearizeConvIndices``) puts the output-channel split innermost, so the
  two tiles of a bus need the same input block. Both emitters lay their grids
  out the same way (``matmul_grid.bus_pair_tile_order``): for a matmul,
  ``out_split`` is the N split (poplin's output channels; A its input); for
  a convolution, the feature split within a group (poplin's conv groups are
  a split of their own, outside it).
  """
  bus = target.tiles_per_exchange_bus
  return np.where(np.asarray(out_split) % bus == 0, 1.0 / bus, 1.0)


def tree_fanins(gk: int, stages: int) -> tuple:
  """Fan-in of each stage of a tree reduction of ``gk`` partials in ``stages``.

  Every stage but the last sums groups of ``f = ceil(gk ** (1/stages))``
  partials (fewer stages when ``f`` already covers ``gk``).
  """
  f = max(2, int(np.ceil(gk ** (1.0 / stages))))
  while f ** stages < gk:
    f += 1
  fanins, count = [], int(gk)
  while count > 1:
    fanins.append(min(f, count))
    count = ceil_div(count, f)
  return tuple(fanins)


# Stages a tree reduction may take (each costs a sync).
_TREE_STAGES = (1, 2, 3)


def _tree_reduce_cost(target, gk, out_block, p_itemsize, stages):
  """Cycles and largest received bytes of a tree reduction (arrays over candidates).

  Stage ``s`` sums groups of ``f`` partial blocks on the tile of the group's
  first: that tile receives ``f - 1`` blocks, adds them, and holds the sum
  for the next stage (the last writes the result).
  """
  gk = np.asarray(gk, np.int64)
  f = np.maximum(2, np.ceil(gk ** (1.0 / stages)).astype(np.int64))
  f = np.where(f ** stages < gk, f + 1, f)
  count = gk.copy()
  cycles = np.zeros(gk.shape, np.float64)
  received = np.zeros(gk.shape, np.int64)
  for _ in range(stages):
    members = np.minimum(f, count)
    active = count > 1
    nbytes = (members - 1) * out_block * p_itemsize
    stage = (target.sync_cycles_internal + _exchange_cycles(target, nbytes)
             + estimators.partials_reduce_cycles(target, members * out_block, p_itemsize,
                                                 outputs=out_block))
    cycles += np.where(active, stage, 0.0)
    received = np.maximum(received, np.where(active, nbytes, 0))
    count = ceil_div(count, f)
  return cycles, received


# poplin's reduction stages by depth (lib/poplin/ConvReducePlan.cpp getNumReduceStages,
# lines 20-26 at poplibs 7eac0f2): 3 from 125 partials, 2 from 16, else 1.
_POPLIN_STAGE_DEPTHS = ((125, 3), (16, 2))


def _poplin_stage_depths(depth: int, stages: int) -> tuple:
  """poplin's intermediate partials depths and their cost (ConvReducePlan.cpp 36-57).

  ``getMultiStageReducePlanAndCost``: the next depth is ``depth ** ((n-1)/n)``
  truncated, or one more, whichever gives fewer messages a tile (``depth /
  next`` plus the rest's), costs in float as poplin computes them.
  """
  if stages == 1:
    return (), np.float32(depth)
  down = int(math.pow(float(depth), (stages - 1.0) / stages))
  plan_down, cost_down = _poplin_stage_depths(down, stages - 1)
  plan_up, cost_up = _poplin_stage_depths(down + 1, stages - 1)
  cost_down = np.float32(cost_down + np.float32(depth) / np.float32(down))
  cost_up = np.float32(cost_up + np.float32(depth) / np.float32(down + 1))
  if cost_down < cost_up:
    return (down,) + plan_down, cost_down
  return (down + 1,) + plan_up, cost_up


def poplin_reduce_levels(gk: int) -> tuple:
  """Partials an output block has left after each stage of poplin's reduction of ``gk``.

  poplin reduces a depth of 16 or more in two stages, 125 or more in three
  (lib/poplin/ConvReducePlan.cpp 20-26), through the intermediate depths of
  its plan (36-57), then to one. E.g. 18: ``(4, 1)``: four sections of the
  18 partials (4, 5, 4 and 5: ``balanced_bounds``, as
  lib/poplin/ConvReduce.cpp 160-162 cuts them), then their 4 sums.

  Returns:
    ``()`` for ``gk <= 1``; ``(1,)`` for one stage.
  """
  gk = int(gk)
  if gk <= 1:
    return ()
  stages = next((s for depth, s in _POPLIN_STAGE_DEPTHS if gk >= depth), 1)
  return tuple(_poplin_stage_depths(gk, stages)[0]) + (1,)


def balanced_bounds(count: int, groups: int) -> np.ndarray:
  """``[groups + 1]`` bounds of ``groups`` consecutive sections of ``count``: ``i * count // groups``.

  poplin's ``partialGroupedReduce`` cuts a stage's partials and the group's
  tiles this way (lib/poplin/ConvReduce.cpp 160-165).
  """
  return (np.arange(groups + 1) * int(count)) // int(groups)


def _section_of(bounds: np.ndarray, index: np.ndarray) -> np.ndarray:
  return np.searchsorted(bounds, index, side="right") - 1


def stage_layout(gk: int, old: int, new: int) -> dict:
  """Where each of the ``gk`` k-tiles stands in a stage reducing ``old`` partials to ``new``.

  The ``old`` partials of a block are items, each on a section of the
  k-tiles (``balanced_bounds(gk, old)``), its sum cut into equal pieces over
  them in order; the stage sums sections of them (``balanced_bounds(old,
  new)``) into ``new`` items laid out the same way.

  Returns:
    ``[gk]`` arrays: ``old_tiles`` / ``old_pos`` (tiles of the k-tile's item
    and its place in it), ``new_tiles`` / ``new_pos``, ``group`` (its new
    item), ``members`` (items that item sums), ``own`` (whether its own item
    is one of them), ``dest`` (the new item its own item goes into).
  """
  t = np.arange(gk)
  a_old, a_new, c = balanced_bounds(gk, old), balanced_bounds(gk, new), balanced_bounds(old, new)
  old_item, group = _section_of(a_old, t), _section_of(a_new, t)
  dest = _section_of(c, old_item)
  return dict(old_tiles=np.diff(a_old)[old_item], old_pos=t - a_old[old_item],
              new_tiles=np.diff(a_new)[group], new_pos=t - a_new[group], group=group,
              members=np.diff(c)[group], own=dest == group, dest=dest)


def staged_scatter_figures(target, gk: int, levels: tuple, block, p_itemsize: int,
                           final_lengths=None) -> list:
  """Per-tile figures of a reduce-scatter of ``gk`` partials through ``levels``.

  Stage ``s`` reduces the block's ``levels[s-1]`` partials (``gk`` at first,
  a whole partial block a tile) to ``levels[s]`` (:func:`stage_layout`):
  k-tile ``t`` receives its piece of its new item from every item summed
  into it, less what it holds of it itself, and adds them (poplin's
  ``partialGroupedReduce``, lib/poplin/ConvReduce.cpp 145-180). After the
  last stage (one item) k-tile ``t`` holds piece ``t`` of ``ceil(block /
  gk)``, the layout of a one-stage reduce-scatter.

  Args:
    target: the IPU target.
    gk: partials per output block.
    levels: partials left after each stage (:func:`poplin_reduce_levels`).
    block: ``[...]`` output block elements (arrays over candidates or groups).
    p_itemsize: bytes of a partial.
    final_lengths: ``[..., gk]`` result elements each k-tile writes, when its
      last piece is short of a full block's (edge blocks); default the full.

  Returns:
    One dict a stage: :func:`stage_layout`'s arrays and ``[..., gk]``
    ``bytes_in``, ``bytes_out``, ``compute`` (ReduceAdd cycles),
    ``outputs``, ``lo`` (each piece's first element), ``piece``.
  """
  block = np.asarray(block, np.int64)[..., None]
  stages, old = [], gk
  for index, new in enumerate(levels):
    lay = stage_layout(gk, old, new)
    q_old, q_new = ceil_div(block, lay["old_tiles"]), ceil_div(block, lay["new_tiles"])
    p_lo = np.minimum(lay["old_pos"] * q_old, block)
    p_hi = np.minimum((lay["old_pos"] + 1) * q_old, block)
    r_lo = np.minimum(lay["new_pos"] * q_new, block)
    r_hi = np.minimum((lay["new_pos"] + 1) * q_new, block)
    if final_lengths is not None and index == len(levels) - 1:
      r_hi = r_lo + np.asarray(final_lengths, np.int64)
    length = r_hi - r_lo
    overlap = np.where(lay["own"], np.maximum(0, np.minimum(p_hi, r_hi) - np.maximum(p_lo, r_lo)),
                       0)
    compute = np.where(length > 0, estimators.partials_reduce_cycles(
        target, lay["members"] * length, p_itemsize, outputs=length), 0.0)
    stages.append(dict(lay, bytes_in=(lay["members"] * length - overlap) * p_itemsize,
                       bytes_out=(p_hi - p_lo - overlap) * p_itemsize, compute=compute,
                       outputs=length, lo=r_lo, held_lo=p_lo, held_hi=p_hi,
                       piece=np.broadcast_to(q_new, length.shape)))
    old = new
  return stages


_STAGED_COSTS = plan_cache.PlanCache("staged reduce-scatter costs", max_entries=4096)


def _staged_scatter_cost(target, gk_value: int, out_block, p_itemsize) -> tuple:
  """``(cycles, received bytes, reduce temporary bytes)`` of a staged reduce-scatter.

  Each stage is a superstep (sync, exchange of the busiest tile's bytes in or
  out, the busiest tile's ReduceAdd), as :mod:`lowering.matmul_stages` emits it.
  Every figure is a function of one candidate's block size, so the costs are
  found for the distinct sizes and kept: the planner meets the same sizes
  for every grid of a depth over a model's matmuls (BERT-Large's phase-2
  estimate: 3,294 evaluations, 61 % of them of sizes already costed).
  """
  blocks, inverse = np.unique(np.asarray(out_block, np.int64), return_inverse=True)
  key = (target, int(gk_value), int(p_itemsize), plan_cache.array_key(blocks))
  costs = plan_cache.cached(_STAGED_COSTS, key,
                            lambda: _staged_costs(target, int(gk_value), blocks, p_itemsize))
  shape = np.shape(out_block)
  return tuple(c[inverse].reshape(shape) for c in costs)


def _staged_costs(target, gk_value: int, out_block: np.ndarray, p_itemsize) -> tuple:
  """:func:`_staged_scatter_cost` of the blocks ``out_block`` (uncached, read-only)."""
  stages = staged_scatter_figures(target, gk_value, poplin_reduce_levels(gk_value), out_block,
                                  p_itemsize)
  cycles = np.zeros(np.shape(out_block))
  received = np.zeros(np.shape(out_block), np.int64)
  held = np.zeros(np.shape(out_block), np.int64)
  for stage in stages:
    busiest = np.maximum(stage["bytes_in"], stage["bytes_out"]).max(axis=-1)
    cycles = cycles + (target.sync_cycles_internal + _exchange_cycles(target, busiest)
                       + stage["compute"].max(axis=-1))
    stage_in = stage["bytes_in"].max(axis=-1)
    received = np.maximum(received, stage_in)
    held = np.maximum(held, stage_in + stage["piece"].max(axis=-1) * p_itemsize)
  for table in (cycles, received, held):
    table.setflags(write=False)
  return cycles, received, held


def _apply_staged_scatter(target, gk, out_block, p_itemsize, staged, costs) -> tuple:
  """Replace the one-stage reduce-scatter's costs where ``staged`` (poplin reduces in stages)."""
  reduce, reduce_bytes, stage2 = costs
  reduce = np.array(reduce, np.float64)
  reduce_bytes = np.array(reduce_bytes, np.int64)
  stage2 = np.array(stage2, np.int64)
  for value in np.unique(gk[staged]):
    sel = staged & (gk == value)
    cycles, received, held = _staged_scatter_cost(target, int(value), out_block[sel], p_itemsize)
    reduce[sel] = cycles
    reduce_bytes[sel] = received
    stage2[sel] = out_block[sel] * p_itemsize + held
  return reduce, reduce_bytes, stage2


def scatter_reduce_cost(target, gk, out_block, p_itemsize, staged=None) -> tuple:
  """A reduce-scatter of ``gk`` partial blocks (arrays over candidates; 0 where ``gk == 1``).

  Each of the ``gk`` tiles sharing an output block receives its piece of the
  other ``gk - 1`` partials and sums them (a superstep: sync, exchange,
  poplin's ``ReduceAdd`` vertex, ``estimators.partials_reduce_cycles``); 16
  or more partials are reduced in poplin's stages, a superstep each
  (:func:`poplin_reduce_levels`, :func:`staged_scatter_figures`), as
  ``lowering/matmul_stages.py`` emits them. Used by the matmul and
  convolution planners (poplin plans both reductions alike: a matmul is its
  1x1 convolution).

  Args:
    target: the IPU target.
    gk: partials per output block (arrays over candidates).
    out_block: output block elements.
    p_itemsize: bytes of a partial.
    staged: where poplin's stages may apply (default everywhere; the
      matmul planner excludes its tree reductions).

  Returns:
    ``(cycles, received bytes, temporary bytes of the reducing stage)``.
  """
  gk = np.asarray(gk, np.int64)
  piece = ceil_div(out_block, gk)
  partial_bytes = out_block * p_itemsize
  reduce_bytes = np.where(gk > 1, (gk - 1) * piece * p_itemsize, 0)
  reduce_compute = np.where(
      gk > 1, estimators.partials_reduce_cycles(target, gk * piece, p_itemsize, outputs=piece),
      0.0)
  reduce = np.where(gk > 1, target.sync_cycles_internal + _exchange_cycles(target, reduce_bytes)
                    + reduce_compute, 0.0)
  stage2 = np.where(gk > 1, partial_bytes + reduce_bytes + piece * p_itemsize, 0)
  shape = np.broadcast_shapes(np.shape(gk), np.shape(out_block))
  gk, out_block = np.broadcast_to(gk, shape), np.broadcast_to(out_block, shape)
  many = gk >= _POPLIN_STAGE_DEPTHS[-1][0]
  if staged is not None:
    many = many & np.broadcast_to(staged, shape)
  if not many.any():
    return reduce, reduce_bytes, stage2
  one_stage = tuple(np.broadcast_to(x, shape) for x in (reduce, reduce_bytes, stage2))
  return _apply_staged_scatter(target, gk, out_block, p_itemsize, many, one_stage)


def evaluate_grid(target, b, m, n, k, dtype, p_itemsize, gb, gm, gn, gk, tree_reduce=True):
  """Per-candidate costs (arrays over candidates).

  A reduce group with fewer output elements than tiles (``gk`` above the
  block's elements: a long contraction with a tiny result) sums its partials
  in a tree (``tree_stages`` > 0) when ``tree_reduce``; else it is costed as
  a reduce-scatter whose first tiles each receive ``gk - 1`` elements.
  """
  itemsize = dtype.itemsize
  bb, bm, bn, bk = (ceil_div(b, gb), ceil_div(m, gm), ceil_div(n, gn), ceil_div(k, gk))
  macs = bb * bm * bn * bk
  out_block = bb * bm * bn
  compute = estimators.matmul_cycles(target, macs, itemsize, outputs=out_block, dtype=dtype,
                                     k=bk, n=bn, groups=bb, partials_itemsize=p_itemsize)
  a_bytes = bb * bm * bk * itemsize
  b_bytes = bb * bk * bn * itemsize
  partial_bytes = out_block * p_itemsize
  exchange_bytes = a_bytes + b_bytes
  exchange = _exchange_cycles(target, bus_shared_fraction(target, gn) * a_bytes + b_bytes)
  tree_stages = np.zeros(gk.shape, np.int64)
  deep = (gk > out_block) & tree_reduce
  reduce, reduce_bytes, stage2 = scatter_reduce_cost(target, gk, out_block, p_itemsize,
                                                     staged=~deep)
  if deep.any():
    best_cycles = np.full(gk.shape, np.inf)
    best_bytes = np.zeros(gk.shape, np.int64)
    for stages in _TREE_STAGES:
      cycles, received = _tree_reduce_cost(target, gk, out_block, p_itemsize, stages)
      better = deep & (cycles < best_cycles)
      tree_stages = np.where(better, stages, tree_stages)
      best_cycles = np.where(better, cycles, best_cycles)
      best_bytes = np.where(better, received, best_bytes)
    reduce = np.where(deep, best_cycles, reduce)
    reduce_bytes = np.where(deep, best_bytes, reduce_bytes)
    # The summing tile holds its partials, those received and the sum.
    stage2 = np.where(deep, 2 * partial_bytes + best_bytes, stage2)
  stage1 = a_bytes + b_bytes + partial_bytes
  temp = np.maximum(stage1, stage2)
  cycles = target.sync_cycles_internal + exchange + compute + reduce
  return dict(block=(bb, bm, bn, bk), compute=compute, exchange=exchange,
              reduce=reduce, exchange_bytes=exchange_bytes, reduce_bytes=reduce_bytes,
              temp=temp, cycles=cycles, tree_stages=tree_stages)
