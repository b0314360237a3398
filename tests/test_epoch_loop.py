"""Plain and pipelined ``fit`` run one epoch loop; the stages' optimizer
states live in the ``TrainState`` and checkpoint with it."""

import os
import tempfile

from absl.testing import absltest
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.keras import Model, callbacks as callbacks_lib
from ipu_jax.keras import train_state as train_state_lib

_STAGES = {"second": 1}


class _Net(nnx.Module):
  """Two linear layers (stages 0 and 1 when pipelined), dropout between."""

  def __init__(self, *, rngs):
    self.first = nnx.Linear(6, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.second = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.second(self.drop(jnp.tanh(self.first(x))))


class _Recorder(callbacks_lib.Callback):
  """Every hook fit calls: its name, its step or epoch and its logs' keys."""

  def __init__(self):
    super().__init__()
    self.events = []

  def _record(self, name, index=None, logs=None):
    keys = sorted(k for k in (logs or {}) if not k.startswith(("host_", "emulated_")))
    self.events.append((name, index, keys))

  def on_train_begin(self, logs=None): self._record("train_begin", None, logs)
  def on_train_end(self, logs=None): self._record("train_end", None, logs)
  def on_epoch_begin(self, epoch, logs=None): self._record("epoch_begin", epoch, logs)
  def on_epoch_end(self, epoch, logs=None): self._record("epoch_end", epoch, logs)
  def on_train_batch_begin(self, batch, logs=None): self._record("batch_begin", batch, logs)
  def on_train_batch_end(self, batch, logs=None): self._record("batch_end", batch, logs)
  def on_test_begin(self, logs=None): self._record("test_begin", None, logs)
  def on_test_end(self, logs=None): self._record("test_end", None, logs)
  def on_test_batch_begin(self, batch, logs=None): self._record("test_batch_begin", batch, logs)
  def on_test_batch_end(self, batch, logs=None): self._record("test_batch_end", batch, logs)


def _data(n=48):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(n, 6)).astype(np.float32),
          rng.integers(0, 3, size=n).astype(np.int32))


def _model(pipelined: bool, g=4) -> Model:
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.auto_select_ipus = 2 if pipelined else 1
  model = Model(_Net(rngs=nnx.Rngs(params=0, dropout=1)), config=cfg)
  model.compile(optax.adam(1e-2), "sparse_categorical_crossentropy", metrics=["accuracy"],
                steps_per_execution=2 * g)
  if pipelined:
    model.set_pipelining_options(gradient_accumulation_steps_per_replica=g)
    model.set_pipeline_stage_assignment(_STAGES)
  else:
    model.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=g)
  return model


class EpochLoopTest(chex.TestCase):

  def test_plain_and_pipelined_fit_call_the_same_hooks_in_the_same_order(self):
    x, y = _data()
    events, executions, histories = {}, {}, {}
    for pipelined in (False, True):
      recorder, model = _Recorder(), _model(pipelined)
      history = model.fit(x, y, batch_size=2, epochs=2, verbose=0, callbacks=[recorder],
                          validation_data=(x[:10], y[:10]))
      events[pipelined], executions[pipelined] = recorder.events, model.executions
      histories[pipelined] = history.history
    self.assertEqual(events[True], events[False])
    names = [e[0] for e in events[False]]
    # 48 samples / (S=8 steps x 2 samples) = 3 executions an epoch, then validation
    # (10 samples: 1 padded execution) before the epoch ends.
    epoch = (["epoch_begin"] + ["batch_begin", "batch_end"] * 3
             + ["test_begin", "test_batch_begin", "test_batch_end", "test_end", "epoch_end"])
    self.assertEqual(names, ["train_begin"] + epoch * 2 + ["train_end"])
    self.assertEqual([e[1] for e in events[False] if e[0] == "batch_end"], [7, 15, 23] * 2)
    self.assertEqual(events[False][-2][2], ["accuracy", "loss", "val_accuracy", "val_loss"])
    # Both count their executions (one per batch hook pair).
    self.assertEqual(executions, {False: 6, True: 6})
    for key, values in histories[False].items():
      np.testing.assert_allclose(histories[True][key], values, rtol=1e-5, err_msg=key)

  def test_pipelined_checkpoint_restores_the_stages_optimizer_state_bit_exactly(self):
    x, y = _data()
    with tempfile.TemporaryDirectory() as directory:
      checkpoint = callbacks_lib.ModelCheckpoint(os.path.join(directory, "ckpt-{epoch}.msgpack"),
                                                 monitor="loss")
      trained = _model(True)
      trained.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[checkpoint])
      state = trained.train_state
      # The stages' optimizer states are the training state's (one per stage).
      self.assertIsInstance(state.opt_state, list)
      self.assertLen(state.opt_state, 2)
      self.assertEqual(state.opt_layout, train_state_lib.STAGE_OPTIMIZERS)
      restored = _model(True)
      self.assertEqual(restored.load_weights(checkpoint.last_saved), 1)
      # One more execution (two weight updates) both ways: the same state, bit for bit.
      for model in (trained, restored):
        model.fit(x, y, batch_size=2, epochs=2, initial_epoch=1, steps_per_epoch=8,
                  verbose=0, shuffle=False)
    self.assertEqual(restored.step, trained.step)
    self.assertEqual(trained.step, 3 * 2 + 2)
    chex.assert_trees_all_equal(restored.train_state.opt_state, trained.train_state.opt_state)
    chex.assert_trees_all_equal(restored.params, trained.params)
    # Restored, not started afresh: Adam's moments carry the first epoch.
    self.assertEqual(int(np.asarray(restored.train_state.opt_state[1][0].count)), 8)


if __name__ == "__main__":
  absltest.main()
