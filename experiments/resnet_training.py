r"""ResNet-50 training, data parallel over IPUs, laid out as Graphcore ran it.

The model is :mod:`experiments.resnet_models` (ResNet-50 v1.5, batch norm
with each replica's statistics). Each replica is **one IPU**; the model is
cut into stages that all sit on that IPU (``--pipeline_splits``, the
examples' ``pipeline_splits`` with ``shards: 1``), run one after another
(the ``Sequential`` schedule) with recomputation: each stage's forward runs
again in its backward, the split points being the checkpoints. Gradients
are accumulated over ``--gradient_accumulation`` micro-batches and averaged
over ``--replicas`` (the all-reduce priced over ``--system``'s links, as
the BERT runner's replicas are: :class:`ipu_jax.pipelining.Pipeline`'s
throughput, :mod:`ipu_jax.pipelining.throughput`); the optimiser is momentum
SGD or LARS (``--optimizer``), as the examples' MLPerf configs.

``--config`` takes a preset (:mod:`experiments.resnet_presets`,
docs/published_resnet.md); every flag given overrides it. ``--estimate_only``
lowers each stage's programs once (abstract weights, nothing runs) and
prints the estimate; ``--json_out`` writes it (``samples_per_second``,
``step_seconds``, ``breakdown``, ``fits``, ``per_ipu_peak_bytes``,
``lower_seconds``, ``peak_rss_bytes``, the BERT runner's keys)::

    python -m experiments.resnet_training --config mlperf_v1_1_pod16 --estimate_only \
        --json_out reports/resnet_pod16.json
    python -m experiments.resnet_training --config mlperf_v1_1_pod16 --system bow-pod16 \
        --micro_batch 22 --estimate_only

Without ``--estimate_only`` it trains ``--steps`` steps on synthetic images;
``--check`` also trains plain JAX gradient accumulation on the same data and
prints the largest weight difference (``--config tiny_check --check``).
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import entry  # noqa: E402
from experiments import resnet_presets as presets  # noqa: E402

_FLAGS = flags.FLAGS
OPTIMIZERS = ("momentum", "lars", "sgd")
MODELS = ("tiny", "resnet50")
DTYPES = ("float32", "float16")
PARTIALS = ("float32", "float16")


def define_flags(fv=None):
  """Defines the runner's flags in ``fv`` (default the global FLAGS) and returns it.

  Called when the runner runs, not on import (other runners share names).
  Values are checked by :func:`check_flags`, which names the flag and the
  valid values.
  """
  fv = flags.FLAGS if fv is None else fv
  d = dict(flag_values=fv)
  flags.DEFINE_string("config", None, f"A preset: {', '.join(sorted(presets.PRESETS))} "
                      "(docs/published_resnet.md); flags given override it.", **d)
  flags.DEFINE_string("model", "tiny", f"One of {', '.join(MODELS)}.", **d)
  flags.DEFINE_string("system", None, "The IPU system (kernels/systems.py): pod16, pod64, "
                      "bow-pod16, ...; none: the flat one-IPU-Link model.", **d)
  flags.DEFINE_integer("replicas", 2, "Data-parallel replicas, one IPU each.", **d)
  flags.DEFINE_integer("micro_batch", 2, "Images per micro-batch.", **d)
  flags.DEFINE_integer("gradient_accumulation", 2, "Micro-batches per weight update (G).", **d)
  flags.DEFINE_integer("updates_per_execution", 1, "Weight updates one execution of the "
                       "device program runs (the host's fixed time per execution, "
                       "IPUSystem.execution_overhead_seconds, is shared by them).", **d)
  flags.DEFINE_string("dtype", "float32", f"Weights and activations: {', '.join(DTYPES)}.", **d)
  flags.DEFINE_integer("image_size", 16, "Images are image_size x image_size x 3.", **d)
  flags.DEFINE_list("pipeline_splits", ["stage1/unit1/relu"],
                    "Units after which a new stage (same IPU) begins.", **d)
  flags.DEFINE_boolean("recomputation", True, "Recompute each stage's forward in its "
                       "backward.", **d)
  flags.DEFINE_float("conv_proportion", 0.6, "Available memory proportion of convolutions "
                     "(the examples' available_memory_proportion; PopLibs' default 0.6).", **d)
  flags.DEFINE_float("matmul_proportion", 0.6, "Available memory proportion of matmuls (the "
                     "final dense layer; PopLibs' default 0.6).", **d)
  flags.DEFINE_string("partials_type", "float32", f"Partial sums of convolutions and matmuls: "
                      f"{', '.join(PARTIALS)} (the examples' enable_half_partials: "
                      "float16).", **d)
  flags.DEFINE_string("optimizer", "momentum", f"One of {', '.join(OPTIMIZERS)}.", **d)
  flags.DEFINE_float("learning_rate", 0.1, "Learning rate.", **d)
  flags.DEFINE_integer("tiles_per_ipu", 16, "Tiles per IPU (the presets: 1,472).", **d)
  flags.DEFINE_integer("steps", 1, "Training steps (weight updates).", **d)
  flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.", **d)
  flags.DEFINE_boolean("check", False, "Compare with plain JAX gradient accumulation.", **d)
  flags.DEFINE_boolean("estimate_only", False, "Lower once and print the estimate; run "
                       "nothing.", **d)
  flags.DEFINE_string("json_out", None, "Write the run's figures to this JSON file.", **d)
  flags.DEFINE_string("report_dir", None, "Where to write the pipeline and stage reports.", **d)
  return fv


def apply_preset(f) -> None:
  """Set the flags of ``--config``'s preset that the command line did not give.

  Raises:
    ValueError: an unknown preset, naming the valid ones.
  """
  if not f.config:
    return
  if f.config not in presets.PRESETS:
    raise ValueError(f"--config={f.config!r} is not a preset; valid presets are "
                     f"{sorted(presets.PRESETS)}.")
  for name, value in presets.PRESETS[f.config].items():
    if not f[name].present:
      setattr(f, name, list(value) if isinstance(value, list) else value)


def _choice(f, name: str, valid) -> None:
  if getattr(f, name) not in valid:
    raise ValueError(f"--{name}={getattr(f, name)!r} is not valid; valid values are "
                     f"{list(valid)}.")


def check_flags(f) -> None:
  """Refuse bad settings before anything is built, naming the flag and what is valid.

  Raises:
    ValueError: an unknown model, dtype, optimiser or system; a count below 1;
      a proportion outside (0, 1]; an image too small for the stem; a split
      naming no unit; more replicas than the system has IPUs.
  """
  from ipu_jax.kernels.systems import SYSTEM_PRESETS, check_capacity, system_preset
  from experiments import resnet_models
  _choice(f, "model", MODELS)
  _choice(f, "dtype", DTYPES)
  _choice(f, "optimizer", OPTIMIZERS)
  if f.system is not None:
    _choice(f, "system", sorted(SYSTEM_PRESETS))
  for name in ("replicas", "micro_batch", "gradient_accumulation", "updates_per_execution",
               "tiles_per_ipu", "steps"):
    if getattr(f, name) < 1:
      raise ValueError(f"--{name}={getattr(f, name)} must be >= 1.")
  _choice(f, "partials_type", PARTIALS)
  for name in ("conv_proportion", "matmul_proportion"):
    if not 0.0 < getattr(f, name) <= 1.0:
      raise ValueError(f"--{name}={getattr(f, name)} must be in (0, 1].")
  mcfg = model_config(f)
  smallest = 4 * 2 ** len(mcfg.units)  # stem /4, each later stage /2: at least 2 x 2 left
  if f.image_size < smallest:
    raise ValueError(f"--image_size={f.image_size} is too small for the {f.model} model; it "
                     f"must be >= {smallest}.")
  resnet_models.stage_assignment(mcfg, f.pipeline_splits)  # names a bad split
  if f.system:
    try:
      check_capacity(system_preset(f.system), f.replicas, 1, "--replicas", "IPUs per replica")
    except ValueError as e:
      raise ValueError(f"--system={f.system}: {e}") from None


def model_config(f):
  import jax.numpy as jnp
  from experiments import resnet_models
  dtype = jnp.dtype(f.dtype).type
  return (resnet_models.resnet50 if f.model == "resnet50" else resnet_models.tiny_resnet)(dtype)


def ipu_config(f):
  """One replica's IPUConfig: one IPU, the stages in sequence, replicas and G.

  The proportions and partials are set where Graphcore's examples set them:
  the MLPerf TensorFlow code (``ipu_utils.py`` ``get_config`` in
  ``github.com/mlcommons/training_results_v1.1``, commit ``ebe92f81``,
  ``Graphcore/benchmarks/resnet/implementations/tensorflow/``) puts its one
  ``available_memory_proportion`` in ``config.convolutions.poplar_options``
  only (matmuls keep PopLibs' default) and ``enable_half_partials`` in both
  the convolutions' and the matmuls' ``partialsType``; PopTorch's
  ``setAvailableMemoryProportion`` (the PyTorch example) covers both. v1.0's
  (``50619b5d``) does the same with ``utils.set_convolution_options``, v2.0's
  (``8437fbb7``) as v1.1's.
  """
  import ipu_jax
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = f.tiles_per_ipu
  cfg.auto_select_ipus = 1
  cfg.replication_factor = f.replicas
  cfg.training.gradient_accumulation_steps = f.gradient_accumulation
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.pipelining.schedule = "Sequential"
  cfg.pipelining.recomputation = f.recomputation
  cfg.convolutions.available_memory_proportion = f.conv_proportion
  cfg.matmuls.available_memory_proportion = f.matmul_proportion
  cfg.matmuls.partials_type = f.partials_type  # the convolutions' too (lowering/options.py)
  cfg.system = f.system
  return cfg


def optimizer(f):
  """The examples' optimisers: momentum 0.9 (v1.0) or LARS (v1.1, v2.0) with
  their weight decay (``weight_decay`` / ``lars_weight_decay`` 5e-5)."""
  import optax
  if f.optimizer == "lars":
    return optax.lars(f.learning_rate, weight_decay=5e-5, momentum=0.9)
  if f.optimizer == "momentum":
    return optax.sgd(f.learning_rate, momentum=0.9)
  return optax.sgd(f.learning_rate)


def build_pipeline(f, mcfg) -> tuple:
  """``(pipe, loss_fn, optimizer, params, state)``; abstract weights with ``--estimate_only``."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  import ipu_jax
  from experiments import bert_pretraining, resnet_models
  assignment = resnet_models.stage_assignment(mcfg, f.pipeline_splits)
  stages = max(assignment.values()) + 1
  cfg = ipu_config(f)
  opt = optimizer(f)
  make = lambda: resnet_models.ResNet(mcfg, rngs=nnx.Rngs(f.seed))
  if f.estimate_only:
    cfg.memory.allow_out_of_memory = True
    with ipu_jax.cheap_tracer_probes():  # linear in the model's size, not quadratic
      model = nnx.eval_shape(make)
    opt = bert_pretraining.abstract_init(opt)
  else:
    model = make()
  loss_fn, params, state = resnet_models.make_loss(model)
  # The batch-norm statistics are concrete even when estimating (the
  # pipeline stacks the state per micro-batch; ResNet-50's are 0.2 MB).
  state = jax.tree_util.tree_map(
      lambda s: jnp.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct) else s, state)
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, opt, config=cfg, device_mapping=[0] * stages,
                                     stage_assignment=assignment, mutable=True)
  return pipe, loss_fn, opt, params, state


