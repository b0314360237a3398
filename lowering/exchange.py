"""Static exchanges: moving elements between tile layouts, and their cost.

All exchange is decided at compile time, as on the IPU: every moved element
has a known source tile and destination tile, so the bytes each tile sends and
receives are exact. The JAX side of an exchange is a gather between storage
arrays, or a pad/reshape when both layouts are linear (XLA fuses those).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.kernels.target import IPUTarget

__all__ = ["ExchangeCost", "movement_cost", "interval_movement_cost", "to_storage", "to_flat",
           "roll_tiles", "relayout", "relayout_cost", "interval_link_bytes", "relative_base", "shift_cost", "exchange_cycles", "ordered_runs",
           "take_or_fill"]


@dataclasses.dataclass
class ExchangeCost:
  """Bytes an exchange moves.

  Attributes:
    bytes_in: ``[num_tiles]`` bytes received by each tile.
    bytes_out: ``[num_tiles]`` bytes sent by each tile.
    link_bytes_out: ``[num_ipus]`` bytes each IPU sends to other IPUs.
    link_cycles: the links' time when a topology model priced it (a
      collective over an ``IPUSystem``, ``kernels/collectives.py``): it
      replaces ``link_bytes_out`` at the target's flat IPU-Link rate.
      ``None``: the flat rate.
    link_notes: how the link time was priced, for the report's notes (a
      step's notes gain them).
    bus_shared_in: ``[num_tiles]`` bytes of ``bytes_in`` a tile receives
      together with the other tiles of its exchange bus (the same bytes,
      ``IPUTarget.tiles_per_exchange_bus`` tiles receiving them in the same
      cycles), or None: none. :func:`exchange_cycles` prices them at that
      many times a tile's rate, as poplin's ExchangeEstimator prices a
      matmul's input elements.
  """

  bytes_in: np.ndarray
  bytes_out: np.ndarray
  link_bytes_out: np.ndarray
  link_cycles: float | None = None
  link_notes: tuple = ()
  bus_shared_in: np.ndarray | None = None

  @classmethod
  def zeros(cls, target: IPUTarget) -> "ExchangeCost":
    return cls(np.zeros(target.num_tiles, np.int64),
               np.zeros(target.num_tiles, np.int64),
               np.zeros(target.num_ipus, np.int64))

  def __add__(self, other: "ExchangeCost") -> "ExchangeCost":
    priced = [c for c in (self, other) if c.link_cycles is not None]
    unpriced = [c for c in (self, other) if c.link_cycles is None]
    if priced and any(int(c.link_bytes_out.sum()) for c in unpriced):
      # The sum's link time would mix a topology price with a flat one.
      raise ValueError("Cannot add an exchange priced by topology (link_cycles) to one "
                       "with IPU-Link bytes at the flat rate.")
    shared = [c.bus_shared_in for c in (self, other) if c.bus_shared_in is not None]
    return ExchangeCost(self.bytes_in + other.bytes_in,
                        self.bytes_out + other.bytes_out,
                        self.link_bytes_out + other.link_bytes_out,
                        sum(c.link_cycles for c in priced) if priced else None,
                        tuple(dict.fromkeys(self.link_notes + other.link_notes)),
                        sum(shared[1:], shared[0]) if shared else None)

  @property
  def total_bytes(self) -> int:
    return int(self.bytes_in.sum())


def movement_cost(target: IPUTarget, src_tile: np.ndarray, dst_tile: np.ndarray,
                  itemsize: int, element_id: np.ndarray | None = None) -> ExchangeCost:
  """The cost of moving elements from ``src_tile`` to ``dst_tile``.

  Args:
    target: the IPU target.
    src_tile: ``[M]`` tile each moved element comes from.
    dst_tile: ``[M]`` tile it goes to.
    itemsize: bytes per element.
    element_id: ``[M]`` identity of the source element. An element sent to
      several tiles leaves its tile once (the exchange multicasts), so a tile
      sends each distinct element once.
  """
  src_tile = np.asarray(src_tile, np.int64).reshape(-1)
  dst_tile = np.asarray(dst_tile, np.int64).reshape(-1)
  if element_id is None:
    element_id = np.arange(src_tile.size)
  element_id = np.asarray(element_id, np.int64).reshape(-1)
  moved = src_tile != dst_tile
  ids, src, dst = element_id[moved], src_tile[moved], dst_tile[moved]
  t, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  bytes_in = np.bincount(dst, minlength=t)[:t] * itemsize
  first_send = _first_occurrences(ids)
  bytes_out = np.bincount(src[first_send], minlength=t)[:t] * itemsize
  # A multicast crosses the IPU-Links once per destination IPU.
  src_ipu, dst_ipu = src // per_ipu, dst // per_ipu
  crossing = src_ipu != dst_ipu
  first_cross = _first_occurrences(ids[crossing] * n_ipus + dst_ipu[crossing])
  link = np.bincount(src_ipu[crossing][first_cross], minlength=n_ipus)[:n_ipus]
  return ExchangeCost(bytes_in.astype(np.int64), bytes_out.astype(np.int64),
                      (link * itemsize).astype(np.int64))


def _first_occurrences(keys: np.ndarray) -> np.ndarray:
  """Positions of the first occurrence of each distinct key, in key order.

  O(n) with a mark array when the keys are dense (the usual case: element
  indices), falling back to a sort for sparse keys. The callers count what
  lies at these positions (``bincount``), so the positions are not sorted:
  sorting them took 1.5 CPU s of the BERT-Large split search (cProfile; a
  2 M-key call sorts in 0.12 s, docs/performance_history.md).
  """
  if keys.size == 0:
    return np.zeros(0, np.int64)
  low, high = int(keys.min()), int(keys.max())
  span = high - low + 1
  if span > 4 * keys.size + 1024:
    return np.unique(keys, return_index=True)[1]
  first = np.full(span, keys.size, np.int64)
  # Writing positions in reverse leaves each key's first position in place.
  positions = np.arange(keys.size - 1, -1, -1)
  first[keys[::-1] - low] = positions
  return first[first < keys.size]


def _received_bytes(target: IPUTarget, cost: ExchangeCost) -> np.ndarray:
  """``[num_tiles]`` bytes each tile receives, weighed by the rate it receives them at.

  Bytes a bus's tiles receive together (``cost.bus_shared_in``) count
  ``1 / tiles_per_exchange_bus``: poplin's ExchangeEstimator
  (lib/poplin/ExchangeEstimator.hpp, getInputElementCycles) gives them that
  many times the exchange rate.
  """
  if cost.bus_shared_in is None:
    return cost.bytes_in
  bus = target.tiles_per_exchange_bus
  return cost.bytes_in - cost.bus_shared_in * (1.0 - 1.0 / bus)


def exchange_cycles(target: IPUTarget, cost: ExchangeCost | None) -> float:
  """Cycles of an exchange phase: the busiest tile, latency, IPU-Link time."""
  if cost is None:
    return 0.0
  busiest = max(_received_bytes(target, cost).max(initial=0),
                int(cost.bytes_out.max(initial=0)))
  if busiest == 0:
    return 0.0
  cycles = busiest / target.exchange_bytes_per_cycle + target.exchange_latency_cycles
  if cost.link_cycles is not None:
    return float(cycles + cost.link_cycles)
  link = int(cost.link_bytes_out.max(initial=0))
  if link:
    cycles += link / target.ipu_link_bytes_per_cycle
  return float(cycles)


# -- storage conversions (JAX, traced inside the executor) -------------------


def to_storage(flat, mapping: TileMapping):
  """Flat logical array -> ``[rows, row_size]`` tile storage."""
  rows, size = mapping.storage_shape
  if mapping.num_elements == 0:
    return jnp.zeros((rows, size), flat.dtype)
  # lax, not jnp: these run for every step's operands while the executor
  # traces, and jnp's shape and index handling was a fifth of that time.
  if mapping.is_linear:
    pad = rows * size - mapping.num_elements
    if pad:
      flat = lax.pad(flat, jnp.zeros((), flat.dtype), ((0, pad, 0),))
    return lax.reshape(flat, (rows, size))
  if mapping.grid is not None:
    return mapping.grid.to_storage(flat.reshape(mapping.grid.shape))
  return take_or_fill(flat, mapping.storage_source, 0).reshape(rows, size)


def host_storage(flat: np.ndarray, mapping: TileMapping) -> np.ndarray:
  """:func:`to_storage` of a host array, computed with NumPy.

  A program's constants are known on the host; laying them out there puts
  each element at its storage position directly, where :func:`to_storage`
  run eagerly would compile a small XLA program for every constant's shape.
  """
  rows, size = mapping.storage_shape
  storage = np.zeros(rows * size, flat.dtype)
  if mapping.num_elements:
    storage[mapping.storage_position] = flat
  return storage.reshape(rows, size)


def host_flat(storage, mapping: TileMapping) -> np.ndarray:
  """:func:`to_flat` computed with NumPy, for storage read back to the host."""
  return np.asarray(storage).reshape(-1)[mapping.storage_position]


def to_flat(storage, mapping: TileMapping):
  """``[rows, row_size]`` tile storage -> flat logical array."""
  if mapping.num_elements == 0:
    return jnp.zeros((0,), storage.dtype)
  if mapping.grid is not None:
    return mapping.grid.to_logical(storage).reshape(-1)
  flat = lax.reshape(storage, (storage.size,))
  if mapping.is_linear:
    return flat if flat.shape[0] == mapping.num_elements else lax.slice(
        flat, (0,), (mapping.num_elements,))
  return flat[mapping.storage_position]


def ordered_runs(index: np.ndarray, size: int):
  """``index``'s pattern when ``flat[index]`` (``size`` = fill) is pads and a reshape.

  That is when the taken elements are ``0 .. size - 1`` in order, in runs of
  ``count`` slots every ``stride`` slots from ``start`` (the last run may be
  shorter) with fills everywhere else: a block layout's rows, padded. The
  check is vectorised, O(len(index)).

  Returns:
    ``(start, count, stride)``, or ``None`` for any other pattern.
  """
  index = np.asarray(index).reshape(-1)
  taken = index < size
  if size == 0 or int(taken.sum()) != size or not np.array_equal(
      index[taken], np.arange(size, dtype=index.dtype)):
    return None
  edges = np.diff(taken.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
  starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
  lengths = ends - starts
  count = int(lengths[0])
  if starts.size == 1:
    return int(starts[0]), count, count
  stride = int(starts[1] - starts[0])
  if (np.all(lengths[:-1] == count) and lengths[-1] <= count
      and np.all(np.diff(starts) == stride)):
    return int(starts[0]), count, stride
  return None


def take_or_fill(flat, index: np.ndarray, fill):
  """``flat[index]``, where ``index == flat.size`` takes ``fill``, for a static ``index``.

  Runs of consecutive elements laid out as padded rows (:func:`ordered_runs`)
  are pads and a reshape, which XLA fuses into neighbouring work; anything
  else is one gather.
  """
  index = np.asarray(index)
  size = int(flat.shape[0])
  fill = jnp.asarray(fill, flat.dtype)
  runs = ordered_runs(index, size)
  if runs is None:
    ext = jnp.concatenate([flat, jnp.reshape(fill, (1,))])
    return ext[index]
  start, count, stride = runs
  rows = -(-size // count)
  x = lax.pad(flat, fill, ((0, rows * count - size, 0),))
  x = lax.pad(lax.reshape(x, (rows, count)), fill, ((0, 0, 0), (0, stride - count, 0)))
  x = lax.reshape(x, (rows * stride,))
  total = int(index.size)
  # Fills before the first run; after the last, up to the index's length.
  x = lax.pad(x, fill, ((start, max(0, total - start - rows * stride), 0),))
  return lax.reshape(lax.slice(x, (0,), (total,)), index.shape)


def relayout(storage, src: TileMapping, dst: TileMapping):
  """Move a tensor's storage from mapping ``src`` to mapping ``dst``."""
  if src.same_as(dst):
    return storage
  return to_storage(to_flat(storage, src), dst)


