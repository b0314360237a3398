"""Tests of the data-movement lowering rules (lowering/rules/shape.py).

Each primitive runs on the emulated IPU and must give exactly what
``jax.jit`` gives; the tests also check what a user sees in the report
(reshapes are free, transposes move bytes, constants need no exchange).
"""


import tracemalloc
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import ipu_jax
from ipu_jax.lowering.context import LoweringContext
from ipu_jax.lowering.exchange import movement_cost, to_flat, to_storage
from ipu_jax.lowering.executor import build_function
from ipu_jax.lowering.lower import lower_closed_jaxpr
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering import copy_elements, copy_plan, movement

_SMALL = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32, jnp.bool_)


def _random(shape, dtype, seed=0):
  """Seeded inputs, converted on the host and put on the device (jnp.asarray
  would compile a conversion per shape and dtype)."""
  rng = np.random.RandomState(seed)
  if dtype == jnp.bool_:
    return jax.device_put(rng.rand(*shape) > 0.5)
  if jnp.issubdtype(dtype, jnp.integer):
    return jax.device_put(rng.randint(-1000, 1000, size=shape).astype(jnp.dtype(dtype)))
  return jax.device_put(np.asarray(rng.randn(*shape)).astype(jnp.dtype(dtype)))


def _config(mode):
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  return cfg


def _check(fn, *args, target=_SMALL, mode="batched"):
  """Runs ``fn`` on the IPU and with jax.jit; they must agree bit for bit."""
  got = ipu_jax.jit(fn, target=target, config=_config(mode))(*args)
  want = jax.jit(fn)(*args)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  chex.assert_trees_all_equal(got, want)
  return got


def _steps(fn, *args, target=_SMALL, config=None):
  return ipu_jax.jit(fn, target=target, config=config).lower(*args).report.profile.steps


def _bytes_moved(steps):
  return sum(int(s.exchange_bytes_in.sum()) for s in steps)


# Each case: (input shapes, fn). The function's outputs cover a primitive's
# parameter space on odd shapes, scalars and size-0 arrays.
_CASES = {
    "reshape": ([(7, 13), (3, 1, 5), (), (0, 3)],
                lambda a, b, s, z: (a.reshape(13, 7), b.reshape(15), b.reshape(5, 3, 1),
                                    s.reshape(1, 1), z.reshape(3, 0, 1))),
    "squeeze_expand_dims": ([(3, 1, 5), (7, 13)],
                            lambda b, a: (jnp.squeeze(b, 1), lax.expand_dims(a, (0, 2)),
                                          jnp.squeeze(a[None, :1, None, :]), a[:, None])),
    "broadcast_in_dim": ([(1, 5), (), (7, 1), (3, 1, 5), (0,)],
                         lambda r, s, c, b, z: (
                             jnp.broadcast_to(r, (4, 3, 5)), jnp.broadcast_to(s, (7, 13)),
                             jnp.broadcast_to(c, (7, 13)),
                             lax.broadcast_in_dim(b, (2, 3, 4, 5), (1, 0, 3)),
                             jnp.broadcast_to(z, (3, 0)), jnp.broadcast_to(c, (2, 7, 1)),
                             lax.broadcast_in_dim(c, (1, 7), (1, 0)))),
    "transpose": ([(7, 13), (3, 4, 5), (2, 3, 4, 5), (3, 1, 5)],
                  lambda a, b, c, d: (a.T, b.transpose(2, 0, 1), b.transpose(1, 2, 0),
                                      c.transpose(3, 1, 0, 2), c.transpose(0, 2, 1, 3),
                                      d.transpose(1, 0, 2))),
    "rev": ([(7, 13), (3, 1, 5), ()],
            lambda a, b, s: (lax.rev(a, (0,)), lax.rev(a, (0, 1)), lax.rev(b, (0, 2)),
                             lax.rev(b, (1,)), lax.rev(s, ()))),
    "slice": ([(7, 13), (3, 4, 5)],
              lambda a, b: (a[1:6:2, 3:], a[2:3, :], a[::-1][:, ::3], b[1:, ::2, 1:4:2],
                            lax.slice(a, (4, 4), (4, 9)))),
    "concatenate": ([(7, 13), (7, 2), (7, 0), (3, 1, 5)],
                    lambda a, b, z, c: (jnp.concatenate([a, b, a.T[:2].T], axis=1),
                                        jnp.concatenate([a, z, b], axis=1),
                                        jnp.concatenate([c, c[::-1], c[:1]], axis=0),
                                        jnp.concatenate([a, a], axis=0))),
    "pad": ([(7, 13), (3, 1, 5), (0, 4)],
            lambda a, b, z: (lax.pad(a, jnp.zeros((), a.dtype), [(-1, 2, 1), (3, -2, 2)]),
                             lax.pad(a, a[0, 0], [(2, 1, 0), (-3, -4, 1)]),
                             lax.pad(b, b[2, 0, 4], [(1, 1, 2), (0, 2, 0), (-5, 3, 3)]),
                             lax.pad(z, a[1, 1], [(1, 2, 3), (0, 1, 0)]),
                             lax.pad(a, jnp.ones((), a.dtype), [(0, 0, 0), (0, 0, 0)]),
                             lax.pad(a, a[3, 3], [(-7, 0, 0), (0, 0, 0)]))),
    "split": ([(7, 13)],
              lambda a: (jnp.split(a, [2, 2, 5], axis=0), jnp.split(a, [4], axis=1),
                         jnp.split(a, [13], axis=1))),
}


class ShapeRulesTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters((case, case) for case in sorted(_CASES))
  def test_matches_jax(self, case):
    # Every dtype in one program: one compilation per case keeps this quick.
    shapes, fn = _CASES[case]
    args = {np.dtype(d).name: [_random(s, d, seed=i) for i, s in enumerate(shapes)]
            for d in _DTYPES}
    _check(lambda args: {name: fn(*a) for name, a in args.items()}, args)

  @parameterized.parameters("transpose", "pad", "concatenate", "broadcast_in_dim", "split",
                            "slice")
  def test_per_tile_mode_identical(self, case):
    shapes, fn = _CASES[case]
    for dtype in (jnp.float32, jnp.bfloat16):
      args = [_random(s, dtype, seed=i) for i, s in enumerate(shapes)]
      batched = _check(fn, *args, mode="batched")
      per_tile = _check(fn, *args, mode="per_tile")
      chex.assert_trees_all_equal(batched, per_tile)

  @parameterized.product(dtype=(jnp.int32, jnp.uint8, jnp.float32, jnp.float16, jnp.bfloat16),
                         mode=("batched", "per_tile"))
  def test_iota(self, dtype, mode):
    def fn():
      return (lax.iota(dtype, 5000), lax.broadcasted_iota(dtype, (7, 13), 0),
              lax.broadcasted_iota(dtype, (3, 1, 5), 2), lax.iota(dtype, 0),
              lax.broadcasted_iota(dtype, (2, 3, 4, 5), 1))
    _check(fn, mode=mode)

  def test_constants_from_nothing(self):
    def fn(x):
      return (jnp.zeros((40, 30)), jnp.full((7, 13), jnp.nan, jnp.bfloat16),
              jnp.ones((5,), jnp.int32) * 3, jnp.arange(10.0) + x[0], jnp.eye(5, dtype=x.dtype),
              jnp.broadcast_to(jnp.asarray(np.arange(5.0, dtype=np.float32)), (7, 5)))
    _check(fn, _random((3,), jnp.float32))
    steps = _steps(lambda: (jnp.zeros((400, 30)), jnp.arange(1000)))
    self.assertEqual(_bytes_moved(steps), 0)  # filled in place: nothing crosses the exchange
    self.assertGreater(sum(s.compute_phase_cycles for s in steps), 0)

  def test_reshape_is_free(self):
    x = _random((12, 20), jnp.float32)

    def fn(x):
      y = x.reshape(4, 3, 20)
      return jnp.squeeze(y[None]).reshape(240)[None, :, None]

    _check(fn, x)
    steps = _steps(fn, x)
    self.assertTrue(all(int(s.exchange_bytes_in.sum()) == 0 for s in steps))
    self.assertEqual(len(steps), 0)  # an alias of the input: no superstep at all
    report = ipu_jax.jit(fn, target=_SMALL).lower(x).report
    self.assertEqual(report.profile.total_cycles, 0)

  def test_reshape_shares_storage_with_its_operand(self):
    ctx = LoweringContext(_SMALL)
    x = ctx.new_tensor((6, 4), np.float32, category="variables")
    closed = jax.make_jaxpr(lambda v: (v.reshape(24), jnp.squeeze(v[:, None])))(
        jnp.zeros((6, 4), jnp.float32))
    flat, squeezed = lower_closed_jaxpr(ctx, closed, [x])
    self.assertEqual(flat.id, x.id)
    self.assertIs(flat.mapping, x.mapping)
    self.assertEqual(flat.shape, (24,))
    self.assertEqual(squeezed.id, x.id)

  def test_transpose_moves_bytes(self):
    x = _random((64, 48), jnp.float32)
    _check(lambda x: x.T, x)
    steps = _steps(lambda x: x.T, x)
    self.assertLen(steps, 1)
    moved = _bytes_moved(steps)
    self.assertGreater(moved, 0)
    # Matches the shared exchange model element by element.
    mapping = TileMapping.linear(x.size, _SMALL.num_tiles, 4)
    src = np.arange(x.size).reshape(x.shape).T.reshape(-1)
    expected = movement_cost(_SMALL, mapping.element_tile[src], mapping.element_tile, 4)
    self.assertEqual(moved, expected.total_bytes)
    np.testing.assert_array_equal(steps[0].exchange_bytes_out, expected.bytes_out)

  # Small ones compare every element's tiles; from 2**21 elements they are
  # planned on the tiles' runs as boxes (lowering/copy_plan.py).
  @parameterized.parameters(((64, 48), (1, 0), 8), ((2, 4, 8, 24), (0, 1, 3, 2), 8),
                            ((6, 5, 16, 4), (2, 0, 3, 1), 8), ((2048, 1024), (1, 0), None),
                            ((4, 8, 256, 256), (0, 1, 3, 2), None),
                            ((2, 64, 128, 128), (2, 0, 3, 1), None))
  def test_transpose_figures_on_two_ipus_match_movement_cost(self, shape, axes, tiles_per_ipu):
    """A transpose's bytes per tile and over IPU-Links equal the element-by-element model."""
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=tiles_per_ipu)
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    steps = ipu_jax.jit(lambda x: x.transpose(axes), target=target).lower(x).profile.steps
    self.assertEqual([s.name for s in steps], ["transpose"])
    mapping = TileMapping.linear(int(np.prod(shape)), target.num_tiles, 4)
    src = np.arange(mapping.num_elements).reshape(shape).transpose(axes).reshape(-1)
    want = movement_cost(target, mapping.element_tile[src], mapping.element_tile, 4)
    np.testing.assert_array_equal(steps[0].exchange_bytes_in, want.bytes_in)
    np.testing.assert_array_equal(steps[0].exchange_bytes_out, want.bytes_out)
    self.assertEqual(int(steps[0].ipu_link_bytes), int(want.link_bytes_out.sum()))

  def test_transpose_plan_host_memory_does_not_grow_with_elements(self):
    """Planned on its tiles' runs: 8 M elements need no per-element arrays (72 MB before)."""
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2)
    x = jax.ShapeDtypeStruct((2048, 4096), jnp.float32)
    tracemalloc.start()
    try:
      steps = ipu_jax.jit(lambda x: x.T, target=target).lower(x).profile.steps
      _, peak = tracemalloc.get_traced_memory()
    finally:
      tracemalloc.stop()
    self.assertEqual([s.name for s in steps], ["transpose"])
    self.assertGreater(int(steps[0].exchange_bytes_in.sum()), 0)
    self.assertLess(peak, 8 << 20)  # a quarter of the tensor's 32 MiB

  def test_exchange_plan_matches_movement_cost(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    rng = np.random.RandomState(1)
    source_tiles = rng.randint(0, target.num_tiles, size=500)
    source = rng.permutation(500)[:300]
    dst = rng.randint(0, target.num_tiles, size=300)
    want = movement_cost(target, source_tiles[source], dst, 2, element_id=source)
    for one_to_one in (False, True):
      got, _ = copy_elements.exchange_plan(target, source_tiles, source, dst, 2, one_to_one)
      np.testing.assert_array_equal(got.bytes_in, want.bytes_in)
      np.testing.assert_array_equal(got.bytes_out, want.bytes_out)
      np.testing.assert_array_equal(got.link_bytes_out, want.link_bytes_out)

  def test_broadcast_is_a_multicast(self):
    s = jnp.float32(2.5)
    # The broadcast is the result: made full size by the rule's own step (read
    # only by elementwise ops, it would be a view: the scalar operand of their
    # vertices).
    steps = _steps(lambda s: jnp.broadcast_to(s, (100, 90)), s)
    bcast = [st for st in steps if st.op == "broadcast_in_dim"]
    self.assertLen(bcast, 1)
    # Every tile receives the scalar once and replicates it on the tile.
    self.assertLessEqual(int(bcast[0].exchange_bytes_in.max()), 4)
    self.assertLessEqual(int(bcast[0].exchange_bytes_out.sum()), 4)
    self.assertGreater(bcast[0].compute_phase_cycles, 0)
    v = _random((90,), jnp.float32)
    steps = _steps(lambda v: jnp.broadcast_to(v, (100, 90)), v)
    # Each element leaves its tile once, however many tiles need it.
    self.assertLessEqual(int(steps[0].exchange_bytes_out.sum()), 90 * 4)

  @parameterized.parameters(((2, 14, 14, 256), 1), ((3, 7, 7, 2048), 1), ((4, 28, 28, 64), 1),
                            ((2, 8, 8, 1000), 2))
  def test_channel_broadcast_on_a_full_ipu_is_planned_by_regions(self, shape, num_ipus):
    """Batch norm's per-channel [C] vector over [B, H, W, C] on 1,472 tiles.

    The vector, a reduction's result, lies on many tiles: planned by its
    elements, the broadcast cost time and memory in the output's elements.
    By regions it is planned per destination tile on the channels it needs,
    with the figures of the per-element planner (the oracle: every
    movement planned element by element).
    """
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=num_ipus)
    x = _random(shape, jnp.float16)

    def fn(x):  # as flax.nnx.BatchNorm in training: statistics kept as [1, 1, 1, C]
      x = x.astype(jnp.float32)
      centred = x - jnp.mean(x, axis=(0, 1, 2), keepdims=True)
      return centred * lax.rsqrt(jnp.mean(centred * centred, axis=(0, 1, 2), keepdims=True)
                                 + 1e-5)

    with mock.patch.object(copy_elements, "plan_elements",
                           wraps=copy_elements.plan_elements) as by_elements:
      lowered = ipu_jax.jit(fn, target=target).lower(x)
    self.assertEqual(by_elements.call_count, 0)
    with mock.patch.object(copy_plan, "MIN_MEAN_ROW", 1 << 62):  # rows never long enough
      oracle = ipu_jax.jit(fn, target=target).lower(x)
    got, want = lowered.report.profile, oracle.report.profile
    # The [1, 1, 1, C] statistics are read broadcast by the steps that use
    # them (popops reads them in place): no full-size broadcast step, but their
    # exchange is still the broadcast's plan.
    self.assertNotIn("broadcast_in_dim", [s.name for s in got.steps])
    self.assertEqual([s.name for s in got.steps], [s.name for s in want.steps])
    for step, expected in zip(got.steps, want.steps):
      self.assertEqual(step.total_cycles, expected.total_cycles, step.name)
      np.testing.assert_array_equal(step.exchange_bytes_in, expected.exchange_bytes_in)
      np.testing.assert_array_equal(step.exchange_bytes_out, expected.exchange_bytes_out)
      self.assertEqual(step.ipu_link_bytes, expected.ipu_link_bytes)
    np.testing.assert_array_equal(got.memory.peak, want.memory.peak)
    chex.assert_trees_all_close(np.asarray(lowered.compile()(x)), jax.jit(fn)(x),
                                rtol=2e-3, atol=2e-3)

  def test_broadcast_to_helper(self):
    """The helper other rules call for operands with size-1 axes."""
    ctx = LoweringContext(_SMALL)
    row = ctx.new_tensor((1, 5), np.float32, category="variables")
    out = movement.broadcast_to(ctx, row, (3, 4, 5))
    self.assertEqual(out.shape, (3, 4, 5))
    self.assertLen(ctx.program.programs, 1)
    self.assertEqual(movement.broadcast_to(ctx, row, (1, 1, 5)).id, row.id)  # an alias
    with self.assertRaises(ValueError):
      movement.broadcast_to(ctx, row, (3, 4))

  def test_constant_pad_value_is_filled_not_sent(self):
    x = _random((40, 30), jnp.float32)
    constant = _steps(lambda x: lax.pad(x, 0.0, [(0, 0, 0), (0, 2, 0)]), x)
    computed = _steps(lambda x: lax.pad(x, x[0, 0], [(0, 0, 0), (0, 2, 0)]), x)
    self.assertLess(_bytes_moved(constant), _bytes_moved(computed))

  @parameterized.parameters((0, jnp.float32), (1, jnp.int32), (2, jnp.bfloat16), (-1, jnp.bool_))
  def test_stack(self, axis, dtype):
    a, b, c = (_random((7, 3), dtype, seed=i) for i in range(3))
    _check(lambda a, b, c: jnp.stack([a, b, c], axis=axis), a, b, c)
    _check(lambda s: jnp.stack([s, s * 2 if dtype != jnp.bool_ else s]), jnp.asarray(3, dtype))

  def test_concatenate_operands_with_general_mappings(self):
    """Three operands, each laid out differently (linear, one tile, scattered)."""
    rng = np.random.RandomState(3)
    shapes = [(5, 7), (5, 3), (5, 11)]
    mappings = [TileMapping.linear(35, 16, 4),
                TileMapping.single(15, 9),
                TileMapping.from_element_tiles(rng.randint(0, 16, size=55))]
    self.assertFalse(mappings[2].is_linear)
    args = [_random(s, jnp.float32, seed=i) for i, s in enumerate(shapes)]

    def fn(a, b, c):
      return (jnp.concatenate([a, b, c], axis=1), c.T, lax.pad(c, a[0, 0], [(1, 1, 1), (-2, 0, 0)]),
              jnp.broadcast_to(b[:, :1], (5, 4)), c.reshape(55))

    want = jax.jit(fn)(*args)
    for mode in ("batched", "per_tile"):
      got = _run_with_mappings(fn, args, mappings, mode)
      chex.assert_trees_all_equal(tuple(got), tuple(want))

  def test_full_ipu2_target(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    x = _random((300, 517), jnp.float32)

    def fn(x):
      y = lax.pad(x.T, 1.0, [(2, -3, 1), (0, 5, 0)])
      return jnp.concatenate([y, lax.rev(y, (0,))], axis=1)[::3], x.reshape(517, 300)

    _check(fn, x, target=target)
    steps = _steps(fn, x, target=target)
    self.assertGreater(_bytes_moved(steps), 0)
    self.assertGreater(max(int((s.exchange_bytes_in > 0).sum()) for s in steps), 16)

  def test_vjp_of_movements(self):
    """Cotangents flow through the transposes of every movement (pad, slice...)."""
    x = _random((6, 5), jnp.float32)

    def f(x):
      y = lax.pad(x.T, 0.0, [(-1, 2, 1), (1, -2, 0)])
      y = jnp.concatenate([y, lax.rev(y, (1,))[:, 1:]], axis=1)
      return jnp.squeeze(y.reshape(1, -1)[:, 3:]) * 2.0

    ct = _random((f(x).shape[0],), jnp.float32, seed=7)
    _check(lambda x, ct: jax.vjp(f, x)[1](ct)[0], x, ct)

  def test_prng_key_arrays(self):
    """Key arrays are moved as whole keys (their uint32 key data)."""
    def fn(key):
      keys = jax.random.split(key, 6)
      grid = keys.reshape(2, 3)
      moved = (keys[1], grid.T, jnp.concatenate([keys, keys[::-1]]), keys[1:6:2],
               jnp.broadcast_to(keys[2], (3,)), *jnp.split(keys, [2]))
      return [jax.random.key_data(k) for k in moved]
    _check(fn, jax.random.key(0))

  def test_grad(self):
    x = _random((6, 5), jnp.float32)
    w = _random((5,), jnp.float32, seed=1)

    def loss(x, w):
      y = jnp.concatenate([x, jnp.broadcast_to(w, (2, 5))], axis=0)
      y = lax.pad(y.T, 0.5, [(1, 0, 1), (0, -2, 0)])
      y = y * jnp.broadcast_to(jnp.arange(10.0)[:, None], y.shape)
      return jnp.sum(lax.rev(y, (0,))[::2] ** 2)

    got = ipu_jax.jit(jax.grad(loss, argnums=(0, 1)), target=_SMALL)(x, w)
    want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    chex.assert_trees_all_close(got, want, rtol=1e-5)


def _run_with_mappings(fn, args, mappings, mode):
  """Lowers ``fn`` with its inputs held in ``mappings`` and runs it."""
  target = _SMALL
  options = _config(mode).lowering_options()
  ctx = LoweringContext(target, options)
  closed = jax.make_jaxpr(fn)(*args)
  inputs = [ctx.new_tensor(a.shape, a.dtype, m, category="variables")
            for a, m in zip(args, mappings)]
  outputs = lower_closed_jaxpr(ctx, closed, inputs)
  tensors = dict(ctx.tensors)
  for t in inputs + outputs + ctx.constants:
    tensors.setdefault(t.id, t)
  run = build_function(ctx.program, tensors, [t.id for t in inputs + ctx.constants],
                       [t.id for t in outputs])
  storages = [to_storage(jnp.reshape(a, (-1,)), t.mapping) for a, t in zip(args, inputs)]
  constants = [to_storage(jnp.asarray(c.value).reshape(-1), c.mapping) for c in ctx.constants]
  results = run(*storages, *constants)
  return [to_flat(r, t.mapping).reshape(t.shape) for r, t in zip(results, outputs)]


if __name__ == "__main__":
  absltest.main()
