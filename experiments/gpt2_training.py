r"""GPT-2 language-model training pipelined over IPUs, laid out as Graphcore ran it.

The model is :mod:`experiments.gpt2`; the layout is Graphcore's PopTorch
example's (``graphcore/examples`` ``nlp/gpt2/pytorch``): ``--layers_per_ipu``
blocks on each IPU of a replica, the token table on IPU 0, the positions on
IPU 1, the tied LM head and the loss back on IPU 0
(:func:`experiments.gpt2.layout`). The training recipe is the example's: a
recomputation checkpoint after every block, the LM head and the tied lookup
serialised over the vocabulary (``--embedding_serialization``), the loss in
chunks of ``--loss_serialization`` positions, a per-IPU available memory
proportion (``--matmul_proportion``), AdamW without bias correction with its
moments in ``--adam_m_dtype`` / ``--adam_v_dtype`` (:mod:`experiments.adamw`),
its state in streaming memory and sharded over the replicas
(``--offload_optimizer_state``, ``--replicated_tensor_sharding``),
gradients accumulated over ``--accumulation`` micro-batches and averaged
over ``--replicas``. The pipeline, its schedule and its throughput are the
BERT runner's (:class:`ipu_jax.pipelining.Pipeline`); the flags the runners
share (``--system``, ``--replicas``, ``--micro_batch``,
``--gradient_accumulation``, ``--dtype``) mean the same in each.

The default is a tiny GPT-2 (4 blocks of width 64, vocabulary 512, sequence
64) on 32 tiles per IPU that trains in a minute; ``--check`` also trains it
with plain JAX gradient accumulation and prints the largest relative weight
difference::

    python -m experiments.gpt2_training --check

``--config`` takes a preset mirroring the example's ``benchmarks.yml``
(:mod:`experiments.gpt2_presets`): ``small_pod16``, ``small_pod64``,
``medium_pod16``, ``medium_pod64``, ``large_sl512_pod16``,
``large_sl512_pod64``, ``large_pod16``; any flag given overrides it.
``--estimate_only`` lowers each stage's programs once (abstract weights,
nothing runs) and prints the estimate; ``--json_out`` writes it with the
keys every runner writes (``samples_per_second``, ``step_seconds``,
``breakdown``, ``fits``, ``per_ipu_peak_bytes``, ``lower_seconds``,
``peak_rss_bytes``)::

    python -m experiments.gpt2_training --config small_pod16 --estimate_only \
        --json_out reports/gpt2_small_pod16.json

No throughput measured with these configurations was found published
(docs/published_tables.md), so the estimates are not held against one.
"""

from __future__ import annotations

import math
import os
import time

from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import bert_pretraining  # noqa: E402
from experiments import entry  # noqa: E402
from experiments import gpt2_presets as presets  # noqa: E402

_FLAGS = flags.FLAGS
MODELS = ("tiny", "small", "medium", "large")
MOMENT_DTYPES = ("float16", "float32")


