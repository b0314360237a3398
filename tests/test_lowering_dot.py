"""Tests of the matmul lowering (lowering/rules/dot.py, lowering/matmul_plan.py).

Every ``dot_general`` must give what ``jax.jit`` gives (f32 to rtol 1e-5) in
both executor modes; the tests also check what a user sees: the plan named in
the report and its cycles, exact exchange bytes, and how the available memory
proportion trades memory for cycles.
"""

import functools
import re

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import ipu_jax
from ipu_jax.lowering.matmul_plan import MatmulPlan, plan_matmul
from ipu_jax.lowering.matmul_cost import split_candidates
import testing_utils

_SMALL = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_FULL = ipu_jax.IPUTarget.preset("ipu2")
_TOL = {jnp.float32: 1e-5, jnp.float16: 2e-2, jnp.bfloat16: 5e-2, jnp.int32: 0}


def _config(mode="batched", **matmuls):
  return testing_utils.executor_config(mode, matmuls=matmuls)


_random = testing_utils.random_array


def _check(fn, *args, tol=1e-5, **kwargs):
  return testing_utils.assert_sums_match_jit(fn, *args, rtol=tol, **kwargs)


def _dot_steps(lowered):
  return [s for s in lowered.report.profile.steps if s.op == "dot_general"]


def _grid(step_name):
  m = re.search(r"b(\d+)\.m(\d+)\.n(\d+)\.k(\d+) blocks (\d+)x(\d+)x(\d+)x(\d+)", step_name)
  return tuple(int(x) for x in m.groups())


class DotGeneralTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(
      ("1x1", (1, 1), (1, 1)),
      ("7x13x5", (7, 13), (13, 5)),
      ("64x300x17", (64, 300), (300, 17)),
      ("vector_matrix", (13,), (13, 5)),
      ("matrix_vector", (7, 13), (13,)),
      ("vector_vector", (13,), (13,)),
  )
  def test_matmul_shapes(self, a_shape, b_shape):
    _check(jnp.matmul, _random(a_shape, seed=1), _random(b_shape, seed=2))

  @parameterized.named_parameters(
      ("bij_bjk", "bij,bjk->bik", (3, 7, 9), (3, 9, 5)),
      ("bhqd_bhkd", "bhqd,bhkd->bhqk", (2, 3, 4, 5), (2, 3, 6, 5)),
      ("contract_two_axes", "ijk,jkl->il", (4, 3, 5), (3, 5, 6)),
      ("batch_in_middle", "ibj,jbk->bik", (5, 3, 4), (4, 3, 2)),
  )
  def test_einsums(self, spec, a_shape, b_shape):
    _check(lambda a, b: jnp.einsum(spec, a, b), _random(a_shape, seed=3), _random(b_shape, seed=4))

  def test_unusual_dimension_numbers(self):
    # Contracting dims first, batch dims last and out of order on the rhs.
    dn = (((2,), (3,)), ((0, 3), (1, 0)))
    a, b = _random((6, 4, 5, 3), seed=5), _random((3, 6, 7, 5), seed=6)
    _check(lambda a, b: lax.dot_general(a, b, dn), a, b)

  def test_zero_size_contraction_gives_zeros(self):
    got = _check(jnp.matmul, jnp.ones((7, 0)), jnp.ones((0, 5)))
    chex.assert_trees_all_equal(got, jnp.zeros((7, 5)))

  @parameterized.named_parameters(("m", (0, 3), (3, 5)), ("n", (4, 3), (3, 0)),
                                  ("batch", (0, 2, 3), (0, 3, 4)))
  def test_zero_size_result(self, a_shape, b_shape):
    _check(jnp.matmul, jnp.ones(a_shape), jnp.ones(b_shape))

  @parameterized.named_parameters(("f16", jnp.float16), ("bf16", jnp.bfloat16),
                                  ("int32", jnp.int32))
  def test_dtypes(self, dtype):
    _check(jnp.matmul, _random((33, 70), dtype, 7), _random((70, 9), dtype, 8), tol=_TOL[dtype])

  def test_half_partials(self):
    a, b = _random((12, 2000), jnp.float16, 28), _random((2000, 10), jnp.float16, 29)
    cfg = _config(partials_type="float16")
    lowered = ipu_jax.jit(jnp.matmul, target=_SMALL, config=cfg).lower(a, b)
    partials = [t for t in lowered.report.profile.tensors if t.name == "dot_general/partials"]
    self.assertNotEmpty(partials)
    self.assertEqual(partials[0].dtype, "float16")
    want = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)))
    got = np.asarray(ipu_jax.jit(jnp.matmul, target=_SMALL, config=cfg)(a, b), np.float32)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())

  def test_preferred_element_type_f32_from_bf16(self):
    fn = lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32)
    a, b = _random((20, 96), jnp.bfloat16, 9), _random((96, 12), jnp.bfloat16, 10)
    got = _check(fn, a, b, tol=1e-5)
    self.assertEqual(got.dtype, jnp.float32)

  def test_dense_layer_gradients(self):
    def loss(params, x):
      w, b = params
      y = jnp.tanh(x @ w + jnp.broadcast_to(b, (x.shape[0], b.shape[0])))
      return jnp.sum(y * y)

    params = (_random((24, 10), seed=11) * 0.3, _random((10,), seed=12))
    x = _random((13, 24), seed=13)
    _check(jax.grad(loss, argnums=(0, 1)), params, x, tol=1e-5)

  def test_per_tile_matches_batched_with_partials_reduce(self):
    # A long contraction makes the plan split K (gk > 1), so the per-tile
    # partials are reduced after the products: gk = 16 here, in poplin's two
    # stages, a superstep each (cost model 22; one superstep before).
    a, b = _random((12, 2000), seed=14), _random((2000, 10), seed=15)
    lowered = ipu_jax.jit(jnp.matmul, target=_SMALL).lower(a, b)
    names = [s.name for s in _dot_steps(lowered)]
    self.assertEqual(_grid(names[0])[3], 16)
    self.assertLen(names, 3)
    self.assertIn("stage 1/2 reduce", names[1])
    self.assertIn("stage 2/2 reduce", names[2])
    _check(jnp.matmul, a, b)

  def test_batched_split_k_gives_jit_numbers(self):
    # The batched executor computes a split-K product as one dot_general, as
    # jax.jit does, so the result is jax.jit's bit for bit (summing the
    # tiles' K-block partials instead would round differently); the profile
    # still shows the split and its reduce step.
    a, b = _random((64, 3000), seed=40), _random((3000, 48), seed=41)
    f = ipu_jax.jit(jnp.matmul, target=_SMALL, config=_config("batched"))
    steps = _dot_steps(f.lower(a, b))
    self.assertGreater(_grid(steps[0].name)[3], 1)
    self.assertIn("reduce", steps[1].name)
    np.testing.assert_array_equal(np.asarray(f(a, b)), np.asarray(jax.jit(jnp.matmul)(a, b)))

  def test_per_tile_on_full_target(self):
    a, b = _random((2, 96, 200), seed=16), _random((2, 200, 72), seed=17)
    _check(jnp.matmul, a, b, target=_FULL)

  def test_several_ipus(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    a, b = _random((40, 300), seed=18), _random((300, 24), seed=19)
    _check(jnp.matmul, a, b, target=target)
    lowered = ipu_jax.jit(jnp.matmul, target=target).lower(a, b)
    self.assertGreater(sum(s.ipu_link_bytes for s in _dot_steps(lowered)), 0)

  def test_1024_cubed_on_full_target_reports_the_plan(self):
    a, b = _random((1024, 1024), seed=20), _random((1024, 1024), seed=21)
    f = ipu_jax.jit(jnp.matmul, target=_FULL)
    lowered = f.lower(a, b)
    plan = plan_matmul(_FULL, 1, 1024, 1024, 1024, jnp.float32, jnp.float32, 0.6)
    steps = _dot_steps(lowered)
    self.assertIn(plan.label, steps[0].name)
    ideal = 2 * 1024 ** 3 / (32 * 1472)
    self.assertGreaterEqual(steps[0].compute_phase_cycles, ideal)
    # 1.4 (was 1.3) since the AMP estimator (issue 12) charges poplibs' per-pass
    # worker entry and fp32 partials-zeroing cycles: ~74 % of peak on ~45-row blocks.
    self.assertLess(plan.compute_cycles, 1.4 * ideal)
    reported = lowered.report.cycles_by_op()["dot_general"]
    # The report's exchange is exact; the plan assumes nothing is in place.
    self.assertAlmostEqual(reported / plan.cycles, 1.0, delta=0.05)
    self.assertLess(reported, 2.5 * ideal)
    self.assertGreater(plan.num_tiles, 1024)
    # A 1,024-long float32 sum: held to its rounding-error bound, not a fixed atol.
    testing_utils.assert_within_sum_bound(np.asarray(f(a, b)), np.matmul, a, b,
                                          against=jax.jit(jnp.matmul)(a, b))


@functools.lru_cache(maxsize=None)
def _dot_fn(dn, preferred):
  """``lax.dot_general`` with these parameters, the same function object each time."""
  return lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=preferred)


