"""The host data loop of ipu_jax.keras: which samples each replica and update get."""

import warnings

from absl.testing import absltest, parameterized
import chex
import numpy as np

from ipu_jax.keras import loop
from ipu_jax.keras.data import ArrayData
from ipu_jax.keras.replication import Replication


class LayoutTest(parameterized.TestCase):

  @parameterized.parameters((1, 1, 3), (2, 2, 1), (2, 3, 2))
  def test_train_layout_gives_each_update_consecutive_samples(self, replicas, accumulation,
                                                                updates):
    b = 5
    rep = Replication(replicas)
    samples = np.arange(updates * replicas * accumulation * b * 2).reshape(-1, 2)
    out = loop.train_layout(samples, rep, b, updates, accumulation)
    chex.assert_shape(out, (replicas, updates, accumulation, b, 2))
    per_update = replicas * accumulation * b
    for u in range(updates):
      # Update u: samples [u R G b, (u + 1) R G b); replica r a block of G b of them.
      got = out[:, u].reshape(replicas, accumulation * b, 2)
      expected = samples[u * per_update:(u + 1) * per_update].reshape(replicas, -1, 2)
      chex.assert_trees_all_equal(got, expected)

  @parameterized.parameters(1, 2)
  def test_padded_batches_cover_every_sample_once(self, replicas):
    x = np.arange(23, dtype=np.float32)[:, None]
    data = ArrayData(x, x[:, 0], 3)
    rep = Replication(replicas)
    steps = 2 * replicas
    seen, masks = [], []
    for xs, ys, mask in loop.padded_batches(data, steps, rep):
      chex.assert_shape(xs, (replicas, steps // replicas, 3, 1))
      seen.append(loop.gather_predictions(xs, rep)[:, 0])
      masks.append(loop.gather_predictions(mask, rep))
    seen, masks = np.concatenate(seen), np.concatenate(masks)
    self.assertEqual(seen.size % (steps * 3), 0)
    chex.assert_trees_all_equal(seen[masks > 0], x[:, 0])
    chex.assert_trees_all_equal(seen[:23], x[:, 0])  # gather_predictions undoes the layout

  def test_array_source_drops_partial_executions_with_a_warning(self):
    x = np.zeros((50, 2), np.float32)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      source = loop.train_source(x, np.zeros(50), 4, None, steps_per_execution=3, seed=0)
    self.assertEqual(source.executions, 4)  # 12 steps of 4 samples: 48 of 50
    self.assertIn("2 of 50 samples are left out", str(caught[0].message))
    chunks = list(source.batches(0, shuffle=True))
    self.assertLen(chunks, 4)
    again = list(source.batches(0, shuffle=True))
    chex.assert_trees_all_equal(chunks, again)  # seeded by (seed, epoch)

  def test_steps_per_execution_must_be_a_multiple_of_g_times_r(self):
    with self.assertRaisesRegex(ValueError, "multiple of .* = 6.*Use steps_per_execution=6 or 12"):
      loop.check_steps_per_execution(8, 3, 2)


if __name__ == "__main__":
  absltest.main()
