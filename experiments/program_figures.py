"""A lowered program's figures in a line: its equations, a fingerprint of its figures, and
how many values its per-tile figures take held as runs.

Shared by the runners that compare two states of the code (the benchmark's
scale and speed suites, ``lowering_time``, ``figures_fingerprint``); kept
apart from them so that importing it defines no command-line flags.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["figure_runs", "figures_sha1", "iter_eqns"]


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


def figure_runs(program) -> dict:
  """How many values a lowered program's per-tile figures take held as runs of equal values.

  Every superstep holds its cycles, vertices, scratch bytes and exchange bytes in and out
  as ``[num_tiles]`` arrays, so each rule's work on them grows with the tile count. Held as
  runs (a value and the tiles it covers, one run per change along the tiles), a figure of
  a regular layout takes a few values whatever the tile count: this is the measure of how
  far that redesign (``docs/performance.md#lowering-on-several-ipus``) could take the
  tile count out of the figures. Each step is counted once, however often it runs.

  Args:
    program: a lowered program (``Lowered.program``).

  Returns:
    ``figures`` (arrays counted), ``tiles`` (their length), ``runs`` (their runs in
    all), ``share`` (``runs / (figures * tiles)``: 1 when no figure repeats a value on
    neighbouring tiles), and the ``median`` and ``p90`` runs of one figure.
  """
  from ipu_jax.lowering import program as P
  counts, sizes, seen = [], [], set()
  for node, _, _ in P.iter_steps(program):
    if not isinstance(node, P.Superstep) or id(node) in seen:
      continue
    seen.add(id(node))
    arrays = [getattr(node, name) for name in _STEP_FIGURES]
    if node.exchange is not None:
      arrays += [getattr(node.exchange, name) for name in _EXCHANGE_FIGURES]
    for a in arrays:
      if a is None or np.ndim(a) != 1 or not np.size(a):
        continue
      a = np.asarray(a)
      sizes.append(a.size)
      counts.append(1 + int(np.count_nonzero(a[1:] != a[:-1])))
  counts = np.asarray(counts, np.int64)
  if not counts.size:
    return {"figures": 0, "tiles": 0, "runs": 0, "share": 0.0, "median": 0.0, "p90": 0.0}
  return {"figures": int(counts.size), "tiles": int(max(sizes)), "runs": int(counts.sum()),
          "share": float(counts.sum() / sum(sizes)),
          "median": float(np.median(counts)), "p90": float(np.percentile(counts, 90))}


def iter_eqns(jaxpr):
  """Every equation, nested jaxprs (loops, conditionals, calls) included."""
  from jax.extend import core as jex_core
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from iter_eqns(sub)
