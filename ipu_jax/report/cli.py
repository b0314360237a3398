"""``python -m ipu_jax.report``: print, compare or render saved reports.

::

    python -m ipu_jax.report A                   # A's summary
    python -m ipu_jax.report A B                 # what changed from A to B
    python -m ipu_jax.report A --html a.html     # A's interactive report
    python -m ipu_jax.report A B --html diff.html  # side-by-side comparison page
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ipu_jax.report.compare import compare_reports
from ipu_jax.report.reports import load_report

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m ipu_jax.report A [B]``: summary of A, or A compared to B."""
  parser = argparse.ArgumentParser(
      prog="python -m ipu_jax.report",
      description="Print the summary of a saved ipu-jax report, or compare "
                  "two reports.")
  parser.add_argument("reports", nargs="+", metavar="REPORT",
                      help="a report directory or its report.json (one to "
                           "summarise, two to compare)")
  parser.add_argument("--top", type=int, default=None,
                      help="how many operations / tensors to list")
  args = parser.parse_args(argv)
  if len(args.reports) > 2:
    parser.error("give one report to summarise or two to compare")
  try:
    loaded = [load_report(path) for path in args.reports]
  except (OSError, ValueError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  if len(loaded) == 1:
    text = loaded[0].summary(**({"top": args.top} if args.top else {}))
  else:
    text = compare_reports(*loaded, **({"top": args.top} if args.top else {}))
  sys.stdout.write(text)
  return 0

