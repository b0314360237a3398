"""Fast Fourier transforms: ``jnp.fft`` / ``lax.fft`` (FFT, IFFT, RFFT, IRFFT).

Tile plan. ``fft`` transforms the trailing ``len(fft_lengths)`` axes of its
operand; every other axis numbers independent transforms. They are laid out
by :func:`ipu_jax.lowering.problems.solve_problems` (problems in equal
consecutive groups, one group per tile, operands exchanged to the tile of
their problem), and each tile's vertex runs the transform on its local batch
of whole lines with ``jax.lax.fft``, so the numbers equal ``jax.jit``'s to
rounding. A transform of ``n`` points costs ``5 n log2 n`` flops (half for
real input or output) at the tile's fp32 rate shared by its workers, with
``log2 n`` sequential butterfly stages (:mod:`ipu_jax.kernels.linalg`).

A multi-dimensional transform (``fft2``, ``fftn``, ``rfftn``...) runs as one
step on whole planes when there are at least as many planes as tiles (every
tile busy, no extra exchange). Otherwise it runs as successive 1-D passes,
one per transformed axis: each pass treats every other axis as batch, so its
lines spread over up to ``size / n`` tiles and the exchange between passes
is the transpose that brings the next axis's lines together on tiles. Real
transforms put the real axis at the end of the chain: RFFT along the last
axis first, then complex FFTs; IRFFT runs the complex inverse passes first,
then IRFFT along the last axis. A single line larger than a tile's memory
lands on one tile and fails the memory check with an
:class:`~ipu_jax.OutOfMemoryError`; splitting one line over tiles (a
four-step FFT) is out of scope.

The gradients of transforms, and complex linear algebra, need the complex
elementwise primitives ``conj`` and ``complex``; unless the elementwise family
already lowers them, they are registered here as elementwise compute sets.
"""

from __future__ import annotations

import math

import numpy as np
from jax import lax

from ipu_jax.kernels import linalg as K
from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.problems import solve_problems
from ipu_jax.lowering.registry import register_lowering, registered_primitives

__all__ = []

_SUPPORTED_DTYPES = ("float32", "float64", "complex64", "complex128")


def _fft_type(value) -> lax.FftType:
  return value if isinstance(value, lax.FftType) else lax.FftType(value)


def _transform(ctx, x, axes, fft_type: lax.FftType, lengths, out_shape, out_dtype):
  """One step: every transform over ``axes`` solved on the tile of its line."""
  batch = tuple(a for a in range(len(x.shape)) if a not in axes)
  points = int(np.prod(lengths, dtype=np.int64))
  real = fft_type in (lax.FftType.RFFT, lax.FftType.IRFFT)
  params = dict(fft_type=fft_type, fft_lengths=tuple(int(n) for n in lengths))

  def fn(line):
    return lax.fft_p.bind(line, **params)

  (out,) = solve_problems(
      ctx, fn, [x], [(out_shape, out_dtype)], batch_axes=[batch],
      out_batch_axes=[batch], flops=K.fft_flops(points, real),
      steps=max(1, math.ceil(math.log2(max(points, 1)))),
      codelet=f"FFT<{fft_type.name}>",
      name=f"fft/{fft_type.name.lower()}" + (f"/axis{axes[0]}" if len(axes) == 1 else ""))
  return out


def _one_axis(ctx, x, axis, fft_type, length, out_dtype):
  """A 1-D pass along ``axis``; every other axis is batch."""
  shape = list(x.shape)
  if fft_type == lax.FftType.RFFT:
    shape[axis] = length // 2 + 1
  elif fft_type == lax.FftType.IRFFT:
    shape[axis] = length
  return _transform(ctx, x, (axis,), fft_type, (length,), tuple(shape), out_dtype)


@register_lowering(lax.fft_p)
def _fft(ctx, x, *, fft_type, fft_lengths):
  fft_type = _fft_type(fft_type)
  dtype = np.dtype(x.dtype)
  if dtype.name not in _SUPPORTED_DTYPES:
    raise NotImplementedError(
        f"operand has dtype {dtype.name}; {fft_type.name} runs on float32/complex64 "
        f"(float64/complex128 with jax_enable_x64). Cast it, e.g. x.astype(jnp.complex64)")
  lengths = tuple(int(n) for n in fft_lengths)
  aval = ctx.out_avals[0]
  out_shape, out_dtype = tuple(int(d) for d in aval.shape), np.dtype(aval.dtype)
  ndim, k = len(x.shape), len(lengths)
  axes = tuple(range(ndim - k, ndim))
  planes = int(np.prod(x.shape[:ndim - k], dtype=np.int64))
  if k == 1 or planes >= ctx.target.num_tiles:
    return [_transform(ctx, x, axes, fft_type, lengths, out_shape, out_dtype)]

  if fft_type == lax.FftType.RFFT:
    y = _one_axis(ctx, x, axes[-1], lax.FftType.RFFT, lengths[-1], out_dtype)
    for axis in reversed(axes[:-1]):
      y = _one_axis(ctx, y, axis, lax.FftType.FFT, y.shape[axis], out_dtype)
    return [y]
  if fft_type == lax.FftType.IRFFT:
    y = x
    for axis in reversed(axes[:-1]):
      y = _one_axis(ctx, y, axis, lax.FftType.IFFT, y.shape[axis], x.dtype)
    return [_one_axis(ctx, y, axes[-1], lax.FftType.IRFFT, lengths[-1], out_dtype)]
  y = x
  for axis in reversed(axes):
    y = _one_axis(ctx, y, axis, fft_type, y.shape[axis], out_dtype)
  return [y]


def _register_complex_elementwise():
  from jax._src.lax import lax as lax_internal
  known = set(registered_primitives())
  for name in ("conj", "complex"):
    primitive = getattr(lax_internal, f"{name}_p")
    if primitive.name in known:
      continue

    def rule(ctx, *operands, _primitive=primitive, **params):
      return elementwise(ctx, lambda *xs: _primitive.bind(*xs, **params), operands)

    register_lowering(primitive, rule)


_register_complex_elementwise()
