"""The training layer as a new user meets it (issue 17).

Label mistakes are caught before training, data comes as Keras accepts it,
reports name layers and say which program and run setup they describe, and
the package's documented submodules are reachable as attributes. 16-tile
targets and a tiny MLP keep every case fast.
"""

import os
import stat
import sys
import tempfile
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
from ipu_jax.lowering.scopes import by_scope, costliest_scopes_table
from ipu_jax.strategy import IPUStrategy


def small_config(tiles=16):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  return cfg


class TinyMLP(nnx.Module):

  def __init__(self, rngs, features=6, hidden=8, classes=4):
    self.hidden = nnx.Linear(features, hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


def data(n=64, features=6, classes=4, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, features)).astype(np.float32)
  y = rng.integers(0, classes, n).astype(np.int32)
  return x, y


def compiled_model(loss="sparse_categorical_crossentropy", steps_per_execution=2):
  with IPUStrategy(small_config()).scope():
    model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0)), seed=0)
    model.compile(optimizer=optax.sgd(0.1), loss=loss, metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
  return model


class LabelChecksTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("one_hot_for_sparse", "sparse_categorical_crossentropy",
       lambda y: np.eye(4, dtype=np.float32)[y], r"shape \[64, 4\].*one-hot"),
      ("label_too_large", "sparse_categorical_crossentropy",
       lambda y: np.where(np.arange(y.size) == 5, 4, y), r"\[0, 3\].*\[0, 4\].*1 of 64"),
      ("minus_one", "sparse_categorical_crossentropy",
       lambda y: np.where(np.arange(y.size) < 3, -1, y), r"\[-1, 3\].*3 of 64"),
      ("fractional", "sparse_categorical_crossentropy",
       lambda y: y.astype(np.float32) + 0.5, "fractional"),
      ("sparse_for_categorical", "categorical_crossentropy",
       lambda y: y, r"class indices.*sparse_categorical_crossentropy"),
      ("not_one_hot", "categorical_crossentropy",
       lambda y: 3.0 * np.eye(4, dtype=np.float32)[y], r"in \[0, 1\]"),
      ("mse_wrong_width", "mse", lambda y: np.zeros((y.size, 3), np.float32),
       r"\[batch, 4\].*\[64, 3\]"),
  )
  def test_fit_and_evaluate_refuse_bad_labels(self, loss, make_labels, message):
    x, y = data()
    bad = make_labels(y)
    model = compiled_model(loss)
    before = jax.tree.map(np.asarray, model.get_weights())
    with self.assertRaisesRegex(ValueError, message):
      model.fit(x, bad, batch_size=8, epochs=1, verbose=0)
    with self.assertRaisesRegex(ValueError, message):
      model.evaluate(x, bad, batch_size=8, verbose=0)
    self.assertEqual(model.executions, 0)  # refused before the first step
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, model.get_weights()), before)

  def test_iterable_batches_are_checked(self):
    x, y = data()
    model = compiled_model()
    batches = [(x[i:i + 8], y[i:i + 8] + 4) for i in range(0, 64, 8)]
    with self.assertRaisesRegex(ValueError, r"\[0, 3\]"):
      model.fit(batches, epochs=1, verbose=0)

  def test_validation_data_is_checked(self):
    x, y = data()
    model = compiled_model()
    with self.assertRaisesRegex(ValueError, r"\[0, 3\]"):
      model.fit(x, y, batch_size=8, epochs=1, verbose=0, validation_data=(x, y + 10))

  def test_good_labels_pass_and_validate_inputs_false_skips(self):
    x, y = data()
    model = compiled_model()
    model.fit(x, y[:, None], batch_size=8, epochs=1, verbose=0)  # [b, 1] labels are fine
    model.fit(x, y + 4, batch_size=8, epochs=1, verbose=0, validate_inputs=False)
    self.assertEqual(model.executions, 8)
    model.evaluate(x, y + 4, batch_size=8, verbose=0, validate_inputs=False)


