"""The examples in the library's docstrings run, and print what they show.

Every ``>>>`` example in a module of ``ipu_jax`` (its ``lowering`` and
``kernels`` floors included) is a doctest: a docstring's example that drifts
from the code fails here rather than misleading a reader. Modules are found
by walking the installed package, so a new module's examples run the day it
appears.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

from absl.testing import absltest
from absl.testing import parameterized
import chex

import ipu_jax
import ipu_jax.kernels
import ipu_jax.lowering

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def modules_with_examples() -> list[str]:
  """Every module below ``ipu_jax`` whose docstrings hold a ``>>>`` example."""
  found = []
  # The two lower floors are walked on their own: an editable install maps
  # them from other folders, which ipu_jax.__path__ does not list.
  names = {info.name for package in (ipu_jax, ipu_jax.lowering, ipu_jax.kernels)
           for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
  for name in sorted(n for n in names if not n.endswith("__main__")):
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module)
    if any(t.examples for t in tests):
      found.append(name)
  return sorted(found)


_MODULES = modules_with_examples()


class DocstringExamplesTest(chex.TestCase, parameterized.TestCase):

  def test_the_public_entry_points_have_examples(self):
    for name in ("ipu_jax.jit", "ipu_jax.stages", "ipu_jax.config", "ipu_jax.ops.tile_map",
                 "ipu_jax.report.reports"):
      self.assertIn(name, _MODULES)

  @parameterized.parameters(*_MODULES)
  def test_examples_run(self, name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    for test in finder.find(module):
      runner.run(test)
    result = runner.summarize(verbose=False)
    self.assertEqual(result.failed, 0, f"{result.failed} of {result.attempted} examples of "
                     f"{name} failed (their output is printed above)")
    self.assertGreater(result.attempted, 0)


if __name__ == "__main__":
  absltest.main()
