"""Flax NNX modules holding ONE tensor-parallel shard of a layer.

Each module's parameters have the shapes of one shard; its ``__call__`` runs
the functional op of :mod:`ipu_jax.parallel.ops` under the bound ``"tp"``
axis (inside :func:`ipu_jax.parallel.spmd`). Build the stacked ``[tp, ...]``
parameters of every shard from an unsplit model with
:func:`~ipu_jax.parallel.shard_columns` / ``shard_rows`` / ``shard_vocab``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ipu_jax.parallel import ops
from ipu_jax.parallel.groups import TP_AXIS
from ipu_jax.parallel.shards import check_tp_size, divisors

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

_KERNEL_INIT = nnx.initializers.lecun_normal()


def _shard(size: int, tp: int, what: str) -> int:
  tp = check_tp_size(tp, "tp")
  if size % tp:
    raise ValueError(f"{what}={size} is not divisible by tp={tp}; valid tp values: "
                     f"{divisors(size)}.")
  return size // tp


class ColumnParallelLinear(nnx.Module):
  """``y[shard] = x @ W[:, shard] + b[shard]``: ``out_features / tp`` outputs.

  Attributes:
    kernel: ``[in_features, out_features / tp]``.
    bias: ``[out_features / tp]`` (``None`` without bias).
    sequence_parallel: the input is this shard's block of the sequence,
      all-gathered first (``ops.column_linear``).
  """

  def __init__(self, in_features: int, out_features: int, tp: int, *, use_bias: bool = True,
               dtype=jnp.float32, axis_name=TP_AXIS, sequence_parallel: bool = False,
               rngs: nnx.Rngs):
    shard = _shard(out_features, tp, "out_features")
    self.tp, self.axis_name = int(tp), axis_name
    self.sequence_parallel = bool(sequence_parallel)
    self.kernel = nnx.Param(_KERNEL_INIT(rngs.params(), (in_features, shard), dtype))
    self.bias = nnx.Param(jnp.zeros((shard,), dtype)) if use_bias else None

  def __call__(self, x, gathered: bool = False):
    """``gathered=True``: ``x`` already came from ``gather_sequence``."""
    bias = None if self.bias is None else self.bias[...]
    return ops.column_linear(x, self.kernel[...], bias, axis_name=self.axis_name,
                             sequence_parallel=self.sequence_parallel, gathered=gathered)


class RowParallelLinear(nnx.Module):
  """``y = psum(x[shard] @ W[shard, :]) + b``: the full output on every shard.

  Attributes:
    kernel: ``[in_features / tp, out_features]``.
    bias: ``[out_features]``, unsplit, added after the all-reduce.
    sequence_parallel: reduce-scatter the partial products along the
      sequence instead of all-reducing them (``ops.row_linear``).
  """

  def __init__(self, in_features: int, out_features: int, tp: int, *, use_bias: bool = True,
               dtype=jnp.float32, axis_name=TP_AXIS, sequence_parallel: bool = False,
               rngs: nnx.Rngs):
    shard = _shard(in_features, tp, "in_features")
    self.tp, self.axis_name = int(tp), axis_name
    self.sequence_parallel = bool(sequence_parallel)
    self.kernel = nnx.Param(_KERNEL_INIT(rngs.params(), (shard, out_features), dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None

  def __call__(self, x_local):
    bias = None if self.bias is None else self.bias[...]
    return ops.row_linear(x_local, self.kernel[...], bias, axis_name=self.axis_name,
                          sequence_parallel=self.sequence_parallel)


class VocabParallelEmbedding(nnx.Module):
  """An embedding whose vocabulary is split over the group.

  Attributes:
    embedding: ``[num_embeddings / tp, features]``: rows
      ``i * num_embeddings / tp ...`` on shard ``i``.
    sequence_parallel: the lookup returns this shard's block of the
      sequence (a reduce-scatter instead of the all-reduce).
  """

  def __init__(self, num_embeddings: int, features: int, tp: int, *, dtype=jnp.float32,
               axis_name=TP_AXIS, sequence_parallel: bool = False, rngs: nnx.Rngs):
    rows = _shard(num_embeddings, tp, "num_embeddings")
    self.tp, self.axis_name = int(tp), axis_name
    self.sequence_parallel = bool(sequence_parallel)
    init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    self.embedding = nnx.Param(init(rngs.params(), (rows, features), dtype))

  def __call__(self, ids):
    return ops.vocab_embedding(ids, self.embedding[...], axis_name=self.axis_name,
                               sequence_parallel=self.sequence_parallel)

  def attend(self, x):
    """Tied output logits of this shard's vocabulary: ``x @ E[shard].T``
    (the gradient of ``x`` all-reduced over the group)."""
    return ops.copy_to_group(x, self.axis_name) @ self.embedding[...].T
