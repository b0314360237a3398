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
:mod:`~ipu_jax.keras.programs`, the host data loop, layouts and ``fit``'s plan
(``FitPlan``) live in :mod:`~ipu_jax.keras.loop`, the weights file in
:mod:`~ipu_jax.keras.weights` and the summary table in
:mod:`~ipu_jax.keras.summary`. A training loop other than ``fit`` (the
pipelined one, :mod:`~ipu_jax.keras.pipelining`) uses the public
training-loop interface: ``train_state`` (read and assign), ``adapter``,
``pipelining_options``, ``compiled``, ``record_number_formats`` and
``reports``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax import config as config_lib
from ipu_jax.fp8_scaling import FP8Stats, collect_telemetry
from ipu_jax.report.precision import NumberFormatTelemetry
from ipu_jax.lowering.host_io import select_outputs
from ipu_jax.keras import accumulation as acc_lib
from ipu_jax.keras import callbacks as callbacks_lib
from ipu_jax.keras import loop
from ipu_jax.keras import loss_scaling
from ipu_jax.keras import losses as losses_lib
from ipu_jax.keras import metrics as metrics_lib
from ipu_jax.keras import offload as offload_lib
from ipu_jax.keras import programs
from ipu_jax.keras.adapters import make_adapter
from ipu_jax.keras.data import ArrayData, as_arrays, is_array_like
from ipu_jax.keras.loop import check_steps_per_execution
from ipu_jax.keras.progress import ProgbarLogger
from ipu_jax.keras.replication import GATHERED, SUMMED, Replication
from ipu_jax.keras.summary import summary_text
from ipu_jax.keras.train_state import FIELDS, INFERENCE_FIELDS, TRAINED_FIELDS, TrainState
from ipu_jax.keras.validation import check_labels
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
    self._programs: dict = {}
    self._compile_verbose = None  # fit/evaluate(verbose=0) silence compile progress
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
    self._last_program: Optional[str] = None
    self.checkpoint_epoch: Optional[int] = None
    self.executions = 0
    self._replication: Optional[Replication] = None
    # The Pipeline of the last pipelined fit (keras/pipelining.py sets it), and
    # its stages' optimizer states, which the next pipelined fit continues.
    self.pipeline = None
    self.pipeline_opt_state = None
    # The stages' optimizer states of a loaded checkpoint (flat, by key path),
    # restored when the next pipelined fit has split the model.
    self.saved_pipeline_opt_state = None

  # -- reports --------------------------------------------------------------------

  @property
  def report(self):
    """The training program's report once ``fit`` compiled it, else the last one's.

    ``reports`` holds one per compiled program: ``"train"``, ``"eval"``,
    ``"predict"``; each profile's ``run_setup`` says how it runs.
    """
    if "train" in self.reports:
      return self.reports["train"]
    return self.reports.get(self._last_program)

  @property
  def train_report(self):
    """The training program's report (``None`` before ``fit``)."""
    return self.reports.get("train")

  def _run_setup(self, program: str, micro_batch: int):
    return programs.run_setup(
        program, self._lowering_config(), self.params, micro_batch=micro_batch,
        replicas=self.num_replicas, accumulation_steps=self.gradient_accumulation_steps,
        accumulation_reduction=self.gradient_accumulation_reduction,
        replica_reduction=self.replica_reduction,
        steps_per_execution=self.steps_per_execution)

  def _record_report(self, program: str, lowered, micro_batch: int):
    self._last_program = program
    if lowered is None:
      return
    if lowered.profile.run_setup is None:
      lowered.profile.run_setup = self._run_setup(program, micro_batch)
    self.reports[program] = lowered.report

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
    fp8 = {}
    if any(isinstance(leaf, FP8Stats) for leaf in jax.tree.leaves(
        self.state, is_leaf=lambda x: isinstance(x, FP8Stats))):
      fp8 = collect_telemetry(self.state)
    if "loss_scale" not in logs and not fp8:
      return
    step, telemetry = self.step, self.number_formats
    if telemetry.last_step is not None and step <= telemetry.last_step:
      telemetry = self.number_formats = NumberFormatTelemetry()
    if "loss_scale" in logs:
      telemetry.record_loss_scale(step, logs["loss_scale"], logs["skipped_steps"],
                                  logs["overflows"])
    if fp8:
      telemetry.record_fp8(step, fp8)
    if report is not None:
      report.number_formats = telemetry

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
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
      raise TypeError("optimizer must be an optax GradientTransformation (e.g. "
                      f"optax.adam(1e-3)); got {optimizer!r}.")
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
    self._programs = {}
    # (Re)compiling resets it; sharded over replicas with replicated tensor sharding.
    self._train_state = self._train_state.replace(
        opt_state=offload_lib.init_optimizer_state(optimizer, self.params, cfg, replication),
        step=jnp.zeros((), jnp.int32))
    self.pipeline_opt_state = None
    self.number_formats = NumberFormatTelemetry()
    self._compiled = True
    if self._pending_optimizer is not None:
      self._restore_optimizer(self._pending_optimizer)
      self._pending_optimizer = None
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
    self._programs = {}

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
        state, so training resumes exactly (what ``ModelCheckpoint`` does).
      epoch: epochs completed, stored for ``fit(..., initial_epoch=...)``.

    Returns:
      ``path``.
    """
    extra = {"rng_state": flat_saveable(self._local(self._train_state.rng_state))}
    if include_optimizer and self._compiled:
      extra["optimizer"] = {
          "opt_state": flat_saveable(self.opt_state),
          "step": np.asarray(self.step, np.int64),
      }
      if self.pipeline_opt_state is not None:
        # A pipelined fit trains its stages' own optimizer states, not opt_state.
        extra["optimizer"]["pipeline_opt_state"] = flat_saveable(self.pipeline_opt_state)
    return write_weights_file(path, self.get_weights(), epoch=epoch, extra=extra)

  def load_weights(self, path: str) -> Optional[int]:
    """Reads a file of :meth:`save_weights` (or ``ModelCheckpoint``).

    Restores the weights; when the file holds the optimizer state, that too
    (now if compiled, else at ``compile``). Sets and returns
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
    self._train_state = self._train_state.replace(
        opt_state=restore_flat(self.opt_state, saved["opt_state"], "opt_state"),
        step=jnp.asarray(int(np.asarray(saved["step"])), jnp.int32))
    # The stages' states are laid out when a pipelined fit splits the model;
    # it restores them then (ipu_jax/keras/pipelining.py).
    self.saved_pipeline_opt_state = saved.get("pipeline_opt_state")

  # -- the programs -------------------------------------------------------------------

  def _lowering_config(self):
    cfg = self.config.copy()
    cfg.replication_factor = self.num_replicas  # the all-reduce spans every replica
    return cfg

  def _shards_optimizer_state(self) -> bool:
    return offload_lib.shards_state(self.config, self.num_replicas)

  def _program(self, key, execution, data, **fields) -> programs.StateProgram:
    """The compiled execution of the training state and ``data``, built once per key."""
    if key not in self._programs:
      self._programs[key] = programs.build_state_program(
          execution, self._train_state, data,
          sharded_optimizer_state=self._shards_optimizer_state(),
          replication=self._replication, config=self._lowering_config(),
          emulate=self.emulate, verbose=self._compile_verbose, **fields)
    return self._programs[key]

  def _train_program(self, xs, ys) -> programs.StateProgram:
    """The program of one training execution (U updates of G micro-batches)."""
    G, R = self.gradient_accumulation_steps, self.num_replicas
    method = self.gradient_accumulation_reduction
    key = ("train", G, method, R, programs.shape_key((xs, ys)))
    execution = programs.train_execution(programs.TrainStep(
        self._adapter, self.optimizer, self.loss, self.metrics, G, method, R,
        self.replica_reduction, sharded_state=self._shards_optimizer_state()))
    return self._program(key, execution, [xs, ys, self._replication.replica_ids],
                         in_fields=FIELDS, out_fields=TRAINED_FIELDS, result_kind=SUMMED)

  def _eval_program(self, xs, ys, mask) -> programs.StateProgram:
    key = ("eval", self.num_replicas, programs.shape_key((xs, ys, mask)))
    execution = programs.eval_execution(self._adapter, self.loss, self.metrics)
    return self._program(key, execution, [xs, ys, mask], in_fields=INFERENCE_FIELDS,
                         out_fields=(), result_kind=SUMMED)

  def _predict_program(self, xs) -> programs.StateProgram:
    key = ("predict", self.num_replicas, programs.shape_key(xs))
    execution = programs.predict_execution(self._adapter)
    return self._program(key, execution, [xs], in_fields=INFERENCE_FIELDS, out_fields=(),
                         result_kind=GATHERED)

  def _place(self):
    """Puts the training state on the replicas' devices (a no-op once there)."""
    self._train_state = self._train_state.place(self._replication,
                                                self._shards_optimizer_state())

  # -- fit ------------------------------------------------------------------------------

  def set_pipelining_options(self, **options):
    """Train pipelined over IPUs (see :mod:`ipu_jax.keras.pipelining`)."""
    from ipu_jax.keras import pipelining
    self._pipelining = pipelining.merged_options(self._pipelining, **options)

  def set_pipeline_stage_assignment(self, assignment: dict):
    """Place layers on pipeline stages by module path (``{"layers_1": 1}``)."""
    from ipu_jax.keras import pipelining
    self._pipelining = pipelining.merged_assignment(self._pipelining, assignment)

  # -- what a training loop uses: plain fit and keras/pipelining.py's fit ------------
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
      return pipelining.fit(self, x, y, batch_size=batch_size, epochs=epochs,
                            verbose=0 if verbose == "auto" else verbose, shuffle=shuffle,
                            callbacks=callbacks, validation_data=validation_data,
                            initial_epoch=initial_epoch, steps_per_epoch=steps_per_epoch,
                            validation_batch_size=validation_batch_size,
                            validate_inputs=validate_inputs)
    plan = self._fit_plan(x, y, batch_size, epochs, verbose, initial_epoch, steps_per_epoch,
                          shuffle, validation_data, validation_batch_size, validate_inputs)
    if validate_inputs:
      self._validate_labels(plan.source.example[0], plan.source.labels)
    history = callbacks_lib.History()
    cb = self._fit_callbacks(plan, callbacks, epochs, history)
    self.stop_training = False
    self.history = history
    self._place()
    # Lower and compile now, so a program that cannot be lowered or does not
    # fit in tile memory fails before any callback or epoch starts.
    self._train_program(*map(plan.layout, plan.source.example))
    cb.on_train_begin()
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
      logs = self._fit_epoch(plan, cb, epoch)
      if self.stop_training:
        break
    self._sync_module()
    cb.on_train_end(logs)
    return history

  def _fit_plan(self, x, y, batch_size, epochs, verbose, initial_epoch, steps_per_epoch,
                shuffle, validation_data, validation_batch_size,
                validate_inputs) -> loop.FitPlan:
    """Checks ``fit``'s sizes and options (before anything runs) into a plan."""
    G, R, S = self.gradient_accumulation_steps, self.num_replicas, self.steps_per_execution
    check_steps_per_execution(S, G, R)
    if initial_epoch < 0 or epochs < initial_epoch:
      raise ValueError(f"need 0 <= initial_epoch <= epochs; got initial_epoch="
                       f"{initial_epoch}, epochs={epochs}.")
    verbose = 1 if verbose == "auto" else int(verbose)
    self._compile_verbose = None if verbose else 0  # verbose=0 silences compile progress
    source = loop.train_source(as_arrays(x), as_arrays(y), batch_size, steps_per_epoch,
                               S, self.seed)
    return loop.FitPlan(G, R, S, source, self._replication, verbose, shuffle=shuffle,
                        validation_data=validation_data,
                        validation_batch_size=validation_batch_size,
                        validate_inputs=validate_inputs)

  def _fit_callbacks(self, plan: loop.FitPlan, callbacks, epochs: int,
                     history) -> callbacks_lib.CallbackList:
    """The user's callbacks, then the progress bar (if verbose) and ``history``."""
    cbs = list(callbacks or [])
    if plan.verbose:
      cbs.append(ProgbarLogger(verbose=plan.verbose))
    cbs.append(history)
    return callbacks_lib.CallbackList(cbs, model=self, params=plan.callback_params(epochs))

  def _fit_epoch(self, plan: loop.FitPlan, cb, epoch: int) -> dict:
    """One epoch of ``fit`` (and its validation); returns the epoch's logs."""
    S = plan.steps_per_execution
    cb.on_epoch_begin(epoch)
    running = loop.RunningSums([m.name for m in self.metrics])
    for index, (xb, yb) in enumerate(plan.source.batches(epoch, plan.shuffle)):
      cb.on_train_batch_begin(index * S)
      logs = self._train_execution(plan, xb, yb, running)
      cb.on_train_batch_end((index + 1) * S - 1, logs)
      if self.stop_training:
        break
    epoch_logs = running.logs()
    if plan.validation_data is not None and not self.stop_training:
      val = self._evaluate(plan.validation_data, None,
                           plan.validation_batch_size or plan.batch_size, cb, verbose=0,
                           validate_inputs=plan.validate_inputs)
      epoch_logs.update({"val_" + k: v for k, v in val.items()})
    self._sync_module()
    cb.on_epoch_end(epoch, epoch_logs)
    return epoch_logs

  def _train_execution(self, plan: loop.FitPlan, xb, yb, running: loop.RunningSums) -> dict:
    """Runs one execution of the training program on ``(xb, yb)``; returns its logs."""
    xs, ys = plan.layout(xb), plan.layout(yb)
    program = self._train_program(xs, ys)
    start = time.perf_counter()
    rep = self._replication
    trained, sums = program(self._train_state, rep.shard(xs), rep.shard(ys),
                            rep.shard(rep.replica_ids))
    self._train_state = self._train_state.merge(trained)
    sums = self._host_sums(program, rep.fetch(sums))
    host_seconds = time.perf_counter() - start
    self.executions += 1
    running.add(sums)
    logs = running.logs()
    lowered = program.lowered
    self._record_report("train", lowered, plan.batch_size)
    if lowered is not None:
      logs["host_round_trips"] = lowered.report.host_round_trips
      logs["emulated_seconds"] = lowered.report.estimated_seconds
    logs.update(loss_scaling.scaling_logs(self._train_state.opt_state))
    self.record_number_formats(logs, lowered.report if lowered is not None else None)
    logs["samples"] = plan.steps_per_execution * plan.batch_size
    logs["host_seconds"] = host_seconds
    return logs

  def _host_sums(self, program, sums) -> np.ndarray:
    """One ``[loss, metrics..., count]`` vector from what ``outputs.mode``
    returned of an execution's per-step sums (docs/host_side.md#output-modes)."""
    sums = np.asarray(sums)
    mode, period = self.config.outputs.mode, self.config.outputs.return_period
    if program.lowered is None and mode != "all":  # plain JAX: select as the device does
      sums = select_outputs(sums, mode, period, 0, np)
    return sums.astype(np.float64).sum(axis=0) if sums.ndim == 2 else sums

  def _validate_labels(self, x, y):
    """Checks labels ``y`` against the loss and the output for ``x`` (nothing runs)."""
    sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
    adapter = self._adapter
    out = jax.eval_shape(
        lambda p, s, r, xb: adapter.apply(p, s, r, xb, False, None)[0],
        self.params, self.state, self._local(self._train_state.rng_state), sample)
    leaves = jax.tree.leaves(out)
    if len(leaves) == 1:
      check_labels(self.loss, y, leaves[0].shape)

  def _evaluate(self, x, y, batch_size, cb, verbose, steps=None, validate_inputs=True):
    if isinstance(x, tuple) and y is None and len(x) == 2 and is_array_like(x[0]):
      x, y = x
    data = loop.eval_data(as_arrays(x), as_arrays(y), batch_size, steps)
    if data.y is None:
      raise ValueError("evaluate needs labels y.")
    if validate_inputs:
      self._validate_labels(data.x, data.y)
    S, rep = self.steps_per_execution, self._replication
    self._place()
    running = loop.RunningSums([m.name for m in self.metrics])
    cb.on_test_begin()
    executions = 0
    for e, (xs, ys, ms) in enumerate(loop.padded_batches(data, S, rep)):
      cb.on_test_batch_begin(e * S)
      program = self._eval_program(xs, ys, ms)
      _, sums = program(self._train_state, rep.shard(xs), rep.shard(ys), rep.shard(ms))
      running.add(self._host_sums(program, rep.fetch(sums)))
      self._record_report("eval", program.lowered, data.batch_size)
      cb.on_test_batch_end((e + 1) * S - 1, running.logs())
      executions += 1
    logs = running.logs()
    cb.on_test_end(logs)
    if verbose:
      print(f"{executions} executions - " + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()))
    return logs

  def evaluate(self, x=None, y=None, batch_size: Optional[int] = None, verbose="auto",
               callbacks: Optional[Sequence] = None, steps: Optional[int] = None,
               return_dict: bool = True, validate_inputs: bool = True):
    """Loss and metrics over the data, as a dict (``return_dict=False``: a list).

    The last execution is padded with masked samples, so every sample counts
    exactly once. ``validate_inputs`` checks the labels against the loss and
    the model's output first (``ValueError``); ``False`` skips it.
    """
    self._require_compiled()
    verbose = 1 if verbose == "auto" else int(verbose)
    self._compile_verbose = None if verbose else 0  # verbose=0 silences compile progress
    cb = callbacks_lib.CallbackList(callbacks or [], model=self)
    logs = self._evaluate(x, y, batch_size, cb, verbose, steps, validate_inputs)
    return logs if return_dict else list(logs.values())

  def predict(self, x, batch_size: Optional[int] = None, verbose=0,
              callbacks: Optional[Sequence] = None, steps: Optional[int] = None) -> np.ndarray:
    """The model's outputs for every sample of ``x``, as NumPy."""
    self._require_compiled()
    x = as_arrays(x)
    if not is_array_like(x):
      x = loop.eval_data(x, None, batch_size, steps).x
    data = ArrayData(x, None, 32 if batch_size is None else batch_size)
    rep = self._replication
    self._place()
    cb = callbacks_lib.CallbackList(callbacks or [], model=self)
    cb.on_predict_begin()
    outputs = []
    # outputs.mode: which steps' outputs come back (docs/host_side.md#output-modes).
    mode, period = self.config.outputs.mode, self.config.outputs.return_period
    for xs, _, _ in loop.padded_batches(data, self.steps_per_execution, rep):
      program = self._predict_program(xs)
      _, ys = program(self._train_state, rep.shard(xs))
      if program.lowered is None and mode != "all":  # plain JAX: select as the device does
        ys = jax.tree.map(lambda a: select_outputs(np.asarray(a), mode, period, 1, np), ys)
      self._record_report("predict", program.lowered, data.batch_size)
      outputs.append(loop.gather_selected_predictions(ys, rep, mode))
    cb.on_predict_end()
    # Padding samples are dropped only when every step's outputs return.
    keep = data.n if mode == "all" else None
    result = jax.tree.map(lambda *a: np.concatenate(a)[:keep], *outputs)
    if verbose:
      print(f"{len(outputs)} executions, {data.n} samples")
    return result

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
