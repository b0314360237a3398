"""A split's memory and time composed from the figures of its lowered bodies.

The split search lowers each distinct body once per (memory proportion,
recomputation, serialisation) setting, as the stages of a small probe
pipeline -- a three-layer model laid out ``[first], [layer], [layer, layer],
[last]`` -- and reads from the profiles (:class:`BodyFigures`): each
program's cycles and per-tile peak, the per-tile bytes of one micro-batch's
stash, of the owned weights, of the on-chip optimizer state and of all the
stage holds for the step (weights, gradient accumulators, on-chip optimizer
state), and the bytes sent between stages.

A stage of n >= 2 layers is the two-layer stage plus n - 2 times what the
second layer added (:func:`layers`): the same cycles, and per tile the same
bytes on average. What a further layer adds -- its weights and gradient
accumulators, its stash (in a recomputing backward its checkpoint, read in
until its segment is backpropagated: segments are recomputed one at a time,
:mod:`~ipu_jax.pipelining.recompute_segments`) -- is the same for every
further layer in total, but not tile by tile: the tile mapper places each
layer's tensors where the earlier layers left room, so the second layer's
bytes fill the tiles the first left emptiest (on BERT-Large's 1,472 tiles
their per-tile stash and holdings are anti-correlated), and n layers are
spread nearly evenly. Extrapolating the second layer's per-tile increment
n - 2 times would pile it onto the same tiles (43 % over a lowered 7-layer
stage's backward peak); its mean over the tiles gives each figure within 2 %
(a 7-layer BERT-Large stage: forward peak +1.1 %, backward +1.9 %, update
-0.5 %, stash -0.3 %, holdings -0.1 %).

IPU 0's first stage runs the first block and its layers one after another
(:func:`compose_stage`): cycles, stash and holdings add; while one body's
program runs, everything the stage holds that the program does not read is
live beside its peak -- beside a forward, every accumulator, every on-chip
optimizer state and the other bodies' weights; beside a backward, the other
bodies' weights and accumulators and every optimizer state -- and the other
bodies' stash; the weight update touches everything, so its peak is the sum. These are upper bounds of
what one lowering of the whole stage would plan.

Each IPU's peak then follows :mod:`~ipu_jax.pipelining.layout`'s rule: the
largest of its stages' program peaks with the other stages' holdings beside
it, plus every stage's stash depth x stash bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ipu_jax.pipelining import layout

__all__ = ["BodyFigures", "StageFigures", "body_figures", "compose_stage", "ipu_peak", "layers"]


@dataclasses.dataclass
class BodyFigures:
  """What one lowered body costs (from its probe stage's programs).

  Attributes:
    forward, backward, update: cycles of each program (update 0 without one).
    forward_peak, backward_peak, update_peak: ``[tiles]`` each program's peak bytes.
    stash: ``[tiles]`` one micro-batch's stashed activations.
    weights: ``[tiles]`` the weights it owns.
    state: ``[tiles]`` its optimizer state kept on chip (zeros offloaded).
    held: ``[tiles]`` the weights it owns, their gradient accumulators and
      its on-chip optimizer state.
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
  state: np.ndarray
  held: np.ndarray
  weight_bytes: int
  sends: int
  returns: int


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
      weights=layout.weight_bytes(programs.forward, pipe.staged.stages[index], num_tiles),
      state=(np.asarray(programs.state_bytes, np.int64) if programs.state_bytes is not None
             else zeros),
      held=(np.asarray(programs.held_bytes, np.int64) if programs.held_bytes is not None
            else zeros),
      weight_bytes=int(programs.weight_bytes),
      sends=int(sum(programs.sends.values())),
      returns=int(sum(programs.returns.values())))


_SCALED = ("forward", "backward", "update", "forward_peak", "backward_peak", "update_peak",
           "stash", "weights", "state", "held", "weight_bytes")


def layers(one: BodyFigures, two: BodyFigures, count: int) -> BodyFigures:
  """The figures of ``count`` >= 1 layers from those of one and of two layers.

  Cycles and byte totals are ``two + (count - 2) x (two - one)``; a per-tile
  figure is ``two`` plus ``count - 2`` times the mean over the tiles of
  ``two - one`` (rounded up), never below zero (see the module docstring).
  """
  if count <= 2:
    return one if count == 1 else two

  def scaled(name):
    a, b = getattr(one, name), getattr(two, name)
    if isinstance(a, np.ndarray):
      step = int(np.ceil(np.mean(b - a))) if a.size else 0
      return np.maximum(b + (count - 2) * step, 0)
    return max(b + (count - 2) * (b - a), 0)
  return dataclasses.replace(two, **{name: scaled(name) for name in _SCALED})


@dataclasses.dataclass
class StageFigures:
  """A composed stage: cycles, per-tile program peak, stash and holdings (weights,
  accumulators and on-chip optimizer state)."""

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
  # Beside each program: what the stage holds less what the program reads
  # (a forward its body's weights; a backward its body's weights and
  # accumulators, not its state).
  forward = np.max([b.forward_peak + (held - b.weights) + (stash - b.stash)
                    for b in bodies], axis=0)
  backward = np.max([b.backward_peak + (held - b.held) + b.state + (stash - b.stash)
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
