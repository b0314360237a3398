"""Every import path and source file the documentation names exists.

Scans the README, WORKSPACE.md and every docstring and string literal of the
package (``ipu_jax/``, ``lowering/``, ``kernels/``, ``experiments/``) for
``from ipu_jax... import name`` lines, dotted ``ipu_jax.x.y`` references and
``.py`` paths, and checks that each imports, resolves or exists, so a renamed
module or a moved function cannot leave the docs or an error message
pointing nowhere.
"""

import ast
import importlib
import os
import re

from absl.testing import absltest
from absl.testing import parameterized

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("ipu_jax", "lowering", "kernels", "experiments")
_DOCS = ("README.md", "WORKSPACE.md")
# ipu_jax.lowering and ipu_jax.kernels are installed from these folders.
_FOLDERS = {"ipu_jax/lowering/": "lowering/", "ipu_jax/kernels/": "kernels/"}

_FROM_IMPORT = re.compile(r"from\s+(ipu_jax(?:\.\w+)*)\s+import\s+\(?([\w ,]+)")
_DOTTED = re.compile(r"(?<![\w./])(ipu_jax(?:\.\w+)+)")
_PATH = re.compile(r"(?<![\w./])((?:ipu_jax|lowering|kernels|experiments|tests)/[\w/]+\.py)\b")


def _texts():
  """(where, text) of every doc file and every string literal of the package."""
  for name in _DOCS:
    with open(os.path.join(_ROOT, name), encoding="utf-8") as f:
      yield name, f.read()
  for package in _PACKAGES:
    for folder, _, files in os.walk(os.path.join(_ROOT, package)):
      for name in sorted(files):
        if not name.endswith(".py"):
          continue
        path = os.path.join(folder, name)
        with open(path, encoding="utf-8") as f:
          tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
          if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield f"{os.path.relpath(path, _ROOT)}:{node.lineno}", node.value


def _references():
  imports, dotted, paths = {}, {}, {}
  for where, text in _texts():
    for module, names in _FROM_IMPORT.findall(text):
      for name in (n.split(" as ")[0].strip() for n in names.split(",")):
        if name:
          imports.setdefault((module, name), where)
    for ref in _DOTTED.findall(text):
      dotted.setdefault(ref.rstrip("."), where)
    for path in _PATH.findall(text):
      paths.setdefault(path, where)
  return imports, dotted, paths


_IMPORTS, _DOTTED_REFS, _PATHS = _references()


def _resolve(dotted: str):
  """Import the longest module prefix of ``dotted`` and get the rest as attributes."""
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ModuleNotFoundError:
      continue
    for attr in parts[cut:]:
      obj = getattr(obj, attr)
    return obj
  raise ModuleNotFoundError(dotted)


class DocumentedPathsTest(parameterized.TestCase):

  def test_found_some(self):
    # The scan itself works (the README shows the public API).
    self.assertIn(("ipu_jax.lowering", "register_lowering"), _IMPORTS)
    self.assertGreater(len(_DOTTED_REFS), 20)
    self.assertGreater(len(_PATHS), 10)

  def test_from_imports(self):
    broken = []
    for (module, name), where in sorted(_IMPORTS.items()):
      try:
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
          importlib.import_module(f"{module}.{name}")
      except ImportError as e:
        broken.append(f"{where}: from {module} import {name} ({e})")
    self.assertEmpty(broken, "\n".join(broken))

  def test_dotted_references(self):
    broken = []
    for ref, where in sorted(_DOTTED_REFS.items()):
      try:
        _resolve(ref)
      except (ImportError, AttributeError) as e:
        broken.append(f"{where}: {ref} ({e})")
    self.assertEmpty(broken, "\n".join(broken))

  def test_source_paths(self):
    broken = []
    for path, where in sorted(_PATHS.items()):
      local = path
      for prefix, folder in _FOLDERS.items():
        if local.startswith(prefix):
          local = folder + local[len(prefix):]
      if not os.path.exists(os.path.join(_ROOT, local)):
        broken.append(f"{where}: {path}")
    self.assertEmpty(broken, "\n".join(broken))


if __name__ == "__main__":
  absltest.main()
