"""What a pipeline's copies and recomputation cost: shared IPU-Links on the
M2000 ladder, and TF-IPU's recomputation (never the last stage) with its
cycles read off the backward program."""

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
from ipu_jax.kernels import collectives, systems
from ipu_jax.pipelining import Pipeline, links, schedule, stage_programs
from ipu_jax.pipelining import throughput as throughput_lib
import testing_utils

_TILES = 16
# One IPU-Link, one direction: 128 Gibit/s at IPUModel's 0.85 efficiency
# (poplibs lib/poplibs_test/Util.cpp; docs/hardware.md), in bytes per second.
_LINK = 128 * 2**30 / 8 * 0.85
_CLOCK = testing_utils.T16.clock_hz
_LATENCY = testing_utils.T16.exchange_latency_cycles
_ROWS, _WIDTH = 16, 32
_ACTIVATION = _ROWS * _WIDTH * 4  # one f32 activation crossing a boundary


def _cycles(nbytes, links_in_group, hops):
  return nbytes / (links_in_group * _LINK) * _CLOCK + hops * _LATENCY


def _pair(a, b):
  return links.Link("pair", min(a, b), max(a, b)), 1 if b > a else -1


def _cross(a, b):
  return links.Link("cross", min(a, b), max(a, b)), 1 if b > a else -1


def _rail(a, b):
  return links.Link("rail", min(a, b), max(a, b)), 1 if b > a else -1


class RouteTest(parameterized.TestCase):
  """Routes on the ladder, as poplibs' IPUModel traces them."""

  @parameterized.parameters(
      (0, 1, [_pair(0, 1)]),
      (3, 2, [_pair(3, 2)]),
      (0, 2, [_rail(0, 2)]),
      (5, 1, [_rail(5, 3), _rail(3, 1)]),
      # Other side of the ladder: across its own rung first, then climb.
      (0, 3, [_cross(0, 1), _rail(1, 3)]),
      (3, 0, [_cross(3, 2), _rail(2, 0)]),
      (0, 7, [_cross(0, 1), _rail(1, 3), _rail(3, 5), _rail(5, 7)]),
      (4, 4, []),
  )
  def test_route(self, src, dst, expected):
    self.assertEqual(links.route(src, dst), expected)

  def test_link_counts_and_single_copy_rates(self):
    self.assertEqual(links.links_between(0, 1), 4)
    self.assertEqual(links.links_between(0, 3), 2)
    self.assertAlmostEqual(links.link_bytes_per_second(2, 3) / 1e9, 58.41, places=2)
    self.assertAlmostEqual(links.link_bytes_per_second(2, 0) / 1e9, 29.21, places=2)

  @parameterized.parameters(-1, 0.5, True, "1")
  def test_bad_ipu(self, ipu):
    with self.assertRaisesRegex(ValueError, r"src must be an IPU number"):
      links.route(ipu, 2)


