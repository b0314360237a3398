"""IPU custom primitives: what Poplar and TessellateIPU offer beyond ``lax``.

Each op is a ``jax.extend.core.Primitive`` defined the way ``jax/_src/lax``
defines its own: an impl (the reference semantics, plain JAX), an abstract
eval, a JVP, a transpose where the op is linear, a batching rule and an MLIR
lowering (``mlir.lower_fun`` of the impl), so a function that uses them runs
under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` without the emulator. The
tile lowerings (how each op runs on tiles and what it costs) live in
``ipu_jax/lowering/rules/ipu_ops.py``.

* :func:`tile_map`: run a codelet once per tile on chosen tiles (TessellateIPU's
  ``tile_map``).
* :func:`cross_replica_sum`, :func:`cross_replica_mean`, :func:`replica_index`:
  the data-parallel collectives (``lax.psum`` / ``pmean`` / ``axis_index`` over
  the replica axis when it is bound, else a single replica).
* :func:`matmul`: ``jnp.matmul`` with poplin's per-op planning options.
* :func:`stochastic_round`: fp32 -> fp16/bf16 rounding the way the IPU's
  stochastic rounding mode does it (unbiased).
* :func:`print_tensor`: Poplar's ``PrintTensor`` as an identity op.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from ipu_jax.kernels.codelet import Codelet

try:
  # Equations made here report the user's line, not this file's (as for
  # jax's own wrappers), in reports and lowering errors.
  from jax._src import source_info_util
  source_info_util.register_exclusion(__file__)
except (ImportError, AttributeError):  # pragma: no cover
  pass

__all__ = [
    "tile_map", "cross_replica_sum", "cross_replica_mean", "replica_index",
    "matmul", "stochastic_round", "print_tensor", "format_tensor",
    "tile_map_p", "cross_replica_sum_p", "cross_replica_mean_p",
    "replica_index_p", "matmul_p", "stochastic_round_p", "print_tensor_p",
    "REPLICA_AXIS",
]

REPLICA_AXIS = "replicas"

not_mapped = None  # jax marks an unbatched operand with a None batch dim


def _aval(shape, dtype, like=None):
  """A ShapedArray of ``shape``/``dtype`` carrying ``like``'s mesh typing."""
  if like is not None and tuple(like.shape) == tuple(shape):
    return like.update(dtype=np.dtype(dtype), weak_type=False)
  return jax.core.ShapedArray(tuple(shape), np.dtype(dtype))


def _compiled(impl: Callable) -> Callable:
  """An eager impl that runs ``impl`` compiled (as jax's primitives do).

  Eager calls then cost one cached XLA dispatch instead of one per ``jnp``
  op; the parameters are hashable, so they are static arguments.
  """
  cached = functools.lru_cache(maxsize=256)(
      lambda items: jax.jit(functools.partial(impl, **dict(items))))

  def eager(*args, **params):
    return cached(tuple(sorted(params.items())))(*args)

  return eager


# ---------------------------------------------------------------------------
# tile_map
# ---------------------------------------------------------------------------

tile_map_p = jcore.Primitive("tile_map")
tile_map_p.multiple_results = True


@dataclasses.dataclass(frozen=True, eq=False)
class _BatchedCodelet(Codelet):
  """A codelet vmapped over a batch axis (what ``vmap`` of ``tile_map`` runs).

  Each tile runs ``size`` instances of ``base`` on the slices of its batch, so
  its cycles are ``size`` times the base vertex's.
  """

  base: Optional[Codelet] = None
  in_axes: tuple = ()
  size: int = 1


def codelet_body(codelet: Codelet) -> Callable:
  """The codelet's body returning a flat tuple of arrays."""
  def fn(*args):
    return tuple(jax.tree_util.tree_leaves(codelet.fn(*args)))
  return fn


@functools.lru_cache(maxsize=1024)
def _batched_codelet(codelet: Codelet, in_axes: tuple, size: int) -> Codelet:
  inner = jax.vmap(codelet_body(codelet), in_axes=in_axes)
  return _BatchedCodelet(name=codelet.name, fn=inner, inputs=codelet.inputs,
                         outputs=codelet.outputs, inouts=codelet.inouts,
                         cycles=None, flops=None, base=codelet, in_axes=in_axes,
                         size=size)


