"""A pipeline stage's backward memory, counted by hand at 16 tiles.

The accumulators are held once (updated in place: the backward's donated
argument), and each weight gradient dies at its add into the accumulator,
before the next segment's recomputation starts (docs/cost_model.md#the-memory-model).
"""

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.ops import pipeline_stage, recomputation_checkpoint
from ipu_jax.pipelining import Pipeline, accumulate_early
from ipu_jax.lowering.scopes import recomputed
import testing_utils

_ROWS = 16
# Three distinct weight shapes, so a gradient is found by its shape.
_SHAPES = [(24, 40), (40, 56), (56, 24)]


def _loss(params, batch):
  """Stage 0: three layers, each a checkpoint (three segments); stage 1: the loss."""
  h = batch["x"]
  for w in params:
    h = recomputation_checkpoint(jnp.tanh(h @ w))
  h = pipeline_stage(h, 1)
  return jnp.mean((h - batch["y"]) ** 2)


def _data(g, seed=0):
  rng = np.random.default_rng(seed)
  params = [jnp.asarray(rng.normal(size=s) * 0.2, jnp.float32) for s in _SHAPES]
  batches = {"x": jnp.asarray(rng.normal(size=(g, _ROWS, _SHAPES[0][0])), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(g, _ROWS, _SHAPES[-1][1])), jnp.float32)}
  return params, batches


def _config(g):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = testing_utils.T16.tiles_per_ipu
  cfg.auto_select_ipus = 2
  cfg.training.gradient_accumulation_steps = g
  cfg.pipelining.schedule = "Grouped"
  cfg.pipelining.recomputation = True
  cfg.report.progress = False
  return cfg


class StageBackwardMemoryTest(chex.TestCase):

  G = 4

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.batches = _data(cls.G)
    cls.pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(cls.G))
    state = cls.pipe.init(cls.params, cls.batches)
    cls.result = cls.pipe.step(cls.params, state, cls.batches)
    cls.backward = cls.pipe.stages[0].backward

  def test_numbers_equal_plain_accumulation(self):
    acc, _ = testing_utils.accumulated_gradients(_loss, self.params, self.batches, self.G)
    expected = testing_utils.sgd_after(self.params, acc, 0.1)
    chex.assert_trees_all_close(self.result.params, expected, rtol=1e-5, atol=1e-6)

  def test_accumulators_are_held_once(self):
    # Hand count: the backward's variables are its arguments -- residuals
    # (the three checkpoints' inputs), the output's gradient and the three
    # accumulators -- once each; the accumulators' new values take their
    # memory, so the only temporary of a weight's shape live at the last step
    # is the last gradient, read by its add there: no new accumulator.
    profile = self.backward.profile
    lowered_inputs = self.backward.inputs
    by_hand = sum(t.size * t.itemsize for t in lowered_inputs)
    self.assertEqual(int(profile.memory.by_category["variables"].sum()), by_hand)
    accumulators = sum(int(np.prod(s)) * 4 for s in _SHAPES)
    self.assertGreaterEqual(by_hand, accumulators)
    last = len(profile.steps) - 1
    at_end = [t for t in profile.tensors
              if t.category == "temporaries" and t.live_to == last and t.shape in _SHAPES]
    self.assertEqual([(t.op, t.shape) for t in at_end], [("transpose", _SHAPES[0])])

  def test_each_gradient_dies_before_the_next_segment_is_recomputed(self):
    # The backward runs segments 2, 1, 0, each recomputed right before its
    # gradients. A weight gradient (a temporary of its weight's shape, not
    # recomputed) must be added into its accumulator -- and so die -- before
    # the next segment's recomputation starts.
    profile = self.backward.profile
    starts = [i for i, s in enumerate(profile.steps) if recomputed(s.scope)
              and (i == 0 or not recomputed(profile.steps[i - 1].scope))]
    self.assertLen(starts, len(_SHAPES))
    gradients = [t for t in profile.tensors if t.category == "temporaries"
                 and t.shape in _SHAPES and not recomputed(t.scope)]
    self.assertNotEmpty(gradients)
    for t in gradients:
      later = [s for s in starts if s > t.live_from]
      if later:
        self.assertLess(t.live_to, later[0], f"{t.name} {t.shape} outlives its segment")


class DonatedInPlaceTest(parameterized.TestCase):
  """``jit(donate_argnums=)``: a donated argument's memory holds the result."""

  @parameterized.parameters("batched", "per_tile")
  def test_donated_accumulator_is_updated_in_place(self, mode):
    cfg = ipu_jax.IPUConfig()
    cfg.executor.mode = mode
    cfg.report.progress = False
    rng = np.random.default_rng(1)
    acc = jnp.asarray(rng.normal(size=(37, 11)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(37, 11)), jnp.float32)
    before = np.asarray(acc).copy()
    add = lambda a, x: a + x
    donated = ipu_jax.jit(add, target=testing_utils.T16, config=cfg, donate_argnums=0)
    kept = ipu_jax.jit(add, target=testing_utils.T16, config=cfg)
    chex.assert_trees_all_close(donated(acc, g), jax.jit(add)(acc, g))
    np.testing.assert_array_equal(np.asarray(acc), before)  # the caller's array is unchanged
    # Hand count: 37 x 11 float32 = 1,628 bytes of result. Donated, it lives
    # in the accumulator's memory; kept, it is a second copy.
    result_bytes = 37 * 11 * 4
    mem_donated = donated.lower(acc, g).profile.memory.by_category
    mem_kept = kept.lower(acc, g).profile.memory.by_category
    self.assertEqual(int(mem_donated["temporaries"].sum()), 0)
    self.assertEqual(int(mem_kept["temporaries"].sum()), result_bytes)
    self.assertEqual(int(mem_donated["variables"].sum()), 2 * result_bytes)

  def test_a_donated_argument_read_later_is_not_overwritten(self):
    cfg = ipu_jax.IPUConfig()
    cfg.report.progress = False
    a = jnp.arange(12.0).reshape(3, 4)
    f = lambda a: (a + 1.0, a * 2.0)  # ``a`` is read again after the add
    got = ipu_jax.jit(f, target=testing_utils.T16, config=cfg, donate_argnums=0)(a)
    chex.assert_trees_all_close(got, f(a))


class EarlyOrderTest(absltest.TestCase):

  def test_accumulator_reads_move_right_after_their_operands(self):
    def backward(x, acc):
      g0 = jnp.sin(x) * 2.0
      g1 = jnp.cos(x) * 3.0
      return [acc[0] + g1, acc[1] + g0]

    x = jnp.arange(4.0)
    acc = [jnp.ones(4), jnp.ones(4)]
    jaxpr = jax.make_jaxpr(backward)(x, acc).jaxpr
    order = accumulate_early.early_order(jaxpr.eqns, jaxpr.invars, jaxpr.constvars,
                                         jaxpr.invars[1:])
    names = [e.primitive.name for e in order]
    self.assertEqual(names, ["sin", "mul", "add", "cos", "mul", "add"])
    got = accumulate_early.accumulate_early(backward, (x, acc), argnum=1)
    chex.assert_trees_all_close(got, backward(x, acc))


if __name__ == "__main__":
  absltest.main()
