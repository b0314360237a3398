"""Pure-function views of Flax modules (NNX and linen) for the training loop.

An adapter holds a module's initial variables, split into

* ``params``: what the optimizer trains (``nnx.Param`` / linen ``"params"``),
* ``state``: other variables the module updates (batch statistics, ...),
* ``rng_state``: NNX random streams (keys and counters),

and a pure ``apply(params, state, rng_state, x, training, rng)`` giving
``(y, new_state)``, traceable by ``jax.make_jaxpr`` and so by ``ipu_jax.jit``.
Random numbers (dropout) come from ``rng = (base_key, counters)``: the
training loop passes the micro-batch step counter and the replica index as
counters, folded into the module's stream keys (NNX) or into ``base_key``
(linen), so every step and replica draws
new masks and a resumed run draws the same ones again.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import jax
import jax.numpy as jnp

from ipu_jax.keras.weights import is_key
from ipu_jax.nnx_scopes import module_scopes

__all__ = ["make_adapter", "NNXAdapter", "LinenAdapter", "flatten_paths"]


def _fold(key, counters):
  for counter in counters:
    key = jax.random.fold_in(key, counter)
  return key


def flatten_paths(tree) -> list:
  """``[(path string, leaf)]`` of a pytree, for summaries."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  for path, leaf in leaves:
    parts = []
    for k in path:
      if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
        continue  # the array inside an nnx.Variable
      name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
      parts.append(str(name))
    out.append(("/".join(parts), leaf))
  return out


class NNXAdapter:
  """A ``flax.nnx.Module``; trains a functional copy and writes back."""

  kind = "nnx"

  def __init__(self, module):
    from flax import nnx
    self._nnx = nnx
    self.module = module
    graphdef, params, rng_state, state = nnx.split(module, nnx.Param, nnx.RngState, ...)
    self.params, self.rng_state, self.state = params, rng_state, state
    train_copy, eval_copy = nnx.clone(module), nnx.clone(module)
    for copy, method in ((train_copy, "train"), (eval_copy, "eval")):
      if hasattr(copy, method):
        getattr(copy, method)()
    self._graphdef = {True: nnx.graphdef(train_copy), False: nnx.graphdef(eval_copy)}
    self.needs_rng = bool(jax.tree.leaves(rng_state))
    self.name = type(module).__name__

  def apply(self, params, state, rng_state, x, training: bool, rng=None):
    nnx = self._nnx
    if rng is not None and self.needs_rng:
      _, counters = rng
      rng_state = jax.tree.map(
          lambda leaf: _fold(leaf, counters) if is_key(leaf) else leaf, rng_state)
    # Fresh Variable objects, owned by the current trace (merge reuses them and
    # the module mutates them, e.g. batch statistics).
    params, state, rng_state = jax.tree.map(lambda v: v, (params, state, rng_state))
    module = nnx.merge(self._graphdef[bool(training)], params, rng_state, state)
    with module_scopes(module):  # reports name operations by module path
      y = module(x)
    _, _, _, new_state = nnx.split(module, nnx.Param, nnx.RngState, ...)
    return y, new_state

  def to_pure(self, tree):
    return self._nnx.to_pure_dict(tree) if isinstance(tree, self._nnx.State) else tree

  def from_pure(self, template, pure):
    nnx = self._nnx
    copy = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(copy, pure)
    return copy

  def sync(self, params, state, rng_state):
    """Writes trained variables back into the user's module."""
    self._nnx.update(self.module, params, state)