def define_flags(fv=None):
  """Defines the runner's flags in ``fv`` (default the global FLAGS) and returns it.

  Called when the runner runs, not on import (other runners share names).
  """
  fv = flags.FLAGS if fv is None else fv
  d = dict(flag_values=fv)
  flags.DEFINE_enum("config", None, sorted(presets.PRESETS),
                    "A preset mirroring Graphcore's PopTorch GPT-2 benchmarks "
                    "(experiments/gpt2_presets.py); flags given override it.", **d)
  flags.DEFINE_enum("model", "tiny", list(MODELS), "tiny: 4 x 64, vocabulary 512; small, "
                    "medium, large: GPT-2's (experiments.gpt2.SIZES).", **d)
  flags.DEFINE_list("layers_per_ipu", ["0", "2", "2"],
                    "Blocks on each IPU of a replica (IPU 0 also holds the token table and "
                    "the LM head, IPU 1 the positions); GPT-2 small: 0,4,4,4.", **d)
  flags.DEFINE_list("matmul_proportion", ["0.25", "0.25", "0.25"],
                    "Available memory proportion of matmuls on each IPU.", **d)
  flags.DEFINE_enum("schedule", "Grouped", ["Grouped", "Sequential", "Interleaved"],
                    "Pipeline schedule.", **d)
  flags.DEFINE_integer("accumulation", 8, "Micro-batches per weight update (G).", lower_bound=1,
                       **d)
  flags.DEFINE_alias("gradient_accumulation", "accumulation", flag_values=fv)
  flags.DEFINE_integer("replicas", 2, "Data-parallel replicas of the pipeline.", lower_bound=1,
                       **d)
  flags.DEFINE_integer("updates_per_execution", 1,
                       "Weight updates one execution of the device program runs (PopTorch's "
                       "device iterations: 8 in the presets); the host's fixed time per "
                       "execution is shared by them.", lower_bound=1, **d)
  flags.DEFINE_integer("micro_batch", 1, "Sequences per micro-batch.", lower_bound=1, **d)
  flags.DEFINE_integer("seq", 64, "Sequence length (also the model's positions, as the "
                       "example sets n_positions to --max-len).", lower_bound=1, **d)
  flags.DEFINE_integer("embedding_serialization", 2,
                       "Pieces of the vocabulary the tied lookup and LM head are cut into "
                       "(must divide it).", lower_bound=1, **d)
  flags.DEFINE_integer("loss_serialization", 32,
                       "Positions each cross-entropy chunk takes (0: one chunk).", lower_bound=0,
                       **d)
  flags.DEFINE_enum("partials_type", "float32", ["float32", "float16"],
                    "cfg.matmuls.partials_type (the example's --enable-half-partials: "
                    "float16).", **d)
  flags.DEFINE_boolean("recomputation", True, "Recompute each stage's forward in its "
                       "backward.", **d)
  flags.DEFINE_enum("last_stage_recomputation", "none", ["none", "checkpoints"],
                    "cfg.pipelining.last_stage_recomputation.", **d)
  flags.DEFINE_boolean("offload_optimizer_state", True, "AdamW state in streaming memory.", **d)
  flags.DEFINE_boolean("replicated_tensor_sharding", True,
                       "Shard the AdamW state over the replicas.", **d)
  flags.DEFINE_enum("adam_m_dtype", None, list(MOMENT_DTYPES),
                    "AdamW's first moment (default the weights' dtype; PopTorch's "
                    "first_order_momentum_accum_type, float16 in the presets).", **d)
  flags.DEFINE_enum("adam_v_dtype", None, list(MOMENT_DTYPES),
                    "AdamW's second moment (default the weights' dtype; PopTorch's "
                    "second_order_momentum_accum_type, float32 in the presets).", **d)
  flags.DEFINE_boolean("adam_bias_correction", True,
                       "Adam's 1 - b**t corrections (the example: bias_correction=False).", **d)
  flags.DEFINE_float("dropout", 0.0, "Dropout of the embeddings and residual branches, in "
                     "[0, 1).", **d)
  flags.DEFINE_float("attention_dropout", 0.0, "Dropout of the attention probabilities, in "
                     "[0, 1).", **d)
  flags.DEFINE_enum("random_mode", "jax", ["jax", "hardware"],
                    "cfg.random.mode: 'jax' draws jax.jit's bits, 'hardware' the tiles' "
                    "generators (poprand's vertices).", **d)
  flags.DEFINE_float("learning_rate", 1e-3, "AdamW learning rate.", **d)
  flags.DEFINE_integer("steps", 2, "Training steps (weight updates).", lower_bound=1, **d)
  flags.DEFINE_integer("tiles_per_ipu", 32, "Tiles per IPU (the presets: 1,472).",
                       lower_bound=0, **d)
  flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.", **d)
  flags.DEFINE_boolean("check", False, "Compare with plain JAX gradient accumulation.", **d)
  flags.DEFINE_string("system", None, "The IPU system (cfg.system): pod16, pod64, "
                      "bow-pod16, ...", **d)
  flags.DEFINE_enum("dtype", "float32", ["float32", "float16"],
                    "Weights and activations (the presets: float16).", **d)
  flags.DEFINE_boolean("estimate_only", False,
                       "Lower each stage program once and print the estimate; run nothing.",
                       **d)
  flags.DEFINE_string("report_dir", None, "Where to write the pipeline and stage reports.", **d)
  flags.DEFINE_string("json_out", None, "Write the run's figures to this JSON file.", **d)
  flags.DEFINE_boolean("auto_split", False,
                       "Search the split (blocks and matmul proportion per IPU, recomputation, "
                       "embedding serialisation) that fits and runs fastest, IPU 0 keeping the "
                       "token table and the head alone as the example's splits do; then estimate "
                       "or train with it. The split flags given are the search's baseline.", **d)
  flags.DEFINE_list("split_proportions", ["0.15", "0.25", "0.35", "0.45"],
                    "--auto_split: matmul proportions tried on each IPU.", **d)
  flags.DEFINE_list("split_recomputation", ["true"], "--auto_split: recomputation settings "
                    "tried.", **d)
  flags.DEFINE_list("split_serialization", ["4", "8"],
                    "--auto_split: embedding serialisation factors tried.", **d)
  flags.DEFINE_integer("split_confirm_top", 1, "--auto_split: best splits lowered in full, in "
                       "order, to confirm one (0: none).", lower_bound=0, **d)
  flags.DEFINE_string("split_plot", None, "--auto_split: PNG of per-IPU cycles and memory, the "
                      "chosen split beside the flags' own.", **d)
  return fv


