"""Loss scaling: static and dynamic (Keras LossScaleOptimizer semantics), and
its scale / skipped steps / overflows in the Keras-like model's logs."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest
from flax import nnx

import ipu_jax
from ipu_jax.keras import LossScaleOptimizer
from ipu_jax.strategy import IPUStrategy
import testing_utils


class OptimizerTest(chex.TestCase):

  def test_dynamic_scale_skips_overflow_halves_and_grows(self):
    opt = LossScaleOptimizer(optax.sgd(1.0), 8.0, dynamic=True, growth_steps=2)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    bad = {"w": jnp.asarray([1.0, jnp.inf, 0.0])}
    updates, state = opt.update(bad, state, params)
    np.testing.assert_array_equal(updates["w"], 0.0)   # skipped
    self.assertEqual(float(state.loss_scale), 4.0)
    self.assertEqual((int(state.skipped_steps), int(state.overflows)), (1, 1))
    good = {"w": jnp.asarray([4.0, 8.0, -4.0])}        # scaled by 4
    updates, state = opt.update(good, state, params)
    np.testing.assert_array_equal(updates["w"], [-1.0, -2.0, 1.0])  # unscaled
    self.assertEqual(float(state.loss_scale), 4.0)
    _, state = opt.update(good, state, params)
    self.assertEqual(float(state.loss_scale), 8.0)      # 2 finite steps: grows

  def test_static_scale_never_changes(self):
    opt = LossScaleOptimizer(optax.sgd(1.0), 16.0, dynamic=False)
    state = opt.init({"w": jnp.ones(2)})
    _, state = opt.update({"w": jnp.asarray([jnp.nan, 1.0])}, state)
    self.assertEqual(float(state.loss_scale), 16.0)
    self.assertEqual(int(state.skipped_steps), 1)

  def test_bad_arguments(self):
    with self.assertRaisesRegex(ValueError, "loss_scaling_factor must be a positive"):
      LossScaleOptimizer(optax.sgd(1.0), 0.0)
    with self.assertRaisesRegex(ValueError, "growth_steps must be an int >= 1"):
      LossScaleOptimizer(optax.sgd(1.0), growth_steps=0)


class ModelTest(chex.TestCase):

  @pytest.mark.slow  # one Keras training compile (~30 s on 2 shared cores)
  def test_scaled_training_matches_unscaled_reference_and_logs(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = rng.integers(0, 4, size=64).astype(np.int32)
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    with IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0)))
      model.compile(optimizer=LossScaleOptimizer(optax.sgd(0.1), 1024.0, dynamic=True),
                    loss="sparse_categorical_crossentropy", steps_per_execution=4)
    logs = []
    cb = ipu_jax.keras.LambdaCallback(on_train_batch_end=lambda b, l: logs.append(dict(l)))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False, callbacks=[cb])
    self.assertEqual(logs[-1]["loss_scale"], 1024.0)
    self.assertEqual((logs[-1]["skipped_steps"], logs[-1]["overflows"]), (0, 0))

    # Plain optax SGD on the unscaled loss: a power-of-two scale is exact.
    graphdef, params = nnx.split(testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0)), nnx.Param)

    @jax.jit
    def step(p, xb, yb):
      def loss(p):
        logits = nnx.merge(graphdef, p)(xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
      return jax.tree.map(lambda w, g: w - 0.1 * g, p, jax.grad(loss)(p))

    for i in range(4):
      params = step(params, x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
    got = jax.tree.leaves(model.get_weights())
    want = jax.tree.leaves(nnx.to_pure_dict(params))
    chex.assert_trees_all_close(sorted(got, key=np.size), sorted(want, key=np.size),
                                rtol=1e-5, atol=1e-7)


if __name__ == "__main__":
  absltest.main()
