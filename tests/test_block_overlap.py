"""Interval arithmetic of block overlaps: the same bytes as per-element counting."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

import ipu_jax
from ipu_jax.lowering import block_counts, block_links, block_overlap
from ipu_jax.lowering import program as P
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.matmul_grid import (block_grid_mapping, canonical_tiles, edge_sizes,
                                          grid_exchange_cost)

_TARGET = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _mapping(kind, shape, rng, num_tiles=16):
  n = int(np.prod(shape))
  if kind == "linear":
    return TileMapping.linear(n, num_tiles, 4, start_tile=int(rng.integers(num_tiles)),
                              min_bytes_per_tile=16)
  if kind == "grid":
    grids, room = [], num_tiles
    for d in shape:
      grids.append(int(rng.integers(1, max(1, min(d, 3, room)) + 1)))
      room //= grids[-1]
    blocks = [-(-d // g) for d, g in zip(shape, grids)]
    tiles = (int(rng.integers(num_tiles)) + np.arange(num_tiles)) % num_tiles
    return block_grid_mapping(shape, grids, blocks, tiles[:int(np.prod(grids))])
  return TileMapping.from_element_tiles(rng.integers(0, num_tiles, n))


def _exact(target, tensor, perm, canon, window, grid, tiles, needs, elements):
  """The per-element reference: ``grid_exchange_cost`` on the canonical tiles."""
  src = canonical_tiles(tensor, perm, canon)
  src = src[tuple(slice(a, b) for a, b in window)]
  return grid_exchange_cost(target, src, tensor.itemsize, grid, tiles, needs, elements)


def _assert_same(got, want):
  (cost, local), (want_cost, want_local) = got, want
  np.testing.assert_array_equal(local, want_local)
  np.testing.assert_array_equal(cost.bytes_in, want_cost.bytes_in)
  np.testing.assert_array_equal(cost.bytes_out, want_cost.bytes_out)
  np.testing.assert_array_equal(cost.link_bytes_out, want_cost.link_bytes_out)


class PrefixInBoxTest(chex.TestCase):

  def test_counts_match_enumeration(self):
    rng = np.random.default_rng(0)
    shape = (3, 4, 5)
    flat = np.arange(60)
    digits = np.stack(np.unravel_index(flat, shape), axis=1)
    for _ in range(30):
      lo = rng.integers(0, 4, 3).clip(max=np.array(shape))
      hi = lo + rng.integers(-1, 4, 3)
      x = rng.integers(0, 61, 8)
      inside = np.all((digits >= lo) & (digits < hi), axis=1)
      want = [int(inside[:v].sum()) for v in x]
      np.testing.assert_array_equal(block_counts.prefix_in_box(x, shape, lo, hi), want)
      # Within a product of sets (e.g. the rows a strided window reads).
      sets = [rng.random(d) < 0.6 for d in shape]
      cums = [np.concatenate([[0], np.cumsum(m)]) for m in sets]
      member = np.all([m[digits[:, a]] for a, m in enumerate(sets)], axis=0)
      want = [int((inside & member)[:v].sum()) for v in x]
      np.testing.assert_array_equal(block_counts.prefix_in_box(x, shape, lo, hi, cums), want)


class MergeAxesTest(chex.TestCase):

  def test_merges_neighbours_of_one_group(self):
    shape, groups = block_counts.merge_axes((2, 1, 3, 4, 5), ((), (0, 2), (3,), (1, 4)))
    self.assertEqual(shape, (6, 4, 5))
    self.assertEqual(groups, [[], [0], [1], [2]])
    # Out of the group's order: kept apart, outer first in the group's order.
    shape, groups = block_counts.merge_axes((2, 3, 4), ((2, 0), (1,)))
    self.assertEqual(shape, (2, 3, 4))
    self.assertEqual(groups, [[2, 0], [1]])


class BlockExchangeCostTest(parameterized.TestCase):

  @parameterized.product(
      kind=("linear", "grid", "random"),
      num_ipus=(1, 2, 4, 8),
      # (operand shape, (batch, free, contract) axes, grid, serial window,
      #  whether every block is a box of the operand's axes)
      case=(((6, 10), ((), (0,), (1,)), (1, 3, 2, 2), None, True),
            ((1, 1), ((), (0,), (1,)), (1, 1, 5, 1), None, True),  # a scalar, multicast
            ((10, 6), ((), (1,), (0,)), (1, 2, 3, 2), None, True),
            ((2, 3, 8), ((), (0, 1), (2,)), (1, 2, 2, 2), (1, 5), True),
            ((2, 3, 8), ((), (0, 1), (2,)), (1, 1, 2, 2), (2, 6), True),
            ((3, 2, 4), ((1,), (0,), (2,)), (2, 2, 1, 2), None, True),
            ((2, 3, 4, 5), ((3,), (0, 1), (2,)), (2, 2, 1, 3), (1, 6), True),
            ((2, 4, 3, 5), ((0, 1), (2,), (3,)), (4, 1, 2, 2), None, True),
            ((2, 5, 4, 3), ((0, 2), (1,), (3,)), (2, 2, 2, 1), None, True),
            ((2, 5, 4, 3), ((0, 2), (1,), (3,)), (3, 2, 1, 1), None, False)),
      # IPU-Link bytes counted run by run in every block, or per cell.
      link_count=("runs", "cells"))
  def test_same_bytes_as_per_element(self, kind, num_ipus, case, link_count):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16 // num_ipus, num_ipus=num_ipus)
    shape, (batch, free, contract), grid, serial, boxes = case
    rng = np.random.default_rng(abs(hash((kind, str(case)))) % 2 ** 32)
    tensor = P.Tensor("x", shape, np.float32, _mapping(kind, shape, rng))
    perm = batch + free + contract
    canon = tuple(int(np.prod([shape[a] for a in g], dtype=np.int64))
                  for g in (batch, free, contract))
    window = [(0, d) for d in canon]
    if serial is not None:
      window[1] = serial
    sizes = [b - a for a, b in window]
    gb, gm, gn, gk = grid
    blocks = [-(-s // g) for s, g in zip(sizes, (gb, gm, gk))]
    needs = [(v, np.arange(sizes[v]) // blocks[v], np.arange(sizes[v]) // blocks[v] + 1)
             for v in range(3)]
    needs = needs[:2] + [None] + needs[2:]
    tiles = (int(rng.integers(16)) + np.arange(gb * gm * gn * gk)) % 16
    ib, im, _, ik = np.unravel_index(np.arange(tiles.size), grid)
    elements = (edge_sizes(sizes[0], gb, blocks[0])[ib] * edge_sizes(sizes[1], gm, blocks[1])[im]
                * edge_sizes(sizes[2], gk, blocks[2])[ik])
    budget = 0 if link_count == "cells" else block_links._DIRECT_BUDGET
    with mock.patch.object(block_links, "_DIRECT_BUDGET", budget):
      got = block_overlap.block_exchange_cost(target, tensor.mapping, shape, 4,
                                              (batch, free, contract), window, grid, tiles,
                                              needs, elements)
    want = _exact(target, tensor, perm, canon, window, grid, tiles, needs, elements)
    if not boxes:
      self.assertIsNone(got)  # a block across a merged axis' boundary: not a box
      return
    self.assertIsNotNone(got)
    _assert_same(got, want)

  @parameterized.product(kind=("linear", "grid", "random"), num_ipus=(1, 2),
                         stride=(1, 2, 3))
  def test_halos_same_bytes_as_per_element(self, kind, num_ipus, stride):
    # A convolution's input: [N, C, H, W] read by a grid over (n, h, w) blocks of
    # the output, 3x3 windows (halos) with stride and padding.
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16 // num_ipus, num_ipus=num_ipus)
    rng = np.random.default_rng(stride + 10 * num_ipus + 100 * len(kind))
    shape = (2, 3, 9, 7)
    tensor = P.Tensor("x", shape, np.float32, _mapping(kind, shape, rng))
    grid = (2, 2, 3)
    needs = [(0, np.arange(2), np.arange(2) + 1)]
    elements = np.ones(12, np.int64)
    for axis, (size, g) in enumerate(zip(shape[2:], grid[1:])):
      out = (size + 2 - 3) // stride + 1
      block = -(-out // g)
      start = np.arange(g) * block * stride - 1       # padded window starts
      end = start + (np.minimum(block, out - np.arange(g) * block) - 1) * stride + 3
      p = np.arange(size)
      lo = np.searchsorted(end, p, side="right")
      hi = np.searchsorted(start, p, side="right")
      needs.append((2 + axis, lo, np.maximum(hi, lo)))
    coords = np.unravel_index(np.arange(12), grid)
    for (v, lo, hi), c in zip(needs, coords):
      elements = elements * ((lo[:, None] <= c) & (c < hi[:, None])).sum(axis=0)
    elements = elements * shape[1]
    needs = [needs[0], None] + needs[1:]
    grid = (2, 1) + grid[1:]
    tiles = (int(rng.integers(16)) + np.arange(12)) % 16
    got = block_overlap.block_exchange_cost(
        target, tensor.mapping, shape, 4, ((0,), (1,), (2,), (3,)),
        [(0, d) for d in shape], grid, tiles, needs, elements)
    want = _exact(target, tensor, (0, 1, 2, 3), shape, [(0, d) for d in shape], grid, tiles,
                  needs, elements)
    self.assertIsNotNone(got)
    _assert_same(got, want)

  @parameterized.parameters(0, 1, 3)
  def test_size_one_axis_needed_by_several_blocks(self, width):
    # A 1x1 kernel [1, 1, I, O]: its one tap is read by every spatial block
    # (or, with width 0, by none).
    rng = np.random.default_rng(width)
    shape = (1, 1, 4, 6)
    tensor = P.Tensor("w", shape, np.float32, _mapping("random", shape, rng))
    grid = (2, 3)   # (output-feature blocks, spatial blocks)
    o_lo = np.arange(6) // 3
    needs = [(0, o_lo, o_lo + 1), (2, np.zeros(1, np.int64), np.full(1, width))]
    elements = np.full(6, 3 * 4 * min(width, 1))
    tiles = (5 + np.arange(6)) % 16
    canon = (6, 4, 1)
    got = block_overlap.block_exchange_cost(_TARGET, tensor.mapping, shape, 4,
                                            ((3,), (2,), (0, 1)), [(0, d) for d in canon],
                                            grid, tiles, needs, elements)
    want = _exact(_TARGET, tensor, (3, 2, 0, 1), canon, [(0, d) for d in canon], grid, tiles,
                  needs, elements)
    _assert_same(got, want)

  @parameterized.parameters("linear", "grid", "random")
  def test_every_axis_cut_without_halos_on_two_ipus(self, kind):
    # Pooling boxes with stride = window: every grid axis says which block
    # reads each coordinate (no axis where all blocks need it), no halo.
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8, num_ipus=2)
    rng = np.random.default_rng(len(kind))
    shape = (12, 10)
    tensor = P.Tensor("x", shape, np.float32, _mapping(kind, shape, rng))
    grid = (3, 2)
    needs = [(0, np.arange(12) // 4, np.arange(12) // 4 + 1),
             (1, np.arange(10) // 5, np.arange(10) // 5 + 1)]
    elements = np.full(6, 20, np.int64)
    tiles = (int(rng.integers(16)) + np.arange(6)) % 16
    window = [(0, d) for d in shape]
    got = block_overlap.block_exchange_cost(target, tensor.mapping, shape, 4, ((0,), (1,)),
                                            window, grid, tiles, needs, elements)
    want = _exact(target, tensor, (0, 1), shape, window, grid, tiles, needs, elements)
    self.assertIsNotNone(got)
    _assert_same(got, want)


  def test_block_boxes_shared_across_placements_keyed_by_needs(self):
    # Pooling boxes over a 12 x 10 tensor on two IPUs: the blocks' boxes are
    # found once for the shapes and needs, then reused wherever the tensor
    # and grid lie; other needs (other box sizes) are not confused with them.
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8, num_ipus=2)
    shape, grid, window = (12, 10), (3, 2), [(0, 12), (0, 10)]
    block_overlap._BLOCKS.clear()
    hits, misses = block_overlap._BLOCKS.hits, block_overlap._BLOCKS.misses
    for seed, rows in ((0, 4), (1, 4), (2, 4), (3, 3)):
      rng = np.random.default_rng(seed)
      tensor = P.Tensor("x", shape, np.float32, _mapping("random", shape, rng))
      lo = np.minimum(np.arange(12) // rows, 2)
      needs = [(0, lo, lo + 1), (1, np.arange(10) // 5, np.arange(10) // 5 + 1)]
      elements = np.bincount(lo, minlength=3).repeat(2) * 5
      tiles = (int(rng.integers(16)) + np.arange(6)) % 16
      got = block_overlap.block_exchange_cost(target, tensor.mapping, shape, 4, ((0,), (1,)),
                                              window, grid, tiles, needs, elements)
      self.assertIsNotNone(got)
      _assert_same(got, _exact(target, tensor, (0, 1), shape, window, grid, tiles, needs,
                               elements))
    self.assertEqual(block_overlap._BLOCKS.hits - hits, 2)      # seeds 1 and 2
    self.assertEqual(block_overlap._BLOCKS.misses - misses, 2)  # seeds 0 and 3 (other needs)

if __name__ == "__main__":
  absltest.main()
