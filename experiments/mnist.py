r"""An MLP on handwritten digits, trained on the emulated IPU.

By default the data are scikit-learn's 8x8 digits (1,797 real handwritten
digits that ship inside the package; 20% held out for testing). With
``--data_dir`` it reads MNIST's IDX files (``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, optionally gzipped).

::

    python -m experiments.mnist                          # ipu2, 1,472 tiles
    python experiments/mnist.py --tiles_per_ipu 16 --replicas 2 --accumulation_steps 2

It prints the progress of every epoch, the test accuracy and the report of
the training program, and writes the report to ``--report_dir`` (default
``reports/mnist``); ``python -m ipu_jax.report reports/mnist`` prints it again.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common  # noqa: E402

# The shared flags are this runner's own: --help lists them (not only --helpfull).
flags.adopt_module_key_flags(common)

NAME = "mnist"
DEFAULTS = {"epochs": 8, "learning_rate": 3e-3, "batch_size": 32}


def _read_idx(path: str) -> np.ndarray:
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  dtype_code, ndim = data[2], data[3]
  if data[:2] != b"\x00\x00" or dtype_code != 0x08:
    raise ValueError(f"{path}: only unsigned-byte IDX files are supported.")
  shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
  return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find(data_dir: str, stem: str) -> str:
  for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
    path = os.path.join(data_dir, name)
    if os.path.exists(path):
      return path
  raise FileNotFoundError(f"no {stem}[.gz] in {data_dir}")


def load_data(data_dir=None, seed: int = 0):
  """``(x_train, y_train), (x_test, y_test)``: float32 images in [0, 1], flattened."""
  if data_dir:
    x_train = _read_idx(_find(data_dir, "train-images-idx3-ubyte"))
    y_train = _read_idx(_find(data_dir, "train-labels-idx1-ubyte"))
    x_test = _read_idx(_find(data_dir, "t10k-images-idx3-ubyte"))
    y_test = _read_idx(_find(data_dir, "t10k-labels-idx1-ubyte"))
    flat = lambda x: (x.reshape(len(x), -1) / 255.0).astype(np.float32)
    return (flat(x_train), y_train.astype(np.int32)), (flat(x_test), y_test.astype(np.int32))
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  x_train, x_test, y_train, y_test = train_test_split(
      x, y, test_size=0.2, random_state=seed, stratify=y)
  return (x_train, y_train), (x_test, y_test)


def make_model(in_features: int, hidden: int = 128, classes: int = 10, seed: int = 0):
  """A two-hidden-layer ReLU MLP in Flax NNX."""
  import jax
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.hidden1 = nnx.Linear(in_features, hidden, rngs=rngs)
      self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
      self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
      x = jax.nn.relu(self.hidden1(x))
      x = jax.nn.relu(self.hidden2(x))
      return self.out(x)

  return MLP(nnx.Rngs(seed))


def run(settings: common.Settings) -> dict:
  """Trains and evaluates; returns the results (accuracy, report directory...)."""
  common.setup_devices(settings)
  (x_train, y_train), (x_test, y_test) = load_data(settings.data_dir, settings.seed)
  print(f"data: {len(x_train)} training and {len(x_test)} test images of "
        f"{x_train.shape[1]} pixels")
  return common.train_and_evaluate(
      settings, make_model(x_train.shape[1], seed=settings.seed),
      (x_train, y_train), (x_test, y_test), NAME, model_name="mlp")


main = common.main_for(run, DEFAULTS)

if __name__ == "__main__":
  app.run(main)
