"""Elementwise primitives: arithmetic, comparison, logical, bitwise, casts.

Each runs as a compute set of elementwise vertices over the result's tiles;
operands not already laid out like the result are exchanged first, scalars
are broadcast (or baked into the vertex when constant). The vertex body is
the primitive itself applied to the tile's elements, so results are exactly
those of XLA.
"""

from __future__ import annotations

from jax import lax
from jax._src.lax import special as lax_special

from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.registry import register_lowering

_UNARY = [
    "neg", "sign", "floor", "ceil", "round", "is_finite", "exp", "exp2", "log",
    "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "sqrt", "rsqrt", "cbrt",
    "abs", "not", "erf", "erfc", "erf_inv", "lgamma", "digamma", "square",
    "integer_pow", "convert_element_type", "reduce_precision", "imag", "real", "conj",
    "population_count", "clz", "copy", "bessel_i0e", "bessel_i1e",
]
_BINARY = [
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2",
    "nextafter", "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "igamma", "igammac", "random_gamma_grad", "polygamma", "zeta",
]
_OTHER = ["select_n", "clamp", "add_any"]

_FLOPS = {"logistic": 4, "tanh": 4, "erf": 8, "erf_inv": 12, "exp": 2, "log": 2,
          "pow": 8, "div": 1, "rsqrt": 2, "sqrt": 2}


def _find_primitive(name):
  for module in (lax, lax_special):
    prim = getattr(module, f"{name}_p", None)
    if prim is not None:
      return prim
  from jax._src.lax import lax as lax_internal
  prim = getattr(lax_internal, f"{name}_p", None)
  if prim is None and name == "add_any":
    from jax._src.ad_util import add_jaxvals_p
    return add_jaxvals_p
  if prim is None and name == "copy":
    from jax._src.lax.lax import copy_p
    return copy_p
  return prim


def _make_rule(primitive):
  def rule(ctx, *operands, **params):
    def body(*arrays):
      if primitive.name == "add_any":
        return arrays[0] + arrays[1]
      return primitive.bind(*arrays, **params)
    return elementwise(ctx, body, operands,
                       flops_per_element=_FLOPS.get(primitive.name, 1))
  return rule


for _name in _UNARY + _BINARY + _OTHER:
  _prim = _find_primitive(_name)
  if _prim is not None:
    register_lowering(_prim, _make_rule(_prim))


def _bitcast_convert_type(ctx, operand, *, new_dtype):
  """Reinterpret bits; elementwise when the widths match, else rows split."""
  import numpy as np
  from ipu_jax.lowering.builders import partitioned
  if np.dtype(new_dtype).itemsize == operand.itemsize:
    return elementwise(ctx, lambda x: lax.bitcast_convert_type(x, new_dtype), [operand])
  if not operand.shape:
    raise NotImplementedError("bitcast_convert_type of a scalar to a different width")
  out = ctx.out_avals[0]
  return partitioned(ctx, lambda x: lax.bitcast_convert_type(x, new_dtype), [operand],
                     [(out.shape, out.dtype)], split_axes=[0], out_axis=0,
                     flops=0, name="bitcast_convert_type")


register_lowering(lax.bitcast_convert_type_p, _bitcast_convert_type)
