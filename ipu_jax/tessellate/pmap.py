"""``jax.pmap(f, backend="ipu")`` under the alias: a pmap over emulated IPUs.

JAX runs ``jax.pmap`` as a ``shard_map`` over a one-axis mesh of the backend's
devices (``jax/_src/pmap.py``); the emulator runs a ``shard_map`` inside
``ipu_jax.jit`` as IPU replicas (``lowering/rules/parallel.py``). So a pmap over
IPUs is that ``shard_map`` over a mesh of the emulated IPUs, lowered by
``ipu_jax.jit``: the mapped arguments are sliced per replica, the body is one
replica's program (its collectives over ``axis_name`` priced over the
replicas), the outputs stacked along ``out_axes``.

JAX's own pmap cannot be reused: its mesh holds real JAX devices, and this
host has no IPU among them (nor, usually, as many CPU devices as IPUs). The
mesh here is an abstract one of the mapped size, which is all the lowering
reads. The IPUs JAX sees are ``jax.devices("ipu")``
(``JAX_IPU_DEVICE_COUNT``, :mod:`ipu_jax.tessellate.device`); a pmap over
more of them is refused before anything is traced further, as JAX refuses it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
from jax.sharding import AbstractMesh, PartitionSpec

from ipu_jax.tessellate.device import DEVICE_COUNT_ENV, emulated_devices

__all__ = ["ipu_pmap"]

# JAX's name for the axis of a pmap given none (jax/_src/pmap.py).
_DEFAULT_AXIS_NAME = "_internal_pmap_axis_name"


def _is_none(x) -> bool:
  return x is None


def _leaf_axes(prefix, tree) -> list:
  """The axis of every leaf of ``tree``, from ``prefix`` (a pytree prefix of it, None leaves)."""
  axes, treedef = jax.tree_util.tree_flatten(prefix, is_leaf=_is_none)
  subtrees = treedef.flatten_up_to(tree)
  return [axis for axis, sub in zip(axes, subtrees) for _ in jax.tree_util.tree_leaves(sub)]


def _spec(axis: Optional[int], name: str) -> PartitionSpec:
  return PartitionSpec() if axis is None else PartitionSpec(*([None] * axis), name)


def _mapped_size(leaves, axes, axis_size: Optional[int], where: str) -> int:
  """The mapped axis's size, the same along every mapped argument (as JAX checks)."""
  sizes = {int(x.shape[a]) for x, a in zip(leaves, axes) if a is not None}
  if axis_size is not None:
    sizes.add(int(axis_size))
  if not sizes:
    raise ValueError(f"{where}: no argument has a mapped axis (in_axes all None) and no "
                     "axis_size was given: pmap needs at least one mapped argument.")
  if len(sizes) > 1:
    raise ValueError(f"{where}: the mapped axes have different sizes {sorted(sizes)}; every "
                     "argument mapped by in_axes (and axis_size) must have the same size.")
  return sizes.pop()


def _check_ipus(size: int, devices: Optional[Sequence[Any]], where: str) -> None:
  """A pmap over more IPUs than JAX sees is refused, naming the variable that sets them."""
  available = len(devices) if devices is not None else len(emulated_devices())
  if size > available:
    given = "the devices given" if devices is not None else 'jax.devices("ipu")'
    raise ValueError(
        f"{where} maps {size} IPUs, but {given} has {available} device(s): set "
        f"{DEVICE_COUNT_ENV}={size} (the IPUs JAX sees, as TessellateIPU's "
        f"jax_ipu_device_count) or map an axis of at most {available}.")


def _normalized_in_axes(leaves, axes) -> list:
  return [None if a is None else int(a) % max(x.ndim, 1) for x, a in zip(leaves, axes)]


def ipu_pmap(fun: Callable, axis_name=None, *, in_axes=0, out_axes=0,
             static_broadcasted_argnums=(), devices=None, axis_size=None) -> Callable:
  """``jax.pmap`` over emulated IPUs, as a ``shard_map`` over an abstract mesh.

  Args:
    fun, axis_name, in_axes, out_axes, static_broadcasted_argnums, devices,
      axis_size: as ``jax.pmap``'s (``in_axes`` a tuple per positional
      argument, static ones included, or one prefix for all; keyword arguments
      mapped along axis 0).

  Returns:
    A function of ``fun``'s arguments building that ``shard_map``; lower it
    with ``ipu_jax.jit`` (``static_broadcasted_argnums`` as its
    ``static_argnums``) or call it inside an enclosing trace.
  """
  name = _DEFAULT_AXIS_NAME if axis_name is None else axis_name
  static = {int(i) for i in (static_broadcasted_argnums if isinstance(
      static_broadcasted_argnums, (tuple, list)) else (static_broadcasted_argnums,))}
  if any(a is not None and a < 0 for a in jax.tree_util.tree_leaves(out_axes, is_leaf=_is_none)):
    raise ValueError(f"jax.pmap(..., backend=\"ipu\") out_axes={out_axes!r}: give non-negative "
                     "axes (the output's rank is not known before the body is traced).")
  out_specs = jax.tree_util.tree_map(lambda a: _spec(a, name), out_axes, is_leaf=_is_none)
  inner = fun.func if isinstance(fun, functools.partial) else fun
  where = f"jax.pmap({getattr(inner, '__name__', type(inner).__name__)}, backend=\"ipu\")"

  def mapped(*args, **kwargs):
    num = len(args)
    static_pos = {i % num for i in static if -num <= i < num}
    dyn_pos = [i for i in range(num) if i not in static_pos]
    dyn = tuple(args[i] for i in dyn_pos)
    prefix = tuple(in_axes[i] for i in dyn_pos) if isinstance(in_axes, tuple) else in_axes
    leaves, tree = jax.tree_util.tree_flatten((dyn, kwargs))
    axes = _normalized_in_axes(leaves, _leaf_axes((prefix, 0), (dyn, kwargs)))
    size = _mapped_size(leaves, axes, axis_size, where)
    _check_ipus(size, devices, where)

    def body(*shards):
      shards = [x if a is None else lax.squeeze(x, (a,)) for x, a in zip(shards, axes)]
      shard_dyn, shard_kwargs = jax.tree_util.tree_unflatten(tree, shards)
      full = list(args)
      for i, value in zip(dyn_pos, shard_dyn):
        full[i] = value
      out = fun(*full, **shard_kwargs)
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      stacked = [x if a is None else lax.expand_dims(x, (a,))
                 for x, a in zip(out_leaves, _leaf_axes(out_axes, out))]
      return jax.tree_util.tree_unflatten(out_tree, stacked)

    mesh = AbstractMesh((size,), (name,))
    sharded = jax.shard_map(body, mesh=mesh, in_specs=tuple(_spec(a, name) for a in axes),
                            out_specs=out_specs, check_vma=False)
    return sharded(*leaves)

  mapped.__name__ = getattr(inner, "__name__", type(inner).__name__)
  mapped.__qualname__ = getattr(inner, "__qualname__", mapped.__name__)
  mapped.__doc__ = getattr(inner, "__doc__", None)
  return mapped
