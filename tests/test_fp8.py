"""FP8 formats F143/F152: scaled casts bit-exact against ml_dtypes, the FP8
matmul against jax.jit, and its cost on targets with and without FP8 units."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import IPUTarget
from ipu_jax.lowering.program import iter_steps
from ipu_jax.number_formats import F143, F152, fp8_format
from ipu_jax.ops import cast_from_fp8, cast_to_fp8, fp8_matmul
import testing_utils

_FORMATS = (("F143", F143), ("F152", F152))


def _boundary_values(fmt):
  """Every finite code's value, its float32 neighbours, the midpoints between
  codes (ties), and values around max, min normal, the subnormals and zero."""
  codes = np.arange(256, dtype=np.uint8).view(fmt.dtype).astype(np.float32)
  finite = np.sort(codes[np.isfinite(codes)])
  mids = (finite[1:].astype(np.float64) + finite[:-1]) / 2
  up = np.nextafter(finite, np.float32(np.inf))
  down = np.nextafter(finite, np.float32(-np.inf))
  extra = [fmt.max, fmt.max * (1 + 2.0 ** -(fmt.mantissa_bits + 1)),
           np.nextafter(np.float32(fmt.max * (1 + 2.0 ** -(fmt.mantissa_bits + 1))), 0),
           fmt.min_normal, fmt.min_subnormal, fmt.min_subnormal / 2,
           np.nextafter(np.float32(fmt.min_subnormal / 2), 1), 1e-30, 1e30,
           np.inf, -np.inf, np.nan, 0.0, -0.0]
  xs = np.concatenate([finite, mids, up, down, np.asarray(extra, np.float64)]).astype(np.float32)
  return np.concatenate([xs, -xs])


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint8) if x.dtype.itemsize == 1 else x.view(np.uint32)


class FP8CastTest(chex.TestCase, parameterized.TestCase):

  target = IPUTarget.preset("ipu2", tiles_per_ipu=16)

  @parameterized.named_parameters(*_FORMATS)
  def test_all_codes_decode_exactly(self, fmt):
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    ref = codes.astype(np.float32)
    got = np.asarray(ipu_jax.jit(lambda c: cast_from_fp8(c), target=self.target)(codes))
    nan = np.isnan(ref)
    self.assertEqual(int(nan.sum()), 1)  # one NaN code (0x80), no infinities
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(_bits(got[~nan]), _bits(ref[~nan]))

  @parameterized.named_parameters(*_FORMATS)
  def test_cast_bit_exact_against_ml_dtypes_around_every_boundary(self, fmt):
    xs = _boundary_values(fmt)
    ref = xs.astype(fmt.dtype)
    got = ipu_jax.jit(lambda x: cast_to_fp8(x, fmt.name), target=self.target)(xs)
    self.assertEqual(np.asarray(got).dtype, fmt.dtype)
    np.testing.assert_array_equal(_bits(got), _bits(ref))
    # Every code round-trips through its value.
    codes = np.arange(256, dtype=np.uint8).view(fmt.dtype)
    back = ipu_jax.jit(lambda c: cast_to_fp8(cast_from_fp8(c), fmt.name),
                       target=self.target)(codes)
    np.testing.assert_array_equal(_bits(back), np.arange(256, dtype=np.uint8))

  @parameterized.parameters((F143, -32), (F152, 31))
  def test_scaled_cast_matches_ml_dtypes_and_round_trips(self, fmt, scale):
    with np.errstate(over="ignore"):
      xs = _boundary_values(fmt) * np.float32(2.0 ** -scale)
    ref = (xs.astype(np.float64) * 2.0 ** scale).astype(np.float32).astype(fmt.dtype)
    f = lambda x: cast_to_fp8(x, fmt.dtype, scale)
    got = ipu_jax.jit(f, target=self.target)(xs)
    np.testing.assert_array_equal(_bits(got), _bits(ref))
    # A traced scale gives the same codes as a static one.
    g = lambda x, s: cast_to_fp8(x, fmt.dtype, s)
    np.testing.assert_array_equal(
        _bits(ipu_jax.jit(g, target=self.target)(xs, jnp.int32(scale))), _bits(ref))
    back = np.asarray(ipu_jax.jit(lambda c: cast_from_fp8(c, scale), target=self.target)(ref))
    want = ref.astype(np.float64) * 2.0 ** -scale
    ok = np.isfinite(want)
    np.testing.assert_array_equal(back[ok], want[ok].astype(np.float32))

  def test_saturate_clips_instead_of_nan(self):
    x = np.float32([1e6, -1e6, np.inf, 241.0, 239.0])
    got = np.asarray(cast_to_fp8(x, "F143", saturate=True).astype(np.float32))
    np.testing.assert_array_equal(got, [240, -240, 240, 240, 240])
    self.assertTrue(np.isnan(np.asarray(cast_to_fp8(x, "F143")).astype(np.float32)[:3]).all())

  def test_bad_arguments_are_named(self):
    with self.assertRaisesRegex(ValueError, "log2_scale must be in \\[-32, 32\\), got 32"):
      cast_to_fp8(np.ones(3, np.float32), "F143", 32)
    with self.assertRaisesRegex(ValueError, "valid formats are 'F143'"):
      fp8_format("E4M3")
    with self.assertRaisesRegex(TypeError, "log2_scale must be an int"):
      cast_to_fp8(np.ones(3, np.float32), "F143", 1.5)
    with self.assertRaisesRegex(TypeError, "b8 must be float8"):
      fp8_matmul(cast_to_fp8(np.ones((2, 2)), "F143"), np.ones((2, 2)))


class FP8MatmulTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(
      ("F143", "F143", (5, 7), (7, 3), 2, -1, jnp.float16),
      ("F152", "F143", (1, 33), (33, 1), 0, 4, jnp.float32),
      ("F152", "F152", (0, 4), (4, 5), 0, 0, jnp.float16))
  def test_matches_jax_jit_and_float64_reference(self, fa, fb, sa_shape, sb_shape, sa, sb, out):
    rng = np.random.default_rng(0)
    a = cast_to_fp8(rng.normal(size=sa_shape).astype(np.float32), fa, sa)
    b = cast_to_fp8(rng.normal(size=sb_shape).astype(np.float32), fb, sb)
    f = lambda a, b: fp8_matmul(a, b, sa, sb, out)
    got = ipu_jax.jit(f, target=IPUTarget.preset("ipu21", tiles_per_ipu=16))(a, b)
    want = jax.jit(f)(a, b)
    chex.assert_trees_all_close(got, want, rtol=1e-5)
    # Exact fp32 products of the scaled FP8 values, summed in fp32, rounded
    # to ``out``.
    testing_utils.assert_within_sum_bound(
        got, np.matmul, np.asarray(a, np.float64) * 2.0 ** -sa,
        np.asarray(b, np.float64) * 2.0 ** -sb, out_dtype=out)

  def test_fp8_matmul_costs_half_the_fp16_compute_on_ipu21_only(self):
    a = cast_to_fp8(np.ones((256, 512), np.float32), "F143")
    b = cast_to_fp8(np.ones((512, 256), np.float32), "F143")
    f = lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.float32)

    def matmul_compute(fn, version, *args):
      lowered = ipu_jax.jit(fn, target=IPUTarget.preset(version, tiles_per_ipu=16)).lower(*args)
      return sum(float(np.max(s.compute_cycles)) for s, _, _ in iter_steps(lowered.program)
                 if getattr(s, "op", "") == "dot_general")

    fp8_21, fp8_2 = matmul_compute(f, "ipu21", a, b), matmul_compute(f, "ipu2", a, b)
    self.assertLess(fp8_21, 0.6 * fp8_2)
    self.assertEqual(IPUTarget.preset("ipu21").flops_per_cycle(jnp.float8_e4m3fnuz), 256)
    self.assertEqual(IPUTarget.preset("ipu2").flops_per_cycle(jnp.float8_e4m3fnuz), 128)
    self.assertEqual(IPUTarget.preset("ipu21").flops_per_cycle(jnp.int8), 128)


if __name__ == "__main__":
  absltest.main()
