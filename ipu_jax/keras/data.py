"""Host-side training data for ``ipu_jax.keras.Model``: arrays or batches.

``fit``/``evaluate``/``predict`` accept NumPy-like arrays (or pytrees of them)
with labels, or an iterable of ``(x, y)`` batches; these helpers normalise
both to host arrays of the dtypes the device program takes.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

__all__ = ["ArrayData", "as_arrays", "host_dtype", "is_array_like", "looks_iterable_of_batches",
           "num_samples", "split_batch"]


def host_dtype(array: np.ndarray) -> np.ndarray:
  array = np.asarray(array)
  if array.dtype == np.float64:
    return array.astype(np.float32)
  if array.dtype == np.int64 or array.dtype == np.uint64:
    return array.astype(np.int32)
  if array.dtype == np.bool_:
    return array.astype(np.int32)
  return array


def _is_number(value) -> bool:
  return isinstance(value, (bool, int, float, complex, np.generic))


def _nested_numbers(value) -> bool:
  if isinstance(value, (list, tuple)):
    return bool(value) and all(_nested_numbers(v) for v in value)
  return _is_number(value)


def as_arrays(value):
  """Python lists/tuples of numbers (at any nesting) become NumPy arrays, as in Keras.

  Anything else (arrays, pytrees of arrays, iterables of batches) is returned
  unchanged.
  """
  if isinstance(value, (list, tuple)) and _nested_numbers(value):
    return np.asarray(value)
  return value


def num_samples(x) -> int:
  leaves = jax.tree.leaves(x)
  if not leaves:
    raise ValueError("x holds no arrays.")
  n = {np.shape(leaf)[0] for leaf in leaves}
  if len(n) != 1:
    raise ValueError(f"every array in x needs the same number of samples; got {sorted(n)}.")
  return n.pop()


class ArrayData:
  """``x`` (array or pytree of arrays) and ``y`` arrays held on the host."""

  def __init__(self, x, y, batch_size):
    self.x = jax.tree.map(host_dtype, x)
    self.y = None if y is None else host_dtype(y)
    self.n = num_samples(self.x)
    if self.y is not None and len(self.y) != self.n:
      raise ValueError(f"x has {self.n} samples and y has {len(self.y)}.")
    # fit, evaluate and predict all batch through here: one check for the three.
    if (isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral)
        or batch_size < 1):
      raise ValueError(f"batch_size must be an int >= 1 (samples a replica takes a step); "
                       f"got {batch_size!r}.")
    self.batch_size = int(batch_size)

  def take(self, index):
    x = jax.tree.map(lambda a: a[index], self.x)
    y = None if self.y is None else self.y[index]
    return x, y


def is_array_like(x) -> bool:
  leaves = jax.tree.leaves(x)
  return bool(leaves) and all(hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                              for leaf in leaves) and not looks_iterable_of_batches(x)


def looks_iterable_of_batches(x) -> bool:
  if isinstance(x, (np.ndarray, jax.Array, dict)):
    return False
  if isinstance(x, (list, tuple)):
    return bool(x) and isinstance(x[0], (tuple, list)) and len(x[0]) == 2
  return hasattr(x, "__iter__") or hasattr(x, "__next__")


def split_batch(item):
  if isinstance(item, dict) and "x" in item:
    return item["x"], item.get("y")
  if isinstance(item, (tuple, list)) and len(item) == 2:
    return item[0], item[1]
  raise ValueError("a dataset for ipu_jax.keras.Model must yield (x, y) pairs or "
                   f"dicts with 'x' and 'y'; got {type(item).__name__}.")