def _attention_loss(q, k, v):
  """A loss through dot-product attention as Flax writes it: the batch
  dimensions of both products (batch, heads) are not all leading."""
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4
  probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  return jnp.sum(out.astype(jnp.float32) ** 2)


_ATTENTION_GRAD = jax.grad(_attention_loss, argnums=(0, 1, 2))


class HalfNonLeadingBatchTest(chex.TestCase, parameterized.TestCase):
  """2-byte float products whose batch dimensions are not leading.

  XLA:CPU cannot run a bfloat16 x bfloat16 -> float32 ``dot_general`` with
  such batch dimensions (it fails when the result is read), though
  ``jax.jit`` runs the same product with a bfloat16 result; the emulation
  multiplies in float32 partials, so it must widen the operands first.
  """

  _DOTS = {  # lhs shape, rhs shape, dimension numbers
      "two_batch_dims": ((2, 5, 8, 7), (2, 3, 5, 8), (((2,), (3,)), ((0, 1), (0, 2)))),
      "middle_batch_dim": ((3, 5, 6), (6, 5, 4), (((2,), (0,)), ((1,), (1,)))),
      "trailing_rhs_batch_dim": ((4, 3, 6), (6, 5, 3), (((2,), (0,)), ((1,), (2,)))),
      "split_k": ((2, 3, 300, 5), (2, 7, 3, 300), (((2,), (3,)), ((0, 1), (0, 2)))),
  }

  @parameterized.product(
      dtype=(jnp.bfloat16, jnp.float16), preferred=(None, jnp.float32, "same"),
      dot=tuple(_DOTS), mode=testing_utils.MODES)
  def test_matches_jit(self, dtype, preferred, dot, mode):
    a_shape, b_shape, dn = self._DOTS[dot]
    preferred = dtype if preferred == "same" else preferred
    fn = _dot_fn(dn, preferred)  # one function per product: both modes share jax.jit's compile
    a, b = _random(a_shape, dtype, 1), _random(b_shape, dtype, 2)
    got = np.asarray(ipu_jax.jit(fn, target=_SMALL, config=_config(mode))(a, b))
    try:
      want = np.asarray(jax.jit(fn)(a, b))
    except Exception:  # pylint: disable=broad-except
      # XLA:CPU's own failure (bf16 x bf16 -> f32): the same product on the
      # operands widened exactly to float32.
      want = np.asarray(jax.jit(fn)(a.astype(jnp.float32), b.astype(jnp.float32)))
    self.assertEqual(got.dtype, want.dtype)
    if mode == "batched":  # one dot_general, as jax.jit computes it
      np.testing.assert_array_equal(got, want)
    else:  # the tiles sum K blocks in their own order
      scale = float(np.abs(want.astype(np.float64)).max())
      np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=0,
                                 atol=_TOL[jnp.dtype(got.dtype).type] * scale)

  @parameterized.product(dtype=(jnp.bfloat16, jnp.float16), mode=testing_utils.MODES)
  def test_attention_gradients(self, dtype, mode):
    q, k, v = (_random((2, 5, 3, 8), dtype, seed) for seed in (3, 4, 5))
    grad = _ATTENTION_GRAD  # one function: both modes share jax.jit's compile
    got = ipu_jax.jit(grad, target=_SMALL, config=_config(mode))(q, k, v)
    want = jax.jit(grad)(q, k, v)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    for g, w in zip(got, want):
      np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=0,
                                 atol=_TOL[dtype] * float(np.abs(np.asarray(w, np.float64)).max()))


