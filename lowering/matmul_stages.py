"""A reduce-scatter in poplin's stages (16 or more partials a block): matmuls, convolutions.

poplin reduces a partials depth of 16 or more in two stages, 125 or more in
three (lib/poplin/ConvReducePlan.cpp 20-26; the depths,
:func:`~ipu_jax.lowering.matmul_cost.poplin_reduce_levels`): for ``gk = 18``,
plan ``[4]``: four sections of consecutive partials (4, 5, 4, 5) are summed
first, each section's sum cut into pieces over the section's own tiles
(poplin's ``partialGroupedReduce``, lib/poplin/ConvReduce.cpp 145-180), then
the 4 sums are reduce-scattered over all 18 tiles, which leaves ``1/gk`` of
the block on each tile, the layout of a one-stage reduce-scatter. Each stage is a
superstep (``<name>/<plan> stage s/S reduce``): its exchange, poplin's
``ReduceAdd`` vertex and a sync. The per-tile figures are
:func:`~ipu_jax.lowering.matmul_cost.staged_scatter_figures`, the same the
planner prices. ``lowering/matmul_emit.py`` calls :func:`emit_staged_scatter`
after a pass's products when ``plan.scatter_stages`` has more than one stage;
a convolution's split contraction (``lowering/conv_partials.py``) reduces in
the same stages, as poplin plans both alike: both describe their partials as
a :class:`StagedScatter` for :func:`emit_stages`.

Arithmetic (``per_tile`` mode): each stage sums its groups in order, fp16
partials rounding each addition (:mod:`half_partials`, the same order as the
batched form's ``planned_dot`` with the plan's ``levels``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import half_partials
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_arith import put_pass
from ipu_jax.lowering.matmul_cost import balanced_bounds, ceil_div, staged_scatter_figures

__all__ = ["StagedScatter", "emit_staged_scatter", "emit_stages"]


def _gather_sums(gk: int, items: int, block: int, width: int) -> np.ndarray:
  """``[items, block]`` index into a group's ``[gk * width]`` pieces: each item's whole sum."""
  bounds = balanced_bounds(gk, items)
  q = ceil_div(block, np.diff(bounds))[:, None]                 # [items, 1]
  e = np.arange(block)[None, :]
  row = bounds[:-1, None] + e // q
  return row * width + e % q


def _scatter_pieces(gk: int, items: int, block: int, width: int) -> np.ndarray:
  """``[gk, width]`` index into ``[items * block + 1]`` sums: each k-tile's piece (pad last)."""
  bounds = balanced_bounds(gk, items)
  item = np.searchsorted(bounds, np.arange(gk), side="right") - 1
  q = ceil_div(block, np.diff(bounds))[item][:, None]
  c = np.arange(width)[None, :]
  e = (np.arange(gk) - bounds[item])[:, None] * q + c
  return np.where((c < q) & (e < block), item[:, None] * block + e, items * block)


def _width(gk: int, items: int, block: int) -> int:
  """Elements of the largest piece of ``items`` sums over the k-tiles."""
  return int(ceil_div(block, np.diff(balanced_bounds(gk, items)).min()))


def _stage_sum(level_st, g_out: int, gk: int, old: int, new: int, block: int, half: bool):
  """The stage's section sums cut into its pieces, ``[g_out * gk, width]`` (per_tile mode)."""
  width = level_st.shape[-1]
  x = level_st.reshape(g_out, gk * width)[:, _gather_sums(gk, old, block, width)]
  bounds = balanced_bounds(old, new)
  members = np.diff(bounds)
  index = bounds[:-1, None] + np.arange(members.max())[None, :]   # [new, most]
  index = np.where(index < bounds[1:, None], index, old)          # past a section: zeros
  x = jnp.concatenate([x, jnp.zeros((g_out, 1, block), x.dtype)], axis=1)[:, index]
  if half:  # in order, rounding each addition
    sums = half_partials.add_in_order(jnp.moveaxis(x, 2, 0), members[None, :, None])
  else:
    sums = x.sum(axis=2)
  new_width = _width(gk, new, block)
  flat = jnp.concatenate([sums.reshape(g_out, new * block),
                          jnp.zeros((g_out, 1), sums.dtype)], axis=1)
  return flat[:, _scatter_pieces(gk, new, block, new_width)].reshape(g_out * gk, new_width)


