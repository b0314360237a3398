"""Presets of ``experiments.gpt2_training`` mirroring Graphcore's GPT-2 examples.

Every preset is one training entry of ``nlp/gpt2/pytorch/benchmarks.yml`` in
``github.com/graphcore/examples`` (read at commit ``3cc8f81f``), the PopTorch
example Graphcore benchmarked GPT-2 with: ``pytorch_gpt2_<size>_train_gen_<system>``
(``_sl512_`` for GPT-2 large at 512 positions). Each entry's own values are
``--ipus-per-replica`` (the length of ``layers_per_ipu``),
``--replication-factor`` (``replicas``), ``--gradient-accumulation``,
``--device-iterations`` (``updates_per_execution``), ``--batch-size``
(``micro_batch``: 1 in all), ``--layers-per-ipu``, ``--matmul-proportion``,
``--max-len`` (``seq``), ``--embedding-serialization-factor`` and
``--replicated-tensor-sharding``.

What every entry shares, from the entry and the example's code:
``--enable-sequence-serialized`` with ``--serialized-seq-len`` 128
(``arguments.py``'s default: ``loss_serialization``),
``--recompute-checkpoint-every-layer`` (recomputation, a checkpoint per
block), ``--enable-half-partials`` (float16 partials), the model in float16
(``GPT2Wrapper(...).half()``), stochastic rounding, the optimizer state off
chip (``--optimizer-state-offchip``' default True), AdamW without bias
correction, its first moment in float16 and second in float32
(``tools.get_optimizer``: ``enable_half_first_order_momentum`` True,
``second_order_momentum_accum_type=float32``), dropout 0.1 on the
embeddings, attention probabilities and residual branches (the
``config/*.json`` files' ``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``),
drawn from the tiles' generators as poprand draws them.

The systems: the entries name IPU-POD16 and POD64 (Mk2, ``pod16``,
``pod64``); ``--system bow-pod16`` asks the same configuration of a Bow Pod.
No throughput measured with these entries was found published
(docs/published_tables.md#gpt-2-configurations-no-measurement-obtained), so
the estimates stand alone.
"""

from __future__ import annotations

__all__ = ["PRESETS"]

_SHARED = {"micro_batch": 1, "dtype": "float16", "partials_type": "float16",
           "tiles_per_ipu": 1472, "loss_serialization": 128, "recomputation": True,
           "offload_optimizer_state": True, "dropout": 0.1, "attention_dropout": 0.1,
           "random_mode": "hardware", "adam_m_dtype": "float16", "adam_v_dtype": "float32",
           "adam_bias_correction": False, "updates_per_execution": 8}

_SMALL = {**_SHARED, "model": "small", "seq": 1024, "layers_per_ipu": [0, 4, 4, 4],
          "matmul_proportion": [0.15, 0.15, 0.15, 0.15], "embedding_serialization": 4,
          "replicated_tensor_sharding": True}
_MEDIUM = {**_SHARED, "model": "medium", "seq": 1024,
           "layers_per_ipu": [0, 3, 3, 3, 3, 4, 4, 4],
           "matmul_proportion": [0.30, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15],
           "embedding_serialization": 4, "replicated_tensor_sharding": True}
_LARGE_512 = {**_SHARED, "model": "large", "seq": 512,
              "layers_per_ipu": [1, 5, 5, 5, 5, 5, 5, 5],
              "matmul_proportion": [0.15, 0.12, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15],
              "embedding_serialization": 8, "replicated_tensor_sharding": True}

# G: the entry's --gradient-accumulation moved to the nearest multiple of
# 2 x stages, which the Grouped schedule asks (TF-IPU's rule, which Pipeline
# checks; PopTorch's pipeline does not), as the BERT presets do: small's 5
# stages 2,048 -> 2,050 and 512 -> 510; medium's 9 stages 4,096 -> 4,104 and
# 1,024 -> 1,026; large at 512's 11 stages ([1, 5, ...] puts block 0 on IPU 0
# between the positions and block 1: wte, wpe, block 0, ...) 4,096 -> 4,092
# and 1,024 -> 1,034; large at 1,024's 17 stages 8,192 -> 8,194.
PRESETS = {
    "small_pod16": {**_SMALL, "system": "pod16", "replicas": 4, "accumulation": 2050},
    "small_pod64": {**_SMALL, "system": "pod64", "replicas": 16, "accumulation": 510},
    "medium_pod16": {**_MEDIUM, "system": "pod16", "replicas": 2, "accumulation": 4104},
    "medium_pod64": {**_MEDIUM, "system": "pod64", "replicas": 8, "accumulation": 1026},
    "large_sl512_pod16": {**_LARGE_512, "system": "pod16", "replicas": 2,
                          "accumulation": 4092},
    "large_sl512_pod64": {**_LARGE_512, "system": "pod64", "replicas": 8,
                          "accumulation": 1034},
    # GPT-2 large at 1,024 positions: one replica over all 16 IPUs.
    "large_pod16": {**_SHARED, "model": "large", "seq": 1024, "system": "pod16",
                    "replicas": 1, "accumulation": 8194,
                    "layers_per_ipu": [0, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 2],
                    "matmul_proportion": [0.15, 0.15, 0.2, 0.2, 0.2, 0.15, 0.15, 0.2, 0.2,
                                          0.15, 0.15, 0.2, 0.2, 0.15, 0.15, 0.2],
                    "embedding_serialization": 4, "replicated_tensor_sharding": False},
}
