"""Tile mappings: which tile holds each element of a tensor.

A mapping also fixes the tensor's *storage*: a ``[rows, row_size]`` array with
one row per tile that holds elements (the tile axis), elements in flattened
order within a row, zero-padded to the longest row. Compute phases ``vmap``
over that leading axis.

Linear mappings (equal contiguous chunks on consecutive tiles, as
``poputil::mapTensorLinearly`` makes) are the common, fast case: their storage
is a pad + reshape of the flat array, so moving between them needs no gather.
"""

from __future__ import annotations

import functools
import itertools
from typing import Optional

import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.block_grid import BlockGrid

__all__ = ["TileMapping", "blocks_on_tiles", "linear_chunk", "row_runs", "spread_runs",
           "tiles_key"]

_object_ids = itertools.count()
# Small on purpose: deriving these arrays costs about what reading them does,
# so a larger table bought no lowering time on the scale rows, only memory.
_ELEMENT_ARRAYS = plan_cache.PlanCache("element_arrays", max_bytes=64 << 20)
# Row arrays (tiles, counts, run starts) of linear mappings, shared read-only:
# a model has thousands of tensors laid out alike, and each holding its own
# copies was a large part of a lowered BERT-base program's host memory.
_ROW_ARRAYS = plan_cache.PlanCache("linear row arrays", max_bytes=64 << 20, max_entries=4096)


def _shared_rows(key: tuple, compute) -> np.ndarray:
  def frozen():
    value = np.ascontiguousarray(compute(), dtype=np.int64)
    value.flags.writeable = False
    return value
  return plan_cache.cached(_ROW_ARRAYS, key, frozen)


def tiles_key(tiles: np.ndarray) -> tuple:
  """A short key for a row-tile array: its length, ends and a 64-bit hash of it.

  Plan-cache keys hold this, not the array's bytes: a key per mapping of
  8 bytes per row (11,776 rows on 8 IPUs) held by thousands of cache entries
  and mappings was hundreds of megabytes. Two distinct arrays of one length
  and ends share a key with odds of 2**-64 (a lowering compares thousands).
  """
  tiles = np.ascontiguousarray(tiles, dtype=np.int64)
  if tiles.size == 0:
    return (0,)
  return (tiles.size, int(tiles[0]), int(tiles[-1]), hash(tiles.tobytes()))


def blocks_on_tiles(num_tiles: int, tiles: np.ndarray, items: int, per_block: int) -> np.ndarray:
  """``[num_tiles]`` items each tile holds when ``items`` are cut into blocks of
  ``per_block`` (the last one shorter), block ``g`` on ``tiles[g]``."""
  on_tile = np.zeros(num_tiles, np.int64)
  if len(tiles):
    counts = np.full(len(tiles), per_block, np.int64)
    counts[-1] = items - per_block * (len(tiles) - 1)
    np.add.at(on_tile, tiles, counts)
  return on_tile


