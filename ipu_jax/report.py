"""Reports of compiled tile programs: the PopVision of ipu-jax.

A :class:`Report` wraps a :class:`~ipu_jax.lowering.profile.ProgramProfile`
(the cycles and bytes per tile that the cost and memory models computed) and
presents it the way Graphcore users read their programs: a text summary like
Poplar's profile summary, a Chrome/Perfetto trace of the BSP supersteps, plots
of memory per tile, of compute cycles per tile and superstep and of live
memory over the program, and a comparison of two reports::

    report = Report(profile)
    print(report.summary())
    report.save("reports/mlp")                  # report.json, trace.json, PNGs
    old = Report.load("reports/mlp-before")
    print(compare_reports(old, report))

From a shell::

    python -m ipu_jax.report reports/mlp                  # prints the summary
    python -m ipu_jax.report reports/before reports/mlp   # prints what changed

Files written by :meth:`Report.save`:

* ``report.json`` -- everything needed to print the summary or compare again,
  schema below.
* ``trace.json`` -- Chrome Trace Event Format; open it in
  https://ui.perfetto.dev or chrome://tracing. One process per IPU (``pid`` =
  IPU index), threads ``tid`` 0 = sync, 1 = exchange, 2 = compute; one
  complete (``"ph": "X"``) span per superstep phase, with ``ts``/``dur`` in
  microseconds at the target's clock. A step that executes ``n`` times is
  drawn once, ``n`` times as long, with ``args.executions = n``. Phases of
  zero cycles are left out. A counter track on process 0 shows the bytes live
  on the device.
* ``memory_per_tile.png``, ``cycles_heatmap.png``, ``live_memory.png`` --
  when matplotlib is installed (``pip install ipu-jax[plots]``); otherwise
  ``PLOTS_MISSING.txt`` says how to get them.

``report.json`` schema, version 1 (all bytes are integers, cycles floats)::

    {
      "schema": "ipu-jax-report",
      "version": 1,
      "name": str,                       # ProgramProfile.name
      "target": {                        # every IPUTarget field, plus:
        "name": str, "num_ipus": int, "tiles_per_ipu": int,
        "bytes_per_tile": int, "clock_hz": float, ...,
        "num_tiles": int
      },
      "totals": {                        # derived, for readers of the file
        "cycles", "compute_cycles", "exchange_cycles", "sync_cycles": float,
        "estimated_seconds": float, "flops": float, "flops_dtype": str,
        "peak_flops_per_second": float, "flops_fraction_of_peak": float,
        "tiles_used": int, "num_supersteps": int,
        "num_supersteps_executed": int, "num_compute_sets": int,
        "host_round_trips": int, "memory_bytes": int,
        "peak_tile": int, "peak_tile_bytes": int
      },
      "memory": {
        "tile_limit": int,               # SRAM per tile
        "always_live_categories": [str],
        "categories": {category: [int] * num_tiles},  # at each tile's peak
        "peak": [int] * num_tiles,
        "over_limit_tiles": [int],
        "largest_tensors_on_peak_tile": [
          {"name", "category", "bytes", "op", "source"}]
      },
      "live_over_program": [int] * num_steps,   # bytes live on the device
      "steps": [{                        # in program order
        "name", "op", "source": str,
        "compute_cycles_max", "compute_cycles_mean": float,
        "compute_cycles_per_ipu": [float] * num_ipus,  # slowest tile per IPU
        "ipus": [int],                   # IPUs taking part
        "tiles_busy": int, "vertices": int,
        "exchange_cycles", "sync_cycles": float,
        "executions": int, "flops": int,
        "exchange_bytes_in", "exchange_bytes_out": int,   # summed over tiles
        "ipu_link_bytes", "host_bytes": int,
        "temporary_bytes_peak": int      # the step's working memory, busiest tile
      }],
      "tensors": [{
        "name", "dtype", "category", "op", "source": str, "shape": [int],
        "total_bytes": int, "tiles": int,  # number of tiles holding a part
        "max_bytes_per_tile": int, "live_from", "live_to": int
      }]
    }

Readers must check ``schema`` and ``version``; later versions only add keys.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.lowering.profile import MEMORY_CATEGORIES
from ipu_jax.lowering.profile import ProgramProfile
from ipu_jax.target import IPUTarget

__all__ = ["Report", "SavedReport", "compare_reports", "load_report",
           "maybe_auto_save", "SCHEMA", "SCHEMA_VERSION", "main"]

SCHEMA = "ipu-jax-report"
SCHEMA_VERSION = 1

REPORT_FILE = "report.json"
TRACE_FILE = "trace.json"
MEMORY_PLOT_FILE = "memory_per_tile.png"
HEATMAP_PLOT_FILE = "cycles_heatmap.png"
LIVE_PLOT_FILE = "live_memory.png"
PLOTS_MISSING_FILE = "PLOTS_MISSING.txt"

# Past these sizes the heatmap averages bins of steps / tiles, so a program
# of thousands of supersteps on 1,472 tiles still renders in well under a
# second and stays readable.
_MAX_HEATMAP_STEPS = 400
_MAX_HEATMAP_TILES = 512

_TID_SYNC, _TID_EXCHANGE, _TID_COMPUTE = 0, 1, 2
_THREAD_NAMES = {_TID_SYNC: "sync", _TID_EXCHANGE: "exchange",
                 _TID_COMPUTE: "compute"}

_CATEGORY_LABELS = {
    "variables": "Variables",
    "constants": "Constants",
    "vertex_state": "Vertex state",
    "code": "Code",
    "temporaries": "Temporaries",
    "exchange_buffers": "Exchange buffers",
}

_CATEGORY_COLOURS = {
    "variables": "#1f77b4",
    "constants": "#9467bd",
    "vertex_state": "#8c564b",
    "code": "#7f7f7f",
    "temporaries": "#ff7f0e",
    "exchange_buffers": "#2ca02c",
}


# ----------------------------------------------------------------------------
# The data a report shows, independent of where it came from.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class _StepTable:
  """Per-step columns (one entry per superstep, in program order)."""

  names: list
  ops: list
  sources: list
  compute_max: np.ndarray
  compute_mean: np.ndarray
  compute_per_ipu: np.ndarray  # [num_steps, num_ipus]
  ipus: list                   # list of lists of IPU indices
  tiles_busy: np.ndarray
  vertices: np.ndarray
  exchange: np.ndarray
  sync: np.ndarray
  executions: np.ndarray
  flops: np.ndarray
  bytes_in: np.ndarray
  bytes_out: np.ndarray
  ipu_link_bytes: np.ndarray
  host_bytes: np.ndarray
  temporary_peak: np.ndarray   # the step's own working memory, busiest tile

  def __len__(self) -> int:
    return len(self.names)

  @property
  def cycles_per_execution(self) -> np.ndarray:
    return self.sync + self.exchange + self.compute_max

  @property
  def weighted_cycles(self) -> np.ndarray:
    return self.cycles_per_execution * self.executions


@dataclasses.dataclass
class _ReportData:
  """Everything summary, compare, trace and plots need."""

  name: str
  target: IPUTarget
  host_round_trips: int
  flops_dtype: str
  categories: dict          # category -> [num_tiles] int64
  peak: np.ndarray          # [num_tiles] int64
  tile_limit: int
  live: np.ndarray          # [num_steps] int64
  steps: _StepTable
  tensors: list             # list of dicts, as in report.json
  peak_tile_tensors: list   # list of dicts, as in report.json


def _int_array(values, size: Optional[int] = None) -> np.ndarray:
  array = np.asarray(values if values is not None else [], dtype=np.float64)
  array = np.rint(array).astype(np.int64)
  if size is not None and array.size != size:
    # A malformed entry must not stop the rest of the report from rendering.
    fixed = np.zeros(size, np.int64)
    fixed[:min(size, array.size)] = array.ravel()[:size]
    return fixed
  return array


def _step_ipus(step, active_row, target: IPUTarget) -> list:
  """The IPUs a step runs on: its own ``ipu`` if set, else the busy ones."""
  ipu = getattr(step, "ipu", None)
  if ipu is not None and 0 <= int(ipu) < target.num_ipus:
    return [int(ipu)]
  busy = np.nonzero(active_row)[0].tolist()
  return busy or list(range(target.num_ipus))


def _per_tile(values, num_tiles: int) -> np.ndarray:
  array = np.asarray(values if values is not None else np.zeros(num_tiles),
                     dtype=np.float64).ravel()
  if array.size == num_tiles:
    return array
  fixed = np.zeros(num_tiles)
  fixed[:min(num_tiles, array.size)] = array[:num_tiles]
  return fixed


def _steps_from_profile(profile: ProgramProfile) -> _StepTable:
  """Reduces the per-tile step arrays of a profile to per-step columns."""
  target = profile.target
  n, num_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  steps = profile.steps
  cycles = np.stack([_per_tile(s.compute_cycles, n) for s in steps]) \
      if steps else np.zeros((0, n))
  bytes_in = np.stack([_per_tile(s.exchange_bytes_in, n) for s in steps]) \
      if steps else np.zeros((0, n))
  bytes_out = np.stack([_per_tile(s.exchange_bytes_out, n) for s in steps]) \
      if steps else np.zeros((0, n))
  per_ipu_cycles = cycles.reshape(len(steps), num_ipus, per_ipu).max(axis=2) \
      if steps else np.zeros((0, num_ipus))
  active = (cycles + bytes_in + bytes_out).reshape(
      len(steps), num_ipus, per_ipu).max(axis=2) > 0
  vertices = [int(np.sum(s.vertices)) if s.vertices is not None else 0
              for s in steps]
  return _StepTable(
      names=[str(s.name) for s in steps],
      ops=[str(s.op) for s in steps],
      sources=[str(s.source or "") for s in steps],
      compute_max=cycles.max(axis=1) if steps else np.zeros(0),
      compute_mean=cycles.mean(axis=1) if steps else np.zeros(0),
      compute_per_ipu=per_ipu_cycles,
      ipus=[_step_ipus(s, active[i], target)
            for i, s in enumerate(steps)],
      tiles_busy=np.count_nonzero(cycles, axis=1).astype(np.int64),
      vertices=np.asarray(vertices, np.int64),
      exchange=np.asarray([float(s.exchange_cycles) for s in steps]),
      sync=np.asarray([float(s.sync_cycles) for s in steps]),
      executions=np.asarray([int(s.executions) for s in steps], np.int64),
      flops=np.asarray([int(s.flops) for s in steps], np.int64),
      bytes_in=_int_array(bytes_in.sum(axis=1)),
      bytes_out=_int_array(bytes_out.sum(axis=1)),
      ipu_link_bytes=np.asarray([int(s.ipu_link_bytes) for s in steps],
                                np.int64),
      host_bytes=np.asarray([int(s.host_bytes) for s in steps], np.int64),
      temporary_peak=np.asarray(
          [int(np.max(s.temporary_bytes)) if getattr(s, "temporary_bytes", None) is not None
           and np.size(s.temporary_bytes) else 0 for s in steps], np.int64),
  )


def _tensor_row(tensor) -> dict:
  on_tile = np.asarray(tensor.bytes_on_tile)
  return {
      "name": str(tensor.name),
      "shape": [int(d) for d in tensor.shape],
      "dtype": str(tensor.dtype),
      "category": str(tensor.category),
      "total_bytes": int(on_tile.sum()),
      "tiles": int(np.asarray(tensor.tiles).size),
      "max_bytes_per_tile": int(on_tile.max()) if on_tile.size else 0,
      "op": str(tensor.op or ""),
      "source": str(tensor.source or ""),
      "live_from": int(tensor.live_from),
      "live_to": int(tensor.live_to),
  }


def _tensors_on_tile(tensors: Iterable, tile: int, limit: int = 10) -> list:
  """The largest tensors holding bytes on ``tile``, largest first."""
  rows = []
  for tensor in tensors:
    held = np.asarray(tensor.bytes_on_tile)[np.asarray(tensor.tiles) == tile]
    if held.size and held.sum() > 0:
      rows.append({"name": str(tensor.name), "category": str(tensor.category),
                   "bytes": int(held.sum()), "op": str(tensor.op or ""),
                   "source": str(tensor.source or "")})
  rows.sort(key=lambda row: -row["bytes"])
  return rows[:limit]


def _flops_dtype(profile: ProgramProfile) -> str:
  """The dtype whose peak FLOPS the program is measured against.

  The profile contract carries no dtype for FLOPs; a cost model may add
  ``ProgramProfile.flops_dtype`` or ``StepProfile.flops_dtype`` and it is
  honoured (the dtype of the majority of FLOPs wins). Otherwise fp32.
  """
  declared = getattr(profile, "flops_dtype", None)
  if declared:
    return str(np.dtype(declared))
  by_dtype = collections.Counter()
  for step in profile.steps:
    dtype = getattr(step, "flops_dtype", None)
    if dtype:
      by_dtype[str(np.dtype(dtype))] += step.flops * step.executions
  if by_dtype:
    return by_dtype.most_common(1)[0][0]
  return "float32"


def _data_from_profile(profile: ProgramProfile) -> _ReportData:
  target = profile.target
  n = target.num_tiles
  memory = profile.memory
  categories = {c: _int_array(v, n) for c, v in memory.by_category.items()}
  peak = _int_array(memory.peak, n)
  worst_tile = int(np.argmax(peak)) if peak.size else 0
  tensors = [_tensor_row(t) for t in profile.tensors]
  return _ReportData(
      name=str(profile.name),
      target=target,
      host_round_trips=int(profile.host_round_trips),
      flops_dtype=_flops_dtype(profile),
      categories=categories,
      peak=peak,
      tile_limit=int(memory.tile_limit),
      live=_int_array(memory.live_over_program),
      steps=_steps_from_profile(profile),
      tensors=tensors,
      peak_tile_tensors=_tensors_on_tile(profile.tensors, worst_tile),
  )


# ----------------------------------------------------------------------------
# report.json (de)serialisation.
# ----------------------------------------------------------------------------


def _target_to_json(target: IPUTarget) -> dict:
  fields = dataclasses.asdict(target)
  fields["num_tiles"] = target.num_tiles
  return fields


def _target_from_json(fields: dict) -> IPUTarget:
  known = {f.name for f in dataclasses.fields(IPUTarget)}
  return IPUTarget(**{k: v for k, v in fields.items() if k in known})


def _steps_to_json(steps: _StepTable) -> list:
  return [{
      "name": steps.names[i],
      "op": steps.ops[i],
      "source": steps.sources[i],
      "compute_cycles_max": float(steps.compute_max[i]),
      "compute_cycles_mean": float(steps.compute_mean[i]),
      "compute_cycles_per_ipu": steps.compute_per_ipu[i].astype(float).tolist(),
      "ipus": list(steps.ipus[i]),
      "tiles_busy": int(steps.tiles_busy[i]),
      "vertices": int(steps.vertices[i]),
      "exchange_cycles": float(steps.exchange[i]),
      "sync_cycles": float(steps.sync[i]),
      "executions": int(steps.executions[i]),
      "flops": int(steps.flops[i]),
      "exchange_bytes_in": int(steps.bytes_in[i]),
      "exchange_bytes_out": int(steps.bytes_out[i]),
      "ipu_link_bytes": int(steps.ipu_link_bytes[i]),
      "host_bytes": int(steps.host_bytes[i]),
      "temporary_bytes_peak": int(steps.temporary_peak[i]),
  } for i in range(len(steps))]


def _steps_from_json(rows: list, num_ipus: int) -> _StepTable:
  def column(key, dtype=np.float64, default=0):
    return np.asarray([row.get(key, default) for row in rows], dtype=dtype)

  per_ipu = np.zeros((len(rows), num_ipus))
  for i, row in enumerate(rows):
    values = row.get("compute_cycles_per_ipu") or [row["compute_cycles_max"]]
    per_ipu[i, :min(num_ipus, len(values))] = values[:num_ipus]
  return _StepTable(
      names=[str(row.get("name", "")) for row in rows],
      ops=[str(row.get("op", "")) for row in rows],
      sources=[str(row.get("source", "")) for row in rows],
      compute_max=column("compute_cycles_max"),
      compute_mean=column("compute_cycles_mean"),
      compute_per_ipu=per_ipu,
      ipus=[list(row.get("ipus", range(num_ipus))) for row in rows],
      tiles_busy=column("tiles_busy", np.int64),
      vertices=column("vertices", np.int64),
      exchange=column("exchange_cycles"),
      sync=column("sync_cycles"),
      executions=column("executions", np.int64, 1),
      flops=column("flops", np.int64),
      bytes_in=column("exchange_bytes_in", np.int64),
      bytes_out=column("exchange_bytes_out", np.int64),
      ipu_link_bytes=column("ipu_link_bytes", np.int64),
      host_bytes=column("host_bytes", np.int64),
      temporary_peak=column("temporary_bytes_peak", np.int64),
  )


def _data_from_json(document: dict) -> _ReportData:
  target = _target_from_json(document["target"])
  memory = document["memory"]
  n = target.num_tiles
  return _ReportData(
      name=str(document.get("name", "program")),
      target=target,
      host_round_trips=int(document.get("totals", {}).get(
          "host_round_trips", 1)),
      flops_dtype=str(document.get("totals", {}).get("flops_dtype",
                                                     "float32")),
      categories={c: _int_array(v, n)
                  for c, v in memory["categories"].items()},
      peak=_int_array(memory["peak"], n),
      tile_limit=int(memory["tile_limit"]),
      live=_int_array(document.get("live_over_program", [])),
      steps=_steps_from_json(document.get("steps", []), target.num_ipus),
      tensors=list(document.get("tensors", [])),
      peak_tile_tensors=list(memory.get("largest_tensors_on_peak_tile", [])),
  )


def _check_schema(document: Any, origin: str) -> None:
  if not isinstance(document, dict) or document.get("schema") != SCHEMA:
    raise ValueError(f"{origin} is not an ipu-jax report: expected "
                     f'"schema": "{SCHEMA}".')
  version = document.get("version")
  if not isinstance(version, int) or version < 1:
    raise ValueError(f"{origin} has an invalid report version {version!r}.")
  if version > SCHEMA_VERSION:
    raise ValueError(
        f"{origin} is report version {version}; this ipu-jax reads versions "
        f"up to {SCHEMA_VERSION}. Upgrade ipu-jax to read it.")


def _report_json_path(path_or_dir: str | os.PathLike) -> str:
  path = os.fspath(path_or_dir)
  return os.path.join(path, REPORT_FILE) if os.path.isdir(path) else path


# ----------------------------------------------------------------------------
# Text formatting.
# ----------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
  n = int(n)
  for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= scale:
      return f"{n:,} B ({n / scale:.2f} {unit})"
  return f"{n:,} B"


def _fmt_int(value: float) -> str:
  return f"{value:,.0f}"


def _fmt_seconds(seconds: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if abs(seconds) >= scale:
      return f"{seconds / scale:.3f} {unit}"
  return f"{seconds / 1e-9:.1f} ns"


def _fmt_flops(flops: float) -> str:
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(flops) >= scale:
      return f"{flops / scale:.3f} {unit}"
  return f"{flops:.0f} "


def _pct(part: float, whole: float) -> str:
  return f"{100.0 * part / whole:.1f}%" if whole else "0.0%"


def _short_source(source: str, width: int = 48) -> str:
  """Keeps the end of long paths: the file name and line matter most."""
  if not source:
    return "?"
  if len(source) <= width:
    return source
  return "..." + source[-(width - 3):]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]],
           indent: str = "  ", right: Sequence[bool] = ()) -> list:
  """Lines of a plain-text table; ``right[i]`` right-aligns column i."""
  widths = [len(h) for h in header]
  for row in rows:
    widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
  aligned = list(right) + [False] * (len(header) - len(right))

  def line(cells):
    parts = [c.rjust(w) if r else c.ljust(w)
             for c, w, r in zip(cells, widths, aligned)]
    return (indent + "  ".join(parts)).rstrip()

  return [line(header), indent + "  ".join("-" * w for w in widths)] + [
      line(row) for row in rows]


def _category_label(category: str) -> str:
  return _CATEGORY_LABELS.get(category, category.replace("_", " ").capitalize())


def _ordered_categories(categories: dict) -> list:
  known = [c for c in MEMORY_CATEGORIES if c in categories]
  return known + sorted(c for c in categories if c not in MEMORY_CATEGORIES)


def _tile_name(tile: int, target: IPUTarget) -> str:
  if target.num_ipus == 1:
    return f"tile {tile}"
  return f"tile {tile} (IPU {target.ipu_of_tile(tile)})"


# ----------------------------------------------------------------------------
# Reports.
# ----------------------------------------------------------------------------


class _ReportBase:
  """What live and loaded reports share: numbers, summary, trace, save."""

  _data: _ReportData

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
    return self.compute_cycles + self.exchange_cycles + self.sync_cycles

  @property
  def estimated_seconds(self) -> float:
    """Time of one program run at the target's tile clock."""
    return self.target.cycles_to_seconds(self.total_cycles)

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

  # -- aggregates -------------------------------------------------------------

  def cycles_by_operation(self) -> list:
    """Steps aggregated by (op, source), most cycles first.

    Returns:
      A list of dicts with keys ``op``, ``source``, ``steps``, ``executions``,
      ``cycles`` (cycles x executions), ``compute``, ``exchange``, ``sync``
      and ``flops``.
    """
    steps = self._data.steps
    groups = {}
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
    for row in groups.values():
      row["cycles"] = row["compute"] + row["exchange"] + row["sync"]
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

  def largest_tensors(self, count: int = 10) -> list:
    """The ``count`` tensors with the most bytes (dicts as in report.json)."""
    return sorted(self._data.tensors,
                  key=lambda t: -t["total_bytes"])[:count]

  # -- summary ----------------------------------------------------------------

  def summary(self, top: int = 10) -> str:
    """A Poplar-style profile summary.

    Args:
      top: how many operations and tensors to list.

    Returns:
      Multi-line text.
    """
    sections = [
        self._summary_target(),
        self._summary_program(),
        self._summary_memory(),
        self._summary_cycles(),
        self._summary_top_ops(top),
        self._summary_top_working_memory(top),
        self._summary_top_tensors(top),
    ]
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
        f"  Memory per tile:       {_fmt_bytes(t.bytes_per_tile)}",
        f"  Total memory:          {_fmt_bytes(t.total_memory_bytes)}",
        f"  Clock:                 {t.clock_hz / 1e9:.3f} GHz",
    ]

  def _summary_program(self) -> list:
    steps = self._data.steps
    lines = [
        f"Program: {self.name}",
        f"  Tiles used:            {self.tiles_used:,} / "
        f"{self.target.num_tiles:,} "
        f"({_pct(self.tiles_used, self.target.num_tiles)})",
        f"  Compute sets:          {self.num_compute_sets:,}",
        f"  Supersteps:            {self.num_supersteps:,} "
        f"({self.num_supersteps_executed:,} executed per run)",
        f"  Host round trips:      {self.host_round_trips:,}",
    ]
    link = int(np.sum(steps.ipu_link_bytes * steps.executions))
    host = int(np.sum(steps.host_bytes * steps.executions))
    if link:
      lines.append(f"  IPU-Link traffic:      {_fmt_bytes(link)}")
    if host:
      lines.append(f"  Host traffic:          {_fmt_bytes(host)}")
    return lines

  def _summary_memory(self) -> list:
    data, target = self._data, self.target
    peak = data.peak
    total = int(peak.sum())
    lines = ["Memory:",
             f"  Total over device:     {_fmt_bytes(total)} of "
             f"{_fmt_bytes(target.total_memory_bytes)} "
             f"({_pct(total, target.total_memory_bytes)})"]
    if peak.size:
      worst = int(np.argmax(peak))
      used = peak[peak > 0]
      lines += [
          f"  Peak tile:             {_tile_name(worst, target)}: "
          f"{_fmt_bytes(peak[worst])} of {_fmt_bytes(data.tile_limit)} "
          f"({_pct(peak[worst], data.tile_limit)})",
          f"  Mean per tile:         {_fmt_bytes(peak.mean())} "
          f"(over used tiles: {_fmt_bytes(used.mean() if used.size else 0)})",
          "  Worst tiles:           " + ", ".join(
              f"{_tile_name(int(t), target)}: {int(peak[t]):,} B"
              for t in np.argsort(-peak, kind="stable")[:5]),
      ]
    lines += ["", "  By category (bytes at each tile's peak):"]
    lines += self._category_table()
    return lines

  def _category_table(self) -> list:
    data = self._data
    worst = int(np.argmax(data.peak)) if data.peak.size else 0
    ordered = _ordered_categories(data.categories)
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
      rows += [self._category_row("  " + _category_label(c),
                                  data.categories[c], worst)
               for c in categories]
    rows.append(self._category_row("Total (peak)", data.peak, worst))
    return _table(["Category", "Total", "Max tile", "Mean tile",
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
        f"  Compute:               {_fmt_int(self.compute_cycles):>16} "
        f"({_pct(self.compute_cycles, total)})",
        f"  Exchange:              {_fmt_int(self.exchange_cycles):>16} "
        f"({_pct(self.exchange_cycles, total)})",
        f"  Sync:                  {_fmt_int(self.sync_cycles):>16} "
        f"({_pct(self.sync_cycles, total)})",
        f"  Total:                 {_fmt_int(total):>16}",
        f"  Estimated time:        {_fmt_seconds(seconds)} at "
        f"{self.target.clock_hz / 1e9:.3f} GHz",
        "",
        "FLOPs:",
        f"  Total:                 {_fmt_flops(self.total_flops)}FLOP "
        f"({self.total_flops:,.0f})",
        f"  Achieved:              {_fmt_flops(achieved)}FLOP/s",
        f"  Peak:                  {_fmt_flops(self.peak_flops_per_second)}"
        f"FLOP/s ({self.flops_dtype})",
        f"  Fraction of peak:      {100.0 * fraction:.2f}%",
    ]

  def _summary_top_ops(self, top: int) -> list:
    rows = self.cycles_by_operation()
    total = self.total_cycles
    body = [[r["op"], _short_source(r["source"]), str(r["steps"]),
             f"{r['executions']:,}", _fmt_int(r["cycles"]),
             _pct(r["cycles"], total)] for r in rows[:top]]
    title = f"Top operations by cycles ({min(top, len(rows))} of {len(rows)}):"
    if not body:
      return [title, "  (no supersteps)"]
    return [title] + _table(
        ["Operation", "Source", "Steps", "Executions", "Cycles", "% total"],
        body, right=(False, False, True, True, True, True))

  def _summary_top_working_memory(self, top: int) -> list:
    peaks = sorted(self.temporary_memory_by_op().items(), key=lambda kv: -kv[1])
    peaks = [(op, b) for op, b in peaks if b > 0]
    title = (f"Top operations by working memory per tile ({min(top, len(peaks))} of "
             f"{len(peaks)}):")
    if not peaks:
      return [title, "  (none)"]
    body = [[op, f"{b:,}", _pct(b, self.tile_limit)] for op, b in peaks[:top]]
    return [title] + _table(["Operation", "Peak bytes", "% of tile"], body,
                            right=(False, True, True))

  def _summary_top_tensors(self, top: int) -> list:
    tensors = self.largest_tensors(top)
    title = (f"Top tensors by memory ({len(tensors)} of "
             f"{len(self._data.tensors)}):")
    if not tensors:
      return [title, "  (no tensors)"]
    body = [[t["name"], "x".join(str(d) for d in t["shape"]) or "()",
             t["dtype"], _category_label(t["category"]),
             f"{t['total_bytes']:,}", str(t["tiles"]), t["op"] or "?",
             _short_source(t["source"])] for t in tensors]
    return [title] + _table(
        ["Tensor", "Shape", "Dtype", "Category", "Bytes", "Tiles", "Op",
         "Source"], body, right=(False, False, False, False, True, True))

  def _summary_out_of_memory(self, limit: int = 20) -> list:
    data, target = self._data, self.target
    over = self.over_limit_tiles
    order = over[np.argsort(-data.peak[over], kind="stable")]
    lines = [
        "!" * 72,
        f"OUT OF MEMORY: {len(over)} tile(s) over the limit of "
        f"{_fmt_bytes(data.tile_limit)} per tile",
        "!" * 72,
    ]
    body = [[_tile_name(int(t), target), f"{int(data.peak[t]):,}",
             f"{int(data.peak[t]) - data.tile_limit:,}",
             _pct(data.peak[t], data.tile_limit)] for t in order[:limit]]
    lines += _table(["Tile", "Bytes needed", "Over by", "% of SRAM"], body,
                    right=(False, True, True, True))
    if len(order) > limit:
      lines.append(f"  ... and {len(order) - limit} more tiles over the limit")
    if data.peak_tile_tensors:
      worst = _tile_name(int(order[0]), target)
      lines += ["", f"  Largest tensors on {worst}:"]
      lines += _table(
          ["Tensor", "Category", "Bytes", "Op", "Source"],
          [[t["name"], _category_label(t["category"]), f"{t['bytes']:,}",
            t["op"] or "?", _short_source(t["source"])]
           for t in data.peak_tile_tensors], indent="    ",
          right=(False, False, True))
    lines += ["", "  What might help: spread large tensors over more tiles, "
              "lower availableMemoryProportion, recompute activations, "
              "or use more IPUs."]
    return lines

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
        "target": _target_to_json(data.target),
        "totals": {
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
        },
        "live_over_program": data.live.tolist(),
        "steps": _steps_to_json(data.steps),
        "tensors": list(data.tensors),
    }

  def trace(self) -> dict:
    """The Chrome Trace Event Format document written to ``trace.json``."""
    return {"traceEvents": _trace_events(self._data), "displayTimeUnit": "ns",
            "otherData": {"program": self.name, "target": self.target.name,
                          "clock_hz": self.target.clock_hz}}

  def _tile_cycles(self) -> Optional[np.ndarray]:
    """``[num_steps, num_tiles]`` compute cycles, if the report has them."""
    return None

  def save(self, directory: str | os.PathLike, plots: bool = True) -> list:
    """Writes report.json, trace.json and the plots into ``directory``.

    Args:
      directory: created if missing; existing files of the same names are
        replaced.
      plots: set False to skip the PNGs.

    Returns:
      The paths written.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    written = [_write_json(os.path.join(directory, REPORT_FILE),
                           self.to_dict(), indent=1),
               _write_json(os.path.join(directory, TRACE_FILE), self.trace())]
    if plots:
      written += _write_plots(self._data, self._tile_cycles(), directory)
    return written


class Report(_ReportBase):
  """The report of a compiled program: memory per tile, cycles, trace.

  Attributes:
    profile: the :class:`~ipu_jax.lowering.profile.ProgramProfile` it shows.

  Example::

    report = Report(profile)
    report.total_cycles, report.memory_per_tile.max()
    print(report)                  # the summary
    report.save("/tmp/my-report")  # report.json, trace.json, PNGs
  """

  def __init__(self, profile: ProgramProfile):
    if not isinstance(profile, ProgramProfile):
      raise TypeError(
          f"Report expects a ProgramProfile, got {type(profile).__name__}.")
    self.profile = profile
    self._cached = None

  @property
  def _data(self) -> _ReportData:
    # Built on first use: compiling must stay cheap when nobody reads reports.
    if self._cached is None:
      self._cached = _data_from_profile(self.profile)
    return self._cached

  def _tile_cycles(self) -> Optional[np.ndarray]:
    n = self.target.num_tiles
    steps = self.profile.steps
    if not steps:
      return np.zeros((0, n))
    return np.stack([_per_tile(s.compute_cycles, n) for s in steps])

  @staticmethod
  def load(path_or_dir: str | os.PathLike) -> "SavedReport":
    """Reads a saved report (its directory or its report.json)."""
    return load_report(path_or_dir)


class SavedReport(_ReportBase):
  """A report read back from ``report.json``.

  It offers everything a :class:`Report` does except the per-tile cycles of
  each step (so a re-save has no cycles heatmap).

  Attributes:
    document: the parsed report.json.
    path: where it was read from ('' if built from a dict).
  """

  def __init__(self, document: dict, path: str = ""):
    _check_schema(document, path or "report document")
    self.document = document
    self.path = path
    self._data = _data_from_json(document)


def load_report(path_or_dir: str | os.PathLike) -> SavedReport:
  """Reads ``report.json`` from a file or a report directory.

  Raises:
    FileNotFoundError: no report there.
    ValueError: the file is not an ipu-jax report or is of a newer version.
  """
  path = _report_json_path(path_or_dir)
  with open(path, encoding="utf-8") as f:
    document = json.load(f)
  return SavedReport(document, path)


def _as_report(report) -> _ReportBase:
  if isinstance(report, _ReportBase):
    return report
  if isinstance(report, ProgramProfile):
    return Report(report)
  if isinstance(report, (str, os.PathLike)):
    return load_report(report)
  raise TypeError(f"Expected a Report, SavedReport, ProgramProfile or path, "
                  f"got {type(report).__name__}.")


# ----------------------------------------------------------------------------
# trace.json
# ----------------------------------------------------------------------------


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


def _trace_events(data: _ReportData) -> list:
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


def _write_json(path: str, document: dict, indent: Optional[int] = None) -> str:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(document, f, indent=indent)
  return path


# ----------------------------------------------------------------------------
# Plots.
# ----------------------------------------------------------------------------


def _load_matplotlib():
  """matplotlib's Figure class, or None when matplotlib is not installed."""
  try:
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return Figure


