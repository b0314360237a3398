"""The data a report shows, and ``report.json``: its schema and (de)serialisation.

A report's numbers come either from a live
:class:`~ipu_jax.lowering.profile.ProgramProfile` (:func:`data_from_profile`)
or from a saved ``report.json`` (:func:`data_from_json`); both give the same
:class:`ReportData`, which every view (summary, trace, plots, HTML,
comparison) reads. Per-tile arrays are reduced here once, with NumPy over
whole ``[steps, tiles]`` arrays, so no view loops over tiles.

``report.json`` schema, version 2 (all bytes are integers, cycles floats;
version 2 added the keys marked ``v2``, version 1 files still load)::

    {
      "schema": "ipu-jax-report",
      "version": 2,
      "name": str,                       # ProgramProfile.name
      "target": {                        # every IPUTarget field, plus:
        "name": str, "num_ipus": int, "tiles_per_ipu": int,
        "bytes_per_tile": int, "clock_hz": float, ...,
        "num_tiles": int
      },
      "cost_model": {                    # optional: absent in older files
        "version": str,                  # ipu_jax.kernels.cost_model.COST_MODEL_VERSION
        "calibrated": [str], "estimates": [str]   # IPUTarget figure names
      },
      "totals": {                        # derived, for readers of the file
        "step_cycles", "step_seconds": float,  # added: the headline, one execution
                                         # with its host I/O where the program
                                         # streams data each iteration, else
                                         # the device cycles (report/host_io.py)
        "step_includes_host_io": bool,   # added: which of the two it is
        "device_cycles": float,          # added: = "cycles" (device only)
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
          {"name", "category", "bytes", "op", "source"}],
        "peak_step": [int] * num_tiles   # v2: step of each tile's peak of
                                         # not-always-live bytes, -1 if none
      },
      "live_over_program": [int] * num_steps,   # bytes live on the device
      "steps": [{                        # in program order
        "name", "op", "source": str,
        "scope": str,                    # added key: module path ('' if none)
        "compute_cycles_max", "compute_cycles_mean": float,
        "compute_cycles_per_ipu": [float] * num_ipus,  # slowest tile per IPU
        "ipus": [int],                   # IPUs taking part
        "tiles_busy": int, "vertices": int,
        "exchange_cycles", "sync_cycles": float,
        "executions": int, "flops": int,
        "exchange_bytes_in", "exchange_bytes_out": int,   # summed over tiles
        "ipu_link_bytes", "host_bytes": int,
        "temporary_bytes_peak": int,     # the step's working memory, busiest tile
        "fused_ops": [[str, str]],      # [op, source] of each operation fused
                                         # into this compute set ([] if none)
        "compute_cycles_tiles": [[int, int, float]],  # v2: runs of busy tiles
                                         # [first_tile, count, cycles]
        "codelets": [str],               # added: vertex types its compute set runs
        "exchange_bytes_in_tiles",       # added: runs [first_tile, count, bytes]
        "exchange_bytes_out_tiles",      # of bytes each tile receives / sends,
        "scratch_bytes_tiles": [[int, int, int]]  # and of its scratch
      }],
      "program_tree": {...},             # added: Report.program_tree() (the
                                         # control program with cycles;
                                         # ipu_jax/report/program_tree.py)
      "codelets": [{                     # added: per vertex type
        "codelet": str, "compute_sets", "executions", "tiles",
        "code_bytes", "vertex_state_bytes": int,
        "cycles": float, "vertices": float  # shared equally by the types
      }],                                # of one compute set
      "tensors": [{
        "name", "dtype", "category", "op", "source": str, "shape": [int],
        "scope": str,                    # added key: module path ('' if none)
        "total_bytes": int, "tiles": int,  # number of tiles holding a part
        "max_bytes_per_tile": int, "live_from", "live_to": int,
        "placement": [[int, int, int]]   # v2: [first_tile, count, bytes per
                                         # tile], runs in tile order
      }],
      "streaming": null | {...},         # added key: streaming memory and its
                                         # copies (ipu_jax/report/streaming.py)
      "number_formats": null | {...},    # added key: loss-scale and FP8-scale
                                         # histories (ipu_jax/report/precision.py)
      "dead_code": null | {              # added key: removed before lowering
        "equations_removed": int,        # nested jaxprs' equations included
        "by_primitive": {str: int}       # (lowering/dead_code.py); null when
      },                                 # not lowered from a jaxpr
      "host_io": null | {...}            # added key: an on-device loop's host
                                         # transfers, I/O tiles, overlap
                                         # (ipu_jax/report/host_io.py)
      "host_side": null | {              # added key (ipu_jax/report/host_side.py)
        "modelled": {...},               # host-link bytes, time, syncs per run
        "measured_on_this_machine": {...}  # tracing, lowering, cache, compile,
      }                                  # calls: this machine's wall clock
    }

Readers must check ``schema`` and ``version``; later versions only add keys.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterable, Optional

import numpy as np

from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.lowering.profile import ProgramProfile, program_flops_dtype
from ipu_jax.kernels.cost_model import cost_model_json
from ipu_jax.kernels.target import IPUTarget

SCHEMA = "ipu-jax-report"
SCHEMA_VERSION = 2

REPORT_FILE = "report.json"
TRACE_FILE = "trace.json"
MEMORY_PLOT_FILE = "memory_per_tile.png"
HEATMAP_PLOT_FILE = "cycles_heatmap.png"
LIVE_PLOT_FILE = "live_memory.png"
PLOTS_MISSING_FILE = "PLOTS_MISSING.txt"
# ----------------------------------------------------------------------------
# The data a report shows, independent of where it came from.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class StepTable:
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
  notes: list = dataclasses.field(default_factory=list)  # per step: how it is costed
  # per step: [[op, source], ...] of the operations fused into it ([] if none)
  fused_ops: list = dataclasses.field(default_factory=list)
  # per step: the vertex types (codelets) its compute set runs
  codelets: list = dataclasses.field(default_factory=list)
  scopes: list = dataclasses.field(default_factory=list)  # per step: module path ('' if none)

  def __len__(self) -> int:
    return len(self.names)

  @property
  def cycles_per_execution(self) -> np.ndarray:
    return self.sync + self.exchange + self.compute_max

  @property
  def weighted_cycles(self) -> np.ndarray:
    return self.cycles_per_execution * self.executions


@dataclasses.dataclass
class ReportData:
  """Everything summary, compare, trace and plots need."""

  name: str
  target: IPUTarget
  host_round_trips: int
  flops_dtype: str
  categories: dict          # category -> [num_tiles] int64
  peak: np.ndarray          # [num_tiles] int64
  tile_limit: int
  live: np.ndarray          # [num_steps] int64
  steps: StepTable
  tensors: list             # list of dicts, as in report.json
  peak_tile_tensors: list   # list of dicts, as in report.json
  peak_step: np.ndarray     # [num_tiles] step of each tile's peak, -1 unknown
  tile_cycles: Optional[np.ndarray] = None  # [num_steps, num_tiles] or None
  # Cost-model provenance (ipu_jax.kernels.cost_model.cost_model_json()); None for a
  # report.json written before the cost model was versioned.
  cost_model: Optional[dict] = None
  # The control program's shape over the step indices
  # (lowering/control_tree.py); None when unknown (then a flat sequence).
  control: Optional[dict] = None
  # Per step, runs over tiles ([[first, count, bytes]]) of the bytes each tile
  # receives, sends, and holds as the step's scratch; None when unknown.
  tile_exchange: Optional[dict] = None
  # Per codelet: compute sets, cycles, vertices and code bytes (views.py).
  codelet_table: Optional[list] = None


def int_array(values, size: Optional[int] = None) -> np.ndarray:
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


def per_tile(values, num_tiles: int) -> np.ndarray:
  array = np.asarray(values if values is not None else np.zeros(num_tiles),
                     dtype=np.float64).ravel()
  if array.size == num_tiles:
    return array
  fixed = np.zeros(num_tiles)
  fixed[:min(num_tiles, array.size)] = array[:num_tiles]
  return fixed


def _steps_from_profile(profile: ProgramProfile) -> StepTable:
  """Reduces the per-tile step arrays of a profile to per-step columns."""
  target = profile.target
  n, num_ipus, per_ipu = target.num_tiles, target.num_ipus, target.tiles_per_ipu
  steps = profile.steps
  cycles = np.stack([per_tile(s.compute_cycles, n) for s in steps]) \
      if steps else np.zeros((0, n))
  bytes_in = np.stack([per_tile(s.exchange_bytes_in, n) for s in steps]) \
      if steps else np.zeros((0, n))
  bytes_out = np.stack([per_tile(s.exchange_bytes_out, n) for s in steps]) \
      if steps else np.zeros((0, n))
  per_ipu_cycles = cycles.reshape(len(steps), num_ipus, per_ipu).max(axis=2) \
      if steps else np.zeros((0, num_ipus))
  active = (cycles + bytes_in + bytes_out).reshape(
      len(steps), num_ipus, per_ipu).max(axis=2) > 0
  vertices = [int(np.sum(s.vertices)) if s.vertices is not None else 0
              for s in steps]
  return StepTable(
      names=[str(s.name) for s in steps],
      ops=[str(s.op) for s in steps],
      sources=[str(s.source or "") for s in steps],
      scopes=[str(getattr(s, "scope", "") or "") for s in steps],
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
      bytes_in=int_array(bytes_in.sum(axis=1)),
      bytes_out=int_array(bytes_out.sum(axis=1)),
      ipu_link_bytes=np.asarray([int(s.ipu_link_bytes) for s in steps],
                                np.int64),
      host_bytes=np.asarray([int(s.host_bytes) for s in steps], np.int64),
      temporary_peak=np.asarray(
          [int(np.max(s.temporary_bytes)) if getattr(s, "temporary_bytes", None) is not None
           and np.size(s.temporary_bytes) else 0 for s in steps], np.int64),
      notes=[list(getattr(s, "notes", ()) or ()) for s in steps],
      fused_ops=[[[f.op, f.source] for f in getattr(s, "fused_ops", ())] for s in steps],
      codelets=[list(getattr(s, "codelets", ()) or ()) for s in steps],
  )


def codelet_table(profile: ProgramProfile) -> list:
  """Per vertex type (codelet): compute sets, cycles, vertices, code bytes.

  Code is charged once per vertex type per tile (as the memory model does),
  so ``code_bytes`` is exact. A compute set running several vertex types
  has one compute phase: its cycles and vertices are shared equally among
  its types (the cost model prices the phase, not each type), so the
  ``cycles`` column adds up to the program's compute cycles.

  Returns:
    Rows ``{"codelet", "compute_sets", "executions", "cycles", "vertices",
    "tiles", "code_bytes", "vertex_state_bytes"}``, most cycles first.
  """
  target = profile.target
  n = target.num_tiles
  rows, masks = {}, {}
  for step in profile.steps:
    names = list(getattr(step, "codelets", ()) or ())
    if not names:
      continue
    vertices = (per_tile(step.vertices, n) if step.vertices is not None
                else (per_tile(step.compute_cycles, n) > 0).astype(float))
    share = 1.0 / len(names)
    for name in names:
      row = rows.setdefault(name, {"codelet": name, "compute_sets": 0,
                                   "executions": 0, "cycles": 0.0,
                                   "vertices": 0.0})
      row["compute_sets"] += 1
      row["executions"] += int(step.executions)
      row["cycles"] += step.compute_phase_cycles * step.executions * share
      row["vertices"] += float(vertices.sum()) * share
      mask = masks.setdefault(name, np.zeros(n, bool))
      mask |= vertices > 0
  for name, row in rows.items():
    # Shared vertices leave fractions (one vertex of two types: 0.5 each).
    row["vertices"] = round(row["vertices"], 2)
    row["tiles"] = int(masks[name].sum())
    row["code_bytes"] = int(row["tiles"] * target.code_bytes_per_codelet)
    row["vertex_state_bytes"] = int(row["vertices"] * target.vertex_state_bytes)
  return sorted(rows.values(), key=lambda r: (-r["cycles"], r["codelet"]))


def _busy_runs(values) -> list:
  values = np.asarray(values)
  busy = np.flatnonzero(values)
  return tile_runs(busy, values[busy])


def _tile_exchange(profile: ProgramProfile) -> dict:
  """Per step, the runs over tiles of bytes received, sent and of scratch.

  What the per-tile liveness and the exchange heatmap of report.html read;
  runs keep them small (a step's tiles mostly hold equal amounts).
  """
  n = profile.target.num_tiles
  received, sent, scratch = [], [], []
  for step in profile.steps:
    bytes_in = per_tile(step.exchange_bytes_in, n)
    received.append(_busy_runs(bytes_in))
    sent.append(_busy_runs(per_tile(step.exchange_bytes_out, n)))
    own = (np.zeros(n) if step.temporary_bytes is None
           else np.maximum(per_tile(step.temporary_bytes, n) - bytes_in, 0))
    scratch.append(_busy_runs(own))
  return {"bytes_in": received, "bytes_out": sent, "scratch": scratch}


def tile_runs(tiles, values) -> list:
  """Run-length encodes per-tile values: ``[[first_tile, count, value]]``.

  Tensors and compute sets are mapped to intervals of tiles holding equal
  amounts, so a 1,472-tile placement is usually one or a few runs.

  Args:
    tiles: tile ids (any order, no repeats).
    values: the value on each of ``tiles``; zeros are kept.

  Returns:
    Runs of consecutive tiles with equal values, in tile order; ``value`` is
    an int when every value is integral, else a float.
  """
  tiles = np.asarray(tiles, np.int64).ravel()
  values = np.asarray(values, np.float64).ravel()
  if not tiles.size:
    return []
  order = np.argsort(tiles, kind="stable")
  tiles, values = tiles[order], values[order]
  starts = np.flatnonzero(np.r_[True, (np.diff(tiles) != 1)
                                | (values[1:] != values[:-1])])
  counts = np.diff(np.r_[starts, tiles.size])
  firsts, run_values = tiles[starts].tolist(), values[starts]
  if np.all(run_values == np.rint(run_values)):
    run_values = run_values.astype(np.int64)
  return [list(run) for run in zip(firsts, counts.tolist(),
                                   run_values.tolist())]


def expand_runs(runs: Iterable, num_tiles: int) -> np.ndarray:
  """The ``[num_tiles]`` array that :func:`tile_runs` encoded (0 elsewhere)."""
  runs = np.asarray(list(runs), np.float64).reshape(-1, 3)
  out = np.zeros(num_tiles)
  if not runs.size:
    return out
  counts = runs[:, 1].astype(np.int64)
  # Each run's tiles are first + 0..count-1: one repeat and one arange.
  offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                counts)
  tiles = np.repeat(runs[:, 0].astype(np.int64), counts) + offsets
  keep = (tiles >= 0) & (tiles < num_tiles)
  out[tiles[keep]] = np.repeat(runs[:, 2], counts)[keep]
  return out


def _peak_steps(profile: ProgramProfile) -> np.ndarray:
  """The superstep at which each tile's not-always-live memory peaks.

  Rebuilds what the memory model sums per tile and step -- temporaries over
  their live range plus each step's own scratch and exchange buffers -- with
  one difference array over ``[steps, tiles]``.
  """
  n, steps = profile.target.num_tiles, profile.steps
  if not steps:
    return np.full(n, -1, np.int64)
  live = np.stack([per_tile(s.temporary_bytes if s.temporary_bytes is not None
                            else s.exchange_bytes_in, n) for s in steps])
  ranged = [t for t in profile.tensors
            if t.category not in ALWAYS_LIVE_CATEGORIES
            and np.asarray(t.tiles).size]
  if ranged:
    lengths = [np.asarray(t.tiles).size for t in ranged]
    tiles = np.concatenate([np.asarray(t.tiles, np.int64).ravel()
                            for t in ranged])
    nbytes = np.concatenate([np.asarray(t.bytes_on_tile, np.float64).ravel()
                             for t in ranged])
    first = np.repeat([min(max(t.live_from, 0), len(steps) - 1)
                       for t in ranged], lengths)
    last = np.repeat([min(max(t.live_to, 0), len(steps) - 1)
                      for t in ranged], lengths)
    delta = np.zeros((len(steps) + 1, n))
    np.add.at(delta, (first, tiles), nbytes)
    np.add.at(delta, (last + 1, tiles), -nbytes)
    live += np.cumsum(delta[:-1], axis=0)
  peak_step = live.argmax(axis=0).astype(np.int64)
  peak_step[live.max(axis=0) <= 0] = -1
  return peak_step


def _tensor_row(tensor) -> dict:
  on_tile = np.asarray(tensor.bytes_on_tile)
  return {
      "placement": tile_runs(tensor.tiles, on_tile),
      "name": str(tensor.name),
      "shape": [int(d) for d in tensor.shape],
      "dtype": str(tensor.dtype),
      "category": str(tensor.category),
      "total_bytes": int(on_tile.sum()),
      "tiles": int(np.asarray(tensor.tiles).size),
      "max_bytes_per_tile": int(on_tile.max()) if on_tile.size else 0,
      "op": str(tensor.op or ""),
      "source": str(tensor.source or ""),
      "scope": str(getattr(tensor, "scope", "") or ""),
      "live_from": int(tensor.live_from),
      "live_to": int(tensor.live_to),
  }


def tensors_on_tile(tensors: Iterable, tile: int, limit: int = 10) -> list:
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


def data_from_profile(profile: ProgramProfile) -> ReportData:
  target = profile.target
  n = target.num_tiles
  memory = profile.memory
  categories = {c: int_array(v, n) for c, v in memory.by_category.items()}
  peak = int_array(memory.peak, n)
  worst_tile = int(np.argmax(peak)) if peak.size else 0
  tensors = [_tensor_row(t) for t in profile.tensors]
  return ReportData(
      name=str(profile.name),
      target=target,
      host_round_trips=int(profile.host_round_trips),
      flops_dtype=program_flops_dtype(profile),
      categories=categories,
      peak=peak,
      tile_limit=int(memory.tile_limit),
      live=int_array(memory.live_over_program),
      steps=_steps_from_profile(profile),
      tensors=tensors,
      peak_tile_tensors=tensors_on_tile(profile.tensors, worst_tile),
      peak_step=_peak_steps(profile),
      tile_cycles=(np.stack([per_tile(s.compute_cycles, n)
                             for s in profile.steps])
                   if profile.steps else np.zeros((0, n))),
      cost_model=cost_model_json(),
      control=getattr(profile, "control", None),
      tile_exchange=_tile_exchange(profile),
      codelet_table=codelet_table(profile),
  )


# ----------------------------------------------------------------------------
# report.json (de)serialisation.
# ----------------------------------------------------------------------------


def target_to_json(target: IPUTarget) -> dict:
  fields = dataclasses.asdict(target)
  # The system by name (a preset name reads back as the same system).
  fields["system"] = None if target.system is None else target.system.name
  fields["num_tiles"] = target.num_tiles
  return fields


def _target_from_json(fields: dict) -> IPUTarget:
  known = {f.name for f in dataclasses.fields(IPUTarget)}
  return IPUTarget(**{k: v for k, v in fields.items() if k in known})


def steps_to_json(steps: StepTable,
                  tile_cycles: Optional[np.ndarray] = None,
                  tile_exchange: Optional[dict] = None) -> list:
  """The ``steps`` rows of report.json (with per-tile runs where known)."""
  rows = [{
      "name": steps.names[i],
      "op": steps.ops[i],
      "source": steps.sources[i],
      "scope": steps.scopes[i] if i < len(steps.scopes) else "",
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
      "notes": list(steps.notes[i]) if i < len(steps.notes) else [],
      "fused_ops": [list(f) for f in steps.fused_ops[i]] if i < len(steps.fused_ops) else [],
      "codelets": list(steps.codelets[i]) if i < len(steps.codelets) else [],
  } for i in range(len(steps))]
  if tile_cycles is not None and len(tile_cycles) == len(rows):
    for row, cycles in zip(rows, tile_cycles):
      busy = np.flatnonzero(cycles)
      row["compute_cycles_tiles"] = tile_runs(busy, cycles[busy])
  if tile_exchange is not None and len(tile_exchange["bytes_in"]) == len(rows):
    for key, column in _TILE_EXCHANGE_KEYS.items():
      for row, runs in zip(rows, tile_exchange[column]):
        row[key] = runs
  return rows


# report.json step keys of ReportData.tile_exchange's columns.
_TILE_EXCHANGE_KEYS = {"exchange_bytes_in_tiles": "bytes_in",
                       "exchange_bytes_out_tiles": "bytes_out",
                       "scratch_bytes_tiles": "scratch"}


def _tile_exchange_from_json(rows: list) -> Optional[dict]:
  if not rows or any(k not in row for row in rows for k in _TILE_EXCHANGE_KEYS):
    return None
  return {column: [row[key] for row in rows]
          for key, column in _TILE_EXCHANGE_KEYS.items()}


def _steps_from_json(rows: list, num_ipus: int) -> StepTable:
  def column(key, dtype=np.float64, default=0):
    return np.asarray([row.get(key, default) for row in rows], dtype=dtype)

  per_ipu = np.zeros((len(rows), num_ipus))
  for i, row in enumerate(rows):
    values = row.get("compute_cycles_per_ipu") or [row["compute_cycles_max"]]
    per_ipu[i, :min(num_ipus, len(values))] = values[:num_ipus]
  return StepTable(
      names=[str(row.get("name", "")) for row in rows],
      ops=[str(row.get("op", "")) for row in rows],
      sources=[str(row.get("source", "")) for row in rows],
      scopes=[str(row.get("scope", "")) for row in rows],
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
      notes=[list(row.get("notes", [])) for row in rows],
      fused_ops=[[list(f) for f in row.get("fused_ops", [])] for row in rows],
      codelets=[list(row.get("codelets", [])) for row in rows],
  )


def data_from_json(document: dict) -> ReportData:
  target = _target_from_json(document["target"])
  memory = document["memory"]
  n = target.num_tiles
  return ReportData(
      name=str(document.get("name", "program")),
      target=target,
      host_round_trips=int(document.get("totals", {}).get(
          "host_round_trips", 1)),
      flops_dtype=str(document.get("totals", {}).get("flops_dtype",
                                                     "float32")),
      categories={c: int_array(v, n)
                  for c, v in memory["categories"].items()},
      peak=int_array(memory["peak"], n),
      tile_limit=int(memory["tile_limit"]),
      live=int_array(document.get("live_over_program", [])),
      steps=_steps_from_json(document.get("steps", []), target.num_ipus),
      tensors=list(document.get("tensors", [])),
      peak_tile_tensors=list(memory.get("largest_tensors_on_peak_tile", [])),
      peak_step=int_array(memory.get("peak_step", [-1] * n), n),
      tile_cycles=_tile_cycles_from_json(document.get("steps", []), n),
      cost_model=document.get("cost_model"),
      control=_control_from_json(document.get("program_tree")),
      tile_exchange=_tile_exchange_from_json(document.get("steps", [])),
      codelet_table=document.get("codelets"),
  )


def _control_from_json(tree: Optional[dict]) -> Optional[dict]:
  """The shape of a saved ``program_tree`` (its cycles are recomputed)."""
  if not isinstance(tree, dict):
    return None
  span = tree.get("steps") or []
  shape = {k: tree[k] for k in ("kind", "iterations", "replicas", "branch")
           if k in tree}
  shape["first"] = int(span[0]) if span else 0
  shape["count"] = int(span[1]) - int(span[0]) + 1 if span else 0
  if "children" in tree:
    shape["children"] = [_control_from_json(c) for c in tree["children"]]
  return shape


def _tile_cycles_from_json(rows: list, num_tiles: int) -> Optional[np.ndarray]:
  """``[steps, tiles]`` compute cycles, or None if a step lacks its runs."""
  if any("compute_cycles_tiles" not in row for row in rows):
    return None
  if not rows:
    return np.zeros((0, num_tiles))
  return np.stack([expand_runs(row["compute_cycles_tiles"], num_tiles)
                   for row in rows])


def check_schema(document: Any, origin: str) -> None:
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


def report_json_path(path_or_dir: str | os.PathLike) -> str:
  path = os.fspath(path_or_dir)
  return os.path.join(path, REPORT_FILE) if os.path.isdir(path) else path

def write_json(path: str, document: dict, indent: Optional[int] = None) -> str:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(document, f, indent=indent)
  return path

