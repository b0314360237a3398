r"""PopSparse on one Bow IPU: static and dynamic sparse against dense matmuls.

For ``m = k = 4096``, ``n`` in {1024, 2048}, block size in {1, 4, 16},
density in {1/64, 1/32, 1/16, 1/8, 1/4}, fp16 and fp32, the cycles of

* a **static** sparse x dense product (pattern known when lowering:
  ``ipu_jax.sparse.static_matmul``'s plan, ``lowering/sparse_plan.plan_static``),
* a **dynamic** one (buckets sized for ``max_non_zeros`` = the case's
  non-zeros with PopSparse's 0.3 oversize: ``plan_dynamic``),
* the **dense** product (``lowering/matmul_plan.plan_matmul``, what
  ``dot_general`` lowers to; half partials at fp16, as the measured baseline:
  :func:`dense_partials`),

all from the cost model (the planners cost their chosen grids from the
vertex estimators; no program is run). ``--lower`` also lowers the listed
cases through ``ipu_jax.jit`` with a random pattern of the case's density and
prints the lowered program's cycles beside the plan's (the lowering costs the
real pattern; each case lowered once).

Prints the table, the density where sparse stops paying off per block size,
and writes the speed-up plot (the PopSparse paper's figure) and JSON.

Usage::

    python -m experiments.popsparse --json_out=experiments/results/popsparse.json

JSON: one row per case, ``{"m", "k", "n", "block", "density", "dtype",
"static_cycles", "dynamic_cycles", "dense_cycles"}``; a product whose plan
does not fit the tile memory under the available memory proportion is
``null``.
"""

from __future__ import annotations

import json
import os
import time

from absl import app
from absl import flags
import numpy as np

from experiments import entry
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.matmul_plan import plan_matmul
from ipu_jax.lowering.sparse_plan import DEFAULT_OVERSIZE, plan_dynamic, plan_static

def define_flags(fv=None):
  """Defines the runner's flags (when it runs, not on import: other runners share names)."""
  fv = flags.FLAGS if fv is None else fv
  global _JSON_OUT, _PLOT, _N, _BLOCKS, _DTYPES, _LOWER, _COMPARE
  _JSON_OUT = flags.DEFINE_string("json_out", "experiments/results/popsparse.json",
                                  "Where to write the JSON rows ('' for none).", flag_values=fv)
  _PLOT = flags.DEFINE_string("plot", "experiments/results/popsparse_speedup.png",
                              "Where to write the speed-up plot ('' for none).", flag_values=fv)
  _N = flags.DEFINE_list("n", ["1024", "2048"], "Dense columns.", flag_values=fv)
  _BLOCKS = flags.DEFINE_list("blocks", ["1", "4", "16"], "Block sizes.", flag_values=fv)
  _DTYPES = flags.DEFINE_list("dtypes", ["float16", "float32"], "Operand types.", flag_values=fv)
  _LOWER = flags.DEFINE_list(
      "lower", ["1024:16:0.0625:float16"],
      "Cases n:block:density:dtype to lower through ipu_jax.jit as a check ('' for none).",
                             flag_values=fv)
  _COMPARE = flags.DEFINE_bool(
      "compare", True, "Print the model beside the published measured speed-ups.",
      flag_values=fv)
  return fv



M = K = 4096
DENSITIES = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4)
PUBLISHED = (
    "Li et al. 2023 (PopSparse, arXiv:2303.16999), measured on a Bow IPU: static sparse "
    "beats dense in FP16 from about 90% sparsity (density ~1/10) with large matrices and "
    "block size; static generally outperforms dynamic; speed-ups need large blocks.")


# Measured speed-ups over dense on a Bow IPU, m = k = 4096, each method at its best
# batch size n (the paper's analysis takes the best FLOP rate over n per method:
# graphcore-research/sparsity-benchmarks analysis/Analysis.ipynb, max_over(df, "n")).
# Keys (dtype, block, density) -> (static, dynamic, where). "Table 2" values are the
# notebook's printed table (one decimal); "Fig. N" values are read off the notebook's
# stored figure (log axes, about +-3 %; the figure's 1/16 points match Table 2).
PUBLISHED_SOURCE = (
    "Li et al. 2023, PopSparse (arXiv:2303.16999), Bow IPU, m = k = 4096, "
    "best over batch n per method; values from graphcore-research/sparsity-benchmarks "
    "analysis/Analysis.ipynb (Table 2 'static_vs_dynamic'; Fig. 2 'ipu_density'; "
    "Fig. 3 'ipu_block_size')")
