"""Why a jitted function compiles again in a running process.

TF-IPU's documentation asks users to watch for recompilation: each new
argument shape, dtype or static value is a new program, lowered and compiled
from scratch. :func:`reason` names what changed between the program compiled
last and the one asked for now; ``ipu_jax.jit`` logs it (logger
``ipu_jax.jit``, level INFO) and the report's "Host side" section shows it
as "Compiled because".
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["CacheKey", "reason"]


@dataclasses.dataclass(frozen=True)
class CacheKey:
  """What ``IPUFunction`` keys its compiled programs by (all hashable)."""

  in_tree: object
  avals: tuple
  static: tuple
  target: object
  options: object
  replicas: int
  bound_axes: object
  offload: object


def _describe_aval(aval) -> str:
  shape, dtype, weak = aval
  return f"{dtype}[{','.join(map(str, shape))}]" + (" (weak)" if weak else "")


def reason(previous: CacheKey, new: CacheKey, names: Sequence[str]) -> str:
  """What differs between ``previous`` and ``new``, for a person to read.

  Args:
    previous: the key of the program compiled last.
    new: the key now asked for (not in the cache).
    names: the argument names of ``new``'s leaves (``args[0]['w']``).
  """
  if previous.in_tree != new.in_tree:
    return "the arguments' tree structure changed"
  changes = [f"{name}: {_describe_aval(a)} -> {_describe_aval(b)}"
             for name, a, b in zip(names, previous.avals, new.avals) if a != b]
  if changes:
    return "new argument shape/dtype: " + "; ".join(changes[:3]) + (
        f" (and {len(changes) - 3} more)" if len(changes) > 3 else "")
  if previous.static != new.static:
    old = {key: value for key, _, value in previous.static}
    diffs = [f"{key!r}: {old.get(key)!r} -> {value!r}" for key, _, value in new.static
             if key not in old or old[key] != value]
    return "new static value: " + ("; ".join(diffs) or "a static argument was dropped")
  for field, what in (("target", "the target"), ("options", "the config's lowering options"),
                      ("replicas", "the replication factor"),
                      ("bound_axes", "the replica axes bound around the call"),
                      ("offload", "which leaves are offloaded")):
    if getattr(previous, field) != getattr(new, field):
      return f"{what} changed"
  return "a new program"
