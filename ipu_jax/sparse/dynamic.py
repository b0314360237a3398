"""``dynamic_matmul``: sparse x dense with the pattern known only at run time.

The primitive ``ipu_dynamic_sparse_matmul`` takes the buckets of an encoded
pattern (:class:`~ipu_jax.sparse.buckets.DynamicSparse`: values and
meta-information, both run-time data) and the dense operand, with the
:class:`~ipu_jax.sparse.buckets.DynamicLayout` as its static parameter. It is
linear in the bucket values and in the dense operand: gradients flow to both
(per bucket entry for the values; empty entries get zero), none to the
meta-information. Its tile rule (:mod:`ipu_jax.sparse.dynamic_rule`) runs the
propagation phases.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching

from ipu_jax import tracing
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.matmul_plan import widen_to_partials
from ipu_jax.lowering.sparse_plan import DEFAULT_OVERSIZE
from ipu_jax.ops.primitive import define_primitive, not_mapped, shaped_like
from ipu_jax.sparse import products
from ipu_jax.sparse.buckets import DynamicLayout, DynamicSparse, dynamic_layout, encode
from ipu_jax.sparse.formats import BlockCSR

__all__ = ["dynamic_matmul", "dynamic_sparse_matmul_p", "bucket_partials"]

dynamic_sparse_matmul_p = jcore.Primitive("ipu_dynamic_sparse_matmul")


def _entries(values, meta, layout: DynamicLayout):
  b = layout.block
  v = values.reshape(-1, b, b)
  rows = meta[..., 0].reshape(-1).astype(jnp.int32)
  cols = meta[..., 1].reshape(-1).astype(jnp.int32)
  return v, rows, cols, rows >= 0


def bucket_partials(values, meta, dense, layout: DynamicLayout, bands: int):
  """``[bands, M, N]`` partials of all bucket entries: with several bands, band ``y``
  from the block columns of the plan's Y band ``y``; with one, all of them."""
  acc = products.accumulator(values.dtype)
  b = layout.block
  rb, cb = layout.shape[0] // b, layout.shape[1] // b
  v, rows, cols, valid = _entries(values, meta, layout)
  dense_blocks = widen_to_partials(dense, acc).reshape(cb, b, -1)
  contrib = jnp.einsum("eab,ebf->eaf", widen_to_partials(v, acc),
                       dense_blocks[jnp.where(valid, cols, 0)], preferred_element_type=acc)
  band = jnp.where(valid, cols, 0) // layout.plan.band[1] if bands > 1 else 0
  segment = jnp.where(valid, band * rb + rows, bands * rb)
  summed = jax.ops.segment_sum(contrib, segment, num_segments=bands * rb + 1)[:-1]
  return summed.reshape(bands, rb * b, dense.shape[1])


def _impl(values, meta, dense, *, layout):
  return bucket_partials(values, meta, dense, layout, 1)[0].astype(dense.dtype)


def _abstract_eval(values, meta, dense, *, layout):
  b, cap = layout.block, layout.bucket_blocks
  want = (layout.buckets, cap, b, b)
  if tuple(values.shape) != want or tuple(meta.shape) != want[:2] + (2,):
    raise TypeError(f"ipu_dynamic_sparse_matmul: buckets must be values {list(want)} and meta "
                    f"{list(want[:2]) + [2]}, got {list(values.shape)} and {list(meta.shape)}.")
  if dense.ndim != 2 or dense.shape[0] != layout.shape[1]:
    raise TypeError(f"ipu_dynamic_sparse_matmul: the dense operand must be [{layout.shape[1]}, "
                    f"N], got {dense.shape}.")
  if values.dtype != dense.dtype:
    raise TypeError(f"ipu_dynamic_sparse_matmul: operand dtypes differ: {values.dtype} and "
                    f"{dense.dtype}.")
  return shaped_like((layout.shape[0], dense.shape[1]), dense.dtype)


def _jvp(primals, tangents, *, layout):
  values, meta, dense = primals
  t_values, _, t_dense = tangents
  out = dynamic_sparse_matmul_p.bind(values, meta, dense, layout=layout)
  terms = []
  if type(t_values) is not ad.Zero:
    terms.append(dynamic_sparse_matmul_p.bind(t_values, meta, dense, layout=layout))
  if type(t_dense) is not ad.Zero:
    terms.append(dynamic_sparse_matmul_p.bind(values, meta, t_dense, layout=layout))
  if not terms:
    return out, ad.Zero.from_primal_value(out)
  return out, sum(terms[1:], terms[0])


