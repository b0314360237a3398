"""Presets of ``experiments.llm`` mirroring Graphcore's public PopXL examples.

Every value names where it comes from (:data:`SOURCES`, one entry per preset
field that is not a plain default): the files of ``graphcore/examples`` at
commit ``3cc8f81f13728dd8c17d0d3c8d2fc1549b159485`` (the repository's last
commit, 5 March 2024):

* GPT-J 6B fine-tuning: ``nlp/gpt_j/popxl/config/finetuning.yml``
  (``gptj_6B_1024_pod16``, ``gptj_6B_1024_pod64``): 28 layers, hidden 4,096,
  16 heads, rotary dimension 64, vocabulary 50,400, sequence 1,024, global
  batch 128, micro-batch 1, tensor parallel 16, data parallel 1 (POD16) or 4
  (POD64), AdamW; the model runs phased (a phase per decoder block, weights
  and optimizer state in remote buffers, RTS over the data-parallel group,
  batch serialisation: ``nlp/gpt_j/popxl/README.md``, "Phased Execution and
  Batch serialisation", "Combining data parallelism, tensor parallelism and
  RTS"). Gradient accumulation = global batch / (dp x micro-batch)
  (``config/config.py``, ``GPTJConfig.gradient_accumulation``): 128 on POD16,
  32 on POD64. Precision float16 (``ModelConfig.precision``'s default).
* GPT-3 175B pre-training: ``nlp/gpt3_175B/popxl/config/pretraining.yml``
  (``gpt3_175B_pod256``): 96 layers, hidden 12,288, 96 heads, vocabulary
  50,257, 2,048 positions, sequence 2,048, global batch 128, micro-batch 1,
  data parallel 4 and **2-D** tensor parallel 8 x 8 (64 IPUs a replica). The
  TP here is 1-D (Megatron's), and 64 does not divide the 96 heads, so the
  preset is **derived**: the same 256 IPUs as tensor parallel 32 (3 heads an
  IPU) x data parallel 8, gradient accumulation 128 / 8 = 16; the vocabulary
  padded to 50,272 (the next multiple of 32, as PopXL's sharded embedding
  pads it). Marked "derived" in :data:`SOURCES`.
* Llama-2 7B inference: ``nlp/llama/popxl/config/inference.yml``
  (``llama2_7b_pod2`` / ``_pod4`` / ``_pod16``): 32 layers, hidden 4,096,
  intermediate 11,008, 32 heads (32 KV heads), vocabulary 32,000, sequence
  2,048, micro-batch 1, tensor parallel 2 / 4 / 16; phased, one decoder block
  a phase with its weights in remote buffers, and a KV cache in remote
  buffers (``nlp/llama/popxl/inference.py``, ``use_cache``: one token a
  step). There is no "pod2" system: the 2-IPU preset runs on an IPU-M2000
  (``pod4``), two of its IPUs.

The tiny preset (``tiny_check``) is the 4-layer GPT of width 128 the issue's
acceptance names, small enough to train for real in a test.

Published measurements beside which the runner's estimate is read
(:data:`PUBLISHED`): GPT-J POD16 fine-tuning "each step takes around 20-22
seconds" (``nlp/gpt_j/popxl/finetuning.ipynb``, "Run fine-tuning"; global
batch 128 of 1,024 tokens: about 6,200 tokens/s); Llama-2 7B on 16 IPUs
(``llama2_7b_pod16``, the notebook's default of 16 IPUs, micro-batch 2,
sequence 1,024) "Total throughput: 7.00 t/s" in the saved outputs of
``nlp/llama/popxl/llama2-inference.ipynb`` (a Paperspace run that also
prints each token live). Nothing is published for GPT-3 175B's throughput.
"""

from __future__ import annotations

__all__ = ["PRESETS", "SOURCES", "PUBLISHED", "EXAMPLES_COMMIT", "preset_values"]

