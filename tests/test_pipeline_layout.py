"""Stages on IPUs: several stages on one IPU, tied weights, per-IPU memory, efficiency."""

import json
import os
import tempfile

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.ops import pipeline_stage
from ipu_jax.pipelining import Pipeline, PipelineError, schedule
from testing_utils import chain_data

_TILES = 16
_VOCAB, _WIDTH, _ROWS = 11, 8, 5


def _config(ipus, g, schedule_name="Grouped", version="ipu2"):
  cfg = ipu_jax.IPUConfig()
  cfg.device.version = version
  cfg.device.tiles_per_ipu = _TILES
  cfg.auto_select_ipus = ipus
  cfg.training.gradient_accumulation_steps = g
  cfg.pipelining.schedule = schedule_name
  return cfg


def _tied_loss(params, batch):
  """Embedding on stage 0, a layer on stage 1, and on stage 2 the output
  projection tied to the embedding (its transpose), as BERT's MLM decoder."""
  embedding = params["embed"]["embedding"]
  h = jnp.tanh(embedding[batch["tokens"]] @ params["l0"])
  h = pipeline_stage(h, 1)
  h = jnp.tanh(h @ params["l1"])
  h = pipeline_stage(h, 2)
  logits = h @ embedding.T + params["head"]["bias"]
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]))


def _tied_data(g, seed=0):
  rng = np.random.default_rng(seed)
  params = {"embed": {"embedding": rng.normal(size=(_VOCAB, _WIDTH)) * 0.5},
            "l0": rng.normal(size=(_WIDTH, _WIDTH)) * 0.4,
            "l1": rng.normal(size=(_WIDTH, _WIDTH)) * 0.4,
            "head": {"bias": rng.normal(size=(_VOCAB,)) * 0.1}}
  params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
  batches = {"tokens": jnp.asarray(rng.integers(0, _VOCAB, size=(g, _ROWS)), jnp.int32),
             "labels": jnp.asarray(rng.integers(0, _VOCAB, size=(g, _ROWS)), jnp.int32)}
  return params, batches


def _plain_steps(loss, optimizer, params, batch_steps):
  """Plain JAX: per step, the micro-batches' gradients summed, then one update."""
  grad = jax.jit(jax.grad(loss))
  state = optimizer.init(params)
  for batches in batch_steps:
    count = len(jax.tree_util.tree_leaves(batches)[0])
    acc = jax.tree_util.tree_map(jnp.zeros_like, params)
    for m in range(count):
      g = grad(params, jax.tree_util.tree_map(lambda b: b[m], batches))
      acc = jax.tree_util.tree_map(jnp.add, acc, g)
    updates, state = optimizer.update(acc, state, params)
    params = optax.apply_updates(params, updates)
  return params


def _chain_loss(params, batch):
  """One tanh layer per stage."""
  h = batch["x"]
  for k, w in enumerate(params):
    if k:
      h = pipeline_stage(h, k)
    h = jnp.tanh(h @ w)
  return jnp.mean((h - batch["y"]) ** 2)


