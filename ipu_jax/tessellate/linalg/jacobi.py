"""``ipu_eigh``: the one-sided Jacobi eigen-decomposition as a tile program (TessellateIPU's).

The algorithm of TessellateIPU's ``tessellate_ipu/linalg/tile_linalg_jacobi.py``
(written here): a symmetric ``N x N`` matrix is held as ``N/2`` column pairs,
pair ``k`` (columns ``p_k``, ``q_k`` of ``A`` and of the eigenvectors ``V``) on
its own tiles — ``A``'s pairs on tiles ``1 .. N/2``, ``V``'s on
``N/2 + 1 .. N``. One Jacobi step, ``N - 1`` of them per sweep:

1. ``JacobiUpdateFirstStep`` (each A tile): the symmetric Schur rotation
   ``(c, s)`` zeroing ``A[p, q]`` (Golub & Van Loan, Matrix Computations,
   Algorithm 8.4.1), applied to its two columns (``A <- A J``).
2. The rotations and index pairs of all tiles, replicated on every A tile
   (``tile_put_replicated``), each tile's own rotation to its V tile.
3. ``JacobiUpdateSecondStep`` (each A tile): all rotations applied to its
   columns' rows (``A <- J^T A``); ``JacobiUpdateEigenvectors`` (each V tile):
   ``V <- V J``.
4. The columns move between tiles in the round-robin (Brent-Luk) order:
   ``p`` columns shift right with ``p_0`` fixed, ``q`` columns shift left
   (one static ``tile_gather``), so every pair meets once per sweep.

``num_iters`` sweeps run in a ``fori_loop`` of ``fori_loop``s (the loop body
is lowered once).
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.tessellate.linalg.vertices import SCHUR2_CYCLES, column_cycles, linalg_vertex
from ipu_jax.tessellate.tile_array import TileShardedArray
from ipu_jax.tessellate.tile_gather import tile_gather
from ipu_jax.tessellate.tile_map import tile_map
from ipu_jax.tessellate.tile_put import tile_put_replicated, tile_put_sharded

__all__ = ["ipu_eigh", "ipu_jacobi_eigh", "tile_sharded_pq_columns", "jacobi_sym_schur2_p",
           "jacobi_update_first_step_p", "jacobi_update_second_step_p",
           "jacobi_update_eigenvectors_p", "jacobi_initial_rotation_set",
           "jacobi_next_rotation_set", "jacobi_sym_schur2", "rotation_schedule"]


def jacobi_sym_schur2(app, aqq, apq):
  """``(c, s)`` of the 2x2 symmetric Schur rotation zeroing ``apq``."""
  safe = jnp.where(apq == 0, 1.0, apq)
  tau = (aqq - app) / (2 * safe)
  sign = jnp.where(tau >= 0, 1.0, -1.0)
  t = sign / (jnp.abs(tau) + jnp.sqrt(1 + tau * tau))
  c = 1 / jnp.sqrt(1 + t * t)
  s = t * c
  return jnp.where(apq == 0, 1.0, c), jnp.where(apq == 0, 0.0, s)


def _first_step(pq, pcol, qcol):
  p, q = pq[0], pq[1]
  c, s = jacobi_sym_schur2(pcol[p], qcol[q], pcol[q])
  return jnp.stack([c, s]).astype(pcol.dtype), c * pcol - s * qcol, s * pcol + c * qcol


def _second_step(cs_all, pq_all, pcol, qcol):
  # Rows p_k, q_k of every pair rotate; pairs are disjoint, so one scatter each.
  c, s = cs_all[:, 0], cs_all[:, 1]
  pi, qi = pq_all[:, 0], pq_all[:, 1]

  def rows(col):
    cp, cq = col[pi], col[qi]
    return col.at[pi].set(c * cp - s * cq).at[qi].set(s * cp + c * cq)
  return rows(pcol), rows(qcol)


def _eigenvectors(cs, vp, vq):
  c, s = cs[0], cs[1]
  return c * vp - s * vq, s * vp + c * vq


def _sym_schur2(pq, pcol, qcol):
  c, s = jacobi_sym_schur2(pcol[pq[0]], qcol[pq[1]], pcol[pq[1]])
  return jnp.stack([c, s]).astype(pcol.dtype)


jacobi_sym_schur2_p = linalg_vertex("JacobiSymSchur2", _sym_schur2,
                                    lambda avals, attrs: SCHUR2_CYCLES)
jacobi_update_first_step_p = linalg_vertex(
    "JacobiUpdateFirstStep", _first_step, column_cycles(SCHUR2_CYCLES, 5))
jacobi_update_second_step_p = linalg_vertex(
    "JacobiUpdateSecondStep", _second_step, column_cycles(100, 5))
jacobi_update_eigenvectors_p = linalg_vertex(
    "JacobiUpdateEigenvectors", _eigenvectors, column_cycles(100, 2.5))


def jacobi_initial_rotation_set(n: int) -> np.ndarray:
  """The first sweep step's pairs: ``[[0, 1], [2, 3], ...]`` (``[n/2, 2]``)."""
  return np.arange(n, dtype=np.uint32).reshape(-1, 2)


