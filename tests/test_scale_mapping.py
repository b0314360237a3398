"""Region-based mapping arithmetic agrees exactly with the per-element costs."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

from ipu_jax.lowering.exchange import (interval_movement_cost, movement_cost,
                                       relayout_cost)
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.target import IPUTarget


def _random_mapping(rng, n, num_tiles, kind):
  if kind == "linear":
    chunk = int(rng.integers(1, n + 1))
    rows = -(-n // chunk)
    if rows > num_tiles:
      chunk = -(-n // num_tiles)
      rows = -(-n // chunk)
    start = int(rng.integers(0, num_tiles))
    return TileMapping.blocks(n, chunk, num_tiles, start)
  if kind == "runs":  # contiguous runs, some tiles revisited
    tiles = rng.choice(num_tiles, size=min(num_tiles, 5), replace=False)
    run_tile = rng.choice(tiles, size=n // 3 + 1)
    return TileMapping.from_element_tiles(np.repeat(run_tile, 3)[:n])
  return TileMapping.from_element_tiles(rng.integers(0, num_tiles, size=n))


class IntervalCostTest(parameterized.TestCase):

  @parameterized.product(
      kinds=[("linear", "linear"), ("linear", "runs"), ("runs", "scatter"),
             ("scatter", "linear"), ("scatter", "scatter")],
      n=[1, 7, 97, 1000],
      num_ipus=[1, 2])
  def test_matches_per_element_cost(self, kinds, n, num_ipus):
    rng = np.random.default_rng(n * 7 + num_ipus)
    target = IPUTarget.preset("ipu2", num_ipus=num_ipus, tiles_per_ipu=8)
    src = _random_mapping(rng, n, target.num_tiles, kinds[0])
    dst = _random_mapping(rng, n, target.num_tiles, kinds[1])
    for itemsize in (2, 4):
      want = movement_cost(target, src.element_tile, dst.element_tile, itemsize)
      got = interval_movement_cost(target, src, dst, itemsize)
      chex.assert_trees_all_equal(
          (got.bytes_in, got.bytes_out, got.link_bytes_out),
          (want.bytes_in, want.bytes_out, want.link_bytes_out))
      self.assertEqual(got.bytes_in.dtype, np.int64)

  @parameterized.product(n=[1, 7, 97, 1000], num_ipus=[1, 2])
  def test_linear_mappings_with_equal_rows(self, n, num_ipus):
    # Equal chunks on other tiles (a layer's activations and residuals): the
    # rows are the pieces, some staying where one tile holds both.
    rng = np.random.default_rng(n + num_ipus)
    target = IPUTarget.preset("ipu2", num_ipus=num_ipus, tiles_per_ipu=8)
    t = target.num_tiles
    chunk = max(-(-n // t), int(rng.integers(1, n + 1)))
    rows = -(-n // chunk)
    src = TileMapping.blocks(n, chunk, t, int(rng.integers(t)))
    for _ in range(4):
      # Half the rows stay on their tiles, the rest go to other (unique) tiles.
      stay = src.tiles[: rows // 2]
      rest = rng.permutation(np.setdiff1d(np.arange(t), stay))[: rows - stay.size]
      tiles = np.concatenate([stay, rest])
      dst = TileMapping(n, tiles, src.counts, chunk=chunk)
      want = movement_cost(target, src.element_tile, dst.element_tile, 4)
      got = interval_movement_cost(target, src, dst, 4)
      chex.assert_trees_all_equal(
          (got.bytes_in, got.bytes_out, got.link_bytes_out),
          (want.bytes_in, want.bytes_out, want.link_bytes_out))

  def test_intervals_of_linear_mapping_touch_no_elements(self):
    mapping = TileMapping.blocks(10**9, 10**6, 1472)
    starts, tiles = mapping.intervals
    self.assertLen(starts, 1000)
    np.testing.assert_array_equal(tiles, np.arange(1000))
    self.assertNotIn("element_tile", mapping.__dict__)

  def test_same_layout_costs_nothing(self):
    target = IPUTarget.preset("ipu2", tiles_per_ipu=8)
    m = TileMapping.blocks(40, 8, 8)
    self.assertIsNone(relayout_cost(target, m, m, 4))


if __name__ == "__main__":
  absltest.main()
