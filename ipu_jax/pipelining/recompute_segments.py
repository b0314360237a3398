"""Recompute a stage one checkpoint segment at a time, interleaved with its backward.

One ``jax.checkpoint`` around a whole stage saving only the
``recomputation_checkpoint`` values makes its backward pass run the stage's
whole forward again first and only then backpropagate: the residuals of every
layer the stage holds are live together, so the backward's peak grows with the
number of layers (for BERT-Large about 111 KB per tile per layer).

TF-IPU recomputes one checkpoint segment at a time, each right before its
gradients are taken (``RecomputeAndBackpropagateInterleaved``: the stage's
forward pass is cut at its ``recomputation_checkpoint`` ops; the backward pass
recomputes the last segment, backpropagates it, then the one before, ...).
:func:`segmented_checkpoint` does the same at the jaxpr level: it traces the
stage, cuts its equations after each equation naming a value
``RECOMPUTATION_CHECKPOINT``, and evaluates each segment inside its own
``jax.checkpoint``. Each segment's inputs (the checkpoints and stage inputs it
reads) are what the forward pass keeps; JAX's transpose of the segments runs in
reverse order and recomputes each segment's forward work (in its
``rematted_computation`` scope) just before transposing that segment, so only
one segment's residuals are live at a time. The numbers are those of the
equations traced, evaluated in the same order.

A stage without checkpoint marks is one segment: the whole stage in one
``jax.checkpoint``, as before. Marks inside a nested call (a ``jax.jit`` or
``scan`` body) do not cut the stage at the top level; such a call is one
equation of whichever segment it falls in.

With ``recompute_tail=False`` (the last stage under
``pipelining.last_stage_recomputation = "checkpoints"``) the equations after
the last mark are evaluated plainly, outside any ``jax.checkpoint``: their
residuals wait for the backward pass and are not recomputed, as PopART's
``Pipeline::setFinalFwdStageRecomputation`` sets the ops between the
topologically final checkpoints and the loss to ``Checkpoint`` ("avoids ...
operations run twice in a row with no benefit to liveness",
``willow/src/transforms/pipeline.cpp``). A stage without marks is then not
recomputed at all.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax.extend import core as jcore

from ipu_jax.lowering.jax_compat import source_info_util
from ipu_jax.ops.pipeline_stage import RECOMPUTATION_CHECKPOINT

__all__ = ["Segment", "split_segments", "segmented_checkpoint"]


@dataclasses.dataclass
class Segment:
  """Consecutive equations of a traced stage, ending at a checkpoint mark.

  Attributes:
    eqns: the equations, in trace order.
    inputs: variables the segment reads that are defined before it (stage
      inputs, constants or earlier segments' results), each once.
    outputs: variables it defines that later segments or the stage's result read.
  """

  eqns: list
  inputs: list
  outputs: list


def _is_checkpoint(eqn) -> bool:
  return eqn.primitive.name == "name" and eqn.params.get("name") == RECOMPUTATION_CHECKPOINT


def _cut(eqns) -> list:
  """Equation lists, each ending after a checkpoint mark (the last may not)."""
  groups, current = [], []
  for eqn in eqns:
    current.append(eqn)
    if _is_checkpoint(eqn):
      groups.append(current)
      current = []
  if current:
    groups.append(current)
  return groups


def _vars(atoms) -> list:
  return [v for v in atoms if not isinstance(v, jcore.Literal)]


def split_segments(jaxpr) -> list:
  """Cut ``jaxpr``'s equations into :class:`Segment` s at its checkpoint marks."""
  groups = _cut(jaxpr.eqns)
  # Walk backwards: what a segment must output is what is read after it.
  needed_after = set(_vars(jaxpr.outvars))
  segments = []
  for eqns in reversed(groups):
    defined = {v for e in eqns for v in e.outvars}
    outputs = [v for e in eqns for v in e.outvars if v in needed_after]
    inputs = list(dict.fromkeys(v for e in eqns for v in _vars(e.invars) if v not in defined))
    segments.append(Segment(eqns, inputs, outputs))
    needed_after = (needed_after - defined) | set(inputs)
  return segments[::-1]


def _eval(eqns, inputs, outputs, values) -> list:
  """Evaluate ``eqns`` on ``values`` of ``inputs``; the values of ``outputs``."""
  env = dict(zip(inputs, values))

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for eqn in eqns:
    params = eqn.primitive.get_bind_params(eqn.params)
    # Keep the user's line and module path on what is traced again.
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack):
      out = eqn.primitive.bind(*map(read, eqn.invars), **params)
    for v, value in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
      if not isinstance(v, jcore.DropVar):
        env[v] = value
  return [read(v) for v in outputs]


def _ends_at_checkpoint(segment: Segment) -> bool:
  return bool(segment.eqns) and _is_checkpoint(segment.eqns[-1])


def segmented_checkpoint(fn: Callable, policy, recompute_tail: bool = True) -> Callable:
  """``fn`` recomputed segment by segment: see the module docstring.

  Args:
    fn: the stage body, a function of pytrees of arrays.
    policy: the ``jax.checkpoint`` policy of each segment.
    recompute_tail: whether the equations after the last checkpoint mark
      (all of them without marks) are recomputed too; False: they are
      evaluated plainly, their residuals kept.

  Returns:
    A function with ``fn``'s signature and results.
  """

  def wrapped(*args):
    flat, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_shape = jax.make_jaxpr(
        lambda *a: fn(*jax.tree_util.tree_unflatten(in_tree, a)), return_shape=True)(*flat)
    jaxpr = closed.jaxpr
    segments = split_segments(jaxpr)
    plain_tail = not recompute_tail and not (segments and _ends_at_checkpoint(segments[-1]))
    if len(segments) <= 1:
      return fn(*args) if plain_tail else jax.checkpoint(fn, policy=policy)(*args)
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, flat))
    for k, seg in enumerate(segments):
      run = lambda *values, seg=seg: _eval(seg.eqns, seg.inputs, seg.outputs, values)
      if not (plain_tail and k == len(segments) - 1):
        run = jax.checkpoint(run, policy=policy)
      env.update(zip(seg.outputs, run(*[env[v] for v in seg.inputs])))
    outs = [v.val if isinstance(v, jcore.Literal) else env[v] for v in jaxpr.outvars]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return wrapped
