"""A split's memory and time composed from the figures of its lowered bodies.

The split search lowers each distinct body -- the first block, one layer, the
last block -- once per (memory proportion, recomputation, serialisation)
setting, as the stages of a small probe pipeline (a one-layer model laid out
``[first], [layer], [last]``), and reads from the profiles
(:class:`BodyFigures`): each program's cycles and per-tile peak, the
per-tile bytes of one micro-batch's stash, of the owned weights and of the
weights plus their gradient accumulators, and the bytes sent between stages.

A stage of several bodies (IPU 0's first block and layers, or n layers) is
composed from them (:func:`compose_stage`):

* cycles: the sum of its bodies' (forward, backward, weight update);
* stash and held bytes: the sums, tile by tile (identical layers lowered for
  one IPU map their tensors onto the same tiles);
* program peak: while body b's forward runs, the other bodies' weights and
  the stash the earlier bodies already made are live beside its own peak, so
  the forward peak is ``max_b(peak_b + weights_others + stash_others)``; the
  backward's is ``max_b(peak_b + held_others + stash_others)`` (all
  residuals and accumulators are its arguments); the weight update touches
  every body's weights, state and accumulators, so its peak is the sum.
  These are upper bounds of what one lowering of the whole stage would plan.

Each IPU's peak then follows :mod:`~ipu_jax.pipelining.layout`'s rule: the
largest of its stages' program peaks with the other stages' holdings beside
it, plus every stage's stash depth x stash bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

__all__ = ["BodyFigures", "StageFigures", "body_figures", "compose_stage", "ipu_peak"]


@dataclasses.dataclass
class BodyFigures:
  """What one lowered body costs (from its probe stage's programs).

  Attributes:
    forward, backward, update: cycles of each program (update 0 without one).
    forward_peak, backward_peak, update_peak: ``[tiles]`` each program's peak bytes.
    stash: ``[tiles]`` one micro-batch's stashed activations.
    weights: ``[tiles]`` the weights it owns.
    held: ``[tiles]`` the weights it owns and their gradient accumulators.
    weight_bytes: bytes of the weights it owns.
    sends, returns: bytes its forward sends on / its backward returns.
  """

  forward: float
  backward: float
  update: float
  forward_peak: np.ndarray
  backward_peak: np.ndarray
  update_peak: np.ndarray
  stash: np.ndarray
  weights: np.ndarray
  held: np.ndarray
  weight_bytes: int
  sends: int
  returns: int


def _owned_weight_tiles(programs, stage, num_tiles: int) -> np.ndarray:
  owned = set(stage.owned)
  out = np.zeros(num_tiles, np.int64)
  for i, tensor in zip(stage.params, programs.forward.inputs[:len(stage.params)]):
    if i in owned and tensor.mapping is not None and tensor.mapping.num_elements:
      np.add.at(out, tensor.mapping.tiles, tensor.mapping.counts * tensor.itemsize)
  return out


def body_figures(pipe, index: int) -> BodyFigures:
  """The figures of stage ``index`` of a lowered (probe) pipeline."""
  programs = pipe.stages[index]
  num_tiles = len(programs.stash_bytes)
  zeros = np.zeros(num_tiles, np.int64)
  update = programs.update
  return BodyFigures(
      forward=float(programs.forward.profile.total_cycles),
      backward=float(programs.backward.profile.total_cycles),
      update=float(update.profile.total_cycles) if update is not None else 0.0,
      forward_peak=np.asarray(programs.forward.profile.memory.peak, np.int64),
      backward_peak=np.asarray(programs.backward.profile.memory.peak, np.int64),
      update_peak=(np.asarray(update.profile.memory.peak, np.int64) if update is not None
                   else zeros),
      stash=np.asarray(programs.stash_bytes, np.int64),
      weights=_owned_weight_tiles(programs, pipe.staged.stages[index], num_tiles),
      held=(np.asarray(programs.held_bytes, np.int64) if programs.held_bytes is not None
            else zeros),
      weight_bytes=int(programs.weight_bytes),
      sends=int(sum(programs.sends.values())),
      returns=int(sum(programs.returns.values())))


@dataclasses.dataclass
class StageFigures:
  """A composed stage: cycles, per-tile program peak, stash and holdings."""

  forward: float
  backward: float
  update: float
  program_peak: np.ndarray
  stash: np.ndarray
  held: np.ndarray
  weight_bytes: int


def compose_stage(bodies: Sequence[BodyFigures]) -> StageFigures:
  """A stage running ``bodies`` one after another (see the module docstring)."""
  stash = sum(b.stash for b in bodies)
  held = sum(b.held for b in bodies)
  weights = sum(b.weights for b in bodies)
  forward = np.max([b.forward_peak + (weights - b.weights) + (stash - b.stash)
                    for b in bodies], axis=0)
  backward = np.max([b.backward_peak + (held - b.held) + (stash - b.stash)
                     for b in bodies], axis=0)
  update = sum(b.update_peak for b in bodies)
  return StageFigures(
      forward=float(sum(b.forward for b in bodies)),
      backward=float(sum(b.backward for b in bodies)),
      update=float(sum(b.update for b in bodies)),
      program_peak=np.maximum(np.maximum(forward, backward), update),
      stash=stash, held=held, weight_bytes=int(sum(b.weight_bytes for b in bodies)))


def ipu_peak(stages: Sequence[StageFigures], depths: Sequence[int]) -> np.ndarray:
  """``[tiles]`` the peak of an IPU running ``stages`` with these stash depths."""
  total_held = sum(s.held for s in stages)
  program = np.max([s.program_peak + (total_held - s.held) for s in stages], axis=0)
  return program + sum(d * s.stash for s, d in zip(stages, depths))
