"""Data-dependent indexing: dynamic slices, gathers, scatters and sorts.

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

* ``gather`` (every ``GatherDimensionNumbers`` form: ``x[idx]``, ``jnp.take``,
  embeddings, ``take_along_axis``; modes clip / fill / promise_in_bounds) and
  ``dynamic_slice`` follow the plan above; the result is mapped linearly.
* ``scatter`` / ``scatter-add`` / ``scatter_mul`` / ``scatter_min`` /
  ``scatter_max`` / ``scatter_sub`` (``.at[].set/add/...`` and the gradients of
  gathers) and ``dynamic_update_slice``: the result keeps the operand's
  mapping (updated in place), the indices are broadcast to its tiles and each
  table tile accumulates the updates whose indices fall in its range — the
  gradient of an embedding lookup.
* ``sort`` (multi-operand, ``num_keys``, stable), ``top_k`` and
  ``approx_top_k``: rows along the sort axis that fit comfortably on one tile
  are partitioned over tiles along the largest other axis
  (:func:`~ipu_jax.lowering.builders.partitioned`), each tile sorting whole
  rows (``n log2 n`` compare-exchanges per row). Longer rows (and 1-D arrays)
  are spread over ``P`` tiles per row (a power of two): each tile sorts its
  chunk, then ``log2 P (log2 P + 1) / 2`` bitonic merge supersteps exchange
  chunks between partner tiles (``top_k``: each tile selects its local top-k
  and the candidates are merged on the row's first tile).

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

import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import builders
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules import small_table

_Mode = lax.GatherScatterMode

# Cycles for a worker to load one index, compare it with its tile's range and
# branch (popops' MultiSlice vertices do this per index).
_CYCLES_PER_INDEX = 3
# Cycles per compare-exchange of a sort: compare the keys, move the operands.
_SORT_COMPARE_CYCLES = 2
# A sort row (all operands, inputs and results) this large or smaller stays
# on one tile; as a fraction of the tile's SRAM.
_ROW_BUDGET_FRACTION = 8
# Elements a per-tile emulation may materialise at once (keeps "per_tile"
# mode's memory bounded for big tables).
_PER_TILE_BLOCK_ELEMENTS = 1 << 23


# -- costs ------------------------------------------------------------------


def _is_constant(t: P.Tensor) -> bool:
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


def _item_cycles(ctx, items, cycles_per_item):
  """Cycles of scalar (not vectorised) work items split over the workers."""
  return estimators.worker_split_cycles(ctx.target, np.asarray(items, np.int64),
                                        cycles_per_item, ctx.target.vector_width_bytes)


def _static_sources(fn, *shapes) -> np.ndarray:
  """Flat source element of every result element of a static movement.

  ``fn`` is applied to arrays holding their own element ids (the operands'
  ids are consecutive); results are ``-1`` where ``fn`` fills.
  """
  with jax.ensure_compile_time_eval():
    offset, ids = 0, []
    for shape in shapes:
      size = int(np.prod(shape, dtype=np.int64))
      ids.append(jnp.arange(offset, offset + size, dtype=jnp.int32).reshape(shape))
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


def _bind_fn(prim, params, reads, outs, per_tile=None):
  """Step function: ``prim`` on the logical operands, results into storage.

  ``per_tile(*logical_operands, *storages)`` replaces the batched call in
  ``"per_tile"`` executor mode when given.
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


def _emit(ctx, name, reads, writes, fn, compute=None, exchange=None,
          vertices=None, codelet="", flops=0, scratch=None):
  ctx.emit(P.Superstep(
      name=name, op=ctx.op, reads=tuple(reads), writes=tuple(writes), fn=fn,
      compute_cycles=compute, exchange=exchange, vertices=vertices,
      codelets=(codelet,) if codelet else (), flops=int(flops),
      scratch_bytes=scratch))


