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
bit for bit. That is each step's ``fn``. Each step also carries its
logical form (``Superstep.logical``), which ``"batched"`` (the default) runs:
the whole product on the logical arrays with the partials type as
``preferred_element_type`` (2-byte float operands widened to float32 partials
first, exactly: XLA:CPU cannot run some bf16 x bf16 -> f32 dots, see
:func:`~ipu_jax.lowering.matmul_plan.widen_to_partials`): one
``lax.dot_general`` whatever the K split (``jax.jit``'s numbers; the tiles'
summation order of fp32 partials differs only in rounding), written into the
result by the first step; the later steps' forms (reduce, further passes)
have nothing left to do on the host, while their cost is still counted. The
executor, not this module, chooses between the forms.

Code. :func:`emit_matmul` is a short driver: :func:`_make_plan` canonicalises
the product (:class:`_Product`), plans it and creates the result (a frozen
:class:`_Plan`); then, per pass, :func:`_pass` gives the pass's block sizes,
:func:`_operand_costs` and :func:`_block_work` its figures, and the
``_emit_*`` helpers its supersteps. The steps' arithmetic
(:func:`_logical_product`, :func:`_pass_blocks`, :func:`_reduce_pieces`,
:func:`_tree_sum`) is module-level and reads the plan; the step functions
themselves are short closures over it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost, relative_base, shift_cost
from ipu_jax.lowering.mapping import TileMapping, tiles_key
from ipu_jax.lowering.options import proportion_for
from ipu_jax.lowering.matmul_plan import (BlockWork, MatmulPlan, block_grid_mapping, block_work,
                                          ceil_div, edge_sizes, grid_tiles, operand_dtype,
                                          operand_exchange_cost, operand_link_bytes,
                                          partials_dtype, plan_matmul,
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


def _operand_cost(target, key: tuple, exchange: "_OperandExchange"):
  """``(cost, local)`` of an operand's exchange, cached.

  The bytes depend only on which tile holds what (and, on several IPUs,
  which IPU), so the key counts tile ids from the grid's first tile (its
  IPU's first tile on several IPUs: :func:`~ipu_jax.lowering.exchange.relative_base`):
  a repeated layer whose grid and operand landed further along the tiles, or
  on another IPU, reuses the first layer's cost, moved along by as many tiles.
  On several IPUs a layer seldom lands a whole number of IPUs along, so the
  bytes in and out are also kept counted from the grid's first tile, and
  only the IPU-Link bytes are counted afresh (:func:`_tile_relative_cost`).
  """
  t, per = target.num_tiles, target.tiles_per_ipu
  operand, tiles = exchange.tensor, exchange.tiles
  base = relative_base(target, tiles[0])
  layout = (operand.shape, operand.itemsize, target)
  ipu_key = key + (operand.mapping.relative_fingerprint(base, t), tiles_key((tiles - base) % t))

  def relative():
    if target.num_ipus == 1:
      cost, local = exchange.cost(target)
    else:
      cost, local = _tile_relative_cost(target, key + layout, exchange)
    return _frozen_grid_cost((shift_cost(cost, -base, per), local))

  cost, local = plan_cache.cached(_GRID_COSTS, ipu_key + layout, relative)
  return shift_cost(cost, base, per), local


_TILE_COSTS = plan_cache.PlanCache("matmul operand tile bytes", max_entries=4096)


def _tile_relative_cost(target, key: tuple, exchange: "_OperandExchange") -> tuple:
  """``(cost, local)`` on several IPUs, its tile bytes cached from the grid's first tile.

  The bytes each tile sends and receives compare only tile identities (as on
  one IPU); the IPU-Link bytes are counted for this placement
  (:meth:`_OperandExchange.link_bytes`, given what each tile sends), or the
  whole exchange is costed where intervals cannot count them.
  """
  t, tiles = target.num_tiles, exchange.tiles
  first = int(tiles[0])
  key = key + ("tile bytes", exchange.tensor.mapping.relative_fingerprint(first, t),
               tiles_key((tiles - first) % t))
  fresh = []

  def tile_bytes():
    cost, local = exchange.cost(target)
    fresh.append(cost)
    return _frozen_grid_cost((shift_cost(_without_link(cost), -first), local))

  cost, local = plan_cache.cached(_TILE_COSTS, key, tile_bytes)
  if fresh:
    return fresh[0], local
  cost = shift_cost(cost, first)
  if cost is None:
    return None, local
  itemsize = exchange.tensor.itemsize
  link = exchange.link_bytes(target, cost.bytes_out // itemsize)
  if link is None:
    return exchange.cost(target)
  return ExchangeCost(cost.bytes_in, cost.bytes_out, link), local


def _without_link(cost):
  """``cost`` with zero IPU-Link bytes (they do not move with the tiles)."""
  if cost is None:
    return None
  return ExchangeCost(cost.bytes_in, cost.bytes_out, np.zeros_like(cost.link_bytes_out))


@dataclasses.dataclass(frozen=True)
class _Product:
  """A ``dot_general`` canonicalised to ``[B, M, K] x [B, K, N]``.

  Attributes:
    lhs_dims: the lhs axes ``(batch, free, contracting)``.
    rhs_dims: the rhs axes ``(batch, contracting, free)``.
    b, m, n, k: the canonical sizes.
  """
  lhs_dims: tuple
  rhs_dims: tuple
  b: int
  m: int
  n: int
  k: int

  @property
  def lhs_perm(self) -> tuple:
    """The lhs transposed to ``[B, M, K]`` order."""
    return sum(self.lhs_dims, ())

  @property
  def rhs_perm(self) -> tuple:
    """The rhs transposed to ``[B, K, N]`` order."""
    return sum(self.rhs_dims, ())

  @property
  def dimension_numbers(self) -> tuple:
    (lb, _, lc), (rb, rc, _) = self.lhs_dims, self.rhs_dims
    return ((lc, rc), (lb, rb))


def _canonical(lhs_shape, rhs_shape, dimension_numbers) -> _Product:
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(a) for a in x) for x in (lc, rc, lb, rb))
  lf = tuple(a for a in range(len(lhs_shape)) if a not in lc and a not in lb)
  rf = tuple(a for a in range(len(rhs_shape)) if a not in rc and a not in rb)
  return _Product((lb, lf, lc), (rb, rc, rf), b=_prod(lhs_shape[a] for a in lb),
                  m=_prod(lhs_shape[a] for a in lf), n=_prod(rhs_shape[a] for a in rf),
                  k=_prod(lhs_shape[a] for a in lc))


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Everything the steps of one planned matmul share.

  Attributes:
    prod: the canonical product.
    lhs, rhs, out: the operands and the result.
    out_mapping: the result's block-grid mapping.
    plan: the :class:`~ipu_jax.lowering.matmul_plan.MatmulPlan`.
    tiles: ``[g_all]`` tile of each grid index ``(ib, im, in, ik)``.
    in_dtype, acc: the operands' costed type and the partials type.
    precision: ``dot_general``'s precision.
    notes: the matmul step's notes (float64 emulation).
    serial_axis: 1 (M) or 2 (N) when the plan has several passes, else None.
    length: the cut axis's elements per pass (0 with one pass).
    out_pieces: pieces each output block is cut into (1 after a tree reduction).
    pass_counts: ``[g_all, passes]`` result elements each tile reduces per
      pass (a reduce-scatter), or None.
    name: prefix of the steps' and tensors' names.
  """
  prod: _Product
  lhs: P.Tensor
  rhs: P.Tensor
  out: P.Tensor
  out_mapping: TileMapping
  plan: MatmulPlan
  tiles: np.ndarray
  in_dtype: np.dtype
  acc: np.dtype
  precision: object
  notes: tuple
  serial_axis: Optional[int]
  length: int
  out_pieces: int
  pass_counts: Optional[np.ndarray]
  name: str

  @property
  def passes(self) -> int:
    return self.plan.serial

  @property
  def serial(self) -> tuple:
    return (self.serial_axis, self.passes)

  @property
  def g_out(self) -> int:
    gb, gm, gn, _ = self.plan.grid
    return gb * gm * gn

  @property
  def g_all(self) -> int:
    return self.g_out * self.plan.grid[3]

  @property
  def block(self) -> int:
    """Elements of a full output block."""
    bb, bm, bn, _ = self.plan.block
    return bb * bm * bn

  @property
  def piece(self) -> int:
    """Elements of an output block each tile of a reduce-scatter sums."""
    return ceil_div(self.block, self.plan.grid[3])

  @property
  def out_dtype(self) -> np.dtype:
    return self.out.dtype

  @property
  def half(self) -> bool:
    """fp16 partials change the arithmetic (:mod:`half_partials`)."""
    return half_partials.applies(self.in_dtype, self.acc)


def _make_plan(ctx, lhs: P.Tensor, rhs: P.Tensor, prod: _Product, out_shape, out_dtype,
               precision, available_memory_proportion, partials_type, name,
               serial=None) -> _Plan:
  """Plan the product, claim its grid's tiles and create the result."""
  options = ctx.options
  if available_memory_proportion is None:
    # A plan may spread over every IPU of the program: the tightest of theirs.
    available_memory_proportion = proportion_for(options.available_memory_proportion,
                                                 range(ctx.target.num_ipus))
  b, m, n, k = prod.b, prod.m, prod.n, prod.k
  in_dtype = operand_dtype(lhs.dtype, rhs.dtype)
  acc = partials_dtype(in_dtype, out_dtype, partials_type or options.partials_type)
  plan = plan_matmul(ctx.target, b, m, n, k, in_dtype, acc, available_memory_proportion,
                     serial=serial)
  note = estimators.mac_cost_note(in_dtype)
  gb, gm, gn, gk = plan.grid
  bb, bm, bn, _ = plan.block
  passes = plan.serial
  serial_axis = (2 if plan.serial_axis == "n" else 1) if passes > 1 else None
  length = ceil_div((b, m, n)[serial_axis], passes) if passes > 1 else 0
  g_out = gb * gm * gn
  tiles = grid_tiles(ctx, g_out * gk)
  # A tree reduction leaves each output block whole on its group's first
  # tile; a reduce-scatter leaves 1/gk of it on each tile of the group.
  out_pieces = 1 if plan.reduce_fanins else gk
  out_tiles = tiles.reshape(g_out, gk)[:, 0] if plan.reduce_fanins else tiles
  out_mapping = block_grid_mapping((b, m, n), (gb, gm, gn), (bb, bm, bn), out_tiles,
                                   pieces=out_pieces, serial=(serial_axis, passes))
  out = ctx.new_tensor(out_shape, out_dtype, out_mapping)
  p = _Plan(prod=prod, lhs=lhs, rhs=rhs, out=out, out_mapping=out_mapping, plan=plan, tiles=tiles,
            in_dtype=in_dtype, acc=acc, precision=precision,
            notes=(note,) if note else (), serial_axis=serial_axis, length=length,
            out_pieces=out_pieces, pass_counts=None, name=name)
  return dataclasses.replace(p, pass_counts=_pass_counts(p))


