"""A matmul's arithmetic: the functions its supersteps run, reading the emitter's plan.

The logical form (:func:`logical_product`: one ``lax.dot_general`` of the
logical operands with the partials type, or fp16 partials in the plan's
order through :mod:`~ipu_jax.lowering.half_partials`), and the per-tile form
of one serial pass (:func:`pass_blocks`: every grid tile's blocks by pad /
reshape / transpose / broadcast, no gathers, multiplied as the AMP would),
its reduce-scatter (:func:`reduce_pieces`) and the write of a pass's pieces
into the result (:func:`put_pass`). ``lowering/matmul_emit.py`` plans the
product (:class:`~ipu_jax.lowering.matmul_emit.ProductPlan`) and binds these
to its steps; the executor chooses which form runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering import half_partials
from ipu_jax.lowering.builders import logical
from ipu_jax.lowering.matmul_plan import widen_to_partials

if TYPE_CHECKING:  # the emitter imports this module; only the annotations need its plan
  from ipu_jax.lowering.matmul_emit import ProductPlan

__all__ = ["logical_product", "pass_blocks", "put_pass", "reduce_pieces"]


def logical_product(p: ProductPlan, a, w):
  """The whole product of the logical operands, in the result's shape and type.

  Whatever the K split, one ``lax.dot_general`` with the user's precision
  and the partials type as ``preferred_element_type``: the numbers
  ``jax.jit`` gives, to rounding. The tiles sum ``gk`` partials in their
  own order; reproducing that order (one product per K block and a sum of
  the partials) cost 5x a plain product on the whole chip and bought only
  a different rounding of fp32 sums, so it is not done. fp16 partials are
  the exception: rounding each partial and each addition to half precision
  changes the result, so :mod:`half_partials` keeps the plan's order.
  The per-tile accounting does not depend on this: it is the plan's.
  """
  prod, acc = p.prod, p.acc
  if p.half:
    return half_partials.planned_dot(
        jnp.transpose(a, prod.lhs_perm).reshape(prod.b, prod.m, prod.k),
        jnp.transpose(w, prod.rhs_perm).reshape(prod.b, prod.k, prod.n), p.plan.grid[3],
        p.plan.block[3], fanins=p.plan.reduce_fanins,
        levels=p.plan.scatter_stages if len(p.plan.scatter_stages) > 1 else ()
    ).astype(p.out_dtype).reshape(p.out.shape)
  c = lax.dot_general(widen_to_partials(a, acc), widen_to_partials(w, acc),
                      prod.dimension_numbers, precision=p.precision, preferred_element_type=acc)
  return c.astype(p.out_dtype).reshape(p.out.shape)


def _tile_blocks(p: ProductPlan, a_st, b_st, start, stop):
  """Each grid tile's A and B blocks of one pass, ``[G, bb, bm, bk]`` and ``[G, bb, bk, bn]``.

  Pad / reshape / transpose / broadcast of the logical operands, no gathers.
  """
  prod = p.prod
  gb, gm, gn, gk = p.plan.grid
  bb, bm, bn, bk = p.plan.block
  g_all = p.g_all
  a = jnp.transpose(logical(a_st, p.lhs), prod.lhs_perm).reshape(prod.b, prod.m, prod.k)
  w = jnp.transpose(logical(b_st, p.rhs), prod.rhs_perm).reshape(prod.b, prod.k, prod.n)
  common = jnp.promote_types(a.dtype, w.dtype)
  a, w = a.astype(common), w.astype(common)
  if p.serial_axis == 1:
    a = a[:, start:stop]
  elif p.serial_axis == 2:
    w = w[:, :, start:stop]
  pb, pm, pk, pn = a.shape[0], a.shape[1], a.shape[2], w.shape[2]
  a = jnp.pad(a, ((0, gb * bb - pb), (0, gm * bm - pm), (0, gk * bk - pk)))
  a = a.reshape(gb, bb, gm, bm, gk, bk).transpose(0, 2, 4, 1, 3, 5)
  a = jnp.broadcast_to(a[:, :, None], (gb, gm, gn, gk, bb, bm, bk)).reshape(g_all, bb, bm, bk)
  w = jnp.pad(w, ((0, gb * bb - pb), (0, gk * bk - pk), (0, gn * bn - pn)))
  w = w.reshape(gb, bb, gk, bk, gn, bn).transpose(0, 4, 2, 1, 3, 5)
  w = jnp.broadcast_to(w[:, None], (gb, gm, gn, gk, bb, bk, bn)).reshape(g_all, bb, bk, bn)
  return a, w


def pass_blocks(p: ProductPlan, a_st, b_st, start, stop):
  """Per-tile partial blocks ``[G, bb*bm*bn]`` of one pass (per_tile mode)."""
  a, w = _tile_blocks(p, a_st, b_st, start, stop)
  bb, bm, bn, bk = p.plan.block
  g_all, acc = p.g_all, p.acc
  if p.half:  # fp16 partials: each tile's AMP chains, as the batched model
    return half_partials.tile_partials(a.reshape(g_all * bb, bm, bk),
                                       w.reshape(g_all * bb, bk, bn)).reshape(g_all, p.block)
  # f32 blocks use HIGHEST: the per-tile arithmetic is the AMP's, not XLA:CPU's default.
  precision = lax.Precision.HIGHEST if np.dtype(p.in_dtype) == np.float32 else p.precision

  def block_matmul(x, y):
    x, y = widen_to_partials(x, acc), widen_to_partials(y, acc)
    return lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,))),
                           precision=precision, preferred_element_type=acc)

  return jax.vmap(block_matmul)(a, w).reshape(g_all, p.block)


def put_pass(p: ProductPlan, out_st, index, value):
  """Write one pass's pieces into the result storage."""
  if p.passes == 1:
    return value.astype(p.out_dtype)
  rows = out_st.shape[0]
  return out_st.reshape(rows, p.passes, -1).at[:, index].set(value.astype(p.out_dtype)).reshape(
      rows, -1)


def reduce_pieces(p: ProductPlan, p_st):
  """Each tile's sum of its piece of the block's ``gk`` partials (per_tile mode)."""
  gk, g_out, block, piece = p.plan.grid[3], p.g_out, p.block, p.piece
  x = p_st.reshape(g_out, gk, block)
  if piece * gk != block:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, piece * gk - block)))
  x = x.reshape(g_out, gk, gk, piece)
  if p.half:  # the partials added in order, rounding each addition
    return half_partials.add_in_order(jnp.moveaxis(x, 1, 0)).reshape(p.g_all, piece)
  return x.sum(axis=1).reshape(p.g_all, piece)