def relayout_cost(target: IPUTarget, src: TileMapping, dst: TileMapping,
                  itemsize: int) -> ExchangeCost | None:
  """Bytes moved when a tensor goes from ``src`` to ``dst``."""
  if src.same_as(dst) or src.num_elements == 0:
    return None
  # The same two layouts meet again (a tensor read by several steps, a fused
  # member moved where it was costed before): the placed cost is looked up.
  prints = (src.fingerprint, dst.fingerprint)
  key = None if "object" in (prints[0][0], prints[1][0]) else prints + (int(itemsize), target)
  return plan_cache.cached(_PLACED_RELAYOUTS, key,
                           lambda: _frozen(_placed_relayout_cost(target, src, dst, itemsize)))


def _placed_relayout_cost(target: IPUTarget, src: TileMapping, dst: TileMapping,
                          itemsize: int) -> ExchangeCost:
  """:func:`relayout_cost` of two layouts that differ, from the costs moved along the tiles."""
  # Repeated layers relayout between the same layouts, maybe moved along the
  # tiles: the bytes each tile sends and receives only compare tile
  # identities, so they are costed once, counted from the destination's
  # first tile, and moved into place. The IPU-Link bytes do depend on where
  # the IPUs' boundaries fall: on several IPUs they are counted afresh, on
  # runs of whole IPUs (a few per tensor, not one per tile).
  base = int(dst.tiles[0]) if dst.num_rows else 0
  t = target.num_tiles
  key = (src.relative_fingerprint(base, t), dst.relative_fingerprint(base, t), int(itemsize),
         target)
  fresh = []

  def relative():
    fresh.append(interval_movement_cost(target, src, dst, itemsize))
    return _frozen(shift_cost(_tile_bytes(fresh[0]), -base))

  relative = plan_cache.cached(_RELAYOUTS, key, relative)
  if fresh:  # counted here, IPU-Link bytes included: nothing to move or recount
    return fresh[0]
  moved = shift_cost(relative, base)
  if target.num_ipus == 1:
    return moved
  return ExchangeCost(moved.bytes_in, moved.bytes_out,
                      interval_link_bytes(target, src, dst, itemsize))


