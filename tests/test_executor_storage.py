"""The executor's storage conversions: exact data movement, and no gathers where a layout is regular."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering.exchange import ordered_runs, take_or_fill, to_flat, to_storage
from ipu_jax.lowering.block_grid import BlockGrid
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.target import IPUTarget


def _padded_rows(size, start, count, stride, tail):
  """An index taking 0..size-1 in runs of ``count`` every ``stride`` slots, else fills."""
  rows = -(-size // count)
  total = start + (rows - 1) * stride + (size - (rows - 1) * count) + tail
  index = np.full(total, size, np.int64)
  element = np.arange(size)
  index[start + (element // count) * stride + element % count] = element
  return index


def _primitives(fn, *args):
  return {e.primitive.name for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns}


class TakeOrFillTest(chex.TestCase, parameterized.TestCase):

  @parameterized.product(size=[1, 5, 37], count=[1, 3, 8], gap=[0, 2], start=[0, 3],
                         tail=[0, 4])
  def test_padded_rows_are_pads(self, size, count, gap, start, tail):
    index = _padded_rows(size, start, count, count + gap, tail)
    flat = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    expected = np.concatenate([flat, [-np.inf]]).astype(np.float32)[index]
    self.assertIsNotNone(ordered_runs(index, size))
    got = jax.jit(lambda x: take_or_fill(x, index, -np.inf))(flat)
    np.testing.assert_array_equal(np.asarray(got), expected)
    self.assertNotIn("gather", _primitives(lambda x: take_or_fill(x, index, -np.inf), flat))

  @parameterized.parameters(
      ([1, 0, 2],),          # out of order
      ([0, 3, 1, 2],),       # a later run longer than the first
      ([0, 0, 1, 2],),       # an element taken twice
      ([0, 3, 1, 3, 3, 2],),  # unequal gaps between runs
  )
  def test_other_patterns_gather(self, index):
    index = np.asarray(index)
    flat = np.arange(1, 4, dtype=np.int32)
    self.assertIsNone(ordered_runs(index, 3))
    got = take_or_fill(jnp.asarray(flat), index, 0)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate([flat, [0]])[index])

  def test_keeps_the_index_shape(self):
    index = _padded_rows(6, 0, 2, 3, 1).reshape(3, 3)
    got = take_or_fill(jnp.arange(6.0), index, 9.0)
    np.testing.assert_array_equal(np.asarray(got), [[0, 1, 9], [2, 3, 9], [4, 5, 9]])


class StorageRoundTripTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(
      dict(shape=(5, 7), grids=(2, 3), blocks=(3, 3), pieces=1),
      dict(shape=(5, 7), grids=(2, 3), blocks=(3, 3), pieces=4),
      dict(shape=(4, 6, 5), grids=(2, 2, 3), blocks=(2, 3, 2), pieces=3),
      dict(shape=(1, 9, 8), grids=(1, 2, 2), blocks=(1, 5, 4), pieces=2, serial=(1, 2)),
  )
  def test_block_grid(self, shape, grids, blocks, pieces, serial=(None, 1)):
    grid = BlockGrid(shape, grids, blocks, pieces, serial=serial)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    storage = grid.to_storage(jnp.asarray(x))
    # Every element lands in its block's row, in the block's row-major order.
    self.assertEqual(int(np.count_nonzero(np.asarray(storage))), x.size)
    np.testing.assert_array_equal(np.asarray(grid.to_logical(storage)), x)

  @parameterized.parameters("linear", "irregular")
  def test_mapping(self, kind):
    n = 50
    if kind == "linear":
      mapping = TileMapping.linear(n, 16, 4)
    else:
      mapping = TileMapping.from_element_tiles(np.random.default_rng(1).integers(0, 16, n))
    x = jnp.arange(1.0, n + 1)
    storage = to_storage(x, mapping)
    self.assertEqual(tuple(storage.shape), mapping.storage_shape)
    np.testing.assert_array_equal(np.asarray(to_flat(storage, mapping)), np.asarray(x))


class EquivalentLayoutsTest(chex.TestCase):

  def test_equal_block_grids_need_no_exchange(self):
    grid = BlockGrid((6, 4), (2, 2), (3, 2))
    tiles = np.arange(4)
    row = np.repeat(np.arange(4), 6)  # only the grid's arithmetic matters here
    a = TileMapping(24, tiles, np.full(4, 6), element_row=row, element_offset=row * 0, grid=grid)
    b = TileMapping(24, tiles, np.full(4, 6), element_row=row, element_offset=row * 0, grid=grid)
    self.assertTrue(a.same_as(b))
    c = TileMapping(24, tiles[::-1].copy(), np.full(4, 6), element_row=row,
                    element_offset=row * 0, grid=grid)
    self.assertFalse(a.same_as(c))


class SplitKProductTest(chex.TestCase):

  def test_split_contraction_matches_jax(self):
    # K = 300 over 16 tiles splits the contraction; the partials are summed
    # by the executor without a reduce over the block axis.
    target = IPUTarget.preset("ipu2", tiles_per_ipu=16)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 300)).astype(np.float32)
    w = rng.standard_normal((300, 10)).astype(np.float32)
    got = ipu_jax.jit(jnp.matmul, target=target, verbose=0)(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(jax.jit(jnp.matmul)(x, w)),
                               rtol=1e-5, atol=1e-4)


if __name__ == "__main__":
  absltest.main()
