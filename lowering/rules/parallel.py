"""Collectives over named axes, ``shard_map`` / ``pmap``, and the IPU replica ops.

What a named axis means on the emulated IPU
-------------------------------------------

* **A vmapped axis** (``jax.vmap(step, axis_name="b")``) is a batch dimension
  of the operands inside ONE program: vmap's batching rules rewrite
  ``pmean``, ``all_gather``, ``axis_index``, ``psum_scatter``, ``ppermute``
  and ``all_to_all`` into ordinary primitives (reductions, broadcasts, iotas,
  gathers, transposes) that their own rules lower; ``psum`` / ``pmax`` /
  ``pmin`` keep their primitive with positional ``axes`` and are lowered here
  as the tile reductions ``reduce_sum`` / ``reduce_max`` / ``reduce_min``.
  Nothing crosses an IPU-Link: the batch lives on the tiles like any tensor.
* **A shard_map / pmap axis** (``jax.pmap(f, axis_name="i")`` traces to
  ``shard_map`` over a one-axis device mesh) is an axis of IPU *replicas*,
  as in the replicated training of :mod:`ipu_jax.keras.replication`: the
  mesh's ``R`` points (the product of its axis sizes) are ``R`` replicas, each
  running the body on its own IPUs (the target: one replica's IPUs). The body
  is lowered ONCE, on the per-shard shapes, inside a
  :class:`~ipu_jax.lowering.program.Replicated` control program; the
  executor runs it under one ``vmap`` per mesh axis bound to the axis's name,
  so the steps' collectives compute the real cross-replica values.
* **A replica axis bound around the whole program** (the training layer runs
  a lowered step inside ``vmap``/``shard_map`` over ``"replicas"``) is seen
  by ``lax.axis_size`` while lowering; collectives over it are replica
  collectives too.

Meshes of several axes are lowered (the replicas are the mesh's points, a
collective over a tuple of names spans the product of their sizes). A
collective over a name that is none of these, a ``shard_map`` that leaves
mesh axes of size > 1 automatic (``axis_names=`` a subset) and
``axis_index_groups`` raise ``LoweringError`` naming the primitive, its
operands and the source line.

Tile plans and costs
--------------------

* Entering a ``shard_map``: outside the region the program's tensors are the
  global arrays, which every replica holds (the replicated part of a
  replicated program). Each replica slices its shard (``axis_index`` of the
  spec's axes) into a linearly mapped per-shard tensor; the exchange is the
  on-IPU movement of replica 0's shard (every replica does the same on its own
  IPU). An unsharded input is used in place.
* Inside: one replica's steps, costed once (the replicas run side by side);
  memory per tile is one replica's body tensors (plus the global arrays
  around the region), as the replicated training reports one replica.
* Collectives over replica axes (``psum``, ``pmean`` as ``psum`` and a divide,
  ``pmax``, ``pmin``, ``psum_invariant``, ``cross_replica_sum/mean``) are a
  ring all-reduce over the IPU-Links (:func:`all_reduce_cost`): the tensor
  stays where it is; each tile sends and receives ``2 (R - 1) / R`` of its
  bytes (reduce-scatter then all-gather), each IPU as many over its links,
  and each tile combines the ``(R - 1) / R`` share of its elements it reduces.
  The one-phase collectives use the same cost (:func:`collective_cost`) with
  ``(R - 1) / R``: ``all_gather`` of the gathered bytes (plus the on-IPU move
  of the replica's own block), ``psum_scatter`` of the input bytes (with the
  adds; plus the move of the replica's reduced block into its result),
  ``all_to_all`` of the input bytes; ``ppermute`` and ``pbroadcast`` send
  every byte once.
* Leaving: an output sharded over mesh axes stays on its replicas, one block
  each (pmap's outputs stay on their devices): the step costs placing the
  replica's block in the global array's layout on its own IPU, and no link
  traffic; the executor stacks the blocks (an ``all_gather``) only to hand the
  host the global value. A replicated output (spec without those axes) is the
  body's tensor itself, replica 0's copy. So the IPU-Link traffic of a
  ``pmap`` step is that of the collectives the user wrote.
* ``axis_index`` / ``replica_index``: one vertex writes the index into a
  scalar.

With no axis in scope the IPU ops ``cross_replica_sum/mean`` keep their old
meaning: ``R`` is ``ctx.replication_factor`` (the config's replicas; 1 when
unset) and their step is the identity on one replica's data.
"""

