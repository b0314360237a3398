"""A pipelined, replicated training step's time on an IPU system.

:func:`step_throughput` reads a lowered :class:`~ipu_jax.pipelining.Pipeline`
and lays one step of ``R`` replicas of the pipeline over the system its
config names (``cfg.system``; none: the flat one-IPU-Link-rate model). The
step is the sum of these parts, each in seconds (``Throughput.breakdown``):

* ``steady_state``, ``ramp``: the compute of the schedule's slots in which
  every stage is busy, and of the slots before and after (in each slot, the
  busiest IPU's passes -- stages sharing an IPU add -- less what of them is
  recomputation);
* ``recomputation``: the forward work the busiest IPU's backward passes run
  again, read off the lowered backward programs
  (:func:`~ipu_jax.pipelining.stage_programs.recompute_cycles`);
* ``inter_stage_copies``: each slot's IPU-Link copies between stages
  (:func:`~ipu_jax.pipelining.links.slot_copy_cycles`); with the Grouped
  schedule every slot, the ramp's too, runs every stage's copies, as PopART
  and TF-IPU run them (the replica-local timeline counts a slot's own);
* ``syncs``: the sync ending each slot. Replicas run in lockstep as one
  replicated graph, so the sync spans all ``R x N`` IPUs
  (:meth:`IPUTarget.ipu_sync_cycles`, growing with the IPU count, DESIGN
  section 10), plus a GW-Link latency each way when the replicas span PODs
  (the same *estimate* the system's collectives use);
* after the last slot, the weight update: ``gradient_reduction`` (an
  all-reduce of the gradients over the replicas, or with replicated tensor
  sharding a reduce-scatter; one collective in which every IPU of the
  replica reduces its stages' gradients with its peers at once, sharing the
  links, as PopART's merged collectives run), then each IPU updates the
  weights its stages own, one stage after another, and the step waits for
  the IPU that takes longest: ``optimizer_state_streaming`` (with
  ``streaming.offload_optimizer_state``: the remote copies of the stage's
  lowered update program, which streams its optimizer state -- the
  replica's ``1 / R`` shard with sharding -- in from and back to Streaming
  Memory, docs/streaming_memory.md), ``optimizer_compute`` (the rest of the
  stage's lowered update program; with sharding the per-replica program,
  which updates one shard, norms all-reduced across the replicas inside it,
  :mod:`~ipu_jax.pipelining.weight_update`); then ``weight_all_gather``
  (sharding: the updated weights gathered back to every replica, every
  IPU's at once as the reduction);
* ``host_io``: the replica's ``G`` micro-batches over its host link at
  ``IPUTarget.host_link_bytes_per_second`` (PCIe 4.0 x16), each replica over
  its own link, not overlapped with compute (an upper bound: Poplar can
  overlap I/O).
* ``execution_overhead``: the host's fixed time per execution of the device
  program (``IPUSystem.execution_overhead_seconds``, measured on Bow Pods:
  PopART's ``session.run`` with its streams and the script's host work
  around it) over the steps one execution runs (``steps_per_execution``
  micro-batches: one step each by default, as PopART's ``batches_per_step``
  of 1 in the MLPerf BERT runs; none without a system).

Collectives run over the system's links (:mod:`ipu_jax.kernels.collectives`)
between IPU ``j`` of every replica. **Placement**: replica ``r`` sits in POD
``r mod P`` when the replicas divide evenly over the system's ``P`` PODs (a
job on a multi-POD partition uses every POD), packed in replica order inside
each POD; otherwise all replicas are packed in order from IPU 0.

The replica-local timeline (:attr:`Pipeline.timeline`) is unchanged by all
this: it syncs the replica's own IPUs and all-reduces over the system in
packed order; the throughput is the system-wide figure.
"""

from __future__ import annotations

import dataclasses

import jax

from ipu_jax.kernels import collectives
from ipu_jax.pipelining import links, schedule as schedule_lib, stage_programs

__all__ = ["Throughput", "PARTS", "step_throughput", "replica_bases", "spans_pods",
           "steps_per_run", "host_parts", "assemble"]

PARTS = ("steady_state", "ramp", "recomputation", "inter_stage_copies", "syncs",
         "gradient_reduction", "optimizer_state_streaming", "optimizer_compute",
         "weight_all_gather", "host_io", "execution_overhead")