def _unbatch_specs(codelet: "_BatchedCodelet", in_specs, out_specs):
  ins = [s if ax is None else jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
         for s, ax in zip(in_specs, codelet.in_axes)]
  outs = [jax.ShapeDtypeStruct(s.shape[1:], s.dtype) for s in out_specs]
  return ins, outs


def _codelet_specs(codelet: Codelet, in_specs, out_specs) -> list:
  """Operand specs in the codelet's field order (inputs, inouts, outputs)."""
  n_written = len(codelet.outputs) + len(codelet.inouts)
  if (len(codelet.inputs) + len(codelet.inouts) == len(in_specs)
      and n_written == len(out_specs)):
    return list(in_specs) + list(out_specs[:len(codelet.outputs)])
  return list(in_specs) + list(out_specs)


def codelet_cycles(codelet: Codelet, in_specs, out_specs) -> int:
  """Cycles of one vertex of ``codelet`` on per-tile operands ``in_specs``.

  A codelet without an estimator is costed as a streaming pass over its
  largest operand (one vector per cycle on one worker), so user code without
  a perf estimate still takes time.
  """
  if isinstance(codelet, _BatchedCodelet):
    ins, outs = _unbatch_specs(codelet, in_specs, out_specs)
    return codelet.size * codelet_cycles(codelet.base, ins, outs)
  if codelet.cycles is not None:
    return int(codelet.estimate(*_codelet_specs(codelet, in_specs, out_specs)))
  from ipu_jax.kernels.library import vector_cycles
  specs = list(in_specs) + list(out_specs)
  largest = max(specs, key=lambda s: int(np.prod(s.shape, dtype=np.int64)), default=None)
  if largest is None:
    return 0
  return vector_cycles(int(np.prod(largest.shape, dtype=np.int64)),
                       np.dtype(largest.dtype).itemsize, 1)


def codelet_flops(codelet: Codelet, in_specs, out_specs) -> int:
  """FLOPs of one vertex (0 when the codelet declares none)."""
  if isinstance(codelet, _BatchedCodelet):
    ins, outs = _unbatch_specs(codelet, in_specs, out_specs)
    return codelet.size * codelet_flops(codelet.base, ins, outs)
  if codelet.flops is None:
    return 0
  return int(codelet.flops(*_codelet_specs(codelet, in_specs, out_specs)))


def _tile_map_impl(*args, codelet, tiles):
  del tiles
  return list(jax.vmap(codelet_body(codelet))(*args))


def _tile_map_abstract_eval(*avals, codelet, tiles):
  del tiles
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
  outs = jax.eval_shape(jax.vmap(codelet_body(codelet)), *specs)
  like = avals[0] if avals else None
  return [_aval(o.shape, o.dtype, like) for o in outs]


def _tile_map_jvp(primals, tangents, *, codelet, tiles):
  outs = tile_map_p.bind(*primals, codelet=codelet, tiles=tiles)
  tangents = [ad.instantiate_zeros(t) for t in tangents]
  # The tangent is the JVP of the vmapped body: plain JAX ops, linear in the
  # tangents, so reverse mode can transpose it.
  _, out_tangents = jax.jvp(jax.vmap(codelet_body(codelet)), tuple(primals), tuple(tangents))
  return outs, list(out_tangents)


def _tile_map_batch(args, dims, *, codelet, tiles):
  # Move the batch axis just inside the tile axis: each tile runs the codelet
  # over its slice of every batch member.
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
  moved, in_axes = [], []
  for a, d in zip(args, dims):
    if d is not_mapped:
      moved.append(a)
      in_axes.append(None)
    else:
      moved.append(jnp.moveaxis(a, d, 1))
      in_axes.append(0)
  inner = _batched_codelet(codelet, tuple(in_axes), int(size))
  outs = tile_map_p.bind(*moved, codelet=inner, tiles=tiles)
  return outs, [1] * len(outs)


tile_map_p.def_impl(_compiled(_tile_map_impl))
tile_map_p.def_abstract_eval(_tile_map_abstract_eval)
ad.primitive_jvps[tile_map_p] = _tile_map_jvp
batching.primitive_batchers[tile_map_p] = _tile_map_batch
mlir.register_lowering(tile_map_p, mlir.lower_fun(_tile_map_impl, multiple_results=True))


