"""The data a report shows: one table every view reads, from a profile or a file.

A report's numbers come either from a live
:class:`~ipu_jax.lowering.profile.ProgramProfile` (:func:`data_from_profile`)
or from a saved ``report.json`` (:func:`ipu_jax.report.report_file.data_from_json`);
both give the same :class:`ReportData`, which every view (summary, trace, plots,
HTML, comparison) reads. Per-tile arrays are reduced here once, with NumPy over
whole ``[steps, tiles]`` arrays, so no view loops over tiles. The file's schema
and (de)serialisation are in :mod:`ipu_jax.report.report_file`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import numpy as np

from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.lowering.profile import ProgramProfile, program_flops_dtype
from ipu_jax.kernels.cost_model import cost_model_json
from ipu_jax.kernels.target import IPUTarget

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
