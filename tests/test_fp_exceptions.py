"""Floating-point exceptions (floating_point_behaviour inv / div0 / oflo): the
program stops with an error naming the kind, the operation, the user's line,
the superstep and the loop iteration; nothing changes when they are off."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import IPUConfig


def _config(inv=True, div0=True, oflo=True):
  cfg = IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.floating_point_behaviour.inv = inv
  cfg.floating_point_behaviour.div0 = div0
  cfg.floating_point_behaviour.oflo = oflo
  return cfg


def _line(fn) -> str:
  """``file:line`` of the last line of ``fn``'s source (where its op is)."""
  lines, start = inspect.getsourcelines(fn)
  return f"{__file__}:{start + len(lines) - 1}"


def _sqrt(x):
  return jnp.sqrt(x - 2.0)


def _inf_minus_inf(x):
  y = jnp.exp(x * 100.0)   # inf where x >= 1 (not trapped in this case)
  return y - y


def _divide(x):
  return 1.0 / x


def _log(x):
  return jnp.log(jnp.abs(x))


def _exp(x):
  return jnp.exp(x * 100.0)


def _to_half(x):
  return (x * 40000.0).astype(jnp.float16)


def _half_add(x):
  h = (x * 20000.0).astype(jnp.float16)
  return h + h + h + h


