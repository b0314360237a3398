"""AdamW whose moments are kept in chosen dtypes, as PopTorch's ``AdamW`` keeps them.

``optax.adamw`` keeps its second moment in the weights' dtype (float16
weights: a float16 ``v``); PopTorch's ``poptorch.optim.AdamW`` takes
``first_order_momentum_accum_type`` and ``second_order_momentum_accum_type``
(Graphcore's GPT-2 example: float16 and float32, ``tools.get_optimizer``) and
``bias_correction`` (the example: False). :func:`adamw` is
``optax.adamw``'s chain with its moments from
:func:`experiments.lamb.scale_by_adam_in` (each moment updated in its own
dtype); with both dtypes ``None`` and bias correction on, the numbers are
``optax.adamw``'s.
"""

from __future__ import annotations

from typing import Any

import optax

from experiments.lamb import scale_by_adam_in

__all__ = ["adamw"]


def adamw(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, weight_decay: float = 0.0,
          mask: Any = None, mu_dtype: Any = None, nu_dtype: Any = None,
          bias_correction: bool = True) -> optax.GradientTransformation:
  """AdamW with its moments in ``mu_dtype`` and ``nu_dtype`` (``None``: the weights').

  Raises:
    ValueError: a dtype that is not floating, naming the argument.
  """
  return optax.chain(
      scale_by_adam_in(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype,
                       nu_dtype=nu_dtype, bias_correction=bias_correction),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
