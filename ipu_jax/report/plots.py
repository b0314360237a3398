"""The PNG plots of a report (matplotlib, optional).

* ``memory_per_tile.png``: stacked bytes per tile by category. The y axis
  scales to the data, so a program using 1 % of the SRAM is still readable;
  the SRAM limit is drawn when it is in range and always named in the
  annotation.
* ``cycles_heatmap.png``: compute cycles per tile and superstep, binned past
  400 steps / 512 tiles (steps summed, tiles take their busiest member).
* ``live_memory.png``: bytes live on the device over the program.

Every plot's title names the program and the target. Without matplotlib,
``PLOTS_MISSING.txt`` says how to get them.
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from ipu_jax.report.data import ReportData
from ipu_jax.report.formatting import CATEGORY_COLOURS
from ipu_jax.report.formatting import category_label
from ipu_jax.report.formatting import fmt_bytes
from ipu_jax.report.formatting import ordered_categories
from ipu_jax.kernels.target import IPUTarget

__all__ = ["write_plots", "memory_figure", "cycles_heatmap_figure",
           "live_memory_figure", "binned_cycles", "load_matplotlib",
           "MEMORY_PLOT_FILE", "HEATMAP_PLOT_FILE", "LIVE_PLOT_FILE",
           "PLOTS_MISSING_FILE"]

# The file names are the data model's (one name for one thing).
from ipu_jax.report.data import (HEATMAP_PLOT_FILE, LIVE_PLOT_FILE,  # noqa: E402
                                 MEMORY_PLOT_FILE, PLOTS_MISSING_FILE)

# Past these sizes the heatmap averages bins of steps / tiles, so a program
# of thousands of supersteps on 1,472 tiles still renders in well under a
# second and stays readable.
_MAX_HEATMAP_STEPS = 400
_MAX_HEATMAP_TILES = 512


def load_matplotlib():
  """matplotlib's Figure class, or None when matplotlib is not installed."""
  try:
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return Figure


def write_plots(data: ReportData, tile_cycles: Optional[np.ndarray],
                 directory: str) -> list:
  figure_class = load_matplotlib()
  if figure_class is None:
    path = os.path.join(directory, PLOTS_MISSING_FILE)
    with open(path, "w", encoding="utf-8") as f:
      f.write("The plots of this report (memory_per_tile.png, "
              "cycles_heatmap.png, live_memory.png) need matplotlib, which is "
              "not installed.\nInstall it with\n\n"
              "    pip install ipu-jax[plots]\n\nor\n\n"
              "    pip install matplotlib\n\nthen save the report again.\n")
    return [path]
  figures = [(MEMORY_PLOT_FILE, memory_figure(data, figure_class)),
             (LIVE_PLOT_FILE, live_memory_figure(data, figure_class))]
  if tile_cycles is not None:
    figures.insert(1, (HEATMAP_PLOT_FILE,
                       cycles_heatmap_figure(data, tile_cycles, figure_class)))
  written = []
  for file_name, figure in figures:
    path = os.path.join(directory, file_name)
    figure.savefig(path, dpi=100)
    written.append(path)
  return written


def _binary_axis(axis, top: float, unit: str, scale: int) -> None:
  """Ticks at round numbers of KiB / MiB, so SRAM sizes read naturally."""
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  raw = max(top / scale / 8, 1e-9)
  magnitude = 10 ** np.floor(np.log10(raw))
  step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
  axis.set_major_locator(ticker.MultipleLocator(step * scale))
  axis.set_major_formatter(
      ticker.FuncFormatter(lambda v, _: f"{v / scale:,.4g} {unit}"))


def _target_label(target: IPUTarget) -> str:
  ipus = f"{target.num_ipus} IPUs, " if target.num_ipus > 1 else ""
  return f"{target.name}, {ipus}{target.num_tiles:,} tiles"