from __future__ import annotations

import contextlib

import numpy as np
from jax import lax

from ipu_jax.kernels import collectives
from ipu_jax.lowering.jax_compat import core as jax_core
from ipu_jax.lowering.jax_compat import lax_parallel
from ipu_jax.lowering.jax_compat import shard_map as shard_map_lib
from ipu_jax.lowering.errors import LoweringError
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, logical, storage, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import ExchangeCost, movement_cost
from ipu_jax.lowering.registry import get_lowering, register_lowering
from ipu_jax.lowering.rules.control import lower_inline
from ipu_jax.lowering.replica_axis import bound_axes, replica_count

__all__ = ["all_reduce_cost", "binding_axes", "block_positions", "collective_cost",
           "collective_groups", "emit_collective", "move_cost", "named_axis_size", "one_phase",
           "replica_layout", "replication_factor", "system_link_cycles"]


# ---------------------------------------------------------------------------
# Which named axes are in scope
# ---------------------------------------------------------------------------


def _names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _operands_text(ctx) -> str:
  return ", ".join(a.str_short() for a in ctx.in_avals) or "none"


def named_axis_size(ctx, axis_name) -> int:
  """Replicas spanned by a collective over ``axis_name`` (a name or a tuple).

  A name is a mesh axis of an enclosing ``shard_map``/``pmap`` being lowered,
  or an axis JAX has bound around the whole program.

  Raises:
    LoweringError: a name that is neither, naming the primitive, operands,
      axis and source line.
  """
  mesh = ctx.mesh_axes
  size = 1
  for name in _names(axis_name):
    if name in mesh:
      size *= int(mesh[name])
      continue
    bound = replica_count(name)
    if bound is None:
      raise LoweringError(
          f"Primitive '{ctx.op}' (operands: {_operands_text(ctx)}) at "
          f"{ctx.source or 'an unknown source line'} is a collective over axis "
          f"{name!r}, which is neither a vmapped axis nor an axis of an enclosing "
          f"shard_map/pmap (axes in scope: {sorted(mesh) or 'none'}).")
    size *= max(1, int(bound))
  return size


def replication_factor(ctx, axis_name) -> int:
  """Replicas an IPU ``cross_replica_*`` op spans (see the module docstring)."""
  mesh = ctx.mesh_axes
  if all(name in mesh for name in _names(axis_name)):
    return named_axis_size(ctx, axis_name)
  bound = replica_count(axis_name)
  if bound is not None:
    return max(1, bound)
  return ctx.replication_factor


def replica_layout(ctx) -> tuple:
  """The replica axes in scope, outermost first: ``((name, size), ...)``.

  The axes JAX has bound around the whole program (``vmap``/``shard_map``
  of the training layer, :func:`binding_axes`), in the order they were bound,
  then the mesh axes of the enclosing ``shard_map``/``pmap`` regions. Replica
  ``r`` is the mixed-radix number of its indices along them (the last axis
  varies fastest), as the executor's nested ``vmap``s number them.
  """
  layout = dict(bound_axes())
  for name, size in ctx.mesh_axes.items():
    layout.pop(name, None)
    layout[name] = int(size)
  return tuple(layout.items())


def collective_groups(ctx, axis_name, replicas: int) -> tuple:
  """``(num_replicas, replica_groups)`` of a collective over ``axis_name``.

  Over axes of the :func:`replica_layout`: the replicas that agree on every
  other axis form a group (in a ``(dp, tp)`` layout a ``tp`` collective's
  groups are ``tp`` consecutive replicas, a ``dp`` one's are ``tp`` apart:
  PopXL's ``replica_grouping(group_size, stride)``). Otherwise (an IPU op
  over the config's replicas, no axis bound) one group of ``replicas``.
  """
  layout = replica_layout(ctx)
  bound = {name for name, _ in layout}
  names = _names(axis_name) if axis_name is not None else ()
  if names and all(name in bound for name in names):
    total = int(np.prod([size for _, size in layout], dtype=np.int64))
    return total, collectives.axis_groups(layout, names)
  return replicas, [list(range(replicas))]


