"""A backward program's gradient accumulation, each weight's add as soon as its gradient is ready.

A stage's backward pass (:func:`~ipu_jax.pipelining.stage_programs.stage_functions`)
is written as "the VJP, then ``acc + d`` for every weight": traced as it
is written, every weight gradient of the stage would wait until the last
segment's gradients are done before being added into its accumulator, so the
emulator would hold all of them at once (a 7-layer BERT encoder stage: six
layers' gradients, about 100 KiB per tile, live at its last layer's FFN
matmul). Neither TensorFlow-IPU nor PopART runs it that way: TF-IPU's
pipelined gradient accumulation adds each gradient into its accumulator
variable in the backward stage that computes it (``GradientAccumulatorAdd``,
an in-place op on the accumulator; its schedulers order work to lower
liveness), and PopART's ``AccumulateOp`` is an in-place weight update right
after the gradient it consumes. So the program is traced once, and every
equation that reads an accumulator is moved to right after the equation that
makes its last operand; nothing else moves, so the dataflow and the numbers
are those of the program as written. With the accumulator updated in place
(``lowering/builders.py``: an elementwise result written over a dying program
variable), each gradient then dies at its add (docs/cost_model.md#the-memory-model).
"""

from __future__ import annotations

import jax
from jax.extend import core as jex_core

__all__ = ["accumulate_early", "early_order"]


def early_order(eqns, invars, constvars, accumulators) -> list:
  """``eqns`` with each one reading ``accumulators`` as early as its operands allow.

  Args:
    eqns: a jaxpr's equations, in order.
    invars, constvars: the jaxpr's inputs (defined from the start).
    accumulators: the input variables whose readers move.

  Returns:
    The same equations, the others in their order, each reader of an
    accumulator right after the last equation defining one of its operands
    (readers ready together keep their order).
  """
  accumulators = set(accumulators)
  defined = set(invars) | set(constvars)
  reads_accumulator = [any(not isinstance(v, jex_core.Literal) and v in accumulators
                           for v in eqn.invars) for eqn in eqns]
  waiting = [eqn for eqn, moves in zip(eqns, reads_accumulator) if moves]
  order = []

  def emit(eqn):
    order.append(eqn)
    defined.update(eqn.outvars)

  def flush():
    # A moved reader may feed another (acc + g, then a cast of it): repeat.
    progress = True
    while progress:
      progress = False
      for eqn in list(waiting):
        if all(isinstance(v, jex_core.Literal) or v in defined for v in eqn.invars):
          waiting.remove(eqn)
          emit(eqn)
          progress = True

  flush()
  for eqn, moves in zip(eqns, reads_accumulator):
    if not moves:
      emit(eqn)
      flush()
  order.extend(waiting)  # unreachable for a well-formed jaxpr: every operand is defined
  return order


def accumulate_early(fn, args: tuple, argnum: int):
  """``fn(*args)``, traced with the readers of ``args[argnum]``'s leaves moved early.

  Args:
    fn: the backward function (pytrees in and out).
    args: its arguments.
    argnum: which argument holds the accumulators.

  Returns:
    ``fn``'s outputs, computed by the reordered equations.
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  jaxpr = closed.jaxpr
  eqns = jaxpr.eqns
  if not jaxpr.effects:  # ordered effects pin the order as written
    start = sum(len(jax.tree_util.tree_leaves(a)) for a in args[:argnum])
    count = len(jax.tree_util.tree_leaves(args[argnum]))
    eqns = early_order(eqns, jaxpr.invars, jaxpr.constvars,
                       jaxpr.invars[start:start + count])
  flat = jax.core.eval_jaxpr(jaxpr.replace(eqns=eqns), closed.consts,
                             *jax.tree_util.tree_leaves(args))
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)
