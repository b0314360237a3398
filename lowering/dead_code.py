"""Dead-code elimination: what no output needs is neither lowered, costed nor refused.

``jax.make_jaxpr`` keeps every equation a function traced, including those
whose results reach no output: a product computed and dropped, the
``custom_lin`` that ``jax.jvp`` through a ``custom_vjp`` leaves behind.
``jax.jit`` never runs them (XLA removes dead instructions before it
compiles), so neither does ipu-jax: :func:`eliminate_dead_code` runs before
lowering, and a dead equation adds no superstep, no cycles, no memory, and
no "no tile lowering" error.

What stays, whether or not its results are used:

* every equation with an effect JAX does not treat as removable
  (``partial_eval.has_effects``): ``jax.debug.print`` / ``jax.debug.callback``
  (the debug effect), ``ipu_jax.ops.print_tensor`` (the ordered debug
  effect it declares), ``io_callback`` and every other ordered or I/O
  effect, writes to references; and whatever those read;
* the program's signature: every input and every output, in order, so
  argument/output pairings (``offload_argnums``, device state, replicas)
  are untouched. Only equations go.

Removable effects (JAX's ``dceable_effects``: reads of references, named
axes of collectives) do not keep an equation alive, as under ``jax.jit``;
nor does ``jax.pure_callback``, which declares none (``jax.jit`` drops an
unused one too). A dead ``ipu_jax.ops.stochastic_round`` goes as well and
draws no bits from the tiles' generators (the ``floating_point_behaviour``
rewrite runs after this pass, on the live conversions only).

Two passes:

1. JAX's ``dce_jaxpr`` with its rules, which also prune the unused results
   and operands of nested calls (``jit``, ``scan`` carries, ``cond``
   branches, ``custom_jvp``/``custom_vjp`` calls, ``remat``,
   ``shard_map``).
2. Every jaxpr still nested in an equation's parameters (``while``
   bodies and conditions, ``pmap``, ``linear_solve``, and the bodies the
   rules above kept) is pruned the same way with its own signature kept,
   recursively. A jaxpr shared by several equations is pruned once.

:class:`DeadCode` says what was removed, counting the equations of nested
jaxprs the lowering would have visited; the report shows it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from jax.extend import core as jcore

from ipu_jax.lowering.jax_compat import partial_eval

__all__ = ["DeadCode", "eliminate_dead_code", "count_equations"]


@dataclasses.dataclass(frozen=True)
class DeadCode:
  """What dead-code elimination removed from one program.

  Attributes:
    equations: equations removed, those inside removed or pruned nested
      jaxprs included (each equation the lowering would have visited).
    by_primitive: primitive name -> equations of it removed.
  """

  equations: int = 0
  by_primitive: dict = dataclasses.field(default_factory=dict)

  def as_dict(self) -> dict:
    """The ``"dead_code"`` entry of ``report.json``."""
    return {"equations_removed": int(self.equations),
            "by_primitive": {str(k): int(v) for k, v in self.by_primitive.items()}}

  @classmethod
  def total(cls, parts) -> "DeadCode":
    """The sum of several programs' :class:`DeadCode` (a pipeline's stages)."""
    counts = collections.Counter()
    for part in parts:
      counts.update(part.by_primitive)
    return cls(sum(counts.values()),
               dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))))

  @classmethod
  def from_dict(cls, document: dict) -> "DeadCode":
    """Inverse of :meth:`as_dict`."""
    return cls(int(document.get("equations_removed", 0)),
               {str(k): int(v) for k, v in document.get("by_primitive", {}).items()})


def eliminate_dead_code(closed_jaxpr):
  """Removes the equations no output or effect needs.

  Args:
    closed_jaxpr: a ``jax.extend.core.ClosedJaxpr`` (as ``jax.make_jaxpr``
      gives).

  Returns:
    ``(pruned ClosedJaxpr, DeadCode)``. The pruned jaxpr has the same
    inputs, outputs and constants; it is ``closed_jaxpr`` itself when
    nothing was dead.
  """
  pruned = _Pruner().closed(closed_jaxpr)
  before, after = count_equations(closed_jaxpr.jaxpr), count_equations(pruned.jaxpr)
  removed = before - after
  if not sum(removed.values()):
    return closed_jaxpr, DeadCode()
  return pruned, DeadCode.total([DeadCode(0, removed)])


class _Pruner:
  """Signature-keeping DCE of jaxprs, memoised by identity over one program."""

  def __init__(self):
    self._done = {}  # id(jaxpr) -> (jaxpr, pruned); the original is held so ids stay unique

  def closed(self, closed_jaxpr):
    key = id(closed_jaxpr)
    if key not in self._done:
      inner = self.open(closed_jaxpr.jaxpr)
      pruned = (closed_jaxpr if inner is closed_jaxpr.jaxpr
                else jcore.ClosedJaxpr(inner, closed_jaxpr.consts))
      self._done[key] = (closed_jaxpr, pruned)
    return self._done[key][1]

  def open(self, jaxpr):
    key = id(jaxpr)
    if key not in self._done:
      # Every output used, every input kept: the signature does not change.
      pruned, _ = partial_eval.dce_jaxpr(jaxpr, True, instantiate=True)
      eqns = [self._equation(eqn) for eqn in pruned.eqns]
      if len(pruned.eqns) == len(jaxpr.eqns) and all(
          new is old for new, old in zip(eqns, jaxpr.eqns)):
        pruned = jaxpr  # nothing dead here or below: keep the caller's object
      elif any(new is not old for new, old in zip(eqns, pruned.eqns)):
        pruned = pruned.replace(eqns=eqns)
      self._done[key] = (jaxpr, pruned)
    return self._done[key][1]

  def _equation(self, eqn):
    params = {name: _map_jaxprs(value, self.closed, self.open)
              for name, value in eqn.params.items()}
    if all(params[name] is value for name, value in eqn.params.items()):
      return eqn
    return eqn.replace(params=params)


def _map_jaxprs(value, on_closed: Callable, on_open: Callable):
  """``value`` with every (Closed)Jaxpr in it, in tuples and lists too, mapped."""
  if isinstance(value, jcore.ClosedJaxpr):
    return on_closed(value)
  if isinstance(value, jcore.Jaxpr):
    return on_open(value)
  if isinstance(value, (tuple, list)):
    items = [_map_jaxprs(item, on_closed, on_open) for item in value]
    if all(new is old for new, old in zip(items, value)):
      return value
    if hasattr(value, "_fields"):  # a named tuple (linear_solve's jaxprs)
      return type(value)(*items)
    return type(value)(items)
  return value


def _nested_jaxprs(value):
  """The open jaxprs inside a parameter value (tuples and lists searched)."""
  if isinstance(value, jcore.ClosedJaxpr):
    yield value.jaxpr
  elif isinstance(value, jcore.Jaxpr):
    yield value
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _nested_jaxprs(item)


def count_equations(jaxpr, _memo=None) -> collections.Counter:
  """Primitive name -> equations in ``jaxpr`` and the jaxprs nested in it.

  A nested jaxpr counts once per equation holding it, as the lowering
  visits it once per equation.
  """
  memo = {} if _memo is None else _memo
  if id(jaxpr) in memo:
    return memo[id(jaxpr)][1]
  counts = collections.Counter()
  for eqn in jaxpr.eqns:
    counts[eqn.primitive.name] += 1
    for value in eqn.params.values():
      for nested in _nested_jaxprs(value):
        counts.update(count_equations(nested, memo))
  memo[id(jaxpr)] = (jaxpr, counts)
  return counts
