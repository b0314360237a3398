"""Elementwise fusion: fewer supersteps, the same numbers, honest costs."""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import ipu_jax
from ipu_jax.kernels import popops
from ipu_jax.lowering import fusion
import testing_utils

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _config(fuse: bool, mode: str = "batched") -> ipu_jax.IPUConfig:
  cfg = ipu_jax.IPUConfig()
  cfg.fusion.elementwise = fuse
  cfg.executor.mode = mode
  cfg.report.progress = False
  return cfg


def _lower(fn, *args, fuse=True, mode="batched", target=_T16):
  f = ipu_jax.jit(fn, target=target, config=_config(fuse, mode))
  return f, f.lower(*args)


def _random(shape, dtype, seed=0):
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if np.issubdtype(dtype, np.integer):
    return testing_utils.on_device(rng.integers(-20, 20, size=shape), dtype)
  return testing_utils.on_device(rng.uniform(-2.0, 2.0, size=shape), dtype)


def _assert_bit_equal(got, want):
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  jax.tree_util.tree_map(
      lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, want)


def _chain(x, y, s):
  a = jnp.exp(x) * y + s
  b = jnp.where(a > 0, a, 0.5 * a)
  return b * x - jnp.tanh(y) / (s * s + 1.0)


def _assert_close_to_jax(got, want):
  # jax.jit may rewrite a chain where the tile program cannot (a division by
  # a broadcast scalar becomes a multiply by its reciprocal, within 3 ulps:
  # docs/tile_program.md#what-same-numbers-means), with or without fusion. Fusion
  # itself changes nothing: the tests compare fused with unfused bit for bit.
  def close(g, w):
    g, w = np.asarray(g), np.asarray(w)
    if np.issubdtype(g.dtype, np.floating) or g.dtype == jnp.bfloat16:
      eps = float(jnp.finfo(g.dtype).eps)
      np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32),
                                 rtol=3 * eps, atol=3 * eps)
    else:
      np.testing.assert_array_equal(g, w)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  jax.tree_util.tree_map(close, got, want)


def _fused_steps(profile):
  return [s for s in profile.steps if s.fused_ops]


def _tensor(profile, op):
  """The tensor ``op`` made (one of the program's)."""
  return next(t for t in profile.tensors if t.op == op)


def _elements_per_tile(tensor, num_tiles):
  """``[num_tiles]`` elements of ``tensor`` on each tile."""
  elements = np.zeros(num_tiles, np.int64)
  elements[np.asarray(tensor.tiles)] = np.asarray(tensor.bytes_on_tile) // np.dtype(
      tensor.dtype).itemsize
  return elements


class FusionTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("f32_odd", (37,), np.float32), ("f32_scalar", (), np.float32),
      ("f32_empty", (0,), np.float32), ("bf16", (3, 1, 5), jnp.bfloat16))
  def test_chain_matches_jax_jit_and_unfused_bit_for_bit(self, shape, dtype):
    x, y = _random(shape, dtype), _random(shape, dtype, seed=1)
    s = _random((), dtype, seed=2)
    for mode in ("batched", "per_tile") if shape == (37,) else ("batched",):
      fused, lowered = _lower(_chain, x, y, s, mode=mode)
      plain, _ = _lower(_chain, x, y, s, fuse=False, mode=mode)
      got = fused(x, y, s)
      _assert_bit_equal(got, plain(x, y, s))
      _assert_close_to_jax(got, jax.jit(_chain)(x, y, s))
    if np.prod(shape) > 1:
      # ``s * s + 1`` runs on the scalar's tile; the other ten ops are one
      # compute set on the arrays' layout.
      scalar, chain = lowered.report.profile.steps
      self.assertEqual([f.op for f in scalar.fused_ops], ["mul", "add"])
      self.assertLen(chain.fused_ops, 10)

  def test_integer_and_mixed_dtype_chain(self):
    x = _random((101,), np.int32)

    def fn(x):
      y = (x * 3 + 7) >> 1
      return jnp.float32(0.25) * y.astype(np.float32) - jnp.sqrt(jnp.abs(x).astype(np.float32))

    fused, lowered = _lower(fn, x)
    _assert_bit_equal(fused(x), _lower(fn, x, fuse=False)[0](x))
    _assert_close_to_jax(fused(x), jax.jit(fn)(x))
    self.assertLen(lowered.report.profile.steps, 1)

  def test_a_chain_is_one_superstep_listing_its_ops(self):
    x, y = _random((515,), np.float32), _random((515,), np.float32, seed=1)
    fn = lambda x, y: jnp.exp(x) * y + x  # noqa: E731
    _, on = _lower(fn, x, y)
    _, off = _lower(fn, x, y, fuse=False)
    self.assertEqual([s.op for s in off.report.profile.steps], ["exp", "mul", "add"])
    step, = on.report.profile.steps
    self.assertEqual(step.op, "fusion")
    self.assertEqual([f.op for f in step.fused_ops], ["exp", "mul", "add"])
    self.assertTrue(all(f.source.endswith("test_fusion.py:" + f.source.split(":")[-1])
                        for f in step.fused_ops))

  def test_cycles_are_one_map_vertex_or_the_parts_less_the_overheads_saved(self):
    # Cost model 5: a fused chain pays the cheaper, per tile, of popops' map
    # codelet for the whole expression and its members' own vertices one
    # after another less the launch and worker overheads each extra member
    # saves (cost model 4's only figure: the busiest tile's 560 cycles are 398
    # now).
    x, y = _random((515,), np.float32), _random((515,), np.float32, seed=1)
    fn = lambda x, y: jnp.exp(x) * y + x  # noqa: E731
    on = _lower(fn, x, y)[1].report.profile
    off = _lower(fn, x, y, fuse=False)[1].report.profile
    parts = np.stack([s.compute_cycles for s in off.steps])
    busy = parts[0] > 0
    overhead = fusion.vertex_overhead_cycles(_T16)
    self.assertGreater(parts[:, busy].min(), overhead)  # each part has work beyond it
    sequential = np.where(busy, parts.sum(axis=0) - 2 * overhead, 0)
    # The map codelet, by hand: per float32 vector (2 elements) exp's 4 ALU
    # cycles, mul's and add's 1 each, x and y loaded, the result stored, one
    # for the loop: 10; exp's worker entry (33) and supervisor (20) once.
    elements = _elements_per_tile(_tensor(on, "add"), 16)
    self.assertEqual(elements.sum(), 515)
    one_vertex = popops.map_expression_cycles(_T16, elements, 10, 2, 33, 20)
    np.testing.assert_array_equal(on.steps[0].compute_cycles, np.minimum(sequential, one_vertex))
    self.assertTrue(np.all(one_vertex[busy] < sequential[busy]))  # here the map wins
    # Two syncs fewer; nothing was exchanged either way.
    self.assertEqual(off.sync_cycles - on.sync_cycles, 2 * _T16.sync_cycles_internal)
    self.assertEqual(on.exchange_cycles, 0)
    self.assertLess(on.total_cycles, off.total_cycles)

  def test_each_chain_of_a_run_costs_its_own_parts(self):
    # Four independent chains, of 2, 3, 3 and 4 ops on four layouts, stay
    # open together in one straight-line run and become four compute sets
    # at its end; each costs its own members, no other chain's.
    sizes, lengths = (16, 37, 515, 100), (2, 3, 3, 4)
    args = [_random((n,), np.float32, seed=n) for n in sizes]

    chains = (lambda a: jnp.exp(a) * 2.0, lambda b: jnp.sin(b) * b + 1.0,
              lambda c: jnp.tanh(c) - c * 0.5, lambda d: jnp.abs(d) * d + d - 3.0)

    def fn(a, b, c, d):
      return tuple(chain(x) for chain, x in zip(chains, (a, b, c, d)))

    f, on = _lower(fn, *args)
    off = _lower(fn, *args, fuse=False)[1].report.profile
    _assert_bit_equal(f(*args), _lower(fn, *args, fuse=False)[0](*args))
    fused = on.report.profile.steps
    self.assertEqual([len(s.fused_ops) for s in fused], list(lengths))
    overhead = fusion.vertex_overhead_cycles(_T16)
    starts = np.cumsum((0,) + lengths)
    for k, (step, lo, hi) in enumerate(zip(fused, starts[:-1], starts[1:])):
      parts = np.stack([s.compute_cycles for s in off.steps[lo:hi]])
      self.assertEqual([f.op for f in step.fused_ops], [s.op for s in off.steps[lo:hi]])
      busy = (parts > 0).sum(axis=0)
      sequential = np.maximum(parts.sum(axis=0) - np.maximum(busy - 1, 0) * overhead,
                              parts.max(axis=0))
      # The chain lowered on its own (its tiles counted from 0) costs what it
      # costs here.
      alone, = _lower(chains[k], args[k])[1].report.profile.steps
      np.testing.assert_array_equal(np.sort(step.compute_cycles), np.sort(alone.compute_cycles))
      self.assertTrue(np.all(step.compute_cycles <= sequential))
      np.testing.assert_array_equal(step.vertices, off.steps[lo].vertices)
      self.assertEqual(int(step.exchange_bytes_in.sum()), 0)

  def test_a_member_moved_onto_the_chain_costs_what_it_costs_at_home(self):
    # exp(y) is computed on y's layout unfused; fused, it joins the product on
    # x.T's layout (the same number of elements on each tile), where it must
    # pay poplibs' float32 exp as it does at home, not a generic estimate.
    x, y = _random((13, 7), np.float32), _random((7, 13), np.float32, seed=1)
    fn = lambda x, y: x.T * jnp.exp(y)  # noqa: E731
    f, lowered = _lower(fn, x, y)
    off = _lower(fn, x, y, fuse=False)[1].report.profile
    _assert_bit_equal(f(x, y), _lower(fn, x, y, fuse=False)[0](x, y))
    fused, = _fused_steps(lowered.report.profile)
    exp, mul = (next(s.compute_cycles for s in off.steps if s.op == op) for op in ("exp", "mul"))
    # Unfused, exp ran on other tiles than mul, the same cycles on each.
    self.assertEqual(len(set(exp[exp > 0])), 1)
    self.assertFalse(np.any((exp > 0) & (mul > 0)))
    overhead = fusion.vertex_overhead_cycles(_T16)
    sequential = np.where(mul > 0, mul + exp.max() - overhead, 0)
    # As one map codelet on the product's tiles: exp's 4 ALU cycles and mul's
    # 1 per float32 vector, x.T and exp's operand y loaded, one store, the
    # loop: 9; exp's overheads (33 per worker, 20) once.
    elements = _elements_per_tile(_tensor(lowered.report.profile, "mul"), 16)
    one_vertex = popops.map_expression_cycles(_T16, elements, 9, 2, 33, 20)
    np.testing.assert_array_equal(fused.compute_cycles, np.minimum(sequential, one_vertex))

  def test_an_outside_operand_is_exchanged_once(self):
    x, y = _random((13, 7), np.float32), _random((7, 13), np.float32, seed=1)

    def fn(x, y):
      t = x.T  # the chain's layout; y has another one
      return (t * y + t) * y

    f, lowered = _lower(fn, x, y)
    _assert_bit_equal(f(x, y), _lower(fn, x, y, fuse=False)[0](x, y))
    _assert_close_to_jax(f(x, y), jax.jit(fn)(x, y))
    fused, = _fused_steps(lowered.report.profile)
    # Read twice, y crosses the exchange once; no use of t moves at all.
    self.assertGreater(int(fused.exchange_bytes_in.sum()), 0)
    self.assertLessEqual(int(fused.exchange_bytes_in.sum()), y.size * 4)

  def test_intermediates_live_only_inside_the_fused_step(self):
    x = _random((1024,), np.float32)  # 64 elements, 256 bytes, per tile

    def fn(x):
      a, b = jnp.exp(x), jnp.sin(x)
      return a * b + 1.0

    on = _lower(fn, x)[1].report.profile
    off = _lower(fn, x, fuse=False)[1].report.profile
    self.assertEqual({t.op for t in on.tensors if t.category == "temporaries"}, {"add"})
    # exp and sin are live together for a moment: one intermediate beyond
    # the result, per tile, still counts (the product is written over exp,
    # the sum over the product, as separate steps write them in place).
    step, = on.steps
    np.testing.assert_array_equal(step.temporary_bytes, np.full(16, 256))
    np.testing.assert_array_equal(on.memory.by_category["temporaries"],
                                  off.memory.by_category["temporaries"])

  def test_dependencies_through_other_operations_are_kept(self):
    x = _random((333,), np.float32)

    def fn(x):
      y = x * 2.0 + 1.0
      total = jnp.sum(y)          # a reduction needs all of y first
      return jnp.exp(y - total), y * y

    f, lowered = _lower(fn, x)
    got = f(x)
    _assert_bit_equal(got, _lower(fn, x, fuse=False)[0](x))
    chex.assert_trees_all_close(got, jax.jit(fn)(x), rtol=1e-6)  # a sum: to rounding
    ops = [s.op for s in lowered.report.profile.steps]
    self.assertLess(ops.index("fusion"), max(i for i, op in enumerate(ops) if op == "reduce_sum"))

  def test_loop_carries_update_in_place(self):
    x, v = _random((129,), np.float32), _random((129,), np.float32, seed=1)

    def fn(x, v):
      def body(_, carry):
        x, v = carry
        v = 0.9 * v + 0.1 * jnp.cos(x)
        return x - 0.5 * v, v
      return lax.fori_loop(0, 5, body, (x, v))

    f, lowered = _lower(fn, x, v)
    _assert_bit_equal(f(x, v), _lower(fn, x, v, fuse=False)[0](x, v))
    _assert_close_to_jax(f(x, v), jax.jit(fn)(x, v))
    self.assertLen(_fused_steps(lowered.report.profile), 1)

  def test_off_switch_gives_todays_program(self):
    x, y = _random((37,), np.float32), _random((37,), np.float32, seed=1)
    s = _random((), np.float32, seed=2)
    _, off = _lower(_chain, x, y, s, fuse=False)
    self.assertFalse(_fused_steps(off.report.profile))
    self.assertNotIn("Fusion:", off.report.summary())
    self.assertFalse(ipu_jax.IPUConfig().lowering_options().fuse_elementwise is False)
    with self.assertRaisesRegex(TypeError, "fusion.elementwise must be a bool"):
      ipu_jax.IPUConfig().fusion.elementwise = 1

  def test_report_says_where_the_syncs_went(self):
    x, y = _random((37,), np.float32), _random((37,), np.float32, seed=1)
    s = _random((), np.float32, seed=2)
    report = _lower(_chain, x, y, s)[1].report
    fused = _fused_steps(report.profile)
    ops = sum(len(f.fused_ops) for f in fused)
    saved = sum(len(f.fused_ops) - 1 for f in fused)
    text = report.summary()
    self.assertIn(f"{ops} elementwise ops fused into {len(fused)} compute sets, "
                  f"{saved} syncs saved per run", text)
    self.assertIn("Fused compute sets", text)
    with tempfile.TemporaryDirectory() as directory:
      report.save(directory, plots=False, html=False)
      with open(os.path.join(directory, "report.json")) as f:
        rows = json.load(f)["steps"]
      self.assertEqual([op for op, _ in rows[-1]["fused_ops"]][:2], ["exp", "mul"])
      self.assertIn(f"{ops} elementwise ops fused into {len(fused)} compute sets",
                    ipu_jax.load_report(directory).summary())

  def test_training_step_has_at_most_half_the_supersteps(self):
    from experiments import models
    step, args = models.workload("mlp", batch=32)
    on = _lower(step, *args)[1].report
    off = _lower(step, *args, fuse=False)[1].report
    self.assertLessEqual(2 * len(on.profile.steps), len(off.profile.steps))
    self.assertLess(on.total_cycles, off.total_cycles)
    self.assertLessEqual(on.profile.memory.peak.max(), off.profile.memory.peak.max())

  @pytest.mark.slow
  def test_training_step_numbers_are_unchanged(self):
    # Compiling both whole training steps takes about a minute on 2 cores.
    from experiments import models
    step, args = models.workload("mlp", batch=32)
    _assert_bit_equal(_lower(step, *args)[0](*args), _lower(step, *args, fuse=False)[0](*args))