@dataclasses.dataclass(frozen=True)
class Throughput:
  """What one training step of the replicated pipeline takes on the system.

  Attributes:
    samples_per_second: samples (rows of a micro-batch) per second.
    sequences_per_second: ``samples_per_second x sequences_per_sample``
      (packed sequences: several a sample).
    step_seconds: one step (``G x R`` micro-batches and the weight update).
    samples_per_step: ``G x R x`` samples per micro-batch.
    sequences_per_sample: the packing factor (1 unpacked).
    breakdown: seconds of each part of :data:`PARTS` (they add up to
      ``step_seconds``; see the module docstring).
    system: the system's name (None: the flat model).
    ipus: ``R x N`` IPUs the step uses.
    update_ipu: the IPU (of a replica) whose weight update the step waits for.
  """

  samples_per_second: float
  sequences_per_second: float
  step_seconds: float
  samples_per_step: int
  sequences_per_sample: float
  breakdown: dict
  system: str | None
  ipus: int
  update_ipu: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def summary_lines(self) -> list:
    where = f"on {self.system}" if self.system else "(flat link model, no system)"
    lines = [f"  throughput {where}, {self.ipus} IPUs: {self.samples_per_second:,.1f} samples/s, "
             f"{self.sequences_per_second:,.1f} sequences/s; step {self.step_seconds * 1e3:,.3f} "
             f"ms ({self.samples_per_step:,d} samples)"]
    for part, seconds in self.breakdown.items():
      share = 100 * seconds / self.step_seconds if self.step_seconds else 0.0
      lines.append(f"    {part:<26s} {seconds * 1e3:>12,.3f} ms {share:>6.1f} %")
    return lines