def _write_plots(data: _ReportData, tile_cycles: Optional[np.ndarray],
                 directory: str) -> list:
  figure_class = _load_matplotlib()
  if figure_class is None:
    path = os.path.join(directory, PLOTS_MISSING_FILE)
    with open(path, "w", encoding="utf-8") as f:
      f.write("The plots of this report (memory_per_tile.png, "
              "cycles_heatmap.png, live_memory.png) need matplotlib, which is "
              "not installed.\nInstall it with\n\n"
              "    pip install ipu-jax[plots]\n\nor\n\n"
              "    pip install matplotlib\n\nthen save the report again.\n")
    return [path]
  figures = [(MEMORY_PLOT_FILE, _memory_figure(data, figure_class)),
             (LIVE_PLOT_FILE, _live_memory_figure(data, figure_class))]
  if tile_cycles is not None:
    figures.insert(1, (HEATMAP_PLOT_FILE,
                       _cycles_heatmap_figure(data, tile_cycles, figure_class)))
  written = []
  for file_name, figure in figures:
    path = os.path.join(directory, file_name)
    figure.savefig(path, dpi=100)
    written.append(path)
  return written


def _binary_axis(axis, top: float, unit: str, scale: int) -> None:
  """Ticks at round numbers of KiB / MiB, so SRAM sizes read naturally."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  raw = max(top / scale / 8, 1e-9)
  magnitude = 10 ** np.floor(np.log10(raw))
  step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
  axis.set_major_locator(ticker.MultipleLocator(step * scale))
  axis.set_major_formatter(
      ticker.FuncFormatter(lambda v, _: f"{v / scale:,.4g} {unit}"))


def _mark_ipus(ax, target: IPUTarget, tiles_on_y: bool = False) -> None:
  """Dotted lines between the tiles of neighbouring IPUs."""
  draw = ax.axhline if tiles_on_y else ax.axvline
  for ipu in range(1, target.num_ipus):
    draw(ipu * target.tiles_per_ipu - 0.5, color="white" if tiles_on_y
         else "black", lw=0.8, ls=":")


def _memory_figure(data: _ReportData, figure_class=None):
  """Stacked bytes per tile by category, with the SRAM limit line.

  Args:
    data: the report data.
    figure_class: ``matplotlib.figure.Figure`` (loaded if None).

  Returns:
    The figure; its first axes holds the limit as a horizontal line.
  """
  figure_class = figure_class or _load_matplotlib()
  fig = figure_class(figsize=(12, 5), layout="constrained")
  ax = fig.add_subplot()
  tiles = np.arange(data.peak.size)
  categories = _ordered_categories(data.categories)
  layers = [data.categories[c] for c in categories]
  labels = [_category_label(c) for c in categories]
  colours = [_CATEGORY_COLOURS.get(c, None) for c in categories]
  if tiles.size <= 128:
    bottom = np.zeros(tiles.size)
    for layer, label, colour in zip(layers, labels, colours):
      ax.bar(tiles, layer, bottom=bottom, width=0.9, label=label, color=colour)
      bottom = bottom + layer
  elif layers:
    # Thousands of bars are slow to draw; step areas look the same.
    ax.stackplot(tiles, *layers, labels=labels, colors=colours, step="mid")
  limit = data.tile_limit
  ax.axhline(limit, color="red", ls="--", lw=1.5,
             label=f"SRAM limit ({limit:,} B per tile)")
  ax.annotate(f"SRAM limit {limit / 1024:,.0f} KiB", xy=(1.0, limit),
              xycoords=("axes fraction", "data"), xytext=(-4, 3),
              textcoords="offset points", ha="right", va="bottom",
              color="red", fontsize=9)
  over = np.nonzero(data.peak > limit)[0]
  if over.size:
    ax.scatter(over, data.peak[over], marker="v", color="red", zorder=3,
               label=f"{over.size} tile(s) over the limit")
  _mark_ipus(ax, data.target)
  ax.set_xlim(-0.5, max(tiles.size, 1) - 0.5)
  top = max(limit, int(data.peak.max()) if data.peak.size else 0) * 1.1
  ax.set_ylim(0, top)
  _binary_axis(ax.yaxis, top, "KiB", 1 << 10)
  ax.set_xlabel("tile")
  ax.set_ylabel("bytes at the tile's peak")
  ax.set_title(f"{data.name}: memory per tile ({data.target.name}, "
               f"{data.target.num_tiles:,} tiles)")
  ax.legend(loc="upper left", fontsize=8, ncols=2)
  return fig


def _bin_edges(size: int, max_bins: int) -> np.ndarray:
  """Start indices of at most ``max_bins`` near-equal bins over ``size``."""
  bins = min(size, max_bins)
  return np.unique(np.linspace(0, size, bins, endpoint=False).astype(np.int64))


def _binned_cycles(tile_cycles: np.ndarray, executions: np.ndarray):
  """Downsamples ``[steps, tiles]`` cycles x executions for drawing.

  Steps are summed in a bin (time spent in that stretch of the program) and
  tiles take their bin's busiest tile, so hot spots stay visible.

  Returns:
    (image [tiles_binned, steps_binned], step starts, tile starts).
  """
  weighted = tile_cycles * executions[:, None]
  step_starts = _bin_edges(weighted.shape[0], _MAX_HEATMAP_STEPS)
  tile_starts = _bin_edges(weighted.shape[1], _MAX_HEATMAP_TILES)
  binned = np.add.reduceat(weighted, step_starts, axis=0)
  binned = np.maximum.reduceat(binned, tile_starts, axis=1)
  return binned.T, step_starts, tile_starts


def _cycles_heatmap_figure(data: _ReportData, tile_cycles: np.ndarray,
                           figure_class=None):
  """Compute cycles per tile (rows) and superstep (columns)."""
  figure_class = figure_class or _load_matplotlib()
  fig = figure_class(figsize=(12, 6), layout="constrained")
  ax = fig.add_subplot()
  steps, tiles = tile_cycles.shape
  if steps == 0 or tiles == 0:
    ax.text(0.5, 0.5, "no supersteps", ha="center", va="center")
    return fig
  image, step_starts, tile_starts = _binned_cycles(tile_cycles,
                                                   data.steps.executions)
  extent = (-0.5, steps - 0.5, -0.5, tiles - 0.5)
  shown = ax.imshow(image, aspect="auto", origin="lower", extent=extent,
                    interpolation="nearest", cmap="viridis")
  fig.colorbar(shown, ax=ax, label="compute cycles x executions")
  if steps <= 30:
    ax.set_xticks(np.arange(steps))
    ax.set_xticklabels([n or o for n, o in zip(data.steps.names,
                                               data.steps.ops)],
                       rotation=60, ha="right", fontsize=7)
  _mark_ipus(ax, data.target, tiles_on_y=True)
  binned = []
  if len(step_starts) < steps:
    binned.append(f"{len(step_starts)} bins of supersteps (summed)")
  if len(tile_starts) < tiles:
    binned.append(f"{len(tile_starts)} bins of tiles (busiest tile)")
  ax.set_xlabel("superstep" + (f" — {', '.join(binned)}" if binned else ""))
  ax.set_ylabel("tile")
  ax.set_title(f"{data.name}: compute cycles per tile and superstep")
  return fig


def _live_memory_figure(data: _ReportData, figure_class=None):
  """Bytes live on the device at each step of the program."""
  figure_class = figure_class or _load_matplotlib()
  fig = figure_class(figsize=(12, 4), layout="constrained")
  ax = fig.add_subplot()
  live = data.live
  if live.size == 0:
    ax.text(0.5, 0.5, "no liveness information", ha="center", va="center")
    return fig
  steps = np.arange(live.size)
  ax.step(steps, live, where="mid", color="#1f77b4")
  ax.fill_between(steps, live, step="mid", alpha=0.3, color="#1f77b4")
  peak_step = int(np.argmax(live))
  label = ""
  if peak_step < len(data.steps):
    label = f" at {data.steps.names[peak_step] or data.steps.ops[peak_step]}"
  ax.scatter([peak_step], [live[peak_step]], color="red", zorder=3,
             label=f"peak {_fmt_bytes(live[peak_step])}{label}")
  top = live.max() * 1.15 if live.max() > 0 else 1
  ax.set_ylim(0, top)
  if top >= 1 << 20:
    _binary_axis(ax.yaxis, top, "MiB", 1 << 20)
  else:
    _binary_axis(ax.yaxis, top, "KiB", 1 << 10)
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.set_xlabel("superstep")
  ax.set_ylabel("bytes live on the device")
  ax.set_title(f"{data.name}: live memory over the program")
  ax.legend(loc="upper left", fontsize=8)
  return fig


# ----------------------------------------------------------------------------
# Comparison.
# ----------------------------------------------------------------------------


def _change(a: float, b: float) -> str:
  if a == b:
    return "0.0%"
  if a == 0:
    return "new"
  return f"{100.0 * (b - a) / abs(a):+.1f}%"


def _compare_row(label: str, a: float, b: float) -> list:
  return [label, _fmt_int(a), _fmt_int(b), f"{b - a:+,.0f}", _change(a, b)]


def _memory_rows(a: _ReportBase, b: _ReportBase, reduce) -> list:
  cats_a, cats_b = a.memory_by_category, b.memory_by_category
  names = _ordered_categories({**cats_a, **cats_b})

  def value(categories, name):
    array = categories.get(name)
    return float(reduce(array)) if array is not None and array.size else 0.0

  rows = [_compare_row("  " + _category_label(c), value(cats_a, c),
                       value(cats_b, c)) for c in names]
  peak_a = float(reduce(a.memory_per_tile)) if a.memory_per_tile.size else 0.0
  peak_b = float(reduce(b.memory_per_tile)) if b.memory_per_tile.size else 0.0
  return rows + [_compare_row("  Total (peak)", peak_a, peak_b)]


def compare_reports(a, b, top: int = 20) -> str:
  """What changed from report ``a`` to report ``b``, side by side.

  Args:
    a, b: :class:`Report`, :class:`SavedReport`, ``ProgramProfile`` or a
      report path, in any mix.
    top: how many operations to list (those with the most cycles).

  Returns:
    Multi-line text: memory by category (total over the device and on the
    peak tile), cycles by phase, estimated time, and cycles by operation, each
    with the delta and % change.
  """
  a, b = _as_report(a), _as_report(b)
  header = ["", f"A: {a.name}", f"B: {b.name}", "Delta (B-A)", "Change"]
  right = (False, True, True, True, True)
  rows = [["Memory, total over device (bytes)", "", "", "", ""]]
  rows += _memory_rows(a, b, np.sum)
  rows += [["Memory, peak tile (bytes)", "", "", "", ""]]
  rows += _memory_rows(a, b, np.max)
  rows += [_compare_row("  Tiles used", a.tiles_used, b.tiles_used),
           _compare_row("  Tiles over the limit", a.over_limit_tiles.size,
                        b.over_limit_tiles.size)]
  rows += [["Cycles", "", "", "", ""],
           _compare_row("  Compute", a.compute_cycles, b.compute_cycles),
           _compare_row("  Exchange", a.exchange_cycles, b.exchange_cycles),
           _compare_row("  Sync", a.sync_cycles, b.sync_cycles),
           _compare_row("  Total", a.total_cycles, b.total_cycles),
           ["  Estimated time", _fmt_seconds(a.estimated_seconds),
            _fmt_seconds(b.estimated_seconds),
            _fmt_seconds(b.estimated_seconds - a.estimated_seconds),
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
  title = [f"Comparing A = {a.name} ({a.target.name}, {a.target.num_ipus} "
           f"IPU(s), {a.target.num_tiles:,} tiles) with B = {b.name} "
           f"({b.target.name}, {b.target.num_ipus} IPU(s), "
           f"{b.target.num_tiles:,} tiles)", ""]
  return "\n".join(title + _table(header, rows, indent="", right=right)) + "\n"


# ----------------------------------------------------------------------------
# Auto-save and command line.
# ----------------------------------------------------------------------------


def _safe_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "program"


def maybe_auto_save(report, directory: Optional[str | os.PathLike]
                    ) -> Optional[str]:
  """Saves ``report`` into a fresh ``directory/<name>-<n>/`` folder.

  Used to keep a report of every compiled program: ``n`` counts up from 0 so
  earlier reports are never overwritten, even by concurrent saves.

  Args:
    report: a :class:`Report` (or a ``ProgramProfile``).
    directory: the parent folder; None disables saving.

  Returns:
    The folder written, or None when ``directory`` is None.
  """
  if directory is None:
    return None
  report = _as_report(report)
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  stem = _safe_name(report.name)
  pattern = re.compile(re.escape(stem) + r"-(\d+)$")
  taken = [int(m.group(1)) for m in map(pattern.match, os.listdir(directory))
           if m]
  n = max(taken) + 1 if taken else 0
  while True:
    path = os.path.join(directory, f"{stem}-{n}")
    try:
      os.makedirs(path)
      break
    except FileExistsError:
      n += 1
  report.save(path)
  return path


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m ipu_jax.report A [B]``: summary of A, or A compared to B."""
  parser = argparse.ArgumentParser(
      prog="python -m ipu_jax.report",
      description="Print the summary of a saved ipu-jax report, or compare "
                  "two reports.")
  parser.add_argument("reports", nargs="+", metavar="REPORT",
                      help="a report directory or its report.json (one to "
                           "summarise, two to compare)")
  parser.add_argument("--top", type=int, default=None,
                      help="how many operations / tensors to list")
  args = parser.parse_args(argv)
  if len(args.reports) > 2:
    parser.error("give one report to summarise or two to compare")
  try:
    loaded = [load_report(path) for path in args.reports]
  except (OSError, ValueError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  if len(loaded) == 1:
    text = loaded[0].summary(**({"top": args.top} if args.top else {}))
  else:
    text = compare_reports(*loaded, **({"top": args.top} if args.top else {}))
  sys.stdout.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