_T1 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)


def _compute_cycles(fn, *args, fuse=True):
  """The program's compute cycles on one tile, as the report gives them."""
  return _lower(fn, *args, fuse=fuse, target=_T1)[1].report.profile.compute_cycles


class FusedCostTest(chex.TestCase, parameterized.TestCase):
  """Cost model 5: fused chains priced as PopLibs would run them."""

  def test_scaled_add_slope_is_popops_scaled_add(self):
    # ``a + 0.5 * b`` is popops' ScaledAddSupervisor: 3 cycles per 2-float
    # vector per worker, 1.5 per element on the tile (cost model 4 priced
    # the mul and the add apart: 464 / 1,796 cycles, 2.97 per element).
    fn = lambda a, b: a + 0.5 * b  # noqa: E731
    cycles = {n: _compute_cycles(fn, _random((n,), np.float32), _random((n,), np.float32, 1))
              for n in (64, 128, 256, 512)}
    slope = (cycles[512] - cycles[64]) / (512 - 64)
    self.assertBetween(slope, 1.3, 1.7)
    for n, c in cycles.items():
      self.assertEqual(c, popops.scaled_arithmetic_cycles(_T1, np.array([n]), np.float32)[0])
    self.assertEqual((cycles[64], cycles[512]), (279, 945))

  @parameterized.named_parameters(
      ("literal", lambda a, b, s: a + 0.5 * b, "add"),
      ("scale_tensor", lambda a, b, s: a - s * b, "subtract"),
      ("scale_first", lambda a, b, s: b * s + a, "add"),
      ("axplusby", lambda a, b, s: 0.9 * a + s * b, "axplusby"),
      ("axminusby", lambda a, b, s: a * 0.9 - s * b, "axminusby"),
      ("ax_minus_y", lambda a, b, s: s * a - b, "axminusby"))
  def test_scaled_patterns_cost_their_vertex(self, fn, operation):
    for dtype, n in ((np.float32, 515), (np.float16, 333)):
      a, b = _random((n,), dtype), _random((n,), dtype, 1)
      s = _random((), dtype, 2)
      f, lowered = _lower(fn, a, b, s, target=_T1)
      _assert_bit_equal(f(a, b, s), _lower(fn, a, b, s, fuse=False, target=_T1)[0](a, b, s))
      _assert_close_to_jax(f(a, b, s), jax.jit(fn)(a, b, s))
      step, = _fused_steps(lowered.report.profile)
      want = popops.scaled_arithmetic_cycles(_T1, np.array([n]), dtype, operation)
      np.testing.assert_array_equal(step.compute_cycles, want)
      vertex = popops.SCALED_VERTICES[operation]
      self.assertIn(f"costed as popops' {vertex}<{np.dtype(dtype).name}>", step.notes)

  @parameterized.named_parameters(
      ("vector_product", lambda a, b, c: a + b * c),
      ("product_also_returned", lambda a, b, c: (a + 0.5 * b, 0.5 * b)),
      ("three_ops", lambda a, b, c: a + 0.5 * b - c))
  def test_other_chains_are_not_scaled_arithmetic(self, fn):
    a, b, c = (_random((515,), np.float32, k) for k in range(3))
    f, lowered = _lower(fn, a, b, c, target=_T1)
    _assert_bit_equal(f(a, b, c), _lower(fn, a, b, c, fuse=False, target=_T1)[0](a, b, c))
    for step in _fused_steps(lowered.report.profile):
      self.assertFalse(any("Supervisor<" in n for n in step.notes))

  @parameterized.product(k=(2, 3, 5, 8), n=(37, 515, 4096), dtype=(np.float32, np.float16))
  def test_a_chain_costs_less_than_its_members_alone(self, k, n, dtype):
    ops = (lambda v, x, y: v * y, lambda v, x, y: v + x, lambda v, x, y: jnp.exp(v),
           lambda v, x, y: v - 0.25 * y, lambda v, x, y: jnp.maximum(v, x))

    def chain(x, y):
      v = x
      for i in range(k):
        v = ops[i % len(ops)](v, x, y)
      return v

    x, y = _random((n,), dtype) * 0.1, _random((n,), dtype, 1) * 0.1
    f, on = _lower(chain, x, y, target=_T1)
    off = _lower(chain, x, y, fuse=False, target=_T1)[1].report.profile
    _assert_bit_equal(f(x, y), _lower(chain, x, y, fuse=False, target=_T1)[0](x, y))
    step, = on.report.profile.steps
    self.assertLen(step.fused_ops, len(off.steps))
    self.assertLess(on.report.profile.compute_cycles, off.compute_cycles)

  def test_map_expression_by_hand(self):
    # ``exp(x) * y + x``, 512 float32 on one tile, as one map codelet: per
    # 2-float vector exp 4 + mul 1 + add 1 ALU cycles, loads of x and y, one
    # store, one loop cycle: 10; 256 vectors, 43 for the busiest worker;
    # exp's worker entry 33 and supervisor 20 once: 6 * (33 + 430) + 20.
    fn = lambda x, y: jnp.exp(x) * y + x  # noqa: E731
    x, y = _random((512,), np.float32), _random((512,), np.float32, 1)
    self.assertEqual(_compute_cycles(fn, x, y), 6 * (33 + 43 * 10) + 20)
    # Its members in turn would pay 3,440: exp 1,766, mul and add 959 each,
    # less 2 x 122 of overheads saved.
    self.assertEqual(_compute_cycles(fn, x, y, fuse=False), 1766 + 959 + 959)

  def test_trapped_members_still_run_one_by_one(self):
    # Floating-point traps run a fused step's members one by one; the
    # chain's cost is the fused one all the same.
    cfg = _config(True)
    cfg.floating_point_behaviour.inv = True
    fn = lambda a, b: jnp.log(a + 0.5 * b)  # noqa: E731
    a = jnp.asarray([1.0, -3.0, 2.0], jnp.float32)
    b = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    f = ipu_jax.jit(fn, target=_T1, config=cfg)
    step, = _fused_steps(f.lower(a, b).report.profile)
    self.assertEqual([op.op for op in step.fused_ops], ["mul", "add", "log"])
    untrapped, = _fused_steps(_lower(fn, a, b, target=_T1)[1].report.profile)
    np.testing.assert_array_equal(step.compute_cycles, untrapped.compute_cycles)
    with self.assertRaisesRegex(ipu_jax.FloatingPointException, "log"):
      np.asarray(f(a, b))
    np.testing.assert_array_equal(np.asarray(f(b, b)), np.asarray(jax.jit(fn)(b, b)))


if __name__ == "__main__":
  absltest.main()