def rotation_schedule(half: int) -> Tuple[np.ndarray, np.ndarray]:
  """Where the next step's p and q columns come from, in ``concat(p, q)`` order.

  Round-robin with ``p_0`` fixed: p takes ``[p_0, q_0, p_1 .. p_{h-2}]``, q
  takes ``[q_1 .. q_{h-1}, p_{h-1}]``.
  """
  p, q = np.arange(half), np.arange(half, 2 * half)
  if half == 1:
    return p, q
  return np.concatenate([p[:1], q[:1], p[1:-1]]), np.concatenate([q[1:], p[-1:]])


def jacobi_next_rotation_set(rot: np.ndarray) -> np.ndarray:
  """The pairs of the next step (the columns moved by :func:`rotation_schedule`)."""
  both = np.concatenate([rot[:, 0], rot[:, 1]])
  p_src, q_src = rotation_schedule(rot.shape[0])
  return np.stack([both[p_src], both[q_src]], axis=1)


def tile_sharded_pq_columns(pcols, qcols, tiles):
  """The p and q columns (``[N/2, N]`` each) sharded over ``tiles``, pair k on ``tiles[k]``."""
  return tile_put_sharded(pcols, tiles), tile_put_sharded(qcols, tiles)


def _rotate(pcols: TileShardedArray, qcols: TileShardedArray):
  both = TileShardedArray.concatenate([pcols, qcols])
  p_src, q_src = rotation_schedule(pcols.num_tiles)
  return (tile_gather(both, p_src.tolist(), pcols.tiles),
          tile_gather(both, q_src.tolist(), qcols.tiles))


def _step(_, carry):
  pq, ap, aq, vp, vq = carry
  cs, ap, aq = tile_map(jacobi_update_first_step_p, pq, ap, aq)
  cs_all = tile_put_replicated(cs.array, ap.tiles)
  pq_all = tile_put_replicated(pq.array, ap.tiles)
  ap, aq = tile_map(jacobi_update_second_step_p, cs_all, pq_all, ap, aq)
  cs_v = tile_put_sharded(cs.array, vp.tiles)
  vp, vq = tile_map(jacobi_update_eigenvectors_p, cs_v, vp, vq)
  # The index pairs travel with their columns.
  idx_p, idx_q = _rotate(TileShardedArray(pq.array[:, :1], pq.tiles),
                         TileShardedArray(pq.array[:, 1:], pq.tiles))
  pq = TileShardedArray(jnp.concatenate([idx_p.array, idx_q.array], axis=1), pq.tiles)
  ap, aq = _rotate(ap, aq)
  vp, vq = _rotate(vp, vq)
  return pq, ap, aq, vp, vq


