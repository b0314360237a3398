"""What one IPU holds at each phase's peak, and what its Streaming Memory holds.

In-Processor Memory at a phase's peak, per tile: the phase program's own peak
from its lowered profile (the phase's weights once loaded, its activations
and temporaries; its code) plus the code of every other program the same IPU
group runs (all phases' code stays resident unless code is loaded per phase,
which is not modelled), plus, when activations are not remote, every stored
activation of the step spread over the tiles. Streaming Memory per IPU:
:func:`~ipu_jax.phased.streaming.streaming_memory_per_group` against
``IPUTarget.streaming_memory_bytes`` (the IPU-M2000 / Bow-2000 datasheets'
DDR, ``docs/hardware.md``).
"""

from __future__ import annotations

import numpy as np

from ipu_jax.lowering.errors import OutOfMemoryError

__all__ = ["PhaseOutOfMemoryError", "phase_peaks", "check_peaks", "check_streaming_memory", "REMEDY"]

REMEDY = ("more tensor parallelism (mesh tp), replicated tensor sharding (PhasedLayout.rts), "
          "batch serialisation (a larger PhasedLayout.batch_serialisation with a smaller "
          "micro-batch), or fewer layers a phase")


class PhaseOutOfMemoryError(OutOfMemoryError):
  """A phase does not fit: names the phase, the IPU, the bytes and the remedy.

  Attributes (besides :class:`ipu_jax.OutOfMemoryError`'s):
    phase: the phase's name (``"streaming memory"`` for a Streaming-Memory overflow).
    ipu: the IPU (index within the run) that overflows.
  """

  def __init__(self, message, *, phase, ipu, bytes_needed, bytes_available, tile=-1):
    super().__init__(message, tile=tile, bytes_needed=int(bytes_needed),
                     bytes_available=int(bytes_available))
    self.phase = phase
    self.ipu = ipu


def _code(profile) -> np.ndarray:
  return np.asarray(profile.memory.by_category.get("code", 0), np.int64)


def phase_peaks(executions: list, profiles: list, layout, target,
                stored_activation_bytes: int) -> list:
  """Per execution, ``(peak bytes of one IPU, [tiles] peak bytes)``.

  A phase execution runs several programs in turn (load, the micro-batch
  program G times, update); its peak is the highest of theirs, each with the
  code of every other program its IPU group runs resident.

  Args:
    executions: ``(name, group, program indices)`` per phase execution.
    profiles: the distinct programs' profiles (one IPU's tiles each).
    layout: the layout.
    target: the per-IPU target.
    stored_activation_bytes: activations held on chip between phases
      (0 with remote activations), per IPU.
  """
  groups = {}
  for _, group, used in executions:
    groups.setdefault(group, set()).update(used)
  spread = stored_activation_bytes / target.tiles_per_ipu
  peaks = []
  for _, group, used in executions:
    tiles = None
    for p in used:
      others = sum((_code(profiles[q]) for q in groups[group] if q != p), np.int64(0))
      mine = np.asarray(profiles[p].memory.peak, np.float64)[:target.tiles_per_ipu] \
          + others + spread
      tiles = mine if tiles is None else np.maximum(tiles, mine)
    peaks.append((int(tiles.sum()), tiles))
  return peaks


def check_peaks(executions: list, peaks: list, layout, target) -> None:
  """Raise :class:`PhaseOutOfMemoryError` for the first phase with a tile over its SRAM."""
  for (name, group, _), (total, tiles) in zip(executions, peaks):
    over = np.nonzero(tiles > target.bytes_per_tile)[0]
    if over.size:
      tile = int(over[0])
      ipu = group * layout.dp * layout.tp
      raise PhaseOutOfMemoryError(
          f"Phase {name!r} does not fit on IPU {ipu} (IPU group {group}): its tile {tile} "
          f"needs {int(tiles[tile]):,d} bytes but has {target.bytes_per_tile:,d}; the IPU "
          f"holds {total:,d} bytes at the phase's peak against "
          f"{target.tiles_per_ipu * target.bytes_per_tile:,d}. Use {REMEDY}.",
          phase=name, ipu=ipu, bytes_needed=int(tiles[tile]),
          bytes_available=target.bytes_per_tile, tile=tile)


def check_streaming_memory(held: np.ndarray, layout, target) -> None:
  """Raise :class:`PhaseOutOfMemoryError` when an IPU's Streaming Memory overflows.

  Args:
    held: ``[groups]`` bytes one IPU of each group holds.
  """
  capacity = target.streaming_memory_bytes
  over = np.nonzero(held > capacity)[0]
  if over.size:
    group = int(over[0])
    ipu = group * layout.dp * layout.tp
    raise PhaseOutOfMemoryError(
        f"Streaming memory of IPU {ipu} (IPU group {group}) overflows: its phases' remote "
        f"weights, optimizer state and stored activations need {int(held[group]):,d} bytes "
        f"but the {target.name} target has {capacity:,d} per IPU "
        f"(IPUTarget.streaming_memory_bytes). Use {REMEDY}, or more data-parallel replicas "
        "with RTS.", phase="streaming memory", ipu=ipu, bytes_needed=int(held[group]),
        bytes_available=capacity)
