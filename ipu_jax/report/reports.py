"""The report classes: :class:`Report` (live) and :class:`SavedReport` (loaded).

Both read a :class:`~ipu_jax.report.data.ReportData` and offer the same
numbers (cycles by phase, FLOPs, memory per tile, aggregates by operation),
the text summary, ``report.json``, the trace and :meth:`save`, which writes
every file of a report into one directory::

    report = Report(profile)
    report.save("reports/mlp")   # report.json, trace.json, report.html, PNGs
    again = Report.load("reports/mlp")
"""

from __future__ import annotations

import collections
import json
import os
from typing import Optional

import numpy as np

from ipu_jax.arguments import check_count
from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.lowering import scopes
from ipu_jax.lowering.dead_code import DeadCode
from ipu_jax.lowering.profile import ProgramProfile
from ipu_jax.report.host_side import host_side_to_json
from ipu_jax.report.streaming import streaming_to_json
from ipu_jax.report.host_io import host_io_to_json
from ipu_jax.report.host_io import step_totals
from ipu_jax.report import html as html_lib
from ipu_jax.report.data import TRACE_FILE
from ipu_jax.report.data import ReportData
from ipu_jax.report.data import data_from_profile
from ipu_jax.report.report_file import REPORT_FILE
from ipu_jax.report.report_file import SCHEMA
from ipu_jax.report.report_file import SCHEMA_VERSION
from ipu_jax.report.report_file import check_schema
from ipu_jax.report.report_file import data_from_json
from ipu_jax.report.report_file import make_directory
from ipu_jax.report.report_file import report_json_path
from ipu_jax.report.report_file import steps_to_json
from ipu_jax.report.report_file import target_to_json
from ipu_jax.report.report_file import write_json
from ipu_jax.report.plots import load_matplotlib
from ipu_jax.report.plots import write_plots
from ipu_jax.report.precision import NUMBER_FORMATS_PLOT_FILE
from ipu_jax.report.precision import NumberFormatTelemetry
from ipu_jax.report.precision import number_formats_figure
from ipu_jax.report.summary import SummaryMixin
from ipu_jax.report.program_tree import program_tree
from ipu_jax.report.timeline import UNROLL
from ipu_jax.report.timeline import Timeline
from ipu_jax.report.timeline import timeline
from ipu_jax.report.trace import trace_events
from ipu_jax.kernels.target import IPUTarget

__all__ = ["Report", "SavedReport", "load_report", "as_report"]