class SlotCopyTest(parameterized.TestCase):
  """One slot's copies: a link's load is the sum of what crosses it."""

  T = testing_utils.T16

  def test_two_copies_on_one_link_cost_their_sum(self):
    a, b = 3_000_000, 1_000_000
    # 0 -> 2 climbs rail (0, 2); 1 -> 2 crosses rung (0, 1) down, then the
    # same rail up: that rail carries a + b.
    got = links.slot_copy_cycles(self.T, [(0, 2, a), (1, 2, b)])
    self.assertAlmostEqual(got, _cycles(a + b, 2, hops=2), places=6)
    self.assertGreater(got, max(links.copy_cycles(self.T, 0, 2, a),
                                links.copy_cycles(self.T, 1, 2, b)))
    # Two copies along the same route: the sum as well.
    self.assertAlmostEqual(links.slot_copy_cycles(self.T, [(0, 1, a), (0, 1, b)]),
                           _cycles(a + b, 4, hops=1), places=6)

  @parameterized.parameters(
      ([(0, 1, 3_000_000), (2, 3, 1_000_000)], _cycles(3_000_000, 4, hops=1)),
      # A link carries each direction at its full rate.
      ([(0, 2, 1_000_000), (2, 0, 3_000_000)], _cycles(3_000_000, 2, hops=1)),
      # The pair's 4 links and the 2 cross links are different links.
      ([(0, 1, 3_000_000), (0, 3, 1_000_000)],
       max(_cycles(3_000_000, 4, hops=1), _cycles(1_000_000, 2, hops=2))),
  )
  def test_copies_on_different_links_cost_their_max(self, copies, expected):
    self.assertAlmostEqual(links.slot_copy_cycles(self.T, copies), expected, places=6)

  def test_far_copy_pays_its_hops(self):
    n = 2_000_000
    self.assertAlmostEqual(links.copy_cycles(self.T, 0, 7, n), _cycles(n, 2, hops=4), places=6)
    self.assertAlmostEqual(links.copy_cycles(self.T, 0, 6, n), _cycles(n, 2, hops=3), places=6)
    self.assertAlmostEqual(links.copy_cycles(self.T, 0, 1, n), _cycles(n, 4, hops=1), places=6)

  def test_copies_within_one_ipu_are_free(self):
    self.assertEqual(links.slot_copy_cycles(self.T, [(3, 3, 10**6), (1, 1, 5)]), 0.0)
    self.assertEqual(links.slot_copy_cycles(self.T, []), 0.0)
    self.assertAlmostEqual(links.slot_copy_cycles(self.T, [(3, 3, 10**6), (0, 1, 100)]),
                           _cycles(100, 4, hops=1), places=6)

  def test_simulate_counts_no_link_bytes_within_an_ipu(self):
    # Two stages on one IPU (as a device_mapping like [0, 1, 0] places
    # them): their copies neither take time nor cross a link.
    n, g = 2, 4
    copies = [[(0, 0, 4096)], []]
    returns = [[], [(0, 0, 4096)]]
    timeline = schedule.simulate(
        schedule.slots("Grouped", n, g), [0, 0], [1.0] * n, [2.0] * n, copies, returns, 0.0,
        [0.0] * n, [0.0] * n, lambda c: links.slot_copy_cycles(self.T, c))
    self.assertEqual(timeline.link_bytes, 0)
    self.assertEqual(set(timeline.copy_cycles_per_slot), {0.0})


def _layers_loss(params, batch):
  """One tanh layer per stage, the middle value of each a checkpoint."""
  return jnp.mean((testing_utils.chain_layers(params, batch["x"]) - batch["y"]) ** 2)


def _data(stages, g, seed=0):
  rng = np.random.default_rng(seed)
  params = [jnp.asarray(rng.normal(size=(_WIDTH, _WIDTH)) * 0.2, jnp.float32)
            for _ in range(stages)]
  batches = {k: jnp.asarray(rng.normal(size=(g, _ROWS, _WIDTH)), jnp.float32) for k in "xy"}
  return params, batches


def _config(ipus, g, recompute=False):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _TILES
  cfg.auto_select_ipus = ipus
  cfg.training.gradient_accumulation_steps = g
  cfg.pipelining.schedule = "Grouped"
  cfg.pipelining.recomputation = recompute
  return cfg


class SharedLinkPipelineTest(chex.TestCase):
  """Three stages on IPUs 0, 2 and 1 of a 4-IPU ladder, Grouped, G = 6.

  In slot 4 every stage runs a forward and a backward pass. Stage 0 (IPU 0)
  sends its activation to stage 1 (IPU 2) up rail (0, 2), and stage 2
  (IPU 1) returns its input gradient to stage 1 across rung (0, 1) and up
  the same rail: that rail carries two activations.
  """

  def test_slot_copy_time_with_two_stages_sending_over_one_link(self):
    params, batches = _data(3, 6)
    pipe = Pipeline(_layers_loss, None, config=_config(4, 6), device_mapping=[0, 2, 1])
    pipe.lower(params, batches)
    slot = pipe._slots[4]
    self.assertEqual({(p.stage, p.kind) for p in slot},
                     {(k, kind) for k in range(3) for kind in ("forward", "backward")})
    self.assertEqual(pipe.copies(0, "forward"), [(0, 2, _ACTIVATION)])
    self.assertEqual(pipe.copies(2, "backward"), [(1, 2, _ACTIVATION)])
    expected = _cycles(2 * _ACTIVATION, 2, hops=2)
    self.assertAlmostEqual(pipe.timeline.copy_cycles_per_slot[4], expected, places=6)
    # Costed pass by pass, the longest copy alone would be less.
    alone = max(pipe.copy_cycles(p.stage, p.kind) for p in slot)
    self.assertAlmostEqual(alone, _cycles(_ACTIVATION, 2, hops=2), places=6)
    # The timeline's copy spans and the step's report show the same time.
    spans = [s for s in pipe.timeline.spans if s[2] == "copy"]
    self.assertIn(expected, {s[5] for s in spans})
    steps = [s for s in pipe.report.program_report.profile.steps if s.op == "pipeline slot"]
    self.assertAlmostEqual(steps[4].exchange_cycles, expected, places=6)
    # Each activation crosses once per pass, whatever links it shares.
    self.assertEqual(pipe.timeline.link_bytes, 6 * 4 * _ACTIVATION)


