"""Half partials change the arithmetic: an fp16 matmul with partials_type
float16 accumulates as the NumPy model of the plan says, bit for bit, in both
executor modes, through ``jnp.matmul`` and ``ipu_jax.ops.matmul``."""

import chex
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax.lowering import half_partials
from ipu_jax.lowering.matmul_plan import plan_matmul

_F16 = np.dtype(np.float16)


def _config(mode="batched", tiles=16, partials="float16"):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.matmuls.partials_type = partials
  cfg.executor.mode = mode
  return cfg


def _operands(m, k, n, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.uniform(-0.5, 1.5, size=(m, k)).astype(np.float16)
  w = rng.uniform(0.5, 1.5, size=(k, n)).astype(np.float16)
  return a, w


def _model(cfg, a, w):
  (m, k), n = a.shape, w.shape[1]
  plan = plan_matmul(cfg.to_target(), 1, m, n, k, _F16, _F16,
                     cfg.matmuls.available_memory_proportion)
  return half_partials.numpy_model(a, w, plan.grid[3], plan.block[3],
                                   fanins=plan.reduce_fanins), plan


def _assert_bits(test, got, want):
  got = np.asarray(got)
  test.assertEqual(got.dtype, np.float16)
  np.testing.assert_array_equal(got.view(np.uint16), np.asarray(want).view(np.uint16))


class HalfPartialsTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters("batched", "per_tile")
  def test_long_k_matches_numpy_model_bit_for_bit(self, mode):
    a, w = _operands(3, 1000, 5)
    cfg = _config(mode)
    got = np.asarray(ipu_jax.jit(jnp.matmul, config=cfg)(a, w))
    want, _ = _model(cfg, a, w)
    _assert_bits(self, got, want)
    # fp32 partials round once: the half-partials result differs from it, and
    # from the exact sum by more.
    f32p = np.asarray(ipu_jax.jit(jnp.matmul, config=_config(mode, partials="float32"))(a, w))
    exact = a.astype(np.float64) @ w.astype(np.float64)
    self.assertTrue((got != f32p).any())
    self.assertGreater(np.abs(got - exact).mean(), np.abs(f32p - exact).mean())

  @parameterized.parameters("batched", "per_tile")
  def test_ops_matmul_per_op_partials_match_the_model(self, mode):
    # The op's own partials_type, with the configured one float32.
    a, w = _operands(17, 300, 9, seed=1)
    fn = lambda x, y: ipu_jax.ops.matmul(x, y, partials_type="float16")
    got = ipu_jax.jit(fn, config=_config(mode, partials="float32"))(a, w)
    want, _ = _model(_config(mode), a, w)
    _assert_bits(self, got, want)

  @parameterized.parameters("batched", "per_tile")
  def test_tree_reduction_adds_partials_stage_by_stage(self, mode):
    # A dot of two long vectors on 1472 tiles: the plan sums the K partials
    # in a tree of several stages (three, as poplin's getNumReduceStages gives
    # a depth of 125 or more) with an uneven last group; that order, not the
    # linear one, is the result.
    a, w = _operands(1, 20000, 1, seed=2)
    cfg = _config(mode, tiles=1472)
    want, plan = _model(cfg, a, w)
    self.assertGreater(len(plan.reduce_fanins), 1)
    self.assertNotEqual(plan.grid[3] % plan.reduce_fanins[0], 0)
    _assert_bits(self, ipu_jax.jit(jnp.matmul, config=cfg)(a, w), want)
    linear = half_partials.numpy_model(a, w, plan.grid[3], plan.block[3])
    self.assertNotEqual(float(linear[0, 0]), float(want[0, 0]))

  def test_ops_matmul_outside_the_tile_program_is_one_tiles_arithmetic(self):
    a, w = _operands(4, 200, 3, seed=3)
    got = ipu_jax.ops.matmul(a, w, partials_type="float16")
    _assert_bits(self, got, half_partials.numpy_model(a, w, 1, 200))
    batched = ipu_jax.ops.matmul(np.stack([a, a]), w, partials_type="float16")
    _assert_bits(self, batched[1], got)

  def test_add_in_order_skips_missing_members(self):
    parts = jnp.asarray([[-0.0, 1.0], [0.0, 2.0]], jnp.float16)
    got = half_partials.add_in_order(parts, np.asarray([1, 2]))
    _assert_bits(self, got, np.asarray([-0.0, 3.0], np.float16))


if __name__ == "__main__":
  absltest.main()
