r"""Benchmark runner: emulated IPU against plain ``jax.jit`` on the same host.

For each workload and tile count it measures, in one run:

* wall time per step of ``ipu_jax.jit(f)`` and of ``jax.jit(f)`` (median of
  ``--repeats`` runs after warm-up) and their ratio;
* lowering plus compile time of the emulated program;
* peak host memory (each case runs in its own subprocess, so peaks are its own);
* the emulated IPU's own estimate (cycles, seconds) from the report.

Usage::

    python -m experiments.benchmark --workloads=matmul,mlp,cnn,transformer,fit \
        --tiles=16,1472 --json_out=reports/benchmark.json

The ``scale`` suite (``--suite=scale [--rows=enc-8x256,bert-base]``) runs the
model-scale training steps of ``experiments/scale_workloads.py``, each row in
its own subprocess (peak RSS is the row's own), and reports per row:
equations (nested jaxprs included), supersteps, lowering time (trace, lower,
profile), compile time (first call), RSS after lowering, peak RSS after
lowering + compile + one step (``step_peak_host_mib``) and over the whole row
(``peak_host_mib``: more steps, and the plain step compiled and run in the
same process), what XLA says plain ``jax.jit``'s step needs (arguments,
outputs, temporaries: ``plain_xla_peak_mib``), and the emulated and plain
``jax.jit`` step times measured in the same process, with their ratio::

    python -m experiments.benchmark --suite=scale --repeats=5 \
        --json_out=experiments/results/scale.json

The ``speed`` suite (``--suite=speed``) prints issue 43's figures, each against
its goal, in one run: the emulated over plain ``jax.jit`` step time of the MLP,
CNN and tiny transformer LM training steps at ``--tiles`` (the two run
alternately, ``--repeats`` times each, in the row's own subprocess; the ratio
of the medians), the 4-IPU / 1-IPU lowering CPU time of the 8-layer width-256
LM step (``experiments/lowering_time.py``'s ``enc-8x256`` and
``enc-8x256-bow4``; the JSON also keeps how many values each program's per-tile
figures would take held as runs, ``figure_runs_share``, and as classes of tiles,
``tile_classes``: ``program_figures.figure_compression``), and the wall time
and peak RSS of the POD16 BERT-Large estimates (``phase2_pod16 --packing_factor 2
--estimate_only``, the pod suite's row, and ``phase1_pod16 --auto_split
--estimate_only``)::

    python -m experiments.benchmark --suite=speed --repeats=31 \
        --json_out=experiments/results/speed.json

The ``pod`` suite (``--suite=pod [--rows=phase2_pod16]``) runs BERT's and
ResNet-50's ``--estimate_only`` on IPU-PODs (experiments/benchmark_pod.py), each
row in its own subprocess: wall time, lowering time, peak RSS, the estimate
(beside the measured throughput where one is recorded: ratios, their geometric
mean and the worst), and whether it kept issue 27's host budget (3 minutes,
8 GB).

JSON format (stable; ``"schema": "ipu-jax-benchmark", "version": 1``): a
``"host"`` object (platform, cpu count, python/jax versions) and ``"results"``:
a list of objects with keys ``workload``, ``tiles``, ``plain_ms``,
``emulated_ms``, ``ratio``, ``lower_compile_s``, ``peak_host_mib``,
``ipu_cycles``, ``ipu_seconds``, ``supersteps``, ``error`` (null when fine);
scale rows also record ``figures_sha1`` (:func:`~experiments.program_figures.figures_sha1`: equal figures
give equal fingerprints, so a speed change can show it changed none).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

from experiments.program_figures import figures_sha1, iter_eqns

_WORKLOADS = flags.DEFINE_list(
    "workloads", ["matmul", "mlp", "cnn", "transformer", "fit"],
    "Workloads: matmul (1024^3 f32), mlp, cnn, transformer (training steps), "
    "fit (one fit epoch of the digits MLP).")
_TILES = flags.DEFINE_list("tiles", ["16", "1472"], "Tiles per IPU to measure at (ipu2).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per measurement (median).", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", "reports/benchmark.json", "Where to write JSON.")
_ISOLATE = flags.DEFINE_bool("isolate", True, "Run each case in its own subprocess.")
_CASE = flags.DEFINE_string("case", None, "Internal: run one case 'workload:tiles' and print JSON.")
_EXECUTOR = flags.DEFINE_enum("executor", "batched", ["batched", "per_tile"], "Executor mode.")
_SUITE = flags.DEFINE_enum(
    "suite", "default", ["default", "scale", "pod", "speed"],
    "default: --workloads at --tiles; scale: model-scale training steps "
    "(experiments/scale_workloads.py), one subprocess per row; pod: BERT estimates "
    "on IPU-PODs (experiments/benchmark_pod.py: wall time and peak RSS of "
    "bert_pretraining --estimate_only); speed: issue 43's figures against their goals "
    "(step ratios, 4-IPU / 1-IPU lowering, the POD16 BERT-Large estimates).")
_SPEED_PARTS = flags.DEFINE_list(
    "speed_parts", ["steps", "lowering", "estimates"],
    "speed suite: which parts to run (steps: MLP, CNN, tiny LM against jax.jit at --tiles; "
    "lowering: enc-8x256 on 4 Bow IPUs over 1; estimates: the POD16 BERT-Large estimates).")
_SPEED_WORKLOADS = flags.DEFINE_list(
    "speed_workloads", ["mlp", "cnn", "transformer", "nnx_mlp"],
    "speed suite: the training steps timed against jax.jit (experiments/models.py; "
    "nnx_mlp: an NNX step under ipu_jax.nnx_jit against nnx.jit).")
_SPEED_BATCH = flags.DEFINE_integer(
    "speed_batch", 0, "speed suite: the step workloads' batch (0: each workload's own).",
    lower_bound=0)
_ROWS = flags.DEFINE_list("rows", None, "scale / pod suite: rows to run (default: all).")
_ROW_TIMEOUT = flags.DEFINE_integer("row_timeout", 1800, "scale suite: seconds per row.",
                                    lower_bound=1)
_MAX_RSS_GIB = flags.DEFINE_float(
    "max_rss_gib", 10.0, "scale suite: a row whose resident memory passes this stops "
    "(recorded as an error) so a shared machine is not exhausted.")

SCHEMA = {"schema": "ipu-jax-benchmark", "version": 1}


def _block(tree):
  import jax
  return jax.tree_util.tree_map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x, tree)


def _median_ms(fn, args, repeats):
  _block(fn(*args))  # warm-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    _block(fn(*args))
    times.append((time.perf_counter() - start) * 1e3)
  return statistics.median(times)


def _step_workload(name):
  import jax
  import jax.numpy as jnp
  if name == "matmul":
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (1024, 1024), jnp.float32)
    b = jax.random.normal(k2, (1024, 1024), jnp.float32)
    return (lambda x, y: x @ y), (a, b)
  from experiments import models
  return models.workload(name)


def _config(tiles):
  import ipu_jax
  cfg = ipu_jax.IPUConfig()
  cfg.device.version = "ipu2"
  cfg.device.tiles_per_ipu = tiles
  cfg.executor.mode = _EXECUTOR.value
  return cfg


def _target(tiles):
  """ipu2 with ``tiles`` tiles and the full chip's total SRAM.

  The same work must fit at every tile count so emulation speeds compare;
  fewer tiles therefore get proportionally more SRAM each (a what-if target).
  """
  import ipu_jax
  full = ipu_jax.IPUTarget.preset("ipu2")
  target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)
  return target.replace(bytes_per_tile=full.bytes_per_tile * full.tiles_per_ipu // tiles)


def _run_step_case(name, tiles, repeats):
  import jax
  import ipu_jax
  fn, args = _step_workload(name)
  plain = jax.jit(fn)
  emulated = ipu_jax.jit(fn, config=_config(tiles), target=_target(tiles))
  start = time.perf_counter()
  lowered = emulated.lower(*args)
  _block(emulated(*args))
  lower_compile = time.perf_counter() - start
  plain_ms = _median_ms(plain, args, repeats)
  emulated_ms = _median_ms(emulated, args, repeats)
  report = lowered.report
  return dict(plain_ms=plain_ms, emulated_ms=emulated_ms, ratio=emulated_ms / plain_ms,
              lower_compile_s=lower_compile, ipu_cycles=report.total_cycles,
              ipu_seconds=report.estimated_seconds, supersteps=len(report.profile.steps))


@functools.lru_cache(maxsize=None)
def _digits_mlp():
  """The digits MLP (64-128-10) as an NNX module class (Flax imported when first asked)."""
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(64, 128, rngs=rngs)
      self.l2 = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, v):
      return self.l2(nnx.relu(self.l1(v)))

  return Net


def _run_fit_case(tiles, repeats):
  """One epoch of the digits MLP with ipu_jax.keras against plain optax."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx
  import ipu_jax
  from ipu_jax import keras
  from sklearn.datasets import load_digits

  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  batch, steps_per_execution = 32, 8
  usable = len(x) // (batch * steps_per_execution) * batch * steps_per_execution
  x, y = x[:usable], y[:usable]

  Net = _digits_mlp()
  cfg = _config(tiles)
  with ipu_jax.IPUStrategy(cfg).scope():
    model = keras.Model(Net(nnx.Rngs(0)))
    model.compile(optimizer=optax.sgd(0.1), loss="sparse_categorical_crossentropy",
                  steps_per_execution=steps_per_execution)
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)  # lowers, compiles, runs
    lower_compile = time.perf_counter() - start
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
      times.append((time.perf_counter() - start) * 1e3)
    report = model.report

  # Plain optax: the same epoch as a jitted scan over the same batches.
  net = Net(nnx.Rngs(0))
  graphdef, params = nnx.split(net, nnx.Param)
  opt = optax.sgd(0.1)

  def loss_fn(p, xb, yb):
    logits = nnx.merge(graphdef, p)(xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @jax.jit
  def epoch(p, s, xs, ys):
    def body(carry, batch_xy):
      p, s = carry
      g = jax.grad(loss_fn)(p, *batch_xy)
      u, s = opt.update(g, s, p)
      return (optax.apply_updates(p, u), s), None
    (p, s), _ = jax.lax.scan(body, (p, s), batch_xy)
    return p, s

  batch_xy = (jnp.asarray(x).reshape(-1, batch, 64), jnp.asarray(y).reshape(-1, batch))
  state = (params, opt.init(params))
  plain_ms = _median_ms(lambda p, s: epoch(p, s, *batch_xy), state, repeats)
  emulated_ms = statistics.median(times)
  return dict(plain_ms=plain_ms, emulated_ms=emulated_ms, ratio=emulated_ms / plain_ms,
              lower_compile_s=lower_compile,
              ipu_cycles=getattr(report, "total_cycles", None),
              ipu_seconds=getattr(report, "estimated_seconds", None),
              supersteps=len(report.profile.steps) if report is not None else None)


def _rss_guard(name, limit_gib):
  """Stop this process (with a JSON error row) if its RSS passes ``limit_gib``."""
  import threading

  def watch():
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
      with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
      if rss > limit_gib * 2**30:
        print(json.dumps(dict(workload=name, error=f"stopped: RSS over {limit_gib} GiB",
                              peak_host_mib=rss / 2**20)), flush=True)
        os._exit(3)
      time.sleep(0.5)

  threading.Thread(target=watch, daemon=True).start()


def run_scale_case(name, repeats):
  """One ``scale`` row: lower, compile, step times, all in this process."""
  from ipu_jax import host_time
  if os.path.exists("/proc/self/statm"):
    _rss_guard(name, _MAX_RSS_GIB.value)
  import jax
  import ipu_jax
  from experiments import scale_workloads
  r = scale_workloads.row(name)
  result = dict(workload=name, model=r.model, layers=r.layers, width=r.width, seq=r.seq,
                batch=r.batch, vocab=r.vocab if r.model == "transformer" else None,
                target=r.target_name)
  try:
    fn, args = scale_workloads.workload(r)
    result["params"] = scale_workloads.num_params(args[0])
    target = r.ipu_target()
    cfg = ipu_jax.IPUConfig()
    cfg.executor.mode = _EXECUTOR.value
    cfg.replication_factor = r.replicas  # ipu_jax.jit lowers and runs one replica
    emulated = ipu_jax.jit(fn, config=cfg, target=target, verbose=0)
    # CPU seconds too: on a shared machine wall time includes waiting for a core.
    start, cpu = time.perf_counter(), time.process_time()
    lowered = emulated.lower(*args)
    result["lower_s"] = time.perf_counter() - start
    result["lower_cpu_s"] = time.process_time() - cpu
    result["equations"] = sum(1 for _ in iter_eqns(lowered.jaxpr.jaxpr))
    result["supersteps"] = len(lowered.report.profile.steps)
    result["lower_rss_mib"] = host_time.peak_rss_bytes() / 2**20
    result["figures_sha1"] = figures_sha1(lowered.report.profile)
    start, cpu = time.perf_counter(), time.process_time()
    _block(emulated(*args))
    result["compile_s"] = time.perf_counter() - start
    result["compile_cpu_s"] = time.process_time() - cpu
    # The issue's measure: lowering + compile + one step. Later steps and the
    # plain step (same process, for the ratio) can add allocator slack.
    result["step_peak_host_mib"] = host_time.peak_rss_bytes() / 2**20
    result["ipu_seconds"] = lowered.report.estimated_seconds
    result["emulated_ms"] = _median_ms(emulated, args, repeats)
    plain = jax.jit(fn).lower(*args).compile()
    # What XLA says plain jax.jit's step needs: arguments, outputs, temporaries
    # (None where the backend does not say).
    analysis = plain.memory_analysis()
    result["plain_xla_peak_mib"] = (analysis.peak_memory_in_bytes / 2**20
                                    if analysis is not None else None)
    result["plain_ms"] = _median_ms(plain, args, repeats)
    result["ratio"] = result["emulated_ms"] / result["plain_ms"]
    result["error"] = None
  except Exception as e:  # a failing row is recorded, the suite goes on
    result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  result["peak_host_mib"] = host_time.peak_rss_bytes() / 2**20
  return result


def _subprocess_scale(name):
  cmd = [sys.executable, "-m", "experiments.benchmark", f"--case=scale:{name}",
         f"--repeats={_REPEATS.value}", f"--executor={_EXECUTOR.value}",
         f"--max_rss_gib={_MAX_RSS_GIB.value}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root,
                          timeout=_ROW_TIMEOUT.value)
  except subprocess.TimeoutExpired:
    return dict(workload=name, error=f"timed out after {_ROW_TIMEOUT.value} s")
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return dict(workload=name, error=f"subprocess failed: {proc.stderr[-500:]}")


def _scale_table(results):
  header = ("| row | target | params | eqns | supersteps | lower s (CPU s) "
            "| compile s (CPU s) | lower CPU ms/eqn | peak RSS after lowering MiB "
            "| peak RSS MiB: lower + compile + 1 step (whole row) | jax.jit step needs MiB "
            "| emulated ms | jax.jit ms | ratio |")
  lines = [header, "|" + "---|" * 14]
  for r in results:
    if r.get("error") and r.get("lower_s") is None:
      lines.append(f"| {r['workload']} | {r.get('target', '')} |" + " |" * 11
                   + f" ERROR {r['error']} |")
      continue
    def fmt(key, spec):
      return format(r[key], spec) if r.get(key) is not None else "-"
    lines.append(
        f"| {r['workload']} | {r['target']} | {r['params'] / 1e6:.1f} M | {fmt('equations', ',d')} "
        f"| {fmt('supersteps', ',d')} | {fmt('lower_s', '.1f')} ({fmt('lower_cpu_s', '.1f')}) "
        f"| {fmt('compile_s', '.1f')} ({fmt('compile_cpu_s', '.1f')}) "
        f"| {1e3 * (r.get('lower_cpu_s') or r['lower_s']) / r['equations'] if r.get('equations') else 0:.2f} "
        f"| {fmt('lower_rss_mib', ',.0f')} "
        f"| {fmt('step_peak_host_mib', ',.0f')} ({fmt('peak_host_mib', ',.0f')}) "
        f"| {fmt('plain_xla_peak_mib', ',.0f')} "
        f"| {fmt('emulated_ms', '.1f')} | {fmt('plain_ms', '.1f')} "
        f"| {fmt('ratio', '.2f')} |" + (f" {r['error']}" if r.get("error") else ""))
  return "\n".join(lines)


def _main_scale():
  from experiments import scale_workloads
  names = _ROWS.value or [r.name for r in scale_workloads.ROWS]
  results = []
  for name in names:  # unknown names fail before anything runs
    try:
      scale_workloads.row(name)
    except ValueError as e:
      raise app.UsageError(f"--rows: {e}") from None
  for name in names:
    print(f"running {name} ...", flush=True)
    results.append(_subprocess_scale(name) if _ISOLATE.value
                   else run_scale_case(name, _REPEATS.value))
    print(json.dumps(results[-1]), flush=True)
  print(_scale_table(results))
  out = _JSON_OUT.value
  if out:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(dict(SCHEMA, suite="scale", host=_host(), results=results), f, indent=2)
    print(f"\nwrote {out}")


def _main_pod():
  from experiments import benchmark_pod
  names = _ROWS.value or list(benchmark_pod.ROWS)
  for name in names:
    if name not in benchmark_pod.ROWS:
      raise app.UsageError(f"Unknown pod row {name!r}; valid rows are "
                           f"{sorted(benchmark_pod.ROWS)}.")
  results = []
  for name in names:
    print(f"running {name} ...", flush=True)
    results.append(benchmark_pod.run_row(name, _ROW_TIMEOUT.value))
    print(json.dumps(results[-1]), flush=True)
  print(benchmark_pod.table(results))
  out = _JSON_OUT.value
  if out:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(dict(SCHEMA, suite="pod", host=_host(), results=results), f, indent=2)
    print(f"\nwrote {out}")


# -- speed suite (issue 43) ----------------------------------------------------

# Goals of issue 43: emulated / jax.jit step time, 4-IPU / 1-IPU lowering time,
# and the POD16 BERT-Large estimates' wall seconds and peak RSS.
SPEED_GOALS = {"step_ratio": 1.2, "lowering_ratio": 1.2, "estimate_wall_s": 20.0,
               "estimate_rss_gib": 3.0, "auto_split_wall_s": 60.0}
_SPEED_LOWERING_ROWS = ("enc-8x256", "enc-8x256-bow4")


def _nnx_mlp_steps(tiles: int, batch: int) -> tuple:
  """``(emulated, plain, args, batch)``: an NNX MLP's training step (a module and an
  ``nnx.Optimizer`` updated in place) under ``ipu_jax.nnx_jit`` and ``nnx.jit``.

  Each side trains its own model; the per-call work over the program is the
  graph's split and write-back, which both pay.
  """
  import numpy as np
  import optax
  from flax import nnx
  import ipu_jax

  MLP = _digits_mlp()

  def step(model, optimizer, x, y):
    def loss_fn(m):
      return optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  batch = batch or 32
  rng = np.random.default_rng(0)
  x = rng.normal(size=(batch, 64)).astype(np.float32)
  y = rng.integers(0, 10, size=batch).astype(np.int32)

  def bound(jitted):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return lambda *_: jitted(model, optimizer, x, y)

  emulated = bound(ipu_jax.nnx_jit(step, config=_config(tiles), target=_target(tiles)))
  return emulated, bound(nnx.jit(step)), (), batch


def _speed_steps(name: str, tiles: int, batch: int) -> tuple:
  """``(emulated, plain, args, batch)`` of speed workload ``name``."""
  import jax
  import ipu_jax
  from experiments import models
  if name == "nnx_mlp":
    return _nnx_mlp_steps(tiles, batch)
  fn, args = models.workload(name, batch=batch)
  emulated = ipu_jax.jit(fn, config=_config(tiles), target=_target(tiles), verbose=0)
  return emulated, jax.jit(fn), args, int(args[2].shape[0])


def run_speed_step(name: str, tiles: int, repeats: int, batch: int = 0) -> dict:
  """Emulated and plain ``jax.jit`` step times of ``name``, run alternately.

  On a shared machine the load moves while a row runs; alternating the two
  (emulated, plain, emulated, ...) gives both the same conditions, and the
  medians of ``repeats`` runs each make the ratio. ``ratio_of_pairs`` is the
  median of each pair's own ratio. ``nnx_mlp`` times ``ipu_jax.nnx_jit``
  against ``nnx.jit``.
  """
  emulated, plain, args, batch = _speed_steps(name, tiles, batch)
  start = time.perf_counter()
  _block(emulated(*args))
  lower_compile = time.perf_counter() - start
  _block(plain(*args))
  emulated_ms, plain_ms = [], []
  for _ in range(repeats):
    for fn_, times in ((emulated, emulated_ms), (plain, plain_ms)):
      start = time.perf_counter()
      _block(fn_(*args))
      times.append((time.perf_counter() - start) * 1e3)
  median = statistics.median
  ratio = median(emulated_ms) / median(plain_ms)
  return dict(workload=name, tiles=tiles, batch=batch, repeats=repeats,
              emulated_ms=median(emulated_ms), plain_ms=median(plain_ms), ratio=ratio,
              ratio_of_pairs=median(e / p for e, p in zip(emulated_ms, plain_ms)),
              lower_compile_s=lower_compile, goal=SPEED_GOALS["step_ratio"],
              meets_goal=ratio <= SPEED_GOALS["step_ratio"], error=None)


def _speed_step_rows(tiles, repeats, batch) -> list:
  rows = []
  for name in _SPEED_WORKLOADS.value:
    for t in tiles:
      print(f"running {name} at {t} tiles ...", flush=True)
      if _ISOLATE.value:
        rows.append(_subprocess_json(
            [f"--case=speed:{name}:{t}", f"--repeats={repeats}", f"--speed_batch={batch}"],
            dict(workload=name, tiles=t)))
      else:
        rows.append(_guarded(run_speed_step, dict(workload=name, tiles=t), name, t,
                             repeats, batch))
  return rows


def _speed_lowering_row(repeats: int) -> dict:
  """enc-8x256's lowering CPU seconds on 4 Bow IPUs over 1: the fastest of ``repeats``
  each, lowered in turn, and the median of the rounds' ratios."""
  from experiments import lowering_time
  one, four = lowering_time.measure_alternating(_SPEED_LOWERING_ROWS, max(1, repeats))
  ratios = lowering_time.over(four, one)
  ratio = ratios["fastest"]
  return dict(workload="lowering enc-8x256 bow x4 / x1", one_ipu_cpu_s=min(one["cpu_s"]),
              four_ipu_cpu_s=min(four["cpu_s"]), one_ipu_wall_s=min(one["wall_s"]),
              four_ipu_wall_s=min(four["wall_s"]), ratio=ratio,
              ratio_of_rounds=ratios["rounds"],
              goal=SPEED_GOALS["lowering_ratio"],
              meets_goal=ratio <= SPEED_GOALS["lowering_ratio"],
              figures_sha1=[one["figures_sha1"], four["figures_sha1"]],
              figure_runs_share=[one["figure_compression"]["runs_share"],
                                 four["figure_compression"]["runs_share"]],
              tile_classes=[one["figure_compression"]["classes"],
                            four["figure_compression"]["classes"]],
              error=None)


def _run_estimate(label: str, args: list, timeout: float) -> dict:
  """``experiments.bert_pretraining ARGS --estimate_only`` in a subprocess: wall, peak RSS."""
  import tempfile
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "estimate.json")
    cmd = [sys.executable, "-m", "experiments.bert_pretraining", *args, "--estimate_only",
           f"--json_out={out}"]
    start = time.time()
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=timeout,
                            env=dict(os.environ, IPU_JAX_PROGRESS="0"))
    except subprocess.TimeoutExpired:
      return dict(workload=label, args=args, error=f"timed out after {timeout} s")
    wall = time.time() - start
    if proc.returncode or not os.path.exists(out):
      return dict(workload=label, args=args, wall_s=wall, error=proc.stderr[-500:])
    with open(out) as f:
      result = json.load(f)
  return dict(workload=label, args=args, wall_s=wall, peak_rss_bytes=result["peak_rss_bytes"],
              error=None)


