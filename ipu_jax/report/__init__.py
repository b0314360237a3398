"""Reports of compiled tile programs: the PopVision of ipu-jax.

A :class:`Report` wraps a :class:`~ipu_jax.lowering.profile.ProgramProfile`
(the cycles and bytes per tile that the cost and memory models computed) and
presents it the way Graphcore users read their programs: a text summary like
Poplar's profile summary, an interactive HTML view like PopVision Graph
Analyser (tile memory map, liveness, execution), a Chrome/Perfetto trace of
the BSP supersteps, PNG plots and comparisons of two reports::

    report = Report(profile)
    print(report.summary())
    report.save("reports/mlp")    # report.json, report.html, trace.json, PNGs
    old = Report.load("reports/mlp-before")
    print(compare_reports(old, report))

From a shell::

    python -m ipu_jax.report reports/mlp                  # prints the summary
    python -m ipu_jax.report reports/before reports/mlp   # prints what changed
    python -m ipu_jax.report reports/before reports/mlp --html diff.html

Files written by :meth:`Report.save`:

* ``report.json`` -- everything needed to print, compare or draw the report
  again (schema in :mod:`~ipu_jax.report.report_file`);
* ``report.html`` -- the interactive view, one self-contained file (needs
  ``pip install ipu-jax[plots]``; otherwise ``HTML_MISSING.txt`` says so);
* ``trace.json`` -- Chrome Trace Event Format, for https://ui.perfetto.dev;
* ``memory_per_tile.png``, ``cycles_heatmap.png``, ``live_memory.png`` --
  with matplotlib; otherwise ``PLOTS_MISSING.txt``; ``number_formats.png``
  when loss-scale or FP8 telemetry was recorded.

One concern per module:

* :mod:`~ipu_jax.report.data` -- the numbers every view reads;
* :mod:`~ipu_jax.report.report_file` -- ``report.json``: its schema, writing
  and reading;
* :mod:`~ipu_jax.report.reports` -- :class:`Report`, :class:`SavedReport`,
  :func:`load_report`, saving;
* :mod:`~ipu_jax.report.summary` -- the text summary;
* :mod:`~ipu_jax.report.program_tree` -- the control program with cycles;
* :mod:`~ipu_jax.report.timeline` -- the steps on a time axis, loops unrolled;
* :mod:`~ipu_jax.report.trace` -- ``trace.json``;
* :mod:`~ipu_jax.report.precision` -- loss-scale and FP8-scale telemetry
  (:class:`NumberFormatTelemetry`) and its summary, plot and JSON;
* :mod:`~ipu_jax.report.plots` -- the PNGs (matplotlib);
* :mod:`~ipu_jax.report.html` -- ``report.html`` and the comparison page
  (plotly.js);
* :mod:`~ipu_jax.report.compare` -- the text comparison;
* :mod:`~ipu_jax.report.autosave` -- a report of every compiled program;
* :mod:`~ipu_jax.report.cli` -- the command line.
"""

from ipu_jax.report.autosave import maybe_auto_save
from ipu_jax.report.cli import main
from ipu_jax.report.compare import compare_reports
from ipu_jax.report.report_file import SCHEMA
from ipu_jax.report.report_file import SCHEMA_VERSION
from ipu_jax.report.precision import NumberFormatTelemetry
from ipu_jax.report.reports import Report
from ipu_jax.report.reports import SavedReport
from ipu_jax.report.reports import load_report

__all__ = ["Report", "SavedReport", "compare_reports", "load_report",
           "NumberFormatTelemetry", "maybe_auto_save", "SCHEMA", "SCHEMA_VERSION", "main"]
