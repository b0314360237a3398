"""``softmax``: ``jax.nn.softmax``'s values, run and priced as popnn's softmax.

What the IPU runs for a softmax in BERT (PopART's ``Softmax`` op, TF-IPU's and
PopTorch's softmax) is popnn's ``nonLinearity(SOFTMAX_STABLE)``, built by
``softmaxImpl`` in PopLibs' ``lib/popnn/NonLinearity.cpp``: a MAX reduction
along the axis, a subtract, an exp, an ADD reduction into float, the
reciprocal of the few sums (``invInPlace``: "As the divide is broadcast we
compute 1/x first as there are a lot fewer elements"), then one multiply of
every element by its broadcast reciprocal (``mulInPlace``). Its gradient,
``softmaxInputGradientImpl`` in the same file, is ``g * y``, an ADD reduction
of that along the axis, ``y * sum`` and a subtract. ``jax.nn.softmax`` instead
divides every element by the broadcast sum, and its derivative keeps a
full-size divide: popops' DIVIDE costs 21 cycles per 4 halves where MULTIPLY
costs one per vector (``binaryOpPerfInfo`` in ``lib/popops/
ElementwiseCodelets`` estimators, ``kernels/popops.py``).

:func:`softmax` computes what ``jax.nn.softmax`` computes (bit for bit, under
``jax.jit`` and ``ipu_jax.jit``); its tile rule is popnn's steps, each through
the lowering's own machinery: the reductions through the reduction planner,
the subtract and exp as elementwise steps (fused as any chain is), the
reciprocal on the reduced tensor, then the normalisation priced as MULTIPLY
(its values are the division's, as XLA's and jax.jit's; the same convention
as a division by a constant, ``lowering/rules/elementwise.py``). The
gradient is its own primitive, :data:`softmax_grad_p`, lowered as
``softmaxInputGradientImpl``'s four steps.
"""

from __future__ import annotations

import functools
from typing import Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.lower import lower_closed_jaxpr
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.primitive import define_primitive, not_mapped, shaped_like

__all__ = ["softmax", "softmax_p", "softmax_grad_p"]

softmax_p = jcore.Primitive("ipu_softmax")
# The softmax's Jacobian-vector product ``y * (t - sum(y * t))``: linear in
# ``t`` and self-adjoint (the Jacobian ``diag(y) - y y^T`` is symmetric), so
# it is the JVP's tangent and, transposed, the gradient.
softmax_grad_p = jcore.Primitive("ipu_softmax_grad")


def _exp_and_sum(x, *, axis, stable):
  """``exp(x - max)`` and its sum along ``axis`` (kept), as jax.nn.softmax makes them."""
  if stable:
    # jax.nn.softmax starts the max at -inf; that changes no value (max(m,
    # -inf) is m, NaN included) except over an empty axis, the only case that
    # needs it (popnn's reduction has no such step).
    empty = any(x.shape[a] == 0 for a in axis)
    x = x - lax.stop_gradient(jnp.max(x, axis, keepdims=True,
                                      initial=-jnp.inf if empty else None))
  unnormalized = jnp.exp(x)
  return unnormalized, jnp.sum(unnormalized, axis, keepdims=True)


def _softmax_impl(x, *, axis, stable):
  unnormalized, total = _exp_and_sum(x, axis=axis, stable=stable)
  return unnormalized / total


def _softmax_grad_impl(y, t, *, axis):
  """popnn's ``softmaxInputGradientImpl``: ``g*y - y * sum(g*y)``."""
  gy = t * y
  return gy - y * jnp.sum(gy, axis, keepdims=True)


def _softmax_abstract_eval(x, *, axis, stable):
  del stable
  _check_axes(axis, x.ndim)
  return shaped_like(x.shape, x.dtype, x)


def _softmax_grad_abstract_eval(y, t, *, axis):
  if y.shape != t.shape or y.dtype != t.dtype:
    raise TypeError(f"softmax gradient: the output {y.dtype}{list(y.shape)} and its "
                    f"cotangent {t.dtype}{list(t.shape)} must have one shape and type.")
  _check_axes(axis, y.ndim)
  return shaped_like(y.shape, y.dtype, y)


def _softmax_jvp(primals, tangents, *, axis, stable):
  (x,), (tx,) = primals, tangents
  y = softmax_p.bind(x, axis=axis, stable=stable)
  if type(tx) is ad.Zero:
    return y, ad.Zero.from_primal_value(y)
  return y, softmax_grad_p.bind(y, tx, axis=axis)


def _softmax_grad_transpose(ct, y, t, *, axis):
  del t
  if type(ct) is ad.Zero:
    return [None, ad.Zero(y.aval)]
  return [None, softmax_grad_p.bind(y, ct, axis=axis)]


def _softmax_grad_jvp(primals, tangents, *, axis):
  # Second derivatives: the impl's own JVP (plain jax ops).
  tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
  return jax.jvp(functools.partial(_softmax_grad_impl, axis=axis), primals, tangents)


def _shifted(axis: Tuple[int, ...]) -> Tuple[int, ...]:
  """The axes once a batch axis is put first."""
  return tuple(a + 1 for a in axis)


def _softmax_batch(args, dims, *, axis, stable):
  (x,), (d,) = args, dims
  x = jnp.moveaxis(x, d, 0)
  return softmax_p.bind(x, axis=_shifted(axis), stable=stable), 0


