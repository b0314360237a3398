"""``tile_map``: one vertex per tile over tile sharded arrays (TessellateIPU's).

``tile_map(primitive, *arrays, **attributes)`` runs ``primitive`` on every
tile of the arrays' tiles, tile ``tiles[i]`` on shard ``i`` of each operand,
and returns :class:`TileShardedArray` results on the same tiles. Two kinds of
primitive are mapped:

* JAX's own primitives (``lax.add_p``, ``lax.exp_p``, ``lax.reduce_sum_p``...)
  and any primitive with a batching rule: the vertex computes
  ``primitive.bind(*shards, **attributes)``, priced per tile as a popops
  elementwise vertex over the tile's elements (poplibs' figures where
  published, else the generic per-vector estimate:
  :func:`ipu_jax.kernels.estimators.elementwise_cycles`).
* Vertex primitives made by :func:`create_ipu_tile_primitive` /
  :func:`declare_ipu_tile_primitive`: priced at the ``perf_estimate`` the
  vertex declares (as Poplar's ``setPerfEstimate``); their body is the C++
  vertex of their ``gp_filename`` (:mod:`ipu_jax.tessellate.cpp_vertex`) or
  the primitive's Python ``impl`` (``def_impl``), vmapped over the tiles.

Both go through :func:`ipu_jax.ops.tile_map` (one superstep: each shard
exchanged onto its tile, one vertex per tile).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import batching

from ipu_jax.kernels import estimators
from ipu_jax.kernels.codelet import Codelet
from ipu_jax.ops.tile_map import tile_map as _ops_tile_map
from ipu_jax.tessellate.tile_array import TileShardedArray, tiles_tuple

__all__ = ["tile_map", "VertexSpec", "register_vertex", "register_same_as",
           "register_attribute_adapter", "vertex_spec"]


@dataclasses.dataclass(frozen=True)
class VertexSpec:
  """How a vertex primitive runs on one tile.

  Attributes:
    vertex_name: the vertex type (templated by the operands' dtypes).
    body: ``body(primitive, attributes) -> fn(*shards) -> outputs`` on one
      tile's operands, or None to use the primitive's ``impl``.
    perf_estimate: ``perf_estimate(in_avals, attributes) -> cycles`` of one
      vertex.
    supervisor: the estimate is the whole tile's cycles (a vertex driving all
      six workers, as TessellateIPU's linear-algebra vertices do); otherwise
      it is one worker's, and a lone worker vertex takes a sixth of the
      tile's issue slots (Poplar's ``setPerfEstimate`` convention).
  """

  vertex_name: Callable[[Sequence], str]
  perf_estimate: Callable[[Sequence, Dict], int]
  body: Optional[Callable] = None
  supervisor: bool = False


_VERTICES: Dict[Any, VertexSpec] = {}
_SAME_AS: Dict[Any, Any] = {}


_ADAPTERS: Dict[Any, Callable[[dict], dict]] = {}


def register_attribute_adapter(primitive, adapt: Callable[[dict], dict]) -> None:
  """Turn TessellateIPU-style attributes of ``primitive`` into its JAX params.

  (``dot_general``'s ``ipu_vertex_type`` choice of AMP vertex, JAX 0.3's
  single ``precision``...)
  """
  _ADAPTERS[primitive] = adapt


def register_same_as(primitive, original) -> None:
  """Map ``primitive`` as ``original`` (TessellateIPU's in-place clones: ``add_inplace_p``)."""
  _SAME_AS[primitive] = original


def register_vertex(primitive, spec: VertexSpec) -> None:
  """Declare ``primitive`` a vertex primitive run as ``spec`` says."""
  _VERTICES[primitive] = spec


def vertex_spec(primitive) -> Optional[VertexSpec]:
  """The :class:`VertexSpec` of a vertex primitive, None for other primitives."""
  return _VERTICES.get(primitive)


# JAX's params that newer JAX requires and TessellateIPU's code (written for
# JAX 0.3) does not pass: their defaults, filled in when missing.
_DEFAULT_PARAMS = {"accuracy": None, "sharding": None, "out_sharding": None}


def _complete_params(primitive, params: dict, avals) -> dict:
  """``params`` plus the defaults newer JAX expects for ``primitive``.

  A default is added only when the primitive does not lower without it and
  does with it (checked once per primitive, parameter names and shapes).
  """
  key = (primitive, tuple(sorted(params)), avals)
  if key not in _COMPLETIONS:
    names = {}
    for name, value in _DEFAULT_PARAMS.items():
      if name not in params and not _lowers(primitive, {**params, **names}, avals):
        if _lowers(primitive, {**params, **names, name: value}, avals):
          names[name] = value
    _COMPLETIONS[key] = names
  return {**params, **_COMPLETIONS[key]}


_COMPLETIONS: Dict[tuple, dict] = {}


def _lowers(primitive, params, avals) -> bool:
  try:
    jax.jit(lambda *xs: primitive.bind(*xs, **params)).lower(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return True
  except Exception:  # pylint: disable=broad-except
    return False


def _tuples(value):
  """Lists (nested in plain tuples too) as tuples; named tuples stay as they are."""
  if isinstance(value, list) or type(value) is tuple:  # pylint: disable=unidiomatic-typecheck
    return tuple(_tuples(v) for v in value)
  return value


def _hashable(value):
  if isinstance(value, np.ndarray):
    return ("ndarray", value.shape, str(value.dtype), value.tobytes())
  if isinstance(value, (list, tuple)):
    return tuple(_hashable(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
  try:
    hash(value)
    return value
  except TypeError:
    return ("repr", repr(value))


def _lax_cycles(primitive):
  """Per-tile cycles of a JAX primitive's vertex (an elementwise pass)."""
  def cycles(target, *specs):
    largest = max(specs, key=lambda s: int(np.prod(s.shape, dtype=np.int64)))
    elements = int(np.prod(largest.shape, dtype=np.int64))
    dtype = np.dtype(specs[-1].dtype)
    return int(np.max(estimators.elementwise_cycles(
        target, elements, primitive.name, dtype.itemsize,
        dtype=dtype if jnp.issubdtype(dtype, jnp.floating) else None)))
  return cycles


def _is_impl_only(primitive, tile_avals) -> bool:
  """A primitive with operands, an eager ``impl`` and no batching rule: its impl is vmapped.

  (JAX's primitives with operands all batch; those without operands, like
  ``iota_p``, are bound directly.)
  """
  return (bool(tile_avals) and "impl" in vars(primitive)
          and primitive not in batching.fancy_primitive_batchers)


def _primitive_fn(primitive, params: dict, tile_avals: tuple) -> Callable:
  """One tile's computation of ``primitive`` with ``params``."""
  spec = vertex_spec(primitive)
  if spec is not None and spec.body is not None:
    return spec.body(primitive, params)
  if not _is_impl_only(primitive, tile_avals):
    bind = lambda *xs: primitive.bind(*xs, **params)
  else:
    bind = lambda *xs: primitive.impl(*xs, **params)

  def fn(*xs):
    out = bind(*xs)
    if primitive.multiple_results:
      return tuple(jnp.asarray(o) for o in out)
    return jnp.asarray(out)
  return fn


_CODELETS: Dict[tuple, Codelet] = {}


def _codelet(primitive, params: dict, tile_avals: tuple) -> Codelet:
  """The codelet of ``primitive`` on shards ``tile_avals`` (one per parameter set).

  Kept so that a second trace reuses the same codelet, and a jit cache keyed
  by the equation's parameters hits.
  """
  key = (primitive, _hashable(params), tile_avals)
  if key in _CODELETS:
    return _CODELETS[key]
  spec = vertex_spec(primitive)
  fn = _primitive_fn(primitive, params, tile_avals)
  body = fn if tile_avals else (lambda _dummy: fn())
  if spec is not None:
    cycles = int(spec.perf_estimate(tile_avals, params))
    if spec.supervisor:
      codelet = Codelet(spec.vertex_name(tile_avals), body,
                        cycles=lambda target, *specs: cycles, supervisor=True)
    else:
      codelet = Codelet(spec.vertex_name(tile_avals), body, cycles=lambda *specs: cycles)
  else:
    codelet = Codelet(primitive.name, body, cycles=_lax_cycles(primitive), supervisor=True)
  _CODELETS[key] = codelet
  return codelet


def _check_inputs(inputs: Sequence, tiles) -> tuple:
  if not all(isinstance(v, TileShardedArray) for v in inputs):
    raise TypeError("tile_map inputs must be TileShardedArrays (use tile_put_sharded or "
                    f"tile_put_replicated first); got {[type(v).__name__ for v in inputs]}.")
  for v in inputs[1:]:
    if v.tiles != inputs[0].tiles:
      raise ValueError(f"Inconsistent tile mapping between tile_map inputs: {inputs[0].tiles} "
                       f"vs {v.tiles}; move them onto the same tiles (tile_gather).")
  if tiles is None:
    if not inputs:
      raise ValueError("tile_map with no inputs needs tiles=.")
    return inputs[0].tiles
  tiles = tiles_tuple(tiles)
  if inputs and tiles != inputs[0].tiles:
    raise ValueError(f"tile_map: tiles={tiles} differ from the inputs' tiles {inputs[0].tiles}.")
  return tiles


def tile_map(primitive, *args: TileShardedArray, **kwargs):
  """Map ``primitive`` over tiles: one vertex per tile on its shards.

  Args:
    primitive: a JAX primitive (``lax.abs_p``...) or a vertex primitive from
      :func:`create_ipu_tile_primitive`; ``None`` returns the inputs.
    *args: :class:`TileShardedArray` operands, all on the same tiles.
    **kwargs: the primitive's attributes; ``tiles=`` (needed when there is no
      input) and ``sync=`` (accepted; every superstep starts with a sync here).

  Returns:
    A :class:`TileShardedArray`, or a tuple of them for a primitive with
    several results.
  """
  inputs = list(args)
  tiles = kwargs.pop("tiles", None)
  kwargs.pop("sync", None)
  if primitive is None:
    return tuple(inputs)
  if not (hasattr(primitive, "bind") and hasattr(primitive, "name")):
    raise TypeError(f"tile_map maps a JAX primitive (e.g. lax.exp_p) or a vertex primitive "
                    f"(create_ipu_tile_primitive); got {type(primitive).__name__} "
                    f"{getattr(primitive, '__name__', primitive)!r}.")
  primitive = _SAME_AS.get(primitive, primitive)
  # JAX's params are hashable: TessellateIPU code passes lists (``axes=[0]``).
  kwargs = {k: _tuples(v) for k, v in kwargs.items()}
  if primitive in _ADAPTERS:
    kwargs = _ADAPTERS[primitive](dict(kwargs))
  tiles = _check_inputs(inputs, tiles)
  tile_avals = tuple(jax.core.ShapedArray(v.tile_shape, v.dtype) for v in inputs)
  if vertex_spec(primitive) is None and not _is_impl_only(primitive, tile_avals):
    kwargs = _complete_params(primitive, kwargs, tile_avals)
  codelet = _codelet(primitive, kwargs, tile_avals)
  arrays = [v.array for v in inputs] or [jnp.zeros((len(tiles), 0), jnp.float32)]
  outs = _ops_tile_map(codelet, *arrays, tiles=tiles)
  if isinstance(outs, (tuple, list)):
    return tuple(TileShardedArray(o, tiles) for o in outs)
  return TileShardedArray(outs, tiles)
