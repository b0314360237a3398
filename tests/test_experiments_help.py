"""Every example command in a runner's ``--help`` runs as written.

The help text is the runner's module docstring (absl prints it). Each command
found there runs in a subprocess with a small step count appended (later
flags win): one epoch of 128 samples, one execution of the on-device loop.
An example that runs out of tile memory, or fails any other way, fails here.
"""

import os
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
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    self.assertEqual(proc.returncode, 0,
                     f"{shlex.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    self.assertIn("test_accuracy", proc.stdout)
    self.assertTrue(os.path.exists(os.path.join(report_dir, "report.json")))


if __name__ == "__main__":
  absltest.main()
