"""Names of a lowered program's arguments in the user's words: ``params/hidden1/kernel``.

A program's arguments are the leaves of the pytrees it was called with. Each
leaf is named by its pytree path, rendered the way a user reads a model's
parameters: the function's parameter name (``params``; ``args[i]`` when the
signature does not say), then every key of the path joined by ``/``.

Two kinds of key carry no information for a reader and are dropped:

* a trailing ``.value``: Flax NNX variables flatten to their ``value``
  (``hidden1/kernel/value`` is the kernel);
* an index into a tuple or list, where the leaf's name stays its own without
  it: optax states are tuples of the chained transforms' states, so Adam's
  first moment is ``opt_state/mu/hidden1/kernel`` rather than
  ``opt_state/0/mu/hidden1/kernel``. Leaves that would share a name (two
  transforms with a ``mu``, ``layers/0/kernel`` and ``layers/1/kernel``) keep
  their indices.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

from jax import tree_util

__all__ = ["argument_names"]


def _key_text(key) -> Optional[str]:
  """A path key as text; None for a sequence index (dropped where unambiguous)."""
  if isinstance(key, tree_util.SequenceKey):
    return None
  if isinstance(key, tree_util.DictKey):
    return str(key.key)
  if isinstance(key, tree_util.GetAttrKey):
    return key.name
  if isinstance(key, tree_util.FlattenedIndexKey):
    return str(key.key)
  return tree_util.keystr((key,)).strip("[].'\"")


def _parts(path, keep_indices: bool) -> list:
  parts = []
  for key in path:
    text = _key_text(key)
    if text is None:
      if keep_indices:
        parts.append(str(key.idx))
    else:
      parts.append(text)
  if len(parts) > 1 and isinstance(path[-1], tree_util.GetAttrKey) and parts[-1] == "value":
    parts.pop()  # an NNX variable's value is the variable
  return parts


def _root(first, second, positional: Sequence[Optional[str]]) -> str:
  """The argument's name: its parameter's (``args[i]`` if unknown) or its keyword."""
  if getattr(first, "idx", 0) == 0:  # (args, kwargs)[0]: a positional argument
    index = second.idx
    name = positional[index] if index < len(positional) else None
    return name or f"args[{index}]"
  return str(second.key)


def argument_names(paths: Sequence[tuple],
                   positional: Sequence[Optional[str]] = ()) -> list:
  """The names of a program's argument leaves.

  Args:
    paths: each leaf's pytree path into ``(args, kwargs)`` (as
      ``jax.tree_util.tree_flatten_with_path`` gives it).
    positional: the parameter name of each positional argument (``None``
      where unknown).

  Returns:
    One name per path, all distinct when the paths are.
  """
  roots = [_root(path[0], path[1], positional) for path in paths]
  full = ["/".join([root] + _parts(path[2:], True)) for root, path in zip(roots, paths)]
  short = ["/".join([root] + _parts(path[2:], False)) for root, path in zip(roots, paths)]
  counts = collections.Counter(short)
  # Each leaf drops its indices unless another leaf would then share its name.
  names = [s if counts[s] == 1 else f for s, f in zip(short, full)]
  return names if len(set(names)) == len(names) else full
