"""Plans for many indices into a small table: partial tables and replication.

The served plan of ``indexing.py`` sends every index (and every scatter
update) to the tiles of the table. With many indices and a small table
(``jnp.zeros(5).at[i].add(1.)`` with 100k indices, ``jnp.bincount``,
``jnp.nonzero(x, size=k)``) that piles the whole index array onto one tile.
The plans here turn the traffic round, as popops' multi-update-add and
multi-slice do when the table is the small side.

Tile plan of a scatter (**partial tables**):

1. *partials*: every tile that holds index tuples (a *group*) scatters the
   updates of its tuples into a private copy of the table filled with the
   combiner's identity (0 for add, 1 for mul, +inf / -inf for min / max).
   Update elements and index components not already on their tuple's tile
   move there first (usually nothing moves: updates lie like their indices).
   An overwrite scatter also scatters each tuple's ordinal with ``max``: a
   table element's partial value comes with the position of its last writer.
2. *reduce*: the partial tables are combined, elementwise, by a tree of fan-in
   ``F``: each stage sends every partial to the first tile of its set of
   ``F`` (``F * table`` bytes in per receiving tile). Trees with ``F = G``
   (all ``G`` partials straight to the table's tiles), ``F = ceil(sqrt(G))``
   (two stages) and the widest ``F`` whose receive buffers fit an eighth of
   a tile are costed; the cheapest that fits is chosen.
3. *apply*: the table's tiles receive their slice of the last partials and
   combine it with the operand in place (``operand + sum``, ``operand * prod``,
   ``min``, ``max``, ``operand - sum`` for ``scatter_sub``; an overwrite takes
   the value of the largest writer position, if any, else keeps the operand).

Numbers: integer, min and max results are exact; floating-point sums and
products are re-associated (per tile, then across tiles), so they equal XLA's
serial order to rounding. An overwrite with duplicate indices keeps the update
of the *last* tuple in index order, XLA's serial semantics on CPU (the XLA
spec leaves the order unspecified). ``mode`` (clip, fill / drop,
promise_in_bounds) is applied by the same scatter on each tile, so out-of-range
tuples are clamped or dropped exactly as XLA does.

Tile plan of a gather (**replicated table**): the table is multicast to every
tile that holds index tuples; each tile gathers its own tuples' results,
which it keeps (the result is mapped like the indices). The exchange is the
table times the receiving tiles instead of all indices to the table's tiles.

Choice. Each plan's cost is its exchange time (the busiest tile's bytes in or
out at the exchange rate, plus latency and a sync per superstep); the rules
take the cheaper of these plans and the served one, so a large table with few
indices keeps the served plan.
"""

from __future__ import annotations

import math
from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import builders
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import ExchangeCost, exchange_cycles, movement_cost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["plan_seconds", "ScatterPartials", "ReplicatedGather"]

# Cycles for a worker to load an index tuple and compute its table offset.
_CYCLES_PER_TUPLE = 3
# A partial table larger than this fraction of a tile's memory is not made.
_PARTIAL_BUDGET_FRACTION = 8

_COMBINERS = ("scatter", "scatter-add", "scatter-sub", "scatter-mul",
              "scatter-min", "scatter-max")


def plan_seconds(target, costs) -> float:
  """Exchange cycles of a plan's supersteps: busiest tile, latency, sync."""
  return float(sum(exchange_cycles(target, c) + target.sync_cycles_internal
                   for c in costs))


def _tuple_tiles(indices: P.Tensor) -> np.ndarray:
  """Tile of every index tuple: the tile of its first component."""
  k = indices.shape[-1] if indices.shape else 1
  return indices.mapping.element_tile[::max(k, 1)]


def _index_movement(target, indices: P.Tensor, tuple_tile: np.ndarray):
  """Index components not on their tuple's tile move there."""
  k = indices.shape[-1]
  if k <= 1:
    return None
  cost = movement_cost(target, indices.mapping.element_tile, np.repeat(tuple_tile, k),
                       indices.itemsize)
  return cost if cost.total_bytes else None


