"""``dot_general``: matrix products planned over tiles like poplin's matmul.

Tile plan: the one matmul emitter's (:mod:`ipu_jax.lowering.matmul_emit`).
The product is canonicalised to ``[B, M, K] x [B, K, N]``, planned as a grid
of ``gb x gm x gn x gk`` blocks, one per tile, under
``matmuls.available_memory_proportion``; a superstep multiplies the blocks on
the tiles' AMP units after multicasting the operand blocks to them, and, when
K is split, one (reduce-scatter) or a few (tree) supersteps sum the partials.
The result type is the equation's (``preferred_element_type`` is in its
aval); ``precision`` sets the batched executor's product.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from ipu_jax.lowering import program as P
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.matmul_emit import emit_matmul
from ipu_jax.lowering.registry import register_lowering

__all__ = ["dot_general_rule"]


@register_lowering(lax.dot_general_p)
def dot_general_rule(ctx: RuleContext, lhs: P.Tensor, rhs: P.Tensor, *, dimension_numbers,
                     precision=None, preferred_element_type=None, **unused):
  """Lower ``dot_general`` to a planned block matmul (+ partials reduce)."""
  del preferred_element_type, unused  # the result type is in ctx.out_avals
  out_aval = ctx.out_avals[0]
  return [emit_matmul(ctx, lhs, rhs, dimension_numbers, out_aval.shape,
                      np.dtype(out_aval.dtype), precision=precision)]
