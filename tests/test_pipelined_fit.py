"""The pipelined ``fit`` trains what a plain ``fit`` trains.

Dropout draws, per micro-batch and stage, the keys plain accumulation draws;
metrics and the history are plain fit's; validation is plain ``evaluate``
on the trained weights; callbacks fire at the points plain fit calls them;
batch statistics are held and updated on the stage that owns them.
"""

import os
import tempfile

from absl.testing import absltest, parameterized
import chex
from flax import linen, nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.keras import Model, callbacks as callbacks_lib
from ipu_jax.ops import pipeline_stage
from ipu_jax.pipelining import Pipeline, PipelineError
from ipu_jax.pipelining import micro_batch_key
import testing_utils
from testing_utils import chain_data

_TILES = 16


def _config(ipus, g=1, schedule="Grouped", recompute=False):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _TILES
  cfg.auto_select_ipus = ipus
  cfg.training.gradient_accumulation_steps = g
  cfg.pipelining.schedule = schedule
  cfg.pipelining.recomputation = recompute
  return cfg


def _dropout(key, x, rate):
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def _loss_with_dropout(params, batch, rng):
  """Three layers, one stage each, each with its own dropout mask."""
  h = batch["x"]
  for k, w in enumerate(params):
    if k:
      h = pipeline_stage(h, k)
    h = _dropout(jax.random.fold_in(rng, k), jnp.tanh(h @ w), 0.5)
  return jnp.mean((h - batch["y"]) ** 2)


def _data(g, stages=3):
  return chain_data(stages, g, width=8, rows=4)


class PipelineRngTest(chex.TestCase):

  @parameterized.named_parameters(("grouped", "Grouped", False),
                                  ("sequential_recomputed", "Sequential", True))
  def test_dropout_equals_plain_accumulation(self, schedule, recompute):
    params, batches = _data(g=6)
    key = jax.random.key(3)
    pipe = Pipeline(_loss_with_dropout, optax.sgd(0.1),
                    config=_config(3, g=6, schedule=schedule, recompute=recompute), rng=True)
    out = pipe.step(params, pipe.init(params, batches, rng=key), batches, rng=key)
    new_params, loss = out.params, out.loss
    acc, losses = testing_utils.accumulated_gradients(_loss_with_dropout, params, batches, 6,
                                                      key=key)
    expected = testing_utils.sgd_after(params, acc, 0.1)
    chex.assert_trees_all_close(new_params, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), np.mean(losses), rtol=1e-5)
    # Each stage reads the key and draws its own bits; no mask crosses a link.
    self.assertTrue(all(s.batch[-1] == 2 for s in pipe.staged.stages))
    self.assertTrue(all(not s.inputs or all(v.aval.dtype == jnp.float32 for v in s.inputs)
                        for s in pipe.staged.stages))
    # Another key draws other masks.
    other = pipe.step(params, pipe.init(params, batches, rng=key), batches,
                      rng=jax.random.key(4)).params
    self.assertGreater(float(jnp.max(jnp.abs(other[0] - new_params[0]))), 1e-4)

  def test_key_required_and_refused(self):
    params, batches = _data(g=6)
    with self.assertRaisesRegex(PipelineError, "rng=True: pass rng="):
      Pipeline(_loss_with_dropout, config=_config(3, g=6), rng=True).gradients(params, batches)
    with self.assertRaisesRegex(PipelineError, "takes no rng"):
      Pipeline(lambda p, b: _loss_with_dropout(p, b, jax.random.key(0)),
               config=_config(3, g=6)).gradients(params, batches, rng=jax.random.key(0))


def _loss_with_state(params, batch, state):
  """Stage 1 keeps a running mean of its activations (batch-statistics style)."""
  h = jnp.tanh(batch["x"] @ params[0])
  h = pipeline_stage(h, 1)
  h = jnp.tanh(h @ params[1])
  mean = 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0)
  h = h - jax.lax.stop_gradient(mean)
  h = pipeline_stage(h, 2)
  loss = jnp.mean((h @ params[2] - batch["y"]) ** 2)
  return loss, ({"mean": mean, "count": state["count"] + 1}, jnp.sum(h, axis=0))