def _lookup(ctx, prim, params, table, indices, out, num_lookups, codelet,
            static_source=None, per_tile=None):
  """Emit a served lookup: indices broadcast, table tiles serve, results move.

  Args:
    table: the operand looked up.
    indices: index tensors broadcast to the table's tiles (the primitive
      binds ``table, *indices``).
    out: the result tensor.
    num_lookups: index tuples each table tile scans.
    static_source: flat source element per result element when the indices
      are compile-time constants (exact, pure exchange), else ``None``.
  """
  target = ctx.target
  reads = [table] + list(indices)
  fn = _bind_fn(prim, params, reads, [out], per_tile)
  if static_source is not None:
    _emit(ctx, f"{ctx.op}/static", reads, [out], fn,
          exchange=_static_cost(ctx, [table], out, static_source))
    return
  share = _table_share(ctx, table)
  active = share > 0
  hits = np.ceil(share * out.size - 1e-9)
  compute = _serve_cycles(ctx, active, num_lookups, hits, out.itemsize)
  vertices = np.where(active, min(target.worker_contexts, max(1, num_lookups)), 0)
  _emit(ctx, ctx.op, reads, [out], fn, compute=compute,
        exchange=_served_lookup_cost(ctx, table, indices, out.mapping, out.itemsize),
        vertices=vertices, codelet=codelet,
        scratch=(hits * out.itemsize).astype(np.int64))


def _update(ctx, prim, params, reads, operand, indices, updates, out, num_lookups,
            codelet, cycles_per_vector=1.0, flops=0, static_source=None,
            per_tile=None):
  """Emit an in-place update: indices broadcast, table tiles apply their hits.

  Args:
    reads: the primitive's operands in bind order.
    operand, indices, updates: their roles (``indices`` are broadcast).
  """
  target = ctx.target
  fn = _bind_fn(prim, params, reads, [out], per_tile)
  if static_source is not None:
    # The operand stays put; each update element moves to its static place.
    cost = _static_cost(ctx, [operand, updates], out, static_source)
    from_update = static_source >= operand.size
    received = np.bincount(out.mapping.element_tile[from_update],
                           minlength=target.num_tiles)[:target.num_tiles]
    _emit(ctx, f"{ctx.op}/static", reads, [out], fn,
          compute=estimators.copy_cycles(target, received, out.itemsize),
          exchange=cost, vertices=builders.worker_vertices(ctx, received),
          codelet=codelet)
    return
  share = _table_share(ctx, operand)
  active = share > 0
  hits = np.ceil(share * updates.size - 1e-9)
  compute = _serve_cycles(ctx, active, num_lookups, hits, out.itemsize,
                          cycles_per_vector)
  vertices = np.where(active, min(target.worker_contexts, max(1, num_lookups)), 0)
  _emit(ctx, ctx.op, reads, [out], fn, compute=compute,
        exchange=_served_update_cost(ctx, operand, indices, updates), vertices=vertices,
        codelet=codelet, flops=flops)


def _served_update_cost(ctx, operand, indices, updates):
  """Exchange of a served update: indices broadcast, updates to the table."""
  costs = [builders.broadcast_cost(ctx, t, operand.mapping.tiles)
           for t in indices if not _is_constant(t)]
  costs.append(_spread_cost(ctx, updates.mapping.elements_per_tile(ctx.target.num_tiles),
                            _table_share(ctx, operand), updates.itemsize,
                            fixed_receives=False))
  return builders.add_costs(*costs)


def _served_lookup_cost(ctx, table, indices, out_mapping, itemsize):
  """Exchange of a served lookup: indices broadcast, results from the table."""
  costs = [builders.broadcast_cost(ctx, t, table.mapping.tiles)
           for t in indices if not _is_constant(t)]
  if table.size:
    costs.append(_spread_cost(ctx, out_mapping.elements_per_tile(ctx.target.num_tiles),
                              _table_share(ctx, table), itemsize, fixed_receives=True))
  return builders.add_costs(*costs)


def _copy_of(ctx, operand: P.Tensor) -> list:
  """The result of an update that changes nothing: a copy in place."""
  out = ctx.like(operand)
  if out.size:
    builders.assign(ctx, out, operand, name=f"{ctx.op}/copy")
  return [out]


# -- per-tile emulation of whole-row lookups and updates -----------------------


