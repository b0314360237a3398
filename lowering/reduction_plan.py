"""Planning a reduction: what it computes, where its partials and outputs go, and at what cost.

The two-stage plan of ``popops::reduce`` (``lowering/rules/reduction.py``
emits it): a :class:`ReductionSpec` says what is reduced (a monoid, an
``argmax``/``argmin`` pair of value and index, or a generic ``reduce``
computation) and how; :func:`plan_reduction` groups each tile's elements by
output element (:mod:`~ipu_jax.lowering.grouping`) into a
:class:`ReductionPlan`; :func:`place_outputs` chooses where the outputs live
(the owner of each output's first element, linear, or a grain per tile,
whichever gives the cheapest second stage, its exchange counted on runs by
:mod:`~ipu_jax.lowering.unicast` and cached relative to the candidate's first
tile) as a :class:`Stage2Plan`; :func:`skips_stage2` tells when the second
stage would only copy local partials.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import lax_internal
from ipu_jax.kernels import estimators
from ipu_jax.kernels import reduce as reduce_kernels
from ipu_jax.lowering import program as P
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.builders import relayout_to
from ipu_jax.lowering.exchange import ExchangeCost, exchange_cycles, roll_tiles, shift_cost
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.grouping import (elements_tiles, first_elements, group_regions,
                                       identity_of, rows_mapping)
from ipu_jax.lowering.unicast import unicast_cost, unicast_link_elements

__all__ = ["PerTileTables", "ReductionInits", "ReductionPlan", "ReductionSpec", "Stage2Plan",
           "arg_combine", "arg_spec", "generic_spec", "mapping_from_tiles", "monoid_of_jaxpr",
           "monoid_spec", "place_outputs", "plan_reduction", "reduce_step_cycles", "skips_stage2"]


INDEX_PAD = np.iinfo(np.int32).max


_MONOID_PRIMS = {"add": "add", "mul": "mul", "max": "max", "min": "min",
                 "and": "and", "or": "or", "xor": "xor"}


def monoid_of_jaxpr(jaxpr) -> Optional[str]:
  """``"add"``, ``"max"``... when ``jaxpr`` is one such op on its two inputs."""
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  if len(inner.eqns) != 1 or len(inner.invars) != 2 or len(inner.outvars) != 1:
    return None
  eqn = inner.eqns[0]
  kind = _MONOID_PRIMS.get(eqn.primitive.name)
  if kind is None or set(map(id, eqn.invars)) != set(map(id, inner.invars)):
    return None
  if inner.outvars[0] is not eqn.outvars[0]:
    return None
  return kind


def mapping_from_tiles(element_tile: np.ndarray) -> TileMapping:
  """``TileMapping.from_element_tiles`` (kept separate for future speed-ups)."""
  return TileMapping.from_element_tiles(element_tile)


@dataclasses.dataclass
class ReductionSpec:
  """How one reduction is carried through the two stages.

  Attributes:
    kind: the monoid's name (``"add"``, ``"max"``, ``"argmax"``...), for
      reports.
    comp_dtypes: dtype of each partial component.
    identities: ``fn(init_values) -> [identity per component]``.
    combine: ``combine(components [..., K], identities) -> components [...]``:
      reduces the last axis (the members of a group) on one tile.
    batched: ``batched(*logical_inputs, init_values) -> outputs``: the whole
      reduction with the primitive itself.
    out_components: the component each output is.
    index_axis: for argmax/argmin, the reduced axis whose coordinate forms an
      extra, static, last component.
    cycles_per_vector: vector ops per input vector in the vertex.
    flop_kind: whether combines count as FLOPs.
  """

  kind: str
  comp_dtypes: tuple
  identities: Callable
  combine: Callable
  batched: Callable
  out_components: tuple
  index_axis: Optional[int] = None
  cycles_per_vector: int = 1
  flop_kind: bool = True


def monoid_spec(prim, params, dtype, kind):
  def combine(comps, _ids):
    x, = comps
    return (prim.bind(x, **{**params, "axes": (x.ndim - 1,)}),)

  def batched(x, _inits):
    return (prim.bind(x, **params),)

  identity = identity_of(kind, dtype)
  return ReductionSpec(kind=kind, comp_dtypes=(np.dtype(dtype),),
                       identities=lambda _inits: [identity], combine=combine,
                       batched=batched, out_components=(0,),
                       flop_kind=np.issubdtype(np.dtype(dtype), np.inexact))


def arg_combine(is_max):
  reduce = jnp.max if is_max else jnp.min

  def combine(comps, _ids):
    v, i = comps
    best = reduce(v, axis=-1)
    candidate = v == best[..., None]
    if jnp.issubdtype(v.dtype, jnp.inexact):
      # NaN beats everything (and ties between NaNs go to the first index),
      # as jax.lax.argmax/argmin's comparator does.
      nan = jnp.isnan(v)
      candidate = candidate | (nan & jnp.any(nan, axis=-1, keepdims=True))
    index = jnp.min(jnp.where(candidate, i, jnp.asarray(INDEX_PAD, i.dtype)), axis=-1)
    return best, index
  return combine


def arg_spec(prim, params, dtype, is_max):
  axis, = params["axes"]
  index_dtype = np.dtype(params["index_dtype"])
  value_identity = identity_of("max" if is_max else "min", dtype)

  def batched(x, _inits):
    return (prim.bind(x, **params),)

  return ReductionSpec(kind="argmax" if is_max else "argmin",
                       comp_dtypes=(np.dtype(dtype), index_dtype),
                       identities=lambda _inits: [value_identity,
                       np.asarray(min(INDEX_PAD, np.iinfo(index_dtype).max),
                       index_dtype)],
                       combine=arg_combine(is_max), batched=batched,
                       out_components=(1,), index_axis=axis, cycles_per_vector=2,
                       flop_kind=False)


def generic_spec(params, dtypes, num):
  jaxpr = params["jaxpr"]
  kind = monoid_of_jaxpr(jaxpr) or "reduce"
  eqns = len(getattr(jaxpr, "jaxpr", jaxpr).eqns)

  def combine(comps, ids):
    last = comps[0].ndim - 1
    return tuple(lax_internal.reduce_p.bind(
        *comps, *[jnp.asarray(i, c.dtype) for i, c in zip(ids, comps)],
        computation=params["computation"], jaxpr=jaxpr, dimensions=(last,)))

  def batched(*args):
    xs, inits = args[:-1], args[-1]
    return tuple(lax_internal.reduce_p.bind(
        *xs, *[jnp.asarray(i, x.dtype) for i, x in zip(inits, xs)], **params))

  return ReductionSpec(kind=kind, comp_dtypes=tuple(np.dtype(d) for d in dtypes),
                       identities=lambda inits: list(inits), combine=combine,
                       batched=batched, out_components=tuple(range(num)),
                       cycles_per_vector=max(1, eqns),
                       flop_kind=all(np.issubdtype(np.dtype(d), np.inexact) for d in dtypes))


def reduce_step_cycles(target, elements, itemsize, outputs, cycles_per_vector, kind):
  # Monoids cost their own Reduce vertex; multi-op reductions ignore ``kind``.
  op = kind if kind in reduce_kernels.REDUCE_OPS else "add"
  return estimators.reduce_cycles(target, elements, itemsize, outputs, cycles_per_vector, op=op)


_OWNERS = plan_cache.PlanCache("reduction owner mappings")


_STAGE2 = plan_cache.PlanCache("reduction stage-2 costs")


def _stage2_cost(ctx, mapping, runs, itemsize, value_itemsize, cpv, kind):
  """Stage 2's exchange onto ``mapping`` (IPU-Link bytes left zero), reduce cycles and
  elements received per tile."""
  target = ctx.target
  cost, received = unicast_cost(target, *runs, mapping, itemsize, links=False)
  cycles = reduce_step_cycles(target, received, value_itemsize,
                              mapping.elements_per_tile(target.num_tiles), cpv, kind)
  return cost, cycles, received


def _peek_linear(ctx, shape, dtype, min_bytes_per_tile: int = 128) -> tuple:
  """The mapping ``ctx.linear_mapping`` would give, without advancing it."""
  size = int(np.prod(shape, dtype=np.int64))
  num_tiles = ctx.target.num_tiles
  mapping = TileMapping.linear(size, num_tiles, np.dtype(dtype).itemsize,
                               min_bytes_per_tile=min_bytes_per_tile)
  rotates = 0 < mapping.num_rows < num_tiles
  if rotates:
    mapping = TileMapping.blocks(size, mapping.chunk, num_tiles, ctx.next_start_tile)
  return mapping, rotates


@dataclasses.dataclass(frozen=True)
class ReductionInits:
  """A reduction's init values: constants are baked into the vertices, others are read.

  Attributes:
    reads: the init tensors the steps read.
    kinds: per init, ``("const", value)`` or ``("read", tensor)``.
  """

  reads: tuple
  kinds: tuple

  @classmethod
  def of(cls, inits: Sequence[P.Tensor]) -> "ReductionInits":
    reads = [t for t in inits if not (t.category == "constants" and t.value is not None)]
    kinds = [("const", np.asarray(t.value).reshape(())) if t not in reads
             else ("read", t) for t in inits]
    return cls(tuple(reads), tuple(kinds))

  def values(self, init_storages) -> list:
    """The init values, from the storages of :attr:`reads` (in order)."""
    it = iter(init_storages)
    return [info if kind == "const" else next(it).reshape(-1)[0]
            for kind, info in self.kinds]


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
  """A non-empty reduction of ``data`` over ``axes``, grouped by output element.

  Attributes:
    spec: how the values are carried through the stages.
    data: the operands, every one laid out like the first.
    inits: the init values.
    shape: the operands' shape; axes: the reduced axes, sorted.
    groups: each tile's elements grouped by output element (see
      :func:`~ipu_jax.lowering.grouping.group_regions`).
    out_avals: ``(shape, dtype)`` of each output; out_size: elements per output.
    slot_index: argmax/argmin, where the per-tile functions are traced: the
      reduced-axis coordinate of every storage slot (and a pad slot), else
      None.
    skip_stage1: every tile holds at most one element per output: stage 1
      would reduce nothing, so the input itself is exchanged.
  """

  spec: ReductionSpec
  data: tuple
  inits: ReductionInits
  shape: tuple
  axes: tuple
  groups: object
  out_avals: tuple
  out_size: int
  slot_index: Optional[np.ndarray]
  skip_stage1: bool

  @property
  def in_map(self) -> TileMapping:
    return self.data[0].mapping

  @property
  def key(self) -> tuple:
    """What the grouping and placement depend on (for the plan caches)."""
    return (self.in_map.fingerprint, self.shape, self.axes)

  @property
  def part_total(self) -> int:
    """Slots of the partials (the input's slots when stage 1 is skipped)."""
    rows, row_size = self.in_map.storage_shape
    return rows * row_size if self.skip_stage1 else rows * self.groups.width

  def part_slots(self, index=None) -> np.ndarray:
    """Slot of the partials ``index`` (all by default): a skipped stage 1
    leaves each output's one element in place."""
    groups, width = self.groups, self.groups.width
    if index is None:
      return groups.first_slot if self.skip_stage1 else groups.row * width + groups.local
    if self.skip_stage1:
      return groups.first_slot_of(index)
    row, _, local = groups.at(index)
    return row * width + local

  def part_mapping(self) -> TileMapping:
    """The partials' mapping: one per (tile, output element), rows as the input's."""
    groups = self.groups
    return rows_mapping(groups.num, self.in_map.tiles, groups.row, groups.local,
                        groups.per_row)


@dataclasses.dataclass(frozen=True)
class Stage2Plan:
  """The outputs' placement and the cost of stage 2 (partials to outputs).

  Attributes:
    out_map: the outputs' mapping; rotates: whether it claims tiles (see
      :func:`_peek_linear`).
    cost: the partials' exchange (None when nothing moves); cycles: the
      final reduce's per tile; received: partials arriving or staying per tile.
  """

  out_map: TileMapping
  rotates: bool
  cost: Optional[ExchangeCost]
  cycles: np.ndarray
  received: np.ndarray


def _index_slots(spec: ReductionSpec, in_map: TileMapping, shape) -> np.ndarray:
  """argmax/argmin's static index component: the coordinate along the reduced
  axis of every storage slot, and the pad index in one extra last slot."""
  rows, row_size = in_map.storage_shape
  total = rows * row_size
  idx_dtype = spec.comp_dtypes[-1]
  coord = np.broadcast_to(
      np.arange(shape[spec.index_axis], dtype=np.int64).reshape(
          [-1 if a == spec.index_axis else 1 for a in range(len(shape))]), shape).reshape(-1)
  slot_index = np.zeros(total + 1, np.int64)
  slot_index[in_map.storage_position] = coord
  slot_index[total] = min(INDEX_PAD, np.iinfo(idx_dtype).max)
  return slot_index.astype(idx_dtype)


def plan_reduction(ctx, spec: ReductionSpec, data, axes, inits: ReductionInits, out_avals, out_size: int) -> ReductionPlan:
  """Relayout the operands and group the input by output element."""
  shape = tuple(data[0].shape)
  n = data[0].size
  # Multi-operand reductions need every operand laid out like the first.
  data = [data[0]] + [relayout_to(ctx, t, data[0].mapping) for t in data[1:]]
  in_map = data[0].mapping
  # The grouping of each tile's elements by output element depends only on
  # the layout, shape and axes (cached: a repeated layer reuses it).
  groups = group_regions(in_map, shape, axes)
  return ReductionPlan(spec=spec, data=tuple(data), inits=inits, shape=shape, axes=axes,
                       groups=groups, out_avals=tuple(out_avals), out_size=out_size,
                       slot_index=None, skip_stage1=groups.num == n)


@dataclasses.dataclass(frozen=True, eq=False)
class PerTileTables:
  """What the per-tile functions build their gathers from when traced.

  The plan without its grouping and index tables (a step keeps neither): the
  grouping comes back from ``group_regions``'s cache, argmax/argmin's slot
  coordinates are computed again.
  """

  light: ReductionPlan
  out_map: Optional[TileMapping] = None

  @classmethod
  def of(cls, plan: ReductionPlan, out_map: Optional[TileMapping] = None) -> "PerTileTables":
    return cls(dataclasses.replace(plan, groups=None, slot_index=None), out_map)

  def plan(self) -> ReductionPlan:
    light = self.light
    slot_index = (_index_slots(light.spec, light.in_map, light.shape)
                  if light.spec.index_axis is not None else None)
    return dataclasses.replace(light, groups=group_regions(light.in_map, light.shape,
                                                           light.axes),
                               slot_index=slot_index)


def place_outputs(ctx, plan: ReductionPlan) -> Stage2Plan:
  """Output placement: on the tile of each output's first element ("owner
  computes"), linear like mapTensorLinearly, or spread one grain per tile
  (many partials per output), whichever makes stage 2 cheapest."""
  target, num_tiles = ctx.target, ctx.target.num_tiles
  spec, in_map, groups = plan.spec, plan.in_map, plan.groups
  out_shape, out_dtype = plan.out_avals[0]
  itemsize = sum(d.itemsize for d in spec.comp_dtypes)
  value_itemsize = spec.comp_dtypes[0].itemsize
  cpv = spec.cycles_per_vector
  owner = plan_cache.cached(
      _OWNERS, plan.key,
      lambda: mapping_from_tiles(elements_tiles(in_map, first_elements(plan.shape, plan.axes))))
  candidates = [(owner, False)]
  candidates.append(_peek_linear(ctx, out_shape, out_dtype))
  if candidates[-1][0].num_rows < num_tiles:
    candidates.append(_peek_linear(ctx, out_shape, out_dtype, min_bytes_per_tile=1))
  # Each tile's partials as runs of consecutive output elements.
  run_row, run_key, run_length = groups.key_runs()
  runs = (in_map.tiles[run_row], run_key, run_length)
  figures = (target, itemsize, value_itemsize, cpv, spec.kind)
  base = int(in_map.tiles[0]) if in_map.num_rows else 0
  # The cheapest placement wins, the earliest of equals. IPU-Link bytes only
  # add cycles, so the placements are tried cheapest-without-them first: one
  # already no cheaper without them than the best so far cannot win, and
  # their count (afresh, on runs) is skipped.
  tried = []
  for index, (cand, rotates) in enumerate(candidates):
    tile_cost, cycles, received, most = _relative_stage2(ctx, plan, cand, runs, base, figures)
    bound = exchange_cycles(target, tile_cost) + most
    tried.append(((bound, index), cand, rotates, tile_cost, cycles, received, most))
  best = None
  for (bound, index), cand, rotates, tile_cost, cycles, received, most in sorted(
      tried, key=lambda entry: entry[0]):
    if best is not None and (bound, index) >= best[-1]:
      continue
    link = _stage2_link_bytes(target, cand, runs, itemsize, tile_cost)
    score = (exchange_cycles(target, _with_link(tile_cost, link)) + most, index)
    if best is None or score < best[-1]:
      best = (cand, rotates, tile_cost, link, cycles, received, score)
  cand, rotates, tile_cost, link, cycles, received, _ = best
  # The tile figures were cached counted from ``base``: the chosen ones move into place.
  return Stage2Plan(cand, rotates, _with_link(shift_cost(tile_cost, base), link),
                    roll_tiles(cycles, base), roll_tiles(received, base))


def _with_link(cost: Optional[ExchangeCost], link) -> Optional[ExchangeCost]:
  """``cost`` with IPU-Link bytes ``link`` (unchanged where either is None)."""
  return cost if cost is None or link is None else ExchangeCost(cost.bytes_in, cost.bytes_out,
                                                                link)


def _stage2_link_bytes(target, cand: TileMapping, runs, itemsize: int, tile_cost):
  """``[num_ipus]`` IPU-Link bytes of stage 2 onto ``cand`` (None on one IPU or when
  nothing moves): counted afresh, they depend on where the IPUs' boundaries fall."""
  if tile_cost is None or target.num_ipus == 1:
    return None
  src, first, length = runs
  first = np.asarray(first, np.int64)
  stop = first + np.asarray(length, np.int64)
  return unicast_link_elements(target, src, first, stop, cand) * itemsize


def _relative_stage2(ctx, plan: ReductionPlan, cand: TileMapping, runs, base: int, figures) -> tuple:
  """Stage 2 onto ``cand`` without its IPU-Link bytes, per-tile figures counted from ``base``.

  A repeated layer reduces the same layout moved along the tiles: what each
  tile sends, receives and reduces only compares tile identities, so the
  figures found for one placement serve every placement moved by the same
  number of tiles (keyed by the absolute layouts, 429 of 564 stage-2 costs of
  enc-8x256-bow4 missed; 254 now, 236 on one IPU). The IPU-Link bytes are
  not moved along (:func:`_stage2_link_bytes`).

  Returns:
    ``(cost, cycles, received, most)``: the exchange (zero link bytes; None
    when nothing moves), ``[num_tiles]`` reduce cycles and elements received,
    all rolled by ``-base``, and the busiest tile's cycles.
  """
  t = ctx.target.num_tiles
  key = (cand.relative_fingerprint(base, t), plan.in_map.relative_fingerprint(base, t),
         plan.shape, plan.axes) + figures

  def compute():
    cost, cycles, received = _stage2_cost(ctx, cand, runs, *figures[1:])
    return (shift_cost(cost, -base), roll_tiles(cycles, -base), roll_tiles(received, -base),
            float(cycles.max(initial=0)))

  return plan_cache.cached(_STAGE2, key, compute)


def skips_stage2(plan: ReductionPlan, stage2: Stage2Plan) -> bool:
  """Whether stage 2 would only copy local partials: they are the outputs."""
  groups, out_size = plan.groups, plan.out_size
  return (not plan.skip_stage1 and groups.num == out_size
          and np.array_equal(groups.key, np.arange(out_size))
          and stage2.cost is None and stage2.out_map.same_as(plan.part_mapping()))
