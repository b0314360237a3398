"""Independent problems spread over tiles: batched linear algebra, FFT lines.

Tile plan. An operation made of independent *problems* (the matrices of a
batched factorisation, the lines of an FFT) is lowered into one superstep:

1. **Placement.** Problems are numbered in row-major order of their batch
   axes and cut into consecutive groups of ``ceil(P / num_tiles)``; group
   ``g`` lives on tile ``start + g``. Every result element lives on the tile
   of its problem, so each tile holds whole problems and the mapping is
   linear when the batch axes lead. ``start`` is the tile of the first
   element of the largest computed operand, so an operand already laid out
   by problem (the result of a previous op on the same batch) does not move.
2. **Exchange.** Each operand element goes from its tile to the tile of its
   problem (a static, exactly costed exchange; nothing moves for elements
   already there).
3. **Compute.** Each tile runs one vertex per problem (the caller's
   algorithm on its local batch), costed by
   :func:`ipu_jax.kernels.linalg.problem_cycles`; ``workspace`` bytes per
   problem are scratch for the step.

A single problem larger than a tile's memory lands on one tile and fails the
normal memory check with an :class:`~ipu_jax.OutOfMemoryError` naming the
tile; splitting one problem over several tiles is the caller's business (an
FFT does it as passes along one axis at a time).

Execution: the step's logical form runs the caller's function once on all
the problems (XLA's batched kernels; the ``"batched"`` executor runs it); its
``fn`` (the ``"per_tile"`` executor's) reshapes the problems into
``[tiles, problems per tile, ...]`` and ``vmap``s the function over the
tiles, each on its own local batch. Both give the same numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import linalg as linalg_kernels
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, logical, storage, worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.mapping import TileMapping, blocks_on_tiles

__all__ = ["solve_problems", "problem_of_elements"]


def problem_of_elements(shape, batch_axes) -> np.ndarray:
  """``[size]`` problem of every element: the row-major index of its batch axes."""
  shape = tuple(int(d) for d in shape)
  index = np.zeros((), np.int64)
  stride = 1
  for axis in reversed(tuple(batch_axes)):
    view = [1] * len(shape)
    view[axis] = shape[axis]
    index = index + np.arange(shape[axis], dtype=np.int64).reshape(view) * stride
    stride *= shape[axis]
  return np.broadcast_to(index, shape).reshape(-1)


def _problem_major(x, batch_axes, num_problems):
  """Logical array -> ``[P, *core]`` with the batch axes first."""
  core = [a for a in range(x.ndim) if a not in batch_axes]
  x = jnp.transpose(x, tuple(batch_axes) + tuple(core))
  return x.reshape((num_problems,) + tuple(x.shape[len(batch_axes):]))


def _from_problem_major(y, shape, batch_axes):
  """``[P, *core]`` -> the logical array of ``shape`` (batch axes in place)."""
  batch_axes = tuple(batch_axes)
  core = [a for a in range(len(shape)) if a not in batch_axes]
  moved = tuple(shape[a] for a in batch_axes) + tuple(shape[a] for a in core)
  y = y.reshape(moved)
  return jnp.transpose(y, np.argsort(batch_axes + tuple(core)))


def _runs_cost(target, src: TileMapping, dst: TileMapping, itemsize: int) -> ExchangeCost:
  """Bytes moved between two linear mappings, by runs of elements.

  Both mappings hold consecutive runs of the flat tensor per tile, so the
  elements split into at most ``rows(src) + rows(dst)`` runs that each have
  one source and one destination tile: no per-element work.
  """
  n = src.num_elements
  bounds = np.union1d(np.minimum(np.arange(src.num_rows + 1, dtype=np.int64) * src.chunk, n),
                      np.minimum(np.arange(dst.num_rows + 1, dtype=np.int64) * dst.chunk, n))
  first, length = bounds[:-1], np.diff(bounds)
  src_tile = src.tiles[np.minimum(first // src.chunk, src.num_rows - 1)]
  dst_tile = dst.tiles[np.minimum(first // dst.chunk, dst.num_rows - 1)]
  moved = np.where(src_tile != dst_tile, length, 0) * itemsize
  t, per_ipu = target.num_tiles, target.tiles_per_ipu
  crossing = (src_tile // per_ipu) != (dst_tile // per_ipu)
  return ExchangeCost(
      np.bincount(dst_tile, weights=moved, minlength=t)[:t].astype(np.int64),
      np.bincount(src_tile, weights=moved, minlength=t)[:t].astype(np.int64),
      np.bincount(src_tile // per_ipu, weights=moved * crossing,
                  minlength=target.num_ipus)[:target.num_ipus].astype(np.int64))


def _problem_mapping(shape, axes, per_tile, group_tile, start, num_tiles) -> TileMapping:
  """Where a tensor's elements go: the tile of their problem."""
  size = int(np.prod(shape, dtype=np.int64))
  if tuple(axes) == tuple(range(len(axes))):
    # Leading batch axes: each group of problems is one run of the flat
    # tensor, so the mapping is linear (planned by runs, not elements).
    per_problem = int(np.prod(shape[len(axes):], dtype=np.int64))
    return TileMapping.blocks(size, per_tile * per_problem, num_tiles, start)
  return TileMapping.from_element_tiles(group_tile[problem_of_elements(shape, axes) // per_tile])


def _move_cost(target, tensor, mapping):
  if tensor.mapping.same_as(mapping):
    return None
  if tensor.mapping.is_linear and mapping.is_linear:
    return _runs_cost(target, tensor.mapping, mapping, tensor.itemsize)
  return movement_cost(target, tensor.mapping.element_tile, mapping.element_tile,
                       tensor.itemsize)


def _start_tile(ctx, operands, groups) -> int:
  """First tile: where the largest computed operand starts, else a fresh one."""
  live = [t for t in operands if t.size and t.category != "constants"]
  if live:
    # Storage rows are in order of first element, so row 0 holds element 0.
    return int(max(live, key=lambda t: t.size).mapping.tiles[0])
  return ctx.claim_tiles(groups)


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Problems cut into consecutive groups of ``per_tile``, group ``g`` on ``group_tile[g]``."""

  num_problems: int
  per_tile: int
  groups: int
  start: int
  group_tile: np.ndarray
  num_tiles: int

  def mapping(self, shape, axes) -> TileMapping:
    """Where a tensor with these batch axes lives."""
    return _problem_mapping(shape, axes, self.per_tile, self.group_tile, self.start,
                            self.num_tiles)

  def problems_on_tile(self) -> np.ndarray:
    """``[num_tiles]`` problems each tile solves."""
    return blocks_on_tiles(self.num_tiles, self.group_tile, self.num_problems,
                           self.per_tile)


def _place(ctx, operands, num_problems: int) -> _Placement:
  num_tiles = ctx.target.num_tiles
  per_tile = -(-num_problems // num_tiles)
  groups = -(-num_problems // per_tile)
  start = _start_tile(ctx, operands, groups)
  group_tile = (start + np.arange(groups, dtype=np.int64)) % num_tiles
  return _Placement(num_problems, per_tile, groups, start, group_tile, num_tiles)


@dataclasses.dataclass(frozen=True)
class _ProblemRun:
  """What the step runs: the caller's ``fn`` on problem-major operands."""

  fn: Callable
  operands: tuple
  batch_axes: tuple
  outputs: tuple
  out_batch_axes: tuple
  with_problem_index: bool
  placement: _Placement


def _solve(run: _ProblemRun, arrays, per_tile: bool) -> tuple:
  """The results' logical arrays: ``fn`` on all problems at once, or
  (``per_tile``) ``vmap``-ed over the tiles' local batches."""
  place = run.placement
  args = [_problem_major(x, axes, place.num_problems)
          for x, axes in zip(arrays, run.batch_axes)]
  if run.with_problem_index:
    args.insert(0, jnp.arange(place.num_problems, dtype=jnp.int32))
  if per_tile and place.groups > 1:
    results = _per_tile(run.fn, args, place.per_tile, place.groups, place.num_problems)
  else:
    results = run.fn(*args)
  if not isinstance(results, (tuple, list)):
    results = (results,)
  return tuple(_from_problem_major(r, o.shape, axes)
               for r, o, axes in zip(results, run.outputs, run.out_batch_axes))


def _run_problems(run: _ProblemRun, *storages):
  """The step's ``fn``: each tile solves its own problems, on storages."""
  arrays = [logical(s, t) for s, t in zip(storages, run.operands)]
  return tuple(storage(r, o) for r, o in zip(_solve(run, arrays, True), run.outputs))


def _problems_logical(run: _ProblemRun, *arrays):
  """The step's logical form: all problems at once."""
  return _solve(run, arrays, False)


def solve_problems(ctx, fn: Callable, operands: Sequence[P.Tensor], out_avals,
                   *, batch_axes: Sequence[Sequence[int]],
                   out_batch_axes: Sequence[Sequence[int]],
                   flops: float, steps: int = 1, workspace_bytes: int = 0,
                   with_problem_index: bool = False, codelet: str = "",
                   name: str = "") -> list:
  """Lower independent problems into one superstep; returns the results.

  Args:
    ctx: the lowering context.
    fn: ``fn(*operands) -> result or tuple`` on problem-major arrays: each
      operand as ``[P, *core]`` (its batch axes flattened in front), each
      result likewise.
    operands: the input tensors.
    out_avals: ``[(shape, dtype)]`` of the results.
    batch_axes: per operand, its axes that number the problems (in order).
    out_batch_axes: the same for each result.
    flops: real flops of one problem (see :mod:`ipu_jax.kernels.linalg`).
    steps: sequential steps of one problem.
    workspace_bytes: scratch bytes one problem needs besides its operands
      and results.
    with_problem_index: pass ``fn`` the ``[P]`` int32 index of every problem
      first (a tile knows which problems it holds; nothing is exchanged).
    codelet: vertex type name for the report.
    name: step name (default: the primitive).
  """
  out_avals = [(tuple(int(d) for d in s), np.dtype(d)) for s, d in out_avals]
  batch_axes = tuple(tuple(int(a) for a in axes) for axes in batch_axes)
  out_batch_axes = tuple(tuple(int(a) for a in axes) for axes in out_batch_axes)
  shape0, axes0 = out_avals[0][0], out_batch_axes[0]
  num_problems = int(np.prod([shape0[a] for a in axes0], dtype=np.int64))
  if num_problems == 0 or all(int(np.prod(s, dtype=np.int64)) == 0 for s, _ in out_avals):
    return [ctx.new_tensor(s, d) for s, d in out_avals]
  place = _place(ctx, operands, num_problems)
  outputs = [ctx.new_tensor(shape, dtype) if int(np.prod(shape, dtype=np.int64)) == 0
             else ctx.new_tensor(shape, dtype, place.mapping(shape, axes))
             for (shape, dtype), axes in zip(out_avals, out_batch_axes)]
  costs = [_move_cost(ctx.target, t, place.mapping(t.shape, axes))
           for t, axes in zip(operands, batch_axes) if t.size]
  problems_on_tile = place.problems_on_tile()
  run = _ProblemRun(fn, tuple(operands), batch_axes, tuple(outputs), out_batch_axes,
                    with_problem_index, place)
  ctx.emit(P.Superstep(
      name=name or ctx.op, op=ctx.op, reads=tuple(operands), writes=tuple(outputs),
      fn=functools.partial(_run_problems, run),
      compute_cycles=linalg_kernels.problem_cycles(ctx.target, problems_on_tile, flops, steps),
      exchange=add_costs(*costs), vertices=worker_vertices(ctx, problems_on_tile),
      codelets=(codelet or ctx.op,), flops=int(round(flops * num_problems)),
      scratch_bytes=problems_on_tile * int(workspace_bytes),
      logical=functools.partial(_problems_logical, run)))
  return outputs


def _per_tile(fn, args, per_tile, groups, num_problems):
  """Run ``fn`` on each tile's problems with ``vmap`` (padded to equal)."""
  padded = per_tile * groups

  def blocks(x):
    pad = [(0, padded - num_problems)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape((groups, per_tile) + x.shape[1:])

  results = jax.vmap(fn)(*[blocks(x) for x in args])
  single = not isinstance(results, (tuple, list))
  results = (results,) if single else results
  out = [r.reshape((padded,) + r.shape[2:])[:num_problems] for r in results]
  return out[0] if single else out