def tile_map(codelet, *args, tiles: Optional[Sequence[int]] = None):
  """Run ``codelet`` on chosen tiles, one slice of every operand per tile.

  Like TessellateIPU's ``tile_map``: every operand's leading axis is the tile
  axis; tile ``tiles[i]`` runs one vertex of ``codelet`` on slice ``i`` of each
  operand, and the results are stacked along a new leading tile axis, i.e. the
  result is ``jax.vmap(codelet.fn)(*args)``.

  Example::

    @ipu_jax.graph.codelet(inputs=("x",), outputs=("y",), cycles=lambda x, y: 20)
    def scale(x):
      return 2.0 * x

    y = ipu_jax.ops.tile_map(scale, jnp.ones((4, 8)), tiles=[3, 5, 7, 9])

  Args:
    codelet: a :class:`~ipu_jax.kernels.codelet.Codelet` (from
      ``ipu_jax.graph.codelet``), or a plain function (costed as a streaming
      pass over its largest operand).
    *args: arrays whose leading axis has one entry per tile.
    tiles: tile id of each slice (``len(tiles) == args[0].shape[0]``);
      default ``range(n)``.

  Returns:
    The codelet's outputs (same pytree as ``codelet.fn`` returns), each with a
    leading tile axis.
  """
  if not isinstance(codelet, Codelet):
    if not callable(codelet):
      raise TypeError(f"tile_map: expected a Codelet or a function, got {codelet!r}")
    codelet = Codelet(getattr(codelet, "__name__", "codelet"), codelet)
  if not args:
    raise ValueError("tile_map needs at least one operand (the tile axis).")
  args = [jnp.asarray(a) for a in args]
  for a in args:
    if a.ndim == 0:
      raise ValueError("tile_map operands need a leading tile axis; got a scalar.")
  n = args[0].shape[0]
  if any(a.shape[0] != n for a in args):
    raise ValueError("tile_map operands must share the leading tile axis; got shapes "
                     f"{[tuple(a.shape) for a in args]}.")
  tiles = tuple(range(n)) if tiles is None else tuple(int(t) for t in np.asarray(tiles).reshape(-1))
  if len(tiles) != n:
    raise ValueError(f"tile_map: {len(tiles)} tiles given for {n} slices.")
  if any(t < 0 for t in tiles):
    raise ValueError(f"tile_map: tile ids must be non-negative, got {tiles}.")
  specs = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in args]
  out_tree = jax.tree_util.tree_structure(jax.eval_shape(codelet.fn, *specs))
  outs = tile_map_p.bind(*args, codelet=codelet, tiles=tiles)
  return jax.tree_util.tree_unflatten(out_tree, outs)


# ---------------------------------------------------------------------------
# Cross-replica collectives
# ---------------------------------------------------------------------------

cross_replica_sum_p = jcore.Primitive("cross_replica_sum")
cross_replica_mean_p = jcore.Primitive("cross_replica_mean")
replica_index_p = jcore.Primitive("replica_index")


def _axes(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def axis_is_bound(axis_name) -> bool:
  """Whether every name in ``axis_name`` is bound by an enclosing transform.

  A name is bound inside ``vmap(..., axis_name=...)``, ``shard_map`` or
  ``pmap`` (while tracing, and while lowering their bodies). JAX raises
  ``NameError('unbound axis name: ...')`` from a collective over a name that
  is not bound; that is the test.
  """
  try:
    lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def replica_count(axis_name) -> Optional[int]:
  """The static size of the bound replica axis, or ``None`` if unbound/unknown."""
  try:
    size = lax.axis_size(axis_name)
  except NameError:
    return None
  try:
    return int(size)
  except Exception:  # a traced size (inside shard_map lowering)
    return None


def apply_collective(kind: str, x, axis_name):
  """``psum``/``pmean`` of ``x`` over ``axis_name`` if bound, else ``x``.

  Used by the impls here and by the tile program's collective steps, which
  run inside the replica ``vmap``/``shard_map`` of the training layer.
  """
  if not axis_is_bound(axis_name):
    return x
  if kind == "sum":
    return lax.psum(x, axis_name)
  return lax.pmean(x, axis_name)


def replica_index_value(axis_name):
  """``lax.axis_index(axis_name)`` if bound, else 0 (one replica)."""
  if not axis_is_bound(axis_name):
    return jnp.zeros((), jnp.int32)
  return lax.axis_index(axis_name).astype(jnp.int32)


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
    keep = frozenset(a for a in varying if a not in _axes(axis_name))
    if keep != varying:
      return x.update(manual_axis_type=mat.update(varying=keep))
  return x


def _make_collective(prim, kind):
  def impl(x, *, axis_name):
    return apply_collective(kind, x, axis_name)

  def transpose(ct, x, *, axis_name):
    lost = _varying(x.aval) - _varying(_typeof(ct))
    lost &= frozenset(_axes(axis_name))
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
    axes = _axes(axis_name)
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

  prim.def_impl(_compiled(impl))
  prim.def_abstract_eval(_collective_abstract_eval)
  ad.deflinear2(prim, transpose)
  batching.fancy_primitive_batchers[prim] = batch
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))


