"""Pipeline schedules: which stage runs which micro-batch in each time slot.

A step of ``G`` micro-batches over ``N`` stages (stage ``k`` on IPU
``ipus[k]``) is a sequence of time slots. In a slot every IPU runs the passes
the schedule gives its stages -- one after another when several stages share
the IPU (``device_mapping=[0, 1, 2, 3, 0]``), so their cycles add -- then
the values that cross stages go over the IPU-Links and all IPUs sync; a slot
lasts as long as its busiest IPU plus its copies and the sync. The slot's
copies are costed together (copies sharing an IPU-Link share its rate:
:func:`ipu_jax.pipelining.links.slot_copy_cycles`). After
the last slot each IPU updates the weights its stages own. ``G`` counts
stages, not IPUs: five stages on four IPUs need a Grouped ``G`` that is a
multiple of 10, as TF-IPU asks.

* ``Grouped`` (TF-IPU's default): stage ``k`` runs the forward pass of
  micro-batch ``m`` in slot ``k + m`` and its backward pass in slot
  ``2N - 2 - k + m`` (the last stage runs both in one slot), so in the
  steady state every IPU runs one forward and one backward pass per slot.
  ``G + 2N - 2`` slots; with balanced stages the step takes
  ``(G + N - 1)`` steady slots, an efficiency of ``G / (G + N - 1)``.
* ``Interleaved``: one pass per IPU per slot, forward at ``k + 2m`` and
  backward at ``2N - 1 - k + 2m``, alternating; a slot costs the larger of
  a forward and a backward pass, but fewer activations wait.
* ``Sequential`` (sharded execution): one pass at a time, micro-batch by
  micro-batch; only one IPU is busy at any time.

The stash depth of stage ``k`` (activation sets waiting for their backward
pass when a forward pass starts) is measured on the schedule itself; it comes
out as TF-IPU's ``2 (N - 1 - k)`` for Grouped, ``N - 1 - k`` for Interleaved
and 0 for Sequential.

The pipeline efficiency is the busy fraction of the IPUs the pipeline uses
(``len(set(ipus))``), not of IPUs ``0 .. max(ipus)``: a pipeline on IPUs 1
and 2 is as efficient as the same pipeline on IPUs 0 and 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["SCHEDULES", "Pass", "Slot", "slots", "stash_depths",
           "minimum_accumulation", "Timeline", "simulate"]

SCHEDULES = ("Grouped", "Interleaved", "Sequential")


@dataclasses.dataclass(frozen=True)
class Pass:
  """One pass of one stage on one micro-batch ('forward' or 'backward')."""

  stage: int
  kind: str
  micro_batch: int


Slot = list  # of Pass, in the order an IPU runs them


def minimum_accumulation(schedule: str, num_stages: int) -> int:
  """The ``L`` that G must be a multiple of (and at least), as TF-IPU checks.

  ``2N`` for Grouped training, ``N`` for Interleaved, 1 for Sequential.
  """
  return {"Grouped": 2 * num_stages, "Interleaved": num_stages, "Sequential": 1}[schedule]


def slots(schedule: str, num_stages: int, accumulation: int) -> list:
  """The passes of each time slot of one step."""
  n, g = num_stages, accumulation
  if schedule == "Sequential":
    out = []
    for m in range(g):
      out += [[Pass(k, "forward", m)] for k in range(n)]
      out += [[Pass(k, "backward", m)] for k in reversed(range(n))]
    return out
  if schedule == "Grouped":
    fwd = lambda k, m: k + m
    bwd = lambda k, m: 2 * n - 2 - k + m
  elif schedule == "Interleaved":
    fwd = lambda k, m: k + 2 * m
    bwd = lambda k, m: 2 * n - 1 - k + 2 * m
  else:
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}.")
  count = bwd(0, g - 1) + 1
  out = [[] for _ in range(count)]
  for k in range(n):
    for m in range(g):
      out[fwd(k, m)].append(Pass(k, "forward", m))
  for k in range(n):
    for m in range(g):
      out[bwd(k, m)].append(Pass(k, "backward", m))
  return out


def stash_depths(schedule_slots: list, num_stages: int) -> list:
  """Per stage, the most activation sets waiting when a forward pass starts.

  A set of micro-batch ``mm < m`` waits when ``m``'s forward pass starts at
  ``t`` if its own forward ran before ``t`` and its backward runs at ``t`` or
  later; counted for every ``m`` at once (``G x G`` per stage, so a
  G = 2,040 step is counted in well under a second).
  """
  fwd, bwd = {}, {}
  for t, slot in enumerate(schedule_slots):
    for p in slot:
      (fwd if p.kind == "forward" else bwd)[(p.stage, p.micro_batch)] = t
  depths = []
  for k in range(num_stages):
    ms = sorted(m for (s, m) in fwd if s == k)
    if not ms:
      depths.append(0)
      continue
    f = np.array([fwd[(k, m)] for m in ms])
    b = np.array([bwd.get((k, m), -1) for m in ms])
    depths.append(_stage_depth(np.array(ms), f, b))
  return depths


def _stage_depth(m: np.ndarray, f: np.ndarray, b: np.ndarray) -> int:
  """The most sets waiting at one stage's forward starts (``m`` ascending).

  Every schedule here runs a stage's passes in micro-batch order: with the
  forward and backward slots non-decreasing, the sets waiting when ``m``
  starts are those before it whose backward is at or after ``f[m]``, a
  ``searchsorted`` (G log G); otherwise every pair is compared (G x G).
  """
  has_bwd = b >= 0
  if np.all(np.diff(f) > 0) and np.all(has_bwd) and np.all(np.diff(b) >= 0):
    done = np.minimum(np.searchsorted(b, f, side="left"), np.arange(len(m)))
    return int((np.arange(len(m)) - done).max())
  waiting = ((m[None, :] < m[:, None]) & (f[None, :] < f[:, None])
             & (b[None, :] >= f[:, None]))
  return int(waiting.sum(axis=1).max())


@dataclasses.dataclass
class Timeline:
  """The simulated step: spans per IPU and the totals reports show.

  Attributes:
    spans: ``(ipu, name, kind, micro_batch, start, cycles[, stage])``; kind
      is 'forward', 'backward', 'copy', 'sync', 'all-reduce' or 'weight
      update'; passes, all-reduces and updates end with their stage.
    total_cycles: the step, first slot to last weight update.
    busy_cycles: ``[max(ipus) + 1]`` cycles each IPU spends running its
      passes and weight updates (indexed by IPU; unused IPUs stay 0).
    ramp_up_cycles, steady_cycles, ramp_down_cycles: the slots before every
      stage is busy, while every stage is busy, and after.
    steady_slot_cycles: the longest steady-state slot (the steady rate is one
      micro-batch per such slot).
    link_bytes: bytes over IPU-Links in the step.
    copy_cycles_per_slot: the IPU-Link copies of each slot, in cycles.
    ipus: the IPUs the pipeline uses, ascending.
  """

  spans: list
  total_cycles: float
  busy_cycles: np.ndarray
  ramp_up_cycles: float
  steady_cycles: float
  ramp_down_cycles: float
  steady_slot_cycles: float
  link_bytes: int
  slot_cycles: float = 0.0
  num_micro_batches: int = 0
  copy_cycles_per_slot: list = dataclasses.field(default_factory=list)
  ipus: tuple = ()

  @property
  def rate_efficiency(self) -> float:
    """The step's micro-batch rate over the steady state's (weight update excluded).

    For balanced Grouped stages this is ``G / (G + N - 1)``.
    """
    return (self.num_micro_batches * self.steady_slot_cycles / self.slot_cycles
            if self.slot_cycles else 0.0)

  @property
  def efficiency(self) -> float:
    """Fraction of the used IPUs' time spent busy."""
    used = list(self.ipus) if self.ipus else list(range(len(self.busy_cycles)))
    total = self.total_cycles * len(used)
    return float(self.busy_cycles[used].sum() / total) if total else 0.0


