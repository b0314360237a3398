"""Tests of the reduction and cumulative lowering rules (rules/reduction.py, cumulative.py)."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import reduce_many
import testing_utils

_T16 = testing_utils.T16
_MODES = testing_utils.MODES
_config = testing_utils.executor_config


def _run(fn, *args, mode="batched", target=_T16):
  return ipu_jax.jit(fn, target=target, config=_config(mode))(*args)


def _assert_matches(test, fn, *args, **kwargs):
  """``fn`` on the emulated IPU equals ``jax.jit(fn)`` in every executor mode."""
  del test
  testing_utils.assert_matches_jit(fn, *args, **kwargs)


def _exchange_bytes(lowered):
  return sum(int(s.exchange_bytes_in.sum()) for s in lowered.profile.steps)


class MonoidReductionTest(parameterized.TestCase):

  @parameterized.parameters((0, 1, 2), (1,), (0, 2), (2,), ())
  def test_f32_sum_max_min_prod(self, *axes):
    x = np.random.default_rng(0).standard_normal((37, 19, 3)).astype(np.float32)

    def fn(x):
      return {"close": (lax.reduce_sum(x, axes), lax.reduce_prod(1.0 + 0.05 * x, axes)),
              "exact": (lax.reduce_max(x, axes), lax.reduce_min(x, axes))}

    _assert_matches(self, fn, x)

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half_sums(self, dtype):
    x = jnp.asarray(np.random.default_rng(1).uniform(0, 1, (64, 33)), dtype)
    _assert_matches(self, lambda x: {"close": (jnp.sum(x, 0), jnp.sum(x, 1), jnp.sum(x)),
                                     "exact": (jnp.max(x, 0), jnp.min(x))},
                    x, rtol=3e-2, atol=5e-2)

  def test_int32(self):
    x = np.random.default_rng(2).integers(-50, 50, (23, 17), dtype=np.int32)
    _assert_matches(self, lambda x: (jnp.sum(x, 0), jnp.sum(x), jnp.max(x, 1), jnp.min(x),
                                     lax.reduce_prod(x % 3 - 1, (1,)),
                                     lax.reduce_xor(x, (0,)), lax.reduce_and(x, (1,)),
                                     lax.reduce_or(x, (0, 1))), x, exact=True)

  @parameterized.parameters((0,), (1,), (0, 1))
  def test_bool(self, *axes):
    x = np.random.default_rng(3).random((33, 7)) > 0.3
    _assert_matches(self, lambda x: (lax.reduce_and(x, axes), lax.reduce_or(x, axes),
                                     lax.reduce_xor(x, axes), jnp.all(x), jnp.any(x)),
                    x, exact=True)

  def test_scalars(self):
    x = np.float32(2.5)
    _assert_matches(self, lambda x: (jnp.sum(x), jnp.max(x), lax.reduce_sum(x, ())), x)
    v = np.arange(1, 6, dtype=np.float32)
    _assert_matches(self, lambda v: (jnp.sum(v), jnp.prod(v), jnp.max(v)), v)

  def test_size_zero(self):
    empty_rows = np.zeros((0, 5), np.float32)
    empty_cols = np.zeros((3, 0), np.float32)
    _assert_matches(self, lambda x: (jnp.sum(x, 0), lax.reduce_max(x, (0,)), jnp.prod(x, 0),
                                     jnp.sum(x), jnp.sum(x, 1)), empty_rows, exact=True)
    _assert_matches(self, lambda x: (jnp.sum(x, 1), lax.reduce_min(x, (1,)), jnp.sum(x, 0)),
                    empty_cols, exact=True)
    _assert_matches(self, jnp.sum, np.zeros((0,), np.float32), exact=True)

  def test_keepdims_and_mean(self):
    x = np.random.default_rng(4).standard_normal((6, 10, 5)).astype(np.float32)
    _assert_matches(self, lambda x: (jnp.sum(x, 1, keepdims=True),
                                     jnp.max(x, (0, 2), keepdims=True), jnp.mean(x, -1)), x)

  def test_grad(self):
    x = np.random.default_rng(5).standard_normal((12, 40)).astype(np.float32)
    fn = jax.grad(lambda x: (jnp.sum(x * x, axis=1) * jnp.prod(1 + 0.01 * x, axis=1)).mean())
    _assert_matches(self, fn, x, modes=("batched",))

  def test_generic_reduce(self):
    x = np.random.default_rng(6).standard_normal((9, 30, 4)).astype(np.float32)
    idx = np.broadcast_to(np.arange(30, dtype=np.int32)[None, :, None], x.shape)

    def pick_max(a, b):  # variadic (value, index), not a known monoid
      take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
      return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    def fn(x, idx):
      total = lax.reduce(x, 0.0, lambda a, b: a + b, (1,))
      best = lax.reduce((x, idx), (-jnp.inf, np.int32(2**31 - 1)), pick_max, (1,))
      return total, best

    _assert_matches(self, fn, x, idx)


class ArgReductionTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_ties_and_nans(self, axis):
    rng = np.random.default_rng(7)
    ints = rng.integers(0, 3, (37, 19, 3)).astype(np.float32)  # many ties
    nans = rng.standard_normal((37, 19, 3)).astype(np.float32)
    nans[rng.random(nans.shape) < 0.05] = np.nan
    fn = lambda a, b: [(lax.argmax(x, axis, jnp.int32), lax.argmin(x, axis, jnp.int32))
                       for x in (a, b)]
    _assert_matches(self, fn, ints, nans, exact=True)

  def test_int_and_flat(self):
    x = np.random.default_rng(8).integers(-3, 3, (50, 11), dtype=np.int32)
    _assert_matches(self, lambda x: (jnp.argmax(x, 0), jnp.argmin(x, 1), jnp.argmax(x)), x,
                    exact=True)


class CumulativeTest(parameterized.TestCase):

  @parameterized.product(axis=(0, 1, 2), reverse=(False, True))
  def test_all_ops_each_axis(self, axis, reverse):
    x = np.random.default_rng(9).standard_normal((37, 19, 3)).astype(np.float32)

    def fn(x):
      return {"close": (lax.cumsum(x, axis, reverse), lax.cumprod(1 + 0.05 * x, axis, reverse),
                        lax.cumlogsumexp(x, axis, reverse)),
              "exact": (lax.cummax(x, axis, reverse), lax.cummin(x, axis, reverse))}

    _assert_matches(self, fn, x, rtol=1e-5, atol=1e-5)

  def test_long_line_split_over_tiles(self):
    x = np.random.default_rng(10).standard_normal((5000,)).astype(np.float32)
    fn = lambda x: (lax.cumsum(x, 0), lax.cumsum(x, 0, reverse=True), lax.cummax(x, 0))
    _assert_matches(self, fn, x, rtol=1e-4, atol=1e-4)
    lowered = ipu_jax.jit(lambda x: lax.cumsum(x, 0), target=_T16).lower(x)
    names = [s.name for s in lowered.profile.steps]
    # Scanned in place: each tile scans its chunk, then folds the totals of
    # the chunks before it; only totals move.
    self.assertEqual(names, ["cumsum/pieces", "cumsum/fold"])
    self.assertEqual(int(lowered.profile.steps[0].exchange_bytes_in.sum()), 0)
    self.assertLess(_exchange_bytes(lowered), 16 * 16 * 4)

  def test_general_input_mapping(self):
    # A transposed input is not linearly mapped: runs of a line on a tile
    # need not be contiguous, so the scan may move whole lines first.
    x = np.random.default_rng(14).standard_normal((40, 24)).astype(np.float32)
    fn = lambda x: {"close": (lax.cumsum(x.T, 1), jnp.sum(x.T, 0), jnp.sum(x.T, 1)),
                    "exact": (jnp.argmax(x.T, 1), lax.cummin(x.T, 0, reverse=True))}
    _assert_matches(self, fn, x)

  def test_int_and_jnp_cumsum(self):
    x = np.random.default_rng(11).integers(-5, 5, (8, 130), dtype=np.int32)
    _assert_matches(self, lambda x: (jnp.cumsum(x, 1), lax.cummax(x, 0, reverse=True)), x,
                    exact=True)

  def test_size_zero(self):
    _assert_matches(self, lambda x: lax.cumsum(x, 1), np.zeros((3, 0), np.float32), exact=True)


class PlanTest(parameterized.TestCase):

  def test_full_ipu2(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    x = np.random.default_rng(12).standard_normal((1024, 300)).astype(np.float32)
    fn = lambda x: (jnp.sum(x, 0), jnp.sum(x, 1), jnp.max(x), jnp.argmax(x, 0))
    _assert_matches(self, fn, x, rtol=1e-5, atol=1e-4, target=target)
    _assert_matches(self, lambda x: lax.cumsum(x, 1), x, rtol=1e-5, atol=1e-4,
                    modes=("per_tile",), target=target)

  def test_scalar_sum_exchanges_only_partials(self):
    x = np.random.default_rng(13).standard_normal((16 * 256,)).astype(np.float32)
    lowered = ipu_jax.jit(jnp.sum, target=_T16).lower(x)
    steps = lowered.profile.steps
    self.assertEqual([s.name for s in steps], ["reduce_sum/partials", "reduce_sum/final"])
    # Stage 1 reduces in place; stage 2 moves one partial from each of the
    # 15 other tiles.
    self.assertEqual(int(steps[0].exchange_bytes_in.sum()), 0)
    self.assertEqual(_exchange_bytes(lowered), 15 * 4)
    self.assertLess(_exchange_bytes(lowered), x.nbytes / 100)
    self.assertEqual(int((steps[0].compute_cycles > 0).sum()), 16)
    self.assertGreater(lowered.report.total_cycles, 0)

  def test_reduce_over_rows_held_whole_needs_no_exchange(self):
    x = np.zeros((256, 64), np.float32)  # 16 rows per tile on 16 tiles
    lowered = ipu_jax.jit(lambda x: jnp.sum(x, 1), target=_T16).lower(x)
    self.assertEqual(_exchange_bytes(lowered), 0)
    self.assertLen(lowered.profile.steps, 1)

  def test_column_sum_spreads_outputs(self):
    x = np.zeros((64, 1024), np.float32)
    lowered = ipu_jax.jit(lambda x: jnp.sum(x, 0), target=_T16).lower(x)
    final = lowered.profile.steps[-1]
    # Every tile holds 4 rows, so stage 1 leaves one partial per column per
    # tile; the 1,024 outputs are spread so no tile receives them all.
    self.assertLess(int(final.exchange_bytes_in.max()), 64 * 1024)


def _size_one_reductions(x, flags):
  # x: [5, 1, 33, 1], reduced over its size-1 axes only.
  return (lax.reduce_sum(x, (1, 3)), lax.reduce_max(x, (1,)), lax.reduce_min(x, (3,)),
          lax.reduce_prod(x, (1, 3)), lax.reduce_or(flags, (1, 3)),
          lax.reduce(x, np.zeros((), x.dtype), lambda a, b: a + b, (1, 3)),
          lax.argmax(x, 1, jnp.int32), lax.argmin(x, 3, jnp.int32))


class SizeOneAxesTest(chex.TestCase, parameterized.TestCase):
  """A reduction over size-1 axes only reduces nothing, as in PopLibs and XLA."""

  @parameterized.parameters(np.float16, np.float32)
  def test_reduction_over_size_one_axes_is_a_view(self, dtype):
    # PopLibs' popops::reduce (lib/popops/reduction/Reduction.cpp,
    # canReduceWithMap / reduceWithMap) runs no Reduce vertex when every
    # reduced dimension has size 1, and XLA turns such a reduce into a reshape
    # (jax.jit's own compile shows a bitcast): a view, 0 cycles, no exchange.
    # An argmax / argmin over a size-1 axis is index 0 (a constant).
    x = np.random.default_rng(20).standard_normal((5, 1, 33, 1)).astype(dtype)
    x[0, 0, :3, 0] = [-0.0, np.nan, np.inf]
    flags = x > 0
    lowered = ipu_jax.jit(_size_one_reductions, target=_T16).lower(x, flags)
    self.assertEqual([s.name for s in lowered.profile.steps], [])
    self.assertEqual(lowered.report.total_cycles, 0)
    # Bit for bit jax.jit's, NaN and the sign of -0.0 included.
    testing_utils.assert_matches_jit(_size_one_reductions, x, flags, exact=True)

  def test_keepdims_mean_gradient_sums_only_its_long_axis(self):
    # The gradient of x - mean(x, -1, keepdims=True) sums the cotangent over
    # the row ([16, 96] -> [16]) and then over the size-1 axis of the
    # keepdims mean ([16, 1] -> [16]): only the first is a reduction.
    x = np.random.default_rng(21).standard_normal((16, 96)).astype(np.float32)
    y = np.random.default_rng(22).standard_normal((16, 96)).astype(np.float32)

    def fn(x, y):
      return jax.grad(lambda x: jnp.sum((x - jnp.mean(x, -1, keepdims=True)) * y))(x)

    lowered = ipu_jax.jit(fn, target=_T16).lower(x, y)
    sums = [s.name for s in lowered.profile.steps if s.op == "reduce_sum"]
    self.assertEqual(sums, ["reduce_sum/partials"])
    testing_utils.assert_matches_jit(fn, x, y)


def _statistics(x):
  """A batch norm's float32 statistics of float16 ``x`` (experiments/resnet_models.py)."""
  return (jnp.sum(x, (0, 1, 2), dtype=jnp.float32),
          jnp.sum(jnp.square(x.astype(jnp.float32)), (0, 1, 2)))


