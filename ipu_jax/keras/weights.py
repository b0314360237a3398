"""Weights on disk: flat dicts of NumPy arrays, written atomically.

``Model.save_weights`` and the checkpoint callback write through
:func:`atomic_write` (a temporary file, then ``os.replace``), so a run killed
at any moment leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["optimizer_entry", "restore_optimizer", "atomic_write", "flat_saveable", "is_key", "restore_flat", "restore_nested",
           "to_saveable", "write_weights_file", "read_weights_file"]

_FORMAT = "ipu-jax-keras-weights"
_FORMAT_VERSION = 1


def is_key(x) -> bool:
  """Whether ``x`` is a typed JAX PRNG key array."""
  return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _umask() -> int:
  # The only portable way to read the umask is to set it and put it back.
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def atomic_write(path: str, data: bytes) -> None:
  """Writes ``data`` to ``path`` via a temporary file and ``os.replace``.

  The file gets the mode ``open()`` would give it (0666 less the umask), not
  the private 0600 of the temporary file.
  """
  path = os.fspath(path)
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=directory)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fchmod(f.fileno(), 0o666 & ~_umask())
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def to_saveable(tree):
  if isinstance(tree, dict):
    return {str(k): to_saveable(v) for k, v in tree.items()}
  if is_key(tree):
    return np.asarray(jax.random.key_data(tree))
  return np.asarray(tree)


def restore_nested(template, saved, where="weights"):
  if isinstance(template, dict):
    if not isinstance(saved, dict):
      raise ValueError(f"checkpoint {where}: expected a dict, found {type(saved).__name__}.")
    missing = [str(k) for k in template if str(k) not in saved]
    if missing:
      raise ValueError(f"checkpoint {where} lacks {missing}; it was saved from a "
                       "different model.")
    return {k: restore_nested(v, saved[str(k)], f"{where}/{k}") for k, v in template.items()}
  value = np.asarray(saved)
  if is_key(template):
    return jax.random.wrap_key_data(jnp.asarray(value), impl=jax.random.key_impl(template))
  if tuple(value.shape) != tuple(np.shape(template)):
    raise ValueError(f"checkpoint {where} has shape {value.shape}; the model's is "
                     f"{np.shape(template)}.")
  return jnp.asarray(value, dtype=template.dtype)


def flat_saveable(tree) -> dict:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {jax.tree_util.keystr(path): to_saveable(leaf) for path, leaf in leaves}


def restore_flat(template, saved: dict, where: str):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  values = []
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path)
    if key not in saved:
      raise ValueError(f"checkpoint {where} lacks {key}; it was saved with a different "
                       "optimizer or model.")
    values.append(restore_nested(leaf, saved[key], f"{where}{key}"))
  return jax.tree_util.tree_unflatten(treedef, values)


def write_weights_file(path: str, weights: dict, *, epoch=None, extra=None) -> str:
  """Writes ``weights`` (plus ``extra`` entries) as a Flax msgpack weights file.

  Only process 0 writes in a multi-process run; the write is atomic.
  """
  import flax.serialization
  payload = {"format": _FORMAT, "version": _FORMAT_VERSION,
             "epoch": -1 if epoch is None else int(epoch), **weights, **(extra or {})}
  data = flax.serialization.msgpack_serialize(payload)
  if jax.process_index() == 0:
    atomic_write(path, data)
  return path


def read_weights_file(path: str) -> dict:
  """The payload of a file :func:`write_weights_file` wrote, format checked.

  Raises:
    ValueError: not a weights file, or one of a newer format version.
  """
  import flax.serialization
  with open(path, "rb") as f:
    payload = flax.serialization.msgpack_restore(f.read())
  if payload.get("format") != _FORMAT:
    raise ValueError(f"{path} is not an ipu_jax.keras weights file.")
  if int(payload.get("version", 0)) > _FORMAT_VERSION:
    raise ValueError(f"{path} has format version {payload['version']}; this "
                     f"ipu-jax reads up to {_FORMAT_VERSION}.")
  return payload


# The optimizer entry of a checkpoint: a whole-model state (plain fit's) under
# "opt_state", a pipelined fit's stage states under "pipeline_opt_state" (they
# are laid out only once a pipelined fit has split the model), and the step.
MODEL_OPTIMIZER_KEY = "opt_state"
STAGE_OPTIMIZERS_KEY = "pipeline_opt_state"


def optimizer_entry(opt_state, stages: bool, step: int) -> dict:
  """The checkpoint's ``optimizer`` entry (``stages``: a pipelined fit's states)."""
  key = STAGE_OPTIMIZERS_KEY if stages else MODEL_OPTIMIZER_KEY
  return {key: flat_saveable(opt_state), "step": np.asarray(step, np.int64)}


def restore_optimizer(train_state, saved: dict, template: Callable[[], object]):
  """``train_state`` with a checkpoint's step and whole-model optimizer state.

  Args:
    train_state: the model's :class:`~ipu_jax.keras.train_state.TrainState`.
    saved: the checkpoint's ``optimizer`` entry (:func:`optimizer_entry`).
    template: the whole-model optimizer state to restore into (called only
      when ``saved`` holds one).

  Returns:
    ``(train_state, stage states)``: the stages' saved states (flat, by key
    path) for the next pipelined fit to restore once it has split the model,
    or ``None``.
  """
  from ipu_jax.keras.train_state import MODEL_OPTIMIZER
  if "step" in saved:
    train_state = train_state.replace(step=jnp.asarray(int(np.asarray(saved["step"])), jnp.int32))
  if MODEL_OPTIMIZER_KEY in saved:
    train_state = train_state.replace(
        opt_state=restore_flat(template(), saved[MODEL_OPTIMIZER_KEY], MODEL_OPTIMIZER_KEY),
        opt_layout=MODEL_OPTIMIZER)
  return train_state, saved.get(STAGE_OPTIMIZERS_KEY)
