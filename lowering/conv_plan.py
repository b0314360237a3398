"""Convolution planning: a ``conv_general_dilated`` cut into a grid of blocks over the tiles.

:func:`conv_geometry` reads a convolution's shapes, dimension numbers,
strides, padding, dilations and groups into a :class:`ConvGeometry` (batch,
groups, input and output features, spatial sizes, windows and halos).
:func:`plan_conv` searches grids over the batch, output features, input
features and the spatial axes, as the matmul planner does (split counts from
``lowering/matmul_cost.py``), pricing each candidate's block MACs on the AMP,
its operand exchange with halos, and its partials reduction, under the
available memory proportion; the cheapest that fits is a :class:`ConvPlan`
(cached by geometry, target and proportion). The rule that emits the plan is
``lowering/rules/convolution.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.lowering.matmul_plan import GridPlan
from ipu_jax.lowering.matmul_cost import (bus_shared_fraction, ceil_div, grid_product,
                                          poplin_reduce_levels, scatter_reduce_cost,
                                          split_candidates)
from ipu_jax.lowering.matmul_grid import edge_sizes

__all__ = ["ConvGeometry", "ConvPlan", "conv_geometry", "plan_conv", "splits_contraction",
           "tap_row_ranges"]


_SEARCH_BUDGET = 100_000


@dataclasses.dataclass(frozen=True)
class ConvGeometry:
  """A convolution in canonical terms (batch, feature, spatial...).

  Attributes:
    n: input batch; n_out: output batch (``n / batch_group_count``).
    c: input features; i: kernel input features (``c / feature_group_count``,
      or ``c`` with batch groups); o: output features.
    in_spatial, k_spatial, out_spatial: spatial sizes.
    strides, padding, lhs_dilation, rhs_dilation: per spatial axis.
    fgc, bgc: feature and batch group counts.
    itemsize, acc_itemsize: operand and partials bytes.
    dtype: operand dtype name (sets the MAC rate: complex and float64
      products are costed as their emulation).
  """

  n: int
  n_out: int
  c: int
  i: int
  o: int
  in_spatial: tuple
  k_spatial: tuple
  out_spatial: tuple
  strides: tuple
  padding: tuple
  lhs_dilation: tuple
  rhs_dilation: tuple
  fgc: int
  bgc: int
  itemsize: int
  acc_itemsize: int
  dtype: str = "float32"

  @property
  def groups(self) -> int:
    return max(self.fgc, self.bgc)

  @property
  def group_size(self) -> int:
    """Output features per group."""
    return self.o // self.groups

  @property
  def kernel_elements(self) -> int:
    return int(np.prod(self.k_spatial, dtype=np.int64))

  def reach(self, axis: int) -> int:
    """Span of the kernel along spatial ``axis`` in padded-dilated positions."""
    return (self.k_spatial[axis] - 1) * self.rhs_dilation[axis] + 1

  def block_ranges(self, axis: int, grid: int, block: int) -> tuple:
    """For each input position along spatial ``axis``, the blocks reading it.

    Block ``i``'s window covers padded-dilated positions ``[i*block*s,
    i*block*s + (rows_i - 1)*s + reach - 1]``; the blocks covering a position
    form a contiguous range ``[lo, hi)`` (empty for positions no one reads).
    """
    s, reach = self.strides[axis], self.reach(axis)
    rows = edge_sizes(self.out_spatial[axis], grid, block)
    start = np.arange(grid) * block * s
    end = start + (rows - 1) * s + reach - 1
    p = self.padding[axis][0] + np.arange(self.in_spatial[axis]) * self.lhs_dilation[axis]
    lo = np.searchsorted(end, p, side="left")
    hi = np.searchsorted(start, p, side="right")
    return lo, np.maximum(hi, lo)

  def tap_block_ranges(self, axis: int, grid: int, block: int) -> tuple:
    """For each kernel tap along spatial ``axis``, the blocks that read it.

    Block ``i`` needs tap ``k`` when some output row ``r`` of it reads an
    input element with it: padded-dilated position ``r*s + k*d`` lies on the
    input (not in padding, not in an lhs-dilation hole). Edge blocks whose
    window runs into padding never read the outer taps, so those kernel
    elements are not sent to them. The blocks form ``[lo, hi)``: exact
    without lhs dilation (the rows reading a tap are contiguous); with holes
    the range spans any block between two readers.
    """
    s, d = self.strides[axis], self.rhs_dilation[axis]
    dil, pad, size = self.lhs_dilation[axis], self.padding[axis][0], self.in_spatial[axis]
    out = self.out_spatial[axis]
    p = (np.arange(out) * s)[None, :] + (np.arange(self.k_spatial[axis]) * d)[:, None] - pad
    reads = (p >= 0) & (p <= (size - 1) * dil) & (p % dil == 0)  # [taps, rows]
    block_of_row = np.arange(out) // block
    first = np.where(reads.any(axis=1), block_of_row[np.argmax(reads, axis=1)], 0)
    last = block_of_row[out - 1 - np.argmax(reads[:, ::-1], axis=1)]
    hi = np.where(reads.any(axis=1), np.minimum(last + 1, grid), 0)
    return first, hi

  def group_block_ranges(self, gc: int, bc: int) -> tuple:
    """For each group, the feature blocks that hold its output features."""
    g = np.arange(self.groups)
    lo = (g * self.group_size) // bc
    hi = ceil_div((g + 1) * self.group_size, bc)
    return lo, np.minimum(hi, gc)


def conv_geometry(lhs_shape, rhs_shape, out_shape, dn, window_strides, padding,
                  lhs_dilation, rhs_dilation, fgc, bgc, itemsize, acc_itemsize,
                  dtype="float32") -> ConvGeometry:
  lhs_spec, rhs_spec, out_spec = dn
  nsp = len(lhs_spec) - 2
  return ConvGeometry(
      n=int(lhs_shape[lhs_spec[0]]), n_out=int(out_shape[out_spec[0]]),
      c=int(lhs_shape[lhs_spec[1]]), i=int(rhs_shape[rhs_spec[1]]),
      o=int(rhs_shape[rhs_spec[0]]),
      in_spatial=tuple(int(lhs_shape[d]) for d in lhs_spec[2:]),
      k_spatial=tuple(int(rhs_shape[d]) for d in rhs_spec[2:]),
      out_spatial=tuple(int(out_shape[d]) for d in out_spec[2:]),
      strides=tuple(int(x) for x in (window_strides or (1,) * nsp)),
      padding=tuple((int(lo), int(hi)) for lo, hi in padding),
      lhs_dilation=tuple(int(x) for x in (lhs_dilation or (1,) * nsp)),
      rhs_dilation=tuple(int(x) for x in (rhs_dilation or (1,) * nsp)),
      fgc=int(fgc), bgc=int(bgc), itemsize=int(itemsize), acc_itemsize=int(acc_itemsize),
      dtype=np.dtype(dtype).name)


@dataclasses.dataclass(frozen=True)
class ConvPlan(GridPlan):
  """How a convolution's output is cut over tiles (a :class:`GridPlan`).

  ``grid`` is ``(gn, gc, gs0, gs1, ...)``: blocks along output batch,
  features and each spatial axis; ``block`` ``(bn, bc, bs0, ...)``; the
  temporaries are the input window, kernel slice and output block in the
  partials type, and they fit when within ``memory_limit``.

  Attributes:
    memory_limit: ``available_memory_proportion * bytes_per_tile``.
  """

  memory_limit: int = 0
  contraction: tuple = (1, 1)
  contraction_block: tuple = (0, 0)
  reduce_cycles: float = 0.0

  @property
  def gk(self) -> int:
    """Tiles sharing an output block (the contraction split)."""
    return int(self.contraction[0] * self.contraction[1])

  @property
  def scatter_stages(self) -> tuple:
    """Partials a block has left after each stage of its reduce-scatter (``(1,)``: one stage).

    poplin reduces a convolution's partials in the stages it reduces a
    matmul's (:func:`~ipu_jax.lowering.matmul_cost.poplin_reduce_levels`:
    two from ``gk = 16``, three from 125); ``()`` when ``gk == 1``.
    """
    return poplin_reduce_levels(self.gk)

  @property
  def out_blocks(self) -> int:
    return int(np.prod(self.grid, dtype=np.int64))

  @property
  def num_tiles(self) -> int:
    return self.out_blocks * self.gk

  @property
  def cycles(self) -> float:
    return super().cycles + self.reduce_cycles

  @property
  def label(self) -> str:
    """E.g. ``grid n8.c2.s4x4 blocks 1x16x8x8`` (``.k2x7`` with a contraction split)."""
    spatial = "x".join(str(g) for g in self.grid[2:]) or "-"
    split = f".k{self.contraction[0]}x{self.contraction[1]}" if self.gk > 1 else ""
    return (f"grid n{self.grid[0]}.c{self.grid[1]}.s{spatial}{split} blocks "
            f"{'x'.join(str(b) for b in self.block)}")


def _feature_candidates(geo: ConvGeometry, limit: int, budget: int) -> np.ndarray:
  """Feature split counts; grouped convolutions need group-aligned blocks."""
  if geo.groups == 1:
    return split_candidates(geo.o, limit, budget)
  g, size = geo.groups, geo.group_size
  # Blocks of whole groups (bc = size * t, t | g) or within a group (bc | size).
  counts = {g // t for t in range(1, g + 1) if g % t == 0}
  counts |= {g * (size // d) for d in range(1, size + 1) if size % d == 0}
  counts = np.array(sorted(c for c in counts if c <= limit), np.int64)
  if counts.size > budget:
    pick = np.unique(np.round(np.geomspace(1, counts.size, budget)).astype(int) - 1)
    counts = counts[pick]
  return counts if counts.size else np.array([1], np.int64)


def splits_contraction(geo: ConvGeometry) -> bool:
  """Whether the planner may split the contraction (input channels, kernel rows).

  Ungrouped convolutions with a spatial axis whose block convolutions run on
  zero-filled windows (not the tap-by-tap form that skips lhs-dilation holes).
  """
  skips_holes = (any(d > 1 for d in geo.lhs_dilation) and all(v == 1 for v in geo.strides)
                 and all(v == 1 for v in geo.rhs_dilation) and len(geo.out_spatial) <= 2)
  return geo.groups == 1 and len(geo.out_spatial) >= 1 and not skips_holes


def plan_conv(target, geo: ConvGeometry, available_memory_proportion: float) -> ConvPlan:
  """Choose the grid of a convolution (cached): output blocks, and the contraction split."""
  return _plan_conv_cached(target, geo, float(available_memory_proportion))


def _output_lists(geo: ConvGeometry, limit: int, budget: int) -> list:
  return ([split_candidates(geo.n_out, limit, budget), _feature_candidates(geo, limit, budget)]
          + [split_candidates(d, limit, budget) for d in geo.out_spatial])


def tap_row_ranges(geo: ConvGeometry, gt: int, bt: int) -> tuple:
  """For each input position along spatial axis 0, the kernel-row blocks reading it.

  Only with the whole axis in one output block: kernel rows ``[t*bt, t*bt +
  rows_t)`` read padded-dilated positions ``[t*bt*d, t*bt*d + (rows_t - 1)*d +
  (out - 1)*s]``.
  """
  s, d = geo.strides[0], geo.rhs_dilation[0]
  rows = edge_sizes(geo.k_spatial[0], gt, bt)
  start = np.arange(gt) * bt * d
  end = start + (rows - 1) * d + (geo.out_spatial[0] - 1) * s
  p = geo.padding[0][0] + np.arange(geo.in_spatial[0]) * geo.lhs_dilation[0]
  lo = np.searchsorted(end, p, side="left")
  hi = np.searchsorted(start, p, side="right")
  return lo, np.maximum(hi, lo)


def _split_within_groups(geo: ConvGeometry, gc) -> np.ndarray:
  """Feature blocks per group (arrays over candidates): poplin's ``outChanSplit``.

  Blocks of whole groups (``gc <= groups``) are poplin's conv-group split,
  one block a group; below a group, ``gc / groups`` blocks split each one.
  """
  gc = np.asarray(gc)
  return np.where(gc > geo.groups, gc // geo.groups, 1)


def _evaluate(target, geo: ConvGeometry, grid: list, gi, gt) -> dict:
  """Per-candidate costs of the busiest tile (arrays over candidates).

  The input window is received at the shared exchange-bus rate when the
  feature split within a group is even
  (:func:`~ipu_jax.lowering.matmul_cost.bus_shared_fraction`: poplin's
  ExchangeEstimator::getInputElementCycles), the kernel slice at a tile's
  rate (poplin's ExchangeEstimator::getCycles for weights).

  ``gi``, ``gt``: the input-channel and kernel-row splits (1: none); a split
  contraction adds the reduce-scatter of the partials
  (:func:`~ipu_jax.lowering.matmul_cost.scatter_reduce_cost`, the matmul
  planner's: in poplin's stages from ``gi * gt = 16``).
  """
  nsp = len(geo.out_spatial)
  dims = (geo.n_out, geo.o) + geo.out_spatial
  block = [ceil_div(d, g) for d, g in zip(dims, grid)]
  bn, bc = block[0], block[1]
  bi = ceil_div(geo.i, gi)
  bt = ceil_div(geo.k_spatial[0], gt)
  taps = bt * int(np.prod(geo.k_spatial[1:], dtype=np.int64))
  out_block = np.ones_like(bn)
  for b in block:
    out_block = out_block * b
  macs = out_block * bi * taps
  compute = estimators.matmul_cycles(target, macs, geo.itemsize, outputs=out_block,
                                     dtype=geo.dtype, n=bc, partials_itemsize=geo.acc_itemsize)
  # Input window of a full block (the planner's estimate; exchange is exact).
  size = geo.group_size
  groups_in_block = np.where(bc >= size, bc // size, 1)
  batch = bn * (groups_in_block if geo.bgc > 1 else 1)
  channels = geo.i * groups_in_block if geo.fgc > 1 else np.where(gi > 1, bi, geo.c)
  window = batch * channels
  for d in range(nsp):
    reach = (bt - 1) * geo.rhs_dilation[d] + 1 if d == 0 else geo.reach(d)
    span = (block[2 + d] - 1) * geo.strides[d] + reach
    lo, hi = geo.block_ranges(d, 1, geo.out_spatial[d])
    read = int((hi > lo).sum())  # positions read at all
    window = window * np.minimum(read, ceil_div(span, geo.lhs_dilation[d]))
  in_bytes = window * geo.itemsize
  k_bytes = bc * bi * taps * geo.itemsize
  exchange_bytes = in_bytes + k_bytes
  # Bus pairs share an input window when the feature split within a group is
  # even (the emitter puts it innermost): poplin's input-element rate.
  priced = bus_shared_fraction(target, _split_within_groups(geo, grid[1])) * in_bytes + k_bytes
  exchange = np.where(exchange_bytes > 0, priced / target.exchange_bytes_per_cycle
                      + target.exchange_latency_cycles, 0.0)
  reduce, _, stage2 = scatter_reduce_cost(target, gi * gt, out_block, geo.acc_itemsize)
  temp = np.maximum(exchange_bytes + out_block * geo.acc_itemsize, stage2)
  tiles = np.ones_like(bn) * gi * gt
  for g in grid:
    tiles = tiles * g
  return dict(grid=grid, block=block, gi=gi * np.ones_like(bn), gt=gt * np.ones_like(bn),
              bi=bi * np.ones_like(bn), bt=bt * np.ones_like(bn), compute=compute,
              exchange=exchange, exchange_bytes=exchange_bytes, reduce=reduce, temp=temp,
              cycles=exchange + compute + reduce, tiles=tiles)


def _contraction_candidates(target, geo: ConvGeometry, active: int) -> dict:
  """Grids that also split the contraction (empty when it cannot be split).

  A kernel-row split keeps spatial axis 0 whole (its window then depends on
  the row block alone); every tile of a reduce-scatter gets a piece.
  """
  limit = target.num_tiles
  budget = max(3, int(_SEARCH_BUDGET ** (1.0 / (active + 2))))
  lists = _output_lists(geo, limit, budget)
  lists += [split_candidates(geo.i, limit, budget),
            split_candidates(geo.k_spatial[0], limit, budget)]
  flat = grid_product(lists, limit)
  *grid, gi, gt = flat
  out_block = np.ones_like(gi)
  for d, g in zip((geo.n_out, geo.o) + geo.out_spatial, grid):
    out_block = out_block * ceil_div(d, g)
  keep = (gi * gt > 1) & (gi * gt <= out_block) & ((gt == 1) | (grid[2] == 1))
  grid = [g[keep] for g in grid]
  return _evaluate(target, geo, grid, gi[keep], gt[keep]) if keep.any() else {}


@functools.lru_cache(maxsize=512)
def _plan_conv_cached(target, geo: ConvGeometry, proportion: float) -> ConvPlan:
  limit = target.num_tiles
  memory_limit = int(proportion * target.bytes_per_tile)
  dims = (geo.n_out, geo.o) + geo.out_spatial
  active = sum(d > 1 for d in dims)
  budget = max(4, int(_SEARCH_BUDGET ** (1.0 / max(active, 1))))
  c = _evaluate(target, geo, grid_product(_output_lists(geo, limit, budget), limit), 1, 1)
  if splits_contraction(geo):
    extra = _contraction_candidates(target, geo, active)
    if extra:
      c = {key: ([np.concatenate([a, b]) for a, b in zip(c[key], extra[key])]
                 if isinstance(c[key], list) else np.concatenate([c[key], extra[key]]))
           for key in c}
  fits = c["temp"] <= memory_limit
  # Today's grids come first: an equal-cost contraction split never wins.
  if fits.any():
    order = np.lexsort((c["tiles"], c["temp"], np.where(fits, c["cycles"], np.inf)))
  else:
    order = np.lexsort((c["tiles"], c["cycles"], c["temp"]))
  j = int(order[0])
  return ConvPlan(
      grid=tuple(int(g[j]) for g in c["grid"]), block=tuple(int(b[j]) for b in c["block"]),
      compute_cycles=float(c["compute"][j]), exchange_cycles=float(c["exchange"][j]),
      sync_cycles=float(target.sync_cycles_internal),
      exchange_bytes=int(c["exchange_bytes"][j]), temp_bytes=int(c["temp"][j]),
      memory_limit=memory_limit, fits=bool(fits[j]), candidates=int(c["tiles"].size),
      contraction=(int(c["gi"][j]), int(c["gt"][j])),
      contraction_block=(int(c["bi"][j]), int(c["bt"][j])),
      reduce_cycles=float(c["reduce"][j]))
