"""Tests of the linear-algebra rules (lowering/rules/linalg.py).

Every case compares ``ipu_jax.jit`` with ``jax.jit`` on random inputs over
batch shapes that do not divide the tile count, single matrices, 1x1 and
empty batches, float32 and complex64, in both executor modes (float16 and
bfloat16 where jax.jit runs them, bit for bit); then gradients,
clear errors for unsupported modes, the out-of-memory check for a matrix that
does not fit a tile, and what the report says about placement and cost.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_DTYPES = {"f32": np.float32, "c64": np.complex64}


def _config(mode):
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  return cfg


def _random(rng, shape, dtype):
  x = rng.standard_normal(shape)
  if np.issubdtype(dtype, np.complexfloating):
    x = x + 1j * rng.standard_normal(shape)
  return x.astype(dtype)


def _positive_definite(rng, batch, n, dtype):
  """Well-conditioned Hermitian positive-definite matrices (built on the host)."""
  a = _random(rng, batch + (n, n), dtype)
  return (a @ np.conj(np.swapaxes(a, -1, -2)) + n * np.eye(n)).astype(dtype)


def _well_conditioned(rng, batch, n, dtype):
  return (_random(rng, batch + (n, n), dtype) + 2 * n * np.eye(n)).astype(dtype)


def _random_square(rng, batch, n, dtype):
  return _random(rng, batch + (n, n), dtype)


def _triangular(rng, batch, n, dtype):
  return np.tril(_well_conditioned(rng, batch, n, dtype))


def _first_step(fn, *args, op):
  steps = ipu_jax.jit(fn, target=_T16).lower(*args).profile.steps
  return [s for s in steps if s.op == op][0]


# name -> (function, operand builders (rng, batch, n, dtype) -> array)
_CASES = {
    "cholesky": (jnp.linalg.cholesky, [_positive_definite]),
    "solve_triangular": (lambda a, b: jsl.solve_triangular(a, b, lower=True),
                         [_triangular, lambda r, b, n, d: _random(r, b + (n, 3), d)]),
    "solve_triangular_right_transposed": (
        lambda a, b: lax.linalg.triangular_solve(a, b, left_side=False, lower=True,
                                                 transpose_a=True, unit_diagonal=True),
        [_triangular, lambda r, b, n, d: _random(r, b + (2, n), d)]),
    "lu_factor": (jsl.lu_factor, [_random_square]),
    "solve": (jnp.linalg.solve, [_well_conditioned, lambda r, b, n, d: _random(r, b + (n, 2), d)]),
    "inv": (jnp.linalg.inv, [_well_conditioned]),
    "det": (jnp.linalg.det, [_well_conditioned]),
    "slogdet": (jnp.linalg.slogdet, [_well_conditioned]),
    "qr": (jnp.linalg.qr, [_random_square]),
    "eigh": (jnp.linalg.eigh, [_positive_definite]),
    "eigvalsh": (jnp.linalg.eigvalsh, [_positive_definite]),
    "svd": (jnp.linalg.svd, [_random_square]),
    "svdvals": (lambda a: jnp.linalg.svd(a, compute_uv=False), [_random_square]),
    "cho_solve": (lambda a, b: jsl.cho_solve((jnp.linalg.cholesky(a), True), b),
                  [_positive_definite, lambda r, b, n, d: _random(r, b + (n, 2), d)]),
    "lu_solve": (lambda a, b: jsl.lu_solve(jsl.lu_factor(a), b),
                 [_well_conditioned, lambda r, b, n, d: _random(r, b + (n, 2), d)]),
    "pinv": (jnp.linalg.pinv, [_random_square]),
    "eigvals": (jnp.linalg.eigvals, [_well_conditioned]),
}
_COMPLEX = ("cholesky", "solve_triangular", "lu_factor", "qr", "eigh", "svd", "cho_solve")
_CORE = ("cholesky", "solve_triangular", "lu_factor", "qr", "eigh", "svd")


def _all_ops(ops):
  """One function computing every op in ``ops`` (one compile for them all)."""
  def fn(args):
    return {op: _CASES[op][0](*args[op]) for op in ops}
  return fn


class LinalgTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(0)

  def _check(self, fn, *args, mode="batched", rtol=1e-5, atol=1e-5):
    got = ipu_jax.jit(fn, target=_T16, config=_config(mode))(*args)
    want = jax.jit(fn)(*args)
    jax.tree_util.tree_map(lambda g, w: self.assertEqual((g.dtype, g.shape), (w.dtype, w.shape)),
                           got, want)
    chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)
    return got

  def _check_ops(self, ops, batch, n, dtype, mode):
    args = {op: [b(self.rng, batch, n, _DTYPES[dtype]) for b in _CASES[op][1]] for op in ops}
    got = ipu_jax.jit(_all_ops(ops), target=_T16, config=_config(mode))(args)
    want = jax.jit(_all_ops(ops))(args)
    for op in ops:
      with self.subTest(op):
        jax.tree_util.tree_map(
            lambda g, w: self.assertEqual((g.dtype, g.shape), (w.dtype, w.shape)),
            got[op], want[op])
        # Inverses amplify rounding by the condition number.
        rtol = 1e-4 if op in ("inv", "pinv") else 1e-5
        chex.assert_trees_all_close(got[op], want[op], rtol=rtol, atol=1e-5)

  @parameterized.named_parameters(
      # Every op over a batch that does not divide the 16 tiles.
      ("every_op_batch17", tuple(_CASES), (17,), 5, "f32", "batched"),
      # Two batch axes, each tile vmapping its own local batch.
      ("core_ops_batch2x3_per_tile", _CORE, (2, 3), 4, "f32", "per_tile"),
      ("complex64_per_tile", _COMPLEX, (3,), 4, "c64", "per_tile"),
      ("single_matrix", _CORE, (), 6, "f32", "batched"),
      ("one_by_one", _CORE, (5,), 1, "f32", "batched"),
      ("empty_batch", _CORE, (0,), 3, "f32", "batched"),
  )
  def test_matches_jax_jit(self, ops, batch, n, dtype, mode):
    self._check_ops(ops, batch, n, dtype, mode)

  @parameterized.parameters((7, 3), (3, 7))
  def test_rectangular_qr_svd_lu(self, m, n):
    a = _random(self.rng, (9, m, n), np.float32)

    def fn(a):
      return (jnp.linalg.qr(a, mode="complete"), jnp.linalg.qr(a, mode="reduced"),
              jnp.linalg.svd(a, full_matrices=True), jnp.linalg.svd(a, full_matrices=False),
              lax.linalg.lu(a))

    self._check(fn, a)

  def test_other_lax_linalg_primitives(self):
    a = _random(self.rng, (5, 4, 4), np.float32)
    spd = _positive_definite(self.rng, (5,), 4, np.float32)
    b = _random(self.rng, (5, 4, 2), np.float32)
    r = np.swapaxes(np.linalg.cholesky(spd[0]), 0, 1)

    def fn(a, spd, b, r):
      return {
          "householder_product": lax.linalg.householder_product(a, a[..., 0] * 0.1),
          "tridiagonal": lax.linalg.tridiagonal(spd),
          "tridiagonal_solve": lax.linalg.tridiagonal_solve(
              a[..., 0], a[..., 1] + 8, a[..., 2], b),
          "hessenberg": jsl.hessenberg(a[0]),
          "schur": jsl.schur(a[0]),
          "lu": jsl.lu(a[0]),
          "qr_pivoting": lax.linalg.qr(a, pivoting=True),
          "cholesky_update": lax.linalg.cholesky_update(r, b[0, :, 0]),
          "lu_pivots_to_permutation": lax.linalg.lu_pivots_to_permutation(
              lax.linalg.lu(a)[1], permutation_size=4),
      }

    self._check(fn, a, spd, b, r)

  def test_gradients(self):
    a = _random(self.rng, (7, 5, 5), np.float32)
    b = _random(self.rng, (7, 5, 2), np.float32)

    def spd(a):
      return a @ jnp.swapaxes(a, -1, -2) + 5 * jnp.eye(5)

    grads = {
        "cholesky": lambda a: jnp.sum(jnp.linalg.cholesky(spd(a)) ** 2),
        "solve": lambda a: jnp.sum(jnp.linalg.solve(spd(a), b) ** 2),
        "eigh": lambda a: jnp.sum(jnp.linalg.eigh(spd(a))[0] ** 2),
        "eigh_vectors": lambda a: jnp.sum(jnp.linalg.eigh(spd(a))[1][..., 0] ** 2),
        "slogdet": lambda a: jnp.sum(jnp.linalg.slogdet(spd(a))[1]),
    }
    def all_grads(a):
      return {name: jax.grad(loss)(a) for name, loss in grads.items()}

    self._check(all_grads, a, rtol=1e-4, atol=1e-4)

  def test_inside_scan_and_vmap(self):
    a = _random(self.rng, (4, 3, 5, 5), np.float32)

    def fn(a):
      def body(total, x):
        factor = jnp.linalg.cholesky(x @ jnp.swapaxes(x, -1, -2) + 5 * jnp.eye(5))
        return total + jnp.sum(factor), factor
      return lax.scan(body, 0.0, a), jax.vmap(lambda x: jnp.linalg.qr(x)[1])(a)

    self._check(fn, a)

  @parameterized.product(
      dtype=(jnp.float16, jnp.bfloat16),
      shape=(((17,), 6, "batched"), ((2, 3), 4, "per_tile"), ((), 5, "per_tile"),
             ((0,), 3, "batched"), ((), 130, "batched")))
  def test_half_precision_triangular_solve(self, dtype, shape):
    # jax.jit runs it in the operands' type (XLA expands the solve; n = 130
    # takes its blocked path): the same bits.
    batch, n, mode = shape
    a = _triangular(self.rng, batch, n, np.float32).astype(dtype)
    b = _random(self.rng, batch + (n, 3), np.float32).astype(dtype)
    bt = _random(self.rng, batch + (2, n), np.float32).astype(dtype)

    def fn(a, b, bt):
      return (lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
              lax.linalg.triangular_solve(a, bt, left_side=False, lower=True, transpose_a=True,
                                          unit_diagonal=True),
              jsl.solve_triangular(jnp.swapaxes(a, -1, -2), b, lower=False))

    got = ipu_jax.jit(fn, target=_T16, config=_config(mode))(a, b, bt)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, jax.jit(fn)(a, b, bt))

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half_precision_update_product_and_gradient(self, dtype):
    a = _triangular(self.rng, (3,), 4, np.float32).astype(dtype)
    b = _random(self.rng, (3, 4, 2), np.float32).astype(dtype)
    r = np.swapaxes(np.linalg.cholesky(_positive_definite(self.rng, (), 4, np.float32)), 0, 1)

    def fn(a, b, r):
      return {
          "cholesky_update": lax.linalg.cholesky_update(r.astype(dtype), b[0, :, 0]),
          "symmetric_product": lax.linalg.symmetric_product(b, a),
          "solve_grad": jax.grad(lambda b: jnp.sum(
              jsl.solve_triangular(a, b, lower=True).astype(jnp.float32) ** 2))(b),
      }

    got = ipu_jax.jit(fn, target=_T16)(a, b, r)
    jax.tree_util.tree_map(np.testing.assert_array_equal, got, jax.jit(fn)(a, b, r))

  # -- errors ---------------------------------------------------------------

  def test_unsupported_modes_name_primitive_and_line(self):
    a = _positive_definite(self.rng, (2,), 4, np.float32)
    cases = [
        (lambda a: lax.linalg.eigh(a, subset_by_index=(0, 2)), "eigh", "subset_by_index"),
        (lambda a: lax.linalg.eigh(a, implementation=lax.linalg.EighImplementation.QDWH),
         "eigh", "QDWH"),
        (lambda a: lax.linalg.svd(a, algorithm=lax.linalg.SvdAlgorithm.POLAR), "svd", "POLAR"),
        (lambda a: lax.linalg.cholesky(a.astype(jnp.bfloat16)), "cholesky", "bfloat16"),
    ]
    for fn, primitive, detail in cases:
      with self.subTest(detail):
        with self.assertRaises(ipu_jax.LoweringError) as caught:
          ipu_jax.jit(fn, target=_T16).lower(a)
        message = str(caught.exception)
        self.assertIn(f"'{primitive}'", message)
        self.assertIn(detail, message)
        self.assertIn(f"test_lowering_linalg.py:{fn.__code__.co_firstlineno}", message)

  def test_jacobi_algorithms_run_as_costed(self):
    a = _positive_definite(self.rng, (3,), 5, np.float32)
    eigh = lambda a: lax.linalg.eigh(a, implementation=lax.linalg.EighImplementation.JACOBI)[1]
    got = ipu_jax.jit(eigh, target=_T16)(a)
    chex.assert_trees_all_close(got, jnp.linalg.eigvalsh(a), rtol=1e-5)
    svd = lambda a: lax.linalg.svd(a, compute_uv=False, algorithm=lax.linalg.SvdAlgorithm.JACOBI)
    got = ipu_jax.jit(svd, target=_T16)(a)
    chex.assert_trees_all_close(got, jnp.linalg.svd(a, compute_uv=False), rtol=1e-5)

  def test_matrix_larger_than_a_tile_is_out_of_memory(self):
    # 300 x 300 float32 operand and factor: 720 KB on one 624 KiB tile.
    a = jax.ShapeDtypeStruct((300, 300), jnp.float32)
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(jnp.linalg.cholesky, target=_T16).lower(a)
    self.assertIn("tile", str(caught.exception))
    # 200 x 200 fits.
    ipu_jax.jit(jnp.linalg.cholesky, target=_T16).lower(
        jax.ShapeDtypeStruct((200, 200), jnp.float32))

  # -- placement and cost -------------------------------------------------------

  def test_batch_spreads_linearly_over_tiles(self):
    a = _positive_definite(self.rng, (40,), 4, np.float32)
    step = _first_step(lax.linalg.cholesky, a, op="cholesky")
    # 40 problems on 16 tiles: groups of 3 on 14 tiles (the last holds 1).
    self.assertEqual(int((step.compute_cycles > 0).sum()), 14)
    self.assertEqual(step.flops, round(40 * 4 ** 3 / 3))
    self.assertEqual(sorted(step.vertices[step.vertices > 0].tolist()), [1] + [3] * 13)

  def test_full_chip_one_problem_per_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    a = jax.ShapeDtypeStruct((1472, 16, 16), jnp.float32)
    steps = ipu_jax.jit(lax.linalg.qr, target=target).lower(a).profile.steps
    (step,) = [s for s in steps if s.op == "qr"]
    self.assertTrue((step.vertices == 1).all())
    self.assertTrue((step.compute_cycles == step.compute_cycles[0]).all())
    # Each tile holds a working copy of its matrix while it runs.
    self.assertTrue((step.temporary_bytes >= 16 * 16 * 4).all())

  def test_factor_stays_on_its_tiles(self):
    a = _well_conditioned(self.rng, (32,), 6, np.float32)
    b = _random(self.rng, (32, 6, 2), np.float32)

    def fn(a, b):
      lu, _, _ = lax.linalg.lu(a)
      return lax.linalg.triangular_solve(lu, b, left_side=True, lower=True,
                                         unit_diagonal=True)

    self._check(fn, a, b)
    solve = _first_step(fn, a, b, op="triangular_solve")
    # Only b moves: the factor is already laid out by problem.
    self.assertLessEqual(int(solve.exchange_bytes_in.sum()), b.nbytes)

  def test_cholesky_cycles_grow_as_n_cubed(self):
    def cycles(batch, n):
      a = jax.ShapeDtypeStruct(batch + (n, n), jnp.float32)
      return _first_step(lax.linalg.cholesky, a, op="cholesky").compute_cycles.max()

    # Six problems per tile: every worker busy with whole problems.
    ratio = cycles((96,), 64) / cycles((96,), 32)
    self.assertBetween(ratio, 7.0, 8.5)
    # One matrix shared by the workers: per-column syncs make small n cheaper
    # than n^3, large n approaches it.
    small, large = cycles((), 32), cycles((), 64)
    self.assertBetween(large / small, 3.0, 8.5)
    self.assertGreater(cycles((), 128) / large, large / small)


if __name__ == "__main__":
  absltest.main()
