"""TessellateIPU's description types: ``IpuType``, ``IpuShapedArray``, ``Base64Data``.

TessellateIPU passes tile equations to its C++ side as JSON; these are the
Python faces of the types in those messages (``tessellate_ipu/core/
tile_common_utils.py`` and the ``pytessellate_ipu_core`` bindings), kept
for code that builds them. The emulator itself does not serialise equations.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
from typing import List

import numpy as np

__all__ = ["IpuType", "IpuShapedArray", "Base64Data", "from_numpy_dtype_to_ipu_type",
           "from_ipu_type_to_numpy_dtype", "make_ipu_shaped_array", "get_ipu_type_name"]


class IpuType(enum.Enum):
  """Poplar's element types (value: Poplar's C++ type name, bytes)."""
  BOOL = ("bool", 1)
  CHAR = ("char", 1)
  UNSIGNED_CHAR = ("unsigned char", 1)
  SIGNED_CHAR = ("signed char", 1)
  UNSIGNED_SHORT = ("unsigned short", 2)
  SHORT = ("short", 2)
  UNSIGNED_INT = ("unsigned int", 4)
  INT = ("int", 4)
  UNSIGNED_LONG = ("unsigned long", 8)
  LONG = ("long", 8)
  QUARTER = ("quarter", 1)
  HALF = ("half", 2)
  FLOAT = ("float", 4)

  @property
  def bytesize(self) -> int:
    return self.value[1]


_FROM_NUMPY = {
    np.dtype(np.bool_): IpuType.BOOL, np.dtype(np.uint8): IpuType.UNSIGNED_CHAR,
    np.dtype(np.int8): IpuType.SIGNED_CHAR, np.dtype(np.uint16): IpuType.UNSIGNED_SHORT,
    np.dtype(np.int16): IpuType.SHORT, np.dtype(np.uint32): IpuType.UNSIGNED_INT,
    np.dtype(np.int32): IpuType.INT, np.dtype(np.float16): IpuType.HALF,
    np.dtype(np.float32): IpuType.FLOAT,
}


def from_numpy_dtype_to_ipu_type(dtype) -> IpuType:
  """The IPU type of a NumPy dtype (an ``IpuType`` is returned as is)."""
  if isinstance(dtype, IpuType):
    return dtype
  dtype = np.dtype(dtype)
  if dtype not in _FROM_NUMPY:
    raise TypeError(f"No IPU type for dtype {dtype}.")
  return _FROM_NUMPY[dtype]


def from_ipu_type_to_numpy_dtype(ipu_type) -> np.dtype:
  """The NumPy dtype of an IPU type (a NumPy dtype is returned as is)."""
  if not isinstance(ipu_type, IpuType):
    return np.dtype(ipu_type)
  for dtype, t in _FROM_NUMPY.items():
    if t == ipu_type:
      return dtype
  raise TypeError(f"No NumPy dtype for IPU type {ipu_type}.")


def get_ipu_type_name(dtype) -> str:
  """Poplar's C++ name of ``dtype`` (``float``, ``half``...)."""
  return from_numpy_dtype_to_ipu_type(dtype).value[0]


@dataclasses.dataclass
class IpuShapedArray:
  """A shape and IPU element type."""
  shape: List[int] = dataclasses.field(default_factory=list)
  dtype: IpuType = IpuType.UNSIGNED_CHAR

  def __post_init__(self):
    self.shape = [int(d) for d in self.shape]

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


def make_ipu_shaped_array(shape, dtype) -> IpuShapedArray:
  """An :class:`IpuShapedArray` from a shape and a NumPy dtype."""
  return IpuShapedArray(shape=list(shape), dtype=from_numpy_dtype_to_ipu_type(dtype))


class Base64Data:
  """Base64-encoded bytes, as TessellateIPU's JSON messages carry constants."""

  def __init__(self, encoded_data=""):
    if isinstance(encoded_data, bytes):
      encoded_data = encoded_data.decode("ascii")
    self.encoded_data = str(encoded_data)

  @classmethod
  def from_decoded_data(cls, data) -> "Base64Data":
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return cls(base64.b64encode(raw))

  @property
  def decoded_data(self) -> str:
    return base64.b64decode(self.encoded_data).decode()

  @property
  def is_empty(self) -> bool:
    return not self.encoded_data

  @classmethod
  def from_json_str(cls, text: str) -> "Base64Data":
    value = json.loads(text)
    return cls((value or {}).get("encoded_data", ""))

  def to_json_str(self) -> str:
    if self.is_empty:
      return "null"
    return json.dumps({"encoded_data": self.encoded_data}, separators=(",", ":"))
