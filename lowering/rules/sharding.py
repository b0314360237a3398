"""Tile rules of the replicated-tensor-sharding collectives.

``ipu_jax.ops.cross_replica_reduce_scatter`` and ``cross_replica_all_gather``
are the two phases of a ring all-reduce, costed apart (see
``lowering/rules/parallel.py`` for the ring model):

* **reduce-scatter** of a ``[R * n]`` vector: every tile sends and receives
  ``(R - 1) / R`` of the bytes it holds over the IPU-Links and adds what it
  receives (``poplin::ReduceAdd``, the vertex that adds a matmul's partials:
  a tile running both holds its code once); the replica's reduced block then
  moves to the ``[n]`` result's tiles (an on-IPU exchange).
* **all-gather** of an ``[n]`` vector into ``[R * n]``: the replica's own block
  is copied on its IPU, the other ``R - 1`` blocks arrive over the links:
  ``(R - 1) / R`` of the gathered bytes per tile.

Together they move what one all-reduce moves; replicated tensor sharding gains
memory and update work, not link traffic.
"""

from __future__ import annotations

from ipu_jax import ops
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.builders import add_costs
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules.parallel import (_block_positions, _emit_collective,
                                             _move_cost, _one_phase, collective_cost)
from ipu_jax.ops.sharded_collectives import _gather_impl, _scatter_impl


@register_lowering(ops.cross_replica_reduce_scatter_p)
def _reduce_scatter_rule(ctx, x, *, axis_name, replicas):
  n = x.size // replicas
  out = ctx.new_tensor((n,), x.dtype, name="reduce_scatter")
  exchange, compute = collective_cost(ctx, x, _one_phase(replicas), replicas)
  # Costed for replica 0's block; every replica's is the same size.
  own = _block_positions(x.shape, (n,))
  exchange = add_costs(exchange, _move_cost(ctx, x, own, out, None))

  def fn(v):
    return _scatter_impl(v, axis_name=axis_name, replicas=replicas)

  _emit_collective(ctx, f"reduce_scatter x{replicas}", x, out, fn, exchange, compute,
                   vocab.vertex(vocab.REDUCE_ADD, x.dtype, x.dtype))
  return [out]


@register_lowering(ops.cross_replica_all_gather_p)
def _all_gather_rule(ctx, x, *, axis_name, replicas):
  out = ctx.new_tensor((x.size * replicas,), x.dtype, name="all_gather")
  own = _block_positions(out.shape, (x.size,))
  exchange, _ = collective_cost(ctx, out, _one_phase(replicas))
  exchange = add_costs(exchange, _move_cost(ctx, x, None, out, own))

  def fn(v):
    return _gather_impl(v, axis_name=axis_name, replicas=replicas)

  _emit_collective(ctx, f"all_gather x{replicas}", x, out, fn, exchange)
  return [out]