def apply_preset(f) -> None:
  """Set the flags of ``--config``'s preset that the command line did not give."""
  if not f.config:
    return
  for name, value in presets.PRESETS[f.config].items():
    if not f[name].present:
      setattr(f, name, [str(v) for v in value] if isinstance(value, list) else value)


def model_config(f):
  """The flags' ``GPT2Config`` (positions = ``--seq``, as the example sets them);
  :func:`check_flags` first."""
  import jax.numpy as jnp
  from experiments import gpt2
  return gpt2.gpt2_config(
      f.model, max_positions=f.seq, dropout=f.dropout, attention_dropout=f.attention_dropout,
      embedding_serialization=f.embedding_serialization,
      loss_serialization=f.loss_serialization, dtype=jnp.dtype(f.dtype).type)


def stage_layout(f) -> tuple:
  """``(stage_assignment, device_mapping)`` of ``--layers_per_ipu``.

  Raises:
    ValueError: entries that are not whole numbers, a layout
      :func:`experiments.gpt2.layout` refuses, or blocks that do not add up to
      the model's, naming the flag.
  """
  from experiments import gpt2
  try:
    counts = [int(v) for v in f.layers_per_ipu]
    assignment, mapping = gpt2.layout(counts)
  except ValueError as e:
    raise ValueError(f"--layers_per_ipu={','.join(f.layers_per_ipu)}: {e}") from None
  blocks = gpt2.SIZES[f.model]["layers"]
  if sum(counts) != blocks:
    raise ValueError(f"--layers_per_ipu {counts} adds up to {sum(counts)} blocks; GPT-2 "
                     f"{f.model} has {blocks}.")
  return assignment, mapping


def check_flags(f) -> None:
  """Refuse bad settings before anything is built, naming the flag.

  Raises:
    ValueError: a dropout rate outside [0, 1), an embedding serialisation
      that does not divide the vocabulary, ``--check`` with hardware masks, a
      bad layout or proportion list, a G the schedule cannot run, or a system
      too small for replicas x IPUs per replica.
  """
  from ipu_jax.kernels.systems import check_capacity, system_preset
  from ipu_jax.pipelining import minimum_accumulation
  from experiments import gpt2
  for name in ("dropout", "attention_dropout"):
    if not 0.0 <= getattr(f, name) < 1.0:
      raise ValueError(f"--{name}={getattr(f, name)!r} must be in [0, 1) (the fraction of "
                       f"values dropped).")
  bert_pretraining.check_vocabulary_factor("--embedding_serialization",
                                           f.embedding_serialization,
                                           gpt2.gpt2_config(f.model).vocab_size)
  if f.check and bert_pretraining.uses_dropout(f) and f.random_mode == "hardware":
    raise ValueError("--check compares with plain JAX, whose dropout masks are jax.jit's bits; "
                     "use --random_mode=jax with --check, or no dropout.")
  _, mapping = stage_layout(f)
  ipus = max(mapping) + 1
  bert_pretraining.check_proportions(f.matmul_proportion, ipus)
  minimum = minimum_accumulation(f.schedule, len(mapping))
  if f.accumulation % minimum:
    raise ValueError(f"--accumulation={f.accumulation} does not suit the {f.schedule} schedule "
                     f"over {len(mapping)} stages: it must be a positive multiple of {minimum}.")
  if f.system:
    try:
      check_capacity(system_preset(f.system), f.replicas, ipus, "--replicas",
                     "IPUs per replica (len(--layers_per_ipu))")
    except ValueError as e:
      raise ValueError(f"--system={f.system}: {e}") from None


