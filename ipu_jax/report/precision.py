"""The number-format section of a report: loss scaling and FP8 per-tensor scales.

Whether a model still trains in fp16 or FP8 shows in numbers that change
from step to step, which the tile program's static profile cannot know:

* **loss scaling** (:class:`~ipu_jax.keras.LossScaleOptimizer`): the scale
  after each recorded step, and the skipped steps and overflows so far;
* **FP8 per-tensor scaling** (FP8-AMAX, :mod:`ipu_jax.fp8_scaling`): each
  tensor's log2 scale and amax per step, by kind (weights and activations
  in F143, gradients in F152), the data behind the scale-distribution
  figures of Perez et al. 2023, for the user's own model.

:class:`NumberFormatTelemetry` records them (``Model.fit`` does for its
loss scale; a user loop calls :meth:`~ipu_jax.report.Report.add_number_format_telemetry`)
and the report shows them: ``report.json["number_formats"]``, the summary's
"Number formats" section, ``number_formats.png`` and a section of
``report.html``. ``report.json`` entry (null when nothing was recorded)::

    "number_formats": {
      "loss_scaling": null | {
        "steps": [int],          # optimizer steps at each record
        "scale": [float],        # the loss scale after that step
        "skipped_steps": [int],  # skipped updates so far (non-finite gradients)
        "overflows": [int]       # steps whose gradients overflowed, so far
      },
      "fp8_tensors": [{
        "name": str,             # layer path + "/input" | "/kernel" | "/grad"
        "kind": "weights" | "activations" | "gradients",
        "format": "F143" | "F152",
        "steps": [int], "log2_scale": [int], "amax": [float]
      }]
    }
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ipu_jax.report.formatting import fmt_int, text_table

__all__ = ["NumberFormatTelemetry", "FP8TensorHistory", "LossScaleHistory", "FP8_KINDS",
           "NUMBER_FORMATS_PLOT_FILE", "number_formats_figure", "number_formats_section",
           "number_formats_comparison", "number_formats_comparison_rows"]

NUMBER_FORMATS_PLOT_FILE = "number_formats.png"

# The tensor kinds of the paper's figures, in their order, with the format
# each is cast to and the telemetry fields of an FP8 layer holding it.
FP8_KINDS = ("weights", "activations", "gradients")
_LAYER_FIELDS = (  # (suffix, kind, format, amax history field, scale field)
    ("kernel", "weights", "F143", "weight_amax", "weight_scale"),
    ("input", "activations", "F143", "input_amax", "input_scale"),
    ("grad", "gradients", "F152", "grad_amax", "grad_scale"),
)


@dataclasses.dataclass
class LossScaleHistory:
  """The loss scale, skipped steps and overflows at each recorded step."""

  steps: list = dataclasses.field(default_factory=list)
  scale: list = dataclasses.field(default_factory=list)
  skipped_steps: list = dataclasses.field(default_factory=list)
  overflows: list = dataclasses.field(default_factory=list)

  def __len__(self) -> int:
    return len(self.steps)


@dataclasses.dataclass
class FP8TensorHistory:
  """One FP8-cast tensor's log2 scale and amax at each recorded step."""

  name: str
  kind: str
  format: str
  steps: list = dataclasses.field(default_factory=list)
  log2_scale: list = dataclasses.field(default_factory=list)
  amax: list = dataclasses.field(default_factory=list)


def _check_step(step, last: Optional[int], what: str) -> int:
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
    raise ValueError(f"{what}: step must be an int >= 0, got {step!r}.")
  if last is not None and step <= last:
    raise ValueError(f"{what}: steps must increase; step {step} comes after step {last}. "
                     "Record each step once, in order.")
  return int(step)


