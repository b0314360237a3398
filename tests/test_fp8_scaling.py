"""Per-tensor FP8 scaling (FP8-AMAX): the scale rule, fp8_dense and its
gradients, the nnx.Linear wrapper's telemetry."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import absltest
from flax import nnx

import ipu_jax
from ipu_jax.fp8_scaling import (amax_log2_scale, collect_telemetry, fp8_dense,
                                 fp8_linear_from, plot_scales, scale_of_amax)


class FP8ScalingTest(chex.TestCase):

  def test_scale_puts_amax_just_under_the_format_max(self):
    scale = jax.jit(amax_log2_scale)
    for amax in (1e-6, 0.37, 1.0, 239.0, 5e4):
      x = jnp.asarray([amax, -amax / 3], jnp.float32)
      s = int(scale(x))
      self.assertLessEqual(amax * 2.0 ** s, 240)
      self.assertGreater(amax * 2.0 ** (s + 1), 240)
      self.assertEqual(s, int(scale_of_amax(amax)))
    self.assertEqual(int(amax_log2_scale(jnp.zeros(3))), 0)

  def test_fp8_dense_and_gradients_close_to_float32(self):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 16)) * 1e-3, jnp.float32)  # tiny: scaling matters
    k = jnp.asarray(rng.normal(size=(16, 5)), jnp.float32)
    y, y32 = jax.jit(fp8_dense)(x, k), x @ k
    np.testing.assert_allclose(y, y32, atol=0.1 * float(jnp.abs(y32).max()))
    g = jax.jit(jax.grad(lambda k: jnp.sum(fp8_dense(x, k) ** 2)))(k)
    g32 = jax.grad(lambda k: jnp.sum((x @ k) ** 2))(k)
    np.testing.assert_allclose(g, g32, atol=0.15 * float(jnp.abs(g32).max()))
    # On the IPU it is the same computation.
    got = ipu_jax.jit(fp8_dense, target=ipu_jax.IPUTarget.preset("ipu21", tiles_per_ipu=16))(x, k)
    chex.assert_trees_all_close(got, y, rtol=1e-5)

  @pytest.mark.slow  # eager Flax init, nnx.jit and matplotlib: ~15-35 s on 2 shared cores
  def test_linear_wrapper_records_amax_history(self):
    lin = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    f8 = fp8_linear_from(lin, history=3)
    call = nnx.jit(lambda m, x: m(x))
    for scale in (1.0, 2.0, 4.0, 8.0):
      call(f8, jnp.full((2, 8), scale, jnp.float32))
    t = collect_telemetry(f8)["<root>"]
    np.testing.assert_array_equal(t["input_amax"], [2.0, 4.0, 8.0])
    self.assertEqual(int(t["input_scale"]), int(scale_of_amax(8.0)))
    self.assertEqual(float(t["weight_amax"][-1]), float(jnp.abs(lin.kernel[...]).max()))
    path = self.create_tempdir().full_path + "/scales.png"
    plot_scales({"activations": [3, 4, 4], "weights": [5, 5]}, path)
    with open(path, "rb") as f:
      self.assertEqual(f.read(4), b"\x89PNG")


if __name__ == "__main__":
  absltest.main()
