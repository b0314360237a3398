"""C++ codelets (Poplar vertex code) compiled for the host and run through XLA FFI."""

import os
import tempfile
import textwrap
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import cpp_codelets
from ipu_jax import graph as g


def setUpModule():
  # Libraries built by these tests go to a directory of their own.
  os.environ.setdefault("IPU_JAX_CACHE", tempfile.mkdtemp(prefix="ipu_jax_cache_"))


def _target(tiles=4):
  return ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)


# Tutorial 3's codelet file: the suffix sums of v1 into v2, one SumVertex per
# element (written here after the tutorial's description).
TUT3_CODELETS = textwrap.dedent("""\
    #include <poplar/Vertex.hpp>

    class SumVertex : public poplar::Vertex {
    public:
      // Fields
      poplar::Input<poplar::Vector<float>> in;
      poplar::Output<float> out;

      // Compute function
      bool compute() {
        *out = 0;
        for (const auto &v : in) {
          *out += v;
        }
        return true;
      }
    };
    """)

# What the other tests use: workers, half, lists, vertex state, templates.
CODELETS = textwrap.dedent("""\
    #include <poplar/HalfFloat.hpp>
    #include <poplar/Vertex.hpp>
    #include <cmath>

    using namespace poplar;

    // Each worker writes its id into its own element; worker 0 then waits
    // for (and adds up) what the others wrote, as TessellateIPU's
    // multi-worker vertices do.
    class WorkerIds : public MultiVertex {
     public:
      Output<Vector<int>> ids;   // (6,)
      Output<int> total;
      bool compute(unsigned wid) {
        ids[wid] = int(wid) + 1;
        if (wid == 0) {
          int sum = 0;
          for (unsigned w = 0; w < numWorkers(); ++w) sum += ids[w];
          *total = sum;
        }
        return true;
      }
    };

    class CountCalls : public SupervisorVertex {
     public:
      InOut<Vector<int>> counter;
      bool compute() {
        counter[0] += 1;
        return true;
      }
    };

    template <typename T>
    class Elementwise : public Vertex {
     public:
      Input<Vector<T>> x;
      Input<Vector<T, VectorLayout::ONE_PTR>> z;
      Output<Vector<T>> product;
      Output<Vector<T, VectorLayout::ONE_PTR>> ratio;
      bool compute() {
        for (unsigned i = 0; i < x.size(); ++i) {
          product[i] = x[i] * z[i];
          ratio[i] = (x[i] + z[i]) / (x[i] - z[i] + T(3));
        }
        return true;
      }
    };

    // TessellateIPU's test vertex shapes: a vector of input vectors, a
    // scalar input, a plain member, templates over int/half/float.
    template <typename T>
    class ScaledRows : public Vertex {
     public:
      Vector<Input<Vector<T>>, VectorLayout::ONE_PTR> rows;
      Input<T> global_scale;
      T scale_value;
      Output<Vector<T, VectorLayout::SPAN>> out;
      bool compute() {
        for (std::size_t i = 0; i < out.size(); ++i) {
          out[i] = T(i) * rows[0][i] * rows[1][i] * (*global_scale) * scale_value;
        }
        return true;
      }
    };

    class JaggedSum : public Vertex {
     public:
      Input<VectorList<float, VectorListLayout::DELTANELEMENTS>> in;
      Output<Vector<float>> out;   // one sum per sub-list
      bool compute() {
        for (unsigned i = 0; i < in.size(); ++i) {
          float s = 0;
          for (auto v : in[i]) s += v;
          out[i] = s;
        }
        return true;
      }
    };

    class Fails : public Vertex {
     public:
      Input<Vector<float>> x;
      Output<float> y;
      bool compute() { *y = x[0]; return x[0] > 0; }
    };

    template class Elementwise<float>;
    template class Elementwise<half>;
    template class ScaledRows<int>;
    template class ScaledRows<half>;
    template class ScaledRows<float>;
    """)


