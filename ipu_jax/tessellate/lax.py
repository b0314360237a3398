"""TessellateIPU's ``tessellate_ipu.lax``: the primitives ``tile_map`` maps, and helpers.

JAX's own primitives (``abs_p``, ``add_p``...) are re-exported as they are:
``tile_map`` maps any of them. Added here, as TessellateIPU names them:

* ``<op>_inplace_p``: the in-place forms of the unary and binary ops (on the
  IPU, popops' ``...InPlace`` vertices); mapped exactly as ``<op>_p`` (the
  emulated tile program gives every result its own tensor).
* ``scaled_add_p`` / ``scaled_sub_p``: ``a + s b`` / ``a - s b`` (popops'
  ScaledAdd / ScaledSubtract; ``s`` a one-element array).
* ``fill_p``, ``tile_fill``, ``tile_sharded_identity``, ``tile_copy``.
* the tile random functions (:mod:`ipu_jax.tessellate.random`).
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax as _lax
from jax.extend import core as jcore
from jax.interpreters import batching, mlir

from ipu_jax.tessellate.linalg.vertices import column_cycles as _column_cycles
from ipu_jax.tessellate.linalg.vertices import linalg_vertex as _linalg_vertex
from ipu_jax.tessellate.random import (tile_get_hw_seeds, tile_random_normal,  # noqa: F401
                                       tile_random_uniform, tile_set_hw_seeds)
from ipu_jax.tessellate.tile_array import TileShardedArray, tiles_tuple
from ipu_jax.tessellate.tile_map import register_attribute_adapter, register_same_as, tile_map
from ipu_jax.tessellate.tile_put import tile_constant_replicated, tile_constant_sharded  # noqa: F401

_REEXPORTED = (
    "abs asin cbrt ceil cos erf exp expm1 floor is_finite log1p log neg population_count round "
    "rsqrt select_n sign sin sqrt tan tanh add atan2 div max min mul pow rem sub eq ne ge gt le "
    "lt and or xor not clamp integer_pow convert_element_type iota shift_left "
    "shift_right_logical shift_right_arithmetic reshape bitcast_convert_type gather scatter "
    "scatter_add scatter_mul scatter_min scatter_max cumsum cumprod cummax cummin reduce_sum "
    "reduce_max reduce_min reduce_prod dot_general").split()
for _name in _REEXPORTED:
  globals()[f"{_name}_p"] = getattr(_lax, f"{_name}_p")

_UNARY_INPLACE = ("abs asin cbrt ceil erf exp expm1 floor is_finite log1p log neg "
                  "population_count round rsqrt sign sin sqrt tan tanh").split()
_BINARY_INPLACE = "add atan2 div max min mul pow rem sub".split()


def _inplace(name: str):
  original = getattr(_lax, f"{name}_p")
  clone = jcore.Primitive(f"{name}_inplace")
  clone.def_impl(lambda *xs, **params: original.bind(*xs, **params))
  clone.def_abstract_eval(lambda *avals, **params: original.abstract_eval(*avals, **params)[0])
  register_same_as(clone, original)
  return clone


for _name in _UNARY_INPLACE + _BINARY_INPLACE:
  globals()[f"{_name}_inplace_p"] = _inplace(_name)


def _scaled(name: str, sign: float):
  p = jcore.Primitive(name)

  def impl(a, b, sb):
    return a + (sign * jnp.reshape(sb, (-1,))[0]).astype(a.dtype) * b
  p.def_impl(impl)
  p.def_abstract_eval(lambda a, b, sb: jax.core.ShapedArray(a.shape, a.dtype))
  mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
  batching.primitive_batchers[p] = lambda args, dims: (
      jax.vmap(impl, in_axes=dims)(*args), 0)
  return p


scaled_add_p = _scaled("scaled_add", 1.0)
scaled_sub_p = _scaled("scaled_sub", -1.0)

fill_p = jcore.Primitive("fill")


def _fill_impl(*, shape, fill_value, dtype):
  return jnp.full(tuple(shape), fill_value, dtype)


fill_p.def_impl(_fill_impl)
fill_p.def_abstract_eval(lambda *, shape, fill_value, dtype: jax.core.ShapedArray(
    tuple(shape), np.dtype(dtype)))
mlir.register_lowering(fill_p, mlir.lower_fun(_fill_impl, multiple_results=False))
batching.primitive_batchers[fill_p] = lambda args, dims, **params: (_fill_impl(**params), None)


def fill(shape, fill_value, dtype):
  """An array of ``shape`` filled with ``fill_value``."""
  return fill_p.bind(shape=tuple(shape), fill_value=fill_value, dtype=np.dtype(dtype))


def tile_fill(shape, fill_value, dtype, tiles) -> TileShardedArray:
  """``fill`` on every tile of ``tiles`` (popops' Fill vertex): ``[len(tiles), *shape]``."""
  return tile_map(fill_p, shape=tuple(shape), fill_value=fill_value, dtype=np.dtype(dtype),
                  tiles=tiles_tuple(tiles))


def tile_sharded_identity(dtype, tiles) -> TileShardedArray:
  """The ``N x N`` identity, row ``i`` on ``tiles[i]`` (``N = len(tiles)``)."""
  tiles = tiles_tuple(tiles)
  n = len(tiles)
  rows = tile_fill((n,), 0, dtype, tiles)
  index = tile_constant_sharded(np.arange(n, dtype=np.int32).reshape(n, 1), tiles)
  one = tile_map(fill_p, shape=(), fill_value=1, dtype=np.dtype(dtype), tiles=tiles)
  return tile_map(_set_one_p, rows, index, one)


_set_one_p = jcore.Primitive("dynamic_update_index")
_set_one_p.def_impl(lambda row, index, value: row.at[index[0]].set(value))
_set_one_p.def_abstract_eval(lambda row, index, value: jax.core.ShapedArray(row.shape, row.dtype))
batching.primitive_batchers[_set_one_p] = lambda args, dims: (
    jax.vmap(lambda r, i, v: r.at[i[0]].set(v), in_axes=dims)(*args), 0)


def tile_copy(x: TileShardedArray) -> TileShardedArray:
  """An on-tile copy of ``x`` (always copied, as TessellateIPU's)."""
  return tile_map(copy_p, x)


copy_p = jcore.Primitive("copy")
copy_p.def_impl(lambda x: jnp.array(x, copy=True))
copy_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
batching.primitive_batchers[copy_p] = lambda args, dims: (args[0], dims[0])


_REDUCE_OPS = {"reduce_sum": "ReduceAdd", "reduce_prod": "ReduceMul", "reduce_max": "ReduceMax",
               "reduce_min": "ReduceMin"}


def make_continuous_reduce_vertex_fullname(reduce_p, out_dtype, partial_dtype,
                                           is_update: bool) -> str:
  """popops' ``ContinuousReduce`` vertex name for a reduction primitive."""
  from ipu_jax.tessellate.ipu_types import get_ipu_type_name  # pylint: disable=import-outside-toplevel
  from ipu_jax.kernels import vocabulary as vocab  # pylint: disable=import-outside-toplevel
  # TessellateIPU's name for popops' reduce vertex (a name only: the emulator prices
  # reductions with its own vertices); the library prefix comes from the vocabulary.
  lib = vocab.REDUCE.split("::", 1)[0]
  op = _REDUCE_OPS[reduce_p.name]
  return (f"{lib}::ContinuousReduce<{lib}::{op},{get_ipu_type_name(out_dtype)},"
          f"{get_ipu_type_name(partial_dtype)},{'true' if is_update else 'false'}>")


def _rotation2d(cs, row0, row1):
  c, s = cs[0], cs[1]
  return c * row0 - s * row1, s * row0 + c * row1


# 2x2 rotation of two rows: ~1,436 cycles measured on Mk2 at N=512 (TessellateIPU's
# tessellate-ipu/tests/lax/test_tile_lax_small_dot.py), i.e. about 2.8 cycles per element.
rotation2d_p = _linalg_vertex("Rotation2dVertex", _rotation2d, _column_cycles(0, 2.8))


def make_unary1d_vertex_fullname(op_name: str, dtype, inplace: bool) -> str:
  """popops' unary vertex for ``op_name`` (``COS``...) on ``dtype``."""
  from ipu_jax.tessellate.ipu_types import get_ipu_type_name  # pylint: disable=import-outside-toplevel
  base = "UnaryOp1DInPlace" if inplace else "UnaryOp1D"
  return f"popops::{base}<popops::expr::UnaryOpType::{op_name},{get_ipu_type_name(dtype)}>"


def ipu_unary_primitive_translation(p, tiles, inavals, attributes=None):
  """The tile equation TessellateIPU builds for a unary primitive (popops' UnaryOp1D)."""
  from ipu_jax.tessellate import equations as eq  # pylint: disable=import-outside-toplevel
  del attributes
  inplace = p.name.endswith("_inplace")
  name = p.name[:-len("_inplace")] if inplace else p.name
  aval = inavals[0]
  io = eq.IpuVertexIOType.InOut if inplace else None
  return eq.IpuTileMapEquation(
      vname=make_unary1d_vertex_fullname(name.upper(), aval.dtype, inplace), pname=p.name,
      tiles=list(tiles),
      inputs_info=[eq.make_ipu_vertex_io_info("inout" if inplace else "in",
                                              io or eq.IpuVertexIOType.In, aval)],
      outputs_info=[eq.make_ipu_vertex_io_info("inout" if inplace else "out",
                                               io or eq.IpuVertexIOType.Out, aval)])


class IpuConvVertexType(enum.Enum):
  """The AMP vertex TessellateIPU maps a ``dot_general`` to (a hint; the emulator prices
  every ``dot_general`` vertex the same way)."""
  ConvPartial1x1 = 1
  ConvPartialHMAC = 2
  ConvPartialVerticalMac = 3


def _dot_general_attributes(attrs: dict) -> dict:
  attrs.pop("ipu_vertex_type", None)
  precision = attrs.get("precision")
  if isinstance(precision, _lax.Precision):
    attrs["precision"] = (precision, precision)  # JAX 0.3 took one precision for both
  if attrs.get("preferred_element_type") is not None:
    attrs["preferred_element_type"] = np.dtype(attrs["preferred_element_type"])
  return attrs


register_attribute_adapter(_lax.dot_general_p, _dot_general_attributes)


def _amp_internals(*args, **kwargs):
  raise NotImplementedError(
      "TessellateIPU's AMP vertex worklist encoding (ConvPartial1x1 static args, transformed "
      "out strides) is not modelled by the emulator; tile_map(dot_general_p, ...) runs the "
      "product directly.")


IpuConvPartial1x1Args = IpuConvPartial1x1StaticArgs = _amp_internals
ipuGetTransformedOutStride = ipuReverseTransformedOutStride = _amp_internals
make_conv_partial1x1_attributes = _amp_internals
