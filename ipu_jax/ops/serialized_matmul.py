"""``serialized_matmul``: a matrix product done as ``factor`` smaller ones, one after another.

TF-IPU's ``ipu.math_ops.serialized_matmul(a, b, serialization_factor,
serialization_dimension)`` and PopTorch's ``poptorch.serializedMatMul(lhs, rhs,
mode, factor)`` cut a product ``a[..., M, K] @ b[..., K, N]`` into ``factor``
pieces along one of its three dimensions, so each piece's plan needs about
``1/factor`` of the tile memory the whole product's would (operand blocks and
partials), at the price of the pieces' extra syncs, exchanges and, for the
contraction, the partial sums (docs/serialization.md). The names, as TF-IPU's
source slices its operands (``a`` is ``[..., M, K]``, ``b`` ``[..., K, N]``):

* ``a_columns`` (PopTorch ``InputChannels``): M, a's rows; pieces side by side.
* ``a_rows_b_columns`` (``ReducingDim``): K; pieces summed in the result type.
* ``b_rows`` (``OutputChannels``): N, b's columns; pieces side by side.

The gradient is serialised too, as TF-IPU's custom gradient does it: the
products of the transpose are serialised on the same dimension of the
problem (``dA = dC @ B^T`` and ``dB = A^T @ dC``; a split of M in the forward
product is a split of the contraction of ``dB``, and so on). A matrix
shared by a batch of products (2-D beside a batched operand: a decoder
weight) gets one product whose contraction runs over the batch as well, not
a stack of per-item gradients summed after.

The tile rule (below the primitive): M and N splits are one planned matmul
in ``factor`` serial passes (:func:`~ipu_jax.lowering.matmul_emit.emit_matmul`'s
``serial``: each pass plans, exchanges and multiplies its slice and writes
its part of the result, poplin's serial split; a piece that does not fit is
cut into more passes); a K split lowers ``factor`` matmuls of the operands'
K slices, in order, each added to the running sum as it comes (TF-IPU's
``result += inner_func(...)``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.lower import lower_closed_jaxpr
from ipu_jax.lowering.matmul_emit import emit_matmul
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.matmul import (batch_matmul_like, folded_lhs_gradient_operands,
                                folded_rhs_gradient_operands, matmul, matmul_operands,
                                shared_by_batch)
from ipu_jax.ops.primitive import define_primitive, shaped_like

__all__ = ["serialized_matmul", "serialized_matmul_p", "MODES", "canonical_mode",
           "check_factor"]

serialized_matmul_p = jcore.Primitive("ipu_serialized_matmul")

# Every accepted name -> the dimension it splits: "m" (a's rows), "k" (the
# contraction), "n" (b's columns).
MODES = {
    "a_columns": "m", "input_channels": "m", "InputChannels": "m",
    "a_rows_b_columns": "k", "reducing_dim": "k", "ReducingDim": "k",
    "b_rows": "n", "output_channels": "n", "OutputChannels": "n",
}
_DIM_NAMES = {"m": "the rows M of a (a.shape[-2])",
              "k": "the contraction K (a.shape[-1] == b.shape[-2])",
              "n": "the columns N of b (b.shape[-1])"}


def canonical_mode(mode) -> str:
  """``"m"``, ``"k"`` or ``"n"`` for a TF-IPU or PopTorch mode name (or enum)."""
  name = getattr(mode, "name", mode)  # a PopTorch-like enum member
  if isinstance(name, str) and name in MODES:
    return MODES[name]
  raise ValueError(f"serialized_matmul: unknown mode {mode!r}; valid modes: "
                   f"{', '.join(repr(m) for m in MODES)}.")


def _divisors(size: int) -> list:
  small = [d for d in range(1, int(size ** 0.5) + 1) if size % d == 0]
  return sorted(set(small + [size // d for d in small]))


def check_factor(factor, size: int, what: str, op: str = "serialized_matmul") -> int:
  """``factor`` as an int, or a ValueError naming ``what`` and its divisors."""
  if isinstance(factor, bool) or not isinstance(factor, (int, np.integer)):
    raise TypeError(f"{op}: the serialisation factor must be an int, got {factor!r}.")
  factor = int(factor)
  if factor < 1:
    raise ValueError(f"{op}: the serialisation factor must be >= 1, got {factor}.")
  if size % factor:
    divisors = _divisors(size)
    shown = ", ".join(str(d) for d in divisors[:24]) + (", ..." if len(divisors) > 24 else "")
    raise ValueError(f"{op}: factor {factor} does not divide {what} = {size}; "
                     f"its divisors: {shown}.")
  return factor


def _split_size(a_shape, b_shape, axis) -> int:
  return {"m": a_shape[-2], "k": a_shape[-1], "n": b_shape[-1]}[axis]


def _batch_shape(a_shape, b_shape):
  return tuple(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))


def _k_piece(a, b, *, factor, index):
  """Piece ``index`` of the K split: the product of the operands' K slices."""
  size = a.shape[-1] // factor
  return matmul(lax.slice_in_dim(a, index * size, (index + 1) * size, axis=a.ndim - 1),
                lax.slice_in_dim(b, index * size, (index + 1) * size, axis=b.ndim - 2))


