"""Pipeline stages that are alike, lowered once (BERT's encoder stages).

A stage's forward and backward programs are a function of its equations (the
primitives, their parameters, the shapes and dtypes flowing between them and
how they are wired), its constants, whether it is recomputed and its IPU's
options -- not of which layers of the model they came from. Two stages of
seven encoder layers each on IPUs with the same options therefore lower to
the same programs, figure for figure: :class:`SharedStages` lowers the first
and hands its :class:`ipu_jax.Lowered` programs to the others
(``StagePrograms.shared_with`` names the stage that lowered them).

:func:`stage_key` is that function's argument in canonical form: variables
numbered in order of appearance, literals and constants by value, nested
jaxprs (``jit``, ``checkpoint``, ``custom_vjp``) by their own canonical form
and name scopes by the order they first appear in (``layers_3`` of one stage
and ``layers_10`` of another are the same scope position; names the lowering
reads by content -- the recomputed scope, ``loss`` -- are kept as they are).
A parameter it cannot put in canonical form (an object compared by identity)
keeps its identity: such stages are not shared, never wrongly shared.

What differs between shared stages is only their report's names: the shared
programs' steps carry the source lines and scopes of the stage that lowered
them.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import numpy as np
from jax.extend import core as jcore

from ipu_jax.lowering.scopes import RECOMPUTED_SCOPE, SEPARATE_GRADIENT_SCOPES
from ipu_jax.ops.pipeline_stage import pipeline_stage_p
from ipu_jax.pipelining import weight_update

__all__ = ["SharedLowerings", "SharedStages", "lowering_settings", "stage_key"]

# Scope names the lowering reads by content (lowering/scopes.py): kept verbatim.
_MEANINGFUL_SCOPES = frozenset((RECOMPUTED_SCOPE,) + tuple(SEPARATE_GRADIENT_SCOPES))
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _digest(value) -> tuple:
  """A constant's shape, dtype and a hash of its bytes."""
  array = np.asarray(value)
  return ("array", array.shape, str(array.dtype),
          hashlib.sha1(np.ascontiguousarray(array).tobytes()).hexdigest())


class _Canonical:
  """Puts equations into a canonical, hashable form (one per stage)."""

  def __init__(self):
    self._scopes = {}  # scope name -> position of first appearance

  def scope(self, name_stack) -> tuple:
    names = str(name_stack or "").split("/")
    return tuple(n if n in _MEANINGFUL_SCOPES or not n else
                 self._scopes.setdefault(n, len(self._scopes)) for n in names)

  def value(self, v) -> Any:
    """An equation parameter in canonical form."""
    if isinstance(v, _PLAIN):
      return (type(v).__name__, v)
    if isinstance(v, jcore.ClosedJaxpr):
      return ("closed", tuple(_digest(c) for c in v.consts), self.jaxpr(v.jaxpr))
    if isinstance(v, jcore.Jaxpr):
      return ("jaxpr", self.jaxpr(v))
    if isinstance(v, (tuple, list)):
      return (type(v).__name__, tuple(self.value(x) for x in v))
    if isinstance(v, dict):
      return ("dict", tuple((k, self.value(x)) for k, x in sorted(v.items(), key=repr)))
    if isinstance(v, np.ndarray):
      return _digest(v)
    if callable(v) and not isinstance(v, type):
      return ("id", id(v))  # a function: compared by identity, as JAX does
    try:
      hash(v)
    except TypeError:
      return ("id", id(v))
    return v  # hashable by value (dtypes, enums, named shardings, meshes)

  def jaxpr(self, jaxpr, names: dict | None = None) -> tuple:
    """``jaxpr``'s equations, variables numbered in order of appearance.

    ``names``: variables already numbered (a stage's weights, batch values,
    inputs and constants); the jaxpr's own in- and constvars are numbered
    next.
    """
    names = {} if names is None else names
    for v in list(jaxpr.constvars) + list(jaxpr.invars):
      names.setdefault(v, len(names))
    eqns = tuple(self.equation(e, names) for e in jaxpr.eqns)
    avals = tuple(repr(v.aval) for v in list(jaxpr.constvars) + list(jaxpr.invars))
    return (avals, eqns, tuple(self.atom(v, names) for v in jaxpr.outvars))

  def atom(self, v, names: dict) -> Any:
    if isinstance(v, jcore.Literal):
      return ("literal", repr(v.aval), self.value(np.asarray(v.val)) if np.ndim(v.val)
              else repr(v.val))
    return names[v]

  def equation(self, eqn, names: dict) -> tuple:
    ins = tuple(self.atom(v, names) for v in eqn.invars)
    for v in eqn.outvars:
      names[v] = len(names)
    outs = tuple(repr(v.aval) for v in eqn.outvars)
    if eqn.primitive is pipeline_stage_p:  # a stage mark: the identity (Stage.__call__)
      return ("mark", ins, outs)
    params = tuple((k, self.value(p)) for k, p in sorted(eqn.params.items()))
    return (eqn.primitive.name, ins, outs, params, self.scope(eqn.source_info.name_stack))