def _speed_estimate_rows(timeout: float) -> list:
  """The POD16 BERT-Large estimate (the pod suite's row) and the split search's, vs goals."""
  from experiments import benchmark_pod
  print("running phase2_pod16 --estimate_only ...", flush=True)
  row = benchmark_pod.run_row("phase2_pod16", timeout)
  estimate = dict(workload="phase2_pod16 estimate", args=row.get("args"),
                  wall_s=row.get("wall_s"), peak_rss_bytes=row.get("peak_rss_bytes"),
                  error=row.get("error"))
  print("running phase1_pod16 --auto_split --estimate_only ...", flush=True)
  split = _run_estimate("phase1_pod16 auto_split", ["--config=phase1_pod16", "--auto_split"],
                        timeout)
  goals = SPEED_GOALS
  if estimate["error"] is None:
    estimate.update(goal_wall_s=goals["estimate_wall_s"], goal_rss_gib=goals["estimate_rss_gib"],
                    meets_goal=estimate["wall_s"] <= goals["estimate_wall_s"]
                    and estimate["peak_rss_bytes"] <= goals["estimate_rss_gib"] * 2**30)
  if split["error"] is None:
    split.update(goal_wall_s=goals["auto_split_wall_s"],
                 meets_goal=split["wall_s"] <= goals["auto_split_wall_s"])
  return [estimate, split]


