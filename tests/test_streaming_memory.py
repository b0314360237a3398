"""Streaming memory: remote buffers, offloaded optimizer state, replicated tensor sharding.

Small targets (4-16 tiles) and tiny models keep these fast; the tests that
train the Keras-like model (two or more compiled training programs each) are
marked ``slow``: ``python -m pytest -m slow tests/test_streaming_memory.py``.
"""

import json
import sys
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
import ipu_jax.keras
from ipu_jax import graph as g
from ipu_jax.lowering import update_order
from ipu_jax.lowering.profile import ALWAYS_LIVE_CATEGORIES
from ipu_jax.ops import pipeline_stage
from ipu_jax.pipelining import Pipeline, stage_programs
from ipu_jax.strategy import IPUStrategy

sys.path.insert(0, os.path.dirname(__file__))
import testing_utils  # noqa: E402
from test_training import TinyMLP, toy_data  # noqa: E402

MIN_BYTES = ipu_jax.offload.MIN_OFFLOAD_BYTES


def _offloaded_bytes(tree):
  return sum(x.nbytes for x in jax.tree.leaves(tree) if x.nbytes >= MIN_BYTES)


def _always_live_total(profile):
  return int(sum(profile.memory.by_category[c].sum() for c in ALWAYS_LIVE_CATEGORIES))


class TargetFiguresTest(parameterized.TestCase):

  @parameterized.parameters("ipu2", "bow")
  def test_presets_have_streaming_memory(self, name):
    t = ipu_jax.IPUTarget.preset(name)
    self.assertEqual(t.streaming_memory_bytes, 64_000_000_000)
    self.assertGreater(t.streaming_bytes_per_cycle, 0)
    # Far slower than the IPU-Links, as Graphcore's guide says (3x-20x).
    self.assertGreater(t.ipu_link_bytes_per_second / t.streaming_memory_bytes_per_second, 3)

  def test_overridable_and_checked(self):
    t = ipu_jax.IPUTarget.preset("ipu2", streaming_memory_bytes_per_second=16e9)
    self.assertEqual(t.streaming_memory_bytes_per_second, 16e9)
    with self.assertRaisesRegex(ValueError, "streaming_memory_bytes_per_second"):
      ipu_jax.IPUTarget.preset("ipu2", streaming_memory_bytes_per_second=0)
    with self.assertRaisesRegex(ValueError, "streaming_memory_bytes"):
      ipu_jax.IPUTarget.preset("ipu2", streaming_memory_bytes=-1)
    self.assertEqual(ipu_jax.IPUTarget.preset("ipu1").streaming_memory_bytes, 0)


def _doubler():
  @g.codelet(inputs=("x",), outputs=("y",), cycles=lambda *specs: 10)
  def double(x):
    return 2 * x
  return double


