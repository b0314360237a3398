"""What the split search answers: the chosen split, its rivals, or why none fits.

:class:`SearchResult` holds the chosen candidate's :class:`Estimate` (its
``.config`` is the dict a user pastes into the BERT runner's flags), the top
candidates (:meth:`SearchResult.table`), the search's counts and time
(:meth:`SearchResult.to_json`'s ``"search"``), and a plot of per-IPU cycles
and memory beside a baseline split (:meth:`SearchResult.plot`). When no
candidate fits, ``.fits`` is False and :class:`Shortfall` names the candidate
closest to fitting, its IPU and the bytes a tile lacks.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Callable, Optional

from ipu_jax.pipelining.candidates import Candidate

if TYPE_CHECKING:  # the annotation only: the search imports the pipeline where it lowers
  from ipu_jax.pipelining.pipeline import Pipeline

__all__ = ["Estimate", "LoweredSplit", "SearchResult", "Shortfall"]


@dataclasses.dataclass
class Estimate:
  """A candidate's composed estimate, and its lowered figures once confirmed.

  Attributes:
    candidate: the split.
    step_cycles: one step (G micro-batches, updates included), composed.
    samples_per_second: :func:`ipu_jax.pipelining.split_search.score` of the step.
    ipu_peak_bytes: each IPU's peak bytes on its fullest tile.
    ipu_busy_cycles: each IPU's busy cycles in the step.
    bottleneck_ipu, bottleneck_stages: the busiest IPU and its stages.
    bytes_per_tile: a tile's memory.
    lowered_step_cycles, lowered_peak_bytes, lowered_samples_per_second: the
      same figures from lowering the full pipeline (None until confirmed).
  """

  candidate: Candidate
  step_cycles: float
  samples_per_second: float
  ipu_peak_bytes: list
  ipu_busy_cycles: list
  bottleneck_ipu: int
  bottleneck_stages: list
  bytes_per_tile: int
  lowered_step_cycles: Optional[float] = None
  lowered_peak_bytes: Optional[list] = None
  lowered_samples_per_second: Optional[float] = None
  lowered_busy_cycles: Optional[list] = None

  @property
  def config(self) -> dict:
    return self.candidate.config

  @property
  def lowered_fits(self) -> Optional[bool]:
    if self.lowered_peak_bytes is None:
      return None
    return max(self.lowered_peak_bytes) <= self.bytes_per_tile

  @property
  def step_error(self) -> Optional[float]:
    """``|estimate - lowered| / lowered`` of the step cycles."""
    if self.lowered_step_cycles is None:
      return None
    return abs(self.step_cycles - self.lowered_step_cycles) / self.lowered_step_cycles

  def row(self) -> dict:
    out = {**self.config, "samples_per_second": self.samples_per_second,
           "step_cycles": self.step_cycles, "ipu_peak_bytes": list(self.ipu_peak_bytes),
           "ipu_busy_cycles": list(self.ipu_busy_cycles),
           "bottleneck_ipu": self.bottleneck_ipu, "bottleneck_stages": self.bottleneck_stages}
    if self.lowered_step_cycles is not None:
      out.update(lowered_step_cycles=self.lowered_step_cycles,
                 lowered_peak_bytes=list(self.lowered_peak_bytes),
                 lowered_samples_per_second=self.lowered_samples_per_second,
                 lowered_fits=self.lowered_fits)
    return out


@dataclasses.dataclass
class Shortfall:
  """Why nothing fits: the candidate closest to fitting and its worst IPU.

  Attributes:
    candidate: that candidate (its proportions: each IPU's least-over one).
    ipu: the IPU short of memory.
    tile: its fullest tile.
    bytes_over: what that tile needs beyond ``bytes_per_tile``.
    bytes_per_tile: a tile's memory.
  """

  candidate: Candidate
  ipu: int
  tile: int
  bytes_over: int
  bytes_per_tile: int

  def message(self) -> str:
    c = self.candidate
    return (f"No split fits: the closest, layers_per_ipu {list(c.layers_per_ipu)} with "
            f"available_memory_proportion {list(c.proportions)}, recomputation "
            f"{c.recomputation}, serialization_factor {c.serialization}, is "
            f"{self.bytes_over:,d} bytes short on IPU {self.ipu} (tile {self.tile} needs "
            f"{self.bytes_per_tile + self.bytes_over:,d} of {self.bytes_per_tile:,d} bytes). "
            "What may help: more IPUs, more tiles, recomputation, a larger serialisation "
            "factor or a smaller micro-batch.")


@dataclasses.dataclass
class LoweredSplit:
  """The chosen split as the search lowered it to confirm it.

  Attributes:
    pipeline: the lowered :class:`~ipu_jax.pipelining.Pipeline` (its report,
      timeline and stage programs), built from the search's model, config
      (with the split's proportions and recomputation, out-of-memory allowed)
      and optimizer.
    seconds: how long lowering it took.
  """

  pipeline: "Pipeline"
  seconds: float


@dataclasses.dataclass
class SearchResult:
  """The answer of :func:`ipu_jax.pipelining.search`.

  Attributes:
    chosen: the chosen split's :class:`Estimate` (None when nothing fits).
    top: the best estimates, fastest first (the confirmed ones lowered).
    shortfall: why nothing fits (None when something does).
    baseline: the user's split estimated under the same model, when given.
    confirmed: whether ``chosen`` was lowered, fits and matched its estimate.
    counts: ``space`` (candidates in the space), ``scored`` (candidates
      whose fit was composed), ``simulated`` (timelines laid out),
      ``lowered`` (pipelines lowered: probes and confirmations), ``probes``,
      ``confirmed``; and the seconds of each phase: ``probe_seconds``,
      ``rank_seconds`` (composing and laying out candidates),
      ``confirm_seconds`` (confirming, and estimating the baseline).
    seconds: the search's wall time.
    lowered: the chosen split's :class:`LoweredSplit` when the search lowered
      it (None otherwise): a caller estimating that split with the same model,
      config and optimizer reads it instead of lowering it again. The result
      holds it, and its memory, while the result is held.
  """

  chosen: Optional[Estimate]
  top: list
  shortfall: Optional[Shortfall]
  baseline: Optional[Estimate]
  confirmed: bool
  counts: dict
  seconds: float
  estimator: Optional[Callable] = dataclasses.field(default=None, repr=False)
  lowered: Optional[LoweredSplit] = dataclasses.field(default=None, repr=False)

  @property
  def fits(self) -> bool:
    return self.chosen is not None

  @property
  def config(self) -> Optional[dict]:
    """The chosen split as the runner's keys, or None when nothing fits."""
    return None if self.chosen is None else self.chosen.config

  def message(self) -> str:
    if self.chosen is None:
      return self.shortfall.message()
    e = self.chosen
    state = "confirmed by lowering" if self.confirmed else "NOT confirmed by lowering"
    return (f"Chosen split {e.config} ({state}): {e.samples_per_second:,.1f} samples/s "
            f"estimated; searched {self.counts['space']:,d} candidates "
            f"({self.counts['simulated']:,d} timelines, {self.counts['lowered']} pipelines "
            f"lowered) in {self.seconds:.1f} s.")

  def table(self) -> str:
    """The top candidates (and the baseline): throughput, per-IPU peak, bottleneck."""
    head = (f"{'':2}{'layers_per_ipu':<18}{'proportions':<26}{'rc':<4}{'ser':<5}"
            f"{'samples/s':>11}  {'peak KiB per IPU (of %d)' % (self._limit() // 1024):<32}"
            f"{'bottleneck':<12}{'lowered':<10}")
    lines = [head]
    rows = [("*" if e is self.chosen else " ", e) for e in self.top]
    if self.baseline is not None:
      rows.append(("B", self.baseline))
    for mark, e in rows:
      c = e.candidate
      lowered = ("-" if e.lowered_step_cycles is None else
                 f"{'fits' if e.lowered_fits else 'OOM'} {100 * e.step_error:.1f}%")
      peaks = ",".join(f"{b / 1024:.0f}" for b in e.ipu_peak_bytes)
      lines.append(
          f"{mark:2}{str(list(c.layers_per_ipu)):<18}"
          f"{str([round(p, 3) for p in c.proportions]):<26}{'on' if c.recomputation else 'off':<4}"
          f"{c.serialization:<5}{e.samples_per_second:>11.1f}  {peaks:<32}"
          f"{'IPU %d' % e.bottleneck_ipu:<12}{lowered:<10}")
    if self.chosen is None:
      lines.append(self.shortfall.message())
    return "\n".join(lines)

  def _limit(self) -> int:
    for e in self.top + [self.baseline]:
      if e is not None:
        return e.bytes_per_tile
    return self.shortfall.bytes_per_tile

  def to_json(self) -> dict:
    """``{"split": config or None, "search": {...}, "top": [...], ...}``."""
    search = {"scored": self.counts["scored"], "lowered": self.counts["lowered"],
              "confirmed": self.counts["confirmed"], "seconds": self.seconds,
              **{k: v for k, v in self.counts.items()
                 if k not in ("scored", "lowered", "confirmed")}}
    out = {"split": self.config, "search": search, "fits": self.fits,
           "confirmed": self.confirmed, "top": [e.row() for e in self.top]}
    if self.chosen is not None:
      out["estimate"] = self.chosen.row()
    if self.baseline is not None:
      out["baseline"] = self.baseline.row()
    if self.shortfall is not None:
      s = self.shortfall
      out["shortfall"] = {"message": s.message(), "ipu": s.ipu, "tile": s.tile,
                          "bytes_over": s.bytes_over, "split": s.candidate.config}
    json.dumps(out)  # fail here, not in the caller's writer, on a stray type
    return out

  def estimate(self, config: dict) -> Estimate:
    """A split given as the runner's keys, estimated under the same model."""
    return self.estimator(config)

  def plot(self, path: str, baseline=None) -> str:
    """PNG of per-IPU busy cycles and peak memory: chosen split beside ``baseline``.

    ``baseline``: a config dict (the runner's keys) or an :class:`Estimate`;
    default the search's own baseline, if any.
    """
    from ipu_jax.pipelining.search_plot import plot_splits
    if baseline is None:
      baseline = self.baseline
    elif isinstance(baseline, dict):
      baseline = self.estimate(baseline)
    if self.chosen is None:
      raise ValueError(f"Nothing to plot: {self.shortfall.message()}")
    return plot_splits(path, self.chosen, baseline)
