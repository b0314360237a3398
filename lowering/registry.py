"""The rule table: one lowering rule per JAX primitive.

Registered the way ``jax.interpreters.mlir.register_lowering`` registers MLIR
lowerings::

    from ipu_jax.lowering import register_lowering

    @register_lowering(my_primitive)
    def _my_rule(ctx, *operands, **params):
      ...  # emit supersteps with ctx, return the output tensors

A rule receives the :class:`~ipu_jax.lowering.context.LoweringContext`, one
:class:`~ipu_jax.lowering.program.Tensor` per operand and the equation's
params, and returns a list of output tensors (one per output of the
equation).
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["register_lowering", "get_lowering", "registered_primitives"]

_RULES: dict = {}


def _key(primitive) -> str:
  return primitive if isinstance(primitive, str) else primitive.name


def register_lowering(primitive, rule: Optional[Callable] = None):
  """Register ``rule`` as the tile lowering of ``primitive``.

  Args:
    primitive: a ``jax.extend.core.Primitive`` (or its name).
    rule: ``rule(ctx, *tensors, **params) -> list[Tensor]``. When omitted,
      returns a decorator.
  """
  if rule is None:
    def decorator(fn):
      _RULES[_key(primitive)] = fn
      return fn
    return decorator
  _RULES[_key(primitive)] = rule
  return rule


def get_lowering(primitive) -> Optional[Callable]:
  _load_builtin_rules()
  return _RULES.get(_key(primitive))


def registered_primitives() -> list:
  _load_builtin_rules()
  return sorted(_RULES)


_loaded = False


def _load_builtin_rules():
  global _loaded
  if not _loaded:
    _loaded = True
    from ipu_jax.lowering import rules  # noqa: F401  (registers on import)