_make_collective(cross_replica_sum_p, "sum")
_make_collective(cross_replica_mean_p, "mean")


def _replica_index_abstract_eval(*, axis_name):
  del axis_name
  return jax.core.ShapedArray((), np.dtype(np.int32))


def _replica_index_batch(axis_data, vals, dims, *, axis_name):
  del vals, dims
  axes = _axes(axis_name)
  if axis_data.name not in axes:
    return replica_index_p.bind(axis_name=axis_name), not_mapped
  return lax.iota(np.int32, axis_data.size), 0


replica_index_p.def_impl(_compiled(lambda *, axis_name: replica_index_value(axis_name)))
replica_index_p.def_abstract_eval(_replica_index_abstract_eval)
batching.fancy_primitive_batchers[replica_index_p] = _replica_index_batch
mlir.register_lowering(replica_index_p, mlir.lower_fun(
    lambda *, axis_name: replica_index_value(axis_name), multiple_results=False))


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
# matmul
# ---------------------------------------------------------------------------

matmul_p = jcore.Primitive("ipu_matmul")

_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _batch_shape(a_shape, b_shape):
  return tuple(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))


def _matmul_impl(a, b, *, available_memory_proportion, partials_type):
  del available_memory_proportion
  out_dtype = a.dtype
  if np.dtype(out_dtype) in _HALF:
    acc = jnp.float16 if partials_type == "float16" else jnp.float32
    return jnp.matmul(a, b, preferred_element_type=acc).astype(out_dtype)
  return jnp.matmul(a, b)


def _matmul_abstract_eval(a, b, *, available_memory_proportion, partials_type):
  del available_memory_proportion, partials_type
  if a.ndim < 2 or b.ndim < 2:
    raise TypeError(f"ipu_matmul needs operands of rank >= 2, got {a.shape} and {b.shape}.")
  if a.shape[-1] != b.shape[-2]:
    raise TypeError(f"ipu_matmul: contracting dimensions differ: {a.shape} @ {b.shape}.")
  if a.dtype != b.dtype:
    raise TypeError(f"ipu_matmul: operand dtypes differ: {a.dtype} and {b.dtype}.")
  shape = _batch_shape(a.shape, b.shape) + (a.shape[-2], b.shape[-1])
  return _aval(shape, a.dtype, a)


def _sum_to_shape(x, shape):
  """Sum the leading/broadcast axes of ``x`` so it has ``shape``."""
  shape = tuple(shape)
  extra = x.ndim - len(shape)
  if extra:
    x = jnp.sum(x, axis=tuple(range(extra)))
  axes = tuple(i for i, (s, t) in enumerate(zip(x.shape, shape)) if t == 1 and s != 1)
  if axes:
    x = jnp.sum(x, axis=axes, keepdims=True)
  return x


def _mT(x):
  return jnp.swapaxes(x, -1, -2)


def _matmul_transpose_lhs(ct, a, b, **params):
  shape = a.aval.shape
  return _sum_to_shape(matmul_p.bind(ct, _mT(b), **params), shape).astype(a.aval.dtype)


def _matmul_transpose_rhs(ct, a, b, **params):
  shape = b.aval.shape
  return _sum_to_shape(matmul_p.bind(_mT(a), ct, **params), shape).astype(b.aval.dtype)


