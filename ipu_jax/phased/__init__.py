"""Phased execution: models beyond the chip's memory, a phase at a time.

Weights, optimizer state and stored activations live in Streaming Memory;
each phase loads what it needs, computes its G micro-batches (batch
serialisation), and stores back (Graphcore's "Intelligent Memory for
Intelligent Computing"; PopTorch's ``SerialPhasedExecution`` /
``ParallelPhasedExecution``; PopXL's phased examples). Serial or ping-pong,
with replicated tensor sharding of the remote state over data-parallel
replicas and tensor parallelism inside each phase. docs/phased_execution.md.
"""

from ipu_jax.phased.estimate import PhaseEstimate, PhasedEstimate
from ipu_jax.phased.layout import MODES, PhasedLayout
from ipu_jax.phased.memory import PhaseOutOfMemoryError
from ipu_jax.phased.model import Phase, PhasedModel
from ipu_jax.phased.streaming import PhaseTraffic, remote_bytes, transfer_cycles
from ipu_jax.phased.trainer import PhasedTrainer

__all__ = ["MODES", "Phase", "PhasedModel", "PhasedLayout", "PhasedTrainer", "PhasedEstimate",
           "PhaseEstimate", "PhaseOutOfMemoryError", "PhaseTraffic", "remote_bytes",
           "transfer_cycles"]
