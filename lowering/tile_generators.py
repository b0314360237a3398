"""The tiles' hardware random number generators and their per-tile state.

Each tile's six worker contexts have their own xoroshiro128aox stream
(``kernels/xoroshiro.py``). Stochastic rounding (``ipu_jax/rounding.py``) and
the hardware mode of ``random_bits`` (``lowering/rules/random.py``) draw from
the same streams, as on the chip: one ``[tiles, WORKERS, 4]`` state tensor per
program and seed, kept as device state between runs and rebuilt by
``set_seed`` (``ipu_jax/compiled.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.kernels import xoroshiro
from ipu_jax.lowering import program as P
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.replica_axis import REPLICA_AXIS, replica_index_value

__all__ = ["HARDWARE_BITS_VERTEX", "PRNG_STATE", "WORKERS", "draw_tile_words", "mix_replica",
           "prng_state", "prng_state_value"]

WORKERS = 6  # worker contexts per tile, each with its own generator stream

#: First element of the :meth:`LoweringContext.program_state` key of the
#: tiles' generator state (the key is ``(PRNG_STATE, seed)``).
PRNG_STATE = "hw_prng_state"

#: The vertex that fills a tile's share of ``random_bits`` in hardware mode
#: (poprand's ``Uniform<int>`` with ``scale == 0``: raw 32-bit words).
HARDWARE_BITS_VERTEX = vocab.vertex(vocab.RANDOM, "xoroshiro128aox")


def prng_state_value(num_tiles: int, seed: int) -> np.ndarray:
  """``[num_tiles, WORKERS, 4]`` uint32: every generator as ``seed`` sets it."""
  return xoroshiro.seed_states(seed, np.arange(num_tiles * WORKERS)).reshape(
      num_tiles, WORKERS, 4)


def prng_state(ctx, seed: int) -> P.Tensor:
  """The program's per-tile generator state (made on first use, one per seed).

  One ``[tiles, WORKERS, 4]`` uint32 tensor for the whole program, shared by
  every user of the generators (stochastic rounding, hardware ``random_bits``),
  so each draw continues where the last one left the streams; the executable
  keeps its final value as device state (``ipu_jax/stages.py`` finds it by
  :data:`PRNG_STATE`).
  """
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


def mix_replica(states):
  """Perturb s0 of every stream by this replica's index (identity on replica 0).

  One seed for the program (Poplar's ``setSeed``); each replica's streams
  differ by its index, so replicas draw different numbers
  (docs/number_formats.md#random-numbers).
  """
  r = replica_index_value(REPLICA_AXIS).astype(jnp.uint32)
  lo = r * jnp.uint32(0x9E3779B9)
  hi = r * jnp.uint32(0x85EBCA6B)
  mix = jnp.stack([lo, hi, jnp.uint32(0), jnp.uint32(0)])
  return states ^ mix


def draw_tile_words(states, words: int):
  """``words`` uint32 per row from each row's ``WORKERS`` streams.

  Args:
    states: ``[rows, WORKERS, 4]`` uint32 generator states (one tile each).
    words: 32-bit words each row needs (static).

  Returns:
    ``(words [rows, words] uint32, new states)``: word ``j`` of a row comes
    from round ``j // (2 * WORKERS)``, worker ``(j // 2) % WORKERS``, half
    ``j % 2``, the workers interleaved as their 64-bit stores are.
  """
  rows = states.shape[0]
  rounds = -(-words // (2 * WORKERS))
  bits, states = xoroshiro.draw(states, rounds)           # [rounds, rows, W, 2]
  bits = jnp.transpose(bits, (1, 0, 2, 3)).reshape(rows, -1)[:, :words]
  return bits, states
