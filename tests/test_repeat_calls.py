"""A loop's calls of one ``ipu_jax.jit`` function: the third call on takes ``jax.jit``'s dispatch.

A program called twice in a row is called straight through ``jax.jit``'s
dispatcher from then on (``Compiled.call_tree``), as a ``Compiled`` is from its
second call; everything a user sees must be as on the first calls' path: the
numbers, the device state carried from call to call, trapped exceptions, new
shapes, weak types and config changes finding their own programs, bad
arguments named, and calls inside JAX transformations.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


def _config(**floating_point):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  for name, value in floating_point.items():
    setattr(cfg.floating_point_behaviour, name, value)
  return cfg


def _step(params, x):
  h = jnp.tanh(x @ params["w"] + params["b"])
  return {"w": params["w"] - 0.1 * h.T @ x, "b": params["b"] - 0.1 * h.sum(0)}, h.mean()


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"w": jax.device_put(rng.normal(size=(7, 7)).astype(np.float32)),
          "b": jax.device_put(rng.normal(size=(7,)).astype(np.float32))}


def _batch(rows, seed):
  return jax.device_put(np.random.default_rng(seed).normal(size=(rows, 7)).astype(np.float32))


class RepeatCallTest(chex.TestCase, parameterized.TestCase):

  def test_a_training_loop_equals_jax_jit_step_by_step(self):
    emulated, plain = ipu_jax.jit(_step, target=_T16), jax.jit(_step)
    got = want = _params()
    for i in range(6):
      x = _batch(5, seed=i)
      (got, got_loss), (want, want_loss) = emulated(got, x), plain(want, x)
      chex.assert_trees_all_close((got, got_loss), (want, want_loss), rtol=1e-5, atol=1e-6)
      np.asarray(got_loss)
    self.assertEqual(emulated.cache_size, 1)
    # Every call after the first is counted as a run of the one program.
    host = emulated.lower(got, x).host
    self.assertEqual(host.calls, 5)
    self.assertGreater(host.call_seconds, 0)

  @parameterized.named_parameters(
      ("alternating", [5, 3, 5, 3, 5, 3]),
      ("a_loop_then_a_last_short_batch", [5, 5, 5, 5, 3, 5, 5, 5]),
      ("back_and_forth_after_loops", [5, 5, 5, 3, 3, 3, 5, 5, 3]))
  def test_new_shapes_find_their_own_programs(self, rows):
    emulated, plain = ipu_jax.jit(_step, target=_T16), jax.jit(_step)
    params = _params()
    for i, n in enumerate(rows):
      x = _batch(n, seed=i)
      chex.assert_trees_all_close(emulated(params, x), plain(params, x), rtol=1e-5, atol=1e-6)
    self.assertEqual(emulated.cache_size, len(set(rows)))

  def test_a_new_tree_or_dtype_is_refused_or_lowered_as_on_the_first_call(self):
    f = lambda p, x: (p["w"] * x).sum()  # noqa: E731
    emulated = ipu_jax.jit(f, target=_T16)
    p, x = {"w": jnp.arange(4.0)}, jnp.ones(4)
    for _ in range(3):
      np.testing.assert_array_equal(np.asarray(emulated(p, x)), np.asarray(jax.jit(f)(p, x)))
    # Another dtype: a program of its own, as jax.jit's.
    x16 = jnp.ones(4, jnp.float16)
    got, want = emulated(p, x16), jax.jit(f)(p, x16)
    self.assertEqual(got.dtype, want.dtype)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    self.assertEqual(emulated.cache_size, 2)
    # A bad argument gets the first call's error, whichever path was taken before.
    fresh = ipu_jax.jit(f, target=_T16)
    for function in (emulated, fresh):
      with self.assertRaises(TypeError) as caught:
        function(p, "not an array")
      if function is emulated:
        loop_message = str(caught.exception)
      else:
        self.assertEqual(str(caught.exception), loop_message)

  def test_a_weakly_typed_argument_promotes_as_in_jax_jit(self):
    # A Python float is weakly typed: added to bfloat16 it stays bfloat16,
    # where a float32 array promotes the sum to float32.
    f = lambda x, y: x + y  # noqa: E731
    emulated = ipu_jax.jit(f, target=_T16)
    y = jnp.arange(3, dtype=jnp.bfloat16)
    for x in (jnp.float32(2.0), jnp.float32(3.0), jnp.float32(4.0), 5.0, 6.0, 7.0,
              jnp.float32(8.0)):
      got, want = emulated(x, y), jax.jit(f)(x, y)
      self.assertEqual(got.dtype, want.dtype)
      np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

  def test_stochastic_rounding_continues_as_on_the_first_calls_path(self):
    f = lambda x: x.astype(jnp.float16)  # noqa: E731
    x = jax.device_put(np.random.default_rng(1).normal(size=(37, 29)).astype(np.float32))
    looped = ipu_jax.jit(f, config=_config(esr="ON", seed=3))
    # The reference threads the generators' state through a pure function.
    compiled = ipu_jax.jit(f, config=_config(esr="ON", seed=3)).lower(x).compile()
    step, state = jax.jit(compiled.apply_with_state), compiled.device_state
    draws = []
    for _ in range(5):
      want, state = step(state, x)
      got, want = np.asarray(looped(x)), np.asarray(want)
      np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
      draws.append(got.view(np.uint16))
    self.assertTrue((draws[3] != draws[4]).any())
    looped.set_seed()
    np.testing.assert_array_equal(np.asarray(looped(x)).view(np.uint16), draws[0])

  def test_a_compiled_program_in_a_loop_still_names_a_bad_argument(self):
    compiled = ipu_jax.jit(_step, target=_T16).lower(_params(), _batch(5, 0)).compile()
    got = want = _params()
    for i in range(3):
      x = _batch(5, i)
      (got, got_loss), (want, want_loss) = compiled(got, x), jax.jit(_step)(want, x)
      chex.assert_trees_all_close((got, got_loss), (want, want_loss), rtol=1e-5, atol=1e-6)
    with self.assertRaisesRegex(TypeError, r"args\[1\] was lowered as f32\[5,7\] and is now "
                                r"f32\[4,7\]"):
      compiled(got, _batch(4, 0))
    # A Python scalar where a 0-d array was lowered: accepted, as by jax.stages.Compiled.
    scale = ipu_jax.jit(lambda x, s: x * s, target=_T16).lower(jnp.ones(3), jnp.float32(2)).compile()
    for s in (jnp.float32(2), jnp.float32(3), 4.0):
      np.testing.assert_array_equal(np.asarray(scale(jnp.ones(3), s)), np.full(3, s, np.float32))

  def test_a_python_scalar_in_a_loop_is_traced_once(self):
    # The strongly typed executor refuses a weakly typed scalar while tracing,
    # and jax.jit keeps no failed trace: a loop passing a Python float (a
    # learning rate) paid two refused traces a call (2.7 ms against 40 us).
    traces = []

    def listener(event, duration, **kw):
      del duration, kw
      if event == "/jax/core/compile/jaxpr_trace_duration":
        traces.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    self.addCleanup(jax.monitoring.unregister_event_duration_listener, listener)
    scale = ipu_jax.jit(lambda x, s: x * s, target=_T16).lower(jnp.ones(3), jnp.float32(2)).compile()
    np.asarray(scale(jnp.ones(3), jnp.float32(2)))
    np.asarray(scale(jnp.ones(3), 3.0))
    before = len(traces)
    for s in (4.0, 5.0, jnp.float32(6), 7.0):
      np.testing.assert_array_equal(np.asarray(scale(jnp.ones(3), s)), np.full(3, s, np.float32))
    self.assertEqual(len(traces), before)

  def test_a_program_over_a_tiles_memory_runs_on_no_path(self):
    cfg = ipu_jax.IPUConfig()
    cfg.memory.allow_out_of_memory = True
    tiny = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=2)
    x = jnp.ones(400_000)
    compiled = ipu_jax.jit(lambda v: v * 2, target=tiny, config=cfg).lower(x).compile()
    for run in (lambda: compiled(x), lambda: compiled.call_flat([x]),
                lambda: compiled.call_tree((x,), {})):
      with self.assertRaisesRegex(RuntimeError, "allow_out_of_memory"):
        run()

  def test_a_trapped_exception_is_raised_on_a_repeat_call(self):
    f = lambda x, y: x / y  # noqa: E731
    emulated = ipu_jax.jit(f, config=_config(div0=True, inv=True, oflo=True))
    x = jnp.arange(1.0, 6.0)
    for _ in range(3):
      np.testing.assert_array_equal(np.asarray(emulated(x, x + 1)), np.asarray(x / (x + 1)))
    with self.assertRaises(ipu_jax.FloatingPointException) as caught:
      emulated(x, x.at[2].set(0.0))
    self.assertEqual(caught.exception.kind, "div0")
    np.testing.assert_array_equal(np.asarray(emulated(x, x + 2)), np.asarray(x / (x + 2)))

  def test_a_config_change_between_calls_lowers_again(self):
    cfg = _config()
    f = lambda a, b: a @ b  # noqa: E731
    emulated = ipu_jax.jit(f, config=cfg)
    a, b = _batch(64, 0).reshape(7, 64), _batch(64, 1)
    for _ in range(3):
      chex.assert_trees_all_close(emulated(a, b), jax.jit(f)(a, b), rtol=1e-5)
    cycles = emulated.lower(a, b).report.total_cycles
    cfg.device.tiles_per_ipu = 8
    chex.assert_trees_all_close(emulated(a, b), jax.jit(f)(a, b), rtol=1e-5)
    self.assertEqual(emulated.cache_size, 2)
    self.assertNotEqual(emulated.lower(a, b).report.total_cycles, cycles)

  def test_calls_inside_transformations_after_a_loop(self):
    f = lambda x: jnp.sin(x) * 2.0  # noqa: E731
    emulated = ipu_jax.jit(f, target=_T16)
    x = jnp.linspace(-1.0, 1.0, 11)
    for _ in range(3):
      np.testing.assert_array_equal(np.asarray(emulated(x)), np.asarray(jax.jit(f)(x)))
    xs = jnp.stack([x, 2 * x])
    chex.assert_trees_all_close(jax.vmap(emulated)(xs), jax.vmap(f)(xs), rtol=1e-6)
    chex.assert_trees_all_close(jax.jit(lambda v: emulated(v) + 1)(x), f(x) + 1, rtol=1e-6)
    chex.assert_trees_all_close(jax.grad(lambda v: emulated(v).sum())(x), 2 * jnp.cos(x),
                                rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(emulated(x)), np.asarray(jax.jit(f)(x)))


if __name__ == "__main__":
  absltest.main()
