"""Module paths of what ``fit`` adds to the user's model: loss, optimizer, reductions.

The report groups costs by ``jax.named_scope`` path (``lowering/scopes.py``);
a Flax model's layers carry theirs (``MLP/hidden1``). What the Keras-like
training loop adds around the model opens its own scopes here, so that the
report says where those cycles go instead of "(no scope)":

* ``loss`` (and ``loss/grad`` for its backward pass, named by the lowering);
* ``metrics``;
* ``optimizer/<transform>``: one scope per transformation of an optax chain
  (``optimizer/scale_by_adam``, ``optimizer/scale_by_learning_rate``), and
  ``optimizer/apply_updates`` for adding the updates to the weights;
* ``gradient_accumulation`` and ``all_reduce`` (gradients over replicas).

How the optimizer's transformations are found: ``optax.chain`` keeps its
members' update functions in its closure (``update_fns``), each wrapped by
``optax.with_extra_args_support`` (whose closure holds the transformation,
``tx``). :func:`scoped_optimizer` calls the members in the chain's order,
each under a scope named after the function that built it (the first part of
its ``__qualname__``: ``scale_by_adam.<locals>.update_fn``). An optimizer of
any other shape is called as it is, under one scope named the same way.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import optax

__all__ = ["LOSS", "METRICS", "OPTIMIZER", "APPLY_UPDATES", "GRADIENT_ACCUMULATION",
           "ALL_REDUCE", "scope", "scoped_optimizer", "optimizer_in_scope", "transform_name"]

LOSS = "loss"
METRICS = "metrics"
OPTIMIZER = "optimizer"
APPLY_UPDATES = "apply_updates"
GRADIENT_ACCUMULATION = "gradient_accumulation"
ALL_REDUCE = "all_reduce"


def scope(name: str):
  """``jax.named_scope(name)``: what ``fit`` adds is costed under ``name``."""
  return jax.named_scope(name)


def _closure(fn: Callable) -> dict:
  code = getattr(fn, "__code__", None)
  cells = getattr(fn, "__closure__", None) or ()
  if code is None:
    return {}
  return dict(zip(code.co_freevars, (c.cell_contents for c in cells)))


def _unwrapped(update_fn: Callable) -> Callable:
  """The update function under ``optax.with_extra_args_support``'s wrapper."""
  while getattr(update_fn, "__qualname__", "").startswith("with_extra_args_support."):
    inner = _closure(update_fn).get("tx")
    if inner is None or not callable(getattr(inner, "update", None)):
      break
    update_fn = inner.update
  return update_fn


def transform_name(update_fn: Callable) -> str:
  """The name of the optax function that built ``update_fn`` (``scale_by_adam``)."""
  update_fn = _unwrapped(update_fn)
  qualname = getattr(update_fn, "__qualname__", None) or type(update_fn).__name__
  return qualname.split(".<locals>")[0].split(".")[0] or OPTIMIZER


def _chain_members(update_fn: Callable) -> Optional[tuple]:
  """The member update functions of an ``optax.chain``, or None."""
  if not getattr(update_fn, "__qualname__", "").startswith("chain.<locals>."):
    return None
  members = _closure(update_fn).get("update_fns")
  if not isinstance(members, tuple) or not all(callable(m) for m in members):
    return None
  return members


def _scoped_update(update_fn: Callable) -> Callable:
  members = _chain_members(_unwrapped(update_fn))
  if members is None:
    name = transform_name(update_fn)

    def update(updates, state, params=None, **extra_args):
      with jax.named_scope(name):
        return update_fn(updates, state, params, **extra_args)
    return _named_like(update, update_fn)

  scoped = [_scoped_update(m) for m in members]

  def chained(updates, state, params=None, **extra_args):
    if not isinstance(state, tuple) or len(state) != len(scoped):
      return update_fn(updates, state, params, **extra_args)  # optax says what is wrong
    # optax.chain's own loop: each member's state, in order.
    new_state = []
    for member_state, member in zip(state, scoped):
      updates, member_state = member(updates, member_state, params, **extra_args)
      new_state.append(member_state)
    return updates, tuple(new_state)
  return _named_like(chained, update_fn)


def _named_like(wrapper: Callable, update_fn: Callable) -> Callable:
  """``wrapper`` named as the transformation it wraps, so errors about the
  optimizer (e.g. one sharding cannot run) name the user's, not this module's."""
  inner = _unwrapped(update_fn)
  for attribute in ("__name__", "__qualname__", "__module__"):
    if hasattr(inner, attribute):
      setattr(wrapper, attribute, getattr(inner, attribute))
  return wrapper


def scoped_optimizer(optimizer) -> optax.GradientTransformationExtraArgs:
  """``optimizer`` whose update costs each transformation under its own scope.

  The same numbers as ``optimizer``: the chain's members are called in order
  with their own states, and ``init`` is the optimizer's.
  """
  return optax.GradientTransformationExtraArgs(optimizer.init, _scoped_update(optimizer.update))


def optimizer_in_scope(optimizer) -> optax.GradientTransformationExtraArgs:
  """:func:`scoped_optimizer` whose update also opens the ``optimizer`` scope.

  For a caller that hands the optimizer on rather than calling it (the
  pipelined ``fit`` gives it to each stage's update program): its costs read
  ``optimizer/<transform>`` as plain ``fit``'s do.
  """
  scoped = scoped_optimizer(optimizer)

  def update(updates, state, params=None, **extra_args):
    with jax.named_scope(OPTIMIZER):
      return scoped.update(updates, state, params, **extra_args)
  return optax.GradientTransformationExtraArgs(optimizer.init,
                                               _named_like(update, optimizer.update))
