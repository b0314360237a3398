"""The three floors import only downward: ipu_jax -> lowering -> kernels.

``kernels/`` (targets, cost figures, number formats) is the bottom floor,
``lowering/`` (jaxpr -> tile program, JAX's own primitives, the executor) the
middle, and ``ipu_jax/`` (the user's API and each custom IPU op with its tile
rule) the top. The folders are installed as ``ipu_jax.kernels`` and
``ipu_jax.lowering`` through ``setup.cfg``'s ``package_dir``, which import-graph
tools such as import-linter do not follow (they would see ``lowering/`` as
loose files), so this test reads the source itself, every package found on
disk, with the remap resolved from ``setup.cfg``. Every import counts, also
those inside functions. A second rule: no module reads another module's
private name (``from m import _x`` or ``m._x``), and no private module
(``_common``) is imported from outside its package.
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import functools
import importlib.util
import pathlib
from typing import Optional

from absl.testing import absltest
from absl.testing import parameterized
import chex

_REPO = pathlib.Path(__file__).resolve().parents[1]

# Lower number, lower floor. A module's floor is that of the longest prefix.
FLOORS = {"ipu_jax.kernels": 0, "ipu_jax.lowering": 1, "ipu_jax": 2}
FLOOR_NAMES = {0: "kernels", 1: "lowering", 2: "ipu_jax"}


@dataclasses.dataclass(frozen=True)
class Violation:
  """One import that breaks the contract."""

  path: str        # the importing file, relative to the repository
  line: int
  importer: str    # the importing module
  imported: str    # the module (or module.name) imported
  why: str

  def __str__(self):
    return f"{self.path}:{self.line}: {self.importer} imports {self.imported} ({self.why})"


def remap(repo: pathlib.Path) -> dict[str, str]:
  """Package -> folder for packages installed from another folder (setup.cfg)."""
  cfg = configparser.ConfigParser()
  cfg.read(repo / "setup.cfg")
  pairs = {}
  for line in cfg["options"].get("package_dir", "").strip().splitlines():
    name, _, folder = (part.strip() for part in line.partition("="))
    pairs[name] = folder
  return pairs


def package_dirs(repo: pathlib.Path) -> dict[str, pathlib.Path]:
  """Package name -> folder, for every folder with an ``__init__.py`` on disk.

  Found by walking the tree, not read from a list, so a new subpackage is
  checked the day it appears (a hand-kept list once hid ``ipu_jax.sparse``).
  """
  roots = {"ipu_jax": repo / "ipu_jax"}
  roots.update({name: repo / folder for name, folder in remap(repo).items()})
  dirs = {}
  for package, root in roots.items():
    for init in sorted(root.rglob("__init__.py")):
      rest = init.parent.relative_to(root).parts
      dirs[".".join((package,) + rest)] = init.parent
  return dirs


def modules(repo: pathlib.Path) -> dict[str, pathlib.Path]:
  """Every installed module name -> its source file."""
  found = {}
  for package, folder in package_dirs(repo).items():
    for path in sorted(folder.glob("*.py")):
      name = package if path.stem == "__init__" else f"{package}.{path.stem}"
      found[name] = path
  return found


def floor_of(module: str):
  """The floor number of a project module, or None outside the project."""
  best = max((p for p in FLOORS if module == p or module.startswith(p + ".")),
             key=len, default=None)
  return None if best is None else FLOORS[best]


def _imports(tree: ast.AST, module: str, is_package: bool):
  """(line, module, name or None, local name) of every import, relative ones resolved."""
  return _facts(tree, module, is_package)[0]


def _facts(tree: ast.AST, module: str, is_package: bool):
  """A module's imports and its ``name._attr`` reads, from one walk of its tree.

  Kept per tree (``_parse`` keeps a tree per source): a check walks every
  module of the library, and each deliberate-break test checks twice.
  """
  key = (id(tree), module, is_package)
  if key not in _FACTS:
    imports, reads = [], []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          imports.append((node.lineno, alias.name, None, alias.asname or alias.name))
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          parts = package.split(".")
          parts = parts[:len(parts) - node.level + 1]
          base = ".".join(parts + ([node.module] if node.module else []))
        for alias in node.names:
          imports.append((node.lineno, base, alias.name, alias.asname or alias.name))
      elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.attr.startswith("_") and not node.attr.startswith("__")):
        reads.append((node.lineno, node.value.id, node.attr))
    _FACTS[key] = (tree, imports, reads)  # the tree held: its id stays its own
  return _FACTS[key][1:]


_FACTS = {}


def _module_aliases(tree: ast.AST, module: str, is_package: bool, known) -> dict[str, str]:
  """Local name -> project module, for names an import binds to a module."""
  aliases = {}
  for _, target, name, local in _imports(tree, module, is_package):
    full = f"{target}.{name}" if name else target
    if full in known and (name or local != target):  # `import a.b` binds `a`, no alias
      aliases[local] = full
  return aliases


def _private_attribute_reads(tree: ast.AST, module: str, is_package: bool, known):
  """(line, module.name) of each ``alias._name`` read through an imported module."""
  aliases = _module_aliases(tree, module, is_package, known)
  for line, name, attr in _facts(tree, module, is_package)[1]:
    if name in aliases and aliases[name] != module:
      yield line, f"{aliases[name]}.{attr}"


def _private_module_outside(imported: str, importer: str) -> bool:
  """Whether ``imported`` is a private module of a package ``importer`` is not in."""
  parts = imported.split(".")
  for i, part in enumerate(parts):
    if part.startswith("_") and not part.startswith("__"):
      owner = ".".join(parts[:i])
      return not (importer == owner or importer.startswith(owner + "."))
  return False


@functools.lru_cache(maxsize=None)
def _parse(source: str, filename: str) -> ast.AST:
  return ast.parse(source, filename)


def check(repo: pathlib.Path, edits: Optional[dict[str, str]] = None) -> list[Violation]:
  """Every import in the project's library that breaks the contract.

  Args:
    repo: the repository root (holding setup.cfg).
    edits: source text to use instead of a file's, by path relative to
      ``repo`` (to show that a deliberate break is caught); a path that is
      not a file yet adds a module.
  """
  edits = edits or {}
  known = modules(repo)
  for rel in edits:
    path = repo / rel
    if path not in known.values():
      package = next(p for p, d in package_dirs(repo).items() if d == path.parent)
      known[f"{package}.{path.stem}"] = path
  found = []
  for module, path in known.items():
    floor = floor_of(module)
    rel = str(path.relative_to(repo))
    source = edits[rel] if rel in edits else path.read_text()
    tree = _parse(source, str(path))
    for line, target, name, _ in _imports(tree, module, path.stem == "__init__"):
      full = f"{target}.{name}" if name else target
      # `from pkg import mod` imports the module pkg.mod.
      imported = full if full in known else target
      target_floor = floor_of(imported)
      if target_floor is None:
        continue
      if target_floor > floor:
        found.append(Violation(rel, line, module, imported,
                               f"{FLOOR_NAMES[floor]} may not import the "
                               f"{FLOOR_NAMES[target_floor]} floor above it"))
      if (name and imported == target and name.startswith("_")
          and not name.startswith("__") and target != module):
        found.append(Violation(rel, line, module, full,
                               "a private name of another module"))
      elif _private_module_outside(imported, module):
        found.append(Violation(rel, line, module, imported,
                               "a private module of another package"))
    for line, full in _private_attribute_reads(tree, module, path.stem == "__init__", known):
      found.append(Violation(rel, line, module, full, "a private name of another module"))
  return found


class ImportLayersTest(chex.TestCase, parameterized.TestCase):

  def test_the_library_keeps_the_contract(self):
    violations = check(_REPO)
    self.assertEmpty(violations, "\n".join(map(str, violations)))

  def test_the_remap_is_resolved(self):
    found = modules(_REPO)
    self.assertEqual(found["ipu_jax.lowering.executor"], _REPO / "lowering" / "executor.py")
    self.assertEqual(found["ipu_jax.kernels.target"], _REPO / "kernels" / "target.py")
    self.assertEqual(found["ipu_jax.lowering.rules.dot"], _REPO / "lowering" / "rules" / "dot.py")
    self.assertEqual(found["ipu_jax.jit"], _REPO / "ipu_jax" / "jit.py")

  def test_every_package_on_disk_is_installed(self):
    # setup.py's list is what the wheel holds; this test's walk is independent.
    spec = importlib.util.spec_from_file_location("ipu_jax_setup", _REPO / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # defines packages(); setup() runs only as __main__
    self.assertEqual(setup.packages(), sorted(package_dirs(_REPO)))
    self.assertIn("ipu_jax.sparse", setup.packages())

  def test_tests_never_import_a_tests_package(self):
    # tests/ is no package: its modules import each other by name
    # (``import testing_utils``). ``from tests import ...`` would resolve to any
    # installed top-level ``tests`` first (icecream, of the pyscf extra, ships
    # one), which shadows a namespace package.
    found = []
    for path in sorted((_REPO / "tests").rglob("*.py")):
      for node in ast.walk(_parse(path.read_text(), str(path))):
        names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [f"{path.relative_to(_REPO)}:{node.lineno}" for n in names
                  if n == "tests" or n.startswith("tests.")]
    self.assertEmpty(found)
    self.assertFalse((_REPO / "tests" / "__init__.py").exists())

  @parameterized.named_parameters(
      ("kernels_imports_lowering", "kernels/estimators.py",
       "from ipu_jax.lowering import program\n", "lowering floor above it"),
      ("kernels_imports_ipu_jax_in_a_function", "kernels/amp.py",
       "def f():\n  from ipu_jax import config\n  return config\n", "ipu_jax floor above it"),
      ("lowering_imports_ipu_jax", "lowering/rules/dot.py",
       "import ipu_jax.ops.matmul\n", "ipu_jax floor above it"),
      ("lowering_relative_import_upward", "lowering/mapping.py",
       "from .. import jit\n", "ipu_jax floor above it"),
      ("private_name", "ipu_jax/jit.py",
       "from ipu_jax.lowering.rules.control import _lower_any\n", "private name"),
      ("private_module", "ipu_jax/keras/model.py",
       "from ipu_jax.report import _figures\n", "private module"),
      ("private_attribute_read", "ipu_jax/ops/matmul.py",
       "from ipu_jax.lowering import mapping as mp\nX = mp._private_helper\n",
       "private name"),
  )
  def test_a_deliberate_break_is_caught(self, path, code, why):
    # A private module of the report package, for the private-module case.
    private = {"ipu_jax/report/_figures.py": "X = 1\n"}
    self.assertEmpty(check(_REPO, private))
    edits = {**private, path: (_REPO / path).read_text() + "\n" + code}
    violations = check(_REPO, edits)
    self.assertLen(violations, 1, "\n".join(map(str, violations)))
    self.assertEqual(violations[0].path, path)
    self.assertIn(why, str(violations[0]))


if __name__ == "__main__":
  absltest.main()
