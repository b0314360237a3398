"""Elementwise primitives: arithmetic, comparison, logical, bitwise, casts.

Each runs as a compute set of elementwise vertices over the result's tiles;
operands not already laid out like the result are exchanged first, scalars
are broadcast (or baked into the vertex when constant). The vertex body is
the primitive itself applied to the tile's elements, so results are exactly
those of XLA.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering.jax_compat import add_jaxvals_p
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import elementwise, logical, storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import movement_cost
from ipu_jax.lowering.indexing import is_constant
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering

# Rules are keyed by the ``Primitive`` objects themselves (a primitive of the
# same name from elsewhere is not one of these).
_UNARY = (
    lax.neg_p, lax.sign_p, lax.floor_p, lax.ceil_p, lax.round_p, lax.is_finite_p, lax.exp_p,
    lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p, lax.logistic_p, lax.sin_p,
    lax.cos_p, lax.tan_p, lax.asin_p, lax.acos_p, lax.atan_p, lax.sinh_p, lax.cosh_p,
    lax.asinh_p, lax.acosh_p, lax.atanh_p, lax.sqrt_p, lax.rsqrt_p, lax.cbrt_p, lax.abs_p,
    lax.not_p, lax.erf_p, lax.erfc_p, lax.erf_inv_p, lax.lgamma_p, lax.digamma_p, lax.square_p,
    lax.integer_pow_p, lax.convert_element_type_p, lax.reduce_precision_p, lax.imag_p,
    lax.real_p, lax.conj_p, lax.population_count_p, lax.clz_p, lax.copy_p, lax.bessel_i0e_p,
    lax.bessel_i1e_p,
)
_BINARY = (
    lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.pow_p, lax.max_p, lax.min_p,
    lax.atan2_p, lax.nextafter_p, lax.and_p, lax.or_p, lax.xor_p, lax.eq_p, lax.ne_p, lax.lt_p,
    lax.le_p, lax.gt_p, lax.ge_p, lax.shift_left_p, lax.shift_right_logical_p,
    lax.shift_right_arithmetic_p, lax.igamma_p, lax.igammac_p, lax.igamma_grad_a_p,
    lax.polygamma_p, lax.zeta_p,
    # Total-order comparisons (NaNs and signed zeros ordered; searchsorted).
    lax.eq_to_p, lax.lt_to_p, lax.le_to_p,
    # ``lax.complex(re, im)`` and ``lax.mulhi`` (high half of an integer product).
    lax.complex_p, lax.mulhi_p,
)
# ``add_any`` (``add_jaxvals_p``) is the sum of cotangents JAX's autodiff adds.
_OTHER = (lax.select_n_p, lax.clamp_p, add_jaxvals_p, lax.regularized_incomplete_beta_p)

_FLOPS = {lax.logistic_p: 4, lax.tanh_p: 4, lax.erf_p: 8, lax.erf_inv_p: 12, lax.exp_p: 2,
          lax.log_p: 2, lax.pow_p: 8, lax.div_p: 1, lax.rsqrt_p: 2, lax.sqrt_p: 2,
          lax.complex_p: 0,
          # Continued-fraction evaluations of a few dozen terms.
          lax.regularized_incomplete_beta_p: 200, lax.igamma_grad_a_p: 200}


def _cost_op(primitive, operands) -> str:
  """The estimator key of ``primitive`` on ``operands`` ('' for the primitive's own).

  A floating-point division by a constant is priced as popops' MULTIPLY:
  XLA's algebraic simplifier (``AlgebraicSimplifierVisitor::HandleDivide``,
  ``A / Const => A * (1 / Const)``, scalar or broadcast constants) rewrites it
  before any backend sees it, TensorFlow's IPU backend included, so the IPU
  runs a multiply by the folded reciprocal, not popops' DIVIDE (21 cycles per
  4 halves against 1 per vector, ``binaryOpPerfInfo``). The values are
  jax.jit's: its own compile applies the same rewrite.

  ``add_any`` (``add_jaxvals_p``, the sum of two cotangents JAX's transpose
  writes) is priced as popops' ADD, as the forward ``add`` is: XLA lowers it
  to an ordinary ``add`` HLO, which TensorFlow's IPU backend maps to
  ``popops::add`` (the ``BinaryOp1D`` ADD estimator,
  ``binaryOpPerfInfo`` in poplibs' ``lib/popops/popopsCycleEstimators.cpp``:
  per worker ``29`` (float) or ``26`` (half) plus ``ceil(n / vector) * (1 +
  2)``, times the contexts, plus ``basicOpSupervisorOverhead``'s 11), and an
  operand with a scalar per region (a LayerNorm's mean cotangent read
  broadcast) is popops' ``BroadcastScalar`` ADD, exactly as for ``add``.
  """
  if primitive is add_jaxvals_p:
    return "add"
  if primitive is not lax.div_p or len(operands) != 2:
    return ""
  x, y = operands
  floating = np.issubdtype(np.dtype(y.dtype), np.floating)
  return "mul" if floating and is_constant(y) and not is_constant(x) else ""


def _make_rule(primitive):
  def rule(ctx: RuleContext, *operands, **params):
    def body(*arrays):
      if len({np.shape(a) for a in arrays}) > 1:
        # A scalar or broadcast operand arrives as read (0-d, size-1 axes);
        # select_n, clamp and others take only equal shapes.
        arrays = jnp.broadcast_arrays(*arrays)
      if primitive is add_jaxvals_p:
        return arrays[0] + arrays[1]
      return primitive.bind(*arrays, **params)
    return elementwise(ctx, body, operands, cost_op=_cost_op(primitive, operands),
                       flops_per_element=_FLOPS.get(primitive, 1))
  return rule


# builders.elementwise reads an operand with size-1 axes broadcast (popops'
# vertices read the broadcast view), so a broadcast_in_dim feeding these
# rules is a view, not a copy (lowering/lower.py).
for _prim in _UNARY + _BINARY + _OTHER:
  register_lowering(_prim, _make_rule(_prim), reads_broadcast=True)


def _bitcast_convert_type(ctx: RuleContext, operand, *, new_dtype):
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
