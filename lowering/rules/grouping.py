"""Storage slots grouped by (tile row, key): shared by reductions and scans.

Both two-stage plans (:mod:`~ipu_jax.lowering.rules.reduction` and
:mod:`~ipu_jax.lowering.rules.cumulative`) start by grouping, on every tile,
the storage slots of the elements that share a key (the output element of a
reduction, the line of a scan) into a dense ``[rows, width, depth]`` table, so
that one vertex per tile can reduce or scan the last axis. The grouping is
static and computed once with vectorised NumPy; this module also holds the
other helpers both plans use (monoid identities, a gather with a fill slot and
mappings built directly from rows).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ipu_jax.jax_compat import lax_internal
from ipu_jax.lowering.mapping import TileMapping

__all__ = ["Groups", "group_slots", "identity_of", "rows_mapping", "gather_or_fill"]


def identity_of(kind: str, dtype) -> np.ndarray:
  """The identity element of the monoid ``kind`` for ``dtype``."""
  dtype = np.dtype(dtype)
  if kind in ("add", "or", "xor"):
    return np.zeros((), dtype)
  if kind == "mul":
    return np.ones((), dtype)
  if kind == "max":
    return np.asarray(lax_internal._get_max_identity(dtype), dtype)
  if kind == "min":
    return np.asarray(lax_internal._get_min_identity(dtype), dtype)
  if kind == "and":
    return np.invert(np.zeros((), dtype))
  if kind == "logaddexp":
    return np.asarray(-np.inf, dtype)
  raise ValueError(f"no identity for {kind}")



def rows_mapping(num: int, row_tiles: np.ndarray, row_of: np.ndarray,
                  offset: np.ndarray, per_row: np.ndarray) -> TileMapping:
  """A mapping whose element ``i`` sits in row ``row_of[i]`` at ``offset[i]``.

  ``row_of`` must be non-decreasing and every row non-empty; rows are on
  ``row_tiles`` (unique). Built directly (no sort).
  """
  per_row = np.asarray(per_row, np.int64)
  chunk = int(per_row[0])
  if np.all(per_row[:-1] == chunk) and per_row[-1] <= chunk:
    return TileMapping(num, row_tiles, per_row, chunk=chunk)
  return TileMapping(num, row_tiles, per_row, element_row=row_of,
                     element_offset=offset)


def gather_or_fill(flat, index: np.ndarray, fill):
  """``flat[index]`` where ``index == flat.size`` takes ``fill``."""
  ext = jnp.concatenate([flat, jnp.reshape(jnp.asarray(fill, flat.dtype), (1,))])
  return ext[index]


@dataclasses.dataclass
class Groups:
  """Stage 1: a tensor's storage slots grouped by (row, output element).

  Attributes:
    num: partials (groups).
    row: ``[num]`` storage row (tile) of each partial, non-decreasing.
    key: ``[num]`` output element of each partial.
    local: ``[num]`` position of the partial within its row.
    per_row: ``[rows]`` partials per row.
    dense: ``[rows, width, depth]`` storage slot of every member of every
      partial (``rows * row_size`` marks padding).
    first_slot: ``[num]`` storage slot of each partial's first member.
    reshape_only: ``dense`` is the storage itself, reshaped.
    valid: ``[rows * row_size]`` slots that hold elements.
  """

  num: int
  row: np.ndarray
  key: np.ndarray
  local: np.ndarray
  per_row: np.ndarray
  dense: np.ndarray
  first_slot: np.ndarray
  reshape_only: bool
  valid: np.ndarray



def group_slots(mapping: TileMapping, element_key: np.ndarray, num_keys: int) -> Groups:
  """Group the storage slots of ``mapping`` by (row, ``element_key``).

  Members of a group keep the order of their slots (flat element order).
  """
  rows, row_size = mapping.storage_shape
  total = rows * row_size
  n = mapping.num_elements
  slots = np.arange(n, dtype=np.int64) if mapping.is_linear else mapping.storage_position
  composite = (slots // max(row_size, 1)) * num_keys + element_key
  if n < 2 or bool(np.all(composite[1:] >= composite[:-1])):
    order = np.arange(n, dtype=np.int64)
  else:
    order = np.argsort(composite, kind="stable")
  keys = composite[order]
  slot = slots[order]
  new = np.ones(n, bool)
  new[1:] = keys[1:] != keys[:-1]
  starts = np.flatnonzero(new)
  gid = np.cumsum(new) - 1
  rank = np.arange(n) - starts[gid]
  group_key = keys[starts]
  group_row = group_key // num_keys
  per_row = np.bincount(group_row, minlength=rows)
  row_start = np.cumsum(per_row) - per_row
  local = np.arange(starts.size) - row_start[group_row]
  width = int(per_row.max())
  depth = int(rank[-1] if n == 1 else rank.max()) + 1
  position = ((group_row * width + local)[gid]) * depth + rank
  reshape_only = width * depth == row_size and bool(np.array_equal(position, slot))
  dense = np.full(rows * width * depth, total, np.int64)
  dense[position] = slot
  valid = np.zeros(total, bool)
  valid[slots] = True
  return Groups(num=int(starts.size), row=group_row, key=group_key % num_keys,
                 local=local, per_row=per_row, dense=dense.reshape(rows, width, depth),
                 first_slot=slot[starts], reshape_only=reshape_only, valid=valid)