@contextlib.contextmanager
def binding_axes(axes):
  """Binds the named ``axes`` (``[(name, size), ...]``, outermost first) around
  what runs inside: tracing sees them as ``vmap`` axes and the lowering reads
  them (:func:`replica_layout`), so a program lowered once for one replica
  prices its collectives over the replica groups the axes make."""
  with jax_core.extend_axis_env_nd([(name, int(size)) for name, size in axes]):
    yield


def _reject_groups(ctx, axis_index_groups) -> None:
  if axis_index_groups is not None:
    raise LoweringError(
        f"Primitive '{ctx.op}' (operands: {_operands_text(ctx)}) at "
        f"{ctx.source or 'an unknown source line'}: axis_index_groups="
        f"{axis_index_groups!r} is not supported; use a mesh axis per group.")


# ---------------------------------------------------------------------------
# The cost of a collective over the IPU-Links
# ---------------------------------------------------------------------------


def collective_cost(ctx, tensor: P.Tensor, share: float, reduce_replicas: int = 0,
                    op_name: str = "add", kind: str | None = None, replicas: int = 0,
                    axis_name=None):
  """(exchange, compute) of a collective moving ``share`` of ``tensor``'s bytes.

  Each tile sends and receives ``share`` of the bytes it holds of ``tensor``;
  each IPU sends the same share of the bytes it holds over its IPU-Links (a
  target with fewer IPUs than the replicas keeps the replica's IPUs: the
  tensor's IPUs). With ``reduce_replicas = R`` each tile also combines
  (``op_name``) the ``(R - 1) / R`` share of its elements it reduces.

  With ``kind`` (a :data:`ipu_jax.kernels.collectives.KINDS` name) over
  ``replicas`` (default ``reduce_replicas``) and a target on an
  ``IPUSystem``, the links' time is the system's price
  (:func:`system_link_cycles`), not the flat rate, over the replica groups
  a collective over ``axis_name`` makes (:func:`collective_groups`).

  Returns ``(None, None)`` when nothing moves.
  """
  target = ctx.target
  if share <= 0 or tensor.size == 0:
    return None, None
  on_tile = tensor.mapping.bytes_per_tile(target.num_tiles, tensor.itemsize)
  tile_bytes = np.ceil(on_tile * share).astype(np.int64)
  ipu = np.arange(target.num_tiles) // target.tiles_per_ipu
  on_ipu = np.bincount(ipu, weights=on_tile, minlength=target.num_ipus)[:target.num_ipus]
  link = np.ceil(on_ipu * share).astype(np.int64)
  link_cycles = None
  if target.system is not None and kind is not None:
    num_replicas, groups = collective_groups(ctx, axis_name, replicas or reduce_replicas)
    link_cycles = system_link_cycles(target, kind, replicas or reduce_replicas, on_ipu,
                                     groups=groups, num_replicas=num_replicas)
  notes = () if link_cycles is None else (
      f"replica {kind.replace('_', '-')} priced over the {target.system.name} system's links "
      "(docs/systems.md#collectives)",)
  exchange = ExchangeCost(tile_bytes, tile_bytes.copy(), link, link_cycles, notes)
  compute = None
  if reduce_replicas > 1:
    elements = tensor.mapping.elements_per_tile(target.num_tiles)
    combined = -(-elements * (reduce_replicas - 1) // reduce_replicas)
    compute = estimators.elementwise_cycles(target, combined, op_name, tensor.itemsize)
  return exchange, compute


def system_link_cycles(target, kind, replicas: int, on_ipu: np.ndarray, groups=None,
                       num_replicas: int | None = None):
  """The links' time of collective ``kind`` over ``replicas`` replicas of
  ``target``'s IPUs on ``target.system``, each IPU's group reducing the
  ``on_ipu`` bytes it holds (``None``: no system, or no kind).

  Replica ``r`` holds the system's IPUs ``r * num_ipus ...``; ``groups``
  (replica groups of ``replicas`` each, out of ``num_replicas``; default one
  group of all ``replicas``) say which replicas take part together; IPU
  ``j`` of every replica of a group forms one IPU group, all groups at once
  (:mod:`ipu_jax.kernels.collectives`).
  """
  if target.system is None or kind is None or replicas <= 1:
    return None
  if groups is None:
    groups, num_replicas = [list(range(replicas))], replicas
  ipus = [j for j in range(target.num_ipus) if on_ipu[j] > 0]
  ipu_groups = collectives.ipu_groups(target.system, groups, num_replicas or replicas,
                                      target.num_ipus, ipus)
  per_group = [float(on_ipu[j]) for _ in groups for j in ipus]
  cost = collectives.collective(kind, target, ipu_groups, per_group)
  return cost.cycles


def all_reduce_cost(ctx, tensor: P.Tensor, replicas: int, op_name: str = "add",
                    axis_name=None):
  """(exchange, compute) of a ring all-reduce of ``tensor`` over ``replicas``.

  Reduce-scatter then all-gather: ``2 (R - 1) / R`` of every tile's bytes
  (see :func:`collective_cost`; ``axis_name``: the axes it spans, for the
  replica groups a system prices).
  """
  if replicas <= 1:
    return None, None
  return collective_cost(ctx, tensor, 2.0 * (replicas - 1) / replicas, replicas, op_name,
                         kind="all_reduce", axis_name=axis_name)


def one_phase(replicas: int) -> float:
  return (replicas - 1) / replicas if replicas > 1 else 0.0


def block_positions(shape, block_shape) -> np.ndarray:
  """Flat positions (in ``shape``) of the leading block of ``block_shape``."""
  index = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(shape)
  return index[tuple(slice(0, b) for b in block_shape)].reshape(-1)


def move_cost(ctx, src: P.Tensor, src_positions, dst: P.Tensor, dst_positions):
  """On-IPU exchange of elements ``src[src_positions] -> dst[dst_positions]``."""
  if src.size == 0 or dst.size == 0:
    return None
  src_tile = src.mapping.element_tile
  dst_tile = dst.mapping.element_tile
  src_tile = src_tile if src_positions is None else src_tile[src_positions]
  dst_tile = dst_tile if dst_positions is None else dst_tile[dst_positions]
  return movement_cost(ctx.target, src_tile, dst_tile, src.itemsize)


# ---------------------------------------------------------------------------
# psum / pmax / pmin (positional and named axes) and psum_invariant
# ---------------------------------------------------------------------------

_COMBINE = {"sum": (lax.psum, "add", vocab.vertex(vocab.REDUCE, "add")),
            "max": (lax.pmax, "max", vocab.vertex(vocab.REDUCE, "max")),
            "min": (lax.pmin, "min", vocab.vertex(vocab.REDUCE, "min"))}


def _emit_all_reduce(ctx, x: P.Tensor, names: tuple, kind: str) -> P.Tensor:
  replicas = named_axis_size(ctx, names)
  collective, op_name, codelet = _COMBINE[kind]
  out = ctx.like(x, name=f"p{kind}")
  exchange, compute = all_reduce_cost(ctx, x, replicas, op_name, axis_name=names)
  elements = x.mapping.elements_per_tile(ctx.target.num_tiles)
  axis = names if len(names) > 1 else names[0]

  def fn(xs):
    # Padding of the storage is combined with padding: harmless.
    return (collective(xs, axis),)

  ctx.emit(P.Superstep(
      name=f"all_reduce<{kind}>x{replicas}", op=ctx.op, reads=(x,), writes=(out,), fn=fn,
      compute_cycles=compute, exchange=exchange,
      vertices=worker_vertices(ctx, elements) if compute is not None else None,
      codelets=(codelet,) if compute is not None else (),
      flops=int(x.size * (replicas - 1)) if np.issubdtype(x.dtype, np.inexact) else 0))
  return out


def _reduce_positional(ctx, reduce_prim, x: P.Tensor, axes: tuple, out_aval) -> P.Tensor:
  """A vmapped axis's collective: the tile reduction over those dimensions."""
  return get_lowering(reduce_prim)(ctx.replace(out_avals=[out_aval]), x, axes=axes,
                                   out_sharding=None)[0]


def _make_reduce_rule(kind: str, reduce_prim):
  def rule(ctx: RuleContext, *xs, axes, axis_index_groups=None):
    _reject_groups(ctx, axis_index_groups)
    positional = tuple(a for a in axes if isinstance(a, (int, np.integer)))
    names = tuple(a for a in axes if not isinstance(a, (int, np.integer)))
    outs = []
    for x, aval in zip(xs, ctx.out_avals):
      if positional:
        # The result's aval is the reduced one (named axes keep the shape).
        x = _reduce_positional(ctx, reduce_prim, x, positional, aval)
      if names:
        x = _emit_all_reduce(ctx, x, names, kind)
      outs.append(x)
    return outs
  return rule


register_lowering(lax_parallel.psum_p, _make_reduce_rule("sum", lax.reduce_sum_p))
register_lowering(lax_parallel.pmax_p, _make_reduce_rule("max", lax.reduce_max_p))
register_lowering(lax_parallel.pmin_p, _make_reduce_rule("min", lax.reduce_min_p))


@register_lowering(lax_parallel.psum_invariant_p)
def _psum_invariant_rule(ctx: RuleContext, *xs, axes):
  # shard_map's check_vma form of psum (varying in, invariant out).
  return [_emit_all_reduce(ctx, x, _names(axes), "sum") for x in xs]


# ---------------------------------------------------------------------------
# axis_index, all_gather, psum_scatter, all_to_all, ppermute, pbroadcast
# ---------------------------------------------------------------------------


@register_lowering(lax_parallel.axis_index_p)
def _axis_index_rule(ctx: RuleContext, *, axis_name):
  named_axis_size(ctx, axis_name)
  out = ctx.new_tensor((), np.int32, name="axis_index")
  elements = out.mapping.elements_per_tile(ctx.target.num_tiles)

  def fn():
    return (storage(lax.axis_index(axis_name).astype(np.int32), out),)

  ctx.emit(P.Superstep(
      name="axis_index", op=ctx.op, reads=(), writes=(out,), fn=fn,
      compute_cycles=estimators.fill_cycles(ctx.target, elements, 4),
      vertices=(elements > 0).astype(np.int64), codelets=(vocab.AXIS_INDEX,)))
  return [out]


def emit_collective(ctx, name, x, out, fn, exchange, compute=None, codelet=None):
  elements = x.mapping.elements_per_tile(ctx.target.num_tiles)
  ctx.emit(P.Superstep(
      name=name, op=ctx.op, reads=(x,), writes=(out,),
      fn=lambda xs: (storage(fn(logical(xs, x)), out),),
      compute_cycles=compute, exchange=exchange,
      vertices=worker_vertices(ctx, elements) if compute is not None else None,
      codelets=(codelet,) if compute is not None and codelet else ()))


def _own_block(shape, dim: int, replicas: int, tiled: bool):
  """Block shape of one replica's part of ``shape`` along ``dim``."""
  block = list(shape)
  if tiled:
    block[dim] = shape[dim] // replicas
  else:
    block[dim] = 1
  return tuple(block)


def _gather_rule(ctx: RuleContext, x, *, all_gather_dimension, axis_name, axis_index_groups=None,
                 axis_size=None, tiled=False, **_):
  _reject_groups(ctx, axis_index_groups)
  replicas = named_axis_size(ctx, axis_name)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype, name="all_gather")
  dim = all_gather_dimension
  # The replica's own block is copied on its IPU; the rest arrives over the
  # links: one ring phase of the gathered bytes.
  own = block_positions(out.shape, _own_block(out.shape, dim, replicas, tiled))
  exchange, _ = collective_cost(ctx, out, one_phase(replicas), kind="all_gather",
                                replicas=replicas, axis_name=axis_name)
  exchange = add_costs(exchange, move_cost(ctx, x, None, out, own))

  def fn(v):
    return lax.all_gather(v, axis_name, axis=dim, tiled=tiled)

  emit_collective(ctx, f"all_gather x{replicas}", x, out, fn, exchange)
  return [out]