class ReportBase(SummaryMixin):
  """What live and loaded reports share: numbers, summary, trace, save."""

  _data: ReportData

  @property
  def data(self) -> ReportData:
    """The numbers every view reads (the same for a live and a loaded report)."""
    return self._data

  # -- identity ---------------------------------------------------------------

  @property
  def name(self) -> str:
    """The program's name (``ProgramProfile.name``)."""
    return self._data.name

  @property
  def target(self) -> IPUTarget:
    return self._data.target

  # -- cycles -----------------------------------------------------------------

  def _weighted(self, column: np.ndarray) -> float:
    return float(np.sum(column * self._data.steps.executions))

  @property
  def compute_cycles(self) -> float:
    """Compute-phase cycles (slowest tile), summed over executed steps."""
    return self._weighted(self._data.steps.compute_max)

  @property
  def exchange_cycles(self) -> float:
    return self._weighted(self._data.steps.exchange)

  @property
  def sync_cycles(self) -> float:
    return self._weighted(self._data.steps.sync)

  @property
  def total_cycles(self) -> float:
    """The tile program's cycles per run: device only, host transfers excluded."""
    return self.compute_cycles + self.exchange_cycles + self.sync_cycles

  @property
  def estimated_seconds(self) -> float:
    """Time of one program run at the target's tile clock (device only)."""
    return self.target.cycles_to_seconds(self.total_cycles)

  def _step_totals(self) -> dict:
    return step_totals(self.total_cycles, self._host_io_dict(), self.target.clock_hz)

  @property
  def step_cycles(self) -> float:
    """The headline: one execution as the system runs it.

    With host transfers (``host_io["step_cycles"]``) when the program
    streams data from the host each iteration of an on-device loop,
    overlapped as the I/O tiles' strategy allows; else :attr:`total_cycles`.
    """
    return self._step_totals()["step_cycles"]

  @property
  def step_includes_host_io(self) -> bool:
    """Whether :attr:`step_cycles` includes host transfers (the program streams data)."""
    return self._step_totals()["step_includes_host_io"]

  @property
  def step_seconds(self) -> float:
    """:attr:`step_cycles` at the target's tile clock."""
    return self._step_totals()["step_seconds"]

  # -- FLOPs ------------------------------------------------------------------

  @property
  def total_flops(self) -> float:
    return self._weighted(self._data.steps.flops)

  @property
  def flops_dtype(self) -> str:
    """The dtype whose peak the FLOPs are measured against (fp32 default)."""
    return self._data.flops_dtype

  @property
  def peak_flops_per_second(self) -> float:
    """Peak FLOP/s of the whole system in `flops_dtype`."""
    target = self.target
    return (target.num_tiles * target.flops_per_cycle(self.flops_dtype)
            * target.clock_hz)

  @property
  def flops_fraction_of_peak(self) -> float:
    """Achieved FLOP/s over the system's peak (0 for an empty program)."""
    seconds = self.estimated_seconds
    if seconds <= 0:
      return 0.0
    return self.total_flops / (seconds * self.peak_flops_per_second)

  # -- structure --------------------------------------------------------------

  @property
  def num_supersteps(self) -> int:
    """Supersteps in the program (each counted once)."""
    return len(self._data.steps)

  @property
  def num_supersteps_executed(self) -> int:
    """Supersteps run by one program run (``Repeat`` counts every trip)."""
    return int(np.sum(self._data.steps.executions))

  @property
  def num_compute_sets(self) -> int:
    """Supersteps with a compute phase (some tile computes or has vertices)."""
    steps = self._data.steps
    return int(np.count_nonzero((steps.tiles_busy > 0) | (steps.vertices > 0)))

  @property
  def host_round_trips(self) -> int:
    return self._data.host_round_trips

  # -- memory -----------------------------------------------------------------

  @property
  def memory_per_tile(self) -> np.ndarray:
    """``[num_tiles]`` peak bytes on each tile."""
    return self._data.peak

  @property
  def memory_by_category(self) -> dict:
    """Category -> ``[num_tiles]`` bytes at each tile's peak."""
    return dict(self._data.categories)

  @property
  def tile_limit(self) -> int:
    return self._data.tile_limit

  @property
  def tiles_used(self) -> int:
    """Tiles that hold any bytes."""
    return int(np.count_nonzero(self._data.peak))

  @property
  def over_limit_tiles(self) -> np.ndarray:
    """Tiles whose peak exceeds their SRAM, in tile order."""
    return np.nonzero(self._data.peak > self._data.tile_limit)[0]

  @property
  def live_over_program(self) -> np.ndarray:
    """``[num_steps]`` bytes live on the device at each step."""
    return self._data.live

  # -- number formats -----------------------------------------------------------

  _telemetry = None  # set by the number_formats setter or add_number_format_telemetry

  @property
  def number_formats(self) -> Optional[NumberFormatTelemetry]:
    """Loss-scale and FP8-scale histories of the run (None if none recorded).

    ``Model.fit`` records its :class:`~ipu_jax.keras.LossScaleOptimizer`'s
    scale here; a user loop records with :meth:`add_number_format_telemetry`
    or assigns a :class:`~ipu_jax.report.NumberFormatTelemetry`.
    """
    if self._telemetry is None and getattr(self, "document", {}).get("number_formats"):
      self._telemetry = NumberFormatTelemetry.from_json(self.document["number_formats"])
    return self._telemetry

  @number_formats.setter
  def number_formats(self, telemetry: Optional[NumberFormatTelemetry]) -> None:
    if telemetry is not None and not isinstance(telemetry, NumberFormatTelemetry):
      raise TypeError(f"number_formats must be a NumberFormatTelemetry or None, got "
                      f"{type(telemetry).__name__}.")
    self._telemetry = telemetry

  def add_number_format_telemetry(self, step: int, *, model=None, opt_state=None,
                                  fp8=None) -> NumberFormatTelemetry:
    """Records one training step's number-format telemetry into this report.

    Args:
      step: the optimizer step (increasing).
      model: an NNX model with :class:`~ipu_jax.fp8_scaling.FP8Linear`
        layers (their amax and scales after the step).
      opt_state: a :class:`~ipu_jax.keras.LossScaleOptimizer` state.
      fp8: ``ipu_jax.fp8_scaling.collect_telemetry(model)``'s dict, instead
        of ``model``.

    Returns:
      :attr:`number_formats`, created on first use.
    """
    if self.number_formats is None:
      self._telemetry = NumberFormatTelemetry()
    self._telemetry.record(step, model=model, opt_state=opt_state, fp8=fp8)
    return self._telemetry

  def _number_formats_dict(self) -> Optional[dict]:
    telemetry = self.number_formats
    return None if telemetry is None else telemetry.to_json()

  # -- aggregates -------------------------------------------------------------

  def cycles_by_operation(self) -> list:
    """Steps aggregated by (op, source), most cycles first.

    Returns:
      A list of dicts with keys ``op``, ``source``, ``steps``, ``executions``,
      ``cycles`` (cycles x executions), ``compute``, ``exchange``, ``sync``,
      ``flops`` and ``scope``: the module paths of its steps, costliest first,
      joined by ", " ('' when none has one; one source line may be a
      forward and a backward operation, ``loss`` and ``loss/grad``).
    """
    steps = self._data.steps
    groups, by_scope = {}, collections.defaultdict(lambda: collections.defaultdict(float))
    for i in range(len(steps)):
      key = (steps.ops[i], steps.sources[i])
      row = groups.setdefault(key, {
          "op": key[0], "source": key[1], "steps": 0, "executions": 0,
          "cycles": 0.0, "compute": 0.0, "exchange": 0.0, "sync": 0.0,
          "flops": 0})
      executions = int(steps.executions[i])
      row["steps"] += 1
      row["executions"] += executions
      row["compute"] += float(steps.compute_max[i]) * executions
      row["exchange"] += float(steps.exchange[i]) * executions
      row["sync"] += float(steps.sync[i]) * executions
      row["flops"] += int(steps.flops[i]) * executions
      by_scope[key][steps.scopes[i] if i < len(steps.scopes) else ""] += (
          float(steps.compute_max[i] + steps.exchange[i] + steps.sync[i]) * executions)
    for key, row in groups.items():
      row["cycles"] = row["compute"] + row["exchange"] + row["sync"]
      ranked = sorted(((c, s) for s, c in by_scope[key].items() if s),
                      key=lambda cs: (-cs[0], cs[1]))
      row["scope"] = ", ".join(s for _, s in ranked)
    return sorted(groups.values(), key=lambda r: -r["cycles"])

  def temporary_memory_by_op(self) -> dict:
    """Op name -> the most working memory any of its steps needs on a tile.

    A step's working memory is its scratch (operand blocks, partial sums)
    plus its exchange buffers: what ``available_memory_proportion`` bounds.
    """
    steps = self._data.steps
    peaks = collections.defaultdict(int)
    for i in range(len(steps)):
      peaks[steps.ops[i]] = max(peaks[steps.ops[i]], int(steps.temporary_peak[i]))
    return dict(peaks)

  def cycles_by_op(self) -> dict:
    """Op name -> cycles x executions, summed over every source line."""
    totals = collections.defaultdict(float)
    for row in self.cycles_by_operation():
      totals[row["op"]] += row["cycles"]
    return dict(totals)

  def by_scope(self, depth: int = 2) -> list:
    """Cycles and memory grouped by module path (``jax.named_scope``, Flax).

    Args:
      depth: how many levels of the path to keep (``Model/block_0`` at 2).

    Returns:
      ``ScopeCost`` rows (``scope``, ``cycles``, ``cycle_share``, ``steps``,
      ``flops``, ``tensor_bytes``, ``working_bytes``), costliest first; the
      same for a live report and the report saved from it.
    """
    steps, tensors = self._data.steps, self._data.tensors
    return scopes.scope_costs(
        steps.scopes, steps.sync + steps.exchange + steps.compute_max, steps.executions,
        steps.flops, steps.temporary_peak, [t.get("scope", "") for t in tensors],
        [t["total_bytes"] for t in tensors], depth)

  def largest_tensors(self, count: int = 10) -> list:
    """The ``count`` tensors with the most bytes (dicts as in report.json)."""
    check_count("largest_tensors: count", count, least=0)
    return sorted(self._data.tensors,
                  key=lambda t: -t["total_bytes"])[:count]

  # -- serialisation ----------------------------------------------------------

  def to_dict(self) -> dict:
    """The ``report.json`` document (see the module docstring)."""
    data = self._data
    peak = data.peak
    worst = int(np.argmax(peak)) if peak.size else 0
    return {
        "schema": SCHEMA,
        "version": SCHEMA_VERSION,
        "name": data.name,
        "target": target_to_json(data.target),
        "cost_model": data.cost_model,
        "totals": {
            # The headline (step_cycles: host I/O included where the program
            # streams data) beside the device-only cycles, kept as they were.
            **self._step_totals(),
            "cycles": self.total_cycles,
            "compute_cycles": self.compute_cycles,
            "exchange_cycles": self.exchange_cycles,
            "sync_cycles": self.sync_cycles,
            "estimated_seconds": self.estimated_seconds,
            "flops": self.total_flops,
            "flops_dtype": self.flops_dtype,
            "peak_flops_per_second": self.peak_flops_per_second,
            "flops_fraction_of_peak": self.flops_fraction_of_peak,
            "tiles_used": self.tiles_used,
            "num_supersteps": self.num_supersteps,
            "num_supersteps_executed": self.num_supersteps_executed,
            "num_compute_sets": self.num_compute_sets,
            "host_round_trips": self.host_round_trips,
            "memory_bytes": int(peak.sum()),
            "peak_tile": worst,
            "peak_tile_bytes": int(peak[worst]) if peak.size else 0,
        },
        "memory": {
            "tile_limit": data.tile_limit,
            "always_live_categories": list(ALWAYS_LIVE_CATEGORIES),
            "categories": {c: v.tolist() for c, v in data.categories.items()},
            "peak": peak.tolist(),
            "over_limit_tiles": self.over_limit_tiles.tolist(),
            "largest_tensors_on_peak_tile": list(data.peak_tile_tensors),
            "peak_step": data.peak_step.tolist(),
        },
        "live_over_program": data.live.tolist(),
        "steps": steps_to_json(data.steps, data.tile_cycles, data.tile_exchange),
        "program_tree": self.program_tree(),
        "codelets": data.codelet_table,
        "tensors": list(data.tensors),
        "run_setup": self._run_setup_dict(),
        "streaming": self._streaming_dict(),
        "number_formats": self._number_formats_dict(),
        "dead_code": self._dead_code_dict(),
        "constant_folding": self._constant_folding_dict(),
        "host_io": self._host_io_dict(),
        "host_side": self._host_side_dict(),
    }

  @property
  def host_io(self) -> Optional[dict]:
    """The on-device loop's host transfers and their overlap with compute
    (``report.json["host_io"]``, ``ipu_jax/report/host_io.py``), or None."""
    return self._host_io_dict()

  def _host_io_dict(self) -> Optional[dict]:
    return getattr(self, "document", {}).get("host_io")

  @property
  def dead_code(self) -> Optional[DeadCode]:
    """What dead-code elimination removed before lowering, or None.

    None for programs not lowered from a jaxpr (the graph API) and for
    reports saved before it was recorded; a pipeline's counts its stage
    programs' together.
    """
    document = self._dead_code_dict()
    return None if document is None else DeadCode.from_dict(document)

  def _dead_code_dict(self) -> Optional[dict]:
    """The ``"dead_code"`` entry of report.json, or None."""
    return getattr(self, "document", {}).get("dead_code")

  def _constant_folding_dict(self) -> Optional[dict]:
    """The ``"constant_folding"`` entry of report.json, or None."""
    return getattr(self, "document", {}).get("constant_folding")

  def _run_setup_dict(self):
    """How the program is run (replicas, batches...), if its builder said."""
    return getattr(self, "document", {}).get("run_setup")

  def _streaming_dict(self):
    """Streaming memory and its copies (``ipu_jax/report/streaming.py``), or None."""
    return getattr(self, "document", {}).get("streaming")

  def program_tree(self) -> dict:
    """The control program with each node's cycles (PopVision's program tree).

    Returns:
      The root node, JSON-serialisable: ``kind`` (``sequence``, ``repeat``,
      ``repeat_while``, ``if``, ``switch``, ``replicated``, ``steps``),
      ``label``, ``iterations`` (repeats), ``branch``, ``steps``
      (``[first, last]`` superstep indices), ``executions``,
      ``self_cycles``, ``total_cycles`` and ``children``; see
      :mod:`ipu_jax.report.program_tree`.
    """
    return program_tree(self._data)

  def timeline(self, unroll: int = UNROLL) -> Timeline:
    """The supersteps at the cycle each starts, loops unrolled ``unroll`` trips.

    See :mod:`ipu_jax.report.timeline`; ``trace.json`` draws it.
    """
    return timeline(self._data, unroll=unroll)

  def codelets(self) -> list:
    """Per vertex type: compute sets, cycles, vertices, code bytes (or [] if unknown)."""
    return list(self._data.codelet_table or [])

  def _host_side_dict(self):
    """Host-link traffic and host time (``ipu_jax/report/host_side.py``), or None."""
    return getattr(self, "document", {}).get("host_side")

  def trace(self) -> dict:
    """The Chrome Trace Event Format document written to ``trace.json``."""
    return {"traceEvents": trace_events(self._data), "displayTimeUnit": "ns",
            "otherData": {"program": self.name, "target": self.target.name,
                          "clock_hz": self.target.clock_hz}}

  def save(self, directory: str | os.PathLike, plots: bool = True,
           html: bool = True) -> list:
    """Writes report.json, trace.json, report.html and the plots.

    Args:
      directory: created if missing; existing files of the same names are
        replaced.
      plots: set False to skip the PNGs.
      html: set False to skip report.html (the interactive view).

    Returns:
      The paths written. Without matplotlib / plotly, ``PLOTS_MISSING.txt`` /
      ``HTML_MISSING.txt`` take the place of the PNGs / the HTML and say how
      to install them.
    """
    directory = os.fspath(directory)
    make_directory(directory, "Report.save")
    written = [write_json(os.path.join(directory, REPORT_FILE),
                          self.to_dict(), indent=1),
               write_json(os.path.join(directory, TRACE_FILE), self.trace())]
    if html:
      written.append(html_lib.write_report_html(self, directory))
    if plots:
      written += write_plots(self._data, self._data.tile_cycles, directory)
      written += self._write_number_formats_plot(directory)
    return written

  def _write_number_formats_plot(self, directory: str) -> list:
    telemetry = self.number_formats
    figure_class = load_matplotlib()
    if telemetry is None or telemetry.empty or figure_class is None:
      return []  # without matplotlib, write_plots already said how to get it
    path = os.path.join(directory, NUMBER_FORMATS_PLOT_FILE)
    title = f"{self.name}: number formats ({self.target.name})"
    number_formats_figure(telemetry, title, figure_class).savefig(path, dpi=100)
    return [path]


