"""Gradient accumulation: G micro-batches, one weight update.

The reductions of Keras on IPU (``gradient_accumulation_reduction_method``):

* ``"sum"`` (the Keras-on-IPU default): the gradients are added up.
* ``"mean"``: their mean, the sum divided by G at the end -- what
  ``optax.MultiSteps`` gives (it keeps a running mean, equal to within
  rounding).
* ``"running_mean"``: a mean kept while accumulating,
  ``acc <- acc + (g - acc) / (k + 1)``, which stays in range in float16.

These are pure functions of pytrees; :class:`ipu_jax.keras.Model` uses them
inside the on-device loop, so they become part of the tile program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["REDUCTIONS", "check_reduction", "init", "accumulate", "finalize"]

REDUCTIONS = ("sum", "mean", "running_mean")

_ALIASES = {"SUM": "sum", "MEAN": "mean", "RUNNING_MEAN": "running_mean"}


def check_reduction(method) -> str:
  """``method`` as a lower-case name; accepts Keras's enum names too.

  Raises:
    ValueError: not one of sum, mean, running_mean.
  """
  name = getattr(method, "name", method)  # an enum member
  if isinstance(name, str):
    name = _ALIASES.get(name, name).lower()
  if name not in REDUCTIONS:
    raise ValueError(f"gradient accumulation reduction_method must be one of "
                     f"{', '.join(map(repr, REDUCTIONS))}; got {method!r}.")
  return name


def init(grads_like):
  """Zero accumulators shaped like the gradients."""
  return jax.tree.map(jnp.zeros_like, grads_like)


def accumulate(acc, grads, k, method: str):
  """Adds micro-batch ``k`` (0-based) to the accumulators."""
  if method == "running_mean":
    scale = 1.0 / (jnp.asarray(k, jnp.float32) + 1.0)
    return jax.tree.map(lambda a, g: a + (g - a) * scale.astype(a.dtype), acc, grads)
  return jax.tree.map(jnp.add, acc, grads)


def finalize(acc, steps: int, method: str):
  """The reduced gradient after ``steps`` micro-batches."""
  if method == "mean" and steps > 1:
    return jax.tree.map(lambda a: a / jnp.asarray(steps, a.dtype), acc)
  return acc
