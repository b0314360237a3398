"""Every example command in a runner's ``--help`` runs as written.

The help text is the runner's module docstring (absl prints it). Each command
found there runs in a subprocess with a small step count appended (later
flags win): one epoch of 128 samples, one execution of the on-device loop.
An example that runs out of tile memory, or fails any other way, fails here.
"""

import os
import re
import shlex
import subprocess
import sys

from absl.testing import absltest, parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNERS = ("mnist", "cifar_cnn", "transformer")
SMALL = ["--epochs=1", "--num_samples=128", "--verbose=0"]


def _help_text(runner: str) -> str:
  proc = subprocess.run([sys.executable, "-m", f"experiments.{runner}", "--help"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  # absl's --help prints the usage and exits with status 1.
  assert proc.returncode in (0, 1) and "Try --helpfull" in proc.stdout, proc.stderr[-2000:]
  return proc.stdout


def examples(text: str) -> list:
  """The ``python ...`` command lines of a help text, comments dropped."""
  commands = []
  for line in text.splitlines():
    line = line.split("#", 1)[0].strip()
    if line.startswith("python ") and "experiments" in line:
      commands.append(shlex.split(line))
  return commands


def _cases():
  cases = []
  for runner in RUNNERS:
    with open(os.path.join(ROOT, "experiments", f"{runner}.py")) as f:
      source = f.read()
    doc = source.split('"""', 2)[1]
    for i, argv in enumerate(examples(doc)):
      cases.append((f"{runner}_{i}", runner, argv))
  return cases


class HelpExamplesTest(parameterized.TestCase):

  def test_help_shows_the_docstring_examples(self):
    for runner in RUNNERS:
      shown = examples(_help_text(runner))
      self.assertNotEmpty(shown, runner)
      self.assertEqual(shown, [argv for _, r, argv in _cases() if r == runner])

  @parameterized.named_parameters(*_cases())
  def test_example_runs(self, runner, argv):
    del runner
    report_dir = self.create_tempdir().full_path
    command = [sys.executable] + argv[1:] + SMALL + [f"--report_dir={report_dir}"]
    proc = subprocess.run(command, cwd=ROOT, env=_user_env(), capture_output=True, text=True,
                          timeout=600)
    self.assertEqual(proc.returncode, 0,
                     f"{shlex.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    self.assertIn("test_accuracy", proc.stdout)
    self.assertTrue(os.path.exists(os.path.join(report_dir, "report.json")))
    self.assertEqual(_foreign_lines(proc.stdout + proc.stderr), [])


def _user_env():
  """The environment a user runs in: no JAX_PLATFORMS (the runners choose), warnings shown."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  env["PYTHONWARNINGS"] = "always::DeprecationWarning,always::UserWarning"
  return env


def _foreign_lines(output: str) -> list:
  """Lines a run should not print: warnings, absl/C++ log lines (``I1127 04:25:16 ...``)."""
  return [line for line in output.splitlines()
          if re.match(r"[IWEF]\d{4} \d\d:\d\d:\d\d", line) or "Warning" in line
          or "Traceback" in line]


class LayerCostsHelpTest(parameterized.TestCase):
  """experiments.layer_costs (no training flags): its --help examples run as written."""

  def _documented(self):
    with open(os.path.join(ROOT, "experiments", "layer_costs.py")) as f:
      return examples(f.read().split('"""', 2)[1])

  def test_help_shows_the_examples(self):
    documented = self._documented()
    self.assertEqual(examples(_help_text("layer_costs")), documented)
    self.assertLen(documented, 2)

  def test_examples_run(self):
    for argv in self._documented():
      out = os.path.join(self.create_tempdir().full_path, "layer.json")
      proc = subprocess.run([sys.executable] + argv[1:] + [f"--json_out={out}"], cwd=ROOT,
                            env=_user_env(), capture_output=True, text=True, timeout=600)
      self.assertEqual(proc.returncode, 0, f"{shlex.join(argv)} failed:\n{proc.stderr[-3000:]}")
      self.assertIn("forward_backward:", proc.stdout)
      self.assertTrue(os.path.exists(out))
      self.assertEqual(_foreign_lines(proc.stdout + proc.stderr), [])


class RunnerFlagsTest(parameterized.TestCase):

  @parameterized.parameters(*RUNNERS)
  def test_help_lists_the_shared_flags_and_every_target(self, runner):
    from ipu_jax.kernels.target import PRESETS
    text = _help_text(runner)
    for flag in ("--epochs", "--tiles_per_ipu", "--report_dir", "--replicas",
                 "--accumulation_steps", "--reduction", "--steps_per_execution"):
      self.assertIn(f"  {flag}", text, runner)
    self.assertIn(f"--target: <{'|'.join(sorted(PRESETS))}>", text)
    self.assertIn("ipu21", PRESETS)

  def test_first_line_says_how_gradients_are_reduced(self):
    from experiments import common
    settings = common.Settings(replicas=2, accumulation_steps=3, reduction="sum")
    line = common.describe(settings, common.make_config(settings), "mnist")
    self.assertIn("gradients summed over the 3 micro-batch(es) and 2 replica(s) "
                  "(--reduction sum)", line)

  @parameterized.parameters(
      ("batch_size", 0, 1), ("epochs", 0, 1), ("replicas", 0, 1),
      ("accumulation_steps", 0, 1), ("ipus_per_replica", 0, 1), ("num_samples", -1, 0),
      ("tiles_per_ipu", -5, 0), ("steps_per_execution", -1, 0),
  )
  def test_settings_name_the_field_its_flag_and_least_value(self, name, value, least):
    # --batch_size 0 used to end in a ZeroDivisionError, --epochs 0 in a KeyError.
    from experiments import common
    with self.assertRaisesRegex(ValueError, rf"Settings\.{name} must be an int >= {least} "
                                            rf"\(--{name}\); got {value}\."):
      common.Settings(**{name: value})

  def test_paths_and_processes_are_checked_before_a_run(self):
    from experiments import common
    with self.assertRaisesRegex(ValueError, "needs --coordinator_address host:port"):
      common.Settings(num_processes=2, process_id=1)
    with self.assertRaisesRegex(ValueError, "Settings.process_id=2 must be below "
                                            "num_processes=1"):
      common.Settings(process_id=2)
    with self.assertRaisesRegex(ValueError, "--data_dir=/nonexistent is not a directory"):
      common.check_paths(common.Settings(data_dir="/nonexistent"))
    # The flags refuse a count below its least when parsed (absl's bound).
    with self.assertRaisesRegex(Exception, "flag --batch_size=0: 0 is not a positive integer"):
      common.FLAGS["batch_size"].parse("0")

  def test_the_main_job_refuses_a_bad_flag_before_it_runs(self):
    # The whole command line: flags, Settings, paths. A report directory that
    # is a file used to fail when the report was saved, after the training.
    a_file = self.create_tempfile().full_path
    proc = subprocess.run([sys.executable, "-m", "experiments.mnist", "--report_dir", a_file],
                          cwd=ROOT, env=_user_env(), capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
    self.assertIn(f"--report_dir={a_file}: {a_file} is a file", proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)
    self.assertNotIn("report written", proc.stdout)

  def test_out_of_memory_prints_the_message_and_the_fix(self):
    # docs/streaming_memory.md's example: Adam state does not fit 28 tiles at
    # micro-batch 17.
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.transformer", "--tiles_per_ipu", "28",
         "--batch_size", "17", "--num_samples", "256", "--epochs", "1", "--verbose", "0",
         f"--report_dir={self.create_tempdir().full_path}"],
        cwd=ROOT, env=_user_env(), capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 1, proc.stdout[-2000:] + proc.stderr[-3000:])
    self.assertNotIn("Traceback", proc.stderr)
    self.assertRegex(proc.stderr, r"(?m)^OutOfMemoryError: Out of memory on tile \d+ of "
                                  r"'train_step'")
    hints = proc.stderr.split("What may help:\n", 1)[1].splitlines()
    self.assertTrue(hints[0].startswith("  - optimizer state:"), hints)
    self.assertIn("streaming.offload_optimizer_state", hints[0])

  def test_low_precision_runner_prints_no_backend_probe(self):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.low_precision", "--steps", "1", "--small_steps",
         "1", "--variants", "fp32", "--batch_size", "2", "--tiles_per_ipu", "16",
         f"--out_dir={self.create_tempdir().full_path}"],
        cwd=ROOT, env=_user_env(), capture_output=True, text=True, timeout=600)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertEqual(_foreign_lines(proc.stdout + proc.stderr), [])


if __name__ == "__main__":
  absltest.main()
