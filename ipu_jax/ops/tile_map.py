"""``tile_map``: run a codelet once per tile on chosen tiles (as TessellateIPU's)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.arguments import tile_ids
from ipu_jax.kernels.codelet import Codelet

from ipu_jax.ops.primitive import shaped_like, define_primitive, not_mapped
from ipu_jax.kernels import estimators
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, storage
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import relayout, relayout_cost, to_flat
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering


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


def is_supervisor(codelet: Codelet) -> bool:
  """Whether ``codelet`` (or the codelet a batched one repeats) is a supervisor vertex."""
  while isinstance(codelet, _BatchedCodelet):
    codelet = codelet.base
  return bool(codelet.supervisor)


def codelet_cycles(codelet: Codelet, in_specs, out_specs, target=None) -> int:
  """Cycles of one vertex of ``codelet`` on per-tile operands ``in_specs``.

  A codelet without an estimator is costed as a streaming pass over its
  largest operand (one vector per cycle on one worker), so user code without
  a perf estimate still takes time. Supervisor codelets are costed for
  ``target`` (their cycles are the whole tile's).
  """
  if isinstance(codelet, _BatchedCodelet):
    ins, outs = _unbatch_specs(codelet, in_specs, out_specs)
    return codelet.size * codelet_cycles(codelet.base, ins, outs, target)
  if codelet.cycles is not None:
    return int(codelet.estimate(*_codelet_specs(codelet, in_specs, out_specs), target=target))
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
  return [shaped_like(o.shape, o.dtype, like) for o in outs]


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


define_primitive(tile_map_p, _tile_map_impl, _tile_map_abstract_eval, jvp=_tile_map_jvp,
                 batch=_tile_map_batch, multiple_results=True)


def tile_map(codelet, *args, tiles: Optional[Sequence[int]] = None):
  """Run ``codelet`` on chosen tiles, one slice of every operand per tile.

  Like TessellateIPU's ``tile_map``: every operand's leading axis is the tile
  axis; tile ``tiles[i]`` runs one vertex of ``codelet`` on slice ``i`` of each
  operand, and the results are stacked along a new leading tile axis, i.e. the
  result is ``jax.vmap(codelet.fn)(*args)``.

  Example:

  >>> import jax.numpy as jnp, ipu_jax
  >>> @ipu_jax.graph.codelet(inputs=("x",), outputs=("y",), cycles=lambda x, y: 20)
  ... def scale(x):
  ...   return 2.0 * x
  >>> run = ipu_jax.jit(lambda a: ipu_jax.ops.tile_map(scale, a, tiles=[3, 5, 7, 9]),
  ...                   target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16))
  >>> run(jnp.ones((4, 2)))
  Array([[2., 2.],
         [2., 2.],
         [2., 2.],
         [2., 2.]], dtype=float32)

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
  tiles = tuple(range(n)) if tiles is None else tile_ids(tiles, "tile_map: ")  # 0.5: not tile 0
  if len(tiles) != n:
    raise ValueError(f"tile_map: {len(tiles)} tiles given for {n} slices.")
  if any(t < 0 for t in tiles):
    raise ValueError(f"tile_map: tile ids must be non-negative, got {tiles}.")
  specs = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in args]
  out_tree = jax.tree_util.tree_structure(jax.eval_shape(codelet.fn, *specs))
  outs = tile_map_p.bind(*args, codelet=codelet, tiles=tiles)
  return jax.tree_util.tree_unflatten(out_tree, outs)


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile lowering of :func:`ipu_jax.ops.tile_map` (a user codelet on chosen tiles).
#
# Tile plan: slice ``i`` of every operand is exchanged onto tile ``tiles[i]``
# (nothing moves for slices already there); each of those tiles runs one vertex
# of the user's codelet, costed by the codelet's estimator (vertices on one tile
# share its workers as in the graph API); results stay one slice per tile.


def _size(shape) -> int:
  return int(np.prod(shape, dtype=np.int64))


def _slice_mapping(ctx, shape, dtype, tiles: np.ndarray) -> TileMapping:
  """Slice ``i`` of the leading axis on ``tiles[i]``."""
  per = _size(shape[1:])
  if per == 0 or len(tiles) == 0:
    return ctx.linear_mapping(shape, dtype)
  return TileMapping.from_element_tiles(np.repeat(tiles, per))


@register_lowering(tile_map_p)
def _tile_map_rule(ctx: RuleContext, *args, codelet, tiles):
  target = ctx.target
  tiles_arr = np.asarray(tiles, np.int64)
  if tiles_arr.size and tiles_arr.max() >= target.num_tiles:
    raise NotImplementedError(
        f"tile_map on tile {int(tiles_arr.max())}, but the target has only "
        f"{target.num_tiles} tiles")
  in_maps = [_slice_mapping(ctx, t.shape, t.dtype, tiles_arr) for t in args]
  outs = [ctx.new_tensor(a.shape, a.dtype,
                         _slice_mapping(ctx, a.shape, a.dtype, tiles_arr),
                         name=codelet.name)
          for a in ctx.out_avals]
  cost = add_costs(*[relayout_cost(target, t.mapping, m, t.itemsize)
                     for t, m in zip(args, in_maps)])
  in_specs = [jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in args]
  out_specs = [jax.ShapeDtypeStruct(o.shape[1:], o.dtype) for o in outs]
  n = tiles_arr.size
  cycles = codelet_cycles(codelet, in_specs, out_specs, target)
  compute = estimators.vertex_cycles_per_tile(target, tiles_arr, np.full(n, cycles, np.float64),
                                              supervisor=np.full(n, is_supervisor(codelet)))
  vertices = np.bincount(tiles_arr, minlength=target.num_tiles)[:target.num_tiles]
  body = codelet_body(codelet)

  def fn(*storages):
    # Exchange: every slice to its tile; compute: one vertex per tile, i.e.
    # the codelet vmapped over the tile axis.
    xs = [to_flat(relayout(s, t.mapping, m), m).reshape(t.shape)
          for s, t, m in zip(storages, args, in_maps)]
    results = jax.vmap(body)(*xs) if n else [jnp.zeros(o.shape, o.dtype) for o in outs]
    return tuple(storage(r, o) for r, o in zip(results, outs))

  ctx.emit(P.Superstep(
      name=f"tile_map<{codelet.name}>", op=ctx.op, reads=tuple(args), writes=tuple(outs),
      fn=fn, compute_cycles=compute if n else None, exchange=cost, vertices=vertices,
      codelets=(codelet.name,), flops=codelet_flops(codelet, in_specs, out_specs) * n))
  return outs
