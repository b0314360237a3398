"""Pipeline recomputation one checkpoint segment at a time (recompute_segments)."""

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.lowering.scopes import recomputed
from ipu_jax.ops import pipeline_stage, recomputation_checkpoint
from ipu_jax.pipelining import Pipeline
from ipu_jax.pipelining.recompute_segments import split_segments

_TILES, _G = 16, 4
_ROWS, _WIDTH = 512, 16


def _loss(params, batch):
  """Stage 0: identical layers, each output a checkpoint; stage 1: the loss."""
  h = batch["x"]
  for w in params[:-1]:
    a = h @ w
    b = jnp.tanh(a)
    h = recomputation_checkpoint(h + b * jnp.sin(a) * b)
  h = pipeline_stage(h, 1)
  return jnp.mean((h @ params[-1] - batch["y"]) ** 2)


def _config(recompute):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _TILES
  cfg.auto_select_ipus = 2
  cfg.training.gradient_accumulation_steps = _G
  cfg.pipelining.schedule = "Grouped"
  cfg.pipelining.recomputation = recompute
  return cfg


def _params(layers, seed=0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=(_WIDTH, _WIDTH)) * 0.2, jnp.float32)
          for _ in range(layers + 1)]


def _batches(seed=1):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=(_G, _ROWS, _WIDTH)), jnp.float32) for k in "xy"}


