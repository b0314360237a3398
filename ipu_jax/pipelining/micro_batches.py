"""What a pipelined step gives each micro-batch besides its data: a random key, held state.

A :class:`~ipu_jax.pipelining.Pipeline` made with

* ``rng=True`` calls ``loss_fn(params, batch, rng)``. ``step(..., rng=key)``
  gives micro-batch ``m`` (``m = r G + k``: replica r's k-th) the key
  :func:`micro_batch_key` ``(key, m) = fold_in(key, m)``, the key plain
  gradient accumulation over the same stacked micro-batches uses when it
  calls the loss with ``micro_batch_key(key, m)``. ``rng`` may instead be a
  pytree already stacked per micro-batch (leading axis ``G R``), e.g. the
  step counters the Keras fit passes so its dropout draws plain ``fit``'s.
* ``mutable=True`` calls ``loss_fn(params, batch, [rng,] state)``, which
  returns ``(loss, new_state)``: state a layer updates in its forward pass
  (batch statistics). ``step(..., state=state)`` returns the new state.
* ``has_aux=True``: the loss returns ``(loss, aux)`` (with ``mutable``:
  ``(loss, (new_state, aux))``); the step returns ``aux`` stacked per
  micro-batch (metrics' sums, predictions).

The key and the state are *free* batch values of the split
(:func:`~ipu_jax.pipelining.split.split_stages`): they carry no stage, so the
equations drawing random bits from a key, or updating a state from a
stage's activations, run on the stage that uses them; each stage reads the
key itself and derives from it what it needs (a key split for several
layers is split again on each of their stages), so the bits are plain
accumulation's and no key crosses an IPU-Link. A
state leaf lives on the one stage that reads and updates it: its forward
passes run micro-batch 0..G-1 in order, each reading the value the previous
one made, as plain accumulation's loop over micro-batches carries it. With R
replicas each starts the step from the same state, and the new state is
their mean (float leaves; other leaves: replica 0's), as the Keras-like
``fit`` averages batch statistics over replicas.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.pipelining.split import PipelineError

__all__ = ["MicroBatchInputs", "StepTaps", "micro_batch_key", "micro_batch_keys", "one_of_stacked"]


def micro_batch_key(key, index):
  """The key of micro-batch ``index`` (over all replicas) of a step with key ``key``."""
  return jax.random.fold_in(key, index)


def micro_batch_keys(key, count: int):
  """``[count]`` keys: :func:`micro_batch_key` of micro-batches ``0..count-1``."""
  return jax.vmap(lambda m: micro_batch_key(key, m))(jnp.arange(count, dtype=jnp.uint32))


def _is_single_key(rng) -> bool:
  """A single PRNG key: typed of shape ``()``, or raw ``uint32[2]``."""
  if not hasattr(rng, "dtype"):
    return False
  if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
    return np.shape(rng) == ()
  return np.shape(rng) == (2,) and rng.dtype == jnp.uint32


@dataclasses.dataclass(frozen=True)
class MicroBatchInputs:
  """Which extra inputs and outputs a pipelined loss function has.

  The split traces ``packed(params, (batch, rng, state))`` (:meth:`wrap`);
  the step stacks ``(batches, rngs, states)`` per micro-batch (:meth:`pack`).
  """

  rng: bool = False
  mutable: bool = False
  has_aux: bool = False

  @property
  def extended(self) -> bool:
    """Whether the loss function is called or returns other than ``(params, batch) -> loss``."""
    return self.rng or self.mutable or self.has_aux

  def wrap(self, loss_fn: Callable) -> Callable:
    """``packed(params, (batch, rng, state)) -> (loss, (new_state, aux))``."""
    if not self.extended:
      return loss_fn
    spec = self

    def packed(params, micro):
      batch, rng, state = micro
      args = (params, batch) + ((rng,) if spec.rng else ()) + ((state,) if spec.mutable else ())
      out = loss_fn(*args)
      if not (spec.mutable or spec.has_aux):
        return out, (None, None)
      if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise PipelineError(f"The pipelined loss function must return {spec._returns()}; it "
                            f"returned {type(out).__name__}.")
      loss, rest = out
      if spec.mutable and spec.has_aux:
        if not isinstance(rest, (tuple, list)) or len(rest) != 2:
          raise PipelineError(f"The pipelined loss function must return {spec._returns()}.")
        new_state, aux = rest
      else:
        new_state, aux = (rest, None) if spec.mutable else (None, rest)
      if spec.mutable:
        _check_same_tree(state, new_state)
      return loss, (new_state, aux)

    return packed

  def _returns(self) -> str:
    return {(True, True): "(loss, (new_state, aux))", (True, False): "(loss, new_state)",
            (False, True): "(loss, aux)"}.get((self.mutable, self.has_aux), "loss")

  def pack(self, batches, rng, state, count: int):
    """``(batches, rngs, states)`` stacked on a leading axis of ``count`` micro-batches.

    Raises:
      PipelineError: a key or state missing where the pipeline needs one, or
        given where it takes none.
    """
    for name, flag, value in (("rng", self.rng, rng), ("state", self.mutable, state)):
      option = "rng=True" if name == "rng" else "mutable=True"
      if flag and value is None:
        raise PipelineError(f"This pipeline was made with {option}: pass {name}=... to the "
                            "step (a PRNG key for rng, the initial state for state).")
      if not flag and value is not None:
        raise PipelineError(f"This pipeline takes no {name}: make it with Pipeline(..., "
                            f"{option}) to pass one.")
    if not self.extended:
      return batches
    rngs = None
    if self.rng:
      rngs = micro_batch_keys(rng, count) if _is_single_key(rng) else rng
    states = None
    if self.mutable:
      states = jax.tree_util.tree_map(
          lambda s: jnp.broadcast_to(jnp.asarray(s)[None], (count,) + np.shape(s)), state)
    return (batches, rngs, states)

  def start_step(self, staged, batches, rng, state, accumulation: int, replicas: int):
    """``(packed micro-batches, the step's StepTaps)``; ``(batches, None)`` for a plain loss."""
    if not self.extended:
      return batches, None
    packed = self.pack(batches, rng, state, accumulation * replicas)
    return packed, StepTaps(self, staged, one_of_stacked(packed),
                            jax.tree_util.tree_leaves(packed), accumulation)

  def free(self, micro) -> tuple:
    """Flat indices of one packed micro-batch's key and state leaves (not infeed)."""
    if not self.extended:
      return ()
    batch, rng, state = micro
    start = len(jax.tree_util.tree_leaves(batch))
    return tuple(range(start, start + len(jax.tree_util.tree_leaves((rng, state)))))

  def state_indices(self, micro) -> list:
    """Flat indices (in one packed micro-batch) of the state's leaves, in order."""
    if not self.mutable:
      return []
    batch, rng, state = micro
    start = len(jax.tree_util.tree_leaves((batch, rng)))
    return list(range(start, start + len(jax.tree_util.tree_leaves(state))))

  def check_owners(self, staged, micro) -> None:
    """Each state leaf is read and updated by one stage, the one holding it.

    Raises:
      PipelineError: naming the state leaf and the stages.
    """
    if not self.mutable:
      return
    paths = [jax.tree_util.keystr(p) or "state"
             for p, _ in jax.tree_util.tree_flatten_with_path(micro[2])[0]]
    for j, i in enumerate(self.state_indices(micro)):
      readers = [s.index for s in staged.stages if i in s.batch]
      source = staged.aux[j]
      writer = source.where if source.kind == "stage" else None
      owners = sorted(set(readers + ([writer] if writer is not None else [])))
      if len(owners) > 1:
        raise PipelineError(
            f"Mutable state {paths[j]} is read by stage(s) {readers} and updated by stage "
            f"{writer}: a state lives on the one stage that reads and updates it (its IPU "
            "holds it between micro-batches). Keep the layer that owns it on one stage.")


def _check_same_tree(state, new_state) -> None:
  if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(new_state):
    raise PipelineError(
        "The pipelined loss function's new state must have the structure of the state it "
        f"was given: got {jax.tree_util.tree_structure(new_state)} for "
        f"{jax.tree_util.tree_structure(state)}.")


def one_of_stacked(stacked):
  """The shapes and dtypes of one micro-batch of ``stacked`` (a pytree of arrays
  stacked on their leading axis).

  They are all the lowering and the step's bookkeeping read: slicing a real
  micro-batch out would run, and first compile, an indexing op per leaf.
  """
  def one(leaf):
    dtype = jax.dtypes.canonicalize_dtype(leaf.dtype, allow_extended_dtype=True)
    return jax.ShapeDtypeStruct(np.shape(leaf)[1:], dtype,
                                weak_type=getattr(leaf, "weak_type", False))
  return jax.tree_util.tree_map(one, stacked)


class StepTaps:
  """One step's state held on its stages and auxiliary outputs collected.

  The run calls :meth:`begin_replica` before each replica's micro-batches,
  :meth:`inputs` for a forward pass's batch values (a state leaf: the value
  its stage holds now) and :meth:`forward` with the pass's outputs;
  :meth:`results` gives ``(new_state, aux)`` of the step.
  """

  def __init__(self, spec: MicroBatchInputs, staged, micro, flat_batches: list,
               accumulation: int):
    self.spec, self.staged, self.g = spec, staged, accumulation
    self.state_index = spec.state_indices(micro)
    self.initial = {i: flat_batches[i][0] for i in self.state_index}
    self.flat_batches = flat_batches
    self.num_state = len(self.state_index)
    self.held: dict = {}
    self.finals: list = []
    self.aux: dict = {}
    self.replica = -1

  def begin_replica(self, replica: int) -> None:
    if self.replica >= 0:
      self.finals.append(dict(self.held))
    self.replica, self.held = replica, dict(self.initial)

  def inputs(self, batch_indices, values: list) -> list:
    """A forward pass's batch values with each state leaf's held value."""
    return [self.held.get(i, v) for i, v in zip(batch_indices, values)]

  def forward(self, stage: int, micro_batch: int, outs: list) -> None:
    """Takes what stage ``stage``'s forward pass of ``micro_batch`` computed."""
    m = self.replica * self.g + micro_batch
    for j, source in enumerate(self.staged.aux):
      if source.kind != "stage" or source.where != stage:
        continue
      if j < self.num_state:
        self.held[self.state_index[j]] = outs[source.position]
      else:
        self.aux[(m, j)] = outs[source.position]

  def _aux_leaf(self, j: int, m: int):
    source = self.staged.aux[j]
    if source.kind == "stage":
      return self.aux[(m, j)]
    if source.kind == "batch":
      return self.flat_batches[source.where][m]
    if source.kind == "param":
      raise PipelineError("An auxiliary output of the pipelined loss is a weight passed "
                          "through unchanged; return values the stages compute.")
    return jnp.asarray(source.where)

  @staticmethod
  def extras(taps: "StepTaps | None") -> tuple:
    """What a step returns after its loss: the new state (``mutable``), then
    the aux (``has_aux``); nothing for a plain loss (``taps`` None)."""
    if taps is None:
      return ()
    new_state, aux = taps.results()
    return (((new_state,) if taps.spec.mutable else ())
            + ((aux,) if taps.spec.has_aux else ()))

  def results(self) -> tuple:
    """``(new_state or None, aux stacked per micro-batch or None)``."""
    finals = self.finals + [self.held]
    new_state = None
    if self.spec.mutable:
      leaves = []
      for i in self.state_index:
        values = [f[i] for f in finals]
        leaves.append(jnp.mean(jnp.stack(values), axis=0).astype(values[0].dtype)
                      if jnp.issubdtype(values[0].dtype, jnp.floating) and len(values) > 1
                      else values[0])
      new_state = jax.tree_util.tree_unflatten(
          self.staged.aux_tree.children()[0], leaves)
    aux = None
    if self.spec.has_aux:
      count = len(finals) * self.g
      leaves = [jnp.stack([self._aux_leaf(j, m) for m in range(count)])
                for j in range(self.num_state, len(self.staged.aux))]
      aux = jax.tree_util.tree_unflatten(self.staged.aux_tree.children()[1], leaves)
    return new_state, aux
