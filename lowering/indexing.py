"""The served plan shared by data-dependent indexing (gathers, scatters, dynamic slices).

Tile plan. Data-dependent indexing is done as on the IPU (popops'
``multiSlice`` / ``multiUpdateAdd`` / ``dynamicSlice``): the indices, which are
small, are broadcast (multicast) to every tile that holds part of the operand
(the *table*); each table tile scans all the indices and serves the elements
that fall in its own range; the served elements are exchanged to the tiles of
the result. One superstep does it: its exchange is the index broadcast plus the
movement of the results, its compute is the table tiles' scan-and-copy.

Where the results come from is only known at run time, but the IPU's exchange
is planned at compile time. The cost charged for the results is the
*proportional estimate*: an element requested from the table is taken to come
from table tile ``t`` with probability ``f_t`` = the fraction of the table that
``t`` holds (uniformly distributed indices). So a result tile holding ``n_o``
result elements receives ``n_o * (1 - f_o)`` of them (the rest it served
itself), a table tile sends ``f_t * (N - n_t)`` and serves ``f_t * N`` hits
(``N`` = result elements), and the elements that cross IPUs are counted the
same way per IPU. Scatters and dynamic updates run the other way round: an
update element goes from the tile that holds it to table tile ``t`` with
probability ``f_t``. The real chip plans this exchange for the worst case
(every table tile may send to every result tile); the estimate is the expected
traffic for uniformly spread indices, which is what the exchange costs on
average. Where the indices are compile-time constants nothing is estimated:
the operation is a static movement and its exchange is exact.

The rules that use it live in :mod:`~ipu_jax.lowering.rules.gather`,
:mod:`~ipu_jax.lowering.rules.scatter` and
:mod:`~ipu_jax.lowering.rules.dynamic_slice`; sorts, which move whole rows
instead, in :mod:`~ipu_jax.lowering.rules.sort`.

Execution. The numbers equal ``jax.jit`` because every step function binds the
primitive itself, with the equation's parameters, on the logical arrays and
writes the results into the result's tile storage. In ``"per_tile"`` executor
mode a gather of whole rows along the table's leading axis (an embedding
lookup) and a scatter of whole rows are emulated tile by tile: each tile masks
the requested elements to its own range and serves (or accumulates) them
locally; the partial gather results are combined with a bitwise OR of their
bit patterns — a sum of masked contributions in which the tiles that do not
hold an element contribute zero bits, so it is exact. Other forms run batched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.lowering import builders
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.mapping import TileMapping

GatherScatterMode = lax.GatherScatterMode  # re-exported for the gather and scatter rules

# Cycles for a worker to load one index, compare it with its tile's range and
# branch (popops' MultiSlice vertices do this per index).
_CYCLES_PER_INDEX = 3
# Elements a per-tile emulation may materialise at once (keeps "per_tile"
# mode's memory bounded for big tables).
_PER_TILE_BLOCK_ELEMENTS = 1 << 23


# -- costs ------------------------------------------------------------------


def is_constant(t: P.Tensor) -> bool:
  """Whether ``t`` is a compile-time constant (its movement is then static)."""
  return t.category == "constants" and t.value is not None


def _spread_cost(ctx, fixed_counts, share, itemsize, fixed_receives):
  """Expected exchange when elements on known tiles trade with a spread.

  Each moving element has one end on a known tile (``fixed_counts`` per tile)
  and the other on tile ``t`` with probability ``share[t]``.

  Args:
    ctx: the lowering context.
    fixed_counts: ``[num_tiles]`` moving elements whose known end is each tile.
    share: ``[num_tiles]`` probability of the other end (sums to 1).
    itemsize: bytes per element.
    fixed_receives: True when elements flow from the spread to the known
      tiles (gather results), False for the other way (scatter updates).
  """
  target = ctx.target
  fixed = np.asarray(fixed_counts, np.float64)
  share = np.asarray(share, np.float64)
  total = fixed.sum()
  stay = fixed * share  # expected elements whose two ends are the same tile
  fixed_side = np.maximum(np.ceil(fixed - stay - 1e-9), 0)
  spread_side = np.maximum(np.ceil(share * total - stay - 1e-9), 0)
  by_ipu = (target.num_ipus, target.tiles_per_ipu)
  fixed_ipu = fixed.reshape(by_ipu).sum(axis=1)
  share_ipu = share.reshape(by_ipu).sum(axis=1)
  if fixed_receives:
    bytes_in, bytes_out = fixed_side, spread_side
    link = share_ipu * (total - fixed_ipu)
  else:
    bytes_in, bytes_out = spread_side, fixed_side
    link = fixed_ipu * (1.0 - share_ipu)
  link = np.maximum(np.ceil(link - 1e-9), 0)
  return ExchangeCost((bytes_in * itemsize).astype(np.int64),
                      (bytes_out * itemsize).astype(np.int64),
                      (link * itemsize).astype(np.int64))


def _table_share(ctx, table: P.Tensor) -> np.ndarray:
  """``[num_tiles]`` fraction of ``table`` each tile holds."""
  held = table.mapping.elements_per_tile(ctx.target.num_tiles).astype(np.float64)
  return held / max(table.size, 1)


def _serve_cycles(ctx, active, num_indices, hits, itemsize, cycles_per_vector=1.0):
  """Compute cycles of table tiles that scan indices and handle their hits.

  Each worker scans a share of the indices and copies (or combines) a share
  of the hits, a vector at a time.
  """
  target = ctx.target
  w = target.worker_contexts
  hits = np.asarray(hits, np.float64)
  per_worker_indices = -(-int(num_indices) // w)
  per_worker_hits = np.ceil(hits / w)
  per_vector = max(1, target.vector_width_bytes // max(1, itemsize))
  busiest = (estimators.WORKER_OVERHEAD + per_worker_indices * _CYCLES_PER_INDEX
             + np.ceil(per_worker_hits / per_vector) * cycles_per_vector)
  return np.where(active, w * busiest + target.supervisor_overhead_cycles, 0.0)


def item_cycles(ctx, items, cycles_per_item):
  """Cycles of scalar (not vectorised) work items split over the workers."""
  return estimators.worker_split_cycles(ctx.target, np.asarray(items, np.int64),
                                        cycles_per_item, ctx.target.vector_width_bytes)


def static_sources(fn, *shapes) -> np.ndarray:
  """Flat source element of every result element of a static movement.

  ``fn`` is applied to arrays holding their own element ids (the operands'
  ids are consecutive); results are ``-1`` where ``fn`` fills.
  """
  with jax.ensure_compile_time_eval():
    offset, ids = 0, []
    for shape in shapes:
      size = int(np.prod(shape, dtype=np.int64))
      # Made on the host and placed as they are: eager jnp ops would compile
      # a program for each shape.
      ids.append(jax.device_put(np.arange(offset, offset + size, dtype=np.int32).reshape(shape)))
      offset += size
    return np.asarray(fn(*ids)).reshape(-1).astype(np.int64)


def _static_cost(ctx, operands, out: P.Tensor, source: np.ndarray):
  """Exact exchange of a static movement into ``out``'s mapping."""
  element_tiles = np.concatenate([t.mapping.element_tile for t in operands])
  real = source >= 0
  return movement_cost(ctx.target, element_tiles[source[real]],
                       out.mapping.element_tile[real], out.itemsize,
                       element_id=source[real])


