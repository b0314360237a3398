"""Dynamic sparsity's host side: bucket layouts and the encoding of a pattern.

A :class:`DynamicLayout` fixes everything the compiled program depends on: the
product's sizes, the block size, ``max_non_zeros`` (in blocks; elements for
1x1 blocks), the oversize proportion and the plan
(:func:`ipu_jax.lowering.sparse_plan.plan_dynamic`): a grid of ``px * py * pz``
tiles, each holding a bucket of ``bucket_blocks`` entries. A pattern is
*encoded* into buckets on the host (:func:`encode`, an ordinary NumPy
function whose time is recorded as host time), so a new pattern with at most
``max_non_zeros`` blocks runs the same program with no new lowering.

Encoding (as PopSparse's host-side partitioner, ``SparsePartitionerImpl``):
each non-zero belongs to the *cell* ``(x, y)`` of its block row's X band and
block column's Y band. A cell's non-zeros are dealt round-robin over the
buckets of its ``pz`` tiles. What does not fit moves on along the ring of
cells in propagation order (``x * py + y``: the other Y cells of its X band
first, then the next X bands) into the first free bucket room, as PopSparse
rebalances overflow within the Z partitions, then the Y, then the X ones.
The buckets hold ``ceil(max_non_zeros / tiles * (1 + oversize)) * tiles >=
max_non_zeros`` blocks, so every pattern of at most ``max_non_zeros``
non-zeros is placed, however it clusters; the encoding records how many
cells its farthest spill moved (:attr:`DynamicSparse.spill_distance`), and
the program's run-time propagation loop brings the buckets that far
(:mod:`ipu_jax.sparse.dynamic_rule`). More non-zeros than ``max_non_zeros``
is a :class:`BucketOverflowError` ("Overflow in buckets") with the counts —
never a silently wrong product.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels.popsparse import BLOCK_SIZES
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.sparse_plan import DEFAULT_OVERSIZE, SparsePlan, plan_dynamic
from ipu_jax.sparse.formats import BlockCSR

__all__ = ["DynamicLayout", "DynamicSparse", "BucketOverflowError", "dynamic_layout", "encode"]


class BucketOverflowError(ValueError):
  """A pattern has more non-zeros than its buckets (with spills) can hold."""


@dataclasses.dataclass(frozen=True)
class DynamicLayout:
  """What a dynamic sparse program is compiled for (hashable: a primitive parameter).

  Attributes:
    shape: ``(M, K)`` of the sparse operand; block: the block size.
    n: columns of the dense operand.
    max_non_zeros: blocks the buckets are sized for.
    oversize: extra bucket room over a uniform spread.
    num_tiles: tiles of the target it was planned for.
    plan: the :class:`SparsePlan` (grid, bucket size, phases).
  """

  shape: tuple
  block: int
  n: int
  max_non_zeros: int
  oversize: float
  num_tiles: int
  plan: SparsePlan

  @property
  def grid(self) -> tuple:
    return self.plan.grid

  @property
  def buckets(self) -> int:
    return self.plan.num_tiles

  @property
  def bucket_blocks(self) -> int:
    return self.plan.bucket_blocks

  @property
  def cells(self) -> tuple:
    """``(px, py)``."""
    return self.plan.grid[:2]

  @property
  def num_cells(self) -> int:
    """``px * py``: the cells of the propagation ring."""
    px, py = self.cells
    return px * py


def dynamic_layout(target: IPUTarget, shape, n: int, max_non_zeros: int, *, block: int = 1,
                   dtype=np.float32, oversize: float = DEFAULT_OVERSIZE,
                   available_memory_proportion: float = 0.6) -> DynamicLayout:
  """Plan buckets for a ``[M, K]`` sparse operand with at most ``max_non_zeros`` blocks.

  Raises:
    TypeError: ``target`` not an ``IPUTarget``.
    ValueError: a block PopSparse has no vertex for (``BLOCK_SIZES``), ``n``
      below 1, ``max_non_zeros`` not positive or more than the matrix's
      blocks, an oversize that is negative or not a number, an available
      memory proportion outside (0, 1], or a block that does not divide the
      shape.
  """
  if not isinstance(target, IPUTarget):
    raise TypeError(f"dynamic_layout: target must be an ipu_jax.IPUTarget (e.g. "
                    f"IPUTarget.preset('ipu2')); got {type(target).__name__}.")
  if len(tuple(shape)) != 2:
    raise ValueError(f"dynamic_layout: shape must be the sparse operand's (M, K), got "
                     f"{tuple(shape)}.")
  m, k = (int(d) for d in shape)
  if block not in BLOCK_SIZES:
    raise ValueError(f"dynamic_layout: block {block!r} has no PopSparse vertex; valid blocks "
                     f"are {list(BLOCK_SIZES)}.")
  block = int(block)
  if isinstance(n, bool) or int(n) != n or n < 1:
    raise ValueError(f"dynamic_layout: n (the dense operand's columns) must be an int >= 1, "
                     f"got {n!r}.")
  if not 0.0 < float(available_memory_proportion) <= 1.0:
    raise ValueError(f"dynamic_layout: available_memory_proportion must be in (0, 1], got "
                     f"{available_memory_proportion!r}.")
  if m % block or k % block:
    raise ValueError(f"dynamic_layout: block {block} does not divide the shape {(m, k)}.")
  total = (m // block) * (k // block)
  if int(max_non_zeros) != max_non_zeros or not 0 < int(max_non_zeros) <= max(total, 1):
    raise ValueError(f"dynamic_layout: max_non_zeros must be in 1..{total} (blocks of the "
                     f"matrix), got {max_non_zeros}.")
  if max(m, k) // block > np.iinfo(np.int16).max:
    raise ValueError(f"dynamic_layout: {max(m, k) // block} block rows or columns do not fit "
                     f"the 16-bit meta-information words (at most {np.iinfo(np.int16).max}).")
  if not float(oversize) >= 0:  # NaN too: it planned buckets of -2**63 blocks
    raise ValueError(f"dynamic_layout: oversize must be a number >= 0, got {oversize}.")
  dtype = np.dtype(dtype)
  plan = plan_dynamic(target, m, k, int(n), block, int(max_non_zeros), dtype,
                      np.float32, float(available_memory_proportion), float(oversize))
  return DynamicLayout((m, k), block, int(n), int(max_non_zeros), float(oversize),
                       target.num_tiles, plan)


@jax.tree_util.register_pytree_node_class
class DynamicSparse:
  """A pattern encoded in buckets: ``values [buckets, bucket_blocks, b, b]``,
  ``meta [buckets, bucket_blocks, 2]`` int16 (block row, block column; -1 empty).

  Both arrays are pytree leaves (run-time data); the layout is static.
  ``host_seconds`` is the encoding's host time and ``spill_distance`` how many
  cells along the propagation ring its farthest spilled block moved (the
  run-time propagation phases the pattern needs beyond the first); neither is
  carried through jit.
  """

  def __init__(self, values, meta, layout: DynamicLayout, host_seconds: float = 0.0,
               spill_distance: int = 0):
    self.values, self.meta, self.layout = values, meta, layout
    self.host_seconds, self.spill_distance = host_seconds, spill_distance

  def tree_flatten(self):
    return (self.values, self.meta), self.layout

  @classmethod
  def tree_unflatten(cls, layout, children):
    return cls(children[0], children[1], layout)

  @property
  def dtype(self):
    return self.values.dtype

  def __repr__(self):
    return (f"DynamicSparse(shape={self.layout.shape}, block={self.layout.block}, buckets="
            f"{self.layout.buckets} x {self.layout.bucket_blocks}, dtype={self.dtype})")


def _spill_order(over: np.ndarray, free: np.ndarray) -> tuple:
  """Where overflow goes: ``(ring, used)``, the cells in propagation order from the
  start cell and the overflowing blocks each of them takes in.

  Cells form a ring in propagation order (``x * py + y``: the Y cells of an X
  band, then the next band). Overflow moves forward along the ring into the
  first free room; started after the lowest prefix of ``over - free``, the
  pending overflow never has to pass the start again, so any overflow that
  fits the ring's free room in total is placed (``used`` sums to it).
  """
  cells = over.size
  start = (int(np.argmin(np.cumsum(over - free))) + 1) % cells
  ring = (start + np.arange(cells)) % cells
  prefix = np.cumsum(over[ring] - free[ring])
  # Lindley's recursion in closed form: pending = max(0, pending + over - free).
  pending = prefix - np.minimum(np.minimum.accumulate(prefix), 0)
  before = np.concatenate([[0], pending[:-1]])
  return ring, before + over[ring] - pending


def _slots(layout: DynamicLayout, cell: np.ndarray) -> tuple:
  """``(bucket, slot, spill distance)`` of every block: a cell's own buckets first,
  overflow forward along the ring of cells (:func:`_spill_order`)."""
  cells, pz, cap = layout.num_cells, layout.grid[2], layout.bucket_blocks
  room = pz * cap
  counts = np.bincount(cell, minlength=cells)
  order = np.argsort(cell, kind="stable")
  start = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.empty(cell.size, np.int64)
  rank[order] = np.arange(cell.size) - start[cell[order]]
  filled = np.minimum(counts, room)
  over, free = counts - filled, room - filled
  if over.sum() > free.sum():   # only with more blocks than the buckets' slots
    raise BucketOverflowError(
        f"Overflow in buckets: {cell.size} non-zero blocks, the {layout.buckets} buckets of "
        f"{cap} blocks hold {layout.buckets * cap} (max_non_zeros={layout.max_non_zeros}, "
        f"oversize={layout.oversize}). Raise max_non_zeros.")
  target_cell, position = cell.copy(), rank.copy()
  spilled = np.flatnonzero(rank >= room)
  if spilled.size:
    ring, used = _spill_order(over, free)
    ring_position = np.empty(cells, np.int64)
    ring_position[ring] = np.arange(cells)
    spilled = spilled[np.lexsort((rank[spilled], ring_position[cell[spilled]]))]
    # The i-th overflowing block in ring order takes the i-th free place taken in.
    targets = np.repeat(ring, used)
    first = np.repeat(np.cumsum(used) - used, used)
    target_cell[spilled] = targets
    position[spilled] = filled[targets] + np.arange(spilled.size) - first
  bucket = target_cell * pz + position % pz
  distance = int(((target_cell - cell) % cells).max()) if cell.size else 0
  return bucket, position // pz, distance


def encode(sparse: BlockCSR, layout: DynamicLayout) -> DynamicSparse:
  """Deal ``sparse``'s non-zero blocks into ``layout``'s buckets (host side).

  Raises:
    ValueError: shape, block or count do not match the layout.
    BucketOverflowError: the pattern does not fit the buckets.
  """
  started = time.perf_counter()
  pattern = sparse.pattern
  if tuple(pattern.shape) != tuple(layout.shape) or pattern.block[0] != layout.block:
    raise ValueError(f"encode: the matrix {pattern.shape} with {pattern.block} blocks does not "
                     f"match the layout's {layout.shape} with {layout.block}x{layout.block}.")
  if pattern.nnz_blocks > layout.max_non_zeros:
    raise BucketOverflowError(
        f"Overflow in buckets: the pattern has {pattern.nnz_blocks} non-zero blocks, more "
        f"than max_non_zeros={layout.max_non_zeros}.")
  rx, cy, _ = layout.plan.band
  _, py = layout.cells
  rows = pattern.row_indices.astype(np.int64)
  cols = pattern.col_indices.astype(np.int64)
  bucket, slot, distance = _slots(layout, (rows // rx) * py + cols // cy)
  cap = layout.bucket_blocks
  index = np.full((layout.buckets, cap), -1, np.int64)
  index[bucket, slot] = np.arange(rows.size)
  meta = np.full((layout.buckets, cap, 2), -1, np.int16)
  meta[bucket, slot, 0], meta[bucket, slot, 1] = rows, cols
  values = jnp.asarray(sparse.values)
  if rows.size:
    # An empty slot reads past the last block: a filled gather gives it zeros,
    # one operation (on a new shape, one compile) where padding took three.
    slots = np.where(index >= 0, index, rows.size)
    bucketed = values.at[slots].get(mode="fill", fill_value=0)
  else:
    bucketed = jnp.zeros(index.shape + values.shape[1:], values.dtype)
  return DynamicSparse(bucketed, meta, layout, time.perf_counter() - started, distance)
