"""Host memory a lowered program holds: per-tile figures, plans and fused members."""

import gc

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import plan_cache


def _mlp_loss(params, x):
  for w in params:
    x = jnp.tanh(x @ w) * 0.5 + x
  return jnp.mean(x * x)


def _step(params, x):
  grads = jax.grad(_mlp_loss)(params, x)
  return [w - 0.1 * g for w, g in zip(params, grads)]


def _held_array_bytes(root) -> int:
  """Bytes of the distinct NumPy arrays reachable from ``root`` (objects, containers)."""
  seen, total, stack = set(), 0, [root]
  while stack:
    obj = stack.pop()
    if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, type)):
      continue
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
      base = obj if obj.base is None else obj.base
      if id(base) not in seen or base is obj:
        seen.add(id(base))
        total += getattr(base, "nbytes", 0)
      continue
    if isinstance(obj, dict):
      stack.extend(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
      stack.extend(obj)
    elif not callable(obj) or hasattr(obj, "__dataclass_fields__"):
      stack.extend(getattr(obj, "__dict__", {}).values())
      stack.extend(getattr(obj, s) for s in getattr(type(obj), "__slots__", ())
                   if hasattr(obj, s))
  return total


class HostMemoryTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    # Inputs drawn with NumPy: jax.random would compile a sampler per shape.
    rng = np.random.default_rng(0)
    self.params = list(jnp.asarray(rng.normal(size=(3, 48, 48)) * 0.1, jnp.float32))
    self.x = jnp.asarray(rng.normal(size=(20, 48)), jnp.float32)

  def test_plan_tables_are_empty_after_lowering(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    fn = ipu_jax.jit(_step, target=target)
    fn.lower(self.params, self.x)
    self.assertEqual(plan_cache.held_bytes(), 0)
    chex.assert_trees_all_close(fn(self.params, self.x), jax.jit(_step)(self.params, self.x),
                                rtol=1e-5, atol=1e-6)

  def test_per_tile_figures_cost_a_few_bytes_per_tile_and_step(self):
    # 2 Bow IPUs: 2,944 tiles, so the per-tile arrays dominate what the
    # program and its profile hold. Each superstep keeps its compute
    # cycles, vertices, exchange bytes (in and out) and working memory per
    # tile, once, in 4-byte words (20 bytes), plus the tensors' per-row
    # layouts; 8-byte words or a second copy in the profile were over 40.
    target = ipu_jax.IPUTarget.preset("bow", num_ipus=2)
    lowered = ipu_jax.jit(_step, target=target).lower(self.params, self.x)
    held = _held_array_bytes((lowered.program, lowered.profile))
    per_tile_step = held / (len(lowered.profile.steps) * target.num_tiles)
    self.assertLess(per_tile_step, 30, f"{held} bytes held for {len(lowered.profile.steps)} "
                    f"steps on {target.num_tiles} tiles")

  @parameterized.parameters(False, True)
  def test_fused_members_keep_what_runs_not_what_it_costs(self, trap):
    config = ipu_jax.IPUConfig()
    config.floating_point_behaviour.inv = trap
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    fn = ipu_jax.jit(lambda x: jnp.sqrt(jnp.tanh(x) + 1.5) - x, target=target, config=config)
    lowered = fn.lower(self.x)
    members = [f.step for s in lowered.profile.steps for f in s.fused_ops]
    self.assertLen(members, 4)
    for step in members:
      self.assertIsNotNone(step.fn)
      self.assertEqual((step.compute_cycles, step.exchange, step.vertices, step.scratch_bytes),
                       (None,) * 4)
    chex.assert_trees_all_close(fn(self.x), jnp.sqrt(jnp.tanh(self.x) + 1.5) - self.x)



class CycleCollectionTest(chex.TestCase):
  """The cycle collector is off while a program is traced and lowered, as it was after."""

  def setUp(self):
    super().setUp()
    self.target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    self.x = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    self.addCleanup(gc.enable)

  def _traced_with(self, fn):
    seen = []

    def f(x):
      seen.append(gc.isenabled())
      return fn(x)
    return seen, ipu_jax.jit(f, target=self.target)

  def test_paused_while_lowering_and_restored(self):
    seen, fn = self._traced_with(lambda x: jnp.tanh(x) @ x.T)
    np.testing.assert_allclose(np.asarray(fn(self.x)), np.tanh(self.x) @ np.asarray(self.x).T,
                               rtol=1e-5)
    self.assertEqual(seen, [False])
    self.assertTrue(gc.isenabled())

  def test_restored_when_tracing_fails(self):
    def fails(x):
      raise ValueError("user error")
    seen, fn = self._traced_with(fails)
    with self.assertRaisesRegex(ValueError, "user error"):
      fn.lower(self.x)
    self.assertEqual(seen, [False])
    self.assertTrue(gc.isenabled())

  def test_left_off_when_the_caller_switched_it_off(self):
    gc.disable()
    seen, fn = self._traced_with(lambda x: x * 2.0)
    np.testing.assert_allclose(np.asarray(fn(self.x)), 2 * np.asarray(self.x))
    self.assertEqual(seen, [False])
    self.assertFalse(gc.isenabled())


if __name__ == "__main__":
  absltest.main()
