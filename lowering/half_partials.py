"""Half partials as arithmetic: how an fp16 matmul accumulates in fp16.

With ``matmuls.partials_type = "float16"`` (TF-IPU ``partialsType``, PopTorch
``setPartialsType(torch.half)``) an fp16 x fp16 -> fp16 matmul keeps its partial
sums in fp16, so rounding happens all along the contraction, not once at the
end. The model here, used by the ``dot_general`` rule in place of one XLA dot:

1. each tile of the plan's ``gk`` contraction split holds ``bk`` of the ``K``
   terms; the AMP sums them in chains of :data:`AMP_CHAIN` products (each
   fp16 x fp16 product is exact in float32; the chain is summed in float32
   in order), and adds each chain's sum into the tile's fp16 partial, rounding
   to nearest every chain;
2. the ``gk`` partials of an output block are then added in order, in fp16
   (the partials type), rounding after each addition.

:func:`numpy_model` is the same order in NumPy, for tests. The chain length is
an *estimate* (the Mk2 AMP's internal accumulation depth is not public); the
order of the two stages follows the plan (``lowering/matmul_plan.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["AMP_CHAIN", "applies", "planned_dot", "numpy_model"]

AMP_CHAIN = 16


def applies(in_dtype, acc_dtype) -> bool:
  """Whether a matmul of ``in_dtype`` with ``acc_dtype`` partials accumulates in fp16."""
  return np.dtype(in_dtype) == np.float16 and np.dtype(acc_dtype) == np.float16


def _tile_partials(a, w, chain):
  """``a [G, M, bk] @ w [G, bk, N]`` accumulated chain by chain into fp16: ``[G, M, N]``."""
  g, m, bk = a.shape
  n = w.shape[-1]
  chunks = -(-bk // chain)
  pad = chunks * chain - bk
  a = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, 0), (0, pad)))
  w = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, pad), (0, 0)))
  a = jnp.moveaxis(a.reshape(g, m, chunks, chain), 2, 0)      # [chunks, G, M, chain]
  w = w.reshape(g, chunks, chain, n).transpose(1, 0, 2, 3)    # [chunks, G, chain, N]

  def chunk(acc, aw):
    ac, wc = aw
    s = ac[..., 0, None] * wc[:, None, 0, :]
    for j in range(1, chain):
      s = s + ac[..., j, None] * wc[:, None, j, :]
    return (acc.astype(jnp.float32) + s).astype(jnp.float16), None

  acc, _ = lax.scan(chunk, jnp.zeros((g, m, n), jnp.float16), (a, w))
  return acc


def planned_dot(a, w, gk: int, bk: int, chain: int = AMP_CHAIN):
  """``a [B, M, K] @ w [B, K, N]`` with fp16 partials, split as the plan splits K.

  Returns ``[B, M, N]`` float16.
  """
  b, m, k = a.shape
  n = w.shape[-1]
  pad = gk * bk - k
  a = jnp.pad(a, ((0, 0), (0, 0), (0, pad))).reshape(b, m, gk, bk).transpose(2, 0, 1, 3)
  w = jnp.pad(w, ((0, 0), (0, pad), (0, 0))).reshape(b, gk, bk, n).transpose(1, 0, 2, 3)
  parts = _tile_partials(a.reshape(gk * b, m, bk), w.reshape(gk * b, bk, n), chain)
  parts = parts.reshape(gk, b, m, n)

  def add(total, p):
    return (total.astype(jnp.float32) + p.astype(jnp.float32)).astype(jnp.float16), None

  total, _ = lax.scan(add, parts[0], parts[1:])
  return total


def numpy_model(a, w, gk: int, bk: int, chain: int = AMP_CHAIN) -> np.ndarray:
  """The accumulation order of :func:`planned_dot` in NumPy, for ``a [M, K] @ w [K, N]``."""
  a, w = np.asarray(a, np.float16), np.asarray(w, np.float16)
  m, k = a.shape
  n = w.shape[1]
  partials = []
  for t in range(gk):
    acc = np.zeros((m, n), np.float16)
    lo, hi = t * bk, min(k, (t + 1) * bk)
    for c in range(lo, lo + bk, chain):
      s = np.zeros((m, n), np.float32)
      for j in range(c, c + chain):
        if j < hi:
          s = s + np.outer(a[:, j].astype(np.float32), w[j].astype(np.float32))
        else:
          s = s + np.float32(0)
      acc = (acc.astype(np.float32) + s).astype(np.float16)
    partials.append(acc)
  total = partials[0]
  for p in partials[1:]:
    total = (total.astype(np.float32) + p.astype(np.float32)).astype(np.float16)
  return total
