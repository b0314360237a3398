"""Tile lowerings of the IPU custom primitives in :mod:`ipu_jax.ops`.

Tile plans:

* ``tile_map``: slice ``i`` of every operand is exchanged onto tile
  ``tiles[i]`` (nothing moves for slices already there); each of those tiles
  runs one vertex of the user's codelet, costed by the codelet's estimator
  (vertices on one tile share its workers as in the graph API); results stay
  one slice per tile.
* ``cross_replica_sum`` / ``cross_replica_mean`` / ``replica_index``: with the
  named-axis collectives, in :mod:`ipu_jax.lowering.rules.parallel`.
* ``ipu_matmul``: planned by ``lowering/matmul_plan.plan_matmul`` with the
  op's own ``available_memory_proportion``/``partials_type`` (poplin's per-op
  options) over the context's: a ``gb x gm x gn x gk`` grid of blocks, one per
  tile. Tile ``(ib, im, in, ik)`` receives its A block (multicast to the
  ``gn`` tiles of its row) and B block (multicast to the ``gm`` tiles of its
  column) and multiplies them; with ``gk > 1`` a second superstep exchanges the
  partial sums and each of the ``gk`` tiles of a block reduces ``1/gk`` of it.
  When no single pass fits in memory the planner splits M or N into serial
  passes that reuse the grid (and the partials buffer); each pass writes its
  slice of the result. Partials follow ``matmul_plan.partials_dtype`` (the
  rule ``dot_general`` uses). A grid whose reduce groups outnumber the
  block's elements (a long contraction with a tiny result) is still
  reduce-scattered: the tiles past the block's elements only send. Exchange bytes are exact (elements already on a destination tile do not
  move; a multicast leaves its tile once) and computed per block, in NumPy.
* ``stochastic_round``: elementwise on the input's tiles; the key is
  multicast to them; each tile draws the random bits for its elements (a
  counter-based generator needs only the key and the position), costed per
  element, and rounds them in the same vertex.
* ``print_tensor``: a ``PrintTensor`` program node (the tensor streams to the
  host); the result is the operand's tensor itself.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import ops
from ipu_jax.ops.stochastic_round import random_bits_for, round_with_bits
from ipu_jax.ops.tile_map import codelet_body, codelet_cycles, codelet_flops, is_supervisor
from ipu_jax.kernels import estimators
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import (add_costs, broadcast_cost, logical,
                                       storage, worker_vertices)
from ipu_jax.lowering.exchange import (ExchangeCost, relayout, relayout_cost,
                                       to_flat, to_storage)
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering

from ipu_jax.lowering.matmul_plan import partials_dtype, plan_matmul

# Cycles per vector for stochastic rounding: the cast plus one 32-bit random
# draw per element (two per 2 x float32 vector).
_SR_CYCLES_PER_VECTOR = 3


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


# ---------------------------------------------------------------------------
# tile_map
# ---------------------------------------------------------------------------


def _slice_mapping(ctx, shape, dtype, tiles: np.ndarray) -> TileMapping:
  """Slice ``i`` of the leading axis on ``tiles[i]``."""
  per = _size(shape[1:])
  if per == 0 or len(tiles) == 0:
    return ctx.linear_mapping(shape, dtype)
  return TileMapping.from_element_tiles(np.repeat(tiles, per))


@register_lowering(ops.tile_map_p)
def _tile_map_rule(ctx, *args, codelet, tiles):
  target = ctx.target
  tiles_arr = np.asarray(tiles, np.int64)
  if tiles_arr.size and tiles_arr.max() >= target.num_tiles:
    raise NotImplementedError(
        f"tile_map on tile {int(tiles_arr.max())}, but the target has only "
        f"{target.num_tiles} tiles")
  in_maps = [_slice_mapping(ctx, t.shape, t.dtype, tiles_arr) for t in args]
  outs = [ctx.new_tensor(a.shape, a.dtype,
                         _slice_mapping(ctx, a.shape, a.dtype, tiles_arr),
                         name=codelet.name)
          for a in ctx.out_avals]
  cost = add_costs(*[relayout_cost(target, t.mapping, m, t.itemsize)
                     for t, m in zip(args, in_maps)])
  in_specs = [jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in args]
  out_specs = [jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in outs]
  n = tiles_arr.size
  cycles = codelet_cycles(codelet, in_specs, out_specs, target)
  compute = estimators.vertex_cycles_per_tile(target, tiles_arr, np.full(n, cycles, np.float64),
                                              supervisor=np.full(n, is_supervisor(codelet)))
  vertices = np.bincount(tiles_arr, minlength=target.num_tiles)[:target.num_tiles]
  body = codelet_body(codelet)

  def fn(*storages):
    # Exchange: every slice to its tile; compute: one vertex per tile, i.e.
    # the codelet vmapped over the tile axis.
    xs = [to_flat(relayout(s, t.mapping, m), m).reshape(t.shape)
          for s, t, m in zip(storages, args, in_maps)]
    results = jax.vmap(body)(*xs) if n else [jnp.zeros(o.shape, o.dtype) for o in outs]
    return tuple(storage(r, o) for r, o in zip(results, outs))

  ctx.emit(P.Superstep(
      name=f"tile_map<{codelet.name}>", op=ctx.op, reads=tuple(args), writes=tuple(outs),
      fn=fn, compute_cycles=compute if n else None, exchange=cost, vertices=vertices,
      codelets=(codelet.name,), flops=codelet_flops(codelet, in_specs, out_specs) * n))
  return outs


# ---------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Grid and blocks of a matmul (``plan_matmul``'s).

  ``serial`` passes each compute ``1/serial`` of ``serial_axis`` (``"m"`` or
  ``"n"``) with the same grid, when no single pass fits in memory.
  """
  grid: tuple
  block: tuple
  label: str
  serial: int = 1
  serial_axis: str = "n"


