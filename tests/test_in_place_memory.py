"""A result written over a dying operand takes its memory (16 tiles).

docs/cost_model.md#the-memory-model: Poplar's map operations have in-place
forms (``popops::mapInPlace``, ``addInPlace``...), its updates write into
their base (``dynamicUpdate``, ``multiUpdate(Add)``), and PopART's inplacing
transform and TensorFlow-IPU's in-place pass choose them wherever nothing
reads the operand later. The memory analysis models that on the fused
program: one buffer where the operand dies and the result is born, never
where the operand is read later, is an output, or differs in dtype or layout.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
import testing_utils

_N = 1024  # 64 elements per tile on 16 tiles


def _profile(fn, *args, fuse=True):
  cfg = ipu_jax.IPUConfig()
  cfg.fusion.elementwise = fuse
  cfg.report.progress = False
  f = ipu_jax.jit(fn, target=testing_utils.T16, config=cfg)
  # The numbers are jax.jit's: sharing memory changes no value.
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, f(*args)),
               jax.tree.map(np.asarray, jax.jit(fn)(*args)))
  return f.lower(*args).profile


def _temporaries(profile):
  return profile.memory.by_category["temporaries"]


def _x(dtype=np.float32):
  return jnp.asarray(np.random.default_rng(0).uniform(-2, 2, size=(_N,)).astype(dtype))


class InPlaceMemoryTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(np.float32, np.float16)
  def test_a_chain_of_steps_holds_one_buffer(self, dtype):
    # Unfused: exp -> a, sin(a) -> b over a, b * 3 -> c over b.
    profile = _profile(lambda x: jnp.sin(jnp.exp(x)) * 3, _x(dtype), fuse=False)
    self.assertLen(profile.steps, 3)
    per_tile = 64 * np.dtype(dtype).itemsize
    np.testing.assert_array_equal(_temporaries(profile), np.full(16, per_tile))

  def test_an_operand_read_later_keeps_its_own_memory(self):
    # a is read again after sin(a): b cannot take it; a * b then takes one
    # of them, so two buffers at most.
    def fn(x):
      a = jnp.exp(x)
      b = jnp.sin(a)
      return a * b
    profile = _profile(fn, _x(), fuse=False)
    np.testing.assert_array_equal(_temporaries(profile), np.full(16, 2 * 256))

  def test_an_output_is_never_written_over(self):
    def fn(x):
      a = jnp.exp(x)
      return a, jnp.sin(a)
    profile = _profile(fn, _x(), fuse=False)
    np.testing.assert_array_equal(_temporaries(profile), np.full(16, 2 * 256))

  def test_a_cast_needs_a_buffer_of_its_own(self):
    # exp's float32 result and its float16 cast differ in bytes: both live.
    profile = _profile(lambda x: jnp.exp(x).astype(jnp.float16), _x(), fuse=False)
    np.testing.assert_array_equal(_temporaries(profile), np.full(16, 256 + 128))

  def test_fused_and_unfused_hold_the_same_peak(self):
    def fn(x):
      a, b = jnp.exp(x), jnp.cos(x)
      return jnp.tanh(a * b) + a
    on, off = _profile(fn, _x()), _profile(fn, _x(), fuse=False)
    self.assertLen(on.steps, 1)
    np.testing.assert_array_equal(_temporaries(on), _temporaries(off))

  def test_a_streamed_moment_is_updated_in_the_buffer_it_was_loaded_into(self):
    # m comes from streaming memory into a buffer of its own (its own layout
    # object, equal to g's layout); 0.9 m + 0.1 g is written over it and
    # stored back: g * 2 (an output) and one buffer of m, not two.
    rng = np.random.default_rng(2)
    g, m = (jnp.asarray(rng.normal(size=(_N,)), jnp.float32) for _ in range(2))
    fn = lambda g, m: (g * 2, 0.9 * m + 0.1 * g)
    cfg = ipu_jax.IPUConfig()
    cfg.report.progress = False
    f = ipu_jax.jit(fn, target=testing_utils.T16, config=cfg, offload_argnums=1,
                    offload_outputs=1)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, f(g, m)),
                 jax.tree.map(np.asarray, jax.jit(fn)(g, m)))
    profile = f.lower(g, m).profile
    self.assertEqual([s.op for s in profile.steps], ["RemoteCopy", "fusion", "RemoteCopy"])
    np.testing.assert_array_equal(_temporaries(profile), np.full(16, 2 * 256))

  @parameterized.named_parameters(
      ("dynamic_update_slice",
       lambda y, u, i: lax.dynamic_update_slice(y, u, (i,))),
      ("scatter_add", lambda y, u, i: y.at[i + jnp.arange(8)].add(u)),
      ("scatter", lambda y, u, i: y.at[i + jnp.arange(8)].set(u)))
  def test_an_update_writes_into_its_dying_base(self, update):
    # popops' dynamicUpdate and multiUpdate(Add) write into their base: the
    # updated exp(x) takes exp(x)'s memory where nothing reads exp(x) later.
    u = jnp.asarray(np.random.default_rng(3).normal(size=(8,)), jnp.float32)
    fn = lambda x, u, i: update(jnp.exp(x), u, i)
    profile = _profile(fn, _x(), u, jnp.int32(100), fuse=False)
    base, = [t for t in profile.tensors if t.op == "exp"]
    out, = [t for t in profile.tensors if t.category == "temporaries" and t.op != "exp"
            and t.shape == (_N,)]
    self.assertEqual(out.live_from, base.live_to + 1)
    # One buffer of 256 B a tile and the small index arithmetic, not two.
    self.assertLess(_temporaries(profile).max(), 2 * 256)

  def test_an_update_keeps_a_base_read_later(self):
    u = jnp.asarray(np.random.default_rng(3).normal(size=(8,)), jnp.float32)

    def fn(x, u):
      y = jnp.exp(x)
      return lax.dynamic_update_slice(y, u, (100,)) + y
    profile = _profile(fn, _x(), u, fuse=False)
    self.assertGreaterEqual(_temporaries(profile).max(), 2 * 256)

  def test_a_matmul_result_is_taken_by_its_activation(self):
    # The fused tanh(h) * 2 reads the matmul's h last: one buffer of [64, 48]
    # float32 where h dies, and the tensors' live ranges say so.
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32, 48)), jnp.float32)
    cfg = ipu_jax.IPUConfig()
    cfg.report.progress = False
    fn = lambda x, w: jnp.tanh(x @ w) * 2
    f = ipu_jax.jit(fn, target=testing_utils.T16, config=cfg)
    chex.assert_trees_all_close(np.asarray(f(x, w)), np.asarray(jax.jit(fn)(x, w)),
                                rtol=1e-5, atol=1e-5)
    profile = f.lower(x, w).profile
    temps = [t for t in profile.tensors if t.category == "temporaries"]
    h, = [t for t in temps if t.op == "dot_general" and t.shape == (64, 48)]
    out, = [t for t in temps if t.op == "fusion" or t.op == "mul"]
    np.testing.assert_array_equal(h.tiles, out.tiles)
    self.assertEqual(out.live_from, h.live_to + 1)
    # Every step: the tensors' live ranges add up to the analysis' live bytes.
    live = np.zeros(len(profile.steps))
    for t in temps:
      live[t.live_from:t.live_to + 1] += t.total_bytes
    always = sum(int(profile.memory.by_category[c].sum())
                 for c in ("variables", "constants", "vertex_state", "code"))
    working = np.array([0 if s.temporary_bytes is None else int(s.temporary_bytes.sum())
                        for s in profile.steps])
    np.testing.assert_array_equal(live + working + always,
                                  np.asarray(profile.memory.live_over_program))


if __name__ == "__main__":
  absltest.main()