register_lowering(lax_parallel.all_gather_p, _gather_rule)
register_lowering(lax_parallel.all_gather_invariant_p, _gather_rule)


@register_lowering(lax_parallel.reduce_scatter_p)
def _reduce_scatter_rule(ctx: RuleContext, x, *, scatter_dimension, axis_name,
                         axis_index_groups=None, axis_size=None, tiled=False):
  _reject_groups(ctx, axis_index_groups)
  replicas = named_axis_size(ctx, axis_name)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype, name="psum_scatter")
  dim = scatter_dimension
  # Ring reduce-scatter (one phase of the input's bytes, with the adds);
  # the replica's reduced block then moves into its result.
  exchange, compute = collective_cost(ctx, x, one_phase(replicas), replicas,
                                      kind="reduce_scatter", axis_name=axis_name)
  block = _own_block(x.shape, dim, replicas, tiled)
  own = block_positions(x.shape, block)
  exchange = add_costs(exchange, move_cost(ctx, x, own, out, None))

  def fn(v):
    return lax.psum_scatter(v, axis_name, scatter_dimension=dim, tiled=tiled)

  # What arrives is added by the vertex that adds a matmul's partials.
  emit_collective(ctx, f"reduce_scatter x{replicas}", x, out, fn, exchange, compute,
                  vocab.vertex(vocab.REDUCE_ADD, x.dtype, x.dtype))
  return [out]