class RemoteBufferTest(chex.TestCase):

  def _graph(self):
    gr = g.Graph(ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4))
    x = gr.add_variable("float32", (2, 5), "x")
    gr.map_tensor_linearly(x, min_elements_per_tile=3, grain_size=1)
    buf = gr.add_remote_buffer("cache", np.float32, (5,), repeats=4)
    cs = gr.add_compute_set("double")
    gr.add_vertex(cs, _doubler(), tile=0, x=x, y=x)
    return gr, x, buf, cs

  def test_round_trip(self):
    gr, x, buf, cs = self._graph()
    prog = g.Sequence(g.Copy(buf, x, offset=1), g.Execute(cs), g.Copy(x, buf, offset=2),
                      g.Copy(buf, x[0], offset=3), g.Copy(x[1], buf, offset=0))
    engine = g.Engine(gr, prog)
    rows = np.arange(20, dtype=np.float32).reshape(4, 5)
    engine.write_tensor(buf, rows)
    engine.run()
    expected = rows.copy()
    doubled = 2 * rows[1:3]
    expected[2:4] = doubled           # x (rows 1, 2 doubled) -> rows 2, 3
    expected[0] = doubled[1]          # then x[1] -> row 0
    x_expected = np.stack([doubled[1], doubled[1]])  # x[0] <- row 3 = doubled row 2
    np.testing.assert_array_equal(engine.read_tensor(buf), expected)
    np.testing.assert_array_equal(engine.read_tensor(x), x_expected)
    # Remote buffers take no tile memory; their copies are their own steps.
    profile = engine.profile
    self.assertEqual(int(profile.memory.by_category["variables"].sum()), x.num_elements() * 4)
    copies = [s for s in profile.steps if s.op == "RemoteCopy"]
    self.assertLen(copies, 4)
    self.assertEqual(sum(s.streaming_bytes for s in copies), (10 + 10 + 5 + 5) * 4)
    t = gr.target
    for step in copies:
      self.assertEqual(step.sync_cycles, t.sync_cycles_host)
      self.assertGreaterEqual(step.exchange_cycles,
                              step.streaming_bytes / t.streaming_bytes_per_cycle)
    streaming = profile.streaming
    self.assertEqual(streaming.total_bytes, 80)
    self.assertEqual(streaming.bytes_moved, 120)
    summary = engine.report().summary()
    self.assertIn("Streaming memory", summary)
    self.assertIn("cache", summary)

  def test_bad_copies_fail_before_running(self):
    gr, x, buf, _ = self._graph()
    with self.assertRaisesRegex(ValueError, r"offset 3 is beyond remote buffer 'cache'.*"
                                r"repeats=4; valid offsets are 0\.\.2"):
      g.Engine(gr, g.Copy(buf, x, offset=3))
    with self.assertRaisesRegex(ValueError, "offset -1 is beyond"):
      g.Engine(gr, g.Copy(x, buf, offset=-1))
    with self.assertRaisesRegex(ValueError, "not a whole number of rows"):
      g.Engine(gr, g.Copy(x[0, :3], buf))
    big = gr.add_remote_buffer("small", np.float32, (5,), repeats=1)
    with self.assertRaisesRegex(ValueError, "larger than remote buffer 'small'"):
      g.Engine(gr, g.Copy(x, big))
    ints = gr.add_remote_buffer("ints", np.int32, (5,))
    with self.assertRaisesRegex(ValueError, "dtypes differ"):
      g.Engine(gr, g.Copy(ints, x[0]))
    with self.assertRaisesRegex(ValueError, "already has a remote buffer 'cache'"):
      gr.add_remote_buffer("cache", np.float32, (5,))
    with self.assertRaisesRegex(ValueError, "repeats must be an int >= 1"):
      gr.add_remote_buffer("zero", np.float32, (5,), repeats=0)
    with self.assertRaisesRegex(ValueError, "ipu1 systems have none"):
      g.Graph(ipu_jax.IPUTarget.preset("ipu1", tiles_per_ipu=4)).add_remote_buffer(
          "b", np.float32, (4,))


# -- ipu_jax.jit users -------------------------------------------------------------------

_OPT = optax.adam(1e-2)


def _loss(p, x):
  return jnp.sum(jnp.tanh(x @ p["w"]) ** 2) + jnp.sum(p["b"] ** 2) + p["s"] ** 2


def _train(params, state, xs):
  def step(carry, x):
    p, s = carry
    grads = jax.grad(_loss)(p, x)
    updates, s = _OPT.update(grads, s, p)
    return (optax.apply_updates(p, updates), s), None
  (params, state), _ = jax.lax.scan(step, (params, state), xs)
  return params, state


