"""Tile rule of ``pipeline_stage`` in a single program: an identity.

Inside one ``ipu_jax.jit`` program every tile of every IPU is one pool, so a
stage boundary moves nothing; :mod:`ipu_jax.pipelining` is what gives each
stage its own IPU (it splits the function at these boundaries first).
"""

from __future__ import annotations

from ipu_jax.lowering.registry import register_lowering
from ipu_jax.ops.pipeline_stage import pipeline_stage_p


@register_lowering(pipeline_stage_p)
def _pipeline_stage_rule(ctx, x, *, stage, backward):
  del ctx, stage, backward
  return [x]
