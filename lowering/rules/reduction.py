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
:mod:`~ipu_jax.lowering.rules.grouping` (shared with the scans of
:mod:`~ipu_jax.lowering.rules.cumulative`).

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
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import lax_internal
from ipu_jax.kernels import estimators
from ipu_jax.kernels import reduce as reduce_kernels
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.builders import add_costs, broadcast_cost, relayout_to, worker_vertices
from ipu_jax.lowering.exchange import (ExchangeCost, exchange_cycles, roll_tiles, shift_cost,
                                       take_or_fill)
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.rules.grouping import (elements_tiles, first_elements, gather_or_fill,
                                             group_regions, identity_of, rows_mapping)

__all__ = ["unicast_cost", "mapping_from_tiles", "identity_of", "monoid_of_jaxpr"]

_INDEX_PAD = np.iinfo(np.int32).max


# -- small helpers -------------------------------------------------------------


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


def _covered(first: np.ndarray, stop: np.ndarray, x: np.ndarray) -> np.ndarray:
  """Elements of the runs ``[first[i], stop[i])`` below each ``x`` (all runs summed)."""
  first, stop = np.sort(first), np.sort(stop)
  total = []
  for ends in (first, stop):
    below = np.searchsorted(ends, x, side="left")
    sums = np.concatenate([np.zeros(1, np.int64), np.cumsum(ends)])
    total.append(x * below - sums[below])
  return total[0] - total[1]


def _overlap(group: np.ndarray, first: np.ndarray, stop: np.ndarray, interval_group: np.ndarray,
             starts: np.ndarray, ends: np.ndarray, size: int) -> np.ndarray:
  """Elements of each run ``[first[i], stop[i])`` in the intervals of its ``group[i]``.

  Intervals of one group are disjoint. Each run end is looked up among the
  intervals sorted by (group, start), against the running sum of their
  lengths: ``O((runs + intervals) log intervals)``.
  """
  key = interval_group * (size + 1) + starts
  if not (key[1:] > key[:-1]).all():  # a linear layout's intervals are in order already
    order = np.lexsort((starts, interval_group))
    interval_group, starts, ends, key = (
        interval_group[order], starts[order], ends[order], key[order])
  begin, length = starts, ends - starts
  through = np.cumsum(length)                       # lengths up to and with each

  def below(x):
    k = np.searchsorted(key, group * (size + 1) + x, side="right") - 1
    valid = k >= 0
    kk = np.maximum(k, 0)
    valid &= interval_group[kk] == group
    upto = np.where(k >= 0, through[kk], 0)
    # In the group's interval that starts at or before x: its part past x is not below.
    past = np.where(valid, length[kk] - np.minimum(x - begin[kk], length[kk]), 0)
    return upto - past
  return below(stop) - below(first)


def unicast_cost(target, src_tile: np.ndarray, first: np.ndarray, length: np.ndarray,
                 dst_mapping: TileMapping, itemsize: int, links: bool = True) -> tuple:
  """Bytes moved when runs of elements go to where ``dst_mapping`` holds them.

  Run ``i`` is elements ``[first[i], first[i] + length[i])`` of the
  destination tensor, now on ``src_tile[i]``; each element has a single
  destination (no multicast). Counted on runs and intervals, not on their
  pieces: what each destination interval receives is the runs' coverage of
  it, what stays is each run's overlap with its own tile's intervals, what
  crosses IPUs each run's part outside its IPU's intervals.

  Args:
    links: False leaves the IPU-Link bytes zero (a caller moving the tile
      figures along the tiles counts them afresh: :func:`unicast_link_elements`).

  Returns:
    ``(cost, received)``: the :class:`ExchangeCost` (``None`` when nothing
    moves) and ``[num_tiles]`` elements arriving at or staying on each tile.
  """
  t = target.num_tiles
  n = dst_mapping.num_elements
  starts, tiles = dst_mapping.intervals
  ends = np.append(starts[1:], n)
  first = np.asarray(first, np.int64)
  stop = first + np.asarray(length, np.int64)
  src = np.asarray(src_tile, np.int64)

  def per(where, weights, length_):
    return np.bincount(where, weights=weights, minlength=length_)[:length_].astype(np.int64)

  # Coverage below every interval's end and start, from one sort of the runs.
  covered = _covered(first, stop, np.concatenate([ends, starts]))
  received = per(tiles, covered[:ends.size] - covered[ends.size:], t)
  stay = _overlap(src, first, stop, tiles, starts, ends, n)
  moved = (stop - first) - stay
  if not moved.any():
    return None, received
  staying = per(src, stay, t)
  link = np.zeros(target.num_ipus, np.int64)  # one IPU: nothing crosses a link
  if links and target.num_ipus > 1:
    link = unicast_link_elements(target, src, first, stop, dst_mapping)
  return ExchangeCost((received - staying) * itemsize, per(src, moved, t) * itemsize,
                      link * itemsize), received