class RampCopiesTest(chex.TestCase):
  """Two stages on IPUs 0 and 1 (one rung of the ladder), Grouped, G = 4.

  PopART runs every stage's inter-IPU copies in every pipeline cycle, fill
  and flush too (popart ``PopPrograms::addPipelineCycle``: "Always do all
  the copies"), and only the stages with a micro-batch compute: G + 2N - 2
  slots, the ramp's compute the stages that have work.
  """

  N, G = 2, 4

  def test_ramp_slots_run_every_copy_and_only_the_busy_stages(self):
    params, batches = _data(self.N, self.G)
    pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=_config(self.N, self.G))
    pipe.lower(params, batches)
    tp = throughput_lib.step_throughput(pipe)
    slots = schedule.slots("Grouped", self.N, self.G)
    self.assertLen(slots, self.G + 2 * self.N - 2)
    # Stage 0's activation up the rung's 4 links and stage 1's input gradient
    # back down them: other directions, so each slot takes one copy's time.
    self.assertEqual(pipe.copies(0, "forward"), [(0, 1, _ACTIVATION)])
    self.assertEqual(pipe.copies(1, "backward"), [(1, 0, _ACTIVATION)])
    copy = _cycles(_ACTIVATION, 4, hops=1)
    self.assertAlmostEqual(tp.breakdown["inter_stage_copies"] * _CLOCK, len(slots) * copy,
                           places=6)
    # The ramp: slot 0 runs stage 0's first forward, the last slot its last
    # backward; the G slots between are full (the last stage forward and backward).
    fwd = [s.forward.profile.total_cycles for s in pipe.stages]
    bwd = [s.backward.profile.total_cycles for s in pipe.stages]
    self.assertAlmostEqual(tp.breakdown["ramp"] * _CLOCK, fwd[0] + bwd[0], places=3)
    # IPU 0 runs forward m = t while t < G and backward m = t - 2 from t = 2.
    last = fwd[1] + bwd[1]
    busiest = [max(fwd[0], last), max(fwd[0] + bwd[0], last), max(fwd[0] + bwd[0], last),
               max(bwd[0], last)]
    self.assertAlmostEqual(tp.breakdown["steady_state"] * _CLOCK, sum(busiest), places=3)
    # No system: no host to price an execution on.
    self.assertEqual(tp.breakdown["execution_overhead"], 0.0)


