"""Flags and plumbing shared by the experiment runners.

Every runner takes the same flags (absl)::

  --target ipu1|ipu2|ipu21|bow    IPU generation: every preset of
                                  ipu_jax.IPUTarget (default ipu2)
  --tiles_per_ipu N               tiles per IPU; 0 = the chip's (1,472 on ipu2)
  --ipus_per_replica N            IPUs each replica spans
  --replicas N                    data-parallel replicas (of this process)
  --accumulation_steps G          gradient accumulation steps per replica
  --reduction sum|mean            accumulation and replica reduction
  --steps_per_execution S         on-device loop length; 0 = the least
                                  multiple of G x R that is >= 8
  --epochs, --learning_rate, --batch_size (micro-batch per replica), --seed
  --report_dir DIR                where the final report is written
  --data_dir DIR                  real data (else the runner's default)
  --emulate / --noemulate         emulate the IPU (default) or run plain JAX
  --coordinator_address host:port, --num_processes N, --process_id I
                                  join a multi-process run (jax.distributed
                                  with gloo CPU collectives); --replicas then
                                  counts this process's replicas

A runner module defines ``DEFAULTS`` (its epochs, learning rate, batch size,
report directory) and ``run(settings)``; :func:`settings_from_flags` fills a
:class:`Settings` from the flags, each flag left unset taking the runner's
default, so tests can call ``run`` directly. A count below its least value
(``--batch_size 0``, ``--replicas 0``) is refused when the flags are parsed,
and by ``Settings`` when one is made by hand, naming the field and its flag.
A runner adopts these flags as its own (``flags.adopt_module_key_flags(common)``),
so its ``--help`` lists them beside its own; :func:`main_for` prints an
out-of-memory or lowering error's message (not its traceback) and exits with
status 1.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

from absl import app, flags, logging

from experiments.entry import prepare_outputs
from experiments.entry import quiet_backend_probe, reporting_errors  # noqa: F401 (re-exported)
from ipu_jax.kernels.target import PRESETS

FLAGS = flags.FLAGS


# The least value of each count (the flags refuse less when parsed, and a
# Settings made by hand when built): 0 where it means "the default".
_LEAST = {"tiles_per_ipu": 0, "ipus_per_replica": 1, "replicas": 1, "accumulation_steps": 1,
          "steps_per_execution": 0, "epochs": 1, "batch_size": 1, "verbose": 0,
          "num_processes": 1, "process_id": 0, "num_samples": 0}


def _define(define, name, default, help_text, **kwargs):
  if name in FLAGS:
    return
  if name in _LEAST:
    kwargs["lower_bound"] = _LEAST[name]
  if "enum_values" in kwargs:
    define(name, default, kwargs.pop("enum_values"), help_text, **kwargs)
  else:
    define(name, default, help_text, **kwargs)


_define(flags.DEFINE_enum, "target", "ipu2", "IPU generation to emulate.",
        enum_values=sorted(PRESETS))
_define(flags.DEFINE_integer, "tiles_per_ipu", 0, "Tiles per IPU; 0 = every tile of the chip.")
_define(flags.DEFINE_integer, "ipus_per_replica", 1, "IPUs each replica spans.")
_define(flags.DEFINE_integer, "replicas", 1, "Data-parallel replicas (in this process).")
_define(flags.DEFINE_integer, "accumulation_steps", 1,
        "Gradient accumulation steps per replica (G).")
_define(flags.DEFINE_enum, "reduction", "mean",
        "How accumulated and replicated gradients are combined.",
        enum_values=["sum", "mean"])
_define(flags.DEFINE_integer, "steps_per_execution", 0,
        "Steps per execution (a multiple of G x R); 0 = the least multiple >= 8.")
_define(flags.DEFINE_integer, "epochs", None, "Epochs (default: the runner's).")
_define(flags.DEFINE_float, "learning_rate", None, "Learning rate (default: the runner's).")
_define(flags.DEFINE_integer, "batch_size", None,
        "Micro-batch per replica (default: the runner's).")
_define(flags.DEFINE_integer, "seed", 0, "Random seed.")
_define(flags.DEFINE_string, "report_dir", None,
        "Directory for the final report (default: reports/<runner>).")
_define(flags.DEFINE_string, "data_dir", None, "Directory of real data (runner-specific).")
_define(flags.DEFINE_boolean, "emulate", True,
        "Run on the emulated IPU; --noemulate runs the same loop with plain jax.jit.")
_define(flags.DEFINE_integer, "verbose", 2, "0 silent, 1 progress bar, 2 a line per epoch.",
        upper_bound=2)
_define(flags.DEFINE_string, "coordinator_address", None,
        "host:port of process 0 of a multi-process run.")
_define(flags.DEFINE_integer, "num_processes", 1, "Processes in a multi-process run.")
_define(flags.DEFINE_integer, "process_id", 0, "This process's index in a multi-process run.")
_define(flags.DEFINE_integer, "num_samples", 0,
        "Samples of synthetic data to generate (runner-specific default when 0).")


@dataclasses.dataclass
class Settings:
  """What a runner needs; :func:`settings_from_flags` or set by hand."""

  target: str = "ipu2"
  tiles_per_ipu: int = 0
  ipus_per_replica: int = 1
  replicas: int = 1
  accumulation_steps: int = 1
  reduction: str = "mean"
  steps_per_execution: int = 0
  epochs: int = 1
  learning_rate: float = 1e-3
  batch_size: int = 32
  seed: int = 0
  report_dir: Optional[str] = None
  data_dir: Optional[str] = None
  emulate: bool = True
  verbose: int = 2
  coordinator_address: Optional[str] = None
  num_processes: int = 1
  process_id: int = 0
  num_samples: int = 0

  def __post_init__(self):
    for name, least in _LEAST.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"Settings.{name} must be an int >= {least} (--{name}); "
                         f"got {value!r}.")
    if self.process_id >= self.num_processes:
      raise ValueError(f"Settings.process_id={self.process_id} must be below "
                       f"num_processes={self.num_processes} (--process_id, --num_processes).")
    if self.num_processes > 1 and not self.coordinator_address:
      raise ValueError("--num_processes > 1 needs --coordinator_address host:port.")

  @property
  def resolved_steps_per_execution(self) -> int:
    unit = self.accumulation_steps * self.replicas * max(self.num_processes, 1)
    if self.steps_per_execution:
      return self.steps_per_execution
    return unit * max(1, -(-8 // unit))


def settings_from_flags(defaults: dict) -> Settings:
  """Settings from the parsed flags; unset flags take ``defaults``."""
  values = {}
  for field in dataclasses.fields(Settings):
    name = field.name
    value = FLAGS[name].value
    if value is None or (not FLAGS[name].present and name in defaults):
      value = defaults.get(name, field.default)
    values[name] = value
  return Settings(**values)


def main_for(run: Callable[[Settings], dict], defaults: dict) -> Callable:
  """The ``absl.app`` main of a runner: its flags read as ``Settings`` over
  the runner's ``defaults``, then ``run`` (errors as :func:`reporting_errors`)."""

  @reporting_errors
  def main(argv):
    del argv
    try:
      settings = settings_from_flags(defaults)
      check_paths(settings)
    except ValueError as e:  # flags that do not go together, named in the message
      raise app.UsageError(str(e)) from None
    run(settings)

  return main


