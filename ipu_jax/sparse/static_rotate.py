"""The rotating static plan's products: a cell's block groups passed along Z.

Tile plan (``plan.rotate``; chosen by
:func:`ipu_jax.lowering.sparse_plan.plan_static` against the replicated plan
on cost): each cell's non-zero blocks are cut into ``pz`` groups
(:func:`ipu_jax.sparse.static_rule.block_groups`), group ``j`` placed once on
tile ``(x, y, j)`` with its own meta-information row. One pass over ``pz``
supersteps: at step ``s`` tile ``(x, y, z)`` holds group ``(z + t) % pz``
(``t = pass * (pz - 1) + s``: every step after a pass's first moves each
group one tile down Z, so the next pass starts with the groups where they
are) and adds that group's products with ``D``'s rows of band ``y`` and
columns of range ``z`` into its partials ``[py, R, w]`` (static_'s partials
type, :func:`ipu_jax.sparse.products.static_accumulator`: each step adds in
float32 and rounds to it). This is
dynamic sparsity's propagation phase with the pattern known: each group holds
exactly its cell's blocks, so there is no oversize, no scan of other cells'
entries and no spill phase, and each step is costed from the group the tile
really holds. With ``py == 1`` the last step writes the result; else the
static rule's reduction follows.

Executor forms: ``per_tile`` runs each step as the tiles do (every tile's held
group, padded, times its dense columns, added to the partials); the logical
form adds every block into its band at the first step and passes the partials
through the rest. Both give the same partials after the last step (with half
partials, up to the per-tile form's rounding after each step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import popsparse
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import logical, storage, worker_vertices
from ipu_jax.lowering.exchange import ExchangeCost
from ipu_jax.lowering.matmul_grid import block_grid_mapping
from ipu_jax.sparse import products
from ipu_jax.sparse import static_rule as sr

__all__ = ["Groups", "groups_of", "held_groups", "emit_rotation"]


@dataclasses.dataclass(frozen=True)
class Groups:
  """Every cell's rotating groups, padded to the fullest group (``-1``: none).

  Attributes:
    block: ``[cells, pz, most]`` frame block index.
    local_row: ``[cells, pz, most]`` block row within the X band.
    blocks, rows: ``[cells, pz]`` blocks and non-empty block rows per group.
  """

  block: np.ndarray
  local_row: np.ndarray
  blocks: np.ndarray
  rows: np.ndarray


def groups_of(grid: sr.SparseGrid, rows: np.ndarray) -> Groups:
  """The frame blocks ``rows`` (block rows of frame block order) grouped per cell and group."""
  px, py, pz = grid.shape
  cells = px * py
  group = sr.block_groups(grid)
  unit = grid.cell_of_block * pz + group
  blocks = np.bincount(unit, minlength=cells * pz).astype(np.int64)
  most = max(int(blocks.max(initial=0)), 1)
  order = np.argsort(unit, kind="stable")
  start = np.concatenate([[0], np.cumsum(blocks)[:-1]])
  rank = np.arange(order.size) - start[unit[order]]
  block = np.full((cells * pz, most), -1, np.int64)
  block[unit[order], rank] = order
  local = np.where(block >= 0, rows[np.maximum(block, 0)] % grid.plan.band[0], 0)
  pairs = np.unique(unit * max(grid.plan.x, 1) + rows)
  g_rows = np.bincount(pairs // max(grid.plan.x, 1), minlength=cells * pz).astype(np.int64)
  shape = (cells, pz)
  return Groups(block.reshape(shape + (most,)), local.reshape(shape + (most,)),
                blocks.reshape(shape), g_rows.reshape(shape))


def held_groups(pz: int, t: int) -> np.ndarray:
  """``[pz]`` the group each Z position holds at rotation count ``t``."""
  return (np.arange(pz) + t) % pz


@dataclasses.dataclass(frozen=True)
class _Step:
  """One rotation step of one pass."""

  grid: sr.SparseGrid
  pattern: object               # the user's SparsityPattern
  frame: object                 # the frame's SparsityPattern
  side: str
  groups: Groups
  held: np.ndarray              # [pz] group held per Z position
  first: bool                   # the pass's first step: partials start here
  values: P.Tensor
  dense: P.Tensor
  partials: P.Tensor            # [py, R, w] static_'s partials type, read after the first step
  out: P.Tensor                 # what the step writes: the partials, or the result
  window: tuple


def _added(p: _Step, fv, dense_c):
  """``[py, R, w]``: what every tile adds at this step (its held group's products)."""
  acc = products.accumulator(fv.dtype)
  b = p.grid.plan.block
  rx, _, fz = p.grid.plan.band
  px, py, pz = p.grid.shape
  cb, w = p.frame.grid[1], dense_c.shape[1]
  idx = p.groups.block[:, p.held]                               # [cells, pz, most]
  vals = jnp.concatenate([fv.astype(acc), jnp.zeros((1, b, b), acc)])
  dense_p = jnp.pad(dense_c.astype(acc), ((0, b), (0, pz * fz - w)))
  dense_p = dense_p.reshape(cb + 1, b, pz, fz)                   # block cb: zeros
  cols = np.where(idx >= 0, p.frame.col_indices[np.maximum(idx, 0)], cb)
  chosen = dense_p[cols, :, np.arange(pz)[None, :, None], :]     # [cells, pz, most, b, fz]
  contrib = jnp.einsum("cznab,cznbf->cznaf", vals[np.where(idx >= 0, idx, fv.shape[0])], chosen,
                       preferred_element_type=acc)
  local = p.groups.local_row[:, p.held].reshape(px * py * pz, -1)
  part = jax.vmap(lambda c, r: jax.ops.segment_sum(c, r, num_segments=rx))(
      contrib.reshape((px * py * pz,) + contrib.shape[2:]), jnp.asarray(local))
  part = part.reshape(px, py, pz, rx, b, fz).transpose(1, 0, 3, 4, 2, 5)
  return part.reshape(py, px * rx * b, pz * fz)[:, :p.frame.shape[0], :w]


def _write(p: _Step, total, prior):
  if p.out is p.partials:
    return total.astype(p.partials.dtype)
  return sr.place_pass(p.side, p.out.shape, p.window, total[0].astype(p.out.dtype), prior)


def _step_fn(p: _Step, values_st, dense_st, meta_st, *rest_st):
  del meta_st  # the pattern is static: each step's groups were listed when lowering
  fv, _ = products.frame(logical(values_st, p.values), p.pattern, p.side)
  dense_c = products.frame_dense(logical(dense_st, p.dense), p.side)[:, p.window[0]:p.window[1]]
  added = _added(p, fv, dense_c)
  rest = list(rest_st)
  total = added if p.first else logical(rest.pop(0), p.partials).astype(added.dtype) + added
  prior = logical(rest[0], p.out) if rest else None
  return (storage(_write(p, total, prior), p.out),)


def _step_logical(p: _Step, values, dense, meta, *rest):
  del meta
  rest = list(rest)
  if p.first:
    fv, fp = products.frame(values, p.pattern, p.side)
    dense_c = products.frame_dense(dense, p.side)[:, p.window[0]:p.window[1]]
    total = products.band_partials(fv, fp, dense_c, p.grid.plan.band[1], p.grid.shape[1])
  else:
    total = rest.pop(0)
  return (_write(p, total, rest[0] if rest else None),)


def _group_bytes(grid: sr.SparseGrid, groups: Groups, itemsize: int) -> np.ndarray:
  """``[cells, pz]`` bytes of a group: its blocks and its meta-information."""
  return (groups.blocks * grid.plan.block ** 2 * itemsize
          + popsparse.meta_info_words(groups.blocks, groups.rows) * popsparse.META_WORD_BYTES)


def _group_exchange(ctx, grid: sr.SparseGrid, gbytes: np.ndarray, held, before) -> ExchangeCost:
  """Every tile receives the group it now holds from its Z neighbour and sends on its last."""
  cost = ExchangeCost.zeros(ctx.target)
  tiles = grid.tiles.reshape(-1)
  cost.bytes_in[tiles] = gbytes[:, held].reshape(-1)
  cost.bytes_out[tiles] = gbytes[:, before].reshape(-1)
  return cost


def _step_cycles(ctx, grid: sr.SparseGrid, groups: Groups, held, z_cols, first, itemsize,
                 p_itemsize) -> np.ndarray:
  """``[num_tiles]``: each tile's products of the group it holds (and zeroing, first)."""
  px, py, pz = grid.shape
  z = np.tile(z_cols, px * py)
  cycles = popsparse.static_product_cycles(ctx.target, groups.blocks[:, held].reshape(-1),
                                           groups.rows[:, held].reshape(-1), z,
                                           grid.plan.block, itemsize)
  if first:
    partial = np.repeat(grid.x_rows, py * pz) * z
    cycles = cycles + popsparse.static_zero_partials_cycles(ctx.target, partial,
                                                            grid.plan.block, p_itemsize)
  out = np.zeros(ctx.target.num_tiles)
  out[grid.tiles.reshape(-1)] = cycles
  return out


def _partials_tensor(ctx, grid: sr.SparseGrid, width: int, acc, name: str) -> P.Tensor:
  px, py, pz = grid.shape
  rx, _, fz = grid.plan.band
  mapping = block_grid_mapping((py, grid.plan.x, width), (py, px, pz),
                               (1, rx * grid.plan.block, fz),
                               grid.tiles.transpose(1, 0, 2).reshape(-1))
  return ctx.new_tensor((py, grid.plan.x, width), acc, mapping, name=f"{name} partials")


def emit_rotation(ctx, grid: sr.SparseGrid, pattern, frame, values, dense, meta, out_dtype,
                  side, name, result: P.Tensor, window, index: int) -> P.Tensor:
  """Pass ``index``'s ``pz`` rotation supersteps; returns its partials ``[py, R, w]`` or
  (``py == 1``) ``result`` with the pass's columns written."""
  px, py, pz = grid.shape
  window = tuple(window)
  acc = products.static_accumulator(out_dtype)
  partials = _partials_tensor(ctx, grid, window[1] - window[0], acc, name)
  groups = groups_of(grid, frame.row_indices.astype(np.int64))
  itemsize = np.dtype(out_dtype).itemsize
  gbytes = _group_bytes(grid, groups, itemsize)
  z_cols = sr.z_columns(grid, window)
  kind = (vocab.STATIC_SPARSE_DENSE_ELEMENTWISE if grid.plan.block == 1
          else vocab.STATIC_SPARSE_DENSE_BLOCK)
  suffix = f" pass {index + 1}/{grid.plan.serial}" if grid.plan.serial > 1 else ""
  on_grid = np.zeros(ctx.target.num_tiles, np.int64)
  on_grid[grid.tiles.reshape(-1)] = 1
  for s in range(pz):
    t = index * (pz - 1) + s
    held = held_groups(pz, t)
    first, last = s == 0, s == pz - 1
    out = result if (last and py == 1) else partials
    prior = (result,) if out is result and window[0] > 0 else ()
    exchange = (sr.dense_exchange(ctx, grid, dense, side, window) if first
                else _group_exchange(ctx, grid, gbytes, held, held_groups(pz, t - 1)))
    p = _Step(grid, pattern, frame, side, groups, held, first, values, dense, partials, out,
              window)
    held_blocks = np.zeros(ctx.target.num_tiles, np.int64)
    held_blocks[grid.tiles.reshape(-1)] = groups.blocks[:, held].reshape(-1)
    ctx.emit(P.Superstep(
        name=f"{name}/rotate x{px}.y{py}.z{pz}{suffix} step {s + 1}/{pz}", op=ctx.op,
        reads=(values, dense, meta) + (() if first else (partials,)) + prior, writes=(out,),
        fn=functools.partial(_step_fn, p), logical=functools.partial(_step_logical, p),
        compute_cycles=_step_cycles(ctx, grid, groups, held, z_cols, first, itemsize,
                                    np.dtype(acc).itemsize),
        exchange=exchange, vertices=worker_vertices(ctx, held_blocks),
        codelets=(vocab.vertex(kind, np.dtype(out_dtype), acc),),
        flops=2 * grid.plan.block ** 2 * int((groups.blocks[:, held] * z_cols).sum()),
        scratch_bytes=exchange.bytes_in + on_grid * int(gbytes.max(initial=0)),
        notes=(grid.plan.describe(),) if first else ()))
  return partials if py > 1 else result
