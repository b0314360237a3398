"""Tile random numbers from the tiles' hardware generators (TessellateIPU's ``tile_random``).

``tile_random_uniform`` / ``tile_random_normal`` draw on every tile of
``tiles`` from that tile's own generators: the six per-worker
xoroshiro128aox streams the emulated chip keeps for the whole program
(``lowering/tile_generators.py``, seeded by ``floating_point_behaviour.seed``
and kept as device state), so successive draws continue the streams.
``tile_get_hw_seeds`` / ``tile_set_hw_seeds`` read and write those streams'
state (``[tiles, 6, 4]`` uint32). Priced with poprand's vertex estimators
(:mod:`ipu_jax.kernels.poprand`).

Distributions follow poprand's vertices: ``Uniform<float|half>`` gives
``offset + scale * (u - 1/2)`` with ``u`` uniform in ``[0, 1)`` (so
``offset=1, scale=2`` spans ``[0, 2]``); ``Uniform<int>`` gives integers in
``[offset, offset + scale)``; ``Normal`` gives ``mean + stddev * z``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import mlir

from ipu_jax.kernels import poprand
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import storage
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import to_flat
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.tile_generators import WORKERS, draw_tile_words, prng_state, prng_state_value
from ipu_jax.tessellate.tile_array import TileShardedArray, tiles_tuple
from ipu_jax.tessellate.tile_gather import check_tiles, place, slice_mapping

__all__ = ["tile_random_uniform", "tile_random_normal", "tile_get_hw_seeds",
           "tile_set_hw_seeds", "tile_random_p"]

tile_random_p = jcore.Primitive("tile_random")
_SUPPORTED = {"uniform": (np.float16, np.float32, np.int32), "normal": (np.float16, np.float32),
              "get_seeds": (np.uint32,)}


def _shape(kind, size, tiles):
  return (len(tiles), WORKERS, 4) if kind.endswith("_seeds") else (len(tiles), size)


def _abstract_eval(*_, kind, tiles, size, dtype, a, b):
  del a, b
  return jax.core.ShapedArray(_shape(kind, size, tiles), np.dtype(dtype))


def _from_words(words, kind, dtype, a, b):
  """``words`` ([tiles, n] uint32) turned into the distribution's values."""
  dtype = np.dtype(dtype)
  u = (words >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)  # [0, 1)
  if kind == "uniform" and dtype.kind == "i":
    return (jnp.int32(a) + (words % jnp.uint32(max(int(b), 1))).astype(jnp.int32)).astype(dtype)
  if kind == "uniform":
    return (np.float32(a) + np.float32(b) * (u - 0.5)).astype(dtype)
  n = words.shape[1] // 2
  u1 = 1.0 - u[:, :n]  # (0, 1]: log is finite
  u2 = u[:, n:2 * n]
  z = jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(np.float32(2 * np.pi) * u2)
  return (np.float32(a) + np.float32(b) * z).astype(dtype)


def _words_needed(kind, size) -> int:
  return 2 * size if kind == "normal" else size


def _impl(*operands, kind, tiles, size, dtype, a, b):
  # Off the tile program: the generators as seed 0 sets them.
  if kind == "set_seeds":
    return operands[0]
  if kind == "get_seeds":
    return jnp.asarray(prng_state_value(max(tiles) + 1, 0)[np.asarray(tiles)])
  states = jnp.asarray(prng_state_value(max(tiles) + 1, 0)[np.asarray(tiles)])
  words, _ = draw_tile_words(states, _words_needed(kind, size))
  return _from_words(words, kind, dtype, a, b)


tile_random_p.def_impl(_impl)
tile_random_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(tile_random_p, mlir.lower_fun(_impl, multiple_results=False))


def _cycles(target, kind, dtype, size, tiles_arr):
  per_tile = np.zeros(target.num_tiles, np.int64)
  per_tile[tiles_arr] = size
  bits = np.dtype(dtype).itemsize * 8
  if kind == "normal":
    return poprand.normal_cycles(per_tile, target.worker_contexts, bits)
  if kind == "uniform" and np.dtype(dtype).kind == "i":
    return poprand.uniform_int_bits_cycles(per_tile, target.worker_contexts)
  if kind == "uniform":
    return poprand.uniform_cycles(per_tile, target.worker_contexts, bits)
  return None


