"""Loss functions for :class:`ipu_jax.keras.Model`, by name or as callables.

Every loss here returns the loss of each sample (shape ``[batch]``); the model
averages it over the micro-batch for the gradient, as Keras does. Flax
modules usually end in a linear layer, so the named losses take **logits**
(``from_logits=True``); build the class with ``from_logits=False`` for a
model whose output is already a probability.

Names accepted by ``Model.compile(loss=...)``:

* ``"sparse_categorical_crossentropy"`` -- integer labels ``[b]``, logits ``[b, C]``.
* ``"categorical_crossentropy"`` -- one-hot (or soft) labels ``[b, C]``.
* ``"binary_crossentropy"`` -- labels in {0, 1}, one logit per label.
* ``"mse"`` / ``"mean_squared_error"``, ``"mae"`` / ``"mean_absolute_error"``.

A callable ``loss(y_true, y_pred)`` may return per-sample losses ``[b]`` (best:
padded samples of the last evaluation batch are then masked exactly) or one
scalar for the batch.
"""

from __future__ import annotations

import difflib
from typing import Callable, Union

import jax
import jax.numpy as jnp

__all__ = [
    "Loss", "SparseCategoricalCrossentropy", "CategoricalCrossentropy",
    "BinaryCrossentropy", "MeanSquaredError", "MeanAbsoluteError", "get",
    "LOSSES",
]


def _per_sample_mean(values: jax.Array) -> jax.Array:
  """Mean over every axis but the first: one value per sample."""
  if values.ndim <= 1:
    return values
  return jnp.mean(values.reshape(values.shape[0], -1), axis=1)


class Loss:
  """Base class: ``loss(y_true, y_pred)`` gives per-sample losses ``[b]``."""

  name = "loss"
  # The "accuracy" metric this loss implies (Keras picks it the same way).
  accuracy = "accuracy"

  def __call__(self, y_true, y_pred) -> jax.Array:
    raise NotImplementedError(f"{type(self).__name__} must define __call__(y_true, y_pred)")

  def __repr__(self):
    return f"{type(self).__name__}()"


class _PredictionLoss(Loss):
  """A loss of predictions given as logits (``from_logits=True``, the
  default) or as probabilities."""

  def __init__(self, from_logits: bool = True):
    self.from_logits = from_logits

  def _log_probs(self, y_pred):
    """Log-probabilities over the last axis (probabilities clipped away from 0)."""
    if self.from_logits:
      return jax.nn.log_softmax(y_pred, axis=-1)
    return jnp.log(jnp.clip(y_pred, 1e-7, 1.0))

  def __repr__(self):
    return f"{type(self).__name__}(from_logits={self.from_logits})"


class SparseCategoricalCrossentropy(_PredictionLoss):
  """Cross-entropy against integer class labels."""

  name = "sparse_categorical_crossentropy"
  accuracy = "sparse_categorical_accuracy"

  def __call__(self, y_true, y_pred):
    labels = jnp.asarray(y_true).astype(jnp.int32)
    if labels.ndim == y_pred.ndim:  # labels given as [b, 1]
      labels = labels[..., 0]
    log_probs = self._log_probs(y_pred)
    one_hot = jax.nn.one_hot(labels, y_pred.shape[-1], dtype=log_probs.dtype)
    return _per_sample_mean(-jnp.sum(one_hot * log_probs, axis=-1))


class CategoricalCrossentropy(_PredictionLoss):
  """Cross-entropy against one-hot (or soft) labels."""

  name = "categorical_crossentropy"
  accuracy = "categorical_accuracy"

  def __call__(self, y_true, y_pred):
    log_probs = self._log_probs(y_pred)
    return _per_sample_mean(-jnp.sum(y_true.astype(log_probs.dtype) * log_probs, axis=-1))


class BinaryCrossentropy(_PredictionLoss):
  """Binary cross-entropy, one logit (or probability) per label."""

  name = "binary_crossentropy"
  accuracy = "binary_accuracy"

  def __call__(self, y_true, y_pred):
    y_true = jnp.reshape(y_true, y_pred.shape).astype(y_pred.dtype)
    if self.from_logits:
      # log(1 + exp(-|x|)) form, stable for large logits.
      losses = (jnp.maximum(y_pred, 0) - y_pred * y_true
                + jnp.log1p(jnp.exp(-jnp.abs(y_pred))))
    else:
      p = jnp.clip(y_pred, 1e-7, 1 - 1e-7)
      losses = -(y_true * jnp.log(p) + (1 - y_true) * jnp.log(1 - p))
    return _per_sample_mean(losses)


class _RegressionLoss(Loss):
  """The per-sample mean of ``_penalty(y_pred - y_true)``, labels reshaped
  to the predictions' shape; subclasses set ``_penalty``."""

  _penalty: Callable

  def __call__(self, y_true, y_pred):
    y_true = jnp.reshape(y_true, y_pred.shape).astype(y_pred.dtype)
    return _per_sample_mean(self._penalty(y_pred - y_true))


class MeanSquaredError(_RegressionLoss):
  name = "mean_squared_error"
  accuracy = "mse"
  _penalty = staticmethod(jnp.square)


class MeanAbsoluteError(_RegressionLoss):
  name = "mean_absolute_error"
  accuracy = "mae"
  _penalty = staticmethod(jnp.abs)


LOSSES = {
    "sparse_categorical_crossentropy": SparseCategoricalCrossentropy,
    "categorical_crossentropy": CategoricalCrossentropy,
    "binary_crossentropy": BinaryCrossentropy,
    "mse": MeanSquaredError,
    "mean_squared_error": MeanSquaredError,
    "mae": MeanAbsoluteError,
    "mean_absolute_error": MeanAbsoluteError,
}


class _CallableLoss(Loss):
  """Wraps a user's ``loss(y_true, y_pred)``."""

  accuracy = None  # decided from the shapes of labels and predictions

  def __init__(self, fn: Callable):
    self.fn = fn
    self.name = getattr(fn, "__name__", "loss")

  def __call__(self, y_true, y_pred):
    return self.fn(y_true, y_pred)

  def __repr__(self):
    return f"loss({self.name})"


def get(loss: Union[str, Callable, Loss]) -> Loss:
  """The :class:`Loss` for a name, a :class:`Loss` or a callable.

  Raises:
    ValueError: an unknown name (with the closest known names).
    TypeError: neither a string nor a callable.
  """
  if isinstance(loss, Loss):
    return loss
  if isinstance(loss, str):
    key = loss.lower()
    if key not in LOSSES:
      close = difflib.get_close_matches(key, list(LOSSES), n=2)
      hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
      raise ValueError(f"Unknown loss {loss!r}.{hint} Known losses: "
                       f"{', '.join(sorted(LOSSES))}; or pass a callable "
                       "loss(y_true, y_pred).")
    return LOSSES[key]()
  if callable(loss):
    return _CallableLoss(loss)
  raise TypeError(f"loss must be a name or a callable loss(y_true, y_pred); "
                  f"got {loss!r} of type {type(loss).__name__}.")
