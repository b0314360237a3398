"""Reductions: ``reduce_*``, ``argmax``/``argmin`` and the generic ``reduce``.

Reductions (``reduce_sum``, ``reduce_max``, ``reduce_min``, ``reduce_prod``,
``reduce_and``, ``reduce_or``, ``reduce_xor``, ``argmax``, ``argmin`` and the
generic ``reduce`` with a jaxpr computation) follow the plan of poplibs'
``popops::reduce``, in two compute sets:

1. **Partials.** Every tile that holds input elements reduces its own
   elements, grouped by the output element they belong to, into one partial
   per (tile, output element) pair. Nothing of the (large) input moves.
2. **Final.** The partials are exchanged to the tile of their output element
   and reduced there.

The output element of every input element is static (the ravelled index of
its non-reduced coordinates), so the grouping, the exchange and the cycles
are planned exactly with vectorised NumPy. The output is placed either on the
tile that holds the first input element of each output ("owner computes",
free for reductions over axes held whole by a tile), linearly like
``mapTensorLinearly``, or spread a grain per tile (when each output has many
partials), whichever gives the cheapest second stage. When stage 1 would reduce
nothing (every tile holds at most one element per output) the input itself is
exchanged; when stage 2 would only copy local partials it is skipped.

``argmax``/``argmin`` carry (value, index) pairs through both stages; ties go
to the smallest index and NaN wins, as in ``jax.lax.argmax``. The generic
``reduce`` assumes, as XLA does, that its computation is associative and
commutative and that the init values are its identity.

The per-tile grouping both stages start from lives in
:mod:`~ipu_jax.lowering.grouping` (shared with the scans of
:mod:`~ipu_jax.lowering.rules.cumulative`); the spec and the plan (grouping,
output placement, stage-2 costs) are :mod:`~ipu_jax.lowering.reduction_plan`'s,
and this module emits them.

Execution: each step's logical form computes the result with the primitive
itself on the logical array (so reductions equal ``jax.jit``'s, up to XLA's
summation order) and passes it through the planned steps (the ``"batched"``
executor runs it); its ``fn`` (the ``"per_tile"`` executor's) genuinely runs
the plan: each tile's storage is rearranged by a static gather into
``[groups, members]`` and reduced with the primitive along the last axis.
Both have the same steps, exchanges, cycles and memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import lax_internal
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.builders import add_costs, broadcast_cost, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import take_or_fill
from ipu_jax.lowering.movement import alias
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.grouping import gather_or_fill
from ipu_jax.lowering.reduction_plan import (PerTileTables, ReductionInits, ReductionPlan,
                                             ReductionSpec, Stage2Plan, arg_spec, generic_spec,
                                             monoid_spec, place_outputs, plan_reduction,
                                             reduce_step_cycles, skips_stage2)

_FINAL = plan_cache.PlanCache("reduction final plans")


def _final_slots(mapping, part_key, part_slot, num_out, sentinel) -> np.ndarray:
  """``[rows, row_size, partials]``: the partials of every output element
  (for steps that gather by slot)."""
  rows, row_size = mapping.storage_shape
  order = np.argsort(part_key, kind="stable")
  counts = np.bincount(part_key, minlength=num_out)
  start = np.concatenate([[0], np.cumsum(counts)[:-1]])
  rank = np.empty(part_key.size, np.int64)
  rank[order] = np.arange(part_key.size) - start[part_key[order]]
  c = int(counts.max())
  pos = mapping.storage_position[part_key]
  dense = np.full(rows * row_size * c, sentinel, np.int64)
  dense[pos * c + rank] = part_slot
  return dense.reshape(rows, row_size, c)


def _claim_linear(ctx, mapping, rotates):
  if rotates:
    ctx.claim_tiles(mapping.num_rows)


# -- the reduction lowering -------------------------------------------------------
#
# A planned pass: the inits and the input grouping (ReductionPlan), the output placement
# and its stage-2 cost (Stage2Plan), then the two compute sets. The steps' functions
# close over small tables only, never the plan: a step must not keep
# per-element index tables (or the shared ``groups``) alive. The logical forms
# keep one index per output; the per-tile functions build their gathers when
# traced (PerTileTables).


def _emit_empty(ctx, spec: ReductionSpec, inits: ReductionInits, out_avals, out_size: int) -> list:
  """Outputs of a reduction with no outputs, or over empty axes (the identity)."""
  num_tiles = ctx.target.num_tiles
  outputs = [ctx.new_tensor(s, d) for s, d in out_avals]
  if out_size == 0:
    ctx.emit(P.Superstep(name=f"{ctx.op}/empty", op=ctx.op, reads=(), writes=tuple(outputs),
                         fn=lambda: tuple(jnp.zeros(o.storage_shape, o.dtype)
                                          for o in outputs)))
    return outputs

  def fill_fn(*init_storages):
    ids = spec.identities(inits.values(init_storages))
    return tuple(jnp.full(o.storage_shape, ids[c], o.dtype)
                 for o, c in zip(outputs, spec.out_components))
  elements = sum(o.mapping.elements_per_tile(num_tiles) for o in outputs)
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/fill", op=ctx.op, reads=tuple(inits.reads), writes=tuple(outputs),
      fn=fill_fn, compute_cycles=estimators.fill_cycles(ctx.target, elements,
                                                        outputs[0].itemsize),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.FILL,)))
  return outputs


def _new_partials(ctx, plan: ReductionPlan, are_outputs: bool) -> list:
  """The partials, one tensor per component; the outputs' own when ``are_outputs``."""
  spec, groups = plan.spec, plan.groups
  part_map = plan.part_mapping()
  partials = []
  for c, dtype in enumerate(spec.comp_dtypes):
    if are_outputs and c in spec.out_components:
      k = spec.out_components.index(c)
      t = ctx.new_tensor(plan.out_avals[0][0], plan.out_avals[k][1], part_map,
                         name=f"{ctx.op}")
    else:
      t = ctx.new_tensor((groups.num,), dtype, part_map, name=f"{ctx.op}/partials")
    partials.append(t)
  assert part_map.storage_shape == (plan.in_map.storage_shape[0], groups.width)
  return partials


