"""Megatron-style tensor-parallel operations, used inside a function run by
:func:`ipu_jax.parallel.spmd` (under the bound ``"tp"`` axis).

The conjugate pair of Shoeybi et al. (2019), "Megatron-LM", section 3:

* ``f`` (:func:`copy_to_group`): identity forward, all-reduce of the
  gradient backward; it enters a column-parallel block;
* ``g`` (:func:`reduce_from_group`): all-reduce forward, identity backward;
  it leaves a row-parallel block.

Each is a ``jax.custom_vjp``, so a column-then-row pair costs exactly one
all-reduce forward and one backward (JAX's own transpose of ``psum`` would
all-reduce again in the backward). The all-reduces are ``lax.psum`` over the
axis, lowered as IPU-Link ring all-reduces over the tensor-parallel replica
groups (docs/tensor_parallel.md#where-the-all-reduces-are).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ipu_jax.parallel.groups import TP_AXIS
from ipu_jax.parallel.sequence import gather_sequence, scatter_sequence

__all__ = ["copy_to_group", "reduce_from_group", "column_linear", "row_linear",
           "vocab_embedding", "vocab_cross_entropy"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def copy_to_group(x, axis_name=TP_AXIS):
  """Megatron's ``f``: ``x`` forward; the gradient all-reduced over the group."""
  return x


def _copy_fwd(x, axis_name):
  return x, None


def _copy_bwd(axis_name, _, g):
  return (lax.psum(g, axis_name),)


copy_to_group.defvjp(_copy_fwd, _copy_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def reduce_from_group(x, axis_name=TP_AXIS):
  """Megatron's ``g``: the sum over the group forward; the gradient as is."""
  return lax.psum(x, axis_name)


def _reduce_fwd(x, axis_name):
  return lax.psum(x, axis_name), None


def _reduce_bwd(axis_name, _, g):
  return (g,)


reduce_from_group.defvjp(_reduce_fwd, _reduce_bwd)


def column_linear(x, kernel_shard, bias_shard=None, axis_name=TP_AXIS,
                  sequence_parallel: bool = False, gathered: bool = False, seq_axis: int = 1):
  """``x @ W[:, shard] (+ b[shard])``: this shard's output features.

  ``x`` is the same on every shard; its gradient is all-reduced over the
  group (``f``). The result stays split (feed it to :func:`row_linear`, or
  to per-head attention). ``sequence_parallel=True``: ``x`` is this shard's
  block of the sequence (``seq_axis``), all-gathered first; its gradient is
  reduce-scattered back (:func:`~ipu_jax.parallel.gather_sequence` in place
  of ``f``). ``gathered=True``: ``x`` already came from ``gather_sequence``
  (one gather shared by several column-parallel linears), so neither applies.
  """
  if not gathered:
    x = (gather_sequence(x, axis_name, seq_axis) if sequence_parallel
         else copy_to_group(x, axis_name))
  y = x @ kernel_shard
  return y if bias_shard is None else y + bias_shard


def row_linear(x_local, kernel_shard, bias=None, axis_name=TP_AXIS,
               sequence_parallel: bool = False, seq_axis: int = 1):
  """``psum(x_local @ W[shard, :]) (+ b)``: the full output on every shard.

  ``x_local`` holds this shard's input features (a column-parallel output);
  the partial products are all-reduced (``g``); the unsplit ``bias`` is added
  once, after the sum. ``sequence_parallel=True``: the partial products are
  reduce-scattered along ``seq_axis`` instead (this shard's block of the
  sequence of the sum), and the bias's gradient, partial per block, is
  summed over the group (``copy_to_group``).
  """
  y = x_local @ kernel_shard
  if not sequence_parallel:
    y = reduce_from_group(y, axis_name)
    return y if bias is None else y + bias
  y = scatter_sequence(y, axis_name, seq_axis)
  return y if bias is None else y + copy_to_group(bias, axis_name)


def _shard_offset(rows: int, axis_name):
  return lax.axis_index(axis_name) * rows


def vocab_embedding(ids, table_shard, axis_name=TP_AXIS, sequence_parallel: bool = False,
                    seq_axis: int = 1):
  """Rows of a vocabulary-sharded embedding table, summed over the group.

  Shard ``i`` holds rows ``i * V / tp ...``; ids outside them read zeros, and
  the all-reduce (``g``) gives every shard the full embedding
  (``sequence_parallel=True``: a reduce-scatter along ``seq_axis``, this
  shard's block of the sequence).
  """
  rows = table_shard.shape[0]
  local = ids - _shard_offset(rows, axis_name)
  inside = (local >= 0) & (local < rows)
  picked = jnp.take(table_shard, jnp.where(inside, local, 0), axis=0)
  picked = jnp.where(inside[..., None], picked, jnp.zeros((), picked.dtype))
  if sequence_parallel:
    return scatter_sequence(picked, axis_name, seq_axis)
  return reduce_from_group(picked, axis_name)


def vocab_cross_entropy(logits_shard, labels, axis_name=TP_AXIS):
  """Mean softmax cross-entropy of logits split along the vocabulary.

  Shard ``i`` holds logits ``i * V / tp ...`` (a column-parallel head). As in
  Megatron-LM's vocab-parallel cross-entropy: the maximum and the sum of
  exponentials are all-reduced across shards (max, then sum), and the
  label's logit comes from the shard that holds it (an all-reduce of zeros
  elsewhere); the gradient of each shard's logits is its own softmax share
  minus the label's one-hot.
  """
  logits_shard = logits_shard.astype(jnp.float32)
  width = logits_shard.shape[-1]
  # The maximum only steadies the exponentials: no gradient through it.
  local_max = jnp.max(lax.stop_gradient(logits_shard), axis=-1)
  top = lax.pmax(local_max, axis_name)
  shifted = logits_shard - top[..., None]
  sum_exp = reduce_from_group(jnp.sum(jnp.exp(shifted), axis=-1), axis_name)
  local = labels - _shard_offset(width, axis_name)
  inside = (local >= 0) & (local < width)
  picked = jnp.take_along_axis(shifted, jnp.where(inside, local, 0)[..., None], axis=-1)[..., 0]
  label_logit = reduce_from_group(jnp.where(inside, picked, 0.0), axis_name)
  return jnp.mean(jnp.log(sum_exp) - label_logit)
