"""The tile grid of a matmul or convolution: blocks on tiles, and the bytes to fill them.

The helpers the matmul and convolution rules (and PopSparse's) share once a
plan (``lowering/matmul_plan.py``) has chosen a grid: the tiles of a grid
(:func:`grid_tiles`), the mapping and storage of an array cut into blocks, one
per tile (:func:`block_grid_mapping`, :func:`blocked_storage`; block-grid
layouts cached tile-independently in ``plan_cache``), and the exact bytes to
give each grid tile the operand elements its block needs
(:func:`grid_exchange_cost`, :func:`operand_exchange_cost`; by interval
arithmetic in ``lowering/block_overlap.py`` where the blocks are boxes, else
per element, with IPU-Link bytes per IPU).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.block_overlap import block_exchange_cost, block_link_bytes
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.block_grid import BlockGrid
from ipu_jax.lowering.matmul_cost import ceil_div

if TYPE_CHECKING:  # program imports this module's users; only the annotation needs it
  from ipu_jax.lowering import program as P

__all__ = ["block_grid_mapping", "blocked_storage", "bus_pair_tile_order", "bus_shared_bytes",
           "canonical_tiles", "edge_sizes", "grid_exchange_cost", "grid_tiles", "matmul_tile_order",
           "operand_exchange_cost", "operand_link_bytes"]


def grid_tiles(ctx, count: int, align: int = 1) -> np.ndarray:
  """Tiles for a grid of ``count`` blocks, rotating the start for small grids.

  Small grids start where the last small tensor ended, so many small products
  do not all pile onto tile 0 (as ``LoweringContext.linear_mapping`` does);
  ``align``: on a multiple of it (see :func:`matmul_tile_order`).
  """
  num_tiles = ctx.target.num_tiles
  start = ctx.claim_tiles(count, align) if count < num_tiles else 0
  return (start + np.arange(count, dtype=np.int64)) % num_tiles


def bus_pair_tile_order(grid: Sequence[int], axis: int) -> np.ndarray:
  """``[prod(grid)]`` the place along its tiles of each (row-major) grid index.

  The grid's axes keep their order except ``axis``, which goes innermost:
  grid indices differing only along ``axis`` sit on consecutive tiles. With
  the grid starting on an even tile (``grid_tiles(..., align=2)``), the two
  tiles of an exchange bus (``2j``, ``2j + 1``) then differ only along
  ``axis`` whenever its split is even, and need the same block of every
  operand that does not vary along it, which they receive together
  (:func:`operand_exchange_cost`'s ``bus_shared``). Poplin's
  ``linearizeConvIndices`` (lib/poplin/Convolution.cpp) puts the
  output-channel split innermost for this reason: a matmul's N split
  (:func:`matmul_tile_order`) and a convolution's feature split.
  """
  grid = tuple(int(g) for g in grid)
  moved = tuple(a for a in range(len(grid)) if a != axis) + (axis,)
  places = np.arange(int(np.prod(grid, dtype=np.int64)), dtype=np.int64).reshape(
      tuple(grid[a] for a in moved))
  return places.transpose(np.argsort(moved)).reshape(-1)


def matmul_tile_order(grid: Sequence[int]) -> np.ndarray:
  """``[gb * gm * gn * gk]`` the place along its tiles of each matmul grid index.

  Grid index ``(ib, im, in, ik)`` (row-major) sits at place
  ``((ib * gm + im) * gk + ik) * gn + in``: the N split innermost
  (:func:`bus_pair_tile_order`), as poplin's ``linearizeConvIndices``
  (lib/poplin/Convolution.cpp) puts the output-channel split innermost, so
  exchange-bus pairs share an A block whenever ``gn`` is even. Poplin puts
  the contraction (input-channel) split outermost; here it stays just
  outside N, so the ``gk`` tiles summing one output block stay close (fewer
  IPU-Link bytes when a grid spans IPUs).
  """
  return bus_pair_tile_order(grid, 2)


def edge_sizes(size: int, grid: int, block: int) -> np.ndarray:
  """``[grid]`` elements in each block of a dimension (the last may be short)."""
  return np.clip(size - np.arange(grid, dtype=np.int64) * block, 0, block)


def block_grid_mapping(shape: Sequence[int], grids: Sequence[int],
                       blocks: Sequence[int], tiles: np.ndarray,
                       pieces: int = 1, serial: tuple = (None, 1)) -> TileMapping:
  """The mapping of an array cut into a grid of blocks, one block per tile.

  Axis ``a`` is cut into ``grids[a]`` blocks of ``blocks[a]``; block ``(i0, i1,
  ...)`` (row-major) is split into ``pieces`` equal runs of its row-major
  elements, each on its own tile: row ``r = block_index * pieces + piece`` of the
  storage lives on ``tiles[r]``. Edge blocks are stored padded to the full block
  size, so storage is ``[rows, ceil(block_elements / pieces)]`` and
  :func:`blocked_storage` builds it with pad / reshape / transpose only.

  ``serial = (axis, count)`` first cuts ``axis`` into ``count`` equal passes
  (the last may be short); the grid then applies within each pass, and every
  tile holds one piece per pass, side by side (row size ``count * piece``).

  Returns:
    A linear mapping when the rows are consecutive runs of the flattened array,
    else a general one.
  """
  shape = tuple(int(d) for d in shape)
  grids = tuple(int(g) for g in grids)
  blocks = tuple(int(b) for b in blocks)
  rows = int(np.prod(grids, dtype=np.int64)) * int(pieces)
  tiles = np.asarray(tiles, np.int64)[:rows]
  n = int(np.prod(shape, dtype=np.int64))
  if n == 0:
    return TileMapping(0, np.zeros(0, np.int64), np.zeros(0, np.int64), chunk=1)
  # Where each element goes does not depend on the tiles: repeated layers,
  # whose grids land on other tiles, share one layout and differ in tiles only.
  key = (shape, grids, blocks, int(pieces), tuple(serial), int(tiles.size))
  layout = plan_cache.cached(_GRID_LAYOUTS, key, lambda: _block_grid_layout(
      shape, grids, blocks, int(tiles.size), int(pieces), tuple(serial)))
  if layout.chunk is not None:
    return TileMapping(n, tiles, layout.counts, chunk=layout.chunk)
  return TileMapping(n, tiles, layout.counts, grid=layout.grid, row_runs=layout.runs)


@dataclasses.dataclass(frozen=True)
class _GridLayout:
  """The tile-independent part of a block-grid mapping (shared, read-only).

  ``chunk`` is set when the rows are consecutive runs of the flattened array
  (a linear mapping); else ``grid`` places every element (its closed form,
  derived on demand by the mapping) and ``runs`` are the runs of one row
  (see ``TileMapping.row_runs``).
  """

  counts: np.ndarray
  chunk: Optional[int] = None
  grid: Optional[BlockGrid] = None
  runs: Optional[tuple] = None


_GRID_LAYOUTS = plan_cache.PlanCache("block_grid_mapping")


def _block_grid_layout(shape, grids, blocks, stored, pieces, serial) -> _GridLayout:
  num_blocks = int(np.prod(grids, dtype=np.int64))
  rows = num_blocks * pieces
  block_elements = int(np.prod(blocks, dtype=np.int64))
  piece = ceil_div(block_elements, pieces)
  _, count = serial
  grid = BlockGrid(tuple(int(d) for d in shape), tuple(int(g) for g in grids),
                   tuple(int(b) for b in blocks), int(pieces), tuple(serial),
                   rows=stored if stored < rows else None)
  # The placement is the grid's closed form (one formula, BlockGrid's), taken
  # on its runs: a vocabulary-sized operand has millions of elements but
  # thousands of runs.
  start, length, row, offset = grid.runs()
  row_size = count * piece if count > 1 else piece
  counts = np.bincount(row, weights=length, minlength=rows)[:rows].astype(np.int64)
  if counts[-1] > 0 and np.all(counts[:-1] == row_size):
    # Within a run both the flat index and the storage place go up by one.
    if np.array_equal(row * row_size + offset, start):
      return _GridLayout(_read_only(counts), chunk=row_size)
  # Blocks past the last tile given are empty (the grid over-covers an
  # axis): they have no storage row.
  if stored < rows and counts[stored:].any():
    raise ValueError(f"block grid: {rows} blocks hold elements but only {stored} tiles given")
  counts = counts[:stored]
  # Runs of one row (TileMapping.row_runs): neighbouring runs on one row merge.
  new = np.ones(row.size, bool)
  new[1:] = row[1:] != row[:-1]
  runs = tuple(_read_only(a) for a in (start[new], row[new]))
  return _GridLayout(_read_only(counts), grid=grid, runs=runs)


def _read_only(a: np.ndarray) -> np.ndarray:
  """``a``, made read-only: cached layouts are shared by many mappings."""
  a = np.ascontiguousarray(a)
  a.setflags(write=False)
  return a


def blocked_storage(x, grids: Sequence[int], blocks: Sequence[int], pieces: int = 1,
                    serial: tuple = (None, 1)):
  """Logical array -> storage of :func:`block_grid_mapping` (pad/reshape/transpose)."""
  return BlockGrid(tuple(x.shape), tuple(grids), tuple(blocks), pieces, serial).to_storage(x)


def canonical_tiles(tensor: P.Tensor, perm: Sequence[int], canon_shape: Sequence[int]):
  """The tile of every element of ``tensor``, in a canonical view of it.

  The view is ``transpose(perm)`` then ``reshape(canon_shape)``, as used by
  :func:`grid_exchange_cost`.
  """
  src = tensor.mapping.element_tile.astype(np.intp, copy=False).reshape(tensor.shape)
  return np.transpose(src, perm).reshape(tuple(int(d) for d in canon_shape))


def operand_exchange_cost(target, tensor, perm, canon_shape, groups, grid, tiles, needs,
                          elements, window=None, bus_shared: bool = False) -> tuple:
  """:func:`grid_exchange_cost` of an operand seen as ``canon_shape`` (axes ``perm`` first).

  By intervals of its mapping where the view allows
  (:func:`~ipu_jax.lowering.block_overlap.block_exchange_cost`; ``groups``:
  the tensor axes of each canonical axis, or None), else per element.
  ``window``: the ``(start, stop)`` taken of each canonical axis (a serial
  pass's slice); default the whole axis. ``bus_shared``: the bytes the two
  tiles of an exchange bus both receive for one block are counted in the
  cost's ``bus_shared_in`` (:func:`bus_shared_bytes`; a matmul's A operand,
  poplin's input elements).
  """
  if window is None:
    window = [(0, int(d)) for d in canon_shape]
  result = None
  if groups is not None:
    result = block_exchange_cost(target, tensor.mapping, tensor.shape, tensor.itemsize,
                                 groups, window, grid, tiles, needs, elements)
  if result is None:
    src = canonical_tiles(tensor, perm, canon_shape)[tuple(slice(a, b) for a, b in window)]
    result = grid_exchange_cost(target, src, tensor.itemsize, grid, tiles, needs, elements)
  cost, local = result
  if bus_shared and cost is not None and target.tiles_per_exchange_bus > 1:
    shared = bus_shared_bytes(target, grid, tiles, needs, elements, local, tensor.itemsize)
    cost = dataclasses.replace(cost, bus_shared_in=shared)
  return cost, local


def bus_shared_bytes(target, grid, tiles, needs, elements, local, itemsize) -> np.ndarray:
  """``[num_tiles]`` bytes a grid tile receives together with its exchange-bus partner.

  Tiles ``2j`` and ``2j + 1`` share a bus. When both are grid tiles needing
  the same block (the same coordinates on every grid axis whose ``needs`` is
  not None), each receives the block's elements that neither holds, in the
  same cycles: those are the shared bytes (what one of them holds, the other
  receives alone). Poplin's ExchangeEstimator credits exactly this
  (lib/poplin/ExchangeEstimator.hpp: input elements at twice the exchange
  rate when the output-channel split is even); here it is counted per pair.

  Args:
    target: the IPU target.
    grid, tiles, needs: as :func:`grid_exchange_cost` takes them.
    elements: ``[G]`` elements of each grid tile's block.
    local: ``[G]`` of them each grid tile already holds.
    itemsize: bytes per element.
  """
  tiles = np.asarray(tiles, np.int64)
  g_count = tiles.size
  coords = np.unravel_index(np.arange(g_count), tuple(int(g) for g in grid))
  block = np.zeros(g_count, np.int64)
  for axis, need in enumerate(needs):
    if need is not None:
      block = block * int(grid[axis]) + coords[axis]
  bus = target.tiles_per_exchange_bus
  # One group per (bus, block); a group is shared when every tile of the bus is in it.
  _, group, members = np.unique((tiles // bus) * g_count + block, return_inverse=True,
                                return_counts=True)
  group = group.reshape(-1)
  held = np.bincount(group, weights=local, minlength=members.size)
  elements = np.broadcast_to(np.asarray(elements, np.int64), (g_count,))
  shared = np.where(members[group] == bus, elements - held[group].astype(np.int64), 0)
  out = np.zeros(target.num_tiles, np.int64)
  np.add.at(out, tiles, shared * itemsize)
  return out


def operand_link_bytes(target, tensor, perm, canon_shape, groups, grid, tiles, needs, sent,
                       window=None) -> Optional[np.ndarray]:
  """The IPU-Link bytes of :func:`operand_exchange_cost` alone, given ``[num_tiles]``
  elements each tile sends (see :func:`~ipu_jax.lowering.block_overlap.block_link_bytes`).

  None where they are not found by intervals: the caller costs the whole
  exchange. ``perm`` is unused (the intervals see the operand through
  ``groups``); it keeps the arguments those of :func:`operand_exchange_cost`.
  """
  del perm
  if groups is None:
    return None
  if window is None:
    window = [(0, int(d)) for d in canon_shape]
  return block_link_bytes(target, tensor.mapping, tensor.shape, tensor.itemsize, groups, window,
                          grid, tiles, needs, sent)


def _along(axis: int, table, ndim: int) -> np.ndarray:
  """``table`` shaped to broadcast along canonical axis ``axis`` of ``ndim``."""
  return np.asarray(table).reshape([-1 if i == axis else 1 for i in range(ndim)])


def _on_tiles(num_tiles: int, tiles: np.ndarray, values, fill: int) -> np.ndarray:
  """A ``[num_tiles]`` table of a per-grid-index value (``fill`` off the grid)."""
  table = np.full(num_tiles, fill, np.int64)
  table[tiles] = values
  return table


@dataclasses.dataclass(frozen=True)
class _GridNeeds:
  """Which grid tiles need each operand element, in the canonical layout.

  Axes where an element needs one block fold into one key, compared with the
  key of the tile that holds it; ranges (halos) are checked per axis.

  Attributes:
    key_needed: the key of the block each element needs (broadcasts to the
      canonical shape).
    key_have: ``[G]`` each grid index's key.
    ranges: per grid axis with halos, ``(coordinate of each tile [num_tiles]
      (-1 off the grid), lo, hi)``, ``lo``/``hi`` along the canonical axis.
    count: how many blocks need each element (broadcasts to the canonical shape).
  """

  key_needed: np.ndarray
  key_have: np.ndarray
  ranges: tuple
  count: np.ndarray


def _grid_needs(num_tiles, ndim, grid_shape, tiles, needs, masks) -> _GridNeeds:
  """The keys, ranges and counts of :func:`grid_exchange_cost`'s ``needs`` and ``masks``."""
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  coords = np.unravel_index(np.arange(g_count), tuple(grid_shape))
  strides = [int(np.prod(grid_shape[a + 1:], dtype=np.int64)) for a in range(len(grid_shape))]
  key_needed = np.zeros((1,) * ndim, np.int64)
  key_have = np.zeros(g_count, np.int64)
  ranges = []
  count = np.ones((1,) * ndim, np.int64)
  for a, need in enumerate(needs):
    if need is None:
      count = count * int(grid_shape[a])
      continue
    axis, lo, hi = need
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    width = np.maximum(hi - lo, 0)
    count = count * _along(axis, width, ndim)
    if np.all(width <= 1):
      key_needed = key_needed + _along(axis, lo * strides[a], ndim)
      key_have += coords[a] * strides[a]
    else:
      ranges.append((_on_tiles(num_tiles, tiles, coords[a], -1), _along(axis, lo, ndim),
                     _along(axis, hi, ndim)))
  for axis, needed in masks:
    count = count * _along(axis, np.asarray(needed, np.int64), ndim)
  return _GridNeeds(key_needed, key_have, tuple(ranges), count)


def _grid_link_bytes(target, src, tiles, grid: _GridNeeds, sent, sent_src,
                     itemsize: int) -> np.ndarray:
  """``[num_ipus]`` IPU-Link bytes of the elements sent (``sent``, from tiles ``sent_src``)."""
  per = target.tiles_per_ipu
  if not grid.ranges:
    # Exact: an element's destinations are the grid tiles sharing its key
    # (every block along the other axes); a multicast crosses once to each
    # other IPU among them.
    g_count = grid.key_have.size
    member = np.zeros((g_count, target.num_ipus), bool)
    member[grid.key_have, np.asarray(tiles) // per] = True
    key = np.broadcast_to(grid.key_needed, src.shape).ravel()[sent.ravel()]
    # Count elements per (key, sending IPU) pair, then weigh each pair by
    # the other IPUs its key's blocks sit on: no per-element IPU table.
    ipus = target.num_ipus
    pairs = np.bincount(key * ipus + sent_src // per, minlength=g_count * ipus)
    pairs = pairs[:g_count * ipus].reshape(g_count, ipus)
    others = member.sum(axis=1, keepdims=True) - member
    return ((pairs * others).sum(axis=0) * itemsize).astype(np.int64)
  # Halo ranges: an upper bound, every element sent leaves for every
  # other IPU the grid spans.
  spanned = np.unique(np.asarray(tiles) // per)
  sent_per_ipu = np.bincount(sent_src // per, minlength=target.num_ipus)[:target.num_ipus]
  others = spanned.size - np.isin(np.arange(target.num_ipus), spanned)
  return (sent_per_ipu * others * itemsize).astype(np.int64)


def grid_exchange_cost(target, src: np.ndarray, itemsize: int, grid_shape: Sequence[int],
                       tiles: np.ndarray, needs: Sequence, block_elements: np.ndarray,
                       masks: Sequence = ()) -> tuple:
  """Bytes moved to give every grid tile the part of an operand it needs.

  The operand is seen in a canonical layout: ``src`` holds the tile of each of
  its elements there (see :func:`canonical_tiles`; a slice of it for a part of
  the operand). For grid axis ``a``, ``needs[a]`` is ``None`` (an element is
  needed by every block along that axis) or ``(canon_axis, lo, hi)``: an
  element whose coordinate along ``canon_axis`` is ``c`` is needed by blocks
  ``lo[c] <= i_a < hi[c]``. ``masks`` are ``(canon_axis, bool table)``:
  elements no tile needs. So the set of tiles needing an element is a product
  of ranges, and no per-(element, destination) array is built.

  Args:
    target: the IPU target.
    src: tile of every operand element, in the canonical layout.
    itemsize: bytes per element.
    grid_shape: blocks along each grid axis; grid index is row-major.
    tiles: ``[G]`` tile of each grid index.
    needs: per grid axis, ``None`` or ``(canon_axis, lo, hi)``.
    block_elements: ``[G]`` elements each grid tile needs (consistent with
      ``needs``, computed analytically by the caller).
    masks: ``(canon_axis, needed)`` tables.

  Returns:
    ``(ExchangeCost, local)``: the cost, and ``[G]`` elements each grid tile
    needs that it already holds.
  """
  t = target.num_tiles
  g_count = int(np.prod(grid_shape, dtype=np.int64))
  if src.size == 0 or g_count == 0:
    return None, np.zeros(g_count, np.int64)
  grid = _grid_needs(t, src.ndim, grid_shape, tiles, needs, masks)
  # Tiles outside the grid hold nothing anyone needs locally.
  local = _on_tiles(t, tiles, grid.key_have, -1)[src] == grid.key_needed
  for coord_of_tile, lo, hi in grid.ranges:
    j = coord_of_tile[src]
    local &= (j >= lo) & (j < hi)
  local &= grid.count > 0
  sent = np.broadcast_to(grid.count, src.shape) > local
  # Flat boolean selection is much faster in NumPy than an n-d mask.
  src_flat = src.ravel()
  sent_src = src_flat[sent.ravel()]
  bytes_out = np.bincount(sent_src, minlength=t)[:t].astype(np.int64) * itemsize
  local_count = np.bincount(src_flat[local.ravel()], minlength=t)[:t][tiles].astype(np.int64)
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, tiles, (np.asarray(block_elements, np.int64) - local_count) * itemsize)
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1 and sent_src.size:
    link = _grid_link_bytes(target, src, tiles, grid, sent, sent_src, itemsize)
  return ExchangeCost(bytes_in, bytes_out, link), local_count
