"""ipu_jax.keras.TrainState: the Keras-like layer's training state, by name."""

import ast
import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax.keras import pipelining as keras_pipelining
from ipu_jax.keras.replication import REPLICATED, SHARDED, Replication
from ipu_jax.keras.train_state import FIELDS, INFERENCE_FIELDS, TRAINED_FIELDS, TrainState
import testing_utils


def _state(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w": jnp.asarray(rng.normal(size=(3, 5)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32)}
  opt = optax.adam(1e-2)
  return opt, TrainState(params=params, opt_state=opt.init(params), state={},
                         rng_state={}, step=jnp.zeros((), jnp.int32),
                         dropout_key=jax.random.key(0))


class TrainStateTest(chex.TestCase):

  def test_placement_is_per_field(self):
    self.assertEqual(TrainState.placements(), dict.fromkeys(FIELDS, REPLICATED))
    sharded = TrainState.placements(sharded_optimizer_state=True)
    self.assertEqual(sharded.pop("opt_state"), SHARDED)
    self.assertEqual(set(sharded.values()), {REPLICATED})
    self.assertEqual(TRAINED_FIELDS, ("params", "opt_state", "state", "step"))
    self.assertEqual(INFERENCE_FIELDS, ("params", "state", "rng_state"))

  def test_apply_gradients_is_one_optax_update(self):
    opt, ts = _state()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), ts.params)
    new = ts.apply_gradients(grads, opt, state={"seen": jnp.ones(())})
    updates, opt_state = opt.update(grads, ts.opt_state, ts.params)
    chex.assert_trees_all_close(new.params, optax.apply_updates(ts.params, updates))
    chex.assert_trees_all_close(new.opt_state, opt_state)
    self.assertEqual(int(new.step), 1)
    self.assertEqual(float(new.state["seen"]), 1.0)
    self.assertIs(new.dropout_key, ts.dropout_key)  # read-only fields pass through

  def test_only_and_merge_carry_the_trained_fields(self):
    _, ts = _state()
    trained = ts.only(TRAINED_FIELDS)
    self.assertIsNone(trained.rng_state)
    self.assertIsNone(trained.dropout_key)
    # The loop carries exactly the trained fields' leaves, in field order.
    self.assertLen(jax.tree.leaves(trained),
                   sum(len(jax.tree.leaves(getattr(ts, f))) for f in TRAINED_FIELDS))
    changed = trained.replace(step=trained.step + 3)
    merged = ts.merge(changed)
    self.assertEqual(int(merged.step), 3)
    self.assertIs(merged.dropout_key, ts.dropout_key)

  def test_place_shards_only_a_sharded_field(self):
    _, ts = _state()
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), ts.opt_state)
    placed = ts.replace(opt_state=stacked).place(Replication(1), sharded_optimizer_state=True)
    chex.assert_trees_all_equal(placed.opt_state, stacked)
    chex.assert_trees_all_equal(placed.params, ts.params)


class ModelTrainStateTest(chex.TestCase):

  def _model(self):
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    model = ipu_jax.keras.Model(testing_utils.TwoLayerMLP((4, 6, 3), rngs=nnx.Rngs(0)),
                                config=cfg)
    model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy")
    return model

  def test_assigning_the_state_writes_the_module(self):
    model = self._model()
    ts = model.train_state
    doubled = jax.tree.map(lambda p: p * 2, ts.params)
    model.train_state = ts.replace(params=doubled, step=7)
    self.assertEqual(model.step, 7)
    chex.assert_trees_all_close(nnx.state(model.module, nnx.Param), doubled)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(np.asarray(model(x)), np.asarray(model.module(x)), rtol=1e-6)
    with self.assertRaisesRegex(TypeError, "train_state must be"):
      model.train_state = {"params": doubled}

  def test_pipelined_fit_uses_no_private_attribute_of_the_model(self):
    tree = ast.parse(inspect.getsource(keras_pipelining))
    private = sorted({node.attr for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                      and node.value.id == "model" and node.attr.startswith("_")})
    self.assertEqual(private, [])


if __name__ == "__main__":
  absltest.main()