def _mark_ipus(ax, target: IPUTarget, tiles_on_y: bool = False) -> None:
  """Dotted lines between the tiles of neighbouring IPUs."""
  draw = ax.axhline if tiles_on_y else ax.axvline
  for ipu in range(1, target.num_ipus):
    draw(ipu * target.tiles_per_ipu - 0.5, color="white" if tiles_on_y
         else "black", lw=0.8, ls=":")


def memory_figure(data: ReportData, figure_class=None):
  """Stacked bytes per tile by category, with the SRAM limit line.

  Args:
    data: the report data.
    figure_class: ``matplotlib.figure.Figure`` (loaded if None).

  Returns:
    The figure; its first axes holds the limit as a horizontal line.
  """
  figure_class = figure_class or load_matplotlib()
  fig = figure_class(figsize=(12, 5), layout="constrained")
  ax = fig.add_subplot()
  tiles = np.arange(data.peak.size)
  categories = ordered_categories(data.categories)
  layers = [data.categories[c] for c in categories]
  labels = [category_label(c) for c in categories]
  colours = [CATEGORY_COLOURS.get(c, None) for c in categories]
  if tiles.size <= 128:
    bottom = np.zeros(tiles.size)
    for layer, label, colour in zip(layers, labels, colours):
      ax.bar(tiles, layer, bottom=bottom, width=0.9, label=label, color=colour)
      bottom = bottom + layer
  elif layers:
    # Thousands of bars are slow to draw; step areas look the same.
    ax.stackplot(tiles, *layers, labels=labels, colors=colours, step="mid")
  limit = data.tile_limit
  highest = int(data.peak.max()) if data.peak.size else 0
  # The axis follows the data: a program using 1 % of the SRAM must not be
  # drawn as a flat line under a 624 KiB limit. The limit is drawn when it
  # is in range and always named.
  top = max(highest, 1) * 1.15
  if limit <= top:
    ax.axhline(limit, color="red", ls="--", lw=1.5,
               label=f"SRAM limit ({limit:,} B per tile)")
    ax.annotate(f"SRAM limit {limit / 1024:,.0f} KiB", xy=(1.0, limit),
                xycoords=("axes fraction", "data"), xytext=(-4, 3),
                textcoords="offset points", ha="right", va="bottom",
                color="red", fontsize=9)
  else:
    ax.annotate(f"SRAM limit {limit / 1024:,.0f} KiB per tile (off the "
                f"axis): the peak tile uses {100 * highest / limit:.1f}%",
                xy=(1.0, 1.0), xycoords="axes fraction", xytext=(-4, -4),
                textcoords="offset points", ha="right", va="top",
                color="red", fontsize=9)
  over = np.nonzero(data.peak > limit)[0]
  if over.size:
    ax.scatter(over, data.peak[over], marker="v", color="red", zorder=3,
               label=f"{over.size} tile(s) over the limit")
  _mark_ipus(ax, data.target)
  ax.set_xlim(-0.5, max(tiles.size, 1) - 0.5)
  ax.set_ylim(0, top)
  _binary_axis(ax.yaxis, top, "KiB", 1 << 10)
  ax.set_xlabel("tile")
  ax.set_ylabel("bytes at the tile's peak")
  ax.set_title(f"{data.name}: memory per tile ({_target_label(data.target)})")
  ax.legend(loc="upper left", fontsize=8, ncols=2)
  return fig


def _bin_edges(size: int, max_bins: int) -> np.ndarray:
  """Start indices of at most ``max_bins`` near-equal bins over ``size``."""
  bins = min(size, max_bins)
  return np.unique(np.linspace(0, size, bins, endpoint=False).astype(np.int64))


