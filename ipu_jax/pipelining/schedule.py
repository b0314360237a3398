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

__all__ = ["SCHEDULES", "Pass", "Slot", "Slots", "slots", "stash_depths",
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


class Slots(list):
  """The slots of one step (a list of :data:`Slot`), with what :func:`simulate`
  reads of them found once: the split search simulates a hundred candidates'
  steps over the same slots (2,048 of them at G = 2,040).

  Attributes:
    compositions: the distinct ``(stage, kind)`` sequences of the slots, in
      order of first appearance.
    composition_of: ``[slots]`` the index of each slot's composition.
    num_micro_batches: the distinct micro-batches the slots run.
  """

  def __init__(self, passes):
    super().__init__(passes)
    found, index = {}, []
    for slot in self:
      index.append(found.setdefault(tuple((p.stage, p.kind) for p in slot), len(found)))
    self.compositions = list(found)
    self.composition_of = np.asarray(index, np.int64)
    self.num_micro_batches = len({p.micro_batch for slot in self for p in slot})


def slots(schedule: str, num_stages: int, accumulation: int) -> Slots:
  """The passes of each time slot of one step (read-only: :class:`Slots`)."""
  n, g = num_stages, accumulation
  if schedule == "Sequential":
    out = []
    for m in range(g):
      out += [[Pass(k, "forward", m)] for k in range(n)]
      out += [[Pass(k, "backward", m)] for k in reversed(range(n))]
    return Slots(out)
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
  return Slots(out)


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


class _Composition:
  """What every slot with one sequence of ``(stage, kind)`` passes shares.

  The micro-batch numbers are the only thing that tells the slots of a
  steady state apart, so a Grouped step of five stages holds 17 compositions
  whatever its G (2,048 slots at G = 2,040): each one's work, copies and
  their cost are found once here rather than once per slot (the split
  search lays out a hundred candidates' steps).
  """

  def __init__(self, key: tuple, ipus: list, cycles: dict, copies: dict, sync: float,
               copy_cost, num_ipus: int, num_stages: int):
    work = np.zeros(num_ipus)
    self.offsets = []  # per pass: (ipu, its start within the slot, cycles)
    copied = []
    for stage, kind in key:
      ipu = ipus[stage]
      # Passes of stages sharing an IPU run one after another: their cycles add.
      self.offsets.append((ipu, work[ipu], cycles[kind][stage]))
      work[ipu] += cycles[kind][stage]
      copied += copies[kind][stage]
    self.work = work
    self.link = sum(nbytes for src, dst, nbytes in copied if src != dst)
    self.longest = float(work.max())
    self.copy = float(copy_cost(copied)) if copied else 0.0
    self.duration = self.longest + self.copy + sync
    self.ipus = list(set(ipus[stage] for stage, _ in key))
    self.full = (len(set(key)) == len(key) and
                 {stage for stage, _ in key} == set(range(num_stages)))


def _compositions(schedule_slots: Slots, make) -> list:
  """The composition of each slot, each distinct one made once by ``make(key)``."""
  made = [make(key) for key in schedule_slots.compositions]
  return [made[i] for i in schedule_slots.composition_of.tolist()]


def _slot_spans(schedule_slots: list, comps: list, starts: np.ndarray, sync: float) -> list:
  """The passes', copies' and syncs' spans of every slot, in slot order."""
  spans = []
  for slot, comp, now in zip(schedule_slots, comps, starts.tolist()):
    for p, (ipu, offset, cycles) in zip(slot, comp.offsets):
      spans.append((ipu, f"{p.kind[0].upper()}{p.micro_batch}", p.kind, p.micro_batch,
                    now + offset, cycles, p.stage))
    for ipu in comp.ipus:
      if comp.copy:
        spans.append((ipu, "copy", "copy", -1, now + comp.longest, comp.copy))
      if sync:
        spans.append((ipu, "sync", "sync", -1, now + comp.longest + comp.copy, sync))
  return spans


def simulate(schedule_slots: list, ipus: list, forward: list, backward: list,
             copies_forward: list, copies_backward: list, sync: float, weight_update: list,
             all_reduce: list, copy_cost, *, with_spans: bool = True) -> Timeline:
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
      (e.g. ``functools.partial(links.slot_copy_cycles, target)``); called
      once per distinct sequence of ``(stage, kind)`` passes in a slot, so it
      must depend on the copies alone.
    with_spans: False leaves ``Timeline.spans`` empty (every total is the
      same), for callers that read the totals only.
  """
  if not isinstance(schedule_slots, Slots):
    schedule_slots = Slots(schedule_slots)
  num_ipus = max(ipus) + 1
  num_stages = len(ipus)
  cycles = {"forward": forward, "backward": backward}
  copies = {"forward": copies_forward, "backward": copies_backward}
  comps = _compositions(schedule_slots, lambda key: _Composition(
      key, ipus, cycles, copies, sync, copy_cost, num_ipus, num_stages))
  slot_cycles = np.array([c.duration for c in comps], dtype=float)
  # Sequential sums (cumsum), in slot order: the same floats as adding slot by slot.
  ends = np.cumsum(slot_cycles)
  starts = np.concatenate([[0.0], ends[:-1]])
  now = float(ends[-1]) if len(ends) else 0.0
  busy = (np.cumsum(np.stack([c.work for c in comps]), axis=0)[-1].copy() if comps
          else np.zeros(num_ipus))
  link = sum(c.link for c in comps)
  spans = _slot_spans(schedule_slots, comps, starts, sync) if with_spans else []
  full = np.asarray([c.full for c in comps], bool)
  steady = np.nonzero(full)[0]
  if steady.size:
    ramp_up = float(slot_cycles[:steady[0]].sum())
    steady_total = float(slot_cycles[steady[0]:steady[-1] + 1].sum())
    ramp_down = float(slot_cycles[steady[-1] + 1:].sum())
    steady_slot = float(slot_cycles[steady].max())
  else:
    ramp_up, steady_total, ramp_down = 0.0, float(slot_cycles.sum()), 0.0
    steady_slot = float(slot_cycles.max(initial=0.0))
  end, update_spans = _weight_updates(ipus, weight_update, all_reduce, busy, now)
  if with_spans:
    spans += update_spans
  return Timeline(spans, end, busy, ramp_up, steady_total, ramp_down + (end - now),
                  steady_slot, int(link), float(slot_cycles.sum()),
                  schedule_slots.num_micro_batches,
                  [c.copy for c in comps], tuple(sorted(set(ipus))))


def _weight_updates(ipus: list, weight_update: list, all_reduce: list, busy: np.ndarray,
                    now: float) -> tuple:
  """``(the step's end, spans)`` of the all-reduces and updates after the last slot.

  Adds each update to ``busy``; stages sharing an IPU update one after another.
  """
  spans, end = [], now
  free = {}  # IPU -> when it is free
  for k, ipu in enumerate(ipus):
    start = free.get(ipu, now)
    if all_reduce[k]:
      spans.append((ipu, "all-reduce", "all-reduce", -1, start, all_reduce[k], k))
      start += all_reduce[k]
    if weight_update[k]:
      spans.append((ipu, "WU", "weight update", -1, start, weight_update[k], k))
    busy[ipu] += weight_update[k]
    free[ipu] = start + weight_update[k]
    end = max(end, free[ipu])
  return end, spans
