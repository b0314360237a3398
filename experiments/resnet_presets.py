"""Presets of ``experiments.resnet_training`` mirroring Graphcore's ResNet-50 runs.

Every preset is one of Graphcore's MLPerf Training ResNet-50 (closed)
submissions, as its ``run_and_time.sh`` ran it: TensorFlow 1 (Poplar SDK
2.1.0 in v1.0, 2.3.0 in v1.1, 2.5.1 in v2.0), the config named beside each
preset from ``Graphcore/benchmarks/resnet/implementations/tensorflow/
configs.yml`` of ``github.com/mlcommons/training_results_v1.0`` (commit
``50619b5d``), ``_v1.1`` (``ebe92f81``) and ``_v2.0`` (``8437fbb7``); the
logged ``global_batch_size`` and ``gradient_accumulation_steps`` of
``Graphcore/results/<system>/resnet/result_*.txt`` agree with micro-batch x
G x replicas. docs/published_resnet.md holds the measurements.

What the runs share (``mk2_resnet50_mlperf_pod16`` and its ``_lars``
children): one IPU per replica (``shards: 1``), the model cut into 7
"pipeline stages" all on that IPU (``pipeline: True``, ``pipeline_splits``
after ``b1/0``, ``b1/2``, ``b2/0``, ``b2/2``, ``b3/0``, ``b3/3`` -- ``b<stage>/<unit
from 0>`` in ``Models/resnet_base.py``, i.e. after units 1 and 3 of stages 1
and 2, and units 1 and 4 of stage 3, v2.0's ``stage1/unit1`` ...), the
``Sequential`` schedule with recomputation (each stage's forward runs again
in its backward: checkpoints at the splits), ``available_memory_proportion``
0.15 (0.14 for v1.0's POD64) for the convolutions, precision ``16.16``
(float16 weights and activations, the train.py default), half partials
(``enable_half_partials``), 8-bit image I/O, batch norm. Optimiser: momentum
SGD (0.9) in v1.0, LARS in v1.1 and v2.0.
Images 224 x 224 (``standard_imagenet``).

Not modelled: ``BN_span: 2`` (statistics over pairs of replicas; here each
replica's own) and the examples' fused preprocessing on the IPU.
"""

from __future__ import annotations

__all__ = ["PRESETS", "SPLITS"]

# The 7-stage cut of every MLPerf run (v1.0 / v1.1 names b1/0/relu ...,
# v2.0 stage1/unit1/relu ...; b<s>/<u> is unit u+1 of stage s+1).
SPLITS = ["stage1/unit1/relu", "stage1/unit3/relu", "stage2/unit1/relu",
          "stage2/unit3/relu", "stage3/unit1/relu", "stage3/unit4/relu"]

# ``available_memory_proportion`` goes to the convolutions only and
# ``enable_half_partials`` to convolutions and matmuls, as the MLPerf code's
# ``ipu_utils.get_config`` sets them (experiments/resnet_training.py's
# ``ipu_config``); the dense layer's matmul keeps PopLibs' default 0.6.
_MLPERF = {"model": "resnet50", "tiles_per_ipu": 1472, "dtype": "float16",
           "image_size": 224, "pipeline_splits": SPLITS, "recomputation": True,
           "conv_proportion": 0.15, "matmul_proportion": 0.6, "partials_type": "float16"}

