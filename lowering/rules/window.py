"""Windowed reductions: pooling and its gradients.

Covers ``reduce_window_sum``, ``reduce_window_max``, ``reduce_window_min``,
the generic ``reduce_window`` (any jaxpr computation), ``select_and_scatter_add``
(the gradient of max pooling) and ``select_and_gather_add`` (in the JVP of
max pooling), with any strides, padding and base/window dilation. The
gradient of average pooling is a ``pad`` (``lowering/rules/shape.py``) and a
``reduce_window_sum``.

Tile plan (``lowering/window_plan.py``): the result is cut into a grid of
boxes along every axis, batch, channels and the windowed (spatial) axes
alike, one box per tile; a tile receives the input box its windows read,
its own rows plus the halo the windows reach into its neighbours' (exchange
counted exactly, by regions), and runs one pooling vertex costed as the
window size times the windows it computes, at about a vector per cycle per
worker. ``select_and_scatter_add`` cuts its operand-shaped result the same
way; a tile receives the windows touching its box and the operand they read.
A 0-d or empty operand is pooled on one tile.

Execution: the step's logical form is the primitive on the logical arrays
(the ``"batched"`` executor runs it); its ``fn`` (the ``"per_tile"``
executor's) cuts each operand into the boxes' input windows (padding and
base dilation made explicit) and vmaps the primitive over the boxes with no
padding. The primitives skip padding and holes; the explicit ones are the
reduction's identity (max, min, sum; the selections pad with the value they
never prefer over an earlier one), and a generic computation, which has no
identity, reduces a validity mask alongside and skips them. Both forms give
the numbers ``jax.jit`` gives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering.jax_compat import windowed_reductions as wr
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering import window_plan as W
from ipu_jax.lowering.builders import (add_costs, broadcast_cost, logical, storage,
                                       worker_vertices)
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import exchange_cycles, movement_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_grid import (block_grid_mapping, blocked_storage, grid_tiles,
                                          operand_exchange_cost)
from ipu_jax.lowering.registry import register_lowering

__all__ = ["WindowedOp"]


@dataclasses.dataclass(frozen=True)
class WindowedOp:
  """One windowed primitive, as the planner and the emitter need it.

  Attributes:
    geo: its window geometry.
    fn: ``fn(*operands) -> result or tuple``, the primitive as traced.
    box_fn: ``box_fn(*windows, *extras)``: the primitive on one box's input
      windows, with no padding or base dilation (they are explicit there).
    fills: ``fills(*extras)``: per windowed operand, the value the primitive
      pads it with (its reduction's identity).
    windowed: how many leading operands are windowed (the rest, ``extras``,
      e.g. init values, go whole to every tile).
    cost: vector passes per window element.
    codelet: the vertex it runs.
    float_flops: whether its work counts as FLOPs.
    scatter: ``select_and_scatter_add``: operands ``(source, operand)``, the
      result has the operand's shape.
    masked: ``box_fn`` takes, after the windows, a boolean window marking
      the input elements (not padding or dilation holes), for a computation
      with no identity to pad with.
  """

  geo: W.WindowGeometry
  fn: Callable
  box_fn: Callable
  fills: Callable
  windowed: int
  cost: int
  codelet: str
  float_flops: bool
  scatter: bool = False
  masked: bool = False


def _is_float(dtype) -> bool:
  # jnp's test: bfloat16 and the FP8 types are not NumPy inexact types.
  return bool(jnp.issubdtype(dtype, jnp.inexact))


def _extreme(dtype, lowest: bool):
  """The lowest (or highest) value of ``dtype``: the identity of max (min)."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return np.array(not lowest)
  if _is_float(dtype):
    return np.array(-np.inf if lowest else np.inf, dtype)
  info = jnp.iinfo(dtype)
  return np.array(info.min if lowest else info.max, dtype)


def _single_tile(ctx, op: WindowedOp, operands, out_avals):
  """Pool on one tile (a 0-d or empty operand: nothing to cut)."""
  target = ctx.target
  tile = ctx.claim_tiles(1)
  outputs = []
  for shape, dtype in out_avals:
    size = int(np.prod(shape, dtype=np.int64))
    outputs.append(ctx.new_tensor(shape, dtype, TileMapping.single(size, tile)
                                  if size else None))
  cost = None
  for t in operands:
    if t.size:
      c = movement_cost(target, t.mapping.element_tile, np.full(t.size, tile), t.itemsize)
      cost = c if cost is None else cost + c
  pooled = operands[0].size if op.scatter else int(np.prod(out_avals[0][0], dtype=np.int64))
  elements = np.zeros(target.num_tiles, np.int64)
  elements[tile] = pooled * op.geo.window_elements * op.cost
  cycles = estimators.worker_split_cycles(target, elements, 1, np.dtype(out_avals[0][1]).itemsize)

  def run(*storages):
    results = _whole(op, *[logical(s, t) for s, t in zip(storages, operands)])
    return tuple(storage(r, o) for r, o in zip(results, outputs))

  ctx.emit(P.Superstep(name=ctx.op, op=ctx.op, reads=tuple(operands), writes=tuple(outputs),
                       fn=run, logical=functools.partial(_whole, op),
                       compute_cycles=cycles, exchange=cost,
                       vertices=worker_vertices(ctx, np.minimum(elements, 1)),
                       codelets=(op.codelet,),
                       flops=pooled * op.geo.window_elements if op.float_flops else 0))
  return outputs


def _exchange(ctx, op: WindowedOp, plan: W.WindowPlan, operands, tiles):
  """Exact bytes moved: each box's input windows, by ranges; extras multicast."""
  target, geo = ctx.target, op.geo
  needs = (list(W.scatter_needs(geo, plan)) if op.scatter
           else [W.pool_needs(geo, plan)] * op.windowed)
  costs = []
  for t, (need, elements) in zip(operands[:op.windowed], needs):
    if t.size:
      nd = len(t.shape)
      cost, _ = operand_exchange_cost(target, t, tuple(range(nd)), t.shape,
                                      tuple((a,) for a in range(nd)), plan.grid, tiles, need,
                                      elements)
      costs.append(cost)
  costs += [broadcast_cost(ctx, t, tiles) for t in operands[op.windowed:]]
  return add_costs(*costs)


def _work(op: WindowedOp, windowed, out_avals) -> W.WindowWork:
  """What the planner costs per box for ``op`` (its key in the plan cache)."""
  itemsize = out_avals[0][1].itemsize
  if op.scatter:
    source, operand = windowed
    return W.WindowWork(scatter=True, cost=op.cost, itemsize=itemsize,
                        in_bytes=operand.itemsize, out_bytes=itemsize,
                        source_bytes=source.itemsize)
  return W.WindowWork(scatter=False, cost=op.cost, itemsize=itemsize,
                      in_bytes=sum(t.itemsize for t in windowed),
                      out_bytes=sum(d.itemsize for _, d in out_avals))


def _choose(ctx, op: WindowedOp, plans, operands) -> tuple:
  """The shortlisted plan with the fewest cycles given where the operands are.

  Returns:
    ``(plan, exchange, windows)``: the plan, its exact exchange and the
    windows each box computes.
  """
  target = ctx.target
  itemsize = np.dtype(ctx.out_avals[0].dtype).itemsize
  best = None
  for plan in plans:
    windows = W.block_work(op.geo, plan, op.scatter)
    work = windows * op.geo.window_elements * op.cost
    cycles = float(estimators.worker_split_cycles(target, work, 1, itemsize).max(initial=0))
    if best is not None and cycles >= best[0]:
      continue  # its compute alone is no better: skip costing its exchange
    count = plan.num_tiles
    # The tiles grid_tiles will give (peeked, not claimed).
    start = ctx.next_start_tile if count < target.num_tiles else 0
    tiles = (start + np.arange(count, dtype=np.int64)) % target.num_tiles
    exchange = _exchange(ctx, op, plan, operands, tiles)
    cycles += exchange_cycles(target, exchange)
    if best is None or cycles < best[0]:
      best = (cycles, plan, exchange, windows)
  return best[1:]


def _lower(ctx, op: WindowedOp, operands: Sequence[P.Tensor]) -> list:
  """Plan, cost and emit one windowed primitive."""
  out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in ctx.out_avals]
  out_shape = out_avals[0][0]
  if int(np.prod(out_shape, dtype=np.int64)) == 0:
    outputs = [ctx.new_tensor(s, d) for s, d in out_avals]
    ctx.emit(P.Superstep(name=ctx.op, op=ctx.op, reads=(), writes=tuple(outputs),
                         fn=lambda: tuple(jnp.zeros(o.storage_shape, o.dtype) for o in outputs)))
    return outputs
  windowed = operands[:op.windowed]
  if not out_shape or any(t.size == 0 for t in windowed):
    return _single_tile(ctx, op, operands, out_avals)
  target, geo = ctx.target, op.geo
  itemsize = out_avals[0][1].itemsize
  plans = W.plan_window(target, geo, _work(op, windowed, out_avals))
  plan, exchange, windows = _choose(ctx, op, plans, operands)
  tiles = grid_tiles(ctx, plan.num_tiles)
  outputs = [ctx.new_tensor(s, d, block_grid_mapping(s, plan.grid, plan.block, tiles))
             for s, d in out_avals]
  elements = np.zeros(target.num_tiles, np.int64)
  elements[tiles] = windows * geo.window_elements * op.cost

  def run(*storages):
    results = _per_tile(op, plan, [logical(s, t) for s, t in zip(storages, operands)])
    return tuple(blocked_storage(r.astype(o.dtype), plan.grid, plan.block)
                 for r, o in zip(results, outputs))

  ctx.emit(P.Superstep(
      name=f"{ctx.op} {plan.label}", op=ctx.op, reads=tuple(operands), writes=tuple(outputs),
      fn=run, compute_cycles=estimators.worker_split_cycles(target, elements, 1, itemsize),
      exchange=exchange,
      vertices=worker_vertices(ctx, elements), codelets=(op.codelet,),
      flops=int(windows.sum()) * geo.window_elements if op.float_flops else 0,
      logical=functools.partial(_whole, op)))
  return outputs


