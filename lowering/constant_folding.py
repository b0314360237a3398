"""Constant folding: equations whose operands are all known are computed on the host.

An equation whose every operand is a compile-time constant (a literal, a
small closed-over constant, or the result of another such equation) has
one possible result. ``jax.jit`` never runs it on the device: XLA's
``HloConstantFolding`` pass evaluates it while compiling
(``xla/service/hlo_constant_folding.cc``), and so do the IPU's own
compilers: PopART's ConstExpr pass computes such ops on the host and makes
their outputs constant tensors (``willow/src/ces/constexpr.cpp`` and one
``*ce.cpp`` per op: add, cast, scale, reshape, transpose, slice, ... in
github.com/graphcore/popart), and Poplar graphs take host constants with
``Graph::addConstant``. Lowered as they come, each such equation would be a
superstep on one tile (a sync, an exchange, a vertex: ~200-250 cycles) the
hardware never pays: ``jax.random.uniform``'s ``minval``/``maxval``
converted and subtracted, ``x / 2.0`` with its divisor converted, a scalar
``sqrt(d_head)``.

:func:`fold_constants` runs on the jaxpr before lowering (after dead-code
elimination, ``lowering/dead_code.py``). It computes each foldable equation
with JAX on the host's CPU (the same primitive, the same parameters) and
puts the value in the jaxpr as a literal; the lowering makes every literal
a constant tensor (``LoweringContext.constant``: "Constants" memory, no
step). Only what is bit-for-bit what ``jax.jit`` computes is folded:

* primitives whose results are exactly rounded (IEEE arithmetic,
  ``sqrt``, conversions, compares, selects, bitwise and integer work) or
  move values (``reshape``, ``squeeze``, a ``broadcast_in_dim`` that adds
  no elements, as ``[] -> [1, 1]``): XLA's evaluator and its compiled code
  give the same bits for them, so folding cannot change a number.
  Transcendental functions (``exp``, ``tanh``, ``log``...) are left to
  run: their approximations differ between the two. A broadcast that adds
  elements stays a broadcast, as XLA leaves it (a scalar is read as one
  value where it is used; a folded copy would be a constant to exchange);
* results and operands of at most :data:`MAX_FOLD_BYTES` each, so a large
  broadcast is not materialised as an always-live constant;
* no equation with an effect, no random bits or keys (``random_bits``,
  ``random_wrap``, ``hw_round``: not in the list), nothing of an
  extended dtype;
* no value a floating-point trap would report (a NaN or an infinity from
  finite operands, a float out of an integer's range, an integer divided
  by zero): those still run, so ``floating_point_behaviour``'s traps see
  them (``lowering/fp_exceptions.py``).

Calls that run their body once with the caller's operands (``jit``,
``closed_call``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat``) see
their known operands: the body is folded for that call site, and a call
whose results all become known is dropped. Loop and branch bodies are
folded on their own constants only (a carry is not a constant).

:class:`ConstantFolding` says what was folded; the report shows it
("Constant folding: N equations folded").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ipu_jax.lowering.jax_compat import (ad_checkpoint, core, custom_derivatives,
                                         is_extended_dtype, pjit)

__all__ = ["ConstantFolding", "MAX_FOLD_BYTES", "fold_constants"]

#: Largest result or operand (bytes) an equation may have to be folded. A
#: folded value becomes an always-live constant where the equation's result
#: was a temporary; 64 KiB is a tenth of one tile's 624 KiB (estimate: the
#: bound keeps what folding adds to "Constants" small against any tile,
#: while every scalar, vector of hyperparameters or small mask folds).
MAX_FOLD_BYTES = 64 * 1024

# Exactly rounded (or exact) on every backend: folding them gives jax.jit's bits.
_FLOAT_EXACT = (lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p, lax.neg_p, lax.abs_p,
                lax.sign_p, lax.max_p, lax.min_p, lax.sqrt_p, lax.floor_p, lax.ceil_p,
                lax.round_p, lax.nextafter_p, lax.clamp_p, lax.is_finite_p)
_BITS = (lax.and_p, lax.or_p, lax.xor_p, lax.not_p, lax.shift_left_p,
         lax.shift_right_logical_p, lax.shift_right_arithmetic_p, lax.eq_p, lax.ne_p,
         lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.select_n_p)
_MOVES = (lax.convert_element_type_p, lax.bitcast_convert_type_p, lax.broadcast_in_dim_p,
          lax.reshape_p, lax.squeeze_p)
FOLDABLE = frozenset(_FLOAT_EXACT + _BITS + _MOVES)
_INTEGER_DIVISIONS = frozenset((lax.div_p, lax.rem_p))

# Calls whose body runs once on the call's operands (the lowering inlines
# them, lowering/rules/control.py): primitive -> the parameter holding the body.
INLINE_CALLS = {
    pjit.jit_p: "jaxpr",
    core.closed_call_p: "call_jaxpr",
    core.call_p: "call_jaxpr",
    custom_derivatives.custom_jvp_call_p: "call_jaxpr",
    custom_derivatives.custom_vjp_call_p: "call_jaxpr",
    ad_checkpoint.remat_p: "jaxpr",
}


@dataclasses.dataclass(frozen=True)
class ConstantFolding:
  """What constant folding computed on the host for one program.

  Attributes:
    equations: equations folded (those in nested jaxprs counted once per
      equation holding them, as the lowering visits them).
    by_primitive: primitive name -> equations of it folded.
  """

  equations: int = 0
  by_primitive: dict = dataclasses.field(default_factory=dict)

  def as_dict(self) -> dict:
    """The ``"constant_folding"`` entry of ``report.json``."""
    return {"equations_folded": int(self.equations),
            "by_primitive": {str(k): int(v) for k, v in self.by_primitive.items()}}

  @classmethod
  def from_counts(cls, counts) -> "ConstantFolding":
    """From a ``Counter`` of primitive names, most folded first."""
    return cls(sum(counts.values()),
               dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))))


def fold_constants(closed_jaxpr, max_bytes: int = MAX_FOLD_BYTES):
  """Computes on the host every equation whose operands are all known.

  Args:
    closed_jaxpr: a ``jax.extend.core.ClosedJaxpr`` (dead code removed).
    max_bytes: the largest result or operand folded.

  Returns:
    ``(folded ClosedJaxpr, ConstantFolding)``. Same inputs, outputs and
    constants; ``closed_jaxpr`` itself when nothing was folded.
  """
  folder = _Folder(max_bytes)
  folded = folder.closed(closed_jaxpr)
  return folded, ConstantFolding.from_counts(folder.counts)


class _Folder:
  """One program's folding; bodies without known operands are folded once."""

  def __init__(self, max_bytes: int):
    self.max_bytes = max_bytes
    self.counts = collections.Counter()
    self._memo = {}  # id(jaxpr) -> (jaxpr, folded, counts); the original keeps ids unique

  def closed(self, closed_jaxpr):
    key = id(closed_jaxpr)
    if key not in self._memo:
      before = self.counts.copy()
      known = self._known_consts(closed_jaxpr)
      inner, _ = self.open(closed_jaxpr.jaxpr, known)
      folded = (closed_jaxpr if inner is closed_jaxpr.jaxpr
                else jcore.ClosedJaxpr(inner, closed_jaxpr.consts))
      self._memo[key] = (closed_jaxpr, folded, self.counts - before)
      return folded
    _, folded, counts = self._memo[key]
    self.counts.update(counts)
    return folded

  def plain(self, jaxpr):
    """An open nested jaxpr (no operand known), memoised by identity."""
    key = id(jaxpr)
    if key not in self._memo:
      before = self.counts.copy()
      folded, _ = self.open(jaxpr, {})
      self._memo[key] = (jaxpr, folded, self.counts - before)
      return folded
    _, folded, counts = self._memo[key]
    self.counts.update(counts)
    return folded

  def _known_consts(self, closed_jaxpr) -> dict:
    known = {}
    for v, c in zip(closed_jaxpr.jaxpr.constvars, closed_jaxpr.consts):
      if self._small(v.aval):
        known[v] = np.asarray(c)
    return known

  def _small(self, aval) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None or is_extended_dtype(dtype) or not hasattr(aval, "shape"):
      return False
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(dtype).itemsize <= self.max_bytes

  def open(self, jaxpr, known: dict):
    """``(folded jaxpr, values of its outputs or None)``, ``known``: var -> value."""
    known = dict(known)
    literal = {}  # folded var -> its Literal
    eqns = []
    for eqn in jaxpr.eqns:
      invars = [_substitute(v, literal) for v in eqn.invars]
      values = [_value(v, known) for v in invars]
      outs = self._fold(eqn, values)
      if outs is None and eqn.primitive in INLINE_CALLS:
        eqn, outs = self._call(eqn, values)
      if outs is not None:  # folded: its results are literals from here on
        for v, value in zip(eqn.outvars, outs):
          known[v] = value
          literal[v] = jcore.Literal(value, v.aval)
        continue
      params = {name: self._nested(value) for name, value in eqn.params.items()}
      if any(a is not b for a, b in zip(invars, eqn.invars)) or any(
          params[k] is not eqn.params[k] for k in params):
        eqn = eqn.replace(invars=invars, params=params)
      eqns.append(eqn)
    outvars = [_substitute(v, literal) for v in jaxpr.outvars]
    results = [_value(v, known) for v in outvars]
    if len(eqns) == len(jaxpr.eqns) and all(a is b for a, b in zip(eqns, jaxpr.eqns)):
      return jaxpr, results
    return jaxpr.replace(eqns=eqns, outvars=outvars), results

  def _nested(self, value):
    """``value`` with every jaxpr in it folded (tuples and lists searched)."""
    if isinstance(value, jcore.ClosedJaxpr):
      return self.closed(value)
    if isinstance(value, jcore.Jaxpr):
      return self.plain(value)
    if isinstance(value, (tuple, list)):
      items = [self._nested(item) for item in value]
      if all(new is old for new, old in zip(items, value)):
        return value
      return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value

  def _call(self, eqn, values):
    """A call's body folded for this call site: ``(equation, results or None)``.

    The results are known (and the call dropped) when every one is.
    """
    name = INLINE_CALLS[eqn.primitive]
    body = eqn.params.get(name)
    if body is None or not any(v is not None for v in values):
      return eqn, None
    closed = isinstance(body, jcore.ClosedJaxpr)
    inner = body.jaxpr if closed else body
    known = self._known_consts(body) if closed else {}
    known.update({v: value for v, value in zip(inner.invars, values) if value is not None})
    folded, results = self.open(inner, known)
    if not eqn.effects and all(r is not None for r in results):
      return eqn, results
    if folded is inner:
      return eqn, None
    new_body = jcore.ClosedJaxpr(folded, body.consts) if closed else folded
    return eqn.replace(params={**eqn.params, name: new_body}), None

  def _fold(self, eqn, values) -> Optional[list]:
    """The equation's results computed on the host, or None when it stays."""
    if (eqn.primitive not in FOLDABLE or eqn.effects or any(v is None for v in values)
        or not all(self._small(v.aval) for v in list(eqn.invars) + list(eqn.outvars))):
      return None
    if _would_trap(eqn, values) or _expands(eqn, values):
      return None
    # This process's own CPU device: in a multi-process run jax.devices()[0]
    # belongs to process 0, and computing on it from another process waits on
    # a collective that process never joins.
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend="cpu")[0]):
      outs = eqn.primitive.bind(*[jax.device_put(v) for v in values], **eqn.params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    results = [np.asarray(o) for o in outs]
    if _makes_non_finite(values, results):
      return None
    self.counts[eqn.primitive.name] += 1
    return results


def _substitute(v, literal: dict):
  return v if isinstance(v, jcore.Literal) else literal.get(v, v)


def _value(v, known: dict):
  """The value of a variable or literal when known, else None."""
  if isinstance(v, jcore.Literal):
    if is_extended_dtype(v.aval.dtype):
      return None
    return np.asarray(v.val, dtype=v.aval.dtype)
  return known.get(v)


def _expands(eqn, values) -> bool:
  """A broadcast that adds elements: left as a broadcast, as XLA leaves it.

  XLA's constant folding skips broadcasts (they would only grow constants);
  here the lowering reads a broadcast scalar as one value where it is used,
  while a folded one would be a constant laid out on its own tiles and
  exchanged to its readers (measured: +62 cycles in a Cholesky solve).
  """
  return (eqn.primitive is lax.broadcast_in_dim_p
          and int(np.prod(eqn.params["shape"], dtype=np.int64)) > values[0].size)


def _would_trap(eqn, values) -> bool:
  """Operands whose results XLA defines but a trap or the hardware may not."""
  if eqn.primitive in _INTEGER_DIVISIONS and jnp.issubdtype(values[1].dtype, jnp.integer):
    return bool(np.any(values[1] == 0))
  if eqn.primitive is lax.convert_element_type_p:
    target = np.dtype(eqn.params["new_dtype"])
    source = values[0]
    if jnp.issubdtype(target, jnp.integer) and jnp.issubdtype(source.dtype, jnp.floating):
      info = np.iinfo(target)
      wide = source.astype(np.float64)
      return not bool(np.all(np.isfinite(wide) & (wide >= info.min) & (wide <= info.max)))
  return False


def _makes_non_finite(values, results) -> bool:
  """A NaN or infinity from finite operands (what a floating-point trap reports)."""
  def finite(array):
    return not jnp.issubdtype(array.dtype, jnp.inexact) or bool(
        np.all(np.isfinite(array.astype(np.float64))))
  return all(finite(v) for v in values) and not all(finite(r) for r in results)
