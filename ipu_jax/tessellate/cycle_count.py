"""``ipu_cycle_count``: the emulated tile cycle counter (TessellateIPU's).

On the IPU, ``ipu_cycle_count`` reads each tile's 64-bit cycle counter
(``$COUNT_L``/``$COUNT_U``) into a ``[tiles, 2]`` uint32 array (low, high
words). Here the counter is the emulator's: when the program is lowered, the
rule profiles the tile program emitted so far (the same profile the report
shows: sync + exchange + compute of every step, loops times their trip count)
and the result is that total on every tile — in the BSP model every tile
reaches the end of a superstep at the same cycle.

What it counts, exactly: the steps of the outermost program lowered before
this point, before elementwise fusion merges steps (so it may exceed the
report's fused total). Inside a loop or branch body it reads the cycles
reached where that loop or branch starts. Reading it costs no cycles, so two
successive counts differ by 0 (as TessellateIPU's IPU model reports). Outside
:func:`ipu_jax.jit` (eager or ``jax.jit`` on CPU) there is no tile program
and the count is 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import mlir

from ipu_jax.lowering.analysis import profile_program
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.tessellate.barrier import tile_data_barrier
from ipu_jax.tessellate.tile_array import TileShardedArray
from ipu_jax.tessellate.tile_gather import check_tiles

__all__ = ["ipu_cycle_count", "ipu_cycle_count_overhead", "cycle_count_p"]

cycle_count_p = jcore.Primitive("ipu_cycle_count")
cycle_count_p.multiple_results = True


def _impl(x, *, tiles):
  return x, jnp.zeros((len(tiles), 2), jnp.uint32)


def _abstract_eval(x, *, tiles):
  return x, jax.core.ShapedArray((len(tiles), 2), np.uint32)


cycle_count_p.def_impl(_impl)
cycle_count_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(cycle_count_p, mlir.lower_fun(_impl, multiple_results=True))


def split_words(cycles: int) -> np.ndarray:
  """A 64-bit count as the counter's ``[low, high]`` uint32 words."""
  cycles = int(cycles)
  return np.array([cycles & 0xFFFFFFFF, (cycles >> 32) & 0xFFFFFFFF], np.uint32)


@register_lowering(cycle_count_p)
def _cycle_count_rule(ctx: RuleContext, x, *, tiles):
  tiles_arr = np.asarray(tiles, np.int64)
  check_tiles(ctx, tiles_arr, "ipu_cycle_count")
  so_far = profile_program(ctx.module.program, ctx.target).total_cycles
  words = np.tile(split_words(round(so_far)), (len(tiles), 1))
  # A constant of the program: reading the counter adds no step (and no cycles).
  return [x, ctx.constant(words, np.uint32, name="cycle_count")]


def ipu_cycle_count(*args: TileShardedArray, **kwargs):
  """The emulated cycle counter on the tiles of the first argument.

  Args:
    *args: tile arrays the count waits for (a :func:`tile_data_barrier`).
    sync: accepted for TessellateIPU compatibility (steps always sync here).

  Returns:
    ``(*args, cycles)``: the arguments unchanged and a ``[tiles, 2]`` uint32
    :class:`TileShardedArray` of (low, high) words of the cycle count.
  """
  kwargs.pop("sync", None)
  if not args or not all(isinstance(v, TileShardedArray) for v in args):
    raise TypeError("ipu_cycle_count takes one or more TileShardedArrays.")
  if len(args) > 1:
    args = tile_data_barrier(*args)
  first, cycles = cycle_count_p.bind(args[0].array, tiles=args[0].tiles)
  return (TileShardedArray(first, args[0].tiles), *args[1:],
          TileShardedArray(cycles, args[0].tiles))


def ipu_cycle_count_overhead() -> int:
  """Cycles one count adds between two successive counts here: 0 (see the module doc)."""
  return 0


ipu_hw_cycle_count = ipu_cycle_count