def _k_pieces(a, b, factor):
  """The K split: ``factor`` products of K slices, summed in order in the result type."""
  total = None
  for i in range(factor):
    piece = _k_piece(a, b, factor=factor, index=i)
    total = piece if total is None else total + piece
  return total


def _impl(a, b, *, factor, axis):
  """Reference semantics: the pieces' numbers (an M or N split is the plain product)."""
  if axis == "k" and factor > 1:
    return _k_pieces(a, b, factor)
  return matmul(a, b)


def _abstract_eval(a, b, *, factor, axis):
  if a.ndim < 2 or b.ndim < 2:
    raise TypeError(f"serialized_matmul needs operands of rank >= 2, got {a.shape} and "
                    f"{b.shape}.")
  if a.shape[-1] != b.shape[-2]:
    raise TypeError(f"serialized_matmul: contracting dimensions differ: {a.shape} @ {b.shape}.")
  if a.dtype != b.dtype:
    raise TypeError(f"serialized_matmul: operand dtypes differ: {a.dtype} and {b.dtype}.")
  check_factor(factor, _split_size(a.shape, b.shape, axis), _DIM_NAMES[axis])
  shape = _batch_shape(a.shape, b.shape) + (a.shape[-2], b.shape[-1])
  return shaped_like(shape, a.dtype, a)


