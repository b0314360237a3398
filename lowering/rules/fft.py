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
tile busy, no extra exchange) and a plane takes at most a quarter of a tile. Otherwise it runs as successive 1-D passes,
one per transformed axis: each pass treats every other axis as batch, so its
lines spread over up to ``size / n`` tiles and the exchange between passes
is the transpose that brings the next axis's lines together on tiles. Real
transforms put the real axis at the end of the chain: RFFT along the last
axis first, then complex FFTs; IRFFT runs the complex inverse passes first,
then IRFFT along the last axis.

A line along the last axis whose operand and result take more than a quarter
of a tile's memory is split over tiles as a four-step FFT (see
:func:`_four_step`): ``n = n1 n2``, a pass of ``n2`` columns of length
``n1`` (with the twiddle factors applied on their tiles), then a pass of
``n1`` rows of length ``n2`` placed straight into the transposed result. A
long RFFT is the complex transform of its real line, keeping the first
``n // 2 + 1`` bins; a long IRFFT is the real part of the complex inverse of
the Hermitian extension of its bins. Lines that do not split (a prime
length) land on one tile; if they do not fit, the memory check raises
:class:`~ipu_jax.OutOfMemoryError` naming the tile.

The gradients of transforms, and complex linear algebra, use the complex
elementwise primitives ``conj`` and ``complex`` of the elementwise family.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.kernels import linalg as K
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering.builders import elementwise
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.problems import solve_problems
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.movement import alias, move

__all__ = []

_SUPPORTED_DTYPES = ("float32", "float64", "complex64", "complex128")
# A line whose operand and result take more than this fraction of a tile's
# memory is split over tiles (four-step FFT).
_LINE_BUDGET_FRACTION = 4
# Flops per point to make and apply a twiddle factor: sine and cosine
# polynomials (about 10 each) and a complex multiply (6).
_TWIDDLE_FLOPS = 26


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
      codelet=vocab.vertex(vocab.FFT, fft_type),
      name=f"fft/{fft_type.name.lower()}" + (f"/axis{axes[0]}" if len(axes) == 1 else ""))
  return out


def _one_axis(ctx, x, axis, fft_type, length, out_dtype):
  """A 1-D pass along ``axis``; every other axis is batch."""
  split = _four_step_split(ctx, x, axis, fft_type, length, out_dtype)
  if split is not None:
    if fft_type == lax.FftType.RFFT:
      return _real_four_step(ctx, x, length, out_dtype, *split)
    if fft_type == lax.FftType.IRFFT:
      return _inverse_real_four_step(ctx, x, length, out_dtype, *split)
    return _four_step(ctx, x, fft_type, *split)
  shape = list(x.shape)
  if fft_type == lax.FftType.RFFT:
    shape[axis] = length // 2 + 1
  elif fft_type == lax.FftType.IRFFT:
    shape[axis] = length
  return _transform(ctx, x, (axis,), fft_type, (length,), tuple(shape), out_dtype)


