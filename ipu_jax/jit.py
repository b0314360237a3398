"""``ipu_jax.jit``: run a JAX function as a tile program on the emulated IPU.

::

    f = ipu_jax.jit(lambda x, w: jnp.tanh(x @ w), target=IPUTarget.preset("ipu2"))
    y = f(x, w)                      # same numbers as jax.jit
    print(f.lower(x, w).report)      # cycles and memory per tile

The function is traced to a jaxpr, every equation is lowered by its rule
into supersteps, the cost and memory models run (an out-of-memory tile raises
before anything executes) and the program is compiled into one jitted JAX
function. Programs are cached by argument shapes, dtypes and static values.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import config as config_lib
from ipu_jax.lowering.analysis import check_memory, profile_program
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.exchange import to_flat, to_storage
from ipu_jax.lowering.executor import build_function
from ipu_jax.lowering.lower import is_key_dtype, lower_closed_jaxpr
from ipu_jax.target import IPUTarget

__all__ = ["jit", "IPUFunction", "Lowered"]


def _key_data_shape(aval):
  return tuple(aval.shape) + tuple(aval.dtype._impl.key_shape)


class Lowered:
  """A lowered and compiled program: its tile program, report and function.

  Attributes:
    program: the tile program (control program of supersteps).
    profile: the :class:`~ipu_jax.lowering.profile.ProgramProfile`.
    report: the :class:`ipu_jax.Report` (cycles, memory per tile, ...).
    target: the IPU target.
  """

  def __init__(self, fn: Callable, args_flat: Sequence, in_tree, name: str,
               target: IPUTarget, options, replication_factor: int = 1,
               arg_names: Sequence[str] = ()):
    self.target = target
    self.options = options
    closed, out_shape = jax.make_jaxpr(
        lambda *flat: fn(*jax.tree_util.tree_unflatten(in_tree, flat)),
        return_shape=True)(*args_flat)
    self.jaxpr = closed
    self.out_tree = jax.tree_util.tree_structure(out_shape)
    ctx = LoweringContext(target, options)
    # Collectives cost a ring all-reduce over this many replicas.
    ctx.replication_factor = replication_factor
    self.replication_factor = replication_factor
    self._in_avals = [v.aval for v in closed.jaxpr.invars]
    inputs = []
    for i, aval in enumerate(self._in_avals):
      arg_name = arg_names[i] if i < len(arg_names) else f"arg{i}"
      shape, dtype = ((_key_data_shape(aval), np.uint32) if is_key_dtype(aval.dtype)
                      else (aval.shape, aval.dtype))
      tensor = ctx.new_tensor(shape, dtype, name=arg_name, category="variables")
      inputs.append(tensor)
    with ctx.at("argument", ""):
      outputs = lower_closed_jaxpr(ctx, closed, inputs)
    self._out_avals = [v.aval for v in closed.jaxpr.outvars]
    self.program = ctx.program
    self.inputs, self.outputs, self.constants = inputs, outputs, list(ctx.constants)
    self.profile = profile_program(self.program, target, persistent=inputs + self.constants,
                                   live_to_end=outputs, name=name)
    from ipu_jax.report import Report, maybe_auto_save
    self.report = Report(self.profile)
    if options.report_directory:
      maybe_auto_save(self.report, options.report_directory)
    check_memory(self.profile, allow_out_of_memory=options.allow_out_of_memory,
                 report=self.report, what=f"'{name}'")
    self.out_of_memory = bool(self.profile.memory.over_limit_tiles.size)
    self._function = self._build(ctx)
    self._constant_values = [to_storage(jnp.asarray(c.value).reshape(-1), c.mapping)
                             for c in self.constants]

  def _build(self, ctx):
    tensors = dict(ctx.tensors)
    for t in self.inputs + self.outputs + self.constants:
      tensors[t.id] = t
    keys_in = [t.id for t in self.inputs] + [t.id for t in self.constants]
    keys_out = [t.id for t in self.outputs]
    inner = build_function(self.program, tensors, keys_in, keys_out).__wrapped__
    in_avals, out_avals = self._in_avals, self._out_avals
    inputs, outputs = self.inputs, self.outputs

    def run(flat_args, constants):
      storages = []
      for arg, aval, tensor in zip(flat_args, in_avals, inputs):
        if is_key_dtype(aval.dtype):
          arg = jax.random.key_data(arg)
        storages.append(to_storage(jnp.reshape(arg, (-1,)).astype(tensor.dtype), tensor.mapping))
      results = inner(*storages, *constants)
      flat_out = []
      for value, aval, tensor in zip(results, out_avals, outputs):
        value = to_flat(value, tensor.mapping).reshape(tensor.shape)
        if is_key_dtype(aval.dtype):
          value = jax.random.wrap_key_data(value, impl=aval.dtype._impl)
        flat_out.append(value)
      return flat_out

    self._pure = run
    return jax.jit(run)

  def _check_runnable(self):
    if self.out_of_memory:
      raise RuntimeError("this program was lowered with allow_out_of_memory and a tile is "
                         "over its SRAM; it cannot run (read .report)")

  def __call__(self, *args_flat):
    self._check_runnable()
    flat = self._function(list(args_flat), self._constant_values)
    return jax.tree_util.tree_unflatten(self.out_tree, flat)

  def apply(self, *args_flat):
    """Run the tile program as a traceable function of the flat arguments.

    Use it inside ``jax.jit``, ``jax.vmap`` or ``jax.shard_map`` (replicas run
    the same program this way); ``__call__`` is the jitted form.
    """
    self._check_runnable()
    flat = self._pure(list(args_flat), self._constant_values)
    return jax.tree_util.tree_unflatten(self.out_tree, flat)

  @property
  def num_supersteps(self) -> int:
    return len(self.profile.steps)


def _bound_replicas():
  """Size of the replica axis when traced under it (vmap/shard_map), else None.

  Part of the cache key: a program lowered under the axis costs its
  collectives for that many replicas.
  """
  try:
    return jax.lax.axis_size("replicas")
  except NameError:
    return None


class IPUFunction:
  """The callable :func:`jit` returns."""

  def __init__(self, fn: Callable, target: Optional[IPUTarget], config,
               static_argnums: Sequence[int], donate_argnums: Sequence[int]):
    self.fn = fn
    self._target = target
    self._config = config
    self.static_argnums = tuple(sorted(static_argnums))
    self.donate_argnums = tuple(donate_argnums)
    self._cache = {}
    # Name and docstring only: a wrapped transform's attributes (pmap's
    # ``lower``, ``trace``...) must not shadow this class's methods.
    functools.update_wrapper(self, fn, updated=())

  def _settings(self):
    config = self._config if self._config is not None else config_lib.get_default_config()
    target = self._target if self._target is not None else config.to_target()
    return target, config.lowering_options(), config.replication_factor

  def _split(self, args):
    static = tuple(args[i] for i in self.static_argnums if i < len(args))
    dynamic = [a for i, a in enumerate(args) if i not in self.static_argnums]

    def call(*dyn):
      it = iter(dyn)
      full = [args[i] if i in self.static_argnums else next(it) for i in range(len(args))]
      return self.fn(*full)

    return static, dynamic, call

  def lower(self, *args) -> Lowered:
    """Lower (or fetch from the cache) the program for these arguments."""
    target, options, replicas = self._settings()
    static, dynamic, call = self._split(args)
    with_paths, in_tree = jax.tree_util.tree_flatten_with_path(dynamic)
    flat = [leaf for _, leaf in with_paths]
    avals = tuple((tuple(np.shape(x)), str(jnp.result_type(x) if not hasattr(x, "dtype") else x.dtype),
                   getattr(x, "weak_type", False)) for x in flat)
    key = (in_tree, avals, static, target, options, replicas, _bound_replicas())
    lowered = self._cache.get(key)
    if lowered is None:
      name = getattr(self.fn, "__name__", "fn")
      # Arguments are named by their pytree path: "args[0]['Dense_0']['kernel']".
      arg_names = [f"args{jax.tree_util.keystr(path)}" for path, _ in with_paths]
      lowered = Lowered(lambda *dyn: call(*dyn), flat, in_tree, name, target, options,
                        replication_factor=replicas, arg_names=arg_names)
      self._cache[key] = lowered
    return lowered

  def __call__(self, *args):
    lowered = self.lower(*args)
    _, dynamic, _ = self._split(args)
    flat, _ = jax.tree_util.tree_flatten(dynamic)
    return lowered(*flat)

  @property
  def cache_size(self) -> int:
    return len(self._cache)


def jit(fn: Callable = None, *, target: Optional[IPUTarget] = None, config=None,
        static_argnums: Sequence[int] = (), donate_argnums: Sequence[int] = ()):
  """Compile ``fn`` into a tile program for the emulated IPU.

  Args:
    fn: a JAX-traceable function (pytrees in, pytrees out).
    target: the :class:`IPUTarget`; default: the config's (``ipu2``).
    config: an :class:`ipu_jax.IPUConfig`; default: the active strategy
      scope's, or a default config.
    static_argnums: positional arguments treated as compile-time constants.
    donate_argnums: accepted for API parity with ``jax.jit``.

  Returns:
    An :class:`IPUFunction`: call it like ``fn``; ``.lower(*args)`` gives the
    :class:`Lowered` program with its ``.report``.
  """
  if isinstance(static_argnums, int):
    static_argnums = (static_argnums,)
  if fn is None:
    return functools.partial(jit, target=target, config=config,
                             static_argnums=static_argnums, donate_argnums=donate_argnums)
  return IPUFunction(fn, target, config, static_argnums, donate_argnums)