class Report(ReportBase):
  """The report of a compiled program: memory per tile, cycles, trace.

  Attributes:
    profile: the :class:`~ipu_jax.lowering.profile.ProgramProfile` it shows.

  Example (``lowered.report`` is one; ``Report(profile)`` makes one):

  >>> import tempfile, jax.numpy as jnp, ipu_jax
  >>> f = ipu_jax.jit(jnp.tanh, target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16))
  >>> report = f.lower(jnp.ones((64, 64))).report
  >>> report.memory_per_tile.shape
  (16,)
  >>> report.summary().splitlines()[0].startswith("Step (device only")
  True
  >>> written = report.save(tempfile.mkdtemp())  # report.json, report.html, trace.json, PNGs
  """

  def __init__(self, profile: ProgramProfile):
    if not isinstance(profile, ProgramProfile):
      raise TypeError(
          f"Report expects a ProgramProfile, got {type(profile).__name__}.")
    self.profile = profile
    self._cached = None

  def _streaming_dict(self):
    return streaming_to_json(self.profile)

  def _host_io_dict(self):
    return host_io_to_json(self.profile)

  def _host_side_dict(self):
    return host_side_to_json(self.profile)

  def _dead_code_dict(self):
    dead_code = getattr(self.profile, "dead_code", None)
    return None if dead_code is None else dead_code.as_dict()

  def _constant_folding_dict(self):
    return getattr(self.profile, "constant_folding", None)

  def _run_setup_dict(self):
    setup = getattr(self.profile, "run_setup", None)
    return None if setup is None else setup.as_dict()

  @property
  def _data(self) -> ReportData:
    # Built on first use: compiling must stay cheap when nobody reads reports.
    if self._cached is None:
      self._cached = data_from_profile(self.profile)
    return self._cached

  @staticmethod
  def load(path_or_dir: str | os.PathLike) -> "SavedReport":
    """Reads a saved report (its directory or its report.json)."""
    return load_report(path_or_dir)


