"""Plan caching: results of pure planning functions, reused across equations.

A transformer repeats the same layer: its equations see the same shapes and,
for tensors that cover every tile, the same tile mappings. Planning work that
depends only on those (grouping a reduction's slots, a block-grid mapping,
the bytes a relayout moves) is computed once and looked up afterwards.

Keys are built from :meth:`TileMapping.fingerprint` (a cheap, exact identity
of a mapping's layout: ``O(rows)`` for linear and block-grid mappings, a
per-object id for irregular ones) and plain shapes/params. Values are kept
in a least-recently-used table bounded by the bytes of the NumPy arrays they
hold, so caching never holds more than ``max_bytes`` of host memory per table,
and mostly while a program is lowered: the tables are emptied when the
outermost :func:`lowering_session` ends (a first call's tracing may derive a
few layout arrays again). Row tiles enter keys as :func:`~ipu_jax.lowering.mapping.tiles_key`,
a 64-bit hash with the length and ends: two layouts share a key by chance
with odds of about 2**-64 a pair.

A key holds everything its value depends on -- layouts, shapes, dtypes, and
the target wherever a figure reads it -- and nothing of the program being
lowered or its options (a matmul's proportion decides its grid, and the grid
is in the key). One session may therefore span several programs: a
pipeline's stage programs (``Pipeline.lower``: a backward replans its
recomputed forward, stages repeat the same layer) and a split search's
probes, confirmations and baseline (``ipu_jax.pipelining.search``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable, Hashable

import numpy as np

__all__ = ["PlanCache", "array_key", "cached", "disabled", "held_bytes", "lowering_session"]

_enabled = [True]
_CACHES: "weakref.WeakSet[PlanCache]" = weakref.WeakSet()
_sessions = [0]
_sessions_lock = threading.Lock()


def array_key(a) -> tuple:
  """An exact hashable key for a small NumPy array (shape, dtype, bytes)."""
  a = np.ascontiguousarray(a)
  return (a.shape, a.dtype.str, a.tobytes())


def _nbytes(value, seen=None) -> int:
  """Bytes of the NumPy arrays reachable from ``value`` (tuples, dataclasses)."""
  if isinstance(value, np.ndarray):
    return int(value.nbytes)
  if isinstance(value, (tuple, list)):
    return sum(_nbytes(v) for v in value)
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
  if hasattr(value, "__dict__"):
    return sum(_nbytes(v) for v in vars(value).values() if isinstance(v, np.ndarray))
  return 0


class PlanCache:
  """A least-recently-used table bounded by the bytes its values hold."""

  def __init__(self, name: str, max_bytes: int = 64 << 20, max_entries: int = 512):
    self.name = name
    self.max_bytes = max_bytes
    self.max_entries = max_entries
    self._table: "collections.OrderedDict[Hashable, tuple]" = collections.OrderedDict()
    self._bytes = 0
    self._lock = threading.Lock()
    self.hits = 0
    self.misses = 0
    _CACHES.add(self)

  def get_or_compute(self, key: Hashable, compute: Callable[[], Any]) -> Any:
    with self._lock:
      entry = self._table.get(key)
      if entry is not None:
        self._table.move_to_end(key)
        self.hits += 1
        return entry[0]
    value = compute()
    size = _nbytes(value)
    with self._lock:
      self.misses += 1
      if size > self.max_bytes // 4:
        return value  # too large to be worth holding
      if key not in self._table:
        self._table[key] = (value, size)
        self._bytes += size
      while self._table and (self._bytes > self.max_bytes or len(self._table) > self.max_entries):
        _, (_, dropped) = self._table.popitem(last=False)
        self._bytes -= dropped
    return value

  @property
  def nbytes(self) -> int:
    """Bytes of the NumPy arrays the table's values held when stored."""
    with self._lock:
      return self._bytes

  def clear(self) -> None:
    with self._lock:
      self._table.clear()
      self._bytes = 0

  def __len__(self):
    return len(self._table)


@contextlib.contextmanager
def disabled():
  """Within this scope every plan is computed afresh (tests compare both)."""
  _enabled.append(False)
  try:
    yield
  finally:
    _enabled.pop()


def held_bytes() -> int:
  """Bytes of NumPy arrays held by every plan table now (0 right after a lowering)."""
  return sum(cache.nbytes for cache in list(_CACHES))


@contextlib.contextmanager
def lowering_session():
  """Plans are shared within this scope and dropped when the outermost one ends.

  A program's equations reuse each other's plans; once it is lowered they
  are dead weight (up to ``max_bytes`` per table, most of a gigabyte at
  BERT size), so the lowering of one program is one session, unless a
  caller lowering several programs that meet the same layouts (a pipeline's
  stages, a split search) holds one around them all. Sessions nest: a
  program lowered inside another session shares its tables.
  """
  with _sessions_lock:
    _sessions[0] += 1
  try:
    yield
  finally:
    with _sessions_lock:
      _sessions[0] -= 1
      last = _sessions[0] == 0
    if last:
      for cache in list(_CACHES):
        cache.clear()


def cached(cache: PlanCache, key: Hashable, compute: Callable[[], Any]) -> Any:
  """``cache.get_or_compute(key, compute)``; ``key=None`` skips the cache."""
  if key is None or not _enabled[-1]:
    return compute()
  return cache.get_or_compute(key, compute)
