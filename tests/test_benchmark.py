"""The benchmark runner's speed suite (issue 43): its step rows run and report their keys;
the lowering rows are measured in turn."""

import json
import os
import subprocess
import sys
import tempfile

from unittest import mock

import chex
from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import host_time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEP_KEYS = {"workload", "tiles", "batch", "repeats", "emulated_ms", "plain_ms", "ratio",
              "ratio_of_pairs", "lower_compile_s", "goal", "meets_goal", "error"}


class SpeedSuiteTest(chex.TestCase):

  def test_step_rows_at_small_size(self):
    # One step at batch 2: the CNN's and the tiny LM's rows run the same code
    # as the MLP's; the NNX step's (ipu_jax.nnx_jit against nnx.jit) its own.
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "speed.json")
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.benchmark", "--suite=speed",
           "--speed_parts=steps", "--speed_workloads=mlp,nnx_mlp", "--speed_batch=2", "--tiles=16",
           "--repeats=2",
           "--noisolate", f"--json_out={out}"],
          capture_output=True, text=True, cwd=_ROOT, timeout=600,
          env=dict(os.environ, IPU_JAX_PROGRESS="0"))
      self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
      with open(out) as f:
        data = json.load(f)
    self.assertEqual(data["suite"], "speed")
    self.assertEqual(data["goals"]["step_ratio"], 1.2)
    rows = data["results"]
    self.assertEqual([r["workload"] for r in rows], ["mlp", "nnx_mlp"])
    for row in rows:
      self.assertIsNone(row["error"])
      self.assertEqual(set(row), _STEP_KEYS)
      self.assertEqual((row["tiles"], row["batch"], row["repeats"]), (16, 2, 2))
      self.assertGreater(row["emulated_ms"], 0)
      self.assertGreater(row["plain_ms"], 0)
      self.assertAlmostEqual(row["ratio"], row["emulated_ms"] / row["plain_ms"])
      self.assertEqual(row["meets_goal"], row["ratio"] <= 1.2)
      self.assertIn(f"{row['workload']} step @ 16 tiles", proc.stdout)

  def test_unknown_part_is_a_usage_error(self):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.benchmark", "--suite=speed",
         "--speed_parts=steps,bogus", "--json_out="],
        capture_output=True, text=True, cwd=_ROOT, timeout=300)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("--speed_parts: unknown ['bogus']", proc.stderr)


class LoweringTimeTest(chex.TestCase):

  def test_rows_lowered_in_turn_keep_their_figures(self):
    # The lowering rows are measured round by round (the machine drifts
    # within minutes); each keeps its own times, equations and figures.
    # Two small steps stand in for the scale rows (whose models take seconds
    # to build): the runner's rows by name, the step and target each gives.
    from experiments import lowering_time
    t16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    steps = {"tanh": (lambda x: jnp.tanh(x), (np.ones((6, 40), np.float32),)),
             "sum": (lambda x: jnp.sum(x * x, 0), (np.ones((9, 33), np.float32),))}

    def prepare(name):
      fn, args = steps[name]
      row = lowering_time._Row  # pylint: disable=protected-access
      return row(name, fn, args, t16, ipu_jax.IPUConfig())

    with mock.patch.object(lowering_time, "_prepare", prepare):
      rows = lowering_time.measure_alternating(["tanh", "sum"], 3)
      alone = lowering_time.measure("sum", 1)
    self.assertEqual([m["row"] for m in rows], ["tanh", "sum"])
    for m in rows:
      self.assertLen(m["cpu_s"], 3)
      self.assertGreater(min(m["cpu_s"]), 0)
    self.assertEqual(rows[1]["figures_sha1"], alone["figures_sha1"])
    self.assertEqual(rows[1]["figure_compression"], alone["figure_compression"])
    self.assertEqual(rows[1]["equations"], alone["equations"])
    self.assertNotEqual(rows[0]["figures_sha1"], rows[1]["figures_sha1"])
    # Each row over the first, as the runner prints it and the speed suite's
    # lowering row reports it: fastest over fastest, and the rounds' median.
    ratio = lowering_time.over(rows[1], rows[0])
    self.assertAlmostEqual(ratio["fastest"], min(rows[1]["cpu_s"]) / min(rows[0]["cpu_s"]))
    self.assertAlmostEqual(ratio["rounds"], float(np.median(
        np.array(rows[1]["cpu_s"]) / np.array(rows[0]["cpu_s"]))))

  def test_the_tile_count_row_is_the_four_ipu_step_on_one_wide_ipu(self):
    # enc-8x256-t5888 parts the four-IPU row's lowering time: the same step
    # on one IPU of the four's tiles, each tile as large as ipu2's.
    from experiments import scale_workloads
    one, wide, four = (scale_workloads.row(n) for n in
                       ("enc-8x256", "enc-8x256-t5888", "enc-8x256-bow4"))
    targets = [r.ipu_target() for r in (one, wide, four)]
    self.assertEqual([(t.num_ipus, t.num_tiles) for t in targets],
                     [(1, 1472), (1, 5888), (4, 5888)])
    self.assertEqual(targets[1].bytes_per_tile, targets[0].bytes_per_tile)
    geometry = lambda r: (r.model, r.batch, r.layers, r.width, r.heads, r.seq, r.vocab)
    self.assertEqual(geometry(wide), geometry(four))
    self.assertEqual(geometry(wide), geometry(one))
    self.assertEqual([r.target_name for r in (wide, four)], ["ipu2x1 (5888 tiles)", "bowx4"])
    self.assertEqual(scale_workloads.row("enc-4x128-bow1x16").target_name, "bowx1 x16 replicas")


