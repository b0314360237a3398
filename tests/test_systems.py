"""IPU systems (kernels/systems.py) and collectives priced over their links
(kernels/collectives.py), and the users of the flat model that follow a system.

Hand-computed figures use the link rates of docs/systems.md: one IPU-Link a
direction 128 Gibit/s x 0.85, one GW-Link 100 Gbps; IPU-Link hops pay the
target's exchange latency, GW-Link hops the system's GW latency too.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import collectives as C
from ipu_jax.kernels.systems import SYSTEM_PRESETS, LinkGroup, system_preset
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.pipelining import Pipeline, links
# The 3-stage tanh pipeline of the pipeline cost tests (one weight per stage).
from test_pipeline_costs import _config, _data, _layers_loss

LINK = 128 * 2**30 / 8 * 0.85     # one IPU-Link, one direction, bytes/s
GW = 100e9 / 8                    # one GW-Link, one direction, bytes/s
B = 48 * 2**20                    # bytes all-reduced


def _target(system, chip="ipu2"):
  return IPUTarget.preset(chip, tiles_per_ipu=16, system=system)


class SystemPresetsTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(
      ("m2000", "ipu2", 4, 1), ("bow-2000", "bow", 4, 1), ("pod16", "ipu2", 16, 1),
      ("bow-pod16", "bow", 16, 1), ("pod64", "ipu2", 64, 1), ("bow-pod64", "bow", 64, 1),
      ("pod128", "ipu2", 128, 2), ("bow-pod256", "bow", 256, 4))
  def test_sizes_and_chips(self, name, chip, ipus, pods):
    s = system_preset(name)
    self.assertEqual((s.chip, s.num_ipus, s.pods), (chip, ipus, pods))
    self.assertEqual(s.pod_of(ipus - 1), pods - 1)
    self.assertEqual(s.machine_of(ipus - 1), ipus // 4 - 1)

  def test_link_class_between_ipus(self):
    s = system_preset("pod128")
    self.assertIsNone(s.link_class(5, 5))
    self.assertEqual(s.link_class(0, 3), "ipu_link")
    self.assertEqual(s.link_class(0, 4), "ipu_link_cable")
    self.assertEqual(s.link_class(63, 64), "gw_link")

  def test_routes(self):
    s = system_preset("pod16")
    # Inside a machine: poplibs' ladder, as the pipeline's links.route.
    for a in range(4):
      for b in range(4):
        self.assertEqual([(tuple(g), d) for g, d in s.route(a, b)],
                         [(tuple(g), d) for g, d in links.route(a, b)])
    # A POD's ladder closes: from the bottom rung to the top one is one cable.
    self.assertEqual(s.route(0, 14), [(LinkGroup("cable", 0, 14), 1)])
    self.assertEqual(s.route(2, 4), [(LinkGroup("cable", 2, 4), 1)])
    # Between two POD64s: the machine's GW-Links to its twin, then IPU-Links.
    s = system_preset("pod128")
    self.assertEqual(s.route(64 + 5, 5), [(LinkGroup("gw", 1, 17), -1)])
    # Switched: up to the switch from the sender's machine, down to the receiver's.
    s = system_preset("bow-pod256")
    self.assertEqual(s.route(1, 201), [(LinkGroup("gw_switch", 0, -1), 1),
                                       (LinkGroup("gw_switch", 50, -1), -1)])

  def test_unknown_preset_lists_the_valid_ones(self):
    with self.assertRaisesRegex(ValueError, r"Unknown IPU system 'pod17'.*'bow-pod16'.*'pod64'"):
      system_preset("pod17")
    with self.assertRaisesRegex(ValueError, r"system must be one of .*'pod16'"):
      ipu_jax.IPUConfig().system = "pod17"

  def test_system_too_small_names_the_fields(self):
    cfg = ipu_jax.IPUConfig()
    cfg.system = "pod16"
    cfg.replication_factor = 5
    cfg.auto_select_ipus = 4
    with self.assertRaisesRegex(ValueError, r"pod16 system has 16 IPUs, too few for "
                                r"replication_factor=5 x auto_select_ipus=4 = 20"):
      cfg.to_target()
    with self.assertRaisesRegex(ValueError, r"replicas=9 x ipus_per_replica=2 = 18"):
      C.replica_groups(system_preset("pod16"), 9, 2)

  def test_config_system_gives_the_target_its_chip(self):
    cfg = ipu_jax.IPUConfig()
    cfg.system = "bow-pod64"
    cfg.replication_factor = 16
    cfg.auto_select_ipus = 4
    target = cfg.to_target()
    self.assertEqual((target.name, target.system.name, target.num_ipus), ("bow", "bow-pod64", 4))
    cfg.device.version = "ipu1"
    with self.assertRaisesRegex(ValueError, r"device.version='ipu1'"):
      cfg.to_target()

  def test_no_system_is_the_flat_model(self):
    self.assertIsNone(ipu_jax.IPUConfig().to_target().system)
    t = _target(None)
    steps = 2 * 3
    expected = (B * steps / 4 / (2 * LINK) * t.clock_hz
                + steps * (t.exchange_latency_cycles + t.ipu_sync_cycles(4)))
    self.assertAlmostEqual(links.all_reduce_cycles(t, 4, B), expected, places=3)


class RingCollectivesTest(chex.TestCase, parameterized.TestCase):

  def test_all_reduce_inside_one_machine(self):
    t = _target("m2000")
    cost = C.all_reduce(t, [[0, 1, 2, 3]], B)
    # Ring 0 -> 2 -> 3 -> 1 -> 0: each step B/4 a member, the rails (2 links)
    # slowest; 2 (R - 1) steps, each one hop and a sync of 4 IPUs.
    step = B / 4 / (2 * LINK) * t.clock_hz + t.exchange_latency_cycles
    expected = 6 * step + 6 * t.ipu_sync_cycles(4)
    self.assertAlmostEqual(cost.cycles, expected, places=3)
    self.assertEqual(cost.steps, 6)
    self.assertEqual(cost.link_bytes, {"ipu_link": 6 * B, "ipu_link_cable": 0, "gw_link": 0})
    # The pipeline's gradient all-reduce gives the same figure on this system
    # as the flat model's ring (its ring neighbours are 2 links apart too).
    self.assertAlmostEqual(links.all_reduce_cycles(t, 4, B), expected, places=3)
    self.assertAlmostEqual(links.all_reduce_cycles(t.replace(system=None), 4, B), expected,
                           places=3)

  def test_all_reduce_across_machines_of_a_pod16(self):
    t = _target("pod16")
    # IPU 0 of 4 replicas of 4 IPUs: 0, 4, 8, 12, one rung apart on side 0;
    # each hop a rail and a cable (2 links each), the last closing the ring.
    cost = C.all_reduce(t, [[0, 4, 8, 12]], B)
    step = B / 4 / (2 * LINK) * t.clock_hz + 2 * t.exchange_latency_cycles
    self.assertAlmostEqual(cost.cycles, 6 * step + 6 * t.ipu_sync_cycles(4), places=3)
    self.assertEqual(cost.link_bytes, {"ipu_link": 6 * B, "ipu_link_cable": 6 * B,
                                       "gw_link": 0})
    self.assertAlmostEqual(
        links.all_reduce_cycles(t.replace(num_ipus=1), 4, B, ipu=0, ipus_per_replica=4),
        cost.cycles, places=3)

  def test_two_rings_sharing_links_pay_their_sum(self):
    t = _target("pod16")
    groups = C.replica_groups(t.system, 4, 4)
    cost = C.all_reduce(t, groups, B)
    # Groups 0 (IPUs 0, 4, ...) and 2 (2, 6, ...) both climb side 0: every
    # rail and cable of it carries two transfers of B/4 in one direction.
    step = 2 * B / 4 / (2 * LINK) * t.clock_hz + 2 * t.exchange_latency_cycles
    self.assertAlmostEqual(cost.cycles, 6 * step + 6 * t.ipu_sync_cycles(16), places=3)
    alone = C.all_reduce(t, groups[:1], B)
    self.assertGreater(cost.cycles, 1.9 * alone.link_cycles["ipu_link"])

  def test_all_reduce_between_two_pod64s_pays_gw_link_rates(self):
    t = _target("pod128")
    s = t.system
    cost = C.all_reduce(t, [[0, 64]], B)
    # One step each way: B/2 over the machines' 2 GW-Links (both join the
    # two PODs), each direction on its own; the sync signal crosses too.
    step = (B / 2 / (2 * GW) * t.clock_hz + t.exchange_latency_cycles
            + s.gw_latency_seconds * t.clock_hz)
    sync = t.ipu_sync_cycles(2) + 2 * s.gw_latency_seconds * t.clock_hz
    self.assertAlmostEqual(cost.cycles, 2 * step + 2 * sync, places=3)
    self.assertEqual(cost.link_bytes, {"ipu_link": 0, "ipu_link_cable": 0, "gw_link": 2 * B})
    self.assertGreater(cost.link_cycles["gw_link"], 0)
    # The same pair inside one POD64 (a rail and a cable, 2 IPU-Links each)
    # is cheaper; four IPUs of a machine crossing at once share its GW-Links.
    inside = C.all_reduce(t, [[0, 4]], B)
    self.assertEqual(inside.link_cycles["gw_link"], 0)
    self.assertGreater(cost.cycles, inside.cycles)
    shared = C.all_reduce(t, [[j, 64 + j] for j in range(4)], B)
    self.assertAlmostEqual(shared.link_cycles["gw_link"],
                           2 * (4 * B / 2 / (2 * GW) * t.clock_hz + t.exchange_latency_cycles
                                + s.gw_latency_seconds * t.clock_hz), places=3)

  def test_hierarchical_all_reduce_across_pods(self):
    t = _target("pod128")
    s = t.system
    cost = C.all_reduce(t, [[0, 2, 64, 66]], B)
    # Reduce-scatter in each POD (0 <-> 2 over the rail, B/2), then the halves
    # cross the GW-Links (0 <-> 64 and 2 <-> 66 share machine 0's GW-Links:
    # 2 x B/4 each way), then all-gather back: 4 steps.
    inner = B / 2 / (2 * LINK) * t.clock_hz + t.exchange_latency_cycles
    outer = (2 * B / 4 / (2 * GW) * t.clock_hz + t.exchange_latency_cycles
             + s.gw_latency_seconds * t.clock_hz)
    sync = 4 * t.ipu_sync_cycles(4) + 2 * 2 * s.gw_latency_seconds * t.clock_hz
    self.assertAlmostEqual(cost.cycles, 2 * inner + 2 * outer + sync, places=3)
    self.assertEqual(cost.steps, 4)
    self.assertEqual(cost.link_bytes["gw_link"], 2 * 4 * B // 4)
    self.assertEqual(cost.link_bytes["ipu_link"], 2 * 4 * B // 2)

  def test_reduce_scatter_and_all_gather_make_an_all_reduce(self):
    t = _target("pod64")
    groups = C.replica_groups(t.system, 8, 2)
    rs, ag = C.reduce_scatter(t, groups, B), C.all_gather(t, groups, B)
    ar = C.all_reduce(t, groups, B)
    self.assertAlmostEqual(rs.cycles + ag.cycles, ar.cycles, places=3)
    self.assertEqual(rs.steps, 7)

  def test_broadcast_scatters_then_gathers(self):
    t = _target("m2000")
    cost = C.broadcast(t, [[0, 1, 2, 3]], B)
    # The root sends B/4 to each member at once: to 1 over the pair (4 links),
    # to 2 up rail (0, 2), to 3 over the rung's cross links then up rail
    # (1, 3), two hops at 2 links: the slowest; then an all-gather (3 steps).
    scatter = B / 4 / (2 * LINK) * t.clock_hz + 2 * t.exchange_latency_cycles
    gather = 3 * (B / 4 / (2 * LINK) * t.clock_hz + t.exchange_latency_cycles)
    self.assertAlmostEqual(cost.cycles, scatter + gather + 4 * t.ipu_sync_cycles(4), places=3)

  def test_bad_groups(self):
    t = _target("m2000")
    with self.assertRaisesRegex(ValueError, "an int in 0..3"):
      C.all_reduce(t, [[0, 4]], B)
    with self.assertRaisesRegex(ValueError, "names an IPU twice"):
      C.all_reduce(t, [[0, 0]], B)
    with self.assertRaisesRegex(ValueError, "Unknown collective 'scan'"):
      C.collective("scan", t, [[0, 1]], B)
    with self.assertRaisesRegex(ValueError, "needs an IPUSystem"):
      C.all_reduce(_target(None), [[0, 1]], B)


class LoweredCollectivesTest(chex.TestCase, parameterized.TestCase):
  """A replicated program's cross-replica sum follows the system."""

  def _lowered(self, system, replicas):
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.replication_factor = replicas
    cfg.system = system
    x = jnp.arange(4096, dtype=jnp.float32)
    f = ipu_jax.jit(lambda v: ipu_jax.ops.cross_replica_sum(v * 2.0), config=cfg)
    return f, f.lower(x), x, cfg.to_target()

  def _step(self, lowered):
    steps = [s for s in lowered.profile.steps if s.name.startswith("cross_replica")
             or "all_reduce" in s.name]
    self.assertLen(steps, 1)
    return steps[0]

  @parameterized.parameters(("pod16", 4), ("pod128", 128), ("pod64", 64))
  def test_all_reduce_step_costs_the_system_price(self, system, replicas):
    f, lowered, x, target = self._lowered(system, replicas)
    flat = self._step(self._lowered(None, replicas)[1])
    step = self._step(lowered)
    busiest = max(step.exchange_bytes_in.max(), step.exchange_bytes_out.max())
    groups = C.replica_groups(target.system, replicas, 1)
    expected = (busiest / target.exchange_bytes_per_cycle + target.exchange_latency_cycles
                + C.all_reduce(target, groups, 4096 * 4).cycles)
    self.assertAlmostEqual(step.exchange_cycles, expected, places=2)
    self.assertEqual(step.ipu_link_bytes, flat.ipu_link_bytes)
    self.assertNotAlmostEqual(step.exchange_cycles, flat.exchange_cycles, places=0)
    self.assertIn(f"replica all-reduce priced over the {system} system's links "
                  "(docs/systems.md#collectives)", step.notes)
    self.assertFalse(any("system's links" in n for n in flat.notes))
    # One replica's numbers are unchanged.
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x * 2.0))

  def test_sharded_collectives_follow_the_system(self):
    from ipu_jax.ops import cross_replica_all_gather, cross_replica_reduce_scatter
    replicas, n = 16, 1024
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.replication_factor = replicas
    cfg.system = "pod16"
    target = cfg.to_target()

    def step(v):
      return cross_replica_all_gather(cross_replica_reduce_scatter(v, replicas) * 0.5, replicas)

    lowered = ipu_jax.jit(step, config=cfg).lower(jnp.ones((replicas * n,), jnp.float32))
    by_name = {s.name: s for s in lowered.profile.steps}
    groups = C.replica_groups(target.system, replicas, 1)
    for name, kind in ((f"reduce_scatter x{replicas}", C.reduce_scatter),
                       (f"all_gather x{replicas}", C.all_gather)):
      s = by_name[name]
      busiest = max(s.exchange_bytes_in.max(), s.exchange_bytes_out.max())
      expected = (busiest / target.exchange_bytes_per_cycle + target.exchange_latency_cycles
                  + kind(target, groups, replicas * n * 4).cycles)
      self.assertAlmostEqual(s.exchange_cycles, expected, places=2)

  def test_report_notes_and_saved_target_name_the_system(self):
    _, lowered, _, _ = self._lowered("bow-pod16", 4)
    self.assertIn("replica all-reduce priced over the bow-pod16 system's links",
                  lowered.report.summary())
    directory = self.create_tempdir().full_path
    lowered.report.save(directory)
    self.assertEqual(ipu_jax.load_report(directory).target.system.name, "bow-pod16")

  def test_spanning_gw_links_costs_more(self):
    one_pod = self._step(self._lowered("pod64", 64)[1])
    two_pods = self._step(self._lowered("pod128", 128)[1])
    self.assertGreater(two_pods.exchange_cycles, one_pod.exchange_cycles)