def check_paths(settings: Settings) -> None:
  """The directories a run reads and writes, checked (and the report's made)
  before it trains: a report directory that is a file would fail only when
  the report is saved, at the end (:func:`experiments.entry.prepare_outputs`).

  Raises:
    ValueError: ``--data_dir`` not a directory, or ``--report_dir`` a file,
      naming the flag.
  """
  if settings.data_dir and not os.path.isdir(settings.data_dir):
    raise ValueError(f"--data_dir={settings.data_dir} is not a directory (the runner reads "
                     f"its data files from it; leave it out for the built-in data).")
  prepare_outputs(directories=[("--report_dir", settings.report_dir)])


def setup_devices(settings: Settings) -> None:
  """Joins a distributed run, or exposes one CPU device per replica.

  Must run before anything touches a JAX backend.
  """
  import jax
  quiet_backend_probe()
  if settings.num_processes > 1:
    from ipu_jax.keras.replication import initialize_distributed
    initialize_distributed(settings.coordinator_address, settings.num_processes,
                           settings.process_id, local_device_count=settings.replicas)
    logging.info("joined %d processes as process %d", settings.num_processes,
                 settings.process_id)
  elif settings.replicas > 1:
    try:
      jax.config.update("jax_num_cpu_devices", max(settings.replicas, 1))
    except Exception as e:  # the backend is already up: replicas are vmapped
      logging.info("could not set the CPU device count (%s); replicas will be vmapped", e)


def make_config(settings: Settings):
  """The IPUConfig the settings describe."""
  import ipu_jax
  cfg = ipu_jax.IPUConfig()
  cfg.device.version = settings.target
  cfg.device.tiles_per_ipu = settings.tiles_per_ipu
  cfg.auto_select_ipus = settings.ipus_per_replica
  cfg.replication_factor = settings.replicas
  cfg.training.gradient_accumulation_steps = settings.accumulation_steps
  cfg.training.gradient_accumulation_reduction = settings.reduction
  cfg.training.replica_reduction = settings.reduction
  if settings.seed is not None:
    cfg.random_seed = settings.seed
  return cfg


