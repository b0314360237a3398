"""The host-I/O section of a report: a looping program's transfers and their overlap.

For a program with an on-device loop over host data (``lowering/host_io.py``):
host bytes in and out per execution (after the output mode), the per-iteration
load, store, I/O-to-compute exchange and compute cycles, the execution's
cycles with its transfers (as the I/O tiles' strategy schedules them, and
with every transfer in turn), and the fraction of compute time overlapped
with I/O (0 without I/O tiles). ``report.json`` holds it under ``"host_io"``
(null for programs without such a loop); the summary prints it as its
"Host I/O" section.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["host_io_to_json", "host_io_section"]

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
