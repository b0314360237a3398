"""BERT pre-training pipelined as Graphcore ran it, on a small BERT.

Four encoder layers of width 128 (vocabulary 1,000, sequence 64) laid out as
BERT-Large is: the embeddings and layer 0 on IPU 0, one layer on each of IPUs
1-3, and the pooler and both heads back on IPU 0 with the MLM decoder tied to
the word embedding (``device_mapping=[0, 1, 2, 3, 0]``); recomputation after
every layer, the decoder serialised by 2, per-IPU matmul memory proportions,
LAMB with its state offloaded and sharded over 2 replicas. After 3 steps the
weights equal plain JAX gradient accumulation of the same micro-batches.
"""

import dataclasses

import chex
import jax
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
from experiments import bert
from experiments import bert_pretraining

_MODEL = bert.BertConfig(vocab_size=1000, hidden=128, layers=4, heads=4, ffn=512,
                         max_positions=64, dropout=0.0, decoder_serialization=2)
_MICRO_BATCH, _SEQ, _PREDICTIONS, _REPLICAS, _STEPS = 2, 64, 8, 2, 3
# One LAMB for every pipeline and reference here: plain_steps keeps its jitted
# update per optimizer, so the references compile it once.
_LAMB = optax.lamb(1e-3)


def _config(schedule: str, g: int):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.auto_select_ipus = 4
  cfg.replication_factor = _REPLICAS
  cfg.training.gradient_accumulation_steps = g
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.training.replica_reduction = "mean"
  cfg.pipelining.schedule = schedule
  cfg.pipelining.recomputation = True
  cfg.matmuls.available_memory_proportion = [0.15, 0.25, 0.25, 0.25]
  cfg.streaming.offload_optimizer_state = True
  cfg.streaming.replicated_tensor_sharding = True
  return cfg


def _data(g: int):
  return [bert.synthetic_batches(_MODEL, g * _REPLICAS, _MICRO_BATCH, _SEQ, _PREDICTIONS,
                                 seed=step) for step in range(_STEPS)]


def _train(schedule: str, g: int):
  loss_fn, params = bert.make_loss(bert.Bert(_MODEL, rngs=nnx.Rngs(0)))
  assignment, mapping = bert.layout([1, 1, 1, 1])
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, _LAMB, config=_config(schedule, g),
                                     device_mapping=mapping, stage_assignment=assignment)
  data = _data(g)
  state = pipe.init(params, data[0])
  trained = params
  for batches in data:
    out = pipe.step(trained, state, batches)
    trained, state = out.params, out.opt_state
  return pipe, loss_fn, params, trained, data


class BertPipelineTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(("Grouped", 10), ("Sequential", 8))
  def test_weights_equal_plain_accumulation(self, schedule, g):
    pipe, loss_fn, params, trained, data = _train(schedule, g)
    expected = bert_pretraining.plain_steps(loss_fn, _LAMB, params, data)
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, trained),
                                jax.tree_util.tree_map(np.asarray, expected),
                                rtol=1e-5, atol=1e-6)
    report = pipe.report.to_dict()
    stages = report["stages"]
    # Five stages on four IPUs: the heads' stage shares IPU 0 with the embeddings.
    self.assertEqual([s["ipu"] for s in stages], [0, 1, 2, 3, 0])
    self.assertEqual(report["memory_per_ipu"]["0"]["stages"], [0, 4])
    # TF-IPU never recomputes the last stage.
    self.assertEqual(stages[-1]["recompute_cycles"], 0.0)
    self.assertTrue(all(s["recompute_cycles"] > 0 for s in stages[:-1]))


class BertDropoutPipelineTest(chex.TestCase):
  """Dropout on: each micro-batch draws the masks plain accumulation draws."""

  def test_dropout_is_reproducible_and_equals_plain_accumulation(self):
    model_cfg = dataclasses.replace(_MODEL, dropout=0.1)
    loss_fn, params = bert.make_loss(bert.Bert(model_cfg, rngs=nnx.Rngs(0)), dropout=True)
    assignment, mapping = bert.layout([1, 1, 1, 1])
    cfg = _config("Sequential", 4)
    cfg.replication_factor = 1
    cfg.streaming.replicated_tensor_sharding = False
    pipe = ipu_jax.pipelining.Pipeline(loss_fn, optax.sgd(0.1), config=cfg, rng=True,
                                       device_mapping=mapping, stage_assignment=assignment)
    batches = bert.synthetic_batches(model_cfg, 4, _MICRO_BATCH, _SEQ, _PREDICTIONS, seed=0)
    state = pipe.init(params, batches, rng=jax.random.key(0))
    runs = [pipe.step(params, state, batches, rng=jax.random.key(seed)).params
            for seed in (7, 7, 8)]
    as_numpy = lambda tree: jax.tree_util.tree_map(np.asarray, tree)
    chex.assert_trees_all_equal(as_numpy(runs[0]), as_numpy(runs[1]))
    expected = bert_pretraining.plain_steps(loss_fn, optax.sgd(0.1), params, [batches],
                                            keys=[jax.random.key(7)])
    chex.assert_trees_all_close(as_numpy(runs[0]), as_numpy(expected), rtol=1e-5, atol=1e-6)
    # The report prices the step, the per-micro-batch keys included.
    self.assertIn("throughput", pipe.report.summary())
    self.assertGreater(pipe.report.throughput.samples_per_second, 0)
    # Another key draws other masks, so other weights.
    word = lambda p: np.asarray(p["encoder"]["layers"][0]["ffn_in"]["kernel"][...])
    self.assertGreater(np.max(np.abs(word(runs[2]) - word(runs[0]))), 1e-6)


