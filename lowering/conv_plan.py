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
from ipu_jax.lowering.matmul_cost import ceil_div, grid_product, split_candidates
from ipu_jax.lowering.matmul_grid import edge_sizes

__all__ = ["ConvGeometry", "ConvPlan", "conv_geometry", "plan_conv"]


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

  @property
  def label(self) -> str:
    """E.g. ``grid n8.c2.s4x4 blocks 1x16x8x8``."""
    spatial = "x".join(str(g) for g in self.grid[2:]) or "-"
    return (f"grid n{self.grid[0]}.c{self.grid[1]}.s{spatial} blocks "
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


def plan_conv(target, geo: ConvGeometry, available_memory_proportion: float) -> ConvPlan:
  """Choose the output grid of a convolution (cached)."""
  return _plan_conv_cached(target, geo, float(available_memory_proportion))


@functools.lru_cache(maxsize=512)
def _plan_conv_cached(target, geo: ConvGeometry, proportion: float) -> ConvPlan:
  limit = target.num_tiles
  memory_limit = int(proportion * target.bytes_per_tile)
  nsp = len(geo.out_spatial)
  dims = (geo.n_out, geo.o) + geo.out_spatial
  active = sum(d > 1 for d in dims)
  budget = max(4, int(_SEARCH_BUDGET ** (1.0 / max(active, 1))))
  lists = ([split_candidates(geo.n_out, limit, budget), _feature_candidates(geo, limit, budget)]
           + [split_candidates(d, limit, budget) for d in geo.out_spatial])
  grid = grid_product(lists, limit)
  block = [ceil_div(d, g) for d, g in zip(dims, grid)]
  bn, bc = block[0], block[1]
  out_block = np.ones_like(bn)
  for b in block:
    out_block = out_block * b
  macs = out_block * geo.i * geo.kernel_elements
  compute = estimators.matmul_cycles(target, macs, geo.itemsize, outputs=out_block,
                                     dtype=geo.dtype, n=bc)
  # Input window of a full block (the planner's estimate; exchange is exact).
  size = geo.group_size
  groups_in_block = np.where(bc >= size, bc // size, 1)
  batch = bn * (groups_in_block if geo.bgc > 1 else 1)
  channels = geo.i * groups_in_block if geo.fgc > 1 else geo.c
  window = batch * channels
  for d in range(nsp):
    span = (block[2 + d] - 1) * geo.strides[d] + geo.reach(d)
    lo, hi = geo.block_ranges(d, 1, geo.out_spatial[d])
    read = int((hi > lo).sum())  # positions read at all
    window = window * np.minimum(read, ceil_div(span, geo.lhs_dilation[d]))
  in_bytes = window * geo.itemsize
  k_bytes = bc * geo.i * geo.kernel_elements * geo.itemsize
  exchange_bytes = in_bytes + k_bytes
  exchange = np.where(exchange_bytes > 0, exchange_bytes / target.exchange_bytes_per_cycle
                      + target.exchange_latency_cycles, 0.0)
  temp = exchange_bytes + out_block * geo.acc_itemsize
  cycles = exchange + compute
  tiles = np.ones_like(bn)
  for g in grid:
    tiles = tiles * g
  fits = temp <= memory_limit
  if fits.any():
    order = np.lexsort((tiles, temp, np.where(fits, cycles, np.inf)))
  else:
    order = np.lexsort((tiles, cycles, temp))
  j = int(order[0])
  return ConvPlan(
      grid=tuple(int(g[j]) for g in grid), block=tuple(int(b[j]) for b in block),
      compute_cycles=float(compute[j]), exchange_cycles=float(exchange[j]),
      sync_cycles=float(target.sync_cycles_internal), exchange_bytes=int(exchange_bytes[j]),
      temp_bytes=int(temp[j]), memory_limit=memory_limit, fits=bool(fits[j]),
      candidates=int(grid[0].size))
