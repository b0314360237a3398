r"""Large language models on IPU-PODs as Graphcore's PopXL examples ran them.

The models are :mod:`experiments.llm_models` (GPT-J, GPT-3, Llama-2 in Flax
NNX, one tensor-parallel shard each); the presets mirror the public PopXL
configurations (:mod:`experiments.llm_presets`, docs/llm.md): phased
execution, a phase per decoder block, weights and optimizer state in
Streaming Memory (``ipu_jax.phased``), tensor parallelism inside each phase
(``ipu_jax.parallel``), data-parallel replicas with replicated tensor
sharding, batch serialisation.

``--estimate_only`` lowers each distinct phase program once (identical
decoder blocks share one) and prints the step's estimate beside two bounds:
the peak-FLOPs bound (model FLOPs per token -- 6 N for training, 2 N per
generated token for inference, plus attention -- against the IPUs' peak
float16 FLOPs) and the streaming-bandwidth bound (the bytes each IPU streams
a step against its Streaming Memory bandwidth); ``--json_out`` writes it::

    python -m experiments.llm --config gptj_6b_finetune_pod16 --estimate_only \
        --json_out gptj.json

``--config tiny_check --check`` trains a 4-layer GPT of width 128 with tensor
parallelism, phases and data-parallel replicas together for ``--steps``
steps and exits non-zero if its weights differ from plain JAX gradient
accumulation of the same model::

    python -m experiments.llm --config tiny_check --check

Every preset value is a flag (``--helpfull`` lists them); a flag given on the
command line overrides the preset. The overriding flags every runner of the
``pod`` suite shares work here too: ``--system``, ``--replicas`` (the
data-parallel replicas, ``--data_parallel``), ``--micro_batch``,
``--gradient_accumulation`` (G: the global batch becomes G x replicas x
micro-batch) and ``--dtype``; the JSON records ``replicas``,
``gradient_accumulation``, ``micro_batch`` and ``dtype`` beside the estimate. A preset whose model does not fit without
tensor parallelism or phases (``--tensor_parallel=1``, ``--nophased``)
reports the out-of-memory error naming the IPU and the remedy, exit status 1.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import entry  # noqa: E402
from experiments import llm_presets as presets  # noqa: E402

_FLAGS = flags.FLAGS
# Flags a preset sets (every key of every preset).
_PRESET_FIELDS = sorted({k for p in presets.PRESETS.values() for k in p})


def define_flags(fv=None):
  """Defines the runner's flags in ``fv`` (default the global FLAGS) and returns it."""
  fv = flags.FLAGS if fv is None else fv
  d = dict(flag_values=fv)
  flags.DEFINE_enum("config", None, sorted(presets.PRESETS),
                    "A preset mirroring Graphcore's public PopXL examples (docs/llm.md); every "
                    "flag given on the command line overrides it.", **d)
  flags.DEFINE_enum("model", "gpt3", ["gptj", "gpt3", "llama2"],
                    "Model family: gptj (parallel block, rotary), gpt3 (learned positions), "
                    "llama2 (RMSNorm, SwiGLU, rotary, KV cache).", **d)
  flags.DEFINE_enum("mode", "train", ["train", "inference"],
                    "train: a phased training step; inference: one generated token a step "
                    "with a KV cache.", **d)
  for name, default, help_ in (
      ("layers", 4, "Decoder blocks."), ("hidden", 128, "Hidden size."),
      ("heads", 4, "Attention heads."), ("ffn", 512, "Feed-forward (intermediate) size."),
      ("vocab_size", 256, "Vocabulary (a multiple of --tensor_parallel)."),
      ("max_positions", 16, "GPT-3's learned positions (>= --seq)."),
      ("seq", 16, "Sequence length (inference: the KV cache's length)."),
      ("micro_batch", 2, "Sequences per micro-batch."),
      ("global_batch", 16, "Sequences per weight update (all replicas); G = global / "
                           "(data_parallel x micro_batch)."),
      ("tensor_parallel", 2, "IPUs of a tensor-parallel group."),
      ("data_parallel", 2, "Data-parallel replicas of the group."),
      ("tiles_per_ipu", 16, "Tiles per IPU (the presets use all 1,472)."),
      ("steps", 3, "Training steps (--check)."), ("seed", 0, "Seed of the weights and data.")):
    flags.DEFINE_integer(name, default, help_, lower_bound=0 if name == "seed" else 1, **d)
  # The overriding flags every runner shares (bert_pretraining, resnet_training):
  # --replicas is --data_parallel; --gradient_accumulation sets --global_batch.
  flags.DEFINE_alias("replicas", "data_parallel", flag_values=fv)
  flags.DEFINE_integer("gradient_accumulation", None,
                       "G, micro-batches per replica per step: sets --global_batch to G x "
                       "--data_parallel x --micro_batch (give one of the two).", lower_bound=1,
                       **d)
  flags.DEFINE_integer("rotary_dim", 0, "Rotary features of each head (0: none).",
                       lower_bound=0, **d)
  flags.DEFINE_boolean("phased", True, "Phased execution (a phase per decoder block).", **d)
  flags.DEFINE_enum("phase_mode", "serial", ["serial", "ping_pong"],
                    "SerialPhasedExecution or ParallelPhasedExecution (ping-pong).", **d)
  for name, help_ in (("remote_weights", "Weights in Streaming Memory between phases."),
                      ("remote_optimizer_state", "Optimizer state in Streaming Memory."),
                      ("remote_activations", "Stored activations in Streaming Memory."),
                      ("rts", "Replicated tensor sharding of the remote state over the "
                              "data-parallel replicas."),
                      ("rts_activations", "Replicated tensor sharding of the stored "
                                          "activations over the tensor-parallel group."),
                      ("recompute", "Recompute each phase's forward in its backward."),
                      ("io_tiles", "Loads overlap compute, as with I/O tiles.")):
    flags.DEFINE_boolean(name, name not in ("io_tiles", "rts", "rts_activations"), help_, **d)
  flags.DEFINE_boolean("sequence_parallel", False,
                       "Megatron's sequence parallelism (Korthikanti et al. 2022): norms and "
                       "residual adds hold --seq / --tensor_parallel positions an IPU, the "
                       "phases' activations too (so --rts_activations must be off).", **d)
  flags.DEFINE_float("available_memory_proportion", 0.6,
                     "Fraction of each tile's memory a matmul may use for temporaries "
                     "(IPUConfig.matmuls.available_memory_proportion; Poplar's default 0.6; "
                     "the presets take their PopXL config's execution value).", **d)
  flags.DEFINE_enum("dtype", "float32", ["float32", "float16"], "Weights and activations.", **d)
  flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.", **d)
  flags.DEFINE_string("system", None, "The IPU system: pod4, pod16, pod64, pod256, ...", **d)
  flags.DEFINE_boolean("estimate_only", False, "Lower each distinct phase program once and "
                       "print the estimate; run nothing.", **d)
  flags.DEFINE_boolean("check", False, "Train --steps steps and compare the weights with "
                       "plain JAX gradient accumulation; exit 1 if they differ.", **d)
  flags.DEFINE_float("check_tolerance", 1e-5, "--check: largest relative weight difference.",
                     **d)
  flags.DEFINE_float("check_perturb", 0.0, "--check: scale the plain-JAX learning rate by "
                     "(1 + this), to show the comparison fails when the runs differ.", **d)
  flags.DEFINE_string("json_out", None, "Write the run's figures to this JSON file.", **d)
  return fv


