"""Run compiled C++ vertices inside a jitted program: one XLA FFI call per vertex class.

A vertex class's call takes its read fields (inputs, in-outs, plain members)
and returns its written fields (outputs, in-outs), each as the flat
elements of one vertex; ``vertex_function`` gives that call as a JAX
function of one vertex, batched with ``vmap_method="broadcast_all"``, so
``jax.vmap`` over the vertices of a compute set (what the graph API does for
every codelet) is still ONE FFI call: the handler (``include/ipu_jax/glue.hpp``)
loops over the vertices in C++, binding each one's fields into the flat
buffers at offsets fixed by the static ``layout`` attribute (computed here,
once, in NumPy).

Elements of an ``Output`` a vertex does not write read as 0 (the call's
result buffers start zeroed); on the IPU they would keep the tensor's
previous value.
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.cpp_codelets.build import CodeletLibrary, VertexClass

__all__ = ["run_vertices", "vertex_function", "field_spans", "layout_attribute"]


def layout_attribute(vclass: VertexClass, spans: Mapping[str, tuple]) -> np.ndarray:
  """The handler's ``layout``: per field ``[elements, number of spans, lengths...]``."""
  out = []
  for f in vclass.fields:
    lengths = tuple(int(n) for n in spans[f.name])
    out += [sum(lengths), len(lengths), *lengths]
  return np.asarray(out, np.int64)


@functools.lru_cache(maxsize=None)
def _vertex_function(vclass: VertexClass, spans: tuple):
  spans_of = dict(spans)
  layout = layout_attribute(vclass, spans_of)
  results = [jax.ShapeDtypeStruct((sum(spans_of[f.name]),), np.dtype(f.dtype))
             for f in vclass.fields if f.written]
  call = jax.ffi.ffi_call(vclass.target, results, vmap_method="broadcast_all")
  read = [f for f in vclass.fields if f.read]

  def one_vertex(*values):
    if len(values) != len(read):
      raise TypeError(f"vertex {vclass.name} reads {[f.name for f in read]}; got {len(values)} values")
    flat = [jnp.reshape(v, (-1,)).astype(np.dtype(f.dtype)) for v, f in zip(values, read)]
    return tuple(call(*flat, layout=layout))

  return one_vertex


def vertex_function(vclass: VertexClass, spans: Mapping[str, tuple]):
  """One vertex of ``vclass`` as a JAX function.

  Args:
    vclass: the compiled vertex class.
    spans: field name -> its span lengths: ``(1,)`` for a scalar, ``(n,)``
      for a vector, one length per span for a list.

  Returns:
    ``f(*read fields) -> tuple of written fields``, each flat (1-D), in the
    class's field order; ``jax.vmap`` of it over vertices is one FFI call.
  """
  return _vertex_function(vclass, tuple((f.name, tuple(int(n) for n in spans[f.name]))
                                        for f in vclass.fields))


def field_spans(vclass: VertexClass, field, value) -> tuple:
  """``(flat 1-D value, span lengths)`` of one vertex's value for ``field``.

  Scalars take one element; vectors any array (flattened); lists a 2-D
  array (one span per row) or a sequence of arrays (one span each).
  """
  if field.shape == "vector_list":
    if isinstance(value, (list, tuple)):
      parts = [jnp.reshape(jnp.asarray(v), (-1,)) for v in value]
      flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), field.dtype)
      return flat, tuple(int(p.shape[0]) for p in parts)
    value = jnp.asarray(value)
    if value.ndim != 2:
      raise ValueError(f"vertex {vclass.name}: list field {field.name!r} takes a 2-D array "
                       f"(one span per row) or a list of arrays; got shape {value.shape}")
    return jnp.reshape(value, (-1,)), (int(value.shape[1]),) * int(value.shape[0])
  value = jnp.asarray(value, dtype=field.dtype) if np.isscalar(value) else value
  size = int(np.prod(np.shape(value), dtype=np.int64))
  if field.shape == "scalar" and size != 1:
    raise ValueError(f"vertex {vclass.name}: scalar field {field.name!r} takes one element; "
                     f"got shape {tuple(np.shape(value))}")
  return value, (size,)


def _check_fields(vclass: VertexClass, values: Mapping, where: str) -> None:
  names = [f.name for f in vclass.fields]
  missing = [n for n in names if n not in values]
  unknown = [n for n in values if n not in names]
  if missing or unknown:
    raise ValueError(f"vertex {vclass.name} ({where}): missing fields {missing}, unknown "
                     f"fields {unknown}; its fields are {names}")


def _check_dtype(vclass: VertexClass, field, value, where: str) -> None:
  dtype = getattr(value, "dtype", None)
  if dtype is not None and np.dtype(dtype) != np.dtype(field.dtype):
    raise TypeError(f"vertex {vclass.name} ({where}): field {field.name!r} holds "
                    f"{field.dtype}, got {np.dtype(dtype).name}")


def run_vertices(lib: CodeletLibrary, class_name: str,
                 field_values: Sequence[Mapping[str, object]]) -> dict:
  """Run one vertex per dict of ``field_values`` in one FFI call (jit-able).

  Args:
    lib: the compiled codelet file.
    class_name: the vertex class.
    field_values: per vertex, every field's value (outputs too: their arrays
      give the shape; their values are not read). Each field has the same
      shape in every vertex.

  Returns:
    ``{field: values stacked over vertices}`` for the written fields
    (outputs and in-outs), each ``[vertices, *shape]`` of the first vertex's
    value (a list field given as a list of arrays: ``[vertices, elements]``).
  """
  vclass = lib[class_name]
  if not field_values:
    raise ValueError(f"run_vertices({class_name!r}) needs at least one vertex")
  flats, spans = {}, {}
  for k, values in enumerate(field_values):
    _check_fields(vclass, values, f"vertex {k}")
    for f in vclass.fields:
      _check_dtype(vclass, f, values[f.name], f"vertex {k}")
      flat, lengths = field_spans(vclass, f, values[f.name])
      if spans.setdefault(f.name, lengths) != lengths:
        raise ValueError(f"vertex {vclass.name}: field {f.name!r} has spans {lengths} in vertex "
                         f"{k} but {spans[f.name]} in vertex 0; one call needs equal shapes")
      flats.setdefault(f.name, []).append(flat)
  fn = vertex_function(vclass, spans)
  reads = [jnp.stack(flats[f.name]) for f in vclass.fields if f.read]
  outs = jax.vmap(fn, axis_size=len(field_values))(*reads)
  written = [f for f in vclass.fields if f.written]
  first = field_values[0]
  result = {}
  for f, value in zip(written, outs):
    shape = np.shape(first[f.name]) if not isinstance(first[f.name], (list, tuple)) else (-1,)
    result[f.name] = jnp.reshape(value, (len(field_values),) + tuple(shape))
  return result
