"""``matmul``: ``jnp.matmul`` with poplin's per-op planning options."""

from __future__ import annotations

import functools
from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.lowering import half_partials
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.matmul_plan import partials_dtype
from ipu_jax.ops.primitive import shaped_like, define_primitive, not_mapped
from ipu_jax.lowering.matmul_emit import emit_matmul
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.movement import broadcast_to


matmul_p = jcore.Primitive("ipu_matmul")

def _batch_shape(a_shape, b_shape):
  return tuple(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))


def _matmul_impl(a, b, *, available_memory_proportion, partials_type):
  """Reference semantics outside the tile program (no plan): one tile's arithmetic."""
  del available_memory_proportion
  out_dtype = a.dtype
  # The partials rule the tile lowering uses (one rule for every matmul).
  acc = partials_dtype(out_dtype, out_dtype, partials_type or "float32")
  if half_partials.applies(out_dtype, acc):
    # fp16 partials: the AMP chains of one tile holding all of K (the tile
    # program uses the same model with its plan's K split).
    batch = _batch_shape(a.shape, b.shape)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3 = jnp.broadcast_to(a, batch + (m, k)).reshape(-1, m, k)
    b3 = jnp.broadcast_to(b, batch + (k, n)).reshape(-1, k, n)
    if k == 0:
      return jnp.zeros(batch + (m, n), out_dtype)
    return half_partials.planned_dot(a3, b3, 1, k).reshape(batch + (m, n))
  return jnp.matmul(a, b, preferred_element_type=acc).astype(out_dtype)


def _matmul_abstract_eval(a, b, *, available_memory_proportion, partials_type):
  del available_memory_proportion, partials_type
  if a.ndim < 2 or b.ndim < 2:
    raise TypeError(f"ipu_matmul needs operands of rank >= 2, got {a.shape} and {b.shape}.")
  if a.shape[-1] != b.shape[-2]:
    raise TypeError(f"ipu_matmul: contracting dimensions differ: {a.shape} @ {b.shape}.")
  if a.dtype != b.dtype:
    raise TypeError(f"ipu_matmul: operand dtypes differ: {a.dtype} and {b.dtype}.")
  shape = _batch_shape(a.shape, b.shape) + (a.shape[-2], b.shape[-1])
  return shaped_like(shape, a.dtype, a)


def _sum_to_shape(x, shape):
  """Sum the leading/broadcast axes of ``x`` so it has ``shape``."""
  shape = tuple(shape)
  extra = x.ndim - len(shape)
  if extra:
    x = jnp.sum(x, axis=tuple(range(extra)))
  axes = tuple(i for i, (s, t) in enumerate(zip(x.shape, shape)) if t == 1 and s != 1)
  if axes:
    x = jnp.sum(x, axis=axes, keepdims=True)
  return x


def _mT(x):
  return jnp.swapaxes(x, -1, -2)


# A matrix shared by a batch of products (a weight applied to a batch of
# sequences) gets the sum of the batch's gradients. Summing products is one
# product with a longer contraction, so the batch joins the contraction and no
# ``[batch, K, N]`` stack of per-item gradients is made (and summed in float32
# after): dB = A^T @ dC with A's and dC's batch and rows flattened together,
# dA = dC @ B^T with dC's and B's batch and columns flattened together.


def shared_by_batch(shared_aval, other) -> bool:
  """Whether a 2-D operand was applied to every item of ``other``'s batch."""
  return len(shared_aval.shape) == 2 and jnp.ndim(other) > 2


def folded_lhs_gradient_operands(ct, b):
  """``(dC', B')`` with ``dC' @ B'`` the batch-summed gradient of a shared 2-D ``a``."""
  ct = jnp.broadcast_to(ct, _batch_shape(ct.shape, b.shape) + ct.shape[-2:])
  b = jnp.broadcast_to(b, ct.shape[:-2] + b.shape[-2:])
  return (jnp.moveaxis(ct, -2, 0).reshape(ct.shape[-2], -1),   # [M, (... N)]
          _mT(b).reshape(-1, b.shape[-2]))                     # [(... N), K]