# -- flags -> settings --------------------------------------------------------

def apply_preset(f) -> None:
  """Set the flags of ``--config``'s preset that the command line did not give."""
  if not f.config:
    return
  for name, value in presets.preset_values(f.config).items():
    if not f[name].present:
      setattr(f, name, value)
  apply_accumulation(f)


def apply_accumulation(f) -> None:
  """``--gradient_accumulation G``: the global batch of G micro-batches on every replica.

  Raises:
    app.UsageError: ``--global_batch`` given too, and not G x replicas x micro-batch.
  """
  if f.gradient_accumulation is None:
    return
  batch = f.gradient_accumulation * f.data_parallel * f.micro_batch
  if f["global_batch"].present and f.global_batch != batch:
    raise app.UsageError(
        f"--global_batch={f.global_batch} and --gradient_accumulation="
        f"{f.gradient_accumulation} disagree: G x --data_parallel x --micro_batch = {batch}; "
        "give one of the two.")
  f.global_batch = batch


def accumulation(f) -> int:
  """G: micro-batches per replica per step."""
  return f.global_batch // (f.data_parallel * f.micro_batch)


def _check_model_sizes(f) -> None:
  """Heads that split the width, a rotary part of a head, a memory proportion."""
  if f.hidden % f.heads:
    raise ValueError(f"--hidden={f.hidden} must be a multiple of --heads={f.heads} (each head "
                     f"takes hidden / heads features).")
  head = f.hidden // f.heads
  if f.rotary_dim % 2 or f.rotary_dim > head:
    raise ValueError(f"--rotary_dim={f.rotary_dim} must be even and at most the head size "
                     f"--hidden / --heads = {head}.")
  if not 0.0 < f.available_memory_proportion <= 1.0:
    raise ValueError(f"--available_memory_proportion={f.available_memory_proportion!r} must be "
                     f"in (0, 1] (the share of a tile's memory a matmul's plan may use).")


