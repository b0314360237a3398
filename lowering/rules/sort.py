"""Sorts: ``sort`` (multi-operand, ``num_keys``, stable), ``top_k`` and ``approx_top_k``.

Tile plan. Rows along the sort axis that fit comfortably on one tile are
partitioned over tiles along the largest other axis
(:func:`~ipu_jax.lowering.builders.partitioned`), each tile sorting whole
rows (``n log2 n`` compare-exchanges per row). Longer rows (and 1-D arrays)
are spread over ``P`` tiles per row (a power of two): each tile sorts its
chunk, then ``log2 P (log2 P + 1) / 2`` bitonic merge supersteps exchange
chunks between partner tiles (``top_k``: each tile selects its local top-k
and the candidates are merged on the row's first tile).

Execution. Every step function binds the primitive itself, with the
equation's parameters, on the logical arrays, so the numbers equal
``jax.jit``'s.
"""

from __future__ import annotations

import math

from jax import lax
import numpy as np

from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import builders
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.indexing import bind_fn, emit_step, item_cycles

# Cycles per compare-exchange of a sort: compare the keys, move the operands.
_SORT_COMPARE_CYCLES = 2
# A sort row (all operands, inputs and results) this large or smaller stays
# on one tile; as a fraction of the tile's SRAM.
_ROW_BUDGET_FRACTION = 8


def _log2(n) -> int:
  return int(math.ceil(math.log2(n))) if n > 1 else 0


