"""Tests of the random-number lowering rules against jax.jit (exact).

Keys created inside the function and passed in as arguments (new-style
``jax.random.key`` and legacy ``jax.random.PRNGKey`` uint32 keys), bits,
uniform, normal, bernoulli, split, fold_in, dropout, and the tile cost of a
generator (key multicast, threefry work on the result's tiles).
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.errors import LoweringError
import testing_utils

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _key_data(tree):
  def unwrap(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
      return jax.random.key_data(x)
    return x
  return jax.tree_util.tree_map(unwrap, tree)


def _keys():
  return {"key": jax.random.key(42), "prngkey": jax.random.PRNGKey(42)}


def _dropout(key, x, rate=0.25):
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _key_slicing_supported() -> bool:
  """Whether the shape rules lower slices of key arrays (``k1, k2 = split(k)``)."""
  try:
    ipu_jax.jit(lambda k: jax.random.split(k)[0], target=_T16).lower(jax.random.key(0))
    return True
  except (LoweringError, TypeError):
    return False


class RandomTest(chex.TestCase, parameterized.TestCase):

  def assert_same(self, fn, *args, target=_T16, config=None, exact=True):
    got = _key_data(ipu_jax.jit(fn, target=target, config=config)(*args))
    want = _key_data(jax.jit(fn)(*args))
    testing_utils.assert_trees_match(got, want, exact, rtol=1e-6, atol=1e-6)
    return got

  @parameterized.parameters("key", "prngkey")
  def test_bits(self, kind):
    def fn(k):
      return [jax.random.bits(k, (), jnp.uint32), jax.random.bits(k, (37,), jnp.uint8),
              jax.random.bits(k, (3, 5, 7), jnp.uint16), jax.random.bits(k, (3, 5, 7))]
    self.assert_same(fn, _keys()[kind])

  @parameterized.parameters("key", "prngkey")
  def test_uniform_normal_bernoulli(self, kind):
    def fn(k):
      return (jax.random.bernoulli(k, 0.3, (19,)),
              jax.random.uniform(k, (41,), minval=-2.0, maxval=3.0),
              jax.random.normal(k, (6, 7)),
              jax.random.uniform(k, (9,), jnp.bfloat16),
              jax.random.normal(k, (10,), jnp.float16))
    self.assert_same(fn, _keys()[kind])

  def test_keys_made_inside(self):
    def fn(x):
      k = jax.random.key(7)
      legacy = jax.random.PRNGKey(8)
      return jax.random.uniform(k, x.shape) * x, jax.random.normal(legacy, x.shape)
    self.assert_same(fn, jnp.arange(23.0))

  def test_traced_seed(self):
    self.assert_same(lambda s: jax.random.bits(jax.random.key(s), (9,)), jnp.int32(123))

  @parameterized.parameters("key", "prngkey")
  def test_split(self, kind):
    key = _keys()[kind]
    self.assert_same(lambda k: jax.random.split(k, 5), key)
    self.assert_same(lambda k: jax.random.split(k, (2, 3)), key)
    # Split keys used without slicing: a vmapped draw per key.
    self.assert_same(
        lambda k: jax.vmap(lambda s: jax.random.normal(s, (4,)))(jax.random.split(k, 3)), key)

  @absltest.skipUnless(_key_slicing_supported(),
                       "shape rules do not lower slices of PRNG key arrays yet")
  def test_split_unpacked(self):
    def fn(k):
      k1, k2 = jax.random.split(k)
      return jax.random.uniform(k1, (5,)), jax.random.normal(k2, (5,))
    self.assert_same(fn, jax.random.key(3))
    self.assert_same(fn, jax.random.PRNGKey(3))

  @parameterized.parameters("key", "prngkey")
  def test_fold_in(self, kind):
    key = _keys()[kind]
    self.assert_same(lambda k: jax.random.uniform(jax.random.fold_in(k, 17), (11,)), key)
    self.assert_same(lambda k, m: jax.random.fold_in(k, m), key, jnp.uint32(5))
    # Batched keys folded with batched messages.
    self.assert_same(
        lambda k, m: jax.vmap(jax.random.fold_in)(jax.random.split(k, 4), m), key,
        jnp.arange(4, dtype=jnp.uint32))

  @parameterized.parameters("rbg", "philox4x32")
  def test_other_implementations(self, impl):
    def fn(k, s):
      made = jax.random.key(s, impl=impl)
      return (jax.random.uniform(k, (7,)), jax.random.bits(made, (5,)),
              jax.random.split(made, 2))
    self.assert_same(fn, jax.random.key(1, impl=impl), jnp.int32(3))

  def test_clone_wrap_unwrap(self):
    def fn(data):
      k = jax.random.wrap_key_data(data)
      return jax.random.key_data(jax.random.clone(k)), jax.random.bits(k, (3,))
    self.assert_same(fn, jax.random.key_data(jax.random.key(5)))

  @parameterized.parameters("key", "prngkey")
  def test_dropout_traced_key(self, kind):
    x = jnp.linspace(-1.0, 1.0, 33 * 7, dtype=jnp.float32).reshape(33, 7)
    self.assert_same(_dropout, _keys()[kind], x)

  def test_dropout_key_inside(self):
    x = jnp.linspace(-1.0, 1.0, 100, dtype=jnp.float32)
    self.assert_same(lambda x: _dropout(jax.random.key(0), x), x)
    self.assert_same(lambda x: _dropout(jax.random.PRNGKey(0), x), x)

  def test_dropout_in_loop(self):
    def fn(key, x):
      def body(i, h):
        return jnp.tanh(_dropout(jax.random.fold_in(key, i), h, 0.1))
      return lax.fori_loop(0, 4, body, x)
    self.assert_same(fn, jax.random.key(1), jnp.linspace(-2.0, 2.0, 50, dtype=jnp.float32))

  def test_key_carried_through_scan(self):
    def fn(key, xs):
      def body(k, x):
        k = jax.random.fold_in(k, 1)
        return k, x * jax.random.uniform(k, x.shape)
      return lax.scan(body, key, xs)
    self.assert_same(fn, jax.random.key(9), jnp.ones((5, 3)))

  def test_scan_over_keys(self):
    def fn(key, x):
      def body(c, k):
        return c + jax.random.normal(k, c.shape), jax.random.bits(k, (2,))
      return lax.scan(body, x, jax.random.split(key, 6))
    # The bits are exact; XLA may fuse the normal's erf_inv polynomial with
    # the loop's add differently (an FMA), so the sum is close, not equal.
    for key in (jax.random.key(4), jax.random.PRNGKey(4)):
      total, bits = self.assert_same(fn, key, jnp.zeros(5), exact=False)
      np.testing.assert_array_equal(bits, jax.jit(fn)(key, jnp.zeros(5))[1])

  def test_split_in_while_loop(self):
    def fn(key):
      def body(s):
        k, total, i = s
        k, sub = jax.random.split(k)
        return k, total + jax.random.uniform(sub), i + 1
      return lax.while_loop(lambda s: s[1] < 3.0, body, (key, jnp.float32(0.0), 0))
    self.assert_same(fn, jax.random.key(11))

  def test_per_tile_and_full_chip(self):
    x = jnp.ones((64, 33), jnp.float32)
    cfg = ipu_jax.IPUConfig()
    cfg.executor.mode = "per_tile"
    self.assert_same(_dropout, jax.random.key(2), x, config=cfg)
    self.assert_same(_dropout, jax.random.key(2), x, target=ipu_jax.IPUTarget.preset("ipu2"))

  def test_generator_cost(self):
    n = 16 * 1000
    lowered = ipu_jax.jit(lambda k: jax.random.bits(k, (n,)), target=_T16).lower(
        jax.random.key(0))
    steps = [s for s in lowered.profile.steps if s.op == "random_bits"]
    self.assertLen(steps, 1)
    step = steps[0]
    # The result covers every tile; each runs threefry on its share.
    self.assertEqual(int((step.compute_cycles > 0).sum()), 16)
    # The 8-byte key is multicast: every tile but the key's own receives it.
    self.assertEqual(int(step.exchange_bytes_in.sum()), 15 * 8)
    self.assertEqual(int(step.exchange_bytes_out.sum()), 8)
    self.assertGreater(lowered.report.total_cycles, 0)

  def test_threefry2x32_primitive(self):
    from jax._src.random.threefry2x32 import threefry_2x32
    keypair = jnp.array([3, 4], jnp.uint32)
    self.assert_same(lambda c: threefry_2x32(keypair, c), jnp.arange(10, dtype=jnp.uint32))


_ALGORITHMS = {"default": lax.RandomAlgorithm.RNG_DEFAULT,
               "philox": lax.RandomAlgorithm.RNG_PHILOX,
               "threefry": lax.RandomAlgorithm.RNG_THREE_FRY}
_RBG_SHAPES = ((), (0,), (37,), (3, 5, 7), (1000,))


@functools.lru_cache(maxsize=None)
def _chained_bits(algorithm, dtype):
  """Bits of every ``_RBG_SHAPES`` shape, each drawn with the key the last
  draw returned, and the last key.

  One function per (algorithm, dtype): the executor modes' checks share
  jax.jit's compile of the reference (jit caches on the function).
  """
  def fn(key):
    out = []
    for shape in _RBG_SHAPES:
      key, bits = lax.rng_bit_generator(key, shape, dtype, algorithm)
      out.append(bits)
    return key, out
  return fn


class RngBitGeneratorTest(chex.TestCase, parameterized.TestCase):
  """``lax.rng_bit_generator`` gives ``jax.jit``'s bits and new keys."""

  def assert_same(self, fn, *args, mode="batched", target=_T16):
    got = ipu_jax.jit(fn, target=target, config=testing_utils.executor_config(mode))(*args)
    want = jax.jit(fn)(*args)
    testing_utils.assert_trees_match(got, want, exact=True)

  @parameterized.product(algorithm=tuple(_ALGORITHMS), dtype=(jnp.uint8, jnp.uint16, jnp.uint32),
                         mode=testing_utils.MODES)
  def test_matches_jit(self, algorithm, dtype, mode):
    key = jnp.array([7, 0xDEADBEEF, 0xFFFFFFFE, 3], jnp.uint32)  # a counter about to carry
    self.assert_same(_chained_bits(_ALGORITHMS[algorithm], dtype), key, mode=mode)

  @parameterized.parameters(*_ALGORITHMS)
  def test_uint64(self, algorithm):
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
      self.assert_same(_chained_bits(_ALGORITHMS[algorithm], jnp.uint64),
                       jnp.array([1, 2, 3, 4], jnp.uint32))
    finally:
      jax.config.update("jax_enable_x64", previous)

  def test_key_made_inside(self):
    # A constant key, and one computed from a traced seed.
    def fn(seed):
      _, a = lax.rng_bit_generator(jnp.array([1, 2, 3, 4], jnp.uint32), (5, 3))
      key, b = lax.rng_bit_generator(jnp.full((4,), seed, jnp.uint32), (9,), jnp.uint8)
      return a, b, key
    self.assert_same(fn, jnp.uint32(12))

  def test_in_a_loop(self):
    # The key carried through a scan, as a stateful generator is used.
    def fn(key):
      return lax.scan(lambda k, _: lax.rng_bit_generator(k, (6,)), key, None, length=4)
    for mode in testing_utils.MODES:
      self.assert_same(fn, jnp.array([5, 6, 7, 8], jnp.uint32), mode=mode)

  def test_full_chip(self):
    self.assert_same(_chained_bits(_ALGORITHMS["default"], jnp.uint32),
                     jnp.array([1, 2, 3, 4], jnp.uint32), target=ipu_jax.IPUTarget.preset("ipu2"))

  @parameterized.parameters("rbg", "unsafe_rbg")
  def test_rbg_default_implementation(self, impl):
    # jax.random under jax_default_prng_impl: PRNGKey's random_bits calls
    # rng_bit_generator.
    previous = jax.config.jax_default_prng_impl
    jax.config.update("jax_default_prng_impl", impl)
    try:
      self.assert_same(lambda s: (jax.random.uniform(jax.random.PRNGKey(s), (7, 3)),
                                  jax.random.bits(jax.random.split(jax.random.PRNGKey(s))[1],
                                                  (5,), jnp.uint8)), jnp.uint32(4))
    finally:
      jax.config.update("jax_default_prng_impl", previous)

  def test_cost(self):
    n = 16 * 1000
    key = jnp.array([1, 2, 3, 4], jnp.uint32)

    def step_of(algorithm, dtype=jnp.uint32):
      lowered = ipu_jax.jit(lambda k: lax.rng_bit_generator(k, (n,), dtype, algorithm),
                            target=_T16).lower(key)
      steps = [s for s in lowered.profile.steps if s.op == "rng_bit_generator"]
      self.assertLen(steps, 1)
      return steps[0]

    philox = step_of(lax.RandomAlgorithm.RNG_DEFAULT)
    # The bits cover every tile; each runs Philox blocks on its share.
    self.assertEqual(int((philox.compute_cycles > 0).sum()), 16)
    # The 16-byte key is multicast: every tile but the key's own receives it;
    # the new key is written where the key lies.
    self.assertEqual(int(philox.exchange_bytes_in.sum()), 15 * 16)
    self.assertEqual(int(philox.exchange_bytes_out.sum()), 16)
    threefry = step_of(lax.RandomAlgorithm.RNG_THREE_FRY)
    self.assertGreater(philox.compute_cycles.max(), threefry.compute_cycles.max())
    # A quarter of the words for uint8 bits.
    narrow = step_of(lax.RandomAlgorithm.RNG_DEFAULT, jnp.uint8)
    self.assertLess(narrow.compute_cycles.max(), philox.compute_cycles.max() / 2)


if __name__ == "__main__":
  absltest.main()