def speed_table(results: list) -> str:
  """One line per figure: what was measured, the goal, whether it is met."""
  lines = []
  for r in results:
    if r.get("error"):
      lines.append(f"{r['workload']:<36} ERROR {str(r['error']).splitlines()[-1:]}")
      continue
    met = "meets" if r.get("meets_goal") else "MISSES"
    if "tiles" in r:
      plain = "nnx.jit" if r["workload"] == "nnx_mlp" else "jax.jit"
      lines.append(f"{r['workload'] + ' step @ ' + str(r['tiles']) + ' tiles':<36} "
                   f"emulated {r['emulated_ms']:8.2f} ms  {plain} {r['plain_ms']:8.2f} ms  "
                   f"ratio {r['ratio']:.2f}x (pairs {r['ratio_of_pairs']:.2f}x)  "
                   f"goal <= {r['goal']}x: {met}")
    elif "four_ipu_cpu_s" in r:
      rounds = (f" (rounds {r['ratio_of_rounds']:.2f}x)" if r.get("ratio_of_rounds")
                else "")
      lines.append(f"{r['workload']:<36} {r['four_ipu_cpu_s']:.2f} / {r['one_ipu_cpu_s']:.2f} "
                   f"CPU s  ratio {r['ratio']:.2f}x{rounds}  goal <= {r['goal']}x: {met}")
    else:
      rss = f"  peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB" if r.get("peak_rss_bytes") else ""
      goal = f"goal <= {r['goal_wall_s']:.0f} s" + (
          f", <= {r['goal_rss_gib']:.0f} GiB" if "goal_rss_gib" in r else "")
      lines.append(f"{r['workload']:<36} wall {r['wall_s']:6.1f} s{rss}  {goal}: {met}")
  return "\n".join(lines)