class NumberFormatTelemetry:
  """Loss-scale and FP8-scale histories of a training run, for its report.

  Example (a user loop; ``Model.fit`` records its loss scale itself)::

    telemetry = NumberFormatTelemetry()
    for step in range(steps):
      params, opt_state, ... = train_step(...)
      telemetry.record(step, model=fp8_model, opt_state=opt_state)
    lowered.report.number_formats = telemetry   # or report.add_number_format_telemetry
  """

  def __init__(self):
    self.loss_scaling = LossScaleHistory()
    self.fp8: dict = {}   # name -> FP8TensorHistory, in first-recorded order

  @property
  def empty(self) -> bool:
    return not len(self.loss_scaling) and not self.fp8

  @property
  def last_step(self) -> Optional[int]:
    """The latest step recorded (None before the first record)."""
    last = [h.steps[-1] for h in (self.loss_scaling, *self.fp8.values()) if h.steps]
    return max(last) if last else None

  # -- recording ------------------------------------------------------------------

  def record(self, step: int, *, model=None, opt_state=None, fp8=None) -> None:
    """Records one step from whatever is given.

    Args:
      step: the optimizer step the values belong to (increasing).
      model: an NNX model holding :class:`~ipu_jax.fp8_scaling.FP8Linear`
        layers (read with :func:`~ipu_jax.fp8_scaling.collect_telemetry`).
      opt_state: a :class:`~ipu_jax.keras.LossScaleOptimizer` state (other
        optimizer states record nothing).
      fp8: already collected telemetry, ``collect_telemetry``'s dict.

    Raises:
      ValueError: a step that does not increase, or ``model`` and ``fp8``
        both given.
    """
    if model is not None and fp8 is not None:
      raise ValueError("NumberFormatTelemetry.record: pass model or fp8, not both.")
    if model is not None:
      from ipu_jax.fp8_scaling import collect_telemetry  # pylint: disable=g-import-not-at-top
      fp8 = collect_telemetry(model)
    if fp8:
      self.record_fp8(step, fp8)
    if opt_state is not None:
      from ipu_jax.keras.loss_scaling import scaling_logs  # pylint: disable=g-import-not-at-top
      logs = scaling_logs(opt_state)
      if logs:
        self.record_loss_scale(step, logs["loss_scale"], logs["skipped_steps"],
                               logs["overflows"])

  def record_loss_scale(self, step: int, scale: float, skipped_steps: int,
                        overflows: int) -> None:
    """Appends the loss scale and the counts so far after ``step``."""
    h = self.loss_scaling
    step = _check_step(step, h.steps[-1] if h.steps else None, "record_loss_scale")
    scale = float(scale)
    if not np.isfinite(scale) or scale <= 0:
      raise ValueError(f"record_loss_scale: the scale must be positive and finite, "
                       f"got {scale!r} at step {step}.")
    h.steps.append(step)
    h.scale.append(scale)
    h.skipped_steps.append(int(skipped_steps))
    h.overflows.append(int(overflows))

  def record_fp8(self, step: int, layers: dict) -> None:
    """Appends each FP8 layer's latest amax and scale per tensor kind.

    Args:
      step: the step (increasing per tensor).
      layers: ``{layer path: {"weight_amax", "weight_scale", "input_amax",
        "input_scale", ["grad_amax", "grad_scale"]}}`` as
        :func:`~ipu_jax.fp8_scaling.collect_telemetry` returns; amax fields
        are histories (newest last). A gradient whose amax history is all
        zero was never recorded (the gradient telemetry was not
        differentiated) and is left out.
    """
    for layer, fields in layers.items():
      for suffix, kind, fmt, amax_field, scale_field in _LAYER_FIELDS:
        if amax_field not in fields:
          continue
        amax_history = np.asarray(fields[amax_field], np.float64).ravel()
        if kind == "gradients" and not np.any(amax_history):
          continue
        name = f"{layer}/{suffix}"
        tensor = self.fp8.setdefault(name, FP8TensorHistory(name, kind, fmt))
        s = _check_step(step, tensor.steps[-1] if tensor.steps else None,
                        f"record_fp8 ({name})")
        tensor.steps.append(s)
        tensor.log2_scale.append(int(np.asarray(fields[scale_field])))
        tensor.amax.append(float(amax_history[-1]) if amax_history.size else 0.0)

  # -- views ------------------------------------------------------------------------

  def scales_by_kind(self) -> dict:
    """``{kind: [log2 scales of every tensor of that kind at every step]}``."""
    out = {kind: [] for kind in FP8_KINDS}
    for tensor in self.fp8.values():
      out.setdefault(tensor.kind, []).extend(tensor.log2_scale)
    return {k: v for k, v in out.items() if v}

  # -- report.json ------------------------------------------------------------------

  def to_json(self) -> Optional[dict]:
    """The ``report.json`` entry (None when nothing was recorded)."""
    if self.empty:
      return None
    h = self.loss_scaling
    return {
        "loss_scaling": dataclasses.asdict(h) if len(h) else None,
        "fp8_tensors": [dataclasses.asdict(t) for t in self.fp8.values()],
    }

  @classmethod
  def from_json(cls, document: Optional[dict]) -> "NumberFormatTelemetry":
    """Reads the ``report.json`` entry back (an empty recorder for None)."""
    telemetry = cls()
    if not document:
      return telemetry
    loss = document.get("loss_scaling")
    if loss:
      telemetry.loss_scaling = LossScaleHistory(
          list(map(int, loss["steps"])), list(map(float, loss["scale"])),
          list(map(int, loss["skipped_steps"])), list(map(int, loss["overflows"])))
    for row in document.get("fp8_tensors", []):
      telemetry.fp8[row["name"]] = FP8TensorHistory(
          row["name"], row["kind"], row["format"], list(map(int, row["steps"])),
          list(map(int, row["log2_scale"])), list(map(float, row["amax"])))
    return telemetry


