"""Module paths: which layer of the user's model each cost belongs to.

JAX records on every equation the ``jax.named_scope`` names it was traced
under (``eqn.source_info.name_stack``); Flax linen opens one per module
(``Model/Dense_0``), and ipu-jax opens one per NNX module
(:mod:`ipu_jax.nnx_scopes`). A name stack is relative to the equation that
holds the jaxpr (a loop body's equations extend the loop's), and it wraps
scopes in transformations (``transpose(jvp(Model/Dense_0))``). The module
path drops the transformations, so a layer's forward and backward pass count
together, and the lowering joins it to the enclosing path.

:func:`by_scope` groups a :class:`~ipu_jax.lowering.profile.ProgramProfile`'s
cycles and memory by module path cut to a depth (NumPy grouping over the
steps and tensors, no per-tile loops); :func:`scope_costs` does the same over
plain columns, which a saved report has; :func:`costliest_scopes_table` is the
text a summary prints.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ScopeCost", "by_scope", "scope_costs", "costliest_scopes_table", "join_scopes",
           "module_path", "truncate", "recomputed", "NO_SCOPE", "RECOMPUTED_SCOPE",
           "SEPARATE_GRADIENT_SCOPES"]

NO_SCOPE = "(no scope)"


# Scopes whose backward pass is costed apart from their forward pass, under
# "<scope>/grad": a training step's loss (its gradient is not the model's).
# Every other scope's backward pass counts with its forward pass, so a layer's
# cost is both.
SEPARATE_GRADIENT_SCOPES = ("loss",)
GRADIENT = "grad"

# The name scope JAX gives the forward work a checkpointed region's transpose
# runs again (jax/_src/ad_checkpoint.py, ``extend_name_stack``).
RECOMPUTED_SCOPE = "rematted_computation"


def recomputed(scope: str) -> bool:
  """Whether a step's scope is forward work a backward pass runs again."""
  return RECOMPUTED_SCOPE in (scope or "").split("/")


def module_path(name_stack) -> str:
  """The scope names of a ``source_info.name_stack``, joined by ``/``.

  Transformations (``jvp``, ``transpose``, ``vmap``) are dropped: they say how
  an operation was derived, not which module it belongs to; but the backward
  pass (``transpose``) of a scope of :data:`SEPARATE_GRADIENT_SCOPES` is
  ``loss/grad``, not ``loss``.
  """
  stack = getattr(name_stack, "stack", None)
  if stack is None:  # a plain string
    return str(name_stack or "")
  from ipu_jax.lowering.jax_compat import source_info_util
  names = [e.name for e in stack if isinstance(e, source_info_util.Scope) and e.name]
  if names and names[0].split("/")[0] in SEPARATE_GRADIENT_SCOPES and any(
      isinstance(e, source_info_util.Transform) and e.name == "transpose" for e in stack):
    head, _, rest = names[0].partition("/")
    names[0] = "/".join(p for p in (head, GRADIENT, rest) if p)
  return "/".join(names)


def join_scopes(outer: str, inner: str) -> str:
  """``outer/inner``, either of which may be empty."""
  return f"{outer}/{inner}" if outer and inner else outer or inner


def truncate(scope: str, depth: int) -> str:
  """The first ``depth`` components of ``scope`` (all of them when ``depth`` <= 0)."""
  if not scope:
    return NO_SCOPE
  parts = scope.split("/")
  return "/".join(parts[:depth] if depth > 0 else parts)


@dataclasses.dataclass(frozen=True)
class ScopeCost:
  """What one module path (cut to a depth) costs in one program run.

  Attributes:
    scope: the module path, or ``"(no scope)"`` for operations outside any
      named scope (the optimizer update of a training step, arguments).
    cycles: cycles of its supersteps, times their executions.
    cycle_share: ``cycles`` over the program's total.
    steps: supersteps it runs (each counted once).
    flops: floating point operations, times executions.
    tensor_bytes: bytes of the tensors its operations create, over all
      tiles (variables and constants included; temporaries counted once each,
      though the program reuses their memory over time).
    working_bytes: the most memory one of its steps needs on one tile while
      it runs (the report's working memory).
  """

  scope: str
  cycles: float
  cycle_share: float
  steps: int
  flops: float
  tensor_bytes: int
  working_bytes: int

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _group(keys):
  names, index = np.unique(np.asarray(keys, dtype=object).astype(str), return_inverse=True)
  return names, index.reshape(-1)


def _check_depth(depth) -> None:
  if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)):
    raise TypeError(f"depth must be an int; got {depth!r}.")


