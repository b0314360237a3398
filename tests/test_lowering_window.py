"""Tests of the windowed-reduction lowering rules (lowering/rules/window.py)."""

import re

from absl.testing import absltest
from absl.testing import parameterized
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import program as P
from ipu_jax.lowering import window_plan
import testing_utils

_T16 = testing_utils.T16
_T4 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4)
_TWO_IPUS = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
_assert_matches = testing_utils.assert_matches_jit
_WINDOW_OPS = ("reduce_window", "select_and_scatter_add", "select_and_gather_add")


def _images(shape=(4, 9, 9, 3), seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _window_steps(lowered):
  return [s for s in lowered.profile.steps if s.op.startswith(_WINDOW_OPS)]


def _tiles_computing(step) -> int:
  return int((step.compute_cycles > 0).sum())


def _pools(window, strides, padding, base_dilation=None, window_dilation=None):
  """Max and min (exact) and sum (close) reduce-windows with these parameters."""
  kwargs = dict(window_dimensions=window, window_strides=strides, padding=padding,
                base_dilation=base_dilation, window_dilation=window_dilation)
  return lambda x: {"exact": (lax.reduce_window(x, -jnp.inf, lax.max, **kwargs),
                              lax.reduce_window(x, jnp.inf, lax.min, **kwargs)),
                    "close": lax.reduce_window(x, 0.0, lax.add, **kwargs)}


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

class HaloSplitTest(parameterized.TestCase):
  """Windows on every axis: the grid cuts the windowed axes, with halos."""

  def test_2000x2000_pooling_on_ipu2(self):
    # Issue 24: 2-D pooling of a [2000, 2000] array was put on one tile (20 MB
    # on tile 0 of a 918 MB chip) and raised OutOfMemoryError.
    target = ipu_jax.IPUTarget.preset("ipu2")
    x = _images((2000, 2000), seed=30)
    fn = lambda x: {
        "exact": lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID"),
        "close": lax.reduce_window(x, 0.0, lax.add, (3, 3), (2, 2), "SAME") / 9}
    _assert_matches(fn, x, target=target)
    lowered = ipu_jax.jit(fn, target=target).lower(x)
    self.assertFalse(lowered.out_of_memory)
    self.assertLess(int(lowered.profile.memory.peak.max()), x.nbytes // 100)
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), target.num_tiles // 2, step.name)

  @parameterized.named_parameters(
      ("odd_sizes_same", (37, 53), (3, 3), (2, 2), "SAME", None, None),
      ("explicit_padding", (29, 61), (3, 2), (1, 1), ((2, 1), (0, 3)), None, None),
      ("window_dilation", (41, 43), (3, 2), (1, 2), "VALID", None, (2, 3)),
      ("base_dilation", (19, 42), (3, 3), (2, 1), ((1, 1), (2, 0)), (2, 1), None),
      ("strides_beyond_window", (103, 97), (2, 3), (5, 4), "VALID", None, None),
      ("window_spans_axis", (9, 1000), (9, 4), (1, 3), "VALID", None, None),
  )
  def test_2d_windows_spread(self, shape, window, strides, padding, base_dilation,
                             window_dilation):
    x = _images(shape, seed=31)
    fn = _pools(window, strides, padding, base_dilation, window_dilation)
    _assert_matches(fn, x)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), 1, step.name)

  @parameterized.named_parameters(
      ("1d_vector", (3001,), (5,), (3,), "SAME"),
      ("1d_nwc", (2, 517, 3), (1, 4, 1), (1, 2, 1), "VALID"),
      ("2d_nhwc", (2, 30, 27, 3), (1, 3, 3, 1), (1, 2, 2, 1), "SAME"),
      ("3d_ndhwc", (1, 12, 14, 10, 2), (1, 2, 3, 2, 1), (1, 2, 2, 1, 1), "SAME"),
  )
  def test_nd_pooling(self, shape, window, strides, padding):
    x = _images(shape, seed=32)
    fn = _pools(window, strides, padding)
    _assert_matches(fn, x)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    # Most tiles (boxes of at least 64 outputs; the box counts the axes allow).
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), 8, step.name)

  def test_dtypes(self):
    x = _images((61, 45), seed=33)
    pools = lambda x: (lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (2, 2), "SAME"),
                       lax.reduce_window(x, 0.0, lax.add, (3, 3), (2, 2), "SAME"))
    for dtype in (jnp.float16, jnp.bfloat16):
      xs = jnp.asarray(x, dtype)
      want_max, want_sum = jax.jit(pools)(xs)
      for mode in testing_utils.MODES:
        got_max, got_sum = ipu_jax.jit(pools, target=_T16,
                                       config=testing_utils.executor_config(mode))(xs)
        np.testing.assert_array_equal(np.asarray(got_max, np.float32),
                                      np.asarray(want_max, np.float32))
        np.testing.assert_allclose(np.asarray(got_sum, np.float32),
                                   np.asarray(want_sum, np.float32), rtol=2e-2, atol=2e-2)
    i = np.random.default_rng(34).integers(-100, 100, (61, 45), dtype=np.int32)
    fn = lambda i: (lax.reduce_window(i, 0, lax.add, (2, 3), (2, 1), "VALID"),
                    lax.reduce_window(i, np.iinfo(np.int32).min, lax.max, (3, 3), (1, 1), "SAME"),
                    lax.reduce_window(i, np.iinfo(np.int32).max, lax.min, (2, 2), (3, 3), "SAME"))
    _assert_matches(fn, i, exact=True)
    lowered = ipu_jax.jit(fn, target=_T16).lower(i)
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), 1, step.name)

  @parameterized.named_parameters(
      ("2x2_stride2", (2, 2), (2, 2), "VALID"),
      ("3x3_stride2_same", (3, 3), (2, 2), "SAME"),
      ("3x3_stride1_same", (3, 3), (1, 1), "SAME"),
      ("2x3_stride3", (2, 3), (3, 3), "SAME"),
  )
  def test_grads_of_one_image(self, window, strides, padding):
    # Batch 1, one channel: only the windowed axes can be cut. The max-pool
    # gradient is select_and_scatter_add; the avg-pool one pad + reduce_window_sum.
    x = _images((1, 45, 38, 1), seed=35)
    max_grad = jax.grad(lambda x: (nn.max_pool(x, window, strides, padding) ** 2).sum())
    avg_grad = jax.grad(lambda x: (nn.avg_pool(x, window, strides, padding) ** 2).sum())
    fn = lambda x: (max_grad(x), avg_grad(x))
    _assert_matches(fn, x)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    ops = {s.op for s in _window_steps(lowered)}
    self.assertEqual(ops, {"reduce_window_max", "reduce_window_sum", "select_and_scatter_add"})
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), 1, step.name)

  def test_max_pool_grad_ties_across_boxes(self):
    # Many ties in overlapping windows: every tile selects the first maximum
    # of each window it computes, as XLA does, so the scatter is exact.
    x = np.random.default_rng(36).integers(0, 3, (1, 40, 44, 1)).astype(np.float32)
    ct = _images((1, 40, 44, 1), seed=37)
    fn = lambda x, c: jax.vjp(lambda x: nn.max_pool(x, (3, 3), (1, 1), "SAME"), x)[1](c)
    _assert_matches(fn, x, ct, exact=True)
    x2 = np.random.default_rng(38).integers(0, 2, (50, 50)).astype(np.float32)
    ct2 = _images((25, 25), seed=39)
    fn2 = lambda x, c: jax.vjp(
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (2, 2), ((1, 1), (1, 1))),
        x)[1](c)
    _assert_matches(fn2, x2, ct2, exact=True)

  def test_min_pool_grad_and_max_pool_jvp(self):
    x, t = _images((37, 41), seed=40), _images((37, 41), seed=41)
    min_pool = lambda x: lax.reduce_window(x, jnp.inf, lax.min, (3, 2), (2, 2), "SAME")
    max_pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 3), (2, 1), "SAME")
    fn = lambda x, t: (jax.grad(lambda x: (min_pool(x) ** 2).sum())(x),
                       jax.jvp(max_pool, (x,), (t,)))
    _assert_matches(fn, x, t)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x, t)
    ops = {s.op for s in _window_steps(lowered)}
    self.assertIn("select_and_gather_add", ops)
    self.assertIn("select_and_scatter_add", ops)
    for step in _window_steps(lowered):
      self.assertGreater(_tiles_computing(step), 1, step.name)

  def test_generic_reduce_window_with_a_traced_init(self):
    x = 1 + 0.05 * _images((33, 47), seed=42)
    idx = np.arange(x.size, dtype=np.int32).reshape(x.shape)

    def pick(a, b):
      take_a = a[0] >= b[0]
      return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    fn = lambda x, i, init: {
        "close": lax.reduce_window(x, init, lax.mul, (2, 3), (1, 2), "SAME"),
        "exact": lax.reduce_window((x, i), (-jnp.inf, np.int32(-1)), pick, (3, 3), (2, 2),
                                   "SAME")}
    _assert_matches(fn, x, idx, np.float32(1.5))
    lowered = ipu_jax.jit(fn, target=_T16).lower(x, idx, np.float32(1.5))
    steps = _window_steps(lowered)
    self.assertLen(steps, 2)
    for step in steps:
      self.assertGreater(_tiles_computing(step), 1, step.name)

  def test_two_ipus(self):
    x = _images((1, 40, 36, 1), seed=43)
    fn = jax.grad(lambda x: (nn.max_pool(x, (3, 3), (2, 2), "SAME") ** 2).sum()
                  + nn.avg_pool(x, (2, 2), (2, 2)).sum())
    _assert_matches(fn, x, target=_TWO_IPUS)

  def test_empty_operand_with_padding(self):
    x = np.zeros((0, 5), np.float32)
    fn = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 1), (1, 1), ((2, 2), (0, 0)))
    _assert_matches(fn, x, exact=True)


