"""The executor: a whole tile program becomes one jit-compiled JAX function.

State holds each tensor's value keyed by tensor id, plus host-stream buffers
and cursors keyed by strings. A :class:`~ipu_jax.lowering.program.Superstep`
carries two forms of its work, and the executor, not the rule, chooses:

- ``"per_tile"`` mode runs every step's ``fn``, what the tiles do, on tile
  storages (``[rows, row_size]``, the leading axis is the tile).
- ``"batched"`` mode (the default) keeps a tensor as its logical array
  between steps (:class:`_Logical`) and runs a step's ``logical`` form on
  logical arrays, so XLA compiles the arithmetic of ``jax.jit``'s program
  rather than round trips through tile storage. With floating-point traps,
  which check every step's storages, it runs that form between the storages
  (:func:`_logical_on_storage`); a step with no logical form runs ``fn``.

Control programs carry tile storages (in ``"batched"`` mode, the logical
arrays of tensors that may be held logical, as the program's inputs are
held) and become ``lax.fori_loop`` (Repeat),
``lax.while_loop`` (RepeatWhileTrue), ``lax.cond`` (If), ``lax.switch``
(Switch) and ``vmap`` over named replica axes (Replicated, so the collectives
of its steps reach across replicas). Nothing here loops over tiles in Python: a step's function does its
work on whole storage arrays.
"""

from __future__ import annotations

import functools

from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from ipu_jax.lowering import fp_exceptions
from ipu_jax.lowering import printing
from ipu_jax.lowering import program as P
from ipu_jax.lowering.exchange import to_flat, to_storage

__all__ = ["build_function", "MODES"]

MODES = ("batched", "per_tile")


class _Logical:
  """A tensor's value held in the state as its logical array, not its storage.

  Between steps a tensor on a linear or block-grid layout is kept as an
  array of its shape and converted to storage (pads, reshapes, transposes)
  only where a step reads it through its storage function; the program's
  inputs and control programs' carries are held so too (:func:`_held_logical`);
  tensors on irregular layouts and tensors a step updates in place stay in
  storage. Steps with a logical form
  (``Superstep.logical``) read and write these arrays directly, and a storage function's
  ``to_flat`` of an operand undoes the conversion (XLA cancels the pair),
  so what XLA materialises between fusions is what ``jax.jit`` would: no
  padded copies in tile storage, no relayouts to and from it around every
  matmul and reduction. Only the representation changes: the storage's
  padding (slots holding no element) reads as zeros, as
  :func:`~ipu_jax.lowering.exchange.to_storage` fills it.

  ``storage``: the storage a step built from ``value`` (None: none yet),
  kept so that later readers in the same state reuse it: a tensor is
  converted once, not once per reading step.
  """

  __slots__ = ("value", "mapping", "storage")

  def __init__(self, value, mapping, storage=None):
    self.value, self.mapping, self.storage = value, mapping, storage


class _Env:
  """What the interpreter needs besides the state: tensors by id, memo.

  With floating-point exceptions trapped (``traps``), the state also carries
  their record (``fp_exceptions.RECORD_KEY``), which every control program
  carries like a tensor it writes; ``iteration`` is the innermost ``Repeat``'s
  index while its body is traced. ``batched``: the mode runs logical forms.
  """

  def __init__(self, tensors: dict, traps=None, mode: str = "batched"):
    if mode not in MODES:
      raise ValueError(f"executor mode {mode!r}: expected one of {MODES}")
    self.tensors = tensors
    self.batched = mode == "batched"
    self.memo = {}
    self.traps = traps
    self.iteration = None
    self.extra_keys = frozenset({fp_exceptions.RECORD_KEY}) if traps else frozenset()

  def get(self, state: dict, key):
    """``key``'s value; a tensor's in its tile storage."""
    value = state.get(key)
    if isinstance(value, _Logical):
      if value.storage is not None:
        return value.storage
      return to_storage(value.value.reshape(-1), value.mapping)
    if value is not None:
      return value
    tensor = self.tensors[key]
    # A temporary not yet written (e.g. first use in a loop carry) is zeros,
    # as uninitialised tile memory would be undefined.
    return jnp.zeros(tensor.storage_shape, tensor.dtype)

  def get_logical(self, state: dict, tensor):
    """``tensor``'s value as its logical array (of its shape)."""
    value = state.get(tensor.id)
    if isinstance(value, _Logical):
      # An alias (rules/shape.py) shares the id with another shape.
      return _shaped(value.value, tensor.shape)
    if value is None:
      return jnp.zeros(tensor.shape, tensor.dtype)
    return to_flat(value, tensor.mapping).reshape(tensor.shape)

  def writes(self, program: P.Program, local_ids=frozenset()):
    """State keys ``program`` writes, less those local to it (not carried)."""
    keys = P.program_writes(program, self.memo) - frozenset(local_ids)
    return sorted(keys | self.extra_keys, key=str)