class FloatingPointExceptionTest(chex.TestCase, parameterized.TestCase):

  # x has a zero, a negative and values > 1 (37 elements: padded storage rows).
  x = jnp.asarray(np.concatenate([[0.0, -1.0, 2.0], np.linspace(0.5, 1.5, 34)]), jnp.float32)

  @parameterized.parameters(
      (_sqrt, "inv", "sqrt"),
      (_inf_minus_inf, "inv", "sub", dict(oflo=False)),
      (_divide, "div0", "div"),
      (_log, "div0", "log"),
      (_exp, "oflo", "exp"),
      (_to_half, "oflo", "convert_element_type"),
      (_half_add, "oflo", "add"),
  )
  def test_names_kind_op_line_and_step(self, fn, kind, op, traps=None):
    f = ipu_jax.jit(fn, config=_config(**(traps or {})))
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      f(self.x)
    e = caught.exception
    self.assertIsInstance(e, FloatingPointError)
    self.assertEqual((e.kind, e.op, e.source), (kind, op, _line(fn)))
    self.assertIsNone(e.iteration)
    report_steps = f.lower(self.x).profile.steps
    self.assertEqual(report_steps[e.step_index].name, e.step_name)
    message = str(e)
    for part in (f"'{kind}'", f"in {op} at {_line(fn)}", f"superstep {e.step_index}",
                 f"floating_point_behaviour.{kind} is True"):
      self.assertIn(part, message)

  @parameterized.parameters(_sqrt, _divide, _exp, _half_add)
  def test_off_by_default_and_bit_exact_with_jax_jit(self, fn):
    cfg = IPUConfig()
    cfg.device.tiles_per_ipu = 16
    self.assertFalse(cfg.floating_point_behaviour.inv or cfg.floating_point_behaviour.div0
                     or cfg.floating_point_behaviour.oflo)
    got = np.asarray(ipu_jax.jit(fn, config=cfg)(self.x))
    want = np.asarray(jax.jit(fn)(self.x))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))

  def test_only_the_enabled_kinds_trap(self):
    # sqrt of a negative is invalid, not an overflow: with only oflo trapped
    # it runs, and its NaN result is jax.jit's.
    got = ipu_jax.jit(_sqrt, config=_config(inv=False, div0=False))(self.x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(jax.jit(_sqrt)(self.x)))
    # 1/0 without div0 is not reported as an overflow either.
    ipu_jax.jit(_divide, config=_config(div0=False))(self.x)

  def test_no_exception_from_padding_identities_or_masks(self):
    def model(x, y):
      q = x / y                                    # padded storage: 0/0 in the padding
      masked = jnp.where(x > 1.0, x, -jnp.inf)     # -inf as a value, not a result
      probs = jax.nn.softmax(masked)
      return q, probs, jnp.max(x), jnp.argmin(x), jnp.cumsum(q)
    x = jnp.linspace(0.5, 1.5, 37, dtype=jnp.float32)
    got = ipu_jax.jit(model, config=_config())(x, x + 1.0)
    chex.assert_trees_all_close(got, jax.jit(model)(x, x + 1.0), rtol=1e-6)

  @parameterized.named_parameters(
      ("times_inf", lambda x: x * jnp.inf),        # inf from an inf literal: no overflow
      ("plus_inf", lambda x: x + jnp.inf),
      ("divide_by_inf", lambda x: jnp.inf / (x + 3.0)),
      ("select_nan", lambda x: jnp.where(x > 1.0, jnp.nan, x)),  # a NaN value, not a result
      ("minus_nan", lambda x: x - jnp.nan),
  )
  def test_literal_operands_are_inputs(self, fn):
    # The literal is folded into the step's function, not read: it still
    # counts as an input, so what it carries is no exception of the step.
    x = jnp.linspace(0.5, 1.5, 37, dtype=jnp.float32)
    got = np.asarray(ipu_jax.jit(fn, config=_config())(x))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(fn)(x)))

  @parameterized.named_parameters(
      ("zero_times_inf", lambda x: x * jnp.inf, "inv", "mul"),   # x holds a 0: 0 * inf
      ("inf_minus_inf", lambda x: jnp.exp(x * 100.0) - jnp.inf, "inv", "sub"),
      ("divide_by_zero_literal", lambda x: (x + 1.0) / 0.0, "div0", "div"),
      ("overflow_by_literal", lambda x: x * 3.0e38, "oflo", "mul"),
  )
  def test_literal_operands_still_trap_what_the_step_makes(self, fn, kind, op):
    x = jnp.asarray([0.0, 2.0, 1.0], jnp.float32)
    traps = dict(oflo=False) if kind == "inv" else {}
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(fn, config=_config(**traps))(x)
    self.assertEqual((caught.exception.kind, caught.exception.op), (kind, op))

  def test_saturating_fp16_overflow_is_still_an_overflow(self):
    # nanoo=False: the cast saturates at 65504 instead of inf, and traps.
    cfg = _config()
    cfg.floating_point_behaviour.nanoo = False
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(_to_half, config=cfg)(self.x)
    self.assertEqual((caught.exception.kind, caught.exception.source), ("oflo", _line(_to_half)))
    cfg.floating_point_behaviour.oflo = False
    out = np.asarray(ipu_jax.jit(_to_half, config=cfg)(self.x), np.float32)
    self.assertEqual(out.max(), 65504.0)
    # 65519 still rounds to 65504: no overflow.
    small = ipu_jax.jit(lambda x: (x * 65519.0).astype(jnp.float16), config=_config())
    self.assertEqual(float(small(jnp.ones((3,), jnp.float32))[0]), 65504.0)

  def test_options_reach_the_lowering(self):
    options = _config(inv=True, div0=False, oflo=True).lowering_options()
    self.assertEqual((options.inv, options.div0, options.oflo), (True, False, True))

  def test_loop_iteration_is_named(self):
    def grow(x):
      return jax.lax.fori_loop(0, 12, lambda i, v: v * 1e4, x)
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(grow, config=_config())(jnp.full((5,), 1e3, jnp.float32))
    e = caught.exception
    # 1e3 * 1e4^k overflows float32 (3.4e38) first at k = 9: iteration 8.
    self.assertEqual((e.kind, e.op, e.iteration), ("oflo", "mul", 8))
    self.assertIn("loop iteration 8", str(e))

  def test_scan_and_while_loops_carry_the_first_exception(self):
    def scanned(x):
      def body(c, _):
        return c * 3.0, jnp.log(c - 100.0)          # invalid from the first step on
      return jax.lax.scan(body, x, None, length=4)
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(scanned, config=_config())(jnp.ones((3,), jnp.float32))
    self.assertEqual((caught.exception.kind, caught.exception.op), ("inv", "log"))
    self.assertEqual(caught.exception.iteration, 0)

    def until_big(x):
      return jax.lax.while_loop(lambda v: v[0] < 1e30, lambda v: v * 1e20, x)
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(until_big, config=_config())(jnp.asarray([1.0, 1e25], jnp.float32))
    self.assertEqual((caught.exception.kind, caught.exception.op), ("oflo", "mul"))

  def test_the_first_exception_is_reported(self):
    def two(x):
      a = jnp.sqrt(x - 10.0)       # inv first
      return a, jnp.exp(x * 1e3)   # then an overflow
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(two, config=_config())(jnp.ones((4,), jnp.float32))
    self.assertEqual((caught.exception.kind, caught.exception.op), ("inv", "sqrt"))

  def test_replica_that_raised_is_named(self):
    mesh = jax.sharding.AbstractMesh((2,), ("replicas",))
    spec = jax.sharding.PartitionSpec

    def per_replica(x):
      scale = 1.0 + jax.lax.axis_index("replicas").astype(jnp.float32) * 1e38
      return (x * scale * 10.0)[None]

    def f(x):
      return jax.shard_map(per_replica, mesh=mesh, in_specs=spec(),
                           out_specs=spec("replicas"))(x)
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      ipu_jax.jit(f, config=_config())(jnp.ones((8,), jnp.float32))
    self.assertEqual((caught.exception.kind, caught.exception.replica), ("oflo", 1))
    self.assertIn("replica 1", str(caught.exception))

  def test_traced_apply_raises_at_run_time(self):
    lowered = ipu_jax.jit(_divide, config=_config()).lower(self.x)
    with self.assertRaisesRegex(Exception, "Floating-point exception 'div0'"):
      jax.block_until_ready(jax.jit(lowered.apply)(self.x))
    np.testing.assert_array_equal(jax.jit(lowered.apply)(self.x + 10.0), 1.0 / (self.x + 10.0))

  @parameterized.parameters("inv", "div0", "oflo")
  def test_bad_value_names_the_field(self, field):
    cfg = IPUConfig()
    with self.assertRaisesRegex(
        TypeError, f"floating_point_behaviour.{field} must be a bool; got 'yes'"):
      setattr(cfg.floating_point_behaviour, field, "yes")
    self.assertIn("FloatingPointException", IPUConfig.help(f"floating_point_behaviour.{field}"))


if __name__ == "__main__":
  absltest.main()
