"""Reports of real programs: the tut4 matmul chain and the CNN training step.

Checks every output a user reads: the summary's fields, report.json,
trace.json (Trace Event format), the PNG plots, and comparisons.
"""

import functools
import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax import graph as g
from experiments import models
import testing_utils

_SUMMARY_FIELDS = (
    "Target", "Tiles used", "Memory", "Peak tile", "Worst tiles", "Always-live",
    "Not-always-live", "Variables", "Constants", "Temporaries", "Exchange buffers",
    "Vertex state", "Code", "Compute sets", "Supersteps", "Compute", "Exchange", "Sync",
    "Estimated time", "FLOPs", "Fraction of peak", "Top operations by cycles",
    "Top operations by working memory", "Top tensors by memory")


def _tut4_report():
  # 64 tiles hold the chain (16 do not); the graph's per-tile planning on all
  # 1,472 tiles cost ~8 s more and no check here depends on the tile count.
  target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=64)
  gr, _, prog, _ = testing_utils.chained_matmul_graph(target)
  return g.Engine(gr, [prog]).report()


@functools.lru_cache(maxsize=None)
def _cnn_workload():
  """``models.workload("cnn", batch=8)``'s step and arguments, drawn with NumPy.

  The reports only lower the step, so its values do not matter: an abstract
  model filled by NumPy skips Flax's eager initialisers (a sampler compiled
  per kernel shape, ~6 s of CPU). Built once; lowering only reads it.
  """
  from experiments import cifar_cnn
  graphdef, state = nnx.split(nnx.eval_shape(lambda: cifar_cnn.make_model(0)))
  optimizer = optax.adam(1e-3)
  model = nnx.merge(graphdef, testing_utils.numpy_weights(state, 0))
  step, params = models.make_train_step(model, optimizer)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(8, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, 8), jnp.int32)
  return step, (params, optimizer.init(params), x, y, jax.random.key(2))


def _cnn_step_report(proportion, tiles=0, conv_proportion=None):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.matmuls.available_memory_proportion = proportion
  cfg.convolutions.available_memory_proportion = (
      proportion if conv_proportion is None else conv_proportion)
  step, args = _cnn_workload()
  return ipu_jax.jit(step, config=cfg).lower(*args).report


class ProgramReportTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.reports = {"tut4": _tut4_report(), "cnn": _cnn_step_report(0.6)}

  def _check_files(self, report, directory):
    written = report.save(directory)
    names = {os.path.basename(p) for p in written}
    for name in ("report.json", "trace.json", "memory_per_tile.png", "cycles_heatmap.png",
                 "live_memory.png"):
      self.assertIn(name, names)
    for png in ("memory_per_tile.png", "cycles_heatmap.png", "live_memory.png"):
      with open(os.path.join(directory, png), "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    with open(os.path.join(directory, "report.json")) as f:
      document = json.load(f)
    self.assertEqual(document["schema"], "ipu-jax-report")
    with open(os.path.join(directory, "trace.json")) as f:
      trace = json.load(f)
    events = trace["traceEvents"]
    self.assertNotEmpty(events)
    for event in events:
      for key in ("ph", "ts", "pid", "tid"):
        self.assertIn(key, event)
      if event["ph"] == "X":
        self.assertGreaterEqual(event["dur"], 0)
    phases = {e["name"] for e in events if e["ph"] == "M"}
    self.assertIn("process_name", phases)
    loaded = ipu_jax.load_report(directory)
    self.assertEqual(loaded.summary(), report.summary())

  def test_tut4_report_carries_every_field(self):
    report = self.reports["tut4"]
    summary = report.summary()
    for field in _SUMMARY_FIELDS:
      self.assertIn(field, summary)
    self.assertIn("ab", summary)  # operations attributed to their compute sets
    self.assertEqual(report.total_flops, 2 * (900 * 600 * 300 + 900 * 300 * 200))
    self._check_files(report, self.create_tempdir().full_path)

  def test_cnn_step_report_carries_every_field(self):
    report = self.reports["cnn"]
    summary = report.summary()
    for field in _SUMMARY_FIELDS:
      self.assertIn(field, summary)
    for op in ("conv_general_dilated", "dot_general", "reduce_window_max"):
      self.assertIn(op, summary)
    self.assertIn("cifar_cnn.py", summary)  # source lines of the user's code
    self.assertGreater(report.flops_fraction_of_peak, 0)
    self._check_files(report, self.create_tempdir().full_path)

  def test_memory_proportion_changes_temporaries_and_cycles(self):
    # On 64 tiles the dense layer's weights are 73 KB per tile, more than
    # 10% of a tile's SRAM: the planner must work in smaller pieces.
    # The convolutions get 0.4: with the AMP cost model the weight-gradient
    # convolution's fastest plan within 0.6 needs 296 KB per tile, which on 64
    # tiles leaves too little beside the 256 KB resident and the live dense
    # gradient (out of memory on every tile; the conv planner does not split
    # the reduction axis, so it cannot trade that memory for partial sums).
    high = _cnn_step_report(0.6, tiles=64, conv_proportion=0.4)
    low = _cnn_step_report(0.1, tiles=64, conv_proportion=0.4)
    working = lambda r: r.temporary_memory_by_op()["dot_general"]  # noqa: E731
    self.assertLess(working(low), working(high))
    self.assertLessEqual(working(low), 0.1 * low.tile_limit)
    self.assertGreater(low.total_cycles, high.total_cycles)
    table = ipu_jax.compare_reports(high, low)
    self.assertIn("Working memory per tile by operation", table)
    self.assertIn("dot_general", table)
    self.assertIn("Temporaries", table)

  def test_out_of_memory_report_marks_tiles(self):
    cfg = ipu_jax.IPUConfig()
    cfg.memory.allow_out_of_memory = True
    tiny = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=2)
    report = ipu_jax.jit(lambda x: x * 2, target=tiny, config=cfg).lower(
        jax.numpy.ones(400_000)).report
    self.assertNotEmpty(report.over_limit_tiles)
    directory = self.create_tempdir().full_path
    report.save(directory, plots=False)  # the PNGs of a tile over its limit: test_report.py
    with open(os.path.join(directory, "report.json")) as f:
      document = json.load(f)
    self.assertNotEmpty(np.atleast_1d(document["memory"]["over_limit_tiles"]))


class FlopsDtypeTest(chex.TestCase):
  """The peak a program's FLOPs are held against is that of the dtype most of them run in."""

  @parameterized.parameters(("ipu2", "float32", "fp32_flops_per_cycle"),
                            ("ipu2", "float16", "fp16_flops_per_cycle"),
                            ("ipu2", "bfloat16", "fp16_flops_per_cycle"),
                            ("ipu21", "float8_e4m3fnuz", "fp8_flops_per_cycle"))
  def test_matmul_with_float32_epilogue(self, preset, dtype, rate):
    target = ipu_jax.IPUTarget.preset(preset, tiles_per_ipu=16)

    def f(a, b, bias):
      # A product on the AMP units (float32 accumulation) then a float32
      # epilogue: the product's FLOPs outnumber the epilogue's.
      y = jnp.matmul(a, b, preferred_element_type=jnp.float32)
      return jnp.tanh(y + bias)

    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(37, 48)), dtype)
    b = jnp.asarray(rng.normal(size=(48, 29)), dtype)
    bias = jnp.asarray(rng.normal(size=(29,)), jnp.float32)
    emulated = ipu_jax.jit(f, target=target, verbose=0)
    report = emulated.lower(a, b, bias).report
    self.assertEqual(report.flops_dtype, dtype)
    peak = target.num_tiles * getattr(target, rate) * target.clock_hz
    self.assertAlmostEqual(report.flops_fraction_of_peak,
                           report.total_flops / (report.estimated_seconds * peak))
    self.assertIn(f"FLOP/s ({dtype})", report.summary())
    chex.assert_trees_all_close(np.asarray(emulated(a, b, bias)),
                                np.asarray(jax.jit(f)(a, b, bias)), rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