class _CodeletsTestCase(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    setUpModule()
    cls.lib = cpp_codelets.compile_codelets(CODELETS)


class Tutorial3Test(chex.TestCase):
  """Poplar tutorial 3: a C++ SumVertex per element, on several tiles."""

  def _graph(self):
    path = os.path.join(self.create_tempdir().full_path, "tut3_codelets.cpp")
    with open(path, "w") as f:
      f.write(TUT3_CODELETS)
    gr = g.Graph(_target(4))
    gr.add_codelets(path)
    v1 = gr.add_variable("float32", (4,), "v1")
    v2 = gr.add_variable("float32", (4,), "v2")
    for i in range(4):
      gr.set_tile_mapping(v1[i], i)
      gr.set_tile_mapping(v2[i], i)
    return gr, v1, v2

  def test_tut3_suffix_sums_equal_numpy(self):
    gr, v1, v2 = self._graph()
    cs = gr.add_compute_set("computeSet")
    for i in range(4):
      vertex = gr.add_vertex(cs, "SumVertex", tile=i, **{"in": v1[i:], "out": v2[i]})
      gr.set_perf_estimate(vertex, 20)
    engine = g.Engine(gr, [g.Sequence([g.Execute(cs)])])
    values = np.array([1.0, 1.5, 2.0, 2.5], np.float32)
    engine.write_tensor(v1, values)
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(v2), np.cumsum(values[::-1])[::-1])
    # The report sees them as the compute set's vertices, with their cycles.
    step = engine.profile.steps[0]
    self.assertIn("SumVertex", step.codelets)
    np.testing.assert_array_equal(step.vertices, [1, 1, 1, 1])
    self.assertTrue(np.all(np.asarray(step.compute_cycles) > 0))

  def test_missing_field_is_an_error_before_running(self):
    gr, v1, v2 = self._graph()
    cs = gr.add_compute_set("computeSet")
    with self.assertRaisesRegex(ValueError, r"SumVertex.*\['out'\] not connected.*in \(in vector float32"):
      gr.add_vertex(cs, "SumVertex", tile=0, **{"in": v1})
    with self.assertRaisesRegex(ValueError, r"no field\(s\) \['y'\]"):
      gr.add_vertex(cs, "SumVertex", tile=0, y=v1, **{"in": v1, "out": v2[0]})
    with self.assertRaisesRegex(ValueError, r"'out' is a scalar.*shape \(4,\)"):
      gr.add_vertex(cs, "SumVertex", tile=0, **{"in": v1, "out": v2})
    ints = gr.add_variable("int32", (4,), "ints")
    with self.assertRaisesRegex(TypeError, r"'in' holds float32; the tensor is int32"):
      gr.add_vertex(cs, "SumVertex", tile=0, **{"in": ints, "out": v2[0]})
    with self.assertRaisesRegex(ValueError, r"no vertex class 'SumVertexx'.*SumVertex"):
      gr.add_vertex(cs, "SumVertexx", tile=0)

  def test_compile_error_names_file_line_and_gxx_message(self):
    path = os.path.join(self.create_tempdir().full_path, "broken.cpp")
    with open(path, "w") as f:
      f.write(TUT3_CODELETS.replace("*out += v;", "*out += undefined_name;"))
    line = TUT3_CODELETS.splitlines().index("      *out += v;") + 1
    with self.assertRaises(cpp_codelets.CodeletCompileError) as raised:
      cpp_codelets.compile_codelets(path)
    message = str(raised.exception)
    self.assertIn(f"{os.path.realpath(path)}:{line}: ", message.splitlines()[0])
    self.assertIn("'undefined_name' was not declared", message)
    self.assertIn("g++ said:", message)


