"""Static data movement: one superstep whose every output element copies a known source.

:func:`move` lowers a movement described in closed form: for each output, boxes
whose elements copy affine positions of the sources
(:class:`~ipu_jax.lowering.copy_plan.BoxMap`: a broadcast axis has source
stride 0, a transpose permutes strides, a slice offsets and scales them), or a
per-element source index. It plans the exchange by regions (rows cut at
tile-run boundaries, in time proportional to runs, ``lowering/copy_plan.py``;
a transpose of the innermost axis from its tiles transposed like the data) and
falls back to the per-element planner
:func:`~ipu_jax.lowering.copy_elements.exchange_plan` only for other maps with
short runs; all give the same figures. The step runs ``Copy`` vertices for the
elements that did not arrive straight from the exchange and ``Fill`` vertices
for constants.

:func:`alias` (the same storage seen with another shape, no step),
:func:`broadcast_in_dim` and :func:`broadcast_to` are built on it. The
movement rules (``lowering/rules/shape.py``) and other rules and builders
(``lowering/builders.py`` its readers of broadcast operands)
share these, as JAX's ``mlir.py`` holds the machinery its primitives' rules
share. :func:`broadcast_read_exchange` prices an elementwise step reading an
operand with size-1 axes in place (popops' vertices read the broadcast view):
the broadcast's exchange without its copy step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import copy_elements, copy_plan
from ipu_jax.lowering import program as P
from ipu_jax.lowering.copy_plan import Box, BoxMap, row_major_strides
from ipu_jax.lowering.exchange import to_flat, to_storage
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.program import worker_vertices

__all__ = ["alias", "move", "broadcast_in_dim", "broadcast_to", "bind_params",
           "uniform_value", "broadcast_read_exchange", "broadcast_view"]


def _output_mapping(ctx, operands, shape, dtype) -> TileMapping:
  """Where a moved result lives: near its inputs, spread linearly.

  A result the size of a linearly mapped operand takes that operand's
  mapping (as popops maps results like their operand), so a transpose or
  reverse moves only the elements that change tile. Otherwise the result is
  mapped linearly; when it is too small to cover every tile it starts on its
  largest operand's first tile rather than on a fresh one.
  """
  size = int(np.prod(shape, dtype=np.int64))
  itemsize = np.dtype(dtype).itemsize
  live = [t for t in operands if t.category != "constants" and t.size and t.mapping.is_linear]
  for t in live:
    if t.size == size and t.itemsize == itemsize:
      return t.mapping
  if live and size:
    num_tiles = ctx.target.num_tiles
    mapping = TileMapping.linear(size, num_tiles, itemsize)
    if mapping.num_rows < num_tiles:
      start = int(max(live, key=lambda t: t.size).mapping.tiles[0])
      return TileMapping.blocks(size, mapping.chunk, num_tiles, start)
    return mapping
  return ctx.linear_mapping(shape, dtype)


def alias(tensor: P.Tensor, shape) -> P.Tensor:
  """``tensor`` seen with another shape of the same size, sharing its storage.

  The alias keeps the tensor's id, so the executor (which keys state by id)
  reads and writes the very same storage, and the memory analysis counts it
  once. Only rules whose output keeps the flat element order may use it.
  """
  shape = tuple(int(d) for d in shape)
  if shape == tuple(tensor.shape):
    return tensor
  if int(np.prod(shape, dtype=np.int64)) != tensor.size:
    raise ValueError(f"alias: {tensor.shape} has {tensor.size} elements, not {shape}")
  value = None if tensor.value is None else np.asarray(tensor.value).reshape(shape)
  return dataclasses.replace(tensor, shape=shape, value=value)


def _is_identity(source: np.ndarray) -> bool:
  n = source.size
  if n == 0:
    return True
  if source[0] != 0 or source[-1] != n - 1:
    return False
  return bool(np.array_equal(source, np.arange(n, dtype=source.dtype)))


def uniform_value(tensor: P.Tensor):
  """The single value of a constant tensor whose elements are all equal."""
  if tensor.category != "constants" or tensor.value is None or tensor.size == 0:
    return None
  value = np.asarray(tensor.value, tensor.dtype).reshape(-1)
  if value.size > 1:
    # Compare bytes so that NaN == NaN and -0.0 != 0.0, as a fill would.
    raw = value.view(np.uint8).reshape(value.size, value.itemsize)
    if not (raw == raw[0]).all():
      return None
  return value[0]


@dataclasses.dataclass(frozen=True)
class _MoveIO:
  """The tensors of one movement step.

  Attributes:
    operands: as the rule passed them (one tensor may appear twice).
    unique: the step's reads, each tensor once (``concatenate(x, x)`` reads
      one source in memory).
    position: tensor id -> its index in ``unique``.
    results: the step's writes.
    logical_fn: the movement on logical arrays (see :func:`move`).
  """

  operands: tuple
  unique: tuple
  position: dict
  results: tuple
  logical_fn: Callable

  @property
  def num_sources(self) -> int:
    return int(sum(t.size for t in self.unique))


def _normalise_outputs(outputs) -> list:
  return [(tuple(int(d) for d in s), np.dtype(d), _realised(i)) for s, d, i in outputs]


def _realised(spec):
  """A map as planned: a BoxMap, or the ``[size]`` source index array (built
  by the map's function when given one)."""
  if isinstance(spec, BoxMap):
    return spec
  return np.asarray(spec() if callable(spec) else spec).reshape(-1)


def _kept(spec):
  """What a step's per-tile ``fn`` keeps of a map: boxes, or the function
  that builds the index (an index array the rule passed, a host table per
  element, is kept as given: rules pass functions)."""
  return spec if isinstance(spec, BoxMap) or callable(spec) else _realised(spec)


def _identity_alias(operands, outputs):
  """The alias a lone identity movement returns, else None."""
  if not (len(operands) == 1 and len(outputs) == 1 and outputs[0][1] == operands[0].dtype):
    return None
  shape, _, spec = outputs[0]
  size = int(np.prod(shape, dtype=np.int64))
  if size == operands[0].size and (spec.is_identity(size) if isinstance(spec, BoxMap)
                                   else _is_identity(spec)):
    return alias(operands[0], shape)
  return None


def _move_io(ctx, operands, outputs, logical_fn) -> _MoveIO:
  """The step's reads and its new result tensors, with the maps checked."""
  unique, position = [], {}
  for t in operands:
    position.setdefault(t.id, len(unique))
    if position[t.id] == len(unique):
      unique.append(t)
  results = []
  for shape, dtype, spec in outputs:
    out = ctx.new_tensor(shape, dtype, _output_mapping(ctx, operands, shape, dtype))
    results.append(out)
    if isinstance(spec, BoxMap):
      spec.check(out.size, int(sum(t.size for t in operands)), ctx.op)
    elif spec.size != out.size:
      raise ValueError(f"{ctx.op}: {spec.size} source indices for {shape}")
  return _MoveIO(tuple(operands), tuple(unique), position, tuple(results), logical_fn)


def _plan_move(target, io: _MoveIO, specs, one_to_one: bool):
  """``(copy plan, per-element gathers or None, specs)`` of the movement.

  By regions when every map is a box map over distinct operands; else by
  elements, the maps expanded to source indices (into ``io.unique``).
  """
  itemsize = io.results[0].itemsize
  if len(io.unique) == len(io.operands) and all(isinstance(s, BoxMap) for s in specs):
    plan = copy_plan.plan_copies(target, [t.mapping for t in io.unique],
                                 [(out.mapping, s) for out, s in zip(io.results, specs)],
                                 itemsize)
    if plan is not None:
      return plan, None, specs
  index_type = copy_plan.index_dtype(io.num_sources + 1)
  specs = [s.index(out.size, -1, index_type) if isinstance(s, BoxMap) else s
           for out, s in zip(io.results, specs)]
  if len(io.unique) != len(io.operands):
    # Point every source at the unique operand's elements.
    starts = np.cumsum([0] + [t.size for t in io.unique])
    remap = np.concatenate([np.arange(t.size) + starts[io.position[t.id]] for t in io.operands])
    specs = [np.where(i >= 0, remap[np.maximum(i, 0)], -1) for i in specs]
    one_to_one = False
  plan, gathers = copy_elements.plan_elements(
      target, [t.mapping for t in io.unique],
      [(out.mapping, s) for out, s in zip(io.results, specs)], itemsize, one_to_one)
  return plan, gathers, specs


@dataclasses.dataclass(frozen=True, eq=False)
class _MoveGathers:
  """What a movement's per-tile exchange gathers from.

  A plan by regions gathers by the rule's boxes; a plan by elements is
  planned again when traced: keeping the rule's maps instead of the planned
  per-element gathers costs the step no host memory per element.
  """

  target: object
  specs: tuple
  one_to_one: bool
  by_regions: bool

  def gathers(self, io: _MoveIO) -> list:
    """Per output, a BoxMap or the ``[size]`` source of each element."""
    specs = [_realised(spec) for spec in self.specs]
    if self.by_regions:
      return specs
    _, gathers, specs = _plan_move(self.target, io, specs, self.one_to_one)
    return specs if gathers is None else gathers


def _per_tile_move(io: _MoveIO, plan: _MoveGathers, fill_value, *storages):
  """The static exchange: every output element gathered from its source."""
  dtype = io.results[0].dtype
  flat = jnp.concatenate(
      [to_flat(s, t.mapping).astype(dtype) for s, t in zip(storages, io.unique)]
      + [jnp.full((1,), fill_value, dtype)])
  index = [_gather_index(g, out.size, io.num_sources)
           for g, out in zip(plan.gathers(io), io.results)]
  return tuple(jnp.zeros(out.storage_shape, out.dtype) if out.size == 0
               else to_storage(flat[g], out.mapping)
               for out, g in zip(io.results, index))


def _as_tuple(value) -> tuple:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _logical_move(io: _MoveIO, *arrays):
  """The step's logical form (arrays of the reads, one per unique operand)."""
  value = _as_tuple(io.logical_fn(*[arrays[io.position[t.id]].reshape(t.shape)
                                    for t in io.operands]))
  return tuple(jnp.reshape(v, out.shape) for v, out in zip(value, io.results))


def move(ctx, operands: Sequence[P.Tensor], outputs: Sequence, logical_fn: Callable,
         fill=None, name: str = "", one_to_one: bool = False) -> list:
  """Lower a static data movement into one superstep; returns the outputs.

  Args:
    ctx: the lowering context.
    operands: tensors whose flattened elements, concatenated, are the
      sources the maps refer to.
    outputs: ``[(shape, dtype, map)]``: ``map`` is a
      :class:`~ipu_jax.lowering.copy_plan.BoxMap` (planned by regions
      when its rows are long) or the ``[size]`` source index of each output
      element, ``-1`` for ``fill`` (or a function that returns it: the step
      then keeps the function, not a table per element).
    logical_fn: ``logical_fn(*logical_operands) -> result or tuple``, the
      same movement on logical arrays (the step's ``logical`` form).
    fill: the constant that unmapped (``-1``) elements take.
    name: step name (default: the primitive).
    one_to_one: no operand element is copied twice (see
      :func:`~ipu_jax.lowering.copy_elements.exchange_plan`).

  A lone output whose map is the identity on a lone operand is returned as
  an :func:`alias` (no step).
  """
  target = ctx.target
  kept = [_kept(spec) for _, _, spec in outputs]
  outputs = _normalise_outputs(outputs)
  same = _identity_alias(operands, outputs)
  if same is not None:
    return [same]
  io = _move_io(ctx, operands, outputs, logical_fn)
  if all(out.size == 0 for out in io.results):
    return list(io.results)  # all outputs empty: nothing to run
  plan, gathers, _ = _plan_move(target, io, [spec for _, _, spec in outputs], one_to_one)
  itemsize = io.results[0].itemsize
  copies, fills = plan.copies, plan.fills
  compute = (estimators.copy_cycles(target, copies, itemsize)
             + estimators.fill_cycles(target, fills, itemsize))
  codelets = tuple(c for c, n in ((vocab.COPY, copies.sum()), (vocab.FILL, fills.sum())) if n)
  fill_value = np.asarray(0 if fill is None else fill).astype(io.results[0].dtype)
  # Neither form holds per-element tables: the per-tile exchange keeps the
  # rule's maps (boxes, for region plans) and finds its gathers when traced;
  # the logical form is ``logical_fn``.
  gathers_from = _MoveGathers(target, tuple(kept), one_to_one, by_regions=gathers is None)
  fn = functools.partial(_per_tile_move, io, gathers_from, fill_value)
  ctx.emit(P.Superstep(
      name=name or ctx.op, op=ctx.op, reads=io.unique, writes=io.results, fn=fn,
      compute_cycles=compute if compute.any() else None, exchange=plan.exchange,
      vertices=worker_vertices(ctx, copies + fills), codelets=codelets,
      logical=functools.partial(_logical_move, io)))
  return list(io.results)


def _gather_index(spec, size: int, num_sources: int) -> np.ndarray:
  """Source of every output element, ``num_sources`` (the fill slot) for fill."""
  if isinstance(spec, BoxMap):
    return spec.index(size, num_sources, copy_plan.index_dtype(num_sources + 1))
  return spec


def bind_params(primitive, params):
  """A function binding ``primitive`` with ``params`` (a movement's logical form)."""
  def fn(*args):
    return primitive.bind(*args, **params)
  return fn


def broadcast_in_dim(ctx, x: P.Tensor, shape, broadcast_dimensions,
                     params=None) -> P.Tensor:
  """``x`` broadcast to ``shape`` as ``lax.broadcast_in_dim`` does.

  For other rules too (an elementwise operand with size-1 axes, say): returns
  an alias when only size-1 axes are added, a fill when ``x`` is a constant
  with a single value, otherwise one multicast superstep.

  Args:
    ctx: the lowering context.
    x: the operand (its tile-memory shape).
    shape: the result's shape.
    broadcast_dimensions: the result axis of each axis of ``x``.
    params: extra primitive params (``sharding``) for the logical function.
  """
  shape = tuple(int(d) for d in shape)
  broadcast_dimensions = tuple(int(d) for d in broadcast_dimensions)
  dtype = x.dtype
  size = int(np.prod(shape, dtype=np.int64))
  if size == x.size and list(broadcast_dimensions) == sorted(broadcast_dimensions):
    return alias(x, shape)  # only size-1 axes added: the same flat order
  full = dict(params or {}, shape=shape, broadcast_dimensions=broadcast_dimensions)
  full.setdefault("sharding", None)
  value = uniform_value(x)
  if value is not None:
    # A constant everywhere (jnp.zeros, jnp.full): fill vertices, no exchange.
    return move(ctx, [], [(shape, dtype, BoxMap())],
                lambda: jnp.full(shape, value, dtype), fill=value, name="fill")[0]
  box = _broadcast_box(x.shape, shape, broadcast_dimensions)
  return move(ctx, [x], [(shape, dtype, BoxMap((box,)))],
              bind_params(lax.broadcast_in_dim_p, full), name="broadcast_in_dim")[0]


def _broadcast_box(x_shape, shape, broadcast_dimensions) -> Box:
  """The box of ``lax.broadcast_in_dim``: a broadcast axis (new, or size 1 in
  ``x``) reads the same source, stride 0."""
  src_strides = [0] * len(shape)
  for axis, (out_axis, stride) in enumerate(zip(broadcast_dimensions,
                                                row_major_strides(x_shape))):
    if x_shape[axis] == shape[out_axis]:
      src_strides[out_axis] = stride
  return Box.make(shape, 0, row_major_strides(shape), 0, src_strides)


def broadcast_read_exchange(target, x: P.Tensor, shape, mapping: TileMapping):
  """The exchange a step on ``mapping`` pays to read ``x`` broadcast to ``shape``.

  popops' elementwise vertices read a broadcast operand in place
  (``BroadcastScalar*``, ``BroadcastVector*``, a map expression's operand):
  each tile receives only the elements of ``x`` its part of the result reads,
  once each, as the broadcast's own copy plan counts them; nothing of the
  result's size is made. ``x`` has the rank of ``shape`` (size-1 axes
  broadcast). Returns the :class:`~ipu_jax.lowering.exchange.ExchangeCost`,
  or None when nothing moves.
  """
  shape = tuple(int(d) for d in shape)
  spec = BoxMap((_broadcast_box(tuple(x.shape), shape, tuple(range(len(shape)))),))
  plan = copy_plan.plan_copies(target, [x.mapping], [(mapping, spec)], x.itemsize)
  if plan is None:
    size = int(np.prod(shape, dtype=np.int64))
    index = spec.index(size, -1, copy_plan.index_dtype(x.size + 1))
    plan, _ = copy_elements.plan_elements(target, [x.mapping], [(mapping, index)],
                                          x.itemsize, False)
  exchange = plan.exchange
  return exchange if exchange is not None and exchange.total_bytes else None


def broadcast_view(x: P.Tensor, shape, broadcast_dimensions) -> P.Tensor:
  """``lax.broadcast_in_dim(x, shape, broadcast_dimensions)`` as a view: ``x``
  seen with the result's rank, size 1 on every broadcast axis.

  For readers that read such an operand broadcast in place (an elementwise
  step: popops' vertices read a broadcast view, ``Tensor::broadcast`` in
  Poplar is a view, not a copy): no step, no full-size tensor; ``x``'s own
  storage, as :func:`alias`. ``broadcast_dimensions`` increase (as
  ``lax.broadcast_in_dim`` requires), so the flat order is ``x``'s.
  """
  view = [1] * len(shape)
  for axis, out_axis in enumerate(broadcast_dimensions):
    view[int(out_axis)] = int(x.shape[axis])
  return alias(x, view)


def broadcast_to(ctx, x: P.Tensor, shape) -> P.Tensor:
  """``x`` broadcast to ``shape`` by NumPy's rules (see :func:`broadcast_in_dim`)."""
  shape = tuple(int(d) for d in shape)
  lead = len(shape) - len(x.shape)
  if lead < 0 or any(d != 1 and d != s for d, s in zip(x.shape, shape[lead:])):
    raise ValueError(f"cannot broadcast {x.shape} to {shape}")
  return broadcast_in_dim(ctx, x, shape, tuple(range(lead, len(shape))))
