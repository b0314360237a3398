"""Plan caching: repeated layers reuse plans, with unchanged costs and results."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import builders
from ipu_jax.lowering import exchange
from ipu_jax.lowering import matmul_grid
from ipu_jax.lowering import program as P
from ipu_jax.kernels import estimators
from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering import matmul_operands
from ipu_jax.lowering import grouping
from ipu_jax.lowering import reduction_plan
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


# Four IPUs of 16 tiles: layers can land on another IPU, and IPU-Link bytes count.
_FOUR_IPUS = ipu_jax.IPUTarget.preset("ipu2", num_ipus=4, tiles_per_ipu=16)


def _assert_costs_equal(got, want):
  for a, b in ((got.bytes_in, want.bytes_in), (got.bytes_out, want.bytes_out),
               (got.link_bytes_out, want.link_bytes_out)):
    np.testing.assert_array_equal(a, b)


class PlanCacheTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    # Inputs drawn with NumPy: jax.random would compile a sampler per shape.
    rng = np.random.default_rng(0)
    self.x = jnp.asarray(rng.normal(size=(24, 40)), jnp.float32)
    self.ws = jnp.asarray(rng.normal(size=(3, 40, 40)) * 0.1, jnp.float32)

  def _clear(self):
    for cache in (grouping.GROUPS, reduction_plan._OWNERS, reduction_plan._STAGE2, reduction._FINAL,
                  matmul_operands._GRID_COSTS):
      cache.clear()

  @parameterized.parameters(1, 4)
  def test_repeated_layers_hit_and_keep_costs(self, num_ipus):
    self._clear()
    target = self.target if num_ipus == 1 else _FOUR_IPUS
    fn = ipu_jax.jit(jax.grad(_layers), target=target)
    cold = fn.lower(self.x, self.ws)
    self.assertGreater(grouping.GROUPS.hits, 0)  # layers 2 and 3 reuse layer 1's grouping
    with plan_cache.disabled():
      fresh = ipu_jax.jit(jax.grad(_layers), target=target).lower(self.x, self.ws)
    self.assertEqual(_step_figures(cold), _step_figures(fresh))
    np.testing.assert_array_equal(cold.report.profile.memory.peak,
                                  fresh.report.profile.memory.peak)
    chex.assert_trees_all_close(np.asarray(fn(self.x, self.ws)),
                                np.asarray(jax.jit(jax.grad(_layers))(self.x, self.ws)),
                                rtol=1e-5, atol=1e-5)

  def test_layouts_on_another_ipu_share_relayout_costs(self):
    # A grid -> linear relayout on IPU 0, the same moved to IPUs 3 and 2
    # (wrapping), then moved by 5 tiles (across an IPU boundary): the bytes
    # per tile are looked up each time, the IPU-Link bytes are counted for
    # the layout's own IPUs, and every cost is the one computed afresh.
    target = _FOUR_IPUS
    exchange._RELAYOUTS.clear()
    hits = exchange._RELAYOUTS.hits
    costs = []
    for shift in (0, 48, 32, 5):
      tiles = (shift + np.arange(20)) % 64
      src = matmul_grid.block_grid_mapping((10, 20), (5, 4), (2, 5), tiles)
      dst = TileMapping.linear(200, 64, 4, start_tile=(shift + 12) % 64, min_bytes_per_tile=32)
      got = exchange.relayout_cost(target, src, dst, 4)
      _assert_costs_equal(got, exchange.interval_movement_cost(target, src, dst, 4))
      costs.append(got)
    self.assertEqual(exchange._RELAYOUTS.hits - hits, 3)
    self.assertGreater(costs[0].link_bytes_out.sum(), 0)  # the layout crosses IPUs 0 -> 1
    np.testing.assert_array_equal(costs[1].link_bytes_out, np.roll(costs[0].link_bytes_out, 3))
    np.testing.assert_array_equal(costs[1].bytes_in, np.roll(costs[0].bytes_in, 48))

  def test_link_bytes_on_ipu_runs_match_per_element_counts(self):
    rng = np.random.default_rng(0)
    for _ in range(20):
      n = int(rng.integers(1, 300))
      src = TileMapping.from_element_tiles(rng.integers(0, 64, n))
      dst = TileMapping.linear(n, 64, 4, start_tile=int(rng.integers(0, 64)),
                               min_bytes_per_tile=int(rng.integers(4, 64)))
      want = exchange.movement_cost(_FOUR_IPUS, src.element_tile, dst.element_tile, 2)
      np.testing.assert_array_equal(exchange.interval_link_bytes(_FOUR_IPUS, src, dst, 2),
                                    want.link_bytes_out)

  def test_shift_cost_moves_link_bytes_by_whole_ipus_only(self):
    cost = exchange.ExchangeCost(np.arange(64), np.arange(64) * 2, np.array([1, 2, 3, 4]))
    moved = exchange.shift_cost(cost, 32, 16)
    np.testing.assert_array_equal(moved.link_bytes_out, [3, 4, 1, 2])
    np.testing.assert_array_equal(moved.bytes_in, np.roll(np.arange(64), 32))
    with self.assertRaisesRegex(ValueError, "tiles_per_ipu=16"):
      exchange.shift_cost(cost, 5, 16)
    without_links = exchange.ExchangeCost(cost.bytes_in, cost.bytes_out, np.zeros(4, np.int64))
    np.testing.assert_array_equal(exchange.shift_cost(without_links, 5).bytes_out,
                                  np.roll(cost.bytes_out, 5))
    self.assertEqual(exchange.relative_base(_FOUR_IPUS, 53), 48)
    self.assertEqual(exchange.relative_base(self.target, 13), 13)

  def _operand_exchange(self, start, tiles):
    """A linear [24, 40] lhs from ``start`` into a 2 x 4 x 2 grid on ``tiles``."""
    lhs = P.Tensor("lhs", (24, 40), np.float32,
                   TileMapping.linear(960, 64, 4, start_tile=start, max_tiles=24))
    # Per grid axis (b, m, n, k): the blocks needing each canonical coordinate.
    needs = [(0, np.zeros(1, np.int64), np.ones(1, np.int64)),
             (1, np.arange(24) // 12, np.arange(24) // 12 + 1), None,
             (2, np.arange(40) // 20, np.arange(40) // 20 + 1)]
    return matmul_operands.OperandExchange(lhs, (0, 1), (1, 24, 40), ((), (0,), (1,)),
                                           (1, 2, 4, 2), tiles, needs, 12 * 20,
                                           ((0, 1), (0, 24), (0, 40)))

  def test_matmul_operand_on_another_ipu_hits_ipu_zeros_plan(self):
    # One operand exchange with operand and grid on IPU 0, then both on IPU
    # 3: the second is IPU 0's cost moved three IPUs along, equal to costing
    # it afresh.
    target = _FOUR_IPUS
    matmul_operands._GRID_COSTS.clear()
    results = []
    for ipu in (0, 3):
      exchange = self._operand_exchange(ipu * 16 + 8, ipu * 16 + np.arange(16))
      hits = matmul_operands._GRID_COSTS.hits
      got, local = matmul_operands.operand_cost(target, ("lhs",), exchange)
      want, want_local = exchange.cost(target)
      _assert_costs_equal(got, want)
      np.testing.assert_array_equal(local, want_local)
      results.append((got, matmul_operands._GRID_COSTS.hits - hits))
    self.assertEqual([h for _, h in results], [0, 1])
    self.assertGreater(results[0][0].link_bytes_out.sum(), 0)  # the operand spans IPUs 0 and 1
    np.testing.assert_array_equal(results[1][0].link_bytes_out,
                                  np.roll(results[0][0].link_bytes_out, 3))

  @parameterized.parameters(5, 13, 40, 57)
  def test_matmul_operand_moved_within_ipus_reuses_tile_bytes(self, shift):
    # The same exchange moved by a number of tiles that is not a whole number
    # of IPUs: IPU 0's plan does not apply, but its bytes in and out per tile
    # do (moved along); the IPU-Link bytes, which change with where the IPUs'
    # boundaries fall, are counted afresh. Every figure equals costing anew.
    target = _FOUR_IPUS
    matmul_operands._GRID_COSTS.clear()
    matmul_operands._TILE_COSTS.clear()
    links = []
    for start in (0, shift):
      exchange = self._operand_exchange((start + 8) % 64, (start + np.arange(16)) % 64)
      tile_hits, hits = matmul_operands._TILE_COSTS.hits, matmul_operands._GRID_COSTS.hits
      got, local = matmul_operands.operand_cost(target, ("lhs",), exchange)
      with plan_cache.disabled():
        want, want_local = exchange.cost(target)
      _assert_costs_equal(got, want)
      np.testing.assert_array_equal(local, want_local)
      self.assertEqual(matmul_operands._GRID_COSTS.hits - hits, 0)
      self.assertEqual(matmul_operands._TILE_COSTS.hits - tile_hits, int(start > 0))
      links.append(got.link_bytes_out)
    self.assertGreater(links[1].sum(), 0)

  @parameterized.parameters(("exp", np.float32, None), ("convert_element_type", np.float16,
                                                         np.float32), ("atan2", np.float32, None))
  def test_elementwise_figures_of_moved_layouts_are_shared(self, op, dtype, in_dtype):
    builders._ELEMENTWISE_FIGURES.clear()
    target = _FOUR_IPUS
    hits = builders._ELEMENTWISE_FIGURES.hits
    for start in (0, 21, 50):  # the same small layout placed further along (and wrapping)
      mapping = TileMapping.linear(700, 64, 4, start_tile=start, min_bytes_per_tile=64)
      cycles, vertices = builders.elementwise_figures(target, mapping, op, dtype, in_dtype)
      elements = mapping.elements_per_tile(64)
      np.testing.assert_array_equal(cycles, estimators.elementwise_cycles(
          target, elements, op, np.dtype(dtype).itemsize, dtype=dtype, in_dtype=in_dtype))
      np.testing.assert_array_equal(vertices, np.minimum(elements, target.worker_contexts))
      self.assertFalse(cycles.flags.writeable)
    self.assertEqual(builders._ELEMENTWISE_FIGURES.hits - hits, 2)

  def _reduction_stage2(self, target, start):
    # A 12 x 30 f32 sum over its rows, laid out linearly from ``start``; the
    # rotating output candidate starts 10 tiles further along.
    ctx = LoweringContext(target)
    ctx._next_start_tile = (start + 10) % target.num_tiles
    x = ctx.new_tensor((12, 30), np.float32, TileMapping.linear(
        360, target.num_tiles, 4, start_tile=start, min_bytes_per_tile=64))
    spec = reduction_plan.monoid_spec(jax.lax.reduce_sum_p, {"axes": (1,), "out_sharding": None},
                                      np.float32, "add")
    plan = reduction_plan.plan_reduction(ctx, spec, [x], (1,),
                                         reduction_plan.ReductionInits((), ()),
                                         [((12,), np.dtype(np.float32))], 12)
    return reduction_plan.place_outputs(ctx, plan)

  @parameterized.parameters(1, 4)
  def test_reductions_moved_along_the_tiles_share_stage2_figures(self, num_ipus):
    # The same reduction placed further along (by whole IPUs or not, and
    # wrapping): its stage-2 figures per tile are found once and moved into
    # place, the IPU-Link bytes counted afresh; all equal costing anew.
    target = self.target if num_ipus == 1 else _FOUR_IPUS
    reduction_plan._STAGE2.clear()
    links = 0
    for i, start in enumerate((0, 5, 16, 27, target.num_tiles - 3)):
      misses = reduction_plan._STAGE2.misses
      got = self._reduction_stage2(target, start)
      with plan_cache.disabled():
        want = self._reduction_stage2(target, start)
      self.assertTrue(got.out_map.same_as(want.out_map))
      self.assertEqual(got.rotates, want.rotates)
      self.assertIsNotNone(got.cost)
      _assert_costs_equal(got.cost, want.cost)
      np.testing.assert_array_equal(got.cycles, want.cycles)
      np.testing.assert_array_equal(got.received, want.received)
      if i:  # every candidate placement found in the cache
        self.assertEqual(reduction_plan._STAGE2.misses - misses, 0)
      links += int(got.cost.link_bytes_out.sum())
    self.assertGreater(reduction_plan._STAGE2.hits, 0)
    if num_ipus > 1:
      self.assertGreater(links, 0)  # some placements cross an IPU boundary

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
      src = matmul_grid.block_grid_mapping((6, 20), (3, 4), (2, 5), tiles)
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
    a = matmul_grid.block_grid_mapping((7, 9), (2, 3), (4, 3), np.arange(6))
    b = matmul_grid.block_grid_mapping((7, 9), (2, 3), (4, 3), (9 + np.arange(6)) % 16)
    self.assertIs(a.element_row, b.element_row)  # one shared, read-only layout
    self.assertFalse(a.element_row.flags.writeable)
    np.testing.assert_array_equal(b.element_tile, ((9 + np.arange(6)) % 16)[a.element_row])
    self.assertEqual(a.relative_fingerprint(0, 16), b.relative_fingerprint(9, 16))
    self.assertNotEqual(a.fingerprint, b.fingerprint)


if __name__ == "__main__":
  absltest.main()
