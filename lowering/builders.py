"""Step builders shared by the lowering rules.

Rules describe *what* an operation does; these helpers plan where its results
live, emit the supersteps that move data and compute, and account for their
cost. The common shapes of work:

* :func:`assign` / :func:`relayout`: an exchange-only step that copies a
  tensor into another mapping.
* :func:`elementwise`: a compute set of elementwise vertices over the output's
  tiles, operands exchanged onto the output's mapping first.
* Pure data movement (transpose, slice, broadcast...) is
  ``lowering/movement.py``'s :func:`~ipu_jax.lowering.movement.move` (every
  output element's source is known statically, so the exchange is exact).
* :func:`partitioned`: an operation whose output is cut along one axis into
  per-tile pieces, each computed on its tile from the inputs it needs.

Each builder is a short driver: a plan (:class:`_ElementwiseOperands`,
:class:`_Partition`), module-level helpers for the storage and the cost, and
a step function bound to the plan with ``functools.partial``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators, popops
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import (ExchangeCost, movement_cost, relayout,
                                       relayout_cost, roll_tiles, to_flat, to_storage)
from ipu_jax.lowering.mapping import TileMapping, blocks_on_tiles
from ipu_jax.lowering.movement import broadcast_read_exchange
from ipu_jax.lowering.program import worker_vertices

__all__ = ["assign", "relayout_to", "elementwise", "elementwise_figures", "partitioned",
           "logical", "storage", "broadcast_cost", "add_costs",
           "worker_vertices"]


def logical(storage_array, tensor: P.Tensor):
  """Tile storage -> logical array of ``tensor``'s shape."""
  return to_flat(storage_array, tensor.mapping).reshape(tensor.shape)


def storage(value, tensor: P.Tensor):
  """Logical array -> tile storage in ``tensor``'s mapping."""
  return to_storage(jnp.reshape(value, (-1,)).astype(tensor.dtype), tensor.mapping)


def add_costs(*costs) -> Optional[ExchangeCost]:
  costs = [c for c in costs if c is not None]
  if not costs:
    return None
  total = costs[0]
  for c in costs[1:]:
    total = total + c
  return total


def assign(ctx, dst: P.Tensor, src: P.Tensor, name: str = "copy") -> None:
  """Emit a step copying ``src`` into ``dst`` (same shape, any mappings)."""
  if src.size != dst.size:
    raise ValueError(f"assign: {src.shape} into {dst.shape}")

  def fn(x):
    return (relayout(x, src.mapping, dst.mapping).astype(dst.dtype),)

  def logical(x):
    # A copy moves elements between tiles; its values are the source's.
    return (jnp.reshape(x, dst.shape).astype(dst.dtype),)

  ctx.emit(P.Superstep(name=name, op=ctx.op or "copy", reads=(src,), writes=(dst,), fn=fn,
                       logical=logical,
                       exchange=relayout_cost(ctx.target, src.mapping, dst.mapping, src.itemsize)))


def relayout_to(ctx, tensor: P.Tensor, mapping: TileMapping, name: str = "relayout") -> P.Tensor:
  """``tensor`` in ``mapping``: itself if already there, else a copy."""
  if tensor.mapping.same_as(mapping):
    return tensor
  out = ctx.new_tensor(tensor.shape, tensor.dtype, mapping, name=name)
  assign(ctx, out, tensor, name)
  return out


