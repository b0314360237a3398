"""``install_alias()``: code written for TessellateIPU runs here unchanged.

TessellateIPU code imports ``tessellate_ipu`` (and ``tessellate_ipu.core``,
``.lax``, ``.linalg``, ``.utils`` and their modules) and compiles with
``jax.jit(f, backend="ipu")``. :func:`install_alias` (opt-in) does both:

* ``sys.modules`` entries make every ``tessellate_ipu...`` module name this
  package's module of the same concept (:data:`MODULES`);
* ``jax.jit(f, backend="ipu")`` is **routed to** :func:`ipu_jax.jit` on the
  emulated target (an ``ipu2`` with ``JAX_IPU_MODEL_NUM_TILES`` tiles, as
  TessellateIPU's IPU-model runs set it; all 1,472 when unset);
  ``jax.pmap(f, backend="ipu", ...)`` is that ``ipu_jax.jit`` of the pmap's
  ``shard_map`` over the emulated IPUs, run as replicas
  (:mod:`ipu_jax.tessellate.pmap`); ``jax.devices("ipu")`` returns the
  ``JAX_IPU_DEVICE_COUNT`` emulated devices (1 when unset). Called with
  traced arguments (inside an enclosing ``jit``/``pmap``/loop being traced),
  either is staged into that trace, as ``jax.jit`` is: the enclosing program
  lowers it as part of itself. Every other backend and call goes to JAX
  untouched. ``uninstall_alias()`` restores JAX.

Patching ``jax.jit`` is the one way unchanged TessellateIPU code can reach
the emulator (JAX has no ``ipu`` platform to register); it is why the alias
is opt-in. New code should call ``ipu_jax.jit`` directly.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types

import jax

__all__ = ["install_alias", "uninstall_alias", "MODULES", "BackendIPUFunction"]

#: TessellateIPU module name -> the module of this package answering it.
MODULES = {
    "tessellate_ipu": "ipu_jax.tessellate.compat",
    "tessellate_ipu.core": "ipu_jax.tessellate.compat",
    "tessellate_ipu.core.tile_array": "ipu_jax.tessellate.compat",
    "tessellate_ipu.core.tile_array_primitives": "ipu_jax.tessellate.tile_put",
    "tessellate_ipu.core.tile_common_utils": "ipu_jax.tessellate.ipu_types",
    "tessellate_ipu.core.tile_interpreter_primitives": "ipu_jax.tessellate.equations",
    "tessellate_ipu.core.tile_interpreter_vertex_utils": "ipu_jax.tessellate.worklists",
    "tessellate_ipu.lib": "ipu_jax.tessellate.equations",
    "tessellate_ipu.lib.pytessellate_ipu_core": "ipu_jax.tessellate.equations",
    "tessellate_ipu.core.tile_interpreter": "ipu_jax.tessellate.compat",
    "tessellate_ipu.core.tile_interpreter_hw_primitives": "ipu_jax.tessellate.cycle_count",
    "tessellate_ipu.lax": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_unary": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_binary": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_array": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_cumulative_ops": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_gather": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_scatter": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_reduce": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_small_dot": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_lax_dot": "ipu_jax.tessellate.lax",
    "tessellate_ipu.lax.tile_random": "ipu_jax.tessellate.random",
    "tessellate_ipu.linalg": "ipu_jax.tessellate.linalg",
    "tessellate_ipu.linalg.tile_linalg_jacobi": "ipu_jax.tessellate.linalg.jacobi",
    "tessellate_ipu.linalg.tile_linalg_qr": "ipu_jax.tessellate.linalg.qr",
    "tessellate_ipu.linalg.tile_linalg_hessenberg": "ipu_jax.tessellate.linalg.hessenberg",
    "tessellate_ipu.utils": "ipu_jax.tessellate.device",
}

_ORIGINAL = {}


def _traced(args, kwargs) -> bool:
  """Whether any argument is a tracer: the call is inside an enclosing trace."""
  return any(isinstance(leaf, jax.core.Tracer)
             for leaf in jax.tree_util.tree_leaves((args, kwargs)))


class BackendIPUFunction:
  """What ``jax.jit(f, backend="ipu")`` and ``jax.pmap(f, backend="ipu")`` return here.

  Called with concrete arguments it runs ``program``, an ``ipu_jax.jit``
  function (its ``lower``, ``trace``, ``cache_size``... are this object's).
  Called with tracers (inside an enclosing trace: an ``ipu_jax.jit``, a
  pmap's body, a ``fori_loop``) it calls ``staged`` instead, a plain JAX
  function that binds into that trace as ``jax.jit`` does, so the enclosing
  program lowers it with its own steps (a program of its own lowered there
  would capture the enclosing trace's tracers as its constants).
  """

  def __init__(self, program, staged):
    self._program = program
    self._staged = staged
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
      value = getattr(program, attr, None)
      if isinstance(value, str):
        setattr(self, attr, value)
    self.__wrapped__ = getattr(program, "__wrapped__", program)

  def __call__(self, *args, **kwargs):
    if _traced(args, kwargs):
      return self._staged(*args, **kwargs)
    return self._program(*args, **kwargs)

  def __getattr__(self, name):
    if name in ("_program", "_staged"):  # not set yet (copy, pickle): no recursion
      raise AttributeError(name)
    return getattr(self._program, name)

  def __get__(self, instance, owner=None):
    # Decorating a method binds ``self`` like a plain function would.
    return self if instance is None else functools.partial(self, instance)


_JIT_ARGS = ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")


def _jit(fun=None, *args, backend=None, **kwargs):
  """``jax.jit``, with ``backend="ipu"`` routed to :func:`ipu_jax.jit`."""
  if backend != "ipu":
    if fun is None:
      return functools.partial(_jit, *args, backend=backend, **kwargs)
    return _ORIGINAL["jit"](fun, *args, backend=backend, **kwargs)
  if fun is None:
    return functools.partial(_jit, backend=backend, **kwargs)
  from ipu_jax.jit import jit as ipu_jit  # pylint: disable=import-outside-toplevel
  from ipu_jax.tessellate.device import emulated_target  # pylint: disable=import-outside-toplevel
  allowed = {k: v for k, v in kwargs.items() if k in _JIT_ARGS}
  static = {k: v for k, v in allowed.items() if k.startswith("static")}
  return BackendIPUFunction(ipu_jit(fun, target=emulated_target(), verbose=0, **allowed),
                            _ORIGINAL["jit"](fun, **static))


def _pmap(fun=None, *args, backend=None, **kwargs):
  """``jax.pmap``, with ``backend="ipu"`` a pmap over the emulated IPUs."""
  if backend != "ipu":
    if fun is None:
      return functools.partial(_pmap, *args, backend=backend, **kwargs)
    return _ORIGINAL["pmap"](fun, *args, backend=backend, **kwargs)
  if fun is None:
    return functools.partial(_pmap, backend=backend, **kwargs)
  from ipu_jax.jit import jit as ipu_jit  # pylint: disable=import-outside-toplevel
  from ipu_jax.tessellate.device import emulated_target  # pylint: disable=import-outside-toplevel
  from ipu_jax.tessellate.pmap import ipu_pmap  # pylint: disable=import-outside-toplevel
  donate = kwargs.pop("donate_argnums", ())
  static = kwargs.get("static_broadcasted_argnums", ())
  mapped = ipu_pmap(fun, *args, **kwargs)
  program = ipu_jit(mapped, target=emulated_target(), verbose=0,
                    static_argnums=static if isinstance(static, (tuple, list)) else (static,),
                    donate_argnums=donate)
  return BackendIPUFunction(program, mapped)


def _devices(backend=None):
  """``jax.devices``, with ``"ipu"`` answered by the emulated devices."""
  if backend == "ipu":
    from ipu_jax.tessellate import device  # pylint: disable=import-outside-toplevel
    return device.emulated_devices()
  return _ORIGINAL["devices"](backend)


def install_alias(patch_jax: bool = True) -> types.ModuleType:
  """Make ``import tessellate_ipu`` resolve to :mod:`ipu_jax.tessellate`.

  Args:
    patch_jax: also route ``jax.jit(..., backend="ipu")`` and
      ``jax.pmap(..., backend="ipu")`` to ``ipu_jax.jit`` and answer
      ``jax.devices("ipu")`` with the emulated devices.

  Returns:
    The module ``tessellate_ipu`` now names.
  """
  for name, target in MODULES.items():
    sys.modules[name] = importlib.import_module(target)
  if patch_jax and "jit" not in _ORIGINAL:
    _ORIGINAL.update(jit=jax.jit, pmap=jax.pmap, devices=jax.devices)
    jax.jit, jax.pmap, jax.devices = _jit, _pmap, _devices
  return sys.modules["tessellate_ipu"]


def uninstall_alias() -> None:
  """Undo :func:`install_alias` (module names and JAX patches)."""
  for name in MODULES:
    sys.modules.pop(name, None)
  if "jit" in _ORIGINAL:
    jax.jit, jax.pmap, jax.devices = (_ORIGINAL.pop("jit"), _ORIGINAL.pop("pmap"),
                                      _ORIGINAL.pop("devices"))
