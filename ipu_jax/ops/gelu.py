"""``gelu``: ``jax.nn.gelu(x, approximate=True)``'s values, run and priced as popnn's GELU.

What the IPU runs for BERT's GELU (PopART's ``Gelu`` op, TF-IPU's
``ipu.nn_ops.gelu``) is popnn's ``nonLinearity(GELU)``: one
``NonLinearity1DInPlace<GELU>`` vertex per tile, the tanh approximation in a
hand-written loop (``lib/popnn/codelets/asm/NonLinearityLoop_gelu.S``), and
its gradient ``nonLinearityInputGradient(GELU)``, one ``NonLinearityGrad1D``
vertex reading the forward input and the incoming gradient. popnn's
estimators (``lib/popnn/popnnCycleEstimators.cpp``, with
``getNonLinearityOpCycles`` in ``lib/popnn/PerformanceEstimation.hpp``) give 5
cycles per 64-bit vector of halves (10 per float pair) for either.
``jax.nn.gelu`` is instead a chain of a dozen elementwise primitives (a
cube, multiplies, adds, a tanh) and its derivative another chain, which the
lowering fuses and prices as popops map expressions, five times popnn's
vertex at BERT-Large's FFN shape.

:func:`gelu` computes what ``jax.nn.gelu(x, approximate=True)`` computes (bit
for bit); its tile rule is one elementwise step priced by popnn's GELU
estimator (``kernels/popops.py`` ``nonlinearity_cycles``). The gradient is
its own primitive, :data:`gelu_grad_p`, with the values of ``jax.nn.gelu``'s
own derivative, priced as ``NonLinearityGrad1D<GELU>``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.primitive import define_primitive, not_mapped, shaped_like

__all__ = ["gelu", "gelu_p", "gelu_grad_p"]

gelu_p = jcore.Primitive("ipu_gelu")
# The derivative applied to a tangent: ``gelu'(x) * t``, linear in ``t`` with
# a diagonal Jacobian, so it is both the JVP's tangent and, transposed, the
# gradient (popnn's nonLinearityInputGradient).
gelu_grad_p = jcore.Primitive("ipu_gelu_grad")

_reference = functools.partial(jax.nn.gelu, approximate=True)


def _gelu_impl(x):
  return _reference(x)


def _gelu_grad_impl(x, t):
  """``jax.nn.gelu``'s own derivative at ``x`` applied to ``t`` (its VJP's values)."""
  _, vjp = jax.vjp(_reference, x)
  return vjp(t)[0]


def _gelu_abstract_eval(x):
  return shaped_like(x.shape, x.dtype, x)


def _gelu_grad_abstract_eval(x, t):
  if x.shape != t.shape or x.dtype != t.dtype:
    raise TypeError(f"gelu gradient: the input {x.dtype}{list(x.shape)} and the gradient "
                    f"{t.dtype}{list(t.shape)} must have one shape and type.")
  return shaped_like(x.shape, x.dtype, x)


def _gelu_jvp(primals, tangents):
  (x,), (tx,) = primals, tangents
  y = gelu_p.bind(x)
  if type(tx) is ad.Zero:
    return y, ad.Zero.from_primal_value(y)
  return y, gelu_grad_p.bind(x, tx)


def _gelu_grad_transpose(ct, x, t):
  del t
  if type(ct) is ad.Zero:
    return [None, ad.Zero(x.aval)]
  return [None, gelu_grad_p.bind(x, ct)]


def _gelu_grad_jvp(primals, tangents):
  # Second derivatives: the impl's own JVP (plain jax ops).
  tangents = tuple(ad.instantiate_zeros(t) for t in tangents)
  return jax.jvp(_gelu_grad_impl, primals, tangents)


def _gelu_batch(args, dims):
  return gelu_p.bind(args[0]), dims[0]


def _gelu_grad_batch(args, dims):
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)

  def front(a, d):
    return jnp.broadcast_to(a, (size,) + a.shape) if d is not_mapped else jnp.moveaxis(a, d, 0)

  return gelu_grad_p.bind(*(front(a, d) for a, d in zip(args, dims))), 0


define_primitive(gelu_p, _gelu_impl, _gelu_abstract_eval, jvp=_gelu_jvp, batch=_gelu_batch)
define_primitive(gelu_grad_p, _gelu_grad_impl, _gelu_grad_abstract_eval, jvp=_gelu_grad_jvp,
                 batch=_gelu_grad_batch)
ad.primitive_transposes[gelu_grad_p] = _gelu_grad_transpose


def gelu(x):
  """``jax.nn.gelu(x, approximate=True)``, lowered as popnn's GELU.

  Args:
    x: an array; integer and boolean inputs are promoted to a float type as
      ``jax.nn.gelu`` promotes them.

  Returns:
    The tanh-approximated GELU of ``x``, of its shape and (floating) type, bit
    for bit ``jax.nn.gelu(x, approximate=True)``; its gradient has the values
    of ``jax.nn.gelu``'s derivative.

  Raises:
    TypeError: a complex input (popnn's GELU is for half and float).
  """
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    raise TypeError(f"gelu: a complex input ({x.dtype}) has no GELU on the IPU; popnn's "
                    f"GELU takes half or float, pass x.real or a float array.")
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return gelu_p.bind(x)


# ---------------------------------------------------------------------------
# The tile rules: one elementwise step each, priced by popnn's estimators
# (cost ops "gelu" / "gelu_grad", kernels/popops.py nonlinearity_cycles).
# ---------------------------------------------------------------------------


@register_lowering(gelu_p)
def _gelu_rule(ctx: RuleContext, x):
  return elementwise(ctx, _gelu_impl, [x], [(x.shape, x.dtype)], name="gelu",
                     cost_op="gelu", flops_per_element=8)


@register_lowering(gelu_grad_p)
def _gelu_grad_rule(ctx: RuleContext, x, t):
  return elementwise(ctx, _gelu_grad_impl, [x, t], [(x.shape, x.dtype)], name="gelu/grad",
                     cost_op="gelu_grad", flops_per_element=12)