def broadcast_cost(ctx, tensor: P.Tensor, dst_tiles: np.ndarray) -> Optional[ExchangeCost]:
  """Every tile in ``dst_tiles`` receives the whole of ``tensor`` (multicast)."""
  target = ctx.target
  # The receiving tiles as a mask (tile ids are small: no sort to find them once each).
  receivers = np.zeros(target.num_tiles, bool)
  receivers[np.asarray(dst_tiles, np.int64)] = True
  dst_tiles = np.flatnonzero(receivers)
  if tensor.size == 0 or dst_tiles.size == 0:
    return None
  on_tile = tensor.mapping.bytes_per_tile(target.num_tiles, tensor.itemsize)
  bytes_in = np.zeros(target.num_tiles, np.int64)
  bytes_in[dst_tiles] = tensor.nbytes - on_tile[dst_tiles]
  # A source tile sends its part once if anyone but itself needs it.
  others = dst_tiles.size - receivers
  bytes_out = np.where(others > 0, on_tile, 0)
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    # Each IPU's part crosses once to every other IPU holding a receiver.
    receiving = np.zeros(target.num_ipus, bool)
    receiving[dst_tiles // target.tiles_per_ipu] = True
    on_ipu = on_tile.astype(np.int64).reshape(target.num_ipus, target.tiles_per_ipu).sum(axis=1)
    link = on_ipu * (int(receiving.sum()) - receiving)
  return ExchangeCost(bytes_in, bytes_out.astype(np.int64), link)


_ELEMENTWISE_FIGURES = plan_cache.PlanCache("elementwise figures", max_entries=4096)


def elementwise_figures(target, mapping: TileMapping, op: str, dtype, in_dtype) -> tuple:
  """``(compute_cycles, vertices)`` per tile of an elementwise step on ``mapping``.

  They depend only on the elements each tile holds, tile by tile, so one
  layout moved along the tiles (a small tensor placed where the last one
  ended, the same layer on another IPU) has them moved by as many tiles:
  they are computed once per layout counted from its first tile, kept
  narrowed and read-only, and rolled into place (on several IPUs,
  recomputing ``[num_tiles]`` figures for every equation was a large part
  of lowering).
  """
  dtype = np.dtype(dtype)
  # Types as dtype objects, not ``.str``: bfloat16 and the FP8 types share ``<V2``/``<V1``.
  in_key = None if in_dtype is None else np.dtype(in_dtype)
  # A chain of elementwise steps works on one layout: its placed figures are
  # looked up (shared read-only arrays), not rolled into place for each step.
  placed = mapping.fingerprint
  key = None if placed[0] == "object" else (placed, op, dtype, in_key, target)
  return plan_cache.cached(
      _PLACED_FIGURES, key,
      lambda: _placed_elementwise_figures(target, mapping, op, dtype, in_dtype, in_key))


_PLACED_FIGURES = plan_cache.PlanCache("placed elementwise figures", max_entries=4096)


def _placed_elementwise_figures(target, mapping, op, dtype, in_dtype, in_key) -> tuple:
  """:func:`elementwise_figures` from the figures cached counted from the layout's first tile."""
  t = target.num_tiles
  base = int(mapping.tiles[0]) if mapping.num_rows else 0

  def compute():
    elements = roll_tiles(mapping.elements_per_tile(t), -base)
    cycles = estimators.elementwise_cycles(target, elements, op, dtype.itemsize, dtype=dtype,
                                           in_dtype=in_dtype)
    vertices = np.minimum(elements, target.worker_contexts)
    return tuple(_frozen(P.narrowed(a)) for a in (cycles, vertices))

  key = (mapping.relative_fingerprint(base, t), op, dtype, in_key, target)
  cycles, vertices = plan_cache.cached(_ELEMENTWISE_FIGURES, key, compute)
  if base == 0:
    return cycles, vertices
  return tuple(_frozen(roll_tiles(a, base)) for a in (cycles, vertices))


def _frozen(a: np.ndarray) -> np.ndarray:
  a.setflags(write=False)
  return a


def _output_mapping(ctx, operands, shape, dtype) -> TileMapping:
  size = math.prod(int(d) for d in shape)
  # Follow the operand with the result's shape (popops maps results like
  # their first full-size operand), preferring non-constants.
  candidates = [t for t in operands if t.size == size and tuple(t.shape) == tuple(shape)]
  candidates.sort(key=lambda t: t.category == "constants")
  if candidates and size > 0:
    mapping = candidates[0].mapping
    if mapping.is_linear or np.dtype(dtype).itemsize == candidates[0].itemsize:
      return mapping
  return ctx.linear_mapping(shape, dtype)


def _check_broadcastable(ctx, t: P.Tensor, shape) -> None:
  """An operand with size-1 axes (``f32[1,128]`` with ``f32[4,128]``) is read
  broadcast; any other shape is an error."""
  if tuple(t.shape) == tuple(shape) or t.size == 1:
    return
  if len(t.shape) != len(shape) or any(a not in (1, b) for a, b in zip(t.shape, shape)):
    raise ValueError(f"elementwise {ctx.op}: operand {t.shape} does not broadcast to {shape}")


@dataclasses.dataclass(frozen=True)
class _ElementwiseOperands:
  """How each operand of an elementwise step reaches the output's tiles.

  Attributes:
    reads: the tensors the step reads, in order (literals are not read).
    kinds: per operand, ``("same", mapping)`` (a full-size operand, moved
      onto the output's mapping), ``("broadcast", (mapping, shape))`` (an
      operand with size-1 axes, read broadcast: each tile receives the
      elements it reads, nothing of the result's size is made),
      ``("scalar", mapping)`` (one element, multicast to every tile) or
      ``("literal", value)`` (a constant scalar folded into the step).
    costs: the exchange of each read operand (None where nothing moves).
  """

  reads: tuple
  kinds: tuple
  costs: tuple


def _elementwise_operands(ctx, operands, shape, size, mapping) -> _ElementwiseOperands:
  """Classify the operands of a result of ``shape`` on ``mapping`` and cost their exchange."""
  target = ctx.target
  all_tiles = mapping.tiles
  reads, kinds, costs = [], [], []
  for t in operands:
    if t.size == size and tuple(t.shape) == shape and size != 1:
      reads.append(t)
      kinds.append(("same", t.mapping))
      costs.append(relayout_cost(target, t.mapping, mapping, t.itemsize))
    elif t.size != 1:
      reads.append(t)
      kinds.append(("broadcast", (t.mapping, tuple(t.shape))))
      costs.append(broadcast_read_exchange(target, t, shape, mapping))
    elif t.size == 1:
      if t.category == "constants" and t.value is not None:
        kinds.append(("literal", np.asarray(t.value).reshape(())))
      else:
        reads.append(t)
        kinds.append(("scalar", t.mapping))
        costs.append(broadcast_cost(ctx, t, all_tiles))
  return _ElementwiseOperands(tuple(reads), tuple(kinds), tuple(costs))


_COMMUTATIVE = frozenset({"add", "mul", "max", "min"})


def _scalar_region_size(small_shape, shape) -> int:
  """Elements of the result that read one element of a broadcast operand
  laid out as one scalar per region (``[a, b, 1]`` read as ``[a, b, c]``: ``c``),
  or 0 when a broadcast axis comes before a kept one (a vector repeated)."""
  kept = [i for i, (a, b) in enumerate(zip(small_shape, shape)) if a == b and b > 1]
  k = kept[-1] + 1 if kept else 0
  if any(a != b for a, b in zip(small_shape[:k], shape[:k])):
    return 0
  return math.prod(int(d) for d in shape[k:])


def _broadcast_scalar_compute(target, mapping, op, dtype, kinds, shape, compute):
  """The compute of a binary step reading one operand as a scalar per region.

  popops runs ``A op broadcast(B)`` with ``B`` constant along each contiguous
  region of a tile (LayerNorm's per-row mean and inverse deviation) with its
  ``BroadcastScalar1D`` / ``BroadcastScalar2D`` vertices
  (``lib/popops/ElementWise.cpp`` tries them before any other plan), priced by
  :func:`~ipu_jax.kernels.popops.broadcast_scalar_cycles` over the regions
  of the result's tile runs cut at every change of scalar. Other broadcasts
  (a vector repeated along the outer axes) keep ``compute``: the binary
  vertex reading the operand in place.
  """
  names = [kind for kind, _ in kinds]
  if len(kinds) != 2 or names.count("broadcast") != 1 or names.count("same") != 1:
    return compute
  if names[0] == "broadcast" and op not in _COMMUTATIVE:
    return compute
  block = _scalar_region_size(kinds[names.index("broadcast")][1][1], shape)
  if block <= 1:
    return compute
  cycles = _broadcast_scalar_figures(target, mapping, block, op, np.dtype(dtype))
  return compute if cycles is None else cycles


_BROADCAST_SCALAR_FIGURES = plan_cache.PlanCache("broadcast scalar figures", max_entries=1024)


def _broadcast_scalar_figures(target, mapping, block: int, op: str, dtype):
  """The BroadcastScalar cycles per tile, narrowed and read-only, once per layout.

  A repeated layer's layer norms read their statistics on the same layouts:
  the figures depend only on the layout, the region size, the op and type.
  """
  t = target.num_tiles
  base = int(mapping.tiles[0]) if mapping.num_rows else 0

  def compute():
    tiles, sizes, counts = _scalar_regions(mapping, block)
    cycles = popops.broadcast_scalar_cycles(target, (tiles - base) % t, sizes, counts, op,
                                            dtype)
    return None if cycles is None else _frozen(P.narrowed(cycles))

  # Counted from the layout's first tile, as elementwise_figures: the same
  # layer's layout moved along the tiles shares them.
  placed = mapping.fingerprint
  key = (None if placed[0] == "object"
         else (mapping.relative_fingerprint(base, t), block, op, dtype, target))
  cycles = plan_cache.cached(_BROADCAST_SCALAR_FIGURES, key, compute)
  if cycles is None or base == 0:
    return cycles
  return _frozen(roll_tiles(cycles, base))


def _scalar_regions(mapping, block: int) -> tuple:
  """``(tiles, sizes, counts)``: the result's tile runs cut where the scalar
  changes (every ``block`` elements), as regions of equal size grouped per
  run (its first piece, its whole blocks, its last piece): O(runs)."""
  starts, lengths, rows, _ = mapping.runs
  starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
  tiles = np.asarray(mapping.tiles, np.int64)[np.asarray(rows, np.int64)]
  ends = starts + lengths
  first_end = np.minimum(ends, (starts // block + 1) * block)
  last_start = np.maximum(first_end, (ends - 1) // block * block)
  whole = (last_start - first_end) // block
  first, last = first_end - starts, ends - last_start
  return (np.concatenate([tiles, tiles, tiles]),
          np.concatenate([first, np.full_like(first, block), last]),
          np.concatenate([(first > 0).astype(np.int64), whole, (last > 0).astype(np.int64)]))


def _elementwise_storages(fn, kinds, mapping, shape, *storages):
  """An elementwise step's function: ``fn`` on whole tile storages."""
  it = iter(storages)
  args = []
  for kind, info in kinds:
    if kind == "literal":
      args.append(jnp.asarray(info))
    elif kind == "scalar":
      args.append(next(it).reshape(-1)[0])
    elif kind == "broadcast":
      # The executor may make the broadcast values; the cost model does not.
      small_mapping, small_shape = info
      value = to_flat(next(it), small_mapping).reshape(small_shape)
      args.append(to_storage(jnp.broadcast_to(value, shape).reshape(-1), mapping))
    else:
      args.append(relayout(next(it), info, mapping))
  result = fn(*args)
  if not isinstance(result, (tuple, list)):
    result = (result,)
  rows_shape = mapping.storage_shape
  return tuple(jnp.broadcast_to(r, rows_shape) for r in result)


def _elementwise_logical(fn, kinds, shape, *arrays):
  """An elementwise step's logical form: the same arithmetic on the logical arrays."""
  it = iter(arrays)
  args = [jnp.asarray(info) if kind == "literal"
          else next(it).reshape(-1)[0] if kind == "scalar"
          else jnp.broadcast_to(next(it).reshape(info[1]), shape) if kind == "broadcast"
          else next(it)
          for kind, info in kinds]
  result = fn(*args)
  if not isinstance(result, (tuple, list)):
    result = (result,)
  return tuple(jnp.broadcast_to(r, shape) for r in result)


def _in_place_output(ctx, operands, out_avals, mapping):
  """``[operand]`` when the one result can be written over a donated, dying argument.

  Poplar updates a variable in place (``popops::addInPlace`` and the other
  ``*InPlace`` map functions write the result into their first operand), and
  XLA reuses a donated argument's buffer for a result: a donated argument
  that nothing reads afterwards -- a pipeline stage's gradient accumulator
  ``acc + g`` -- holds its new value in its own memory instead of beside a
  second copy. Only an operand laid out like the result, with its dtype and
  shape, qualifies (an in-place map op keeps its operand's layout). None
  otherwise (docs/cost_model.md#the-memory-model).
  """
  if len(out_avals) != 1:
    return None
  shape, dtype = tuple(out_avals[0][0]), np.dtype(out_avals[0][1])
  for t in operands:
    if (t.mapping is mapping and t.dtype == dtype and tuple(t.shape) == shape
        and ctx.donated_and_dying(t)):
      return [t]
  return None


def elementwise(ctx, fn: Callable, operands: Sequence[P.Tensor], out_avals=None,
                name: str = "", cost_op: str = "", flops_per_element: int = 1) -> list:
  """Lower an elementwise operation; returns the output tensors.

  Args:
    ctx: the lowering context.
    fn: ``fn(*operand_arrays) -> array or tuple``; applied to whole tile
      storages (elementwise, so the tile axis is just another axis), and, as
      the step's logical form (``Superstep.logical``), to the logical arrays.
    operands: tensors of the result's shape, or scalars (broadcast).
    out_avals: ``[(shape, dtype)]`` of the results (default: ``ctx.out_avals``).
    name: step name; cost_op: estimator key (default: the primitive).
    flops_per_element: for the report.
  """
  if out_avals is None:
    out_avals = [(a.shape, a.dtype) for a in ctx.out_avals]
  shape, dtype = tuple(out_avals[0][0]), np.dtype(out_avals[0][1])
  size = math.prod(int(d) for d in shape)
  for t in operands:
    _check_broadcastable(ctx, t, shape)
  mapping = _output_mapping(ctx, operands, shape, dtype)
  outputs = _in_place_output(ctx, operands, out_avals, mapping)
  if outputs is None:
    outputs = [ctx.new_tensor(s, d, mapping) for s, d in out_avals]
  ins = _elementwise_operands(ctx, operands, shape, size, mapping)
  step_fn = functools.partial(_elementwise_storages, fn, ins.kinds, mapping, shape)
  logical_fn = functools.partial(_elementwise_logical, fn, ins.kinds, shape)

  op = cost_op or ctx.op
  in_dtype = operands[0].dtype if operands else None
  compute, vertices = elementwise_figures(ctx.target, mapping, op, dtype, in_dtype)
  compute = _broadcast_scalar_compute(ctx.target, mapping, op, dtype, ins.kinds, shape, compute)
  flops = size * flops_per_element if np.issubdtype(dtype, np.inexact) else 0
  # The step and its ElementwiseWork hold the operands' costs narrowed, one
  # copy for both (a lone moved operand's cost is the step's exchange).
  costs = tuple(map(P.narrowed_cost, ins.costs))
  moved = [c for c in costs if c is not None]
  exchange = moved[0] if len(moved) == 1 else add_costs(*ins.costs)
  ctx.emit(P.Superstep(
      name=name or op, op=ctx.op, reads=ins.reads, writes=tuple(outputs), fn=step_fn,
      logical=logical_fn, compute_cycles=compute, exchange=exchange,
      vertices=vertices, codelets=(vocab.vertex(vocab.ELEMENTWISE, op),),
      flops=flops, elementwise=P.ElementwiseWork(mapping, costs, op, dtype.itemsize, dtype,
                                                 in_dtype),
      literals=tuple(info for kind, info in ins.kinds if kind == "literal")))
  return outputs


@dataclasses.dataclass(frozen=True)
class _Partition:
  """How :func:`partitioned` cuts the results' ``out_axis`` over tiles.

  Attributes:
    rows: the results' length along ``out_axis``.
    per_tile: rows per tile (the last tile may hold fewer).
    groups: tiles that hold rows, ``ceil(rows / per_tile)``.
    tiles: ``[groups]`` the tile of each row block.
  """

  rows: int
  per_tile: int
  groups: int
  tiles: np.ndarray

  def rows_on_tile(self, num_tiles: int) -> np.ndarray:
    """``[num_tiles]`` rows each tile holds."""
    return blocks_on_tiles(num_tiles, self.tiles, self.rows, self.per_tile)


def _partition(ctx, first_shape, out_axis: int) -> _Partition:
  """Cut ``first_shape``'s ``out_axis`` into row blocks and claim a tile for each."""
  num_tiles = ctx.target.num_tiles
  rows = first_shape[out_axis] if first_shape else 1
  # Enough rows per tile that a tile holds at least a few hundred bytes.
  row_elements = max(1, int(np.prod(first_shape, dtype=np.int64)) // max(rows, 1))
  min_rows = max(1, -(-64 // max(row_elements, 1)))
  per_tile = max(min_rows, -(-rows // num_tiles)) if rows else 1
  groups = -(-rows // per_tile) if rows else 0
  start = ctx.claim_tiles(groups)
  tiles = (start + np.arange(groups)) % num_tiles
  return _Partition(rows, per_tile, groups, tiles)


def _partitioned_outputs(ctx, part: _Partition, out_avals, out_axis: int) -> list:
  """The results, each cut along ``out_axis`` into the partition's row blocks."""
  outputs = []
  for shape, dtype in out_avals:
    size = int(np.prod(shape, dtype=np.int64))
    if size == 0 or not shape:
      mapping = ctx.linear_mapping(shape, dtype)
    else:
      group = (np.arange(shape[out_axis]) // part.per_tile)
      element_group = np.broadcast_to(
          group.reshape([-1 if a == out_axis else 1 for a in range(len(shape))]), shape)
      mapping = TileMapping.from_element_tiles(part.tiles[element_group.reshape(-1)])
    outputs.append(ctx.new_tensor(shape, dtype, mapping))
  return outputs


def _partitioned_exchange(ctx, part: _Partition, operands, split_axes) -> list:
  """Per operand: split ones go row block to tile; whole ones multicast."""
  costs = []
  for t, axis in zip(operands, split_axes):
    if t.size == 0:
      continue
    if axis is None or part.groups == 0:
      costs.append(broadcast_cost(ctx, t, part.tiles))
    else:
      group = np.arange(t.shape[axis]) // part.per_tile
      element_group = np.broadcast_to(
          group.reshape([-1 if a == axis else 1 for a in range(len(t.shape))]),
          t.shape).reshape(-1)
      dst = part.tiles[np.minimum(element_group, max(part.groups - 1, 0))]
      costs.append(movement_cost(ctx.target, t.mapping.element_tile, dst, t.itemsize))
  return costs


def _partitioned_cycles(target, part: _Partition, rows_on_tile, flops, itemsize) -> np.ndarray:
  """Compute cycles per tile: ``flops`` spread over tiles in proportion to their rows."""
  share = rows_on_tile / max(part.rows, 1)
  rate = target.fp16_flops_per_cycle if itemsize <= 2 else target.fp32_flops_per_cycle
  # Non-matmul work runs on the workers at about a vector per cycle.
  rate = min(rate, max(1, target.vector_width_bytes // itemsize) * target.worker_contexts)
  return np.where(rows_on_tile > 0,
                  np.ceil(flops * share / rate) + target.worker_contexts * estimators.WORKER_OVERHEAD
                  + target.supervisor_overhead_cycles, 0.0)


def _partitioned_run(fn, operands, outputs, split_axes, out_axis, part: _Partition, *storages):
  """A partitioned step's function: ``fn`` on each tile's rows (vmapped over the tiles)."""
  args = [logical(s, t) for s, t in zip(storages, operands)]
  if part.groups > 1:
    result = _per_tile(fn, args, split_axes, out_axis, part.per_tile, part.groups, part.rows)
  else:
    result = fn(*args)
  if not isinstance(result, (tuple, list)):
    result = (result,)
  return tuple(storage(r, o) for r, o in zip(result, outputs))


def _partitioned_logical(fn, *arrays):
  """A partitioned step's logical form: ``fn`` once on the whole arrays (the rows
  are independent, so the numbers are those of the per-tile runs)."""
  result = fn(*arrays)
  return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def partitioned(ctx, fn: Callable, operands: Sequence[P.Tensor], out_avals,
                split_axes: Sequence[Optional[int]], out_axis: int = 0,
                flops: int = 0, cycles_per_tile_fn: Optional[Callable] = None,
                name: str = "", codelet: str = "") -> list:
  """Lower an operation that splits along one axis into per-tile pieces.

  The results are cut along ``out_axis`` into one block of rows per tile.
  Operand ``i`` is cut the same way along ``split_axes[i]`` (its piece is
  exchanged to the tile), or, where ``split_axes[i]`` is ``None``, sent whole
  to every tile that works (a multicast). Each tile then runs ``fn`` on its
  pieces (the step's ``fn`` vmaps it over the tiles). Because the split is
  along independent rows, running ``fn`` once on the whole arrays gives the
  same numbers: that is the step's logical form.

  Args:
    fn: ``fn(*logical_operands) -> result or tuple`` on logical arrays.
    operands: input tensors.
    out_avals: ``[(shape, dtype)]`` of the results; all share ``out_axis``.
    split_axes: per operand, its axis that maps to ``out_axis``, or ``None``.
    out_axis: the result axis cut over tiles.
    flops: total FLOPs; spread over tiles in proportion to their rows.
    cycles_per_tile_fn: ``f(rows_per_tile [num_tiles]) -> cycles`` override.
  """
  shapes = [tuple(int(d) for d in s) for s, _ in out_avals]
  part = _partition(ctx, shapes[0], out_axis)
  outputs = _partitioned_outputs(ctx, part, out_avals, out_axis)
  costs = _partitioned_exchange(ctx, part, operands, split_axes)
  rows_on_tile = part.rows_on_tile(ctx.target.num_tiles)
  if cycles_per_tile_fn is not None:
    compute = np.asarray(cycles_per_tile_fn(rows_on_tile), np.float64)
  else:
    compute = _partitioned_cycles(ctx.target, part, rows_on_tile, flops,
                                  np.dtype(out_avals[0][1]).itemsize)
  run = functools.partial(_partitioned_run, fn, tuple(operands), tuple(outputs),
                          tuple(split_axes), out_axis, part)
  ctx.emit(P.Superstep(name=name or ctx.op, op=ctx.op, reads=tuple(operands),
                       writes=tuple(outputs), fn=run,
                       logical=functools.partial(_partitioned_logical, fn),
                       compute_cycles=compute,
                       exchange=add_costs(*costs),
                       vertices=worker_vertices(ctx, rows_on_tile),
                       codelets=(codelet or ctx.op,), flops=int(flops)))
  return outputs


def _per_tile(fn, args, split_axes, out_axis, per_tile, groups, rows):
  """Run ``fn`` on each tile's row block with vmap (rows padded to equal)."""
  padded_rows = per_tile * groups
  blocked = []
  in_axes = []
  for x, axis in zip(args, split_axes):
    if axis is None:
      blocked.append(x)
      in_axes.append(None)
      continue
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padded_rows - x.shape[axis])
    x = jnp.pad(x, pad)
    x = jnp.moveaxis(x, axis, 0).reshape((groups, per_tile) + tuple(np.delete(x.shape, axis)))
    blocked.append(jnp.moveaxis(x, 1, axis + 1))
    in_axes.append(0)
  results = jax.vmap(fn, in_axes=tuple(in_axes))(*blocked)
  single = not isinstance(results, (tuple, list))
  results = (results,) if single else results
  out = []
  for r in results:
    r = jnp.moveaxis(r, out_axis + 1, 1)
    r = r.reshape((groups * per_tile,) + r.shape[2:])[:rows]
    out.append(jnp.moveaxis(r, 0, out_axis))
  return out
