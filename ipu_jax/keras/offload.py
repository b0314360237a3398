"""Optimizer state in streaming memory, and its sharding over replicas.

Two ``IPUConfig.streaming`` options change how the Keras-like ``Model`` trains:

* ``offload_optimizer_state``: the training program is lowered with the
  optimizer state (the execution's ``opt_state`` argument and output) in streaming
  memory (``ipu_jax.jit(..., offload_argnums=1, offload_outputs=1)``, see
  ``ipu_jax/offload.py``): each leaf is streamed onto its tiles just before the
  weight update reads it and back right after, as TensorFlow-IPU's
  ``offload_weight_update_variables``.
* ``replicated_tensor_sharding`` (with R > 1 replicas): each replica holds one
  R-th of every optimizer-state leaf (the leaf flattened and zero-padded to a
  multiple of R). The weight update becomes: reduce-scatter the gradients
  (each replica receives the reduced gradients of its
  shard), update that shard of the weights with that shard of the state, and
  all-gather the new weights (``ipu_jax.ops.cross_replica_reduce_scatter`` /
  ``cross_replica_all_gather``), in place of one all-reduce
  of the gradients (TensorFlow-IPU ``replicated_optimizer_state_sharding``,
  PopTorch ``useReplicatedTensorSharding``). A ring reduce-scatter and a ring
  all-gather each move (R - 1)/R of the bytes per replica over the IPU-Links,
  as the two halves of a ring all-reduce do, so the traffic is the same as
  unsharded training while the state, and the update's work, shrink R-fold.
  The optimizer must act elementwise (SGD, momentum, Adam, LAMB's moments
  are; a global-norm clip is not): the shards are updated independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ipu_jax import ops
from ipu_jax.keras import scopes
from ipu_jax.keras.replication import REPLICA_AXIS

__all__ = ["offloads_state", "shards_state", "jit_options", "shard_length",
           "shard_params", "init_optimizer_state", "sharded_update"]


def offloads_state(config) -> bool:
  return bool(config.streaming.offload_optimizer_state)


def shards_state(config, num_replicas: int) -> bool:
  """Whether replicated tensor sharding is on (it needs more than one replica)."""
  return bool(config.streaming.replicated_tensor_sharding) and num_replicas > 1


def jit_options(config, argnum: int, output: int) -> dict:
  """``ipu_jax.jit`` arguments of the training execution.

  Args:
    config: the ``IPUConfig``.
    argnum: the position of the optimizer state among the execution's
      arguments; ``output``: among its outputs (both taken from the
      :class:`~ipu_jax.keras.train_state.TrainState` fields by name).
  """
  if not offloads_state(config):
    return {}
  return {"offload_argnums": (argnum,), "offload_outputs": (output,)}


def shard_length(size: int, replicas: int) -> int:
  """Elements of one replica's shard of a leaf of ``size`` elements."""
  return -(-int(size) // replicas)


def _flat_padded(x, replicas: int):
  flat = jnp.reshape(x, (-1,))
  return jnp.pad(flat, (0, shard_length(flat.size, replicas) * replicas - flat.size))


def shard_params(params, replica, replicas: int):
  """Replica ``replica``'s shard of every leaf (traceable in ``replica``)."""
  def one(x):
    n = shard_length(np.size(x), replicas)
    return jax.lax.dynamic_slice_in_dim(_flat_padded(x, replicas), replica * n, n)
  return jax.tree.map(one, params)


def init_optimizer_state(optimizer, params, config, replication):
  """The optimizer state ``compile`` starts from.

  Sharded: stacked along a leading axis of this process's replicas, each
  row the state of that replica's shard.
  """
  if not shards_state(config, replication.num_replicas):
    return optimizer.init(params)
  R = replication.num_replicas
  shards = [optimizer.init(shard_params(params, int(r), R)) for r in replication.replica_ids]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *shards)


# Placing the state on the replicas (sharded with replicated tensor sharding)
# is TrainState.place's: the optimizer state's field says where it lives.


def sharded_update(optimizer, grads, opt_state, params, replica, replicas: int,
                   reduction: str):
  """One weight update with replicated tensor sharding (see the module docstring).

  Args:
    optimizer: the optax transformation (elementwise).
    grads: this replica's (micro-batch) gradients, full size.
    opt_state: this replica's shard of the optimizer state.
    params: the full weights (equal on every replica).
    replica: this replica's index (traced int32 scalar).
    replicas: R.
    reduction: ``"sum"`` or ``"mean"`` over replicas.

  Returns:
    ``(new params, new opt_state shard)``.
  """
  def scatter(g):
    shard = ops.cross_replica_reduce_scatter(_flat_padded(g, replicas), replicas, REPLICA_AXIS)
    return shard / replicas if reduction == "mean" else shard

  grad_shards = jax.tree.map(scatter, grads)
  param_shards = shard_params(params, replica, replicas)
  updates, opt_state = optimizer.update(grad_shards, opt_state, param_shards)
  with scopes.scope(scopes.APPLY_UPDATES):
    new_shards = optax.apply_updates(param_shards, updates)

  def gather(shard, like):
    full = ops.cross_replica_all_gather(shard, replicas, REPLICA_AXIS)
    return jnp.reshape(full[:np.size(like)], np.shape(like)).astype(like.dtype)

  return jax.tree.map(gather, new_shards, params), opt_state
