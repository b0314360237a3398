"""Replicas on JAX devices (shard_map) and across processes (jax.distributed).

The host-device count is fixed when JAX starts, so each scenario runs this
file as a worker in a fresh subprocess:

* ``matrix``: one process with 4 CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=4``) trains with every
  R in {1, 2, 4} x G in {1, 2, 4}, mean reductions, and compares the weights
  with plain optax on batches of R G b samples;
* ``multiprocess``: 2 processes joined by ``jax.distributed`` over loopback
  (gloo CPU collectives), 2 replicas each, whose weights must equal those of
  one process with 4 replicas (written by the matrix worker).
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
B = 4          # micro-batch per replica
UPDATES = 4    # weight updates per run
LR = 1e-2


# ---------------------------------------------------------------------------
# The worker (runs in a subprocess).
# ---------------------------------------------------------------------------


def _data(n):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  y = np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int32)
  return x, y


def _module():
  from flax import nnx
  import testing_utils  # the worker imports JAX only after its flags are set
  return testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0))


def _train(replicas, accumulation):
  """Fits UPDATES updates with R local replicas and G; returns (model, x, y)."""
  import jax
  import optax
  import ipu_jax
  import ipu_jax.keras
  from ipu_jax.strategy import IPUStrategy
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.replication_factor = replicas
  cfg.training.replica_reduction = "mean"
  total = replicas * jax.process_count()
  n = total * accumulation * B * UPDATES
  x, y = _data(n)
  with IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(_module())
    model.compile(optax.adam(LR), "sparse_categorical_crossentropy",
                  steps_per_execution=total * accumulation * 2)
    model.set_gradient_accumulation_options(
        gradient_accumulation_steps_per_replica=accumulation, reduction_method="mean")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
  return model, x, y


_REFERENCE = {}  # the plain step, jitted once: the combos' batch sizes repeat


def _reference_step(graphdef):
  """Plain optax Adam's jitted step on ``graphdef``'s model (one per graphdef)."""
  import jax
  import optax
  from flax import nnx
  if graphdef not in _REFERENCE:
    opt = optax.adam(LR)

    def loss(p, xb, yb):
      return optax.softmax_cross_entropy_with_integer_labels(
          nnx.merge(graphdef, p)(xb), yb).mean()

    @jax.jit
    def step(p, s, xb, yb):
      updates, s = opt.update(jax.grad(loss)(p, xb, yb), s, p)
      return optax.apply_updates(p, updates), s
    _REFERENCE[graphdef] = opt, step
  return _REFERENCE[graphdef]


def _reference(x, y, batch):
  from flax import nnx
  graphdef, params = nnx.split(_module(), nnx.Param)
  opt, step = _reference_step(graphdef)
  state = opt.init(params)
  for i in range(0, len(x), batch):
    params, state = step(params, state, x[i:i + batch], y[i:i + batch])
  return params


def _leaves(params):
  import jax
  return [np.asarray(v) for v in jax.tree.leaves(params)]


def _matrix(out_dir):
  import jax
  results = []
  for replicas in (1, 2, 4):
    for accumulation in (1, 2, 4):
      start = time.perf_counter()
      model, x, y = _train(replicas, accumulation)
      expected = _leaves(_reference(x, y, replicas * accumulation * B))
      actual = _leaves(model.params)
      # How far outside rtol 1e-5 the worst element is (<= 0: within).
      excess = max(float(np.max(np.abs(a - e) - 1e-5 * np.abs(e)))
                   for a, e in zip(actual, expected))
      report = model.train_report
      results.append({
          "replicas": replicas, "accumulation": accumulation,
          "mode": model.replication.mode, "excess": excess, "step": model.step,
          "all_reduce": any("cross_replica" in op for op in report.cycles_by_op()),
          "seconds": time.perf_counter() - start})
      if (replicas, accumulation) == (4, 2):
        np.savez(os.path.join(out_dir, "four_replicas.npz"), *actual)
  with open(os.path.join(out_dir, "matrix.json"), "w") as f:
    json.dump({"devices": jax.device_count(), "results": results}, f)


def _multiprocess(out_dir, address, process_id):
  from ipu_jax.keras.replication import initialize_distributed
  initialize_distributed(address, 2, process_id, local_device_count=2)
  import jax
  model, _, _ = _train(replicas=2, accumulation=2)
  info = {"process": jax.process_index(), "processes": jax.process_count(),
          "devices": jax.device_count(), "mode": model.replication.mode,
          "replicas": model.num_replicas, "step": model.step}
  np.savez(os.path.join(out_dir, f"process{process_id}.npz"), *_leaves(model.params))
  with open(os.path.join(out_dir, f"process{process_id}.json"), "w") as f:
    json.dump(info, f)
  jax.distributed.shutdown()


# ---------------------------------------------------------------------------
# The tests.
# ---------------------------------------------------------------------------


def _env(devices=None):
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if devices:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def matrix_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("matrix")
  proc = subprocess.run([sys.executable, HERE, "matrix", str(out)], env=_env(devices=4),
                        capture_output=True, text=True, timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return out


def test_replicas_and_accumulation_on_devices_equal_one_big_batch(matrix_dir):
  with open(matrix_dir / "matrix.json") as f:
    data = json.load(f)
  assert data["devices"] == 4
  combos = {(r["replicas"], r["accumulation"]) for r in data["results"]}
  assert combos == {(r, g) for r in (1, 2, 4) for g in (1, 2, 4)}
  for r in data["results"]:
    assert r["excess"] <= 0.0, r           # within rtol 1e-5 of plain optax
    assert r["step"] == UPDATES, r
    assert r["mode"] == ("single" if r["replicas"] == 1 else "devices"), r
    assert r["all_reduce"] == (r["replicas"] > 1), r


def test_two_processes_equal_one_process_with_four_replicas(matrix_dir, tmp_path):
  port = _free_port()
  address = f"127.0.0.1:{port}"
  procs = [subprocess.Popen([sys.executable, HERE, "multiprocess", str(tmp_path), address,
                             str(i)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=300))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, (out, err) in zip(procs, outputs):
    if p.returncode != 0 and ("gloo" in err.lower() and "not" in err.lower()
                              and "support" in err.lower()):
      pytest.skip("this jaxlib has no gloo CPU collectives: " + err[-500:])
    assert p.returncode == 0, out[-2000:] + err[-5000:]
  expected = np.load(matrix_dir / "four_replicas.npz")
  for i in range(2):
    with open(tmp_path / f"process{i}.json") as f:
      info = json.load(f)
    assert info == {"process": i, "processes": 2, "devices": 4, "mode": "devices",
                    "replicas": 4, "step": UPDATES}
    got = np.load(tmp_path / f"process{i}.npz")
    assert len(got.files) == len(expected.files)
    for key in expected.files:
      np.testing.assert_allclose(got[key], expected[key], rtol=1e-5)


if __name__ == "__main__":
  from absl import flags as absl_flags
  absl_flags.FLAGS.mark_as_parsed()
  mode = sys.argv[1]
  if mode == "matrix":
    _matrix(sys.argv[2])
  elif mode == "multiprocess":
    _multiprocess(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  else:
    raise SystemExit(f"unknown mode {mode}")
