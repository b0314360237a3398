"""Number and table formatting shared by the text views of a report."""

from __future__ import annotations

from typing import Sequence

from ipu_jax.lowering.profile import MEMORY_CATEGORIES
from ipu_jax.kernels.target import IPUTarget

CATEGORY_LABELS = {
    "variables": "Variables",
    "constants": "Constants",
    "vertex_state": "Vertex state",
    "code": "Code",
    "temporaries": "Temporaries",
    "exchange_buffers": "Exchange buffers",
}

CATEGORY_COLOURS = {
    "variables": "#1f77b4",
    "constants": "#9467bd",
    "vertex_state": "#8c564b",
    "code": "#7f7f7f",
    "temporaries": "#ff7f0e",
    "exchange_buffers": "#2ca02c",
}


def fmt_bytes(n: float) -> str:
  n = int(n)
  for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= scale:
      return f"{n:,} B ({n / scale:.2f} {unit})"
  return f"{n:,} B"


def fmt_int(value: float) -> str:
  return f"{value:,.0f}"


def fmt_seconds(seconds: float) -> str:
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if abs(seconds) >= scale:
      return f"{seconds / scale:.3f} {unit}"
  return f"{seconds / 1e-9:.1f} ns"


def fmt_flops(flops: float) -> str:
  for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(flops) >= scale:
      return f"{flops / scale:.3f} {unit}"
  return f"{flops:.0f} "


def pct(part: float, whole: float) -> str:
  return f"{100.0 * part / whole:.1f}%" if whole else "0.0%"


def short_source(source: str, width: int = 48) -> str:
  """Keeps the end of long paths: the file name and line matter most."""
  if not source:
    return "?"
  if len(source) <= width:
    return source
  return "..." + source[-(width - 3):]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]],
           indent: str = "  ", right: Sequence[bool] = ()) -> list:
  """Lines of a plain-text table; ``right[i]`` right-aligns column i."""
  widths = [len(h) for h in header]
  for row in rows:
    widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
  aligned = list(right) + [False] * (len(header) - len(right))

  def line(cells):
    parts = [c.rjust(w) if r else c.ljust(w)
             for c, w, r in zip(cells, widths, aligned)]
    return (indent + "  ".join(parts)).rstrip()

  return [line(header), indent + "  ".join("-" * w for w in widths)] + [
      line(row) for row in rows]


def category_label(category: str) -> str:
  return CATEGORY_LABELS.get(category, category.replace("_", " ").capitalize())


def ordered_categories(categories: dict) -> list:
  known = [c for c in MEMORY_CATEGORIES if c in categories]
  return known + sorted(c for c in categories if c not in MEMORY_CATEGORIES)


def tile_name(tile: int, target: IPUTarget) -> str:
  if target.num_ipus == 1:
    return f"tile {tile}"
  return f"tile {tile} (IPU {target.ipu_of_tile(tile)})"