def stage_key(stage) -> tuple:
  """What a stage's programs depend on among its own parts, in canonical form.

  Args:
    stage: a :class:`~ipu_jax.pipelining.split.Stage`.

  Returns:
    A hashable tuple, equal for two stages whose forward and backward
    programs are the same for the same options (their equations, wiring,
    shapes, constants and scope structure), whichever layers they hold.
  """
  canonical = _Canonical()
  names = {}
  head = []
  for v in list(stage.param_vars) + list(stage.batch_vars) + list(stage.inputs):
    names[v] = len(names)
    head.append(repr(v.aval))
  for v, value in stage.consts.items():
    names[v] = len(names)
    head.append(_digest(value))
  eqns = tuple(canonical.equation(e, names) for e in stage.eqns)
  outputs = tuple(canonical.atom(v, names) for v in stage.outputs)
  return (len(stage.param_vars), len(stage.batch_vars), tuple(head), eqns, outputs)


def lowering_settings(cfg, ignoring: Sequence[str] = ()) -> tuple:
  """What a program lowered under ``cfg`` depends on: ``ipu_jax.jit``'s own cache key
  parts (the target, the lowering options, the replicas), not options it never reads
  (the schedule, the gradient accumulation count).

  ``ignoring``: lowering options left out (for a program known not to read them);
  the options are then ``(name, value)`` pairs instead of a ``LoweringOptions``.
  """
  options = cfg.lowering_options()
  if ignoring:
    options = tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options)
                    if f.name not in ignoring)
  return cfg.to_target(), options, cfg.replication_factor


class SharedStages:
  """Stage programs shared by the stages alike, of one pipeline or of several.

  Attributes:
    lowerings: how many stages were lowered (the rest reused a program).
  """

  def __init__(self):
    self._programs = {}  # stage_key -> [(recompute, settings, stage index, programs)]
    self.lowerings = 0

  def programs(self, stage, recompute: bool, cfg, lower: Callable[[], Any]) -> tuple:
    """``(programs, index)``: the programs of a stage alike lowered before and
    its index, else ``lower()``'s and None.

    Args:
      stage: the stage (its equations decide what is alike).
      recompute: whether its forward is recomputed in the backward.
      cfg: its IPU's config (stages are alike under equal
        :func:`lowering_settings` only).
      lower: lowers the stage's programs (called at most once per kind).
    """
    entries = self._programs.setdefault(stage_key(stage), [])
    settings = lowering_settings(cfg)
    for known_recompute, known_settings, index, programs in entries:
      if known_recompute == recompute and known_settings == settings:
        return programs, index
    programs = lower()
    self.lowerings += 1
    entries.append((recompute, settings, stage.index, programs))
    return programs, None


class SharedLowerings:
  """The stage and update programs several lowerings share.

  Each :meth:`Pipeline.lower <ipu_jax.pipelining.Pipeline.lower>` shares
  them among its own stages; a split search hands one of these to every
  pipeline it lowers (``Pipeline.shared_lowerings``), so a stage met again
  -- the heads of every probe of one proportion, a probe's first blocks in
  the probe of its last block only, the confirmed split's heads -- is
  lowered once. Keys hold the optimizer (updates) and the lowering settings,
  so pipelines with other optimizers or options never share.

  Attributes:
    stages: the :class:`SharedStages`.
    updates: the :class:`~ipu_jax.pipelining.weight_update.SharedUpdates`
      (``updates``, or fresh ones: a search keeps its updates when it moves
      to another proportion, where the stages cannot match).
  """

  def __init__(self, updates: "weight_update.SharedUpdates | None" = None):
    self.stages = SharedStages()
    self.updates = weight_update.SharedUpdates() if updates is None else updates
