"""Collectives under named axes: vmap(axis_name=), jax.pmap and jax.shard_map.

Every case runs through ``ipu_jax.jit`` and is compared with plain JAX
(``jax.jit`` of the same function, or ``jax.pmap``). This process has one
host device; the 4-device scenarios (pmap over 4 replicas, a 2 x 2 mesh, a
pmapped training step) run this file as a worker in a subprocess started with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and report back in
JSON.
"""

import functools
import json
import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _target():
  import ipu_jax
  return ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def ipu(fn):
  import ipu_jax
  return ipu_jax.jit(fn, target=_target())


def data(seed, shape, dtype=jnp.float32):
  # Test inputs drawn on the host: jax.random would compile a sampler per shape.
  rng = np.random.default_rng(seed)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(rng.integers(-50, 50, shape), dtype)
  return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def ring_exchange_cycles(target, step_bytes_per_tile, link_bytes):
  """What the all-reduce cost model gives: busiest tile, latency, links."""
  return (step_bytes_per_tile / target.exchange_bytes_per_cycle
          + target.exchange_latency_cycles + link_bytes / target.ipu_link_bytes_per_cycle)


# ---------------------------------------------------------------------------
# The Flax-imagenet-style training step (shared with the 4-device worker).
# ---------------------------------------------------------------------------


def make_train_step(axis_name="batch"):
  """A pmap-style step: loss, grads pmean'd over the axis, an optax update.

  With ``axis_name=None``: the same step on one (big) batch, no collective.
  """
  import flax.linen as nn
  import optax

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(12)(x))
      return nn.Dense(3)(x)

  net = Net()
  tx = optax.sgd(0.1, momentum=0.9)

  def init(seed=0):
    params = net.init(jax.random.key(seed), jnp.zeros((1, 6)))["params"]
    return params, tx.init(params)

  def train_step(state, batch):
    params, opt_state = state
    x, y = batch

    def loss_fn(p):
      logits = net.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    mean = (lambda v: lax.pmean(v, axis_name)) if axis_name else (lambda v: v)
    grads = mean(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": mean(loss),
               "accuracy": mean(jnp.mean(jnp.argmax(logits, -1) == y))}
    return (params, opt_state), metrics

  return init, train_step


def batches(replicas, per_replica=5, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(replicas, per_replica, 6)).astype(np.float32)
  y = rng.integers(0, 3, size=(replicas, per_replica)).astype(np.int32)
  return x, y


def replicate(tree, n):
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), tree)


# ---------------------------------------------------------------------------
# vmap(axis_name=...)
# ---------------------------------------------------------------------------


COLLECTIVES = {
    "psum": lambda v: lax.psum(v, "b"),
    "pmean": lambda v: lax.pmean(v, "b"),
    "pmax": lambda v: lax.pmax(v, "b"),
    "pmin": lambda v: lax.pmin(v, "b"),
    "all_gather": lambda v: lax.all_gather(v, "b"),
    "all_gather_tiled": lambda v: lax.all_gather(v, "b", tiled=True),
    "axis_index": lambda v: v * lax.axis_index("b").astype(v.dtype),
    "psum_scatter": lambda v: lax.psum_scatter(v, "b"),
    "psum_scatter_tiled": lambda v: lax.psum_scatter(v, "b", tiled=True),
    "ppermute": lambda v: lax.ppermute(v, "b", [(0, 1), (1, 2), (2, 0)]),
    "all_to_all": lambda v: lax.all_to_all(v, "b", 0, 0, tiled=True),
}


