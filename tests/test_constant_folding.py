"""Constant folding (lowering/constant_folding.py): equations of known operands
are computed on the host, as XLA and PopART fold them, bit for bit as
``jax.jit``, and add no superstep."""

import json
import os
import tempfile

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from testing_utils import T16, random_array


def _lower(fn, *args):
  return ipu_jax.jit(fn, target=T16).lower(*args)


def _ops(report) -> set:
  """The operations that cost cycles (one per lowered step's op)."""
  return {row["op"] for row in report.cycles_by_operation()}


def _codelets(report) -> str:
  """Every vertex type the program runs, in one string."""
  return " ".join(row["codelet"] for row in report.codelets())


def _folded(report) -> dict:
  return report.to_dict()["constant_folding"]


def _float_fn(dtype):
  def fn(x):
    # jax.random.uniform's bounds, a converted divisor, sqrt(d_head), as models write them.
    scale = jnp.sqrt(jnp.asarray(64.0, jnp.float32)).astype(dtype)
    low, high = jnp.asarray(-0.5, jnp.float32).astype(dtype), jnp.asarray(1.5, dtype)
    span = jnp.reshape(high - low, (1, 1))
    return x / scale * span + low / jnp.asarray(3.0, dtype)
  return fn


def _int_fn(x):
  step = (jnp.int32(7) // jnp.int32(2)) * jnp.int32(5) - (jnp.int32(3) << 2)
  return x * step + jnp.maximum(jnp.int32(-4), jnp.int32(9) % jnp.int32(4))


def _bool_fn(x):
  flag = (jnp.float32(0.1) + jnp.float32(0.2) > jnp.float32(0.3)) ^ jnp.bool_(True)
  return jnp.logical_or(x, flag) != jnp.logical_not(flag)


class BitExactTest(chex.TestCase):

  @parameterized.named_parameters(
      ("f32", jnp.float32), ("f16", jnp.float16), ("bf16", jnp.bfloat16))
  def test_float_constants_fold_to_jax_jits_bits(self, dtype):
    x = random_array((9, 13), dtype, seed=1)
    lowered = _lower(_float_fn(dtype), x)
    # sqrt, sub, reshape, div (and the converts to float16 / bfloat16).
    self.assertGreaterEqual(_folded(lowered.report)["equations_folded"], 4)
    got = np.asarray(lowered(x))
    want = np.asarray(jax.jit(_float_fn(dtype))(x))
    self.assertEqual(got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))

  @parameterized.named_parameters(("int32", _int_fn, jnp.int32), ("bool", _bool_fn, jnp.bool_))
  def test_integer_and_bool_constants_fold_to_jax_jits_values(self, fn, dtype):
    x = (random_array((7, 5), jnp.int32, seed=2) > 0) if dtype == jnp.bool_ else \
        random_array((7, 5), jnp.int32, seed=2)
    lowered = _lower(fn, x)
    self.assertGreaterEqual(_folded(lowered.report)["equations_folded"], 3)
    np.testing.assert_array_equal(np.asarray(lowered(x)), np.asarray(jax.jit(fn)(x)))

  def test_uniform_bounds_fold_inside_its_jit(self):
    """``minval``/``maxval`` reach ``_uniform``'s body as literal operands."""
    def fn(key):
      return jax.random.uniform(key, (8, 8), jnp.float16, minval=-1.0, maxval=3.0)
    key = jax.random.key(5)
    lowered = _lower(fn, key)
    by_primitive = _folded(lowered.report)["by_primitive"]
    self.assertEqual(by_primitive.get("convert_element_type"), 2)
    self.assertEqual(by_primitive.get("sub"), 1)
    np.testing.assert_array_equal(np.asarray(lowered(key)), np.asarray(jax.jit(fn)(key)))