def _whole(op, *arrays) -> tuple:
  """The step's logical form: the primitive on the logical operands."""
  results = op.fn(*arrays)
  return tuple(results) if isinstance(results, (tuple, list)) else (results,)


# -- per-tile execution ------------------------------------------------------------


def _cut(x, axis: int, starts: np.ndarray, span: int, fill):
  """``x`` with ``axis`` replaced by ``[len(starts), span]`` windows (``fill`` outside)."""
  n = x.shape[axis]
  low = max(0, -int(starts.min()))
  high = max(0, int(starts.max()) + span - n)
  if low or high:
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (low, high, 0)
    x = lax.pad(x, jnp.asarray(fill, x.dtype), config)
  index = (starts + low)[:, None] + np.arange(span, dtype=np.int64)[None, :]
  return jnp.take(x, jnp.asarray(index), axis=axis, mode="clip")


def _boxes_first(x, nd: int):
  """``[g0, w0, g1, w1, ...]`` -> ``[G, w0, w1, ...]`` (boxes row-major)."""
  x = jnp.transpose(x, tuple(range(0, 2 * nd, 2)) + tuple(range(1, 2 * nd, 2)))
  return x.reshape((-1,) + x.shape[nd:])


def _assemble(y, plan: W.WindowPlan, shape):
  """``[G, *block]`` box results -> the array of ``shape`` they tile."""
  nd = len(shape)
  y = y.reshape(tuple(plan.grid) + tuple(plan.block))
  y = jnp.transpose(y, tuple(i for a in range(nd) for i in (a, nd + a)))
  y = y.reshape(tuple(g * b for g, b in zip(plan.grid, plan.block)))
  return y[tuple(slice(0, d) for d in shape)]