class VertexKindsTest(_CodeletsTestCase):

  def test_multi_vertex_runs_every_worker(self):
    out = cpp_codelets.run_vertices(self.lib, "WorkerIds", [
        {"ids": np.zeros(6, np.int32), "total": np.zeros((), np.int32)}] * 3)
    np.testing.assert_array_equal(out["ids"], np.tile(np.arange(1, 7, dtype=np.int32), (3, 1)))
    np.testing.assert_array_equal(out["total"], [21, 21, 21])

  def test_supervisor_vertex_computes_once(self):
    out = cpp_codelets.run_vertices(self.lib, "CountCalls",
                                    [{"counter": np.array([5], np.int32)}])
    np.testing.assert_array_equal(out["counter"], [[6]])

  def test_compute_returning_false_is_an_error(self):
    with self.assertRaisesRegex(Exception, r"Fails: compute\(\) returned false for vertex 1"):
      out = cpp_codelets.run_vertices(self.lib, "Fails", [
          {"x": np.array([1.0], np.float32), "y": np.float32(0)},
          {"x": np.array([-1.0], np.float32), "y": np.float32(0)}])
      jax.block_until_ready(out)

  def test_half_fields_round_as_float16(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 33)).astype(np.float16)
    z = rng.normal(size=(5, 33)).astype(np.float16)
    out = cpp_codelets.run_vertices(self.lib, "Elementwise<half>", [
        {"x": x[k], "z": z[k], "product": x[k], "ratio": x[k]} for k in range(5)])
    self.assertEqual(out["product"].dtype, jnp.float16)
    # One operation rounded once to half: what float16 NumPy gives.
    np.testing.assert_array_equal(np.asarray(out["product"]).view(np.uint16),
                                  (x.astype(np.float32) * z).astype(np.float16).view(np.uint16))

  @parameterized.parameters("int", "half", "float")
  def test_tessellate_style_fields(self, type_name):
    dtype = {"int": np.int32, "half": np.float16, "float": np.float32}[type_name]
    rows = np.array([[1, 2, 3, 4], [2, 2, 2, 2]], dtype)
    out = cpp_codelets.run_vertices(self.lib, f"ScaledRows<{type_name}>", [
        {"rows": rows, "global_scale": dtype(2), "scale_value": dtype(3),
         "out": np.zeros(4, dtype)}])
    np.testing.assert_array_equal(out["out"][0],
                                  (np.arange(4) * rows[0] * rows[1] * 6).astype(dtype))

  def test_vertex_classes_describe_fields(self):
    fields = self.lib.vertex_classes["ScaledRows<half>"].fields
    self.assertEqual([(f.name, f.kind, f.shape, f.dtype, f.attribute) for f in fields], [
        ("rows", "in", "vector_list", "float16", False),
        ("global_scale", "in", "scalar", "float16", False),
        ("scale_value", "in", "scalar", "float16", True),
        ("out", "out", "vector", "float16", False)])
    self.assertTrue(self.lib.vertex_classes["WorkerIds"].supervisor)

  def test_run_vertices_is_one_ffi_call(self):
    x = jnp.arange(64, dtype=jnp.float32).reshape(16, 4)

    def run(x):
      return cpp_codelets.run_vertices(self.lib, "Elementwise<float>", [
          {"x": x[k], "z": x[k] + 1, "product": x[k], "ratio": x[k]} for k in range(16)])

    hlo = jax.jit(run).lower(x).as_text()
    self.assertEqual(hlo.count("custom_call"), 1, hlo)
    chex.assert_trees_all_close(run(x)["product"], x * (x + 1))


def _elementwise_graph(gr, tiles, n, cpp):
  """x, z spread over tiles; one elementwise vertex per tile (C++ or Python)."""
  x = gr.add_variable("float32", (tiles, n), "x")
  z = gr.add_variable("float32", (tiles, n), "z")
  product = gr.add_variable("float32", (tiles, n), "product")
  ratio = gr.add_variable("float32", (tiles, n), "ratio")
  for t in (x, z, product, ratio):
    gr.map_tensor_linearly(t, min_elements_per_tile=n)
  cs = gr.add_compute_set("elementwise")

  @g.codelet(inputs=("x", "z"), outputs=("product", "ratio"), cycles=10)
  def elementwise(x, z):
    return x * z, (x + z) / (x - z + 3)

  for tile in range(tiles):
    fields = dict(x=x[tile], z=z[tile], product=product[tile], ratio=ratio[tile])
    gr.add_vertex(cs, "Elementwise<float>" if cpp else elementwise, tile=tile, **fields)
  return cs, (x, z, product, ratio)


