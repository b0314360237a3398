"""The host-I/O section of a report: a looping program's transfers and their overlap.

For a program with an on-device loop over host data (``lowering/host_io.py``):
host bytes in and out per execution (after the output mode), the per-iteration
load, store, I/O-to-compute exchange and compute cycles, the execution's
cycles with its transfers (as the I/O tiles' strategy schedules them, and
with every transfer in turn), and the fraction of compute time overlapped
with I/O (0 without I/O tiles). ``report.json`` holds it under ``"host_io"``
(null for programs without such a loop); the summary prints it as its
"Host I/O" section.

It also gives the report its headline (:func:`step_totals`,
:func:`headline_line`): one execution as the system runs it. Where the
program streams data from the host each iteration that is ``step_cycles``
above, host transfers included; otherwise the device cycles. The device-only
figure (``total_cycles``) stands beside it, so a change that trades device
cycles for host time (I/O tiles) reads the right way round.
"""

from __future__ import annotations

from typing import Optional

from ipu_jax.report.formatting import fmt_int
from ipu_jax.report.formatting import fmt_seconds

__all__ = ["host_io_to_json", "host_io_section", "step_totals", "headline_line"]

_LABELS = {
    "num_io_tiles": "I/O tiles per IPU", "strategy": "Strategy", "output_mode": "Output mode",
}


def host_io_to_json(profile) -> Optional[dict]:
  """The ``"host_io"`` entry of ``report.json`` from a ``ProgramProfile``."""
  host_io = getattr(profile, "host_io", None)
  return None if host_io is None else host_io.as_dict()


def host_io_section(document: Optional[dict]) -> list:
  """The summary's "Host I/O" lines from the ``"host_io"`` entry (none if null)."""
  if not document:
    return []
  d = document
  io = (f"{d['num_io_tiles']} I/O tiles per IPU, {d['strategy']}" if d["num_io_tiles"]
        else "no I/O tiles (transfers hold the compute tiles)")
  return [
      "Host I/O:",
      f"  Loop:                  {d['outer']} x {d['inner']} iteration(s), {io}; "
      f"output mode {d['output_mode']}",
      f"  Host bytes in / out:   {d['host_bytes_in']:,} / {d['host_bytes_out']:,} per execution",
      f"  Per iteration:         load {d['load_cycles']:,.0f}, "
      f"store {d['store_cycles']:,.0f} (x {d.get('stores', 0)} per execution), "
      f"I/O exchange {d['io_exchange_cycles']:,.0f}, compute {d['compute_cycles']:,.0f} cycles",
      f"  Execution with I/O:    {d['step_cycles']:,.0f} cycles "
      f"(every transfer in turn: {d['serial_cycles']:,.0f})",
      f"  Compute overlapped with I/O: {100 * d['overlapped_fraction']:.1f}%",
  ]


def step_totals(device_cycles: float, document: Optional[dict], clock_hz: float) -> dict:
  """The headline keys of ``report.json["totals"]``.

  Args:
    device_cycles: the tile program's cycles per run (``total_cycles``).
    document: the ``"host_io"`` entry (None: no on-device loop over host data).
    clock_hz: the target's tile clock.

  Returns:
    ``step_cycles`` (the execution with its host transfers when the program
    streams data each iteration, else ``device_cycles``), ``step_seconds``,
    ``step_includes_host_io`` and ``device_cycles``.
  """
  streams = bool(document)
  step = float(document["step_cycles"]) if streams else float(device_cycles)
  return {"step_cycles": step, "step_seconds": step / clock_hz,
          "step_includes_host_io": streams, "device_cycles": float(device_cycles)}


def headline_line(totals: dict, clock_hz: float) -> str:
  """The summary's first line: the step, and what it includes, from :func:`step_totals`."""
  step = totals["step_cycles"]
  timing = f"{fmt_int(step)} cycles ({fmt_seconds(totals['step_seconds'])} at " \
           f"{clock_hz / 1e9:.3f} GHz)"
  if totals["step_includes_host_io"]:
    return (f"Step (host I/O included): {timing}; device only: "
            f"{fmt_int(totals['device_cycles'])} cycles (total_cycles)")
  return f"Step (device only, no data streamed each iteration): {timing}"
