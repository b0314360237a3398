"""The Poplar tutorials rebuilt on ipu_jax.graph, with their exact outputs."""

import contextlib
import io

from absl.testing import absltest
import chex
import numpy as np

import ipu_jax
from ipu_jax import graph as g
from ipu_jax import poplibs
import testing_utils


def _target(tiles=4):
  return ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=tiles)


def _run_capturing(engine, index=0):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    engine.run(index)
  return out.getvalue()


class Tutorial1Test(chex.TestCase):
  """tut1: variables, constants, copies, host streams, host reads."""

  def test_tut1(self):
    gr = g.Graph(_target())
    v1, v2 = testing_utils.spread_vectors(gr, ("v1", "v2"))
    v3 = gr.add_variable("float32", (4, 4), "v3")
    v4 = gr.add_variable("int32", (10,), "v4")
    gr.set_tile_mapping(v3, 0)
    gr.set_tile_mapping(v4, 0)
    c1 = gr.add_constant("float32", (4,), [1.0, 1.5, 2.0, 2.5], "c1")
    gr.set_tile_mapping(c1, 0)
    in_stream = gr.add_host_to_device_fifo("v4-input-stream", "int32", 10)
    prog = g.Sequence([
        g.Copy(c1, v1),
        g.PrintTensor("v1-debug", v1),
        g.Copy(v1, v2),
        g.PrintTensor("v2-debug", v2),
        g.Copy(v1[0:3], v3[1, 1:4]),
        g.Copy(in_stream, v4),
        g.PrintTensor("v4-0", v4),
        g.Copy(in_stream, v4),
        g.PrintTensor("v4-1", v4),
    ])
    engine = g.Engine(gr, [prog])
    engine.connect_stream("v4-input-stream", np.arange(30, dtype=np.int32))
    engine.write_tensor(v3, np.zeros((4, 4), np.float32))
    printed = _run_capturing(engine)
    self.assertIn("v1-debug: [1.0000000 1.5000000 2.0000000 2.5000000]", printed)
    self.assertIn("v2-debug: [1.0000000 1.5000000 2.0000000 2.5000000]", printed)
    self.assertIn("v4-0: [0 1 2 3 4 5 6 7 8 9]", printed)
    self.assertIn("v4-1: [10 11 12 13 14 15 16 17 18 19]", printed)
    np.testing.assert_array_equal(
        engine.read_tensor(v3),
        np.array([[0, 0, 0, 0], [0, 1, 1.5, 2], [0, 0, 0, 0], [0, 0, 0, 0]], np.float32))
    # The next run continues around the circular host buffer.
    printed = _run_capturing(engine)
    self.assertIn("v4-0: [20 21 22 23 24 25 26 27 28 29]", printed)
    self.assertIn("v4-1: [0 1 2 3 4 5 6 7 8 9]", printed)


class Tutorial2Test(chex.TestCase):
  """tut2: popops add on 2x2 tensors spread over tiles, with a transpose."""

  def test_tut2(self):
    gr = g.Graph(_target())
    v1 = gr.add_variable("float32", (2, 2), "v1")
    v2 = gr.add_variable("float32", (2, 2), "v2")
    for i in range(2):
      for j in range(2):
        gr.set_tile_mapping(v1[i, j], i * 2 + j)
        gr.set_tile_mapping(v2[i, j], j * 2 + i)
    c1 = gr.add_constant("float32", (4,), [1.0, 1.5, 2.0, 2.5], "c1")
    c2 = gr.add_constant("float32", (4,), [4.0, 3.0, 2.0, 1.0], "c2")
    gr.set_tile_mapping(c1, 0)
    gr.set_tile_mapping(c2, 0)
    prog = g.Sequence([g.Copy(c1, v1.flatten()), g.Copy(c2, v2.flatten())])
    v3 = poplibs.add(gr, v1, v2, prog, "Add")
    v4 = poplibs.add(gr, v3, v2, prog, "Add2")
    v5 = poplibs.add(gr, v1, v2.transpose(), prog, "Add3")
    engine = g.Engine(gr, [prog])
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(v3), [[5, 4.5], [4, 3.5]])
    np.testing.assert_array_equal(engine.read_tensor(v4), [[9, 7.5], [6, 4.5]])
    np.testing.assert_array_equal(engine.read_tensor(v5), [[5, 3.5], [5, 3.5]])
    # v2 is mapped transposed to v1, so the adds must exchange operands.
    add_steps = [s for s in engine.profile.steps if s.name == "Add"]
    self.assertGreater(int(add_steps[0].exchange_bytes_in.sum()), 0)


