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

A chain that starts from the tiles' hardware random bits (``random.mode =
"hardware"``: the bits step is a member, ``lowering/rules/random.py``) is what
poprand draws in one vertex: the generators' words turned into samples on
the way to memory. :func:`find_sampler` reads which one from the members
(:class:`Sampler`): JAX's uniform (shift, or, bitcast, affine, clamp) is
``Uniform<T>``; a compare of it with a single value, ``Bernoulli<T>``; that
mask selecting a (scaled) vector against a single value (``jnp.where(keep, x
/ p, 0)``, what ``nnx.Dropout`` traces to), ``Dropout<T>``; ``erf_inv`` of the
uniform (scaled, shifted), ``Normal<T>``; clipped after, ``TruncatedNormal<T>``
(priced at poprand's rounds for a cut at 2 deviations, the bounds being
traced values); bits used otherwise stay ``Uniform<int>`` words. Those members
cost poprand's estimator (``kernels/poprand.py``); the rest of the group is
costed as above, as a second vertex of the same compute set.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import popops
from ipu_jax.kernels import poprand
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.tile_generators import HARDWARE_BITS_VERTEX

__all__ = ["MapExpression", "describe", "expression_cycles", "cheapest", "SCALED_VERTEX_NOTE",
           "POPRAND_VERTEX_NOTE", "Sampler", "find_sampler", "sampler_cycles"]

# The note a fused step gets when a scaled-arithmetic vertex is its cost.
SCALED_VERTEX_NOTE = "costed as popops' {vertex}<{dtype}>"
# The note a fused step on the hardware random bits gets.
POPRAND_VERTEX_NOTE = "costed as {vertex}"


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


# -- poprand's samplers on the hardware bits -----------------------------------

# What JAX's uniform does to the bits: the mantissa (shift, or, bitcast), then
# ``- 1``, ``* (max - min) + min`` and a clamp at ``min``, each with single values.
_UNIFORM_OPS = frozenset({"shift_right_logical", "or", "bitcast_convert_type", "sub", "mul",
                          "add", "max", "min", "convert_element_type"})
_AFFINE_OPS = frozenset({"mul", "add", "sub", "div"})
_CLAMP_OPS = frozenset({"max", "min", "clamp"})
_COMPARES = frozenset({"lt", "le", "gt", "ge"})
# ``TruncatedNormal``'s cut, in deviations, where the bounds are traced values.
_TRUNCATION_DEVIATIONS = 2.0

_SAMPLER_VERTICES = {
    "Uniform": vocab.POPRAND_UNIFORM, "Bernoulli": vocab.POPRAND_BERNOULLI,
    "Normal": vocab.POPRAND_NORMAL, "TruncatedNormal": vocab.POPRAND_TRUNCATED_NORMAL,
    "Dropout": vocab.POPRAND_DROPOUT,
}


@dataclasses.dataclass(frozen=True)
class Sampler:
  """The poprand vertex a fused chain on the hardware bits is.

  Attributes:
    kind: ``"UniformInt"`` (raw words), ``"Uniform"``, ``"Bernoulli"``,
      ``"Normal"``, ``"TruncatedNormal"`` or ``"Dropout"``.
    dtype: the vertex's type (the uniform's float type for ``Bernoulli``,
      whose mask JAX holds as bool; the result's for ``Dropout``).
    positions: the members the vertex does (the rest of the group is costed
      as a map expression).
  """

  kind: str
  dtype: np.dtype
  positions: frozenset

  @property
  def vertex(self) -> str:
    if self.kind == "UniformInt":
      return HARDWARE_BITS_VERTEX
    return vocab.vertex(_SAMPLER_VERTICES[self.kind], self.dtype)


@dataclasses.dataclass(frozen=True)
class _Node:
  position: int
  op: str
  inputs: tuple     # per operand: its id, or None for a single value
  operands: tuple   # per read: its id
  outs: tuple
  dtype: Optional[np.dtype]


def _sampler_nodes(members, born):
  """Per member: a :class:`_Node`; single-value broadcasts have op ``"single"``."""
  single, nodes = set(), []
  for position, (step, work) in enumerate(members):
    outs = tuple(t.id for t in step.writes)
    operands = tuple(t.id for t in step.reads)
    if step.codelets == (HARDWARE_BITS_VERTEX,):
      nodes.append(_Node(position, "bits", (), operands, outs[:1], np.dtype(step.writes[0].dtype)))
      continue
    op = work.cost_op or step.op
    if op == "copy" and all(t.size == 1 for t in step.reads):
      single.update(outs)
      nodes.append(_Node(position, "single", (), operands, outs, None))
      continue
    inputs = []
    for t in step.reads:
      inside = born.get(t.id, position) < position
      inputs.append(None if (inside and t.id in single) or (not inside and t.size == 1)
                    else t.id)
    inputs.extend([None] * len(step.literals))
    nodes.append(_Node(position, op, tuple(inputs), operands, outs,
                       np.dtype(step.writes[0].dtype)))
  return nodes


