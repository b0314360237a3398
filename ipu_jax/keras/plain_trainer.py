"""The plain (not pipelined) executions of a Keras-like ``Model``.

:class:`Programs` builds and caches the model's compiled executions (train,
eval, predict: :mod:`ipu_jax.keras.programs`), places the training state on
the replicas and turns what an execution returns into host sums;
:class:`PlainTrainer` is plain ``fit``'s side of the one training loop
(:mod:`ipu_jax.keras.epoch_loop`): one execution of the training program per
call. ``evaluate`` and ``predict`` (of plain and pipelined models alike) run
:class:`Programs`' eval and predict programs.

This is ``Model``'s own machinery, split out of ``keras/model.py``: it reads
and writes the model's training state as the model holds it (on the
replicas' devices), syncing the module only when the loop asks.
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ipu_jax.keras import loss_scaling
from ipu_jax.keras import offload as offload_lib
from ipu_jax.keras import programs
from ipu_jax.keras.loop import FitPlan, RunningSums
from ipu_jax.keras.replication import GATHERED, SUMMED
from ipu_jax.keras.train_state import FIELDS, INFERENCE_FIELDS, TRAINED_FIELDS
from ipu_jax.lowering.host_io import select_outputs

__all__ = ["Programs", "PlainTrainer"]


class Programs:
  """A model's compiled executions, built once per shape key.

  Attributes:
    model: the :class:`~ipu_jax.keras.Model`.
    verbose: the compile-progress verbosity (``fit``/``evaluate(verbose=0)``
      set 0, which silences it; ``None``: the config's).
    last_program: the name of the program that ran last (``"train"``,
      ``"eval"`` or ``"predict"``), whose report ``Model.report`` shows
      before ``fit``.
  """

  def __init__(self, model):
    self.model = model
    self.verbose: Optional[int] = None
    self.last_program: Optional[str] = None
    self._cache: dict = {}

  def reset(self) -> None:
    """Forgets the compiled programs (after ``compile`` or new accumulation options)."""
    self._cache = {}

  # -- settings ---------------------------------------------------------------------

  def lowering_config(self):
    """The model's config with the replicas of the whole run (the all-reduce spans them)."""
    cfg = self.model.config.copy()
    cfg.replication_factor = self.model.num_replicas
    return cfg

  def shards_optimizer_state(self) -> bool:
    """Whether replicated tensor sharding is on for this model."""
    return offload_lib.shards_state(self.model.config, self.model.num_replicas)

  def place(self) -> None:
    """Puts the training state on the replicas' devices (a no-op once there)."""
    model = self.model
    model.placed_train_state = model.placed_train_state.place(model.replication,
                                                  self.shards_optimizer_state())

  # -- reports ----------------------------------------------------------------------

  def record_report(self, program: str, lowered, micro_batch: int) -> None:
    """Keeps ``lowered``'s report as the model's report of ``program``."""
    self.last_program = program
    if lowered is None:
      return
    if lowered.profile.run_setup is None:
      model = self.model
      lowered.profile.run_setup = programs.run_setup(
          program, self.lowering_config(), model.params, micro_batch=micro_batch,
          replicas=model.num_replicas, accumulation_steps=model.gradient_accumulation_steps,
          accumulation_reduction=model.gradient_accumulation_reduction,
          replica_reduction=model.replica_reduction,
          steps_per_execution=model.steps_per_execution)
    model = self.model
    model.reports[program] = lowered.report

  # -- the programs -----------------------------------------------------------------

  def _build(self, key, execution, data, **fields) -> programs.StateProgram:
    if key not in self._cache:
      model = self.model
      self._cache[key] = programs.build_state_program(
          execution, model.placed_train_state, data,
          sharded_optimizer_state=self.shards_optimizer_state(),
          replication=model.replication, config=self.lowering_config(),
          emulate=model.emulate, verbose=self.verbose, **fields)
    return self._cache[key]

  def train(self, xs, ys) -> programs.StateProgram:
    """The program of one training execution (U updates of G micro-batches)."""
    model = self.model
    G, R = model.gradient_accumulation_steps, model.num_replicas
    method = model.gradient_accumulation_reduction
    key = ("train", G, method, R, programs.shape_key((xs, ys)))
    execution = programs.train_execution(programs.TrainStep(
        model.adapter, model.optimizer, model.loss, model.metrics, G, method, R,
        model.replica_reduction, sharded_state=self.shards_optimizer_state()))
    return self._build(key, execution, [xs, ys, model.replication.replica_ids],
                       in_fields=FIELDS, out_fields=TRAINED_FIELDS, result_kind=SUMMED)

  def eval(self, xs, ys, mask) -> programs.StateProgram:
    """The program of one evaluate execution (masked sums of loss and metrics)."""
    model = self.model
    key = ("eval", model.num_replicas, programs.shape_key((xs, ys, mask)))
    execution = programs.eval_execution(model.adapter, model.loss, model.metrics)
    return self._build(key, execution, [xs, ys, mask], in_fields=INFERENCE_FIELDS,
                       out_fields=(), result_kind=SUMMED)

  def predict(self, xs) -> programs.StateProgram:
    """The program of one predict execution (the outputs of every step)."""
    model = self.model
    key = ("predict", model.num_replicas, programs.shape_key(xs))
    execution = programs.predict_execution(model.adapter)
    return self._build(key, execution, [xs], in_fields=INFERENCE_FIELDS, out_fields=(),
                       result_kind=GATHERED)

  def host_sums(self, program, sums) -> np.ndarray:
    """One ``[loss, metrics..., count]`` vector from what ``outputs.mode``
    returned of an execution's per-step sums (docs/host_side.md#output-modes)."""
    sums = np.asarray(sums)
    outputs = self.model.config.outputs
    if program.lowered is None and outputs.mode != "all":  # plain JAX: select as the device does
      sums = select_outputs(sums, outputs.mode, outputs.return_period, 0, np)
    return sums.astype(np.float64).sum(axis=0) if sums.ndim == 2 else sums


class PlainTrainer:
  """Plain ``fit``'s executions (:class:`~ipu_jax.keras.epoch_loop.Trainer`).

  Each call of :meth:`execution` runs the training program once: S
  micro-batch steps, U = S / (G R) weight updates, on the replicas.
  """

  def __init__(self, model, programs_: Programs):
    self.model = model
    self.programs = programs_

  @property
  def accumulation(self) -> int:
    """G, micro-batches per replica per weight update."""
    return self.model.gradient_accumulation_steps

  def prepare(self, plan: FitPlan) -> None:
    """Places the state, then lowers and compiles the training program, so a
    program that cannot be lowered or does not fit fails before any callback."""
    self.programs.place()
    self.programs.train(*map(plan.layout, plan.source.example))

  def execution(self, plan: FitPlan, xb, yb, running: RunningSums) -> dict:
    """Runs one execution of the training program on ``(xb, yb)``; returns its logs."""
    model, rep = self.model, self.model.replication
    xs, ys = plan.layout(xb), plan.layout(yb)
    program = self.programs.train(xs, ys)
    start = time.perf_counter()
    trained, sums = program(model.placed_train_state, rep.feed(xs), rep.feed(ys),
                            rep.feed(rep.replica_ids))
    model.placed_train_state = model.placed_train_state.merge(trained)
    running.add(self.programs.host_sums(program, rep.fetch(sums)))
    host_seconds = time.perf_counter() - start
    logs = running.logs()
    lowered = program.lowered
    self.programs.record_report("train", lowered, plan.batch_size)
    report = lowered.report if lowered is not None else None
    if report is not None:
      logs["host_round_trips"] = report.host_round_trips
      logs["emulated_seconds"] = report.estimated_seconds
    logs.update(loss_scaling.scaling_logs(model.placed_train_state.opt_state))
    model.record_number_formats(logs, report)
    logs["samples"] = plan.steps_per_execution * plan.batch_size
    logs["host_seconds"] = host_seconds
    return logs

  def end_epoch(self) -> None:
    """Writes the trained variables into the module (once per epoch, not per execution)."""
    self.model._sync_module()