# ----------------------------------------------------------------------------
# Summary.
# ----------------------------------------------------------------------------


def _fmt_scale(scale: float) -> str:
  log2 = np.log2(scale)
  return f"2^{int(log2)}" if log2 == int(log2) else f"{scale:,.4g}"


def number_formats_section(telemetry: Optional[NumberFormatTelemetry], top: int = 10) -> list:
  """Summary lines of the telemetry (``[]`` when there is none)."""
  if telemetry is None or telemetry.empty:
    return []
  lines = ["Number formats:"]
  h = telemetry.loss_scaling
  if len(h):
    scale = np.asarray(h.scale)
    lines += [
        f"  Loss scale:            {_fmt_scale(scale[0])} at step {h.steps[0]} -> "
        f"{_fmt_scale(scale[-1])} at step {h.steps[-1]} (min {_fmt_scale(scale.min())}, "
        f"max {_fmt_scale(scale.max())}, {len(h)} records)",
        f"  Skipped steps:         {fmt_int(h.skipped_steps[-1])} "
        f"(overflows: {fmt_int(h.overflows[-1])})",
    ]
  if telemetry.fp8:
    tensors = list(telemetry.fp8.values())
    steps = sorted({s for t in tensors for s in t.steps})
    lines.append(f"  FP8 per-tensor log2 scales ({len(tensors)} tensors, {len(steps)} steps "
                 f"recorded, {steps[0]}..{steps[-1]}):")
    rows = []
    for kind in FP8_KINDS:
      group = [t for t in tensors if t.kind == kind]
      if not group:
        continue
      scales = np.concatenate([np.asarray(t.log2_scale) for t in group])
      amax = np.concatenate([np.asarray(t.amax) for t in group])
      last = [t.log2_scale[-1] for t in group]
      rows.append([kind, group[0].format, str(len(group)), str(int(scales.min())),
                   f"{np.median(scales):g}", str(int(scales.max())), f"{np.median(last):g}",
                   f"{amax.min():.3g} .. {amax.max():.3g}"])
    lines += text_table(["Kind", "Format", "Tensors", "Min", "Median", "Max", "Last (median)",
                         "amax"], rows, indent="    ",
                        right=(False, False, True, True, True, True, True, False))
    moving = sorted(tensors, key=lambda t: -(max(t.log2_scale) - min(t.log2_scale)))[:top]
    lines.append(f"  Tensors whose scale moved most ({len(moving)} of {len(tensors)}):")
    lines += text_table(
        ["Tensor", "Kind", "First", "Last", "Min", "Max", "Last amax"],
        [[t.name, t.kind, str(t.log2_scale[0]), str(t.log2_scale[-1]), str(min(t.log2_scale)),
          str(max(t.log2_scale)), f"{t.amax[-1]:.3g}"] for t in moving],
        indent="    ", right=(False, False, True, True, True, True, True))
  return lines


