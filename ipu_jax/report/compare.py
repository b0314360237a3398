"""Comparing two reports: what changed in memory and cycles, as text.

:func:`compare_reports` lines up memory by category (device total and peak
tile), cycles by phase, estimated time, FLOPs, and cycles and working memory
by operation, each with its delta and % change. The HTML comparison page
(:func:`ipu_jax.report.html.comparison_html`) shows the same numbers as
charts.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.arguments import check_count
from ipu_jax.report.formatting import category_label
from ipu_jax.report.formatting import fmt_int
from ipu_jax.report.formatting import fmt_seconds
from ipu_jax.report.formatting import ordered_categories
from ipu_jax.report.formatting import text_table
from ipu_jax.report.precision import number_formats_comparison
from ipu_jax.report.precision import number_formats_comparison_rows
from ipu_jax.report.reports import ReportBase
from ipu_jax.report.reports import as_report

__all__ = ["compare_reports", "comparison_to_dict"]

def _change(a: float, b: float) -> str:
  if a == b:
    return "0.0%"
  if a == 0:
    return "new"
  return f"{100.0 * (b - a) / abs(a):+.1f}%"


def _compare_row(label: str, a: float, b: float) -> list:
  return [label, fmt_int(a), fmt_int(b), f"{b - a:+,.0f}", _change(a, b)]


def _memory_rows(a: ReportBase, b: ReportBase, reduce) -> list:
  cats_a, cats_b = a.memory_by_category, b.memory_by_category
  names = ordered_categories({**cats_a, **cats_b})

  def value(categories, name):
    array = categories.get(name)
    return float(reduce(array)) if array is not None and array.size else 0.0

  rows = [_compare_row("  " + category_label(c), value(cats_a, c),
                       value(cats_b, c)) for c in names]
  peak_a = float(reduce(a.memory_per_tile)) if a.memory_per_tile.size else 0.0
  peak_b = float(reduce(b.memory_per_tile)) if b.memory_per_tile.size else 0.0
  return rows + [_compare_row("  Total (peak)", peak_a, peak_b)]


def _step_label(a: ReportBase, b: ReportBase) -> str:
  """What the compared steps include (each side says when they differ)."""
  kinds = [("host I/O included" if r.step_includes_host_io else "device only") for r in (a, b)]
  return f" ({kinds[0]})" if kinds[0] == kinds[1] else f" (A: {kinds[0]}; B: {kinds[1]})"


def compare_reports(a, b, top: int = 20) -> str:
  """What changed from report ``a`` to report ``b``, side by side.

  Args:
    a, b: :class:`Report`, :class:`SavedReport`, ``ProgramProfile`` or a
      report path, in any mix.
    top: how many operations to list (those with the most cycles).

  Returns:
    Multi-line text: memory by category (total over the device and on the
    peak tile), the step (host I/O included where a program streams data
    each iteration), cycles by phase, estimated time, and cycles by
    operation, each with the delta and % change; then, when either report has number-format
    telemetry (loss scale, FP8 per-tensor scales), both side by side.
  """
  check_count("compare_reports: top", top, least=0)
  a, b = as_report(a), as_report(b)
  header = ["", f"A: {a.name}", f"B: {b.name}", "Delta (B-A)", "Change"]
  right = (False, True, True, True, True)
  rows = [["Memory, total over device (bytes)", "", "", "", ""]]
  rows += _memory_rows(a, b, np.sum)
  rows += [["Memory, peak tile (bytes)", "", "", "", ""]]
  rows += _memory_rows(a, b, np.max)
  rows += [_compare_row("  Tiles used", a.tiles_used, b.tiles_used),
           _compare_row("  Tiles over the limit", a.over_limit_tiles.size,
                        b.over_limit_tiles.size)]
  rows += [["Cycles (Total: device only)", "", "", "", ""],
           _compare_row("  Step" + _step_label(a, b), a.step_cycles, b.step_cycles),
           _compare_row("  Compute", a.compute_cycles, b.compute_cycles),
           _compare_row("  Exchange", a.exchange_cycles, b.exchange_cycles),
           _compare_row("  Sync", a.sync_cycles, b.sync_cycles),
           _compare_row("  Total", a.total_cycles, b.total_cycles),
           ["  Estimated time", fmt_seconds(a.estimated_seconds),
            fmt_seconds(b.estimated_seconds),
            fmt_seconds(b.estimated_seconds - a.estimated_seconds),
            _change(a.estimated_seconds, b.estimated_seconds)],
           _compare_row("  Supersteps executed", a.num_supersteps_executed,
                        b.num_supersteps_executed),
           _compare_row("  FLOPs", a.total_flops, b.total_flops)]
  ops_a, ops_b = a.cycles_by_op(), b.cycles_by_op()
  ops = sorted(set(ops_a) | set(ops_b),
               key=lambda op: -max(ops_a.get(op, 0.0), ops_b.get(op, 0.0)))
  rows += [[f"Cycles by operation ({min(top, len(ops))} of {len(ops)})",
            "", "", "", ""]]
  rows += [_compare_row("  " + op, ops_a.get(op, 0.0), ops_b.get(op, 0.0))
           for op in ops[:top]]
  mem_a, mem_b = a.temporary_memory_by_op(), b.temporary_memory_by_op()
  mem_ops = sorted((op for op in set(mem_a) | set(mem_b)
                    if mem_a.get(op, 0) or mem_b.get(op, 0)),
                   key=lambda op: -max(mem_a.get(op, 0), mem_b.get(op, 0)))
  rows += [[f"Working memory per tile by operation, bytes ({min(top, len(mem_ops))} "
            f"of {len(mem_ops)})", "", "", "", ""]]
  rows += [_compare_row("  " + op, mem_a.get(op, 0), mem_b.get(op, 0))
           for op in mem_ops[:top]]
  rows += number_formats_comparison_rows(
      number_formats_comparison(a.number_formats, b.number_formats))
  title = [f"Comparing A = {a.name} ({a.target.name}, {a.target.num_ipus} "
           f"IPU(s), {a.target.num_tiles:,} tiles) with B = {b.name} "
           f"({b.target.name}, {b.target.num_ipus} IPU(s), "
           f"{b.target.num_tiles:,} tiles)", ""]
  return "\n".join(title + text_table(header, rows, indent="", right=right)) + "\n"


def comparison_to_dict(a, b) -> dict:
  """The comparison as a JSON document (``python -m ipu_jax.report A B --json``).

  Args:
    a, b: as :func:`compare_reports` takes them.

  Returns:
    ``{"a": name, "b": name, "totals": {key: {"a", "b", "delta"}},
    "number_formats": None | {...}}``: the totals of ``report.json`` side by
    side, and the number formats as
    :func:`~ipu_jax.report.precision.number_formats_comparison` gives them.
  """
  a, b = as_report(a), as_report(b)
  totals_a, totals_b = a.to_dict()["totals"], b.to_dict()["totals"]
  totals = {}
  for key in totals_a:
    va, vb = totals_a[key], totals_b.get(key)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (va, vb))
    totals[key] = {"a": va, "b": vb, "delta": vb - va if numeric else None}
  return {"a": a.name, "b": b.name, "totals": totals,
          "number_formats": number_formats_comparison(a.number_formats, b.number_formats)}
