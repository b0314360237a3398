"""Walk a jaxpr and lower every equation with its registered rule."""

from __future__ import annotations

import functools

import numpy as np

from jax.extend import core as jcore

from ipu_jax.lowering.errors import LoweringError
from ipu_jax.lowering.jax_compat import (is_extended_dtype, physical_shape_dtype, physical_value,
                                         source_info_util)
from ipu_jax.lowering.context import LoweringContext, RuleContext
from ipu_jax.lowering.registry import get_lowering, get_view, reads_broadcast

__all__ = ["lower_jaxpr", "lower_closed_jaxpr", "source_of", "is_key_dtype"]


def source_of(eqn, library_fallback: bool = True) -> str:
  """The user's ``file:line`` an equation came from ('' if unknown).

  The innermost frame outside JAX and outside the libraries a model is built
  with (Flax, optax, chex, NumPy, ipu-jax itself): for a Flax layer, the line
  of the user's model that called it, not a line of ``flax/nnx/nn/linear.py``.
  When every frame is library code, the innermost non-JAX frame (or '' when
  ``library_fallback`` is False, unless a driver such as the Keras-like
  ``fit`` wrote the equation: see ``_DRIVERS``).
  """
  traceback = eqn.source_info.traceback
  if traceback is None:
    return ""
  return _source_of_traceback(traceback, library_fallback)


@functools.lru_cache(maxsize=4096)
def _source_of_traceback(traceback, library_fallback: bool) -> str:
  """:func:`source_of` by traceback: a layer's equations, traced once per layer
  from the same lines, share equal tracebacks (walking the frames is
  costly on thousands of equations)."""
  global _LIBRARY_ROOTS, _DRIVER_ROOTS
  if _LIBRARY_ROOTS is None:
    _LIBRARY_ROOTS, _DRIVER_ROOTS = _library_roots(_LIBRARIES), _library_roots(_DRIVERS)
  frames = list(source_info_util.user_frames(traceback))  # innermost first
  for frame in frames:
    if not frame.file_name.startswith(_LIBRARY_ROOTS):
      return f"{frame.file_name}:{frame.start_line}"
  if not frames:
    return ""
  if library_fallback or any(f.file_name.startswith(_DRIVER_ROOTS) for f in frames):
    return f"{frames[0].file_name}:{frames[0].start_line}"
  return ""


def user_call_site() -> str:
  """The ``file:line`` of the innermost caller outside JAX and the libraries.

  JAX records an equation's traceback only from where tracing began, so an
  equation of a wrapped transform (``ipu_jax.jit(jax.jit(f))``) or of a
  library helper may hold no user frame at all: it then belongs to the line
  that called ``ipu_jax.jit``'s function.
  """
  import sys
  global _LIBRARY_ROOTS, _DRIVER_ROOTS
  if _LIBRARY_ROOTS is None:
    _LIBRARY_ROOTS, _DRIVER_ROOTS = _library_roots(_LIBRARIES), _library_roots(_DRIVERS)
  jax_roots = _jax_roots()
  frame = sys._getframe(1)
  while frame is not None:
    name = frame.f_code.co_filename
    if not name.startswith(_LIBRARY_ROOTS + jax_roots) and not name.startswith("<frozen"):
      return f"{name}:{frame.f_lineno}"
    frame = frame.f_back
  return ""


def _jax_roots() -> tuple:
  import os
  import jax
  return tuple(os.path.join(os.path.dirname(os.path.realpath(p)), "")
               for p in (jax.__file__,))


_LIBRARY_ROOTS = None
_DRIVER_ROOTS = None
_LIBRARIES = ("flax", "optax", "chex", "numpy", "ipu_jax", "ipu_jax.lowering", "ipu_jax.kernels")
# Libraries that run the user's model on the user's behalf (the Keras-like
# training loop traces its own step function). An equation they wrote holds
# no user frame (its traceback starts where that tracing began): the loss,
# the optimizer update. The innermost frame outside JAX (``keras/losses.py``,
# optax's ``scale_by_adam``) says which of them, where the call site
# (``model.fit(...)``) would say nothing.
_DRIVERS = ("ipu_jax.keras",)


