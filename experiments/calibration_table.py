r"""Every measured IPU-POD point in one table and one plot: estimate beside measurement.

Reads the ``pod`` benchmark suite's results (``python -m experiments.benchmark
--suite=pod --json_out=experiments/results/pod.json``, experiments/benchmark_pod.py)
and writes, for every row with a published measurement, the family, the
configuration, the system, the measured and estimated throughput in the
family's unit, their ratio and the largest part of the difference read from
the row's breakdown; then the geometric-mean and worst ratio over all rows and
per family. ``--plot`` draws estimate against measurement on log-log axes, one
marker per model family, with the y = x line and a ±15 % band::

    python -m experiments.calibration_table --results experiments/results/pod.json \
        --markdown_out table.md --plot docs/calibration_plot.png

Several results files may be given (comma-separated); a row found in more
than one is taken from the last.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import benchmark_pod  # noqa: E402

__all__ = ["load_results", "largest_part", "markdown", "plot"]

# The band the acceptance asks every row to be within.
TOLERANCE = 0.15
# The parts of a pipeline's breakdown that grow with G (every micro-batch's
# compute); the others are paid once a step (collectives, optimizer, syncs, I/O).
_PER_MICRO_BATCH = ("steady_state", "ramp", "recomputation")
_MARKERS = {"BERT-Large": "o", "BERT-Base": "s", "ResNet-50": "^", "GPT-2": "D"}


def load_results(paths) -> list:
  """The measured rows of the suite's JSON files (``{"results": [...]}`` or a list)."""
  by_name = {}
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    for r in data["results"] if isinstance(data, dict) else data:
      by_name[r["workload"]] = r
  return benchmark_pod.measured_rows(list(by_name.values()))


def largest_part(r: dict) -> str:
  """Where the difference between estimate and measurement can be, from the breakdown.

  The measured step is the estimated step times the ratio (the same samples
  a step, at the measured rate). An estimate slower than the hardware
  (ratio < 1) over-prices by ``step x (1 - ratio)`` seconds; the parts of
  the breakdown that can hold that are the fewest largest ones outside which
  the breakdown holds less than the gap (the others, set to zero, would not
  close it). An estimate faster than the hardware misses time no part of the
  breakdown shows; the largest part is named as the one most likely
  under-priced.
  """
  step, ratio = r["step_seconds"], r["ratio"]
  parts = sorted((v, k) for k, v in r.get("breakdown", {}).items() if v > 0)
  if not parts:
    return "no breakdown"
  gap = step * (1.0 - ratio)
  top, top_name = parts[-1]
  largest = f"largest part {top_name} {top * 1e3:,.1f} ms ({top / step:.0%} of the step)"
  if abs(gap) < 0.02 * step:
    return f"within 2 % of the step; {largest}"
  if gap < 0:
    fixed = sum(v for v, k in parts if k not in _PER_MICRO_BATCH)
    return (f"estimate {-gap * 1e3:,.1f} ms short of the measured step ({-gap / step:.0%}): "
            f"time no part shows (the parts outside the micro-batches' compute hold "
            f"{fixed * 1e3:,.1f} ms); {largest}")
  rest = 0.0
  while parts and rest + parts[0][0] < gap:  # the smallest parts cannot hold the gap
    rest += parts.pop(0)[0]
  if not parts:
    return f"{gap * 1e3:,.1f} ms over, more than the whole breakdown"
  held = sum(v for v, _ in parts)
  names = " + ".join(k for _, k in reversed(parts))
  return (f"{gap * 1e3:,.1f} ms over ({gap / step:.0%} of the step): in {names} "
          f"({held * 1e3:,.1f} ms); the other parts hold {rest * 1e3:,.1f} ms")


def _configuration(r: dict) -> str:
  args = " ".join(a.lstrip("-") for a in r.get("args", ()) if not a.startswith("--system"))
  return f"`{r['workload']}` ({args})" if args else f"`{r['workload']}`"


def markdown(rows: list) -> str:
  """The table and the geometric-mean / worst ratios (overall and per family)."""
  rows = sorted(rows, key=lambda r: (r["family"], r["workload"]))
  lines = ["| family | configuration | system | measured | estimate | ratio "
           "| largest part of the difference |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    flag = "" if abs(r["ratio"] - 1.0) <= TOLERANCE else " (outside ±15 %)"
    if r.get("fits") is False:  # an estimate of a program the IPUs could not hold
      flag += " (does not fit)"
    lines.append(f"| {r['family']} | {_configuration(r)} | {r.get('system') or '-'} "
                 f"| {r['measured']:,.0f} {r['measured_unit']} | {r['estimate']:,.0f} "
                 f"| {r['ratio']:.3f}{flag} | {largest_part(r)} |")
  return "\n".join(lines + [""] + benchmark_pod.summary_lines(rows))


def plot(rows: list, path: str) -> str:
  """Write a log-log PNG of estimate against measurement to ``path``; returns it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, ax = plt.subplots(figsize=(6.5, 6))
  values = [v for r in rows for v in (r["measured"], r["estimate"])]
  lo, hi = min(values) / 1.5, max(values) * 1.5
  line = np.geomspace(lo, hi, 50)
  ax.fill_between(line, line * (1 - TOLERANCE), line * (1 + TOLERANCE), color="0.85",
                  label="±15 %")
  ax.plot(line, line, "k-", linewidth=0.8, label="estimate = measurement")
  for fam in sorted({r["family"] for r in rows}):
    sub = [r for r in rows if r["family"] == fam]
    ax.scatter([r["measured"] for r in sub], [r["estimate"] for r in sub],
               marker=_MARKERS.get(fam, "x"), label=f"{fam} ({sub[0]['measured_unit']})")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlim(lo, hi)
  ax.set_ylim(lo, hi)
  ax.set_xlabel("measured throughput (published)")
  ax.set_ylabel("estimated throughput (ipu-jax)")
  ax.set_title("IPU-POD training: estimate vs measurement")
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


_RESULTS = flags.DEFINE_list("results", ["experiments/results/pod.json"],
                             "The pod suite's JSON files (comma-separated).")
_MARKDOWN_OUT = flags.DEFINE_string("markdown_out", None, "Also write the table here.")
_PLOT = flags.DEFINE_string("plot", None, "Write the log-log PNG here.")


def main(argv):
  del argv
  rows = load_results(_RESULTS.value)
  if not rows:
    raise app.UsageError(f"No measured rows without an error in {_RESULTS.value}; run "
                         "python -m experiments.benchmark --suite=pod --json_out=... first.")
  text = markdown(rows)
  print(text)
  if _MARKDOWN_OUT.value:
    with open(_MARKDOWN_OUT.value, "w") as f:
      f.write(text + "\n")
  if _PLOT.value:
    print(f"wrote {plot(rows, _PLOT.value)}")


if __name__ == "__main__":
  app.run(main)