# -- steps ------------------------------------------------------------------


def bind_fn(prim, params, reads, outs, per_tile=None):
  """Step function: ``prim`` on the logical operands, results into storage.

  ``per_tile(logical_operands, storages)``, when given, replaces the call:
  what the tiles do. Either way the step's logical form is
  :func:`bind_logical` (the batched executor runs that, with no round trip
  through tile storage).
  """
  def fn(*storages):
    args = [builders.logical(s, t) for s, t in zip(storages, reads)]
    if per_tile is not None:
      results = per_tile(args, storages)
    else:
      results = prim.bind(*args, **params)
    if not isinstance(results, (tuple, list)):
      results = (results,)
    return tuple(builders.storage(r, o) for r, o in zip(results, outs))
  return fn


def bind_logical(prim, params):
  """A step's logical form: ``prim`` on the logical operands."""
  def form(*arrays):
    results = prim.bind(*arrays, **params)
    return tuple(results) if isinstance(results, (tuple, list)) else (results,)
  return form


def emit_step(ctx, name, reads, writes, fn, compute=None, exchange=None,
              vertices=None, codelet="", flops=0, scratch=None, logical=None,
              updates_base=False):
  """Emit one indexing superstep of the equation being lowered.

  ``updates_base``: the one result is ``reads[0]`` updated in place
  (``Superstep.updates_base``).
  """
  ctx.emit(P.Superstep(
      name=name, op=ctx.op, reads=tuple(reads), writes=tuple(writes), fn=fn,
      compute_cycles=compute, exchange=exchange, vertices=vertices,
      codelets=(codelet,) if codelet else (), flops=int(flops),
      scratch_bytes=scratch, logical=logical, updates_base=updates_base))