def replica_bases(system, replicas: int, ipus_per_replica: int) -> list:
  """The first IPU of each replica on ``system`` (see the placement rule above)."""
  n = ipus_per_replica
  if system is None:
    return [r * n for r in range(replicas)]
  pods = system.pods
  if pods > 1 and replicas % pods == 0 and (replicas // pods) * n <= system.ipus_per_pod:
    return [(r % pods) * system.ipus_per_pod + (r // pods) * n for r in range(replicas)]
  return [r * n for r in range(replicas)]


def spans_pods(system, bases: list, n: int) -> bool:
  """Whether the replicas starting at ``bases`` (``n`` IPUs each) span PODs."""
  if system is None:
    return False
  return len({ipu // system.ipus_per_pod for b in bases for ipu in (b, b + n - 1)}) > 1


def _collective(kind: str, target, groups, nbytes: float, replicas: int) -> float:
  """Cycles of a collective between the replicas (flat model without a system:
  an all-reduce is the ring of ``links``, a reduce-scatter or all-gather half of it)."""
  if replicas <= 1 or nbytes <= 0:
    return 0.0
  if target.system is not None:
    return collectives.collective(kind, target, groups, nbytes).cycles
  full = links.all_reduce_cycles(target, replicas, nbytes)
  return full if kind == "all_reduce" else full / 2


def _slot_copies(pipeline) -> list:
  """Cycles of each slot's IPU-Link copies as the framework runs them.

  Grouped: every slot runs the copies of *every* stage, the ramp's slots as
  the full ones, since PopART puts one merged inter-IPU copy program in each
  pipeline cycle, fill and flush included (popart
  ``willow/src/popx/popprograms.cpp``, ``PopPrograms::addPipelineCycle``:
  "Always do all the copies"), as TF-IPU's grouped visitor schedules its
  inter-IPU copies over the ramp-up with the full schedule
  (``grouped_overlap_pipeline_visitor.cc``); only the stages' compute is
  skipped where they have no micro-batch. Other schedules: the copies of
  the slot's own passes (the replica-local timeline's).
  """
  copies = list(pipeline.timeline.copy_cycles_per_slot)
  if pipeline.schedule != "Grouped":
    return copies
  every = [c for k in range(len(pipeline.stages)) for kind in ("forward", "backward")
           for c in pipeline.copies(k, kind)]
  return [links.slot_copy_cycles(pipeline.target, every)] * len(copies)


def _slot_parts(pipeline, sync: float) -> dict:
  """Cycles of the slots: steady / ramp compute, recomputation, copies, syncs."""
  stages = pipeline.stages
  n = len(stages)
  fwd = [s.forward.profile.total_cycles for s in stages]
  bwd = [s.backward.profile.total_cycles for s in stages]
  rec = [s.recompute_cycles for s in stages]
  slots = schedule_lib.slots(pipeline.schedule, n, pipeline.accumulation)
  copies = _slot_copies(pipeline)
  out = dict.fromkeys(("steady_state", "ramp", "recomputation", "inter_stage_copies",
                       "syncs"), 0.0)
  for t, slot in enumerate(slots):
    # A slot lasts as long as its busiest IPU: in the ramp the stages with no
    # micro-batch yet (or any more) are skipped (PopART ``PipelineInfo::doStage``).
    work, again = {}, {}
    for p in slot:
      ipu = stages[p.stage].ipu
      work[ipu] = work.get(ipu, 0.0) + (fwd[p.stage] if p.kind == "forward" else bwd[p.stage])
      again[ipu] = again.get(ipu, 0.0) + (rec[p.stage] if p.kind == "backward" else 0.0)
    busiest = max(work, key=work.get)
    full = (len({(p.stage, p.kind) for p in slot}) == len(slot)
            and {p.stage for p in slot} == set(range(n)))
    out["steady_state" if full else "ramp"] += work[busiest] - again[busiest]
    out["recomputation"] += again[busiest]
    out["inter_stage_copies"] += copies[t] if t < len(copies) else 0.0
    out["syncs"] += sync
  return out


def _concurrent(kind: str, target, groups_of, nbytes_by_ipu: dict, replicas: int) -> float:
  """Cycles of one collective ``kind`` over every IPU's group at once.

  IPU ``j`` of the replica reduces ``nbytes_by_ipu[j]`` with its peers while
  the replica's other IPUs reduce theirs, over the same ladder and GW-Links
  (:mod:`~ipu_jax.kernels.collectives` prices the shared links' load). The
  flat model has no shared links: the slowest IPU's ring.
  """
  ipus = [j for j in sorted(nbytes_by_ipu) if nbytes_by_ipu[j] > 0]
  if replicas <= 1 or not ipus:
    return 0.0
  if target.system is None:
    return max(_collective(kind, target, None, nbytes_by_ipu[j], replicas) for j in ipus)
  groups = [(group, nbytes_by_ipu[j]) for j in ipus for group in groups_of(j)]
  return collectives.collective(kind, target, [g for g, _ in groups],
                                [b for _, b in groups]).cycles


def _update_parts(pipeline, target, groups_of, replicas: int) -> tuple:
  """``(ipu, parts)``: the weight-update phase; ``ipu`` the one whose optimizer
  takes longest.

  The gradient reduction (and with sharding the weights' all-gather) is one
  collective of every IPU's gradients at once, each IPU's with its own
  bytes: the step waits for the collective, the slowest IPU's optimizer,
  then the gather. PopART merges a replica's all-reduces
  (``replicatedCollectivesSettings.mergeAllReduceCollectives``, on in every
  MLPerf BERT run: ``merge_collectives`` in Graphcore's
  ``configs/pod*-closed.json``, mlcommons/training_results_v2.0). Under
  replicated tensor sharding the runs' SDK (PopART ``sdk/poplar/2.5.1``) did
  not merge the reduce-scatters and all-gathers that replace them: its
  ``MergeCollectivesTransform`` merges all-reduces only
  (``willow/src/transforms/mergecollectives.cpp``, where merging the other
  two is still marked as work to do, T56323 / T56324; it came with popart
  a068bba76), so those runs paid one pair per
  weight tensor. Merged here all the same: the bytes are the same, and the
  other pairs' latency at :mod:`~ipu_jax.kernels.collectives`' figures
  (about 45 tensors an IPU on the BERT-Large presets) is about 0.2 ms a
  step over a Bow Pod64's replicas, 2.3 ms over a Bow Pod256's (the
  GW-Link rings' steps): not modelled.
  """
  sharded = pipeline.config.streaming.replicated_tensor_sharding and replicas > 1
  grads, streamed, compute = {}, {}, {}
  for programs in pipeline.stages:
    j = programs.ipu
    grads[j] = grads.get(j, 0) + programs.weight_bytes
    streamed.setdefault(j, 0.0)
    compute.setdefault(j, 0.0)
    if programs.update is not None:
      # The lowered update (per replica with sharding) streams its state itself.
      profile = programs.update.profile
      stream = profile.streaming.cycles if profile.streaming is not None else 0.0
      streamed[j] += stream
      compute[j] += profile.total_cycles - stream
  ipu = max(grads, key=lambda i: streamed[i] + compute[i])
  parts = {
      "gradient_reduction": _concurrent("reduce_scatter" if sharded else "all_reduce", target,
                                        groups_of, grads, replicas),
      "optimizer_state_streaming": streamed[ipu],
      "optimizer_compute": compute[ipu],
      "weight_all_gather": (_concurrent("all_gather", target, groups_of, grads, replicas)
                            if sharded else 0.0)}
  return ipu, parts


def steps_per_run(steps_per_execution, accumulation: int, replicas: int) -> int:
  """Weight updates one execution runs (``steps_per_execution`` checked)."""
  if steps_per_execution is None:
    return 1
  from ipu_jax.pipelining.pipeline import check_steps_per_execution
  from ipu_jax.pipelining.split import PipelineError
  if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, int) \
      or steps_per_execution < 1:
    raise PipelineError(f"steps_per_execution must be a positive integer (micro-batches an "
                        f"execution runs); got {steps_per_execution!r}.")
  check_steps_per_execution(steps_per_execution, accumulation, replicas)
  return steps_per_execution // (accumulation * replicas)


def step_throughput(pipeline, samples_per_micro_batch: int | None = None,
                    sequences_per_sample: float = 1.0, system=None,
                    steps_per_execution: int | None = None) -> Throughput:
  """The throughput of a lowered pipeline's step (see the module docstring).

  Args:
    pipeline: a lowered :class:`~ipu_jax.pipelining.Pipeline`.
    samples_per_micro_batch: rows of a micro-batch; default the leading
      dimension of the micro-batch's first leaf.
    sequences_per_sample: sequences packed in each sample (>= 1).
    system: price the same lowered step on this system (an ``IPUSystem`` or
      a preset name) instead of the config's: the stage programs depend on
      the chip only, so they are not lowered again; the chip must match.
    steps_per_execution: micro-batches (over all replicas) one execution of
      the device program runs, a multiple of ``G x R``; default ``G x R``
      (one step an execution).

  Raises:
    ValueError: ``sequences_per_sample`` below 1, or the system is too
      small for the replicas (naming the fields).
    PipelineError: ``steps_per_execution`` not a multiple of ``G x R``.
  """
  if not sequences_per_sample >= 1:
    raise ValueError(f"sequences_per_sample (the packing factor) must be >= 1; got "
                     f"{sequences_per_sample!r}.")
  target = pipeline.target
  if system is not None:
    target = target.replace(system=system)  # checks the chip
  system = target.system
  r, n, g = pipeline.replicas, pipeline.config.auto_select_ipus, pipeline.accumulation
  runs = steps_per_run(steps_per_execution, g, r)
  if system is not None:
    from ipu_jax.kernels.systems import check_capacity
    check_capacity(system, r, n)
  bases = replica_bases(system, r, n)
  sync = target.ipu_sync_cycles(r * n)
  if spans_pods(system, bases, n):
    sync += 2 * system.gw_latency_seconds * target.clock_hz
  cycles = _slot_parts(pipeline, sync)
  ipu, update = _update_parts(pipeline, target, lambda j: [[b + j for b in bases]], r)
  cycles.update(update)
  breakdown = {part: cycles[part] / target.clock_hz for part in PARTS
               if part not in ("host_io", "execution_overhead")}
  breakdown.update(host_parts(pipeline, target, runs))
  return assemble(pipeline, system, {part: breakdown[part] for part in PARTS},
                  samples_per_micro_batch, sequences_per_sample, ipu)


def host_parts(pipeline, target, runs: int) -> dict:
  """``host_io`` and ``execution_overhead`` (seconds) of one step of ``pipeline``
  on ``target`` (its system's host), ``runs`` steps an execution (:func:`steps_per_run`)."""
  system = target.system
  # stage_programs.nbytes reads dtype.itemsize, which a typed PRNG key has too.
  micro_bytes = stage_programs.nbytes(jax.tree_util.tree_leaves(pipeline.micro_batch_avals))
  return {"host_io": pipeline.accumulation * float(micro_bytes)
                     / target.host_link_bytes_per_second,
          "execution_overhead": (system.execution_overhead_seconds / runs
                                 if system is not None else 0.0)}


def assemble(pipeline, system, breakdown: dict, samples_per_micro_batch,
             sequences_per_sample: float, update_ipu: int) -> Throughput:
  """The :class:`Throughput` on ``system`` of a step whose parts take ``breakdown`` seconds."""
  breakdown = {part: float(seconds) for part, seconds in breakdown.items()}
  step = sum(breakdown.values())
  if samples_per_micro_batch is None:
    leaves = jax.tree_util.tree_leaves(pipeline.micro_batch_avals)
    samples_per_micro_batch = int(leaves[0].shape[0]) if leaves and leaves[0].shape else 1
  samples = pipeline.accumulation * pipeline.replicas * int(samples_per_micro_batch)
  rate = samples / step if step else 0.0
  return Throughput(rate, rate * sequences_per_sample, step, samples,
                    float(sequences_per_sample), breakdown,
                    None if system is None else system.name,
                    pipeline.replicas * pipeline.config.auto_select_ipus, update_ipu)
