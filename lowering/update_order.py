"""A weight update's equations in the order the IPU frameworks schedule them.

optax writes an update operation by operation over the whole tree
(``tree_map``: every leaf's first moment, then every leaf's second moment,
then every leaf's bias correction ...), so a jaxpr traced from it holds every
leaf's state and float32 temporaries live at once. The IPU toolchains order
the same graph to keep liveness low: TensorFlow-IPU's default
``IPUConfig.scheduling.algorithm`` (``CHOOSE_BEST``) builds several schedules
(look-ahead, clustering, post-order, shortest path) and keeps the one of
lowest predicted liveness (``tensorflow/python/ipu/config.py``); PopART
schedules its IR with poprithms' shift scheduler (``willow/src/scheduler.cpp``),
which minimises sum-liveness (``willow/src/transforms/decomposesum.cpp``),
keeps each weight's ``VarUpdateOp`` apart by default
(``MergeVarUpdateType::None``) and, with optimizer state streamed on demand,
schedules its remote loads with the optimizer ops and remote stores
(``willow/src/transforms/streamingmemoryopinserter.cpp``).
An update's per-weight chains are independent, so such schedules run (and
stream offloaded state for) one weight at a time.

:func:`chain_order` reorders a closed jaxpr that way: equations are grouped
by the connected components of the dataflow graph once the *shared* values
are cut out (small values, scalars by default, computed from nothing but the
jaxpr's small inputs: a step count, a learning rate, a bias correction that
every chain reads). The shared equations come first, then each component's
equations contiguously, in their original relative order, components in the
order of their first equation. A value that genuinely couples the chains (a
global-norm clip's norm) joins them into one component, which keeps its
traced order. Nested jaxprs (``pjit``, loops, custom derivatives) stay single
equations. Only the order changes: every equation computes what it did, so
numbers are bit-identical. Linear in equations and operands (a union-find).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from jax.extend import core as jex_core

__all__ = ["SHARED_MAX_ELEMENTS", "chain_order", "chain_order_eqns", "in_chain_order"]

# Values of at most this many elements may be shared by every chain without
# joining them: scalars (step counts, learning rates, bias corrections).
SHARED_MAX_ELEMENTS = 1


def _is_small(var, max_elements: int) -> bool:
  shape = getattr(var.aval, "shape", None)
  return shape is not None and int(np.prod(shape, dtype=np.int64)) <= max_elements


class _UnionFind:
  """Disjoint sets of equation indices (path halving, union by index)."""

  def __init__(self, n: int):
    self.parent = list(range(n))

  def find(self, i: int) -> int:
    parent = self.parent
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  def union(self, i: int, j: int) -> None:
    a, b = self.find(i), self.find(j)
    if a != b:  # the earlier equation stays the root: roots order components
      self.parent[max(a, b)] = min(a, b)


def _shared_equations(eqns, invars, max_elements: int) -> list:
  """Whether each equation is shared: small outputs from small, shared inputs only."""
  shared_vars = {v for v in invars if _is_small(v, max_elements)}
  shared = []
  for eqn in eqns:
    is_shared = (not eqn.effects
                 and all(_is_small(v, max_elements) for v in eqn.outvars)
                 and all(isinstance(v, jex_core.Literal) or v in shared_vars
                         for v in eqn.invars))
    if is_shared:
      shared_vars.update(eqn.outvars)
    shared.append(is_shared)
  return shared


def chain_order_eqns(eqns, invars, constvars=(),
                     max_shared_elements: int = SHARED_MAX_ELEMENTS) -> list:
  """``eqns`` grouped by independent chain (see the module docstring).

  Args:
    eqns: a jaxpr's equations, in a valid (topological) order.
    invars, constvars: the jaxpr's inputs; small ones (at most
      ``max_shared_elements`` elements) may be shared by every chain.
    max_shared_elements: the size up to which a value computed only from
      small inputs is shared rather than joining the chains reading it.

  Returns:
    The same equation objects, shared ones first, then chain by chain.
  """
  del constvars  # produced by no equation: they join nothing
  shared = _shared_equations(eqns, invars, max_shared_elements)
  producer = {}
  sets = _UnionFind(len(eqns))
  last_effect = None
  for i, eqn in enumerate(eqns):
    if not shared[i]:
      for v in eqn.invars:
        j = producer.get(v) if not isinstance(v, jex_core.Literal) else None
        if j is not None and not shared[j]:
          sets.union(i, j)
      if eqn.effects:  # effects keep their order: one component holds them all
        if last_effect is not None:
          sets.union(i, last_effect)
        last_effect = i
    for v in eqn.outvars:
      producer[v] = i
  roots = np.array([sets.find(i) for i in range(len(eqns))], np.int64)
  roots[np.asarray(shared, bool)] = -1  # shared equations sort first
  # A stable sort by root keeps each component's (and the shared) original order.
  order = np.argsort(roots, kind="stable")
  return [eqns[i] for i in order]


def chain_order(closed, max_shared_elements: int = SHARED_MAX_ELEMENTS):
  """``closed`` (a ``ClosedJaxpr``) with its equations grouped by independent chain."""
  jaxpr = closed.jaxpr
  eqns = chain_order_eqns(jaxpr.eqns, jaxpr.invars, jaxpr.constvars, max_shared_elements)
  return jex_core.ClosedJaxpr(jaxpr.replace(eqns=eqns), closed.consts)


def in_chain_order(fn: Callable) -> Callable:
  """``fn`` traced, reordered by :func:`chain_order`, and evaluated in that order.

  Called inside a trace (``ipu_jax.jit``), the outer trace records ``fn``'s
  equations chain by chain; the outputs are ``fn``'s, bit for bit. The
  wrapper keeps ``fn``'s signature (``functools.wraps``), so a program lowered
  from it names its arguments as ``fn``'s (``state``, ``grads`` ...).
  """

  @functools.wraps(fn)
  def ordered(*args, **kwargs):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    closed = chain_order(closed)
    flat = jex_core.jaxpr_as_fun(closed)(*jax.tree_util.tree_leaves((args, kwargs)))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), flat)

  return ordered