def by_scope(profile, depth: int = 2) -> list:
  """Cycles and memory of ``profile`` grouped by module path cut to ``depth``.

  Args:
    profile: a :class:`~ipu_jax.lowering.profile.ProgramProfile`.
    depth: path components kept (``Encoder/layers_0/attention`` at depth 2
      counts under ``Encoder/layers_0``); 0 or less keeps whole paths.

  Returns:
    :class:`ScopeCost` rows, costliest in cycles first.

  Raises:
    TypeError: ``depth`` is not an int.
  """
  _check_depth(depth)
  steps, tensors = profile.steps, profile.tensors
  return scope_costs(
      [s.scope for s in steps],
      [s.sync_cycles + s.exchange_cycles + s.compute_phase_cycles for s in steps],
      [s.executions for s in steps], [s.flops for s in steps],
      [0 if s.temporary_bytes is None or not s.temporary_bytes.size else s.temporary_bytes.max()
       for s in steps],
      [t.scope for t in tensors], [t.total_bytes for t in tensors], depth)


def scope_costs(step_scopes, step_cycles, executions, flops, working, tensor_scopes,
                tensor_bytes, depth: int = 2) -> list:
  """:func:`by_scope` over columns: one entry per step, one per tensor.

  A saved report (``report.json``) has these columns and no profile; both
  kinds of report group them here, so they print the same table.

  Args:
    step_scopes: each step's module path ('' for none).
    step_cycles: cycles of one execution of each step (sync + exchange +
      compute).
    executions: executions of each step per run.
    flops: floating-point operations of one execution of each step.
    working: each step's working memory on its busiest tile.
    tensor_scopes: each tensor's module path.
    tensor_bytes: each tensor's bytes over all tiles.
    depth: see :func:`by_scope`.
  """
  _check_depth(depth)
  n_steps = len(step_scopes)
  names, inverse = _group([truncate(s, depth) for s in step_scopes]
                          + [truncate(s, depth) for s in tensor_scopes])
  step_index, tensor_index = inverse[:n_steps], inverse[n_steps:]
  n = len(names)

  def per_scope(index, values, dtype=np.float64):
    return (np.bincount(index, np.asarray(values, np.float64), minlength=n).astype(dtype)
            if len(index) else np.zeros(n, dtype))

  runs = np.asarray(executions, np.float64)
  cycles = per_scope(step_index, np.asarray(step_cycles, np.float64) * runs)
  total_flops = per_scope(step_index, np.asarray(flops, np.float64) * runs)
  counts = np.bincount(step_index, minlength=n) if n_steps else np.zeros(n, np.int64)
  working_bytes = np.zeros(n, np.int64)
  if n_steps:
    np.maximum.at(working_bytes, step_index, np.asarray(working, np.int64))
  memory = per_scope(tensor_index, tensor_bytes)
  total = float(cycles.sum())
  rows = [ScopeCost(scope=str(names[i]), cycles=float(cycles[i]),
                    cycle_share=float(cycles[i] / total) if total else 0.0,
                    steps=int(counts[i]), flops=float(total_flops[i]),
                    tensor_bytes=int(memory[i]), working_bytes=int(working_bytes[i]))
          for i in range(n)]
  rows.sort(key=lambda r: (-r.cycles, -r.tensor_bytes, r.scope))
  return rows


def costliest_scopes_table(profile, depth: int = 2, top: int = 5, rows=None) -> str:
  """The ``top`` costliest module paths by cycles and by memory, as text.

  Args:
    profile: a :class:`~ipu_jax.lowering.profile.ProgramProfile` (None when
      ``rows`` are given).
    depth: see :func:`by_scope`.
    top: rows in each table.
    rows: :class:`ScopeCost` rows already grouped at ``depth`` (from
      :func:`scope_costs`), instead of ``profile``.

  Returns:
    Two tables under one heading, ready for a report summary.
  """
  rows = by_scope(profile, depth) if rows is None else rows
  width = max([len("Module path")] + [len(r.scope) for r in rows])
  lines = [f"Costliest module paths (depth {depth})", "  by cycles:",
           f"    {'Module path'.ljust(width)}  {'Cycles':>14}  {'Share':>6}  {'Steps':>6}"]
  for r in rows[:top]:
    lines.append(f"    {r.scope.ljust(width)}  {r.cycles:>14,.0f}  {r.cycle_share:>6.1%}  "
                 f"{r.steps:>6,}")
  lines += ["  by memory:",
            f"    {'Module path'.ljust(width)}  {'Tensor bytes':>14}  {'Working B/tile':>14}"]
  for r in sorted(rows, key=lambda r: (-r.tensor_bytes, -r.working_bytes, r.scope))[:top]:
    lines.append(f"    {r.scope.ljust(width)}  {r.tensor_bytes:>14,}  {r.working_bytes:>14,}")
  return "\n".join(lines)
