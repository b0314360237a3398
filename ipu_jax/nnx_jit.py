"""``ipu_jax.nnx_jit``: the emulated-IPU form of ``flax.nnx.jit``.

A Flax NNX training step updates its arguments in place::

    @ipu_jax.nnx_jit                      # was: @nnx.jit
    def train_step(model, optimizer, batch):
      loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      optimizer.update(model, grads)      # mutates model and optimizer
      return loss

A tile program is a pure function of arrays, so (as ``nnx.jit`` does) the
graph nodes among the arguments (modules, optimizers, metrics, ``Rngs``) are
split into a graph definition and their state, the state goes through the tile
program as ordinary arguments, the function runs on modules merged back from
it inside the trace, and their new state comes out as extra results and is
written back into the caller's objects. Plain ``ipu_jax.jit`` flattens a
module into leaves and cannot write back; :func:`reject_graph_nodes` is the
check that says so instead of dropping the update.

What cannot be carried back raises ``TypeError`` while tracing, before any
tile program runs: a function that changes a module's structure (adds or
removes variables or submodules) or returns a graph node.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from ipu_jax.jit import Lowered, jit as ipu_jit
from ipu_jax.nnx_scopes import module_scopes

__all__ = ["nnx_jit", "NNXFunction", "has_graph_nodes", "reject_graph_nodes"]


def _is_graph_node(value) -> bool:
  from flax import nnx
  return nnx.graph.is_graph_node(value)


def _is_stateful_object(value) -> bool:
  """A module or optimizer (whose updates go in place), not a lone Variable.

  A Variable passed in a state pytree is data: its value is an input and any
  new value comes back as an output, so plain ``ipu_jax.jit`` handles it.
  """
  from flax import nnx
  return _is_graph_node(value) and not isinstance(value, nnx.Variable)


def _graph_node_paths(tree, predicate=_is_graph_node) -> list:
  """Pytree paths of the graph nodes in ``tree`` (not descending into them)."""
  if "flax" not in __import__("sys").modules:
    return []  # no NNX object can exist without Flax imported
  with_paths, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=predicate)
  return [jax.tree_util.keystr(path) for path, leaf in with_paths if predicate(leaf)]


def has_graph_nodes(args: Sequence) -> bool:
  """Whether any argument holds a Flax NNX graph node (module, optimizer...)."""
  return bool(_graph_node_paths(tuple(args)))


# Argument tree structures already checked to hold no graph node, when every
# leaf is an array: a structure records the type of each of its nodes, so an
# equal structure with array leaves holds no graph node either.
_CHECKED_TREES: set = set()
_CHECKED_TREES_LIMIT = 256
_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic)


def reject_graph_nodes(args: Sequence, fn_name: str = "fn", flat=None) -> None:
  """Refuses NNX objects in a plain ``ipu_jax.jit`` call.

  ``ipu_jax.jit`` sees a module's variables as input arrays only; an update
  the function makes in place would be lost. The hook for
  ``IPUFunction.__call__``, which passes its own flattening of the same
  values as ``flat`` (``(leaves, treedef)``) so they are not flattened twice.

  Raises:
    TypeError: naming the arguments that are graph nodes.
  """
  # A step called in a loop passes the same structure every time: checking
  # its leaves' types is ~20x cheaper than asking Flax about every node.
  leaves, treedef = flat if flat is not None else jax.tree_util.tree_flatten(tuple(args))
  arrays = all(isinstance(leaf, _ARRAY_LEAVES) for leaf in leaves)
  if arrays and treedef in _CHECKED_TREES:
    return
  paths = _graph_node_paths(tuple(args), _is_stateful_object)
  if not paths and arrays and len(_CHECKED_TREES) < _CHECKED_TREES_LIMIT:
    _CHECKED_TREES.add(treedef)
  if paths:
    where = ", ".join(f"args{p}" for p in paths)
    raise TypeError(
        f"ipu_jax.jit({fn_name}) got Flax NNX objects ({where}); plain ipu_jax.jit "
        "cannot write in-place updates of a module or optimizer back. Use "
        "@ipu_jax.nnx_jit (the ipu-jax form of @nnx.jit) instead.")


def _nested(pairs) -> dict:
  """A nested dict of ``(path, value)`` pairs: ``{0: {"l1": {"kernel": value}}}``.

  The variables' values travel through the tile program in it: a dict
  flattens in JAX's C++ (an ``nnx.State`` calls back into Python at every
  node), and its paths name the program's inputs as the state's would
  (``state/0/l1/kernel`` in the report).
  """
  tree: dict = {}
  for path, value in pairs:
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def _at(tree: dict, path: tuple):
  """The value at ``path`` of a :func:`_nested` dict."""
  for key in path:
    tree = tree[key]
  return tree


@dataclasses.dataclass(frozen=True)
class _SplitCall:
  """One call's arguments split for the tile program.

  Attributes:
    treedef: the ``(args, kwargs)`` tree, graph nodes as leaves.
    node_positions: the leaves that are graph nodes (modules, optimizers...).
    graphdef: their graph definition (structure, variable types, metadata).
    variables: ``(path, Variable)`` of each of their variables, shared ones once.
    state: the variables' values, :func:`_nested` by path.
    others: the leaves that are not graph nodes.
  """

  treedef: Any
  node_positions: tuple
  graphdef: Any
  variables: tuple
  state: dict
  others: list


def _split_call(args, kwargs) -> _SplitCall:
  """:class:`_SplitCall` of a call: the graph nodes flattened once, as ``nnx.split`` would."""
  from flax import nnx
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_is_graph_node)
  positions = tuple(i for i, leaf in enumerate(leaves) if _is_graph_node(leaf))
  nodes = tuple(leaves[i] for i in positions)
  others = [leaf for i, leaf in enumerate(leaves) if i not in positions]
  graphdef, flat = nnx.graph.flatten(nodes, with_paths=True)
  variables = tuple(flat)
  state = _nested((path, variable.get_raw_value()) for path, variable in variables)
  return _SplitCall(treedef, positions, graphdef, variables, state, others)


class NNXFunction:
  """The callable :func:`nnx_jit` returns.

  Attributes:
    fn: the user's function.
  """

  def __init__(self, fn: Callable, **jit_kwargs):
    self.fn = fn
    self._jit_kwargs = jit_kwargs
    self._functions: dict = {}
    functools.update_wrapper(self, fn)

  def _ipu_function(self, split: _SplitCall):
    key = (split.treedef, split.node_positions, split.graphdef)
    function = self._functions.get(key)
    if function is None:
      function = ipu_jit(_pure_function(self.fn, *key), **self._jit_kwargs)
      self._functions[key] = function
    return function

  def lower(self, *args, **kwargs) -> Lowered:
    """The :class:`ipu_jax.Lowered` program (and its ``.report``) for these arguments."""
    split = _split_call(args, kwargs)
    return self._ipu_function(split).lower(split.state, split.others)

  def __call__(self, *args, **kwargs):
    from flax import nnx
    split = _split_call(args, kwargs)
    out, new_state = self._ipu_function(split)(split.state, split.others)
    # Variable by variable (nnx.update's own rule for one), not the whole
    # graph walked again: a step's write-back was a quarter of its call.
    for path, variable in split.variables:
      nnx.update(variable, _at(new_state, path))
    return out


def _pure_function(fn: Callable, treedef, node_positions: tuple, graphdef) -> Callable:
  """``pure(state, others) -> (out, new state)``: ``fn`` on modules merged from ``state``.

  Raises (while tracing) ``TypeError`` when ``fn`` returns a graph node or
  changes its arguments' graph (variables or submodules added or removed,
  a variable's metadata changed): only values come back.
  """
  from flax import nnx
  name = getattr(fn, "__name__", "fn")

  def pure(state, others):
    nodes = nnx.merge(graphdef, state)
    positions = set(node_positions)
    node_it, other_it = iter(nodes), iter(others)
    leaves = [next(node_it) if i in positions else next(other_it)
              for i in range(treedef.num_leaves)]
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    with module_scopes(*nodes):  # reports name operations by module path
      out = fn(*args, **kwargs)
    returned = _graph_node_paths(out)
    if returned:
      raise TypeError(
          f"ipu_jax.nnx_jit({name}) returned Flax NNX objects (result{returned[0]}); "
          "a tile program returns arrays only. Update the module in place, or "
          "return nnx.state(module).")
    new_graphdef, flat = nnx.graph.flatten(nodes, with_paths=True)
    if new_graphdef != graphdef:
      raise TypeError(
          f"ipu_jax.nnx_jit({name}) changed the structure of its NNX arguments "
          "(added or removed variables or submodules, or changed their metadata); only "
          "their values can be carried back from the IPU. Create variables before the step.")
    return out, _nested((path, variable.get_raw_value()) for path, variable in flat)

  pure.__name__ = name
  return pure


def nnx_jit(fn: Optional[Callable] = None, *, target=None, config=None) -> Any:
  """Compile an NNX function for the emulated IPU, carrying in-place updates back.

  The drop-in replacement of ``@nnx.jit``: modules, optimizers, metrics and
  ``Rngs`` among the arguments (at any depth of the argument pytrees) are
  split into state, run through the tile program and updated in place
  afterwards, exactly as ``nnx.jit`` does for XLA.

  Args:
    fn: the function; positional and keyword arguments may be pytrees of
      arrays and NNX objects.
    target: the :class:`ipu_jax.IPUTarget` (default: the config's).
    config: an :class:`ipu_jax.IPUConfig` (default: the strategy scope's).

  Returns:
    An :class:`NNXFunction`; ``.lower(*args)`` gives the program and report.

  Raises:
    TypeError: (when called) the function changes the structure of a module
      or returns an NNX object; neither can be carried back.
  """
  if fn is None:
    return functools.partial(nnx_jit, target=target, config=config)
  return NNXFunction(fn, target=target, config=config)