def _matmul_batch(args, dims, **params):
  a, b = args
  da, db = dims
  if da is not not_mapped and db is not_mapped and b.ndim == 2:
    # x @ W with W shared: fold the batch into the rows (one larger GEMM).
    a = jnp.moveaxis(a, da, 0)
    size = a.shape[0]
    rows = a.reshape((-1, a.shape[-1]))
    out = matmul_p.bind(rows, b, **params)
    return out.reshape(a.shape[:-1] + (b.shape[-1],)), 0
  if da is not_mapped and db is not not_mapped and a.ndim == 2:
    # A @ x with A shared: fold the batch into the columns.
    b = jnp.moveaxis(b, db, -2)                       # [..., K, B, N]
    k, size, n = b.shape[-3], b.shape[-2], b.shape[-1]
    cols = b.reshape(b.shape[:-3] + (k, size * n))
    out = matmul_p.bind(a, cols, **params)            # [..., M, B*N]
    out = out.reshape(out.shape[:-1] + (size, n))
    return out, out.ndim - 2
  # General: the batch becomes a leading batch dimension of both operands
  # (size 1 for an unbatched operand; matmul broadcasts batch dimensions).
  a = jnp.moveaxis(a, da, 0) if da is not not_mapped else a[None]
  b = jnp.moveaxis(b, db, 0) if db is not not_mapped else b[None]
  # Align ranks so the new axis is the leading batch axis of both.
  rank = max(a.ndim, b.ndim)
  a = a.reshape(a.shape[:1] + (1,) * (rank - a.ndim) + a.shape[1:])
  b = b.reshape(b.shape[:1] + (1,) * (rank - b.ndim) + b.shape[1:])
  return matmul_p.bind(a, b, **params), 0


matmul_p.def_impl(_compiled(_matmul_impl))
matmul_p.def_abstract_eval(_matmul_abstract_eval)
ad.defbilinear(matmul_p, _matmul_transpose_lhs, _matmul_transpose_rhs)
batching.primitive_batchers[matmul_p] = _matmul_batch
mlir.register_lowering(matmul_p, mlir.lower_fun(_matmul_impl, multiple_results=False))


def matmul(a, b, available_memory_proportion: Optional[float] = None,
           partials_type: Optional[str] = None):
  """``jnp.matmul(a, b)`` with poplin's per-op planning options.

  Args:
    a, b: arrays; 1-D operands are promoted as ``jnp.matmul`` does and batch
      dimensions broadcast.
    available_memory_proportion: overrides ``matmuls.available_memory_proportion``
      for this op's plan: the fraction of tile memory its temporaries may use.
    partials_type: overrides ``matmuls.partials_type`` (``"float32"`` or
      ``"float16"``): the accumulation type for half-precision operands.
  """
  if available_memory_proportion is not None:
    amp = float(available_memory_proportion)
    if not 0 < amp <= 1:
      raise ValueError(f"available_memory_proportion must be in (0, 1], got {amp}.")
    available_memory_proportion = amp
  if partials_type is not None:
    partials_type = np.dtype(partials_type).name
    if partials_type not in ("float32", "float16"):
      raise ValueError(f"partials_type must be 'float32' or 'float16', got {partials_type!r}.")
  a, b = jnp.asarray(a), jnp.asarray(b)
  if a.ndim == 0 or b.ndim == 0:
    raise ValueError("matmul: operands must have at least one dimension.")
  dtype = jnp.promote_types(a.dtype, b.dtype)
  if not jnp.issubdtype(dtype, jnp.floating):
    dtype = jnp.dtype(dtype)
  a, b = a.astype(dtype), b.astype(dtype)
  squeeze = []
  if a.ndim == 1:
    a = a[None, :]
    squeeze.append(-2)
  if b.ndim == 1:
    b = b[:, None]
    squeeze.append(-1)
  out = matmul_p.bind(a, b, available_memory_proportion=available_memory_proportion,
                      partials_type=partials_type)
  if squeeze:
    out = jnp.squeeze(out, axis=tuple(squeeze))
  return out


# ---------------------------------------------------------------------------
# Stochastic rounding
# ---------------------------------------------------------------------------

stochastic_round_p = jcore.Primitive("stochastic_round")


def _key_impl_name(key) -> Tuple[Any, str]:
  """(key operand, PRNG impl name) for a typed key or raw uint32 key data."""
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key, str(jax.random.key_impl(key))
  key = jnp.asarray(key)
  if key.dtype != jnp.uint32:
    raise TypeError(f"stochastic_round: key must be a PRNG key, got {key.dtype}.")
  return key, str(jax.config.jax_default_prng_impl)


def _typed_keys(key, impl: str):
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key, impl=impl)


