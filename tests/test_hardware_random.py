"""Random numbers: ``random.mode`` 'jax' (jax.jit's bits) and 'hardware' (the
tiles' generators, priced by poprand's estimators); dropout in the BERT
runner's estimate."""

import contextlib
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import IPUConfig

_WORKERS = 6


def _config(mode="hardware", seed=0, tiles=16, estimate_only=False):
  cfg = IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.memory.allow_out_of_memory = estimate_only  # a cost estimate on 1 or 16 tiles
  cfg.random.mode = mode
  cfg.floating_point_behaviour.seed = seed
  return cfg


def _dropout(key, x, rate=0.1):
  """What ``nnx.Dropout`` traces to: bernoulli of the keep rate, then a select."""
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _poprand_uniform_int_cycles(words_per_tile):
  """PopLibs' ``Uniform<int>`` (scale 0) estimator, from its published formula.

  ``lib/poprand/poprandCycleEstimators.cpp``, ``MAKE_PERF_ESTIMATOR_NAME(Uniform)``:
  ``4 + 22 * workers + out.size() / 2`` on every tile with something to write.
  """
  w = np.asarray(words_per_tile)
  return np.where(w > 0, 4 + 22 * _WORKERS + w // 2, 0)


class JaxModeTest(chex.TestCase):

  def test_dropout_is_bit_exact_with_jax_jit(self):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 45)), jnp.float16)
    key = jax.random.key(3)
    got = ipu_jax.jit(_dropout, config=_config("jax"))(key, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(_dropout)(key, x)))

  def test_summary_names_random_bit_steps_and_the_option(self):
    x = jnp.ones((64, 64), jnp.float16)
    summary = ipu_jax.jit(_dropout, config=_config("jax")).lower(
        jax.random.key(0), x).report.summary()
    line = next(l for l in summary.splitlines() if "Random bits:" in l)
    self.assertRegex(line, r"1 step, \d+\.\d% of cycles")
    self.assertIn("cfg.random.mode = 'hardware'", line)
    hardware = ipu_jax.jit(_dropout, config=_config("hardware")).lower(
        jax.random.key(0), x).report.summary()
    self.assertNotIn("Random bits:", hardware)

  def test_bad_mode_is_named(self):
    with self.assertRaisesRegex(ValueError, r"random\.mode must be one of 'jax', 'hardware'"):
      IPUConfig().random.mode = "threefry"


class HardwareModeTest(chex.TestCase):

  def test_dropout_mask_rate_matches_the_rate(self):
    n, rate = 256 * 256, 0.1
    x = jnp.ones((256, 256), jnp.float32)
    y = np.asarray(ipu_jax.jit(_dropout, config=_config())(jax.random.key(0), x))
    kept = float(np.mean(y != 0))
    # Binomial: 6 standard deviations (a false failure once in ~5e8 runs).
    bound = 6 * np.sqrt(rate * (1 - rate) / n)
    self.assertLess(abs(kept - (1 - rate)), bound)
    np.testing.assert_allclose(y[y != 0], 1 / (1 - rate), rtol=1e-6)

  @parameterized.named_parameters(
      # (sampler, mean, variance, fourth central moment)
      ("uniform", lambda k, s: jax.random.uniform(k, s), 0.5, 1 / 12, 1 / 80),
      ("normal", lambda k, s: jax.random.normal(k, s), 0.0, 1.0, 3.0),
  )
  def test_moments_match_within_six_standard_errors(self, sample, mean, var, m4):
    n = 128 * 128
    x = np.asarray(ipu_jax.jit(lambda k: sample(k, (128, 128)), config=_config())(
        jax.random.key(1)), np.float64).reshape(-1)
    self.assertLess(abs(x.mean() - mean), 6 * np.sqrt(var / n))
    self.assertLess(abs(x.var() - var), 6 * np.sqrt((m4 - var**2) / n))

  def test_truncated_normal_stays_in_bounds_with_its_variance(self):
    n = 128 * 128
    x = np.asarray(ipu_jax.jit(lambda k: jax.random.truncated_normal(k, -2.0, 2.0, (128, 128)),
                               config=_config())(jax.random.key(2)), np.float64)
    self.assertTrue(((x >= -2) & (x <= 2)).all())
    # The standard normal truncated to [-2, 2]: variance 0.7737 (1 - 4 phi(2) / erf(sqrt 2)).
    self.assertLess(abs(x.var() - 0.7737), 6 * np.sqrt(2 * 0.7737**2 / n))

  def test_numbers_differ_from_jax_jit_and_repeat_with_the_seed(self):
    key = jax.random.key(0)
    f = lambda k: jax.random.bits(k, (40, 33))
    a = np.asarray(ipu_jax.jit(f, config=_config(seed=5))(key))
    b = np.asarray(ipu_jax.jit(f, config=_config(seed=5))(key))
    c = np.asarray(ipu_jax.jit(f, config=_config(seed=6))(key))
    np.testing.assert_array_equal(a, b)
    self.assertGreater(np.mean(a != c), 0.99)
    self.assertGreater(np.mean(a != np.asarray(jax.jit(f)(key))), 0.99)

  def test_replicas_draw_different_numbers(self):
    lowered = ipu_jax.jit(lambda k: jax.random.uniform(k, (512,)), config=_config()).lower(
        jax.random.key(0))
    run = jax.jit(jax.vmap(lowered.apply, in_axes=None, axis_size=2, axis_name="replicas"))
    out = np.asarray(run(jax.random.key(0)))
    self.assertGreater(np.mean(out[0] != out[1]), 0.99)

  @parameterized.parameters(1, 16, 1472)
  def test_bits_cost_poprands_estimate(self, tiles):
    x = jnp.ones((1024, 1024), jnp.float16)
    report = ipu_jax.jit(_dropout, config=_config(tiles=tiles, estimate_only=True)).lower(
        jax.random.key(0), x).report
    row = next(r for r in report.cycles_by_operation() if r["op"] == "random_bits")
    # One 32-bit word per element (bernoulli draws a float32 uniform), spread
    # linearly: the busiest tile holds ceil(n / tiles).
    expected = _poprand_uniform_int_cycles(-(-x.size // tiles))
    self.assertBetween(row["compute"], 0.75 * expected, 1.25 * expected)
    jax_report = ipu_jax.jit(_dropout, config=_config("jax", tiles=tiles,
                                                      estimate_only=True)).lower(
        jax.random.key(0), x).report
    jax_row = next(r for r in jax_report.cycles_by_operation() if r["op"] == "random_bits")
    self.assertLess(row["compute"], jax_row["compute"] / 10)


class BertDropoutEstimateTest(chex.TestCase):

  def test_estimate_only_with_dropout(self):
    from experiments import bert_pretraining
    f = bert_pretraining.define_flags(flags.FlagValues())
    f(["bert_pretraining", "--estimate_only", "--dropout=0.1", "--tiles_per_ipu=14",
       "--layers_per_ipu=1,1,1,1", "--decoder_serialization=2"])
    with contextlib.redirect_stdout(io.StringIO()):
      results = bert_pretraining.run(f)
    self.assertGreater(results["samples_per_second"], 0)


if __name__ == "__main__":
  absltest.main()