def _four_step_split(ctx, x, axis, fft_type, length, out_dtype):
  """``(n1, n2)`` when a line along ``axis`` is too long for one tile, else None.

  Only lines along the last axis split; ``n1`` is the largest divisor of
  ``length`` not above its square root (a prime length does not split).
  """
  if axis != len(x.shape) - 1:
    return None
  line_bytes = length * (x.itemsize + np.dtype(out_dtype).itemsize)
  if line_bytes <= ctx.target.bytes_per_tile // _LINE_BUDGET_FRACTION:
    return None
  n1 = max(d for d in range(1, math.isqrt(length) + 1) if length % d == 0)
  return None if n1 == 1 else (n1, length // n1)


def _four_step(ctx, x, fft_type, n1, n2):
  """A long complex line as ``n1 x n2``: columns, twiddles, rows.

  With ``x[j1 * n2 + j2]`` seen as ``A[j1, j2]``, the transform is
  ``X[k1 + n1 k2] = sum_j2 w_n2^(j2 k2) w_n^(j2 k1) sum_j1 w_n1^(j1 k1) A[j1, j2]``:
  the ``n2`` columns (length ``n1``) are transformed on their tiles, which
  then multiply by the twiddles ``w_n^(j2 k1)`` (made on the tile from the
  column's index); the ``n1`` rows (length ``n2``) are transformed next, and
  each row lands strided in the result, so the final transpose is the rows'
  placement. Each 1-D pass spreads its lines over the tiles like any batch.
  """
  batch = tuple(x.shape[:-1])
  nb, n = len(batch), n1 * n2
  dtype = x.dtype
  sign = -1.0 if fft_type == lax.FftType.FFT else 1.0
  grid = alias(x, batch + (n1, n2))
  column_params = dict(fft_type=fft_type, fft_lengths=(n1,))

  def columns(index, line):
    y = lax.fft_p.bind(line, **column_params)
    j2 = index % n2
    exponent = (j2[:, None] * jnp.arange(n1, dtype=jnp.int32)[None, :]) % n
    angle = (sign * 2.0 * np.pi / n) * exponent.astype(jnp.float32)
    return y * lax.complex(jnp.cos(angle), jnp.sin(angle)).astype(dtype)

  column_axes = tuple(range(nb)) + (nb + 1,)
  (twiddled,) = solve_problems(
      ctx, columns, [grid], [(grid.shape, dtype)], batch_axes=[column_axes],
      out_batch_axes=[column_axes], flops=K.fft_flops(n1) + _TWIDDLE_FLOPS * n1,
      steps=max(1, math.ceil(math.log2(n1))), with_problem_index=True,
      codelet=vocab.vertex(vocab.FFT, fft_type), name=f"fft/{fft_type.name.lower()}/columns")
  row_params = dict(fft_type=fft_type, fft_lengths=(n2,))
  (rows,) = solve_problems(
      ctx, lambda line: lax.fft_p.bind(line, **row_params), [twiddled],
      [(batch + (n2, n1), dtype)], batch_axes=[tuple(range(nb + 1))],
      out_batch_axes=[tuple(range(nb)) + (nb + 1,)], flops=K.fft_flops(n2),
      steps=max(1, math.ceil(math.log2(n2))),
      codelet=vocab.vertex(vocab.FFT, fft_type), name=f"fft/{fft_type.name.lower()}/rows")
  return alias(rows, batch + (n,))


def _leading_bins(shape, bins: int) -> np.ndarray:
  """Source of each of the first ``bins`` bins of every line of ``shape``
  (built when needed: a step keeps no table per element)."""
  return np.arange(int(np.prod(shape, dtype=np.int64)), dtype=np.int64).reshape(
      shape)[..., :bins].reshape(-1)


def _mirrored_bins(lines: int, bins: int, n: int) -> np.ndarray:
  """Source bin of each of the ``n`` bins of the Hermitian spectrum, per line."""
  k = np.arange(n, dtype=np.int64)
  return (np.arange(lines, dtype=np.int64)[:, None] * bins
          + np.minimum(k, n - k)[None, :]).reshape(-1)


def _real_four_step(ctx, x, length, out_dtype, n1, n2):
  """A long RFFT: the complex four-step transform, keeping ``n // 2 + 1`` bins."""
  as_complex = elementwise(ctx, lambda v: v.astype(out_dtype), [x],
                           out_avals=[(x.shape, out_dtype)], name="fft/to_complex",
                           cost_op="convert_element_type")[0]
  full = _four_step(ctx, as_complex, lax.FftType.FFT, n1, n2)
  bins = length // 2 + 1
  shape = tuple(x.shape[:-1]) + (bins,)
  index = functools.partial(_leading_bins, full.shape, bins)
  return move(ctx, [full], [(shape, out_dtype, index)], lambda v: v[..., :bins],
              name="fft/rfft/bins", one_to_one=True)[0]


def _inverse_real_four_step(ctx, x, length, out_dtype, n1, n2):
  """A long IRFFT: the real part of the complex inverse of the full spectrum.

  The ``n // 2 + 1`` bins are extended to the Hermitian spectrum of ``n``
  bins (bin ``k > n / 2`` is ``conj(X[n - k])``): a static gather, then
  chunks of ``n1`` bins conjugate their upper half on their tiles. The
  imaginary parts of the DC and Nyquist bins only add an imaginary part to
  the inverse, which the real part drops, as IRFFT ignores them.
  """
  batch = tuple(x.shape[:-1])
  nb, bins, n = len(batch), x.shape[-1], length
  lines = int(np.prod(batch, dtype=np.int64))
  k = np.arange(n, dtype=np.int64)
  mirror = np.minimum(k, n - k)
  extended = move(ctx, [x], [(batch + (n,), x.dtype,
                              functools.partial(_mirrored_bins, lines, bins, n))],
                  lambda v: v[..., mirror], name="fft/irfft/extend")[0]
  chunks = alias(extended, batch + (n2, n1))
  chunk_axes = tuple(range(nb + 1))

  def conjugate_upper_half(chunk_index, chunk):
    bin_of = (chunk_index % n2)[:, None] * n1 + jnp.arange(n1, dtype=jnp.int32)[None, :]
    return jnp.where(bin_of > n // 2, jnp.conj(chunk), chunk)

  (hermitian,) = solve_problems(
      ctx, conjugate_upper_half, [chunks], [(chunks.shape, x.dtype)],
      batch_axes=[chunk_axes], out_batch_axes=[chunk_axes], flops=float(n1),
      with_problem_index=True, codelet=vocab.vertex(vocab.ELEMENTWISE, "conj"), name="fft/irfft/conjugate")
  full = _four_step(ctx, alias(hermitian, batch + (n,)), lax.FftType.IFFT, n1, n2)
  return elementwise(ctx, lambda v: jnp.real(v).astype(out_dtype), [full],
                     out_avals=[(full.shape, out_dtype)], name="fft/irfft/real",
                     cost_op="real")[0]


@register_lowering(lax.fft_p)
def _fft(ctx: RuleContext, x, *, fft_type, fft_lengths):
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
  if k == 1:
    return [_one_axis(ctx, x, axes[0], fft_type, lengths[0], out_dtype)]
  plane_bytes = (int(np.prod(x.shape[ndim - k:], dtype=np.int64)) * x.itemsize
                 + int(np.prod(out_shape[ndim - k:], dtype=np.int64)) * out_dtype.itemsize)
  if (planes >= ctx.target.num_tiles
      and plane_bytes <= ctx.target.bytes_per_tile // _LINE_BUDGET_FRACTION):
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