def random_bits_for(key, shape, impl: str):
  """uint32 random bits of ``shape``: ``jax.random.bits`` of each key.

  ``key`` is a typed key array (or its raw data) of shape ``K``; each key
  draws the bits of its block ``x[k]`` of an ``x`` of shape ``K + rest``.
  """
  keys = _typed_keys(key, impl)
  kshape = tuple(keys.shape)
  rest = tuple(shape)[len(kshape):]
  if not kshape:
    return jax.random.bits(keys, rest, jnp.uint32)
  flat = keys.reshape(-1)
  bits = jax.vmap(lambda k: jax.random.bits(k, rest, jnp.uint32))(flat)
  return bits.reshape(tuple(shape))


def round_with_bits(x, bits, dtype):
  """Stochastically round fp32 ``x`` to ``dtype`` using uint32 ``bits``.

  bfloat16 keeps the top 16 bits of a float32, so the IPU's method is exact
  here: add a uniform 16-bit integer to the float32 bit pattern and truncate
  the low 16 bits. The carry into the kept bits happens with probability
  (low 16 bits) / 2^16, i.e. the distance to the lower neighbour over the
  spacing: E[round(x)] = x, for subnormals too (sign-magnitude: the magnitude
  rounds away from zero with that probability).

  float16 has its own exponent range, so the two neighbours lo <= x <= hi are
  found with round-to-nearest and ``nextafter``; the result is hi when a
  uniform u in [0, 1) (24 random bits) is below (x - lo) / (hi - lo). That
  fraction is exact in float32 and a multiple of 2^-24 for |x| >= 2^-38, so
  P(hi) equals it exactly (below that, fp16 rounds to 0 or 2^-24 with a bias
  under 2^-24 of the spacing).

  Non-finite inputs and magnitudes beyond the largest finite value of
  ``dtype`` are rounded to nearest, as a plain cast would.
  """
  dtype = np.dtype(dtype)
  x = x.astype(jnp.float32)
  nearest = x.astype(dtype)
  finfo = jnp.finfo(dtype)
  special = ~jnp.isfinite(x) | (jnp.abs(x) > jnp.float32(finfo.max))
  if dtype == np.dtype(jnp.bfloat16):
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    summed = raw + (bits >> 16)
    rounded = lax.bitcast_convert_type((summed >> 16).astype(jnp.uint16), jnp.bfloat16)
  elif dtype == np.dtype(jnp.float16):
    near32 = nearest.astype(jnp.float32)
    below = near32 <= x
    lo = jnp.where(below, nearest, jnp.nextafter(nearest, jnp.float16(-jnp.inf)))
    hi = jnp.where(below, jnp.nextafter(nearest, jnp.float16(jnp.inf)), nearest)
    lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
    frac = (x - lo32) / (hi32 - lo32)
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)
    rounded = jnp.where(u < frac, hi, lo)
    rounded = jnp.where(near32 == x, nearest, rounded)
  else:
    raise TypeError(f"stochastic_round to {dtype} is not supported (float16 or bfloat16).")
  return jnp.where(special, nearest, rounded)


def _stochastic_round_impl(x, key, *, dtype, impl):
  bits = random_bits_for(key, x.shape, impl)
  return round_with_bits(x, bits, dtype)


def _key_batch_shape(key_aval):
  if jax.dtypes.issubdtype(key_aval.dtype, jax.dtypes.prng_key):
    return tuple(key_aval.shape)
  return tuple(key_aval.shape[:-1])


def _stochastic_round_abstract_eval(x, key, *, dtype, impl):
  del impl
  if x.dtype != np.dtype(np.float32):
    raise TypeError(f"stochastic_round takes float32 input, got {x.dtype}.")
  kb = _key_batch_shape(key)
  if tuple(x.shape[:len(kb)]) != kb:
    raise TypeError(f"stochastic_round: key batch shape {kb} does not prefix {x.shape}.")
  return _aval(x.shape, dtype, x)


def _stochastic_round_jvp(primals, tangents, *, dtype, impl):
  x, key = primals
  tx, _ = tangents
  out = stochastic_round_p.bind(x, key, dtype=dtype, impl=impl)
  # Straight-through: d round(x) / dx = 1.
  if type(tx) is ad.Zero:
    return out, ad.Zero.from_primal_value(out)
  return out, tx.astype(dtype)