class PipelineStateTest(chex.TestCase):

  def test_state_held_on_its_stage_equals_plain_loop(self):
    params, batches = _data(g=6)
    state = {"mean": jnp.zeros((8,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    pipe = Pipeline(_loss_with_state, config=_config(3, g=6), has_aux=True, mutable=True)
    grads, loss, new_state, aux = pipe.gradients(params, batches, state=state)
    grad = jax.jit(jax.value_and_grad(_loss_with_state, has_aux=True))
    acc, s, sums = jax.tree_util.tree_map(jnp.zeros_like, params), state, []
    for m in range(6):
      (_, (s, out)), g = grad(params, jax.tree_util.tree_map(lambda b: b[m], batches), s)
      acc, sums = jax.tree_util.tree_map(jnp.add, acc, g), sums + [out]
    chex.assert_trees_all_close(grads, acc, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state, s, rtol=1e-5, atol=1e-6)
    self.assertEqual(int(new_state["count"]), 6)
    chex.assert_trees_all_close(aux, jnp.stack(sums), rtol=1e-5, atol=1e-6)
    # The running mean is read and updated on stage 1 only.
    mean_index = len(jax.tree_util.tree_leaves(batches)) + 1
    self.assertEqual([mean_index in s.batch for s in pipe.staged.stages], [False, True, False])

  def test_replicas_start_from_the_state_and_average_it(self):
    # Two replicas: each runs its G micro-batches (keys r G + k) from the
    # step's state; the new state is their mean, the integer count replica 0's.
    def loss(params, batch, rng, state):
      batch = dict(batch, x=_dropout(rng, batch["x"], 0.5))
      return _loss_with_state(params, batch, state)

    params, batches = _data(g=12)
    state = {"mean": jnp.zeros((8,), jnp.float32), "count": jnp.zeros((), jnp.int32)}
    cfg = _config(3, g=6)
    cfg.replication_factor = 2
    cfg.training.replica_reduction = "mean"
    pipe = Pipeline(loss, config=cfg, rng=True, has_aux=True, mutable=True)
    key = jax.random.key(7)
    grads, _, new_state, aux = pipe.gradients(params, batches, rng=key, state=state)
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    acc, finals, sums = jax.tree_util.tree_map(jnp.zeros_like, params), [], []
    for r in range(2):
      s = state
      for k in range(6):
        m = r * 6 + k
        (_, (s, out)), g = grad(params, jax.tree_util.tree_map(lambda b: b[m], batches),
                                micro_batch_key(key, m), s)
        acc, sums = jax.tree_util.tree_map(jnp.add, acc, g), sums + [out]
      finals.append(s)
    chex.assert_trees_all_close(grads, jax.tree_util.tree_map(lambda a: a / 2, acc),
                                rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(new_state["mean"], (finals[0]["mean"] + finals[1]["mean"]) / 2,
                                rtol=1e-5, atol=1e-6)
    self.assertEqual(int(new_state["count"]), 6)
    chex.assert_trees_all_close(aux, jnp.stack(sums), rtol=1e-5, atol=1e-6)

  def test_state_read_on_two_stages_is_refused(self):
    def loss(params, batch, state):
      h = jnp.tanh(batch["x"] @ params[0]) + state["mean"]
      h = pipeline_stage(h, 1)
      new = 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0)
      return jnp.mean((h @ params[1] - batch["y"]) ** 2), {"mean": new}

    params, batches = _data(g=4, stages=2)
    pipe = Pipeline(loss, config=_config(2, g=4), mutable=True)
    with self.assertRaisesRegex(PipelineError,
                                r"Mutable state \['mean'\] is read by stage\(s\) \[0, 1\] and "
                                r"updated by stage 1"):
      pipe.gradients(params, batches, state={"mean": jnp.zeros((8,), jnp.float32)})


class Net(nnx.Module):
  """Three linear layers (stages 0, 1, 2 when pipelined), dropout after the
  first two, optionally batch normalisation on stage 1."""

  def __init__(self, *, rate=0.0, batch_norm=False, rngs):
    self.first = nnx.Linear(6, 16, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.second = nnx.Linear(16, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.8, rngs=rngs) if batch_norm else None
    self.drop2 = nnx.Dropout(rate, rngs=rngs)
    self.third = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    h = self.drop(jnp.tanh(self.first(x)))
    h = self.second(h)
    if self.norm is not None:
      h = self.norm(h)
    return self.third(self.drop2(jnp.tanh(h)))


_STAGES = {"second": 1, "third": 2}  # the norm reads stage 1 values: it runs there


class LinenNet(linen.Module):
  """Net's layers in linen: dropout by ``deterministic``, batch statistics in
  the ``batch_stats`` collection."""

  @linen.compact
  def __call__(self, x, train: bool = False):
    h = linen.Dropout(0.3, deterministic=not train)(jnp.tanh(linen.Dense(16)(x)))
    h = linen.BatchNorm(use_running_average=not train, momentum=0.8)(linen.Dense(16)(h))
    h = linen.Dropout(0.3, deterministic=not train)(jnp.tanh(h))
    return linen.Dense(3)(h)


def _keras_data(n=96, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, 6)).astype(np.float32)
  y = rng.integers(0, 3, size=n).astype(np.int32)
  return x, y


class Recorder(callbacks_lib.Callback):
  """Records every training and test hook: its name, step or epoch, and logs' keys."""

  def __init__(self):
    super().__init__()
    self.events = []

  def _record(self, name, index, logs):
    keys = sorted(k for k in (logs or {}) if not k.startswith(("host_", "emulated_")))
    self.events.append((name, index, keys))

  def on_train_begin(self, logs=None): self._record("on_train_begin", None, logs)
  def on_train_end(self, logs=None): self._record("on_train_end", None, logs)
  def on_epoch_begin(self, epoch, logs=None): self._record("on_epoch_begin", epoch, logs)
  def on_epoch_end(self, epoch, logs=None): self._record("on_epoch_end", epoch, logs)
  def on_train_batch_begin(self, batch, logs=None): self._record("on_train_batch_begin", batch, logs)
  def on_train_batch_end(self, batch, logs=None): self._record("on_train_batch_end", batch, logs)
  def on_test_begin(self, logs=None): self._record("on_test_begin", None, logs)
  def on_test_end(self, logs=None): self._record("on_test_end", None, logs)
  def on_test_batch_begin(self, batch, logs=None): self._record("on_test_batch_begin", batch, logs)
  def on_test_batch_end(self, batch, logs=None): self._record("on_test_batch_end", batch, logs)


def _fit(pipelined, *, rate=0.0, batch_norm=False, g=6, epochs=2, callbacks=(),
         validation=True, metrics=("accuracy",)):
  """Plain fit with G-step accumulation, or pipelined over 3 IPUs with the same G."""
  x, y = _keras_data()
  model = Model(Net(rate=rate, batch_norm=batch_norm, rngs=nnx.Rngs(params=0, dropout=1)),
                config=_config(3 if pipelined else 1, g=1))
  model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy", metrics=list(metrics),
                steps_per_execution=2 * g)
  if pipelined:
    model.set_pipelining_options(schedule="Grouped", gradient_accumulation_steps_per_replica=g)
    model.set_pipeline_stage_assignment(_STAGES)
  else:
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=g)
  history = model.fit(x, y, batch_size=4, epochs=epochs, verbose=0, callbacks=list(callbacks),
                      validation_data=(x[:20], y[:20]) if validation else None)
  return model, history


class KerasPipelinedFitTest(chex.TestCase):

  @parameterized.named_parameters(("dropout", 0.3, False), ("dropout_and_batch_norm", 0.3, True))
  def test_trains_what_plain_fit_trains(self, rate, batch_norm):
    plain, plain_history = _fit(False, rate=rate, batch_norm=batch_norm, g=6)
    piped, piped_history = _fit(True, rate=rate, batch_norm=batch_norm, g=6)
    self.assertEqual(piped.step, plain.step)
    self.assertEqual(piped.step, 2 * 96 // (4 * 6))
    chex.assert_trees_all_close(nnx.state(piped.module, nnx.Param),
                                nnx.state(plain.module, nnx.Param), rtol=2e-5, atol=2e-6)
    # Batch statistics: updated on stage 1, each micro-batch from the last.
    chex.assert_trees_all_close(nnx.state(piped.module, nnx.BatchStat),
                                nnx.state(plain.module, nnx.BatchStat), rtol=2e-5, atol=2e-6)
    self.assertEqual(sorted(piped_history.history), ["accuracy", "loss", "val_accuracy",
                                                     "val_loss"])
    for key, values in plain_history.history.items():
      np.testing.assert_allclose(piped_history.history[key], values, rtol=1e-5, err_msg=key)
    if batch_norm:  # the statistics moved away from their initial values
      self.assertGreater(float(jnp.max(jnp.abs(piped.module.norm.mean[...]))), 1e-3)
    self.assertEqual(piped.pipeline.staged.num_stages, 3)

  def test_linen_dropout_and_batch_norm(self):
    x, y = _keras_data()
    models = []
    for pipelined in (False, True):
      model = Model(LinenNet(), input_shape=(4, 6), seed=3, config=_config(3 if pipelined else 1))
      model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"],
                    steps_per_execution=12)
      if pipelined:
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=6)
        model.set_pipeline_stage_assignment({"Dense_1": 1, "Dense_2": 2})
      else:
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=6)
      models.append((model, model.fit(x, y, batch_size=4, epochs=1, verbose=0)))
    (plain, plain_history), (piped, piped_history) = models
    self.assertTrue(piped.adapter.needs_rng)
    # Linen splits one key for its dropout layers: each stage derives it again
    # from the micro-batch's counters; no key crosses to another stage.
    stages = piped.pipeline.staged.stages
    self.assertFalse([v for s in stages for v in s.inputs
                      if jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.prng_key)])
    chex.assert_trees_all_close(piped.params, plain.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(piped.state, plain.state, rtol=1e-5, atol=1e-6)
    self.assertGreater(float(jnp.max(jnp.abs(
        piped.state["batch_stats"]["BatchNorm_0"]["mean"]))), 1e-3)
    for key, values in plain_history.history.items():
      np.testing.assert_allclose(piped_history.history[key], values, rtol=1e-6, err_msg=key)

  def test_dropout_draws_new_masks_per_step_and_seed(self):
    x, y = _keras_data()
    weights = []
    for dropout_seed in (1, 1, 2):
      model = Model(Net(rate=0.3, rngs=nnx.Rngs(params=0, dropout=dropout_seed)),
                    config=_config(3, g=1))
      model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", steps_per_execution=6)
      model.set_pipelining_options(gradient_accumulation_steps_per_replica=6)
      model.set_pipeline_stage_assignment(_STAGES)
      model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)
      weights.append(np.asarray(model.module.first.kernel[...]))
    np.testing.assert_array_equal(weights[0], weights[1])
    self.assertGreater(np.max(np.abs(weights[0] - weights[2])), 1e-5)

  def test_a_second_fit_goes_on(self):
    # As plain fit: epochs 0..1 in one call train what epoch 0, then a call
    # resuming at epoch 1, train (the stages' Adam moments and the dropout
    # counters go on).
    # A third model resumes from a checkpoint of the first epoch (with the
    # optimizer: the stages' own Adam moments, not the plain state's).
    x, y = _keras_data()
    models = []
    with tempfile.TemporaryDirectory() as directory:
      path = os.path.join(directory, "epoch1.msgpack")
      for calls in ([(0, 2)], [(0, 1), (1, 2)], [(1, 2)]):
        model = Model(Net(rate=0.3, rngs=nnx.Rngs(params=0, dropout=1)), config=_config(3))
        model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy", steps_per_execution=6)
        model.set_pipelining_options(gradient_accumulation_steps_per_replica=6)
        model.set_pipeline_stage_assignment(_STAGES)
        if calls[0][0]:
          self.assertEqual(model.load_weights(path), 1)
        for initial, epochs in calls:
          model.fit(x, y, batch_size=4, epochs=epochs, initial_epoch=initial, verbose=0)
          if len(calls) == 2 and epochs == 1:
            model.save_weights(path, include_optimizer=True, epoch=1)
        models.append(model)
    for resumed in models[1:]:
      self.assertEqual(resumed.step, models[0].step)
      chex.assert_trees_all_close(nnx.state(resumed.module, nnx.Param),
                                  nnx.state(models[0].module, nnx.Param), rtol=1e-6, atol=1e-7)

  def test_validation_is_plain_evaluate_on_the_trained_weights(self):
    model, history = _fit(True, rate=0.3, batch_norm=True, epochs=1)
    x, y = _keras_data()
    logs = model.evaluate(x[:20], y[:20], batch_size=4, verbose=0)
    self.assertEqual(history.history["val_loss"], [logs["loss"]])
    self.assertEqual(history.history["val_accuracy"], [logs["accuracy"]])

  def test_stage_reports_cost_loss_metrics_and_optimizer_under_plain_fits_scopes(self):
    model, _ = _fit(True, epochs=1, validation=False)
    scopes = {name: {row.scope for row in report.by_scope(depth=0)}
              for name, report in model.pipeline.report.stage_reports.items()}
    self.assertLessEqual({"loss", "metrics", "Net/third"}, scopes["stage2/forward"])
    self.assertIn("loss/grad", scopes["stage2/backward"])
    for k in range(3):
      self.assertIn("optimizer/scale_by_adam", scopes[f"stage{k}/update"])

  def test_callbacks_fire_as_in_plain_fit(self):
    events = {}
    for pipelined in (False, True):
      recorder = Recorder()
      _fit(pipelined, epochs=2, callbacks=[recorder])
      events[pipelined] = recorder.events
    self.assertEqual(events[True], events[False])
    names = [e[0] for e in events[True]]
    self.assertEqual(names[:4], ["on_train_begin", "on_epoch_begin", "on_train_batch_begin",
                                 "on_train_batch_end"])
    # 96 samples / (S=12 steps x 4 samples) = 2 executions per epoch, then validation.
    self.assertEqual(names.count("on_train_batch_end"), 4)
    self.assertEqual(events[True][3][1], 11)  # the step counter at the execution's last step
    self.assertIn("on_test_end", names)
    self.assertEqual(names[-1], "on_train_end")

  def test_early_stopping_and_checkpoint(self):
    with tempfile.TemporaryDirectory() as directory:
      path = os.path.join(directory, "ckpt-{epoch}.msgpack")
      stop = callbacks_lib.EarlyStopping(monitor="loss", min_delta=10.0, patience=0)
      checkpoint = callbacks_lib.ModelCheckpoint(path, monitor="val_loss")
      model, history = _fit(True, epochs=5, callbacks=[stop, checkpoint])
      self.assertEqual(history.epoch, [0, 1])  # no improvement of 10 after epoch 0
      self.assertEqual(stop.stopped_epoch, 1)
      self.assertTrue(os.path.exists(os.path.join(directory, "ckpt-2.msgpack")))
      restored = Model(Net(rngs=nnx.Rngs(params=5, dropout=1)), config=_config(1))
      restored.compile(optax.adam(1e-2), "sparse_categorical_crossentropy")
      self.assertEqual(restored.load_weights(checkpoint.last_saved), 2)
      chex.assert_trees_all_close(nnx.state(restored.module, nnx.Param),
                                  nnx.state(model.module, nnx.Param))

  def test_refused_before_anything_runs(self):
    x, y = _keras_data()
    model = Model(Net(rngs=nnx.Rngs(0)), config=_config(3))
    model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", steps_per_execution=4,
                  emulate=False)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=6)
    with self.assertRaisesRegex(NotImplementedError, "emulated IPUs only"):
      model.fit(x, y, batch_size=4, verbose=0)
    model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", steps_per_execution=4)
    with self.assertRaisesRegex(ValueError, "steps_per_execution=4 must be a multiple of"):
      model.fit(x, y, batch_size=4, verbose=0)
    self.assertEqual(model.step, 0)