# ----------------------------------------------------------------------------
# Two reports side by side (compare_reports, the comparison page).
# ----------------------------------------------------------------------------


def _loss_scaling_digest(telemetry) -> Optional[dict]:
  h = telemetry.loss_scaling if telemetry is not None else None
  if h is None or not len(h):
    return None
  return {"records": len(h), "first_step": h.steps[0], "last_step": h.steps[-1],
          "first_scale": h.scale[0], "last_scale": h.scale[-1],
          "min_scale": min(h.scale), "max_scale": max(h.scale),
          "skipped_steps": h.skipped_steps[-1], "overflows": h.overflows[-1]}


def _fp8_digest(telemetry, kind: str) -> Optional[dict]:
  group = [t for t in (telemetry.fp8.values() if telemetry is not None else ())
           if t.kind == kind]
  if not group:
    return None
  scales = np.concatenate([np.asarray(t.log2_scale) for t in group])
  amax = np.concatenate([np.asarray(t.amax) for t in group])
  return {"format": group[0].format, "tensors": len(group),
          "steps": len({s for t in group for s in t.steps}),
          "min_log2_scale": int(scales.min()), "median_log2_scale": float(np.median(scales)),
          "max_log2_scale": int(scales.max()),
          "last_log2_scale_median": float(np.median([t.log2_scale[-1] for t in group])),
          "max_amax": float(amax.max())}


def number_formats_comparison(a: Optional[NumberFormatTelemetry],
                              b: Optional[NumberFormatTelemetry]) -> Optional[dict]:
  """Two runs' number formats side by side (e.g. fp16 + loss scaling vs FP8).

  Args:
    a, b: the telemetry of reports A and B (None or empty: nothing recorded).

  Returns:
    None when neither has telemetry, else ``{"loss_scaling": {"a": digest |
    None, "b": ...}, "fp8": {kind: {"a": ..., "b": ...}}}`` (only the kinds
    either recorded). A loss-scaling digest holds ``records``,
    ``first_step``/``last_step``, ``first_scale``/``last_scale``,
    ``min_scale``/``max_scale``, ``skipped_steps`` and ``overflows`` (the
    counts at the last record); an FP8 digest holds ``format``,
    ``tensors``, ``steps``, the ``min``/``median``/``max_log2_scale`` over
    every tensor and step, ``last_log2_scale_median`` and ``max_amax``.
  """
  a = None if a is None or a.empty else a
  b = None if b is None or b.empty else b
  if a is None and b is None:
    return None
  fp8 = {}
  for kind in FP8_KINDS:
    pair = {"a": _fp8_digest(a, kind), "b": _fp8_digest(b, kind)}
    if pair["a"] or pair["b"]:
      fp8[kind] = pair
  return {"loss_scaling": {"a": _loss_scaling_digest(a), "b": _loss_scaling_digest(b)},
          "fp8": fp8}


def _scale_delta(a: float, b: float) -> str:
  """How many binades B's scale is above A's (loss scales are powers of two)."""
  steps = float(np.log2(b) - np.log2(a))
  return f"{steps:+g} binades" if steps else "0"


def _scale_ratio(a: float, b: float) -> str:
  return f"x{b / a:.4g}"


def _difference(a: float, b: float) -> str:
  return f"{b - a:+,.4g}"


def _fmt_log2(value: float) -> str:
  return f"{value:g}"


def _no_change_column(a: float, b: float) -> str:
  del a, b  # a difference of log2 scales is already relative
  return ""


def _percent(a: float, b: float) -> str:
  if a == b:
    return "0.0%"
  return "new" if a == 0 else f"{100.0 * (b - a) / abs(a):+.1f}%"


