"""A small BERT pipelined over a replicated system, its throughput, the runner's presets.

One small BERT (4 layers of width 128) is lowered once, on 2 replicas of 4
IPUs of an IPU-POD64, and trained for a real step; the big estimates are
measured by the benchmark's ``pod`` row, not here.
"""

import contextlib
import io
import json
import os
import shutil
import tempfile

import chex
import jax
import numpy as np
import optax
from absl import app, flags
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
from experiments import bert, bert_pretraining, bert_presets, lamb
from ipu_jax.kernels import collectives, systems
from ipu_jax.pipelining import throughput as tp_lib
import testing_utils

_G, _R = 10, 2


def _small_pipeline(system="pod64"):
  cfg_model = bert.BertConfig(vocab_size=1000, hidden=128, layers=4, heads=4, ffn=512,
                              max_positions=64, dropout=0.0, decoder_serialization=2)
  loss_fn, params = bert.make_loss(bert.Bert(cfg_model, rngs=nnx.Rngs(0)))
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 32
  cfg.auto_select_ipus = 4
  cfg.replication_factor = _R
  cfg.system = system
  cfg.training.gradient_accumulation_steps = _G
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.pipelining.recomputation = True
  cfg.streaming.offload_optimizer_state = True
  cfg.streaming.replicated_tensor_sharding = True
  assignment, mapping = bert.layout([1, 1, 1, 1])
  optimizer = optax.lamb(1e-3)
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                                     stage_assignment=assignment)
  batches = bert.synthetic_batches(cfg_model, _G * _R, 2, 16, 4, seed=1)
  return pipe, loss_fn, optimizer, params, batches


class SmallBertOnAPodTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.pipe, loss_fn, optimizer, params, batches = _small_pipeline()
    state = cls.pipe.init(params, batches)
    out = cls.pipe.step(params, state, batches)
    cls.trained, cls.loss = out.params, out.loss
    cls.expected = bert_pretraining.plain_steps(loss_fn, optimizer, params, [batches])

  def test_weights_equal_plain_gradient_accumulation(self):
    self.assertTrue(np.isfinite(float(self.loss)))
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, self.trained),
                                jax.tree_util.tree_map(np.asarray, self.expected),
                                rtol=1e-5, atol=1e-7)

  def test_report_shows_throughput_whose_parts_add_up(self):
    report = self.pipe.report
    tp = report.throughput
    self.assertEqual(tp.system, "pod64")
    self.assertEqual(tp.ipus, _R * 4)
    self.assertEqual(set(tp.breakdown), set(tp_lib.PARTS))
    self.assertAlmostEqual(sum(tp.breakdown.values()), tp.step_seconds, delta=1e-12)
    self.assertEqual(tp.samples_per_step, _G * _R * 2)
    self.assertAlmostEqual(tp.samples_per_second, tp.samples_per_step / tp.step_seconds)
    for part in ("steady_state", "ramp", "recomputation", "inter_stage_copies", "syncs",
                 "gradient_reduction", "optimizer_state_streaming", "optimizer_compute",
                 "weight_all_gather", "host_io"):
      self.assertGreater(tp.breakdown[part], 0.0, part)
    # The slots' compute and recomputation are the lowered programs' cycles.
    clock = self.pipe.target.clock_hz
    rec = (tp.breakdown["recomputation"] * clock)
    self.assertLessEqual(rec, _G * sum(s.recompute_cycles for s in self.pipe.stages) + 1)
    d = report.to_dict()["throughput"]
    self.assertAlmostEqual(d["step_seconds"], tp.step_seconds)
    self.assertIn("throughput on pod64, 8 IPUs", report.summary())
    self.assertIn("gradient_reduction", report.summary())

  def test_packing_multiplies_sequences(self):
    tp = self.pipe.report.throughput_for(sequences_per_sample=2.0)
    self.assertAlmostEqual(tp.sequences_per_second, 2 * tp.samples_per_second)
    with self.assertRaisesRegex(ValueError, "packing factor"):
      self.pipe.report.throughput_for(sequences_per_sample=0.5)

  def test_two_pod64s_change_only_collectives_and_syncs(self):
    one = tp_lib.step_throughput(self.pipe)
    two = tp_lib.step_throughput(self.pipe, system="pod128")
    changed = {"syncs", "gradient_reduction", "weight_all_gather"}
    for part in set(tp_lib.PARTS) - changed:
      self.assertEqual(one.breakdown[part], two.breakdown[part], part)
    for part in changed:
      self.assertGreater(two.breakdown[part], one.breakdown[part], part)
    target = self.pipe.target
    pod128 = systems.system_preset("pod128")
    clock = target.clock_hz
    # One replica in each POD: IPU j of replica 1 is IPU 64 + j, across the GW-Links.
    self.assertEqual(tp_lib.replica_bases(pod128, 2, 4), [0, 64])
    slots = len(ipu_jax.pipelining.schedule.slots("Grouped", 5, _G))
    gw = 2 * pod128.gw_latency_seconds * clock
    self.assertAlmostEqual((two.breakdown["syncs"] - one.breakdown["syncs"]) * clock,
                           slots * gw, delta=1e-6)
    # One reduce-scatter of every IPU's gradients at once (IPU 0's: stages 0 and 4),
    # priced by the system's links.
    t128 = target.replace(system=pod128)
    grads = [sum(s.weight_bytes for s in self.pipe.stages if s.ipu == j) for j in range(4)]
    expected = collectives.reduce_scatter(t128, [[j, 64 + j] for j in range(4)], grads).cycles
    self.assertAlmostEqual(two.breakdown["gradient_reduction"] * clock, expected, delta=1e-3)
    self.assertGreater(
        collectives.reduce_scatter(t128, [[0, 64]], 1 << 20).link_bytes["gw_link"], 0)


