"""Tests of the IPU custom primitives (ipu_jax.ops) and their tile lowerings."""

import contextlib
import io

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import ops
from ipu_jax.graph import codelet
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.exchange import movement_cost
from ipu_jax.lowering.rules import parallel as rules
import testing_utils

T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
AXIS = "replicas"


def ipu(fn, target=T16, mode=None):
  config = None
  if mode is not None:
    config = ipu_jax.IPUConfig()
    config.executor.mode = mode
  return ipu_jax.jit(fn, target=target, config=config)


def normal(seed, shape, dtype=jnp.float32):
  """Seeded normal test inputs, drawn on the host (no sampler compiled per shape)."""
  x = np.random.default_rng(seed).standard_normal(shape, np.float32)
  return jax.device_put(x.astype(jnp.dtype(dtype)))


def _split_k_operands():
  """The split-K operands: jax.random's draw, whose sequential fp32 sum is
  known to break atol=1e-4 (SumErrorBoundTest depends on these values)."""
  return (jax.random.normal(jax.random.key(1), (64, 4096)),
          jax.random.normal(jax.random.key(2), (4096, 8)))


@codelet(inputs=("x", "w"), outputs=("y",), cycles=lambda x, w, y: 20)
def sin_scale(x, w):
  return jnp.sin(x) * w


@codelet(inputs=("x",), outputs=("total", "shifted"),
         cycles=lambda x, total, shifted: 10 + x.size, flops=lambda x, t, s: x.size)
def two_outputs(x):
  return {"total": jnp.sum(x, keepdims=True), "shifted": x - jnp.mean(x)}


@codelet(inputs=("x",), inouts=("acc",), cycles=lambda x, acc: 7)
def accumulate(x, acc):
  return acc + 2.0 * x