class ForwardOnlyTest(chex.TestCase):
  """A forward-only run (PopART's implicitPipeliningFwdOnly) of the same
  lowered stages: G + N - 1 slots, stage k on micro-batch t - k in slot t."""

  G = 4

  @parameterized.named_parameters(("two_ipus", [0, 1]), ("one_ipu", [0, 0]))
  def test_slots_run_the_forward_passes_only(self, mapping):
    params, batches = _data(2, self.G)
    cfg = _config(2, self.G)
    cfg.auto_select_ipus = max(mapping) + 1
    pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=cfg, device_mapping=mapping)
    pipe.lower(params, batches)
    tp = ipu_jax.pipelining.forward_throughput(pipe)
    fwd = [s.forward.profile.total_cycles for s in pipe.stages]
    slots = self.G + 2 - 1
    if mapping == [0, 1]:
      # Fill and drain run one stage; the G - 1 slots between run both, on
      # their own IPUs; every slot runs stage 0's activation copy up the rung.
      busiest, ramp = max(fwd), fwd[0] + fwd[1]
      copy = _cycles(_ACTIVATION, 4, hops=1)
    else:
      # One IPU: both stages' passes add in a slot, and no copy crosses a link.
      busiest, ramp, copy = fwd[0] + fwd[1], fwd[0] + fwd[1], 0.0
    self.assertAlmostEqual(tp.breakdown["steady_state"] * _CLOCK, (self.G - 1) * busiest,
                           places=3)
    self.assertAlmostEqual(tp.breakdown["ramp"] * _CLOCK, ramp, places=3)
    self.assertAlmostEqual(tp.breakdown["inter_stage_copies"] * _CLOCK, slots * copy, places=6)
    sync = pipe.target.ipu_sync_cycles(max(mapping) + 1)
    self.assertAlmostEqual(tp.breakdown["syncs"] * _CLOCK, slots * sync, places=6)
    self.assertEqual(tp.breakdown["execution_overhead"], 0.0)  # no system
    self.assertAlmostEqual(tp.step_seconds, sum(tp.breakdown.values()), places=12)
    self.assertEqual(tp.samples_per_step, self.G * _ROWS)
    # Cheaper than the training step it shares its forward programs with.
    self.assertLess(tp.step_seconds, pipe.report.throughput.step_seconds)
    self.assertEqual(pipe.report.forward_throughput().breakdown, tp.breakdown)

  def test_a_step_of_fewer_micro_batches_than_stages_is_all_ramp(self):
    params, batches = _data(3, 2)
    cfg = _config(3, 2)
    cfg.pipelining.schedule = "Sequential"  # Grouped asks G >= 2N for training
    pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=cfg)
    pipe.lower(params, batches)
    tp = ipu_jax.pipelining.forward_throughput(pipe)
    fwd = [s.forward.profile.total_cycles for s in pipe.stages]
    self.assertEqual(tp.breakdown["steady_state"], 0.0)
    # Slots 0..3 run stages {0}, {0, 1}, {1, 2}, {2}, each on its own IPU.
    expected = fwd[0] + max(fwd[0], fwd[1]) + max(fwd[1], fwd[2]) + fwd[2]
    self.assertAlmostEqual(tp.breakdown["ramp"] * _CLOCK, expected, places=3)


class ConcurrentUpdateCollectivesTest(chex.TestCase):
  """Two replicas of a 4-stage pipeline on a POD16, one stage per IPU.

  Group ``j`` is IPU ``j`` of both replicas, ``{j, 4 + j}``; every IPU
  reduces its gradients with its peer at once (PopART's merged
  collectives), so groups 0 and 2 share the cable up from IPU 2 to IPU 4,
  and groups 1 and 3 the one from IPU 3 to IPU 5.
  """

  IPUS, R, G, WIDTH = 4, 2, 8, 128

  def test_gradient_all_reduce_is_every_ipus_at_once(self):
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(self.WIDTH, self.WIDTH)) * 0.1, jnp.float32)
              for _ in range(self.IPUS)]
    batches = {k: jnp.asarray(rng.normal(size=(self.G * self.R, _ROWS, self.WIDTH)),
                              jnp.float32) for k in "xy"}
    cfg = _config(self.IPUS, self.G)
    cfg.replication_factor = self.R
    cfg.system = "pod16"
    pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=cfg)
    pipe.lower(params, batches)
    tp = throughput_lib.step_throughput(pipe)
    system = systems.system_preset("pod16")
    grads = self.WIDTH * self.WIDTH * 4
    self.assertEqual([s.weight_bytes for s in pipe.stages], [grads] * self.IPUS)
    # Hand-computed: each of the all-reduce's 2 steps (reduce-scatter, then
    # all-gather, of 2 members) sends half the gradients each way over the
    # rail and the cable; the cable carries two groups' halves at 2 links.
    self.assertEqual([g.kind for g, _ in system.route(0, 4)], ["rail", "cable"])
    rate = 2 * system.ipu_link_bytes_per_second
    target = pipe.target
    step = (2 * (grads / 2) / rate * _CLOCK + 2 * target.exchange_latency_cycles
            + target.ipu_sync_cycles(self.IPUS * self.R))
    self.assertAlmostEqual(tp.breakdown["gradient_reduction"] * _CLOCK, 2 * step, places=3)
    concurrent = collectives.all_reduce(target, [[j, self.IPUS + j] for j in range(self.IPUS)],
                                        grads)
    self.assertAlmostEqual(tp.breakdown["gradient_reduction"] * _CLOCK, concurrent.cycles,
                           places=3)
    alone = collectives.all_reduce(target, [[0, self.IPUS]], grads)
    self.assertGreater(concurrent.cycles, alone.cycles)
    self.assertEqual(tp.breakdown["weight_all_gather"], 0.0)


