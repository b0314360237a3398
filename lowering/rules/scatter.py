"""Scatters: ``scatter`` / ``scatter-add`` / ``-mul`` / ``-min`` / ``-max`` / ``-sub``.

* ``scatter`` / ``scatter-add`` / ``scatter_mul`` / ``scatter_min`` /
  ``scatter_max`` / ``scatter_sub`` (``.at[].set/add/...`` and the gradients of
  gathers) and ``dynamic_update_slice``: the result keeps the operand's
  mapping (updated in place), the indices are broadcast to its tiles and each
  table tile accumulates the updates whose indices fall in its range — the
  gradient of an embedding lookup.

The served plan is that of :mod:`~ipu_jax.lowering.indexing`; when many
updates go to a small table, :mod:`~ipu_jax.lowering.small_table`'s
partial-table scatter (reduced in a tree) is taken instead if its estimated
time is lower. A served scatter of whole rows is emulated tile by tile
(:func:`_rows_scatter_per_tile`) in its step's ``fn``, which the
``"per_tile"`` executor runs; its logical form is the primitive.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import builders
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering import small_table
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.indexing import (GatherScatterMode, copy_of, rows_in_range, served_update,
                                       served_update_cost, tile_blocks)

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
  block, _, starts, counts = tile_blocks(mapping, dest.size)
  combine = _COMBINE[name]

  def tile(args):
    row, start, count = args
    local = dest - start
    hit = valid[:, None] & (local >= 0) & (local < count)
    pos = jnp.where(hit, local, chunk).reshape(-1)  # ``chunk`` is dropped
    return combine(row, pos, upd)

  num = mapping.num_rows
  return lax.map(tile, (op_storage, starts[:num], counts[:num]), batch_size=block)


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


# -- scatter rules ------------------------------------------------------------


def _scatter_rule(prim, codelet, cycles_per_vector, counts_flops):
  name = prim.name

  def rule(ctx: RuleContext, operand, indices, updates, *, dimension_numbers, indices_are_sorted,
           unique_indices, mode, update_jaxpr, update_consts):
    params = dict(dimension_numbers=dimension_numbers,
                  indices_are_sorted=indices_are_sorted, unique_indices=unique_indices,
                  mode=mode, update_jaxpr=update_jaxpr, update_consts=update_consts)
    if operand.size == 0:
      return [ctx.like(operand)]
    if updates.size == 0:
      return copy_of(ctx, operand)
    out = ctx.like(operand)
    num_lookups = int(np.prod(indices.shape[:-1], dtype=np.int64))
    per_tile = None
    if (name in _COMBINE
        and (name != "scatter" or update_jaxpr is None)
        and _rows_form_scatter(operand, indices, updates, dimension_numbers)):
      clip = GatherScatterMode.from_any(mode) == GatherScatterMode.CLIP
      mapping, num_rows = operand.mapping, operand.shape[0]
      row_len = int(np.prod(operand.shape[1:], dtype=np.int64))

      def per_tile(args, storages):
        rows, valid = rows_in_range(args[1].reshape(-1), num_rows)
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
            ctx.target, [served_update_cost(ctx, operand, [indices], updates)])):
      partials.emit(params, out)
      return [out]
    flops = updates.size if counts_flops and np.issubdtype(updates.dtype, np.inexact) else 0
    served_update(ctx, prim, params, [operand, indices, updates], operand, [indices],
                  updates, out, num_lookups,
                  codelet=codelet, cycles_per_vector=cycles_per_vector, flops=flops,
                  per_tile=per_tile)
    return [out]

  return rule


_SCATTERS = (
    (lax.scatter_p, vocab.MULTI_UPDATE, 1.0, False),
    (lax.scatter_add_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "add"), 2.0, True),
    (lax.scatter_mul_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "mul"), 2.0, True),
    (lax.scatter_min_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "min"), 2.0, True),
    (lax.scatter_max_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "max"), 2.0, True),
    (lax.scatter_sub_p, vocab.vertex(vocab.MULTI_UPDATE_OP, "sub"), 2.0, True),
)

for _prim, _codelet, _cycles, _flops in _SCATTERS:
  register_lowering(_prim, _scatter_rule(_prim, _codelet, _cycles, _flops))
