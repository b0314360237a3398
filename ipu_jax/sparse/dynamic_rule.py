"""The tile rule of ``ipu_dynamic_sparse_matmul`` (``popsparse::dynamic``).

Tile plan (:func:`ipu_jax.lowering.sparse_plan.plan_dynamic`; the grid and
buckets are the layout's, fixed before any pattern is known):

1. **Placement.** Bucket ``g`` (values and 16-bit meta-information) lives on
   grid tile ``g = (x * py + y) * pz + z`` (a copy step when the buckets
   arrive elsewhere). Each tile also has a second bucket buffer to receive
   into.
2. **Propagation, phase 1** (``pz`` supersteps). At step ``s`` tile
   ``(x, y, z)`` holds the bucket that started on ``(x, y, (z + s) % pz)``:
   every step after the first moves every bucket one tile along Z (each
   tile receives and sends one bucket). The tile scans the bucket's entries
   and multiplies those of its own cell into its partials (its block rows
   of X band ``x``, the dense rows of Y band ``y`` and the columns of its Z
   range, received in the first step). After ``pz`` steps it has met all of
   its cell's non-zeros that were not spilled.
3. **Further phases, at run time** (when the grid has more than one cell):
   a step reads the buckets' meta-information for the farthest distance a
   spilled non-zero moved along the ring of cells (``x * py + y``; the host
   encoding puts overflow in the first free room forward along it), as
   PopSparse's propagation reads the overflow information its partitioner
   wrote; then a ``RepeatWhileTrue`` loop runs one phase per cell of that
   distance: in phase ``k`` tile ``(x, y, z)`` meets the buckets that started
   in cell ``(x * py + y + k) % (px * py)``, moved one cell on and rotated
   along Z in ``pz`` supersteps, and multiplies the entries of its own cell
   among them. A uniform pattern spills nothing and the loop runs no phase;
   a pattern clustered in one cell runs as many phases as its spills need
   (at most ``px * py - 1``).
4. **Reduction**: the ``py`` partials of each ``(x, z)`` region are
   reduce-scattered as for static sparsity (``static_rule.emit_reduction``).

Costs are the plan's figures for a uniform pattern of ``max_non_zeros``
blocks: each step a bucket exchange, the scan of a bucket and the products
of the cell's share (:mod:`ipu_jax.kernels.popsparse`); the loop's body is
costed once, as a phase that scans and skips (its products are what phase 1
did not do); the program is the same for every pattern.

Executor forms: ``per_tile`` runs the propagation step by step (each tile's
held bucket gathered, entries of other cells masked); the logical form sums
every bucket entry into its band at the first step and passes the partials
through the rest. Both give the same partials after the last step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import popsparse
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, relayout_to, storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.errors import LoweringError
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_grid import block_grid_mapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.sparse import products
from ipu_jax.sparse.buckets import DynamicLayout
from ipu_jax.sparse.dynamic import bucket_partials, dynamic_sparse_matmul_p
from ipu_jax.sparse.static_rule import SparseGrid, dense_exchange, emit_reduction, sparse_grid

__all__ = []


@dataclasses.dataclass(frozen=True)
class _Propagation:
  layout: DynamicLayout
  grid: SparseGrid
  values: P.Tensor
  meta: P.Tensor
  dense: P.Tensor
  partials: P.Tensor
  counter: P.Tensor = None


def _positions(grid: SparseGrid) -> tuple:
  """``(x, y, z, cell)`` of every grid position, in grid order."""
  px, py, pz = grid.shape
  g = np.arange(px * py * pz)
  x, y, z = g // (py * pz), (g // pz) % py, g % pz
  return x, y, z, x * py + y


def held_buckets(grid: SparseGrid, phase, step: int):
  """``[G]`` the bucket each grid position holds at ``(phase, step)`` (``phase`` may
  be a traced scalar: the run-time loop's)."""
  px, py, pz = grid.shape
  _, _, z, cell = _positions(grid)
  return ((cell + phase) % (px * py)) * pz + (z + step) % pz


def _step_partials(p: _Propagation, held, values, meta, dense):
  """``[py, M, N]`` what every tile adds at one step (its cell's entries of its held bucket)."""
  layout, grid = p.layout, p.grid
  acc = products.accumulator(values.dtype)
  px, py, pz = grid.shape
  rx, cy, fz = grid.plan.band
  b = layout.block
  x, _, z, cell = _positions(grid)
  held_v, held_m = values[held].astype(acc), meta[held].astype(jnp.int32)
  rows, cols = held_m[..., 0], held_m[..., 1]
  mine = (rows >= 0) & ((rows // rx) * py + cols // cy == cell[:, None])
  k, n = dense.shape
  dense_p = jnp.pad(dense.astype(acc), ((0, 0), (0, pz * fz - n))).reshape(k // b, b, pz, fz)
  chosen = dense_p[jnp.where(mine, cols, 0), :, z[:, None], :]          # [G, cap, b, fz]
  contrib = jnp.einsum("gcab,gcbf->gcaf", held_v, chosen, preferred_element_type=acc)
  local = jnp.where(mine, rows - x[:, None] * rx, rx)
  part = jax.vmap(lambda c, r: jax.ops.segment_sum(c, r, num_segments=rx + 1))(contrib, local)
  part = part[:, :rx].reshape(px, py, pz, rx, b, fz).transpose(1, 0, 3, 4, 2, 5)
  part = part.reshape(py, px * rx * b, pz * fz)
  return part[:, :layout.shape[0], :n]


def _step_fn(p: _Propagation, step, first, values_st, meta_st, dense_st, *partials_st):
  """Phase 1's steps: the held buckets are known when lowering."""
  values, meta = logical(values_st, p.values), logical(meta_st, p.meta)
  added = _step_partials(p, held_buckets(p.grid, 0, step), values, meta,
                         logical(dense_st, p.dense))
  total = added if first else logical(partials_st[0], p.partials) + added
  return (storage(total, p.partials),)


def _step_logical(p: _Propagation, first, values, meta, dense, *partials):
  if first:
    return (bucket_partials(values, meta, dense, p.layout, p.grid.shape[1]),)
  return (partials[0],)


def _loop_step_fn(p: _Propagation, step, last, values_st, meta_st, dense_st, partials_st,
                  counter_st):
  """A run-time phase's step: phase ``counter + 1`` (the loop's counter)."""
  counter = logical(counter_st, p.counter)
  held = held_buckets(p.grid, counter + 1, step)
  added = _step_partials(p, held, logical(values_st, p.values), logical(meta_st, p.meta),
                         logical(dense_st, p.dense))
  out = (storage(logical(partials_st, p.partials) + added, p.partials),)
  return out + ((storage(counter + 1, p.counter),) if last else ())


def _loop_step_logical(last, values, meta, dense, partials, counter):
  del values, meta, dense   # the first step summed every entry
  return (partials,) + ((counter + 1,) if last else ())


def spill_distance(layout: DynamicLayout, meta):
  """The farthest any entry of ``meta`` sits from its cell along the ring (int32)."""
  px, py, pz = layout.grid
  rx, cy, _ = layout.plan.band
  rows, cols = meta[..., 0].astype(jnp.int32), meta[..., 1].astype(jnp.int32)
  home = (jnp.arange(meta.shape[0], dtype=jnp.int32) // pz)[:, None]
  distance = ((rows // rx) * py + cols // cy - home) % (px * py)
  return jnp.max(jnp.where(rows >= 0, distance, 0)).astype(jnp.int32)


def _bucket_exchange(ctx, grid: SparseGrid, nbytes: int) -> ExchangeCost:
  """Every grid tile sends its bucket on and receives the next one."""
  cost = ExchangeCost.zeros(ctx.target)
  tiles = grid.tiles.reshape(-1)
  cost.bytes_in[tiles] = nbytes
  cost.bytes_out[tiles] = nbytes
  return cost


def _step_cycles(ctx, p: _Propagation, phase: int, first: bool) -> np.ndarray:
  """Per tile: the bucket scan and the products of its cell's expected share."""
  grid, layout = p.grid, p.layout
  px, py, pz = grid.shape
  rx, cy, _ = grid.plan.band
  b, itemsize = layout.block, p.values.itemsize
  cells = max((layout.shape[0] // b) * (layout.shape[1] // b), 1)
  share = min(-(-layout.max_non_zeros * rx * cy // (cells * pz)), layout.bucket_blocks)
  z = np.tile(grid.z_cols, px * py)
  if phase == 0:
    work = (popsparse.sparse_product_cycles(ctx.target, share, min(rx, share), z, b, itemsize)
            + popsparse.bucket_scan_cycles(1, 1, b))
  else:   # a uniform pattern spills nothing: the spill phase scans and skips
    work = np.broadcast_to(popsparse.bucket_scan_cycles(1, 0, b), z.shape)
  if first:
    partial = np.repeat(grid.x_rows, py * pz) * z
    work = work + popsparse.zero_partials_cycles(ctx.target, partial, p.partials.itemsize)
  out = np.zeros(ctx.target.num_tiles)
  out[grid.tiles.reshape(-1)] = work
  return out


def _on_grid(ctx, grid: SparseGrid) -> np.ndarray:
  on_grid = np.zeros(ctx.target.num_tiles, np.int64)
  on_grid[grid.tiles.reshape(-1)] = 1
  return on_grid


def _propagation_step(ctx, p: _Propagation, label: str, bucket_bytes: int, exchange, **fields):
  """A propagation superstep: every grid tile's vertex on the bucket it holds."""
  on_grid = _on_grid(ctx, p.grid)
  kind = (vocab.SPARSE_DENSE_ELEMENTWISE if p.layout.block == 1
          else vocab.SPARSE_DENSE_BLOCK)
  return P.Superstep(
      name=label, op=ctx.op, exchange=exchange,
      vertices=worker_vertices(ctx, on_grid * ctx.target.worker_contexts),
      codelets=(vocab.vertex(kind, p.values.dtype, p.partials.dtype),),
      scratch_bytes=on_grid * bucket_bytes, **fields)


def _emit_step(ctx, p: _Propagation, step: int, bucket_bytes: int, name: str):
  """Step ``step`` of phase 1 (the buckets' own cells)."""
  first = step == 0
  grid = p.grid
  exchange = (dense_exchange(ctx, grid, p.dense, "lhs") if first
              else _bucket_exchange(ctx, grid, bucket_bytes))
  ctx.emit(_propagation_step(
      ctx, p, f"{name}/propagate phase 1 step {step + 1}", bucket_bytes, exchange,
      reads=(p.values, p.meta, p.dense) + (() if first else (p.partials,)),
      writes=(p.partials,), fn=functools.partial(_step_fn, p, step, first),
      logical=functools.partial(_step_logical, p, first),
      compute_cycles=_step_cycles(ctx, p, 0, first),
      notes=(grid.plan.describe(),) if first else ()))


def _scalar_tiles(ctx, tensor: P.Tensor) -> np.ndarray:
  return tensor.mapping.elements_per_tile(ctx.target.num_tiles)


def _emit_distance(ctx, p: _Propagation, need: P.Tensor, name: str) -> None:
  """``need``: the farthest spill (phases the loop must run); the loop counter zeroed.

  Each grid tile reads its bucket's sub-group header (a bucket skipped:
  PopSparse's figure) and sends its farthest distance to the counter's tile,
  which takes their maximum (popops' Reduce) and zeroes the counter (Fill).
  """
  tiles = p.grid.tiles.reshape(-1)
  dst = int(p.counter.mapping.tiles[0])
  counter_tiles = _scalar_tiles(ctx, p.counter)
  cycles = _on_grid(ctx, p.grid) * popsparse.bucket_scan_cycles(1, 0, p.layout.block)
  cycles = cycles + estimators.fill_cycles(ctx.target, counter_tiles, 4)
  cycles[dst] += estimators.reduce_cycles(ctx.target, np.array([tiles.size]), 4,
                                          op="max")[0]
  layout = p.layout

  def fn(meta_st):
    distance = spill_distance(layout, logical(meta_st, p.meta))
    return storage(distance, need), storage(jnp.zeros((), jnp.int32), p.counter)

  def logical_fn(meta):
    return spill_distance(layout, meta), jnp.zeros((), jnp.int32)

  ctx.emit(P.Superstep(
      name=f"{name}/spill distance", op=ctx.op, reads=(p.meta,), writes=(need, p.counter),
      fn=fn, logical=logical_fn, compute_cycles=cycles,
      exchange=movement_cost(ctx.target, tiles, np.full(tiles.size, dst, np.int64), 4),
      vertices=np.minimum(_on_grid(ctx, p.grid) + counter_tiles, 1)))


def _emit_condition(ctx, p: _Propagation, need: P.Tensor, more: P.Tensor, name: str) -> None:
  """``more``: whether a further phase is needed (counter < need, on one tile)."""
  counter_tiles = _scalar_tiles(ctx, p.counter)

  def fn(counter_st, need_st):
    return (storage(logical(counter_st, p.counter) < logical(need_st, need), more),)

  ctx.emit(P.Superstep(
      name=f"{name}/more phases", op=ctx.op, reads=(p.counter, need), writes=(more,), fn=fn,
      logical=lambda counter, distance: (counter < distance,),
      compute_cycles=estimators.elementwise_cycles(ctx.target, counter_tiles, "lt", 4),
      vertices=np.minimum(counter_tiles, 1)))


def _emit_loop_step(ctx, p: _Propagation, step: int, bucket_bytes: int, name: str):
  """Step ``step`` of a run-time phase; the last one counts the phase."""
  last = step == p.grid.shape[2] - 1
  cycles = _step_cycles(ctx, p, 1, False)
  if last:
    cycles = cycles + estimators.elementwise_cycles(ctx.target, _scalar_tiles(ctx, p.counter),
                                                    "add", 4)
  ctx.emit(_propagation_step(
      ctx, p, f"{name}/propagate next cell step {step + 1}", bucket_bytes,
      _bucket_exchange(ctx, p.grid, bucket_bytes),
      reads=(p.values, p.meta, p.dense, p.partials, p.counter),
      writes=(p.partials,) + ((p.counter,) if last else ()),
      fn=functools.partial(_loop_step_fn, p, step, last),
      logical=functools.partial(_loop_step_logical, last), compute_cycles=cycles))


def _emit_further_phases(ctx, p: _Propagation, bucket_bytes: int, name: str) -> None:
  """The run-time loop: one phase per cell the farthest spill moved."""
  need = ctx.new_tensor((), np.int32, mapping=p.counter.mapping, name=f"{name} spill distance")
  _emit_distance(ctx, p, need, name)
  with ctx.sub_program() as (condition, cond_locals):
    more = ctx.new_tensor((), np.bool_, mapping=p.counter.mapping, name=f"{name} more phases")
    _emit_condition(ctx, p, need, more, name)
  with ctx.sub_program() as (body, body_locals):
    for step in range(p.grid.shape[2]):
      _emit_loop_step(ctx, p, step, bucket_bytes, name)
  cond_locals.discard(more.id)   # read after the loop's last condition
  ctx.emit(P.RepeatWhileTrue(condition, more, body, local_ids=frozenset(cond_locals | body_locals)))


def _bucket_mapping(ctx, grid: SparseGrid, tensor: P.Tensor) -> TileMapping:
  """Bucket ``g`` (one row of ``tensor``) on grid tile ``g``."""
  tiles = grid.tiles.reshape(-1)
  row = tensor.size // tiles.size
  return TileMapping.blocks(tensor.size, row, ctx.target.num_tiles, int(tiles[0]))


@register_lowering(dynamic_sparse_matmul_p)
def _dynamic_sparse_rule(ctx: RuleContext, values, meta, dense, *, layout):
  out_aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(int(d) for d in out_aval.shape), np.dtype(out_aval.dtype)
  if layout.num_tiles != ctx.target.num_tiles:
    raise LoweringError(f"dynamic sparse matmul: its buckets were planned for {layout.num_tiles} "
                        f"tiles, the program is lowered for {ctx.target.num_tiles}; plan the "
                        f"layout with the target passed to ipu_jax.jit.")
  if 0 in out_shape:
    return [ctx.new_tensor(out_shape, out_dtype)]
  name = "dynamic sparse matmul"
  grid = sparse_grid(ctx, layout.plan, np.zeros(0, np.int64), np.zeros(0, np.int64))
  values = relayout_to(ctx, values, _bucket_mapping(ctx, grid, values), name=f"{name}/place")
  meta = relayout_to(ctx, meta, _bucket_mapping(ctx, grid, meta), name=f"{name}/place meta")
  px, py, pz = grid.shape
  acc = products.accumulator(out_dtype)
  partials = ctx.new_tensor((py,) + out_shape, acc, name=f"{name} partials",
                            mapping=_partials_mapping(grid, out_shape))
  counter = ctx.new_tensor((), np.int32, name=f"{name} phase counter") if px * py > 1 else None
  p = _Propagation(layout, grid, values, meta, dense, partials, counter)
  bucket_bytes = (values.nbytes + meta.nbytes) // (px * py * pz)
  for step in range(pz):
    _emit_step(ctx, p, step, bucket_bytes, name)
  if counter is not None:
    _emit_further_phases(ctx, p, bucket_bytes, name)
  return [emit_reduction(ctx, grid, partials, out_dtype, "lhs", name)]


def _partials_mapping(grid: SparseGrid, out_shape) -> TileMapping:
  px, py, pz = grid.shape
  rx, _, fz = grid.plan.band
  return block_grid_mapping((py,) + tuple(out_shape), (py, px, pz), (1, rx * grid.plan.block, fz),
                            grid.tiles.transpose(1, 0, 2).reshape(-1))