class Float16SplitTest(absltest.TestCase):

  def test_float16_bert_splits_into_its_stages(self):
    # A NumPy float64 scale promoted float16 scores to float32, so each layer
    # converted the stage-0 attention mask and layer 2 (stage 2) was refused.
    cfg = bert.BertConfig(vocab_size=100, hidden=32, layers=4, heads=2, ffn=64,
                          max_positions=32, dtype=np.float16)
    loss_fn, params = bert.make_loss(bert.Bert(cfg, rngs=nnx.Rngs(0)))
    micro = jax.tree_util.tree_map(lambda b: b[0], bert.synthetic_batches(cfg, 1, 2, 16, 4))
    assignment, _ = bert.layout([1, 1, 1, 1])
    staged = ipu_jax.pipelining.split_stages(loss_fn, params, micro, assignment)
    self.assertEqual(staged.num_stages, 5)
    jaxpr = jax.make_jaxpr(loss_fn)(params, micro)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    self.assertTrue(dots)
    self.assertTrue(all(e.outvars[0].aval.dtype == np.float16 for e in dots))


class BadInputTest(parameterized.TestCase):

  def _flags(self, *argv):
    # The runner's own flags, parsed apart from the process's global FLAGS.
    f = bert_pretraining.define_flags(flags.FlagValues())
    f(["bert_pretraining", *argv])
    bert_pretraining.apply_preset(f)
    return f

  @parameterized.named_parameters(
      ("packing", ["--packing_factor=0.5"], "--packing_factor must be >= 1"),
      ("accumulation", ["--accumulation=12"], "--accumulation=12 does not suit the Grouped"),
      ("system", ["--config=phase1_pod16", "--replicas=5"], "--replicas=5"),
      ("layers", ["--layers_per_ipu=1,1,1"], "--layers_per_ipu"),
      ("hardware_masks_checked", ["--check", "--dropout=0.1", "--random_mode=hardware"],
       "--random_mode=jax with --check"),
      ("updates", ["--updates_per_execution=0"], "--updates_per_execution=0 must be >= 1"),
  )
  def test_clear_errors_naming_the_flag(self, argv, message):
    f = self._flags(*argv)
    with self.assertRaisesRegex(ValueError, message):
      bert_pretraining.check_flags(f, 24 if f.model == "large" else 4)

  @parameterized.parameters(
      ("--replicas=0", "--replicas=0: 0 is not a positive integer"),
      ("--micro_batch=0", "--micro_batch=0: 0 is not a positive integer"),
      ("--seq=-4", "--seq=-4: -4 is not a positive integer"),
      ("--steps=0", "--steps=0: 0 is not a positive integer"),
      ("--decoder_serialization=0", "--decoder_serialization=0: 0 is not a positive integer"),
      ("--tiles_per_ipu=-1", "--tiles_per_ipu=-1: -1 is not a non-negative integer"),
  )
  def test_counts_below_their_least_are_refused_when_parsed(self, arg, message):
    # --micro_batch=0 used to estimate 0 samples/s; --replicas=0 raised from IPUConfig.
    with self.assertRaisesRegex(flags.IllegalFlagValueError, message):
      self._flags(arg)

  @parameterized.parameters(
      (["--dropout=1.5"], r"--dropout=1\.5 must be in \[0, 1\)"),
      (["--attention_dropout=-0.1"], r"--attention_dropout=-0\.1 must be in \[0, 1\)"),
      (["--max_predictions=100"], r"--max_predictions=100 exceeds --seq=64"),
      # The tiny model's 1,000 words do not split in 3; the factors that do are listed.
      (["--decoder_serialization=3"],
       r"--decoder_serialization=3 does not divide the vocabulary of 1,000 words.*"
       r"\[1, 2, 4, 5, 8, 10,"),
      # BERT-Large's 30,522 words split into 1, 2, 3 or 6 pieces, not 4.
      (["--config=phase2_pod16", "--decoder_serialization=4"],
       r"--decoder_serialization=4 .* 30,522 words"),
      (["--matmul_proportion=2.0,0.2,0.2,0.2"],
       r"--matmul_proportion=2\.0,0\.2,0\.2,0\.2: each entry must be a proportion in \(0, 1\]"),
      (["--matmul_proportion=0.2,0.2"], r"gives 2 proportions; the split has 4 IPUs a replica"),
      (["--layers_per_ipu=1,x,1,1"], r"--layers_per_ipu=1,x,1,1: each entry must be a whole"),
  )
  def test_values_the_model_cannot_take_are_a_usage_error(self, argv, message):
    # Raised by the runner before a model is built or a program lowered (they
    # were tracebacks from BertConfig, IPUConfig or the decoder's tracing).
    with self.assertRaisesRegex(app.UsageError, message):
      bert_pretraining.run(self._flags("--estimate_only", *argv))

  def test_presets_and_overrides(self):
    f = self._flags("--config=phase2_pod16", "--micro_batch=4")
    self.assertEqual((f.seq, f.micro_batch, f.replicas, f.accumulation, f.system),
                     (512, 4, 4, 2040, "pod16"))
    # The overriding flags every runner shares (resnet_training, llm).
    f = self._flags("--config=phase2_pod16", "--gradient_accumulation=1020",
                    "--system=bow-pod16", "--dtype=float32")
    self.assertEqual((f.accumulation, f.system, f.dtype), (1020, "bow-pod16", "float32"))
    bert_pretraining.check_flags(f, 24)
    self.assertEqual([int(v) for v in f.layers_per_ipu], [3, 7, 7, 7])
    bert_pretraining.check_flags(f, 24)
    f = self._flags("--config=phase1_pod16", "--model=base")
    self.assertEqual([int(v) for v in f.layers_per_ipu],
                     bert_presets.BASE_OVERRIDES["layers_per_ipu"])
    self.assertEqual((f.micro_batch, f.accumulation), (32, 510))
    bert_pretraining.check_flags(f, 12)

  @parameterized.parameters(*sorted(bert_presets.PRESETS))
  def test_every_preset_passes_its_own_checks(self, name):
    f = self._flags(f"--config={name}")
    mcfg = bert_pretraining.model_config(f.model, f.dropout, f.decoder_serialization, f.dtype,
                                         f.vocab_size)
    bert_pretraining.check_flags(f, mcfg.layers)
    _, mapping = bert_pretraining.stage_layout(f, mcfg.layers)
    self.assertLen(f.matmul_proportion, bert_pretraining.num_ipus(mapping))
    # The serialised decoder splits the vocabulary into equal pieces.
    self.assertEqual(mcfg.vocab_size % mcfg.decoder_serialization, 0)

  @parameterized.parameters(*sorted(bert_presets.PRESETS))
  def test_presets_drop_out_as_the_measured_runs_did(self, name):
    # Every run: 0.1 of the hidden values (PopART's dropout_prob, the
    # examples' hidden_dropout_prob) from the tiles' generators; the
    # attention probabilities too only in MLPerf v2.0 (no_attn_dropout: false).
    f = self._flags(f"--config={name}")
    self.assertEqual((f.dropout, f.random_mode), (0.1, "hardware"))
    self.assertEqual(f.attention_dropout, 0.1 if name.startswith("mlperf_v2") else 0.0)
    mcfg = bert_pretraining.model_config(f.model, f.dropout, f.decoder_serialization, f.dtype,
                                         f.vocab_size, f.attention_dropout)
    self.assertEqual((mcfg.dropout, mcfg.attention_dropout), (f.dropout, f.attention_dropout))

  # LAMB's m and v (PopART's accl1 / accl2) as each run set them
  # (docs/published_bert.md): v1.1 lamb_m_dtype FLOAT16 on POD16 / POD128,
  # its default FLOAT on POD64, v at PopART's default FLOAT; v2.0
  # lamb_accl_dtype FLOAT16 for both; v1.0 neither (FLOAT). The examples'
  # presets: float32 both, as the PyTorch example's poptorch LAMB
  # (optimization.py: first_order_momentum_accum_type float32 without
  # enable_half_first_order_momentum, second_order_momentum_accum_type
  # float32) and the TensorFlow 2 example's LAMBIpuOptimizer (optimization.py:
  # m_dtype, v_dtype tf.float32) keep them.
  _RUN_LAMB_STATE = {"mlperf_v1_1_pod16": ("float16", "float32"),
                     "mlperf_v1_1_pod128": ("float16", "float32"),
                     "mlperf_v2_bow_pod16": ("float16", "float16"),
                     "mlperf_v2_bow_pod64": ("float16", "float16"),
                     "mlperf_v2_bow_pod128": ("float16", "float16"),
                     "mlperf_v2_bow_pod256": ("float16", "float16")}

  @parameterized.parameters(*sorted(bert_presets.PRESETS))
  def test_presets_keep_lamb_state_as_the_measured_runs_did(self, name):
    f = self._flags(f"--config={name}")
    weights = {"w": np.zeros((4, 8), f.dtype), "b": np.zeros((8,), f.dtype)}
    state = bert_pretraining.make_optimizer(f).init(weights)[0]
    got = tuple({np.dtype(x.dtype).name for x in jax.tree.leaves(moment)}
                for moment in (state.mu, state.nu))
    m, v = self._RUN_LAMB_STATE.get(name, ("float32", "float32"))
    self.assertEqual(got, ({m}, {v}))

  @parameterized.named_parameters(
      # PyTorch pretrain_base_128: optimizer LAMBNoBiasCorrection (poptorch
      # LAMB bias_correction False), proportion 0.25, vocabulary 30,522.
      ("pytorch", ["--config=phase1_pod16", "--model=base"], False, [0.25] * 4, None),
      # TensorFlow 2 pretrain_base_128_phase1.json: LAMBIpuOptimizer with
      # debiasing at its default True; its own proportions and vocabulary,
      # whether or not --model=base is given.
      ("tf2", ["--config=tf2_base_phase1_pod16"], True, [0.28, 0.26, 0.28, 0.28], 30400),
      ("tf2_model_given", ["--config=tf2_base_phase1_pod16", "--model=base"], True,
       [0.28, 0.26, 0.28, 0.28], 30400),
  )
  def test_base_presets_run_their_examples(self, argv, bias_correction, proportions, vocab):
    f = self._flags(*argv)
    self.assertEqual((f.model, f.micro_batch, f.accumulation), ("base", 32, 510))
    self.assertEqual([int(v) for v in f.layers_per_ipu], [0, 4, 4, 4])
    self.assertEqual(f.lamb_bias_correction, bias_correction)
    self.assertEqual([float(v) for v in f.matmul_proportion], proportions)
    self.assertEqual(f.vocab_size, vocab)
    bert_pretraining.check_flags(f, 12)

  @parameterized.parameters(*sorted(bert_presets.PRESETS))
  def test_mlperf_presets_run_lamb_without_bias_correction(self, name):
    # Every MLPerf config: optimizer LAMB_NO_BIAS (PopART's LambNoBias); the
    # example presets keep optax.lamb's bias-corrected LAMB.
    f = self._flags(f"--config={name}")
    self.assertEqual(f.lamb_bias_correction, not name.startswith("mlperf_"))

  def test_bad_lamb_state_dtype_names_the_flag_and_its_values(self):
    with self.assertRaisesRegex(flags.IllegalFlagValueError,
                                r"--lamb_m_dtype=bfloat16: value should be one of "
                                r"<float16\|float32>"):
      self._flags("--lamb_m_dtype=bfloat16")
    with self.assertRaisesRegex(flags.IllegalFlagValueError,
                                r"--lamb_v_dtype=half: value should be one of"):
      self._flags("--config=mlperf_v2_bow_pod16", "--lamb_v_dtype=half")

  def test_mlperf_presets_mirror_the_measured_runs(self):
    # docs/published_bert.md: MLPerf Training v1.0 closed, configs/mk2/pod64-closed.json.
    f = self._flags("--config=mlperf_v1_pod64")
    mcfg = bert_pretraining.model_config(f.model, f.dropout, f.decoder_serialization, f.dtype,
                                         f.vocab_size)
    self.assertEqual((f.replicas, f.micro_batch, f.seq, f.max_predictions, f.packing_factor),
                     (8, 2, 512, 76, 2.0))
    self.assertEqual([int(v) for v in f.layers_per_ipu], [0, 3, 3, 3, 3, 4, 4, 4])
    self.assertEqual((mcfg.vocab_size, mcfg.decoder_serialization, f.offload_optimizer_state),
                     (30400, 5, False))
    f = self._flags("--config=mlperf_v1_pod16", "--vocab_size=30522", "--decoder_serialization=2")
    self.assertEqual((f.replicas, f.accumulation, f.vocab_size), (4, 190, 30522))

  # docs/published_bert.md: every MLPerf closed run's system, replicas x IPUs
  # per replica, micro-batch (packs), G (the run's, then the preset's: the
  # Grouped schedule's nearest multiple of 2 x stages), vocabulary, partials,
  # optimizer state offloaded.
  @parameterized.named_parameters(
      ("v1_pod16", "mlperf_v1_pod16", "pod16", 4, 4, 2, 192, 190, 30400, "float16", True, 3072),
      ("v1_pod64", "mlperf_v1_pod64", "pod64", 8, 8, 2, 96, 90, 30400, "float16", False, 3072),
      ("v1_1_pod16", "mlperf_v1_1_pod16", "pod16", 4, 4, 2, 192, 190, 30912, "float16", True,
       3072),
      ("v1_1_pod64", "mlperf_v1_1_pod64", "pod64", 8, 8, 2, 96, 90, 30912, "float16", False,
       3072),
      ("v1_1_pod128", "mlperf_v1_1_pod128", "pod128", 16, 8, 2, 96, 90, 30912, "float16",
       False, 6144),
      ("v2_pod16", "mlperf_v2_bow_pod16", "bow-pod16", 2, 8, 3, 256, 252, 30912, "float16",
       False, 3072),
      ("v2_pod64", "mlperf_v2_bow_pod64", "bow-pod64", 8, 8, 3, 96, 90, 30912, "float16",
       False, 4608),
      ("v2_pod128", "mlperf_v2_bow_pod128", "bow-pod128", 16, 8, 3, 64, 72, 30912, "float16",
       False, 6144),
      ("v2_pod256", "mlperf_v2_bow_pod256", "bow-pod256", 32, 8, 3, 36, 36, 30912, "float16",
       False, 6912),
  )
  def test_every_mlperf_run_has_its_preset(self, name, system, replicas, ipus, micro_batch,
                                           run_g, g, vocab, partials, offload, global_batch):
    f = self._flags(f"--config={name}")
    _, mapping = bert_pretraining.stage_layout(f, 24)
    stages = len(mapping)
    self.assertEqual((f.system, f.replicas, bert_pretraining.num_ipus(mapping), f.micro_batch,
                      f.accumulation), (system, replicas, ipus, micro_batch, g))
    self.assertEqual((f.seq, f.max_predictions, f.packing_factor, f.vocab_size, f.partials_type,
                      f.offload_optimizer_state, f.replicated_tensor_sharding),
                     (512, 76, 2.0, vocab, partials, offload, True))
    # G: the accepted multiple of 2 x stages nearest the run's.
    multiples = [k * 2 * stages for k in range(1, run_g // stages + 2)]
    self.assertEqual(g, min(multiples, key=lambda m: abs(m - run_g)))
    # The logged global batch (sequences) is micro-batch x the run's G x replicas x 2.
    self.assertEqual(micro_batch * run_g * replicas * 2, global_batch)
    ipu_cfg = bert_pretraining.ipu_config(f, bert_pretraining.num_ipus(mapping))
    self.assertEqual(ipu_cfg.matmuls.partials_type, partials)

  @parameterized.named_parameters(
      ("v1_pod16", "mlperf_v1_pod16", False, ()),
      ("v1_1_pod16", "mlperf_v1_1_pod16", True, (20, 21, 22, 23)),
      ("v1_1_pod64", "mlperf_v1_1_pod64", True, (23,)),
      ("v2_pod16", "mlperf_v2_bow_pod16", True, ()),
      ("v2_pod64", "mlperf_v2_bow_pod64", True, (23,)),
  )
  def test_mlperf_presets_recompute_the_last_stage_as_popart(self, name, marked, attention):
    # PopART's RecomputationType::Pipeline; bert_model.py's should_checkpoint_att
    # marks the attention outputs of the last stage (docs/published_bert.md).
    f = self._flags(f"--config={name}")
    self.assertEqual((f.last_stage_recomputation, f.checkpoint_blocks), ("checkpoints", marked))
    mcfg = bert_pretraining.with_checkpoints(f, bert_pretraining.model_config(
        f.model, f.dropout, f.decoder_serialization, f.dtype, f.vocab_size))
    self.assertEqual((mcfg.attention_checkpoints, mcfg.head_checkpoints), (attention, marked))
    ipu_cfg = bert_pretraining.ipu_config(f, 8)
    self.assertEqual(ipu_cfg.pipelining.last_stage_recomputation, "checkpoints")
    # Other presets keep TF-IPU's rule.
    f = self._flags("--config=phase2_pod16")
    self.assertEqual((f.last_stage_recomputation, f.checkpoint_blocks), ("none", False))

  def test_attention_ffn_placement_flag(self):
    f = self._flags("--config=mlperf_v1_1_pod16")
    assignment, mapping = bert_pretraining.stage_layout(f, 24)
    self.assertEqual(mapping, [0, 1, 2, 3, 0])
    self.assertEqual((assignment["layers_6/attention_block"], assignment["layers_6/ffn_block"]),
                     (1, 2))
    # --layers_per_ipu on the command line replaces the preset's placement.
    f = self._flags("--config=mlperf_v1_1_pod16", "--layers_per_ipu=3,7,7,7")
    self.assertIsNone(f.att_ffn_placement)
    self.assertEqual(bert_pretraining.stage_layout(f, 24)[1], [0, 1, 2, 3, 0])

  @parameterized.named_parameters(
      ("json", ["--att_ffn_placement=[[1, [2, 2]"], "--att_ffn_placement="),
      ("counts", ["--att_ffn_placement=[[1, [2, 2]], [2, [2, 1]]]"],
       "--att_ffn_placement=.*places 4 attention and 3 feed-forward"),
      ("auto_split", ["--config=mlperf_v2_bow_pod64", "--auto_split"],
       "--auto_split searches whole layers"),
      ("capacity", ["--config=mlperf_v2_bow_pod16", "--replicas=3"], "--replicas=3"),
  )
  def test_bad_placement_flags(self, argv, message):
    f = self._flags(*argv)
    with self.assertRaisesRegex(ValueError, message):
      bert_pretraining.check_flags(f, 24 if f.model == "large" else 4)

  def test_pipeline_refuses_a_system_too_small(self):
    pipe, _, _, params, batches = _small_pipeline()
    pipe.config.replication_factor = 5
    pipe.config.system = "pod16"
    batches = jax.tree_util.tree_map(lambda b: np.concatenate([b, b, b[:10]]), batches)
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError,
                                "replication_factor=5 x auto_select_ipus=4"):
      pipe.lower(params, batches)


def _gradients(params, step):
  """Step ``step``'s made-up gradients, in ``params``' shapes and dtypes."""
  keys = jax.random.split(jax.random.key(step), len(params))
  return {name: (0.1 * jax.random.normal(k, p.shape)).astype(p.dtype)
          for k, (name, p) in zip(keys, sorted(params.items()))}


def _lamb_steps(optimizer, params, steps=3):
  """``steps`` updates of ``optimizer`` on :func:`_gradients`: the weights and
  the state after them."""
  state = optimizer.init(params)
  for step in range(steps):
    updates, state = optimizer.update(_gradients(params, step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _weights(dtype):
  w = np.random.default_rng(0).normal(size=(8, 16))
  return {"w": w.astype(dtype), "b": np.linspace(-1.0, 1.0, 16).astype(dtype)}


class LambStateDtypesTest(chex.TestCase):
  """experiments.lamb: optax.lamb with its moments kept in given dtypes."""

  @parameterized.product(dtype=[np.float32, np.float16], weight_decay=[0.0, 0.01])
  def test_weights_dtypes_give_optax_lamb(self, dtype, weight_decay):
    # Moments in the weights' dtype, as given or as the default: optax.lamb's numbers.
    params = _weights(dtype)
    want = _lamb_steps(optax.lamb(1e-2, weight_decay=weight_decay), params)
    for mu, nu in ((None, None), (dtype, dtype)):
      got = _lamb_steps(lamb.lamb(1e-2, weight_decay=weight_decay, mu_dtype=mu, nu_dtype=nu),
                        params)
      chex.assert_trees_all_close(jax.tree.map(np.asarray, got),
                                  jax.tree.map(np.asarray, want), rtol=0, atol=0)

  @parameterized.parameters(("float16", "float32"), ("float32", "float32"),
                            ("float16", "float16"), ("float32", "float16"))
  def test_each_moment_stays_in_its_dtype(self, mu, nu):
    params = _weights(np.float16)
    got, state = _lamb_steps(lamb.lamb(1e-2, mu_dtype=mu, nu_dtype=nu), params)
    adam = state[0]
    self.assertEqual({np.dtype(x.dtype).name for x in jax.tree.leaves(adam.mu)}, {mu})
    self.assertEqual({np.dtype(x.dtype).name for x in jax.tree.leaves(adam.nu)}, {nu})
    self.assertEqual({np.dtype(x.dtype).name for x in jax.tree.leaves(got)}, {"float16"})

  def test_float32_moments_are_float32_lamb_of_the_gradients(self):
    # float16 weights, float32 m and v: each moment's update is computed in
    # float32 (the gradient cast first), so the moments are those of a float32
    # LAMB given the same gradients; the weights, cast to float16, agree to
    # float16's rounding.
    params = _weights(np.float16)
    got, state = _lamb_steps(lamb.lamb(1e-2, mu_dtype="float32", nu_dtype="float32"), params)
    mu = nu = jax.tree.map(lambda p: np.zeros(p.shape, np.float32), params)
    for step in range(3):
      g = jax.tree.map(lambda x: x.astype(np.float32), _gradients(params, step))
      mu = jax.tree.map(lambda m, x: 0.9 * m + 0.1 * x, mu, g)
      nu = jax.tree.map(lambda n, x: 0.999 * n + 0.001 * x * x, nu, g)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, (state[0].mu, state[0].nu)),
                                jax.tree.map(np.asarray, (mu, nu)), rtol=1e-6, atol=1e-12)
    self.assertEqual({np.dtype(x.dtype).name for x in jax.tree.leaves(got)}, {"float16"})

  def test_without_bias_correction_is_popart_lamb_no_bias(self):
    # PopART's LambNoBias (willow/include/popart/adam.hpp): m' and v' divide
    # the update as they are; the trust ratio ||w|| / ||u|| scales it. The
    # ratio cancels any per-tensor factor, so the two modes differ through
    # eps alone: a large eps shows it.
    params = _weights(np.float32)
    got, _ = _lamb_steps(lamb.lamb(1e-2, eps=0.1, bias_correction=False), params)
    want = {k: np.asarray(v, np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in want.items()}
    nu = {k: np.zeros_like(v) for k, v in want.items()}
    for step in range(3):
      g = {k: np.asarray(v, np.float64) for k, v in _gradients(params, step).items()}
      for k in want:
        mu[k] = 0.9 * mu[k] + 0.1 * g[k]
        nu[k] = 0.999 * nu[k] + 0.001 * g[k] ** 2
        u = mu[k] / (np.sqrt(nu[k]) + 0.1)
        want[k] = want[k] - 1e-2 * np.linalg.norm(want[k]) / np.linalg.norm(u) * u
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got), want, rtol=1e-6, atol=1e-7)
    corrected, _ = _lamb_steps(lamb.lamb(1e-2, eps=0.1), params)
    self.assertGreater(np.max(np.abs(np.asarray(corrected["w"]) - want["w"])), 1e-4)

  def test_mixed_dtypes_update_on_the_ipu_equals_jax_jit(self):
    # The update with float16 weights, float16 m and float32 v (MLPerf v1.1
    # POD16's) lowers and runs on the emulated IPU as jax.jit runs it.
    params = _weights(np.float16)
    optimizer = lamb.lamb(1e-2, mu_dtype="float16", nu_dtype="float32")
    _, state = _lamb_steps(optimizer, params, steps=2)
    grads = jax.tree.map(lambda p: (0.05 * p).astype(p.dtype), params)

    def update(grads, state, params):
      updates, new_state = optimizer.update(grads, state, params)
      return optax.apply_updates(params, updates), new_state
    testing_utils.assert_matches_jit(update, grads, state, params, rtol=2e-3, atol=1e-3,
                                     modes=("batched",))

  def test_a_moment_dtype_that_is_not_floating_is_refused(self):
    with self.assertRaisesRegex(ValueError, r"nu_dtype='int8' is not a floating dtype"):
      lamb.lamb(1e-3, nu_dtype="int8")
    with self.assertRaisesRegex(ValueError, r"mu_dtype='fp17' is not a floating dtype"):
      lamb.lamb(1e-3, mu_dtype="fp17")


