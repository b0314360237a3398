"""The data-parallel collectives over the replica axis.

``cross_replica_sum`` / ``cross_replica_mean`` / ``replica_index`` are
``lax.psum`` / ``pmean`` / ``axis_index`` over the replica axis when it is
bound (vmap, shard_map, pmap), else a single replica.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.lowering.replica_axis import (REPLICA_AXIS, apply_collective, axis_is_bound, axis_names,
                                           replica_count, replica_index_value)
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules.parallel import all_reduce_cost, replication_factor
from ipu_jax.ops.primitive import define_primitive, not_mapped

cross_replica_sum_p = jcore.Primitive("cross_replica_sum")
cross_replica_mean_p = jcore.Primitive("cross_replica_mean")
replica_index_p = jcore.Primitive("replica_index")


def _typeof(x):
  return jax.typeof(x)


def _varying(aval) -> frozenset:
  """Axes an aval varies over (shard_map's check_vma typing; empty otherwise)."""
  mat = getattr(aval, "mat", None)
  return frozenset(getattr(mat, "varying", None) or ())


def _collective_abstract_eval(x, *, axis_name):
  # Under shard_map with check_vma the result no longer varies over the axis.
  mat = getattr(x, "mat", None)
  varying = getattr(mat, "varying", None)
  if varying:
    keep = frozenset(a for a in varying if a not in axis_names(axis_name))
    if keep != varying:
      return x.update(manual_axis_type=mat.update(varying=keep))
  return x


def _make_collective(prim, kind):
  def impl(x, *, axis_name):
    return apply_collective(kind, x, axis_name)

  def transpose(ct, x, *, axis_name):
    lost = _varying(x.aval) - _varying(_typeof(ct))
    lost &= frozenset(axis_names(axis_name))
    if lost:
      # shard_map with check_vma: the op took a varying value to an invariant
      # one, so (as for jax's psum_invariant) the transpose broadcasts the
      # invariant cotangent back to every replica.
      ct = lax.pcast(ct, tuple(lost), to="varying")
      if kind == "mean":
        ct = ct / lax.axis_size(axis_name)
      return (ct,)
    # As jax's psum: the transpose of an all-reduce is an all-reduce.
    return (prim.bind(ct, axis_name=axis_name),)

  def batch(axis_data, vals, dims, *, axis_name):
    (x,), (d,) = vals, dims
    axes = axis_names(axis_name)
    if axis_data.name not in axes:
      if d is not_mapped:
        return prim.bind(x, axis_name=axis_name), not_mapped
      return prim.bind(x, axis_name=axis_name), d
    # The vmapped axis is a replica axis: reduce over it (and over any other
    # named replica axes with the primitive).
    rest = tuple(a for a in axes if a != axis_data.name)
    if d is not_mapped:
      out = x * axis_data.size if kind == "sum" else x
    else:
      out = jnp.sum(x, axis=d) if kind == "sum" else jnp.mean(x, axis=d)
      out = out.astype(x.dtype)
    if rest:
      out = prim.bind(out, axis_name=rest if len(rest) > 1 else rest[0])
    return out, not_mapped

  define_primitive(prim, impl, _collective_abstract_eval, fancy_batch=batch)
  ad.deflinear2(prim, transpose)


_make_collective(cross_replica_sum_p, "sum")
_make_collective(cross_replica_mean_p, "mean")


def _replica_index_abstract_eval(*, axis_name):
  del axis_name
  return jax.core.ShapedArray((), np.dtype(np.int32))


def _replica_index_batch(axis_data, vals, dims, *, axis_name):
  del vals, dims
  axes = axis_names(axis_name)
  if axis_data.name not in axes:
    return replica_index_p.bind(axis_name=axis_name), not_mapped
  return lax.iota(np.int32, axis_data.size), 0


define_primitive(replica_index_p, lambda *, axis_name: replica_index_value(axis_name),
                 _replica_index_abstract_eval, fancy_batch=_replica_index_batch)


def _check_collective_operand(x, what):
  x = jnp.asarray(x)
  if not (jnp.issubdtype(x.dtype, jnp.number)):
    raise TypeError(f"{what} needs a numeric array, got {x.dtype}.")
  return x


def cross_replica_sum(x, axis_name=REPLICA_AXIS):
  """Sum ``x`` over the replicas (Poplar's ``crossReplicaSum``).

  Inside ``jax.vmap(..., axis_name=axis_name)``, ``shard_map`` or ``pmap``
  over ``axis_name`` this is ``lax.psum(x, axis_name)``; outside any of them
  there is a single replica and it is the identity. On tiles it is costed as
  a ring all-reduce over the IPU-Links.

  Args:
    x: an array (a pytree of arrays is summed leaf by leaf).
    axis_name: the replica axis name (or a tuple of names).
  """
  def one(leaf):
    leaf = _check_collective_operand(leaf, "cross_replica_sum")
    if leaf.dtype == jnp.bool_:
      raise TypeError("cross_replica_sum of booleans: cast to an integer type first.")
    return cross_replica_sum_p.bind(leaf, axis_name=axis_name)
  return jax.tree_util.tree_map(one, x)


def cross_replica_mean(x, axis_name=REPLICA_AXIS):
  """Mean of ``x`` over the replicas (``lax.pmean``; identity for one replica).

  Args:
    x: a floating point array (or pytree of them).
    axis_name: the replica axis name (or a tuple of names).
  """
  def one(leaf):
    leaf = _check_collective_operand(leaf, "cross_replica_mean")
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(f"cross_replica_mean needs a floating point array, got {leaf.dtype}.")
    return cross_replica_mean_p.bind(leaf, axis_name=axis_name)
  return jax.tree_util.tree_map(one, x)


def replica_index(axis_name=REPLICA_AXIS):
  """This replica's index (int32 scalar): ``lax.axis_index``, or 0 unreplicated."""
  return replica_index_p.bind(axis_name=axis_name)


# ---------------------------------------------------------------------------
# Tile rules. cross_replica_sum/mean: an all-reduce over the IPU-Links
# (ipu_jax.lowering.rules.parallel's ring model) with the sum on the tiles;
# replica_index: one vertex writes the index.
# ---------------------------------------------------------------------------


def _make_cross_replica_rule(kind):
  def rule(ctx: RuleContext, x, *, axis_name):
    out = ctx.like(x, name=f"cross_replica_{kind}")
    replicas = replication_factor(ctx, axis_name)
    exchange, compute = all_reduce_cost(ctx, x, replicas, axis_name=axis_name)

    def fn(xs):
      # Zero padding of the storage stays zero under sum and mean.
      return (apply_collective(kind, xs, axis_name),)

    elements = x.mapping.elements_per_tile(ctx.target.num_tiles)
    ctx.emit(P.Superstep(
        name=f"all_reduce<{kind}>x{replicas}", op=ctx.op, reads=(x,), writes=(out,), fn=fn,
        compute_cycles=compute, exchange=exchange,
        vertices=worker_vertices(ctx, elements) if compute is not None else None,
        codelets=(vocab.vertex(vocab.REDUCE, "add"),) if compute is not None else (),
        flops=int(x.size * (replicas - 1)) if np.issubdtype(x.dtype, np.inexact) else 0))
    return [out]
  return rule


register_lowering(cross_replica_sum_p, _make_cross_replica_rule("sum"))
register_lowering(cross_replica_mean_p, _make_cross_replica_rule("mean"))


@register_lowering(replica_index_p)
def _replica_index_rule(ctx: RuleContext, *, axis_name):
  out = ctx.new_tensor((), np.int32, name="replica_index")
  elements = out.mapping.elements_per_tile(ctx.target.num_tiles)

  def fn():
    return (storage(replica_index_value(axis_name), out),)

  ctx.emit(P.Superstep(
      name="replica_index", op=ctx.op, reads=(), writes=(out,), fn=fn,
      compute_cycles=estimators.fill_cycles(ctx.target, elements, 4),
      vertices=(elements > 0).astype(np.int64), codelets=(vocab.REPLICA_INDEX,)))
  return [out]
