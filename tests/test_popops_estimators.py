"""poplibs-sourced estimators (cost models 3 and 4): reduce, cast, fill, scaled add, dynamic slice.

Each expected figure is worked out by hand from poplibs' published estimator
(the comment gives the sum), and the lowered programs are checked to pay
exactly what the estimator says, so each piece of work has one cost.
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import ipu_jax
from experiments import poplibs_reference
from ipu_jax.kernels import cost_model
from ipu_jax.kernels import estimators
from ipu_jax.kernels import popops
from ipu_jax.kernels import reduce as reduce_kernels

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_T1 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)


def _lower(fn, target, *args):
  return ipu_jax.jit(fn, target=target, verbose=0).lower(*args)


class HandWorkedFiguresTest(chex.TestCase, parameterized.TestCase):
  """Cost model 3 figures, each a sum over poplibs' estimator terms."""

  def test_cast_fp32_to_fp16(self):
    # Cast1D, 600 elements: 100 per worker at 4 per 2 cycles, 2 remainder
    # checks: 19 + 2 * 25 + 2 = 71; tile: 12 + 6 * (71 + 18) = 546.
    self.assertEqual(popops.cast_cycles(_T16, np.array([600]), np.float32, np.float16)[0], 546)

  def test_cast_fp16_to_fp32(self):
    # 100 per worker at 2 per cycle, 1 remainder check: 19 + 50 + 1 = 70;
    # 12 + 6 * (70 + 18) = 540.
    self.assertEqual(popops.cast_cycles(_T16, np.array([600]), np.float16, np.float32)[0], 540)

  def test_cast_int_to_float_is_scalar(self):
    # Not on the float pipeline: 1 element per 2 cycles: 19 + 200 = 219;
    # 12 + 6 * (219 + 18) = 1434.
    self.assertEqual(popops.cast_cycles(_T16, np.array([600]), np.int32, np.float32)[0], 1434)

  @parameterized.parameters((4, 6 * (16 + 50 + 6 + 1) + 50), (2, 6 * (26 + 25) + 50),
                            (1, 6 * (39 + 12) + 50))
  def test_fill(self, itemsize, expected):
    # Fill, 100 elements per worker: fp32 16 + 100/2 + 6 + 1; fp16 26 + 100/4;
    # 8-bit 39 + 100/8; plus the compute set's launch (50).
    self.assertEqual(estimators.fill_cycles(_T16, np.array([600]), itemsize)[0], expected)

  def test_scaled_add_fp32(self):
    # ScaledAddSupervisor, 1200 fp32: 600 vectors, 100 per worker:
    # 15 + 6 + 3 * 99 + 2 + 1 + 1 = 322; supervisor 21 + 11 + 7 + 12 + 6 = 57.
    self.assertEqual(estimators.scaled_add_cycles(_T16, np.array([1200]), 4)[0], 57 + 6 * 322)

  def test_dynamic_slice_fp32(self):
    # DynamicSlice1D, a 60-element region: 10 per worker, 5 64-bit copies:
    # 39 + 24 + 2 * 5 = 73 per worker; supervisor 25.
    self.assertEqual(estimators.dynamic_slice_cycles(_T16, np.array([60]), 4)[0], 25 + 6 * 73)

  def test_reduce_columns_fp32(self):
    # STRIDED_REDUCE, 60 outputs of 8 rows: 10 outputs per worker in 5 loops of
    # 3 + 5 + 3 + 7 = 18 cycles, 16 of setup: 106; tile 6 * 106 + 50.
    self.assertEqual(estimators.reduce_cycles(_T16, np.array([480]), 4, np.array([60]))[0],
                     6 * 106 + 50)

  def test_reduce_columns_fp32_max(self):
    # Cost model 4: max has no accumulators; STRIDED_REDUCE completes and
    # stores a group in 2 + 2 cycles (add: 3 + 2). 10 outputs per worker in 5
    # loops of 3 + 4 + 3 + 7 = 17 cycles, 16 of setup: 101; tile 6 * 101 + 50.
    for op in ("max", "min", "mul"):
      self.assertEqual(reduce_kernels.reduce_cycles(_T16, np.array([480]), np.array([60]),
                                                    np.float32, op)[0], 6 * 101 + 50)

  def test_reduce_single_output_fp16_max_and_add(self):
    # SCALAR_OUTPUT_SINGLE_INPUT, 1,000 fp16 over 6 workers (167 or 166).
    # max: 4 a loop of 1 cycle: 9 + 167 // 4 + 5 + 167 % 4 + 3 + 5 = 66;
    # add: 8 a loop of 2 cycles: 9 + 2 * 167 // 8 + 5 + 167 % 8 + 3 + 5 = 70.
    one = np.array([1000])
    self.assertEqual(reduce_kernels.reduce_cycles(_T16, one, None, np.float16, "max")[0],
                     6 * 66 + 50)
    self.assertEqual(reduce_kernels.reduce_cycles(_T16, one, None, np.float16, "add")[0],
                     6 * 70 + 50)
    # One worker's vertex alone, as the second on-tile stage uses it.
    self.assertEqual(reduce_kernels.reduce_vertex_cycles(_T16, 1, 167, np.float16, "max"), 66)

  def test_reduce_half_into_float_and_square_add(self):
    # poplibs' CycleEstimationFunctions.cpp. SCALAR_OUTPUT_SINGLE_INPUT,
    # 1,000 fp16 (167 or 166 a worker) summed (or squared and summed) into
    # fp32: 8 a loop of 2 cycles, no 5 cycles of conversion for a float
    # output: 9 + 2 * 167 // 8 + 5 + 167 % 8 + 3 = 65 (166: 9 + 41 + 5 + 6 + 3).
    one = np.array([1000])
    for op in ("add", "square_add"):
      self.assertEqual(reduce_kernels.reduce_cycles(_T16, one, None, np.float16, op,
                                                    out_dtype=np.float32)[0], 6 * 65 + 50)
    # STRIDED_REDUCE, 10 outputs of 3 rows: 3 + 2 + 6 + 5, then per loop of
    # gcd(min(8, 4), 10) = 2 outputs 3 + cyclesLoopPost + 3 + 2. Half in, float
    # out: 1 + 6 (cycleMap[FLOAT][ADD]; SQUARE_ADD has no row and takes ADD's).
    # Float in: ADD 3 + 2, SQUARE_ADD 2 + 2 (isOpAdd).
    vertex = reduce_kernels.reduce_vertex_cycles
    self.assertEqual(vertex(_T16, 10, 3, np.float16, "square_add", np.float32), 16 + 5 * 15)
    self.assertEqual(vertex(_T16, 10, 3, np.float16, "add", np.float32), 16 + 5 * 15)
    self.assertEqual(vertex(_T16, 10, 3, np.float16, "add"), 16 + 5 * 16)
    self.assertEqual(vertex(_T16, 10, 3, np.float32, "square_add"), 16 + 5 * 12)
    self.assertEqual(vertex(_T16, 10, 3, np.float32, "add"), 16 + 5 * 13)

  def test_reduce_logical_and_is_poplibs_cpp_vertex(self):
    # LOGICAL_AND has no assembly vertex: 7 + 24 + 8 + 22 per region + 25 per
    # element. 1,000 bools, 167 per worker: 61 + 25 * 167 = 4,236.
    self.assertEqual(reduce_kernels.reduce_cycles(_T16, np.array([1000]), None, np.bool_,
                                                  "and")[0], 6 * 4236 + 50)
    # A strided worker: 3 rows of 10 outputs, a region per row: 39 + 3 * 22 + 25 * 30.
    self.assertEqual(reduce_kernels.reduce_vertex_cycles(_T16, 10, 3, np.bool_, "or"),
                     39 + 66 + 750)

  @parameterized.parameters(("add", np.float32), ("max", np.float16), ("and", np.bool_))
  def test_reduce_on_some_tiles_is_each_tiles_own_figure(self, op, dtype):
    # Idle tiles (no inputs) cost nothing, and a busy tile's figure is the one
    # it gets alone: the estimate of a mostly idle [num_tiles] array (costed
    # on its busy tiles) equals the estimate of every tile by itself.
    # Also over many tiles mostly holding one pair of figures (costed once for
    # that pair), busy or all busy.
    rng = np.random.default_rng(3)
    shared = [0.9, 0.05, 0.05]
    for n, busy, values in ((64, 0.2, None), (600, 0.9, 3), (600, 1.0, 3)):
      elements = rng.integers(1, 4000, n) if values is None else rng.choice(
          rng.integers(1, 4000, values), n, p=shared)
      elements = elements * (rng.random(n) < busy)
      for outputs in (None, rng.integers(1, 90, n) if values is None
                      else rng.choice(rng.integers(1, 90, values), n, p=shared)):
        got = reduce_kernels.reduce_cycles(_T16, elements, outputs, dtype, op)
        alone = [reduce_kernels.reduce_cycles(
            _T16, elements[i:i + 1], None if outputs is None else outputs[i:i + 1], dtype,
            op)[0] for i in range(n)]
        np.testing.assert_array_equal(got, alone)
        self.assertEqual(got.dtype, np.float64)
        self.assertTrue(np.all(got[elements == 0] == 0))

  def test_reduce_unknown_op(self):
    with self.assertRaisesRegex(ValueError, "reduce op 'argmax' has no cost"):
      reduce_kernels.reduce_cycles(_T16, np.array([4]), None, np.float32, "argmax")

  def test_no_work_costs_nothing(self):
    zero = np.zeros(3, np.int64)
    for cycles in (popops.cast_cycles(_T16, zero, np.float32, np.float16),
                   estimators.fill_cycles(_T16, zero, 4),
                   estimators.scaled_add_cycles(_T16, zero, 2),
                   estimators.dynamic_slice_cycles(_T16, zero, 4),
                   estimators.reduce_cycles(_T16, zero, 4, zero)):
      np.testing.assert_array_equal(cycles, 0.0)

  def test_cost_model_version(self):
    # 5: fused elementwise chains as map expressions / scaled-arithmetic vertices.
    # 6: constant folding (equations of known operands computed on the host).
    # 7: PopSparse's block vertices scan buckets with their own supervisor figures.
    # 8: float32 sums of float16 values folded into popops' Reduce, siblings reduceMany'd.
    # 9: fp16 products with float32 partials at half the AMP rate (8 units).
    # 10: a pipeline's weight-update collectives every IPU's at once; ramp slots' copies.
    # 11: a split contraction's partials summed by poplin's ReduceAdd.
    # 12: a floating-point division by a constant costs popops' MULTIPLY.
    # 13: ipu_jax.ops.softmax (popnn's softmax) in the BERT attention.
    # 14: ipu_jax.ops.gelu (popnn's GELU vertices) in the BERT feed-forward block.
    # 15: operands with size-1 axes read broadcast (popops' BroadcastScalar), not copied.
    # 16: a pipelined step pays the host's measured time per execution, shared by its steps.
    # 17: matmul inputs received at the shared exchange-bus rate (poplin's ExchangeEstimator).
    # 18: a broadcast_in_dim read only by elementwise ops is a view, not a copy.
    # 19: convolution inputs received at the shared exchange-bus rate, as matmuls' in 17.
    # 20: add_any priced as popops' ADD; a reduction over size-1 axes only is a view.
    # 21: the AMP block is poplin's ConvPartial1x1 estimate case for case.
    # 22: a matmul's 16+ partials reduce in poplin's stages; static_'s own vertices.
    # 23: a convolution's 16+ partials reduce in poplin's stages, as a matmul's.
    # 24: memory only: an elementwise result is written over an operand it reads last.
    self.assertEqual(cost_model.COST_MODEL_VERSION, "24")

  def test_scaled_arithmetic_family(self):
    # 1,200 fp32: 600 vectors, 100 per worker, no remainder.
    one = np.array([1200])
    # ScaledSubtract: ScaledAdd's 57 + 6 * 322 and 7 more in the supervisor.
    self.assertEqual(popops.scaled_arithmetic_cycles(_T16, one, np.float32, "subtract")[0],
                     64 + 6 * 322)
    # Float aXPlusbY: supervisor 57 + 12; worker 16 + 6 + 3 * 99 + 1 + 1 = 321.
    self.assertEqual(popops.scaled_arithmetic_cycles(_T16, one, np.float32, "axplusby")[0],
                     69 + 6 * 321)
    # aXMinusbY: the same worker, no extra supervisor cycles.
    self.assertEqual(popops.scaled_arithmetic_cycles(_T16, one, np.float32, "axminusby")[0],
                     57 + 6 * 321)
    # Half aXPlusbY, 1,203 elements: 300 vectors (50 per worker), 3 left:
    # worker 15 + 6 + 3 * 49 + 2 + 1 + 1 + 5 + 7 + 6 = 190; supervisor
    # 21 + 11 + 13 + 12 + 6 + 12 = 75.
    self.assertEqual(popops.scaled_arithmetic_cycles(_T16, np.array([1203]), np.float16,
                                                     "axplusby")[0], 75 + 6 * 190)
    with self.assertRaisesRegex(ValueError, "'mul'.*expected one of"):
      popops.scaled_arithmetic_cycles(_T16, one, np.float32, "mul")

  @parameterized.parameters(("add", np.float32, 2, 0.5), ("mul", np.float16, 2, 0.25),
                            ("exp", np.float32, 1, 2.0), ("div", np.float32, 2, 3.5),
                            ("max", np.float32, 2, 0.5), ("exp", np.float16, 1, 0.5),
                            ("abs", np.float32, 1, 1.0), ("sin", np.float32, 1, None))
  def test_map_member_cycles(self, op, dtype, inputs, expected):
    # Natural-width ops: the table's cycles per vector (add 1 per 2 floats);
    # unrolled ones less their own loads and store, one cycle per 64-bit
    # word: exp f32 (6 - 2) / 2, div f32 (10 - 3) / 2, max f32 max(3 - 3, 1) / 2,
    # exp f16 (4 - 2) / 4; per-element ones as they are (abs 1).
    self.assertEqual(popops.map_member_element_cycles(_T16, op, dtype, inputs), expected)
    # No poplibs figure: the generic model's 6 cycles a vector, per element.
    self.assertEqual(estimators.map_member_element_cycles(_T16, "sin", np.float32, 1), 3.0)

  def test_map_expression_cycles(self):
    # 100 floats in vectors of 2 at 7 cycles: 50 vectors, 9 for workers 0-1,
    # 8 for the others; 101: the last worker (8 vectors) also does the odd
    # element, still under 9; 97: 48 vectors, 8 each, and the odd one makes
    # the last worker the busiest.
    self.assertEqual(popops.map_expression_cycles(_T16, np.array([100]), 7, 2, 29, 11)[0],
                     6 * (29 + 9 * 7) + 11)
    self.assertEqual(popops.map_expression_cycles(_T16, np.array([101]), 7, 2, 29, 11)[0],
                     6 * (29 + 9 * 7) + 11)
    self.assertEqual(popops.map_expression_cycles(_T16, np.array([97]), 7, 2, 29, 11)[0],
                     6 * (29 + 9 * 7) + 11)
    self.assertEqual(popops.map_expression_cycles(_T16, np.array([96]), 7, 2, 29, 11)[0],
                     6 * (29 + 8 * 7) + 11)
    np.testing.assert_array_equal(popops.map_expression_cycles(_T16, np.zeros(2, int), 7, 2,
                                                               29, 11), 0.0)

  def test_map_vectorisation_and_overheads(self):
    self.assertTrue(popops.map_vectorisable(np.float16))
    self.assertTrue(popops.map_vectorisable(np.bool_))
    self.assertFalse(popops.map_vectorisable(np.int32))
    self.assertIn("convert_element_type", popops.MAP_SCALAR_ONLY_OPS)
    self.assertEqual(popops.elementwise_overheads(_T16, "add", np.float32), (29, 11))
    self.assertEqual(popops.elementwise_overheads(_T16, "exp", np.float16), (33, 20))
    self.assertEqual(estimators.elementwise_overheads(_T16, "sin", np.float32), (12, 50))

  def test_kernel_figures_have_sources(self):
    for name in ("scaled_arithmetic_cycles", "map_expression_cycles",
                 "map_member_element_cycles", "elementwise_overheads", "MAP_LOOP_CYCLES",
                 "MAP_WORDS_PER_CYCLE", "NONLINEARITY", "BINARY"):
      self.assertTrue(hasattr(popops, name), name)
      source = cost_model.FIGURE_SOURCES["kernels.popops." + name]
      self.assertIn(source.kind, ("poplibs", "estimate"))


