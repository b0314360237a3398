r"""C++ codelets against the same computation as Python codelets, in wall time.

Builds the same graph twice on an ``ipu2`` of ``--tiles`` tiles: one vertex
per tile, its fields on its own tile, the vertex a C++ class
(``ipu_jax/cpp_codelets``, one XLA FFI call for all the tiles' vertices) or
a Python codelet (``vmap``-ed over the tiles); each engine run is one
compute set. Times ``Engine.run`` (and reading the result) in the steady
state, after a warm-up run that compiles, the two engines' runs alternating:
the median over ``--repeats`` runs of each, and their ratio.

Usage::

    python -m experiments.codelet_benchmark --tiles=1472 --elements=256 --repeats=7 \
        --json_out=reports/codelet_benchmark.json
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app
from absl import flags
import numpy as np

import ipu_jax
from ipu_jax import graph as g

_TILES = flags.DEFINE_integer("tiles", 1472, "Tiles (ipu2), one vertex on each.", lower_bound=1)
_ELEMENTS = flags.DEFINE_integer("elements", 256, "Elements per vertex.", lower_bound=1)
_REPEATS = flags.DEFINE_integer("repeats", 7, "Timed runs (median).", lower_bound=1)
_WORKLOADS = flags.DEFINE_list("workloads", ["elementwise", "sum"], "What the vertices compute.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Where to write the results as JSON.")

CODELETS = r"""
#include <poplar/Vertex.hpp>
using namespace poplar;

class Elementwise : public Vertex {
 public:
  Input<Vector<float>> x;
  Input<Vector<float>> z;
  Output<Vector<float>> y;
  bool compute() {
    for (unsigned i = 0; i < x.size(); ++i) y[i] = (x[i] + z[i]) / (x[i] - z[i] + 3.0f);
    return true;
  }
};

class Sum : public Vertex {
 public:
  Input<Vector<float>> x;
  Input<Vector<float>> z;
  Output<float> y;
  bool compute() {
    float s = 0;
    for (unsigned i = 0; i < x.size(); ++i) s += x[i] * z[i];
    *y = s;
    return true;
  }
};
"""


@g.codelet(inputs=("x", "z"), outputs=("y",), cycles=100)
def elementwise(x, z):
  return (x + z) / (x - z + 3.0)


@g.codelet(inputs=("x", "z"), outputs=("y",), cycles=100)
def dot_sum(x, z):
  return (x * z).sum()


def _engine(workload: str, cpp: bool, tiles: int, n: int):
  gr = g.Graph(ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles))
  gr.add_codelets(CODELETS, cycles=100)
  x = gr.add_variable("float32", (tiles, n), "x")
  z = gr.add_variable("float32", (tiles, n), "z")
  out_shape = (tiles, n) if workload == "elementwise" else (tiles,)
  y = gr.add_variable("float32", out_shape, "y")
  for t in (x, z, y):
    gr.map_tensor_linearly(t, min_elements_per_tile=int(np.prod(out_shape[1:], dtype=int)) or 1)
  cs = gr.add_compute_set(workload)
  vertex = {"elementwise": ("Elementwise", elementwise), "sum": ("Sum", dot_sum)}[workload]
  for tile in range(tiles):
    gr.add_vertex(cs, vertex[0] if cpp else vertex[1], tile=tile, x=x[tile], z=z[tile], y=y[tile])
  engine = g.Engine(gr, [g.Execute(cs)])
  rng = np.random.default_rng(0)
  engine.write_tensor(x, rng.normal(size=(tiles, n)).astype(np.float32))
  engine.write_tensor(z, rng.normal(size=(tiles, n)).astype(np.float32))
  return engine, y


def _time_ms(engine, y) -> float:
  start = time.perf_counter()
  engine.run(0)
  engine.read_tensor(y)  # the run has finished once its result is read
  return (time.perf_counter() - start) * 1e3


def run(workload: str, tiles: int, n: int, repeats: int) -> dict:
  """Both engines' steady-state ms per run (median), their ratio, and equal results.

  The two engines' runs alternate, so a change in the host's load falls on both.
  """
  engines = {cpp: _engine(workload, cpp, tiles, n) for cpp in (True, False)}
  for engine, y in engines.values():
    _time_ms(engine, y)  # compiles
  times = {True: [], False: []}
  for _ in range(repeats):
    for cpp, (engine, y) in engines.items():
      times[cpp].append(_time_ms(engine, y))
  row = {"workload": workload, "tiles": tiles, "elements_per_vertex": n,
         "cpp_ms": statistics.median(times[True]), "python_ms": statistics.median(times[False])}
  row["ratio"] = row["cpp_ms"] / row["python_ms"]
  values = {cpp: engine.read_tensor(y) for cpp, (engine, y) in engines.items()}
  row["max_abs_difference"] = float(np.max(np.abs(values[True] - values[False])))
  return row


def main(argv):
  del argv
  rows = [run(w, _TILES.value, _ELEMENTS.value, _REPEATS.value) for w in _WORKLOADS.value]
  print(f"{'workload':<12} {'tiles':>6} {'elems':>6} {'C++ ms':>9} {'Python ms':>10} "
        f"{'C++/Py':>7} {'max |diff|':>11}")
  for r in rows:
    print(f"{r['workload']:<12} {r['tiles']:>6} {r['elements_per_vertex']:>6} {r['cpp_ms']:>9.2f} "
          f"{r['python_ms']:>10.2f} {r['ratio']:>7.2f} {r['max_abs_difference']:>11.3g}")
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(_JSON_OUT.value) or ".", exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      json.dump({"schema": "ipu-jax-codelet-benchmark", "results": rows}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
