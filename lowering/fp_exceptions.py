"""Floating-point exceptions inside the tile program (``inv``, ``div0``, ``oflo``).

Poplar's ``FloatingPointBehaviour`` (TF-IPU's ``floating_point_behaviour``
``inv``, ``div0``, ``oflo``; all off by default) makes the tiles trap on an
IEEE invalid operation, a division by zero or an overflow: the program stops
at the compute set that raised it. The executor models that without a host
round trip per step:

* after every superstep, :meth:`Traps.check` classifies what the step did to
  the *valid* elements of its float tensors (storage padding is masked out):

  - ``inv``: a NaN written although no float input held a NaN (``0/0``,
    ``inf - inf``, ``0 * inf``, ``sqrt(-1)``, ``log(-1)``, ...);
  - ``div0``: an infinity written from finite inputs by an operation with a
    pole (division, ``log``, ``rsqrt``, ``pow``, ...) one of whose inputs
    holds a zero (IEEE's divide-by-zero: an exact infinite result);
  - ``oflo``: any other infinity written from finite inputs by arithmetic
    (``exp``, sums, products, matmuls, an fp32 -> fp16 cast beyond 65504).
    Steps that only move values or write identities (``max`` reductions'
    ``-inf``, fills, gathers, selects) never overflow;

* the first trapped exception is kept in a small int32 record in the
  executor's state -- ``(kind, step, loop iteration, replica)`` -- carried
  through ``Repeat`` / ``RepeatWhileTrue`` / ``If`` / ``Switch`` like any
  tensor the program writes, and merged over replicas (the first replica
  that raised);
* ``ipu_jax.jit`` reads the record once per run and raises
  :class:`ipu_jax.FloatingPointException` naming the kind, the operation, the
  user's ``file:line``, the superstep and the iteration of the innermost
  ``Repeat`` (a ``fori_loop``/``scan`` body) it happened in.

A fused compute set (``lowering/fusion.py``) is run operation by operation
when exceptions are trapped (:func:`run_fused`; the same arithmetic as the
fused function), so the error names the operation itself; the superstep it
names is the fused compute set of the report.

A step's float *inputs* are the tensors it reads and the scalar literals
folded into its function (``Superstep.literals``: ``x * jnp.inf`` reads ``x``
and holds ``inf``, so an infinite result is no overflow and ``0 * inf`` is
no invalid operation the step made up); a step with neither (a fill, an
integer conversion) never raises.

With ``nanoo=False`` the chip's rounding to float16 saturates at 65504; its
overflow (a finite float32 operand of magnitude 65520 or more, which rounds
beyond 65504) is still reported as ``oflo``.

Differences from the chip: the chip stops *at* the faulting compute set,
while here the whole program runs and its results are discarded.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.errors import FloatingPointException
from ipu_jax.lowering import program as P

__all__ = ["KINDS", "RECORD_KEY", "Traps", "traps_from_options", "fused_members", "run_fused"]

KINDS = ("inv", "div0", "oflo")
#: The executor-state key of the record ``int32[4]``:
#: ``(kind code (0: none, 1 + index in KINDS), checked step (an index into
#: Traps.steps), iteration, replica)``; -1: none.
RECORD_KEY = "fp_exception_record"
_NONE = -1

_DESCRIPTIONS = {
    "inv": "invalid operation: a NaN produced from non-NaN inputs",
    "div0": "divide by zero: an infinity produced from finite inputs by a division by zero",
    "oflo": "overflow: an infinity produced from finite inputs",
}

# Operations with a pole: an infinite result from a zero input is IEEE's
# divide-by-zero.
DIVIDING_OPS = frozenset({"div", "rem", "log", "log1p", "rsqrt", "pow", "integer_pow",
                          "atanh", "lgamma", "digamma", "erf_inv"})
# Arithmetic whose result can overflow (plus the dividing ones). Steps of
# other operations only move values or write identities.
OVERFLOWING_OPS = DIVIDING_OPS | frozenset({
    "add", "add_any", "sub", "mul", "exp", "exp2", "expm1", "square", "sinh", "cosh", "tan",
    "dot_general", "conv_general_dilated", "ipu_matmul", "convert_element_type",
    "hw_round", "stochastic_round", "reduce_sum", "reduce_prod", "cumsum", "cumprod",
    "cumlogsumexp", "reduce_window_sum", "psum", "cross_replica_sum", "cross_replica_mean",
    "cross_replica_reduce_scatter"})
# The chip's rounding to float16 (``ipu_jax/rounding.py``): with ``nanoo=False``
# it saturates, so its overflow is seen on its float32 operand instead.
_ROUNDING_OPS = frozenset({"hw_round"})
# float32 magnitudes that round (to nearest) beyond float16's 65504.
_F16_OVERFLOW = 65520.0


def _is_zero(value):
  return value == 0


def _is_float(dtype) -> bool:
  return bool(jnp.issubdtype(np.dtype(dtype), jnp.inexact))


@dataclasses.dataclass(frozen=True)
class _StepInfo:
  index: int   # the superstep's index in the report (program order), or -1
  name: str    # the superstep's name (the fused compute set's, for a member)
  op: str
  source: str


class Traps:
  """Which exceptions trap, and the supersteps the record's indices refer to.

  One per built executor function. The record refers to the checked steps
  by :attr:`steps` entries, each knowing its superstep's index among the
  program's leaves (``P.iter_steps`` order, the report's step order).
  """

  def __init__(self, inv: bool, div0: bool, oflo: bool, program=None,
               program_name: str = ""):
    self.enabled = {"inv": bool(inv), "div0": bool(div0), "oflo": bool(oflo)}
    self.program_name = program_name
    self.steps: list = []
    self.parent = None  # the fused compute set whose operation is being run
    self._leaf_index = ({id(node): i for i, (node, _, _) in enumerate(P.iter_steps(program))}
                        if program is not None else {})
    self._index = {}
    self._masks = {}

  @property
  def any(self) -> bool:
    return any(self.enabled.values())

  @staticmethod
  def initial_record():
    return jnp.asarray([0, _NONE, _NONE, _NONE], jnp.int32)

  # -- inside the traced program --------------------------------------------

  def _step_index(self, step) -> int:
    index = self._index.get(id(step))
    if index is None:
      home = self.parent if self.parent is not None else step
      index = self._index[id(step)] = len(self.steps)
      self.steps.append(_StepInfo(self._leaf_index.get(id(home), -1), home.name,
                                  str(step.op), step.source))
    return index

  def _mask(self, tensor, shape):
    """``[rows, row_size]`` bool of the storage slots holding elements, or None (all do)."""
    key = tensor.id
    if key not in self._masks:
      mapping = getattr(tensor, "mapping", None)
      mask = None
      if mapping is not None and tuple(mapping.storage_shape) == tuple(shape) and \
          mapping.num_elements != int(np.prod(shape)):
        # Padding slots name no element (their source is num_elements).
        mask = (mapping.storage_source < mapping.num_elements).reshape(shape)
      self._masks[key] = mask
    return self._masks[key]

  def _any(self, tensors, values, predicate):
    found = jnp.asarray(False)
    for tensor, value in zip(tensors, values):
      if not _is_float(value.dtype) or value.size == 0:
        continue
      hit = predicate(value)
      mask = self._mask(tensor, value.shape)
      if mask is not None:
        hit = hit & mask
      found = found | jnp.any(hit)
    return found

  def check(self, step, reads, writes, record, iteration):
    """The record after ``step``: the first trapped exception is kept.

    Args:
      step: the superstep.
      reads, writes: its read and written storages (in ``step.reads`` /
        ``step.writes`` order).
      record: the record so far.
      iteration: the innermost ``Repeat``'s iteration (traced) or None.
    """
    index = self._step_index(step)
    fused = getattr(step, "fused_ops", ())
    ops = tuple(f.op for f in fused) if fused else (str(step.op),)
    code = jnp.int32(0)
    literals = [v for v in map(np.asarray, getattr(step, "literals", ())) if _is_float(v.dtype)]
    if not literals and not any(_is_float(t.dtype) for t in step.reads):
      # No float inputs: a fill or an integer conversion, not arithmetic on
      # floats.
      return record

    def any_input(np_predicate, jnp_predicate):
      # Literals are known while tracing: their part is decided on the host.
      if any(bool(np_predicate(v)) for v in literals):
        return jnp.asarray(True)
      return self._any(step.reads, reads, jnp_predicate)

    out_nan = self._any(step.writes, writes, jnp.isnan)
    if self.enabled["inv"]:
      code = jnp.where(out_nan & ~any_input(np.isnan, jnp.isnan), jnp.int32(1), code)
    overflowing = any(op in OVERFLOWING_OPS for op in ops)
    if overflowing and (self.enabled["div0"] or self.enabled["oflo"]):
      new_inf = (self._any(step.writes, writes, jnp.isinf)
                 & ~any_input(np.isinf, jnp.isinf) & ~any_input(np.isnan, jnp.isnan))
      dividing = any(op in DIVIDING_OPS for op in ops)
      div0 = new_inf & (any_input(_is_zero, _is_zero) if dividing else jnp.asarray(False))
      if self.enabled["div0"]:
        code = jnp.where((code == 0) & div0, jnp.int32(2), code)
      if self.enabled["oflo"]:
        overflow = new_inf & ~div0
        if ops[0] in _ROUNDING_OPS and any(np.dtype(t.dtype) == np.float16
                                           for t in step.writes):
          overflow = overflow | self._any(
              step.reads, reads, lambda v: jnp.isfinite(v) & (jnp.abs(v) >= _F16_OVERFLOW))
        code = jnp.where((code == 0) & overflow, jnp.int32(3), code)
    it = jnp.int32(_NONE) if iteration is None else jnp.asarray(iteration, jnp.int32)
    new = jnp.stack([code, jnp.int32(index), it, jnp.int32(_NONE)])
    return jnp.where((record[0] == 0) & (code > 0), new, record)

  @staticmethod
  def merge_replicas(records):
    """``[*replicas, 4]`` records -> one: the first replica's that raised."""
    flat = records.reshape(-1, 4)
    raised = flat[:, 0] > 0
    first = jnp.argmax(raised)
    chosen = flat[first]
    return jnp.where(raised.any(), chosen.at[3].set(first.astype(jnp.int32)), flat[0])

  # -- on the host, after the run -------------------------------------------

  def error(self, record) -> Optional[FloatingPointException]:
    """The exception a record describes, or None when nothing trapped."""
    record = np.asarray(record).reshape(-1, 4)
    raised = np.flatnonzero(record[:, 0] > 0)
    if not raised.size:
      return None
    code, index, iteration, replica = (int(v) for v in record[raised[0]])
    kind = KINDS[code - 1]
    info = self.steps[index]
    op, source = info.op, info.source
    where = f"superstep {info.index} '{info.name}'" if info.index >= 0 else f"'{info.name}'"
    if iteration >= 0:
      where += f", loop iteration {iteration}"
    if replica >= 0 and record.shape[0] == 1:
      where += f", replica {replica}"
    program = f" of '{self.program_name}'" if self.program_name else ""
    message = (f"Floating-point exception '{kind}' ({_DESCRIPTIONS[kind]}) in {op} at "
               f"{source or 'an unknown line'}: {where}{program}. The program stops on it "
               f"because floating_point_behaviour.{kind} is True; set it to False to let "
               f"the value through, or change the computation (e.g. loss scaling or a "
               f"wider type against fp16 overflow).")
    return FloatingPointException(message, kind=kind, op=op, source=source,
                                  step_index=info.index, step_name=info.name,
                                  iteration=iteration if iteration >= 0 else None,
                                  replica=replica if replica >= 0 else None)


def traps_from_options(options, program=None, program_name: str = "") -> Optional[Traps]:
  """The :class:`Traps` ``options`` (``LoweringOptions``) ask for, or None."""
  flags = [bool(getattr(options, kind, False)) for kind in ("inv", "div0", "oflo")]
  if not any(flags):
    return None  # the default: no walk of the program to index its steps
  return Traps(*flags, program, program_name)


def fused_members(step) -> tuple:
  """The supersteps a fused compute set was made of (empty for other steps)."""
  members = tuple(f.step for f in getattr(step, "fused_ops", ()))
  return members if members and all(m is not None for m in members) else ()


def run_fused(step, state: dict, env, run) -> dict:
  """Run a fused compute set operation by operation, each checked on its own.

  The fused function applies its members' functions in order, storing each
  result in its tensor's dtype; running them as supersteps does the same
  arithmetic (``run`` is the executor's interpreter).
  """
  traps = env.traps
  outer, traps.parent = traps.parent, step
  try:
    for member in fused_members(step):
      state = run(member, state, env)
  finally:
    traps.parent = outer
  return state
