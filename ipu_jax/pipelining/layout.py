"""Stages on IPUs: the device mapping, tied weights and each IPU's memory.

A pipeline's ``device_mapping`` gives each stage an IPU of the replica, and
may give one IPU several stages (BERT's heads go back to IPU 0 after the
last encoder IPU: ``[0, 1, 2, 3, 0]``, TF-IPU's ``device_mapping``,
PopTorch's ``BeginBlock(ipu_id=0)``). The rules users of those frameworks
know are checked here, before anything is lowered:

* every entry names an IPU of the replica (``0 .. auto_select_ipus - 1``);
* the Interleaved schedule takes one stage per IPU (TF-IPU refuses several
  stages on one device with it); Grouped and Sequential take any mapping;
* a weight read by several stages (a tied embedding and output projection)
  must have all its readers on one IPU, where it lives once (PopTorch's
  rule); its first reader owns it: it holds the weight, its gradient
  accumulator and optimizer state and runs its update, the others add their
  gradient contributions into that accumulator.

Stages on one IPU share its tiles and memory. The programs of one IPU run
one at a time, so on each tile the IPU needs the largest of its stages'
program peaks -- with, beside that program, the weights and accumulators the
IPU's *other* stages hold (a program's peak already counts its own) and the
optimizer state every stage on the IPU keeps on chip (only the update
program reads it, so a forward or backward program's peak does not count
even its own stage's) -- plus every activation set any of its stages keeps
stashed (each stage's stash depth x its stash bytes). With one stage per IPU
this is that stage's largest program, its optimizer state beside its forward
and backward programs, plus its stash.

The optimizer state is held on the tiles the update program maps it to (with
replicated tensor sharding: the copy's shard); a leaf offloaded to streaming
memory (``streaming.offload_optimizer_state``) is a remote buffer with no
tile mapping and holds nothing on chip between updates.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Sequence

import jax
import numpy as np

from ipu_jax.pipelining.split import PipelineError

__all__ = ["INTERLEAVED_SHARED_IPU", "IPUMemory", "check_mapping", "check_tied_weights",
           "accumulator_bytes", "held_bytes", "ipu_memory", "state_bytes", "weight_bytes"]

# TF-IPU's reason for refusing an Interleaved pipeline with a repeated IPU.
INTERLEAVED_SHARED_IPU = ("The Interleaved schedule does not currently support multiple "
                          "pipeline stages on the same device")

_PROGRAM_KINDS = ("forward", "backward", "update")


def check_mapping(device_mapping: Optional[Sequence[int]], num_stages: int, num_ipus: int,
                  schedule: str) -> list:
  """The IPU of each stage, checked against the replica's IPUs and the schedule.

  Args:
    device_mapping: the user's mapping, or None for stage k on IPU k.
    num_stages: stages of the split model.
    num_ipus: IPUs per replica (``auto_select_ipus``).
    schedule: the pipelining schedule.

  Returns:
    ``[ipu of stage k]`` as ints.

  Raises:
    PipelineError: more stages than IPUs without a mapping, a mapping of the
      wrong length, an entry that is not an IPU of the replica, or several
      stages on one IPU with the Interleaved schedule.
  """
  if device_mapping is None:
    if num_stages > num_ipus:
      raise PipelineError(
          f"The model has {num_stages} pipeline stages but each replica has only "
          f"{num_ipus} IPUs (auto_select_ipus={num_ipus}); set auto_select_ipus >= "
          f"{num_stages}, give a device_mapping that puts several stages on one IPU "
          "(Grouped or Sequential schedule), or use fewer stages.")
    return list(range(num_stages))
  if isinstance(device_mapping, (str, bytes)) or not hasattr(device_mapping, "__len__"):
    raise PipelineError(f"device_mapping must be a sequence with the IPU of each stage, e.g. "
                        f"[0, 1, 2, 3, 0]; got {device_mapping!r}.")
  mapping = list(device_mapping)
  if len(mapping) != num_stages:
    raise PipelineError(f"device_mapping {tuple(mapping)} has {len(mapping)} entries for "
                        f"{num_stages} stages; give one IPU per stage.")
  for k, ipu in enumerate(mapping):
    if isinstance(ipu, bool) or not isinstance(ipu, numbers.Integral):
      raise PipelineError(
          f"device_mapping[{k}]={ipu!r} is not an IPU number: stage {k} needs an int IPU of "
          f"the replica, valid range 0..{num_ipus - 1} (auto_select_ipus={num_ipus}).")
    if not 0 <= ipu < num_ipus:
      raise PipelineError(
          f"device_mapping[{k}]={ipu!r} is out of range: stage {k} must be on an IPU of the "
          f"replica, valid range 0..{num_ipus - 1} (auto_select_ipus={num_ipus}).")
  mapping = [int(i) for i in mapping]
  shared = {ipu: [k for k, i in enumerate(mapping) if i == ipu] for ipu in set(mapping)}
  shared = {ipu: ks for ipu, ks in sorted(shared.items()) if len(ks) > 1}
  if shared and schedule == "Interleaved":
    where = "; ".join(f"stages {', '.join(map(str, ks))} on IPU {ipu}"
                      for ipu, ks in shared.items())
    raise PipelineError(
        f"{INTERLEAVED_SHARED_IPU} (TF-IPU's rule): device_mapping {tuple(mapping)} puts "
        f"{where}. Use the Grouped or Sequential schedule, or one IPU per stage.")
  return mapping


def check_tied_weights(staged, mapping: Sequence[int]) -> None:
  """A weight read by several stages must have all of them on one IPU.

  Raises:
    PipelineError: naming the weight (its pytree path), the stages reading it,
      their IPUs and where each first reads it.
  """
  for i, reads in sorted(staged.weight_reads.items()):
    ipus = {mapping[k] for k in reads}
    if len(ipus) > 1:
      readers = " and by ".join(f"stage {k} (IPU {mapping[k]}, at {where})"
                                for k, where in sorted(reads.items()))
      raise PipelineError(
          f"Weight params{staged.param_names[i]} is read by {readers}: a weight shared by "
          "stages lives on one IPU, so the stages reading it must be on the same IPU "
          f"(device_mapping {tuple(mapping)}). Map these stages to one IPU, or pass the "
          "value across the stage boundary instead.")


def _tile_bytes(tensors, num_tiles: int) -> np.ndarray:
  """``[tiles]`` bytes of ``tensors`` on the tiles their mappings give (each tensor once)."""
  out = np.zeros(num_tiles, np.int64)
  seen = set()
  for tensor in tensors:
    # By object: tensor ids are numbered per program, and these come from several.
    if id(tensor) in seen or tensor.mapping is None or not tensor.mapping.num_elements:
      continue
    seen.add(id(tensor))
    np.add.at(out, tensor.mapping.tiles, tensor.mapping.counts * tensor.itemsize)
  return out


def state_bytes(update, num_tiles: int) -> np.ndarray:
  """``[tiles]`` bytes of the optimizer state a stage keeps on chip for the whole step.

  Read from the tile mappings of the update program's state arguments
  (argument 1 of ``update(p_k, state, g_k)``, or of the sharded per-copy
  program: the copy's shard). Leaves offloaded to streaming memory are remote
  buffers without a tile mapping: they add nothing.

  Args:
    update: the stage's lowered update program, or None (no optimizer).
    num_tiles: tiles of the stage's IPU.
  """
  if update is None:
    return np.zeros(num_tiles, np.int64)
  in_tree = update.signature.in_tree
  args, _ = jax.tree_util.tree_unflatten(in_tree, list(range(in_tree.num_leaves)))
  return _tile_bytes([update.inputs[i] for i in jax.tree_util.tree_leaves(args[1])], num_tiles)


def _owned(stage, tensors) -> list:
  """Of a program's per-parameter ``tensors`` (``stage.params`` order), the stage's own."""
  owned = set(stage.owned)
  return [t for i, t in zip(stage.params, tensors) if i in owned]


def weight_bytes(forward, stage, num_tiles: int) -> np.ndarray:
  """``[tiles]`` bytes of the weights ``stage`` owns, read from the forward
  program's weight arguments (its first ``len(stage.params)``)."""
  return _tile_bytes(_owned(stage, forward.inputs[:len(stage.params)]), num_tiles)


def accumulator_bytes(backward, stage, num_tiles: int) -> np.ndarray:
  """``[tiles]`` bytes of the gradient accumulators of the weights ``stage`` owns.

  Read from the backward program's accumulator arguments (its last
  ``len(stage.params)``). They live for the whole step, beside the stage's
  forward program too, which does not read them.
  """
  count = len(stage.params)
  return _tile_bytes(_owned(stage, backward.inputs[-count:] if count else []), num_tiles)


def held_bytes(forward, backward, stage, num_tiles: int, update=None) -> np.ndarray:
  """``[tiles]`` bytes ``stage`` holds for the whole step.

  The weights it owns (:func:`weight_bytes`), their gradient accumulators
  (:func:`accumulator_bytes`) and its on-chip optimizer state
  (:func:`state_bytes` of ``update``).
  """
  return (weight_bytes(forward, stage, num_tiles)
          + accumulator_bytes(backward, stage, num_tiles) + state_bytes(update, num_tiles))


@dataclasses.dataclass
class IPUMemory:
  """The memory of one IPU and the stages it runs.

  Attributes:
    ipu: the IPU within the replica.
    stages: its :class:`StagePrograms`, in stage order.
    programs: ``[(stage, kind, Lowered)]``, every program run on the IPU.
    others_held: ``[programs, tiles]`` bytes of the weights and accumulators
      held beside each program and not counted in its peak: the IPU's other
      stages', and a forward program's own stage's accumulators (which it
      does not read).
    optimizer_state: ``[programs, tiles]`` bytes of on-chip optimizer state
      held beside each program and not counted in its peak: every stage's on
      the IPU, less an update program's own (which it reads).
    chosen: ``[tiles]`` index into ``programs`` of the program that peaks
      highest on each tile (with what is held beside it).
    program_peak: ``[tiles]`` that program's peak plus what is held beside it.
    stash: ``[tiles]`` every stage's stash depth x stash bytes, summed.
  """

  ipu: int
  stages: list
  programs: list
  others_held: np.ndarray
  optimizer_state: np.ndarray
  chosen: np.ndarray
  program_peak: np.ndarray
  stash: np.ndarray

  @property
  def stage_indices(self) -> list:
    return [s.index for s in self.stages]

  @property
  def peak(self) -> np.ndarray:
    """``[tiles]`` the IPU's peak bytes: largest program with what is held beside it + stash."""
    return self.program_peak + self.stash

  def describe_tile(self, tile: int) -> str:
    """What makes up ``tile``'s peak, for an out-of-memory message."""
    chosen = self.chosen[tile]
    stage, kind, program = self.programs[chosen]
    held = int(self.others_held[chosen, tile])
    stashes = ", ".join(f"stage {s.index}: {s.stash_depth} x {int(s.stash_bytes[tile]):,d} B"
                        for s in self.stages)
    return (f"stage {stage}'s {kind} program peaks at "
            f"{int(program.profile.memory.peak[tile]):,d} B, the weights and gradient "
            f"accumulators held beside it take {held:,d} B, "
            f"{self._describe_state(chosen, tile)}"
            f"and the stashed activation sets take {int(self.stash[tile]):,d} B ({stashes})")

  def _describe_state(self, chosen: int, tile: int) -> str:
    state = int(self.optimizer_state[chosen, tile])
    if not state:
      return ""
    own = self.programs[chosen][0] if self.programs[chosen][1] == "update" else None
    parts = ", ".join(f"stage {s.index}: {int(_state(s, len(self.program_peak))[tile]):,d} B"
                      for s in self.stages if s.index != own)
    return f"the optimizer state held on chip beside it takes {state:,d} B ({parts}), "

  def state_at(self, tile: int) -> int:
    """Bytes of on-chip optimizer state beside the program peaking on ``tile``."""
    return int(self.optimizer_state[self.chosen[tile], tile])


def _held(stage, num_tiles: int) -> np.ndarray:
  held = getattr(stage, "held_bytes", None)
  return np.zeros(num_tiles, np.int64) if held is None else held


def _state(stage, num_tiles: int) -> np.ndarray:
  state = getattr(stage, "state_bytes", None)
  return np.zeros(num_tiles, np.int64) if state is None else state


def _accumulators(stage, num_tiles: int) -> np.ndarray:
  acc = getattr(stage, "accumulator_bytes", None)
  return np.zeros(num_tiles, np.int64) if acc is None else acc


def ipu_memory(stages: Sequence) -> dict:
  """``{ipu: IPUMemory}`` for the IPUs the stages use (see the module docstring)."""
  out = {}
  for ipu in sorted({s.ipu for s in stages}):
    on_ipu = [s for s in stages if s.ipu == ipu]
    num_tiles = len(on_ipu[0].stash_bytes)
    state = {s.index: _state(s, num_tiles) for s in on_ipu}
    # Weights and accumulators: ``held_bytes`` counts the stage's state too.
    held = {s.index: _held(s, num_tiles) - state[s.index] for s in on_ipu}
    total_held, total_state = sum(held.values()), sum(state.values())
    programs, others, beside = [], [], []
    for s in on_ipu:
      for kind in _PROGRAM_KINDS:
        program = getattr(s, kind)
        if program is None:
          continue
        programs.append((s.index, kind, program))
        # The forward program reads its stage's weights, not their accumulators.
        own = _accumulators(s, num_tiles) if kind == "forward" else 0
        others.append(total_held - held[s.index] + own)
        # Only the update program reads (and so counts) its own stage's state.
        beside.append(total_state - (state[s.index] if kind == "update" else 0))
    others, beside = np.stack(others), np.stack(beside)
    peaks = np.stack([p.profile.memory.peak for _, _, p in programs]) + others + beside
    chosen = np.argmax(peaks, axis=0)
    stash = sum(s.stash_depth * s.stash_bytes for s in on_ipu)
    out[ipu] = IPUMemory(ipu, on_ipu, programs, others, beside, chosen,
                         peaks[chosen, np.arange(num_tiles)], np.asarray(stash, np.int64))
  return out