def estimate(f, pipe, params, state, mcfg) -> dict:
  """Lower the pipeline once (``G x R`` micro-batches as views of one) and read it."""
  import jax
  from experiments import resnet_models
  one = resnet_models.synthetic_batches(mcfg, 1, f.micro_batch, f.image_size, f.seed)
  per_step = f.gradient_accumulation * f.replicas
  batches = jax.tree_util.tree_map(
      lambda b: np.broadcast_to(b, (per_step,) + b.shape[1:]), one)
  start = time.time()
  pipe.lower(params, batches, state=state)
  return figures(f, pipe, time.time() - start)


def figures(f, pipe, lower_seconds: float) -> dict:
  """The JSON keys every pod runner writes, from a lowered pipeline."""
  from ipu_jax import host_time
  report = pipe.report
  report.steps_per_execution = f.updates_per_execution * f.gradient_accumulation * f.replicas
  tp = report.throughput
  memory = report.memory_per_ipu()
  limit = pipe.target.bytes_per_tile
  return {"config": f.config, "model": f.model, "system": f.system, "replicas": f.replicas,
          "micro_batch": f.micro_batch, "gradient_accumulation": f.gradient_accumulation,
          "dtype": f.dtype, "image_size": f.image_size,
          "samples_per_second": tp.samples_per_second, "step_seconds": tp.step_seconds,
          "breakdown": tp.breakdown, "lower_seconds": lower_seconds,
          "peak_rss_bytes": host_time.peak_rss_bytes(),
          "fits": all(m["max_tile_bytes"] <= limit for m in memory.values()),
          "per_ipu_peak_bytes": [memory[i]["total_bytes"] for i in sorted(memory)],
          "per_ipu_max_tile_bytes": [memory[i]["max_tile_bytes"] for i in sorted(memory)],
          "bytes_per_tile": limit}


