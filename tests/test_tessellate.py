"""ipu_jax.tessellate: the TessellateIPU API on the emulated IPU (docs/tessellate.md)."""

import os
import shutil
import sys
import tempfile
from functools import partial
from unittest import mock

from absl.testing import absltest, parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import tessellate as T
from ipu_jax.tessellate.linalg import ipu_eigh, ipu_hessenberg, ipu_qr

import testing_utils as tu


def _target(tiles):
  return ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=max(16, tiles))


def _symmetric(n, seed=0):
  m = np.random.default_rng(seed).normal(size=(n, n)).astype(np.float32)
  return (m + m.T) / 2


class TileMapTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(lax.exp_p, lax.abs_p, lax.neg_p)
  def test_tile_map_unary_equals_jax(self, prim):
    x = tu.random_array((3, 5, 4))
    fn = lambda a: T.tile_map(prim, T.tile_put_sharded(a, (2, 7, 9))).array
    tu.assert_matches_jit(fn, x)

  def test_tile_map_binary_and_reduction_equal_jax(self):
    x, y = tu.random_array((4, 6), seed=1), tu.random_array((6,), seed=2)

    def fn(a, b):
      a = T.tile_put_sharded(a, (0, 5, 10, 15))
      b = T.tile_put_replicated(b, a.tiles)
      s = T.tile_map(lax.mul_p, a, b)
      return T.tile_map(lax.reduce_sum_p, s, axes=(0,)).array
    tu.assert_matches_jit(fn, x, y)

  def test_tile_map_returns_sharded_arrays_on_the_tiles(self):
    out = ipu_jax.jit(lambda a: T.tile_map(lax.abs_p, T.tile_put_sharded(a, (3, 4, 5))),
                      target=tu.T16)(-np.ones((3, 2), np.float32))
    self.assertIsInstance(out, T.TileShardedArray)
    self.assertEqual(out.tiles, (3, 4, 5))
    np.testing.assert_array_equal(np.asarray(out), np.ones((3, 2)))

  def test_vertex_primitive_runs_its_impl_and_perf_estimate(self):
    prim = T.create_ipu_tile_primitive("twice", "TwiceVertex<{x}>", inputs=["x"],
                                       outputs={"y": 0}, perf_estimate=123)
    prim.def_impl(lambda x: 2 * x)
    fn = ipu_jax.jit(lambda a: T.tile_map(prim, T.tile_put_sharded(a, (1, 2))).array,
                     target=tu.T16)
    np.testing.assert_array_equal(np.asarray(fn(np.ones((2, 3), np.float32))), 2 * np.ones((2, 3)))
    step = [s for s in fn.lower(np.ones((2, 3), np.float32)).profile.steps
            if "TwiceVertex<float>" in str(s.codelets)]
    self.assertLen(step, 1)
    self.assertEqual(step[0].compute_cycles[1], step[0].compute_cycles[2])
    self.assertGreaterEqual(step[0].compute_cycles[1], 123)


_SCALE_VERTEX = """
#include <poplar/Vertex.hpp>
using namespace poplar;
template <typename T>
class ScaleVertex : public Vertex {
 public:
  Input<Vector<T>> x;
  Output<Vector<T>> y;
  float k;
  bool compute() {
    for (unsigned i = 0; i < x.size(); ++i) y[i] = k * x[i];
    return true;
  }
};
template class ScaleVertex<float>;
"""