def _library_roots(libraries=_LIBRARIES) -> tuple:
  import importlib.util
  import os
  roots = []
  for name in libraries:
    spec = importlib.util.find_spec(name)
    for location in (spec.submodule_search_locations or []) if spec else []:
      roots.append(os.path.join(os.path.realpath(location), ""))
      roots.append(os.path.join(os.path.abspath(location), ""))
  return tuple(dict.fromkeys(roots))


def is_key_dtype(dtype) -> bool:
  """Whether ``dtype`` is a JAX PRNG key type (held as uint32 key data)."""
  return is_extended_dtype(dtype)


def _describe(values) -> str:
  return ", ".join(f"{getattr(v.aval, 'str_short', lambda: str(v.aval))()}" for v in values)


def _unsupported(eqn, source: str) -> LoweringError:
  source = source or "an unknown source line"
  return LoweringError(
      f"No tile lowering for primitive '{eqn.primitive.name}' "
      f"(operands: {_describe(eqn.invars) or 'none'}; results: {_describe(eqn.outvars)}) "
      f"at {source}. Register one with "
      f"ipu_jax.lowering.register_lowering({eqn.primitive.name}_p, rule).")


def lower_jaxpr(ctx: LoweringContext, jaxpr, consts, args, progress=None) -> list:
  """Lower ``jaxpr`` into ``ctx``'s program; returns the output tensors.

  Every equation's rule is called as ``rule(rule_ctx, *operands, **params)``
  with a :class:`~ipu_jax.lowering.context.RuleContext` for it.

  Args:
    ctx: the :class:`~ipu_jax.lowering.context.LoweringContext` (a rule
      lowering a nested jaxpr passes ``rule_ctx.module``).
    jaxpr: a ``jax.extend.core.Jaxpr``.
    consts: tensors for ``jaxpr.constvars``.
    args: tensors for ``jaxpr.invars``.
    progress: optional ``progress(done, total)``, called after each
      equation of this jaxpr (not of the jaxprs nested in it).
  """
  if not isinstance(ctx, LoweringContext):
    raise TypeError(
        f"lower_jaxpr lowers into a LoweringContext, got {type(ctx).__name__}"
        + (" (a rule lowers a nested jaxpr into ctx.module)"
           if isinstance(ctx, RuleContext) else ""))
  env = {}

  def read(v):
    if isinstance(v, jcore.Literal):
      return ctx.constant(np.asarray(v.val, dtype=v.aval.dtype))
    return env[v]

  views = _broadcast_views(jaxpr)
  uses = _TensorLastUses(jaxpr, ctx.dying_ids)
  for v, t in zip(jaxpr.constvars, consts):
    env[v] = t
    uses.bind(v, t)
  for v, t in zip(jaxpr.invars, args):
    env[v] = t
    uses.bind(v, t)
  for index, eqn in enumerate(jaxpr.eqns):
    if progress is not None:
      progress(index, len(jaxpr.eqns))
    # Equations inside JAX's own jitted helpers (jnp.linalg, searchsorted, ...)
    # carry no user frame: they belong to the user line of the enclosing call.
    source = source_of(eqn, library_fallback=False) or ctx.source or source_of(eqn)
    rule = get_lowering(eqn.primitive)
    if rule is None:
      raise _unsupported(eqn, source)
    operands = [read(v) for v in eqn.invars]
    if index in views:
      # Read in place by every reader: bound as a view, nothing emitted.
      env[eqn.outvars[0]] = view = get_view(eqn.primitive)(operands[0], **eqn.params)
      uses.bind(eqn.outvars[0], view)
      continue
    name_stack = eqn.source_info.name_stack
    rule_ctx = RuleContext(ctx, eqn.primitive, [v.aval for v in eqn.invars],
                           [v.aval for v in eqn.outvars], source, name_stack)
    with ctx.at(eqn.primitive.name, source, name_stack), \
        ctx.dying(uses.dying_at(index, operands)):
      try:
        outputs = rule(rule_ctx, *operands, **eqn.params)
      except LoweringError:
        raise
      except NotImplementedError as e:
        raise LoweringError(
            f"Primitive '{eqn.primitive.name}' (operands: {_describe(eqn.invars)}) at "
            f"{source or 'an unknown source line'} is not supported: {e}") from e
    if len(outputs) != len(eqn.outvars):
      raise LoweringError(f"rule for {eqn.primitive.name} returned {len(outputs)} results, "
                          f"expected {len(eqn.outvars)}")
    for v, t in zip(eqn.outvars, outputs):
      if (tuple(t.shape), np.dtype(t.dtype)) != physical_shape_dtype(v.aval):
        raise LoweringError(
            f"rule for {eqn.primitive.name} at {source} produced "
            f"{t.dtype}{list(t.shape)}, expected {v.aval.str_short()}")
      if not isinstance(v, jcore.DropVar):
        env[v] = t
        uses.bind(v, t)
  if progress is not None:
    progress(len(jaxpr.eqns), len(jaxpr.eqns))
  return [read(v) for v in jaxpr.outvars]


