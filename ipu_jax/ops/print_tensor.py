"""``print_tensor``: Poplar's ``PrintTensor`` as an identity op."""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend import core as jcore

from ipu_jax.lowering import printing
from ipu_jax.lowering.printing import format_tensor
from ipu_jax.ops.primitive import define_primitive
from ipu_jax.lowering.jax_compat import debugging
from ipu_jax.lowering import program as P
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering


__all__ = ["print_tensor", "print_tensor_p", "format_tensor"]

print_tensor_p = jcore.Primitive("print_tensor")


def _print_tensor_impl(x, *, title):
  printing.print_tensor(title, x)
  return x


def _print_tensor_abstract_eval(x, *, title):
  del title
  return x, {debugging.ordered_debug_effect}


def _print_tensor_jvp(primals, tangents, *, title):
  (x,), (t,) = primals, tangents
  return print_tensor_p.bind(x, title=title), t


def _print_tensor_batch(args, dims, *, title):
  # The whole batch is printed at once (stacked along the batch axis).
  (x,), (d,) = args, dims
  return print_tensor_p.bind(x, title=title), d


define_primitive(print_tensor_p, _print_tensor_impl, _print_tensor_abstract_eval,
                 jvp=_print_tensor_jvp, batch=_print_tensor_batch, effectful=True)


def print_tensor(x, title: str = ""):
  """Print ``x`` on the host like Poplar's ``PrintTensor`` and return it.

  The line is ``"{title}: [1.0000000 1.5000000]"`` (see
  :func:`format_tensor`, the one printer of ``lowering/printing.py`` that the
  emulated IPU's ``PrintTensor`` uses too); prints happen in program order. Under ``jax.grad``
  only the primal value is printed.
  """
  return print_tensor_p.bind(jnp.asarray(x), title=str(title))


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile lowering of :func:`ipu_jax.ops.print_tensor`.
#
# Tile plan: a ``PrintTensor`` program node (the tensor streams to the host,
# which prints it); the result is the operand's tensor itself (nothing moves on
# chip).


@register_lowering(print_tensor_p)
def _print_tensor_rule(ctx: RuleContext, x, *, title):
  ctx.emit(P.PrintTensor(title, x))
  return [x]