def _tile_bytes(cost: ExchangeCost) -> ExchangeCost:
  """``cost`` without its IPU-Link bytes (zeros: they are not moved with the tiles)."""
  return ExchangeCost(cost.bytes_in, cost.bytes_out, np.zeros_like(cost.link_bytes_out))


def interval_link_bytes(target: IPUTarget, src: TileMapping, dst: TileMapping,
                        itemsize: int) -> np.ndarray:
  """``[num_ipus]`` IPU-Link bytes of :func:`interval_movement_cost`, on runs of whole IPUs.

  An element crosses a link when the IPU holding it in ``src`` is not the one
  holding it in ``dst``: the overlaps of the two tensors' IPU runs give the
  same sums as their tile runs, in time proportional to the IPU runs.
  """
  per, n_ipus = target.tiles_per_ipu, target.num_ipus
  s_starts, s_ipus = src.ipu_runs(per)
  d_starts, d_ipus = dst.ipu_runs(per)
  bounds, in_s, in_d = _merged_runs(s_starts, d_starts)
  lengths = np.diff(np.append(bounds, src.num_elements))
  s, d = s_ipus[in_s], d_ipus[in_d]
  crossing = s != d
  link = np.bincount(s[crossing], weights=lengths[crossing], minlength=n_ipus)[:n_ipus]
  return link.astype(np.int64) * itemsize


