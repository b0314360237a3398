"""Cycle estimators of the dense linear-algebra and FFT vertices.

A linear-algebra vertex solves whole problems (one matrix factorisation, one
FFT line) held on its tile. Its cost is the floating-point work of the
algorithm it runs, counted with the textbook operation counts below, at the
tile's fp32 rate shared among the worker contexts:

* A worker issues one instruction every ``worker_contexts`` tile cycles, so
  one worker alone gets ``1 / worker_contexts`` of the tile's rate and the
  tile reaches its full rate only when every worker is busy. In the worker's
  own cycles a problem of ``F`` flops therefore costs ``F / rate`` plus the
  usual per-vertex overhead, and the tile costs its busiest worker times the
  number of contexts plus the supervisor's overhead (as every estimator in
  :mod:`ipu_jax.kernels.estimators`).
* With at least as many problems as workers, problems are dealt to the
  workers whole (``ceil(p / w)`` each).
* With fewer problems than workers, the independent inner loops of each
  problem (the columns of a trailing update, the rows of a rotation, the
  butterflies of an FFT stage) are shared by ``w // p`` workers, which must
  rejoin after each of the algorithm's sequential steps (a column, a Jacobi
  round, an FFT stage); each rejoin costs a worker launch. The vertex takes
  whichever arrangement is cheaper.

Operation counts (real flops; a complex flop counts as four real ones):

========================  ===============================================
Cholesky ``n x n``        ``n^3 / 3``
triangular solve          ``m^2 k`` (``m x m`` triangle, ``k`` right-hand sides)
LU ``m x n``, ``k=min``   ``2 (m n k - (m + n) k^2 / 2 + k^3 / 3)`` (``2n^3/3``)
Householder QR (R)        ``4 (m n k - (m + n) k^2 / 2 + k^3 / 3)`` (``4n^3/3``)
forming Q (``m x q``)     ``4 m q k - 2 (m + q) k^2 + 4 k^3 / 3``
Jacobi eigh               ``sweeps * n (n - 1) / 2`` rotations of ``12 n``
                          flops (``8 n`` on the matrix, ``4 n`` on the
                          eigenvectors), ``sweeps = 3 + ceil(log2 n)``
one-sided Jacobi SVD      ``sweeps * k (k - 1) / 2`` column pairs of
                          ``12 m`` flops (+ ``6 n`` for V), ``k = min(m, n)``
Hessenberg / Schur / eig  ``10 n^3 / 3`` / ``10 n^3`` (``25 n^3`` with vectors)
FFT of ``n`` points       ``5 n log2 n`` complex, half that for real input
========================  ===============================================

The Jacobi sweep count is that of cyclic Jacobi with quadratic convergence in
fp32: a few sweeps to reach the quadratic regime, then about ``log2 n`` more
for the off-diagonal mass of an ``n x n`` matrix to fall below rounding
(Demmel, *Applied Numerical Linear Algebra*, sec. 5.3.5; the tile-parallel
Jacobi of pyscf-ipu ran a fixed number of sweeps of this size).
"""

from __future__ import annotations

import math

import numpy as np

from ipu_jax.kernels.estimators import WORKER_OVERHEAD
from ipu_jax.kernels.target import IPUTarget

__all__ = [
    "problem_cycles", "complex_factor", "cholesky_flops",
    "triangular_solve_flops", "lu_flops", "qr_flops", "form_q_flops",
    "jacobi_sweeps", "eigh_flops", "svd_flops", "fft_flops",
    "hessenberg_flops", "schur_flops", "tridiagonal_flops",
]


def complex_factor(dtype) -> int:
  """Real flops per flop of ``dtype``: 4 for complex, else 1."""
  return 4 if np.issubdtype(np.dtype(dtype), np.complexfloating) else 1


def cholesky_flops(n: int) -> float:
  return n ** 3 / 3.0


def triangular_solve_flops(m: int, k: int) -> float:
  return float(m) * m * k


def lu_flops(m: int, n: int) -> float:
  k = min(m, n)
  return 2.0 * (m * n * k - (m + n) * k * k / 2.0 + k ** 3 / 3.0)


def qr_flops(m: int, n: int) -> float:
  """Householder reduction to R (``geqrf``): twice the work of LU."""
  return 2.0 * lu_flops(m, n)


def form_q_flops(m: int, q: int, k: int) -> float:
  """Accumulating ``k`` reflectors into the ``m x q`` Q (``orgqr``)."""
  return max(0.0, 4.0 * m * q * k - 2.0 * (m + q) * k * k + 4.0 * k ** 3 / 3.0)


def jacobi_sweeps(n: int) -> int:
  """Cyclic-Jacobi sweeps to converge in fp32 (see the module docstring)."""
  return 0 if n <= 1 else 3 + math.ceil(math.log2(n))


def eigh_flops(n: int, vectors: bool = True) -> float:
  rotations = jacobi_sweeps(n) * n * (n - 1) / 2.0
  return rotations * (12.0 if vectors else 8.0) * n


def svd_flops(m: int, n: int, compute_uv: bool = True) -> float:
  """One-sided Jacobi on the ``k = min(m, n)`` columns of the taller side."""
  rows, k = max(m, n), min(m, n)
  pairs = jacobi_sweeps(k) * k * (k - 1) / 2.0
  return pairs * (12.0 * rows + (6.0 * k if compute_uv else 0.0))


def hessenberg_flops(n: int) -> float:
  return 10.0 * n ** 3 / 3.0


def schur_flops(n: int, vectors: bool) -> float:
  return (25.0 if vectors else 10.0) * n ** 3


def tridiagonal_flops(n: int) -> float:
  return 4.0 * n ** 3 / 3.0


def fft_flops(n: int, real: bool = False) -> float:
  """One transform of ``n`` points (``n`` may be the product of several axes)."""
  if n <= 1:
    return 0.0
  flops = 5.0 * n * math.log2(n)
  return flops / 2.0 if real else flops


def problem_cycles(target: IPUTarget, problems: np.ndarray, flops: float,
                   steps: int = 1) -> np.ndarray:
  """Compute-phase cycles of tiles that each solve ``problems`` problems.

  Args:
    target: the IPU target.
    problems: ``[num_tiles]`` problems held by each tile.
    flops: real flops of one problem.
    steps: sequential steps of one problem (workers sharing a problem rejoin
      after each).

  Returns:
    ``[num_tiles]`` cycles (0 on tiles without problems).
  """
  problems = np.asarray(problems, np.int64)
  w = target.worker_contexts
  rate = float(target.fp32_flops_per_cycle)
  whole = WORKER_OVERHEAD + np.ceil(flops / rate)
  # Problems dealt whole to workers.
  dealt = -(-problems // w) * whole
  # Fewer problems than workers: each shared by w // p workers.
  sharing = np.maximum(1, w // np.maximum(problems, 1))
  shared = (WORKER_OVERHEAD + np.ceil(flops / (rate * sharing))
            + np.where(sharing > 1, steps * WORKER_OVERHEAD, 0))
  busiest = np.where(problems < w, np.minimum(dealt, shared), dealt)
  return np.where(problems > 0, w * busiest + target.supervisor_overhead_cycles,
                  0.0).astype(np.float64)