class CppVertexTest(chex.TestCase):

  @absltest.skipIf(shutil.which("g++") is None, "needs g++ to compile the C++ vertex")
  def test_tile_map_runs_the_cpp_vertex_of_gp_filename(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "scale_vertex.cpp")
      with open(path, "w", encoding="utf-8") as f:
        f.write(_SCALE_VERTEX)
      prim = T.create_ipu_tile_primitive("scale_cpp", "ScaleVertex<{x}>", inputs=["x"],
                                         outputs={"y": 0}, gp_filename=path, perf_estimate=40)
      x = np.arange(12, dtype=np.float32).reshape(3, 4)
      fn = ipu_jax.jit(lambda a: T.tile_map(prim, T.tile_put_sharded(a, (1, 5, 9)), k=3.0).array,
                       target=tu.T16)
      np.testing.assert_array_equal(np.asarray(fn(x)), 3 * x)

  @absltest.skipIf(shutil.which("g++") is None, "needs g++ to compile the C++ vertex")
  def test_a_vertex_including_tile_constants_compiles_and_reads_ctxt_workers(self):
    # pyscf-ipu's compute_indices.cpp includes "poplar/TileConstants.hpp".
    source = _SCALE_VERTEX.replace("#include <poplar/Vertex.hpp>",
                                   "#include <poplar/Vertex.hpp>\n"
                                   "#include \"poplar/TileConstants.hpp\"")
    source = source.replace("y[i] = k * x[i]", "y[i] = CTXT_WORKERS * x[i]")
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "workers_vertex.cpp")
      with open(path, "w", encoding="utf-8") as f:
        f.write(source)
      prim = T.create_ipu_tile_primitive("workers_cpp", "ScaleVertex<{x}>", inputs=["x"],
                                         outputs={"y": 0}, gp_filename=path, perf_estimate=40)
      x = np.arange(8, dtype=np.float32).reshape(2, 4)
      fn = ipu_jax.jit(lambda a: T.tile_map(prim, T.tile_put_sharded(a, (1, 5)), k=1.0).array,
                       target=tu.T16)
      np.testing.assert_array_equal(np.asarray(fn(x)), tu.T16.worker_contexts * x)


class PlacementTest(chex.TestCase):

  def test_tile_put_sharded_places_shard_i_on_tile_i(self):
    tiles = (9, 2, 14)
    lowered = ipu_jax.jit(lambda a: T.tile_put_sharded(a, tiles).array,
                          target=tu.T16).lower(np.zeros((3, 8), np.float32))
    placed = [t for t in lowered.profile.tensors if t.name == "tile_put_sharded"]
    self.assertLen(placed, 1)
    self.assertEqual(sorted(placed[0].tiles.tolist()), sorted(tiles))
    np.testing.assert_array_equal(placed[0].bytes_on_tile, [32, 32, 32])

  def test_tile_gather_moves_slices(self):
    x = tu.random_array((4, 3))
    got = ipu_jax.jit(lambda a: T.tile_gather(T.tile_put_sharded(a, (0, 1, 2, 3)),
                                              (0, 2, 3, 1), (4, 5, 6, 7)).array,
                      target=tu.T16)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(x)[[0, 2, 3, 1]])

  def test_tile_outside_target_is_an_error_before_running(self):
    fn = ipu_jax.jit(lambda a: T.tile_put_sharded(a, (3, 16)).array, target=tu.T16)
    with self.assertRaisesRegex(Exception, "tile 16 is outside the target.*16 tiles"):
      fn.lower(np.zeros((2, 4), np.float32))

  def test_shards_and_tiles_mismatch_is_an_error(self):
    with self.assertRaisesRegex(ValueError, "3 shards but 2 tiles"):
      T.tile_put_sharded(np.zeros((3, 4), np.float32), (0, 1))

  def test_tile_ids_and_mapped_function_of_the_wrong_kind(self):
    # A float id was truncated (0.5 -> tile 0), a string parsed digit by digit.
    with self.assertRaisesRegex(TypeError, r"tile ids must be integers; got \[0.5, 1\]"):
      T.tile_put_sharded(np.zeros((2, 4), np.float32), [0.5, 1])
    x = T.tile_put_sharded(np.zeros((2, 4), np.float32), (0, 1))
    with self.assertRaisesRegex(TypeError, "tile_map maps a JAX primitive .* got "
                                           "PjitFunction 'exp'"):
      T.tile_map(jnp.exp, x)
    with self.assertRaisesRegex(IndexError, "tile index 7 is out of range .* 2 tiles"):
      x[7]  # was wrapped round to shard 1

  def test_barrier_refuses_dtypes_of_different_sizes(self):
    a = T.tile_put_replicated(np.zeros(3, np.float32), (0, 1))
    b = T.tile_put_replicated(np.zeros(3, np.float16), (0, 1))
    with self.assertRaisesRegex(TypeError, "one size"):
      T.tile_data_barrier(a, b)


class CycleCountTest(chex.TestCase):

  def test_cycle_count_reads_the_cycles_reached(self):
    def fn(a):
      a = T.tile_put_sharded(a, (1, 2))
      a, c0 = T.ipu_cycle_count(a)
      a, c1 = T.ipu_cycle_count(a)
      b = T.tile_map(lax.exp_p, a)
      b, c2 = T.ipu_cycle_count(b)
      return c0.array, c1.array, c2.array
    c0, c1, c2 = (np.asarray(c) for c in ipu_jax.jit(fn, target=tu.T16)(np.ones((2, 64), np.float32)))
    self.assertEqual(c0.dtype, np.uint32)
    np.testing.assert_array_equal(c1, c0)        # reading the counter costs nothing
    self.assertTrue((c0[:, 0] > 0).all())        # the placement's exchange came first
    self.assertTrue((c2[:, 0] > c1[:, 0]).all())  # the exp vertex's cycles


