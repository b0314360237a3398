"""Training-step workloads for the end-to-end tests and the benchmark runner.

The models are the runners' own Flax NNX models (``experiments.mnist``,
``experiments.cifar_cnn``, ``experiments.transformer``), so each is defined
once; this module turns one into a pure optax training step (forward,
``jax.grad``, update) over explicit parameters, which ``ipu_jax.jit`` and
``jax.jit`` can both compile.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

__all__ = ["make_train_step", "workload"]


def make_train_step(model: nnx.Module, optimizer: optax.GradientTransformation,
                    reduce_grads=None):
  """``(step, params)`` for ``model``.

  ``step(params, opt_state, x, y, rng) -> (params, opt_state, loss)``; ``rng``
  reseeds the model's random streams (dropout), so the step is pure.
  ``step.loss_fn(params, x, y, rng)`` is the loss alone. ``reduce_grads``
  (e.g. ``ipu_jax.ops.cross_replica_mean`` for a replicated step), if given,
  is applied to the gradients before the update.
  """
  graphdef, params, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)

  def loss_fn(params, x, y, rng):
    # Every random stream (dropout) starts from this step's key.
    keys = jax.tree_util.tree_map(
        lambda v: rng if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v, rng_state)
    logits = nnx.merge(graphdef, params, keys, rest)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(params, opt_state, x, y, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, rng)
    if reduce_grads is not None:
      grads = reduce_grads(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step.loss_fn = loss_fn
  return step, params


def workload(name: str, batch: int = 0, seed: int = 0):
  """``(step_fn, args)`` for a named training-step workload, adam optimizer.

  Names: ``"mlp"`` (784-128-128-10, batch 64), ``"cnn"`` (the Keras-on-IPU
  CNN on 32x32x3, batch 8), ``"transformer"`` (2 layers, 4 heads, width 64,
  sequence 32, vocabulary 256, batch 8).
  """
  from experiments import cifar_cnn, mnist, transformer
  k_x, k_y, k_drop = jax.random.split(jax.random.key(seed), 3)
  if name == "mlp":
    batch = batch or 64
    model = mnist.make_model(784, hidden=128, classes=10, seed=seed)
    x = jax.random.normal(k_x, (batch, 784))
    y = jax.random.randint(k_y, (batch,), 0, 10)
  elif name == "cnn":
    batch = batch or 8
    model = cifar_cnn.make_model(seed)
    x = jax.random.normal(k_x, (batch, 32, 32, 3))
    y = jax.random.randint(k_y, (batch,), 0, 10)
  elif name == "transformer":
    batch = batch or 8
    model = transformer.make_model(seed)
    x = jax.random.randint(k_x, (batch, 32), 0, 256)
    y = jax.random.randint(k_y, (batch, 32), 0, 256)
  else:
    raise ValueError(f"unknown workload {name!r}; valid: 'mlp', 'cnn', 'transformer'")
  optimizer = optax.adam(1e-3)
  step, params = make_train_step(model, optimizer)
  return step, (params, optimizer.init(params), x, y, k_drop)