def _plan(ctx, b, m, n, k, dtype, pdtype, proportion) -> _Plan:
  # Reduce groups with more tiles than output elements are reduce-scattered
  # here (the tiles past the block's elements only send): planned as such.
  p = plan_matmul(ctx.target, b, m, n, k, dtype, pdtype, proportion, tree_reduce=False)
  return _Plan(tuple(p.grid), tuple(p.block), p.label, int(p.serial), str(p.serial_axis))


def _extents(d: int, g: int, blk: int) -> np.ndarray:
  """Edge-aware sizes of ``g`` blocks of ``blk`` covering ``d``."""
  return np.clip(d - np.arange(g, dtype=np.int64) * blk, 0, blk)


def _block_coords(d: int, blk: int):
  """(block index, position in block) of each of ``d`` positions."""
  idx = np.arange(d, dtype=np.int64)
  return idx // blk, idx % blk


def _rows_mapping(row: np.ndarray, offset: np.ndarray, tiles: np.ndarray,
                  counts: np.ndarray) -> TileMapping:
  """A mapping from each element's storage row and offset in the row.

  Linear when rows are consecutive runs of equal length (no gather needed to
  reach the storage), else general. Rows with no elements are dropped.
  """
  n = row.size
  keep = counts > 0
  if not keep.all():
    remap = np.cumsum(keep) - 1
    row, tiles, counts = remap[row], tiles[keep], counts[keep]
  chunk = int(counts[0])
  if (counts[:-1] == chunk).all() and np.array_equal(row, np.arange(n, dtype=np.int64) // chunk):
    return TileMapping(n, tiles, counts, chunk=chunk)
  return TileMapping(n, tiles, counts, element_row=row, element_offset=offset)


def _operand_exchange(ctx, tensor: P.Tensor, canon_index: np.ndarray, duplicates: bool,
                      g0: np.ndarray, stride: int, fanout: int, block_size: np.ndarray,
                      phys: np.ndarray, grid_of_tile: np.ndarray) -> ExchangeCost:
  """Exact bytes to bring an operand's blocks onto the grid tiles.

  Args:
    tensor: the operand.
    canon_index: ``[E]`` flat operand element of each entry of the canonical
      problem (a pass may use part of the operand).
    duplicates: whether an element can appear in several entries (batch
      dimensions broadcast); it still leaves its tile once.
    g0: ``[E]`` grid index of the first tile that needs the entry; the others
      are ``g0 + j * stride`` for ``j < fanout`` (one multicast).
    block_size: ``[G]`` entries of this operand each grid tile needs.
    phys: ``[G]`` tile of each grid index; grid_of_tile: its inverse (-1 off
      the grid).
  """
  target = ctx.target
  t = target.num_tiles
  itemsize = tensor.itemsize
  element_tile = tensor.mapping.element_tile
  src = element_tile[canon_index]
  gs = grid_of_tile[src]
  diff = gs - g0
  local = (gs >= 0) & (diff >= 0) & (diff % stride == 0) & (diff < fanout * stride)
  local_count = np.bincount(gs[local], minlength=phys.size)[:phys.size]
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, phys, (block_size - local_count) * itemsize)
  # An element is sent unless its only destination is its own tile.
  sends = ~local if fanout == 1 else np.ones(src.shape, bool)
  if duplicates:
    send_tiles = element_tile[np.unique(canon_index[sends])]
  else:
    send_tiles = src[sends]
  bytes_out = np.bincount(send_tiles, minlength=t)[:t].astype(np.int64) * itemsize
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    # IPUs each multicast group reaches (a multicast crosses to each once).
    per = target.tiles_per_ipu
    groups = np.unique(g0)
    dest_ipu = phys[groups[:, None] + np.arange(fanout)[None, :] * stride] // per
    member = np.zeros((phys.size, target.num_ipus), bool)
    member[np.repeat(groups, fanout), dest_ipu.reshape(-1)] = True
    src_ipu = src // per
    other = member[g0].sum(axis=1) - member[g0, src_ipu]
    if duplicates:
      # Count each (element, group) once.
      _, first = np.unique(canon_index * phys.size + g0, return_index=True)
      keep = np.zeros(src.shape, bool)
      keep[first] = True
      other = np.where(keep, other, 0)
    link = np.bincount(src_ipu, weights=other, minlength=target.num_ipus)[:target.num_ipus]
    link = (link * itemsize).astype(np.int64)
  return ExchangeCost(bytes_in, bytes_out, link)


