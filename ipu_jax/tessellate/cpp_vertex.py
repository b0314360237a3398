"""Vertex primitives with a C++ file: the vertex compiled and run by :mod:`ipu_jax.cpp_codelets`.

A vertex primitive naming ``gp_filename`` (TessellateIPU's
``create_ipu_tile_primitive(..., gp_filename=...)``) runs that C++ vertex on
every tile, as TessellateIPU does on the IPU and as Graphcore's IPU model
does: the file is compiled for the host with g++ (cached by content) and
``tile_map`` calls the vertex once per tile through one XLA FFI call
(``ipu_jax.cpp_codelets.run_vertices``, vmapped over the tiles). Fields are
connected by name: the inputs to the shards, the outputs to fresh arrays of
their shapes, constant fields to the values the primitive's ``constants``
factories give, and plain members to the ``tile_map`` attributes of the same
name. The C++ file is the user's: nothing of it is copied here.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cpp_body"]


def _library(gp_filename: str):
  from ipu_jax import cpp_codelets  # pylint: disable=import-outside-toplevel
  return cpp_codelets.compile_codelets(gp_filename)


def _run(lib, name: str, values: Dict[str, object], out_avals: Dict[str, object]):
  from ipu_jax import cpp_codelets  # pylint: disable=import-outside-toplevel
  if name not in lib.vertex_classes:
    raise KeyError(f"Vertex {name!r} is not defined in the codelet file; it defines "
                   f"{sorted(lib.vertex_classes)}.")
  vclass = lib.vertex_classes[name]
  missing = [f.name for f in vclass.fields if f.name not in values]
  if missing:
    raise ValueError(f"Vertex {name}: fields {missing} are not connected; give them as inputs, "
                     "outputs, constants or tile_map attributes.")
  values = {f.name: values[f.name] for f in vclass.fields}
  written = cpp_codelets.run_vertices(lib, name, [values])
  return [jnp.reshape(written[n][0], a.shape).astype(a.dtype) for n, a in out_avals.items()]


def cpp_body(gp_filename: str, vertex_name: Callable, inputs: Sequence[str],
             out_avals: Callable, constants: Callable,
             scratch: Callable = lambda avals: {}) -> Callable:
  """A :class:`~ipu_jax.tessellate.tile_map.VertexSpec` body running the C++ vertex.

  Args:
    gp_filename: the C++ file.
    vertex_name: ``vertex_name(in_avals) -> str`` (templated by dtype).
    inputs: the input field names, in operand order.
    out_avals: ``out_avals(in_avals) -> {field: aval}``.
    constants: ``constants(in_avals, out_avals, attributes) -> {field: array}``.
    scratch: ``scratch(in_avals) -> {field: aval}``, the vertex's temporary fields.
  """
  def body(primitive, params):
    def fn(*shards):
      avals = [jax.core.ShapedArray(s.shape, s.dtype) for s in shards]
      outs = out_avals(avals)
      values = dict(zip(inputs, shards))
      for name, aval in outs.items():
        values.setdefault(name, jnp.zeros(aval.shape, aval.dtype))
      for name, data in constants(avals, outs, params).items():
        values[name] = jnp.asarray(np.asarray(data))
      for name, aval in scratch(avals).items():
        values.setdefault(name, jnp.zeros(aval.shape, aval.dtype))
      for name, value in params.items():
        values.setdefault(name, value)
      results = _run(_library(gp_filename), vertex_name(avals), values, outs)
      return tuple(results) if primitive.multiple_results else results[0]
    return fn
  return body
