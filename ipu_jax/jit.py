"""``ipu_jax.jit``: run a JAX function as a tile program on the emulated IPU.

::

    f = ipu_jax.jit(lambda x, w: jnp.tanh(x @ w), target=IPUTarget.preset("ipu2"))
    y = f(x, w)                      # same numbers as jax.jit
    print(f.lower(x, w).report)      # cycles and memory per tile

The function is traced to a jaxpr, every equation is lowered by its rule
into supersteps, the cost and memory models run (an out-of-memory tile raises
before anything executes) and the program is compiled into one jitted JAX
function: the stages ``f.trace(...)`` -> ``Traced``, ``.lower()`` ->
``Lowered``, ``.compile()`` -> ``Compiled`` of ``ipu_jax/stages.py``.
Programs are cached by argument shapes, dtypes and static values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from typing import Any, Callable, Optional, Sequence

import jax

from ipu_jax import cached_program
from ipu_jax import compile_progress
from ipu_jax.argument_names import argument_names
from ipu_jax import config as config_lib
from ipu_jax import executable_cache
from ipu_jax import host_time
from ipu_jax.lowering import host_memory
from ipu_jax.lowering.jax_compat import outside_transformations
from ipu_jax import recompilation
from ipu_jax.lowering.lower import user_call_site
from ipu_jax.lowering.replica_axis import bound_axes
from ipu_jax.compiled import ArgumentMismatch, Compiled, check_arguments
from ipu_jax.stages import Lowered, Setup, Traced
from ipu_jax.kernels.target import PRESETS, IPUTarget

__all__ = ["jit", "IPUFunction", "Compiled", "Lowered", "Traced", "check_arguments"]


logger = logging.getLogger(cached_program.LOGGER)


def _cache_aval(x) -> tuple:
  """``(shape, dtype name, weak type)`` of an argument leaf, for the lowering cache.

  A NumPy array and a ``jax.Array`` of one shape and dtype give the same key.
  A Python scalar is weakly typed, as ``jax.jit`` traces it: ``2.0 + bf16``
  stays bfloat16 where ``float32(2.0) + bf16`` is float32, so the two get
  programs of their own.
  """
  dtype = getattr(x, "dtype", None)
  if dtype is not None:  # arrays (jax and NumPy), NumPy scalars: no conversions
    return tuple(x.shape), dtype, getattr(x, "weak_type", False)
  aval = jax.typeof(x)
  return tuple(aval.shape), aval.dtype, aval.weak_type


def _tuple_of(value, kind: type, what: str) -> tuple:
  """``value`` (one ``kind`` or a sequence of them) as a tuple, else TypeError."""
  single = isinstance(value, kind) and not isinstance(value, bool)
  items = (value,) if single else value
  noun = {int: "an int or a sequence of ints", str: "a str or a sequence of str"}[kind]
  try:
    items = tuple(items)
  except TypeError:
    raise TypeError(f"ipu_jax.jit {what} must be {noun}, got {value!r}") from None
  if isinstance(value, str) and kind is not str or any(
      isinstance(i, bool) or not isinstance(i, kind) for i in items):
    raise TypeError(f"ipu_jax.jit {what} must be {noun}, got {value!r}")
  return items


def _positional_parameters(fn):
  """Names of ``fn``'s positional parameters, and whether it takes ``*args``.

  ``None`` when ``fn`` has no inspectable signature (then arguments are
  checked at the call).
  """
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):
    return None
  names, varargs, varkw = [], False, False
  for p in signature.parameters.values():
    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
      names.append(p.name)
    elif p.kind == p.VAR_POSITIONAL:
      varargs = True
    elif p.kind == p.VAR_KEYWORD:
      varkw = True
  keyword_only = [p.name for p in signature.parameters.values() if p.kind == p.KEYWORD_ONLY]
  return names, varargs, varkw, keyword_only


def _resolve_target(target) -> Optional[IPUTarget]:
  if target is None or isinstance(target, IPUTarget):
    return target
  if isinstance(target, str):
    return IPUTarget.preset(target)  # an unknown name raises, listing the presets
  raise TypeError(f"ipu_jax.jit target must be an ipu_jax.IPUTarget or a preset name "
                  f"(one of {sorted(PRESETS)}), got {type(target).__name__}: {target!r}")


def _copy_metadata(wrapper, fn) -> None:
  """Name ``wrapper`` after ``fn`` without copying ``fn``'s ``__dict__``.

  ``functools.update_wrapper`` would copy the wrapped object's attributes
  (``lower``, ``trace``, ... of ``jax.jit``/``nnx.jit``/``jax.pmap``
  functions), which would shadow this object's own methods.
  """
  inner = fn.func if isinstance(fn, functools.partial) else fn
  for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
    value = getattr(inner, attr, None)
    if isinstance(value, str):
      setattr(wrapper, attr, value)
  if not isinstance(getattr(inner, "__name__", None), str):
    wrapper.__name__ = type(inner).__name__
  wrapper.__wrapped__ = fn


class IPUFunction:
  """The callable :func:`jit` returns."""

  def __init__(self, fn: Callable, target: Optional[IPUTarget], config,
               static_argnums: Sequence[int] = (), static_argnames: Sequence[str] = (),
               donate_argnums: Sequence[int] = (), donate_argnames: Sequence[str] = (),
               positional_names: Optional[Sequence[str]] = None,
               verbose: Optional[int] = None, offload_argnums: Sequence[int] = (),
               offload_outputs: Sequence[int] = ()):
    self.fn = fn
    self.offload_argnums = tuple(offload_argnums)
    self.offload_outputs = tuple(offload_outputs)
    self.verbose = verbose
    # Names of fn's positional parameters when its signature is known: a
    # static position not passed positionally may come by keyword or default.
    self._positional_names = positional_names
    self._target = target
    self._config = config
    self.static_argnums = tuple(sorted(set(static_argnums)))
    self.static_argnames = tuple(static_argnames)
    self.donate_argnums = tuple(donate_argnums)
    self.donate_argnames = tuple(donate_argnames)
    self._cache = {}
    self._settings_memo = None
    # A loop's program (see _note_called): the last program called, the one
    # repeat calls go straight to, and those that refused arguments they fit.
    self._last_called = None
    self._repeat = None
    self._not_repeated = set()
    _copy_metadata(self, fn)

  def __get__(self, instance, owner=None):
    # Decorating a method binds ``self`` like a plain function would.
    if instance is None:
      return self
    return functools.partial(self, instance)

  def _settings(self):
    """``(target, lowering options, replicas)`` of this call's config.

    Building and checking them took a third of a small step's time, every
    call: they are kept while the config is the same object (or, with no
    config given nor set as the default, while that stays so: each call
    would otherwise build an equal fresh default), no option of any config
    has been set since, and the report directory's environment variable
    reads the same.
    """
    config = self._config if self._config is not None else config_lib.active_config()
    stamp = (config_lib.generation(), os.environ.get(config_lib.REPORT_DIR_ENV))
    memo = self._settings_memo
    if memo is not None and memo[0] is config and memo[1] == stamp:
      return memo[2]
    if config is None:
      config = config_lib.IPUConfig()
    target = self._target if self._target is not None else config.to_target()
    settings = (target, config.lowering_options(), config.replication_factor)
    self._settings_memo = (self._config if self._config is not None
                           else config_lib.active_config(), stamp, settings)
    return settings

  def _cache_directory(self) -> Optional[str]:
    """The executable cache's directory (checked writable), or None; see executable_cache.py."""
    config = self._config if self._config is not None else config_lib.get_default_config()
    directory = executable_cache.cache_directory(config.executable_cache_dir)
    if directory is not None:
      executable_cache.enable_compilation_cache(directory)
    return directory

  def _split(self, args, kwargs):
    """Static values, dynamic (args, kwargs), and ``fn`` of the dynamic ones."""
    num_args = len(args)
    static_nums = set()
    for i in self.static_argnums:
      j = i + num_args if i < 0 else i
      if self._positional_names is not None and num_args <= j < len(self._positional_names):
        continue  # passed by keyword (static by name) or left at its default
      if not 0 <= j < num_args:
        raise ValueError(
            f"jitted function '{self.__name__}' has static_argnums={self.static_argnums}, "
            f"but was called with only {num_args} positional arguments.")
      static_nums.add(j)
    static_names = [k for k in self.static_argnames if k in kwargs]
    static = []
    for key in sorted(static_nums) + static_names:
      value = args[key] if isinstance(key, int) else kwargs[key]
      try:
        hash(value)
      except TypeError:
        where = f"argument {key}" if isinstance(key, int) else f"argument '{key}'"
        raise ValueError(
            f"Non-hashable static {where} of '{self.__name__}': {type(value).__name__} "
            f"{value!r}. Static arguments must be hashable (use a tuple for a list), "
            f"or pass it as a dynamic (array) argument.") from None
      static.append((key, type(value), value))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in static_nums)
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
    static_kwargs = {k: kwargs[k] for k in static_names}

    def call(*dyn, **dyn_kw):
      it = iter(dyn)
      full = [args[i] if i in static_nums else next(it) for i in range(num_args)]
      return self.fn(*full, **dyn_kw, **static_kwargs)

    return tuple(static), (dyn_args, dyn_kwargs), call

  def trace(self, *args, **kwargs) -> Traced:
    """Trace the function for these arguments: the :class:`~ipu_jax.stages.Traced`.

    As ``jax.jit(f).trace``, nothing is cached; ``.lower()`` lowers it and
    ``.lower().compile()`` compiles it.

    Raises:
      TypeError: an argument is a Flax NNX module or optimizer (use
        ``ipu_jax.nnx_jit``).
    """
    call = self._call(args, kwargs)
    with self._progress() as progress:
      with host_memory.cycle_collection_paused():  # see Traced.lower
        return self._trace(call, "first call", progress)

  def lower(self, *args, **kwargs) -> Lowered:
    """Lower (or fetch from the cache) the program for these arguments.

    The :class:`~ipu_jax.stages.Lowered` holds the tile program, profile and
    report; calling it runs the program it compiles
    (:meth:`~ipu_jax.stages.Lowered.compile`).

    Raises:
      TypeError: an argument is a Flax NNX module or optimizer, whose in-place
        updates this function could not write back (use ``ipu_jax.nnx_jit``).
    """
    return self._lower(args, kwargs)[0]

  def _call(self, args, kwargs) -> "_Call":
    """The arguments split, flattened and keyed (see :class:`_Call`)."""
    from ipu_jax.nnx_jit import reject_graph_nodes  # nnx_jit builds on this module
    static, dynamic, fn = self._split(args, kwargs)
    # One flattening serves the graph-node check and the key; the leaves'
    # paths (a slower flattening) only where names, offload or donation need them.
    flat, in_tree = jax.tree_util.tree_flatten(dynamic)
    reject_graph_nodes(tuple(args) + tuple(kwargs.values()), self.__name__,
                       flat=None if static else (flat, in_tree))
    target, options, replicas = self._settings()
    avals = tuple(_cache_aval(x) for x in flat)
    with_paths = (jax.tree_util.tree_flatten_with_path(dynamic)[0]
                  if self.offload_argnums or self.offload_outputs or self.donate_argnums
                  else None)
    paths = lambda: [path for path, _ in (with_paths if with_paths is not None else
                                          jax.tree_util.tree_flatten_with_path(dynamic)[0])]
    offload = None
    if self.offload_argnums or self.offload_outputs:
      from ipu_jax import offload as offload_lib
      num_args = len(args)
      static_positions = {key for key, _, _ in static if isinstance(key, int)}
      dyn_positions = [i for i in range(num_args) if i not in static_positions]
      argnums = tuple(i % num_args if num_args else i for i in self.offload_argnums)
      offload = (tuple(offload_lib.offloaded_input_leaves(with_paths, argnums, dyn_positions)),
                 self.offload_outputs)
    donated = self._donated_leaves(with_paths, len(args), static)
    key = recompilation.CacheKey(in_tree, avals, static, target, options, replicas,
                                 bound_axes(), offload)
    # Arguments are named by their pytree path: "params/Dense_0/kernel".
    names = lambda: argument_names(paths(), self._dynamic_parameter_names(len(args), static))
    setup = lambda arg_names: Setup(self.__name__, target, options, replicas,
                                    tuple(arg_names), user_call_site(), offload, donated)
    return _Call(fn, flat, in_tree, key, names, setup)

  def _trace(self, call: "_Call", because: str, progress, arg_names=None) -> Traced:
    arg_names = call.arg_names() if arg_names is None else arg_names
    return Traced.trace(call.fn, call.flat, call.in_tree, call.setup(arg_names), progress,
                        host_time.HostTimes(compiled_because=because))

  def _lower(self, args, kwargs):
    """:meth:`lower`, and the flat dynamic arguments (one flattening for a call)."""
    call = self._call(args, kwargs)
    lowered = self._cache.get(call.key)
    if lowered is None:
      cache_dir = self._cache_directory()  # checked before anything is lowered
      arg_names = call.arg_names()
      because = "first call"
      if self._cache:
        because = recompilation.reason(next(reversed(self._cache)), call.key, arg_names)
        logger.info("recompiling '%s' (%d programs so far): %s",
                    self.__name__, len(self._cache), because)
      with self._progress() as progress:
        with host_memory.cycle_collection_paused():  # see Traced.lower
          traced = self._trace(call, because, progress, arg_names)
          lowered = traced.lower(progress, cache_dir=cache_dir)
      self._cache[call.key] = lowered
    return lowered, call.flat

  def _donated_leaves(self, with_paths, num_args: int, static) -> tuple:
    """Flat indices of the leaves of the donated positional arguments."""
    if not self.donate_argnums:
      return ()
    from ipu_jax import offload as offload_lib  # the same leaf numbering
    static_positions = {key for key, _, _ in static if isinstance(key, int)}
    dyn_positions = [i for i in range(num_args) if i not in static_positions]
    argnums = tuple(i % num_args if num_args else i for i in self.donate_argnums)
    return tuple(i for i, _ in offload_lib.offloaded_input_leaves(with_paths, argnums,
                                                                  dyn_positions))

  def _dynamic_parameter_names(self, num_args: int, static) -> list:
    """The parameter name of each dynamic positional argument (None where unknown)."""
    names = self._positional_names or ()
    static_positions = {key for key, _, _ in static if isinstance(key, int)}
    return [names[i] if i < len(names) else None
            for i in range(num_args) if i not in static_positions]

  def __call__(self, *args, **kwargs):
    repeat, refused = self._repeat, None
    if repeat is not None and self._repeat_applies(repeat):
      try:
        return repeat.compiled.call_tree(args, kwargs)
      except ArgumentMismatch:  # other shapes: found or lowered below
        self._repeat, refused = None, repeat.compiled
    lowered, flat = self._lower(args, kwargs)
    compiled = lowered.compile()
    if compiled.has_run:
      result = compiled.call_flat(flat)
    else:
      with self._progress() as progress:
        progress.stage("compiling (XLA)")
        result = compiled.call_flat(flat)
    self._note_called(compiled, refused)
    return result

  def _note_called(self, compiled: Compiled, refused: Optional[Compiled]) -> None:
    """Let a program called twice in a row take the next calls directly.

    A step in a loop is called with arguments of one tree and shape again
    and again: :meth:`Compiled.call_tree` lets ``jax.jit``'s dispatcher check
    and flatten them (a mismatch is found before anything runs, and the call
    comes back here). Twice in a row, so that calls alternating between two
    shapes do not pay a refused trace each; never again for a program that
    refused arguments its key then found it for (their weak types differ
    from the lowering's, say). Not for static arguments (their values are
    part of the key), inside a JAX transformation (the replica axes bound
    around the call are), nor for a program from the executable cache (its
    arguments are committed to a device first).
    """
    if compiled is refused:
      self._not_repeated.add(compiled)
    if (compiled is self._last_called and compiled not in self._not_repeated
        and not self.static_argnums and not self.static_argnames
        and not compiled.executable.exported and outside_transformations()):
      self._repeat = _RepeatCall(compiled, self._settings())
    self._last_called = compiled

  def _repeat_applies(self, repeat: "_RepeatCall") -> bool:
    """Whether the config is as when ``repeat`` was kept, outside any transformation."""
    return self._settings() is repeat.settings and outside_transformations()

  def _progress(self) -> compile_progress.CompileProgress:
    """The progress display of a compile (shown only when it is slow)."""
    verbose = self.verbose
    config = self._config if self._config is not None else config_lib.get_default_config()
    if verbose is None and not config.report.progress:
      verbose = 0
    return compile_progress.CompileProgress(self.__name__, verbose=verbose)

  @property
  def cache_size(self) -> int:
    return len(self._cache)

  def set_seed(self, seed: Optional[int] = None) -> None:
    """:meth:`Lowered.set_seed` on every program compiled so far."""
    for lowered in self._cache.values():
      lowered.set_seed(seed)