def _train_layout(layout, g: int = 2, steps: int = 1):
  """Weights after ``steps`` Sequential steps of the small BERT laid out as
  ``layout`` (``(stage_assignment, device_mapping)``), and the pipeline."""
  loss_fn, params = bert.make_loss(bert.Bert(_MODEL, rngs=nnx.Rngs(0)))
  assignment, mapping = layout
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, _LAMB,
                                     config=_config("Sequential", g),
                                     device_mapping=mapping, stage_assignment=assignment)
  data = _data(g)[:steps]
  state = pipe.init(params, data[0])
  trained = params
  for batches in data:
    out = pipe.step(trained, state, batches)
    trained, state = out.params, out.opt_state
  return pipe, jax.tree_util.tree_map(np.asarray, trained), loss_fn, params, data


class AttentionFfnPlacementTest(chex.TestCase):
  """Graphcore's att_ffn_placement: a layer's attention on one IPU, its FFN on the next."""

  def test_split_layers_train_as_whole_layers_do(self):
    # Layer 1's FFN and layer 2's attention change IPUs against the whole-layer
    # split [0, 2, 1, 1] (the embeddings alone on IPU 0, the heads back on it).
    split = bert.placement_layout([[1, [2, 1]], [2, [1, 2]], [3, [1, 1]]], 4)
    whole = bert.layout([0, 2, 1, 1])
    self.assertEqual(split[1], whole[1])
    # Plain accumulation is what the whole-layer split trains to
    # (BertPipelineTest), so it stands for that split here.
    pipe, trained, loss_fn, params, data = _train_layout(split)
    expected = bert_pretraining.plain_steps(loss_fn, _LAMB, params, data)
    chex.assert_trees_all_close(trained, jax.tree_util.tree_map(np.asarray, expected),
                                rtol=1e-5, atol=1e-6)
    # The FFN of layer 1 runs on IPU 2: its weights are stage 2's.
    stages = pipe.report.to_dict()["stages"]
    self.assertEqual([s["ipu"] for s in stages], [0, 1, 2, 3, 0])

  def test_placement_layout(self):
    # MLPerf v1.1 POD16 (configs/mk2/pod16-closed.json).
    assignment, mapping = bert.placement_layout(
        [[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], [0, [4, 5]]], 24)
    self.assertEqual(mapping, [0, 1, 2, 3, 0])
    self.assertEqual(assignment["embeddings"], 0)
    self.assertEqual(assignment["layers_6/attention_block"], 1)
    self.assertEqual(assignment["layers_6/ffn_block"], 2)
    self.assertEqual(assignment["layers_19/attention_block"], 3)
    self.assertEqual(assignment["layers_19/ffn_block"], 4)
    self.assertEqual({assignment[k] for k in ("pooler", "mlm_head", "nsp_head")}, {4})
    # The last stage off IPU 0: the heads get a stage of their own on IPU 0.
    _, mapping = bert.placement_layout([[1, [2, 1]], [2, [2, 3]]], 4)
    self.assertEqual(mapping, [0, 1, 2, 0])


# The heads' stage on IPU 0 with the last two layers (att_ffn_placement).
_LAST_TWO_ON_IPU0 = [[1, [1, 1]], [2, [1, 1]], [0, [2, 2]]]


def _popart_pipeline(mode: str):
  """The small BERT laid out as ``_LAST_TWO_ON_IPU0`` with Graphcore's MLPerf
  checkpoints, its last stage recomputed as ``mode`` says."""
  attention = bert.popart_checkpoints(_LAST_TWO_ON_IPU0, _MODEL.layers)
  model = bert.Bert(dataclasses.replace(_MODEL, attention_checkpoints=attention,
                                        head_checkpoints=True), rngs=nnx.Rngs(0))
  loss_fn, params = bert.make_loss(model)
  assignment, mapping = bert.placement_layout(_LAST_TWO_ON_IPU0, _MODEL.layers)
  cfg = _config("Sequential", 2)
  cfg.auto_select_ipus = 3
  cfg.matmuls.available_memory_proportion = 0.25
  cfg.pipelining.last_stage_recomputation = mode
  # Two layers and the heads overfill IPU 0's 16 tiles: the peaks are compared, not checked.
  cfg.memory.allow_out_of_memory = True
  pipe = ipu_jax.pipelining.Pipeline(loss_fn, _LAMB, config=cfg,
                                     device_mapping=mapping, stage_assignment=assignment)
  return pipe, loss_fn, params