def unicast_link_elements(target, src_tile: np.ndarray, first: np.ndarray, stop: np.ndarray,
                          dst_mapping: TileMapping) -> np.ndarray:
  """``[num_ipus]`` elements each IPU sends over its links in :func:`unicast_cost`.

  What stays on its IPU is each run's overlap with its IPU's runs of
  intervals (a few per tensor, not one per tile); the rest crosses.
  """
  per_ipu, n = target.tiles_per_ipu, dst_mapping.num_elements
  ipu_starts, ipus = dst_mapping.ipu_runs(per_ipu)
  ipu_ends = np.append(ipu_starts[1:], n)
  src_ipu = np.asarray(src_tile, np.int64) // per_ipu
  crossing = (stop - first) - _overlap(src_ipu, first, stop, ipus, ipu_starts, ipu_ends, n)
  return np.bincount(src_ipu, weights=crossing,
                     minlength=target.num_ipus)[:target.num_ipus].astype(np.int64)


def mapping_from_tiles(element_tile: np.ndarray) -> TileMapping:
  """``TileMapping.from_element_tiles`` (kept separate for future speed-ups)."""
  return TileMapping.from_element_tiles(element_tile)


# -- reduction specs ------------------------------------------------------------


@dataclasses.dataclass
class _Spec:
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


def _monoid_spec(prim, params, dtype, kind):
  def combine(comps, _ids):
    x, = comps
    return (prim.bind(x, **{**params, "axes": (x.ndim - 1,)}),)

  def batched(x, _inits):
    return (prim.bind(x, **params),)

  identity = identity_of(kind, dtype)
  return _Spec(kind=kind, comp_dtypes=(np.dtype(dtype),),
               identities=lambda _inits: [identity], combine=combine,
               batched=batched, out_components=(0,),
               flop_kind=np.issubdtype(np.dtype(dtype), np.inexact))


def _arg_combine(is_max):
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
    index = jnp.min(jnp.where(candidate, i, jnp.asarray(_INDEX_PAD, i.dtype)), axis=-1)
    return best, index
  return combine


def _arg_spec(prim, params, dtype, is_max):
  axis, = params["axes"]
  index_dtype = np.dtype(params["index_dtype"])
  value_identity = identity_of("max" if is_max else "min", dtype)

  def batched(x, _inits):
    return (prim.bind(x, **params),)

  return _Spec(kind="argmax" if is_max else "argmin",
               comp_dtypes=(np.dtype(dtype), index_dtype),
               identities=lambda _inits: [value_identity,
                                          np.asarray(min(_INDEX_PAD, np.iinfo(index_dtype).max),
                                                     index_dtype)],
               combine=_arg_combine(is_max), batched=batched,
               out_components=(1,), index_axis=axis, cycles_per_vector=2,
               flop_kind=False)


def _generic_spec(params, dtypes, num):
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

  return _Spec(kind=kind, comp_dtypes=tuple(np.dtype(d) for d in dtypes),
               identities=lambda inits: list(inits), combine=combine,
               batched=batched, out_components=tuple(range(num)),
               cycles_per_vector=max(1, eqns),
               flop_kind=all(np.issubdtype(np.dtype(d), np.inexact) for d in dtypes))


# -- planning ---------------------------------------------------------------------


def _reduce_cycles(target, elements, itemsize, outputs, cycles_per_vector, kind):
  # Monoids cost their own Reduce vertex; multi-op reductions ignore ``kind``.
  op = kind if kind in reduce_kernels.REDUCE_OPS else "add"
  return estimators.reduce_cycles(target, elements, itemsize, outputs, cycles_per_vector, op=op)



_OWNERS = plan_cache.PlanCache("reduction owner mappings")
_STAGE2 = plan_cache.PlanCache("reduction stage-2 costs")
_FINAL = plan_cache.PlanCache("reduction final plans")




