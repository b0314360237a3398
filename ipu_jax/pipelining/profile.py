"""A pipelined step as one ``ProgramProfile``, so the usual reports read it.

Each time slot of the schedule becomes one step across the pipeline's IPUs:
its sync is the cross-IPU sync, its exchange the slot's IPU-Link copies
(costed together: copies sharing a link share its rate), and
each tile's compute the cycles its IPU spends on the slot's passes (a stage
program's cycles, spread evenly over the IPU's tiles: the slot lasts as long
as the busiest IPU). The gradient all-reduce over replicas and the weight
updates close the step. Memory per tile is, on each IPU, the categories of
the stage program that peaks highest on that tile, plus the weights,
accumulators and on-chip optimizer state held beside it (the IPU's other
stages', and what of its own stage's it does not read: as ``variables``) and every stashed
activation set of its stages (category ``stashed_activations``;
:mod:`~ipu_jax.pipelining.layout`), so ``ipu_jax.Report``,
``compare_reports`` and the HTML page show a pipeline like any program.
Its dead code is what was removed from all its stage programs.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.lowering.dead_code import DeadCode
from ipu_jax.lowering.profile import (MEMORY_CATEGORIES, MemoryProfile, ProgramProfile,
                                      StepProfile, flops_by_dtype, majority_dtype)
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.pipelining import layout

__all__ = ["STASH_CATEGORY", "pipeline_profile"]

STASH_CATEGORY = "stashed_activations"


def _memory(pipeline, target: IPUTarget, num_steps: int) -> MemoryProfile:
  t = target.tiles_per_ipu
  cats = {c: np.zeros(target.num_tiles, np.int64) for c in MEMORY_CATEGORIES + (STASH_CATEGORY,)}
  cols = np.arange(t)
  for ipu, memory in layout.ipu_memory(pipeline.stages).items():
    chosen = memory.chosen
    window = slice(ipu * t, (ipu + 1) * t)
    for c in MEMORY_CATEGORIES:
      stack = np.stack([p.profile.memory.by_category[c] for _, _, p in memory.programs])
      cats[c][window] = stack[chosen, cols]
    # Held beside the chosen program: the other stages' weights and
    # accumulators, and the on-chip optimizer state it does not read.
    cats["variables"][window] += (memory.others_held[chosen, cols]
                                  + memory.optimizer_state[chosen, cols])
    cats[STASH_CATEGORY][window] = memory.stash
  peak = sum(cats.values())
  return MemoryProfile(by_category=cats, peak=peak,
                       live_over_program=np.full(num_steps, float(peak.sum())),
                       tile_limit=target.bytes_per_tile)


def _read_only(a: np.ndarray) -> np.ndarray:
  a.flags.writeable = False
  return a


class _PassTotals:
  """A stage pass's cycles, flops and IPU-Link bytes, read once per pass kind.

  A stage program's totals sum over its thousands of steps; a step of
  G micro-batches has ~2 G slots, each naming a few passes.
  """

  def __init__(self, pipeline):
    self.pipeline, self._table = pipeline, {}

  def __call__(self, stage: int, kind: str) -> tuple:
    key = (stage, kind)
    if key not in self._table:
      s = self.pipeline.stages[stage]
      program = s.forward if kind == "forward" else s.backward
      link_bytes = sum(nbytes for src, dst, nbytes in self.pipeline.copies(stage, kind)
                       if src != dst)
      self._table[key] = (program.profile.total_cycles, int(program.profile.total_flops),
                          link_bytes)
    return self._table[key]


def _slot_arrays(passes: _PassTotals, composition, stages, n: int, t: int) -> tuple:
  """``(compute, vertices, flops, link_bytes)`` of a slot running ``composition``."""
  compute = np.zeros(n)
  flops, link_bytes = 0, 0
  for stage, kind in composition:
    cycles, pass_flops, pass_link = passes(stage, kind)
    ipu = stages[stage].ipu
    compute[ipu * t:(ipu + 1) * t] += cycles
    flops += pass_flops
    link_bytes += pass_link
  vertices = _read_only((compute > 0).astype(np.int64))
  return _read_only(compute), vertices, flops, link_bytes


def _stages_flops_dtype(pipeline):
  """The dtype of most of the step's FLOPs: its stage programs' steps say theirs
  (forward and backward passes run once per micro-batch, updates once)."""
  totals = {}
  for stage in pipeline.stages:
    for program, runs in ((stage.forward, pipeline.accumulation),
                          (stage.backward, pipeline.accumulation), (stage.update, 1)):
      if program is None:
        continue
      for dtype, flops in flops_by_dtype(program.profile).items():
        totals[dtype] = totals.get(dtype, 0) + flops * runs
  return majority_dtype(totals)


def pipeline_profile(pipeline) -> ProgramProfile:
  """The :class:`ProgramProfile` of one step of a lowered pipeline."""
  stage_target = pipeline.target
  num_ipus = pipeline.config.auto_select_ipus
  target = stage_target.replace(num_ipus=num_ipus)
  t, n = stage_target.tiles_per_ipu, target.num_tiles
  stages = pipeline.stages
  steps = []
  spans_by_kind = {}
  for span in pipeline.timeline.spans:
    spans_by_kind.setdefault(span[2], []).append(span)
  sync = stage_target.ipu_sync_cycles(num_ipus)
  passes = _PassTotals(pipeline)
  slot_arrays = {}
  zeros = _read_only(np.zeros(n, np.int64))
  for index, slot in enumerate(pipeline._slots):
    # Slots of the steady state repeat a few pass compositions; each
    # composition's per-tile arrays are built once and shared read-only
    # (thousands of slots x every tile of the IPUs otherwise).
    composition = tuple((p.stage, p.kind) for p in slot)
    if composition not in slot_arrays:
      slot_arrays[composition] = _slot_arrays(passes, composition, stages, n, t)
    compute, vertices, flops, link_bytes = slot_arrays[composition]
    names = [f"{p.kind[0].upper()}{p.stage}.{p.micro_batch}" for p in slot]
    steps.append(StepProfile(
        name=f"slot {index}: " + " ".join(names), op="pipeline slot", source="",
        compute_cycles=compute, exchange_bytes_in=zeros, exchange_bytes_out=zeros,
        exchange_cycles=pipeline.timeline.copy_cycles_per_slot[index],
        sync_cycles=sync, ipu_link_bytes=link_bytes, flops=flops,
        vertices=vertices, temporary_bytes=zeros, scope=""))
  for kind in ("all-reduce", "weight update"):
    compute = np.zeros(n)
    flops = 0
    for span in spans_by_kind.get(kind, []):
      ipu, cycles = span[0], span[5]
      compute[ipu * t:(ipu + 1) * t] += cycles
    if kind == "weight update":
      flops = int(sum(s.update.profile.total_flops for s in stages if s.update))
    if compute.any():
      steps.append(StepProfile(
          name=kind, op=f"pipeline {kind}", source="", compute_cycles=compute,
          exchange_bytes_in=np.zeros(n, np.int64), exchange_bytes_out=np.zeros(n, np.int64),
          # Syncs of the all-reduce are in its cycles; the update needs none.
          exchange_cycles=0.0, sync_cycles=0.0, flops=flops,
          vertices=(compute > 0).astype(np.int64), temporary_bytes=np.zeros(n, np.int64)))
  return ProgramProfile(target=target, steps=steps, tensors=[],
                        memory=_memory(pipeline, target, len(steps)),
                        name=f"pipeline ({pipeline.schedule}, G={pipeline.accumulation})",
                        host_round_trips=1, flops_dtype=_stages_flops_dtype(pipeline),
                        dead_code=DeadCode.total(
                            program.dead_code for s in stages
                            for program in (s.forward, s.backward, s.update) if program))
