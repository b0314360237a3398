"""A matmul's partials summed in a tree of supersteps (poplin's multi-stage reduction).

When an output block has fewer elements than the ``gk`` tiles sharing its
contraction (a long contraction with a tiny result, e.g. a dot of two long
vectors), a reduce-scatter would leave tiles idle and pile ``gk - 1`` partials
on one. :func:`emit_tree_reduce` instead sums groups of
``plan.reduce_fanins[s]`` partials on each group's first tile, stage by stage
(one superstep each), until one sum per block is left, cast to the result
type. The stage counts are the plan's (``lowering/matmul_cost.py`` prices 1
to 3 stages); ``lowering/matmul_emit.py`` calls this after a pass's products.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_plan import MatmulPlan
from ipu_jax.lowering.matmul_cost import ceil_div

__all__ = ["emit_tree_reduce"]


@dataclasses.dataclass(frozen=True)
class _TreeStage:
  """One stage of a tree reduction: groups of ``fanin`` partials summed on their first tile.

  Attributes:
    count, new_count: partials per output block before and after the stage.
    fanin: partials a group sums.
    members: ``[new_count]`` partials in each group (the last may be short).
    receivers: ``[g_out, new_count]`` the tile summing each group.
    exchange: the stage's bytes.
    compute: ``[num_tiles]`` cycles.
    outputs: ``[num_tiles]`` elements each tile writes.
  """
  count: int
  new_count: int
  fanin: int
  members: np.ndarray
  receivers: np.ndarray
  exchange: ExchangeCost
  compute: np.ndarray
  outputs: np.ndarray

  @property
  def last(self) -> bool:
    return self.new_count == 1


def _tree_stage(target, group_tiles: np.ndarray, elements: np.ndarray, p_size: int, count: int,
                stride: int, fanin: int) -> _TreeStage:
  """A stage's costs; partial ``j`` of group ``g`` is on ``group_tiles[g, j * stride]``."""
  num_tiles = target.num_tiles
  new_count = ceil_div(count, fanin)
  holders = group_tiles[:, ::stride][:, :count]                  # [g_out, count]
  members = np.minimum(fanin, count - np.arange(new_count) * fanin)  # [new_count]
  receivers = holders[:, ::fanin]                                 # [g_out, new_count]
  sends = (np.arange(count) % fanin) != 0                         # [count]
  bytes_in = np.zeros(num_tiles, np.int64)
  bytes_out = np.zeros(num_tiles, np.int64)
  np.add.at(bytes_in, receivers, (members[None, :] - 1) * elements[:, None] * p_size)
  senders = holders[:, sends]
  np.add.at(bytes_out, senders, np.broadcast_to(elements[:, None] * p_size, senders.shape))
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus > 1:
    per = target.tiles_per_ipu
    dest = np.repeat(receivers, fanin, axis=1)[:, :count][:, sends]
    crossing = (senders // per) != (dest // per)
    np.add.at(link, (senders // per)[crossing],
              np.broadcast_to(elements[:, None] * p_size, senders.shape)[crossing])
  summed = np.zeros(num_tiles, np.int64)
  np.add.at(summed, receivers, members[None, :] * elements[:, None])
  outputs = np.zeros(num_tiles, np.int64)
  np.add.at(outputs, receivers, np.broadcast_to(elements[:, None], receivers.shape))
  compute = estimators.partials_reduce_cycles(target, summed, p_size, outputs)
  return _TreeStage(count, new_count, fanin, members, receivers,
                    ExchangeCost(bytes_in, bytes_out, link), compute, outputs)


def _tree_sum(level_st, stage: _TreeStage, g_out: int, block: int, acc):
  """Each group's sum of its ``fanin`` partial blocks (per_tile mode)."""
  count, new_count, fanin = stage.count, stage.new_count, stage.fanin
  x = level_st.reshape(g_out, count, block)
  x = jnp.pad(x, ((0, 0), (0, new_count * fanin - count), (0, 0)))
  x = x.reshape(g_out, new_count, fanin, block)
  if half_partials.applies(acc, acc):  # in order, rounding each addition
    return half_partials.add_in_order(jnp.moveaxis(x, 2, 0), stage.members[None, :, None])
  return x.sum(axis=2)


def emit_tree_reduce(ctx, partials: P.Tensor, out: P.Tensor, plan: MatmulPlan, tiles: np.ndarray,
                     block_elements: np.ndarray, name: str) -> None:
  """Sum each output block's ``gk`` partial blocks in a tree of supersteps.

  For a block with fewer elements than ``gk`` (a long contraction with a tiny
  result) a reduce-scatter would leave tiles idle and pile ``gk - 1`` partials
  on one: instead stage ``s`` sums groups of ``plan.reduce_fanins[s]``
  partials on the tile of each group's first (which keeps its own partial
  in place and receives the others), until one sum per block is left, on the
  group's first tile, where the result lies.

  Args:
    partials: ``[g_all, block]`` partial blocks, row ``g * gk + j`` on
      ``tiles[g * gk + j]``.
    out: the result (block-grid mapping on the groups' first tiles).
    plan: the matmul plan.
    tiles: ``[g_all]`` tile of each grid index.
    block_elements: ``[g_all]`` elements of the output block of each grid tile.
    name: prefix of the steps' and tensors' names.
  """
  gb, gm, gn, gk = plan.grid
  g_out = gb * gm * gn
  acc = partials.dtype
  elements = block_elements.reshape(g_out, gk)[:, 0]  # [g_out]
  group_tiles = tiles.reshape(g_out, gk)
  level, count, stride = partials, gk, 1  # partial j of a group is on k-tile j * stride
  for index, fanin in enumerate(plan.reduce_fanins):
    stage = _tree_stage(ctx.target, group_tiles, elements, acc.itemsize, count, stride, fanin)
    label = f"{plan.label} stage {index + 1}/{len(plan.reduce_fanins)}"
    result = _emit_tree_stage(ctx, stage, level, out, label, index, elements, name)
    level, count, stride = result, stage.new_count, stride * fanin


def _emit_tree_stage(ctx, stage: _TreeStage, level: P.Tensor, out: P.Tensor, label: str,
                     index: int, elements: np.ndarray, name: str) -> P.Tensor:
  """Emit one stage's superstep; returns its result (``out`` at the last stage)."""
  g_out, block = stage.receivers.shape[0], level.shape[1]
  acc, out_dtype, last = level.dtype, out.dtype, stage.last
  if last:
    result = out
  else:
    rows = g_out * stage.new_count
    result = ctx.new_tensor((rows, block), acc,
                            TileMapping(rows * block, stage.receivers.reshape(-1),
                                        np.full(rows, block, np.int64), chunk=block),
                            name=f"{name}/partials{index + 1}")

  def step(level_st, *out_st):
    x = _tree_sum(level_st, stage, g_out, block, acc)
    if last:
      return (x.astype(out_dtype).reshape(out.storage_shape),)
    return (x.reshape(result.storage_shape),)

  def logical_step(level, *out):
    # The matmul step's logical form wrote the result.
    return (out[0],) if last else (jnp.zeros(result.shape, acc),)

  ctx.emit(P.Superstep(
      name=f"{name}/{label} reduce", op=ctx.op, reads=(level,) + ((out,) if last else ()),
      writes=(result,), fn=step, logical=logical_step, compute_cycles=stage.compute,
      exchange=stage.exchange,
      vertices=worker_vertices(ctx, stage.outputs),
      codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out_dtype if last else acc),),
      flops=(int(((stage.members - 1).sum()) * elements.sum())
             if jnp.issubdtype(np.dtype(out_dtype), jnp.inexact) else 0)))
  return result
