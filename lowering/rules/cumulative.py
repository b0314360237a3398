"""Cumulative (scan) primitives: ``cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``.

Cumulative ops (``cumsum``, ``cumprod``, ``cummax``, ``cummin``,
``cumlogsumexp``) see the tensor as independent lines along the scanned axis
and are planned as *pieces*: the run of a line held by one tile. Compute set
1 scans every piece on its tile and publishes the piece's total; when a line
spans several tiles, compute set 2 multicasts each total to the later pieces
of its line, which fold the combination of the totals before them into their
elements. Two layouts are costed and the cheaper taken: scanning where the
data already is (no input exchange; best when lines lie along the tile
chunks, e.g. the last axis, or a 1-D tensor cut over tiles), or first moving
whole lines onto tiles (several lines per tile, or for few long lines, each
line cut into chunks on consecutive tiles) when the scanned axis runs across
tiles.

Execution: each step's logical form computes the result with the primitive
itself on the logical array and passes it through the planned steps (the
``"batched"`` executor runs it); its ``fn`` (the ``"per_tile"`` executor's)
genuinely runs the plan: every piece is scanned on its tile and the totals of
earlier pieces are folded in. Both have the same steps, exchanges, cycles
and memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import control_flow_loops
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import ExchangeCost, exchange_cycles, relayout, relayout_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.grouping import (Groups, Slots, gather_or_fill, group_regions, identity_of,
                                       rows_mapping)


_CUMULATIVE = {
    control_flow_loops.cumsum_p: ("add", jnp.add, 1),
    control_flow_loops.cumprod_p: ("mul", jnp.multiply, 1),
    control_flow_loops.cummax_p: ("max", jnp.maximum, 1),
    control_flow_loops.cummin_p: ("min", jnp.minimum, 1),
    control_flow_loops.cumlogsumexp_p: ("logaddexp", jnp.logaddexp, 10),
}


@dataclasses.dataclass
class _ScanPlan:
  """A scan over a mapping's pieces: (tile, line) runs of consecutive elements.

  Attributes:
    mapping: where the scanned tensor (and the result) lives.
    groups: the pieces (:class:`Groups` keyed by line).
    slots: the storage slot of every element of every piece.
    piece_slot: ``[pieces]`` slot of each piece in ``[rows, width]`` storage.
    count: ``[pieces]`` elements in each piece.
    q: ``[pieces]`` position of each piece along its line (ascending k).
    before: ``[pieces]`` pieces that precede it in scan order.
    max_pieces: most pieces of one line.
    scan_cycles, fold_cycles: ``[num_tiles]`` cycles of the two compute sets.
    fold_cost: the exchange of totals (``None`` when no line is split).
    score: estimated cycles of the whole plan (with ``relayout_cost``).
    relayout_cost: exchange bringing the input into ``mapping``.
  """

  mapping: TileMapping
  groups: Groups
  slots: Slots
  piece_slot: np.ndarray
  count: np.ndarray
  q: np.ndarray
  before: np.ndarray
  max_pieces: int
  scan_cycles: np.ndarray
  fold_cycles: Optional[np.ndarray]
  fold_cost: Optional[ExchangeCost]
  relayout_cost: Optional[ExchangeCost]
  score: float


def _plan_scan(ctx, mapping, shape, axis, k_coord, lines, reverse, itemsize, cost,
               relayout_cost_=None) -> Optional[_ScanPlan]:
  """Plan a scan of lines held as in ``mapping``; ``None`` if a tile's run of
  a line is not contiguous (then the in-place plan does not apply)."""
  target = ctx.target
  num_tiles = target.num_tiles
  groups = group_regions(mapping, shape, (axis,))
  if relayout_cost_ is None and 2 * groups.num > mapping.num_elements and 2 * lines < k_coord.size:
    # Runs of under two elements: folding would send every element the
    # totals of all earlier runs of its line, far more than moving the lines.
    return None
  rows, row_size = mapping.storage_shape
  total = rows * row_size
  # Whether each piece is consecutive along the line needs every element.
  slots = groups.slots(mapping)
  width, depth = groups.width, groups.depth
  slot_k = np.zeros(total + 1, np.int64)
  slot_k[mapping.storage_position] = k_coord
  k_dense = slot_k[slots.dense]
  valid = slots.dense < total
  if not np.all(~valid | (k_dense - k_dense[..., :1] == np.arange(depth))):
    return None
  num = groups.num
  piece_slot = groups.row * width + groups.local
  count = valid.sum(axis=-1).reshape(-1)[piece_slot]
  line = groups.key
  first_slot = slots.dense.reshape(rows * width, depth)[piece_slot, 0]
  order = np.argsort(line * (int(k_coord.max(initial=0)) + 1) + slot_k[first_slot],
                     kind="stable")
  line_count = np.bincount(line, minlength=lines)
  line_start = np.cumsum(line_count) - line_count
  q = np.empty(num, np.int64)
  q[order] = np.arange(num) - line_start[line[order]]
  before = q if not reverse else line_count[line] - 1 - q
  after = line_count[line] - 1 - before
  tiles = mapping.tiles[groups.row]
  elements = mapping.elements_per_tile(num_tiles)
  # A worker scans sequentially (one element per cycle, more for
  # logaddexp), so each element counts as one vector.
  scan_cycles = estimators.worker_split_cycles(target, elements, cost,
                                               target.vector_width_bytes)
  score = exchange_cycles(target, relayout_cost_) + float(scan_cycles.max(initial=0))
  fold_cycles = fold_cost = None
  max_pieces = int(line_count.max(initial=0))
  if max_pieces > 1:
    # Each piece receives the totals of the pieces before it in its line; a
    # total is sent once (multicast) and crosses to each other IPU once.
    def tile_bytes(weights, length=num_tiles, where=tiles):
      return np.bincount(where, weights=weights, minlength=length).astype(np.int64) * itemsize

    bytes_in = tile_bytes(before)
    bytes_out = tile_bytes(after > 0)
    link = np.zeros(target.num_ipus, np.int64)
    if target.num_ipus > 1:
      ipu = tiles // target.tiles_per_ipu
      last = np.full(lines * target.num_ipus, -1, np.int64)
      np.maximum.at(last, line * target.num_ipus + ipu, before)
      last = last.reshape(lines, target.num_ipus)[line]
      crossings = ((last > before[:, None])
                   & (np.arange(target.num_ipus)[None, :] != ipu[:, None])).sum(axis=1)
      link = tile_bytes(crossings, target.num_ipus, ipu)
    fold_cost = ExchangeCost(bytes_in, bytes_out, link)
    fold_elements = np.bincount(tiles, weights=np.where(before > 0, count, 0),
                                minlength=num_tiles).astype(np.int64)
    received = np.bincount(tiles, weights=before, minlength=num_tiles)
    fold_cycles = estimators.worker_split_cycles(target, fold_elements, cost, itemsize)
    fold_cycles = fold_cycles + np.where(fold_elements > 0, received, 0)
    # The fold is a second superstep: its sync, exchange and compute.
    score += (target.sync_cycles_internal + exchange_cycles(target, fold_cost)
              + float(fold_cycles.max(initial=0)))
  return _ScanPlan(mapping=mapping, groups=groups, slots=slots, piece_slot=piece_slot, count=count, q=q,
                   before=before, max_pieces=max_pieces, scan_cycles=scan_cycles,
                   fold_cycles=fold_cycles, fold_cost=fold_cost,
                   relayout_cost=relayout_cost_, score=score)


def _lines_mapping(ctx, shape, axis, itemsize):
  """Whole lines per tile, or (few lines) each line cut into chunks.

  Returns ``(mapping, rotates)``; ``rotates`` says whether claiming it moves
  the context's next start tile.
  """
  num_tiles = ctx.target.num_tiles
  size = int(np.prod(shape, dtype=np.int64))
  n = shape[axis]
  lines = size // n
  grain = max(1, 8 // itemsize)
  min_elements = max(grain, -(-128 // itemsize))
  chunks = 1
  if lines < num_tiles and n > min_elements:
    chunks = min(num_tiles // lines, -(-n // min_elements))
  if chunks > 1:
    seg = -(-n // chunks)
    chunks = -(-n // seg)
    per_row_lines = 1
  else:
    chunks, seg = 1, n
    per_row_lines = max(-(-lines // num_tiles), min(lines, -(-min_elements // n)))
  num_rows = -(-lines // per_row_lines) * chunks
  rotates = num_rows < num_tiles
  start = ctx.next_start_tile if rotates else 0
  row_tiles = (start + np.arange(num_rows)) % num_tiles
  flat_lk = np.moveaxis(np.arange(size, dtype=np.int64).reshape(shape), axis, -1).reshape(lines, n)
  row_lk = ((np.arange(lines, dtype=np.int64)[:, None] // per_row_lines) * chunks
            + np.arange(n, dtype=np.int64)[None, :] // seg)
  element_row = np.empty(size, np.int64)
  element_row[flat_lk.reshape(-1)] = row_lk.reshape(-1)
  counts = np.bincount(element_row, minlength=num_rows)
  chunk = int(counts[0])
  if np.array_equal(element_row, np.arange(size) // chunk):
    return TileMapping(size, row_tiles, counts, chunk=chunk), rotates
  # Elements keep flat order within their row.
  order = np.argsort(element_row, kind="stable")
  offset = np.empty(size, np.int64)
  offset[order] = np.arange(size) - np.repeat(np.cumsum(counts) - counts, counts)
  return TileMapping(size, row_tiles, counts, element_row=element_row,
                     element_offset=offset), rotates


def _lower_cumulative(ctx, prim, kind, combine, cost, x, axis, reverse):
  """A scan along ``axis``, in place or on whole/chunked lines per tile."""
  target = ctx.target
  shape, dtype = tuple(x.shape), x.dtype
  size = x.size
  if size == 0:
    out = ctx.new_tensor(shape, dtype)
    ctx.emit(P.Superstep(name=ctx.op, op=ctx.op, reads=(), writes=(out,),
                         fn=lambda: (jnp.zeros(out.storage_shape, dtype),)))
    return [out]
  axis = axis % len(shape)
  n = shape[axis]
  lines = size // n
  itemsize = dtype.itemsize
  k_coord = np.broadcast_to(np.arange(n, dtype=np.int64).reshape(
      [-1 if a == axis else 1 for a in range(len(shape))]), shape).reshape(-1)
  # Candidate 1: scan where the data is (each tile scans its runs of each
  # line, then folds in the totals of the runs before it on other tiles).
  stride = int(np.prod(shape[axis + 1:], dtype=np.int64))
  plan = None
  if not (x.mapping.is_linear and n > 1 and stride >= x.mapping.chunk):
    # (With a linear mapping whose chunks are shorter than the line's
    # stride, no tile holds two elements of a line: nothing to scan in place.)
    plan = _plan_scan(ctx, x.mapping, shape, axis, k_coord, lines, reverse, itemsize, cost)
  rotates = False
  if plan is None or plan.max_pieces > 1:
    # Candidate 2: first move whole lines (or, for few lines, chunks of a
    # line on consecutive tiles) onto tiles.
    lines_map, lines_rotates = _lines_mapping(ctx, shape, axis, itemsize)
    moved = _plan_scan(ctx, lines_map, shape, axis, k_coord, lines, reverse, itemsize, cost,
                       relayout_cost(target, x.mapping, lines_map, itemsize))
    if plan is None or moved.score < plan.score:
      plan, rotates = moved, lines_rotates
  if rotates:
    ctx.claim_tiles(plan.mapping.num_rows)
  return _emit_scan(ctx, prim, kind, combine, x, axis, reverse, plan)


@dataclasses.dataclass(frozen=True)
class _ScanRun:
  """What a scan plan's steps need to run (their per-tile ``fn``).

  The plan's storage ``[rows, row_size]`` is viewed as pieces
  ``[rows, width, depth]`` (each piece one tile's run of one line, padded
  with the operation's identity).

  Attributes:
    prim, combine, axis, reverse: the primitive, its combining
      function and its parameters.
    x: the operand (read in its own mapping, relaid into ``mapping``).
    mapping: where the plan scans.
    slots: the plan's slots (dense view of storage).
    valid: ``[rows, width, depth]`` which dense slots hold an element.
    dense32, inverse32: storage -> dense and dense -> storage gathers.
    identity: the operation's identity in the operand's dtype.
    pieces_shape: ``(rows, width, depth)``.
  """

  prim: object
  combine: object
  axis: int
  reverse: bool
  x: P.Tensor
  mapping: TileMapping
  slots: Slots
  valid: np.ndarray
  dense32: np.ndarray
  inverse32: np.ndarray
  identity: object
  pieces_shape: tuple

  @property
  def dtype(self):
    return self.x.dtype


def _scan_run(prim, kind, combine, x, axis, reverse, plan: _ScanPlan) -> _ScanRun:
  slots = plan.slots
  rows, row_size = plan.mapping.storage_shape
  total = rows * row_size
  valid = slots.dense < total
  inverse = np.full(total, valid.size, np.int64)
  inverse[slots.dense[valid]] = np.flatnonzero(valid.reshape(-1))
  return _ScanRun(prim, combine, axis, reverse, x, plan.mapping, slots, valid,
                  slots.dense.astype(np.int32), inverse.astype(np.int32),
                  identity_of(kind, x.dtype), (rows, plan.groups.width, plan.groups.depth))


def _to_dense(run: _ScanRun, st):
  """Storage -> ``[rows, width, depth]`` pieces (gaps hold the identity)."""
  if run.slots.reshape_only:
    d = st.reshape(run.pieces_shape)
    return (d if run.slots.valid.all()
            else jnp.where(run.valid, d, jnp.asarray(run.identity, run.dtype)))
  return gather_or_fill(st.reshape(-1), run.dense32, run.identity)


def _to_rows(run: _ScanRun, d):
  """``[rows, width, depth]`` pieces -> storage."""
  shape = run.mapping.storage_shape
  if run.slots.reshape_only:
    return d.reshape(shape)
  return gather_or_fill(d.reshape(-1), run.inverse32, 0).reshape(shape)


def _scan_pieces(run: _ScanRun, xs):
  """Every piece scanned on its tile (the operand relaid into the plan first)."""
  dense = _to_dense(run, relayout(xs, run.x.mapping, run.mapping))
  return jax.vmap(lambda r: run.prim.bind(r, axis=1, reverse=run.reverse))(dense)


def _scan_logical(run: _ScanRun, x):
  """The scan's logical form: the primitive on the logical operand."""
  return (run.prim.bind(x, axis=run.axis, reverse=run.reverse),)


def _scan_whole(run: _ScanRun, xs):
  """The step of a plan whose lines are each on one tile."""
  return (_to_rows(run, _scan_pieces(run, xs)),)


def _scan_with_totals(run: _ScanRun, total_at, xs):
  """Step 1 of a folded plan: scanned pieces and each piece's total."""
  scanned = _scan_pieces(run, xs)
  tot = jnp.take_along_axis(scanned, jnp.asarray(total_at), axis=2)[..., 0]
  return _to_rows(run, scanned), tot


def _scan_with_totals_logical(run: _ScanRun, num_totals: int, x):
  """Step 1's logical form: the whole scan, the totals left at the identity
  (step 2's logical form then passes the scan through)."""
  return (_scan_logical(run, x)[0], jnp.full((num_totals,), run.identity, run.dtype))


@dataclasses.dataclass(frozen=True)
class _FoldTables:
  """Where step 2 finds the totals each piece folds in.

  Attributes:
    lines: lines of the tensor.
    table: ``[lines, max_pieces]`` slot of each line's pieces' totals (k order).
    offset_at: ``[rows, width]`` entry of each piece in ``table``.
    first: ``[rows, width, 1]`` whether a piece comes first in scan order.
  """

  lines: int
  table: np.ndarray
  offset_at: np.ndarray
  first: np.ndarray


def _fold_tables(plan: _ScanPlan) -> _FoldTables:
  groups, m = plan.groups, plan.max_pieces
  rows, width = plan.mapping.storage_shape[0], groups.width
  lines = int(groups.key.max()) + 1
  table = np.full(lines * m, rows * width, np.int64)
  table[groups.key * m + plan.q] = plan.piece_slot
  offset_at = np.full(rows * width, lines * m, np.int64)
  offset_at[plan.piece_slot] = groups.key * m + plan.q
  first = np.ones(rows * width, bool)
  first[plan.piece_slot] = plan.before == 0
  return _FoldTables(lines, table.reshape(lines, m).astype(np.int32),
                     offset_at.reshape(rows, width).astype(np.int32),
                     first.reshape(rows, width, 1))


def _fold_totals(run: _ScanRun, tables: _FoldTables, local_st, totals_st):
  """Step 2: every piece folds in the combined totals of the pieces before it."""
  tab = gather_or_fill(totals_st.reshape(-1), tables.table, run.identity)
  inclusive = run.prim.bind(tab, axis=1, reverse=run.reverse)
  fill = jnp.full((tables.lines, 1), run.identity, run.dtype)
  if run.reverse:
    exclusive = jnp.concatenate([inclusive[:, 1:], fill], axis=1)
  else:
    exclusive = jnp.concatenate([fill, inclusive[:, :-1]], axis=1)
  offsets = gather_or_fill(exclusive.reshape(-1), tables.offset_at, run.identity)
  folded = jax.vmap(lambda o, r, f: jnp.where(f, r, run.combine(o[:, None], r)))(
      offsets, _to_dense(run, local_st), jnp.asarray(tables.first))
  return (_to_rows(run, folded),)


def _fold_logical(local, totals):
  """Step 2's logical form: step 1's already holds the whole scan."""
  del totals
  return (local,)


def _emit_fold(ctx, run: _ScanRun, plan: _ScanPlan, kind, local, totals, out) -> None:
  """The fold step (compute set 2) of a plan whose lines span tiles."""
  groups = plan.groups
  fold_elements = np.bincount(plan.mapping.tiles[groups.row],
                              weights=np.where(plan.before > 0, plan.count, 0),
                              minlength=ctx.target.num_tiles).astype(np.int64)
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/fold", op=ctx.op, reads=(local, totals), writes=(out,),
      fn=functools.partial(_fold_totals, run, _fold_tables(plan)),
      compute_cycles=plan.fold_cycles, exchange=plan.fold_cost,
      vertices=worker_vertices(ctx, fold_elements),
      codelets=(vocab.vertex(vocab.SCAN_FOLD, kind),),
      flops=int(fold_elements.sum()) if np.issubdtype(run.dtype, np.inexact) else 0,
      logical=_fold_logical))


