"""``ipu_jax.lowering``: from jaxpr equations to a tile program.

The public face for writing rules::

    from ipu_jax.lowering import register_lowering, RuleContext, Tensor

    @register_lowering(my_primitive)
    def _my_rule(ctx: RuleContext, x: Tensor, **params) -> list[Tensor]:
      ...

A rule gets a :class:`RuleContext` (the equation: primitive, avals, source;
``ctx.module`` is the :class:`LoweringContext` of the whole lowering).
Importing this package registers every built-in rule (``lowering/rules/``).
"""

from ipu_jax.lowering.context import LoweringContext, ModuleContext, RuleContext
from ipu_jax.lowering.lower import lower_closed_jaxpr, lower_jaxpr
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.program import Superstep, Tensor
from ipu_jax.lowering.registry import get_lowering, register_lowering, registered_primitives
from ipu_jax.lowering import rules  # noqa: F401  (registers the built-in rules)

__all__ = [
    "LoweringContext", "ModuleContext", "RuleContext", "Superstep", "Tensor", "TileMapping",
    "get_lowering", "lower_closed_jaxpr", "lower_jaxpr", "register_lowering", "registered_primitives",
]
