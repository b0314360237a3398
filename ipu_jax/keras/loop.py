"""The host side of the data loop: which samples each execution gets, and where.

One execution of the training program takes ``S * b`` samples (S steps per
execution, micro-batch b). :func:`train_source` says how ``fit`` draws them
from arrays (a seeded shuffle per epoch, whole executions only) or from an
iterable of micro-batches; :func:`eval_data` gathers evaluate/predict data into
arrays, whose last execution is padded (:func:`padded_executions`).

The layouts put the samples of an execution on the replicas:

* :func:`train_layout`: ``[S b, ...] -> [R_local, U, G, b, ...]``. Update u
  takes the consecutive samples ``[u R G b, (u + 1) R G b)`` and replica r a
  block of ``G b`` of them, so with mean reductions R replicas x G
  micro-batches train exactly as one replica with batch ``R G b``.
* :func:`eval_layout`: ``[S b, ...] -> [R_local, S / R, b, ...]``;
  :func:`gather_predictions` undoes it for the outputs.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import jax
import numpy as np

from ipu_jax.arguments import check_count
from ipu_jax.keras.data import ArrayData, host_dtype, is_array_like, num_samples, split_batch
from ipu_jax.keras.replication import Replication

__all__ = ["check_steps_per_execution", "RunningSums", "TrainSource", "train_source",
           "eval_data", "padded_executions", "padded_batches", "train_layout", "eval_layout",
           "gather_predictions", "gather_selected_predictions", "FitPlan"]

_DEFAULT_BATCH = 32


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


class RunningSums:
  """Host-side running sums ``[loss, metrics..., count]`` over an epoch."""

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


@dataclasses.dataclass
class TrainSource:
  """How ``fit`` draws the samples of each execution.

  Attributes:
    batch_size: the micro-batch b.
    executions: executions per epoch (``None``: until an iterable ends).
    batches: ``batches(epoch, shuffle)`` yields ``(x, y)`` of ``S * b``
      samples in order, one per execution.
    example: an ``(x, y)`` of one execution's shapes, to compile with.
    labels: labels to check against the loss before training.
  """
  batch_size: int
  executions: Optional[int]
  batches: Callable
  example: tuple
  labels: object


def _whole_executions(data: ArrayData, steps_per_execution: int,
                      steps_per_epoch: Optional[int]) -> int:
  S, b = steps_per_execution, data.batch_size
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


def _array_source(x, y, batch_size, steps_per_epoch, S, seed) -> TrainSource:
  if y is None:
    raise ValueError("fit with an array x needs labels y.")
  data = ArrayData(x, y, _DEFAULT_BATCH if batch_size is None else batch_size)
  executions = _whole_executions(data, S, steps_per_epoch)
  chunk = S * data.batch_size

  def batches(epoch, shuffle):
    # Seeded by (seed, epoch): a run resumed at an epoch sees the same order.
    order = (np.random.default_rng([seed, epoch]).permutation(data.n) if shuffle
             else np.arange(data.n))
    for e in range(executions):
      yield data.take(order[e * chunk:(e + 1) * chunk])

  used = executions * chunk
  if steps_per_epoch is None and used < data.n:
    # At the user's fit call: here <- train_source <- epoch_loop._plan <- epoch_loop.fit
    # <- Model.fit (plain and pipelined alike).
    warnings.warn(
        f"fit: {data.n - used} of {data.n} samples are left out of every epoch: an "
        f"epoch runs whole executions of steps_per_execution x batch_size = {S} x "
        f"{data.batch_size} = {chunk} samples ({executions} of them). Choose sizes "
        "that divide the data to use every sample.", stacklevel=6)
  example = data.take(np.zeros(chunk, np.int64))
  return TrainSource(data.batch_size, executions, batches, example, data.y)


def _iterable_source(x, batch_size, steps_per_epoch, S) -> TrainSource:
  iterator_once = iter(x) is x if hasattr(x, "__iter__") else True
  stream = {"it": None}
  it = x if iterator_once and hasattr(x, "__next__") else iter(x)
  peek = next(it, None)
  if peek is None:
    raise ValueError("fit: the dataset is empty.")
  if iterator_once:
    stream["it"] = it
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
  # The batch peeked at for the shapes is still the first one trained on.
  pending = [peek] if iterator_once else []

  def batches(epoch, shuffle):
    it = stream["it"] if iterator_once else iter(x)
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
  return TrainSource(b, executions, batches, example, host_dtype(py))


def train_source(x, y, batch_size: Optional[int], steps_per_epoch: Optional[int],
                 steps_per_execution: int, seed: int) -> TrainSource:
  """How ``fit`` draws ``[S * b, ...]`` samples per execution from ``x`` (and ``y``)."""
  if x is None:
    raise ValueError("fit needs data: x and y arrays, or x an iterable of (x, y) batches.")
  check_count("steps_per_epoch", steps_per_epoch, none="all the data")
  if y is not None or is_array_like(x):
    return _array_source(x, y, batch_size, steps_per_epoch, steps_per_execution, seed)
  return _iterable_source(x, batch_size, steps_per_epoch, steps_per_execution)


def eval_data(x, y, batch_size: Optional[int], steps: Optional[int]) -> ArrayData:
  """Evaluate/predict data as arrays (an iterable of batches is concatenated).

  Raises:
    ValueError: ``steps`` not None or an int >= 1, or no samples.
  """
  check_count("steps", steps, none="all the data")
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
  return ArrayData(x, y, _DEFAULT_BATCH if batch_size is None else batch_size)


def padded_executions(data: ArrayData, steps_per_execution: int) -> tuple:
  """``(executions, samples per execution)``, the last execution padded.

  Raises:
    ValueError: no samples (nothing to evaluate or predict; no execution runs).
  """
  if data.n == 0:
    raise ValueError("x has no samples: evaluate and predict need at least one.")
  chunk = steps_per_execution * data.batch_size
  return -(-data.n // chunk), chunk


def padded_batches(data: ArrayData, steps_per_execution: int, replication: Replication):
  """Yields ``(xs, ys, mask)`` of each evaluate/predict execution, laid out for the replicas.

  The last execution is filled up with copies of the last sample whose mask is
  0, so every sample counts exactly once. ``ys`` is ``None`` without labels.
  """
  executions, chunk = padded_executions(data, steps_per_execution)
  per_replica = steps_per_execution // replication.num_replicas
  for e in range(executions):
    index = np.arange(e * chunk, (e + 1) * chunk)
    mask = (index < data.n).astype(np.float32)
    xb, yb = data.take(np.minimum(index, data.n - 1))
    yield tuple(None if a is None else
                eval_layout(a, replication, data.batch_size, per_replica)
                for a in (xb, yb, mask))


def _local_replicas(a, replication: Replication):
  return a[replication.first_replica:replication.first_replica + replication.local_replicas]


def train_layout(batch, replication: Replication, batch_size: int, updates: int,
                 accumulation: int):
  """``[S * b, ...]`` samples in order -> this process's ``[R_local, U, G, b, ...]``."""
  R = replication.num_replicas

  def arrange(a):
    a = np.asarray(a).reshape((updates, R, accumulation, batch_size) + np.shape(a)[1:])
    return _local_replicas(np.swapaxes(a, 0, 1), replication)

  return jax.tree.map(arrange, batch)


