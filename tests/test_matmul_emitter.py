"""One matmul emitter: ``ipu_jax.ops.matmul`` and ``jnp.dot``/``jnp.matmul`` agree.

Both lower through ``lowering/matmul_emit.py``: with the same options (the
op's own ``available_memory_proportion``/``partials_type``, the others'
from the config) they give the same plan, the same supersteps and the same
costs (cycles, exchange and IPU-Link bytes, memory per tile) and the same
numbers. Shapes cover odd sizes, a tree-reduced long contraction, serial
passes, a batched product, half operands with half partials, and two IPUs.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from testing_utils import executor_config

_ONE = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_TWO = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)


def _report(fn, a, b, target, amp, partials):
  cfg = ipu_jax.IPUConfig()
  if amp is not None:
    cfg.matmuls.available_memory_proportion = amp
  if partials is not None:
    cfg.matmuls.partials_type = partials
  return ipu_jax.jit(fn, target=target, config=cfg).lower(a, b)


def _step_costs(step):
  """What a step costs, without its op's name (``dot_general/`` vs ``matmul/``)."""
  return (step.name.split("/", 1)[1], step.compute_cycles, step.exchange_bytes_in,
          step.exchange_bytes_out, step.exchange_cycles, step.sync_cycles,
          step.ipu_link_bytes, step.flops, step.temporary_bytes)


class OneEmitterTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("tiny", (3, 4), (4, 5), jnp.float32, None, None, _ONE, jnp.dot),
      ("odd_amp", (33, 17), (17, 9), jnp.float32, 0.3, None, _ONE, jnp.dot),
      ("tree_two_ipus", (1, 5000), (5000, 1), jnp.float32, None, None, _TWO, jnp.dot),
      ("serial_passes", (64, 4096), (4096, 8), jnp.float32, 0.05, None, _ONE, jnp.dot),
      ("bf16_half_partials", (12, 2000), (2000, 10), jnp.bfloat16, None, "float16", _TWO,
       jnp.dot),
      ("batched", (3, 7, 5), (3, 5, 6), jnp.float32, None, None, _ONE, jnp.matmul),
      ("batch_rows", (2, 9, 13), (13, 4), jnp.float32, 0.2, None, _TWO, jnp.matmul),
  )
  def test_same_supersteps_and_costs(self, a_shape, b_shape, dtype, amp, partials, target,
                                     reference):
    rng = np.random.RandomState(0)
    a = jnp.asarray(rng.randn(*a_shape), dtype)
    b = jnp.asarray(rng.randn(*b_shape), dtype)
    ref = _report(reference, a, b, target, amp, partials)
    op = _report(lambda a, b: ipu_jax.ops.matmul(a, b, available_memory_proportion=amp,
                                                  partials_type=partials),
                 a, b, target, None, None)
    ref_steps = [s for s in ref.profile.steps if s.op == "dot_general"]
    op_steps = [s for s in op.profile.steps if s.op == "ipu_matmul"]
    self.assertLen(op.profile.steps, len(op_steps))  # nothing but the matmul
    self.assertLen(op_steps, len(ref_steps))
    for got, want in zip(op_steps, ref_steps):
      chex.assert_trees_all_equal(_step_costs(got), _step_costs(want))
    np.testing.assert_array_equal(op.profile.memory.peak, ref.profile.memory.peak)
    self.assertEqual(op.report.total_cycles, ref.report.total_cycles)
    wide = lambda x: np.asarray(x, np.float32)
    chex.assert_trees_all_close(wide(op(a, b)), wide(ref(a, b)), rtol=1e-6, atol=1e-6)



# PopLibs' estimate of one Bow tile's fp16 [96, 64] x [64, 32] block, worked by
# hand from lib/poplin/PerformanceEstimation.hpp
# (getConvPartial1x1SupervisorInnerLoopCycleEstimateHalfFloat and
# ...OuterLoopCycleEstimateHalfFloat; weight loads at 16 bytes a cycle, as
# kernels/amp.py assumes): 4 input groups of 16 channels, 16 rows per worker,
# a worker's pass 37 + 13 * 4 - 7 = 82 cycles zeroing (83 not), x 6 contexts
# + 14 = 506 (512); supervisor 50 + 6 * (7 + 3 * 3) = 146, then 13 + 3 * (15 +
# G * (19 + 6 + L + 512)) + 11 + G * (18 + 7 + L + 506).
# * float32 partials: 8 conv units on IPU2 / Bow (fp16InFp32OutConvUnitsPerTile,
#   conv_partial_1x1_half_float_8_and_half_half_h16.S), G = 4 output groups of
#   8, L = 8 * 32 / 16 = 16: 146 + 13 + 6,681 + 2,199 = 9,039 cycles.
# * half partials: 16 units, G = 2, L = 32: 146 + 13 + 3,459 + 1,137 = 4,755.
_POPLIBS_HALF_BLOCK = {"float32": 9039, "float16": 4755}


