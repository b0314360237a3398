"""Optimizers on replica shards: LAMB, Adam and global-norm clipping with replicated
tensor sharding (and offloaded state), in the Keras-like fit and in a Pipeline.

The update program runs on shards (ipu_jax/sharded_optimizer.py); norms over a
whole weight are reduced across the replicas, so the weights equal unsharded
training's. Small models, 16 tiles, 2 replicas.
"""

import os
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax.ops import pipeline_stage
from ipu_jax.ops.collectives import REPLICA_AXIS
from ipu_jax.pipelining import Pipeline, links, weight_update
from ipu_jax.sharded_optimizer import (ShardedOptimizerError, ShardedUpdate, gather_leaf,
                                       shard_tree)
from ipu_jax.strategy import IPUStrategy

sys.path.insert(0, os.path.dirname(__file__))
from test_training import TinyMLP, toy_data  # noqa: E402

_TILES = 16
_STEPS = 3


def _max_scaled():
  """Scales the update by the largest gradient of each weight (a max over it) and
  doubles it where every gradient is negative (an ``all`` over it): reductions the
  zero padding of a shard would change if it were not masked."""

  def init(params):
    del params
    return optax.EmptyState()

  def update(grads, state, params=None):
    del params
    def one(g):
      g = g / (jnp.abs(jnp.max(g)) + 1.0)
      return jnp.where(jnp.all(g < 0), 2.0 * g, g)
    return jax.tree.map(one, grads), state

  return optax.GradientTransformation(init, update)


def _row_normalized():
  """Divides each row by its norm: a reduction over one axis, which mixes shards."""

  def init(params):
    del params
    return optax.EmptyState()

  def update(grads, state, params=None):
    del params
    return jax.tree.map(lambda g: g / jnp.linalg.norm(g, axis=-1, keepdims=True), grads), state

  return optax.GradientTransformation(init, update)


_OPTIMIZERS = {
    "lamb": lambda: optax.lamb(1e-2),
    "adam": lambda: optax.adam(1e-2),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}


def _normal_sampler(seed):
  """float32 normal samples of a shape, from NumPy's generator (jax.random
  would compile a sampler for every shape)."""
  rng = np.random.default_rng(seed)
  return lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _full_update(optimizer, params, grads_per_step):
  state = optimizer.init(params)
  update = jax.jit(optimizer.update)  # one XLA program, not one per operation
  for grads in grads_per_step:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params


class ShardedUpdateTest(chex.TestCase):
  """The interpreter in plain JAX: replicas as a vmap, against the full update."""

  @parameterized.parameters(("lamb", 2), ("lamb", 3), ("adam", 3), ("clip_adam", 2),
                            ("max_scaled", 3))
  def test_shards_equal_the_full_update(self, name, replicas):
    optimizer = _max_scaled() if name == "max_scaled" else _OPTIMIZERS[name]()
    normal = _normal_sampler(0)
    # Odd sizes (padded shards), a scalar weight (replicated) and a 1-element one.
    params = {"w": normal((7, 5)), "b": normal((11,)), "s": jnp.float32(0.7),
              "u": jnp.ones((1,))}
    steps = [jax.tree.map(lambda p: -jnp.abs(normal(np.shape(p))), params)
             for _ in range(_STEPS)]
    program = ShardedUpdate(optimizer, params, replicas)

    def replica(r):
      state, p = program.init(params, r), shard_tree(params, r, replicas)
      for grads in steps:
        p, state = program(shard_tree(grads, r, replicas), state, p, r)
      return p

    shards = jax.jit(jax.vmap(replica, axis_name=REPLICA_AXIS))(jnp.arange(replicas))
    got = jax.tree.map(lambda s, like: gather_leaf(jnp.reshape(s, (-1,)), like)
                       if np.ndim(like) else s[0], shards, params)
    chex.assert_trees_all_close(got, _full_update(optimizer, params, steps), rtol=1e-5,
                                atol=1e-7)

  @parameterized.parameters("apply_if_finite", "multi_steps")
  def test_branches_on_a_replicated_predicate(self, name):
    # optax's skip of non-finite steps (an `all` over each sharded weight, then
    # a cond) and its accumulation over mini-steps (a cond on the step count).
    inner = optax.lamb(1e-2)
    optimizer = (optax.apply_if_finite(inner, 3) if name == "apply_if_finite"
                 else optax.MultiSteps(inner, 2))
    normal = _normal_sampler(1)
    params = {"w": normal((7, 5)), "b": normal((11,))}
    steps = [jax.tree.map(lambda p: normal(np.shape(p)), params) for _ in range(4)]
    if name == "apply_if_finite":  # the second step is skipped
      steps[1]["b"] = steps[1]["b"].at[4].set(jnp.inf)
    program = ShardedUpdate(optimizer, params, 2)

    def replica(r):
      state, p = program.init(params, r), shard_tree(params, r, 2)
      for grads in steps:
        p, state = program(shard_tree(grads, r, 2), state, p, r)
      return p

    shards = jax.jit(jax.vmap(replica, axis_name=REPLICA_AXIS))(jnp.arange(2))
    got = jax.tree.map(lambda s, like: gather_leaf(jnp.reshape(s, (-1,)), like), shards, params)
    expected = _full_update(optimizer, params, steps)
    chex.assert_tree_all_finite(expected)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-7)

  def test_a_program_that_mixes_shards_is_refused(self):
    program = ShardedUpdate(_row_normalized(), {"w": jnp.ones((4, 6))}, 2)
    with self.assertRaisesRegex(
        ShardedOptimizerError,
        r"optimizer _row_normalized .* 'reduce_sum' to a sharded value \(a reduction over "
        r"axes \(1,\) of a value of shape \(4, 6\), not over all of them\) at .*\.py:\d+"):
      program.check()


