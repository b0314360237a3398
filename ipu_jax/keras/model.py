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

What one call of the device does (DESIGN section 5):

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
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ipu_jax import config as config_lib
from ipu_jax.keras import accumulation as acc_lib
from ipu_jax.keras import callbacks as callbacks_lib
from ipu_jax.keras import losses as losses_lib
from ipu_jax.keras import metrics as metrics_lib
from ipu_jax.keras.adapters import flatten_paths, make_adapter
from ipu_jax.keras.data import (ArrayData, as_arrays, host_dtype, is_array_like, num_samples,
                                split_batch)
from ipu_jax.keras.validation import check_labels
from ipu_jax.keras.progress import ProgbarLogger
from ipu_jax.keras.weights import (atomic_write, flat_saveable, restore_flat,
                                   restore_nested, to_saveable)
from ipu_jax.keras.replication import (GATHERED, REPLICATED, SHARDED, SUMMED, Replication,
                                       cross_replica_mean, cross_replica_sum)

__all__ = ["Model", "check_steps_per_execution"]

_FORMAT = "ipu-jax-keras-weights"
_FORMAT_VERSION = 1


def check_steps_per_execution(steps_per_execution: int, accumulation_steps: int,
                              replicas: int) -> None:
  """Refuses an S that is not a multiple of G x R, as Keras on IPU does.

  Raises:
    ValueError: with the numbers and the nearest valid choices.
  """
  if isinstance(steps_per_execution, bool) or not isinstance(steps_per_execution, (int, np.integer)):
    raise TypeError(f"steps_per_execution must be an int; got {steps_per_execution!r}.")
  if steps_per_execution < 1:
    raise ValueError(f"steps_per_execution must be >= 1; got {steps_per_execution}.")
  unit = accumulation_steps * replicas
  if steps_per_execution % unit:
    lower = max(unit, steps_per_execution - steps_per_execution % unit)
    upper = lower + unit if lower < steps_per_execution else lower
    raise ValueError(
        f"steps_per_execution={steps_per_execution} must be a multiple of "
        f"gradient_accumulation_steps_per_replica x replicas = "
        f"{accumulation_steps} x {replicas} = {unit}: each execution runs "
        f"steps_per_execution / replicas steps on every replica and updates the "
        f"weights every {accumulation_steps} of them. Use steps_per_execution="
        f"{lower}" + (f" or {upper}" if upper != lower else "") + ".")


def _active_config():
  """The config of the innermost strategy scope / default_config, or None."""
  return config_lib._DEFAULT_CONFIG.get()  # noqa: SLF001  (same package)


def _vector(scalars):
  """A float32 vector of scalars (concatenate, which every lowering knows)."""
  return jnp.concatenate([jnp.reshape(jnp.asarray(s, jnp.float32), (1,)) for s in scalars])


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


class _Metrics:
  """Host-side running sums of loss and metrics over an epoch."""

  def __init__(self, names):
    self.names = list(names)
    self.totals = np.zeros(len(self.names) + 2, np.float64)

  def add(self, sums):
    self.totals += np.asarray(sums, np.float64)

  @property
  def count(self) -> float:
    return float(self.totals[-1])

  def logs(self, prefix="") -> dict:
    count = max(self.count, 1.0)
    out = {prefix + "loss": float(self.totals[0] / count)}
    for i, name in enumerate(self.names):
      out[prefix + name] = float(self.totals[1 + i] / count)
    return out