def _tree(count: int, fan_in: int) -> tuple:
  """Fan-ins of a reduction tree over ``count`` partials, ending at the table.

  Stages of ``fan_in`` run while more than ``fan_in`` partials remain; the
  last entry is the number of partials the table's tiles combine.
  """
  fan_in = max(2, int(fan_in))
  stages = []
  while count > fan_in:
    stages.append(fan_in)
    count = -(-count // fan_in)
  return tuple(stages) + (count,)


def _sets_cost(target, member_tiles, set_tiles, nbytes) -> ExchangeCost:
  """Each member tile sends ``nbytes`` to its set's tile (none to itself)."""
  moving = member_tiles != set_tiles
  src, dst = member_tiles[moving], set_tiles[moving]
  t = target.num_tiles
  bytes_in = np.bincount(dst, minlength=t)[:t] * nbytes
  bytes_out = np.bincount(src, minlength=t)[:t] * nbytes
  crossing = target.ipu_of_tile(src) != target.ipu_of_tile(dst)
  link = np.bincount(target.ipu_of_tile(src[crossing]),
                     minlength=target.num_ipus)[:target.num_ipus] * nbytes
  return ExchangeCost(bytes_in.astype(np.int64), bytes_out.astype(np.int64),
                      link.astype(np.int64))


def _identity(name: str, dtype) -> Optional[np.ndarray]:
  """The combiner's identity in ``dtype``, or None where it has none."""
  dtype = np.dtype(dtype) if not hasattr(dtype, "dtype") else dtype
  is_float = jnp.issubdtype(dtype, jnp.floating)
  is_int = jnp.issubdtype(dtype, jnp.integer)
  is_complex = jnp.issubdtype(dtype, jnp.complexfloating)
  if name in ("scatter-add", "scatter-sub"):
    return np.zeros((), dtype) if (is_float or is_int or is_complex) else None
  if name == "scatter-mul":
    return np.ones((), dtype) if (is_float or is_int or is_complex) else None
  if name == "scatter-min":
    if is_float:
      return np.asarray(np.inf, dtype)
    return np.asarray(jnp.iinfo(dtype).max, dtype) if is_int else None
  if name == "scatter-max":
    if is_float:
      return np.asarray(-np.inf, dtype)
    return np.asarray(jnp.iinfo(dtype).min, dtype) if is_int else None
  if name == "scatter":
    return np.zeros((), dtype)
  return None


def _reduce_rows(name: str, x, axis: int):
  """Combine partial tables along ``axis`` with the scatter's combiner."""
  if name in ("scatter-add", "scatter-sub"):
    return jnp.sum(x, axis=axis, dtype=x.dtype)
  if name == "scatter-mul":
    return jnp.prod(x, axis=axis, dtype=x.dtype)
  if name == "scatter-min":
    return lax.reduce(x, np.array(_identity(name, x.dtype)), lax.min, (axis,))
  return lax.reduce(x, np.array(_identity(name, x.dtype)), lax.max, (axis,))


def _pick_last(values, positions, axis: int):
  """Per element, the value of the largest writer position along ``axis``."""
  best = jnp.argmax(positions, axis=axis, keepdims=True)
  return (jnp.take_along_axis(values, best, axis=axis).squeeze(axis),
          jnp.take_along_axis(positions, best, axis=axis).squeeze(axis))


class ScatterPartials:
  """The partial-tables plan of one scatter (see the module docstring).

  Build with :meth:`plan`, which returns ``None`` where the plan does not
  apply; :attr:`costs` are its steps' exchanges; :meth:`emit` lowers it.
  """

  def __init__(self, ctx, name, operand, indices, updates, dnums, tuple_tile,
               update_tile, fan_ins):
    self.ctx, self.name = ctx, name
    self.operand, self.indices, self.updates, self.dnums = operand, indices, updates, dnums
    self.tuple_tile, self.update_tile, self.fan_ins = tuple_tile, update_tile, fan_ins
    self.group_tiles, self.group_of_tuple = np.unique(tuple_tile, return_inverse=True)
    self.overwrite = name == "scatter"
    self.costs = self._costs()

  @classmethod
  def plan(cls, ctx, name, operand, indices, updates, dnums, update_jaxpr):
    """The cheapest partial-tables plan over a few reduction trees, or None."""
    if name not in _COMBINERS or (name == "scatter" and update_jaxpr is not None):
      return None
    # Index tuples of no components (a whole-operand window) have no tile of
    # their own: the served plan handles them.
    if _identity(name, operand.dtype) is None or not indices.shape or indices.shape[-1] == 0:
      return None
    target = ctx.target
    table_bytes = operand.nbytes + (4 * operand.size if name == "scatter" else 0)
    if table_bytes > target.bytes_per_tile // _PARTIAL_BUDGET_FRACTION:
      return None
    tuple_tile = _tuple_tiles(indices)
    # Every update element belongs to the tuple of its scatter coordinates.
    window = tuple(dnums.update_window_dims)
    scatter_shape = [d for a, d in enumerate(updates.shape) if a not in window]
    ordinal = np.arange(tuple_tile.size, dtype=np.int64).reshape(scatter_shape)
    tuple_of_update = np.broadcast_to(np.expand_dims(ordinal, window), updates.shape)
    update_tile = tuple_tile[tuple_of_update.reshape(-1)]
    groups = np.unique(tuple_tile).size
    # Fan-ins: all partials straight to the table, a two-stage tree, and the
    # widest tree whose receive buffers fit the budget.
    widest = max(2, (target.bytes_per_tile // _PARTIAL_BUDGET_FRACTION) // max(table_bytes, 1))
    options = {_tree(groups, f) for f in (groups, int(math.ceil(math.sqrt(groups))), widest)}
    plans = [cls(ctx, name, operand, indices, updates, dnums, tuple_tile, update_tile,
                 fan_ins) for fan_ins in sorted(options)]
    budget = target.bytes_per_tile // _PARTIAL_BUDGET_FRACTION
    plans = [p for p in plans
             if max(int(c.bytes_in.max(initial=0)) for c in p.costs if c is not None) <= budget]
    if not plans:
      return None
    return min(plans, key=lambda p: plan_seconds(target, p.costs))

  # -- costs -----------------------------------------------------------------

  def _stage_tiles(self):
    """Tiles of the partial tables before each reduce stage, and after."""
    tiles = [self.group_tiles]
    for fan_in in self.fan_ins[:-1]:
      tiles.append(tiles[-1][::fan_in])
    return tiles

  @property
  def _partial_bytes(self) -> int:
    return self.operand.nbytes + (4 * self.operand.size if self.overwrite else 0)

  def _costs(self):
    target = self.ctx.target
    first = builders.add_costs(
        movement_cost(target, self.updates.mapping.element_tile, self.update_tile,
                      self.updates.itemsize),
        _index_movement(target, self.indices, self.tuple_tile))
    costs = [first]
    stage_tiles = self._stage_tiles()
    for fan_in, tiles in zip(self.fan_ins[:-1], stage_tiles[:-1]):
      sets = tiles[(np.arange(tiles.size) // fan_in) * fan_in]
      costs.append(_sets_cost(target, tiles, sets, self._partial_bytes))
    costs.append(self._apply_cost(stage_tiles[-1]))
    return costs

  def _apply_cost(self, partial_tiles) -> ExchangeCost:
    """Every table tile receives its slice of each remaining partial."""
    target = self.ctx.target
    t = target.num_tiles
    per_element = self._partial_bytes // max(self.operand.size, 1)
    held = self.operand.mapping.elements_per_tile(t).astype(np.int64) * per_element
    is_partial = np.zeros(t, bool)
    is_partial[partial_tiles] = True
    bytes_in = held * (partial_tiles.size - is_partial)
    total = int(held.sum())
    bytes_out = np.where(is_partial, total - held, 0)
    ipu = target.ipu_of_tile(np.arange(t))
    held_by_ipu = np.bincount(ipu, weights=held, minlength=target.num_ipus)
    partial_ipu = target.ipu_of_tile(partial_tiles)
    link = np.bincount(partial_ipu, weights=total - held_by_ipu[partial_ipu],
                       minlength=target.num_ipus)[:target.num_ipus]
    return ExchangeCost(bytes_in.astype(np.int64), bytes_out.astype(np.int64),
                        link.astype(np.int64))

  # -- lowering --------------------------------------------------------------

  def _partial_tensors(self, tiles, label):
    size = self.operand.size
    mapping = TileMapping(tiles.size * size, tiles, np.full(tiles.size, size, np.int64),
                          chunk=size)
    shape = (tiles.size,) + tuple(self.operand.shape)
    values = self.ctx.new_tensor(shape, self.operand.dtype, mapping,
                                 name=f"{self.ctx.op}/{label}")
    if not self.overwrite:
      return (values,)
    positions = self.ctx.new_tensor(shape, np.int32, mapping,
                                    name=f"{self.ctx.op}/{label}_positions")
    return values, positions

  def _extended_dnums(self):
    d = self.dnums
    return lax.ScatterDimensionNumbers(
        update_window_dims=tuple(d.update_window_dims),
        inserted_window_dims=(0,) + tuple(a + 1 for a in d.inserted_window_dims),
        scatter_dims_to_operand_dims=(0,) + tuple(a + 1 for a in d.scatter_dims_to_operand_dims),
        operand_batching_dims=tuple(a + 1 for a in d.operand_batching_dims),
        scatter_indices_batching_dims=tuple(d.scatter_indices_batching_dims))

  def emit(self, params, out: P.Tensor) -> None:
    """Emit the partials, reduce and apply steps; the result is ``out``."""
    ctx, name, target = self.ctx, self.name, self.ctx.target
    operand, indices, updates = self.operand, self.indices, self.updates
    num_groups = self.group_tiles.size
    identity = _identity(name, operand.dtype)
    index_dtype = np.dtype(indices.dtype)
    if np.iinfo(index_dtype).max < num_groups:
      index_dtype = np.dtype(np.int32)  # holds every value of the narrow types
    group_ids = self.group_of_tuple.reshape(tuple(indices.shape[:-1]) + (1,)).astype(index_dtype)
    scatter_kw = dict(dimension_numbers=self._extended_dnums(), indices_are_sorted=False,
                      unique_indices=params["unique_indices"], mode=params["mode"])
    combine = {"scatter-add": lax.scatter_add, "scatter-sub": lax.scatter_add,
               "scatter-mul": lax.scatter_mul, "scatter-min": lax.scatter_min,
               "scatter-max": lax.scatter_max, "scatter": lax.scatter}[name]
    first = self._partial_tensors(self.group_tiles, "partials")
    table_shape = (num_groups,) + tuple(operand.shape)
    num_tuples = self.tuple_tile.size
    update_shape = tuple(updates.shape)
    window = tuple(self.dnums.update_window_dims)

    def partials_fn(index_storage, update_storage):
      idx = builders.logical(index_storage, indices).astype(index_dtype)
      ext = jnp.concatenate([jnp.asarray(group_ids), idx], axis=-1)
      upd = builders.logical(update_storage, updates)
      start = jnp.full(table_shape, identity, operand.dtype)
      values = combine(start, ext, upd, **scatter_kw)
      if not self.overwrite:
        return (builders.storage(values, first[0]),)
      ordinal = jnp.arange(num_tuples, dtype=jnp.int32).reshape(
          [update_shape[a] for a in range(len(update_shape)) if a not in window])
      ordinal = jnp.broadcast_to(jnp.expand_dims(ordinal, window), update_shape)
      positions = lax.scatter_max(jnp.full(table_shape, -1, jnp.int32), ext, ordinal,
                                  **scatter_kw)
      return (builders.storage(values, first[0]),
              builders.storage(positions, first[1]))

    tuples_on_tile = np.bincount(self.tuple_tile, minlength=target.num_tiles)[:target.num_tiles]
    updates_on_tile = np.bincount(self.update_tile, minlength=target.num_tiles)[:target.num_tiles]
    table_on_group = np.zeros(target.num_tiles, np.int64)
    table_on_group[self.group_tiles] = operand.size * len(first)
    compute = (estimators.worker_split_cycles(target, tuples_on_tile, _CYCLES_PER_TUPLE, 4)
               + estimators.worker_split_cycles(target, updates_on_tile, 2.0, updates.itemsize)
               + estimators.fill_cycles(target, table_on_group, operand.itemsize))
    ctx.emit(P.Superstep(
        name=f"{ctx.op}/partials", op=ctx.op, reads=(indices, updates), writes=first,
        fn=partials_fn, compute_cycles=compute, exchange=self.costs[0],
        vertices=builders.worker_vertices(ctx, tuples_on_tile),
        codelets=(vocab.vertex(vocab.MULTI_UPDATE_OP, name),),
        flops=updates.size if jnp.issubdtype(operand.dtype, jnp.inexact) else 0))

    partials = first
    stage_tiles = self._stage_tiles()
    for stage, (fan_in, tiles, next_tiles) in enumerate(
        zip(self.fan_ins[:-1], stage_tiles[:-1], stage_tiles[1:])):
      reduced = self._partial_tensors(next_tiles, f"reduce{stage}")
      partials = self._emit_stage(partials, reduced, fan_in, identity,
                                  self.costs[1 + stage])
    self._emit_apply(partials, out, self.costs[-1])

  def _emit_stage(self, partials, reduced, fan_in, identity, cost):
    """One tree stage: sets of ``fan_in`` partials combine on their first tile."""
    ctx, name, target = self.ctx, self.name, self.ctx.target
    count, next_count = partials[0].shape[0], reduced[0].shape[0]
    pad = next_count * fan_in - count
    table_shape = tuple(self.operand.shape)

    def fn(*storages):
      values = builders.logical(storages[0], partials[0])
      values = jnp.concatenate(
          [values, jnp.full((pad,) + table_shape, identity, values.dtype)])
      values = values.reshape((next_count, fan_in) + table_shape)
      if not self.overwrite:
        return (builders.storage(_reduce_rows(name, values, 1), reduced[0]),)
      positions = builders.logical(storages[1], partials[1])
      positions = jnp.concatenate([positions, jnp.full((pad,) + table_shape, -1, jnp.int32)])
      positions = positions.reshape((next_count, fan_in) + table_shape)
      v, p = _pick_last(values, positions, 1)
      return builders.storage(v, reduced[0]), builders.storage(p, reduced[1])

    received = np.zeros(target.num_tiles, np.int64)
    received[reduced[0].mapping.tiles] = fan_in * self.operand.size
    ctx.emit(P.Superstep(
        name=f"{ctx.op}/reduce", op=ctx.op, reads=tuple(partials), writes=tuple(reduced),
        fn=fn, compute_cycles=estimators.reduce_cycles(target, received, self.operand.itemsize),
        exchange=cost, vertices=builders.worker_vertices(ctx, received),
        codelets=(vocab.vertex(vocab.REDUCE, name),)))
    return reduced

  def _emit_apply(self, partials, out, cost):
    """The table's tiles combine the last partials into the operand, in place."""
    ctx, name, target = self.ctx, self.name, self.ctx.target
    operand = self.operand
    count = partials[0].shape[0]

    def fn(operand_storage, *storages):
      old = builders.logical(operand_storage, operand)
      values = builders.logical(storages[0], partials[0])
      if self.overwrite:
        positions = builders.logical(storages[1], partials[1])
        v, p = _pick_last(values, positions, 0)
        return (builders.storage(jnp.where(p >= 0, v, old), out),)
      total = _reduce_rows(name, values, 0)
      if name == "scatter-add":
        new = old + total
      elif name == "scatter-sub":
        new = old - total
      elif name == "scatter-mul":
        new = old * total
      else:
        new = _reduce_rows(name, jnp.stack([old, total]), 0)
      return (builders.storage(new, out),)

    held = operand.mapping.elements_per_tile(target.num_tiles)
    ctx.emit(P.Superstep(
        name=f"{ctx.op}/apply", op=ctx.op, reads=(operand,) + tuple(partials),
        writes=(out,), fn=fn,
        compute_cycles=estimators.reduce_cycles(target, held * (count + 1), operand.itemsize),
        exchange=cost, vertices=builders.worker_vertices(ctx, held),
        codelets=(vocab.vertex(vocab.REDUCE, name),)))


class ReplicatedGather:
  """The replicated-table plan of one gather (see the module docstring)."""

  def __init__(self, ctx, table, indices, out_shape):
    self.ctx, self.table, self.indices = ctx, table, indices
    self.out_shape = tuple(out_shape)
    target = ctx.target
    # A replica must fit comfortably beside what the tile already holds, and
    # index tuples need components to have a tile (see ScatterPartials.plan).
    self.feasible = (table.nbytes <= target.bytes_per_tile // _PARTIAL_BUDGET_FRACTION
                     and bool(indices.shape) and indices.shape[-1] > 0)
    if not self.feasible:
      self.tuple_tile, self.costs = np.zeros(0, np.int64), []
      return
    self.tuple_tile = _tuple_tiles(indices)
    self.costs = [builders.add_costs(
        builders.broadcast_cost(ctx, table, np.unique(self.tuple_tile)),
        _index_movement(target, indices, self.tuple_tile))]

  def out_mapping(self, offset_dims) -> TileMapping:
    """Each result element on the tile of the index tuple it was gathered by."""
    batch_shape = tuple(self.indices.shape[:-1])
    tiles = self.tuple_tile.reshape(batch_shape)
    tiles = np.expand_dims(tiles, tuple(offset_dims)) if offset_dims else tiles
    return TileMapping.from_element_tiles(np.broadcast_to(tiles, self.out_shape))

  def emit(self, fn, out: P.Tensor, codelet: str) -> None:
    ctx, target = self.ctx, self.ctx.target
    tuples = np.bincount(self.tuple_tile, minlength=target.num_tiles)[:target.num_tiles]
    elements = out.mapping.elements_per_tile(target.num_tiles)
    compute = (estimators.worker_split_cycles(target, tuples, _CYCLES_PER_TUPLE, 4)
               + estimators.copy_cycles(target, elements, out.itemsize))
    ctx.emit(P.Superstep(
        name=f"{ctx.op}/replicated", op=ctx.op, reads=(self.table, self.indices),
        writes=(out,), fn=fn, compute_cycles=compute, exchange=self.costs[0],
        vertices=builders.worker_vertices(ctx, tuples), codelets=(codelet,)))
