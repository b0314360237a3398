"""Elementwise primitives against jax.jit: exact results on every layout."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import vocabulary as vocab

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_SHAPES = ((), (0,), (1,), (37,), (7, 13), (3, 1, 5), (515,))


def _random(shape, dtype, seed=0, low=-3.0, high=3.0):
  """Seeded inputs, converted on the host and put on the device (jnp.asarray
  would compile a conversion per shape and dtype)."""
  rng = np.random.default_rng(seed)
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return jax.device_put(rng.random(shape) > 0.5)
  if np.issubdtype(dtype, np.integer):
    return jax.device_put(rng.integers(-50, 50, size=shape).astype(dtype))
  return jax.device_put(rng.uniform(low, high, size=shape).astype(dtype))


def _check(fn, *args, target=_T16, mode="batched"):
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  got = ipu_jax.jit(fn, target=target, config=cfg)(*args)
  want = jax.jit(fn)(*args)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  # Each vertex applies the primitive itself: bit-identical, NaNs included.
  jax.tree_util.tree_map(
      lambda g, w: np.testing.assert_array_equal(np.asarray(g), np.asarray(w)), got, want)


_UNARY_FLOAT = [
    ("neg", lax.neg), ("sign", lax.sign), ("floor", lax.floor), ("ceil", lax.ceil),
    ("round", lax.round), ("is_finite", lax.is_finite), ("exp", lax.exp),
    ("exp2", lax.exp2), ("log", lambda x: lax.log(jnp.abs(x) + 0.5)),
    ("log1p", lambda x: lax.log1p(jnp.abs(x))), ("expm1", lax.expm1), ("tanh", lax.tanh),
    ("logistic", lax.logistic), ("sin", lax.sin), ("cos", lax.cos), ("tan", lax.tan),
    ("asin", lambda x: lax.asin(x / 4)), ("acos", lambda x: lax.acos(x / 4)),
    ("atan", lax.atan), ("sinh", lax.sinh), ("cosh", lax.cosh), ("asinh", lax.asinh),
    ("acosh", lambda x: lax.acosh(jnp.abs(x) + 1)), ("atanh", lambda x: lax.atanh(x / 4)),
    ("sqrt", lambda x: lax.sqrt(jnp.abs(x))), ("rsqrt", lambda x: lax.rsqrt(jnp.abs(x) + 0.1)),
    ("cbrt", lax.cbrt), ("abs", lax.abs), ("erf", lax.erf), ("erfc", lax.erfc),
    ("erf_inv", lambda x: lax.erf_inv(x / 4)), ("lgamma", lambda x: lax.lgamma(jnp.abs(x) + 0.1)),
    ("digamma", lambda x: lax.digamma(jnp.abs(x) + 0.1)), ("square", lax.square),
    ("integer_pow3", lambda x: lax.integer_pow(x, 3)),
    ("integer_pow-2", lambda x: lax.integer_pow(x, -2)),
    ("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10)),
    ("gelu", jax.nn.gelu), ("relu", jax.nn.relu), ("silu", jax.nn.silu),
    ("softplus", jax.nn.softplus),
]

_BINARY_FLOAT = [
    ("add", lax.add), ("sub", lax.sub), ("mul", lax.mul), ("div", lax.div),
    ("rem", lax.rem), ("pow", lambda x, y: lax.pow(jnp.abs(x) + 0.1, y)),
    ("max", lax.max), ("min", lax.min), ("atan2", lax.atan2),
    ("nextafter", lax.nextafter), ("eq", lax.eq), ("ne", lax.ne), ("lt", lax.lt),
    ("le", lax.le), ("gt", lax.gt), ("ge", lax.ge),
]

_BINARY_INT = [
    ("add", lax.add), ("sub", lax.sub), ("mul", lax.mul),
    ("div", lambda x, y: lax.div(x, jnp.where(y == 0, 1, y))),
    ("rem", lambda x, y: lax.rem(x, jnp.where(y == 0, 1, y))),
    ("max", lax.max), ("min", lax.min), ("and", lax.bitwise_and), ("or", lax.bitwise_or),
    ("xor", lax.bitwise_xor), ("shift_left", lambda x, y: lax.shift_left(x, jnp.abs(y) % 8)),
    ("shift_right_logical", lambda x, y: lax.shift_right_logical(x, jnp.abs(y) % 8)),
    ("shift_right_arithmetic", lambda x, y: lax.shift_right_arithmetic(x, jnp.abs(y) % 8)),
    ("eq", lax.eq), ("lt", lax.lt),
]


class ElementwiseTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*[(name, fn) for name, fn in _UNARY_FLOAT])
  def test_unary_float32(self, fn):
    # Every shape in one program (each is lowered and checked on its own; one
    # compile instead of one per shape).
    _check(lambda *xs: [fn(x) for x in xs], *[_random(s, np.float32) for s in _SHAPES])

  @parameterized.product(dtype=("float16", "bfloat16"), shape=((), (37,), (7, 13)))
  def test_unary_half_precision(self, dtype, shape):
    x = _random(shape, dtype)
    _check(lambda v: (jnp.exp(v), jnp.tanh(v), -v, jnp.abs(v), jax.nn.gelu(v)), x)

  @parameterized.named_parameters(*[(name, fn) for name, fn in _BINARY_FLOAT])
  def test_binary_float32(self, fn):
    xs = [_random(s, np.float32) for s in _SHAPES]
    ys = [_random(s, np.float32, seed=1) for s in _SHAPES]
    _check(lambda xs, ys: [fn(x, y) for x, y in zip(xs, ys)], xs, ys)

  @parameterized.named_parameters(*[(name, fn) for name, fn in _BINARY_INT])
  def test_binary_int32(self, fn):
    shapes = ((), (0,), (37,), (7, 13))
    xs = [_random(s, np.int32) for s in shapes]
    ys = [_random(s, np.int32, seed=1) for s in shapes]
    _check(lambda xs, ys: [fn(x, y) for x, y in zip(xs, ys)], xs, ys)

  @parameterized.parameters("and", "or", "xor", "not")
  def test_bool(self, op):
    x, y = _random((37,), np.bool_), _random((37,), np.bool_, seed=1)
    fns = {"and": jnp.logical_and, "or": jnp.logical_or, "xor": jnp.logical_xor,
           "not": lambda a, b: jnp.logical_not(a)}
    _check(fns[op], x, y)

  def test_integer_unary(self):
    x = _random((41,), np.int32)
    _check(lambda v: (-v, jnp.abs(v), jnp.sign(v), ~v, lax.population_count(v), lax.clz(v)), x)

  @parameterized.parameters(
      ("float32", "int32"), ("float32", "bfloat16"), ("float32", "float16"), ("int32", "float32"),
      ("bool", "float32"), ("float32", "bool"), ("bfloat16", "float32"), ("int32", "bool"),
      ("float32", "uint8"), ("uint32", "float32"))
  def test_convert_element_type(self, src, dst):
    x = _random((37,), src, low=-300, high=300)
    _check(lambda v: v.astype(dst), x)

  def test_select_clamp_and_where(self):
    p = _random((7, 13), np.bool_)
    x, y = _random((7, 13), np.float32), _random((7, 13), np.float32, seed=1)
    _check(lambda p, x, y: (lax.select(p, x, y), jnp.where(p, x, 0.5),
                            lax.clamp(-1.0, x, 1.0), lax.clamp(y - 1, x, y + 1)), p, x, y)
    i = _random((7, 13), np.int32) % 3
    _check(lambda i, x, y: lax.select_n(jnp.abs(i), x, y, x * y), i, x, y)

  def test_special_functions_of_several_operands(self):
    # Continued fractions XLA expands in place: the same expansion runs per tile.
    a = _random((7, 13), np.float32, seed=2, low=0.5, high=4.0)
    b = _random((7, 13), np.float32, seed=3, low=0.5, high=4.0)
    x = _random((7, 13), np.float32, seed=4, low=0.0, high=1.0)
    _check(lambda a, b, x: (lax.betainc(a, b, x), jax.scipy.special.betainc(a, 2.0, x)), a, b, x)
    _check(lambda a, x: jax.grad(lambda a: jnp.sum(lax.igamma(a, x)))(a), a, x * 5)

  def test_bitcast(self):
    x = _random((37,), np.float32)
    _check(lambda v: (lax.bitcast_convert_type(v, jnp.int32),
                      lax.bitcast_convert_type(v, jnp.uint16)), x)

  def test_broadcasting_size_one_axes_and_scalars(self):
    x = _random((6, 10, 5), np.float32)
    m = _random((6, 10, 1), np.float32, seed=1)
    s = _random((), np.float32, seed=2)
    _check(lambda x, m, s: (x - m, x * s + 2.0, jnp.maximum(x, m), x / (s + 4.0)), x, m, s)
    # A softmax: keepdims reductions broadcast back along their axis. It sums,
    # so it matches to rounding rather than bit for bit.
    softmax = lambda x: jax.nn.softmax(x, axis=-1)  # noqa: E731
    chex.assert_trees_all_close(ipu_jax.jit(softmax, target=_T16)(x), jax.jit(softmax)(x),
                                rtol=1e-6)

  def test_operands_with_different_layouts(self):
    # x.T has another tile layout than y: the operand is exchanged first.
    x, y = _random((13, 7), np.float32), _random((7, 13), np.float32, seed=1)
    _check(lambda x, y: x.T * y + x.T, x, y)
    report = ipu_jax.jit(lambda x, y: x.T * y, target=_T16).lower(x, y).report
    self.assertGreater(int(sum(s.exchange_bytes_in.sum() for s in report.profile.steps)), 0)

  def test_same_layout_needs_no_exchange(self):
    x, y = _random((515,), np.float32), _random((515,), np.float32, seed=1)
    # Fusion off: this compares the cost of single operations, each its own
    # superstep (tests/test_fusion.py covers the fused compute set).
    cfg = ipu_jax.IPUConfig()
    cfg.fusion.elementwise = False
    report = ipu_jax.jit(lambda x, y: jnp.exp(x) * y + x, target=_T16,
                         config=cfg).lower(x, y).report
    self.assertEqual(int(sum(s.exchange_bytes_in.sum() for s in report.profile.steps)), 0)
    self.assertGreater(report.compute_cycles, 0)
    # Transcendentals cost more per element than additions.
    exp_step, mul_step = report.profile.steps[0], report.profile.steps[1]
    self.assertGreater(exp_step.compute_phase_cycles, mul_step.compute_phase_cycles)

  @parameterized.parameters(np.float16, np.float32)
  def test_division_by_a_constant_costs_a_multiply(self, dtype):
    # XLA's algebraic simplifier rewrites A / Const into A * (1 / Const), so
    # the IPU runs popops' MULTIPLY: BinaryOp1D's estimator for it, not
    # DIVIDE's 21 (half) / 10 (float) cycles per unrolled group.
    from ipu_jax.kernels import popops
    x, y = _random((16, 96), dtype), _random((16, 96), dtype, seed=1, low=1.0)
    cfg = ipu_jax.IPUConfig()
    cfg.fusion.elementwise = False

    def cycles(fn, *args):
      steps = ipu_jax.jit(fn, target=_T16, config=cfg).lower(*args).report.profile.steps
      return np.asarray(steps[-1].compute_cycles, np.float64)

    scaled = cycles(lambda x: x / 8.0, x)
    np.testing.assert_array_equal(scaled, cycles(lambda x: x * 0.125, x))
    elements = np.full(16, x.size // 16)   # 96 elements a tile
    want = popops.popops_elementwise_cycles(_T16, elements, "mul", dtype)
    self.assertEqual(scaled.max(), want.max())
    # A divisor that is not a constant stays popops' DIVIDE.
    divided = cycles(lambda x, y: x / y, x, y)
    self.assertEqual(divided.max(), popops.popops_elementwise_cycles(_T16, elements, "div",
                                                                     dtype).max())
    _check(lambda x: x / 3.0, x)
    _check(lambda x: x / 8.0, x)

  def test_scalar_broadcast_is_a_multicast(self):
    x, s = _random((515,), np.float32), _random((), np.float32, seed=1)
    report = ipu_jax.jit(lambda x, s: x * s, target=_T16).lower(x, s).report
    step = report.profile.steps[0]
    # Every tile of x receives the 4-byte scalar at most once; its tile sends it once.
    self.assertTrue(np.all(step.exchange_bytes_in <= 4))
    self.assertEqual(int(step.exchange_bytes_out.sum()), 4)

  def test_per_tile_mode_and_full_target(self):
    x, y = _random((1001,), np.float32), _random((1001,), np.float32, seed=1)
    fn = lambda x, y: (jnp.tanh(x) * y - x, x > y)  # noqa: E731
    _check(fn, x, y, mode="per_tile")
    _check(fn, x, y, target=ipu_jax.IPUTarget.preset("ipu2"))

  def test_gradients(self):
    x = _random((7, 13), np.float32)

    def f(x):
      return jnp.sum(jnp.tanh(x) * jax.nn.sigmoid(x) + jnp.exp(-x * x))

    chex.assert_trees_all_close(ipu_jax.jit(jax.grad(f), target=_T16)(x), jax.jit(jax.grad(f))(x),
                                rtol=1e-6)



def _profile(fn, *args, fuse=False):
  cfg = ipu_jax.IPUConfig()
  cfg.fusion.elementwise = fuse
  return ipu_jax.jit(fn, target=_T16, config=cfg).lower(*args).report.profile


def _layer_norm_like(x, r, m):
  return x * r[..., None] + m[..., None]


def _batch_norm_like(x, s, b):
  return x * s[None, None, None, :] + b


class BroadcastOperandTest(chex.TestCase):
  """An operand with size-1 axes is read broadcast, never made full size.

  popops' vertices read it in place (lib/popops/ElementWise.cpp: BroadcastScalar
  for a scalar per region, the binary vertex or a map expression otherwise).
  """

  @parameterized.parameters(np.float16, np.float32)
  def test_values_are_exact_on_odd_sizes(self, dtype):
    x = _random((3, 37, 33), dtype)
    r, m = _random((3, 37), dtype, seed=1), _random((3, 37), dtype, seed=2)
    s, b = _random((33,), dtype, seed=3), _random((33,), dtype, seed=4)
    x4 = _random((2, 3, 5, 33), dtype, seed=5)
    for mode in ("batched", "per_tile"):
      _check(_layer_norm_like, x, r, m, mode=mode)
      _check(_batch_norm_like, x4, s, b, mode=mode)
      _check(lambda r, s: r[..., None] - s, r, s, mode=mode)   # both operands broadcast

  @parameterized.parameters(np.float16, np.float32)
  def test_scalar_per_row_is_popops_broadcast_scalar(self, dtype):
    # [4, 8, 32] on 16 tiles: 64 elements, two rows of 32, on each tile.
    x = _random((4, 8, 32), dtype)
    r, m = _random((4, 8), dtype, seed=1), _random((4, 8), dtype, seed=2)
    profile = _profile(_layer_norm_like, x, r, m)
    self.assertEqual([s.name for s in profile.steps], ["mul", "add"])   # no copy step
    # popops' BroadcastScalar1D per region (lib/popops/popopsCycleEstimators.cpp,
    # broadcastArithmetic1DCycleEstimate; mul and add have assembly codelets, 1
    # cycle + 1 overhead a vector): 6 * (20 + ceil(ceil(32 / 6) / vector) * 2)
    # + 11 (basicOpSupervisorOverhead); it is cheaper than BroadcastScalar2D
    # (6 * (20 + 2 * 28 + loops * 5)), so popops picks it; two regions a tile.
    vector = 4 if dtype == np.float16 else 2
    region = 6 * (20 + -(-6 // vector) * 2) + 11
    for step in profile.steps:
      np.testing.assert_array_equal(step.compute_cycles, np.full(16, 2 * region))
      # Each tile receives at most the two scalars its rows read.
      self.assertLessEqual(int(step.exchange_bytes_in.max()), 2 * np.dtype(dtype).itemsize)
    _check(_layer_norm_like, x, r, m)

  @parameterized.parameters(np.float16, np.float32)
  def test_vector_along_rows_is_read_in_place(self, dtype):
    from ipu_jax.kernels import popops
    x = _random((2, 4, 8, 16), dtype)        # 64 elements a tile: 4 rows of 16
    s, b = _random((16,), dtype, seed=1), _random((16,), dtype, seed=2)
    profile = _profile(_batch_norm_like, x, s, b)
    self.assertEqual([st.name for st in profile.steps], ["mul", "add"])
    want = popops.popops_elementwise_cycles(_T16, np.full(16, 64), "mul", dtype)
    itemsize = np.dtype(dtype).itemsize
    for step in profile.steps:
      np.testing.assert_array_equal(step.compute_cycles, want)
      # Only the 16 elements of the vector, once, not the 64 a tile reads.
      self.assertLessEqual(int(step.exchange_bytes_in.max()), 16 * itemsize)
    _check(_batch_norm_like, x, s, b)

  @parameterized.parameters((_layer_norm_like, (4, 8, 32), (4, 8)),
                            (_batch_norm_like, (2, 4, 8, 16), (16,)))
  def test_fused_chain_makes_no_full_size_operand(self, fn, shape, small):
    x = _random(shape, np.float32)
    a, b = _random(small, np.float32, seed=1), _random(small, np.float32, seed=2)
    fused = _profile(fn, x, a, b, fuse=True)
    self.assertLen(fused.steps, 1)
    # The same arithmetic with explicit full-size broadcasts (as JAX's
    # transposes write them) reads them in place too: no copy step, the
    # same peak.
    ndim = len(shape)
    lead = (ndim - len(small)) if fn is _batch_norm_like else 0

    def made(x, a, b):
      dims = tuple(range(lead, lead + len(small)))
      full = lambda v: lax.broadcast_in_dim(v, shape, dims)  # noqa: E731
      return x * full(a) + full(b)

    explicit = _profile(made, x, a, b, fuse=True)
    self.assertLen(explicit.steps, 1)
    self.assertEqual(int(fused.memory.peak.max()), int(explicit.memory.peak.max()))
    _check(fn, x, a, b)
    _check(made, x, a, b)


def _two_uses_grad(x, y, z):
  # x read twice: its cotangent is JAX's add_any of the two readers' cotangents.
  return jax.grad(lambda x: jnp.sum(jnp.sin(x) * y) + jnp.sum(jnp.cos(x) * z))(x)


def _centred_grad(x, y):
  # x - mean(x): x's cotangent is add_any(g, broadcast_in_dim(-sum(g) / n)),
  # the broadcast read as a view (a scalar per row).
  return jax.grad(lambda x: jnp.sum((x - jnp.mean(x, axis=-1, keepdims=True)) * y))(x)


def _add_any_step(profile):
  steps = [s for s in profile.steps if s.op == "add_any"]
  assert len(steps) == 1, [s.op for s in profile.steps]
  return steps[0]


class CotangentSumTest(chex.TestCase, parameterized.TestCase):
  """``add_any`` (the backward pass's sum of cotangents) is popops' ADD, as ``add`` is."""

  @parameterized.parameters(np.float16, np.float32)
  def test_add_any_is_popops_binary_add(self, dtype):
    # [16, 96] on 16 tiles: 96 elements a tile. popops' BinaryOp1D ADD
    # (poplibs lib/popops/popopsCycleEstimators.cpp, BinaryOp1D estimator with
    # binaryOpPerfInfo ADD: 1 cycle a vector, +2 loop overhead for the
    # assembly codelet): 6 * (29 float / 26 half + ceil(ceil(96 / 6) / vector)
    # * 3) + 11 (basicOpSupervisorOverhead). float: 6 * (29 + 8 * 3) + 11 = 329;
    # half: 6 * (26 + 4 * 3) + 11 = 239.
    x, y, z = (_random((16, 96), dtype, seed=i) for i in range(3))
    step = _add_any_step(_profile(_two_uses_grad, x, y, z))
    want = 329 if dtype == np.float32 else 239
    np.testing.assert_array_equal(step.compute_cycles, np.full(16, want))
    self.assertEqual(step.codelets, (vocab.vertex(vocab.ELEMENTWISE, "add"),))
    _check(_two_uses_grad, x, y, z)

  def test_add_any_broadcast_reader_is_popops_broadcast_scalar(self):
    # [16, 96] float32, one row a tile; the mean's cotangent is one scalar per
    # row: popops' BroadcastScalar1D ADD (broadcastArithmetic1DCycleEstimate,
    # 1 cycle + 1 overhead a vector of 2 floats): 6 * (20 + ceil(ceil(96 / 6)
    # / 2) * 2) + 11 = 6 * (20 + 16) + 11 = 227 (BroadcastScalar2D's
    # 6 * (20 + 28 + 8 * 5) = 528 is dearer), as the forward ``add`` pays.
    x, y = _random((16, 96), np.float32), _random((16, 96), np.float32, seed=1)
    step = _add_any_step(_profile(_centred_grad, x, y))
    np.testing.assert_array_equal(step.compute_cycles, np.full(16, 227))
    forward = _profile(lambda x, m: x + m[:, None], x, _random((16,), np.float32, seed=2))
    np.testing.assert_array_equal(step.compute_cycles, forward.steps[0].compute_cycles)
    _check(_centred_grad, x, y)


def _centred_square_sum(x):
  return jnp.sum((x - x.mean(-1, keepdims=True)) ** 2)


class BroadcastInDimViewTest(chex.TestCase, parameterized.TestCase):
  """A ``broadcast_in_dim`` read only by elementwise ops is a view, not a copy.

  JAX's transpose of ``reduce_sum`` (a LayerNorm's or softmax's backward) is
  a ``broadcast_in_dim`` of the cotangent to full size; popops reads it
  through a broadcast view (lib/popops/ElementWise.cpp), as it reads an
  operand with size-1 axes.
  """

  @parameterized.product(fuse=(False, True), dtype=(np.float32, np.float16))
  def test_reduction_cotangent_is_read_in_place(self, fuse, dtype):
    x = _random((64, 96), dtype)
    grad = jax.grad(_centred_square_sum)
    jaxpr = jax.make_jaxpr(grad)(x).jaxpr
    self.assertIn("broadcast_in_dim", [e.primitive.name for e in jaxpr.eqns])
    profile = _profile(grad, x, fuse=fuse)
    names = [s.name for s in profile.steps]
    self.assertNotIn("broadcast_in_dim", names)
    self.assertNotIn("fill", names)
    # No step writes a full-size copy of the [64] cotangent: each step
    # reading it receives at most the rows its tiles hold (4 a tile).
    for step in profile.steps:
      self.assertLessEqual(int(step.exchange_bytes_in.max()), 4 * np.dtype(dtype).itemsize)
    for mode in ("batched", "per_tile"):
      _check(grad, x, mode=mode)

  @parameterized.product(op=(lax.add, lax.sub, lax.mul, lax.div),
                         dtype=(np.float32, np.float16))
  def test_costs_what_a_size_one_operand_costs(self, op, dtype):
    # An explicit broadcast read by a binary op costs what the same operand
    # with size-1 axes does (cost model 15: BroadcastScalar, or the binary
    # vertex reading in place): the same steps, cycles and peak memory.
    a, v = _random((64, 96), dtype), _random((64,), dtype, seed=1, low=1.0)
    explicit = _profile(lambda a, v: op(a, lax.broadcast_in_dim(v, a.shape, (0,))), a, v)
    size_one = _profile(lambda a, v: op(a, v[:, None]), a, v)
    self.assertEqual([s.name for s in explicit.steps], [s.name for s in size_one.steps])
    for got, want in zip(explicit.steps, size_one.steps):
      np.testing.assert_array_equal(got.compute_cycles, want.compute_cycles)
      np.testing.assert_array_equal(got.exchange_bytes_in, want.exchange_bytes_in)
    self.assertEqual(explicit.total_cycles, size_one.total_cycles)
    self.assertEqual(int(explicit.memory.peak.max()), int(size_one.memory.peak.max()))
    _check(lambda a, v: op(a, lax.broadcast_in_dim(v, a.shape, (0,))), a, v)

  @parameterized.parameters(
      (lambda v, n: lax.broadcast_in_dim(v, (64, 96), (0,)),),
      (lambda v, n: v[:, None],),
  )
  def test_fused_member_moved_onto_another_layout_reads_its_rows(self, read):
    a, w = _random((64, 96), np.float32), _random((64, 96), np.float32, seed=1)
    b, v = _random((64, 64), np.float32, seed=2), _random((64,), np.float32, seed=3)
    # The multiply, on the matmul's layout alone, joins exp(a)'s group on
    # a's layout: there it still receives only the rows of v each tile reads
    # (not all of v on every tile), as if written on that layout unfused.
    moved = lambda a, b, v: jnp.exp(a) + (b @ w) * read(v, 96)  # noqa: E731
    on_a = lambda a, b, v: jnp.exp(a) * read(v, 96) + b @ w  # noqa: E731
    fused = [s for s in _profile(moved, a, b, v, fuse=True).steps if s.name.startswith("fused")]
    self.assertLen(fused, 1)
    steps = _profile(on_a, a, b, v).steps
    want = sum(s.exchange_bytes_in for s in steps if s.name in ("mul", "add"))
    np.testing.assert_array_equal(fused[0].exchange_bytes_in, want)
    _check(moved, a, b, v)

  @parameterized.named_parameters(
      ("output", lambda v, w: (lax.broadcast_in_dim(v, (16, 24), (0,)),
                               lax.broadcast_in_dim(v, (16, 24), (0,)) * 2.0)),
      ("matmul_reader", lambda v, w: jnp.dot(lax.broadcast_in_dim(v, (16, 24), (0,)), w)),
      ("mixed_readers", lambda v, w: (lambda b: (b + 1.0, b @ w))(
          lax.broadcast_in_dim(v, (16, 24), (0,)))),
  )
  def test_other_readers_get_the_full_size_result(self, fn):
    v, w = _random((16,), np.float32), _random((24, 8), np.float32, seed=1)
    names = [s.name for s in _profile(fn, v, w).steps]
    self.assertIn("broadcast_in_dim", names)
    _check(fn, v, w)

  @parameterized.parameters(
      (lambda c, x: jnp.where(c, x, lax.broadcast_in_dim(x[:, 0], x.shape, (0,))),),
      (lambda c, x: lax.clamp(lax.broadcast_in_dim(x[:, 0], x.shape, (0,)), x, x + 1.0),),
      (lambda c, x: -lax.broadcast_in_dim(x[:, 0], x.shape, (0,)).astype(np.float16),),
      (lambda c, x: jnp.where(c, x, 0.0) + jnp.zeros_like(x),),
  )
  def test_every_elementwise_reader_reads_a_view(self, fn):
    c, x = _random((13, 37), np.bool_), _random((13, 37), np.float32, seed=1)
    for mode in ("batched", "per_tile"):
      _check(fn, c, x, mode=mode)

if __name__ == "__main__":
  absltest.main()