@register_lowering(lax_parallel.all_to_all_p)
def _all_to_all_rule(ctx: RuleContext, x, *, axis_name, split_axis, concat_axis,
                     axis_index_groups=None, tiled=False, **_):
  _reject_groups(ctx, axis_index_groups)
  replicas = named_axis_size(ctx, axis_name)
  aval = ctx.out_avals[0]
  out = ctx.new_tensor(aval.shape, aval.dtype, name="all_to_all")
  # Each replica keeps 1/R of its data and sends the rest, one block to each
  # other replica; the kept block (split block r -> concat block r) moves on
  # the IPU.
  exchange, _ = collective_cost(ctx, x, one_phase(replicas))
  kept = block_positions(x.shape, _own_block(x.shape, split_axis, replicas, tiled))
  placed = block_positions(out.shape, _own_block(out.shape, concat_axis, replicas, tiled))
  exchange = add_costs(exchange, move_cost(ctx, x, kept, out, placed))

  def fn(v):
    return lax.all_to_all(v, axis_name, split_axis, concat_axis, tiled=tiled)

  emit_collective(ctx, f"all_to_all x{replicas}", x, out, fn, exchange)
  return [out]


def _whole_copy(ctx, x, name, axis_name, moves, fn):
  """A collective that sends each replica's whole ``x`` to another replica
  (``moves``), or keeps it in place when no replica's data moves."""
  replicas = named_axis_size(ctx, axis_name)
  out = ctx.like(x, name=name)
  exchange, _ = collective_cost(ctx, x, 1.0 if moves else 0.0)
  emit_collective(ctx, f"{name} x{replicas}", x, out, fn, exchange)
  return [out]