def _per_tile(op: WindowedOp, plan: W.WindowPlan, arrays) -> tuple:
  """Every box computed from its own input windows, vmapped over the grid."""
  if op.scatter:
    return (_scatter_per_tile(op, plan, *arrays),)
  geo, nd = op.geo, op.geo.ndim
  extras = arrays[op.windowed:]
  windowed, fills = list(arrays[:op.windowed]), list(op.fills(*extras))
  if op.masked:
    windowed.append(jnp.ones(geo.in_shape, bool))
    fills.append(False)
  boxes = []
  for x, fill in zip(windowed, fills):
    fill = jnp.asarray(fill, x.dtype)
    # Padding and base dilation as explicit identity elements.
    x = lax.pad(x, fill, [(lo, hi, b - 1) for (lo, hi), b in zip(geo.padding, geo.base_dilation)])
    for a in range(nd):
      starts, span = W.pool_cuts(geo, plan, a)
      x = _cut(x, 2 * a, starts, span, fill)
    boxes.append(_boxes_first(x, nd))
  in_axes = (0,) * len(boxes) + (None,) * len(extras)
  results = jax.vmap(op.box_fn, in_axes=in_axes)(*boxes, *extras)
  results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
  return tuple(_assemble(r, plan, geo.out_shape) for r in results)