def _run(program: P.Program, state: dict, env: _Env, owned: bool = False) -> dict:
  """The state after ``program``; ``owned``: ``state`` is this call's to update in place.

  A sequence copies the state once and its steps write into that copy:
  copying it per step made tracing quadratic in the number of steps.
  """
  if program is None:
    return state
  if isinstance(program, P.Superstep):
    return _step(program, state, env, owned)
  if isinstance(program, P.Sequence):
    state = state if owned else dict(state)
    for child in program.programs:
      # Other nodes return a new dict (or this one unchanged): still ours.
      state = _run(child, state, env, owned=True)
    return state
  if isinstance(program, P.StreamCopy):
    return _stream_copy(program, state, env)
  if isinstance(program, P.PrintTensor):
    tensor = program.tensor
    value = env.get_logical(state, tensor)
    printing.print_tensor(program.title, value)
    return state
  if isinstance(program, P.Repeat):
    return _repeat(program, state, env)
  if isinstance(program, P.RepeatWhileTrue):
    return _repeat_while(program, state, env)
  if isinstance(program, P.If):
    return _if(program, state, env)
  if isinstance(program, P.Switch):
    return _switch(program, state, env)
  if isinstance(program, P.Replicated):
    return _replicated(program, state, env)
  raise TypeError(f"not a tile program: {program!r}")


def _step(step: P.Superstep, state: dict, env: _Env, owned: bool) -> dict:
  """Run one superstep by the form the mode chooses (see the module docstring)."""
  members = fp_exceptions.fused_members(step)
  if env.traps is not None and members:
    # Op by op, to name the faulting op; one copy of the state for all of them.
    return fp_exceptions.run_fused(step, state if owned else dict(state), env,
                                   functools.partial(_run, owned=True))
  if (env.batched and members and step.logical is None
      and any(m.logical is not None for m in members)):
    # The fused ``fn`` is the members' per-tile functions and some member
    # has no logical form (so the fused step has none): run each member by
    # the form this mode chooses for it.
    state = state if owned else dict(state)
    for member in members:
      state = _step(member, state, env, owned=True)
    return state
  if env.batched and env.traps is None and step.logical and _writes_logical(step):
    return _run_logical(step, state if owned else dict(state), env)
  return _run_storage(step, _storage_function(step, env), state, env, owned)


def _storage_function(step: P.Superstep, env: _Env):
  """The function a step runs on storages: in ``"batched"`` mode its logical
  form between storages where it has one (the values the logical path
  computes), else ``fn``."""
  if (env.batched and step.logical is not None
      and all(t.mapping is not None for t in step.reads + step.writes)):
    return functools.partial(_logical_on_storage, step)
  return step.fn


def _logical_on_storage(step: P.Superstep, *storages):
  """``step.logical`` on its reads' storages, its results back into storage."""
  arrays = [to_flat(s, t.mapping).reshape(t.shape) for s, t in zip(storages, step.reads)]
  outputs = step.logical(*arrays)
  return tuple(to_storage(jnp.reshape(v, (-1,)).astype(t.dtype), t.mapping)
               for v, t in zip(outputs, step.writes))


