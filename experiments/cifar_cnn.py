r"""The CNN of Graphcore's Keras-on-IPU example, on CIFAR-10, on the emulated IPU.

Conv2D 32 3x3 (same) - Conv2D 32 3x3 - max-pool 2x2 - dropout 0.25 -
Conv2D 64 3x3 (same) - Conv2D 64 3x3 - max-pool 2x2 - dropout 0.25 -
dense 512 - dropout 0.5 - dense 10, ReLU activations, in Flax NNX.

With ``--data_dir DIR`` it reads CIFAR-10's python pickle batches
(``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, as in
``cifar-10-batches-py``). Without it, it makes synthetic data of CIFAR's shape
(32x32x3 images, 10 classes) that a CNN can learn: each class has its own
pattern of coloured blobs, under noise. ``--num_samples`` sets how many.

The training step needs about 18 MB always live (5 MB of weights, 10 MB of
Adam state, 1.6 MB of input batches for 8 steps) plus one step's temporaries,
whose largest is the second convolution's working memory: it fits 128 tiles
(peak tile 585 KB of 624 KB), not 64. Example (``tests/test_experiments_help.py``
runs it)::

    python -m experiments.cifar_cnn --tiles_per_ipu 128 --epochs 2
"""

from __future__ import annotations

import os
import pickle

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

# The shared flags are this runner's own: --help lists them (not only --helpfull).
flags.adopt_module_key_flags(common)

NAME = "cifar_cnn"
DEFAULTS = {"epochs": 2, "learning_rate": 1e-3, "batch_size": 16}
IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10


def _load_batch(path: str):
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")
  data = batch[b"data"] if b"data" in batch else batch["data"]
  labels = batch[b"labels"] if b"labels" in batch else batch["labels"]
  images = np.asarray(data, np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return (images / 255.0).astype(np.float32), np.asarray(labels, np.int32)


def synthetic_data(num_samples: int, seed: int = 0, image_shape=IMAGE_SHAPE,
                   classes: int = CLASSES):
  """Images whose class decides where coloured blobs sit, plus noise."""
  rng = np.random.default_rng(seed)
  h, w, c = image_shape
  templates = np.zeros((classes, h, w, c), np.float32)
  yy, xx = np.mgrid[0:h, 0:w]
  pattern_rng = np.random.default_rng(1234)  # the same classes for every seed
  for k in range(classes):
    for _ in range(3):
      cy, cx = pattern_rng.uniform(4, h - 4), pattern_rng.uniform(4, w - 4)
      colour = pattern_rng.uniform(0.2, 1.0, size=c)
      blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * 3.0 ** 2))
      templates[k] += blob[..., None] * colour
  labels = rng.integers(0, classes, num_samples).astype(np.int32)
  images = templates[labels] + rng.normal(0, 0.3, size=(num_samples, h, w, c))
  return images.astype(np.float32), labels


def load_data(data_dir=None, num_samples: int = 0, seed: int = 0):
  """``(x_train, y_train), (x_test, y_test)`` as NHWC float32 in [0, 1]."""
  if data_dir:
    parts = [_load_batch(os.path.join(data_dir, f"data_batch_{i}")) for i in range(1, 6)
             if os.path.exists(os.path.join(data_dir, f"data_batch_{i}"))]
    if not parts:
      raise FileNotFoundError(f"no data_batch_* files in {data_dir}")
    x_train = np.concatenate([p[0] for p in parts])
    y_train = np.concatenate([p[1] for p in parts])
    x_test, y_test = _load_batch(os.path.join(data_dir, "test_batch"))
    if num_samples:
      x_train, y_train = x_train[:num_samples], y_train[:num_samples]
      x_test, y_test = x_test[:max(num_samples // 5, 1)], y_test[:max(num_samples // 5, 1)]
    return (x_train, y_train), (x_test, y_test)
  n = num_samples or 512
  x, y = synthetic_data(n + max(n // 4, 1), seed)
  return (x[:n], y[:n]), (x[n:], y[n:])


def make_model(seed: int = 0, image_shape=IMAGE_SHAPE, classes: int = CLASSES):
  """The Keras-on-IPU example CNN in Flax NNX."""
  import jax
  from flax import nnx

  class CNN(nnx.Module):
    def __init__(self, rngs):
      c = image_shape[-1]
      self.conv1 = nnx.Conv(c, 32, (3, 3), padding="SAME", rngs=rngs)
      self.conv2 = nnx.Conv(32, 32, (3, 3), padding="VALID", rngs=rngs)
      self.drop1 = nnx.Dropout(0.25, rngs=rngs)
      self.conv3 = nnx.Conv(32, 64, (3, 3), padding="SAME", rngs=rngs)
      self.conv4 = nnx.Conv(64, 64, (3, 3), padding="VALID", rngs=rngs)
      self.drop2 = nnx.Dropout(0.25, rngs=rngs)
      h = ((image_shape[0] - 2) // 2 - 2) // 2
      w = ((image_shape[1] - 2) // 2 - 2) // 2
      self.dense1 = nnx.Linear(h * w * 64, 512, rngs=rngs)
      self.drop3 = nnx.Dropout(0.5, rngs=rngs)
      self.dense2 = nnx.Linear(512, classes, rngs=rngs)

    def __call__(self, x):
      x = jax.nn.relu(self.conv1(x))
      x = jax.nn.relu(self.conv2(x))
      x = self.drop1(nnx.max_pool(x, (2, 2), strides=(2, 2)))
      x = jax.nn.relu(self.conv3(x))
      x = jax.nn.relu(self.conv4(x))
      x = self.drop2(nnx.max_pool(x, (2, 2), strides=(2, 2)))
      x = x.reshape(x.shape[0], -1)
      x = self.drop3(jax.nn.relu(self.dense1(x)))
      return self.dense2(x)

  return CNN(nnx.Rngs(params=seed, dropout=seed + 1))


def run(settings: common.Settings) -> dict:
  common.setup_devices(settings)
  (x_train, y_train), (x_test, y_test) = load_data(settings.data_dir, settings.num_samples,
                                                   settings.seed)
  print(f"data: {len(x_train)} training and {len(x_test)} test images of shape "
        f"{x_train.shape[1:]}" + ("" if settings.data_dir else " (synthetic)"))
  return common.train_and_evaluate(
      settings, make_model(settings.seed, x_train.shape[1:]),
      (x_train, y_train), (x_test, y_test), NAME, model_name="cnn")


main = common.main_for(run, DEFAULTS)

if __name__ == "__main__":
  app.run(main)