class Tutorial3Test(chex.TestCase):
  """tut3: a custom SumVertex on 4 tiles with a perf estimate of 20."""

  def test_tut3(self):
    gr = g.Graph(_target())
    v1, v2 = testing_utils.spread_vectors(gr, ("v1", "v2"))
    c1 = gr.add_constant("float32", (4,), [1.0, 1.5, 2.0, 2.5], "c1")
    gr.set_tile_mapping(c1, 0)

    @g.codelet(inputs=("in_",), outputs=("out",))
    def sum_vertex(in_):
      return in_.sum()

    cs = gr.add_compute_set("computeSet")
    for i in range(4):
      vertex = gr.add_vertex(cs, sum_vertex, tile=i, in_=v1[i:], out=v2[i])
      gr.set_perf_estimate(vertex, 20)
    prog = g.Sequence([g.Copy(c1, v1), g.Execute(cs), g.PrintTensor("v2", v2)])
    engine = g.Engine(gr, [prog])
    printed = _run_capturing(engine)
    np.testing.assert_array_equal(engine.read_tensor(v2), [7, 6, 4.5, 2.5])
    self.assertIn("v2: [7.0000000 6.0000000 4.5000000 2.5000000]", printed)
    step = [s for s in engine.profile.steps if s.name == "computeSet"][0]
    # One vertex of 20 cycles per tile: busiest context x 6 contexts + supervisor.
    t = _target()
    expected = 20 * t.worker_contexts + t.supervisor_overhead_cycles
    np.testing.assert_array_equal(step.compute_cycles[:4], [expected] * 4)


def _tile_table(gr, views):
  """Global element id -> tile for every element of ``views`` (-1 elsewhere),
  read with ``Graph.get_tile_mapping``."""
  table = np.full(max(int(v.index.max()) for v in views) + 1, -1)
  for view in views:
    flat = view.index.reshape(-1)
    for tile, positions in gr.get_tile_mapping(view).items():
      table[flat[positions]] = tile
  return table


def _exchange_of_one_vertex_per_tile(cs, table, num_tiles, itemsize):
  """``(bytes in, bytes out)`` per tile of a compute set whose vertices are
  on distinct tiles and write on their own tile: a tile receives each element
  its vertex reads from elsewhere once, and a tile sends once each of its
  elements that some other tile reads."""
  bytes_in = np.zeros(num_tiles, np.int64)
  sent = np.zeros(table.size, bool)
  for v in cs.vertices:
    ids = np.sort(np.concatenate([v.connections[f].index.reshape(-1)
                                  for f in v.codelet.inputs]))
    ids = ids[np.append(True, ids[1:] != ids[:-1])]  # distinct
    away = ids[table[ids] != v.tile]
    bytes_in[v.tile] += itemsize * away.size
    sent[away] = True
  return bytes_in, itemsize * np.bincount(table[sent], minlength=num_tiles)