class JitOffloadTest(chex.TestCase):

  def test_offloaded_state_same_numbers_less_tile_memory(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    # Odd sizes and a scalar leaf (below the offload threshold: stays on tiles).
    params = {"w": jnp.arange(21 * 13, dtype=jnp.float32).reshape(21, 13) / 300,
              "b": jnp.linspace(-1, 1, 37), "s": jnp.float32(0.5)}
    state = _OPT.init(params)
    xs = jnp.asarray(np.random.default_rng(0).standard_normal((3, 7, 21), np.float32))
    on_chip = ipu_jax.jit(_train, target=target)
    offloaded = ipu_jax.jit(_train, target=target, offload_argnums=1, offload_outputs=1)
    # Offloading moves bytes, not arithmetic: the numbers on-chip state gives
    # (whole-program XLA fusions may round the last bit differently).
    result = offloaded(params, state, xs)
    chex.assert_trees_all_close(result, on_chip(params, state, xs), rtol=1e-6, atol=1e-8)
    # And jax.jit's to rounding: three Adam steps of matmuls whose K split sums
    # its partials tile by tile, as the IPU does (not in XLA's order).
    chex.assert_trees_all_close(result, jax.jit(_train)(params, state, xs), rtol=1e-4, atol=1e-6)
    lo, lf = on_chip.lower(params, state, xs), offloaded.lower(params, state, xs)
    state_bytes = _offloaded_bytes(state)
    self.assertEqual(_always_live_total(lo.profile) - _always_live_total(lf.profile),
                     state_bytes)
    streaming = lf.profile.streaming
    self.assertEqual(streaming.total_bytes, state_bytes)
    # In and out once per iteration of the 3-step loop.
    self.assertEqual(streaming.bytes_moved, 2 * 3 * state_bytes)
    copies = [s for s in lf.profile.steps if s.op == "RemoteCopy"]
    self.assertEqual(sum(s.total_cycles * s.executions for s in copies), streaming.cycles)
    self.assertIsNone(lo.profile.streaming)
    # The copies are in the trace, the summary and report.json.
    names = {e["name"] for e in lf.report.trace()["traceEvents"] if e.get("ph") == "X"}
    self.assertIn("from streaming memory: 4 buffers", names)  # one step, one sync
    self.assertIn("RemoteCopy", lf.report.summary())
    document = json.loads(json.dumps(lf.report.to_dict()))
    self.assertEqual(document["streaming"]["total_bytes"], state_bytes)
    self.assertEqual(document["streaming"]["bytes_moved_per_run"], 6 * state_bytes)

  def test_bad_offload_arguments(self):
    with self.assertRaisesRegex(ValueError, "offload_argnums"):
      ipu_jax.jit(_train, offload_argnums=5)
    with self.assertRaisesRegex(ValueError, "both static and offloaded"):
      ipu_jax.jit(_train, offload_argnums=1, static_argnums=1)
    with self.assertRaisesRegex(ValueError, "offload_outputs"):
      ipu_jax.jit(_train, offload_outputs=-1)
    params = {"w": jnp.ones((4, 40)), "b": jnp.ones(40), "s": jnp.float32(0)}
    f = ipu_jax.jit(lambda p, s: (p, s), target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4),
                    offload_argnums=1, offload_outputs=3)
    with self.assertRaisesRegex(ipu_jax.LoweringError, "returns no output 3"):
      f.lower(params, _OPT.init(params))
    h = ipu_jax.jit(lambda p: p, target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4),
                    offload_argnums=0)
    with self.assertRaisesRegex(ipu_jax.LoweringError, "also returned as an on-tile output"):
      h.lower(params)


class ShardedCollectivesTest(chex.TestCase):

  def test_match_lax_and_are_costed_as_ring_phases(self):
    replicas = 4

    def f(v):
      shard = ipu_jax.ops.cross_replica_reduce_scatter(v, replicas)
      return ipu_jax.ops.cross_replica_all_gather(shard * 2.0, replicas)

    def reference(v):
      shard = jax.lax.psum_scatter(v, "replicas", scatter_dimension=0, tiled=True)
      return jax.lax.all_gather(shard * 2.0, "replicas", axis=0, tiled=True)

    x = jnp.asarray(np.random.default_rng(1).standard_normal((replicas, 4 * 7), np.float32))
    expected = jax.vmap(reference, axis_name="replicas")(x)
    chex.assert_trees_all_close(jax.vmap(f, axis_name="replicas")(x), expected, rtol=1e-6)
    lowered = ipu_jax.jit(f, target=ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)).lower(x[0])
    chex.assert_trees_all_close(jax.vmap(lowered.apply, axis_name="replicas")(x), expected,
                                rtol=1e-6)
    steps = {s.op: s for s in lowered.profile.steps}
    scatter = steps["cross_replica_reduce_scatter"]
    gather = steps["cross_replica_all_gather"]
    # One ring phase each: (R - 1) / R of the vector's bytes over the links.
    self.assertEqual(scatter.ipu_link_bytes, int(np.ceil(28 * 4 * 3 / 4)))
    self.assertEqual(gather.ipu_link_bytes, int(np.ceil(28 * 4 * 3 / 4)))
    with self.assertRaisesRegex(ValueError, "not a multiple of replicas=4"):
      ipu_jax.ops.cross_replica_reduce_scatter(jnp.ones(6), 4)


