"""Elementwise fusion: chains of elementwise steps on one layout become one step.

The rules lower every elementwise equation to its own superstep (sync,
exchange, one compute set). The real toolchain does not: popops map
expressions and XLA's fusion in TensorFlow-IPU turn a chain such as
``b2 * nu + (1 - b2) * g ** 2`` into one compute set whose vertex on each tile
evaluates the whole expression over its elements. This pass does the same on
the tile program, after lowering.

Why here and not on the jaxpr: only after lowering is it known which
equations became elementwise compute sets and on which layout (operands with
size-1 axes are read broadcast, mappings follow operands, scalars may be
baked into the vertex). The pass reads that from the steps themselves
(:attr:`Superstep.elementwise`, set by ``builders.elementwise``) and needs no
second copy of the lowering rules.

Tile plan of a fused step: the same tiles and elements per tile as each of its
members (they share one mapping), one vertex per worker on each tile as
before. Its exchange brings every operand that comes from outside the group
onto the layout before the compute phase (each such tensor once; operands
made inside the group are already on the right tiles, so nothing moves for
them). Its compute phase is, per tile, the cheapest way PopLibs runs the
chain (``lowering/fused_cost.py``): one generated map codelet for the whole
expression, popops' ScaledAdd-family vertex where the chain is that pattern,
or the members' vertices in turn, the sum of their cycles less the fixed
cost each extra member would have paid for its own compute set (the
supervisor's launch and each worker's vertex overhead,
``estimators.worker_split_cycles``' fixed part). One sync replaces one per
member.

Grouping: within each straight-line run of supersteps (control programs,
stream copies and prints are barriers), steps are visited in program order;
the dependencies between them (read-after-write, write-after-read,
write-after-write on tensor ids) decide what may move. An elementwise step
joins an open group on the same mapping when everything it depends on is
already emitted or in that group; a step that depends on an open group closes
(emits) it first. So independent work may be emitted before a group that is
still growing, but never out of dependency order, and every value is computed
by the same functions from the same inputs: the numbers do not change. (An
optimizer's update, written leaf by leaf for each operation, thus becomes one
compute set per parameter.) Forward work a backward pass recomputes (JAX's
``rematted_computation`` scope) groups only with recomputed work: TF-IPU's
recomputation clones the forward stage's own program, which does not merge
with the gradient's compute sets (and so ``recompute_cycles`` stays the
cycles of whole steps).

A producer on another layout joins its consumer's group when nothing else
reads its results (``b1 * mu`` on the moment's layout feeding a chain on the
gradient's): its vertices then run on the chain's tiles, costed there by the
elementwise estimator, with its operands exchanged to them instead of its
result. Scalar expressions stay on their own tile, as on the IPU.

Memory: a member's result that nothing outside the group reads (and that is
not a program output, variable or constant) is never written to tile memory
between supersteps; it lives only inside the fused step. Those values still
count: the fused step's scratch is, per tile, the peak of such intermediates
live at once within the chain, a member's result written over an
intermediate it reads last as separate steps would write it. The memory
analysis may also write the fused step's result over an operand the step
reads last (``analysis._in_place_results``): one compute set, whose
generated codelet evaluates the chain element by element, needs no second
buffer for them; the scratch still counts the chain's intermediates as the
members in turn would hold them (a conservative reading, as before).

Host cost: the pass must cost less than the profiling of the steps it
removes. It walks the program once to count reads and writes, numbers each
layout once (compared by a sample of storage slots, then in full only when
the sample agrees), so grouping compares integers; it finds dependencies in
the same scan that groups. The per-tile figures of all fused steps of a run
(cycles, vertices, exchanged bytes) are reduced together, groups of equal
size stacked into one array, and the scratch liveness is kept as bytes per
element per layout, turned into bytes per tile once per step.

Execution: a fused step's function calls its members' functions in order
on the storages (each result cast to its tensor's dtype, as the executor
stores it), inside the one jitted program, so XLA sees the same operations
as for the separate steps (the same HLO instructions, measured on the
training steps of docs/fusion.md) and the numbers are the same bit for bit.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Iterable

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import fused_cost
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import broadcast_cost
from ipu_jax.lowering.exchange import relayout_cost
from ipu_jax.lowering.scopes import recomputed
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.fused_step import (chain_cycles, common_scope, fold_rows, fused_fn,
                                         fused_logical, sum_costs, without_figures)
from ipu_jax.lowering.layout_numbers import LayoutNumbers
from ipu_jax.lowering.movement import broadcast_read_exchange
from ipu_jax.lowering.reduce_many import fold_sums
from ipu_jax.lowering.tile_generators import HARDWARE_BITS_VERTEX

__all__ = ["fuse_elementwise", "vertex_overhead_cycles"]


def vertex_overhead_cycles(target: IPUTarget) -> int:
  """Fixed cycles of one elementwise compute set on a tile that has work.

  The supervisor's launch plus each worker's vertex overhead: what a fused
  chain pays once instead of once per member.
  """
  return target.worker_contexts * estimators.WORKER_OVERHEAD + target.supervisor_overhead_cycles


def fuse_elementwise(program: P.Program, target: IPUTarget,
                     keep: Iterable[P.Tensor] = ()) -> P.Program:
  """``program`` with chains of elementwise steps fused (a new program tree).

  Args:
    program: the lowered control program; not modified.
    target: the IPU target (for the per-compute-set overheads saved).
    keep: tensors read after the program ends (its outputs): a step that
      writes one keeps writing it.
  """
  reads, writes = {}, {}
  _count_uses(program, reads, writes)
  for tensor in keep:
    reads[tensor.id] = reads.get(tensor.id, 0) + _NEVER_INTERNAL
  fuser = _Fuser(target, reads, writes)
  return fuser.program(program)


# Added to a tensor's read count when something outside the supersteps reads
# it (a control program's predicate, the program's caller): no group can
# account for every read, so its writer keeps writing it.
_NEVER_INTERNAL = 1 << 20


def _count_uses(node, reads: dict, writes: dict) -> None:
  """Counts, per tensor id, the reads and writes of the whole program.

  One walk of the tree: supersteps, stream copies and prints are leaves;
  a control program's predicate or control tensor is read by the host's
  choice of path, never by a compute set.
  """
  if node is None:
    return
  if isinstance(node, P.Superstep):
    for t in node.reads:
      reads[t.id] = reads.get(t.id, 0) + 1
    for t in node.writes:
      writes[t.id] = writes.get(t.id, 0) + 1
    return
  if isinstance(node, (P.StreamCopy, P.PrintTensor)):
    i = node.tensor.id
    reads[i] = reads.get(i, 0) + 1
    if isinstance(node, P.StreamCopy):
      writes[i] = writes.get(i, 0) + 1
    return
  if isinstance(node, (P.RepeatWhileTrue, P.If)):
    reads[node.predicate.id] = reads.get(node.predicate.id, 0) + _NEVER_INTERNAL
  elif isinstance(node, P.Switch):
    reads[node.control.id] = reads.get(node.control.id, 0) + _NEVER_INTERNAL
  # Other nodes are checked when the fuser walks the same tree.
  for child in P.children(node):
    _count_uses(child, reads, writes)


class _Fuser:
  """Rebuilds a program tree with its straight-line runs fused."""

  def __init__(self, target, reads, writes):
    self.target = target
    self.reads = reads
    self.writes = writes
    self.overhead = vertex_overhead_cycles(target)
    self.layouts = LayoutNumbers(target.num_tiles)
    self._exchanges = {}
    self._moved_cycles = {}
    self._expressions = {}

  def program(self, node):
    if node is None or isinstance(node, (P.Superstep, P.StreamCopy, P.PrintTensor)):
      return node
    if isinstance(node, P.Sequence):
      return P.Sequence(self._sequence(node))
    if isinstance(node, (P.Repeat, P.Replicated)):
      return dataclasses.replace(node, body=self.program(node.body))
    if isinstance(node, P.RepeatWhileTrue):
      return dataclasses.replace(node, condition=self.program(node.condition),
                                 body=self.program(node.body))
    if isinstance(node, P.If):
      return dataclasses.replace(node, then=self.program(node.then),
                                 else_=self.program(node.else_))
    if isinstance(node, P.Switch):
      return dataclasses.replace(node, cases=[(v, self.program(p)) for v, p in node.cases],
                                 default=self.program(node.default))
    raise TypeError(f"not a tile program: {node!r}")

  def _sequence(self, sequence) -> list:
    out, run = [], []
    for child in _flatten(sequence):
      if isinstance(child, P.Superstep):
        run.append(child)
        continue
      out.extend(self._run(run))
      run = []
      out.append(self.program(child))
    out.extend(self._run(run))
    return out

  def _run(self, steps) -> list:
    """Schedule a straight-line run of supersteps, fusing where allowed."""
    # Sums first take their casts and squares and their siblings as popops runs them.
    steps = fold_sums(steps, self.target, self.reads)
    if len(steps) < 2:
      return list(steps)
    works = [_work(step) for step in steps]
    if sum(w is not None for w in works) < 2:
      return list(steps)  # nothing to fuse with: the run as it was
    out = []                  # steps, and groups where their fused steps go
    open_groups = []          # groups not yet emitted, in creation order
    group_of = {}             # step index -> its open group
    # The dependencies between steps (read-after-write, write-after-read,
    # write-after-write), found as the run is scanned.
    last_writer, readers = {}, {}

    def close(group):
      open_groups.remove(group)
      group.members.sort()
      out.append(group)
      for i in group.members:
        del group_of[i]

    for i, step in enumerate(steps):
      preds = set()
      for t in step.reads:
        w = last_writer.get(t.id)
        if w is not None:
          preds.add(w)
        readers.setdefault(t.id, []).append(i)
      for t in step.writes:
        w = last_writer.get(t.id)
        if w is not None:
          preds.add(w)
        preds.update(readers.get(t.id, ()))
        last_writer[t.id] = i
        readers[t.id] = []
      preds.discard(i)
      pending = {group_of[p] for p in preds if p in group_of}
      work = works[i]
      home = None
      if recomputed(step.scope):
        # A segment's recomputation runs after the gradient work before it
        # (interleaved recomputation): that work's groups do not sink past it.
        for g in [g for g in open_groups if not g.recomputed]:
          close(g)
      if work is not None:
        # Prefer a group this step reads from (a chain), else the newest.
        layout = self.layouts.number(work.mapping)
        again = recomputed(step.scope)
        # Hardware random bits start a group of their own: the chain that
        # turns them into samples is one poprand vertex (fused_cost.find_sampler).
        joinable = [] if _draws_hardware_bits(step) else open_groups
        for g in reversed(joinable):
          if g.layout == layout and g.recomputed == again:
            if g in pending:
              home = g
              break
            if home is None:
              home = g
        if home is None:
          home = _Group(work.mapping, layout, again)
          open_groups.append(home)
        home.members.append(i)
        group_of[i] = home
      if pending:
        for g in [g for g in open_groups if g in pending and g is not home]:
          if home is not None and self._absorbable(g, home, steps, works):
            # A producer on another layout whose results only this chain
            # reads: its vertices move onto the chain's tiles.
            open_groups.remove(g)
            home.members.extend(g.members)
            for j in g.members:
              group_of[j] = home
          else:
            close(g)
      if work is None:
        out.append(step)
    for g in list(open_groups):
      close(g)
    fused = self._fuse_groups([g for g in out if isinstance(g, _Group)], steps, works)
    return [fused[id(g)] if isinstance(g, _Group) else g for g in out]

  def _absorbable(self, producer, consumer, steps, works) -> bool:
    """Whether ``producer``'s steps can run inside ``consumer``'s compute set.

    Every result of ``producer`` must be an intermediate that only the two
    groups read (so no other layout of it is ever needed), of the
    consumer's size, and every step's cost must be known on any layout.
    """
    if (any(not works[j].cost_op for j in producer.members)
        or producer.recomputed != consumer.recomputed):
      return False
    inside = {}
    for j in producer.members + consumer.members:
      for t in steps[j].reads:
        inside[t.id] = inside.get(t.id, 0) + 1
    for j in producer.members:
      for t in steps[j].writes:
        if (t.category != "temporaries" or self.writes.get(t.id, 0) != 1
            or self.reads.get(t.id, 0) != inside.get(t.id, 0)
            or t.mapping.num_elements != consumer.mapping.num_elements):
          return False
    return True

  def _fuse_groups(self, groups, steps, works) -> dict:
    """The step of each group (by ``id``): its fused step, or its one step.

    What is per tile (cycles, vertices, exchanged bytes) is folded over each
    group's members' rows in their order (:func:`fold_rows`): a few
    in-place array operations per member (each the length of the tiles),
    rather than stacking every member's rows into ``[groups, rows, tiles]``
    arrays and reducing those, whose copies were most of the time on several
    IPUs (rows thousands of tiles long); the sums combine the rows in the
    same order, so the figures are the same.
    """
    result = {}
    plans = []
    for group in groups:
      if len(group.members) == 1:
        result[id(group)] = steps[group.members[0]]
      else:
        plans.append(self._plan(group, [(steps[i], works[i]) for i in group.members]))
    if not plans:
      return result
    sequential = [chain_cycles(p.cycles, self.overhead) for p in plans]
    vertices = [fold_rows(p.vertices, np.maximum) for p in plans]
    exchanges = [sum_costs(p.exchanges) for p in plans]
    for k, plan in enumerate(plans):
      members = [s for s, _ in plan.members]
      compute, vertex, codelets = self._compute_cycles(plan, sequential[k])
      notes = tuple(dict.fromkeys([n for s in members for n in s.notes]
                                  + ([vertex] if vertex else [])))
      result[id(plan.group)] = P.Superstep(
          name="fused(" + "+".join(dict.fromkeys(s.name for s in members)) + ")",
          op="fusion", reads=plan.reads, writes=plan.writes,
          fn=fused_fn(members, plan.reads, plan.writes),
          logical=fused_logical(members, plan.reads, plan.writes),
          compute_cycles=compute, exchange=exchanges[k], vertices=vertices[k],
          codelets=codelets or (_map_vertex(members),),
          flops=int(sum(s.flops for s in members)),
          scratch_bytes=self._scratch(plan),
          source=members[0].source,
          notes=notes,
          scope=common_scope(s.scope for s in members),
          elementwise=P.ElementwiseWork(plan.group.mapping),
          fused_ops=tuple(P.FusedOp(s.name, s.op, s.source, s.scope, step=without_figures(s))
                          for s in members))
    return result

  def _compute_cycles(self, plan, sequential) -> tuple:
    """``(cycles, note, codelets)`` of the fused step: the cheapest way to run
    the chain (``fused_cost.cheapest``), given its members' cost in turn, or
    poprand's vertex where the chain draws hardware random bits (then
    ``codelets`` names it; else None). Costs as one vertex are cached by
    layout and expression (a model's repeated layers share them)."""
    kept = {t.id for t in plan.writes}
    elements = self.layouts.elements_per_tile(plan.group.mapping)
    sampler = fused_cost.find_sampler(plan.members, plan.born, kept)
    if sampler is not None:
      return self._sampler_cycles(plan, sampler, elements, kept)
    cycles, note = self._cheapest(plan.group.layout, plan.members, plan.born, kept, elements,
                                  sequential)
    return cycles, note, None

  def _cheapest(self, layout, members, born, kept, elements, sequential) -> tuple:
    """``(cycles, note)``: ``members``' cheapest way as one compute set."""
    expression = fused_cost.describe(members, born, kept)
    key = (layout, expression)
    as_one = self._expressions.get(key)
    if as_one is None:
      as_one = self._expressions[key] = fused_cost.expression_cycles(self.target, elements,
                                                                     expression)
    return fused_cost.cheapest(sequential, *as_one, expression, elements)

  def _sampler_cycles(self, plan, sampler, elements, kept) -> tuple:
    """A chain on the hardware bits: poprand's vertex for the members it does,
    the rest (if any) costed as a chain of its own, run after it in the same
    compute set (one launch saved), reading what the vertex wrote."""
    vertex_cycles = fused_cost.sampler_cycles(self.target, elements, sampler)
    note = fused_cost.POPRAND_VERTEX_NOTE.format(vertex=sampler.vertex)
    rest = [k for k in range(len(plan.members)) if k not in sampler.positions]
    if not rest:
      return vertex_cycles, note, (sampler.vertex,)
    members = [plan.members[k] for k in rest]
    born = {}
    for position, (step, _) in enumerate(members):
      for t in step.writes:
        born.setdefault(t.id, position)
    made = {t.id for k in sampler.positions for t in plan.members[k][0].writes}
    read = {t.id for step, _ in members for t in step.reads}
    sequential = chain_cycles([plan.cycles[k] for k in rest], self.overhead)
    rest_cycles, _ = self._cheapest(plan.group.layout, members, born, kept | (made & read),
                                    elements, sequential)
    both = (vertex_cycles > 0) & (rest_cycles > 0)
    cycles = vertex_cycles + rest_cycles - both * self.overhead
    return cycles, note, (sampler.vertex, _map_vertex([s for s, _ in members]))

  def _plan(self, group, members) -> "_Plan":
    """What one fused step reads, writes, exchanges and keeps inside."""
    mapping = group.mapping
    plan = _Plan(group, members)
    written_at = plan.born
    external = {}
    reads_after = {}          # reads within the group after the group wrote the tensor
    operand_reads = plan.operand_reads
    last_read = plan.last_read
    at_home = []
    for position, (step, work) in enumerate(members):
      # A step's own costs hold unless it moved from another layout or is a
      # broadcast of a scalar (as a fused vertex it reads the one value
      # instead of receiving every element).
      home = step.elementwise is work and (work.mapping is mapping or
                                           self.layouts.number(work.mapping) == group.layout)
      if home:
        plan.cycles.append(step.compute_cycles)
        at_home.append(step.vertices)
      else:
        plan.cycles.append(self._cycles_on(mapping, work))
      for k, t in enumerate(step.reads):
        last_read[t.id] = position
        if t.id in written_at:
          reads_after[t.id] = reads_after.get(t.id, 0) + 1
          continue
        operand_reads[t.id] = operand_reads.get(t.id, 0) + 1
        if t.id in external:
          continue
        external[t.id] = t
        if home:
          costs = work.read_exchanges
          cost = costs[k] if k < len(costs) else None
        else:
          cost = self._exchange_onto(t, mapping, step.writes[0].shape)
        if cost is not None:
          plan.exchanges.append(cost)
      for t in step.writes:
        written_at.setdefault(t.id, position)
    plan.vertices = at_home or [members[0][0].vertices]
    # A result only the group reads, after making it, lives inside the
    # fused step.
    categories = {t.id: t.category for s, _ in members for t in s.writes}
    internal = plan.internal
    internal.update(i for i in written_at
                    if categories[i] == "temporaries" and self.writes.get(i, 0) == 1
                    and self.reads.get(i, 0) == reads_after.get(i, 0))
    kept = {}
    for step, _ in members:
      for t in step.writes:
        if t.id not in internal:
          kept[t.id] = t
    plan.reads = tuple(external.values())
    plan.writes = tuple(kept.values())
    return plan

  def _cycles_on(self, mapping, work) -> np.ndarray:
    """A moved member's cycles on ``mapping`` (by the elementwise estimator)."""
    key = (self.layouts.number(mapping), work.cost_op, work.itemsize, work.dtype, work.in_dtype)
    cycles = self._moved_cycles.get(key)
    if cycles is None:
      cycles = estimators.elementwise_cycles(
          self.target, self.layouts.elements_per_tile(mapping), work.cost_op, work.itemsize,
          dtype=work.dtype, in_dtype=work.in_dtype)
      self._moved_cycles[key] = cycles
    return cycles

  def _exchange_onto(self, tensor, mapping, shape):
    """The exchange bringing ``tensor`` to the vertices of ``mapping`` for a
    member whose result has ``shape``."""
    shape = tuple(int(d) for d in shape)
    key = (tensor.id, self.layouts.number(mapping), shape, tuple(tensor.shape))
    cost = self._exchanges.get(key, False)
    if cost is False:
      if tensor.mapping.num_elements == 1:
        # A scalar: every tile of the group receives the one value.
        cost = broadcast_cost(types.SimpleNamespace(target=self.target), tensor, mapping.tiles)
      elif tensor.mapping.num_elements != mapping.num_elements:
        # An operand read broadcast by a member moved here from its own
        # layout: each tile receives the elements its part of the result
        # reads, as the member's own step would (builders.elementwise).
        cost = broadcast_read_exchange(self.target, tensor, shape, mapping)
      else:
        cost = relayout_cost(self.target, tensor.mapping, mapping, tensor.itemsize)
      self._exchanges[key] = cost
    return cost

  def _scratch(self, plan) -> np.ndarray:
    """Per tile: the step's working memory beyond its operands and results.

    Within the chain every value lives from the member that makes it to the
    last member that reads it, as it would in separate steps. The memory
    analysis already holds the step's operands and kept results for the
    whole step, so the scratch is what the peak of that in-chain liveness
    exceeds them by: chiefly the intermediates that never leave the step.

    A value's bytes on each tile are its itemsize times its layout's
    elements per tile, so the liveness is kept as bytes per element for each
    (position, layout) and turned into bytes per tile once.
    """
    members = [s for s, _ in plan.members]
    internal, born, last_read = plan.internal, plan.born, plan.last_read
    own = [s.scratch_bytes for s in members if s.scratch_bytes is not None]
    if not internal:
      # Operands and results are already held for the whole step.
      return np.max(np.array(own, np.int64), axis=0) if own else None
    mapping, group_layout = plan.group.mapping, plan.group.layout
    n = len(members)
    columns = {}              # layout number -> column
    layouts = []              # per column, its mapping
    change = [[] for _ in range(n + 1)]   # per position: (column, bytes per element)
    held = []                 # per column: bytes per element held the whole step

    def live(tensor, first, last, whole_step):
      # Intermediates live where the fused vertices run.
      where = mapping if tensor.id in internal and tensor.mapping.num_elements \
          == mapping.num_elements else tensor.mapping
      number = group_layout if where is mapping else self.layouts.number(where)
      c = columns.get(number)
      if c is None:
        c = columns[number] = len(layouts)
        layouts.append(where)
        held.append(0)
      change[first].append((c, tensor.itemsize))
      change[last + 1].append((c, -tensor.itemsize))
      if whole_step:
        held[c] += tensor.itemsize
      return c

    for tensor in plan.reads:
      if tensor.category == "temporaries" and tensor.id not in born:
        # Read only here: it is free after the group's last read of it.
        inside = self.reads.get(tensor.id, 0) == plan.operand_reads[tensor.id]
        live(tensor, 0, last_read[tensor.id] if inside else n - 1, True)
    seen, column, taken = set(), {}, set()
    for step in members:
      for tensor in step.writes:
        if tensor.id in seen:
          continue
        seen.add(tensor.id)
        first = born[tensor.id]
        if tensor.id in internal:
          c = live(tensor, first, max(last_read.get(tensor.id, 0), first), False)
        else:
          c = live(tensor, first, n - 1, True)
        column[tensor.id] = c
        # In place, as the analysis writes a step's result over a dying
        # operand (analysis._in_place_results): over an intermediate this
        # member reads last, on the same layout and of the same itemsize.
        over = next((a for a in step.reads if a.id in internal and a.id not in taken
                     and a.id != tensor.id and last_read.get(a.id) == first
                     and column.get(a.id) == c and a.itemsize == tensor.itemsize), None)
        if over is not None:
          taken.add(over.id)
          change[first].append((c, -tensor.itemsize))
          change[first + 1].append((c, tensor.itemsize))
    # Bytes per element live at each position, per layout.
    now = [0] * len(layouts)
    per_position = []
    for position in range(n):
      for c, nbytes in change[position]:
        now[c] += nbytes
      per_position.append(list(now))
    elements = [self.layouts.elements_per_tile(m) for m in layouts]
    if len(layouts) == 1 and not own:
      # One layout: the peak over positions is the largest byte count per
      # element, on every tile alike.
      return np.maximum((max(row[0] for row in per_position) - held[0]) * elements[0], 0)
    # Float products are exact here (integers far below 2**53) and take
    # BLAS, which integer matrix products do not.
    elements = np.array(elements, np.float64)
    in_chain = (np.array(per_position, np.float64) @ elements).astype(np.int64)
    for position, step in enumerate(members):
      if step.scratch_bytes is not None:
        in_chain[position] += np.asarray(step.scratch_bytes, np.int64)
    baseline = (np.array(held, np.float64) @ elements).astype(np.int64)
    return np.maximum(in_chain.max(axis=0) - baseline, 0)


class _Plan:
  """One group's fused step in the making (see ``_Fuser._plan``)."""

  def __init__(self, group, members):
    self.group = group
    self.members = members    # (step, work) in program order
    self.cycles = []          # per member, its compute cycles on the group's layout
    self.vertices = []        # the vertices of members at home
    self.exchanges = []       # exchanges of operands from outside the group
    self.born = {}            # tensor id -> position of the member writing it first
    self.operand_reads = {}   # reads of tensors before the group writes them
    self.last_read = {}       # tensor id -> position of the last member reading it
    self.internal = set()     # ids of results that live only inside the step
    self.reads = ()
    self.writes = ()


class _Group:
  """Steps (indices into a run) that will be one compute set on ``mapping``."""

  def __init__(self, mapping, layout: int, recomputed: bool = False):
    self.mapping = mapping
    self.layout = layout      # its number in the fuser's LayoutNumbers
    # Recomputed forward work (a checkpointed region's ``rematted_computation``)
    # is a clone of the forward stage's program (TF-IPU's recomputation pass
    # clones the forward computation), so it fuses only with itself.
    self.recomputed = recomputed
    self.members = []

  def __eq__(self, other):
    return self is other

  __hash__ = object.__hash__


def _map_vertex(steps) -> str:
  """The vertex type of ``steps`` fused into one map codelet."""
  return vocab.vertex(vocab.MAP, *(s.codelets[0] if s.codelets else s.op for s in steps))


def _draws_hardware_bits(step) -> bool:
  """Whether ``step`` is ``random_bits`` from the tiles' generators."""
  return step.codelets == (HARDWARE_BITS_VERTEX,)


def _work(step):
  """What fusion may do with ``step``: its :class:`ElementwiseWork`, or None.

  Besides elementwise steps, a broadcast of a scalar (a ``fill`` of a
  constant or a ``broadcast_in_dim`` of a one-element tensor) is elementwise
  work: each result element is a copy of the one value.
  """
  if step.elementwise is not None:
    return step.elementwise
  if (step.name in ("fill", "broadcast_in_dim") and len(step.writes) == 1
      and len(step.reads) <= 1 and all(t.size == 1 for t in step.reads)
      and step.writes[0].size > 1 and step.compute_cycles is not None):
    out = step.writes[0]
    return P.ElementwiseWork(out.mapping, (step.exchange,) if step.reads else (),
                             "copy", out.itemsize)
  return None


def _flatten(sequence):
  for child in sequence.programs:
    if isinstance(child, P.Sequence):
      yield from _flatten(child)
    else:
      yield child


