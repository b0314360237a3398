"""Every import path, source file and docs page the documentation names exists.

Scans the README, WORKSPACE.md, the pages of ``docs/`` and every docstring and
string literal of the package (``ipu_jax/``, ``lowering/``, ``kernels/``,
``experiments/``) for ``from ipu_jax... import name`` lines, dotted
``ipu_jax.x.y`` references and ``.py`` paths, and checks that each imports,
resolves or exists, so a renamed module or a moved function cannot leave the
docs or an error message pointing nowhere. References to ``docs/`` pages (with
a ``#section``) from the code, and the Markdown links between the documents,
must reach an existing file and heading; and nothing may cite a file that is
not in the repository (the design notes the code once cited lived outside it).
"""

import ast
import glob
import importlib
import os
import re

from absl.testing import absltest
from absl.testing import parameterized

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("ipu_jax", "lowering", "kernels", "experiments")
_DOCS = ("README.md", "WORKSPACE.md") + tuple(
    os.path.relpath(p, _ROOT) for p in sorted(glob.glob(os.path.join(_ROOT, "docs", "*.md"))))
# ipu_jax.lowering and ipu_jax.kernels are installed from these folders.
_FOLDERS = {"ipu_jax/lowering/": "lowering/", "ipu_jax/kernels/": "kernels/"}

_FROM_IMPORT = re.compile(r"from\s+(ipu_jax(?:\.\w+)*)\s+import\s+\(?([\w ,]+)")
_DOTTED = re.compile(r"(?<![\w./])(ipu_jax(?:\.\w+)+)")
_PATH = re.compile(r"(?<![\w./])((?:ipu_jax|lowering|kernels|experiments|tests)/[\w/]+\.py)\b")
# "docs/page.md" or "docs/page.md#section" as the code and the README cite them.
_DOCS_PAGE = re.compile(r"(?<![\w./])(docs/[\w-]+\.md)(?:#([\w-]+))?")
# Markdown links: [text](target), targets relative to the document.
_MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# Files outside the repository that code or docs once cited.
_OUTSIDE = re.compile("DESIGN" r"(?:\.md| section)|\.\./shared/|/work/")


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


def _anchors(path: str) -> set:
  """GitHub's anchors of a Markdown file's headings."""
  anchors, seen = set(), {}
  in_code = False
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("```"):
        in_code = not in_code
      if in_code or not line.startswith("#"):
        continue
      slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
      count = seen.get(slug, 0)
      seen[slug] = count + 1
      anchors.add(slug if count == 0 else f"{slug}-{count}")
  return anchors


def _missing_target(path: str, anchor) -> str:
  """Why ``path#anchor`` (relative to the root) reaches nothing, or ''."""
  full = os.path.join(_ROOT, path)
  if not os.path.exists(full):
    return "no such file"
  if anchor and anchor not in _anchors(full):
    return f"no heading with anchor #{anchor}"
  return ""


def _source_files():
  """Every Python file of the package and the tests, but this one."""
  for package in _PACKAGES + ("tests",):
    for folder, _, files in os.walk(os.path.join(_ROOT, package)):
      for name in sorted(files):
        path = os.path.join(folder, name)
        if name.endswith(".py") and path != os.path.abspath(__file__):
          yield path


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


  def test_docs_pages_cited(self):
    cited, broken = 0, []
    for where, text in _texts():
      for page, anchor in _DOCS_PAGE.findall(text):
        cited += 1
        why = _missing_target(page, anchor)
        if why:
          broken.append(f"{where}: {page}{'#' + anchor if anchor else ''} ({why})")
    self.assertGreater(cited, 5)
    self.assertEmpty(broken, "\n".join(broken))

  def test_markdown_links(self):
    broken = []
    for name in _DOCS:
      with open(os.path.join(_ROOT, name), encoding="utf-8") as f:
        text = f.read()
      for target in _MD_LINK.findall(text):
        if re.match(r"[a-z]+:", target):
          continue  # a web address
        path, _, anchor = target.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(name), path)) if path else name
        why = _missing_target(path, anchor)
        if why:
          broken.append(f"{name}: ({target}) {why}")
    self.assertEmpty(broken, "\n".join(broken))

  def test_nothing_cites_files_outside_the_repository(self):
    found = []
    paths = [os.path.join(_ROOT, name) for name in _DOCS] + list(_source_files())
    for path in paths:
      with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
          if _OUTSIDE.search(line):
            found.append(f"{os.path.relpath(path, _ROOT)}:{number}: {line.strip()}")
    self.assertEmpty(found, "\n".join(found))


if __name__ == "__main__":
  absltest.main()
