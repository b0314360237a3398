"""Tests of ``ipu_jax.ops.softmax``: jax.nn.softmax's values, popnn's steps and costs."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import ops

T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def normal(seed, shape, dtype=jnp.float32, scale=3.0):
  # Test inputs drawn on the host: jax.random would compile a sampler per shape.
  return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape, np.float32),
                     dtype)


def vjp_of(fn):
  return lambda x, g: jax.vjp(fn, x)[1](g)[0]


def popnn_forward(x):
  """popnn's softmaxImpl written as plain ops: the sums' reciprocal, then a multiply."""
  e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
  return e * (1 / jnp.sum(e, -1, keepdims=True))


def popnn_backward(y, g):
  """popnn's softmaxInputGradientImpl as plain ops."""
  gy = g * y
  return gy - y * jnp.sum(gy, -1, keepdims=True)


class SoftmaxValuesTest(parameterized.TestCase):

  @parameterized.product(
      shape_axis=[((7,), -1), ((3, 5, 37), -1), ((4, 9, 6), 1), ((5, 3), 0),
                  ((2, 3, 4), (0, 2)), ((2, 3), None)],
      dtype=[jnp.float16, jnp.float32])
  def test_values_are_jax_nn_softmax_bit_exact(self, shape_axis, dtype):
    shape, axis = shape_axis
    x = normal(sum(shape), shape, dtype)
    want = np.asarray(jax.jit(lambda x: jax.nn.softmax(x, axis=axis))(x))
    fn = lambda x: ops.softmax(x, axis=axis)
    chex.assert_trees_all_equal(np.asarray(jax.jit(fn)(x)), want)
    chex.assert_trees_all_equal(np.asarray(ipu_jax.jit(fn, target=T16)(x)), want)

  def test_unstable_is_exp_over_sum(self):
    x = normal(0, (4, 11))
    want = jax.jit(lambda x: jnp.exp(x) / jnp.sum(jnp.exp(x), -1, keepdims=True))(x)
    got = ipu_jax.jit(lambda x: ops.softmax(x, stable=False), target=T16)(x)
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(want))

  @parameterized.parameters(((0,),), ((3, 0),), ((0, 4),))
  def test_empty(self, shape):
    x = jnp.zeros(shape, jnp.float16)
    got = np.asarray(ipu_jax.jit(ops.softmax, target=T16)(x))
    self.assertEqual(got.shape, shape)
    chex.assert_trees_all_equal(got, np.asarray(jax.nn.softmax(x)))

  def test_vmap(self):
    x = normal(1, (3, 4, 10))
    fn = jax.vmap(lambda x: ops.softmax(x, axis=0), in_axes=1)
    want = jax.vmap(lambda x: jax.nn.softmax(x, axis=0), in_axes=1)(x)
    chex.assert_trees_all_equal(np.asarray(ipu_jax.jit(fn, target=T16)(x)), np.asarray(want))

  @parameterized.parameters(jnp.float16, jnp.float32)
  def test_grad_matches_jax_nn_softmax(self, dtype):
    x, g = normal(2, (3, 5, 37), dtype), normal(3, (3, 5, 37), dtype, scale=1.0)
    want = jax.jit(vjp_of(jax.nn.softmax))(x, g)
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == jnp.float16 else dict(rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(jax.jit(vjp_of(ops.softmax))(x, g), want, **tol)
    chex.assert_trees_all_close(ipu_jax.jit(vjp_of(ops.softmax), target=T16)(x, g), want, **tol)

  def test_grad_of_vmap_and_second_order(self):
    x = normal(4, (2, 3, 6))
    loss = lambda f: (lambda x: jnp.sum(jnp.sin(jax.vmap(f)(x))))
    chex.assert_trees_all_close(jax.grad(loss(ops.softmax))(x),
                                jax.grad(loss(jax.nn.softmax))(x), rtol=1e-5, atol=1e-6)
    hess = lambda f: jax.hessian(lambda v: jnp.sum(jnp.sin(f(v))))(x[0, 0])
    chex.assert_trees_all_close(hess(ops.softmax), hess(jax.nn.softmax), rtol=1e-4, atol=1e-6)

  @parameterized.parameters((2,), (-3,), ((0, 0),))
  def test_bad_axis_raises_before_running(self, axis):
    with self.assertRaisesRegex(ValueError, "softmax: .*axis"):
      ops.softmax(jnp.ones((2, 3)), axis=axis)

  def test_axis_of_another_type_raises_naming_it(self):
    with self.assertRaisesRegex(TypeError, "softmax: axis must be an int, a sequence of ints "
                                           "or None, got 1.0"):
      ops.softmax(jnp.ones((2, 3)), axis=1.0)  # was "'float' object is not iterable"
    with self.assertRaisesRegex(TypeError, "softmax: stable must be True or False, got 'no'"):
      ops.softmax(jnp.ones((2, 3)), stable="no")  # was read as True

  def test_scalar_raises(self):
    with self.assertRaisesRegex(ValueError, "rank-0 input has no axis"):
      ops.softmax(jnp.float32(1.0), axis=None)


class SoftmaxCostTest(parameterized.TestCase):
  """The tile program is popnn's: costs equal popnn's steps written as plain ops."""

  def test_forward_costs_popnn_steps(self):
    x = normal(5, (3, 5, 37), jnp.float16)
    cycles = lambda f: ipu_jax.jit(f, target=T16).lower(x).report.total_cycles
    self.assertEqual(cycles(ops.softmax), cycles(popnn_forward))
    self.assertLess(cycles(ops.softmax), cycles(jax.nn.softmax))

  def test_backward_costs_popnn_steps(self):
    x, g = normal(6, (3, 5, 37), jnp.float16), normal(7, (3, 5, 37), jnp.float16)
    cycles = lambda f: ipu_jax.jit(f, target=T16).lower(x, g).report.total_cycles
    popnn = lambda x, g: popnn_backward(ops.softmax(x), g)
    self.assertEqual(cycles(vjp_of(ops.softmax)), cycles(popnn))
    self.assertLess(cycles(vjp_of(ops.softmax)), cycles(vjp_of(jax.nn.softmax)))


if __name__ == "__main__":
  absltest.main()