def served_lookup(ctx, prim, params, table, indices, out, num_lookups, codelet,
                  static_source=None, per_tile=None, estimator=None):
  """Emit a served lookup: indices broadcast, table tiles serve, results move.

  Args:
    table: the operand looked up.
    indices: index tensors broadcast to the table's tiles (the primitive
      binds ``table, *indices``).
    out: the result tensor.
    num_lookups: index tuples each table tile scans.
    static_source: flat source element per result element when the indices
      are compile-time constants (exact, pure exchange), else ``None``.
    estimator: ``estimator(target, hits, itemsize)``, the compute cycles of
      the table tiles' vertex (``None``: the generic served-lookup model).
    per_tile: the tiles' lookup (see :func:`bind_fn`), or None.
  """
  target = ctx.target
  reads = [table] + list(indices)
  fn = bind_fn(prim, params, reads, [out], per_tile)
  logical = bind_logical(prim, params)
  if static_source is not None:
    emit_step(ctx, f"{ctx.op}/static", reads, [out], fn,
              exchange=_static_cost(ctx, [table], out, static_source), logical=logical)
    return
  share = _table_share(ctx, table)
  active = share > 0
  hits = np.ceil(share * out.size - 1e-9)
  compute = (_serve_cycles(ctx, active, num_lookups, hits, out.itemsize) if estimator is None
             else np.where(active, estimator(target, np.maximum(hits, 1), out.itemsize), 0.0))
  vertices = np.where(active, min(target.worker_contexts, max(1, num_lookups)), 0)
  emit_step(ctx, ctx.op, reads, [out], fn, compute=compute,
            exchange=served_lookup_cost(ctx, table, indices, out.mapping, out.itemsize),
            vertices=vertices, codelet=codelet,
            scratch=(hits * out.itemsize).astype(np.int64), logical=logical)


def served_update(ctx, prim, params, reads, operand, indices, updates, out, num_lookups,
                  codelet, cycles_per_vector=1.0, flops=0, static_source=None,
                  per_tile=None, estimator=None):
  """Emit an in-place update: indices broadcast, table tiles apply their hits.

  Args:
    reads: the primitive's operands in bind order.
    operand, indices, updates: their roles (``indices`` are broadcast).
    estimator, per_tile: as for :func:`served_lookup`.
  """
  target = ctx.target
  fn = bind_fn(prim, params, reads, [out], per_tile)
  logical = bind_logical(prim, params)
  if static_source is not None:
    # The operand stays put; each update element moves to its static place.
    cost = _static_cost(ctx, [operand, updates], out, static_source)
    from_update = static_source >= operand.size
    received = np.bincount(out.mapping.element_tile[from_update],
                           minlength=target.num_tiles)[:target.num_tiles]
    emit_step(ctx, f"{ctx.op}/static", reads, [out], fn,
              compute=estimators.copy_cycles(target, received, out.itemsize),
              exchange=cost, vertices=builders.worker_vertices(ctx, received),
              codelet=codelet, logical=logical, updates_base=reads[0] is operand)
    return
  share = _table_share(ctx, operand)
  active = share > 0
  hits = np.ceil(share * updates.size - 1e-9)
  compute = (_serve_cycles(ctx, active, num_lookups, hits, out.itemsize, cycles_per_vector)
             if estimator is None
             else np.where(active, estimator(target, np.maximum(hits, 1), out.itemsize), 0.0))
  vertices = np.where(active, min(target.worker_contexts, max(1, num_lookups)), 0)
  emit_step(ctx, ctx.op, reads, [out], fn, compute=compute,
            exchange=served_update_cost(ctx, operand, indices, updates), vertices=vertices,
            codelet=codelet, flops=flops, logical=logical, updates_base=reads[0] is operand)