def _pass_counts(p: _Plan) -> Optional[np.ndarray]:
  """Result elements per tile and pass (a pass's pieces sit side by side)."""
  if p.plan.reduce_fanins:
    return None
  if p.passes == 1:
    return p.out_mapping.counts[:, None]
  g_all, passes = p.g_all, p.passes
  # From the mapping's runs, each cut where it crosses a piece: per-element
  # rows and offsets of a vocabulary-sized result are 8 B x its size each.
  _, length, row, offset = p.out_mapping.runs
  first, last = offset // p.piece, (offset + length - 1) // p.piece
  cuts = last - first + 1
  run = np.repeat(np.arange(row.size), cuts)
  k = first[run] + (np.arange(run.size) - np.repeat(np.cumsum(cuts) - cuts, cuts))
  lo = np.maximum(offset[run], k * p.piece)
  hi = np.minimum(offset[run] + length[run], (k + 1) * p.piece)
  return np.bincount(row[run] * passes + k, weights=hi - lo,
                     minlength=g_all * passes)[:g_all * passes].astype(np.int64).reshape(
                         g_all, passes)


def emit_matmul(ctx, lhs: P.Tensor, rhs: P.Tensor, dimension_numbers, out_shape: Sequence[int],
                out_dtype, *, precision=None, available_memory_proportion: Optional[float] = None,
                partials_type: Optional[str] = None, name: Optional[str] = None,
                serial: Optional[tuple] = None) -> P.Tensor:
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
    serial: ``(axis, count)``: ``count`` serial passes (or a multiple, when
      a piece does not fit) along the canonical ``"m"`` (the lhs free dims)
      or ``"n"`` (the rhs free dims)
      (:func:`~ipu_jax.lowering.matmul_plan.plan_matmul`'s ``serial``); None:
      passes only when nothing else fits.
  """
  out_shape, out_dtype = tuple(int(d) for d in out_shape), np.dtype(out_dtype)
  name = name or ctx.op
  prod = _canonical(lhs.shape, rhs.shape, dimension_numbers)
  if prod.b * prod.m * prod.n == 0:
    return ctx.new_tensor(out_shape, out_dtype)
  if prod.k == 0:
    return fill_zeros(ctx, out_shape, out_dtype, f"{name}/zeros")
  p = _make_plan(ctx, lhs, rhs, prod, out_shape, out_dtype, precision,
                 available_memory_proportion, partials_type, name, serial)
  gk = p.plan.grid[3]
  # The operand that is not cut into passes is exchanged the same way in
  # every pass: cost it once.
  costs = (None, None)
  for index in range(p.passes):
    ps = _pass(p, index)
    costs = _operand_costs(ctx.target, p, ps, costs)
    (a_cost, a_local), (b_cost, b_local) = costs
    work = _block_work(ctx.target, p, ps, a_local, b_local)
    exchange = _add(a_cost, b_cost)
    if gk == 1:
      _emit_whole_blocks(ctx, p, ps, work, exchange)
      continue
    partials = _emit_partial_blocks(ctx, p, ps, work, exchange)
    if p.plan.reduce_fanins:
      _emit_tree_reduce(ctx, partials, p.out, p.plan, p.tiles, ps.outputs, p.name)
    else:
      _emit_reduce_scatter(ctx, p, ps, partials)
  return p.out


# --- Arithmetic (the steps' functions) -------------------------------------------------------


def _logical_product(p: _Plan, a, w):
  """The whole product of the logical operands, in the result's shape and type.

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
  prod, acc = p.prod, p.acc
  if p.half:
    return half_partials.planned_dot(
        jnp.transpose(a, prod.lhs_perm).reshape(prod.b, prod.m, prod.k),
        jnp.transpose(w, prod.rhs_perm).reshape(prod.b, prod.k, prod.n), p.plan.grid[3],
        p.plan.block[3], fanins=p.plan.reduce_fanins).astype(p.out_dtype).reshape(p.out.shape)
  c = lax.dot_general(widen_to_partials(a, acc), widen_to_partials(w, acc),
                      prod.dimension_numbers, precision=p.precision, preferred_element_type=acc)
  return c.astype(p.out_dtype).reshape(p.out.shape)


def _tile_blocks(p: _Plan, a_st, b_st, start, stop):
  """Each grid tile's A and B blocks of one pass, ``[G, bb, bm, bk]`` and ``[G, bb, bk, bn]``.

  Pad / reshape / transpose / broadcast of the logical operands, no gathers.
  """
  prod = p.prod
  gb, gm, gn, gk = p.plan.grid
  bb, bm, bn, bk = p.plan.block
  g_all = p.g_all
  a = jnp.transpose(logical(a_st, p.lhs), prod.lhs_perm).reshape(prod.b, prod.m, prod.k)
  w = jnp.transpose(logical(b_st, p.rhs), prod.rhs_perm).reshape(prod.b, prod.k, prod.n)
  common = jnp.promote_types(a.dtype, w.dtype)
  a, w = a.astype(common), w.astype(common)
  if p.serial_axis == 1:
    a = a[:, start:stop]
  elif p.serial_axis == 2:
    w = w[:, :, start:stop]
  pb, pm, pk, pn = a.shape[0], a.shape[1], a.shape[2], w.shape[2]
  a = jnp.pad(a, ((0, gb * bb - pb), (0, gm * bm - pm), (0, gk * bk - pk)))
  a = a.reshape(gb, bb, gm, bm, gk, bk).transpose(0, 2, 4, 1, 3, 5)
  a = jnp.broadcast_to(a[:, :, None], (gb, gm, gn, gk, bb, bm, bk)).reshape(g_all, bb, bm, bk)
  w = jnp.pad(w, ((0, gb * bb - pb), (0, gk * bk - pk), (0, gn * bn - pn)))
  w = w.reshape(gb, bb, gk, bk, gn, bn).transpose(0, 4, 2, 1, 3, 5)
  w = jnp.broadcast_to(w[:, None], (gb, gm, gn, gk, bb, bk, bn)).reshape(g_all, bb, bk, bn)
  return a, w


def _pass_blocks(p: _Plan, a_st, b_st, start, stop):
  """Per-tile partial blocks ``[G, bb*bm*bn]`` of one pass (per_tile mode)."""
  a, w = _tile_blocks(p, a_st, b_st, start, stop)
  bb, bm, bn, bk = p.plan.block
  g_all, acc = p.g_all, p.acc
  if p.half:  # fp16 partials: each tile's AMP chains, as the batched model
    return half_partials.tile_partials(a.reshape(g_all * bb, bm, bk),
                                       w.reshape(g_all * bb, bk, bn)).reshape(g_all, p.block)
  # f32 blocks use HIGHEST: the per-tile arithmetic is the AMP's, not XLA:CPU's default.
  precision = lax.Precision.HIGHEST if np.dtype(p.in_dtype) == np.float32 else p.precision

  def block_matmul(x, y):
    x, y = widen_to_partials(x, acc), widen_to_partials(y, acc)
    return lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,))),
                           precision=precision, preferred_element_type=acc)

  return jax.vmap(block_matmul)(a, w).reshape(g_all, p.block)