def check_flags(f) -> None:
  """Refuse bad settings before anything is built, naming the flag and valid values.

  Raises:
    ValueError: heads not dividing the hidden size, an odd or too long rotary
      part, a memory proportion outside (0, 1]; a tensor-parallel size not
      dividing the heads, hidden size,
      feed-forward size or vocabulary; a global batch not a multiple of
      ``data_parallel x micro_batch``; a system too small; GPT-3 positions
      shorter than the sequence.
  """
  from ipu_jax import parallel
  from ipu_jax.kernels.systems import check_capacity, system_preset
  _check_model_sizes(f)
  parallel.check_tensor_parallel(f.tensor_parallel, heads=f.heads, hidden=f.hidden,
                                 vocab=f.vocab_size, field="--tensor_parallel")
  if f.ffn % f.tensor_parallel:
    raise ValueError(f"--tensor_parallel={f.tensor_parallel} does not divide --ffn={f.ffn}; "
                     f"valid values: {parallel.divisors(f.ffn)}.")
  if f.mode == "train" and f.global_batch % (f.data_parallel * f.micro_batch):
    raise ValueError(f"--global_batch={f.global_batch} is not a multiple of --data_parallel x "
                     f"--micro_batch = {f.data_parallel * f.micro_batch}.")
  if f.sequence_parallel:
    if f.mode != "train":
      raise ValueError("--sequence_parallel is for --mode=train (one decoded token has no "
                       "sequence to split).")
    if f.seq % f.tensor_parallel:
      raise ValueError(f"--sequence_parallel: --tensor_parallel={f.tensor_parallel} does not "
                       f"divide --seq={f.seq}; valid values: {parallel.divisors(f.seq)}.")
    if f.rts_activations:
      # The phases' activations are already each IPU's 1/tp block of the
      # sequence: RTS would count (and gather) them a second time.
      raise ValueError("--sequence_parallel already shards the stored activations over the "
                       "tensor-parallel group; --rts_activations would shard them again. "
                       "Pass --norts_activations.")
  if f.model == "gpt3" and f.max_positions < f.seq:
    raise ValueError(f"--max_positions={f.max_positions} is shorter than --seq={f.seq}.")
  if f.system:
    groups = 2 if f.phase_mode == "ping_pong" else 1
    try:
      check_capacity(system_preset(f.system), f.data_parallel, groups * f.tensor_parallel,
                     "--data_parallel", "IPUs a replica (--tensor_parallel x phase groups)")
    except ValueError as e:
      raise ValueError(f"--system={f.system}: {e}") from None


