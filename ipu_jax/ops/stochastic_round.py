"""``stochastic_round``: fp32 -> fp16/bf16 rounding the IPU's (unbiased) way."""

from __future__ import annotations

from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.ops.primitive import HALF_DTYPES, shaped_like, define_primitive, not_mapped
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import broadcast_cost, logical, worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import to_storage
from ipu_jax.lowering.registry import register_lowering


stochastic_round_p = jcore.Primitive("stochastic_round")


def _key_impl_name(key) -> Tuple[Any, str]:
  """(key operand, PRNG impl name) for a typed key or raw uint32 key data."""
  if not hasattr(key, "dtype"):  # a Python int seed, say: not a key
    raise TypeError(f"stochastic_round: key must be a PRNG key (jax.random.key(seed)), got "
                    f"{type(key).__name__}: {key!r}.")
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key, str(jax.random.key_impl(key))
  key = jnp.asarray(key)
  if key.dtype != jnp.uint32:
    raise TypeError(f"stochastic_round: key must be a PRNG key, got {key.dtype}.")
  return key, str(jax.config.jax_default_prng_impl)


def _typed_keys(key, impl: str):
  if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key
  return jax.random.wrap_key_data(key, impl=impl)


def random_bits_for(key, shape, impl: str):
  """uint32 random bits of ``shape``: ``jax.random.bits`` of each key.

  ``key`` is a typed key array (or its raw data) of shape ``K``; each key
  draws the bits of its block ``x[k]`` of an ``x`` of shape ``K + rest``.
  """
  keys = _typed_keys(key, impl)
  kshape = tuple(keys.shape)
  rest = tuple(shape)[len(kshape):]
  if not kshape:
    return jax.random.bits(keys, rest, jnp.uint32)
  flat = keys.reshape(-1)
  bits = jax.vmap(lambda k: jax.random.bits(k, rest, jnp.uint32))(flat)
  return bits.reshape(tuple(shape))


def round_with_bits(x, bits, dtype):
  """Stochastically round fp32 ``x`` to ``dtype`` using uint32 ``bits``.

  bfloat16 keeps the top 16 bits of a float32, so the IPU's method is exact
  here: add a uniform 16-bit integer to the float32 bit pattern and truncate
  the low 16 bits. The carry into the kept bits happens with probability
  (low 16 bits) / 2^16, i.e. the distance to the lower neighbour over the
  spacing: E[round(x)] = x, for subnormals too (sign-magnitude: the magnitude
  rounds away from zero with that probability).

  float16 has its own exponent range, so the two neighbours lo <= x <= hi are
  found with round-to-nearest and ``nextafter``; the result is hi when a
  uniform u in [0, 1) (24 random bits) is below (x - lo) / (hi - lo). That
  fraction is exact in float32 and a multiple of 2^-24 for |x| >= 2^-38, so
  P(hi) equals it exactly (below that, fp16 rounds to 0 or 2^-24 with a bias
  under 2^-24 of the spacing).

  Non-finite inputs and magnitudes beyond the largest finite value of
  ``dtype`` are rounded to nearest, as a plain cast would.
  """
  dtype = np.dtype(dtype)
  x = x.astype(jnp.float32)
  nearest = x.astype(dtype)
  finfo = jnp.finfo(dtype)
  special = ~jnp.isfinite(x) | (jnp.abs(x) > jnp.float32(finfo.max))
  if dtype == np.dtype(jnp.bfloat16):
    raw = lax.bitcast_convert_type(x, jnp.uint32)
    summed = raw + (bits >> 16)
    rounded = lax.bitcast_convert_type((summed >> 16).astype(jnp.uint16), jnp.bfloat16)
  elif dtype == np.dtype(jnp.float16):
    near32 = nearest.astype(jnp.float32)
    below = near32 <= x
    lo = jnp.where(below, nearest, jnp.nextafter(nearest, jnp.float16(-jnp.inf)))
    hi = jnp.where(below, jnp.nextafter(nearest, jnp.float16(jnp.inf)), nearest)
    lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
    frac = (x - lo32) / (hi32 - lo32)
    u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)
    rounded = jnp.where(u < frac, hi, lo)
    rounded = jnp.where(near32 == x, nearest, rounded)
  elif dtype in _FP8_DTYPES:
    rounded = _round_fp8_with_bits(x, nearest, bits, dtype)
  else:
    raise TypeError(f"stochastic_round to {dtype} is not supported "
                    "(float16, bfloat16, float8_e4m3fnuz or float8_e5m2fnuz).")
  return jnp.where(special, nearest, rounded)


_FP8_DTYPES = (np.dtype(jnp.float8_e4m3fnuz), np.dtype(jnp.float8_e5m2fnuz))


def _round_fp8_with_bits(x, nearest, bits, dtype):
  """FP8 (fnuz) stochastic rounding on the codes of the magnitude.

  Positive codes 0x00..0x7F are monotonic in value, so the neighbours of
  ``|x|`` are the nearest code and the one next to it; the upper is chosen
  with probability (|x| - lo) / (hi - lo) from 24 random bits. The sign is
  put back except on zero (the formats have no negative zero: 0x80 is NaN).
  """
  mag = jnp.abs(x)
  near = lax.bitcast_convert_type(mag.astype(dtype), jnp.uint8)
  near32 = lax.bitcast_convert_type(near, dtype).astype(jnp.float32)
  below = near32 <= mag
  lo_code = jnp.where(below, near, near - 1)
  hi_code = jnp.where(below, jnp.minimum(near + 1, 0x7F), near)
  lo = lax.bitcast_convert_type(lo_code.astype(jnp.uint8), dtype).astype(jnp.float32)
  hi = lax.bitcast_convert_type(hi_code.astype(jnp.uint8), dtype).astype(jnp.float32)
  frac = (mag - lo) / jnp.where(hi > lo, hi - lo, 1)
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)
  code = jnp.where(near32 == mag, near, jnp.where(u < frac, hi_code, lo_code)).astype(jnp.uint8)
  code = jnp.where((x < 0) & (code != 0), code | jnp.uint8(0x80), code)
  del nearest
  return lax.bitcast_convert_type(code, dtype)