def _lower_reduction(ctx, spec: ReductionSpec, data: Sequence[P.Tensor], axes,
                     inits: Sequence[P.Tensor] = ()) -> list:
  """Lower a reduction of ``data`` over ``axes`` in two compute sets."""
  axes = tuple(sorted(int(a) % max(len(data[0].shape), 1) for a in axes))
  out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in ctx.out_avals]
  out_size = int(np.prod(out_avals[0][0], dtype=np.int64))
  init_plan = ReductionInits.of(inits)
  if out_size == 0 or data[0].size == 0:
    return _emit_empty(ctx, spec, init_plan, out_avals, out_size)
  views = _size_one_views(ctx, spec, data, axes, out_avals)
  if views is not None:
    return views
  plan = plan_reduction(ctx, spec, data, axes, init_plan, out_avals, out_size)
  stage2 = place_outputs(ctx, plan)
  _claim_linear(ctx, stage2.out_map, stage2.rotates)
  skip_stage2 = skips_stage2(plan, stage2)
  partials = []
  if not plan.skip_stage1:
    partials = _new_partials(ctx, plan, skip_stage2)
    _emit_partials(ctx, plan, partials, skip_stage2)
    if skip_stage2:
      return [partials[c] for c in spec.out_components]
  outputs = [ctx.new_tensor(s, d, stage2.out_map) for s, d in out_avals]
  _emit_final(ctx, plan, stage2, partials, outputs)
  return outputs


