"""``trace.json``: the program on a time axis, in Chrome's Trace Event Format.

For https://ui.perfetto.dev or ``chrome://tracing``. One process per IPU
(``pid`` = IPU index), threads ``tid`` 0 = sync, 1 = exchange, 2 = compute,
3 = program. The steps are laid out as they run
(:func:`~ipu_jax.report.timeline.timeline`): loops unrolled for their first
trips, the rest of each loop one summary span on the program thread, named
"N more iterations"; every loop occurrence is a span on the program thread
too, around its trips. Each step is a complete (``"ph": "X"``) span per
phase at the target's clock (a step whose executions run back to back in one
span, ``args.repeat`` > 1, is that many times as long). A counter track on
process 0 shows the bytes live on the device.
"""

from __future__ import annotations

from ipu_jax.report.data import ReportData
from ipu_jax.report.timeline import timeline

__all__ = ["trace_events"]

_TID_SYNC, _TID_EXCHANGE, _TID_COMPUTE, _TID_PROGRAM = 0, 1, 2, 3
_THREAD_NAMES = {_TID_SYNC: "sync", _TID_EXCHANGE: "exchange",
                 _TID_COMPUTE: "compute", _TID_PROGRAM: "program"}


def _metadata_events(num_ipus: int) -> list:
  events = []
  for ipu in range(num_ipus):
    events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": ipu,
                   "tid": 0, "args": {"name": f"IPU {ipu}"}})
    events.append({"name": "process_sort_index", "ph": "M", "ts": 0,
                   "pid": ipu, "tid": 0, "args": {"sort_index": ipu}})
    for tid, thread in _THREAD_NAMES.items():
      events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": ipu,
                     "tid": tid, "args": {"name": thread}})
      events.append({"name": "thread_sort_index", "ph": "M", "ts": 0,
                     "pid": ipu, "tid": tid, "args": {"sort_index": tid}})
  return events


def _step_events(data: ReportData, i: int, start: float, repeat: int,
                 us_per_cycle: float) -> list:
  """The sync, exchange and compute spans of one step on each of its IPUs."""
  steps = data.steps
  common = {"step": i, "op": steps.ops[i], "source": steps.sources[i],
            "executions": int(steps.executions[i]), "repeat": repeat}
  name = steps.names[i] or steps.ops[i] or f"step {i}"
  sync, exchange = float(steps.sync[i]), float(steps.exchange[i])
  t_exchange = start + sync * repeat
  t_compute = t_exchange + exchange * repeat
  exchange_args = dict(common, cycles=exchange,
                       bytes_in=int(steps.bytes_in[i]),
                       bytes_out=int(steps.bytes_out[i]),
                       ipu_link_bytes=int(steps.ipu_link_bytes[i]),
                       host_bytes=int(steps.host_bytes[i]))
  events = []
  for ipu in steps.ipus[i]:
    compute = float(steps.compute_per_ipu[i, ipu])
    compute_args = dict(common, cycles=compute,
                        cycles_slowest_tile=float(steps.compute_max[i]),
                        cycles_mean_tile=float(steps.compute_mean[i]),
                        flops=int(steps.flops[i]),
                        tiles_busy=int(steps.tiles_busy[i]))
    for tid, begin, cycles, args in (
        (_TID_SYNC, start, sync, dict(common, cycles=sync)),
        (_TID_EXCHANGE, t_exchange, exchange, exchange_args),
        (_TID_COMPUTE, t_compute, compute, compute_args)):
      if cycles > 0:
        events.append({"name": name, "cat": _THREAD_NAMES[tid], "ph": "X",
                       "ts": begin * us_per_cycle,
                       "dur": cycles * repeat * us_per_cycle,
                       "pid": int(ipu), "tid": tid, "args": args})
  return events


def _program_events(layout, num_ipus: int, us_per_cycle: float) -> list:
  """Loops and summarised trips, on every IPU's program thread."""
  events = []
  for kind, items in (("loop", layout.loops), ("summary", layout.summaries)):
    for item in items:
      args = {k: v for k, v in item.items() if k not in ("start", "cycles", "label")}
      for ipu in range(num_ipus):
        events.append({"name": item["label"], "cat": kind, "ph": "X",
                       "ts": item["start"] * us_per_cycle,
                       "dur": item["cycles"] * us_per_cycle,
                       "pid": ipu, "tid": _TID_PROGRAM, "args": args})
  return events


def trace_events(data: ReportData) -> list:
  """The trace's events: metadata, step phases, loops, live bytes."""
  us_per_cycle = 1e6 / data.target.clock_hz
  layout = timeline(data)
  events = _metadata_events(data.target.num_ipus)
  for i, start, repeat in zip(layout.step, layout.start, layout.repeat):
    events.extend(_step_events(data, i, start, repeat, us_per_cycle))
  events.extend(_program_events(layout, data.target.num_ipus, us_per_cycle))
  live = data.live
  for i, start in zip(layout.step, layout.start):
    if i < len(live):
      events.append({"name": "live memory", "ph": "C",
                     "ts": float(start * us_per_cycle), "pid": 0, "tid": 0,
                     "args": {"bytes": int(live[i])}})
  return events
