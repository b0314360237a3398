"""The three tile programs of a pipeline stage, each on one IPU.

* forward: the stage's pass on one micro-batch; it returns the values later
  stages read and the activations its backward pass needs (JAX's VJP
  residuals: exactly what the stage stashes). With recomputation every stage
  but the last is cut at its ``recomputation_checkpoint`` values into
  segments, each in a ``jax.checkpoint`` saving only those values, so it
  stashes its inputs (from earlier stages and the micro-batch) and those;
  ``jax.checkpoint`` / ``nnx.remat``
  regions inside a stage shrink the stash the same way. By default the last
  stage is never recomputed, as in TensorFlow-IPU, whose recomputation pass
  skips the last forward stage: its forward and backward passes run back to
  back, so its stash is never kept across slots (``PipelineRecomputation`` in
  tensorflow/compiler/plugin/poplar/driver/passes/pipeline_recomputation.cc).
  With ``pipelining.last_stage_recomputation = "checkpoints"`` it is cut at
  its checkpoints as PopART's ``RecomputationType::Pipeline`` cuts it
  (``Pipeline::setFinalFwdStageRecomputation``): the segments up to its last
  checkpoint are recomputed, the tail after it (up to the loss) is not
  (``recompute_tail=False``); one micro-batch's checkpoints wait, its
  residuals are those of one segment at a time plus the tail's.
* backward: the stashed activations and the gradient of the stage's outputs
  in, the gradient of its inputs out (to the stages that made them), its
  weight gradients added to the accumulator it holds. With recomputation it
  runs again the forward work its gradients need, one checkpoint segment at a
  time, each right before that segment's gradients
  (:mod:`~ipu_jax.pipelining.recompute_segments`).
* weight update: the optimizer on the stage's own weights and state.

What recomputation costs (:func:`recompute_cycles`) is read off the lowered
backward program, not estimated: when JAX transposes a ``jax.checkpoint``
region it evaluates the region's non-linear part -- the forward equations
and the derivative coefficients computed from them, which without the
checkpoint the forward pass computes and stashes -- under the name scope
``rematted_computation`` (``jax/_src/ad_checkpoint.py``), and the lowering
keeps each equation's name scope on the supersteps it becomes. So the
recompute cycles are the cycles of the backward's supersteps in that scope.
Elementwise fusion joins recomputed steps only with recomputed steps
(``lowering/fusion.py``), so a fused step counts whole or not at all (the
flops share of its recomputed members, were that ever mixed). This counts exactly the equations the backward program runs
again, also those of ``jax.checkpoint`` regions the user wrote inside a
stage. It is less than the stage's forward: the rematted computation holds
only what the gradients read, so a segment's output work (a residual block's
last matmul and add, whose results only leave the segment) is not run again,
while the derivative coefficients the plain forward computes are
(docs/multi_ipu.md#what-is-recomputed). The other way, lowering the backward
once more without recomputation and subtracting, would double the lowering
work per stage and mix in whatever else differs between the two programs. (Should JAX rename the
scope, the figure drops to 0, which tests/test_pipeline_costs.py catches.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ipu_jax.lowering.scopes import RECOMPUTED_SCOPE, recomputed as _recomputed
from ipu_jax.ops.pipeline_stage import RECOMPUTATION_CHECKPOINT
from ipu_jax.pipelining.accumulate_early import accumulate_early
from ipu_jax.pipelining.recompute_segments import segmented_checkpoint

__all__ = ["StagePrograms", "differentiable", "stage_functions", "update_function", "nbytes",
           "per_tile_bytes", "recompute_cycles", "RECOMPUTED_SCOPE"]


@dataclasses.dataclass
class StagePrograms:
  """The lowered programs of one stage and what they cost.

  Attributes:
    index, ipu: the stage and the IPU (within one replica) it runs on.
    forward, backward, update: the :class:`ipu_jax.Lowered` programs
      (``update`` is None without an optimizer).
    stash_bytes: ``[tiles_per_ipu]`` bytes of one micro-batch's stashed
      activations on each tile.
    stash_depth: activation sets waiting for their backward pass (schedule).
    sends: stage -> bytes this stage's forward pass sends it (a skip
      connection sends past the next stage, straight to its reader).
    returns: stage -> bytes of input gradients the backward pass sends it.
    weight_bytes: bytes of the weights the stage owns and updates (and so
      of their gradients).
    held_bytes: ``[tiles_per_ipu]`` bytes of the weights it owns, their
      gradient accumulators and its on-chip optimizer state, held for the
      whole step (what the other stages on its IPU run beside;
      :mod:`~ipu_jax.pipelining.layout`).
    state_bytes: ``[tiles_per_ipu]`` of those, the on-chip optimizer state
      (zeros when offloaded to streaming memory): beside its forward and
      backward programs too.
    accumulator_bytes: ``[tiles_per_ipu]`` of those, the gradient
      accumulators: beside its forward program too.
    shared_with: the stage whose forward and backward programs these are
      (an earlier stage alike, :mod:`~ipu_jax.pipelining.shared_stages`),
      or None when this stage's were lowered for it.
  """

  index: int
  ipu: int
  forward: Any
  backward: Any
  update: Any
  stash_bytes: np.ndarray
  stash_depth: int = 0
  sends: dict = dataclasses.field(default_factory=dict)
  returns: dict = dataclasses.field(default_factory=dict)
  weight_bytes: int = 0
  held_bytes: Any = None
  state_bytes: Any = None
  accumulator_bytes: Any = None
  shared_with: Any = None

  @property
  def send_bytes(self) -> int:
    """Bytes sent to later stages per forward pass."""
    return sum(self.sends.values())

  @property
  def gradient_bytes(self) -> int:
    """Bytes of input gradients sent back per backward pass."""
    return sum(self.returns.values())

  @property
  def recompute_cycles(self) -> float:
    """Cycles the backward pass spends running forward work again (see
    :func:`recompute_cycles`); 0 for a stage that is not recomputed."""
    return recompute_cycles(self.backward.profile)

  @property
  def peak_bytes(self) -> np.ndarray:
    """``[tiles_per_ipu]`` this stage's peak bytes: its largest program plus its stash.

    Its on-chip optimizer state is held beside its forward and backward
    programs (the update program counts it), its gradient accumulators beside
    its forward program (the backward and update programs read them). Stages
    sharing an IPU add up there: see :func:`ipu_jax.pipelining.layout.ipu_memory`.
    """
    state = 0 if self.state_bytes is None else self.state_bytes
    acc = 0 if self.accumulator_bytes is None else self.accumulator_bytes
    peaks = [self.forward.profile.memory.peak + state + acc,
             self.backward.profile.memory.peak + state]
    peaks += [self.update.profile.memory.peak] if self.update else []
    return np.max(peaks, axis=0) + self.stash_depth * self.stash_bytes


def nbytes(values) -> int:
  # ``dtype.itemsize``: a typed PRNG key's dtype has one (8 bytes) but is no NumPy dtype.
  return int(sum(np.prod(np.shape(v), dtype=np.int64) * v.dtype.itemsize for v in values))


def per_tile_bytes(lowered, output_indices, num_tiles: int) -> np.ndarray:
  out = np.zeros(num_tiles, np.int64)
  seen = set()
  for i in output_indices:
    tensor = lowered.outputs[i]
    if tensor.id in seen or tensor.mapping is None or tensor.mapping.num_elements == 0:
      continue
    seen.add(tensor.id)
    np.add.at(out, tensor.mapping.tiles, tensor.mapping.counts * tensor.itemsize)
  return out


def _recomputed_share(step) -> float:
  """The share of ``step``'s cycles that is recomputed forward work."""
  if not step.fused_ops:
    return 1.0 if _recomputed(step.scope) else 0.0
  members = [(op.step.flops if op.step is not None else 0, _recomputed(op.scope))
             for op in step.fused_ops]
  flops = sum(f for f, _ in members)
  if flops:
    return sum(f for f, r in members if r) / flops
  return sum(r for _, r in members) / len(members)


