"""Tests of ``ipu_jax.ops.gelu``: jax.nn.gelu's values, popnn's GELU vertex and its cost."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import popops
from testing_utils import T16, assert_matches_jit, random_array

_ref = lambda x: jax.nn.gelu(x, approximate=True)


def _vjp(fn):
  return lambda x, g: jax.vjp(fn, x)[1](g)[0]


class GeluValuesTest(parameterized.TestCase):

  @parameterized.product(shape=[(7, 33), (5,), (2, 3, 17)], dtype=[jnp.float16, jnp.float32])
  def test_values_are_jax_nn_gelu_bit_exact(self, shape, dtype):
    x = random_array(shape, dtype) * 3
    want = jax.jit(_ref)(x)
    jax.tree.map(np.testing.assert_array_equal, jax.jit(ipu_jax.ops.gelu)(x), want)
    assert_matches_jit(ipu_jax.ops.gelu, x, exact=True)
    np.testing.assert_array_equal(np.asarray(ipu_jax.jit(ipu_jax.ops.gelu, target=T16)(x)),
                                  np.asarray(want))

  @parameterized.parameters(jnp.float16, jnp.float32)
  def test_grad_matches_jax_nn_gelu(self, dtype):
    x, g = random_array((6, 19), dtype) * 3, random_array((6, 19), dtype, seed=1)
    want = jax.jit(_vjp(_ref))(x, g)
    got = ipu_jax.jit(_vjp(ipu_jax.ops.gelu), target=T16)(x, g)
    tol = 1e-2 if dtype == jnp.float16 else 1e-6
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)

  def test_vmap_and_second_order(self):
    x = random_array((3, 11), jnp.float32)
    chex.assert_trees_all_close(np.asarray(jax.vmap(ipu_jax.ops.gelu, 1, 1)(x)),
                                np.asarray(_ref(x)))
    second = lambda f: jax.grad(lambda v: jnp.sum(jax.grad(lambda u: jnp.sum(f(u)))(v)))
    chex.assert_trees_all_close(np.asarray(ipu_jax.jit(second(ipu_jax.ops.gelu), target=T16)(x)),
                                np.asarray(jax.jit(second(_ref))(x)), rtol=1e-5, atol=1e-6)
    g = random_array((3, 11), jnp.float32, seed=2)
    got = jax.vmap(_vjp(ipu_jax.ops.gelu), (0, None))(x, g[0])
    chex.assert_trees_all_close(np.asarray(got), np.asarray(jax.vmap(_vjp(_ref), (0, None))(x, g[0])),
                                rtol=1e-6, atol=1e-6)

  def test_integers_promote_as_jax_nn_gelu(self):
    x = jnp.arange(-3, 4)
    got = ipu_jax.ops.gelu(x)
    self.assertEqual(got.dtype, _ref(x).dtype)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(_ref(x)))

  def test_complex_raises_before_running(self):
    with self.assertRaisesRegex(TypeError, "complex input .*half or float"):
      ipu_jax.ops.gelu(jnp.ones((3,), jnp.complex64))


class GeluCostTest(parameterized.TestCase):
  """The steps are popnn's vertices, costed by popnn's own estimators."""

  def test_forward_vertex_reproduces_popnn_estimator(self):
    # nonLinearity1DCycleEstimator (lib/popnn/popnnCycleEstimators.cpp), GELU half,
    # opCycles 5 (PerformanceEstimation.hpp), 6 workers, 4 halves a vector:
    # 1,003 halves: 250 vectors, remainder 3; 42 vectors on the longest worker.
    # worker = 20 + (2 + 5 + 41 * 5 + 1 + 5) + 2 + 1 + (2 + 5) + 1 + (3 + 5) = 257
    # cycles = 9 + 6 * 257 = 1,551
    got = popops.nonlinearity_cycles(T16, np.array([1003, 0]), "gelu", np.float16)
    np.testing.assert_array_equal(got, [1551, 0])
    # float: 2 a vector, opCycles 10; 1,001 floats: 500 vectors, remainder 1, 84 per worker
    # worker = 20 + (2 + 10 + 83 * 10 + 1 + 10) + 3 + (2 + 10) = 888; 9 + 6 * 888 = 5,337
    got = popops.nonlinearity_cycles(T16, np.array([1001]), "gelu", np.float32)
    np.testing.assert_array_equal(got, [5337])

  def test_grad_vertex_reproduces_popnn_estimator(self):
    # NonLinearityGrad1D's estimator, GELU half, opCycles 5: 1,003 halves, 42 vectors a worker
    # worker = 20 + (4 + 41 * 5 + 1) + 2 + 2 + (5 + 2) + 2 + (5 + 4) = 252; 9 + 6 * 252 = 1,521
    got = popops.nonlinearity_cycles(T16, np.array([1003]), "gelu_grad", np.float16)
    np.testing.assert_array_equal(got, [1521])

  @parameterized.parameters(("ipu_gelu", "gelu"), ("ipu_gelu_grad", "gelu_grad"))
  def test_lowered_step_costs_popnn_vertex(self, op, kind):
    x = random_array((16, 1003), jnp.float16)
    g = random_array((16, 1003), jnp.float16, seed=1)
    fn = (lambda x, g: ipu_jax.ops.gelu(x)) if kind == "gelu" else _vjp(ipu_jax.ops.gelu)
    (step,) = [s for s in _steps(ipu_jax.jit(fn, target=T16).lower(x, g).program) if s.op == op]
    elements = step.writes[0].mapping.elements_per_tile(T16.num_tiles)
    np.testing.assert_array_equal(np.asarray(step.compute_cycles),
                                  popops.nonlinearity_cycles(T16, elements, kind, np.float16))

  def test_cheaper_than_jax_nn_gelu_chain(self):
    x = random_array((3, 64, 1024), jnp.float16)
    g = random_array((3, 64, 1024), jnp.float16, seed=1)
    cost = lambda f: ipu_jax.jit(_vjp(f), target=T16).lower(x, g).report.total_cycles
    self.assertLess(cost(ipu_jax.ops.gelu), 0.6 * cost(_ref))


def _steps(node):
  from ipu_jax.lowering import program as P
  if isinstance(node, P.Superstep):
    yield node
    return
  for child in P.children(node):
    yield from _steps(child)


if __name__ == "__main__":
  absltest.main()
