"""The raw numbers a compiled tile program yields: cycles and bytes per tile.

`ProgramProfile` is the contract between the cost and memory analysis (which
fills it in, in `lowering/analysis.py`) and the reports people read
(`ipu_jax.report`, which only reads it). Arrays are NumPy, indexed by tile,
read-only in spirit and often shared (a step's arrays are the lowered
step's own; steps without compute share one zeros): per-tile figures are held
in the narrowest dtype that is exact for them (float32 cycles, int32 counts
and bytes where every value fits), so sum or scale them in float64 / int64.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ipu_jax.kernels.target import IPUTarget

__all__ = ["StepProfile", "TensorProfile", "MemoryProfile", "ProgramProfile",
           "MEMORY_CATEGORIES", "ALWAYS_LIVE_CATEGORIES", "flops_by_dtype", "majority_dtype",
           "program_flops_dtype"]

# Always-live memory is allocated for the whole program; not-always-live
# memory is shared between values whose lifetimes do not overlap.
ALWAYS_LIVE_CATEGORIES = ("variables", "constants", "vertex_state", "code")
NOT_ALWAYS_LIVE_CATEGORIES = ("temporaries", "exchange_buffers")
MEMORY_CATEGORIES = ALWAYS_LIVE_CATEGORIES + NOT_ALWAYS_LIVE_CATEGORIES


@dataclasses.dataclass
class StepProfile:
  """One BSP superstep (sync -> exchange -> compute) of the program.

  Attributes:
    name: a readable name, e.g. ``"dot_general/partials"``.
    op: the JAX primitive or graph program that produced it (``"dot_general"``,
      ``"Execute"``, ``"Copy"``...).
    source: the user's ``file:line`` the operation came from ('' if unknown).
    compute_cycles: ``[num_tiles]`` cycles of the compute phase on each tile.
    exchange_bytes_in: ``[num_tiles]`` bytes each tile receives.
    exchange_bytes_out: ``[num_tiles]`` bytes each tile sends.
    exchange_cycles: cost of the exchange phase (the busiest tile plus latency,
      plus IPU-Link time for bytes that cross IPUs).
    sync_cycles: cost of the sync that opens the superstep.
    ipu_link_bytes: bytes that cross from one IPU to another.
    flops: floating point operations of the compute phase.
    vertices: ``[num_tiles]`` vertex count per tile.
    executions: times the step runs per program run (``Repeat`` multiplies it;
      loops of unknown trip count count once).
    host_bytes: bytes moved over the host link (streams), 0 otherwise.
    temporary_bytes: ``[num_tiles]`` memory the step itself needs while it
      runs (its scratch: operand blocks, partials; and its exchange
      buffers). What ``available_memory_proportion`` limits.
    notes: remarks from the lowering about how the step is costed (e.g.
      ``"float64 emulated in software: ..."``).
    scope: the module path (name stack) of the operation, e.g.
      ``"Encoder/layers_0/attention"`` ('' outside any named scope).
    streaming_bytes: bytes moved between tiles and streaming memory (remote
      buffer copies, ``lowering/remote.py``), 0 otherwise.
    fused_ops: for a fused compute set, the
      :class:`~ipu_jax.lowering.program.FusedOp` s it was made of (each
      would otherwise have been its own superstep); empty otherwise.
    codelets: the vertex types (codelet names) its compute set runs; empty
      for a step without compute.
    flops_dtype: the dtype whose peak rate its FLOPs are counted against:
      the one its rule costed them at (a matmul's operand type: an AMP
      product of half operands runs at the half rate whatever it accumulates
      in), else its widest floating-point operand or result; '' for a step
      without FLOPs or without floating-point values.
  """

  name: str
  op: str
  source: str
  compute_cycles: np.ndarray
  exchange_bytes_in: np.ndarray
  exchange_bytes_out: np.ndarray
  exchange_cycles: float
  sync_cycles: float
  ipu_link_bytes: int = 0
  flops: int = 0
  vertices: Optional[np.ndarray] = None
  executions: int = 1
  host_bytes: int = 0
  temporary_bytes: Optional[np.ndarray] = None
  notes: tuple = ()
  scope: str = ""
  streaming_bytes: int = 0
  fused_ops: tuple = ()
  codelets: tuple = ()
  flops_dtype: str = ""

  @property
  def compute_phase_cycles(self) -> float:
    """The compute phase lasts as long as its slowest tile."""
    return float(self.compute_cycles.max()) if self.compute_cycles.size else 0.0

  @property
  def total_cycles(self) -> float:
    """Cycles for one execution: sync + exchange + compute."""
    return self.sync_cycles + self.exchange_cycles + self.compute_phase_cycles


@dataclasses.dataclass
class TensorProfile:
  """A tensor of the program and where its bytes live.

  Attributes:
    name: tensor name (user-given, or the JAX variable it holds).
    shape, dtype: logical shape and dtype.
    category: one of `MEMORY_CATEGORIES` ("variables", "constants",
      "temporaries").
    tiles: tile ids that hold part of it.
    bytes_on_tile: bytes held on each of ``tiles``.
    op: the operation that produced it; source: its ``file:line``.
    live_from, live_to: first and last step index (into
      `ProgramProfile.steps`) where it is live (temporaries only).
    scope: the module path (name stack) of the operation that made it.
  """

  name: str
  shape: tuple
  dtype: str
  category: str
  tiles: np.ndarray
  bytes_on_tile: np.ndarray
  op: str = ""
  source: str = ""
  live_from: int = 0
  live_to: int = 0
  scope: str = ""

  @property
  def total_bytes(self) -> int:
    return int(self.bytes_on_tile.sum())


@dataclasses.dataclass
class MemoryProfile:
  """Bytes per tile, by category, at each tile's peak.

  Attributes:
    by_category: category -> ``[num_tiles]`` bytes. For not-always-live
      categories the value is the category's share at that tile's peak.
    peak: ``[num_tiles]`` peak bytes (always-live + peak not-always-live).
    live_over_program: ``[num_steps]`` total bytes live on the device (all
      tiles) at each step, always-live included.
    tile_limit: SRAM per tile.
  """

  by_category: dict
  peak: np.ndarray
  live_over_program: np.ndarray
  tile_limit: int

  @property
  def always_live(self) -> np.ndarray:
    return sum(self.by_category[c] for c in ALWAYS_LIVE_CATEGORIES)

  @property
  def not_always_live(self) -> np.ndarray:
    return self.peak - self.always_live

  @property
  def over_limit_tiles(self) -> np.ndarray:
    return np.nonzero(self.peak > self.tile_limit)[0]


@dataclasses.dataclass
class ProgramProfile:
  """Everything the emulator knows about what a program would cost.

  ``run_setup`` (a :class:`~ipu_jax.lowering.run_setup.RunSetup`, or None)
  says how the program is run (replicas, accumulation, batch sizes,
  precision); the Keras-like ``Model`` sets it on the programs it compiles.
  ``streaming`` (a :class:`~ipu_jax.lowering.remote.StreamingProfile`, or
  None when the program uses no streaming memory) holds its remote buffers
  and what copying them costs. ``control`` (a dict, or None for a profile
  not built from a control program) is the control program's shape over the
  step indices (:func:`~ipu_jax.lowering.control_tree.control_tree`): loops
  with their counts, branches. ``dead_code`` (a
  :class:`~ipu_jax.lowering.dead_code.DeadCode`, or None for a program not
  lowered from a jaxpr) says what dead-code elimination removed first;
  ``constant_folding`` (the dict of
  :meth:`~ipu_jax.lowering.constant_folding.ConstantFolding.as_dict`, or
  None) what constant folding computed on the host instead.
  ``host_io`` (a :class:`~ipu_jax.lowering.host_io.HostIOProfile`, or None
  for a program with no on-device loop over host data) holds what its host
  transfers add, with or without I/O tiles.
  ``host_side`` (an ``ipu_jax.host_time.HostSide``, or None) holds the
  host time measured on this machine for the report's "Host side" section;
  nothing here reads it.
  ``flops_dtype`` (a dtype name, or None) declares the dtype whose peak the
  program's FLOPs are measured against (a composed profile whose steps do
  not say, as a pipeline's); None: :func:`flops_dtype` finds it from the steps.
  """

  target: IPUTarget
  steps: list
  tensors: list
  memory: MemoryProfile
  name: str = "program"
  host_round_trips: int = 1
  run_setup: Optional[object] = None
  streaming: Optional[object] = None
  dead_code: Optional[object] = None
  constant_folding: Optional[dict] = None
  control: Optional[dict] = None
  host_io: Optional[object] = None
  host_side: Optional[object] = None
  flops_dtype: Optional[str] = None

  def _weighted(self, attribute: str) -> float:
    return float(sum(getattr(s, attribute) * s.executions for s in self.steps))

  @property
  def compute_cycles(self) -> float:
    return self._weighted("compute_phase_cycles")

  @property
  def exchange_cycles(self) -> float:
    return self._weighted("exchange_cycles")

  @property
  def sync_cycles(self) -> float:
    return self._weighted("sync_cycles")

  @property
  def total_cycles(self) -> float:
    return self.compute_cycles + self.exchange_cycles + self.sync_cycles

  @property
  def total_flops(self) -> float:
    return float(sum(s.flops * s.executions for s in self.steps))

  @property
  def estimated_seconds(self) -> float:
    return self.target.cycles_to_seconds(self.total_cycles)

  @property
  def tiles_used(self) -> int:
    return int(np.count_nonzero(self.memory.peak))

  def tile_cycles(self) -> np.ndarray:
    """``[num_steps, num_tiles]`` compute cycles per step and tile."""
    if not self.steps:
      return np.zeros((0, self.target.num_tiles))
    return np.stack([s.compute_cycles for s in self.steps], dtype=np.float64)


def flops_by_dtype(profile: ProgramProfile) -> dict:
  """``{dtype name: FLOPs per run}`` of ``profile``'s steps that say their dtype."""
  by_dtype = {}
  for step in profile.steps:
    if step.flops_dtype and step.flops:
      by_dtype[step.flops_dtype] = (by_dtype.get(step.flops_dtype, 0)
                                    + step.flops * step.executions)
  return by_dtype


def majority_dtype(by_dtype: dict) -> Optional[str]:
  """The dtype with the most FLOPs in ``{dtype: FLOPs}`` (the first on a tie), or None."""
  return max(by_dtype.items(), key=lambda item: item[1])[0] if by_dtype else None


def program_flops_dtype(profile: ProgramProfile) -> str:
  """The dtype whose peak FLOP/s ``profile`` is measured against.

  The declared ``profile.flops_dtype`` if set; else the dtype of most of
  its FLOPs (a float16 model's products outweigh its float32 norms and
  updates); float32 for a program with none.
  """
  if profile.flops_dtype:
    return str(np.dtype(profile.flops_dtype))
  return majority_dtype(flops_by_dtype(profile)) or "float32"
