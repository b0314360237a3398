"""Tile layouts numbered so that equal layouts share one number.

Elementwise fusion (``lowering/fusion.py``) groups steps on one layout; it
compares layouts for every open group and step. :class:`LayoutNumbers`
compares each mapping object once, when first seen (by closed-form
fingerprint for linear and block-grid layouts, else against the layouts of
its bucket: size, storage shape, row tiles and a sample of storage slots),
so grouping compares integers instead of tile arrays, and keeps each
layout's per-tile element counts once.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.lowering.mapping import tiles_key

__all__ = ["LayoutNumbers"]


class LayoutNumbers:
  """Numbers tile layouts so that equal layouts share one number.

  Two mappings get the same number exactly when ``same_as`` holds (an
  equivalence: both put every element in the same storage slot on the same
  tile). Each mapping object is compared once, when first seen; grouping
  then compares integers instead of tile arrays for every open group and
  step. Per-tile element counts are kept per layout for the same reason.
  """

  def __init__(self, num_tiles: int):
    self.num_tiles = num_tiles
    self._by_object = {}      # id(mapping) -> (number, mapping); holds the mapping alive
    self._by_key = {}         # closed-form fingerprint -> number
    self._by_bucket = {}      # _layout_bucket(mapping) -> [(number, mapping)]
    self._elements = {}       # number -> elements per tile

  def number(self, mapping) -> int:
    """The number of ``mapping``'s layout."""
    seen = self._by_object.get(id(mapping))
    if seen is not None:
      return seen[0]
    # Linear and block-grid layouts with equal closed forms are equal.
    key = mapping.fingerprint
    closed_form = key[0] in ("linear", "grid")
    number = self._by_key.get(key) if closed_form else None
    if number is None:
      bucket = _layout_bucket(mapping)
      candidates = self._by_bucket.setdefault(bucket, [])
      number = next((n for n, m in candidates if m.same_as(mapping)), None)
      if number is None:
        number = len(self._by_object)
        candidates.append((number, mapping))
      if closed_form:
        self._by_key[key] = number
    self._by_object[id(mapping)] = (number, mapping)
    return number

  def elements_per_tile(self, mapping) -> np.ndarray:
    """``[num_tiles]`` elements ``mapping`` puts on each tile (shared, read-only)."""
    number = self.number(mapping)
    elements = self._elements.get(number)
    if elements is None:
      elements = mapping.elements_per_tile(self.num_tiles)
      elements.setflags(write=False)
      self._elements[number] = elements
    return elements


def _layout_bucket(mapping) -> tuple:
  """What two layouts share if they are equal: size, storage shape, row
  tiles and the storage slots of every ``n // 64``-th element (so unequal
  layouts of the same shape on the same tiles rarely need comparing)."""
  n = mapping.num_elements
  step = max(1, n // 64)
  sample = mapping.positions_of(np.arange(0, n, step, dtype=np.int64))
  return n, mapping.storage_shape, tiles_key(mapping.tiles), sample.tobytes()
