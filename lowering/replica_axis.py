"""The replica axis as a lowered program sees it.

Replicas run as a named axis (``vmap``/``shard_map``/``pmap`` of the training
layer), so whether a collective moves anything, and how many replicas it
spans, is read from JAX's axis environment while tracing. The executor's
collective steps and the user's replica ops (:mod:`ipu_jax.ops.collectives`)
share these helpers.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax import lax

from ipu_jax.lowering.jax_compat import core

__all__ = ["REPLICA_AXIS", "apply_collective", "axis_is_bound", "axis_names", "bound_axes",
           "replica_count", "replica_index_value"]

# The axis name the training layer's replicas are bound to.
REPLICA_AXIS = "replicas"


def axis_names(axis_name) -> tuple:
  """``axis_name`` as a tuple of names (a collective may name several axes)."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_is_bound(axis_name) -> bool:
  """Whether every name in ``axis_name`` is bound by an enclosing transform.

  A name is bound inside ``vmap(..., axis_name=...)``, ``shard_map`` or
  ``pmap`` (while tracing, and while lowering their bodies). JAX raises
  ``NameError('unbound axis name: ...')`` from a collective over a name that
  is not bound; that is the test.
  """
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def replica_count(axis_name) -> Optional[int]:
  """The static size of the bound replica axis, or ``None`` if unbound/unknown."""
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    return None
  try:
    return int(size)
  except Exception:  # a traced size (inside shard_map lowering)
    return None


def bound_axes() -> tuple:
  """The named axes bound around what is being traced, outermost first.

  ``((name, size), ...)`` in the order the enclosing ``vmap``/``shard_map``s
  bound them (sizes static; an axis of unknown size is left out). A program
  lowered under them prices its collectives over the replica groups they
  make, so they are part of every cache key of a lowered program.
  """
  layout = {}
  for name in core.get_axis_env().axis_names():
    size = replica_count(name)
    if size is not None and size > 0:
      layout[name] = size
  return tuple(layout.items())


def apply_collective(kind: str, x, axis_name):
  """``psum``/``pmean`` of ``x`` over ``axis_name`` if bound, else ``x``.

  Used by the impls here and by the tile program's collective steps, which
  run inside the replica ``vmap``/``shard_map`` of the training layer.
  """
  if not axis_is_bound(axis_name):
    return x
  if kind == "sum":
    return lax.psum(x, axis_name)
  return lax.pmean(x, axis_name)


def replica_index_value(axis_name):
  """``lax.axis_index(axis_name)`` if bound, else 0 (one replica)."""
  if not axis_is_bound(axis_name):
    return jnp.zeros((), jnp.int32)
  return lax.axis_index(axis_name).astype(jnp.int32)
