"""Tile lowering of :func:`ipu_jax.ops.print_tensor`.

Tile plan: a ``PrintTensor`` program node (the tensor streams to the host,
which prints it); the result is the operand's tensor itself (nothing moves on
chip).
"""

from __future__ import annotations

from ipu_jax.lowering import program as P
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.print_tensor import print_tensor_p


@register_lowering(print_tensor_p)
def _print_tensor_rule(ctx, x, *, title):
  ctx.emit(P.PrintTensor(title, x))
  return [x]
