"""A convolution's split contraction: partial output blocks and their reduce-scatter.

When ``lowering/conv_plan.py`` splits a convolution's contraction (input
channels ``gi``, kernel rows ``gt``; PopLibs plans a weight update the same
way, its reduction over batch x field as an input-channel split), the ``gk =
gi * gt`` tiles sharing an output block each compute a partial block in the
partials type: tile ``b * gk + j`` holds contraction block ``j`` of output
block ``b``. :func:`partials_tensor` is that tensor; :func:`emit_partials_reduce`
sums the partials as the matmul rules do (``lowering/matmul_emit.py``): a
reduce-scatter in which each of the ``gk`` tiles sums its piece of the block
and casts it to the result type, priced by ``estimators.partials_reduce_cycles`` and
the matmul's reduce-scatter exchange; the result lies in ``gk`` pieces per
block (``block_grid_mapping(..., pieces=gk)``). From ``gk = 16`` the
reduce-scatter runs in poplin's stages, a superstep each, exactly as a
matmul's (``lowering/matmul_stages.py``, priced by the planner with the same
figures): poplin plans a convolution's reduction as a matmul's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_cost import ceil_div
from ipu_jax.lowering.matmul_emit import scatter_exchange
from ipu_jax.lowering.matmul_stages import StagedScatter, emit_stages

__all__ = ["emit_partials_reduce", "partials_tensor", "sum_pieces"]


def partials_tensor(ctx, tiles: np.ndarray, block: int, acc, name: str) -> P.Tensor:
  """``[num_tiles, block]`` partial blocks in ``acc``, row ``r`` on ``tiles[r]``."""
  rows = int(tiles.size)
  return ctx.new_tensor((rows, block), acc,
                        TileMapping(rows * block, tiles, np.full(rows, block, np.int64),
                                    chunk=block), name=name)


def sum_pieces(p_st, gk: int, half: bool):
  """Each tile's sum of its piece of the ``gk`` partials of its block.

  ``p_st``: ``[g_out * gk, block]``; returns ``[g_out * gk, ceil(block / gk)]``
  (fp16 partials are added in order, rounding each addition).
  """
  rows, block = p_st.shape
  g_out, piece = rows // gk, ceil_div(block, gk)
  x = p_st.reshape(g_out, gk, block)
  if piece * gk != block:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, piece * gk - block)))
  total = half_partials.add_in_order(jnp.moveaxis(x, 1, 0)) if half else x.sum(axis=1)
  return total.reshape(rows, piece)


def emit_partials_reduce(ctx, partials: P.Tensor, out: P.Tensor, tiles: np.ndarray, gk: int,
                         levels: tuple, half: bool, name: str) -> None:
  """The reduce-scatter writing ``out`` (mapped in ``gk`` pieces per block).

  Args:
    ctx: the rule context.
    partials: ``[g_out * gk, block]`` partial blocks, row ``r`` on ``tiles[r]``.
    out: the result.
    tiles: the tile of each partial block.
    gk: partials per output block.
    levels: partials left after each stage (``ConvPlan.scatter_stages``):
      one superstep for ``(1,)``, poplin's stages, a superstep each, for more.
    half: fp16 partials, added in order rounding each addition.
    name: prefix of the steps' names.
  """
  if len(levels) > 1:
    out_dtype = out.dtype
    emit_stages(ctx, StagedScatter(
        tiles=tiles, gk=gk, block=int(partials.shape[1]), levels=tuple(levels),
        acc=np.dtype(partials.dtype), half=half, out=out,
        final_lengths=out.mapping.counts.reshape(-1, gk), name=name,
        stage_tensor=f"{ctx.op}/partials stage {{}}",
        write=lambda out_st, x: x.astype(out_dtype).reshape(out_st.shape)), partials)
    return
  _emit_one_stage(ctx, partials, out, tiles, gk, half, name)


def _emit_one_stage(ctx, partials: P.Tensor, out: P.Tensor, tiles: np.ndarray, gk: int,
                    half: bool, name: str) -> None:
  """The one reduce-scatter superstep of fewer than 16 partials a block."""
  target, acc = ctx.target, np.dtype(partials.dtype)
  counts = out.mapping.counts  # [g_out * gk] result elements each tile sums
  p_size = acc.itemsize
  compute = np.zeros(target.num_tiles)
  compute[tiles] = estimators.partials_reduce_cycles(target, gk * counts, p_size, counts)
  vertices = np.zeros(target.num_tiles, np.int64)
  vertices[tiles] = worker_vertices(ctx, counts)
  out_dtype = out.dtype

  def reduce_step(p_st, out_st):
    del out_st
    return (sum_pieces(p_st, gk, half).astype(out_dtype),)

  ctx.emit(P.Superstep(
      name=f"{name} reduce", op=ctx.op, reads=(partials, out), writes=(out,), fn=reduce_step,
      # The convolution step's logical form wrote the result.
      logical=lambda partial_blocks, result: (result,), compute_cycles=compute,
      exchange=scatter_exchange(target, tiles, counts.reshape(-1, gk), p_size),
      vertices=vertices, codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out_dtype),),
      flops=int((gk - 1) * counts.sum()) if jnp.issubdtype(out_dtype, jnp.inexact) else 0))
