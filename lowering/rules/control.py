"""Control flow: inlined calls, scan, while and cond as tile control programs.

Tile plan:

* **Inlined calls** (``jit``, ``closed_call``, ``call``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``remat``): the inner jaxpr is lowered in place on the
  operand tensors, as XLA inlines calls; nothing is copied. A live
  ``custom_lin`` (``jax.jvp`` through a ``custom_vjp``) is refused with
  ``jax.jit``'s reason; a dead one never reaches lowering.
* **scan** becomes ``Repeat(length, body)``. Before the loop, the carries are
  copied into loop-carried tensors (one exchange step) and an iteration counter
  (an int32 scalar on one tile) is zeroed. Each iteration runs

  1. a *slice* step: the counter is broadcast to the tiles holding the stacked
     ``xs``; each of them copies its part of row ``i`` (``length - 1 - i`` when
     ``reverse``) and the exchange moves it to the body's slice tensor;
  2. the body, lowered in a sub-program;
  3. an *update* step: the ``ys`` rows are exchanged into the stacked outputs
     at row ``i``, the body's new carries are copied into the carried tensors
     (all reads happen before any write, so swapped carries are safe), and the
     counter is incremented.

  A dynamic slice moves different tiles' data on different iterations; the
  static exchange is sized for the worst iteration of every tile, as a Poplar
  program is compiled for all the offsets it may see.
* **while** becomes ``RepeatWhileTrue(condition, predicate, body)``: the
  condition jaxpr is lowered into the condition program (its boolean output is
  the predicate), the body into the body program, ending with the carry copy.
  A *batched* predicate (``vmap`` of a data-dependent ``while_loop``, e.g.
  ``jnp.gcd`` under ``vmap``) is one flag per lane: the condition program ORs
  the lanes (each tile its own, then the per-tile flags on one tile) into the
  loop's predicate, and the body ends with a select step instead of the copy:
  lanes whose flag was true take the body's values, lanes already done keep
  theirs, so the loop runs until every lane is done with finished lanes
  frozen, as XLA's lowering does.
* **cond** becomes ``If`` (two branches) or ``Switch`` (more) on the index: each
  branch is lowered in its own sub-program and ends by copying its results into
  result tensors shared by all branches (mapped like branch 0's results, so
  that branch's copy is an on-tile one). An index out of range runs the last
  branch, as XLA's ``case`` does.

Loop and branch bodies record the tensors created inside them (their locals):
they are written before they are read on every iteration, so the executor need
not carry them between iterations.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.jax_compat import (ad_checkpoint, ad_internal, control_flow, core,
                                         custom_derivatives, pjit)
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import movement_cost, relayout, relayout_cost, to_flat, to_storage
from ipu_jax.lowering.jax_compat import physical_shape_dtype
from ipu_jax.lowering.lower import lower_closed_jaxpr, lower_jaxpr
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.dynamic_rows import dynamic_rows_cost, read_row, row_positions, write_row

__all__ = ["copy_step", "make_repeat"]


# -- helpers ------------------------------------------------------------------


def _note_keys(jaxpr, tensors) -> None:
  """Record the PRNG impl of key-typed inputs of ``jaxpr`` (see random.py)."""
  from ipu_jax.lowering.rules.random import note_key_avals
  inner = getattr(jaxpr, "jaxpr", jaxpr)
  note_key_avals([v.aval for v in inner.invars], tensors)


def lower_inline(ctx, jaxpr, args) -> list:
  """Lower a ``ClosedJaxpr`` or an open ``Jaxpr`` (no constvars) inline."""
  _note_keys(jaxpr, args)
  if hasattr(jaxpr, "consts") and hasattr(jaxpr, "jaxpr"):
    return lower_closed_jaxpr(ctx.module, jaxpr, list(args))
  if jaxpr.constvars:
    raise NotImplementedError("an open jaxpr with constvars cannot be inlined")
  return lower_jaxpr(ctx.module, jaxpr, [], list(args))


def _fields(cls) -> set:
  return {f.name for f in dataclasses.fields(cls)}


def make_repeat(count: int, body, local_ids=()):
  """``P.Repeat``, passing ``local_ids`` when the IR supports it."""
  if "local_ids" in _fields(P.Repeat):
    return P.Repeat(count, body, local_ids=frozenset(local_ids))
  return P.Repeat(count, body)


def _make_while(condition, predicate, body, local_ids=()):
  if "local_ids" in _fields(P.RepeatWhileTrue):
    return P.RepeatWhileTrue(condition, predicate, body, local_ids=frozenset(local_ids))
  return P.RepeatWhileTrue(condition, predicate, body)


def _make_branching(index, branches, local_ids=()):
  """``If`` for two branches, else ``Switch``; out-of-range runs the last."""
  kwargs = {}
  cls = P.If if len(branches) == 2 else P.Switch
  if "local_ids" in _fields(cls):
    kwargs["local_ids"] = frozenset(local_ids)
  if len(branches) == 2:
    # XLA's case runs the last branch for any index outside [0, n): so any
    # non-zero index runs branch 1, exactly If's rule.
    return P.If(index, branches[1], branches[0], **kwargs)
  cases = [(i, b) for i, b in enumerate(branches[:-1])]
  return P.Switch(index, cases, branches[-1], **kwargs)


def copy_step(ctx, dsts: Sequence[P.Tensor], srcs: Sequence[P.Tensor],
              name: str = "copy") -> Optional[P.Superstep]:
  """One step copying every ``srcs[i]`` into ``dsts[i]`` in parallel.

  All sources are read before any destination is written, so a destination
  may also be another pair's source (swapped loop carries). Pairs where the
  source already is the destination are left out. Returns ``None`` when
  nothing needs copying. The step is not emitted.
  """
  # A source with the destination's id is the destination (or a reshaped
  # alias of it, sharing its storage): nothing to copy.
  pairs = [(d, s) for d, s in zip(dsts, srcs) if d.id != s.id and d.size > 0]
  if not pairs:
    return None
  for d, s in pairs:
    if d.size != s.size:
      raise ValueError(f"copy {s.shape} into {d.shape}")
  src_maps = [s.mapping for _, s in pairs]
  dst_maps = [d.mapping for d, _ in pairs]
  dst_dtypes = [d.dtype for d, _ in pairs]

  def fn(*storages):
    return tuple(relayout(x, sm, dm).astype(dt)
                 for x, sm, dm, dt in zip(storages, src_maps, dst_maps, dst_dtypes))

  dst_shapes = [d.shape for d, _ in pairs]

  def logical(*arrays):
    # A copy moves elements between tiles; its values are its sources'.
    return tuple(jnp.reshape(x, shape).astype(dt)
                 for x, shape, dt in zip(arrays, dst_shapes, dst_dtypes))

  cost = add_costs(*[relayout_cost(ctx.target, s.mapping, d.mapping, s.itemsize)
                     for d, s in pairs])
  return P.Superstep(name=name, op=ctx.op, reads=tuple(s for _, s in pairs),
                     writes=tuple(d for d, _ in pairs), fn=fn, logical=logical,
                     exchange=cost, source=ctx.source)


def _emit_copies(ctx, dsts, srcs, name="copy") -> None:
  step = copy_step(ctx, dsts, srcs, name)
  if step is not None:
    ctx.emit(step)


def _carry_tensor(ctx, init: P.Tensor, name: str) -> P.Tensor:
  """A loop-carried tensor for ``init``: mapped like it unless it is a constant."""
  mapping = init.mapping if init.category != "constants" and init.size else None
  return ctx.new_tensor(init.shape, init.dtype, mapping, name=name)


def _slice_mapping(stacked: P.Tensor, carries) -> Optional[TileMapping]:
  """Where a scan body's row of ``stacked`` lives.

  Next to a carry of the same shape when there is one (``carry + x`` then
  needs no exchange inside the body); else linear (``None``).
  """
  shape = tuple(stacked.shape[1:])
  for c in carries:
    if tuple(c.shape) == shape and c.itemsize == stacked.itemsize and c.size:
      return c.mapping
  return None


def _scalar(storage_array):
  return storage_array.reshape(-1)[0]


# -- inlined calls ------------------------------------------------------------


def _inline_rule(param_names):
  def rule(ctx: RuleContext, *operands, **params):
    for name in param_names:
      jaxpr = params.get(name)
      if jaxpr is not None:
        return lower_inline(ctx, jaxpr, operands)
    raise NotImplementedError(f"no inner jaxpr among {param_names}")
  return rule


def _register_calls():
  calls = [
      (pjit.jit_p, ("jaxpr",)),
      (core.closed_call_p, ("call_jaxpr",)),
      (core.call_p, ("call_jaxpr",)),
      (custom_derivatives.custom_jvp_call_p, ("call_jaxpr",)),
      (custom_derivatives.custom_jvp_call_jaxpr_p, ("fun_jaxpr",)),
      (custom_derivatives.custom_vjp_call_p, ("call_jaxpr",)),
      (ad_checkpoint.remat_p, ("jaxpr",)),
  ]
  for prim, names in calls:
    register_lowering(prim, _inline_rule(names))


_register_calls()


def _custom_lin(ctx: RuleContext, *operands, **params):
  """A live ``custom_lin``: the tangent of ``jax.jvp`` through a ``custom_vjp``.

  ``jax.jit`` refuses it (a ``custom_vjp`` has no forward mode); a dead one
  never gets here (``lowering/dead_code.py`` removes it first).
  """
  del ctx, operands, params
  raise NotImplementedError(
      "can't apply forward-mode autodiff (jvp) to a custom_vjp function, as jax.jit says; "
      "use its VJP (jax.grad, jax.vjp), or define the function with jax.custom_jvp")


register_lowering(ad_internal.custom_lin_p, _custom_lin)


# -- scan ---------------------------------------------------------------------


def _with_zero_counter(copy_fn, counter_shape, *storages):
  """The init copies, then a zeroed loop counter (storages or logical arrays)."""
  return tuple(copy_fn(*storages)) + (jnp.zeros(counter_shape, jnp.int32),)


def _scan_row(counter_storage, length: int, reverse: bool):
  """The stacked row iteration ``counter_storage`` works on."""
  i = _scalar(counter_storage)
  return (length - 1 - i) if reverse else i


def _emit_scan_init(ctx, carries, inits, counter: P.Tensor) -> None:
  """The carries' init copies and the counter's zeroing, as one step.

  The counter is zeroed by a one-element fill vertex on its tile.
  """
  target = ctx.target
  counter_tiles = counter.mapping.elements_per_tile(target.num_tiles)
  fill = estimators.fill_cycles(target, counter_tiles, 4)
  counter_shape = counter.storage_shape
  init = copy_step(ctx, carries, inits, "scan/init")
  if init is None:
    ctx.emit(P.Superstep(
        name="scan/init", op=ctx.op, reads=(), writes=(counter,),
        fn=lambda: (jnp.zeros(counter_shape, jnp.int32),),
        compute_cycles=fill, vertices=(counter_tiles > 0).astype(np.int64),
        codelets=(vocab.vertex(vocab.FILL, "int"),)))
    return
  init.fn = functools.partial(_with_zero_counter, init.fn, counter_shape)
  init.logical = functools.partial(_with_zero_counter, init.logical, counter.shape)
  init.writes = init.writes + (counter,)
  init.compute_cycles = fill
  init.vertices = (counter_tiles > 0).astype(np.int64)
  init.codelets = init.codelets + (vocab.vertex(vocab.FILL, "int"),)
  ctx.emit(init)


def _rows_costs(ctx, pairs, to_piece: bool, counter: P.Tensor, cycles):
  """``(cycles, exchange costs)`` of moving the rows of ``(stacked, piece)`` pairs.

  Each pair's compute cycles are added to ``cycles`` in turn.
  """
  costs = []
  for stacked, piece in pairs:
    cost, cy = dynamic_rows_cost(ctx, stacked, piece, to_piece, counter)
    costs.append(cost)
    cycles = cycles + cy
  return cycles, costs


@dataclasses.dataclass(frozen=True)
class _RowRead:
  """How the slice step reads one row of a stacked ``xs`` into its slice."""

  mapping: TileMapping          # the stacked tensor's
  positions: Optional[np.ndarray]   # see row_positions
  size: int                     # elements per row
  slice_mapping: TileMapping


def _slice_rows(length, reverse, reads, counter_storage, *stacked):
  """The slice step's function: row ``i`` of every stacked tensor, in its slice's layout."""
  row = _scan_row(counter_storage, length, reverse)
  return tuple(to_storage(read_row(st, r.mapping, r.positions, row, r.size), r.slice_mapping)
               for st, r in zip(stacked, reads))


def _emit_scan_slice(ctx, xs, slices, counter: P.Tensor, length: int, reverse: bool) -> None:
  """Step 1 of an iteration: row ``i`` of every ``xs`` into its body slice."""
  moves = [(x, s) for x, s in zip(xs, slices) if s.size]
  if not moves:
    return
  cycles, costs = _rows_costs(ctx, moves, True, counter, np.zeros(ctx.target.num_tiles))
  reads = tuple(_RowRead(x.mapping, row_positions(x.mapping, length, s.size), s.size,
                         s.mapping) for x, s in moves)
  ctx.emit(P.Superstep(
      name="scan/slice", op=ctx.op, reads=(counter,) + tuple(x for x, _ in moves),
      writes=tuple(s for _, s in moves),
      fn=functools.partial(_slice_rows, length, reverse, reads), compute_cycles=cycles,
      exchange=add_costs(*costs), vertices=(cycles > 0).astype(np.int64),
      codelets=(vocab.DYNAMIC_SLICE,)))


def _update_rows(length, reverse, y_plans, copy_fn, counter_storage, *rest):
  """The ys rows written at row ``i``, the carry copies, the counter incremented."""
  n_y = len(y_plans)
  stacked, values, copy_in = rest[:n_y], rest[n_y:2 * n_y], rest[2 * n_y:]
  row = _scan_row(counter_storage, length, reverse)
  new_stacked = tuple(write_row(st, None, None, row, n, to_flat(v, m))
                      for st, v, (m, n) in zip(stacked, values, y_plans))
  return new_stacked + tuple(copy_fn(*copy_in)) + (counter_storage + 1,)


def _no_copies():
  return ()


def _emit_scan_update(ctx, ys_stacked, ys, carries, new_carries, counter: P.Tensor,
                      length: int, reverse: bool) -> None:
  """Step 3 of an iteration: ys rows, carry copies and the counter increment.

  The stacked ys are new (linear) tensors, so their rows are plain slices.
  """
  target = ctx.target
  y_pairs = [(st, y) for st, y in zip(ys_stacked, ys) if y.size]
  copies = copy_step(ctx, carries, new_carries)
  counter_tiles = counter.mapping.elements_per_tile(target.num_tiles)
  cycles, row_costs = _rows_costs(
      ctx, y_pairs, False, counter, estimators.elementwise_cycles(target, counter_tiles, "add", 4))
  costs = [copies.exchange if copies is not None else None] + row_costs
  y_plans = tuple((y.mapping, y.size) for _, y in y_pairs)
  copy_fn = copies.fn if copies is not None else _no_copies
  copy_reads = copies.reads if copies is not None else ()
  copy_writes = copies.writes if copies is not None else ()
  ctx.emit(P.Superstep(
      name="scan/update", op=ctx.op,
      reads=(counter,) + tuple(st for st, _ in y_pairs) + tuple(y for _, y in y_pairs)
      + tuple(copy_reads),
      writes=tuple(st for st, _ in y_pairs) + tuple(copy_writes) + (counter,),
      fn=functools.partial(_update_rows, length, reverse, y_plans, copy_fn),
      compute_cycles=cycles, exchange=add_costs(*costs),
      vertices=(cycles > 0).astype(np.int64),
      codelets=(vocab.DYNAMIC_UPDATE_SLICE, vocab.vertex(vocab.ELEMENTWISE, "add"))))


def _scan_rule(ctx: RuleContext, *operands, jaxpr, length, reverse, num_consts, num_carry,
               unroll=1, **params):
  del unroll, params  # unrolling does not change the tile program's numbers
  length = int(length)
  consts = list(operands[:num_consts])
  inits = list(operands[num_consts:num_consts + num_carry])
  xs = list(operands[num_consts + num_carry:])
  # A variable no later operation reads is carried in its own memory (updated
  # in place, as the weights in a training loop are), not in a copy.
  carries = [x if ctx.updatable_in_place(x) else _carry_tensor(ctx, x, "scan/carry")
             for x in inits]
  ys_stacked = []
  for aval in jaxpr.out_avals[num_carry:]:
    shape, dtype = physical_shape_dtype(aval)
    ys_stacked.append(ctx.new_tensor((length,) + shape, dtype, name="scan/ys"))
  if length == 0:
    _emit_copies(ctx, carries, inits, "scan/init")
    return carries + ys_stacked

  counter = ctx.new_tensor((), np.int32, name="scan/counter")
  _emit_scan_init(ctx, carries, inits, counter)
  with ctx.sub_program() as (body, local_ids):
    slices = [ctx.new_tensor(x.shape[1:], x.dtype, _slice_mapping(x, carries), name="scan/x")
              for x in xs]
    _emit_scan_slice(ctx, xs, slices, counter, length, reverse)
    _note_keys(jaxpr, consts + inits + xs)
    _note_keys(jaxpr, consts + carries + slices)
    outs = lower_closed_jaxpr(ctx.module, jaxpr, consts + carries + slices)
    _emit_scan_update(ctx, ys_stacked, outs[num_carry:], carries, outs[:num_carry], counter,
                      length, reverse)
  ctx.emit(make_repeat(length, body, local_ids))
  return carries + ys_stacked


# -- while --------------------------------------------------------------------


def _while_rule(ctx: RuleContext, *operands, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts,
                **params):
  del params
  cond_consts = list(operands[:cond_nconsts])
  body_consts = list(operands[cond_nconsts:cond_nconsts + body_nconsts])
  inits = list(operands[cond_nconsts + body_nconsts:])
  carries = [_carry_tensor(ctx, x, "while/carry") for x in inits]
  _note_keys(body_jaxpr, body_consts + inits)
  _note_keys(body_jaxpr, body_consts + carries)
  _note_keys(cond_jaxpr, cond_consts + carries)
  _emit_copies(ctx, carries, inits, "while/init")
  batched = bool(cond_jaxpr.out_avals[0].shape)
  with ctx.sub_program() as (condition, cond_locals):
    lanes, = lower_closed_jaxpr(ctx.module, cond_jaxpr, cond_consts + carries)
    predicate = _any_lane(ctx, lanes) if batched else lanes
  with ctx.sub_program() as (body, body_locals):
    outs = lower_closed_jaxpr(ctx.module, body_jaxpr, body_consts + carries)
    if batched:
      _emit_lane_select(ctx, carries, outs, lanes)
    else:
      _emit_copies(ctx, carries, outs, "while/copy")
  # The predicate is read after the loop's last condition, and a batched
  # body reads the lanes' predicate: keep them carried.
  cond_locals.discard(predicate.id)
  cond_locals.discard(lanes.id)
  ctx.emit(_make_while(condition, predicate, body, cond_locals | body_locals))
  return carries


def _any_lane(ctx, lanes: P.Tensor) -> P.Tensor:
  """The loop's scalar predicate: whether any lane of a batched one is true.

  A two-stage OR reduction: each tile ORs the lanes it holds, then the
  partial flags (one byte per tile) are gathered onto the predicate's tile.
  """
  target = ctx.target
  predicate = ctx.new_tensor((), np.bool_, name="while/any")
  held = lanes.mapping.elements_per_tile(target.num_tiles)
  partial_tiles = np.flatnonzero(held)
  dst = int(predicate.mapping.tiles[0])
  exchange = movement_cost(target, partial_tiles,
                           np.full(partial_tiles.size, dst, np.int64), 1)
  compute = estimators.reduce_cycles(target, held, 1)
  compute[dst] += estimators.reduce_cycles(
      target, np.array([partial_tiles.size]), 1)[0]

  def fn(lanes_storage):
    return (to_storage(jnp.any(to_flat(lanes_storage, lanes.mapping)).reshape(1),
                       predicate.mapping),)

  ctx.emit(P.Superstep(name="while/any", op=ctx.op, reads=(lanes,), writes=(predicate,),
                       fn=fn, compute_cycles=compute,
                       exchange=exchange if exchange.total_bytes else None,
                       vertices=np.minimum(held, 1) + (np.arange(target.num_tiles) == dst),
                       codelets=(vocab.vertex(vocab.REDUCE, "or"),)))
  return predicate


def _emit_lane_select(ctx, carries, outs, lanes: P.Tensor) -> None:
  """Carries of a batched while: lanes still running take the body's values.

  A lane whose predicate was false before this iteration keeps its carry
  (it finished, so it stays frozen) as XLA's lowering of a batched predicate
  does. ``lanes`` has a prefix of every carry's shape; each carry element
  needs its lane's flag, multicast to the carry's tiles, and the body's value,
  exchanged into the carry's layout; each tile then runs ``Select`` vertices.
  """
  target = ctx.target
  pairs = [(c, o) for c, o in zip(carries, outs) if c.size]
  if not pairs:
    return
  costs, elements = [], np.zeros(target.num_tiles, np.int64)
  for carry, out in pairs:
    if tuple(carry.shape[:len(lanes.shape)]) != tuple(lanes.shape):
      raise NotImplementedError(
          f"while: batched predicate {lanes.shape} is not a prefix of carry {carry.shape}")
    lane_of = np.arange(carry.size, dtype=np.int64) // (carry.size // max(lanes.size, 1))
    # A flag arrives once on each tile that holds elements of its lane.
    needs = np.unique(lane_of * target.num_tiles + carry.mapping.element_tile)
    lane, dst = needs // target.num_tiles, needs % target.num_tiles
    costs.append(movement_cost(target, lanes.mapping.element_tile[lane], dst, 1,
                               element_id=lane))
    costs.append(relayout_cost(target, out.mapping, carry.mapping, out.itemsize))
    elements += carry.mapping.elements_per_tile(target.num_tiles)
  carry_maps = [c.mapping for c, _ in pairs]
  out_maps = [o.mapping for _, o in pairs]
  shapes = [c.shape for c, _ in pairs]
  dtypes = [c.dtype for c, _ in pairs]

  def fn(lanes_storage, *storages):
    flags = to_flat(lanes_storage, lanes.mapping).reshape(lanes.shape)
    olds, news = storages[:len(pairs)], storages[len(pairs):]
    result = []
    for old, new, cm, om, shape, dtype in zip(olds, news, carry_maps, out_maps, shapes, dtypes):
      old_value = to_flat(old, cm).reshape(shape)
      new_value = to_flat(relayout(new, om, cm), cm).reshape(shape).astype(dtype)
      mask = flags.reshape(flags.shape + (1,) * (len(shape) - flags.ndim))
      result.append(to_storage(jnp.where(mask, new_value, old_value).reshape(-1), cm))
    return tuple(result)

  ctx.emit(P.Superstep(
      name="while/select", op=ctx.op,
      reads=(lanes,) + tuple(c for c, _ in pairs) + tuple(o for _, o in pairs),
      writes=tuple(c for c, _ in pairs), fn=fn,
      compute_cycles=estimators.elementwise_cycles(target, elements, "select_n", 4),
      exchange=add_costs(*costs), vertices=np.minimum(elements, target.worker_contexts),
      codelets=(vocab.SELECT,)))


# -- cond ---------------------------------------------------------------------


def _cond_rule(ctx: RuleContext, index, *operands, branches, **params):
  del params  # branches_platforms: the index already says which branch
  operands = list(operands)
  if len(branches) == 1:
    return lower_closed_jaxpr(ctx.module, branches[0], operands)
  if index.category == "constants" and index.value is not None:
    # A static index picks its branch at compile time (XLA folds it too).
    i = int(np.asarray(index.value).reshape(()))
    i = i if 0 <= i < len(branches) else len(branches) - 1
    return lower_closed_jaxpr(ctx.module, branches[i], operands)
  _note_keys(branches[0], operands)
  sequences, outputs, local_ids = [], [], set()
  for branch in branches:
    with ctx.sub_program() as (seq, locals_):
      outputs.append(lower_closed_jaxpr(ctx.module, branch, operands))
    sequences.append(seq)
    local_ids |= locals_
  results = []
  for i, first in enumerate(outputs[0]):
    mapping = first.mapping if first.category != "constants" and first.size else None
    results.append(ctx.new_tensor(first.shape, first.dtype, mapping, name="cond/result"))
  for seq, outs in zip(sequences, outputs):
    step = copy_step(ctx, results, outs, "cond/result")
    if step is not None:
      ctx.emit(step, into=seq)
  ctx.emit(_make_branching(index, sequences, local_ids))
  return results


def _register_control_flow():
  cf = control_flow
  register_lowering(cf.scan_p, _scan_rule)
  register_lowering(cf.while_p, _while_rule)
  register_lowering(cf.cond_p, _cond_rule)


_register_control_flow()