class DataFormsTest(chex.TestCase, parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    x, y = data(n=32)
    cls.expected_loss = compiled_model().fit(
        x, y, batch_size=8, epochs=1, verbose=0, shuffle=False).history["loss"]

  @parameterized.named_parameters(
      ("lists", lambda a: a.tolist()),
      ("tuples", lambda a: tuple(map(tuple, a.tolist())) if a.ndim > 1 else tuple(a.tolist())),
      ("jax_arrays", jnp.asarray),
  )
  def test_fit_evaluate_predict_accept(self, convert):
    x, y = data(n=32)
    model = compiled_model()
    history = model.fit(convert(x), convert(y), batch_size=8, epochs=1, verbose=0,
                        shuffle=False)
    chex.assert_trees_all_close(history.history["loss"], self.expected_loss, rtol=1e-6)
    self.assertIn("loss", model.evaluate(convert(x), convert(y), batch_size=8, verbose=0))
    self.assertEqual(model.predict(convert(x), batch_size=8).shape, (32, 4))

  def test_generator_of_batches(self):
    x, y = data(n=32)
    model = compiled_model()
    model.fit((b for b in [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]),
              steps_per_epoch=4, epochs=1, verbose=0)
    self.assertEqual(model.executions, 2)

  def test_left_over_samples_warn_with_the_count(self):
    x, y = data(n=50)  # 3 executions of 2 x 8 = 48 samples; 2 left over
    model = compiled_model()
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "left out" in str(w.message)]
    self.assertLen(messages, 1)  # once per fit, not per epoch
    self.assertIn("2 of 50 samples", messages[0])
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      model.fit(x[:48], y[:48], batch_size=8, epochs=1, verbose=0)
    self.assertFalse([w for w in caught if "left out" in str(w.message)])


class CheckpointModeTest(absltest.TestCase):

  def test_weights_file_mode_follows_umask(self):
    model = compiled_model()
    with tempfile.TemporaryDirectory() as directory:
      for mask in (0o022, 0o077):
        old = os.umask(mask)
        try:
          path = model.save_weights(os.path.join(directory, f"w{mask}.msgpack"))
        finally:
          os.umask(old)
        self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o666 & ~mask)


class ReportsTest(chex.TestCase):

  def test_a_report_per_program_with_its_run_setup(self):
    x, y = data()
    model = compiled_model()
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=2)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, validation_data=(x[:16], y[:16]))
    model.predict(x[:8], batch_size=4)
    self.assertEqual(set(model.reports), {"train", "eval", "predict"})
    self.assertIs(model.report, model.reports["train"])  # not the last (predict) one
    self.assertEqual(model.reports["train"].name, "train_step")
    self.assertEqual(model.reports["eval"].name, "eval_step")
    setup = model.reports["train"].profile.run_setup
    self.assertEqual((setup.program, setup.target, setup.tiles_per_ipu, setup.replicas),
                     ("train", "ipu2", 16, 1))
    self.assertEqual((setup.gradient_accumulation_steps, setup.steps_per_execution,
                      setup.micro_batch, setup.global_batch,
                      setup.weight_updates_per_execution), (2, 2, 4, 8, 1))
    self.assertEqual(setup.param_dtypes, ("float32",))
    text = "\n".join(setup.summary_lines())
    self.assertIn("global batch 8", text)
    self.assertEqual(setup.as_dict()["matmul_partials_type"], "float32")
    eval_setup = model.reports["eval"].profile.run_setup
    self.assertEqual((eval_setup.program, eval_setup.gradient_accumulation_steps,
                      eval_setup.micro_batch), ("eval", 1, 4))
    # What a user reads: the summary and report.json say how it was run.
    summary = model.reports["train"].summary()
    # First the headline (the step with its host I/O), then the run setup.
    self.assertTrue(summary.startswith("Step (host I/O included): "), summary[:200])
    self.assertTrue(summary.split("\n\n", 1)[1].startswith("Run setup:\n  Program: train step"),
                    summary[:300])
    directory = self.create_tempdir().full_path
    model.reports["train"].save(directory, plots=False, html=False)
    saved = ipu_jax.load_report(directory)
    self.assertEqual(saved.document["run_setup"]["global_batch"], 8)
    self.assertIn("global batch 8", saved.summary())  # as the live summary prints it

  def test_training_report_groups_by_nnx_module_path(self):
    x, y = data()
    model = compiled_model()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    profile = model.reports["train"].profile
    rows = {r.scope: r for r in by_scope(profile, depth=2)}
    self.assertIn("TinyMLP/hidden", rows)
    self.assertIn("TinyMLP/out", rows)
    # Forward and backward matmuls both belong to the layer.
    self.assertGreater(rows["TinyMLP/hidden"].steps, 1)
    self.assertAlmostEqual(sum(r.cycles for r in rows.values()), profile.total_cycles,
                           delta=1e-6 * profile.total_cycles)
    dot_steps = [s for s in profile.steps if s.op == "dot_general"]
    self.assertTrue(dot_steps)
    for step in dot_steps:
      self.assertTrue(step.scope.startswith("TinyMLP/"), step.scope)
      self.assertNotIn("flax", step.source)  # source lines skip library frames
    table = costliest_scopes_table(profile, depth=2, top=5)
    self.assertIn("by cycles", table)
    self.assertIn("TinyMLP/hidden", table)
    report = model.reports["train"]
    self.assertEqual([r.scope for r in report.by_scope(2)], [r.scope for r in by_scope(profile, 2)])
    self.assertIn("Costliest module paths (depth 2)", report.summary())

  def test_named_scopes_and_linen_paths_in_plain_jit(self):
    class Block(linen.Module):
      @linen.compact
      def __call__(self, x):
        return linen.Dense(5)(linen.Dense(7)(x))

    params = Block().init(jax.random.key(0), jnp.ones((3, 4)))

    def fn(params, x):
      with jax.named_scope("outer"):
        y = Block().apply(params, x)
      return jax.lax.fori_loop(0, 2, lambda i, v: jnp.sin(v), y)

    lowered = ipu_jax.jit(fn, config=small_config()).lower(params, jnp.ones((3, 4)))
    scopes = {s.scope for s in lowered.profile.steps}
    self.assertIn("outer/Block/Dense_0", scopes)
    self.assertIn("outer/Block/Dense_1", scopes)
    tensors = {t.scope for t in lowered.profile.tensors}
    self.assertIn("outer/Block/Dense_0", tensors)
    depth1 = {r.scope for r in by_scope(lowered.profile, depth=1)}
    self.assertIn("outer", depth1)
    with self.assertRaisesRegex(TypeError, "depth"):
      by_scope(lowered.profile, depth="2")