@dataclasses.dataclass(frozen=True)
class _RepeatCall:
  """The program a loop's calls go straight to (see ``IPUFunction._note_called``).

  Attributes:
    compiled: the program.
    settings: ``IPUFunction._settings()`` when it was kept (the same object
      while no config option has changed).
  """

  compiled: Compiled
  settings: tuple


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's arguments as :class:`IPUFunction` lowers them.

  Attributes:
    fn: the function of the dynamic ``(args, kwargs)`` (static ones bound).
    flat: the dynamic arguments' leaves.
    in_tree: their tree.
    key: the in-memory cache's key (``recompilation.CacheKey``).
    arg_names: ``() -> names`` of the leaves (made only when lowering).
    setup: ``(arg_names) -> stages.Setup``.
  """

  fn: Callable
  flat: list
  in_tree: Any
  key: Any
  arg_names: Callable
  setup: Callable


@dataclasses.dataclass(frozen=True)
class _ArgumentOptions:
  """:func:`jit`'s argument options, checked and as tuples.

  ``positional_names`` is set once they are checked against ``fn``'s
  signature (when it is known and takes no ``*args``).
  """

  static_argnums: tuple
  static_argnames: tuple
  donate_argnums: tuple
  donate_argnames: tuple
  offload_argnums: tuple
  offload_outputs: tuple
  positional_names: Optional[tuple] = None


def _argument_options(static_argnums, static_argnames, donate_argnums, donate_argnames,
                      offload_argnums, offload_outputs) -> _ArgumentOptions:
  """The options as tuples (TypeError for a wrong type, ValueError for a
  negative ``offload_outputs``)."""
  static_argnums = _tuple_of(static_argnums, int, "static_argnums")
  donate_argnums = _tuple_of(donate_argnums, int, "donate_argnums")
  static_argnames = _tuple_of(static_argnames, str, "static_argnames")
  donate_argnames = _tuple_of(donate_argnames, str, "donate_argnames")
  offload_argnums = _tuple_of(offload_argnums, int, "offload_argnums")
  offload_outputs = _tuple_of(offload_outputs, int, "offload_outputs")
  bad = [i for i in offload_outputs if i < 0]
  if bad:
    raise ValueError(f"ipu_jax.jit: offload_outputs={offload_outputs} must be >= 0 "
                     "(elements of the returned tuple).")
  return _ArgumentOptions(static_argnums, static_argnames, donate_argnums, donate_argnames,
                          offload_argnums, offload_outputs)


def _check_config(config) -> None:
  if config is not None and not isinstance(config, config_lib.IPUConfig):
    raise TypeError(f"ipu_jax.jit config must be an ipu_jax.IPUConfig, got "
                    f"{type(config).__name__}: {config!r}")


def _check_positions(fn, names, options: _ArgumentOptions) -> None:
  """ValueError for an argument index ``fn`` (taking ``names``, no ``*args``) lacks."""
  for what, nums in (("static_argnums", options.static_argnums),
                     ("donate_argnums", options.donate_argnums),
                     ("offload_argnums", options.offload_argnums)):
    bad = [i for i in nums if not -len(names) <= i < len(names)]
    if bad:
      raise ValueError(
          f"ipu_jax.jit: {what}={nums} but '{getattr(fn, '__name__', fn)}' takes "
          f"{len(names)} positional arguments ({', '.join(names) or 'none'}).")


def _check_names(fn, known, options: _ArgumentOptions) -> None:
  """ValueError for an argument name not among ``known`` (``fn`` takes no ``**kwargs``)."""
  for what, given in (("static_argnames", options.static_argnames),
                      ("donate_argnames", options.donate_argnames)):
    bad = [n for n in given if n not in known]
    if bad:
      raise ValueError(
          f"ipu_jax.jit: {what} {bad} are not parameters of "
          f"'{getattr(fn, '__name__', fn)}' (its parameters: {sorted(known)}).")


def _against_signature(fn, options: _ArgumentOptions) -> _ArgumentOptions:
  """``options`` checked against ``fn``'s signature (when it has one).

  Static by position means static by name too, and the other way round.
  """
  params = _positional_parameters(fn)
  if params is None:
    return options
  names, varargs, varkw, keyword_only = params
  if not varargs:
    _check_positions(fn, names, options)
    static_argnames = tuple(dict.fromkeys(
        options.static_argnames + tuple(names[i] for i in options.static_argnums)))
    static_argnums = tuple(sorted(set(
        tuple(i % len(names) for i in options.static_argnums)
        + tuple(names.index(n) for n in static_argnames if n in names))))
    options = dataclasses.replace(options, positional_names=tuple(names),
                                  static_argnums=static_argnums,
                                  static_argnames=static_argnames)
  if not varkw:
    _check_names(fn, set(names) | set(keyword_only), options)
  return options


def _check_overlap(options: _ArgumentOptions) -> None:
  overlap = sorted(set(options.offload_argnums) & set(options.static_argnums))
  if overlap:
    raise ValueError(f"ipu_jax.jit: arguments {overlap} are both static and offloaded; "
                     "a static argument is a compile-time constant with no memory.")


def jit(fn: Callable = None, *, target=None, config=None,
        static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (), donate_argnames: str | Sequence[str] = (),
        verbose: Optional[int] = None, offload_argnums: int | Sequence[int] = (),
        offload_outputs: int | Sequence[int] = ()):
  """Compile ``fn`` into a tile program for the emulated IPU.

  Args:
    fn: a JAX-traceable callable (a function, ``functools.partial``, bound
      method, callable object, or another transform's result such as
      ``jax.jit(f)``); pytrees in, pytrees out.
    target: an :class:`IPUTarget` or a preset name (``"ipu2"``); default: the
      config's (``ipu2``).
    config: an :class:`ipu_jax.IPUConfig`; default: the active strategy
      scope's, or a default config.
    static_argnums: positional arguments treated as compile-time constants
      (hashable); an int or a sequence of ints, negative counting from the end.
    static_argnames: keyword arguments treated as compile-time constants.
    donate_argnums: checked like ``jax.jit``'s; a donated positional
      argument that nothing reads after an elementwise operation with its
      shape, dtype and layout holds that operation's result in its own memory
      (an in-place update, as a Poplar variable ``x += g``), so the memory
      figures count one copy, not two (docs/cost_model.md#the-memory-model).
    donate_argnames: checked like ``jax.jit``'s and otherwise without effect.
    verbose: 0 never shows compile progress; 1 shows it when tracing,
      lowering, planning and compiling take over 2 s; None (default) follows
      ``config.report.progress`` and :func:`ipu_jax.compile_progress.verbosity`.
    offload_argnums: positional arguments whose leaves live in streaming
      memory (e.g. optimizer state), streamed onto the tiles where they are
      used (see ``ipu_jax/offload.py``).
    offload_outputs: elements of the returned tuple written back to streaming
      memory; the k-th pairs with the k-th of ``offload_argnums`` (same buffers,
      an in-place update).

  Returns:
    An :class:`IPUFunction`: call it like ``fn``; ``.lower(*args)`` gives the
    :class:`Lowered` program with its ``.report``.

  Raises:
    TypeError: ``fn`` is not callable, or an argument has the wrong type.
    ValueError: a static or donated argument index or name ``fn`` does not
      have, or an unknown target preset.

  Example:

  >>> import jax.numpy as jnp, ipu_jax
  >>> f = ipu_jax.jit(lambda x, n: x * n, target="ipu2", static_argnums=1)
  >>> f(jnp.arange(3.0), 2)
  Array([0., 2., 4.], dtype=float32)
  """
  options = _argument_options(static_argnums, static_argnames, donate_argnums,
                              donate_argnames, offload_argnums, offload_outputs)
  target = _resolve_target(target)
  _check_config(config)
  if fn is None:
    return functools.partial(jit, target=target, config=config,
                             static_argnums=options.static_argnums,
                             static_argnames=options.static_argnames,
                             donate_argnums=options.donate_argnums,
                             donate_argnames=options.donate_argnames,
                             verbose=verbose, offload_argnums=options.offload_argnums,
                             offload_outputs=options.offload_outputs)
  if not callable(fn):
    raise TypeError(f"ipu_jax.jit expects a callable, got {type(fn).__name__}: {fn!r}")
  options = _against_signature(fn, options)
  _check_overlap(options)
  return IPUFunction(fn, target, config, options.static_argnums, options.static_argnames,
                     options.donate_argnums, options.donate_argnames,
                     options.positional_names, verbose, options.offload_argnums,
                     options.offload_outputs)