PUBLISHED_SPEEDUPS = {
    ("float16", 1, 1 / 32): (1.22, 0.53, "Fig. 2"),
    ("float16", 1, 1 / 16): (0.7, 0.4, "Table 2"),
    ("float16", 1, 1 / 8): (0.41, 0.27, "Fig. 2"),
    ("float16", 1, 1 / 4): (0.21, 0.17, "Fig. 2"),
    ("float16", 4, 1 / 16): (1.52, 1.01, "Fig. 3"),
    ("float16", 8, 1 / 16): (3.46, 1.50, "Fig. 3"),
    ("float16", 16, 1 / 32): (5.03, 2.18, "Fig. 2"),
    ("float16", 16, 1 / 16): (4.9, 1.9, "Table 2"),
    ("float16", 16, 1 / 8): (2.40, 1.38, "Fig. 2"),
    ("float16", 16, 1 / 4): (1.59, 0.97, "Fig. 2"),
    ("float32", 1, 1 / 16): (1.4, 0.9, "Table 2"),
    ("float32", 16, 1 / 16): (5.6, 3.8, "Table 2"),
}
#: Measured dense fp16 rate, m = k = 4096, best over n (Fig. 2's dense line: 226 TFLOP/s
#: at 1/8, 1/16 and 1/32, non-zero FLOP/s divided by the density).
PUBLISHED_DENSE_FP16_TFLOPS = 226.0
#: Batch sizes the model takes the best of (the paper swept powers of two up to 16384).
BEST_OF_N = (256, 1024, 2048, 4096, 16384)


def _rate(target, cycles, n, density):
  """Non-zero TFLOP/s of a product of ``cycles`` (None where its plan does not fit)."""
  if cycles is None:
    return None
  return 2.0 * M * K * n * density / (cycles / target.clock_hz) / 1e12


def published_comparison(target) -> list:
  """Per published point: the model's best-over-n speed-ups beside the measured ones."""
  out = []
  for (dtype, block, density), (static, dynamic, where) in PUBLISHED_SPEEDUPS.items():
    rows = [case_row(target, n, block, density, dtype) for n in BEST_OF_N]
    best = {key: max((r for r in (_rate(target, row[key], row["n"], share) for row in rows)
                      if r is not None), default=None)
            for key, share in (("static_cycles", density), ("dynamic_cycles", density),
                               ("dense_cycles", 1.0))}
    dense = best["dense_cycles"] * density   # the dense product's non-zero FLOP/s
    out.append({"dtype": dtype, "block": block, "density": density, "where": where,
                "published_static": static, "published_dynamic": dynamic,
                "model_static": best["static_cycles"] / dense,
                "model_dynamic": best["dynamic_cycles"] / dense,
                "model_dense_tflops": best["dense_cycles"],
                "model_static_tflops": best["static_cycles"],
                "model_dynamic_tflops": best["dynamic_cycles"]})
  return out


def comparison_table(points) -> str:
  head = (f"{'dtype':>7} {'block':>5} {'density':>7} {'source':>7} {'static pub':>10} "
          f"{'model':>6} {'ratio':>6} {'dyn pub':>7} {'model':>6} {'ratio':>6} "
          f"{'static rate':>11} {'dyn rate':>8}")
  lines = [head, "-" * len(head)]
  for p in points:
    lines.append(
        f"{p['dtype']:>7} {p['block']:>5} {_fraction(p['density']):>7} {p['where']:>7} "
        f"{p['published_static']:>10.2f} {p['model_static']:>6.2f} "
        f"{p['model_static'] / p['published_static']:>6.2f} {p['published_dynamic']:>7.2f} "
        f"{p['model_dynamic']:>6.2f} {p['model_dynamic'] / p['published_dynamic']:>6.2f} "
        f"{_rate_ratio(p, 'static'):>11} {_rate_ratio(p, 'dynamic'):>8}")
  lines.append("ratio: model / published speed-up; rate: model / measured non-zero FLOP/s "
               "(fp16 only, the measured rate being the speed-up times the measured dense)")
  return "\n".join(lines)


