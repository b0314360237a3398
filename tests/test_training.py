"""ipu_jax.keras.Model: fit on the emulated IPU, its semantics and its guarantees.

Most tests use a 16-tile target and a tiny MLP; the acceptance test trains the
digits MLP on the full 1,472-tile ipu2.
"""

import functools
import io
import os
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import linen, nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax.keras import callbacks as callbacks_lib
from ipu_jax.strategy import IPUStrategy

RTOL = 1e-5


def small_config(tiles=16, replicas=1, **training):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.replication_factor = replicas
  for name, value in training.items():
    setattr(cfg.training, name, value)
  return cfg


class TinyMLP(nnx.Module):

  def __init__(self, rngs, features=8, hidden=16, classes=4, dropout=0.0):
    self.l1 = nnx.Linear(features, hidden, rngs=rngs)
    self.l2 = nnx.Linear(hidden, classes, rngs=rngs)
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None

  def __call__(self, x):
    h = jnp.tanh(self.l1(x))
    if self.dropout is not None:
      h = self.dropout(h)
    return self.l2(h)


def toy_data(n=256, features=8, classes=4, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype(np.float32)
  w = rng.normal(size=(features, classes))
  y = np.argmax(x @ w, axis=1).astype(np.int32)
  return x, y


@functools.lru_cache(maxsize=None)
def _adam(lr):
  """One ``optax.adam`` a rate (it holds no state): the reference step below
  is compiled once a rate and batch shape, not once a test."""
  return optax.adam(lr)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _reference_step(graphdef, optimizer, params, opt_state, xb, yb):
  def loss_fn(p):
    logits = nnx.merge(graphdef, p)(xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  updates, opt_state = optimizer.update(jax.grad(loss_fn)(params), opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def reference_training(batches, lr=1e-2, optimizer=None):
  """Plain JAX + optax: one update per batch, from the same initial weights."""
  model = TinyMLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  optimizer = optimizer or _adam(lr)
  opt_state = optimizer.init(params)
  for xb, yb in batches:
    params, opt_state = _reference_step(graphdef, optimizer, params, opt_state, xb, yb)
  return params


def assert_params_close(actual, expected, rtol=RTOL, atol=None):
  """Equal to rounding: sums taken in another order (a loop body compiled
  differently) differ relative to the size of the terms, not of each result,
  so by default the absolute tolerance is ``rtol`` of the leaf's largest
  magnitude (docs/tile_program.md#what-same-numbers-means)."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    e = np.asarray(e)
    leaf_atol = rtol * float(np.abs(e).max(initial=0)) if atol is None else atol
    np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=leaf_atol)


def compiled_model(cfg, steps_per_execution=1, lr=1e-2, dropout=0.0, metrics=("accuracy",),
                   accumulation=None, reduction=None, optimizer=None):
  with IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), dropout=dropout))
    model.compile(optimizer=optimizer or optax.adam(lr), loss="sparse_categorical_crossentropy",
                  metrics=list(metrics), steps_per_execution=steps_per_execution)
    if accumulation is not None or reduction is not None:
      model.set_gradient_accumulation_options(
          gradient_accumulation_steps_per_replica=accumulation, reduction_method=reduction)
  return model


# ---------------------------------------------------------------------------
# Acceptance: a user's NNX script trains the digits MLP on ipu2 (1,472 tiles).
# ---------------------------------------------------------------------------


class DigitsAcceptanceTest(absltest.TestCase):

  def test_nnx_user_script_reaches_90_percent_on_ipu2(self):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.2, random_state=0, stratify=digits.target)

    class MLP(nnx.Module):
      def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

      def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))

    cfg = ipu_jax.IPUConfig()  # the default target: ipu2, every one of its 1,472 tiles
    with ipu_jax.IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(MLP(nnx.Rngs(0)))
      model.compile(optimizer=optax.adam(3e-3), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], steps_per_execution=8)
      history = model.fit(x_train, y_train, batch_size=32, epochs=4, verbose=0)
      result = model.evaluate(x_test, y_test, batch_size=32, verbose=0)

    self.assertGreaterEqual(result["accuracy"], 0.90, result)
    self.assertEqual(model.train_report.target.num_tiles, 1472)
    self.assertEqual(model.train_report.target.name, "ipu2")
    self.assertEqual(model.train_report.host_round_trips, 1)
    self.assertEqual(history.executions, 4 * (len(x_train) // (32 * 8)))
    self.assertLess(history.history["loss"][-1], history.history["loss"][0])


# ---------------------------------------------------------------------------
# Semantics.
# ---------------------------------------------------------------------------


class StepsPerExecutionTest(absltest.TestCase):

  def test_steps_per_execution_8_equals_1_with_one_round_trip_each(self):
    x, y = toy_data(128)
    weights, histories, reports = [], [], []
    for steps in (1, 8):
      model = compiled_model(small_config(), steps_per_execution=steps)
      counter = CountingCallback()
      history = model.fit(x, y, batch_size=8, epochs=2, shuffle=True, verbose=0,
                          callbacks=[counter])
      weights.append(model.params)
      histories.append((history, counter))
      reports.append(model.train_report)
    assert_params_close(weights[1], weights[0])
    for steps, (history, counter), report in zip((1, 8), histories, reports):
      executions = 2 * 128 // (8 * steps)
      self.assertEqual(history.executions, executions)
      self.assertEqual(counter.batch_ends, executions)  # callbacks once per execution
      self.assertEqual(report.host_round_trips, 1)      # one round trip per execution
      self.assertEqual(history.host_round_trips, executions)
      self.assertEqual(history.steps, executions * steps)
    # The 8-step program is an on-device loop: its steps execute 8 times per run.
    self.assertGreater(reports[1].num_supersteps_executed, reports[1].num_supersteps)
    self.assertAlmostEqual(histories[0][0].history["loss"][-1],
                           histories[1][0].history["loss"][-1], places=4)


class RepeatedFitTest(absltest.TestCase):

  def test_a_second_fit_traces_nothing_and_still_checks_its_labels(self):
    # A loop of one-epoch fits (as the benchmark's fit row runs) traces the
    # module once: the label check's output shapes are kept per input shape.
    traced = []

    class Counted(TinyMLP):

      def __call__(self, x):
        traced.append(x.shape)
        return super().__call__(x)

    x, y = toy_data(64)
    with IPUStrategy(small_config()).scope():
      model = ipu_jax.keras.Model(Counted(nnx.Rngs(0)))
      model.compile(optimizer=optax.sgd(0.1), loss="sparse_categorical_crossentropy",
                    steps_per_execution=2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    first = len(traced)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    self.assertEqual(len(traced), first)
    self.assertEqual(model.executions, 8)
    # Labels that do not fit the output are refused on every call, before a step.
    with self.assertRaisesRegex(ValueError, "label"):
      model.fit(x, np.full(64, 7, np.int32)[:, None].repeat(3, axis=1), batch_size=8,
                epochs=1, verbose=0)
    self.assertEqual(model.executions, 8)


class CountingCallback(callbacks_lib.Callback):

  def __init__(self):
    super().__init__()
    self.batch_ends = 0
    self.epoch_ends = 0
    self.steps_seen = []

  def on_train_batch_end(self, batch, logs=None):
    self.batch_ends += 1
    self.steps_seen.append(batch)

  def on_epoch_end(self, epoch, logs=None):
    self.epoch_ends += 1


class AccumulationTest(parameterized.TestCase):

  @parameterized.parameters(2, 4)
  def test_mean_accumulation_equals_optax_multisteps(self, accumulation):
    x, y = toy_data(128)
    b = 4
    model = compiled_model(small_config(), steps_per_execution=accumulation * 2,
                           accumulation=accumulation, reduction="mean")
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    multi = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=accumulation)
    expected = reference_training(
        [(x[i:i + b], y[i:i + b]) for i in range(0, len(x), b)], optimizer=multi)
    assert_params_close(model.params, expected)
    self.assertEqual(model.step, len(x) // (b * accumulation))

  def test_running_mean_and_sum(self):
    x, y = toy_data(64)
    b, g = 4, 4
    batches = [(x[i:i + b * g], y[i:i + b * g]) for i in range(0, len(x), b * g)]
    # running_mean is a mean too: the same as one batch of G b samples.
    model = compiled_model(small_config(), steps_per_execution=g, accumulation=g,
                           reduction="running_mean")
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    assert_params_close(model.params, reference_training(batches))
    # sum: G times the mean gradient, so SGD at lr equals SGD at G lr on the mean.
    model = compiled_model(small_config(), steps_per_execution=g, accumulation=g,
                           reduction="sum", optimizer=optax.sgd(0.05))
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    assert_params_close(model.params, reference_training(batches, optimizer=optax.sgd(0.05 * g)),
                        rtol=RTOL, atol=1e-6)

  def test_config_sets_accumulation_defaults(self):
    cfg = small_config(gradient_accumulation_steps=2, gradient_accumulation_reduction="mean")
    model = compiled_model(cfg, steps_per_execution=2)
    self.assertEqual(model.gradient_accumulation_steps, 2)
    self.assertEqual(model.gradient_accumulation_reduction, "mean")


class ReplicationTest(parameterized.TestCase):
  """Replicas on a vmapped axis (this process has one JAX device).

  tests/test_distributed.py runs every R x G on devices with shard_map and
  across processes.
  """

  @parameterized.parameters((2, 2), (4, 1))
  def test_replicas_times_accumulation_equal_one_big_batch(self, replicas, accumulation):
    x, y = toy_data(256)
    b = 4
    cfg = small_config(replicas=replicas, replica_reduction="mean")
    model = compiled_model(cfg, steps_per_execution=replicas * accumulation * 2,
                           accumulation=accumulation, reduction="mean")
    self.assertEqual(model.replication.mode, "vmap" if jax.device_count() < replicas
                     else "devices")
    n = replicas * accumulation * b * 8
    model.fit(x[:n], y[:n], batch_size=b, epochs=1, shuffle=False, verbose=0)
    big = replicas * accumulation * b
    expected = reference_training([(x[i:i + big], y[i:i + big]) for i in range(0, n, big)])
    assert_params_close(model.params, expected)
    report = model.train_report
    self.assertTrue(any("cross_replica" in op for op in report.cycles_by_op()),
                    report.cycles_by_op())
    self.assertGreater(report.to_dict()["totals"]["cycles"], 0)

  def test_sum_reduction_scales_with_replicas(self):
    x, y = toy_data(64)
    b = 4
    cfg = small_config(replicas=2, replica_reduction="sum")
    model = compiled_model(cfg, steps_per_execution=2, optimizer=optax.sgd(0.05))
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    expected = reference_training([(x[i:i + 2 * b], y[i:i + 2 * b])
                                   for i in range(0, len(x), 2 * b)],
                                  optimizer=optax.sgd(0.1))
    assert_params_close(model.params, expected, atol=1e-6)


# ---------------------------------------------------------------------------
# Errors before training.
# ---------------------------------------------------------------------------


class BadConfigTest(absltest.TestCase):

  def test_errors_come_before_training(self):
    cfg = ipu_jax.IPUConfig()
    with self.assertRaisesRegex(AttributeError, "Did you mean 'replication_factor'"):
      cfg.replication_factr = 2
    with self.assertRaisesRegex(AttributeError, "tiles_per_ipu"):
      cfg.device.tiles_per_ip = 16
    with self.assertRaisesRegex(ValueError, "tiles_per_ipu"):
      cfg.device.tiles_per_ipu = -1

    x, y = toy_data(64)
    module = TinyMLP(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(module, nnx.Param))
    with IPUStrategy(small_config(replicas=2)).scope():
      model = ipu_jax.keras.Model(module)
      with self.assertRaisesRegex(ValueError, "multiple of.*2"):
        model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy",
                      steps_per_execution=3)
      with self.assertRaisesRegex(ValueError, "Unknown loss 'sparse_categorical_crossentropyy'"
                                  ".*Did you mean 'sparse_categorical_crossentropy'"):
        model.compile(optax.adam(1e-2), "sparse_categorical_crossentropyy",
                      steps_per_execution=2)
      with self.assertRaisesRegex(ValueError, "Unknown metric"):
        model.compile(optax.adam(1e-2), "mse", metrics=["acuracy"])
      model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy", steps_per_execution=4)
      with self.assertRaisesRegex(ValueError, "multiple of gradient_accumulation_steps_per_replica"
                                  " x replicas = 4 x 2 = 8"):
        model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=4)
      with self.assertRaisesRegex(ValueError, "reduction_method"):
        model.set_gradient_accumulation_options(reduction_method="median")
    cfg = small_config(gradient_accumulation_steps=3)
    with IPUStrategy(cfg).scope():
      model2 = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0)))
      with self.assertRaisesRegex(ValueError, "steps_per_execution=4 must be a multiple"):
        model2.compile(optax.adam(1e-2), "sparse_categorical_crossentropy",
                       steps_per_execution=4)
    with self.assertRaisesRegex(ValueError, "samples"):
      model.fit(x[:4], y[:4], batch_size=4, verbose=0)  # less than one execution of data
    # One check for the three loops: evaluate's used to divide by zero, predict's
    # to fail inside a tree map.
    for run in (lambda b: model.fit(x, y, batch_size=b, verbose=0),
                lambda b: model.evaluate(x, y, batch_size=b, verbose=0),
                lambda b: model.predict(x, batch_size=b, verbose=0)):
      for bad in (0, -2, 2.5):
        with self.assertRaisesRegex(ValueError, rf"batch_size must be an int >= 1 .*got {bad}"):
          run(bad)
    self.assertEqual(model.executions, 0)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(module, nnx.Param)), before)
    with self.assertRaisesRegex(ValueError, "input_shape"):
      ipu_jax.keras.Model(linen.Dense(3))
    with self.assertRaises(TypeError):
      ipu_jax.keras.Model(lambda x: x)

  def test_fit_evaluate_predict_check_their_data_and_counts_before_the_first_step(self):
    x, y = toy_data(64)
    model = compiled_model(small_config())
    before = jax.tree.map(np.asarray, model.get_weights())
    fit = lambda **kw: model.fit(x, y, batch_size=16, verbose=0, **kw)  # noqa: E731
    # Each used to train a whole epoch first (validation data), train nothing
    # and report zeros (a negative steps_per_epoch), or fail inside the loop.
    cases = [
        (dict(steps_per_epoch=-1), "steps_per_epoch must be an int >= 1"),
        (dict(steps_per_epoch=1.5), "steps_per_epoch must be an int >= 1"),
        (dict(validation_data=(x[:10], y[:5])), "x has 10 samples and y has 5"),
        (dict(validation_data=(x,)), r"validation_data must be \(x_val, y_val\)"),
        (dict(validation_data=(x[:16, :5], y[:16])),
         r"validation_data's x has samples of shape \(5,\); the training data's are \(8,\)"),
        (dict(validation_data=(x, y), validation_batch_size=0),
         "validation_batch_size must be an int >= 1"),
        (dict(callbacks=ipu_jax.keras.callbacks.History()), "callbacks must be a list"),
    ]
    for kwargs, message in cases:
      with self.assertRaisesRegex(ValueError, message):
        fit(**kwargs)
    with self.assertRaisesRegex(ValueError, "fit: the dataset is empty"):
      model.fit(iter([]), steps_per_epoch=4, verbose=0)
    self.assertEqual(model.executions, 0)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, model.get_weights()), before)
    for run in (lambda **kw: model.evaluate(x, y, verbose=0, **kw),
                lambda **kw: model.predict(x, verbose=0, **kw)):
      with self.assertRaisesRegex(ValueError, "steps must be an int >= 1"):
        run(steps=0)
    with self.assertRaisesRegex(ValueError, "x has no samples"):
      model.evaluate(x[:0], y[:0], verbose=0)
    with self.assertRaisesRegex(ValueError, "x has no samples"):
      model.predict(x[:0], verbose=0)

  def test_options_and_weights_of_the_wrong_kind_are_named(self):
    x, y = toy_data(64)
    model = compiled_model(small_config())
    # "no" used to read as True (emulate, recomputation); the others failed inside.
    with self.assertRaisesRegex(TypeError, "emulate must be True or False; got 'no'"):
      model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", emulate="no")
    with self.assertRaisesRegex(TypeError, r"unknown option\(s\) \['foo'\]; the options are"):
      model.set_pipelining_options(foo=1)
    with self.assertRaisesRegex(ValueError, "recomputation must be True or False; got 'no'"):
      model.set_pipelining_options(recomputation="no")
    with self.assertRaisesRegex(ValueError, r"set_weights takes what get_weights gives: .* "
                                            r"got \['foo'\]"):
      model.set_weights({"foo": 1})
    with self.assertRaisesRegex(ValueError, "epochs must be an int; got '2'"):
      model.fit(x, y, batch_size=16, epochs="2", verbose=0)
    with self.assertRaisesRegex(ValueError, "verbose must be 'auto', 0, 1 or 2; got 'x'"):
      model.fit(x, y, batch_size=16, verbose="x")
    self.assertEqual(model.executions, 0)

  def test_left_out_samples_warning_points_at_the_fit_call(self):
    x, y = toy_data(50)
    model = compiled_model(small_config(), steps_per_execution=4)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    left_out = [w for w in caught if "left out of every epoch" in str(w.message)]
    self.assertLen(left_out, 1)
    self.assertEqual(left_out[0].filename, __file__)  # the user's line, not the library's


# ---------------------------------------------------------------------------
# Nothing lost: weights and checkpoints.
# ---------------------------------------------------------------------------


class InterruptTraining(Exception):
  pass


class KillAt(callbacks_lib.Callback):
  """Raises in the middle of an epoch, as a killed process would stop."""

  def __init__(self, epoch, execution):
    super().__init__()
    self.epoch, self.execution, self.count = epoch, execution, 0
    self.current = 0

  def on_epoch_begin(self, epoch, logs=None):
    self.current, self.count = epoch, 0

  def on_train_batch_end(self, batch, logs=None):
    self.count += 1
    if self.current == self.epoch and self.count == self.execution:
      raise InterruptTraining()


class CheckpointTest(absltest.TestCase):

  def _model(self):
    return compiled_model(small_config(), steps_per_execution=2, dropout=0.25)

  def test_killed_fit_resumes_to_the_same_weights(self):
    x, y = toy_data(64)
    directory = self.create_tempdir().full_path
    pattern = os.path.join(directory, "ckpt-{epoch:02d}.msgpack")

    uninterrupted = self._model()
    uninterrupted.fit(x, y, batch_size=8, epochs=3, verbose=0)

    first = self._model()
    checkpoint = ipu_jax.keras.ModelCheckpoint(pattern)
    with self.assertRaises(InterruptTraining):
      first.fit(x, y, batch_size=8, epochs=3, verbose=0,
                callbacks=[checkpoint, KillAt(epoch=1, execution=3)])
    self.assertEqual(sorted(os.listdir(directory)), ["ckpt-01.msgpack"])  # no temp files

    path = ipu_jax.keras.latest_checkpoint(directory)
    resumed = self._model()
    epoch = resumed.load_weights(path)
    self.assertEqual(epoch, 1)
    resumed.fit(x, y, batch_size=8, epochs=3, initial_epoch=epoch, verbose=0)
    assert_params_close(resumed.params, uninterrupted.params, rtol=1e-6)
    self.assertEqual(resumed.step, uninterrupted.step)

  def test_save_and_load_weights(self):
    x, y = toy_data(64)
    model = self._model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = os.path.join(self.create_tempdir().full_path, "w.msgpack")
    model.save_weights(path)
    other = self._model()
    self.assertIsNone(other.load_weights(path))
    assert_params_close(other.params, model.params, rtol=0)
    self.assertEqual(other.step, 0)  # weights only: the optimizer starts afresh
    # The user's NNX module holds the loaded weights too.
    np.testing.assert_array_equal(np.asarray(other.module.l1.kernel[...]),
                                  np.asarray(model.params["l1"]["kernel"][...]))
    with self.assertRaisesRegex(ValueError, "shape"):
      ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), hidden=5)).load_weights(path)


# ---------------------------------------------------------------------------
# fit / evaluate / predict and the rest of the API.
# ---------------------------------------------------------------------------


class ApiTest(absltest.TestCase):

  def test_evaluate_and_predict_cover_every_sample(self):
    x, y = toy_data(100)  # not a multiple of batch x steps: the last execution is padded
    model = compiled_model(small_config(), steps_per_execution=2)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    predictions = model.predict(x, batch_size=8)
    self.assertEqual(predictions.shape, (100, 4))
    np.testing.assert_allclose(predictions, np.asarray(model(x)), rtol=RTOL, atol=1e-6)
    result = model.evaluate(x, y, batch_size=8, verbose=0)
    self.assertAlmostEqual(result["accuracy"], float(np.mean(predictions.argmax(1) == y)),
                           places=6)
    loss = optax.softmax_cross_entropy_with_integer_labels(predictions, y).mean()
    self.assertAlmostEqual(result["loss"], float(loss), places=4)
    self.assertEqual(set(result), {"loss", "accuracy"})

  def test_iterable_of_batches_equals_arrays(self):
    x, y = toy_data(64)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]
    a = compiled_model(small_config(), steps_per_execution=4)
    a.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    b = compiled_model(small_config(), steps_per_execution=4)
    history = b.fit(batches, epochs=2, verbose=0, validation_data=(x, y))
    assert_params_close(b.params, a.params, rtol=1e-6)
    self.assertIn("val_accuracy", history.history)
    self.assertLen(history.history["val_loss"], 2)

  def test_progress_bar_and_summary(self):
    x, y = toy_data(64)
    model = compiled_model(small_config(), steps_per_execution=4)
    stream = io.StringIO()
    stop = ipu_jax.keras.LambdaCallback(
        on_epoch_end=lambda epoch, logs: setattr(model, "stop_training", epoch == 1))
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[ipu_jax.keras.ProgbarLogger(verbose=2, stream=stream), stop])
    text = stream.getvalue()
    self.assertIn("Epoch 1/3", text)
    self.assertIn("Epoch 2/3", text)
    self.assertNotIn("Epoch 3/3", text)  # stop_training ends fit after epoch 2
    self.assertEqual(history.epoch, [0, 1])
    self.assertEqual(history.executions_per_epoch, [2, 2])
    self.assertIn("8/8 [", text)
    self.assertRegex(text, r"samples/s emulated")
    self.assertRegex(text, r"loss: \d+\.\d+ - accuracy: \d+\.\d+")
    self.assertRegex(text, r"\d+\.\d+s host")
    summary = model.summary(print_fn=None)
    self.assertIn("l1/kernel", summary)
    self.assertIn("Trainable params: 212", summary)
    self.assertIn("16 tiles", summary)

  def test_linen_module_with_dropout_matches_plain_jax(self):

    class LinenMLP(linen.Module):
      @linen.compact
      def __call__(self, x, train: bool = False):
        x = jnp.tanh(linen.Dense(16)(x))
        x = linen.Dropout(0.2, deterministic=not train)(x)
        return linen.Dense(4)(x)

    x, y = toy_data(64)
    results = []
    for emulate in (True, False):
      with IPUStrategy(small_config()).scope():
        model = ipu_jax.keras.Model(LinenMLP(), input_shape=(1, 8), seed=3)
        model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy",
                      metrics=["accuracy"], steps_per_execution=2, emulate=emulate)
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
      results.append(model)
    self.assertTrue(results[0]._adapter.needs_rng)
    assert_params_close(results[0].params, results[1].params)
    self.assertIsNotNone(results[0].report)
    self.assertIsNone(results[1].report)
    # Inference is deterministic (dropout off).
    np.testing.assert_allclose(results[0].predict(x[:16], batch_size=8),
                               results[0].predict(x[:16], batch_size=8))

  def test_nnx_batchnorm_state_is_trained(self):

    class BNNet(nnx.Module):
      def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

      def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))

    x, y = toy_data(64)
    module = BNNet(nnx.Rngs(0))
    with IPUStrategy(small_config()).scope():
      model = ipu_jax.keras.Model(module)
      model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy",
                    metrics=["accuracy"], steps_per_execution=2)
      model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    mean = np.asarray(module.bn.mean[...])
    self.assertGreater(np.abs(mean).max(), 0)  # the running mean moved, in the user's module
    np.testing.assert_allclose(model.predict(x[:16], batch_size=8),
                               np.asarray(model(x[:16])),
                               rtol=RTOL, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
