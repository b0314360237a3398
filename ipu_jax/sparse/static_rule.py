"""The tile rule of ``ipu_static_sparse_matmul`` (``popsparse::static_``).

Tile plan (:func:`ipu_jax.lowering.sparse_plan.plan_static` chooses the grid
on a uniform pattern of the same density; see its module docstring). In the
product's frame ``out[R, F] = S[R, C] @ D[C, F]`` (a dense x sparse product
is framed transposed), on a grid of ``px * py * pz`` tiles:

1. **Placement.** The non-zero blocks of cell ``(x, y)`` (block rows of X
   band ``x``, block columns of Y band ``y``) move to tile ``(x, y, 0)`` (a
   copy step when they live elsewhere), with their meta-information (a
   program constant on every tile of the cell: header, row entries, column
   entries; :func:`ipu_jax.kernels.popsparse.meta_info_words`).
2. **Products** (one superstep). Tile ``(x, y, z)`` receives ``D``'s rows of
   band ``y`` and columns of range ``z`` (exact bytes, by intervals of ``D``'s
   mapping) and, for ``z > 0``, the cell's blocks from tile ``(x, y, 0)``;
   it zeroes its partials and runs PopSparse's element-wise or block AMP
   vertex over its blocks (costed per tile from the *real* pattern). With
   ``py == 1`` the products are the result; else they are partials
   ``[py, R, F]`` in static_'s partials type (the data type's: half for
   float16, :func:`ipu_jax.sparse.products.static_accumulator`).
3. **Reduction** (``py > 1``). The ``py`` partials of each ``(x, z)`` region
   are reduce-scattered over the region's ``py`` tiles: each sums one piece
   (``poplin::ReduceAdd``, popops' Reduce cost) and writes it as the result.
4. **Serial passes.** When the plan splits Z into equal passes (no one-pass
   grid fits the memory proportion), steps 2 and 3 repeat per pass on that
   pass's dense columns, each writing its columns of the one result (laid
   out pass by pass: every tile holds one piece per pass).
5. **Final output.** static_ leaves its result in ``out``, laid out linearly
   over all the tiles in grains of ``nGrainSize * mGrainSize`` elements
   (poplibs ``lib/popsparse/StaticMatMul.cpp:543-546``), by
   ``popops::reduceMany`` (``StaticMatMul.cpp:793``): a row block's partials
   from one tile are copied there (``lib/popops/reduction/Reduction.cpp:707-713``),
   from several reduced into it. One copy superstep moves the result from the
   grid to that layout (:func:`final_output_mapping`), priced by its exchange.

**Rotating plan** (``plan.rotate``; :mod:`ipu_jax.lowering.sparse_plan`'s
docstring): step 1 places group ``j`` of each cell's blocks (the cell's
blocks in order, cut into ``pz`` runs whose counts differ by at most one) on
tile ``(x, y, j)``, with a meta-information row of its own; step 2 becomes
``pz`` supersteps: at step ``s`` of pass ``p`` tile ``(x, y, z)`` holds group
``(z + t) % pz`` with ``t = p * (pz - 1) + s`` (each step after a pass's first
moves every group one tile down Z, so the next pass starts where the last
ended) and adds its products into its partials; the costs are each tile's
real group's. Then the reduction or, with ``py == 1``, the last step writes
the result.

Executor forms: ``per_tile`` runs every cell's own padded block list (the
grid's work split) and sums partials band by band; the logical form sums all
blocks into their bands at once. Both give each band's partials from the same
block products.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import popsparse
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, relayout_to, storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_emit import fill_zeros
from ipu_jax.lowering.matmul_grid import block_grid_mapping, grid_tiles, operand_exchange_cost
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.sparse_plan import SparsePlan, plan_static
from ipu_jax.sparse import products
from ipu_jax.sparse import static_rotate
from ipu_jax.sparse.formats import SparsityPattern
from ipu_jax.sparse.static import static_sparse_matmul_p

__all__ = ["SparseGrid", "sparse_grid", "pass_windows", "emit_products", "emit_reduction",
           "new_result", "result_mapping", "place_pass", "block_groups", "final_output_mapping"]


@dataclasses.dataclass(frozen=True)
class SparseGrid:
  """A plan's grid on tiles, and where a frame pattern's blocks fall in it.

  Attributes:
    plan: the :class:`SparsePlan`.
    tiles: ``[px, py, pz]`` tile of each grid position.
    cell_of_block: ``[nnz]`` cell ``x * py + y`` of each frame block.
    cell_blocks: ``[px * py]`` blocks per cell; cell_rows: non-empty block rows per cell.
    z_cols: ``[pz]`` dense columns per Z range; x_rows: ``[px]`` rows (elements) per X band.
  """

  plan: SparsePlan
  tiles: np.ndarray
  cell_of_block: np.ndarray
  cell_blocks: np.ndarray
  cell_rows: np.ndarray
  z_cols: np.ndarray
  x_rows: np.ndarray

  @property
  def shape(self) -> tuple:
    return tuple(int(g) for g in self.tiles.shape)


def _edges(size: int, count: int, band: int) -> np.ndarray:
  return np.clip(size - np.arange(count, dtype=np.int64) * band, 0, band)


def sparse_grid(ctx, plan: SparsePlan, rows: np.ndarray, cols: np.ndarray) -> SparseGrid:
  """Place ``plan``'s grid on tiles and count the frame blocks ``(rows, cols)`` per cell."""
  rx, cy, fz = plan.band
  b = plan.block
  xb = plan.x // b
  # Counts that leave no empty band (the planner's are merged so already).
  px = max(-(-xb // rx), 1)
  py = max(-(-(plan.y // b) // cy), 1)
  pz = max(-(-plan.pass_z // fz), 1)
  tiles = grid_tiles(ctx, px * py * pz).reshape(px, py, pz)
  rows, cols = rows.astype(np.int64), cols.astype(np.int64)
  cell = (rows // rx) * py + cols // cy
  cell_blocks = np.bincount(cell, minlength=px * py).astype(np.int64)
  # Non-empty block rows per cell: distinct (cell, row) pairs.
  pairs = np.unique(cell * max(xb, 1) + rows)
  cell_rows = np.bincount(pairs // max(xb, 1), minlength=px * py).astype(np.int64)
  return SparseGrid(plan, tiles, cell, cell_blocks, cell_rows, _edges(plan.pass_z, pz, fz),
                    _edges(plan.x, px, rx * b))


def pass_windows(plan: SparsePlan) -> list:
  """``[(start, stop)]`` dense columns of each serial pass."""
  width = plan.pass_z
  return [(i * width, min(plan.z, (i + 1) * width)) for i in range(plan.serial)]


def z_columns(grid: SparseGrid, window) -> np.ndarray:
  """Column edges of the Z partitions of a pass's output ``window`` (also for rotation)."""
  return _edges(window[1] - window[0], grid.shape[2], grid.plan.band[2])


# -- placement ------------------------------------------------------------------


def block_groups(grid: SparseGrid) -> np.ndarray:
  """``[nnz]`` the rotating group of each frame block: its cell's blocks in order, cut
  into ``pz`` runs whose counts differ by at most one."""
  pz = grid.shape[2]
  order = np.argsort(grid.cell_of_block, kind="stable")
  start = np.concatenate([[0], np.cumsum(grid.cell_blocks)[:-1]])
  rank = np.empty(order.size, np.int64)
  rank[order] = np.arange(order.size) - start[grid.cell_of_block[order]]
  return rank * pz // np.maximum(grid.cell_blocks[grid.cell_of_block], 1)


def values_mapping(grid: SparseGrid, frame_order: np.ndarray, block_elements: int) -> TileMapping:
  """The values ``[nnz, bm, bk]`` (user order) with block ``i`` on its cell's ``z = 0`` tile,
  or (rotating plan) on its group's tile ``(x, y, group)``.

  ``frame_order[j]``: the user block that is frame block ``j``.
  """
  px, py, pz = grid.shape
  z = block_groups(grid) if grid.plan.rotate else 0
  tile_of_user_block = np.empty(frame_order.size, np.int64)
  tile_of_user_block[frame_order] = grid.tiles.reshape(px * py, pz)[grid.cell_of_block, z]
  return TileMapping.from_element_tiles(np.repeat(tile_of_user_block, block_elements))


def _unit_words(grid: SparseGrid, rows: np.ndarray, cols: np.ndarray, per_cell: int) -> tuple:
  """Meta-information of every unit (a cell, or with ``per_cell = pz`` a cell's rotating
  group): ``(words, unit of each word)`` in unit order.

  A unit's words: a header (blocks, non-empty rows, x, y), then ``(row, count)``
  for each non-empty block row, then each block's column within the band.
  """
  px, py, _ = grid.shape
  rx, cy, _ = grid.plan.band
  unit_of_block = grid.cell_of_block * per_cell + (block_groups(grid) if per_cell > 1 else 0)
  units = np.arange(px * py * per_cell)
  xr = max(grid.plan.x, 1)
  pair, counts = np.unique(unit_of_block * xr + rows, return_counts=True)
  blocks = np.bincount(unit_of_block, minlength=units.size)
  unit_rows = np.bincount(pair // xr, minlength=units.size)
  used = blocks > 0
  cell = units // per_cell
  header = np.stack([blocks, unit_rows, cell // py, cell % py], 1)[used]
  h_unit = np.repeat(units[used], 4)
  r_unit = np.repeat(pair // xr, 2)
  r_words = np.stack([(pair % xr) % rx, counts], 1).reshape(-1)
  unit = np.concatenate([h_unit, r_unit, unit_of_block])
  section = np.concatenate([np.zeros(h_unit.size), np.ones(r_unit.size),
                            np.full(cols.size, 2)])
  words = np.concatenate([header.reshape(-1), r_words, cols % cy])
  order = np.lexsort((np.arange(unit.size), section, unit))
  return words[order].astype(np.uint16), unit[order]


def meta_constant(ctx, grid: SparseGrid, rows: np.ndarray, cols: np.ndarray) -> P.Tensor:
  """The meta-information as a program constant ``[G, L]``: row ``g`` on grid tile ``g``
  holds its cell's words (rotating plan: its group's), padded to the longest row's ``L``
  (a linear layout, so no per-element arrays however many blocks)."""
  px, py, pz = grid.shape
  per_cell = pz if grid.plan.rotate else 1
  words, unit = _unit_words(grid, rows, cols, per_cell)
  units = px * py * per_cell
  length = np.bincount(unit, minlength=units)
  longest = max(int(length.max(initial=0)), 1)
  start = np.concatenate([[0], np.cumsum(length)[:-1]])
  padded = np.zeros((units, longest), np.uint16)
  padded[unit, np.arange(unit.size) - start[unit]] = words
  value = np.repeat(padded, pz // per_cell, axis=0)   # grid order (x, y, z): z innermost
  tiles = grid.tiles.reshape(-1)
  mapping = TileMapping.blocks(value.size, longest, ctx.target.num_tiles, int(tiles[0]))
  module = ctx.module
  tensor = P.Tensor("sparse meta-info", value.shape, value.dtype, mapping, category="constants",
                    value=value, op=ctx.op, source=ctx.source, scope=module.scope)
  module.tensors[tensor.id] = tensor
  module.constants.append(tensor)
  return tensor


# -- costs --------------------------------------------------------------------


def dense_exchange(ctx, grid: SparseGrid, dense: P.Tensor, side: str, window=None):
  """Bytes bringing each tile ``D``'s rows of its Y band and columns of its Z range
  (within the pass's ``window`` of columns)."""
  px, py, pz = grid.shape
  rx, cy, fz = grid.plan.band
  b = grid.plan.block
  c, f = grid.plan.y, grid.plan.z
  window = (0, f) if window is None else window
  y_of_row = np.arange(c) // (cy * b)
  z_of_col = np.arange(window[1] - window[0]) // fz
  needs = [None, (0, y_of_row, y_of_row + 1), (1, z_of_col, z_of_col + 1)]
  band_rows = _edges(c, py, cy * b)
  elements = (band_rows[None, :, None] * z_columns(grid, window)[None, None, :]
              * np.ones((px, 1, 1), np.int64)).reshape(-1)
  perm, groups = ((0, 1), ((0,), (1,))) if side == "lhs" else ((1, 0), ((1,), (0,)))
  cost, _ = operand_exchange_cost(ctx.target, dense, perm, (c, f), groups, (px, py, pz),
                                  grid.tiles.reshape(-1), needs, elements,
                                  window=[(0, c), tuple(window)])
  return cost


def block_copies(ctx, grid: SparseGrid, itemsize: int) -> ExchangeCost:
  """Bytes copying each cell's blocks from its ``z = 0`` tile to its other ``pz - 1`` tiles."""
  t = ctx.target.num_tiles
  cost = ExchangeCost.zeros(ctx.target)
  px, py, pz = grid.shape
  if pz == 1:
    return cost
  nbytes = grid.cell_blocks * grid.plan.block ** 2 * itemsize
  receivers = grid.tiles[:, :, 1:].reshape(px * py, pz - 1)
  cost.bytes_in[:] = np.bincount(receivers.reshape(-1), np.repeat(nbytes, pz - 1),
                                 minlength=t)[:t].astype(np.int64)
  cost.bytes_out[:] = np.bincount(grid.tiles[:, :, 0].reshape(-1), nbytes,
                                  minlength=t)[:t].astype(np.int64)
  return cost


def product_cycles(ctx, grid: SparseGrid, itemsize: int, p_itemsize: int,
                   z_cols=None) -> np.ndarray:
  """``[num_tiles]`` cycles of each tile's zeroing and sparse-dense vertex."""
  px, py, pz = grid.shape
  b = grid.plan.block
  blocks = np.repeat(grid.cell_blocks, pz)
  rows = np.repeat(grid.cell_rows, pz)
  z = np.tile(grid.z_cols if z_cols is None else z_cols, px * py)
  partial = np.repeat(grid.x_rows, py * pz) * z
  cycles = (popsparse.static_product_cycles(ctx.target, blocks, rows, z, b, itemsize)
            + popsparse.static_zero_partials_cycles(ctx.target, partial, b, p_itemsize))
  out = np.zeros(ctx.target.num_tiles)
  np.add.at(out, grid.tiles.reshape(-1), cycles)
  return out


def _on_tiles(ctx, grid: SparseGrid, per_position: np.ndarray) -> np.ndarray:
  out = np.zeros(ctx.target.num_tiles, np.asarray(per_position).dtype)
  np.add.at(out, grid.tiles.reshape(-1), per_position)
  return out


# -- the products and the reduction ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Cells:
  """Each cell's frame blocks, padded to the fullest cell (``-1``: none)."""

  block: np.ndarray      # [cells, most] frame block index
  local_row: np.ndarray  # [cells, most] block row within the X band


def _cells(grid: SparseGrid, rows: np.ndarray) -> _Cells:
  cells = grid.cell_blocks.size
  most = max(int(grid.cell_blocks.max(initial=0)), 1)
  order = np.argsort(grid.cell_of_block, kind="stable")
  start = np.concatenate([[0], np.cumsum(grid.cell_blocks)[:-1]])
  rank = np.arange(order.size) - start[grid.cell_of_block[order]]
  block = np.full((cells, most), -1, np.int64)
  block[grid.cell_of_block[order], rank] = order
  local = np.where(block >= 0, rows[np.maximum(block, 0)] % grid.plan.band[0], 0)
  return _Cells(block, local)


@dataclasses.dataclass(frozen=True)
class _Product:
  """What one pass's products step computes."""

  grid: SparseGrid
  pattern: SparsityPattern      # the user's
  frame: SparsityPattern        # the frame's
  side: str
  cells: _Cells
  values: P.Tensor
  dense: P.Tensor
  out: P.Tensor                 # partials [py, R, w] or the result
  window: tuple                 # the pass's dense columns (frame F)


def _per_tile_partials(p: _Product, fv, dense_c):
  """``[py, R, w]``: every cell's blocks on its own (padded list), then placed."""
  acc = products.accumulator(fv.dtype)
  b = p.grid.plan.block
  rx = p.grid.plan.band[0]
  px, py, _ = p.grid.shape
  cb, f = p.frame.grid[1], dense_c.shape[1]
  vals = jnp.concatenate([fv.astype(acc), jnp.zeros((1, b, b), acc)])
  dblocks = jnp.concatenate([dense_c.astype(acc).reshape(cb, b, f), jnp.zeros((1, b, f), acc)])
  idx = np.where(p.cells.block >= 0, p.cells.block, fv.shape[0])
  cols = np.where(p.cells.block >= 0, p.frame.col_indices[np.maximum(p.cells.block, 0)], cb)
  contrib = jnp.einsum("cnab,cnbf->cnaf", vals[idx], dblocks[cols], preferred_element_type=acc)
  part = jax.vmap(lambda c, r: jax.ops.segment_sum(c, r, num_segments=rx))(
      contrib, jnp.asarray(p.cells.local_row))
  part = part.reshape(px, py, rx * b, f).transpose(1, 0, 2, 3).reshape(py, px * rx * b, f)
  return part[:, :p.frame.shape[0]]


def _partials(p: _Product, values, dense, per_tile: bool):
  fv, _ = products.frame(values, p.pattern, p.side)
  dense_c = products.frame_dense(dense, p.side)[:, p.window[0]:p.window[1]]
  if per_tile:
    return _per_tile_partials(p, fv, dense_c)
  return products.band_partials(fv, p.frame, dense_c, p.grid.plan.band[1], p.grid.shape[1])


def place_pass(side, out_shape, window, value, prior):
  """The result with the pass's ``[R, w]`` frame ``value`` in its columns (zeros or
  ``prior`` elsewhere)."""
  value = products.unframe(value, side)
  start, stop = window
  full = stop - start == (out_shape[1] if side == "lhs" else out_shape[0])
  if full:
    return value
  base = jnp.zeros(out_shape, value.dtype) if prior is None else prior
  if side == "lhs":
    return base.at[:, start:stop].set(value)
  return base.at[start:stop, :].set(value)


def _finish(p: _Product, partials, prior):
  """The step's written value: the partials, or (one band) the result."""
  if p.grid.shape[1] > 1:
    return partials.astype(p.out.dtype)   # summed in float32, stored in static_'s partials type
  return place_pass(p.side, p.out.shape, p.window, partials[0].astype(p.out.dtype), prior)


def _products_fn(p: _Product, values_st, dense_st, meta_st, *prior_st):
  del meta_st  # the pattern is static: the step's blocks were listed when lowering
  partials = _partials(p, logical(values_st, p.values), logical(dense_st, p.dense), True)
  prior = logical(prior_st[0], p.out) if prior_st else None
  return (storage(_finish(p, partials, prior), p.out),)


def _products_logical(p: _Product, values, dense, meta, *prior):
  del meta
  return (_finish(p, _partials(p, values, dense, False), prior[0] if prior else None),)


def result_mapping(grid: SparseGrid, side: str, pieces: int) -> TileMapping:
  """The result's layout: block ``(x, z)`` (each pass's) cut in ``pieces`` over its Y tiles."""
  px, py, pz = grid.shape
  rx, _, fz = grid.plan.band
  rows = rx * grid.plan.block
  count = grid.plan.serial
  if side == "lhs":
    return block_grid_mapping((grid.plan.x, grid.plan.z), (px, pz), (rows, fz),
                              grid.tiles.transpose(0, 2, 1).reshape(-1), pieces=pieces,
                              serial=(1, count) if count > 1 else (None, 1))
  return block_grid_mapping((grid.plan.z, grid.plan.x), (pz, px), (fz, rows),
                            grid.tiles.transpose(2, 0, 1).reshape(-1), pieces=pieces,
                            serial=(0, count) if count > 1 else (None, 1))


def final_output_mapping(target, shape, dtype, block: int, side: str) -> TileMapping:
  """static_'s result layout: equal chunks on the tiles from tile 0 (the last less).

  The chunk is :func:`ipu_jax.kernels.popsparse.static_output_chunk` of the frame's
  ``[rows, columns]`` result. The chunks follow the result's row-major order;
  static_'s follow its ``out`` tensor's ``[rows / b, columns, b]`` order
  (``StaticMatMul.cpp:543-546``): the same elements per tile, not the same ones.
  """
  rows, columns = shape if side == "lhs" else shape[::-1]
  itemsize = np.dtype(dtype).itemsize
  chunk = popsparse.static_output_chunk(target, rows, columns, itemsize, block)
  return TileMapping.blocks(int(np.prod(shape)), chunk, target.num_tiles, 0)


def new_result(ctx, grid: SparseGrid, side: str, out_dtype, name) -> P.Tensor:
  """The result tensor, laid out for the plan's last step (products, or the reduction)."""
  shape = (grid.plan.x, grid.plan.z) if side == "lhs" else (grid.plan.z, grid.plan.x)
  return ctx.new_tensor(shape, out_dtype, result_mapping(grid, side, grid.shape[1]), name=name)


def emit_products(ctx, grid: SparseGrid, pattern, frame, values, dense, meta, out_dtype,
                  side, name, result: P.Tensor, window=None) -> P.Tensor:
  """One pass's products superstep; returns its partials ``[py, R, w]``, or (``py == 1``)
  ``result`` with the pass's columns written."""
  px, py, pz = grid.shape
  rx, _, fz = grid.plan.band
  window = (0, grid.plan.z) if window is None else tuple(window)
  acc = products.static_accumulator(out_dtype)
  prior = ()
  if py > 1:
    width = window[1] - window[0]
    mapping = block_grid_mapping((py, grid.plan.x, width), (py, px, pz),
                                 (1, rx * grid.plan.block, fz),
                                 grid.tiles.transpose(1, 0, 2).reshape(-1))
    out = ctx.new_tensor((py, grid.plan.x, width), acc, mapping, name=f"{name} partials")
  else:
    out = result
    prior = (result,) if window[0] > 0 else ()
  itemsize = np.dtype(out_dtype).itemsize
  z_cols = z_columns(grid, window)
  exchange = dense_exchange(ctx, grid, dense, side, window) + block_copies(ctx, grid, itemsize)
  blocks_on_tile = _on_tiles(ctx, grid, np.repeat(grid.cell_blocks, pz))
  p = _Product(grid, pattern, frame, side, _cells(grid, frame.row_indices), values, dense, out,
               window)
  kind = (vocab.STATIC_SPARSE_DENSE_ELEMENTWISE if grid.plan.block == 1
          else vocab.STATIC_SPARSE_DENSE_BLOCK)
  suffix = f" pass {window[0] // grid.plan.pass_z + 1}/{grid.plan.serial}" if grid.plan.serial > 1 else ""
  ctx.emit(P.Superstep(
      name=f"{name}/products x{px}.y{py}.z{pz}{suffix}", op=ctx.op,
      reads=(values, dense, meta) + prior, writes=(out,),
      fn=functools.partial(_products_fn, p), logical=functools.partial(_products_logical, p),
      compute_cycles=product_cycles(ctx, grid, itemsize, np.dtype(acc).itemsize, z_cols),
      exchange=exchange, vertices=worker_vertices(ctx, blocks_on_tile),
      codelets=(vocab.vertex(kind, np.dtype(out_dtype), acc),),
      flops=2 * frame.nnz_blocks * grid.plan.block ** 2 * (window[1] - window[0]),
      scratch_bytes=exchange.bytes_in, notes=(grid.plan.describe(),)))
  return out


@dataclasses.dataclass(frozen=True)
class _Reduction:
  side: str
  partials: P.Tensor
  out: P.Tensor
  window: tuple


def _reduced(r: _Reduction, partials, prior):
  # Half partials are summed in float32 and the sum rounded once to the result.
  partials = partials.astype(products.accumulator(r.out.dtype))
  total = partials[0]
  for band in range(1, partials.shape[0]):   # band by band, as the tiles add them
    total = total + partials[band]
  return place_pass(r.side, r.out.shape, r.window, total.astype(r.out.dtype), prior)


def _reduce_fn(r: _Reduction, partials_st, *prior_st):
  prior = logical(prior_st[0], r.out) if prior_st else None
  return (storage(_reduced(r, logical(partials_st, r.partials), prior), r.out),)


def _reduce_logical(r: _Reduction, partials, *prior):
  return (_reduced(r, partials, prior[0] if prior else None),)


def emit_reduction(ctx, grid: SparseGrid, partials: P.Tensor, out_dtype, side, name,
                   result: P.Tensor = None, window=None) -> P.Tensor:
  """Reduce-scatter a pass's ``py`` partials of each region over its ``py`` tiles, into
  ``result`` (made here when None)."""
  px, py, pz = grid.shape
  out = new_result(ctx, grid, side, out_dtype, name) if result is None else result
  window = (0, grid.plan.z) if window is None else tuple(window)
  region = np.repeat(grid.x_rows, pz)[:, None] * np.tile(z_columns(grid, window), px)[:, None]
  region = np.broadcast_to(region.reshape(px, 1, pz), (px, py, pz)).reshape(-1)
  piece = -(-region // py)
  p_item = partials.itemsize
  received = _on_tiles(ctx, grid, piece * (py - 1) * p_item).astype(np.int64)
  sent = _on_tiles(ctx, grid, np.maximum(region - piece, 0) * p_item).astype(np.int64)
  exchange = ExchangeCost(received, sent, np.zeros(ctx.target.num_ipus, np.int64))
  piece_on_tile = _on_tiles(ctx, grid, piece)
  r = _Reduction(side, partials, out, window)
  prior = (out,) if window[0] > 0 else ()
  ctx.emit(P.Superstep(
      name=f"{name}/reduce x{py}", op=ctx.op, reads=(partials,) + prior, writes=(out,),
      fn=functools.partial(_reduce_fn, r), logical=functools.partial(_reduce_logical, r),
      compute_cycles=estimators.reduce_cycles(ctx.target, piece_on_tile * py, p_item,
                                              outputs=piece_on_tile),
      exchange=exchange, vertices=worker_vertices(ctx, piece_on_tile),
      codelets=(vocab.vertex(vocab.REDUCE_ADD, partials.dtype, np.dtype(out_dtype)),),
      scratch_bytes=received))
  return out


@register_lowering(static_sparse_matmul_p)
def _static_sparse_rule(ctx: RuleContext, values, dense, *, pattern, side,
                        available_memory_proportion):
  out_aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(int(d) for d in out_aval.shape), np.dtype(out_aval.dtype)
  if 0 in out_shape:
    return [ctx.new_tensor(out_shape, out_dtype)]
  if pattern.nnz_blocks == 0:
    return [fill_zeros(ctx, out_shape, out_dtype, "static sparse matmul (no blocks)")]
  fv_order = np.arange(pattern.nnz_blocks) if side == "lhs" else pattern.transpose()[1]
  frame = pattern if side == "lhs" else pattern.transpose()[0]
  amp = available_memory_proportion
  if amp is None:
    amp = ctx.memory_proportion("available_memory_proportion")
  free = out_shape[1] if side == "lhs" else out_shape[0]
  plan = plan_static(ctx.target, frame.shape[0], frame.shape[1], free, frame.block[0],
                     frame.nnz_blocks, out_dtype, products.static_accumulator(out_dtype), amp)
  grid = sparse_grid(ctx, plan, frame.row_indices, frame.col_indices)
  name = "static sparse matmul"
  placed = relayout_to(ctx, values, values_mapping(grid, fv_order, frame.block[0] ** 2),
                       name=f"{name}/place blocks")
  meta = meta_constant(ctx, grid, frame.row_indices.astype(np.int64),
                       frame.col_indices.astype(np.int64))
  result = new_result(ctx, grid, side, out_dtype, name)
  for index, window in enumerate(pass_windows(plan)):
    if plan.rotate:
      out = static_rotate.emit_rotation(ctx, grid, pattern, frame, placed, dense, meta, out_dtype,
                                        side, name, result, window, index)
    else:
      out = emit_products(ctx, grid, pattern, frame, placed, dense, meta, out_dtype, side, name,
                          result, window)
    if grid.shape[1] > 1:
      emit_reduction(ctx, grid, out, out_dtype, side, name, result, window)
  final = final_output_mapping(ctx.target, out_shape, out_dtype, frame.block[0], side)
  return [relayout_to(ctx, result, final, name=f"{name}/final output")]