def describe(settings: Settings, cfg, name: str) -> str:
  """The run's first line: target, replicas, batches, and how gradients are reduced."""
  target = cfg.to_target()
  replicas = settings.replicas * max(settings.num_processes, 1)
  verb = "averaged" if settings.reduction == "mean" else "summed"
  return (f"{name}: {target.name}, {target.num_ipus} IPU(s) x {target.tiles_per_ipu:,} "
          f"tiles per replica, {settings.replicas} replica(s) x "
          f"{max(settings.num_processes, 1)} process(es), G={settings.accumulation_steps}, "
          f"S={settings.resolved_steps_per_execution}, "
          f"micro-batch {settings.batch_size}, lr {settings.learning_rate}, "
          f"{settings.epochs} epoch(s), {'emulated' if settings.emulate else 'plain JAX'}; "
          f"gradients {verb} over the {settings.accumulation_steps} micro-batch(es) and "
          f"{replicas} replica(s) (--reduction {settings.reduction})")


def whole_executions(num_samples: int, settings: Settings) -> Optional[int]:
  """Steps per epoch that run whole executions, or None when the data is too small.

  ``fit`` runs whole executions of ``steps_per_execution`` micro-batches; a
  runner passes this as ``steps_per_epoch`` and says what it leaves out,
  where ``fit`` would warn about it.
  """
  S = settings.resolved_steps_per_execution
  steps = num_samples // settings.batch_size // S * S
  return steps or None


def train_and_evaluate(settings: Settings, module, train, test, name: str,
                       model_name: str, configure=None) -> dict:
  """The runners' shared body: fit ``module`` on the emulated IPU, evaluate, report.

  Builds the config from the flags, opens an ``IPUStrategy`` scope, compiles a
  Keras-like model (adam, sparse categorical cross-entropy, accuracy), fits,
  evaluates on ``test``, prints the report and saves it.

  Args:
    settings: the parsed flags.
    module: a Flax module (NNX, or linen with a sample input in the model).
    train, test: ``(x, y)`` pairs of host arrays.
    name: the runner's name (report folder, log lines).
    model_name: the model's name in summaries.
    configure: optional ``configure(cfg)`` applying a runner's own flags to
      the ``IPUConfig`` (e.g. the transformer's streaming-memory flags).

  Returns:
    The results: test loss and accuracy, training accuracy, executions, host
    round trips, fit seconds, report directory and the emulated timing.
  """
  import optax
  import ipu_jax.keras
  from ipu_jax.strategy import IPUStrategy

  cfg = make_config(settings)
  if configure is not None:
    configure(cfg)
  print(describe(settings, cfg, name))
  with IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(module, seed=settings.seed, name=model_name)
    model.compile(optimizer=optax.adam(settings.learning_rate),
                  loss="sparse_categorical_crossentropy", metrics=["accuracy"],
                  steps_per_execution=settings.resolved_steps_per_execution,
                  emulate=settings.emulate)
    model.summary()
    steps = whole_executions(len(train[0]), settings)
    if steps is not None and steps * settings.batch_size < len(train[0]):
      print(f"fit: {steps // settings.resolved_steps_per_execution} execution(s) of "
            f"{settings.resolved_steps_per_execution} x {settings.batch_size} samples per "
            f"epoch; each epoch leaves out {len(train[0]) - steps * settings.batch_size} of "
            f"the {len(train[0])} (a new shuffle each epoch)")
    with Timer() as timer:
      history = model.fit(*train, batch_size=settings.batch_size,
                          epochs=settings.epochs, verbose=settings.verbose,
                          steps_per_epoch=steps)
    evaluation = model.evaluate(*test, batch_size=settings.batch_size, verbose=0)
  results = {
      "test_loss": evaluation["loss"], "test_accuracy": evaluation["accuracy"],
      "train_accuracy": history.history["accuracy"][-1],
      "executions": history.executions, "host_round_trips": history.host_round_trips,
      "fit_seconds": timer.seconds,
  }
  return finish(model, settings, results, name)


def finish(model, settings: Settings, results: dict, name: str) -> dict:
  """Prints the final report summary and writes it to ``report_dir``."""
  import jax
  report = model.train_report or model.report
  report_dir = settings.report_dir or os.path.join("reports", name)
  if report is not None:
    print(report.summary(), end="")  # as `python -m ipu_jax.report DIR` prints it
    if jax.process_index() == 0:
      report.save(report_dir)
      print(f"report written to {report_dir}")
    results["report_dir"] = report_dir
    results["estimated_seconds_per_execution"] = report.estimated_seconds
    results["tiles_used"] = report.tiles_used
  print(" - ".join(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}"
                   for k, v in results.items()))
  return results


class Timer:
  def __enter__(self):
    self.start = time.perf_counter()
    return self

  def __exit__(self, *exc):
    self.seconds = time.perf_counter() - self.start