def _size_one_views(ctx, spec: ReductionSpec, data: Sequence[P.Tensor], axes,
                    out_avals) -> Optional[list]:
  """The outputs as views of the inputs when every reduced axis has size 1, else None.

  PopLibs reduces nothing then: ``popops::reduce`` finds that every reduced
  dimension has size 1 (``canReduceWithMap``, ``lib/popops/reduction/
  Reduction.cpp``) and ``reduceWithMap`` clones the input's mapping for the
  output and runs ``popops::cast``, a plain on-tile copy when the types agree
  (no Reduce vertex, no exchange: the output sits where the input is). XLA's
  algebraic simplifier goes one step further before any backend sees it
  (``AlgebraicSimplifierVisitor::HandleReduce``: a reduce with as many
  elements out as in is a reshape of its input, the init value being the
  computation's identity), so TensorFlow's IPU backend is handed a reshape,
  a Poplar view: no step, no cycles, no memory. Dropping size-1 axes keeps
  the row-major element order, so the output is an alias of the input.
  JAX emits these in backward passes (a ``keepdims`` mean's cotangent summed
  over its size-1 axis). An ``argmax``/``argmin`` over a size-1 axis is
  index 0 everywhere: the same simplifier leaves XLA's variadic reduce as
  the reshape of an iota of one element, a constant, so it is a constant
  of zeros here (no step, no cycles; its bytes are a constant's).
  """
  if any(int(data[0].shape[a]) != 1 for a in axes):
    return None
  if spec.index_axis is not None:
    return [ctx.constant(np.zeros(shape, dtype)) for shape, dtype in out_avals]
  xs = [data[c] for c in spec.out_components]
  if any(x.dtype != np.dtype(dtype) for x, (_, dtype) in zip(xs, out_avals)):
    return None
  return [alias(x, shape) for x, (shape, _) in zip(xs, out_avals)]


@dataclasses.dataclass(frozen=True)
class _MemberGather:
  """How a per-tile partials step lays each tile's members out as ``[rows, width, depth]``.

  Attributes:
    shape: ``(rows, width, depth)``.
    reshape_only: the storage already is that array (pads where ``valid`` is False).
    valid: when reshape_only and some slots are pads, the mask of members.
    dense: when not reshape_only, the storage slot of every member (int32 when
      it fits; the pad slot past the end).
    index: argmax/argmin: the index component of every member.
  """

  shape: tuple
  reshape_only: bool
  valid: Optional[np.ndarray]
  dense: Optional[np.ndarray]
  index: Optional[np.ndarray]


def _member_gather(plan: ReductionPlan) -> _MemberGather:
  """The slot of every member, built here (never cached): only per-tile steps
  gather by slot."""
  in_map, groups = plan.in_map, plan.groups
  rows, row_size = in_map.storage_shape
  shape = (rows, groups.width, groups.depth)
  slots = groups.slots(in_map)
  index = plan.slot_index[slots.dense] if plan.slot_index is not None else None
  if slots.reshape_only:
    valid = None if bool(slots.valid.all()) else slots.valid.reshape(shape)
    return _MemberGather(shape, True, valid, None, index)
  dense = slots.dense.astype(np.int32) if rows * row_size < 2**31 - 1 else slots.dense
  return _MemberGather(shape, False, None, dense, index)


def _gathered_members(gather: _MemberGather, xs, ids) -> list:
  """Each component as ``[rows, width, depth]`` (pads hold the identity)."""
  comps = []
  for x, ident in zip(xs, ids):
    if gather.reshape_only:
      d = x.reshape(gather.shape)
      if gather.valid is not None:
        d = jnp.where(gather.valid, d, jnp.asarray(ident, d.dtype))
    else:
      d = gather_or_fill(x.reshape(-1), gather.dense, ident)
    comps.append(d)
  if gather.index is not None:
    comps.append(jnp.asarray(gather.index))
  return comps


def _partials_per_tile(spec, inits, partials, tables: PerTileTables, *storages):
  """Stage 1's ``fn``: every tile reduces its members of each group (one vertex per tile)."""
  gather = _member_gather(tables.plan())
  n_src = len(storages) - len(inits.reads)
  xs, init_storages = storages[:n_src], storages[n_src:]
  ids = spec.identities(inits.values(init_storages))
  reduced = jax.vmap(lambda *c: spec.combine(c, ids))(*_gathered_members(gather, xs, ids))
  return tuple(r.astype(p.dtype).reshape(p.storage_shape) for r, p in zip(reduced, partials))