# -- the Keras-like fit --------------------------------------------------------------------


def _keras_config(offload, sharding):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _TILES
  cfg.replication_factor = 2
  cfg.training.replica_reduction = "mean"
  cfg.streaming.offload_optimizer_state = offload
  cfg.streaming.replicated_tensor_sharding = sharding
  return cfg


def _keras_model(cfg, optimizer):
  with IPUStrategy(cfg).scope():
    # hidden=17: odd sizes, so shards are padded.
    model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), hidden=17))
    # One execution of 2 replicas x 3 updates.
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  steps_per_execution=2 * _STEPS)
  return model


def _check_keras_fit(test, name):
  """Fit with state offloaded and sharded equals the unsharded fit; the report shows it."""
  x, y = toy_data(2 * _STEPS * 4)
  models = {}
  for sharded in (False, True):
    model = _keras_model(_keras_config(sharded, sharded), _OPTIMIZERS[name]())
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    models[sharded] = model
  chex.assert_trees_all_close(np.asarray(models[True].step), _STEPS)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, models[True].params),
                              jax.tree.map(np.asarray, models[False].params),
                              rtol=1e-5, atol=1e-7)
  report = models[True].train_report
  # The state's shards (those of at least 128 bytes) are in streaming memory.
  test.assertGreater(report.profile.streaming.total_bytes, 0)
  test.assertIn("Streaming memory", report.summary())
  ops = report.cycles_by_op()
  test.assertGreater(ops.get("cross_replica_reduce_scatter", 0), 0)
  test.assertGreater(ops.get("cross_replica_all_gather", 0), 0)
  # LAMB's norms and the global norm: scalar all-reduces, costed as collectives.
  if name == "adam":
    test.assertNotIn("cross_replica_sum", ops)
  else:
    test.assertGreater(ops.get("cross_replica_sum", 0), 0)
    norms = [s for s in report.profile.steps if s.op == "cross_replica_sum"]
    test.assertTrue(all(s.ipu_link_bytes <= 8 for s in norms))


class KerasShardedOptimizerTest(chex.TestCase):

  def test_lamb_offloaded_sharded_equals_unsharded_fit(self):
    _check_keras_fit(self, "lamb")

  def test_an_optimizer_that_cannot_be_sharded_fails_before_running(self):
    x, y = toy_data(2 * _STEPS * 4)
    model = _keras_model(_keras_config(True, True), _row_normalized())
    before = jax.tree.map(np.asarray, model.params)
    with self.assertRaisesRegex(ShardedOptimizerError, "_row_normalized.*reduce_sum"):
      model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, model.params), before)


@pytest.mark.slow
class KerasShardedOptimizerSlowTest(chex.TestCase):
  """Adam and clip + Adam (``-m slow``: about half a minute each)."""

  @parameterized.parameters("adam", "clip_adam")
  def test_offloaded_sharded_equals_unsharded_fit(self, name):
    _check_keras_fit(self, name)


# -- Pipeline -----------------------------------------------------------------------------


def _pipeline_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w0"] + params["b0"])
  h = pipeline_stage(h, 1)
  h = jnp.tanh(h @ params["w1"]) * params["s"]
  return jnp.mean((h - batch["y"]) ** 2)


_STAGE_LEAVES = (("b0", "w0"), ("s", "w1"))  # each stage's weights, in leaf order


def _pipeline_config(offload, sharding, g=4):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _TILES
  cfg.auto_select_ipus = 2
  cfg.replication_factor = 2
  cfg.training.gradient_accumulation_steps = g
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.streaming.offload_optimizer_state = offload
  cfg.streaming.replicated_tensor_sharding = sharding
  return cfg