def model_config(f):
  import jax.numpy as jnp
  from experiments import llm_models
  return llm_models.LLMConfig(
      family=f.model, vocab_size=f.vocab_size, hidden=f.hidden, layers=f.layers, heads=f.heads,
      ffn=f.ffn, max_positions=max(f.max_positions, f.seq), rotary_dim=f.rotary_dim,
      tp=f.tensor_parallel, dtype=jnp.dtype(f.dtype).type,
      sequence_parallel=f.sequence_parallel)


def ipu_target(f):
  """One IPU's target: the system's chip with ``--tiles_per_ipu`` tiles."""
  from ipu_jax.kernels.systems import system_preset
  from ipu_jax.target import IPUTarget
  chip = system_preset(f.system).chip if f.system else "ipu2"
  return IPUTarget.preset(chip, tiles_per_ipu=f.tiles_per_ipu)


def ipu_config(f):
  """The ``IPUConfig`` every program is lowered with (the matmuls' memory proportion)."""
  import ipu_jax
  config = ipu_jax.IPUConfig()
  config.matmuls.available_memory_proportion = f.available_memory_proportion
  return config


def num_ipus(f) -> int:
  return f.data_parallel * f.tensor_parallel * (2 if f.phase_mode == "ping_pong" else 1)


def tokens_per_step(f) -> int:
  if f.mode == "train":
    return f.global_batch * f.seq
  return f.data_parallel * f.micro_batch  # one generated token per sequence


# -- the bounds ---------------------------------------------------------------

def model_flops_per_token(cfg, mode: str, seq: int) -> float:
  """Model FLOPs per token: 6 N (training) or 2 N (inference), plus attention.

  N counts the weights that multiply (the embedding lookup does none). The
  attention's scores and weighted sum are ``4 x layers x context x hidden``
  FLOPs a token forward (Kaplan et al. 2020, Table 1), x 3 for training;
  the context is the sequence (no causal halving: the IPU computes the
  masked scores too).
  """
  from experiments import llm_models
  counts = llm_models.parameter_count(cfg)
  n = counts["total"] - counts["embedding"]
  attention = 4.0 * cfg.layers * seq * cfg.hidden
  return (6.0 * n + 3.0 * attention) if mode == "train" else (2.0 * n + attention)


def bounds(f, cfg, target, streaming_bytes_per_ipu: float) -> dict:
  """Tokens/s bounds: peak FLOPs of every IPU, Streaming Memory bandwidth of every IPU.

  Peak FLOPs: ``IPUTarget`` tiles x FLOP/cycle x clock (datasheet: 250 TFLOPS
  float16 a GC200). Streaming: each IPU moves ``streaming_bytes_per_ipu`` a
  step at ``IPUTarget.streaming_memory_bytes_per_second`` (docs/hardware.md).
  """
  import jax.numpy as jnp
  peak = target.flops_per_cycle(jnp.dtype(f.dtype)) * target.tiles_per_ipu * target.clock_hz
  flops_bound = num_ipus(f) * peak / model_flops_per_token(cfg, f.mode, f.seq)
  seconds = streaming_bytes_per_ipu / target.streaming_memory_bytes_per_second
  streaming_bound = tokens_per_step(f) / seconds if seconds > 0 else float("inf")
  return {"peak_flops_tokens_per_second": flops_bound,
          "streaming_tokens_per_second": streaming_bound,
          "peak_flops_per_ipu": peak, "model_flops_per_token": model_flops_per_token(
              cfg, f.mode, f.seq)}


# -- not phased: everything on chip --------------------------------------------

