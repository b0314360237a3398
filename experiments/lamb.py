"""LAMB whose moments are kept in chosen dtypes, as PopART's ``Adam`` keeps them.

``optax.lamb`` keeps both of Adam's moments in the weights' dtype (float16
weights: float16 moments); ``optax.scale_by_adam`` takes a first-moment
dtype (``mu_dtype``) but none for the second moment. PopART's
``popart.Adam(..., mode=AdamMode.Lamb/LambNoBias, accl1_type=, accl2_type=)``
gives each its own (Graphcore's MLPerf BERT runs: ``lamb_m_dtype`` set the
first moment, ``lamb_accl_dtype`` both; docs/published_bert.md), so
:func:`lamb` takes ``mu_dtype`` (m, PopART's accl1) and ``nu_dtype`` (v,
accl2). Each moment's update is computed in its own dtype (the gradient cast
to it first), so a float32 moment of float16 gradients gains no float16
rounding of ``(1 - b) g`` or ``g ** 2``; with both dtypes the weights'
(``None``, the default) the numbers are ``optax.lamb``'s.

``bias_correction=False`` is PopART's ``AdamMode.LambNoBias`` (the mode
every Graphcore MLPerf BERT run chose, ``optimizer: LAMB_NO_BIAS``): the
moments divide the update as they are, without Adam's ``1 - b ** t``
corrections (graphcore/popart ``willow/include/popart/adam.hpp``, the
optimizer's formulas: ``m_tmp := m'``, ``v_tmp := v'`` for LambNoBias).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["lamb", "scale_by_adam_in", "moment_dtype"]


def moment_dtype(name: str, dtype: Any):
  """``dtype`` as a floating NumPy dtype (``None``: the weights'), checked.

  Raises:
    ValueError: ``dtype`` is not a floating dtype, naming ``name``.
  """
  if dtype is None:
    return None
  try:
    canonical = np.dtype(dtype)
  except TypeError:
    canonical = None
  if canonical is None or not jnp.issubdtype(canonical, jnp.floating):
    raise ValueError(f"{name}={dtype!r} is not a floating dtype; give e.g. 'float16' or "
                     f"'float32', or None for the weights' dtype.")
  return canonical


def _to_moment(updates, moments):
  """Each gradient cast to its moment's dtype: the moment is updated in its own."""
  return jax.tree.map(lambda g, t: g.astype(t.dtype), updates, moments)


def scale_by_adam_in(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
                     eps_root: float = 0.0, mu_dtype: Any = None,
                     nu_dtype: Any = None,
                     bias_correction: bool = True) -> optax.GradientTransformation:
  """``optax.scale_by_adam`` with the first moment in ``mu_dtype`` and the second in
  ``nu_dtype`` (``None``: the weights' dtype); the state is ``optax.ScaleByAdamState``.
  ``bias_correction=False`` divides by the moments as they are (PopART's NoBias modes).

  Raises:
    ValueError: a dtype that is not floating, naming the argument.
  """
  mu_dtype = moment_dtype("mu_dtype", mu_dtype)
  nu_dtype = moment_dtype("nu_dtype", nu_dtype)

  def init(params):
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32),
                                  mu=optax.tree.zeros_like(params, dtype=mu_dtype),
                                  nu=optax.tree.zeros_like(params, dtype=nu_dtype))

  def update(updates, state, params=None):
    del params
    mu = optax.tree.update_moment(_to_moment(updates, state.mu), state.mu, b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(_to_moment(updates, state.nu), state.nu, b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat, nu_hat = mu, nu
    if bias_correction:
      mu_hat = optax.tree.bias_correction(mu, b1, count)
      nu_hat = optax.tree.bias_correction(nu, b2, count)
    scaled = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    # A weakly typed constant must not move a moment out of its dtype.
    state = optax.ScaleByAdamState(count=count, mu=optax.tree.cast_like(mu, state.mu),
                                   nu=optax.tree.cast_like(nu, state.nu))
    return scaled, state

  return optax.GradientTransformation(init, update)


def lamb(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-6, eps_root: float = 0.0, weight_decay: float = 0.0,
         mask: Any = None, mu_dtype: Any = None, nu_dtype: Any = None,
         bias_correction: bool = True) -> optax.GradientTransformation:
  """``optax.lamb`` (same arguments and defaults) with its moments in ``mu_dtype``
  and ``nu_dtype`` (``None``: the weights' dtype, ``optax.lamb``'s numbers);
  ``bias_correction=False`` is PopART's LambNoBias.

  Raises:
    ValueError: a dtype that is not floating, naming the argument.
  """
  return optax.chain(
      scale_by_adam_in(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                       nu_dtype=nu_dtype, bias_correction=bias_correction),
      optax.add_decayed_weights(weight_decay=weight_decay, mask=mask),
      optax.scale_by_trust_ratio(),
      optax.scale_by_learning_rate(learning_rate),
  )
