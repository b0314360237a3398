"""Plan caching: repeated layers reuse plans, with unchanged costs and results."""

from absl.testing import absltest
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import exchange
from ipu_jax.lowering import matmul_plan
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering import matmul_emit
from ipu_jax.lowering.rules import grouping
from ipu_jax.lowering.rules import reduction


def _layers(x, ws):
  # The same layer three times: reductions, broadcasts, matmuls, elementwise.
  for w in ws:
    mean = x.mean(axis=-1, keepdims=True)
    x = jnp.tanh((x - mean) @ w) + x
  return x.sum()


def _step_figures(lowered):
  return [(s.name, s.compute_cycles.tolist(), s.exchange_bytes_in.tolist(),
           s.exchange_bytes_out.tolist()) for s in lowered.report.profile.steps]


class PlanCacheTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    k1, k2 = jax.random.split(jax.random.key(0))
    self.x = jax.random.normal(k1, (24, 40))
    self.ws = jax.random.normal(k2, (3, 40, 40)) * 0.1

  def _clear(self):
    for cache in (grouping.GROUPS, reduction._OWNERS, reduction._STAGE2, reduction._FINAL,
                  matmul_emit._GRID_COSTS):
      cache.clear()

  def test_repeated_layers_hit_and_keep_costs(self):
    self._clear()
    fn = ipu_jax.jit(jax.grad(_layers), target=self.target)
    cold = fn.lower(self.x, self.ws)
    self.assertGreater(grouping.GROUPS.hits, 0)  # layers 2 and 3 reuse layer 1's grouping
    with plan_cache.disabled():
      fresh = ipu_jax.jit(jax.grad(_layers), target=self.target).lower(self.x, self.ws)
    self.assertEqual(_step_figures(cold), _step_figures(fresh))
    np.testing.assert_array_equal(cold.report.profile.memory.peak,
                                  fresh.report.profile.memory.peak)
    chex.assert_trees_all_close(fn(self.x, self.ws), jax.jit(jax.grad(_layers))(self.x, self.ws),
                                rtol=1e-5, atol=1e-5)

  def test_cache_is_bounded_by_bytes(self):
    cache = plan_cache.PlanCache("test", max_bytes=4000)
    for i in range(10):
      cache.get_or_compute(i, lambda: np.zeros(100))  # 800 bytes each
    self.assertLessEqual(len(cache), 5)
    self.assertEqual(cache.misses, 10)
    big = cache.get_or_compute("big", lambda: np.zeros(1000))  # over a quarter: not kept
    self.assertEqual(big.size, 1000)
    self.assertLessEqual(len(cache), 5)
    cache.get_or_compute(9, lambda: None)
    self.assertEqual(cache.hits, 1)

  def test_layouts_moved_along_the_tiles_share_relayout_costs(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    exchange._RELAYOUTS.clear()
    hits = exchange._RELAYOUTS.hits
    costs = []
    for shift in (0, 5, 11):
      tiles = (shift + np.arange(12)) % 16
      src = matmul_plan.block_grid_mapping((6, 20), (3, 4), (2, 5), tiles)
      dst = TileMapping.linear(120, 16, 4, start_tile=(shift + 3) % 16, min_bytes_per_tile=16)
      got = exchange.relayout_cost(target, src, dst, 4)
      want = exchange.interval_movement_cost(target, src, dst, 4)
      for a, b in ((got.bytes_in, want.bytes_in), (got.bytes_out, want.bytes_out),
                   (got.link_bytes_out, want.link_bytes_out)):
        np.testing.assert_array_equal(a, b)
      costs.append(got)
    # The moved layouts: shifted, not recounted.
    self.assertEqual(exchange._RELAYOUTS.hits - hits, 2)
    np.testing.assert_array_equal(costs[1].bytes_in, np.roll(costs[0].bytes_in, 5))

  def test_grids_moved_along_the_tiles_share_one_layout(self):
    a = matmul_plan.block_grid_mapping((7, 9), (2, 3), (4, 3), np.arange(6))
    b = matmul_plan.block_grid_mapping((7, 9), (2, 3), (4, 3), (9 + np.arange(6)) % 16)
    self.assertIs(a.element_row, b.element_row)  # one shared, read-only layout
    self.assertFalse(a.element_row.flags.writeable)
    np.testing.assert_array_equal(b.element_tile, ((9 + np.arange(6)) % 16)[a.element_row])
    self.assertEqual(a.relative_fingerprint(0, 16), b.relative_fingerprint(9, 16))
    self.assertNotEqual(a.fingerprint, b.fingerprint)


if __name__ == "__main__":
  absltest.main()
