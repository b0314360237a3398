"""Layouts and groupings planned on runs and spans agree with their per-element forms.

Block grids place their elements by runs (:meth:`BlockGrid.runs`), mappings
expose runs (:attr:`TileMapping.runs`) and groupings hold spans of groups;
each must say exactly what the per-element arrays say.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

from ipu_jax.lowering.mapping import TileMapping, spread_runs
from ipu_jax.lowering.block_grid import BlockGrid
from ipu_jax.lowering.matmul_grid import block_grid_mapping
from ipu_jax.lowering.grouping import group_regions
from ipu_jax.lowering.unicast import unicast_cost
from ipu_jax.target import IPUTarget


def _random_grid(rng, shape=None):
  """A random block grid: rank 1-3, edge blocks, pieces, maybe serial passes."""
  if shape is None:
    shape = tuple(int(d) for d in rng.integers(1, 9, int(rng.integers(1, 4))))
  ndim = len(shape)
  serial = (None, 1)
  if rng.random() < 0.4:
    serial = (int(rng.integers(0, ndim)), int(rng.integers(2, 4)))
  pass_shape = list(shape)
  if serial[0] is not None:
    pass_shape[serial[0]] = -(-shape[serial[0]] // serial[1])
  blocks = tuple(int(rng.integers(1, d + 1)) for d in pass_shape)
  grids = tuple(-(-d // b) for d, b in zip(pass_shape, blocks))
  return BlockGrid(shape, grids, blocks, int(rng.integers(1, 5)), serial)


def _random_mapping(rng, shape):
  n = int(np.prod(shape))
  kind = rng.integers(0, 3)
  if kind == 0:
    return TileMapping.blocks(n, int(rng.integers(1, n + 1)), 10**6)
  if kind == 1:
    return TileMapping.from_element_tiles(rng.integers(0, 5, n))
  grid = _random_grid(rng, shape)
  return block_grid_mapping(grid.shape, grid.grids, grid.blocks, rng.permutation(4096),
                            grid.pieces, grid.serial)


def _expand(runs, n):
  start, length, row, offset = runs
  within = np.arange(n) - np.repeat(start, length)
  return np.repeat(row, length), np.repeat(offset, length) + within


class RunsTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_grid_runs_are_its_element_layout(self, seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
      grid = _random_grid(rng)
      n = int(np.prod(grid.shape))
      start, length, row, offset = grid.runs()
      self.assertEqual(int(length.sum()), n)
      np.testing.assert_array_equal(start, np.cumsum(length) - length)
      got_row, got_offset = _expand((start, length, row, offset), n)
      want_row, want_offset = grid.element_layout()
      np.testing.assert_array_equal(got_row, want_row, err_msg=str(grid))
      np.testing.assert_array_equal(got_offset, want_offset, err_msg=str(grid))
      # Maximal: no run continues the one before it.
      continues = (row[1:] == row[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
      self.assertFalse(continues.any(), str(grid))

  def test_vocabulary_grid_has_few_runs(self):
    grid = BlockGrid((1, 256, 30522), (1, 4, 291), (1, 64, 105), pieces=10)
    start, _, _, _ = grid.runs()
    self.assertLess(start.size, 256 * 30522 // 50)

  @parameterized.parameters(3, 4)
  def test_mapping_runs_and_element_arrays(self, seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
      shape = tuple(int(d) for d in rng.integers(1, 9, int(rng.integers(1, 4))))
      mapping = _random_mapping(rng, shape)
      n = mapping.num_elements
      row, offset = _expand(mapping.runs, n)
      np.testing.assert_array_equal(row, mapping.element_row)
      np.testing.assert_array_equal(offset, mapping.element_offset)
      np.testing.assert_array_equal(mapping.storage_position, row * mapping.row_size + offset)
      np.testing.assert_array_equal(mapping.element_tile, mapping.tiles[row])
      some = rng.integers(0, n, 5)
      np.testing.assert_array_equal(mapping.positions_of(some), mapping.storage_position[some])
      if mapping.grid is not None:
        want_row, want_offset = mapping.grid.element_layout()
        np.testing.assert_array_equal(row, want_row)
        np.testing.assert_array_equal(offset, want_offset)

  def test_spread_runs_is_repeat(self):
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 6, 50)
    values = rng.integers(-100, 100, 50)
    starts = np.cumsum(lengths) - lengths
    chex.assert_trees_all_equal(spread_runs(values, starts, int(lengths.sum())),
                                np.repeat(values, lengths))


def _brute_groups(mapping, shape, axes):
  """(row, key) of every group in (row, key) order, and members per group."""
  kept = [a for a in range(len(shape)) if a not in axes]
  coords = np.unravel_index(np.arange(mapping.num_elements), shape)
  key = np.zeros(mapping.num_elements, np.int64)
  for a in kept:
    key = key * shape[a] + coords[a]
  num_keys = int(np.prod([shape[a] for a in kept], dtype=np.int64))
  composite, count = np.unique(mapping.element_row * num_keys + key, return_counts=True)
  return composite // num_keys, composite % num_keys, count


class SpansTest(parameterized.TestCase):

  @parameterized.parameters(6, 7)
  def test_groups_match_the_elements(self, seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
      ndim = int(rng.integers(1, 4))
      shape = tuple(int(d) for d in rng.integers(1, 7, ndim))
      mapping = _random_mapping(rng, shape)
      axes = tuple(a for a in range(ndim) if rng.random() < 0.5)
      groups = group_regions(mapping, shape, axes)
      row, key, count = _brute_groups(mapping, shape, axes)
      np.testing.assert_array_equal(groups.row, row)
      np.testing.assert_array_equal(groups.key, key)
      np.testing.assert_array_equal(groups.count, count)
      first = np.full(groups.first_of_key.size, row.size)
      np.minimum.at(first, key, np.arange(row.size))
      np.testing.assert_array_equal(groups.first_of_key, first)
      index = rng.integers(0, groups.num, 5)
      at_row, at_key, at_local = groups.at(index)
      np.testing.assert_array_equal(at_row, row[index])
      np.testing.assert_array_equal(at_key, key[index])
      np.testing.assert_array_equal(at_local, groups.local[index])
      if groups.first_slot is not None:
        np.testing.assert_array_equal(groups.first_slot_of(index), groups.first_slot[index])
      run_row, run_key, run_length = groups.key_runs()
      np.testing.assert_array_equal(np.repeat(run_row, run_length), row)
      np.testing.assert_array_equal(
          np.repeat(run_key, run_length) + np.arange(row.size)
          - np.repeat(np.cumsum(run_length) - run_length, run_length), key)

  def test_vocabulary_reduction_needs_no_per_group_arrays(self):
    # BERT's output-bias gradient: [batch, seq, vocab] summed to [vocab] on a
    # linear layout: every element is its own group (7.8 M), in 23 k spans.
    shape = (2, 128, 30522)
    mapping = TileMapping.blocks(int(np.prod(shape)), 664, 11776)
    groups = group_regions(mapping, shape, (0, 1))
    self.assertEqual(groups.num, mapping.num_elements)
    self.assertLess(groups.span_first.size, 30_000)
    run_row, run_key, run_length = groups.key_runs()
    self.assertEqual(int(run_length.sum()), groups.num)
    # The output's first partials: keys 0.. on the row holding element k.
    first = groups.first_slot_of(groups.first_of_key)
    np.testing.assert_array_equal(first, np.arange(30522))
    for lazy in ("row", "key", "local", "count", "first_slot"):
      self.assertNotIn(lazy, vars(groups))


class UnicastCostTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 4)
  def test_counted_on_runs_equals_element_by_element(self, num_ipus):
    target = IPUTarget.preset("ipu2", num_ipus=num_ipus, tiles_per_ipu=8)
    rng = np.random.default_rng(num_ipus)
    moved_some = False
    for _ in range(150):
      n = int(rng.integers(1, 50))
      tiles = rng.integers(0, target.num_tiles, n)
      dst = (TileMapping.from_element_tiles(np.repeat(tiles, 3)[:n]) if rng.random() < 0.5
             else TileMapping.blocks(n, int(rng.integers(-(-n // target.num_tiles), n + 1)),
                                     target.num_tiles, int(rng.integers(0, 16))))
      runs = int(rng.integers(1, 10))
      first = rng.integers(0, n, runs)
      length = np.array([int(rng.integers(1, n - f + 1)) for f in first])
      src = np.where(rng.random(runs) < 0.3, dst.element_tile[first],
                     rng.integers(0, target.num_tiles, runs))
      cost, received = unicast_cost(target, src, first, length, dst, 4)
      # Element by element: every element of every run goes to its tile.
      element = np.concatenate([np.arange(f, f + k) for f, k in zip(first, length)])
      from_tile = np.repeat(src, length)
      to_tile = dst.element_tile[element]
      t = target.num_tiles
      np.testing.assert_array_equal(received, np.bincount(to_tile, minlength=t))
      moves = from_tile != to_tile
      if not moves.any():
        self.assertIsNone(cost)
        continue
      moved_some = True
      np.testing.assert_array_equal(cost.bytes_in, 4 * np.bincount(to_tile[moves], minlength=t))
      np.testing.assert_array_equal(cost.bytes_out,
                                    4 * np.bincount(from_tile[moves], minlength=t))
      ipu_from, ipu_to = from_tile // 8, to_tile // 8
      crossing = ipu_from != ipu_to
      np.testing.assert_array_equal(
          cost.link_bytes_out, 4 * np.bincount(ipu_from[crossing], minlength=num_ipus))
    self.assertTrue(moved_some)


if __name__ == "__main__":
  absltest.main()