# -- an update's order: weight by weight -------------------------------------------------


def _optax_update(optimizer):
  def update(p, s, g):
    updates, s = optimizer.update(g, s, p)
    return optax.apply_updates(p, updates), s
  return update


def _nested_update(p, s, g):
  """Per-leaf chains through a nested jaxpr (a jit) and a loop: single equations."""
  del s
  scale = jax.jit(lambda x: x * 0.5)
  out = [scale(w) - jax.lax.fori_loop(0, 2, lambda _, a: a * 0.9, d) for w, d in zip(p, g)]
  return out, jnp.float32(len(out))


def _leaves(seed):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for shape in ((3, 5), (7,), (4, 6), (2, 2, 3))]


def _defined_before_use(jaxpr) -> bool:
  defined = set(jaxpr.invars) | set(jaxpr.constvars)
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jax.extend.core.Var) and v not in defined for v in eqn.invars):
      return False
    defined.update(eqn.outvars)
  return all(not isinstance(v, jax.extend.core.Var) or v in defined for v in jaxpr.outvars)


class UpdateOrderTest(chex.TestCase):
  """``lowering/update_order.py``: an update's equations grouped weight by weight."""

  @parameterized.named_parameters(
      ("adam", optax.adam(1e-2)),
      ("lamb", optax.lamb(1e-2)),
      ("clipped", optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))),
      ("nested", None))
  def test_a_valid_order_with_the_same_numbers(self, optimizer):
    params, grads = _leaves(0), _leaves(1)
    if optimizer is None:
      update, state = _nested_update, None
    else:
      update, state = _optax_update(optimizer), optimizer.init(params)
    closed = jax.make_jaxpr(update)(params, state, grads)
    ordered = update_order.chain_order(closed)
    self.assertTrue(_defined_before_use(ordered.jaxpr))
    self.assertCountEqual([id(e) for e in ordered.jaxpr.eqns], [id(e) for e in closed.jaxpr.eqns])
    args = jax.tree.leaves((params, state, grads))
    expected = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*args)
    got = jax.jit(jax.extend.core.jaxpr_as_fun(ordered))(*args)
    for a, b in zip(got, expected):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    # And through the wrapper every program uses.
    ordered_fn = jax.jit(update_order.in_chain_order(update))
    chex.assert_trees_all_equal(ordered_fn(params, state, grads),
                                jax.jit(update)(params, state, grads))

  @parameterized.parameters("adam", "lamb")
  def test_each_weight_updated_before_the_next_starts(self, name):
    optimizer = getattr(optax, name)(1e-2)
    params, grads = _leaves(0), _leaves(1)
    closed = jax.make_jaxpr(_optax_update(optimizer))(params, optimizer.init(params), grads)
    jaxpr = update_order.chain_order(closed).jaxpr
    n = len(params)
    grad_vars = jaxpr.invars[-n:]
    position = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    first_read = [min(i for i, e in enumerate(jaxpr.eqns) if v in e.invars) for v in grad_vars]
    done = [position[v] for v in jaxpr.outvars[:n]]  # the new weights
    # optax's own order starts every leaf's chain before any weight is done.
    self.assertTrue(all(done[k] < first_read[k + 1] for k in range(n - 1)), (done, first_read))

  def test_a_global_norm_keeps_the_chains_together(self):
    # Leaf k's new value reads every leaf (a norm over them all): one chain,
    # still a valid order with the same numbers.
    def update(p, s, g):
      norm = sum(jnp.sum(x * x) for x in g)
      return [w - d / norm for w, d in zip(p, g)], s
    params, grads = _leaves(0), _leaves(1)
    closed = jax.make_jaxpr(update)(params, None, grads)
    ordered = update_order.chain_order(closed)
    self.assertTrue(_defined_before_use(ordered.jaxpr))
    ordered_fn = jax.jit(update_order.in_chain_order(update))
    chex.assert_trees_all_equal(ordered_fn(params, None, grads),
                                jax.jit(update)(params, None, grads))