def _bits_dtype(dtype):
  """The unsigned type with ``dtype``'s bit pattern, or None."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_ or dtype.kind == "c":
    return None
  return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(dtype.itemsize)


def _tile_blocks(mapping: TileMapping, work_per_tile: int):
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


def _pad_rows(storage_array, rows):
  pad = rows - storage_array.shape[0]
  return jnp.pad(storage_array, ((0, pad), (0, 0))) if pad else storage_array


def _rows_gather_per_tile(table_storage, mapping, rows, row_len, dtype):
  """``table[rows]`` served tile by tile (``rows`` in range, ``[K]``).

  Every tile masks the requested elements to the range it holds and copies
  those; the partial results are ORed bitwise (tiles that do not hold an
  element contribute zero bits), which is exact.
  """
  bits = _bits_dtype(dtype)
  chunk = mapping.row_size
  src = rows.astype(jnp.int32)[:, None] * row_len + jnp.arange(row_len, dtype=jnp.int32)
  block, num_blocks, starts, counts = _tile_blocks(mapping, src.size)
  table_bits = lax.bitcast_convert_type(table_storage, bits)
  table_bits = _pad_rows(table_bits, num_blocks * block).reshape(num_blocks, block, chunk)

  def serve(row, start, count):
    local = src - start
    hit = (local >= 0) & (local < count)
    return jnp.where(hit, row[jnp.clip(local, 0, chunk - 1)], jnp.zeros((), bits))

  def body(acc, blk):
    part = jax.vmap(serve)(*blk)
    return acc | lax.reduce(part, jnp.zeros((), bits), lax.bitwise_or, (0,)), None

  acc, _ = lax.scan(body, jnp.zeros(src.shape, bits),
                    (table_bits, starts.reshape(num_blocks, block),
                     counts.reshape(num_blocks, block)))
  return lax.bitcast_convert_type(acc, dtype)


_COMBINE = {
    "scatter": lambda ref, pos, u: ref.at[pos].set(u, mode="drop"),
    "scatter-add": lambda ref, pos, u: ref.at[pos].add(u, mode="drop"),
    "scatter-sub": lambda ref, pos, u: ref.at[pos].subtract(u, mode="drop"),
    "scatter-mul": lambda ref, pos, u: ref.at[pos].multiply(u, mode="drop"),
    "scatter-min": lambda ref, pos, u: ref.at[pos].min(u, mode="drop"),
    "scatter-max": lambda ref, pos, u: ref.at[pos].max(u, mode="drop"),
}


def _rows_scatter_per_tile(name, op_storage, mapping, rows, valid, updates, row_len):
  """Whole-row scatter applied tile by tile into ``op_storage``.

  Each tile keeps the update elements whose destination falls in its range
  (in their original order) and combines them into its own storage row.
  """
  chunk = mapping.row_size
  dest = rows.astype(jnp.int32)[:, None] * row_len + jnp.arange(row_len, dtype=jnp.int32)
  upd = updates.reshape(dest.shape).reshape(-1)
  block, _, starts, counts = _tile_blocks(mapping, dest.size)
  combine = _COMBINE[name]

  def tile(args):
    row, start, count = args
    local = dest - start
    hit = valid[:, None] & (local >= 0) & (local < count)
    pos = jnp.where(hit, local, chunk).reshape(-1)  # ``chunk`` is dropped
    return combine(row, pos, upd)

  num = mapping.num_rows
  return lax.map(tile, (op_storage, starts[:num], counts[:num]), batch_size=block)


def _rows_in_range(idx, num_rows):
  """Row indices clamped to ``[0, num_rows)`` (int32) and whether in range.

  Compares in the indices' own type, so unsigned and narrow types work.
  """
  hi = min(num_rows - 1, int(np.iinfo(idx.dtype).max))
  hi = np.asarray(hi, idx.dtype)
  zero = np.asarray(0, idx.dtype)
  valid = (idx >= zero) & (idx <= hi)
  return jnp.clip(idx, zero, hi).astype(jnp.int32), valid


def _rows_form_gather(operand, indices, dnums, slice_sizes) -> bool:
  """Whether a gather takes whole rows of the leading axis (an embedding)."""
  batch = len(indices.shape) - 1
  return (len(operand.shape) >= 1 and len(indices.shape) >= 1
          and indices.shape[-1] == 1 and operand.size > 0
          and tuple(dnums.collapsed_slice_dims) == (0,)
          and tuple(dnums.start_index_map) == (0,)
          and not tuple(dnums.operand_batching_dims)
          and tuple(slice_sizes) == (1,) + tuple(operand.shape[1:])
          and tuple(dnums.offset_dims) == tuple(range(batch, batch + len(operand.shape) - 1))
          and operand.mapping.is_linear and _bits_dtype(operand.dtype) is not None
          and np.issubdtype(indices.dtype, np.integer))


def _rows_form_scatter(operand, indices, updates, dnums) -> bool:
  """Whether a scatter updates whole rows of the leading axis."""
  batch = len(indices.shape) - 1
  return (len(operand.shape) >= 1 and len(indices.shape) >= 1
          and indices.shape[-1] == 1 and operand.size > 0
          and tuple(dnums.inserted_window_dims) == (0,)
          and tuple(dnums.scatter_dims_to_operand_dims) == (0,)
          and not tuple(dnums.operand_batching_dims)
          and tuple(dnums.update_window_dims) == tuple(range(batch, len(updates.shape)))
          and tuple(updates.shape) == tuple(indices.shape[:-1]) + tuple(operand.shape[1:])
          and operand.mapping.is_linear
          and np.issubdtype(indices.dtype, np.integer))


# -- dynamic_slice / dynamic_update_slice ---------------------------------------


@register_lowering(lax.dynamic_slice_p)
def _dynamic_slice(ctx, operand, *indices, slice_sizes):
  """A window at run-time offsets: each operand tile serves its part."""
  params = dict(slice_sizes=slice_sizes)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype)
  if out.size == 0:
    return [out]
  static = None
  if all(_is_constant(t) for t in indices):
    starts = [np.asarray(t.value).reshape(()) for t in indices]
    static = _static_sources(
        lambda ids: lax.dynamic_slice(ids, [jnp.asarray(s) for s in starts], slice_sizes),
        operand.shape)
  _lookup(ctx, lax.dynamic_slice_p, params, operand, indices, out,
          num_lookups=1, codelet=vocab.DYNAMIC_SLICE, static_source=static)
  return [out]


@register_lowering(lax.dynamic_update_slice_p)
def _dynamic_update_slice(ctx, operand, update, *indices):
  """Overwrite a window at run-time offsets, in place on the operand's tiles."""
  if operand.size == 0:
    return [ctx.like(operand)]
  if update.size == 0:
    return _copy_of(ctx, operand)
  out = ctx.like(operand)
  static = None
  if all(_is_constant(t) for t in indices):
    starts = [np.asarray(t.value).reshape(()) for t in indices]
    static = _static_sources(
        lambda a, b: lax.dynamic_update_slice(a, b, [jnp.asarray(s) for s in starts]),
        operand.shape, update.shape)
  _update(ctx, lax.dynamic_update_slice_p, {}, [operand, update, *indices], operand,
          list(indices), update, out, num_lookups=1,
          codelet=vocab.DYNAMIC_UPDATE_SLICE, static_source=static)
  return [out]