class SavedReport(ReportBase):
  """A report read back from ``report.json``.

  It offers everything a :class:`Report` does. Reports saved before
  version 2 lack the per-tile cycles of each step and the tensors' tile
  placement, so their re-save has no cycles heatmap and their HTML view no
  tensors per tile.

  Attributes:
    document: the parsed report.json.
    path: where it was read from ('' if built from a dict).
  """

  def __init__(self, document: dict, path: str = ""):
    check_schema(document, path or "report document")
    self.document = document
    self.path = path
    self._data = data_from_json(document)


def load_report(path_or_dir: str | os.PathLike) -> SavedReport:
  """Reads ``report.json`` from a file or a report directory.

  Raises:
    FileNotFoundError: no report there.
    ValueError: the file is not an ipu-jax report or is of a newer version.
  """
  path = report_json_path(path_or_dir)
  with open(path, encoding="utf-8") as f:
    try:
      document = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not an ipu-jax report: it is not JSON ({e}).") from None
  return SavedReport(document, path)



def as_report(report) -> ReportBase:
  if isinstance(report, ReportBase):
    return report
  if isinstance(report, ProgramProfile):
    return Report(report)
  if isinstance(report, (str, os.PathLike)):
    return load_report(report)
  raise TypeError(f"Expected a Report, SavedReport, ProgramProfile or path, "
                  f"got {type(report).__name__}.")