def make_optimizer(f):
  """The flags' AdamW (no weight decay: the example's parameter groups set it to 0)."""
  from experiments import adamw
  return adamw.adamw(f.learning_rate, eps=1e-6, mu_dtype=f.adam_m_dtype,
                     nu_dtype=f.adam_v_dtype, bias_correction=f.adam_bias_correction)


def build_pipeline(f, mcfg) -> tuple:
  """``(pipe, loss_fn, optimizer, params)``; abstract weights with ``--estimate_only``."""
  from flax import nnx
  import ipu_jax
  from experiments import gpt2
  assignment, mapping = stage_layout(f)
  cfg = bert_pretraining.ipu_config(f, max(mapping) + 1)
  optimizer = make_optimizer(f)
  if f.estimate_only:
    cfg.memory.allow_out_of_memory = True
    with ipu_jax.cheap_tracer_probes():
      model = nnx.eval_shape(lambda: gpt2.GPT2(mcfg, rngs=nnx.Rngs(f.seed)))
    optimizer = bert_pretraining.abstract_init(optimizer)
  else:
    model = gpt2.GPT2(mcfg, rngs=nnx.Rngs(f.seed))
  loss_fn, params = gpt2.make_loss(model, dropout=bert_pretraining.uses_dropout(f))
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                                     stage_assignment=assignment, rng=bert_pretraining.uses_dropout(f))
  return pipe, loss_fn, optimizer, params


def figures(f, pipe, lower_seconds: float) -> dict:
  """The run's figures under the keys every runner writes."""
  from ipu_jax import host_time
  report = pipe.report
  report.steps_per_execution = f.updates_per_execution * f.accumulation * f.replicas
  tp = report.throughput
  return {"config": f.config, "model": f.model, "system": f.system,
          "device_mapping": list(pipe.device_mapping),
          "samples_per_second": tp.samples_per_second,
          "tokens_per_second": tp.samples_per_second * f.seq,
          "step_seconds": tp.step_seconds, "breakdown": tp.breakdown,
          "forward_only": bert_pretraining.forward_only(pipe),
          "lower_seconds": lower_seconds, "peak_rss_bytes": host_time.peak_rss_bytes(),
          **bert_pretraining.memory_figures(pipe)}


def estimate(f, pipe, params, mcfg) -> dict:
  """Lower the pipeline once (one micro-batch's shapes, viewed ``G x R`` times)."""
  from experiments import gpt2
  one = gpt2.synthetic_batches(mcfg, 1, f.micro_batch, f.seq, f.seed)
  return figures(f, pipe, bert_pretraining.lower_step(pipe, params, one, f))


def train(f, pipe, loss_fn, optimizer, params, mcfg) -> dict:
  """Train ``--steps`` steps on generated text; with ``--check``, against plain JAX."""
  import jax
  from experiments import gpt2
  per_step = f.accumulation * f.replicas
  data = [gpt2.synthetic_batches(mcfg, per_step, f.micro_batch, f.seq, f.seed + step)
          for step in range(f.steps)]
  keys = [jax.random.key(f.seed + step) for step in range(f.steps)] if bert_pretraining.uses_dropout(f) else None
  rng = (lambda step: {"rng": keys[step]}) if keys else (lambda step: {})
  start = time.time()
  state = pipe.init(params, data[0], **rng(0))
  lower_seconds = time.time() - start
  trained = params
  for step, batches in enumerate(data):
    out = pipe.step(trained, state, batches, **rng(step))
    trained, state = out.params, out.opt_state
    print(f"step {step}: loss {float(out.loss):.4f}")
  results = dict(figures(f, pipe, lower_seconds), final_loss=float(out.loss))
  if f.check:
    expected = bert_pretraining.plain_steps(loss_fn, optimizer, params, data, keys=keys)
    results["max_relative_difference"] = bert_pretraining.max_relative_difference(
        trained, expected)
    print(f"Plain JAX gradient accumulation: largest weight difference "
          f"{results['max_relative_difference']:.2e} of the weight's own scale")
  return results