def _scatter_per_tile(op: WindowedOp, plan: W.WindowPlan, source, operand):
  """``select_and_scatter_add`` per box: its windows scattered, its own rows kept."""
  geo, nd = op.geo, op.geo.ndim
  (op_fill,) = op.fills()
  op_fill = jnp.asarray(op_fill, operand.dtype)
  offsets = []
  for a in range(nd):
    first, count, op_starts, span, offset = W.scatter_cuts(geo, plan, a)
    source = _cut(source, 2 * a, first, count, jnp.zeros((), source.dtype))
    operand = _cut(operand, 2 * a, op_starts, span, op_fill)
    offsets.append(offset)
  coords = np.unravel_index(np.arange(plan.num_tiles), plan.grid)
  starts = np.stack([o[c] for o, c in zip(offsets, coords)], axis=1)

  def box(s, o, start):
    return lax.dynamic_slice(op.box_fn(s, o), tuple(start), plan.block)

  y = jax.vmap(box)(_boxes_first(source, nd), _boxes_first(operand, nd), jnp.asarray(starts))
  return _assemble(y, plan, geo.in_shape)


# -- rules ---------------------------------------------------------------------


def _unpadded(geo: W.WindowGeometry) -> dict:
  return dict(padding=((0, 0),) * geo.ndim, base_dilation=(1,) * geo.ndim)


def _make_monoid_rule(prim, kind):
  def rule(ctx: RuleContext, x, *, window_dimensions, window_strides, padding, base_dilation,
           window_dilation):
    geo = W.window_geometry(x.shape, ctx.out_avals[0].shape, window_dimensions, window_strides,
                            padding, base_dilation, window_dilation)
    params = dict(window_dimensions=window_dimensions, window_strides=window_strides,
                  window_dilation=window_dilation)
    identity = (np.zeros((), x.dtype) if kind == "add"
                else _extreme(x.dtype, lowest=kind == "max"))
    op = WindowedOp(geo=geo, fn=lambda a: prim.bind(a, padding=padding,
                                                    base_dilation=base_dilation, **params),
                    box_fn=lambda a: prim.bind(a, **_unpadded(geo), **params),
                    fills=lambda: (identity,), windowed=1, cost=1,
                    codelet=vocab.vertex(vocab.POOL, kind), float_flops=_is_float(x.dtype))
    return _lower(ctx, op, [x])
  return rule


register_lowering(wr.reduce_window_sum_p, _make_monoid_rule(wr.reduce_window_sum_p, "add"))
register_lowering(wr.reduce_window_max_p, _make_monoid_rule(wr.reduce_window_max_p, "max"))
register_lowering(wr.reduce_window_min_p, _make_monoid_rule(wr.reduce_window_min_p, "min"))


