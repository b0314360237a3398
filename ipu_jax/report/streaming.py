"""The streaming-memory section of a report.

What a program keeps in Streaming Memory (remote buffers and offloaded
state, bytes per IPU of one replica, by buffer) and what moving it costs per
run: the copies between tiles and streaming memory, their bytes, executions
and cycles (see ``lowering/remote.py`` for the cost model). ``report.json``
holds it under ``"streaming"`` (absent or null when the program uses none);
the summary prints it as its "Streaming memory" section.
"""

from __future__ import annotations

from typing import Optional

from ipu_jax.report.formatting import fmt_bytes, fmt_int, pct, text_table

__all__ = ["streaming_to_json", "streaming_section"]


def streaming_to_json(profile) -> Optional[dict]:
  """The ``"streaming"`` entry of ``report.json`` from a ``ProgramProfile``."""
  streaming = getattr(profile, "streaming", None)
  if streaming is None:
    return None
  copies = []
  for step in profile.steps:
    if step.streaming_bytes:
      copies.append({
          "name": step.name, "bytes": int(step.streaming_bytes),
          "direction": "to_streaming" if int(step.exchange_bytes_out.sum()) else "from_streaming",
          "executions": int(step.executions), "cycles": float(step.total_cycles)})
  return {
      "capacity_per_ipu": int(streaming.capacity_per_ipu),
      "bytes_per_ipu": [int(b) for b in streaming.bytes_per_ipu],
      "total_bytes": int(streaming.total_bytes),
      "bytes_moved_per_run": int(streaming.bytes_moved),
      "copy_cycles_per_run": float(streaming.cycles),
      "copies_per_run": int(streaming.copies),
      "buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype,
                   "repeats": int(b.repeats), "bytes": b.total_bytes,
                   "bytes_per_ipu": [int(x) for x in b.bytes_per_ipu]}
                  for b in streaming.buffers],
      "copies": copies,
  }


def streaming_section(document: Optional[dict], total_cycles: float, top: int = 10) -> list:
  """Summary lines of the streaming entry (``[]`` when there is none)."""
  if not document:
    return []
  capacity = document["capacity_per_ipu"]
  lines = ["Streaming memory (one replica):"]
  for ipu, held in enumerate(document["bytes_per_ipu"]):
    lines.append(f"  IPU {ipu}:                 {fmt_bytes(held)} of {fmt_bytes(capacity)} "
                 f"({pct(held, capacity)})")
  moved, cycles = document["bytes_moved_per_run"], document["copy_cycles_per_run"]
  lines.append(f"  Moved per run:         {fmt_bytes(moved)} in "
               f"{fmt_int(document['copies_per_run'])} copies")
  lines.append(f"  Copy cycles per run:   {fmt_int(cycles)} ({pct(cycles, total_cycles)} of "
               "the program)")
  buffers = sorted(document["buffers"], key=lambda b: -b["bytes"])
  if buffers:
    lines.append("")
    lines.append(f"  Buffers ({min(top, len(buffers))} of {len(buffers)}):")
    rows = [[b["name"], "x".join(str(d) for d in b["shape"]) or "scalar", b["dtype"],
             str(b["repeats"]), fmt_int(b["bytes"])] for b in buffers[:top]]
    lines += text_table(["Buffer", "Shape", "Dtype", "Repeats", "Bytes"], rows, indent="    ",
                        right=(False, False, False, True, True))
  copies = sorted(document["copies"], key=lambda c: -c["cycles"] * c["executions"])
  if copies:
    lines.append("")
    lines.append(f"  Copies ({min(top, len(copies))} of {len(copies)}):")
    rows = [[c["name"], c["direction"].replace("_", " "), fmt_int(c["bytes"]),
             fmt_int(c["executions"]), fmt_int(c["cycles"] * c["executions"])]
            for c in copies[:top]]
    lines += text_table(["Copy", "Direction", "Bytes", "Executions", "Cycles"], rows,
                        indent="    ", right=(False, False, True, True, True))
  return lines
