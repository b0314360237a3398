"""``pipeline_stage`` and ``recomputation_checkpoint``: marking a model for IPUs.

``pipeline_stage(x, k)`` is an identity that says "from here on the forward
pass runs on pipeline stage ``k``" (TF-IPU's ``PipelineStage``, PopTorch's
``BeginBlock(layer, ipu_id=k)``). It is a primitive, so the boundary survives
``jax.grad`` and ``jax.vmap``: the JVP carries the tangent through the same
boundary and the transpose marks the cotangent leaving stage ``k`` for the
stage before it (``backward=True``). :mod:`ipu_jax.pipelining` splits a
function at these boundaries into one program per stage; under a plain
``ipu_jax.jit`` the op is an identity.

``recomputation_checkpoint(x)`` names ``x`` (``jax.ad_checkpoint.checkpoint_name``)
as a value to keep for the backward pass when pipeline stages are recomputed
(TF-IPU's ``recomputation_checkpoint``, PopTorch's ``recomputationCheckpoint``);
everything else in the stage is recomputed from the stage's input and these.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering

__all__ = ["pipeline_stage", "pipeline_stage_p", "recomputation_checkpoint",
           "RECOMPUTATION_CHECKPOINT"]

# The name ``recomputation_checkpoint`` gives values; the stage recomputation
# policy saves exactly the values so named.
RECOMPUTATION_CHECKPOINT = "ipu_jax_recomputation_checkpoint"

pipeline_stage_p = jcore.Primitive("pipeline_stage")


def _identity(x, *, stage, backward):
  del stage, backward
  return x


def _jvp(primals, tangents, *, stage, backward):
  (x,), (t,) = primals, tangents
  out = pipeline_stage_p.bind(x, stage=stage, backward=backward)
  if type(t) is ad.Zero:
    return out, t
  return out, pipeline_stage_p.bind(t, stage=stage, backward=backward)


def _transpose(ct, x, *, stage, backward):
  del x
  if type(ct) is ad.Zero:
    return [ct]
  return [pipeline_stage_p.bind(ct, stage=stage, backward=not backward)]


def _batch(args, dims, *, stage, backward):
  (x,), (d,) = args, dims
  return pipeline_stage_p.bind(x, stage=stage, backward=backward), d


pipeline_stage_p.def_impl(_identity)
pipeline_stage_p.def_abstract_eval(lambda x, **params: x)
ad.primitive_jvps[pipeline_stage_p] = _jvp
ad.primitive_transposes[pipeline_stage_p] = _transpose
batching.primitive_batchers[pipeline_stage_p] = _batch
mlir.register_lowering(pipeline_stage_p, mlir.lower_fun(_identity, multiple_results=False))


def pipeline_stage(x, stage: int):
  """Start pipeline stage ``stage`` at ``x``; returns ``x`` unchanged.

  Every operation that depends on the result (and on nothing of a later
  stage) belongs to ``stage``, up to the next boundary. Stages number
  ``0, 1, ...`` along the forward pass; stage 0 needs no marker. Pytrees are
  marked leaf by leaf.

  Args:
    x: an array, or a pytree of arrays, entering the stage.
    stage: the stage id, an int >= 1 (the forward pass starts on stage 0).

  Returns:
    ``x``, marked.

  Raises:
    ValueError: ``stage`` is not an int >= 1.
  """
  if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage < 1:
    raise ValueError(f"pipeline_stage: stage must be an int >= 1 (stage 0 is where the "
                     f"forward pass starts and needs no marker); got {stage!r}.")
  return jax.tree_util.tree_map(
      lambda leaf: pipeline_stage_p.bind(jnp.asarray(leaf), stage=int(stage),
                                         backward=False), x)


def recomputation_checkpoint(x):
  """Keep ``x`` for the backward pass when pipeline stages are recomputed.

  With ``PipelineOptions(recomputation=True)`` a stage (every stage but the
  last, as in TF-IPU) stashes only its inputs and the values marked here; the
  rest of its forward pass runs again in the backward pass. Without
  recomputation it is an identity.
  """
  from jax.ad_checkpoint import checkpoint_name
  return jax.tree_util.tree_map(
      lambda leaf: checkpoint_name(jnp.asarray(leaf), RECOMPUTATION_CHECKPOINT), x)


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile rule of ``pipeline_stage`` in a single program: an identity.
#
# Inside one ``ipu_jax.jit`` program every tile of every IPU is one pool, so a
# stage boundary moves nothing; :mod:`ipu_jax.pipelining` is what gives each
# stage its own IPU (it splits the function at these boundaries first).


@register_lowering(pipeline_stage_p)
def _pipeline_stage_rule(ctx: RuleContext, x, *, stage, backward):
  del ctx, stage, backward
  return [x]