def _put(p: _Plan, out_st, index, value):
  """Write one pass's pieces into the result storage."""
  if p.passes == 1:
    return value.astype(p.out_dtype)
  rows = out_st.shape[0]
  return out_st.reshape(rows, p.passes, -1).at[:, index].set(value.astype(p.out_dtype)).reshape(
      rows, -1)


def _reduce_pieces(p: _Plan, p_st):
  """Each tile's sum of its piece of the block's ``gk`` partials (per_tile mode)."""
  gk, g_out, block, piece = p.plan.grid[3], p.g_out, p.block, p.piece
  x = p_st.reshape(g_out, gk, block)
  if piece * gk != block:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, piece * gk - block)))
  x = x.reshape(g_out, gk, gk, piece)
  if p.half:  # the partials added in order, rounding each addition
    return half_partials.add_in_order(jnp.moveaxis(x, 1, 0)).reshape(p.g_all, piece)
  return x.sum(axis=1).reshape(p.g_all, piece)


# --- One pass: costs ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Pass:
  """One serial pass: its slice of the cut axis and every grid tile's block sizes.

  Attributes:
    index: the pass.
    start, stop: its slice of the cut axis (0 and None with one pass).
    pm, pn: the rows and columns of the result it computes.
    rb, rm, rn, rk: ``[g_all]`` block sizes of every grid tile (edge blocks
      are short).
    suffix: the steps' name suffix (``" pass i/n"``, or empty).
  """
  index: int
  start: int
  stop: Optional[int]
  pm: int
  pn: int
  rb: np.ndarray
  rm: np.ndarray
  rn: np.ndarray
  rk: np.ndarray
  suffix: str

  @property
  def outputs(self) -> np.ndarray:
    """``[g_all]`` elements of each grid tile's output block."""
    return self.rb * self.rm * self.rn


