"""Which stages an optimizer's update reads: a pipeline's updates see one stage each.

A :class:`~ipu_jax.pipelining.Pipeline` updates each stage's weights with the
optimizer on that stage's IPU, from that stage's weights, gradients and state
only. An optimizer whose update of one weight reads others (a global-norm
clip reads every gradient) then computes something else than on the whole
model: each stage clips by its own norm. :func:`warn_if_mixing` traces the
whole model's update once (abstractly), follows which weights each value is
computed from, and warns, naming a weight and the weight of another stage it
reads.
"""

from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

__all__ = ["warn_if_mixing"]


def _dependencies(jaxpr, in_deps) -> list:
  """For each output of ``jaxpr``, the set of weights it is computed from.

  A ``select_n`` predicate or a ``cond`` index only chooses between values
  (a skip of a non-finite step, which the pipelined ``fit`` decides once for
  all stages), so it is not counted; nested calls are followed.
  """
  deps = dict(zip(jaxpr.invars, in_deps))

  def of(v):
    return frozenset() if isinstance(v, jcore.Literal) else deps.get(v, frozenset())

  for eqn in jaxpr.eqns:
    body = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr")
                 if isinstance(eqn.params.get(k), (jcore.ClosedJaxpr, jcore.Jaxpr))), None)
    if body is not None:
      inner = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
      reads = [of(v) for v in eqn.invars][len(eqn.invars) - len(inner.invars):]
      deps.update(zip(eqn.outvars, _dependencies(inner, reads)))
      continue
    operands = eqn.invars[1:] if eqn.primitive in (lax.select_n_p, lax.cond_p) else eqn.invars
    read = frozenset().union(*(of(v) for v in operands))
    deps.update((v, read) for v in eqn.outvars)
  return [of(v) for v in jaxpr.outvars]


def _reads_across_stages(optimizer, flat_params, stages_of) -> Optional[tuple]:
  """``(i, j)``: a weight ``i`` whose new value is computed from weight ``j`` of
  another stage (its value or gradient), traced on the whole model's update."""
  import optax

  flat = [jax.ShapeDtypeStruct(np.shape(p), jnp.result_type(p)) for p in flat_params]

  def update(grads, state, params):
    updates, _ = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates)

  closed = jax.make_jaxpr(update)(flat, jax.eval_shape(optimizer.init, flat), flat)
  n, num_in = len(flat), len(closed.jaxpr.invars)
  # The gradients, then the state (computed from no weight), then the weights.
  in_deps = [frozenset([k]) if k < n else
             frozenset([k - (num_in - n)]) if k >= num_in - n else frozenset()
             for k in range(num_in)]
  for i, read in enumerate(_dependencies(closed.jaxpr, in_deps)[:n]):
    for j in sorted(read):
      if stages_of[i] and stages_of[j] and not stages_of[i] & stages_of[j]:
        return i, j
  return None


def warn_if_mixing(pipeline, flat_params) -> None:
  """Warn when the optimizer reads other stages' weights: each stage sees its own only."""
  stages_of = [set() for _ in flat_params]
  for stage in pipeline.staged.stages:
    for i in stage.params:
      stages_of[i].add(stage.index)
  if len({k for s in stages_of for k in s}) < 2:
    return
  found = _reads_across_stages(pipeline.optimizer, flat_params, stages_of)
  if found is None:
    return
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(
      jax.tree_util.tree_unflatten(pipeline.staged.param_tree, list(flat_params)))[0]]
  i, j = found
  warnings.warn(
      f"The optimizer's update of weight {paths[i]} (pipeline stage "
      f"{min(stages_of[i])}) reads weight {paths[j]} of stage {min(stages_of[j])} (a "
      "global-norm clip, for example); a Pipeline updates each stage's weights on their own "
      "IPU, seeing only that stage's weights and gradients, so a global norm is each "
      "stage's own.", stacklevel=4)
