"""IPU custom primitives: what Poplar and TessellateIPU offer beyond ``lax``.

Each op is a ``jax.extend.core.Primitive`` defined the way ``jax/_src/lax``
defines its own: an impl (the reference semantics, plain JAX), an abstract
eval, a JVP, a transpose where the op is linear, a batching rule and an MLIR
lowering (``mlir.lower_fun`` of the impl), so a function that uses them runs
under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` without the emulator. Each
op's tile rule (how it runs on tiles and what it costs) sits in the op's own
module, below its primitive, as ``jax/_src/lax/lax.py`` keeps a primitive and
its rules together; the rules build on the lowering's public helpers (the
collectives' ring costs are ``ipu_jax.lowering.rules.parallel``'s).

* :func:`tile_map`: run a codelet once per tile on chosen tiles (TessellateIPU's
  ``tile_map``).
* :func:`cross_replica_sum`, :func:`cross_replica_mean`, :func:`replica_index`:
  the data-parallel collectives (``lax.psum`` / ``pmean`` / ``axis_index`` over
  the replica axis when it is bound, else a single replica).
* :func:`cross_replica_reduce_scatter`, :func:`cross_replica_all_gather`: the
  two halves of an all-reduce, for replicated tensor sharding.
* :func:`matmul`: ``jnp.matmul`` with poplin's per-op planning options.
* :func:`serialized_matmul`: a product done as ``factor`` smaller ones in
  sequence (TF-IPU's ``serialized_matmul``, PopTorch's ``serializedMatMul``);
  :func:`embedding_lookup` with TF-IPU's ``serialization_factor``.
* :func:`stochastic_round`: fp32 -> fp16/bf16 rounding the way the IPU's
  stochastic rounding mode does it (unbiased).
* :func:`softmax`: ``jax.nn.softmax``'s values, lowered and priced as popnn's
  softmax (max, exp, sum, the sums' reciprocal, a multiply; its gradient as
  ``softmaxInputGradientImpl``).
* :func:`gelu`: ``jax.nn.gelu(x, approximate=True)``'s values, lowered and
  priced as popnn's GELU vertex (its gradient as ``NonLinearityGrad1D``).
* :func:`print_tensor`: Poplar's ``PrintTensor`` as an identity op.
* :func:`cast_to_fp8`, :func:`cast_from_fp8`, :func:`fp8_matmul`: the FP8
  formats F143/F152 with power-of-two scales (``ops/fp8.py``).
* :func:`pipeline_stage`, :func:`recomputation_checkpoint`: pipeline stage
  boundaries and values kept when stages are recomputed (see
  :mod:`ipu_jax.pipelining`).
"""

import os as _os

# Equations made by these ops report the user's line, not this package's
# (as for jax's own wrappers), in reports and lowering errors.
from ipu_jax.lowering.jax_compat import source_info_util as _source_info_util
_source_info_util.register_exclusion(_os.path.dirname(__file__))

from ipu_jax.ops.collectives import (REPLICA_AXIS, cross_replica_mean, cross_replica_mean_p,
                                     cross_replica_sum, cross_replica_sum_p, replica_index,
                                     replica_index_p)
from ipu_jax.ops.gelu import gelu, gelu_grad_p, gelu_p
from ipu_jax.ops.fp8 import cast_from_fp8, cast_to_fp8, fp8_matmul
from ipu_jax.ops.matmul import matmul, matmul_p
from ipu_jax.ops.serialized_matmul import serialized_matmul, serialized_matmul_p
from ipu_jax.ops.embedding import embedding_lookup
from ipu_jax.ops.sharded_collectives import (cross_replica_all_gather,
                                             cross_replica_all_gather_p,
                                             cross_replica_reduce_scatter,
                                             cross_replica_reduce_scatter_p)
from ipu_jax.ops.pipeline_stage import (RECOMPUTATION_CHECKPOINT, pipeline_stage,
                                        pipeline_stage_p, recomputation_checkpoint)
from ipu_jax.ops.print_tensor import format_tensor, print_tensor, print_tensor_p
from ipu_jax.ops.softmax import softmax, softmax_grad_p, softmax_p
from ipu_jax.ops.stochastic_round import stochastic_round, stochastic_round_p
from ipu_jax.ops.tile_map import tile_map, tile_map_p

__all__ = [
    "tile_map", "cross_replica_sum", "cross_replica_mean", "replica_index",
    "matmul", "stochastic_round", "print_tensor", "format_tensor",
    "tile_map_p", "cross_replica_sum_p", "cross_replica_mean_p",
    "replica_index_p", "matmul_p", "stochastic_round_p", "print_tensor_p",
    "REPLICA_AXIS", "cast_to_fp8", "cast_from_fp8", "fp8_matmul",
    "cross_replica_reduce_scatter", "cross_replica_all_gather",
    "cross_replica_reduce_scatter_p", "cross_replica_all_gather_p",
    "pipeline_stage", "pipeline_stage_p", "recomputation_checkpoint",
    "RECOMPUTATION_CHECKPOINT", "serialized_matmul", "serialized_matmul_p", "embedding_lookup",
    "softmax", "softmax_p", "softmax_grad_p", "gelu", "gelu_p", "gelu_grad_p",
]
