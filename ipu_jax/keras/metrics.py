"""Metrics for :class:`ipu_jax.keras.Model`.

A metric is a function ``metric(y_true, y_pred) -> [batch]`` of per-sample
values. The model sums them on the device over every step of an execution
(masked where the last evaluation batch is padded) and the host keeps a
running mean over the epoch, which is what Keras reports.

Names: ``"accuracy"`` / ``"acc"`` (resolved from the loss as Keras does:
sparse, categorical or binary accuracy), ``"sparse_categorical_accuracy"``,
``"categorical_accuracy"``, ``"binary_accuracy"``, ``"mse"``, ``"mae"``,
``"sparse_top_k_categorical_accuracy"`` (k=5).
"""

from __future__ import annotations

import difflib
from typing import Callable, Union

import jax
import jax.numpy as jnp

__all__ = ["Metric", "get", "METRICS"]


def _per_sample(values):
  if values.ndim <= 1:
    return values
  return jnp.mean(values.reshape(values.shape[0], -1), axis=1)


class Metric:
  """A named per-sample metric function."""

  def __init__(self, name: str, fn: Callable):
    self.name = name
    self.fn = fn

  def __call__(self, y_true, y_pred) -> jax.Array:
    values = jnp.asarray(self.fn(y_true, y_pred))
    return values.astype(jnp.float32)

  def __repr__(self):
    return f"Metric({self.name!r})"


def sparse_categorical_accuracy(y_true, y_pred):
  labels = jnp.asarray(y_true).astype(jnp.int32)
  if labels.ndim == y_pred.ndim:
    labels = labels[..., 0]
  return _per_sample((jnp.argmax(y_pred, axis=-1) == labels).astype(jnp.float32))


def categorical_accuracy(y_true, y_pred):
  return _per_sample((jnp.argmax(y_pred, axis=-1) == jnp.argmax(y_true, axis=-1))
                     .astype(jnp.float32))


def _binary_accuracy(threshold):
  def binary_accuracy(y_true, y_pred):
    y_true = jnp.reshape(y_true, y_pred.shape)
    return _per_sample(((y_pred > threshold) == (y_true > 0.5)).astype(jnp.float32))
  return binary_accuracy


def mse(y_true, y_pred):
  return _per_sample(jnp.square(y_pred - jnp.reshape(y_true, y_pred.shape)))


def mae(y_true, y_pred):
  return _per_sample(jnp.abs(y_pred - jnp.reshape(y_true, y_pred.shape)))


def sparse_top_k_categorical_accuracy(y_true, y_pred, k: int = 5):
  labels = jnp.asarray(y_true).astype(jnp.int32)
  if labels.ndim == y_pred.ndim:
    labels = labels[..., 0]
  target = jnp.take_along_axis(y_pred, labels[..., None], axis=-1)
  # In the top k when fewer than k classes score strictly higher.
  higher = jnp.sum((y_pred > target).astype(jnp.int32), axis=-1)
  return _per_sample((higher < k).astype(jnp.float32))


METRICS = {
    "sparse_categorical_accuracy": sparse_categorical_accuracy,
    "categorical_accuracy": categorical_accuracy,
    "binary_accuracy": _binary_accuracy(0.0),
    "mse": mse, "mean_squared_error": mse,
    "mae": mae, "mean_absolute_error": mae,
    "sparse_top_k_categorical_accuracy": sparse_top_k_categorical_accuracy,
}
_ACCURACY_NAMES = ("accuracy", "acc")


def get(metric: Union[str, Callable, Metric], loss=None,
        from_logits: bool = True) -> Metric:
  """The :class:`Metric` for a name or callable.

  ``"accuracy"`` becomes the accuracy that matches ``loss`` (a
  :class:`~ipu_jax.keras.losses.Loss`) and keeps the name ``accuracy``.

  Raises:
    ValueError: an unknown name.
  """
  if isinstance(metric, Metric):
    return metric
  if isinstance(metric, str):
    key = metric.lower()
    if key in _ACCURACY_NAMES:
      kind = getattr(loss, "accuracy", None) or "auto"
      if kind == "binary_accuracy" and not getattr(loss, "from_logits", from_logits):
        return Metric(metric, _binary_accuracy(0.5))
      if kind in METRICS:
        return Metric(metric, METRICS[kind])
      return Metric(metric, _auto_accuracy)
    if key not in METRICS:
      close = difflib.get_close_matches(key, list(METRICS) + list(_ACCURACY_NAMES), n=2)
      hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
      raise ValueError(f"Unknown metric {metric!r}.{hint} Known metrics: "
                       f"{', '.join(sorted(set(METRICS) | set(_ACCURACY_NAMES)))}; "
                       "or pass a callable metric(y_true, y_pred).")
    return Metric(metric, METRICS[key])
  if callable(metric):
    return Metric(getattr(metric, "__name__", "metric"), metric)
  raise TypeError(f"metric must be a name or a callable; got {metric!r}.")


def _auto_accuracy(y_true, y_pred):
  """Accuracy chosen from shapes, for losses given as callables."""
  y_true = jnp.asarray(y_true)
  if y_pred.ndim == y_true.ndim + 1 or (
      y_pred.ndim == y_true.ndim and y_true.shape[-1:] == (1,) and y_pred.shape[-1] > 1):
    return sparse_categorical_accuracy(y_true, y_pred)
  if y_pred.shape[-1:] != (1,) and y_pred.shape == y_true.shape:
    return categorical_accuracy(y_true, y_pred)
  return _binary_accuracy(0.0)(y_true, y_pred)
