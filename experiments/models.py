"""Reference models used by the end-to-end tests and the benchmark runner.

Flax linen versions of the three workloads the issues name: an MLP, the CNN of
Graphcore's Keras-on-IPU example, and a small transformer encoder; plus
``make_train_step`` building one optax training step (forward, ``jax.grad``,
update) for any of them.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class MLP(nn.Module):
  """Dense layers with ReLU; the last layer gives logits."""
  features: tuple = (128, 128, 10)

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape((x.shape[0], -1))
    for width in self.features[:-1]:
      x = nn.relu(nn.Dense(width)(x))
    return nn.Dense(self.features[-1])(x)


class KerasCNN(nn.Module):
  """The CNN of the Keras-on-IPU example (CIFAR-10).

  Conv2D 32, Conv2D 32, max-pool, Conv2D 64, Conv2D 64, max-pool, dense 512,
  dropout, dense 10.
  """
  num_classes: int = 10
  dropout_rate: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.relu(nn.Conv(32, (3, 3), padding="SAME")(x))
    x = nn.relu(nn.Conv(32, (3, 3), padding="VALID")(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = nn.relu(nn.Conv(64, (3, 3), padding="SAME")(x))
    x = nn.relu(nn.Conv(64, (3, 3), padding="VALID")(x))
    x = nn.max_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.relu(nn.Dense(512)(x))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(self.num_classes)(x)


class EncoderBlock(nn.Module):
  width: int
  heads: int
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, train: bool = False):
    y = nn.LayerNorm()(x)
    y = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.width,
                                        dropout_rate=self.dropout_rate,
                                        deterministic=not train)(y, y)
    x = x + y
    y = nn.LayerNorm()(x)
    y = nn.gelu(nn.Dense(4 * self.width)(y))
    y = nn.Dropout(self.dropout_rate, deterministic=not train)(nn.Dense(self.width)(y))
    return x + y


class TransformerEncoder(nn.Module):
  """A small encoder: embedding, positional embedding, blocks, per-token logits."""
  vocab: int = 256
  width: int = 64
  heads: int = 4
  layers: int = 2
  max_len: int = 32
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, tokens, train: bool = False):
    x = nn.Embed(self.vocab, self.width)(tokens)
    positions = self.param("positions", nn.initializers.normal(0.02),
                           (self.max_len, self.width))
    x = x + positions[: tokens.shape[1]]
    for _ in range(self.layers):
      x = EncoderBlock(self.width, self.heads, self.dropout_rate)(x, train)
    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab)(x)


def make_train_step(model: nn.Module, optimizer: optax.GradientTransformation) -> Callable:
  """``step(params, opt_state, x, y, rng) -> (params, opt_state, loss)``."""

  def loss_fn(params, x, y, rng):
    logits = model.apply({"params": params}, x, train=True, rngs={"dropout": rng})
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(params, opt_state, x, y, rng):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y, rng)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step.loss_fn = loss_fn  # for tests that look at the gradients themselves
  return step


def workload(name: str, batch: int = 0, seed: int = 0):
  """``(step_fn, args)`` for a named training-step workload.

  Names: ``"mlp"`` (784-128-128-10, batch 64), ``"cnn"`` (Keras CNN, 32x32x3,
  batch 8), ``"transformer"`` (2 layers, 4 heads, width 64, sequence 32,
  vocabulary 256, batch 8). The optimizer is adam.
  """
  key = jax.random.key(seed)
  k_init, k_x, k_y, k_drop = jax.random.split(key, 4)
  if name == "mlp":
    batch = batch or 64
    model = MLP((128, 128, 10))
    x = jax.random.normal(k_x, (batch, 784))
    y = jax.random.randint(k_y, (batch,), 0, 10)
  elif name == "cnn":
    batch = batch or 8
    model = KerasCNN()
    x = jax.random.normal(k_x, (batch, 32, 32, 3))
    y = jax.random.randint(k_y, (batch,), 0, 10)
  elif name == "transformer":
    batch = batch or 8
    model = TransformerEncoder()
    x = jax.random.randint(k_x, (batch, 32), 0, 256)
    y = jax.random.randint(k_y, (batch, 32), 0, 256)
  else:
    raise ValueError(f"unknown workload {name!r}; valid: 'mlp', 'cnn', 'transformer'")
  params = model.init({"params": k_init, "dropout": k_drop}, x)["params"]
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(params)
  return make_train_step(model, optimizer), (params, opt_state, x, y, k_drop)