def _softmax_grad_batch(args, dims, *, axis):
  y, t = args
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)

  def front(a, d):
    return jnp.broadcast_to(a, (size,) + a.shape) if d is not_mapped else jnp.moveaxis(a, d, 0)

  return softmax_grad_p.bind(front(y, dims[0]), front(t, dims[1]), axis=_shifted(axis)), 0


define_primitive(softmax_p, _softmax_impl, _softmax_abstract_eval, jvp=_softmax_jvp,
                 batch=_softmax_batch)
define_primitive(softmax_grad_p, _softmax_grad_impl, _softmax_grad_abstract_eval,
                 jvp=_softmax_grad_jvp, batch=_softmax_grad_batch)
ad.primitive_transposes[softmax_grad_p] = _softmax_grad_transpose


def _check_axes(axis: Tuple[int, ...], ndim: int) -> None:
  bad = [a for a in axis if not 0 <= a < ndim]
  if bad or len(set(axis)) != len(axis):
    raise ValueError(f"softmax: axis {axis} is not a set of distinct axes of a rank-{ndim} "
                     f"input.")


def _normalize_axis(axis, ndim: int) -> Tuple[int, ...]:
  """``axis`` (int, sequence of ints or None) as sorted non-negative axes, or a ValueError."""
  if axis is None:
    return tuple(range(ndim))
  if not isinstance(axis, (int, np.integer, tuple, list)):  # a float is not iterable either
    raise TypeError(f"softmax: axis must be an int, a sequence of ints or None, got {axis!r}.")
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  out = []
  for a in axes:
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
      raise TypeError(f"softmax: axis must be an int, a sequence of ints or None, got {axis!r}.")
    if not -ndim <= int(a) < ndim:
      raise ValueError(f"softmax: axis {int(a)} is out of range for an input of rank {ndim} "
                       f"(valid: {-ndim} to {ndim - 1}).")
    out.append(int(a) % ndim)
  if len(set(out)) != len(out):
    raise ValueError(f"softmax: repeated axis in {axis!r}.")
  return tuple(sorted(out))


def softmax(x, axis: Union[int, Sequence[int], None] = -1, stable: bool = True):
  """``jax.nn.softmax(x, axis)``, lowered as popnn's softmax.

  Args:
    x: an array; integer and boolean inputs are promoted to a float type as
      ``jnp.exp`` promotes them.
    axis: the axis (or axes; ``None``: all) the softmax normalises over.
    stable: subtract the maximum along ``axis`` before the exp (popnn's
      ``SOFTMAX_STABLE``, what ``jax.nn.softmax`` does); ``False`` is popnn's
      ``SOFTMAX``: ``exp(x) / sum(exp(x))`` with no max reduction, cheaper and
      overflowing for large inputs.

  Returns:
    The softmax, of ``x``'s shape and (floating) type; with ``stable=True``
    bit for bit ``jax.nn.softmax(x, axis)``.

  Raises:
    ValueError: an axis outside ``x``'s rank or repeated (a rank-0 input has
      none), before anything is traced.
    TypeError: an axis that is not an int, or ``stable`` not a bool.
  """
  if not isinstance(stable, (bool, np.bool_)):  # "no" would read as True
    raise TypeError(f"softmax: stable must be True or False, got {stable!r}.")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  axes = _normalize_axis(axis, x.ndim)
  if not axes:
    raise ValueError(f"softmax: a rank-{x.ndim} input has no axis to normalise over.")
  return softmax_p.bind(x, axis=axes, stable=bool(stable))


# ---------------------------------------------------------------------------
# The tile rules
# ---------------------------------------------------------------------------
# softmax_p, popnn's softmaxImpl: exp(x - max) and its sum lowered as their
# jaxpr (reduce_max and reduce_sum through the reduction planner; the sum of
# float16 accumulates in float32 as popnn's ``reduce(..., FLOAT, ...)``; the
# subtract and exp fused as any elementwise chain); then the reciprocal of
# the sums (a step on the reduced tensor only: ``invInPlace``, priced by the
# division rule, 1 / s) and the full-size normalisation priced as popops'
# MULTIPLY (``mulInPlace`` by the broadcast reciprocals) with the division's
# values, so the results are jax.nn.softmax's.
#
# softmax_grad_p, popnn's softmaxInputGradientImpl: its impl's jaxpr
# (multiply, ADD reduction, multiply, subtract) lowered as it is.


def _avals(*tensors):
  return [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in tensors]


@register_lowering(softmax_p)
def _softmax_rule(ctx: RuleContext, x, *, axis, stable):
  closed = jax.make_jaxpr(functools.partial(_exp_and_sum, axis=axis, stable=stable))(*_avals(x))
  unnormalized, total = lower_closed_jaxpr(ctx.module, closed, [x])
  reciprocal = jax.make_jaxpr(lambda s: 1 / s)(*_avals(total))
  # The reciprocals popnn multiplies by; the normalisation below reads the
  # sums instead to give the division's values at the multiply's price.
  lower_closed_jaxpr(ctx.module, reciprocal, [total])
  return elementwise(ctx, lax.div, [unnormalized, total], [(x.shape, x.dtype)],
                     name="softmax/invScale", cost_op="mul")


@register_lowering(softmax_grad_p)
def _softmax_grad_rule(ctx: RuleContext, y, t, *, axis):
  closed = jax.make_jaxpr(functools.partial(_softmax_grad_impl, axis=axis))(*_avals(y, t))
  return lower_closed_jaxpr(ctx.module, closed, [y, t])