def layered_model(f, mcfg):
  """GPT-2 (``mcfg``) as the split search's :class:`ipu_jax.pipelining.LayeredModel`,
  abstract weights: ``wte`` the first block, ``lm_head`` the last (IPU 0), the
  blocks between. The positions and ``ln_f`` follow the values they read
  (``wpe`` the table's stage, ``ln_f`` the last block's), so the search's
  layout differs from the example's only in the positions' IPU (0, not 1).
  """
  import dataclasses
  import jax
  from flax import nnx
  import ipu_jax
  from experiments import gpt2
  batch = jax.tree_util.tree_map(
      lambda b: b[0], gpt2.synthetic_batches(mcfg, 1, f.micro_batch, f.seq, f.seed))
  dropout = bert_pretraining.uses_dropout(f)

  def build(num_layers: int, serialization: int):
    cfg = dataclasses.replace(mcfg, layers=num_layers, embedding_serialization=serialization)
    with ipu_jax.cheap_tracer_probes():
      model = nnx.eval_shape(lambda: gpt2.GPT2(cfg, rngs=nnx.Rngs(f.seed)))
    return gpt2.make_loss(model, dropout=dropout)

  return ipu_jax.pipelining.LayeredModel(
      build=build, num_layers=mcfg.layers, micro_batch=batch,
      layer_path=lambda i: f"layers_{i}", first=("wte",), last=("lm_head",),
      samples_per_micro_batch=f.micro_batch, rng=dropout)


# Compositions of the blocks over IPUs 1.. searched in full up to this many;
# past it (GPT-2 medium and large on 8 IPUs: 100,947 and 1.6 M) only the
# balanced ones, each IPU within one block of the even share's floor / ceiling.
_ALL_COMPOSITIONS = 5000
# Candidates (compositions x proportions per IPU x recomputation x
# serialisation) a search may score: a 4-IPU search scores 28,160 in ~20 s.
_MAX_CANDIDATES = 2_000_000


def _count(blocks: int, parts: int, low: int, high: int) -> int:
  """How many splits of ``blocks`` into ``parts`` counts, each in ``[low, high]``."""
  ways = [1] + [0] * blocks  # ways[b]: splits of b blocks into the parts so far
  for _ in range(parts):
    ways = [sum(ways[b - k] for k in range(low, min(high, b) + 1)) for b in range(blocks + 1)]
  return ways[blocks]


def _compositions(blocks: int, parts: int, low: int, high: int) -> list:
  """Every split of ``blocks`` into ``parts`` counts, each in ``[low, high]``."""
  if parts == 1:
    return [(blocks,)] if low <= blocks <= high else []
  out = []
  for first in range(low, high + 1):
    rest = blocks - first
    if (parts - 1) * low <= rest <= (parts - 1) * high:
      out += [(first,) + tail for tail in _compositions(rest, parts - 1, low, high)]
  return out


