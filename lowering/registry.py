"""The rule table: one lowering rule per JAX primitive.

Rules are keyed by the ``Primitive`` object itself, as
``jax.interpreters.mlir.register_lowering`` keys MLIR lowerings, so a user's
primitive that happens to share a name with a built-in (``"add"``) has a rule
of its own::

    from ipu_jax.lowering import register_lowering

    @register_lowering(my_primitive)
    def _my_rule(ctx, *operands, **params):
      ...  # emit supersteps with ctx, return the output tensors

A rule receives a :class:`~ipu_jax.lowering.context.RuleContext` (the
equation's primitive, avals, source line and the module context), one
:class:`~ipu_jax.lowering.program.Tensor` per operand and the equation's
params, and returns a list of output tensors (one per output of the
equation). The built-in rules are registered when ``ipu_jax.lowering`` is
imported.
"""

from __future__ import annotations

from typing import Callable, Optional

from jax.extend import core as jcore

__all__ = ["register_lowering", "get_lowering", "registered_primitives", "reads_broadcast",
           "register_view", "get_view"]

_RULES: dict = {}
# Primitives whose rule reads an operand with size-1 axes broadcast in place.
_BROADCAST_READERS: set = set()
# Primitive -> view(operand, **params): its one-operand result as a view of the
# operand with size-1 axes, for readers that all read broadcast (lower.py).
_VIEWS: dict = {}


def _check_primitive(primitive) -> None:
  if not isinstance(primitive, jcore.Primitive):
    raise TypeError(
        f"register_lowering takes a jax.extend.core.Primitive (e.g. jax.lax.add_p or "
        f"your own Primitive object), got {type(primitive).__name__}: {primitive!r}")


def register_lowering(primitive, rule: Optional[Callable] = None, *, override: bool = False,
                      reads_broadcast: bool = False):
  """Register ``rule`` as the tile lowering of ``primitive``.

  Args:
    primitive: a ``jax.extend.core.Primitive``.
    rule: ``rule(ctx, *tensors, **params) -> list[Tensor]``. When omitted,
      returns a decorator.
    override: replace a rule ``primitive`` already has (otherwise that is an
      error, so two rules never silently compete).
    reads_broadcast: the rule reads any operand whose tensor has size-1 axes
      where the equation's operand has the result's sizes (``f32[64, 1]``
      for ``f32[64, 96]``) broadcast, in place, as
      ``ipu_jax.lowering.builders.elementwise`` does. A
      ``broadcast_in_dim`` read only by such rules is then lowered as a
      view of its operand, never a full-size copy (``lowering/lower.py``).

  Returns:
    ``rule`` (or the decorator).

  Raises:
    TypeError: ``primitive`` is not a ``Primitive``.
    ValueError: ``primitive`` already has a rule and ``override`` is False.
  """
  _check_primitive(primitive)

  def register(fn):
    existing = _RULES.get(primitive)
    if existing is not None and existing is not fn and not override:
      where = getattr(existing, "__module__", "?")
      raise ValueError(
          f"Primitive '{primitive.name}' already has a tile lowering "
          f"({where}.{getattr(existing, '__qualname__', existing)}); pass override=True to "
          f"replace it.")
    _RULES[primitive] = fn
    if reads_broadcast:
      _BROADCAST_READERS.add(primitive)
    else:
      _BROADCAST_READERS.discard(primitive)
    return fn

  return register if rule is None else register(rule)


def get_lowering(primitive) -> Optional[Callable]:
  """The rule registered for ``primitive`` (a ``Primitive``), or None."""
  return _RULES.get(primitive)


def reads_broadcast(primitive) -> bool:
  """Whether ``primitive``'s rule reads operands with size-1 axes broadcast
  (registered with ``reads_broadcast=True``)."""
  return primitive in _BROADCAST_READERS


def register_view(primitive, view: Callable) -> None:
  """Let ``primitive``'s result be lowered as a view when every reader's rule
  reads broadcast (:func:`reads_broadcast`) and it is not an output.

  ``view(operand, **params)`` returns the one operand seen with the result's
  rank and size 1 on the axes it would fill (no step, no storage of its own);
  ``lowering/lower.py`` binds it instead of running the rule.

  Raises:
    TypeError: ``primitive`` is not a ``Primitive``.
  """
  _check_primitive(primitive)
  _VIEWS[primitive] = view


def get_view(primitive) -> Optional[Callable]:
  """The view function registered for ``primitive``, or None."""
  return _VIEWS.get(primitive)


def registered_primitives() -> list:
  """Every primitive with a tile lowering, sorted by name."""
  return sorted(_RULES, key=lambda p: p.name)
