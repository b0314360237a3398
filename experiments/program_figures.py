"""A lowered program's figures in a line: its equations, a fingerprint of its figures, and
how many values its per-tile figures take held per tile, as runs or as classes of tiles.

Shared by the runners that compare two states of the code (the benchmark's
scale and speed suites, ``lowering_time``, ``figures_fingerprint``); kept
apart from them so that importing it defines no command-line flags.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["figure_compression", "figures_sha1", "iter_eqns"]


def figures_sha1(profile) -> str:
  """A fingerprint of a program's figures: every step's total cycles and the bytes each tile
  receives in it, and every tile's peak memory (equal when a change leaves them unchanged)."""
  digest = hashlib.sha1()
  for step in profile.steps:
    digest.update(np.float64(step.total_cycles).tobytes())
    digest.update(np.asarray(step.exchange_bytes_in, np.int64).tobytes())
  digest.update(np.asarray(profile.memory.peak, np.int64).tobytes())
  return digest.hexdigest()[:16]


# The per-tile figures a superstep holds (``lowering/program.py``), by name.
_STEP_FIGURES = ("compute_cycles", "vertices", "scratch_bytes")
_EXCHANGE_FIGURES = ("bytes_in", "bytes_out")


def _step_figures(program):
  """Each superstep's ``[num_tiles]`` figures, once per step however often it runs."""
  from ipu_jax.lowering import program as P
  seen = set()
  for node, _, _ in P.iter_steps(program):
    if not isinstance(node, P.Superstep) or id(node) in seen:
      continue
    seen.add(id(node))
    arrays = [getattr(node, name) for name in _STEP_FIGURES]
    if node.exchange is not None:
      arrays += [getattr(node.exchange, name) for name in _EXCHANGE_FIGURES]
    arrays = [np.asarray(a) for a in arrays if a is not None and np.ndim(a) == 1 and np.size(a)]
    if arrays:
      yield arrays


def figure_compression(program) -> dict:
  """How many values a lowered program's per-tile figures take, held per tile or otherwise.

  Every superstep holds its cycles, vertices, scratch bytes and exchange bytes in and out
  as ``[num_tiles]`` arrays, so each rule's work on them grows with the tile count. Two
  other forms measure how far the tile count could drop out of that work
  (``docs/performance.md#lowering-on-several-ipus``):

  * runs: a value and the neighbouring tiles that share it, per figure;
  * tile classes: per step, the tiles whose figures are all equal (a class's values
    once, and which class each tile is in).

  Args:
    program: a lowered program (``Lowered.program``).

  Returns:
    ``figures`` (arrays counted), ``tiles`` (their length), ``runs`` (their runs in
    all), ``runs_share`` (``runs`` over the figures' values: 1 when no figure repeats a
    value on neighbouring tiles), ``median_runs`` and ``p90_runs`` (runs of one figure),
    ``steps`` (steps counted), ``classes`` (their tile classes in all),
    ``median_classes`` and ``p90_classes`` (classes of one step).
  """
  runs, sizes, classes = [], [], []
  for arrays in _step_figures(program):
    for a in arrays:
      sizes.append(a.size)
      runs.append(1 + int(np.count_nonzero(a[1:] != a[:-1])))
    # Float64 holds every figure exactly (integer counts below 2**53, or cycles already float).
    table = np.stack([a.astype(np.float64) for a in arrays], axis=1)
    classes.append(np.unique(table, axis=0).shape[0])
  runs, classes = np.asarray(runs, np.int64), np.asarray(classes, np.int64)
  if not classes.size:
    return {"figures": 0, "tiles": 0, "runs": 0, "runs_share": 0.0, "median_runs": 0.0,
            "p90_runs": 0.0, "steps": 0, "classes": 0, "median_classes": 0.0,
            "p90_classes": 0.0}
  return {"figures": int(runs.size), "tiles": int(max(sizes)), "runs": int(runs.sum()),
          "runs_share": float(runs.sum() / sum(sizes)),
          "median_runs": float(np.median(runs)), "p90_runs": float(np.percentile(runs, 90)),
          "steps": int(classes.size), "classes": int(classes.sum()),
          "median_classes": float(np.median(classes)),
          "p90_classes": float(np.percentile(classes, 90))}


def iter_eqns(jaxpr):
  """Every equation, nested jaxprs (loops, conditionals, calls) included."""
  from jax.extend import core as jex_core
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from iter_eqns(sub)
