"""Reduce-scatter and all-gather over the replicas, for replicated tensor sharding.

``cross_replica_reduce_scatter(x, replicas)`` sums a ``[replicas * n]`` vector
over the replicas and gives replica ``r`` elements ``[r * n, (r + 1) * n)``
of the sum; ``cross_replica_all_gather(x, replicas)`` concatenates every
replica's ``[n]`` vector in replica order. Inside the replica ``vmap`` /
``shard_map`` they are ``lax.psum_scatter(..., tiled=True)`` and
``lax.all_gather(..., tiled=True)``. Unlike ``lax``'s, they can be traced for
one replica's program with no axis bound (the training layer lowers that
program once): the replica count is a parameter, so shapes are known.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ipu_jax.ops.primitive import define_primitive, not_mapped
from ipu_jax.ops.collectives import REPLICA_AXIS, axis_is_bound
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.builders import add_costs
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules.parallel import (block_positions, emit_collective,
                                             move_cost, one_phase, collective_cost)

__all__ = ["cross_replica_reduce_scatter", "cross_replica_all_gather",
           "cross_replica_reduce_scatter_p", "cross_replica_all_gather_p"]

cross_replica_reduce_scatter_p = jcore.Primitive("cross_replica_reduce_scatter")
cross_replica_all_gather_p = jcore.Primitive("cross_replica_all_gather")


def _replica_impl(prim, collective):
  """The implementation of ``prim``: ``collective(x, axis_name)`` across the
  replicas, the identity for one replica."""

  def impl(x, *, axis_name, replicas):
    if replicas == 1:
      return x
    if not axis_is_bound(axis_name):
      raise NameError(
          f"{prim.name} over {replicas} replicas needs the replica axis {axis_name!r} "
          "bound (run it inside the replicas' vmap/shard_map, as the training layer does).")
    return collective(x, axis_name)

  return impl


_scatter_impl = _replica_impl(
    cross_replica_reduce_scatter_p,
    lambda x, axis_name: lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True))
_gather_impl = _replica_impl(
    cross_replica_all_gather_p,
    lambda x, axis_name: lax.all_gather(x, axis_name, axis=0, tiled=True))


def _scatter_abstract(x, *, axis_name, replicas):
  del axis_name
  return jax.core.ShapedArray((x.shape[0] // replicas,), x.dtype)


def _gather_abstract(x, *, axis_name, replicas):
  del axis_name
  return jax.core.ShapedArray((x.shape[0] * replicas,), x.dtype)


def _other_axis(prim, x, d, axis_name, replicas):
  if d is not not_mapped:
    raise NotImplementedError(
        f"{prim.name} batched over an axis other than the replica axis {axis_name!r}")
  return prim.bind(x, axis_name=axis_name, replicas=replicas), not_mapped


def _scatter_batch(axis_data, vals, dims, *, axis_name, replicas):
  (x,), (d,) = vals, dims
  if axis_data.name != axis_name:
    return _other_axis(cross_replica_reduce_scatter_p, x, d, axis_name, replicas)
  # The vmapped axis is the replica axis: replica r gets block r of the sum.
  total = x * axis_data.size if d is not_mapped else jnp.sum(x, axis=d).astype(x.dtype)
  return jnp.reshape(total, (replicas, -1)), 0


def _gather_batch(axis_data, vals, dims, *, axis_name, replicas):
  (x,), (d,) = vals, dims
  if axis_data.name != axis_name:
    return _other_axis(cross_replica_all_gather_p, x, d, axis_name, replicas)
  if d is not_mapped:
    return jnp.tile(x, replicas), not_mapped
  return jnp.reshape(jnp.moveaxis(x, d, 0), (-1,)), not_mapped


define_primitive(cross_replica_reduce_scatter_p, _scatter_impl, _scatter_abstract,
                 fancy_batch=_scatter_batch)
define_primitive(cross_replica_all_gather_p, _gather_impl, _gather_abstract,
                 fancy_batch=_gather_batch)


def _check(x, replicas, what):
  x = jnp.asarray(x)
  if x.ndim != 1:
    raise ValueError(f"{what} takes a vector, got shape {x.shape}.")
  if isinstance(replicas, bool) or not isinstance(replicas, (int, np.integer)) or replicas < 1:
    raise ValueError(f"{what}: replicas must be a positive int, got {replicas!r}.")
  return x


def cross_replica_reduce_scatter(x, replicas: int, axis_name=REPLICA_AXIS):
  """Block ``r`` of the sum over replicas of ``x`` (``[replicas * n] -> [n]``).

  Raises:
    ValueError: ``x`` is not a vector of a multiple of ``replicas`` elements.
  """
  x = _check(x, replicas, "cross_replica_reduce_scatter")
  if x.shape[0] % replicas:
    raise ValueError(f"cross_replica_reduce_scatter: {x.shape[0]} elements are not a "
                     f"multiple of replicas={replicas}; pad the vector first.")
  return cross_replica_reduce_scatter_p.bind(x, axis_name=axis_name, replicas=int(replicas))


def cross_replica_all_gather(x, replicas: int, axis_name=REPLICA_AXIS):
  """Every replica's ``x`` concatenated in replica order (``[n] -> [replicas * n]``)."""
  x = _check(x, replicas, "cross_replica_all_gather")
  return cross_replica_all_gather_p.bind(x, axis_name=axis_name, replicas=int(replicas))


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile rules of the replicated-tensor-sharding collectives.
#
# ``ipu_jax.ops.cross_replica_reduce_scatter`` and ``cross_replica_all_gather``
# are the two phases of a ring all-reduce, costed apart (see
# ``lowering/rules/parallel.py`` for the ring model):
#
# * **reduce-scatter** of a ``[R * n]`` vector: every tile sends and receives
#   ``(R - 1) / R`` of the bytes it holds over the IPU-Links and adds what it
#   receives (``poplin::ReduceAdd``, the vertex that adds a matmul's partials:
#   a tile running both holds its code once); the replica's reduced block then
#   moves to the ``[n]`` result's tiles (an on-IPU exchange).
# * **all-gather** of an ``[n]`` vector into ``[R * n]``: the replica's own block
#   is copied on its IPU, the other ``R - 1`` blocks arrive over the links:
#   ``(R - 1) / R`` of the gathered bytes per tile.
#
# Together they move what one all-reduce moves; replicated tensor sharding gains
# memory and update work, not link traffic.


