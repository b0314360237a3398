"""One training step of an MLP, the Keras CNN and a small transformer.

Forward, ``jax.grad`` and an optax adam update run through ``ipu_jax.jit``
on a 16-tile target and on the full 1,472-tile ipu2, and must match
``jax.jit`` to rtol 1e-5, with a report of per-tile memory and cycles.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from experiments import models


def _target(tiles):
  target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)
  if tiles < 1472:
    # The CNN's dense layer alone is 4.7 MB: give a small target the full
    # chip's total SRAM so the same step fits.
    target = target.replace(bytes_per_tile=638_976 * 1472 // tiles)
  return target


def _above_noise(grads, scale):
  """Mask of gradient elements clearly above rounding noise.

  Adam's first step is about ``lr * sign(g)``: an element whose gradient is
  within rounding noise of zero (e.g. the attention key bias, to which
  softmax is invariant) can flip a whole ``lr`` step. Its gradient is
  compared; its updated value cannot be.
  """
  return jax.tree_util.tree_map(lambda g: jnp.abs(g) > 1e-4 * scale, grads)


_WORKLOADS = {}


def _workload(name):
  """``(step, args, value_and_grad, its jax.jit result, step's jax.jit result)``.

  One per workload: both tile counts train the same step on the same seeded
  arguments (read only), so plain ``jax.jit``'s results are computed once.
  """
  if name not in _WORKLOADS:
    step, args = models.workload(name, batch=4)
    params, _, x, y, rng = args
    value_and_grad = jax.value_and_grad(step.loss_fn)
    _WORKLOADS[name] = (step, args, value_and_grad,
                        jax.jit(value_and_grad)(params, x, y, rng), jax.jit(step)(*args))
  return _WORKLOADS[name]


class TrainingStepTest(chex.TestCase, parameterized.TestCase):

  @parameterized.product(workload=("mlp", "cnn", "transformer"), tiles=(16, 1472))
  def test_training_step_matches_jax(self, workload, tiles):
    step, args, value_and_grad, (want_loss, want_grads), want = _workload(workload)
    params, opt_state, x, y, rng = args
    target = _target(tiles)

    # Loss and gradients.
    (loss, grads) = ipu_jax.jit(value_and_grad, target=target)(params, x, y, rng)
    chex.assert_trees_all_close(loss, want_loss, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(want_grads))
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-5 * scale)

    # The whole step with the adam update.
    emulated = ipu_jax.jit(step, target=target)
    got = emulated(*args)
    mask = _above_noise(want_grads, scale)
    keep = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda v, m: jnp.where(m, v, 0), tree, mask)
    chex.assert_trees_all_close(keep(got[0]), keep(want[0]), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got[2], want[2], rtol=1e-5)

    report = emulated.lower(*args).report
    self.assertGreater(report.total_cycles, 0)
    self.assertEqual(report.memory_per_tile.shape, (target.num_tiles,))
    self.assertGreater(report.tiles_used, min(tiles, 8))
    self.assertTrue(np.all(report.memory_per_tile <= target.bytes_per_tile))
    # Every step is attributed to a JAX operation.
    self.assertTrue(all(s.op for s in report.profile.steps))

  def test_second_call_does_not_lower_again(self):
    step, args = models.workload("mlp", batch=4)
    emulated = ipu_jax.jit(step, target=_target(16))
    emulated(*args)
    emulated(*args)
    self.assertEqual(emulated.cache_size, 1)


if __name__ == "__main__":
  absltest.main()
