"""Windowed reductions: pooling and its gradients.

Covers ``reduce_window_sum``, ``reduce_window_max``, ``reduce_window_min``,
the generic ``reduce_window`` (any jaxpr computation), ``select_and_scatter_add``
(the gradient of max pooling) and ``select_and_gather_add`` (in the JVP of
max pooling), with any strides, padding and base/window dilation.

Tile plan: the result is cut into row blocks along a *non-windowed* axis — one
whose window is 1 wide with stride 1, no padding and no dilation, typically
the batch axis of NHWC pooling, or the channel axis — so every output block
needs exactly the matching block of each input: the blocks are halo-free and
no tile needs another's rows. The largest such axis is chosen (the first on
ties) and :func:`~ipu_jax.lowering.builders.partitioned` exchanges the input
blocks onto their tiles. Each tile then runs one pooling vertex whose cost is
the window size times the outputs it computes, at about a vector per cycle
per worker. A tensor with no non-windowed axis (a 1-D window over everything)
is pooled on one tile.

Execution: ``"batched"`` runs the primitive on the logical arrays; ``"per_tile"``
vmaps it over the tiles' blocks. Both give the numbers ``jax.jit`` gives.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import windowed_reductions as wr
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, partitioned, storage, worker_vertices
from ipu_jax.lowering.exchange import movement_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering

__all__ = ["split_axis"]


def split_axis(shape, window_dimensions, window_strides, padding,
               base_dilation=None) -> Optional[int]:
  """The largest axis the window does not touch (``None`` if there is none)."""
  best = None
  for a, d in enumerate(shape):
    if window_dimensions[a] != 1 or window_strides[a] != 1:
      continue
    if tuple(padding[a]) != (0, 0):
      continue
    if base_dilation is not None and base_dilation[a] != 1:
      continue
    if best is None or d > shape[best]:
      best = a
  return best


def _single_tile(ctx, fn, operands, out_avals, work, itemsize, codelet):
  """Pool on one tile (no axis can be split without halos)."""
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
  elements = np.zeros(target.num_tiles, np.int64)
  elements[tile] = work
  cycles = estimators.worker_split_cycles(target, elements, 1, itemsize)

  def run(*storages):
    result = fn(*[logical(s, t) for s, t in zip(storages, operands)])
    if not isinstance(result, (tuple, list)):
      result = (result,)
    return tuple(storage(r, o) for r, o in zip(result, outputs))

  ctx.emit(P.Superstep(name=ctx.op, op=ctx.op, reads=tuple(operands), writes=tuple(outputs),
                       fn=run, compute_cycles=cycles, exchange=cost,
                       vertices=worker_vertices(ctx, np.minimum(elements, 1)),
                       codelets=(codelet,)))
  return outputs


def _lower_window(ctx, fn, operands: Sequence[P.Tensor], splittable: Sequence[bool],
                  axis: Optional[int], window_elems: int, cost_per_element: int,
                  codelet: str, float_flops: bool) -> list:
  """Partition along ``axis`` (operands with ``splittable`` cut the same way)."""
  out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in ctx.out_avals]
  out_shape, out_dtype = out_avals[0]
  out_size = int(np.prod(out_shape, dtype=np.int64))
  itemsize = out_dtype.itemsize
  # The work runs over the windows: one per output of a pooling, one per
  # source element of select_and_scatter_add.
  pooled = operands[0].size if codelet.startswith(vocab.SELECT_AND_SCATTER) else out_size
  flops = pooled * window_elems if float_flops else 0
  if out_size == 0:
    outputs = [ctx.new_tensor(s, d) for s, d in out_avals]
    ctx.emit(P.Superstep(name=ctx.op, op=ctx.op, reads=(), writes=tuple(outputs),
                         fn=lambda: tuple(jnp.zeros(o.storage_shape, o.dtype) for o in outputs)))
    return outputs
  if axis is None or not out_shape:
    return _single_tile(ctx, fn, operands, out_avals, pooled * window_elems * cost_per_element,
                        itemsize, codelet)
  per_out_row = pooled // max(out_shape[axis], 1)
  target = ctx.target

  def cycles(rows_on_tile):
    work = np.asarray(rows_on_tile, np.int64) * per_out_row * window_elems * cost_per_element
    return estimators.worker_split_cycles(target, work, 1, itemsize)

  return partitioned(ctx, fn, operands, out_avals,
                     [axis if s else None for s in splittable], out_axis=axis,
                     flops=flops, cycles_per_tile_fn=cycles, codelet=codelet)


def _is_float(dtype) -> bool:
  return np.issubdtype(np.dtype(dtype), np.inexact)


def _make_monoid_rule(prim, kind):
  def rule(ctx, x, *, window_dimensions, window_strides, padding, base_dilation,
           window_dilation):
    params = dict(window_dimensions=window_dimensions, window_strides=window_strides,
                  padding=padding, base_dilation=base_dilation,
                  window_dilation=window_dilation)
    axis = split_axis(x.shape, window_dimensions, window_strides, padding, base_dilation)
    return _lower_window(ctx, lambda a: prim.bind(a, **params), [x], [True], axis,
                         int(np.prod(window_dimensions)), 1, vocab.vertex(vocab.POOL, kind),
                         _is_float(x.dtype))
  return rule


register_lowering(wr.reduce_window_sum_p, _make_monoid_rule(wr.reduce_window_sum_p, "add"))
register_lowering(wr.reduce_window_max_p, _make_monoid_rule(wr.reduce_window_max_p, "max"))
register_lowering(wr.reduce_window_min_p, _make_monoid_rule(wr.reduce_window_min_p, "min"))


@register_lowering(wr.reduce_window_p)
def _reduce_window_rule(ctx, *args, jaxpr, consts, window_dimensions, window_strides,
                        padding, base_dilation, window_dilation):
  """Generic ``lax.reduce_window``: any computation, variadic operands."""
  num = len(args) // 2
  xs, inits = list(args[:num]), list(args[num:])
  params = dict(jaxpr=jaxpr, consts=consts, window_dimensions=window_dimensions,
                window_strides=window_strides, padding=padding,
                base_dilation=base_dilation, window_dilation=window_dilation)
  # Constant init values are baked into the vertex; others are multicast.
  baked = [np.asarray(t.value) if t.category == "constants" and t.value is not None else None
           for t in inits]
  read_inits = [t for t, b in zip(inits, baked) if b is None]

  def fn(*arrays):
    data, rest = arrays[:num], iter(arrays[num:])
    init_values = [b if b is not None else next(rest) for b in baked]
    return tuple(wr.reduce_window_p.bind(*data, *init_values, **params))

  axis = split_axis(xs[0].shape, window_dimensions, window_strides, padding, base_dilation)
  eqns = max(1, len(getattr(jaxpr, "eqns", ())))
  return _lower_window(ctx, fn, xs + read_inits, [True] * num + [False] * len(read_inits),
                       axis, int(np.prod(window_dimensions)), eqns, vocab.vertex(vocab.POOL, "reduce"),
                       all(_is_float(x.dtype) for x in xs))


@register_lowering(wr.select_and_scatter_add_p)
def _select_and_scatter_add_rule(ctx, source, operand, *, select_prim, window_dimensions,
                                 window_strides, padding):
  """Max-pool gradient: each window's cotangent goes to its selected element."""
  params = dict(select_prim=select_prim, window_dimensions=window_dimensions,
                window_strides=window_strides, padding=padding)
  axis = split_axis(operand.shape, window_dimensions, window_strides, padding)

  def fn(s, o):
    return wr.select_and_scatter_add_p.bind(s, o, **params)

  return _lower_window(ctx, fn, [source, operand], [True, True], axis,
                       int(np.prod(window_dimensions)), 2, vocab.vertex(vocab.SELECT_AND_SCATTER, "add"),
                       _is_float(source.dtype))


@register_lowering(wr.select_and_gather_add_p)
def _select_and_gather_add_rule(ctx, tangents, operand, *, select_prim, window_dimensions,
                                window_strides, padding, base_dilation, window_dilation):
  """Max-pool JVP: each window takes the tangent of its selected element."""
  params = dict(select_prim=select_prim, window_dimensions=window_dimensions,
                window_strides=window_strides, padding=padding,
                base_dilation=base_dilation, window_dilation=window_dilation)
  axis = split_axis(operand.shape, window_dimensions, window_strides, padding, base_dilation)

  def fn(t, o):
    return wr.select_and_gather_add_p.bind(t, o, **params)

  return _lower_window(ctx, fn, [tangents, operand], [True, True], axis,
                       int(np.prod(window_dimensions)), 2, vocab.vertex(vocab.SELECT_AND_GATHER, "add"),
                       _is_float(tangents.dtype))
