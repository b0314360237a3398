"""A lowered program's figures in a line: its equations and a fingerprint of its figures.

Shared by the runners that compare two states of the code (the benchmark's
scale and speed suites, ``lowering_time``, ``figures_fingerprint``); kept
apart from them so that importing it defines no command-line flags.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["figures_sha1", "iter_eqns"]


def figures_sha1(profile) -> str:
  """A fingerprint of a program's figures: every step's total cycles and the bytes each tile
  receives in it, and every tile's peak memory (equal when a change leaves them unchanged)."""
  digest = hashlib.sha1()
  for step in profile.steps:
    digest.update(np.float64(step.total_cycles).tobytes())
    digest.update(np.asarray(step.exchange_bytes_in, np.int64).tobytes())
  digest.update(np.asarray(profile.memory.peak, np.int64).tobytes())
  return digest.hexdigest()[:16]


def iter_eqns(jaxpr):
  """Every equation, nested jaxprs (loops, conditionals, calls) included."""
  from jax.extend import core as jex_core
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jex_core.jaxprs_in_params(eqn.params):
      yield from iter_eqns(sub)