class OneCostPerWorkTest(chex.TestCase, parameterized.TestCase):
  """The lowered programs pay what the sourced estimators say."""

  @parameterized.parameters(("float32", 64, 100), ("float16", 64, 96), ("float32", 37, 99),
                            ("float32", 1000, 1), ("float16", 333, 1))
  def test_sum_matches_poplibs_reference(self, dtype, rows, outputs):
    # The vectorised model against poplibs' estimators evaluated per worker.
    shape = (rows, outputs) if outputs > 1 else (rows,)
    x = jnp.ones(shape, dtype)
    lowered = _lower(lambda x: jnp.sum(x, axis=0, dtype=x.dtype), _T1, x)
    step = next(s for s in lowered.profile.steps if s.op == "reduce_sum")
    expected = poplibs_reference.poplibs_reduce_cycles(rows, outputs, np.dtype(dtype).itemsize == 2)
    self.assertEqual(step.compute_cycles.max(), expected)

  @parameterized.parameters(("max", "float32", 37, 99), ("min", "float16", 64, 96),
                            ("max", "float16", 333, 1), ("prod", "float32", 1000, 1))
  def test_max_min_prod_match_poplibs_reference(self, fn, dtype, rows, outputs):
    # Each monoid costs its own Reduce vertex (cost model 4), not add's.
    op = {"max": "max", "min": "min", "prod": "mul"}[fn]
    shape = (rows, outputs) if outputs > 1 else (rows,)
    x = jnp.ones(shape, dtype)
    kwargs = {"dtype": x.dtype} if fn == "prod" else {}
    lowered = _lower(lambda x: getattr(jnp, fn)(x, axis=0, **kwargs), _T1, x)
    step = next(s for s in lowered.profile.steps if s.op == f"reduce_{fn}")
    expected = poplibs_reference.poplibs_reduce_cycles(rows, outputs, np.dtype(dtype).itemsize == 2,
                                                 op=op)
    self.assertEqual(step.compute_cycles.max(), expected)

  def test_sum_still_matches_jax(self):
    x = jnp.asarray(np.random.default_rng(0).normal(size=(37, 99)), jnp.float32)
    fn = lambda x: jnp.sum(x, axis=0)
    np.testing.assert_allclose(ipu_jax.jit(fn, target=_T16, verbose=0)(x), jax.jit(fn)(x),
                               rtol=1e-5, atol=1e-5)

  def test_astype_costs_cast1d(self):
    x = jnp.ones((16 * 600,), jnp.float32)
    lowered = _lower(lambda x: x.astype(jnp.float16), _T16, x)
    step = next(s for s in lowered.profile.steps if s.op == "convert_element_type")
    np.testing.assert_array_equal(step.compute_cycles, 546.0)  # worked out above

  def test_dynamic_slice_costs_dynamic_slice1d(self):
    table = jnp.arange(16 * 64 * 8, dtype=jnp.float32).reshape(16 * 64, 8)
    fn = lambda t, i: lax.dynamic_slice(t, (i, 0), (16, 8))
    lowered = _lower(fn, _T16, table, jnp.int32(5))
    step = next(s for s in lowered.profile.steps if s.op == "dynamic_slice")
    active = step.compute_cycles > 0
    self.assertTrue(active.any())
    floor = estimators.dynamic_slice_cycles(_T16, np.array([1]), 4)[0]
    self.assertTrue(np.all(step.compute_cycles[active] >= floor))
    np.testing.assert_array_equal(lowered(table, jnp.int32(5)), fn(table, jnp.int32(5)))

  def test_graph_api_scaled_add_costs_the_same(self):
    from ipu_jax import graph as g
    from ipu_jax.kernels import library
    gr = g.Graph(_T16)
    x = gr.add_variable("float32", (600,), "x")
    y = gr.add_constant("float32", (600,), np.ones(600), "y")
    scale = gr.add_constant("float32", (), 0.5, "scale")
    for t in (x, y, scale):
      gr.set_tile_mapping(t, 3)
    cs = gr.add_compute_set("axpy")
    gr.add_vertex(cs, library.scaled_add, tile=3, y=y, scale=scale, x=x)
    engine = g.Engine(gr, [g.Sequence([g.Execute(cs)])])
    step = next(s for s in engine.profile.steps if s.name == "axpy")
    self.assertEqual(step.compute_cycles[3],
                     estimators.scaled_add_cycles(_T16, np.array([600]), 4)[0])

  def test_reduce_accumulator_widths(self):
    self.assertEqual(reduce_kernels.accumulator_width(np.float16), 8)
    self.assertEqual(reduce_kernels.accumulator_width(np.float32), 4)
    self.assertEqual(reduce_kernels.accumulator_width(np.int32), 1)


if __name__ == "__main__":
  absltest.main()
