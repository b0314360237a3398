"""C++ vertex classes in the Poplar-like graph API (``ipu_jax.graph``).

``Graph.add_codelets`` compiles a file and keeps its classes;
``Graph.add_vertex(cs, "Name", tile=, **fields)`` checks the connections
(:func:`connect`) and wraps the class as a
:class:`~ipu_jax.kernels.codelet.Codelet` (:func:`cpp_codelet`) whose body
is the class's FFI call, so C++ vertices go through the same compute-set
path as Python codelets: one superstep per compute set, the vertices of a
class with equal field shapes ``vmap``-ed into one FFI call, their cycles
in the profile and report.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import numpy as np

from ipu_jax.cpp_codelets import cost
from ipu_jax.cpp_codelets.build import VertexClass
from ipu_jax.cpp_codelets.run import vertex_function
from ipu_jax.kernels.codelet import Codelet

__all__ = ["CppCodelet", "cpp_codelet", "connect"]


@dataclasses.dataclass(frozen=True, eq=False)
class CppCodelet(Codelet):
  """A Codelet whose body is a compiled C++ vertex class.

  Attributes:
    vertex_class: the compiled class.
    work_estimate: its cycles are :func:`cost.work_cycles` (no figure given).
  """

  vertex_class: Optional[VertexClass] = None
  work_estimate: bool = False


def _body(vclass: VertexClass, spans: tuple, codelet_order: tuple):
  """``fn(*inputs, *inouts) -> outputs + inouts`` over the class's FFI call."""
  call = vertex_function(vclass, dict(spans))
  read = [f.name for f in vclass.fields if f.read]
  written = [f.name for f in vclass.fields if f.written]
  inputs, inouts, outputs = codelet_order

  def fn(*operands):
    by_name = dict(zip(inputs + inouts, operands))
    results = dict(zip(written, call(*[by_name[n] for n in read])))
    out = tuple(results[n] for n in outputs + inouts)
    return out[0] if len(out) == 1 else out

  return fn


def _cycles(vclass: VertexClass, cycles, fields: tuple):
  """The Codelet's estimator from the author's figure, or the work estimate."""
  def specs_of(specs):
    return {n: cost.FieldSpec(s.shape, s.dtype) for n, s in zip(fields, specs)}

  if cycles is None:
    if vclass.supervisor:
      return lambda target, *specs: cost.work_cycles(vclass, specs_of(specs), target.worker_contexts)
    return lambda *specs: cost.work_cycles(vclass, specs_of(specs))
  if isinstance(cycles, (int, np.integer)):
    constant = int(cycles)
    cycles = lambda _fields: constant  # noqa: E731
  if vclass.supervisor:
    return lambda target, *specs: cycles(specs_of(specs))
  return lambda *specs: cycles(specs_of(specs))


@functools.lru_cache(maxsize=None)
def _codelet_cached(vclass: VertexClass, spans: tuple, cycles) -> CppCodelet:
  fields = vclass.fields
  inputs = tuple(f.name for f in fields if f.kind == "in")
  inouts = tuple(f.name for f in fields if f.kind == "inout")
  outputs = tuple(f.name for f in fields if f.kind == "out")
  order = inputs + inouts + outputs
  return CppCodelet(
      name=vclass.name, fn=_body(vclass, spans, (inputs, inouts, outputs)), inputs=inputs,
      outputs=outputs, inouts=inouts, cycles=_cycles(vclass, cycles, order),
      supervisor=vclass.supervisor, vertex_class=vclass, work_estimate=cycles is None)


def cpp_codelet(vclass: VertexClass, spans: dict, cycles=None) -> CppCodelet:
  """The Codelet of ``vclass`` for fields with these span lengths (one per layout)."""
  return _codelet_cached(vclass, tuple((f.name, tuple(spans[f.name])) for f in vclass.fields),
                         cycles)


def _as_view(graph, vclass, field, value, tile: int):
  """The 1-D view (and span lengths) a field is connected to."""
  from ipu_jax.graph import GraphTensor, concatenate
  where = f"vertex {vclass.name}: field {field.name!r}"
  if field.attribute:
    if isinstance(value, GraphTensor):
      raise TypeError(f"{where} is vertex state (a plain member): give its value as a number or "
                      "array (as Poplar's setInitialValue), not a tensor")
    array = np.asarray(value)
    typed = hasattr(value, "dtype") and not isinstance(value, np.generic)
    if typed and not np.can_cast(array.dtype, field.dtype, "same_kind"):
      raise TypeError(f"{where} holds {field.dtype}; got {array.dtype.name}")
    size = array.size
    if field.shape == "scalar" and size != 1:
      raise ValueError(f"{where} is a scalar; got {size} values")
    const = graph.add_constant(field.dtype, (size,), array.reshape(-1),
                               f"{vclass.name}.{field.name}")
    graph.set_tile_mapping(const, tile)
    return const, (size,)
  if field.shape == "vector_list":
    views = list(value) if isinstance(value, (list, tuple)) else None
    if views is None and isinstance(value, GraphTensor) and value.rank == 2:
      views = [value[i] for i in range(value.shape[0])]
    if views is None or not all(isinstance(v, GraphTensor) for v in views):
      raise TypeError(f"{where} is a list of vectors: connect a list of tensors "
                      "(or a 2-D tensor, one vector per row)")
    flat = [v.flatten() for v in views]
    for v in flat:
      _check_dtype(where, field, v)
    joined = concatenate(flat) if flat else None
    if joined is None:
      raise ValueError(f"{where} needs at least one vector")
    return joined, tuple(v.num_elements() for v in flat)
  if not isinstance(value, GraphTensor):
    raise TypeError(f"{where} must be connected to a tensor, got {type(value).__name__}")
  _check_dtype(where, field, value)
  if field.shape == "scalar":
    if value.num_elements() != 1:
      raise ValueError(f"{where} is a scalar ({field.kind}); it needs a one-element tensor, "
                       f"got shape {value.shape}")
    return value.reshape(()), (1,)
  return value.flatten(), (value.num_elements(),)


def _check_dtype(where: str, field, view) -> None:
  if np.dtype(view.dtype) != np.dtype(field.dtype):
    raise TypeError(f"{where} holds {field.dtype}; the tensor is {np.dtype(view.dtype).name}")


def connect(graph, vclass: VertexClass, tile: int, connections: dict, cycles=None):
  """``(codelet, views by field)`` for a vertex of ``vclass`` on ``tile``.

  Raises before anything runs: a missing or unknown field (naming the
  vertex, the field and the fields it has), a dtype or shape mismatch.
  """
  names = [f.name for f in vclass.fields]
  missing = [n for n in names if n not in connections]
  unknown = [n for n in connections if n not in names]
  if missing or unknown:
    parts = ([f"field(s) {missing} not connected"] if missing else []) + (
        [f"no field(s) {unknown}"] if unknown else [])
    raise ValueError(f"vertex {vclass.name} on tile {tile}: {'; '.join(parts)}. "
                     f"Its fields: " + ", ".join(f"{f.name} ({f.kind} {f.shape} {f.dtype}"
                                                 f"{', vertex state' if f.attribute else ''})"
                                                 for f in vclass.fields))
  views, spans = {}, {}
  for f in vclass.fields:
    views[f.name], spans[f.name] = _as_view(graph, vclass, f, connections[f.name], tile)
  return cpp_codelet(vclass, spans, cycles), views