def _main_speed():
  parts = set(_SPEED_PARTS.value)
  unknown = parts - {"steps", "lowering", "estimates"}
  if unknown:
    raise app.UsageError(f"--speed_parts: unknown {sorted(unknown)}; valid parts are "
                         "steps, lowering, estimates.")
  workloads = set(_SPEED_WORKLOADS.value) - {"mlp", "cnn", "transformer", "nnx_mlp"}
  if workloads:
    raise app.UsageError(f"--speed_workloads: unknown {sorted(workloads)}; valid "
                         "workloads are mlp, cnn, transformer, nnx_mlp.")
  results = []
  if "steps" in parts:
    results += _speed_step_rows([int(t) for t in _TILES.value], _REPEATS.value,
                                _SPEED_BATCH.value)
  if "lowering" in parts:
    print("lowering enc-8x256 on 1 and 4 Bow IPUs ...", flush=True)
    results.append(_guarded(_speed_lowering_row, dict(workload="lowering enc-8x256"),
                            min(_REPEATS.value, 5)))
  if "estimates" in parts:
    results += _speed_estimate_rows(_ROW_TIMEOUT.value)
  print(speed_table(results))
  out = _JSON_OUT.value
  if out:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
      json.dump(dict(SCHEMA, suite="speed", host=_host(), goals=SPEED_GOALS,
                     load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
                     results=results), f, indent=2)
    print(f"\nwrote {out}")


