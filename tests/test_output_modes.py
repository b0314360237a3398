"""Output modes: which of an on-device loop's results return to the host, and their bytes."""

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax.strategy import IPUStrategy
from testing_utils import random_array


def _config(mode="all", period=1, tiles=32, io=0):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.io_tiles.num_io_tiles = io
  cfg.outputs.mode = mode
  cfg.outputs.return_period = period
  return cfg


def loop(w, xs):
  def body(c, x):
    y = jnp.tanh(x @ w)
    return c + jnp.sum(y), y
  return jax.lax.scan(body, jnp.zeros(()), xs)


def _expected(ys, mode, period):
  ys = np.asarray(ys)
  return {"all": ys, "final": ys[-1], "sum": ys.sum(0),
          "every_n": ys[period - 1::period]}[mode]


class Tiny(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)


class OutputModesTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(("all", 1, 0), ("final", 1, 0), ("sum", 1, 4), ("every_n", 2, 0),
                            ("every_n", 3, 4))
  def test_jit_loop_outputs_follow_mode(self, mode, period, io):
    w, xs = random_array((7, 5), seed=1) * 0.3, random_array((6, 9, 7), seed=2)
    fn = ipu_jax.jit(loop, config=_config(mode, period, io=io))
    carry, ys = fn(w, xs)
    want_carry, want_ys = jax.jit(loop)(w, xs)
    chex.assert_trees_all_close(np.asarray(carry), want_carry, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(np.asarray(ys), _expected(want_ys, mode, period),
                                rtol=1e-5, atol=1e-5)
    # The host receives only what the mode keeps.
    host = fn.lower(w, xs).report.host_io
    self.assertEqual(host["output_mode"], mode)
    self.assertEqual(host["host_bytes_out"], np.asarray(ys).nbytes)
    self.assertEqual(host["host_bytes_in"], xs.nbytes)

  def test_all_is_the_default_and_counts_every_step(self):
    w, xs = random_array((7, 5), seed=1), random_array((6, 9, 7), seed=2)
    all_bytes = ipu_jax.jit(loop, config=_config()).lower(w, xs).report.host_io
    final = ipu_jax.jit(loop, config=_config("final")).lower(w, xs).report.host_io
    self.assertEqual(all_bytes["host_bytes_out"], 6 * final["host_bytes_out"])
    self.assertEqual(ipu_jax.IPUConfig().outputs.mode, "all")

  def test_unknown_mode_lists_the_valid_ones(self):
    cfg = ipu_jax.IPUConfig()
    with self.assertRaisesRegex(ValueError, "outputs.mode must be one of 'all', 'final', "
                                "'sum', 'every_n'; got 'last'"):
      cfg.outputs.mode = "last"
    with self.assertRaisesRegex(ValueError, "outputs.return_period must be an int >= 1"):
      cfg.outputs.return_period = 0

  def test_period_must_divide_the_loop(self):
    w, xs = random_array((7, 5), seed=1), random_array((6, 9, 7), seed=2)
    with self.assertRaisesRegex(ValueError, "outputs.return_period=4 must divide the loop's 6"):
      ipu_jax.jit(loop, config=_config("every_n", 4)).lower(w, xs)

  def test_mode_without_a_loop_is_refused(self):
    with self.assertRaisesRegex(ValueError, "outputs.mode='final'.*no"):
      ipu_jax.jit(lambda x: x + 1, config=_config("final")).lower(np.ones(3, np.float32))

  @parameterized.parameters(("all", 1), ("final", 1), ("sum", 1), ("every_n", 2))
  def test_predict_follows_mode(self, mode, period):
    x = random_array((32, 6), seed=3)
    with IPUStrategy(_config(mode, period, tiles=16)).scope():
      model = ipu_jax.keras.Model(Tiny(nnx.Rngs(0)))
      model.compile(optimizer=optax.sgd(0.1), loss="mse", steps_per_execution=4)
      got = model.predict(x, batch_size=4)
    module = Tiny(nnx.Rngs(0))
    per_step = np.asarray(jax.jit(lambda v: module(v))(x)).reshape(2, 4, 4, 3)
    want = np.concatenate([_expected(e, mode, period).reshape(-1, 3) for e in per_step])
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    self.assertEqual(model.reports["predict"].host_io["host_bytes_out"],
                     _expected(per_step[0], mode, period).nbytes)


  def _model(self, mode, period=1, steps=4):
    with IPUStrategy(_config(mode, period, tiles=16)).scope():
      model = ipu_jax.keras.Model(Tiny(nnx.Rngs(0)))
      model.compile(optimizer=optax.sgd(0.1), loss="mse", steps_per_execution=steps)
    return model

  def test_fit_modes_leave_training_unchanged(self):
    x, y = random_array((32, 6), seed=3), random_array((32, 3), seed=4)
    fits = {}
    for mode, period in (("all", 1), ("sum", 1), ("final", 1), ("every_n", 4), ("every_n", 2)):
      model = self._model(mode, period)
      history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
      fits[mode, period] = (history.history["loss"][0], jax.tree.map(np.asarray, model.params),
                            model.train_report.host_io["host_bytes_out"])
    for key, (_, params, _) in fits.items():  # the weights never depend on the mode
      chex.assert_trees_all_close(params, fits["all", 1][1], rtol=0, atol=0)
    np.testing.assert_allclose(fits["sum", 1][0], fits["all", 1][0], rtol=1e-6)
    # every 4th of 4 updates is the final one; the last update's loss is not the mean.
    self.assertEqual(fits["final", 1][0], fits["every_n", 4][0])
    self.assertNotAlmostEqual(fits["final", 1][0], fits["all", 1][0], places=4)
    k_bytes = fits["final", 1][2]
    self.assertEqual(fits["all", 1][2], 4 * k_bytes)
    self.assertEqual(fits["every_n", 2][2], 2 * k_bytes)
    self.assertEqual(fits["sum", 1][2], k_bytes)

  @parameterized.parameters("all", "sum", "final")
  def test_evaluate_follows_mode(self, mode):
    x, y = random_array((32, 6), seed=3), random_array((32, 3), seed=4)
    result = self._model(mode).evaluate(x, y, batch_size=4, verbose=0)
    module = Tiny(nnx.Rngs(0))
    per_sample = np.mean((np.asarray(module(x)) - y) ** 2, axis=1)
    # Two executions of 4 steps of 4 samples; 'final' returns each one's last step.
    chosen = (per_sample if mode != "final"
              else np.concatenate([per_sample[12:16], per_sample[28:32]]))
    np.testing.assert_allclose(result["loss"], chosen.mean(), rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