# -- gather -------------------------------------------------------------------


def _default_fill(dtype):
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.inexact):
    return np.nan
  if np.issubdtype(dtype, np.signedinteger):
    return np.iinfo(dtype).min
  if np.issubdtype(dtype, np.unsignedinteger):
    return np.iinfo(dtype).max
  return True


@register_lowering(lax.gather_p)
def _gather(ctx, operand, indices, *, dimension_numbers, slice_sizes,
            indices_are_sorted, unique_indices, mode, fill_value):
  """Gathers: the indices go to the table's tiles, which serve their rows."""
  params = dict(dimension_numbers=dimension_numbers, slice_sizes=slice_sizes,
                indices_are_sorted=indices_are_sorted, unique_indices=unique_indices,
                mode=mode, fill_value=fill_value)
  mode = _Mode.from_any(mode)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype)
  if out.size == 0:
    return [out]
  if operand.size == 0:
    # Nothing to serve (only a fill-mode gather can get here): every result
    # element is the fill value, written on its own tile.
    fill = _default_fill(out.dtype) if fill_value is None else fill_value
    elements = out.mapping.elements_per_tile(ctx.target.num_tiles)
    _emit(ctx, f"{ctx.op}/fill", [], [out],
          lambda: (builders.storage(jnp.full(out.shape, fill, out.dtype), out),),
          compute=estimators.fill_cycles(ctx.target, elements, out.itemsize),
          vertices=builders.worker_vertices(ctx, elements), codelet=vocab.FILL)
    return [out]
  num_lookups = int(np.prod(indices.shape[:-1], dtype=np.int64))
  static = None
  if _is_constant(indices):
    source_params = dict(params, fill_value=-1)
    index_value = np.asarray(indices.value)
    static = _static_sources(
        lambda ids: lax.gather_p.bind(ids, jnp.asarray(index_value), **source_params),
        operand.shape)
  per_tile = None
  if (ctx.options.executor_mode == "per_tile"
      and _rows_form_gather(operand, indices, dimension_numbers, slice_sizes)):
    fill = _default_fill(out.dtype) if fill_value is None else fill_value
    mapping, num_rows = operand.mapping, operand.shape[0]
    row_len = int(np.prod(operand.shape[1:], dtype=np.int64))
    batch_shape = tuple(indices.shape[:-1])

    def per_tile(args, storages):
      rows, valid = _rows_in_range(args[1].reshape(-1), num_rows)
      served = _rows_gather_per_tile(storages[0], mapping, rows, row_len, out.dtype)
      if mode == _Mode.FILL_OR_DROP:
        served = jnp.where(valid[:, None], served, jnp.asarray(fill, out.dtype))
      return served.reshape(batch_shape + tuple(operand.shape[1:]))

  if static is None:
    replicated = small_table.ReplicatedGather(ctx, operand, indices, out.shape)
    served = _served_lookup_cost(ctx, operand, [indices], out.mapping, out.itemsize)
    if replicated.feasible and (small_table.plan_seconds(ctx.target, replicated.costs)
        < small_table.plan_seconds(ctx.target, [served])):
      out = ctx.new_tensor(aval.shape, aval.dtype,
                           replicated.out_mapping(dimension_numbers.offset_dims))
      replicated.emit(_bind_fn(lax.gather_p, params, [operand, indices], [out]), out,
                      codelet=vocab.MULTI_SLICE)
      return [out]
  _lookup(ctx, lax.gather_p, params, operand, [indices], out, num_lookups,
          codelet=vocab.MULTI_SLICE, static_source=static, per_tile=per_tile)
  return [out]


