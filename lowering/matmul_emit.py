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
   of the block (a reduce-scatter), casting to the result type; from ``gk =
   16`` in poplin's stages, one superstep each (``<name>/<plan> stage s/S
   reduce``, ``lowering/matmul_stages.py``). When the
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
reshape / transpose (:func:`~ipu_jax.lowering.matmul_grid.blocked_storage`).

Exchange accounting is exact per tile without per-destination index arrays:
every operand element knows its block, hence the set of grid tiles that need
it (a product of ranges); a tile receives its blocks' sizes less the elements
it already holds (found from the operand's real mapping), and a tile sends
each element it holds once if any other tile needs it (multicast), crossing
once to each other IPU its destinations span
(:func:`~ipu_jax.lowering.matmul_grid.grid_exchange_cost`). Per-tile
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
:class:`ProductPlan`); then, per pass, :func:`_pass` gives the pass's block sizes,
:func:`_operand_costs` (operands' exchanges costed and cached in
``lowering/matmul_operands.py``) and :func:`_block_work` its figures, and the
``_emit_*`` helpers its supersteps (a tree reduction's in
``lowering/matmul_tree.py``). The steps' arithmetic is
``lowering/matmul_arith.py``'s and reads the plan; the step functions
themselves are short closures over it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_plan import (BlockWork, MatmulPlan, block_work, operand_dtype,
                                          partials_dtype, plan_matmul)
from ipu_jax.lowering.matmul_cost import ceil_div
from ipu_jax.lowering.matmul_grid import (block_grid_mapping, edge_sizes, grid_tiles,
                                          matmul_tile_order)
from ipu_jax.lowering.matmul_tree import emit_tree_reduce
from ipu_jax.lowering.matmul_stages import emit_staged_scatter
from ipu_jax.lowering.matmul_operands import OperandExchange, blocks_of, operand_cost
from ipu_jax.lowering.matmul_arith import logical_product, pass_blocks, put_pass, reduce_pieces

__all__ = ["emit_matmul", "fill_zeros", "scatter_exchange"]


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
class ProductPlan:
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
               serial=None) -> ProductPlan:
  """Plan the product, claim its grid's tiles and create the result."""
  options = ctx.options
  if available_memory_proportion is None:
    available_memory_proportion = ctx.memory_proportion("available_memory_proportion")
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
  # Grid index (ib, im, in, ik) on its tiles with N innermost from an even
  # tile, as poplin lays out a plan: exchange-bus pairs share an A block.
  tiles = grid_tiles(ctx, g_out * gk, align=ctx.target.tiles_per_exchange_bus)[
      matmul_tile_order(plan.grid)]
  # A tree reduction leaves each output block whole on its group's first
  # tile; a reduce-scatter leaves 1/gk of it on each tile of the group.
  out_pieces = 1 if plan.reduce_fanins else gk
  out_tiles = tiles.reshape(g_out, gk)[:, 0] if plan.reduce_fanins else tiles
  out_mapping = block_grid_mapping((b, m, n), (gb, gm, gn), (bb, bm, bn), out_tiles,
                                   pieces=out_pieces, serial=(serial_axis, passes))
  out = ctx.new_tensor(out_shape, out_dtype, out_mapping)
  p = ProductPlan(prod=prod, lhs=lhs, rhs=rhs, out=out, out_mapping=out_mapping, plan=plan,
                  tiles=tiles, in_dtype=in_dtype, acc=acc, precision=precision,
                  notes=(note,) if note else (), serial_axis=serial_axis, length=length,
                  out_pieces=out_pieces, pass_counts=None, name=name)
  return dataclasses.replace(p, pass_counts=_pass_counts(p))


def _pass_counts(p: ProductPlan) -> Optional[np.ndarray]:
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
      emit_tree_reduce(ctx, partials, p.out, p.plan, p.tiles, ps.outputs, p.name)
    elif len(p.plan.scatter_stages) > 1:
      emit_staged_scatter(ctx, p, ps, partials)
    else:
      _emit_reduce_scatter(ctx, p, ps, partials)
  return p.out


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
    edges: ``([gb], [gm], [gn], [gk])`` the block sizes along each grid axis,
      of which ``rb, rm, rn, rk`` are the grid's outer product.
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
  edges: tuple

  @property
  def outputs(self) -> np.ndarray:
    """``[g_all]`` elements of each grid tile's output block."""
    return self.rb * self.rm * self.rn


