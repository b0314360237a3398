"""Elementwise fusion: chains of elementwise steps on one layout become one step.

The rules lower every elementwise equation to its own superstep (sync,
exchange, one compute set). The real toolchain does not: popops map
expressions and XLA's fusion in TensorFlow-IPU turn a chain such as
``b2 * nu + (1 - b2) * g ** 2`` into one compute set whose vertex on each tile
evaluates the whole expression over its elements. This pass does the same on
the tile program, after lowering.

Why here and not on the jaxpr: only after lowering is it known which
equations became elementwise compute sets and on which layout (operands with
size-1 axes are broadcast first, mappings follow operands, scalars may be
baked into the vertex). The pass reads that from the steps themselves
(:attr:`Superstep.elementwise`, set by ``builders.elementwise``) and needs no
second copy of the lowering rules.

Tile plan of a fused step: the same tiles and elements per tile as each of its
members (they share one mapping), one vertex per worker on each tile as
before. Its exchange brings every operand that comes from outside the group
onto the layout before the compute phase (each such tensor once; operands
made inside the group are already on the right tiles, so nothing moves for
them). Its compute phase is the sum of the members' cycles less the fixed
cost each extra member would have paid for its own compute set: the
supervisor's launch and each worker's vertex overhead
(``estimators.worker_split_cycles``' fixed part). One sync replaces one per
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
compute set per parameter.)

A producer on another layout joins its consumer's group when nothing else
reads its results (``b1 * mu`` on the moment's layout feeding a chain on the
gradient's): its vertices then run on the chain's tiles, costed there by the
elementwise estimator, with its operands exchanged to them instead of its
result. Scalar expressions stay on their own tile, as on the IPU.

Memory: a member's result that nothing outside the group reads (and that is
not a program output, variable or constant) is never written to tile memory
between supersteps; it lives only inside the fused step. Those values still
count: the fused step's scratch is, per tile, the peak of such intermediates
live at once within the chain.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Iterable

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import add_costs, broadcast_cost
from ipu_jax.lowering.exchange import relayout_cost
from ipu_jax.target import IPUTarget

__all__ = ["fuse_elementwise", "vertex_overhead_cycles"]


def vertex_overhead_cycles(target: IPUTarget) -> int:
  """Fixed cycles of one elementwise compute set on a tile that has work.

  The supervisor's launch plus each worker's vertex overhead: what a fused
  chain pays once instead of once per member.
  """
  return target.worker_contexts * estimators.WORKER_OVERHEAD + target.supervisor_overhead_cycles


def fuse_elementwise(program, target: IPUTarget, keep: Iterable[P.Tensor] = ()):
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
  if isinstance(node, P.Sequence):
    for child in node.programs:
      _count_uses(child, reads, writes)
    return
  if isinstance(node, (P.RepeatWhileTrue, P.If)):
    reads[node.predicate.id] = reads.get(node.predicate.id, 0) + _NEVER_INTERNAL
  elif isinstance(node, P.Switch):
    reads[node.control.id] = reads.get(node.control.id, 0) + _NEVER_INTERNAL
  if isinstance(node, (P.Repeat, P.Replicated)):
    _count_uses(node.body, reads, writes)
  elif isinstance(node, P.RepeatWhileTrue):
    _count_uses(node.condition, reads, writes)
    _count_uses(node.body, reads, writes)
  elif isinstance(node, P.If):
    _count_uses(node.then, reads, writes)
    _count_uses(node.else_, reads, writes)
  elif isinstance(node, P.Switch):
    for _, case in node.cases:
      _count_uses(case, reads, writes)
    _count_uses(node.default, reads, writes)
  else:
    raise TypeError(f"not a tile program: {node!r}")


class _Layouts:
  """Numbers tile layouts so that equal layouts share one number.

  Two mappings get the same number exactly when ``same_as`` holds (an
  equivalence: both put every element in the same storage slot on the same
  tile). Each mapping object is compared once, when first seen; grouping
  then compares integers instead of tile arrays for every open group and
  step. Per-tile element counts are kept per layout for the same reason.
  """

  def __init__(self, num_tiles: int):
    self.num_tiles = num_tiles
    self._by_object = {}      # id(mapping) -> (number, mapping); holds the mapping alive
    self._by_key = {}         # closed-form fingerprint -> number
    self._by_bucket = {}      # (size, storage shape, tiles) -> [(number, mapping)]
    self._elements = {}       # number -> elements per tile

  def number(self, mapping) -> int:
    """The number of ``mapping``'s layout."""
    seen = self._by_object.get(id(mapping))
    if seen is not None:
      return seen[0]
    key = mapping.fingerprint
    number = self._by_key.get(key) if key[0] != "object" else None
    if number is None:
      # Layouts equal only with the same size, storage shape and row tiles.
      bucket = (mapping.num_elements, mapping.storage_shape, mapping.tiles.tobytes())
      candidates = self._by_bucket.setdefault(bucket, [])
      number = next((n for n, m in candidates if m.same_as(mapping)), None)
      if number is None:
        number = len(self._by_object)
        candidates.append((number, mapping))
      if key[0] != "object":
        self._by_key[key] = number
    self._by_object[id(mapping)] = (number, mapping)
    return number

  def elements_per_tile(self, mapping) -> np.ndarray:
    """``[num_tiles]`` elements ``mapping`` puts on each tile (shared, read-only)."""
    number = self.number(mapping)
    elements = self._elements.get(number)
    if elements is None:
      elements = mapping.elements_per_tile(self.num_tiles)
      elements.setflags(write=False)
      self._elements[number] = elements
    return elements


