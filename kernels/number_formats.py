"""Graphcore's low-precision number formats: FP8 F143 and F152.

The Mk2 IPU with FP8 support (the C600 card) has two 8-bit float formats
(Graphcore's "8-bit Numerical Formats for Deep Neural Networks", Noune et al.,
2022; Poplar's ``QuarterMetadata``):

* **F143**: 1 sign, 4 exponent, 3 mantissa bits, bias 8, largest value 240.
* **F152**: 1 sign, 5 exponent, 2 mantissa bits, bias 16, largest value 57344.

Neither has infinities and each has a single NaN code (``0x80``, the pattern
of "negative zero"), which is what JAX and ``ml_dtypes`` call
``float8_e4m3fnuz`` and ``float8_e5m2fnuz``; ipu-jax stores FP8 tensors in
those dtypes, one byte per element.

Every FP8 tensor carries a power-of-two scale, ``log2_scale`` in [-32, 32):
casting ``x`` to FP8 stores ``x * 2**log2_scale`` rounded to the format and
casting back divides by it, so a tensor whose values sit far from 1 uses the
format's precision where its values are.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = ["FP8Format", "F143", "F152", "FP8_FORMATS", "LOG2_SCALE_RANGE",
           "fp8_format", "is_fp8", "check_log2_scale"]

# Poplar's QuarterMetadata scale is a signed 6-bit exponent.
LOG2_SCALE_RANGE = (-32, 32)


@dataclasses.dataclass(frozen=True)
class FP8Format:
  """One FP8 format.

  Attributes:
    name: ``"F143"`` or ``"F152"``.
    dtype: the JAX/NumPy storage dtype (``float8_e4m3fnuz`` / ``float8_e5m2fnuz``).
    exponent_bits, mantissa_bits, bias: the layout.
  """

  name: str
  dtype: np.dtype
  exponent_bits: int
  mantissa_bits: int
  bias: int

  @property
  def max(self) -> float:
    """Largest finite value."""
    return float(ml_dtypes.finfo(self.dtype).max)

  @property
  def min_normal(self) -> float:
    return float(ml_dtypes.finfo(self.dtype).tiny)

  @property
  def min_subnormal(self) -> float:
    return float(ml_dtypes.finfo(self.dtype).smallest_subnormal)


F143 = FP8Format("F143", np.dtype(jnp.float8_e4m3fnuz), 4, 3, 8)
F152 = FP8Format("F152", np.dtype(jnp.float8_e5m2fnuz), 5, 2, 16)
FP8_FORMATS = {"F143": F143, "F152": F152}
_BY_DTYPE = {F143.dtype: F143, F152.dtype: F152}


def fp8_format(fmt) -> FP8Format:
  """The :class:`FP8Format` named by ``fmt``: a format, its name or its dtype.

  Raises:
    ValueError: ``fmt`` is none of ``"F143"``, ``"F152"``,
      ``jnp.float8_e4m3fnuz``, ``jnp.float8_e5m2fnuz``.
  """
  if isinstance(fmt, FP8Format):
    return fmt
  if isinstance(fmt, str) and fmt.upper() in FP8_FORMATS:
    return FP8_FORMATS[fmt.upper()]
  try:
    dtype = np.dtype(fmt)
  except TypeError:
    dtype = None
  if dtype in _BY_DTYPE:
    return _BY_DTYPE[dtype]
  raise ValueError(
      f"Unknown FP8 format {fmt!r}; valid formats are 'F143' "
      "(jnp.float8_e4m3fnuz) and 'F152' (jnp.float8_e5m2fnuz).")


def is_fp8(dtype) -> bool:
  """Whether ``dtype`` is one of the IPU's FP8 storage dtypes."""
  try:
    return np.dtype(dtype) in _BY_DTYPE
  except TypeError:
    return False


def check_log2_scale(log2_scale, what: str = "log2_scale"):
  """``log2_scale`` checked: a Python int in [-32, 32), or an integer scalar array.

  A Python int is checked here, before anything runs. An array (a scale
  computed in the program, as per-tensor scaling does every step) must be an
  integer scalar; its value is clipped into [-32, 31] when used, as the
  hardware's 6-bit scale field holds no other value.

  Raises:
    TypeError: neither an int nor an integer scalar array.
    ValueError: an int out of range.
  """
  if isinstance(log2_scale, bool):
    raise TypeError(f"{what} must be an int in [-32, 32) or an integer scalar array, got "
                    f"{log2_scale!r}.")
  if not isinstance(log2_scale, numbers.Integral):
    dtype = getattr(log2_scale, "dtype", None)
    shape = getattr(log2_scale, "shape", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or tuple(shape) != ():
      raise TypeError(f"{what} must be an int in [-32, 32) or an integer scalar array, got "
                      f"{log2_scale!r} of type {type(log2_scale).__name__}.")
    return log2_scale
  lo, hi = LOG2_SCALE_RANGE
  if not lo <= int(log2_scale) < hi:
    raise ValueError(f"{what} must be in [{lo}, {hi}), got {log2_scale}.")
  return int(log2_scale)