class ExchangeAccountingTest(chex.TestCase, parameterized.TestCase):

  def test_nothing_moves_on_one_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    lowered = ipu_jax.jit(jnp.matmul, target=target).lower(jnp.ones((9, 7)), jnp.ones((7, 5)))
    self.assertEqual(sum(int(s.exchange_bytes_in.sum()) for s in _dot_steps(lowered)), 0)
    self.assertGreater(lowered.report.total_cycles, 0)

  @parameterized.named_parameters(
      ("matmul", (7, 13), (13, 5), (((1,), (0,)), ((), ()))),
      ("tall", (64, 30), (30, 17), (((1,), (0,)), ((), ()))),
      ("batched", (3, 8, 5), (5, 3, 6), (((2,), (0,)), ((0,), (1,)))),
  )
  def test_exchange_matches_brute_force(self, a_shape, b_shape, dn):
    lowered = ipu_jax.jit(lambda a, b: lax.dot_general(a, b, dn), target=_SMALL).lower(
        jnp.ones(a_shape), jnp.ones(b_shape))
    step = _dot_steps(lowered)[0]
    gb, gm, gn, gk, bb, bm, bn, bk = _grid(step.name)
    (lc, rc), (lb, rb) = dn
    lf = [i for i in range(len(a_shape)) if i not in lc + lb]
    rf = [i for i in range(len(b_shape)) if i not in rc + rb]
    sizes = lambda shape, axes: int(np.prod([shape[i] for i in axes]))
    b, m, k, n = (sizes(a_shape, lb), sizes(a_shape, lf), sizes(a_shape, lc), sizes(b_shape, rf))
    lhs, rhs = lowered.inputs
    ia = np.arange(lhs.size).reshape(a_shape).transpose(list(lb) + lf + list(lc)).reshape(b, m, k)
    ib = np.arange(rhs.size).reshape(b_shape).transpose(list(rb) + list(rc) + rf).reshape(b, k, n)
    tiles = lowered.outputs[0].mapping.tiles
    bytes_in = np.zeros(_SMALL.num_tiles, np.int64)
    needed_by = {}
    for g, (i0, i1, i2, i3) in enumerate(np.ndindex(gb, gm, gn, gk)):
      blocks = ((lhs, ia[i0 * bb:(i0 + 1) * bb, i1 * bm:(i1 + 1) * bm, i3 * bk:(i3 + 1) * bk]),
                (rhs, ib[i0 * bb:(i0 + 1) * bb, i3 * bk:(i3 + 1) * bk, i2 * bn:(i2 + 1) * bn]))
      for tensor, ids in blocks:
        ids = ids.ravel()
        bytes_in[tiles[g]] += 4 * int((tensor.mapping.element_tile[ids] != tiles[g]).sum())
        for e in ids:
          needed_by.setdefault((tensor.id, int(e)), set()).add(int(tiles[g]))
    bytes_out = np.zeros(_SMALL.num_tiles, np.int64)
    for (tid, e), dst in needed_by.items():
      src = (lhs if tid == lhs.id else rhs).mapping.element_tile[e]
      bytes_out[src] += 4 * bool(dst - {int(src)})
    np.testing.assert_array_equal(step.exchange_bytes_in, bytes_in)
    np.testing.assert_array_equal(step.exchange_bytes_out, bytes_out)