def relative_base(target: IPUTarget, tile: int) -> int:
  """Where costs of layouts moved along the tiles are counted from, for ``tile``.

  On one IPU, ``tile`` itself: an exchange's bytes per tile only compare tile
  identities, so a layout moved by ``k`` tiles costs the same, moved by ``k``.
  On several IPUs, the first tile of ``tile``'s IPU: a move by whole IPUs
  keeps which tiles share an IPU, so the IPU-Link bytes move along with the
  tiles (a layer on IPU 3 costs what the same layer on IPU 0 does, three
  IPUs along), while any other move could change which bytes cross a link.
  """
  tile = int(tile)
  if target.num_ipus == 1:
    return tile
  per = target.tiles_per_ipu
  return tile - tile % per


def roll_tiles(a: np.ndarray, shift: int) -> np.ndarray:
  """``np.roll(a, shift)`` of a 1-D per-tile (or per-IPU) array, as two slice copies.

  Every equation on a layout moved along the tiles rolls its cached figures
  into place; ``np.roll``'s generic axis handling cost four times the copy on
  ``[num_tiles]`` arrays (tens of thousands of calls per program).
  """
  n = a.shape[0]
  shift = shift % n if n else 0
  out = np.empty_like(a)
  if shift == 0:
    out[...] = a
    return out
  out[shift:] = a[:n - shift]
  out[:shift] = a[n - shift:]
  return out


