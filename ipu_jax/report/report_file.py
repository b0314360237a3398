"""``report.json``: its schema, and a report's data to and from it.

:func:`data_from_json` gives the :class:`~ipu_jax.report.data.ReportData` a
live profile gives (:func:`~ipu_jax.report.data.data_from_profile`), so a
saved report shows what the live one showed.

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
      "constant_folding": null | {       # added key: computed on the host
        "equations_folded": int,         # (lowering/constant_folding.py); null
        "by_primitive": {str: int}       # when not lowered from a jaxpr
      },
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
from typing import Any, Optional

import numpy as np

from ipu_jax.kernels.target import IPUTarget
from ipu_jax.report.data import ReportData, StepTable, expand_runs, int_array, tile_runs

SCHEMA = "ipu-jax-report"
SCHEMA_VERSION = 2
REPORT_FILE = "report.json"


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


def make_directory(directory: str, who: str) -> None:
  """``os.makedirs``, a file in the way named as the caller's mistake."""
  try:
    os.makedirs(directory, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise ValueError(f"{who}: {directory} is (or lies under) a file, not a directory; give a "
                     f"directory to write the report into.") from None