def _nbytes(tree) -> int:
  return sum(np.size(leaf) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
             if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key))


class FitMemoryTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(("steps", 1), ("accumulation", 2))
  def test_carried_variables_are_counted_once(self, accumulation):
    x, y = data()
    with IPUStrategy(small_config()).scope():
      model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), features=6, hidden=64), seed=0)
      model.compile(optimizer=optax.adam(1e-3), loss="sparse_categorical_crossentropy",
                    steps_per_execution=4)
      model.set_gradient_accumulation_options(
          gradient_accumulation_steps_per_replica=accumulation)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    profile = model.reports["train"].profile
    memory = profile.memory
    weights = _nbytes(model.params) + _nbytes(model.opt_state)
    batches = 4 * 8 * (6 * 4 + 4)  # S micro-batches of b samples: x float32[6], y int32
    scalars = 4 + 2 * 4 + 4  # step counter, dropout key data, replica id
    # Always live: exactly the weights, optimizer state and this execution's inputs.
    self.assertEqual(int(memory.by_category["variables"].sum()), weights + batches + scalars)
    # No second copy of a weight carried through the on-device loops: the only
    # weight-shaped loop carries are the gradient accumulators (G > 1).
    param_shapes = [tuple(np.shape(v)) for v in jax.tree.leaves(model.params)]
    carried = [tuple(t.shape) for t in profile.tensors
               if t.name == "scan/carry" and tuple(t.shape) in param_shapes]
    self.assertCountEqual(carried, param_shapes if accumulation > 1 else [])
    # What is not always live is one step's needs (gradients, updates, activations,
    # the accumulator): at most a few times the weights, whatever S and G are.
    self.assertLess(float(memory.not_always_live.sum()), 6 * weights + 4 * batches)


class SubmodulesTest(absltest.TestCase):

  def test_documented_submodules_are_attributes(self):
    import subprocess
    code = ("import ipu_jax; "
            "print(ipu_jax.graph.Graph, ipu_jax.poplibs, ipu_jax.keras.Model, "
            "ipu_jax.lowering.registry, ipu_jax.kernels, ipu_jax.report.Report, "
            "ipu_jax.strategy.IPUStrategy, ipu_jax.target.IPUTarget, ipu_jax.ops.matmul, "
            "ipu_jax.nnx_jit)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    self.assertEqual(result.returncode, 0, result.stderr)


if __name__ == "__main__":
  absltest.main()
