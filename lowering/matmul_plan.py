"""Matmul planning: how a batched matrix product is cut over the tiles.

Like poplin's planner, a product ``[B, M, K] x [B, K, N]`` is partitioned into
a grid of ``gb x gm x gn x gk`` blocks, one per tile (``gb*gm*gn*gk <=
num_tiles``). Tile ``(ib, im, in, ik)`` receives the A block ``[bb, bm, bk]``
and the B block ``[bb, bk, bn]`` and multiplies them on its AMP unit into a
partial block ``[bb, bm, bn]`` held in the partials type. When ``gk > 1`` the
``gk`` partials of each output block are then exchanged and summed: each of the
``gk`` tiles of the group reduces ``1/gk`` of the block (a reduce-scatter), so
the output ends up spread over every tile of the grid.

The cost of a candidate, per tile (the busiest, whose blocks are full):

* compute: block MACs at the AMP rate (``estimators.matmul_cycles``: fp16 and
  bf16 at the fp16 rate, everything else at the fp32 rate);
* exchange: the bytes of both operand blocks at the exchange bandwidth. The
  planner assumes nothing is already in place (the operands' mappings are not
  known when planning); the emitted supersteps count the exact bytes, so the
  report may show slightly less exchange than the plan;
* reduce, when ``gk > 1``: a second superstep (sync, exchange of ``gk - 1``
  pieces of ``1/gk`` of the block in the partials type, a reduce vertex);
  from ``gk = 16``, poplin's two (from 125, three) stages, a superstep each
  (``MatmulPlan.scatter_stages``, ``lowering/matmul_stages.py``).
  A block with fewer elements than ``gk`` cannot be reduce-scattered (a dot
  of two long vectors has one output element but may want all tiles for its
  contraction): its partials are summed in a tree of 1 to 3 stages, each a
  superstep in which a tile receives and adds ``fan-in - 1`` partial blocks
  (poplin's multi-stage reduction); the stage count with the fewest cycles
  is kept (``MatmulPlan.reduce_fanins``).

MACs are costed by type (``estimators.matmul_cycles``): the IPU has neither a
complex nor a float64 unit, so a complex MAC is four real ones and a float64
MAC the software emulation (see ``kernels/estimators.py``). The operand and
partials types of every matmul and convolution come from
:func:`operand_dtype` and :func:`partials_dtype` here (one rule).

Temporary memory per tile is the two operand blocks plus the partial block
(and, in the reduce stage, the received partials plus the output piece); a plan
must fit in ``available_memory_proportion`` of the tile's SRAM. When no grid
fits, the product is split into serial passes along M or N (poplin's serial
splits): each pass is a smaller product with its own exchange and compute, so
the temporaries shrink and the cycles grow. Pass counts up to the fewest that
fit and a couple past it are searched on both axes, as widely as one pass, and
the fastest plan that fits is kept (:func:`_serial_options`). When even that does not fit, the
plan with the least temporary memory is returned (``fits=False``) and the
program's out-of-memory check reports the tile (on a target of a tile or two
the serial searches may find no grid at all; the single pass always has one).
A serialised matmul (``serial=``) asks for a number of passes whatever
fits (a multiple of it when a piece must be cut again), its passes chosen to
cut the temporaries below the unserialised plan's (:func:`_forced_serial`,
:func:`_serial_budget`).

The search is vectorised: for each of ``B, M, N, K`` a modest set of split
counts (powers of two, divisors and the full size, deduplicated by the block
size they give) is combined into a grid of candidates evaluated as NumPy
arrays (``lowering/matmul_cost.py``: the split counts and the cost of a
candidate). Plans are cached by shapes, dtypes, target and proportion.

The tile-grid helpers the matmul and convolution rules share once a grid is
chosen (block mappings, storage, exact operand bytes) are in
``lowering/matmul_grid.py``; ``lowering/matmul_emit.py`` emits the supersteps.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.matmul_cost import (ceil_div, evaluate_grid, grid_product,
                                          poplin_reduce_levels, split_candidates, tree_fanins)

__all__ = ["BlockWork", "GridPlan", "MatmulPlan", "block_work", "plan_matmul", "covering",
           "operand_dtype", "partials_dtype", "widen_to_partials"]

# About this many grids are evaluated per plan (a few milliseconds of NumPy).
_SEARCH_BUDGET = 150_000


@dataclasses.dataclass(frozen=True)
class GridPlan:
  """An output cut into a grid of blocks, one per tile (convolutions, pooling).

  Attributes:
    grid: blocks along each axis.
    block: full block size along each axis.
    compute_cycles, exchange_cycles, sync_cycles: estimates for the busiest
      tile.
    exchange_bytes: bytes the busiest tile receives (nothing assumed in place).
    temp_bytes: the busiest tile's temporaries.
    fits: ``temp_bytes`` within the tile memory the plan may use.
    candidates: grids evaluated.
  """

  grid: tuple
  block: tuple
  compute_cycles: float
  exchange_cycles: float
  sync_cycles: float
  exchange_bytes: int
  temp_bytes: int
  fits: bool
  candidates: int = 0

  @property
  def num_tiles(self) -> int:
    return int(np.prod(self.grid, dtype=np.int64))

  @property
  def cycles(self) -> float:
    return self.sync_cycles + self.exchange_cycles + self.compute_cycles


@dataclasses.dataclass(frozen=True)
class BlockWork:
  """Per-tile figures of a grid of AMP block products (``[num_tiles]`` arrays).

  Attributes:
    compute: cycles; scratch: temporary bytes; vertices: vertices per tile.
    flops: of all the blocks (0 for integer products).
  """

  compute: np.ndarray
  scratch: np.ndarray
  vertices: np.ndarray
  flops: int


def block_work(target, tiles: np.ndarray, macs: np.ndarray, cycles: np.ndarray,
               scratch_bytes: np.ndarray, is_float: bool) -> BlockWork:
  """The figures of block products on ``tiles``: each tile's ``cycles`` and
  ``scratch_bytes``, a worker vertex on each of its contexts where it has MACs."""
  compute = np.zeros(target.num_tiles)
  compute[tiles] = cycles
  scratch = np.zeros(target.num_tiles, np.int64)
  scratch[tiles] = scratch_bytes
  vertices = np.zeros(target.num_tiles, np.int64)
  vertices[tiles] = np.where(macs > 0, target.worker_contexts, 0)
  return BlockWork(compute, scratch, vertices, int(2 * macs.sum()) if is_float else 0)


def covering(lo: np.ndarray, hi: np.ndarray, grid: int) -> np.ndarray:
  """``[grid]`` how many items each block needs, given per-item block ranges ``[lo, hi)``."""
  diff = np.zeros(grid + 1, np.int64)
  np.add.at(diff, np.minimum(lo, grid), 1)
  np.add.at(diff, np.minimum(hi, grid), -1)
  return np.cumsum(diff)[:grid]


def operand_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """The type a product of ``lhs_dtype`` and ``rhs_dtype`` is costed in.

  The wider operand sets the AMP rate and the bytes moved (a narrower one is
  converted on the tile). A complex or float64 operand makes the product
  complex or float64 (a real operand of a complex product is costed as
  complex with a zero imaginary part, as the emulation would promote it).
  """
  lhs_dtype, rhs_dtype = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
  if any(d.kind == "c" or (d.kind == "f" and d.itemsize >= 8) for d in (lhs_dtype, rhs_dtype)):
    return np.dtype(np.promote_types(lhs_dtype, rhs_dtype))
  return lhs_dtype if lhs_dtype.itemsize >= rhs_dtype.itemsize else rhs_dtype


def partials_dtype(in_dtype, out_dtype, option: str) -> np.dtype:
  """The partial-sum type of a matmul or convolution: the one rule.

  * Integer and boolean results accumulate in the result type.
  * Complex results accumulate in the result type (complex64 or complex128):
    both halves are kept (the IPU has no complex unit; the cost is that of
    real MACs, see ``estimators.COMPLEX_REAL_MACS``).
  * float64 results accumulate in float64 (emulated in software, see
    ``estimators.FLOAT64_FP32_OPS_PER_MAC``).
  * Other floats accumulate in float32, except that ``option == "float16"``
    (``matmuls.partials_type`` or the op's own ``partials_type``) gives half
    partials to 2-byte float operands with a 2-byte result, as poplin never
    accumulates in a narrower type than the data. Half partials keep the
    operands' format (bf16 data gets bf16 partials: fp16 ones would overflow
    past 65504 where the data does not).

  Args:
    in_dtype: the operand type (see :func:`operand_dtype`).
    out_dtype: the result type.
    option: ``"float32"`` or ``"float16"``.
  """
  in_dtype, out_dtype = np.dtype(in_dtype), np.dtype(out_dtype)
  if out_dtype.kind in "biu":
    return out_dtype
  if out_dtype.kind == "c" or out_dtype.itemsize >= 8:
    return out_dtype
  if option == "float16" and in_dtype.itemsize <= 2 and out_dtype.itemsize <= 2:
    return in_dtype if in_dtype.kind == "f" or in_dtype.name == "bfloat16" else np.dtype(np.float16)
  return np.dtype(np.float32)


def widen_to_partials(x, acc):
  """``x`` in the partials type ``acc`` when it is a narrower float (exact).

  The executor multiplies in the partials type. Handing XLA:CPU narrow
  operands with a wider ``preferred_element_type`` is not always runnable: a
  bfloat16 x bfloat16 -> float32 ``dot_general`` whose batch dimensions are
  not leading fails at execution (``DotThunk``: "Unsupported element type"),
  though ``jax.jit`` runs the same dot with a bfloat16 result by computing
  it in float32. Widening first is that computation: converting a 2-byte (or
  FP8) float to float32 is exact, and so is the product of two of them, so
  only the order of the float32 sums can differ. Other operands (integers,
  float32, complex, half partials) are returned unchanged.
  """
  acc = np.dtype(acc)
  dtype = np.dtype(x.dtype)
  if acc == np.float32 and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return x.astype(acc)
  return x


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
  """How a ``[B, M, K] x [B, K, N]`` product is cut over tiles.

  Attributes:
    b, m, n, k: the canonical problem size.
    dtype: operand dtype name; partials_dtype: partial sums' dtype name.
    grid: ``(gb, gm, gn, gk)`` blocks along each dimension; tile
      ``((ib * gm + im) * gn + in) * gk + ik`` of the grid holds block
      ``(ib, im, in, ik)``.
    block: ``(bb, bm, bn, bk)`` full block sizes (edge blocks may be smaller).
    compute_cycles: the busiest tile's block-matmul cycles.
    exchange_cycles: cycles to bring the operand blocks in (nothing assumed in
      place).
    reduce_cycles: sync + exchange + compute of the partials reduction
      (0 when ``gk == 1``).
    sync_cycles: sync of the matmul superstep.
    exchange_bytes: bytes the busiest tile receives for its operand blocks.
    reduce_bytes: bytes the busiest tile receives in the reduction.
    temp_bytes: temporary bytes per tile (operand blocks + partials, or the
      reduce stage's buffers if larger).
    memory_limit: ``available_memory_proportion * bytes_per_tile``.
    fits: whether ``temp_bytes <= memory_limit``.
    candidates: how many grids were evaluated.
    serial: passes the product is done in (1 unless no single-pass plan fits
      in memory); each pass computes ``1/serial`` of the ``serial_axis``
      (``"m"`` or ``"n"``) with the grid and blocks above, so the cycle
      fields are totals over the passes and the byte fields are per pass.
    reduce_fanins: empty when the ``gk`` partials of a block are
      reduce-scattered (every tile of the group sums a piece); else the
      fan-in of each stage of a tree reduction, used when a block has fewer
      elements than ``gk`` (a long contraction with a tiny result: poplin's
      multi-stage reduction). The result then lies on the group's first tile.
  """

  b: int
  m: int
  n: int
  k: int
  dtype: str
  partials_dtype: str
  grid: tuple
  block: tuple
  compute_cycles: float
  exchange_cycles: float
  reduce_cycles: float
  sync_cycles: float
  exchange_bytes: int
  reduce_bytes: int
  temp_bytes: int
  memory_limit: int
  fits: bool
  candidates: int = 0
  serial: int = 1
  serial_axis: str = "n"
  reduce_fanins: tuple = ()

  @property
  def num_tiles(self) -> int:
    """Tiles the grid occupies."""
    gb, gm, gn, gk = self.grid
    return gb * gm * gn * gk

  @property
  def cycles(self) -> float:
    """Estimated cycles of the whole matmul (both supersteps)."""
    return self.sync_cycles + self.exchange_cycles + self.compute_cycles + self.reduce_cycles

  @property
  def scatter_stages(self) -> tuple:
    """Partials a block has left after each stage of its reduce-scatter (``(1,)``: one stage).

    poplin's multi-stage reduction, two stages from ``gk = 16``
    (:func:`~ipu_jax.lowering.matmul_cost.poplin_reduce_levels`); ``()``
    without a reduce-scatter (``gk == 1`` or a tree reduction).
    """
    return () if self.reduce_fanins else poplin_reduce_levels(self.grid[3])

  @property
  def label(self) -> str:
    """A short name, e.g. ``grid b1.m8.n8.k16 blocks 1x128x128x64``."""
    gb, gm, gn, gk = self.grid
    bb, bm, bn, bk = self.block
    serial = f" serial {self.serial_axis}x{self.serial}" if self.serial > 1 else ""
    tree = (f" tree {'x'.join(str(f) for f in self.reduce_fanins)}"
            if self.reduce_fanins else "")
    return f"grid b{gb}.m{gm}.n{gn}.k{gk} blocks {bb}x{bm}x{bn}x{bk}{serial}{tree}"

  def describe(self) -> str:
    """A one-paragraph account of the plan, for reports and logs."""
    return (f"matmul [{self.b}x{self.m}x{self.k}] x [{self.b}x{self.k}x{self.n}] "
            f"{self.dtype} (partials {self.partials_dtype}): {self.label} on "
            f"{self.num_tiles} tiles; cycles {self.cycles:,.0f} = compute "
            f"{self.compute_cycles:,.0f} + exchange {self.exchange_cycles:,.0f} + sync "
            f"{self.sync_cycles:,.0f} + reduce {self.reduce_cycles:,.0f}; temporary "
            f"memory {self.temp_bytes:,d} B per tile of {self.memory_limit:,d} B allowed"
            f"{'' if self.fits else ' (does not fit)'}.")


def plan_matmul(target: IPUTarget, b: int, m: int, n: int, k: int, dtype,
                partials_dtype=np.float32, available_memory_proportion: float = 0.6,
                max_tiles: Optional[int] = None, tree_reduce: bool = True,
                serial: Optional[tuple] = None) -> MatmulPlan:
  """Choose how a ``[b, m, k] x [b, k, n]`` product is cut over tiles.

  Args:
    target: the IPU target.
    b, m, n, k: batch, rows, columns and contraction size.
    dtype: operand dtype (sets the AMP rate and operand bytes).
    partials_dtype: dtype of the partial sums.
    available_memory_proportion: fraction of a tile's SRAM the plan's
      temporaries may use.
    max_tiles: use at most this many tiles (default: all of the target).
    tree_reduce: whether the lowering sums a reduce group with fewer output
      elements than tiles in a tree (``dot_general``); else such groups are
      costed as the reduce-scatter the lowering then emits.
    serial: ``(axis, count)`` with axis ``"m"`` or ``"n"``: do the product
      in ``count`` serial passes along that axis (a serialised matmul,
      :mod:`ipu_jax.ops.serialized_matmul`), each piece cut again into as few
      equal passes as fit when it does not, the passes' grid chosen by
      :func:`_serial_budget`; None: passes only when no single pass fits.

  Returns:
    The cheapest :class:`MatmulPlan` that fits, in one pass when one fits,
    else in the fewest serial passes found to fit; when nothing fits, the one
    with the least temporary memory per tile.
  """
  if serial is not None:
    axis, count = serial
    if axis not in ("m", "n") or int(count) < 1:
      raise ValueError(f"serial must be ('m' or 'n', count >= 1), got {serial!r}")
    serial = (axis, int(count)) if int(count) > 1 else None
  return _plan_cached(target, int(b), int(m), int(n), int(k), np.dtype(dtype).name,
                      np.dtype(partials_dtype).name, float(available_memory_proportion),
                      target.num_tiles if max_tiles is None else int(max_tiles),
                      bool(tree_reduce), serial)


# Serial splits tried when no single-pass plan fits (poplin's serial splits).
_SERIAL_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _search(target, b, m, n, k, dtype, p_itemsize, limit, budget_total,
            serial_axis=None, last=0, tree_reduce=True):
  """Candidate grids for one pass of ``[b, m, k] x [b, k, n]`` and their costs.

  With serial passes, the last pass (``last`` long along ``serial_axis``) must
  still fill the first block, so that tile storage has the width of a full
  tile's pieces; and a reduce group must have an output element per tile (no
  tree reductions: those are for results too small to need passes). The
  result may hold no candidate at all (on a target of a tile or two).
  """
  active = sum(d > 1 for d in (b, m, n, k))
  budget = max(4, int(budget_total ** (1.0 / max(active, 1))))
  lists = [split_candidates(d, limit, budget) for d in (b, m, n, k)]
  gb, gm, gn, gk = grid_product(lists, limit)
  keep = np.ones(gk.shape, bool)
  if serial_axis is not None:
    keep &= gk <= ceil_div(b, gb) * ceil_div(m, gm) * ceil_div(n, gn)
  if serial_axis == "m":
    keep &= ceil_div(m, gm) <= last
  elif serial_axis == "n":
    keep &= ceil_div(n, gn) <= last
  gb, gm, gn, gk = gb[keep], gm[keep], gn[keep], gk[keep]
  costs = evaluate_grid(target, b, m, n, k, dtype, p_itemsize, gb, gm, gn, gk, tree_reduce)
  costs["grid"] = (gb, gm, gn, gk)
  costs["tiles"] = gb * gm * gn * gk
  return costs


def _serial_option(target, b, m, n, k, operand, p_itemsize, limit, axis, count, budget):
  """``(count, axis, costs)`` of ``count`` equal passes along ``axis`` (the last may be short)."""
  size = m if axis == "m" else n
  length = int(ceil_div(size, count))
  pm, pn = (length, n) if axis == "m" else (m, length)
  return (count, axis, _search(target, b, pm, pn, k, operand, p_itemsize, limit, budget, axis,
                               size - (count - 1) * length))


def _serial_budget(plain: MatmulPlan, count: int, temps: np.ndarray, memory_limit: int) -> int:
  """The temporaries a forced serialisation's passes are chosen within.

  A serialised product is asked for to cut the working memory about
  ``count``-fold (TF-IPU and PopTorch document serialisation as trading
  cycles for memory): its passes take the fastest grid within ``1/count`` of
  what the unserialised plan holds per tile or, when no grid of a pass is
  that small (block faces shrink as the two-thirds power of a tile's work),
  within 10 % of the smallest a pass can hold; never above the available
  memory proportion when anything fits it.
  """
  budget = max(plain.temp_bytes // count, int(1.1 * temps.min()))
  return min(budget, memory_limit) if (temps <= memory_limit).any() else budget


def _forced_serial(target, b, m, n, k, operand, p_itemsize, limit, axis, factor,
                   memory_limit, wanted) -> list:
  """``(count, axis, costs)`` options of a forced serialisation: ``factor`` pieces, each
  cut again into equal passes (poplin plans each piece as a matmul of its own).

  Pass counts rise until a grid holds at most ``wanted`` bytes (the
  temporaries the serialisation is asked to reach, :func:`_serial_budget`)
  within the available memory, and :data:`_SERIAL_LOOKAHEAD` counts past it:
  stopping at the fewest passes that merely fit kept the unserialised plan's
  temporaries, or more, where that plan already needs serial passes. Empty
  when no grid exists (a tile or two).
  """
  size = m if axis == "m" else n
  options, lookahead = [], _Lookahead()
  for times in (1,) + _SERIAL_COUNTS:
    count = factor * times
    if count > size:
      break
    option = _serial_option(target, b, m, n, k, operand, p_itemsize, limit, axis, count,
                            _SEARCH_BUDGET)
    if option[2]["cycles"].size == 0:
      continue
    options.append(option)
    if lookahead.done((option[2]["temp"] <= min(wanted, memory_limit)).any()):
      break
  return options


# Pass counts tried past the fewest that fit: more passes can be faster when the
# fewest that fit leave only a grid with a costly partials reduction.
_SERIAL_LOOKAHEAD = 2


class _Lookahead:
  """Stops a search over rising pass counts :data:`_SERIAL_LOOKAHEAD` counts after
  the first that fits."""

  def __init__(self):
    self.left = None

  def done(self, fits: bool) -> bool:
    """Records one more count (``fits``: whether it fits); True when the search stops."""
    if self.left is not None:
      self.left -= 1
    elif fits:
      self.left = _SERIAL_LOOKAHEAD
    return self.left == 0


def _serial_options(target, b, m, n, k, operand, p_itemsize, limit, memory_limit) -> list:
  """Serial splits of a product no single pass of which fits (poplin's serial splits).

  Both axes are tried at each count of :data:`_SERIAL_COUNTS` up to the
  fewest passes found to fit, and :data:`_SERIAL_LOOKAHEAD` counts past it,
  each searched as widely as a single pass: the caller keeps the fastest
  that fits. (Stopping at the first count that fits, with a coarser search,
  left faster plans to a serialised matmul: two passes over M or four over N
  of a ``[1024, 1024] x [1024, 30522]`` fp16 product beat the three passes
  over N it chose.)
  """
  options, tried, lookahead = [], set(), _Lookahead()
  for count in _SERIAL_COUNTS:
    for axis, size in (("n", n), ("m", m)):
      # Passes of equal length; a count giving the same length is the same plan.
      count_ = int(ceil_div(size, ceil_div(size, count)))
      if count_ > 1 and (axis, count_) not in tried:
        tried.add((axis, count_))
        options.append(_serial_option(target, b, m, n, k, operand, p_itemsize, limit, axis,
                                      count_, _SEARCH_BUDGET))
    if lookahead.done(any((c["temp"] <= memory_limit).any() for _, _, c in options)):
      break
  return options


@functools.lru_cache(maxsize=1024)
def _plan_cached(target, b, m, n, k, dtype, partials_dtype, proportion, max_tiles,
                 tree_reduce, serial=None):
  operand = np.dtype(dtype)
  p_itemsize = np.dtype(partials_dtype).itemsize
  limit = max(1, min(max_tiles, target.num_tiles))
  memory_limit = int(proportion * target.bytes_per_tile)
  if min(b, m, n, k) <= 0:
    return MatmulPlan(b, m, n, k, dtype, partials_dtype, (1, 1, 1, 1),
                      (max(b, 0), max(m, 0), max(n, 0), max(k, 0)), 0.0, 0.0, 0.0,
                      0.0, 0, 0, 0, memory_limit, True, 0)
  # One pass if any grid fits; else split M or N into serial passes that each
  # fit (each pass re-exchanges its operand blocks: more cycles, less memory).
  # A forced serialisation searches only its own passes.
  options = []
  if serial is not None:
    plain = _plan_cached(target, b, m, n, k, dtype, partials_dtype, proportion, max_tiles,
                         tree_reduce)
    options = _forced_serial(target, b, m, n, k, operand, p_itemsize, limit, serial[0],
                             serial[1], memory_limit, plain.temp_bytes // serial[1])
    if not options:  # no grid for the passes (a tile or two)
      serial = None
  if not options:
    options = [(1, "n", _search(target, b, m, n, k, operand, p_itemsize, limit, _SEARCH_BUDGET,
                                tree_reduce=tree_reduce))]
  if serial is None and not (options[0][2]["temp"] <= memory_limit).any():
    options += _serial_options(target, b, m, n, k, operand, p_itemsize, limit, memory_limit)
  choose_limit = memory_limit
  if serial is not None:
    temps = np.concatenate([c["temp"] for _, _, c in options])
    choose_limit = _serial_budget(plain, serial[1], temps, memory_limit)
  best = None
  for count, axis, costs in options:
    if costs["cycles"].size == 0:
      continue
    cycles = costs["cycles"] * count
    fits = costs["temp"] <= choose_limit
    if fits.any():
      order = np.lexsort((costs["tiles"], costs["temp"], np.where(fits, cycles, np.inf)))
      key = (0, float(cycles[order[0]]), float(costs["temp"][order[0]]))
    else:
      order = np.lexsort((costs["tiles"], cycles, costs["temp"]))
      key = (1, float(costs["temp"][order[0]]), float(cycles[order[0]]))
    if best is None or key < best[0]:
      best = (key, count, axis, costs, int(order[0]))
  _, count, axis, costs, i = best
  gb, gm, gn, gk = costs["grid"]
  block = tuple(int(x[i]) for x in costs["block"])
  return MatmulPlan(
      b=b, m=m, n=n, k=k, dtype=dtype, partials_dtype=partials_dtype,
      grid=(int(gb[i]), int(gm[i]), int(gn[i]), int(gk[i])), block=block,
      compute_cycles=count * float(costs["compute"][i]),
      exchange_cycles=count * float(costs["exchange"][i]),
      reduce_cycles=count * float(costs["reduce"][i]),
      sync_cycles=count * float(target.sync_cycles_internal),
      exchange_bytes=int(costs["exchange_bytes"][i]),
      reduce_bytes=int(costs["reduce_bytes"][i]),
      temp_bytes=int(costs["temp"][i]), memory_limit=memory_limit,
      fits=int(costs["temp"][i]) <= memory_limit, candidates=int(sum(c["grid"][0].size for _, _, c in options)),
      serial=count, serial_axis=axis,
      reduce_fanins=(tree_fanins(int(gk[i]), int(costs["tree_stages"][i]))
                     if costs["tree_stages"][i] else ()))
