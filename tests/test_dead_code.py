"""Dead-code elimination before lowering (``lowering/dead_code.py``).

What no output needs is neither lowered, costed nor refused (``jax.jit``
never runs it either): a program with dead work costs exactly what its twin
without it costs. Effects stay (prints and callbacks happen, with the values
they were given), and so does the program's signature. The report counts
what was removed.
"""

import contextlib
import io
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

import ipu_jax
from ipu_jax import ops
from ipu_jax.lowering.dead_code import DeadCode
from testing_utils import T16, random_array


def _lower(fn, *args, target=T16, **kwargs):
  return ipu_jax.jit(fn, target=target, **kwargs).lower(*args)


def _run_printing(lowered, *args):
  """(results read back, what the run printed), host callbacks flushed."""
  buffer = io.StringIO()
  with contextlib.redirect_stdout(buffer):
    out = jax.tree.map(np.asarray, lowered(*args))
    jax.effects_barrier()
  return out, buffer.getvalue()


@jax.custom_vjp
def _sin(x):
  return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (cos * g,))


class DeadWorkCostsNothingTest(chex.TestCase, parameterized.TestCase):

  def assert_same_program(self, dead, clean):
    """``dead``'s lowering costs and holds exactly what ``clean``'s does."""
    self.assertEqual(dead.report.total_cycles, clean.report.total_cycles)
    self.assertEqual(len(dead.profile.steps), len(clean.profile.steps))
    np.testing.assert_array_equal(dead.profile.memory.peak, clean.profile.memory.peak)

  def test_dead_matmul_chain(self):
    # The program: 256 x 256, an unused a @ a @ a.
    a = random_array((256, 256), seed=1)

    def dead(a):
      _ = a @ a @ a
      return jnp.tanh(a) * 2

    lowered = _lower(dead, a)
    self.assert_same_program(lowered, _lower(lambda a: jnp.tanh(a) * 2, a))
    self.assertEqual(lowered.dead_code, DeadCode(2, {"dot_general": 2}))
    chex.assert_trees_all_close(np.asarray(lowered(a)), np.asarray(jax.jit(dead)(a)),
                                rtol=1e-6, atol=1e-6)

  @parameterized.named_parameters(
      ("vector", (7,), jnp.float32), ("scalar", (), jnp.float32), ("empty", (0, 3), jnp.float32),
      ("matrix_f16", (5, 3), jnp.float16))
  def test_jvp_through_custom_vjp(self, shape, dtype):
    # jax.jvp leaves a custom_lin for the tangent; the primal alone is used.
    def f(x):
      y, _ = jax.jvp(_sin, (x,), (jnp.ones_like(x),))
      return y * 2

    x = random_array(shape, dtype, seed=2)
    lowered = _lower(f, x)
    got = np.asarray(lowered(x))
    chex.assert_trees_all_close(got, np.asarray(jax.jit(f)(x)), rtol=1e-3, atol=1e-3)
    self.assertEqual(lowered.dead_code.by_primitive.get("custom_lin"), 1)

  def test_live_custom_lin_is_refused_with_the_reason(self):
    f = lambda x: jax.jvp(_sin, (x,), (jnp.ones_like(x),))
    with self.assertRaisesRegex(ipu_jax.LoweringError,
                                r"custom_lin.*test_dead_code.py:\d+.*forward-mode"):
      _lower(f, jnp.ones(3))