def plain_steps(loss_fn, opt, params, state, data, replicas: int):
  """Weights and statistics after plain JAX accumulation, as the replicas do it.

  Each replica runs its ``G`` micro-batches from the step's statistics; the
  gradients are averaged over all ``G x R`` micro-batches, the statistics
  over the replicas' final ones.
  """
  import jax
  import optax
  grad = jax.jit(jax.grad(loss_fn, has_aux=True))
  opt_state = opt.init(params)
  mean = lambda trees: jax.tree_util.tree_map(lambda *t: sum(t) / len(t), *trees)
  for batches in data:
    n = len(batches["labels"])
    g_count = n // replicas
    grads, finals = [], []
    for r in range(replicas):
      s = state
      for m in range(r * g_count, (r + 1) * g_count):
        g, s = grad(params, jax.tree_util.tree_map(lambda b: b[m], batches), s)
        grads.append(g)
      finals.append(s)
    updates, opt_state = opt.update(mean(grads), opt_state, params)
    params, state = optax.apply_updates(params, updates), mean(finals)
  return params, state


def train(f, pipe, loss_fn, opt, params, state, mcfg) -> dict:
  """Train ``--steps`` steps on synthetic images; the run's figures (and ``--check``)."""
  from experiments import bert_pretraining, resnet_models
  per_step = f.gradient_accumulation * f.replicas
  data = [resnet_models.synthetic_batches(mcfg, per_step, f.micro_batch, f.image_size,
                                          f.seed + s) for s in range(f.steps)]
  start = time.time()
  opt_state = pipe.init(params, data[0], state=state)
  lower_seconds = time.time() - start
  trained, bn = params, state
  for step, batches in enumerate(data):
    out = pipe.step(trained, opt_state, batches, state=bn)
    trained, opt_state, bn = out.params, out.opt_state, out.state
    print(f"step {step}: loss {float(out.loss):.4f}")
  results = dict(figures(f, pipe, lower_seconds), final_loss=float(out.loss))
  if f.check:
    want_params, want_state = plain_steps(loss_fn, opt, params, state, data, f.replicas)
    results["max_relative_difference"] = max(
        bert_pretraining.max_relative_difference(trained, want_params),
        bert_pretraining.max_relative_difference(bn, want_state))
    print(f"Plain JAX gradient accumulation: largest difference "
          f"{results['max_relative_difference']:.2e} of the value's own scale")
  results["trained"] = (trained, bn)
  return results


