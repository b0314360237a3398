"""The three tile programs of a pipeline stage, each on one IPU.

* forward: the stage's pass on one micro-batch; it returns the values later
  stages read and the activations its backward pass needs (JAX's VJP
  residuals: exactly what the stage stashes). With recomputation the stage
  is wrapped in ``jax.checkpoint`` saving only ``recomputation_checkpoint``
  values, so it stashes its inputs and those; ``jax.checkpoint`` /
  ``nnx.remat`` regions inside a stage shrink the stash the same way.
* backward: the stashed activations and the gradient of the stage's outputs
  in, the gradient of its inputs out (to the stages that made them), its
  weight gradients added to the accumulator it holds.
* weight update: the optimizer on the stage's own weights and state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ipu_jax.ops.pipeline_stage import RECOMPUTATION_CHECKPOINT

__all__ = ["StagePrograms", "differentiable", "stage_functions", "update_function", "nbytes", "per_tile_bytes"]


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
    weight_bytes: bytes of the stage's weights (and so of its gradients).
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

  @property
  def send_bytes(self) -> int:
    """Bytes sent to later stages per forward pass."""
    return sum(self.sends.values())

  @property
  def gradient_bytes(self) -> int:
    """Bytes of input gradients sent back per backward pass."""
    return sum(self.returns.values())

  @property
  def peak_bytes(self) -> np.ndarray:
    """``[tiles_per_ipu]`` peak bytes: the largest program plus the stash."""
    programs = [self.forward, self.backward] + ([self.update] if self.update else [])
    peak = np.max([p.profile.memory.peak for p in programs], axis=0)
    return peak + self.stash_depth * self.stash_bytes


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


def stage_functions(stage, recompute: bool):
  """The forward and backward functions of one stage (lowered by ipu_jax.jit)."""

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
      body = jax.checkpoint(
          body, policy=jax.checkpoint_policies.save_only_these_names(RECOMPUTATION_CHECKPOINT))
    float_outs, vjp, int_outs = jax.vjp(
        body, p_k, [x for x, d in zip(in_k, mask) if d], has_aux=True)
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    vjp_tree[:] = [tree]
    shapes = jax.eval_shape(lambda: stage(p_k, b_k, in_k))
    it_f, it_i = iter(float_outs), iter(int_outs)
    outs = [next(it_f) if differentiable(o) else next(it_i) for o in shapes]
    return outs, leaves

  def backward(residuals, cts, acc):
    """``cts``: of the differentiable outputs; returns those inputs' gradients."""
    vjp = jax.tree_util.tree_unflatten(vjp_tree[0], residuals)
    d_params, d_inputs = vjp(cts)
    return [a + d for a, d in zip(acc, d_params)], d_inputs

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
