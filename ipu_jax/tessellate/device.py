"""The emulated IPU as TessellateIPU code sees it (``tessellate_ipu.utils``).

TessellateIPU asks ``jax.devices("ipu")`` for the device and reads its
``num_tiles``, ``num_worker_contexts`` and ``target_type``; it runs the IPU
model when ``JAX_IPU_USE_MODEL=true`` with ``JAX_IPU_MODEL_NUM_TILES`` tiles,
and JAX sees ``JAX_IPU_DEVICE_COUNT`` IPUs (TessellateIPU's README:
``jax_ipu_device_count``, "the number of IPUs visible in JAX").
:func:`emulated_target` reads the same variables: the emulated target is an
``ipu2`` with that many tiles (1,472 when unset), :func:`emulated_devices` is
that many IPUs (1 when unset), and each reports itself as an IPU model (the
emulator, like Graphcore's IPU model, runs no hardware).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Tuple

import numpy as np

from ipu_jax.kernels.target import IPUTarget

__all__ = ["IpuTargetType", "IpuDevice", "is_ipu_model", "emulated_target", "emulated_device",
           "emulated_devices", "DEVICE_COUNT_ENV",
           "ArrayLike", "DType", "DTypeLike", "NDArray", "Shape"]

ArrayLike = Any
DType = np.dtype
DTypeLike = Any
NDArray = np.ndarray
Shape = Tuple[int, ...]

NUM_TILES_ENV = "JAX_IPU_MODEL_NUM_TILES"
DEVICE_COUNT_ENV = "JAX_IPU_DEVICE_COUNT"


class IpuTargetType(enum.Enum):
  """TessellateIPU's device kinds."""
  IPU = 1
  IPU_MODEL = 2
  CPU = 3


@dataclasses.dataclass(frozen=True)
class IpuDevice:
  """The emulated IPU device (``jax.devices("ipu")[0]`` under the alias)."""

  target: IPUTarget
  id: int = 0

  @property
  def num_tiles(self) -> int:
    return int(self.target.tiles_per_ipu)

  @property
  def num_worker_contexts(self) -> int:
    return int(self.target.worker_contexts)

  @property
  def target_type(self) -> IpuTargetType:
    return IpuTargetType.IPU_MODEL

  @property
  def is_ipu_model(self) -> bool:
    return True

  platform = "ipu"
  device_kind = "IPU (ipu-jax emulator)"


def is_ipu_model(device) -> bool:
  """Whether ``device`` is an IPU model (the emulated device is)."""
  return isinstance(device, IpuDevice) and device.target_type == IpuTargetType.IPU_MODEL


def emulated_target() -> IPUTarget:
  """The target ``jax.jit(..., backend="ipu")`` compiles for (``JAX_IPU_MODEL_NUM_TILES``)."""
  tiles = os.environ.get(NUM_TILES_ENV)
  if tiles is None:
    return IPUTarget.preset("ipu2")
  return IPUTarget.preset("ipu2", tiles_per_ipu=int(tiles))


def emulated_device() -> IpuDevice:
  """The emulated device for :func:`emulated_target`."""
  return IpuDevice(emulated_target())


def emulated_devices() -> list:
  """``jax.devices("ipu")`` under the alias: ``JAX_IPU_DEVICE_COUNT`` IPUs (1 when unset).

  Raises:
    ValueError: the variable is not a positive integer.
  """
  count = os.environ.get(DEVICE_COUNT_ENV, "1")
  if not count.strip().isdigit() or int(count) < 1:
    raise ValueError(f"{DEVICE_COUNT_ENV}={count!r}: the number of IPUs JAX sees, a positive "
                     "integer.")
  target = emulated_target()
  return [IpuDevice(target, id=i) for i in range(int(count))]


def env_path_append(key: str, value: str) -> None:
  """Append ``value`` to the ``os.pathsep`` list in environment variable ``key``."""
  current = os.environ.get(key)
  os.environ[key] = value if not current else current + os.pathsep + value


env_cpath_append = lambda path: env_path_append("CPATH", path)  # noqa: E731