def _nested_cases():
  """name -> (program with dead work inside a nested jaxpr, its clean twin, a
  primitive removed)."""
  helper = jax.jit(lambda v: (v @ v, v + 1))

  def scan_body(dead):
    def body(c, r):
      if dead:
        _ = c @ c
      return c + r, jnp.sin(r)
    return lambda v: lax.scan(body, v, v)

  def scan_carry(dead):
    def body(carry, r):
      return (carry[0] + r, carry[1] @ carry[1]) if dead else (carry[0] + r,), None
    return lambda v: lax.scan(body, (v, v) if dead else (v,), v)[0][0]

  def while_body(dead):
    def body(c):
      if dead:
        _ = jnp.exp(c[1]) @ c[1]
      return c[0] + 1, c[1] * 0.5
    return lambda v: lax.while_loop(lambda c: c[0] < 3, body, (0, v))[1]

  def cond_branch(dead):
    def yes(a):
      if dead:
        _ = a @ a
      return a + 1
    return lambda v: lax.cond(v[0, 0] > 0, yes, lambda a: a - 1, v)

  def remat(dead):
    return lambda v: jax.checkpoint(lambda a: (a @ a, jnp.sin(a)) if dead else (jnp.sin(a),))(v)[-1]

  def custom_jvp(dead):
    @jax.custom_jvp
    def f(a):
      return (jnp.sin(a), a @ a) if dead else (jnp.sin(a),)

    @f.defjvp
    def _(primals, tangents):
      return f(*primals), tuple(tangents[0] * jnp.cos(primals[0]) for _ in f(*primals))
    return lambda v: f(v)[0]

  def shard_map(dead):
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:1]), ("i",))
    body = (lambda v: (lax.psum(v @ v, "i"), v * 2)) if dead else (lambda v: (v * 2,))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P("i"),),
                           out_specs=(P(), P("i")) if dead else (P("i"),))
    return lambda v: mapped(v)[-1]

  return {
      "jit_helper": (lambda v: helper(v)[1], lambda v: jax.jit(lambda a: a + 1)(v),
                     "dot_general"),
      "scan_body": (scan_body(True), scan_body(False), "dot_general"),
      "scan_carry": (scan_carry(True), scan_carry(False), "dot_general"),
      "while_body": (while_body(True), while_body(False), "dot_general"),
      "cond_branch": (cond_branch(True), cond_branch(False), "dot_general"),
      "remat": (remat(True), remat(False), "dot_general"),
      "custom_jvp": (custom_jvp(True), custom_jvp(False), "dot_general"),
      "shard_map": (shard_map(True), shard_map(False), "dot_general"),
  }


_NESTED = _nested_cases()


class NestedDeadCodeTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(*[(name, name) for name in sorted(_NESTED)])
  def test_dead_work_inside(self, name):
    dead, clean, primitive = _NESTED[name]
    v = random_array((5, 5), seed=3) * 0.3
    lowered = _lower(dead, v)
    twin = _lower(clean, v)
    self.assertEqual(lowered.report.total_cycles, twin.report.total_cycles)
    self.assertEqual(len(lowered.profile.steps), len(twin.profile.steps))
    self.assertGreaterEqual(lowered.dead_code.by_primitive.get(primitive, 0), 1)
    self.assertEqual(twin.dead_code, DeadCode())
    chex.assert_trees_all_close(jax.tree.map(np.asarray, lowered(v)),
                                jax.tree.map(np.asarray, jax.jit(dead)(v)), rtol=1e-5, atol=1e-5)