def _run_storage(step: P.Superstep, function, state: dict, env: _Env, owned: bool) -> dict:
  """Run ``function`` (``step``'s, on storages) and store its results."""
  values = [env.get(state, t.id) for t in step.reads]
  outputs = function(*values)
  if len(outputs) != len(step.writes):
    raise RuntimeError(f"step {step.name} returned {len(outputs)} values, "
                       f"expected {len(step.writes)}")
  if not owned:
    state = dict(state)
  _keep_storages(state, step.reads, values)
  written = []
  for tensor, value in zip(step.writes, outputs):
    if tuple(value.shape) != tensor.storage_shape:
      raise RuntimeError(
          f"step {step.name} produced storage {value.shape} for {tensor.name}, "
          f"expected {tensor.storage_shape}")
    value = value if value.dtype == tensor.dtype else value.astype(tensor.dtype)
    written.append(value)
    state[tensor.id] = (_Logical(to_flat(value, tensor.mapping).reshape(tensor.shape),
                                 tensor.mapping)
                        if _keeps_logical(tensor, step) else value)
  if env.traps is not None:
    key = fp_exceptions.RECORD_KEY
    state[key] = env.traps.check(step, values, written, state[key], env.iteration)
  return state


def _keep_storages(state: dict, reads, storages) -> None:
  """Keep the storages built for logical ``reads`` beside their arrays in ``state``.

  A new :class:`_Logical` in this state (owned): the old one may be shared
  with an enclosing control program's state, traced outside this one.
  """
  for tensor, storage in zip(reads, storages):
    value = state.get(tensor.id)
    if isinstance(value, _Logical) and value.storage is None:
      state[tensor.id] = _Logical(value.value, value.mapping, storage)


def _keeps_logical(tensor, step) -> bool:
  """Whether a storage function's result is kept logical (see :class:`_Logical`).

  Where the conversion is pads and transposes that XLA cancels with a
  reader's; an irregular layout's is a gather, done on demand. A tensor the
  step also reads is updated in place (a matmul's serial passes each write
  part of the result): converting it at every update would chain layout
  round trips XLA does not cancel.
  """
  mapping = tensor.mapping
  return (mapping is not None and (mapping.is_linear or mapping.grid is not None)
          and all(t.id != tensor.id for t in step.reads))


def _writes_logical(step) -> bool:
  """Whether every result of ``step`` can be held logical (a remote buffer has no mapping)."""
  return all(t.mapping is not None for t in step.writes)


def _run_logical(step: P.Superstep, state: dict, env) -> dict:
  """Run ``step``'s logical form on its reads' logical arrays, into ``state`` (owned)."""
  outputs = step.logical(*[env.get_logical(state, t) for t in step.reads])
  if len(outputs) != len(step.writes):
    raise RuntimeError(f"step {step.name} returned {len(outputs)} values, "
                       f"expected {len(step.writes)}")
  for tensor, value in zip(step.writes, outputs):
    if tuple(value.shape) != tuple(tensor.shape):
      raise RuntimeError(f"step {step.name} produced {value.shape} for {tensor.name}, "
                         f"expected {tensor.shape}")
    value = value if value.dtype == tensor.dtype else value.astype(tensor.dtype)
    state[tensor.id] = _Logical(value, tensor.mapping)
  return state


def _held_logical(env: _Env, key) -> bool:
  """Whether the program's inputs and control programs' carries hold ``key`` logical.

  In ``"batched"`` mode (no traps) a tensor that may be held logical
  (:class:`_Logical`: a linear or block-grid layout) enters the program and
  crosses a loop or a branch as the array ``jax.jit``'s program has there.
  Held as storage, a branch sliced its operands out of the padded rows and
  padded its results into them, conversions XLA cannot cancel across the
  branch's boundary, so it fused them with the branch's steps and ran those
  over other loop shapes than ``jax.jit``'s; XLA's CPU backend computes
  some transcendental functions (``exp``) by its own vectorised polynomial
  in some loops and by a libm call in others, an ulp apart on some inputs
  (docs/tile_program.md#what-same-numbers-means). Stream cursors and
  buffers and the trap record are not tensors: held as they are.
  """
  tensor = env.tensors.get(key) if isinstance(key, int) else None
  if not env.batched or env.traps is not None or tensor is None:
    return False
  mapping = tensor.mapping
  return mapping is not None and (mapping.is_linear or mapping.grid is not None)