def linear_chunk(num_elements: int, num_tiles: int, itemsize: int,
                 grain_bytes: int = 8, min_bytes_per_tile: int = 128,
                 max_tiles: Optional[int] = None) -> int:
  """Elements per tile for a linear mapping, like ``mapTensorLinearly``.

  The flattened tensor is cut into grains (``grain_bytes`` wide: 2 floats or 4
  halves) spread evenly, with at least ``min_bytes_per_tile`` on each tile so
  small tensors occupy few tiles.
  """
  grain = max(1, grain_bytes // itemsize)
  min_elements = max(grain, -(-min_bytes_per_tile // itemsize))
  tiles = num_tiles if max_tiles is None else max(1, min(num_tiles, max_tiles))
  per_tile = -(-num_elements // tiles)
  per_tile = -(-per_tile // grain) * grain
  return max(per_tile, -(-min_elements // grain) * grain, 1)


def row_runs(element_row: np.ndarray) -> tuple:
  """``(starts, rows)``: runs of equal ``element_row`` along the flattened tensor."""
  change = np.flatnonzero(element_row[1:] != element_row[:-1]) + 1
  starts = np.concatenate([np.zeros(1, np.int64), change.astype(np.int64)])
  return starts, element_row[starts]


def spread_runs(values: np.ndarray, starts: np.ndarray, num: int) -> np.ndarray:
  """``values[i]`` on ``[starts[i], starts[i + 1])`` (the last to ``num``).

  ``starts`` is strictly increasing from 0. What ``np.repeat`` by the run
  lengths gives, by a cumulative sum of the steps: several times faster on
  the millions of elements of a vocabulary-sized tensor.
  """
  out = np.zeros(num, np.int64)
  if num:
    out[0] = values[0]
    out[starts[1:]] = np.diff(values)
    np.cumsum(out, out=out)
  return out


class TileMapping:
  """Which tile holds each element of a flattened tensor, and its storage.

  Build one with :meth:`linear`, :meth:`single` or :meth:`from_element_tiles`.

  Attributes:
    num_elements: elements of the flattened tensor.
    tiles: ``[rows]`` tile id of each storage row (unique).
    counts: ``[rows]`` elements in each row.
    chunk: for linear mappings, the elements per row (row ``r`` holds elements
      ``[r * chunk, (r + 1) * chunk)``); ``None`` for general mappings.
    grid: for general mappings that are a regular :class:`BlockGrid`, that
      grid (storage conversions are then reshapes, not gathers).
    row_runs: optionally, for general mappings, ``(starts, rows)``: the
      flattened tensor as runs of one storage row each (run ``i`` starts at
      ``starts[i]`` and lies in row ``rows[i]``). It does not depend on the
      row tiles, so mappings of one layout on other tiles share it, and
      :attr:`intervals` is then found without touching elements.
  """

  def __init__(self, num_elements: int, tiles: np.ndarray, counts: np.ndarray,
               chunk: Optional[int] = None,
               element_row: Optional[np.ndarray] = None,
               element_offset: Optional[np.ndarray] = None,
               grid: Optional[BlockGrid] = None,
               row_runs: Optional[tuple] = None):
    self.num_elements = int(num_elements)
    self.tiles = np.asarray(tiles, dtype=np.int64)
    self.counts = np.asarray(counts, dtype=np.int64)
    self.chunk = chunk
    # A general mapping with a regular block structure: storage conversions
    # use its reshapes instead of gathers, and its per-element layout is its
    # closed form (BlockGrid.element_layout), so it is not held here.
    self.grid = grid
    if grid is not None:
      element_row = element_offset = None
    self._element_row = element_row
    self._element_offset = element_offset
    self._row_runs = row_runs

  # -- constructors ---------------------------------------------------------

  @classmethod
  def linear(cls, num_elements: int, num_tiles: int, itemsize: int, *,
             start_tile: int = 0, grain_bytes: int = 8,
             min_bytes_per_tile: int = 128,
             max_tiles: Optional[int] = None) -> "TileMapping":
    """Equal contiguous chunks on consecutive tiles from ``start_tile``."""
    if num_elements == 0:
      return cls(0, np.zeros(0, np.int64), np.zeros(0, np.int64), chunk=1)
    chunk = linear_chunk(num_elements, num_tiles, itemsize, grain_bytes,
                         min_bytes_per_tile, max_tiles)
    return cls.blocks(num_elements, chunk, num_tiles, start_tile)

  @classmethod
  def blocks(cls, num_elements: int, chunk: int, num_tiles: int,
             start_tile: int = 0) -> "TileMapping":
    """Chunks of ``chunk`` elements on tiles ``start_tile, start_tile+1, ...``."""
    rows = -(-num_elements // chunk) if num_elements else 0
    if rows > num_tiles:
      raise ValueError(f"{rows} chunks of {chunk} do not fit on {num_tiles} tiles")
    tiles = _shared_rows(("tiles", rows, start_tile % max(num_tiles, 1), num_tiles),
                         lambda: (start_tile + np.arange(rows)) % num_tiles)
    last = num_elements - chunk * (rows - 1) if rows else 0

    def counts():
      value = np.full(rows, chunk, np.int64)
      if rows:
        value[-1] = last
      return value
    mapping = cls(num_elements, tiles, _shared_rows(("counts", rows, chunk, last), counts),
                  chunk=chunk)
    # Moved along the tiles it is the same kind of run: relative keys need no new array.
    mapping._consecutive = (start_tile % max(num_tiles, 1), num_tiles)
    return mapping

  @classmethod
  def single(cls, num_elements: int, tile: int) -> "TileMapping":
    """Every element on one tile."""
    if num_elements == 0:
      return cls(0, np.zeros(0, np.int64), np.zeros(0, np.int64), chunk=1)
    return cls(num_elements, np.array([tile]), np.array([num_elements]),
               chunk=num_elements)

  @classmethod
  def from_element_tiles(cls, element_tile: np.ndarray) -> "TileMapping":
    """A mapping from the tile of every element (any pattern)."""
    element_tile = np.asarray(element_tile, dtype=np.int64).reshape(-1)
    n = element_tile.size
    if n == 0:
      return cls(0, np.zeros(0, np.int64), np.zeros(0, np.int64), chunk=1)
    tiles, first, counts = np.unique(element_tile, return_index=True,
                                     return_counts=True)
    # Rows in order of first appearance keeps linear mappings recognisable.
    order = np.argsort(first, kind="stable")
    tiles, counts = tiles[order], counts[order]
    row_of_tile = np.empty(tiles.max() + 1, np.int64)
    row_of_tile[tiles] = np.arange(tiles.size)
    element_row = row_of_tile[element_tile]
    chunk = int(counts[0])
    expected_rows = np.arange(n) // chunk
    if np.array_equal(element_row, expected_rows):
      return cls(n, tiles, counts, chunk=chunk)
    # Offset of each element within its row: rank among same-row elements.
    sort = np.argsort(element_row, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    offsets = np.empty(n, np.int64)
    offsets[sort] = np.arange(n) - np.repeat(starts, counts)
    return cls(n, tiles, counts, element_row=element_row,
               element_offset=offsets)

  # -- queries --------------------------------------------------------------

  @property
  def is_linear(self) -> bool:
    return self.chunk is not None

  @property
  def num_rows(self) -> int:
    return int(self.tiles.size)

  @property
  def row_size(self) -> int:
    if self.num_elements == 0:
      return 0
    return int(self.chunk) if self.is_linear else int(self.counts.max())

  @property
  def storage_shape(self) -> tuple:
    return (self.num_rows, self.row_size)

  # Per-element arrays (8 bytes per element each) of linear and block-grid
  # layouts are derived from their closed form and held in a bounded LRU
  # keyed by the layout, not on the mapping: a model's tensors all stay alive
  # to the end of lowering, and keeping these on every one of them was most
  # of lowering's host memory at BERT size. Irregular mappings keep theirs
  # (the layout is those arrays).

  def _derived(self, name: str, compute):
    if not self.is_linear and self.grid is None:
      value = self._irregular_cache.get(name)
      if value is None:
        value = self._irregular_cache[name] = compute()
      return value
    return plan_cache.cached(_ELEMENT_ARRAYS, (self.fingerprint, name), compute)

  @functools.cached_property
  def _irregular_cache(self) -> dict:
    return {}

  def _layout_array(self, which: int) -> np.ndarray:
    """Row (``which=0``) or offset (1) of every element of a regular layout.

    These do not depend on the tiles, so they are keyed by the layout alone:
    the same grid moved along the tiles (a transformer's next layer) shares
    one read-only array.
    """
    if self.is_linear:
      key = ("linear", self.num_elements, int(self.chunk), which)
      compute = lambda: np.divmod(np.arange(self.num_elements, dtype=np.int64),  # noqa: E731
                                  self.chunk)[which]
    else:
      key = ("grid", self.grid, which)
      compute = lambda: self._from_runs(which)  # noqa: E731

    def frozen():
      value = np.ascontiguousarray(compute())
      value.flags.writeable = False
      return value
    return plan_cache.cached(_ELEMENT_ARRAYS, key, frozen)

  def _from_runs(self, which: int) -> np.ndarray:
    """Row (``which=0``), offset (1) or storage position (2) of every
    element, spread from :attr:`runs` (cheaper than the closed form per
    element: a few passes, whatever the rank)."""
    start, _, row, offset = self.runs
    n = self.num_elements
    if which == 0:
      return spread_runs(row, start, n)
    value = offset if which == 1 else row * self.row_size + offset
    value = spread_runs(value - start, start, n)
    value += np.arange(n, dtype=np.int64)
    return value

  @property
  def runs(self) -> tuple:
    """``(start, length, row, offset)``: the flattened tensor as maximal runs
    of consecutive elements in consecutive places of one storage row.

    Linear layouts have one run per row and block grids their closed form
    (:meth:`BlockGrid.runs`), both without touching elements; irregular
    mappings compress their per-element arrays once.
    """
    if self.num_elements == 0:
      empty = np.zeros(0, np.int64)
      return empty, empty, empty, empty
    if self.is_linear:
      chunk = int(self.chunk)
      rows = _shared_rows(("rows", self.num_rows), lambda: np.arange(self.num_rows))
      starts = _shared_rows(("starts", self.num_rows, chunk), lambda: rows * chunk)
      offsets = _shared_rows(("zeros", self.num_rows), lambda: np.zeros(self.num_rows))
      return starts, self.counts, rows, offsets
    if self.grid is not None:
      def frozen():
        value = tuple(np.ascontiguousarray(a, np.int64) for a in self.grid.runs())
        for a in value:
          a.flags.writeable = False
        return value
      return plan_cache.cached(_ELEMENT_ARRAYS, ("grid runs", self.grid), frozen)
    return self._derived("runs", self._compute_runs)

  def _compute_runs(self) -> tuple:
    row, offset = self._element_row, self._element_offset
    n = self.num_elements
    brk = np.flatnonzero((row[1:] != row[:-1]) | (offset[1:] != offset[:-1] + 1)) + 1
    start = np.concatenate([np.zeros(1, np.int64), brk])
    return start, np.diff(np.append(start, n)), row[start], offset[start]

  @property
  def element_row(self) -> np.ndarray:
    """``[num_elements]`` storage row of each element."""
    if self.is_linear or self.grid is not None:
      return self._layout_array(0)
    return self._element_row

  @property
  def element_offset(self) -> np.ndarray:
    """``[num_elements]`` place of each element within its storage row."""
    if self.is_linear or self.grid is not None:
      return self._layout_array(1)
    return self._element_offset

  @property
  def element_tile(self) -> np.ndarray:
    """``[num_elements]`` tile of each element."""
    if self.is_linear:
      return self._derived("tile", lambda: np.repeat(self.tiles, self.counts))
    if self.grid is not None:
      return self._derived("tile", lambda: spread_runs(self.tiles[self.runs[2]], self.runs[0],
                                                      self.num_elements))
    return self._derived("tile", lambda: self.tiles[self.element_row])

  @property
  def storage_position(self) -> np.ndarray:
    """``[num_elements]`` index of each element in the flattened storage."""
    if self.is_linear:
      return self._derived("position", lambda: np.arange(self.num_elements, dtype=np.int64))
    if self.grid is not None:
      return self._derived("position", lambda: self._from_runs(2))
    return self._derived("position", lambda: self.element_row * self.row_size + self.element_offset)

  def positions_of(self, elements: np.ndarray) -> np.ndarray:
    """:attr:`storage_position` of the given flat ``elements`` only.

    Found on the mapping's runs (a binary search each) for linear and
    block-grid layouts: a sample of a large tensor's places costs the
    sample, not the tensor.
    """
    elements = np.asarray(elements, np.int64)
    if self.is_linear:
      return elements
    if self.grid is None:
      return self.storage_position[elements]
    start, _, row, offset = self.runs
    run = np.searchsorted(start, elements, side="right") - 1
    return row[run] * self.row_size + offset[run] + (elements - start[run])

  @property
  def storage_source(self) -> np.ndarray:
    """For each storage slot, the flat element it holds (``num_elements`` = padding)."""
    def compute():
      rows, size = self.storage_shape
      source = np.full(rows * size, self.num_elements, np.int64)
      source[self.storage_position] = np.arange(self.num_elements)
      return source
    return self._derived("source", compute)

  @functools.cached_property
  def fingerprint(self) -> tuple:
    """A hashable identity of this layout, for plan caches.

    Two mappings with equal fingerprints put every element in the same
    storage slot on the same tile, but for a chance collision of
    :func:`tiles_key` (row tiles as a 64-bit hash; odds about 2**-64 a pair). Linear and block-grid mappings are keyed
    by their closed form and their row tiles (``O(rows)``), so equal layouts
    made by different equations (the same layer repeated) share plans;
    irregular mappings get a key unique to the object.
    """
    tiles = tiles_key(self.tiles)
    if self.num_elements == 0:
      return ("empty", self.num_rows)
    if self.is_linear:
      return ("linear", self.num_elements, int(self.chunk), tiles)
    if self.grid is not None:
      return ("grid", self.num_elements, self.grid, tiles)
    return ("object", next(_object_ids))

  def relative_fingerprint(self, base: int, num_tiles: int) -> tuple:
    """:attr:`fingerprint` with tile ids counted from ``base`` (modulo ``num_tiles``).

    A cost that only compares tile ids (which tile holds what, not where the
    tile is: any exchange within one IPU) is the same for two layouts moved
    by the same number of tiles, up to that shift. Keyed by this, a
    repeated layer whose tensors all landed ``k`` tiles further along finds
    the plans of the first.
    """
    kind = self.fingerprint
    if kind[0] not in ("linear", "grid"):
      # Keyed by the object: the shift is part of the key.
      return kind + (("base", int(base)),)
    # A tensor is costed against several others from the same base (its
    # first tile, its IPU's): the hashed row tiles are kept per base.
    memo = self.__dict__.setdefault("_relative_keys", {})
    key = memo.get((int(base), int(num_tiles)))
    if key is None:
      consecutive = self.__dict__.get("_consecutive")
      if consecutive is not None and consecutive[1] == int(num_tiles):
        # Consecutive row tiles moved along are consecutive from the moved
        # start: keyed in closed form (another mapping with the same tiles
        # but made otherwise keys by their hash, and only shares no plans).
        moved = ("consecutive", self.num_rows, (consecutive[0] - int(base)) % int(num_tiles),
                 int(num_tiles))
      else:
        moved = tiles_key((self.tiles - int(base)) % int(num_tiles))
      key = memo[int(base), int(num_tiles)] = kind[:-1] + (moved,)
    return key

  @property
  def intervals(self) -> tuple:
    """``(starts, tiles)``: the flattened tensor as runs of one tile each.

    Run ``i`` covers elements ``[starts[i], starts[i + 1])`` (the last ends at
    ``num_elements``) and lives on ``tiles[i]``; neighbouring runs are on
    different tiles. This is Poplar's per-tile interval list, ordered by
    element. Linear mappings give one run per row without touching elements;
    general mappings compress their per-element tiles once (then cached).
    """
    if self.num_elements == 0:
      return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if self.is_linear:
      chunk = int(self.chunk)
      starts = _shared_rows(("starts", self.num_rows, chunk),
                            lambda: np.arange(self.num_rows, dtype=np.int64) * chunk)
      return starts, self.tiles
    # Derived on demand and held in the bounded layout table (block grids) or
    # on the mapping (irregular ones): kept on every block-grid mapping they
    # were a tenth of a lowered BERT-base program's host memory.
    return self._derived("intervals", self._compute_intervals)

  def ipu_runs(self, tiles_per_ipu: int) -> tuple:
    """``(starts, ipus)``: the flattened tensor as runs of one IPU each.

    What crosses IPU-Links is counted on these (a few per tensor, not one
    per tile); a tensor is costed against many others, so they are kept
    on the mapping (small arrays, read-only).
    """
    memo = self.__dict__.setdefault("_ipu_runs", {})
    runs = memo.get(int(tiles_per_ipu))
    if runs is None:
      starts, tiles = self.intervals
      ipus = tiles // int(tiles_per_ipu)
      keep = np.ones(ipus.size, bool)
      keep[1:] = ipus[1:] != ipus[:-1]
      runs = memo[int(tiles_per_ipu)] = (starts[keep], ipus[keep])
      for a in runs:
        a.setflags(write=False)
    return runs

  def _compute_intervals(self) -> tuple:
    if self._row_runs is None:
      self._row_runs = row_runs(self.element_row)
    starts, rows = self._row_runs
    tiles = self.tiles[rows]
    # Row tiles are unique, but neighbouring runs on one tile still merge.
    keep = np.ones(tiles.size, bool)
    keep[1:] = tiles[1:] != tiles[:-1]
    return starts[keep], tiles[keep]

  def elements_per_tile(self, num_tiles: int) -> np.ndarray:
    """``[num_tiles]`` elements held by each tile."""
    out = np.zeros(num_tiles, np.int64)
    # Storage rows are on distinct tiles, so a plain indexed add is exact.
    out[self.tiles] += self.counts
    return out

  def bytes_per_tile(self, num_tiles: int, itemsize: int) -> np.ndarray:
    return self.elements_per_tile(num_tiles) * itemsize

  def same_as(self, other: "TileMapping") -> bool:
    """Whether both mappings put every element in the same storage slot."""
    if self is other:
      return True
    if self.num_elements != other.num_elements:
      return False
    if self.is_linear and other.is_linear:
      return (self.chunk == other.chunk or self.num_rows <= 1) and \
          np.array_equal(self.tiles, other.tiles) and self.storage_shape == other.storage_shape
    if self.grid is not None and self.grid == other.grid:
      # Equal grids put equal elements in equal rows: compare rows' tiles, not elements.
      return np.array_equal(self.tiles, other.tiles)
    return (np.array_equal(self.tiles, other.tiles)
            and self.storage_shape == other.storage_shape
            and np.array_equal(self.storage_position, other.storage_position))

  def __repr__(self):
    kind = f"linear chunk={self.chunk}" if self.is_linear else "general"
    return (f"TileMapping({self.num_elements} elements on {self.num_rows} tiles, "
            f"{kind})")