def _stochastic_round_batch(args, dims, *, dtype, impl):
  x, key = args
  dx, dk = dims
  size = x.shape[dx] if dx is not not_mapped else (
      key.shape[dk] if dk is not not_mapped else 1)
  x = jnp.moveaxis(x, dx, 0) if dx is not not_mapped else jnp.broadcast_to(x, (size,) + x.shape)
  if dk is not not_mapped:
    key = jnp.moveaxis(key, dk, 0)
  else:
    # Every batch member draws the same bits, as the unbatched op would.
    key = jnp.broadcast_to(key, (size,) + key.shape)
  return stochastic_round_p.bind(x, key, dtype=dtype, impl=impl), 0


stochastic_round_p.def_impl(_compiled(_stochastic_round_impl))
stochastic_round_p.def_abstract_eval(_stochastic_round_abstract_eval)
ad.primitive_jvps[stochastic_round_p] = _stochastic_round_jvp
batching.primitive_batchers[stochastic_round_p] = _stochastic_round_batch
mlir.register_lowering(stochastic_round_p, mlir.lower_fun(_stochastic_round_impl,
                                                          multiple_results=False))


def stochastic_round(x, dtype, key):
  """Round float32 ``x`` to ``dtype`` stochastically, as the IPU can.

  Each element becomes one of its two neighbouring ``dtype`` values, the
  upper with probability proportional to the distance from the lower, so the
  rounding is unbiased: ``E[stochastic_round(x)] == x``. Infinities, NaNs and
  values beyond the largest finite ``dtype`` value round to nearest. The
  gradient is straight-through (the derivative is 1, cast to ``dtype``).

  Args:
    x: a float32 array.
    dtype: ``jnp.float16`` or ``jnp.bfloat16``.
    key: a PRNG key (typed, or raw ``uint32`` key data); the same key gives
      the same result. The bits are ``jax.random.bits(key, x.shape)``.
  """
  dtype = np.dtype(dtype)
  if dtype not in _HALF:
    raise ValueError(f"stochastic_round: dtype must be float16 or bfloat16, got {dtype}.")
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"stochastic_round takes a floating point array, got {x.dtype}.")
    x = x.astype(jnp.float32)
  key, impl = _key_impl_name(key)
  return stochastic_round_p.bind(x, key, dtype=dtype, impl=impl)


# ---------------------------------------------------------------------------
# print_tensor
# ---------------------------------------------------------------------------

print_tensor_p = jcore.Primitive("print_tensor")


def format_tensor(value) -> str:
  """Poplar's PrintTensor format: ``[1.0000000 1.5000000]``."""
  from ipu_jax.lowering.executor import format_tensor as fmt
  return fmt(np.asarray(value))


def _print_host(title, value):
  sys.stdout.write(f"{title}: {format_tensor(value)}\n")
  sys.stdout.flush()


def _print_tensor_impl(x, *, title):
  jax.debug.callback(functools.partial(_print_host, title), x, ordered=True)
  return x


def _print_tensor_abstract_eval(x, *, title):
  del title
  from jax._src import debugging
  return x, {debugging.ordered_debug_effect}


def _print_tensor_jvp(primals, tangents, *, title):
  (x,), (t,) = primals, tangents
  return print_tensor_p.bind(x, title=title), t


def _print_tensor_batch(args, dims, *, title):
  # The whole batch is printed at once (stacked along the batch axis).
  (x,), (d,) = args, dims
  return print_tensor_p.bind(x, title=title), d


print_tensor_p.def_impl(_compiled(_print_tensor_impl))
print_tensor_p.def_effectful_abstract_eval(_print_tensor_abstract_eval)
ad.primitive_jvps[print_tensor_p] = _print_tensor_jvp
batching.primitive_batchers[print_tensor_p] = _print_tensor_batch
mlir.register_lowering(print_tensor_p, mlir.lower_fun(_print_tensor_impl,
                                                      multiple_results=False))


def print_tensor(x, title: str = ""):
  """Print ``x`` on the host like Poplar's ``PrintTensor`` and return it.

  The line is ``"{title}: [1.0000000 1.5000000]"`` (see
  :func:`format_tensor`); prints happen in program order. Under ``jax.grad``
  only the primal value is printed.
  """
  return print_tensor_p.bind(jnp.asarray(x), title=str(title))