def check_on_chip(f, cfg, target) -> None:
  """Without phases every IPU holds its shard of the whole model (and, training,
  its gradients and Adam's two moments): refuse what its SRAM cannot hold.

  Raises:
    ipu_jax.OutOfMemoryError: names the IPU, the bytes and the remedy.
  """
  import jax.numpy as jnp
  from experiments import llm_models
  from ipu_jax.errors import OutOfMemoryError
  itemsize = jnp.dtype(f.dtype).itemsize
  weights = llm_models.parameter_count(cfg)["total"] / f.tensor_parallel
  per_weight = itemsize * (2 if f.mode == "train" else 1) + (8 if f.mode == "train" else 0)
  needed = int(weights * per_weight)
  sram = target.tiles_per_ipu * target.bytes_per_tile
  if needed > sram:
    raise OutOfMemoryError(
        f"IPU 0 (every IPU of the tensor-parallel group) needs {needed:,d} bytes for its shard "
        f"of the weights{' , gradients and Adam state' if f.mode == 'train' else ''} without "
        f"phased execution, more than its {sram:,d} bytes of In-Processor Memory; use phased "
        f"execution (--phased: weights and optimizer state in Streaming Memory, a phase per "
        f"decoder block) or more tensor parallelism (--tensor_parallel).",
        tile=-1, bytes_needed=needed, bytes_available=sram)


# -- training: phases through ipu_jax.phased -----------------------------------

def phased_model(model, tp: int, abstract: bool):
  """The model's phases as an ``ipu_jax.phased.PhasedModel``, weights stacked over tp."""
  import jax
  from experiments import llm_models
  from ipu_jax import phased
  phases = []
  for name, apply, params in llm_models.phase_functions(model):
    if tp == 1:  # unsplit: ipu_jax.phased takes the weights as they are (no [tp] axis)
      pass
    elif abstract:
      params = jax.tree.map(lambda a: jax.ShapeDtypeStruct((tp,) + tuple(a.shape), a.dtype),
                            params)
    else:
      params = llm_models.shard_state(params, tp)
    phases.append(phased.Phase(name, apply, params))
  return phased.PhasedModel(phases)


def layout(f):
  from ipu_jax import parallel, phased
  try:
    return _layout(f, parallel, phased)
  except ValueError as e:
    raise app.UsageError(f"--config={f.config}: {e}") from None


def _layout(f, parallel, phased):
  return phased.PhasedLayout(
      mode=f.phase_mode, batch_serialisation=accumulation(f), remote_weights=f.remote_weights,
      remote_optimizer_state=f.remote_optimizer_state, remote_activations=f.remote_activations,
      rts=f.rts, rts_activations=f.rts_activations, recompute=f.recompute,
      io_tiles=f.io_tiles,
      mesh=parallel.Mesh(dp=f.data_parallel, tp=f.tensor_parallel))


def unsplit_model(f, cfg):
  """The model with unsplit weights (tp = 1) from ``--seed``."""
  import dataclasses
  from flax import nnx
  from experiments import llm_models
  return llm_models.DecoderLM(dataclasses.replace(cfg, tp=1), rngs=nnx.Rngs(f.seed))


def abstract_shard(f, cfg):
  """One tensor-parallel shard of the model as shapes (``nnx.eval_shape``: no
  weights allocated), traced with :func:`ipu_jax.cheap_tracer_probes` so that
  a 96-layer model costs in proportion to its size."""
  from flax import nnx
  import ipu_jax
  from experiments import llm_models
  with ipu_jax.cheap_tracer_probes():
    return nnx.eval_shape(lambda: llm_models.DecoderLM(cfg, rngs=nnx.Rngs(f.seed)))


def train_estimate(f, cfg, target) -> dict:
  """The phased training step's estimate, from shapes (no weights allocated)."""
  import jax
  import jax.numpy as jnp
  import optax
  from ipu_jax import phased
  model = abstract_shard(f, cfg)
  trainer = phased.PhasedTrainer(phased_model(model, f.tensor_parallel, abstract=True),
                                 optax.adam(f.learning_rate), layout(f), target,
                                 config=ipu_config(f))
  tokens = jax.ShapeDtypeStruct((f.global_batch, f.seq), jnp.int32)
  est = trainer.estimate_from_shapes(tokens, tokens)
  breakdown = {k: target.cycles_to_seconds(v) for k, v in est.breakdown.items()}
  return {"step_seconds": est.step_seconds, "breakdown": breakdown, "fits": bool(est.fits),
          "per_ipu_peak_bytes": int(est.per_ipu_peak_bytes),
          "streaming_memory_bytes_per_ipu": int(est.streaming_memory_bytes_per_ipu),
          "streaming_bytes_per_step": int(est.streaming_bytes_per_step),
          "lower_seconds": est.lower_seconds, "programs_lowered": est.programs_lowered,
          "summary": est.summary()}


