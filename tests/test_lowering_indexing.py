"""Tests of the data-dependent indexing rules (rules/gather, scatter, dynamic_slice, sort).

Every case compares ``ipu_jax.jit`` with ``jax.jit`` on random inputs; a few
check what a user sees in the report (exchange, cycles) and that the
``"per_tile"`` executor serves an embedding lookup tile by tile.
"""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import registered_primitives
from ipu_jax.lowering.rules import gather as gather_rules
from ipu_jax.lowering.rules import scatter as scatter_rules
import testing_utils

_TARGET = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "i32": jnp.int32}


def _random(rng, shape, dtype):
  dtype = jnp.dtype(dtype)
  # Cast and placed from the host: a device cast (or jnp.asarray) compiles an
  # XLA program per shape and dtype.
  if jnp.issubdtype(dtype, jnp.integer):
    return testing_utils.on_device(rng.integers(-50, 50, shape), dtype)
  return testing_utils.on_device(rng.standard_normal(shape), dtype)


def _per_tile_config():
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = "per_tile"
  return cfg


class IndexingTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(0)

  def _needs(self, *names):
    """The test relies on other families' rules: they must be registered."""
    registered = {p.name for p in registered_primitives()}
    missing = [n for n in names if n not in registered]
    self.assertEqual(missing, [], f"lowering rules missing for {missing}")

  def _check(self, fn, *args, **kwargs):
    return self._check_lowered(fn, *args, **kwargs)[0]

  def _check_lowered(self, fn, *args, target=_TARGET, config=None, exact=True):
    """``_check``, also returning the ``Lowered`` that ran (for its report: lowered once)."""
    lowered = ipu_jax.jit(fn, target=target, config=config).lower(*args)
    got = lowered(*args)
    want = jax.jit(fn)(*args)
    jax.tree_util.tree_map(lambda g, w: self.assertEqual(g.dtype, w.dtype), got, want)
    if exact:
      chex.assert_trees_all_equal(got, want)
    else:
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
    return got, lowered

  # -- dynamic_slice / dynamic_update_slice ----------------------------------

  @parameterized.product(dtype=["f32", "bf16", "i32"],
                         starts=[(1, 2), (-3, 7), (100, -100), (5, 5)])
  def test_dynamic_slice_traced_indices(self, dtype, starts):
    x = _random(self.rng, (7, 9), _DTYPES[dtype])
    fn = lambda x, i, j: lax.dynamic_slice(x, (i, j), (3, 4))
    self._check(fn, x, jnp.int32(starts[0]), jnp.int32(starts[1]))

  def test_dynamic_slice_constant_indices_is_exact_movement(self):
    x = _random(self.rng, (33, 17), jnp.float32)
    fn = lambda x: lax.dynamic_slice(x, (30, 2), (5, 3))  # clamps to row 28
    _, lowered = self._check_lowered(fn, x)
    (step,) = [s for s in lowered.profile.steps if s.op == "dynamic_slice"]
    self.assertTrue(step.name.endswith("/static"))
    self.assertEqual(step.exchange_bytes_in.sum(), step.exchange_bytes_out.sum())

  @parameterized.product(dtype=["f32", "bf16", "i32"], starts=[(2, 3), (-1, 100), (6, 0)])
  def test_dynamic_update_slice(self, dtype, starts):
    x = _random(self.rng, (7, 11), _DTYPES[dtype])
    u = _random(self.rng, (3, 4), _DTYPES[dtype])
    fn = lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j))
    self._check(fn, x, u, jnp.int32(starts[0]), jnp.int32(starts[1]))

  def test_dynamic_update_slice_constant_indices(self):
    x = _random(self.rng, (40, 9), jnp.float32)
    u = _random(self.rng, (2, 9), jnp.float32)
    fn = lambda x, u: lax.dynamic_update_slice(x, u, (39, 0))
    self._check(fn, x, u)

  def test_dynamic_index_in_scan(self):
    self._needs("scan", "broadcast_in_dim", "squeeze")
    xs = _random(self.rng, (10, 5), jnp.float32)

    def fn(xs):
      def body(c, i):
        return c + lax.dynamic_index_in_dim(xs, i, keepdims=False), None
      return lax.scan(body, jnp.zeros(5), jnp.arange(10))[0]

    self._check(fn, xs, exact=False)

  # -- gather -----------------------------------------------------------------

  @parameterized.product(dtype=["f32", "bf16", "i32"])
  def test_embedding_lookup(self, dtype):
    self._needs("broadcast_in_dim")
    table = _random(self.rng, (257, 33), _DTYPES[dtype])
    ids = jnp.asarray(self.rng.integers(-257, 257, (5, 7)), jnp.int32)
    self._check(lambda t, i: t[i], table, ids)

  def test_embedding_lookup_out_of_range_clamps(self):
    self._needs("broadcast_in_dim")
    table = _random(self.rng, (257, 33), jnp.float32)
    ids = jnp.asarray([[0, 256, 300, -900, 5]], jnp.int32)
    self._check(lambda t, i: t[i], table, ids)

  def test_gather_leading_axis_direct(self):
    # The embedding gather built by hand: needs no other family's rules.
    table = _random(self.rng, (257, 33), jnp.float32)
    ids = jnp.asarray(self.rng.integers(-10, 270, (5, 7, 1)), jnp.int32)
    dnums = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    for mode in ("clip", "fill", "promise_in_bounds"):
      fn = lambda t, i, mode=mode: lax.gather(t, i, dnums, (1, 33), mode=mode)
      self._check(fn, table, ids)
      self._check(fn, table, ids, config=_per_tile_config())

  @parameterized.product(dtype=["f32", "i32"])
  def test_take_fill_mode(self, dtype):
    self._needs("broadcast_in_dim", "jit")
    table = _random(self.rng, (31, 6), _DTYPES[dtype])
    ids = jnp.asarray([[0, 30, 31, -1, -40, 7]], jnp.int32)
    fn = lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=-7)
    self._check(fn, table, ids)
    fn_default = lambda t, i: jnp.take(t, i, axis=0, mode="fill")
    self._check(fn_default, table, ids)
    self._check(fn_default, table, ids, config=_per_tile_config())

  def test_take_along_axis(self):
    self._needs("reshape", "jit")
    x = _random(self.rng, (6, 9), jnp.float32)
    idx = jnp.asarray(self.rng.integers(0, 9, (6, 4)), jnp.int32)
    self._check(lambda x, i: jnp.take_along_axis(x, i, axis=1), x, idx)
    self._check(lambda x, i: jnp.take_along_axis(x, i, axis=1), x, idx,
                config=_per_tile_config())

  def test_column_gather(self):
    self._needs("broadcast_in_dim")
    x = _random(self.rng, (13, 9), jnp.float32)
    idx = jnp.asarray([8, 0, 3, 3, -2], jnp.int32)
    self._check(lambda x, i: x[:, i], x, idx)

  def test_gather_2d_index_vector(self):
    # x[i, j] with two index arrays: a 2-element index vector per lookup.
    self._needs("broadcast_in_dim", "concatenate")
    x = _random(self.rng, (11, 7, 3), jnp.float32)
    i = jnp.asarray(self.rng.integers(0, 11, (4,)), jnp.int32)
    j = jnp.asarray(self.rng.integers(0, 7, (4,)), jnp.int32)
    self._check(lambda x, i, j: x[i, j], x, i, j)

  def test_gather_constant_indices(self):
    x = _random(self.rng, (20, 5), jnp.float32)
    indices = np.array([[3], [19], [0], [25]], np.int32)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    fn = lambda x: lax.gather(x, indices, dnums, (1, 5), mode="fill", fill_value=0.5)
    _, lowered = self._check_lowered(fn, x)
    names = [s.name for s in lowered.profile.steps]
    self.assertIn("gather/static", names)

  def test_gather_size_zero(self):
    table = _random(self.rng, (9, 4), jnp.float32)
    ids = jnp.zeros((0, 1), jnp.int32)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    fn = lambda t, i: lax.gather(t, i, dnums, (1, 4), mode="clip")
    self.assertEqual(self._check(fn, table, ids).shape, (0, 4))

  def test_gather_report_charges_index_broadcast_and_results(self):
    table = _random(self.rng, (257, 33), jnp.float32)
    ids = jnp.asarray(self.rng.integers(0, 257, (5, 7, 1)), jnp.int32)
    dnums = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    fn = lambda t, i: lax.gather(t, i, dnums, (1, 33), mode="clip")
    lowered = ipu_jax.jit(fn, target=_TARGET).lower(table, ids)
    (step,) = [s for s in lowered.profile.steps if s.op == "gather"]
    # Every table tile (all 16) receives the 140 index bytes it does not hold.
    self.assertGreater(step.exchange_bytes_in.sum(), 0)
    self.assertTrue(np.all(step.compute_cycles > 0))
    result_bytes = 5 * 7 * 33 * 4
    self.assertLessEqual(step.exchange_bytes_in.sum(), result_bytes + 16 * ids.nbytes)
    self.assertGreater(lowered.report.total_cycles, 0)

  # -- scatter ----------------------------------------------------------------

  @parameterized.product(dtype=["f32", "i32"])
  def test_scatter_add_duplicate_indices(self, dtype):
    self._needs("broadcast_in_dim")
    x = _random(self.rng, (23, 9), _DTYPES[dtype])
    idx = jnp.asarray([3, 3, 22, 0, 3, -1, 22], jnp.int32)
    upd = _random(self.rng, (7, 9), _DTYPES[dtype])
    self._check(lambda x, i, u: x.at[i].add(u), x, idx, upd, exact=False)

  @parameterized.parameters("set", "max", "min", "mul")
  def test_scatter_ops(self, op):
    self._needs("broadcast_in_dim")
    x = _random(self.rng, (17, 5), jnp.float32)
    idx = jnp.asarray([4, 16, 0, 4, 30], jnp.int32)  # 30 is dropped
    upd = _random(self.rng, (5, 5), jnp.float32)
    fn = lambda x, i, u: getattr(x.at[i], {"mul": "multiply"}.get(op, op))(u)
    self._check(fn, x, idx, upd, exact=False)

  @parameterized.parameters("add", "set", "max", "mul")
  def test_scatter_direct_per_tile(self, op):
    x = _random(self.rng, (41, 7), jnp.float32)
    idx = jnp.asarray([[3], [3], [40], [0], [41], [-2], [17]], jnp.int32)
    upd = _random(self.rng, (7, 7), jnp.float32)
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
    scatter = {"add": lax.scatter_add, "set": lax.scatter, "max": lax.scatter_max,
               "mul": lax.scatter_mul}[op]
    with mock.patch.object(scatter_rules, "_rows_scatter_per_tile",
                           wraps=scatter_rules._rows_scatter_per_tile) as spy:
      for mode in ("fill", "clip", "promise_in_bounds"):
        fn = lambda x, i, u, mode=mode: scatter(x, i, u, dnums, mode=mode)
        self._check(fn, x, idx, upd, exact=False)
        self._check(fn, x, idx, upd, exact=False, config=_per_tile_config())
    self.assertEqual(spy.call_count, 3)  # once per per_tile program

  def test_scatter_empty_updates(self):
    x = _random(self.rng, (6, 3), jnp.float32)
    idx = jnp.zeros((0, 1), jnp.int32)
    upd = jnp.zeros((0, 3), jnp.float32)
    dnums = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                        scatter_dims_to_operand_dims=(0,))
    self._check(lambda x, i, u: lax.scatter_add(x, i, u, dnums), x, idx, upd)

  def test_embedding_gradient(self):
    self._needs("broadcast_in_dim", "reduce_sum", "mul")
    table = _random(self.rng, (257, 33), jnp.float32)
    ids = jnp.asarray(self.rng.integers(0, 257, (5, 7)), jnp.int32)
    ids = ids.at[0, :3].set(11)  # repeated ids accumulate
    w = _random(self.rng, (5, 7, 33), jnp.float32)
    loss = lambda t, i, w: jnp.sum(t[i] * w)
    self._check(jax.grad(loss), table, ids, w, exact=False)

  def test_take_along_axis_gradient(self):
    self._needs("reshape", "jit", "reduce_sum", "broadcast_in_dim")
    x = _random(self.rng, (6, 9), jnp.float32)
    idx = jnp.asarray(self.rng.integers(0, 9, (6, 4)), jnp.int32)
    fn = jax.grad(lambda x, i: jnp.take_along_axis(x, i, axis=1).sum())
    self._check(fn, x, idx, exact=False)

  # -- sort / top_k -----------------------------------------------------------

  @parameterized.product(dtype=["f32", "bf16", "i32"])
  def test_argsort_last_axis(self, dtype):
    self._needs("iota", "jit")
    x = _random(self.rng, (7, 13), _DTYPES[dtype])
    self._check(lambda x: jnp.argsort(x, axis=-1), x)

  def test_sort_first_axis(self):
    self._needs("jit")
    x = _random(self.rng, (13, 7), jnp.float32)
    self._check(lambda x: jnp.sort(x, axis=0), x)
    self._check(lambda x: jnp.sort(x, axis=0), x, config=_per_tile_config())

  def test_sort_direct(self):
    x = _random(self.rng, (5, 3, 11), jnp.float32)
    for dim in (0, 1, 2):
      self._check(lambda x, dim=dim: lax.sort(x, dimension=dim), x)

  def test_multi_operand_sort(self):
    keys1 = jnp.asarray(self.rng.integers(0, 3, (6, 17)), jnp.int32)
    keys2 = _random(self.rng, (6, 17), jnp.float32)
    vals = _random(self.rng, (6, 17), jnp.bfloat16)
    fn = lambda a, b, c: lax.sort((a, b, c), num_keys=2, is_stable=True)
    self._check(fn, keys1, keys2, vals)
    fn1 = lambda a, b, c: lax.sort((a, b, c), num_keys=1, is_stable=True)
    self._check(fn1, keys1, keys2, vals, config=_per_tile_config())

  def test_sort_1d_and_long_rows(self):
    x = _random(self.rng, (301,), jnp.float32)
    self._check(lambda x: lax.sort(x), x)
    # Rows too long for one tile: chunks on 8 tiles per row, bitonic merges.
    keys = _random(self.rng, (3, 20011), jnp.float32)
    vals = jnp.asarray(self.rng.integers(0, 1000, (3, 20011)), jnp.int32)
    fn = lambda k, v: lax.sort((k, v), num_keys=1)
    _, lowered = self._check_lowered(fn, keys, vals)
    steps = lowered.profile.steps
    merges = [s for s in steps if s.name.startswith("sort/merge")]
    self.assertLen(merges, 6)  # log2(8) * (log2(8) + 1) / 2
    self.assertTrue(all(s.exchange_bytes_in.sum() > 0 for s in merges))

  def test_sort_size_zero(self):
    x = jnp.zeros((0, 5), jnp.float32)
    self._check(lambda x: lax.sort(x, dimension=1), x)

  @parameterized.parameters(1, 3, 13)
  def test_top_k(self, k):
    x = _random(self.rng, (4, 5, 13), jnp.float32)
    self._check(lambda x: lax.top_k(x, k), x)

  def test_top_k_1d_and_long_row(self):
    x = _random(self.rng, (37,), jnp.float32)
    self._check(lambda x: lax.top_k(x, 5), x)
    x = _random(self.rng, (2, 30001), jnp.float32)
    _, lowered = self._check_lowered(lambda x: lax.top_k(x, 7), x)
    names = [s.name for s in lowered.profile.steps]
    self.assertIn("top_k/merge", names)

  def test_top_k_int_and_bf16(self):
    for dtype in (jnp.int32, jnp.bfloat16):
      x = _random(self.rng, (9, 21), dtype)
      self._check(lambda x: lax.top_k(x, 4), x)

  def test_approx_max_k(self):
    x = _random(self.rng, (6, 40), jnp.float32)
    self._check(lambda x: lax.approx_max_k(x, 3), x)
    self._check(lambda x: lax.approx_min_k(x, 2), x)

  # -- targets and executor modes ---------------------------------------------

  def test_two_ipus_charge_links(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    table = _random(self.rng, (300, 16), jnp.float32)
    ids = jnp.asarray(self.rng.integers(0, 300, (12, 1)), jnp.int32)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    fn = lambda t, i: lax.gather(t, i, dnums, (1, 16), mode="clip")
    _, lowered = self._check_lowered(fn, table, ids, target=target)
    (step,) = [s for s in lowered.profile.steps if s.op == "gather"]
    self.assertGreater(step.ipu_link_bytes, 0)

  def test_per_tile_gather_narrow_unsigned_indices(self):
    table = _random(self.rng, (300, 5), jnp.float32)
    ids = jnp.asarray(self.rng.integers(0, 256, (9, 1)), jnp.uint8)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                       start_index_map=(0,))
    for mode in ("clip", "fill"):
      fn = lambda t, i, mode=mode: lax.gather(t, i, dnums, (1, 5), mode=mode)
      self._check(fn, table, ids, config=_per_tile_config())
    small = _random(self.rng, (7, 5), jnp.bfloat16)
    fn = lambda t, i: lax.gather(t, i, dnums, (1, 5), mode="fill")
    self._check(fn, small, ids, config=_per_tile_config())


  def test_full_ipu2_embedding_and_scatter(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    table = _random(self.rng, (1000, 64), jnp.float32)
    ids = jnp.asarray(self.rng.integers(0, 1000, (8, 9, 1)), jnp.int32)
    upd = _random(self.rng, (8, 9, 64), jnp.float32)
    gd = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                    start_index_map=(0,))
    sd = lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0,))

    def fn(t, i, u):
      rows = lax.gather(t, i, gd, (1, 64), mode="clip")
      return rows, lax.scatter_add(t, i, u, sd)

    _, lowered = self._check_lowered(fn, table, ids, upd, target=target, exact=False)
    (step,) = [s for s in lowered.profile.steps if s.op == "gather"]
    self.assertGreater(int((step.compute_cycles > 0).sum()), 100)

  def test_per_tile_embedding_lookup_is_exact_and_served_per_tile(self):
    self._needs("broadcast_in_dim")
    table = _random(self.rng, (257, 33), jnp.float32)
    table = table.at[3, 4].set(-0.0).at[5, 0].set(jnp.inf).at[9, 1].set(jnp.nan)
    ids = jnp.asarray(self.rng.integers(-257, 257, (5, 7)), jnp.int32)
    ids = ids.at[0, :3].set(jnp.asarray([3, 5, 9]))
    fn = lambda t, i: t[i]
    with mock.patch.object(gather_rules, "_rows_gather_per_tile",
                           wraps=gather_rules._rows_gather_per_tile) as spy:
      got = ipu_jax.jit(fn, target=_TARGET, config=_per_tile_config())(table, ids)
    self.assertEqual(spy.call_count, 1)
    want = jax.jit(fn)(table, ids)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32),
                                  np.asarray(want).view(np.uint32))