def _values_cotangent(ct, meta, dense, layout):
  acc = products.accumulator(dense.dtype)
  b = layout.block
  rows = meta[..., 0].astype(jnp.int32)
  cols = meta[..., 1].astype(jnp.int32)
  valid = rows >= 0
  ct_b = widen_to_partials(ct, acc).reshape(layout.shape[0] // b, b, -1)
  d_b = widen_to_partials(dense, acc).reshape(layout.shape[1] // b, b, -1)
  grad = jnp.einsum("gcaf,gcbf->gcab", ct_b[jnp.where(valid, rows, 0)],
                    d_b[jnp.where(valid, cols, 0)], preferred_element_type=acc)
  return jnp.where(valid[..., None, None], grad, 0).astype(dense.dtype)


def _dense_cotangent(ct, values, meta, layout):
  """``S^T @ ct`` from the buckets: each entry's block transposed times its row of ``ct``."""
  acc = products.accumulator(values.dtype)
  b = layout.block
  v, rows, cols, valid = _entries(values, meta, layout)
  ct_b = widen_to_partials(ct, acc).reshape(layout.shape[0] // b, b, -1)
  contrib = jnp.einsum("eab,eaf->ebf", widen_to_partials(v, acc),
                       ct_b[jnp.where(valid, rows, 0)], preferred_element_type=acc)
  cb = layout.shape[1] // b
  summed = jax.ops.segment_sum(contrib, jnp.where(valid, cols, cb), num_segments=cb + 1)[:-1]
  return summed.reshape(layout.shape[1], -1).astype(values.dtype)


def _transpose(ct, values, meta, dense, *, layout):
  if type(ct) is ad.Zero:
    return [None, None, None]
  ct_values = ct_dense = None
  if ad.is_undefined_primal(values):
    ct_values = _values_cotangent(ct, meta, dense, layout)
  if ad.is_undefined_primal(dense):
    ct_dense = _dense_cotangent(ct, values, meta, layout)
  return [ct_values, None, ct_dense]


def _batch(args, dims, *, layout):
  values, meta, dense = args
  dv, dm, dd = dims
  if dv is not_mapped and dm is not_mapped:
    # Shared buckets: one product per batch element (the layout's Z split is
    # planned for N dense columns, so the batch cannot join them).
    d = jnp.moveaxis(dense, dd, 0)
    return jnp.stack([dynamic_sparse_matmul_p.bind(values, meta, d[i], layout=layout)
                      for i in range(d.shape[0])]), 0
  # Batched buckets: the reference arithmetic per batch element (lax ops).
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
  moved = [jnp.moveaxis(a, d, 0) if d is not not_mapped
           else jnp.broadcast_to(a, (size,) + a.shape) for a, d in zip(args, dims)]
  return jax.vmap(lambda v, m, d: _impl(v, m, d, layout=layout))(*moved), 0


define_primitive(dynamic_sparse_matmul_p, _impl, _abstract_eval, jvp=_jvp, batch=_batch)
ad.primitive_transposes[dynamic_sparse_matmul_p] = _transpose


def dynamic_matmul(a, b, max_non_zeros: Optional[int] = None, *, target: Optional[IPUTarget] = None,
                   oversize: float = DEFAULT_OVERSIZE,
                   available_memory_proportion: float = 0.6):
  """``a @ b`` with ``a`` sparse in a pattern known only at run time.

  Args:
    a: a :class:`DynamicSparse` (an encoded pattern: pass it to the jitted
      function as an argument, and a new pattern reuses the compiled program),
      or a :class:`BlockCSR`, encoded here (on the host) for a layout of
      ``max_non_zeros`` blocks planned for ``target``.
    b: the dense ``[K, N]`` operand.
    max_non_zeros: blocks the buckets are sized for (with a ``BlockCSR``).
    target: the IPU target the layout is planned for (with a ``BlockCSR``;
      it must be the one the program is lowered for). Inside
      ``ipu_jax.jit`` it defaults to the jit's target.
    oversize: bucket room over a uniform spread (PopSparse's default 0.3).
    available_memory_proportion: the plan's temporary memory budget.

  Raises:
    BucketOverflowError: the pattern does not fit the buckets ("Overflow in
      buckets"), e.g. more non-zeros than ``max_non_zeros``.
    ValueError: shapes, dtypes or arguments that do not fit.
  """
  b = jnp.asarray(b)
  if isinstance(a, BlockCSR):
    target = target if target is not None else tracing.tracing_target()
    if max_non_zeros is None or target is None:
      raise ValueError("dynamic_matmul: a BlockCSR needs max_non_zeros= to size its buckets and "
                       "a target to plan them for: call it inside ipu_jax.jit (its target is "
                       "used) or pass target=; or pass a DynamicSparse from "
                       "ipu_jax.sparse.encode.")
    if b.ndim != 2:
      raise ValueError(f"dynamic_matmul: the dense operand must be a matrix, got {b.shape}.")
    a = encode(a, dynamic_layout(target, a.shape, b.shape[1], max_non_zeros,
                                 block=a.block_shape[0], dtype=a.dtype, oversize=oversize,
                                 available_memory_proportion=available_memory_proportion))
  if not isinstance(a, DynamicSparse):
    raise ValueError(f"dynamic_matmul: a must be a BlockCSR or DynamicSparse, got "
                     f"{type(a).__name__}.")
  layout = a.layout
  if b.ndim != 2 or b.shape[0] != layout.shape[1]:
    raise ValueError(f"dynamic_matmul: contracting dimensions differ: sparse {layout.shape} @ "
                     f"dense {b.shape}.")
  if b.shape[1] != layout.n:
    raise ValueError(f"dynamic_matmul: the layout was planned for N={layout.n} dense columns, "
                     f"got {b.shape[1]}.")
  if a.dtype != b.dtype:
    raise ValueError(f"dynamic_matmul: operand dtypes differ: sparse values are {a.dtype}, the "
                     f"dense operand {b.dtype}; cast one of them.")
  if not jnp.issubdtype(b.dtype, jnp.floating):
    raise ValueError(f"dynamic_matmul: operands must be floating point, got {b.dtype}.")
  return dynamic_sparse_matmul_p.bind(a.values, a.meta, b, layout=layout)
