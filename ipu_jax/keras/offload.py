"""Optimizer state in streaming memory, and its sharding over replicas.

Two ``IPUConfig.streaming`` options change how the Keras-like ``Model`` trains:

* ``offload_optimizer_state``: the training program is lowered with the
  optimizer state (the execution's ``opt_state`` argument and output) in streaming
  memory (``ipu_jax.jit(..., offload_argnums=1, offload_outputs=1)``, see
  ``ipu_jax/offload.py``): each leaf is streamed onto its tiles just before the
  weight update reads it and back right after, as TensorFlow-IPU's
  ``offload_weight_update_variables``.
* ``replicated_tensor_sharding`` (with R > 1 replicas): each replica holds one
  R-th of every optimizer-state leaf with an axis (the leaf flattened and
  zero-padded to a multiple of R; scalar leaves, such as step counts, are
  whole on every replica). The weight update becomes: reduce-scatter the
  gradients (each replica receives the reduced gradients of its shard),
  update that shard of the weights with that shard of the state, and
  all-gather the new weights (``ipu_jax.ops.cross_replica_reduce_scatter`` /
  ``cross_replica_all_gather``), in place of one all-reduce of the gradients
  (TensorFlow-IPU ``replicated_optimizer_state_sharding``, PopTorch
  ``useReplicatedTensorSharding``). A ring reduce-scatter and a ring
  all-gather each move (R - 1)/R of the bytes per replica over the
  IPU-Links, as the two halves of a ring all-reduce do, so the traffic is the
  same as unsharded training while the state, and the update's work, shrink
  R-fold. The shard's update is the optimizer's own update program run on
  shards (:class:`ipu_jax.sharded_optimizer.ShardedUpdate`): elementwise work
  on the shard, and every norm or other reduction over a whole weight (LAMB's
  trust ratio, global-norm clipping) reduced on the shard and then across the
  replicas by a small all-reduce, so the weights equal unsharded training's.
  An optimizer whose update mixes elements in other ways is refused with
  :class:`~ipu_jax.sharded_optimizer.ShardedOptimizerError` while the
  training program is traced, before anything runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import ops
from ipu_jax.keras.replication import REPLICA_AXIS, cross_replica_mean, cross_replica_sum
from ipu_jax.sharded_optimizer import (ShardedUpdate, gather_leaf, is_sharded_leaf,
                                       shard_length, shard_tree)

__all__ = ["offloads_state", "shards_state", "jit_options", "init_optimizer_state",
           "sharded_update"]


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


def init_optimizer_state(optimizer, params, config, replication):
  """The optimizer state ``compile`` starts from.

  Sharded: stacked along a leading axis of this process's replicas, each
  row that replica's shards of the full state (scalar leaves whole).
  """
  if not shards_state(config, replication.num_replicas):
    return optimizer.init(params)
  program = ShardedUpdate(optimizer, params, replication.num_replicas)
  shards = [program.init(params, int(r)) for r in replication.replica_ids]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *shards)


# Placing the state on the replicas (sharded with replicated tensor sharding)
# is TrainState.place's: the optimizer state's field says where it lives.


def sharded_update(optimizer, grads, opt_state, params, replica, replicas: int,
                   reduction: str):
  """One weight update with replicated tensor sharding (see the module docstring).

  Args:
    optimizer: the optax transformation.
    grads: this replica's (micro-batch) gradients, full size.
    opt_state: this replica's shard of the optimizer state.
    params: the full weights (equal on every replica).
    replica: this replica's index (traced int32 scalar).
    replicas: R.
    reduction: ``"sum"`` or ``"mean"`` over replicas.

  Returns:
    ``(new params, new opt_state shard)``.

  Raises:
    ShardedOptimizerError: the optimizer's update cannot run on shards.
  """
  def scatter(g):
    if not is_sharded_leaf(g):  # a scalar weight: all-reduced, updated whole
      return (cross_replica_mean(g) if reduction == "mean" else cross_replica_sum(g))
    n = shard_length(np.size(g), replicas)
    flat = jnp.pad(jnp.reshape(g, (-1,)), (0, n * replicas - np.size(g)))
    shard = ops.cross_replica_reduce_scatter(flat, replicas, REPLICA_AXIS)
    return shard / replicas if reduction == "mean" else shard

  program = ShardedUpdate(optimizer, params, replicas)
  grad_shards = jax.tree.map(scatter, grads)
  new_shards, opt_state = program(grad_shards, opt_state,
                                  shard_tree(params, replica, replicas), replica)

  def gather(shard, like):
    if not is_sharded_leaf(like):
      return shard
    return gather_leaf(ops.cross_replica_all_gather(shard, replicas, REPLICA_AXIS), like)

  return jax.tree.map(gather, new_shards, params), opt_state
