"""Models across IPUs: stage marks, schedules, pipelined training, reports."""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest, parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ipu_jax
from ipu_jax.lowering import plan_cache
from ipu_jax.ops import pipeline_stage
from ipu_jax.pipelining import Pipeline, PipelineError, links, schedule, stage_programs
import testing_utils

_TILES = 16


def _config(stages=4, g=8, schedule_name="Grouped", recompute=False, replicas=1, tiles=_TILES):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.auto_select_ipus = stages
  cfg.replication_factor = replicas
  cfg.training.gradient_accumulation_steps = g
  cfg.pipelining.schedule = schedule_name
  cfg.pipelining.recomputation = recompute
  return cfg


def _loss(params, batch):
  """A stack of equal layers, one stage each; the recomputation checkpoint
  keeps the middle activation of each layer. An integer value made on stage 0
  crosses to the last stage (it carries no gradient)."""
  shift = jnp.argmax(batch["x"], axis=-1)
  h = testing_utils.chain_layers(params, batch["x"])
  picked = jnp.take_along_axis(h, shift[:, None], axis=1)
  return jnp.mean((h - batch["y"]) ** 2) + 0.01 * jnp.mean(picked)


def _data(stages=4, g=8, width=32, rows=16, seed=0):
  return testing_utils.chain_data(stages, g, width=width, rows=rows, seed=seed, scale=0.2)


def _plain_gradients(loss, params, batches, count):
  return testing_utils.accumulated_gradients(loss, params, batches, count)[0]


class StageMarkTest(chex.TestCase):

  def test_survives_grad_and_runs_on_tiles(self):
    params, batches = _data(stages=2, g=1, width=5, rows=3)
    batch = jax.tree_util.tree_map(lambda b: b[0], batches)
    expected = jax.jit(jax.grad(_loss))(params, batch)
    jaxpr = jax.make_jaxpr(jax.grad(_loss))(params, batch)
    marks = [e.params for e in jaxpr.jaxpr.eqns if e.primitive.name == "pipeline_stage"]
    self.assertEqual(marks, [{"stage": 1, "backward": False}, {"stage": 1, "backward": True}])
    got = ipu_jax.jit(jax.grad(_loss), config=_config(stages=1, g=1))(params, batch)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    self.assertEqual(jax.vmap(lambda x: pipeline_stage(x, 1))(jnp.ones((2, 3))).shape, (2, 3))

  def test_bad_stage_id(self):
    with self.assertRaisesRegex(ValueError, "stage must be an int >= 1"):
      pipeline_stage(jnp.ones(2), 0)