def _pass(p: ProductPlan, index: int) -> _Pass:
  prod, passes, axis = p.prod, p.passes, p.serial_axis
  b, m, n, k = prod.b, prod.m, prod.n, prod.k
  gb, gm, gn, gk = p.plan.grid
  bb, bm, bn, bk = p.plan.block
  start = index * p.length if passes > 1 else 0
  stop = min(start + p.length, (b, m, n)[axis]) if passes > 1 else None
  pm = (stop - start) if axis == 1 else m
  pn = (stop - start) if axis == 2 else n
  ib, im, in_, ik = np.unravel_index(np.arange(p.g_all), (gb, gm, gn, gk))
  edges = (edge_sizes(b, gb, bb), edge_sizes(pm, gm, bm), edge_sizes(pn, gn, bn),
           edge_sizes(k, gk, bk))
  return _Pass(index, start, stop, pm, pn, edges[0][ib], edges[1][im], edges[2][in_],
               edges[3][ik], f" pass {index + 1}/{passes}" if passes > 1 else "", edges)


def _lhs_exchange(p: ProductPlan, ps: _Pass) -> OperandExchange:
  """Bringing every grid tile its A blocks of a pass."""
  prod, (bb, bm, _, bk) = p.prod, p.plan.block
  b, m, k = prod.b, prod.m, prod.k
  needs = [(0,) + blocks_of(b, bb), (1,) + blocks_of(ps.pm, bm), None,
           (2,) + blocks_of(k, bk)]
  window = ((0, b), (ps.start, ps.stop) if p.serial_axis == 1 else (0, m), (0, k))
  return OperandExchange(p.lhs, prod.lhs_perm, (b, m, k), prod.lhs_dims, tuple(p.plan.grid),
                         p.tiles, needs, ps.rb * ps.rm * ps.rk, window, bus_shared=True)


def _rhs_exchange(p: ProductPlan, ps: _Pass) -> OperandExchange:
  """Bringing every grid tile its B blocks of a pass."""
  prod, (bb, _, bn, bk) = p.prod, p.plan.block
  b, n, k = prod.b, prod.n, prod.k
  needs = [(0,) + blocks_of(b, bb), None, (2,) + blocks_of(ps.pn, bn),
           (1,) + blocks_of(k, bk)]
  window = ((0, b), (0, k), (ps.start, ps.stop) if p.serial_axis == 2 else (0, n))
  return OperandExchange(p.rhs, prod.rhs_perm, (b, k, n), prod.rhs_dims, tuple(p.plan.grid),
                         p.tiles, needs, ps.rb * ps.rk * ps.rn, window)


def _operand_costs(target, p: ProductPlan, ps: _Pass, previous: tuple) -> tuple:
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
    a_all = operand_cost(target, ("lhs", prod.lhs_perm) + grid_key, _lhs_exchange(p, ps))
  if b_all is None or p.serial_axis == 2:
    b_all = operand_cost(target, ("rhs", prod.rhs_perm) + grid_key, _rhs_exchange(p, ps))
  return a_all, b_all


def _block_cycles(target, p: ProductPlan, ps: _Pass) -> np.ndarray:
  """``[g_all]`` AMP cycles of every grid tile's block, estimated once per block shape.

  Along each grid axis the blocks take at most three sizes (whole, the
  edge's short one, none past the end), so the grid's thousands of tiles
  hold a few shapes: the elementwise estimate is taken of those and
  gathered back (the same figures as one estimate per tile, at a fraction
  of the work on a grid over several IPUs).
  """
  sizes, where = zip(*(np.unique(e, return_inverse=True) for e in ps.edges))
  rb, rm, rn, rk = np.ix_(*sizes)
  table = estimators.matmul_cycles(target, rb * rm * rn * rk, np.dtype(p.in_dtype).itemsize,
                                   outputs=rb * rm * rn, dtype=p.in_dtype, k=rk, n=rn,
                                   groups=rb, partials_itemsize=p.acc.itemsize)
  # Each grid tile's shape, row-major over the grid as ``_pass`` lays the tiles.
  index = np.ravel_multi_index(np.ix_(*(w.reshape(-1) for w in where)), table.shape)
  return table.reshape(-1)[index.reshape(-1)[:p.g_all]]


