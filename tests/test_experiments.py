"""The experiment runners: they train, print progress and the report, and save it."""

import gzip
import json
import os
import pickle
import struct
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the runners live in the repository, not in the package
  sys.path.insert(0, ROOT)

from experiments import cifar_cnn, common, low_precision, mnist, transformer  # noqa: E402


def _settings(tmp_path, **changes):
  values = dict(tiles_per_ipu=16, epochs=1, batch_size=16, learning_rate=3e-3,
                report_dir=str(tmp_path / "report"), verbose=2)
  values.update(changes)
  return common.Settings(**values)


def test_mnist_runner_trains_and_writes_its_report(tmp_path, capsys):
  results = mnist.run(_settings(tmp_path, epochs=3, batch_size=32))
  out = capsys.readouterr().out
  assert results["test_accuracy"] >= 0.85, results
  assert results["host_round_trips"] == results["executions"] > 0
  assert "Epoch 3/3" in out and "samples/s emulated" in out
  assert "Host round trips:" in out          # the report summary was printed
  with open(tmp_path / "report" / "report.json") as f:
    report = json.load(f)
  assert report["target"]["num_tiles"] == 16
  assert report["totals"]["host_round_trips"] == 1


def test_mnist_script_with_replicas_and_accumulation(tmp_path):
  report_dir = tmp_path / "mnist"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "mnist.py"), "--tiles_per_ipu=16",
       "--epochs=1", "--replicas=2", "--accumulation_steps=2", f"--report_dir={report_dir}"],
      cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "2 replica(s)" in proc.stdout and "G=2" in proc.stdout and "S=8" in proc.stdout
  assert "Epoch 1/1" in proc.stdout and "test_accuracy" in proc.stdout
  assert "IPU-Link traffic" in proc.stdout   # the all-reduce crosses IPU-Links
  assert (report_dir / "report.json").exists()


def _write_idx(path, array):
  array = np.asarray(array, np.uint8)
  header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(
      ">" + "I" * array.ndim, *array.shape)
  with gzip.open(path, "wb") as f:
    f.write(header + array.tobytes())


def test_mnist_reads_idx_files(tmp_path):
  rng = np.random.default_rng(0)
  for prefix, n in (("train", 20), ("t10k", 10)):
    _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
    _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
  (x_train, y_train), (x_test, y_test) = mnist.load_data(str(tmp_path))
  assert x_train.shape == (20, 784) and x_test.shape == (10, 784)
  assert x_train.dtype == np.float32 and 0 <= x_train.min() and x_train.max() <= 1
  assert y_train.shape == (20,) and y_test.dtype == np.int32


def test_cifar_reads_pickle_batches(tmp_path):
  rng = np.random.default_rng(0)
  for name, n in (("data_batch_1", 6), ("data_batch_2", 4), ("test_batch", 5)):
    with open(tmp_path / name, "wb") as f:
      pickle.dump({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                   b"labels": list(rng.integers(0, 10, n))}, f)
  (x_train, y_train), (x_test, y_test) = cifar_cnn.load_data(str(tmp_path))
  assert x_train.shape == (10, 32, 32, 3) and x_test.shape == (5, 32, 32, 3)
  assert y_train.shape == (10,)


def test_cifar_cnn_runner(tmp_path, capsys):
  results = cifar_cnn.run(_settings(tmp_path, tiles_per_ipu=0, num_samples=32,
                                    batch_size=4, steps_per_execution=8))
  out = capsys.readouterr().out
  assert results["executions"] == 1
  assert "conv1/kernel" in out and "dense1/kernel" in out
  assert (tmp_path / "report" / "report.json").exists()
  assert np.isfinite(results["test_loss"])


def test_transformer_runner(tmp_path, capsys):
  results = transformer.run(_settings(tmp_path, tiles_per_ipu=0, num_samples=128,
                                      batch_size=8), task="reverse")
  out = capsys.readouterr().out
  assert "task: reverse" in out
  assert results["executions"] == 2
  assert (tmp_path / "report" / "report.json").exists()
  x, y = transformer.make_data(4, "shift")
  np.testing.assert_array_equal(y[:, 1:], x[:, :-1])
  x, y = transformer.make_data(4, "reverse")
  np.testing.assert_array_equal(y, x[:, ::-1])