class StageAssignmentTest(chex.TestCase):
  """Stages by module path (Keras-on-IPU's set_pipeline_stage_assignment)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import flax.linen as nn

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        for _ in range(3):
          x = jnp.tanh(nn.Dense(5)(x))
        return x

    model = Model()
    cls.params = jax.jit(model.init)(jax.random.key(0), jnp.ones((3, 5)))
    cls.batch = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5)), jnp.float32)
    cls.loss = staticmethod(lambda p, x: jnp.sum(model.apply(p, x) ** 2))

  def test_stages_compute_the_loss(self):
    staged = ipu_jax.pipelining.split_stages(self.loss, self.params, self.batch,
                                             {"Dense_1": 1, "Dense_2": 2})
    names = [[staged.param_names[i] for i in s.params] for s in staged.stages]
    self.assertEqual([[n.split("'")[-2] for n in group] for group in names],
                     [["bias", "kernel"]] * 3)
    self.assertIn("Dense_2", names[2][0])
    flat = jax.tree_util.tree_leaves(self.params)

    @jax.jit
    def staged_loss(flat, batch):
      values = {}
      for s in staged.stages:
        outs = s([flat[i] for i in s.params], [batch], [values[v] for v in s.inputs])
        values.update(zip(s.outputs, outs))
      return values[staged.loss_var]

    np.testing.assert_allclose(staged_loss(flat, self.batch),
                               jax.jit(self.loss)(self.params, self.batch), rtol=1e-6)

  def test_skip_connection_goes_straight_to_its_reader(self):
    def loss(params, batch):
      skip = jnp.tanh(batch @ params[0])
      h = pipeline_stage(skip, 1) @ params[1]
      h = pipeline_stage(h, 2) @ params[2]
      return jnp.sum(h + skip)
    params = [jnp.ones((5, 5))] * 3
    staged = ipu_jax.pipelining.split_stages(loss, params, self.batch)
    self.assertEqual([staged.producer(v) for v in staged.stages[2].inputs], [1, 0])
    self.assertLen(staged.stages[0].outputs, 1)

  def test_layer_reading_only_an_earlier_stage_value_trains(self):
    # Layer c (stage 2) scales by sin of a stage-0 value alone, as a BERT layer
    # converting the embeddings' attention mask does: the value goes straight
    # from stage 0 to stage 2 and its gradient straight back.
    import flax.linen as nn

    class Last(nn.Module):
      @nn.compact
      def __call__(self, h, m):
        return jnp.tanh(nn.Dense(8)(h)) * jnp.sin(m)

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        h = jnp.tanh(nn.Dense(8, name="b")(jnp.tanh(nn.Dense(8, name="a")(x))))
        return Last(name="c")(h, x * 0.5)

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((4, 8)))
    rng = np.random.default_rng(2)
    batches = {k: jnp.asarray(rng.normal(size=(6, 4, 8)), jnp.float32) for k in ("x", "y")}
    loss = lambda p, b: jnp.mean((model.apply(p, b["x"]) - b["y"]) ** 2)
    micro = jax.tree_util.tree_map(lambda b: b[0], batches)
    staged = ipu_jax.pipelining.split_stages(loss, params, micro, {"b": 1, "c": 2})
    self.assertIn(0, [staged.producer(v) for v in staged.stages[2].inputs])
    pipe = Pipeline(loss, optax.sgd(0.1), config=_config(stages=3, g=6),
                    stage_assignment={"b": 1, "c": 2})
    new = pipe.step(params, pipe.init(params, batches), batches).params
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params,
                                      _plain_gradients(loss, params, batches, 6))
    chex.assert_trees_all_close(new, expected, rtol=1e-5, atol=1e-6)

  def test_unknown_module_path(self):
    with self.assertRaisesRegex(PipelineError, r"module path\(s\) \['Dense_9'\] that no "
                                r"operation .* the module paths are: \['Model', "
                                "'Model/Dense_0'"):
      ipu_jax.pipelining.split_stages(self.loss, self.params, self.batch, {"Dense_9": 1})


class ScheduleTest(parameterized.TestCase):

  @parameterized.parameters(2, 4)
  def test_stash_depths_follow_tf_ipu(self, n):
    g = 4 * n
    self.assertEqual(schedule.stash_depths(schedule.slots("Grouped", n, g), n),
                     [2 * (n - 1 - k) for k in range(n)])
    self.assertEqual(schedule.stash_depths(schedule.slots("Interleaved", n, g), n),
                     [n - 1 - k for k in range(n)])
    self.assertEqual(schedule.stash_depths(schedule.slots("Sequential", n, g), n), [0] * n)

  @parameterized.product(sched=("Grouped", "Interleaved", "Sequential"), n=(1, 3, 5),
                         g=(1, 7, 2040))
  def test_stash_depths_count_the_sets_waiting(self, sched, n, g):
    # Replay the schedule: at each forward start, count the earlier micro-batches
    # of that stage whose forward ran and whose backward has not yet run.
    slots = schedule.slots(sched, n, g)
    fwd_at, bwd_at = {}, {}
    for t, slot in enumerate(slots):
      for p in slot:
        (fwd_at if p.kind == "forward" else bwd_at)[(p.stage, p.micro_batch)] = t
    want = []
    for k in range(n):
      starts = sorted((t, m) for (s, m), t in fwd_at.items() if s == k)
      live, most = [], 0
      for t, m in starts:
        live = [mm for mm in live if bwd_at[(k, mm)] >= t]
        most = max(most, len(live))
        live.append(m)
      want.append(most)
    self.assertEqual(schedule.stash_depths(slots, n), want)

  @parameterized.parameters((4, 8), (4, 16), (2, 4))
  def test_balanced_efficiency_closed_forms(self, n, g):
    def run(name):
      return schedule.simulate(schedule.slots(name, n, g), list(range(n)), [1.0] * n,
                               [2.0] * n, [[]] * n, [[]] * n, 0.0, [0.0] * n,
                               [0.0] * n, lambda copies: 0.0)
    self.assertAlmostEqual(run("Grouped").efficiency, g / (g + n - 1))
    self.assertAlmostEqual(run("Grouped").rate_efficiency, g / (g + n - 1))
    self.assertAlmostEqual(run("Sequential").efficiency, 1 / n)
    # Interleaved: one pass per IPU per slot, 2G + 2N - 2 slots.
    self.assertLen(schedule.slots("Interleaved", n, g), 2 * g + 2 * n - 2)
    self.assertLess(run("Interleaved").efficiency, run("Grouped").efficiency)

  @parameterized.parameters(*[(name, ipus) for name in schedule.SCHEDULES
                              for ipus in ([0, 1, 2, 3], [0, 1, 2, 0])])
  def test_slot_copies_priced_once_per_composition(self, name, ipus):
    # A step's slots repeat a few (stage, kind) compositions; the copies of
    # each are priced once, and every figure is the slot-by-slot one.
    n, g = len(ipus), 2 * schedule.minimum_accumulation(name, len(ipus))
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    fwd, bwd = [1.5e4, 2.5e4, 2.0e4, 3.0e3], [3.1e4, 4.9e4, 4.2e4, 7.0e3]
    copies_f = [[(ipus[k], ipus[(k + 1) % n], 1000 * (k + 1))] for k in range(n)]
    copies_b = [[(ipus[k], ipus[k - 1], 700 * (k + 1))] for k in range(n)]
    priced = []

    def copy_cost(copies):
      priced.append(tuple(copies))
      return links.slot_copy_cycles(target, copies)

    slots = schedule.slots(name, n, g)
    timeline = schedule.simulate(slots, ipus, fwd, bwd, copies_f, copies_b, 100.0,
                                 [0.0] * n, [0.0] * n, copy_cost)
    compositions = {tuple((p.stage, p.kind) for p in slot) for slot in slots}
    self.assertLen(priced, len(compositions))
    self.assertLen(set(priced), len(priced))
    # The slots as a plain list (what schedule.slots found of them found afresh).
    plain = schedule.simulate([list(slot) for slot in slots], ipus, fwd, bwd, copies_f,
                              copies_b, 100.0, [0.0] * n, [0.0] * n,
                              lambda copies: links.slot_copy_cycles(target, copies))
    self.assertEqual((plain.spans, plain.total_cycles, plain.num_micro_batches),
                     (timeline.spans, timeline.total_cycles, timeline.num_micro_batches))
    np.testing.assert_array_equal(plain.busy_cycles, timeline.busy_cycles)
    # The same step laid out slot by slot.
    now, busy, starts = 0.0, np.zeros(max(ipus) + 1), []
    for slot in slots:
      work = np.zeros(max(ipus) + 1)
      copies = []
      for p in slot:
        starts.append(now + work[ipus[p.stage]])
        work[ipus[p.stage]] += (fwd if p.kind == "forward" else bwd)[p.stage]
        copies += (copies_f if p.kind == "forward" else copies_b)[p.stage]
      busy += work
      now += work.max() + links.slot_copy_cycles(target, copies) + 100.0
    self.assertEqual(timeline.total_cycles, now)
    np.testing.assert_array_equal(timeline.busy_cycles, busy)
    self.assertEqual([s[4] for s in timeline.spans if s[2] in ("forward", "backward")], starts)
    totals = schedule.simulate(slots, ipus, fwd, bwd, copies_f, copies_b, 100.0, [0.0] * n,
                               [0.0] * n, copy_cost, with_spans=False)
    self.assertEqual(totals.spans, [])
    self.assertEqual(dataclasses.replace(totals, spans=timeline.spans, busy_cycles=None),
                     dataclasses.replace(timeline, busy_cycles=None))


class PipelinedTrainingTest(chex.TestCase):
  """A 2-stage model, pipelined (Grouped, G=4) with and without recomputation."""

  STAGES, G, SCHEDULE = 2, 4, "Grouped"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.batches = _data(stages=cls.STAGES, g=cls.G)
    cls.pipes = {}
    for recompute in (False, True):
      pipe = Pipeline(_loss, optax.sgd(0.05), config=_config(
          stages=cls.STAGES, g=cls.G, schedule_name=cls.SCHEDULE, recompute=recompute))
      state = pipe.init(cls.params, cls.batches)
      cls.pipes[recompute] = (pipe, pipe.step(cls.params, state, cls.batches))
    cls.plain = _plain_gradients(_loss, cls.params, cls.batches, cls.G)

  @parameterized.parameters(False, True)
  def test_weights_equal_plain_accumulation(self, recompute):
    _, out = self.pipes[recompute]
    new_params, loss = out.params, out.loss
    grads = self.plain
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, self.params, grads)
    chex.assert_trees_all_close(new_params, expected, rtol=1e-5, atol=1e-6)
    losses = [jax.jit(_loss)(self.params, jax.tree_util.tree_map(lambda b: b[m], self.batches))
              for m in range(self.G)]
    np.testing.assert_allclose(loss, np.mean(losses), rtol=1e-5)

  def test_each_stage_on_its_own_ipu(self):
    pipe, _ = self.pipes[False]
    n = self.STAGES
    self.assertEqual([s.ipu for s in pipe.stages], list(range(n)))
    for s in pipe.stages:
      self.assertEqual(s.forward.target.num_tiles, _TILES)
      self.assertEqual(len(s.peak_bytes), _TILES)
    per_tile = pipe.report.memory_per_tile()
    self.assertEqual(per_tile.shape, (n * _TILES,))
    self.assertTrue(np.all(per_tile.reshape(n, _TILES).max(axis=1) > 0))

  def test_stash_and_efficiency(self):
    pipe, _ = self.pipes[False]
    n, g = self.STAGES, self.G
    factor = {"Grouped": 2, "Interleaved": 1, "Sequential": 0}[self.SCHEDULE]
    self.assertEqual([s.stash_depth for s in pipe.stages],
                     [factor * (n - 1 - k) for k in range(n)])
    memory = pipe.report.memory_per_ipu()
    self.assertGreater(memory[0]["stash_bytes"], 0)
    self.assertEqual(memory[n - 1]["stash_bytes"], 0)
    if self.SCHEDULE == "Grouped":
      # The first stage computes no input gradient and the last also the
      # loss, so these stages are not balanced: the ramps cost less than
      # steady slots of the slowest stage and the rate beats the balanced
      # closed form (matched exactly on balanced costs in ScheduleTest),
      # less the copies and syncs.
      closed = g / (g + n - 1)
      self.assertBetween(pipe.timeline.rate_efficiency, 0.95 * closed, 1.0)
    # Activations forward and gradients back, per micro-batch and boundary;
    # the integer indices made on stage 0 go to the last stage, forward only.
    activations = 16 * 32 * 4
    last = pipe.staged.stages[-1]
    ints = [v for v in last.inputs if not np.issubdtype(v.aval.dtype, np.inexact)]
    self.assertNotEmpty(ints)
    self.assertEqual(sum(s.gradient_bytes for s in pipe.stages), (n - 1) * activations)
    int_bytes = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in ints)
    self.assertEqual(pipe.timeline.link_bytes, g * (2 * (n - 1) * activations + int_bytes))

  def test_recomputation_trades_memory_for_cycles(self):
    plain, _ = self.pipes[False]
    recomputed, _ = self.pipes[True]
    for a, b in zip(plain.stages[:-1], recomputed.stages[:-1]):
      self.assertLess(b.stash_bytes.sum(), a.stash_bytes.sum())
      self.assertGreater(b.backward.profile.total_cycles, a.backward.profile.total_cycles)
    # TF-IPU never recomputes the last stage: the same programs either way.
    a, b = plain.stages[-1], recomputed.stages[-1]
    np.testing.assert_array_equal(b.stash_bytes, a.stash_bytes)
    self.assertEqual(b.backward.profile.total_cycles, a.backward.profile.total_cycles)
    self.assertLess(recomputed.stages[0].peak_bytes.max(), plain.stages[0].peak_bytes.max())
    self.assertGreater(recomputed.report.total_cycles, plain.report.total_cycles)

  def test_step_as_a_report_for_compare_reports(self):
    plain, _ = self.pipes[False]
    recomputed, _ = self.pipes[True]
    a, b = plain.report.program_report, recomputed.report.program_report
    self.assertAlmostEqual(a.total_cycles, plain.report.total_cycles, delta=1e-6 * a.total_cycles)
    self.assertEqual(a.target.num_ipus, self.STAGES)
    np.testing.assert_array_equal(a.memory_per_tile, plain.report.memory_per_tile())
    stash_a = a.memory_by_category["stashed_activations"].sum()
    self.assertLess(b.memory_by_category["stashed_activations"].sum(), stash_a)
    self.assertGreater(b.total_cycles, a.total_cycles)
    self.assertEqual(a.flops_dtype, "float32")
    text = ipu_jax.compare_reports(a, b)
    self.assertRegex(text, r"Stashed activations +[\d,]+ +[\d,]+ +-[\d,]+")
    self.assertRegex(text, r"Total +[\d,]+ +[\d,]+ +\+[\d,]+")

  def test_slot_sync_is_the_sync_of_a_multi_ipu_program(self):
    # One work, one cost: the sync ending a pipeline slot and the sync of a
    # superstep spanning the same IPUs in one program are the same sync: the
    # on-chip sync (90) and IPUModel's signal between the IPUs,
    # ceil(15 ns x 1.33 GHz x hops x 2) with hops 1 + (IPUs / 2) / 2: 40
    # cycles for 2 IPUs, 80 for 4.
    pipe, _ = self.pipes[False]
    n = self.STAGES
    expected = 90.0 + {2: 40.0, 4: 80.0}[n]
    slots = [s for s in pipe.report.program_report.profile.steps if s.op == "pipeline slot"]
    self.assertNotEmpty(slots)
    self.assertEqual({s.sync_cycles for s in slots}, {expected})
    target = pipe.target.replace(num_ipus=n)
    lowered = ipu_jax.jit(lambda x: jnp.sum(x, axis=0), target=target, verbose=0).lower(
        jnp.ones((8 * n, 256), jnp.float32))
    crossing = [s for s in lowered.profile.steps if s.ipu_link_bytes > 0]
    self.assertNotEmpty(crossing)
    self.assertEqual({s.sync_cycles for s in crossing}, {expected})

  def test_report_summary(self):
    pipe, _ = self.pipes[False]
    summary = pipe.report.summary()
    self.assertIn("pipeline efficiency", summary)
    self.assertIn("over IPU-Links per step", summary)
    self.assertEqual(len(pipe.report.to_dict()["stages"]), self.STAGES)


class HalfPrecisionPipelineTest(chex.TestCase):

  def test_step_counts_its_flops_at_the_half_rate(self):
    # The stage programs' products read float16: the step's FLOPs are held
    # against the AMP units' float16 peak, not float32's.
    params, batches = _data(stages=2, g=4)
    half = lambda a: a.astype(jnp.float16) if a.dtype == jnp.float32 else a
    params, batches = (jax.tree_util.tree_map(half, t) for t in (params, batches))
    pipe = Pipeline(_loss, optax.sgd(0.05), config=_config(stages=2, g=4))
    new_params = pipe.step(params, pipe.init(params, batches), batches).params
    # The half-precision step trains as plain accumulation does, to float16 rounding.
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params,
                                      _plain_gradients(_loss, params, batches, 4))
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, new_params),
                                jax.tree_util.tree_map(np.asarray, expected),
                                rtol=1e-2, atol=1e-3)
    report = pipe.report.program_report
    self.assertEqual(report.flops_dtype, "float16")
    target = report.target
    peak = target.num_tiles * target.fp16_flops_per_cycle * target.clock_hz
    self.assertAlmostEqual(report.flops_fraction_of_peak,
                           report.total_flops / (report.estimated_seconds * peak))


class _FourStages(PipelinedTrainingTest):
  """The acceptance runs: 4 stages, Grouped and Interleaved, G = 8 and 16."""

  STAGES = 4

  def test_report_files(self):
    pipe, _ = self.pipes[False]
    summary = pipe.report.summary()
    self.assertIn("pipeline efficiency", summary)
    self.assertIn("over IPU-Links per step", summary)
    with tempfile.TemporaryDirectory() as d:
      pipe.report.save(d)
      with open(os.path.join(d, "pipeline_trace.json")) as f:
        events = json.load(f)["traceEvents"]
      spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
      self.assertEqual({e["pid"] for e in spans}, {0, 1, 2, 3})
      self.assertEqual(len(spans), 4 * self.G * 2)
      with open(os.path.join(d, "pipeline.json")) as f:
        self.assertEqual(len(json.load(f)["stages"]), 4)
      self.assertTrue(os.path.getsize(os.path.join(d, "pipeline_schedule.png")) > 0)


for _name, _g in (("Grouped", 8), ("Grouped", 16), ("Interleaved", 8), ("Interleaved", 16)):
  globals()[f"FourStage{_name}G{_g}Test"] = pytest.mark.slow(
      type(f"FourStage{_name}G{_g}Test", (_FourStages,), {"SCHEDULE": _name, "G": _g}))
del _FourStages


class ShardedAndReplicatedTest(chex.TestCase):

  def test_nnx_model_in_stage_blocks_sequential_two_replicas(self):
    from flax import nnx

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.first = nnx.Linear(8, 8, rngs=rngs)
        self.second = nnx.Linear(8, 8, rngs=rngs)

      def __call__(self, x):
        with ipu_jax.pipelining.stage(0):
          x = jnp.tanh(self.first(x))
        with ipu_jax.pipelining.stage(1):
          return self.second(x)

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))

    def loss(state, batch):
      return jnp.mean((nnx.merge(graphdef, state)(batch["x"]) - batch["y"]) ** 2)

    _, batches = _data(stages=2, g=4, width=8, rows=4)
    cfg = _config(stages=2, g=2, schedule_name="Sequential", replicas=2)
    pipe = Pipeline(loss, config=cfg)
    grads, _ = pipe.gradients(state, batches)
    chex.assert_trees_all_close(grads, _plain_gradients(loss, state, batches, 4),
                                rtol=1e-5, atol=1e-6)
    self.assertEqual([len(s.params) for s in pipe.staged.stages], [2, 2])
    # Sharded: one IPU busy at a time, less the copies and syncs between them.
    self.assertAlmostEqual(pipe.report.efficiency, 0.5, delta=0.1)
    self.assertLess(pipe.report.efficiency, 0.5)
    self.assertEqual([s.stash_depth for s in pipe.stages], [0, 0])
    kinds = {span[2] for span in pipe.timeline.spans}
    self.assertIn("all-reduce", kinds)
    self.assertEqual(pipe.report.to_dict()["ipus"], 4)


class AlikeStagesTest(chex.TestCase):
  """Stages whose weights have the same shapes share one lowered update program."""

  @parameterized.parameters(False, True)
  def test_alike_stages_share_one_update_and_train_as_plain(self, sharded):
    replicas, g = 2, 4
    params, batches = _data(stages=4, g=g * replicas)
    cfg = _config(stages=4, g=g, schedule_name="Sequential", replicas=replicas)
    cfg.streaming.offload_optimizer_state = sharded
    cfg.streaming.replicated_tensor_sharding = sharded
    optimizer = optax.adam(0.01)
    pipe = Pipeline(_loss, optimizer, config=cfg)
    out = pipe.step(params, pipe.init(params, batches), batches)
    lowered = [getattr(s.update, "lowered", s.update) for s in pipe.stages]
    # Every stage updates one [32, 32] weight: one program, lowered once.
    self.assertTrue(all(program is lowered[0] for program in lowered))
    grads = _plain_gradients(_loss, params, batches, g * replicas)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    chex.assert_trees_all_close([np.asarray(p) for p in out.params],
                                optax.apply_updates(params, updates), rtol=1e-5, atol=1e-6)

  @parameterized.parameters(False, True)
  def test_alike_stages_lower_once_with_their_own_figures(self, recompute):
    # Stages 1 and 2 hold one equal layer each (the integer value stage 0
    # makes passes them by): their forward and backward are lowered once.
    params, batches = _data(stages=4)
    pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(recompute=recompute))
    pipe.lower(params, batches)
    self.assertEqual([s.shared_with for s in pipe.stages], [None, None, 1, None])
    self.assertIs(pipe.stages[2].forward, pipe.stages[1].forward)
    self.assertIs(pipe.stages[2].backward, pipe.stages[1].backward)
    # The figures are those of stage 2's programs lowered for it alone.
    stage = pipe.staged.stages[2]
    forward, backward = stage_programs.stage_functions(stage, recompute)
    cfg = pipe._stage_config(2)  # pylint: disable=protected-access
    p_k, x = [params[2]], jnp.zeros((16, 32), jnp.float32)
    fwd = ipu_jax.jit(forward, config=cfg).lower(p_k, [], [x])
    outs, residuals = fwd.jaxpr.out_avals[:1], fwd.jaxpr.out_avals[1:]
    bwd = ipu_jax.jit(backward, config=cfg, donate_argnums=2).lower(
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in residuals],
        [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs], p_k)
    for own, shared in ((fwd, pipe.stages[2].forward), (bwd, pipe.stages[2].backward)):
      self.assertEqual(own.profile.total_cycles, shared.profile.total_cycles)
      np.testing.assert_array_equal(own.profile.memory.peak, shared.profile.memory.peak)
    # Trained with the shared programs, the weights are plain accumulation's.
    out = pipe.step(params, pipe.init(params, batches), batches)
    grads = _plain_gradients(_loss, params, batches, 8)
    chex.assert_trees_all_close([np.asarray(p) for p in out.params],
                                [p - 0.1 * g for p, g in zip(params, grads)],
                                rtol=1e-5, atol=1e-6)

  def test_stages_on_ipus_with_other_options_are_not_shared(self):
    params, batches = _data(stages=4)
    cfg = _config()
    cfg.matmuls.available_memory_proportion = [0.6, 0.6, 0.3, 0.6]
    pipe = Pipeline(_loss, None, config=cfg)
    pipe.lower(params, batches)
    self.assertEqual([s.shared_with for s in pipe.stages], [None] * 4)
    self.assertIsNot(pipe.stages[2].forward, pipe.stages[1].forward)


class PlanSessionTest(chex.TestCase):
  """A pipeline's stage programs are lowered in one plan session."""

  def test_each_plan_computed_once_with_the_figures_of_no_cache(self):
    # Other proportions on every IPU: no stage shares another's programs, but
    # each backward recomputes its forward's equations and every stage holds
    # the same layer, so their plans are met again.
    params, batches = _data(stages=4)
    cfg = _config(recompute=True)
    cfg.matmuls.available_memory_proportion = [0.6, 0.5, 0.4, 0.3]
    pipe = Pipeline(_loss, optax.sgd(0.1), config=cfg)
    with testing_utils.counting_plans() as computed:
      pipe.lower(params, batches)
    self.assertEqual([s.shared_with for s in pipe.stages], [None] * 4)
    self.assertTrue(computed)
    # The tables whose plans were computed more than once: none.
    self.assertEqual(sorted({table for (table, _), n in computed.items() if n > 1}), [])
    # Plans met again are the plans computed afresh: the same figures.
    with plan_cache.disabled():
      fresh = Pipeline(_loss, optax.sgd(0.1), config=cfg).lower(params, batches)
    self.assertEqual(pipe.timeline.total_cycles, fresh.timeline.total_cycles)
    for ours, theirs in zip(pipe.stages, fresh.stages):
      for name in ("forward", "backward", "update"):
        mine, other = getattr(ours, name).profile, getattr(theirs, name).profile
        self.assertEqual(mine.total_cycles, other.total_cycles)
        np.testing.assert_array_equal(mine.memory.peak, other.memory.peak)
    # And the pipeline trains as plain accumulation does.
    out = pipe.step(params, pipe.init(params, batches), batches)
    grads = _plain_gradients(_loss, params, batches, 8)
    chex.assert_trees_all_close([np.asarray(p) for p in out.params],
                                [p - 0.1 * g for p, g in zip(params, grads)],
                                rtol=1e-5, atol=1e-6)


