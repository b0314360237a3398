"""The benchmark's ``pod`` suite: what estimating BERT, ResNet-50 and GPT-2 on IPU-PODs costs.

Each row runs ``python -m experiments.bert_pretraining --config C
--estimate_only --json_out F`` (the ``resnet_*`` rows:
``experiments.resnet_training``; the ``gpt2_*`` rows, which have no
published measurement: ``experiments.gpt2_training``) in its own subprocess and records its wall
time, the lowering time and the peak RSS the run reports (its own process's high-water
mark, ``host_time.peak_rss_bytes``), with the estimate itself (samples/s, sequences/s, step
seconds, fits) and whether the run stayed within the host budget of issue 27
(<= 180 s wall, <= 8 GB peak RSS). Rows with a published measurement
(``MEASURED``: the BERT and ResNet-50 MLPerf runs, docs/published_bert.md and
docs/published_resnet.md, and Graphcore's performance-results tables,
docs/published_tables.md) carry it, the figure of the runner's JSON it is
compared with (``UNITS``: ``sequences_per_second`` for BERT,
``samples_per_second`` = images/s for ResNet-50) and the estimate's ratio to
it; the table ends with the geometric-mean and worst ratio over all measured
rows and per family (``python -m experiments.calibration_table`` writes the
same as docs/calibration.md's table and a plot)::

    python -m experiments.benchmark --suite=pod [--rows=phase2_pod16] \
        --json_out=experiments/results/pod.json
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time

__all__ = ["ROWS", "RUNNERS", "MEASURED", "UNITS", "BUDGET_SECONDS", "BUDGET_RSS_BYTES",
           "run_row", "row_result", "compare", "family", "table", "measured_rows",
           "summary_lines"]

# Issue 27's host budget for an estimate.
BUDGET_SECONDS = 180.0
BUDGET_RSS_BYTES = 8 * 10**9

# row name -> the runner's arguments.
ROWS = {
    "phase2_pod16": ["--config=phase2_pod16", "--packing_factor=2"],
    "phase1_pod16": ["--config=phase1_pod16"],
    "phase1_pod64": ["--config=phase1_pod64"],
    "phase1_pod16_base": ["--config=phase1_pod16", "--model=base"],
    "phase2_pod64": ["--config=phase2_pod64", "--packing_factor=2"],
    # The two configurations with a published measurement (docs/calibration.md).
    "mlperf_v1_pod16": ["--config=mlperf_v1_pod16"],
    "mlperf_v1_pod64": ["--config=mlperf_v1_pod64"],
}

# BERT-Large: Graphcore's MLPerf Training v1.1 and v2.0 closed runs
# (experiments/bert_presets.py, docs/published_bert.md#measurements).
_BERT_MLPERF = ("mlperf_v1_1_pod16", "mlperf_v1_1_pod64", "mlperf_v1_1_pod128",
                "mlperf_v2_bow_pod16", "mlperf_v2_bow_pod64", "mlperf_v2_bow_pod128",
                "mlperf_v2_bow_pod256")
ROWS.update({name: [f"--config={name}"] for name in _BERT_MLPERF})

# ResNet-50: Graphcore's MLPerf Training runs (experiments/resnet_presets.py).
_RESNET_PRESETS = ("mlperf_v1_pod16", "mlperf_v1_pod64", "mlperf_v1_1_pod16", "mlperf_v1_1_pod64",
                   "mlperf_v1_1_pod128", "mlperf_v1_1_pod256", "mlperf_v2_bow_pod16",
                   "mlperf_v2_bow_pod64", "mlperf_v2_bow_pod128", "mlperf_v2_bow_pod256")
ROWS.update({f"resnet_{name}": [f"--config={name}"] for name in _RESNET_PRESETS})

# Graphcore's published performance-results tables (docs/published_tables.md):
# the runner preset of the same configuration, asked on the table's system.
# The BERT examples run half partials (TensorFlow 2: options.py
# matmul_partials_type "half"; PyTorch: enable_half_partials: True).
_HALF = "--partials_type=float16"
_TABLE_ROWS = {
    # BERT-Large phase 1, TensorFlow 2: the example's own config
    # (configs/pretrain_large_128_phase1.json, the tf2_phase1_pod16 preset:
    # micro-batch 8, 4 replicas, G 2,040 = the table's 65,280).
    "table_bert_large_ph1_bow_pod16": ["--config=tf2_phase1_pod16", "--system=bow-pod16",
                                       _HALF],
    # ... on a Bow Pod64 (pretrain_large_128_phase1_POD64.json, tf2_phase1_pod64):
    # the table's batch 66,560 = 8 x 16 replicas x G 520 (the file's G is 1,020).
    "table_bert_large_ph1_bow_pod64": ["--config=tf2_phase1_pod64", "--system=bow-pod64",
                                       "--accumulation=520", _HALF],
    # BERT-Base phase 1, TensorFlow 2 (pretrain_base_128_phase1.json,
    # tf2_base_phase1_pod16: 32 x 4 x 510).
    "table_bert_base_ph1_bow_pod16": ["--config=tf2_base_phase1_pod16", "--model=base",
                                      "--system=bow-pod16", _HALF],
    # BERT-Large phase 2 packed, PyTorch (pretrain_large_512, 2 sequences a pack):
    # the table's batch of 8,192 sequences is 4,096 packs of micro-batch 2, G 512
    # on 4 replicas (510: the Grouped schedule's multiple of 10), G 128 on 16 (130).
    "table_bert_large_ph2_bow_pod16": ["--config=phase2_pod16", "--packing_factor=2",
                                       "--system=bow-pod16", "--accumulation=510", _HALF],
    "table_bert_large_ph2_bow_pod64": ["--config=phase2_pod64", "--packing_factor=2",
                                       "--system=bow-pod64", "--accumulation=130", _HALF],
    # ResNet-50, TensorFlow 1, pre-SDK 2.5: the MLPerf configurations of the
    # table's global batch (1,920 = 20 x 6 x 16; 2,560 = 20 x 2 x 64;
    # 10,240 = 20 x 2 x 256) on Bow Pods.
    "table_resnet_bow_pod16": ["--config=mlperf_v1_pod16", "--system=bow-pod16"],
    "table_resnet_bow_pod64": ["--config=mlperf_v1_pod64", "--system=bow-pod64"],
    "table_resnet_bow_pod256": ["--config=mlperf_v1_1_pod256", "--system=bow-pod256"],
}
ROWS.update(_TABLE_ROWS)

# GPT-2: Graphcore's PopTorch example's benchmarks.yml entries
# (experiments/gpt2_presets.py); no published measurement (docs/published_tables.md).
_GPT2_PRESETS = ("small_pod16", "small_pod64", "medium_pod16", "medium_pod64",
                 "large_sl512_pod16", "large_sl512_pod64", "large_pod16")
ROWS.update({f"gpt2_{name}": [f"--config={name}"] for name in _GPT2_PRESETS})

# row name -> the runner module it runs (default: the BERT runner).
RUNNERS = {f"resnet_{name}": "experiments.resnet_training" for name in _RESNET_PRESETS}
RUNNERS.update({f"gpt2_{name}": "experiments.gpt2_training" for name in _GPT2_PRESETS})
RUNNERS.update({name: "experiments.resnet_training" for name in _TABLE_ROWS
                if name.startswith("table_resnet")})

# row name -> the published measurement, in the unit of its family (UNITS).
# ResNet-50 MLPerf rows: images/s from the MLPerf result logs; v1.1 and v2.0
# by the steady-epoch rule (docs/published_resnet.md#steady-epochs: epochs of 5
# executions with no checkpoint save, 5 x updates x global batch images each),
# v1.0 by the first rule (the median over the 5 runs of each run's median epoch
# rate, 1,281,167 images / epoch_stop - epoch_start;
# docs/published_resnet.md#measurements). BERT MLPerf
# rows: sequences/s, the median over the 10 runs of each run's median block
# rate, from the logs (docs/published_bert.md#measurements). table_* rows:
# the items/s of Graphcore's performance-results tables
# (docs/published_tables.md), sequences/s for BERT, images/s for ResNet-50.
MEASURED = {"resnet_mlperf_v1_pod16": 27522.0, "resnet_mlperf_v1_pod64": 83420.0,
            "resnet_mlperf_v1_1_pod16": 29619.0, "resnet_mlperf_v1_1_pod64": 106937.0,
            "resnet_mlperf_v1_1_pod128": 185333.0, "resnet_mlperf_v1_1_pod256": 348110.0,
            "resnet_mlperf_v2_bow_pod16": 42770.0, "resnet_mlperf_v2_bow_pod64": 148080.0,
            "resnet_mlperf_v2_bow_pod128": 237719.0, "resnet_mlperf_v2_bow_pod256": 448965.0,
            "mlperf_v1_pod16": 1419.0, "mlperf_v1_pod64": 4241.0,
            "mlperf_v1_1_pod16": 1524.0, "mlperf_v1_1_pod64": 4792.0,
            "mlperf_v1_1_pod128": 9028.0, "mlperf_v2_bow_pod16": 2304.0,
            "mlperf_v2_bow_pod64": 7411.0, "mlperf_v2_bow_pod128": 12676.0,
            "mlperf_v2_bow_pod256": 19071.0,
            "table_bert_large_ph1_bow_pod16": 4527.0, "table_bert_large_ph1_bow_pod64": 18199.0,
            "table_bert_base_ph1_bow_pod16": 15173.0, "table_bert_large_ph2_bow_pod16": 1973.0,
            "table_bert_large_ph2_bow_pod64": 6543.0, "table_resnet_bow_pod16": 42029.0,
            "table_resnet_bow_pod64": 145287.0, "table_resnet_bow_pod256": 425514.0}


def family(name: str) -> str:
  """A row's model family: ``ResNet-50``, ``BERT-Base``, ``BERT-Large`` or ``GPT-2``."""
  if "resnet" in name:
    return "ResNet-50"
  if "gpt2" in name:
    return "GPT-2"
  return "BERT-Base" if "--model=base" in ROWS.get(name, ()) else "BERT-Large"