def _link_bytes(target, tiles: np.ndarray, stage: dict, p_size: int):
  """Bytes each IPU sends over its links: a piece to every tile of another IPU needing it.

  A tile holds ``[held_lo, held_hi)`` of its item's sum; each tile of the
  new item its item goes into (``dest``) needs ``[lo, lo + outputs)`` of it.
  """
  link = np.zeros(target.num_ipus, np.int64)
  if target.num_ipus == 1:
    return link
  g_out, gk = stage["held_lo"].shape
  ipu = (tiles // target.tiles_per_ipu).reshape(g_out, gk)
  # Only a block whose k-tiles straddle an IPU boundary sends over a link,
  # and a block's few dozen consecutive k-tiles seldom do: the [block,
  # sender, receiver] overlaps are taken of those blocks alone.
  mixed = np.flatnonzero(ipu.min(axis=1) != ipu.max(axis=1))
  if not mixed.size:
    return link
  ipu = ipu[mixed]
  held_lo, held_hi, lo, outputs = (np.broadcast_to(stage[k], (g_out, gk))[mixed]
                                   for k in ("held_lo", "held_hi", "lo", "outputs"))
  hi = lo + outputs
  overlap = np.maximum(0, np.minimum(held_hi[:, :, None], hi[:, None, :])
                       - np.maximum(held_lo[:, :, None], lo[:, None, :]))  # [g, sender, receiver]
  needs = stage["dest"][:, None] == stage["group"][None, :]               # [sender, receiver]
  crossing = needs[None] & (ipu[:, :, None] != ipu[:, None, :])
  sent = (overlap * crossing).sum(axis=2) * p_size               # [g_out, gk] by sender
  np.add.at(link, ipu.reshape(-1), sent.reshape(-1))
  return link


@dataclasses.dataclass(frozen=True)
class StagedScatter:
  """A reduce-scatter of ``gk`` partials a block in poplin's stages: what to emit.

  Attributes:
    tiles: ``[g_out * gk]`` tile of each partial block (row ``b * gk + j``).
    gk: partials per output block.
    block: elements of a (full) partial block.
    levels: partials left after each stage (``plan.scatter_stages``).
    acc: the partials' dtype.
    half: fp16 partials, added in order rounding each addition.
    out: the result, written by the last stage.
    final_lengths: ``[g_out, gk]`` result elements each tile writes.
    name: prefix of the steps' names (``<name> stage s/S reduce``).
    stage_tensor: name of stage ``s``'s sums, a format string of ``s``.
    write: ``(out storage, [g_out * gk, piece] sums in acc) -> out storage``.
  """

  tiles: np.ndarray
  gk: int
  block: int
  levels: tuple
  acc: np.dtype
  half: bool
  out: P.Tensor
  final_lengths: np.ndarray
  name: str
  stage_tensor: str
  write: Callable

  @property
  def g_out(self) -> int:
    return int(self.tiles.size) // self.gk


def emit_staged_scatter(ctx, p, ps, partials: P.Tensor) -> None:
  """Reduce-scatter a matmul pass's ``gk`` partials in ``p.plan.scatter_stages`` supersteps.

  Args:
    ctx: the rule context.
    p: the :class:`~ipu_jax.lowering.matmul_emit.ProductPlan`.
    ps: the pass (its index and step-name suffix).
    partials: ``[g_all, block]`` partial blocks, row ``g * gk + j`` on ``p.tiles[g * gk + j]``.
  """
  gk = p.plan.grid[3]
  emit_stages(ctx, StagedScatter(
      tiles=p.tiles, gk=gk, block=p.block, levels=p.plan.scatter_stages, acc=p.acc,
      half=p.half, out=p.out, final_lengths=p.pass_counts[:, ps.index].reshape(p.g_out, gk),
      name=f"{p.name}/{p.plan.label}{ps.suffix}",
      stage_tensor=f"{p.name}/partials stage {{}}{ps.suffix}",
      write=lambda out_st, x: put_pass(p, out_st, ps.index, x[:, :p.piece])), partials)


def emit_stages(ctx, spec: StagedScatter, partials: P.Tensor) -> None:
  """Emit the stages of ``spec``, a superstep each, reading ``partials`` ``[g_out * gk, block]``.

  Each stage's figures are :func:`~ipu_jax.lowering.matmul_cost.staged_scatter_figures`',
  what the planners price.
  """
  g_out, gk = spec.g_out, spec.gk
  stages = staged_scatter_figures(ctx.target, gk, spec.levels, np.full(g_out, spec.block),
                                  spec.acc.itemsize, final_lengths=spec.final_lengths)
  level, old = partials, gk
  for index, (new, stage) in enumerate(zip(spec.levels, stages)):
    stage = dict(stage, held_lo=np.broadcast_to(stage["held_lo"], (g_out, gk)),
                 held_hi=np.broadcast_to(stage["held_hi"], (g_out, gk)))
    link = _link_bytes(ctx.target, spec.tiles, stage, spec.acc.itemsize)
    level = _emit_stage(ctx, spec, level, stage, link, (index, old, new))
    old = new


def _per_tile(target, tiles: np.ndarray, values) -> np.ndarray:
  full = np.zeros(target.num_tiles, np.asarray(values).dtype)
  full[tiles] = np.asarray(values).reshape(-1)
  return full


def _emit_stage(ctx, spec: StagedScatter, level: P.Tensor, stage: dict, link,
                where: tuple) -> P.Tensor:
  """Emit one stage's superstep; returns its result (``spec.out`` at the last stage)."""
  index, old, new = where
  target, tiles, acc, out = ctx.target, spec.tiles, spec.acc, spec.out
  gk, g_out, block, count = spec.gk, spec.g_out, spec.block, len(spec.levels)
  last, half = index == count - 1, spec.half
  if last:
    result = out
  else:
    width, rows = _width(gk, new, block), int(tiles.size)
    result = ctx.new_tensor((rows, width), acc,
                            TileMapping(rows * width, tiles, np.full(rows, width, np.int64),
                                        chunk=width),
                            name=spec.stage_tensor.format(index + 1))

  def step(level_st, *out_st):
    x = _stage_sum(level_st, g_out, gk, old, new, block, half)
    return (spec.write(out_st[0], x),) if last else (x,)

  def logical_step(level, *prior):
    # The product's (matmul or convolution) step's logical form wrote the result.
    return (prior[0],) if last else (jnp.zeros(result.shape, acc),)

  outputs = _per_tile(target, tiles, stage["outputs"])
  ctx.emit(P.Superstep(
      name=f"{spec.name} stage {index + 1}/{count} reduce", op=ctx.op,
      reads=(level,) + ((out,) if last else ()), writes=(result,), fn=step,
      logical=logical_step, compute_cycles=_per_tile(target, tiles, stage["compute"]),
      exchange=ExchangeCost(_per_tile(target, tiles, stage["bytes_in"]),
                            _per_tile(target, tiles, stage["bytes_out"]), link),
      vertices=worker_vertices(ctx, outputs),
      codelets=(vocab.vertex(vocab.REDUCE_ADD, acc, out.dtype if last else acc),),
      flops=(int(((stage["members"] - 1) * stage["outputs"]).sum())
             if jnp.issubdtype(np.dtype(out.dtype), jnp.inexact) else 0)))
  return result
