"""``dot_general``: matrix products planned over tiles like poplin's matmul.

Tile plan. Any ``dot_general`` is canonicalised to a batched product
``[B, M, K] x [B, K, N]`` (batch dims, then the lhs free dims, then the rhs free
dims, as ``dot_general`` orders its result). :func:`plan_matmul` picks a grid
``gb x gm x gn x gk`` of blocks, one per tile, by the cycle model (AMP rate,
exchange, partials reduction) under ``matmuls.available_memory_proportion``.
Two supersteps follow (per serial pass, when the plan needs several passes to
fit in memory: each pass computes a slice of M or N and writes its part of
the result):

1. ``dot_general/matmul``: the exchange brings tile ``(ib, im, in, ik)`` its A
   block ``[bb, bm, bk]`` and B block ``[bb, bk, bn]`` (an A block is
   multicast to the ``gn`` tiles that need it, a B block to ``gm``), then every
   tile multiplies its blocks on the AMP into a partial block in the partials
   type.
2. ``dot_general/reduce`` (only when ``gk > 1``): the ``gk`` tiles that share
   an output block exchange their partials so that each sums ``1/gk`` of the
   block (a reduce-scatter), casting to the result type.

The result stays where it was computed: output block ``(ib, im, in)`` lies on
its grid tiles (cut into ``gk`` pieces; with serial passes a tile holds one
piece per pass), a block :class:`TileMapping` (general, or linear when the
blocks happen to be contiguous runs). Its storage is built from the logical
result with pad / reshape / transpose (:func:`blocked_storage`).

Exchange accounting is exact per tile without per-destination index arrays:
every operand element knows its block, hence the set of grid tiles that need
it (a product of ranges); a tile receives its blocks' sizes less the elements
it already holds (found from the operand's real mapping), and a tile sends
each element it holds once if any other tile needs it (multicast). IPU-Link
bytes across several IPUs are an upper bound (every IPU the grid spans).
Per-tile temporary memory: the received blocks are exchange buffers; the
blocks' local elements are copied into the AMP's block layout (the step's
``scratch_bytes``); the partials are a tensor. Together they equal the plan's
``temp_bytes``.

Execution. ``executor.mode = "per_tile"`` really cuts A and B into the
per-tile blocks with pad / reshape / transpose / broadcast (no gathers) and
vmaps a block matmul over the tile axis, then sums the partials; f32 uses
``Precision.HIGHEST``. ``"batched"`` (the default) computes the whole product
as one ``lax.dot_general`` on the logical arrays with the partials type as
``preferred_element_type`` (the numbers a per-tile plan gives, up to
summation order) and writes it straight into the result's tile storage in
the first step; the later steps (reduce, further passes) then have nothing
left to do on the host, while their cost is still counted.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import BlockGrid, TileMapping
from ipu_jax.lowering.matmul_plan import (ceil_div, operand_dtype, partials_dtype,
                                          plan_matmul)
from ipu_jax.lowering.registry import register_lowering

__all__ = ["block_grid_mapping", "blocked_storage", "grid_exchange_cost",
           "partials_dtype", "grid_tiles", "edge_sizes"]


# -- tile-grid helpers (shared with the convolution rules) -------------------


def grid_tiles(ctx, count: int) -> np.ndarray:
  """Tiles for a grid of ``count`` blocks, rotating the start for small grids.

  Small grids start where the last small tensor ended, so many small products
  do not all pile onto tile 0 (as ``LoweringContext.linear_mapping`` does).
  """
  num_tiles = ctx.target.num_tiles
  start = ctx.claim_tiles(count) if count < num_tiles else 0
  return (start + np.arange(count, dtype=np.int64)) % num_tiles


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
  n = int(np.prod(shape, dtype=np.int64))
  num_blocks = int(np.prod(grids, dtype=np.int64))
  rows = num_blocks * pieces
  tiles = np.asarray(tiles, np.int64)[:rows]
  block_elements = int(np.prod(blocks, dtype=np.int64))
  piece = ceil_div(block_elements, pieces)
  serial_axis, count = serial
  if n == 0:
    return TileMapping(0, np.zeros(0, np.int64), np.zeros(0, np.int64), chunk=1)
  ndim = len(shape)
  row = np.zeros((1,) * ndim, np.int64)
  offset = np.zeros((1,) * ndim, np.int64)
  passes = np.zeros((1,) * ndim, np.int64)
  g_stride = b_stride = 1
  for a in reversed(range(ndim)):
    idx = np.arange(shape[a], dtype=np.int64).reshape([-1 if i == a else 1 for i in range(ndim)])
    if a == serial_axis and count > 1:
      length = ceil_div(shape[a], count)
      passes = passes + idx // length
      idx = idx % length
    row = row + (idx // blocks[a]) * g_stride
    offset = offset + (idx % blocks[a]) * b_stride
    g_stride *= int(grids[a])
    b_stride *= int(blocks[a])
  row = np.broadcast_to(row, shape).reshape(-1)
  offset = np.broadcast_to(offset, shape).reshape(-1)
  if pieces > 1:
    row = row * pieces + offset // piece
    offset = offset % piece
  row_size = piece
  if count > 1:
    offset = np.broadcast_to(passes, shape).reshape(-1) * piece + offset
    row_size = count * piece
  counts = np.bincount(row, minlength=rows)[:rows].astype(np.int64)
  if counts[-1] > 0 and np.all(counts[:-1] == row_size):
    if np.array_equal(row * row_size + offset, np.arange(n, dtype=np.int64)):
      return TileMapping(n, tiles, counts, chunk=row_size)
  # Blocks past the last tile given are empty (the grid over-covers an
  # axis): they have no storage row.
  stored = int(tiles.size)
  if stored < rows and counts[stored:].any():
    raise ValueError(f"block grid: {rows} blocks hold elements but only {stored} tiles given")
  counts = counts[:stored]
  grid = BlockGrid(shape, tuple(int(g) for g in grids), tuple(int(b) for b in blocks),
                   int(pieces), tuple(serial), rows=stored if stored < rows else None)
  return TileMapping(n, tiles, counts, element_row=row, element_offset=offset, grid=grid)


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
  canon_shape = src.shape
  ndim = len(canon_shape)
  coords = np.unravel_index(np.arange(g_count), tuple(grid_shape))
  strides = [int(np.prod(grid_shape[a + 1:], dtype=np.int64)) for a in range(len(grid_shape))]

  def along(axis, table):
    return np.asarray(table).reshape([-1 if i == axis else 1 for i in range(ndim)])

  def per_tile(values, fill):
    """A [num_tiles] table of a per-grid-index value (``fill`` off the grid)."""
    table = np.full(t, fill, np.int64)
    table[tiles] = values
    return table

  # Axes where an element needs one block fold into one key, compared with
  # the key of the tile that holds it; ranges (halos) are checked per axis.
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
    count = count * along(axis, width)
    if np.all(width <= 1):
      key_needed = key_needed + along(axis, lo * strides[a])
      key_have += coords[a] * strides[a]
    else:
      ranges.append((per_tile(coords[a], -1), along(axis, lo), along(axis, hi)))
  for axis, needed in masks:
    count = count * along(axis, np.asarray(needed, np.int64))
  # Tiles outside the grid hold nothing anyone needs locally.
  local = per_tile(key_have, -1)[src] == key_needed
  for coord_of_tile, lo, hi in ranges:
    j = coord_of_tile[src]
    local &= (j >= lo) & (j < hi)
  local &= count > 0
  sent = np.broadcast_to(count, canon_shape) > local
  # Flat boolean selection is much faster in NumPy than an n-d mask.
  src_flat = src.ravel()
  sent_src = src_flat[sent.ravel()]
  bytes_out = np.bincount(sent_src, minlength=t)[:t].astype(np.int64) * itemsize
  local_count = np.bincount(src_flat[local.ravel()], minlength=t)[:t][tiles].astype(np.int64)
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, tiles, (np.asarray(block_elements, np.int64) - local_count) * itemsize)
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1 and sent_src.size:
    # Upper bound: every element sent leaves for every other IPU the grid spans.
    spanned = np.unique(np.asarray(tiles) // target.tiles_per_ipu)
    sent_per_ipu = np.bincount(sent_src // target.tiles_per_ipu,
                               minlength=target.num_ipus)[:target.num_ipus]
    others = spanned.size - np.isin(np.arange(target.num_ipus), spanned)
    link = (sent_per_ipu * others * itemsize).astype(np.int64)
  return ExchangeCost(bytes_in, bytes_out, link), local_count


def _is_float(dtype) -> bool:
  return bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))


def fill_zeros(ctx, shape, dtype, name: str) -> P.Tensor:
  """A result of zeros (e.g. an empty contraction): one fill compute set."""
  out = ctx.new_tensor(shape, dtype)
  elements = out.mapping.elements_per_tile(ctx.target.num_tiles)

  def fn():
    return (jnp.zeros(out.storage_shape, out.dtype),)

  ctx.emit(P.Superstep(name=name, op=ctx.op, reads=(), writes=(out,), fn=fn,
                       compute_cycles=estimators.fill_cycles(ctx.target, elements, out.itemsize),
                       vertices=worker_vertices(ctx, elements), codelets=("Fill",)))
  return out


# -- the rule ------------------------------------------------------------------


def _prod(values) -> int:
  return int(np.prod([int(v) for v in values], dtype=np.int64))


@register_lowering(lax.dot_general_p)
def dot_general_rule(ctx, lhs: P.Tensor, rhs: P.Tensor, *, dimension_numbers,
                     precision=None, preferred_element_type=None, **unused):
  """Lower ``dot_general`` to a planned block matmul (+ partials reduce)."""
  del preferred_element_type, unused  # the result type is in ctx.out_avals
  out_aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(out_aval.shape), np.dtype(out_aval.dtype)
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(a) for a in x) for x in (lc, rc, lb, rb))
  lf = tuple(a for a in range(len(lhs.shape)) if a not in lc and a not in lb)
  rf = tuple(a for a in range(len(rhs.shape)) if a not in rc and a not in rb)
  b = _prod(lhs.shape[a] for a in lb)
  m = _prod(lhs.shape[a] for a in lf)
  k = _prod(lhs.shape[a] for a in lc)
  n = _prod(rhs.shape[a] for a in rf)
  if b * m * n == 0:
    return [ctx.new_tensor(out_shape, out_dtype)]
  if k == 0:
    return [fill_zeros(ctx, out_shape, out_dtype, f"{ctx.op}/zeros")]

  target, options = ctx.target, ctx.options
  in_dtype = operand_dtype(lhs.dtype, rhs.dtype)
  acc = partials_dtype(in_dtype, out_dtype, options.partials_type)
  plan = plan_matmul(target, b, m, n, k, in_dtype, acc, options.available_memory_proportion)
  note = estimators.mac_cost_note(in_dtype)
  notes = (note,) if note else ()
  gb, gm, gn, gk = plan.grid
  bb, bm, bn, bk = plan.block
  passes = plan.serial
  serial_axis = (2 if plan.serial_axis == "n" else 1) if passes > 1 else None
  length = ceil_div((b, m, n)[serial_axis], passes) if passes > 1 else 0
  g_out = gb * gm * gn
  g_all = g_out * gk
  tiles = grid_tiles(ctx, g_all)
  serial = (serial_axis, passes)
  # A tree reduction leaves each output block whole on its group's first
  # tile; a reduce-scatter leaves 1/gk of it on each tile of the group.
  out_pieces = 1 if plan.reduce_fanins else gk
  out_tiles = tiles.reshape(g_out, gk)[:, 0] if plan.reduce_fanins else tiles
  out_mapping = block_grid_mapping((b, m, n), (gb, gm, gn), (bb, bm, bn), out_tiles,
                                   pieces=out_pieces, serial=serial)
  out = ctx.new_tensor(out_shape, out_dtype, out_mapping)
  lhs_perm, rhs_perm = lb + lf + lc, rb + rc + rf
  lhs_src = canonical_tiles(lhs, lhs_perm, (b, m, k))
  rhs_src = canonical_tiles(rhs, rhs_perm, (b, k, n))
  ib, im, in_, ik = np.unravel_index(np.arange(g_all), (gb, gm, gn, gk))
  num_tiles = target.num_tiles
  mode = options.executor_mode
  per_tile_precision = (lax.Precision.HIGHEST
                        if np.dtype(in_dtype) == np.float32 else precision)
  dn = ((lc, rc), (lb, rb))
  block = bb * bm * bn
  piece = ceil_div(block, gk)
  codelet = f"MatMulBlock<{np.dtype(in_dtype).name},{acc.name}>"
  label = plan.label

  def blocks_of(size, block_size):
    """Per position along a dimension: the one block needing it, ``[lo, lo + 1)``."""
    lo = np.arange(size, dtype=np.int64) // block_size
    return lo, lo + 1

  def full_product(a_st, b_st):
    """The whole product, [B, M, N] in the result type (batched mode)."""
    a, w = logical(a_st, lhs), logical(b_st, rhs)
    c = lax.dot_general(a, w, dn, precision=precision, preferred_element_type=acc)
    return c.astype(out_dtype).reshape(b, m, n)

  def pass_blocks(a_st, b_st, start, stop):
    """Per-tile partial blocks ``[G, bb*bm*bn]`` of one pass (per_tile mode)."""
    a = jnp.transpose(logical(a_st, lhs), lhs_perm).reshape(b, m, k)
    w = jnp.transpose(logical(b_st, rhs), rhs_perm).reshape(b, k, n)
    common = jnp.promote_types(a.dtype, w.dtype)
    a, w = a.astype(common), w.astype(common)
    if serial_axis == 1:
      a = a[:, start:stop]
    elif serial_axis == 2:
      w = w[:, :, start:stop]
    pb, pm, pk, pn = a.shape[0], a.shape[1], a.shape[2], w.shape[2]
    a = jnp.pad(a, ((0, gb * bb - pb), (0, gm * bm - pm), (0, gk * bk - pk)))
    a = a.reshape(gb, bb, gm, bm, gk, bk).transpose(0, 2, 4, 1, 3, 5)
    a = jnp.broadcast_to(a[:, :, None], (gb, gm, gn, gk, bb, bm, bk)).reshape(g_all, bb, bm, bk)
    w = jnp.pad(w, ((0, gb * bb - pb), (0, gk * bk - pk), (0, gn * bn - pn)))
    w = w.reshape(gb, bb, gk, bk, gn, bn).transpose(0, 4, 2, 1, 3, 5)
    w = jnp.broadcast_to(w[:, None], (gb, gm, gn, gk, bb, bk, bn)).reshape(g_all, bb, bk, bn)

    def block_matmul(x, y):
      return lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,))),
                             precision=per_tile_precision, preferred_element_type=acc)

    return jax.vmap(block_matmul)(a, w).reshape(g_all, block)

  def put(out_st, index, value):
    """Write one pass's pieces into the result storage."""
    if passes == 1:
      return value.astype(out_dtype)
    rows = out_st.shape[0]
    return out_st.reshape(rows, passes, -1).at[:, index].set(value.astype(out_dtype)).reshape(
        rows, -1)

  def reduce_pieces(p_st):
    x = p_st.reshape(g_out, gk, block)
    if piece * gk != block:
      x = jnp.pad(x, ((0, 0), (0, 0), (0, piece * gk - block)))
    return x.reshape(g_out, gk, gk, piece).sum(axis=1).reshape(g_all, piece)

  # Result elements per tile and pass (a pass's pieces sit side by side).
  if plan.reduce_fanins:
    pass_counts = None
  elif passes == 1:
    pass_counts = out_mapping.counts[:, None]
  else:
    pass_of = out_mapping.element_offset // piece
    pass_counts = np.bincount(out_mapping.element_row * passes + pass_of,
                              minlength=g_all * passes)[:g_all * passes].reshape(g_all, passes)

  # The operand that is not cut into passes is exchanged the same way in
  # every pass: cost it once.
  a_cost_all = b_cost_all = None
  for index in range(passes):
    start = index * length if passes > 1 else 0
    stop = min(start + length, (b, m, n)[serial_axis]) if passes > 1 else None
    pm_ = (stop - start) if serial_axis == 1 else m
    pn_ = (stop - start) if serial_axis == 2 else n
    # Block sizes of every grid tile (edge blocks are short).
    rb_, rm_, rn_, rk_ = (edge_sizes(b, gb, bb)[ib], edge_sizes(pm_, gm, bm)[im],
                          edge_sizes(pn_, gn, bn)[in_], edge_sizes(k, gk, bk)[ik])
    # A pass needs only its slice of the cut operand (tables index the slice).
    if a_cost_all is None or serial_axis == 1:
      a_src = lhs_src[:, start:stop] if serial_axis == 1 else lhs_src
      a_cost_all = grid_exchange_cost(
          target, a_src, lhs.itemsize, (gb, gm, gn, gk), tiles,
          [(0,) + blocks_of(b, bb), (1,) + blocks_of(pm_, bm), None, (2,) + blocks_of(k, bk)],
          rb_ * rm_ * rk_)
    if b_cost_all is None or serial_axis == 2:
      b_src = rhs_src[:, :, start:stop] if serial_axis == 2 else rhs_src
      b_cost_all = grid_exchange_cost(
          target, b_src, rhs.itemsize, (gb, gm, gn, gk), tiles,
          [(0,) + blocks_of(b, bb), None, (2,) + blocks_of(pn_, bn), (1,) + blocks_of(k, bk)],
          rb_ * rk_ * rn_)
    (a_cost, a_local), (b_cost, b_local) = a_cost_all, b_cost_all
    macs = rb_ * rm_ * rn_ * rk_
    compute = np.zeros(num_tiles)
    compute[tiles] = estimators.matmul_cycles(target, macs, np.dtype(in_dtype).itemsize,
                                              outputs=rb_ * rm_ * rn_, dtype=in_dtype)
    # Local elements of the blocks are copied into the AMP's block layout; the
    # received ones sit in the exchange buffers (counted by the analysis).
    scratch = np.zeros(num_tiles, np.int64)
    scratch[tiles] = a_local * lhs.itemsize + b_local * rhs.itemsize
    if gk == 1 and acc != out_dtype:
      scratch[tiles] += rb_ * rm_ * rn_ * acc.itemsize
    vertices = np.zeros(num_tiles, np.int64)
    vertices[tiles] = np.where(macs > 0, target.worker_contexts, 0)
    flops = int(2 * macs.sum()) if _is_float(out_dtype) else 0
    pass_name = f" pass {index + 1}/{passes}" if passes > 1 else ""
    # A pass writes part of the result, so it also reads it (except a single pass).
    result_in = (out,) if passes > 1 else ()

    if gk == 1:
      def step(a_st, b_st, *out_st, index=index, start=start, stop=stop):
        if mode == "per_tile":
          prior = out_st[0] if out_st else None
          return (put(prior, index, pass_blocks(a_st, b_st, start, stop)),)
        if index == 0:
          # Batched: the whole product at once; later passes have nothing to do.
          return (blocked_storage(full_product(a_st, b_st), (gb, gm, gn), (bb, bm, bn),
                                  serial=serial),)
        return (out_st[0],)

      ctx.emit(P.Superstep(
          name=f"{ctx.op}/matmul {label}{pass_name}", op=ctx.op, reads=(lhs, rhs) + result_in,
          writes=(out,), fn=step, compute_cycles=compute, exchange=_add(a_cost, b_cost),
          vertices=vertices, codelets=(codelet,), flops=flops, scratch_bytes=scratch,
          notes=notes))
      continue

    partials = ctx.new_tensor((g_all, block), acc,
                              TileMapping(g_all * block, tiles, np.full(g_all, block, np.int64),
                                          chunk=block),
                              name=f"{ctx.op}/partials")

    def matmul_step(a_st, b_st, *out_st, index=index, start=start, stop=stop,
                    partials=partials):
      # Batched mode does the whole product in the first pass, written straight
      # into the result (its partials are never read, so XLA drops them).
      if mode == "per_tile":
        prior = out_st[0] if out_st else jnp.zeros(out.storage_shape, out_dtype)
        return pass_blocks(a_st, b_st, start, stop), prior
      if index == 0:
        return (jnp.zeros(partials.storage_shape, acc),
                blocked_storage(full_product(a_st, b_st), (gb, gm, gn), (bb, bm, bn),
                                pieces=out_pieces, serial=serial))
      return jnp.zeros(partials.storage_shape, acc), out_st[0]

    ctx.emit(P.Superstep(
        name=f"{ctx.op}/matmul {label}{pass_name}", op=ctx.op, reads=(lhs, rhs) + result_in,
        writes=(partials, out), fn=matmul_step, compute_cycles=compute,
        exchange=_add(a_cost, b_cost), vertices=vertices, codelets=(codelet,), flops=flops,
        scratch_bytes=scratch, notes=notes))

    if plan.reduce_fanins:
      _emit_tree_reduce(ctx, partials, out, plan, tiles, rb_ * rm_ * rn_, mode)
      continue

    # Reduce-scatter of the partials: each tile sums its piece of the block.
    counts = pass_counts[:, index]  # [g_all] result elements each tile reduces
    group = counts.reshape(g_out, gk)
    p_size = acc.itemsize
    bytes_in = np.zeros(num_tiles, np.int64)
    bytes_out = np.zeros(num_tiles, np.int64)
    bytes_in[tiles] = ((gk - 1) * group).reshape(-1) * p_size
    bytes_out[tiles] = (group.sum(axis=1, keepdims=True) - group).reshape(-1) * p_size
    link = np.zeros(target.num_ipus, np.int64)
    if target.num_ipus > 1:
      ipu = (tiles // target.tiles_per_ipu).reshape(g_out, gk)
      crossing = ipu[:, :, None] != ipu[:, None, :]  # [group, src, dst]
      sent = (crossing * group[:, None, :]).sum(axis=2) * p_size  # [group, src]
      link = np.bincount(ipu.reshape(-1), weights=sent.reshape(-1),
                         minlength=target.num_ipus)[:target.num_ipus].astype(np.int64)
    reduce_compute = np.zeros(num_tiles)
    reduce_compute[tiles] = estimators.reduce_cycles(target, gk * counts, p_size, outputs=counts)
    reduce_vertices = np.zeros(num_tiles, np.int64)
    reduce_vertices[tiles] = worker_vertices(ctx, counts)

    def reduce_step(p_st, out_st, index=index):
      if mode != "per_tile":
        return (out_st,)
      return (put(out_st, index, reduce_pieces(p_st)),)

    ctx.emit(P.Superstep(
        name=f"{ctx.op}/reduce {label}{pass_name}", op=ctx.op, reads=(partials, out),
        writes=(out,), fn=reduce_step, compute_cycles=reduce_compute,
        exchange=ExchangeCost(bytes_in, bytes_out, link), vertices=reduce_vertices,
        codelets=(f"ReduceAdd<{acc.name},{out_dtype.name}>",),
        flops=int((gk - 1) * counts.sum()) if _is_float(out_dtype) else 0))
  return [out]


def _emit_tree_reduce(ctx, partials: P.Tensor, out: P.Tensor, plan, tiles: np.ndarray,
                      block_elements: np.ndarray, mode: str) -> None:
  """Sum each output block's ``gk`` partial blocks in a tree of supersteps.

  For a block with fewer elements than ``gk`` (a long contraction with a tiny
  result) a reduce-scatter would leave tiles idle and pile ``gk - 1`` partials
  on one: instead stage ``s`` sums groups of ``plan.reduce_fanins[s]``
  partials on the tile of each group's first (which keeps its own partial
  in place and receives the others), until one sum per block is left, on the
  group's first tile, where the result lies.

  Args:
    partials: ``[g_all, block]`` partial blocks, row ``g * gk + j`` on
      ``tiles[g * gk + j]``.
    out: the result (block-grid mapping on the groups' first tiles).
    plan: the matmul plan.
    tiles: ``[g_all]`` tile of each grid index.
    block_elements: ``[g_all]`` elements of the output block of each grid tile.
    mode: the executor mode.
  """
  target = ctx.target
  gb, gm, gn, gk = plan.grid
  g_out = gb * gm * gn
  block = partials.shape[1]
  acc, out_dtype = partials.dtype, out.dtype
  p_size = acc.itemsize
  num_tiles = target.num_tiles
  elements = block_elements.reshape(g_out, gk)[:, 0]  # [g_out]
  group_tiles = tiles.reshape(g_out, gk)
  level, count, stride = partials, gk, 1  # partial j of a group is on k-tile j * stride
  for stage, fanin in enumerate(plan.reduce_fanins):
    new_count = ceil_div(count, fanin)
    last = new_count == 1
    holders = group_tiles[:, ::stride][:, :count]                  # [g_out, count]
    members = np.minimum(fanin, count - np.arange(new_count) * fanin)  # [new_count]
    receivers = holders[:, ::fanin]                                 # [g_out, new_count]
    sends = (np.arange(count) % fanin) != 0                         # [count]
    bytes_in = np.zeros(num_tiles, np.int64)
    bytes_out = np.zeros(num_tiles, np.int64)
    np.add.at(bytes_in, receivers, (members[None, :] - 1) * elements[:, None] * p_size)
    senders = holders[:, sends]
    np.add.at(bytes_out, senders, np.broadcast_to(elements[:, None] * p_size, senders.shape))
    link = np.zeros(target.num_ipus, np.int64)
    if target.num_ipus > 1:
      per = target.tiles_per_ipu
      dest = np.repeat(receivers, fanin, axis=1)[:, :count][:, sends]
      crossing = (senders // per) != (dest // per)
      np.add.at(link, (senders // per)[crossing],
                np.broadcast_to(elements[:, None] * p_size, senders.shape)[crossing])
    summed = np.zeros(num_tiles, np.int64)
    np.add.at(summed, receivers, members[None, :] * elements[:, None])
    outputs = np.zeros(num_tiles, np.int64)
    np.add.at(outputs, receivers, np.broadcast_to(elements[:, None], receivers.shape))
    compute = estimators.reduce_cycles(target, summed, p_size, outputs=outputs)
    if last:
      result = out
    else:
      rows = g_out * new_count
      result = ctx.new_tensor((rows, block), acc,
                              TileMapping(rows * block, receivers.reshape(-1),
                                          np.full(rows, block, np.int64), chunk=block),
                              name=f"{ctx.op}/partials{stage + 1}")

    def step(level_st, *out_st, count=count, new_count=new_count, fanin=fanin, last=last,
             result=result):
      if mode != "per_tile":
        # Batched mode wrote the result in the matmul step.
        return (out_st[0],) if last else (jnp.zeros(result.storage_shape, acc),)
      x = level_st.reshape(g_out, count, block)
      x = jnp.pad(x, ((0, 0), (0, new_count * fanin - count), (0, 0)))
      x = x.reshape(g_out, new_count, fanin, block).sum(axis=2)
      if last:
        return (x.astype(out_dtype).reshape(out.storage_shape),)
      return (x.reshape(result.storage_shape),)

    ctx.emit(P.Superstep(
        name=f"{ctx.op}/reduce {plan.label} stage {stage + 1}/{len(plan.reduce_fanins)}",
        op=ctx.op, reads=(level,) + ((out,) if last else ()), writes=(result,), fn=step,
        compute_cycles=compute, exchange=ExchangeCost(bytes_in, bytes_out, link),
        vertices=worker_vertices(ctx, outputs),
        codelets=(f"ReduceAdd<{acc.name},{(out_dtype if last else acc).name}>",),
        flops=int(((members - 1).sum()) * elements.sum()) if _is_float(out_dtype) else 0))
    level, count, stride = result, new_count, stride * fanin


def _add(x: Optional[ExchangeCost], y: Optional[ExchangeCost]) -> Optional[ExchangeCost]:
  if x is None:
    return y
  if y is None:
    return x
  return x + y