def _runner_flags(*argv):
  """The runner's flags parsed apart from the process's global FLAGS."""
  f = bert_pretraining.define_flags(flags.FlagValues())
  f(["bert_pretraining", *argv])
  return f


# The tiny BERT (4 layers of width 128) on 14 tiles per IPU: no split fits at
# proportion 0.6, nor Graphcore-style splits with an empty IPU 0 as fast as
# one layer per IPU.
_TILES = ["--tiles_per_ipu=14", "--split_proportions=0.3,0.6", "--split_recomputation=true",
          "--split_serialization=2"]


# The search lowers the model as the run does, its dropout masks included
# (the presets drop out as the measured runs did).
_DROPOUT = ("--dropout=0.1", "--attention_dropout=0.1", "--random_mode=hardware")


class AutoSplitTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.mkdtemp()
    path = os.path.join(cls.tmp, "auto.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      bert_pretraining.run(_runner_flags(
          "--auto_split", "--estimate_only", f"--json_out={path}", *_TILES, *_DROPOUT,
          "--layers_per_ipu=0,2,1,1", "--matmul_proportion=0.3,0.3,0.3,0.3",
          "--decoder_serialization=2", f"--split_plot={os.path.join(cls.tmp, 'split.png')}"))
    cls.printed = printed.getvalue()
    with open(path) as out:
      cls.auto = json.load(out)
    split = cls.auto["split"]
    # The same estimate, the chosen split given by hand.
    path = os.path.join(cls.tmp, "given.json")
    bert_pretraining.run(_runner_flags(
        "--estimate_only", f"--json_out={path}", *_TILES, *_DROPOUT,
        "--layers_per_ipu=" + ",".join(map(str, split["layers_per_ipu"])),
        "--matmul_proportion=" + ",".join(map(str, split["available_memory_proportion"])),
        f"--recomputation={split['recomputation']}",
        f"--decoder_serialization={split['serialization_factor']}"))
    with open(path) as out:
      cls.given = json.load(out)

  @classmethod
  def tearDownClass(cls):
    shutil.rmtree(cls.tmp, ignore_errors=True)
    super().tearDownClass()

  def test_chosen_split_fits_and_is_the_layout_estimated(self):
    auto = self.auto
    self.assertEqual(set(auto["split"]), {"layers_per_ipu", "available_memory_proportion",
                                          "recomputation", "serialization_factor"})
    self.assertEqual(sum(auto["split"]["layers_per_ipu"]), 4)
    self.assertLen(auto["split"]["available_memory_proportion"], 4)
    self.assertTrue(auto["fits"])
    self.assertLessEqual(max(auto["per_ipu_max_tile_bytes"]), auto["bytes_per_tile"])
    # The flags' own split was the baseline; the search chose a faster one.
    self.assertEqual(auto["split_baseline"]["layers_per_ipu"], [0, 2, 1, 1])
    self.assertNotEqual(auto["split"]["layers_per_ipu"], [0, 2, 1, 1])
    self.assertGreater(auto["split_estimate"]["samples_per_second"],
                       auto["split_baseline"]["samples_per_second"])
    # The runner estimated the chosen split from the search's own lowering of
    # it (dropout's masks and all): the same figures as that split given by
    # hand and lowered afresh.
    self.assertEqual(auto["lowered_by"], "split search")
    # A forward-only run of the same micro-batches (evaluation) is cheaper.
    forward = auto["forward_only"]
    self.assertLess(forward["run_seconds"], auto["step_seconds"])
    self.assertGreater(forward["slot_seconds"], 0.0)
    self.assertAlmostEqual(sum(forward["breakdown"].values()), forward["run_seconds"],
                           delta=1e-12)
    self.assertRegex(self.printed, r"Estimate \(flags, BERT-.*\(split search\)")
    self.assertEqual(self.given["lowered_by"], "runner")
    self.assertEqual(auto["per_ipu_max_tile_bytes"], self.given["per_ipu_max_tile_bytes"])
    self.assertEqual(auto["per_ipu_peak_bytes"], self.given["per_ipu_peak_bytes"])
    self.assertAlmostEqual(auto["samples_per_second"], self.given["samples_per_second"],
                           delta=1e-9 * auto["samples_per_second"])
    # ... which the search's own lowering of it confirmed.
    self.assertEqual(auto["split_estimate"]["lowered_peak_bytes"],
                     auto["per_ipu_max_tile_bytes"])
    self.assertNotIn("split", self.given)
    with open(os.path.join(self.tmp, "split.png"), "rb") as png:
      self.assertEqual(png.read(8), b"\x89PNG\r\n\x1a\n")

  def test_search_counts(self):
    search = self.auto["search"]
    # 4 layer compositions x 2 proportions on each of 4 IPUs.
    self.assertEqual(search["scored"], 4 * 2 ** 4)
    self.assertGreaterEqual(search["lowered"], 3)  # a probe per proportion, a confirmation
    self.assertEqual(search["confirmed"], 1)
    self.assertGreater(search["seconds"], 0)

  def test_nothing_fits_is_a_usage_error_naming_the_ipu_and_shortfall(self):
    path = os.path.join(self.tmp, "none.json")
    f = _runner_flags("--auto_split", "--estimate_only", f"--json_out={path}",
                      "--tiles_per_ipu=4", "--split_proportions=0.3",
                      "--split_recomputation=true", "--split_serialization=2")
    with self.assertRaisesRegex(app.UsageError,
                                r"--auto_split: No split fits: .* is [\d,]+ bytes short on IPU "
                                r"\d \(tile \d+ needs [\d,]+ of 638,976 bytes\)"):
      bert_pretraining.run(f)
    self.assertFalse(os.path.exists(path))

  @parameterized.named_parameters(
      ("proportion", ["--split_proportions=0.3,1.5"], "--split_proportions: '1.5'"),
      ("recomputation", ["--split_recomputation=maybe"], "--split_recomputation: 'maybe'"),
      ("factor", ["--split_serialization=0"], "--split_serialization: '0'"),
      ("vocabulary", ["--split_serialization=3,7"], "none of \\[3, 7\\] divides the vocabulary"),
  )
  def test_bad_search_space_flags(self, argv, message):
    with self.assertRaisesRegex(ValueError, message):
      bert_pretraining.split_space(_runner_flags(*argv), 1000)

  def test_factors_not_dividing_the_vocabulary_are_left_out(self):
    space = bert_pretraining.split_space(_runner_flags("--split_serialization=1,2,4"), 30522)
    self.assertEqual(space["serialization"], (1, 2))
    self.assertEqual(space["recomputation"], (True, False))


if __name__ == "__main__":
  absltest.main()