def _scan_step(ctx, run: _ScanRun, plan: _ScanPlan, kind, name, writes, fn,
               logical_fn) -> P.Superstep:
  """The step of compute set 1: every piece scanned on its tile."""
  x = run.x
  return P.Superstep(
      name=name, op=ctx.op, reads=(x,), writes=writes, fn=fn,
      compute_cycles=plan.scan_cycles, exchange=plan.relayout_cost,
      vertices=worker_vertices(ctx, plan.mapping.elements_per_tile(ctx.target.num_tiles)),
      codelets=(vocab.vertex(vocab.SCAN, kind),),
      flops=x.size if np.issubdtype(x.dtype, np.inexact) else 0, logical=logical_fn)


def _emit_scan(ctx, prim, kind, combine, x, axis, reverse, plan: _ScanPlan):
  """The steps of a scan plan: scan pieces (+ totals), fold earlier totals."""
  run = _scan_run(prim, kind, combine, x, axis, reverse, plan)
  mapping, groups = plan.mapping, plan.groups
  out = ctx.new_tensor(x.shape, x.dtype, mapping)
  if plan.max_pieces <= 1:
    ctx.emit(_scan_step(ctx, run, plan, kind, ctx.op, (out,),
                        functools.partial(_scan_whole, run),
                        functools.partial(_scan_logical, run)))
    return [out]
  local = ctx.new_tensor(x.shape, x.dtype, mapping, name=f"{ctx.op}/local")
  totals_map = rows_mapping(groups.num, mapping.tiles, groups.row, groups.local,
                            groups.per_row)
  totals = ctx.new_tensor((groups.num,), x.dtype, totals_map, name=f"{ctx.op}/totals")
  # Where each piece's total sits in its scanned run.
  rows = mapping.storage_shape[0]
  total_at = np.zeros(rows * groups.width, np.int64)
  total_at[plan.piece_slot] = plan.count - 1 if not reverse else 0
  total_at = total_at.reshape(rows, groups.width, 1)
  ctx.emit(_scan_step(ctx, run, plan, kind, f"{ctx.op}/pieces", (local, totals),
                      functools.partial(_scan_with_totals, run, total_at),
                      functools.partial(_scan_with_totals_logical, run, groups.num)))
  _emit_fold(ctx, run, plan, kind, local, totals, out)
  return [out]


def _make_cumulative_rule(prim, kind, combine, cost):
  def rule(ctx: RuleContext, x, *, axis, reverse):
    return _lower_cumulative(ctx, prim, kind, combine, cost, x, axis, reverse)
  return rule


for _prim, (_kind, _combine, _cost) in _CUMULATIVE.items():
  register_lowering(_prim, _make_cumulative_rule(_prim, _kind, _combine, _cost))
