"""Cycle estimates of PopLibs' poprand vertices (the tiles' hardware generators).

Every formula is PopLibs' own codelet cycle estimator, read from
``lib/poprand/poprandCycleEstimators.cpp`` (graphcore/poplibs, the
``MAKE_PERF_ESTIMATOR_NAME(<Vertex>)`` functions): a supervisor vertex per
tile whose six workers each draw from their own generator, so the cost is a
per-tile constant (supervisor call, each worker's preparation) plus a
repeat loop over 64-bit vectors of results. ``out`` below is the number of
values the vertex writes on that tile. The data path is 64 bits wide
(``IPUTarget``'s ``getDataPathWidth()``).

All functions take per-tile element counts (NumPy arrays) and return per-tile
cycles; a tile with nothing to write runs no vertex (0 cycles).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["DATA_PATH_BITS", "bernoulli_cycles", "dropout_cycles", "normal_cycles",
           "set_seed_cycles", "truncated_normal_cycles", "truncated_normal_iterations",
           "uniform_cycles", "uniform_int_bits_cycles"]

#: Bits a tile loads or stores per cycle (``Target::getDataPathWidth()``).
DATA_PATH_BITS = 64


def _counts(out) -> np.ndarray:
  return np.asarray(out, np.int64)


def _vectors(out: np.ndarray, width: int) -> np.ndarray:
  return -(-out // width)


def _ragged(out: np.ndarray, width: int) -> np.ndarray:
  return (out % width != 0).astype(np.int64)


def _only_busy(out: np.ndarray, cycles: np.ndarray) -> np.ndarray:
  return np.where(out > 0, cycles, 0).astype(np.int64)


def uniform_int_bits_cycles(out, workers: int) -> np.ndarray:
  """``Uniform<int>`` with ``scale == 0``: ``out`` raw 32-bit random words.

  ``4 + 22 * workers + out / 2`` (one ``st64`` of two words a cycle):
  ``MAKE_PERF_ESTIMATOR_NAME(Uniform)``, ``type == INT``, ``scale == 0``.
  """
  out = _counts(out)
  return _only_busy(out, 4 + 22 * workers + out // 2)


def uniform_cycles(out, workers: int, dtype_bits: int) -> np.ndarray:
  """``Uniform<float>`` / ``Uniform<half>``: ``out`` values in ``[min, max)``.

  ``4 + 4 * ceil(out / vw) + 22 * workers (+4 ragged)`` for float (vw = 2),
  ``... + 24 * workers (+12 ragged)`` for half (vw = 4):
  ``MAKE_PERF_ESTIMATOR_NAME(Uniform)``, the non-INT branch. (The estimator
  spells the vector width ``dataPathWidth / 2`` and ``/ 4``; 4 cycles per 64-bit
  vector is its meaning, as the Normal estimator's ``/ 32`` and ``/ 16`` say.)
  """
  out = _counts(out)
  is_float = dtype_bits == 32
  width = DATA_PATH_BITS // dtype_bits
  cycles = 4 + 4 * _vectors(out, width)
  cycles = cycles + (22 * workers + 4 * _ragged(out, width) if is_float
                     else 24 * workers + 12 * _ragged(out, width))
  return _only_busy(out, cycles)


def bernoulli_cycles(out, workers: int, dtype_bits: int) -> np.ndarray:
  """``Bernoulli<T>``: ``out`` 0/1 values with probability ``prob`` of 1.

  ``4 + ceil(out / vw) + 21 * workers (+9 ragged)`` for half (vw = 4),
  ``... + 23 * workers (+1 ragged)`` otherwise (vw = 2):
  ``MAKE_PERF_ESTIMATOR_NAME(Bernoulli)``.
  """
  out = _counts(out)
  is_half = dtype_bits == 16
  width = 4 if is_half else 2
  cycles = 4 + _vectors(out, width)
  cycles = cycles + (21 * workers + 9 * _ragged(out, width) if is_half
                     else 23 * workers + _ragged(out, width))
  return _only_busy(out, cycles)


def normal_cycles(out, workers: int, dtype_bits: int) -> np.ndarray:
  """``Normal<T>``: ``out`` values of mean ``mean`` and deviation ``stdDev``.

  ``4 + 4 * ceil(out / vw) + 22 * workers (+3 ragged)`` for float,
  ``... + 24 * workers (+12 ragged)`` for half:
  ``MAKE_PERF_ESTIMATOR_NAME(Normal)``.
  """
  out = _counts(out)
  width = DATA_PATH_BITS // dtype_bits
  cycles = 4 + 4 * _vectors(out, width)
  cycles = cycles + (22 * workers + 3 * _ragged(out, width) if dtype_bits == 32
                     else 24 * workers + 12 * _ragged(out, width))
  return _only_busy(out, cycles)


def truncated_normal_cycles(out, workers: int, dtype_bits: int,
                            iterations: int) -> np.ndarray:
  """``TruncatedNormal<T>``: normals redrawn up to ``iterations`` times.

  ``4 + 26 * workers + (11 * it + 5) * ceil(out / vw) (+ (13 * it + 2)
  ragged)`` for float, ``4 + 28 * workers + (12 * it + 5) * ... (+ (12 * it +
  10) ragged)`` for half: ``MAKE_PERF_ESTIMATOR_NAME(TruncatedNormal)``.
  """
  out = _counts(out)
  width = DATA_PATH_BITS // dtype_bits
  it = int(iterations)
  if dtype_bits == 32:
    cycles = (4 + 26 * workers + (11 * it + 5) * _vectors(out, width)
              + _ragged(out, width) * (13 * it + 2))
  else:
    cycles = (4 + 28 * workers + (12 * it + 5) * _vectors(out, width)
              + _ragged(out, width) * (12 * it + 10))
  return _only_busy(out, cycles)


def truncated_normal_iterations(alpha: float) -> int:
  """Redraw rounds poprand gives ``TruncatedNormal`` for a cut at ``alpha`` deviations.

  ``ceil(-4 / log10(erfc(alpha / sqrt(2))))``: enough rounds that a value is
  still outside ``[-alpha, alpha]`` with probability at most 1e-4
  (``poprand::truncatedNormal``, ``lib/poprand/RandomGen.cpp``); 3 for
  ``alpha = 2``.
  """
  outside = math.erfc(float(alpha) / math.sqrt(2.0))
  return int(math.ceil(-4.0 / math.log10(outside)))


def dropout_cycles(out, workers: int, dtype_bits: int) -> np.ndarray:
  """``Dropout<T>``: ``out`` values kept (scaled) or zeroed, in one pass.

  ``6 + 24 * workers + 2 * ceil(out / vw) (+1 ragged float, +9 half)``:
  ``MAKE_PERF_ESTIMATOR_NAME(Dropout)``.
  """
  out = _counts(out)
  width = DATA_PATH_BITS // dtype_bits
  cycles = (6 + 24 * workers + 2 * _vectors(out, width)
            + _ragged(out, width) * (1 if dtype_bits == 32 else 9))
  return _only_busy(out, cycles)


def set_seed_cycles(workers: int) -> int:
  """``SetSeed``: ``14 + 27 * workers`` (``MAKE_PERF_ESTIMATOR_NAME(SetSeed)``)."""
  return 14 + 27 * workers