def _reads(size, out, k, s, d, b, lo):
  """``[out, size]``: whether window ``o`` reads input ``i`` along one axis (brute force)."""
  reads = np.zeros((out, size), bool)
  for o in range(out):
    for j in range(k):
      p = o * s + j * d - lo
      if p >= 0 and p % b == 0 and p // b < size:
        reads[o, p // b] = True
  return reads


def _superstep(lowered, op):
  (step,) = [n for n in lowered.program.programs if isinstance(n, P.Superstep) and n.op == op]
  return step


def _boxes(step, shape):
  """Per box (row-major), its ranges along each axis, from the step's plan label."""
  grid, block = (tuple(int(v) for v in m.split("x"))
                 for m in re.search(r"grid ([\dx]+) boxes ([\dx]+)", step.name).groups())
  for index in np.ndindex(*grid):
    yield [np.arange(i * b, min((i + 1) * b, d)) for i, b, d in zip(index, block, shape)]


def _bytes_in(tensor, box_tile, needed_axes, itemsize, into):
  """Add what the tile needs of ``tensor`` (a product of per-axis index sets) and lacks."""
  needed = np.zeros(tensor.shape, bool)
  needed[np.ix_(*needed_axes)] = True
  held = tensor.mapping.element_tile.reshape(tensor.shape) == box_tile
  into[box_tile] += int((needed & ~held).sum()) * itemsize


class PlanTest(parameterized.TestCase):

  def test_partitioned_along_batch_without_halos(self):
    x = _images((32, 8, 8, 4), seed=12)
    lowered = ipu_jax.jit(lambda x: nn.max_pool(x, (2, 2), (2, 2)), target=_T16).lower(x)
    step = lowered.profile.steps[-1]
    self.assertEqual(step.op, "reduce_window_max")
    # 32 images over 16 tiles: each tile pools its own 2 images.
    self.assertEqual(int((step.compute_cycles > 0).sum()), 16)
    # Cut along the batch, as the input is laid out: nothing moves.
    self.assertEqual(int(step.exchange_bytes_in.sum()), 0)
    self.assertGreater(lowered.report.total_cycles, 0)

  def test_splits_channels_when_batch_is_one(self):
    x = _images((1, 6, 6, 64), seed=13)
    lowered = ipu_jax.jit(lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME"), target=_T16).lower(x)
    pool = [s for s in lowered.profile.steps if s.op == "reduce_window_sum"][0]
    self.assertEqual(int((pool.compute_cycles > 0).sum()), 16)

  def test_uses_spatial_axes_when_the_batch_is_short(self):
    # Four images on 16 tiles: the row-block plan used 4 tiles; boxes of the
    # spatial axes use them all, and the pool step gets faster.
    x = _images((4, 32, 32, 3), seed=14)
    lowered = ipu_jax.jit(lambda x: nn.max_pool(x, (3, 3), (2, 2), "SAME"), target=_T16).lower(x)
    (step,) = _window_steps(lowered)
    self.assertEqual(_tiles_computing(step), 16)

  def test_full_ipu2(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    x = _images((64, 12, 12, 8), seed=14)
    fn = jax.grad(lambda x: (nn.max_pool(x, (2, 2), (2, 2)) ** 2).sum()
                  + nn.avg_pool(x, (3, 3), (1, 1), "SAME").sum())
    _assert_matches(fn, x, target=target)

  def test_halo_exchange_hand_count(self):
    # 512 fp32 on 4 tiles (128 each), max over 3 with SAME padding: four boxes
    # of 128 outputs, each reading one element past each inner edge of its
    # own block. Tiles 0 and 3 receive one element (4 bytes), tiles 1 and 2
    # two; each sends its inner-edge elements once.
    x = _images((512,), seed=44)
    fn = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (1,), "SAME")
    lowered = ipu_jax.jit(fn, target=_T4).lower(x)
    (step,) = _window_steps(lowered)
    self.assertIn("grid 4 boxes 128", step.name)
    np.testing.assert_array_equal(step.exchange_bytes_in, [4, 8, 8, 4])
    np.testing.assert_array_equal(step.exchange_bytes_out, [4, 8, 8, 4])

  @parameterized.named_parameters(
      ("same_3x3", (45, 38), (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1)),
      ("stride_beyond_window", (70, 61), (2, 3), (5, 4), ((0, 0), (0, 0)), (1, 1), (1, 1)),
      ("dilations", (40, 41), (3, 2), (2, 1), ((1, 2), (0, 1)), (2, 1), (1, 3)),
  )
  def test_pool_exchange_is_the_halo_overlap(self, shape, window, strides, padding,
                                             base_dilation, window_dilation):
    x = _images(shape, seed=45)
    fn = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding,
                                     base_dilation, window_dilation)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    step = _superstep(lowered, "reduce_window_max")
    (operand,), (out,) = step.reads, step.writes
    reads = [_reads(shape[a], out.shape[a], window[a], strides[a], window_dilation[a],
                    base_dilation[a], padding[a][0]) for a in range(2)]
    want = np.zeros(_T16.num_tiles, np.int64)
    out_tiles = out.mapping.element_tile.reshape(out.shape)
    boxes = list(_boxes(step, out.shape))
    self.assertGreater(len(boxes), 1)
    for box in boxes:
      needed = [np.flatnonzero(r[rows].any(axis=0)) for r, rows in zip(reads, box)]
      _bytes_in(operand, out_tiles[tuple(rows[0] for rows in box)], needed, 4, want)
    np.testing.assert_array_equal(step.exchange.bytes_in, want)

  @parameterized.named_parameters(
      ("3x3_stride2_same", (3, 3), (2, 2), ((0, 1), (1, 1))),
      ("3x3_stride1", (3, 3), (1, 1), ((1, 1), (1, 1))),
      ("2x2_stride3", (2, 2), (3, 3), ((0, 0), (1, 0))),
  )
  def test_scatter_exchange_is_the_halo_overlap(self, window, strides, padding):
    # A box of select_and_scatter_add's result needs the windows touching it
    # and every operand element those windows read.
    shape = (44, 39)
    x = _images(shape, seed=46)
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)
    out_shape = jax.eval_shape(pool, x).shape
    ct = _images(out_shape, seed=47)
    lowered = ipu_jax.jit(lambda x, c: jax.vjp(pool, x)[1](c), target=_T16).lower(x, ct)
    step = _superstep(lowered, "select_and_scatter_add")
    (source, operand), (out,) = step.reads, step.writes
    reads = [_reads(shape[a], out_shape[a], window[a], strides[a], 1, 1, padding[a][0])
             for a in range(2)]
    want = np.zeros(_T16.num_tiles, np.int64)
    out_tiles = out.mapping.element_tile.reshape(out.shape)
    boxes = list(_boxes(step, shape))
    self.assertGreater(len(boxes), 1)
    for box in boxes:
      touching = [np.flatnonzero(r[:, rows].any(axis=1)) for r, rows in zip(reads, box)]
      tile = out_tiles[tuple(rows[0] for rows in box)]
      _bytes_in(source, tile, touching, 4, want)
      read = [np.flatnonzero(r[windows].any(axis=0)) for r, windows in zip(reads, touching)]
      _bytes_in(operand, tile, read, 4, want)
    np.testing.assert_array_equal(step.exchange.bytes_in, want)


class WindowGeometryTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_readers_are_the_first_and_last_window(self, seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
      size, k, s, d, b = (int(v) for v in rng.integers(1, [30, 6, 6, 4, 3]))
      lo, hi = (int(v) for v in rng.integers(0, 4, 2))
      span = lo + (size - 1) * b + 1 + hi
      out = (span - ((k - 1) * d + 1)) // s + 1
      if out <= 0:
        continue
      geo = window_plan.window_geometry((size,), (out,), (k,), (s,), ((lo, hi),), (b,), (d,))
      first, last = geo.readers(0)
      reads = _reads(size, out, k, s, d, b, lo)
      some = reads.any(axis=0)
      np.testing.assert_array_equal(first <= last, some)
      np.testing.assert_array_equal(first[some], np.argmax(reads, axis=0)[some])
      np.testing.assert_array_equal(last[some], out - 1 - np.argmax(reads[::-1], axis=0)[some])

  @parameterized.parameters(0, 1)
  def test_scatter_cuts_hold_every_touching_window(self, seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
      size, k, s = (int(v) for v in rng.integers(1, [40, 6, 6]))
      lo, hi = (int(v) for v in rng.integers(0, k, 2))
      out = max(0, (lo + size + hi - k) // s + 1)
      if not out:
        continue
      grid = int(rng.integers(1, size + 1))
      block = -(-size // grid)
      grid = -(-size // block)
      geo = window_plan.window_geometry((size,), (out,), (k,), (s,), ((lo, hi),))
      plan = window_plan.WindowPlan((grid,), (block,), 0, 0, 0, 0, 0, True)
      first, count, op_starts, span, offset = window_plan.scatter_cuts(geo, plan, 0)
      reads = _reads(size, out, k, s, 1, 1, lo)
      for i in range(grid):
        rows = np.arange(i * block, min((i + 1) * block, size))
        touching = np.flatnonzero(reads[:, rows].any(axis=1))
        if touching.size:
          self.assertLessEqual(first[i], touching[0])
          self.assertLess(touching[-1], first[i] + count)
        self.assertEqual(op_starts[i], first[i] * s - lo)
        self.assertGreaterEqual(offset[i], 0)
        self.assertLessEqual(offset[i] + block, span)


if __name__ == "__main__":
  absltest.main()
