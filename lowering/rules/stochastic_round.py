"""Tile lowering of :func:`ipu_jax.ops.stochastic_round`.

Tile plan: elementwise on the input's tiles; the key is multicast to them;
each tile draws the random bits for its elements (a counter-based generator
needs only the key and the position), costed per element, and rounds them in
the same vertex (``popops::CastStochasticRound``).
"""

from __future__ import annotations

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import broadcast_cost, logical, worker_vertices
from ipu_jax.lowering.exchange import to_storage
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.stochastic_round import random_bits_for, round_with_bits, stochastic_round_p

# Cycles per vector for stochastic rounding: the cast plus one 32-bit random
# draw per element (two per 2 x float32 vector).
_SR_CYCLES_PER_VECTOR = 3


@register_lowering(stochastic_round_p)
def _stochastic_round_rule(ctx, x, key, *, dtype, impl):
  target = ctx.target
  out = ctx.new_tensor(x.shape, dtype, x.mapping, name="stochastic_round")
  if x.size == 0:
    return [out]
  elements = x.mapping.elements_per_tile(target.num_tiles)
  compute = estimators.worker_split_cycles(target, elements, _SR_CYCLES_PER_VECTOR, x.itemsize)

  def fn(x_s, k_s):
    keys = logical(k_s, key)
    # Bits of the logical array, laid out like x: each tile's vertex draws
    # the bits of the elements it holds.
    bits = to_storage(random_bits_for(keys, x.shape, impl).reshape(-1), x.mapping)
    return (round_with_bits(x_s, bits, dtype),)

  ctx.emit(P.Superstep(
      name="stochastic_round", op=ctx.op, reads=(x, key), writes=(out,), fn=fn,
      compute_cycles=compute, exchange=broadcast_cost(ctx, key, x.mapping.tiles),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST_STOCHASTIC_ROUND,),
      flops=int(x.size)))
  return [out]