class HostInputBytesTest(chex.TestCase):
  """The host sends what the device holds: without x64, JAX holds NumPy
  float64 (int64) batches as float32 (int32), so the step's host I/O counts
  four bytes an element for them, as for float32 batches."""

  def test_float64_batches_cost_what_float32_ones_do(self):
    params, batches = _data(2, 4)
    host_io = []
    for dtype in (np.float64, np.float32):
      given = {k: np.asarray(v, dtype) for k, v in batches.items()}
      pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=_config(2, 4)).lower(params, given)
      host_io.append(throughput_lib.step_throughput(pipe).breakdown["host_io"])
    micro_batch_bytes = 2 * _ROWS * _WIDTH * 4  # x and y, float32
    self.assertEqual(host_io[0], host_io[1])
    rate = pipe.target.host_link_bytes_per_second
    self.assertAlmostEqual(host_io[1], 4 * micro_batch_bytes / rate, places=15)


class ExecutionOverheadTest(chex.TestCase):
  """The host's fixed time per execution of the device program, shared by
  the steps one execution runs (PopART's ``batches_per_step``)."""

  IPUS, R, G = 2, 2, 4

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    params, batches = _data(cls.IPUS, cls.G * cls.R)
    cfg = _config(cls.IPUS, cls.G)
    cfg.replication_factor = cls.R
    cfg.system = "pod16"
    cls.pipe = Pipeline(_layers_loss, optax.sgd(0.05), config=cfg).lower(params, batches)

  @parameterized.parameters(None, 8, 24)
  def test_each_step_pays_its_share_of_an_execution(self, steps_per_execution):
    tp = throughput_lib.step_throughput(self.pipe, steps_per_execution=steps_per_execution)
    # 53 ms: MLPerf v2.0's Bow Pod BERT evaluation gaps, assumed for IPU-M2000
    # PODs too (kernels/systems.py).
    self.assertEqual(systems.system_preset("pod16").execution_overhead_seconds, 53e-3)
    updates = 1 if steps_per_execution is None else steps_per_execution // (self.G * self.R)
    self.assertAlmostEqual(tp.breakdown["execution_overhead"], 53e-3 / updates, places=12)
    self.assertAlmostEqual(tp.step_seconds, sum(tp.breakdown.values()), places=12)
    self.assertIn("execution_overhead", "\n".join(tp.summary_lines()))

  def test_the_report_reads_the_pipelines_executions(self):
    report = self.pipe.report
    one = report.throughput_for(steps_per_execution=self.G * self.R)
    ten = report.throughput_for(steps_per_execution=10 * self.G * self.R)
    self.assertAlmostEqual(one.step_seconds - ten.step_seconds, 0.9 * 53e-3, places=9)
    self.assertEqual(report.throughput.breakdown, one.breakdown)

  def test_the_system_asked_for_prices_the_host(self):
    # step_throughput(system=...) prices the same step on another system, its host too.
    quiet = systems.system_preset("pod16").replace(execution_overhead_seconds=1e-3)
    tp = throughput_lib.step_throughput(self.pipe, system=quiet)
    self.assertAlmostEqual(tp.breakdown["execution_overhead"], 1e-3, places=15)
    self.assertEqual(tp.system, "pod16")

  @parameterized.parameters(6, 0, -8, 2.5)
  def test_a_bad_steps_per_execution_is_refused(self, steps):
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError, "steps_per_execution"):
      throughput_lib.step_throughput(self.pipe, steps_per_execution=steps)

  def test_a_negative_overhead_is_refused(self):
    with self.assertRaisesRegex(ValueError, "IPUSystem.execution_overhead_seconds"):
      systems.system_preset("pod16").replace(execution_overhead_seconds=-1.0)