def _pipeline_data(g=4, replicas=2):
  rng = np.random.default_rng(0)
  params = {"w0": rng.normal(size=(12, 23)) * 0.3, "b0": rng.normal(size=(23,)),
            "w1": rng.normal(size=(23, 9)) * 0.3, "s": np.float64(1.1)}
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
  batches = {"x": jnp.asarray(rng.normal(size=(g * replicas, 3, 12)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(g * replicas, 3, 9)), jnp.float32)}
  return params, batches


def _plain_pipeline_training(optimizer, params, batches):
  """Plain JAX: the mean gradient of all micro-batches, each stage's weights updated
  by the optimizer on its own (the pipeline's documented semantics)."""
  count = jax.tree.leaves(batches)[0].shape[0]
  grad = jax.jit(jax.grad(_pipeline_loss))
  states = [optimizer.init([params[k] for k in leaves]) for leaves in _STAGE_LEAVES]
  update = jax.jit(optimizer.update)  # one XLA program, not one per operation
  for _ in range(_STEPS):
    grads = [grad(params, jax.tree.map(lambda b, m=m: b[m], batches)) for m in range(count)]
    mean = jax.tree.map(lambda *g: sum(g) / count, *grads)
    for k, leaves in enumerate(_STAGE_LEAVES):
      p = [params[name] for name in leaves]
      updates, states[k] = update([mean[name] for name in leaves], states[k], p)
      params.update(zip(leaves, optax.apply_updates(p, updates)))
  return params


def _train_pipeline(cfg, optimizer, params, batches):
  pipe = Pipeline(_pipeline_loss, optimizer, config=cfg)
  state = pipe.init(params, batches)
  for _ in range(_STEPS):
    out = pipe.step(params, state, batches)
    params, state = out.params, out.opt_state
  return pipe, params, state