@register_lowering(wr.reduce_window_p)
def _reduce_window_rule(ctx: RuleContext, *args, jaxpr, consts, window_dimensions, window_strides,
                        padding, base_dilation, window_dilation):
  """Generic ``lax.reduce_window``: any computation, variadic operands."""
  num = len(args) // 2
  xs, inits = list(args[:num]), list(args[num:])
  params = dict(jaxpr=jaxpr, consts=consts, window_dimensions=window_dimensions,
                window_strides=window_strides, window_dilation=window_dilation)
  geo = W.window_geometry(xs[0].shape, ctx.out_avals[0].shape, window_dimensions,
                          window_strides, padding, base_dilation, window_dilation)
  # Constant init values are baked into the vertex; others are multicast.
  baked = [np.asarray(t.value) if t.category == "constants" and t.value is not None else None
           for t in inits]
  read_inits = [t for t, b in zip(inits, baked) if b is None]

  def init_values(extras):
    rest = iter(extras)
    return [b if b is not None else next(rest) for b in baked]

  def fn(*arrays):
    return tuple(wr.reduce_window_p.bind(*arrays[:num], *init_values(arrays[num:]),
                                         padding=padding, base_dilation=base_dilation, **params))

  combine = _skipping_holes(jaxpr, consts, num)

  def box_fn(*arrays):
    # The primitive skips padding and dilation holes (it does not reduce the
    # init value into them), so the box's explicit ones are masked out.
    boxes, mask = arrays[:num], arrays[num]
    inits = tuple(init_values(arrays[num + 1:])) + (np.bool_(True),)
    return lax.reduce_window(tuple(boxes) + (mask,), inits, combine, window_dimensions,
                             window_strides, ((0, 0),) * geo.ndim,
                             window_dilation=window_dilation)[:num]

  eqns = max(1, len(getattr(jaxpr, "eqns", ())))
  op = WindowedOp(geo=geo, fn=fn, box_fn=box_fn, fills=lambda *e: init_values(e), windowed=num,
                  cost=eqns, codelet=vocab.vertex(vocab.POOL, "reduce"),
                  float_flops=all(_is_float(x.dtype) for x in xs), masked=True)
  return _lower(ctx, op, xs + read_inits)


def _skipping_holes(jaxpr, consts, num: int) -> Callable:
  """A reduce-window computation over ``(values..., valid)`` that skips invalid ones."""
  computation = jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(jaxpr, consts))

  def combine(a, b):
    a_values, a_valid, b_values, b_valid = a[:num], a[num], b[:num], b[num]
    out = computation(*a_values, *b_values)
    both = a_valid & b_valid
    values = tuple(jnp.where(both, o, jnp.where(a_valid, x, y))
                   for o, x, y in zip(out, a_values, b_values))
    return values + (a_valid | b_valid,)

  return combine


@register_lowering(wr.select_and_scatter_add_p)
def _select_and_scatter_add_rule(ctx: RuleContext, source, operand, *, select_prim,
                                 window_dimensions, window_strides, padding):
  """Max-pool gradient: each window's cotangent goes to its selected element."""
  params = dict(select_prim=select_prim, window_dimensions=window_dimensions,
                window_strides=window_strides)
  geo = W.window_geometry(operand.shape, source.shape, window_dimensions, window_strides,
                          padding)
  # The selection pads the operand with the value it never prefers.
  fill = _extreme(operand.dtype, lowest=select_prim is lax.ge_p)
  op = WindowedOp(
      geo=geo, fn=lambda s, o: wr.select_and_scatter_add_p.bind(s, o, padding=padding, **params),
      box_fn=lambda s, o: wr.select_and_scatter_add_p.bind(
          s, o, padding=((0, 0),) * geo.ndim, **params),
      fills=lambda: (fill,), windowed=2, cost=2,
      codelet=vocab.vertex(vocab.SELECT_AND_SCATTER, "add"),
      float_flops=_is_float(source.dtype), scatter=True)
  return _lower(ctx, op, [source, operand])


@register_lowering(wr.select_and_gather_add_p)
def _select_and_gather_add_rule(ctx: RuleContext, tangents, operand, *, select_prim,
                                window_dimensions,
                                window_strides, padding, base_dilation, window_dilation):
  """Max-pool JVP: each window takes the tangent of its selected element."""
  params = dict(select_prim=select_prim, window_dimensions=window_dimensions,
                window_strides=window_strides, window_dilation=window_dilation)
  geo = W.window_geometry(operand.shape, ctx.out_avals[0].shape, window_dimensions,
                          window_strides, padding, base_dilation, window_dilation)
  fills = (np.zeros((), tangents.dtype), _extreme(operand.dtype, lowest=select_prim is lax.ge_p))
  op = WindowedOp(
      geo=geo,
      fn=lambda t, o: wr.select_and_gather_add_p.bind(t, o, padding=padding,
                                                      base_dilation=base_dilation, **params),
      box_fn=lambda t, o: wr.select_and_gather_add_p.bind(t, o, **_unpadded(geo), **params),
      fills=lambda: fills, windowed=2, cost=2,
      codelet=vocab.vertex(vocab.SELECT_AND_GATHER, "add"), float_flops=_is_float(tangents.dtype))
  return _lower(ctx, op, [tangents, operand])