def _pass(p: _Plan, index: int) -> _Pass:
  prod, passes, axis = p.prod, p.passes, p.serial_axis
  b, m, n, k = prod.b, prod.m, prod.n, prod.k
  gb, gm, gn, gk = p.plan.grid
  bb, bm, bn, bk = p.plan.block
  start = index * p.length if passes > 1 else 0
  stop = min(start + p.length, (b, m, n)[axis]) if passes > 1 else None
  pm = (stop - start) if axis == 1 else m
  pn = (stop - start) if axis == 2 else n
  ib, im, in_, ik = np.unravel_index(np.arange(p.g_all), (gb, gm, gn, gk))
  return _Pass(index, start, stop, pm, pn, edge_sizes(b, gb, bb)[ib], edge_sizes(pm, gm, bm)[im],
               edge_sizes(pn, gn, bn)[in_], edge_sizes(k, gk, bk)[ik],
               f" pass {index + 1}/{passes}" if passes > 1 else "")


def _blocks_of(size, block_size):
  """Per position along a dimension: the one block needing it, ``[lo, lo + 1)``."""
  lo = np.arange(size, dtype=np.int64) // block_size
  return lo, lo + 1


@dataclasses.dataclass(frozen=True)
class _OperandExchange:
  """One operand's exchange of a pass, as ``operand_exchange_cost`` takes it.

  Attributes:
    tensor, perm, canon_shape, groups: the operand and its canonical view.
    grid, tiles, needs: the grid, its tiles and which blocks need what.
    elements: elements of each grid tile's block.
    window: the ``(start, stop)`` taken of each canonical axis.
  """

  tensor: P.Tensor
  perm: tuple
  canon_shape: tuple
  groups: tuple
  grid: tuple
  tiles: np.ndarray
  needs: list
  elements: int
  window: tuple

  def cost(self, target) -> tuple:
    """``(cost, local)`` of the exchange."""
    return operand_exchange_cost(target, self.tensor, self.perm, self.canon_shape, self.groups,
                                 self.grid, self.tiles, self.needs, self.elements, self.window)

  def link_bytes(self, target, sent):
    """Its IPU-Link bytes alone, given what each tile sends (None: cost it whole)."""
    return operand_link_bytes(target, self.tensor, self.perm, self.canon_shape, self.groups,
                              self.grid, self.tiles, self.needs, sent, self.window)