class ShardedStatePipelinedFitTest(chex.TestCase):
  """Two replicas of a 3-stage pipelined fit, LAMB state offloaded and sharded."""

  def _model(self, sharded):
    cfg = _config(3)
    cfg.replication_factor = 2
    cfg.training.replica_reduction = "mean"
    cfg.streaming.offload_optimizer_state = sharded
    cfg.streaming.replicated_tensor_sharding = sharded
    model = Model(Net(rate=0.3, rngs=nnx.Rngs(params=0, dropout=1)), config=cfg)
    model.compile(optax.lamb(1e-2), "sparse_categorical_crossentropy", steps_per_execution=12)
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=6)
    model.set_pipeline_stage_assignment(_STAGES)
    return model

  def test_trains_what_the_unsharded_fit_trains_and_resumes_from_its_shards(self):
    x, y = _keras_data()
    plain = self._model(False)
    plain.fit(x, y, batch_size=4, epochs=2, verbose=0)
    with tempfile.TemporaryDirectory() as directory:
      path = os.path.join(directory, "epoch1.msgpack")
      sharded = self._model(True)
      sharded.fit(x, y, batch_size=4, epochs=1, verbose=0)
      sharded.save_weights(path, include_optimizer=True, epoch=1)
      sharded.fit(x, y, batch_size=4, epochs=2, initial_epoch=1, verbose=0)
      resumed = self._model(True)
      self.assertEqual(resumed.load_weights(path), 1)
      resumed.fit(x, y, batch_size=4, epochs=2, initial_epoch=1, verbose=0)
    params = lambda m: nnx.state(m.module, nnx.Param)
    chex.assert_trees_all_close(params(sharded), params(plain), rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(params(resumed), params(sharded), rtol=1e-6, atol=1e-7)
    # Each replica holds half of every state leaf with an axis (Linear(6, 16)'s
    # kernel: 96 elements, 48 a replica); the stages stream their shards.
    stage_states = sharded.train_state.opt_state  # the stages' states, in the TrainState
    shapes = [np.shape(a) for a in jax.tree_util.tree_leaves(stage_states[0])]
    self.assertIn((2, 48), shapes)
    streamed = [s.update.profile.streaming for s in sharded.pipeline.stages]
    self.assertGreater(streamed[0].total_bytes, 0)
    self.assertIn("replicated tensor sharding over 2 replicas", sharded.pipeline.report.summary())


if __name__ == "__main__":
  absltest.main()
