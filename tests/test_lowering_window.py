"""Tests of the windowed-reduction lowering rules (lowering/rules/window.py)."""

from absl.testing import absltest
from absl.testing import parameterized
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
import testing_utils

_T16 = testing_utils.T16
_assert_matches = testing_utils.assert_matches_jit


def _images(shape=(4, 9, 9, 3), seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


class PoolingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("2x2_stride2", (2, 2), (2, 2), "VALID"),
      ("3x3_stride1_same", (3, 3), (1, 1), "SAME"),
      ("3x2_stride21_same", (3, 2), (2, 1), "SAME"),
  )
  def test_max_and_avg_pool(self, window, strides, padding):
    x = _images()
    dims, steps = (1,) + window + (1,), (1,) + strides + (1,)
    fn = lambda x: {
        "close": nn.avg_pool(x, window, strides, padding),
        "exact": (nn.max_pool(x, window, strides, padding),
                  lax.reduce_window(x, jnp.inf, lax.min, dims, steps, padding))}
    _assert_matches(fn, x)

  @parameterized.named_parameters(
      ("2x2_stride2", (2, 2), (2, 2), "VALID"),
      ("3x3_stride1_same", (3, 3), (1, 1), "SAME"),
  )
  def test_grads(self, window, strides, padding):
    x = _images(seed=1)
    max_grad = jax.grad(lambda x: (nn.max_pool(x, window, strides, padding) ** 2).sum())
    avg_grad = jax.grad(lambda x: (nn.avg_pool(x, window, strides, padding) ** 2).sum())
    _assert_matches(lambda x: (max_grad(x), avg_grad(x)), x)

  def test_select_and_scatter_add_ties(self):
    # Ties inside a window: the cotangent goes to the first maximum, as in XLA.
    x = np.random.default_rng(2).integers(0, 2, (2, 8, 8, 4)).astype(np.float32)
    ct = _images((2, 4, 4, 4), seed=3)
    fn = lambda x, c: jax.vjp(lambda x: nn.max_pool(x, (2, 2), (2, 2)), x)[1](c)
    _assert_matches(fn, x, ct, exact=True)

  def test_max_pool_jvp(self):
    x, t = _images(seed=4), _images(seed=5)
    fn = lambda x, t: jax.jvp(lambda x: nn.max_pool(x, (3, 3), (1, 1), "SAME"), (x,), (t,))
    _assert_matches(fn, x, t, exact=True)

  def test_half_and_int(self):
    x = _images((3, 8, 8, 5), seed=6, dtype=np.float32)
    for dtype in (jnp.float16, jnp.bfloat16):
      _assert_matches(lambda x: (nn.max_pool(x, (2, 2), (2, 2)), nn.avg_pool(x, (2, 2), (2, 2))),
                      jnp.asarray(x, dtype), rtol=2e-2, atol=2e-2)
    i = np.random.default_rng(7).integers(-100, 100, (3, 8, 8, 5), dtype=np.int32)
    fn = lambda i: (lax.reduce_window(i, 0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
                    nn.max_pool(i, (3, 3), (1, 1), "SAME"))
    _assert_matches(fn, i, exact=True)


class ReduceWindowTest(parameterized.TestCase):

  def test_dilations_and_padding(self):
    x = _images((2, 11, 10, 3), seed=8)
    kwargs = dict(window_dimensions=(1, 2, 3, 1), window_strides=(1, 2, 1, 1),
                  padding=((0, 0), (1, 0), (0, 2), (0, 0)), base_dilation=(1, 2, 1, 1),
                  window_dilation=(1, 1, 2, 1))
    fn = lambda x: (lax.reduce_window(x, 0.0, lax.add, **kwargs),
                    lax.reduce_window(x, -jnp.inf, lax.max, **kwargs),
                    lax.reduce_window(x, jnp.inf, lax.min, **kwargs))
    _assert_matches(fn, x)

  def test_generic_computations(self):
    x = _images((3, 7, 7, 2), seed=9)
    # Not a known monoid: the generic reduce_window primitive with a jaxpr.
    fn = lambda x: (
        lax.reduce_window(1 + 0.1 * x, 1.0, lax.mul, (1, 2, 2, 1), (1, 1, 1, 1), "SAME"),
        lax.reduce_window(x, 0.0, lambda a, b: a + b, (1, 3, 1, 1), (1, 2, 1, 1), "VALID"))
    _assert_matches(fn, x)

  def test_variadic_reduce_window(self):
    x = _images((2, 6, 6, 2), seed=10)
    idx = np.broadcast_to(np.arange(x.size, dtype=np.int32).reshape(x.shape), x.shape)

    def pick(a, b):
      take_a = a[0] >= b[0]
      return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    fn = lambda x, i: lax.reduce_window((x, i), (-jnp.inf, np.int32(-1)), pick,
                                        (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    _assert_matches(fn, x, idx, exact=True)

  def test_no_unwindowed_axis_runs_on_one_tile(self):
    x = np.random.default_rng(11).standard_normal((50,)).astype(np.float32)
    fn = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "SAME")
    _assert_matches(fn, x, exact=True)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    self.assertEqual(int((lowered.profile.steps[-1].compute_cycles > 0).sum()), 1)

  def test_size_zero(self):
    x = np.zeros((0, 6, 6, 2), np.float32)
    _assert_matches(lambda x: nn.max_pool(x, (2, 2), (2, 2)), x, exact=True)


class PlanTest(absltest.TestCase):

  def test_partitioned_along_batch_without_halos(self):
    x = _images((32, 8, 8, 4), seed=12)
    lowered = ipu_jax.jit(lambda x: nn.max_pool(x, (2, 2), (2, 2)), target=_T16).lower(x)
    step = lowered.profile.steps[-1]
    self.assertEqual(step.op, "reduce_window_max")
    # 32 images over 16 tiles: each tile pools its own 2 images.
    self.assertEqual(int((step.compute_cycles > 0).sum()), 16)
    # Input bytes moved at most once (no halo duplication).
    self.assertLessEqual(int(step.exchange_bytes_in.sum()), x.nbytes)
    self.assertGreater(lowered.report.total_cycles, 0)

  def test_splits_channels_when_batch_is_one(self):
    x = _images((1, 6, 6, 64), seed=13)
    lowered = ipu_jax.jit(lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME"), target=_T16).lower(x)
    pool = [s for s in lowered.profile.steps if s.op == "reduce_window_sum"][0]
    self.assertEqual(int((pool.compute_cycles > 0).sum()), 16)

  def test_full_ipu2(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    x = _images((64, 12, 12, 8), seed=14)
    fn = jax.grad(lambda x: (nn.max_pool(x, (2, 2), (2, 2)) ** 2).sum()
                  + nn.avg_pool(x, (3, 3), (1, 1), "SAME").sum())
    _assert_matches(fn, x, target=target)


if __name__ == "__main__":
  absltest.main()