def eval_layout(batch, replication: Replication, batch_size: int, steps_per_replica: int):
  """``[S * b, ...]`` -> this process's ``[R_local, S / R, b, ...]``."""
  R = replication.num_replicas

  def arrange(a):
    a = np.asarray(a).reshape((steps_per_replica, R, batch_size) + np.shape(a)[1:])
    return _local_replicas(np.swapaxes(a, 0, 1), replication)

  return jax.tree.map(arrange, batch)


def gather_predictions(outputs, replication: Replication):
  """Outputs ``[R, K, b, ...]`` of every replica -> ``[K R b, ...]`` in sample order."""

  def unarrange(a):
    a = np.swapaxes(replication.fetch_gathered(a), 0, 1)
    return a.reshape((-1,) + a.shape[3:])

  return jax.tree.map(unarrange, outputs)


def gather_selected_predictions(outputs, replication: Replication, mode: str):
  """Outputs of every replica after output ``mode``, in sample order.

  ``'all'`` and ``'every_n'`` keep a step axis (``[R, K', b, ...]``, as
  :func:`gather_predictions`); ``'final'`` and ``'sum'`` leave one
  micro-batch per replica (``[R, b, ...] -> [R b, ...]``).
  """
  if mode not in ("final", "sum"):
    return gather_predictions(outputs, replication)

  def unarrange(a):
    a = replication.fetch_gathered(a)
    return a.reshape((-1,) + a.shape[2:])

  return jax.tree.map(unarrange, outputs)


@dataclasses.dataclass(frozen=True)
class FitPlan:
  """How one ``fit`` call runs: the sizes of an execution, the data, the options.

  Attributes:
    accumulation: G, micro-batches per replica per weight update.
    replicas: R, replicas in the whole run.
    steps_per_execution: S, micro-batch steps (all replicas) per execution.
    source: the training data (:func:`train_source`).
    replication: the replicas' placement.
    verbose: 0, 1 or 2.
    shuffle: reshuffle array data each epoch.
    validation_data: evaluated after each epoch (``None``: none).
    validation_batch_size: its micro-batch (``None``: the training one).
    validate_inputs: check labels before the first step (and validation's).
  """
  accumulation: int
  replicas: int
  steps_per_execution: int
  source: TrainSource
  replication: Replication
  verbose: int
  shuffle: bool = True
  validation_data: object = None
  validation_batch_size: Optional[int] = None
  validate_inputs: bool = True

  @property
  def updates(self) -> int:
    """U, weight updates per execution."""
    return self.steps_per_execution // (self.accumulation * self.replicas)

  @property
  def batch_size(self) -> int:
    return self.source.batch_size

  def layout(self, batch):
    """An execution's samples as ``[R_local, U, G, b, ...]`` (:func:`train_layout`)."""
    return train_layout(batch, self.replication, self.batch_size, self.updates,
                        self.accumulation)

  def callback_params(self, epochs: int) -> dict:
    """The ``params`` the callbacks see (Keras's, and the IPU's sizes)."""
    S, executions = self.steps_per_execution, self.source.executions
    return {"epochs": epochs, "steps": None if executions is None else executions * S,
            "steps_per_execution": S, "verbose": self.verbose,
            "batch_size": self.batch_size, "replicas": self.replicas,
            "gradient_accumulation_steps": self.accumulation,
            "executions_per_epoch": executions}
