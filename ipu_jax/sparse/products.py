"""The arithmetic of block-sparse products, in plain JAX (no tiles).

A product is handled in its *frame* ``out[R, F] = S[R, C] @ D[C, F]`` with
the sparse operand on the left: a sparse x dense product is its own frame, a
dense x sparse one ``a @ S`` is framed as ``S^T @ a^T`` (the pattern
transposed, each block transposed, results transposed back). Products run
block by block in the partials type (float32), never through a dense copy of
the sparse operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering import sparse_plan
from ipu_jax.lowering.matmul_plan import partials_dtype, widen_to_partials
from ipu_jax.sparse.formats import SparsityPattern

__all__ = ["frame", "frame_dense", "unframe", "accumulator", "static_accumulator", "band_partials",
           "reference_product", "values_gradient"]


def accumulator(dtype) -> np.dtype:
  """The partials type of a sparse product of ``dtype`` operands (float32 for floats)."""
  return partials_dtype(dtype, dtype, "float32")


def static_accumulator(dtype) -> np.dtype:
  """The partials type of a ``popsparse::static_`` product (half for float16 data).

  :func:`ipu_jax.lowering.sparse_plan.static_partials_dtype`. The products
  themselves are summed in float32 and rounded once when written, as the
  static vertices' C++ forms sum in float.
  """
  return sparse_plan.static_partials_dtype(dtype)


def frame(values, pattern: SparsityPattern, side: str):
  """``(values, pattern)`` of the frame's sparse operand ``S`` (``S^T`` for ``side='rhs'``)."""
  if side == "lhs":
    return values, pattern
  transposed, order = pattern.transpose()
  return jnp.swapaxes(values[..., order, :, :], -1, -2), transposed


def frame_dense(dense, side: str):
  """The frame's dense operand ``[C, F]``."""
  return dense if side == "lhs" else dense.T


def unframe(out, side: str):
  """The frame's ``[R, F]`` result as the user's (transposed for ``side='rhs'``)."""
  return out if side == "lhs" else out.T


def _contributions(values, rows_cols, dense, block: int, acc):
  """``[nnz, b, F]``: each block times the dense rows of its block column."""
  _, cols = rows_cols
  c, f = dense.shape
  dense_blocks = widen_to_partials(dense, acc).reshape(c // block, block, f)
  return jnp.einsum("nab,nbf->naf", widen_to_partials(values, acc), dense_blocks[cols],
                    preferred_element_type=acc)


def band_partials(values, pattern: SparsityPattern, dense, col_band: int, bands: int):
  """``[bands, R, F]`` partials: band ``y`` sums the blocks of block columns
  ``[y * col_band, (y + 1) * col_band)`` (float32 for float operands)."""
  acc = accumulator(values.dtype)
  rb, b = pattern.grid[0], pattern.block[0]
  f = dense.shape[1]
  if pattern.nnz_blocks == 0:
    return jnp.zeros((bands, pattern.shape[0], f), acc)
  rows, cols = pattern.row_indices, pattern.col_indices
  contrib = _contributions(values, (rows, cols), dense, b, acc)
  segment = (cols // col_band).astype(np.int64) * rb + rows
  summed = jax.ops.segment_sum(contrib, segment, num_segments=bands * rb)
  return summed.reshape(bands, rb * b, f)


def reference_product(values, pattern: SparsityPattern, dense, side: str):
  """The product in the operands' dtype (what ``jax.jit`` off the IPU computes)."""
  fv, fp = frame(values, pattern, side)
  out = band_partials(fv, fp, frame_dense(dense, side), max(fp.grid[1], 1), 1)[0]
  return unframe(out.astype(values.dtype), side)


def values_gradient(ct, dense, pattern: SparsityPattern, side: str):
  """``d out / d values`` contracted with ``ct``: one ``b x b`` block per non-zero.

  Sparse x dense (``out = S D``): block ``(r, c)`` gets ``ct[r] @ D[c]^T``;
  dense x sparse (``out = A S``): block ``(r, c)`` gets ``A[:, r]^T @ ct[:, c]``.
  """
  out_dtype = dense.dtype
  acc = accumulator(out_dtype)
  bm, bk = pattern.block
  if pattern.nnz_blocks == 0:
    return jnp.zeros((0, bm, bk), out_dtype)
  rows, cols = pattern.row_indices, pattern.col_indices
  ct, dense = widen_to_partials(ct, acc), widen_to_partials(dense, acc)
  if side == "lhs":
    ct_b = ct.reshape(pattern.grid[0], bm, -1)[rows]
    d_b = dense.reshape(pattern.grid[1], bk, -1)[cols]
    grad = jnp.einsum("naf,nbf->nab", ct_b, d_b, preferred_element_type=acc)
  else:
    a_b = dense.reshape(dense.shape[0], pattern.grid[0], bm)[:, rows]
    ct_b = ct.reshape(ct.shape[0], pattern.grid[1], bk)[:, cols]
    grad = jnp.einsum("fna,fnb->nab", a_b, ct_b, preferred_element_type=acc)
  return grad.astype(out_dtype)
