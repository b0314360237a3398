"""I/O tiles: fewer compute tiles, host transfers overlapped with compute, sizing, errors."""

import json
import os
import re
import shutil
import subprocess

from absl.testing import absltest, parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax.lowering import host_io
from ipu_jax.report import html as report_html
from ipu_jax.strategy import IPUStrategy
from testing_utils import random_array

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_page_harness.js")


def _config(tiles=32, io=0, strategy="OverlapLoops"):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles
  cfg.io_tiles.num_io_tiles = io
  cfg.io_tiles.strategy = strategy
  return cfg


def host_bound(w, xs):
  """Large inputs, a few flops per iteration."""
  def body(c, x):
    return c + jnp.sum(x[:2, :4]) * w, None
  return jax.lax.scan(body, jnp.zeros((), xs.dtype), xs)[0]


def compute_bound(w, xs):
  """Small inputs, matmuls per iteration."""
  def body(c, x):
    h = x
    for _ in range(4):
      h = jnp.tanh(h @ w)
    return c, h
  return jax.lax.scan(body, jnp.zeros(()), xs)


def _streaming_fit(io):
  """A fit streaming 1,024 floats a sample each step on 32 tiles (``io`` of them
  I/O tiles): its train report and trained parameters."""
  x, y = random_array((32, 1024), seed=8), random_array((32, 4), seed=9)
  with IPUStrategy(_config(32, io)).scope():
    model = ipu_jax.keras.Model(nnx.Linear(1024, 4, rngs=nnx.Rngs(0)))
    model.compile(optimizer=optax.sgd(0.01), loss="mse", steps_per_execution=8)
  model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
  return model.train_report, jax.tree.map(np.asarray, model.params)


