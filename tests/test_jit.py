"""ipu_jax.jit: the user-facing behaviour of compiling a function."""

import inspect
import os
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax.extend import core as jcore
from jax.interpreters import mlir
import jax.numpy as jnp
import numpy as np

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)

# A primitive with no tile lowering, defined here to test the error.
_mystery_p = jcore.Primitive("mystery_op")
_mystery_p.def_impl(lambda x: x * 3)
_mystery_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_mystery_p, mlir.lower_fun(lambda x: x * 3, multiple_results=False))


class JitTest(chex.TestCase, parameterized.TestCase):

  def test_pytrees_in_and_out(self):
    def f(params, x):
      return {"y": params["w"] * x + params["b"], "aux": (x.sum(), x - 1)}

    params = {"w": jnp.arange(5.0), "b": jnp.float32(2.0)}
    x = jnp.linspace(-1, 1, 5)
    chex.assert_trees_all_close(ipu_jax.jit(f, target=_T16)(params, x), jax.jit(f)(params, x),
                                rtol=1e-6)

  def test_static_argnums(self):
    def f(x, power):
      return x ** power

    g = ipu_jax.jit(f, target=_T16, static_argnums=1)
    x = jnp.arange(7.0)
    chex.assert_trees_all_close(g(x, 2), x ** 2)
    chex.assert_trees_all_close(g(x, 3), x ** 3)
    self.assertEqual(g.cache_size, 2)
    g(x, 2)
    self.assertEqual(g.cache_size, 2)

  def test_cache_by_shape_and_dtype(self):
    g = ipu_jax.jit(lambda x: x + 1, target=_T16)
    g(jnp.ones(3))
    g(jnp.ones(3) * 2)
    self.assertEqual(g.cache_size, 1)
    g(jnp.ones(4))
    g(jnp.ones(3, jnp.int32))
    self.assertEqual(g.cache_size, 3)
    g(np.ones(3, np.float32))  # a NumPy array of a lowered shape and dtype reuses it
    self.assertEqual(g.cache_size, 3)

  def test_repeated_calls_reuse_the_configs_settings(self):
    # Building and checking the config's lowering options on every call was a
    # third of a small training step's time; an unchanged config reuses them.
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    built = []
    original = ipu_jax.IPUConfig.lowering_options

    def counting(config):
      built.append(config)
      return original(config)

    g = ipu_jax.jit(lambda x: x * 2 + 1, config=cfg)
    x = jnp.arange(6.0)
    with mock.patch.object(ipu_jax.IPUConfig, "lowering_options", counting):
      for _ in range(3):
        chex.assert_trees_all_close(np.asarray(g(x)), np.asarray(x * 2 + 1))
    self.assertLen(built, 1)
    self.assertEqual(g.cache_size, 1)

  def test_a_config_changed_between_calls_is_seen(self):
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    g = ipu_jax.jit(lambda x: x * 2 + 1, config=cfg)
    x = jnp.arange(6.0)
    g(x)
    cfg.matmuls.available_memory_proportion = 0.3  # an option the lowering reads
    chex.assert_trees_all_close(np.asarray(g(x)), np.asarray(x * 2 + 1))
    self.assertEqual(g.cache_size, 2)
    self.assertEqual(g.lower(x).report.target.num_tiles, 16)
    cfg.device.tiles_per_ipu = 32  # the target
    self.assertEqual(g.lower(x).report.target.num_tiles, 32)
    self.assertEqual(g.cache_size, 3)

  def test_lower_gives_program_and_report(self):
    lowered = ipu_jax.jit(lambda x: jnp.exp(x) * 2, target=_T16).lower(jnp.ones(100))
    self.assertGreater(lowered.num_supersteps, 0)
    self.assertIsInstance(lowered.report, ipu_jax.Report)
    self.assertEqual(lowered.report.memory_per_tile.shape, (16,))
    self.assertGreater(lowered.report.total_cycles, 0)
    self.assertIn("exp", lowered.report.summary())

  def test_unsupported_primitive_names_itself_and_the_source_line(self):
    def f(x):
      y = jnp.sin(x)
      return _mystery_p.bind(y)  # the line the error must name

    line = inspect.getsourcelines(f)[1] + 2
    with self.assertRaises(ipu_jax.LoweringError) as caught:
      ipu_jax.jit(f, target=_T16)(jnp.ones((3, 4)))
    message = str(caught.exception)
    self.assertIn("mystery_op", message)
    self.assertIn("float32[3,4]", message)
    self.assertIn(f"{os.path.basename(__file__)}:{line}", message)
    self.assertIn("register_lowering", message)

  def test_user_registered_rule_is_used(self):
    from ipu_jax.lowering import builders

    prim = jcore.Primitive("times_three")
    prim.def_impl(lambda x: x * 3)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))

    @ipu_jax.register_lowering(prim)
    def _rule(ctx, x):
      return builders.elementwise(ctx, lambda v: v * 3, [x])

    out = ipu_jax.jit(lambda x: prim.bind(x), target=_T16)(jnp.arange(5.0))
    np.testing.assert_array_equal(out, np.arange(5.0) * 3)

  def test_out_of_memory_is_raised_before_running(self):
    tiny = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=2)
    calls = []

    def f(x):
      jax.debug.callback(lambda: calls.append(1))
      return jnp.tanh(x) * 2

    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(f, target=tiny)(jnp.ones(400_000))
    self.assertEqual(calls, [])
    self.assertIn("tanh", str(caught.exception))

  def test_allow_out_of_memory_gives_report(self):
    cfg = ipu_jax.IPUConfig()
    cfg.memory.allow_out_of_memory = True
    tiny = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=2)
    lowered = ipu_jax.jit(lambda x: x * 2, target=tiny, config=cfg).lower(jnp.ones(400_000))
    self.assertGreater(len(lowered.report.over_limit_tiles), 0)
    with self.assertRaisesRegex(RuntimeError, "allow_out_of_memory"):
      lowered(jnp.ones(400_000))

  @parameterized.parameters("float32", "float16", "bfloat16", "int32", "bool")
  def test_identity_and_scalars(self, dtype):
    x = jnp.asarray(np.arange(13) % 3, dtype)
    chex.assert_trees_all_equal(ipu_jax.jit(lambda v: v, target=_T16)(x), x)
    s = jnp.asarray(1, dtype)
    chex.assert_trees_all_equal(ipu_jax.jit(lambda v: v, target=_T16)(s), s)

  def test_empty_arrays(self):
    x = jnp.zeros((0, 3))
    out = ipu_jax.jit(lambda v: jnp.exp(v) + 1, target=_T16)(x)
    self.assertEqual(out.shape, (0, 3))

  def test_uses_config_from_default_scope(self):
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 8
    with ipu_jax.default_config(cfg):
      report = ipu_jax.jit(lambda x: x + 1).lower(jnp.ones(10_000)).report
    self.assertEqual(report.memory_per_tile.shape, (8,))

  def test_calls_without_a_config_build_their_settings_once(self):
    # With no config given nor set as the default, every call built a fresh
    # default IPUConfig, so the settings kept between calls never matched and
    # the lowering options were built and checked again on each call (about
    # 35 of the 80 microseconds a call spent on the host).
    f = ipu_jax.jit(lambda x: x + 1)
    x = jnp.ones(10_000)
    with mock.patch.object(ipu_jax.IPUConfig, "lowering_options", autospec=True,
                           side_effect=ipu_jax.IPUConfig.lowering_options) as built:
      for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x) + 1)
    self.assertEqual(built.call_count, 1)
    # A default config set later is still followed, and dropped after its scope.
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 8
    with ipu_jax.default_config(cfg):
      self.assertEqual(f.lower(x).report.memory_per_tile.shape, (8,))
    self.assertEqual(f.lower(x).report.memory_per_tile.shape, (1472,))

  def test_auto_report_directory(self):
    directory = self.create_tempdir().full_path
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 4
    cfg.report.directory = directory
    ipu_jax.jit(lambda x: x * 2, config=cfg).lower(jnp.ones(10))
    saved = os.listdir(directory)
    self.assertLen(saved, 1)
    self.assertTrue(os.path.exists(os.path.join(directory, saved[0], "report.json")))


if __name__ == "__main__":
  absltest.main()
