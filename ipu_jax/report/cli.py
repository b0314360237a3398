"""``python -m ipu_jax.report``: print, compare or render saved reports.

::

    python -m ipu_jax.report A                   # A's summary
    python -m ipu_jax.report A B                 # what changed from A to B
    python -m ipu_jax.report A --html a.html     # A's interactive report
    python -m ipu_jax.report A B --html diff.html  # side-by-side comparison page
    python -m ipu_jax.report A B --json diff.json  # the comparison as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

from ipu_jax.report import html as html_lib
from ipu_jax.report.compare import compare_reports
from ipu_jax.report.compare import comparison_to_dict
from ipu_jax.report.reports import load_report

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
  """``python -m ipu_jax.report A [B] [--html OUT] [--json OUT]``.

  Prints the summary of A, or A compared to B; with ``--html``, writes A's
  interactive page, or the comparison page of A and B, to OUT instead; with
  ``--json`` (two reports), the comparison as JSON (``comparison_to_dict``).
  """
  parser = argparse.ArgumentParser(
      prog="python -m ipu_jax.report",
      description="Print the summary of a saved ipu-jax report, or compare "
                  "two reports; --html writes the interactive page instead.")
  parser.add_argument("reports", nargs="+", metavar="REPORT",
                      help="a report directory or its report.json (one to "
                           "summarise, two to compare)")
  parser.add_argument("--top", type=int, default=None,
                      help="how many operations / tensors to list")
  parser.add_argument("--html", metavar="OUT", default=None,
                      help="write the HTML page (one report) or the "
                           "comparison page (two reports) to OUT")
  parser.add_argument("--json", metavar="OUT", default=None,
                      help="write the comparison of two reports as JSON to OUT")
  args = parser.parse_args(argv)
  if len(args.reports) > 2:
    parser.error("give one report to summarise or two to compare")
  if args.json and len(args.reports) != 2:
    parser.error("--json writes a comparison: give two reports")
  try:
    loaded = [load_report(path) for path in args.reports]
  except (OSError, ValueError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 1
  if args.html:
    try:
      if len(loaded) == 1:
        html_lib.write_page(html_lib.report_html(loaded[0]), args.html)
      else:
        html_lib.write_comparison_html(*loaded, args.html)
    except (ImportError, OSError) as error:
      print(f"error: {error}", file=sys.stderr)
      return 1
    print(f"wrote {args.html}")
    return 0
  if args.json:
    try:
      with open(args.json, "w", encoding="utf-8") as f:
        json.dump(comparison_to_dict(*loaded), f, indent=1)
    except OSError as error:
      print(f"error: {error}", file=sys.stderr)
      return 1
    print(f"wrote {args.json}")
    return 0
  if len(loaded) == 1:
    text = loaded[0].summary(**({"top": args.top} if args.top else {}))
  else:
    text = compare_reports(*loaded, **({"top": args.top} if args.top else {}))
  sys.stdout.write(text)
  return 0
