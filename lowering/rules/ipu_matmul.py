"""Tile lowering of :func:`ipu_jax.ops.matmul` (``jnp.matmul`` with poplin's per-op options).

Tile plan: the one matmul emitter's (:mod:`ipu_jax.lowering.matmul_emit`, as
``dot_general``), with the op's ``available_memory_proportion`` and
``partials_type`` passed over the configured ones. Operands ``[*batch, M, K]``
and ``[K, N]`` are one product whose rows are the batch and M (the layout
``dot_general`` gives); operands with batch dimensions are batched products
over the result's batch dimensions, an operand with fewer or size-1 batch
dimensions first broadcast to them (a broadcast step; ``jnp.matmul`` instead
folds such dimensions into the free ones and transposes the result). So
``ipu_jax.ops.matmul(a, b, ...)`` and ``jnp.matmul(a, b)`` under the same
options give the same plan, supersteps and costs whenever ``jnp.matmul``
needs no transpose.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.lowering.matmul_emit import emit_matmul
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules.shape import broadcast_to
from ipu_jax.ops.matmul import matmul_p


@register_lowering(matmul_p)
def _matmul_rule(ctx, a, b, *, available_memory_proportion, partials_type):
  out_aval = ctx.out_avals[0]
  out_shape = tuple(int(d) for d in out_aval.shape)
  batch = out_shape[:-2]
  if len(b.shape) == 2:
    # a's batch dimensions are free dimensions of the lhs.
    dimension_numbers = (((len(a.shape) - 1,), (0,)), ((), ()))
  else:
    a = broadcast_to(ctx, a, batch + tuple(a.shape[-2:]))
    b = broadcast_to(ctx, b, batch + tuple(b.shape[-2:]))
    axes = tuple(range(len(batch)))
    dimension_numbers = (((len(batch) + 1,), (len(batch),)), (axes, axes))
  return [emit_matmul(ctx, a, b, dimension_numbers, out_shape, np.dtype(out_aval.dtype),
                      available_memory_proportion=available_memory_proportion,
                      partials_type=partials_type, name="matmul")]
