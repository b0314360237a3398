"""Keeping a report of every compiled program (``config.report.directory``)."""

from __future__ import annotations

import os
import re
from typing import Optional

from ipu_jax.report.report_file import make_directory
from ipu_jax.report.reports import as_report

__all__ = ["maybe_auto_save"]


def _safe_name(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "program"


def maybe_auto_save(report, directory: Optional[str | os.PathLike]
                    ) -> Optional[str]:
  """Saves ``report`` into a fresh ``directory/<name>-<n>/`` folder.

  Used to keep a report of every compiled program: ``n`` counts up from 0 so
  earlier reports are never overwritten, even by concurrent saves.

  Args:
    report: a :class:`Report` (or a ``ProgramProfile``).
    directory: the parent folder; None disables saving.

  Returns:
    The folder written, or None when ``directory`` is None.
  """
  if directory is None:
    return None
  report = as_report(report)
  directory = os.fspath(directory)
  make_directory(directory, "IPUConfig.report.directory")
  stem = _safe_name(report.name)
  pattern = re.compile(re.escape(stem) + r"-(\d+)$")
  taken = [int(m.group(1)) for m in map(pattern.match, os.listdir(directory))
           if m]
  n = max(taken) + 1 if taken else 0
  while True:
    path = os.path.join(directory, f"{stem}-{n}")
    try:
      os.makedirs(path)
      break
    except FileExistsError:
      n += 1
  report.save(path)
  return path
