"""Keras-on-IPU style training of Flax modules on the emulated IPU.

::

    with ipu_jax.IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(module)
      model.compile(optimizer=optax.adam(1e-3), loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], steps_per_execution=8)
      model.fit(x, y, batch_size=32, epochs=3)

See :mod:`ipu_jax.keras.model` for the semantics of steps per execution,
gradient accumulation and replication.
"""

from ipu_jax.keras import accumulation, callbacks, losses, metrics, replication
from ipu_jax.keras.callbacks import (Callback, EarlyStopping, History, LambdaCallback,
                                     ModelCheckpoint, TerminateOnNaN, latest_checkpoint)
from ipu_jax.keras.loss_scaling import LossScaleOptimizer
from ipu_jax.keras.model import Model, check_steps_per_execution
from ipu_jax.keras.progress import ProgbarLogger
from ipu_jax.keras.replication import Replication, initialize_distributed
from ipu_jax.keras.train_state import TrainState

__all__ = [
    "Model", "Callback", "History", "ModelCheckpoint", "LambdaCallback", "EarlyStopping",
    "TerminateOnNaN", "ProgbarLogger", "Replication", "latest_checkpoint",
    "initialize_distributed", "check_steps_per_execution", "accumulation", "callbacks",
    "losses", "metrics", "replication", "LossScaleOptimizer", "TrainState",
]