class LinenAdapter:
  """A ``flax.linen.Module``, initialised from a sample input.

  Args:
    module: the linen module.
    sample_input: an example input (a batch) used by ``module.init``.
    key: the initialisation key.
    train_kwargs / eval_kwargs: keyword arguments of ``__call__`` in training
      and inference; by default a ``train``, ``training`` or
      ``deterministic`` argument of ``__call__`` is set accordingly.
    init_kwargs: keyword arguments for ``module.init`` (default: the eval ones).
    rng_collections: random streams the module draws from in training.
  """

  kind = "linen"

  def __init__(self, module, sample_input, key, train_kwargs=None, eval_kwargs=None,
               init_kwargs=None, rng_collections: Sequence[str] = ("dropout",)):
    self.module = module
    auto_train, auto_eval = self._flag_kwargs(module)
    self.train_kwargs = dict(auto_train if train_kwargs is None else train_kwargs)
    self.eval_kwargs = dict(auto_eval if eval_kwargs is None else eval_kwargs)
    self.rng_collections = tuple(rng_collections)
    init_kwargs = dict(self.eval_kwargs if init_kwargs is None else init_kwargs)
    keys = jax.random.split(key, 1 + len(self.rng_collections))
    rngs = {"params": keys[0]}
    rngs.update({c: k for c, k in zip(self.rng_collections, keys[1:])})
    variables = module.init(rngs, sample_input, **init_kwargs)
    variables = dict(variables)
    self.params = variables.pop("params", {})
    self.state = variables
    self.rng_state = {}
    self.name = type(module).__name__
    self.needs_rng = self._probe_rng(sample_input)

  @staticmethod
  def _flag_kwargs(module):
    try:
      names = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
      return {}, {}
    for name in ("train", "training", "is_training"):
      if name in names:
        return {name: True}, {name: False}
    if "deterministic" in names:
      return {"deterministic": False}, {"deterministic": True}
    return {}, {}

  def _probe_rng(self, sample_input) -> bool:
    import flax.errors
    try:
      jax.eval_shape(lambda p, s, x: self.apply(p, s, {}, x, True, None),
                     self.params, self.state, sample_input)
    except flax.errors.InvalidRngError:
      return True
    return False

  def apply(self, params, state, rng_state, x, training: bool, rng=None):
    variables = {"params": params, **state}
    kwargs = self.train_kwargs if training else self.eval_kwargs
    rngs = None
    if rng is not None and training and self.rng_collections:
      base, counters = rng
      keys = jax.random.split(_fold(base, counters), len(self.rng_collections))
      rngs = {c: k for c, k in zip(self.rng_collections, keys)}
    if training and state:
      y, new_state = self.module.apply(variables, x, rngs=rngs, mutable=list(state),
                                       **kwargs)
      return y, dict(new_state)
    y = self.module.apply(variables, x, rngs=rngs, **kwargs)
    return y, state

  def to_pure(self, tree):
    return jax.tree.map(lambda x: x, dict(tree)) if isinstance(tree, dict) else tree

  def from_pure(self, template, pure):
    import flax.serialization
    return flax.serialization.from_state_dict(template, pure)

  def sync(self, params, state, rng_state):
    pass  # linen modules hold no variables


def make_adapter(module, *, sample_input=None, input_shape=None, input_dtype=jnp.float32,
                 key=None, train_kwargs=None, eval_kwargs=None, init_kwargs=None,
                 rng_collections=("dropout",)):
  """The adapter for an NNX or linen module.

  Raises:
    ValueError: a linen module without ``sample_input`` or ``input_shape``.
    TypeError: neither an NNX nor a linen module.
  """
  from flax import linen, nnx
  if isinstance(module, nnx.Module):
    return NNXAdapter(module)
  if isinstance(module, linen.Module):
    if sample_input is None:
      if input_shape is None:
        raise ValueError(
            f"A linen module ({type(module).__name__}) has no variables until it "
            "is initialised: pass sample_input=<an example batch> or "
            "input_shape=(batch, ...) to ipu_jax.keras.Model.")
      sample_input = jnp.zeros(tuple(input_shape), input_dtype)
    if key is None:
      key = jax.random.key(0)
    return LinenAdapter(module, sample_input, key, train_kwargs, eval_kwargs,
                        init_kwargs, rng_collections)
  raise TypeError(f"ipu_jax.keras.Model wraps a flax.nnx.Module or a "
                  f"flax.linen.Module; got {type(module).__name__}.")