class SegmentedRecomputationTest(chex.TestCase):
  """A stage of 1 or 4 identical layers, recomputed (and 4 layers plain)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.batches = _batches()
    cls.stage0 = {}
    for layers, recompute in ((1, True), (4, True), (4, False)):
      pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(recompute))
      pipe.lower(_params(layers), cls.batches)
      cls.stage0[layers, recompute] = pipe.stages[0]

  def test_backward_peak_does_not_hold_every_layers_residuals(self):
    one, four = self.stage0[1, True], self.stage0[4, True]
    peak = {n: s.backward.profile.memory.peak.max() for n, s in ((1, one), (4, four))}
    # What the 4-layer backward reads in more: three more checkpoints.
    checkpoints = four.stash_bytes.max() - one.stash_bytes.max()
    # One layer's residuals: what a stage stashes per layer without recomputation.
    layer = self.stage0[4, False].stash_bytes.max() / 4
    # Recomputing the whole stage first would keep three more layers'
    # residuals at the peak; segment by segment keeps less than one more.
    self.assertLess(peak[4] - peak[1], checkpoints + layer)
    self.assertLess(peak[4], 1.6 * peak[1])

  def test_segments_are_recomputed_between_their_gradients(self):
    steps = self.stage0[4, True].backward.profile.steps
    flags = [recomputed(s.scope) for s in steps]
    runs = sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))
    # Each layer's recomputation runs right before its own gradient (the
    # last segment's recomputation needs nothing but its checkpoint).
    self.assertEqual(runs, 4)
    self.assertFalse(flags[-1])

  def test_weights_equal_plain_accumulation(self):
    params = _params(4)
    pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(True))
    state = pipe.init(params, self.batches)
    new_params = pipe.step(params, state, self.batches).params
    grad = jax.jit(jax.grad(_loss))
    acc = [jnp.zeros_like(p) for p in params]
    for m in range(_G):
      g = grad(params, jax.tree_util.tree_map(lambda b, m=m: b[m], self.batches))
      acc = [a + d for a, d in zip(acc, g)]
    expected = [p - 0.1 * a for p, a in zip(params, acc)]
    chex.assert_trees_all_close([np.asarray(p) for p in new_params], expected,
                                rtol=1e-5, atol=1e-6)


class SplitSegmentsTest(chex.TestCase):

  def test_cut_after_each_checkpoint(self):
    jaxpr = jax.make_jaxpr(_loss)(_params(3), jax.tree_util.tree_map(lambda b: b[0],
                                                                     _batches())).jaxpr
    segments = split_segments(jaxpr)
    self.assertLen(segments, 4)  # three layers, then the rest
    for seg in segments[:3]:
      self.assertEqual(seg.eqns[-1].primitive.name, "name")
      self.assertLen(seg.outputs, 1)  # the checkpoint: weights are read, not passed on
    self.assertEqual(sum(len(s.eqns) for s in segments), len(jaxpr.eqns))

  def test_no_checkpoint_is_one_segment(self):
    jaxpr = jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(3)).jaxpr
    (segment,) = split_segments(jaxpr)
    self.assertEqual(segment.inputs, list(jaxpr.invars))
    self.assertEqual(segment.outputs, list(jaxpr.outvars))


_SEGMENT_OUTPUT = "segment_output"


def _residual_loss(params, batch):
  """Stage 0: two residual blocks (``x + tanh(x @ w) @ w'``), the first one's
  output a checkpoint, as in an encoder layer; stage 1: the loss. Each block's
  output matmul and residual add are in the scope ``segment_output``."""
  w1, w2, w3, w4, w_out = params
  x = batch["x"]
  a = jnp.tanh(x @ w1)
  with jax.named_scope(_SEGMENT_OUTPUT):
    x = x + a @ w2
  x = recomputation_checkpoint(x)
  b = jnp.tanh(x @ w3)
  with jax.named_scope(_SEGMENT_OUTPUT):
    x = x + b @ w4
  x = pipeline_stage(x, 1)
  return jnp.mean((x @ w_out - batch["y"]) ** 2)


def _cycles(steps) -> float:
  return float(sum(s.total_cycles * s.executions for s in steps))


class WhatIsRecomputedTest(chex.TestCase):
  """Which forward work the backward runs again (docs/multi_ipu.md#what-is-recomputed)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    batches = _batches()
    cls.stage0 = {}
    for recompute in (False, True):
      pipe = Pipeline(_residual_loss, optax.sgd(0.1), config=_config(recompute))
      pipe.lower(_params(4), batches)
      cls.stage0[recompute] = pipe.stages[0]

  def _segment_output_steps(self, profile):
    return [s for s in profile.steps if _SEGMENT_OUTPUT in s.scope.split("/")]

  def test_recompute_cycles_are_the_forward_less_each_segments_output(self):
    # The backward of ``x + h @ w`` reads h and w, never the product or the
    # sum: so each segment's output matmul and residual add are all of the
    # forward that is not run again (JAX's remat keeps only what the
    # gradients read, as TF-IPU's recomputation cluster does).
    plain, recomputing = self.stage0[False], self.stage0[True]
    skipped = _cycles(self._segment_output_steps(plain.forward.profile))
    self.assertGreater(skipped, 0.0)
    forward = _cycles(plain.forward.profile.steps)
    self.assertAlmostEqual(recomputing.recompute_cycles, forward - skipped,
                           delta=1e-9 * forward)
    rerun = [s for s in recomputing.backward.profile.steps if recomputed(s.scope)]
    self.assertNotEmpty(rerun)
    self.assertEmpty([s for s in rerun if _SEGMENT_OUTPUT in s.scope.split("/")])

  def test_recomputed_forward_is_a_share_of_the_recomputing_stages_forward(self):
    # The recomputing stage's own forward computes no derivative
    # coefficients (tanh's 1 - tanh^2); the recomputation does, as the plain
    # forward does: recompute = its forward - segment outputs + coefficients.
    plain, recomputing = self.stage0[False], self.stage0[True]
    coefficients = plain.forward.profile.total_cycles - recomputing.forward.profile.total_cycles
    self.assertGreater(coefficients, 0.0)
    skipped = _cycles(self._segment_output_steps(recomputing.forward.profile))
    self.assertAlmostEqual(
        recomputing.recompute_cycles,
        recomputing.forward.profile.total_cycles - skipped + coefficients,
        delta=1e-9 * plain.forward.profile.total_cycles)
    self.assertLess(recomputing.recompute_cycles, recomputing.forward.profile.total_cycles)


_TAIL = "loss_tail"


def _last_stage_loss(params, batch, marks=True):
  """Stage 0: one layer; stage 1 (the last): four layers, each output a
  checkpoint when ``marks``, then the loss in the scope ``loss_tail``."""
  h = pipeline_stage(jnp.tanh(batch["x"] @ params[0]), 1)
  for w in params[1:-1]:
    a = h @ w
    b = jnp.tanh(a)
    h = h + b * jnp.sin(a) * b
    h = recomputation_checkpoint(h) if marks else h
  with jax.named_scope(_TAIL):
    return jnp.mean((jnp.tanh(h @ params[-1]) - batch["y"]) ** 2)


def _unmarked_loss(params, batch):
  return _last_stage_loss(params, batch, marks=False)


def _last_stage_config(mode):
  cfg = _config(True)
  cfg.pipelining.last_stage_recomputation = mode
  return cfg


class LastStageRecomputationTest(chex.TestCase):
  """pipelining.last_stage_recomputation: TF-IPU's rule ('none') and PopART's
  ('checkpoints': the last stage recomputed between its checkpoints)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.batches = _batches()
    cls.params = _params(5)
    cls.pipes = {}
    for loss in (_last_stage_loss, _unmarked_loss):
      for mode in ("none", "checkpoints"):
        pipe = Pipeline(loss, optax.sgd(0.1), config=_last_stage_config(mode))
        pipe.lower(cls.params, cls.batches)
        cls.pipes[loss.__name__, mode] = pipe

  def test_default_is_tf_ipus_rule(self):
    self.assertEqual(ipu_jax.IPUConfig().pipelining.last_stage_recomputation, "none")

  def test_weights_equal_none_and_plain_accumulation(self):
    pipe = self.pipes["_last_stage_loss", "checkpoints"]
    new = pipe.step(self.params, pipe.init(self.params, self.batches), self.batches).params
    plain = self.pipes["_last_stage_loss", "none"]
    tf_rule = plain.step(self.params, plain.init(self.params, self.batches),
                         self.batches).params
    grad = jax.jit(jax.grad(_last_stage_loss))
    acc = [jnp.zeros_like(p) for p in self.params]
    for m in range(_G):
      g = grad(self.params, jax.tree_util.tree_map(lambda b, m=m: b[m], self.batches))
      acc = [a + d for a, d in zip(acc, g)]
    expected = [p - 0.1 * a for p, a in zip(self.params, acc)]
    chex.assert_trees_all_close([np.asarray(p) for p in new], expected, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close([np.asarray(p) for p in new],
                                [np.asarray(p) for p in tf_rule], rtol=1e-6, atol=1e-7)

  def test_last_stage_recomputed_with_a_lower_backward_peak(self):
    none = self.pipes["_last_stage_loss", "none"].stages[-1]
    checkpoints = self.pipes["_last_stage_loss", "checkpoints"].stages[-1]
    self.assertEqual(none.recompute_cycles, 0.0)
    self.assertGreater(checkpoints.recompute_cycles, 0.0)
    # Four layers' residuals wait under TF-IPU's rule; one segment's at a
    # time (and the four checkpoints) under PopART's.
    self.assertLess(checkpoints.backward.profile.memory.peak.max(),
                    0.75 * none.backward.profile.memory.peak.max())
    self.assertLess(checkpoints.peak_bytes.max(), none.peak_bytes.max())

  def test_segments_recomputed_one_at_a_time_tail_not(self):
    steps = self.pipes["_last_stage_loss", "checkpoints"].stages[-1].backward.profile.steps
    flags = [recomputed(s.scope) for s in steps]
    runs = sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))
    self.assertEqual(runs, 4)  # one per checkpoint segment, before its gradients
    rerun = [s.scope for s in steps if recomputed(s.scope)]
    self.assertEmpty([scope for scope in rerun if _TAIL in scope.split("/")])
    tail = [s for s in steps if _TAIL in s.scope.split("/")]
    self.assertNotEmpty(tail)  # the tail's gradients, from its kept residuals

  def test_last_stage_without_marks_is_unchanged(self):
    none = self.pipes["_unmarked_loss", "none"].stages[-1]
    checkpoints = self.pipes["_unmarked_loss", "checkpoints"].stages[-1]
    self.assertEqual(checkpoints.recompute_cycles, 0.0)
    for program in ("forward", "backward"):
      a, b = getattr(none, program).profile, getattr(checkpoints, program).profile
      self.assertEqual(a.total_cycles, b.total_cycles)
      np.testing.assert_array_equal(a.memory.peak, b.memory.peak)

  def test_popart_rule_fits_where_tf_ipus_does_not(self):
    # 6,144 rows: the last stage's four layers' residuals overfill a tile
    # (about 840 KB of 639 KB) under TF-IPU's rule; one segment's at a time
    # fit (about 422 KB). The error points at the option.
    rng = np.random.default_rng(1)
    batches = {k: jnp.asarray(rng.normal(size=(_G, 6144, _WIDTH)), jnp.float32) for k in "xy"}
    with self.assertRaisesRegex(OutOfMemoryError, r"Out of memory on IPU 1 .*"
                                r"pipelining\.last_stage_recomputation='checkpoints'"):
      Pipeline(_last_stage_loss, optax.sgd(0.1),
               config=_last_stage_config("none")).lower(self.params, batches)
    pipe = Pipeline(_last_stage_loss, optax.sgd(0.1), config=_last_stage_config("checkpoints"))
    pipe.lower(self.params, batches)
    self.assertLess(pipe.stages[-1].peak_bytes.max(), pipe.target.bytes_per_tile)

  @parameterized.parameters("all", "Checkpoints", True, None)
  def test_bad_value_names_the_option_and_its_values(self, value):
    cfg = ipu_jax.IPUConfig()
    # A string not among them: ValueError; another type: TypeError (the config's kinds).
    with self.assertRaisesRegex((ValueError, TypeError), r"pipelining\.last_stage_recomputation must be "
                                r"one of 'none', 'checkpoints'"):
      cfg.pipelining.last_stage_recomputation = value


if __name__ == "__main__":
  absltest.main()
