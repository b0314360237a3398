"""The training state of a Keras-like ``Model``, as one pytree with named fields.

Like Flax's ``TrainState`` (``flax/training/train_state.py``) it carries the
step, the parameters and the optimizer state, and ``apply_gradients`` makes the
next one; it also carries what the module needs besides its parameters (its
non-trainable state, its random-number state) and the base key of dropout.

Each field says where it lives on the replicas (``placement`` in its
metadata), so the programs and the host loop place, pass and read the state by
name, never by position:

* ``REPLICATED``: the same value on every replica;
* ``SHARDED``: a leading axis of this process's replicas, each row one
  replica's value.

The optimizer state is replicated, or sharded when replicated tensor sharding
is on (``IPUConfig.streaming.replicated_tensor_sharding`` with more than one
replica, :mod:`ipu_jax.keras.offload`): its metadata names that placement as
``sharded_placement``. A pipelined ``fit`` (:mod:`ipu_jax.keras.pipelining`)
trains one optimizer state per pipeline stage, and holds them in the same
field: ``opt_layout`` says which (:data:`MODEL_OPTIMIZER` or
:data:`STAGE_OPTIMIZERS`), and :meth:`TrainState.place` leaves the stages'
states where their update programs keep them (with replicated tensor sharding
each leaf stacked over the replicas, ``[R, ...]``, one shard a row).
Checkpoints (``Model.save_weights(include_optimizer=True)``) save either.

Training changes some fields and only reads others (``trained`` in the
metadata): a training execution returns the trained fields (the loop over
weight updates carries only them), and :meth:`TrainState.merge` puts them back.
A field may be ``None`` (an empty pytree): the optimizer state before
``compile``, or a field a program does not take.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.struct
import optax

from ipu_jax.keras import scopes
from ipu_jax.keras.replication import REPLICATED, SHARDED, Replication

__all__ = ["TrainState", "FIELDS", "TRAINED_FIELDS", "INFERENCE_FIELDS", "MODEL_OPTIMIZER",
           "STAGE_OPTIMIZERS"]

# opt_layout: the optimizer's state of every parameter (``compile``'s, what plain fit trains) ...
MODEL_OPTIMIZER = "model"
# ... or a list with one state per pipeline stage, of the weights the stage owns.
STAGE_OPTIMIZERS = "stages"


def _field(placement: str, trained: bool, sharded_placement: Optional[str] = None):
  return flax.struct.field(default=None, metadata={
      "placement": placement, "sharded_placement": sharded_placement or placement,
      "trained": trained})


@flax.struct.dataclass
class TrainState:
  """What one replica trains with; see the module docstring.

  Attributes:
    params: the trainable parameters (an ``nnx.State`` or a linen params dict).
    opt_state: the optimizer's state (``None`` before ``compile``); one
      replica's shard of it, stacked over replicas on the host, with
      replicated tensor sharding. After a pipelined ``fit``: the list of
      the stages' states (``opt_layout``).
    state: the module's non-trainable variables (batch statistics, ...).
    rng_state: the module's random-number state (NNX ``RngState``); read only.
    step: the weight updates made so far (an int32 scalar).
    dropout_key: the base key of dropout; each micro-batch and replica folds
      in its own indices. Read only.
    opt_layout: how ``opt_state`` is laid out, :data:`MODEL_OPTIMIZER` or
      :data:`STAGE_OPTIMIZERS` (static: not a leaf of the pytree).
  """
  # The order of the fields is the order a program takes them in; its report
  # names their leaves by field and path ("params/hidden1/kernel").
  params: Any = _field(REPLICATED, trained=True)
  opt_state: Any = _field(REPLICATED, trained=True, sharded_placement=SHARDED)
  state: Any = _field(REPLICATED, trained=True)
  rng_state: Any = _field(REPLICATED, trained=False)
  step: Any = _field(REPLICATED, trained=True)
  dropout_key: Any = _field(REPLICATED, trained=False)
  opt_layout: str = flax.struct.field(pytree_node=False, default=MODEL_OPTIMIZER)

  @staticmethod
  def placements(sharded_optimizer_state: bool = False) -> dict:
    """``{field: REPLICATED or SHARDED}``, with or without a sharded optimizer state."""
    key = "sharded_placement" if sharded_optimizer_state else "placement"
    return {f.name: f.metadata[key] for f in _state_fields()}

  def apply_gradients(self, grads, optimizer, **changes) -> "TrainState":
    """One optimizer update from ``grads``; the step counts it.

    Args:
      grads: gradients shaped like ``params`` (already reduced over replicas).
      optimizer: the optax ``GradientTransformation``.
      **changes: other fields of the new state (the module state the step made).
    """
    updates, opt_state = optimizer.update(grads, self.opt_state, self.params)
    with scopes.scope(scopes.APPLY_UPDATES):
      params = optax.apply_updates(self.params, updates)
    return self.replace(params=params, opt_state=opt_state, step=self.step + 1, **changes)

  def only(self, names) -> "TrainState":
    """This state with every field but ``names`` set to ``None``."""
    return self.replace(**{name: None for name in FIELDS if name not in names})

  def merge(self, other: "TrainState") -> "TrainState":
    """This state with the fields ``other`` holds (not ``None``) taken from it."""
    return self.replace(**{name: getattr(other, name) for name in FIELDS
                           if getattr(other, name) is not None})

  def values(self, names) -> list:
    """The fields ``names``, in that order."""
    return [getattr(self, name) for name in names]

  def place(self, replication: Replication, sharded_optimizer_state: bool) -> "TrainState":
    """Every field on the replicas' devices as its placement says (a no-op once there)."""
    placements = self.placements(sharded_optimizer_state)

    def put(name):
      value = getattr(self, name)
      if value is None or (name == "opt_state" and self.opt_layout == STAGE_OPTIMIZERS):
        return value  # the stages' states stay where their update programs keep them
      return (replication.shard(value) if placements[name] == SHARDED
              else replication.replicate(value))

    return self.replace(**{name: put(name) for name in FIELDS})

  def local(self, replication: Optional[Replication]) -> "TrainState":
    """Every field as arrays of this process (usable outside the run)."""
    return self if replication is None else replication.local(self)


def _state_fields() -> list:
  """The fields that hold state (``opt_layout`` only describes one of them)."""
  return [f for f in dataclasses.fields(TrainState) if "placement" in f.metadata]


FIELDS = tuple(f.name for f in _state_fields())
# What a training execution returns (and its loop over updates carries), in order.
TRAINED_FIELDS = tuple(f.name for f in _state_fields() if f.metadata["trained"])
# What evaluation and prediction read.
INFERENCE_FIELDS = ("params", "state", "rng_state")