class EffectsKeptTest(chex.TestCase, parameterized.TestCase):
  """Dead results of effectful operations: the effect happens, with its values."""

  def check(self, fn, x, printed, removed=DeadCode(1, {"dot_general": 1})):
    lowered = _lower(fn, x)
    out, text = _run_printing(lowered, x)
    # The dead product beside the effect is gone, the effect's operands not.
    self.assertEqual(lowered.dead_code, removed)
    self.assertEqual(text, printed)
    chex.assert_trees_all_close(out, np.asarray(jax.jit(fn)(x)), rtol=1e-6)

  def test_debug_print(self):
    x = jnp.arange(4.0)

    def fn(x):
      _ = jnp.dot(x, x)
      jax.debug.print("sum {s}", s=jnp.sum(x * 2))
      return x + 1

    self.check(fn, x, "sum 12.0\n")

  def test_debug_callback(self):
    x, seen = jnp.arange(4.0), []

    def fn(x):
      _ = jnp.dot(x, x)
      jax.debug.callback(lambda s: seen.append(float(s)), jnp.sum(x * 3))
      return x + 1

    self.check(fn, x, "")
    self.assertEqual(seen, [18.0, 18.0])  # the IPU's run, then jax.jit's

  def test_print_tensor_result_unused(self):
    x = jnp.arange(3.0)

    def fn(x):
      _ = ops.print_tensor(x * 2, "doubled")
      _ = jnp.dot(x, x)
      return x - 1

    self.check(fn, x, "doubled: [0.0000000 2.0000000 4.0000000]\n")

  def test_callback_in_unused_scan(self):
    # The scan's results are unused; its callbacks keep it, each iteration.
    x, seen = jnp.arange(6.0).reshape(3, 2), []

    def fn(x):
      def body(c, row):
        jax.debug.callback(lambda s: seen.append(float(s)), jnp.sum(row), ordered=True)
        _ = jnp.dot(row, row)
        return c + row, None
      lax.scan(body, jnp.zeros(2), x)
      return x * 2

    # The product, the carry nobody reads and its initial zeros.
    self.check(fn, x, "", DeadCode(3, {"add": 1, "broadcast_in_dim": 1, "dot_general": 1}))
    self.assertEqual(seen, [1.0, 5.0, 9.0] * 2)  # the IPU's run, then jax.jit's

  def test_io_callback_is_kept(self):
    # An I/O effect stays, unused result or not (so it is refused: no tile
    # rule for io_callback), where a pure callback's unused call goes.
    from jax.experimental import io_callback
    x = jnp.arange(3.0)

    def fn(x):
      _ = io_callback(lambda v: v, jax.ShapeDtypeStruct((3,), jnp.float32), x)
      return x + 1

    with self.assertRaisesRegex(ipu_jax.LoweringError, "io_callback"):
      _lower(fn, x)

  def test_unused_pure_callback_is_removed(self):
    x, calls = jnp.arange(3.0), []

    def fn(x):
      _ = jax.pure_callback(lambda v: calls.append(1) or v,
                            jax.ShapeDtypeStruct((3,), jnp.float32), x)
      return x + 1

    lowered = _lower(fn, x)
    self.assertEqual(lowered.dead_code, DeadCode(1, {"pure_callback": 1}))
    np.testing.assert_array_equal(np.asarray(lowered(x)), np.asarray(jax.jit(fn)(x)))
    self.assertEqual(calls, [])  # jax.jit does not call it either


class SignatureKeptTest(chex.TestCase):

  def test_unused_inputs_and_passed_through_outputs(self):
    x, w = random_array((4, 3), seed=4), random_array((3, 3), seed=5)

    def fn(x, unused, w):
      _ = w @ w
      return x + 1, w

    lowered = _lower(fn, x, jnp.float32(2), w)
    self.assertEqual(len(lowered.inputs), 3)
    self.assertEqual(len(lowered.outputs), 2)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, lowered(x, jnp.float32(2), w)),
                                jax.jit(fn)(x, jnp.float32(2), w))

  def test_offloaded_state_keeps_its_pairing(self):
    # Argument 1's leaves pair with output 1's: dead work on the state and an
    # offloaded leaf the update ignores must not shift the pairing.
    x = random_array((7, 13), seed=6)
    state = {"m": random_array((13, 21), seed=7), "unused": random_array((9, 17), seed=8)}

    def step(x, state, dead):
      if dead:
        _ = state["m"] @ state["m"].T
      m = state["m"] * 0.9 + jnp.sum(x)
      return x @ m, {"m": m, "unused": state["unused"]}

    kwargs = dict(offload_argnums=1, offload_outputs=1)
    lowered = _lower(lambda x, s: step(x, s, True), x, state, **kwargs)
    twin = _lower(lambda x, s: step(x, s, False), x, state, **kwargs)
    self.assertEqual(lowered.dead_code, DeadCode(2, {"dot_general": 1, "transpose": 1}))
    self.assertEqual(lowered.profile.streaming.total_bytes, twin.profile.streaming.total_bytes)
    self.assertEqual(lowered.report.total_cycles, twin.report.total_cycles)
    got = jax.tree.map(np.asarray, lowered(x, state))
    chex.assert_trees_all_close(got, jax.jit(lambda x, s: step(x, s, True))(x, state),
                                rtol=1e-5, atol=1e-5)