def _lhs_exchange(p: _Plan, ps: _Pass) -> _OperandExchange:
  """Bringing every grid tile its A blocks of a pass."""
  prod, (bb, bm, _, bk) = p.prod, p.plan.block
  b, m, k = prod.b, prod.m, prod.k
  needs = [(0,) + _blocks_of(b, bb), (1,) + _blocks_of(ps.pm, bm), None,
           (2,) + _blocks_of(k, bk)]
  window = ((0, b), (ps.start, ps.stop) if p.serial_axis == 1 else (0, m), (0, k))
  return _OperandExchange(p.lhs, prod.lhs_perm, (b, m, k), prod.lhs_dims, tuple(p.plan.grid),
                          p.tiles, needs, ps.rb * ps.rm * ps.rk, window)


def _rhs_exchange(p: _Plan, ps: _Pass) -> _OperandExchange:
  """Bringing every grid tile its B blocks of a pass."""
  prod, (bb, _, bn, bk) = p.prod, p.plan.block
  b, n, k = prod.b, prod.n, prod.k
  needs = [(0,) + _blocks_of(b, bb), None, (2,) + _blocks_of(ps.pn, bn),
           (1,) + _blocks_of(k, bk)]
  window = ((0, b), (0, k), (ps.start, ps.stop) if p.serial_axis == 2 else (0, n))
  return _OperandExchange(p.rhs, prod.rhs_perm, (b, k, n), prod.rhs_dims, tuple(p.plan.grid),
                          p.tiles, needs, ps.rb * ps.rk * ps.rn, window)