class PlannerTest(chex.TestCase, parameterized.TestCase):

  def test_plan_fields(self):
    plan = plan_matmul(_SMALL, 1, 200, 120, 300, "float32")
    self.assertIsInstance(plan, MatmulPlan)
    gb, gm, gn, gk = plan.grid
    self.assertLessEqual(plan.num_tiles, 16)
    for dim, g, blk in zip((1, 200, 120, 300), plan.grid, (plan.block[0], plan.block[1],
                                                          plan.block[2], plan.block[3])):
      self.assertEqual(blk, -(-dim // g))
    self.assertTrue(plan.fits)
    self.assertAlmostEqual(plan.cycles, plan.sync_cycles + plan.exchange_cycles
                           + plan.compute_cycles + plan.reduce_cycles)
    self.assertIn(plan.label, plan.describe())
    del gb, gm, gn, gk

  @parameterized.named_parameters(("full_1024", _FULL, 1024, 1024, 1024, 0.01),
                                  ("small_512", _SMALL, 512, 512, 512, 0.2),
                                  ("small_wide", _SMALL, 64, 2048, 700, 0.1))
  def test_lower_memory_proportion_uses_less_memory_not_fewer_cycles(
      self, target, m, n, k, low):
    high = plan_matmul(target, 1, m, n, k, "float32", "float32", 0.6)
    lower = plan_matmul(target, 1, m, n, k, "float32", "float32", low)
    self.assertLessEqual(lower.temp_bytes, high.temp_bytes)
    self.assertGreaterEqual(lower.cycles, high.cycles)
    self.assertLessEqual(lower.temp_bytes, max(lower.memory_limit, high.temp_bytes))

  def test_memory_proportion_changes_the_lowered_plan(self):
    a, b = _random((256, 512), seed=22), _random((512, 384), seed=23)
    tight = _config(available_memory_proportion=0.05)
    lowered = {amp: ipu_jax.jit(jnp.matmul, target=_SMALL, config=cfg).lower(a, b)
               for amp, cfg in ((0.6, _config()), (0.05, tight))}
    peaks = {amp: int(l.report.memory_per_tile.max()) for amp, l in lowered.items()}
    cycles = {amp: l.report.total_cycles for amp, l in lowered.items()}
    self.assertLess(peaks[0.05], peaks[0.6])
    self.assertGreaterEqual(cycles[0.05], cycles[0.6])
    _check(jnp.matmul, a, b, modes=("batched",))

  @parameterized.named_parameters(("n", (256, 784), (784, 512), 0.1),
                                  ("m", (300, 200), (200, 30), 0.02))
  def test_serial_passes_when_nothing_fits(self, a_shape, b_shape, amp):
    # On 16 tiles no single pass fits these limits: the product is done in
    # serial passes, each writing its part of the result.
    a, b = _random(a_shape, seed=24), _random(b_shape, seed=25)
    plan = plan_matmul(_SMALL, 1, a_shape[0], b_shape[1], a_shape[1], "float32", "float32", amp)
    self.assertGreater(plan.serial, 1)
    self.assertTrue(plan.fits)
    one_pass = plan_matmul(_SMALL, 1, a_shape[0], b_shape[1], a_shape[1], "float32", "float32",
                           1.0)
    self.assertGreater(plan.cycles, one_pass.cycles)
    want = jax.jit(jnp.matmul)(a, b)
    for mode in ("batched", "per_tile"):
      f = ipu_jax.jit(jnp.matmul, target=_SMALL,
                      config=_config(mode, available_memory_proportion=amp))
      chex.assert_trees_all_close(f(a, b), want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    steps = _dot_steps(f.lower(a, b))
    self.assertLen([s for s in steps if "matmul" in s.name], plan.serial)
    self.assertIn(f"pass {plan.serial}/{plan.serial}", steps[-1].name)

  def test_mlp_layer_fits_on_16_tiles(self):
    # 256x784 @ 784x512 needs more than one pass's worth of memory on 16 tiles.
    a, b = _random((256, 784), seed=26), _random((784, 512), seed=27)
    lowered = ipu_jax.jit(jnp.matmul, target=_SMALL).lower(a, b)
    self.assertLessEqual(int(lowered.report.memory_per_tile.max()), _SMALL.bytes_per_tile)

  def test_fp16_runs_at_four_times_the_fp32_rate(self):
    f32 = plan_matmul(_FULL, 1, 512, 512, 512, "float32")
    f16 = plan_matmul(_FULL, 1, 512, 512, 512, "float16")
    self.assertLess(f16.compute_cycles, f32.compute_cycles)
    self.assertGreater(f16.compute_cycles, 0)

  def test_plans_are_cached(self):
    a = plan_matmul(_SMALL, 2, 30, 40, 50, np.float32)
    b = plan_matmul(_SMALL, 2, 30, 40, 50, "float32")
    self.assertIs(a, b)

  def test_split_candidates(self):
    c = split_candidates(1024, 1472)
    self.assertEqual(c[0], 1)
    self.assertEqual(c[-1], 1024)
    self.assertContainsSubset([2, 4, 8, 16, 32, 64], c.tolist())
    self.assertEqual(split_candidates(1, 16).tolist(), [1])


if __name__ == "__main__":
  absltest.main()