class TileMapTest(parameterized.TestCase):

  def test_reference_semantics(self):
    x, w = normal(0, (5, 3)), normal(1, (5, 3))
    chex.assert_trees_all_close(ops.tile_map(sin_scale, x, w), jnp.sin(x) * w)
    out = ops.tile_map(two_outputs, x, tiles=[4, 3, 2, 1, 0])
    chex.assert_trees_all_close(out["total"], jnp.sum(x, axis=1, keepdims=True), rtol=1e-6)
    chex.assert_trees_all_close(out["shifted"], x - jnp.mean(x, axis=1, keepdims=True),
                                rtol=1e-6)
    chex.assert_trees_all_close(ops.tile_map(accumulate, x, w), w + 2 * x)

  def test_jit_grad_vmap_without_emulator(self):
    x, w = normal(0, (4, 6)), normal(1, (4, 6))
    fn = lambda x, w: ops.tile_map(sin_scale, x, w, tiles=[3, 5, 7, 9])
    chex.assert_trees_all_close(jax.jit(fn)(x, w), jnp.sin(x) * w)
    loss = lambda x, w: jnp.sum(fn(x, w) ** 2)
    ref = lambda x, w: jnp.sum((jnp.sin(x) * w) ** 2)
    chex.assert_trees_all_close(jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w),
                                jax.grad(ref, argnums=(0, 1))(x, w), rtol=1e-6)
    xs = normal(2, (3, 4, 6))
    chex.assert_trees_all_close(jax.vmap(fn, in_axes=(0, None))(xs, w),
                                jnp.sin(xs) * w, rtol=1e-6)
    chex.assert_trees_all_close(jax.vmap(fn, in_axes=(2, None), out_axes=1)(
        jnp.moveaxis(xs, 0, 2), w), jnp.moveaxis(jnp.sin(xs) * w, 0, 1), rtol=1e-6)

  @parameterized.parameters("batched", "per_tile")
  def test_on_tiles_matches_jit(self, mode):
    x, w = normal(0, (5, 7)), normal(1, (5, 7))
    fn = lambda x, w: ops.tile_map(sin_scale, x, w, tiles=[3, 15, 7, 0, 9])
    chex.assert_trees_all_equal(ipu(fn, mode=mode)(x, w), jax.jit(fn)(x, w))
    fn2 = lambda x: ops.tile_map(two_outputs, x)
    chex.assert_trees_all_close(ipu(fn2, mode=mode)(x), jax.jit(fn2)(x), rtol=1e-6)

  def test_grad_and_vmap_on_tiles(self):
    x, w = normal(0, (4, 6)), normal(1, (4, 6))
    loss = lambda x, w: jnp.sum(ops.tile_map(sin_scale, x, w, tiles=[2, 4, 6, 8]) * w)
    grad = jax.grad(loss, argnums=(0, 1))
    chex.assert_trees_all_close(ipu(grad)(x, w), jax.jit(grad)(x, w), rtol=1e-6)
    batched = jax.vmap(lambda x: ops.tile_map(sin_scale, x, w))
    xs = normal(2, (3, 4, 6))
    chex.assert_trees_all_close(ipu(batched)(xs), jax.jit(batched)(xs), rtol=1e-6)

  def test_cost_follows_placement(self):
    x = normal(0, (16, 32))
    w = jnp.ones((16, 32))
    in_place = ipu(lambda x, w: ops.tile_map(sin_scale, x, w)).lower(x, w)
    step = next(s for s in in_place.profile.steps if s.name.startswith("tile_map"))
    # Linear mapping already puts row i on tile i: nothing moves.
    self.assertEqual(int(step.exchange_bytes_in.sum()), 0)
    # One vertex of 20 cycles per tile: 6 contexts x 20 + supervisor.
    expected = 20 * T16.worker_contexts + T16.supervisor_overhead_cycles
    np.testing.assert_allclose(step.compute_cycles, np.full(16, expected))
    moved = ipu(lambda x, w: ops.tile_map(sin_scale, x, w, tiles=list(range(15, -1, -1)))
                ).lower(x, w)
    step = next(s for s in moved.profile.steps if s.name.startswith("tile_map"))
    self.assertEqual(int(step.exchange_bytes_in.sum()), 2 * x.nbytes)
    self.assertGreater(moved.report.total_cycles, in_place.report.total_cycles)

  def test_errors(self):
    x = jnp.ones((4, 2))
    with self.assertRaises(ValueError):
      ops.tile_map(sin_scale, x, jnp.ones((3, 2)))
    with self.assertRaises(ValueError):
      ops.tile_map(sin_scale, x, x, tiles=[0, 1])
    with self.assertRaises(ipu_jax.LoweringError):
      ipu(lambda x: ops.tile_map(sin_scale, x, x, tiles=[0, 1, 2, 99]))(x)
    with self.assertRaisesRegex(TypeError, "tile ids must be integers"):
      ops.tile_map(sin_scale, x, x, tiles=[0.5, 1, 2, 3])  # was read as tile 0
    bad = codelet(inputs=("x",), outputs=("y",),
                  cycles=lambda *specs: "12x")(lambda x: x + 1)
    with self.assertRaisesRegex(ValueError, "cycles function must return a number >= 0 .* "
                                            "'12x'"):
      ipu(lambda x: ops.tile_map(bad, x))(x)  # was int()'s "invalid literal"