@dataclasses.dataclass
class _Pass:
  """One serial pass: rows ``[lo_m, hi_m)`` and columns ``[lo_n, hi_n)``."""
  lo_m: int
  hi_m: int
  lo_n: int
  hi_n: int
  elements: np.ndarray = None    # flat output elements, in pass-logical order
  rows: np.ndarray = None        # their storage row (grid index)
  local_offsets: np.ndarray = None
  counts: np.ndarray = None      # [G] elements per grid row in this pass
  block_elems: np.ndarray = None  # [G // gk] elements per output block


@register_lowering(ops.matmul_p)
def _matmul_rule(ctx, a, b, *, available_memory_proportion, partials_type):
  target = ctx.target
  out_aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(out_aval.shape), np.dtype(out_aval.dtype)
  batch = out_shape[:-2]
  bt, m, n, k = _size(batch), a.shape[-2], b.shape[-1], a.shape[-1]
  itemsize = out_dtype.itemsize
  proportion = (available_memory_proportion if available_memory_proportion is not None
                else ctx.options.available_memory_proportion)
  # The one partials rule of every matmul (lowering/matmul_plan.py); the
  # op's own partials_type overrides the configured one.
  pdtype = partials_dtype(out_dtype, out_dtype, partials_type or ctx.options.partials_type)
  if _size(out_shape) == 0:
    return [ctx.new_tensor(out_shape, out_dtype)]
  if k == 0:
    out = ctx.new_tensor(out_shape, out_dtype)
    elements = out.mapping.elements_per_tile(target.num_tiles)
    ctx.emit(P.Superstep(
        name="matmul/zeros", op=ctx.op, reads=(), writes=(out,),
        fn=lambda: (jnp.zeros(out.storage_shape, out_dtype),),
        compute_cycles=estimators.fill_cycles(target, elements, itemsize),
        vertices=worker_vertices(ctx, elements), codelets=("popops::Fill",)))
    return [out]

  plan = _plan(ctx, bt, m, n, k, out_dtype, pdtype, proportion)
  gb, gm, gn, gk = plan.grid
  bb, bm, bn, bk = plan.block
  num = gb * gm * gn * gk
  start = ctx.claim_tiles(num)
  phys = (start + np.arange(num, dtype=np.int64)) % target.num_tiles
  grid_of_tile = np.full(target.num_tiles, -1, np.int64)
  grid_of_tile[phys] = np.arange(num)
  ib, im, in_, ik = np.unravel_index(np.arange(num), (gb, gm, gn, gk))

  # Serial passes (poplin's serial split) run the grid over slices of M or N.
  length = m if plan.serial_axis == "m" else n
  step = -(-length // plan.serial)
  passes = []
  for p in range(plan.serial):
    lo, hi = p * step, min(length, (p + 1) * step)
    if plan.serial_axis == "m":
      passes.append(_Pass(lo, hi, 0, n))
    else:
      passes.append(_Pass(0, m, lo, hi))

  # Where every output element lives: grid tile of its block (and, with
  # gk > 1, the block's tile that reduces it), offset after earlier passes.
  qb, rb = _block_coords(bt, bb)
  xb = _extents(bt, gb, bb)
  total_counts = np.zeros(num, np.int64)
  element_row = np.empty(bt * m * n, np.int64)
  element_offset = np.empty(bt * m * n, np.int64)
  for ps in passes:
    pm, pn = ps.hi_m - ps.lo_m, ps.hi_n - ps.lo_n
    qm, rm = _block_coords(pm, bm)
    qn, rn = _block_coords(pn, bn)
    xm, xn = _extents(pm, gm, bm), _extents(pn, gn, bn)
    blk = (((qb * gm)[:, None, None] + qm[None, :, None]) * gn + qn[None, None, :]).reshape(-1)
    pos = (((rb[:, None, None] * xm[qm][None, :, None]) + rm[None, :, None])
           * xn[qn][None, None, :] + rn[None, None, :]).reshape(-1)
    ps.block_elems = (xb[ib] * xm[im] * xn[in_])[::gk]
    if gk == 1:
      ps.rows, ps.local_offsets, ps.counts = blk, pos, ps.block_elems.copy()
    else:
      ps.rows, ps.local_offsets = blk * gk + pos % gk, pos // gk
      ps.counts = np.maximum(0, -(-(ps.block_elems[:, None] - np.arange(gk)[None, :]) // gk)
                             ).reshape(-1)
    ps.elements = ((np.arange(bt)[:, None, None] * m + np.arange(ps.lo_m, ps.hi_m)[None, :, None])
                   * n + np.arange(ps.lo_n, ps.hi_n)[None, None, :]).reshape(-1)
    element_row[ps.elements] = ps.rows
    element_offset[ps.elements] = total_counts[ps.rows] + ps.local_offsets
    total_counts += ps.counts
  out = ctx.new_tensor(out_shape, out_dtype,
                       _rows_mapping(element_row, element_offset, phys, total_counts))
  partials = None
  if gk > 1:
    # Tile (ib, im, in, ik) holds its [bb, bm, bn] partial block (edge blocks
    # zero padded), tile-major, so the storage is a reshape. Passes reuse it.
    chunk = bb * bm * bn
    partials = ctx.new_tensor((num, chunk), pdtype,
                              TileMapping.blocks(num * chunk, chunk, target.num_tiles, start),
                              name="matmul/partials")
  a_index = np.broadcast_to(np.arange(a.size, dtype=np.int64).reshape(a.shape),
                            tuple(batch) + (m, k)).reshape(bt, m, k)
  b_index = np.broadcast_to(np.arange(b.size, dtype=np.int64).reshape(b.shape),
                            tuple(batch) + (k, n)).reshape(bt, k, n)
  a_dups = tuple(a.shape[:-2]) != tuple(batch)
  b_dups = tuple(b.shape[:-2]) != tuple(batch)
  mode = ctx.options.executor_mode
  geometry = (gb, gm, gn, gk, bb, bm, bn, bk)
  for p, ps in enumerate(passes):
    name = f"matmul[{plan.label}]" + (f"/pass{p}" if len(passes) > 1 else "")
    _emit_pass(ctx, a, b, out, partials, ps, p, len(passes), name, geometry, batch,
               a_index[:, ps.lo_m:ps.hi_m, :], b_index[:, :, ps.lo_n:ps.hi_n], a_dups,
               b_dups, phys, grid_of_tile, pdtype, mode)
  return [out]


def _emit_pass(ctx, a, b, out, partials, ps, p, num_passes, name, geometry, batch,
               a_index, b_index, a_dups, b_dups, phys, grid_of_tile, pdtype, mode):
  """Emit the superstep(s) of one pass: block products, then the reduction."""
  target = ctx.target
  gb, gm, gn, gk, bb, bm, bn, bk = geometry
  num = phys.size
  bt, pm, k = a_index.shape
  pn = b_index.shape[-1]
  out_dtype = out.dtype
  itemsize = out_dtype.itemsize
  ib, im, in_, ik = np.unravel_index(np.arange(num), (gb, gm, gn, gk))
  xb, xm, xn, xk = (_extents(bt, gb, bb), _extents(pm, gm, bm), _extents(pn, gn, bn),
                    _extents(k, gk, bk))
  eb, em, en, ek = xb[ib], xm[im], xn[in_], xk[ik]
  qb, _ = _block_coords(bt, bb)
  qm, _ = _block_coords(pm, bm)
  qn, _ = _block_coords(pn, bn)
  qk, _ = _block_coords(k, bk)
  # A block (ib, im, ik) goes to the gn tiles of its row, B block (ib, ik, in)
  # to the gm tiles of its column.
  a_g0 = (((qb * gm)[:, None, None] + qm[None, :, None]) * gn) * gk + qk[None, None, :]
  b_g0 = ((qb[:, None, None] * gm * gn + qn[None, None, :]) * gk) + qk[None, :, None]
  a_cost = _operand_exchange(ctx, a, a_index.reshape(-1), a_dups, a_g0.reshape(-1), gk, gn,
                             eb * em * ek, phys, grid_of_tile)
  b_cost = _operand_exchange(ctx, b, b_index.reshape(-1), b_dups, b_g0.reshape(-1), gn * gk,
                             gm, eb * ek * en, phys, grid_of_tile)
  macs = eb * em * en * ek
  compute = np.zeros(target.num_tiles, np.float64)
  np.add.at(compute, phys, estimators.matmul_cycles(target, macs, itemsize,
                                                    outputs=eb * em * en, dtype=out_dtype,
                                                    k=ek, n=en, groups=eb))
  note = estimators.mac_cost_note(out_dtype)
  notes = (note,) if note else ()
  vertices = np.zeros(target.num_tiles, np.int64)
  np.add.at(vertices, phys, np.where(macs > 0, np.minimum(target.worker_contexts, em), 0))
  flops = 2 * bt * pm * pn * k
  whole = num_passes == 1
  positions = None if whole else out.mapping.storage_position[ps.elements]
  pass_geometry = (gb, gm, gn, gk, bb, bm, bn, bk)
  lo_m, hi_m, lo_n, hi_n = ps.lo_m, ps.hi_m, ps.lo_n, ps.hi_n

  def operands(a_s, b_s):
    x, y = logical(a_s, a), logical(b_s, b)
    if not whole:
      x, y = x[..., lo_m:hi_m, :], y[..., lo_n:hi_n]
    return x, y

  def write(result, out_s=None):
    """The pass's results into the output's storage."""
    result = result.astype(out_dtype)
    if whole:
      return storage(result, out)
    base = jnp.zeros(out.storage_shape, out_dtype) if out_s is None else out_s
    flat = base.reshape(-1).at[positions].set(result.reshape(-1))
    return flat.reshape(out.storage_shape)

  # A later pass adds its part to the output the earlier passes wrote.
  carry = () if p == 0 else (out,)

  if gk == 1:
    def fn(a_s, b_s, *out_s):
      x, y = operands(a_s, b_s)
      if mode == "per_tile":
        r = _blocks_to_logical(_tile_products(x, y, batch, pass_geometry, pdtype, True),
                               batch, pass_geometry, pm, pn)
      else:
        r = _product(x, y, pdtype)
      return (write(r, *out_s),)

    ctx.emit(P.Superstep(
        name=name, op=ctx.op, reads=(a, b) + carry, writes=(out,), fn=fn,
        compute_cycles=compute, exchange=add_costs(a_cost, b_cost), vertices=vertices,
        codelets=("poplin::MatMulBlock",), flops=flops, notes=notes))
    return

  chunk = bb * bm * bn

  def partial_fn(a_s, b_s):
    x, y = operands(a_s, b_s)
    r = _tile_products(x, y, batch, pass_geometry, pdtype, mode == "per_tile")
    return (storage(r.reshape(num, chunk), partials),)

  ctx.emit(P.Superstep(
      name=f"{name}/partials", op=ctx.op, reads=(a, b), writes=(partials,),
      fn=partial_fn, compute_cycles=compute, exchange=add_costs(a_cost, b_cost),
      vertices=vertices, codelets=("poplin::MatMulBlock",), flops=flops, notes=notes))

  # Reduce: element `pos` of an output block is reduced on the block's tile
  # pos mod gk (each of the gk tiles reduces 1/gk of the block).
  counts = ps.counts
  reduce_cost = _reduce_exchange(ctx, counts.reshape(-1, gk), ps.block_elems, gk, phys,
                                 pdtype.itemsize)
  reduced = np.zeros(target.num_tiles, np.int64)
  np.add.at(reduced, phys, counts)
  reduce_compute = estimators.reduce_cycles(target, gk * reduced, pdtype.itemsize,
                                            outputs=reduced)

  def reduce_fn(p_s, *out_s):
    blocks = logical(p_s, partials).reshape(gb, gm, gn, gk, bb, bm, bn)
    total = jnp.sum(blocks, axis=3)
    return (write(_blocks_to_logical(total, batch, pass_geometry, pm, pn), *out_s),)

  ctx.emit(P.Superstep(
      name=f"{name}/reduce" if not whole else "matmul/reduce", op=ctx.op,
      reads=(partials,) + carry, writes=(out,), fn=reduce_fn,
      compute_cycles=reduce_compute, exchange=reduce_cost,
      vertices=worker_vertices(ctx, reduced), codelets=("popops::Reduce",),
      flops=int(bt * pm * pn * (gk - 1))))


def _reduce_exchange(ctx, count, block_elems, gk, phys, p_itemsize) -> ExchangeCost:
  """Bytes of the partials reduction.

  ``count[blk, j]`` elements of block ``blk`` are reduced on its tile ``j``,
  which receives them from the other ``gk - 1`` tiles of the block; tile
  ``j`` sends every element of its partial block that another tile reduces.
  """
  target = ctx.target
  t = target.num_tiles
  bytes_in = np.zeros(t, np.int64)
  np.add.at(bytes_in, phys, ((gk - 1) * count * p_itemsize).reshape(-1))
  bytes_out = np.zeros(t, np.int64)
  np.add.at(bytes_out, phys, ((block_elems[:, None] - count) * p_itemsize).reshape(-1))
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    ipu = (phys // target.tiles_per_ipu).reshape(-1, gk)
    crossing = ipu[:, :, None] != ipu[:, None, :]                  # [blk, src, dst]
    sent = (crossing * count[:, None, :]).sum(axis=2)               # [blk, src]
    link = np.bincount(ipu.reshape(-1), weights=sent.reshape(-1),
                       minlength=target.num_ipus)[:target.num_ipus]
    link = (link * p_itemsize).astype(np.int64)
  return ExchangeCost(bytes_in, bytes_out, link)


def _product(x, y, pdtype):
  return jnp.matmul(x, y, preferred_element_type=pdtype)


def _tile_products(x, y, batch, geometry, pdtype, per_tile: bool):
  """Every grid tile's partial block: ``[gb, gm, gn, gk, bb, bm, bn]``.

  ``per_tile`` runs one block product per tile under ``vmap`` (operand blocks
  replicated as the multicast delivers them); otherwise one einsum computes
  all blocks (the same products, arranged for the host).
  """
  gb, gm, gn, gk, bb, bm, bn, bk = geometry
  m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
  bt = _size(batch)
  x = jnp.broadcast_to(x, tuple(batch) + (m, k)).reshape(bt, m, k)
  y = jnp.broadcast_to(y, tuple(batch) + (k, n)).reshape(bt, k, n)
  x = jnp.pad(x, [(0, gb * bb - bt), (0, gm * bm - m), (0, gk * bk - k)])
  y = jnp.pad(y, [(0, gb * bb - bt), (0, gk * bk - k), (0, gn * bn - n)])
  xa = x.reshape(gb, bb, gm, bm, gk, bk)
  ya = y.reshape(gb, bb, gk, bk, gn, bn)
  if not per_tile:
    # One batched GEMM per k-block in the natural layout, then the blocks
    # are gathered tile-major (a transpose XLA does as one copy).
    xk = jnp.moveaxis(x.reshape(gb * bb, gm * bm, gk, bk), 2, 1)   # [Bp, gk, Mp, bk]
    yk = y.reshape(gb * bb, gk, bk, gn * bn)                       # [Bp, gk, bk, Np]
    r = _product(xk, yk, pdtype).astype(pdtype)                    # [Bp, gk, Mp, Np]
    return r.reshape(gb, bb, gk, gm, bm, gn, bn).transpose(0, 3, 5, 2, 1, 4, 6)
  xa = jnp.broadcast_to(xa.transpose(0, 2, 4, 1, 3, 5)[:, :, None],
                        (gb, gm, gn, gk, bb, bm, bk))
  ya = jnp.broadcast_to(ya.transpose(0, 4, 2, 1, 3, 5)[:, None],
                        (gb, gm, gn, gk, bb, bk, bn))
  tiles = gb * gm * gn * gk
  r = jax.vmap(lambda u, v: _product(u, v, pdtype).astype(pdtype))(
      xa.reshape((tiles, bb, bm, bk)), ya.reshape((tiles, bb, bk, bn)))
  return r.reshape(gb, gm, gn, gk, bb, bm, bn)


def _blocks_to_logical(blocks, batch, geometry, m, n):
  """``[gb, gm, gn, (1,) bb, bm, bn]`` blocks -> the ``[*batch, m, n]`` result."""
  gb, gm, gn, _, bb, bm, bn, _ = geometry
  blocks = blocks.reshape(gb, gm, gn, bb, bm, bn).transpose(0, 3, 1, 4, 2, 5)
  r = blocks.reshape(gb * bb, gm * bm, gn * bn)[:_size(batch), :m, :n]
  return r.reshape(tuple(batch) + (m, n))


# ---------------------------------------------------------------------------
# stochastic_round
# ---------------------------------------------------------------------------


@register_lowering(ops.stochastic_round_p)
def _stochastic_round_rule(ctx, x, key, *, dtype, impl):
  target = ctx.target
  out = ctx.new_tensor(x.shape, dtype, x.mapping, name="stochastic_round")
  if x.size == 0:
    return [out]
  elements = x.mapping.elements_per_tile(target.num_tiles)
  compute = estimators.worker_split_cycles(target, elements, _SR_CYCLES_PER_VECTOR, x.itemsize)

  def fn(x_s, k_s):
    keys = logical(k_s, key)
    # Bits of the logical array, laid out like x: each tile's vertex draws
    # the bits of the elements it holds.
    bits = to_storage(random_bits_for(keys, x.shape, impl).reshape(-1), x.mapping)
    return (round_with_bits(x_s, bits, dtype),)

  ctx.emit(P.Superstep(
      name="stochastic_round", op=ctx.op, reads=(x, key), writes=(out,), fn=fn,
      compute_cycles=compute, exchange=broadcast_cost(ctx, key, x.mapping.tiles),
      vertices=worker_vertices(ctx, elements), codelets=("popops::CastStochasticRound",),
      flops=int(x.size)))
  return [out]


# ---------------------------------------------------------------------------
# print_tensor
# ---------------------------------------------------------------------------


@register_lowering(ops.print_tensor_p)
def _print_tensor_rule(ctx, x, *, title):
  ctx.emit(P.PrintTensor(title, x))
  return [x]