def _broadcast_views(jaxpr) -> frozenset:
  """Indices of the equations lowered as views (``registry.register_view``:
  ``broadcast_in_dim``).

  JAX's transpose of a reduction is a ``broadcast_in_dim`` of the cotangent
  to full size (a LayerNorm's or softmax's backward), read by elementwise
  ops. popops reads such an operand through a broadcast view
  (``lib/popops/ElementWise.cpp``: ``BroadcastScalar*``, the binary vertex, a
  map expression) and Poplar's ``Tensor::broadcast`` is itself a view, so
  when every reader's rule reads operands with size-1 axes broadcast
  (:func:`~ipu_jax.lowering.registry.reads_broadcast`) and the result is not
  an output of ``jaxpr``, the result is the operand seen with size-1 axes
  (:func:`~ipu_jax.lowering.movement.broadcast_view`): no full-size copy
  step nor temporary, each reader priced as reading it broadcast. Results
  read by any other rule (a matmul, a nested jaxpr) are made full size.
  """
  readers_ok = {}
  for eqn in jaxpr.eqns:
    ok = reads_broadcast(eqn.primitive)
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        readers_ok[v] = readers_ok.get(v, True) and ok
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal):
      readers_ok[v] = False
  return frozenset(
      index for index, eqn in enumerate(jaxpr.eqns)
      if get_view(eqn.primitive) is not None and len(eqn.invars) == 1
      and readers_ok.get(eqn.outvars[0], False)
      and not is_extended_dtype(eqn.outvars[0].aval.dtype))


def _last_uses(jaxpr) -> dict:
  """Variable -> index of the last equation reading it (outputs: past the end)."""
  last = {}
  for index, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        last[v] = index
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal):
      last[v] = len(jaxpr.eqns)
  return last


class _TensorLastUses:
  """When each tensor is last read, over every variable bound to it.

  Shape rules return aliases (tensors sharing an id), so a tensor dies only
  when none of its variables is read later. An alias made after an equation
  reads a variable after it, so the variables bound so far decide. A rule
  may update a dying operand in place (a loop carries a variable in its own
  memory).
  """

  def __init__(self, jaxpr, inherited):
    self._last = _last_uses(jaxpr)
    self._by_id = {}
    self._end = len(jaxpr.eqns)
    self._constvars = set(jaxpr.constvars)
    self._invars = set(jaxpr.invars)
    self._inherited = inherited  # ids dying in the enclosing equation; None: top level

  def bind(self, v, tensor):
    last = self._last.get(v, -1)
    if v in self._constvars or (v in self._invars and self._inherited is not None
                                and tensor.id not in self._inherited):
      last = self._end  # lives beyond this jaxpr
    self._by_id[tensor.id] = max(self._by_id.get(tensor.id, -1), last)

  def dying_at(self, index, tensors) -> list:
    ids = [t.id for t in tensors]
    return [i for i in dict.fromkeys(ids) if ids.count(i) == 1 and self._by_id.get(i) == index]


def lower_closed_jaxpr(ctx: LoweringContext, closed_jaxpr, args, progress=None) -> list:
  """Lower a ``ClosedJaxpr``: its consts become constant tensors."""
  consts = [ctx.constant(physical_value(c)) for c in closed_jaxpr.consts]
  return lower_jaxpr(ctx, closed_jaxpr.jaxpr, consts, args, progress=progress)
