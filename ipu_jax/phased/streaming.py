"""Bytes each phase moves to and from Streaming Memory, and what it holds there.

Per IPU, per step, for a phase of weights ``W`` and optimizer state ``O``
(leaves of at least ``ipu_jax.offload.MIN_OFFLOAD_BYTES``, as the offload
pass keeps smaller ones on the tiles; with RTS each IPU holds one ``dp``-th
of each, padded as :func:`ipu_jax.sharded_optimizer.shard_length` pads) and
G micro-batches of input ``x`` and output ``y``:

* forward phase: loads ``W`` (remote weights) and ``G x`` (its stored input;
  the first phase's input is the step's data, from the host); stores ``G y``.
* backward phase: loads ``W``, ``O``, ``G x`` (to recompute its forward) and
  ``G y`` (the gradient of its output; the last phase starts from its loss);
  stores the updated ``W`` and ``O`` and ``G x`` (the gradient of its input,
  except the first phase's).

Activations are counted only when ``remote_activations``; weights and
optimizer state only when they are remote. A transfer of ``b`` bytes on one
IPU costs ``b / IPUTarget.streaming_bytes_per_cycle`` cycles -- the gateway
term of ``lowering/remote.py``'s ``RemoteCopy`` (one IPU's tiles share its
gateway link; the bandwidth is the target's ``streaming_memory_bytes_per_second``,
an estimate with its source in ``kernels/target.py``) -- and each direction of
a phase opens with one host sync (``IPUTarget.sync_cycles_host``, as a
``RemoteCopy`` does).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ipu_jax.offload import MIN_OFFLOAD_BYTES
from ipu_jax.sharded_optimizer import is_sharded_leaf, shard_length

__all__ = ["PhaseShapes", "PhaseTraffic", "remote_bytes", "phase_traffic", "transfer_cycles",
           "streaming_memory_per_group"]


def remote_bytes(tree, replicas: int = 1, rts: bool = False) -> int:
  """Bytes of ``tree``'s streamed leaves on one IPU (RTS: its ``1/replicas`` shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    size, itemsize = int(np.prod(np.shape(leaf))), np.dtype(leaf.dtype).itemsize
    if rts and is_sharded_leaf(leaf):
      nbytes = shard_length(size, replicas) * itemsize
    else:
      nbytes = size * itemsize
    if nbytes >= MIN_OFFLOAD_BYTES:
      total += nbytes
  return total


def _bytes(aval) -> int:
  return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                 for a in jax.tree.leaves(aval)))


@dataclasses.dataclass(frozen=True)
class PhaseShapes:
  """What a phase holds and passes, per IPU: the inputs of the byte counts.

  Attributes:
    name: the phase's name.
    index: its position in the model.
    kind: its kind (programs shared by phases of one kind).
    weight_bytes, optimizer_bytes: streamed bytes on one IPU (RTS applied).
    input_bytes, output_bytes: one micro-batch's input and output bytes on
      one IPU (``1/tp`` of them with ``PhasedLayout.rts_activations``).
  """

  name: str
  index: int
  kind: int
  weight_bytes: int
  optimizer_bytes: int
  input_bytes: int
  output_bytes: int

  @classmethod
  def of(cls, name, index, kind, params, opt_state, x, y, layout) -> "PhaseShapes":
    dp, rts = layout.dp, layout.rts
    # RTS on activations: each IPU of the TP group stores 1/tp of them.
    share = layout.tp if layout.rts_activations else 1
    return cls(name, index, kind,
               remote_bytes(params, dp, rts) if layout.remote_weights else 0,
               remote_bytes(opt_state, dp, rts) if layout.remote_optimizer_state else 0,
               -(-_bytes(x) // share), -(-_bytes(y) // share))


@dataclasses.dataclass(frozen=True)
class PhaseTraffic:
  """One execution of a phase (forward or backward): bytes per IPU per step."""

  name: str
  index: int
  kind: int
  direction: str
  group: int
  weights_load: int = 0
  weights_store: int = 0
  optimizer_load: int = 0
  optimizer_store: int = 0
  activations_load: int = 0
  activations_store: int = 0

  @property
  def load_bytes(self) -> int:
    return self.weights_load + self.optimizer_load + self.activations_load

  @property
  def store_bytes(self) -> int:
    return self.weights_store + self.optimizer_store + self.activations_store

  @property
  def streaming_bytes(self) -> int:
    return self.load_bytes + self.store_bytes


def phase_traffic(shapes: list, layout) -> list:
  """Every phase execution of one step in order: forwards, then backwards.

  Args:
    shapes: :class:`PhaseShapes` of each phase, first to last.
    layout: the :class:`~ipu_jax.phased.PhasedLayout`.
  """
  g, acts, last = layout.batch_serialisation, layout.remote_activations, len(shapes) - 1
  act = (lambda n: g * n) if acts else (lambda n: 0)  # noqa: E731
  rows = []
  for s in shapes[:-1]:
    rows.append(PhaseTraffic(
        s.name, s.index, s.kind, "forward", layout.group_of(s.index),
        weights_load=s.weight_bytes,
        activations_load=act(s.input_bytes) if s.index > 0 else 0,
        activations_store=act(s.output_bytes)))
  for s in reversed(shapes):
    rows.append(PhaseTraffic(
        s.name, s.index, s.kind, "backward", layout.group_of(s.index),
        weights_load=s.weight_bytes, weights_store=s.weight_bytes,
        optimizer_load=s.optimizer_bytes, optimizer_store=s.optimizer_bytes,
        activations_load=(act(s.input_bytes) if s.index > 0 else 0)
        + (act(s.output_bytes) if s.index < last else 0),
        activations_store=act(s.input_bytes) if s.index > 0 else 0))
  return rows


def transfer_cycles(nbytes: float, target) -> float:
  """Cycles one IPU's ``nbytes`` take over its gateway link (``RemoteCopy``'s gateway term)."""
  return float(nbytes) / target.streaming_bytes_per_cycle


def streaming_memory_per_group(shapes: list, layout) -> np.ndarray:
  """Streaming Memory one IPU of each group holds at its peak: ``[groups]`` bytes.

  Each phase's weights and optimizer state, on the group that runs it; the
  stored activations of every micro-batch (each phase's input, kept from its
  forward to its backward) and the largest gradient passed between backward
  phases, on the group of the phase that reads them.
  """
  held = np.zeros(layout.groups, np.int64)
  g = layout.batch_serialisation
  for s in shapes:
    group = layout.group_of(s.index)
    held[group] += s.weight_bytes + s.optimizer_bytes
    if layout.remote_activations and s.index > 0:
      held[group] += g * s.input_bytes
  if layout.remote_activations:
    largest = max((g * s.output_bytes for s in shapes[:-1]), default=0)
    held += largest
  return held
