"""The cycle and memory models, observed through the graph API's reports."""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import graph as g


def _copy_engine(target, n, src_tile, dst_tile, dtype="float32"):
  gr = g.Graph(target)
  src = gr.add_variable(dtype, (n,), "src")
  dst = gr.add_variable(dtype, (n,), "dst")
  gr.set_tile_mapping(src, src_tile)
  gr.set_tile_mapping(dst, dst_tile)
  return g.Engine(gr, [g.Copy(src, dst)]), src, dst


class ExchangeCostTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(256, 1000, 4096)
  def test_bytes_to_one_tile_cost_bytes_over_four_plus_latency(self, n):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8)
    engine, _, _ = _copy_engine(target, n, 0, 5)
    step = engine.profile.steps[0]
    nbytes = 4 * n
    self.assertEqual(int(step.exchange_bytes_in[5]), nbytes)
    self.assertEqual(int(step.exchange_bytes_out[0]), nbytes)
    self.assertEqual(step.exchange_cycles, nbytes / 4 + target.exchange_latency_cycles)
    self.assertEqual(step.sync_cycles, target.sync_cycles_internal)

  def test_no_exchange_when_data_is_in_place(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=8)
    engine, _, _ = _copy_engine(target, 100, 3, 3)
    self.assertEqual(engine.profile.steps[0].exchange_cycles, 0.0)

  def test_crossing_ipus_pays_link_rate(self):
    target = ipu_jax.IPUTarget.preset("ipu2", num_ipus=2, tiles_per_ipu=8)
    n = 10_000
    same, _, _ = _copy_engine(target, n, 0, 5)
    cross, src, dst = _copy_engine(target, n, 0, 13)
    nbytes = 4 * n
    same_step, cross_step = same.profile.steps[0], cross.profile.steps[0]
    self.assertEqual(same_step.ipu_link_bytes, 0)
    self.assertEqual(cross_step.ipu_link_bytes, nbytes)
    link_cycles = nbytes / target.ipu_link_bytes_per_cycle
    self.assertAlmostEqual(cross_step.exchange_cycles - same_step.exchange_cycles, link_cycles)
    # Cost model 4: a sync across the 2 IPUs is the on-chip sync (90) plus
    # poplibs' IPUModel global sync signal (40 cycles at 1.33 GHz), as
    # pipelines pay, no longer the 1,500-cycle estimate that also priced
    # host syncs.
    self.assertEqual(cross_step.sync_cycles, target.ipu_sync_cycles(2))
    self.assertEqual(cross_step.sync_cycles, 90 + 40)
    cross.write_tensor(src, np.arange(n, dtype=np.float32))
    cross.run(0)
    np.testing.assert_array_equal(cross.read_tensor(dst), np.arange(n, dtype=np.float32))


class ComputeCostTest(chex.TestCase, parameterized.TestCase):

  def _vertices_engine(self, count, cycles=100):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4, supervisor_overhead_cycles=0)
    gr = g.Graph(target)
    x = gr.add_variable("float32", (count,), "x")
    gr.set_tile_mapping(x, 0)

    @g.codelet(inouts=("x",), cycles=cycles)
    def bump(x):
      return x + 1

    cs = gr.add_compute_set("bump")
    for i in range(count):
      gr.add_vertex(cs, bump, tile=0, x=x[i])
    return g.Engine(gr, [g.Execute(cs)]), x

  def test_twelve_vertices_cost_twice_six(self):
    six, _ = self._vertices_engine(6)
    twelve, x = self._vertices_engine(12)
    c6 = six.profile.steps[0].compute_phase_cycles
    c12 = twelve.profile.steps[0].compute_phase_cycles
    self.assertEqual(c6, 6 * 100)
    self.assertEqual(c12, 2 * c6)
    twelve.run(0)
    np.testing.assert_array_equal(twelve.read_tensor(x), np.ones(12))

  def test_unequal_vertices_busiest_context(self):
    # Seven vertices: the seventh shares a context; cost = (100 + 100) * 6.
    seven, _ = self._vertices_engine(7)
    self.assertEqual(seven.profile.steps[0].compute_phase_cycles, 1200)

  def test_phase_costs_slowest_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4, supervisor_overhead_cycles=0)
    gr = g.Graph(target)
    x = gr.add_variable("float32", (2,), "x")
    gr.set_tile_mapping(x[0], 0)
    gr.set_tile_mapping(x[1], 1)
    slow = g.codelet(inouts=("x",), cycles=90, name="slow")(lambda x: x)
    fast = g.codelet(inouts=("x",), cycles=10, name="fast")(lambda x: x)
    cs = gr.add_compute_set("mixed")
    gr.add_vertex(cs, slow, tile=0, x=x[0])
    gr.add_vertex(cs, fast, tile=1, x=x[1])
    step = g.Engine(gr, [g.Execute(cs)]).profile.steps[0]
    self.assertEqual(step.compute_phase_cycles, 540)
    self.assertEqual(step.compute_cycles[1], 60)

  def test_matmul_amp_rate(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
    x = jnp.ones((64, 256), jnp.float32)
    w = jnp.ones((256, 128), jnp.float32)
    f32 = ipu_jax.jit(lambda a, b: a @ b, target=target).lower(x, w).report
    f16 = ipu_jax.jit(lambda a, b: a @ b, target=target).lower(
        x.astype(jnp.float16), w.astype(jnp.float16)).report
    # fp16 runs on the AMP units at 4x the fp32 rate.
    self.assertLess(f16.compute_cycles, f32.compute_cycles)


class MemoryModelTest(chex.TestCase):

  def test_variable_larger_than_sram_on_one_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=4)
    n = target.bytes_per_tile // 4 + 1000
    gr = g.Graph(target)
    big = gr.add_variable("float32", (n,), "big_weights")
    gr.set_tile_mapping(big, 2)
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      g.Engine(gr, [g.Sequence()])
    err = caught.exception
    self.assertEqual(err.tile, 2)
    self.assertEqual(err.bytes_available, 638_976)
    self.assertGreaterEqual(err.bytes_needed, 4 * n)
    message = str(err)
    for text in ("tile 2", "big_weights", f"{4 * n:,d}", "638,976", "allow_out_of_memory"):
      self.assertIn(text, message)
    engine = g.Engine(gr, [g.Sequence()], allow_out_of_memory=True)
    report = engine.report()
    self.assertEqual(list(report.over_limit_tiles), [2])
    self.assertIn("OUT OF MEMORY", report.summary())
    with self.assertRaisesRegex(RuntimeError, "allow_out_of_memory"):
      engine.run(0)

  def test_liveness_reuses_memory(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)

    def chain(x):
      for _ in range(6):
        x = jnp.sin(x)
      return x

    x = jnp.ones(20_000, jnp.float32)
    report = ipu_jax.jit(chain, target=target).lower(x).report
    memory = report.profile.memory
    # Only two 80 KB temporaries are live at once, not six (the result is one
    # of them, kept to the end); the argument is the one variable.
    self.assertLessEqual(int(memory.by_category["temporaries"][0]), 2 * 80_000)
    self.assertEqual(int(memory.by_category["variables"][0]), 80_000)

  def test_jit_out_of_memory_names_operation(self):
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    x = jnp.ones(200_000, jnp.float32)
    f = ipu_jax.jit(lambda x: jnp.exp(x) + 1.0, target=target)
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      f.lower(x)
    self.assertIn("tile 0", str(caught.exception))
    self.assertIn("exp", str(caught.exception))


if __name__ == "__main__":
  absltest.main()