# family -> (unit of the measurement, the runner's JSON key compared with it).
UNITS = {"ResNet-50": ("images/s", "samples_per_second"),
         "BERT-Large": ("sequences/s", "sequences_per_second"),
         "BERT-Base": ("sequences/s", "sequences_per_second"),
         "GPT-2": ("tokens/s", "tokens_per_second")}


def compare(name: str, result: dict) -> dict:
  """The fields a row with a measurement adds: what is compared, and the ratio.

  ``ratio`` is the estimate over the measurement, both in the family's unit
  (:data:`UNITS`): above 1 the estimate is faster than the hardware was.
  """
  unit, key = UNITS[family(name)]
  estimate = result.get(key, result["samples_per_second"])
  return {"family": family(name), "measured": MEASURED[name], "measured_unit": unit,
          "compared_key": key, "estimate": estimate, "ratio": estimate / MEASURED[name]}


def run_row(name: str, timeout: float) -> dict:
  """One row in its own subprocess; its figures or an ``error``."""
  if name not in ROWS:
    raise ValueError(f"Unknown pod row {name!r}; valid rows are {sorted(ROWS)}.")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "estimate.json")
    runner = RUNNERS.get(name, "experiments.bert_pretraining")
    cmd = [sys.executable, "-m", runner, *ROWS[name],
           "--estimate_only", f"--json_out={out}"]
    start = time.time()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=timeout,
                            env=dict(os.environ, IPU_JAX_PROGRESS="0"))
    except subprocess.TimeoutExpired:
      return {"workload": name, "error": f"timed out after {timeout} s"}
    wall = time.time() - start
    if proc.returncode or not os.path.exists(out):
      return {"workload": name, "wall_s": wall, "error": proc.stderr[-500:]}
    with open(out) as f:
      return row_result(name, json.load(f), wall)


