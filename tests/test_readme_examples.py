"""The README's examples run as written, and its test command is CI's.

The README is the user's guide: its first examples are what a new user pastes.
The self-contained ones (the taste: a jitted function and its report, the
Keras-like training run; the graph API) are executed here exactly as printed,
in a scratch directory, and their results read. The other snippets continue
those (they use names such as ``model`` or ``cfg``), so they are compiled, not
run. The README's set-up test command and ``.ci/run`` must stay in step.
"""

import contextlib
import io
import os
import re

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
  with open(os.path.join(_ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def _blocks(language: str) -> list:
  return re.findall(rf"```{language}\n(.*?)```", _readme(), re.S)


def _block_starting(prefix: str) -> str:
  found = [b for b in _blocks("python") if b.startswith(prefix)]
  assert len(found) == 1, f"one README example should start with {prefix!r}; found {len(found)}"
  return found[0]


class ReadmeExamplesTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    previous = os.getcwd()
    os.chdir(self.create_tempdir().full_path)  # the examples write reports/
    self.addCleanup(os.chdir, previous)

  def _run(self, source: str, name: str, prelude: str = "") -> dict:
    namespace = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(prelude + source, f"README.md:{name}", "exec"), namespace)  # pylint: disable=exec-used
    namespace["_printed"] = out.getvalue()
    return namespace

  def test_taste_jit_and_report(self):
    ns = self._run(_block_starting("import jax, jax.numpy as jnp, ipu_jax"), "taste")
    want = jax.jit(lambda x, w: jnp.tanh(x @ w))(ns["x"], ns["w"])
    chex.assert_trees_all_close(np.asarray(ns["y"]), np.asarray(want), rtol=2e-5, atol=2e-5)
    self.assertIn("cycles", ns["_printed"].lower())
    for name in ("report.json", "report.html", "trace.json"):
      self.assertTrue(os.path.exists(os.path.join("reports", "tanh", name)), name)

  def test_taste_keras_training(self):
    ns = self._run(_block_starting("import numpy as np, optax, ipu_jax"), "training")
    report = ns["model"].reports["train"]
    self.assertIs(report, ns["model"].report)
    self.assertGreater(report.total_cycles, 0)
    # What the example says it does: 2 replicas, 8 steps per host call.
    self.assertIn("2 replica(s)", ns["_printed"])
    self.assertIn("One execution: 8 micro-batch step(s)", ns["_printed"])
    self.assertRegex(ns["_printed"], r"Epoch 2/2\n.*loss: \d+\.\d+")

  def test_graph_api(self):
    ns = self._run(_block_starting("from ipu_jax import graph as g"), "graph",
                   prelude="import numpy as np, ipu_jax\n")
    np.testing.assert_array_equal(ns["engine"].read_tensor(ns["out"]), 6.0)
    self.assertIn("out: 6.0", ns["_printed"])

  def test_every_python_example_compiles(self):
    blocks = _blocks("python")
    self.assertGreaterEqual(len(blocks), 5)
    for i, block in enumerate(blocks):
      compile(block, f"README.md python example {i}", "exec")

  def test_setup_test_command_is_cis(self):
    commands = [b.strip() for b in _blocks("bash")]
    self.assertTrue(commands[0].endswith("python -m experiments.mnist --report_dir reports/mnist"),
                    commands[0])
    readme_tests = commands[1].split("&&")[-1].strip()
    with open(os.path.join(_ROOT, ".ci", "run"), encoding="utf-8") as f:
      ci = [line.strip() for line in f if line.strip().startswith("python -m pytest")]
    self.assertEqual(ci, [readme_tests])


if __name__ == "__main__":
  absltest.main()