class PipelineDeadCodeTest(chex.TestCase):

  def test_dead_work_in_a_stage(self):
    from ipu_jax.ops import pipeline_stage
    import optax

    def loss(params, batch, dead):
      h = jnp.tanh(batch["x"] @ params[0])
      h = pipeline_stage(h, 1)
      if dead:
        _ = h @ h.T @ h
      h = jnp.tanh(h @ params[1])
      return jnp.mean((h - batch["y"]) ** 2)

    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.auto_select_ipus = 2
    cfg.training.gradient_accumulation_steps = 4
    params = [random_array((7, 7), seed=10) * 0.3, random_array((7, 7), seed=11) * 0.3]
    batches = {"x": random_array((4, 5, 7), seed=12), "y": random_array((4, 5, 7), seed=13)}
    results = {}
    for dead in (True, False):
      pipe = ipu_jax.pipelining.Pipeline(lambda p, b, d=dead: loss(p, b, d), optax.sgd(0.1),
                                         config=cfg)
      state = pipe.init(params, batches)
      out = pipe.step(params, state, batches)
      new_params, value = out.params, out.loss
      results[dead] = (jax.tree.map(np.asarray, new_params), np.asarray(value), pipe.report)
    chex.assert_trees_all_close(results[True][:2], results[False][:2], rtol=1e-6, atol=1e-7)
    dead_report, clean_report = results[True][2], results[False][2]
    self.assertEqual(dead_report.total_cycles, clean_report.total_cycles)
    removed = dead_report.program_report.dead_code
    self.assertGreaterEqual(removed.by_primitive.get("dot_general", 0), 2)
    self.assertEqual(clean_report.program_report.dead_code, DeadCode())


class DeadCodeReportTest(chex.TestCase):

  def test_counted_in_summary_json_and_saved_report(self):
    x = random_array((6, 5), seed=9)

    def fn(x):
      _ = jnp.tanh(x @ x.T)
      return x * 2

    report = _lower(fn, x).report
    expected = {"equations_removed": 3,
                "by_primitive": {"dot_general": 1, "tanh": 1, "transpose": 1}}
    self.assertEqual(report.to_dict()["dead_code"], expected)
    line = "Dead code removed:     3 equations (dot_general, tanh, transpose), not lowered"
    self.assertIn(line, report.summary())
    with tempfile.TemporaryDirectory() as directory:
      report.save(directory, plots=False, html=False)
      with open(os.path.join(directory, "report.json"), encoding="utf-8") as f:
        self.assertEqual(json.load(f)["dead_code"], expected)
      saved = ipu_jax.Report.load(directory)
    self.assertEqual(saved.dead_code, DeadCode(3, expected["by_primitive"]))
    self.assertIn(line, saved.summary())
    self.assertEqual(saved.to_dict()["dead_code"], expected)

  def test_nothing_dead(self):
    report = _lower(lambda x: x * 2, jnp.ones(3)).report
    self.assertEqual(report.dead_code, DeadCode())
    self.assertEqual(report.to_dict()["dead_code"], {"equations_removed": 0, "by_primitive": {}})
    self.assertNotIn("Dead code", report.summary())

  def test_report_without_the_entry(self):
    # A report.json written before dead code was counted.
    document = _lower(lambda x: x * 2, jnp.ones(3)).report.to_dict()
    del document["dead_code"]
    saved = ipu_jax.report.SavedReport(document)
    self.assertIsNone(saved.dead_code)
    self.assertNotIn("Dead code", saved.summary())


if __name__ == "__main__":
  absltest.main()
