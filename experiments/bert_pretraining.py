r"""BERT pre-training pipelined over IPUs, laid out as Graphcore ran BERT-Large.

The model is :mod:`experiments.bert`. The layout: ``--layers_per_ipu``
encoder layers on each IPU of a replica, the embeddings on IPU 0 and the
pooler and heads back on IPU 0 (the MLM decoder is tied to the word
embedding), so the pipeline runs IPU 0 -> 1 -> ... -> N-1 -> 0: N + 1
stages on N IPUs (``device_mapping = [0, 1, ..., N-1, 0]``). The training
recipe is BERT's on the IPU: a recomputation checkpoint after every encoder
layer, the decoder projection serialised over the vocabulary
(``--decoder_serialization``), a per-IPU available memory proportion
(``--matmul_proportion``), LAMB with its state in streaming memory and
sharded over the replicas (``--offload_optimizer_state``,
``--replicated_tensor_sharding``), its moments m and v in the weights' dtype
or in ``--lamb_m_dtype`` / ``--lamb_v_dtype`` (:mod:`experiments.lamb`), with or without
Adam's bias correction (``--lamb_bias_correction``), gradients accumulated over
``--accumulation`` micro-batches and averaged over ``--replicas``.

The default is a small BERT (4 layers of width 128, vocabulary 1,000,
sequence 64) on 32 tiles per IPU that trains in a few minutes::

    python -m experiments.bert_pretraining --report_dir reports/bert

``--check`` also trains the same model on the same micro-batches with plain
JAX gradient accumulation (no pipeline) and prints the largest relative
difference of the weights. The report's summary ends with the step's
throughput on ``--system`` and its breakdown by part
(:mod:`ipu_jax.pipelining.throughput`).

``--config`` takes a preset mirroring Graphcore's public BERT examples
(:mod:`experiments.bert_presets`, docs/published_bert.md): ``phase1_pod16``,
``phase1_pod64`` (sequence 128, micro-batch 8), ``phase2_pod16``,
``phase2_pod64`` (sequence 512, micro-batch 2), BERT-Large on 4 replicas x 4
IPUs of an IPU-POD16 or 16 x 4 of a POD64, every IPU's 1,472 tiles;
``--model base`` for BERT-Base; any flag given overrides the preset. The
``tf2_*`` presets (``tf2_phase1_pod16``, ``tf2_phase1_pod64``,
``tf2_base_phase1_pod16``) mirror the TensorFlow 2 example's phase-1
configs, whose throughput Graphcore's performance-results tables give
(docs/published_tables.md). The
``mlperf_*`` presets mirror Graphcore's MLPerf Training v1.0 / v1.1 / v2.0
BERT runs; v1.1's and v2.0's place attention and feed-forward blocks
separately (``--att_ffn_placement``, in place of ``--layers_per_ipu``) and
use half partials (``--partials_type float16``); every ``mlperf_*`` preset
recomputes the last stage as PopART did (``--last_stage_recomputation
checkpoints``) and v1.1's and v2.0's mark its attention outputs and the MLM
projection as checkpoints as their code did (``--checkpoint_blocks``).
Every preset drops out as the measured runs did: ``--dropout 0.1``, with
``--attention_dropout 0.1`` in the v2.0 presets, the masks from the tiles'
generators (``--random_mode hardware``; ``--check`` needs ``--random_mode
jax``, plain JAX's masks).
``--estimate_only`` lowers each stage's programs once (on one IPU; the
replicas are not lowered again, the weights and optimizer state stay
abstract) and prints the estimate without running anything; ``--json_out``
writes it (samples/s, sequences/s, step seconds, breakdown, lowering
seconds, peak RSS, whether every IPU fits and each IPU's peak)::

    python -m experiments.bert_pretraining --config phase2_pod16 --packing_factor 2 \
        --estimate_only --json_out reports/phase2_pod16.json

``--auto_split`` first searches the split (:func:`ipu_jax.pipelining.search`
through :func:`experiments.bert_split.auto_split`): layers and matmul
proportion per IPU, recomputation and decoder serialisation (the space:
``--split_proportions``, ``--split_recomputation``, ``--split_serialization``)
for this model, system and training options, the flags' own split as the
baseline; it prints the candidates' table, then runs as above with the chosen
split, and ``--json_out`` gains its ``"split"`` and ``"search"``
(docs/multi_ipu.md, "Finding the split")::

    python -m experiments.bert_pretraining --config phase1_pod16 --auto_split \
        --estimate_only --json_out split.json --split_plot split.png
"""

from __future__ import annotations

import functools
import json
import os
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import bert_presets as presets  # noqa: E402
from experiments import entry  # noqa: E402

_FLAGS = flags.FLAGS
# The dtypes --lamb_m_dtype / --lamb_v_dtype take (PopART's FLOAT16 and FLOAT).
LAMB_STATE_DTYPES = ("float16", "float32")


