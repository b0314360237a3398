"""A matmul operand's exchange onto its grid, costed exactly and cached by relative layout.

An :class:`OperandExchange` is one operand of one pass as
:func:`~ipu_jax.lowering.matmul_grid.operand_exchange_cost` takes it (the
operand's canonical view, the grid, its tiles and which blocks need which
positions). :func:`operand_cost` caches its ``(cost, local)`` in
``plan_cache`` keyed by layouts counted from the grid's first tile (its IPU's
first tile on several IPUs, :func:`~ipu_jax.lowering.exchange.relative_base`),
so a repeated layer whose grid landed further along the tiles, or on another
IPU, reuses the first layer's bytes moved along; on several IPUs the tile
bytes are kept relative and only the IPU-Link bytes are counted afresh.
``lowering/matmul_emit.py`` builds the exchanges of each pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import relative_base, shift_cost
from ipu_jax.lowering.mapping import tiles_key
from ipu_jax.lowering.matmul_grid import operand_exchange_cost, operand_link_bytes

__all__ = ["OperandExchange", "blocks_of", "operand_cost"]


_GRID_COSTS = plan_cache.PlanCache("matmul operand exchange", max_entries=4096)


def _frozen_grid_cost(result):
  """A cached ``(cost, local)`` pair, made read-only since it is shared."""
  cost, local = result
  arrays = [local] + ([] if cost is None else [cost.bytes_in, cost.bytes_out,
                                               cost.link_bytes_out])
  if cost is not None and cost.bus_shared_in is not None:
    arrays.append(cost.bus_shared_in)
  for a in arrays:
    a.setflags(write=False)
  return cost, local


def operand_cost(target, key: tuple, exchange: "OperandExchange"):
  """``(cost, local)`` of an operand's exchange, cached.

  The bytes depend only on which tile holds what (and, on several IPUs,
  which IPU), so the key counts tile ids from the grid's first tile (its
  IPU's first tile on several IPUs: :func:`~ipu_jax.lowering.exchange.relative_base`):
  a repeated layer whose grid and operand landed further along the tiles, or
  on another IPU, reuses the first layer's cost, moved along by as many tiles.
  On several IPUs a layer seldom lands a whole number of IPUs along, so the
  bytes in and out are also kept counted from the grid's first tile, and
  only the IPU-Link bytes are counted afresh (:func:`_tile_relative_cost`).
  """
  t, per = target.num_tiles, target.tiles_per_ipu
  operand, tiles = exchange.tensor, exchange.tiles
  base = relative_base(target, tiles[0])
  layout = (operand.shape, operand.itemsize, target)
  ipu_key = key + (operand.mapping.relative_fingerprint(base, t), tiles_key((tiles - base) % t))

  def relative():
    if target.num_ipus == 1:
      cost, local = exchange.cost(target)
    else:
      cost, local = _tile_relative_cost(target, key + layout, exchange)
    return _frozen_grid_cost((shift_cost(cost, -base, per), local))

  cost, local = plan_cache.cached(_GRID_COSTS, ipu_key + layout, relative)
  return shift_cost(cost, base, per), local


_TILE_COSTS = plan_cache.PlanCache("matmul operand tile bytes", max_entries=4096)


def _tile_relative_cost(target, key: tuple, exchange: "OperandExchange") -> tuple:
  """``(cost, local)`` on several IPUs, its tile bytes cached from the grid's first tile.

  The bytes each tile sends and receives compare only tile identities (as on
  one IPU); the IPU-Link bytes are counted for this placement
  (:meth:`OperandExchange.link_bytes`, given what each tile sends), or the
  whole exchange is costed where intervals cannot count them.
  """
  t, tiles = target.num_tiles, exchange.tiles
  first = int(tiles[0])
  key = key + ("tile bytes", exchange.tensor.mapping.relative_fingerprint(first, t),
               tiles_key((tiles - first) % t))
  fresh = []

  def tile_bytes():
    cost, local = exchange.cost(target)
    fresh.append(cost)
    return _frozen_grid_cost((shift_cost(_without_link(cost), -first), local))

  cost, local = plan_cache.cached(_TILE_COSTS, key, tile_bytes)
  if fresh:
    return fresh[0], local
  cost = shift_cost(cost, first)
  if cost is None:
    return None, local
  itemsize = exchange.tensor.itemsize
  link = exchange.link_bytes(target, cost.bytes_out // itemsize)
  if link is None:
    return exchange.cost(target)
  return dataclasses.replace(cost, link_bytes_out=link), local


def _without_link(cost):
  """``cost`` with zero IPU-Link bytes (they do not move with the tiles)."""
  if cost is None:
    return None
  return dataclasses.replace(cost, link_bytes_out=np.zeros_like(cost.link_bytes_out))


def blocks_of(size, block_size):
  """Per position along a dimension: the one block needing it, ``[lo, lo + 1)``."""
  lo = np.arange(size, dtype=np.int64) // block_size
  return lo, lo + 1


@dataclasses.dataclass(frozen=True)
class OperandExchange:
  """One operand's exchange of a pass, as ``operand_exchange_cost`` takes it.

  Attributes:
    tensor, perm, canon_shape, groups: the operand and its canonical view.
    grid, tiles, needs: the grid, its tiles and which blocks need what.
    elements: elements of each grid tile's block.
    window: the ``(start, stop)`` taken of each canonical axis.
    bus_shared: count the bytes exchange-bus pairs receive together (the
      A operand, poplin's input elements; see
      :func:`~ipu_jax.lowering.matmul_grid.bus_shared_bytes`).
  """

  tensor: P.Tensor
  perm: tuple
  canon_shape: tuple
  groups: tuple
  grid: tuple
  tiles: np.ndarray
  needs: list
  elements: int
  window: tuple
  bus_shared: bool = False

  def cost(self, target) -> tuple:
    """``(cost, local)`` of the exchange."""
    return operand_exchange_cost(target, self.tensor, self.perm, self.canon_shape, self.groups,
                                 self.grid, self.tiles, self.needs, self.elements, self.window,
                                 self.bus_shared)

  def link_bytes(self, target, sent):
    """Its IPU-Link bytes alone, given what each tile sends (None: cost it whole)."""
    return operand_link_bytes(target, self.tensor, self.perm, self.canon_shape, self.groups,
                              self.grid, self.tiles, self.needs, sent, self.window)
