"""Name stacks for Flax NNX modules: ``Encoder/layers_1/attention/dot_general``.

Flax linen runs every module method under ``jax.named_scope`` (so equations
carry ``Model/Dense_0`` in ``eqn.source_info.name_stack``); Flax NNX does not,
so a report of an NNX model could name operations only by primitive. Inside
:func:`module_scopes`, calling a module (or any of its submodules) opens a
``jax.named_scope`` named after the module's attribute path, so every
equation it traces carries the module path, as with linen.

How: each module object of the graph is given, for the duration of the
``with`` block only, a subclass of its own class whose ``__call__`` opens the
scope (Python looks ``__call__`` up on the type, so an instance attribute
would not do). The original classes are restored on exit, before anyone
splits the modules into a graph definition again.
"""

from __future__ import annotations

import contextlib
import functools

import jax

__all__ = ["module_scopes"]

_SCOPED_CLASSES: dict = {}


def _scoped_class(cls):
  scoped = _SCOPED_CLASSES.get(cls)
  if scoped is None:
    def __call__(self, *args, **kwargs):
      with jax.named_scope(self.__dict__.get("_ipu_jax_scope", cls.__name__)):
        return cls.__call__(self, *args, **kwargs)

    scoped = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                         "__qualname__": cls.__qualname__})
    _SCOPED_CLASSES[cls] = scoped
  return scoped


def _defines_call(cls) -> bool:
  return any("__call__" in vars(k) for k in cls.__mro__ if k is not object)


def _scope_names(root) -> dict:
  """``{id(module): (module, name)}``: a module's path below its nearest module parent."""
  from flax import nnx
  modules = {}
  for path, node in nnx.iter_graph(root):
    # Only modules that define __call__ (containers such as nnx.List do not).
    if isinstance(node, nnx.Module) and _defines_call(type(node)):
      modules.setdefault(tuple(path), node)
  names = {}
  for path, node in modules.items():
    if not path:
      name = type(node).__name__
    else:
      # A module under no calling module (the root a container) is named by its whole path.
      parent = max((p for p in modules if len(p) < len(path) and path[:len(p)] == p), key=len,
                   default=())
      name = "_".join(str(k) for k in path[len(parent):])
    names.setdefault(id(node), (node, name))
  return names


@contextlib.contextmanager
def module_scopes(*roots):
  """Calls of the NNX modules in ``roots`` (and their submodules) open named scopes.

  Args:
    *roots: NNX modules (other values are ignored).
  """
  from flax import nnx
  swapped = []
  try:
    for root in roots:
      if not isinstance(root, nnx.Module):
        continue
      for node, name in _scope_names(root).values():
        cls = type(node)
        if cls in _SCOPED_CLASSES.values():
          continue  # already scoped by an enclosing block
        object.__setattr__(node, "__class__", _scoped_class(cls))
        node.__dict__["_ipu_jax_scope"] = name
        swapped.append((node, cls))
    yield
  finally:
    for node, cls in reversed(swapped):
      object.__setattr__(node, "__class__", cls)
      node.__dict__.pop("_ipu_jax_scope", None)