class PipelineAllReduceTest(chex.TestCase, parameterized.TestCase):
  """A pipeline's gradient all-reduce: stage on IPU i of 4, group of IPU i of every replica."""

  @parameterized.parameters((None, 2), ("pod16", 2), ("pod16", 4), ("pod128", 32))
  def test_stage_all_reduce_is_the_systems_ring(self, system, replicas):
    params, batches = _data(3, 6 * replicas)
    cfg = _config(4, 6)
    cfg.replication_factor = replicas
    cfg.system = system
    pipe = Pipeline(_layers_loss, None, config=cfg, device_mapping=[0, 2, 1])
    pipe.lower(params, batches)
    spans = {s[0]: s[5] for s in pipe.timeline.spans if s[1] == "all-reduce"}
    self.assertEqual(set(spans), {0, 1, 2})
    for stage in pipe.stages:
      group = [[r * 4 + stage.ipu for r in range(replicas)]]
      expected = (links.all_reduce_cycles(pipe.target, replicas, stage.weight_bytes)
                  if system is None
                  else C.all_reduce(pipe.target, group, stage.weight_bytes).cycles)
      self.assertAlmostEqual(spans[stage.ipu], expected, places=3)


class KerasReplicatedFitTest(chex.TestCase):
  """The Keras-like fit over 4 replicas with sharded optimizer state: the
  gradient reduce-scatter and the all-gather are priced over the system."""

  def _fit(self, system):
    import optax
    from flax import nnx
    import ipu_jax.keras
    from ipu_jax.strategy import IPUStrategy
    from test_training import TinyMLP, toy_data
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.replication_factor = 4
    cfg.training.replica_reduction = "mean"
    cfg.streaming.offload_optimizer_state = True
    cfg.streaming.replicated_tensor_sharding = True
    cfg.system = system
    x, y = toy_data(32, features=32, classes=128)
    with IPUStrategy(cfg).scope():
      model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), features=32, hidden=128, classes=128))
      model.compile(optimizer=optax.adam(1e-2), loss="sparse_categorical_crossentropy",
                    steps_per_execution=4)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    return model

  def test_same_weights_collectives_priced_by_the_system(self):
    flat, pod = self._fit(None), self._fit("pod128")
    chex.assert_trees_all_close(pod.params, flat.params, rtol=1e-6, atol=1e-8)
    steps = [s for s in pod.train_report.profile.steps
             if s.op in ("cross_replica_reduce_scatter", "cross_replica_all_gather")]
    self.assertNotEmpty(steps)
    for s in steps:
      self.assertTrue(any("system's links" in n for n in s.notes), s.name)
    flat_ops, pod_ops = flat.train_report.cycles_by_op(), pod.train_report.cycles_by_op()
    for op in ("cross_replica_reduce_scatter", "cross_replica_all_gather"):
      self.assertNotAlmostEqual(flat_ops[op], pod_ops[op], places=0)


if __name__ == "__main__":
  absltest.main()