def find_sampler(members, born: dict, kept_ids) -> Optional[Sampler]:
  """The poprand vertex a group's chain from the hardware bits is, or None.

  Args:
    members: ``(step, work)`` in program order.
    born: tensor id -> position of the member that first writes it.
    kept_ids: ids of the results written out of the fused step (a value
      another step reads ends the sampler there: the vertex writes it).

  Returns:
    None when no member draws hardware bits.
  """
  nodes = _sampler_nodes(members, born)
  bits = next((n for n in nodes if n.op == "bits"), None)
  if bits is None:
    return None
  readers = {}
  for n in nodes:
    for i in n.operands:
      readers.setdefault(i, []).append(n)

  def next_of(value, ops):
    """The one member that reads ``value`` as its one vector, when in ``ops``."""
    users = readers.get(value, [])
    if value in kept_ids or len(users) != 1 or users[0].op not in ops:
      return None
    user = users[0]
    vectors = [i for i in user.inputs if i is not None]
    return user if vectors == [value] and len(user.outs) == 1 else None

  covered, value = [bits.position], bits.outs[0]
  chain, node = [], next_of(value, _UNIFORM_OPS)
  while node is not None:
    chain.append(node)
    node = next_of(node.outs[0], _UNIFORM_OPS)
  if not any(n.op == "bitcast_convert_type" for n in chain) or chain[-1].dtype.kind != "f":
    return Sampler("UniformInt", bits.dtype, frozenset(covered))
  covered += [n.position for n in chain]
  value, dtype = chain[-1].outs[0], chain[-1].dtype
  node = next_of(value, {"erf_inv"} | _COMPARES)
  if node is None:
    return Sampler("Uniform", dtype, frozenset(covered))
  if node.op in _COMPARES:
    return _bernoulli(node, covered, dtype, readers, nodes, kept_ids)
  return _normal(node, covered, next_of)


def _normal(node, covered, next_of) -> Sampler:
  """``erf_inv`` of the uniform, scaled and shifted, maybe clipped after."""
  kind, dtype = "Normal", node.dtype
  while node is not None:
    covered.append(node.position)
    dtype = node.dtype
    node = next_of(node.outs[0], _AFFINE_OPS | _CLAMP_OPS)
    if node is not None and node.op in _CLAMP_OPS:
      kind = "TruncatedNormal"
  return Sampler(kind, dtype, frozenset(covered))


def _bernoulli(compare, covered, dtype, readers, nodes, kept_ids) -> Sampler:
  """The compare's mask; ``Dropout`` when it only selects a vector against a
  single value, the vector an operand from outside or its scaling."""
  covered.append(compare.position)
  mask = compare.outs[0]
  users = readers.get(mask, [])
  bernoulli = Sampler("Bernoulli", dtype, frozenset(covered))
  if mask in kept_ids or len(users) != 1 or users[0].op != "select_n":
    return bernoulli
  select = users[0]
  if len(select.inputs) != 3 or select.inputs[0] != mask or select.inputs[1:].count(None) != 1:
    return bernoulli
  kept_value = next(i for i in select.inputs[1:] if i is not None)
  # The single value: a member's broadcast, a scalar read, or a literal the
  # select folds in (a broadcast read as a view; no operand then).
  other = next((i for i in select.operands[1:] if i != kept_value), None)
  maker = {i: n for n in nodes for i in n.outs}
  extra = [select.position]
  fill = None if other is None else maker.get(other)
  if fill is not None:
    if fill.op != "single" or len(readers.get(other, [])) != 1 or other in kept_ids:
      return bernoulli
    extra.append(fill.position)
  scale = maker.get(kept_value)
  if scale is not None:
    # The kept values are ``x * s`` or ``x / s``, made only for this select.
    vectors = [i for i in scale.inputs if i is not None]
    if (scale.op not in ("mul", "div") or len(vectors) != 1
        or getattr(maker.get(vectors[0]), "position", None) in covered
        or kept_value in kept_ids or len(readers.get(kept_value, [])) != 1):
      return bernoulli
    extra.append(scale.position)
  return Sampler("Dropout", select.dtype, frozenset(covered + extra))


def sampler_cycles(target, elements, sampler: Sampler) -> np.ndarray:
  """``[num_tiles]`` cycles of ``sampler``'s poprand vertex (``kernels/poprand.py``)."""
  workers = target.worker_contexts
  bits = sampler.dtype.itemsize * 8
  if sampler.kind == "UniformInt":
    return poprand.uniform_int_bits_cycles(-(-np.asarray(elements) * bits // 32), workers)
  if sampler.kind == "TruncatedNormal":
    return poprand.truncated_normal_cycles(
        elements, workers, bits, poprand.truncated_normal_iterations(_TRUNCATION_DEVIATIONS))
  estimator = {"Uniform": poprand.uniform_cycles, "Bernoulli": poprand.bernoulli_cycles,
               "Normal": poprand.normal_cycles, "Dropout": poprand.dropout_cycles}[sampler.kind]
  return estimator(elements, workers, bits)
