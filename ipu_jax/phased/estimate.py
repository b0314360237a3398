"""A phased step's time: the phase programs' profiles composed with streaming.

Each phase execution (forwards in order, then backwards in reverse) costs

* its programs' cycles from their lowered profiles (per replica: the RTS
  load once, the micro-batch program G times, the update once), less the
  programs' own Streaming-Memory copies (priced here instead, from the counted bytes),
  split into compute and collectives (all-gathers, reduce-scatters,
  all-reduces over the IPU-Links);
* its loads and stores: per IPU bytes at the streaming rate
  (:func:`~ipu_jax.phased.streaming.transfer_cycles`) plus a host sync per
  remote copy: one each way for the weights and optimizer state, one per
  micro-batch each way for the activations (streamed inside the loop).

How transfers overlap compute, by scheme (exposed = what the step waits for):

* ``serial``: load, compute, store, phase after phase: all exposed.
* ``serial`` with I/O tiles (``PhasedLayout.io_tiles`` or the target's
  ``io_tiles_per_ipu``): the next phase's loads run under this phase's
  compute, as the host I/O model overlaps host transfers with the loop
  (``lowering/host_io.py``); stores stay exposed.
* ``ping_pong``: while one IPU group computes phase k the other stores
  phase k - 1's results and loads phase k + 1's weights and activations;
  a slot lasts the longer of the two, and the groups sync at each swap
  (``IPUTarget.ipu_sync_cycles`` over all the run's IPUs).

Only the first load and the last store of the step are exposed in full under
ping-pong; what a slot's transfers exceed its compute by is exposed, shared
among them in proportion to their cycles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ipu_jax.phased.streaming import PhaseTraffic, transfer_cycles

__all__ = ["COLLECTIVE_OPS", "activation_gather_cycles", "PhaseEstimate", "PhasedEstimate", "program_cycles", "compose"]

# Ops whose steps move data between IPUs over the IPU-Links.
COLLECTIVE_OPS = frozenset({
    "psum", "pmax", "pmin", "psum_invariant", "all_gather", "all_gather_invariant",
    "reduce_scatter", "all_to_all", "ppermute", "pbroadcast", "cross_replica_sum",
    "cross_replica_mean", "cross_replica_reduce_scatter", "cross_replica_all_gather"})


def program_cycles(profile) -> tuple[float, float]:
  """``(compute, collectives)`` cycles of one run of ``profile``, its remote copies left out."""
  collectives = float(sum(s.total_cycles * s.executions for s in profile.steps
                          if s.op in COLLECTIVE_OPS))
  streaming = float(profile.streaming.cycles) if profile.streaming is not None else 0.0
  return float(profile.total_cycles) - streaming - collectives, collectives


@dataclasses.dataclass
class PhaseEstimate:
  """One phase execution of a step (cycles per replica; bytes per IPU).

  Attributes:
    name, index, direction, group, kind: which phase, forward or backward,
      on which IPU group, of which kind.
    compute_cycles: its program's cycles less collectives and remote copies.
    collective_cycles: its program's IPU-Link collectives.
    load_bytes, store_bytes: Streaming-Memory bytes per IPU.
    streaming_cycles: those bytes at the streaming rate.
    exposed_streaming_cycles: what of them the step waits for.
    sync_cycles: host syncs opening its loads and stores (and ping-pong swaps).
    traffic: the byte counts by what moves (:class:`PhaseTraffic`).
    peak_bytes_per_ipu: In-Processor Memory one IPU holds at this phase's peak.
  """

  name: str
  index: int
  direction: str
  group: int
  kind: int
  compute_cycles: float
  collective_cycles: float
  load_bytes: int
  store_bytes: int
  streaming_cycles: float
  exposed_streaming_cycles: float
  sync_cycles: float
  traffic: PhaseTraffic
  peak_bytes_per_ipu: int = 0

  @property
  def overlapped_streaming_cycles(self) -> float:
    return self.streaming_cycles - self.exposed_streaming_cycles

  @property
  def busy_cycles(self) -> float:
    return self.compute_cycles + self.collective_cycles


def _overlap_slots(n: int, mode: str, io_tiles: bool) -> list:
  """For each compute slot k, the transfers under it: ``(execution, "load"|"store")``."""
  slots = []
  for k in range(n):
    under = []
    if mode == "ping_pong":
      if k > 0:
        under.append((k - 1, "store"))
      if k + 1 < n:
        under.append((k + 1, "load"))
    elif io_tiles and k + 1 < n:
      under.append((k + 1, "load"))
    slots.append(under)
  return slots


def _exposed(busy, loads, stores, mode: str, io_tiles: bool) -> np.ndarray:
  """Exposed streaming cycles of each execution under the scheme."""
  n = len(busy)
  transfer = {"load": np.asarray(loads, float), "store": np.asarray(stores, float)}
  exposed = transfer["load"] + transfer["store"]
  for k, under in enumerate(_overlap_slots(n, mode, io_tiles)):
    if not under:
      continue
    total = sum(transfer[d][j] for j, d in under)
    spill = max(0.0, total - busy[k])
    for j, d in under:
      hidden = transfer[d][j] - (spill * transfer[d][j] / total if total else 0.0)
      exposed[j] -= hidden
  return exposed


def _transfers(t: PhaseTraffic, micro_batches: int) -> int:
  """Remote copies (each opened by a host sync) of one phase execution: the
  weights and optimizer state each way once; the activations once per
  micro-batch each way (loaded and stored inside the micro-batch loop)."""
  state_in = t.weights_load + t.optimizer_load > 0
  state_out = t.weights_store + t.optimizer_store > 0
  return int(state_in) + int(state_out) + micro_batches * (
      int(t.activations_load > 0) + int(t.activations_store > 0))


def activation_gather_cycles(t: PhaseTraffic, layout, target) -> float:
  """IPU-Link cycles of re-assembling RTS-sharded activations (``rts_activations``).

  After each load of a micro-batch's activation shard (``1/tp`` of it on each
  IPU) the TP group all-gathers it: each IPU receives the other ``tp - 1``
  shards over its IPU-Links (``IPUTarget.ipu_link_bytes_per_second``, the
  flat rate the lowering prices a collective at without a system) and the
  group syncs (``IPUTarget.ipu_sync_cycles`` over ``tp`` IPUs) once per
  micro-batch (a micro-batch's loaded shards gathered in one step).
  """
  tp = layout.tp
  if not layout.rts_activations or tp == 1 or not t.activations_load:
    return 0.0
  moved = (tp - 1) * t.activations_load / target.ipu_link_bytes_per_cycle
  return float(moved + layout.batch_serialisation * target.ipu_sync_cycles(tp))


def compose(traffic: list, figures: list, layout, target, peaks=None) -> list:
  """Per-execution estimates of one step.

  Args:
    traffic: :class:`PhaseTraffic` per execution, in order.
    figures: ``(compute, collectives)`` cycles per execution.
    layout: the :class:`~ipu_jax.phased.PhasedLayout`.
    target: the per-IPU target.
    peaks: per execution, In-Processor bytes per IPU at its peak.
  """
  io_tiles = layout.io_tiles or target.io_tiles_per_ipu > 0
  figures = [(c, k + activation_gather_cycles(t, layout, target))
             for (c, k), t in zip(figures, traffic)]
  busy = [c + k for c, k in figures]
  loads = [transfer_cycles(t.load_bytes, target) for t in traffic]
  stores = [transfer_cycles(t.store_bytes, target) for t in traffic]
  exposed = _exposed(busy, loads, stores, layout.mode, io_tiles)
  swap = target.replace(num_ipus=max(layout.num_ipus, 1)).ipu_sync_cycles() \
      if layout.mode == "ping_pong" else 0.0
  rows = []
  g = layout.batch_serialisation
  for k, t in enumerate(traffic):
    syncs = target.sync_cycles_host * _transfers(t, g) + swap
    rows.append(PhaseEstimate(
        t.name, t.index, t.direction, t.group, t.kind, figures[k][0], figures[k][1],
        t.load_bytes, t.store_bytes, loads[k] + stores[k], float(max(exposed[k], 0.0)),
        float(syncs), t, int(peaks[k]) if peaks is not None else 0))
  return rows


@dataclasses.dataclass
class PhasedEstimate:
  """A phased training step, estimated without running it.

  Attributes:
    phases: :class:`PhaseEstimate` per execution, in step order.
    layout: the :class:`~ipu_jax.phased.PhasedLayout`.
    target: the per-IPU target.
    per_ipu_peak_bytes: In-Processor Memory of the busiest IPU at its peak.
    streaming_memory_bytes_per_ipu: Streaming Memory the fullest IPU holds.
    fits: both fit (no tile over its SRAM, Streaming Memory within capacity).
    programs_lowered: distinct programs lowered (independent of the layer count).
    lower_seconds: wall time lowering them took.
    samples_per_step: samples one step trains on (all replicas).
    peak_rss_bytes: the host process's peak resident memory after lowering.
  """

  phases: list
  layout: Any
  target: Any
  per_ipu_peak_bytes: int
  streaming_memory_bytes_per_ipu: int
  fits: bool
  programs_lowered: int = 0
  lower_seconds: float = 0.0
  samples_per_step: int = 0
  peak_rss_bytes: int = 0

  @property
  def breakdown(self) -> dict:
    """Cycles of the step by what they are: compute, collectives, streaming, sync."""
    return {"compute": float(sum(p.compute_cycles for p in self.phases)),
            "collectives": float(sum(p.collective_cycles for p in self.phases)),
            "streaming": float(sum(p.exposed_streaming_cycles for p in self.phases)),
            "sync": float(sum(p.sync_cycles for p in self.phases))}

  @property
  def step_cycles(self) -> float:
    return float(sum(self.breakdown.values()))

  @property
  def step_seconds(self) -> float:
    return self.target.cycles_to_seconds(self.step_cycles)

  @property
  def streaming_bytes_per_step(self) -> int:
    """Bytes one IPU moves to and from Streaming Memory in a step."""
    return int(sum(p.load_bytes + p.store_bytes for p in self.phases))

  @property
  def streaming_cycles(self) -> float:
    return float(sum(p.streaming_cycles for p in self.phases))

  @property
  def samples_per_second(self) -> float:
    return self.samples_per_step / self.step_seconds if self.step_seconds else 0.0

  def summary(self) -> str:
    from ipu_jax.report.phases import phases_summary
    return phases_summary(self)

  def to_dict(self) -> dict:
    from ipu_jax.report.phases import phases_dict
    return phases_dict(self)
