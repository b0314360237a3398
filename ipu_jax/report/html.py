"""``report.html``: the interactive view of a report, and the comparison page.

What PopVision Graph Analyser shows, in one self-contained HTML file that
opens from disk with no server and no network:

* **Program tree**: the control program -- loops with their repeat counts,
  conditionals, runs of supersteps -- each node with its total and self
  cycles; a run's steps open to their details.
* **Memory**: a map of every tile of every IPU (colour = bytes at the tile's
  peak; tile numbers in the cells or on the rows; the peak and the selected
  tile marked). Clicking a tile lists what lives on it by category, and
  draws its own liveness: its bytes at every superstep by category, with
  the tensors live at its peak.
* **Liveness**: not-always-live bytes on the device at every superstep
  (drag to zoom, range slider below); clicking a superstep lists the tensors
  live there.
* **Execution**: the supersteps on a time axis (cycles), one lane per IPU,
  each split into sync / exchange / compute, each loop's first trips drawn
  and the rest summarised (:mod:`~ipu_jax.report.timeline`); below, cycles
  per superstep by index. Clicking a superstep shows its tile balance and
  details; the operations table sorts by any column.
* **Vertex types** and **Exchanges**: cycles, vertices and code bytes per
  codelet; per exchange its bytes sent, received and over IPU-Links, and a
  heatmap of the bytes each tile sends (or receives).
* **Number formats** (only when telemetry was recorded): the FP8 log2
  scales per tensor kind, the loss scale over steps, a table per tensor.

:func:`comparison_html` writes the page of two reports side by side
(``python -m ipu_jax.report A B --html out.html``), with changes highlighted.

The charts are plotly.js, embedded from the ``plotly`` pip package's own
bundled ``plotly.min.js`` (an optional dependency: ``pip install
ipu-jax[plots]``); without it :meth:`Report.save` writes ``HTML_MISSING.txt``
instead. The page's own scripts (``assets/report.js``, ``assets/views.js``)
only turn the report's numbers into plotly figures, tables and panels.

The numbers travel as one JSON document (:func:`report_payload`) in a
``<script type="application/json">`` tag; per-tile arrays of tensors and
compute sets, and each step's exchange and scratch bytes, are run-length
encoded over tiles (``[first, count, value]``), so a 1,472-tile program stays
a few hundred kilobytes of data; a tile's liveness and the exchange heatmap
are expanded from those runs in the page when shown.
"""

from __future__ import annotations

import functools
import html
import importlib.util
import json
import math
import os
from typing import Optional

import numpy as np

from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.report.data import tile_runs
from ipu_jax.report.formatting import CATEGORY_COLOURS
from ipu_jax.report.formatting import category_label
from ipu_jax.report.formatting import ordered_categories
from ipu_jax.report.host_side import host_side_html
from ipu_jax.report.precision import number_formats_comparison
from ipu_jax.report.precision import number_formats_comparison_rows
from ipu_jax.report.timeline import timeline

__all__ = ["HTML_FILE", "HTML_MISSING_FILE", "plotly_js", "report_payload",
           "report_html", "comparison_html", "write_report_html",
           "write_comparison_html", "write_page"]

HTML_FILE = "report.html"
# Bars of the page's execution trace, over all IPU lanes and phases (trace.json
# lays out more): plotly draws about this many smoothly.
HTML_MAX_BARS = 24_000
# Runs of per-tile exchange and scratch bytes the page embeds (about 12 bytes
# each: the main job's 3,800 take 45 KB); beyond this the page leaves them out.
HTML_MAX_TILE_RUNS = 100_000
HTML_MISSING_FILE = "HTML_MISSING.txt"

_ASSETS = os.path.join(os.path.dirname(__file__), "assets")

_MISSING_NOTE = (
    "The interactive report (report.html) needs plotly, whose pip package "
    "bundles the plotly.js the page embeds; it is not installed.\n"
    "Install it with\n\n    pip install ipu-jax[plots]\n\nor\n\n"
    "    pip install plotly\n\nthen save the report again, or run\n\n"
    "    python -m ipu_jax.report REPORT_DIR --html REPORT_DIR/report.html\n")


@functools.lru_cache(maxsize=1)
def plotly_js() -> Optional[str]:
  """The text of the plotly.min.js bundled with the plotly pip package.

  Found without importing plotly (its Python side is not needed and slow to
  import).

  Returns:
    The script, or None when plotly is not installed.
  """
  spec = importlib.util.find_spec("plotly")
  if spec is None or not spec.submodule_search_locations:
    return None
  for folder in spec.submodule_search_locations:
    path = os.path.join(folder, "package_data", "plotly.min.js")
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        return f.read()
  return None