def _guarded(function, row: dict, *args) -> dict:
  """``function(*args)``, or ``row`` with the error (a failing row does not stop the suite)."""
  try:
    return function(*args)
  except Exception as e:  # pylint: disable=broad-except
    return dict(row, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


def _subprocess_json(flags_: list, row: dict) -> dict:
  """This runner with ``flags_`` in a subprocess; the last JSON line it prints."""
  cmd = [sys.executable, "-m", "experiments.benchmark", *flags_,
         f"--executor={_EXECUTOR.value}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return dict(row, error=f"subprocess failed: {proc.stderr[-500:]}")


def run_case(name, tiles, repeats):
  from ipu_jax import host_time
  try:
    if name == "fit":
      result = _run_fit_case(tiles, repeats)
    else:
      result = _run_step_case(name, tiles, repeats)
    result["error"] = None
  except Exception as e:  # a failing case is recorded, the run goes on
    result = dict(plain_ms=None, emulated_ms=None, ratio=None, lower_compile_s=None,
                  ipu_cycles=None, ipu_seconds=None, supersteps=None,
                  error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
  result["peak_host_mib"] = host_time.peak_rss_bytes() / 2**20
  return dict(workload=name, tiles=tiles, **result)


def _subprocess_case(name, tiles):
  cmd = [sys.executable, "-m", "experiments.benchmark", f"--case={name}:{tiles}",
         f"--repeats={_REPEATS.value}", f"--executor={_EXECUTOR.value}"]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
  for line in reversed(proc.stdout.splitlines()):
    if line.startswith("{"):
      return json.loads(line)
  return dict(workload=name, tiles=tiles, error=f"subprocess failed: {proc.stderr[-500:]}")


def _host():
  import jax
  return dict(platform=platform.platform(), processor=platform.processor(),
              cpu_count=os.cpu_count(), python=platform.python_version(),
              jax=jax.__version__, executor=_EXECUTOR.value)


def _table(results):
  header = (f"{'workload':<12} {'tiles':>6} {'plain ms':>10} {'emulated ms':>12} "
            f"{'ratio':>7} {'lower+compile s':>16} {'peak MiB':>9} {'IPU est. ms':>12}")
  lines = [header, "-" * len(header)]
  for r in results:
    if r.get("error"):
      lines.append(f"{r['workload']:<12} {r['tiles']:>6}  ERROR {r['error']}")
      continue
    ipu_ms = (r["ipu_seconds"] or 0) * 1e3
    lines.append(
        f"{r['workload']:<12} {r['tiles']:>6} {r['plain_ms']:>10.2f} {r['emulated_ms']:>12.2f} "
        f"{r['ratio']:>7.2f} {r['lower_compile_s']:>16.2f} {r['peak_host_mib']:>9.0f} {ipu_ms:>12.4f}")
  return "\n".join(lines)


def main(argv):
  del argv
  from experiments import common, entry  # pylint: disable=g-import-not-at-top
  common.quiet_backend_probe()
  try:  # written at the end, after minutes of rows: its directory made now
    entry.prepare_outputs(files=[("--json_out", _JSON_OUT.value)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if _CASE.value:
    name, tiles = _CASE.value.split(":", 1)
    if name == "speed":
      workload, tiles = tiles.split(":")
      print(json.dumps(_guarded(run_speed_step, dict(workload=workload, tiles=int(tiles)),
                                workload, int(tiles), _REPEATS.value, _SPEED_BATCH.value)))
      return
    if name == "scale":
      print(json.dumps(run_scale_case(tiles, _REPEATS.value)))
    else:
      print(json.dumps(run_case(name, int(tiles), _REPEATS.value)))
    return
  if _SUITE.value == "scale":
    _main_scale()
    return
  if _SUITE.value == "pod":
    _main_pod()
    return
  if _SUITE.value == "speed":
    _main_speed()
    return
  results = []
  for name in _WORKLOADS.value:
    for tiles in (int(t) for t in _TILES.value):
      print(f"running {name} at {tiles} tiles ...", flush=True)
      result = (_subprocess_case(name, tiles) if _ISOLATE.value
                else run_case(name, tiles, _REPEATS.value))
      results.append(result)
  print(_table(results))
  by_key = {(r["workload"], r["tiles"]): r for r in results}
  tiles = sorted(int(t) for t in _TILES.value)
  if len(tiles) >= 2:
    print(f"\n{tiles[-1]}-tile / {tiles[0]}-tile emulated time:")
    for name in _WORKLOADS.value:
      small, big = by_key.get((name, tiles[0])), by_key.get((name, tiles[-1]))
      if small and big and small.get("emulated_ms") and big.get("emulated_ms"):
        print(f"  {name:<12} {big['emulated_ms'] / small['emulated_ms']:.2f}x")
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(_JSON_OUT.value) or ".", exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      json.dump(dict(SCHEMA, host=_host(), results=results), f, indent=2)
    print(f"\nwrote {_JSON_OUT.value}")


if __name__ == "__main__":
  # experiments.lowering_time (the speed suite's lowering row) imports this
  # module by name: let it find this one, whose flags are defined, not a second copy.
  sys.modules.setdefault("experiments.benchmark", sys.modules[__name__])
  app.run(main)
