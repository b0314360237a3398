"""``ipu_hessenberg``: Householder reduction to upper Hessenberg form on tiles (TessellateIPU's).

As TessellateIPU's ``tessellate_ipu/linalg/tile_linalg_hessenberg.py``
describes it (the program is written here): ``Q``'s rows on tiles
``0 .. N-1``, ``H``'s rows on ``N .. 2N-1``. Step ``i`` (``N - 2`` of them,
in a ``fori_loop``): the reflector ``v`` zeroing column ``i`` below the
subdiagonal is computed on one tile, replicated, then ``H <- P H`` (on the
columns: ``H^T`` sharded by a transposing exchange), ``H <- H P`` and
``Q <- Q P`` on the rows, with ``P = I - 2 v v^T / ||v||^2``. The vertices and
their cycle counts are QR's (:mod:`ipu_jax.tessellate.linalg.qr`).
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

from ipu_jax.tessellate.linalg.qr import correction_on_tile, householder_step
from ipu_jax.tessellate.tile_array import TileShardedArray
from ipu_jax.tessellate.tile_put import tile_put_replicated, tile_put_sharded

__all__ = ["ipu_hessenberg", "ipu_hessenberg_iterations"]


def ipu_hessenberg_iterations(q: TileShardedArray, h: TileShardedArray, sdiag: TileShardedArray):
  """The ``N - 2`` reflections; returns ``(Q, H)``."""
  n = len(q)

  def body(i, carry):
    q, h = carry
    col = jax.lax.dynamic_index_in_dim(h.array, i, axis=1, keepdims=False)
    v, scale = correction_on_tile(col, sdiag.array[0], i + 1, h.tiles[0])
    ht = householder_step(tile_put_sharded(h.array.T, h.tiles), v, scale)
    h = householder_step(tile_put_sharded(ht.array.T, h.tiles), v, scale)
    return householder_step(q, v, scale), h

  return jax.lax.fori_loop(0, max(n - 2, 0), body, (q, h))


def ipu_hessenberg(x) -> Tuple[TileShardedArray, TileShardedArray]:
  """Hessenberg decomposition ``x = Q H Q^T`` on ``2 N`` tiles.

  Args:
    x: ``[N, N]`` matrix.

  Returns:
    ``(Q, H)`` as :class:`TileShardedArray` (rows on tiles): ``Q``
    orthogonal, ``H`` upper Hessenberg.
  """
  x = jnp.asarray(x)
  if x.ndim != 2 or x.shape[0] != x.shape[1]:
    raise ValueError(f"ipu_hessenberg: expected a square matrix, got shape {x.shape}.")
  n = x.shape[0]
  q = tile_put_sharded(jnp.eye(n, dtype=x.dtype), tuple(range(n)))
  h = tile_put_sharded(x, tuple(range(n, 2 * n)))
  # Pivot signs: zero, i.e. each pivot's own sign (cancellation-free).
  sdiag = tile_put_replicated(jnp.zeros(n, x.dtype), h.tiles)
  return ipu_hessenberg_iterations(q, h, sdiag)
