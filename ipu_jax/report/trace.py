"""``trace.json``: the supersteps as a Chrome Trace Event Format document.

One process per IPU (``pid`` = IPU index), threads ``tid`` 0 = sync,
1 = exchange, 2 = compute; one complete (``"ph": "X"``) span per superstep
phase, laid end to end at the target's clock. A step that executes ``n``
times is drawn once, ``n`` times as long. A counter track on process 0 shows
the bytes live on the device.
"""

from __future__ import annotations


import numpy as np

from ipu_jax.report.data import ReportData

__all__ = ["trace_events"]

_TID_SYNC, _TID_EXCHANGE, _TID_COMPUTE = 0, 1, 2
_THREAD_NAMES = {_TID_SYNC: "sync", _TID_EXCHANGE: "exchange",
                 _TID_COMPUTE: "compute"}


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


def trace_events(data: ReportData) -> list:
  """Complete events for every superstep phase, laid end to end."""
  steps = data.steps
  us_per_cycle = 1e6 / data.target.clock_hz
  starts = np.concatenate([[0.0], np.cumsum(steps.weighted_cycles)])
  events = _metadata_events(data.target.num_ipus)
  for i in range(len(steps)):
    executions = int(steps.executions[i])
    common = {"step": i, "op": steps.ops[i], "source": steps.sources[i],
              "executions": executions}
    name = steps.names[i] or steps.ops[i] or f"step {i}"
    sync, exchange = float(steps.sync[i]), float(steps.exchange[i])
    t_sync = starts[i]
    t_exchange = t_sync + sync * executions
    t_compute = t_exchange + exchange * executions
    exchange_args = dict(common, cycles=exchange,
                         bytes_in=int(steps.bytes_in[i]),
                         bytes_out=int(steps.bytes_out[i]),
                         ipu_link_bytes=int(steps.ipu_link_bytes[i]),
                         host_bytes=int(steps.host_bytes[i]))
    for ipu in steps.ipus[i]:
      compute = float(steps.compute_per_ipu[i, ipu])
      compute_args = dict(common, cycles=compute,
                          cycles_slowest_tile=float(steps.compute_max[i]),
                          cycles_mean_tile=float(steps.compute_mean[i]),
                          flops=int(steps.flops[i]),
                          tiles_busy=int(steps.tiles_busy[i]))
      for tid, start, cycles, args in (
          (_TID_SYNC, t_sync, sync, dict(common, cycles=sync)),
          (_TID_EXCHANGE, t_exchange, exchange, exchange_args),
          (_TID_COMPUTE, t_compute, compute, compute_args)):
        if cycles > 0:
          events.append({"name": name, "cat": _THREAD_NAMES[tid], "ph": "X",
                         "ts": start * us_per_cycle,
                         "dur": cycles * executions * us_per_cycle,
                         "pid": int(ipu), "tid": tid, "args": args})
  for i, live in enumerate(data.live[:len(steps)]):
    events.append({"name": "live memory", "ph": "C",
                   "ts": float(starts[i] * us_per_cycle), "pid": 0, "tid": 0,
                   "args": {"bytes": int(live)}})
  return events