# ---------------------------------------------------------------------------
# The model.
# ---------------------------------------------------------------------------


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
    if seed is None:
      known = config or self._config_at_init
      seed = known.random_seed if known is not None and known.random_seed is not None else 0
    self.seed = int(seed)
    self._base_key = jax.random.key(self.seed)
    init_key, self._dropout_key = jax.random.split(self._base_key)
    self._adapter = make_adapter(module, sample_input=sample_input, input_shape=input_shape,
                                 input_dtype=input_dtype, key=init_key,
                                 train_kwargs=train_kwargs, eval_kwargs=eval_kwargs,
                                 init_kwargs=init_kwargs, rng_collections=rng_collections)
    self.module = module
    self.name = name or self._adapter.name
    self._params = self._adapter.params
    self._state = self._adapter.state
    self._rng_state = self._adapter.rng_state
    self._opt_state = None
    self._step = 0
    self._pending_optimizer = None
    self._compiled = False
    self._accumulation_steps: Optional[int] = None
    self._accumulation_reduction: Optional[str] = None
    self._programs: dict = {}
    self.config: Optional[config_lib.IPUConfig] = None
    self.optimizer = None
    self.loss = None
    self.metrics: list = []
    self.steps_per_execution = 1
    self.emulate = True
    self.stop_training = False
    self.history: Optional[callbacks_lib.History] = None
    self.reports: dict = {}
    self._last_program: Optional[str] = None
    self.checkpoint_epoch: Optional[int] = None
    self.executions = 0
    self._replication: Optional[Replication] = None

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
    from ipu_jax.lowering.run_setup import RunSetup
    cfg = self._lowering_config()
    target = cfg.to_target()
    G = self.gradient_accumulation_steps if program == "train" else 1
    R, S = self.num_replicas, self.steps_per_execution
    dtypes = sorted({str(np.dtype(v.dtype)) for v in jax.tree.leaves(self.params)})
    return RunSetup(
        program=program, target=target.name, num_ipus=target.num_ipus,
        tiles_per_ipu=target.tiles_per_ipu, replicas=R, gradient_accumulation_steps=G,
        gradient_accumulation_reduction=self.gradient_accumulation_reduction,
        replica_reduction=self.replica_reduction, steps_per_execution=S,
        micro_batch=int(micro_batch), global_batch=int(micro_batch) * G * R,
        weight_updates_per_execution=S // (G * R) if program == "train" else 0,
        param_dtypes=tuple(dtypes), matmul_partials_type=cfg.matmuls.partials_type,
        matmul_available_memory_proportion=cfg.matmuls.available_memory_proportion,
        conv_available_memory_proportion=cfg.convolutions.available_memory_proportion)

  def _record_report(self, program: str, lowered, micro_batch: int):
    self._last_program = program
    if lowered is None:
      return
    if lowered.profile.run_setup is None:
      lowered.profile.run_setup = self._run_setup(program, micro_batch)
    self.reports[program] = lowered.report

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
    self._opt_state = optimizer.init(self._local(self._params))  # (re)compiling resets it
    self._step = 0
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

  def _require_compiled(self):
    if not self._compiled:
      raise RuntimeError("call model.compile(optimizer=..., loss=...) first.")

  # -- variables ----------------------------------------------------------------

  def _local(self, tree):
    if self._replication is None:
      return tree
    return self._replication.local(tree)

  @property
  def params(self):
    """The trained parameters (an ``nnx.State`` or a linen params dict)."""
    return self._local(self._params)

  @property
  def state(self):
    """Non-trainable variables (batch statistics, ...)."""
    return self._local(self._state)

  @property
  def opt_state(self):
    return self._local(self._opt_state)

  @property
  def step(self) -> int:
    """Weight updates made so far."""
    return int(np.asarray(self._local(self._step)))

  def get_weights(self) -> dict:
    """``{"params": ..., "state": ...}`` as nested dicts of NumPy arrays."""
    return {"params": to_saveable(self._adapter.to_pure(self.params)),
            "state": to_saveable(self._adapter.to_pure(self.state))}

  def set_weights(self, weights: dict):
    """Sets weights as :meth:`get_weights` gives them."""
    params_t = self._adapter.to_pure(self.params)
    state_t = self._adapter.to_pure(self.state)
    self._params = self._adapter.from_pure(self.params, restore_nested(
        params_t, weights["params"], "params"))
    if "state" in weights and jax.tree.leaves(state_t):
      self._state = self._adapter.from_pure(self.state, restore_nested(
          state_t, weights["state"], "state"))
    self._sync_module()

  def _sync_module(self):
    self._adapter.sync(self.params, self.state, self._rng_state)

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
    import flax.serialization
    payload = {
        "format": _FORMAT, "version": _FORMAT_VERSION,
        "epoch": -1 if epoch is None else int(epoch),
        **self.get_weights(),
        "rng_state": flat_saveable(self._local(self._rng_state)),
    }
    if include_optimizer and self._compiled:
      payload["optimizer"] = {
          "opt_state": flat_saveable(self.opt_state),
          "step": np.asarray(self.step, np.int64),
      }
    data = flax.serialization.msgpack_serialize(payload)
    if jax.process_index() == 0:
      atomic_write(path, data)
    return path

  def load_weights(self, path: str) -> Optional[int]:
    """Reads a file of :meth:`save_weights` (or ``ModelCheckpoint``).

    Restores the weights; when the file holds the optimizer state, that too
    (now if compiled, else at ``compile``). Sets and returns
    ``checkpoint_epoch``, the epochs the checkpoint had completed (``None``
    if it does not say), the ``initial_epoch`` to resume ``fit`` from.
    """
    import flax.serialization
    with open(path, "rb") as f:
      payload = flax.serialization.msgpack_restore(f.read())
    if payload.get("format") != _FORMAT:
      raise ValueError(f"{path} is not an ipu_jax.keras weights file.")
    if int(payload.get("version", 0)) > _FORMAT_VERSION:
      raise ValueError(f"{path} has format version {payload['version']}; this "
                       f"ipu-jax reads up to {_FORMAT_VERSION}.")
    self.set_weights(payload)
    saved_rng = payload.get("rng_state") or {}
    if saved_rng and jax.tree.leaves(self._rng_state):
      self._rng_state = restore_flat(self._local(self._rng_state), saved_rng, "rng_state")
    if "optimizer" in payload:
      if self._compiled:
        self._restore_optimizer(payload["optimizer"])
      else:
        self._pending_optimizer = payload["optimizer"]
    epoch = int(payload.get("epoch", -1))
    self.checkpoint_epoch = None if epoch < 0 else epoch
    return self.checkpoint_epoch

  def _restore_optimizer(self, saved):
    self._opt_state = restore_flat(self.opt_state, saved["opt_state"], "opt_state")
    self._step = jnp.asarray(int(np.asarray(saved["step"])), jnp.int32)

  # -- the programs -------------------------------------------------------------------

  def _lowering_config(self):
    cfg = self.config.copy()
    cfg.replication_factor = self.num_replicas  # the all-reduce spans every replica
    return cfg

  def _build(self, key, execution, args, in_kinds_per_arg, out_kinds_fn, name):
    """Lowers ``execution`` for one replica and wraps it for every replica.

    Returns:
      ``(run, lowered)``: ``run(*args)`` takes the arguments (sharded ones
      with a leading axis of this process's replicas) and returns the output
      pytree; ``lowered`` is the ``ipu_jax.Lowered`` (``None`` when not
      emulating).
    """
    cached = self._programs.get(key)
    if cached is not None:
      return cached
    import ipu_jax
    execution.__name__ = name
    per_replica_args = [
        _abstract(a) if kind == REPLICATED else
        jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v)[1:], v.dtype), a)
        for a, kind in zip(args, in_kinds_per_arg)]
    flat_example, in_tree = jax.tree_util.tree_flatten(list(per_replica_args))
    in_kinds = []
    for a, kind in zip(args, in_kinds_per_arg):
      in_kinds += [kind] * len(jax.tree.leaves(a))
    lowered = None
    if self.emulate:
      ipu_fn = ipu_jax.jit(execution, config=self._lowering_config(),
                           verbose=getattr(self, "_compile_verbose", None))
      lowered = ipu_fn.lower(*per_replica_args)
      out_tree = lowered.out_tree
      program = lowered.apply
    else:
      out_tree = jax.tree_util.tree_structure(jax.eval_shape(execution, *per_replica_args))

      def program(*flat):
        return execution(*jax.tree_util.tree_unflatten(in_tree, flat))

    out_kinds = out_kinds_fn(out_tree)

    def per_replica(*flat):
      return jax.tree_util.tree_leaves(program(*flat))

    runner = self._replication.build(per_replica, in_kinds, out_kinds)

    def run(*args_):
      leaves = jax.tree_util.tree_leaves(list(args_))
      return jax.tree_util.tree_unflatten(out_tree, runner(*leaves))

    self._programs[key] = (run, lowered)
    return run, lowered

  def _per_sample_loss(self, y, y_pred):
    values = jnp.asarray(self.loss(y, y_pred))
    batch = jax.tree.leaves(y_pred)[0].shape[0]
    if values.ndim == 0:  # a callable giving the batch mean
      values = jnp.broadcast_to(values, (batch,))
    return values.reshape(batch, -1).mean(axis=1) if values.ndim > 1 else values

  def _train_program(self, xs, ys):
    """The program of one training execution (U updates of G micro-batches)."""
    G = self.gradient_accumulation_steps
    R = self.num_replicas
    method = self.gradient_accumulation_reduction
    replica_reduction = self.replica_reduction
    key = ("train", G, method, R, jax.tree.map(lambda a: (a.shape, str(a.dtype)), (xs, ys)))
    adapter, optimizer, metric_fns = self._adapter, self.optimizer, self.metrics
    needs_rng = adapter.needs_rng
    per_sample_loss = self._per_sample_loss

    def execution(params, opt_state, state, rng_state, step, base_key, xs, ys, replica):
      def micro(params, state, x, y, micro_step):
        rng = (base_key, (micro_step, replica)) if needs_rng else None

        def objective(p):
          y_pred, new_state = adapter.apply(p, state, rng_state, x, True, rng)
          per_sample = per_sample_loss(y, y_pred)
          return jnp.mean(per_sample), (y_pred, new_state, per_sample)

        (_, (y_pred, new_state, per_sample)), grads = jax.value_and_grad(
            objective, has_aux=True)(params)
        sums = [jnp.sum(per_sample)] + [jnp.sum(m(y, y_pred)) for m in metric_fns]
        sums.append(jnp.asarray(per_sample.shape[0], jnp.float32))
        return grads, new_state, _vector(sums)

      def update(carry, batch):
        params, opt_state, state, step = carry
        xg, yg = batch
        if G == 1:
          grads, state, sums = micro(params, state, jax.tree.map(lambda a: a[0], xg),
                                     yg[0], step)
        else:
          def accumulate(c, inp):
            acc, state, sums = c
            k, x, y = inp
            grads, state, s = micro(params, state, x, y, step * G + k)
            return (acc_lib.accumulate(acc, grads, k, method), state, sums + s), None

          zeros = jnp.zeros((len(metric_fns) + 2,), jnp.float32)
          (acc, state, sums), _ = jax.lax.scan(
              accumulate, (acc_lib.init(params), state, zeros),
              (jnp.arange(G, dtype=jnp.int32), xg, yg))
          grads = acc_lib.finalize(acc, G, method)
        if R > 1:
          grads = (cross_replica_mean(grads) if replica_reduction == "mean"
                   else cross_replica_sum(grads))
          if jax.tree.leaves(state):  # keep batch statistics equal on every replica
            state = jax.tree.map(
                lambda v: cross_replica_mean(v) if jnp.issubdtype(v.dtype, jnp.floating)
                else v, state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state, state, step + 1), sums

      (params, opt_state, state, step), sums = jax.lax.scan(
          update, (params, opt_state, state, step), (xs, ys))
      return params, opt_state, state, step, jnp.sum(sums, axis=0)

    args = [self._params, self._opt_state, self._state, self._rng_state, self._step,
            self._dropout_key, xs, ys, self._replica_ids()]
    kinds = [REPLICATED] * 6 + [SHARDED] * 3

    def out_kinds(out_tree):
      n = out_tree.num_leaves
      return [REPLICATED] * (n - 1) + [SUMMED]

    return self._build(key, execution, args, kinds, out_kinds, "train_step")

  def _eval_program(self, xs, ys, mask):
    key = ("eval", self.num_replicas,
           jax.tree.map(lambda a: (a.shape, str(a.dtype)), (xs, ys, mask)))
    adapter, metric_fns = self._adapter, self.metrics
    per_sample_loss = self._per_sample_loss

    def execution(params, state, rng_state, xs, ys, mask):
      def body(sums, inp):
        x, y, m = inp
        y_pred, _ = adapter.apply(params, state, rng_state, x, False, None)
        values = [per_sample_loss(y, y_pred)] + [mf(y, y_pred) for mf in metric_fns]
        s = [jnp.sum(v.astype(jnp.float32) * m) for v in values] + [jnp.sum(m)]
        return sums + _vector(s), None

      zeros = jnp.zeros((len(metric_fns) + 2,), jnp.float32)
      sums, _ = jax.lax.scan(body, zeros, (xs, ys, mask))
      return sums

    args = [self._params, self._state, self._rng_state, xs, ys, mask]
    kinds = [REPLICATED] * 3 + [SHARDED] * 3
    return self._build(key, execution, args, kinds,
                       lambda tree: [SUMMED] * tree.num_leaves, "eval_step")

  def _predict_program(self, xs):
    key = ("predict", self.num_replicas, jax.tree.map(lambda a: (a.shape, str(a.dtype)), xs))
    adapter = self._adapter

    def execution(params, state, rng_state, xs):
      def body(carry, x):
        y_pred, _ = adapter.apply(params, state, rng_state, x, False, None)
        return carry, y_pred

      _, ys = jax.lax.scan(body, jnp.zeros((), jnp.int32), xs)
      return ys

    args = [self._params, self._state, self._rng_state, xs]
    kinds = [REPLICATED] * 3 + [SHARDED]
    return self._build(key, execution, args, kinds,
                       lambda tree: [GATHERED] * tree.num_leaves, "predict_step")

  def _replica_ids(self):
    return self._replication.replica_ids

  def _place(self):
    """Puts the training state on the replicas' devices (a no-op once there)."""
    rep = self._replication
    self._params = rep.replicate(self._params)
    self._state = rep.replicate(self._state)
    self._rng_state = rep.replicate(self._rng_state)
    if self._opt_state is not None:
      self._opt_state = rep.replicate(self._opt_state)
    self._step = rep.replicate(jnp.asarray(self._step, jnp.int32))
    self._dropout_key = rep.replicate(self._dropout_key)

  # -- data layout ----------------------------------------------------------------

  def _layout(self, batch, updates: int, accumulation: int):
    """``[S * b, ...]`` samples in order -> this process's ``[R_local, U, G, b, ...]``.

    Update u takes the consecutive samples ``[u R G b, (u + 1) R G b)``;
    within them replica r takes a block of ``G b``.
    """
    rep = self._replication
    R, b = rep.num_replicas, self._batch_size

    def arrange(a):
      a = np.asarray(a)
      a = a.reshape((updates, R, accumulation, b) + a.shape[1:])
      a = np.swapaxes(a, 0, 1)
      return a[rep.first_replica:rep.first_replica + rep.local_replicas]

    return jax.tree.map(arrange, batch)

  def _eval_layout(self, batch, steps_per_replica: int):
    """``[S * b, ...]`` -> this process's ``[R_local, S / R, b, ...]``."""
    rep = self._replication
    R, b = rep.num_replicas, self._eval_batch_size

    def arrange(a):
      a = np.asarray(a)
      a = a.reshape((steps_per_replica, R, b) + a.shape[1:])
      a = np.swapaxes(a, 0, 1)
      return a[rep.first_replica:rep.first_replica + rep.local_replicas]

    return jax.tree.map(arrange, batch)

  # -- fit ------------------------------------------------------------------------------

  def _executions(self, data, steps_per_epoch):
    S, b = self.steps_per_execution, data.batch_size
    steps = data.n // b if steps_per_epoch is None else int(steps_per_epoch)
    if steps_per_epoch is not None and steps * b > data.n:
      raise ValueError(f"steps_per_epoch={steps} needs {steps * b} samples of "
                       f"batch_size={b}; x has {data.n}.")
    executions = steps // S
    if executions == 0:
      raise ValueError(
          f"one execution needs steps_per_execution x batch_size = {S} x {b} = {S * b} "
          f"samples (batch_size is the micro-batch of each replica); the data has "
          f"{data.n}" + (f" and steps_per_epoch={steps}" if steps_per_epoch else "") +
          ". Use a smaller batch_size or steps_per_execution.")
    return executions

  def set_pipelining_options(self, **options):
    """Train pipelined over IPUs (see :mod:`ipu_jax.keras.pipelining`)."""
    from ipu_jax.keras import pipelining
    pipelining.set_pipelining_options(self, **options)

  def set_pipeline_stage_assignment(self, assignment: dict):
    """Place layers on pipeline stages by module path (``{"layers_1": 1}``)."""
    from ipu_jax.keras import pipelining
    pipelining.set_pipeline_stage_assignment(self, assignment)

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
    if getattr(self, "_pipelining", None):
      from ipu_jax.keras import pipelining
      return pipelining.fit(self, x, y, batch_size=batch_size, epochs=epochs,
                            verbose=0 if verbose == "auto" else verbose, shuffle=shuffle,
                            callbacks=callbacks, validation_data=validation_data)
    G, R, S = self.gradient_accumulation_steps, self.num_replicas, self.steps_per_execution
    check_steps_per_execution(S, G, R)
    if initial_epoch < 0 or epochs < initial_epoch:
      raise ValueError(f"need 0 <= initial_epoch <= epochs; got initial_epoch="
                       f"{initial_epoch}, epochs={epochs}.")
    verbose = 1 if verbose == "auto" else int(verbose)
    self._compile_verbose = None if verbose else 0  # verbose=0 silences compile progress
    U = S // (G * R)
    source = self._train_source(as_arrays(x), as_arrays(y), batch_size, steps_per_epoch)
    self._batch_size = source["batch_size"]
    if validate_inputs:
      self._validate_labels(source["example"][0], source["labels"])
    executions_per_epoch = source["executions"]

    history = callbacks_lib.History()
    cbs = list(callbacks or [])
    if verbose:
      cbs.append(ProgbarLogger(verbose=verbose))
    cbs.append(history)
    cb = callbacks_lib.CallbackList(cbs, model=self, params={
        "epochs": epochs, "steps": None if executions_per_epoch is None
        else executions_per_epoch * S, "steps_per_execution": S, "verbose": verbose,
        "batch_size": self._batch_size, "replicas": R, "gradient_accumulation_steps": G,
        "executions_per_epoch": executions_per_epoch})
    self.stop_training = False
    self.history = history
    self._place()
    # Lower and compile now, so a program that cannot be lowered or does not
    # fit in tile memory fails before any callback or epoch starts.
    example_x, example_y = source["example"]
    self._train_program(self._layout(example_x, U, G), self._layout(example_y, U, G))
    samples_per_execution = S * self._batch_size
    cb.on_train_begin()
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
      cb.on_epoch_begin(epoch)
      running = _Metrics([m.name for m in self.metrics])
      for index, (xb, yb) in enumerate(source["batches"](epoch, shuffle)):
        cb.on_train_batch_begin(index * S)
        xs = self._layout(xb, U, G)
        ys = self._layout(yb, U, G)
        run, lowered = self._train_program(xs, ys)
        start = time.perf_counter()
        rep = self._replication
        (self._params, self._opt_state, self._state, self._step, sums) = run(
            self._params, self._opt_state, self._state, self._rng_state, self._step,
            self._dropout_key, rep.shard(xs), rep.shard(ys), rep.shard(self._replica_ids()))
        sums = np.asarray(rep.fetch(sums))
        host_seconds = time.perf_counter() - start
        self.executions += 1
        running.add(sums)
        logs = running.logs()
        self._record_report("train", lowered, self._batch_size)
        if lowered is not None:
          logs["host_round_trips"] = lowered.report.host_round_trips
          logs["emulated_seconds"] = lowered.report.estimated_seconds
        logs["samples"] = samples_per_execution
        logs["host_seconds"] = host_seconds
        cb.on_train_batch_end((index + 1) * S - 1, logs)
        if self.stop_training:
          break
      epoch_logs = running.logs()
      if validation_data is not None and not self.stop_training:
        val = self._evaluate(validation_data, None, validation_batch_size or self._batch_size,
                             cb, verbose=0, validate_inputs=validate_inputs)
        epoch_logs.update({"val_" + k: v for k, v in val.items()})
      self._sync_module()
      cb.on_epoch_end(epoch, epoch_logs)
      logs = epoch_logs
      if self.stop_training:
        break
    self._sync_module()
    cb.on_train_end(logs)
    return history

  def _train_source(self, x, y, batch_size, steps_per_epoch):
    """How fit draws the samples of each execution: ``[S * b, ...]`` in order."""
    S = self.steps_per_execution
    if x is None:
      raise ValueError("fit needs data: x and y arrays, or x an iterable of (x, y) batches.")
    if y is not None or is_array_like(x):
      if y is None:
        raise ValueError("fit with an array x needs labels y.")
      data = ArrayData(x, y, 32 if batch_size is None else batch_size)
      if data.batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
      executions = self._executions(data, steps_per_epoch)
      chunk = S * data.batch_size

      def batches(epoch, shuffle):
        order = (np.random.default_rng([self.seed, epoch]).permutation(data.n) if shuffle
                 else np.arange(data.n))
        for e in range(executions):
          yield data.take(order[e * chunk:(e + 1) * chunk])

      used = executions * chunk
      if steps_per_epoch is None and used < data.n:
        warnings.warn(
            f"fit: {data.n - used} of {data.n} samples are left out of every epoch: an "
            f"epoch runs whole executions of steps_per_execution x batch_size = {S} x "
            f"{data.batch_size} = {chunk} samples ({executions} of them). Choose sizes "
            "that divide the data to use every sample.", stacklevel=3)
      example = data.take(np.zeros(chunk, np.int64))
      return {"batch_size": data.batch_size, "executions": executions, "batches": batches,
              "example": example, "labels": data.y}

    # An iterable of (x, y) micro-batches.
    iterator_once = iter(x) is x if hasattr(x, "__iter__") else True
    stream = {"it": None}
    peek = None
    if iterator_once:
      it = x if hasattr(x, "__next__") else iter(x)
      peek = next(it)
      stream["it"] = it
    else:
      peek = next(iter(x))
    px, py = split_batch(peek)
    b = num_samples(px)
    if batch_size is not None and batch_size != b:
      raise ValueError(f"batch_size={batch_size} but the dataset yields batches of {b}.")
    executions = None if steps_per_epoch is None else int(steps_per_epoch) // S
    if executions == 0:
      raise ValueError(f"steps_per_epoch={steps_per_epoch} is less than "
                       f"steps_per_execution={S}.")
    if iterator_once and executions is None:
      raise ValueError("fit on an iterator needs steps_per_epoch (it cannot be "
                       "re-read each epoch).")
    pending = [peek] if iterator_once else []

    def batches(epoch, shuffle):
      if iterator_once:
        it = stream["it"]
      else:
        it = iter(x)
      count = 0
      group = []
      while executions is None or count < executions:
        if pending:
          item = pending.pop()
        else:
          try:
            item = next(it)
          except StopIteration:
            break
        bx, by = split_batch(item)
        if num_samples(bx) != b:
          break  # a short last batch: dropped, as drop_remainder does
        group.append((bx, by))
        if len(group) == S:
          xs = jax.tree.map(lambda *a: np.concatenate([host_dtype(v) for v in a]),
                            *[g[0] for g in group])
          ys = np.concatenate([host_dtype(g[1]) for g in group])
          group = []
          count += 1
          yield xs, ys

    example = (jax.tree.map(lambda a: np.repeat(host_dtype(a)[:1], S * b, axis=0), px),
               np.repeat(host_dtype(py)[:1], S * b, axis=0))
    return {"batch_size": b, "executions": executions, "batches": batches,
            "example": example, "labels": host_dtype(py)}

  # -- evaluate and predict ---------------------------------------------------------

  def _eval_arrays(self, x, y, batch_size, steps):
    if y is None and not is_array_like(x):
      items = []
      for i, item in enumerate(x):
        if steps is not None and i >= steps:
          break
        items.append(split_batch(item))
      if not items:
        raise ValueError("the dataset is empty.")
      b = num_samples(items[0][0])
      x = jax.tree.map(lambda *a: np.concatenate([host_dtype(v) for v in a]),
                       *[i[0] for i in items])
      y = None if items[0][1] is None else np.concatenate([host_dtype(i[1]) for i in items])
      batch_size = batch_size or b
    return ArrayData(x, y, 32 if batch_size is None else batch_size)

  def _padded_executions(self, data):
    """Executions (padded to whole ones) and the per-execution sample count."""
    S, b = self.steps_per_execution, data.batch_size
    chunk = S * b
    executions = -(-data.n // chunk)
    return executions, chunk

  def _validate_labels(self, x, y):
    """Checks labels ``y`` against the loss and the output for ``x`` (nothing runs)."""
    sample = jax.tree.map(lambda a: np.asarray(a)[:1], x)
    adapter = self._adapter
    out = jax.eval_shape(
        lambda p, s, r, xb: adapter.apply(p, s, r, xb, False, None)[0],
        self.params, self.state, self._local(self._rng_state), sample)
    leaves = jax.tree.leaves(out)
    if len(leaves) == 1:
      check_labels(self.loss, y, leaves[0].shape)

  def _evaluate(self, x, y, batch_size, cb, verbose, steps=None, validate_inputs=True):
    if isinstance(x, tuple) and y is None and len(x) == 2 and is_array_like(x[0]):
      x, y = x
    data = self._eval_arrays(as_arrays(x), as_arrays(y), batch_size, steps)
    if data.y is None:
      raise ValueError("evaluate needs labels y.")
    if validate_inputs:
      self._validate_labels(data.x, data.y)
    self._eval_batch_size = data.batch_size
    executions, chunk = self._padded_executions(data)
    R = self.num_replicas
    K = self.steps_per_execution // R
    self._place()
    running = _Metrics([m.name for m in self.metrics])
    cb.on_test_begin()
    rep = self._replication
    for e in range(executions):
      cb.on_test_batch_begin(e * self.steps_per_execution)
      index = np.arange(e * chunk, (e + 1) * chunk)
      mask = (index < data.n).astype(np.float32)
      xb, yb = data.take(np.minimum(index, data.n - 1))
      xs, ys = self._eval_layout(xb, K), self._eval_layout(yb, K)
      ms = self._eval_layout(mask, K)
      run, lowered = self._eval_program(xs, ys, ms)
      sums = run(self._params, self._state, self._rng_state,
                 rep.shard(xs), rep.shard(ys), rep.shard(ms))
      running.add(np.asarray(rep.fetch(sums)))
      self._record_report("eval", lowered, data.batch_size)
      cb.on_test_batch_end((e + 1) * self.steps_per_execution - 1, running.logs())
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
      x = self._eval_arrays(x, None, batch_size, steps).x
    data = ArrayData(x, None, 32 if batch_size is None else batch_size)
    self._eval_batch_size = data.batch_size
    executions, chunk = self._padded_executions(data)
    R = self.num_replicas
    K = self.steps_per_execution // R
    self._place()
    cb = callbacks_lib.CallbackList(callbacks or [], model=self)
    cb.on_predict_begin()
    rep = self._replication
    outputs = []
    for e in range(executions):
      index = np.minimum(np.arange(e * chunk, (e + 1) * chunk), data.n - 1)
      xb, _ = data.take(index)
      xs = self._eval_layout(xb, K)
      run, lowered = self._predict_program(xs)
      ys = run(self._params, self._state, self._rng_state, rep.shard(xs))
      self._record_report("predict", lowered, data.batch_size)

      def unarrange(a):
        a = rep.fetch_gathered(a)  # [R, K, b, ...]
        a = np.swapaxes(a, 0, 1)
        return a.reshape((-1,) + a.shape[3:])

      outputs.append(jax.tree.map(unarrange, ys))
    cb.on_predict_end()
    result = jax.tree.map(lambda *a: np.concatenate(a)[:data.n], *outputs)
    if verbose:
      print(f"{executions} executions, {data.n} samples")
    return result

  def __call__(self, x, training: bool = False):
    """The module applied to ``x`` with the current weights (plain JAX)."""
    y, _ = self._adapter.apply(self.params, self.state, self._local(self._rng_state),
                               x, training, None)
    return y

  # -- summary --------------------------------------------------------------------------

  def count_params(self) -> int:
    return int(sum(np.size(leaf) for leaf in jax.tree.leaves(self.params)))

  def summary(self, print_fn: Optional[Callable[[str], Any]] = print) -> str:
    """A table of the variables and the IPU settings; printed and returned."""
    rows = [(path, "x".join(map(str, np.shape(v))) or "scalar", str(v.dtype), np.size(v))
            for path, v in flatten_paths(self.params)]
    state_rows = [(path, "x".join(map(str, np.shape(v))) or "scalar", str(v.dtype), np.size(v))
                  for path, v in flatten_paths(self.state)]
    header = ("Variable", "Shape", "Dtype", "Params")
    widths = [max([len(header[i])] + [len(str(r[i])) for r in rows + state_rows])
              for i in range(4)]

    def line(r):
      return "  ".join(str(c).ljust(w) if i < 3 else f"{c:,}".rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths)))

    total = sum(r[3] for r in rows)
    nbytes = sum(np.size(v) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(self.params))
    lines = [f'Model: "{self.name}" ({self._adapter.kind})',
             "  ".join(h.ljust(w) for h, w in zip(header, widths)),
             "-" * (sum(widths) + 6)]
    lines += [line(r) for r in rows]
    if state_rows:
      lines.append("Non-trainable:")
      lines += [line(r) for r in state_rows]
    lines += ["-" * (sum(widths) + 6),
              f"Trainable params: {total:,} ({nbytes:,} B)",
              f"Non-trainable params: {sum(r[3] for r in state_rows):,}"]
    cfg = self.config or self._explicit_config or _active_config() or self._config_at_init
    if cfg is not None:
      target = cfg.to_target()
      lines += [
          f"IPU target: {target.name}, {target.num_ipus} IPU(s) x "
          f"{target.tiles_per_ipu:,} tiles per replica",
          f"Replicas: {self.num_replicas}, gradient accumulation: "
          f"{self.gradient_accumulation_steps} ({self.gradient_accumulation_reduction}), "
          f"steps per execution: {self.steps_per_execution}"]
    if self.report is not None:
      lines.append(f"Last execution: {self.report.total_cycles:,.0f} cycles "
                   f"({self.report.estimated_seconds * 1e3:.3f} ms emulated), peak tile "
                   f"memory {int(np.max(self.report.memory_per_tile)):,} B")
    text = "\n".join(lines)
    if print_fn is not None:
      print_fn(text)
    return text
