"""A data movement's exchange lands in the tensor it writes: counted once (16 tiles).

docs/cost_model.md#the-memory-model: a Poplar ``Copy``'s exchange writes the
destination variable, so a transpose's received bytes are its result's, not
an exchange buffer beside it; a compute step's received operands still are.
"""

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
import testing_utils


def _lowered(fn, *args):
  cfg = ipu_jax.IPUConfig()
  cfg.report.progress = False
  f = ipu_jax.jit(fn, target=testing_utils.T16, config=cfg)
  chex.assert_trees_all_close(f(*args), jax.jit(fn)(*args))
  return f.lower(*args).profile


class MovementMemoryTest(parameterized.TestCase):

  @parameterized.parameters(jnp.float32, jnp.float16)
  def test_transpose_peak_is_operand_plus_result(self, dtype):
    # [8, 4, 16, 8] -> [8, 16, 4, 8]: rows of 8 move between tiles.
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4, 16, 8)), dtype)
    profile = _lowered(lambda a: a.transpose(0, 2, 1, 3), x)
    (step,) = profile.steps
    self.assertGreater(int(step.exchange_bytes_in.sum()), 0)  # it does move data
    memory = profile.memory
    # Hand count per tile: the operand (a variable) + the result (a
    # temporary) + vertex state + code; the received rows are the result's.
    held = {t.category: t.bytes_on_tile for t in profile.tensors}
    self.assertEqual(memory.by_category["exchange_buffers"].tolist(), [0] * 16)
    np.testing.assert_array_equal(memory.by_category["temporaries"], held["temporaries"])
    np.testing.assert_array_equal(
        memory.peak, held["variables"] + held["temporaries"]
        + memory.by_category["vertex_state"] + memory.by_category["code"])

  def test_a_compute_step_still_holds_its_received_operand(self):
    # a + b @ c: the product lies in the matmul's blocks, so the add receives
    # its elements in a's layout into a buffer of its own, beside the result.
    rng = np.random.default_rng(1)
    a, b, c = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((48, 40), (48, 24), (24, 40)))
    profile = _lowered(lambda a, b, c: a + b @ c, a, b, c)
    (add,) = [s for s in profile.steps if s.op == "add"]
    received = add.exchange_bytes_in.astype(np.int64)
    self.assertGreater(int(received.sum()), 0)
    result = [t for t in profile.tensors if t.op == "add"][0]
    step = profile.steps.index(add)
    # At the add, each tile holds its result and its received operand.
    on_tile = np.zeros(16, np.int64)
    for t in profile.tensors:
      if t.category == "temporaries" and t.live_from <= step <= t.live_to:
        on_tile[t.tiles] += t.bytes_on_tile
    self.assertGreater(int(result.bytes_on_tile.sum()), 0)
    # Hand count of the bytes live at the add (all tiles): always-live, the
    # temporaries live there (the product, the result) and the received operand.
    always = int(profile.memory.always_live.sum())
    self.assertEqual(int(profile.memory.live_over_program[step]),
                     always + int(on_tile.sum()) + int(received.sum()))

if __name__ == "__main__":
  absltest.main()