def _sweep(_, carry):
  n = carry[1].shape[1]
  return jax.lax.fori_loop(0, n - 1, _step, carry)


def ipu_jacobi_eigh(x, num_iters: int = 1, tile_offset: int = 1):
  """``num_iters`` Jacobi sweeps of symmetric ``x`` (even ``N``) on tiles.

  Returns:
    ``(A, VT)``: the rotated matrix (eigenvalues on its diagonal) and the
    eigenvectors as rows, in the original index order.
  """
  n = x.shape[0]
  half = n // 2
  a_tiles = tuple(range(tile_offset, tile_offset + half))
  v_tiles = tuple(range(tile_offset + half, tile_offset + n))
  eye = jnp.eye(n, dtype=x.dtype)
  pq = tile_put_sharded(jnp.asarray(jacobi_initial_rotation_set(n).astype(np.int32)), a_tiles)
  ap, aq = tile_put_sharded(x[0::2], a_tiles), tile_put_sharded(x[1::2], a_tiles)
  vp, vq = tile_put_sharded(eye[0::2], v_tiles), tile_put_sharded(eye[1::2], v_tiles)
  pq, ap, aq, vp, vq = jax.lax.fori_loop(0, num_iters, _sweep, (pq, ap, aq, vp, vq))
  # Columns back to index order (A is symmetric: its columns are its rows).
  order = jnp.concatenate([pq.array[:, 0], pq.array[:, 1]])
  inverse = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
  a = jnp.concatenate([ap.array, aq.array])[inverse]
  vt = jnp.concatenate([vp.array, vq.array])[inverse]
  return a, vt


def _padded(x):
  """An odd-sized matrix padded with a decoupled diagonal entry above every eigenvalue."""
  n = x.shape[0]
  bound = 1 + 2 * jnp.max(jnp.sum(jnp.abs(x), axis=1))  # Gershgorin: above every eigenvalue
  return jnp.zeros((n + 1, n + 1), x.dtype).at[:n, :n].set(x).at[n, n].set(bound)


def ipu_eigh(x, *, lower: bool = True, symmetrize_input: bool = False,
             sort_eigenvalues: bool = True, num_iters: int = 1):
  """Eigen-decomposition of a symmetric matrix by Jacobi sweeps on tiles (TessellateIPU's).

  Args:
    x: ``[N, N]`` symmetric matrix (``N <= 1024``; odd ``N`` is padded with
      one decoupled diagonal entry, dropped from the result).
    lower: accepted for ``jnp.linalg.eigh`` compatibility (both triangles are read).
    symmetrize_input: must be False (as TessellateIPU).
    sort_eigenvalues: sort ascending.
    num_iters: Jacobi sweeps (TessellateIPU's default is one; use 6-10 for
      float32 accuracy on ``N`` up to a few hundred).

  Returns:
    ``(eigenvectors [N, N] (columns), eigenvalues [N])`` — TessellateIPU's order.

  Raises:
    ValueError: ``x`` is not square, ``N > 1024`` or ``symmetrize_input``. The
      tile program needs ``N + 1`` tiles (``N + 2`` for odd ``N``); fewer is an
      error when it is lowered.
  """
  del lower
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape[0] != x.shape[1]:
    raise ValueError(f"ipu_eigh: expected a square matrix, got shape {x.shape}.")
  if symmetrize_input:
    raise ValueError("ipu_eigh: symmetrize_input=True is not supported (as TessellateIPU).")
  n = x.shape[0]
  if n > 1024:
    raise ValueError(f"ipu_eigh: N={n} > 1024, TessellateIPU's limit.")
  xp = _padded(x) if n % 2 else x
  a, vt = ipu_jacobi_eigh(xp, num_iters=num_iters)
  values, vt = jnp.diag(a)[:n], vt[:n, :n]
  if sort_eigenvalues or n % 2:
    order = jnp.argsort(values)
    values, vt = values[order], vt[order]
  return vt.T, values
