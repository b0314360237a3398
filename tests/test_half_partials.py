"""Half partials change the arithmetic: an fp16 matmul with partials_type
float16 accumulates as the NumPy model of the plan says, bit for bit."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import ipu_jax
from ipu_jax.lowering import half_partials
from ipu_jax.lowering.matmul_plan import plan_matmul


class HalfPartialsTest(chex.TestCase):

  def test_long_k_matches_numpy_model_bit_for_bit(self):
    m, k, n = 3, 1000, 5
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 1.5, size=(m, k)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, size=(k, n)).astype(np.float16)
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.matmuls.partials_type = "float16"
    got = np.asarray(ipu_jax.jit(jnp.matmul, config=cfg)(a, w))
    f16 = np.dtype(np.float16)
    plan = plan_matmul(cfg.to_target(), 1, m, n, k, f16, f16,
                       cfg.matmuls.available_memory_proportion)
    gk, bk = plan.grid[3], plan.block[3]
    want = half_partials.numpy_model(a, w, gk, bk)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    # fp32 partials round once: the half-partials result differs from it, and
    # from the exact sum by more.
    cfg.matmuls.partials_type = "float32"
    f32p = np.asarray(ipu_jax.jit(jnp.matmul, config=cfg)(a, w))
    exact = a.astype(np.float64) @ w.astype(np.float64)
    self.assertTrue((got != f32p).any())
    self.assertGreater(np.abs(got - exact).mean(), np.abs(f32p - exact).mean())


if __name__ == "__main__":
  absltest.main()
