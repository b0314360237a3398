"""One row of a stacked tensor read or written at a loop counter: a scan's ``xs`` and ``ys``.

A ``scan`` reads row ``i`` of each stacked input and writes row ``i`` of each
stacked output on iteration ``i``, where ``i`` is known only on the device.
:func:`dynamic_rows_cost` prices that movement per tile (each tile's bytes
those of its busiest iteration; the index broadcast to the tiles holding the
stacked tensor, which run the dynamic-slice or dynamic-update vertices), and :func:`read_row` /
:func:`write_row` do it on tile storage from the static positions of each
row's elements (:func:`row_positions`). The scan rule in
``lowering/rules/control.py`` emits the steps.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, broadcast_cost
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["dynamic_rows_cost", "read_row", "row_positions", "write_row"]


def dynamic_rows_cost(ctx, stacked: P.Tensor, piece: P.Tensor, to_piece: bool,
                      index: P.Tensor):
  """Exchange and compute of moving row ``i`` of ``stacked`` to/from ``piece``.

  Every tile's bytes are those of its busiest iteration; the index is
  broadcast to the tiles holding ``stacked`` (they run the dynamic-slice or
  dynamic-update vertices).

  Returns:
    ``(ExchangeCost or None, compute cycles [num_tiles])``.
  """
  target = ctx.target
  t = target.num_tiles
  length, size = stacked.shape[0], piece.size
  cycles = np.zeros(t, np.float64)
  if length == 0 or size == 0:
    return None, cycles
  smap, pmap = stacked.mapping, piece.mapping
  src = smap.element_tile.reshape(length, size)
  dst = pmap.element_tile
  moved = src != dst[None, :]
  it = np.arange(length, dtype=np.int64)[:, None]

  def busiest_per_tile(rows, num_rows, tiles, mask):
    """Max over iterations of elements per row (mask selects elements)."""
    key = it * num_rows + rows
    if mask is not None:
      key = key[mask]
    key = key.reshape(-1)
    out = np.zeros(t, np.int64)
    if key.size == 0:
      return out
    if length * num_rows <= 8 * key.size + 4096:
      per_row = np.bincount(key, minlength=length * num_rows).reshape(length, num_rows).max(axis=0)
    else:
      if bool(np.all(key[1:] >= key[:-1])):
        # Linear mappings list each iteration's rows in order: count runs.
        starts = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        keys, counts = key[starts], np.diff(np.append(starts, key.size))
      else:
        keys, counts = np.unique(key, return_counts=True)
      per_row = np.zeros(num_rows, np.int64)
      np.maximum.at(per_row, keys % num_rows, counts)
    np.add.at(out, tiles, per_row)
    return out

  piece_rows = pmap.element_row[None, :]
  stacked_rows = smap.element_row.reshape(length, size)
  piece_side = busiest_per_tile(piece_rows, pmap.num_rows, pmap.tiles, moved) * piece.itemsize
  stacked_side = busiest_per_tile(stacked_rows, smap.num_rows, smap.tiles, moved) * piece.itemsize
  if to_piece:
    bytes_in, bytes_out = piece_side, stacked_side
  else:
    bytes_in, bytes_out = stacked_side, piece_side
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    per_ipu = target.tiles_per_ipu
    src_ipu, dst_ipu = (src // per_ipu), np.broadcast_to(dst // per_ipu, src.shape)
    if not to_piece:
      src_ipu, dst_ipu = dst_ipu, src_ipu
    crossing = src_ipu != dst_ipu
    if crossing.any():
      totals = np.bincount(src_ipu[crossing], minlength=target.num_ipus)[:target.num_ipus]
      link = (-(-totals // length) * piece.itemsize).astype(np.int64)
  cost = ExchangeCost(bytes_in.astype(np.int64), bytes_out.astype(np.int64), link)
  # The tiles holding the stacked tensor copy their part of the row.
  copied = busiest_per_tile(stacked_rows, smap.num_rows, smap.tiles, None)
  cycles = estimators.copy_cycles(target, copied, piece.itemsize)
  # Every tile holding the stacked tensor checks the index, even when idle.
  holders = np.zeros(t, bool)
  holders[smap.tiles] = True
  cycles = np.where(holders & (cycles == 0), target.supervisor_overhead_cycles, cycles)
  return add_costs(cost, broadcast_cost(ctx, index, smap.tiles)), cycles


def row_positions(mapping: TileMapping, length: int, size: int):
  """``[length, size]`` storage positions of each row (None when linear)."""
  if mapping.is_linear:
    return None
  return mapping.storage_position.reshape(length, size).astype(np.int32)


def read_row(stacked_storage, mapping, positions, row, size):
  flat = stacked_storage.reshape(-1)
  if positions is None:
    return lax.dynamic_slice(flat, (row * size,), (size,))
  return flat[jnp.asarray(positions)[row]]


def write_row(stacked_storage, mapping, positions, row, size, value):
  shape = stacked_storage.shape
  flat = stacked_storage.reshape(-1)
  if positions is None:
    flat = lax.dynamic_update_slice(flat, value.astype(flat.dtype), (row * size,))
  else:
    flat = flat.at[jnp.asarray(positions)[row]].set(value.astype(flat.dtype))
  return flat.reshape(shape)