# -- scatters -----------------------------------------------------------------


def _scatter_rule(prim, codelet, cycles_per_vector, counts_flops):
  name = prim.name

  def rule(ctx, operand, indices, updates, *, dimension_numbers, indices_are_sorted,
           unique_indices, mode, update_jaxpr, update_consts):
    params = dict(dimension_numbers=dimension_numbers,
                  indices_are_sorted=indices_are_sorted, unique_indices=unique_indices,
                  mode=mode, update_jaxpr=update_jaxpr, update_consts=update_consts)
    if operand.size == 0:
      return [ctx.like(operand)]
    if updates.size == 0:
      return _copy_of(ctx, operand)
    out = ctx.like(operand)
    num_lookups = int(np.prod(indices.shape[:-1], dtype=np.int64))
    per_tile = None
    if (ctx.options.executor_mode == "per_tile" and name in _COMBINE
        and (name != "scatter" or update_jaxpr is None)
        and _rows_form_scatter(operand, indices, updates, dimension_numbers)):
      clip = _Mode.from_any(mode) == _Mode.CLIP
      mapping, num_rows = operand.mapping, operand.shape[0]
      row_len = int(np.prod(operand.shape[1:], dtype=np.int64))

      def per_tile(args, storages):
        rows, valid = _rows_in_range(args[1].reshape(-1), num_rows)
        if clip:
          valid = jnp.ones_like(valid)
        new = _rows_scatter_per_tile(name, storages[0], mapping, rows, valid,
                                     args[2], row_len)
        return builders.logical(new, operand)

    partials = small_table.ScatterPartials.plan(
        ctx, name, operand, indices, updates, dimension_numbers, update_jaxpr)
    if partials is not None and (
        small_table.plan_seconds(ctx.target, partials.costs)
        < small_table.plan_seconds(
            ctx.target, [_served_update_cost(ctx, operand, [indices], updates)])):
      partials.emit(params, out)
      return [out]
    flops = updates.size if counts_flops and np.issubdtype(updates.dtype, np.inexact) else 0
    _update(ctx, prim, params, [operand, indices, updates], operand, [indices],
            updates, out, num_lookups,
            codelet=codelet, cycles_per_vector=cycles_per_vector, flops=flops,
            per_tile=per_tile)
    return [out]

  return rule


_SCATTERS = [
    (lax.scatter_p, vocab.MULTI_UPDATE, 1.0, False),
    (lax.scatter_add_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "add"), 2.0, True),
    (lax.scatter_mul_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "mul"), 2.0, True),
    (lax.scatter_min_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "min"), 2.0, True),
    (lax.scatter_max_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "max"), 2.0, True),
]
if hasattr(lax, "scatter_sub_p"):
  _SCATTERS.append((lax.scatter_sub_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "sub"), 2.0, True))

