"""The search space of a pipeline split: layered models and their candidates.

A *layered model* (:class:`LayeredModel`) is what the split search needs to
know of a model: how to build it with a given number of repeated layers and a
given serialisation factor of its largest matmul, the module path of each
repeated layer, and the module paths of the block before the layers (the
embeddings) and after them (the heads). Its layout is BERT's as Graphcore ran
it: the first block and the first layers on IPU 0, the remaining layers over
the other IPUs, and the last block back on IPU 0 as the last stage -- so a
decoder tied to the embedding sits with it (``device_mapping`` ``[0, 1, ...,
N-1, 0]``, N + 1 stages on N IPUs).

A *candidate* (:class:`Candidate`) is one point of the space
(:class:`SearchSpace`): the layers on each IPU (a composition of the layer
count with IPU 0 allowed none), the available memory proportion of each IPU,
recomputation on or off, and the serialisation factor.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ipu_jax.pipelining.split import PipelineError

__all__ = ["Candidate", "LayeredModel", "SearchSpace", "layer_compositions"]


@dataclasses.dataclass(frozen=True)
class LayeredModel:
  """A model of repeated layers between a first and a last block.

  Attributes:
    build: ``build(num_layers, serialization_factor) -> (loss_fn, params)``;
      ``loss_fn(params, micro_batch)`` (``loss_fn(params, micro_batch, rng)``
      with ``rng``) runs its layers inside named scopes (module paths) so a
      ``stage_assignment`` can place them.
    num_layers: the repeated layers of the full model.
    micro_batch: one micro-batch (a pytree of arrays, leading axis the samples).
    layer_path: ``layer_path(i)`` is the module path of layer ``i``
      (e.g. ``lambda i: f"layers_{i}"``).
    first: module paths of the block before the layers (stage 0, IPU 0).
    last: module paths of the block after them (the last stage, on IPU 0).
    samples_per_micro_batch: samples in ``micro_batch`` (default: its leading size).
    rng: the loss takes a key (dropout): every lowering of the search is a
      ``Pipeline(..., rng=True)``, so the masks' work and memory are in its
      figures, as in the run's own pipeline.
  """

  build: Callable
  num_layers: int
  micro_batch: object
  layer_path: Callable[[int], str]
  first: Tuple[str, ...]
  last: Tuple[str, ...]
  samples_per_micro_batch: Optional[int] = None
  rng: bool = False

  def __post_init__(self):
    if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) \
        or self.num_layers < 1:
      raise PipelineError(f"LayeredModel.num_layers must be an int >= 1; got "
                          f"{self.num_layers!r}.")
    for name in ("first", "last"):
      paths = getattr(self, name)
      if isinstance(paths, str) or not paths or not all(isinstance(p, str) for p in paths):
        raise PipelineError(f"LayeredModel.{name} must be a non-empty sequence of module "
                            f"paths, e.g. ('embeddings',); got {paths!r}.")
      object.__setattr__(self, name, tuple(paths))
    if not isinstance(self.rng, bool):
      raise PipelineError(f"LayeredModel.rng must be True (the loss takes a key: dropout) or "
                          f"False; got {self.rng!r}.")
    samples = self.samples_per_micro_batch
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int)
                                or samples < 1):
      raise PipelineError(f"LayeredModel.samples_per_micro_batch must be an int >= 1 or None "
                          f"(the micro-batch's leading size); got {samples!r}.")

  def samples(self) -> int:
    if self.samples_per_micro_batch is not None:
      return int(self.samples_per_micro_batch)
    import jax
    import numpy as np
    return int(np.shape(jax.tree_util.tree_leaves(self.micro_batch)[0])[0])

  def layout(self, layers_per_ipu: Sequence[int], layer_offset: int = 0):
    """``(stage_assignment, device_mapping)`` for ``layers_per_ipu``.

    Stage k < N holds IPU k's layers (stage 0 also the first block); stage N,
    on IPU 0, holds the last block. ``layer_offset`` numbers the layers from
    there (for probes of a model with fewer layers it stays 0).
    """
    assignment = {path: 0 for path in self.first}
    layer = layer_offset
    for ipu, count in enumerate(layers_per_ipu):
      for _ in range(count):
        assignment[self.layer_path(layer)] = ipu
        layer += 1
    last_stage = len(layers_per_ipu)
    assignment.update({path: last_stage for path in self.last})
    return assignment, list(range(len(layers_per_ipu))) + [0]


def layer_compositions(num_layers: int, num_ipus: int, max_per_ipu: Optional[int] = None,
                       min_first: int = 0) -> list:
  """Every ``layers_per_ipu``: IPU 0 >= ``min_first`` layers, each other IPU >= 1.

  Args:
    num_layers: layers to place.
    num_ipus: IPUs of a replica.
    max_per_ipu: at most this many layers on any IPU (None: no bound).
    min_first: the fewest layers IPU 0 (which also holds the first and
      last blocks) may take.
  """
  top = num_layers if max_per_ipu is None else max_per_ipu
  out = []
  for rest in itertools.product(range(1, top + 1), repeat=num_ipus - 1):
    first = num_layers - sum(rest)
    if min_first <= first <= top:
      out.append((first,) + rest)
  return sorted(out)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """What the split search may choose.

  Attributes:
    proportions: available memory proportions an IPU may take (each IPU its own).
    recomputation: recomputation settings to try (True, False or both).
    serialization: serialisation factors of the largest matmul to try.
    layers_per_ipu: the layer compositions to try; None: all of
      :func:`layer_compositions` (bounded by ``max_layers_per_ipu``).
    max_layers_per_ipu: bound on the layers of any IPU when enumerating.
  """

  proportions: Tuple[float, ...] = (0.15, 0.25, 0.35, 0.45)
  recomputation: Tuple[bool, ...] = (True, False)
  serialization: Tuple[int, ...] = (1,)
  layers_per_ipu: Optional[Tuple[Tuple[int, ...], ...]] = None
  max_layers_per_ipu: Optional[int] = None

  def __post_init__(self):
    for name in ("proportions", "recomputation", "serialization"):
      values = getattr(self, name)
      if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise PipelineError(f"SearchSpace.{name} must be a sequence of values, e.g. "
                            f"{getattr(SearchSpace, name)!r}; got {values!r}.")
      values = tuple(values)
      if not values:
        raise PipelineError(f"SearchSpace.{name} must list at least one value.")
      object.__setattr__(self, name, values)
    for p in self.proportions:
      if (isinstance(p, bool) or not isinstance(p, numbers.Real)
          or not 0.0 < float(p) <= 1.0):
        raise PipelineError(f"SearchSpace.proportions: {p!r} is not a number in (0, 1].")
    for r in self.recomputation:
      if not isinstance(r, (bool, np.bool_)):  # "no" would read as on
        raise PipelineError(f"SearchSpace.recomputation: {r!r} is not True or False.")
    bound = self.max_layers_per_ipu
    if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
      raise PipelineError(f"SearchSpace.max_layers_per_ipu must be an int >= 1 or None; got "
                          f"{bound!r}.")
    for s in self.serialization:
      if isinstance(s, bool) or not isinstance(s, int) or s < 1:
        raise PipelineError(f"SearchSpace.serialization: {s!r} is not an int >= 1.")

  def compositions(self, num_layers: int, num_ipus: int) -> list:
    if self.layers_per_ipu is None:
      return layer_compositions(num_layers, num_ipus, self.max_layers_per_ipu)
    out = []
    for counts in self.layers_per_ipu:
      counts = tuple(int(n) for n in counts)
      if len(counts) != num_ipus or sum(counts) != num_layers or min(counts[1:], default=1) < 1 \
          or counts[0] < 0:
        raise PipelineError(
            f"SearchSpace.layers_per_ipu entry {counts} must give {num_ipus} IPUs "
            f"{num_layers} layers in all, IPU 0 >= 0 and every other IPU >= 1.")
      out.append(counts)
    return out

  def size(self, num_layers: int, num_ipus: int) -> int:
    """Candidates in the space (every IPU's proportion chosen independently)."""
    return (len(self.compositions(num_layers, num_ipus)) * len(self.proportions) ** num_ipus
            * len(self.recomputation) * len(self.serialization))


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One split: the runner's ``layers_per_ipu`` / ``available_memory_proportion`` /
  ``recomputation`` / ``serialization_factor``."""

  layers_per_ipu: Tuple[int, ...]
  proportions: Tuple[float, ...]
  recomputation: bool
  serialization: int

  @property
  def config(self) -> dict:
    """The dict a user pastes (the runner's keys)."""
    return {"layers_per_ipu": list(self.layers_per_ipu),
            "available_memory_proportion": [float(p) for p in self.proportions],
            "recomputation": bool(self.recomputation),
            "serialization_factor": int(self.serialization)}