def _operand_costs(target, p: _Plan, ps: _Pass, previous: tuple) -> tuple:
  """The pass's ``((a_cost, a_local), (b_cost, b_local))``.

  An operand not cut into passes keeps ``previous``'s (costed in the first
  pass). A pass needs only its slice of the cut operand (tables index the
  slice). Costs depend only on the operand's layout and the grid: a repeated
  layer's matmuls look them up (see lowering/plan_cache.py).
  """
  prod, (gb, gm, gn, gk), (bb, bm, bn, bk) = p.prod, p.plan.grid, p.plan.block
  a_all, b_all = previous
  grid_key = ((gb, gm, gn, gk), (prod.b, bb, ps.pm, bm, ps.pn, bn, prod.k, bk), p.serial_axis,
              ps.start, ps.stop)
  if a_all is None or p.serial_axis == 1:
    a_all = _operand_cost(target, ("lhs", prod.lhs_perm) + grid_key, _lhs_exchange(p, ps))
  if b_all is None or p.serial_axis == 2:
    b_all = _operand_cost(target, ("rhs", prod.rhs_perm) + grid_key, _rhs_exchange(p, ps))
  return a_all, b_all


def _block_work(target, p: _Plan, ps: _Pass, a_local, b_local) -> BlockWork:
  macs = ps.rb * ps.rm * ps.rn * ps.rk
  cycles = estimators.matmul_cycles(target, macs, np.dtype(p.in_dtype).itemsize,
                                    outputs=ps.rb * ps.rm * ps.rn, dtype=p.in_dtype,
                                    k=ps.rk, n=ps.rn, groups=ps.rb)
  # Local elements of the blocks are copied into the AMP's block layout; the
  # received ones sit in the exchange buffers (counted by the analysis).
  scratch = a_local * p.lhs.itemsize + b_local * p.rhs.itemsize
  if p.plan.grid[3] == 1 and p.acc != p.out_dtype:
    scratch = scratch + ps.rb * ps.rm * ps.rn * p.acc.itemsize
  return block_work(target, p.tiles, macs, cycles, scratch, _is_float(p.out_dtype))


# --- One pass: emission ---------------------------------------------------------------------


def _matmul_step(ctx, p: _Plan, ps: _Pass, work: BlockWork, exchange, writes, fn, logical):
  """The pass's block-matmul superstep (a pass also reads the result it adds to)."""
  result_in = (p.out,) if p.passes > 1 else ()  # a single pass writes it whole
  return P.Superstep(
      name=f"{p.name}/matmul {p.plan.label}{ps.suffix}", op=ctx.op,
      reads=(p.lhs, p.rhs) + result_in, writes=writes, fn=fn, logical=logical,
      compute_cycles=work.compute,
      exchange=exchange, vertices=work.vertices,
      codelets=(vocab.vertex(vocab.MATMUL_BLOCK, np.dtype(p.in_dtype), p.acc),),
      flops=work.flops, scratch_bytes=work.scratch, notes=p.notes,
      flops_dtype=np.dtype(p.in_dtype))


def _emit_whole_blocks(ctx, p: _Plan, ps: _Pass, work: BlockWork, exchange) -> None:
  """``gk == 1``: each tile's product block is its piece of the result."""
  index = ps.index

  def step(a_st, b_st, *out_st):
    prior = out_st[0] if out_st else None
    return (_put(p, prior, index, _pass_blocks(p, a_st, b_st, ps.start, ps.stop)),)

  def logical_step(a, w, *prior):
    # The whole product at once; later passes have nothing to do.
    return (_logical_product(p, a, w),) if index == 0 else (prior[0],)

  ctx.emit(_matmul_step(ctx, p, ps, work, exchange, (p.out,), step, logical_step))


