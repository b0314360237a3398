"""TessellateIPU's tile-equation descriptors (``tile_interpreter_primitives`` and the
``pytessellate_ipu_core`` bindings' classes), for code that builds them.

On the IPU, ``tile_map`` turns a primitive into an ``IpuTileMapEquation`` (a
vertex name, its fields with shapes/types/2-D slicing, attributes, a C++ file
and a perf estimate) serialised to JSON for the C++ side. The emulator maps
primitives directly (:mod:`ipu_jax.tessellate.tile_map`); these classes are
the same descriptions as plain Python objects, so code that registers its own
translation (``register_ipu_tile_primitive``) runs, and its ``perf_estimate``
prices the vertex.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
import json
from typing import Any, Dict, List, Optional, Tuple  # noqa: F401

import numpy as np
from jax.interpreters import ad, batching

from ipu_jax.tessellate.ipu_types import (Base64Data, IpuShapedArray, IpuType,
                                          from_numpy_dtype_to_ipu_type, get_ipu_type_name)

__all__ = ["IpuTensorSlice", "IpuVertexIOType", "IpuVertexIOInfo", "IpuVertexAttributeI32",
           "IpuVertexAttributeF32", "IpuTileMapEquation", "TileDataBarrierParams",
           "make_ipu_vertex_io_info", "make_ipu_vertex_in_info", "make_ipu_vertex_out_info",
           "make_ipu_vertex_inout_info", "make_ipu_vertex_constant_info",
           "make_ipu_vertex_inputs", "make_ipu_vertex_outputs", "make_ipu_vertex_attributes",
           "make_ipu_vertex_name_templated", "primitive_clone", "primitive_has_impl",
           "primitive_has_batching", "primitive_num_inout_alias_args"]


class IpuVertexIOType(enum.Enum):
  """How a vertex field is connected."""
  In = 0
  Out = 1
  InOut = 2


@dataclasses.dataclass
class IpuTensorSlice:
  """A ``[begin, end)`` range of a flattened field (one row of a 2-D field)."""
  begin: int
  end: int

  def to_json_str(self) -> str:
    return json.dumps({"begin": self.begin, "end": self.end}, separators=(",", ":"))

  @classmethod
  def from_json_str(cls, text: str) -> "IpuTensorSlice":
    value = json.loads(text)
    return cls(int(value["begin"]), int(value["end"]))


def _slices2d(size: int, dim2: int) -> List[IpuTensorSlice]:
  """A field cut into ``size / dim2`` rows of ``dim2`` (a 2-D vertex field); none for 1-D."""
  if dim2 <= 0:
    return []
  return [IpuTensorSlice(b, min(b + dim2, size)) for b in range(0, size, dim2)]


_IPU_TYPES = list(IpuType)


@dataclasses.dataclass
class IpuVertexIOInfo:
  """One vertex field: name, connection, shape, IPU type, 2-D slicing, constant data."""
  name: str
  iotype: IpuVertexIOType
  shape: List[int]
  dtype: IpuType
  constant_data: Base64Data = dataclasses.field(default_factory=Base64Data)
  slices2d: List[IpuTensorSlice] = dataclasses.field(default_factory=list)
  is_scalar: bool = False

  def __eq__(self, other) -> bool:
    return (isinstance(other, IpuVertexIOInfo) and self.to_json_str() == other.to_json_str())

  @property
  def is_constant_input(self) -> bool:
    return not self.constant_data.is_empty

  @property
  def aval(self) -> IpuShapedArray:
    return IpuShapedArray(self.shape, self.dtype)

  def to_json_str(self) -> str:
    return json.dumps({
        "aval": {"dtype": _IPU_TYPES.index(self.dtype), "shape": list(self.shape)},
        "constant_data": json.loads(self.constant_data.to_json_str()),
        "iotype": self.iotype.value, "is_scalar": self.is_scalar, "name": self.name,
        "slices2d": [{"begin": s.begin, "end": s.end} for s in self.slices2d],
    }, separators=(",", ":"), sort_keys=True)

  @classmethod
  def from_json_str(cls, text: str) -> "IpuVertexIOInfo":
    v = json.loads(text)
    return cls(name=v["name"], iotype=IpuVertexIOType(v["iotype"]),
               shape=list(v["aval"]["shape"]), dtype=_IPU_TYPES[v["aval"]["dtype"]],
               constant_data=Base64Data((v.get("constant_data") or {}).get("encoded_data", "")),
               slices2d=[IpuTensorSlice(s["begin"], s["end"]) for s in v.get("slices2d", [])],
               is_scalar=bool(v.get("is_scalar", False)))


@dataclasses.dataclass(frozen=True)
class IpuVertexAttributeI32:
  name: str
  value: int


@dataclasses.dataclass(frozen=True)
class IpuVertexAttributeF32:
  name: str
  value: float


@dataclasses.dataclass
class IpuTileMapEquation:
  """A primitive mapped on tiles as one vertex per tile."""
  vname: str = ""
  pname: str = ""
  tiles: Tuple[int, ...] = ()
  inputs_info: List[IpuVertexIOInfo] = dataclasses.field(default_factory=list)
  outputs_info: List[IpuVertexIOInfo] = dataclasses.field(default_factory=list)
  attributes_i32: List[IpuVertexAttributeI32] = dataclasses.field(default_factory=list)
  attributes_f32: List[IpuVertexAttributeF32] = dataclasses.field(default_factory=list)
  gp_filename: Optional[str] = None
  perf_estimate: int = 0
  sync: bool = False
  tmp_space_name: str = ""
  tmp_space_aval: IpuShapedArray = dataclasses.field(
      default_factory=lambda: IpuShapedArray(shape=[0]))

  @property
  def use_tmp_space(self) -> bool:
    return bool(self.tmp_space_name) and self.tmp_space_aval.size > 0

  @property
  def num_inouts(self) -> int:
    return sum(i.iotype == IpuVertexIOType.InOut for i in self.inputs_info)

  @property
  def num_inputs(self) -> int:
    return len(self.inputs_info)

  @property
  def num_outputs(self) -> int:
    return len(self.outputs_info)


@dataclasses.dataclass
class TileDataBarrierParams:
  """The barrier's parameters (vertex name, each input's tiles, the largest tile)."""
  vname: str
  inputs_tiles: List[List[int]]
  max_tile: int

  def to_json_str(self) -> str:
    return json.dumps({"inputs_tiles": self.inputs_tiles, "max_tile": self.max_tile,
                       "vname": self.vname}, separators=(",", ":"), sort_keys=True)


def make_ipu_vertex_io_info(name: str, iotype: IpuVertexIOType, aval,
                            vertex_dim2: int = 0) -> IpuVertexIOInfo:
  """A field of ``aval``'s shape and type."""
  size = int(np.prod(aval.shape, dtype=np.int64))
  return IpuVertexIOInfo(name, iotype, [int(d) for d in aval.shape],
                         from_numpy_dtype_to_ipu_type(aval.dtype),
                         slices2d=_slices2d(size, vertex_dim2), is_scalar=vertex_dim2 < 0)


