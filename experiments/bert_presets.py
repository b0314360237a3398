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
as the examples train (``--dtype float32`` to override), with half partials
as both examples set them (``--partials_type float32`` to override); LAMB's
moments m and v float32 as the PyTorch example keeps them
(``optimization.py``: ``first_order_momentum_accum_type`` float32 unless
``enable_half_first_order_momentum``, ``second_order_momentum_accum_type``
float32), bias-corrected for BERT-Large (``optimizer: LAMB``) and not for
BERT-Base (``pretrain_base_128``'s ``LAMBNoBiasCorrection``).

Three presets mirror the TensorFlow 2 example
(``nlp/bert/tensorflow2/configs/pretrain_large_128_phase1.json``,
``pretrain_large_128_phase1_POD64.json``, ``pretrain_base_128_phase1.json``,
with the defaults of ``utilities/options.py``), whose throughput Graphcore's
performance-results tables give (docs/published_tables.md): ``tf2_phase1_pod16``,
``tf2_phase1_pod64`` and ``tf2_base_phase1_pod16``. Against the PyTorch
presets they take the configs' own proportions, replicated tensor sharding
(off on POD16, on on POD64), vocabulary 30,400, serialisation (5 on the
POD64 config, else ``options.py``'s 2) and the ``LAMBIpuOptimizer`` the
example builds (``keras_extensions/optimization.py``: m and v float32,
``debiasing`` at its default, on).

Two presets mirror the MLPerf Training v1.0 closed BERT runs whose throughput
Graphcore measured (docs/published_bert.md; ``mlperf_v1_pod16``,
``mlperf_v1_pod64``): sequence 512 packed with 2 sequences a pack on average
(``packing_factor`` 2), micro-batch 2 packs, 76 masked positions, the
vocabulary padded to 30,400 and serialised in 5 steps, half partials
(``enable_half_partials``), LAMB with replicated tensor sharding. POD16: 4 replicas x 4 IPUs, ``[3, 7, 7, 7]``, proportions
``[0.20, 0.20, 0.25, 0.25]``, state offloaded, G 192 -> 190 (the multiple of
10 nearest). POD64: 8 replicas x 8 IPUs, the embeddings alone on IPU 0
(``encoder_start_ipu: 1``) and ``[3, 3, 3, 3, 4, 4, 4]`` after it, proportion
1.0 on every IPU, state on chip, G 96 -> 90 (9 stages on 8 IPUs: a multiple
of 18).

Seven presets mirror the MLPerf Training v1.1 and v2.0 closed BERT runs
(``configs/mk2/pod{16,64,128}-closed.json`` of
``github.com/mlcommons/training_results_v1.1`` and
``configs/pod{16,64,128,256}-closed.json`` of ``_v2.0``, folder
``Graphcore/benchmarks/bert/implementations/popart/``; docs/published_bert.md).
Those runs place each layer's attention and feed-forward blocks separately
(``att_ffn_placement``, ``encoder_start_pipeline_stage: 1``): stage 0 holds the
embeddings alone on IPU 0, then each ``[ipu, [a, f]]`` is a stage of the next
``a`` attention and ``f`` feed-forward blocks, the last one back on IPU 0 with
the heads (``experiments.bert.placement_layout``); the presets give the runs'
placement as is. What they share: sequence 512 packed (2 sequences a pack),
76 masked positions, the vocabulary padded to 30,912 and serialised in 4
steps (``embedding_serialization_vocab_steps: 4``; here the tied decoder's
projection), half partials (``enable_half_partials``), LAMB with replicated
tensor sharding, float16. LAMB's moments take the dtypes each run gave
PopART's ``Adam`` (``--lamb_m_dtype`` m / accl1, ``--lamb_v_dtype`` v /
accl2): v1.1 set only m, FLOAT16 where a config says ``lamb_m_dtype:
FLOAT16`` (POD16, POD128) and FLOAT otherwise (POD64: ``bert_model.py``'s
default), v left at PopART's default FLOAT; v2.0 set both to FLOAT16
(``lamb_accl_dtype``); v1.0 set neither (m and v float32). Every run's
LAMB was PopART's ``LambNoBias``, without Adam's bias correction
(``optimizer: LAMB_NO_BIAS``; ``--nolamb_bias_correction``). The gradient accumulator (PopART's ``accum_type``) no
run set: PopART's default is the weight's dtype, float16, as here. G is the
Grouped schedule's nearest multiple of ``2 x stages`` to the run's (the
schedule TF-IPU checks; PopART's pipeline does not ask it): 5 stages on a
v1.1 POD16 (192 -> 190), 9 on every other (96 -> 90, 256 -> 252, 64 -> 72,
36 as run).

Every MLPerf run was PopART's with ``autoRecomputation =
RecomputationType::Pipeline`` (v1.1 ``bert.py:444-446``, v2.0
``bert.py:453-454``), which recomputes the last stage too, between the
checkpoints the model marks there (``Pipeline::setFinalFwdStageRecomputation``
in PopART's ``willow/src/transforms/pipeline.cpp``): the presets set
``last_stage_recomputation: "checkpoints"``, and v1.1's and v2.0's
``checkpoint_blocks`` marks what their ``bert_model.py`` marks
(``should_checkpoint_att``: each attention output of the last stage;
``projection()``: the masked rows, the vocabulary projection, the biased
logits; docs/multi_ipu.md#the-last-stage). v1.0's code was not read for
its marks: its presets' heads stage has none, so it is not recomputed.

What they do not reproduce (each preset's comment says which apply): v2.0
POD16's FLOAT8 activation checkpoints (``activation_checkpoint_dtype``: each
checkpoint off the last stage cast to a 1.3.4 float and back, float16 here), v2.0's ``merge_collectives`` (one
merged all-reduce; here one collective per weight, inside the update),
and stochastic rounding. v1.0 / v1.1 POD16's ``split_qkv`` split only the
weight variables: ``bert_model.py``'s ``qkv_weights`` concatenates the three
into the one ``[H, 3H]`` operand of one product, the product here. The runs' dropout is on, as they ran it: 0.1 of the hidden values
everywhere, of the attention probabilities too in v2.0, from the tiles'
generators (``random_mode`` "hardware").

``--model base`` on a BERT-Large preset takes ``pretrain_base_128``'s layout
(the embeddings alone on IPU 0, ``layers_per_ipu [0, 4, 4, 4]``, proportion
0.25), its LAMB without bias correction (``LAMBNoBiasCorrection``) and, in
phase 1, its micro-batch 32 and G 512 (510 here).
"""

from __future__ import annotations

__all__ = ["PRESETS", "BASE_OVERRIDES", "preset_values"]

# Half partials: both public BERT examples set them (TensorFlow 2:
# utilities/options.py matmul_partials_type "half"; PyTorch:
# enable_half_partials True); float32 partials run the AMP at half the rate.
# Every measured run dropped out 0.1 of the embeddings', attention outputs'
# and FFN outputs' values (PopART's bert_model.py dropout_prob 0.1 with
# no_dropout false in every MLPerf config; hidden_dropout_prob 0.1 in the
# TensorFlow 2 configs and HF's default under the PyTorch example), drawn from
# the tiles' generators as poprand draws them (random_mode "hardware").
_LARGE = {"layers_per_ipu": [3, 7, 7, 7], "model": "large", "tiles_per_ipu": 1472,
          "dtype": "float16", "decoder_serialization": 2, "schedule": "Grouped",
          "recomputation": True, "offload_optimizer_state": True,
          "replicated_tensor_sharding": True, "partials_type": "float16",
          "dropout": 0.1, "random_mode": "hardware"}

# What Graphcore's MLPerf v1.0 BERT runs share: packed sequences of 512 (2 a
# pack on average), micro-batch 2 packs, 76 masked positions, the vocabulary
# padded to 30,400 and serialised in 5 steps, half partials (the runs'
# enable_half_partials: true; float32 partials run the AMP at half rate).
# PopART's RecomputationType::Pipeline recomputes the last stage between its
# checkpoints (last_stage_recomputation "checkpoints"); v1.0's heads stage
# holds no mark here, so it is not recomputed either way.
# Every MLPerf BERT run (v1.0, v1.1, v2.0) chose optimizer LAMB_NO_BIAS
# (configs/*-closed.json), PopART's AdamMode.LambNoBias: no bias correction
# (v1.0 bert_optimizer.py:141-147, v1.1 :148-161, v2.0 :151-167). v1.0
# passes accl1_type FLOAT unless lamb_m_dtype is FLOAT16 (bert_optimizer.py:
# 141-147, bert_model.py:123's default FLOAT), which neither config sets, and
# no accl2_type (PopART's default FLOAT): m and v float32.
_MLPERF_V1 = dict(_LARGE, seq=512, micro_batch=2, max_predictions=76, packing_factor=2.0,
                  vocab_size=30400, decoder_serialization=5, partials_type="float16",
                  last_stage_recomputation="checkpoints", lamb_bias_correction=False,
                  lamb_m_dtype="float32", lamb_v_dtype="float32")

# The PyTorch example's LAMB (nlp/bert/pytorch/optimization.py:54,69-79):
# poptorch.optim.LAMB with first_order_momentum_accum_type float32 (the
# configs leave enable_half_first_order_momentum False, configs_pretraining.yml
# defaults) and second_order_momentum_accum_type float32; bias_correction as
# optimizer: LAMB (pretrain_large_128, inherited by pretrain_large_512).
# Serialisation: embedding_serialization_factor 2 (pretrain_large_128) splits
# both the word-embedding lookup (modeling.py SerializedEmbedding) and the
# tied decoder; the runner's --decoder_serialization 2 is the decoder's, and
# the lookup's split (BertConfig.embedding_serialization) has no runner flag.
_PYTORCH_LARGE = dict(_LARGE, lamb_m_dtype="float32", lamb_v_dtype="float32")

PRESETS = {
    "phase1_pod16": dict(_PYTORCH_LARGE, seq=128, micro_batch=8, replicas=4, accumulation=2040,
                         matmul_proportion=[0.15, 0.25, 0.25, 0.25], system="pod16",
                         max_predictions=20),
    "phase1_pod64": dict(_PYTORCH_LARGE, seq=128, micro_batch=8, replicas=16, accumulation=510,
                         matmul_proportion=[0.14, 0.19, 0.19, 0.19], system="pod64",
                         max_predictions=20),
    "phase2_pod16": dict(_PYTORCH_LARGE, seq=512, micro_batch=2, replicas=4, accumulation=2040,
                         matmul_proportion=[0.10, 0.15, 0.15, 0.15], system="pod16",
                         max_predictions=76),
    "phase2_pod64": dict(_PYTORCH_LARGE, seq=512, micro_batch=2, replicas=16, accumulation=510,
                         matmul_proportion=[0.13, 0.19, 0.19, 0.19], system="pod64",
                         max_predictions=76),
    # MLPerf Training v1.0 closed (configs/mk2/pod16-closed.json, pod64-closed.json).
    "mlperf_v1_pod16": dict(_MLPERF_V1, replicas=4, accumulation=190,
                            matmul_proportion=[0.20, 0.20, 0.25, 0.25], system="pod16"),
    "mlperf_v1_pod64": dict(_MLPERF_V1, replicas=8, accumulation=90,
                            layers_per_ipu=[0, 3, 3, 3, 3, 4, 4, 4], matmul_proportion=[1.0] * 8,
                            system="pod64", offload_optimizer_state=False),
}

# What Graphcore's MLPerf v1.1 / v2.0 BERT runs share: packed sequences of
# 512, 76 masked positions, the vocabulary padded to 30,912 and serialised in
# 4 steps, half partials, layers placed as att_ffn_placement, the last stage
# recomputed between the checkpoints bert_model.py marks there (each
# attention output, each layer's output, the MLM projection's three).
# LAMB's moments (PopART's popart.Adam accl1_type / accl2_type): v1.1's
# bert_optimizer.py:149-161 passes accl1_type alone, FLOAT16 when
# lamb_m_dtype is "FLOAT16" and FLOAT otherwise (bert_model.py:118's
# default), so accl2 keeps PopART's default FLOAT (graphcore/popart
# python/popart/popart_core/popart.cpp:938-942, "Momentums in FP32 by
# default"; bert_tf_loader.py:122-135: "accl2 is always in FP32"). Each
# v1.1 preset sets m as its config did.
_MLPERF_V1_1 = dict(_LARGE, seq=512, micro_batch=2, max_predictions=76, packing_factor=2.0,
                    vocab_size=30912, decoder_serialization=4, partials_type="float16",
                    last_stage_recomputation="checkpoints", checkpoint_blocks=True,
                    lamb_m_dtype="float32", lamb_v_dtype="float32", lamb_bias_correction=False)
# v2.0 also dropped out the attention probabilities (no_attn_dropout: false in
# its four configs; attn_dropout_prob 0.1, bert_model.py); v1.0 / v1.1 set
# no_attn_dropout: true, the examples attention_probs_dropout_prob 0.0.
# Its four configs set lamb_accl_dtype: FLOAT16 (configs/pod{16,64,128,256}-
# closed.json:19), which bert_optimizer.py:151-166 passes as both accl1_type
# and accl2_type: LAMB's m and v float16.
_MLPERF_V2 = dict(_MLPERF_V1_1, micro_batch=3, offload_optimizer_state=False,
                  attention_dropout=0.1, lamb_m_dtype="float16", lamb_v_dtype="float16")
# v1.1 POD64 / POD128 and v2.0 POD64 / POD128 / POD256: 8 IPUs a replica.
_V1_1_POD64_PLACEMENT = [[1, [2, 2]], [2, [3, 3]], [3, [4, 3]], [4, [3, 4]], [5, [4, 3]],
                         [6, [3, 4]], [7, [4, 3]], [0, [1, 2]]]
_V2_POD64_PLACEMENT = [[1, [3, 3]], [2, [3, 3]], [3, [3, 3]], [4, [4, 3]], [5, [3, 4]],
                       [6, [4, 3]], [7, [3, 4]], [0, [1, 1]]]

PRESETS.update({
    # v1.1 closed, IPU-POD16 (configs/mk2/pod16-closed.json): 4 x 4 IPUs,
    # 5 stages, G 192 -> 190, LAMB's m float16 (lamb_m_dtype: FLOAT16, line
    # 19), v float32.
    "mlperf_v1_1_pod16": dict(_MLPERF_V1_1, replicas=4, accumulation=190, system="pod16",
                              lamb_m_dtype="float16",
                              att_ffn_placement=[[1, [7, 6]], [2, [6, 7]], [3, [7, 6]],
                                                 [0, [4, 5]]],
                              matmul_proportion=[0.23] * 4),
    # v1.1 closed, IPU-POD64 (pod64-closed.json): 8 x 8 IPUs, 9 stages,
    # G 96 -> 90, LAMB state on chip, m and v float32 (the config sets no
    # lamb_m_dtype: bert_model.py:118's "FLOAT").
    "mlperf_v1_1_pod64": dict(_MLPERF_V1_1, replicas=8, accumulation=90, system="pod64",
                              att_ffn_placement=_V1_1_POD64_PLACEMENT,
                              matmul_proportion=[0.20] + [0.25] * 7,
                              offload_optimizer_state=False),
    # v1.1 closed, IPU-POD128 (pod128-closed.json, 2 hosts): as POD64 on 16
    # replicas, but LAMB's m float16 (lamb_m_dtype: FLOAT16, line 19).
    "mlperf_v1_1_pod128": dict(_MLPERF_V1_1, replicas=16, accumulation=90, system="pod128",
                               lamb_m_dtype="float16",
                               att_ffn_placement=_V1_1_POD64_PLACEMENT,
                               matmul_proportion=[0.20] + [0.25] * 7,
                               offload_optimizer_state=False),
    # v2.0 closed, Bow Pod16 (configs/pod16-closed.json): 2 x 8 Bow IPUs,
    # micro-batch 3, G 256 -> 252. Not modelled: FLOAT8 activation
    # checkpoints, merge_collectives.
    "mlperf_v2_bow_pod16": dict(_MLPERF_V2, replicas=2, accumulation=252, system="bow-pod16",
                                att_ffn_placement=[[1, [3, 3]], [2, [4, 3]], [3, [3, 3]],
                                                   [4, [3, 4]], [5, [4, 3]], [6, [3, 4]],
                                                   [7, [4, 3]], [0, [0, 1]]],
                                matmul_proportion=[0.3] * 8),
    # v2.0 closed, Bow-Pod64 / 128 / 256 (pod64/128/256-closed.json): 8, 16,
    # 32 replicas of 8 Bow IPUs, G 96 -> 90, 64 -> 72, 36. Not modelled:
    # merge_collectives.
    "mlperf_v2_bow_pod64": dict(_MLPERF_V2, replicas=8, accumulation=90, system="bow-pod64",
                                att_ffn_placement=_V2_POD64_PLACEMENT,
                                matmul_proportion=[1.0] * 8),
    "mlperf_v2_bow_pod128": dict(_MLPERF_V2, replicas=16, accumulation=72,
                                 system="bow-pod128", att_ffn_placement=_V2_POD64_PLACEMENT,
                                 matmul_proportion=[1.0] * 8),
    "mlperf_v2_bow_pod256": dict(_MLPERF_V2, replicas=32, accumulation=36,
                                 system="bow-pod256", att_ffn_placement=_V2_POD64_PLACEMENT,
                                 matmul_proportion=[1.0] * 8),
})

# Graphcore's TensorFlow 2 BERT example (graphcore/examples
# nlp/bert/tensorflow2, commit 3cc8f81f), the configuration of the
# performance-results tables' TensorFlow2 rows (docs/published_tables.md).
# What every config inherits (utilities/options.py SharedOptions):
# optimizer_state_offchip True (run_pretraining.py passes it as
# offload_weight_update_variables), matmul_partials_type "half",
# embedding_serialization_factor 2 (the word-embedding lookup and the tied MLM
# projection, convert_bert_model.py / ipu_lm_prediction_head.py's
# serialized_matmul; the runner serialises the projection,
# --decoder_serialization, and has no flag for the lookup's split),
# enable_recomputation True. run_pretraining.py: the Grouped schedule,
# RecomputeAndBackpropagateInterleaved (the last stage not recomputed:
# last_stage_recomputation "none"), the proportions per IPU
# (ipu_utils.get_poplar_options_per_pipeline_stage indexes them by the
# stage's device). keras_extensions/optimization.py: ipu_tensorflow_addons'
# LAMBIpuOptimizer with m_dtype and v_dtype float32 and debiasing left at its
# default True (bias-corrected). The configs' bert_config: vocab_size 30400,
# hidden_dropout_prob 0.1, attention_probs_dropout_prob 0.0.
# Not expressible here: optimizer_compute_precisions (float32, float16) (the
# update's ratio applied in float16; here LAMB computes in each moment's
# dtype), enable_stochastic_rounding True, min_remote_tensor_size 50000 (only
# variables of 50,000 bytes or more offloaded; here all the state), the
# static loss scaling (32768 Large, 4096 Base).
_TF2 = dict(_LARGE, seq=128, max_predictions=20, vocab_size=30400, decoder_serialization=2,
            offload_optimizer_state=True, partials_type="float16", lamb_m_dtype="float32",
            lamb_v_dtype="float32", lamb_bias_correction=True,
            last_stage_recomputation="none")

PRESETS.update({
    # configs/pretrain_large_128_phase1.json: micro_batch_size 8, replicas 4,
    # grad_acc_steps_per_replica 2040, stages [emb + 3, 7, 7, 7, heads] on
    # pipeline_device_mapping [0, 1, 2, 3, 0],
    # matmul_available_memory_proportion_per_pipeline_stage
    # [0.10, 0.19, 0.20, 0.25], replicated_tensor_sharding false.
    "tf2_phase1_pod16": dict(_TF2, micro_batch=8, replicas=4, accumulation=2040,
                             layers_per_ipu=[3, 7, 7, 7],
                             matmul_proportion=[0.10, 0.19, 0.20, 0.25],
                             replicated_tensor_sharding=False, system="bow-pod16"),
    # configs/pretrain_large_128_phase1_POD64.json: replicas 16,
    # grad_acc_steps_per_replica 1020, proportions [0.1, 0.19, 0.2, 0.2],
    # replicated_tensor_sharding true, embedding_serialization_factor 5
    # (30,400 / 5 = 6,080 a piece).
    "tf2_phase1_pod64": dict(_TF2, micro_batch=8, replicas=16, accumulation=1020,
                             layers_per_ipu=[3, 7, 7, 7],
                             matmul_proportion=[0.10, 0.19, 0.20, 0.20],
                             replicated_tensor_sharding=True, decoder_serialization=5,
                             system="bow-pod64"),
    # configs/pretrain_base_128_phase1.json: BERT-Base, micro_batch_size 32,
    # replicas 4, grad_acc_steps_per_replica 510, stages [emb], [4 x hid] x 3,
    # [heads] on [0, 1, 2, 3, 0], proportions [0.28, 0.26, 0.28, 0.28],
    # replicated_tensor_sharding false.
    "tf2_base_phase1_pod16": dict(_TF2, model="base", micro_batch=32, replicas=4,
                                  accumulation=510, layers_per_ipu=[0, 4, 4, 4],
                                  matmul_proportion=[0.28, 0.26, 0.28, 0.28],
                                  replicated_tensor_sharding=False, system="bow-pod16"),
})

# pretrain_base_128: embeddings alone on IPU 0, 4 layers on each other IPU,
# optimizer LAMBNoBiasCorrection (poptorch LAMB, bias_correction False;
# pretrain_base_512 inherits it).
BASE_OVERRIDES = {"layers_per_ipu": [0, 4, 4, 4], "matmul_proportion": [0.25] * 4,
                  "lamb_bias_correction": False}
_BASE_PHASE1 = {"micro_batch": 32, "accumulation": 510}


def preset_values(name: str, model: str | None) -> dict:
  """The flag values of preset ``name`` for ``model`` ('large', 'base'; None: the preset's).

  ``model`` 'base' on a BERT-Large preset takes the PyTorch example's
  BERT-Base layout (:data:`BASE_OVERRIDES`); a preset of BERT-Base's own
  (``tf2_base_phase1_pod16``) keeps its values.
  """
  values = dict(PRESETS[name])
  if model == "base" and values["model"] != "base":
    values.update(BASE_OVERRIDES, model="base")
    if name.startswith("phase1"):
      values.update(_BASE_PHASE1)
  return values
