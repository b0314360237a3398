"""Splitting a vertex's 1-D work over the tile's worker threads (TessellateIPU's helpers).

A supervisor vertex hands each of the tile's six workers a contiguous range
of vectors. These functions build those worklists as TessellateIPU's
``tessellate_ipu/core/tile_interpreter_vertex_utils.py`` documents them:
workers take ``ceil(units / workers)`` grains each, the last busy worker the
remainder, the rest nothing (offsets and sizes in vectors).
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

__all__ = ["make_num_elements_per_worker", "make_ipu_vector1d_worker_offsets",
           "make_ipu_vector1d_worker_offsets_and_sizes"]


def make_num_elements_per_worker(n: int, num_workers: int) -> np.ndarray:
  """``n`` elements dealt evenly to ``num_workers`` (the first ones get one more)."""
  if num_workers <= 0:
    raise ValueError(f"num_workers must be positive, got {num_workers}.")
  out = np.full(num_workers, n // num_workers, np.int32)
  out[:n % num_workers] += 1
  return out


def _grains(size: int, vector_size: int, grain_size: Optional[int], exact: bool):
  grain = grain_size or vector_size
  if size % 2:
    raise ValueError(f"Odd sizes are not supported (size={size}).")
  if grain % vector_size:
    raise ValueError(f"grain_size {grain} must be a multiple of vector_size {vector_size}.")
  if size < grain:
    raise ValueError(f"Requires at least a size of {grain}, got {size}.")
  if exact and size % grain:
    raise ValueError(f"Requires the size, {size}, divisible by the grain size {grain}.")
  return grain, grain // vector_size


def make_ipu_vector1d_worker_offsets(size: int, vector_size: int = 2, num_workers: int = 6,
                                     wdtype=np.uint16,
                                     grain_size: Optional[int] = None) -> np.ndarray:
  """``[num_workers + 1]`` start offsets (in vectors) of each worker's range, then the end."""
  grain, scale = _grains(size, vector_size, grain_size, exact=True)
  units = size // grain
  per = math.ceil(units / num_workers)
  busy = units // per
  sizes = [per] * busy
  if busy < num_workers:
    sizes += [units - per * busy] + [0] * (num_workers - busy - 1)
  return np.concatenate([[0], np.cumsum(np.asarray(sizes) * scale)]).astype(wdtype)


def make_ipu_vector1d_worker_offsets_and_sizes(size: int, vector_size: int = 2,
                                               num_workers: int = 6, wdtype=np.uint16,
                                               allow_overlap: bool = False,
                                               grain_size: Optional[int] = None) -> np.ndarray:
  """``[num_workers, 2]`` (offset, size) per worker, in vectors.

  With ``allow_overlap`` a size not a multiple of the grain is covered by a
  last range ending at the end and overlapping its neighbour.
  """
  grain, scale = _grains(size, vector_size, grain_size, exact=not allow_overlap)
  per = math.ceil(size / (grain * num_workers))
  busy = size // (grain * per)
  out = np.zeros((num_workers, 2), np.int64)
  out[:busy, 0] = np.arange(busy) * per * scale
  out[:busy, 1] = per * scale
  if busy < num_workers:
    rest = math.ceil((size - per * grain * busy) / grain)
    out[busy] = (size // vector_size - rest * scale, rest * scale)
  return out.astype(wdtype)