class TiedWeightsTest(parameterized.TestCase):
  """A weight read by stages on one IPU is updated once from their summed gradients."""

  @parameterized.named_parameters(
      ("grouped_sgd", "Grouped", 6, "sgd"), ("grouped_adam", "Grouped", 6, "adam"),
      ("sequential_sgd", "Sequential", 4, "sgd"), ("sequential_adam", "Sequential", 4, "adam"))
  def test_weights_after_two_steps_equal_plain_accumulation(self, name, g, opt):
    optimizer = {"sgd": optax.sgd(0.1), "adam": optax.adam(0.01)}[opt]
    params, _ = _tied_data(g)
    steps = [_tied_data(g, seed=s)[1] for s in (1, 2)]
    pipe = Pipeline(_tied_loss, optimizer, config=_config(2, g, name),
                    device_mapping=[0, 1, 0])
    state = pipe.init(params, steps[0])
    got = params
    for batches in steps:
      out = pipe.step(got, state, batches)
      got, state, loss = out.params, out.opt_state, out.loss
      self.assertTrue(np.isfinite(np.asarray(loss)))
    expected = _plain_steps(_tied_loss, optimizer, params, steps)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    # The tied weight is read by stages 0 and 2 and owned (updated) by stage 0 only.
    names = pipe.staged.param_names
    tied = names.index("['embed']['embedding']")
    self.assertEqual([tied in s.params for s in pipe.staged.stages], [True, False, True])
    self.assertEqual([tied in s.owned for s in pipe.staged.stages], [True, False, False])
    # Its optimizer state lives once: the stages' states cover each weight once.
    owned = sorted(i for s in pipe.staged.stages for i in s.owned)
    self.assertEqual(owned, list(range(len(names))))
    if opt == "adam":
      mus = [len(s[0].mu) for s in state]
      self.assertEqual(mus, [len(s.owned) for s in pipe.staged.stages])
      self.assertEqual(sum(mus), 4)

  def test_gradients_sum_both_stages_contributions(self):
    g = 6
    params, batches = _tied_data(g)
    pipe = Pipeline(_tied_loss, config=_config(2, g), device_mapping=[0, 1, 0])
    grads, _ = pipe.gradients(params, batches)
    acc = jax.tree_util.tree_map(jnp.zeros_like, params)
    grad = jax.jit(jax.grad(_tied_loss))
    for m in range(g):
      acc = jax.tree_util.tree_map(
          jnp.add, acc, grad(params, jax.tree_util.tree_map(lambda b: b[m], batches)))
    chex.assert_trees_all_close(grads, acc, rtol=1e-5, atol=1e-6)

  def test_tied_across_ipus_raises_before_anything_runs(self):
    g = 6
    params, batches = _tied_data(g)
    pipe = Pipeline(_tied_loss, optax.sgd(0.1), config=_config(3, g))
    with self.assertRaisesRegex(
        PipelineError, r"Weight params\['embed'\]\['embedding'\] is read by stage 0 \(IPU 0, "
        r"at .*test_pipeline_layout.py:\d+\) and by stage 2 \(IPU 2, at "
        r".*test_pipeline_layout.py:\d+\).*same IPU"):
      pipe.init(params, batches)
    self.assertEqual(pipe.stages, [])  # nothing was lowered
    self.assertIsNone(pipe.timeline)
    with self.assertRaisesRegex(PipelineError, r"stage 2 \(IPU 1"):
      Pipeline(_tied_loss, config=_config(2, g), device_mapping=[0, 0, 1]).lower(
          params, batches)


