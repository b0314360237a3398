"""Per-element layout arrays of regular mappings: derived exactly, never held on the mapping."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.lowering.block_grid import BlockGrid
from ipu_jax.lowering.mapping import TileMapping


def _grid_mapping(grid: BlockGrid) -> TileMapping:
  """A mapping of ``grid``, and its rows and offsets read off ``to_storage`` (the executor's)."""
  n = int(np.prod(grid.shape))
  # Elements numbered from 1, so 0 marks padding.
  storage = np.asarray(grid.to_storage(np.arange(1, n + 1, dtype=np.int32).reshape(grid.shape)))
  row_size = storage.shape[1]
  flat = storage.reshape(-1)
  held = np.flatnonzero(flat)
  slots = np.empty(n, np.int64)
  slots[flat[held] - 1] = held
  rows, offsets = slots // row_size, slots % row_size
  counts = np.bincount(rows, minlength=storage.shape[0]).astype(np.int64)
  tiles = np.arange(storage.shape[0], dtype=np.int64) * 3 % 1472
  return TileMapping(n, tiles, counts, element_row=rows, element_offset=offsets, grid=grid), rows, offsets


class GridLayoutTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("2d", BlockGrid((7, 10), (2, 3), (4, 4))),
      ("3d_pieces", BlockGrid((3, 5, 6), (1, 2, 2), (3, 3, 3), pieces=2)),
      ("serial_passes", BlockGrid((9, 8), (2, 2), (3, 4), serial=(0, 2))),
      ("pieces_and_passes", BlockGrid((6, 10), (3, 2), (2, 5), pieces=3, serial=(1, 2))),
  )
  def test_closed_form_matches_storage(self, grid):
    mapping, rows, offsets = _grid_mapping(grid)
    with plan_cache.disabled():
      np.testing.assert_array_equal(mapping.element_row, rows)
      np.testing.assert_array_equal(mapping.element_offset, offsets)
      np.testing.assert_array_equal(mapping.storage_position, rows * mapping.row_size + offsets)
      np.testing.assert_array_equal(mapping.element_tile, mapping.tiles[rows])
    # Cached or not, the same arrays.
    np.testing.assert_array_equal(mapping.storage_position, rows * mapping.row_size + offsets)
    np.testing.assert_array_equal(mapping.element_tile, mapping.tiles[rows])

  def test_grid_and_linear_mappings_hold_no_per_element_arrays(self):
    grid_mapping, _, _ = _grid_mapping(BlockGrid((64, 48), (4, 3), (16, 16)))
    linear = TileMapping.linear(64 * 48, 1472, 4)
    for mapping in (grid_mapping, linear):
      for _ in (mapping.element_row, mapping.element_offset, mapping.element_tile,
                mapping.storage_position, mapping.storage_source, mapping.intervals):
        pass
      held = sum(v.nbytes for v in vars(mapping).values() if isinstance(v, np.ndarray))
      self.assertLess(held, 8 * mapping.num_elements // 4)

  def test_irregular_mapping_keeps_its_layout(self):
    element_tile = np.array([5, 2, 5, 9, 2, 9, 9, 5])
    mapping = TileMapping.from_element_tiles(element_tile)
    self.assertIsNone(mapping.grid)
    np.testing.assert_array_equal(mapping.element_tile, element_tile)
    np.testing.assert_array_equal(mapping.element_row, [0, 1, 0, 2, 1, 2, 2, 0])
    np.testing.assert_array_equal(mapping.element_offset, [0, 0, 1, 0, 1, 1, 2, 2])
    self.assertIs(mapping.storage_position, mapping.storage_position)


if __name__ == "__main__":
  absltest.main()
