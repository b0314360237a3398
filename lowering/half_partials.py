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
2. the ``gk`` partials of an output block are then added in fp16 (the
   partials type), rounding after each addition, in the order of the plan's
   reduction: in order 0, 1, ..., gk - 1 when the tiles reduce-scatter the
   block in one stage; stage by stage when the plan sums them in a tree
   (``plan.reduce_fanins``: each stage adds groups of ``fanin`` consecutive
   partials in order, the last group possibly shorter) or reduce-scatters
   them in poplin's stages (``plan.scatter_stages``, from ``gk = 16``: each
   stage adds poplin's balanced sections of consecutive partials in order).

Both executor modes use these functions: ``"batched"`` computes the whole
product with :func:`planned_dot`, ``"per_tile"`` cuts the per-tile blocks and
calls :func:`tile_partials` on them, then :func:`add_in_order` in its reduce
steps. A convolution with a split contraction and fp16 partials adds its
partial convolutions in the same order (:func:`reduce_partials` in the
``"batched"`` form, :func:`add_in_order` in its reduce steps; one stage, or
poplin's stages from ``gk = 16``). :func:`numpy_model` is the same order in
NumPy, for tests. The chain length is an *estimate* (the Mk2 AMP's internal
accumulation depth is not public); the order of the two stages follows the
plan (``lowering/matmul_plan.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering.matmul_cost import balanced_bounds

__all__ = ["AMP_CHAIN", "applies", "tile_partials", "add_in_order", "reduce_partials",
           "planned_dot", "numpy_model"]

AMP_CHAIN = 16


def applies(in_dtype, acc_dtype) -> bool:
  """Whether a matmul of ``in_dtype`` with ``acc_dtype`` partials accumulates in fp16."""
  return np.dtype(in_dtype) == np.float16 and np.dtype(acc_dtype) == np.float16


def tile_partials(a, w, chain: int = AMP_CHAIN):
  """``a [G, M, bk] @ w [G, bk, N]`` accumulated chain by chain into fp16: ``[G, M, N]``.

  One tile's AMP work for each of the ``G`` blocks: products summed in
  float32 in chains of ``chain``, each chain added into the fp16 partial.
  """
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


def add_in_order(parts, members=None):
  """``parts[0] + parts[1] + ...`` in fp16, rounding after each addition.

  Args:
    parts: ``[count, ...]`` float16 partials.
    members: optional count of valid partials, broadcastable to
      ``parts.shape[1:]``; partials at or past it are skipped (not added as
      zeros, which would turn a ``-0`` sum into ``+0``).

  Returns:
    ``parts.shape[1:]`` float16.
  """
  def add(carry, part):
    total, j = carry
    added = (total.astype(jnp.float32) + part.astype(jnp.float32)).astype(jnp.float16)
    if members is not None:
      added = jnp.where(j < members, added, total)
    return (added, j + 1), None

  (total, _), _ = lax.scan(add, (parts[0].astype(jnp.float16), jnp.int32(1)), parts[1:])
  return total


def _reduce_stages(parts, fanins):
  """The plan's reduction of ``parts [gk, ...]``: one stage per fan-in."""
  for fanin in fanins:
    count = parts.shape[0]
    groups = -(-count // fanin)
    members = np.minimum(fanin, count - np.arange(groups) * fanin)
    pad = [(0, groups * fanin - count)] + [(0, 0)] * (parts.ndim - 1)
    x = jnp.pad(parts, pad).reshape((groups, fanin) + parts.shape[1:])
    x = jnp.moveaxis(x, 1, 0)                                    # [fanin, groups, ...]
    parts = add_in_order(x, members.reshape((groups,) + (1,) * (parts.ndim - 1)))
  return parts[0]


def _reduce_levels(parts, levels):
  """A staged reduce-scatter's order: each stage sums poplin's sections of the partials."""
  for new in levels:
    count = parts.shape[0]
    bounds = balanced_bounds(count, new)
    members = np.diff(bounds)
    index = bounds[:-1, None] + np.arange(members.max())[None, :]     # [new, most]
    index = np.where(index < bounds[1:, None], index, count)          # past a section: zeros
    padded = jnp.concatenate([parts, jnp.zeros((1,) + parts.shape[1:], parts.dtype)])
    x = jnp.moveaxis(padded[index], 1, 0)                              # [most, new, ...]
    parts = add_in_order(x, members.reshape((new,) + (1,) * (parts.ndim - 1)))
  return parts[0]


def reduce_partials(parts, fanins=(), levels=()):
  """``parts [gk, ...]`` fp16 partials added in the plan's order, rounding each addition.

  Args:
    parts: the ``gk`` partials of every output element.
    fanins: a tree reduction's fan-ins (``plan.reduce_fanins``).
    levels: a staged reduce-scatter's partials left after each stage
      (``scatter_stages``, when it has more than one stage).

  Neither: one reduce-scatter, the partials added in order 0, 1, ...
  """
  if levels:
    return _reduce_levels(parts, levels)
  return _reduce_stages(parts, tuple(fanins) or (parts.shape[0],))


def planned_dot(a, w, gk: int, bk: int, chain: int = AMP_CHAIN, fanins=(), levels=()):
  """``a [B, M, K] @ w [B, K, N]`` with fp16 partials, split as the plan splits K.

  Args:
    a, w: the float16 operands.
    gk, bk: the plan's contraction split: ``gk`` tiles of ``bk`` terms.
    chain: the AMP's accumulation chain.
    fanins: the plan's tree reduction (``plan.reduce_fanins``); empty: the
      partials are added in order (a reduce-scatter).
    levels: a staged reduce-scatter's partials left after each stage
      (``plan.scatter_stages``, when it has more than one stage).

  Returns ``[B, M, N]`` float16.
  """
  b, m, k = a.shape
  n = w.shape[-1]
  pad = gk * bk - k
  a = jnp.pad(a, ((0, 0), (0, 0), (0, pad))).reshape(b, m, gk, bk).transpose(2, 0, 1, 3)
  w = jnp.pad(w, ((0, 0), (0, pad), (0, 0))).reshape(b, gk, bk, n).transpose(1, 0, 2, 3)
  parts = tile_partials(a.reshape(gk * b, m, bk), w.reshape(gk * b, bk, n), chain)
  return reduce_partials(parts.reshape(gk, b, m, n), fanins, levels)


def numpy_model(a, w, gk: int, bk: int, chain: int = AMP_CHAIN, fanins=(),
                levels=()) -> np.ndarray:
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
  for groups in _section_bounds(gk, fanins, levels):
    sums = []
    for lo, hi in zip(groups[:-1], groups[1:]):
      total = partials[lo]
      for p in partials[lo + 1:hi]:
        total = (total.astype(np.float32) + p.astype(np.float32)).astype(np.float16)
      sums.append(total)
    partials = sums
  return partials[0]


def _section_bounds(gk: int, fanins, levels) -> list:
  """Each stage's section bounds: ``levels``' balanced sections, else groups of each fan-in."""
  stages, count = [], gk
  for step in (levels or tuple(fanins) or (gk,)):
    if levels:
      bounds = balanced_bounds(count, step)
    else:
      bounds = np.unique(np.minimum(np.arange(0, count + step, step), count))
    stages.append([int(x) for x in bounds])
    count = len(bounds) - 1
  return stages
