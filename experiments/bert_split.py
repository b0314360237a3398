r"""The split search (:func:`ipu_jax.pipelining.search`) for BERT.

:func:`layered_model` describes :mod:`experiments.bert` to the search: its
encoder layers ``layers_i``, the ``embeddings`` before them and the
``pooler`` and heads after them (the MLM decoder tied to the word table, so
both blocks sit on IPU 0), built with any number of layers and any
serialisation factor of the decoder (the largest matmul).
:func:`auto_split` is what the runner's ``--auto_split`` calls;
:func:`large_phase1_pod16` is the BERT-Large phase-1 search on POD16 (4 IPUs
per replica, 4 replicas) beside Graphcore's published split::

    python -m experiments.bert_split --json_out split.json --plot split.png
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from absl import app, flags

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import entry  # noqa: E402

# Graphcore's published BERT-Large phase-1 split on 4 IPUs per replica
# (graphcore/examples, nlp/bert configs: layers_per_ipu / matmul_proportion).
GRAPHCORE_LARGE_SPLIT = {"layers_per_ipu": [3, 7, 7, 7],
                         "available_memory_proportion": [0.15, 0.25, 0.25, 0.25],
                         "recomputation": True, "serialization_factor": 4}


def layered_model(mcfg, micro_batch: int, seq: int, max_predictions: int, seed: int = 0,
                  abstract: bool = False):
  """BERT (``mcfg``) as an :class:`ipu_jax.pipelining.LayeredModel`.

  Args:
    abstract: build the weights as shapes only (``nnx.eval_shape``): lowering
      reads only their shapes, and BERT-Large's real weights would be drawn
      again for every probe and confirmation. The optimizer must then give
      abstract state for abstract weights
      (``experiments.bert_pretraining.abstract_init``).
  """
  import jax
  from flax import nnx
  import ipu_jax
  from experiments import bert
  batch = bert.synthetic_batches(mcfg, 1, micro_batch, seq, max_predictions, seed=seed)
  batch = jax.tree_util.tree_map(lambda b: b[0], batch)

  # With dropout the search lowers the masks too: its figures are the run's.
  dropout = mcfg.dropout > 0 or mcfg.attention_dropout > 0

  def build(num_layers: int, serialization: int):
    cfg = dataclasses.replace(mcfg, layers=num_layers, decoder_serialization=serialization)
    make = lambda: bert.Bert(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    if abstract:
      with ipu_jax.cheap_tracer_probes():  # linear in the model's size, not quadratic
        return bert.make_loss(nnx.eval_shape(make), dropout=dropout)
    return bert.make_loss(make(), dropout=dropout)

  return ipu_jax.pipelining.LayeredModel(
      build=build, num_layers=mcfg.layers, micro_batch=batch,
      layer_path=lambda i: f"layers_{i}", first=("embeddings",),
      last=("pooler", "mlm_head", "nsp_head"), samples_per_micro_batch=micro_batch,
      rng=dropout)


def auto_split(mcfg, config, optimizer, micro_batch: int, seq: int, max_predictions: int,
               proportions=(0.15, 0.25, 0.35, 0.45), recomputation=(True,),
               serialization=(1, 2, 4), baseline=None, log=print, seed: int = 0,
               abstract: bool = False, **search_options):
  """The runner's ``--auto_split``: the search's result for this BERT and config.

  ``result.config`` holds the runner's keys (None when nothing fits:
  ``result.message()`` names the shortfall); ``result.to_json()`` gives the
  runner's ``"split"`` and ``"search"`` entries.
  """
  import ipu_jax
  space = ipu_jax.pipelining.SearchSpace(proportions=tuple(proportions),
                                         recomputation=tuple(recomputation),
                                         serialization=tuple(serialization))
  model = layered_model(mcfg, micro_batch, seq, max_predictions, seed=seed, abstract=abstract)
  return ipu_jax.pipelining.search(model, config, optimizer, space, baseline=baseline,
                                   log=log, **search_options)


def large_phase1_config(micro_batch: int = 8, accumulation: int = 256, replicas: int = 4,
                        tiles_per_ipu: int = 1472, optimizer: str = "lamb"):
  """BERT-Large phase 1 (sequence 128, 20 masked positions) on POD16: 4 IPUs per
  replica x 4 replicas, half precision, Grouped schedule, LAMB state offloaded and sharded.

  Returns ``(model config, IPUConfig, optimizer, micro_batch, seq, max_predictions)``.
  """
  import jax.numpy as jnp
  import optax
  import ipu_jax
  from experiments import bert
  # Graphcore's BERT configs pad the vocabulary to 30,528 (a multiple of 4 and
  # 8) so the decoder serialises into equal pieces.
  # Weights and activations in half precision, as Graphcore trained BERT-Large.
  mcfg = bert.bert_large(dropout=0.0, vocab_size=30528, dtype=jnp.float16)
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles_per_ipu
  cfg.auto_select_ipus = 4
  cfg.replication_factor = replicas
  cfg.training.gradient_accumulation_steps = accumulation
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.pipelining.schedule = "Grouped"
  cfg.streaming.offload_optimizer_state = True
  cfg.streaming.replicated_tensor_sharding = True
  opt = optax.lamb(1e-3) if optimizer == "lamb" else optax.sgd(1e-3)
  return mcfg, cfg, opt, micro_batch, 128, 20


def large_phase1_pod16(log=print, preset_options=None, **search_options):
  """The BERT-Large phase-1 POD16 search, with Graphcore's split as the baseline.

  ``preset_options``: keywords of :func:`large_phase1_config`.
  """
  mcfg, cfg, optimizer, micro_batch, seq, max_predictions = large_phase1_config(
      **(preset_options or {}))
  return auto_split(mcfg, cfg, optimizer, micro_batch, seq, max_predictions,
                    baseline=GRAPHCORE_LARGE_SPLIT, log=log, **search_options)


@entry.reporting_errors
def main(argv):
  from ipu_jax import host_time
  del argv
  entry.quiet_backend_probe()
  try:
    entry.prepare_outputs(files=[("--json_out", _JSON_OUT.value), ("--plot", _PLOT.value)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  start = time.time()
  result = large_phase1_pod16(
      preset_options={"optimizer": _OPTIMIZER.value, "micro_batch": _MICRO_BATCH.value},
      confirm_top=_CONFIRM_TOP.value,
      proportions=[float(p) for p in _PROPORTIONS.value],
      serialization=[int(s) for s in _SERIALIZATION.value])
  print(result.table())
  if result.fits:
    print(result.message())
  rss = host_time.peak_rss_bytes() / 2**30
  print(f"wall {time.time() - start:.0f} s, peak RSS {rss:.2f} GB")
  if _JSON_OUT.value:
    with open(_JSON_OUT.value, "w") as out:
      json.dump({**result.to_json(), "peak_rss_gb": rss}, out, indent=1)
  if _PLOT.value and result.fits:
    result.plot(_PLOT.value)


def _define_flags() -> None:
  """The runner's flags, defined only when it runs (tests import this module
  beside ``bert_pretraining``, whose flags share some names)."""
  global _JSON_OUT, _PLOT, _CONFIRM_TOP, _PROPORTIONS, _SERIALIZATION, _OPTIMIZER
  global _MICRO_BATCH
  _JSON_OUT = flags.DEFINE_string("json_out", None, "Write the search's result to this JSON file.")
  _PLOT = flags.DEFINE_string("plot", None, "Plot per-IPU cycles and memory of the chosen split.")
  _CONFIRM_TOP = flags.DEFINE_integer("confirm_top", 1,
                                      "Best splits lowered in full to confirm (0: none).",
                                      lower_bound=0)
  _PROPORTIONS = flags.DEFINE_list("proportions", ["0.15", "0.25", "0.35", "0.45"],
                                   "Available memory proportions tried on each IPU.")
  _SERIALIZATION = flags.DEFINE_list("serialization", ["1", "2", "4"],
                                     "Serialisation factors tried on the MLM decoder.")
  _OPTIMIZER = flags.DEFINE_enum("optimizer", "lamb", ["lamb", "sgd"], "The optimizer.")
  _MICRO_BATCH = flags.DEFINE_integer("micro_batch", 8, "Sequences per micro-batch.",
                                      lower_bound=1)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