def folded_rhs_gradient_operands(ct, a):
  """``(A', dC')`` with ``A' @ dC'`` the batch-summed gradient of a shared 2-D ``b``."""
  ct = jnp.broadcast_to(ct, _batch_shape(ct.shape, a.shape) + ct.shape[-2:])
  a = jnp.broadcast_to(a, ct.shape[:-2] + a.shape[-2:])
  return a.reshape(-1, a.shape[-1]).T, ct.reshape(-1, ct.shape[-1])  # [K, (... M)], [(... M), N]


def _matmul_transpose_lhs(ct, a, b, **params):
  if shared_by_batch(a.aval, b):
    return matmul_p.bind(*folded_lhs_gradient_operands(ct, b), **params).astype(a.aval.dtype)
  shape = a.aval.shape
  return _sum_to_shape(matmul_p.bind(ct, _mT(b), **params), shape).astype(a.aval.dtype)


def _matmul_transpose_rhs(ct, a, b, **params):
  if shared_by_batch(b.aval, a):
    return matmul_p.bind(*folded_rhs_gradient_operands(ct, a), **params).astype(b.aval.dtype)
  shape = b.aval.shape
  return _sum_to_shape(matmul_p.bind(_mT(a), ct, **params), shape).astype(b.aval.dtype)


def batch_matmul_like(primitive, args, dims, **params):
  """vmap of a matmul-like primitive ``primitive(a, b, **params)``: ``(out, out_dim)``.

  Shared by every primitive with ``jnp.matmul``'s operand convention (this
  one and :mod:`ipu_jax.ops.serialized_matmul`). A shared matrix folds the
  batch into the other operand's rows or columns (one larger product, the
  way a user would write it); otherwise the batch leads both operands as a
  batch dimension (size 1 for an unbatched operand: matmul broadcasts it).
  """
  a, b = args
  da, db = dims
  if da is not not_mapped and db is not_mapped and b.ndim == 2:
    # x @ W with W shared: fold the batch into the rows.
    a = jnp.moveaxis(a, da, 0)
    out = primitive.bind(a.reshape((-1, a.shape[-1])), b, **params)
    return out.reshape(a.shape[:-1] + (b.shape[-1],)), 0
  if da is not_mapped and db is not not_mapped and a.ndim == 2:
    # A @ x with A shared: fold the batch into the columns.
    b = jnp.moveaxis(b, db, -2)                       # [..., K, B, N]
    k, size, n = b.shape[-3], b.shape[-2], b.shape[-1]
    out = primitive.bind(a, b.reshape(b.shape[:-3] + (k, size * n)), **params)
    out = out.reshape(out.shape[:-1] + (size, n))     # [..., M, B, N]
    return out, out.ndim - 2
  a = jnp.moveaxis(a, da, 0) if da is not not_mapped else a[None]
  b = jnp.moveaxis(b, db, 0) if db is not not_mapped else b[None]
  # Align ranks so the new axis is the leading batch axis of both.
  rank = max(a.ndim, b.ndim)
  a = a.reshape(a.shape[:1] + (1,) * (rank - a.ndim) + a.shape[1:])
  b = b.reshape(b.shape[:1] + (1,) * (rank - b.ndim) + b.shape[1:])
  return primitive.bind(a, b, **params), 0


define_primitive(matmul_p, _matmul_impl, _matmul_abstract_eval,
                 batch=functools.partial(batch_matmul_like, matmul_p))
ad.defbilinear(matmul_p, _matmul_transpose_lhs, _matmul_transpose_rhs)