class DeviceMappingTest(parameterized.TestCase):

  def test_five_stages_on_four_ipus_grouped_needs_g_multiple_of_ten(self):
    params, batches = chain_data(5, 8)
    with self.assertRaisesRegex(PipelineError, "gradient_accumulation_steps=8 .*multiple of "
                                r"10 \(2 x stages\)"):
      Pipeline(_chain_loss, config=_config(4, 8), device_mapping=[0, 1, 2, 3, 0]).lower(
          params, batches)
    params, batches = chain_data(5, 10)
    pipe = Pipeline(_chain_loss, config=_config(4, 10), device_mapping=[0, 1, 2, 3, 0])
    grads, _ = pipe.gradients(params, batches)
    grad = jax.jit(jax.grad(_chain_loss))
    acc = jax.tree_util.tree_map(jnp.zeros_like, params)
    for m in range(10):
      acc = jax.tree_util.tree_map(
          jnp.add, acc, grad(params, jax.tree_util.tree_map(lambda b: b[m], batches)))
    chex.assert_trees_all_close(grads, acc, rtol=1e-5, atol=1e-6)
    self.assertEqual([s.ipu for s in pipe.stages], [0, 1, 2, 3, 0])
    self.assertEqual(pipe.report.memory_per_ipu()[0]["stages"], [0, 4])

  def test_interleaved_refuses_stages_sharing_an_ipu(self):
    params, batches = chain_data(3, 6)
    with self.assertRaisesRegex(
        PipelineError, "The Interleaved schedule does not currently support multiple pipeline "
        r"stages on the same device \(TF-IPU's rule\).*stages 0, 2 on IPU 0"):
      Pipeline(_chain_loss, config=_config(2, 6, "Interleaved"),
               device_mapping=[0, 1, 0]).lower(params, batches)

  @parameterized.parameters(((0, 1, 4), 2, "is out of range"), ((0, -1, 1), 1, "is out of range"),
                            ((0, 1.0, 1), 1, "is not an IPU number"))
  def test_mapping_entry_outside_the_target(self, mapping, bad, what):
    params, batches = chain_data(3, 6)
    with self.assertRaisesRegex(
        PipelineError, rf"device_mapping\[{bad}\]={mapping[bad]!r} {what}: stage {bad} .*IPU "
        r"of the replica, valid range 0\.\.3 \(auto_select_ipus=4\)"):
      Pipeline(_chain_loss, config=_config(4, 6), device_mapping=mapping).lower(
          params, batches)

  @parameterized.parameters(3, "010")
  def test_mapping_that_is_not_a_sequence_of_ipus(self, mapping):
    params, batches = chain_data(3, 6)
    with self.assertRaisesRegex(PipelineError, "device_mapping must be a sequence with the IPU "
                                f"of each stage, e.g. .*; got {mapping!r}"):
      Pipeline(_chain_loss, config=_config(2, 6), device_mapping=mapping).lower(params, batches)

  def test_more_stages_than_ipus_without_mapping_suggests_one(self):
    params, batches = chain_data(3, 6)
    with self.assertRaisesRegex(PipelineError, "3 pipeline stages but each replica has only 2 "
                                "IPUs .*give a device_mapping"):
      Pipeline(_chain_loss, config=_config(2, 6)).lower(params, batches)

  def test_keras_options_take_and_check_a_device_mapping(self):
    from ipu_jax.keras import pipelining
    options = pipelining.merged_options(None, device_mapping=[0, 1, 2, 3, 0])
    self.assertEqual(options["device_mapping"], (0, 1, 2, 3, 0))
    with self.assertRaisesRegex(ValueError, r"device_mapping\[1\]=-1 is not an IPU number"):
      pipelining.set_pipelining_options(object(), device_mapping=[0, -1])
    with self.assertRaisesRegex(ValueError, "device_mapping must be a sequence"):
      pipelining.set_pipelining_options(object(), device_mapping=3)


class SharedIPUOutOfMemoryTest(parameterized.TestCase):

  def test_stages_that_fit_alone_overflow_their_shared_ipu(self):
    # Width 320 on 16 tiles of 256 KiB (ipu1): each stage's programs peak at
    # ~231 KB a tile, so one stage per IPU fits; stages 0 and 2 on IPU 0 need
    # one's largest program beside the other's weights and accumulators (~282 KB).
    params, batches = chain_data(3, 2, width=320)
    fits = Pipeline(_chain_loss, optax.adam(0.1), config=_config(3, 2, "Sequential", "ipu1"))
    fits.lower(params, batches)
    limit = fits.target.bytes_per_tile
    self.assertLess(max(int(s.peak_bytes.max()) for s in fits.stages), limit)
    shared = Pipeline(_chain_loss, optax.adam(0.1), config=_config(2, 2, "Sequential", "ipu1"),
                      device_mapping=[0, 1, 0])
    with self.assertRaisesRegex(
        OutOfMemoryError, r"Out of memory on IPU 0 \(pipeline stages 0, 2\), tile \d+: it needs "
        rf"[\d,]+ bytes but has {limit:,d} .*stage [02]'s (forward|backward|update) program "
        r"peaks at [\d,]+ B, the weights and gradient accumulators held beside it take "
        r"[\d,]+ B"):
      shared.lower(params, batches)