def run(f) -> dict:
  """The runner on parsed flag values ``f``: estimate or train; the run's figures.

  Raises:
    app.UsageError: a bad flag (the message names it and the valid values).
  """
  try:
    apply_preset(f)
    check_flags(f)
    entry.prepare_outputs(files=[("--json_out", f.json_out)],
                          directories=[("--report_dir", f.report_dir)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  mcfg = model_config(f)
  pipe, loss_fn, opt, params, state = build_pipeline(f, mcfg)
  if f.estimate_only:
    results = estimate(f, pipe, params, state, mcfg)
  else:
    results = train(f, pipe, loss_fn, opt, params, state, mcfg)
  print(pipe.report.summary())
  print(f"Estimate ({f.config or 'flags'}, {f.model}, {f.replicas} replicas on "
        f"{f.system or 'no system'}): {results['samples_per_second']:,.1f} images/s, step "
        f"{results['step_seconds'] * 1e3:.2f} ms; fits: {results['fits']} (largest tile "
        f"{results['per_ipu_max_tile_bytes']} of {results['bytes_per_tile']:,d} B); lowered in "
        f"{results['lower_seconds']:.1f} s, peak RSS {results['peak_rss_bytes'] / 2**30:.2f} GiB")
  entry.write_outputs(pipe.report, {k: v for k, v in results.items() if k != "trained"},
                      f.report_dir, f.json_out)
  return results


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  run(_FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