class KerasPipeliningTest(chex.TestCase):

  @pytest.mark.slow
  def test_fit_with_stage_assignment_equals_plain_accumulation(self):
    from flax import nnx
    from ipu_jax.keras import Model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=40).astype(np.int32)
    model = Model(testing_utils.TwoLayerMLP((6, 8, 3), rngs=nnx.Rngs(0)), config=_config(stages=2, g=1))
    # As Keras on IPU asks, steps_per_execution is a multiple of G (one update here).
    model.compile(optax.sgd(0.1), "sparse_categorical_crossentropy", steps_per_execution=4)
    model.set_pipelining_options(schedule="Interleaved",
                                 gradient_accumulation_steps_per_replica=4)
    model.set_pipeline_stage_assignment({"second": 1})
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False)

    graphdef, params = nnx.split(testing_utils.TwoLayerMLP((6, 8, 3), rngs=nnx.Rngs(0)), nnx.Param)

    def loss(p, batch):
      logits = nnx.merge(graphdef, p)(batch["x"])
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))

    batches = {"x": x[:32].reshape(4, 8, 6), "y": y[:32].reshape(4, 8)}
    grads = _plain_gradients(loss, params, batches, 4)
    expected = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(nnx.state(model.module, nnx.Param), expected,
                                rtol=1e-5, atol=1e-6)
    self.assertLen(history.history["loss"], 1)
    self.assertEqual([len(s.params) for s in model.pipeline.staged.stages], [2, 2])
    self.assertIs(model.reports["train"], model.pipeline.report.program_report)

  def test_fit_with_loss_scaling_records_what_plain_fit_records(self):
    # The first step's inputs are huge (1e30, against a first kernel of
    # ~1e-30): at the scale 2^40 the first stage's kernel gradient overflows
    # and the second stage's does not. The step is skipped on every stage,
    # the scale backs off (by 2^30), then training goes on; the weights, the
    # losses and the number-format telemetry are plain fit's.
    from flax import nnx
    from ipu_jax.keras import LossScaleOptimizer, Model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    x[:16] *= 1e30
    y = rng.integers(0, 3, size=48).astype(np.int32)
    models = {}
    for kind in ("plain", "pipelined"):
      module = testing_utils.TwoLayerMLP((6, 8, 3), rngs=nnx.Rngs(0))
      module.first.kernel[...] = module.first.kernel[...] * 1e-30
      model = Model(module, config=_config(stages=2 if kind == "pipelined" else 1, g=2))
      model.compile(LossScaleOptimizer(optax.sgd(0.1), 2.0 ** 40, factor=2.0 ** 30),
                    "sparse_categorical_crossentropy", steps_per_execution=2)
      if kind == "pipelined":
        model.set_pipelining_options(schedule="Interleaved",
                                     gradient_accumulation_steps_per_replica=2)
        model.set_pipeline_stage_assignment({"second": 1})
      models[kind] = (model, model.fit(x, y, batch_size=8, epochs=1, shuffle=False))
    (plain, plain_history), (piped, piped_history) = models["plain"], models["pipelined"]
    self.assertEqual(piped.step, 3)
    self.assertEqual(piped.step, plain.step)
    chex.assert_trees_all_close(nnx.state(piped.module, nnx.Param),
                                nnx.state(plain.module, nnx.Param), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(piped_history.history["loss"], plain_history.history["loss"],
                               rtol=1e-5)
    want = plain.number_formats.loss_scaling
    got = piped.number_formats.loss_scaling
    self.assertEqual(want.scale, [2.0 ** 10] * 3)         # skipped, backed off
    self.assertEqual(want.skipped_steps, [1, 1, 1])
    self.assertEqual(want.overflows, [1, 1, 1])
    self.assertEqual(got, want)
    report = piped.reports["train"]
    self.assertIs(report.number_formats, piped.number_formats)
    self.assertIn("Loss scale:", report.summary())
    self.assertEqual(report.to_dict()["number_formats"]["loss_scaling"]["skipped_steps"],
                     [1, 1, 1])

  def test_bad_options(self):
    from ipu_jax.keras import pipelining
    with self.assertRaisesRegex(ValueError, "schedule must be one of"):
      pipelining.set_pipelining_options(object(), schedule="Groupd")
    with self.assertRaisesRegex(ValueError, "non-empty dict of module path"):
      pipelining.set_pipeline_stage_assignment(object(), [1])


class ValidationTest(parameterized.TestCase):

  def _lower(self, loss, cfg, stages=4, g=8, **kwargs):
    params, batches = _data(stages=stages, g=g, width=4, rows=2)
    return Pipeline(loss, config=cfg, **kwargs).lower(params, batches)

  def test_not_increasing(self):
    def loss(params, batch):
      h = pipeline_stage(batch["x"] @ params[0], 1)
      h = pipeline_stage(h @ params[1], 2)
      h = pipeline_stage(h @ params[2], 1)
      return jnp.sum(h @ params[3])
    with self.assertRaisesRegex(PipelineError, r"pipeline_stage\(1\) at .*test_pipelining.py"
                                r":\d+ follows values of stage 2"):
      self._lower(loss, _config())

  def test_skipped_stage(self):
    def loss(params, batch):
      return jnp.sum(pipeline_stage(batch["x"] @ params[0], 2) @ params[1])
    with self.assertRaisesRegex(PipelineError, "must not skip a stage"):
      self._lower(loss, _config(), stages=2)

  def test_more_stages_than_ipus(self):
    with self.assertRaisesRegex(PipelineError, "4 pipeline stages but each replica has only 2"):
      self._lower(_loss, _config(stages=2))

  def test_stage_block_reading_a_later_stage(self):
    def loss(params, batch):
      with ipu_jax.pipelining.stage(1):
        h = batch["x"] @ params[0]
      with ipu_jax.pipelining.stage(0):
        return jnp.sum(h @ params[1])
    with self.assertRaisesRegex(PipelineError, r"inside pipelining.stage\(0\) reads values "
                                "of stage 1"):
      self._lower(loss, _config(stages=2), stages=2)

  def test_weight_on_two_stages(self):
    def loss(params, batch):
      h = pipeline_stage(batch["x"] @ params[0], 1)
      return jnp.sum(h @ params[0])
    with self.assertRaisesRegex(PipelineError, r"Weight params\[0\] is read by stage 0 "
                                r"\(IPU 0, at .*test_pipelining.py:\d+\) and by stage 1 "
                                r"\(IPU 1, at .*test_pipelining.py:\d+\)"):
      self._lower(loss, _config(stages=2), stages=2)

  @parameterized.parameters(("Grouped", 4, "multiple of 8"), ("Grouped", 12, "multiple of 8"),
                            ("Interleaved", 6, "multiple of 4"))
  def test_accumulation_below_minimum(self, name, g, message):
    with self.assertRaisesRegex(PipelineError, f"gradient_accumulation_steps={g} .*{message}"):
      self._lower(_loss, _config(g=g, schedule_name=name), g=g)

  def test_device_mapping(self):
    with self.assertRaisesRegex(PipelineError, r"device_mapping\[1\]=7 is out of range: "
                                r"stage 1 .* valid range 0\.\.3 \(auto_select_ipus=4\)"):
      self._lower(_loss, _config(), device_mapping=(0, 7, 1, 2))
    with self.assertRaisesRegex(PipelineError, "Interleaved schedule does not currently support "
                                "multiple pipeline stages on the same device.*stages 0, 1 on "
                                "IPU 0"):
      self._lower(_loss, _config(schedule_name="Interleaved"), device_mapping=(0, 0, 1, 2))

  def test_batches_and_steps_per_execution(self):
    with self.assertRaisesRegex(PipelineError, "stack gradient_accumulation_steps x "
                                r"replication_factor = 8 x 1 = 8 micro-batches"):
      self._lower(_loss, _config(g=8), g=4)
    params, batches = _data(stages=4, g=24, width=4, rows=2)
    pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(g=8, replicas=2))
    with self.assertRaisesRegex(PipelineError, "steps_per_execution=12 must be a multiple of "
                                "gradient_accumulation_steps x replication_factor = 8 x 2"):
      pipe.run(params, None, batches, steps_per_execution=12)
    for count in (0, -8, 8.0, "8"):
      with self.assertRaisesRegex(PipelineError, "steps_per_execution must be a positive int"):
        pipe.run(params, None, batches, steps_per_execution=count)

  def test_integer_loss_is_refused_as_jax_grad_refuses_it(self):
    # A count has no gradient: the weights would stay as they are, silently.
    def loss(params, batch):
      h = pipeline_stage(batch["x"] @ params[0], 1)
      return jnp.sum(h @ params[1] > 0)
    with self.assertRaisesRegex(PipelineError, "must return a floating-point loss .* int32"):
      self._lower(loss, _config(stages=2), stages=2)
    params, batches = _data(stages=2, g=8, width=4, rows=2)
    with self.assertRaisesRegex(PipelineError, r"trains floating-point weights; params\[0\] "
                                               r"is int32"):
      Pipeline(_loss, config=_config(stages=2)).lower(
          [params[0].astype(jnp.int32), params[1]], batches)  # was JAX's float0 error

  def test_constructor_arguments_and_scalar_batch_leaves(self):
    # An optimizer of the wrong kind used to fail after every stage was lowered.
    with self.assertRaisesRegex(PipelineError, "optimizer must be an optax "
                                "GradientTransformation .* got str: 'sgd'"):
      Pipeline(_loss, "sgd", config=_config(stages=2))
    with self.assertRaisesRegex(PipelineError, "config must be an ipu_jax.IPUConfig; got dict"):
      Pipeline(_loss, config={"auto_select_ipus": 2})
    with self.assertRaisesRegex(PipelineError, "stage_assignment must map module paths"):
      Pipeline(_loss, config=_config(stages=2), stage_assignment=[1])
    params, batches = _data(stages=2, g=8, width=4, rows=2)
    with self.assertRaisesRegex(PipelineError, r"batches\['y'\] is a scalar; every leaf must "
                                r"stack .* = 8 micro-batches"):
      Pipeline(_loss, config=_config(stages=2)).lower(params, {**batches, "y": 0.0})

  def test_step_needs_one_optimizer_state_per_stage(self):
    # A shorter list used to leave the last stages' weights untouched.
    params, batches = _data(stages=2, g=8, width=4, rows=2)
    pipe = Pipeline(_loss, optax.sgd(0.1), config=_config(stages=2))
    state = pipe.init(params, batches)
    for bad, got in ((state[:1], "got 1 entries"), (None, "got NoneType")):
      with self.assertRaisesRegex(PipelineError, rf"one optimizer state per stage \(2\); {got}"):
        pipe.step(params, bad, batches)
    out = pipe.step(params, state, batches)
    self.assertLen(out.opt_state, 2)
    self.assertFalse(np.allclose(np.asarray(out.params[1]), np.asarray(params[1])))


if __name__ == "__main__":
  absltest.main()