def binned_cycles(tile_cycles: np.ndarray, executions: np.ndarray):
  """Downsamples ``[steps, tiles]`` cycles x executions for drawing.

  Steps are summed in a bin (time spent in that stretch of the program) and
  tiles take their bin's busiest tile, so hot spots stay visible.

  Returns:
    (image [tiles_binned, steps_binned], step starts, tile starts).
  """
  weighted = tile_cycles * executions[:, None]
  step_starts = _bin_edges(weighted.shape[0], _MAX_HEATMAP_STEPS)
  tile_starts = _bin_edges(weighted.shape[1], _MAX_HEATMAP_TILES)
  binned = np.add.reduceat(weighted, step_starts, axis=0)
  binned = np.maximum.reduceat(binned, tile_starts, axis=1)
  return binned.T, step_starts, tile_starts


def cycles_heatmap_figure(data: ReportData, tile_cycles: np.ndarray,
                           figure_class=None):
  """Compute cycles per tile (rows) and superstep (columns)."""
  figure_class = figure_class or load_matplotlib()
  fig = figure_class(figsize=(12, 6), layout="constrained")
  ax = fig.add_subplot()
  steps, tiles = tile_cycles.shape
  if steps == 0 or tiles == 0:
    ax.text(0.5, 0.5, "no supersteps", ha="center", va="center")
    ax.set_title(f"{data.name}: compute cycles per tile and superstep "
                 f"({_target_label(data.target)})")
    return fig
  image, step_starts, tile_starts = binned_cycles(tile_cycles,
                                                   data.steps.executions)
  extent = (-0.5, steps - 0.5, -0.5, tiles - 0.5)
  shown = ax.imshow(image, aspect="auto", origin="lower", extent=extent,
                    interpolation="nearest", cmap="viridis")
  fig.colorbar(shown, ax=ax, label="compute cycles x executions")
  if steps <= 30:
    ax.set_xticks(np.arange(steps))
    ax.set_xticklabels([n or o for n, o in zip(data.steps.names,
                                               data.steps.ops)],
                       rotation=60, ha="right", fontsize=7)
  _mark_ipus(ax, data.target, tiles_on_y=True)
  binned = []
  if len(step_starts) < steps:
    binned.append(f"{len(step_starts)} bins of supersteps (summed)")
  if len(tile_starts) < tiles:
    binned.append(f"{len(tile_starts)} bins of tiles (busiest tile)")
  ax.set_xlabel("superstep" + (f" — {', '.join(binned)}" if binned else ""))
  ax.set_ylabel("tile")
  ax.set_title(f"{data.name}: compute cycles per tile and superstep "
               f"({_target_label(data.target)})")
  return fig


def live_memory_figure(data: ReportData, figure_class=None):
  """Bytes live on the device at each step of the program."""
  figure_class = figure_class or load_matplotlib()
  fig = figure_class(figsize=(12, 4), layout="constrained")
  ax = fig.add_subplot()
  live = data.live
  if live.size == 0:
    ax.text(0.5, 0.5, "no liveness information", ha="center", va="center")
    ax.set_title(f"{data.name}: live memory over the program "
                 f"({_target_label(data.target)})")
    return fig
  steps = np.arange(live.size)
  ax.step(steps, live, where="mid", color="#1f77b4")
  ax.fill_between(steps, live, step="mid", alpha=0.3, color="#1f77b4")
  peak_step = int(np.argmax(live))
  label = ""
  if peak_step < len(data.steps):
    label = f" at {data.steps.names[peak_step] or data.steps.ops[peak_step]}"
  ax.scatter([peak_step], [live[peak_step]], color="red", zorder=3,
             label=f"peak {fmt_bytes(live[peak_step])}{label}")
  top = live.max() * 1.15 if live.max() > 0 else 1
  ax.set_ylim(0, top)
  if top >= 1 << 20:
    _binary_axis(ax.yaxis, top, "MiB", 1 << 20)
  else:
    _binary_axis(ax.yaxis, top, "KiB", 1 << 10)
  from matplotlib import ticker  # pylint: disable=g-import-not-at-top
  ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
  ax.set_xlabel("superstep")
  ax.set_ylabel("bytes live on the device")
  ax.set_title(f"{data.name}: live memory over the program "
               f"({_target_label(data.target)})")
  ax.legend(loc="upper left", fontsize=8)
  return fig
