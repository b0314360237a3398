"""A forward-only execution of a lowered pipeline: evaluation or inference.

PopART runs a training pipeline's forward passes alone as
``implicitPipeliningFwdOnly`` (``SessionOptions.createImplicitPipeliningFwdOnlyProgram``),
the program Graphcore's MLPerf v2.0 BERT evaluated with between training
blocks; TF-IPU and PopTorch run inference pipelines the same way. Over ``G``
micro-batches and ``N`` stages it runs ``G + N - 1`` slots: in slot ``t``
stage ``k`` runs the forward pass of micro-batch ``t - k`` when there is
one, so the first and last ``N - 1`` slots (the fill and the drain) run
only some stages. No backward pass, recomputation, stash or weight update.

:func:`forward_throughput` prices it from the stages' lowered forward
programs, with the parts (seconds, ``Throughput.breakdown``):

* ``steady_state``, ``ramp``: each slot lasts as long as its busiest IPU's
  forward passes (stages sharing an IPU add), the slots where every stage
  runs and the fill and drain;
* ``inter_stage_copies``: every stage's forward copies in every slot, as
  PopART's pipeline cycle always runs all its copies (``PopPrograms::
  addPipelineCycle``; the training step's Grouped rule,
  :mod:`~ipu_jax.pipelining.throughput`);
* ``syncs``: the sync ending each slot, across all ``R x N`` IPUs;
* ``host_io``: the ``G`` micro-batches' inputs over the replica's host link;
* ``execution_overhead``: the host's time per execution
  (``IPUSystem.execution_overhead_seconds``) over the runs of ``G x R``
  micro-batches an execution holds.

Graphcore's MLPerf v2.0 evaluation runs give a measured forward slot to
hold this against (docs/published_bert.md#the-evaluation-gaps).
"""

from __future__ import annotations

from ipu_jax.pipelining import links
from ipu_jax.pipelining.throughput import (Throughput, assemble, host_parts, replica_bases,
                                          spans_pods, steps_per_run)

__all__ = ["FORWARD_PARTS", "forward_throughput"]

FORWARD_PARTS = ("steady_state", "ramp", "inter_stage_copies", "syncs", "host_io",
                 "execution_overhead")


def _busiest(pipeline, first: int, last: int, fwd: list) -> float:
  """Cycles of the busiest IPU when stages ``first..last`` run their forward."""
  work = {}
  for k in range(first, last + 1):
    ipu = pipeline.stages[k].ipu
    work[ipu] = work.get(ipu, 0.0) + fwd[k]
  return max(work.values())


def _slot_cycles(pipeline) -> tuple:
  """``(steady, ramp)`` compute cycles of the forward-only slots.

  Slot ``t`` runs stages ``max(0, t - G + 1) .. min(N - 1, t)``: all of them
  in the ``G - N + 1`` slots from ``N - 1`` to ``G - 1``, each priced once.
  """
  n, g = len(pipeline.stages), pipeline.accumulation
  fwd = [s.forward.profile.total_cycles for s in pipeline.stages]
  full = max(0, g - n + 1)
  steady = full * _busiest(pipeline, 0, n - 1, fwd) if full else 0.0
  ramp = sum(_busiest(pipeline, max(0, t - g + 1), min(n - 1, t), fwd)
             for t in range(g + n - 1) if not n - 1 <= t <= g - 1)
  return steady, ramp


def forward_throughput(pipeline, samples_per_micro_batch: int | None = None,
                       sequences_per_sample: float = 1.0,
                       steps_per_execution: int | None = None) -> Throughput:
  """What a forward-only run of the lowered pipeline's ``G x R`` micro-batches takes.

  Args:
    pipeline: a lowered :class:`~ipu_jax.pipelining.Pipeline` (its forward
      programs are the training step's: the same stages and layouts).
    samples_per_micro_batch: rows of a micro-batch; default the leading
      dimension of the micro-batch's first leaf.
    sequences_per_sample: sequences packed in each sample (>= 1).
    steps_per_execution: micro-batches (over all replicas) one execution
      runs, a multiple of ``G x R``; default ``G x R`` (one run of ``G``
      micro-batches a replica an execution).

  Returns:
    A :class:`~ipu_jax.pipelining.throughput.Throughput` whose
    ``step_seconds`` is one run of ``G`` micro-batches a replica, its
    ``breakdown`` over :data:`FORWARD_PARTS` and ``update_ipu`` -1 (no update).

  Raises:
    ValueError: ``sequences_per_sample`` below 1.
    PipelineError: ``steps_per_execution`` not a multiple of ``G x R``.
  """
  if not sequences_per_sample >= 1:
    raise ValueError(f"sequences_per_sample (the packing factor) must be >= 1; got "
                     f"{sequences_per_sample!r}.")
  target, system = pipeline.target, pipeline.target.system
  r, n, g = pipeline.replicas, pipeline.config.auto_select_ipus, pipeline.accumulation
  runs = steps_per_run(steps_per_execution, g, r)
  sync = target.ipu_sync_cycles(r * n)
  if system is not None and spans_pods(system, replica_bases(system, r, n), n):
    sync += 2 * system.gw_latency_seconds * target.clock_hz
  slots = g + len(pipeline.stages) - 1
  every = [c for k in range(len(pipeline.stages)) for c in pipeline.copies(k, "forward")]
  steady, ramp = _slot_cycles(pipeline)
  breakdown = {
      "steady_state": steady / target.clock_hz, "ramp": ramp / target.clock_hz,
      "inter_stage_copies": slots * links.slot_copy_cycles(target, every) / target.clock_hz,
      "syncs": slots * sync / target.clock_hz, **host_parts(pipeline, target, runs)}
  return assemble(pipeline, system, {part: breakdown[part] for part in FORWARD_PARTS},
                  samples_per_micro_batch, sequences_per_sample, -1)
