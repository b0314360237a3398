"""Models across IPUs: stages on IPUs, sharded and pipelined execution.

Mark stage boundaries with :func:`ipu_jax.ops.pipeline_stage` or put
layers in ``with ipu_jax.pipelining.stage(k):`` blocks; a
:class:`Pipeline` splits the loss function there, lowers each stage's
forward, backward and weight-update programs onto its IPU (``device_mapping``;
an IPU may hold several stages, which may share tied weights), runs steps in
the schedule's order (``config.pipelining.schedule``: Grouped, Interleaved or
Sequential) and costs them (:class:`PipelineReport`); :func:`search` finds
a split (layers per IPU, memory proportions, recomputation) that fits and
runs fastest. What users of Graphcore's frameworks expect of
sharding, pipelining and recomputation, with sources: docs/multi_ipu.md.
"""

from ipu_jax.pipelining.micro_batches import micro_batch_key, micro_batch_keys
from ipu_jax.pipelining.pipeline import (Pipeline, StagePrograms, StepResult,
                                        check_steps_per_execution)
from ipu_jax.pipelining.report import PipelineReport
from ipu_jax.pipelining.schedule import SCHEDULES, minimum_accumulation, stash_depths
from ipu_jax.pipelining.split import PipelineError, split_stages, stage
from ipu_jax.pipelining.candidates import Candidate, LayeredModel, SearchSpace
from ipu_jax.pipelining.search_result import LoweredSplit, SearchResult
from ipu_jax.pipelining.split_search import search
from ipu_jax.pipelining.throughput import Throughput, step_throughput
from ipu_jax.pipelining.forward_throughput import forward_throughput

__all__ = ["Candidate", "LayeredModel", "LoweredSplit", "Pipeline", "PipelineError",
           "PipelineReport", "SCHEDULES", "SearchResult", "SearchSpace", "StagePrograms",
           "StepResult", "Throughput",
           "check_steps_per_execution", "forward_throughput", "micro_batch_key",
           "micro_batch_keys",
           "minimum_accumulation", "search", "split_stages",
           "stage", "stash_depths", "step_throughput"]