class NoSuperstepTest(chex.TestCase):

  def test_folded_equations_emit_no_superstep(self):
    def fn(x):
      return x * (jnp.sqrt(jnp.float32(4.0)) - jnp.float32(1.5))
    x = random_array((32, 16), seed=3)
    report = _lower(fn, x).report
    # sqrt and sub are computed on the host: only the multiply runs.
    self.assertEqual(report.num_supersteps, 1)
    self.assertEqual(_ops(report), {"mul"})
    self.assertEqual(_folded(report), {"equations_folded": 2,
                                       "by_primitive": {"sqrt": 1, "sub": 1}})

  def test_summary_json_and_saved_report_say_how_many(self):
    report = _lower(_float_fn(jnp.float16), jnp.ones((4, 4), jnp.float16)).report
    folded = _folded(report)
    line = next(l for l in report.summary().splitlines() if "Constant folding:" in l)
    self.assertIn(f"Constant folding:      {folded['equations_folded']} equations folded", line)
    with tempfile.TemporaryDirectory() as directory:
      report.save(directory, plots=False, html=False)
      with open(os.path.join(directory, "report.json"), encoding="utf-8") as f:
        self.assertEqual(json.load(f)["constant_folding"], folded)
      self.assertIn(line, ipu_jax.Report.load(directory).summary())

  def test_nothing_to_fold_has_no_line(self):
    report = _lower(lambda x: x * 2.0, jnp.ones(3)).report
    self.assertEqual(_folded(report)["equations_folded"], 0)
    self.assertNotIn("Constant folding", report.summary())


class NotFoldedTest(chex.TestCase):

  def test_large_constant_is_not_folded(self):
    big = jnp.arange(256 * 128, dtype=jnp.float32).reshape(256, 128)  # 128 KiB
    big = np.asarray(big)
    small = big[:8, :8].copy()
    x = random_array((256, 128), seed=4)
    # Closed over (jnp.asarray: not NumPy's own arithmetic at trace time).
    big_fn = lambda v: v + jnp.asarray(big) * 2.0
    small_fn = lambda v: v[:8, :8] + jnp.asarray(small) * 2.0
    big_report = _lower(big_fn, x).report
    self.assertEqual(_folded(big_report)["equations_folded"], 0)
    self.assertIn("Elementwise<mul>", _codelets(big_report))
    small_report = _lower(small_fn, x).report
    self.assertEqual(_folded(small_report)["by_primitive"], {"mul": 1})
    self.assertNotIn("Elementwise<mul>", _codelets(small_report))
    for fn in (big_fn, small_fn):
      np.testing.assert_array_equal(np.asarray(ipu_jax.jit(fn, target=T16)(x)),
                                    np.asarray(jax.jit(fn)(x)))

  def test_expanding_broadcast_stays_a_broadcast(self):
    # XLA leaves broadcasts unfolded too: a scalar is read as one value.
    report = _lower(lambda x: x + jnp.full((4, 4), 2.0) * 3.0, jnp.ones((4, 4))).report
    self.assertNotIn("broadcast_in_dim", _folded(report)["by_primitive"])

  def test_random_bits_of_a_constant_key_are_not_folded(self):
    def fn(x):
      return x + jax.random.uniform(jax.random.key(7), x.shape)
    x = jnp.zeros((4, 4))
    lowered = _lower(fn, x)
    by_primitive = _folded(lowered.report)["by_primitive"]
    self.assertNotIn("random_bits", by_primitive)
    self.assertNotIn("random_wrap", by_primitive)
    self.assertIn("random_bits", {row["name"] for row in lowered.report.to_dict()["steps"]}
                  | _ops(lowered.report))
    np.testing.assert_array_equal(np.asarray(lowered(x)), np.asarray(jax.jit(fn)(x)))

  def test_effects_and_transcendentals_are_not_folded(self):
    def fn(x):
      jax.debug.callback(lambda v: None, jnp.float32(2.0))
      return x * jnp.exp(jnp.float32(1.0))
    x = random_array((4, 4), seed=6)
    lowered = _lower(fn, x)
    self.assertEqual(_folded(lowered.report)["equations_folded"], 0)
    self.assertIn("exp", _ops(lowered.report))
    np.testing.assert_array_equal(np.asarray(lowered(x)), np.asarray(jax.jit(fn)(x)))

  def test_division_by_zero_is_left_to_trap(self):
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.floating_point_behaviour.div0 = True
    fn = lambda x: x + jnp.float32(1.0) / jnp.float32(0.0)
    lowered = ipu_jax.jit(fn, config=cfg).lower(jnp.ones(3))
    self.assertEqual(_folded(lowered.report)["equations_folded"], 0)
    with self.assertRaises(ipu_jax.FloatingPointException):
      np.asarray(lowered(jnp.ones(3)))


if __name__ == "__main__":
  absltest.main()