class RecomputationTest(chex.TestCase):
  """Three stages, Grouped, G = 6, with and without recomputation."""

  STAGES, G = 3, 6

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params, cls.batches = _data(cls.STAGES, cls.G)
    cls.pipes = {}
    for recompute in (False, True):
      pipe = Pipeline(_layers_loss, optax.sgd(0.05),
                      config=_config(cls.STAGES, cls.G, recompute))
      state = pipe.init(cls.params, cls.batches)
      cls.pipes[recompute] = (pipe, pipe.step(cls.params, state, cls.batches))

  def test_numbers_equal_plain_accumulation(self):
    acc, _ = testing_utils.accumulated_gradients(_layers_loss, self.params, self.batches, self.G)
    expected = testing_utils.sgd_after(self.params, acc, 0.05)
    for recompute in (False, True):
      chex.assert_trees_all_close(self.pipes[recompute][1].params, expected, rtol=1e-5, atol=1e-6)

  def test_last_stage_is_not_recomputed(self):
    plain, recomputed = self.pipes[False][0], self.pipes[True][0]
    self.assertEqual([s.recompute_cycles for s in plain.stages], [0.0] * self.STAGES)
    self.assertEqual(recomputed.stages[-1].recompute_cycles, 0.0)
    for s in recomputed.stages[:-1]:
      self.assertGreater(s.recompute_cycles, 0.0)
    # Its programs are those of the plain pipeline: same stash, same backward.
    a, b = plain.stages[-1], recomputed.stages[-1]
    np.testing.assert_array_equal(b.stash_bytes, a.stash_bytes)
    self.assertEqual(b.backward.profile.total_cycles, a.backward.profile.total_cycles)

  def test_recompute_cycles_are_what_recomputation_adds_to_the_backward(self):
    # In this model recomputation changes nothing else in the backward
    # program, so the supersteps JAX's remat transpose runs again are the
    # whole difference.
    plain, recomputed = self.pipes[False][0], self.pipes[True][0]
    for a, b in zip(plain.stages[:-1], recomputed.stages[:-1]):
      added = b.backward.profile.total_cycles - a.backward.profile.total_cycles
      self.assertAlmostEqual(b.recompute_cycles, added, delta=0.02 * added)

  def test_stash_is_the_inputs_and_checkpoints(self):
    # Stage 0 stashes its micro-batch input x and its checkpoint; stage 1
    # the activation it received and its checkpoint: each one activation.
    # The weights stay where they are and are not stashed.
    recomputed = self.pipes[True][0]
    for s in recomputed.stages[:-1]:
      self.assertEqual(int(s.stash_bytes.sum()), 2 * _ACTIVATION)
    plain = self.pipes[False][0]
    for a, b in zip(plain.stages[:-1], recomputed.stages[:-1]):
      self.assertLess(int(b.stash_bytes.sum()), int(a.stash_bytes.sum()))

  def test_report_shows_recompute_cycles(self):
    pipe = self.pipes[True][0]
    d = pipe.report.to_dict()
    per_stage = [s["recompute_cycles"] for s in d["stages"]]
    self.assertEqual(per_stage, [s.recompute_cycles for s in pipe.stages])
    self.assertAlmostEqual(d["recompute_cycles_per_micro_batch"], sum(per_stage))
    summary = pipe.report.summary()
    self.assertIn("backward (recompute)", summary)
    row = next(line for line in summary.splitlines() if line.split()[:2] == ["0", "0"])
    self.assertIn(f"({per_stage[0]:>9,.0f})", row)
    with tempfile.TemporaryDirectory() as directory:
      pipe.report.save(directory, plots=False)
      with open(os.path.join(directory, "pipeline.json")) as f:
        saved = json.load(f)
    self.assertEqual([s["recompute_cycles"] for s in saved["stages"]], per_stage)


class RecomputeCyclesTest(chex.TestCase):
  """``recompute_cycles`` on any backward program: jax.checkpoint regions."""

  def test_checkpointed_region_in_a_gradient(self):
    def layer(w, x):
      return jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T))

    w = testing_utils.random_array((_WIDTH, _WIDTH), seed=1) * 0.2
    x = testing_utils.random_array((_ROWS, _WIDTH), seed=2)
    cycles = {}
    for name, fn in (("plain", layer), ("remat", jax.checkpoint(layer))):
      lowered = ipu_jax.jit(jax.grad(fn), target=testing_utils.T16, verbose=0).lower(w, x)
      cycles[name] = stage_programs.recompute_cycles(lowered.profile)
      self.assertLessEqual(cycles[name], lowered.profile.total_cycles)
    self.assertEqual(cycles["plain"], 0.0)
    self.assertGreater(cycles["remat"], 0.0)


if __name__ == "__main__":
  absltest.main()