PRESETS = {
    # v1.0: mk2_resnet50_mlperf_pod16_bs20 / _pod64_bs20 (momentum SGD).
    "mlperf_v1_pod16": dict(_MLPERF, system="pod16", replicas=16, micro_batch=20,
                            gradient_accumulation=6, optimizer="momentum"),
    "mlperf_v1_pod64": dict(_MLPERF, system="pod64", replicas=64, micro_batch=20,
                            gradient_accumulation=2, optimizer="momentum",
                            conv_proportion=0.14),
    # v1.1: mk2_resnet50_mlperf_pod{16,64,128,256}_lars.
    "mlperf_v1_1_pod16": dict(_MLPERF, system="pod16", replicas=16, micro_batch=20,
                              gradient_accumulation=10, optimizer="lars"),
    "mlperf_v1_1_pod64": dict(_MLPERF, system="pod64", replicas=64, micro_batch=20,
                              gradient_accumulation=3, optimizer="lars"),
    "mlperf_v1_1_pod128": dict(_MLPERF, system="pod128", replicas=128, micro_batch=20,
                               gradient_accumulation=2, optimizer="lars"),
    "mlperf_v1_1_pod256": dict(_MLPERF, system="pod256", replicas=256, micro_batch=20,
                               gradient_accumulation=2, optimizer="lars"),
    # v2.0 on Bow Pods: mk2_resnet50_mlperf_pod{16,64,128,256}_lars
    # (systems/ipu-pod*-TF1-closed.json: Bow IPUs; Bow-Pod256's GW-Links are
    # switched, kernels/systems.py's bow-pod256).
    "mlperf_v2_bow_pod16": dict(_MLPERF, system="bow-pod16", replicas=16, micro_batch=22,
                                gradient_accumulation=10, optimizer="lars"),
    "mlperf_v2_bow_pod64": dict(_MLPERF, system="bow-pod64", replicas=64, micro_batch=20,
                                gradient_accumulation=4, optimizer="lars"),
    "mlperf_v2_bow_pod128": dict(_MLPERF, system="bow-pod128", replicas=128, micro_batch=20,
                                 gradient_accumulation=2, optimizer="lars"),
    "mlperf_v2_bow_pod256": dict(_MLPERF, system="bow-pod256", replicas=256, micro_batch=20,
                                 gradient_accumulation=2, optimizer="lars"),
    # graphcore/examples (commit 3cc8f81f) vision/cnns/pytorch/train/configs.yml
    # ``resnet50`` (PopTorch, run by benchmarks.yml's
    # pytorch_resnet50_train_real_pod16 on 16 Mk2 IPUs): one stage, recomputation
    # from manual checkpoints (modelled as the whole forward recomputed),
    # micro-batch 18, G 57, proportion 0.16 (PopTorch's setAvailableMemoryProportion:
    # convolutions and matmuls, utils/ipu_settings.py), half_partial, momentum
    # SGD, device_iterations 1 (one update an execution, the runner's default).
    # No measurement is published with it (docs/published_resnet.md).
    "poptorch_pod16": dict(_MLPERF, system="pod16", replicas=16, micro_batch=18,
                           gradient_accumulation=57, optimizer="momentum", pipeline_splits=[],
                           conv_proportion=0.16, matmul_proportion=0.16),
    # A test-sized model on 16 tiles: the runner's own checks.
    "tiny_check": {"model": "tiny", "tiles_per_ipu": 16, "dtype": "float32", "image_size": 16,
                   "pipeline_splits": ["stage1/unit1/relu"], "recomputation": True,
                   "conv_proportion": 0.6, "matmul_proportion": 0.6,
                   "partials_type": "float32", "system": "pod4", "replicas": 2, "micro_batch": 2,
                   "gradient_accumulation": 2, "optimizer": "momentum"},
}

# One execution of the MLPerf runs' training loop is a fifth of an epoch:
# train.py sets its on-device iterations (weight updates) to ``log_freq =
# (1,281,167 // global batch) // logs_per_epoch`` (``logs_per_epoch: 5`` in
# the base config every MLPerf config inherits; ``batches_per_step: 100000``
# only caps it), e.g. 25 updates on POD256, 80 on v1.1's POD16
# (docs/published_resnet.md#steady-epochs).
for _name, _preset in PRESETS.items():
  if _name.startswith("mlperf_"):
    _batch = _preset["micro_batch"] * _preset["gradient_accumulation"] * _preset["replicas"]
    _preset["updates_per_execution"] = (1_281_167 // _batch) // 5
del _name, _preset, _batch
