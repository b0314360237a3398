r"""A small transformer encoder on a synthetic sequence task, on the emulated IPU.

The encoder: token and position embeddings (vocabulary 256, width 64,
sequence 32), 2 pre-norm layers of 4-head self-attention and a GELU MLP, a
final layer norm and a linear read-out per position, in Flax NNX.

The task (``--task``) is one it can learn only by attending across positions:

* ``shift`` (default): output position t is the input token at t - 1
  (position 0 predicts token 0), a copy with shift;
* ``reverse``: the sequence reversed.

::

    python -m experiments.transformer --tiles_per_ipu 64 --epochs 3

``--offload_optimizer_state`` keeps the Adam state in streaming memory and
``--replicated_tensor_sharding`` (with ``--replicas``) shards it over the
replicas; the report then has a "Streaming memory" section.
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

# The shared flags are this runner's own: --help lists them (not only --helpfull).
flags.adopt_module_key_flags(common)

if "task" not in flags.FLAGS:
  flags.DEFINE_enum("task", "shift", ["shift", "reverse"], "The synthetic sequence task.")
if "offload_optimizer_state" not in flags.FLAGS:
  flags.DEFINE_boolean(
      "offload_optimizer_state", False,
      "Keep the Adam state in streaming memory (IPUConfig."
      "streaming.offload_optimizer_state), streamed onto the tiles for each update.")
  flags.DEFINE_boolean(
      "replicated_tensor_sharding", False,
      "With --replicas R > 1, each replica holds 1/R of the optimizer state: "
      "reduce-scatter, sharded update, all-gather (IPUConfig."
      "streaming.replicated_tensor_sharding).")

NAME = "transformer"
DEFAULTS = {"epochs": 4, "learning_rate": 3e-3, "batch_size": 16}
VOCAB, WIDTH, HEADS, LAYERS, SEQ = 256, 64, 4, 2, 32


def make_data(num_samples: int, task: str = "shift", seq_len: int = SEQ, vocab: int = VOCAB,
              seed: int = 0):
  """Random token sequences (tokens 1..vocab-1) and their targets."""
  rng = np.random.default_rng(seed)
  x = rng.integers(1, vocab, size=(num_samples, seq_len)).astype(np.int32)
  if task == "shift":
    y = np.concatenate([np.zeros((num_samples, 1), np.int32), x[:, :-1]], axis=1)
  elif task == "reverse":
    y = x[:, ::-1].copy()
  else:
    raise ValueError(f"unknown task {task!r}; use 'shift' or 'reverse'.")
  return x, y


def make_model(seed: int = 0, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS,
               layers: int = LAYERS, seq_len: int = SEQ):
  """The encoder in Flax NNX."""
  import jax
  from flax import nnx

  class EncoderLayer(nnx.Module):
    def __init__(self, rngs):
      self.norm1 = nnx.LayerNorm(width, rngs=rngs)
      self.attention = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                              decode=False, rngs=rngs)
      self.norm2 = nnx.LayerNorm(width, rngs=rngs)
      self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
      self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x):
      x = x + self.attention(self.norm1(x))
      return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))

  class Encoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, width, rngs=rngs)
      self.position = nnx.Param(
          jax.random.normal(rngs.params(), (seq_len, width)) * 0.02)
      self.layers = nnx.List([EncoderLayer(rngs) for _ in range(layers)])
      self.norm = nnx.LayerNorm(width, rngs=rngs)
      self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.position[None, :tokens.shape[1]]
      for layer in self.layers:
        x = layer(x)
      return self.head(self.norm(x))

  return Encoder(nnx.Rngs(seed))


def streaming_options(offload: bool, sharding: bool):
  """``configure(cfg)`` applying the streaming-memory flags to an IPUConfig."""
  def configure(cfg):
    cfg.streaming.offload_optimizer_state = bool(offload)
    cfg.streaming.replicated_tensor_sharding = bool(sharding)
  return configure


def run(settings: common.Settings, task: str = None, offload_optimizer_state: bool = None,
        replicated_tensor_sharding: bool = None) -> dict:
  common.setup_devices(settings)
  task = task or flags.FLAGS["task"].value or "shift"
  if offload_optimizer_state is None:
    offload_optimizer_state = bool(flags.FLAGS["offload_optimizer_state"].value)
  if replicated_tensor_sharding is None:
    replicated_tensor_sharding = bool(flags.FLAGS["replicated_tensor_sharding"].value)
  n = settings.num_samples or 2048
  x_train, y_train = make_data(n, task, seed=settings.seed)
  x_test, y_test = make_data(max(n // 8, 64), task, seed=settings.seed + 1)
  print(f"task: {task}, {n} training sequences of {SEQ} tokens (vocabulary {VOCAB})")
  # Accuracies are per token.
  return common.train_and_evaluate(
      settings, make_model(settings.seed), (x_train, y_train), (x_test, y_test), NAME,
      model_name="encoder",
      configure=streaming_options(offload_optimizer_state, replicated_tensor_sharding))


main = common.main_for(run, DEFAULTS)

if __name__ == "__main__":
  app.run(main)