class RandomTest(chex.TestCase):

  def test_uniform_and_normal_on_tiles(self):
    def fn():
      u = T.tile_random_uniform((1, 2, 3), size=2000, dtype=np.float32, offset=1.0, scale=2.0)
      v = T.tile_random_uniform((1, 2, 3), size=2000, dtype=np.float32, offset=1.0, scale=2.0)
      z = T.tile_random_normal((4,), size=20000, dtype=np.float32, mean=1.0, stddev=2.0)
      return u.array, v.array, z.array
    u, v, z = (np.asarray(a) for a in ipu_jax.jit(fn, target=tu.T16)())
    self.assertTrue(0.0 <= u.min() and u.max() <= 2.0)
    self.assertFalse(np.array_equal(u, v))       # the streams move on
    self.assertFalse(np.array_equal(u[0], u[1]))  # each tile its own stream
    self.assertAlmostEqual(float(z.mean()), 1.0, delta=0.1)
    self.assertAlmostEqual(float(z.std()), 2.0, delta=0.1)


class LinalgTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(16, 32, 64, 128)
  def test_eigh_equals_numpy(self, n):
    x = _symmetric(n, seed=n)
    vectors, values = ipu_jax.jit(lambda a: ipu_eigh(a, num_iters=10), target=_target(n + 2))(x)
    vectors, values = np.asarray(vectors), np.asarray(values)
    want = np.linalg.eigh(x.astype(np.float64))[0]
    scale = np.abs(want).max()
    np.testing.assert_allclose(values, want, rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(vectors @ np.diag(values) @ vectors.T, x, atol=2e-4 * scale)
    np.testing.assert_allclose(vectors.T @ vectors, np.eye(n), atol=1e-4)

  def test_eigh_odd_size(self):
    x = _symmetric(7)
    vectors, values = ipu_jax.jit(lambda a: ipu_eigh(a, num_iters=8), target=tu.T16)(x)
    np.testing.assert_allclose(np.asarray(values), np.linalg.eigh(x)[0], rtol=1e-4, atol=1e-5)

  def test_eigh_needs_enough_tiles(self):
    fn = ipu_jax.jit(lambda a: ipu_eigh(a), target=tu.T16)
    with self.assertRaisesRegex(Exception, "outside the target"):
      fn.lower(_symmetric(32))

  @parameterized.parameters(8, 16)
  def test_qr(self, n):
    x = np.random.default_rng(n).normal(size=(n, n)).astype(np.float32)
    q, rt = ipu_jax.jit(ipu_qr, target=_target(2 * n))(x)
    q, r = np.asarray(q), np.asarray(rt).T
    np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-5)
    np.testing.assert_allclose(np.tril(r, -1), 0, atol=1e-5)
    np.testing.assert_allclose(q @ r, x, atol=1e-5)

  @parameterized.parameters(8, 16)
  def test_hessenberg(self, n):
    x = np.random.default_rng(n).normal(size=(n, n)).astype(np.float32)
    q, h = ipu_jax.jit(ipu_hessenberg, target=_target(2 * n))(x)
    q, h = np.asarray(q), np.asarray(h)
    np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-5)
    np.testing.assert_allclose(np.tril(h, -2), 0, atol=1e-5)
    np.testing.assert_allclose(q @ h @ q.T, x, atol=1e-5)