for _prim, _codelet, _cycles, _flops in _SCATTERS:
  register_lowering(_prim, _scatter_rule(_prim, _codelet, _cycles, _flops))


# -- sort / top_k ----------------------------------------------------------------


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
def _sort(ctx, *operands, dimension, is_stable, num_keys):
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
          cycles_per_tile_fn=lambda r: _item_cycles(
              ctx, r * rows_per_slice * flat_compares, compare_cycles),
          codelet=vocab.SORT)
  plan = _RowPlan(ctx, shape, dimension, _tiles_per_row(ctx, n, 2 * n * element_bytes))
  mapping = plan.mapping()
  outs = [ctx.new_tensor(s, d, mapping) for s, d in out_avals]
  local = plan.per_tile(plan.chunk_elems * np.ceil(np.log2(np.maximum(plan.chunk_elems, 1))))
  _emit(ctx, "sort", operands, outs, _bind_fn(lax.sort_p, params, operands, outs),
        compute=_item_cycles(ctx, local, compare_cycles),
        exchange=_relayout_cost(ctx, operands, mapping),
        vertices=builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems))),
        codelet=vocab.SORT)
  # Bitonic merges between the chunks of a row: the data is already sorted
  # by the step above; these steps carry the cost of the merges.
  levels = _log2(plan.p)
  merge_compute = _item_cycles(ctx, plan.per_tile(2 * plan.chunk_elems), compare_cycles)
  vertices = builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems)))
  costs = {}
  for level in range(1, levels + 1):
    for j in range(level - 1, -1, -1):
      bit = 1 << j
      if bit not in costs:
        costs[bit] = plan.merge_cost(bit, element_bytes)
      _emit(ctx, f"sort/merge{level}.{j}", outs, outs, lambda *xs: tuple(xs),
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
          cycles_per_tile_fn=lambda r: _item_cycles(
              ctx, r * rows_per_slice * n * max(select, 1), _SORT_COMPARE_CYCLES + 1),
          codelet=codelet)
  plan = _RowPlan(ctx, shape, axis, _tiles_per_row(ctx, n, n * operand.itemsize))
  out_mapping = plan.mapping(out_avals[0][0], first_tile_only=True)
  outs = [ctx.new_tensor(s, d, out_mapping) for s, d in out_avals]
  local_cycles = _item_cycles(ctx, plan.per_tile(plan.chunk_elems * max(select, 1)),
                              _SORT_COMPARE_CYCLES + 1)
  vertices = builders.worker_vertices(ctx, plan.per_tile(np.ones_like(plan.chunk_elems)))
  if plan.p == 1:
    _emit(ctx, prim.name, [operand], outs, _bind_fn(prim, params, [operand], outs),
          compute=local_cycles, exchange=_relayout_cost(ctx, [operand], plan.mapping()),
          vertices=vertices, codelet=codelet)
    return outs
  # Each tile selects the top k of its chunk, then the row's first tile merges
  # the candidates of its row.
  in_mapping = plan.mapping()
  spread = ctx.new_tensor(shape, operand.dtype, in_mapping, name=f"{prim.name}/chunks")
  _emit(ctx, f"{prim.name}/local", [operand], [spread],
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
  _emit(ctx, f"{prim.name}/merge", [spread], outs, _bind_fn(prim, params, [spread], outs),
        compute=_item_cycles(ctx, merged * max(select, 1), _SORT_COMPARE_CYCLES + 1),
        exchange=ExchangeCost(received.astype(np.int64),
                              plan.per_tile(sent).astype(np.int64), link.astype(np.int64)),
        vertices=builders.worker_vertices(ctx, merged > 0), codelet=codelet)
  return outs


@register_lowering(lax.top_k_p)
def _top_k(ctx, operand, *, k, **params):
  axis = params.get("axis", -1) % len(operand.shape)
  return _top_k_like(ctx, lax.top_k_p, dict(params, k=k), operand, axis, k)


if hasattr(lax, "approx_top_k_p"):

  @register_lowering(lax.approx_top_k_p)
  def _approx_top_k(ctx, operand, *, k, reduction_dimension, **params):
    axis = reduction_dimension % len(operand.shape)
    return _top_k_like(ctx, lax.approx_top_k_p,
                       dict(params, k=k, reduction_dimension=reduction_dimension),
                       operand, axis, ctx.out_avals[0].shape[axis])