def _block_work(target, p: ProductPlan, ps: _Pass, a_local, b_local) -> BlockWork:
  macs = ps.rb * ps.rm * ps.rn * ps.rk
  cycles = _block_cycles(target, p, ps)
  # Local elements of the blocks are copied into the AMP's block layout; the
  # received ones sit in the exchange buffers (counted by the analysis).
  scratch = a_local * p.lhs.itemsize + b_local * p.rhs.itemsize
  if p.plan.grid[3] == 1 and p.acc != p.out_dtype:
    scratch = scratch + ps.rb * ps.rm * ps.rn * p.acc.itemsize
  return block_work(target, p.tiles, macs, cycles, scratch, _is_float(p.out_dtype))


# --- One pass: emission ---------------------------------------------------------------------


def _matmul_step(ctx, p: ProductPlan, ps: _Pass, work: BlockWork, exchange, writes, fn, logical):
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


def _emit_whole_blocks(ctx, p: ProductPlan, ps: _Pass, work: BlockWork, exchange) -> None:
  """``gk == 1``: each tile's product block is its piece of the result."""
  index = ps.index

  def step(a_st, b_st, *out_st):
    prior = out_st[0] if out_st else None
    return (put_pass(p, prior, index, pass_blocks(p, a_st, b_st, ps.start, ps.stop)),)

  def logical_step(a, w, *prior):
    # The whole product at once; later passes have nothing to do.
    return (logical_product(p, a, w),) if index == 0 else (prior[0],)

  ctx.emit(_matmul_step(ctx, p, ps, work, exchange, (p.out,), step, logical_step))


def _emit_partial_blocks(ctx, p: ProductPlan, ps: _Pass, work: BlockWork, exchange) -> P.Tensor:
  """``gk > 1``: each tile's product block is a partial block; returns the partials."""
  g_all, block, acc, out, index = p.g_all, p.block, p.acc, p.out, ps.index
  partials = ctx.new_tensor((g_all, block), acc,
                            TileMapping(g_all * block, p.tiles, np.full(g_all, block, np.int64),
                                        chunk=block),
                            name=f"{p.name}/partials")

  def step(a_st, b_st, *out_st):
    prior = out_st[0] if out_st else jnp.zeros(out.storage_shape, out.dtype)
    return pass_blocks(p, a_st, b_st, ps.start, ps.stop), prior

  def logical_step(a, w, *prior):
    # The whole product in the first pass, written straight into the result;
    # the partials are never read (XLA drops them), nor are the reductions'.
    return (jnp.zeros(partials.shape, acc),
            logical_product(p, a, w) if index == 0 else prior[0])

  ctx.emit(_matmul_step(ctx, p, ps, work, exchange, (partials, out), step, logical_step))
  return partials


def scatter_exchange(target, tiles: np.ndarray, group: np.ndarray, p_size: int) -> ExchangeCost:
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


def _emit_reduce_scatter(ctx, p: ProductPlan, ps: _Pass, partials: P.Tensor) -> None:
  """Reduce-scatter of the partials: each tile sums its piece of the block."""
  target, tiles, gk, acc, out, index = (ctx.target, p.tiles, p.plan.grid[3], p.acc, p.out,
                                        ps.index)
  counts = p.pass_counts[:, index]  # [g_all] result elements each tile reduces
  p_size = acc.itemsize
  reduce_compute = np.zeros(target.num_tiles)
  reduce_compute[tiles] = estimators.partials_reduce_cycles(target, gk * counts, p_size, counts)
  reduce_vertices = np.zeros(target.num_tiles, np.int64)
  reduce_vertices[tiles] = worker_vertices(ctx, counts)

  def reduce_step(p_st, out_st):
    return (put_pass(p, out_st, index, reduce_pieces(p, p_st)),)

  ctx.emit(P.Superstep(
      name=f"{p.name}/{p.plan.label}{ps.suffix} reduce", op=ctx.op, reads=(partials, out),
      writes=(out,), fn=reduce_step,
      # The matmul step's logical form wrote the result.
      logical=lambda partial_blocks, result: (result,), compute_cycles=reduce_compute,
      exchange=scatter_exchange(target, tiles, counts.reshape(p.g_out, gk), p_size),
      vertices=reduce_vertices, codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out.dtype),),
      flops=int((gk - 1) * counts.sum()) if _is_float(out.dtype) else 0))


# --- Tree reduction -------------------------------------------------------------------------


def _add(x: Optional[ExchangeCost], y: Optional[ExchangeCost]) -> Optional[ExchangeCost]:
  if x is None:
    return y
  if y is None:
    return x
  return x + y