class CollectiveTest(parameterized.TestCase):

  def test_single_replica(self):
    x = normal(0, (3, 2))
    chex.assert_trees_all_equal(ops.cross_replica_sum(x), x)
    chex.assert_trees_all_equal(jax.jit(ops.cross_replica_mean)(x), x)
    self.assertEqual(int(ops.replica_index()), 0)
    self.assertEqual(int(jax.jit(ops.replica_index)()), 0)
    with self.assertRaises(TypeError):
      ops.cross_replica_mean(jnp.arange(3))

  def test_vmap_replicas_match_lax(self):
    xs = normal(0, (4, 3))
    for op, ref in ((ops.cross_replica_sum, lambda x: lax.psum(x, AXIS)),
                    (ops.cross_replica_mean, lambda x: lax.pmean(x, AXIS))):
      chex.assert_trees_all_close(jax.vmap(op, axis_name=AXIS)(xs),
                                  jax.vmap(ref, axis_name=AXIS)(xs), rtol=1e-6)
      chex.assert_trees_all_close(jax.jit(jax.vmap(op, axis_name=AXIS))(xs),
                                  jax.vmap(ref, axis_name=AXIS)(xs), rtol=1e-6)
      # Another vmap axis is not a replica axis: the op maps over it.
      two = jax.vmap(jax.vmap(op, axis_name=AXIS), axis_name="batch")
      two_ref = jax.vmap(jax.vmap(ref, axis_name=AXIS), axis_name="batch")
      chex.assert_trees_all_close(two(xs.reshape(2, 2, 3)), two_ref(xs.reshape(2, 2, 3)),
                                  rtol=1e-6)
    idx = jax.vmap(lambda x: ops.replica_index(), axis_name=AXIS)(xs)
    chex.assert_trees_all_equal(idx, jnp.arange(4, dtype=jnp.int32))

  def test_one_meaning_per_name(self):
    # The training layer's all-reduces are these ops (one meaning, arrays or
    # pytrees), over the same replica axis.
    from ipu_jax.keras import replication
    self.assertIs(replication.cross_replica_sum, ops.cross_replica_sum)
    self.assertIs(replication.cross_replica_mean, ops.cross_replica_mean)
    self.assertEqual(replication.REPLICA_AXIS, ops.REPLICA_AXIS)
    tree = {"w": normal(0, (4, 3)), "b": [normal(1, (4,))]}
    for op, ref in ((ops.cross_replica_sum, lambda x: lax.psum(x, AXIS)),
                    (ops.cross_replica_mean, lambda x: lax.pmean(x, AXIS))):
      got = jax.vmap(op, axis_name=AXIS)(tree)
      chex.assert_trees_all_close(got, jax.vmap(ref, axis_name=AXIS)(tree), rtol=1e-6)
      chex.assert_trees_all_close(jax.vmap(lambda t: op(t, AXIS), axis_name=AXIS)(tree), got)

  def test_grad_under_vmap(self):
    xs = normal(0, (4, 3))
    for op, ref in ((ops.cross_replica_sum, lambda x: lax.psum(x, AXIS)),
                    (ops.cross_replica_mean, lambda x: lax.pmean(x, AXIS))):
      grad = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(op(x)) * x)), axis_name=AXIS)
      grad_ref = jax.vmap(jax.grad(lambda x: jnp.sum(jnp.sin(ref(x)) * x)), axis_name=AXIS)
      chex.assert_trees_all_close(grad(xs), grad_ref(xs), rtol=1e-6)

  @parameterized.parameters(True, False)
  def test_shard_map(self, check_vma):
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    spec = jax.sharding.PartitionSpec(AXIS)
    xs = jax.device_put(normal(0, (jax.device_count() * 2, 3)),
                        jax.sharding.NamedSharding(mesh, spec))

    def run(op):
      body = lambda x: op(x) * x
      return jax.jit(jax.grad(lambda x: jnp.sum(jax.shard_map(
          body, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)(x) ** 2)))(xs)

    chex.assert_trees_all_close(run(ops.cross_replica_sum),
                                run(lambda x: lax.psum(x, AXIS)), rtol=1e-6)
    chex.assert_trees_all_close(run(ops.cross_replica_mean),
                                run(lambda x: lax.pmean(x, AXIS)), rtol=1e-6)

  def test_tile_program_under_replica_vmap(self):
    xs = normal(0, (4, 1000))
    fn = lambda x: ops.cross_replica_sum(x) * 2 + ops.replica_index()
    ref = lambda x: lax.psum(x, AXIS) * 2 + lax.axis_index(AXIS)
    expected = jax.vmap(ref, axis_name=AXIS)(xs)
    f = ipu(fn)
    # The emulated program itself runs inside the replica vmap.
    chex.assert_trees_all_close(jax.vmap(f, axis_name=AXIS)(xs), expected, rtol=1e-6)
    chex.assert_trees_all_close(jax.vmap(ipu(fn, mode="per_tile"), axis_name=AXIS)(xs),
                                expected, rtol=1e-6)
    # Lowered inside the vmap, the all-reduce is costed for 4 replicas.
    lowered = {}

    def inner(x):
      g = ipu(lambda x: ops.cross_replica_mean(x))
      lowered["program"] = g.lower(x)
      return g(x)

    chex.assert_trees_all_close(jax.vmap(inner, axis_name=AXIS)(xs),
                                jax.vmap(lambda x: lax.pmean(x, AXIS), axis_name=AXIS)(xs),
                                rtol=1e-6)
    step = lowered["program"].profile.steps[0]
    self.assertEqual(step.ipu_link_bytes, int(np.ceil(1.5 * 4000)))
    self.assertEqual(int(step.exchange_bytes_in.sum()), 6000)
    self.assertGreater(step.exchange_cycles, 6000 / T16.ipu_link_bytes_per_cycle)
    self.assertGreater(step.compute_cycles.max(), 0)
    # Outside any replica axis: one replica, nothing crosses the links.
    single = ipu(fn).lower(xs[0])
    self.assertEqual(sum(s.ipu_link_bytes for s in single.profile.steps), 0)
    chex.assert_trees_all_close(ipu(fn)(xs[0]), 2 * xs[0], rtol=1e-6)

  def test_replication_factor_from_context(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=16)
    ctx = LoweringContext(target, replication_factor=4)
    x = ctx.new_tensor((64, 16), np.float32)
    self.assertEqual(rules.replication_factor(ctx, AXIS), 4)
    exchange, compute = rules.all_reduce_cost(ctx, x, 4)
    on_tile = x.mapping.bytes_per_tile(target.num_tiles, 4)
    np.testing.assert_array_equal(exchange.bytes_in, np.ceil(on_tile * 1.5))
    np.testing.assert_array_equal(exchange.bytes_out, np.ceil(on_tile * 1.5))
    ipu_bytes = on_tile.reshape(2, 16).sum(axis=1)
    np.testing.assert_array_equal(exchange.link_bytes_out, np.ceil(ipu_bytes * 1.5))
    self.assertEqual(int(exchange.link_bytes_out.sum()), int(1.5 * x.nbytes))
    self.assertTrue((compute[on_tile > 0] > 0).all())


