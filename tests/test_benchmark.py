"""The benchmark runner's speed suite (issue 43): its step rows run and report their keys."""

import json
import os
import subprocess
import sys
import tempfile

import chex
from absl.testing import absltest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STEP_KEYS = {"workload", "tiles", "batch", "repeats", "emulated_ms", "plain_ms", "ratio",
              "ratio_of_pairs", "lower_compile_s", "goal", "meets_goal", "error"}


class SpeedSuiteTest(chex.TestCase):

  def test_step_rows_at_small_size(self):
    # One step at batch 2: the CNN's and the tiny LM's rows run the same code.
    with tempfile.TemporaryDirectory() as tmp:
      out = os.path.join(tmp, "speed.json")
      proc = subprocess.run(
          [sys.executable, "-m", "experiments.benchmark", "--suite=speed",
           "--speed_parts=steps", "--speed_workloads=mlp", "--speed_batch=2", "--tiles=16",
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
    self.assertEqual([r["workload"] for r in rows], ["mlp"])
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


if __name__ == "__main__":
  absltest.main()