def _hold(env: _Env, key, value, storage: bool = False):
  """``key``'s ``value`` as the state holds it.

  ``value`` is its storage where ``storage`` (a program input) or where
  :func:`_held_logical` says no (a carry of storage), else its logical array.
  """
  if not _held_logical(env, key):
    return value
  tensor = env.tensors[key]
  if storage:
    value = to_flat(value, tensor.mapping)
  return _Logical(_shaped(value, tensor.shape), tensor.mapping)


def _shaped(value, shape):
  """``value`` (of ``shape``'s size) as ``shape``.

  No operation where it has that shape already: JAX traces a reshape of a
  scalar to its own shape as one.
  """
  shape = tuple(shape)
  return value if tuple(value.shape) == shape else jnp.reshape(value, shape)


def _hold_input(env: _Env, key, value, logical: bool):
  """A program input's ``value`` as the state holds it.

  ``logical``: it arrives as its logical array (any shape of its size).
  Held logical (:func:`_held_logical`) it is kept as it is, so an input that
  no step reads through its storage costs XLA no operation at all (built
  into storage and read back, it was a pad, reshapes and a slice per input
  that XLA compiled, and cancelled, in every program); otherwise its
  storage is built here, once.
  """
  if not logical:
    return _hold(env, key, value, storage=True)
  if _held_logical(env, key):
    return _hold(env, key, value)
  return to_storage(jnp.reshape(value, (-1,)), env.tensors[key].mapping)


def _carry(state, env, keys):
  """The values of ``keys`` a control program carries (see :func:`_held_logical`)."""
  return tuple(env.get_logical(state, env.tensors[k]) if _held_logical(env, k)
               else env.get(state, k) for k in keys)


def _with(state, keys, values, env):
  state = dict(state)
  state.update((k, _hold(env, k, v)) for k, v in zip(keys, values))
  return state


def _repeat(program: P.Repeat, state, env):
  keys = env.writes(program.body, program.local_ids)
  if program.count <= 0:
    return state

  def body(i, carried):
    outer, env.iteration = env.iteration, i
    try:
      inner = _run(program.body, _with(state, keys, carried, env), env)
    finally:
      env.iteration = outer
    return _carry(inner, env, keys)

  carried = jax.lax.fori_loop(0, program.count, body, _carry(state, env, keys))
  return _with(state, keys, carried, env)


def _scalar_true(state, env, tensor):
  return env.get_logical(state, tensor).reshape(()) != 0


def _repeat_while(program: P.RepeatWhileTrue, state, env):
  keys = sorted(set(env.writes(program.body, program.local_ids))
                | set(env.writes(program.condition, program.local_ids)), key=str)
  state = _run(program.condition, state, env)

  def cond(carry):
    return carry[0]

  def body(carry):
    inner = _with(state, keys, carry[1], env)
    inner = _run(program.body, inner, env)
    inner = _run(program.condition, inner, env)
    return _scalar_true(inner, env, program.predicate), _carry(inner, env, keys)

  init = (_scalar_true(state, env, program.predicate), _carry(state, env, keys))
  _, carried = jax.lax.while_loop(cond, body, init)
  return _with(state, keys, carried, env)


def _branches(programs, state, env, local_ids=frozenset()):
  keys = sorted(set().union(*[env.writes(p, local_ids) for p in programs if p is not None]),
                key=str)

  def make(p):
    def branch(carried):
      return _carry(_run(p, _with(state, keys, carried, env), env), env, keys)
    return branch

  return keys, [make(p) for p in programs]


def _if(program: P.If, state, env):
  keys, (then, else_) = _branches([program.then, program.else_], state, env, program.local_ids)
  pred = _scalar_true(state, env, program.predicate)
  carried = jax.lax.cond(pred, then, else_, _carry(state, env, keys))
  return _with(state, keys, carried, env)


def _switch(program: P.Switch, state, env):
  bodies = [p for _, p in program.cases] + [program.default]
  keys, branches = _branches(bodies, state, env, program.local_ids)
  control = env.get_logical(state, program.control).reshape(())
  index = jnp.int32(len(program.cases))
  for i, (value, _) in reversed(list(enumerate(program.cases))):
    index = jnp.where(control == value, jnp.int32(i), index)
  carried = jax.lax.switch(index, branches, _carry(state, env, keys))
  return _with(state, keys, carried, env)