@register_lowering(lax_parallel.ppermute_p)
def _ppermute_rule(ctx: RuleContext, x, *, axis_name, perm):
  perm = tuple((int(s), int(d)) for s, d in perm)
  moves = any(src != dst for src, dst in perm)
  return _whole_copy(ctx, x, "ppermute", axis_name, moves,
                     lambda v: lax.ppermute(v, axis_name, perm))


@register_lowering(lax_parallel.pbroadcast_p)
def _pbroadcast_rule(ctx: RuleContext, x, *, axis_name, source):
  moves = named_axis_size(ctx, axis_name) > 1
  return _whole_copy(ctx, x, "pbroadcast", axis_name, moves,
                     lambda v: lax.pbroadcast(v, axis_name, source))


# ---------------------------------------------------------------------------
# shard_map (and jax.pmap, which traces to it)
# ---------------------------------------------------------------------------


def _spec_dims(spec, ndim: int) -> list:
  """Mesh axis names splitting each of ``ndim`` dimensions (``()`` if none)."""
  entries = list(spec) if spec is not None else []
  dims = []
  for d in range(ndim):
    entry = entries[d] if d < len(entries) else None
    dims.append(() if entry is None else _names(entry))
  return dims


def _shard_index(dim_names: tuple, sizes: dict):
  """This replica's block along a dimension split over ``dim_names`` (major first)."""
  index = 0
  for name in dim_names:
    index = index * sizes[name] + lax.axis_index(name)
  return index