@register_lowering(cross_replica_reduce_scatter_p)
def _reduce_scatter_rule(ctx: RuleContext, x, *, axis_name, replicas):
  n = x.size // replicas
  out = ctx.new_tensor((n,), x.dtype, name="reduce_scatter")
  exchange, compute = collective_cost(ctx, x, one_phase(replicas), replicas,
                                      kind="reduce_scatter", axis_name=axis_name)
  # Costed for replica 0's block; every replica's is the same size.
  own = block_positions(x.shape, (n,))
  exchange = add_costs(exchange, move_cost(ctx, x, own, out, None))

  def fn(v):
    return _scatter_impl(v, axis_name=axis_name, replicas=replicas)

  emit_collective(ctx, f"reduce_scatter x{replicas}", x, out, fn, exchange, compute,
                  vocab.vertex(vocab.REDUCE_ADD, x.dtype, x.dtype))
  return [out]


@register_lowering(cross_replica_all_gather_p)
def _all_gather_rule(ctx: RuleContext, x, *, axis_name, replicas):
  out = ctx.new_tensor((x.size * replicas,), x.dtype, name="all_gather")
  own = block_positions(out.shape, (x.size,))
  exchange, _ = collective_cost(ctx, out, one_phase(replicas), kind="all_gather",
                                replicas=replicas, axis_name=axis_name)
  exchange = add_costs(exchange, move_cost(ctx, x, None, out, own))

  def fn(v):
    return _gather_impl(v, axis_name=axis_name, replicas=replicas)

  emit_collective(ctx, f"all_gather x{replicas}", x, out, fn, exchange)
  return [out]
