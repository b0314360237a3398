"""IPUStrategy: scope() installs the config; run() executes on the emulated IPU."""

from unittest import mock

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import config as config_lib
from ipu_jax.strategy import IPUStrategy, get_strategy


def small_config(**changes):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  for name, value in changes.items():
    setattr(cfg, name, value)
  return cfg


class StrategyTest(chex.TestCase, parameterized.TestCase):

  def test_scope_installs_and_restores_config(self):
    cfg = small_config()
    strategy = IPUStrategy(cfg)
    self.assertIsNone(get_strategy())
    with strategy.scope() as active:
      self.assertIs(active, strategy)
      self.assertIs(get_strategy(), strategy)
      self.assertIs(config_lib.get_default_config(), cfg)
      inner_cfg = small_config()
      inner_cfg.device.tiles_per_ipu = 8
      with IPUStrategy(inner_cfg).scope():
        self.assertIs(config_lib.get_default_config(), inner_cfg)
      self.assertIs(config_lib.get_default_config(), cfg)
    self.assertIsNone(get_strategy())
    self.assertIsNot(config_lib.get_default_config(), cfg)

  def test_scope_restores_after_exception(self):
    cfg = small_config()
    with self.assertRaises(RuntimeError):
      with IPUStrategy(cfg).scope():
        raise RuntimeError("boom")
    self.assertIsNone(get_strategy())
    self.assertIsNot(config_lib.get_default_config(), cfg)

  def test_jit_inside_scope_uses_the_config(self):
    cfg = small_config()
    cfg.device.version = "ipu1"
    f = ipu_jax.jit(lambda x: x * 2.0 + 1.0)
    x = jnp.arange(40, dtype=jnp.float32)
    with IPUStrategy(cfg).scope():
      lowered = f.lower(x)
      np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x * 2.0 + 1.0))
    self.assertEqual(lowered.target.num_tiles, 16)
    self.assertEqual(lowered.target.name, "ipu1")

  def test_run_matches_jax(self):
    strategy = IPUStrategy(small_config())

    def fn(x, y, scale=1.0):
      return {"sum": jnp.tanh(x) + y * scale, "diff": x - y}

    x = jnp.linspace(-2, 2, 37, dtype=jnp.float32)
    y = jnp.ones((37,), jnp.float32)
    out = strategy.run(fn, args=(x, y), kwargs={"scale": jnp.float32(3.0)})
    expected = fn(x, y, 3.0)
    chex.assert_trees_all_close(out, expected, rtol=1e-6)
    self.assertIsNotNone(strategy.last_report)
    self.assertEqual(strategy.last_report.target.num_tiles, 16)
    self.assertGreater(strategy.last_report.total_cycles, 0)
    # The program is cached: a second run lowers nothing new.
    strategy.run(fn, args=(x, y), kwargs={"scale": jnp.float32(2.0)})
    self.assertEqual(strategy._function(fn).cache_size, 1)

  def test_run_replicated(self):
    from ipu_jax import ops
    strategy = IPUStrategy(small_config(replication_factor=2))
    self.assertEqual(strategy.num_replicas_in_sync, 2)

    def fn(x):
      return x * 2.0, ops.cross_replica_sum(x)

    x = jnp.arange(8, dtype=jnp.float32)
    doubled, summed = strategy.run(fn, args=(x,))
    self.assertEqual(doubled.shape, (2, 8))
    np.testing.assert_allclose(np.asarray(doubled[1]), np.asarray(x * 2.0))
    np.testing.assert_allclose(np.asarray(summed[0]), np.asarray(x * 2.0))
    np.testing.assert_allclose(np.asarray(strategy.reduce("sum", doubled)),
                               np.asarray(x * 4.0))
    np.testing.assert_allclose(np.asarray(strategy.reduce("mean", doubled)),
                               np.asarray(x * 2.0))

  def test_run_replicated_compiles_its_runner_once(self):
    from ipu_jax.keras import replication
    strategy = IPUStrategy(small_config(replication_factor=2))

    def fn(v):
      return v * 2.0

    build = replication.Replication.build
    with mock.patch.object(replication.Replication, "build", autospec=True,
                           side_effect=build) as counted:
      runs = [strategy.run(fn, args=(jnp.arange(8.0) + k,)) for k in range(3)]
    self.assertEqual(counted.call_count, 1)
    for k, out in enumerate(runs):
      np.testing.assert_allclose(np.asarray(out), np.tile((np.arange(8.0) + k) * 2.0, (2, 1)))

  @parameterized.parameters(1, 2)
  def test_run_continues_the_rounding_generators_until_reseeded(self, replicas):
    # As a single compiled program on the chip: each run of strategy.run
    # continues the stochastic rounding streams, and set_seed restarts them.
    cfg = small_config(replication_factor=replicas)
    cfg.floating_point_behaviour.esr = "ON"
    cfg.floating_point_behaviour.seed = 3
    strategy = IPUStrategy(cfg)

    def update(w, g):
      return w - jnp.float16(1e-4) * g   # below half an fp16 ulp of 1: SR decides

    w = jnp.ones((512,), jnp.float16)
    bits = lambda out: np.asarray(out).view(np.uint16)
    first, second = bits(strategy.run(update, args=(w, w))), bits(strategy.run(update, args=(w, w)))
    self.assertEqual(first.shape, (512,) if replicas == 1 else (replicas, 512))
    self.assertTrue((first != second).any())
    # One program, reused: the state lives with it.
    self.assertEqual(strategy._function(update).cache_size, 1)
    strategy.set_seed()                     # back to floating_point_behaviour.seed
    np.testing.assert_array_equal(bits(strategy.run(update, args=(w, w))), first)
    np.testing.assert_array_equal(bits(strategy.run(update, args=(w, w))), second)
    strategy.set_seed(4)
    other_cfg = cfg.copy()
    other_cfg.floating_point_behaviour.seed = 4
    fresh = IPUStrategy(other_cfg).run(update, args=(w, w))
    np.testing.assert_array_equal(bits(strategy.run(update, args=(w, w))), bits(fresh))
    with self.assertRaisesRegex(ValueError, "seed must be an int >= 0"):
      strategy.set_seed(-1)

  def test_bad_arguments_before_any_run(self):
    strategy = IPUStrategy(ipu_jax.IPUConfig())
    # Checked before any program is compiled (nothing to reseed yet).
    with self.assertRaisesRegex(ValueError, "seed must be an int >= 0 or None; got -1"):
      strategy.set_seed(-1)
    with self.assertRaisesRegex(TypeError, "seed must be an int >= 0 or None; got 'x'"):
      strategy.set_seed("x")
    # An array was unpacked row by row into the function's arguments.
    with self.assertRaisesRegex(TypeError, r"args must be a tuple .* e.g. args=\(x,\)"):
      strategy.run(lambda x: x + 1, np.ones((3, 4), np.float32))

  def test_bad_configs(self):
    with self.assertRaises(TypeError):
      IPUStrategy({"replication_factor": 2})
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 5000  # more than the chip has: refused when the target is made
    with self.assertRaisesRegex(ValueError, "tiles_per_ipu"):
      IPUStrategy(cfg)
    with self.assertRaisesRegex(AttributeError, "replication_factor"):
      cfg.replication_factr = 2
    with self.assertRaises(ValueError):
      cfg.device.tiles_per_ipu = -1
    with self.assertRaises(ValueError):
      IPUStrategy().reduce("max", jnp.ones(2))


if __name__ == "__main__":
  absltest.main()