class _Fuser:
  """Rebuilds a program tree with its straight-line runs fused."""

  def __init__(self, target, reads, writes):
    self.target = target
    self.reads = reads
    self.writes = writes
    self.overhead = vertex_overhead_cycles(target)
    self.layouts = _Layouts(target.num_tiles)
    self._exchanges = {}

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
    if len(steps) < 2:
      return list(steps)
    works = [_work(step) for step in steps]
    if sum(w is not None for w in works) < 2:
      return list(steps)  # nothing to fuse with: the run as it was
    preds = _dependencies(steps)
    out = []
    open_groups = []          # groups not yet emitted, in creation order
    group_of = {}             # step index -> its open group

    def close(group):
      open_groups.remove(group)
      out.append(self._fused(group, [(steps[i], works[i]) for i in sorted(group.members)]))
      for i in group.members:
        del group_of[i]

    for i, step in enumerate(steps):
      pending = []
      for p in preds[i]:
        g = group_of.get(p)
        if g is not None and g not in pending:
          pending.append(g)
      work = works[i]
      home = None
      if work is not None:
        # Prefer a group this step reads from (a chain), else the newest.
        layout = self.layouts.number(work.mapping)
        for g in reversed(open_groups):
          if g.layout == layout:
            if g in pending:
              home = g
              break
            if home is None:
              home = g
        if home is None:
          home = _Group(work.mapping, layout)
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
    return out

  def _absorbable(self, producer, consumer, steps, works) -> bool:
    """Whether ``producer``'s steps can run inside ``consumer``'s compute set.

    Every result of ``producer`` must be an intermediate that only the two
    groups read (so no other layout of it is ever needed), of the
    consumer's size, and every step's cost must be known on any layout.
    """
    if any(not works[j].cost_op for j in producer.members):
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

  def _fused(self, group, members) -> P.Superstep:
    """One step doing ``members`` (``(step, work)`` in order) in one compute set."""
    if len(members) == 1:
      return members[0][0]
    mapping = group.mapping
    home = [step.elementwise is work and self.layouts.number(work.mapping) == group.layout
            for step, work in members]
    written_at = {}           # tensor id -> position of the member writing it first
    external, exchanges = {}, []
    reads_after = {}          # reads within the group after the group wrote the tensor
    reads_before = {}         # reads within the group before that (or of an operand)
    last_read = {}            # position of the last member reading each tensor
    for position, (step, work) in enumerate(members):
      for k, t in enumerate(step.reads):
        last_read[t.id] = position
        if t.id in written_at:
          reads_after[t.id] = reads_after.get(t.id, 0) + 1
          continue
        reads_before[t.id] = reads_before.get(t.id, 0) + 1
        if t.id in external:
          continue
        external[t.id] = t
        if home[position]:
          costs = work.read_exchanges
          exchanges.append(costs[k] if k < len(costs) else None)
        else:
          exchanges.append(self._exchange_onto(t, mapping))
      for t in step.writes:
        written_at.setdefault(t.id, position)
    # A result only the group reads, after making it, lives inside the
    # fused step.
    categories = {t.id: t.category for s, _ in members for t in s.writes}
    internal = {i for i in written_at
                if categories[i] == "temporaries" and self.writes.get(i, 0) == 1
                and self.reads.get(i, 0) == reads_after.get(i, 0)}
    kept = {}
    for step, _ in members:
      for t in step.writes:
        if t.id not in internal:
          kept[t.id] = t
    reads = tuple(external.values())
    writes = tuple(kept.values())
    steps = [step for step, _ in members]
    ops = tuple(P.FusedOp(s.name, s.op, s.source, s.scope) for s in steps)
    at_home = [s for s, h in zip(steps, home) if h] or [steps[0]]
    return P.Superstep(
        name="fused(" + "+".join(dict.fromkeys(s.name for s in steps)) + ")",
        op="fusion", reads=reads, writes=writes, fn=_fused_fn(steps, reads, writes),
        compute_cycles=self._compute(mapping, members, home),
        exchange=add_costs(*exchanges),
        vertices=np.max([np.asarray(s.vertices) for s in at_home], axis=0),
        codelets=(vocab.vertex(vocab.MAP, *(s.codelets[0] if s.codelets else s.op
                                            for s in steps)),),
        flops=int(sum(s.flops for s in steps)),
        scratch_bytes=self._scratch(mapping, steps, internal, reads, written_at,
                                    reads_before, last_read),
        source=steps[0].source, notes=tuple(dict.fromkeys(n for s in steps for n in s.notes)),
        scope=_common_scope(s.scope for s in steps),
        elementwise=P.ElementwiseWork(mapping), fused_ops=ops)

  def _exchange_onto(self, tensor, mapping):
    """The exchange bringing ``tensor`` to the vertices of ``mapping``."""
    key = (tensor.id, self.layouts.number(mapping))
    cost = self._exchanges.get(key, False)
    if cost is False:
      if tensor.mapping.num_elements == 1:
        cost = broadcast_cost(types.SimpleNamespace(target=self.target), tensor, mapping.tiles)
      else:
        cost = relayout_cost(self.target, tensor.mapping, mapping, tensor.itemsize)
      self._exchanges[key] = cost
    return cost

  def _compute(self, mapping, members, home) -> np.ndarray:
    """Each member's cycles on ``mapping``, less the overheads fusion saves."""
    rows = []
    for (step, work), at_home in zip(members, home):
      if at_home:
        rows.append(step.compute_cycles)
      else:
        rows.append(estimators.elementwise_cycles(
            self.target, self.layouts.elements_per_tile(mapping), work.cost_op, work.itemsize))
    cycles = np.array(rows, np.float64)
    busy = np.count_nonzero(cycles > 0, axis=0)
    # Each member after the first on a tile no longer pays a compute set's
    # launch and vertex overheads.
    saved = np.maximum(busy - 1, 0) * self.overhead
    return np.maximum(cycles.sum(axis=0) - saved, cycles.max(axis=0))

  def _scratch(self, mapping, members, internal, reads, born, operand_reads,
               last_read) -> np.ndarray:
    """Per tile: the step's working memory beyond its operands and results.

    Within the chain every value lives from the member that makes it to the
    last member that reads it, as it would in separate steps. The memory
    analysis already holds the step's operands and kept results for the
    whole step, so the scratch is what the peak of that in-chain liveness
    exceeds them by: chiefly the intermediates that never leave the step.

    Every value's bytes on each tile are its itemsize times its layout's
    elements per tile, so the liveness of all of them is one small matrix
    (positions x layouts) of bytes per element, times the layouts' elements
    per tile.
    """
    own = [s.scratch_bytes for s in members if s.scratch_bytes is not None]
    if not internal:
      # Operands and results are already held for the whole step.
      return np.max(np.array(own, np.int64), axis=0) if own else None
    n = len(members)
    columns = {}              # layout number -> column
    layouts = []              # per column, its mapping
    lo, hi, col, size, counted = [], [], [], [], []

    def live(tensor, first, last, held):
      # Intermediates live where the fused vertices run.
      where = mapping if tensor.id in internal and tensor.mapping.num_elements \
          == mapping.num_elements else tensor.mapping
      number = self.layouts.number(where)
      c = columns.get(number)
      if c is None:
        c = columns[number] = len(layouts)
        layouts.append(where)
      lo.append(first)
      hi.append(last + 1)
      col.append(c)
      size.append(tensor.itemsize)
      counted.append(held)

    for tensor in reads:
      if tensor.category == "temporaries" and tensor.id not in born:
        # Read only here: it is free after the group's last read of it.
        inside = self.reads.get(tensor.id, 0) == operand_reads[tensor.id]
        live(tensor, 0, last_read[tensor.id] if inside else n - 1, True)
    seen = set()
    for step in members:
      for tensor in step.writes:
        if tensor.id in seen:
          continue
        seen.add(tensor.id)
        first = born[tensor.id]
        if tensor.id in internal:
          live(tensor, first, max(last_read.get(tensor.id, 0), first), False)
        else:
          live(tensor, first, n - 1, True)
    elements = np.stack([self.layouts.elements_per_tile(m) for m in layouts])
    col, size = np.asarray(col), np.asarray(size, np.int64)
    weights = np.zeros((n + 1, len(layouts)), np.int64)
    np.add.at(weights, (np.asarray(lo), col), size)
    np.add.at(weights, (np.asarray(hi), col), -size)
    in_chain = np.cumsum(weights[:-1], axis=0) @ elements
    for position, step in enumerate(members):
      if step.scratch_bytes is not None:
        in_chain[position] += np.asarray(step.scratch_bytes, np.int64)
    baseline = np.bincount(col, weights=size * np.asarray(counted), minlength=len(layouts))
    baseline = baseline.astype(np.int64) @ elements
    return np.maximum(in_chain.max(axis=0) - baseline, 0)


