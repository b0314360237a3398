"""``tile_data_barrier``: make tile arrays ready together (TessellateIPU's barrier).

On the IPU, TessellateIPU's barrier is one compute set whose vertex touches
every input on every tile, so that everything after it waits for all the
inputs. In the emulated tile program every superstep already ends with a sync
of all tiles (BSP), so the barrier adds no step: its tile rule returns its
inputs unchanged. It still checks what TessellateIPU checks: the inputs'
dtypes must have one size (its vertex reinterprets them as one type).
"""

from __future__ import annotations

import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.tessellate.tile_array import TileShardedArray

__all__ = ["tile_data_barrier", "tile_barrier", "tile_data_barrier_p"]

tile_data_barrier_p = jcore.Primitive("tile_data_barrier")
tile_data_barrier_p.multiple_results = True
tile_data_barrier_p.def_impl(lambda *args, **_: tuple(args))
tile_data_barrier_p.def_abstract_eval(lambda *avals, **_: tuple(avals))
mlir.register_lowering(tile_data_barrier_p,
                       mlir.lower_fun(lambda *a, **_: tuple(a), multiple_results=True))
ad.deflinear2(tile_data_barrier_p, lambda cts, *args, **_: [ad.instantiate_zeros(c) for c in cts])
batching.primitive_batchers[tile_data_barrier_p] = (
    lambda args, dims, **params: (tile_data_barrier_p.bind(*args, **params), dims))


@register_lowering(tile_data_barrier_p)
def _tile_data_barrier_rule(ctx: RuleContext, *args, inputs_tiles):
  del ctx, inputs_tiles
  return list(args)


def tile_data_barrier(*args: TileShardedArray):
  """A barrier over tile sharded arrays: returns them, ready together.

  Args:
    *args: :class:`TileShardedArray` inputs.

  Returns:
    The single input itself for one argument (no barrier needed), else a
    tuple of the inputs.

  Raises:
    TypeError: an input is not a TileShardedArray, or the dtypes differ in
      size (TessellateIPU's barrier vertex reads them as one type).
  """
  if not all(isinstance(v, TileShardedArray) for v in args):
    raise TypeError("tile_data_barrier takes TileShardedArrays only.")
  if len(args) == 1:
    return args[0]
  sizes = {np.dtype(v.dtype).itemsize for v in args}
  if len(sizes) > 1:
    raise TypeError("tile_data_barrier supports dtypes of one size only; got "
                    f"{sorted({str(np.dtype(v.dtype)) for v in args})}.")
  outs = tile_data_barrier_p.bind(*[v.array for v in args],
                                  inputs_tiles=tuple(v.tiles for v in args))
  return tuple(TileShardedArray(o, v.tiles) for o, v in zip(outs, args))


tile_barrier = tile_data_barrier