EXAMPLES_COMMIT = "3cc8f81f13728dd8c17d0d3c8d2fc1549b159485"
_GPTJ_YML = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt_j/popxl/config/finetuning.yml"
_GPTJ_README = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt_j/popxl/README.md"
_GPTJ_CONFIG = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt_j/popxl/config/config.py"
_GPT3_YML = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt3_175B/popxl/config/pretraining.yml"
_GPT3_README = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt3_175B/popxl/README.md"
_LLAMA_YML = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/llama/popxl/config/inference.yml"
_LLAMA_PY = f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/llama/popxl/inference.py"

# What every preset of a model shares (the model's sizes and recipe).
_GPTJ = {"model": "gptj", "mode": "train", "layers": 28, "hidden": 4096, "heads": 16,
         "ffn": 16384, "rotary_dim": 64, "vocab_size": 50400, "seq": 1024, "micro_batch": 1,
         "global_batch": 128, "tensor_parallel": 16, "phased": True, "phase_mode": "serial",
         "remote_weights": True, "remote_optimizer_state": True, "remote_activations": True,
         "rts": True, "rts_activations": True, "recompute": True, "dtype": "float16",
         "tiles_per_ipu": 1472, "available_memory_proportion": 0.2}
_GPT3 = {"model": "gpt3", "mode": "train", "layers": 96, "hidden": 12288, "heads": 96,
         "ffn": 49152, "rotary_dim": 0, "vocab_size": 50272, "max_positions": 2048,
         "seq": 2048, "micro_batch": 1, "global_batch": 128, "tensor_parallel": 32,
         "data_parallel": 8, "phased": True, "phase_mode": "serial", "remote_weights": True,
         "remote_optimizer_state": True, "remote_activations": True, "rts": True,
         "rts_activations": False, "sequence_parallel": True, "recompute": True,
         "dtype": "float16", "tiles_per_ipu": 1472, "available_memory_proportion": 0.1,
         "system": "pod256"}
_LLAMA2_7B = {"model": "llama2", "mode": "inference", "layers": 32, "hidden": 4096,
              "heads": 32, "ffn": 11008, "rotary_dim": 128, "vocab_size": 32000, "seq": 2048,
              "micro_batch": 1, "global_batch": 1, "data_parallel": 1, "phased": True,
              "phase_mode": "serial", "remote_weights": True, "remote_optimizer_state": False,
              "remote_activations": False, "rts": False, "recompute": False,
              "dtype": "float16", "tiles_per_ipu": 1472}

PRESETS = {
    # One replica: nothing to shard the remote state over (RTS needs dp >= 2).
    "gptj_6b_finetune_pod16": dict(_GPTJ, data_parallel=1, rts=False, system="pod16"),
    "gptj_6b_finetune_pod64": dict(_GPTJ, data_parallel=4, system="pod64"),
    "gpt3_175b_pretrain_pod256": dict(_GPT3),
    "llama2_7b_inference_pod2": dict(_LLAMA2_7B, tensor_parallel=2, system="pod4",
                                     available_memory_proportion=0.1),
    "llama2_7b_inference_pod4": dict(_LLAMA2_7B, tensor_parallel=4, system="pod4",
                                     available_memory_proportion=0.4),
    "llama2_7b_inference_pod16": dict(_LLAMA2_7B, tensor_parallel=16, system="pod16",
                                      available_memory_proportion=0.4),
    # The small GPT: 4 layers of width 128, 4 heads, vocabulary 256,
    # sequence 16; TP 2 x DP 2, phased, G = 4 (global batch 16 of micro-batch 2).
    "tiny_check": {"model": "gpt3", "mode": "train", "layers": 4, "hidden": 128, "heads": 4,
                   "ffn": 512, "rotary_dim": 0, "vocab_size": 256, "max_positions": 16,
                   "seq": 16, "micro_batch": 2, "global_batch": 16, "tensor_parallel": 2,
                   "data_parallel": 2, "phased": True, "phase_mode": "serial",
                   "remote_weights": True, "remote_optimizer_state": True,
                   "remote_activations": True, "rts": False, "recompute": True,
                   "dtype": "float32", "tiles_per_ipu": 16, "system": "pod16"},
}