def _sum_to_shape(x, shape):
  """Sum the broadcast (leading or size-1) axes of ``x`` so it has ``shape``."""
  extra = x.ndim - len(shape)
  if extra:
    x = jnp.sum(x, axis=tuple(range(extra)))
  axes = tuple(i for i, (s, t) in enumerate(zip(x.shape, shape)) if t == 1 and s != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x


# The dimension each transposed product splits (TF-IPU's grad_a_fn / grad_b_fn
# with no transposes): dA = dC @ B^T is [M, N] x [N, K], dB = A^T @ dC is
# [K, M] x [M, N].
_LHS_GRAD_AXIS = {"m": "m", "k": "n", "n": "k"}
_RHS_GRAD_AXIS = {"m": "k", "k": "m", "n": "n"}


# A 2-D matrix shared by a batched operand: its gradient is one product over
# the batch-flattened contraction (ipu_jax.ops.matmul); the split dimension
# keeps its factor (a split contraction B * M or B * N is still divided).


def _transpose_lhs(ct, a, b, *, factor, axis):
  if shared_by_batch(a.aval, b):
    grad = serialized_matmul_p.bind(*folded_lhs_gradient_operands(ct, b), factor=factor,
                                    axis=_LHS_GRAD_AXIS[axis])
    return grad.astype(a.aval.dtype)
  grad = serialized_matmul_p.bind(ct, jnp.swapaxes(b, -1, -2), factor=factor,
                                  axis=_LHS_GRAD_AXIS[axis])
  return _sum_to_shape(grad, a.aval.shape).astype(a.aval.dtype)


def _transpose_rhs(ct, a, b, *, factor, axis):
  if shared_by_batch(b.aval, a):
    grad = serialized_matmul_p.bind(*folded_rhs_gradient_operands(ct, a), factor=factor,
                                    axis=_RHS_GRAD_AXIS[axis])
    return grad.astype(b.aval.dtype)
  grad = serialized_matmul_p.bind(jnp.swapaxes(a, -1, -2), ct, factor=factor,
                                  axis=_RHS_GRAD_AXIS[axis])
  return _sum_to_shape(grad, b.aval.shape).astype(b.aval.dtype)


# vmap folds the batch into M or N when one operand is a shared matrix, which
# keeps the split dimension's factor dividing it (B * M rows, B * N columns).
define_primitive(serialized_matmul_p, _impl, _abstract_eval,
                 batch=functools.partial(batch_matmul_like, serialized_matmul_p))
ad.defbilinear(serialized_matmul_p, _transpose_lhs, _transpose_rhs)


def serialized_matmul(a, b, factor: int, mode, *, name: Optional[str] = None):
  """``a @ b`` done as ``factor`` smaller products, one after another.

  Args:
    a: ``[..., M, K]``.
    b: ``[..., K, N]`` (batch dimensions broadcast as in ``jnp.matmul``).
    factor: the number of pieces; must divide the split dimension.
    mode: the dimension to split: ``"a_columns"`` (M), ``"a_rows_b_columns"``
      (K, pieces summed) or ``"b_rows"`` (N), TF-IPU's names; PopTorch's
      ``"input_channels"`` / ``"reducing_dim"`` / ``"output_channels"`` (or
      ``InputChannels`` / ``ReducingDim`` / ``OutputChannels``, as strings
      or enum members) are the same three.
    name: unused (TF-IPU's op name); steps are named after the op.

  Returns:
    ``a @ b``, in the operands' type.

  Raises:
    ValueError: an unknown mode, a factor below 1 or one that does not
      divide the dimension (the message lists its divisors), operands that
      cannot be multiplied; before anything is traced or run.
  """
  del name
  axis = canonical_mode(mode)
  a, b = jnp.asarray(a), jnp.asarray(b)
  if a.ndim < 2 or b.ndim < 2:
    raise ValueError(f"serialized_matmul: operands must have rank >= 2 (as TF-IPU's), got "
                     f"shapes {a.shape} and {b.shape}.")
  if a.shape[-1] != b.shape[-2]:
    raise ValueError(f"serialized_matmul: a's columns ({a.shape[-1]}) differ from b's rows "
                     f"({b.shape[-2]}): {a.shape} @ {b.shape}.")
  factor = check_factor(factor, _split_size(a.shape, b.shape, axis),
                        f"{_DIM_NAMES[axis]} for mode {mode!r}")
  dtype = jnp.promote_types(a.dtype, b.dtype)
  return serialized_matmul_p.bind(a.astype(dtype), b.astype(dtype), factor=factor, axis=axis)


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile plan. M or N split: the one matmul emitter's plan
# (:mod:`ipu_jax.lowering.matmul_emit`, as ``ipu_jax.ops.matmul``: operands
# ``[*batch, M, K] x [K, N]`` are one product whose rows are the batch and M,
# batched operands a batched product) forced into ``factor`` serial passes
# (or a multiple, when a piece does not fit) along the canonical M (a's free
# dimensions) or N, within 1/factor of the plain plan's temporaries where a
# grid is that small (lowering/matmul_plan.py, ``_serial_budget``): each pass is
# planned over all the tiles for its slice, exchanges its operand blocks,
# multiplies and (with a K split in its grid) reduces its partials, then
# writes its slice of the one result, so its temporaries are a pass's. K
# split: each piece's jaxpr (K slices of both operands, a planned matmul)
# lowered in place, then added to the running sum in the result type in a
# compute set of its own (kept out of elementwise fusion, so no more than
# the running sum and one piece's product are live at once).


def _accumulate(ctx, total: P.Tensor, piece: P.Tensor) -> P.Tensor:
  """``total + piece`` in a compute set of its own, right after the piece.

  Poplar adds each piece in place as it comes; elementwise fusion would
  instead gather the adds into one compute set after the last piece, keeping
  every piece's product live at once, so the step is kept out of it.
  """
  with ctx.module.sub_program() as (body, _):
    (out,) = elementwise(ctx, jnp.add, [total, piece], [(piece.shape, piece.dtype)],
                         name="serialized_matmul/accumulate", cost_op="add")
  for node in body.programs:
    ctx.emit(dataclasses.replace(node, elementwise=None)
             if isinstance(node, P.Superstep) else node)
  return out


def _k_split_rule(ctx, a, b, factor):
  avals = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (a, b)]
  total = None
  for index in range(factor):
    closed = jax.make_jaxpr(functools.partial(_k_piece, factor=factor, index=index))(*avals)
    (piece,) = lower_closed_jaxpr(ctx.module, closed, [a, b])
    total = piece if total is None else _accumulate(ctx, total, piece)
  return [total]


@register_lowering(serialized_matmul_p)
def _serialized_matmul_rule(ctx: RuleContext, a, b, *, factor, axis):
  if axis == "k" and factor > 1:
    return _k_split_rule(ctx, a, b, factor)
  a, b, dimension_numbers, out_shape = matmul_operands(ctx, a, b)
  serial = (axis, factor) if factor > 1 and axis != "k" else None
  return [emit_matmul(ctx, a, b, dimension_numbers, out_shape, np.dtype(ctx.out_avals[0].dtype),
                      name="serialized_matmul", serial=serial)]