class AliasTest(chex.TestCase, parameterized.TestCase):

  def tearDown(self):
    T.alias.uninstall_alias()
    super().tearDown()

  def test_tessellate_ipu_code_runs_unchanged(self):
    T.install_alias()
    from tessellate_ipu import tile_map, tile_put_sharded  # pylint: disable=import-outside-toplevel
    from tessellate_ipu.linalg import ipu_eigh as eigh  # pylint: disable=import-outside-toplevel

    @partial(jax.jit, backend="ipu")
    def fn(a):
      return tile_map(lax.abs_p, tile_put_sharded(a, (1, 2)))
    out = fn(-np.ones((2, 3), np.float32))
    self.assertIsInstance(fn.lower(-np.ones((2, 3), np.float32)), ipu_jax.stages.Lowered)
    np.testing.assert_array_equal(np.asarray(out), np.ones((2, 3)))
    self.assertIs(eigh, ipu_eigh)
    self.assertEqual(jax.devices("ipu")[0].num_tiles, T.device.emulated_target().tiles_per_ipu)

  def test_uninstall_restores_jax(self):
    original, original_pmap = jax.jit, jax.pmap
    T.install_alias()
    self.assertIsNot(jax.jit, original)
    T.alias.uninstall_alias()
    self.assertIs(jax.jit, original)
    self.assertIs(jax.pmap, original_pmap)
    self.assertNotIn("tessellate_ipu", sys.modules)

  @parameterized.parameters(1, 2)
  def test_pmap_with_backend_ipu_runs_as_replicas(self, ipus):
    # nanoDFT's SCF program: jax.pmap(f, backend="ipu", in_axes=..., axis_name="p").
    x = tu.random_array((ipus, 2, 8), seed=3)
    h = tu.random_array((8,), seed=4)
    body = lambda a, b: (lax.psum(a * 2.0, "p") + b, a.sum())
    on_cpu = jax.pmap(body, in_axes=(0, None), axis_name="p", backend="cpu")
    # One CPU device here: JAX's own pmap runs over 1; over more, vmap with the
    # same axis name is pmap's semantics.
    expected = (on_cpu(x, h) if ipus == 1 else
                jax.vmap(body, in_axes=(0, None), axis_name="p")(x, h))
    with mock.patch.dict(os.environ, {"JAX_IPU_DEVICE_COUNT": str(ipus),
                                      "JAX_IPU_MODEL_NUM_TILES": "16"}):
      T.install_alias()
      self.assertLen(jax.devices("ipu"), ipus)
      fn = jax.pmap(body, backend="ipu", in_axes=(0, None), axis_name="p")
      got = fn(x, h)
      report = fn.lower(x, h).report
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got), expected, rtol=1e-6)
    self.assertGreater(report.total_cycles, 0)
    self.assertEqual(report.target.tiles_per_ipu, 16)

  def test_pmap_over_more_ipus_than_jax_devices_ipu_is_refused(self):
    with mock.patch.dict(os.environ, {"JAX_IPU_DEVICE_COUNT": "1"}):
      T.install_alias()
      fn = jax.pmap(lambda a: a + 1, backend="ipu")
      with self.assertRaisesRegex(ValueError, "2 IPUs.*1 device.*JAX_IPU_DEVICE_COUNT=2"):
        fn(np.zeros((2, 3), np.float32))

  def test_pmap_of_other_backends_is_jax_own(self):
    T.install_alias()
    x = np.arange(3, dtype=np.float32)[None]
    got = jax.pmap(lambda a: a * 3, backend="cpu")(x)
    self.assertIsInstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), x * 3)

  @parameterized.parameters("ipu_jax.jit", "pmap")
  def test_jit_backend_ipu_called_under_a_trace_is_inlined(self, outer_kind):
    # pyscf-ipu's ipu_ijkl: decorated at import, called in the SCF loop with
    # traced arguments.
    T.install_alias()
    from tessellate_ipu import tile_map, tile_put_sharded  # pylint: disable=import-outside-toplevel

    @partial(jax.jit, backend="ipu")
    def inner(a, k):
      return tile_map(lax.abs_p, tile_put_sharded(a * k, (1, 2))).array

    def outer(a):
      step = lambda i, acc: acc + inner(a, (i - 1).astype(np.float32))
      return lax.fori_loop(0, 3, step, jnp.zeros_like(a))

    def reference(a):
      step = lambda i, acc: acc + jnp.abs(a * (i - 1).astype(np.float32))
      return lax.fori_loop(0, 3, step, jnp.zeros_like(a))

    x = tu.random_array((2, 5), seed=5)
    if outer_kind == "pmap":
      fn = jax.pmap(outer, backend="ipu")
      got, expected = fn(x[None]), jax.jit(reference)(x)[None]
    else:
      fn = ipu_jax.jit(outer, target=_target(16))
      got, expected = fn(x), jax.jit(reference)(x)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(expected), rtol=1e-6)
    # Its vertices are steps of the outer program, not of a program of its own.
    report = fn.lower(x[None] if outer_kind == "pmap" else x).report
    self.assertIn("tile_map<abs>", [step.name for step in report.profile.steps])


if __name__ == "__main__":
  absltest.main()