def matmul(a, b, available_memory_proportion: Optional[float] = None,
           partials_type: Optional[str] = None):
  """``jnp.matmul(a, b)`` with poplin's per-op planning options.

  Args:
    a, b: arrays; 1-D operands are promoted as ``jnp.matmul`` does and batch
      dimensions broadcast.
    available_memory_proportion: overrides ``matmuls.available_memory_proportion``
      for this op's plan: the fraction of tile memory its temporaries may use.
    partials_type: overrides ``matmuls.partials_type`` (``"float32"`` or
      ``"float16"``): the accumulation type for half-precision operands.
  """
  if available_memory_proportion is not None:
    amp = float(available_memory_proportion)
    if not 0 < amp <= 1:
      raise ValueError(f"available_memory_proportion must be in (0, 1], got {amp}.")
    available_memory_proportion = amp
  if partials_type is not None:
    try:
      partials_type = np.dtype(partials_type).name
    except TypeError:  # NumPy's "data type 'foo' not understood"
      pass
    if partials_type not in ("float32", "float16"):
      raise ValueError(f"partials_type must be 'float32' or 'float16', got {partials_type!r}.")
  a, b = jnp.asarray(a), jnp.asarray(b)
  if a.ndim == 0 or b.ndim == 0:
    raise ValueError("matmul: operands must have at least one dimension.")
  dtype = jnp.promote_types(a.dtype, b.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    dtype = jnp.dtype(dtype)
  a, b = a.astype(dtype), b.astype(dtype)
  squeeze = []
  if a.ndim == 1:
    a = a[None, :]
    squeeze.append(-2)
  if b.ndim == 1:
    b = b[:, None]
    squeeze.append(-1)
  out = matmul_p.bind(a, b, available_memory_proportion=available_memory_proportion,
                      partials_type=partials_type)
  if squeeze:
    out = jnp.squeeze(out, axis=tuple(squeeze))
  return out


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile lowering of :func:`ipu_jax.ops.matmul` (``jnp.matmul`` with poplin's per-op options).
#
# Tile plan: the one matmul emitter's (:mod:`ipu_jax.lowering.matmul_emit`, as
# ``dot_general``), with the op's ``available_memory_proportion`` and
# ``partials_type`` passed over the configured ones. Operands ``[*batch, M, K]``
# and ``[K, N]`` are one product whose rows are the batch and M (the layout
# ``dot_general`` gives); operands with batch dimensions are batched products
# over the result's batch dimensions, an operand with fewer or size-1 batch
# dimensions first broadcast to them (a broadcast step; ``jnp.matmul`` instead
# folds such dimensions into the free ones and transposes the result). So
# ``ipu_jax.ops.matmul(a, b, ...)`` and ``jnp.matmul(a, b)`` under the same
# options give the same plan, supersteps and costs whenever ``jnp.matmul``
# needs no transpose.


def matmul_operands(ctx, a, b):
  """``jnp.matmul``-shaped operands as one ``dot_general`` for the emitter.

  Returns ``(a, b, dimension_numbers, out_shape)``: with a 2-D ``b``, ``a``'s
  batch dimensions are free dimensions of the lhs; otherwise both operands are
  broadcast to the result's batch dimensions, which become batch dimensions.
  Shared with :mod:`ipu_jax.ops.serialized_matmul`.
  """
  out_shape = tuple(int(d) for d in ctx.out_avals[0].shape)
  batch = out_shape[:-2]
  if len(b.shape) == 2:
    return a, b, (((len(a.shape) - 1,), (0,)), ((), ())), out_shape
  a = broadcast_to(ctx, a, batch + tuple(a.shape[-2:]))
  b = broadcast_to(ctx, b, batch + tuple(b.shape[-2:]))
  axes = tuple(range(len(batch)))
  return a, b, (((len(batch) + 1,), (len(batch),)), (axes, axes)), out_shape


@register_lowering(matmul_p)
def _matmul_rule(ctx: RuleContext, a, b, *, available_memory_proportion, partials_type):
  a, b, dimension_numbers, out_shape = matmul_operands(ctx, a, b)
  return [emit_matmul(ctx, a, b, dimension_numbers, out_shape, np.dtype(ctx.out_avals[0].dtype),
                      available_memory_proportion=available_memory_proportion,
                      partials_type=partials_type, name="matmul")]
