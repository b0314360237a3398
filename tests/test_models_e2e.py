"""One training step of an MLP, the Keras CNN and a small transformer.

Forward, ``jax.grad`` and an optax adam update run through ``ipu_jax.jit``
on a 16-tile target and on the full 1,472-tile ipu2, and must match
``jax.jit`` to rtol 1e-5, with a report of per-tile memory and cycles.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import numpy as np

import ipu_jax
from experiments import models


class TrainingStepTest(chex.TestCase, parameterized.TestCase):

  @parameterized.product(workload=("mlp", "cnn", "transformer"), tiles=(16, 1472))
  def test_training_step_matches_jax(self, workload, tiles):
    step, args = models.workload(workload, batch=4)
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)
    if tiles == 16:
      # The CNN's dense layer alone is 4.7 MB: give the small target the
      # full chip's total SRAM so the same step fits.
      target = target.replace(bytes_per_tile=638_976 * 92)
    emulated = ipu_jax.jit(step, target=target)
    got = emulated(*args)
    want = jax.jit(step)(*args)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    report = emulated.lower(*args).report
    self.assertGreater(report.total_cycles, 0)
    self.assertEqual(report.memory_per_tile.shape, (target.num_tiles,))
    self.assertGreater(report.tiles_used, min(tiles, 8))
    self.assertTrue(np.all(report.memory_per_tile <= target.bytes_per_tile))
    # Every step is attributed to a JAX operation.
    self.assertTrue(all(s.op for s in report.profile.steps))

  def test_second_call_does_not_lower_again(self):
    step, args = models.workload("mlp", batch=4)
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    emulated = ipu_jax.jit(step, target=target)
    emulated(*args)
    emulated(*args)
    self.assertEqual(emulated.cache_size, 1)


if __name__ == "__main__":
  absltest.main()
