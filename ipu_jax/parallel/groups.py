"""The axis names of tensor and data parallelism, and replica groupings.

A model replica of ``tp`` tensor-parallel shards occupies ``tp`` consecutive
replicas (IPUs); ``dp`` such replicas run data-parallel. Global replica
``r = dp_index * tp + tp_index``, so the tensor-parallel group is PopXL's
``replica_grouping(group_size=tp, stride=1)`` and the data-parallel group
``replica_grouping(group_size=dp, stride=tp)`` (docs/tensor_parallel.md#replica-groups).
"""

from __future__ import annotations

from ipu_jax.kernels.collectives import ReplicaGrouping, axis_groups
from ipu_jax.lowering.replica_axis import REPLICA_AXIS

__all__ = ["DP_AXIS", "TP_AXIS", "ReplicaGrouping", "axis_groups"]

# Data-parallel replicas: the training layer's replica axis (one meaning).
DP_AXIS = REPLICA_AXIS
# Tensor-parallel shards of one model replica.
TP_AXIS = "tp"
