"""Tests of the FFT rule (lowering/rules/fft.py).

``jnp.fft`` transforms against ``jax.jit`` over batches that do not divide
the tile count, single lines, length-1 and empty batches, real and complex
inputs, both executor modes; multi-dimensional transforms as 1-D passes and
as whole planes per tile; gradients; the memory check for a line larger than
a tile; and the cost the report shows.
"""

import math

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _config(mode):
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  return cfg


def _complex(rng, shape):
  return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def _real(rng, shape):
  return rng.standard_normal(shape).astype(np.float32)


def _transforms(x, y):
  """Every kind of transform of a real ``x`` and a complex ``y``."""
  return {
      "fft": jnp.fft.fft(y), "ifft": jnp.fft.ifft(y), "rfft": jnp.fft.rfft(x),
      "irfft": jnp.fft.irfft(y), "fft_of_real": jnp.fft.fft(x),
      "fft_padded": jnp.fft.fft(y, n=8), "fft_first_axis": jnp.fft.fft(y, axis=0),
      "hfft": jnp.fft.hfft(y),
  }


def _multi_dimensional(x, y):
  return {
      "fft2": jnp.fft.fft2(y), "ifft2": jnp.fft.ifft2(y), "fftn": jnp.fft.fftn(y),
      "ifftn": jnp.fft.ifftn(y), "rfft2": jnp.fft.rfft2(x), "rfftn": jnp.fft.rfftn(x),
      "irfft2": jnp.fft.irfft2(y), "irfftn": jnp.fft.irfftn(y),
  }


def _fft_steps(fn, *args):
  steps = ipu_jax.jit(fn, target=_T16).lower(*args).profile.steps
  return [s for s in steps if s.op == "fft"]


class FftTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(0)

  def _check(self, fn, *args, mode="batched"):
    got = ipu_jax.jit(fn, target=_T16, config=_config(mode))(*args)
    want = jax.jit(fn)(*args)
    jax.tree_util.tree_map(
        lambda g, w: self.assertEqual((g.dtype, g.shape), (w.dtype, w.shape)), got, want)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=2e-5)

  @parameterized.named_parameters(
      ("batch17", (17, 6), "batched"),
      ("batch2x3_per_tile", (2, 3, 6), "per_tile"),
      ("single_line", (7,), "batched"),
      ("length_one", (5, 1), "per_tile"),
  )
  def test_one_dimensional(self, shape, mode):
    x, y = _real(self.rng, shape), _complex(self.rng, shape)
    self._check(_transforms, x, y, mode=mode)

  def test_empty_batch(self):
    x, y = _real(self.rng, (0, 6)), _complex(self.rng, (0, 6))
    self._check(lambda x, y: (jnp.fft.rfft(x), jnp.fft.fft(y), jnp.fft.fft2(y)), x, y)

  @parameterized.named_parameters(
      # Fewer planes than tiles: one 1-D pass per axis.
      ("passes", (3, 4, 6), "batched"),
      ("passes_per_tile", (3, 4, 6), "per_tile"),
      # At least as many planes as tiles: whole planes per tile, one step.
      ("planes_per_tile", (18, 4, 6), "per_tile"),
  )
  def test_multi_dimensional(self, shape, mode):
    x, y = _real(self.rng, shape), _complex(self.rng, shape)
    self._check(_multi_dimensional, x, y, mode=mode)

  def test_fft2_layout_choice(self):
    few, many = _complex(self.rng, (3, 4, 6)), _complex(self.rng, (18, 4, 6))
    self.assertEqual([s.name for s in _fft_steps(jnp.fft.fft2, few)],
                     ["fft/fft/axis2", "fft/fft/axis1"])
    self.assertEqual([s.name for s in _fft_steps(jnp.fft.fft2, many)], ["fft/fft"])
    # Many planes too large for a tile: passes again.
    large = jax.ShapeDtypeStruct((16, 128, 128), jnp.complex64)
    self.assertEqual([s.name for s in _fft_steps(jnp.fft.fft2, large)],
                     ["fft/fft/axis2", "fft/fft/axis1"])
    # The passes spread the 3 planes' 12 or 18 lines over more tiles.
    passes = _fft_steps(jnp.fft.fft2, few)
    self.assertTrue(all((s.compute_cycles > 0).sum() > 3 for s in passes))

  def test_gradients(self):
    x = _real(self.rng, (5, 8))

    def grads(x):
      return (jax.grad(lambda x: jnp.sum(jnp.abs(jnp.fft.rfft(x)) ** 2))(x),
              jax.grad(lambda x: jnp.sum(jnp.real(jnp.fft.fft2(x))))(x),
              jax.grad(lambda x: jnp.sum(jnp.fft.irfft(jnp.fft.rfft(x) * 2.0) ** 2))(x))

    self._check(grads, x)

  @parameterized.named_parameters(
      ("power_of_two_batched", (2, 1 << 14), "batched"),
      ("odd_length_per_tile", (3 * 5 * 7 * 11 * 13,), "per_tile"),
  )
  def test_long_lines_split_over_tiles(self, shape, mode):
    x, y = _real(self.rng, shape), _complex(self.rng, shape)
    n = shape[-1]
    fn = lambda x, y: (jnp.fft.fft(y), jnp.fft.ifft(y), jnp.fft.rfft(x),
                       jnp.fft.irfft(y[..., :n // 2 + 1], n=n))
    got = ipu_jax.jit(fn, target=_T16, config=_config(mode))(x, y)
    want = jax.jit(fn)(x, y)
    for g, w in zip(got, want):
      self.assertEqual((g.dtype, g.shape), (w.dtype, w.shape))
      # Twiddles made in fp32 on the tiles: errors relative to the spectrum.
      chex.assert_trees_all_close(g, w, rtol=1e-5, atol=2e-6 * float(np.abs(w).max()))
    steps = _fft_steps(jnp.fft.fft, y)
    self.assertEqual([s.name for s in steps], ["fft/fft/columns", "fft/fft/rows"])
    self.assertTrue(all((s.compute_cycles > 0).sum() >= 15 for s in steps))

  def test_line_that_cannot_split_is_out_of_memory(self):
    # A 1 MiB line splits over tiles; a prime length cannot, and overflows.
    ipu_jax.jit(jnp.fft.fft, target=_T16).lower(
        jax.ShapeDtypeStruct((1 << 17,), jnp.complex64))
    prime = jax.ShapeDtypeStruct(((1 << 17) - 1,), jnp.complex64)
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(jnp.fft.fft, target=_T16).lower(prime)
    self.assertIn("tile", str(caught.exception))

  def test_cost_is_5_n_log2_n_per_transform(self):
    y = jax.ShapeDtypeStruct((96, 64), jnp.complex64)
    (step,) = _fft_steps(jnp.fft.fft, y)
    self.assertEqual(step.flops, round(96 * 5 * 64 * math.log2(64)))
    x = jax.ShapeDtypeStruct((96, 64), jnp.float32)
    (real_step,) = _fft_steps(jnp.fft.rfft, x)
    self.assertEqual(real_step.flops, step.flops // 2)
    self.assertLess(real_step.compute_cycles.max(), step.compute_cycles.max())
    # Six lines per tile, one per worker: a longer line costs n log n more.
    longer = _fft_steps(jnp.fft.fft, jax.ShapeDtypeStruct((96, 256), jnp.complex64))[0]
    ratio = longer.compute_cycles.max() / step.compute_cycles.max()
    self.assertBetween(ratio, 4.0, 256 * 8 / (64 * 6) + 0.1)


if __name__ == "__main__":
  absltest.main()