def _replicated(program: P.Replicated, state, env):
  keys = env.writes(program.body, program.local_ids)
  axes = tuple(program.axes)

  def replica(*_indices):
    return _carry(_run(program.body, state, env), env, keys)

  # One vmap per mesh axis (the outermost is the first), each binding its
  # name; the dummy index arguments give every vmap its axis to map.
  fn = replica
  for k in reversed(range(len(axes))):
    name, size = axes[k]
    in_axes = tuple(0 if j == k else None for j in range(len(axes)))
    fn = jax.vmap(fn, in_axes=in_axes, axis_name=name, axis_size=size)
  carried = fn(*[jnp.arange(size) for _, size in axes])
  first = (0,) * len(axes)
  return _with(state, keys, [fp_exceptions.Traps.merge_replicas(value)
                             if k == fp_exceptions.RECORD_KEY else value[first]
                             for k, value in zip(keys, carried)], env)


def _stream_copy(program: P.StreamCopy, state, env):
  stream, tensor = program.stream, program.tensor
  buffer = state[stream.buffer_key]
  cursor = state[stream.cursor_key]
  length = buffer.shape[0]
  n = stream.num_elements
  # Host buffers are circular, as with Poplar's connectStream(start, end).
  index = (cursor + jnp.arange(n, dtype=jnp.int32)) % max(length, 1)
  state = dict(state)
  if stream.to_device:
    chunk = buffer[index].astype(tensor.dtype)
    state[tensor.id] = to_storage(chunk, tensor.mapping)
  else:
    value = env.get_logical(state, tensor).reshape(-1)
    state[stream.buffer_key] = buffer.at[index].set(value.astype(buffer.dtype))
  state[stream.cursor_key] = ((cursor + n) % max(length, 1)).astype(cursor.dtype)
  return state


def build_function(program: P.Program, tensors: dict, input_keys: Iterable,
                   output_keys: Iterable, *, donate: bool = False, traps=None,
                   mode: str = "batched", logical_inputs: Iterable = (),
                   logical_outputs: Iterable = ()) -> Callable:
  """Compile ``program`` into one jitted function.

  Args:
    program: the control program.
    tensors: every tensor the program touches, by id.
    input_keys: state keys the function takes (tensor ids / stream keys), in
      order; keys the program reads but that are not inputs start as zeros.
    output_keys: state keys it returns, in order.
    donate: donate the input buffers (their storage is reused for outputs).
    traps: a :class:`~ipu_jax.lowering.fp_exceptions.Traps` to record the
      first trapped floating-point exception (``output_keys`` may then name
      ``fp_exceptions.RECORD_KEY``), or None.
    mode: ``"batched"`` (steps' logical forms) or ``"per_tile"`` (their
      ``fn``s); see the module docstring.
    logical_inputs: positions in ``input_keys`` (of tensors) given as their
      logical arrays (any shape of their size) rather than their storages (see
      :func:`_hold_input`); the others are storages.
    logical_outputs: positions in ``output_keys`` (of tensors) returned as
      their logical arrays (of their shapes) rather than their storages: a tensor held
      logical goes out as it is, where building its storage and reading it
      back cost two gathers for an irregular layout, which XLA does not
      cancel.

  Returns:
    ``fn(*inputs) -> tuple(outputs)``, jit-compiled.
  """
  input_keys = tuple(input_keys)
  output_keys = tuple(output_keys)
  logical_inputs = frozenset(logical_inputs)
  logical_outputs = frozenset(logical_outputs)
  env = _Env(tensors, traps, mode)

  def output(state, i, key):
    if i in logical_outputs:
      return env.get_logical(state, tensors[key])
    return env.get(state, key)

  def run(*inputs):
    state = {k: _hold_input(env, k, v, i in logical_inputs)
             for i, (k, v) in enumerate(zip(input_keys, inputs))}
    if traps is not None:
      state[fp_exceptions.RECORD_KEY] = traps.initial_record()
    state = _run(program, state, env, owned=True)
    return tuple(output(state, i, k) for i, k in enumerate(output_keys))

  donate_argnums = tuple(range(len(input_keys))) if donate else ()
  return jax.jit(run, donate_argnums=donate_argnums)
