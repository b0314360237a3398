"""Sums as popops runs them: the cast and square in the vertex, siblings in one compute set.

The reduction rule (``lowering/rules/reduction.py``) lowers each ``reduce_sum``
alone, on the tensor it is given. A float32 sum of float16 values
(``jnp.sum(x, dtype=jnp.float32)``, what a batch norm's statistics and their
gradients are) reaches it as ``convert_element_type`` then ``reduce_sum``; a
sum of squares as ``convert``, ``square``, ``reduce_sum``; and the two
statistics of one layer as two reductions. PopLibs does neither thing that
way (popnn's batch norm, ``poplin::normStatistics`` and
``normParamGradients``, ``lib/poplin/Norms.cpp``):

* **The cast and the square are the vertex's.** ``popops::reduce`` takes a
  float16 input and a float32 output: the first stage's ``Reduce`` vertices
  load the float16 values, 8 to an accumulator operation, and store float32
  partials; the sum of squares is the ``SQUARE_ADD`` operation of the same
  vertices (``f16v8sqacc``). No float32 copy of the input is made or stored.
* **Sibling reductions share compute sets.** ``popops::reduceMany`` puts the
  reductions it is given (mean and power; the two parameter gradients) into
  one list of compute sets (``lib/popops/reduction/Reduction.cpp``,
  ``reduceMany``): the stages run together, one launch and one exchange each.

This pass does both on the tile program, on the straight-line runs the
elementwise fusion pass (``lowering/fusion.py``) walks, before it groups them:

1. a ``reduce_sum``'s first stage whose input is made, on its own layout, by
   a widening float cast and/or a square that nothing else reads takes the
   cast's input instead; its cycles are the ``Reduce`` vertex's on that input
   type into the partials' type, ``square_add`` when it squares
   (:func:`ipu_jax.kernels.reduce.reduce_cycles`); the cast and square steps
   go (their functions run inside the reduction's, so the numbers are the
   same);
2. two ``reduce_sum`` stages of the same kind (first or second) of one scope
   reading equal shapes and types from one layout become one compute set
   where the later does not depend on the earlier: the earlier sinks to the
   later with whatever between depends on it (the batch norm gradient's
   ``sum(dy)`` waits for ``dy * x``, as in ``normParamGradients``); the cycles
   are the sum less one compute set's launch (``supervisor_overhead_cycles``),
   the exchanges are one.

Execution: each new step's function runs its members' functions in order
(``fused_step.fused_fn`` / ``fused_logical``), so results equal the separate
steps' bit for bit.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.fused_step import fused_fn, fused_logical, sum_costs
from ipu_jax.lowering.mapping import tiles_key

__all__ = ["fold_sums"]

_SUM = "reduce_sum"
_STAGES = (f"{_SUM}/partials", f"{_SUM}/final")
_ADD = vocab.vertex(vocab.REDUCE, "add")


def fold_sums(steps: list, target, reads: dict) -> list:
  """A straight-line run of supersteps with its sums as popops runs them.

  Args:
    steps: the run, in program order (not modified).
    target: the IPU target.
    reads: reads of each tensor id in the whole program (outputs counted as
      read elsewhere): a cast or square is folded only when its reduction is
      its result's one reader.

  Returns:
    The new run (the same list when nothing changes).
  """
  if sum(s.name == _STAGES[0] for s in steps) == 0:
    return steps
  steps = _fold_maps(list(steps), target, reads)
  for stage in _STAGES:
    steps = _merge_siblings(steps, stage, target)
  return steps


# -- 1. the cast and square into the first stage --------------------------------------


def _fold_maps(steps: list, target, reads: dict) -> list:
  """Each first stage of a sum with its widening cast / square folded in."""
  writer = {}
  drop = set()
  out = list(steps)
  for i, step in enumerate(steps):
    if step.name == _STAGES[0] and step.codelets == (_ADD,) and len(step.reads) == 1:
      chain = _map_chain(steps, writer, i, reads)
      if chain:
        out[i] = _folded(step, [steps[j] for j in chain], target)
        drop.update(chain)
    for t in step.writes:
      writer[t.id] = i
  return [s for j, s in enumerate(out) if j not in drop] if drop else steps


def _map_chain(steps, writer, at: int, reads: dict) -> list:
  """Indices of the cast and/or square making step ``at``'s input, in order; [] if none.

  Each must be an elementwise step of one operand, with no folded literal,
  whose result is a temporary only the next step reads; all but the first
  on their operand's layout (the first's exchange, which brings the cast's
  float16 input onto the reduction's layout, stays: the folded stage's
  exchange phase); the first one's operand must not be written before ``at``.
  """
  chain = []
  tensor = steps[at].reads[0]
  kinds = ("square", "convert_element_type")
  while kinds:
    j = writer.get(tensor.id)
    step = None if j is None else steps[j]
    if step is None or not _foldable(step, tensor, reads) or step.elementwise.cost_op not in kinds:
      break
    chain.insert(0, j)
    kinds = kinds[kinds.index(step.elementwise.cost_op) + 1:]
    tensor = step.reads[0]
  first = steps[chain[0]] if chain else None
  if first is None or (first.elementwise.cost_op == "convert_element_type"
                       and not _is_widening(first)):
    return []
  if any(e is not None for j in chain[1:] for e in steps[j].elementwise.read_exchanges):
    return []
  source = first.reads[0]
  between = range(chain[0] + 1, at)
  if any(source.id == t.id for k in between for t in steps[k].writes):
    return []
  return chain


def _foldable(step, result, reads: dict) -> bool:
  """Whether ``step`` (making ``result``) is one float operation only the sum reads."""
  work = step.elementwise
  return (work is not None and len(step.reads) == 1 and len(step.writes) == 1
          and not step.literals and result.category == "temporaries"
          and reads.get(result.id, 0) == 1
          and np.issubdtype(step.reads[0].dtype, np.floating)
          and np.issubdtype(result.dtype, np.floating))


def _is_widening(step) -> bool:
  """A float16 -> float32 cast (the first stage's input type to its partials')."""
  return (step.elementwise.cost_op == "convert_element_type"
          and np.dtype(step.reads[0].dtype) == np.float16
          and np.dtype(step.writes[0].dtype) == np.float32)


def _folded(stage, chain: list, target) -> P.Superstep:
  """The first stage reading the chain's operand, costed as popops' vertex on it."""
  source = chain[0].reads[0]
  squares = any(s.elementwise.cost_op == "square" for s in chain)
  op = "square_add" if squares else "add"
  partials = stage.writes[0]
  num_tiles = target.num_tiles
  # The vertices run on the reduction's layout (the chain's), on the source's type.
  cycles = estimators.reduce_cycles(
      target, stage.reads[0].mapping.elements_per_tile(num_tiles), source.itemsize,
      partials.mapping.elements_per_tile(num_tiles), dtype=source.dtype, op=op,
      out_dtype=partials.dtype)
  members = chain + [stage]
  note = (f"{' and '.join(s.name for s in chain)} of {source.dtype.name} folded into the "
          f"{op} vertex (popops::reduce, {source.dtype.name} in, {partials.dtype.name} out)")
  return dataclasses.replace(
      stage, reads=(source,), fn=fused_fn(members, (source,), stage.writes),
      logical=fused_logical(members, (source,), stage.writes), compute_cycles=cycles,
      exchange=sum_costs([s.exchange for s in members if s.exchange is not None]),
      codelets=(vocab.vertex(vocab.REDUCE, op),),
      flops=int(stage.flops + (source.size if squares else 0)), notes=stage.notes + (note,),
      elementwise=None, flops_dtype=None)


# -- 2. siblings in one compute set --------------------------------------------------


def _merge_siblings(steps: list, stage: str, target) -> list:
  """Pairs of ``stage`` steps of one layout merged where the schedule allows.

  Each ``stage`` step, in the run's current order, is merged into its next
  sibling (:func:`_same_layouts`) unless that sibling depends on it or on
  what it must sink past. Siblings are found by their class key
  (:func:`_class_key`) in :class:`_Order`, not by comparing each step with
  every later one: the merged steps of a 7-layer stage's sharded update
  compared 1.3 M pairs that way. The cost is the run once, plus the steps
  between each step and its sibling (the ones a merge may move).
  """
  order = _Order(steps, stage)
  pos = 0
  while pos < len(order.steps):
    j = order.sibling(pos)
    if j is not None:
      window = _sink(order.steps, pos, j)
      if window is not None:
        order.replace(pos, j, window[0] + [_merged(order.steps[pos], order.steps[j], target)]
                      + window[1])
    pos += 1
  return order.steps


def _same_layouts(a, b) -> bool:
  """Stages of two reductions of one shape from one layout (outputs may lie anywhere)."""
  return (a.name == b.name and a.scope == b.scope
          and len(a.reads) == len(b.reads) == 1 and len(a.writes) == len(b.writes) == 1
          and a.reads[0].shape == b.reads[0].shape and a.writes[0].shape == b.writes[0].shape
          and a.reads[0].dtype == b.reads[0].dtype and a.writes[0].dtype == b.writes[0].dtype
          and a.reads[0].mapping.same_as(b.reads[0].mapping))


def _class_key(step, stage: str):
  """A hashable key equal for any two steps :func:`_same_layouts` accepts; None: no sibling.

  ``TileMapping.same_as`` holds only for mappings of equal element counts and
  equal row tiles, so those (the tiles by :func:`mapping.tiles_key`) stand
  for the layout here; :func:`_same_layouts` still decides within a class.
  """
  if step.name != stage or len(step.reads) != 1 or len(step.writes) != 1:
    return None
  read, write = step.reads[0], step.writes[0]
  layout = None if read.mapping is None else (
      read.mapping.num_elements, tiles_key(read.mapping.tiles))
  return (step.scope, read.shape, write.shape, read.dtype, write.dtype, layout)


class _Order:
  """A run's steps in their current order, and where each class's members are.

  Each position holds a rank that grows along the run; a merge rewrites only
  the steps from a member to its sibling, which take that stretch's ranks in
  their new order (one fewer step), so the ranks stay sorted and a class,
  kept as its members' sorted ranks, finds a member's next sibling by
  bisection. The same step object may stand at two positions.
  """

  def __init__(self, steps: list, stage: str):
    self.steps = list(steps)
    self._stage = stage
    self._ranks = list(range(len(steps)))                  # increasing along ``steps``
    self._keys = [_class_key(s, stage) for s in steps]      # per position
    self._members = {}                                      # key -> sorted ranks
    for rank, key in enumerate(self._keys):
      if key is not None:
        self._members.setdefault(key, []).append(rank)

  def sibling(self, pos: int):
    """Position of the next step :func:`_same_layouts` pairs with step ``pos``; None if none."""
    key = self._keys[pos]
    if key is None:
      return None
    members = self._members[key]
    first = self.steps[pos]
    for rank in members[bisect.bisect_right(members, self._ranks[pos]):]:
      j = bisect.bisect_left(self._ranks, rank)
      if _same_layouts(first, self.steps[j]):
        return j
    return None

  def replace(self, pos: int, j: int, window: list):
    """Steps ``pos`` .. ``j`` become ``window`` (one step fewer)."""
    low, high = self._ranks[pos], self._ranks[j]
    for key in set(self._keys[pos:j + 1]) - {None}:
      members = self._members[key]
      del members[bisect.bisect_left(members, low):bisect.bisect_right(members, high)]
    known = {id(s): k for s, k in zip(self.steps[pos + 1:j], self._keys[pos + 1:j])}
    keys = [known[id(s)] if id(s) in known else _class_key(s, self._stage) for s in window]
    ranks = self._ranks[pos + 1:j + 1]
    self.steps[pos:j + 1] = window
    self._ranks[pos:j + 1] = ranks
    self._keys[pos:j + 1] = keys
    for rank, key in zip(ranks, keys):
      if key is not None:
        bisect.insort(self._members.setdefault(key, []), rank)


def _sink(steps: list, i: int, j: int):
  """``(stay, after)``: steps between ``i`` and its sibling ``j`` before and after the merge.

  Step ``i`` sinks to the sibling with the steps between that depend on it
  (they follow the merged step, in order); the others between keep their
  order before it. None when the sibling depends on what sinks.
  """
  first = steps[i]
  sinking = []
  read = {t.id for t in first.reads}
  written = {t.id for t in first.writes}
  stay = []
  for k in range(i + 1, j + 1):
    step = steps[k]
    ins = {t.id for t in step.reads}
    outs = {t.id for t in step.writes}
    depends = bool(ins & written or outs & (written | read))
    if k == j:
      return None if depends else (stay, sinking)
    if depends:
      sinking.append(step)
      read |= ins
      written |= outs
    else:
      stay.append(step)
  raise AssertionError("unreachable: the loop ends at the sibling")


def _merged(a: P.Superstep, b: P.Superstep, target) -> P.Superstep:
  """``a`` and ``b`` as one compute set (popops::reduceMany)."""
  reads = tuple({t.id: t for t in a.reads + b.reads}.values())
  writes = a.writes + b.writes
  both = (_cycles(a) > 0) & (_cycles(b) > 0)
  cycles = _cycles(a) + _cycles(b) - np.where(both, target.supervisor_overhead_cycles, 0)
  if a.reads == b.reads:  # one input (a statistic and its square): brought once
    exchange = a.exchange
  else:
    exchange = sum_costs([c for c in (a.exchange, b.exchange) if c is not None])
  vertices = _added(a.vertices, b.vertices)
  scratch = _added(a.scratch_bytes, b.scratch_bytes)
  return dataclasses.replace(
      a, reads=reads, writes=writes, fn=fused_fn([a, b], reads, writes),
      logical=fused_logical([a, b], reads, writes), compute_cycles=cycles.astype(np.float64),
      exchange=exchange, vertices=vertices, scratch_bytes=scratch,
      codelets=tuple(dict.fromkeys(a.codelets + b.codelets)), flops=int(a.flops + b.flops),
      notes=tuple(dict.fromkeys(a.notes + b.notes + (
          "two sums in one compute set (popops::reduceMany)",))))


def _cycles(step) -> np.ndarray:
  return np.asarray(0.0 if step.compute_cycles is None else step.compute_cycles, np.float64)


def _added(a, b):
  """Per-tile figures of two steps added (None when neither has them)."""
  if a is None or b is None:
    return b if a is None else a
  return np.asarray(a) + np.asarray(b)