def _stage2_cost(ctx, mapping, runs, itemsize, value_itemsize, cpv, kind):
  """Stage 2's exchange onto ``mapping`` (IPU-Link bytes left zero), reduce cycles and
  elements received per tile."""
  target = ctx.target
  cost, received = unicast_cost(target, *runs, mapping, itemsize, links=False)
  cycles = _reduce_cycles(target, received, value_itemsize,
                          mapping.elements_per_tile(target.num_tiles), cpv, kind)
  return cost, cycles, received


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


def _claim_linear(ctx, mapping, rotates):
  if rotates:
    ctx.claim_tiles(mapping.num_rows)


# -- the reduction lowering -------------------------------------------------------
#
# A planned pass: the inits and the input grouping (_Plan), the output placement
# and its stage-2 cost (_Stage2), then the two compute sets. The steps' functions
# close over small tables only, never the plan: a step must not keep
# per-element index tables (or the shared ``groups``) alive. The logical forms
# keep one index per output; the per-tile functions build their gathers when
# traced (_PerTilePlan).


@dataclasses.dataclass(frozen=True)
class _Inits:
  """A reduction's init values: constants are baked into the vertices, others are read.

  Attributes:
    reads: the init tensors the steps read.
    kinds: per init, ``("const", value)`` or ``("read", tensor)``.
  """

  reads: tuple
  kinds: tuple

  @classmethod
  def of(cls, inits: Sequence[P.Tensor]) -> "_Inits":
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
class _Plan:
  """A non-empty reduction of ``data`` over ``axes``, grouped by output element.

  Attributes:
    spec: how the values are carried through the stages.
    data: the operands, every one laid out like the first.
    inits: the init values.
    shape: the operands' shape; axes: the reduced axes, sorted.
    groups: each tile's elements grouped by output element (see
      :func:`~ipu_jax.lowering.rules.grouping.group_regions`).
    out_avals: ``(shape, dtype)`` of each output; out_size: elements per output.
    slot_index: argmax/argmin, where the per-tile functions are traced: the
      reduced-axis coordinate of every storage slot (and a pad slot), else
      None.
    skip_stage1: every tile holds at most one element per output: stage 1
      would reduce nothing, so the input itself is exchanged.
  """

  spec: _Spec
  data: tuple
  inits: _Inits
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
class _Stage2:
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


def _emit_empty(ctx, spec: _Spec, inits: _Inits, out_avals, out_size: int) -> list:
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


def _index_slots(spec: _Spec, in_map: TileMapping, shape) -> np.ndarray:
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
  slot_index[total] = min(_INDEX_PAD, np.iinfo(idx_dtype).max)
  return slot_index.astype(idx_dtype)


def _plan(ctx, spec: _Spec, data, axes, inits: _Inits, out_avals, out_size: int) -> _Plan:
  """Relayout the operands and group the input by output element."""
  shape = tuple(data[0].shape)
  n = data[0].size
  # Multi-operand reductions need every operand laid out like the first.
  data = [data[0]] + [relayout_to(ctx, t, data[0].mapping) for t in data[1:]]
  in_map = data[0].mapping
  # The grouping of each tile's elements by output element depends only on
  # the layout, shape and axes (cached: a repeated layer reuses it).
  groups = group_regions(in_map, shape, axes)
  return _Plan(spec=spec, data=tuple(data), inits=inits, shape=shape, axes=axes,
               groups=groups, out_avals=tuple(out_avals), out_size=out_size,
               slot_index=None, skip_stage1=groups.num == n)


@dataclasses.dataclass(frozen=True, eq=False)
class _PerTilePlan:
  """What the per-tile functions build their gathers from when traced.

  The plan without its grouping and index tables (a step keeps neither): the
  grouping comes back from ``group_regions``'s cache, argmax/argmin's slot
  coordinates are computed again.
  """

  light: _Plan
  out_map: Optional[TileMapping] = None

  @classmethod
  def of(cls, plan: _Plan, out_map: Optional[TileMapping] = None) -> "_PerTilePlan":
    return cls(dataclasses.replace(plan, groups=None, slot_index=None), out_map)

  def plan(self) -> _Plan:
    light = self.light
    slot_index = (_index_slots(light.spec, light.in_map, light.shape)
                  if light.spec.index_axis is not None else None)
    return dataclasses.replace(light, groups=group_regions(light.in_map, light.shape,
                                                           light.axes),
                               slot_index=slot_index)


