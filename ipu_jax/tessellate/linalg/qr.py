"""``ipu_qr``: Householder QR as a tile program (TessellateIPU's layout).

As TessellateIPU's ``tessellate_ipu/linalg/tile_linalg_qr.py`` describes it
(the program is written here): ``Q``'s rows live on tiles ``0 .. N-1`` and
``R``'s columns (rows of ``R^T``) on tiles ``N .. 2N-1``. Step ``k``
(``N - 1`` of them, in a ``fori_loop``):

1. ``QRCorrectionVectorVertex`` on one tile: the Householder vector ``v`` of
   column ``k`` of ``R`` (zero above ``k``; ``v_k -= sign * ||x||``) and its
   scale ``2 / ||v||^2``.
2. ``v`` and the scale replicated on every Q and R tile.
3. ``DotProduct1dVertex`` then ``QRHouseholderRowUpdateVertex`` on every tile:
   ``row -= scale * (row . v) * v``, i.e. ``R <- H R`` (on R's columns) and
   ``Q <- Q H`` (on Q's rows).

Cycle counts (estimates sitting under TessellateIPU's published hardware
figures, see :mod:`ipu_jax.tessellate.linalg.vertices`): row update
``60 + 2.4 N`` (measured ~683 cycles on Mk2 at N=256, TessellateIPU's
``tessellate-ipu/tests/linalg/test_tile_linalg_qr.py``), correction vector ``200 + 5 N``
(bound 950 at N=128), dot product ``100 + 1.25 N`` (bound 800 at N=512), leaving 12 partial sums
(six workers x two lanes) that a reduce adds.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from ipu_jax.tessellate.linalg.vertices import column_cycles, linalg_vertex
from ipu_jax.tessellate.tile_array import TileShardedArray
from ipu_jax.tessellate.tile_map import tile_map
from ipu_jax.tessellate.tile_put import tile_put_replicated, tile_put_sharded
from ipu_jax.tessellate.worklists import make_ipu_vector1d_worker_offsets  # noqa: F401  (TessellateIPU re-exports it here)

__all__ = ["ipu_qr", "ipu_qr_shard_inputs", "ipu_qr_iterations", "householder_vector",
           "dot_product1d_p", "qr_correction_vector_p", "qr_householder_row_update_p",
           "householder_step"]


def householder_vector(col, sdiag, k):
  """``(v, 2 / ||v||^2)``: the reflector zeroing ``col`` below index ``k``.

  ``sdiag[k]`` is the sign given for the pivot (TessellateIPU passes the
  input's diagonal signs); a zero sign takes the pivot's own sign, the
  cancellation-free choice (Golub & Van Loan, Algorithm 5.1.1).
  """
  n = col.shape[0]
  idx = jnp.arange(n)
  v = jnp.where(idx >= k, col, 0)
  norm = jnp.sqrt(jnp.sum(v * v))
  pivot = col[k]
  sign = jnp.where(sdiag[k] != 0, jnp.sign(sdiag[k]), jnp.where(pivot >= 0, 1.0, -1.0))
  v = v.at[k].add(-sign.astype(col.dtype) * norm)
  vv = jnp.sum(v * v)
  scale = jnp.where(vv > 0, 2.0 / jnp.where(vv > 0, vv, 1.0), 0.0)
  return v, jnp.reshape(scale, (1,)).astype(col.dtype)


def _correction(col, sdiag, k=None, col_idx=None):
  # The column index: an operand (a loop counter) or TessellateIPU's static ``col_idx``.
  k = jnp.reshape(k, ())[()] if k is not None else col_idx
  return householder_vector(col, sdiag, k)


#: Partial sums a dot product leaves: 6 workers x 2 float lanes (TessellateIPU's layout).
DOT_PARTIALS = 12


def _dot(v, x):
  # Worker w's lanes hold the products of its contiguous range; summed later.
  prod = v * x[x.shape[0] - v.shape[0]:]
  pad = (-prod.shape[0]) % DOT_PARTIALS
  prod = jnp.pad(prod, (0, pad)).reshape(DOT_PARTIALS, -1)
  return prod.sum(axis=1)


def _row_update(x, v, w, scale, start_idx=0):
  # Only x[start_idx:] changes (v is zero before it: TessellateIPU's skipped prefix).
  start = x.shape[0] - v.shape[0] if start_idx is None else int(start_idx)
  return x.at[start:].add(-(w[0] * scale[0]) * v[v.shape[0] - (x.shape[0] - start):])


qr_correction_vector_p = linalg_vertex("QRCorrectionVectorVertex", _correction,
                                       column_cycles(200, 5))
dot_product1d_p = linalg_vertex("DotProduct1dVertex", _dot, column_cycles(100, 1.25))
qr_householder_row_update_p = linalg_vertex("QRHouseholderRowUpdateVertex", _row_update,
                                            column_cycles(60, 2.4))


def householder_step(rows: TileShardedArray, v, scale) -> TileShardedArray:
  """``row -= scale * (row . v) * v`` on every tile of ``rows`` (``v``, ``scale``: one tile's)."""
  v_rep = tile_put_replicated(v, rows.tiles)
  s_rep = tile_put_replicated(scale, rows.tiles)
  w = tile_map(jax.lax.reduce_sum_p, tile_map(dot_product1d_p, v_rep, rows), axes=(0,))
  w = w.reshape((len(w.tiles), 1))
  return tile_map(qr_householder_row_update_p, rows, v_rep, w, s_rep)


def correction_on_tile(col, sdiag, k, tile: int):
  """The Householder vector of ``col`` below ``k``, computed on one ``tile``."""
  col_t = tile_put_replicated(col, (tile,))
  sd_t = tile_put_replicated(sdiag, (tile,))
  k_t = tile_put_replicated(jnp.reshape(k, (1,)).astype(jnp.int32), (tile,))
  v, scale = tile_map(qr_correction_vector_p, col_t, sd_t, k_t)
  return v.array[0], scale.array[0]


def ipu_qr_shard_inputs(x, xsdiag) -> Tuple[TileShardedArray, TileShardedArray, TileShardedArray]:
  """Q (identity rows) on tiles ``0..N-1``, ``R^T`` on ``N..2N-1``, the signs on R's tiles."""
  n = x.shape[0]
  q_tiles, r_tiles = tuple(range(n)), tuple(range(n, 2 * n))
  q = tile_put_sharded(jnp.eye(n, dtype=x.dtype), q_tiles)
  rt = tile_put_sharded(jnp.asarray(x).T, r_tiles)
  return q, rt, tile_put_replicated(jnp.asarray(xsdiag, x.dtype), r_tiles)


def ipu_qr_iterations(q: TileShardedArray, rt: TileShardedArray, sdiag: TileShardedArray):
  """The ``N - 1`` Householder steps; returns ``(Q, R^T)``."""
  n = len(q)

  def body(k, carry):
    q, rt = carry
    col = jax.lax.dynamic_index_in_dim(rt.array, k, keepdims=False)
    v, scale = correction_on_tile(col, sdiag.array[0], k, rt.tiles[0])
    return householder_step(q, v, scale), householder_step(rt, v, scale)

  return jax.lax.fori_loop(0, n - 1, body, (q, rt))


def ipu_qr(x, xsdiag: Optional[jax.Array] = None) -> Tuple[TileShardedArray, TileShardedArray]:
  """QR decomposition of a square ``x`` by Householder reflections on ``2 N`` tiles.

  Args:
    x: ``[N, N]`` matrix.
    xsdiag: the sign to give each pivot (TessellateIPU passes
      ``sign(diag(x))``); None or 0 entries: the pivot's own sign.

  Returns:
    ``(Q, R^T)`` as :class:`TileShardedArray` (TessellateIPU returns ``R^T``):
    ``Q`` orthogonal, ``R`` upper triangular, ``Q R = x``.
  """
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape[0] != x.shape[1]:
    raise ValueError(f"ipu_qr: expected a square matrix, got shape {x.shape}.")
  if xsdiag is None:
    xsdiag = jnp.zeros(x.shape[0], x.dtype)
  return ipu_qr_iterations(*ipu_qr_shard_inputs(x, xsdiag))