class VmapCollectivesTest(parameterized.TestCase):
  """The named axis is a batch dimension of the operands inside one program."""

  @parameterized.product(name=sorted(COLLECTIVES), dtype=["float32", "int32"])
  def test_matches_jax_jit(self, name, dtype):
    fn = jax.vmap(COLLECTIVES[name], axis_name="b")
    if name == "pmean" and dtype == "int32":
      dtype = "float32"
    # Axis size 3; the per-replica leading dimension 6 splits over it.
    x = data(1, (3, 6, 7), jnp.dtype(dtype))
    chex.assert_trees_all_close(ipu(fn)(x), jax.jit(fn)(x), rtol=1e-5)

  @parameterized.named_parameters(
      ("scalar", (5,)), ("odd", (7, 33)), ("empty", (3, 0)), ("one_replica", (1, 4)))
  def test_shapes(self, shape):
    fn = jax.vmap(lambda v: (lax.psum(v, "b"), lax.pmax(v, "b"), lax.pmean(v, "b"),
                             lax.all_gather(v, "b"), lax.axis_index("b")), axis_name="b")
    x = data(2, shape)
    chex.assert_trees_all_close(ipu(fn)(x), jax.jit(fn)(x), rtol=1e-5)

  def test_in_axes_variants(self):
    def step(v, w, s):
      return lax.psum(v * w, "b") + s, lax.pmean(w, "b"), lax.all_gather(v, "b", axis=1)

    v, w, s = data(3, (4, 9)), data(4, (9, 4)), data(5, ())
    for in_axes, args in [((0, 1, None), (v, w, s)),
                          ((1, None, None), (v.T, w[:, 0], s)),
                          ((None, 1, None), (v[0], w, s))]:
      fn = jax.vmap(step, in_axes=in_axes, out_axes=1, axis_name="b")
      chex.assert_trees_all_close(ipu(fn)(*args), jax.jit(fn)(*args), rtol=1e-5,
                                  custom_message=str(in_axes))

  def test_nested_named_axes(self):
    fn = jax.vmap(jax.vmap(lambda v: lax.psum(v, ("i", "j")) + lax.pmax(v, "i"),
                           axis_name="j"), axis_name="i")
    x = data(6, (3, 4, 5))
    chex.assert_trees_all_close(ipu(fn)(x), jax.jit(fn)(x), rtol=1e-5)

  def test_stays_on_the_tiles(self):
    fn = jax.vmap(lambda v: lax.psum(v, "b"), axis_name="b")
    lowered = ipu(fn).lower(data(7, (4, 64)))
    self.assertEqual(sum(s.ipu_link_bytes for s in lowered.profile.steps), 0)
    # A tile reduction: the psum's steps compute on several tiles.
    psum = [s for s in lowered.profile.steps if s.op == "psum"]
    self.assertNotEmpty(psum)
    self.assertGreater(max(int((s.compute_cycles > 0).sum()) for s in psum), 1)

  def test_vmapped_training_step_matches_jax(self):
    init, train_step = make_train_step()
    state = replicate(init(), 3)
    x, y = batches(3)
    fn = jax.vmap(train_step, axis_name="batch")
    chex.assert_trees_all_close(ipu(fn)(state, (x, y)), jax.jit(fn)(state, (x, y)),
                                rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# pmap and shard_map on this process's one device
# ---------------------------------------------------------------------------


class OneDeviceTest(parameterized.TestCase):
  """A pmap/shard_map axis of one device: one IPU replica."""

  def test_pmap_collectives(self):
    def body(v):
      return (lax.psum(v, "i"), lax.pmean(v, "i"), lax.pmax(v, "i"),
              lax.all_gather(v, "i"), v * lax.axis_index("i"))

    f = jax.pmap(body, axis_name="i")
    x = data(8, (1, 5, 7))
    chex.assert_trees_all_close(ipu(f)(x), f(x), rtol=1e-5)
    # One replica: nothing crosses the IPU-Links.
    lowered = ipu(f).lower(x)
    self.assertEqual(sum(s.ipu_link_bytes for s in lowered.profile.steps), 0)

  @parameterized.named_parameters(
      ("scalar", (1,), "float32"), ("empty", (1, 0), "float32"),
      ("bfloat16", (1, 3, 5), "bfloat16"), ("int32", (1, 7), "int32"))
  def test_pmap_shapes_and_dtypes(self, shape, dtype):
    f = jax.pmap(lambda v: (lax.psum(v, "i"), lax.pmax(v, "i"), lax.all_gather(v, "i"),
                            lax.axis_index("i")), axis_name="i")
    x = data(13, shape, jnp.dtype(dtype))
    chex.assert_trees_all_close(ipu(f)(x), f(x), rtol=1e-5)

  @parameterized.parameters(True, False)
  def test_shard_map(self, check_vma):
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    f = jax.shard_map(lambda v, w: (lax.psum(v @ w, "i"), v * 2), mesh=mesh,
                      in_specs=(P("i"), P()), out_specs=(P(), P("i")), check_vma=check_vma)
    v, w = data(9, (5, 3)), data(10, (3, 4))
    chex.assert_trees_all_close(ipu(f)(v, w), jax.jit(f)(v, w), rtol=1e-5)

  def test_axis_index_groups_is_rejected(self):
    import ipu_jax
    f = jax.pmap(lambda v: lax.psum(v, "i", axis_index_groups=[[0]]), axis_name="i")
    with self.assertRaisesRegex(ipu_jax.LoweringError, r"'psum'.*axis_index_groups"):
      ipu(f).lower(data(11, (1, 3)))

  def test_unbound_axis_is_rejected(self):
    import ipu_jax
    from ipu_jax.lowering.context import LoweringContext
    from ipu_jax.lowering.lower import lower_closed_jaxpr
    # A jaxpr traced with an axis environment the program does not provide.
    closed = jax.make_jaxpr(lambda v: lax.psum(v, "k"), axis_env=[("k", 2)])(data(12, (3,)))
    ctx = LoweringContext(_target())
    x = ctx.new_tensor((3,), np.float32)
    with self.assertRaisesRegex(ipu_jax.LoweringError,
                                r"'psum'.*float32\[3\].*test_named_axis_collectives.py:\d+.*'k'"):
      lower_closed_jaxpr(ctx, closed, [x])


# ---------------------------------------------------------------------------
# Four devices (a subprocess)
# ---------------------------------------------------------------------------


def _worker(out_path):
  """Runs the 4-device scenarios; writes what the tests check as JSON."""
  import ipu_jax
  from jax.sharding import Mesh, PartitionSpec as P
  target = _target()
  report = {"devices": jax.device_count(), "max_error": {}}

  def compare(name, got, want):
    errors = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a, np.float64)
                                                           - np.asarray(b, np.float64)),
                                                    initial=0.0)
                                             / (1.0 + np.max(np.abs(np.asarray(b, np.float64)),
                                                             initial=0.0))), got, want)
    report["max_error"][name] = max(jax.tree.leaves(errors))

  def body(v):
    return (lax.psum(v, "i"), lax.pmean(v, "i"), lax.pmax(v, "i"), lax.pmin(v, "i"),
            lax.all_gather(v, "i", axis=1, tiled=True), v * lax.axis_index("i"),
            lax.ppermute(v, "i", [(0, 1), (1, 2), (2, 3), (3, 0)]),
            lax.psum_scatter(v, "i", tiled=True), lax.all_to_all(v, "i", 0, 0, tiled=True),
            jax.vmap(lambda r: lax.psum(r, ("i", "b")), axis_name="b")(v),
            ipu_jax.ops.cross_replica_mean(v, "i"))

  pmapped = jax.pmap(body, axis_name="i")
  x = data(0, (4, 8, 5))
  compare("pmap_collectives", ipu(pmapped)(x), pmapped(x))

  # The all-reduce of a pmapped psum: a ring over 4 replicas.
  lowered = ipu(jax.pmap(lambda v: lax.psum(v, "i"), axis_name="i")).lower(x)
  step = next(s for s in lowered.profile.steps if s.name.startswith("all_reduce"))
  # The IPU op's all-reduce over a pmap axis is costed the same.
  ipu_op = ipu(jax.pmap(lambda v: ipu_jax.ops.cross_replica_sum(v, "i"), axis_name="i"))
  ipu_op_step = next(s for s in ipu_op.lower(x).profile.steps
                     if s.name.startswith("all_reduce"))
  report["all_reduce"] = {
      "name": step.name, "link_bytes": int(step.ipu_link_bytes),
      "exchange_cycles": float(step.exchange_cycles),
      "bytes_in_max": int(step.exchange_bytes_in.max()),
      "bytes_in_total": int(step.exchange_bytes_in.sum()),
      "ipu_op_link_bytes": int(ipu_op_step.ipu_link_bytes),
      "ipu_op_exchange_cycles": float(ipu_op_step.exchange_cycles),
      "shard_bytes": 8 * 5 * 4, "tiles_used": int((step.exchange_bytes_in > 0).sum()),
      "steps": [s.name for s in lowered.profile.steps],
      "summary": lowered.report.summary()}

  # Per-replica PRNG keys and a broadcast (in_axes=None) argument.
  keyed = jax.pmap(lambda k, v, w: lax.pmean(v * w + jax.random.normal(k, v.shape), "i"),
                   in_axes=(0, 0, None), axis_name="i")
  keys, w = jax.random.split(jax.random.key(2), 4), data(3, (5,))
  compare("pmap_keys_broadcast", ipu(keyed)(keys, x, w), keyed(keys, x, w))

  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
  meshed = jax.shard_map(
      lambda v: (lax.psum(v, "a"), lax.psum(v, ("a", "b")), lax.pmax(v, "b"),
                 v * lax.axis_index("a") + lax.axis_index("b")),
      mesh=mesh, in_specs=P("a", "b"), out_specs=(P(None, "b"), P(), P("a"), P("a", "b")))
  xm = data(1, (6, 10))
  compare("mesh_2x2", ipu(meshed)(xm), jax.jit(meshed)(xm))

  partial = jax.shard_map(lambda v: lax.psum(v, "a"), mesh=mesh, in_specs=P("a"),
                          out_specs=P(), axis_names={"a"})
  try:
    ipu(jax.jit(partial)).lower(xm)
    report["partial_auto_error"] = ""
  except ipu_jax.LoweringError as e:
    report["partial_auto_error"] = str(e)

  init, train_step = make_train_step()
  state = replicate(init(), 4)
  xb, yb = batches(4)
  step_fn = jax.pmap(train_step, axis_name="batch")
  ipu_step = ipu(step_fn)
  ipu_state, jax_state = state, state
  for i in range(3):
    ipu_state, ipu_metrics = ipu_step(ipu_state, (xb, yb))
    jax_state, jax_metrics = step_fn(jax_state, (xb, yb))
  compare("train_state", ipu_state, jax_state)
  compare("train_metrics", ipu_metrics, jax_metrics)
  report["loss_decreased"] = bool(float(ipu_metrics["loss"][0]) < float(
      step_fn(state, (xb, yb))[1]["loss"][0]))
  # jax.jit of the same step over the 4 shards as one batch: pmean'd grads
  # of equal shards are the gradient of the mean loss.
  _, big_step = make_train_step(None)
  big_step = jax.jit(big_step)
  big_state = init()
  for i in range(3):
    big_state, big_metrics = big_step(big_state, (xb.reshape(-1, 6), yb.reshape(-1)))
  compare("train_vs_one_batch", jax.tree.map(lambda a: a[0], ipu_state), big_state)
  compare("train_metrics_vs_one_batch", jax.tree.map(lambda a: a[0], ipu_metrics), big_metrics)
  train_lowered = ipu_step.lower(state, (xb, yb))
  reduces = [s for s in train_lowered.profile.steps if s.name.startswith("all_reduce")]
  params_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(init()[0]))
  report["train"] = {"all_reduces": len(reduces),
                     "link_bytes": int(sum(s.ipu_link_bytes for s in reduces)),
                     "program_link_bytes": int(sum(s.ipu_link_bytes
                                                   for s in train_lowered.profile.steps)),
                     "params_bytes": int(params_bytes)}
  with open(out_path, "w") as f:
    json.dump(report, f)


class FourDevicesTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    import tempfile
    cls._dir = tempfile.TemporaryDirectory()
    out = os.path.join(cls._dir.name, "report.json")
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, HERE, "worker", out], env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
      cls.report = json.load(f)

  @classmethod
  def tearDownClass(cls):
    cls._dir.cleanup()
    super().tearDownClass()

  def test_four_devices(self):
    self.assertEqual(self.report["devices"], 4)

  def test_numbers_equal_jax(self):
    for name, error in self.report["max_error"].items():
      self.assertLessEqual(error, 1e-5, name)

  def test_all_reduce_is_costed_as_a_ring_over_ipu_links(self):
    r = self.report["all_reduce"]
    self.assertEqual(r["name"], "all_reduce<sum>x4")
    # 2 (R - 1) / R of the replica's shard leaves each IPU over its links.
    self.assertEqual(r["link_bytes"], int(np.ceil(2 * 3 / 4 * r["shard_bytes"])))
    target = _target()
    expected = ring_exchange_cycles(target, r["bytes_in_max"], r["link_bytes"])
    self.assertAlmostEqual(r["exchange_cycles"], expected, places=6)
    self.assertEqual(r["ipu_op_link_bytes"], r["link_bytes"])
    self.assertEqual(r["ipu_op_exchange_cycles"], r["exchange_cycles"])
    # Each tile receives 1.5x the bytes it holds (rounded up per tile).
    self.assertBetween(r["bytes_in_total"] - 1.5 * r["shard_bytes"], 0, r["tiles_used"])
    # The body is one replica's: entered by slicing, left by an all-gather.
    self.assertEqual(r["steps"][0], "shard_map/slice")
    self.assertEqual(r["steps"][-1], "shard_map/blocks x4")
    self.assertIn("IPU-Link traffic", r["summary"])

  def test_training_step(self):
    train = self.report["train"]
    # One all-reduce per gradient leaf (4) plus the two metrics.
    self.assertEqual(train["all_reduces"], 6)
    # Ring share 2 (R - 1) / R = 1.5 of the parameters, and of two f32 scalars.
    self.assertEqual(train["link_bytes"], int(1.5 * train["params_bytes"]) + 2 * 6)
    # Nothing else crosses the links: the replicas keep their state.
    self.assertEqual(train["program_link_bytes"], train["link_bytes"])
    self.assertTrue(self.report["loss_decreased"])

  def test_partially_automatic_mesh_is_rejected(self):
    message = self.report["partial_auto_error"]
    self.assertIn("shard_map", message)
    self.assertIn("['b']", message)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "worker":
    from absl import flags
    flags.FLAGS.mark_as_parsed()
    _worker(sys.argv[2])
  else:
    absltest.main()
