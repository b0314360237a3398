"""Vertex primitives: ``create_ipu_tile_primitive`` and its relatives (TessellateIPU's).

A vertex primitive names a vertex type (``"JacobiSymSchur2"``, or templated
by an input's dtype: ``"CustomVertex<{x}>"``), its fields (``inputs``, and
``outputs`` with their shapes), the C++ file defining it (``gp_filename``)
and its cycle count (``perf_estimate``, as Poplar's ``setPerfEstimate``).
:func:`~ipu_jax.tessellate.tile_map` runs it one vertex per tile, priced at
that estimate. Its body on the emulator: the C++ vertex of ``gp_filename``,
compiled and run by :mod:`ipu_jax.cpp_codelets`
(:mod:`ipu_jax.tessellate.cpp_vertex`); without a file, the primitive's
Python ``impl`` (``def_impl``), vmapped over the tiles. A vertex with neither
is refused when it is mapped, before anything runs.
"""

from __future__ import annotations

import base64

from typing import Any, Callable, Dict, List, Optional, Union

import jax
import numpy as np
from jax.extend import core as jcore

from ipu_jax.tessellate import ipu_types
from ipu_jax.tessellate.cpp_vertex import cpp_body
from ipu_jax.tessellate.tile_map import VertexSpec, register_vertex

__all__ = ["create_ipu_tile_primitive", "declare_ipu_tile_primitive",
           "register_ipu_tile_primitive", "ipu_type_name"]

_IPU_TYPE_NAMES = {
    np.dtype(np.bool_): "bool", np.dtype(np.uint8): "unsigned char",
    np.dtype(np.int8): "signed char", np.dtype(np.uint16): "unsigned short",
    np.dtype(np.int16): "short", np.dtype(np.uint32): "unsigned int",
    np.dtype(np.int32): "int", np.dtype(np.float16): "half", np.dtype(np.float32): "float",
}


def ipu_type_name(dtype) -> str:
  """Poplar's C++ name of ``dtype`` (``float``, ``half``, ``int``...)."""
  dtype = np.dtype(dtype)
  if dtype not in _IPU_TYPE_NAMES:
    raise TypeError(f"No IPU type for dtype {dtype}; the IPU has {sorted(map(str, _IPU_TYPE_NAMES))}.")
  return _IPU_TYPE_NAMES[dtype]


def _templated(vname: str, inputs, avals) -> str:
  """``vname`` with ``{input}`` replaced by that input's IPU type name."""
  names = {n: ipu_type_name(a.dtype) for n, a in zip(inputs, avals) if f"{{{n}}}" in vname}
  return vname.format(**names) if names else vname


def _has_impl(primitive) -> bool:
  return "impl" in vars(primitive)


def _checked_impl_body(primitive) -> Optional[Callable]:
  """The body of a vertex without a C++ file: the primitive's Python impl, vmapped over the tiles."""
  def body(p, params):
    if not _has_impl(p):
      raise NotImplementedError(
          f"Vertex primitive '{p.name}' has no body on the emulator: give its C++ vertex "
          "file (gp_filename=...), or a Python implementation with primitive.def_impl(fn).")

    def fn(*xs):
      out = p.impl(*xs, **params)
      if p.multiple_results:
        return tuple(jax.numpy.asarray(o) for o in out)
      return jax.numpy.asarray(out)
    return fn
  return body


def create_ipu_tile_primitive(pname: str, vname: str, inputs: List[str],
                              outputs: Dict[str, Union[int, Any]],
                              constants: Optional[Dict[str, Callable]] = None,
                              tmp_space=None, gp_filename: Optional[str] = None,
                              perf_estimate: int = 0):
  """A vertex primitive mapping straight to an IPU vertex (TessellateIPU's factory).

  Args:
    pname: the primitive's name.
    vname: the vertex type, optionally templated by inputs' dtypes (``"V<{x}>"``).
    inputs: the input field names, in order.
    outputs: output field name -> the input index whose shape/dtype it has, or
      a ``ShapedArray``.
    constants: constant fields (``fn(in_avals, out_avals, attributes)``); the
      C++ runner receives them, a Python ``impl`` computes its own.
    tmp_space: a scratch field (accepted; scratch is per-vertex memory here).
    gp_filename: the C++ file defining ``vname``.
    perf_estimate: the vertex's cycles (Poplar's ``setPerfEstimate``).

  Returns:
    The primitive, for :func:`~ipu_jax.tessellate.tile_map`.
  """
  p = jcore.Primitive(pname)
  p.multiple_results = len(outputs) > 1
  inputs = list(inputs)

  def abstract_eval(*avals, **_):
    if len(avals) != len(inputs):
      raise TypeError(f"{pname}: {len(avals)} operands for inputs {inputs}.")
    outs = [avals[o] if isinstance(o, int) else o for o in outputs.values()]
    outs = [jax.core.ShapedArray(o.shape, o.dtype) for o in outs]
    return tuple(outs) if p.multiple_results else outs[0]

  p.def_abstract_eval(abstract_eval)
  name_of = lambda avals: _templated(vname, inputs, avals)

  def out_avals(avals):
    outs = [avals[o] if isinstance(o, int) else o for o in outputs.values()]
    return {n: jax.core.ShapedArray(o.shape, o.dtype) for n, o in zip(outputs, outs)}

  def constant_values(avals, outs, attrs):
    return {n: f(avals, list(outs.values()), attrs) for n, f in (constants or {}).items()}

  def scratch(avals):
    if tmp_space is None:
      return {}
    aval = avals[tmp_space] if isinstance(tmp_space, int) else tmp_space
    return {"tmp": jax.core.ShapedArray(aval.shape, aval.dtype)}

  body = (cpp_body(gp_filename, name_of, inputs, out_avals, constant_values, scratch)
          if gp_filename else _checked_impl_body(p))
  register_vertex(p, VertexSpec(vertex_name=name_of,
                                perf_estimate=lambda avals, attrs: int(perf_estimate),
                                body=body))
  return p


