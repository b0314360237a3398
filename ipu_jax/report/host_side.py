"""The report's "Host side" section: host-link traffic and host time.

Two kinds of figure, kept apart and labelled:

* **Modelled** (the emulated system): bytes crossing the host link per run
  (the program's arguments in, its results out, and its stream copies and
  printed tensors), their time at the target's host-link bandwidth
  (``IPUTarget.host_link_bytes_per_second``, the model ``lowering/analysis.py``
  prices stream copies with), and the host syncs per run (the program's
  round trips plus one per stream copy executed).
* **Measured on this machine** (:class:`ipu_jax.host_time.HostTimes`):
  tracing, lowering, the executable cache, XLA's compile and the calls' wall
  time. These are the emulator's host costs, not an IPU's, and do not enter
  the device cycles.

``report.json`` holds it under ``"host_side"``; the summary prints it as
"Host side"; report.html shows it as a small table.
"""

from __future__ import annotations

from typing import Optional

import html

from ipu_jax.report.formatting import fmt_bytes, fmt_int

__all__ = ["host_side_to_json", "host_side_section", "host_side_rows", "host_side_html"]


def host_side_to_json(profile) -> Optional[dict]:
  """The ``"host_side"`` entry of report.json, or None for a program with no record."""
  host = getattr(profile, "host_side", None)
  if host is None:
    return None
  record = host.times
  target = profile.target
  stream_bytes = int(sum(int(s.host_bytes) * int(s.executions) for s in profile.steps))
  stream_syncs = int(sum(int(s.executions) for s in profile.steps if s.host_bytes))
  in_bytes, out_bytes = int(host.argument_bytes), int(host.result_bytes)
  total = in_bytes + out_bytes + stream_bytes
  return {
      "modelled": {
          "argument_bytes": in_bytes, "result_bytes": out_bytes,
          "stream_bytes": stream_bytes, "bytes_per_run": total,
          "host_link_bytes_per_second": float(target.host_link_bytes_per_second),
          "transfer_seconds_per_run": total / float(target.host_link_bytes_per_second),
          "host_syncs_per_run": int(profile.host_round_trips) + stream_syncs,
      },
      "measured_on_this_machine": record.as_dict(),
  }


def _seconds(value: float) -> str:
  return f"{value * 1e3:,.1f} ms" if value < 1 else f"{value:,.2f} s"


def _short_seconds(value: float) -> str:
  return f"{value * 1e9:,.0f} ns" if value < 1e-6 else f"{value * 1e6:,.1f} us"


def host_side_rows(document: Optional[dict]) -> list:
  """``[(label, value)]`` rows of the section (the summary's and the page's)."""
  if not document:
    return []
  model, measured = document["modelled"], document["measured_on_this_machine"]
  rows = [
      ("Host-link bytes per run (model)",
       f"{fmt_bytes(model['bytes_per_run'])} (arguments {fmt_bytes(model['argument_bytes'])}, "
       f"results {fmt_bytes(model['result_bytes'])}, streams {fmt_bytes(model['stream_bytes'])})"),
      ("Host-link time per run (model)",
       f"{_short_seconds(model['transfer_seconds_per_run'])} at "
       f"{model['host_link_bytes_per_second'] / 1e9:,.1f} GB/s"),
      ("Host syncs per run (model)", fmt_int(model["host_syncs_per_run"])),
      ("Executable cache", measured["cache"]),
      ("Compiled because", measured["compiled_because"]),
      ("Tracing (this machine)", _seconds(measured["tracing_seconds"])),
      ("Lowering (this machine)", _seconds(measured["lowering_seconds"])),
      ("Cache read/write (this machine)", _seconds(measured["cache_seconds"])),
      ("HLO emission (this machine)", _seconds(measured["hlo_seconds"])),
      ("XLA compile (this machine)",
       f"{_seconds(measured['compile_seconds'])} "
       f"({fmt_int(measured['compile_cache_hits'])} executables from JAX's cache)"),
      ("First call (this machine)", _seconds(measured["first_call_seconds"])),
  ]
  calls = measured["calls"]
  if calls:
    rows.append(("Later calls (this machine)",
                 f"{fmt_int(calls)}, {_seconds(measured['call_seconds'] / calls)} each"))
  return rows


def host_side_section(document: Optional[dict]) -> list:
  """Summary lines of the section (``[]`` without a record)."""
  rows = host_side_rows(document)
  if not rows:
    return []
  width = max(len(label) for label, _ in rows) + 2
  return (["Host side (model: the emulated host link; this machine: measured here, "
           "not device cycles):"]
          + [f"  {label + ':':<{width}}{value}" for label, value in rows])


def host_side_html(document: Optional[dict]) -> str:
  """The page's "Host side" section: one table, rendered here (no script)."""
  rows = host_side_rows(document)
  if not rows:
    return ""
  cells = "".join(f"<tr><td>{html.escape(label)}</td><td>{html.escape(value)}</td></tr>"
                  for label, value in rows)
  return ("\n<section id=\"host-side\">\n  <h2>Host side</h2>\n"
          "  <p class=\"hint\">Model: the emulated host link. This machine: wall-clock time "
          "measured here (the emulator's host costs), not device cycles.</p>\n"
          f"  <div class=\"table-wrap\"><table>{cells}</table></div>\n</section>\n")
