"""Random numbers: ``random.mode`` 'jax' (jax.jit's bits) and 'hardware' (the
tiles' generators, priced by poprand's estimators); dropout in the BERT
runner's estimate."""

import contextlib
import functools
import io

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import IPUConfig
from ipu_jax.kernels import vocabulary as vocab

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
  def test_bits_alone_cost_poprands_estimate(self, tiles):
    f = lambda k: jax.random.bits(k, (1024, 1024))
    report = ipu_jax.jit(f, config=_config(tiles=tiles, estimate_only=True)).lower(
        jax.random.key(0)).report
    row = next(r for r in report.cycles_by_operation() if r["op"] == "random_bits")
    # One 32-bit word per element, spread linearly: the busiest tile holds ceil(n / tiles).
    expected = _poprand_uniform_int_cycles(-(-(1024 * 1024) // tiles))
    self.assertBetween(row["compute"], 0.75 * expected, 1.25 * expected)
    jax_report = ipu_jax.jit(f, config=_config("jax", tiles=tiles, estimate_only=True)).lower(
        jax.random.key(0)).report
    jax_row = next(r for r in jax_report.cycles_by_operation() if r["op"] == "random_bits")
    self.assertLess(row["compute"], jax_row["compute"] / 10)


def _vectors(n, dtype_bits):
  """64-bit vectors of ``n`` values and whether the last is ragged."""
  width = 64 // dtype_bits
  return -(-n // width), int(n % width != 0)


def _poprand_cycles(vertex, n, dtype_bits):
  """PopLibs' estimators of poprand's vertices, from their published formulas.

  ``lib/poprand/poprandCycleEstimators.cpp``, ``MAKE_PERF_ESTIMATOR_NAME(<vertex>)``,
  for ``n`` values on a tile (six workers); TruncatedNormal at 3 rounds (a cut at
  2 deviations, ``poprand::truncatedNormal``).
  """
  vectors, ragged = _vectors(n, dtype_bits)
  half = dtype_bits == 16
  w = _WORKERS
  if vertex == "Dropout":
    return 6 + 24 * w + 2 * vectors + ragged * (9 if half else 1)
  if vertex == "Bernoulli":
    vectors, ragged = -(-n // (4 if half else 2)), int(n % (4 if half else 2) != 0)
    return 4 + vectors + (21 * w + 9 * ragged if half else 23 * w + ragged)
  if vertex == "Uniform":
    return 4 + 4 * vectors + (24 * w + 12 * ragged if half else 22 * w + 4 * ragged)
  if vertex == "Normal":
    return 4 + 4 * vectors + (24 * w + 12 * ragged if half else 22 * w + 3 * ragged)
  if vertex == "TruncatedNormal":
    return (4 + 28 * w + (12 * 3 + 5) * vectors + ragged * (12 * 3 + 10) if half else
            4 + 26 * w + (11 * 3 + 5) * vectors + ragged * (13 * 3 + 2))
  raise ValueError(vertex)


def _vertex_cycles(report, prefix):
  """The cycles of the one vertex type named ``prefix...`` in ``report``."""
  rows = [r for r in report.codelets() if r["codelet"].startswith(prefix)]
  names = [r["codelet"] for r in report.codelets()]
  assert len(rows) == 1, f"expected one {prefix} vertex, got {names}"
  return rows[0]["codelet"], rows[0]["cycles"]


class PoprandVerticesTest(chex.TestCase):
  """A chain on the hardware bits costs the one poprand vertex that makes it."""

  @parameterized.parameters(
      # (shape, dtype, tiles): [1024, 1024] float16 on 1, 16 and 1,472 tiles, and a
      # float32 shape whose tiles hold a ragged number of values.
      ((1024, 1024), jnp.float16, 1), ((1024, 1024), jnp.float16, 16),
      ((1024, 1024), jnp.float16, 1472), ((384, 1000), jnp.float32, 1472),
      ((384, 1000), jnp.float32, 16))
  def test_dropout_costs_poprands_dropout(self, shape, dtype, tiles):
    x = jnp.ones(shape, dtype)
    report = ipu_jax.jit(_dropout, config=_config(tiles=tiles, estimate_only=True)).lower(
        jax.random.key(0), x).report
    name, cycles = _vertex_cycles(report, "poprand::Dropout")
    self.assertEqual(name, f"poprand::Dropout<{np.dtype(dtype).name}>")
    bits = np.dtype(dtype).itemsize * 8
    expected = _poprand_cycles("Dropout", -(-x.size // tiles), bits)
    self.assertBetween(cycles, 0.75 * expected, 1.25 * expected)

  def test_nnx_dropout_is_one_dropout_vertex(self):
    from flax import nnx
    layer = nnx.Dropout(0.1, rngs=nnx.Rngs(dropout=0))
    x = jnp.ones((256, 512), jnp.float16)
    lowered = ipu_jax.nnx_jit(lambda m, v: m(v), config=_config(tiles=16)).lower(layer, x)
    name, cycles = _vertex_cycles(lowered.report, "poprand::Dropout")
    self.assertEqual(name, "poprand::Dropout<float16>")
    self.assertBetween(cycles, 0.75 * _poprand_cycles("Dropout", 256 * 512 // 16, 16),
                       1.25 * _poprand_cycles("Dropout", 256 * 512 // 16, 16))

  @parameterized.named_parameters(
      ("bernoulli", lambda k, s: jax.random.bernoulli(k, 0.3, s), "Bernoulli", 32),
      ("uniform_f32", lambda k, s: jax.random.uniform(k, s), "Uniform", 32),
      ("uniform_f16", lambda k, s: jax.random.uniform(k, s, jnp.float16), "Uniform", 16),
      ("normal", lambda k, s: jax.random.normal(k, s), "Normal", 32),
      ("scaled_normal", lambda k, s: 0.02 * jax.random.normal(k, s) + 1.0, "Normal", 32),
      ("truncated_normal", lambda k, s: jax.random.truncated_normal(k, -2.0, 2.0, s),
       "TruncatedNormal", 32),
  )
  def test_sampler_costs_its_poprand_vertex(self, sample, vertex, bits):
    shape, tiles = (512, 512), 16
    report = ipu_jax.jit(lambda k: sample(k, shape),
                         config=_config(tiles=tiles, estimate_only=True)).lower(
        jax.random.key(0)).report
    name, cycles = _vertex_cycles(report, f"poprand::{vertex}<")
    self.assertEqual(name, f"poprand::{vertex}<float{bits}>")
    expected = _poprand_cycles(vertex, 512 * 512 // tiles, bits)
    self.assertBetween(cycles, 0.75 * expected, 1.25 * expected)

  def test_kept_mask_is_bernoulli_and_the_select_a_map(self):
    """A mask also returned (as a backward pass keeps it) is written by
    Bernoulli; the select reading it is a map codelet of the same step."""
    def f(key, x):
      keep = jax.random.bernoulli(key, 0.9, x.shape)
      return jnp.where(keep, x / 0.9, 0), keep
    report = ipu_jax.jit(f, config=_config(tiles=16)).lower(
        jax.random.key(0), jnp.ones((128, 128), jnp.float32)).report
    names = [r["codelet"] for r in report.codelets()]
    self.assertIn("poprand::Bernoulli<float32>", names)
    self.assertFalse(any(n.startswith("poprand::Dropout") for n in names), names)

  @parameterized.named_parameters(
      ("dropout", _dropout, (jnp.ones((64, 96), jnp.float16),)),
      ("normal_and_uniform", lambda k: (jax.random.normal(k, (64, 96)),
                                        jax.random.uniform(k, (64, 96), jnp.float16)), ()),
      ("truncated_normal", lambda k: jax.random.truncated_normal(k, -1.5, 2.0, (300,)), ()),
  )
  def test_numbers_are_the_bits_as_unfused_steps_make_them(self, f, args):
    """Only the cost moves: the values are those of the steps one by one."""
    fused = ipu_jax.jit(f, config=_config(seed=3))(jax.random.key(0), *args)
    cfg = _config(seed=3)
    cfg.fusion.elementwise = False
    unfused = ipu_jax.jit(f, config=cfg)(jax.random.key(0), *args)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, fused),
                                jax.tree.map(np.asarray, unfused))


class DistributionTest(chex.TestCase):
  """Hardware numbers differ from jax.jit's but follow the same distributions.

  Every test is deterministic (fixed seeds); each would fail by chance for a
  correct generator with probability ``_ALPHA``.
  """

  _ALPHA = 1e-3

  @parameterized.product(rate=(0.1, 0.5), dtype=(jnp.float16, jnp.float32))
  def test_dropout_mask_rate_binomial_test(self, rate, dtype):
    from scipy import stats
    x = jnp.ones((256, 256), dtype)
    y = np.asarray(ipu_jax.jit(functools.partial(_dropout, rate=rate), config=_config())(
        jax.random.key(0), x))
    kept = int(np.sum(y != 0))
    self.assertGreater(stats.binomtest(kept, y.size, 1 - rate).pvalue, self._ALPHA)

  @parameterized.named_parameters(
      ("uniform", lambda k, s: jax.random.uniform(k, s), "uniform"),
      ("normal", lambda k, s: jax.random.normal(k, s), "norm"),
  )
  def test_same_distribution_as_jax_jit_by_ks_tests(self, sample, law):
    from scipy import stats
    f = lambda k: sample(k, (128, 128))
    key = jax.random.key(4)
    hardware = np.asarray(ipu_jax.jit(f, config=_config())(key), np.float64).reshape(-1)
    reference = np.asarray(jax.jit(f)(key), np.float64).reshape(-1)
    self.assertGreater(np.mean(hardware != reference), 0.99)
    self.assertGreater(stats.kstest(hardware, law).pvalue, self._ALPHA)
    self.assertGreater(stats.ks_2samp(hardware, reference).pvalue, self._ALPHA)


class ReplicaSeedTest(chex.TestCase):

  def test_replicas_draw_different_masks_and_the_same_seed_the_same_masks(self):
    x = jnp.ones((64, 64), jnp.float32)

    def masks(seed):
      lowered = ipu_jax.jit(_dropout, config=_config(seed=seed)).lower(jax.random.key(0), x)
      run = jax.jit(jax.vmap(lowered.apply, in_axes=None, axis_size=3, axis_name="replicas"))
      return np.asarray(run(jax.random.key(0), x)) != 0

    first, again, other = masks(1), masks(1), masks(2)
    np.testing.assert_array_equal(first, again)
    for a, b in ((0, 1), (0, 2), (1, 2)):
      self.assertGreater(np.mean(first[a] != first[b]), 0.1)
    self.assertGreater(np.mean(first != other), 0.1)


def _two_stage_loss(params, batch, rng):
  """Two pipeline stages, each a dense layer and a dropout."""
  from ipu_jax.ops import pipeline_stage
  h = batch["x"]
  for k, w in enumerate(params):
    if k:
      h = pipeline_stage(h, k)
    keep = jax.random.bernoulli(jax.random.fold_in(rng, k), 0.75, h.shape)
    h = jnp.where(keep, jnp.tanh(h @ w) / 0.75, 0.0)
  return jnp.mean((h - batch["y"]) ** 2)


class PipelineDropoutTest(chex.TestCase):

  def test_hardware_dropout_in_a_pipeline(self):
    import optax
    import testing_utils
    from ipu_jax.pipelining import Pipeline
    params, batches = testing_utils.chain_data(2, 4, width=8, rows=4)

    def gradients(mode):
      cfg = _config(mode)
      cfg.auto_select_ipus = 2
      cfg.training.gradient_accumulation_steps = 4
      pipe = Pipeline(_two_stage_loss, optax.sgd(0.1), config=cfg, rng=True)
      return pipe.gradients(params, batches, rng=jax.random.key(7))

    grads, loss = gradients("hardware")
    jax_grads, jax_loss = gradients("jax")
    self.assertTrue(all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads)))
    self.assertTrue(np.isfinite(np.asarray(loss)))
    # The hardware masks are not jax.jit's.
    self.assertNotEqual(float(loss), float(jax_loss))


class BertDropoutEstimateTest(chex.TestCase):

  def test_estimate_only_with_dropout(self):
    from experiments import bert_pretraining
    f = bert_pretraining.define_flags(flags.FlagValues())
    f(["bert_pretraining", "--estimate_only", "--dropout=0.1", "--tiles_per_ipu=14",
       "--layers_per_ipu=1,1,1,1", "--decoder_serialization=2"])
    with contextlib.redirect_stdout(io.StringIO()):
      results = bert_pretraining.run(f)
    self.assertGreater(results["samples_per_second"], 0)


class BertAttentionDropoutTest(chex.TestCase):
  """Dropout of BERT's attention probabilities, as Graphcore's MLPerf v2.0 runs had it."""

  @staticmethod
  def _loss(attention_dropout):
    from experiments import bert
    cfg = bert.BertConfig(vocab_size=64, hidden=32, layers=1, heads=2, ffn=64, max_positions=16,
                          dropout=0.0, attention_dropout=attention_dropout)
    loss_fn, params = bert.make_loss(bert.Bert(cfg, rngs=nnx.Rngs(0)), dropout=True)
    batch = jax.tree_util.tree_map(lambda b: b[0], bert.synthetic_batches(cfg, 1, 2, 16, 4))
    return loss_fn, params, batch

  def test_jax_mode_is_jax_jit_and_the_probabilities_are_dropped(self):
    key = jax.random.key(3)
    loss_fn, params, batch = self._loss(0.5)
    got = np.asarray(ipu_jax.jit(loss_fn, config=_config("jax"))(params, batch, key))
    chex.assert_trees_all_equal(got, np.asarray(jax.jit(loss_fn)(params, batch, key)))
    plain_fn, plain_params, _ = self._loss(0.0)
    self.assertNotEqual(float(got), float(jax.jit(plain_fn)(plain_params, batch, key)))

  def test_hardware_mode_draws_a_mask_of_the_probabilities(self):
    key = jax.random.key(3)
    loss_fn, params, batch = self._loss(0.1)
    lowered = ipu_jax.jit(loss_fn, config=_config("hardware")).lower(params, batch, key)
    dropouts = [s for s in lowered.profile.steps
                if any(c.startswith(vocab.POPRAND_DROPOUT) for c in s.codelets)]
    # The model's one dropout: poprand's Dropout vertex on the probabilities
    # (fused with the softmax's last scaling, a member of its compute set).
    self.assertLen(dropouts, 1)
    self.assertIn("Bert/encoder/layers_0/attention_block/attention_dropout",
                  {m.scope for m in dropouts[0].fused_ops})
    self.assertTrue(np.isfinite(np.asarray(lowered(params, batch, key))))


if __name__ == "__main__":
  absltest.main()
