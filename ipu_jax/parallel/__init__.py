"""Tensor parallelism (Megatron-style) and replica groups on emulated IPUs.

A layer's weights split over a group of ``tp`` IPUs, with data-parallel
replicas of the whole group: one program lowered for one shard, run on every
point of a :class:`Mesh` (:func:`spmd`), its all-reduces priced over the
IPU-Links of the replica groups (PopXL's ``replica_grouping``); with
sequence parallelism (:mod:`ipu_jax.parallel.sequence`) the regions between
the split matmuls hold ``1/tp`` of the sequence.
docs/tensor_parallel.md.
"""

from ipu_jax.parallel.groups import DP_AXIS, TP_AXIS, ReplicaGrouping, axis_groups
from ipu_jax.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ipu_jax.parallel.mesh import Mesh
from ipu_jax.parallel.ops import (column_linear, copy_to_group, reduce_from_group, row_linear,
                                  vocab_cross_entropy, vocab_embedding)
from ipu_jax.parallel.sequence import gather_sequence, scatter_sequence, sequence_shard_start
from ipu_jax.parallel.shards import (check_tensor_parallel, divisors, shard_columns, shard_rows,
                                     shard_vocab)
from ipu_jax.parallel.spmd import SPMDFunction, spmd

__all__ = ["DP_AXIS", "TP_AXIS", "ReplicaGrouping", "axis_groups", "Mesh", "spmd", "SPMDFunction",
           "column_linear", "row_linear", "vocab_embedding", "vocab_cross_entropy",
           "copy_to_group", "reduce_from_group", "shard_columns", "shard_rows", "shard_vocab",
           "check_tensor_parallel", "divisors", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "gather_sequence", "scatter_sequence",
           "sequence_shard_start"]
