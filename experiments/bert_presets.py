"""Presets of ``experiments.bert_pretraining`` mirroring Graphcore's BERT examples.

The values are those of ``graphcore/examples`` ``nlp/bert/pytorch/configs_pretraining.yml``
(``pretrain_large_128``, ``pretrain_large_128_POD64``, ``pretrain_large_512``,
``pretrain_large_512_POD64``, ``pretrain_base_128``; docs/published_bert.md),
with one change: the examples' G (2,048 on POD16, 512 on POD64) is not a
multiple of ``2 x stages = 10`` that the Grouped schedule over BERT's five
stages on four IPUs asks (TF-IPU's rule, which ``Pipeline`` checks), so the
presets take the largest multiple of 10 below it -- 2,040 on POD16, which is
what the TensorFlow 2 example uses (``grad_acc_steps_per_replica: 2040``),
and 510 on POD64. Masked positions: 20 a sequence at 128 tokens and 76 at
512 (the examples' ``mask_tokens``). Weights and activations are float16,
as the examples train (``--dtype float32`` to override); LAMB's state takes
the weights' dtype here.

Two presets mirror the MLPerf Training v1.0 closed BERT runs whose throughput
Graphcore measured (docs/published_bert.md; ``mlperf_v1_pod16``,
``mlperf_v1_pod64``): sequence 512 packed with 2 sequences a pack on average
(``packing_factor`` 2), micro-batch 2 packs, 76 masked positions, the
vocabulary padded to 30,400 and serialised in 5 steps, LAMB with replicated
tensor sharding. POD16: 4 replicas x 4 IPUs, ``[3, 7, 7, 7]``, proportions
``[0.20, 0.20, 0.25, 0.25]``, state offloaded, G 192 -> 190 (the multiple of
10 nearest). POD64: 8 replicas x 8 IPUs, the embeddings alone on IPU 0
(``encoder_start_ipu: 1``) and ``[3, 3, 3, 3, 4, 4, 4]`` after it, proportion
1.0 on every IPU, state on chip, G 96 -> 90 (9 stages on 8 IPUs: a multiple
of 18).

``--model base`` takes ``pretrain_base_128``'s layout (the embeddings alone
on IPU 0, ``layers_per_ipu [0, 4, 4, 4]``, proportion 0.25) and, in phase 1,
its micro-batch 32 and G 512 (510 here).
"""

from __future__ import annotations

__all__ = ["PRESETS", "BASE_OVERRIDES", "preset_values"]

_LARGE = {"layers_per_ipu": [3, 7, 7, 7], "model": "large", "tiles_per_ipu": 1472,
          "dtype": "float16", "decoder_serialization": 2, "schedule": "Grouped",
          "recomputation": True, "offload_optimizer_state": True,
          "replicated_tensor_sharding": True}

# What Graphcore's MLPerf v1.0 BERT runs share: packed sequences of 512 (2 a
# pack on average), micro-batch 2 packs, 76 masked positions, the vocabulary
# padded to 30,400 and serialised in 5 steps.
_MLPERF_V1 = dict(_LARGE, seq=512, micro_batch=2, max_predictions=76, packing_factor=2.0,
                  vocab_size=30400, decoder_serialization=5)

PRESETS = {
    "phase1_pod16": dict(_LARGE, seq=128, micro_batch=8, replicas=4, accumulation=2040,
                         matmul_proportion=[0.15, 0.25, 0.25, 0.25], system="pod16",
                         max_predictions=20),
    "phase1_pod64": dict(_LARGE, seq=128, micro_batch=8, replicas=16, accumulation=510,
                         matmul_proportion=[0.14, 0.19, 0.19, 0.19], system="pod64",
                         max_predictions=20),
    "phase2_pod16": dict(_LARGE, seq=512, micro_batch=2, replicas=4, accumulation=2040,
                         matmul_proportion=[0.10, 0.15, 0.15, 0.15], system="pod16",
                         max_predictions=76),
    "phase2_pod64": dict(_LARGE, seq=512, micro_batch=2, replicas=16, accumulation=510,
                         matmul_proportion=[0.13, 0.19, 0.19, 0.19], system="pod64",
                         max_predictions=76),
    # MLPerf Training v1.0 closed (configs/mk2/pod16-closed.json, pod64-closed.json).
    "mlperf_v1_pod16": dict(_MLPERF_V1, replicas=4, accumulation=190,
                            matmul_proportion=[0.20, 0.20, 0.25, 0.25], system="pod16"),
    "mlperf_v1_pod64": dict(_MLPERF_V1, replicas=8, accumulation=90,
                            layers_per_ipu=[0, 3, 3, 3, 3, 4, 4, 4], matmul_proportion=[1.0] * 8,
                            system="pod64", offload_optimizer_state=False),
}

# pretrain_base_128: embeddings alone on IPU 0, 4 layers on each other IPU.
BASE_OVERRIDES = {"layers_per_ipu": [0, 4, 4, 4], "matmul_proportion": [0.25] * 4}
_BASE_PHASE1 = {"micro_batch": 32, "accumulation": 510}


def preset_values(name: str, model: str | None) -> dict:
  """The flag values of preset ``name`` for ``model`` ('large', 'base'; None: large)."""
  values = dict(PRESETS[name])
  if model == "base":
    values.update(BASE_OVERRIDES, model="base")
    if name.startswith("phase1"):
      values.update(_BASE_PHASE1)
  return values
