"""Sequence parallelism (Korthikanti et al. 2022), used with Megatron's TP.

Plain 1-D tensor parallelism (:mod:`ipu_jax.parallel.ops`) splits the
matmuls but leaves every IPU of the group holding the whole ``[B, S, H]``
activation in the regions between them: the layer norms, the residual adds,
dropout. Sequence parallelism (V. Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", arXiv:2205.05198, section 4.2.2)
splits those regions along the sequence: each IPU of the group holds
``S / tp`` positions. The all-reduce after a row-parallel linear becomes a
reduce-scatter along the sequence (``g``'s replacement, :func:`scatter_sequence`),
and the input of a column-parallel linear is all-gathered along the sequence
first (``f``'s replacement, :func:`gather_sequence`). A ring all-reduce is a
reduce-scatter then an all-gather, so the links carry the same bytes; the
activations between the matmuls shrink by ``tp``.

Both are ``jax.custom_vjp`` conjugates (the gather's backward is the
reduce-scatter of the gradient, and the reverse), written with ``lax.all_gather``
and ``lax.psum_scatter`` (``tiled``), which ``lowering/rules/parallel.py``
lowers as IPU-Link ring collectives priced over the ``"tp"`` replica groups.

Weights used inside a sequence-split region (norm scales, a row-parallel
linear's bias, learned positions) see only this IPU's positions, so their
gradients are partial sums: ``copy_to_group`` (Megatron's ``f``,
:mod:`ipu_jax.parallel.ops`) applied to such a weight sums its gradient over
the group in the backward, so every shard's copy gets the full gradient, as
with plain TP (Megatron-LM all-reduces these gradients too).
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from ipu_jax.parallel.groups import TP_AXIS

__all__ = ["gather_sequence", "scatter_sequence", "sequence_shard_start"]


def _axis(x, axis: int) -> int:
  ndim = jax.numpy.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"sequence axis={axis} is out of range for an array of shape "
                     f"{jax.numpy.shape(x)}.")
  return axis % ndim


def _gather(x, axis_name, axis):
  return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def _scatter(x, axis_name, axis):
  return lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_sequence(x, axis_name, axis):
  return _gather(x, axis_name, axis)


_gather_sequence.defvjp(lambda x, axis_name, axis: (_gather(x, axis_name, axis), None),
                        lambda axis_name, axis, _, g: (_scatter(g, axis_name, axis),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scatter_sequence(x, axis_name, axis):
  return _scatter(x, axis_name, axis)


_scatter_sequence.defvjp(lambda x, axis_name, axis: (_scatter(x, axis_name, axis), None),
                         lambda axis_name, axis, _, g: (_gather(g, axis_name, axis),))


def gather_sequence(x, axis_name=TP_AXIS, axis: int = 1):
  """All shards' sequence blocks, concatenated in shard order (forward all-gather).

  ``x``: this IPU's ``S / tp`` positions along ``axis`` (shard ``i`` holds
  positions ``i * S / tp ...``). The backward reduce-scatters the gradient
  along the same axis: the sum over the group of each shard's block.
  """
  return _gather_sequence(x, axis_name, _axis(x, axis))


def scatter_sequence(x, axis_name=TP_AXIS, axis: int = 1):
  """This shard's block of the sum over the group (forward reduce-scatter).

  ``x``: partial sums over the whole sequence (a row-parallel linear's
  output before its all-reduce); the result is positions ``i * S / tp ...``
  of the sum on shard ``i``. The backward all-gathers the gradient.

  Raises:
    ValueError: the sequence length is not a multiple of the group size.
  """
  axis = _axis(x, axis)
  size = lax.axis_size(axis_name)
  if x.shape[axis] % size:
    raise ValueError(f"sequence parallelism: the sequence length {x.shape[axis]} (axis "
                     f"{axis}) is not a multiple of the {axis_name!r} group size {size}; "
                     "pad the sequence or choose a tensor-parallel size that divides it.")
  return _scatter_sequence(x, axis_name, axis)


def sequence_shard_start(length: int, axis_name=TP_AXIS):
  """The first position of this shard's block of a sequence of ``length`` positions."""
  return lax.axis_index(axis_name) * (length // lax.axis_size(axis_name))
