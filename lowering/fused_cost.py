"""Compute cycles of a fused elementwise compute set.

A fused step (``lowering/fusion.py``) evaluates a chain of elementwise
operations over the elements of one layout. PopLibs would run it one of three
ways, and the step pays the cheapest on each tile:

* **A map expression.** popops' expression generator turns the chain into
  one codelet: every input that is not a single value is loaded once per
  vector, the members run in registers, each result that leaves the step is
  stored once per vector; vectors are 64 bits of the widest type when every
  value is half, float or bool and nothing is cast, else one element. Per
  worker and vector: the members' ALU cycles (popops' figures less their own
  loads and stores, :func:`estimators.map_member_element_cycles`), one cycle
  per 64-bit word loaded or stored and one for the loop; the fixed worker and
  supervisor cycles are paid once (the largest of the members' own).
  Scalar broadcasts in the chain are single values read once, no vector work.
* **A scaled-arithmetic vertex.** TensorFlow's IPU backend rewrites
  ``X + b * Y`` / ``X - b * Y`` / ``a * X + b * Y`` / ``a * X - b * Y`` /
  ``a * X +- Y`` (``a`` and ``b`` single values: literals or scalar tensors)
  into popops' ScaledAdd / ScaledSubtract / aXPlusbY / aXMinusbY supervisor
  vertices (``fuse_ops_into_poplar_ops.cc``, patterns ``scaled_inplace_xby``,
  ``scaled_inplace_axby``, ``scaled_inplace_axy``), costed by their poplibs
  estimators. A chain is recognised when it is exactly that pattern (its
  scalar broadcasts aside), in float16 or float32 (ScaledAdd / Subtract also
  int32), with the product an intermediate nothing else reads. The vertex
  updates ``X`` in place; a copy poplar would add where ``X`` is read later
  is not counted.
* **The members' own vertices one after another** in one compute set: the
  sum of their cycles less the compute-set launch and worker overheads that
  each member after the first no longer pays (the cost before map
  expressions were modelled).

The description of a chain (:class:`MapExpression`) holds no tile data, so
equal chains on the same layout (a transformer's layers) share one costing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import popops

__all__ = ["MapExpression", "describe", "expression_cycles", "cheapest", "SCALED_VERTEX_NOTE"]

# The note a fused step gets when a scaled-arithmetic vertex is its cost.
SCALED_VERTEX_NOTE = "costed as popops' {vertex}<{dtype}>"


@dataclasses.dataclass(frozen=True)
class MapExpression:
  """What a fused chain computes per element, for its cost.

  Attributes:
    ops: per member that computes (scalar broadcasts left out): its
      estimator key, result dtype, first operand's dtype and how many of its
      operands are vectors (not single values).
    loads: itemsizes of the distinct inputs that are not single values and
      come from outside the chain.
    stores: itemsizes of the results that leave the chain.
    vectorised: whether popops' generated codelet would vectorise it.
    itemsize: the widest value's itemsize (sets the vector width).
    scaled: ``(operation, dtype)`` when the chain is one scaled-arithmetic
      vertex (``popops.SCALED_OPERATIONS``), else ``None``.
  """

  ops: tuple
  loads: tuple
  stores: tuple
  vectorised: bool
  itemsize: int
  scaled: Optional[tuple] = None


def describe(members, born: dict, kept_ids) -> MapExpression:
  """The :class:`MapExpression` of a chain.

  Args:
    members: ``(step, work)`` in program order (``work``: the step's
      :class:`~ipu_jax.lowering.program.ElementwiseWork`).
    born: tensor id -> position of the member that first writes it.
    kept_ids: ids of the results written out of the fused step.
  """
  single = set()            # ids of in-chain values that are one value broadcast
  loads, ops, nodes = {}, [], []
  itemsize = 1
  vectorised = True
  for position, (step, work) in enumerate(members):
    op = work.cost_op or step.op
    if op == "copy" and all(t.size == 1 for t in step.reads):
      single.update(t.id for t in step.writes)
      continue
    inputs = []
    for t in step.reads:
      inside = born.get(t.id, position) < position
      if (inside and t.id in single) or (not inside and t.size == 1):
        inputs.append(None)
        continue
      inputs.append(t.id)
      if not inside:
        loads[t.id] = t.itemsize
      itemsize = max(itemsize, t.itemsize)
      vectorised &= popops.map_vectorisable(t.dtype)
    inputs.extend([None] * len(step.literals))
    for t in step.writes:
      itemsize = max(itemsize, t.itemsize)
      vectorised &= popops.map_vectorisable(t.dtype)
    vectorised &= op not in popops.MAP_SCALAR_ONLY_OPS
    dtype = np.dtype(work.dtype if work.dtype is not None else step.writes[0].dtype)
    in_dtype = None if work.in_dtype is None else np.dtype(work.in_dtype)
    vector_inputs = sum(i is not None for i in inputs)
    ops.append((op, dtype, in_dtype, vector_inputs))
    nodes.append((op, tuple(inputs), tuple(t.id for t in step.writes), dtype, in_dtype))
  stores = {t.id: t.itemsize for step, _ in members for t in step.writes if t.id in kept_ids}
  return MapExpression(tuple(ops), tuple(loads.values()), tuple(stores.values()),
                       bool(vectorised), itemsize, _scaled_pattern(nodes, kept_ids))


def _scaled_pattern(nodes, kept_ids) -> Optional[tuple]:
  """``(operation, dtype)`` when ``nodes`` are one scaled-arithmetic vertex."""
  if len(nodes) not in (2, 3):
    return None
  *products, (op, inputs, _, dtype, in_dtype) = nodes
  if op not in ("add", "sub") or len(inputs) != 2 or in_dtype != dtype:
    return None
  if any(not _is_scaling(p, dtype) or p[2][0] in kept_ids for p in products):
    return None
  made = [p[2][0] for p in products]
  if any(inputs.count(m) != 1 for m in made) or (len(nodes) == 3 and set(inputs) != set(made)):
    return None
  if len(nodes) == 3:
    operation = "axplusby" if op == "add" else "axminusby"
  elif None in inputs:
    return None                       # X must be a vector
  elif op == "add":
    operation = "add"                 # X + b * Y
  else:
    # X - b * Y, or a * X - Y (aXMinusbY with b = 1).
    operation = "subtract" if inputs[1] == made[0] else "axminusby"
  # poplibs' vertices: half and float; ScaledAdd / ScaledSubtract also int
  # and unsigned int.
  floating = dtype.kind == "f" and dtype.itemsize in (2, 4)
  integral = dtype.kind in "iu" and dtype.itemsize == 4 and operation in ("add", "subtract")
  return (operation, dtype) if floating or integral else None


def _is_scaling(node, dtype) -> bool:
  """Whether ``node`` is a vector times a single value, in ``dtype``."""
  op, inputs, outs, node_dtype, in_dtype = node
  return (op == "mul" and len(inputs) == 2 and sum(i is None for i in inputs) == 1
          and len(outs) == 1 and node_dtype == dtype and in_dtype == dtype)


def expression_cycles(target, elements, expression: MapExpression) -> tuple:
  """``(map, scaled)``: ``[num_tiles]`` cycles of ``expression`` as one map
  codelet, and as its scaled-arithmetic vertex (``None`` when it is not one).

  The members' own vertices one after another are the caller's third way
  (:func:`cheapest`).
  """
  natural = max(1, target.vector_width_bytes // max(1, expression.itemsize))
  width = natural if expression.vectorised else 1
  alu = sum(max(1.0, width * estimators.map_member_element_cycles(target, op, dtype, n))
            for op, dtype, _, n in expression.ops)
  words = lambda nbytes: -(-width * nbytes // target.vector_width_bytes)  # noqa: E731
  memory = sum(words(b) for b in expression.loads) + sum(words(b) for b in expression.stores)
  per_vector = (int(np.ceil(alu)) + -(-memory // popops.MAP_WORDS_PER_CYCLE)
                + popops.MAP_LOOP_CYCLES)
  # A chain of scalar broadcasts alone pays a copy's overheads.
  fixed = [estimators.elementwise_overheads(target, op, dtype, in_dtype)
           for op, dtype, in_dtype, _ in expression.ops] or [
               estimators.elementwise_overheads(target, "copy", np.uint8)]
  as_map = popops.map_expression_cycles(target, elements, per_vector, width,
                                        max(f[0] for f in fixed), max(f[1] for f in fixed))
  if expression.scaled is None:
    return as_map, None
  operation, dtype = expression.scaled
  return as_map, estimators.scaled_arithmetic_cycles(target, elements, dtype, operation)


def cheapest(sequential, as_map, scaled, expression: MapExpression, elements) -> tuple:
  """``(cycles, note)``: per tile the cheapest of the members in turn
  (``sequential``), the map codelet and the scaled-arithmetic vertex; the
  note names the vertex when it is the cost of the tile with the most
  elements (``None`` otherwise)."""
  cycles = np.minimum(sequential, as_map)
  if scaled is None:
    return cycles, None
  busiest = int(np.argmax(elements))
  note = None
  if scaled[busiest] < cycles[busiest]:
    operation, dtype = expression.scaled
    note = SCALED_VERTEX_NOTE.format(vertex=popops.SCALED_VERTICES[operation], dtype=dtype.name)
  return np.minimum(cycles, scaled), note