def _rate_ratio(point, method) -> str:
  if point["dtype"] != "float16":
    return "-"
  measured = point[f"published_{method}"] * PUBLISHED_DENSE_FP16_TFLOPS * point["density"]
  return f"{point[f'model_{method}_tflops'] / measured:.2f}"


def dense_partials(dtype):
  """The dense baseline's partials: half for fp16, as the measured baseline ran.

  The paper's dense fp16 rate, 226 TFLOP/s (:data:`PUBLISHED_DENSE_FP16_TFLOPS`), is above
  what fp16 inputs with float32 partials can reach on a Bow IPU (8 AMP units,
  poplibs' ``fp16InFp32OutConvUnitsPerTile``: half the 350 TFLOP/s peak, about 174), so
  its dense runs took ``matmul_bench.py --partials half`` (``poplin::matMul`` with
  ``partialsType`` half; the benchmark's sparse runs pass no options).
  """
  return np.float16 if np.dtype(dtype) == np.float16 else np.float32


def _cycles(plan):
  return float(plan.cycles) if plan.fits else None


def case_row(target, n, block, density, dtype) -> dict:
  nnz = max(int(round(density * (M // block) * (K // block))), 1)
  static = plan_static(target, M, K, n, block, nnz, dtype)
  dynamic = plan_dynamic(target, M, K, n, block, nnz, dtype, oversize=DEFAULT_OVERSIZE)
  dense = plan_matmul(target, 1, M, n, K, dtype, partials_dtype=dense_partials(dtype))
  return {"m": M, "k": K, "n": n, "block": block, "density": density, "dtype": dtype,
          "static_cycles": _cycles(static), "dynamic_cycles": _cycles(dynamic),
          "dense_cycles": _cycles(dense)}


def _speedup(row, key):
  if row[key] is None or row["dense_cycles"] is None:
    return None
  return row["dense_cycles"] / row[key]


def _fmt(value, digits=0):
  return "-" if value is None else f"{value:,.{digits}f}"


def table(rows) -> str:
  head = (f"{'n':>5} {'dtype':>7} {'block':>5} {'density':>8} {'static':>11} {'dynamic':>11} "
          f"{'dense':>11} {'static x':>8} {'dyn x':>6}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(f"{r['n']:>5} {r['dtype']:>7} {r['block']:>5} {'1/%d' % round(1 / r['density']):>8}"
                 f" {_fmt(r['static_cycles']):>11} {_fmt(r['dynamic_cycles']):>11}"
                 f" {_fmt(r['dense_cycles']):>11} {_fmt(_speedup(r, 'static_cycles'), 2):>8}"
                 f" {_fmt(_speedup(r, 'dynamic_cycles'), 2):>6}")
  return "\n".join(lines)


def break_even(rows) -> dict:
  """Per (n, dtype, block): ``(last density of the grid where static sparse beats dense,
  first density where it does not: speed-up <= 1, or its plan does not fit)``; None where
  there is none."""
  out = {}
  for r in sorted(rows, key=lambda r: r["density"]):
    key = (r["n"], r["dtype"], r["block"])
    last, stop = out.get(key, (None, None))
    s = _speedup(r, "static_cycles")
    if stop is None:
      if s is not None and s > 1:
        last = r["density"]
      else:
        stop = (r["density"], "does not fit" if s is None else f"speed-up {s:.2f}")
    out[key] = (last, stop)
  return out


def _fraction(density):
  return f"1/{round(1 / density)}"


def plot(rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  dtypes = sorted({r["dtype"] for r in rows})
  fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
  colours, markers = {1: "C0", 4: "C1", 16: "C2"}, {1024: "o", 2048: "s"}
  for ax, dtype in zip(axes[0], dtypes):
    for (n, block) in sorted({(r["n"], r["block"]) for r in rows}):
      for key, style in (("static_cycles", "-"), ("dynamic_cycles", "--")):
        pts = [(r["density"], _speedup(r, key)) for r in rows
               if r["dtype"] == dtype and r["n"] == n and r["block"] == block]
        pts = [(d, s) for d, s in pts if s is not None]
        if pts:
          ax.plot(*zip(*pts), style, color=colours.get(block), marker=markers.get(n, "o"),
                  label=f"{key.split('_')[0]} b{block} n{n}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("density")
    ax.set_ylabel("speed-up over dense")
    ax.set_title(f"m=k={M}, one Bow IPU, {dtype}")
    ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def lower_case(target, spec: str) -> str:
  """Lower one case through ipu_jax.jit: the program's cycles beside the plans'."""
  import ipu_jax
  from ipu_jax.sparse import BlockCSR, dynamic_layout, dynamic_matmul, encode, static_matmul
  n, block, density, dtype = spec.split(":")
  n, block, density = int(n), int(block), float(density)
  rng = np.random.RandomState(0)
  grid = (M // block, K // block)
  nnz = max(int(round(density * grid[0] * grid[1])), 1)
  flat = np.zeros(grid[0] * grid[1], bool)
  flat[rng.choice(flat.size, nnz, replace=False)] = True
  values = rng.randn(nnz, block, block).astype(dtype)
  rows, cols = np.nonzero(flat.reshape(grid))
  sparse = BlockCSR.from_coordinates(rows, cols, values, (M, K), (block, block))
  dense = rng.randn(K, n).astype(dtype)
  started = time.perf_counter()
  static = ipu_jax.jit(static_matmul, target=target).lower(sparse, dense)
  encoded = encode(sparse, dynamic_layout(target, (M, K), n, nnz, block=block, dtype=dtype))
  dynamic = ipu_jax.jit(dynamic_matmul, target=target).lower(encoded, dense)
  row = case_row(target, n, block, density, dtype)
  return (f"lowered {spec} in {time.perf_counter() - started:.1f} s: static "
          f"{static.profile.total_cycles:,.0f} cycles (plan {_fmt(row['static_cycles'])}), "
          f"dynamic {dynamic.profile.total_cycles:,.0f} (plan {_fmt(row['dynamic_cycles'])}); "
          f"encoding the pattern took {encoded.host_seconds * 1e3:.1f} ms on the host")


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  started = time.perf_counter()
  target = IPUTarget.preset("bow")
  rows = [case_row(target, int(n), int(b), d, dtype)
          for n in _N.value for dtype in _DTYPES.value for b in _BLOCKS.value
          for d in DENSITIES]
  print(table(rows))
  print("\nWhere static sparse stops paying off (densities of the grid):")
  for (n, dtype, block), (last, stop) in break_even(rows).items():
    pays = "never" if last is None else f"up to {_fraction(last)}"
    ends = "beyond 1/4" if stop is None else f"from {_fraction(stop[0])} ({stop[1]})"
    print(f"  n={n} {dtype} block {block:>2}: pays off {pays}, stops {ends}")
  print("\nPublished: " + PUBLISHED)
  if _COMPARE.value:
    print(f"\nModel beside the measurements ({PUBLISHED_SOURCE}); speed-ups over dense, "
          f"model best over n in {BEST_OF_N}:")
    points = published_comparison(target)
    print(comparison_table(points))
    dense = {p["model_dense_tflops"] for p in points if p["dtype"] == "float16"}
    print(f"dense fp16, best over n: model {max(dense):.0f} TFLOP/s, measured "
          f"{PUBLISHED_DENSE_FP16_TFLOPS:.0f}")
  for spec in [s for s in _LOWER.value if s]:
    print(lower_case(target, spec))
  if _PLOT.value:
    plot(rows, _PLOT.value)
    print(f"plot: {_PLOT.value}")
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(_JSON_OUT.value) or ".", exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      json.dump(rows, f, indent=1)
    print(f"json: {_JSON_OUT.value}")
  print(f"total {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
  define_flags()
  app.run(main)
