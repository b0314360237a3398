"""Regressions of matmul and convolution lowerings (issue 15, items 1-3, 5, 6, 9).

Each case runs through ``ipu_jax.jit`` (the tile program, both executor
modes) and is checked against plain ``jax.jit``: complex and float64 products
computed exactly and costed as their emulation, lhs-dilated convolutions in
``per_tile`` mode that do not multiply holes, every dtype combination
``jax.jit`` accepts, targets of one or two tiles, and long contractions with
tiny results split over tiles and reduced in a tree.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import ipu_jax
from ipu_jax.kernels import estimators
import testing_utils

_SMALL = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_FULL = ipu_jax.IPUTarget.preset("ipu2")
_MODES = ("batched", "per_tile")


def _config(mode="batched", partials_type=None):
  return testing_utils.executor_config(mode, matmuls={"partials_type": partials_type})


def _random(shape, dtype=jnp.float32, seed=0):
  return testing_utils.random_array(shape, dtype, seed, int_bound=20)


def _check(fn, *args, **kwargs):
  return testing_utils.assert_sums_match_jit(fn, *args, **kwargs)


def _steps(fn, *args, target=_SMALL, op=None, config=None):
  steps = ipu_jax.jit(fn, target=target, config=config).lower(*args).report.profile.steps
  return [s for s in steps if op is None or s.op == op]


def _compute_cycles(steps):
  return sum(s.compute_phase_cycles for s in steps)


def _same_conv_notes(dtype):
  """The profile notes of a small SAME convolution in ``dtype``."""
  conv = _steps(_conv(window_strides=(1, 1), padding="SAME"), _random((1, 2, 6, 6), dtype),
                _random((3, 2, 3, 3), dtype), op="conv_general_dilated")
  return " ".join(conv[0].notes)


def _conv(**kwargs):
  return lambda x, w: lax.conv_general_dilated(x, w, **kwargs)


class ComplexProductTest(chex.TestCase, parameterized.TestCase):
  """Item 1: complex products keep their imaginary part."""

  @parameterized.named_parameters(
      ("c64_c64", jnp.complex64, jnp.complex64, (7, 13), (13, 5)),
      ("f32_c64", jnp.float32, jnp.complex64, (7, 13), (13, 5)),
      ("c64_f32", jnp.complex64, jnp.float32, (7, 13), (13, 5)),
      ("c64_vector", jnp.complex64, jnp.complex64, (13,), (13,)),
      ("c64_batched", jnp.complex64, jnp.complex64, (3, 5, 9), (3, 9, 4)),
      # A long contraction: the partials are reduced across tiles.
      ("c64_split_k", jnp.complex64, jnp.complex64, (12, 2000), (2000, 10)),
  )
  def test_matmul_matches_jax(self, lhs_dtype, rhs_dtype, a_shape, b_shape):
    a, b = _random(a_shape, lhs_dtype, 1), _random(b_shape, rhs_dtype, 2)
    want = _check(jnp.matmul, a, b)
    self.assertGreater(float(np.abs(np.imag(want)).max()), 0.1)

  def test_dot_from_the_issue(self):
    a = (jnp.arange(12.).reshape(3, 4) + 1j * jnp.arange(12.).reshape(3, 4)[::-1])
    b = jnp.ones((4, 5)) - 2j
    _check(jnp.dot, a.astype(jnp.complex64), b.astype(jnp.complex64))

  def test_convolution_matches_jax(self):
    x, w = _random((1, 2, 6, 5), jnp.complex64, 3), _random((3, 2, 3, 2), jnp.complex64, 4)
    _check(_conv(window_strides=(1, 2), padding="SAME"), x, w)
    _check(_conv(window_strides=(1, 1), padding=[(1, 0), (0, 1)], lhs_dilation=(2, 1)), x, w)

  def test_cost_is_four_real_macs_and_the_report_says_so(self):
    a32, b32 = _random((64, 256), seed=6), _random((256, 48), seed=7)
    a64, b64 = a32.astype(jnp.complex64), b32.astype(jnp.complex64)
    real = _steps(jnp.matmul, a32, b32, op="dot_general")
    complex_ = _steps(jnp.matmul, a64, b64, op="dot_general")
    self.assertIn(f"complex MAC costed as {estimators.COMPLEX_REAL_MACS} real MACs",
                  complex_[0].notes)
    self.assertEqual(real[0].notes, ())
    ratio = _compute_cycles(complex_) / _compute_cycles(real)
    self.assertGreater(ratio, 3.0)
    self.assertIn("complex MAC", _same_conv_notes(jnp.complex64))


class PerTileConvolutionHolesTest(chex.TestCase, parameterized.TestCase):
  """Item 2: per-tile lhs-dilated convolutions do not multiply the holes."""

  def test_inf_tap_meeting_only_holes_from_the_issue(self):
    x = jnp.ones((1, 2, 8, 8))
    w = jnp.ones((3, 2, 3, 3)).at[0, 0, 0, 0].set(jnp.inf)
    fn = _conv(window_strides=(1, 1), padding=[(1, 1), (1, 1)], lhs_dilation=(2, 2))
    want = jax.jit(fn)(x, w)
    self.assertFalse(np.isnan(np.asarray(want)).any())
    for mode in _MODES:
      got = ipu_jax.jit(fn, target=_SMALL, config=_config(mode))(x, w)
      chex.assert_trees_all_equal(got, want)

  @parameterized.named_parameters(
      ("dilated_padded", dict(padding=[(2, 0), (-1, 1)], lhs_dilation=(2, 3))),
      ("dilated_only", dict(padding=[(0, 0), (0, 0)], lhs_dilation=(3, 1))),
      # Strides, rhs dilation or groups: the reference zero-fills the holes.
      ("dilated_strided", dict(padding=[(1, 1), (0, 2)], lhs_dilation=(2, 2),
                               window_strides=(2, 1))),
      ("dilated_rhs_dilated", dict(padding=[(1, 1), (0, 2)], lhs_dilation=(2, 1),
                                   rhs_dilation=(1, 2))),
      ("dilated_grouped", dict(padding=[(1, 0), (2, 1)], lhs_dilation=(2, 2),
                               feature_group_count=2)),
      ("padded_only", dict(padding=[(1, 2), (2, 0)])),
  )
  def test_non_finite_taps_match_jax(self, kwargs):
    kwargs = dict(kwargs)
    kwargs.setdefault("window_strides", (1, 1))
    groups = kwargs.get("feature_group_count", 1)
    fn = _conv(**kwargs)
    x = _random((2, 4, 5, 6), seed=8)
    w = np.array(_random((2, 4 // groups, 3, 2), seed=9))
    w[0, 0, 2, 1], w[1, 0, 0, 0] = np.inf, np.nan
    w = jnp.asarray(w)
    per_tile = ipu_jax.jit(fn, target=_SMALL, config=_config("per_tile"))
    want = np.asarray(jax.jit(fn)(x, w))
    got = np.asarray(per_tile(x, w))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Finite inputs: the same numbers in both modes (as _check; the per-tile
    # program above, lowered and compiled once, runs them).
    finite = _random(w.shape, seed=10)
    want = _check(fn, x, finite, modes=("batched",))
    got = per_tile(x, finite)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    scale = max(1.0, float(np.abs(np.asarray(want, np.float64)).max(initial=0)))
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64),
                               rtol=1e-5, atol=1e-5 * scale)

  @parameterized.named_parameters(
      ("1d", (2, 3, 9), (4, 3, 3), [(1, 2)], (3,)),
      # 3-D: the reference zero-fills the holes (0 * inf = nan), and so must we.
      ("3d", (1, 2, 4, 3, 5), (2, 2, 2, 3, 2), [(1, 0), (0, 1), (2, 2)], (2, 1, 3)),
  )
  def test_non_finite_taps_other_ranks(self, x_shape, w_shape, padding, lhs_dilation):
    fn = _conv(window_strides=(1,) * len(lhs_dilation), padding=padding,
               lhs_dilation=lhs_dilation)
    x = _random(x_shape, seed=41)
    w = np.array(_random(w_shape, seed=42))
    w.flat[0] = np.inf
    want = np.asarray(jax.jit(fn)(x, jnp.asarray(w)))
    got = np.asarray(ipu_jax.jit(fn, target=_SMALL, config=_config("per_tile"))(x, jnp.asarray(w)))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_transposed_convolution_gradient(self):
    # The input gradient of a strided convolution is lhs-dilated.
    x, w = _random((1, 2, 7, 6), seed=11), _random((3, 2, 3, 3), seed=12)
    loss = lambda x, w: jnp.sum(jnp.tanh(lax.conv_general_dilated(x, w, (2, 2), "SAME")))
    _check(jax.grad(loss, argnums=(0, 1)), x, w, rtol=1e-4)


class Float64Test(chex.TestCase, parameterized.TestCase):
  """Item 3: float64 is computed exactly and costed as a software emulation."""

  def setUp(self):
    super().setUp()
    self._x64 = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)

  def tearDown(self):
    jax.config.update("jax_enable_x64", self._x64)
    super().tearDown()

  @parameterized.named_parameters(
      ("odd", (7, 13), (13, 5)),
      ("split_k", (12, 2000), (2000, 10)),
      ("batched", (3, 5, 9), (3, 9, 4)),
      ("vector_dot", (3001,), (3001,)),
  )
  def test_matmul_is_float64_exact(self, a_shape, b_shape):
    a, b = _random(a_shape, jnp.float64, 13), _random(b_shape, jnp.float64, 14)
    want = _check(jnp.matmul, a, b, rtol=1e-12)
    self.assertEqual(want.dtype, jnp.float64)
    # fp32 arithmetic would be off by ~1e-7 relative: far outside 1e-12.
    single = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)), np.float64)
    self.assertGreater(float(np.abs(single - np.asarray(want)).max()), 1e-9)

  def test_convolution_is_float64_exact(self):
    x, w = _random((1, 2, 7, 6), jnp.float64, 15), _random((3, 2, 3, 3), jnp.float64, 16)
    _check(_conv(window_strides=(1, 1), padding="SAME"), x, w, rtol=1e-12)
    _check(_conv(window_strides=(1, 1), padding=[(1, 1), (1, 1)], lhs_dilation=(2, 2)),
           x, w, rtol=1e-12)

  def test_elementwise_and_reductions_stay_exact(self):
    fn = lambda x, y: (x * y + 1.0, jnp.sum(x * y, axis=1), jnp.max(x), x / y)
    x, y = _random((7, 13), jnp.float64, 17), _random((7, 13), jnp.float64, 18)
    want = jax.jit(fn)(x, y)
    got = ipu_jax.jit(fn, target=_SMALL)(x, y)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(got, want, rtol=1e-14, atol=1e-13)

  def test_cost_is_the_emulation_and_the_report_says_so(self):
    a, b = _random((64, 256), jnp.float64, 19), _random((256, 48), jnp.float64, 20)
    double = _steps(jnp.matmul, a, b, op="dot_general")
    single = _steps(jnp.matmul, a.astype(jnp.float32), b.astype(jnp.float32), op="dot_general")
    self.assertIn("float64 emulated in software", " ".join(double[0].notes))
    ratio = _compute_cycles(double) / _compute_cycles(single)
    # 20 fp32 vector ops per MAC at 2 per cycle against 16 MACs per cycle on
    # the AMP: ~160x the fp32 block compute (less the fixed overheads).
    self.assertGreater(ratio, 50)
    self.assertIn("float64 emulated in software", _same_conv_notes(jnp.float64))

  def test_report_summary_and_json_carry_the_note(self):
    a = _random((9, 9), jnp.float64, 21)
    report = ipu_jax.jit(jnp.matmul, target=_SMALL).lower(a, a).report
    self.assertRegex(report.summary(), r"Cost notes:\n  float64 emulated in software")
    directory = self.create_tempdir().full_path
    report.save(directory, html=False)
    self.assertIn("float64 emulated in software", ipu_jax.load_report(directory).summary())


_DTYPE_CASES = (
    ("f32", jnp.float32, jnp.float32, None),
    ("f16", jnp.float16, jnp.float16, None),
    ("bf16", jnp.bfloat16, jnp.bfloat16, None),
    ("bf16_to_f32", jnp.bfloat16, jnp.bfloat16, jnp.float32),
    ("f16_to_f32", jnp.float16, jnp.float16, jnp.float32),
    ("int8", jnp.int8, jnp.int8, None),
    ("int8_to_int32", jnp.int8, jnp.int8, jnp.int32),
    ("int32", jnp.int32, jnp.int32, None),
    ("int32_to_f32", jnp.int32, jnp.int32, jnp.float32),
    ("c64", jnp.complex64, jnp.complex64, None),
    ("bf16_f32", jnp.bfloat16, jnp.float32, None),
    ("f16_bf16_to_f32", jnp.float16, jnp.bfloat16, jnp.float32),
    ("int8_bf16", jnp.int8, jnp.bfloat16, None),
    ("int32_f32", jnp.int32, jnp.float32, None),
    ("f32_c64", jnp.float32, jnp.complex64, None),
    ("bf16_c64", jnp.bfloat16, jnp.complex64, None),
)
_TOL = {"float32": 1e-5, "complex64": 1e-5, "float16": 2e-2, "bfloat16": 5e-2}


class DtypeMatrixTest(chex.TestCase, parameterized.TestCase):
  """Item 5: every dtype combination jax.jit accepts runs, in both modes."""

  @parameterized.named_parameters(*_DTYPE_CASES)
  def test_dot_general(self, lhs_dtype, rhs_dtype, preferred):
    def fn(a, b, p, q):
      plain = lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=preferred)
      # Batch dims in the middle, as in attention (lm1b's "bqhd,bkhd->bhqk").
      batched = lax.dot_general(p, q, (((3,), (3,)), ((0, 2), (0, 2))),
                                preferred_element_type=preferred)
      return plain, batched

    args = (_random((9, 70), lhs_dtype, 21), _random((70, 6), rhs_dtype, 22),
            _random((2, 5, 3, 40), lhs_dtype, 23), _random((2, 4, 3, 40), rhs_dtype, 24))
    out_dtype = jax.eval_shape(fn, *args)[0].dtype.name
    _check(fn, *args, rtol=_TOL.get(out_dtype, 0))

  @parameterized.named_parameters(("bf16", jnp.bfloat16, None), ("bf16_to_f32", jnp.bfloat16,
                                                                   jnp.float32),
                                  ("int8_to_int32", jnp.int8, jnp.int32))
  def test_convolution(self, dtype, preferred):
    fn = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                               preferred_element_type=preferred)
    args = _random((2, 3, 7, 6), dtype, 25), _random((4, 3, 3, 3), dtype, 26)
    out_dtype = jax.eval_shape(fn, *args).dtype.name
    _check(fn, *args, rtol=_TOL.get(out_dtype, 0))

  @parameterized.named_parameters(("float32", "float32", "float32"),
                                  ("float16", "float16", "bfloat16"))
  def test_one_partials_rule_for_dot_and_ipu_matmul(self, option, want_partials):
    # bf16 operands: fp32 partials by default, half (bf16) ones on request,
    # in dot_general and ipu_jax.ops.matmul alike.
    a, b = _random((12, 2000), jnp.bfloat16, 27), _random((2000, 10), jnp.bfloat16, 28)
    cfg = _config(partials_type=option)
    for fn, name in ((jnp.matmul, "dot_general/partials"),
                     (ipu_jax.ops.matmul, "matmul/partials")):
      report = ipu_jax.jit(fn, target=_SMALL, config=cfg).lower(a, b).report
      partials = [t for t in report.profile.tensors if t.name == name]
      self.assertNotEmpty(partials, name)
      self.assertEqual(partials[0].dtype, want_partials, name)
    chex.assert_trees_all_close(
        ipu_jax.jit(ipu_jax.ops.matmul, target=_SMALL, config=cfg)(a, b).astype(jnp.float32),
        jax.jit(lambda a, b: ipu_jax.ops.matmul(a, b, partials_type=option))(a, b).astype(
            jnp.float32), rtol=2e-2, atol=0.5)


class TinyTargetTest(chex.TestCase):
  """Item 6: a product that fits nowhere is out of memory, not an IndexError."""

  def test_too_big_for_one_tile_is_out_of_memory(self):
    one = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    a, b = jnp.ones((513, 37)), jnp.ones((37, 513))
    with self.assertRaisesRegex(ipu_jax.OutOfMemoryError, r"tile 0.*bytes"):
      ipu_jax.jit(lambda p, q: p @ q, target=one)(a, b)

  def test_fits_on_one_and_two_tiles(self):
    for tiles, a_shape, b_shape in ((1, (40, 37), (37, 50)), (1, (3, 5000), (5000, 2)),
                                    (2, (400, 50), (50, 400))):
      target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)
      _check(jnp.matmul, _random(a_shape, seed=29), _random(b_shape, seed=30), target=target)

  def test_serial_passes_on_two_tiles(self):
    two = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=2)
    a, b = _random((400, 50), seed=31), _random((50, 400), seed=32)
    names = [s.name for s in _steps(jnp.matmul, a, b, target=two, op="dot_general")]
    self.assertIn("pass 2/2", names[-1])


class TinyOutputSplitKTest(chex.TestCase, parameterized.TestCase):
  """Item 9: a long contraction with a tiny result splits K and reduces in a tree."""

  def test_vector_dot_on_full_target(self):
    a, b = _random((100_000,), seed=33), _random((100_000,), seed=34)
    f = ipu_jax.jit(jnp.dot, target=_FULL)
    steps = [s for s in f.lower(a, b).report.profile.steps if s.op == "dot_general"]
    self.assertIn("tree", steps[0].name)
    self.assertGreater(len(steps), 2)  # the matmul, then at least two reduce stages
    self.assertTrue(all("reduce" in s.name for s in steps[1:]))
    # Each tile receives a few hundred bytes, nowhere near the 800 KB of one
    # tile holding both vectors.
    self.assertLess(max(int(s.exchange_bytes_in.max()) for s in steps), 4096)
    # A 100,000-term fp32 sum: its error follows the terms, not the result
    # (which may be near zero), whatever order the tree or XLA sums in.
    testing_utils.assert_within_sum_bound(f(a, b), np.dot, a, b, against=jax.jit(jnp.dot)(a, b))

  @parameterized.named_parameters(
      ("vector", (5000,), (5000,)),
      ("few_outputs", (3, 5000), (5000, 2)),
      ("batched", (2, 1, 3000), (2, 3000, 1)),
      ("int32", (4000,), (4000,)),
  )
  def test_matches_jax(self, a_shape, b_shape):
    dtype = jnp.int32 if len(a_shape) == 1 and a_shape[0] == 4000 else jnp.float32
    a, b = _random(a_shape, dtype, 35), _random(b_shape, dtype, 36)
    _check(jnp.matmul, a, b, rtol=1e-5 if dtype == jnp.float32 else 0)
    steps = _steps(jnp.matmul, a, b, op="dot_general")
    self.assertIn("tree", steps[0].name)
    for step in steps[1:]:
      # Every byte a summing tile receives was sent by another tile.
      self.assertEqual(int(step.exchange_bytes_in.sum()), int(step.exchange_bytes_out.sum()))
      self.assertGreater(step.compute_phase_cycles, 0)

  def test_several_ipus(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    a, b = _random((3000,), seed=37), _random((3000,), seed=38)
    _check(jnp.dot, a, b, target=target)
    steps = _steps(jnp.dot, a, b, target=target, op="dot_general")
    self.assertGreater(sum(s.ipu_link_bytes for s in steps[1:]), 0)

  def test_ipu_matmul_splits_k_too(self):
    # ipu_jax.ops.matmul reduce-scatters such groups (planned as it emits).
    a, b = _random((1, 5000), seed=39), _random((5000, 1), seed=40)
    _check(ipu_jax.ops.matmul, a, b, rtol=1e-5)
    names = [s.name for s in _steps(ipu_jax.ops.matmul, a, b)]
    self.assertRegex(names[0], r"\.k(1[0-9]|[2-9])\b")
    self.assertTrue(names[-1].endswith("reduce"), names)


if __name__ == "__main__":
  absltest.main()