def _fused_fn(steps, reads, writes):
  """The fused step's function: its members' functions in order, on storages.

  Each member's results are cast to their tensors' dtypes, as the executor
  stores every step's results, so the numbers are those of the separate
  steps bit for bit.
  """
  read_ids = tuple(t.id for t in reads)
  plan = tuple((s.fn, tuple(t.id for t in s.reads), tuple((t.id, t.dtype) for t in s.writes))
               for s in steps)
  write_ids = tuple(t.id for t in writes)

  def fn(*storages):
    env = dict(zip(read_ids, storages))
    for step_fn, ins, outs in plan:
      values = step_fn(*[env[i] for i in ins])
      for (i, dtype), v in zip(outs, values):
        env[i] = v.astype(dtype)
    return tuple(env[i] for i in write_ids)

  return fn


class _Group:
  """Steps (indices into a run) that will be one compute set on ``mapping``."""

  def __init__(self, mapping, layout: int):
    self.mapping = mapping
    self.layout = layout      # its number in the fuser's _Layouts
    self.members = []

  def __eq__(self, other):
    return self is other

  __hash__ = object.__hash__


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


def _dependencies(steps) -> list:
  """Per step, the indices of earlier steps it must follow (RAW, WAR, WAW)."""
  preds = [set() for _ in steps]
  last_writer, readers = {}, {}
  for i, step in enumerate(steps):
    for t in step.reads:
      w = last_writer.get(t.id)
      if w is not None:
        preds[i].add(w)
      readers.setdefault(t.id, []).append(i)
    for t in step.writes:
      w = last_writer.get(t.id)
      if w is not None:
        preds[i].add(w)
      preds[i].update(r for r in readers.get(t.id, ()) if r != i)
      last_writer[t.id] = i
      readers[t.id] = []
  return [sorted(p) for p in preds]


def _common_scope(scopes) -> str:
  parts = None
  for scope in scopes:
    pieces = scope.split("/") if scope else []
    if parts is None:
      parts = pieces
      continue
    n = 0
    while n < min(len(parts), len(pieces)) and parts[n] == pieces[n]:
      n += 1
    parts = parts[:n]
  return "/".join(parts or [])
