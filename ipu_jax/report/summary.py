"""The text summary of a report, laid out like Poplar's profile summary.

:class:`SummaryMixin` gives every report class ``summary()``: first the
headline (one execution's cycles as the system runs it, host I/O included
where the program streams data each iteration, and the device-only cycles
beside them), then the target, program structure, memory by category
(always-live vs not-always-live, on the peak tile), cycles by phase, FLOPs
against the target's peak, the top operations by cycles and by working
memory, the largest tensors, and an out-of-memory section listing the tiles
over their SRAM.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ipu_jax.arguments import check_count
from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.lowering.profile import MEMORY_CATEGORIES
from ipu_jax.lowering import memory_hints
from ipu_jax.lowering.run_setup import RunSetup
from ipu_jax.lowering.scopes import costliest_scopes_table
from ipu_jax.lowering.tile_generators import HARDWARE_BITS_VERTEX
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.report.formatting import category_label
from ipu_jax.report.formatting import fmt_bytes
from ipu_jax.report.formatting import fmt_flops
from ipu_jax.report.formatting import fmt_int
from ipu_jax.report.formatting import fmt_seconds
from ipu_jax.report.formatting import ordered_categories
from ipu_jax.report.formatting import pct
from ipu_jax.report.formatting import short_source
from ipu_jax.report.formatting import text_table
from ipu_jax.report.formatting import tile_name
from ipu_jax.report.precision import number_formats_section
from ipu_jax.report.host_side import host_side_section
from ipu_jax.report.streaming import streaming_section
from ipu_jax.report.host_io import headline_line
from ipu_jax.report.host_io import host_io_section

__all__ = ["SummaryMixin"]


class SummaryMixin:
  """``summary()`` and its sections, over the numbers of a report class."""


  def summary(self, top: int = 10) -> str:
    """A Poplar-style profile summary.

    Args:
      top: how many operations and tensors to list.

    Returns:
      Multi-line text.
    """
    check_count("summary: top", top, least=0)
    sections = [
        # First what a user reads first: the step as the system runs it.
        [headline_line(self._step_totals(), self.target.clock_hz)],
        self._summary_run_setup(),
        self._summary_target(),
        self._summary_program(),
        self._summary_memory(),
        streaming_section(self._streaming_dict(), self.total_cycles, top),
        self._summary_cycles(),
        host_io_section(self._host_io_dict()),
        number_formats_section(self.number_formats, top),
        self._summary_cost_model(),
        self._summary_top_ops(top),
        self._summary_top_working_memory(top),
        self._summary_top_tensors(top),
        self._summary_scopes(),
        self._summary_fusion(top),
        host_side_section(self._host_side_dict()),
    ]
    sections = [section for section in sections if section]
    notes = self._summary_notes()
    if notes:
      sections.append(notes)
    if self.over_limit_tiles.size:
      sections.append(self._summary_out_of_memory())
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"

  def __str__(self) -> str:
    return self.summary()

  def __repr__(self) -> str:
    return (f"{type(self).__name__}(name={self.name!r}, "
            f"target={self.target.name!r}, cycles={self.total_cycles:,.0f}, "
            f"tiles_used={self.tiles_used})")

  def _summary_target(self) -> list:
    t = self.target
    return [
        "Target:",
        f"  Name:                  {t.name}",
        f"  Number of IPUs:        {t.num_ipus}",
        f"  Tiles per IPU:         {t.tiles_per_ipu:,}",
        f"  Total tiles:           {t.num_tiles:,}",
        f"  Memory per tile:       {fmt_bytes(t.bytes_per_tile)}",
        f"  Total memory:          {fmt_bytes(t.total_memory_bytes)}",
        f"  Clock:                 {t.clock_hz / 1e9:.3f} GHz",
    ]

  def _summary_program(self) -> list:
    steps = self._data.steps
    lines = [
        f"Program: {self.name}",
        f"  Tiles used:            {self.tiles_used:,} / "
        f"{self.target.num_tiles:,} "
        f"({pct(self.tiles_used, self.target.num_tiles)})",
        f"  Compute sets:          {self.num_compute_sets:,}",
        f"  Supersteps:            {self.num_supersteps:,} "
        f"({self.num_supersteps_executed:,} executed per run)",
        f"  Host round trips:      {self.host_round_trips:,}",
    ]
    fused = self._fusion_totals()
    if fused[0]:
      lines.append(f"  Fusion:                {fused[0]:,} elementwise ops fused into "
                   f"{fused[1]:,} compute sets, {fused[2]:,} syncs saved per run")
    random_line = self._random_bits_line()
    if random_line:
      lines.append(random_line)
    dead = self._dead_code_dict()
    if dead and dead["equations_removed"]:
      lines.append(f"  Dead code removed:     {dead['equations_removed']:,} equations "
                   f"({_counts_list(dead['by_primitive'])}), not lowered")
    folded = self._constant_folding_dict()
    if folded and folded["equations_folded"]:
      # lowering/constant_folding.py: computed on the host, as XLA and PopART do.
      lines.append(f"  Constant folding:      {folded['equations_folded']:,} equations folded "
                   f"({_counts_list(folded['by_primitive'])}), computed on the host")
    link = int(np.sum(steps.ipu_link_bytes * steps.executions))
    host = int(np.sum(steps.host_bytes * steps.executions))
    if link:
      lines.append(f"  IPU-Link traffic:      {fmt_bytes(link)}")
    if host:
      lines.append(f"  Host traffic:          {fmt_bytes(host)}")
    return lines

  def _random_bits_line(self) -> str:
    """Steps drawing ``jax.random``'s bits as ``jax.jit`` does, and their share.

    Threefry and Philox run as integer arithmetic on the tiles, where the chip
    would draw from its hardware generators (``random.mode = 'hardware'``,
    docs/number_formats.md#random-numbers); '' when no step does.
    """
    steps = self._data.steps
    prefix = vocab.vertex(vocab.RANDOM, "")[:-1]
    counter_based = [i for i, names in enumerate(steps.codelets)
                     if any(n.startswith(prefix) and n != HARDWARE_BITS_VERTEX for n in names)]
    draws_bits = any(steps.names[i] == "random_bits" or
                     steps.names[i].startswith("rng_bit_generator") for i in counter_based)
    if not draws_bits:  # keys alone (split, fold_in) are a few words
      return ""
    cycles = float(np.sum(steps.weighted_cycles[counter_based]))
    count = len(counter_based)
    return (f"  Random bits:           {count:,} step{'s' if count != 1 else ''}, "
            f"{pct(cycles, self.total_cycles)} of cycles (threefry as jax.jit draws them; "
            f"cfg.random.mode = 'hardware' draws them as the IPU's generators do)")

  def _summary_memory(self) -> list:
    data, target = self._data, self.target
    peak = data.peak
    total = int(peak.sum())
    lines = ["Memory:",
             f"  Total over device:     {fmt_bytes(total)} of "
             f"{fmt_bytes(target.total_memory_bytes)} "
             f"({pct(total, target.total_memory_bytes)}): the sum of each "
             f"tile's own peak"]
    if data.live.size:
      # The other reading of "device memory": all tiles at one moment.
      step = int(np.argmax(data.live))
      lines.append(f"  Device peak:           {fmt_bytes(int(data.live[step]))} live on "
                   f"all tiles at superstep {step} (tiles peak at different steps)")
    if peak.size:
      worst = int(np.argmax(peak))
      used = peak[peak > 0]
      lines += [
          f"  Peak tile:             {tile_name(worst, target)}: "
          f"{fmt_bytes(peak[worst])} of {fmt_bytes(data.tile_limit)} "
          f"({pct(peak[worst], data.tile_limit)})",
          f"  Mean per tile:         {fmt_bytes(peak.mean())} "
          f"(over used tiles: {fmt_bytes(used.mean() if used.size else 0)})",
          "  Worst tiles:           " + ", ".join(
              f"{tile_name(int(t), target)}: {int(peak[t]):,} B"
              for t in np.argsort(-peak, kind="stable")[:5]),
      ]
    lines += ["", "  By category (bytes at each tile's peak):"]
    lines += self._category_table()
    return lines

  def _category_table(self) -> list:
    data = self._data
    worst = int(np.argmax(data.peak)) if data.peak.size else 0
    ordered = ordered_categories(data.categories)
    groups = (
        ("Always-live", [c for c in ordered if c in ALWAYS_LIVE_CATEGORIES]),
        ("Not-always-live", [c for c in ordered if c in MEMORY_CATEGORIES
                             and c not in ALWAYS_LIVE_CATEGORIES]),
        ("Other", [c for c in ordered if c not in MEMORY_CATEGORIES]),
    )
    rows = []
    for title, categories in groups:
      if not categories:
        continue
      stacked = sum(data.categories[c] for c in categories)
      rows.append(self._category_row(title, stacked, worst))
      rows += [self._category_row("  " + category_label(c),
                                  data.categories[c], worst)
               for c in categories]
    rows.append(self._category_row("Total (peak)", data.peak, worst))
    return text_table(["Category", "Total", "Max tile", "Mean tile",
                   "On peak tile"], rows, indent="    ",
                  right=(False, True, True, True, True))

  @staticmethod
  def _category_row(label: str, per_tile: np.ndarray, worst: int) -> list:
    per_tile = np.asarray(per_tile)
    if not per_tile.size:
      return [label, "0", "0", "0", "0"]
    return [label, f"{int(per_tile.sum()):,}", f"{int(per_tile.max()):,}",
            f"{per_tile.mean():,.0f}", f"{int(per_tile[worst]):,}"]

  def _summary_cycles(self) -> list:
    total = self.total_cycles
    fraction = self.flops_fraction_of_peak
    seconds = self.estimated_seconds
    achieved = self.total_flops / seconds if seconds > 0 else 0.0
    return [
        "Cycles:",
        f"  Compute:               {fmt_int(self.compute_cycles):>16} "
        f"({pct(self.compute_cycles, total)})",
        f"  Exchange:              {fmt_int(self.exchange_cycles):>16} "
        f"({pct(self.exchange_cycles, total)})",
        f"  Sync:                  {fmt_int(self.sync_cycles):>16} "
        f"({pct(self.sync_cycles, total)})",
        f"  Total (device only):   {fmt_int(total):>16}",
        f"  Estimated time:        {fmt_seconds(seconds)} at "
        f"{self.target.clock_hz / 1e9:.3f} GHz",
        "",
        "FLOPs:",
        f"  Total:                 {fmt_flops(self.total_flops)}FLOP "
        f"({self.total_flops:,.0f})",
        f"  Achieved:              {fmt_flops(achieved)}FLOP/s",
        f"  Peak:                  {fmt_flops(self.peak_flops_per_second)}"
        f"FLOP/s ({self.flops_dtype})",
        f"  Fraction of peak:      {100.0 * fraction:.2f}%",
    ]

  def _summary_cost_model(self) -> list:
    """Which figures behind the cycles are calibrated and which are estimates."""
    model = self._data.cost_model
    if not model:
      return ["Cost model:", "  Version:               unknown (report written before "
              "cost-model versions)"]
    return [
        "Cost model:",
        f"  Version:               {model.get('version', 'unknown')}",
        "  Calibrated figures:    " + ", ".join(model.get("calibrated", [])),
        "  Estimates:             " + ", ".join(model.get("estimates", [])),
        "  (sources: ipu_jax.kernels.cost_model.FIGURE_SOURCES; checks: experiments/calibration.py)",
    ]

  def _summary_top_ops(self, top: int) -> list:
    rows = self.cycles_by_operation()
    total = self.total_cycles
    body = [[r["op"], short_source(r["source"]), str(r["steps"]),
             f"{r['executions']:,}", fmt_int(r["cycles"]),
             pct(r["cycles"], total)] for r in rows[:top]]
    title = f"Top operations by cycles ({min(top, len(rows))} of {len(rows)}):"
    if not body:
      return [title, "  (no supersteps)"]
    return [title] + text_table(
        ["Operation", "Source", "Steps", "Executions", "Cycles", "% total"],
        body, right=(False, False, True, True, True, True))

  def _summary_top_working_memory(self, top: int) -> list:
    peaks = sorted(self.temporary_memory_by_op().items(), key=lambda kv: -kv[1])
    peaks = [(op, b) for op, b in peaks if b > 0]
    title = (f"Top operations by working memory per tile ({min(top, len(peaks))} of "
             f"{len(peaks)}):")
    if not peaks:
      return [title, "  (none)"]
    body = [[op, f"{b:,}", pct(b, self.tile_limit)] for op, b in peaks[:top]]
    return [title] + text_table(["Operation", "Peak bytes", "% of tile"], body,
                            right=(False, True, True))

  def _summary_top_tensors(self, top: int) -> list:
    tensors = self.largest_tensors(top)
    title = (f"Top tensors by memory ({len(tensors)} of "
             f"{len(self._data.tensors)}):")
    if not tensors:
      return [title, "  (no tensors)"]
    body = [[t["name"], "x".join(str(d) for d in t["shape"]) or "()",
             t["dtype"], category_label(t["category"]),
             f"{t['total_bytes']:,}", str(t["tiles"]), t["op"] or "?",
             short_source(t["source"])] for t in tensors]
    return [title] + text_table(
        ["Tensor", "Shape", "Dtype", "Category", "Bytes", "Tiles", "Op",
         "Source"], body, right=(False, False, False, False, True, True))

  def _summary_run_setup(self) -> list:
    """How the program is run (a Keras-like program's builder says; saved in report.json)."""
    setup = self._run_setup_dict()
    if not setup:
      return []
    return ["Run setup:"] + [f"  {line}" for line in run_setup_lines(setup)]

  def _summary_scopes(self) -> list:
    """The costliest module paths, by cycles and by memory (none without scopes)."""
    if not any(self._data.steps.scopes):
      return []
    return costliest_scopes_table(None, depth=2, top=5, rows=self.by_scope(2)).splitlines()

  def _fusion_totals(self) -> tuple:
    """(operations fused, fused compute sets, syncs saved per run)."""
    steps = self._data.steps
    ops = sets = saved = 0
    for i, members in enumerate(steps.fused_ops):
      if members:
        ops += len(members)
        sets += 1
        saved += (len(members) - 1) * int(steps.executions[i])
    return ops, sets, saved

  def _summary_fusion(self, top: int) -> list:
    """Fused compute sets, most syncs saved first, with their member ops."""
    steps = self._data.steps
    rows = [(i, members) for i, members in enumerate(steps.fused_ops) if members]
    if not rows:
      return []
    rows.sort(key=lambda r: -(len(r[1]) - 1) * int(steps.executions[r[0]]))
    body = []
    for i, members in rows[:top]:
      sources = list(dict.fromkeys(short_source(src) for _, src in members if src))
      body.append([str(i), str(len(members)), f"{(len(members) - 1) * int(steps.executions[i]):,}",
                   _op_list([op for op, _ in members]), ", ".join(sources[:2])
                   + (" ..." if len(sources) > 2 else "")])
    lines = [f"Fused compute sets (top {min(top, len(rows))} of {len(rows)}, by syncs saved):"]
    lines += text_table(["Step", "Ops", "Syncs saved", "Operations", "Source"], body,
                        right=(True, True, True, False, False))
    return lines

  def _summary_notes(self) -> list:
    """Steps whose cost the lowering qualified (e.g. emulated float64)."""
    steps = self._data.steps
    counts = {}
    for i, notes in enumerate(steps.notes):
      for note in notes:
        entry = counts.setdefault(note, [0, steps.sources[i] or steps.names[i]])
        entry[0] += 1
    if not counts:
      return []
    lines = ["Cost notes:"]
    for note, (count, where) in counts.items():
      lines.append(f"  {note} ({count} step{'s' if count != 1 else ''}, first at {where})")
    return lines

  def _summary_out_of_memory(self, limit: int = 20) -> list:
    data, target = self._data, self.target
    over = self.over_limit_tiles
    order = over[np.argsort(-data.peak[over], kind="stable")]
    lines = [
        "!" * 72,
        f"OUT OF MEMORY: {len(over)} tile(s) over the limit of "
        f"{fmt_bytes(data.tile_limit)} per tile",
        "!" * 72,
    ]
    body = [[tile_name(int(t), target), f"{int(data.peak[t]):,}",
             f"{int(data.peak[t]) - data.tile_limit:,}",
             pct(data.peak[t], data.tile_limit)] for t in order[:limit]]
    lines += text_table(["Tile", "Bytes needed", "Over by", "% of SRAM"], body,
                    right=(False, True, True, True))
    if len(order) > limit:
      lines.append(f"  ... and {len(order) - limit} more tiles over the limit")
    if data.peak_tile_tensors:
      worst = tile_name(int(order[0]), target)
      lines += ["", f"  Largest tensors on {worst}:"]
      lines += text_table(
          ["Tensor", "Category", "Bytes", "Op", "Source"],
          [[t["name"], category_label(t["category"]), f"{t['bytes']:,}",
            t["op"] or "?", short_source(t["source"])]
           for t in data.peak_tile_tensors], indent="    ",
          right=(False, False, True))
    holdings = [memory_hints.Holding(t["name"], t["category"], int(t["bytes"]), t["op"] or "",
                                     t["source"] or "") for t in data.peak_tile_tensors]
    lines += ["", "  What may help:"]
    lines += memory_hints.hint_lines(holdings, int(data.peak[order[0]]) - data.tile_limit,
                                     indent="    ")
    return lines


def run_setup_lines(setup: dict) -> list:
  """The lines of a ``RunSetup`` saved as a dict (``report.json["run_setup"]``).

  Keys a later version added are ignored, so an older reader prints what it
  knows; a dict that is not a run setup is printed as its keys and values.
  """
  known = {f.name for f in dataclasses.fields(RunSetup)}
  values = {k: v for k, v in setup.items() if k in known}
  if "param_dtypes" in values:
    values["param_dtypes"] = tuple(values["param_dtypes"])
  try:
    return RunSetup(**values).summary_lines()
  except TypeError:  # required fields missing
    return [f"{k}: {v}" for k, v in setup.items()]


def _counts_list(counts: dict, width: int = 60) -> str:
  """``{"dot_general": 2, "add": 1}`` -> ``"dot_general x2, add"``, cut at ``width``."""
  text = ", ".join(op if n == 1 else f"{op} x{n}" for op, n in counts.items())
  return text if len(text) <= width else text[:width - 3].rstrip(", ") + "..."


def _op_list(ops, width: int = 60) -> str:
  """``["mul", "mul", "add"]`` -> ``"mul x2, add"``, cut at ``width``."""
  runs = []
  for op in ops:
    if runs and runs[-1][0] == op:
      runs[-1][1] += 1
    else:
      runs.append([op, 1])
  text = ", ".join(op if n == 1 else f"{op} x{n}" for op, n in runs)
  return text if len(text) <= width else text[:width - 3].rstrip(", ") + "..."