class IOTilesTest(chex.TestCase, parameterized.TestCase):

  def test_compute_tiles_exclude_io_tiles(self):
    target = _config(32, 4).to_target()
    self.assertEqual((target.tiles_per_ipu, target.io_tiles_per_ipu), (28, 4))
    w, xs = random_array((64, 64), seed=1), random_array((4, 8, 64), seed=2)
    lowered = ipu_jax.jit(compute_bound, config=_config(32, 4)).lower(w, xs)
    self.assertEqual(lowered.profile.memory.peak.shape, (28,))
    self.assertEqual(lowered.report.to_dict()["target"]["tiles_per_ipu"], 28)

  @parameterized.parameters("JustInTime", "OverlapInnerLoop", "OverlapLoops")
  def test_numbers_unchanged(self, strategy):
    w, xs = random_array((64, 64), seed=1) * 0.1, random_array((6, 16, 64), seed=2)
    got = ipu_jax.jit(compute_bound, config=_config(32, 4, strategy))(w, xs)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.jit(compute_bound)(w, xs),
                                rtol=1e-5, atol=1e-6)
    got = ipu_jax.jit(host_bound, config=_config(32, 8, strategy))(np.float32(2.0), xs)
    chex.assert_trees_all_close(np.asarray(got), jax.jit(host_bound)(np.float32(2.0), xs),
                                rtol=1e-5, atol=1e-5)

  def test_host_bound_step_falls_to_max_plus_exchange(self):
    n = 8
    xs = random_array((n, 256, 512), seed=3)
    w = np.float32(1.5)
    base = ipu_jax.jit(host_bound, config=_config(64)).lower(w, xs).profile.host_io
    io = ipu_jax.jit(host_bound, config=_config(64, 16)).lower(w, xs).profile.host_io
    # Without I/O tiles every transfer is in turn with compute.
    self.assertEqual(base.overlapped_fraction, 0.0)
    self.assertEqual((base.stores, base.store_cycles), (0, 0.0))  # returns its carry only
    self.assertAlmostEqual(base.step_cycles, n * (base.compute_cycles + base.load_cycles),
                           delta=1.0)
    transfer = io.load_cycles
    self.assertGreater(transfer, io.compute_cycles)  # host-bound
    # First and last not overlapped; the rest cost max(compute, transfer) + exchange.
    expected = (io.compute_cycles + transfer + (n - 1) * max(io.compute_cycles, transfer)
                + n * io.io_exchange_cycles)
    self.assertAlmostEqual(io.step_cycles, expected, delta=1.0)
    # The overlap hides all of compute behind the transfers but the last iteration's.
    self.assertAlmostEqual(io.serial_cycles - io.step_cycles, (n - 1) * io.compute_cycles,
                           delta=1.0)
    self.assertGreater(io.overlapped_fraction, 0.5)

  def test_compute_bound_changes_by_lost_tiles_only(self):
    n = 8
    w, xs = random_array((128, 128), seed=1) * 0.1, random_array((n, 64, 128), seed=2)
    base = ipu_jax.jit(compute_bound, config=_config(32)).lower(w, xs).profile
    io = ipu_jax.jit(compute_bound, config=_config(32, 4)).lower(w, xs).profile
    h = io.host_io
    self.assertGreater(h.compute_cycles, h.load_cycles + h.store_cycles)  # compute-bound
    lost_tiles = io.total_cycles - base.total_cycles  # 28 compute tiles instead of 32
    self.assertGreaterEqual(lost_tiles, 0.0)
    change = h.step_cycles - base.host_io.step_cycles
    # The transfers hide behind compute; what remains is the tiles lost and the exchange.
    self.assertLessEqual(change, lost_tiles + n * h.io_exchange_cycles + 1.0)

  @parameterized.parameters(("JustInTime", 0), ("OverlapInnerLoop", 4 * (3 - 1)),
                            ("OverlapLoops", 4 * 3 - 1))
  def test_strategies_overlap_what_popart_says(self, strategy, overlapped):
    def nested(w, xs):  # 4 outer iterations of 3 inner ones (gradient accumulation)
      def outer(c, xg):
        def inner(c2, x):
          return c2 + jnp.sum(x) * w, None
        return jax.lax.scan(inner, c, xg)[0], None
      return jax.lax.scan(outer, jnp.zeros(()), xs)[0]

    xs = random_array((4, 3, 16, 32), seed=4)
    lowered = ipu_jax.jit(nested, config=_config(32, 4, strategy)).lower(np.float32(1), xs)
    h = lowered.profile.host_io
    self.assertEqual((h.outer, h.inner, h.overlapped_iterations), (4, 3, overlapped))
    self.assertEqual(h.overlapped_fraction > 0, overlapped > 0)
    self.assertEqual(lowered.report.to_dict()["host_io"]["overlapped_iterations"], overlapped)
    self.assertIn("Compute overlapped with I/O", lowered.report.summary())
    directory = self.create_tempdir().full_path
    lowered.report.save(directory, plots=False)
    saved = ipu_jax.report.load_report(directory)
    self.assertEqual(saved.host_io, lowered.report.host_io)
    self.assertIn("Compute overlapped with I/O", saved.summary())
    chex.assert_trees_all_close(np.asarray(lowered(np.float32(1), xs)),
                                jax.jit(nested)(np.float32(1), xs), rtol=1e-5)

  @parameterized.parameters(("OverlapInnerLoop", 4 * (2 - 1)), ("OverlapLoops", 4 * 2 - 1))
  def test_keras_fit_loops_over_updates_and_accumulation(self, strategy, overlapped):
    import optax
    from flax import nnx
    from ipu_jax.strategy import IPUStrategy

    x, y = random_array((64, 6), seed=6), random_array((64, 3), seed=7)
    params = {}
    for io in (0, 4):
      cfg = _config(32, io, strategy)
      cfg.training.gradient_accumulation_steps = 2
      with IPUStrategy(cfg).scope():
        model = ipu_jax.keras.Model(nnx.Linear(6, 3, rngs=nnx.Rngs(0)))
        model.compile(optimizer=optax.sgd(0.1), loss="mse", steps_per_execution=8)
      model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
      params[io] = jax.tree.map(np.asarray, model.params)
      h = model.train_report.host_io
      # 8 micro-batches per execution: 4 weight updates of 2 accumulated ones.
      self.assertEqual((h["outer"], h["inner"]), (4, 2))
      self.assertEqual(h["host_bytes_in"], 32 * (6 + 3) * 4)
      self.assertEqual(h["overlapped_iterations"], overlapped if io else 0)
      self.assertEqual(model.train_report.to_dict()["target"]["tiles_per_ipu"], 32 - io)
    chex.assert_trees_all_close(params[4], params[0], rtol=1e-5, atol=1e-6)

  def test_fit_headline_moves_as_the_step_with_host_io(self):
    # Issue 42: inputs streamed every step; I/O tiles cost device cycles (fewer
    # compute tiles) but hide the transfers, so the step as run gets faster.
    (base, base_params), (io, io_params) = _streaming_fit(0), _streaming_fit(4)
    chex.assert_trees_all_close(io_params, base_params, rtol=1e-5, atol=1e-6)
    self.assertGreater(io.total_cycles, base.total_cycles)  # device only: worse
    self.assertLess(io.host_io["step_cycles"], base.host_io["step_cycles"])  # as run: better
    for report in (base, io):
      step = report.host_io["step_cycles"]
      first = report.summary().splitlines()[0]
      self.assertTrue(first.startswith(f"Step (host I/O included): {step:,.0f} cycles"), first)
      self.assertIn(f"device only: {report.total_cycles:,.0f} cycles", first)
      self.assertEqual((report.step_cycles, report.step_includes_host_io), (step, True))
      totals = report.to_dict()["totals"]
      self.assertEqual((totals["step_cycles"], totals["step_includes_host_io"]), (step, True))
      self.assertEqual(totals["cycles"], report.total_cycles)  # keeps its meaning
      self.assertEqual(totals["device_cycles"], report.total_cycles)
    self.assertLess(io.step_cycles, base.step_cycles)  # the headline moves as the step does
    self.assertRegex(ipu_jax.report.compare_reports(base, io),
                     rf"Step \(host I/O included\)\s+{base.step_cycles:,.0f}\s+"
                     rf"{io.step_cycles:,.0f}\s+-")

  def test_fit_page_leads_with_the_step_with_host_io(self):
    node = shutil.which("node")
    if node is None:
      self.skipTest("node (nodejs) is not installed: the page's script cannot be run")
    if report_html.plotly_js() is None:
      self.skipTest("plotly is not installed (pip install ipu-jax[plots])")
    report, _ = _streaming_fit(4)
    directory = self.create_tempdir().full_path
    report.save(directory, plots=False)
    run = subprocess.run([node, _HARNESS, os.path.join(directory, "report.html")],
                         capture_output=True, text=True, timeout=60)
    self.assertEqual(run.returncode, 0, run.stderr)
    cards = re.findall(r'<div class="card">(.*?)<b>(.*?)</b></div>',
                       json.loads(run.stdout)["cards"])
    (label, step), (device_label, device) = cards[0], cards[1]
    self.assertEqual(label, "Step cycles (host I/O included)")
    self.assertAlmostEqual(float(step.replace(",", "")), report.host_io["step_cycles"], delta=1)
    self.assertEqual(device_label, "Device cycles (host I/O excluded)")
    self.assertEqual(device, f"{report.total_cycles:,.0f}")

  def test_no_loop_no_host_io(self):
    lowered = ipu_jax.jit(lambda x: x * 2, config=_config(32, 4)).lower(np.ones(8, np.float32))
    self.assertIsNone(lowered.profile.host_io)
    self.assertIsNone(lowered.report.to_dict()["host_io"])

  @parameterized.parameters((-2, "0 or a positive even"), (3, "0 or a positive even"),
                            (18, "too few compute tiles"))
  def test_bad_counts_name_the_field(self, count, message):
    cfg = _config(32)
    with self.assertRaisesRegex(ValueError, f"io_tiles.num_io_tiles.*{message}"):
      cfg.io_tiles.num_io_tiles = count
      cfg.to_target()

  def test_unknown_strategy_lists_the_valid_ones(self):
    with self.assertRaisesRegex(ValueError, "io_tiles.strategy.*'JustInTime', "
                                "'OverlapInnerLoop', 'OverlapLoops'"):
      _config().io_tiles.strategy = "Overlap"

  def test_io_tiles_out_of_memory(self):
    cfg = _config(32, 2)
    cfg.io_tiles.available_memory_proportion = 0.01
    xs = random_array((4, 64, 256), seed=5)
    with self.assertRaisesRegex(ipu_jax.OutOfMemoryError, "I/O tiles.*num_io_tiles to"):
      ipu_jax.jit(host_bound, config=cfg).lower(np.float32(1), xs)

  @parameterized.parameters((0, 0), (1, 2), (638_976, 2), (3 * 638_976, 4),
                            (5 * 638_976, 8))
  def test_suggest_num_io_tiles(self, nbytes, expected):
    cfg = ipu_jax.IPUConfig()
    cfg.io_tiles.available_memory_proportion = 1.0
    self.assertEqual(ipu_jax.io_tiles.suggest_num_io_tiles(nbytes, cfg), expected)

  def test_suggest_from_arrays_and_limit(self):
    cfg = _config(32)
    data = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)  # 4 MB: 7 tiles at 0.9
    with self.assertRaisesRegex(ValueError, "num_io_tiles=8 leaves too few"):
      ipu_jax.io_tiles.suggest_num_io_tiles(data, _config(14))
    self.assertEqual(ipu_jax.io_tiles.suggest_num_io_tiles(data, cfg), 8)
    self.assertEqual(host_io.suggest_num_io_tiles_for(4_000_000, 638_976 * 0.9), 8)


if __name__ == "__main__":
  absltest.main()