# -- inference: one token a step, KV cache, weights streamed per phase ---------

def _decode_programs(f, cfg, target):
  """Lowered embedding / block-decode / head programs of one token (one shard)."""
  import jax
  import jax.numpy as jnp
  from experiments import llm_models
  from ipu_jax import parallel
  tp, b = f.tensor_parallel, f.micro_batch
  model = abstract_shard(f, cfg)
  phases = llm_models.phase_functions(model, inference=True)
  stack = lambda tree: jax.tree.map(  # noqa: E731
      lambda a: jax.ShapeDtypeStruct((tp,) + tuple(a.shape), a.dtype), tree)
  mesh = parallel.Mesh(dp=1, tp=tp)
  whole = target.replace(num_ipus=tp)
  config = ipu_config(f)
  x = jax.ShapeDtypeStruct((b, 1, cfg.hidden), cfg.dtype)
  cache = jax.ShapeDtypeStruct((tp, b, f.seq, cfg.heads // tp, cfg.head_dim), cfg.dtype)
  position = jax.ShapeDtypeStruct((), jnp.int32)
  (_, emb, emb_p), (_, block, block_p), (_, head, head_p) = phases[0], phases[1], phases[-1]
  lowered = {
      "embedding": parallel.spmd(emb, mesh, ["tp_sharded", "replicated"], "stacked",
                                 target=whole, config=config).lower(
          stack(emb_p), jax.ShapeDtypeStruct((b, 1), jnp.int32)),
      "block": parallel.spmd(block, mesh, ["tp_sharded", "replicated", "tp_sharded",
                                           "tp_sharded", "replicated"], "stacked",
                             target=whole, config=config).lower(
          stack(block_p), x, cache, cache, position),
      "head": parallel.spmd(head, mesh, ["tp_sharded", "replicated"], "stacked",
                            target=whole, config=config).lower(stack(head_p), x)}
  weights = {"embedding": emb_p, "block": block_p, "head": head_p}
  return lowered, weights, 2 * cache.size // tp * jnp.dtype(cfg.dtype).itemsize


def inference_estimate(f, cfg, target) -> dict:
  """One generated token a step: embedding, every block (decode), head, serial phases.

  Each phase loads its weights from Streaming Memory (``--remote_weights``),
  and each block loads and stores its KV cache (PopXL's ``past_k`` /
  ``past_v`` remote buffers), one transfer after the other with its compute
  (serial phases, no overlap), plus a sync per transfer.
  """
  import jax
  import jax.numpy as jnp
  from ipu_jax.phased import transfer_cycles
  from ipu_jax.phased.estimate import program_cycles
  start = time.perf_counter()
  lowered, weights, cache_bytes = _decode_programs(f, cfg, target)
  lower_seconds = time.perf_counter() - start
  count = {"embedding": 1, "block": cfg.layers, "head": 1}
  compute = collectives = 0.0
  streamed = 0
  peaks = []
  for name, low in lowered.items():
    c, k = program_cycles(low.profile)
    compute += count[name] * c
    collectives += count[name] * k
    peaks.append(int(np.sum(low.profile.memory.peak)))
    nbytes = sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(weights[name]))
    per_ipu = nbytes // f.tensor_parallel if f.remote_weights else 0
    streamed += count[name] * (per_ipu + (2 * cache_bytes if name == "block" else 0))
  transfers = 2 * cfg.layers + (2 if f.remote_weights else 0)
  streaming = transfer_cycles(streamed, target)
  sync = transfers * target.sync_cycles_host
  fits = all(len(low.profile.memory.over_limit_tiles) == 0 for low in lowered.values())
  cycles = {"compute": compute, "collectives": collectives, "streaming": streaming,
            "sync": sync}
  return {"step_seconds": target.cycles_to_seconds(sum(cycles.values())),
          "breakdown": {k: target.cycles_to_seconds(v) for k, v in cycles.items()},
          "fits": bool(fits), "per_ipu_peak_bytes": max(peaks),
          "streaming_bytes_per_step": int(streamed), "lower_seconds": lower_seconds,
          "programs_lowered": len(lowered)}


def estimate(f) -> dict:
  """The preset's estimate and both bounds (nothing runs)."""
  from ipu_jax import host_time
  cfg, target = model_config(f), ipu_target(f)
  if not f.phased:
    check_on_chip(f, cfg, target)
  if f.mode == "train":
    result = train_estimate(f, cfg, target)
  else:
    result = inference_estimate(f, cfg, target)
  step = result["step_seconds"]
  result.update(config=f.config, model=f.model, mode=f.mode, system=f.system,
                replicas=f.data_parallel, micro_batch=f.micro_batch, dtype=f.dtype,
                gradient_accumulation=accumulation(f) if f.mode == "train" else 1,
                num_ipus=num_ipus(f), tokens_per_step=tokens_per_step(f),
                tokens_per_second=tokens_per_step(f) / step,
                samples_per_second=(f.global_batch if f.mode == "train"
                                    else f.data_parallel * f.micro_batch) / step,
                peak_rss_bytes=host_time.peak_rss_bytes())
  result["bounds"] = bounds(f, cfg, target, result["streaming_bytes_per_step"])
  b = result["bounds"]
  result["closest_bound"] = ("peak_flops" if b["peak_flops_tokens_per_second"]
                             <= b["streaming_tokens_per_second"] else "streaming")
  if f.config in presets.PUBLISHED:
    result["published"] = presets.PUBLISHED[f.config]
  return result


def print_estimate(r: dict) -> None:
  b = r["bounds"]
  if r.get("summary"):
    print(r["summary"])
  print(f"Estimate ({r['config'] or 'flags'}, {r['model']} {r['mode']}, {r['num_ipus']} IPUs): "
        f"{r['tokens_per_second']:,.1f} tokens/s, {r['samples_per_second']:,.3f} samples/s, "
        f"step {r['step_seconds']:.4f} s; fits: {r['fits']}")
  print(f"  bounds: peak FLOPs {b['peak_flops_tokens_per_second']:,.1f} tokens/s, streaming "
        f"bandwidth {b['streaming_tokens_per_second']:,.1f} tokens/s (closest: "
        f"{r['closest_bound']})")
  print("  breakdown (s): " + ", ".join(f"{k} {v:.4f}" for k, v in r["breakdown"].items()))
  if "published" in r:
    print(f"  published: {r['published']['tokens_per_second']:,.1f} tokens/s "
          f"({r['published']['source']})")
  print(f"  streaming {r['streaming_bytes_per_step']:,d} B an IPU a step; lowered "
        f"{r['programs_lowered']} programs in {r['lower_seconds']:.1f} s, peak RSS "
        f"{r['peak_rss_bytes'] / 2**30:.2f} GiB")


# -- --check: the phased TP x DP run against plain JAX ------------------------

def synthetic_tokens(f, step: int):
  rng = np.random.default_rng(f.seed + 1000 + step)
  ids = rng.integers(0, f.vocab_size, size=(f.global_batch, f.seq + 1)).astype(np.int32)
  return ids[:, :-1], ids[:, 1:]


def check_optimizer(learning_rate: float):
  """SGD with momentum: Adam's ``g / (|g| + eps)`` turns rounding-level
  differences of near-zero gradients into whole learning-rate steps, so a
  weight comparison at 1e-5 would read rounding, not the schedule."""
  import optax
  return optax.sgd(learning_rate, momentum=0.9)


def plain_steps(f, model, batches):
  """Weights after plain JAX gradient accumulation (tp = 1, mean over micro-batches)."""
  import jax
  import optax
  from flax import nnx
  from experiments import llm_models
  graphdef, params = nnx.split(model)

  def loss(params, ids, labels):  # the TP ops need their axis: bound with size 1
    one = lambda p: nnx.merge(graphdef, p)(ids, labels)  # noqa: E731
    return jax.vmap(one, axis_name="tp")(jax.tree.map(lambda a: a[None], params))[0]

  grad = jax.jit(jax.grad(loss))
  opt = check_optimizer(f.learning_rate * (1.0 + f.check_perturb))
  state = opt.init(params)
  for ids, labels in batches:
    n = ids.shape[0] // f.micro_batch
    total = None
    for m in range(n):
      sl = slice(m * f.micro_batch, (m + 1) * f.micro_batch)
      g = grad(params, ids[sl], labels[sl])
      total = g if total is None else jax.tree.map(np.add, total, g)
    updates, state = opt.update(jax.tree.map(lambda t: t / n, total), state, params)
    params = optax.apply_updates(params, updates)
  return [p for _, _, p in llm_models.phase_functions(nnx.merge(graphdef, params))]


def _stacked(weights, tp: int):
  """Weights as ``ipu_jax.phased`` takes them: ``[tp, ...]`` shards when tp > 1."""
  from experiments import llm_models
  return llm_models.shard_state(weights, tp) if tp > 1 else weights


def _unstacked(weights, tp: int):
  from experiments import llm_models
  return llm_models.unshard_state(weights) if tp > 1 else weights


def check(f) -> dict:
  """Train with TP, phases and replicas; compare with plain JAX; the figures."""
  from experiments import bert_pretraining, llm_models
  from ipu_jax import phased
  cfg, target = model_config(f), ipu_target(f)
  full = unsplit_model(f, cfg)
  # The phases' functions are the TP shard's (shapes only: nothing allocated);
  # their weights the unsplit model's, split into [tp, ...] shards.
  shard = abstract_shard(f, cfg)
  model = phased.PhasedModel([
      phased.Phase(name, apply, _stacked(weights, f.tensor_parallel))
      for (name, apply, _), (_, _, weights) in zip(llm_models.phase_functions(shard),
                                                   llm_models.phase_functions(full))])
  trainer = phased.PhasedTrainer(model, check_optimizer(f.learning_rate), layout(f), target,
                                 config=ipu_config(f))
  batches = [synthetic_tokens(f, s) for s in range(f.steps)]
  losses = [trainer.step(b) for b in batches]
  for s, value in enumerate(losses):
    print(f"step {s}: loss {value:.4f}")
  got = [_unstacked(p, f.tensor_parallel) for p in trainer.params]
  expected = plain_steps(f, full, batches)
  diff = bert_pretraining.max_relative_difference(got, expected)
  print(f"Plain JAX gradient accumulation: largest weight difference {diff:.2e} of the "
        f"weight's own scale (tolerance {f.check_tolerance:.0e})")
  return {"losses": losses, "max_relative_difference": diff,
          "check_passed": bool(diff <= f.check_tolerance)}


# -- main ---------------------------------------------------------------------

def run(f) -> dict:
  """The runner on parsed flag values ``f``: the run's figures.

  Raises:
    app.UsageError: a bad flag (the message names it and the valid values).
  """
  apply_preset(f)
  if not f.config:
    apply_accumulation(f)
  try:
    check_flags(f)
    entry.prepare_outputs(files=[("--json_out", f.json_out)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  if f.check:
    results = check(f)
  elif f.estimate_only:
    results = estimate(f)
    print_estimate(results)
    results.pop("summary", None)
  else:
    raise app.UsageError("Give --estimate_only (an estimate) or --check (train the preset "
                         "and compare with plain JAX).")
  if f.json_out:
    with open(f.json_out, "w") as out:
      json.dump(results, out, indent=1, default=float)
  return results


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  results = run(_FLAGS)
  if _FLAGS.check and not results["check_passed"]:
    print("CHECK FAILED: the phased TP x DP weights differ from plain JAX gradient "
          "accumulation.", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