class FigureCompressionTest(chex.TestCase):
  """How many values a program's per-tile figures take as runs and as classes of tiles."""

  def _compression(self, fn, x):
    from experiments.program_figures import figure_compression
    t16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    emulated = ipu_jax.jit(fn, target=t16, verbose=0)
    chex.assert_trees_all_close(np.asarray(emulated(x)), np.asarray(fn(x)), rtol=1e-6)
    return figure_compression(emulated.lower(x).program)

  def test_a_figure_equal_on_every_tile_is_one_run_and_one_class(self):
    # 1,024 elements on 16 tiles: every tile runs the same tanh (cycles and
    # vertices, two figures), each one run of sixteen values; one step whose
    # tiles are all alike.
    c = self._compression(jnp.tanh, np.linspace(-2, 2, 1024, dtype=np.float32))
    self.assertEqual((c["figures"], c["tiles"], c["runs"], c["runs_share"]), (2, 16, 2, 2 / 32))
    self.assertEqual((c["median_runs"], c["p90_runs"]), (1, 1))
    self.assertEqual((c["steps"], c["classes"], c["median_classes"]), (1, 1, 1))

  def test_a_scalar_on_one_tile_is_that_tile_and_the_idle_rest(self):
    # One element on tile 0: its cycles and vertices are a value and fifteen
    # zeros (two runs each); its exchange's bytes in and out, zero on every
    # tile, one run each. Two classes of tiles: the busy one and the idle.
    c = self._compression(jnp.tanh, np.float32(0.5))
    self.assertEqual((c["figures"], c["runs"], c["runs_share"]), (4, 6, 6 / 64))
    self.assertEqual((c["steps"], c["classes"]), (1, 2))

  def test_classes_count_tiles_alike_wherever_they_lie(self):
    # Five rows of 100 summed on sixteen tiles: the rows' partials and sums
    # fall on every third tile or so, figures alternating along the tiles
    # (many runs) between a few values (few classes).
    c = self._compression(lambda x: jnp.sum(x * x, axis=1), np.ones((5, 100), np.float32))
    self.assertEqual(c["steps"], 3)  # the square, the partials, the sums
    self.assertLess(4 * c["classes"], c["runs"])
    self.assertLessEqual(c["runs"], c["figures"] * c["tiles"])

  def test_a_program_without_supersteps_has_no_figures(self):
    c = self._compression(lambda x: x, np.ones(3, np.float32))
    self.assertEqual((c["figures"], c["steps"], c["runs"], c["classes"]), (0, 0, 0, 0))


class PeakMemoryTest(chex.TestCase):

  def test_a_runner_started_from_a_large_process_reports_its_own_peak(self):
    # The speed suite lowers programs in its own process, then starts the
    # POD estimates: each must report its own peak, not the suite's (Linux
    # keeps ru_maxrss across exec).
    held = np.ones(96 << 20, np.uint8)  # 96 MiB touched in this process
    parent = host_time.peak_rss_bytes()
    proc = subprocess.run(
        [sys.executable, "-c", "from ipu_jax import host_time; print(host_time.peak_rss_bytes())"],
        capture_output=True, text=True, cwd=_ROOT, timeout=120, check=True)
    child = int(proc.stdout.split()[-1])
    self.assertGreater(parent, held.nbytes)
    self.assertGreater(child, 1 << 20)
    if os.path.exists("/proc/self/status"):
      self.assertLess(child, parent)

if __name__ == "__main__":
  absltest.main()