def shift_cost(cost: ExchangeCost | None, tiles: int,
               tiles_per_ipu: int | None = None) -> ExchangeCost | None:
  """``cost`` with every tile ``t``'s bytes moved to tile ``t + tiles`` (cyclically).

  To reuse a cost found for a layout moved along the tiles (see
  :func:`relative_base`). With several IPUs the move must be by whole IPUs
  (``tiles_per_ipu`` given): IPU ``i``'s IPU-Link bytes then move to IPU
  ``i + tiles // tiles_per_ipu``.

  Raises:
    ValueError: a cost with IPU-Link bytes moved by a number of tiles that
      is not a multiple of ``tiles_per_ipu`` (a cost without any may move
      by any number of tiles).
  """
  if cost is None or tiles == 0:
    return cost
  link = cost.link_bytes_out
  if link.size > 1 and link.any():
    if not tiles_per_ipu or tiles % tiles_per_ipu:
      raise ValueError(f"shift_cost: a cost over {link.size} IPUs moved by {tiles} tiles, "
                       f"not a multiple of tiles_per_ipu={tiles_per_ipu}")
    link = roll_tiles(link, tiles // tiles_per_ipu)
  shared = cost.bus_shared_in
  if shared is not None and tiles % 2:
    # Bus pairs are tiles (2j, 2j + 1): an odd move would pair other tiles.
    raise ValueError(f"shift_cost: a cost with bytes shared by exchange-bus pairs moved by "
                     f"{tiles} tiles, an odd number")
  return ExchangeCost(roll_tiles(cost.bytes_in, tiles), roll_tiles(cost.bytes_out, tiles), link,
                      bus_shared_in=None if shared is None else roll_tiles(shared, tiles))


_RELAYOUTS = plan_cache.PlanCache("relayout costs", max_entries=4096)
_PLACED_RELAYOUTS = plan_cache.PlanCache("placed relayout costs", max_entries=4096)


def _frozen(cost: ExchangeCost) -> ExchangeCost:
  """``cost`` with read-only arrays: a cached cost is shared, never edited."""
  for a in (cost.bytes_in, cost.bytes_out, cost.link_bytes_out):
    a.setflags(write=False)
  return cost


def _merged_runs(a: np.ndarray, b: np.ndarray) -> tuple:
  """The pieces two sorted, duplicate-free run-start lists cut a tensor into.

  Returns:
    ``(bounds, in_a, in_b)``: the union of the starts, and for each the run
    of ``a`` and of ``b`` it lies in (the last start at or before it).

  One stable argsort of the two lists side by side (timsort finds the two
  runs: a merge) gives both: counting the entries of each list up to every
  position, and keeping the last of equal starts, gives the run each piece
  lies in, without a binary search of either list per piece.
  """
  merged = np.concatenate([a, b])
  order = np.argsort(merged, kind="stable")
  merged = merged[order]
  in_a = np.cumsum(order < a.size) - 1
  # The entries of b up to position i are the rest of the i + 1.
  in_b = np.arange(merged.size) - in_a - 1
  keep = np.ones(merged.size, bool)
  keep[:-1] = merged[1:] != merged[:-1]
  if keep.all():
    return merged, in_a, in_b
  kept = np.flatnonzero(keep)  # one pass for the three arrays
  return merged[kept], in_a[kept], in_b[kept]


def _pieces(src: TileMapping, dst: TileMapping) -> tuple:
  """``(src_tiles, dst_tiles, lengths)`` of the pieces where a run of ``src``
  overlaps a run of ``dst``.

  Two linear mappings with equal rows (the same tensor laid out from other
  tiles, as a layer's activations and residuals often are) share every run
  boundary: the pieces are their rows, with no merge.
  """
  if (src.is_linear and dst.is_linear and src.chunk == dst.chunk
      and src.num_rows == dst.num_rows):
    return src.tiles, dst.tiles, src.counts
  s_starts, s_tiles = src.intervals
  d_starts, d_tiles = dst.intervals
  bounds, in_s, in_d = _merged_runs(s_starts, d_starts)
  lengths = np.diff(np.append(bounds, src.num_elements))
  return s_tiles[in_s], d_tiles[in_d], lengths


def interval_movement_cost(target: IPUTarget, src: TileMapping, dst: TileMapping,
                           itemsize: int) -> ExchangeCost:
  """:func:`movement_cost` of every element from ``src`` to ``dst``, by intervals.

  Each element moves at most once (no multicast), so the cost is a sum over
  the pieces where a run of ``src`` overlaps a run of ``dst``: merging the
  two sorted run lists takes time proportional to the runs, not elements.
  """
  s, d, lengths = _pieces(src, dst)
  t, n_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  # Pieces that stay weigh nothing (cheaper than selecting the rest).
  moved = np.where(s != d, lengths, 0)
  bytes_in = np.bincount(d, weights=moved, minlength=t)[:t]
  bytes_out = np.bincount(s, weights=moved, minlength=t)[:t]
  link = np.zeros(n_ipus)
  if n_ipus > 1:  # on one IPU nothing crosses (and a piece that stays never does)
    s_ipu = s // per_ipu
    link = np.bincount(s_ipu, weights=np.where(s_ipu != d // per_ipu, lengths, 0),
                       minlength=n_ipus)[:n_ipus]
  # Weighted bincounts are float64: exact for any tensor below 2**53 bytes.
  return ExchangeCost((bytes_in.astype(np.int64) * itemsize),
                      (bytes_out.astype(np.int64) * itemsize),
                      (link.astype(np.int64) * itemsize))