def make_ipu_vertex_in_info(name, aval, vertex_dim2=0):
  return make_ipu_vertex_io_info(name, IpuVertexIOType.In, aval, vertex_dim2)


def make_ipu_vertex_out_info(name, aval, vertex_dim2=0):
  return make_ipu_vertex_io_info(name, IpuVertexIOType.Out, aval, vertex_dim2)


def make_ipu_vertex_inout_info(name, aval, vertex_dim2=0):
  return make_ipu_vertex_io_info(name, IpuVertexIOType.InOut, aval, vertex_dim2)


def make_ipu_vertex_constant_info(name: str, data, vertex_dim2: int = 0) -> IpuVertexIOInfo:
  """A constant input field holding ``data`` (``vertex_dim2 < 0``: a scalar field)."""
  data = np.asarray(data)
  info = make_ipu_vertex_io_info(name, IpuVertexIOType.In, data, vertex_dim2)
  info.constant_data = Base64Data(base64.b64encode(data.tobytes()))
  return info


def _infos(avals: Dict[str, Any], inout: set, dim2: Dict[str, int], default):
  return [make_ipu_vertex_io_info(name, IpuVertexIOType.InOut if name in inout else default,
                                  aval, dim2.get(name, 0)) for name, aval in avals.items()]


def make_ipu_vertex_inputs(inavals, inout_names=frozenset(), vertex_dim2=None):
  """Input fields (``InOut`` for names in ``inout_names``)."""
  return _infos(inavals, set(inout_names), vertex_dim2 or {}, IpuVertexIOType.In)


def make_ipu_vertex_outputs(outavals, inout_names=frozenset(), vertex_dim2=None):
  """Output fields (``InOut`` for names in ``inout_names``)."""
  return _infos(outavals, set(inout_names), vertex_dim2 or {}, IpuVertexIOType.Out)


def make_ipu_vertex_attributes(**kwargs):
  """Keyword attributes split into int32 and float32 lists."""
  i32 = [IpuVertexAttributeI32(k, int(v)) for k, v in kwargs.items()
         if isinstance(v, (bool, int, np.integer))]
  f32 = [IpuVertexAttributeF32(k, float(v)) for k, v in kwargs.items()
         if isinstance(v, (float, np.floating))]
  return i32, f32


def make_ipu_vertex_name_templated(basename: str, *args) -> str:
  """``Base<arg,...>``: types by Poplar name, bools as ``true``/``false``."""
  def name(arg) -> str:
    if isinstance(arg, str):
      return arg
    if isinstance(arg, (bool, np.bool_)):
      return "true" if arg else "false"
    if isinstance(arg, (int, np.integer)):
      return str(int(arg))
    return get_ipu_type_name(arg)
  return f"{basename}<{','.join(name(a) for a in args)}>"


def primitive_clone(p, name: str):
  """A copy of primitive ``p`` named ``name``, sharing its JVP and batching rules."""
  if name == p.name:
    raise ValueError("primitive_clone needs a new name.")
  clone = copy.copy(p)
  clone.name = name
  if p in ad.primitive_jvps:
    ad.primitive_jvps[clone] = ad.primitive_jvps[p]
  if p in batching.fancy_primitive_batchers:
    batching.fancy_primitive_batchers[clone] = batching.fancy_primitive_batchers[p]
  return clone


def primitive_has_impl(p) -> bool:
  """Whether ``p`` has an eager implementation."""
  return "impl" in vars(p)


def primitive_has_batching(p) -> bool:
  """Whether ``p`` has a batching rule (``vmap`` support)."""
  return p in batching.fancy_primitive_batchers


def primitive_num_inout_alias_args(p) -> int:
  """In/out aliased operands of ``p`` (0: the emulator gives every result its own tensor)."""
  return int(getattr(p, "num_inout_alias_args", 0))
