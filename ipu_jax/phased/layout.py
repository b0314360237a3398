"""How a phased model runs: :class:`PhasedLayout`, checked before anything runs.

The option names follow Graphcore's frameworks where they exist: PopTorch's
``SerialPhasedExecution`` is ``mode="serial"`` (one IPU group runs every phase
in turn) and ``ParallelPhasedExecution`` is ``mode="ping_pong"`` (two IPU
groups: even phases on group 0, odd phases on group 1; one group computes
while the other loads and stores). ``batch_serialisation`` is PopXL's /
PopART's batch-serialisation factor: the micro-batch loop inside each phase.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MODES", "PhasedLayout", "mesh_sizes"]

MODES = ("serial", "ping_pong")


def mesh_sizes(mesh: Any) -> tuple[int, int]:
  """``(dp, tp)`` of ``mesh`` (``None``: one replica of one IPU)."""
  if mesh is None:
    return 1, 1
  if not (hasattr(mesh, "dp") or hasattr(mesh, "tp")):
    # A tuple such as (2, 1) would read as one replica of one IPU.
    raise TypeError(f"PhasedLayout.mesh must be ipu_jax.parallel.Mesh(dp, tp) (or an object "
                    f"with dp and tp) or None; got {mesh!r}.")
  return int(getattr(mesh, "dp", 1)), int(getattr(mesh, "tp", 1))


def _positive_int(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"PhasedLayout.{name} must be a positive integer, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class PhasedLayout:
  """Where a phased model's state lives and how its phases run.

  Attributes:
    mode: ``"serial"`` (PopTorch ``SerialPhasedExecution``) or
      ``"ping_pong"`` (``ParallelPhasedExecution``: two IPU groups, so the
      run uses twice the IPUs of one replica group).
    batch_serialisation: G, the micro-batches each phase loops over between
      one load and one store of its weights (gradient accumulation inside
      the phase).
    remote_weights: weights live in Streaming Memory between phases.
    remote_optimizer_state: optimizer state lives in Streaming Memory.
    remote_activations: stored activations (each phase's input, per
      micro-batch) and the gradients passed between backward phases live in
      Streaming Memory; ``False`` keeps them in In-Processor Memory.
    rts: replicated tensor sharding of the remote weights and optimizer
      state over the data-parallel replicas (each stores 1/dp; the phase
      all-gathers the weights after loading and reduce-scatters the
      gradients before the sharded update).
    recompute: the backward phase recomputes its forward from the stored
      phase input (the only scheme implemented: ``False`` is refused).
    mesh: ``ipu_jax.parallel.Mesh(dp, tp)`` or any object with ``dp`` and
      ``tp``; ``None`` is one replica on one IPU.
    io_tiles: loads overlap compute as with I/O tiles (the target's
      ``io_tiles_per_ipu > 0`` also turns this on).
    rts_activations: replicated tensor sharding of the stored activations
      over the tensor-parallel group (Graphcore's GPT-J README, "RTS on
      activations"): a phase's input and output are identical on the
      group's IPUs, so each stores and loads ``1/tp`` of every micro-batch's
      activation and the group all-gathers it over the IPU-Links after each
      load. Needs ``remote_activations``; with ``tp = 1`` it changes nothing.
  """

  mode: str = "serial"
  batch_serialisation: int = 1
  remote_weights: bool = True
  remote_optimizer_state: bool = True
  remote_activations: bool = True
  rts: bool = False
  recompute: bool = True
  mesh: Any = None
  io_tiles: bool = False
  rts_activations: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"PhasedLayout.mode must be one of {list(MODES)}, got {self.mode!r}.")
    _positive_int("batch_serialisation", self.batch_serialisation)
    for name in ("remote_weights", "remote_optimizer_state", "remote_activations", "rts",
                 "recompute", "io_tiles", "rts_activations"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"PhasedLayout.{name} must be True or False, "
                         f"got {getattr(self, name)!r}.")
    if not self.recompute:
      raise ValueError("PhasedLayout.recompute=False is not supported: the backward phases "
                       "recompute their forward from the stored phase input (valid: True).")
    dp, tp = self.dp, self.tp
    _positive_int("mesh.dp", dp)
    _positive_int("mesh.tp", tp)
    if self.rts and dp < 2:
      raise ValueError(f"PhasedLayout.rts=True shards the remote state over data-parallel "
                       f"replicas, but mesh.dp={dp}; use mesh dp >= 2 or rts=False.")
    if self.rts_activations and not self.remote_activations:
      raise ValueError("PhasedLayout.rts_activations=True shards the stored activations in "
                       "Streaming Memory; set remote_activations=True.")
    if self.rts and not (self.remote_weights and self.remote_optimizer_state):
      raise ValueError("PhasedLayout.rts=True shards remote weights and optimizer state; "
                       "set remote_weights=True and remote_optimizer_state=True.")

  @property
  def dp(self) -> int:
    return mesh_sizes(self.mesh)[0]

  @property
  def tp(self) -> int:
    return mesh_sizes(self.mesh)[1]

  @property
  def groups(self) -> int:
    """IPU groups the phases alternate over: 2 for ping-pong, else 1."""
    return 2 if self.mode == "ping_pong" else 1

  @property
  def num_ipus(self) -> int:
    """IPUs the run uses: groups x dp x tp."""
    return self.groups * self.dp * self.tp

  def group_of(self, phase_index: int) -> int:
    """The IPU group running phase ``phase_index`` (ping-pong: even 0, odd 1)."""
    return phase_index % self.groups

  def check_batch(self, batch_size: int, field: str = "batch") -> int:
    """The micro-batch size, or a ``ValueError`` naming the sizes that do not divide.

    Args:
      batch_size: samples in one step (all replicas).
      field: the name to use in the message.
    """
    g, dp = self.batch_serialisation, self.dp
    if batch_size < 1:  # a mean over no samples: a NaN loss, and the step counted
      raise ValueError(f"{field} size {batch_size}: the batch has no samples; use a batch "
                       f"that is a positive multiple of mesh.dp x "
                       f"PhasedLayout.batch_serialisation = {dp * g}.")
    if batch_size % (dp * g):
      raise ValueError(
          f"{field} size {batch_size} is not divisible by mesh.dp x "
          f"PhasedLayout.batch_serialisation = {dp} x {g} = {dp * g}; use a batch that is "
          f"a multiple of {dp * g}.")
    return batch_size // (dp * g)
