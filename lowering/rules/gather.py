"""Gathers (``x[idx]``, ``jnp.take``, embeddings, ``take_along_axis``).

* ``gather`` (every ``GatherDimensionNumbers`` form: ``x[idx]``, ``jnp.take``,
  embeddings, ``take_along_axis``; modes clip / fill / promise_in_bounds) and
  ``dynamic_slice`` follow the plan above; the result is mapped linearly.

Every ``GatherDimensionNumbers`` form and the modes clip / fill /
promise_in_bounds are lowered with the served plan of
:mod:`~ipu_jax.lowering.indexing`. When many indices read a small table,
:mod:`~ipu_jax.lowering.small_table`'s replicated-table gather is taken
instead if its estimated time is lower. A served gather of whole rows along
the table's leading axis (an embedding lookup) is emulated tile by tile
(:func:`_rows_gather_per_tile`) in its step's ``fn``, which the
``"per_tile"`` executor runs; its logical form is the primitive.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import builders
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering import small_table
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.indexing import (GatherScatterMode, bind_fn, bits_dtype, emit_step,
                                       is_constant, pad_rows, rows_in_range, served_lookup,
                                       served_lookup_cost, static_sources, tile_blocks)


def _rows_gather_per_tile(table_storage, mapping, rows, row_len, dtype):
  """``table[rows]`` served tile by tile (``rows`` in range, ``[K]``).

  Every tile masks the requested elements to the range it holds and copies
  those; the partial results are ORed bitwise (tiles that do not hold an
  element contribute zero bits), which is exact.
  """
  bits = bits_dtype(dtype)
  chunk = mapping.row_size
  src = rows.astype(jnp.int32)[:, None] * row_len + jnp.arange(row_len, dtype=jnp.int32)
  block, num_blocks, starts, counts = tile_blocks(mapping, src.size)
  table_bits = lax.bitcast_convert_type(table_storage, bits)
  table_bits = pad_rows(table_bits, num_blocks * block).reshape(num_blocks, block, chunk)

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
          and operand.mapping.is_linear and bits_dtype(operand.dtype) is not None
          and np.issubdtype(indices.dtype, np.integer))


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
def _gather(ctx: RuleContext, operand, indices, *, dimension_numbers, slice_sizes,
            indices_are_sorted, unique_indices, mode, fill_value):
  """Gathers: the indices go to the table's tiles, which serve their rows."""
  params = dict(dimension_numbers=dimension_numbers, slice_sizes=slice_sizes,
                indices_are_sorted=indices_are_sorted, unique_indices=unique_indices,
                mode=mode, fill_value=fill_value)
  mode = GatherScatterMode.from_any(mode)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype)
  if out.size == 0:
    return [out]
  if operand.size == 0:
    # Nothing to serve (only a fill-mode gather can get here): every result
    # element is the fill value, written on its own tile.
    fill = _default_fill(out.dtype) if fill_value is None else fill_value
    elements = out.mapping.elements_per_tile(ctx.target.num_tiles)
    emit_step(ctx, f"{ctx.op}/fill", [], [out],
              lambda: (builders.storage(jnp.full(out.shape, fill, out.dtype), out),),
              compute=estimators.fill_cycles(ctx.target, elements, out.itemsize),
              vertices=builders.worker_vertices(ctx, elements), codelet=vocab.FILL)
    return [out]
  num_lookups = int(np.prod(indices.shape[:-1], dtype=np.int64))
  static = None
  if is_constant(indices):
    source_params = dict(params, fill_value=-1)
    index_value = np.asarray(indices.value)
    static = static_sources(
        lambda ids: lax.gather_p.bind(ids, jnp.asarray(index_value), **source_params),
        operand.shape)
  per_tile = None
  if _rows_form_gather(operand, indices, dimension_numbers, slice_sizes):
    fill = _default_fill(out.dtype) if fill_value is None else fill_value
    mapping, num_rows = operand.mapping, operand.shape[0]
    row_len = int(np.prod(operand.shape[1:], dtype=np.int64))
    batch_shape = tuple(indices.shape[:-1])

    def per_tile(args, storages):
      rows, valid = rows_in_range(args[1].reshape(-1), num_rows)
      served = _rows_gather_per_tile(storages[0], mapping, rows, row_len, out.dtype)
      if mode == GatherScatterMode.FILL_OR_DROP:
        served = jnp.where(valid[:, None], served, jnp.asarray(fill, out.dtype))
      return served.reshape(batch_shape + tuple(operand.shape[1:]))

  if static is None:
    replicated = small_table.ReplicatedGather(ctx, operand, indices, out.shape)
    served = served_lookup_cost(ctx, operand, [indices], out.mapping, out.itemsize)
    if replicated.feasible and (small_table.plan_seconds(ctx.target, replicated.costs)
        < small_table.plan_seconds(ctx.target, [served])):
      out = ctx.new_tensor(aval.shape, aval.dtype,
                           replicated.out_mapping(dimension_numbers.offset_dims))
      replicated.emit(bind_fn(lax.gather_p, params, [operand, indices], [out]), out,
                      codelet=vocab.MULTI_SLICE)
      return [out]
  served_lookup(ctx, lax.gather_p, params, operand, [indices], out, num_lookups,
                codelet=vocab.MULTI_SLICE, static_source=static, per_tile=per_tile)
  return [out]