def number_formats_comparison_rows(comparison: Optional[dict]) -> list:
  """Rows ``[label, A, B, delta, change]`` of :func:`number_formats_comparison`.

  For :func:`~ipu_jax.report.compare_reports`' table; ``[]`` when neither
  report has telemetry. A side that recorded nothing shows ``-``.
  """
  if comparison is None:
    return []
  rows = [["Number formats", "", "", "", ""]]

  def row(label, a, b, fmt, delta=_difference, change=_percent):
    both = a is not None and b is not None
    rows.append(["  " + label, "-" if a is None else fmt(a), "-" if b is None else fmt(b),
                 delta(a, b) if both else "", change(a, b) if both else ""])


  def field(digest, key):
    return None if digest is None else digest[key]

  loss = comparison["loss_scaling"]
  if loss["a"] or loss["b"]:
    la, lb = loss["a"], loss["b"]
    for what in ("first", "last", "min", "max"):
      row(f"Loss scale, {what}", field(la, f"{what}_scale"), field(lb, f"{what}_scale"),
          _fmt_scale, _scale_delta, _scale_ratio)
    row("Loss scale records (steps)", field(la, "records"), field(lb, "records"), fmt_int)
    row("Skipped steps", field(la, "skipped_steps"), field(lb, "skipped_steps"), fmt_int)
    row("Overflows", field(la, "overflows"), field(lb, "overflows"), fmt_int)
  for kind, pair in comparison["fp8"].items():
    da, db = pair["a"], pair["b"]
    fmt = (da or db)["format"]
    row(f"FP8 {kind} ({fmt}) tensors", field(da, "tensors"), field(db, "tensors"), fmt_int)
    for what, key in (("median", "median_log2_scale"), ("min", "min_log2_scale"),
                      ("max", "max_log2_scale"), ("last (median)", "last_log2_scale_median")):
      # log2 scales: the difference is in binades; a percentage means nothing.
      row(f"FP8 {kind} log2 scale, {what}", field(da, key), field(db, key), _fmt_log2,
          _difference, _no_change_column)
    row(f"FP8 {kind} amax, max", field(da, "max_amax"), field(db, "max_amax"),
        lambda v: f"{v:.4g}")
  return rows


# ----------------------------------------------------------------------------
# number_formats.png
# ----------------------------------------------------------------------------


def number_formats_figure(telemetry: NumberFormatTelemetry, title: str, figure_class=None):
  """The FP8 scale distributions per kind and the loss scale over steps.

  One histogram panel per tensor kind (log2 scales of every tensor at every
  recorded step: Perez et al.'s figure for this model) and, with loss
  scaling, a panel of the scale (log axis) with the skipped steps marked.
  """
  if figure_class is None:
    from matplotlib.figure import Figure as figure_class  # pylint: disable=g-import-not-at-top
  by_kind = telemetry.scales_by_kind()
  has_loss = bool(len(telemetry.loss_scaling))
  panels = len(by_kind) + int(has_loss)
  fig = figure_class(figsize=(4.2 * max(panels, 1), 3.6), layout="constrained")
  axes = [fig.add_subplot(1, max(panels, 1), i + 1) for i in range(max(panels, 1))]
  if by_kind:
    everything = np.concatenate([np.asarray(v) for v in by_kind.values()])
    bins = np.arange(everything.min() - 0.5, everything.max() + 1.5)
  for ax, (kind, scales), colour in zip(axes, by_kind.items(),
                                         ("#1f77b4", "#ff7f0e", "#2ca02c")):
    fmt = next(t.format for t in telemetry.fp8.values() if t.kind == kind)
    ax.hist(scales, bins=bins, color=colour)
    ax.set_title(f"{kind} ({fmt})", fontsize=10)
    ax.set_xlabel("log2 scale")
    ax.set_ylabel("tensors x steps")
  if has_loss:
    h = telemetry.loss_scaling
    ax = axes[-1]
    ax.step(h.steps, h.scale, where="post", color="#9467bd", label="loss scale")
    skipped = np.flatnonzero(np.diff(np.r_[0, h.skipped_steps]) > 0)
    if skipped.size:
      ax.scatter(np.asarray(h.steps)[skipped], np.asarray(h.scale)[skipped], color="red",
                 marker="v", zorder=3, label=f"skipped ({h.skipped_steps[-1]} total)")
    ax.set_yscale("log", base=2)
    from matplotlib import ticker  # pylint: disable=g-import-not-at-top
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("dynamic loss scale", fontsize=10)
    ax.legend(fontsize=8)
  if not panels:
    axes[0].text(0.5, 0.5, "no number-format telemetry", ha="center", va="center")
  fig.suptitle(title, fontsize=11)
  return fig