def _partials_logical(spec, inits, num_data: int, out_of_group, partials, *arrays):
  """Stage 1's logical form: the whole reduction by the primitive.

  Partials that are the outputs (stage 2 skipped) hold each result in its
  output's group (``out_of_group``: its output, ``out_size`` for the other
  groups). Partials that only stage 2's form reads carry the results in
  their first ``out_size`` elements and the identity after them
  (``out_of_group`` is ``None``): stage 2's form takes that prefix, which
  XLA folds away with the padding, where placing each result in its
  output's first group and taking it back cost one gather per reduction.
  """
  ids = spec.identities(inits.values(arrays[num_data:]))
  results = spec.batched(*arrays[:num_data], inits.values(arrays[num_data:]))
  out = []
  for c, p in enumerate(partials):
    if c not in spec.out_components:
      out.append(jnp.full(p.shape, ids[c], p.dtype))
      continue
    value = results[spec.out_components.index(c)].reshape(-1).astype(p.dtype)
    fill = jnp.asarray(ids[c], p.dtype)
    if out_of_group is None:
      # Placing the results (no arithmetic follows).
      value = lax.pad(value, fill, ((0, p.size - value.size, 0),))
    else:
      value = take_or_fill(value, out_of_group, fill)
    out.append(value.reshape(p.shape))
  return tuple(out)


def _out_of_group(groups, out_size: int) -> np.ndarray:
  """The output whose first group each group is, ``out_size`` for none (one
  entry per group: what the logical form keeps)."""
  dtype = np.int32 if out_size < 2**31 - 1 else np.int64
  out = np.full(groups.num, out_size, dtype)
  out[groups.first_of_key] = np.arange(out_size, dtype=dtype)
  return out


def _emit_partials(ctx, plan: ReductionPlan, partials, are_outputs: bool) -> None:
  """Compute set 1: every tile reduces its own elements per output element
  (into the outputs themselves when ``are_outputs``)."""
  target = ctx.target
  num_tiles = target.num_tiles
  spec, data, groups, in_map = plan.spec, plan.data, plan.groups, plan.in_map
  elements = in_map.elements_per_tile(num_tiles)
  per_tile = np.zeros(num_tiles, np.int64)
  np.add.at(per_tile, in_map.tiles, groups.per_row)
  cycles = reduce_step_cycles(target, elements, spec.comp_dtypes[0].itemsize, per_tile,
                              spec.cycles_per_vector, spec.kind)
  flops = (data[0].size - groups.num) * len(data) if spec.flop_kind else 0
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/partials", op=ctx.op, reads=tuple(data) + tuple(plan.inits.reads),
      writes=tuple(partials),
      fn=functools.partial(_partials_per_tile, spec, plan.inits, tuple(partials),
                           PerTileTables.of(plan)),
      compute_cycles=cycles, exchange=_init_cost(ctx, plan.inits.reads, in_map.tiles),
      vertices=worker_vertices(ctx, per_tile), codelets=(vocab.vertex(vocab.REDUCE, spec.kind),),
      flops=int(flops),
      logical=functools.partial(_partials_logical, spec, plan.inits, len(data),
                                _out_of_group(groups, plan.out_size) if are_outputs else None,
                                tuple(partials))))


def _init_cost(ctx, init_reads, tiles):
  return add_costs(*[broadcast_cost(ctx, t, tiles) for t in init_reads])


def _final_per_tile(spec, inits, outputs, tables: PerTileTables, *storages):
  """Stage 2's ``fn``: each output's tile gathers its partials and reduces them."""
  plan, out_map = tables.plan(), tables.out_map
  groups, skip_stage1 = plan.groups, plan.skip_stage1
  final_dense = plan_cache.cached(
      _FINAL, (out_map.fingerprint, skip_stage1) + plan.key,
      lambda: _final_slots(out_map, groups.key, plan.part_slots(), plan.out_size,
                           plan.part_total))
  dense = final_dense.astype(np.int32) if plan.part_total < 2**31 - 1 else final_dense
  index = (plan.slot_index[final_dense]
           if (skip_stage1 and plan.slot_index is not None) else None)
  n_src = len(storages) - len(inits.reads)
  srcs, init_storages = storages[:n_src], storages[n_src:]
  ids = spec.identities(inits.values(init_storages))
  comps = [gather_or_fill(s.reshape(-1), dense, ident) for s, ident in zip(srcs, ids)]
  if index is not None:
    comps.append(jnp.asarray(index))
  reduced = jax.vmap(lambda *c: spec.combine(c, ids))(*comps)
  return tuple(reduced[c].astype(o.dtype).reshape(o.storage_shape)
               for c, o in zip(spec.out_components, outputs))


