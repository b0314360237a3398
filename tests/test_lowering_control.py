"""Tests of the control-flow and miscellaneous lowering rules against jax.jit.

Inlined calls (nested jit, custom_jvp/custom_vjp, remat) with gradients,
scan / fori_loop / while_loop / cond / switch (and conditionals inside loops),
identities and host callbacks. Loop and branch bodies are elementwise fp32, so
results must equal jax.jit exactly.
"""

import functools

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import program as P
import testing_utils

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _run(fn, *args, target=_T16, config=None):
  return ipu_jax.jit(fn, target=target, config=config)(*args)


def _per_tile_config():
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = "per_tile"
  return cfg


def _vjp(fn):
  """Elementwise gradient of ``fn`` (no reduction needed)."""
  def grad(x):
    y, pullback = jax.vjp(fn, x)
    return pullback(jnp.ones_like(y))[0]
  return grad


def _cumsum_scan(xs):
  def body(c, x):
    c = c + x
    return c, c * 2.0
  return lax.scan(body, jnp.zeros(xs.shape[1:], xs.dtype), xs)


def _newton_sqrt(a):
  """Newton iterations for sqrt(a) until converged; returns (root, count)."""
  def cond(state):
    x, i = state
    return (jnp.abs(x * x - a) > 1e-5 * a) & (i < 50)

  def body(state):
    x, i = state
    return 0.5 * (x + a / x), i + 1

  return lax.while_loop(cond, body, (a, jnp.int32(0)))


@jax.custom_vjp
def _clipped_sin(x):
  return jnp.sin(x)


def _clipped_sin_fwd(x):
  return jnp.sin(x), jnp.cos(x)


def _clipped_sin_bwd(cos_x, g):
  return (jnp.clip(g * cos_x, -0.5, 0.5),)


_clipped_sin.defvjp(_clipped_sin_fwd, _clipped_sin_bwd)


def _tanh_scan(x0, w):
  """Three steps of ``tanh(c @ w)``; one function, so both modes share jax.jit's compile."""
  return lax.scan(lambda c, _: (jnp.tanh(c @ w), c.sum()), x0, None, length=3)


class ControlTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters("batched", "per_tile")
  def test_scan_carry_changes_layout_in_the_body(self, mode):
    # The carry starts linearly mapped; the body's result is a matmul's
    # block-grid layout, so the end-of-iteration copy must relayout it while
    # the initial copy must not.
    # Inputs drawn on the host: jax.random would compile a sampler per shape.
    x0 = jnp.asarray(np.random.default_rng(0).standard_normal((37, 29), np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((29, 29), np.float32) * 0.2)
    cfg = ipu_jax.IPUConfig()
    cfg.executor.mode = mode
    chex.assert_trees_all_close(_run(_tanh_scan, x0, w, config=cfg),
                                jax.jit(_tanh_scan)(x0, w), rtol=1e-5, atol=1e-6)

  def assert_same(self, fn, *args, target=_T16, config=None, exact=True):
    got = _run(fn, *args, target=target, config=config)
    want = jax.jit(fn)(*args)
    testing_utils.assert_trees_match(got, want, exact, rtol=1e-5, atol=1e-6)
    return got

  # -- inlined calls ---------------------------------------------------------

  def test_nested_jit(self):
    inner = jax.jit(lambda x, y: jnp.sin(x) * y + 1.0)
    outer = jax.jit(lambda x: inner(x, x) - inner(2.0 * x, x))
    x = jnp.linspace(-2.0, 3.0, 37, dtype=jnp.float32)
    self.assert_same(lambda x: outer(x) * 3.0, x)

  def test_nested_jit_identity_and_constant(self):
    ident = jax.jit(lambda x: x)
    const = jax.jit(lambda x: (x, jnp.float32(2.5)))
    self.assert_same(lambda x: ident(x) + const(x)[1], jnp.arange(5.0))

  @parameterized.named_parameters(
      ("relu", jax.nn.relu),
      ("gelu_tanh", jax.nn.gelu),
      ("gelu_erf", functools.partial(jax.nn.gelu, approximate=False)),
      ("softplus", jax.nn.softplus),
      ("silu", jax.nn.silu),
  )
  def test_custom_jvp_and_grad(self, fn):
    x = jnp.linspace(-4.0, 4.0, 41, dtype=jnp.float32)
    self.assert_same(fn, x)
    # Gradients may differ in the last bit where XLA contracts a different
    # multiply-add into an FMA.
    self.assert_same(_vjp(fn), x, exact=False)
    self.assert_same(jax.grad(lambda s: fn(s) * 2.0), jnp.float32(0.7), exact=False)

  def test_custom_vjp_and_grad(self):
    x = jnp.linspace(-3.0, 3.0, 19, dtype=jnp.float32)
    self.assert_same(_clipped_sin, x)
    self.assert_same(_vjp(lambda v: _clipped_sin(v) * 3.0), x, exact=False)

  def test_remat_and_grad(self):
    fn = jax.checkpoint(lambda x: jnp.sin(jnp.cos(x)) * x)
    x = jnp.linspace(-2.0, 2.0, 23, dtype=jnp.float32)
    self.assert_same(fn, x)
    self.assert_same(_vjp(lambda v: fn(fn(v))), x, exact=False)

  # -- scan ------------------------------------------------------------------

  @parameterized.named_parameters(
      ("scalar_rows", (37,)),
      ("vector_rows", (14, 5)),
      ("matrix_rows", (6, 3, 7)),
  )
  def test_scan_cumsum(self, shape):
    xs = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * 0.37
    self.assert_same(_cumsum_scan, xs)

  def test_scan_reverse_with_consts(self):
    w = jnp.float32(1.5)
    b = jnp.arange(4.0) * 0.25

    def fn(xs):
      def body(c, x):
        c = c * w + x + b
        return c, jnp.sin(c)
      return lax.scan(body, jnp.ones(4), xs, reverse=True)

    self.assert_same(fn, jnp.arange(36.0).reshape(9, 4) * 0.1)

  def test_scan_swapped_carries_and_passthrough(self):
    def fn(xs):
      def body(carry, x):
        a, b, k = carry
        return (b, a + x, k), (a, x, k)
      return lax.scan(body, (jnp.float32(1.0), jnp.float32(-2.0), jnp.int32(7)), xs)

    self.assert_same(fn, jnp.arange(11.0))

  def test_scan_length_zero_and_no_xs(self):
    self.assert_same(_cumsum_scan, jnp.zeros((0, 3), jnp.float32))
    self.assert_same(_cumsum_scan, jnp.zeros((4, 0), jnp.float32))
    self.assert_same(
        lambda c: lax.scan(lambda c, _: (c * 1.5 + 1.0, c), c, None, length=6), jnp.ones(3))

  @parameterized.named_parameters(
      ("f16", jnp.float16), ("bf16", jnp.bfloat16), ("i32", jnp.int32))
  def test_scan_dtypes(self, dtype):
    xs = (jnp.arange(40) % 7).astype(dtype).reshape(8, 5)
    self.assert_same(_cumsum_scan, xs)

  def test_scan_grad(self):
    def fn(xs):
      return lax.scan(lambda c, x: (c * x + jnp.sin(x), c), jnp.float32(1.0), xs)[0]
    self.assert_same(jax.grad(fn), jnp.linspace(0.5, 1.5, 7, dtype=jnp.float32), exact=False)

  def test_nested_scan(self):
    def fn(xs):
      def outer(c, row):
        inner_c, ys = lax.scan(lambda a, x: (a + x * c, a), c, row)
        return inner_c, ys
      return lax.scan(outer, jnp.float32(0.5), xs)
    self.assert_same(fn, jnp.arange(20.0).reshape(4, 5) * 0.1)

  def test_scan_per_tile_and_full_chip(self):
    xs = jnp.arange(3 * 1000, dtype=jnp.float32).reshape(3, 1000) * 0.01
    self.assert_same(_cumsum_scan, xs, config=_per_tile_config())
    self.assert_same(_cumsum_scan, xs, target=ipu_jax.IPUTarget.preset("ipu2"))

  def test_scan_report_counts_iterations(self):
    xs = jnp.arange(24.0).reshape(12, 2)
    # Fusion off: this counts the body's steps one operation each (with
    # fusion the add joins a fused compute set; tests/test_fusion.py).
    cfg = ipu_jax.IPUConfig()
    cfg.fusion.elementwise = False
    lowered = ipu_jax.jit(_cumsum_scan, target=_T16, config=cfg).lower(xs)
    loops = [p for p in lowered.program.programs if isinstance(p, P.Repeat)]
    self.assertLen(loops, 1)
    self.assertEqual(loops[0].count, 12)
    body_ops = {s.op: s.executions for s in lowered.profile.steps if s.executions > 1}
    self.assertEqual(body_ops.get("add"), 12)
    self.assertEqual(body_ops.get("scan"), 12)
    self.assertEqual(set(body_ops.values()), {12})
    self.assertGreater(lowered.report.total_cycles, 0)
    # The carry update lands where the add left it: only ys rows move.
    add_steps = [s for s in lowered.profile.steps if s.op == "add"]
    self.assertEqual(sum(int(s.exchange_bytes_in.sum()) for s in add_steps), 0)
    slices = [s for s in lowered.profile.steps if s.name == "scan/slice"]
    self.assertLen(slices, 1)
    self.assertGreater(int(slices[0].exchange_bytes_in.sum()) + int(slices[0].exchange_bytes_out.sum()), 0)

  def test_scan_body_tensors_are_loop_local(self):
    xs = jnp.arange(24.0).reshape(6, 4)
    lowered = ipu_jax.jit(_cumsum_scan, target=_T16).lower(xs)
    loop, = [p for p in lowered.program.programs if isinstance(p, P.Repeat)]
    written = P.program_writes(loop.body)
    local = getattr(loop, "local_ids", frozenset())
    # The carry, the stacked ys and the counter cross iterations; the row of
    # xs and the body's intermediates do not.
    self.assertLen(written - local, 3)
    self.assertNotEmpty(local)

  # -- fori_loop / while_loop -----------------------------------------------

  def test_fori_loop_static_bounds(self):
    fn = lambda x: lax.fori_loop(0, 9, lambda i, c: c * 1.25 + i, x)
    self.assert_same(fn, jnp.linspace(-1.0, 1.0, 13, dtype=jnp.float32))
    jaxpr = jax.make_jaxpr(fn)(jnp.ones(3))
    self.assertIn("scan", str(jaxpr))

  def test_fori_loop_dynamic_bounds(self):
    fn = lambda x, lo, hi: lax.fori_loop(lo, hi, lambda i, c: c * 1.25 + i, x)
    x = jnp.linspace(-1.0, 1.0, 13, dtype=jnp.float32)
    self.assertIn("while", str(jax.make_jaxpr(fn)(x, 0, 3)))
    for lo, hi in ((0, 7), (3, 3), (5, 2)):
      self.assert_same(fn, x, jnp.int32(lo), jnp.int32(hi))

  def test_while_newton(self):
    a = jnp.float32(10.0)
    root, count = self.assert_same(_newton_sqrt, a)
    self.assertGreater(int(count), 2)
    self.assertAlmostEqual(float(root), np.sqrt(10.0), places=5)
    self.assert_same(_newton_sqrt, jnp.float32(1.0))  # converged at once

  def test_while_with_consts_and_vector_state(self):
    scale = jnp.arange(1.0, 8.0)

    def fn(x, limit):
      def cond(s):
        return s[1] < limit
      def body(s):
        return s[0] * 0.5 + scale, s[1] + 1
      return lax.while_loop(cond, body, (x, jnp.int32(0)))

    self.assert_same(fn, jnp.ones(7), jnp.int32(5))

  # -- cond / switch ---------------------------------------------------------

  @parameterized.parameters(-1.5, 0.0, 2.5)
  def test_cond(self, v):
    fn = lambda x, p: lax.cond(p > 0, lambda x: jnp.sin(x) * p, lambda x: x - p, x)
    self.assert_same(fn, jnp.arange(9.0), jnp.float32(v))

  @parameterized.parameters(-1, 0, 1, 2, 3)
  def test_switch_three_branches(self, index):
    branches = [lambda x: x * 2.0, lambda x: x - 1.0, jnp.cos]
    fn = lambda i, x: lax.switch(i, branches, x)
    self.assert_same(fn, jnp.int32(index), jnp.linspace(0.0, 1.0, 21, dtype=jnp.float32))

  def test_cond_passthrough_and_multiple_outputs(self):
    def fn(p, x, y):
      return lax.cond(p, lambda x, y: (y, x + y), lambda x, y: (x, y), x, y)
    self.assert_same(fn, True, jnp.arange(3.0), jnp.ones(3))
    self.assert_same(fn, False, jnp.arange(3.0), jnp.ones(3))

  def test_cond_grad(self):
    fn = lambda x: lax.cond(x > 0.5, jnp.sin, lambda v: v * v, x)
    for v in (0.25, 1.5):
      self.assert_same(jax.grad(fn), jnp.float32(v), exact=False)

  def test_conditionals_inside_loops(self):
    def fn(x):
      def body(i, c):
        c = lax.cond(i % 2 == 0, lambda c: c * 1.5, lambda c: c - 0.25, c)
        return lax.switch(i % 3, [lambda c: c, jnp.sin, lambda c: c + i], c)
      return lax.fori_loop(0, 7, body, x)

    self.assert_same(fn, jnp.linspace(-1.0, 1.0, 10, dtype=jnp.float32))

    def scan_fn(xs):
      def body(c, x):
        c = lax.cond(x > 2.0, lambda: c + x, lambda: c * 0.5)
        return c, c
      return lax.scan(body, jnp.float32(1.0), xs)
    self.assert_same(scan_fn, jnp.arange(6.0))

  def test_cond_inside_while(self):
    def fn(x):
      def body(s):
        v, i = s
        v = lax.cond(v > 10.0, lambda v: v * 0.5, lambda v: v * 3.0 + 1.0, v)
        return v, i + 1
      return lax.while_loop(lambda s: s[1] < 12, body, (x, 0))
    self.assert_same(fn, jnp.float32(7.0))

  # -- identities and callbacks ---------------------------------------------

  def test_identities(self):
    from jax.ad_checkpoint import checkpoint_name

    def fn(x):
      a = lax.optimization_barrier(x * 2.0)
      b = lax.stop_gradient(x)
      c = jax.device_put(x)
      d = checkpoint_name(x + 1.0, "d")
      return a + b + c + d

    x = jnp.arange(7.0)
    self.assert_same(fn, x)
    lowered = ipu_jax.jit(fn, target=_T16).lower(x)
    ops = {s.op for s in lowered.profile.steps}
    self.assertNotIn("optimization_barrier", ops)
    self.assertNotIn("device_put", ops)

  def test_debug_callback_ordered(self):
    seen = []

    def fn(x):
      jax.debug.callback(lambda v: seen.append(("first", np.asarray(v))), x, ordered=True)
      y = x * 2.0
      jax.debug.callback(lambda v: seen.append(("second", np.asarray(v))), y, ordered=True)
      return y

    x = jnp.arange(5.0)
    out = _run(fn, x)
    jax.effects_barrier()
    np.testing.assert_array_equal(out, x * 2.0)
    self.assertEqual([name for name, _ in seen], ["first", "second"])
    np.testing.assert_array_equal(seen[0][1], x)
    np.testing.assert_array_equal(seen[1][1], x * 2.0)

  def test_debug_callback_in_loop(self):
    seen = []

    def fn(x):
      def body(i, c):
        jax.debug.callback(lambda i: seen.append(int(i)), i, ordered=True)
        return c + 1.0
      return lax.fori_loop(0, 4, body, x)

    self.assert_same(fn, jnp.float32(0.0))
    jax.effects_barrier()
    self.assertEqual(seen[:4], [0, 1, 2, 3])


if __name__ == "__main__":
  absltest.main()
