"""Splitting an unsplit model's weights into tensor-parallel shards, and the
checks that a tensor-parallel size divides what it splits."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np

__all__ = ["check_tensor_parallel", "check_tp_size", "divisors", "shard_columns", "shard_rows", "shard_vocab"]


def divisors(n: int) -> list:
  """The positive divisors of ``n``, ascending."""
  n = int(n)
  return [d for d in range(1, n + 1) if n % d == 0]


def check_tp_size(tp, field: str) -> int:
  """``tp`` as an int, or ``ValueError`` naming ``field`` unless a positive integer."""
  if isinstance(tp, bool) or not isinstance(tp, numbers.Integral) or tp < 1:
    raise ValueError(f"{field} must be a positive integer (IPUs a layer is split over), "
                     f"got {tp!r}.")
  return int(tp)


def check_tensor_parallel(tp, heads=None, hidden=None, vocab=None,
                          field: str = "tensor_parallel", **sizes) -> int:
  """Checks that ``tp`` splits every given size evenly, before anything runs.

  Args:
    tp: the tensor-parallel size (IPUs each layer is split over).
    heads: attention heads (split across the group).
    hidden: the hidden size (the MLP's and the projections' split dimension).
    vocab: the vocabulary (the embedding's and the head's split dimension).
    field: the name of the setting ``tp`` came from, for the message.
    **sizes: more named sizes to check (``ffn=...``).

  Returns:
    ``tp`` as an int.

  Raises:
    ValueError: naming ``field``, the size it does not divide and the valid
      values (the common divisors of every given size).
  """
  tp = check_tp_size(tp, field)
  named = {"heads": heads, "hidden": hidden, "vocab": vocab, **sizes}
  named = {k: int(v) for k, v in named.items() if v is not None}
  bad = {k: v for k, v in named.items() if v % tp}
  if bad:
    common = None
    for v in named.values():
      common = set(divisors(v)) if common is None else common & set(divisors(v))
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise ValueError(
        f"{field}={tp} does not divide {what}: tensor parallelism splits them evenly over "
        f"the group. Valid values of {field} for "
        f"{', '.join(f'{k}={v}' for k, v in named.items())}: {sorted(common)}.")
  return tp


def _split(w, tp: int, axis: int, what: str):
  w = jnp.asarray(w)
  tp = check_tp_size(tp, "tp")
  if w.ndim == 0:
    raise ValueError(f"{what} needs an array with at least one axis, got a scalar.")
  axis = axis % w.ndim
  size = w.shape[axis]
  if size % tp:
    raise ValueError(f"{what}: axis {axis} of shape {tuple(w.shape)} has {size} entries, not "
                     f"a multiple of tp={tp}; valid tp values: {divisors(size)}.")
  parts = jnp.split(w, tp, axis=axis)
  return jnp.stack(parts)


def shard_columns(w, tp: int):
  """A column-parallel weight's shards: the last axis split in ``tp`` blocks.

  ``[..., in, out] -> [tp, ..., in, out / tp]`` (also a bias ``[out]``);
  shard ``i`` holds output features ``i * out / tp ...`` (for attention
  projections: heads ``i * heads / tp ...``).
  """
  return _split(w, tp, -1, "shard_columns")


def shard_rows(w, tp: int):
  """A row-parallel weight's shards: ``[in, out] -> [tp, in / tp, out]``."""
  w = jnp.asarray(w)
  if w.ndim < 2:
    raise ValueError(f"shard_rows needs a [in, out] kernel, got shape {tuple(w.shape)}.")
  return _split(w, tp, -2, "shard_rows")


def shard_vocab(table, tp: int):
  """A vocabulary-parallel embedding's shards: ``[vocab, features] -> [tp, vocab / tp, features]``."""
  return _split(table, tp, 0, "shard_vocab")


def unshard(shards, axis: int):
  """The inverse of the helpers above: ``[tp, ...]`` shards joined along ``axis``."""
  shards = np.asarray(shards)
  return np.concatenate(list(shards), axis=axis)
