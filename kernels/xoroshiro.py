"""The IPU's hardware random number generator, xoroshiro128aox.

Every IPU tile has a generator of 128 bits of state (James Hanlon, "A
hardware-friendly pseudorandom number generator", IEEE Trans. Computers 2022,
arXiv:2203.04058, and his Graphcore note on it): Vigna's xoroshiro128 linear
state update with shifts (a, b, c) = (55, 14, 36), and an output "scrambler"
made only of AND, OR and XOR gates (AOX), cheaper in silicon than
xoroshiro128+'s 64-bit add::

  sx  = s0 ^ s1
  sa  = s0 & s1
  out = sx ^ (rotl(sa, 1) | rotl(sa, 2))       # 64 random bits
  s0  = rotl(s0, 55) ^ sx ^ (sx << 14)
  s1  = rotl(sx, 36)

Here the 64-bit words are pairs of uint32 (``lo``, ``hi``), so the generator
runs in JAX without 64-bit mode; :func:`reference_numpy` is the same algorithm
in NumPy ``uint64`` for tests. Streams are seeded with splitmix64 (Vigna's
recommended seeder for the xoroshiro family) from ``(seed, stream id)`` and
warmed up for 12 steps, as Hanlon's test harness does.

One stream per (tile, worker context): the six workers of a tile each draw
from their own stream, so a tile produces up to 6 x 64 bits per round.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["SHIFTS", "seed_states", "next_u64", "draw", "reference_numpy", "WARMUP"]

SHIFTS = (55, 14, 36)
WARMUP = 12
_M64 = (1 << 64) - 1


# -- NumPy uint64 reference (and seeding, done at lowering time) --------------


def _rotl_np(x, k):
  return (x << np.uint64(k)) | (x >> np.uint64(64 - k))


def _aox_step_np(s0, s1):
  a, b, c = SHIFTS
  sx = s0 ^ s1
  sa = s0 & s1
  out = sx ^ (_rotl_np(sa, 1) | _rotl_np(sa, 2))
  s0 = _rotl_np(s0, a) ^ sx ^ (sx << np.uint64(b))
  s1 = _rotl_np(sx, c)
  return out, s0, s1


def reference_numpy(s0, s1, n: int):
  """``n`` outputs of xoroshiro128aox from uint64 states ``s0``, ``s1`` (any shape).

  Returns ``(outputs [n, ...], s0, s1)``.
  """
  s0, s1 = np.asarray(s0, np.uint64).copy(), np.asarray(s1, np.uint64).copy()
  outs = []
  with np.errstate(over="ignore"):
    for _ in range(n):
      out, s0, s1 = _aox_step_np(s0, s1)
      outs.append(out)
  return np.stack(outs) if outs else np.zeros((0,) + s0.shape, np.uint64), s0, s1


def _splitmix64(x):
  with np.errstate(over="ignore"):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seed_states(seed: int, streams) -> np.ndarray:
  """Initial states of streams ``streams`` (ints) of generator ``seed``.

  Returns ``[..., 4]`` uint32: ``(s0 lo, s0 hi, s1 lo, s1 hi)`` per stream,
  already warmed up. The state is never all-zero (splitmix64 outputs of
  distinct inputs).
  """
  streams = np.asarray(streams, np.uint64)
  base = _splitmix64(np.uint64(int(seed) & _M64))
  with np.errstate(over="ignore"):
    x = base ^ (streams * np.uint64(0xD1342543DE82EF95))
  s0 = _splitmix64(x)
  s1 = _splitmix64(s0 ^ np.uint64(0x5851F42D4C957F2D))
  s1 = np.where((s0 | s1) == 0, np.uint64(1), s1)
  _, s0, s1 = reference_numpy(s0, s1, WARMUP)
  return np.stack([s0 & np.uint64(0xFFFFFFFF), s0 >> np.uint64(32),
                   s1 & np.uint64(0xFFFFFFFF), s1 >> np.uint64(32)], -1).astype(np.uint32)


# -- JAX uint32-pair implementation ------------------------------------------


def _rotl(lo, hi, k):
  """64-bit rotate left of (lo, hi) by constant ``k`` in (0, 64)."""
  if k >= 32:
    lo, hi, k = hi, lo, k - 32
  if k == 0:
    return lo, hi
  s, r = jnp.uint32(k), jnp.uint32(32 - k)
  return (lo << s) | (hi >> r), (hi << s) | (lo >> r)


def _shl(lo, hi, k):
  """64-bit shift left by constant ``k`` in (0, 32)."""
  s, r = jnp.uint32(k), jnp.uint32(32 - k)
  return lo << s, (hi << s) | (lo >> r)


def next_u64(state):
  """One step of every stream: ``state [..., 4] uint32 -> (out_lo, out_hi, state)``."""
  a, b, c = SHIFTS
  s0l, s0h, s1l, s1h = state[..., 0], state[..., 1], state[..., 2], state[..., 3]
  sxl, sxh = s0l ^ s1l, s0h ^ s1h
  sal, sah = s0l & s1l, s0h & s1h
  r1l, r1h = _rotl(sal, sah, 1)
  r2l, r2h = _rotl(sal, sah, 2)
  outl, outh = sxl ^ (r1l | r2l), sxh ^ (r1h | r2h)
  ral, rah = _rotl(s0l, s0h, a)
  shl_l, shl_h = _shl(sxl, sxh, b)
  n0l, n0h = ral ^ sxl ^ shl_l, rah ^ sxh ^ shl_h
  n1l, n1h = _rotl(sxl, sxh, c)
  return outl, outh, jnp.stack([n0l, n0h, n1l, n1h], -1)


def draw(state, rounds: int):
  """``rounds`` 64-bit outputs of every stream.

  Args:
    state: ``[..., 4]`` uint32 states.
    rounds: steps to run (static).

  Returns:
    ``(bits [rounds, ..., 2] uint32 (lo, hi), new state)``.
  """
  state = jnp.asarray(state, jnp.uint32)
  if rounds == 0:
    return jnp.zeros((0,) + state.shape[:-1] + (2,), jnp.uint32), state

  def step(s, _):
    lo, hi, s = next_u64(s)
    return s, jnp.stack([lo, hi], -1)

  state, bits = lax.scan(step, state, None, length=rounds)
  return bits, state
