"""FP8 casts and the FP8 matmul, with Poplar's power-of-two scales.

* :func:`cast_to_fp8`: ``x * 2**log2_scale`` rounded to F143 or F152 (round to
  nearest even, or stochastically with ``key``); as ``ml_dtypes`` does, a
  value beyond the format's largest becomes its NaN (the formats have no
  infinity), unless ``saturate=True`` clips it to the largest value.
* :func:`cast_from_fp8`: FP8 codes to ``float16``/``float32`` times
  ``2**-log2_scale``, exact.
* :func:`fp8_matmul`: ``A8 @ B8`` with each operand's scale, accumulated in
  float32 (the AMP's FP8 path accumulates in fp32 partials), and the result
  scaled back by ``2**-(a_log2_scale + b_log2_scale)`` in ``float16`` or
  ``float32``.

They are compositions of ``lax`` operations, so they run under ``jax.jit``,
``jax.grad`` and ``jax.vmap`` and lower through the ordinary rules: the FP8
matmul is a ``dot_general`` with FP8 operands, which the tile plan costs at the
target's FP8 rate (``IPUTarget.fp8_flops_per_cycle``; on targets without FP8
units at the fp16 rate, as poplin falls back to half-precision AMP work).
Scaling by a power of two is exact in float32 for every scale in [-32, 32)
and every value an FP8 format can hold, so the scaled cast is bit-exact against
``ml_dtypes`` applied to the scaled value.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels.number_formats import check_log2_scale, fp8_format, is_fp8

__all__ = ["cast_to_fp8", "cast_from_fp8", "fp8_matmul", "pow2"]


def pow2(log2_scale, dtype=jnp.float32):
  """``2**log2_scale`` exactly, for an int or a traced integer scalar.

  The float32 is built from its exponent bits, so it is exact (``exp2`` need
  not be); traced values are clipped into the representable [-126, 127].
  """
  if isinstance(log2_scale, (int, np.integer)):
    return jnp.asarray(np.ldexp(np.float32(1), int(log2_scale)), dtype)
  e = jnp.clip(jnp.asarray(log2_scale, jnp.int32), -126, 127)
  return lax.bitcast_convert_type((e + 127) << 23, jnp.float32).astype(dtype)


def _clip_scale(log2_scale):
  if isinstance(log2_scale, (int, np.integer)):
    return int(log2_scale)
  return jnp.clip(jnp.asarray(log2_scale, jnp.int32), -32, 31)


def cast_to_fp8(x, fmt="F143", log2_scale=0, *, saturate: bool = False, key=None):
  """Cast ``x`` to an FP8 format, scaling it by ``2**log2_scale`` first.

  Args:
    x: a float array (computed in float32).
    fmt: ``"F143"``/``"F152"`` or ``jnp.float8_e4m3fnuz``/``jnp.float8_e5m2fnuz``.
    log2_scale: an int in [-32, 32), or an integer scalar array (clipped into
      that range) for scales computed in the program.
    saturate: clip values beyond the format's largest to it (and infinities
      to it) instead of producing NaN.
    key: round stochastically with this PRNG key
      (:func:`ipu_jax.ops.stochastic_round`) instead of to nearest.

  Returns:
    An array of the format's dtype.
  """
  f = fp8_format(fmt)
  log2_scale = check_log2_scale(log2_scale)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"cast_to_fp8 takes a floating point array, got {x.dtype}.")
  scaled = x.astype(jnp.float32) * pow2(_clip_scale(log2_scale))
  if saturate:
    scaled = jnp.clip(scaled, -f.max, f.max)
  if key is not None:
    from ipu_jax.ops.stochastic_round import stochastic_round
    return stochastic_round(scaled, f.dtype, key)
  return scaled.astype(f.dtype)


def cast_from_fp8(x8, log2_scale=0, dtype=jnp.float32):
  """FP8 values back to ``dtype``, divided by ``2**log2_scale`` (exact).

  Args:
    x8: an array of an FP8 dtype.
    log2_scale: the scale it was cast with (int in [-32, 32) or integer scalar).
    dtype: ``jnp.float32`` or ``jnp.float16``.
  """
  x8 = jnp.asarray(x8)
  if not is_fp8(x8.dtype):
    raise TypeError(f"cast_from_fp8 takes float8_e4m3fnuz or float8_e5m2fnuz, got {x8.dtype}.")
  log2_scale = check_log2_scale(log2_scale)
  dtype = np.dtype(dtype)
  if dtype not in (np.dtype(jnp.float32), np.dtype(jnp.float16)):
    raise ValueError(f"cast_from_fp8: dtype must be float32 or float16, got {dtype}.")
  out = x8.astype(jnp.float32) * pow2(-_clip_scale(log2_scale))
  return out.astype(dtype)


def fp8_matmul(a8, b8, a_log2_scale=0, b_log2_scale=0, out_dtype=jnp.float16,
               precision: Optional[str] = None):
  """``(A8 / 2**a_scale) @ (B8 / 2**b_scale)`` from FP8 operands.

  The products of FP8 values are exact in float32 and accumulate in float32;
  the result is scaled by ``2**-(a_log2_scale + b_log2_scale)`` and rounded
  once to ``out_dtype``.

  Args:
    a8: ``[..., M, K]`` FP8 array (either format).
    b8: ``[..., K, N]`` FP8 array (either format).
    a_log2_scale, b_log2_scale: the operands' scales (see :func:`cast_to_fp8`).
    out_dtype: ``jnp.float16`` or ``jnp.float32``.
    precision: unused; reserved (must be None).
  """
  del precision
  a8, b8 = jnp.asarray(a8), jnp.asarray(b8)
  for name, t in (("a8", a8), ("b8", b8)):
    if not is_fp8(t.dtype):
      raise TypeError(f"fp8_matmul: {name} must be float8_e4m3fnuz or float8_e5m2fnuz, "
                      f"got {t.dtype}.")
    if t.ndim < 2:
      raise ValueError(f"fp8_matmul: {name} must have rank >= 2, got shape {t.shape}.")
  if a8.shape[-1] != b8.shape[-2]:
    raise ValueError(f"fp8_matmul: contracting dimensions differ: {a8.shape} @ {b8.shape}.")
  out_dtype = np.dtype(out_dtype)
  if out_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.float16)):
    raise ValueError(f"fp8_matmul: out_dtype must be float16 or float32, got {out_dtype}.")
  sa = check_log2_scale(a_log2_scale, "a_log2_scale")
  sb = check_log2_scale(b_log2_scale, "b_log2_scale")
  if a8.dtype != b8.dtype:
    # Mixed formats: both widen exactly to float16 before the AMP.
    a8, b8 = a8.astype(jnp.float16), b8.astype(jnp.float16)
  batch = np.broadcast_shapes(a8.shape[:-2], b8.shape[:-2])
  a8 = jnp.broadcast_to(a8, batch + a8.shape[-2:])
  b8 = jnp.broadcast_to(b8, batch + b8.shape[-2:])
  nb = len(batch)
  dims = (((nb + 1,), (nb,)), (tuple(range(nb)), tuple(range(nb))))
  acc = lax.dot_general(a8, b8, dims, preferred_element_type=jnp.float32)
  total = -(_clip_scale(sa) + _clip_scale(sb))
  return (acc * pow2(total)).astype(out_dtype)
