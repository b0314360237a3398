"""Costs where the user's code is: a Keras-like fit's scopes, sources and tensor names.

The report groups cycles by module path (``lowering/scopes.py``). A ``fit``
adds a loss, its gradient, metrics and an optimizer update around the model
(``ipu_jax/keras/scopes.py``); these tests check that each carries its own
scope, that the operations ``fit`` wrote point at the loss and optimizer code
rather than at the ``fit`` line, and that the program's arguments are named by
the user's pytree paths.
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax.argument_names import argument_names
from ipu_jax.keras import scopes as keras_scopes
from ipu_jax.lowering import scopes
from ipu_jax.lowering.scopes import NO_SCOPE
from ipu_jax.strategy import IPUStrategy
import testing_utils

_THIS_FILE = os.path.abspath(__file__)


def _fit(accumulation=1, optimizer=None, tiles=16):
  """The train report of a 16-tile fit of the two-layer MLP (called from this file)."""
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 8)).astype(np.float32)
  y = rng.integers(0, 4, 64).astype(np.int32)
  with IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0)))
    if accumulation > 1:
      model.set_gradient_accumulation_options(
          gradient_accumulation_steps_per_replica=accumulation)
    model.compile(optimizer=optimizer or optax.adam(1e-3),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  steps_per_execution=4)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  return model.reports["train"]


class FitScopesTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.reports = {g: _fit(accumulation=g) for g in (1, 2)}

  @parameterized.parameters(1, 2)
  def test_most_cycles_carry_a_scope(self, accumulation):
    report = self.reports[accumulation]
    rows = {r.scope: r for r in report.by_scope(depth=0)}
    unscoped = rows[NO_SCOPE].cycle_share if NO_SCOPE in rows else 0.0
    self.assertLess(unscoped, 0.10, sorted(rows))
    for scope in ("loss", "loss/grad", "metrics", "TwoLayerMLP/first", "TwoLayerMLP/second"):
      self.assertIn(scope, rows)
    self.assertTrue(any(s.startswith("optimizer/") for s in rows), sorted(rows))
    if accumulation > 1:
      self.assertIn("gradient_accumulation", rows)

  @parameterized.parameters(1, 2)
  def test_loss_and_optimizer_point_at_their_code(self, accumulation):
    report = self.reports[accumulation]
    steps = report.profile.steps
    loss_sources = {s.source for s in steps if s.scope.startswith("loss")}
    optimizer_sources = {s.source for s in steps if s.scope.startswith("optimizer")}
    self.assertTrue(loss_sources and optimizer_sources)
    # Not the model.fit line of this file, which every operation fit wrote had.
    self.assertFalse([s for s in loss_sources | optimizer_sources if s.startswith(_THIS_FILE)])
    self.assertTrue(any(os.path.join("ipu_jax", "keras", "losses.py") in s
                        for s in loss_sources), loss_sources)
    self.assertTrue(all(os.sep + "optax" + os.sep in s or os.path.join("ipu_jax", "keras") in s
                        for s in optimizer_sources), optimizer_sources)
    # The model's own operations still point at the model's lines.
    layer_sources = {s.source for s in steps if s.scope.startswith("TwoLayerMLP/")}
    self.assertTrue(any("testing_utils.py" in s for s in layer_sources), layer_sources)

  def test_tensors_named_by_pytree_path(self):
    report = self.reports[1]
    names = {t.name for t in report.profile.tensors}
    for name in ("params/first/kernel", "params/second/bias", "opt_state/mu/first/kernel",
                 "opt_state/nu/second/kernel", "step", "xs", "ys"):
      self.assertIn(name, names)
    self.assertFalse([n for n in names if n.startswith("args[")])

  def test_saved_report_keeps_the_scopes(self):
    report = self.reports[1]
    saved = ipu_jax.report.SavedReport(report.to_dict())
    self.assertEqual([r.as_dict() for r in saved.by_scope(0)],
                     [r.as_dict() for r in report.by_scope(0)])
    self.assertEqual([r.as_dict() for r in report.by_scope(2)],
                     [r.as_dict() for r in scopes.by_scope(report.profile, 2)])


class MainJobTest(parameterized.TestCase):
  """The README's main job (``python -m experiments.mnist``), one epoch on the full ipu2."""

  def test_main_job_fit_costs_carry_scopes(self):
    from experiments import common, mnist
    directory = self.create_tempdir().full_path
    settings = common.Settings(epochs=1, learning_rate=3e-3, batch_size=32, verbose=0,
                               report_dir=directory)
    mnist.run(settings)
    report = ipu_jax.report.load_report(directory)
    rows = {r.scope: r for r in report.by_scope(depth=0)}
    self.assertGreaterEqual(1.0 - rows[NO_SCOPE].cycle_share, 0.9, sorted(rows))
    operations = report.cycles_by_operation()
    fit_file = os.path.join("experiments", "common.py")
    for row in operations:
      scope = row["scope"]
      if scope.startswith(("loss", "optimizer")):
        self.assertNotIn(fit_file, row["source"], row)
    self.assertTrue(any(r["scope"].startswith("optimizer") for r in operations))


