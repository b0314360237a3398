"""Elementwise primitives: arithmetic, comparison, logical, bitwise, casts.

Each runs as a compute set of elementwise vertices over the result's tiles;
operands not already laid out like the result are exchanged first, scalars
are broadcast (or baked into the vertex when constant). The vertex body is
the primitive itself applied to the tile's elements, so results are exactly
those of XLA.
"""

from __future__ import annotations

import jax
import numpy as np
from jax import lax

from ipu_jax.lowering.jax_compat import add_jaxvals_p, lax_internal, lax_special
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import elementwise, logical, storage, worker_vertices
from ipu_jax.lowering.exchange import movement_cost
from ipu_jax.lowering.mapping import TileMapping
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
    "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    # Total-order comparisons (NaNs and signed zeros ordered; searchsorted).
    "eq_to", "lt_to", "le_to",
    # ``lax.complex(re, im)`` and ``lax.mulhi`` (high half of an integer product).
    "complex", "mulhi",
]
_OTHER = ["select_n", "clamp", "add_any", "regularized_incomplete_beta"]

_FLOPS = {"logistic": 4, "tanh": 4, "erf": 8, "erf_inv": 12, "exp": 2, "log": 2,
          "pow": 8, "div": 1, "rsqrt": 2, "sqrt": 2, "complex": 0,
          # Continued-fraction evaluations of a few dozen terms.
          "regularized_incomplete_beta": 200, "igamma_grad_a": 200}


def _find_primitive(name):
  """The primitive called ``name`` (public ``lax`` first, then JAX's internals)."""
  if name == "add_any":
    return add_jaxvals_p
  for module in (lax, lax_special, lax_internal):
    prim = getattr(module, f"{name}_p", None)
    if prim is not None:
      return prim
  raise ImportError(f"JAX {jax.__version__} has no primitive '{name}_p' "
                    f"(ipu_jax supports the JAX range pinned in setup.cfg)")


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
  register_lowering(_prim, _make_rule(_prim))


def _bitcast_convert_type(ctx, operand, *, new_dtype):
  """Reinterpret bits, keeping every byte on the tile that holds it.

  Equal widths are elementwise. A narrowing bitcast (``f32 -> u8[..., 4]``)
  maps the ``r`` pieces of an element to that element's tile, so nothing
  moves; a widening one (``u16[..., 2] -> u32``) maps each result to the tile
  of its first piece, and only pieces held elsewhere (a group cut by a tile
  boundary) cross the exchange. Each tile then copies its bytes into the new
  tensor.
  """
  new_dtype = np.dtype(new_dtype)
  if new_dtype.itemsize == operand.itemsize:
    return elementwise(ctx, lambda x: lax.bitcast_convert_type(x, new_dtype), [operand])
  aval = ctx.out_avals[0]
  target = ctx.target
  if new_dtype.itemsize < operand.itemsize:
    ratio = operand.itemsize // new_dtype.itemsize
    out_tile = np.repeat(operand.mapping.element_tile, ratio)
    exchange = None
  else:
    ratio = new_dtype.itemsize // operand.itemsize
    out_tile = operand.mapping.element_tile[::ratio]
    piece_dst = np.repeat(out_tile, ratio)
    exchange = movement_cost(target, operand.mapping.element_tile, piece_dst,
                             operand.itemsize)
    if not exchange.total_bytes:
      exchange = None
  mapping = (TileMapping.from_element_tiles(out_tile) if out_tile.size
             else ctx.linear_mapping(aval.shape, new_dtype))
  out = ctx.new_tensor(aval.shape, new_dtype, mapping)
  if out.size == 0:
    return [out]

  def fn(x):
    value = lax.bitcast_convert_type(logical(x, operand), new_dtype)
    return (storage(value, out),)

  held = operand.mapping.bytes_per_tile(target.num_tiles, operand.itemsize)
  ctx.emit(P.Superstep(
      name="bitcast_convert_type", op=ctx.op, reads=(operand,), writes=(out,), fn=fn,
      compute_cycles=estimators.copy_cycles(target, held, 1), exchange=exchange,
      vertices=worker_vertices(ctx, held), codelets=(vocab.COPY,)))
  return [out]


register_lowering(lax.bitcast_convert_type_p, _bitcast_convert_type)
