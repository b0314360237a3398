"""No file of the repository holds a merge-conflict marker.

A page of docs/ was once committed with its conflict half-resolved (both sides
and the ``<<<<<<<`` / ``>>>>>>>`` lines): Markdown renders it without a word of
warning. Every text file is read, not a list of kinds.
"""

from __future__ import annotations

import pathlib
import re

from absl.testing import absltest
import chex

_REPO = pathlib.Path(__file__).resolve().parents[1]
# Folders that are not the project's source: environments, builds, caches.
_SKIP = {".git", ".venv", "venv", "build", "dist", "reports", "node_modules",
         "__pycache__", ".pytest_cache"}
# git writes `<<<<<<< ours`, `=======`, `>>>>>>> theirs` at a line's start; a
# lone `=======` is also a Markdown heading underline, so only the outer two count.
_MARKER = re.compile(rb"^(<<<<<<<|>>>>>>>)( |$)", re.MULTILINE)


def conflict_markers(root: pathlib.Path) -> list[str]:
  """``path:line`` of every conflict marker in the text files below ``root``."""
  found = []
  for path in sorted(root.rglob("*")):
    rel = path.relative_to(root)
    if set(rel.parts) & _SKIP or not path.is_file() or path.is_symlink():
      continue
    data = path.read_bytes()
    if b"\0" in data[:8192]:  # binary
      continue
    for match in _MARKER.finditer(data):
      line = data.count(b"\n", 0, match.start()) + 1
      found.append(f"{rel}:{line}")
  return found


class ConflictMarkerTest(chex.TestCase):

  def test_no_file_holds_a_conflict_marker(self):
    found = conflict_markers(_REPO)
    self.assertEmpty(found, "merge-conflict markers (resolve them): " + ", ".join(found))

  def test_a_marker_is_found(self):
    root = pathlib.Path(self.create_tempdir().full_path)
    (root / "docs").mkdir()
    (root / "docs" / "page.md").write_text("Title\n=======\n\ntext\n<<<<<<< HEAD\na\n=======\n"
                                           "b\n>>>>>>> other\n")
    (root / "ok.md").write_text("Title\n=======\n")
    self.assertEqual(conflict_markers(root), ["docs/page.md:5", "docs/page.md:9"])


if __name__ == "__main__":
  absltest.main()