def _place_outputs(ctx, plan: _Plan) -> _Stage2:
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
  return _Stage2(cand, rotates, _with_link(shift_cost(tile_cost, base), link),
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


def _relative_stage2(ctx, plan: _Plan, cand: TileMapping, runs, base: int, figures) -> tuple:
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


def _skips_stage2(plan: _Plan, stage2: _Stage2) -> bool:
  """Whether stage 2 would only copy local partials: they are the outputs."""
  groups, out_size = plan.groups, plan.out_size
  return (not plan.skip_stage1 and groups.num == out_size
          and np.array_equal(groups.key, np.arange(out_size))
          and stage2.cost is None and stage2.out_map.same_as(plan.part_mapping()))


def _new_partials(ctx, plan: _Plan, are_outputs: bool) -> list:
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


def _lower_reduction(ctx, spec: _Spec, data: Sequence[P.Tensor], axes,
                     inits: Sequence[P.Tensor] = ()) -> list:
  """Lower a reduction of ``data`` over ``axes`` in two compute sets."""
  axes = tuple(sorted(int(a) % max(len(data[0].shape), 1) for a in axes))
  out_avals = [(tuple(a.shape), np.dtype(a.dtype)) for a in ctx.out_avals]
  out_size = int(np.prod(out_avals[0][0], dtype=np.int64))
  init_plan = _Inits.of(inits)
  if out_size == 0 or data[0].size == 0:
    return _emit_empty(ctx, spec, init_plan, out_avals, out_size)
  plan = _plan(ctx, spec, data, axes, init_plan, out_avals, out_size)
  stage2 = _place_outputs(ctx, plan)
  _claim_linear(ctx, stage2.out_map, stage2.rotates)
  skip_stage2 = _skips_stage2(plan, stage2)
  partials = []
  if not plan.skip_stage1:
    partials = _new_partials(ctx, plan, skip_stage2)
    _emit_partials(ctx, plan, partials)
    if skip_stage2:
      return [partials[c] for c in spec.out_components]
  outputs = [ctx.new_tensor(s, d, stage2.out_map) for s, d in out_avals]
  _emit_final(ctx, plan, stage2, partials, outputs)
  return outputs


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


def _member_gather(plan: _Plan) -> _MemberGather:
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


def _partials_per_tile(spec, inits, partials, tables: _PerTilePlan, *storages):
  """Stage 1's ``fn``: every tile reduces its members of each group (one vertex per tile)."""
  gather = _member_gather(tables.plan())
  n_src = len(storages) - len(inits.reads)
  xs, init_storages = storages[:n_src], storages[n_src:]
  ids = spec.identities(inits.values(init_storages))
  reduced = jax.vmap(lambda *c: spec.combine(c, ids))(*_gathered_members(gather, xs, ids))
  return tuple(r.astype(p.dtype).reshape(p.storage_shape) for r, p in zip(reduced, partials))


def _partials_logical(spec, inits, num_data: int, out_of_group, partials, *arrays):
  """Stage 1's logical form: the whole reduction by the primitive, each
  output element in its first group's partial (``out_of_group``: its
  output, ``out_size`` for the other groups, which hold the identity)."""
  ids = spec.identities(inits.values(arrays[num_data:]))
  results = spec.batched(*arrays[:num_data], inits.values(arrays[num_data:]))
  out = []
  for c, p in enumerate(partials):
    if c in spec.out_components:
      value = results[spec.out_components.index(c)].reshape(-1).astype(p.dtype)
      # Placing the results (no arithmetic follows).
      out.append(take_or_fill(value, out_of_group, ids[c]).reshape(p.shape))
    else:
      out.append(jnp.full(p.shape, ids[c], p.dtype))
  return tuple(out)


def _out_of_group(groups, out_size: int) -> np.ndarray:
  """The output whose first group each group is, ``out_size`` for none (one
  entry per group: what the logical form keeps)."""
  dtype = np.int32 if out_size < 2**31 - 1 else np.int64
  out = np.full(groups.num, out_size, dtype)
  out[groups.first_of_key] = np.arange(out_size, dtype=dtype)
  return out


def _emit_partials(ctx, plan: _Plan, partials) -> None:
  """Compute set 1: every tile reduces its own elements per output element."""
  target = ctx.target
  num_tiles = target.num_tiles
  spec, data, groups, in_map = plan.spec, plan.data, plan.groups, plan.in_map
  elements = in_map.elements_per_tile(num_tiles)
  per_tile = np.zeros(num_tiles, np.int64)
  np.add.at(per_tile, in_map.tiles, groups.per_row)
  cycles = _reduce_cycles(target, elements, spec.comp_dtypes[0].itemsize, per_tile,
                          spec.cycles_per_vector, spec.kind)
  flops = (data[0].size - groups.num) * len(data) if spec.flop_kind else 0
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/partials", op=ctx.op, reads=tuple(data) + tuple(plan.inits.reads),
      writes=tuple(partials),
      fn=functools.partial(_partials_per_tile, spec, plan.inits, tuple(partials),
                           _PerTilePlan.of(plan)),
      compute_cycles=cycles, exchange=_init_cost(ctx, plan.inits.reads, in_map.tiles),
      vertices=worker_vertices(ctx, per_tile), codelets=(vocab.vertex(vocab.REDUCE, spec.kind),),
      flops=int(flops),
      logical=functools.partial(_partials_logical, spec, plan.inits, len(data),
                                _out_of_group(groups, plan.out_size), tuple(partials))))


