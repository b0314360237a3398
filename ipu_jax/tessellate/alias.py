"""``install_alias()``: code written for TessellateIPU runs here unchanged.

TessellateIPU code imports ``tessellate_ipu`` (and ``tessellate_ipu.core``,
``.lax``, ``.linalg``, ``.utils`` and their modules) and compiles with
``jax.jit(f, backend="ipu")``. :func:`install_alias` (opt-in) does both:

* ``sys.modules`` entries make every ``tessellate_ipu...`` module name this
  package's module of the same concept (:data:`MODULES`);
* ``jax.jit(f, backend="ipu")`` is **routed to** :func:`ipu_jax.jit` on the
  emulated target (an ``ipu2`` with ``JAX_IPU_MODEL_NUM_TILES`` tiles, as
  TessellateIPU's IPU-model runs set it; all 1,472 when unset), and
  ``jax.devices("ipu")`` returns the emulated device. Every other backend
  and call goes to JAX untouched. ``uninstall_alias()`` restores JAX.

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

__all__ = ["install_alias", "uninstall_alias", "MODULES"]

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
  allowed = {k: v for k, v in kwargs.items()
             if k in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames")}
  return ipu_jit(fun, target=emulated_target(), verbose=0, **allowed)


def _devices(backend=None):
  """``jax.devices``, with ``"ipu"`` answered by the emulated device."""
  if backend == "ipu":
    from ipu_jax.tessellate.device import emulated_device  # pylint: disable=import-outside-toplevel
    return [emulated_device()]
  return _ORIGINAL["devices"](backend)


def install_alias(patch_jax: bool = True) -> types.ModuleType:
  """Make ``import tessellate_ipu`` resolve to :mod:`ipu_jax.tessellate`.

  Args:
    patch_jax: also route ``jax.jit(..., backend="ipu")`` to ``ipu_jax.jit``
      and answer ``jax.devices("ipu")`` with the emulated device.

  Returns:
    The module ``tessellate_ipu`` now names.
  """
  for name, target in MODULES.items():
    sys.modules[name] = importlib.import_module(target)
  if patch_jax and "jit" not in _ORIGINAL:
    _ORIGINAL["jit"], _ORIGINAL["devices"] = jax.jit, jax.devices
    jax.jit, jax.devices = _jit, _devices
  return sys.modules["tessellate_ipu"]


def uninstall_alias() -> None:
  """Undo :func:`install_alias` (module names and JAX patches)."""
  for name in MODULES:
    sys.modules.pop(name, None)
  if "jit" in _ORIGINAL:
    jax.jit, jax.devices = _ORIGINAL.pop("jit"), _ORIGINAL.pop("devices")
