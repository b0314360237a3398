"""Tile rule of ``hw_round``: the chip's rounding under its FP behaviour.

Tile plan: elementwise on the operand's tiles, the result keeps the operand's
mapping. With stochastic rounding each tile rounds its elements with bits from
its own six xoroshiro128aox streams (one per worker), whose state is a
``[tiles, 6, 4]`` uint32 tensor of the program: created once per program from
the configured seed, read and advanced by every stochastic rounding, so each
rounding, in loops too, draws new bits. ``ipu_jax.jit`` keeps its final value
as the executable's device state: the next run starts where this one ended
(``Lowered.set_seed`` resets it). Costed as a cast plus one random draw
per element (the hardware produces 64 random bits per cycle per tile).
See :mod:`ipu_jax.rounding`.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.rounding import WORKERS, hw_round_p, round_tile_rows, _round_nearest
from ipu_jax.kernels import xoroshiro

# As ``stochastic_round``: the cast plus a 32-bit random draw per element.
_SR_CYCLES_PER_VECTOR = 3


#: First element of the :meth:`LoweringContext.program_state` key of the
#: generator state (the key is ``(PRNG_STATE, seed)``).
PRNG_STATE = "hw_prng_state"


def prng_state_value(num_tiles: int, seed: int) -> np.ndarray:
  """``[num_tiles, WORKERS, 4]`` uint32: every generator as ``seed`` sets it."""
  return xoroshiro.seed_states(seed, np.arange(num_tiles * WORKERS)).reshape(
      num_tiles, WORKERS, 4)


def prng_state(ctx, seed: int) -> P.Tensor:
  """The program's per-tile generator state (made on first use, one per seed)."""
  module = ctx.module

  def make():
    n = module.target.num_tiles
    value = prng_state_value(n, seed)
    mapping = TileMapping.blocks(n * WORKERS * 4, WORKERS * 4, n, 0)
    state = P.Tensor("hw_prng_state", value.shape, np.dtype(np.uint32), mapping,
                     category="constants", value=value, op=ctx.op, source=ctx.source,
                     scope=module.scope)
    module.tensors[state.id] = state
    module.constants.append(state)
    return state

  return module.program_state((PRNG_STATE, int(seed)), make)


@register_lowering(hw_round_p)
def _hw_round_rule(ctx, x, *, dtype, stochastic, saturate, replica_identical, seed, site):
  del site  # the persistent per-tile state gives every rounding new bits
  target = ctx.target
  out = ctx.new_tensor(x.shape, dtype, x.mapping, name="hw_round")
  if x.size == 0:
    return [out]
  elements = x.mapping.elements_per_tile(target.num_tiles)
  if not stochastic:
    ctx.emit(P.Superstep(
        name="hw_round/nearest", op=ctx.op, reads=(x,), writes=(out,),
        fn=lambda x_s: (_round_nearest(x_s, dtype, saturate),),
        compute_cycles=estimators.elementwise_cycles(target, elements, "convert_element_type",
                                                     x.itemsize, dtype=dtype, in_dtype=x.dtype),
        vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST,),
        flops=int(x.size)))
    return [out]
  state = prng_state(ctx, seed)
  row_tiles = np.asarray(x.mapping.tiles, np.int64)
  n = target.num_tiles

  def fn(x_s, st_s):
    st = st_s.reshape(n, WORKERS, 4)
    rounded, new = round_tile_rows(x_s, st[row_tiles], dtype, saturate=saturate,
                                   replica_identical=replica_identical)
    st = st.at[row_tiles].set(new)
    return rounded, st.reshape(st_s.shape)

  ctx.emit(P.Superstep(
      name="hw_round/stochastic", op=ctx.op, reads=(x, state), writes=(out, state), fn=fn,
      compute_cycles=estimators.worker_split_cycles(target, elements, _SR_CYCLES_PER_VECTOR,
                                                    x.itemsize),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST_STOCHASTIC_ROUND,),
      flops=int(x.size)))
  return [out]