def _init_cost(ctx, init_reads, tiles):
  return add_costs(*[broadcast_cost(ctx, t, tiles) for t in init_reads])


def _final_per_tile(spec, inits, outputs, tables: _PerTilePlan, *storages):
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


def _final_logical(spec, inits, first_of_key, skip_stage1, outputs, *arrays):
  """Stage 2's logical form: each output from its first partial (stage 1's
  form holds the result there), or the whole reduction when stage 1 is skipped."""
  n_src = len(arrays) - len(inits.reads)
  srcs, init_values = arrays[:n_src], inits.values(arrays[n_src:])
  if skip_stage1:
    return tuple(jnp.reshape(r, o.shape) for r, o in zip(spec.batched(*srcs, init_values),
                                                          outputs))
  return tuple(srcs[c].reshape(-1)[first_of_key].reshape(o.shape)
               for c, o in zip(spec.out_components, outputs))


def _emit_final(ctx, plan: _Plan, stage2: _Stage2, partials, outputs) -> None:
  """Compute set 2: partials exchanged to the output's tiles and reduced."""
  spec, groups, skip_stage1 = plan.spec, plan.groups, plan.skip_stage1
  out_map = stage2.out_map
  sources = list(plan.data) if skip_stage1 else partials
  flops = (groups.num - plan.out_size) * len(plan.data) if spec.flop_kind else 0
  ctx.emit(P.Superstep(
      name=f"{ctx.op}/final" if not skip_stage1 else ctx.op, op=ctx.op,
      reads=tuple(sources) + tuple(plan.inits.reads), writes=tuple(outputs),
      fn=functools.partial(_final_per_tile, spec, plan.inits, tuple(outputs),
                           _PerTilePlan.of(plan, out_map)),
      compute_cycles=stage2.cycles,
      exchange=_add(stage2.cost, _init_cost(ctx, plan.inits.reads, out_map.tiles)),
      vertices=worker_vertices(ctx, out_map.elements_per_tile(ctx.target.num_tiles)),
      codelets=(vocab.vertex(vocab.REDUCE, spec.kind),), flops=int(flops),
      logical=functools.partial(_final_logical, spec, plan.inits, groups.first_of_key,
                                skip_stage1, tuple(outputs))))


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
  def rule(ctx, x, **params):
    spec = _monoid_spec(prim, params, x.dtype, kind)
    return _lower_reduction(ctx, spec, [x], params["axes"])
  return rule


for _prim, _kind in _MONOIDS.items():
  register_lowering(_prim, _make_monoid_rule(_prim, _kind))


def _make_arg_rule(prim, is_max):
  def rule(ctx, x, **params):
    if len(params["axes"]) != 1:
      raise NotImplementedError(f"{prim.name} over {len(params['axes'])} axes")
    spec = _arg_spec(prim, params, x.dtype, is_max)
    return _lower_reduction(ctx, spec, [x], params["axes"])
  return rule


register_lowering(lax_internal.argmax_p, _make_arg_rule(lax_internal.argmax_p, True))
register_lowering(lax_internal.argmin_p, _make_arg_rule(lax_internal.argmin_p, False))


@register_lowering(lax_internal.reduce_p)
def _reduce_rule(ctx, *operands, computation, jaxpr, dimensions):
  """``lax.reduce`` with a jaxpr computation (assumed associative/commutative)."""
  num = len(operands) // 2
  xs, inits = operands[:num], operands[num:]
  if getattr(jaxpr, "consts", ()):
    raise NotImplementedError("reduce computations that close over constants")
  params = dict(computation=computation, jaxpr=jaxpr, dimensions=dimensions)
  spec = _generic_spec(params, [x.dtype for x in xs], num)
  return _lower_reduction(ctx, spec, list(xs), dimensions, inits)