def _row_coords(shape, axis):
  """``(row, position)`` of every element: its row along ``axis`` and place in it."""
  size = int(np.prod(shape, dtype=np.int64))
  n = shape[axis]
  inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
  flat = np.arange(size, dtype=np.int64)
  pos = (flat // inner) % n
  row = (flat // (inner * n)) * inner + flat % inner
  return row, pos


class _RowPlan:
  """Rows along ``axis`` spread over ``tiles_per_row`` consecutive tiles each.

  Row ``b``'s chunk ``p`` (positions ``[p m, (p + 1) m)``) lives on tile
  ``start + b * tiles_per_row + p`` (modulo the tiles: many rows wrap).
  """

  def __init__(self, ctx, shape, axis, tiles_per_row):
    self.target = ctx.target
    self.shape, self.axis, self.p = tuple(shape), axis, tiles_per_row
    self.n = shape[axis]
    self.rows = int(np.prod(shape, dtype=np.int64)) // self.n
    self.m = -(-self.n // self.p)
    num_tiles = self.target.num_tiles
    used = min(self.rows * self.p, num_tiles)
    self.start = ctx.claim_tiles(used)
    chunk_ids = np.arange(self.rows * self.p, dtype=np.int64)
    self.chunk_tile = (self.start + chunk_ids) % num_tiles
    self.chunk_pos = chunk_ids % self.p
    self.chunk_row = chunk_ids // self.p
    self.elems_by_pos = np.clip(self.n - np.arange(self.p) * self.m, 0, self.m)
    self.chunk_elems = self.elems_by_pos[self.chunk_pos]

  def mapping(self, shape=None, first_tile_only=False) -> TileMapping:
    shape = self.shape if shape is None else tuple(shape)
    size = int(np.prod(shape, dtype=np.int64))
    if self.rows == 1 and not first_tile_only:
      # One row (a 1-D array): consecutive chunks on consecutive tiles.
      return TileMapping.blocks(size, self.m, self.target.num_tiles, self.start)
    row, pos = _row_coords(shape, self.axis)
    chunk = row * self.p if first_tile_only else row * self.p + pos // self.m
    return TileMapping.from_element_tiles((self.start + chunk) % self.target.num_tiles)

  def per_tile(self, values) -> np.ndarray:
    """Sum a per-chunk quantity onto the chunks' tiles."""
    return np.bincount(self.chunk_tile, weights=np.asarray(values, np.float64),
                       minlength=self.target.num_tiles)[:self.target.num_tiles]

  def merge_cost(self, bit, bytes_per_element) -> ExchangeCost:
    """Exchange of one bitonic stage: partners ``pos ^ bit`` swap their chunks."""
    target = self.target
    partner_pos = self.chunk_pos ^ bit
    exists = partner_pos < self.p
    partner_pos = np.where(exists, partner_pos, self.chunk_pos)
    own = np.where(exists, self.chunk_elems, 0) * bytes_per_element
    theirs = np.where(exists, self.elems_by_pos[partner_pos], 0) * bytes_per_element
    partner_tile = (self.start + self.chunk_row * self.p + partner_pos) % target.num_tiles
    crossing = target.ipu_of_tile(partner_tile) != target.ipu_of_tile(self.chunk_tile)
    link = np.bincount(target.ipu_of_tile(self.chunk_tile), weights=own * crossing,
                       minlength=target.num_ipus)[:target.num_ipus]
    return ExchangeCost(self.per_tile(theirs).astype(np.int64),
                        self.per_tile(own).astype(np.int64), link.astype(np.int64))


def _tiles_per_row(ctx, n, row_bytes):
  """Tiles a row of ``row_bytes`` needs (a power of two), given the budget."""
  budget = max(1, ctx.target.bytes_per_tile // _ROW_BUDGET_FRACTION)
  need = -(-row_bytes // budget)
  p = 1 << _log2(need)
  max_p = 1 << (ctx.target.num_tiles.bit_length() - 1)
  while p > 1 and (p > max_p or p > n):
    p //= 2
  return p


def _linear_movement_cost(target, src: TileMapping, dst: TileMapping) -> ExchangeCost:
  """Bytes (one per element) moved between two linear mappings.

  Both are runs of consecutive elements per tile, so the elements split into
  at most ``rows(src) + rows(dst)`` segments with one source and one
  destination tile each; no per-element work.
  """
  n = src.num_elements
  src_bounds = np.minimum(np.arange(src.num_rows + 1, dtype=np.int64) * src.chunk, n)
  dst_bounds = np.minimum(np.arange(dst.num_rows + 1, dtype=np.int64) * dst.chunk, n)
  bounds = np.union1d(src_bounds, dst_bounds)
  first, length = bounds[:-1], np.diff(bounds)
  src_tile = src.tiles[np.minimum(first // src.chunk, src.num_rows - 1)]
  dst_tile = dst.tiles[np.minimum(first // dst.chunk, dst.num_rows - 1)]
  moved = np.where(src_tile != dst_tile, length, 0)
  t = target.num_tiles
  bytes_in = np.bincount(dst_tile, weights=moved, minlength=t)[:t]
  bytes_out = np.bincount(src_tile, weights=moved, minlength=t)[:t]
  crossing = target.ipu_of_tile(src_tile) != target.ipu_of_tile(dst_tile)
  link = np.bincount(target.ipu_of_tile(src_tile), weights=moved * crossing,
                     minlength=target.num_ipus)[:target.num_ipus]
  return ExchangeCost(bytes_in.astype(np.int64), bytes_out.astype(np.int64),
                      link.astype(np.int64))


def _relayout_cost(ctx, operands, mapping):
  """Exchange that brings ``operands`` into ``mapping``.

  Operands laid out alike move alike: their cost is computed once per layout
  (for one byte per element) and scaled by their total item size.
  """
  groups = []  # [(source mapping, bytes per element)]
  for t in operands:
    if t.mapping.same_as(mapping):
      continue
    for i, (m, nbytes) in enumerate(groups):
      if m.same_as(t.mapping):
        groups[i] = (m, nbytes + t.itemsize)
        break
    else:
      groups.append((t.mapping, t.itemsize))
  costs = []
  for m, nbytes in groups:
    if m.is_linear and mapping.is_linear:
      c = _linear_movement_cost(ctx.target, m, mapping)
    else:
      c = movement_cost(ctx.target, m.element_tile, mapping.element_tile, 1)
    costs.append(ExchangeCost(c.bytes_in * nbytes, c.bytes_out * nbytes,
                              c.link_bytes_out * nbytes))
  return builders.add_costs(*costs)


@register_lowering(lax.sort_p)
def _sort(ctx: RuleContext, *operands, dimension, is_stable, num_keys):
  """Sort rows: whole rows per tile, or chunks per tile with bitonic merges."""
  params = dict(dimension=dimension, is_stable=is_stable, num_keys=num_keys)
  shape = tuple(operands[0].shape)
  out_avals = [(a.shape, a.dtype) for a in ctx.out_avals]
  size = operands[0].size
  if size == 0:
    return [ctx.new_tensor(s, d) for s, d in out_avals]
  n = shape[dimension]
  rows = size // n
  element_bytes = sum(t.itemsize for t in operands)
  compare_cycles = _SORT_COMPARE_CYCLES + len(operands)
  flat_compares = n * _log2(n)
  other_axes = [a for a in range(len(shape)) if a != dimension]
  budget = ctx.target.bytes_per_tile // _ROW_BUDGET_FRACTION

  def fn(*xs):
    return lax.sort_p.bind(*xs, **params)

  if other_axes:
    axis = max(other_axes, key=lambda a: shape[a])
    rows_per_slice = rows // shape[axis]
    if 2 * rows_per_slice * n * element_bytes <= budget:
      return builders.partitioned(
          ctx, fn, operands, out_avals, [axis] * len(operands), out_axis=axis,
          cycles_per_tile_fn=lambda r: item_cycles(
              ctx, r * rows_per_slice * flat_compares, compare_cycles),
          codelet=vocab.SORT)
  plan = _RowPlan(ctx, shape, dimension, _tiles_per_row(ctx, n, 2 * n * element_bytes))
  mapping = plan.mapping()
  outs = [ctx.new_tensor(s, d, mapping) for s, d in out_avals]
  local = plan.per_tile(plan.chunk_elems * np.ceil(np.log2(np.maximum(plan.chunk_elems, 1))))
  emit_step(ctx, "sort", operands, outs, bind_fn(lax.sort_p, params, operands, outs),
            compute=item_cycles(ctx, local, compare_cycles),
            exchange=_relayout_cost(ctx, operands, mapping),
            vertices=builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems))),
            codelet=vocab.SORT)
  # Bitonic merges between the chunks of a row: the data is already sorted
  # by the step above; these steps carry the cost of the merges.
  levels = _log2(plan.p)
  merge_compute = item_cycles(ctx, plan.per_tile(2 * plan.chunk_elems), compare_cycles)
  vertices = builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems)))
  costs = {}
  for level in range(1, levels + 1):
    for j in range(level - 1, -1, -1):
      bit = 1 << j
      if bit not in costs:
        costs[bit] = plan.merge_cost(bit, element_bytes)
      emit_step(ctx, f"sort/merge{level}.{j}", outs, outs, lambda *xs: tuple(xs),
                compute=merge_compute, exchange=costs[bit], vertices=vertices,
                codelet=vocab.SORT_MERGE)
  return outs


def _top_k_like(ctx, prim, params, operand, axis, k):
  """Top-k along ``axis``: per-tile rows, or local top-k then a merge."""
  out_avals = [(a.shape, a.dtype) for a in ctx.out_avals]
  shape = tuple(operand.shape)
  if operand.size == 0 or k == 0:
    return [ctx.new_tensor(s, d) for s, d in out_avals]
  n = shape[axis]
  rows = operand.size // n
  select = _log2(k + 1)  # a sorted insertion of each element into k best
  other_axes = [a for a in range(len(shape)) if a != axis]
  budget = ctx.target.bytes_per_tile // _ROW_BUDGET_FRACTION
  result_bytes = sum(np.dtype(d).itemsize for _, d in out_avals)
  codelet = vocab.vertex(vocab.TOP_K, prim.name)

  def fn(x):
    return prim.bind(x, **params)

  if other_axes:
    split = max(other_axes, key=lambda a: shape[a])
    rows_per_slice = rows // shape[split]
    if rows_per_slice * (n * operand.itemsize + k * result_bytes) <= budget:
      return builders.partitioned(
          ctx, fn, [operand], out_avals, [split], out_axis=split,
          cycles_per_tile_fn=lambda r: item_cycles(
              ctx, r * rows_per_slice * n * max(select, 1), _SORT_COMPARE_CYCLES + 1),
          codelet=codelet)
  plan = _RowPlan(ctx, shape, axis, _tiles_per_row(ctx, n, n * operand.itemsize))
  out_mapping = plan.mapping(out_avals[0][0], first_tile_only=True)
  outs = [ctx.new_tensor(s, d, out_mapping) for s, d in out_avals]
  local_cycles = item_cycles(ctx, plan.per_tile(plan.chunk_elems * max(select, 1)),
                             _SORT_COMPARE_CYCLES + 1)
  vertices = builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems)))
  if plan.p == 1:
    emit_step(ctx, prim.name, [operand], outs, bind_fn(prim, params, [operand], outs),
              compute=local_cycles, exchange=_relayout_cost(ctx, [operand], plan.mapping()),
              vertices=vertices, codelet=codelet)
    return outs
  # Each tile selects the top k of its chunk, then the row's first tile merges
  # the candidates of its row.
  in_mapping = plan.mapping()
  spread = ctx.new_tensor(shape, operand.dtype, in_mapping, name=f"{prim.name}/chunks")
  emit_step(ctx, f"{prim.name}/local", [operand], [spread],
            lambda s: (builders.storage(builders.logical(s, operand), spread),),
            compute=local_cycles, exchange=_relayout_cost(ctx, [operand], in_mapping),
            vertices=vertices, codelet=codelet)
  candidates = np.minimum(plan.chunk_elems, k)
  sent = np.where(plan.chunk_pos > 0, candidates, 0) * result_bytes
  first_tile = (plan.start + plan.chunk_row * plan.p) % ctx.target.num_tiles
  received = np.bincount(first_tile, weights=sent, minlength=ctx.target.num_tiles)
  crossing = ctx.target.ipu_of_tile(first_tile) != ctx.target.ipu_of_tile(plan.chunk_tile)
  link = np.bincount(ctx.target.ipu_of_tile(plan.chunk_tile), weights=sent * crossing,
                     minlength=ctx.target.num_ipus)
  merged = np.bincount(first_tile, weights=np.where(plan.chunk_pos == 0, 1, 0) *
                       plan.p * k, minlength=ctx.target.num_tiles)
  emit_step(ctx, f"{prim.name}/merge", [spread], outs, bind_fn(prim, params, [spread], outs),
            compute=item_cycles(ctx, merged * max(select, 1), _SORT_COMPARE_CYCLES + 1),
            exchange=ExchangeCost(received.astype(np.int64),
                              plan.per_tile(sent).astype(np.int64), link.astype(np.int64)),
        vertices=builders.worker_vertices(ctx, merged > 0), codelet=codelet)
  return outs


@register_lowering(lax.top_k_p)
def _top_k(ctx: RuleContext, operand, *, k, **params):
  axis = params.get("axis", -1) % len(operand.shape)
  return _top_k_like(ctx, lax.top_k_p, dict(params, k=k), operand, axis, k)


@register_lowering(lax.approx_top_k_p)
def _approx_top_k(ctx: RuleContext, operand, *, k, reduction_dimension, **params):
  axis = reduction_dimension % len(operand.shape)
  return _top_k_like(ctx, lax.approx_top_k_p,
                     dict(params, k=k, reduction_dimension=reduction_dimension),
                     operand, axis, ctx.out_avals[0].shape[axis])
