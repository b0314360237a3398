"""Tests of ipu_jax.sparse: BlockCSR, static sparse matmuls and their tile plans."""

import functools
import json
import os
import subprocess
import sys
import time
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import popsparse
from ipu_jax.lowering import sparse_plan
from ipu_jax.lowering.matmul_plan import plan_matmul
from ipu_jax.sparse import static_rule
from ipu_jax.sparse import (BlockCSR, BucketOverflowError, dynamic_layout, dynamic_matmul, encode,
                            static_matmul)

sys.path.insert(0, os.path.dirname(__file__))
from testing_utils import MODES, T16, executor_config  # noqa: E402

from experiments import popsparse_reference  # noqa: E402

BOW = ipu_jax.IPUTarget.preset("bow")


def _pattern(kind, grid, seed):
  """A block mask of one of the acceptance list's kinds."""
  rng = np.random.RandomState(seed)
  rows, cols = grid
  if kind == "random":
    return rng.rand(rows, cols) < 0.4
  if kind == "empty_rows":
    mask = rng.rand(rows, cols) < 0.5
    mask[::2] = False
    return mask
  if kind == "empty":
    return np.zeros(grid, bool)
  if kind == "one_block":
    mask = np.zeros(grid, bool)
    mask[rows - 1, cols // 2] = True
    return mask
  if kind == "full":
    return np.ones(grid, bool)
  raise ValueError(kind)


def _sparse(shape, block, kind="random", seed=0, dtype=np.float32):
  rng = np.random.RandomState(seed + 1)
  dense = rng.randn(*shape).astype(dtype)
  return BlockCSR.fromdense(dense, _pattern(kind, (shape[0] // block, shape[1] // block), seed),
                            (block, block))


def _dense(shape, seed=2, dtype=np.float32):
  return np.random.RandomState(seed).randn(*shape).astype(dtype)


def _run(fn, mode, *args, target=T16):
  return jax.tree.map(np.asarray, ipu_jax.jit(fn, target=target,
                                               config=executor_config(mode))(*args))


def _grad_case(side):
  """A sparse operand with empty rows, a dense one, and a loss of their product
  through ``static_matmul`` and the same loss through the densified matrix."""
  a = _sparse((32, 48), 4, "empty_rows")
  dense = _dense((48, 10) if side == "lhs" else (6, 32))
  weights = _dense((32, 10) if side == "lhs" else (6, 48), seed=5)

  def product_loss(values, d, matmul):
    s = BlockCSR.from_pattern(values, a.pattern)
    if matmul is jnp.matmul:
      s = s.todense()
    out = matmul(s, d) if side == "lhs" else matmul(d, s)
    return jnp.sum(jnp.sin(0.1 * out) * weights)

  return (a, dense, functools.partial(product_loss, matmul=static_matmul),
          functools.partial(product_loss, matmul=jnp.matmul))


# jax.jit of static_matmul, one per side: the executor modes of a case share
# the reference's compile (jit caches on the pattern and shapes).
_STATIC_REFERENCE = {"lhs": jax.jit(lambda s, d: static_matmul(s, d)),
                     "rhs": jax.jit(lambda s, d: static_matmul(d, s))}


@functools.lru_cache(maxsize=None)
def _grad_reference(side):
  """The gradients of ``_grad_case(side)``'s dense loss (the same for every
  executor mode and plan kind: computed once)."""
  a, dense, _, dense_loss = _grad_case(side)
  return jax.tree.map(np.asarray, jax.jit(jax.grad(dense_loss, (0, 1)))(a.values, dense))


def _steps(lowered):
  out = []

  def walk(p):
    for child in getattr(p, "programs", ()):
      walk(child)
    if hasattr(p, "fn"):
      out.append(p)
  walk(lowered.program)
  return out


class BlockCSRTest(parameterized.TestCase):

  def test_fromdense_and_todense(self):
    dense = _dense((8, 12))
    mask = np.array([[1, 0, 1], [0, 0, 1]], bool)
    a = BlockCSR.fromdense(dense, mask, (4, 4))
    self.assertEqual(a.nnz_blocks, 3)
    np.testing.assert_array_equal(a.row_offsets, [0, 2, 3])
    np.testing.assert_array_equal(a.col_indices, [0, 2, 2])
    want = dense * np.kron(mask, np.ones((4, 4)))
    np.testing.assert_array_equal(np.asarray(a.todense()), want)
    np.testing.assert_array_equal(np.asarray(a.T.todense()), want.T)

  def test_element_mask_and_default_mask(self):
    dense = np.zeros((4, 6), np.float32)
    dense[1, 4] = 3.0
    a = BlockCSR.fromdense(dense)            # 1x1 blocks where the matrix is non-zero
    self.assertEqual(a.nnz_blocks, 1)
    b = BlockCSR.fromdense(dense, dense != 0, (1, 1))
    np.testing.assert_array_equal(np.asarray(b.todense()), dense)

  def test_from_coordinates_sorts(self):
    values = np.arange(3 * 16, dtype=np.float32).reshape(3, 4, 4)
    a = BlockCSR.from_coordinates([1, 0, 1], [2, 1, 0], values, (8, 12), (4, 4))
    np.testing.assert_array_equal(a.row_offsets, [0, 1, 3])
    np.testing.assert_array_equal(a.col_indices, [1, 0, 2])
    dense = np.asarray(a.todense())
    np.testing.assert_array_equal(dense[4:8, 8:12], values[0])
    np.testing.assert_array_equal(dense[0:4, 4:8], values[1])

  def test_pytree_through_jit_and_vmap(self):
    a = _sparse((8, 16), 4)
    doubled = jax.jit(lambda s: jax.tree.map(lambda v: 2 * v, s))(a)
    self.assertIsInstance(doubled, BlockCSR)
    self.assertEqual(doubled.pattern, a.pattern)
    stacked = jnp.stack([a.values, 3 * a.values])
    dense = jax.vmap(lambda v: BlockCSR.from_pattern(v, a.pattern).todense())(stacked)
    np.testing.assert_allclose(np.asarray(dense[1]), 3 * np.asarray(a.todense()))

  @parameterized.named_parameters(
      ("block_does_not_divide", lambda: BlockCSR.fromdense(np.ones((6, 8)), None, (4, 4)),
       "does not divide"),
      ("unsupported_block", lambda: BlockCSR.fromdense(np.ones((6, 6)), None, (3, 3)),
       "valid block shapes"),
      ("column_out_of_range", lambda: BlockCSR(np.ones((1, 1, 1)), [0, 1], [5], (1, 4)),
       "out of range"),
      ("unsorted_columns", lambda: BlockCSR(np.ones((2, 1, 1)), [0, 2], [3, 1], (1, 4)),
       "unsorted or repeated"),
      ("bad_offsets", lambda: BlockCSR(np.ones((2, 1, 1)), [0, 3], [0, 1], (1, 4)),
       "row_offsets"),
      ("values_shape", lambda: BlockCSR(np.ones((2, 2, 2)), [0, 2], [0, 1], (1, 4)),
       "values must be"),
      ("repeated_coordinate",
       lambda: BlockCSR.from_coordinates([0, 0], [1, 1], np.ones((2, 1, 1)), (2, 2)),
       "given twice"),
      ("coordinate_out_of_range",
       lambda: BlockCSR.from_coordinates([0, 2], [1, 1], np.ones((2, 1, 1)), (2, 2)),
       "out of range"),
      ("mask_shape", lambda: BlockCSR.fromdense(np.ones((8, 8)), np.ones((3, 3)), (4, 4)),
       "mask must be"),
  )
  def test_bad_input(self, build, message):
    with self.assertRaisesRegex(ValueError, message):
      build()

  @parameterized.parameters(np.float32, np.float64, jnp.bfloat16)
  def test_host_matrices_are_built_and_densified_without_compiling(self, dtype):
    # Host arrays are cut into blocks and densified on the host: no XLA
    # program per shape, the same values as the traced path.
    dense = _dense((12, 16)).astype(dtype)
    mask = _pattern("random", (3, 4), 0)
    with jax.log_compiles(), self.assertNoLogs(level="WARNING"):
      a = BlockCSR.fromdense(dense, mask, (4, 4))
    stacked = jnp.stack([a.values, a.values])
    with jax.log_compiles(), self.assertNoLogs(level="WARNING"):
      batched = BlockCSR.from_pattern(stacked, a.pattern)
      got = (a.values, a.todense(), a.T.values, a.T.todense(), batched.todense())
    traced = jax.jit(lambda d: BlockCSR.fromdense(d, mask, (4, 4)))(dense)
    want = jax.jit(lambda v: (v, BlockCSR.from_pattern(v, a.pattern).todense(),
                              BlockCSR.from_pattern(v, a.pattern).T.values,
                              BlockCSR.from_pattern(v, a.pattern).T.todense(),
                              BlockCSR.from_pattern(jnp.stack([v, v]), a.pattern).todense()))(
                                  traced.values)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    chex.assert_trees_all_equal_dtypes(got, want)
    self.assertFalse(any(x.committed for x in got))

  def test_traced_mask_is_refused(self):
    with self.assertRaisesRegex(ValueError, "concrete"):
      jax.jit(lambda d: BlockCSR.fromdense(d, d > 0).values)(jnp.ones((4, 4)))


class StaticMatmulTest(parameterized.TestCase):

  @parameterized.product(
      case=[("random", 4, (36, 24, 7)), ("empty_rows", 4, (32, 48, 5)),
            ("empty", 4, (16, 16, 3)), ("one_block", 8, (24, 40, 9)),
            ("full", 4, (20, 28, 6)), ("random", 1, (9, 13, 11)),
            ("random", 16, (48, 32, 3)), ("random", 8, (64, 256, 40))],
      side=["lhs", "rhs"],
      mode=MODES)
  def test_equals_dense(self, case, side, mode):
    kind, block, (m, k, n) = case
    a = _sparse((m, k), block, kind)
    dense = _dense((k, n) if side == "lhs" else (n, m))
    fn = ((lambda s, d: static_matmul(s, d)) if side == "lhs"
          else (lambda s, d: static_matmul(d, s)))
    got = _run(fn, mode, a, dense)
    s = np.asarray(a.todense(), np.float64)
    want = s @ dense if side == "lhs" else dense @ s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(got, np.asarray(_STATIC_REFERENCE[side](a, dense)), rtol=1e-5,
                                atol=1e-5)

  @parameterized.product(side=["lhs", "rhs"], mode=MODES)
  def test_grad_to_values_and_dense(self, side, mode):
    a, dense, loss, _ = _grad_case(side)
    got = _run(jax.grad(loss, (0, 1)), mode, a.values, dense)
    self.assertEqual(got[0].shape, a.values.shape)  # a gradient per non-zero block only
    chex.assert_trees_all_close(got, _grad_reference(side), rtol=1e-4, atol=1e-4)

  @parameterized.product(batched=["dense", "values", "both"], side=["lhs", "rhs"])
  def test_vmap(self, batched, side):
    a = _sparse((16, 24), 4)
    n, copies = 5, 3
    dense = _dense((copies,) + ((24, n) if side == "lhs" else (n, 16)))
    values = jnp.stack([a.values * (i + 1) for i in range(copies)])

    def one(v, d):
      s = BlockCSR.from_pattern(v, a.pattern)
      return static_matmul(s, d) if side == "lhs" else static_matmul(d, s)

    axes = {"dense": (None, 0), "values": (0, None), "both": (0, 0)}[batched]
    args = (a.values if axes[0] is None else values, dense[0] if axes[1] is None else dense)
    got = _run(jax.vmap(one, axes), "per_tile", *args)
    s = np.asarray(jax.vmap(lambda v: BlockCSR.from_pattern(v, a.pattern).todense())(values))
    s = s[:1].repeat(copies, 0) if axes[0] is None else s
    d = np.broadcast_to(dense[0], dense.shape) if axes[1] is None else dense
    want = s @ d if side == "lhs" else d @ s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  @parameterized.product(side=["lhs", "rhs"], mode=MODES)
  def test_serial_passes_when_no_grid_fits(self, side, mode):
    a = _sparse((24, 40), 1)
    n = 96
    frame = a.pattern if side == "lhs" else a.pattern.transpose()[0]
    plan = sparse_plan.plan_static(T16, frame.shape[0], frame.shape[1], n, 1, a.nnz_blocks,
                                   np.float32, np.float32, 0.001)
    self.assertGreater(plan.serial, 1)
    self.assertTrue(plan.fits)
    dense = _dense((40, n) if side == "lhs" else (n, 24))
    fn = ((lambda s, d: static_matmul(s, d, 0.001)) if side == "lhs"
          else (lambda s, d: static_matmul(d, s, 0.001)))
    got = _run(fn, mode, a, dense)
    s = np.asarray(a.todense(), np.float64)
    np.testing.assert_allclose(got, s @ dense if side == "lhs" else dense @ s, rtol=1e-5,
                               atol=1e-5)

  def test_float16_one_band_rounds_once(self):
    a = _sparse((32, 64), 8, dtype=np.float16)
    dense = _dense((64, 12), dtype=np.float16)
    got = _run(lambda s, d: static_matmul(s, d), "batched", a, dense)
    self.assertEqual(got.dtype, np.float16)
    exact = np.asarray(a.todense(), np.float32) @ dense.astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), exact.astype(np.float16), rtol=1e-3,
                               atol=1e-3)

  @parameterized.product(case=((16, 512, 8, 4), (32, 1024, 4, 8)), mode=MODES)
  def test_float16_keeps_half_partials_across_bands(self, case, mode):
    # popsparse::static_ keeps partials in the data type: with py > 1 the bands'
    # partials are half, each rounded once, then summed in float32.
    m, k, n, block = case
    rng = np.random.RandomState(0)
    a = BlockCSR.fromdense(_dense((m, k), dtype=np.float16), rng.rand(m // block, k // block)
                           < 0.5, (block, block))
    dense = _dense((k, n), dtype=np.float16)
    fn = lambda s, d: static_matmul(s, d)
    lowered = ipu_jax.jit(fn, target=T16).lower(a, dense)
    partials = [t for t in lowered.profile.tensors if t.name.endswith("partials")]
    self.assertLen(partials, 1)
    self.assertEqual(np.dtype(partials[0].dtype), np.float16)
    self.assertTrue(any("/reduce x" in s.name for s in _steps(lowered)))
    got = _run(fn, mode, a, dense)
    want = np.asarray(_STATIC_REFERENCE["lhs"](a, dense))
    self.assertEqual(got.dtype, np.float16)
    # One half rounding per band's partial: within an ulp of the largest result.
    chex.assert_trees_all_close(got.astype(np.float32), want.astype(np.float32), rtol=0,
                                atol=2.0 ** -10 * float(np.abs(want).max()))

  @parameterized.parameters(((8, 8), (8, 0)), ((0, 8), (8, 3)))
  def test_zero_sized(self, sparse_shape, dense_shape):
    m, k = sparse_shape
    a = BlockCSR.fromdense(np.ones(sparse_shape, np.float32), np.ones((m // 4, k // 4), bool),
                           (4, 4))
    got = _run(lambda s, d: static_matmul(s, d), "batched", a, np.ones(dense_shape, np.float32))
    self.assertEqual(got.shape, (m, dense_shape[1]))

  @parameterized.named_parameters(
      ("dtype_mismatch", lambda a: static_matmul(a, np.ones((24, 3), np.float16)),
       "dtypes differ"),
      ("contraction", lambda a: static_matmul(a, np.ones((23, 3), np.float32)),
       "contracting dimensions differ"),
      ("both_sparse", lambda a: static_matmul(a, a), "exactly one operand"),
      ("batched_dense", lambda a: static_matmul(a, np.ones((2, 24, 3), np.float32)),
       "must be a matrix"),
      ("memory_proportion", lambda a: static_matmul(a, np.ones((24, 3), np.float32), 1.5),
       "available_memory_proportion"),
  )
  def test_bad_input(self, call, message):
    with self.assertRaisesRegex(ValueError, message):
      call(_sparse((16, 24), 4))


def _rotating():
  """Lower static sparse products with the rotating plan (the planner kept to that kind)."""
  return mock.patch.object(static_rule, "plan_static",
                           functools.partial(sparse_plan.plan_static, rotate=True))


def _rotate_steps(fn, *args):
  with _rotating():
    lowered = ipu_jax.jit(fn, target=T16).lower(*args)
  return [s for s in _steps(lowered) if "/rotate" in s.name]


class RotatingStaticTest(parameterized.TestCase):
  """The rotating static plan: a cell's block groups placed once and passed along Z."""

  @parameterized.product(
      case=[("random", 4, (36, 24, 7), None), ("empty_rows", 4, (32, 48, 5), None),
            ("one_block", 8, (24, 40, 9), None), ("full", 4, (20, 28, 6), None),
            ("random", 1, (9, 13, 11), None), ("empty_rows", 1, (24, 40, 96), 0.003),
            ("random", 8, (64, 256, 40), 0.01)],
      side=["lhs", "rhs"],
      mode=MODES)
  def test_equals_dense(self, case, side, mode):
    kind, block, (m, k, n), proportion = case
    a = _sparse((m, k), block, kind)
    dense = _dense((k, n) if side == "lhs" else (n, m))
    fn = ((lambda s, d: static_matmul(s, d, proportion)) if side == "lhs"
          else (lambda s, d: static_matmul(d, s, proportion)))
    steps = _rotate_steps(fn, a, dense)
    self.assertGreater(len(steps), 1)
    # Each group is met once per pass: the steps' products are the whole product's.
    self.assertEqual(sum(s.flops for s in steps), 2 * a.nnz_blocks * block ** 2 * n)
    with _rotating():
      got = _run(fn, mode, a, dense)
    s = np.asarray(a.todense(), np.float64)
    want = s @ dense if side == "lhs" else dense @ s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

  def test_serial_passes_and_y_bands(self):
    a = _sparse((64, 256), 8)
    names = [s.name for s in _rotate_steps(lambda s, d: static_matmul(s, d, 0.01), a,
                                           _dense((256, 40)))]
    self.assertTrue(any("pass 2/" in n for n in names), names)
    self.assertTrue(any(".y1." not in n for n in names), names)

  @parameterized.product(side=["lhs", "rhs"], mode=MODES)
  def test_grad_to_values_and_dense(self, side, mode):
    a, dense, loss, _ = _grad_case(side)
    self.assertNotEmpty(_rotate_steps(jax.grad(loss, (0, 1)), a.values, dense))
    with _rotating():
      got = _run(jax.grad(loss, (0, 1)), mode, a.values, dense)
    chex.assert_trees_all_close(got, _grad_reference(side), rtol=1e-4, atol=1e-4)

  @parameterized.parameters("dense", "values", "both")
  def test_vmap(self, batched):
    a = _sparse((16, 24), 4)
    n, copies = 5, 3
    dense = _dense((copies, 24, n))
    values = jnp.stack([a.values * (i + 1) for i in range(copies)])

    def one(v, d):
      return static_matmul(BlockCSR.from_pattern(v, a.pattern), d)

    axes = {"dense": (None, 0), "values": (0, None), "both": (0, 0)}[batched]
    args = (a.values if axes[0] is None else values, dense[0] if axes[1] is None else dense)
    self.assertNotEmpty(_rotate_steps(jax.vmap(one, axes), *args))
    with _rotating():
      got = _run(jax.vmap(one, axes), "per_tile", *args)
    s = np.asarray(jax.vmap(lambda v: BlockCSR.from_pattern(v, a.pattern).todense())(values))
    s = s[:1].repeat(copies, 0) if axes[0] is None else s
    d = np.broadcast_to(dense[0], dense.shape) if axes[1] is None else dense
    np.testing.assert_allclose(got, s @ d, rtol=1e-5, atol=1e-5)

  def test_float16_rounds_to_half_partials(self):
    a = _sparse((32, 64), 8, dtype=np.float16)
    dense = _dense((64, 12), dtype=np.float16)
    with _rotating():
      got = _run(lambda s, d: static_matmul(s, d), "per_tile", a, dense)
    self.assertEqual(got.dtype, np.float16)
    exact = np.asarray(a.todense(), np.float32) @ dense.astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), exact.astype(np.float16), rtol=1e-3,
                               atol=1e-3)

  def test_chosen_by_cost_where_copies_do_not_fit_one_pass(self):
    # fp32 16x16 blocks at density 1/4: copying each cell's blocks to its Z tiles
    # needs two serial passes; rotating groups fits in one, and is cheaper.
    nnz = (4096 // 16) ** 2 // 4
    plan = sparse_plan.plan_static(BOW, 4096, 4096, 1024, 16, nnz, "float32")
    copies = sparse_plan.plan_static(BOW, 4096, 4096, 1024, 16, nnz, "float32", rotate=False)
    self.assertTrue(plan.rotate and plan.fits)
    self.assertEqual((plan.serial, copies.serial), (1, 2))
    self.assertLess(plan.cycles, copies.cycles)
    self.assertIn("rotating", plan.describe())


# (m, k, n): block rows, blocks per row, dense columns; odd ones, and the
# element-wise vertex's specialised n (2, 4, 8).
_VERTEX_SHAPES = ((1, 1, 1), (3, 5, 7), (5, 3, 13), (2, 7, 33), (8, 2, 96), (6, 1, 4),
                  (4, 4, 8), (7, 3, 2), (3, 2, 250))


def _static_reference_cycles(target, m, blocks, n, block, dtype):
  """popsparse::static_'s planner figures for one tile: vertex plus partials zeroing."""
  half = np.dtype(dtype).itemsize == 2
  w = target.worker_contexts
  return (popsparse_reference.tile_vertex_cycles(w, m, blocks, n, block, half)
          + popsparse_reference.zeroing_cycles(w, m, n, block, 2 if half else 4))


class StaticPlanTest(parameterized.TestCase):

  @parameterized.product(block=(1, 4, 8, 16), dtype=("float16", "float32"))
  def test_vertex_cycles_are_static_planners_figures(self, block, dtype):
    # One tile holding m block rows of k blocks each times n columns: the plan's
    # compute is popsparse::static_'s vertex and zeroing, as its planner prices them.
    for m, k, n in _VERTEX_SHAPES:
      plan = sparse_plan.plan_static(T16, m * block, (k + 1) * block, n, block, m * k, dtype,
                                     max_tiles=1)
      self.assertEqual((plan.grid, plan.serial), ((1, 1, 1), 1))
      self.assertEqual(plan.compute_cycles,
                       _static_reference_cycles(T16, m, m * k, n, block, dtype), (m, k, n))

  @parameterized.product(block=(1, 4, 8, 16), dtype=("float16", "float32"))
  def test_lowered_products_step_prices_static_vertices(self, block, dtype):
    # What the report shows: a one-tile IPU's products step, on a pattern with a
    # block in every block row and rows of unequal length, times 11 columns.
    one = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    m, n = 5, 11
    mask = np.zeros((m, 4), bool)
    mask[np.arange(m), np.arange(m) % 4] = True
    mask[0, 1:] = True
    a = BlockCSR.fromdense(_dense((m * block, 4 * block), dtype=dtype), mask, (block, block))
    dense = _dense((4 * block, n), dtype=dtype)
    lowered = ipu_jax.jit(lambda s, d: static_matmul(s, d), target=one).lower(a, dense)
    products = [s for s in _steps(lowered) if "/products" in s.name]
    self.assertLen(products, 1)
    self.assertEqual(float(np.asarray(products[0].compute_cycles)[0]),
                     _static_reference_cycles(one, m, int(mask.sum()), n, block, dtype))
    vertex = "StaticSparseDenseElementWise" if block == 1 else "StaticSparseDenseMatMulBlock"
    self.assertEqual(products[0].codelets[0], f"popsparse::{vertex}<{dtype},{dtype}>")
    got = np.asarray(ipu_jax.jit(lambda s, d: static_matmul(s, d), target=one)(a, dense))
    chex.assert_trees_all_close(got, np.asarray(_STATIC_REFERENCE["lhs"](a, dense)),
                                rtol=2e-3 if dtype == "float16" else 1e-5, atol=1e-3)

  def test_memory_is_density_times_dense_plus_meta(self):
    m = k = 256
    block, density = 4, 1 / 16
    rng = np.random.RandomState(0)
    grid = (m // block, k // block)
    mask = np.zeros(grid[0] * grid[1], bool)
    mask[rng.choice(mask.size, int(mask.size * density), replace=False)] = True
    a = BlockCSR.fromdense(_dense((m, k)), mask.reshape(grid), (block, block))
    lowered = ipu_jax.jit(lambda s, d: static_matmul(s, d), target=T16).lower(a, _dense((k, 32)))
    tensors = {t.name: t for t in lowered.profile.tensors}
    meta = sum(t.total_bytes for t in lowered.profile.tensors if t.name == "sparse meta-info")
    values = a.values.nbytes
    dense_bytes = m * k * 4
    self.assertEqual(values, dense_bytes * density)
    self.assertGreater(meta, 0)
    # Meta-information: a column word per block, row entries, headers; a few
    # percent of the values for 4x4 float32 blocks.
    self.assertLess(meta, 0.15 * values)
    self.assertIn("sparse meta-info", tensors)

  def test_costs_from_the_vertex_work(self):
    a = _sparse((128, 256), 4)
    lowered = ipu_jax.jit(lambda s, d: static_matmul(s, d), target=T16).lower(a, _dense((256, 64)))
    products = [s for s in _steps(lowered) if "/products" in s.name]
    self.assertLen(products, 1)
    self.assertIn("popsparse::StaticSparseDenseMatMulBlock", products[0].codelets[0])
    self.assertGreater(float(np.max(products[0].compute_cycles)), 0)
    self.assertIn("grid x", products[0].notes[0])

  @parameterized.parameters("float16", "float32")
  def test_speed_up_falls_with_density_and_blocks_pay(self, dtype):
    def cycles(block, density):
      nnz = int(density * (4096 // block) ** 2)
      return sparse_plan.plan_static(BOW, 4096, 4096, 1024, block, nnz, dtype).cycles
    for block in (1, 4, 16):
      series = [cycles(block, d) for d in (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4)]
      self.assertEqual(series, sorted(series))
    for density in (1 / 16, 1 / 4):
      self.assertLess(cycles(16, density), cycles(4, density))
      self.assertLess(cycles(4, density), cycles(1, density))

  def test_plan_respects_memory_proportion(self):
    def plan(proportion):
      return sparse_plan.plan_static(BOW, 4096, 4096, 1024, 4, 16384, "float16",
                                     available_memory_proportion=proportion)
    # Half partials (static_'s for fp16) leave the 0.6 plan within 0.2: 0.15 is tight.
    loose, tight, too_tight = plan(0.6), plan(0.15), plan(0.05)
    for p in (loose, tight):
      self.assertTrue(p.fits)
      self.assertLessEqual(p.temp_bytes, p.memory_limit)
    # Less memory costs cycles; when no one-pass grid fits, serial passes over Z.
    self.assertLess(tight.temp_bytes, loose.temp_bytes)
    self.assertGreater(tight.cycles, loose.cycles)
    self.assertEqual((loose.serial, tight.serial), (1, 1))
    self.assertGreater(too_tight.serial, 1)
    self.assertTrue(too_tight.fits)
    self.assertGreater(too_tight.cycles, tight.cycles)
    nothing = sparse_plan.plan_static(BOW, 4096, 4096, 1024, 4, 16384, "float16",
                                      available_memory_proportion=0.001)
    self.assertFalse(nothing.fits)     # marked, the least-memory grid kept

class StaticFinalOutputTest(chex.TestCase, parameterized.TestCase):
  """static_ leaves its result in ``out``'s linear layout (StaticMatMul.cpp:543-546,
  popops::reduceMany at :793 copies or reduces the products into it): one copy step."""

  @parameterized.named_parameters(
      ("element_wise_one_y_band", 1, "lhs", (64, 64, 32), "float32"),
      ("element_wise_reduced_over_y_bands", 1, "lhs", (128, 256, 40), "float32"),
      ("block_16_rotating", 16, "lhs", (256, 256, 64), "float32"),
      ("block_4_dense_times_sparse", 4, "rhs", (128, 64, 24), "float16"),
      ("block_8_half", 8, "lhs", (128, 128, 40), "float16"))
  def test_result_moves_to_static_layout_in_a_final_copy(self, block, side, shape, dtype):
    m, k, n = shape
    a = _sparse((m, k), block, dtype=dtype)
    dense = _dense((k, n) if side == "lhs" else (n, m), dtype=dtype)
    fn = (lambda s, d: static_matmul(s, d)) if side == "lhs" else (lambda s, d: static_matmul(d, s))
    rows = m if side == "lhs" else k           # the product's frame: out[rows, n]
    lowered = ipu_jax.jit(fn, target=T16).lower(a, dense)
    final = [s for s in _steps(lowered) if s.name.endswith("/final output")]
    self.assertLen(final, 1)
    src, out = final[0].reads[0].mapping, final[0].writes[0].mapping
    item, tiles = np.dtype(dtype).itemsize, T16.num_tiles
    chunk = popsparse_reference.output_chunk_elements(tiles, rows, n, block, item)
    holds = np.clip(rows * n - chunk * np.arange(tiles), 0, chunk)
    np.testing.assert_array_equal(out.elements_per_tile(tiles), holds)
    # Each tile receives its chunk less what the products or reduction left on it.
    kept = np.bincount(out.element_tile[src.element_tile == out.element_tile], minlength=tiles)
    np.testing.assert_array_equal(final[0].exchange.bytes_in, (holds - kept) * item)
    # The plan charges the move too: a sync and a tile's whole chunk at the exchange rate.
    plan = sparse_plan.plan_static(T16, rows, m if side == "rhs" else k, n, block,
                                   a.nnz_blocks, dtype)
    self.assertEqual(plan.output_cycles, T16.sync_cycles_internal + T16.exchange_latency_cycles
                     + chunk * item / T16.exchange_bytes_per_cycle)
    tol = dict(rtol=2e-3, atol=2e-2) if dtype == "float16" else dict(rtol=1e-5, atol=1e-4)
    expected = np.asarray(_STATIC_REFERENCE[side](a, dense))
    for mode in MODES:
      chex.assert_trees_all_close(_run(fn, mode, a, dense), expected, **tol)


class DynamicMatmulTest(parameterized.TestCase):

  @parameterized.product(
      case=[("random", 4, (36, 24, 7)), ("empty_rows", 4, (32, 48, 70)),
            ("empty", 4, (16, 16, 3)), ("one_block", 8, (24, 40, 9)),
            ("full", 4, (20, 28, 6)), ("random", 1, (9, 13, 11)),
            ("random", 16, (48, 32, 3))],
      mode=MODES)
  def test_equals_dense(self, case, mode):
    kind, block, (m, k, n) = case
    a = _sparse((m, k), block, kind)
    dense = _dense((k, n))
    total = (m // block) * (k // block)
    layout = dynamic_layout(T16, (m, k), n, min(max(a.nnz_blocks, 1) + 3, total), block=block)
    encoded = encode(a, layout)
    got = _run(lambda e, d: dynamic_matmul(e, d), mode, encoded, dense)
    np.testing.assert_allclose(got, np.asarray(a.todense(), np.float64) @ dense, rtol=1e-5,
                               atol=1e-5)

  @parameterized.parameters(*MODES)
  def test_float16_rounds_float32_partials(self, mode):
    a = _sparse((32, 32), 8, dtype=np.float16)
    dense = _dense((32, 12), dtype=np.float16)
    layout = dynamic_layout(T16, (32, 32), 12, 16, block=8, dtype=np.float16)
    got = _run(lambda e, d: dynamic_matmul(e, d), mode, encode(a, layout), dense)
    self.assertEqual(got.dtype, np.float16)
    exact = np.asarray(a.todense(), np.float32) @ dense.astype(np.float32)
    np.testing.assert_allclose(got.astype(np.float32), exact.astype(np.float16), rtol=1e-3,
                               atol=1e-3)

  def _skewed(self):
    """Every block of the matrix's first X band: more than its cell's buckets hold."""
    mask = np.zeros((8, 16), bool)
    mask[0, :] = True
    mask[1, :9] = True
    mask[5, 3] = True
    return BlockCSR.fromdense(_dense((32, 64)), mask, (4, 4))

  @parameterized.parameters(*MODES)
  def test_spilled_blocks_are_met_in_phase_two(self, mode):
    a = self._skewed()
    layout = dynamic_layout(T16, (32, 64), 200, 40, block=4)
    encoded = encode(a, layout)
    rx, cy, _ = layout.plan.band
    px, py, pz = layout.grid
    rows = np.asarray(encoded.meta[..., 0])
    cols = np.asarray(encoded.meta[..., 1])
    own_cell = (np.arange(px * py * pz) // pz)[:, None]
    entry_cell = (rows // rx) * py + cols // cy
    spilled = (rows >= 0) & (entry_cell != own_cell)
    self.assertGreater(int(spilled.sum()), 0)             # the pattern did spill
    self.assertEqual(layout.plan.phases, 2)
    dense = _dense((64, 200))
    got = _run(lambda e, d: dynamic_matmul(e, d), mode, encoded, dense)
    np.testing.assert_allclose(got, np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-4)

  @parameterized.parameters(*MODES)
  def test_a_pattern_of_max_non_zeros_in_one_band_encodes(self, mode):
    a = self._skewed()            # 26 blocks, 25 of them in the first X band
    layout = dynamic_layout(T16, (32, 64), 200, 26, block=4, oversize=0.0)
    encoded = encode(a, layout)
    self.assertGreater(encoded.spill_distance, 1)     # past the neighbouring cell
    dense = _dense((64, 200))
    got = _run(lambda e, d: dynamic_matmul(e, d), mode, encoded, dense)
    np.testing.assert_allclose(got, np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-4)

  def test_overflow_is_an_error_with_the_counts(self):
    a = self._skewed()
    small = dynamic_layout(T16, (32, 64), 200, 25, block=4)
    with self.assertRaisesRegex(BucketOverflowError, "26 non-zero blocks, more than "
                                "max_non_zeros=25"):
      encode(a, small)
    with self.assertRaisesRegex(BucketOverflowError, "26 non-zero blocks, more than "
                                "max_non_zeros=25"):
      dynamic_matmul(a, _dense((64, 200)), 25, target=T16)

  def test_a_new_pattern_runs_the_same_program(self):
    layout = dynamic_layout(T16, (32, 48), 20, 40, block=4)
    first, second = _sparse((32, 48), 4, seed=1), _sparse((32, 48), 4, "empty_rows", seed=2)
    dense = _dense((48, 20))
    lowered = ipu_jax.jit(lambda e, d: dynamic_matmul(e, d), target=T16).lower(
        encode(first, layout), dense)
    for a in (first, second):
      np.testing.assert_allclose(np.asarray(lowered(encode(a, layout), dense)),
                                 np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-5)

  @parameterized.parameters(*MODES)
  def test_grad_to_values_and_dense(self, mode):
    a = _sparse((32, 48), 4, "empty_rows")
    layout = dynamic_layout(T16, (32, 48), 10, a.nnz_blocks + 4, block=4)
    weights = _dense((32, 10), seed=5)

    def loss(values, d):
      out = dynamic_matmul(encode(BlockCSR.from_pattern(values, a.pattern), layout), d)
      return jnp.sum(jnp.sin(0.1 * out) * weights)

    def dense_loss(values, d):
      out = BlockCSR.from_pattern(values, a.pattern).todense() @ d
      return jnp.sum(jnp.sin(0.1 * out) * weights)

    dense = _dense((48, 10))
    got = _run(jax.grad(loss, (0, 1)), mode, a.values, dense)
    want = jax.jit(jax.grad(dense_loss, (0, 1)))(a.values, dense)
    chex.assert_trees_all_close(got, jax.tree.map(np.asarray, want), rtol=1e-4, atol=1e-4)

  def test_vmap_over_the_dense_operand(self):
    a = _sparse((16, 24), 4)
    layout = dynamic_layout(T16, (16, 24), 5, a.nnz_blocks, block=4)
    dense = _dense((3, 24, 5))
    got = _run(jax.vmap(lambda e, d: dynamic_matmul(e, d), (None, 0)), "per_tile",
               encode(a, layout), dense)
    np.testing.assert_allclose(got, np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-5)

  def test_buckets_are_sized_for_max_non_zeros_and_oversize(self):
    layout = dynamic_layout(BOW, (4096, 4096), 1024, 16384, block=4, oversize=0.3)
    slots = layout.buckets * layout.bucket_blocks
    self.assertGreaterEqual(slots, 1.3 * 16384)
    self.assertLess(slots, 1.3 * 16384 + layout.buckets)
    a = _sparse((64, 64), 4)
    small = dynamic_layout(T16, (64, 64), 8, 120, block=4, oversize=0.5)
    encoded = encode(a, small)
    self.assertEqual(encoded.values.nbytes, small.buckets * small.bucket_blocks * 16 * 4)
    self.assertGreaterEqual(small.buckets * small.bucket_blocks, 180)

  @parameterized.parameters((16, 33, 102), (4, 33, 102), (1, 32, 93))
  def test_bucket_scan_is_poplibs_vertex_estimate(self, block, skip, found):
    # PopLibs lib/popsparse/PerformanceEstimation.hpp: sparseDenseBlockMultiply's
    # supervisor skips a sub-group not for its tile in 33 cycles and finds its own
    # (one sub-group a bucket) in (0 + 1) * 46 + 56 = 102; the element-wise
    # vertex (sparseDenseElementwiseMultiply) in 32 and (0 + 1) * 47 + 46 = 93.
    plan = sparse_plan.plan_dynamic(BOW, 1024, 1024, 256, block, (1024 // block) ** 2 // 16,
                                    "float16")
    _, _, pz = plan.grid
    bucket_bytes = plan.bucket_blocks * (block * block * 2 + 2 * 2)
    exchange = bucket_bytes / BOW.exchange_bytes_per_cycle + BOW.exchange_latency_cycles
    self.assertGreater(plan.phases, 1)
    self.assertAlmostEqual(plan.phase_cycles,
                           pz * (skip + exchange + BOW.sync_cycles_internal))
    # The lowered program's run-time phase pays the same skips as the plan.
    layout = dynamic_layout(BOW, (1024, 1024), 256, (1024 // block) ** 2 // 16, block=block,
                            dtype=np.float16)
    self.assertEqual(layout.plan.phase_cycles, plan.phase_cycles)
    self.assertEqual(float(popsparse.bucket_scan_cycles(3, 1, block)), 2 * skip + found)

  def test_static_beats_dynamic(self):
    for block in (1, 4, 16):
      for density in (1 / 64, 1 / 16, 1 / 4):
        nnz = int(density * (4096 // block) ** 2)
        static = sparse_plan.plan_static(BOW, 4096, 4096, 1024, block, nnz, "float16")
        dynamic = sparse_plan.plan_dynamic(BOW, 4096, 4096, 1024, block, nnz, "float16")
        self.assertLess(static.cycles, dynamic.cycles)

  @parameterized.named_parameters(
      ("dtype_mismatch", lambda e: dynamic_matmul(e, np.ones((24, 5), np.float16)),
       "dtypes differ"),
      ("other_n", lambda e: dynamic_matmul(e, np.ones((24, 6), np.float32)), "N=5"),
      ("contraction", lambda e: dynamic_matmul(e, np.ones((23, 5), np.float32)),
       "contracting dimensions differ"),
      ("no_target", lambda e: dynamic_matmul(_sparse((16, 24), 4), np.ones((24, 5)), 10),
       "target="),
      ("max_non_zeros", lambda e: dynamic_layout(T16, (16, 24), 5, 0, block=4),
       "max_non_zeros must be"),
      # Each of these planned (n=-8: a z of -8), divided by zero or failed in a table lookup.
      ("n", lambda e: dynamic_layout(T16, (16, 24), -8, 10, block=4), "n .* must be an int >= 1"),
      ("block", lambda e: dynamic_layout(T16, (16, 24), 5, 10, block=2),
       r"block 2 has no PopSparse vertex; valid blocks are \[1, 4, 8, 16\]"),
      ("oversize", lambda e: dynamic_layout(T16, (16, 24), 5, 10, block=4, oversize=np.nan),
       "oversize must be a number >= 0"),
      ("proportion", lambda e: dynamic_layout(T16, (16, 24), 5, 10, block=4,
                                              available_memory_proportion=5),
       r"available_memory_proportion must be in \(0, 1\]"),
  )
  def test_bad_input(self, call, message):
    layout = dynamic_layout(T16, (16, 24), 5, 20, block=4)
    with self.assertRaisesRegex(ValueError, message):
      call(encode(_sparse((16, 24), 4), layout))

  def test_layout_for_another_target_is_refused(self):
    a = _sparse((16, 24), 4)
    layout = dynamic_layout(ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8), (16, 24), 5, 20,
                            block=4)
    with self.assertRaisesRegex(ipu_jax.LoweringError, "planned for 8 tiles"):
      ipu_jax.jit(lambda e, d: dynamic_matmul(e, d), target=T16).lower(
          encode(a, layout), _dense((24, 5)))



def _clustered(kind, grid, count, seed):
  """A block mask of exactly ``count`` non-zeros: ``uniform`` (random over the
  matrix), ``corner`` (the top-left blocks, nearest the corner first) or ``row``
  (one full row of blocks, the rest random)."""
  rng = np.random.RandomState(seed)
  rows, cols = grid
  mask = np.zeros(grid, bool)
  if kind == "corner":
    r, c = np.divmod(np.arange(rows * cols), cols)
    mask.reshape(-1)[np.lexsort((c, np.maximum(r, c)))[:count]] = True
    return mask
  if kind == "row":
    mask[rng.randint(rows)] = True
  free = np.flatnonzero(~mask.reshape(-1))
  mask.reshape(-1)[rng.choice(free, count - int(mask.sum()), replace=False)] = True
  return mask


class DynamicPatternsOfMaxNonZerosTest(chex.TestCase, parameterized.TestCase):
  """Any pattern of at most max_non_zeros blocks runs, however it clusters."""

  def _check(self, kind, block, grid, count, n, mode, target, seed=0):
    m, k = grid[0] * block, grid[1] * block
    a = BlockCSR.fromdense(_dense((m, k), seed=seed + 7), _clustered(kind, grid, count, seed),
                           (block, block))
    dense = _dense((k, n))
    self.assertEqual(a.nnz_blocks, count)
    got = _run(lambda v, d: dynamic_matmul(BlockCSR.from_pattern(v, a.pattern), d, count,
                                           target=target), mode, a.values, dense, target=target)
    chex.assert_trees_all_close(got, np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-4)

  def test_the_issue_pattern_runs(self):
    # 35 random 4x4 blocks planned for exactly 35 used to overflow a cell.
    for seed in range(3):
      self._check("uniform", 4, (16, 16), 35, 8, "per_tile", T16, seed)

  @parameterized.product(kind=["uniform", "corner", "row"],
                         case=[(1, (24, 20), 60, 9), (4, (16, 12), 40, 6),
                               (16, (6, 5), 12, 5)],
                         mode=MODES)
  def test_exactly_max_non_zeros_on_16_tiles(self, kind, case, mode):
    block, grid, count, n = case
    self._check(kind, block, grid, count, n, mode, T16)

  @parameterized.parameters(("corner", 4, (40, 40), 120, 6), ("row", 1, (64, 96), 200, 4),
                            ("uniform", 16, (8, 8), 24, 3))
  def test_exactly_max_non_zeros_on_1472_tiles(self, kind, block, grid, count, n):
    self._check(kind, block, grid, count, n, "per_tile", ipu_jax.IPUTarget.preset("ipu2"))

  def test_target_taken_from_the_enclosing_jit(self):
    # Inside ipu_jax.jit, a BlockCSR's buckets are planned for the jit's target.
    a = BlockCSR.fromdense(_dense((64, 48), seed=3), _clustered("corner", (16, 12), 40, 0),
                           (4, 4))
    dense = _dense((48, 6))
    got = _run(lambda v, d: dynamic_matmul(BlockCSR.from_pattern(v, a.pattern), d, 40),
               "per_tile", a.values, dense)
    chex.assert_trees_all_close(got, np.asarray(a.todense()) @ dense, rtol=1e-5, atol=1e-4)
    with self.assertRaisesRegex(ValueError, "inside ipu_jax.jit .* or pass target="):
      dynamic_matmul(a, dense, 40)  # outside a jit, no target to plan for

  def test_one_more_than_planned_names_the_counts(self):
    a = BlockCSR.fromdense(_dense((64, 48)), _clustered("corner", (16, 12), 41, 0), (4, 4))
    with self.assertRaisesRegex(BucketOverflowError, "41 non-zero blocks, more than "
                                "max_non_zeros=40"):
      dynamic_matmul(a, _dense((48, 6)), 40, target=T16)


def _dynamic_has_assembly_vertex(dtype, block) -> bool:
  """Whether PopSparse's dynamic block vertex has the assembly form its estimator prices.

  ``SparseDenseMatMulBlock<float, float, 16, 16>`` is a C++ codelet (poplibs
  ``lib/popsparse/codelets/SparseDenseMatMulBlock.cpp:17-23``): the dynamic
  model's fp32 16x16 figure is its estimator's half-input path with two weight
  loads, faster than the static fp32 16x16 vertex static_ prices, so static and
  dynamic are compared only where both figures are of assembly vertices.
  """
  return not (dtype == "float32" and block == 16)


class ExperimentTest(absltest.TestCase):

  def test_static_cycles_at_most_dynamic_in_every_row(self):
    from experiments import popsparse as runner  # pylint: disable=g-import-not-at-top
    for n in (1024, 2048):
      for dtype in ("float16", "float32"):
        for block in (1, 4, 16):
          if not _dynamic_has_assembly_vertex(dtype, block):
            continue
          for density in (1 / 16, 1 / 8, 1 / 4):
            row = runner.case_row(BOW, n, block, density, dtype)
            self.assertLessEqual(row["static_cycles"], row["dynamic_cycles"], row)

  def test_published_points_beside_the_model(self):
    from experiments import popsparse as runner  # pylint: disable=g-import-not-at-top
    points = runner.published_comparison(BOW)
    self.assertLen(points, len(runner.PUBLISHED_SPEEDUPS))
    for p in points:
      # Measured and modelled alike: static beats dynamic at every published point.
      self.assertGreater(p["published_static"], p["published_dynamic"], p)
      if _dynamic_has_assembly_vertex(p["dtype"], p["block"]):
        self.assertGreater(p["model_static"], p["model_dynamic"], p)
    self.assertIn("Table 2", runner.comparison_table(points))

  def test_dense_fp16_baseline_is_above_the_float_partials_ceiling(self):
    # The measured dense fp16 baseline (226 TFLOP/s) exceeds what float32 partials allow
    # (8 AMP units: half the fp16 peak), so the runner's baseline takes half partials.
    from experiments import popsparse as runner  # pylint: disable=g-import-not-at-top
    ceiling = BOW.fp16_flops_per_cycle / 2 * BOW.num_tiles * BOW.clock_hz / 1e12
    row = runner.case_row(BOW, 2048, 16, 1 / 16, "float16")
    half = plan_matmul(BOW, 1, 4096, 2048, 4096, "float16", partials_dtype=np.float16)
    self.assertEqual(row["dense_cycles"], float(half.cycles))
    rate = 2.0 * 4096 * 4096 * 2048 / (row["dense_cycles"] / BOW.clock_hz) / 1e12
    self.assertGreater(rate, ceiling)
    self.assertLess(rate, runner.PUBLISHED_DENSE_FP16_TFLOPS * 1.3)
    fp32 = runner.case_row(BOW, 2048, 16, 1 / 16, "float32")
    self.assertEqual(fp32["dense_cycles"],
                     float(plan_matmul(BOW, 1, 4096, 2048, 4096, "float32").cycles))

  def test_runner_writes_the_table_rows_in_time(self):
    out = os.path.join(self.create_tempdir().full_path, "popsparse.json")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "experiments.popsparse", f"--json_out={out}",
                           "--plot="], cwd=root, capture_output=True, text=True, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertLess(time.perf_counter() - started, 180)
    self.assertIn("Where static sparse stops paying off", proc.stdout)
    self.assertIn("lowered 1024:16:0.0625:float16", proc.stdout)
    self.assertIn("Model beside the measurements", proc.stdout)
    with open(out) as f:
      rows = json.load(f)
    self.assertLen(rows, 2 * 3 * 5 * 2)
    keys = {"m", "k", "n", "block", "density", "dtype", "static_cycles", "dynamic_cycles",
            "dense_cycles"}
    for row in rows:
      self.assertEqual(set(row), keys)
    for n in (1024, 2048):
      for dtype in ("float16", "float32"):
        for block in (1, 4, 16):
          series = [r for r in rows if (r["n"], r["dtype"], r["block"]) == (n, dtype, block)]
          speedups = [r["dense_cycles"] / r["static_cycles"] for r in series]
          self.assertEqual(speedups, sorted(speedups, reverse=True))   # falls with density
    # Larger blocks pay off at higher densities: at 1/4, block 16 beats dense, 1x1 does not.
    quarter = {r["block"]: r["dense_cycles"] / r["static_cycles"] for r in rows
               if r["density"] == 0.25 and r["n"] == 1024 and r["dtype"] == "float16"}
    self.assertGreater(quarter[16], 1)
    self.assertLess(quarter[1], 1)


if __name__ == "__main__":
  absltest.main()