class PopartLastStageTest(chex.TestCase):
  """Graphcore's MLPerf checkpoints, the last stage recomputed between them (PopART)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.data = _data(2)[:1]
    cls.pipes = {}
    for mode in ("none", "checkpoints"):
      # A tuple: a function stored on the class would be bound to the test.
      pipe, *cls.model = _popart_pipeline(mode)
      pipe.lower(cls.model[1], cls.data[0])
      cls.pipes[mode] = pipe

  def test_popart_checkpoints_are_the_last_stages_attention_blocks(self):
    self.assertEqual(bert.popart_checkpoints(_LAST_TWO_ON_IPU0, 4), (2, 3))
    # MLPerf v1.1 POD16: attention 20-23 on the last stage (configs/mk2/pod16-closed.json).
    self.assertEqual(bert.popart_checkpoints(
        [[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], [0, [4, 5]]], 24), (20, 21, 22, 23))
    # The heads on a stage of their own: no attention block there.
    self.assertEqual(bert.popart_checkpoints([[1, [2, 1]], [2, [2, 3]]], 4), ())
    with self.assertRaisesRegex(ValueError, "BertConfig.attention_checkpoints"):
      bert.BertConfig(layers=4, attention_checkpoints=(4,))

  def test_weights_equal_plain_accumulation(self):
    pipe, (loss_fn, params) = self.pipes["checkpoints"], self.model
    state = pipe.init(params, self.data[0])
    trained = pipe.step(params, state, self.data[0]).params
    expected = bert_pretraining.plain_steps(loss_fn, _LAMB, params, self.data)
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, trained),
                                jax.tree_util.tree_map(np.asarray, expected),
                                rtol=1e-5, atol=1e-6)

  def test_last_stage_recomputed_with_a_lower_peak(self):
    none, checkpoints = self.pipes["none"].stages[-1], self.pipes["checkpoints"].stages[-1]
    self.assertEqual(none.recompute_cycles, 0.0)
    self.assertGreater(checkpoints.recompute_cycles, 0.0)
    self.assertLess(checkpoints.backward.profile.memory.peak.max(),
                    none.backward.profile.memory.peak.max())
    # The other stages are recomputed alike under either rule.
    for a, b in zip(self.pipes["none"].stages[:-1], self.pipes["checkpoints"].stages[:-1]):
      self.assertEqual(a.recompute_cycles, b.recompute_cycles)


class BertLayoutTest(chex.TestCase, parameterized.TestCase):

  def test_bert_large_layout(self):
    assignment, mapping = bert.layout([3, 7, 7, 7])
    self.assertEqual(mapping, [0, 1, 2, 3, 0])
    self.assertEqual(assignment["layers_2"], 0)
    self.assertEqual(assignment["layers_3"], 1)
    self.assertEqual(assignment["layers_23"], 3)
    self.assertEqual({assignment[k] for k in ("pooler", "mlm_head", "nsp_head")}, {4})

  @parameterized.parameters([[]], [[1, 0, 2]], [[-1, 2]])
  def test_bad_layout(self, layers_per_ipu):
    with self.assertRaisesRegex(ValueError, "layers_per_ipu"):
      bert.layout(layers_per_ipu)

  @parameterized.named_parameters(
      ("not_pairs", [[1, 7]], "att_ffn_placement must list stages"),
      ("empty_stage", [[1, [4, 4]], [2, [0, 0]]], "stage 2 \\(IPU 2\\) holds no block"),
      ("counts", [[1, [3, 4]]], "places 3 attention and 4 feed-forward"),
      ("ffn_first", [[1, [1, 2]], [2, [3, 2]]], "feed-forward block 1 before"),
      ("ipus", [[2, [4, 4]]], "uses IPUs \\[0, 2\\]"),
  )
  def test_bad_placement(self, placement, message):
    with self.assertRaisesRegex(ValueError, message):
      bert.placement_layout(placement, 4)

  def test_sizes(self):
    large, base = bert.bert_large(), bert.bert_base()
    self.assertEqual((large.layers, large.hidden, large.heads, large.ffn, large.vocab_size),
                     (24, 1024, 16, 4096, 30522))
    self.assertEqual((base.layers, base.hidden, base.heads, base.ffn), (12, 768, 12, 3072))
    with self.assertRaisesRegex(ValueError, "BertConfig.heads"):
      bert.BertConfig(hidden=100, heads=16)

  def test_serialised_decoder_equals_plain(self):
    """Loss and gradients with the decoder serialised by 2 equal the plain model's."""
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 64  # the whole model on one IPU
    batch = jax.tree_util.tree_map(lambda b: b[0], _data(1)[0])
    results = []
    for factor in (1, 2):
      model = bert.Bert(dataclasses.replace(_MODEL, layers=1, decoder_serialization=factor),
                        rngs=nnx.Rngs(0))
      loss_fn, params = bert.make_loss(model)
      results.append(ipu_jax.jit(jax.value_and_grad(loss_fn), config=cfg)(params, batch))
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, results[1]),
                                jax.tree_util.tree_map(np.asarray, results[0]),
                                rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
