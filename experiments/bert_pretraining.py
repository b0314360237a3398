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
``--replicated_tensor_sharding``), gradients accumulated over
``--accumulation`` micro-batches and averaged over ``--replicas``.

The default is a small BERT (4 layers of width 128, vocabulary 1,000,
sequence 64) on 16 tiles per IPU that trains in about a minute::

    python -m experiments.bert_pretraining --report_dir reports/bert

``--check`` also trains the same model on the same micro-batches with plain
JAX gradient accumulation (no pipeline) and prints the largest relative
difference of the weights.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "tiny", ["tiny", "base", "large"],
                  "tiny: 4 x 128, vocabulary 1,000; base: BERT-Base; large: BERT-Large.")
flags.DEFINE_list("layers_per_ipu", ["1", "1", "1", "1"],
                  "Encoder layers on each IPU of a replica (BERT-Large: 3,7,7,7).")
flags.DEFINE_list("matmul_proportion", ["0.15", "0.25", "0.25", "0.25"],
                  "Available memory proportion of matmuls on each IPU.")
flags.DEFINE_enum("schedule", "Grouped", ["Grouped", "Sequential", "Interleaved"],
                  "Pipeline schedule (Interleaved cannot hold two stages on one IPU).")
flags.DEFINE_integer("accumulation", 10, "Micro-batches per weight update (G).")
flags.DEFINE_integer("replicas", 2, "Data-parallel replicas of the pipeline.")
flags.DEFINE_integer("micro_batch", 2, "Sequences per micro-batch.")
flags.DEFINE_integer("seq", 64, "Sequence length.")
flags.DEFINE_integer("max_predictions", 8, "Masked positions per sequence.")
flags.DEFINE_integer("decoder_serialization", 2, "Serialisation factor of the MLM decoder.")
flags.DEFINE_boolean("recomputation", True, "Recompute each stage's forward in its backward.")
flags.DEFINE_boolean("offload_optimizer_state", True, "LAMB state in streaming memory.")
flags.DEFINE_boolean("replicated_tensor_sharding", True,
                     "Shard the LAMB state over the replicas.")
flags.DEFINE_float("dropout", 0.0, "Dropout rate.")
flags.DEFINE_float("learning_rate", 1e-3, "LAMB learning rate.")
flags.DEFINE_integer("steps", 3, "Training steps (weight updates).")
flags.DEFINE_integer("tiles_per_ipu", 16, "Tiles per IPU (small: a fast emulation).")
flags.DEFINE_integer("seed", 0, "Seed of the weights and the data.")
flags.DEFINE_boolean("check", False, "Compare with plain JAX gradient accumulation.")
flags.DEFINE_string("report_dir", None, "Where to write the pipeline and stage reports.")
flags.DEFINE_string("json_out", None, "Write the run's figures to this JSON file.")


def model_config(name: str, dropout: float, decoder_serialization: int):
  from experiments import bert
  if name == "tiny":
    return bert.BertConfig(vocab_size=1000, hidden=128, layers=4, heads=4, ffn=512,
                           max_positions=512, dropout=dropout,
                           decoder_serialization=decoder_serialization)
  make = bert.bert_large if name == "large" else bert.bert_base
  return make(dropout=dropout, decoder_serialization=decoder_serialization)


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
  cfg.matmuls.available_memory_proportion = [float(v) for v in f.matmul_proportion]
  cfg.streaming.offload_optimizer_state = f.offload_optimizer_state
  cfg.streaming.replicated_tensor_sharding = f.replicated_tensor_sharding
  return cfg


def plain_steps(loss_fn, optimizer, params, batches_per_step, keys=None):
  """Weights after plain JAX gradient accumulation: the mean over all micro-batches.

  Args:
    keys: with dropout, each step's key; micro-batch m of a step is given
      ``ipu_jax.pipelining.micro_batch_key(key, m)``, as the pipeline does.
  """
  import jax
  import optax
  from ipu_jax.pipelining import micro_batch_key
  state = optimizer.init(params)
  grad = jax.jit(jax.grad(loss_fn))
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
    updates, state = optimizer.update(mean, state, params)
    params = optax.apply_updates(params, updates)
  return params


def max_relative_difference(a, b) -> float:
  import jax
  diffs = [float(np.max(np.abs(np.asarray(x) - np.asarray(y)) / (np.abs(np.asarray(y)) + 1e-6)))
           for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))]
  return max(diffs, default=0.0)


def main(argv):
  del argv
  import jax
  import optax
  from flax import nnx
  import ipu_jax
  from experiments import bert

  f = _FLAGS
  layers_per_ipu = [int(v) for v in f.layers_per_ipu]
  mcfg = model_config(f.model, f.dropout, f.decoder_serialization)
  if sum(layers_per_ipu) != mcfg.layers:
    raise app.UsageError(f"--layers_per_ipu {layers_per_ipu} adds up to {sum(layers_per_ipu)} "
                         f"layers; the {f.model} model has {mcfg.layers}.")
  assignment, mapping = bert.layout(layers_per_ipu)
  cfg = ipu_config(f, len(layers_per_ipu))
  loss_fn, params = bert.make_loss(bert.Bert(mcfg, rngs=nnx.Rngs(f.seed)))
  optimizer = optax.lamb(f.learning_rate)
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                                     stage_assignment=assignment)
  per_step = f.accumulation * f.replicas
  data = [bert.synthetic_batches(mcfg, per_step, f.micro_batch, f.seq, f.max_predictions,
                                 seed=f.seed + step) for step in range(f.steps)]
  start = time.time()
  state = pipe.init(params, data[0])
  lower_seconds = time.time() - start
  print(f"Lowered {len(mapping)} stages on IPUs {mapping} in {lower_seconds:.1f} s.")
  trained = params
  for step, batches in enumerate(data):
    t = time.time()
    trained, state, value = pipe.step(trained, state, batches)
    print(f"step {step}: loss {float(value):.4f} ({time.time() - t:.1f} s on the host)")
  print(pipe.report.summary())
  results = {"layers_per_ipu": layers_per_ipu, "device_mapping": mapping,
             "lower_seconds": lower_seconds, "final_loss": float(value)}
  if f.check:
    expected = plain_steps(loss_fn, optimizer, params, data)
    results["max_relative_difference"] = max_relative_difference(trained, expected)
    print(f"Plain JAX gradient accumulation: largest relative weight difference "
          f"{results['max_relative_difference']:.2e}")
  if f.report_dir:
    pipe.report.save(f.report_dir)
    print(f"Reports written to {f.report_dir}")
  if f.json_out:
    with open(f.json_out, "w") as out:
      json.dump(results, out, indent=1)


if __name__ == "__main__":
  app.run(main)
