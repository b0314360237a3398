"""The split search's plot: per-IPU cycles and memory of two splits side by side."""

from __future__ import annotations

import numpy as np

__all__ = ["plot_splits"]


def plot_splits(path: str, chosen, baseline=None) -> str:
  """Write a PNG of each IPU's busy cycles and peak memory (per tile) to ``path``.

  Args:
    path: the PNG to write.
    chosen: the chosen split's :class:`~ipu_jax.pipelining.search_result.Estimate`.
    baseline: another split's estimate to draw beside it, or None.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  splits = [("chosen", chosen)] + ([("baseline", baseline)] if baseline is not None else [])
  splits = [(f"{name} {list(e.candidate.layers_per_ipu)} at "
             f"{[round(float(p), 3) for p in e.candidate.proportions]}", e)
            for name, e in splits]
  num_ipus = len(chosen.ipu_peak_bytes)
  x = np.arange(num_ipus)
  width = 0.8 / len(splits)
  fig, (cycles_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 4))
  for i, (label, e) in enumerate(splits):
    offset = (i - (len(splits) - 1) / 2) * width
    cycles_ax.bar(x + offset, np.asarray(e.ipu_busy_cycles[:num_ipus]) / 1e6, width,
                  label=f"{label}: {e.samples_per_second:,.0f} samples/s")
    memory_ax.bar(x + offset, np.asarray(e.ipu_peak_bytes) / 1024, width, label=label)
  memory_ax.axhline(chosen.bytes_per_tile / 1024, color="k", linestyle="--",
                    label="tile memory")
  for ax, ylabel in ((cycles_ax, "busy cycles in a step (millions)"),
                     (memory_ax, "peak KiB on the fullest tile")):
    ax.set_xticks(x, [f"IPU {i}" for i in x])
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=1)
  cycles_ax.set_title("Per-IPU cycles (estimate)")
  memory_ax.set_title("Per-IPU memory (estimate)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