def test_low_precision_fp16_drops_small_updates_and_saves_its_telemetry(tmp_path):
  data = low_precision.make_data(64)
  # One compile serves both learning rates; 5e-4 x these gradients is below
  # half an fp16 ulp of most weights, so round to nearest leaves them.
  big, small = low_precision.run_variant("fp16", data, runs=[(0.05, 2), (5e-4, 2)], batch=4,
                                         tiles=16, out_dir=str(tmp_path))
  assert (big["learning_rate"], small["learning_rate"]) == (0.05, 5e-4)
  assert small["weights_unchanged"] > 0.5 > big["weights_unchanged"]
  assert len(small["losses"]) == 2 and np.isfinite(small["final_loss"])
  for run in (big, small):
    with open(os.path.join(run["report"], "report.json")) as f:
      telemetry = json.load(f)["number_formats"]
    assert telemetry == run["number_formats"]
    assert telemetry["loss_scaling"]["steps"] == [1, 2]
    assert telemetry["loss_scaling"]["scale"] == [4096.0, 4096.0]
    assert os.path.exists(os.path.join(run["report"], "number_formats.png"))


def test_settings_and_flags():
  s = common.Settings(replicas=4, accumulation_steps=4)
  assert s.resolved_steps_per_execution == 16
  s = common.Settings(replicas=2, accumulation_steps=1)
  assert s.resolved_steps_per_execution == 8
  cfg = common.make_config(common.Settings(target="bow", tiles_per_ipu=32, replicas=2,
                                           reduction="sum"))
  assert cfg.to_target().name == "bow" and cfg.to_target().num_tiles == 32
  assert cfg.replication_factor == 2 and cfg.training.replica_reduction == "sum"
  defaults = common.settings_from_flags(mnist.DEFAULTS)
  assert defaults.epochs == mnist.DEFAULTS["epochs"]
  assert defaults.target == "ipu2"


def test_replicated_scale_row_all_reduces_its_gradients():
  # A scale row with replicas lowers one replica's step whose gradients are
  # averaged over the replicas (an all-reduce step per gradient), and runs as
  # one replica: the numbers of the plain step (a mean of one replica).
  import jax
  import ipu_jax
  from experiments import scale_workloads
  row = scale_workloads.ScaleRow("tiny-x2", "transformer", batch=2, layers=1, width=32, heads=2,
                                 seq=16, vocab=64, replicas=2)
  fn, args = scale_workloads.workload(row)
  cfg = ipu_jax.IPUConfig()
  cfg.replication_factor = row.replicas
  emulated = ipu_jax.jit(fn, config=cfg, target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16),
                         verbose=0)
  names = [s.name for s in emulated.lower(*args).report.profile.steps]
  assert sum(n.startswith("all_reduce<mean>x2") for n in names) == len(jax.tree.leaves(args[0]))
  params, _, loss = emulated(*args)
  want_params, _, want_loss = jax.jit(fn)(*args)
  np.testing.assert_allclose(np.asarray(loss), np.asarray(want_loss), rtol=1e-4)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=1e-5)


import chex  # noqa: E402
from absl.testing import parameterized  # noqa: E402

# A 2-head width-64 BERT layer on 16 tiles: seconds.
_TINY_LAYER = ["--hidden=64", "--heads=2", "--ffn=256", "--seq=32", "--micro_batch=1",
               "--tiles_per_ipu=16"]


