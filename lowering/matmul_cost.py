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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels.target import IPUTarget

__all__ = ["bus_shared_fraction", "ceil_div", "evaluate_grid", "grid_product",
           "scatter_reduce_cost", "split_candidates", "tree_fanins"]


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


def scatter_reduce_cost(target, gk, out_block, p_itemsize) -> tuple:
  """A reduce-scatter of ``gk`` partial blocks (arrays over candidates; 0 where ``gk == 1``).

  Each of the ``gk`` tiles sharing an output block receives its piece of the
  other ``gk - 1`` partials and sums them (a superstep: sync, exchange,
  poplin's ``ReduceAdd`` vertex, ``estimators.partials_reduce_cycles``). Used by
  the matmul and convolution planners.

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
  return reduce, reduce_bytes, stage2


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
  reduce, reduce_bytes, stage2 = scatter_reduce_cost(target, gk, out_block, p_itemsize)
  tree_stages = np.zeros(gk.shape, np.int64)
  deep = (gk > out_block) & tree_reduce
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
