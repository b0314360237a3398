"""Static copies planned element by element, for maps whose rows are short.

A movement whose map has short runs (a strided slice or reversal of the
innermost axis, an index array) is planned here on its elements rather than
by regions (``lowering/copy_plan.py``): :func:`plan_elements` finds each
output element's source tile (:func:`element_tiles`) and, through
:func:`exchange_plan`, the exchange bytes per tile (an element needed on
several tiles crosses once per destination tile: a multicast), the IPU-Link
bytes, and the copies and fills each tile runs; the figures are the same as
the region planner's where both apply. Returns a
:class:`~ipu_jax.lowering.copy_plan.CopyPlan` and the per-element gathers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.copy_plan import CopyPlan, index_dtype

__all__ = ["element_tiles", "exchange_plan", "plan_elements"]


def element_tiles(mapping: TileMapping, dtype=None) -> np.ndarray:
  """The tile of every element, from the mapping's runs (as ``dtype`` if given).

  Unlike ``TileMapping.element_tile`` this is not cached on the mapping
  (8 bytes per element for the mapping's lifetime): a movement needs it only
  while it is planned.
  """
  starts, tiles = mapping.intervals
  if dtype is not None:
    tiles = tiles.astype(dtype)
  return np.repeat(tiles, np.diff(np.append(starts, mapping.num_elements)))


def plan_elements(target, sources: Sequence[TileMapping], outputs: Sequence, itemsize: int,
                  one_to_one: bool = False):
  """``(CopyPlan, gathers)`` of a static copy planned element by element.

  Args:
    target: the IPU target.
    sources: the source tensors' mappings (their elements concatenated are
      the source positions).
    outputs: ``[(mapping, index)]``: ``index`` is the ``[size]`` source of
      every output element, ``-1`` for fill.
    itemsize: bytes per element.
    one_to_one: no source element is copied twice (see :func:`exchange_plan`).

  Returns:
    The :class:`CopyPlan` and, per output, the gather indices into the
    sources with ``num_sources`` (the fill slot) for fill (``None`` for an
    empty output).
  """
  num_tiles = target.num_tiles
  source_tiles = (np.concatenate([element_tiles(m) for m in sources])
                  if sources else np.zeros(0, np.int64))
  num_sources = int(source_tiles.size)
  gathers, all_src, all_dst, fill_dst = [], [], [], []
  for mapping, index in outputs:
    if mapping.num_elements == 0:
      gathers.append(None)
      continue
    dst_tile = element_tiles(mapping)
    real = index >= 0
    if real.all():  # the common case: skip the masked copies
      all_src.append(index)
      all_dst.append(dst_tile)
      gathers.append(index)
      continue
    all_src.append(index[real])
    all_dst.append(dst_tile[real])
    fill_dst.append(dst_tile[~real])
    gathers.append(np.where(real, index, num_sources).astype(index_dtype(num_sources + 1)))
  src = np.concatenate(all_src) if len(all_src) != 1 else all_src[0]
  dst = np.concatenate(all_dst) if len(all_dst) != 1 else all_dst[0]
  cost, received = exchange_plan(target, source_tiles, src, dst, itemsize, one_to_one)
  # Elements not written straight by the exchange are copied on their tile.
  copies = np.bincount(dst, minlength=num_tiles)[:num_tiles] - received
  fills = np.bincount(np.concatenate(fill_dst + [np.zeros(0, np.int64)]),
                      minlength=num_tiles)[:num_tiles]
  return CopyPlan(cost, received, copies, fills), gathers


def _sorted_unique(key: np.ndarray) -> np.ndarray:
  """``np.unique(key)``: a mark table when the keys are dense, else a sort."""
  low, high = int(key.min()), int(key.max())
  span = high - low + 1
  if span <= 8 * key.size + (1 << 20):
    marks = np.zeros(span, bool)
    marks[key - low] = True
    return np.flatnonzero(marks) + low
  key = np.sort(key)
  return key[np.concatenate([[True], key[1:] != key[:-1]])]


def exchange_plan(target, source_tiles: np.ndarray, source: np.ndarray,
                  dst_tile: np.ndarray, itemsize: int, one_to_one: bool = False):
  """Exchange bytes of a static copy, with multicasts, and what each tile gets.

  Args:
    target: the IPU target.
    source_tiles: ``[S]`` tile of every source element.
    source: ``[M]`` source element of every copied output element.
    dst_tile: ``[M]`` tile of every copied output element.
    itemsize: bytes per element.
    one_to_one: the caller knows no source element is copied twice (a
      permutation, slice...), which skips the deduplication.

  Returns:
    ``(cost, received)``: the :class:`ExchangeCost` (``None`` when nothing
    moves) and ``[num_tiles]`` elements each tile receives. A tile receives
    a source element once however many of its output elements copy it; a
    tile sends each element once however many tiles need it; an element
    crosses the IPU-Links once per destination IPU. For one-to-one copies
    this equals :func:`~ipu_jax.lowering.exchange.movement_cost`.
  """
  num_tiles = target.num_tiles
  n_ipus, per_ipu = target.num_ipus, target.tiles_per_ipu
  source_tiles = np.asarray(source_tiles)
  src_tile = source_tiles[source]
  moved = src_tile != dst_tile
  if not moved.any():
    return None, np.zeros(num_tiles, np.int64)
  link = np.zeros(n_ipus, np.int64)
  if one_to_one:
    from_tile, dst = src_tile[moved], dst_tile[moved]
    received = np.bincount(dst, minlength=num_tiles)[:num_tiles].astype(np.int64)
    bytes_out = np.bincount(from_tile, minlength=num_tiles)[:num_tiles]
    if n_ipus > 1:
      src_ipu, dst_ipu = from_tile // per_ipu, dst // per_ipu
      link = np.bincount(src_ipu[src_ipu != dst_ipu], minlength=n_ipus)[:n_ipus]
    return ExchangeCost(received * itemsize, bytes_out.astype(np.int64) * itemsize,
                        link.astype(np.int64) * itemsize), received
  src, dst = source[moved], dst_tile[moved]
  # Deduplicate (source, destination tile) pairs, only among sources used
  # more than once, so copies of distinct elements never pay for a sort.
  uses = np.bincount(src, minlength=source_tiles.size)
  repeated = uses[src] > 1
  if repeated.any():
    key = src[repeated].astype(np.int64) * num_tiles + dst[repeated]
    # Runs of one element on one tile are common: drop them before sorting.
    key = key[np.concatenate([[True], key[1:] != key[:-1]])]
    key = _sorted_unique(key)
    src = np.concatenate([src[~repeated], (key // num_tiles).astype(src.dtype)])
    dst = np.concatenate([dst[~repeated], key % num_tiles])
  received = np.bincount(dst, minlength=num_tiles)[:num_tiles].astype(np.int64)
  sent = np.zeros(source_tiles.size, bool)
  sent[src] = True
  bytes_out = np.bincount(source_tiles[sent], minlength=num_tiles)[:num_tiles]
  if n_ipus > 1:
    src_ipu, dst_ipu = source_tiles[src] // per_ipu, dst // per_ipu
    crossing = src_ipu != dst_ipu
    if crossing.any():
      marks = np.zeros((source_tiles.size, n_ipus), bool)
      marks[src[crossing], dst_ipu[crossing]] = True
      per_source = marks.sum(axis=1)
      link = np.bincount(source_tiles // per_ipu, weights=per_source,
                         minlength=n_ipus)[:n_ipus].astype(np.int64)
  cost = ExchangeCost(received * itemsize, bytes_out.astype(np.int64) * itemsize,
                      link * itemsize)
  return cost, received
