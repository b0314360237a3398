"""IPUTarget presets, overrides and validation."""

import dataclasses

from absl.testing import absltest
from absl.testing import parameterized
import chex

import ipu_jax


class TargetTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(("ipu1", 1216, 262_144), ("ipu2", 1472, 638_976),
                            ("bow", 1472, 638_976))
  def test_presets(self, name, tiles, sram):
    t = ipu_jax.IPUTarget.preset(name)
    self.assertEqual(t.num_tiles, tiles)
    self.assertEqual(t.bytes_per_tile, sram)
    self.assertEqual(t.worker_contexts, 6)
    self.assertEqual(t.exchange_bytes_per_cycle, 4)

  def test_ipu2_peak_flops(self):
    t = ipu_jax.IPUTarget.preset("ipu2")
    self.assertAlmostEqual(t.fp16_flops_per_cycle * t.num_tiles * t.clock_hz / 1e12, 250.6, places=0)
    self.assertAlmostEqual(t.fp32_flops_per_cycle * t.num_tiles * t.clock_hz / 1e12, 62.6, places=0)

  def test_multi_ipu_and_small(self):
    t = ipu_jax.IPUTarget.preset("ipu2", num_ipus=4, tiles_per_ipu=16)
    self.assertEqual(t.num_tiles, 64)
    self.assertEqual(int(t.ipu_of_tile(33)), 2)

  def test_what_if_overrides(self):
    t = ipu_jax.IPUTarget.preset("ipu2")
    big = t.replace(bytes_per_tile=2 * t.bytes_per_tile)
    self.assertEqual(big.bytes_per_tile, 1_277_952)
    self.assertEqual(dataclasses.replace(t, clock_hz=2e9).clock_hz, 2e9)
    self.assertEqual(ipu_jax.IPUTarget.preset("bow", sync_cycles_internal=10).sync_cycles_internal, 10)

  @parameterized.parameters(("ipu2", 2, 90 + 40), ("ipu2", 3, 90 + 40), ("ipu2", 4, 90 + 80),
                            ("ipu2", 8, 90 + 120), ("bow", 2, 90 + 56), ("ipu1", 2, 90 + 48))
  def test_ipu_sync_cycles(self, name, num_ipus, expected):
    # The on-chip sync, then IPUModel's signal: ceil(15 ns x clock x hops x 2)
    # with hops = 1 + (IPUs // 2) // 2 (2 IPUs at 1.33 GHz: ceil(39.9) = 40).
    t = ipu_jax.IPUTarget.preset(name, num_ipus=num_ipus, tiles_per_ipu=16)
    self.assertEqual(t.ipu_sync_cycles(), expected)
    self.assertEqual(t.ipu_sync_cycles(1), 0.0)  # no sync crosses IPUs

  @parameterized.parameters(
      (dict(ipu_sync_seconds_per_hop=0.0), "ipu_sync_seconds_per_hop"),
      (dict(sync_cycles_host=-1), "sync_cycles_host"),
      (dict(tiles_per_ipu=0), "tiles_per_ipu"),
      (dict(bytes_per_tile=-1), "bytes_per_tile"),
      (dict(num_ipus=0), "num_ipus"),
      (dict(clock_hz=0), "clock_hz"),
  )
  def test_invalid_fields_name_themselves(self, change, field):
    with self.assertRaisesRegex(ValueError, field):
      ipu_jax.IPUTarget.preset("ipu2").replace(**change)

  def test_unknown_preset_lists_valid(self):
    with self.assertRaisesRegex(ValueError, "ipu1.*ipu2"):
      ipu_jax.IPUTarget.preset("ipu9")

  def test_too_many_tiles(self):
    with self.assertRaisesRegex(ValueError, "1216"):
      ipu_jax.IPUTarget.preset("ipu1", tiles_per_ipu=1300)

  def test_frozen(self):
    t = ipu_jax.IPUTarget.preset("ipu2")
    with self.assertRaises(dataclasses.FrozenInstanceError):
      t.num_ipus = 2


if __name__ == "__main__":
  absltest.main()
