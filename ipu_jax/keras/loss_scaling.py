"""Loss scaling for float16 training: static and dynamic (automatic).

Gradients of a float16 model underflow when the loss is small; multiplying the
loss by a scale ``S`` before differentiating shifts every gradient up by ``S``
(into fp16's range) and dividing them by ``S`` before the update undoes it.

:class:`LossScaleOptimizer` wraps an optax optimizer the way Keras's
``LossScaleOptimizer`` wraps a Keras one (and PopTorch's automatic loss
scaling, TF-IPU's ``loss_scaling_factor``):

* **static** (``dynamic=False``): ``S = loss_scaling_factor`` always; a step
  whose unscaled gradients hold inf/NaN is still skipped (counted as an
  overflow), so a too-large factor shows in the logs instead of destroying
  the weights.
* **dynamic** (``dynamic=True``, Keras semantics): a step with non-finite
  gradients is skipped (weights and inner optimizer state unchanged) and
  ``S`` is halved; after ``growth_steps`` consecutive finite steps ``S`` is
  doubled.

The scale, the skipped steps and the overflows live in the optimizer state, so
they are part of the compiled training step; ``ipu_jax.keras.Model`` scales the
loss by :func:`loss_scale_of` its optimizer state and puts :func:`scaling_logs`
(``loss_scale``, ``skipped_steps``, ``overflows``) in the training logs.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

__all__ = ["LossScaleOptimizer", "LossScaleState", "loss_scale_of", "scaling_logs"]


class LossScaleState(NamedTuple):
  inner_state: Any
  loss_scale: jax.Array       # float32 scalar
  good_steps: jax.Array       # int32: finite steps since the scale last changed
  skipped_steps: jax.Array    # int32: updates skipped (non-finite gradients)
  overflows: jax.Array        # int32: steps whose gradients overflowed


def _all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def LossScaleOptimizer(inner: optax.GradientTransformation, loss_scaling_factor: float = 2.0 ** 15,
                       *, dynamic: bool = True, growth_steps: int = 2000,
                       factor: float = 2.0, min_scale: float = 1.0,
                       max_scale: float = 2.0 ** 24) -> optax.GradientTransformation:
  """An optax optimizer that takes gradients of the *scaled* loss.

  Args:
    inner: the optimizer applied to the unscaled gradients.
    loss_scaling_factor: the (initial) scale; a power of two keeps the
      scaling exact.
    dynamic: adjust the scale (Keras ``LossScaleOptimizer(dynamic=True)``).
    growth_steps: finite steps before the scale grows (Keras
      ``dynamic_growth_steps``, 2000).
    factor: growth and back-off factor.
    min_scale, max_scale: bounds of a dynamic scale.

  Raises:
    ValueError: a non-positive or non-finite factor, or growth_steps < 1.
  """
  import math
  for name, v in (("loss_scaling_factor", loss_scaling_factor), ("factor", factor),
                  ("min_scale", min_scale), ("max_scale", max_scale)):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
      raise ValueError(f"LossScaleOptimizer: {name} must be a positive finite number, "
                       f"got {v!r}.")
  if not isinstance(growth_steps, int) or growth_steps < 1:
    raise ValueError(f"LossScaleOptimizer: growth_steps must be an int >= 1, got "
                     f"{growth_steps!r}.")
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(f"LossScaleOptimizer wraps an optax GradientTransformation; got {inner!r}.")

  def init(params):
    zero = jnp.zeros((), jnp.int32)
    return LossScaleState(inner.init(params), jnp.asarray(loss_scaling_factor, jnp.float32),
                          zero, zero, zero)

  def update(grads, state, params=None):
    scale = state.loss_scale
    unscaled = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), grads)
    finite = _all_finite(unscaled)
    updates, inner_state = inner.update(unscaled, state.inner_state, params)
    # A skipped step changes neither the weights nor the inner state.
    updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                               inner_state, state.inner_state)
    bad = (~finite).astype(jnp.int32)
    good = jnp.where(finite, state.good_steps + 1, 0)
    if dynamic:
      grow = good >= growth_steps
      new_scale = jnp.where(finite, jnp.where(grow, scale * factor, scale), scale / factor)
      new_scale = jnp.clip(new_scale, min_scale, max_scale)
      good = jnp.where(grow, 0, good)
    else:
      new_scale = scale
    return updates, LossScaleState(inner_state, new_scale, good,
                                   state.skipped_steps + bad, state.overflows + bad)

  return optax.GradientTransformation(init, update)


def loss_scale_of(opt_state) -> Optional[jax.Array]:
  """The loss scale held in ``opt_state``, or None without loss scaling."""
  return opt_state.loss_scale if isinstance(opt_state, LossScaleState) else None


def scaling_logs(opt_state) -> dict:
  """``{"loss_scale", "skipped_steps", "overflows"}`` from ``opt_state`` (else {})."""
  if not isinstance(opt_state, LossScaleState):
    return {}
  return {"loss_scale": float(jax.device_get(opt_state.loss_scale)),
          "skipped_steps": int(jax.device_get(opt_state.skipped_steps)),
          "overflows": int(jax.device_get(opt_state.overflows))}