class GraphTest(_CodeletsTestCase):

  def test_fp32_elementwise_bit_exact_with_python_codelet(self):
    rng = np.random.default_rng(1)
    xv = rng.normal(size=(8, 37)).astype(np.float32)
    zv = rng.normal(size=(8, 37)).astype(np.float32)
    results = []
    for cpp in (True, False):
      gr = g.Graph(_target(8))
      gr.add_codelets(CODELETS, cycles=10)
      cs, (x, z, product, ratio) = _elementwise_graph(gr, 8, 37, cpp)
      engine = g.Engine(gr, [g.Execute(cs)])
      engine.write_tensor(x, xv)
      engine.write_tensor(z, zv)
      engine.run(0)
      results.append([engine.read_tensor(product), engine.read_tensor(ratio)])
    for cpp_value, python_value in zip(*results):
      np.testing.assert_array_equal(cpp_value.view(np.uint32), python_value.view(np.uint32))

  def test_vector_list_and_vertex_state(self):
    gr = g.Graph(_target(4))
    gr.add_codelets(CODELETS, cycles={"ScaledRows<float>": lambda fields: 7 * fields["out"].size})
    rows = gr.add_variable("float32", (2, 4), "rows")
    scale = gr.add_variable("float32", (1,), "scale")
    out = gr.add_variable("float32", (4,), "out")
    data = gr.add_variable("float32", (6,), "data")
    sums = gr.add_variable("float32", (3,), "sums")
    for t in (rows, scale, out, data, sums):
      gr.set_tile_mapping(t, 1)
    cs = gr.add_compute_set("cs")
    gr.add_vertex(cs, "ScaledRows<float>", tile=1, rows=[rows[0], rows[1]], global_scale=scale,
                  scale_value=0.5, out=out)
    gr.add_vertex(cs, "JaggedSum", tile=1, cycles=9, **{"in": [data[0:1], data[1:3], data[3:6]],
                                                         "out": sums})
    engine = g.Engine(gr, [g.Execute(cs)])
    engine.write_tensor(rows, [[1, 2, 3, 4], [5, 6, 7, 8]])
    engine.write_tensor(scale, [4])
    engine.write_tensor(data, np.arange(6))
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(out),
                                  np.arange(4) * [1, 2, 3, 4] * np.array([5, 6, 7, 8]) * 2.0)
    np.testing.assert_array_equal(engine.read_tensor(sums), [0, 3, 12])
    with self.assertRaisesRegex(TypeError, r"'scale_value' is vertex state"):
      gr.add_vertex(cs, "ScaledRows<float>", tile=1, rows=[rows[0], rows[1]],
                    global_scale=scale, scale_value=scale, out=out)

  def test_multi_vertex_that_only_writes_on_several_tiles(self):
    gr = g.Graph(_target(4))
    gr.add_codelets(CODELETS, cycles=30)
    ids = gr.add_variable("int32", (2, 6), "ids")
    total = gr.add_variable("int32", (2,), "total")
    cs = gr.add_compute_set("workers")
    for tile in range(2):
      gr.set_tile_mapping(ids[tile], tile)
      gr.set_tile_mapping(total[tile], tile)
      gr.add_vertex(cs, "WorkerIds", tile=tile, ids=ids[tile], total=total[tile])
    engine = g.Engine(gr, [g.Execute(cs)])
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(ids), np.tile(np.arange(1, 7), (2, 1)))
    np.testing.assert_array_equal(engine.read_tensor(total), [21, 21])
    # A MultiVertex is priced as the tile's cycles (the author's 30).
    np.testing.assert_array_equal(engine.profile.steps[0].compute_cycles[:2], [30, 30])

  def test_cycles_without_an_estimate_are_marked_estimate(self):
    gr = g.Graph(_target(4))
    gr.add_codelets(CODELETS)
    cs, _ = _elementwise_graph(gr, 4, 16, cpp=True)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      engine = g.Engine(gr, [g.Execute(cs)])
    self.assertTrue(any("Elementwise<float>" in str(w.message) and "estimate" in str(w.message)
                        for w in caught), [str(w.message) for w in caught])
    step = engine.profile.steps[0]
    self.assertTrue(any("estimate" in note for note in step.notes), step.notes)
    # 2 inputs + 2 outputs of 16 elements at the documented figure, plus overhead.
    from ipu_jax.cpp_codelets import cost
    per_vertex = cost.VERTEX_OVERHEAD_CYCLES + cost.CYCLES_PER_ELEMENT * 64
    target = _target(4)
    self.assertEqual(float(step.compute_cycles[0]),
                     per_vertex * target.worker_contexts + target.supervisor_overhead_cycles)


if __name__ == "__main__":
  absltest.main()