class Tutorial4Test(chex.TestCase):
  """tut4: chained matmuls 900x600 . 600x300 . 300x200 with a summary."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.gr, cls.operands, prog, cls.abc = testing_utils.chained_matmul_graph(
        ipu_jax.IPUTarget.preset("ipu2"))
    cls.engine = g.Engine(cls.gr, [prog])

  def test_tut4_exchange_is_what_each_vertex_reads_from_other_tiles(self):
    # Each compute set's exchange is planned on runs of all its vertices at
    # once (docs/performance.md#what-makes-lowering-scale); the bytes each tile
    # receives and sends are worked out here element by element instead.
    gr, engine = self.gr, self.engine
    ab_cs, abc_cs = (next(cs for cs in gr.compute_sets if cs.name == name)
                     for name in ("ab", "abc"))
    written = g.concatenate([v.connections["c"].flatten() for v in ab_cs.vertices])
    table = _tile_table(gr, list(self.operands) + [self.abc, written])
    steps = {s.name: s for s in engine.profile.steps}
    for cs in (ab_cs, abc_cs):
      self.assertLen({v.tile for v in cs.vertices}, len(cs.vertices))
      bytes_in, bytes_out = _exchange_of_one_vertex_per_tile(cs, table, gr.target.num_tiles, 4)
      np.testing.assert_array_equal(steps[cs.name].exchange_bytes_in, bytes_in)
      np.testing.assert_array_equal(steps[cs.name].exchange_bytes_out, bytes_out)
      self.assertEqual(steps[cs.name].ipu_link_bytes, 0)
      np.testing.assert_array_equal(
          steps[cs.name].vertices,
          np.bincount([v.tile for v in cs.vertices], minlength=gr.target.num_tiles))

  def test_tut4(self):
    (a, b, c), abc, engine = self.operands, self.abc, self.engine
    rng = np.random.default_rng(0)
    av, bv, cv = (rng.standard_normal(s).astype(np.float32)
                  for s in ((900, 600), (600, 300), (300, 200)))
    engine.write_tensor(a, av)
    engine.write_tensor(b, bv)
    engine.write_tensor(c, cv)
    engine.run(0)
    # Two chained fp32 contractions: each element's sum passes 600 + 300
    # roundings.
    testing_utils.assert_within_sum_bound(engine.read_tensor(abc), lambda a, b, c: a @ b @ c,
                                          av, bv, cv, n=600 + 300)
    report = engine.report()
    summary = report.summary()
    for field in ("Memory", "Compute", "Exchange", "Sync", "Tiles used", "Estimated time"):
      self.assertIn(field, summary)
    self.assertGreater(report.total_cycles, 0)
    self.assertGreater(report.profile.tiles_used, 1000)
    flops = 2 * (900 * 600 * 300 + 900 * 300 * 200)
    self.assertEqual(report.total_flops, flops)


class Tutorial5Test(chex.TestCase):
  """tut5: matrix-vector product, one dot-product vertex per row."""

  def test_tut5(self):
    rows, cols = 40, 50
    gr = g.Graph(_target(16))
    matrix = gr.add_variable("float32", (rows, cols), "matrix")
    vector = gr.add_variable("float32", (cols,), "vector")
    result = gr.add_variable("float32", (rows,), "result")
    tiles = gr.target.num_tiles
    for r in range(rows):
      gr.set_tile_mapping(matrix[r], r % tiles)
      gr.set_tile_mapping(result[r], r % tiles)
    gr.map_tensor_linearly(vector)

    @g.codelet(inputs=("a", "b"), outputs=("out",),
               cycles=lambda a, b, out: 10 + a.size)
    def dot_product(a, b):
      return (a * b).sum()

    cs = gr.add_compute_set("mat_vec")
    for r in range(rows):
      gr.add_vertex(cs, dot_product, tile=r % tiles, a=matrix[r], b=vector, out=result[r])
    engine = g.Engine(gr, [g.Execute(cs)])
    rng = np.random.default_rng(1)
    m = rng.standard_normal((rows, cols)).astype(np.float32)
    v = rng.standard_normal(cols).astype(np.float32)
    engine.write_tensor(matrix, m)
    engine.write_tensor(vector, v)
    engine.run(0)
    exact = m.astype(np.float64) @ v
    ok = (np.abs(engine.read_tensor(result) - exact)
          <= testing_utils.sum_error_bound(np.matmul, m, v)).all()
    self.assertEqual("Multiplication result OK" if ok else "Multiplication result WRONG",
                     "Multiplication result OK")
    # The vector is spread linearly, so every tile receives most of it.
    step = engine.profile.steps[0]
    self.assertGreater(int(step.exchange_bytes_in.sum()), 0)


class GraphApiTest(chex.TestCase):

  def test_full_target_one_vertex_per_tile(self):
    target = ipu_jax.IPUTarget.preset("ipu2")
    gr = g.Graph(target)
    n = target.num_tiles
    x = gr.add_variable("float32", (n, 8), "x")
    y = gr.add_variable("float32", (n,), "y")
    # Row i and y[i] on tile i, set with one vectorised mapping per tensor.
    gr.map_tensor_linearly(x, min_elements_per_tile=8, grain_size=8)
    gr.map_tensor_linearly(y, min_elements_per_tile=1, grain_size=1)

    @g.codelet(inputs=("row",), outputs=("total",), cycles=lambda row, total: 4 * row.size)
    def row_sum(row):
      return row.sum()

    cs = gr.add_compute_set("rows")
    for t in range(n):
      gr.add_vertex(cs, row_sum, tile=t, row=x[t], total=y[t])
    engine = g.Engine(gr, [g.Execute(cs)])
    values = np.arange(n * 8, dtype=np.float32).reshape(n, 8)
    engine.write_tensor(x, values)
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(y), values.sum(1))
    step = engine.profile.steps[0]
    self.assertEqual(int((step.compute_cycles > 0).sum()), n)
    self.assertEqual(int(step.exchange_bytes_in.sum()), 0)
    self.assertEqual(engine.profile.memory.peak.shape, (n,))
    self.assertTrue((engine.profile.memory.peak > 0).all())

  def test_views(self):
    gr = g.Graph(_target())
    v = gr.add_variable("float32", (2, 3), "v")
    gr.map_tensor_linearly(v)
    engine = g.Engine(gr, [g.Sequence()])
    engine.write_tensor(v, np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(engine.read_tensor(v.transpose()), np.arange(6).reshape(2, 3).T)
    np.testing.assert_array_equal(engine.read_tensor(v.reshape(3, 2)[2]), [4, 5])
    np.testing.assert_array_equal(engine.read_tensor(g.concatenate([v[0], v[1]])), np.arange(6))
    np.testing.assert_array_equal(engine.read_tensor(v.slice(1, 3, dim=1)), [[1, 2], [4, 5]])

  def test_graph_tensors_are_named_apart_from_tile_program_tensors(self):
    # One meaning per name: a view of graph elements is a GraphTensor; a
    # `Tensor` is the tile program's (ipu_jax.lowering.Tensor), what rules use.
    gr = g.Graph(_target())
    v = gr.add_variable("float32", (2, 3), "v")
    for view in (v, v[1], v.transpose(), g.concatenate([v, v])):
      self.assertIsInstance(view, g.GraphTensor)
    self.assertNotIn("Tensor", g.__all__)
    self.assertFalse(hasattr(g, "Tensor"))
    self.assertIsNot(g.GraphTensor, ipu_jax.lowering.Tensor)
    self.assertEqual(repr(v[0]), "GraphTensor(shape=(3,), dtype=float32)")

  def test_control_programs(self):
    gr = g.Graph(_target())
    counter = gr.add_variable("int32", (), "counter")
    limit = gr.add_constant("int32", (), 5, "limit")
    flag = gr.add_variable("bool", (), "flag")
    for t in (counter, limit, flag):
      gr.set_tile_mapping(t, 0)
    one = gr.add_constant("int32", (), 1, "one")
    gr.set_tile_mapping(one, 1)

    @g.codelet(inputs=("step",), inouts=("x",), cycles=5)
    def increment(step, x):
      return x + step

    @g.codelet(inputs=("x", "limit"), outputs=("flag",), cycles=5)
    def less(x, limit):
      return x < limit

    inc = gr.add_compute_set("inc")
    gr.add_vertex(inc, increment, tile=0, step=one, x=counter)
    check = gr.add_compute_set("check")
    gr.add_vertex(check, less, tile=0, x=counter, limit=limit, flag=flag)
    loop = g.RepeatWhileTrue(g.Execute(check), flag, g.Execute(inc))
    repeat = g.Repeat(3, g.Execute(inc))
    branch = g.If(flag, g.Execute(inc), g.Sequence([g.Execute(inc), g.Execute(inc)]))
    switch = g.Switch(counter, [(9, g.Execute(inc)), (10, g.Repeat(4, g.Execute(inc)))])
    engine = g.Engine(gr, [loop, repeat, branch, switch])
    engine.run(0)
    self.assertEqual(int(engine.read_tensor(counter)), 5)
    engine.run(1)
    self.assertEqual(int(engine.read_tensor(counter)), 8)
    engine.run(2)  # flag is False (5 < 5 failed): the else branch adds 2
    self.assertEqual(int(engine.read_tensor(counter)), 10)
    engine.run(3)
    self.assertEqual(int(engine.read_tensor(counter)), 14)
    repeat_step = [s for s in engine.profiles[1].steps if s.name == "inc"][0]
    self.assertEqual(repeat_step.executions, 3)

  def test_counts_indices_and_slices_are_checked_as_poplar_does(self):
    gr = g.Graph(_target())
    v = gr.add_variable("float32", (4,), "v")
    gr.set_tile_mapping(v, 0)
    # A negative count ran nothing and reported negative cycles; 2.5 ran twice.
    for count in (-1, 2.5):
      with self.assertRaisesRegex(ValueError, "Repeat: count must be an int >= 0"):
        g.Repeat(count, g.Sequence())
    with self.assertRaisesRegex(ValueError, r"slice\(2, 9\) of dimension 0 \(size 4\)"):
      v.slice(2, 9)  # NumPy would clamp it to [2, 4)
    with self.assertRaisesRegex(ValueError, "stream 'f': num_elements must be an int >= 1"):
      gr.add_host_to_device_fifo("f", "float32", -1)
    inc = g.codelet(inouts=("x",), cycles=1, name="inc")(lambda x: x + 1)
    vertex = gr.add_vertex(gr.add_compute_set("inc"), inc, tile=0, x=v)
    with self.assertRaisesRegex(ValueError, "cycles must be >= 0; got -5"):
      gr.set_perf_estimate(vertex, -5)
    engine = g.Engine(gr, [g.Sequence()])
    with self.assertRaisesRegex(IndexError, r"Engine.run\(3\): the engine has 1 program"):
      engine.run(3)

  def test_unmapped_tensor_is_an_error(self):
    gr = g.Graph(_target())
    gr.add_variable("float32", (4,), "lonely")
    with self.assertRaisesRegex(ValueError, "lonely.*tile mapping"):
      g.Engine(gr, [g.Sequence()])

  def test_engines_are_independent_of_later_graph_changes(self):
    gr = g.Graph(_target())
    u = gr.add_variable("float32", (8,), "u")
    gr.map_tensor_linearly(u, min_elements_per_tile=2, grain_size=2)
    inc = g.codelet(inouts=("x",), cycles=1, name="inc")(lambda x: x + 1)
    cs = gr.add_compute_set("inc")
    gr.add_vertex(cs, inc, tile=0, x=u)
    first = g.Engine(gr, [g.Execute(cs)])
    first.write_tensor(u, np.arange(8))
    # Remap u and build a second engine on the same graph.
    for i in range(8):
      gr.set_tile_mapping(u[i], (7 - i) // 2)
    second = g.Engine(gr, [g.Execute(cs)])
    first.run(0)
    np.testing.assert_array_equal(first.read_tensor(u), np.arange(8) + 1)
    second.write_tensor(u, np.zeros(8))
    second.run(0)
    np.testing.assert_array_equal(second.read_tensor(u), np.ones(8))
    np.testing.assert_array_equal(first.read_tensor(u), np.arange(8) + 1)

  def test_vertices_on_one_tile_share_received_data(self):
    gr = g.Graph(_target())
    a = gr.add_variable("float32", (4,), "a")
    out = gr.add_variable("float32", (4,), "out")
    gr.set_tile_mapping(a, 1)
    gr.set_tile_mapping(out, 0)
    total = g.codelet(inputs=("x",), outputs=("y",), cycles=1, name="total")(lambda x: x.sum())
    cs = gr.add_compute_set("sums")
    for i in range(4):
      gr.add_vertex(cs, total, tile=0, x=a, y=out[i])
    step = g.Engine(gr, [g.Execute(cs)]).profile.steps[0]
    self.assertEqual(int(step.exchange_bytes_in[0]), 16)
    self.assertEqual(int(step.exchange_bytes_out[1]), 16)

  def test_builtin_codelets(self):
    from ipu_jax.kernels import library
    gr = g.Graph(_target())
    x = gr.add_variable("float32", (8,), "x")
    y = gr.add_constant("float32", (8,), np.arange(8), "y")
    scale = gr.add_constant("float32", (), 0.5, "scale")
    rows = gr.add_variable("float32", (2, 4), "rows")
    partials = gr.add_variable("float32", (2,), "partials")
    total = gr.add_variable("float32", (), "total")
    dot = gr.add_variable("float32", (), "dot")
    neg = gr.add_variable("float32", (8,), "neg")
    copied = gr.add_variable("float32", (8,), "copied")
    seven = gr.add_constant("float32", (), 7.0, "seven")
    for t in (x, y, scale, rows, partials, total, dot, neg, copied, seven):
      gr.set_tile_mapping(t, 0)
    fill = gr.add_compute_set("fill")
    gr.add_vertex(fill, library.fill, tile=0, value=seven, x=x)
    axpy = gr.add_compute_set("axpy")
    gr.add_vertex(axpy, library.scaled_add, tile=0, y=y, scale=scale, x=x)
    work = gr.add_compute_set("work")
    gr.add_vertex(work, library.copy, tile=0, x=x, y=copied)
    gr.add_vertex(work, library.unary("neg"), tile=0, x=y, y=neg)
    gr.add_vertex(work, library.dot_product, tile=0, a=x, b=y, out=dot)
    gr.add_vertex(work, library.partial_reduce, tile=0, x=x.reshape(2, 4), partials=partials)
    final = gr.add_compute_set("final")
    gr.add_vertex(final, library.final_reduce, tile=0, partials=partials, out=total)
    engine = g.Engine(gr, [g.Sequence([g.Execute(fill), g.Execute(axpy), g.Execute(work),
                                       g.Execute(final)])])
    engine.run(0)
    expected = 7.0 + 0.5 * np.arange(8)
    np.testing.assert_array_equal(engine.read_tensor(x), expected)
    np.testing.assert_array_equal(engine.read_tensor(copied), expected)
    np.testing.assert_array_equal(engine.read_tensor(neg), -np.arange(8))
    np.testing.assert_allclose(engine.read_tensor(dot), expected @ np.arange(8), rtol=1e-6)
    np.testing.assert_allclose(engine.read_tensor(partials), expected.reshape(2, 4).sum(1))
    np.testing.assert_allclose(engine.read_tensor(total), expected.sum(), rtol=1e-6)
    steps = {s.name: s for s in engine.profile.steps}
    for name in ("fill", "axpy", "work", "final"):
      self.assertGreater(steps[name].compute_cycles[0], 0)
    # Four vertices in "work" share the tile's six workers: it costs the most.
    self.assertGreater(steps["work"].compute_cycles[0], steps["fill"].compute_cycles[0])

  def test_device_to_host_stream(self):
    gr = g.Graph(_target())
    v = gr.add_constant("float32", (3,), [1, 2, 3], "v")
    gr.map_tensor_linearly(v)
    out = gr.add_device_to_host_fifo("out", "float32", 3)
    engine = g.Engine(gr, [g.Copy(v, out)])
    host = np.zeros(6, np.float32)
    engine.connect_stream("out", host)
    engine.run(0)
    engine.run(0)
    np.testing.assert_array_equal(host, [1, 2, 3, 1, 2, 3])


if __name__ == "__main__":
  absltest.main()