class ManyIndicesSmallTableTest(chex.TestCase, parameterized.TestCase):
  """Many indices into a small table: partial tables and replicated tables.

  Sending every index to the table's one tile used to run the tile out of
  memory; the partial-tables scatter and the replicated-table gather keep the
  traffic on the tiles that hold the indices.
  """

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(1)
    # 3001 indices over 16 tiles, some out of range on both sides.
    self.idx = jnp.asarray(self.rng.integers(-2, 9, 3001), jnp.int32)
    self.upd = jnp.asarray(self.rng.standard_normal(3001), jnp.float32)

  def _check(self, fn, *args, exact, target=_TARGET):
    # The program that ran is the one whose report the caller reads: lowered once.
    lowered = ipu_jax.jit(fn, target=target).lower(*args)
    got = lowered(*args)
    want = jax.jit(fn)(*args)
    testing_utils.assert_trees_match(got, want, exact, rtol=1e-5, atol=1e-5)
    return lowered

  def _step_names(self, lowered, op):
    return [s.name for s in lowered.profile.steps if s.op == op]

  def test_index_tuples_of_no_components(self):
    # A whole-operand window (index_vector of length 0, as in the gradients of
    # some training steps): no tuple has a tile of its own.
    x, u = jnp.arange(5.0), jnp.ones(5)
    none = jnp.zeros((0,), jnp.int32)
    scatter_dims = lax.ScatterDimensionNumbers(
        update_window_dims=(0,), inserted_window_dims=(), scatter_dims_to_operand_dims=())
    gather_dims = lax.GatherDimensionNumbers(
        offset_dims=(0,), collapsed_slice_dims=(), start_index_map=())
    self._check(lambda x, u: lax.scatter_add(x, none, u, scatter_dims), x, u, exact=True)
    self._check(lambda x: lax.gather(x, none, gather_dims, (5,)), x, exact=True)

  @parameterized.product(
      op=["add", "set", "min", "max", "multiply"],
      dtype=["f32", "i32", "bf16"],
      mode=["drop", "clip", "promise_in_bounds"])
  def test_scatter_into_small_table(self, op, dtype, mode):
    dtype = _DTYPES[dtype]
    idx = jnp.clip(self.idx, 0, 6) if mode == "promise_in_bounds" else self.idx
    signs = jnp.where(self.upd > 0, 1, -1)
    if op == "multiply":  # products of ~430 factors per element stay finite
      upd = 1 + self.upd * 1e-3 if dtype == jnp.float32 else signs
    elif op == "add" and dtype != jnp.float32:
      # Partial sums of +-1 stay below 256: exact in bfloat16 in any order.
      upd = signs
    else:
      upd = self.upd * 3
    upd = upd.astype(dtype)

    def fn(i, u):
      table = jnp.arange(7, dtype=dtype) - 3
      return getattr(table.at[i], op)(u, mode=mode)

    lowered = self._check(fn, idx, upd, exact=dtype != jnp.float32 or op in ("set", "min", "max"))
    prim = {"add": "scatter-add", "set": "scatter", "min": "scatter-min",
            "max": "scatter-max", "multiply": "scatter-mul"}[op]
    names = self._step_names(lowered, prim)
    self.assertEqual(names[0], f"{prim}/partials")
    self.assertEqual(names[-1], f"{prim}/apply")

  def test_overwrite_keeps_the_last_duplicate(self):
    idx = jnp.asarray(self.rng.integers(0, 5, 2999), jnp.int32)
    values = jnp.arange(2999, dtype=jnp.float32)
    fn = lambda i, v: jnp.full(5, -1.0).at[i].set(v)
    self._check(fn, idx, values, exact=True)
    got = np.asarray(ipu_jax.jit(fn, target=_TARGET)(idx, values))
    last = [max(np.flatnonzero(np.asarray(idx) == k), default=-1) for k in range(5)]
    np.testing.assert_array_equal(got, np.asarray(last, np.float32))

  def test_scatter_windows_and_multi_dimensional_indices(self):
    idx, upd = self.idx, self.upd
    rows = lambda i, u: jnp.zeros((7, 3)).at[i].add(jnp.stack([u, 2 * u, -u], 1), mode="drop")
    self._check(rows, idx, upd, exact=False)
    rows_set = lambda i, u: jnp.ones((7, 3), jnp.bfloat16).at[i].set(
        jnp.stack([u, 2 * u, -u], 1).astype(jnp.bfloat16), mode="clip")
    self._check(rows_set, idx, upd, exact=True)
    grid = lambda i, u: jnp.zeros((4, 3)).at[i % 4, i % 3].add(u)
    self._check(grid, idx, upd, exact=False)
    narrow = lambda i, u: jnp.zeros(7, jnp.uint8).at[i.astype(jnp.uint8)].add(
        (u * 100).astype(jnp.uint8), mode="drop")
    self._check(narrow, idx, upd, exact=True)
    sub = lambda i, u: lax.scatter_sub(
        jnp.ones(7), jnp.clip(i, 0, 6)[:, None], u,
        lax.ScatterDimensionNumbers((), (0,), (0,)))
    self._check(sub, idx, upd, exact=False)

  @parameterized.parameters("drop", "clip", "fill")
  def test_gather_from_small_table(self, mode):
    idx = self.idx
    take = lambda i: jnp.arange(7.0).at[i].get(mode=mode, fill_value=-1.0)
    lowered = self._check(take, idx, exact=True)
    self.assertEqual(self._step_names(lowered, "gather"), ["gather/replicated"])
    rows = lambda i: (jnp.arange(21, dtype=jnp.int32).reshape(7, 3)).at[i].get(mode=mode)
    self._check(rows, idx, exact=True)
    along = lambda i: jnp.take_along_axis(
        jnp.arange(14.0).reshape(2, 7), jnp.clip(i[:3000], 0, 6).reshape(2, 1500), axis=1)
    self._check(along, idx, exact=True)

  def test_large_table_few_indices_keeps_the_served_plan(self):
    table = _random(self.rng, (2000, 33), jnp.float32)
    idx = jnp.asarray(self.rng.integers(0, 2000, 7), jnp.int32)
    upd = _random(self.rng, (7, 33), jnp.float32)
    lowered = self._check(lambda t, i, u: t.at[i].add(u), table, idx, upd, exact=False)
    self.assertEqual(self._step_names(lowered, "scatter-add"), ["scatter-add"])
    lowered = self._check(lambda t, i: t[i], table, idx, exact=True)
    self.assertEqual(self._step_names(lowered, "gather"), ["gather"])

  def test_full_ipu2_many_indices_fit_far_below_sram(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    idx = jnp.asarray(self.rng.integers(0, 5, 100_000), jnp.int32)
    x = jnp.asarray(self.rng.standard_normal(100_000), jnp.float32)
    cases = [
        (lambda i: jnp.zeros(5).at[i].add(1.0), idx, "scatter-add"),
        (lambda i: jnp.bincount(i, length=5), idx, "scatter-add"),
        (lambda x: jnp.nonzero(x > 0, size=7)[0], x, "scatter-add"),
        (lambda i: jnp.arange(5.0)[i], idx, "gather"),
    ]
    for fn, arg, op in cases:
      lowered = self._check(fn, arg, exact=True, target=target)  # sums of ones: exact
      self.assertLess(int(lowered.profile.memory.peak.max()), target.bytes_per_tile // 32)
      steps = [s for s in lowered.profile.steps if s.op == op]
      # No tile receives more than a few kilobytes in any of the plan's steps.
      self.assertLess(max(int(s.exchange_bytes_in.max()) for s in steps), 4096)


if __name__ == "__main__":
  absltest.main()