def _final_logical(spec, inits, skip_stage1, outputs, *arrays):
  """Stage 2's logical form: the outputs are the partials' first elements
  (stage 1's form holds the results there), or the whole reduction when
  stage 1 is skipped."""
  n_src = len(arrays) - len(inits.reads)
  srcs, init_values = arrays[:n_src], inits.values(arrays[n_src:])
  if skip_stage1:
    return tuple(jnp.reshape(r, o.shape) for r, o in zip(spec.batched(*srcs, init_values),
                                                          outputs))
  return tuple(lax.slice(srcs[c].reshape(-1), (0,), (o.size,)).reshape(o.shape)
               for c, o in zip(spec.out_components, outputs))


def _emit_final(ctx, plan: ReductionPlan, stage2: Stage2Plan, partials, outputs) -> None:
  """Compute set 2: partials exchanged to the output's tiles and reduced."""
  spec, groups, skip_stage1 = plan.spec, plan.groups, plan.skip_stage1
  out_map = stage2.out_map
  sources = list(plan.data) if skip_stage1 else partials
  flops = (groups.num - plan.out_size) * len(plan.data) if spec.flop_kind else 0
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/final" if not skip_stage1 else ctx.op, op=ctx.op,
      reads=tuple(sources) + tuple(plan.inits.reads), writes=tuple(outputs),
      fn=functools.partial(_final_per_tile, spec, plan.inits, tuple(outputs),
                           PerTileTables.of(plan, out_map)),
      compute_cycles=stage2.cycles,
      exchange=_add(stage2.cost, _init_cost(ctx, plan.inits.reads, out_map.tiles)),
      vertices=worker_vertices(ctx, out_map.elements_per_tile(ctx.target.num_tiles)),
      codelets=(vocab.vertex(vocab.REDUCE, spec.kind),), flops=int(flops),
      logical=functools.partial(_final_logical, spec, plan.inits, skip_stage1,
                                tuple(outputs))))


def _add(a, b):
  if a is None:
    return b
  if b is None:
    return a
  return a + b


# -- rules ------------------------------------------------------------------------------


_MONOIDS = {
    lax_internal.reduce_sum_p: "add", lax_internal.reduce_prod_p: "mul",
    lax_internal.reduce_max_p: "max", lax_internal.reduce_min_p: "min",
    lax_internal.reduce_and_p: "and", lax_internal.reduce_or_p: "or",
    lax_internal.reduce_xor_p: "xor",
}


def _make_monoid_rule(prim, kind):
  def rule(ctx: RuleContext, x, **params):
    spec = monoid_spec(prim, params, x.dtype, kind)
    return _lower_reduction(ctx, spec, [x], params["axes"])
  return rule


for _prim, _kind in _MONOIDS.items():
  register_lowering(_prim, _make_monoid_rule(_prim, _kind))


def _make_arg_rule(prim, is_max):
  def rule(ctx: RuleContext, x, **params):
    if len(params["axes"]) != 1:
      raise NotImplementedError(f"{prim.name} over {len(params['axes'])} axes")
    spec = arg_spec(prim, params, x.dtype, is_max)
    return _lower_reduction(ctx, spec, [x], params["axes"])
  return rule


register_lowering(lax_internal.argmax_p, _make_arg_rule(lax_internal.argmax_p, True))
register_lowering(lax_internal.argmin_p, _make_arg_rule(lax_internal.argmin_p, False))


@register_lowering(lax_internal.reduce_p)
def _reduce_rule(ctx: RuleContext, *operands, computation, jaxpr, dimensions):
  """``lax.reduce`` with a jaxpr computation (assumed associative/commutative)."""
  num = len(operands) // 2
  xs, inits = operands[:num], operands[num:]
  if getattr(jaxpr, "consts", ()):
    raise NotImplementedError("reduce computations that close over constants")
  params = dict(computation=computation, jaxpr=jaxpr, dimensions=dimensions)
  spec = generic_spec(params, [x.dtype for x in xs], num)
  return _lower_reduction(ctx, spec, list(xs), dimensions, inits)