@register_lowering(tile_random_p)
def _tile_random_rule(ctx: RuleContext, *operands, kind, tiles, size, dtype, a, b):
  target, n = ctx.target, ctx.target.num_tiles
  tiles_arr = np.asarray(tiles, np.int64)
  check_tiles(ctx, tiles_arr, f"tile_random ({kind})")
  state = prng_state(ctx, ctx.options.rounding_seed)
  shape = _shape(kind, size, tiles)
  out = ctx.new_tensor(shape, np.dtype(dtype), slice_mapping(shape, tiles_arr), name=kind)
  words = _words_needed(kind, size)

  if kind == "set_seeds":
    seeds = operands[0]

    def fn(seeds_s, st_s):
      new = to_flat(seeds_s, seeds.mapping).reshape(shape)
      st = st_s.reshape(n, WORKERS, 4).at[tiles_arr].set(new)
      return storage(new, out), st.reshape(st_s.shape)
    reads = (seeds, state)
  else:
    def fn(st_s):
      st = st_s.reshape(n, WORKERS, 4)
      if kind == "get_seeds":
        return storage(st[tiles_arr], out), st_s
      drawn, new = draw_tile_words(st[tiles_arr], words)
      st = st.at[tiles_arr].set(new)
      return storage(_from_words(drawn, kind, dtype, a, b), out), st.reshape(st_s.shape)
    reads = (state,)
  cycles = _cycles(target, kind, dtype, size, tiles_arr)
  ctx.emit(P.Superstep(
      name=f"tile_random/{kind}", op=ctx.op, reads=reads, writes=(out, state), fn=fn,
      compute_cycles=cycles, vertices=P.worker_vertices(ctx, np.isin(np.arange(n), tiles_arr)),
      codelets=(vocab.vertex(vocab.RANDOM, kind),)))
  return [out]


def _draw(kind, tiles, size, dtype, a, b, *operands):
  tiles = tiles_tuple(tiles)
  dtype = np.dtype(dtype)
  if kind in _SUPPORTED and dtype not in [np.dtype(d) for d in _SUPPORTED[kind]]:
    raise TypeError(f"tile_random {kind}: dtype {dtype} not supported; use one of "
                    f"{[np.dtype(d).name for d in _SUPPORTED[kind]]}.")
  out = tile_random_p.bind(*operands, kind=kind, tiles=tiles, size=int(size), dtype=dtype,
                           a=float(a), b=float(b))
  return TileShardedArray(out, tiles)


def tile_random_uniform(tiles, size: int, dtype, offset: float = 0.0,
                        scale: float = 1.0) -> TileShardedArray:
  """``size`` uniform samples on every tile of ``tiles`` (``[len(tiles), size]``)."""
  return _draw("uniform", tiles, size, dtype, offset, scale)


def tile_random_normal(tiles, size: int, dtype, mean: float = 0.0,
                       stddev: float = 1.0) -> TileShardedArray:
  """``size`` normal samples on every tile of ``tiles`` (``[len(tiles), size]``)."""
  return _draw("normal", tiles, size, dtype, mean, stddev)


def tile_get_hw_seeds(tiles) -> TileShardedArray:
  """The generators' state on ``tiles``: ``[len(tiles), 6, 4]`` uint32."""
  return _draw("get_seeds", tiles, 0, np.uint32, 0, 0)


def tile_set_hw_seeds(seeds: TileShardedArray) -> TileShardedArray:
  """Set the generators' state on ``seeds.tiles`` (``[tiles, 6, 4]`` uint32); returns ``seeds``."""
  if tuple(seeds.tile_shape) != (WORKERS, 4) or np.dtype(seeds.dtype) != np.uint32:
    raise ValueError(f"tile_set_hw_seeds: seeds must be [tiles, {WORKERS}, 4] uint32; got "
                     f"{seeds.shape} {seeds.dtype}.")
  data = place(seeds.array, range(len(seeds.tiles)), seeds.tiles, name="tile_put_sharded")
  out = tile_random_p.bind(data, kind="set_seeds", tiles=seeds.tiles, size=0,
                           dtype=np.dtype(np.uint32), a=0.0, b=0.0)
  return TileShardedArray(out, seeds.tiles)