def _gradient_sums(dy, x):
  """The batch norm gradient's two float32 sums of float16 tensors."""
  return (jnp.sum(dy, (0, 1, 2), dtype=jnp.float32),
          jnp.sum((dy * x).astype(jnp.float32), (0, 1, 2)))


def _layer_statistics(*xs):
  """Every layer's batch norm statistics (sibling sums of one layout across layers)."""
  return [_statistics(x) for x in xs]


class ReduceManyTest(chex.TestCase, parameterized.TestCase):
  """float32 sums of float16 values as popnn's batch norm runs them (lowering/reduce_many.py)."""

  # [n, 8, 8, 32] float16: every tile holds whole rows of the 32 channels
  # (64 rows on 1 tile, 16 on each of 16, 2 on each of 1,472).
  @parameterized.parameters((1, 1, 64), (16, 4, 16), (1472, 46, 2))
  def test_statistics_first_stage_is_popops_reduce_many(self, tiles, n, rows):
    target = (ipu_jax.IPUTarget.preset("ipu2") if tiles == 1472
              else ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles))
    x = jax.ShapeDtypeStruct((n, 8, 8, 32), jnp.float16)
    steps = ipu_jax.jit(_statistics, target=target).lower(x).profile.steps
    # One compute set reads the float16 input: no float32 copy, no square step.
    self.assertEqual([s.name for s in steps][:1], ["reduce_sum/partials"])
    self.assertNotIn("convert_element_type", " ".join(s.name for s in steps))
    # poplibs' STRIDED_REDUCE estimate (lib/popops/reduction/CycleEstimationFunctions.cpp,
    # getCyclesEstimateForStridedReduce), half partials into float: per worker
    # (32 outputs over 6 workers: 6 or 5, in 2 loops of 4 = gcd(min(8, 4), 32)):
    # 3 + 2 entry/exit, 6 + 5 loop setup, per loop 3 + cyclesLoopPost (1 + 6:
    # cycleMap[FLOAT][ADD][false]; SQUARE_ADD has no entry, it takes ADD's)
    # + 3 + (rows - 1). ADD and SQUARE_ADD in one compute set (popops::reduceMany,
    # lib/popops/reduction/Reduction.cpp): 6 workers each, one launch of 50.
    worker = 16 + 2 * (3 + 7 + 3 + rows - 1)
    cycles = np.asarray(steps[0].compute_cycles)
    self.assertEqual(set(cycles[cycles > 0].tolist()), {2 * (6 * worker + 50) - 50})
    self.assertEqual(int((cycles > 0).sum()), tiles)

  @parameterized.parameters("batched", "per_tile")
  def test_statistics_and_gradient_sums_match_jit(self, mode):
    x = testing_utils.random_array((4, 8, 8, 32), jnp.float16, seed=3)
    dy = testing_utils.random_array((4, 8, 8, 32), jnp.float16, seed=4)
    for fn, args in ((_statistics, (x,)), (_gradient_sums, (dy, x))):
      got = ipu_jax.jit(fn, target=_T16, config=_config(mode))(*args)
      chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.jit(fn)(*args),
                                  rtol=1e-5, atol=1e-3)

  def test_gradient_sums_share_compute_sets(self):
    x = jax.ShapeDtypeStruct((4, 8, 8, 32), jnp.float16)
    steps = ipu_jax.jit(_gradient_sums, target=_T16).lower(x, x).profile.steps
    names = [s.name for s in steps]
    # dy * x stays a float16 multiply; both casts go into the vertices, and
    # the two sums' stages run as one compute set each.
    self.assertEqual(names, ["mul", "reduce_sum/partials", "reduce_sum/final"])
    self.assertEqual(steps[1].codelets, ("popops::Reduce<add>",))
    # 16 rows of 32 float16 per tile, two ADD vertices (the test above's figures).
    worker = 16 + 2 * (3 + 7 + 3 + 15)
    self.assertEqual(int(np.max(steps[1].compute_cycles)), 2 * (6 * worker + 50) - 50)


  @parameterized.parameters(3, 8)
  def test_many_layers_statistics_merge_per_layer(self, layers):
    """Each layer's two sums share its compute sets, at one layer's figures, values as jit's."""
    x = jax.ShapeDtypeStruct((4, 8, 8, 32), jnp.float16)
    one = ipu_jax.jit(_statistics, target=_T16).lower(x).profile.steps
    steps = ipu_jax.jit(_layer_statistics, target=_T16).lower(*[x] * layers).profile.steps
    # Sibling sums of equal layouts pair up in order: each layer's sum with its
    # sum of squares (the next sibling), never across layers.
    self.assertEqual([s.name for s in steps], [s.name for s in one] * layers)
    for got, want in zip(steps, one * layers):
      self.assertIn("two sums in one compute set (popops::reduceMany)", got.notes)
      np.testing.assert_array_equal(got.compute_cycles, want.compute_cycles)
      np.testing.assert_array_equal(got.exchange_bytes_in, want.exchange_bytes_in)
    xs = [testing_utils.random_array((4, 8, 8, 32), jnp.float16, seed=s) for s in range(layers)]
    got = ipu_jax.jit(_layer_statistics, target=_T16)(*xs)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.jit(_layer_statistics)(*xs),
                                rtol=1e-5, atol=1e-3)

  def test_sibling_search_is_linear_in_the_sums(self):
    """Twice the sums, twice the layout comparisons (siblings found by key, not pairwise)."""

    def slices_statistics(x):  # every slice's two sums in one straight-line run
      return [(jnp.sum(x[i], 0, dtype=jnp.float32),
               jnp.sum(jnp.square(x[i].astype(jnp.float32)), 0)) for i in range(x.shape[0])]

    def comparisons(layers):
      x = jax.ShapeDtypeStruct((layers, 64, 32), jnp.float16)
      compare = reduce_many._same_layouts  # pylint: disable=protected-access
      with mock.patch.object(reduce_many, "_same_layouts", side_effect=compare) as counted:
        steps = ipu_jax.jit(slices_statistics, target=_T16).lower(x).profile.steps
      merged = [s for s in steps if "two sums in one compute set (popops::reduceMany)" in s.notes]
      self.assertLen(merged, 2 * layers)  # each slice's two stages, each one compute set
      return counted.call_count

    few, many = comparisons(8), comparisons(16)
    self.assertGreater(few, 0)
    # Pairwise, every merged step was compared with every later step: 216 -> 816.
    self.assertLessEqual(many, 2 * few + 2)

if __name__ == "__main__":
  absltest.main()