def _stochastic_round_impl(x, key, *, dtype, impl):
  bits = random_bits_for(key, x.shape, impl)
  return round_with_bits(x, bits, dtype)


def _key_batch_shape(key_aval):
  if jax.dtypes.issubdtype(key_aval.dtype, jax.dtypes.prng_key):
    return tuple(key_aval.shape)
  return tuple(key_aval.shape[:-1])


def _stochastic_round_abstract_eval(x, key, *, dtype, impl):
  del impl
  if x.dtype != np.dtype(np.float32):
    raise TypeError(f"stochastic_round takes float32 input, got {x.dtype}.")
  kb = _key_batch_shape(key)
  if tuple(x.shape[:len(kb)]) != kb:
    raise TypeError(f"stochastic_round: key batch shape {kb} does not prefix {x.shape}.")
  return shaped_like(x.shape, dtype, x)


def _stochastic_round_jvp(primals, tangents, *, dtype, impl):
  x, key = primals
  tx, _ = tangents
  out = stochastic_round_p.bind(x, key, dtype=dtype, impl=impl)
  # Straight-through: d round(x) / dx = 1.
  if type(tx) is ad.Zero:
    return out, ad.Zero.from_primal_value(out)
  return out, tx.astype(dtype)


def _stochastic_round_batch(args, dims, *, dtype, impl):
  x, key = args
  dx, dk = dims
  size = x.shape[dx] if dx is not not_mapped else (
      key.shape[dk] if dk is not not_mapped else 1)
  x = jnp.moveaxis(x, dx, 0) if dx is not not_mapped else jnp.broadcast_to(x, (size,) + x.shape)
  if dk is not not_mapped:
    key = jnp.moveaxis(key, dk, 0)
  else:
    # Every batch member draws the same bits, as the unbatched op would.
    key = jnp.broadcast_to(key, (size,) + key.shape)
  return stochastic_round_p.bind(x, key, dtype=dtype, impl=impl), 0


define_primitive(stochastic_round_p, _stochastic_round_impl, _stochastic_round_abstract_eval,
                 jvp=_stochastic_round_jvp, batch=_stochastic_round_batch)


def stochastic_round(x, dtype, key):
  """Round float32 ``x`` to ``dtype`` stochastically, as the IPU can.

  Each element becomes one of its two neighbouring ``dtype`` values, the
  upper with probability proportional to the distance from the lower, so the
  rounding is unbiased: ``E[stochastic_round(x)] == x``. Infinities, NaNs and
  values beyond the largest finite ``dtype`` value round to nearest. The
  gradient is straight-through (the derivative is 1, cast to ``dtype``).

  Args:
    x: a float32 array.
    dtype: ``jnp.float16``, ``jnp.bfloat16`` or an FP8 format
      (``jnp.float8_e4m3fnuz``, ``jnp.float8_e5m2fnuz``).
    key: a PRNG key (typed, or raw ``uint32`` key data); the same key gives
      the same result. The bits are ``jax.random.bits(key, x.shape)``.
  """
  dtype = np.dtype(dtype)
  if dtype not in HALF_DTYPES + _FP8_DTYPES:
    raise ValueError(f"stochastic_round: dtype must be float16, bfloat16, float8_e4m3fnuz "
                     f"or float8_e5m2fnuz, got {dtype}.")
  x = jnp.asarray(x)
  if x.dtype != jnp.float32:
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"stochastic_round takes a floating point array, got {x.dtype}.")
    x = x.astype(jnp.float32)
  key, impl = _key_impl_name(key)
  return stochastic_round_p.bind(x, key, dtype=dtype, impl=impl)


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile lowering of :func:`ipu_jax.ops.stochastic_round`.
#
# Tile plan: elementwise on the input's tiles; the key is multicast to them;
# each tile draws the random bits for its elements (a counter-based generator
# needs only the key and the position), costed per element, and rounds them in
# the same vertex (``popops::CastStochasticRound``).


# Cycles per vector for stochastic rounding: the cast plus one 32-bit random
# draw per element (two per 2 x float32 vector).
_SR_CYCLES_PER_VECTOR = 3


@register_lowering(stochastic_round_p)
def _stochastic_round_rule(ctx: RuleContext, x, key, *, dtype, impl):
  target = ctx.target
  out = ctx.new_tensor(x.shape, dtype, x.mapping, name="stochastic_round")
  if x.size == 0:
    return [out]
  elements = x.mapping.elements_per_tile(target.num_tiles)
  compute = estimators.worker_split_cycles(target, elements, _SR_CYCLES_PER_VECTOR, x.itemsize)

  def fn(x_s, k_s):
    keys = logical(k_s, key)
    # Bits of the logical array, laid out like x: each tile's vertex draws
    # the bits of the elements it holds.
    bits = to_storage(random_bits_for(keys, x.shape, impl).reshape(-1), x.mapping)
    return (round_with_bits(x_s, bits, dtype),)

  ctx.emit(P.Superstep(
      name="stochastic_round", op=ctx.op, reads=(x, key), writes=(out,), fn=fn,
      compute_cycles=compute, exchange=broadcast_cost(ctx, key, x.mapping.tiles),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST_STOCHASTIC_ROUND,),
      flops=int(x.size)))
  return [out]
