"""``static_matmul``: sparse x dense and dense x sparse with the pattern known when lowering.

One primitive, ``ipu_static_sparse_matmul``, with operands ``(values, dense)``
and the static parameters ``pattern`` (a :class:`SparsityPattern`), ``side``
(``"lhs"``: ``S @ dense``; ``"rhs"``: ``dense @ S``) and
``available_memory_proportion``. It is linear in each operand: its JVP and
transposes give gradients with respect to the dense operand (another static
sparse product, with the transposed pattern) and the non-zero values (one
``b x b`` block per non-zero, never a dense gradient). Its tile rule is in
:mod:`ipu_jax.sparse.static_rule`.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.ops.primitive import define_primitive, not_mapped, shaped_like
from ipu_jax.sparse import products
from ipu_jax.sparse.formats import BlockCSR, SparsityPattern

__all__ = ["static_matmul", "static_sparse_matmul_p", "block_diagonal"]

static_sparse_matmul_p = jcore.Primitive("ipu_static_sparse_matmul")


def _impl(values, dense, *, pattern, side, available_memory_proportion):
  del available_memory_proportion
  return products.reference_product(values, pattern, dense, side)


def _out_shape(pattern: SparsityPattern, dense_shape, side) -> tuple:
  if side == "lhs":
    return (pattern.shape[0], dense_shape[1])
  return (dense_shape[0], pattern.shape[1])


def _abstract_eval(values, dense, *, pattern, side, available_memory_proportion):
  del available_memory_proportion
  want = (pattern.nnz_blocks,) + pattern.block
  if tuple(values.shape) != want:
    raise TypeError(f"ipu_static_sparse_matmul: values must be {list(want)}, got "
                    f"{list(values.shape)}.")
  if dense.ndim != 2:
    raise TypeError(f"ipu_static_sparse_matmul: the dense operand must be a matrix, got "
                    f"shape {dense.shape}.")
  if values.dtype != dense.dtype:
    raise TypeError(f"ipu_static_sparse_matmul: operand dtypes differ: {values.dtype} and "
                    f"{dense.dtype}.")
  return shaped_like(_out_shape(pattern, dense.shape, side), dense.dtype)


def _transposed(values, pattern):
  t_pattern, order = pattern.transpose()
  return jnp.swapaxes(values[order], -1, -2), t_pattern


def _transpose_values(ct, values, dense, *, pattern, side, available_memory_proportion):
  del values, available_memory_proportion
  return products.values_gradient(ct, dense, pattern, side)


def _transpose_dense(ct, values, dense, *, pattern, side, available_memory_proportion):
  del dense
  t_values, t_pattern = _transposed(values, pattern)
  # S @ D -> D's cotangent S^T @ ct; A @ S -> A's cotangent ct @ S^T.
  return static_sparse_matmul_p.bind(t_values, ct, pattern=t_pattern, side=side,
                                     available_memory_proportion=available_memory_proportion)


def block_diagonal(pattern: SparsityPattern, copies: int) -> SparsityPattern:
  """``copies`` of ``pattern`` along the diagonal of a ``copies``-times larger matrix."""
  rb, cb = pattern.grid
  nnz = pattern.nnz_blocks
  offsets = (pattern.row_offsets[None, :-1].astype(np.int64)
             + nnz * np.arange(copies)[:, None]).reshape(-1)
  cols = (pattern.col_indices[None, :].astype(np.int64)
          + cb * np.arange(copies)[:, None]).reshape(-1)
  shape = (pattern.shape[0] * copies, pattern.shape[1] * copies)
  return SparsityPattern(shape, pattern.block, np.append(offsets, nnz * copies), cols)


def _batch(args, dims, *, pattern, side, available_memory_proportion):
  values, dense = args
  dv, dd = dims
  params = dict(side=side, available_memory_proportion=available_memory_proportion)
  if dv is not_mapped:
    # A shared sparse operand: the batch joins the dense operand's free axis.
    if side == "lhs":
      d = jnp.moveaxis(dense, dd, 1)                     # [C, B, F]
      out = static_sparse_matmul_p.bind(values, d.reshape(d.shape[0], -1), pattern=pattern,
                                        **params)
      return out.reshape(out.shape[0], d.shape[1], d.shape[2]), 1
    d = jnp.moveaxis(dense, dd, 0)                       # [B, F, C]
    out = static_sparse_matmul_p.bind(values, d.reshape(-1, d.shape[2]), pattern=pattern,
                                      **params)
    return out.reshape(d.shape[0], d.shape[1], out.shape[1]), 0
  # Batched values: one product with the patterns along a block diagonal.
  values = jnp.moveaxis(values, dv, 0)
  copies = values.shape[0]
  dense = (jnp.broadcast_to(dense, (copies,) + dense.shape) if dd is not_mapped
           else jnp.moveaxis(dense, dd, 0))
  big = block_diagonal(pattern, copies)
  flat_values = values.reshape((-1,) + values.shape[2:])
  if side == "lhs":
    out = static_sparse_matmul_p.bind(flat_values, dense.reshape(-1, dense.shape[2]),
                                      pattern=big, **params)
    return out.reshape(copies, -1, out.shape[1]), 0
  stacked = jnp.moveaxis(dense, 0, 1).reshape(dense.shape[1], -1)   # [F, B*C]
  out = static_sparse_matmul_p.bind(flat_values, stacked, pattern=big, **params)
  return out.reshape(out.shape[0], copies, -1), 1


define_primitive(static_sparse_matmul_p, _impl, _abstract_eval, batch=_batch)
ad.defbilinear(static_sparse_matmul_p, _transpose_values, _transpose_dense)


def _check_proportion(value) -> Optional[float]:
  if value is None:
    return None
  value = float(value)
  if not 0 < value <= 1:
    raise ValueError(f"static_matmul: available_memory_proportion must be in (0, 1], got "
                     f"{value}.")
  return value


def _check_operands(sparse: BlockCSR, dense, side: str):
  dense = jnp.asarray(dense)
  if dense.ndim != 2:
    raise ValueError(f"static_matmul: the dense operand must be a matrix, got shape "
                     f"{dense.shape} (use jax.vmap for batches).")
  m, k = sparse.shape
  contracted = dense.shape[0] if side == "lhs" else dense.shape[1]
  if contracted != (k if side == "lhs" else m):
    what = (f"sparse {sparse.shape} @ dense {dense.shape}" if side == "lhs"
            else f"dense {dense.shape} @ sparse {sparse.shape}")
    raise ValueError(f"static_matmul: contracting dimensions differ: {what}.")
  if sparse.dtype != dense.dtype:
    raise ValueError(f"static_matmul: operand dtypes differ: sparse values are "
                     f"{sparse.dtype}, the dense operand {dense.dtype}; cast one of them.")
  if not jnp.issubdtype(dense.dtype, jnp.floating):
    raise ValueError(f"static_matmul: operands must be floating point, got {dense.dtype}.")
  if sparse.values.ndim != 3:
    raise ValueError(f"static_matmul: values must be [nnz_blocks, bm, bk], got shape "
                     f"{sparse.values.shape}.")
  return dense


def static_matmul(a, b, available_memory_proportion: Optional[float] = None):
  """``a @ b`` where exactly one operand is a :class:`BlockCSR` with a static pattern.

  Args:
    a, b: a ``BlockCSR`` and a dense matrix, in either order.
    available_memory_proportion: the fraction of tile memory the plan's
      temporaries may use (default ``matmuls.available_memory_proportion``).

  Returns:
    The dense product, in the operands' dtype (partials in float32).

  Raises:
    ValueError: neither or both operands sparse, shapes that do not contract,
      differing dtypes, a non-float dtype.
  """
  amp = _check_proportion(available_memory_proportion)
  a_sparse, b_sparse = isinstance(a, BlockCSR), isinstance(b, BlockCSR)
  if a_sparse == b_sparse:
    raise ValueError("static_matmul: exactly one operand must be a BlockCSR, got "
                     f"{type(a).__name__} and {type(b).__name__}.")
  sparse, dense, side = (a, b, "lhs") if a_sparse else (b, a, "rhs")
  dense = _check_operands(sparse, dense, side)
  return static_sparse_matmul_p.bind(sparse.values, dense, pattern=sparse.pattern, side=side,
                                     available_memory_proportion=amp)
