"""The program on a time axis: each superstep's execution at its cycle offset.

The profile holds each step once with its execution count; on the chip a
loop's body runs once per trip, one trip after another. :func:`timeline`
walks the control program (:func:`~ipu_jax.report.program_tree.control_shape`)
and lays the steps out in the order they run, at the cycle each starts:

* a ``repeat`` loop is unrolled for its first ``unroll`` trips; its
  remaining trips become one *summary* span ("N more iterations"), as long
  as they would take, so the time axis stays exact;
* once ``max_spans`` spans are laid out, further loops are summarised whole
  (a program's top-level steps are always laid out);
* a step the control shape cannot place in a loop (a flat shape: a pipeline
  slot profile, an old report) runs its executions back to back in one span
  (``repeat`` > 1);
* a ``repeat_while`` body and the branches of an ``if`` / ``switch`` are laid
  out once each, as the totals count them.

Each span's length is the step's cycles (sync + exchange + slowest tile's
compute) times its ``repeat``; the last span ends at the report's total
cycles. ``trace.json`` and ``report.html``'s execution trace both draw this.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipu_jax.report.data import ReportData
from ipu_jax.report.program_tree import control_shape

__all__ = ["Timeline", "timeline", "UNROLL", "MAX_SPANS"]

UNROLL = 4          # trips of each loop laid out one by one
MAX_SPANS = 20_000  # spans laid out before further loops are summarised


@dataclasses.dataclass
class Timeline:
  """Spans of steps, and the loops and summaries around them.

  Attributes:
    step: per span, its step index.
    start: per span, its first cycle.
    repeat: per span, executions of the step run back to back in it.
    loops: one dict per loop occurrence laid out: ``start``, ``cycles``,
      ``label``, ``steps`` ([first, last]), ``iterations``, ``unrolled``
      (trips laid out step by step) and ``depth`` (nesting).
    summaries: one dict per summarised stretch: ``start``, ``cycles``,
      ``label``, ``steps``, ``iterations`` (trips it stands for), ``depth``.
    total_cycles: where the last span ends.
  """

  step: list
  start: list
  repeat: list
  loops: list
  summaries: list
  total_cycles: float

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


class _Layout:
  """The walk over the control shape, keeping the clock."""

  def __init__(self, data: ReportData, unroll: int, max_spans: int):
    steps = data.steps
    self.cycles = np.asarray(steps.cycles_per_execution, np.float64)
    self.executions = np.asarray(steps.executions, np.int64)
    self.weighted = self.cycles * self.executions
    self.unroll, self.max_spans = unroll, max_spans
    self.clock = 0.0
    self.step, self.start, self.repeat = [], [], []
    self.loops, self.summaries = [], []

  def walk(self, node: dict, outer: int, depth: int) -> None:
    kind = node["kind"]
    if kind == "steps":
      self._steps(node, outer)
    elif kind == "repeat":
      self._repeat(node, outer, depth)
    else:
      for child in node.get("children", []):
        self.walk(child, outer, depth)

  def _steps(self, node: dict, outer: int) -> None:
    first, count = int(node["first"]), int(node["count"])
    for i in range(first, first + count):
      times = max(1, int(round(self.executions[i] / max(outer, 1))))
      self.step.append(i)
      self.start.append(self.clock)
      self.repeat.append(times)
      self.clock += float(self.cycles[i]) * times

  def _repeat(self, node: dict, outer: int, depth: int) -> None:
    first, count = int(node["first"]), int(node["count"])
    iterations = int(node["iterations"])
    inner = outer * max(iterations, 1)
    per_trip = float(self.weighted[first:first + count].sum()) / max(inner, 1)
    begin, shown = self.clock, 0
    while shown < min(iterations, self.unroll) and (
        len(self.step) + count <= self.max_spans):
      for child in node.get("children", []):
        self.walk(child, inner, depth + 1)
      shown += 1
    rest = iterations - shown
    if rest > 0:
      self.summaries.append({
          "start": self.clock, "cycles": per_trip * rest,
          "label": (f"{rest:,} more iteration{'s' if rest > 1 else ''} "
                    f"of repeat ×{iterations:,}"),
          "steps": [first, first + count - 1], "iterations": rest,
          "depth": depth})
      self.clock += per_trip * rest
    self.loops.append({
        "start": begin, "cycles": self.clock - begin,
        "label": f"repeat ×{iterations:,}", "steps": [first, first + count - 1],
        "iterations": iterations, "unrolled": shown, "depth": depth})


def timeline(data: ReportData, unroll: int = UNROLL,
             max_spans: int = MAX_SPANS) -> Timeline:
  """The report's steps laid out in the order they run (module docstring).

  Args:
    data: the report's data.
    unroll: trips of each loop laid out one by one (at least 1).
    max_spans: spans laid out before further loops are summarised whole.

  Returns:
    A :class:`Timeline`.
  """
  if unroll < 1:
    raise ValueError(f"unroll must be at least 1, got {unroll}.")
  layout = _Layout(data, unroll, max_spans)
  layout.walk(control_shape(data), 1, 0)
  return Timeline(step=layout.step, start=layout.start, repeat=layout.repeat,
                  loops=layout.loops, summaries=layout.summaries,
                  total_cycles=layout.clock)
