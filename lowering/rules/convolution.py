"""``conv_general_dilated``: convolutions planned over tiles, run on the AMP.

Tile plan. The output is cut into a grid of blocks, one per tile, along its
batch axis (``gn``), its feature axis (``gc``) and each spatial axis (``gs``).
Tile ``(in, ic, is...)`` receives

* the input it needs: its batch rows (from every batch group its features
  use), the input channels of the feature groups its features belong to, and
  along each spatial axis the positions under its window: ``[i*b*s, i*b*s +
  (b-1)*s + (k-1)*d]`` of the padded, lhs-dilated input, i.e. its own rows
  plus the halo the kernel reaches (``b`` block, ``s`` stride, ``d`` rhs
  dilation, ``k`` kernel size);
* the kernel slice of its output features (multicast to every tile with the
  same ``ic``), less the taps that meet only padding in its window (edge
  blocks),

and computes its output block on the AMP unit. The grid starts on an even tile
with the feature split innermost (poplin's ``linearizeConvIndices``), so the
two tiles of an exchange bus hold neighbouring feature blocks and receive
their common input window together, at twice a tile's rate (poplin's
ExchangeEstimator; ``ExchangeCost.bus_shared_in``, as a matmul's A block).
The cycles are the block's MACs at the AMP rate
(``estimators.matmul_cycles``), as the IPU runs convolutions on the AMP. The grid is chosen by the cycle model (compute + exchange + sync)
among split counts for each axis, so that the per-tile temporaries (input
window, kernel slice and output block in the partials type) fit in
``convolutions.available_memory_proportion`` of the tile's SRAM (more, smaller
blocks when they do not; the least-memory grid when nothing fits). The grid
may also split the contraction (input channels, kernel rows along spatial
axis 0; ungrouped convolutions): the ``gk`` tiles of an output block compute
partial blocks, then a reduce-scatter sums them (``lowering/conv_partials.py``),
and the result lies in ``gk`` pieces per block. Feature splits of
grouped convolutions are aligned to the groups, so every tile runs the same
convolution. Every form ``jax.grad`` emits is covered: the input gradient (lhs
dilation, flipped kernel, possibly negative padding) and the weight gradient
(swapped dimension numbers, ``batch_group_count`` for grouped and depthwise
convolutions).

Exchange is counted exactly per tile from ranges (no per-destination index
arrays): every input element knows, per axis, the contiguous range of blocks
whose windows cover it and the feature blocks that read its channel; a tile
receives what it needs less what it already holds, and a tile sends each
element once if anyone else needs it (multicast). A window is a contiguous
range, so with strides or dilations larger than the kernel reach it counts a
few positions that are never read. IPU-Link bytes across IPUs are an upper
bound.

Execution. The step's logical form is one ``lax.conv_general_dilated`` with
the equation's own parameters on the logical arrays (the numbers of
``jax.jit``; the ``"batched"`` executor runs it). Its ``fn``, which the
``"per_tile"`` executor runs, cuts the input into the per-tile windows with pad / reshape / slice (no gathers) and
the kernel into feature blocks, and vmaps the block convolution over the grid.
A window's holes (lhs dilation) and padding are explicit zeros there; where
the reference backend never reads them (1-D or 2-D, lhs-dilated, unit
strides and rhs dilation, no groups: it runs an input-gradient kernel), the block runs one
1x1 convolution per kernel tap and masks the output rows whose tap reads no
input element, so a non-finite kernel tap meeting only holes stays out of
the sum (``0 * inf`` would be ``nan``).

Types and MAC costs follow the matmul rules (``matmul_plan.partials_dtype``,
``estimators.matmul_cycles``): complex and float64 convolutions are computed
exactly and costed as their emulation, with a note on the step.

The geometry and the grid plan are ``lowering/conv_plan.py``'s
(:func:`~ipu_jax.lowering.conv_plan.conv_geometry`,
:func:`~ipu_jax.lowering.conv_plan.plan_conv`); this module emits the plan.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, logical
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.matmul_emit import fill_zeros
from ipu_jax.lowering.matmul_plan import (BlockWork, block_work, covering, operand_dtype,
                                          partials_dtype)
from ipu_jax.lowering.matmul_cost import ceil_div
from ipu_jax.lowering.matmul_grid import (block_grid_mapping, blocked_storage,
                                          bus_pair_tile_order, edge_sizes, grid_tiles,
                                          operand_exchange_cost)
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering import half_partials
from ipu_jax.lowering.conv_partials import emit_partials_reduce, partials_tensor
from ipu_jax.lowering.conv_plan import (ConvGeometry, ConvPlan, conv_geometry, plan_conv,
                                        tap_row_ranges as _tap_ranges)


def _normalise_dn(dimension_numbers, ndim):
  if dimension_numbers is None:
    spec = tuple(range(ndim))
    return spec, spec, spec
  if hasattr(dimension_numbers, "lhs_spec"):
    return (tuple(dimension_numbers.lhs_spec), tuple(dimension_numbers.rhs_spec),
            tuple(dimension_numbers.out_spec))
  return tuple(tuple(s) for s in dimension_numbers)


def _inverse(perm):
  return tuple(int(i) for i in np.argsort(perm))


@dataclasses.dataclass(frozen=True)
class _OutputGrid:
  """The plan's grid in the output's own axis order, and where its blocks live.

  Attributes:
    grids, blocks: blocks along each output axis and their full sizes (the
      output's storage rows are row-major over this grid).
    tiles: the tile of every grid index.
    coords: per canonical axis (batch, features, spatial...), the block
      coordinate of every grid index.
  """

  grids: tuple
  blocks: tuple
  tiles: np.ndarray
  coords: tuple
  contraction: tuple = (1, 1)
  contraction_coords: tuple = ()

  @property
  def exchange_grid(self) -> tuple:
    """The output axes, then the input-channel and kernel-row splits (innermost)."""
    return self.grids + tuple(self.contraction)


def _output_grid(ctx, out_shape, out_spec, plan: ConvPlan) -> _OutputGrid:
  """Grid index ``b * gk + j`` computes contraction block ``j`` of output block ``b``.

  Its tiles start on an even tile with the feature split innermost, as
  poplin's ``linearizeConvIndices`` lays a plan out: the two tiles of an
  exchange bus then hold neighbouring feature blocks and need the same input
  window, which they receive together (:func:`_lhs_exchange`).
  """
  grids, blocks = [1] * len(out_shape), list(out_shape)
  for canon, axis in enumerate(out_spec):
    grids[axis], blocks[axis] = plan.grid[canon], plan.block[canon]
  exchange_grid = tuple(grids) + plan.contraction
  coords = np.unravel_index(np.arange(plan.num_tiles), exchange_grid)
  tiles = grid_tiles(ctx, plan.num_tiles, align=ctx.target.tiles_per_exchange_bus)[
      bus_pair_tile_order(exchange_grid, out_spec[1])]
  return _OutputGrid(tuple(grids), tuple(blocks), tiles,
                     tuple(coords[axis] for axis in out_spec), plan.contraction,
                     tuple(coords[-2:]))


def _lhs_exchange(target, lhs: P.Tensor, geo: ConvGeometry, plan: ConvPlan, dn,
                  out: _OutputGrid):
  """(cost, elements held locally per block) of bringing every block its input window.

  Canonical lhs view: [batch groups, batch, feature groups, channels, spatial...].
  """
  lhs_spec, _, out_spec = dn
  grid, block = plan.grid, plan.block
  gc, bn, bc = grid[1], block[0], block[1]
  c_n, c_c = out.coords[0], out.coords[1]
  g_lo, g_hi = geo.group_block_ranges(gc, bc)
  lhs_canon = (geo.bgc, geo.n // geo.bgc, geo.fgc, geo.c // geo.fgc) + geo.in_spatial
  n_lo = np.arange(geo.n_out) // bn
  needs = [None] * len(out.exchange_grid)
  needs[out_spec[0]] = (1, n_lo, n_lo + 1)
  if geo.bgc > 1:
    needs[out_spec[1]] = (0, g_lo, g_hi)
  elif geo.fgc > 1:
    needs[out_spec[1]] = (2, g_lo, g_hi)
  # Batch rows / channels per feature block: the groups whose features it holds.
  groups_of_block = covering(g_lo, g_hi, gc)
  elements = edge_sizes(geo.n_out, grid[0], bn)[c_n]
  if geo.bgc > 1:
    elements = elements * groups_of_block[c_c]
  gi, gt = plan.contraction
  bi, bt = plan.contraction_block
  if gi > 1:  # (ungrouped) a channel block
    c_lo = np.arange(geo.c) // bi
    needs[-2] = (3, c_lo, c_lo + 1)
    elements = elements * edge_sizes(geo.c, gi, bi)[out.contraction_coords[0]]
  else:
    elements = elements * ((geo.c // geo.fgc) * groups_of_block[c_c] if geo.fgc > 1 else geo.c)
  for d in range(len(geo.out_spatial)):
    if d == 0 and gt > 1:  # axis 0 is one output block: the kernel-row block sets the window
      lo, hi = _tap_ranges(geo, gt, bt)
      needs[-1] = (4, lo, hi)
      elements = elements * covering(lo, hi, gt)[out.contraction_coords[1]]
      continue
    lo, hi = geo.block_ranges(d, grid[2 + d], block[2 + d])
    needs[out_spec[2 + d]] = (4 + d, lo, hi)
    elements = elements * covering(lo, hi, grid[2 + d])[out.coords[2 + d]]
  # Grouped convolutions split the batch or feature axis: not a plain view.
  groups = (((), (lhs_spec[0],), (), (lhs_spec[1],)) + tuple((a,) for a in lhs_spec[2:])
            if geo.bgc == 1 and geo.fgc == 1 else None)
  # Bus pairs needing the same window receive it together (poplin's input elements).
  return operand_exchange_cost(target, lhs, tuple(lhs_spec), lhs_canon, groups,
                               out.exchange_grid, out.tiles, needs, elements, bus_shared=True)


def _rhs_exchange(target, rhs: P.Tensor, geo: ConvGeometry, plan: ConvPlan, dn,
                  out: _OutputGrid):
  """(cost, elements held locally per block) of bringing every block its kernel slice.

  Canonical rhs view: [features, input channels, taps...]. A spatial block
  receives only the taps that meet input (not padding) in its window.
  """
  _, rhs_spec, out_spec = dn
  grid, block = plan.grid, plan.block
  o_lo = np.arange(geo.o) // block[1]
  needs = [None] * len(out.exchange_grid)
  needs[out_spec[1]] = (0, o_lo, o_lo + 1)
  gi, gt = plan.contraction
  bi, bt = plan.contraction_block
  elements = edge_sizes(geo.o, grid[1], block[1])[out.coords[1]]
  if gi > 1:
    i_lo = np.arange(geo.i) // bi
    needs[-2] = (1, i_lo, i_lo + 1)
    elements = elements * edge_sizes(geo.i, gi, bi)[out.contraction_coords[0]]
  else:
    elements = elements * geo.i
  for d in range(len(geo.out_spatial)):
    lo, hi = geo.tap_block_ranges(d, grid[2 + d], block[2 + d])
    if d == 0 and gt > 1:  # taps read by the (single) block, by kernel-row block
      t_lo = np.arange(geo.k_spatial[0]) // bt
      lo, hi = t_lo, np.where(hi > lo, t_lo + 1, t_lo)
      needs[-1] = (2, lo, hi)
      elements = elements * covering(lo, hi, gt)[out.contraction_coords[1]]
      continue
    needs[out_spec[2 + d]] = (2 + d, lo, hi)
    elements = elements * covering(lo, hi, grid[2 + d])[out.coords[2 + d]]
  return operand_exchange_cost(target, rhs, tuple(rhs_spec), (geo.o, geo.i) + geo.k_spatial,
                               tuple((a,) for a in rhs_spec), out.exchange_grid, out.tiles,
                               needs, elements)


def _block_work(target, geo: ConvGeometry, plan: ConvPlan, out: _OutputGrid, local_bytes,
                acc, out_dtype) -> BlockWork:
  """The AMP cycles, temporaries and vertices of every tile's block convolution.

  ``local_bytes``: per block, the bytes of its window and kernel slice it holds
  itself (copied into place; the received parts are exchange buffers).
  """
  out_elements = np.ones(plan.num_tiles, np.int64)
  for canon, size in enumerate((geo.n_out, geo.o) + geo.out_spatial):
    out_elements = out_elements * edge_sizes(size, plan.grid[canon],
                                              plan.block[canon])[out.coords[canon]]
  if plan.gk > 1:
    gi, gt = plan.contraction
    bi, bt = plan.contraction_block
    taps = edge_sizes(geo.k_spatial[0], gt, bt)[out.contraction_coords[1]] * (
        geo.kernel_elements // geo.k_spatial[0])
    macs = out_elements * edge_sizes(geo.i, gi, bi)[out.contraction_coords[0]] * taps
  else:
    macs = out_elements * geo.i * geo.kernel_elements
  out_chans = edge_sizes(geo.o, plan.grid[1], plan.block[1])[out.coords[1]]
  cycles = estimators.matmul_cycles(target, macs, geo.itemsize, outputs=out_elements,
                                    dtype=geo.dtype, n=out_chans,
                                    partials_itemsize=acc.itemsize)
  scratch = local_bytes
  if acc != out_dtype and plan.gk == 1:   # partials wider than the result (else a tensor)
    scratch = scratch + out_elements * acc.itemsize
  return block_work(target, out.tiles, macs, cycles, scratch,
                    bool(jnp.issubdtype(out_dtype, jnp.inexact)))


@register_lowering(lax.conv_general_dilated_p)
def conv_general_dilated_rule(ctx: RuleContext, lhs: P.Tensor, rhs: P.Tensor, *, window_strides,
                              padding, lhs_dilation, rhs_dilation, dimension_numbers,
                              feature_group_count, batch_group_count, precision=None,
                              preferred_element_type=None, **unused):
  """Lower ``conv_general_dilated`` to a planned grid of block convolutions."""
  del unused, preferred_element_type  # the result type is in ctx.out_avals
  out_aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(out_aval.shape), np.dtype(out_aval.dtype)
  dn = _normalise_dn(dimension_numbers, len(lhs.shape))
  if int(np.prod(out_shape, dtype=np.int64)) == 0:
    return [ctx.new_tensor(out_shape, out_dtype)]
  if lhs.size == 0 or rhs.size == 0:
    return [fill_zeros(ctx, out_shape, out_dtype, f"{ctx.op}/zeros")]
  if feature_group_count > 1 and batch_group_count > 1:
    raise NotImplementedError("feature_group_count and batch_group_count both > 1")

  target, options = ctx.target, ctx.options
  in_dtype = operand_dtype(lhs.dtype, rhs.dtype)
  acc = partials_dtype(in_dtype, out_dtype, options.partials_type)
  geo = conv_geometry(lhs.shape, rhs.shape, out_shape, dn, window_strides, padding,
                      lhs_dilation, rhs_dilation, feature_group_count, batch_group_count,
                      np.dtype(in_dtype).itemsize, acc.itemsize, in_dtype.name)
  plan = plan_conv(target, geo, ctx.memory_proportion("conv_available_memory_proportion"))
  grid = _output_grid(ctx, out_shape, dn[2], plan)
  out = ctx.new_tensor(out_shape, out_dtype,
                       block_grid_mapping(out_shape, grid.grids, grid.blocks, grid.tiles,
                                          pieces=plan.gk))
  lhs_cost, lhs_local = _lhs_exchange(target, lhs, geo, plan, dn, grid)
  rhs_cost, rhs_local = _rhs_exchange(target, rhs, geo, plan, dn, grid)
  work = _block_work(target, geo, plan, grid,
                     lhs_local * lhs.itemsize + rhs_local * rhs.itemsize, acc, out_dtype)
  name = f"{ctx.op}/conv {plan.label}"
  partials = (partials_tensor(ctx, grid.tiles, int(np.prod(grid.blocks)), acc,
                              f"{ctx.op}/partials") if plan.gk > 1 else None)
  step, logical_step = _conv_step(lhs, rhs, out, partials, grid, geo, dn, plan, acc, precision,
                                  in_dtype)
  note = estimators.mac_cost_note(in_dtype)
  ctx.emit(P.Superstep(
      name=name, op=ctx.op, reads=(lhs, rhs),
      writes=(out,) if partials is None else (partials, out), fn=step,
      compute_cycles=work.compute, exchange=add_costs(lhs_cost, rhs_cost),
      vertices=work.vertices,
      codelets=(vocab.vertex(vocab.CONV_PARTIAL, np.dtype(in_dtype), acc),), flops=work.flops,
      scratch_bytes=work.scratch, notes=(note,) if note else (), logical=logical_step,
      flops_dtype=np.dtype(in_dtype)))
  if partials is not None:
    emit_partials_reduce(ctx, partials, out, grid.tiles, plan.gk, plan.scatter_stages,
                         half_partials.applies(in_dtype, acc), name)
  return [out]


def _conv_step(lhs, rhs, out, partials, grid: _OutputGrid, geo: ConvGeometry, dn,
               plan: ConvPlan, acc, precision, in_dtype):
  """``(fn, logical)``: the step's blocks on tile storage, and the whole
  convolution on the logical operands (with a split contraction, the step
  writes the partial blocks, and its logical form the result: fp16 partials
  summed in the reduction's order, :mod:`half_partials`, as the reduce steps
  of ``"per_tile"`` sum them)."""
  dn_obj = lax.ConvDimensionNumbers(*dn)
  half = half_partials.applies(in_dtype, acc)

  def step(x_st, w_st):
    x, w = logical(x_st, lhs), logical(w_st, rhs)
    if partials is None:
      y = _per_tile_conv(x, w, geo, dn, plan, acc, precision, in_dtype)
      return (blocked_storage(y.astype(out.dtype), grid.grids, grid.blocks),)
    block_conv = lambda xj, wj, geo_j: _per_tile_conv(xj, wj, geo_j, dn, plan, acc, precision,
                                                      in_dtype)
    parts = [blocked_storage(y, grid.grids, grid.blocks)
             for y in _contraction_parts(x, w, geo, dn, plan, block_conv)]
    p_st = jnp.stack(parts, axis=1).reshape(partials.storage_shape)
    return p_st, jnp.zeros(out.storage_shape, out.dtype)

  def whole_conv(x, w, geo_j):
    return lax.conv_general_dilated(
        x, w, geo_j.strides, geo_j.padding, geo_j.lhs_dilation, geo_j.rhs_dilation,
        dimension_numbers=dn_obj, feature_group_count=geo_j.fgc,
        batch_group_count=geo_j.bgc, precision=precision, preferred_element_type=acc)

  def logical_step(x, w):
    if partials is None:
      return (whole_conv(x, w, geo),)
    if half:  # fp16 partials: the gk partial convolutions added in the plan's order
      parts = _contraction_parts(x, w, geo, dn, plan, whole_conv)
      levels = plan.scatter_stages if len(plan.scatter_stages) > 1 else ()
      y = half_partials.reduce_partials(jnp.stack(parts), levels=levels)
    else:
      y = whole_conv(x, w, geo)
    # The partials are never read on the host (XLA drops them); the reduce
    # step's logical form passes the result on.
    return jnp.zeros(partials.shape, acc), y

  return step, logical_step


def _contraction_parts(x, w, geo: ConvGeometry, dn, plan: ConvPlan, conv) -> list:
  """The ``gk`` partial convolutions of a split contraction, logical, in ``acc``.

  ``conv(xj, wj, geo_j)`` computes one: the tiles' block convolutions
  (``"per_tile"``) or one whole convolution (the logical form of fp16 partials).

  Contraction block ``j = ci * gt + ct`` convolves input channels ``[ci*bi,
  ...)`` with kernel rows ``[ct*bt, ...)`` along spatial axis 0: the same
  convolution with the window's start moved by ``ct*bt`` taps (padding less
  ``ct*bt*d`` before, so every output row still reads the same positions).
  """
  lhs_spec, rhs_spec, _ = dn
  (gi, gt), (bi, bt) = plan.contraction, plan.contraction_block
  reach = geo.reach(0)
  parts = []
  for ci in range(gi):
    chans = slice(ci * bi, min(geo.i, (ci + 1) * bi))
    for ct in range(gt):
      rows = slice(ct * bt, min(geo.k_spatial[0], (ct + 1) * bt))
      taps = rows.stop - rows.start
      lo, hi = geo.padding[0]
      lo_j = lo - rows.start * geo.rhs_dilation[0]
      hi_j = lo + hi - reach + (taps - 1) * geo.rhs_dilation[0] + 1 - lo_j
      geo_j = dataclasses.replace(
          geo, c=chans.stop - chans.start, i=chans.stop - chans.start,
          k_spatial=(taps,) + geo.k_spatial[1:], padding=((lo_j, hi_j),) + geo.padding[1:])
      xj = lax.slice_in_dim(x, chans.start, chans.stop, axis=lhs_spec[1])
      wj = lax.slice_in_dim(w, chans.start, chans.stop, axis=rhs_spec[1])
      wj = lax.slice_in_dim(wj, rows.start, rows.stop, axis=rhs_spec[2])
      parts.append(conv(xj, wj, geo_j))
  return parts


@dataclasses.dataclass(frozen=True)
class _InputBlocks:
  """The input cut for the block convolutions.

  Attributes:
    x: ``[gn, gcx, B, C, spatial...]``.
    gcx: ``gc`` when feature blocks read different inputs (grouped), else 1.
    feature_groups, batch_groups: the group counts of each block convolution.
  """

  x: jax.Array
  gcx: int
  feature_groups: int
  batch_groups: int


def _input_blocks(x, geo: ConvGeometry, lhs_spec, plan: ConvPlan) -> _InputBlocks:
  """Canonical lhs ``[bgc, n_out, fgc, i_per_group, spatial...]``, batch padded,
  with each feature block's groups picked out."""
  nsp = len(lhs_spec) - 2
  gn, gc, bn, bc = plan.grid[0], plan.grid[1], plan.block[0], plan.block[1]
  x = jnp.transpose(x, lhs_spec)
  x = x.reshape((geo.bgc, geo.n_out, geo.fgc, geo.c // geo.fgc) + geo.in_spatial)
  x = jnp.pad(x, [(0, 0), (0, gn * bn - geo.n_out)] + [(0, 0)] * (2 + nsp))
  x = x.reshape((geo.bgc, gn, bn, geo.fgc, geo.c // geo.fgc) + geo.in_spatial)
  if geo.groups == 1:
    return _InputBlocks(x.reshape((gn, 1, bn, geo.c) + geo.in_spatial), 1, 1, 1)
  size, groups = geo.group_size, geo.groups
  x = jnp.moveaxis(x, 0 if geo.bgc > 1 else 3, 0)  # [groups, <four other axes>, spatial...]
  if bc >= size:
    tb = bc // size
    x = x.reshape((gc, tb) + x.shape[1:])
  else:
    tb = 1
    x = jnp.broadcast_to(x[:, None], (groups, gc // groups) + x.shape[1:])
    x = x.reshape((gc, 1) + x.shape[2:])
  spatial = tuple(range(6, 6 + nsp))
  if geo.bgc > 1:
    # [gc, tb, gn, bn, fgc=1, i, sp...] -> [gn, gc, tb*bn, c, sp...]
    x = jnp.transpose(x, (2, 0, 1, 3, 4, 5) + spatial)
    x = x.reshape((gn, gc, tb * bn, geo.c) + geo.in_spatial)
  else:
    # [gc, tb, bgc=1, gn, bn, i, sp...] -> [gn, gc, bn, tb*i, sp...]
    x = jnp.transpose(x, (3, 0, 2, 4, 1, 5) + spatial)
    x = x.reshape((gn, gc, bn, tb * (geo.c // geo.fgc)) + geo.in_spatial)
  return _InputBlocks(x, gc, tb if geo.fgc > 1 else 1, tb if geo.bgc > 1 else 1)


def _spatial_windows(x, geo: ConvGeometry, plan: ConvPlan):
  """Cuts every spatial axis of ``[gn, gcx, B, C, spatial...]`` into its blocks'
  windows: ``[gn, g_0, ..., gcx, B, C, W_0, ...]``. Padding and lhs dilation
  are applied here, so the block convolutions need neither."""
  nsp = len(geo.out_spatial)
  for d in range(nsp):
    g, b = plan.grid[2 + d], plan.block[2 + d]
    s, reach = geo.strides[d], geo.reach(d)
    window, stride = (b - 1) * s + reach, b * s
    chunks = ceil_div(window, stride)
    needed = (g - 1 + chunks) * stride
    lo, hi = geo.padding[d]
    length = lo + (geo.in_spatial[d] - 1) * geo.lhs_dilation[d] + 1 + hi
    axis = d + 4 + d  # d grid axes already prepended
    config = [(0, 0, 0)] * x.ndim
    config[axis] = (lo, hi + max(0, needed - length), geo.lhs_dilation[d] - 1)
    x = lax.pad(x, jnp.zeros((), x.dtype), config)
    x = jnp.moveaxis(x, axis, 0)
    parts = [x[j * stride:j * stride + g * stride].reshape((g, stride) + x.shape[1:])
             for j in range(chunks)]
    x = (jnp.concatenate(parts, axis=1) if chunks > 1 else parts[0])[:, :window]
    x = jnp.moveaxis(x, 1, axis + 1)  # [g, ..., window in place of the axis]
  # [g_{nsp-1}, ..., g_0, gn, gcx, B, C, W_0, ...] -> [gn, g_0, ..., gcx, B, C, W...]
  order = (nsp,) + tuple(range(nsp - 1, -1, -1)) + tuple(range(nsp + 1, x.ndim))
  return jnp.transpose(x, order)


def _kernel_blocks(w, geo: ConvGeometry, rhs_spec, plan: ConvPlan):
  """Canonical kernel ``[o, i, k...]`` cut into feature blocks ``[gc, bc, i, k...]``."""
  gc, bc = plan.grid[1], plan.block[1]
  w = jnp.transpose(w, rhs_spec)
  w = jnp.pad(w, [(0, gc * bc - geo.o)] + [(0, 0)] * (w.ndim - 1))
  return w.reshape((gc, bc) + w.shape[1:])


def _skips_holes(geo: ConvGeometry) -> bool:
  """Whether the reference backend never reads the lhs dilation's holes.

  XLA on CPU runs a 1-D or 2-D lhs-dilated convolution with unit strides and
  rhs dilation and no groups as an input-gradient kernel that never reads
  holes or padding (a non-finite tap meeting only those stays out of the
  sum), and every other convolution on explicitly zero-filled input
  (0 * inf = nan). Per-tile blocks do the same.
  """
  return (any(d > 1 for d in geo.lhs_dilation) and all(v == 1 for v in geo.strides)
          and all(v == 1 for v in geo.rhs_dilation) and geo.groups == 1
          and len(geo.out_spatial) <= 2)


def _block_conv(geo: ConvGeometry, plan: ConvPlan, blocks: _InputBlocks, acc, precision,
                in_dtype):
  """One tile's block convolution ``(xb, wb, *tap_masks) -> output block``.

  Where the reference skips holes (:func:`_skips_holes`), each tap is a 1x1
  block convolution masked where it reads no input element.
  """
  nsp = len(geo.out_spatial)
  canon = tuple(range(nsp + 2))
  block_dn = lax.ConvDimensionNumbers(canon, canon, canon)
  block_precision = lax.Precision.HIGHEST if np.dtype(in_dtype) == np.float32 else precision
  groups = dict(feature_group_count=blocks.feature_groups,
                batch_group_count=blocks.batch_groups, precision=block_precision,
                preferred_element_type=acc)
  if not _skips_holes(geo):
    return lambda xb, wb: lax.conv_general_dilated(
        xb, wb, geo.strides, [(0, 0)] * nsp, (1,) * nsp, geo.rhs_dilation,
        dimension_numbers=block_dn, **groups)

  def masked_taps(xb, wb, *tile_masks):
    total = None
    for taps in np.ndindex(*geo.k_spatial):
      window = tuple(slice(t, t + b) for t, b in zip(taps, plan.block[2:]))
      kernel = tuple(slice(t, t + 1) for t in taps)
      y = lax.conv_general_dilated(
          xb[(slice(None), slice(None)) + window], wb[(slice(None), slice(None)) + kernel],
          (1,) * nsp, [(0, 0)] * nsp, dimension_numbers=block_dn, **groups)
      reads_input = functools.reduce(
          jnp.logical_and, [m[:, t].reshape([-1 if a == d else 1 for a in range(nsp)])
                            for d, (m, t) in enumerate(zip(tile_masks, taps))])
      y = jnp.where(reads_input, y, jnp.zeros((), y.dtype))
      total = y if total is None else total + y
    return total

  return masked_taps


def _per_tile_conv(x, w, geo: ConvGeometry, dn, plan: ConvPlan, acc, precision, in_dtype):
  """The convolution as a vmapped block convolution over the tile grid.

  Returns the logical result (in the output's layout), in ``acc``.
  """
  lhs_spec, rhs_spec, out_spec = dn
  nsp = len(lhs_spec) - 2
  common = jnp.promote_types(x.dtype, w.dtype)
  blocks = _input_blocks(x.astype(common), geo, lhs_spec, plan)
  xw = _spatial_windows(blocks.x, geo, plan)
  if blocks.gcx == 1:
    xw = jnp.squeeze(xw, axis=1 + nsp)
  w = _kernel_blocks(w.astype(common), geo, rhs_spec, plan)
  skip = _skips_holes(geo)
  masks = _tap_masks(geo, plan.grid, plan.block) if skip else []
  # vmaps over feature blocks, then spatial blocks (innermost first), then
  # batch blocks; a spatial axis's masks follow its blocks.
  fn = jax.vmap(_block_conv(geo, plan, blocks, acc, precision, in_dtype),
                in_axes=(0 if blocks.gcx > 1 else None, 0) + (None,) * len(masks))
  for level in range(nsp + 1):
    axis = nsp - 1 - level
    fn = jax.vmap(fn, in_axes=(0, None) + tuple(0 if d == axis else None
                                                 for d in range(len(masks))))
  y = fn(xw, w, *masks)  # [gn, g_0.., gc, bn, bc, b_0..]
  # -> [gn, bn, gc, bc, g_0, b_0, ...] -> canonical [n, o, spatial...]
  k = nsp + 2
  order = [0, k, 1 + nsp, k + 1]
  for d in range(nsp):
    order += [1 + d, k + 2 + d]
  y = jnp.transpose(y, order)
  y = y.reshape(tuple(g * b for g, b in zip(plan.grid, plan.block)))
  y = y[tuple(slice(0, n) for n in (geo.n_out, geo.o) + geo.out_spatial)]
  return jnp.transpose(y, _inverse(out_spec))


def _tap_masks(geo: ConvGeometry, grid, block) -> list:
  """Per spatial axis, ``[g, b, k]``: whether tap ``k`` of output row ``r`` of
  block ``i`` reads an input element (not a hole of the lhs dilation nor
  padding), for unit strides and rhs dilation."""
  masks = []
  for d in range(len(geo.out_spatial)):
    g, b, k = grid[2 + d], block[2 + d], geo.k_spatial[d]
    dilation = geo.lhs_dilation[d]
    position = (np.arange(g)[:, None, None] * b + np.arange(b)[None, :, None]
                + np.arange(k)[None, None, :] - geo.padding[d][0])
    masks.append(jnp.asarray((position >= 0) & (position <= (geo.in_spatial[d] - 1) * dilation)
                             & (position % dilation == 0)))
  return masks