def _asset(name: str) -> str:
  with open(os.path.join(_ASSETS, name), encoding="utf-8") as f:
    return f.read()


def _tile_grid(tiles_per_ipu: int) -> dict:
  """Columns x rows of one IPU's tile map: about 4:1, like the die's tiles."""
  columns = max(1, min(tiles_per_ipu, math.ceil(math.sqrt(4 * tiles_per_ipu))))
  return {"columns": columns, "rows": math.ceil(tiles_per_ipu / columns)}


def _operations(report) -> list:
  """``cycles_by_operation`` rows with each (op, source)'s working memory."""
  steps = report.data.steps
  memory = {}
  for op, source, peak in zip(steps.ops, steps.sources, steps.temporary_peak):
    memory[(op, source)] = max(memory.get((op, source), 0), int(peak))
  rows = report.cycles_by_operation()
  for row in rows:
    row["memory"] = memory.get((row["op"], row["source"]), 0)
  return rows


def report_payload(report) -> dict:
  """Everything the HTML view draws, as one JSON-serialisable document.

  Args:
    report: a :class:`~ipu_jax.report.Report` or
      :class:`~ipu_jax.report.SavedReport`.

  Returns:
    A dict: ``name``, ``target``, ``totals`` (as in report.json), ``grid``
    (tile map layout), ``memory`` (per-tile arrays, categories, peak step),
    ``liveness`` (not-always-live bytes per step), ``steps`` (columns),
    ``tile_cycles`` (per step, runs of busy tiles; None if unknown),
    ``tensors``, ``operations``, ``number_formats`` (loss-scale and FP8
    telemetry as in report.json, or None), ``program_tree`` (as
    ``Report.program_tree()``), ``timeline`` (the steps on a time axis,
    :mod:`~ipu_jax.report.timeline`), ``codelets`` (per vertex type) and
    ``tile_exchange`` (per step, runs over tiles of bytes received, sent and
    of scratch; None if unknown): the per-tile liveness and the exchange
    heatmap are computed from these runs in the page, on demand.
  """
  data = report.data
  document = report.to_dict()
  target = data.target
  return {
      "name": data.name,
      "target": {"name": target.name, "num_ipus": target.num_ipus,
                 "tiles_per_ipu": target.tiles_per_ipu,
                 "num_tiles": target.num_tiles,
                 "bytes_per_tile": target.bytes_per_tile,
                 "clock_hz": target.clock_hz},
      "totals": document["totals"],
      "grid": _tile_grid(target.tiles_per_ipu),
      **_memory_payload(data),
      "steps": _steps_payload(data.steps),
      "tile_cycles": _tile_cycle_runs(data),
      "tensors": [{key: tensor.get(key) for key in
                   ("name", "shape", "dtype", "category", "total_bytes", "op",
                    "source", "live_from", "live_to", "placement")}
                  for tensor in data.tensors],
      "operations": _operations(report),
      "number_formats": document["number_formats"],
      "program_tree": document["program_tree"],
      "timeline": timeline(
          data, max_spans=max(200, HTML_MAX_BARS // (3 * target.num_ipus))).as_dict(),
      "codelets": document.get("codelets") or [],
      "tile_exchange": _bounded_tile_exchange(data.tile_exchange),
  }


def _memory_payload(data) -> dict:
  """The page's ``memory`` (per tile, by category) and ``liveness`` entries."""
  categories = ordered_categories(data.categories)
  always_live = int(sum(int(data.categories[c].sum()) for c in categories
                        if c in ALWAYS_LIVE_CATEGORIES))
  return {
      "memory": {
          "tile_limit": data.tile_limit,
          "peak": data.peak.tolist(),
          "peak_step": data.peak_step.tolist(),
          "categories": [{"key": c, "label": category_label(c),
                          "colour": CATEGORY_COLOURS.get(c, "#17becf"),
                          "always_live": c in ALWAYS_LIVE_CATEGORIES,
                          "bytes": data.categories[c].tolist()}
                         for c in categories],
      },
      "liveness": {
          "always_live_bytes": always_live,
          "not_always_live": np.maximum(data.live - always_live, 0).tolist(),
      },
  }


def _steps_payload(steps) -> dict:
  """The page's per-step columns."""
  return {
      "name": steps.names, "op": steps.ops, "source": steps.sources,
      "compute": steps.compute_max.tolist(),
      "compute_mean": steps.compute_mean.tolist(),
      "compute_per_ipu": steps.compute_per_ipu.tolist(),
      "ipus": [list(map(int, ipus)) for ipus in steps.ipus],
      "exchange": steps.exchange.tolist(), "sync": steps.sync.tolist(),
      "executions": steps.executions.tolist(),
      "flops": steps.flops.tolist(),
      "tiles_busy": steps.tiles_busy.tolist(),
      "vertices": steps.vertices.tolist(),
      "bytes_in": steps.bytes_in.tolist(),
      "bytes_out": steps.bytes_out.tolist(),
      "ipu_link_bytes": steps.ipu_link_bytes.tolist(),
      "working_memory": steps.temporary_peak.tolist(),
      "codelets": [list(c) for c in steps.codelets] or [[] for _ in steps.names],
  }


def _tile_cycle_runs(data) -> Optional[list]:
  """Per step, runs of busy tiles with their cycles (None when not recorded)."""
  if data.tile_cycles is None:
    return None
  runs = []
  for cycles in data.tile_cycles:
    busy = np.flatnonzero(cycles)
    runs.append(tile_runs(busy, cycles[busy]))
  return runs


def _bounded_tile_exchange(tile_exchange: Optional[dict]) -> Optional[dict]:
  """The per-step tile runs, or None when they would bloat the page.

  Most steps hold equal bytes on runs of tiles (a few runs each); a program
  of thousands of steps with irregular layouts could reach millions, which
  report.json keeps but the page leaves out (its per-tile liveness then
  shows tensors only, and it says so).
  """
  if tile_exchange is None:
    return None
  runs = sum(len(step) for column in tile_exchange.values() for step in column)
  return tile_exchange if runs <= HTML_MAX_TILE_RUNS else None


def _json_for_script(document) -> str:
  # "</" would end the <script> element early; JSON allows "<\/" instead.
  return json.dumps(document, separators=(",", ":")).replace("</", "<\\/")


def _page(title: str, body: str, payload: dict, script: str) -> str:
  plotly = plotly_js()
  if plotly is None:
    raise ImportError(_MISSING_NOTE)
  return (
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      f"<title>{html.escape(title)}</title>\n"
      f"<style>\n{_asset('report.css')}\n</style>\n"
      f"<script>{plotly}</script>\n</head>\n<body>\n{body}\n"
      "<script type=\"application/json\" id=\"report-data\">"
      f"{_json_for_script(payload)}</script>\n"
      f"<script>\n{_asset('common.js')}\n{script}\n</script>\n"
      "</body>\n</html>\n")


def report_html(report) -> str:
  """The self-contained HTML page of one report.

  Raises:
    ImportError: plotly is not installed (the message says how to get it).
  """
  title = (f"{report.name} on {report.target.name} "
           f"({report.target.num_tiles:,} tiles) — ipu-jax report")
  body = _asset("report.html") + host_side_html(report._host_side_dict())  # pylint: disable=protected-access
  return _page(title, body, report_payload(report),
               _asset("views.js") + "\n" + _asset("report.js"))


def comparison_html(a, b) -> str:
  """The self-contained HTML page comparing report ``a`` with report ``b``.

  Raises:
    ImportError: plotly is not installed.
  """
  title = f"{a.name} vs {b.name} — ipu-jax report comparison"
  payload = {"a": report_payload(a), "b": report_payload(b)}
  # The number formats side by side, as the text comparison lists them (each
  # side's own histories are in its payload, for the charts).
  formats = number_formats_comparison(a.number_formats, b.number_formats)
  payload["number_formats"] = None if formats is None else {
      "comparison": formats, "rows": number_formats_comparison_rows(formats)}
  return _page(title, _asset("compare.html"), payload, _asset("compare.js"))


def write_page(text: str, path) -> str:
  """Writes an HTML page to ``path``; returns the path."""
  path = os.fspath(path)
  with open(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


def write_report_html(report, directory: str) -> str:
  """Writes ``report.html`` into ``directory`` (or ``HTML_MISSING.txt``).

  Returns:
    The path written.
  """
  try:
    page = report_html(report)
  except ImportError:
    return write_page(_MISSING_NOTE, os.path.join(directory, HTML_MISSING_FILE))
  return write_page(page, os.path.join(directory, HTML_FILE))


def write_comparison_html(a, b, path: str) -> str:
  """Writes the comparison page of reports ``a`` and ``b`` to ``path``.

  Raises:
    ImportError: plotly is not installed.
  """
  return write_page(comparison_html(a, b), path)