class MatmulTest(parameterized.TestCase):

  @parameterized.parameters(
      ((3, 4), (4, 5)), ((2, 33, 17), (17, 9)), ((7,), (7, 3)), ((5, 6), (6,)),
      ((2, 1, 5, 6), (3, 6, 4)), ((100, 300), (300, 70)), ((3, 50, 200), (3, 200, 30)))
  def test_matches_jnp_and_tiles(self, sa, sb):
    a, b = normal(1, sa), normal(2, sb)
    ref = jnp.matmul(a, b)
    chex.assert_trees_all_close(ops.matmul(a, b), ref, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(jax.jit(ops.matmul)(a, b), ref, rtol=1e-5, atol=1e-5)
    # The tile plan may sum in another order than XLA: both lie within the
    # product's rounding-error bound.
    testing_utils.assert_within_sum_bound(ipu(ops.matmul)(a, b), np.matmul, a, b, against=ref)

  def test_per_tile_mode_and_split_k(self):
    a, b = _split_k_operands()
    fn = lambda a, b: ops.matmul(a, b, available_memory_proportion=0.05)
    # A 4096-long fp32 contraction is off the exact product by an amount that
    # depends on the machine's summation order (XLA's is ~1.2e-4 here and
    # ~1.9e-4 on another machine): hold it to the rounding-error bound.
    for mode in ("batched", "per_tile"):
      f = ipu(fn, mode=mode)
      testing_utils.assert_within_sum_bound(f(a, b), np.matmul, a, b)
    names = [s.name for s in f.lower(a, b).profile.steps]
    self.assertTrue(names[-1].endswith("reduce"), names)

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half(self, dtype):
    a, b = normal(1, (2, 24, 40), dtype), normal(2, (40, 16), dtype)
    ref = jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)
    chex.assert_trees_all_close(ops.matmul(a, b), ref, rtol=1e-2)
    chex.assert_trees_all_close(ipu(ops.matmul)(a, b).astype(jnp.float32),
                                ref.astype(jnp.float32), rtol=2e-2, atol=2e-2)
    low = ops.matmul(a, b, partials_type="float16")
    self.assertEqual(low.dtype, dtype)

  def test_grad_and_vmap(self):
    a, b = normal(1, (5, 6)), normal(2, (6, 3))
    loss = lambda a, b: jnp.sum(jnp.tanh(ops.matmul(a, b)))
    ref = lambda a, b: jnp.sum(jnp.tanh(a @ b))
    grad, grad_ref = jax.grad(loss, argnums=(0, 1)), jax.grad(ref, argnums=(0, 1))
    want = jax.jit(grad_ref)(a, b)
    chex.assert_trees_all_close(jax.jit(grad)(a, b), want, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(ipu(grad)(a, b), want, rtol=1e-5, atol=1e-6)
    # Broadcast batch dims: the cotangent is summed back to the operand.
    a3, b3 = normal(3, (4, 5, 6)), normal(4, (1, 6, 3))
    chex.assert_trees_all_close(jax.jit(jax.grad(loss, argnums=(0, 1)))(a3, b3),
                                jax.jit(jax.grad(ref, argnums=(0, 1)))(a3, b3), rtol=1e-5)
    xs, bs = normal(5, (7, 5, 6)), normal(6, (7, 6, 3))
    for axes, args in (((0, None), (xs, b)), ((None, 0), (a, bs)), ((0, 0), (xs, bs)),
                       ((2, 0), (jnp.moveaxis(xs, 0, 2), bs))):
      chex.assert_trees_all_close(jax.jit(jax.vmap(ops.matmul, in_axes=axes))(*args),
                                  jax.jit(jax.vmap(jnp.matmul, in_axes=axes))(*args),
                                  rtol=1e-5)
    batched = jax.vmap(ops.matmul, in_axes=(0, None))
    chex.assert_trees_all_close(ipu(batched)(xs, b), jnp.matmul(xs, b), rtol=1e-5, atol=1e-5)

  def test_options_override_plan(self):
    from ipu_jax.lowering.matmul_plan import plan_matmul
    a, b = normal(1, (128, 512)), normal(2, (512, 64))
    plans = {}
    for amp in (1.0, 0.02):
      lowered = ipu(lambda a, b: ops.matmul(a, b, available_memory_proportion=amp)).lower(a, b)
      plans[amp] = lowered.profile.steps[0].name
      expected = plan_matmul(T16, 1, 128, 64, 512, np.float32, np.float32, amp)
      self.assertIn(expected.label, plans[amp])
    self.assertNotEqual(plans[1.0], plans[0.02])
    with self.assertRaises(ValueError):
      ops.matmul(a, b, available_memory_proportion=1.5)
    with self.assertRaisesRegex(ValueError, "partials_type must be 'float32' or 'float16', "
                                            "got 'foo'"):
      ops.matmul(a, b, partials_type="foo")  # was NumPy's "data type not understood"

  # One plan without and one with a K split. The first shape changed with the
  # AMP estimator (issue 12): it no longer charges 1 cycle per 2 outputs on top
  # of the MACs, so K splits got relatively cheaper and [30x90]x[90x20] now
  # splits K. How many ways K is split is the planner's choice, not asserted.
  @parameterized.parameters((30, 12, 20, False), (20, 400, 30, True))
  def test_exchange_is_exact(self, m, k, n, k_split):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    a, b = normal(1, (m, k)), normal(2, (k, n))
    lowered = ipu(ops.matmul, target=target).lower(a, b)
    steps = lowered.program.programs
    name = steps[0].name
    grid = [int(v[1:]) for v in name.split("grid ")[1].split(" ")[0].split(".")]
    block = [int(v) for v in name.split("blocks ")[1].split("]")[0].split("x")]
    gb, gm, gn, gk = grid
    _, bm, bn, bk = block
    self.assertEqual((gb, gk > 1), (1, k_split))
    self.assertLen(steps, 1 if gk == 1 else 2)
    # Grid tile g of the plan holds storage row g of its result.
    phys = steps[0].writes[0].mapping.tiles
    ta, tb = lowered.inputs
    g = lambda im, in_, ik: (im * gn + in_) * gk + ik
    # A element (m, k) goes to the tiles of every n block (one multicast);
    # B element (k, n) to those of every m block.
    mi, ki, jn = np.meshgrid(np.arange(m), np.arange(k), np.arange(gn), indexing="ij")
    a_id = (mi * k + ki).reshape(-1)
    cost_a = movement_cost(target, ta.mapping.element_tile[a_id],
                           phys[g(mi // bm, jn, ki // bk)].reshape(-1), 4, a_id)
    ki, ni, jm = np.meshgrid(np.arange(k), np.arange(n), np.arange(gm), indexing="ij")
    b_id = (ki * n + ni).reshape(-1)
    cost_b = movement_cost(target, tb.mapping.element_tile[b_id],
                           phys[g(jm, ni // bn, ki // bk)].reshape(-1), 4, b_id)
    expected = cost_a + cost_b
    got = steps[0].exchange
    np.testing.assert_array_equal(got.bytes_in, expected.bytes_in)
    np.testing.assert_array_equal(got.bytes_out, expected.bytes_out)
    np.testing.assert_array_equal(got.link_bytes_out, expected.link_bytes_out)
    testing_utils.assert_within_sum_bound(lowered(a, b), np.matmul, a, b, against=a @ b)
    if gk == 1:
      return
    # Reduce: every k-partial of an output element goes to its reducing tile.
    out = steps[1].writes[0]
    om, on = np.meshgrid(np.arange(m), np.arange(n), indexing="ij")
    src = np.stack([phys[g(om // bm, on // bn, j)].reshape(-1) for j in range(gk)])
    dst = np.broadcast_to(out.mapping.element_tile, src.shape)
    ids = np.arange(src.size)
    expected = movement_cost(target, src.reshape(-1), dst.reshape(-1), 4, ids)
    got = steps[1].exchange
    np.testing.assert_array_equal(got.bytes_in, expected.bytes_in)
    np.testing.assert_array_equal(got.bytes_out, expected.bytes_out)
    np.testing.assert_array_equal(got.link_bytes_out, expected.link_bytes_out)

  def test_full_chip(self):
    a, b = normal(1, (256, 512)), normal(2, (512, 128))
    f = ipu(ops.matmul, target=ipu_jax.IPUTarget.preset("ipu2"))
    testing_utils.assert_within_sum_bound(f(a, b), np.matmul, a, b, against=a @ b)
    self.assertGreater(f.lower(a, b).report.total_cycles, 0)


def _split_k_products():
  """test_per_tile_mode_and_split_k's operands and their fp32 products
  ``[m, k, n]``, to be summed over ``k`` in chosen orders."""
  a, b = _split_k_operands()
  return a, b, np.asarray(a)[:, :, None] * np.asarray(b)[None, :, :]


def _sum_k(products, order, dtype=np.float32):
  """The fp32 (or ``dtype``) sum over axis 1 of ``products`` in ``order``."""
  p = products.astype(dtype)
  if order == "sequential":
    return np.cumsum(p, axis=1, dtype=dtype)[:, -1]
  if order == "reversed":
    return np.cumsum(p[:, ::-1], axis=1, dtype=dtype)[:, -1]
  if order == "pairwise":  # NumPy's pairwise sum runs along the last axis
    return np.ascontiguousarray(np.moveaxis(p, 1, 2)).sum(-1, dtype=dtype)
  # "split_k": 8 sequential partials of 512, then their sequential sum.
  m, k, n = p.shape
  partials = np.cumsum(p.reshape(m, 8, k // 8, n), axis=2, dtype=dtype)[:, :, -1]
  return np.cumsum(partials, axis=1, dtype=dtype)[:, -1]


class SumErrorBoundTest(chex.TestCase, parameterized.TestCase):
  """testing_utils.sum_error_bound: the tolerance of a long fp32 sum."""

  @parameterized.parameters("sequential", "reversed")
  def test_other_order_breaks_a_fixed_atol_but_not_the_bound(self, order):
    # The same fp32 products summed in another order: the split-K test's
    # former atol=1e-4 fails (as it did on another machine), the bound holds.
    a, b, products = _split_k_products()
    got = _sum_k(products, order)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    with self.assertRaises(AssertionError):
      np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-4)
    testing_utils.assert_within_sum_bound(got, np.matmul, a, b)

  @parameterized.product(order=("sequential", "reversed", "pairwise", "split_k"),
                         kind=testing_utils.SUM_BOUND_KINDS)
  def test_every_order_within_each_bound(self, order, kind):
    a, b, products = _split_k_products()
    testing_utils.assert_within_sum_bound(_sum_k(products, order), np.matmul, a, b, kind=kind)

  def test_half_accumulation_breaks_the_float32_bound(self):
    # The bound still tells the precision apart: fp16 partials exceed the
    # fp32 bound by far, and stay within their own.
    a, b, products = _split_k_products()
    got = _sum_k(products, "split_k", dtype=np.float16)
    with self.assertRaisesRegex(AssertionError, "more than the rounding-error bound"):
      testing_utils.assert_within_sum_bound(got, np.matmul, a, b)
    testing_utils.assert_within_sum_bound(got, np.matmul, a, b, dtype=np.float16)

  def test_terms_of_one_sign(self):
    # Partial sums of positive terms grow with k, and so do their roundings:
    # a bound on ||t||_2 alone is exceeded, the bound (|sum| included) is not.
    x = np.random.default_rng(0).uniform(0, 1, 4096).astype(np.float32)
    got = np.cumsum(x, dtype=np.float32)
    exact = testing_utils.assert_within_sum_bound(got, np.cumsum, x)
    k = np.arange(1, x.size + 1)
    norm_only = (testing_utils.TYPICAL_SUM_SAFETY * 2.0**-24 * np.sqrt(k)
                 * np.sqrt(np.cumsum(np.asarray(x, np.float64) ** 2)))
    self.assertTrue((np.abs(got - exact) > norm_only).any())

  def test_unknown_kind_is_named(self):
    with self.assertRaisesRegex(ValueError, "kind must be one of .*'typical'.*got 'loose'"):
      testing_utils.sum_error_bound(np.sum, np.ones(3), kind="loose")


class StochasticRoundTest(parameterized.TestCase):

  @parameterized.parameters((jnp.float16, 2.0 ** -12, 2.0 ** -10),
                            (jnp.bfloat16, 2.0 ** -9, 2.0 ** -7))
  def test_unbiased(self, dtype, offset, ulp):
    value = np.float32(1 + offset)
    x = jnp.full((20000,), value, jnp.float32)
    r = ops.stochastic_round(x, dtype, jax.random.key(0)).astype(jnp.float32)
    self.assertEqual(set(np.unique(np.asarray(r))), {1.0, 1.0 + ulp})
    p = offset / ulp
    sigma = ulp * np.sqrt(p * (1 - p) / x.size)
    self.assertLess(abs(float(jnp.mean(r)) - float(value)), 3 * sigma)

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_neighbours_specials_determinism(self, dtype):
    scales = np.float32([1e-7, 1e-5, 1e-2, 1.0, 300.0, 6e4])
    x = np.asarray(normal(3, (6, 500))) * scales[:, None]
    x = jnp.asarray(x.reshape(-1))
    key = jax.random.key(7)
    r = np.asarray(ops.stochastic_round(x, dtype, key).astype(np.float32))
    xn = np.asarray(x)
    near = np.asarray(x.astype(dtype)).astype(np.float32)
    down = np.where(near <= xn, near,
                    np.asarray(jnp.nextafter(x.astype(dtype), -jnp.inf)).astype(np.float32))
    up = np.where(near >= xn, near,
                  np.asarray(jnp.nextafter(x.astype(dtype), jnp.inf)).astype(np.float32))
    finite = np.isfinite(up) & np.isfinite(down)
    self.assertTrue(((r == down) | (r == up))[finite].all())
    self.assertGreater(((r == up) & (up != down)).sum(), 0)
    self.assertGreater(((r == down) & (up != down)).sum(), 0)
    chex.assert_trees_all_equal(ops.stochastic_round(x, dtype, key),
                                ops.stochastic_round(x, dtype, key))
    self.assertFalse(np.array_equal(r, np.asarray(
        ops.stochastic_round(x, dtype, jax.random.key(8)).astype(np.float32))))
    big = jnp.finfo(dtype).max
    specials = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 1.5, float(big),
                          float(big) * 1.002, -float(big) * 1.003, 1e30], jnp.float32)
    got = ops.stochastic_round(specials, dtype, key)
    chex.assert_trees_all_equal(got, specials.astype(dtype))
    # Raw uint32 key data works like the typed key it holds.
    chex.assert_trees_all_equal(ops.stochastic_round(x, dtype, jax.random.key_data(key)),
                                ops.stochastic_round(x, dtype, key))
    # A seed is not a key: named, not an AttributeError on int.dtype.
    with self.assertRaisesRegex(TypeError, "key must be a PRNG key .* got int: 3"):
      ops.stochastic_round(x, dtype, 3)

  def test_jit_grad_vmap(self):
    x = normal(0, (3, 50))
    key = jax.random.key(1)
    fn = lambda x, k: ops.stochastic_round(x, jnp.float16, k)
    chex.assert_trees_all_equal(jax.jit(fn)(x, key), fn(x, key))
    grad = jax.grad(lambda x: jnp.sum(fn(x, key).astype(jnp.float32) * 3.0))(x)
    chex.assert_trees_all_equal(grad, jnp.full_like(x, 3.0))
    keys = jax.random.split(key, 3)
    batched = jax.vmap(fn)(x, keys)
    one = jax.jit(fn)
    chex.assert_trees_all_equal(batched, jnp.stack([one(x[i], keys[i]) for i in range(3)]))
    shared = jax.jit(jax.vmap(fn, in_axes=(0, None)))(x, key)
    chex.assert_trees_all_equal(shared, jnp.stack([one(x[i], key) for i in range(3)]))

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_on_tiles_bit_exact(self, dtype):
    x = normal(0, (37, 29))
    key = jax.random.key(3)
    fn = lambda x, k: ops.stochastic_round(x * 3.0, dtype, k)
    f = ipu(fn)
    chex.assert_trees_all_equal(f(x, key), jax.jit(fn)(x, key))
    step = next(s for s in f.lower(x, key).profile.steps if s.name == "stochastic_round")
    self.assertGreater(step.compute_cycles.max(), 0)
    if dtype == jnp.float16:
      chex.assert_trees_all_equal(ipu(fn, mode="per_tile")(x, key), jax.jit(fn)(x, key))
    else:
      grad = jax.grad(lambda x, k: jnp.sum(fn(x, k).astype(jnp.float32) ** 2))
      chex.assert_trees_all_close(ipu(grad)(x, key), jax.jit(grad)(x, key), rtol=1e-6)


class PrintTensorTest(parameterized.TestCase):

  def printed(self, fn, *args):
    """(result, what fn printed), with the host callbacks flushed."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
      out = jax.block_until_ready(fn(*args))
      jax.effects_barrier()
    return out, buffer.getvalue()

  def test_formats_like_poplar(self):
    v = jnp.array([1.0, 1.5, 2.0, 2.5])
    out, text = self.printed(lambda x: ops.print_tensor(x, "v1"), v)
    chex.assert_trees_all_equal(out, v)
    self.assertEqual(text, "v1: [1.0000000 1.5000000 2.0000000 2.5000000]\n")
    out, text = self.printed(jax.jit(lambda x: ops.print_tensor(x * 2, "v2") + 1), v)
    chex.assert_trees_all_equal(out, v * 2 + 1)
    self.assertEqual(text, "v2: [2.0000000 3.0000000 4.0000000 5.0000000]\n")
    _, text = self.printed(lambda x: ops.print_tensor(x, "ints"), jnp.arange(4).reshape(2, 2))
    self.assertEqual(text, "ints: [[0 1],\n [2 3]]\n")

  def test_grad_vmap_and_tiles(self):
    v = jnp.array([1.0, 1.5])
    grad, text = self.printed(jax.grad(lambda x: jnp.sum(ops.print_tensor(x, "p") ** 2)), v)
    chex.assert_trees_all_equal(grad, 2 * v)
    self.assertEqual(text, "p: [1.0000000 1.5000000]\n")
    _, text = self.printed(jax.vmap(lambda x: ops.print_tensor(x, "b")), jnp.stack([v, v + 1]))
    self.assertEqual(text, "b: [[1.0000000 1.5000000],\n [2.0000000 2.5000000]]\n")
    fn = lambda x: ops.print_tensor(x, "first") * 2 + ops.print_tensor(x + 1, "second")
    expected = "first: [1.0000000 1.5000000]\nsecond: [2.0000000 2.5000000]\n"
    out, text = self.printed(jax.jit(fn), v)
    self.assertEqual(text, expected)
    on_tiles, text = self.printed(ipu(fn), v)
    chex.assert_trees_all_equal(on_tiles, out)
    self.assertEqual(text, expected)


if __name__ == "__main__":
  absltest.main()