def served_update_cost(ctx, operand, indices, updates):
  """Exchange of a served update: indices broadcast, updates to the table."""
  costs = [builders.broadcast_cost(ctx, t, operand.mapping.tiles)
           for t in indices if not is_constant(t)]
  costs.append(_spread_cost(ctx, updates.mapping.elements_per_tile(ctx.target.num_tiles),
                            _table_share(ctx, operand), updates.itemsize,
                            fixed_receives=False))
  return builders.add_costs(*costs)


def served_lookup_cost(ctx, table, indices, out_mapping, itemsize):
  """Exchange of a served lookup: indices broadcast, results from the table."""
  costs = [builders.broadcast_cost(ctx, t, table.mapping.tiles)
           for t in indices if not is_constant(t)]
  if table.size:
    costs.append(_spread_cost(ctx, out_mapping.elements_per_tile(ctx.target.num_tiles),
                              _table_share(ctx, table), itemsize, fixed_receives=True))
  return builders.add_costs(*costs)


def copy_of(ctx, operand: P.Tensor) -> list:
  """The result of an update that changes nothing: a copy in place."""
  out = ctx.like(operand)
  if out.size:
    builders.assign(ctx, out, operand, name=f"{ctx.op}/copy")
  return [out]


# -- per-tile emulation of whole-row lookups and updates -----------------------


def bits_dtype(dtype):
  """The unsigned type with ``dtype``'s bit pattern, or None."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_ or dtype.kind == "c":
    return None
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(dtype.itemsize)


def tile_blocks(mapping: TileMapping, work_per_tile: int):
  """Storage rows grouped into equal blocks of tiles, with starts and counts.

  Returns ``(block, num_blocks, starts, counts)``; padding tiles hold nothing.
  """
  rows = mapping.num_rows
  block = max(1, min(rows, _PER_TILE_BLOCK_ELEMENTS // max(1, work_per_tile)))
  num_blocks = -(-rows // block)
  pad = num_blocks * block - rows
  starts = np.concatenate([np.arange(rows, dtype=np.int64) * mapping.row_size,
                           np.zeros(pad, np.int64)]).astype(np.int32)
  counts = np.concatenate([mapping.counts, np.zeros(pad, np.int64)]).astype(np.int32)
  return block, num_blocks, starts, counts


def pad_rows(storage_array, rows):
  """``storage_array`` with zero rows appended up to ``rows``."""
  pad = rows - storage_array.shape[0]
  return jnp.pad(storage_array, ((0, pad), (0, 0))) if pad else storage_array


def rows_in_range(idx, num_rows):
  """Row indices clamped to ``[0, num_rows)`` (int32) and whether in range.

  Compares in the indices' own type, so unsigned and narrow types work.
  """
  hi = min(num_rows - 1, int(np.iinfo(idx.dtype).max))
  hi = np.asarray(hi, idx.dtype)
  zero = np.asarray(0, idx.dtype)
  valid = (idx >= zero) & (idx <= hi)
  return jnp.clip(idx, zero, hi).astype(jnp.int32), valid