class KerasDeviceMappingTest(chex.TestCase):

  def test_fit_with_two_stages_on_one_ipu_equals_plain_accumulation(self):
    from flax import nnx
    import testing_utils
    from ipu_jax.keras import Model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=32).astype(np.int32)
    model = Model(testing_utils.TwoLayerMLP((6, 8, 3), rngs=nnx.Rngs(0)), config=_config(1, 1))
    model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy",
                  steps_per_execution=4)
    model.set_pipelining_options(schedule="Grouped", gradient_accumulation_steps_per_replica=4,
                                 device_mapping=[0, 0])
    model.set_pipeline_stage_assignment({"second": 1})
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False)

    graphdef, params = nnx.split(testing_utils.TwoLayerMLP((6, 8, 3), rngs=nnx.Rngs(0)),
                                 nnx.Param)

    def loss(p, batch):
      logits = nnx.merge(graphdef, p)(batch["x"])
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

    batches = {"x": x.reshape(4, 8, 6), "y": y.reshape(4, 8)}
    expected = _plain_steps(loss, optax.sgd(0.1), params, [batches])
    chex.assert_trees_all_close(nnx.state(model.module, nnx.Param), expected,
                                rtol=1e-5, atol=1e-6)
    self.assertEqual([s.ipu for s in model.pipeline.stages], [0, 0])
    self.assertEqual(model.pipeline.report.memory_per_ipu()[0]["stages"], [0, 1])


class SharedIPUScheduleTest(parameterized.TestCase):
  """The simulated step with several stages on one IPU."""

  def test_passes_on_one_ipu_in_one_slot_add_up(self):
    n, g = 3, 6
    fwd, bwd = [1.0, 10.0, 4.0], [2.0, 20.0, 8.0]
    slots = schedule.slots("Grouped", n, g)
    tl = schedule.simulate(slots, [0, 1, 0], fwd, bwd, [[]] * n, [[]] * n, 0.0,
                           [3.0, 0.0, 5.0], [0.0] * n, lambda copies: 0.0)
    np.testing.assert_allclose(tl.busy_cycles, [g * (1 + 2 + 4 + 8) + 3 + 5, g * 30.0])
    # A slot holding passes of stages 0 and 2 runs them one after another on IPU 0.
    shared = 0
    for slot in slots:
      on_zero = {(p.stage, p.kind, p.micro_batch) for p in slot if p.stage != 1}
      if len(on_zero) < 2:
        continue
      shared += 1
      spans = sorted((s for s in tl.spans if len(s) > 6 and (s[6], s[2], s[3]) in on_zero),
                     key=lambda s: s[4])
      self.assertLen(spans, len(on_zero))
      self.assertEqual({s[0] for s in spans}, {0})
      for a, b in zip(spans, spans[1:]):
        self.assertEqual(a[4] + a[5], b[4])  # back to back, no overlap
    self.assertGreater(shared, 0)
    # Stages on IPU 0 update one after another, after the last slot.
    updates = sorted((s for s in tl.spans if s[2] == "weight update"), key=lambda s: s[4])
    self.assertEqual([(s[0], s[6]) for s in updates], [(0, 0), (0, 2)])
    self.assertEqual(updates[0][4] + 3.0, updates[1][4])
    self.assertEqual(tl.total_cycles, updates[1][4] + 5.0)

  @parameterized.parameters("Grouped", "Sequential")
  def test_efficiency_counts_the_ipus_used(self, name):
    n, g = 2, 4

    def run(ipus):
      return schedule.simulate(schedule.slots(name, n, g), ipus, [1.0] * n, [2.0] * n,
                               [[]] * n, [[]] * n, 0.0, [0.0] * n, [0.0] * n,
                               lambda copies: 0.0)

    low, high = run([0, 1]), run([1, 2])
    self.assertAlmostEqual(high.efficiency, low.efficiency)
    closed = {"Grouped": g / (g + n - 1), "Sequential": 1 / n}[name]
    self.assertAlmostEqual(high.efficiency, closed)
    self.assertEqual(high.ipus, (1, 2))


