"""The benchmark's ``pod`` suite: what estimating BERT and ResNet-50 on IPU-PODs costs.

Each row runs ``python -m experiments.bert_pretraining --config C
--estimate_only --json_out F`` (the ``resnet_*`` rows:
``experiments.resnet_training``) in its own subprocess and records its wall
time, the lowering time and the peak RSS the run reports (its own process's
``ru_maxrss``), with the estimate itself (samples/s, sequences/s, step
seconds, fits) and whether the run stayed within the host budget of issue 27
(<= 180 s wall, <= 8 GB peak RSS). Rows with a published measurement
(``MEASURED``: the ResNet-50 MLPerf runs, docs/published_resnet.md) carry it
and the estimate's ratio to it::

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

__all__ = ["ROWS", "RUNNERS", "MEASURED", "BUDGET_SECONDS", "BUDGET_RSS_BYTES", "run_row",
           "table"]

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

# ResNet-50: Graphcore's MLPerf Training runs (experiments/resnet_presets.py).
_RESNET_PRESETS = ("mlperf_v1_pod16", "mlperf_v1_pod64", "mlperf_v1_1_pod16", "mlperf_v1_1_pod64",
                   "mlperf_v1_1_pod128", "mlperf_v1_1_pod256", "mlperf_v2_bow_pod16",
                   "mlperf_v2_bow_pod64", "mlperf_v2_bow_pod128", "mlperf_v2_bow_pod256")
ROWS.update({f"resnet_{name}": [f"--config={name}"] for name in _RESNET_PRESETS})

# row name -> the runner module it runs (default: the BERT runner).
RUNNERS = {f"resnet_{name}": "experiments.resnet_training" for name in _RESNET_PRESETS}

# row name -> measured images/s: the median over the 5 runs of each run's
# median epoch rate (1,281,167 images / epoch_stop - epoch_start), from the
# MLPerf result logs (docs/published_resnet.md#measurements).
MEASURED = {"resnet_mlperf_v1_pod16": 27522.0, "resnet_mlperf_v1_pod64": 83420.0,
            "resnet_mlperf_v1_1_pod16": 29465.0, "resnet_mlperf_v1_1_pod64": 108006.0,
            "resnet_mlperf_v1_1_pod128": 181430.0, "resnet_mlperf_v1_1_pod256": 335077.0,
            "resnet_mlperf_v2_bow_pod16": 43133.0, "resnet_mlperf_v2_bow_pod64": 145952.0,
            "resnet_mlperf_v2_bow_pod128": 231487.0, "resnet_mlperf_v2_bow_pod256": 425354.0}


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
      result = json.load(f)
  result.update(workload=name, wall_s=wall, args=ROWS[name],
                within_budget=wall <= BUDGET_SECONDS
                and result["peak_rss_bytes"] <= BUDGET_RSS_BYTES, error=None)
  if name in MEASURED:
    result.update(measured_samples_per_second=MEASURED[name],
                  ratio=result["samples_per_second"] / MEASURED[name])
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
  ratios = [r["ratio"] for r in results if not r.get("error") and "ratio" in r]
  if ratios:
    lines += ["", "| row | estimate samples/s | measured | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['samples_per_second']:,.0f} "
              f"| {r['measured_samples_per_second']:,.0f} | {r['ratio']:.3f} |"
              for r in results if not r.get("error") and "ratio" in r]
    worst = max(ratios, key=lambda x: abs(math.log(x)))
    lines.append(f"geometric-mean ratio {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
                 f"worst {worst:.3f} ({len(ratios)} measured rows)")
  return "\n".join(lines)