_PIPE_WEIGHTS = 4  # per stage


def _pipe_loss(params, batch):
  h = batch["x"]
  for k, w in enumerate(params):
    if k and k % _PIPE_WEIGHTS == 0:
      h = pipeline_stage(h, k // _PIPE_WEIGHTS)
    h = jnp.tanh(h @ w)
  return jnp.mean((h - batch["y"]) ** 2)


class PipelinedOffloadedUpdateTest(chex.TestCase):
  """A pipeline stage's LAMB update with offloaded state streams one weight at a time."""

  def test_state_streamed_weight_by_weight_same_weights(self):
    rng = np.random.default_rng(0)
    g, width = 4, 32
    params = [jnp.asarray(rng.normal(size=(width, width)) * 0.2, jnp.float32)
              for _ in range(2 * _PIPE_WEIGHTS)]
    batches = {"x": jnp.asarray(rng.normal(size=(g, 8, width)), jnp.float32),
               "y": jnp.asarray(rng.normal(size=(g, 8, width)), jnp.float32)}
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.auto_select_ipus = 2
    cfg.training.gradient_accumulation_steps = g
    cfg.pipelining.schedule = "Sequential"
    cfg.streaming.offload_optimizer_state = True
    optimizer = optax.lamb(1e-2)
    pipe = Pipeline(_pipe_loss, optimizer, config=cfg)
    out = pipe.step(params, pipe.init(params, batches), batches)
    grads = testing_utils.accumulated_gradients(_pipe_loss, params, batches, g)[0]
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    chex.assert_trees_all_close([np.asarray(p) for p in out.params],
                                optax.apply_updates(params, updates), rtol=1e-5, atol=1e-6)
    p_k = params[:_PIPE_WEIGHTS]
    state = optimizer.init(p_k)
    # The update in optax's trace order, lowered alone: every leaf's state at once.
    traced_order = ipu_jax.jit(stage_programs.update_function(optimizer),
                               config=pipe._stage_config(0),  # pylint: disable=protected-access
                               offload_argnums=1, offload_outputs=1).lower(p_k, state, p_k)
    update = pipe.stages[0].update
    loads = [s for s in update.profile.steps
             if s.op == "RemoteCopy" and s.name.startswith("from streaming memory")]
    self.assertLen(loads, _PIPE_WEIGHTS)  # one load (one sync) per weight: m and v together
    # The tiles hold one weight's state at a time: the peak falls by at least
    # the other weights' state spread over the tiles.
    leaf_state = 2 * width * width * 4  # m and v, float32
    old_peak = int(traced_order.profile.memory.peak.max())
    new_peak = int(update.profile.memory.peak.max())
    self.assertGreaterEqual(old_peak - new_peak, (_PIPE_WEIGHTS - 1) * leaf_state // 16,
                            (old_peak, new_peak))
    # Only the order changed: the same numbers as the traced order's program.
    chex.assert_trees_all_equal(update(p_k, state, grads[:_PIPE_WEIGHTS]),
                                traced_order(p_k, state, grads[:_PIPE_WEIGHTS]))
    # Each moment is loaded into a buffer of its own layout object and its
    # new value, stored back afterwards, is written over it (cost model 24,
    # tests/test_in_place_memory.py): the loaded moment's range ends where a
    # result of its bytes on its tiles begins.
    temps = [t for t in update.profile.tensors if t.category == "temporaries"]
    loaded = [t for t in temps if t.name.startswith("state/")]
    self.assertLen(loaded, 2 * _PIPE_WEIGHTS)  # m and v of each weight
    for moment in loaded:
      self.assertNotEmpty([t for t in temps if t.live_from == moment.live_to + 1
                           and np.array_equal(t.tiles, moment.tiles)
                           and np.array_equal(t.bytes_on_tile, moment.bytes_on_tile)],
                          moment.name)


# -- the training layer ----------------------------------------------------------------


def _model(cfg, optimizer, steps_per_execution=2, **sizes):
  with IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(TinyMLP(nnx.Rngs(0), **sizes))
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy",
                  steps_per_execution=steps_per_execution)
  return model


