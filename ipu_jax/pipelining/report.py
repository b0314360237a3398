"""What a pipelined step costs: per-IPU memory, per-stage cycles, the timeline.

``PipelineReport`` reads a lowered :class:`~ipu_jax.pipelining.Pipeline`:
each IPU's peak (the largest program of its stages, beside what its other
stages hold, plus every stash its stages keep; :mod:`~ipu_jax.pipelining.layout`),
the cycles of each stage's forward, backward and update programs, what
crosses the IPU-Links per step, the step's ramp-up / steady state /
ramp-down and the pipeline efficiency (the fraction of the used IPUs' time
busy) and the step's throughput on the config's system with its breakdown
by part (``throughput``; :mod:`~ipu_jax.pipelining.throughput`). ``save(directory)`` writes ``pipeline.json``, a ``pipeline_trace.json``
(Chrome trace: one process per IPU the pipeline uses, one span per pass of
each micro-batch, named and tagged with its stage, so stages sharing an IPU
show on its track) and ``pipeline_schedule.png``; every stage program keeps
its own ``ipu_jax.Report`` (``stage_reports``).
"""

from __future__ import annotations

import json
import os

import numpy as np

from ipu_jax.pipelining import layout

__all__ = ["PipelineReport"]


class PipelineReport:
  """The report of a lowered pipeline (see the module docstring)."""

  def __init__(self, pipeline):
    self.schedule = pipeline.schedule
    self.accumulation = pipeline.accumulation
    self.replicas = pipeline.replicas
    self.recomputation = pipeline.config.pipelining.recomputation
    self.target = pipeline.target
    self.stages = pipeline.stages
    self.timeline = pipeline.timeline
    self.num_ipus = pipeline.config.auto_select_ipus
    #: The IPUs the pipeline uses (one trace track and schedule row each).
    self.ipus = sorted({s.ipu for s in self.stages})
    #: ``{ipu: layout.IPUMemory}``: each used IPU's memory and stages.
    self.ipu_memory = layout.ipu_memory(self.stages)
    from ipu_jax.pipelining.profile import pipeline_profile
    from ipu_jax.report import Report
    self.profile = pipeline_profile(pipeline)
    #: The step as an ``ipu_jax.Report`` (one step per slot): its summary,
    #: ``compare_reports``, HTML page and ``trace.json`` (one process per IPU).
    self.program_report = Report(self.profile)
    self._pipeline = pipeline
    #: Sequences packed in each sample (the packing factor) for :attr:`throughput`.
    self.sequences_per_sample = 1.0
    #: Micro-batches one execution of the device program runs for
    #: :attr:`throughput` (None: one step an execution).
    self.steps_per_execution = None
    self._throughput = {}

  def throughput_for(self, samples_per_micro_batch=None, sequences_per_sample=None,
                     steps_per_execution=None):
    """The step's :class:`~ipu_jax.pipelining.throughput.Throughput` on the
    config's system (see :func:`~ipu_jax.pipelining.throughput.step_throughput`)."""
    from ipu_jax.pipelining.throughput import step_throughput
    packing = self.sequences_per_sample if sequences_per_sample is None else sequences_per_sample
    per_run = self.steps_per_execution if steps_per_execution is None else steps_per_execution
    key = (samples_per_micro_batch, packing, per_run)
    if key not in self._throughput:
      self._throughput[key] = step_throughput(self._pipeline, samples_per_micro_batch, packing,
                                              steps_per_execution=per_run)
    return self._throughput[key]

  def forward_throughput(self, samples_per_micro_batch=None, sequences_per_sample=None,
                         steps_per_execution=None):
    """A forward-only run of the step's micro-batches (evaluation, inference;
    :func:`~ipu_jax.pipelining.forward_throughput.forward_throughput`)."""
    from ipu_jax.pipelining.forward_throughput import forward_throughput
    packing = self.sequences_per_sample if sequences_per_sample is None else sequences_per_sample
    per_run = self.steps_per_execution if steps_per_execution is None else steps_per_execution
    return forward_throughput(self._pipeline, samples_per_micro_batch, packing,
                              steps_per_execution=per_run)

  @property
  def throughput(self):
    """Samples and sequences per second of a step on the system, with the
    step's breakdown by part (:mod:`~ipu_jax.pipelining.throughput`)."""
    return self.throughput_for()

  @property
  def stage_reports(self) -> dict:
    """``{"stage0/forward": Report, ...}`` for every stage program."""
    out = {}
    for s in self.stages:
      for kind in ("forward", "backward", "update"):
        program = getattr(s, kind)
        if program is not None:
          out[f"stage{s.index}/{kind}"] = program.report
    return out

  @property
  def efficiency(self) -> float:
    """Fraction of the pipeline's IPU time spent running passes and updates."""
    return self.timeline.efficiency

  @property
  def total_cycles(self) -> float:
    return self.timeline.total_cycles

  def memory_per_ipu(self) -> dict:
    """Used IPU -> its stages, the peak bytes of its busiest tile, its total
    peak, its stash (all its stages') and each stage's stash depth."""
    out = {}
    for ipu, memory in self.ipu_memory.items():
      peak = memory.peak
      out[ipu] = {"stages": memory.stage_indices, "max_tile_bytes": int(peak.max()),
                  "total_bytes": int(peak.sum()), "stash_bytes": int(memory.stash.sum()),
                  "stash_depths": [s.stash_depth for s in memory.stages]}
    return out

  def memory_per_tile(self) -> np.ndarray:
    """``[pipeline IPUs x tiles_per_ipu]`` peak bytes, tiles numbered IPU-major."""
    t = self.target.tiles_per_ipu
    out = np.zeros(self.num_ipus * t, np.int64)
    for ipu, memory in self.ipu_memory.items():
      out[ipu * t:(ipu + 1) * t] = memory.peak
    return out

  def to_dict(self) -> dict:
    tl = self.timeline
    return {
        "schedule": self.schedule, "gradient_accumulation_steps": self.accumulation,
        "replication_factor": self.replicas, "recomputation": self.recomputation,
        "ipus": self.num_ipus * self.replicas, "total_cycles": tl.total_cycles,
        "seconds": self.target.cycles_to_seconds(tl.total_cycles),
        "efficiency": self.efficiency, "rate_efficiency": tl.rate_efficiency,
        "ramp_up_cycles": tl.ramp_up_cycles,
        "steady_cycles": tl.steady_cycles, "ramp_down_cycles": tl.ramp_down_cycles,
        "steady_slot_cycles": tl.steady_slot_cycles,
        "ipu_link_bytes_per_step": tl.link_bytes,
        "recompute_cycles_per_micro_batch": float(sum(s.recompute_cycles for s in self.stages)),
        "busy_cycles_per_ipu": [float(b) for b in tl.busy_cycles],
        "ipus_used": list(self.ipus),
        "memory_per_ipu": {str(ipu): m for ipu, m in self.memory_per_ipu().items()},
        "throughput": self.throughput.to_dict(),
        "stages": [{"stage": s.index, "ipu": s.ipu,
                    "forward_cycles": s.forward.profile.total_cycles,
                    "backward_cycles": s.backward.profile.total_cycles,
                    "recompute_cycles": s.recompute_cycles,
                    "update_cycles": s.update.profile.total_cycles if s.update else 0.0,
                    "send_bytes": s.send_bytes, "gradient_bytes": s.gradient_bytes,
                    "weight_bytes": s.weight_bytes, "stash_depth": s.stash_depth,
                    "stash_bytes_per_micro_batch": int(s.stash_bytes.sum()),
                    "peak_max_tile_bytes": int(s.peak_bytes.max()),
                    "peak_total_bytes": int(s.peak_bytes.sum())} for s in self.stages],
    }

  def summary(self) -> str:
    d = self.to_dict()
    lines = [
        f"Pipeline: {len(self.stages)} stages, {self.schedule} schedule, G={self.accumulation}, "
        f"{self.replicas} replica(s) = {d['ipus']} IPUs, recomputation "
        f"{'on' if self.recomputation else 'off'}",
        f"  step: {d['total_cycles']:,.0f} cycles ({d['seconds'] * 1e3:.3f} ms); ramp-up "
        f"{d['ramp_up_cycles']:,.0f}, steady {d['steady_cycles']:,.0f}, ramp-down "
        f"{d['ramp_down_cycles']:,.0f}",
        f"  pipeline efficiency: {100 * self.efficiency:.1f} % of IPU time busy; micro-batch "
        f"rate {100 * d['rate_efficiency']:.1f} % of the steady state's",
        f"  over IPU-Links per step: {d['ipu_link_bytes_per_step']:,d} B",
        *self.throughput.summary_lines(),
        f"  recomputation in backward passes: {d['recompute_cycles_per_micro_batch']:,.0f} "
        "cycles per micro-batch (all stages)",
        "  stage  IPU   forward  backward (recompute)    update  stash(depth x B)  peak tile B"
        "   IPU total B",
    ]
    for s in d["stages"]:
      lines.append(
          f"  {s['stage']:>5d} {s['ipu']:>4d} {s['forward_cycles']:>9,.0f} "
          f"{s['backward_cycles']:>9,.0f} ({s['recompute_cycles']:>9,.0f}) "
          f"{s['update_cycles']:>9,.0f} "
          f"{s['stash_depth']:>5d} x {s['stash_bytes_per_micro_batch']:>9,d} "
          f"{s['peak_max_tile_bytes']:>12,d} {s['peak_total_bytes']:>13,d}")
    lines.append("    IPU  stages          peak tile B   IPU total B       stash B")
    for ipu, m in self.memory_per_ipu().items():
      stages = ", ".join(map(str, m["stages"]))
      lines.append(f"  {ipu:>5d}  {stages:<14s} {m['max_tile_bytes']:>12,d} "
                   f"{m['total_bytes']:>13,d} {m['stash_bytes']:>13,d}")
    from ipu_jax.pipelining.weight_update import summary_lines
    return "\n".join(lines + summary_lines(self))

  def trace_events(self) -> list:
    """Chrome trace events: process = used IPU, one span per pass / copy / update.

    Spans of a stage are named and tagged with it (``"stage 4 F0"``), so the
    stages sharing an IPU show on that IPU's one track.
    """
    us = 1e6 / self.target.clock_hz
    events = []
    for ipu in self.ipus:
      stages = ", ".join(map(str, self.ipu_memory[ipu].stage_indices))
      events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": ipu, "tid": 0,
                     "args": {"name": f"IPU {ipu} (stage{'s' * (',' in stages)} {stages})"}})
    for span in self.timeline.spans:
      ipu, name, kind, mb, start, cycles = span[:6]
      stage = span[6] if len(span) > 6 else None
      events.append({"name": name if stage is None else f"stage {stage} {name}", "cat": kind,
                     "ph": "X", "ts": start * us, "dur": cycles * us, "pid": int(ipu),
                     "tid": 0, "args": {"stage": stage, "micro_batch": mb, "cycles": cycles}})
    return events

  def plot(self, path: str) -> str:
    """Draw the schedule (one row per IPU) as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    colours = {"forward": "#4c72b0", "backward": "#dd8452", "copy": "#999999",
               "sync": "#dddddd", "all-reduce": "#8172b3", "weight update": "#55a868"}
    row = {ipu: r for r, ipu in enumerate(self.ipus)}  # one row per used IPU
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.6 * len(row)))
    for span in self.timeline.spans:
      ipu, name, kind, mb, start, cycles = span[:6]
      ax.broken_barh([(start, cycles)], (row[ipu] - 0.4, 0.8), facecolors=colours[kind])
      if kind in ("forward", "backward") and cycles > 0.02 * self.total_cycles:
        label = f"{span[6]}:{name}" if len(span) > 6 else name
        ax.text(start + cycles / 2, row[ipu], label, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(row)), [f"IPU {i}" for i in self.ipus])
    ax.invert_yaxis()
    ax.set_xlabel("cycles")
    ax.set_title(f"{self.schedule} pipeline, G={self.accumulation}: "
                 f"{100 * self.efficiency:.1f} % busy")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper center", bbox_to_anchor=(0.5, -0.3),
              fontsize=7, ncol=len(colours), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

  def save(self, directory: str, plots: bool = True) -> str:
    """Write pipeline.json, pipeline_trace.json, pipeline_schedule.png and,
    from :attr:`program_report`, report.json, trace.json and report.html."""
    os.makedirs(directory, exist_ok=True)
    self.program_report.save(directory, plots=plots)
    with open(os.path.join(directory, "pipeline.json"), "w") as f:
      json.dump(self.to_dict(), f, indent=1)
    with open(os.path.join(directory, "pipeline_trace.json"), "w") as f:
      json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ns"}, f)
    if plots:
      try:
        self.plot(os.path.join(directory, "pipeline_schedule.png"))
      except ImportError:  # matplotlib is the optional "plots" extra
        pass
    return directory