def _enter(ctx, g: P.Tensor, spec, shape, sizes: dict) -> P.Tensor:
  """The per-replica shard of the global ``g`` (``g`` itself if unsplit)."""
  dims = _spec_dims(spec, len(g.shape))
  shape = tuple(shape) + tuple(g.shape[len(shape):])  # key data's trailing dims
  if not any(dims) or shape == tuple(g.shape):
    return g  # unsplit (or split over axes of size 1): used in place
  shard = ctx.new_tensor(shape, g.dtype, name=f"{g.name}/shard")
  own = block_positions(g.shape, shape)
  exchange = move_cost(ctx, g, own, shard, None)

  def fn(gs):
    value = logical(gs, g)
    for d, names in enumerate(dims):
      if names:
        value = lax.dynamic_slice_in_dim(value, _shard_index(names, sizes) * shape[d],
                                         shape[d], d)
    return (storage(value, shard),)

  ctx.emit(P.Superstep(name="shard_map/slice", op=ctx.op, reads=(g,), writes=(shard,),
                       fn=fn, exchange=exchange))
  return shard


def _leave(ctx, s: P.Tensor, spec, shape, sizes: dict, local_ids: set) -> P.Tensor:
  """The global value of the body output ``s`` (its blocks stacked if split)."""
  dims = _spec_dims(spec, len(shape))
  shape = tuple(shape) + tuple(s.shape[len(shape):])
  if not any(dims) or shape == tuple(s.shape):
    # Replicated (or split over axes of size 1): the body's tensor itself;
    # replica 0's copy leaves the region.
    local_ids.discard(s.id)
    return s
  out = ctx.new_tensor(shape, s.dtype, name=f"{s.name}/blocks")
  local_ids.discard(out.id)
  replicas = int(np.prod([sizes[n] for names in dims for n in names], dtype=np.int64))
  # Each replica keeps its block (as pmap's outputs stay on their devices):
  # the cost is placing the block in the global layout on its own IPU. The
  # executor all-gathers the blocks only to hand the host the global value.
  exchange = move_cost(ctx, s, None, out, block_positions(out.shape, s.shape))

  def fn(ss):
    value = logical(ss, s)
    for d, names in enumerate(dims):
      if names:
        value = lax.all_gather(value, names if len(names) > 1 else names[0],
                               axis=d, tiled=True)
    return (storage(value, out),)

  ctx.emit(P.Superstep(name=f"shard_map/blocks x{replicas}", op=ctx.op, reads=(s,),
                       writes=(out,), fn=fn, exchange=exchange))
  return out


def _shard_map_rule(ctx: RuleContext, *args, jaxpr, mesh, in_specs, out_specs, **params):
  sizes = {str(name): int(size) for name, size in dict(mesh.shape).items()}
  manual = params.get("manual_axes", params.get("newly_manual_axes"))
  manual = frozenset(sizes) if manual is None else frozenset(manual)
  auto = sorted(n for n in sizes if n not in manual and sizes[n] > 1)
  if auto:
    raise LoweringError(
        f"Primitive '{ctx.op}' (operands: {_operands_text(ctx)}) at "
        f"{ctx.source or 'an unknown source line'}: mesh axes {auto} are left automatic "
        f"(shard_map axis_names={sorted(manual)}); only fully manual meshes are lowered.")
  axes = tuple((name, sizes[name]) for name in mesh.axis_names if name in manual)
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  in_shapes = [tuple(v.aval.shape) for v in inner.invars]
  out_shapes = [tuple(a.shape) for a in ctx.out_avals]
  with ctx.sub_program() as (body, local_ids), ctx.named_axes(dict(axes)):
    shards = [_enter(ctx, g, spec, shape, sizes)
              for g, spec, shape in zip(args, in_specs, in_shapes)]
    results = lower_inline(ctx, jaxpr, shards)
    outs = [_leave(ctx, s, spec, shape, sizes, local_ids)
            for s, spec, shape in zip(results, out_specs, out_shapes)]
    local = frozenset(local_ids)
  ctx.emit(P.Replicated(body, axes, local))
  return outs


register_lowering(shard_map_lib.shard_map_p, _shard_map_rule)
