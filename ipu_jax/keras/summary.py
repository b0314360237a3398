"""The text of ``Model.summary()``: a table of variables, then the IPU settings."""

from __future__ import annotations

import jax
import numpy as np

from ipu_jax.keras.adapters import flatten_paths

__all__ = ["summary_text"]


def _rows(tree) -> list:
  return [(path, "x".join(map(str, np.shape(v))) or "scalar", str(v.dtype), np.size(v))
          for path, v in flatten_paths(tree)]


def summary_text(title: str, params, state, *, config=None, replicas: int = 1,
                 accumulation_steps: int = 1, accumulation_reduction: str = "sum",
                 steps_per_execution: int = 1, report=None,
                 replica_reduction: str = "sum") -> str:
  """The summary table.

  Args:
    title: the first line, e.g. ``'Model: "mlp" (nnx)'``.
    params, state: trainable and non-trainable variables.
    config: the ``IPUConfig`` (its target is described), or ``None``.
    replicas, accumulation_steps, accumulation_reduction, steps_per_execution:
      the run's settings, shown with the target.
    replica_reduction: how gradients are combined over replicas (said when
      there are several: summed gradients are R times the mean).
    report: the last program's report (cycles, peak memory), or ``None``.
  """
  rows, state_rows = _rows(params), _rows(state)
  header = ("Variable", "Shape", "Dtype", "Params")
  widths = [max([len(header[i])] + [len(str(r[i])) for r in rows + state_rows])
            for i in range(4)]

  def line(r):
    return "  ".join(str(c).ljust(w) if i < 3 else f"{c:,}".rjust(w)
                     for i, (c, w) in enumerate(zip(r, widths)))

  total = sum(r[3] for r in rows)
  nbytes = sum(np.size(v) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(params))
  lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths)),
           "-" * (sum(widths) + 6)]
  lines += [line(r) for r in rows]
  if state_rows:
    lines.append("Non-trainable:")
    lines += [line(r) for r in state_rows]
  lines += ["-" * (sum(widths) + 6),
            f"Trainable params: {total:,} ({nbytes:,} B)",
            f"Non-trainable params: {sum(r[3] for r in state_rows):,}"]
  if config is not None:
    target = config.to_target()
    lines += [
        f"IPU target: {target.name}, {target.num_ipus} IPU(s) x "
        f"{target.tiles_per_ipu:,} tiles per replica",
        f"Replicas: {replicas}"
        + (f" (gradients {'summed' if replica_reduction == 'sum' else 'averaged'} over "
           f"them: training.replica_reduction = {replica_reduction!r})" if replicas > 1 else "")
        + ", gradient accumulation: "
        f"{accumulation_steps} ({accumulation_reduction}), "
        f"steps per execution: {steps_per_execution}"]
  if report is not None:
    lines.append(f"Last execution: {report.total_cycles:,.0f} cycles "
                 f"({report.estimated_seconds * 1e3:.3f} ms emulated), peak tile "
                 f"memory {int(np.max(report.memory_per_tile)):,} B")
  return "\n".join(lines)
