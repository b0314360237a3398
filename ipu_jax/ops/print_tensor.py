"""``print_tensor``: Poplar's ``PrintTensor`` as an identity op."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from ipu_jax.ops._common import _compiled
from ipu_jax.jax_compat import debugging


print_tensor_p = jcore.Primitive("print_tensor")


def format_tensor(value) -> str:
  """Poplar's PrintTensor format: ``[1.0000000 1.5000000]``."""
  from ipu_jax.lowering.executor import format_tensor as fmt
  return fmt(np.asarray(value))


def _print_host(title, value):
  sys.stdout.write(f"{title}: {format_tensor(value)}\n")
  sys.stdout.flush()


def _print_tensor_impl(x, *, title):
  jax.debug.callback(functools.partial(_print_host, title), x, ordered=True)
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


print_tensor_p.def_impl(_compiled(_print_tensor_impl))
print_tensor_p.def_effectful_abstract_eval(_print_tensor_abstract_eval)
ad.primitive_jvps[print_tensor_p] = _print_tensor_jvp
batching.primitive_batchers[print_tensor_p] = _print_tensor_batch
mlir.register_lowering(print_tensor_p, mlir.lower_fun(_print_tensor_impl,
                                                      multiple_results=False))


def print_tensor(x, title: str = ""):
  """Print ``x`` on the host like Poplar's ``PrintTensor`` and return it.

  The line is ``"{title}: [1.0000000 1.5000000]"`` (see
  :func:`format_tensor`); prints happen in program order. Under ``jax.grad``
  only the primal value is printed.
  """
  return print_tensor_p.bind(jnp.asarray(x), title=str(title))