def recompute_cycles(profile) -> float:
  """Cycles of ``profile``'s supersteps that rerun checkpointed forward work.

  Args:
    profile: a backward program's ``ProgramProfile``.

  Returns:
    Per run of the program: the cycles (times executions) of the supersteps
    lowered from equations in JAX's ``rematted_computation`` scope, a fused
    step counting for the flops share of its members in that scope (see the
    module docstring).
  """
  return float(sum(_recomputed_share(s) * s.total_cycles * s.executions
                   for s in profile.steps))


def stage_functions(stage, recompute: bool, recompute_tail: bool = True):
  """The forward and backward functions of one stage (lowered by ipu_jax.jit).

  Args:
    stage: the :class:`~ipu_jax.pipelining.split.Stage`.
    recompute: cut it at its checkpoint marks and recompute the segments in
      the backward pass.
    recompute_tail: with ``recompute``, whether the equations after the last
      mark are recomputed too (False: PopART's last stage).
  """

  # The VJP's tree holds the traced backward jaxpr, which differs from trace
  # to trace: the programs pass its leaves (the residuals), and the backward
  # pass rebuilds it with the structure of the latest forward trace.
  vjp_tree = []

  def forward(p_k, b_k, in_k):
    # Integer values (token ids, labels) cross stages but carry no gradient.
    mask = [differentiable(x) for x in in_k]
    fixed = [x for x, d in zip(in_k, mask) if not d]

    def body(p, i):
      it, fx = iter(i), iter(fixed)
      outs = stage(p, b_k, [next(it) if d else next(fx) for d in mask])
      return ([o for o in outs if differentiable(o)],
              [o for o in outs if not differentiable(o)])

    if recompute:
      # One jax.checkpoint per checkpoint segment: the backward recomputes
      # each segment right before backpropagating it (recompute_segments).
      body = segmented_checkpoint(
          body, jax.checkpoint_policies.save_only_these_names(RECOMPUTATION_CHECKPOINT),
          recompute_tail=recompute_tail)
    float_outs, vjp, int_outs = jax.vjp(
        body, p_k, [x for x, d in zip(in_k, mask) if d], has_aux=True)
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    vjp_tree[:] = [tree]
    # The stage's output variables say which outputs are differentiable
    # (their avals), without tracing the stage once more.
    it_f, it_i = iter(float_outs), iter(int_outs)
    outs = [next(it_f) if differentiable(o) else next(it_i) for o in stage.outputs]
    return outs, leaves

  def accumulate(residuals, cts, acc):
    vjp = jax.tree_util.tree_unflatten(vjp_tree[0], residuals)
    d_params, d_inputs = vjp(cts)
    return [a + d for a, d in zip(acc, d_params)], d_inputs

  def backward(residuals, cts, acc):
    """``cts``: of the differentiable outputs; returns those inputs' gradients.

    Each weight's gradient is added into its accumulator as soon as it is
    ready (:mod:`~ipu_jax.pipelining.accumulate_early`), not after the whole
    VJP.
    """
    return accumulate_early(accumulate, (residuals, cts, acc), argnum=2)

  return forward, backward


def differentiable(x) -> bool:
  """Whether ``x`` (an array, aval or variable) has a gradient: inexact dtypes."""
  dtype = getattr(getattr(x, "aval", x), "dtype", None)
  return dtype is not None and jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def update_function(optimizer):
  import optax

  def update(p_k, state, g_k):
    updates, state = optimizer.update(g_k, state, p_k)
    return optax.apply_updates(p_k, updates), state

  return update