def _check_pipeline(test, name):
  """Offloaded, sharded state in a Pipeline equals plain accumulation; the report shows it."""
  params, batches = _pipeline_data()
  optimizer = _OPTIMIZERS[name]()
  plain_pipe, plain, _ = _train_pipeline(_pipeline_config(False, False), optimizer, params,
                                         batches)
  pipe, sharded, state = _train_pipeline(_pipeline_config(True, True), optimizer, params,
                                         batches)
  expected = _plain_pipeline_training(optimizer, dict(params), batches)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, sharded), expected, rtol=1e-5,
                              atol=1e-7)
  chex.assert_trees_all_close(jax.tree.map(np.asarray, plain), expected, rtol=1e-5,
                              atol=1e-7)
  # Each replica holds half of every state leaf with an axis: [2, ceil(size / 2)];
  # the step count is one scalar.
  shapes = [s.shape for s in jax.tree.leaves(state[0]) if s.ndim > 1]
  test.assertIn((), [s.shape for s in jax.tree.leaves(state[0])])
  test.assertIn((2, 12), shapes)        # b0: 23 elements, padded to 24
  test.assertIn((2, 12 * 23 // 2), shapes)
  # The state is in streaming memory: the sharded update's always-live tile
  # memory holds none of it; its copies are costed.
  for stage in pipe.stages:
    streaming = stage.update.profile.streaming
    test.assertGreater(streaming.total_bytes, 0)
    test.assertGreater(streaming.cycles, 0)
  summary = pipe.report.summary()
  test.assertIn("optimizer state in streaming memory", summary)
  test.assertIn("replicated tensor sharding over 2 replicas", summary)
  ops = pipe.report.stage_reports["stage0/update"].cycles_by_op()
  if name == "adam":
    test.assertNotIn("cross_replica_sum", ops)
  else:  # the norms: scalar all-reduces over the replicas, in the update program
    test.assertGreater(ops["cross_replica_sum"], 0)
    test.assertIn("cross_replica_sum", summary)
  # The gradient reduction in the timeline, where the all-reduce was: a
  # reduce-scatter and an all-gather of the padded sharded weights (two ring
  # phases: one all-reduce's traffic and steps), and an all-reduce of the
  # scalar weight s.
  spans = {ipu: cycles for ipu, _, kind, _, _, cycles in (s[:6] for s in pipe.timeline.spans)
           if kind == "all-reduce"}
  target = pipe.target
  test.assertAlmostEqual(spans[0], links.all_reduce_cycles(target, 2, (12 * 23 + 24) * 4))
  test.assertAlmostEqual(spans[1], links.all_reduce_cycles(target, 2, 208 * 4)
                         + links.all_reduce_cycles(target, 2, 4))
  test.assertAlmostEqual(
      2 * weight_update.ring_phase_cycles(target, 2, 1000),
      links.all_reduce_cycles(target, 2, 1000))


class PipelineShardedOptimizerTest(chex.TestCase):

  def test_lamb_offloaded_sharded_equals_plain_accumulation(self):
    _check_pipeline(self, "lamb")

  def test_a_sharded_update_compiles_one_xla_program(self):
    # The R copies' updates run under jax.vmap; run op by op, each of LAMB's
    # operations would compile its own XLA program (hundreds a stage).
    params, batches = _pipeline_data()
    pipe = Pipeline(_pipeline_loss, _OPTIMIZERS["lamb"](), config=_pipeline_config(True, True))
    state = pipe.init(params, batches)
    p_0 = [params[name] for name in _STAGE_LEAVES[0]]
    compiles = []
    listener = lambda event, duration, **_: compiles.append(event) if event == (
        "/jax/core/compile/backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      new_p, _ = pipe.stages[0].update(p_0, state[0], p_0)
      jax.tree.map(np.asarray, new_p)
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
    self.assertLen(compiles, 1)

  def test_an_optimizer_reading_other_stages_is_named(self):
    # A global-norm clip reads every stage's gradients; the pipeline's updates
    # see one stage each, and the user is told. LAMB's norms are per weight.
    params, batches = _pipeline_data()
    cfg = _pipeline_config(False, False)
    with self.assertWarnsRegex(UserWarning, r"update of weight \['b0'\] \(pipeline stage 0\) "
                               r"reads weight \['s'\] of stage 1"):
      Pipeline(_pipeline_loss, _OPTIMIZERS["clip_adam"](), config=cfg).init(params, batches)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      Pipeline(_pipeline_loss, _OPTIMIZERS["lamb"](), config=cfg).init(params, batches)
    self.assertEmpty([w for w in caught if "reads weight" in str(w.message)])

  def test_an_optimizer_that_cannot_be_sharded_fails_before_running(self):
    params, batches = _pipeline_data()
    pipe = Pipeline(_pipeline_loss, _row_normalized(), config=_pipeline_config(True, True))
    with self.assertRaisesRegex(ShardedOptimizerError, "_row_normalized.*reduce_sum"):
      pipe.init(params, batches)


@pytest.mark.slow
class PipelineShardedOptimizerSlowTest(chex.TestCase):

  @parameterized.parameters("adam", "clip_adam")
  def test_offloaded_sharded_equals_plain_accumulation(self, name):
    _check_pipeline(self, name)

  def test_offload_alone_and_sharding_alone(self):
    params, batches = _pipeline_data()
    optimizer = _OPTIMIZERS["lamb"]()
    expected = _plain_pipeline_training(optimizer, dict(params), batches)
    for offload, sharding in ((True, False), (False, True)):
      pipe, got, _ = _train_pipeline(_pipeline_config(offload, sharding), optimizer, params,
                                     batches)
      chex.assert_trees_all_close(jax.tree.map(np.asarray, got), expected, rtol=1e-5,
                                  atol=1e-7)
      streaming = pipe.stages[0].update.profile.streaming
      self.assertEqual(streaming is not None, offload)


@pytest.mark.slow
class KerasPipelinedShardedOptimizerTest(chex.TestCase):

  def test_pipelined_fit_with_loss_scaled_lamb(self):
    # The Keras pipelined fit runs a Pipeline: LAMB under a loss-scale optimizer
    # (whose finiteness check is an `all` over every gradient, reduced across the
    # replicas), state offloaded and sharded, equals the unsharded pipelined fit.
    import testing_utils
    from ipu_jax.keras import LossScaleOptimizer, Model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(_STEPS * 16, 6)).astype(np.float32)
    y = rng.integers(0, 9, size=_STEPS * 16).astype(np.int32)
    models = {}
    for sharded in (False, True):
      cfg = _pipeline_config(sharded, sharded, g=1)
      model = Model(testing_utils.TwoLayerMLP((6, 17, 9), rngs=nnx.Rngs(0)), config=cfg)
      model.compile(LossScaleOptimizer(optax.lamb(1e-2), 2.0 ** 10),
                    "sparse_categorical_crossentropy", steps_per_execution=8)
      model.set_pipelining_options(schedule="Grouped", gradient_accumulation_steps_per_replica=4)
      model.set_pipeline_stage_assignment({"second": 1})
      model.fit(x, y, batch_size=2, epochs=1, shuffle=False)
      models[sharded] = model
    self.assertEqual(models[True].step, _STEPS)
    chex.assert_trees_all_close(nnx.state(models[True].module, nnx.Param),
                                nnx.state(models[False].module, nnx.Param), rtol=1e-5,
                                atol=1e-7)
    self.assertEqual(models[True].number_formats.loss_scaling.scale, [2.0 ** 10] * _STEPS)
    self.assertGreater(models[True].pipeline.stages[1].update.profile.streaming.total_bytes, 0)


if __name__ == "__main__":
  absltest.main()