def row_result(name: str, result: dict, wall: float) -> dict:
  """A runner's JSON as the suite records it: host cost, budget, and the measurement."""
  result = dict(result, workload=name, wall_s=wall, args=ROWS[name],
                within_budget=wall <= BUDGET_SECONDS
                and result["peak_rss_bytes"] <= BUDGET_RSS_BYTES, error=None)
  if name in MEASURED:
    result.update(compare(name, result))
  return result


def table(results: list) -> str:
  lines = ["| row | wall s | lower s | peak RSS GiB | fits | samples/s | sequences/s | step s "
           "| within budget |", "|" + "---|" * 9]
  for r in results:
    if r.get("error"):
      lines.append(f"| {r['workload']} |" + " |" * 7 + f" ERROR {r['error'][-200:]} |")
      continue
    lines.append(f"| {r['workload']} | {r['wall_s']:.1f} | {r['lower_seconds']:.1f} "
                 f"| {r['peak_rss_bytes'] / 2**30:.2f} | {r['fits']} "
                 f"| {r['samples_per_second']:,.1f} "
                 f"| {r.get('sequences_per_second', r['samples_per_second']):,.1f} "
                 f"| {r['step_seconds']:.3f} | {r['within_budget']} |")
  measured = measured_rows(results)
  if measured:
    lines += ["", "| row | family | estimate | measured | unit | ratio |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['family']} | {r['estimate']:,.0f} | {r['measured']:,.0f} "
              f"| {r['measured_unit']} | {r['ratio']:.3f} |" for r in measured]
    lines += summary_lines(measured)
  return "\n".join(lines)


def measured_rows(results: list) -> list:
  """The rows with a measurement and no error, each with its family, unit and estimate.

  Results written before the compared figure was recorded per row (only
  ``measured_samples_per_second``) are read as samples/s.
  """
  rows = []
  for r in results:
    if r.get("error") or "ratio" not in r:
      continue
    name = r["workload"]
    fam = r.get("family") or family(name)
    rows.append(dict(r, family=fam, measured=r.get("measured", r.get(
        "measured_samples_per_second")), measured_unit=r.get("measured_unit", UNITS[fam][0]),
        estimate=r.get("estimate", r["samples_per_second"])))
  return rows


def _geomean(ratios) -> float:
  return math.exp(sum(map(math.log, ratios)) / len(ratios))


def _worst(ratios) -> float:
  """The ratio farthest from 1 on a log scale (0.5 and 2.0 are equally far)."""
  return max(ratios, key=lambda x: abs(math.log(x)))


def summary_lines(measured: list) -> list:
  """The geometric-mean and worst ratio over every measured row, then per family."""
  ratios = [r["ratio"] for r in measured]
  lines = [f"geometric-mean ratio {_geomean(ratios):.3f}, worst {_worst(ratios):.3f} "
           f"({len(ratios)} measured rows)"]
  families = sorted({r["family"] for r in measured})
  if len(families) > 1:
    for fam in families:
      sub = [r["ratio"] for r in measured if r["family"] == fam]
      lines.append(f"  {fam}: geometric-mean ratio {_geomean(sub):.3f}, worst "
                   f"{_worst(sub):.3f} ({len(sub)} rows)")
  return lines
