"""``ipu_jax.keras.Model``: Keras-on-IPU style training of Flax modules.

::

    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    with ipu_jax.IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(MyNNXModule(rngs=nnx.Rngs(0)))
      model.compile(optimizer=optax.adam(1e-3),
                    loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], steps_per_execution=8)
      model.set_gradient_accumulation_options(
          gradient_accumulation_steps_per_replica=2, reduction_method="mean")
      history = model.fit(x, y, batch_size=32, epochs=3)
    print(model.report.summary())          # the training program's report
    model.reports["eval"]                  # one per compiled program: train, eval, predict

Before the first step ``fit`` and ``evaluate`` check the labels against the
loss and the model's output (``validate_inputs=False`` skips it); data may be
arrays, pytrees of arrays, Python lists, JAX arrays or an iterable of batches.

What one call of the device does (docs/training.md#what-one-call-of-the-device-does):

* ``batch_size`` is the micro-batch of one replica.
* ``steps_per_execution`` S counts micro-batch steps over all replicas: one
  execution of the tile program runs S steps, S / R on each of the R
  replicas, as an on-device loop (``lax.scan`` lowered to ``Repeat``), and is
  one host round trip. Callbacks and the progress bar see the host side once
  per execution.
* Every G micro-batches of a replica (gradient accumulation) the gradients
  are reduced (sum, mean or running mean), combined over the replicas by the
  cross-replica all-reduce (sum or mean, ``training.replica_reduction``),
  and the optimizer updates once: S / (G R) weight updates per execution,
  each from R G ``batch_size`` samples. S must be a multiple of G R.
* The samples of one update are consecutive in the (shuffled) data, so with
  mean reductions R replicas x G micro-batches of b samples train exactly as
  one replica with batch R G b does.

This module is the public face only (its length is mostly the docstrings of
the Keras API): the training state is one named pytree
(:class:`~ipu_jax.keras.train_state.TrainState`, each field's replica
placement in its metadata), the per-replica programs are built in
:mod:`~ipu_jax.keras.programs` and cached, placed and run by
:mod:`~ipu_jax.keras.plain_trainer`; ``fit``, ``evaluate`` and ``predict``
run the one host loop of :mod:`~ipu_jax.keras.epoch_loop` (plain or
pipelined, :mod:`~ipu_jax.keras.pipelining`: only what one execution does
differs); the data layouts and ``fit``'s plan (``FitPlan``) live in
:mod:`~ipu_jax.keras.loop`, the weights file in :mod:`~ipu_jax.keras.weights`
and the summary table in :mod:`~ipu_jax.keras.summary`. The pipelined trainer
uses the public training-loop interface: ``train_state`` (read and assign),
``adapter``, ``pipelining_options``, ``compiled``, ``record_number_formats``,
``pop_saved_stage_optimizers`` and ``reports``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.arguments import check_optimizer
from ipu_jax import config as config_lib
from ipu_jax.report.precision import NumberFormatTelemetry
from ipu_jax.keras import accumulation as acc_lib
from ipu_jax.keras import callbacks as callbacks_lib
from ipu_jax.keras import epoch_loop
from ipu_jax.keras import losses as losses_lib
from ipu_jax.keras import metrics as metrics_lib
from ipu_jax.keras import offload as offload_lib
from ipu_jax.keras import plain_trainer
from ipu_jax.keras import telemetry as telemetry_lib
from ipu_jax.keras.adapters import make_adapter
from ipu_jax.keras.loop import check_steps_per_execution
from ipu_jax.keras.replication import Replication
from ipu_jax.keras.summary import summary_text
from ipu_jax.keras.train_state import MODEL_OPTIMIZER, STAGE_OPTIMIZERS, TrainState
from ipu_jax.keras import weights as weights_lib
from ipu_jax.keras.weights import (flat_saveable, read_weights_file, restore_flat,
                                   restore_nested, to_saveable, write_weights_file)

__all__ = ["Model", "check_steps_per_execution"]

NOT_COMPILED = "call model.compile(optimizer=..., loss=...) first."


def _active_config():
  """The config of the innermost strategy scope / default_config, or None."""
  return config_lib.active_config()


class Model:
  """A Flax module trained the way Keras on IPU trains.

  Args:
    module: a ``flax.nnx.Module`` (its variables are used and, after
      ``fit``, updated in place) or a ``flax.linen.Module``.
    sample_input: linen only: an example batch to initialise with.
    input_shape: linen only: the input shape (batch included), if no
      ``sample_input``; ``input_dtype`` its dtype.
    seed: seeds linen initialisation, dropout of linen modules and the
      shuffling of ``fit``; default: the config's ``random_seed``, else 0.
    config: an :class:`ipu_jax.IPUConfig`; default: the strategy scope's when
      ``compile`` is called, else the one active when the model was built,
      else a default config.
    name: a name for summaries.
    train_kwargs / eval_kwargs / init_kwargs / rng_collections: linen only,
      see :class:`~ipu_jax.keras.adapters.LinenAdapter`.
  """

  def __init__(self, module, *, sample_input=None, input_shape=None,
               input_dtype=jnp.float32, seed: Optional[int] = None, config=None,
               name: Optional[str] = None,
               train_kwargs=None, eval_kwargs=None, init_kwargs=None,
               rng_collections: Sequence[str] = ("dropout",)):
    if config is not None and not isinstance(config, config_lib.IPUConfig):
      raise TypeError(f"config must be an ipu_jax.IPUConfig; got {type(config).__name__}.")
    self._explicit_config = config
    self._config_at_init = _active_config()
    seed = config_lib.SEED_KIND.check("Model(seed=...)", seed)
    if seed is None:
      known = config or self._config_at_init
      seed = known.random_seed if known is not None and known.random_seed is not None else 0
    self.seed = int(seed)
    self._base_key = jax.random.key(self.seed)
    init_key, dropout_key = jax.random.split(self._base_key)
    self._adapter = make_adapter(module, sample_input=sample_input, input_shape=input_shape,
                                 input_dtype=input_dtype, key=init_key,
                                 train_kwargs=train_kwargs, eval_kwargs=eval_kwargs,
                                 init_kwargs=init_kwargs, rng_collections=rng_collections)
    self.module = module
    self.name = name or self._adapter.name
    # Every replica's training state, by name (the optimizer state comes at compile).
    self._train_state = TrainState(
        params=self._adapter.params, opt_state=None, state=self._adapter.state,
        rng_state=self._adapter.rng_state, step=jnp.zeros((), jnp.int32),
        dropout_key=dropout_key)
    self._pending_optimizer = None
    self._compiled = False
    self._accumulation_steps: Optional[int] = None
    self._accumulation_reduction: Optional[str] = None
    # set_pipelining_options: the pipelining options (None: not pipelined).
    self._pipelining: Optional[dict] = None
    # The compiled train / eval / predict executions (plain_trainer.Programs).
    self._programs = plain_trainer.Programs(self)
    self.config: Optional[config_lib.IPUConfig] = None
    self.optimizer = None
    self.loss = None
    self.metrics: list = []
    self.steps_per_execution = 1
    self.emulate = True
    self.stop_training = False
    self.history: Optional[callbacks_lib.History] = None
    self.reports: dict = {}
    # Loss-scale and FP8-scale histories of fit, shared by every train report.
    self.number_formats = NumberFormatTelemetry()
    self.checkpoint_epoch: Optional[int] = None
    self.executions = 0
    self._replication: Optional[Replication] = None
    # The Pipeline of the last pipelined fit (keras/pipelining.py sets it); its
    # stages' optimizer states are the training state's opt_state.
    self.pipeline = None

  # -- reports --------------------------------------------------------------------

  @property
  def report(self):
    """The training program's report once ``fit`` compiled it, else the last one's.

    ``reports`` holds one per compiled program: ``"train"``, ``"eval"``,
    ``"predict"``; each profile's ``run_setup`` says how it runs.
    """
    if "train" in self.reports:
      return self.reports["train"]
    return self.reports.get(self._programs.last_program)

  @property
  def train_report(self):
    """The training program's report (``None`` before ``fit``)."""
    return self.reports.get("train")

  def record_number_formats(self, logs: dict, report):
    """After an execution: the loss scale and FP8 layers' scales into the train report.

    One record per execution (the scale inside the on-device loop is not
    seen by the host), at the weight-update count so far. Restoring an
    earlier step (``load_weights``) starts a new history.

    Args:
      logs: the execution's logs (``loss_scale``, ``skipped_steps``,
        ``overflows`` with loss scaling).
      report: the train program's report (None when not emulating); the
        pipelined ``fit`` passes its step's report.
    """
    self.number_formats = telemetry_lib.record_number_formats(
        self.number_formats, lambda: self.step, self.state, logs, report)

  # -- configuration --------------------------------------------------------------

  def compile(self, optimizer, loss, metrics: Optional[Sequence] = None,
              steps_per_execution: int = 1, *, emulate: bool = True):
    """Sets the optimizer, loss, metrics and on-device loop length.

    Args:
      optimizer: an optax ``GradientTransformation``.
      loss: a name (see :mod:`ipu_jax.keras.losses`) or ``loss(y_true, y_pred)``.
      metrics: names or callables, e.g. ``["accuracy"]``.
      steps_per_execution: S, micro-batch steps (over all replicas) per
        execution of the tile program; a multiple of G x R.
      emulate: run on the emulated IPU (default). ``False`` runs the same
        training loop with plain ``jax.jit`` (no report), for comparison.

    Raises:
      ValueError: an unknown loss or metric, a bad target, or S not a
        multiple of G x R -- all before anything is traced.
    """
    check_optimizer(optimizer)
    if not isinstance(emulate, bool):  # "no" would read as True
      raise TypeError(f"compile: emulate must be True or False; got {emulate!r}.")
    loss_fn = losses_lib.get(loss)
    metric_fns = [metrics_lib.get(m, loss_fn) for m in (metrics or [])]
    names = [m.name for m in metric_fns]
    if len(set(names)) != len(names) or "loss" in names:
      raise ValueError(f"metric names must be unique and not 'loss'; got {names}.")
    cfg = (self._explicit_config or _active_config() or self._config_at_init
           or config_lib.IPUConfig())
    cfg = cfg.copy()
    cfg.to_target()  # a bad target raises ValueError now
    replication = Replication(cfg.replication_factor)
    steps_acc = (self._accumulation_steps if self._accumulation_steps is not None
                 else cfg.training.gradient_accumulation_steps)
    check_steps_per_execution(steps_per_execution, steps_acc, replication.num_replicas)
    self.config = cfg
    self.optimizer = optimizer
    self.loss = loss_fn
    self.metrics = metric_fns
    self.steps_per_execution = int(steps_per_execution)
    self.emulate = bool(emulate)
    self._replication = replication
    self._programs.reset()
    # (Re)compiling resets it; sharded over replicas with replicated tensor sharding.
    self._train_state = self._train_state.replace(
        opt_state=offload_lib.init_optimizer_state(optimizer, self.params, cfg, replication),
        step=jnp.zeros((), jnp.int32), opt_layout=MODEL_OPTIMIZER)
    self.number_formats = NumberFormatTelemetry()
    self._compiled = True
    if self._pending_optimizer is not None:  # loaded before compile (or stage states)
      self._restore_optimizer(self._pending_optimizer)
    return self

  def set_gradient_accumulation_options(self, gradient_accumulation_steps_per_replica=None,
                                        reduction_method=None, **kwargs):
    """Accumulates the gradients of G micro-batches before each update.

    Args:
      gradient_accumulation_steps_per_replica: G (>= 1); default: the
        config's ``training.gradient_accumulation_steps``.
      reduction_method: ``"sum"`` (default, as Keras on IPU), ``"mean"`` (what
        ``optax.MultiSteps`` gives) or ``"running_mean"``; default: the
        config's ``training.gradient_accumulation_reduction``.

    Raises:
      ValueError: G < 1, an unknown method, or (after ``compile``) a
        steps_per_execution that is not a multiple of G x R.
    """
    if kwargs:
      raise TypeError(f"set_gradient_accumulation_options got unknown options "
                      f"{sorted(kwargs)}; it takes gradient_accumulation_steps_per_replica "
                      "and reduction_method.")
    if gradient_accumulation_steps_per_replica is not None:
      g = gradient_accumulation_steps_per_replica
      if isinstance(g, bool) or not isinstance(g, (int, np.integer)) or g < 1:
        raise ValueError("gradient_accumulation_steps_per_replica must be an int >= 1; "
                         f"got {g!r}.")
      if self._compiled:
        check_steps_per_execution(self.steps_per_execution, int(g),
                                  self._replication.num_replicas)
      self._accumulation_steps = int(g)
    if reduction_method is not None:
      self._accumulation_reduction = acc_lib.check_reduction(reduction_method)
    self._programs.reset()

  @property
  def gradient_accumulation_steps(self) -> int:
    if self._accumulation_steps is not None:
      return self._accumulation_steps
    cfg = self.config or self._explicit_config or config_lib.IPUConfig()
    return cfg.training.gradient_accumulation_steps

  @property
  def gradient_accumulation_reduction(self) -> str:
    if self._accumulation_reduction is not None:
      return self._accumulation_reduction
    cfg = self.config or self._explicit_config or config_lib.IPUConfig()
    return cfg.training.gradient_accumulation_reduction

  @property
  def replica_reduction(self) -> str:
    return (self.config or config_lib.IPUConfig()).training.replica_reduction

  @property
  def num_replicas(self) -> int:
    """Replicas in the whole run (all processes)."""
    return self._replication.num_replicas if self._replication else 1

  @property
  def replication(self) -> Optional[Replication]:
    return self._replication

  @property
  def compiled(self) -> bool:
    """Whether ``compile`` was called (as Keras's ``Model.compiled``)."""
    return self._compiled

  def _require_compiled(self):
    if not self._compiled:
      raise RuntimeError(NOT_COMPILED)

  # -- variables ----------------------------------------------------------------

  def _local(self, tree):
    if self._replication is None:
      return tree
    return self._replication.local(tree)

  @property
  def params(self):
    """The trained parameters (an ``nnx.State`` or a linen params dict)."""
    return self._local(self._train_state.params)

  @property
  def state(self):
    """Non-trainable variables (batch statistics, ...)."""
    return self._local(self._train_state.state)

  @property
  def opt_state(self):
    return self._local(self._train_state.opt_state)

  @property
  def step(self) -> int:
    """Weight updates made so far."""
    return int(np.asarray(self._local(self._train_state.step)))

  def get_weights(self) -> dict:
    """``{"params": ..., "state": ...}`` as nested dicts of NumPy arrays."""
    return {"params": to_saveable(self._adapter.to_pure(self.params)),
            "state": to_saveable(self._adapter.to_pure(self.state))}

  def set_weights(self, weights: dict):
    """Sets weights as :meth:`get_weights` gives them."""
    if not isinstance(weights, dict) or "params" not in weights:
      got = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
      raise ValueError(f"set_weights takes what get_weights gives: a dict with 'params' (and "
                       f"'state'); got {got}.")
    params_t = self._adapter.to_pure(self.params)
    state_t = self._adapter.to_pure(self.state)
    ts = self._train_state.replace(params=self._adapter.from_pure(self.params, restore_nested(
        params_t, weights["params"], "params")))
    if "state" in weights and jax.tree.leaves(state_t):
      ts = ts.replace(state=self._adapter.from_pure(self.state, restore_nested(
          state_t, weights["state"], "state")))
    self._train_state = ts
    self._sync_module()

  def _sync_module(self):
    self._adapter.sync(self.params, self.state, self._train_state.rng_state)

  # -- saving -------------------------------------------------------------------

  def save_weights(self, path: str, include_optimizer: bool = False,
                   epoch: Optional[int] = None) -> str:
    """Writes the weights (and optionally the optimizer) with Flax msgpack.

    The file is written to a temporary name and renamed over ``path``, so a
    crash never leaves a torn file. In a multi-process run only process 0
    writes.

    Args:
      path: the file.
      include_optimizer: also the optimizer state, step counter and random
        state, so training resumes exactly (what ``ModelCheckpoint`` does);
        after a pipelined ``fit``, the stages' optimizer states.
      epoch: epochs completed, stored for ``fit(..., initial_epoch=...)``.

    Returns:
      ``path``.
    """
    extra = {"rng_state": flat_saveable(self._local(self._train_state.rng_state))}
    if include_optimizer and self._compiled:
      extra["optimizer"] = weights_lib.optimizer_entry(
          self.opt_state, self._train_state.opt_layout == STAGE_OPTIMIZERS, self.step)
    return write_weights_file(path, self.get_weights(), epoch=epoch, extra=extra)

  def load_weights(self, path: str) -> Optional[int]:
    """Reads a file of :meth:`save_weights` (or ``ModelCheckpoint``).

    Restores the weights; when the file holds the optimizer state, that too
    (now if compiled, else at ``compile``; a pipelined fit's stage states
    when the next pipelined ``fit`` has split the model). Sets and returns
    ``checkpoint_epoch``, the epochs the checkpoint had completed (``None``
    if it does not say), the ``initial_epoch`` to resume ``fit`` from.
    """
    payload = read_weights_file(path)
    self.set_weights(payload)
    saved_rng = payload.get("rng_state") or {}
    if saved_rng and jax.tree.leaves(self._train_state.rng_state):
      self._train_state = self._train_state.replace(rng_state=restore_flat(
          self._local(self._train_state.rng_state), saved_rng, "rng_state"))
    if "optimizer" in payload:
      if self._compiled:
        self._restore_optimizer(payload["optimizer"])
      else:
        self._pending_optimizer = payload["optimizer"]
    epoch = int(payload.get("epoch", -1))
    self.checkpoint_epoch = None if epoch < 0 else epoch
    return self.checkpoint_epoch

  def _restore_optimizer(self, saved):
    """Restores the step and a whole-model optimizer state now; keeps the
    stages' states of a pipelined fit for its next split."""
    def template():  # a whole-model state to restore into (not the stages')
      if self._train_state.opt_layout == MODEL_OPTIMIZER:
        return self.opt_state
      return offload_lib.init_optimizer_state(self.optimizer, self.params, self.config,
                                              self._replication)

    self._train_state, stages = weights_lib.restore_optimizer(self._train_state, saved,
                                                              template)
    # Kept in the file's form, so a later compile keeps waiting for the split.
    self._pending_optimizer = (None if stages is None
                               else {weights_lib.STAGE_OPTIMIZERS_KEY: stages})

  def pop_saved_stage_optimizers(self) -> Optional[dict]:
    """A loaded checkpoint's pipeline-stage optimizer states (flat, by key path),
    once: the pipelined fit restores them when it has split the model."""
    pending, self._pending_optimizer = self._pending_optimizer, None
    return None if pending is None else pending.get(weights_lib.STAGE_OPTIMIZERS_KEY)

  # -- fit ------------------------------------------------------------------------------

  def set_pipelining_options(self, **options):
    """Train pipelined over IPUs (see :mod:`ipu_jax.keras.pipelining`).

    Options: ``schedule``, ``gradient_accumulation_steps_per_replica``,
    ``recomputation``, ``device_mapping``.
    """
    from ipu_jax.keras import pipelining
    unknown = sorted(set(options) - set(pipelining.PIPELINING_OPTIONS))
    if unknown:
      raise TypeError(f"set_pipelining_options: unknown option(s) {unknown}; the options are "
                      f"{list(pipelining.PIPELINING_OPTIONS)}.")
    self._pipelining = pipelining.merged_options(self._pipelining, **options)

  def set_pipeline_stage_assignment(self, assignment: dict):
    """Place layers on pipeline stages by module path (``{"layers_1": 1}``)."""
    from ipu_jax.keras import pipelining
    self._pipelining = pipelining.merged_assignment(self._pipelining, assignment)

  # -- what a trainer uses: plain_trainer.py and pipelining.py ----------------------
  #
  # A loop reads the compiled settings (config, optimizer, loss, metrics, seed,
  # the accumulation properties), the module adapter and the training state;
  # it writes back the new state (``train_state``), records number formats per
  # execution (``record_number_formats``) and puts its report in ``reports``.

  @property
  def pipelining_options(self) -> Optional[dict]:
    """The options of ``set_pipelining_options`` / ``set_pipeline_stage_assignment``
    (``None``: ``fit`` is not pipelined); a copy."""
    return None if self._pipelining is None else dict(self._pipelining)

  @property
  def adapter(self):
    """The module's adapter (:mod:`ipu_jax.keras.adapters`): ``apply``, ``needs_rng``, ..."""
    return self._adapter

  @property
  def train_state(self) -> TrainState:
    """The training state (:class:`~ipu_jax.keras.train_state.TrainState`), as
    arrays of this process; assigning one also writes it into the module."""
    return self._train_state.local(self._replication)

  @property
  def placed_train_state(self) -> TrainState:
    """The training state as the replicas hold it (on their devices, sharded
    fields sharded): what the compiled programs read and a trainer replaces
    after each execution. :attr:`train_state` is this process's view of it."""
    return self._train_state

  @placed_train_state.setter
  def placed_train_state(self, value: TrainState):
    self._train_state = value

  @train_state.setter
  def train_state(self, value: TrainState):
    if not isinstance(value, TrainState):
      raise TypeError(f"train_state must be an ipu_jax.keras.TrainState; got "
                      f"{type(value).__name__}.")
    self._train_state = value.replace(step=jnp.asarray(value.step, jnp.int32))
    self._sync_module()

  def fit(self, x=None, y=None, batch_size: Optional[int] = None, epochs: int = 1,
          verbose="auto", callbacks: Optional[Sequence] = None, validation_data=None,
          shuffle: bool = True, initial_epoch: int = 0,
          steps_per_epoch: Optional[int] = None, validation_batch_size: Optional[int] = None,
          validate_inputs: bool = True):
    """Trains for ``epochs`` epochs; returns a :class:`~ipu_jax.keras.callbacks.History`.

    Args:
      x, y: arrays (``x`` may be a pytree of arrays) with samples along the
        first axis; or ``x`` an iterable of ``(x, y)`` micro-batches (then
        ``y`` is None; pass ``steps_per_epoch`` for an endless iterator).
      batch_size: the micro-batch of each replica (default 32; for an
        iterable, the size of its batches).
      epochs: train until this epoch index.
      verbose: 0 silent, 1 progress bar, 2 one line per epoch.
      callbacks: :class:`~ipu_jax.keras.callbacks.Callback` instances; batch
        hooks fire once per execution.
      validation_data: ``(x_val, y_val)`` or an iterable of batches,
        evaluated after each epoch (``val_`` logs).
      shuffle: reshuffle array data each epoch (seeded by the model's seed
        and the epoch, so a resumed run sees the same order).
      initial_epoch: the epoch to start at, to resume from a checkpoint.
      steps_per_epoch: micro-batch steps (over all replicas) per epoch;
        default: all full micro-batches. Steps that do not fill a whole
        execution are left out (with a warning saying how many).
      validate_inputs: check the labels against the loss and the model's
        output on the host before the first step (for an iterable, its
        first batch); ``False`` skips the check.

    Raises:
      ValueError: S not a multiple of G x R, too little data, or labels that
        do not fit the loss (one-hot for a sparse loss, out of range) --
        before training starts.
    """
    self._require_compiled()
    if self._pipelining:
      from ipu_jax.keras import pipelining
      trainer = pipelining.trainer(self)
    else:
      trainer = plain_trainer.PlainTrainer(self, self._programs)
    return epoch_loop.fit(
        self, trainer, self._programs, x, y, epochs=epochs, callbacks=callbacks,
        initial_epoch=initial_epoch, verbose=_verbosity(verbose),
        batch_size=batch_size, shuffle=shuffle, steps_per_epoch=steps_per_epoch,
        validation_data=validation_data, validation_batch_size=validation_batch_size,
        validate_inputs=validate_inputs)

  def evaluate(self, x=None, y=None, batch_size: Optional[int] = None, verbose="auto",
               callbacks: Optional[Sequence] = None, steps: Optional[int] = None,
               return_dict: bool = True, validate_inputs: bool = True):
    """Loss and metrics over the data, as a dict (``return_dict=False``: a list).

    The last execution is padded with masked samples, so every sample counts
    exactly once. ``validate_inputs`` checks the labels against the loss and
    the model's output first (``ValueError``); ``False`` skips it.
    """
    self._require_compiled()
    verbose = _verbosity(verbose)
    self._programs.verbose = None if verbose else 0  # verbose=0 silences compile progress
    cb = callbacks_lib.CallbackList(callbacks or [], model=self)
    logs = epoch_loop.evaluate(self, self._programs, x, y, batch_size, cb, verbose, steps,
                               validate_inputs)
    return logs if return_dict else list(logs.values())

  def predict(self, x, batch_size: Optional[int] = None, verbose=0,
              callbacks: Optional[Sequence] = None, steps: Optional[int] = None) -> np.ndarray:
    """The model's outputs for every sample of ``x``, as NumPy."""
    self._require_compiled()
    cb = callbacks_lib.CallbackList(callbacks or [], model=self)
    return epoch_loop.predict(self, self._programs, x, batch_size, verbose, cb, steps)

  def __call__(self, x, training: bool = False):
    """The module applied to ``x`` with the current weights (plain JAX)."""
    y, _ = self._adapter.apply(self.params, self.state,
                               self._local(self._train_state.rng_state), x, training, None)
    return y

  # -- summary --------------------------------------------------------------------------

  def count_params(self) -> int:
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(self.params)))

  def summary(self, print_fn: Optional[Callable[[str], Any]] = print) -> str:
    """A table of the variables and the IPU settings; printed and returned."""
    cfg = self.config or self._explicit_config or _active_config() or self._config_at_init
    text = summary_text(
        f'Model: "{self.name}" ({self._adapter.kind})', self.params, self.state, config=cfg,
        replicas=self.num_replicas, accumulation_steps=self.gradient_accumulation_steps,
        accumulation_reduction=self.gradient_accumulation_reduction,
        steps_per_execution=self.steps_per_execution, report=self.report,
        replica_reduction=self.replica_reduction)
    if print_fn is not None:
      print_fn(text)
    return text


def _verbosity(verbose) -> int:
  """``verbose`` (``"auto"``, 0, 1 or 2) as 0, 1 or 2."""
  if verbose == "auto":
    return 1
  if isinstance(verbose, bool) or verbose not in (0, 1, 2):
    raise ValueError(f"verbose must be 'auto', 0, 1 or 2; got {verbose!r}.")
  return int(verbose)