class LayerCostsRunnerTest(chex.TestCase, parameterized.TestCase):
  """``python -m experiments.layer_costs``: one encoder layer's cycles, part by part."""

  def _run(self, *flags):
    out = os.path.join(self.create_tempdir().full_path, "layer.json")
    proc = subprocess.run([sys.executable, "-m", "experiments.layer_costs", *_TINY_LAYER,
                           *flags, f"--json_out={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-3000:])
    self.assertIn("forward_backward:", proc.stdout)
    with open(out) as f:
      return json.load(f)

  @parameterized.named_parameters(("half_partials", "float16", 0.0),
                                  ("float_partials_dropout", "float32", 0.1))
  def test_parts_add_up_to_the_totals(self, partials, dropout):
    from ipu_jax.kernels.cost_model import COST_MODEL_VERSION
    results = self._run(f"--partials={partials}", f"--dropout={dropout}")
    self.assertEqual((results["schema"], results["version"]), ("ipu-jax-layer-costs", 1))
    self.assertEqual(results["cost_model"], COST_MODEL_VERSION)
    for key in ("forward", "forward_backward"):
      program = results[key]
      parts = [p for passes in program["passes"].values() for p in passes.values()]
      self.assertAlmostEqual(sum(p["cycles"] for p in parts), program["total_cycles"], delta=1)
      for part in parts:
        self.assertAlmostEqual(sum(s["cycles"] for s in part["steps"].values()), part["cycles"],
                               delta=1)
      self.assertGreater(program["peak_tile_bytes"], 0)
    forward, both = results["forward"], results["forward_backward"]
    self.assertEqual(list(forward["passes"]), ["forward"])
    self.assertEqual(sorted(both["passes"]), ["backward", "forward"])
    self.assertEqual((forward["matmuls"], both["matmuls"]), (6, 18))
    # The forward alone is a part of forward + backward: its products cost the same there.
    self.assertLess(forward["total_cycles"], both["total_cycles"])
    matmul_parts = ("qkv_matmul", "attention_scores", "attention_context",
                    "attention_output_matmul", "ffn_in_matmul", "ffn_out_matmul")
    for name in matmul_parts + ("softmax", "gelu", "layer_norm"):
      self.assertIn(name, both["passes"]["backward"])
      self.assertIn(name, both["passes"]["forward"])
    for name in matmul_parts:
      self.assertEqual(forward["passes"]["forward"][name]["cycles"],
                       both["passes"]["forward"][name]["cycles"], name)
    self.assertEqual("dropout" in forward["passes"]["forward"], dropout > 0)

  @parameterized.named_parameters(("float_partials", "float32", 4, 8),
                                  ("half_partials", "float16", 2, 16))
  def test_matmuls_stand_beside_poplins_estimate(self, partials, partials_bytes, units):
    results = self._run(f"--partials={partials}")
    references = [r for passes in results["forward_backward"]["passes"].values()
                  for part in passes.values() for r in part.get("poplin_reference", [])]
    self.assertLen(references, 18)
    for r in references:
      # Bow (IPU2) with float16 operands: poplin's 8 half-float units, 16 half-half.
      self.assertEqual((r["partials_bytes"], r["conv_units"]), (partials_bytes, units))
      # Cost model 21: kernels/amp.py is poplin's estimate case for case (was within 15 %).
      self.assertEqual(r["estimate_compute_cycles"], r["poplin_cycles"], r["step"])

  def test_half_partials_reference_is_poplins_estimate_worked_by_hand(self):
    from experiments.poplibs_reference import poplibs_amp_matmul_cycles
    # poplibs 7eac0f2, lib/poplin/PerformanceEstimation.hpp ("PE"): [64, 64] x [64, 64]
    # half-half on IPU2's 16 units, 6 workers. Half activations on 16 units take the
    # half-float code path (PE:418-419, common = 1), retention savings (7, 3) (PE:49-58);
    # 4 input groups of 16, 4 output groups of 16; 64 rows dealt 11,11,11,11,10,10.
    # Inner loop (PE:420-488), worker = (37 zeroing / 38 not) + (e - 3) * 4 - 7:
    #   zeroing: 11 rows 62 x 6 = 372, 10 rows 58 x 6 = 348; max(372, 348 + 14) = 372;
    #   not:     11 rows 63 x 6 = 378, 10 rows 59 x 6 = 354; max(378, 354 + 14) = 378.
    # Weight loads 16 units x 32 bytes / 16 bytes a cycle = 32 (PE:558-570).
    # Outer loop (PE:595-616): 50 + 6 x (7 + 3 x 3) + 12 + 1
    #   + 3 x (15 - 1 + 1 + 4 x (19 + 6 + 32 + 378)) + (10 + 1 + 4 x (19 - 1 + 7 + 32 + 372))
    #   = 146 + 13 + 5,265 + 1,727 = 7,151.
    self.assertEqual(poplibs_amp_matmul_cycles(64, 64, 64, True, 16, 6, float_partials=False),
                     7151)
    # Half-half on 8 units has its own path (common = 0, no retention, 2 zeroing cycles a
    # row, PE:413-415): [12, 16] x [16, 8], 2 rows a worker, one input and output group:
    # worker 40 + (2 + 2 x 2) = 46, x 6 = 276, max(276, 276 + 14) = 290; loads 8 x 32 / 16
    # = 16; 50 + 12 + (10 + 1 + (19 + 7 + 16 + 290)) = 405.
    self.assertEqual(poplibs_amp_matmul_cycles(12, 16, 8, True, 8, 6, float_partials=False),
                     405)
    # The float-partials path is unchanged (its values before half partials were added).
    self.assertEqual(poplibs_amp_matmul_cycles(64, 64, 64, True, 8, 6), 13575)
    self.assertEqual(poplibs_amp_matmul_cycles(64, 64, 64, False, 8, 6), 47251)
    # Float activations always accumulate in float (ConvVertexType.cpp:250-252).
    self.assertEqual(poplibs_amp_matmul_cycles(64, 64, 64, False, 8, 6, float_partials=False),
                     47251)