def define_flags(fv=None):
  """Defines the runner's flags in ``fv`` (default the global FLAGS) and returns it.

  Called when the runner runs, not on import: tests import this module beside
  other runners whose flags share names (``json_out``, ``seed``, ...).
  """
  fv = flags.FLAGS if fv is None else fv
  flags.DEFINE_enum("model", "tiny", ["tiny", "base", "large"],
                    "tiny: 4 x 128, vocabulary 1,000; base: BERT-Base; large: BERT-Large.",
                    flag_values=fv)
  flags.DEFINE_list("layers_per_ipu", ["1", "1", "1", "1"],
                    "Encoder layers on each IPU of a replica (BERT-Large: 3,7,7,7).",
                    flag_values=fv)
  flags.DEFINE_string("att_ffn_placement", None,
                      "Graphcore's MLPerf att_ffn_placement as JSON, replacing --layers_per_ipu: "
                      "stages [ipu, [attention blocks, feed-forward blocks]] after the "
                      "embeddings' stage on IPU 0, e.g. '[[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], "
                      "[0, [4, 5]]]' (a layer's attention and feed-forward block may sit on "
                      "different IPUs); the heads join the last stage on IPU 0.",
                      flag_values=fv)
  flags.DEFINE_list("matmul_proportion", ["0.15", "0.25", "0.25", "0.25"],
                    "Available memory proportion of matmuls on each IPU.", flag_values=fv)
  flags.DEFINE_enum("schedule", "Grouped", ["Grouped", "Sequential", "Interleaved"],
                    "Pipeline schedule (Interleaved cannot hold two stages on one IPU).",
                    flag_values=fv)
  flags.DEFINE_integer("accumulation", 10, "Micro-batches per weight update (G).", flag_values=fv)
  # The name every runner shares (resnet_training, llm): one configuration
  # can be asked of another runner with the same flags.
  flags.DEFINE_alias("gradient_accumulation", "accumulation", flag_values=fv)
  flags.DEFINE_integer("replicas", 2, "Data-parallel replicas of the pipeline.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("updates_per_execution", 1,
                       "Weight updates one execution of the device program runs (PopART's "
                       "batches_per_step: 1 in every MLPerf BERT config); the host's fixed "
                       "time per execution (IPUSystem.execution_overhead_seconds) is shared "
                       "by them.", flag_values=fv)
  flags.DEFINE_integer("micro_batch", 2, "Sequences per micro-batch.", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("seq", 64, "Sequence length.", lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("max_predictions", 8, "Masked positions per sequence (<= --seq).",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_enum("partials_type", "float32", ["float32", "float16"],
                    "cfg.matmuls.partials_type: the matmuls' partial sums (Graphcore's "
                    "enable_half_partials: float16).", flag_values=fv)
  flags.DEFINE_integer("decoder_serialization", 2, "Serialisation factor of the MLM decoder.",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_boolean("recomputation", True, "Recompute each stage's forward in its backward.",
                       flag_values=fv)
  flags.DEFINE_enum("last_stage_recomputation", "none", ["none", "checkpoints"],
                    "cfg.pipelining.last_stage_recomputation: 'none' never recomputes the last "
                    "stage (TF-IPU); 'checkpoints' recomputes it between its checkpoints "
                    "(PopART's RecomputationType::Pipeline, what the MLPerf presets ran).",
                    flag_values=fv)
  flags.DEFINE_boolean("checkpoint_blocks", False,
                       "Mark recomputation checkpoints as Graphcore's MLPerf PopART BERT does: "
                       "each attention block's output on the last stage and the MLM "
                       "projection's (experiments.bert.popart_checkpoints).", flag_values=fv)
  flags.DEFINE_boolean("offload_optimizer_state", True, "LAMB state in streaming memory.",
                       flag_values=fv)
  flags.DEFINE_enum("lamb_m_dtype", None, list(LAMB_STATE_DTYPES),
                    "LAMB's first moment m (PopART's accl1); default the weights' dtype "
                    "(--dtype), as optax.lamb. Graphcore's MLPerf v1.1 lamb_m_dtype, v2.0 "
                    "lamb_accl_dtype (docs/published_bert.md).", flag_values=fv)
  flags.DEFINE_enum("lamb_v_dtype", None, list(LAMB_STATE_DTYPES),
                    "LAMB's second moment v (PopART's accl2); default the weights' dtype "
                    "(--dtype), as optax.lamb. Graphcore's MLPerf v2.0 lamb_accl_dtype; "
                    "PopART's default float32 in v1.1.", flag_values=fv)
  flags.DEFINE_boolean("lamb_bias_correction", True,
                       "Divide LAMB's moments by Adam's 1 - b**t (optax.lamb); false is "
                       "PopART's LambNoBias, the mode of Graphcore's MLPerf runs "
                       "(optimizer: LAMB_NO_BIAS).", flag_values=fv)
  flags.DEFINE_boolean("replicated_tensor_sharding", True,
                       "Shard the LAMB state over the replicas.", flag_values=fv)
  flags.DEFINE_float("dropout", 0.0, "Dropout rate of the embeddings', attention output's and "
                     "FFN output's dropouts, in [0, 1).", flag_values=fv)
  flags.DEFINE_float("attention_dropout", 0.0,
                     "Dropout rate of the attention probabilities, in [0, 1) (BERT's "
                     "attention_probs_dropout_prob; Graphcore's MLPerf v2.0 runs: 0.1).",
                     flag_values=fv)
  flags.DEFINE_enum("random_mode", "jax", ["jax", "hardware"],
                    "cfg.random.mode: 'jax' draws jax.jit's bits (priced as threefry's integer "
                    "work), 'hardware' the tiles' generators (priced as poprand's vertices: "
                    "dropout as one Dropout vertex).", flag_values=fv)
  flags.DEFINE_float("learning_rate", 1e-3, "LAMB learning rate.", flag_values=fv)
  flags.DEFINE_integer("steps", 3, "Training steps (weight updates).", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("tiles_per_ipu", 32,
                       "Tiles per IPU (small: a fast emulation; the presets use all 1,472; "
                       "0: every tile of the system's chip).", lower_bound=0, flag_values=fv)
  flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.", flag_values=fv)
  flags.DEFINE_boolean("check", False, "Compare with plain JAX gradient accumulation.",
                       flag_values=fv)
  flags.DEFINE_string("report_dir", None, "Where to write the pipeline and stage reports.",
                      flag_values=fv)
  flags.DEFINE_string("json_out", None, "Write the run's figures to this JSON file.",
                      flag_values=fv)
  flags.DEFINE_enum("config", None, sorted(presets.PRESETS),
                    "A preset mirroring Graphcore's public BERT examples (docs/published_bert.md); "
                    "every flag given on the command line overrides it.", flag_values=fv)
  flags.DEFINE_string("system", None, "The IPU system (cfg.system): pod16, pod64, pod128, ...",
                      flag_values=fv)
  flags.DEFINE_float("packing_factor", 1.0,
                     "Sequences packed in each sample (>= 1); samples/s x this = sequences/s.",
                     flag_values=fv)
  flags.DEFINE_enum("dtype", "float32", ["float32", "float16"],
                    "Weights and activations (the presets: float16, as Graphcore trained).",
                    flag_values=fv)
  flags.DEFINE_boolean("estimate_only", False,
                       "Lower each stage program once and print the estimate; run nothing.",
                       flag_values=fv)
  flags.DEFINE_integer("vocab_size", None,
                       "Vocabulary (default the model's: 1,000 tiny, 30,522 base and large); "
                       "Graphcore's MLPerf runs pad it to 30,400.", lower_bound=1, flag_values=fv)
  flags.DEFINE_boolean("auto_split", False,
                       "Search the split (layers and matmul proportion per IPU, recomputation, "
                       "decoder serialisation) that fits and runs fastest, then estimate or "
                       "train with it; the split flags given are the search's baseline (the "
                       "search lowers the model as the run does, dropout included).",
                       flag_values=fv)
  flags.DEFINE_list("split_proportions", ["0.15", "0.25", "0.35", "0.45"],
                    "--auto_split: matmul proportions tried on each IPU.", flag_values=fv)
  flags.DEFINE_list("split_recomputation", ["true", "false"],
                    "--auto_split: recomputation settings tried.", flag_values=fv)
  flags.DEFINE_list("split_serialization", ["1", "2", "4"],
                    "--auto_split: decoder serialisation factors tried.", flag_values=fv)
  flags.DEFINE_integer("split_confirm_top", 1,
                       "--auto_split: best splits lowered in full, in order, to confirm one "
                       "(0: none).", lower_bound=0, flag_values=fv)
  flags.DEFINE_string("split_plot", None,
                      "--auto_split: PNG of per-IPU cycles and memory, the chosen split beside "
                      "the flags' own.", flag_values=fv)
  return fv




def model_config(name: str, dropout: float, decoder_serialization: int,
                 dtype: str = "float32", vocab_size: int | None = None,
                 attention_dropout: float = 0.0):
  import jax.numpy as jnp
  from experiments import bert
  kw = dict(dropout=dropout, attention_dropout=attention_dropout,
            decoder_serialization=decoder_serialization, dtype=jnp.dtype(dtype).type)
  if name == "tiny":
    return bert.BertConfig(vocab_size=vocab_size or 1000, hidden=128, layers=4, heads=4,
                           ffn=512, max_positions=512, **kw)
  if vocab_size is not None:
    kw["vocab_size"] = vocab_size
  make = bert.bert_large if name == "large" else bert.bert_base
  return make(**kw)


def uses_dropout(f) -> bool:
  """Whether the model draws dropout masks (so the loss takes a key)."""
  return f.dropout > 0 or f.attention_dropout > 0


def with_checkpoints(f, mcfg):
  """``mcfg`` with ``--checkpoint_blocks``' checkpoints (unchanged without it).

  The attention blocks of the last stage (a placement's, from
  :func:`experiments.bert.popart_checkpoints`; ``--layers_per_ipu`` gives the
  heads a stage of their own, so none) and the MLM head's three.
  """
  import dataclasses
  from experiments import bert
  if not f.checkpoint_blocks:
    return mcfg
  attention = (bert.popart_checkpoints(json.loads(f.att_ffn_placement), mcfg.layers)
               if f.att_ffn_placement else ())
  return dataclasses.replace(mcfg, attention_checkpoints=attention, head_checkpoints=True)


def apply_preset(f) -> None:
  """Set the flags of ``--config``'s preset that the command line did not give.

  A ``--layers_per_ipu`` given on the command line replaces the preset's
  ``att_ffn_placement`` (whole layers per IPU), unless that is given too.
  """
  if not f.config:
    return
  values = presets.preset_values(f.config, f.model if f["model"].present else None)
  if f["layers_per_ipu"].present and not f["att_ffn_placement"].present:
    values.pop("att_ffn_placement", None)
  for name, value in values.items():
    if f[name].present:
      continue
    if name == "att_ffn_placement":
      value = json.dumps(value)  # a JSON flag
    setattr(f, name, [str(v) for v in value] if isinstance(value, list) else value)


def stage_layout(f, num_layers: int) -> tuple:
  """``(stage_assignment, device_mapping)`` of the flags' split.

  ``--att_ffn_placement`` when given (:func:`experiments.bert.placement_layout`),
  else ``--layers_per_ipu`` (:func:`experiments.bert.layout`).

  Raises:
    ValueError: a placement that is not JSON or that the layout refuses, or
      layers that do not add up to ``num_layers``, naming the flag.
  """
  from experiments import bert
  if f.att_ffn_placement:
    try:
      placement = json.loads(f.att_ffn_placement)
      return bert.placement_layout(placement, num_layers)
    except ValueError as e:  # json.JSONDecodeError is a ValueError
      raise ValueError(f"--att_ffn_placement={f.att_ffn_placement!r}: {e}") from None
  try:
    layers = [int(v) for v in f.layers_per_ipu]
  except ValueError:
    raise ValueError(f"--layers_per_ipu={','.join(f.layers_per_ipu)}: each entry must be a "
                     f"whole number of encoder layers.") from None
  if sum(layers) != num_layers:
    raise ValueError(f"--layers_per_ipu {layers} adds up to {sum(layers)} layers; the "
                     f"{f.model} model has {num_layers}.")
  return bert.layout(layers)


def num_ipus(mapping) -> int:
  """IPUs of one replica's pipeline, from its ``device_mapping``."""
  return max(mapping) + 1


def check_model_flags(f) -> None:
  """Refuse model and data flags the model cannot take, naming the flag.

  (Counts are held to their least values when the flags are parsed.)

  Raises:
    ValueError: a dropout rate outside [0, 1), or more masked positions than
      the sequence has.
  """
  for name in ("dropout", "attention_dropout"):
    rate = getattr(f, name)
    if not 0.0 <= rate < 1.0:
      raise ValueError(f"--{name}={rate!r} must be in [0, 1) (the fraction of values dropped).")
  if f.max_predictions > f.seq:
    raise ValueError(f"--max_predictions={f.max_predictions} exceeds --seq={f.seq}: a sequence "
                     f"has at most --seq masked positions.")


def check_vocabulary_factor(flag: str, factor: int, vocab_size: int) -> None:
  """A serialisation factor ``--flag`` must divide the vocabulary (the tied
  head's columns); the message lists the factors that do."""
  if vocab_size % factor:
    divisors = [d for d in range(1, vocab_size + 1) if vocab_size % d == 0]
    shown = divisors if len(divisors) <= 16 else divisors[:16] + ["..."]
    raise ValueError(f"{flag}={factor} does not divide the vocabulary of "
                     f"{vocab_size:,d} words (the tied head's columns, in {factor} pieces); "
                     f"factors that do: {shown}.")


def check_proportions(values, ipus: int) -> None:
  """``--matmul_proportion``: one proportion in (0, 1] per IPU of a replica."""
  text = ",".join(values)
  try:
    proportions = [float(v) for v in values]
  except ValueError:
    proportions = None
  if proportions is None or not all(0.0 < p <= 1.0 for p in proportions):
    raise ValueError(f"--matmul_proportion={text}: each entry must be a proportion in (0, 1] "
                     f"of a tile's memory.")
  if len(proportions) != ipus:
    raise ValueError(f"--matmul_proportion={text} gives {len(proportions)} proportions; the "
                     f"split has {ipus} IPUs a replica, one proportion each.")


def check_flags(f, num_layers: int) -> None:
  """Refuse bad settings before anything is built, naming the flag.

  Raises:
    ValueError: ``--check`` with hardware dropout masks, a packing factor
      below 1, layers that do not add up to the model's (or a placement
      :func:`stage_layout` refuses), ``--auto_split`` from a placement, a G
      the Grouped / Interleaved schedule cannot run over BERT's stages, or a
      system too small for replicas x IPUs per replica.
  """
  from ipu_jax.kernels.systems import check_capacity, system_preset
  from ipu_jax.pipelining import minimum_accumulation
  if not f.packing_factor >= 1.0:
    raise ValueError(f"--packing_factor must be >= 1 (sequences packed in each sample); "
                     f"got {f.packing_factor!r}.")
  if f.check and uses_dropout(f) and f.random_mode == "hardware":
    raise ValueError("--check compares with plain JAX, whose dropout masks are jax.jit's bits; "
                     "--random_mode=hardware draws other masks. Use --random_mode=jax with "
                     "--check, or --dropout=0.")
  if f.auto_split and f.att_ffn_placement:
    raise ValueError("--auto_split searches whole layers per IPU (--layers_per_ipu); it cannot "
                     "start from --att_ffn_placement. Give --layers_per_ipu instead.")
  _, mapping = stage_layout(f, num_layers)
  check_proportions(f.matmul_proportion, num_ipus(mapping))
  stages = len(mapping)
  minimum = minimum_accumulation(f.schedule, stages)
  if f.updates_per_execution < 1:
    raise ValueError(f"--updates_per_execution={f.updates_per_execution} must be >= 1.")
  if f.accumulation < minimum or f.accumulation % minimum:
    raise ValueError(f"--accumulation={f.accumulation} does not suit the {f.schedule} schedule "
                     f"over {stages} stages: it must be a positive multiple of {minimum}.")
  if f.system:
    try:
      check_capacity(system_preset(f.system), f.replicas, num_ipus(mapping), "--replicas",
                     "IPUs per replica (len(--layers_per_ipu), or the IPUs of "
                     "--att_ffn_placement)")
    except ValueError as e:
      raise ValueError(f"--system={f.system}: {e}") from None


def ipu_config(f, num_ipus: int):
  """The IPUConfig of one replica's pipeline from the flags."""
  import ipu_jax
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = f.tiles_per_ipu
  cfg.auto_select_ipus = num_ipus
  cfg.replication_factor = f.replicas
  cfg.training.gradient_accumulation_steps = f.accumulation
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.pipelining.schedule = f.schedule
  cfg.pipelining.recomputation = f.recomputation
  cfg.pipelining.last_stage_recomputation = f.last_stage_recomputation
  cfg.matmuls.available_memory_proportion = [float(v) for v in f.matmul_proportion]
  cfg.matmuls.partials_type = f.partials_type
  cfg.streaming.offload_optimizer_state = f.offload_optimizer_state
  cfg.streaming.replicated_tensor_sharding = f.replicated_tensor_sharding
  cfg.system = f.system
  cfg.random.mode = f.random_mode
  return cfg


@functools.lru_cache(maxsize=8)
def _plain_update(optimizer):
  """``optimizer``'s update and its application as one ``jax.jit`` function.

  One XLA program per update: run eagerly, every one of the optimizer's
  operations on every leaf would be compiled on its own. Kept per optimizer
  (an optax ``GradientTransformation`` hashes by its functions), so the
  references of several runs with one optimizer compile it once per shape.
  """
  import jax
  import optax

  @jax.jit
  def update(grads, state, params):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return update


def plain_steps(loss_fn, optimizer, params, batches_per_step, keys=None):
  """Weights after plain JAX gradient accumulation: the mean over all micro-batches.

  Args:
    keys: with dropout, each step's key; micro-batch m of a step is given
      ``ipu_jax.pipelining.micro_batch_key(key, m)``, as the pipeline does.
  """
  import jax
  from ipu_jax.pipelining import micro_batch_key
  state = optimizer.init(params)
  grad = jax.jit(jax.grad(loss_fn))
  update = _plain_update(optimizer)
  for step, batches in enumerate(batches_per_step):
    n = len(jax.tree_util.tree_leaves(batches)[0])
    total = None
    for m in range(n):
      args = (params, jax.tree_util.tree_map(lambda b: b[m], batches))
      if keys is not None:
        args += (micro_batch_key(keys[step], m),)
      g = grad(*args)
      total = g if total is None else jax.tree_util.tree_map(np.add, total, g)
    mean = jax.tree_util.tree_map(lambda t: t / n, total)
    params, state = update(mean, state, params)
  return params


def max_relative_difference(a, b) -> float:
  """The largest ``max |a - b| / max |b|`` over the leaves: each weight's
  difference against its own scale (weights near zero would make an
  element-wise ratio meaningless)."""
  import jax
  diffs = [float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0)
                 / max(float(np.max(np.abs(np.asarray(y)), initial=0.0)), 1e-30))
           for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
  return max(diffs, default=0.0)


def make_optimizer(f):
  """The flags' LAMB: ``--learning_rate``, its moments in ``--lamb_m_dtype`` and
  ``--lamb_v_dtype`` (unset: the weights' dtype, ``optax.lamb``'s numbers),
  bias-corrected unless ``--nolamb_bias_correction`` (PopART's LambNoBias)."""
  from experiments import lamb
  return lamb.lamb(f.learning_rate, mu_dtype=f.lamb_m_dtype, nu_dtype=f.lamb_v_dtype,
                   bias_correction=f.lamb_bias_correction)


def abstract_init(optimizer):
  """``optimizer`` whose ``init`` gives shapes (``jax.ShapeDtypeStruct``) for
  abstract weights, so lowering its update allocates no state."""
  import jax
  import optax

  def init(params):
    if any(isinstance(p, jax.ShapeDtypeStruct) for p in jax.tree_util.tree_leaves(params)):
      return jax.eval_shape(optimizer.init, params)
    return optimizer.init(params)

  return optax.GradientTransformation(init, optimizer.update)


def lower_step(pipe, params, one_batch, f) -> float:
  """Lower the pipeline (each stage's programs once, on one IPU); its seconds.

  ``one_batch`` is one micro-batch stacked once; the step's ``G x R``
  micro-batches are views of it (only shapes matter here). With dropout
  (``--dropout``, ``--attention_dropout``) the step takes ``--seed``'s key.
  The GPT-2 runner lowers its pipeline the same way.
  """
  import jax
  per_step = f.accumulation * f.replicas
  batches = jax.tree_util.tree_map(
      lambda b: np.broadcast_to(b, (per_step,) + b.shape[1:]), one_batch)
  start = time.time()
  pipe.lower(params, batches, **({"rng": jax.random.key(f.seed)} if uses_dropout(f) else {}))
  return time.time() - start


def estimate(pipe, params, one_batch, f) -> dict:
  """Lower the pipeline (:func:`lower_step`) and read the estimate."""
  return lowered_estimate(pipe, f, lower_step(pipe, params, one_batch, f))


def forward_only(pipe) -> dict:
  """A forward-only run of the step's micro-batches, as the MLPerf v2.0 runs
  evaluated (docs/published_bert.md#the-evaluation-gaps): its seconds, its
  breakdown and ``slot_seconds``, a slot's mean (its passes, copies and
  sync; what the evaluation gaps measure a micro-batch at)."""
  fwd = pipe.report.forward_throughput()
  slots = pipe.accumulation + len(pipe.stages) - 1
  per_slot = sum(fwd.breakdown[p] for p in ("steady_state", "ramp", "inter_stage_copies",
                                            "syncs"))
  return {"run_seconds": fwd.step_seconds, "slot_seconds": per_slot / slots,
          "breakdown": fwd.breakdown}


def memory_figures(pipe) -> dict:
  """A lowered pipeline's memory as the runners' JSON holds it: ``fits``, each
  IPU's peak bytes and fullest tile, what fills that tile, the tile's bytes."""
  report = pipe.report
  memory = report.memory_per_ipu()
  limit = pipe.target.bytes_per_tile
  return {"fits": all(m["max_tile_bytes"] <= limit for m in memory.values()),
          "per_ipu_peak_bytes": [memory[i]["total_bytes"] for i in sorted(memory)],
          "per_ipu_max_tile_bytes": [memory[i]["max_tile_bytes"] for i in sorted(memory)],
          # What fills each IPU's fullest tile (which program, what the others hold, stash).
          "per_ipu_peak_tile": [report.ipu_memory[i].describe_tile(
              int(np.argmax(report.ipu_memory[i].peak))) for i in sorted(memory)],
          "bytes_per_tile": limit}


def lowered_estimate(pipe, f, lower_seconds: float) -> dict:
  """The estimate of an already lowered pipeline (``lower_seconds``: its lowering)."""
  from ipu_jax import host_time
  report = pipe.report
  report.sequences_per_sample = f.packing_factor
  report.steps_per_execution = f.updates_per_execution * f.accumulation * f.replicas
  tp = report.throughput
  return {"config": f.config, "model": f.model, "system": f.system,
          "samples_per_second": tp.samples_per_second,
          "sequences_per_second": tp.sequences_per_second, "step_seconds": tp.step_seconds,
          "breakdown": tp.breakdown, "forward_only": forward_only(pipe),
          "lower_seconds": lower_seconds,
          "peak_rss_bytes": host_time.peak_rss_bytes(),
          **memory_figures(pipe),
          # The recomputation rule the figures are under (docs/multi_ipu.md#the-last-stage).
          "last_stage_recomputation": pipe.config.pipelining.last_stage_recomputation,
          "checkpoint_blocks": bool(f.checkpoint_blocks)}


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  run(_FLAGS)


def build_pipeline(f, mcfg) -> tuple:
  """``(pipe, loss_fn, optimizer, params)`` of the flags' split, model and training options.

  With ``--estimate_only`` the weights and the optimizer state are abstract
  (only shapes matter; BERT-Large's would take 4 GB of host memory) and an
  out-of-memory split is reported, not raised.
  """
  from flax import nnx
  import ipu_jax
  from experiments import bert
  assignment, mapping = stage_layout(f, mcfg.layers)
  cfg = ipu_config(f, num_ipus(mapping))
  optimizer = make_optimizer(f)
  if f.estimate_only:
    cfg.memory.allow_out_of_memory = True
    with ipu_jax.cheap_tracer_probes():  # linear in the model's size, not quadratic
      model = nnx.eval_shape(lambda: bert.Bert(mcfg, rngs=nnx.Rngs(f.seed)))
    optimizer = abstract_init(optimizer)
  else:
    model = bert.Bert(mcfg, rngs=nnx.Rngs(f.seed))
  # With dropout the loss takes a key: each micro-batch gets its own
  # (ipu_jax.pipelining.micro_batch_key), the key plain accumulation uses.
  dropout = uses_dropout(f)
  loss_fn, params = bert.make_loss(model, dropout=dropout)
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                                     stage_assignment=assignment, rng=dropout)
  return pipe, loss_fn, optimizer, params


def run(f) -> dict:
  """The runner on parsed flag values ``f``: estimate or train; the run's figures.

  Raises:
    app.UsageError: a bad flag, or ``--auto_split`` finding no split that fits.
  """
  from experiments import bert

  apply_preset(f)
  try:
    check_model_flags(f)
    mcfg = model_config(f.model, f.dropout, f.decoder_serialization, f.dtype, f.vocab_size,
                        f.attention_dropout)
    check_flags(f, mcfg.layers)
    # With --auto_split: the baseline's.
    check_vocabulary_factor("--decoder_serialization", f.decoder_serialization,
                            mcfg.vocab_size)
    entry.prepare_outputs(files=[("--json_out", f.json_out), ("--split_plot", f.split_plot)],
                          directories=[("--report_dir", f.report_dir)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  mcfg = with_checkpoints(f, mcfg)
  searched, lowered = {}, None
  if f.auto_split:
    searched, lowered = choose_split(f, mcfg)
    mcfg = with_checkpoints(f, model_config(f.model, f.dropout, f.decoder_serialization,
                                            f.dtype, f.vocab_size, f.attention_dropout))
  if f.estimate_only and lowered is not None:
    # The search lowered this very split to confirm it, from the same model,
    # config, optimizer and micro-batch shapes: its pipeline is read rather
    # than lowered again (a minute or more at BERT-Large size).
    pipe = lowered.pipeline
    results = dict(lowered_estimate(pipe, f, lowered.seconds), lowered_by="split search")
  else:
    del lowered  # not this run's pipeline: its memory goes before another is lowered
    pipe, loss_fn, optimizer, params = build_pipeline(f, mcfg)
    if f.estimate_only:
      one = bert.synthetic_batches(mcfg, 1, f.micro_batch, f.seq, f.max_predictions, f.seed)
      results = dict(estimate(pipe, params, one, f), lowered_by="runner")
    else:
      results = train(pipe, loss_fn, optimizer, params, mcfg, f,
                      stage_layout(f, mcfg.layers)[1])
  if f.estimate_only:
    print(pipe.report.summary())
    print(f"Estimate ({f.config or 'flags'}, BERT-{f.model}): "
          f"{results['samples_per_second']:,.1f} samples/s, "
          f"{results['sequences_per_second']:,.1f} sequences/s, step "
          f"{results['step_seconds']:.3f} s; fits: {results['fits']} (largest tile per IPU "
          f"{results['per_ipu_max_tile_bytes']} of {results['bytes_per_tile']:,d} B); lowered "
          f"in {results['lower_seconds']:.1f} s ({results['lowered_by']}), peak RSS "
          f"{results['peak_rss_bytes'] / 2**30:.2f} GiB")
  results.update(searched)
  entry.write_outputs(pipe.report, results, f.report_dir, f.json_out)
  return results


def split_space(f, vocab_size: int) -> dict:
  """``--split_*`` as :func:`experiments.bert_split.auto_split`'s search-space keywords.

  Serialisation factors that do not divide the vocabulary (the decoder's
  columns) are left out with a note: BERT-Large's 30,522 words split into 1,
  2, 3 or 6 pieces, not 4 (Graphcore's configs pad it to 30,528).

  Raises:
    ValueError: a value that is not a proportion in (0, 1], a boolean or a
      factor >= 1, or no factor dividing the vocabulary, naming the flag.
  """
  def parse(name, convert, valid, what):
    values = []
    for text in getattr(f, name):
      try:
        value = convert(text.strip())
      except ValueError:
        value = None
      if value is None or not valid(value):
        raise ValueError(f"--{name}: {text!r} is not {what}.")
      values.append(value)
    if not values:
      raise ValueError(f"--{name} must list at least one value ({what}).")
    return tuple(dict.fromkeys(values))

  booleans = {"true": True, "false": False, "1": True, "0": False}
  factors = parse("split_serialization", int, lambda s: s >= 1, "an integer >= 1")
  dividing = tuple(s for s in factors if vocab_size % s == 0)
  if not dividing:
    raise ValueError(f"--split_serialization: none of {list(factors)} divides the vocabulary "
                     f"of {vocab_size:,d} words (the decoder's columns).")
  if len(dividing) < len(factors):
    print(f"--split_serialization: leaving out {[s for s in factors if s not in dividing]}, "
          f"which do not divide the vocabulary of {vocab_size:,d} words.")
  return {"proportions": parse("split_proportions", float, lambda p: 0.0 < p <= 1.0,
                               "a proportion in (0, 1]"),
          "recomputation": parse("split_recomputation", lambda t: booleans.get(t.lower()),
                                 lambda r: r is not None, "true or false"),
          "serialization": dividing}


def choose_split(f, mcfg) -> tuple:
  """``--auto_split``: search the split for the flags' model, system and training
  options, set the split flags to it; ``(the JSON's split and search entries, the
  chosen split as the search lowered it or None)``.

  The flags' own split (``--layers_per_ipu``, ``--matmul_proportion``,
  ``--recomputation``, ``--decoder_serialization``) is the search's baseline,
  estimated beside the chosen one.

  Raises:
    app.UsageError: a bad ``--split_*`` value, or no split fits (the message
      names the closest split's IPU and the bytes its fullest tile lacks).
  """
  from experiments import bert_split
  try:
    space = split_space(f, mcfg.vocab_size)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  layers = [int(v) for v in f.layers_per_ipu]
  baseline = {"layers_per_ipu": layers,
              "available_memory_proportion": [float(v) for v in f.matmul_proportion],
              "recomputation": f.recomputation,
              "serialization_factor": f.decoder_serialization}
  # The search lowers shapes only: abstract weights, abstract optimizer state.
  result = bert_split.auto_split(
      mcfg, ipu_config(f, len(layers)), abstract_init(make_optimizer(f)),
      f.micro_batch, f.seq, f.max_predictions, baseline=baseline,
      confirm_top=f.split_confirm_top, seed=f.seed, abstract=True, **space)
  return adopt_split(f, result, "decoder_serialization"), result.lowered


def adopt_split(f, result, serialization_flag: str) -> dict:
  """Print a split search's ``result``, set the split flags to its choice (the
  serialisation factor into ``--serialization_flag``) and plot it with
  ``--split_plot``; the run JSON's ``split`` / ``search`` / ``split_estimate`` /
  ``split_baseline`` entries. The GPT-2 runner's ``--auto_split`` ends the same way.

  Raises:
    app.UsageError: nothing fits (the message names the closest split's IPU
      and the bytes its fullest tile lacks).
  """
  print(result.table())  # when nothing fits, its last line is the shortfall
  if not result.fits:
    raise app.UsageError(f"--auto_split: {result.message()}")
  print(result.message())
  split = result.config
  f.layers_per_ipu = [str(n) for n in split["layers_per_ipu"]]
  f.matmul_proportion = [str(p) for p in split["available_memory_proportion"]]
  f.recomputation = split["recomputation"]
  setattr(f, serialization_flag, split["serialization_factor"])
  if f.split_plot:
    print(f"Split plot written to {result.plot(f.split_plot)}")
  out = result.to_json()
  return {"split": out["split"], "search": out["search"], "split_estimate": out["estimate"],
          **({"split_baseline": out["baseline"]} if "baseline" in out else {})}


def train(pipe, loss_fn, optimizer, params, mcfg, f, mapping) -> dict:
  """Train ``--steps`` steps on synthetic masked-LM data; the run's figures."""
  from ipu_jax import host_time
  from experiments import bert
  per_step = f.accumulation * f.replicas
  data = [bert.synthetic_batches(mcfg, per_step, f.micro_batch, f.seq, f.max_predictions,
                                 seed=f.seed + step) for step in range(f.steps)]
  import jax
  keys = [jax.random.key(f.seed + step) for step in range(f.steps)] if uses_dropout(f) else None
  rng = (lambda step: {"rng": keys[step]}) if keys else (lambda step: {})
  start = time.time()
  state = pipe.init(params, data[0], **rng(0))
  lower_seconds = time.time() - start
  print(f"Lowered {len(mapping)} stages on IPUs {mapping} in {lower_seconds:.1f} s.")
  trained = params
  for step, batches in enumerate(data):
    t = time.time()
    out = pipe.step(trained, state, batches, **rng(step))
    trained, state, value = out.params, out.opt_state, out.loss
    print(f"step {step}: loss {float(value):.4f} ({time.time() - t:.1f} s on the host)")
  pipe.report.sequences_per_sample = f.packing_factor
  pipe.report.steps_per_execution = f.updates_per_execution * f.accumulation * f.replicas
  print(pipe.report.summary())
  tp = pipe.report.throughput
  layout = ({"att_ffn_placement": json.loads(f.att_ffn_placement)} if f.att_ffn_placement
            else {"layers_per_ipu": [int(v) for v in f.layers_per_ipu]})
  results = {**layout, "device_mapping": mapping,
             "lower_seconds": lower_seconds, "final_loss": float(value),
             "samples_per_second": tp.samples_per_second,
             "sequences_per_second": tp.sequences_per_second, "step_seconds": tp.step_seconds,
             "breakdown": tp.breakdown, "peak_rss_bytes": host_time.peak_rss_bytes()}
  if f.check:
    expected = plain_steps(loss_fn, optimizer, params, data, keys=keys)
    results["max_relative_difference"] = max_relative_difference(trained, expected)
    print(f"Plain JAX gradient accumulation: largest weight difference "
          f"{results['max_relative_difference']:.2e} of the weight's own scale")
  return results


if __name__ == "__main__":
  define_flags()
  app.run(main)