def declare_ipu_tile_primitive(vname: str, gp_filename: Optional[str] = None):
  """Decorator: a vertex primitive from an initializer (TessellateIPU's v2 factory).

  The decorated ``initializer(*in_avals) -> (outputs, constants, temps,
  perf_estimate)`` names the inputs by its parameters and returns the outputs
  as a dict of shaped arrays (an output named like an input is an in/out).
  """
  def decorate(initializer):
    n = initializer.__code__.co_argcount
    inputs = list(initializer.__code__.co_varnames[:n])
    p = jcore.Primitive(initializer.__name__)

    def outputs_of(avals):
      outs = tuple(initializer(*avals)[0].values())
      p.multiple_results = len(outs) > 1
      return outs

    def abstract_eval(*avals, **_):
      outs = [jax.core.ShapedArray(o.shape, o.dtype) for o in outputs_of(avals)]
      return tuple(outs) if p.multiple_results else outs[0]

    def name_of(avals):
      outputs_of(avals)
      return _templated(vname, inputs, avals)

    def out_avals(avals):
      outs = initializer(*avals)[0]
      return {n: jax.core.ShapedArray(o.shape, o.dtype) for n, o in outs.items()}

    def constant_values(avals, outs, attrs):
      del outs, attrs
      return dict(initializer(*avals)[1] or {})

    def scratch(avals):
      temps = initializer(*avals)[2] or {}
      return {n: jax.core.ShapedArray(a.shape, a.dtype) for n, a in temps.items()}

    p.def_abstract_eval(abstract_eval)
    body = (cpp_body(gp_filename, name_of, inputs, out_avals, constant_values, scratch)
            if gp_filename else _checked_impl_body(p))
    register_vertex(p, VertexSpec(
        vertex_name=name_of,
        perf_estimate=lambda avals, attrs: int(initializer(*avals)[3] or 0),
        body=body))
    return p
  return decorate


def _equation(translation, primitive, avals, attrs):
  """The translation's tile equation for ``avals``, or None when it cannot be built here."""
  try:
    return translation(primitive, (0,), list(avals), dict(attrs))
  except Exception:  # pylint: disable=broad-except
    return None


def _decoded(info) -> np.ndarray:
  """A constant field's data (base64 in the equation) as an array."""
  from ipu_jax.tessellate.ipu_types import from_ipu_type_to_numpy_dtype  # pylint: disable=import-outside-toplevel
  raw = base64.b64decode(info.constant_data.encoded_data)
  return np.frombuffer(raw, from_ipu_type_to_numpy_dtype(info.dtype)).reshape(info.shape)


def _equation_body(translation):
  """Run the C++ vertex the translation's equation names, when it names a file."""
  def body(p, params):
    def fn(*shards):
      avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in shards]
      eqn = _equation(translation, p, avals, params)
      if eqn is None or not getattr(eqn, "gp_filename", None):
        return _checked_impl_body(p)(p, params)(*shards)
      operands = [i for i in eqn.inputs_info if not i.is_constant_input]
      consts = {i.name: _decoded(i) for i in eqn.inputs_info if i.is_constant_input}
      outs = {o.name: jax.core.ShapedArray(
          o.shape, ipu_types.from_ipu_type_to_numpy_dtype(o.dtype)) for o in eqn.outputs_info}
      tmp = ({eqn.tmp_space_name: jax.core.ShapedArray(
          eqn.tmp_space_aval.shape, ipu_types.from_ipu_type_to_numpy_dtype(
              eqn.tmp_space_aval.dtype))} if eqn.use_tmp_space else {})
      run = cpp_body(eqn.gp_filename, lambda _: eqn.vname, [i.name for i in operands],
                     lambda _: outs, lambda *_: consts, lambda _: tmp)
      return run(p, {})(*shards)
    return fn
  return body


def register_ipu_tile_primitive(primitive, translation: Callable) -> None:
  """Register a primitive with its own IPU translation (TessellateIPU's low-level API).

  The translation's equation (an :class:`~ipu_jax.tessellate.equations.IpuTileMapEquation`)
  names the vertex, its fields and constants, its C++ file and its ``perf_estimate``: the
  vertex runs from that file (the primitive's ``impl`` when the equation names none) and is
  priced at that estimate.
  """
  def perf(avals, attrs):
    eqn = _equation(translation, primitive, avals, attrs)
    return int(getattr(eqn, "perf_estimate", 0) or 0)

  register_vertex(primitive, VertexSpec(vertex_name=lambda avals: primitive.name,
                                        perf_estimate=perf, body=_equation_body(translation)))
