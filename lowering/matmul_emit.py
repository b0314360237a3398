"""The one matmul emitter: a planned block matmul and its partials reduction.

Used by every product of the lowering: ``dot_general``
(:mod:`ipu_jax.lowering.rules.dot`) and ``ipu_jax.ops.matmul``
(:mod:`ipu_jax.ops.matmul`, with the op's own
``available_memory_proportion`` and ``partials_type`` passed as parameters).
Convolutions share the planner's grid helpers and the partials rule
(``lowering/matmul_plan.py``) and :func:`fill_zeros`.

Tile plan. A product given as ``dot_general`` dimension numbers is
canonicalised to a batched product ``[B, M, K] x [B, K, N]`` (batch dims, then
the lhs free dims, then the rhs free dims, as ``dot_general`` orders its
result). :func:`~ipu_jax.lowering.matmul_plan.plan_matmul` picks a grid
``gb x gm x gn x gk`` of blocks, one per tile, by the cycle model (AMP rate,
exchange, partials reduction) under the available memory proportion. Two
supersteps follow (per serial pass, when the plan needs several passes to fit
in memory: each pass computes a slice of M or N and writes its part of the
result):

1. ``<name>/matmul <plan>``: the exchange brings tile ``(ib, im, in, ik)`` its
   A block ``[bb, bm, bk]`` and B block ``[bb, bk, bn]`` (an A block is
   multicast to the ``gn`` tiles that need it, a B block to ``gm``), then
   every tile multiplies its blocks on the AMP into a partial block in the
   partials type.
2. ``<name>/<plan> reduce`` (only when ``gk > 1``): the ``gk`` tiles that
   share an output block exchange their partials so that each sums ``1/gk``
   of the block (a reduce-scatter), casting to the result type. When the
   block has fewer elements than ``gk`` (a long contraction with a tiny
   result, e.g. a dot of two long vectors), the partials are summed in a
   tree instead: one superstep per stage (``<name>/<plan> stage s/S
   reduce``), each tile summing the ``plan.reduce_fanins[s]`` partial blocks
   of its group, so no tile receives more than a fan-in's worth; the result
   lies whole on the first tile of each group.

Types: the operands are costed in :func:`matmul_plan.operand_dtype` and
accumulate in :func:`matmul_plan.partials_dtype` (the one partials rule of
every matmul and convolution; a per-op ``partials_type`` replaces the
configured option before that rule applies). Complex products keep both
halves and cost four real MACs per MAC; float64 ones are computed in float64
and cost the software emulation the chip would run (``kernels/estimators.py``);
the matmul step carries a note saying so (``StepProfile.notes``).

The result stays where it was computed: output block ``(ib, im, in)`` lies on
its grid tiles (cut into ``gk`` pieces, or whole on the group's first tile
after a tree reduction; with serial passes a tile holds one piece per pass),
a block :class:`TileMapping` (general, or linear when the blocks happen to be
contiguous runs). Its storage is built from the logical result with pad /
reshape / transpose (:func:`~ipu_jax.lowering.matmul_plan.blocked_storage`).

Exchange accounting is exact per tile without per-destination index arrays:
every operand element knows its block, hence the set of grid tiles that need
it (a product of ranges); a tile receives its blocks' sizes less the elements
it already holds (found from the operand's real mapping), and a tile sends
each element it holds once if any other tile needs it (multicast), crossing
once to each other IPU its destinations span
(:func:`~ipu_jax.lowering.matmul_plan.grid_exchange_cost`). Per-tile
temporary memory: the received blocks are exchange buffers; the blocks' local
elements are copied into the AMP's block layout (the step's
``scratch_bytes``); the partials are a tensor. Together they equal the plan's
``temp_bytes``.

Execution. ``executor.mode = "per_tile"`` really cuts A and B into the
per-tile blocks with pad / reshape / transpose / broadcast (no gathers) and
vmaps a block matmul over the tile axis, then sums the partials; f32 uses
``Precision.HIGHEST``. With fp16 partials both modes do the arithmetic of
:mod:`~ipu_jax.lowering.half_partials` (each tile's AMP chains, then the
partials added in the plan's order, rounding each addition), so they agree
bit for bit. ``"batched"`` (the default) computes the whole product
on the logical arrays with the partials type as ``preferred_element_type``
(2-byte float operands widened to float32 partials first, exactly: XLA:CPU
cannot run some bf16 x bf16 -> f32 dots, see
:func:`~ipu_jax.lowering.matmul_plan.widen_to_partials`):
one ``lax.dot_general`` whatever the K split (``jax.jit``'s numbers; the
tiles' summation order of fp32 partials differs only in rounding), and
writes it straight into the result's tile storage in the first step; the
later steps (reduce, further passes) then have nothing left to do on the
host, while their cost is still counted. Batched steps also carry that
product as their logical form (:mod:`~ipu_jax.lowering.logical_form`), which
the executor runs on the operands' logical arrays.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import logical_form
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost, relative_base, shift_cost
from ipu_jax.lowering.mapping import TileMapping, tiles_key
from ipu_jax.lowering.matmul_plan import (block_grid_mapping, blocked_storage, ceil_div,
                                          edge_sizes, grid_tiles, operand_dtype,
                                          operand_exchange_cost, partials_dtype, plan_matmul,
                                          widen_to_partials)

__all__ = ["emit_matmul", "fill_zeros"]


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
                       vertices=worker_vertices(ctx, elements), codelets=(vocab.FILL,)))
  return out


def _prod(values) -> int:
  return int(np.prod([int(v) for v in values], dtype=np.int64))


_GRID_COSTS = plan_cache.PlanCache("matmul operand exchange", max_entries=4096)


def _frozen_grid_cost(result):
  """A cached ``(cost, local)`` pair, made read-only since it is shared."""
  cost, local = result
  arrays = [local] + ([] if cost is None else [cost.bytes_in, cost.bytes_out,
                                               cost.link_bytes_out])
  for a in arrays:
    a.setflags(write=False)
  return cost, local


def _operand_cost(target, operand: P.Tensor, key: tuple, tiles: np.ndarray, compute):
  """``compute()``'s ``(cost, local)`` of an operand's exchange, cached.

  The bytes depend only on which tile holds what (and, on several IPUs,
  which IPU), so the key counts tile ids from the grid's first tile (its
  IPU's first tile on several IPUs: :func:`~ipu_jax.lowering.exchange.relative_base`):
  a repeated layer whose grid and operand landed further along the tiles, or
  on another IPU, reuses the first layer's cost, moved along by as many tiles.
  """
  t, per = target.num_tiles, target.tiles_per_ipu
  base = relative_base(target, tiles[0])
  key = key + (operand.mapping.relative_fingerprint(base, t), operand.shape, operand.itemsize,
               tiles_key((tiles - base) % t), target)

  def relative():
    cost, local = compute()
    return _frozen_grid_cost((shift_cost(cost, -base, per), local))

  cost, local = plan_cache.cached(_GRID_COSTS, key, relative)
  return shift_cost(cost, base, per), local


def emit_matmul(ctx, lhs: P.Tensor, rhs: P.Tensor, dimension_numbers, out_shape: Sequence[int],
                out_dtype, *, precision=None, available_memory_proportion: Optional[float] = None,
                partials_type: Optional[str] = None, name: Optional[str] = None) -> P.Tensor:
  """Emit a planned block matmul (and its partials reduction); returns the result.

  Args:
    ctx: the rule context.
    lhs, rhs: the operands.
    dimension_numbers: ``dot_general``'s ``((lhs_contract, rhs_contract),
      (lhs_batch, rhs_batch))``; the result is laid out as ``dot_general``
      lays it out (batch, lhs free, rhs free).
    out_shape, out_dtype: the result's shape and type.
    precision: ``dot_general``'s precision (the batched executor's product).
    available_memory_proportion: the plan's share of tile memory; None: the
      configured ``matmuls.available_memory_proportion``.
    partials_type: ``"float32"`` or ``"float16"``; None: the configured
      ``matmuls.partials_type``. Either way :func:`partials_dtype` decides.
    name: prefix of the steps' and tensors' names (default: the op).
  """
  out_shape, out_dtype = tuple(int(d) for d in out_shape), np.dtype(out_dtype)
  name = name or ctx.op
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(a) for a in x) for x in (lc, rc, lb, rb))
  lf = tuple(a for a in range(len(lhs.shape)) if a not in lc and a not in lb)
  rf = tuple(a for a in range(len(rhs.shape)) if a not in rc and a not in rb)
  b = _prod(lhs.shape[a] for a in lb)
  m = _prod(lhs.shape[a] for a in lf)
  k = _prod(lhs.shape[a] for a in lc)
  n = _prod(rhs.shape[a] for a in rf)
  if b * m * n == 0:
    return ctx.new_tensor(out_shape, out_dtype)
  if k == 0:
    return fill_zeros(ctx, out_shape, out_dtype, f"{name}/zeros")

  target, options = ctx.target, ctx.options
  if available_memory_proportion is None:
    available_memory_proportion = options.available_memory_proportion
  in_dtype = operand_dtype(lhs.dtype, rhs.dtype)
  acc = partials_dtype(in_dtype, out_dtype, partials_type or options.partials_type)
  plan = plan_matmul(target, b, m, n, k, in_dtype, acc, available_memory_proportion)
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
  ib, im, in_, ik = np.unravel_index(np.arange(g_all), (gb, gm, gn, gk))
  num_tiles = target.num_tiles
  mode = options.executor_mode
  per_tile_precision = (lax.Precision.HIGHEST
                        if np.dtype(in_dtype) == np.float32 else precision)
  dn = ((lc, rc), (lb, rb))
  block = bb * bm * bn
  piece = ceil_div(block, gk)
  codelet = vocab.vertex(vocab.MATMUL_BLOCK, np.dtype(in_dtype), acc)
  half = half_partials.applies(in_dtype, acc)  # fp16 partials change the arithmetic
  label = plan.label

  def blocks_of(size, block_size):
    """Per position along a dimension: the one block needing it, ``[lo, lo + 1)``."""
    lo = np.arange(size, dtype=np.int64) // block_size
    return lo, lo + 1

  def full_product(a_st, b_st):
    """The whole product, [B, M, N] in the result type (batched mode).

    Whatever the K split, one ``lax.dot_general`` with the user's precision
    and the partials type as ``preferred_element_type``: the numbers
    ``jax.jit`` gives, to rounding. The tiles sum ``gk`` partials in their
    own order; reproducing that order (one product per K block and a sum of
    the partials) cost 5x a plain product on the whole chip and bought only
    a different rounding of fp32 sums, so it is not done. fp16 partials are
    the exception: rounding each partial and each addition to half precision
    changes the result, so :mod:`half_partials` keeps the plan's order.
    The per-tile accounting does not depend on this: it is the plan's.
    """
    return logical_product(logical(a_st, lhs), logical(b_st, rhs)).reshape(b, m, n)

  def logical_product(a, w):
    """:func:`full_product` of the operands' logical arrays, in the result's shape."""
    if half:
      return half_partials.planned_dot(
          jnp.transpose(a, lhs_perm).reshape(b, m, k),
          jnp.transpose(w, rhs_perm).reshape(b, k, n), gk, bk,
          fanins=plan.reduce_fanins).astype(out_dtype).reshape(out_shape)
    c = lax.dot_general(widen_to_partials(a, acc), widen_to_partials(w, acc), dn,
                        precision=precision, preferred_element_type=acc)
    return c.astype(out_dtype).reshape(out_shape)

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

    if half:  # fp16 partials: each tile's AMP chains, as the batched model
      return half_partials.tile_partials(a.reshape(g_all * bb, bm, bk),
                                         w.reshape(g_all * bb, bk, bn)).reshape(g_all, block)

    def block_matmul(x, y):
      x, y = widen_to_partials(x, acc), widen_to_partials(y, acc)
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
    x = x.reshape(g_out, gk, gk, piece)
    if half:  # the partials added in order, rounding each addition
      return half_partials.add_in_order(jnp.moveaxis(x, 1, 0)).reshape(g_all, piece)
    return x.sum(axis=1).reshape(g_all, piece)

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
    # Costs depend only on the operand's layout and the grid: a repeated
    # layer's matmuls look them up (see lowering/plan_cache.py).
    grid_key = ((gb, gm, gn, gk), (b, bb, pm_, bm, pn_, bn, k, bk), serial_axis, start, stop)
    if a_cost_all is None or serial_axis == 1:
      def a_cost_fn(start=start, stop=stop, pm_=pm_, rb_=rb_, rm_=rm_, rk_=rk_):
        needs = [(0,) + blocks_of(b, bb), (1,) + blocks_of(pm_, bm), None,
                 (2,) + blocks_of(k, bk)]
        window = ((0, b), (start, stop) if serial_axis == 1 else (0, m), (0, k))
        return operand_exchange_cost(target, lhs, lhs_perm, (b, m, k), (lb, lf, lc),
                                     (gb, gm, gn, gk), tiles, needs, rb_ * rm_ * rk_, window)
      a_cost_all = _operand_cost(target, lhs, ("lhs", lhs_perm) + grid_key, tiles, a_cost_fn)
    if b_cost_all is None or serial_axis == 2:
      def b_cost_fn(start=start, stop=stop, pn_=pn_, rb_=rb_, rk_=rk_, rn_=rn_):
        needs = [(0,) + blocks_of(b, bb), None, (2,) + blocks_of(pn_, bn),
                 (1,) + blocks_of(k, bk)]
        window = ((0, b), (0, k), (start, stop) if serial_axis == 2 else (0, n))
        return operand_exchange_cost(target, rhs, rhs_perm, (b, k, n), (rb, rc, rf),
                                     (gb, gm, gn, gk), tiles, needs, rb_ * rk_ * rn_, window)
      b_cost_all = _operand_cost(target, rhs, ("rhs", rhs_perm) + grid_key, tiles, b_cost_fn)
    (a_cost, a_local), (b_cost, b_local) = a_cost_all, b_cost_all
    macs = rb_ * rm_ * rn_ * rk_
    compute = np.zeros(num_tiles)
    compute[tiles] = estimators.matmul_cycles(target, macs, np.dtype(in_dtype).itemsize,
                                              outputs=rb_ * rm_ * rn_, dtype=in_dtype,
                                              k=rk_, n=rn_, groups=rb_)
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

      def logical_step(a, w, *prior, index=index):
        return (logical_product(a, w),) if index == 0 else (prior[0],)

      if mode != "per_tile":
        logical_form.attach(step, logical_step)
      ctx.emit(P.Superstep(
          name=f"{name}/matmul {label}{pass_name}", op=ctx.op, reads=(lhs, rhs) + result_in,
          writes=(out,), fn=step, compute_cycles=compute, exchange=_add(a_cost, b_cost),
          vertices=vertices, codelets=(codelet,), flops=flops, scratch_bytes=scratch,
          notes=notes))
      continue

    partials = ctx.new_tensor((g_all, block), acc,
                              TileMapping(g_all * block, tiles, np.full(g_all, block, np.int64),
                                          chunk=block),
                              name=f"{name}/partials")

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

    def logical_matmul_step(a, w, *prior, index=index, partials=partials):
      # Batched: the whole product in the first pass; the partials are never read.
      return (jnp.zeros(partials.shape, acc),
              logical_product(a, w) if index == 0 else prior[0])

    if mode != "per_tile":
      logical_form.attach(matmul_step, logical_matmul_step)
    ctx.emit(P.Superstep(
        name=f"{name}/matmul {label}{pass_name}", op=ctx.op, reads=(lhs, rhs) + result_in,
        writes=(partials, out), fn=matmul_step, compute_cycles=compute,
        exchange=_add(a_cost, b_cost), vertices=vertices, codelets=(codelet,), flops=flops,
        scratch_bytes=scratch, notes=notes))

    if plan.reduce_fanins:
      _emit_tree_reduce(ctx, partials, out, plan, tiles, rb_ * rm_ * rn_, mode, name)
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

    if mode != "per_tile":  # the matmul step wrote the result
      logical_form.attach(reduce_step, lambda p, out: (out,))
    ctx.emit(P.Superstep(
        name=f"{name}/{label}{pass_name} reduce", op=ctx.op, reads=(partials, out),
        writes=(out,), fn=reduce_step, compute_cycles=reduce_compute,
        exchange=ExchangeCost(bytes_in, bytes_out, link), vertices=reduce_vertices,
        codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out_dtype),),
        flops=int((gk - 1) * counts.sum()) if _is_float(out_dtype) else 0))
  return out


def _emit_tree_reduce(ctx, partials: P.Tensor, out: P.Tensor, plan, tiles: np.ndarray,
                      block_elements: np.ndarray, mode: str, name: str) -> None:
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
    name: prefix of the steps' and tensors' names.
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
                              name=f"{name}/partials{stage + 1}")

    def step(level_st, *out_st, count=count, new_count=new_count, fanin=fanin, last=last,
             result=result, members=members):
      if mode != "per_tile":
        # Batched mode wrote the result in the matmul step.
        return (out_st[0],) if last else (jnp.zeros(result.storage_shape, acc),)
      x = level_st.reshape(g_out, count, block)
      x = jnp.pad(x, ((0, 0), (0, new_count * fanin - count), (0, 0)))
      x = x.reshape(g_out, new_count, fanin, block)
      if half_partials.applies(acc, acc):  # in order, rounding each addition
        x = half_partials.add_in_order(jnp.moveaxis(x, 2, 0), members[None, :, None])
      else:
        x = x.sum(axis=2)
      if last:
        return (x.astype(out_dtype).reshape(out.storage_shape),)
      return (x.reshape(result.storage_shape),)

    if mode != "per_tile":  # the matmul step wrote the result
      logical_form.attach(step, lambda level, *out, last=last, result=result: (
          out[0],) if last else (jnp.zeros(result.shape, acc),))
    ctx.emit(P.Superstep(
        name=f"{name}/{plan.label} stage {stage + 1}/{len(plan.reduce_fanins)} reduce",
        op=ctx.op, reads=(level,) + ((out,) if last else ()), writes=(result,), fn=step,
        compute_cycles=compute, exchange=ExchangeCost(bytes_in, bytes_out, link),
        vertices=worker_vertices(ctx, outputs),
        codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out_dtype if last else acc),),
        flops=int(((members - 1).sum()) * elements.sum()) if _is_float(out_dtype) else 0))
    level, count, stride = result, new_count, stride * fanin


def _add(x: Optional[ExchangeCost], y: Optional[ExchangeCost]) -> Optional[ExchangeCost]:
  if x is None:
    return y
  if y is None:
    return x
  return x + y