def _emit_partial_blocks(ctx, p: _Plan, ps: _Pass, work: BlockWork, exchange) -> P.Tensor:
  """``gk > 1``: each tile's product block is a partial block; returns the partials."""
  g_all, block, acc, out, index = p.g_all, p.block, p.acc, p.out, ps.index
  partials = ctx.new_tensor((g_all, block), acc,
                            TileMapping(g_all * block, p.tiles, np.full(g_all, block, np.int64),
                                        chunk=block),
                            name=f"{p.name}/partials")

  def step(a_st, b_st, *out_st):
    prior = out_st[0] if out_st else jnp.zeros(out.storage_shape, out.dtype)
    return _pass_blocks(p, a_st, b_st, ps.start, ps.stop), prior

  def logical_step(a, w, *prior):
    # The whole product in the first pass, written straight into the result;
    # the partials are never read (XLA drops them), nor are the reductions'.
    return (jnp.zeros(partials.shape, acc),
            _logical_product(p, a, w) if index == 0 else prior[0])

  ctx.emit(_matmul_step(ctx, p, ps, work, exchange, (partials, out), step, logical_step))
  return partials


def _scatter_exchange(target, tiles: np.ndarray, group: np.ndarray, p_size: int) -> ExchangeCost:
  """Bytes of a reduce-scatter: tile ``j`` of a group gets ``group[:, j]`` from each other."""
  g_out, gk = group.shape
  bytes_in = np.zeros(target.num_tiles, np.int64)
  bytes_out = np.zeros(target.num_tiles, np.int64)
  bytes_in[tiles] = ((gk - 1) * group).reshape(-1) * p_size
  bytes_out[tiles] = (group.sum(axis=1, keepdims=True) - group).reshape(-1) * p_size
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    n_ipus = target.num_ipus
    ipu = (tiles // target.tiles_per_ipu).reshape(g_out, gk)
    # A tile sends its group's pieces for the tiles on other IPUs: the
    # group's total less what its own IPU's tiles take.
    slot = np.arange(g_out)[:, None] * n_ipus + ipu  # [group, tile]: (group, IPU)
    on_ipu = np.bincount(slot.reshape(-1), weights=group.reshape(-1),
                         minlength=g_out * n_ipus)[:g_out * n_ipus]
    sent = (group.sum(axis=1, keepdims=True) - on_ipu[slot]) * p_size  # [group, src]
    link = np.bincount(ipu.reshape(-1), weights=sent.reshape(-1),
                       minlength=n_ipus)[:n_ipus].astype(np.int64)
  return ExchangeCost(bytes_in, bytes_out, link)


def _emit_reduce_scatter(ctx, p: _Plan, ps: _Pass, partials: P.Tensor) -> None:
  """Reduce-scatter of the partials: each tile sums its piece of the block."""
  target, tiles, gk, acc, out, index = (ctx.target, p.tiles, p.plan.grid[3], p.acc, p.out,
                                        ps.index)
  counts = p.pass_counts[:, index]  # [g_all] result elements each tile reduces
  p_size = acc.itemsize
  reduce_compute = np.zeros(target.num_tiles)
  reduce_compute[tiles] = estimators.reduce_cycles(target, gk * counts, p_size, outputs=counts)
  reduce_vertices = np.zeros(target.num_tiles, np.int64)
  reduce_vertices[tiles] = worker_vertices(ctx, counts)

  def reduce_step(p_st, out_st):
    return (_put(p, out_st, index, _reduce_pieces(p, p_st)),)

  ctx.emit(P.Superstep(
      name=f"{p.name}/{p.plan.label}{ps.suffix} reduce", op=ctx.op, reads=(partials, out),
      writes=(out,), fn=reduce_step,
      # The matmul step's logical form wrote the result.
      logical=lambda partial_blocks, result: (result,), compute_cycles=reduce_compute,
      exchange=_scatter_exchange(target, tiles, counts.reshape(p.g_out, gk), p_size),
      vertices=reduce_vertices, codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out.dtype),),
      flops=int((gk - 1) * counts.sum()) if _is_float(out.dtype) else 0))