def searched_compositions(blocks: int, ipus: int, limit: int) -> tuple:
  """``layers_per_ipu`` the search tries: IPU 0 none, the others at least one each;
  all of them, or only the balanced ones when there are more than
  :data:`_ALL_COMPOSITIONS`.

  Raises:
    ValueError: more than ``limit`` of them (counted, not listed).
  """
  parts = ipus - 1
  if math.comb(blocks - 1, parts - 1) <= _ALL_COMPOSITIONS:
    low, high = 1, blocks
  else:
    low, high = max(1, blocks // parts - 1), -(-blocks // parts) + 1
  count = _count(blocks, parts, low, high)
  if count > limit:
    raise ValueError(f"{count:,d} ways to place {blocks} blocks on IPUs 1 to {parts} "
                     f"(each {low} to {high})")
  return tuple((0,) + c for c in _compositions(blocks, parts, low, high))


def choose_split(f, mcfg) -> dict:
  """``--auto_split``: search the split, set the split flags to it; the JSON's entries.

  The compositions searched keep IPU 0 free of blocks (the table, the head
  and the loss are its work, as in the example's splits of GPT-2 small and
  medium), so the runner's layout has the stages the search's had and G
  suits both (:func:`searched_compositions`).

  Raises:
    app.UsageError: a bad ``--split_*`` value, or no split fits (the message
      names the closest split's IPU and the bytes its fullest tile lacks).
  """
  import ipu_jax
  from ipu_jax.pipelining import minimum_accumulation
  try:
    space = bert_pretraining.split_space(f, mcfg.vocab_size)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  ipus = len(f.layers_per_ipu)
  # The searched layouts' stages: the table's, one per other IPU, the head's;
  # the flags' split is the baseline, so it must be one of them.
  minimum = minimum_accumulation(f.schedule, ipus + 1)
  g = max(minimum, round(f.accumulation / minimum) * minimum)
  if int(f.layers_per_ipu[0]) or f.accumulation % minimum:
    share, extra = divmod(mcfg.layers, ipus - 1)
    even = [0] + [share] * (ipus - 1 - extra) + [share + 1] * extra
    raise app.UsageError(
        f"--auto_split searches splits with no blocks on IPU 0 ({ipus + 1} stages under the "
        f"{f.schedule} schedule) from the flags' split; --layers_per_ipu="
        f"{','.join(f.layers_per_ipu)} with --accumulation={f.accumulation} is not one. Give "
        f"one, e.g. --layers_per_ipu={','.join(map(str, even))} --accumulation={g} (a "
        f"multiple of {minimum}).")
  settings = (len(space["proportions"]) ** ipus * len(space["recomputation"])
              * len(space["serialization"]))
  try:
    free_ipu0 = searched_compositions(mcfg.layers, ipus, _MAX_CANDIDATES // settings)
  except ValueError as e:
    raise app.UsageError(
        f"--auto_split: {e}, times {settings:,d} settings ({len(space['proportions'])} "
        f"proportions on each of {ipus} IPUs x {len(space['recomputation'])} x "
        f"{len(space['serialization'])}), are more than the {_MAX_CANDIDATES:,d} candidates a "
        f"search scores in minutes; give fewer --split_proportions (each IPU multiplies by "
        f"their count), --split_serialization or --split_recomputation, or fewer IPUs.") from None
  baseline = {"layers_per_ipu": [int(v) for v in f.layers_per_ipu],
              "available_memory_proportion": [float(v) for v in f.matmul_proportion],
              "recomputation": f.recomputation,
              "serialization_factor": f.embedding_serialization}
  result = ipu_jax.pipelining.search(
      layered_model(f, mcfg), bert_pretraining.ipu_config(f, ipus),
      bert_pretraining.abstract_init(make_optimizer(f)),
      ipu_jax.pipelining.SearchSpace(layers_per_ipu=free_ipu0, **space), baseline=baseline,
      confirm_top=f.split_confirm_top)
  return bert_pretraining.adopt_split(f, result, "embedding_serialization")


def run(f) -> dict:
  """The runner on parsed flag values ``f``: estimate or train; the run's figures.

  Raises:
    app.UsageError: a bad flag, naming it.
  """
  apply_preset(f)
  try:
    check_flags(f)
    mcfg = model_config(f)
    entry.prepare_outputs(files=[("--json_out", f.json_out), ("--split_plot", f.split_plot)],
                          directories=[("--report_dir", f.report_dir)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  searched = {}
  if f.auto_split:
    searched = choose_split(f, mcfg)
    mcfg = model_config(f)  # the chosen serialisation
  pipe, loss_fn, optimizer, params = build_pipeline(f, mcfg)
  if f.estimate_only:
    results = estimate(f, pipe, params, mcfg)
  else:
    results = train(f, pipe, loss_fn, optimizer, params, mcfg)
  print(pipe.report.summary())
  print(f"{'Estimate' if f.estimate_only else 'Run'} ({f.config or 'flags'}, GPT-2 {f.model}): "
        f"{results['samples_per_second']:,.1f} sequences/s, "
        f"{results['tokens_per_second']:,.0f} tokens/s, step {results['step_seconds']:.3f} s; "
        f"fits: {results['fits']} (largest tile per IPU {results['per_ipu_max_tile_bytes']} "
        f"of {results['bytes_per_tile']:,d} B); lowered in {results['lower_seconds']:.1f} s, "
        f"peak RSS {results['peak_rss_bytes'] / 2**30:.2f} GiB")
  results.update(searched)
  entry.write_outputs(pipe.report, results, f.report_dir, f.json_out)
  return results


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  run(_FLAGS)


if __name__ == "__main__":
  define_flags()
  app.run(main)
