"""What a fused compute set is made of once its members are chosen.

``lowering/fusion.py`` groups chains of elementwise steps on one layout;
these build the one superstep that replaces a group: its functions (the
members run in order on tile storage, :func:`fused_fn`, or on logical
arrays, :func:`fused_logical`, intermediates living only inside the step),
its figures (per-tile rows of the members reduced together,
:func:`fold_rows`: the sequential cycles less the per-compute-set overheads
saved, :func:`chain_cycles`, the most vertices, the exchanges added,
:func:`sum_costs`), the members as kept in ``Superstep.fused_ops``
(:func:`without_figures`) and the group's module path
(:func:`common_scope`). Pricing the chain as one map expression or a
ScaledAdd-family vertex is ``lowering/fused_cost.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import ExchangeCost

__all__ = ["chain_cycles", "common_scope", "fold_rows", "fused_fn", "fused_logical", "sum_costs",
           "without_figures"]


def without_figures(step: P.Superstep) -> P.Superstep:
  """``step`` as a fused member keeps it: what runs, not what it costs.

  The executor runs members one by one (to name an op that traps a
  floating-point exception) or by their logical forms; the fused step holds
  the figures. Members keeping their per-tile arrays held a gigabyte at
  BERT size.
  """
  return dataclasses.replace(step, compute_cycles=None, exchange=None, vertices=None,
                             scratch_bytes=None, elementwise=None)


def fold_rows(rows, combine, dtype=None) -> np.ndarray:
  """``combine`` folded over ``[num_tiles]`` rows in their order, into a new array.

  The values and dtype of reducing the rows stacked along a middle axis
  (``stacked.sum(axis=1)`` for ``np.add``, ``.max`` for ``np.maximum``):
  such a reduction combines the rows one after another too. Sums accumulate
  in at least the platform integer, as ``ndarray.sum`` does.
  """
  if dtype is None:
    dtype = np.result_type(*rows)
    if combine is np.add and np.issubdtype(dtype, np.integer):
      dtype = np.add.reduce(np.zeros((1,), dtype)).dtype
  out = np.array(rows[0], dtype)
  for row in rows[1:]:
    combine(out, row, out=out)
  return out


def chain_cycles(rows, overhead) -> np.ndarray:
  """Per tile, the cycles of a group's members run one after another in one step.

  Each member after the first on a tile no longer pays a compute set's
  launch and vertex overheads; a tile never takes less than its longest
  member. Computed in float64 from the members' rows in order.
  """
  total = fold_rows(rows, np.add, np.float64)
  longest = fold_rows(rows, np.maximum, np.float64)
  busy = fold_rows([row > 0 for row in rows], np.add, np.intp)
  saved = np.maximum(busy - 1, 0) * overhead
  return np.maximum(total - saved, longest)


def sum_costs(costs) -> Optional[ExchangeCost]:
  """The sum of a group's exchange costs (None for none)."""
  if not costs:
    return None
  shared = [c.bus_shared_in for c in costs if c.bus_shared_in is not None]
  return ExchangeCost(*(fold_rows([getattr(c, field) for c in costs], np.add)
                        for field in ("bytes_in", "bytes_out", "link_bytes_out")),
                      bus_shared_in=fold_rows(shared, np.add) if shared else None)


def fused_fn(steps, reads, writes):
  """The fused step's function: its members' functions in order, on storages.

  Each member's results are cast to their tensors' dtypes, as the executor
  stores every step's results, so the numbers are those of the separate
  steps bit for bit.
  """
  read_ids = tuple(t.id for t in reads)
  plan = tuple((s.fn, tuple(t.id for t in s.reads), tuple((t.id, t.dtype) for t in s.writes))
               for s in steps)
  write_ids = tuple(t.id for t in writes)

  def fn(*storages):
    env = dict(zip(read_ids, storages))
    for step_fn, ins, outs in plan:
      values = step_fn(*[env[i] for i in ins])
      for (i, dtype), v in zip(outs, values):
        env[i] = v.astype(dtype)
    return tuple(env[i] for i in write_ids)

  return fn


def fused_logical(steps, reads, writes):
  """The fused step's logical form: its members' forms in order, or None
  when one has none (the executor then runs each member by its own form).

  Each member's results are cast to their tensors' dtypes and shapes, as the
  executor stores every step's results.
  """
  forms = [s.logical for s in steps]
  if not all(forms):
    return None
  plan = tuple((form, tuple((t.id, t.shape) for t in s.reads),
                tuple((t.id, t.dtype, t.shape) for t in s.writes))
               for form, s in zip(forms, steps))
  read_ids = tuple(t.id for t in reads)
  write_ids = tuple(t.id for t in writes)

  def form(*arrays):
    env = dict(zip(read_ids, arrays))
    for member_form, ins, outs in plan:
      values = member_form(*[env[i].reshape(shape) for i, shape in ins])
      for (i, dtype, shape), v in zip(outs, values):
        v = jnp.reshape(v, shape)
        env[i] = v if v.dtype == dtype else v.astype(dtype)
    return tuple(env[i] for i in write_ids)

  return form


def common_scope(scopes) -> str:
  parts = None
  for scope in scopes:
    pieces = scope.split("/") if scope else []
    if parts is None:
      parts = pieces
      continue
    n = 0
    while n < min(len(parts), len(pieces)) and parts[n] == pieces[n]:
      n += 1
    parts = parts[:n]
  return "/".join(parts or [])