class SharedIPUMemoryAndReportTest(chex.TestCase):
  """Three stages on two IPUs (stages 0 and 2 on IPU 0), Grouped, G = 6."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.g = 6
    params, batches = _tied_data(cls.g)
    cls.pipe = Pipeline(_tied_loss, optax.adam(0.01), config=_config(2, cls.g),
                        device_mapping=[0, 1, 0]).lower(params, batches)
    cls.params = params

  def test_memory_per_ipu_adds_the_stages_on_it(self):
    pipe = self.pipe
    s0, s1, s2 = pipe.stages
    memory = pipe.report.memory_per_ipu()
    self.assertEqual(sorted(memory), [0, 1])
    self.assertEqual(memory[0]["stages"], [0, 2])
    self.assertEqual(memory[1]["stages"], [1])
    self.assertEqual(memory[0]["stash_depths"], [4, 0])
    self.assertEqual(memory[0]["stash_bytes"],
                     int((s0.stash_depth * s0.stash_bytes + s2.stash_depth * s2.stash_bytes).sum()))
    # What each stage holds for the whole step: the weights it owns, their
    # accumulators and Adam's m and v (stage 0 the tied embedding and l0,
    # stage 2 the bias), and Adam's int32 count, all on chip.
    f32, count = 4, 4
    self.assertEqual(int(s0.held_bytes.sum()),
                     4 * f32 * (_VOCAB * _WIDTH + _WIDTH * _WIDTH) + count)
    self.assertEqual(int(s2.held_bytes.sum()), 4 * f32 * _VOCAB + count)
    self.assertEqual(int(s0.state_bytes.sum()),
                     2 * f32 * (_VOCAB * _WIDTH + _WIDTH * _WIDTH) + count)
    self.assertEqual(s2.weight_bytes, f32 * _VOCAB)  # updates (and all-reduces) only its own

    def programs(s):
      # A stage's forward and backward run beside its state, its forward beside
      # its accumulators too; its update reads both.
      return [s.forward.profile.memory.peak + s.state_bytes + s.accumulator_bytes,
              s.backward.profile.memory.peak + s.state_bytes, s.update.profile.memory.peak]

    # On every tile of IPU 0: the largest program of either stage, beside what
    # the other holds, plus both stashes.
    expected = np.max(np.stack([p + s2.held_bytes for p in programs(s0)] +
                               [p + s0.held_bytes for p in programs(s2)]), axis=0)
    expected = expected + s0.stash_depth * s0.stash_bytes + s2.stash_depth * s2.stash_bytes
    per_tile = pipe.report.memory_per_tile().reshape(2, _TILES)
    np.testing.assert_array_equal(per_tile[0], expected)
    np.testing.assert_array_equal(per_tile[1], s1.peak_bytes)
    alone = np.maximum(s0.peak_bytes, s2.peak_bytes)  # what a per-stage check saw
    self.assertTrue(np.all(per_tile[0] >= alone))
    self.assertGreater(per_tile[0].sum(), alone.sum())
    self.assertEqual(memory[0]["max_tile_bytes"], int(expected.max()))
    # The step's program report shows the same memory, by category.
    report = pipe.report.program_report
    np.testing.assert_array_equal(report.memory_per_tile, pipe.report.memory_per_tile())

  def test_trace_and_report_show_stages_on_their_ipu(self):
    pipe = self.pipe
    with tempfile.TemporaryDirectory() as d:
      pipe.report.save(d, plots=False)
      with open(os.path.join(d, "pipeline_trace.json")) as f:
        events = json.load(f)["traceEvents"]
      with open(os.path.join(d, "pipeline.json")) as f:
        saved = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    self.assertEqual(names, {0: "IPU 0 (stages 0, 2)", 1: "IPU 1 (stage 1)"})
    passes = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    self.assertLen(passes, 3 * self.g * 2)
    by_ipu = {}
    for e in passes:
      by_ipu.setdefault(e["pid"], set()).add(e["args"]["stage"])
      self.assertTrue(e["name"].startswith(f"stage {e['args']['stage']} "))
    self.assertEqual(by_ipu, {0: {0, 2}, 1: {1}})
    self.assertEqual(saved["ipus_used"], [0, 1])
    self.assertEqual(saved["memory_per_ipu"]["0"]["stages"], [0, 2])
    self.assertIn("(stages 0, 2)", json.dumps(names))
    self.assertRegex(pipe.report.summary(), r"\n +0  0, 2 +[\d,]+ +[\d,]+ +[\d,]+")


class PipelineEfficiencyTest(chex.TestCase):

  def test_efficiency_same_on_other_ipus(self):
    # IPUs 2 and 3 are a pair of the ladder as 0 and 1 are, so copies cost the same.
    params, batches = chain_data(2, 4)
    pipes = {mapping: Pipeline(_chain_loss, config=_config(4, 4), device_mapping=mapping).lower(
        params, batches) for mapping in ((0, 1), (2, 3))}
    low, high = pipes[(0, 1)].report, pipes[(2, 3)].report
    self.assertAlmostEqual(high.total_cycles, low.total_cycles, places=6)
    self.assertAlmostEqual(high.efficiency, low.efficiency, places=12)
    self.assertGreater(low.efficiency, 0.5)
    self.assertEqual(high.to_dict()["efficiency"], high.efficiency)
    self.assertEqual(high.ipus, [2, 3])


class SameIPUValuesTest(chex.TestCase):

  def test_values_between_stages_on_one_ipu_use_no_link(self):
    # Stages 0 and 1 on IPU 0, stage 2 on IPU 1: only the boundary 1 -> 2
    # crosses an IPU-Link (activations forward, their gradients back).
    g = 6
    params, batches = chain_data(3, g)
    pipe = Pipeline(_chain_loss, config=_config(2, g), device_mapping=[0, 0, 1])
    pipe.lower(params, batches)
    activations = 8 * 16 * 4
    self.assertEqual(pipe.stages[0].send_bytes, activations)  # still sent, on chip
    self.assertEqual(pipe.copy_cycles(0, "forward"), 0.0)
    self.assertEqual(pipe.timeline.link_bytes, g * 2 * activations)
    slots = [s for s in pipe.report.program_report.profile.steps if s.op == "pipeline slot"]
    self.assertEqual(sum(s.ipu_link_bytes for s in slots), g * 2 * activations)


def _state_config(offload, replicas=1, allow_out_of_memory=False):
  """Two stages on two ipu2 IPUs of 16 tiles; Adam's state on chip or offloaded,
  sharded over the replicas when there are several."""
  cfg = _config(2, 2, "Sequential")
  cfg.replication_factor = replicas
  cfg.streaming.offload_optimizer_state = offload
  cfg.streaming.replicated_tensor_sharding = replicas > 1
  cfg.memory.allow_out_of_memory = allow_out_of_memory
  return cfg


def _state_tile_bytes(update):
  """``[tiles]`` bytes of the update program's state arguments on the tiles
  their mappings give (none for those in streaming memory)."""
  out = np.zeros(_TILES, np.int64)
  for tensor in update.inputs:
    if tensor.name.startswith("state") and tensor.mapping is not None:
      np.add.at(out, tensor.mapping.tiles, tensor.mapping.counts * tensor.itemsize)
  return out


class OnChipOptimizerStateTest(chex.TestCase):
  """Optimizer state kept on chip is held on its IPU for the whole step."""

  @parameterized.named_parameters(("unsharded", 1), ("sharded_over_two_replicas", 2))
  def test_peak_beside_forward_and_backward_grows_by_the_state(self, replicas):
    # 128 rows of width 256: the backward program peaks over the update on
    # the tiles compared (asserted), so the state beside it shows.
    params, batches = chain_data(2, 2 * replicas, width=256, rows=128)
    pipes = [Pipeline(_chain_loss, optax.adam(0.01),
                      config=_state_config(offload, replicas, True)).lower(params, batches)
             for offload in (False, True)]
    on_chip, offloaded = pipes
    compared = 0
    for ipu in (0, 1):
      memory = [p.report.ipu_memory[ipu] for p in pipes]
      kinds = [np.array([k for _, k, _ in m.programs])[m.chosen] for m in memory]
      steady = (kinds[0] != "update") & (kinds[1] != "update")
      stage = [p.stages[ipu] for p in pipes]
      for kind in ("forward", "backward"):  # the same programs either way
        np.testing.assert_array_equal(getattr(stage[0], kind).profile.memory.peak,
                                      getattr(stage[1], kind).profile.memory.peak)
      # On chip Adam's m and v (and its count, on chip either way) are held.
      state = _state_tile_bytes(stage[0].update) - _state_tile_bytes(stage[1].update)
      per_tile = [p.report.memory_per_tile().reshape(2, _TILES)[ipu] for p in pipes]
      np.testing.assert_array_equal((per_tile[0] - per_tile[1])[steady], state[steady])
      compared += int(state[steady].sum())
    # Every tile compared: m and v of both [256, 256] weights, a copy's shard of them.
    self.assertEqual(compared, 2 * 2 * 4 * 256 * 256 // replicas)
    self.assertIn("optimizer state held on chip beside it takes",
                  on_chip.report.ipu_memory[1].describe_tile(0))

  def test_on_chip_state_beside_the_backward_overflows_offloaded_fits(self):
    # Width 512, 128 rows: each stage's backward peaks ~526 KB a tile and its
    # update ~591 KB, both under the 638,976 B of an ipu2 tile; Adam's m and v
    # (131,072 B a tile) held beside the last stage's backward do not fit.
    params, batches = chain_data(2, 2, width=512, rows=128)
    on_chip = Pipeline(_chain_loss, optax.adam(0.01), config=_state_config(False))
    limit = 638976
    with self.assertRaisesRegex(
        OutOfMemoryError, rf"Out of memory on IPU 1 \(pipeline stage 1\), tile \d+: it needs "
        rf"[\d,]+ bytes but has {limit:,d} .*stage 1's backward program peaks at [\d,]+ B, "
        r"the weights and gradient accumulators held beside it take 0 B, the optimizer state "
        r"held on chip beside it takes 131,07\d B \(stage 1: 131,07\d B\).*"
        r"streaming.offload_optimizer_state = True"):
      on_chip.lower(params, batches)
    offloaded = Pipeline(_chain_loss, optax.adam(0.01), config=_state_config(True))
    offloaded.lower(params, batches)
    self.assertLessEqual(int(offloaded.report.memory_per_tile().max()), limit)



class AccumulatorsBesideForwardTest(chex.TestCase):
  """A stage's gradient accumulators are live beside its own forward program."""

  def test_forward_program_is_counted_with_its_stages_accumulators(self):
    params, batches = chain_data(2, 2, width=128, rows=32)
    pipe = Pipeline(_chain_loss, optax.sgd(0.01), config=_state_config(True)).lower(
        params, batches)
    for ipu in (0, 1):
      stage, memory = pipe.stages[ipu], pipe.report.ipu_memory[ipu]
      # The [128, 128] float32 weight's accumulator, as the backward program maps it.
      count = len(pipe.staged.stages[ipu].params)
      acc = np.zeros(_TILES, np.int64)
      for t in stage.backward.inputs[-count:]:
        np.add.at(acc, t.mapping.tiles, t.mapping.counts * t.itemsize)
      self.assertEqual(int(acc.sum()), 128 * 128 * 4)
      kinds = [k for _, k, _ in memory.programs]
      # One stage an IPU: beside its forward only its own accumulators;
      # beside its backward (which reads them) nothing.
      np.testing.assert_array_equal(memory.others_held[kinds.index("forward")], acc)
      np.testing.assert_array_equal(memory.others_held[kinds.index("backward")], 0)
      forward = np.asarray(stage.forward.profile.memory.peak) + acc
      self.assertTrue(np.all(memory.program_peak >= forward))
      self.assertTrue(np.all(stage.peak_bytes >= forward + stage.stash_depth * stage.stash_bytes))


if __name__ == "__main__":
  absltest.main()