class AmpRateByPartialsTest(chex.TestCase, parameterized.TestCase):
  """fp16 products run the AMP at half rate with float32 partials, as PopLibs does."""

  @parameterized.parameters(("float32", jnp.float32), ("float16", jnp.float16))
  def test_block_cycles_match_poplibs_estimate(self, partials, out_dtype):
    target = ipu_jax.IPUTarget.preset("bow", tiles_per_ipu=1)  # one tile: the block is whole
    rng = np.random.RandomState(0)
    a = jnp.asarray(rng.randn(96, 64), jnp.float16)
    b = jnp.asarray(rng.randn(64, 32), jnp.float16)
    fn = lambda a, b: jnp.dot(a, b, preferred_element_type=out_dtype)
    lowered = _report(fn, a, b, target, None, partials)
    steps = [s for s in lowered.profile.steps if s.op == "dot_general"]
    self.assertLen(steps, 1)
    # Cost model 21: kernels/amp.py is PopLibs' estimator case for case (it was
    # within 5 %: a 37-cycle worker entry on every pass, no retention saving).
    self.assertEqual(float(steps[0].compute_cycles.max()), _POPLIBS_HALF_BLOCK[partials])
    chex.assert_trees_all_close(np.asarray(lowered(a, b), np.float32),
                                np.asarray(jnp.dot(a, b, preferred_element_type=out_dtype),
                                           np.float32), rtol=2e-2, atol=2e-1)


class ReduceScatterExchangeTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(2, 3, 4)
  def test_link_bytes_are_each_piece_sent_to_another_ipu(self, num_ipus):
    # Tile j of a group receives group[g, j] partials from every other tile of
    # its group; those on another IPU cross a link.
    from ipu_jax.lowering import matmul_emit
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=num_ipus, tiles_per_ipu=6)
    rng = np.random.default_rng(num_ipus)
    g_out, gk = 3, 4
    tiles = rng.permutation(target.num_tiles)[:g_out * gk]
    group = rng.integers(0, 50, (g_out, gk))
    cost = matmul_emit.scatter_exchange(target, tiles, group, 4)
    ipu = (tiles // 6).reshape(g_out, gk)
    want = np.zeros(num_ipus, np.int64)
    for g in range(g_out):
      for src in range(gk):
        for dst in range(gk):
          if ipu[g, src] != ipu[g, dst]:
            want[ipu[g, src]] += group[g, dst] * 4
    np.testing.assert_array_equal(cost.link_bytes_out, want)
    np.testing.assert_array_equal(cost.bytes_in[tiles], ((gk - 1) * group).reshape(-1) * 4)


class PartialsReduceTest(chex.TestCase, parameterized.TestCase):
  """A split contraction's partials are summed by poplin's ReduceAdd vertex.

  Expected figures are poplin's getReduceCycleEstimate
  (lib/poplin/PerformanceEstimation.hpp) worked by hand for 6 workers and a
  64-bit data path, half partials and outputs.
  """

  @parameterized.named_parameters(
      # 16 outputs (whole vectors of 8), depth 16, 480 B exchanged: the
      # single-input vertex, (20 + (2 * 15 + 9) * 1) * 6 + 33.
      ("single_input", 16, 16, 387),
      # 3,280 outputs, depth 8, 45,920 B exchanged (over 1/16 of the tile):
      # the supervisor vertex, (32 + (3 * 8 + 8) * 69) * 6 (BERT-Large's QKV).
      ("supervisor_large_partials", 3280, 8, 13440),
      # 1,084 outputs (a tail of 4), depth 4: the supervisor vertex with the
      # remainder loop, (32 + 19 + (3 * 4 + 8) * 22) * 6.
      ("supervisor_ragged", 1084, 4, 2946),
  )
  def test_reduce_add_estimate(self, outputs, depth, expected):
    from ipu_jax.kernels import estimators
    got = estimators.partials_reduce_cycles(_ONE, np.array([depth * outputs]), 2,
                                            np.array([outputs]))
    np.testing.assert_array_equal(np.asarray(got), [expected])

  def test_plan_prices_reduce_scatter_with_reduce_add(self):
    from ipu_jax.lowering.matmul_plan import plan_matmul
    # [16, 4096] x [4096, 16] on 16 tiles: the contraction split 16 ways,
    # reduced in poplin's two stages, 16 -> 4 -> 1 (cost model 22; one stage of 16
    # before, 90 + 220 + 387). Stage 1: each tile sums 64 outputs of its
    # group's 4 partials: sync 90, 3 x 64 x 2 B received at 4 B a cycle + 100,
    # ReduceAdd single input (20 + (2 * 3 + 9) * 2) * 6 + 33 = 333. Stage 2:
    # 16 outputs of the 4 group sums, 4 x 16 x 2 B, (20 + (2 * 3 + 9)) * 6 + 33.
    plan = plan_matmul(_ONE, 1, 16, 16, 4096, np.float16, np.float16, 0.6)
    self.assertEqual(plan.grid, (1, 1, 1, 16))
    self.assertEqual(plan.scatter_stages, (4, 1))
    self.assertEqual(plan.reduce_cycles,
                     90 + (384 / 4 + 100) + 333 + 90 + (128 / 4 + 100) + 243)


class ExchangeBusSharingTest(chex.TestCase, parameterized.TestCase):
  """A bus pair's shared A block, priced as poplin's ExchangeEstimator prices input elements.

  lib/poplin/ExchangeEstimator.hpp: where the target shares exchange buses
  (two tiles a bus) and the output-channel split is even, getInputElementCycles
  is ``ceil(elements * size * 16 / (round(4 B * 16) * 2))``: input elements
  at twice the 4 B a cycle, weights (getCycles) at 4 B a cycle. A matmul is
  poplin's 1x1 convolution with A the input (batch M, input channels K) and
  N the output channels (lib/poplin/MatMul.cpp getConvParams).
  """

  def test_pairs_receive_a_shared_a_block_at_twice_the_rate(self):
    # [16, 32] x [32, 128] float16 on 16 tiles: grid b1.m1.n16.k1, every tile
    # needs all of A (512 elements) and a [32, 8] block of B. Tiles 8..15 hold
    # none of A (it lies on tiles 0..7, 64 elements each); B lies 2 rows a
    # tile, so each tile holds 16 of its block's 256 elements. Per poplin, a
    # tile of 8..15: inputs ceil(512 x 2 x 16 / (64 x 2)) = 128 cycles,
    # weights ceil(240 x 2 x 16 / 64) = 120 cycles, + 100 exchange latency
    # = 348. (Tiles 0..7 receive 448 + 448 - 2 x 64 = 768 of A's bytes shared
    # and 128 alone: the same 248 cycles.) Both received at 4 B a cycle, as
    # before cost model 17: (1,024 + 480) / 4 + 100 = 476.
    a = jnp.asarray(np.random.RandomState(0).randn(16, 32), jnp.float16)
    b = jnp.asarray(np.random.RandomState(1).randn(32, 128), jnp.float16)
    lowered = _report(jnp.dot, a, b, _ONE, None, None)
    step, = [s for s in lowered.profile.steps if "/matmul " in s.name]
    self.assertIn("grid b1.m1.n16.k1", step.name)
    np.testing.assert_array_equal(step.exchange_bytes_in, [1376] * 8 + [1504] * 8)
    self.assertEqual(step.exchange_cycles, 348.0)
    # Only placement and cycles move: the values are jax.jit's.
    chex.assert_trees_all_close(np.asarray(lowered(a, b)), np.asarray(jnp.dot(a, b)),
                                rtol=2e-3, atol=2e-2)

  @parameterized.named_parameters(
      # [16, 32] x [32, 128]: 16 N blocks; the A block (512 elements) costs
      # poplin's 128 cycles, the B block (256 elements) ceil(256 x 2 x 16 /
      # 64) = 128, + 100 = 356 (at 4 B a cycle both: 484).
      ("even_n_split", 16, 128, 32, (1, 1, 16, 1), 356.0),
      # [64, 256] x [256, 3]: one N block (an odd split), A at 4 B a cycle:
      # (32 x 32 + 32 x 3) x 2 B / 4 + 100 = 660 (cost model 22: the k16 grid
      # it had, 636, now pays poplin's two reduce stages and loses to m2.k8).
      ("one_n_block", 64, 3, 256, (1, 2, 1, 8), 660.0))
  def test_plan_prices_a_at_the_shared_rate_when_n_split_is_even(self, m, n, k, grid, exchange):
    from ipu_jax.lowering.matmul_plan import plan_matmul
    plan = plan_matmul(_ONE, 1, m, n, k, np.float16, np.float16, 0.6)
    self.assertEqual(plan.grid, grid)
    self.assertEqual(plan.exchange_cycles, exchange)



class StagedReduceTest(chex.TestCase, parameterized.TestCase):
  """16 or more partials a block are reduced in poplin's two stages, a superstep each.

  poplin (lib/poplin/ConvReducePlan.cpp 20-26) reduces a depth of 16 to 4
  sections' sums and then one, a depth of 20 to 5 and then one; each stage's
  ReduceAdd is what poplin's estimateConvReduceCycles prices for it
  (experiments/poplibs_reference.py, transcribed from PerformanceEstimation.hpp).
  """

  @parameterized.named_parameters(
      ("k16_half", 16, 4096, np.float16, "float16"),
      ("k16_float", 16, 4096, np.float32, None),
      ("k20_half", 20, 8192, np.float16, "float16"),
  )
  def test_stages_are_poplins(self, tiles, k, dtype, partials):
    from experiments import poplibs_reference as ref
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)
    rng = np.random.RandomState(0)
    a = jnp.asarray(rng.randn(16, k), dtype)
    b = jnp.asarray(rng.randn(k, 40), dtype)
    lowered = _report(jnp.dot, a, b, target, None, partials)
    steps = [s for s in lowered.profile.steps if s.op == "dot_general"]
    self.assertEqual([s.name.rsplit(" ", 3)[-3:] for s in steps[1:]],
                     [["stage", "1/2", "reduce"], ["stage", "2/2", "reduce"]])
    block, gk, p_size = 16 * 40, tiles, np.dtype(dtype).itemsize
    want = ref.poplin_conv_reduce_stages(block // gk, gk, p_size == 4, p_size == 4,
                                         target.bytes_per_tile)
    self.assertEqual([float(s.compute_cycles.max()) for s in steps[1:]],
                     [float(cycles) for _, _, cycles in want])
    # Stage 1: a tile gets its piece of the group's sum from the group's
    # other tiles; stage 2: its piece of the block from every group's sum.
    (d1, out1, _), (d2, out2, _) = want
    self.assertEqual([int(s.exchange_bytes_in.max()) for s in steps[1:]],
                     [(d1 - 1) * out1 * p_size, d2 * out2 * p_size])
    # The plan prices the steps it emits.
    from ipu_jax.lowering.matmul_plan import plan_matmul
    plan = plan_matmul(target, 1, 16, 40, k, dtype, dtype, 0.6)
    self.assertEqual(plan.reduce_cycles,
                     sum(s.sync_cycles + s.exchange_cycles + float(s.compute_cycles.max())
                         for s in steps[1:]))
    # The stages' costs the planner keeps by block size are the ones it finds afresh.
    from ipu_jax.lowering import plan_cache
    with plan_cache.disabled():
      fresh = plan_matmul(target, 1, 16, 40, k, dtype, dtype, 0.6)
    self.assertEqual((fresh.grid, fresh.reduce_cycles), (plan.grid, plan.reduce_cycles))
    np.asarray(lowered(a, b))

  @parameterized.product(mode=("batched", "per_tile"), half=(False, True))
  def test_matches_jit(self, mode, half):
    from ipu_jax.lowering import half_partials
    from ipu_jax.lowering.matmul_plan import plan_matmul
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=18)
    dtype = jnp.float16 if half else jnp.float32
    rng = np.random.RandomState(1)
    a = jnp.asarray(rng.randn(16, 3000), dtype)   # k18 blocks of 167: the last short
    b = jnp.asarray(rng.randn(3000, 40), dtype)
    cfg = executor_config(mode, matmuls={"partials_type": "float16" if half else None})
    lowered = ipu_jax.jit(jnp.dot, target=target, config=cfg).lower(a, b)
    plan = plan_matmul(target, 1, 16, 40, 3000, dtype, dtype if half else np.float32, 0.6)
    self.assertEqual((plan.grid[3], plan.block[3], plan.scatter_stages), (18, 167, (4, 1)))
    self.assertIn(f"{plan.label} stage 2/2 reduce", [s.name.split("/", 1)[1]
                                                     for s in lowered.profile.steps])
    got = np.asarray(lowered(a, b), np.float32)
    if half:  # fp16 partials: the plan's order (sections of 4, 5, 4, 5, then their 4 sums)
      want = half_partials.numpy_model(np.asarray(a), np.asarray(b), 18, 167, levels=(4, 1))
      np.testing.assert_array_equal(got, np.asarray(want, np.float32))
      chex.assert_trees_all_close(got, np.asarray(jnp.dot(a, b), np.float32), rtol=2e-2,
                                  atol=0.5)
    else:
      chex.assert_trees_all_close(got, np.asarray(jnp.dot(a, b)), rtol=1e-5, atol=1e-3)

if __name__ == "__main__":
  absltest.main()