# Where each value comes from: field -> source (file of graphcore/examples at
# EXAMPLES_COMMIT, with its key), per preset; "derived:" marks a value not
# published as such, with the reason.
_GPTJ_SOURCES = {
    "layers": f"{_GPTJ_YML} gptj_6B_1024.model.layers",
    "hidden": f"{_GPTJ_YML} gptj_6B_1024.model.hidden_size",
    "heads": f"{_GPTJ_YML} gptj_6B_1024.model.attention.heads",
    "rotary_dim": f"{_GPTJ_YML} gptj_6B_1024.model.attention.rotary_dim",
    "vocab_size": f"{_GPTJ_YML} gptj_6B_1024.model.embedding.vocab_size",
    "seq": f"{_GPTJ_YML} gptj_6B_1024.model.sequence_length",
    "ffn": "GPT-J's 4 x hidden feed-forward (EleutherAI GPT-J 6B config, n_inner = 4 n_embd)",
    "global_batch": f"{_GPTJ_YML} gptj_6B_1024.training.global_batch_size",
    "micro_batch": f"{_GPTJ_YML} release.*.execution.micro_batch_size",
    "tensor_parallel": f"{_GPTJ_YML} release.*.execution.tensor_parallel",
    "data_parallel": f"{_GPTJ_YML} release.*.execution.data_parallel",
    "phased": f"{_GPTJ_README} 'Phased Execution and Batch serialisation'",
    "rts": f"{_GPTJ_README} 'Combining data parallelism, tensor parallelism and RTS'",
    "remote_activations": f"{_GPTJ_README} 'RTS on activations'",
    "rts_activations": f"{_GPTJ_README} 'RTS on activations' (stored activations sharded "
                       "over the tensor-parallel group, gathered after each load)",
    "dtype": f"{_GPTJ_CONFIG} ModelConfig.precision (float16)",
    "accumulation": f"{_GPTJ_CONFIG} GPTJConfig.gradient_accumulation = global / (dp x micro)",
    "available_memory_proportion": f"{_GPTJ_YML} release.*.execution.available_memory_proportion",
}
_GPT3_SOURCES = {
    "rts_activations": f"derived: {_GPT3_README} 'Phased Execution and RTS' (the 2-D tensor "
                       "parallelism splits the activation x along the hidden dimension); "
                       "off here: sequence_parallel already stores each IPU's 1/32 block",
    "sequence_parallel": ("derived: Graphcore's 2-D TP splits activations along hidden; "
                          "sequence parallelism is our 1-D TP's way to split them "
                          "(Korthikanti et al. 2022, arXiv:2205.05198)"),
    "layers": f"{_GPT3_YML} gpt3_175B.model.layers",
    "hidden": f"{_GPT3_YML} gpt3_175B.model.hidden_size",
    "heads": f"{_GPT3_YML} gpt3_175B.model.attention.heads",
    "seq": f"{_GPT3_YML} gpt3_175B.model.sequence_length",
    "max_positions": f"{_GPT3_YML} gpt3_175B.model.embedding.max_positional_length",
    "ffn": "GPT-3's 4 x hidden feed-forward (Brown et al. 2020, section 2.1)",
    "global_batch": f"{_GPT3_YML} gpt3_175B.training.global_batch_size",
    "micro_batch": f"{_GPT3_YML} release.gpt3_175B_pod256.execution.micro_batch_size",
    "vocab_size": (f"derived: {_GPT3_YML} embedding.vocab_size 50257 padded to the next "
                   "multiple of tensor_parallel 32"),
    "tensor_parallel": (f"derived: {_GPT3_YML} release.gpt3_175B_pod256 has 2-D TP "
                        "tensor_parallel_1 = tensor_parallel_2 = 8 (64 IPUs a replica); "
                        "1-D TP here, 64 does not divide 96 heads: 32"),
    "data_parallel": (f"derived: {_GPT3_YML} data_parallel 4 x 64 IPUs = 256 IPUs; "
                      "with 32 IPUs a replica, 8 replicas fill the same POD256"),
    "phased": f"{_GPT3_README} 'Phased Execution and RTS'",
    "rts": f"{_GPT3_README} 'Phased Execution and RTS'",
    "system": f"{_GPT3_README} 'Min. 256 IPUs (POD256) required'",
    "available_memory_proportion": (f"{_GPT3_YML} release.gpt3_175B_pod256.execution."
                                    "available_memory_proportion"),
}
_LLAMA_SOURCES = {
    "layers": f"{_LLAMA_YML} llama2_7b.model.layers",
    "hidden": f"{_LLAMA_YML} llama2_7b.model.hidden_size",
    "ffn": f"{_LLAMA_YML} llama2_7b.model.intermediate_size",
    "heads": f"{_LLAMA_YML} llama2_7b.model.attention.heads",
    "vocab_size": f"{_LLAMA_YML} llama2_7b.model.embedding.vocab_size",
    "seq": f"{_LLAMA_YML} llama2_7b.model.sequence_length",
    "micro_batch": f"{_LLAMA_YML} release.llama2_7b_pod*.execution.micro_batch_size",
    "tensor_parallel": f"{_LLAMA_YML} release.llama2_7b_pod*.execution.tensor_parallel",
    "rotary_dim": "Llama-2: rotary over the whole head (hidden / heads = 128)",
    "phased": f"{_LLAMA_PY} module docstring (one transformer block loaded at a time)",
    "remote_weights": f"{_LLAMA_PY} named_variable_buffers(..., shard_over_dict=False)",
    "kv_cache": f"{_LLAMA_PY} prepare_cache / use_cache (past_k, past_v remote buffers)",
    "available_memory_proportion": (f"{_LLAMA_YML} release.llama2_7b_pod*.execution."
                                    "available_memory_proportion (0.1 pod2, 0.4 pod4 / pod16)"),
}
SOURCES = {
    "gptj_6b_finetune_pod16": dict(_GPTJ_SOURCES, system=f"{_GPTJ_YML} gptj_6B_1024_pod16"),
    "gptj_6b_finetune_pod64": dict(_GPTJ_SOURCES, system=f"{_GPTJ_YML} gptj_6B_1024_pod64"),
    "gpt3_175b_pretrain_pod256": _GPT3_SOURCES,
    "llama2_7b_inference_pod2": dict(
        _LLAMA_SOURCES, system=(f"derived: {_LLAMA_YML} llama2_7b_pod2 on 2 IPUs; no 2-IPU "
                                "system preset, so an IPU-M2000 (pod4)")),
    "llama2_7b_inference_pod4": dict(_LLAMA_SOURCES, system=f"{_LLAMA_YML} llama2_7b_pod4"),
    "llama2_7b_inference_pod16": dict(_LLAMA_SOURCES, system=f"{_LLAMA_YML} llama2_7b_pod16"),
    "tiny_check": {"layers": "issue 39 acceptance: a small GPT (4 layers, width 128)"},
}

# Published measurements to read beside the estimates.
PUBLISHED = {
    "gptj_6b_finetune_pod16": {
        "tokens_per_second": 128 * 1024 / 21.0,
        "source": (f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/gpt_j/popxl/finetuning.ipynb "
                   "'each step takes around 20-22 seconds' (gptj_6B_1024_pod16, global batch "
                   "128 x 1,024 tokens; 21 s taken)")},
    "llama2_7b_inference_pod16": {
        "tokens_per_second": 7.0,
        "source": (f"graphcore/examples@{EXAMPLES_COMMIT[:12]}:nlp/llama/popxl/"
                   "llama2-inference.ipynb saved output 'Total throughput: 7.00 t/s' "
                   "(llama2_7b_pod16, micro-batch 2, sequence 1,024, tokens printed live)")},
}


def preset_values(name: str) -> dict:
  """The flag values of preset ``name``, with its gradient accumulation.

  Raises:
    KeyError: an unknown preset.
  """
  return dict(PRESETS[name])
