"""A model cut into phases: :class:`Phase`, :class:`PhasedModel`.

A phase is a function of its weights and the previous phase's output
(``apply(params, x) -> y``); the last phase also takes the batch's extras
(labels) and returns the micro-batch's scalar loss. Phases whose ``apply``
is the same function and whose weights and inputs have the same shapes (the
decoder layers of a transformer) are one *kind*: they share one lowered
forward and one lowered backward program, so the cost of lowering does not
grow with the number of layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Phase", "PhasedModel"]


@dataclasses.dataclass(frozen=True)
class Phase:
  """One phase: a name, its function and its weights (a pytree of arrays).

  Attributes:
    name: the phase's name (in errors and reports).
    apply: ``apply(params, x, *extras) -> y``; extras are passed to the
      last phase only, which returns a scalar loss.
    params: the phase's weights (arrays or ``jax.ShapeDtypeStruct`` for an
      estimate from shapes).
  """

  name: str
  apply: Callable
  params: Any


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def _signature(tree) -> tuple:
  leaves, treedef = jax.tree.flatten(_abstract(tree))
  return (treedef, tuple((tuple(a.shape), np.dtype(a.dtype).name) for a in leaves))


def _chain(layers: Sequence[Phase]) -> Callable:
  """One apply running ``layers`` in order (the extras go to the last)."""
  applies = tuple(layer.apply for layer in layers)

  def apply(params, x, *extras):
    for k, fn in enumerate(applies):
      x = fn(params[k], x, *(extras if k == len(applies) - 1 else ()))
    return x
  return apply


class PhasedModel:
  """Phases in execution order, grouped into kinds that share programs.

  Args:
    phases: the :class:`Phase` list, first to last; at least two (the last
      returns the loss).

  Raises:
    ValueError: fewer than two phases, or two phases with one name.
  """

  def __init__(self, phases: Sequence[Phase]):
    phases = list(phases)
    wrong = [type(p).__name__ for p in phases if not isinstance(p, Phase)]
    if wrong:
      raise TypeError(f"PhasedModel takes Phase(name, apply, params) objects; got {wrong}.")
    if len(phases) < 2:
      raise ValueError(f"PhasedModel needs at least 2 phases (the last returns the loss), "
                       f"got {len(phases)}.")
    names = [p.name for p in phases]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
      raise ValueError(f"PhasedModel: phase names must be unique; repeated: {repeated}.")
    self.phases = phases

  @classmethod
  def from_layers(cls, layers: Mapping[str, Phase], assignment: Sequence[Sequence[str]],
                  names: Sequence[str] | None = None) -> "PhasedModel":
    """Phases made of named layers, ``assignment[k]`` the layers of phase k.

    Args:
      layers: ordered ``{layer name: Phase}`` (each layer's apply and weights).
      assignment: per phase, the names of its layers in order.
      names: the phases' names (default ``"phase<k>"``).

    Raises:
      ValueError: a layer left out, an unknown layer name, a layer in two
        phases, or layers out of the model's order.
    """
    order = list(layers)
    placed = [n for group in assignment for n in group]
    unknown = [n for n in placed if n not in layers]
    if unknown:
      raise ValueError(f"PhasedModel phase assignment names unknown layer(s) {unknown}; "
                       f"the model's layers are {order}.")
    missing = [n for n in order if n not in placed]
    if missing:
      raise ValueError(f"PhasedModel phase assignment leaves layer(s) {missing} out; every "
                       f"layer of {order} must be in exactly one phase.")
    twice = sorted({n for n in placed if placed.count(n) > 1})
    if twice:
      raise ValueError(f"PhasedModel phase assignment puts layer(s) {twice} in more than "
                       "one phase.")
    if placed != order:
      raise ValueError(f"PhasedModel phase assignment {placed} does not keep the model's "
                       f"layer order {order}.")
    if any(not group for group in assignment):
      raise ValueError("PhasedModel phase assignment has an empty phase.")
    names = list(names) if names is not None else [f"phase{k}" for k in range(len(assignment))]
    phases = []
    for name, group in zip(names, assignment):
      members = [layers[n] for n in group]
      if len(members) == 1:
        phases.append(Phase(name, members[0].apply, members[0].params))
      else:
        phases.append(Phase(name, _chain(members), [m.params for m in members]))
    return cls(phases)

  def __len__(self) -> int:
    return len(self.phases)

  def input_avals(self, x, *extras) -> list:
    """Each phase's input shape for micro-batch ``x`` (abstract; nothing runs).

    Raises:
      ValueError: the last phase does not return a floating-point scalar loss
        (a vector would be trained as its sum by nobody's intent; an integer
        has no gradient, so the weights would not move).
    """
    avals = [_abstract(x)]
    for phase in self.phases[:-1]:
      avals.append(jax.eval_shape(phase.apply, _abstract(phase.params), avals[-1]))
    last = self.phases[-1]
    loss = jax.eval_shape(last.apply, _abstract(last.params), avals[-1],
                          *(_abstract(e) for e in extras))
    if (not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ()
        or not jnp.issubdtype(loss.dtype, jnp.floating)):
      got = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", loss)
      raise ValueError(f"PhasedModel: the last phase ({last.name!r}) must return the "
                       f"micro-batch's loss as a floating-point scalar; it returned {got}.")
    return avals

  def kinds(self, x, *extras) -> list[int]:
    """Kind index of each phase: equal apply, weight shapes, input shape and role."""
    avals = self.input_avals(x, *extras)
    keys, kinds = {}, []
    for k, (phase, aval) in enumerate(zip(self.phases, avals)):
      role = "first" if k == 0 else ("last" if k == len(self.phases) - 1 else "middle")
      key = (role, phase.apply, _signature(phase.params), _signature(aval))
      kinds.append(keys.setdefault(key, len(keys)))
    return kinds