def simulate(schedule_slots: list, ipus: list, forward: list, backward: list,
             copies_forward: list, copies_backward: list, sync: float, weight_update: list,
             all_reduce: list, copy_cost) -> Timeline:
  """Lay the slots end to end and time them.

  Args:
    schedule_slots: from :func:`slots`.
    ipus: the IPU of each stage (an IPU may run several stages).
    forward, backward: cycles of each stage's forward / backward pass.
    copies_forward: per stage, the ``(src_ipu, dst_ipu, nbytes)`` copies
      after its forward pass (its outputs to the stages that read them).
    copies_backward: per stage, the copies after its backward pass (its
      input gradients back to the stages that made the inputs).
    sync: cycles of the sync that ends each slot.
    weight_update: cycles of each stage's weight update.
    all_reduce: cycles of each stage's gradient all-reduce over replicas.
    copy_cost: ``copy_cost(copies) -> cycles`` of all of one slot's copies
      (e.g. ``functools.partial(links.slot_copy_cycles, target)``).
  """
  num_ipus = max(ipus) + 1
  num_stages = len(ipus)
  busy = np.zeros(num_ipus)
  spans = []
  now = 0.0
  link = 0
  slot_cycles, full, slot_copies = [], [], []
  for slot in schedule_slots:
    work = np.zeros(num_ipus)
    copies = []
    for p in slot:
      ipu = ipus[p.stage]
      cycles = forward[p.stage] if p.kind == "forward" else backward[p.stage]
      # Passes of stages sharing an IPU run one after another: their cycles add.
      spans.append((ipu, f"{p.kind[0].upper()}{p.micro_batch}", p.kind, p.micro_batch,
                    now + work[ipu], cycles, p.stage))
      work[ipu] += cycles
      copies += (copies_forward if p.kind == "forward" else copies_backward)[p.stage]
    link += sum(nbytes for src, dst, nbytes in copies if src != dst)
    busy += work
    longest = float(work.max())
    copy = float(copy_cost(copies)) if copies else 0.0
    slot_copies.append(copy)
    for ipu in set(ipus[p.stage] for p in slot):
      if copy:
        spans.append((ipu, "copy", "copy", -1, now + longest, copy))
      if sync:
        spans.append((ipu, "sync", "sync", -1, now + longest + copy, sync))
    duration = longest + copy + sync
    slot_cycles.append(duration)
    full.append(len({(p.stage, p.kind) for p in slot}) == len(slot) and
                {p.stage for p in slot} == set(range(num_stages)))
    now += duration
  slot_cycles = np.asarray(slot_cycles)
  full = np.asarray(full, bool)
  steady = np.nonzero(full)[0]
  if steady.size:
    ramp_up = float(slot_cycles[:steady[0]].sum())
    steady_total = float(slot_cycles[steady[0]:steady[-1] + 1].sum())
    ramp_down = float(slot_cycles[steady[-1] + 1:].sum())
    steady_slot = float(slot_cycles[steady].max())
  else:
    ramp_up, steady_total, ramp_down = 0.0, float(slot_cycles.sum()), 0.0
    steady_slot = float(slot_cycles.max(initial=0.0))
  end = now
  free = {}  # IPU -> when it is free: stages sharing an IPU update one after another
  for k in range(num_stages):
    ipu = ipus[k]
    start = free.get(ipu, now)
    if all_reduce[k]:
      spans.append((ipu, "all-reduce", "all-reduce", -1, start, all_reduce[k], k))
      start += all_reduce[k]
    if weight_update[k]:
      spans.append((ipu, "WU", "weight update", -1, start, weight_update[k], k))
    busy[ipu] += weight_update[k]
    free[ipu] = start + weight_update[k]
    end = max(end, free[ipu])
  micro_batches = len({p.micro_batch for slot in schedule_slots for p in slot})
  return Timeline(spans, end, busy, ramp_up, steady_total, ramp_down + (end - now),
                  steady_slot, int(link), float(slot_cycles.sum()), micro_batches,
                  slot_copies, tuple(sorted(set(ipus))))
