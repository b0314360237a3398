"""Sizing I/O tiles: how many tiles to set aside for host data.

PopART's overlap-I/O guide gives the rule of thumb: the bytes of all the
overlapped inputs and outputs (anchors) divided by the SRAM available per
tile, rounded up to the next power of two (see
``docs/host_side.md#io-tiles``). :func:`suggest_num_io_tiles` applies it to
arrays (one iteration's data) or a byte count, against the I/O tiles' share
of SRAM (``io_tiles.available_memory_proportion``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from ipu_jax import config as config_lib
from ipu_jax.lowering.host_io import check_num_io_tiles, suggest_num_io_tiles_for
from ipu_jax.lowering.jax_compat import physical_nbytes

__all__ = ["suggest_num_io_tiles"]


def _bytes_of(data: Any) -> int:
  if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
    if data < 0:
      raise ValueError(f"suggest_num_io_tiles: a byte count must be >= 0; got {data}.")
    return int(data)
  leaves = jax.tree.leaves(data)
  return sum(physical_nbytes(a) for a in leaves)


def suggest_num_io_tiles(data: Any, config: Optional[config_lib.IPUConfig] = None) -> int:
  """I/O tiles per IPU for ``data`` by PopART's rule (0 for no data).

  Args:
    data: one iteration's overlapped inputs and outputs: a pytree of arrays
      (or ``jax.ShapeDtypeStruct``) or a byte count.
    config: the ``IPUConfig`` whose device and
      ``io_tiles.available_memory_proportion`` apply (default: the current
      default config).

  Returns:
    An even power of two, at least 2 when there is data.

  Raises:
    ValueError: the suggestion leaves too few compute tiles on the device
      (naming ``io_tiles.num_io_tiles``).
  """
  cfg = config or config_lib.get_default_config()
  target = cfg.to_target()
  per_tile = target.bytes_per_tile * cfg.io_tiles.available_memory_proportion
  count = suggest_num_io_tiles_for(_bytes_of(data), per_tile)
  check_num_io_tiles(count, target.tiles_per_ipu + target.io_tiles_per_ipu)
  return count