class ModulePathTest(parameterized.TestCase):

  def _paths(self, fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [(e.primitive.name, scopes.module_path(e.source_info.name_stack))
            for e in jaxpr.jaxpr.eqns]

  @parameterized.parameters("loss", "loss/cross_entropy")
  def test_backward_pass_of_the_loss_is_loss_grad(self, loss_scope):
    def objective(w, x):
      with jax.named_scope("Model"), jax.named_scope("dense"):
        y = jnp.tanh(x @ w)
      with jax.named_scope(loss_scope):
        return jnp.mean(y ** 2)

    paths = self._paths(jax.grad(objective), jnp.ones((3, 2)), jnp.ones((5, 3)))
    found = {p for _, p in paths}
    grad_scope = "loss/grad" + loss_scope[len("loss"):]
    self.assertIn(loss_scope, found)
    self.assertIn(grad_scope, found)
    # A layer's backward pass counts with its forward pass.
    self.assertIn("Model/dense", found)
    self.assertFalse([p for p in found if p.startswith("Model/") and "grad" in p])
    # the loss's own forward equations are not "grad"
    self.assertIn(("integer_pow", loss_scope), paths)

  def test_other_scopes_keep_their_path_in_the_backward_pass(self):
    def objective(w):
      with jax.named_scope("lossy"):
        return jnp.sum(jnp.sin(w))

    found = {p for _, p in self._paths(jax.grad(objective), jnp.ones(3))}
    self.assertEqual(found, {"lossy"})


class ScopedOptimizerTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("adam", lambda: optax.adam(1e-2), {"scale_by_adam", "scale"}),
      ("sgd_momentum", lambda: optax.sgd(0.1, momentum=0.9), {"trace", "scale"}),
      ("clipped_adamw", lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
       {"clip_by_global_norm", "scale_by_adam", "add_decayed_weights",
        "scale"}),
      ("injected", lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
       {"inject_hyperparams"}),
  )
  def test_same_numbers_and_one_scope_per_transform(self, make, names):
    tx = make()
    params = {"w": testing_utils.random_array((5, 3), seed=1),
              "b": testing_utils.random_array((3,), seed=2)}
    grads = jax.tree.map(lambda p: p * 0.5 - 0.1, params)
    state = tx.init(params)
    scoped = keras_scopes.scoped_optimizer(tx)
    for _ in range(2):  # a second update reads the state the first wrote
      want, want_state = jax.jit(tx.update)(grads, state, params)
      got, got_state = jax.jit(scoped.update)(grads, state, params)
      chex.assert_trees_all_close(np.asarray(got["w"]), np.asarray(want["w"]), rtol=1e-6)
      chex.assert_trees_all_close(got, want, rtol=1e-6)
      chex.assert_trees_all_close(got_state, want_state, rtol=1e-6)
      state = want_state
    jaxpr = jax.make_jaxpr(scoped.update)(grads, state, params)
    found = {scopes.module_path(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns} - {""}
    self.assertEqual(found, names)


class ArgumentNamesTest(parameterized.TestCase):

  def _names(self, args, kwargs=None, positional=()):
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path((args, kwargs or {}))[0]]
    return argument_names(paths, positional)

  def test_parameter_names_and_dict_paths(self):
    params = {"dense": {"kernel": 1.0, "bias": 2.0}}
    opt_state = (optax.ScaleByAdamState(count=0, mu=params, nu=params), optax.EmptyState())
    names = self._names((params, opt_state, 3.0), {"lr": 0.1},
                        positional=("params", "opt_state", None))
    self.assertEqual(names, [
        "params/dense/bias", "params/dense/kernel", "opt_state/count",
        "opt_state/mu/dense/bias", "opt_state/mu/dense/kernel", "opt_state/nu/dense/bias",
        "opt_state/nu/dense/kernel", "args[2]", "lr"])

  def test_indices_kept_where_names_would_collide(self):
    names = self._names(([{"kernel": 1.0}, {"kernel": 2.0}],), positional=("layers",))
    self.assertEqual(names, ["layers/0/kernel", "layers/1/kernel"])

  def test_each_leaf_keeps_indices_only_where_needed(self):
    names = self._names((({"w": 1.0}, {"opt_state": ({"mu": 2.0},)}), [3.0, 4.0]),
                        positional=("state", "others"))
    self.assertEqual(names, ["state/w", "state/opt_state/mu", "others/0", "others/1"])

  def test_nnx_variable_value_dropped(self):
    state = nnx.state(testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0)))
    names = self._names((state,), positional=("params",))
    self.assertIn("params/first/kernel", names)
    self.assertEqual(len(set(names)), len(names))

  def test_jit_names_tensors_by_parameter(self):
    def step(params, batch):
      return jnp.sum(batch["x"] @ params["w"])

    lowered = ipu_jax.jit(step, target=testing_utils.T16).lower(
        {"w": jnp.ones((4, 3))}, {"x": jnp.ones((2, 4))})
    names = {t.name for t in lowered.profile.tensors if t.category == "variables"}
    self.assertLessEqual({"params/w", "batch/x"}, names)
    self.assertEqual(float(np.asarray(lowered({"w": jnp.ones((4, 3))},
                                              {"x": jnp.ones((2, 4))}))), 24.0)


if __name__ == "__main__":
  absltest.main()