def _config(tiles=16, replicas=1, offload=False, sharding=False):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.replication_factor = replicas
  cfg.training.replica_reduction = "mean"
  cfg.streaming.offload_optimizer_state = offload
  cfg.streaming.replicated_tensor_sharding = sharding
  return cfg


@pytest.mark.slow
class KerasOffloadTest(chex.TestCase):

  def test_same_weights_and_always_live_falls_by_the_state(self):
    x, y = toy_data(16)
    models = []
    for offload in (False, True):
      model = _model(_config(offload=offload), optax.adam(1e-2))
      model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
      models.append(model)
    on_chip, offloaded = models
    # rtol 1e-6; atol for the last-bit differences XLA's whole-program
    # fusions leave on values near zero (on chip vs jax.jit shows the same).
    chex.assert_trees_all_close(offloaded.params, on_chip.params, rtol=1e-6, atol=1e-8)
    chex.assert_trees_all_close(offloaded.opt_state, on_chip.opt_state, rtol=1e-6, atol=1e-8)
    p_on, p_off = on_chip.train_report.profile, offloaded.train_report.profile
    self.assertEqual(_always_live_total(p_on) - _always_live_total(p_off),
                     _offloaded_bytes(on_chip.opt_state))
    self.assertIn("Streaming memory", offloaded.train_report.summary())


@pytest.mark.slow
class KerasOutOfMemoryTest(chex.TestCase):

  def test_out_of_memory_on_chip_fits_offloaded(self):
    # Activations of a 256-sample batch plus on-chip Adam state overflow 14
    # tiles; with the state in streaming memory the peak fits.
    sizes = dict(features=128, hidden=1024, classes=128)
    x, y = toy_data(256, features=128, classes=128)
    on_chip = _model(_config(tiles=14), optax.adam(1e-3), steps_per_execution=1, **sizes)
    with self.assertRaises(ipu_jax.OutOfMemoryError):
      on_chip.fit(x, y, batch_size=256, epochs=1, verbose=0)
    offloaded = _model(_config(tiles=14, offload=True), optax.adam(1e-3),
                       steps_per_execution=1, **sizes)
    history = offloaded.fit(x, y, batch_size=256, epochs=1, verbose=0)
    self.assertTrue(np.isfinite(history.history["loss"][-1]))
    report = offloaded.train_report
    streaming = report.to_dict()["streaming"]
    self.assertEqual(streaming["total_bytes"], _offloaded_bytes(offloaded.opt_state))
    self.assertGreater(streaming["copy_cycles_per_run"], 0)
    self.assertLessEqual(int(report.profile.memory.peak.max()),
                         report.profile.memory.tile_limit)


@pytest.mark.slow
class ReplicatedTensorShardingTest(chex.TestCase):

  def test_four_replicas_sharded_state(self):
    # Every leaf's quarter is at least 128 bytes, so every shard is offloaded.
    sizes = dict(features=32, hidden=128, classes=128)
    x, y = toy_data(64, features=32, classes=128)
    models = []
    for sharding in (False, True):
      model = _model(_config(replicas=4, offload=True, sharding=sharding), optax.adam(1e-2),
                     steps_per_execution=4, **sizes)
      model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
      models.append(model)
    plain, sharded = models
    chex.assert_trees_all_close(sharded.params, plain.params, rtol=1e-5, atol=1e-7)
    p_plain, p_sharded = plain.train_report.profile, sharded.train_report.profile
    self.assertEqual(p_sharded.streaming.total_bytes * 4, p_plain.streaming.total_bytes)
    ops = sharded.train_report.cycles_by_op()
    self.assertGreater(ops.get("cross_replica_reduce_scatter", 0), 0)
    self.assertGreater(ops.get("cross_replica_all_gather", 0), 0)
    self.assertNotIn("cross_replica_mean", ops)
    self.assertIn("cross_replica_mean", plain.train_report.cycles_by_op())


if __name__ == "__main__":
  absltest.main()