# --- Tree reduction -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TreeStage:
  """One stage of a tree reduction: groups of ``fanin`` partials summed on their first tile.

  Attributes:
    count, new_count: partials per output block before and after the stage.
    fanin: partials a group sums.
    members: ``[new_count]`` partials in each group (the last may be short).
    receivers: ``[g_out, new_count]`` the tile summing each group.
    exchange: the stage's bytes.
    compute: ``[num_tiles]`` cycles.
    outputs: ``[num_tiles]`` elements each tile writes.
  """
  count: int
  new_count: int
  fanin: int
  members: np.ndarray
  receivers: np.ndarray
  exchange: ExchangeCost
  compute: np.ndarray
  outputs: np.ndarray

  @property
  def last(self) -> bool:
    return self.new_count == 1


def _tree_stage(target, group_tiles: np.ndarray, elements: np.ndarray, p_size: int, count: int,
                stride: int, fanin: int) -> _TreeStage:
  """A stage's costs; partial ``j`` of group ``g`` is on ``group_tiles[g, j * stride]``."""
  num_tiles = target.num_tiles
  new_count = ceil_div(count, fanin)
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
  return _TreeStage(count, new_count, fanin, members, receivers,
                    ExchangeCost(bytes_in, bytes_out, link), compute, outputs)


def _tree_sum(level_st, stage: _TreeStage, g_out: int, block: int, acc):
  """Each group's sum of its ``fanin`` partial blocks (per_tile mode)."""
  count, new_count, fanin = stage.count, stage.new_count, stage.fanin
  x = level_st.reshape(g_out, count, block)
  x = jnp.pad(x, ((0, 0), (0, new_count * fanin - count), (0, 0)))
  x = x.reshape(g_out, new_count, fanin, block)
  if half_partials.applies(acc, acc):  # in order, rounding each addition
    return half_partials.add_in_order(jnp.moveaxis(x, 2, 0), stage.members[None, :, None])
  return x.sum(axis=2)


def _emit_tree_reduce(ctx, partials: P.Tensor, out: P.Tensor, plan: MatmulPlan, tiles: np.ndarray,
                      block_elements: np.ndarray, name: str) -> None:
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
    name: prefix of the steps' and tensors' names.
  """
  gb, gm, gn, gk = plan.grid
  g_out = gb * gm * gn
  acc = partials.dtype
  elements = block_elements.reshape(g_out, gk)[:, 0]  # [g_out]
  group_tiles = tiles.reshape(g_out, gk)
  level, count, stride = partials, gk, 1  # partial j of a group is on k-tile j * stride
  for index, fanin in enumerate(plan.reduce_fanins):
    stage = _tree_stage(ctx.target, group_tiles, elements, acc.itemsize, count, stride, fanin)
    label = f"{plan.label} stage {index + 1}/{len(plan.reduce_fanins)}"
    result = _emit_tree_stage(ctx, stage, level, out, label, index, elements, name)
    level, count, stride = result, stage.new_count, stride * fanin


def _emit_tree_stage(ctx, stage: _TreeStage, level: P.Tensor, out: P.Tensor, label: str,
                     index: int, elements: np.ndarray, name: str) -> P.Tensor:
  """Emit one stage's superstep; returns its result (``out`` at the last stage)."""
  g_out, block = stage.receivers.shape[0], level.shape[1]
  acc, out_dtype, last = level.dtype, out.dtype, stage.last
  if last:
    result = out
  else:
    rows = g_out * stage.new_count
    result = ctx.new_tensor((rows, block), acc,
                            TileMapping(rows * block, stage.receivers.reshape(-1),
                                        np.full(rows, block, np.int64), chunk=block),
                            name=f"{name}/partials{index + 1}")

  def step(level_st, *out_st):
    x = _tree_sum(level_st, stage, g_out, block, acc)
    if last:
      return (x.astype(out_dtype).reshape(out.storage_shape),)
    return (x.reshape(result.storage_shape),)

  def logical_step(level, *out):
    # The matmul step's logical form wrote the result.
    return (out[0],) if last else (jnp.zeros(result.shape, acc),)

  ctx.emit(P.Superstep(
      name=f"{name}/{label} reduce", op=ctx.op, reads=(level,) + ((out,) if last else ()),
      writes=(result,), fn=step, logical=logical_step, compute_cycles=stage.compute,
      exchange=stage.exchange,
      vertices=worker_vertices(ctx, stage.outputs),
      codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out_dtype if last else acc),),
      flops=int(((stage.members - 1).sum()) * elements.sum()) if _is_float(out_dtype) else 0))
  return result


def _add(x: Optional[ExchangeCost], y: Optional[ExchangeCost]) -> Optional[ExchangeCost]:
  if x is None:
    return y
  if y is None:
    return x
  return x + y
