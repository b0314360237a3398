"""experiments/pyscf_ipu.py: pyscf-ipu's nanoDFT through ipu-jax, against PySCF.

The energy tests run the runner in a subprocess, as a user does: the IPU path installs the
TessellateIPU alias, which routes ``jax.jit(..., backend="ipu")`` for the whole process. They need
PySCF, the packages pyscf-ipu imports and a pyscf-ipu checkout named by ``$PYSCF_IPU_SRC``
(docs/pyscf_ipu.md#running-it), and skip saying which is missing.
"""

import importlib.util
import json
import os
import subprocess
import sys

from absl.testing import absltest
import chex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the runners live in the repository, not in the package
  sys.path.insert(0, ROOT)

from experiments import pyscf_ipu  # noqa: E402

# What pyscf-ipu's nanoDFT imports (the `pyscf` extra of setup.cfg).
DEPENDENCIES = ("pyscf", "jaxtyping", "jsonargparse", "icecream", "h5py", "pubchempy", "tqdm",
                "matplotlib")


def _missing() -> str:
  """Why the energy tests cannot run here ('' when they can)."""
  absent = [name for name in DEPENDENCIES if importlib.util.find_spec(name) is None]
  if absent:
    return f"pip install -e .[pyscf] first: {', '.join(absent)} not installed"
  try:
    pyscf_ipu.source_path(None)
  except pyscf_ipu.NanoDFTSourceError as error:
    return str(error)
  return ""


def _run_runner(tmp_dir: str, *flags: str):
  out = os.path.join(tmp_dir, "result.json")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run([sys.executable, "-m", "experiments.pyscf_ipu", *flags,
                         f"--json_out={out}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=3000)
  return proc, out


class RunnerErrorsTest(chex.TestCase):
  """Errors a user meets before anything runs."""

  def test_without_a_checkout_the_runner_says_how_to_give_one(self):
    env = {k: v for k, v in os.environ.items() if k != pyscf_ipu.SRC_ENV}
    proc = subprocess.run([sys.executable, "-m", "experiments.pyscf_ipu", "--molecule=h2o",
                           "--backend=cpu", "--tiles=16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-2000:])
    self.assertIn("No pyscf-ipu source given", proc.stderr)
    self.assertIn("--pyscf_ipu_src", proc.stderr)
    self.assertIn(pyscf_ipu.SRC_ENV, proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)

  def test_an_incomplete_checkout_names_the_missing_file(self):
    src = self.create_tempdir()
    src.create_file("pyscf_ipu/nanoDFT/nanoDFT.py", "")
    with self.assertRaisesRegex(pyscf_ipu.NanoDFTSourceError,
                                "not a pyscf-ipu checkout .*compute_indices.cpp"):
      pyscf_ipu.run("h2o", src.full_path, backend="cpu", tiles=16)

  def test_the_ipu_path_refuses_fewer_tiles_than_it_names(self):
    with self.assertRaisesRegex(ValueError, r"tiles 1\.\.1471.*--tiles=1472"):
      pyscf_ipu.run("h2o", "/nonexistent", backend="ipu", tiles=16)


class NanoDFTEnergyTest(chex.TestCase):
  """nanoDFT's energy through ipu-jax equals PySCF's (issue 41's acceptance)."""

  def setUp(self):
    super().setUp()
    reason = _missing()
    if reason:
      self.skipTest(reason)

  def _result(self, *flags: str) -> dict:
    proc, out = _run_runner(self.create_tempdir().full_path, *flags)
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(out) as f:
      return json.load(f)

  def _check_cycles(self, cycles: dict) -> None:
    parts = cycles["by_part"]
    self.assertAlmostEqual(sum(parts.values()), cycles["per_iteration"],
                           delta=1e-6 * cycles["per_iteration"])
    self.assertGreater(parts["eri"], 0)
    self.assertGreater(parts["eigh"], 0)
    self.assertGreater(parts["grid"], 0)

  def test_h2o_cpu_path_through_ipu_jax_matches_pyscf(self):
    result = self._result("--molecule=h2o", "--backend=cpu", "--tiles=16")
    self.assertLess(result["error_hartree"], 1e-4, result)
    self._check_cycles(result["cycles"])

  def test_h2o_ipu_path_matches_pyscf(self):
    # nanoDFT(..., backend="ipu") unchanged: all 1,472 tiles, the C++ vertex compiled from the
    # checkout; about 35 s on 2 cores (docs/pyscf_ipu.md#tests).
    proc, out = _run_runner(self.create_tempdir().full_path, "--molecule=h2o", "--backend=ipu")
    self.assertEqual(proc.returncode, 0, proc.stdout[-3000:] + proc.stderr[-3000:])
    with open(out) as f:
      result = json.load(f)
    self.assertLess(result["error_hartree"], 1e-4, result)
    self._check_cycles(result["cycles"])
    self.assertTrue(any("IndicesIJKL" in name for name in result["cycles"]["vertices"]),
                    result["cycles"]["vertices"])


if __name__ == "__main__":
  absltest.main()
