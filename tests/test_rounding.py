"""Floating-point behaviour: xoroshiro128aox, stochastic rounding as config
(ON / REPLICA_IDENTICAL_ONLY), nanoo saturation, and bit-exactness when off."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import IPUConfig
from ipu_jax.kernels import xoroshiro
from ipu_jax.rounding import hw_round_p


def _config(esr="ON", seed=0, nanoo=True, tiles=16):
  cfg = IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.floating_point_behaviour.esr = esr
  cfg.floating_point_behaviour.seed = seed
  cfg.floating_point_behaviour.nanoo = nanoo
  return cfg


def _u16(x):
  return np.asarray(x).view(np.uint16)


class XoroshiroTest(chex.TestCase):

  def test_known_answer_of_the_definition(self):
    # s0 = 1, s1 = 2: sx = 3, sa = 0 gives 3; then s0 = 2^55 ^ 3 ^ (3 << 14),
    # s1 = 3 << 36, sa = 0 again, so the output is their xor.
    out, _, _ = xoroshiro.reference_numpy(np.uint64(1), np.uint64(2), 2)
    self.assertEqual([int(v) for v in out], [3, (1 << 55) ^ 3 ^ (3 << 14) ^ (3 << 36)])

  def test_uint32_pairs_match_the_uint64_reference(self):
    st = xoroshiro.seed_states(11, np.arange(30))
    s0 = st[..., 0].astype(np.uint64) | (st[..., 1].astype(np.uint64) << np.uint64(32))
    s1 = st[..., 2].astype(np.uint64) | (st[..., 3].astype(np.uint64) << np.uint64(32))
    ref, r0, r1 = xoroshiro.reference_numpy(s0, s1, 40)
    bits, new = jax.jit(lambda s: xoroshiro.draw(s, 40))(jnp.asarray(st))
    bits, new = np.asarray(bits), np.asarray(new)
    got = bits[..., 0].astype(np.uint64) | (bits[..., 1].astype(np.uint64) << np.uint64(32))
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(new[..., 0].astype(np.uint64)
                                  | (new[..., 1].astype(np.uint64) << np.uint64(32)), r0)
    # Streams of one seed differ; output bits are balanced.
    self.assertEqual(len(set(ref[0].tolist())), 30)
    ones = np.unpackbits(ref.view(np.uint8)).mean()
    self.assertAlmostEqual(float(ones), 0.5, delta=0.01)


class StochasticRoundingConfigTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters((1 / 3, jnp.float16), (0.3, jnp.float8_e4m3fnuz))
  def test_mean_of_many_roundings_is_the_value(self, value, dtype):
    n = 20_000
    x = jnp.full((n,), value, jnp.float32)
    out = ipu_jax.jit(lambda x: x.astype(dtype), config=_config())(x)
    vals = np.asarray(out).astype(np.float64)
    lo, hi = vals.min(), vals.max()
    self.assertLess(lo, hi)                 # both neighbours occur
    self.assertLessEqual(lo, value)
    self.assertGreaterEqual(hi, value)
    # Bernoulli(p) between lo and hi: 5 standard deviations of the mean.
    p = (value - lo) / (hi - lo)
    bound = 5 * (hi - lo) * np.sqrt(p * (1 - p) / n)
    self.assertLess(abs(vals.mean() - value), bound)

  def test_small_update_moves_weight_only_with_sr(self):
    # 1e-4 is under half an fp16 ulp of 1.0 (2^-11 ~ 4.9e-4).
    def update(w, g):
      return w - jnp.float16(1e-4) * g
    w = jnp.ones((2048,), jnp.float16)
    g = jnp.ones((2048,), jnp.float16)
    off = ipu_jax.jit(update, config=_config("OFF"))(w, g)
    on = ipu_jax.jit(update, config=_config("ON"))(w, g)
    np.testing.assert_array_equal(_u16(off), _u16(w))
    moved = np.asarray(on) < 1
    self.assertGreater(moved.mean(), 0.1)
    self.assertLess(moved.mean(), 0.35)

  def test_loops_draw_new_bits_every_iteration(self):
    def train(w):
      return jax.lax.fori_loop(
          0, 40, lambda i, w: (w.astype(jnp.float32) - 1e-4).astype(jnp.float16), w)
    w = jnp.ones((1024,), jnp.float16)
    on = np.asarray(ipu_jax.jit(train, config=_config("ON"))(w), np.float64)
    off = np.asarray(ipu_jax.jit(train, config=_config("OFF"))(w), np.float64)
    np.testing.assert_array_equal(off, 1.0)  # round to nearest stalls
    self.assertAlmostEqual(on.mean(), 1 - 40e-4, delta=2e-4)
    self.assertGreater(len(np.unique(on)), 3)

  def test_one_seed_gives_equal_bits_another_seed_other_bits(self):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 29)), jnp.float32)
    f = lambda x: x.astype(jnp.float16) * jnp.float16(3)
    a = ipu_jax.jit(f, config=_config(seed=5))(x)
    b = ipu_jax.jit(f, config=_config(seed=5))(x)   # a new program: from the seed
    c = ipu_jax.jit(f, config=_config(seed=6))(x)
    np.testing.assert_array_equal(_u16(a), _u16(b))
    self.assertTrue((_u16(a) != _u16(c)).any())
    chex.assert_trees_all_close(np.asarray(a, np.float32), np.asarray(f(x), np.float32),
                                atol=0.01)

  def test_generator_state_persists_across_calls_until_reseeded(self):
    # As on the chip: the seed is set once and the streams advance, so two
    # training steps of one compiled program draw different bits.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 29)), jnp.float32)
    f = lambda x: x.astype(jnp.float16)
    run = ipu_jax.jit(f, config=_config(seed=5))
    first, second, third = _u16(run(x)), _u16(run(x)), _u16(run(x))
    self.assertTrue((first != second).any())
    self.assertTrue((second != third).any())
    run.set_seed()                          # back to floating_point_behaviour.seed
    np.testing.assert_array_equal(_u16(run(x)), first)
    np.testing.assert_array_equal(_u16(run(x)), second)
    lowered = run.lower(x)
    lowered.set_seed(6)
    np.testing.assert_array_equal(_u16(lowered(x)), _u16(ipu_jax.jit(f, config=_config(seed=6))(x)))
    with self.assertRaisesRegex(ValueError, "seed must be an int >= 0"):
      lowered.set_seed(-1)
    with self.assertRaisesRegex(TypeError, "seed must be an int >= 0.*'1'"):
      lowered.set_seed("1")

  def test_replica_identical_only_stays_identical_across_calls(self):
    # shard_map replicas inside the program: the persisted state is the
    # replicas' common one, so every call keeps their roundings equal.
    mesh = jax.sharding.AbstractMesh((2,), ("replicas",))
    spec = jax.sharding.PartitionSpec

    def update(w, g):
      def body(w, g):
        return (w - jnp.float16(1e-4) * g)[None]
      return jax.shard_map(body, mesh=mesh, in_specs=(spec(), spec()),
                           out_specs=spec("replicas"))(w, g)
    w = jnp.ones((512,), jnp.float16)
    run = ipu_jax.jit(update, config=_config("REPLICA_IDENTICAL_ONLY"))
    calls = [_u16(run(w, w)) for _ in range(2)]
    for out in calls:
      np.testing.assert_array_equal(out[0], out[1])
    self.assertTrue((calls[0] != calls[1]).any())

  @parameterized.parameters("ON", "REPLICA_IDENTICAL_ONLY")
  def test_training_layer_executions_continue_the_generators(self, esr):
    # The Keras-like layer runs lowered steps on replicas (traced); the
    # generator state still goes from one execution to the next.
    from ipu_jax.keras.programs import build_program
    from ipu_jax.keras.replication import GATHERED, REPLICATED, Replication

    def update(w, g):
      return w - jnp.float16(1e-4) * g
    w = jnp.ones((512,), jnp.float16)
    cfg = _config(esr)
    cfg.replication_factor = 2
    run, lowered = build_program(update, [w, w], [REPLICATED, REPLICATED],
                                 lambda tree: [GATHERED] * tree.num_leaves,
                                 replication=Replication(2), config=cfg, emulate=True,
                                 verbose=0)
    first, second = _u16(run(w, w)), _u16(run(w, w))
    self.assertEqual(first.shape, (2, 512))
    self.assertTrue((first[0] != second[0]).any())
    if esr == "ON":
      self.assertTrue((first[0] != first[1]).any())
    else:
      np.testing.assert_array_equal(first[0], first[1])
      np.testing.assert_array_equal(second[0], second[1])
    lowered.set_seed()
    np.testing.assert_array_equal(_u16(run(w, w)), first)

  def test_replicas_bits_differ_with_on_and_agree_with_replica_identical_only(self):
    def update(w, g):
      return w - jnp.float16(1e-4) * g
    w = jnp.ones((512,), jnp.float16)
    results = {}
    for esr in ("ON", "REPLICA_IDENTICAL_ONLY"):
      lowered = ipu_jax.jit(update, config=_config(esr)).lower(w, w)
      run = jax.jit(jax.vmap(lowered.apply, in_axes=None, axis_size=2, axis_name="replicas"))
      results[esr] = _u16(run(w, w))
    self.assertTrue((results["ON"][0] != results["ON"][1]).any())
    np.testing.assert_array_equal(results["REPLICA_IDENTICAL_ONLY"][0],
                                  results["REPLICA_IDENTICAL_ONLY"][1])

  def test_off_rewrites_nothing_and_matches_jax_jit(self):
    def f(x, w):
      return (x.astype(jnp.float16) @ w).astype(jnp.float32) + x.astype(jnp.float16) * 2
    x = np.random.default_rng(1).normal(size=(5, 7)).astype(np.float32)
    w = np.random.default_rng(2).normal(size=(7, 7)).astype(np.float16)
    lowered = ipu_jax.jit(f, config=_config("OFF")).lower(x, w)
    self.assertNotIn(hw_round_p, {e.primitive for e in lowered.jaxpr.jaxpr.eqns})
    np.testing.assert_array_equal(np.asarray(lowered(x, w)), np.asarray(jax.jit(f)(x, w)))

  def test_nanoo_off_saturates_fp16_overflow(self):
    f = lambda a, b: a + b
    a = jnp.asarray([60000, -60000, 1, jnp.inf], jnp.float16)
    sat = ipu_jax.jit(f, config=_config("OFF", nanoo=False))(a, a)
    np.testing.assert_array_equal(np.asarray(sat, np.float32), [65504, -65504, 2, 65504])
    ovf = ipu_jax.jit(f, config=_config("OFF", nanoo=True))(a, a)
    np.testing.assert_array_equal(np.asarray(ovf, np.float32), [np.inf, -np.inf, 2, np.inf])

  def test_bad_esr_is_named(self):
    cfg = IPUConfig()
    with self.assertRaisesRegex(ValueError, "floating_point_behaviour.esr must be one of 'OFF'"):
      cfg.floating_point_behaviour.esr = "on"


if __name__ == "__main__":
  absltest.main()
