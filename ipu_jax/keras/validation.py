"""Host-side checks of labels against the loss and the model's output.

On the IPU (and here) a sparse cross-entropy turns labels into one-hot rows
by comparison, and a label outside ``[0, classes)`` just gives a zero row: a
wrong label encoding trains without a word. ``fit`` and ``evaluate`` call
:func:`check_labels` on the host once, before the first step, with the shape
the model's output will have (from ``jax.eval_shape``, nothing runs);
``validate_inputs=False`` skips it.

The checks are vectorised over the whole label array (one min/max pass).
"""

from __future__ import annotations

import numpy as np

from ipu_jax.keras import losses as losses_lib

__all__ = ["check_labels"]


def _range_text(y) -> str:
  return f"values in [{y.min()}, {y.max()}]" if y.size else "no values"


def _check_sparse(y, pred_shape, loss_name):
  classes = pred_shape[-1]
  expected = tuple(pred_shape[1:-1])
  shape = tuple(y.shape[1:])
  if shape == expected + (1,):
    shape = expected
  if shape != expected:
    hint = ""
    if shape == tuple(pred_shape[1:]):
      hint = (" They look one-hot (one column per class): use "
              "loss='categorical_crossentropy', or pass labels.argmax(-1).")
    raise ValueError(
        f"{loss_name} expects integer class labels of shape [batch"
        f"{''.join(', ' + str(d) for d in expected)}] (the model's output "
        f"[batch{''.join(', ' + str(d) for d in pred_shape[1:])}] without its class axis); "
        f"got labels of shape {list(y.shape)}.{hint}")
  if y.size == 0:
    return
  if np.issubdtype(y.dtype, np.floating) and not np.all(np.equal(np.mod(y, 1), 0)):
    raise ValueError(f"{loss_name} expects integer class labels; got {y.dtype} labels "
                     f"with fractional values ({_range_text(y)}).")
  low, high = y.min(), y.max()
  if low < 0 or high >= classes:
    bad = np.count_nonzero((y < 0) | (y >= classes))
    raise ValueError(
        f"{loss_name} expects class labels in [0, {classes - 1}] (the model outputs "
        f"{classes} classes); got {_range_text(y)}, {bad} of {y.size} labels outside "
        "the range. Negative or too-large labels would train silently against a zero "
        "target; remap them (or mask such samples) first.")


def _check_dense(y, pred_shape, loss_name, one_hot: bool, reshaped: bool):
  # Losses that reshape the labels to the output need only as many values per sample.
  fits = (int(np.prod(y.shape[1:])) == int(np.prod(pred_shape[1:])) if reshaped
          else tuple(y.shape[1:]) == tuple(pred_shape[1:]))
  if not fits:
    hint = ""
    if not reshaped and tuple(y.shape[1:]) in (tuple(pred_shape[1:-1]), tuple(pred_shape[1:-1]) + (1,)):
      hint = " They look like class indices: use loss='sparse_categorical_crossentropy'."
    raise ValueError(
        f"{loss_name} expects labels shaped like the model's output "
        f"[batch{''.join(', ' + str(d) for d in pred_shape[1:])}]; got labels of shape "
        f"{list(y.shape)}.{hint}")
  if one_hot and y.size and (y.min() < 0 or y.max() > 1):
    raise ValueError(f"{loss_name} expects one-hot or probability labels in [0, 1]; "
                     f"got {_range_text(y)}.")


def check_labels(loss, y, pred_shape) -> None:
  """Refuses labels that do not fit ``loss`` and the model's output.

  Args:
    loss: the compiled :class:`~ipu_jax.keras.losses.Loss`.
    y: the labels, a host array with samples along axis 0.
    pred_shape: the model's output shape for a batch (only axes after the
      first are compared).

  Raises:
    ValueError: saying what was given and what the loss expects.
  """
  if y is None:
    return
  y = np.asarray(y)
  if isinstance(loss, losses_lib.SparseCategoricalCrossentropy):
    _check_sparse(y, pred_shape, loss.name)
  elif isinstance(loss, losses_lib.CategoricalCrossentropy):
    _check_dense(y, pred_shape, loss.name, one_hot=True, reshaped=False)
  elif isinstance(loss, losses_lib.BinaryCrossentropy):
    _check_dense(y, pred_shape, loss.name, one_hot=True, reshaped=True)
  elif isinstance(loss, (losses_lib.MeanSquaredError, losses_lib.MeanAbsoluteError)):
    _check_dense(y, pred_shape, loss.name, one_hot=False, reshaped=True)
  # A user's callable loss defines its own label format: nothing to check.
