"""Tests of ipu_jax.report on synthetic program profiles."""

import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import numpy as np

from ipu_jax import report as report_lib
from ipu_jax.report import html as html_lib
from ipu_jax.report import plots as plots_lib
from ipu_jax.lowering.profile import MEMORY_CATEGORIES
from ipu_jax.lowering.profile import MemoryProfile
from ipu_jax.lowering.profile import ProgramProfile
from ipu_jax.lowering.profile import StepProfile
from ipu_jax.lowering.profile import TensorProfile
from ipu_jax.target import IPUTarget

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_OVER_TILE = 3


def _on_tiles(n, tiles, value):
  array = np.zeros(n)
  array[list(tiles)] = value
  return array


def _make_profile(num_ipus=1, over_limit=True, name="mlp", scale=1.0,
                  extra_variable_bytes=0):
  """Three supersteps on 16 tiles per IPU, a few tensors, one tile too full.

  Cycles (one IPU): compute 1000 + 4 x 200 + 300 = 2100, exchange 50 + 40 =
  90, sync 150 + 4 x 150 + 150 = 900 (the last sync is external on 2 IPUs).
  """
  target = IPUTarget.preset("ipu2", num_ipus=num_ipus, tiles_per_ipu=16)
  n = target.num_tiles
  last_sync = 1500.0 if num_ipus > 1 else 150.0
  steps = [
      StepProfile(
          name="dot_general/partials", op="dot_general", source="model.py:12",
          compute_cycles=_on_tiles(n, range(8), 1000 * scale),
          exchange_bytes_in=_on_tiles(n, range(8), 64),
          exchange_bytes_out=_on_tiles(n, range(8, 16), 64),
          exchange_cycles=50.0, sync_cycles=150.0, flops=100_000,
          vertices=_on_tiles(n, range(8), 1).astype(int)),
      StepProfile(
          name="add", op="add", source="model.py:13",
          compute_cycles=np.full(n, 200.0), exchange_bytes_in=np.zeros(n),
          exchange_bytes_out=np.zeros(n), exchange_cycles=0.0,
          sync_cycles=150.0, flops=1_600, executions=4),
      StepProfile(
          name="reduce_sum", op="reduce_sum", source="model.py:14",
          compute_cycles=_on_tiles(n, [0], 300.0),
          exchange_bytes_in=_on_tiles(n, [0], 32 * (n - 1)),
          exchange_bytes_out=_on_tiles(n, range(1, n), 32),
          exchange_cycles=40.0, sync_cycles=last_sync, flops=50,
          ipu_link_bytes=512 if num_ipus > 1 else 0),
  ]
  used = range(16)
  categories = {
      "variables": _on_tiles(n, range(8), 2048 + extra_variable_bytes),
      "constants": _on_tiles(n, range(4), 512),
      "vertex_state": _on_tiles(n, used, 100),
      "code": _on_tiles(n, used, 256),
      "temporaries": _on_tiles(n, range(8), 1024),
      "exchange_buffers": _on_tiles(n, used, 64),
  }
  if over_limit:
    categories["temporaries"][_OVER_TILE] = target.bytes_per_tile
  categories = {c: v.astype(np.int64) for c, v in categories.items()}
  peak = sum(categories.values())
  tensors = [
      TensorProfile(name="weights", shape=(64, 64), dtype="float32",
                    category="variables", tiles=np.arange(8),
                    bytes_on_tile=np.full(8, 2048), op="param",
                    source="model.py:5"),
      TensorProfile(name="bias", shape=(256,), dtype="float32",
                    category="constants", tiles=np.arange(4),
                    bytes_on_tile=np.full(4, 256), op="broadcast_in_dim",
                    source="model.py:6"),
      TensorProfile(name="partials", shape=(8, 64, 64), dtype="float32",
                    category="temporaries", tiles=np.array([_OVER_TILE]),
                    bytes_on_tile=np.array([target.bytes_per_tile]),
                    op="dot_general", source="model.py:12", live_from=0,
                    live_to=2),
  ]
  memory = MemoryProfile(
      by_category=categories, peak=peak,
      live_over_program=np.array([60_000, 80_000, 40_000]),
      tile_limit=target.bytes_per_tile)
  return ProgramProfile(target=target, steps=steps, tensors=tensors,
                        memory=memory, name=name, host_round_trips=2)


def _empty_profile():
  target = IPUTarget.preset("ipu1", tiles_per_ipu=4)
  zeros = np.zeros(4, np.int64)
  memory = MemoryProfile(by_category={c: zeros for c in MEMORY_CATEGORIES},
                         peak=zeros, live_over_program=np.zeros(0),
                         tile_limit=target.bytes_per_tile)
  return ProgramProfile(target=target, steps=[], tensors=[], memory=memory,
                        name="empty")


def _run_cli(*args):
  return subprocess.run([sys.executable, "-m", "ipu_jax.report", *args],
                        capture_output=True, text=True, check=False,
                        timeout=120)


class ReportNumbersTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(1, 2)
  def test_totals_match_profile(self, num_ipus):
    profile = _make_profile(num_ipus=num_ipus)
    report = report_lib.Report(profile)
    self.assertIs(report.profile, profile)
    self.assertEqual(report.compute_cycles, 2100.0)
    self.assertEqual(report.exchange_cycles, 90.0)
    self.assertEqual(report.sync_cycles,
                     900.0 + (1350.0 if num_ipus > 1 else 0.0))
    self.assertAlmostEqual(report.total_cycles, profile.total_cycles)
    self.assertAlmostEqual(report.estimated_seconds,
                           profile.estimated_seconds)
    self.assertEqual(report.total_flops, 100_000 + 4 * 1_600 + 50)

  def test_memory_and_structure(self):
    profile = _make_profile()
    report = report_lib.Report(profile)
    np.testing.assert_array_equal(report.memory_per_tile, profile.memory.peak)
    self.assertEqual(set(report.memory_by_category), set(MEMORY_CATEGORIES))
    np.testing.assert_array_equal(report.over_limit_tiles, [_OVER_TILE])
    self.assertEqual(report.tiles_used, 16)
    self.assertEqual(report.num_supersteps, 3)
    self.assertEqual(report.num_supersteps_executed, 6)
    self.assertEqual(report.num_compute_sets, 3)
    self.assertEqual(report.host_round_trips, 2)

  def test_flops_fraction_of_peak_uses_fp32_by_default(self):
    report = report_lib.Report(_make_profile())
    target = report.target
    peak = target.num_tiles * target.fp32_flops_per_cycle * target.clock_hz
    expected = report.total_flops / (report.estimated_seconds * peak)
    self.assertAlmostEqual(report.flops_fraction_of_peak, expected)
    self.assertEqual(report.flops_dtype, "float32")

  def test_flops_fraction_honours_declared_fp16(self):
    profile = _make_profile()
    profile.flops_dtype = "float16"
    report = report_lib.Report(profile)
    target = report.target
    peak = target.num_tiles * target.fp16_flops_per_cycle * target.clock_hz
    self.assertAlmostEqual(report.flops_fraction_of_peak,
                           report.total_flops / (report.estimated_seconds *
                                                 peak))

  def test_operations_aggregate_by_op_and_source(self):
    profile = _make_profile()
    repeated = profile.steps[1]
    profile.steps.append(StepProfile(
        name="add/again", op="add", source="model.py:13",
        compute_cycles=repeated.compute_cycles,
        exchange_bytes_in=repeated.exchange_bytes_in,
        exchange_bytes_out=repeated.exchange_bytes_out,
        exchange_cycles=0.0, sync_cycles=150.0, executions=2))
    rows = report_lib.Report(profile).cycles_by_operation()
    add = [r for r in rows if r["op"] == "add"]
    self.assertLen(add, 1)
    self.assertEqual(add[0]["steps"], 2)
    self.assertEqual(add[0]["executions"], 6)
    self.assertEqual(add[0]["cycles"], 6 * 350.0)
    self.assertEqual(rows[0]["op"], "add")  # the most cycles come first

  def test_rejects_non_profile(self):
    with self.assertRaises(TypeError):
      report_lib.Report({"steps": []})

  def test_empty_program(self):
    report = report_lib.Report(_empty_profile())
    self.assertEqual(report.total_cycles, 0.0)
    self.assertEqual(report.flops_fraction_of_peak, 0.0)
    self.assertIn("no supersteps", report.summary())
    with tempfile.TemporaryDirectory() as directory:
      files = report.save(directory)
      loaded = report_lib.Report.load(directory)
    self.assertLen(files, 6)   # report.json, trace.json, report.html, 3 PNGs
    self.assertEqual(loaded.summary(), report.summary())


def _host_io(step_cycles):
  """A looping program's host transfers of ``step_cycles`` per execution."""
  from ipu_jax.lowering.host_io import HostIOProfile
  return HostIOProfile(
      num_io_tiles=0, strategy="none", outer=4, inner=1, load_cycles=400.0, store_cycles=0.0,
      stores=0, io_exchange_cycles=0.0, compute_cycles=772.5, overlapped_iterations=0,
      serial_cycles=step_cycles, step_cycles=step_cycles, overlapped_fraction=0.0,
      host_bytes_in=4096, host_bytes_out=0, output_mode="all")


class SummaryTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(1, 2)
  def test_every_field_is_present(self, num_ipus):
    report = report_lib.Report(_make_profile(num_ipus=num_ipus))
    text = report.summary()
    expected = [
        "Target:", "ipu2", f"Number of IPUs:        {num_ipus}",
        "Total tiles:", "638,976 B", "1.330 GHz", "Tiles used:",
        "Always-live", "Not-always-live", "Variables", "Constants",
        "Temporaries", "Exchange buffers", "Vertex state", "Code",
        "Total over device", "Peak tile", "Mean per tile", "Worst tiles",
        "Compute sets:", "Supersteps:", "Compute:", "Exchange:", "Sync:",
        "Estimated time:", "FLOP", "Fraction of peak:",
        "Top operations by cycles", "dot_general", "model.py:12",
        "model.py:14", "Top tensors by memory", "weights", "model.py:5",
        "OUT OF MEMORY", f"tile {_OVER_TILE}",
    ]
    for needle in expected:
      self.assertIn(needle, text)
    self.assertEqual(str(report), text)

  def test_cycle_split_percentages(self):
    text = report_lib.Report(_make_profile()).summary()
    self.assertRegex(text, r"Compute:\s+2,100 \(68\.0%\)")
    self.assertRegex(text, r"Exchange:\s+90 \(2\.9%\)")
    self.assertRegex(text, r"Sync:\s+900 \(29\.\d%\)")

  def test_out_of_memory_names_tile_and_tensor(self):
    text = report_lib.Report(_make_profile()).summary()
    oom = text[text.index("OUT OF MEMORY"):]
    self.assertIn(f"tile {_OVER_TILE}", oom)
    self.assertIn("partials", oom)  # the largest tensor on that tile
    self.assertIn("1 tile(s) over the limit", oom)

  def test_headline_without_host_streams_is_the_device_cycles(self):
    report = report_lib.Report(_make_profile())
    first = report.summary().splitlines()[0]
    self.assertEqual(first, "Step (device only, no data streamed each iteration): 3,090 "
                            "cycles (2.323 us at 1.330 GHz)")
    totals = report.to_dict()["totals"]
    self.assertEqual((totals["step_cycles"], totals["cycles"]), (3090.0, 3090.0))
    self.assertFalse(totals["step_includes_host_io"])

  def test_headline_with_host_streams_read_back_from_an_older_file(self):
    # A report.json written before the headline keys has them rebuilt from host_io.
    profile = _make_profile()
    profile.host_io = _host_io(step_cycles=5000.0)
    report = report_lib.Report(profile)
    first = report.summary().splitlines()[0]
    self.assertEqual(first, "Step (host I/O included): 5,000 cycles (3.759 us at 1.330 GHz); "
                            "device only: 3,090 cycles (total_cycles)")
    document = report.to_dict()
    for key in ("step_cycles", "step_seconds", "step_includes_host_io", "device_cycles"):
      del document["totals"][key]
    loaded = report_lib.SavedReport(document)
    self.assertEqual((loaded.step_cycles, loaded.total_cycles), (5000.0, 3090.0))
    self.assertEqual(loaded.summary(), report.summary())

  def test_no_out_of_memory_section_when_everything_fits(self):
    text = report_lib.Report(_make_profile(over_limit=False)).summary()
    self.assertNotIn("OUT OF MEMORY", text)


class SaveTest(chex.TestCase, parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.directory = self.create_tempdir().full_path

  def _save_and_read(self, num_ipus, filename):
    """A report of ``num_ipus`` IPUs saved without plots, and its saved
    JSON file ``filename``."""
    report = report_lib.Report(_make_profile(num_ipus=num_ipus))
    report.save(self.directory, plots=False)
    with open(os.path.join(self.directory, filename)) as f:
      return report, json.load(f)

  def test_writes_all_files(self):
    out = os.path.join(self.directory, "new", "report")
    files = report_lib.Report(_make_profile()).save(out)
    names = sorted(os.path.basename(f) for f in files)
    self.assertEqual(names, sorted([
        "report.json", "trace.json", "report.html", "memory_per_tile.png",
        "cycles_heatmap.png", "live_memory.png"]))
    for path in files:
      self.assertTrue(os.path.isfile(path), path)

  @parameterized.parameters(1, 2)
  def test_report_json_round_trip(self, num_ipus):
    report, document = self._save_and_read(num_ipus, "report.json")
    self.assertEqual(document["schema"], "ipu-jax-report")
    self.assertEqual(document["version"], report_lib.SCHEMA_VERSION)
    self.assertEqual(document["target"]["num_ipus"], num_ipus)
    self.assertLen(document["steps"], 3)
    self.assertLen(document["tensors"], 3)
    self.assertEqual(document["memory"]["over_limit_tiles"], [_OVER_TILE])
    self.assertEqual(set(document["memory"]["categories"]),
                     set(MEMORY_CATEGORIES))
    self.assertEqual(document["steps"][1]["executions"], 4)
    self.assertEqual(document["totals"]["cycles"], report.total_cycles)

    for source in (self.directory,
                   os.path.join(self.directory, "report.json")):
      loaded = report_lib.Report.load(source)
      self.assertIsInstance(loaded, report_lib.SavedReport)
      self.assertEqual(loaded.total_cycles, report.total_cycles)
      self.assertEqual(loaded.total_flops, report.total_flops)
      self.assertEqual(loaded.target, report.target)
      np.testing.assert_array_equal(loaded.memory_per_tile,
                                    report.memory_per_tile)
      for category, values in report.memory_by_category.items():
        np.testing.assert_array_equal(loaded.memory_by_category[category],
                                      values)
      np.testing.assert_array_equal(loaded.live_over_program,
                                    report.live_over_program)
      self.assertEqual(loaded.summary(), report.summary())

  def test_version_2_keeps_placement_tile_cycles_and_peak_steps(self):
    profile = _make_profile()
    report = report_lib.Report(profile)
    report.save(self.directory, plots=False, html=False)
    with open(os.path.join(self.directory, "report.json")) as f:
      document = json.load(f)
    for tensor, row in zip(profile.tensors, document["tensors"]):
      on_tile = np.zeros(profile.target.num_tiles)
      for first, count, nbytes in row["placement"]:
        on_tile[first:first + count] = nbytes
      expected = np.zeros(profile.target.num_tiles)
      expected[tensor.tiles] = tensor.bytes_on_tile
      np.testing.assert_array_equal(on_tile, expected)
    # The tile over its limit peaks at the step where its temporaries and
    # exchange buffers are largest.
    peak_step = document["memory"]["peak_step"]
    self.assertLen(peak_step, profile.target.num_tiles)
    self.assertTrue(all(-1 <= s < len(profile.steps) for s in peak_step))
    loaded = report_lib.Report.load(self.directory)
    files = loaded.save(os.path.join(self.directory, "again"), html=False)
    self.assertIn("cycles_heatmap.png", [os.path.basename(f) for f in files])
    np.testing.assert_array_equal(loaded.data.tile_cycles,
                                  report.data.tile_cycles)

  def test_version_1_report_still_loads(self):
    report = report_lib.Report(_make_profile())
    document = report.to_dict()
    document["version"] = 1
    for tensor in document["tensors"]:
      del tensor["placement"]
    for step in document["steps"]:
      del step["compute_cycles_tiles"]
    del document["memory"]["peak_step"]
    loaded = report_lib.SavedReport(document)
    self.assertEqual(loaded.summary(), report.summary())
    files = loaded.save(self.directory, html=False)
    self.assertNotIn("cycles_heatmap.png",
                     [os.path.basename(f) for f in files])

  def test_load_rejects_other_files(self):
    path = os.path.join(self.directory, "report.json")
    for document, message in (({"schema": "other"}, "not an ipu-jax report"),
                              ({"schema": "ipu-jax-report", "version": 99},
                               "Upgrade")):
      with open(path, "w") as f:
        json.dump(document, f)
      with self.assertRaisesRegex(ValueError, message):
        report_lib.Report.load(path)

  @parameterized.parameters(1, 2)
  def test_trace_is_valid_chrome_trace(self, num_ipus):
    _, trace = self._save_and_read(num_ipus, "trace.json")
    self.assertEqual(trace["displayTimeUnit"], "ns")
    events = trace["traceEvents"]
    self.assertIsInstance(events, list)
    for event in events:
      for key in ("ph", "ts", "pid", "tid"):
        self.assertIn(key, event)
    spans = [e for e in events if e["ph"] == "X"]
    self.assertNotEmpty(spans)
    for span in spans:
      self.assertGreaterEqual(span["dur"], 0)
      self.assertIn(span["tid"], (0, 1, 2, 3))
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
    self.assertEqual(processes, {i: f"IPU {i}" for i in range(num_ipus)})
    self.assertEqual({s["pid"] for s in spans}, set(range(num_ipus)))
    threads = {e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    self.assertEqual(threads, {"sync", "exchange", "compute", "program"})

  def test_trace_spans_follow_bsp_order_and_scale_executions(self):
    report = report_lib.Report(_make_profile())
    spans = [e for e in report.trace()["traceEvents"] if e["ph"] == "X"]
    us_per_cycle = 1e6 / report.target.clock_hz
    add = [s for s in spans if s["args"]["op"] == "add"]
    self.assertEqual([s["tid"] for s in add], [0, 2])  # no exchange bytes
    compute = add[1]
    self.assertEqual(compute["args"]["executions"], 4)
    self.assertAlmostEqual(compute["dur"], 4 * 200 * us_per_cycle)
    self.assertEqual(compute["args"]["source"], "model.py:13")
    first = [s for s in spans if s["args"]["step"] == 0]
    self.assertEqual([s["tid"] for s in first], [0, 1, 2])
    for before, after in zip(first, first[1:]):
      self.assertAlmostEqual(before["ts"] + before["dur"], after["ts"])
    end = max(s["ts"] + s["dur"] for s in spans)
    self.assertAlmostEqual(end, report.total_cycles * us_per_cycle)

  def test_pngs_are_valid(self):
    files = report_lib.Report(_make_profile(num_ipus=2)).save(self.directory)
    pngs = [f for f in files if f.endswith(".png")]
    self.assertLen(pngs, 3)
    for path in pngs:
      with open(path, "rb") as f:
        self.assertEqual(f.read(8), _PNG_MAGIC, path)

  def test_memory_plot_has_limit_line(self):
    report = report_lib.Report(_make_profile())
    figure = plots_lib.memory_figure(report.data)
    limit = report.target.bytes_per_tile
    lines = [line for line in figure.axes[0].lines
             if np.allclose(line.get_ydata(), limit)]
    self.assertLen(lines, 1)
    self.assertIn("SRAM limit", lines[0].get_label())

  def test_memory_axis_scales_to_a_program_far_below_the_limit(self):
    report = report_lib.Report(_make_profile(over_limit=False))
    peak = int(report.memory_per_tile.max())
    limit = report.target.bytes_per_tile
    self.assertLess(peak, limit / 4)
    axes = plots_lib.memory_figure(report.data).axes[0]
    bottom, top = axes.get_ylim()
    self.assertEqual(bottom, 0)
    self.assertGreaterEqual(top, peak)
    self.assertLess(top, 1.5 * peak)          # the bars fill the plot
    self.assertEmpty([line for line in axes.lines
                      if np.allclose(line.get_ydata(), limit)])
    notes = [text.get_text() for text in axes.texts]
    self.assertTrue(any(f"SRAM limit {limit // 1024:,} KiB" in note
                        and "off the axis" in note for note in notes), notes)

  @parameterized.parameters(1, 2)
  def test_every_plot_title_names_the_program_and_target(self, num_ipus):
    report = report_lib.Report(_make_profile(num_ipus=num_ipus, name="mlp"))
    data = report.data
    figures = [plots_lib.memory_figure(data),
               plots_lib.cycles_heatmap_figure(data, data.tile_cycles),
               plots_lib.live_memory_figure(data)]
    for figure in figures:
      title = figure.axes[0].get_title()
      self.assertTrue(title.startswith("mlp: "), title)
      self.assertIn(f"ipu2, {f'{num_ipus} IPUs, ' if num_ipus > 1 else ''}"
                    f"{16 * num_ipus} tiles", title)

  def test_heatmap_bins_large_programs(self):
    cycles = np.ones((1000, 1472))
    executions = np.ones(1000, np.int64)
    image, step_starts, tile_starts = plots_lib.binned_cycles(cycles,
                                                                executions)
    self.assertLessEqual(image.shape[1], 400)
    self.assertLessEqual(image.shape[0], 512)
    self.assertEqual(image.shape, (len(tile_starts), len(step_starts)))
    self.assertEqual(image.sum(axis=1)[0], 1000)  # steps are summed

  def test_missing_matplotlib_writes_a_note(self):
    with mock.patch.object(plots_lib, "load_matplotlib", return_value=None):
      files = report_lib.Report(_make_profile()).save(self.directory,
                                                      html=False)
    names = sorted(os.path.basename(f) for f in files)
    self.assertEqual(names,
                     ["PLOTS_MISSING.txt", "report.json", "trace.json"])
    with open(os.path.join(self.directory, "PLOTS_MISSING.txt")) as f:
      self.assertIn("pip install ipu-jax[plots]", f.read())


class CompareTest(chex.TestCase, parameterized.TestCase):

  @parameterized.named_parameters(("live", False), ("loaded", True))
  def test_shows_deltas(self, load_b):
    a = report_lib.Report(_make_profile(name="before"))
    b = report_lib.Report(_make_profile(name="after", scale=2.0,
                                        extra_variable_bytes=1024))
    if load_b:
      directory = self.create_tempdir().full_path
      b.save(directory, plots=False)
      b = report_lib.Report.load(directory)
    text = report_lib.compare_reports(a, b)
    for needle in ("before", "after", "Variables", "Temporaries",
                   "Exchange buffers", "Compute", "Exchange", "Sync",
                   "Total", "dot_general", "reduce_sum", "add"):
      self.assertIn(needle, text)
    # Variables grew by 1,024 bytes on each of 8 tiles; 50% more.
    self.assertRegex(text, r"Variables\s+16,384\s+24,576\s+\+8,192\s+\+50\.0%")
    # Only the dot_general compute phase doubled (1,000 -> 2,000 cycles).
    self.assertRegex(text, r"dot_general\s+1,200\s+2,200\s+\+1,000\s+\+83\.3%")
    self.assertRegex(text, r"add\s+1,400\s+1,400\s+\+0\s+0\.0%")

  def test_new_operation(self):
    a = _make_profile()
    b = _make_profile()
    b.steps[0].op = "conv"
    text = report_lib.compare_reports(a, b)
    self.assertRegex(text, r"conv\s+0\s+1,200\s+\+1,200\s+new")
    self.assertRegex(text, r"dot_general\s+1,200\s+0\s+-1,200\s+-100\.0%")


class CommandLineTest(chex.TestCase):

  def test_summary_and_compare(self):
    root = self.create_tempdir().full_path
    first, second = os.path.join(root, "a"), os.path.join(root, "b")
    report_lib.Report(_make_profile(name="first")).save(first, plots=False)
    report_lib.Report(_make_profile(name="second", scale=3.0)).save(
        second, plots=False)

    result = _run_cli(first)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("Program: first", result.stdout)
    self.assertIn("OUT OF MEMORY", result.stdout)

    result = _run_cli(os.path.join(first, "report.json"), second)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertIn("Comparing A = first", result.stdout)
    self.assertIn("dot_general", result.stdout)
    self.assertRegex(result.stdout,
                     r"dot_general\s+1,200\s+3,200\s+\+2,000\s+\+166\.7%")
    # A package with __main__: no "found in sys.modules" RuntimeWarning.
    self.assertNotIn("RuntimeWarning", result.stderr)

  def test_html_pages(self):
    if html_lib.plotly_js() is None:
      self.skipTest("plotly is not installed (pip install ipu-jax[plots])")
    root = self.create_tempdir().full_path
    first, second = os.path.join(root, "a"), os.path.join(root, "b")
    report_lib.Report(_make_profile(name="first")).save(first, plots=False,
                                                         html=False)
    report_lib.Report(_make_profile(name="second", scale=3.0)).save(
        second, plots=False, html=False)
    for reports, marker in (((first,), '"name":"first"'),
                            ((first, second), '"b":{"name":"second"')):
      out = os.path.join(root, "page.html")
      result = _run_cli(*reports, "--html", out)
      self.assertEqual(result.returncode, 0, result.stderr)
      self.assertIn(f"wrote {out}", result.stdout)
      with open(out, encoding="utf-8") as f:
        page = f.read()
      self.assertIn(marker, page)

  def test_missing_report_fails_cleanly(self):
    result = _run_cli(os.path.join(self.create_tempdir().full_path, "none"))
    self.assertEqual(result.returncode, 1)
    self.assertIn("error:", result.stderr)


def _scoped_profile():
  """``_make_profile`` with module paths and a run setup, as a Keras-like fit has."""
  from ipu_jax.lowering.run_setup import RunSetup
  profile = _make_profile()
  for step, scope in zip(profile.steps, ("MLP/dense", "loss", "")):
    step.scope = scope
  for tensor, scope in zip(profile.tensors, ("MLP/dense", "", "MLP/dense")):
    tensor.scope = scope
  profile.run_setup = RunSetup(
      program="train", target="ipu2", num_ipus=1, tiles_per_ipu=16, replicas=1,
      gradient_accumulation_steps=2, gradient_accumulation_reduction="mean",
      replica_reduction="mean", steps_per_execution=4, micro_batch=8, global_batch=16,
      weight_updates_per_execution=2, param_dtypes=("float32",),
      matmul_available_memory_proportion=0.6, conv_available_memory_proportion=0.6)
  return profile


def _keras_fit_report():
  """The train report of a 16-tile fit with its optimizer state in streaming memory."""
  import optax
  from flax import nnx
  import ipu_jax
  import ipu_jax.keras
  import testing_utils
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.streaming.offload_optimizer_state = True
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(32, 8)).astype(np.float32), rng.integers(0, 4, 32)
  with ipu_jax.IPUStrategy(cfg).scope():
    model = ipu_jax.keras.Model(testing_utils.TwoLayerMLP(rngs=nnx.Rngs(0)))
    model.compile(optimizer=ipu_jax.keras.LossScaleOptimizer(optax.adam(1e-3)),
                  loss="sparse_categorical_crossentropy", steps_per_execution=2)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
  return model.reports["train"]


class SavedEqualsLiveTest(chex.TestCase, parameterized.TestCase):
  """``python -m ipu_jax.report DIR`` prints exactly what the live report printed."""

  @parameterized.named_parameters(("scoped_profile", _scoped_profile),
                                  ("keras_fit", _keras_fit_report))
  def test_saved_summary_is_the_live_summary(self, make):
    live = make()
    if isinstance(live, ProgramProfile):
      live = report_lib.Report(live)
    directory = self.create_tempdir().full_path
    live.save(directory, plots=False, html=False)
    saved = report_lib.load_report(directory)
    for top in (10, 3):
      self.assertEqual(saved.summary(top=top), live.summary(top=top))
    text = live.summary()
    self.assertIn("Run setup:\n  Program: train step", text)
    self.assertIn("Costliest module paths", text)
    if make is _keras_fit_report:
      self.assertIn("Streaming memory (one replica):", text)
      self.assertIn("Number formats:", text)
    result = _run_cli(directory)
    self.assertEqual(result.returncode, 0, result.stderr)
    self.assertEqual(result.stdout, text)
    result = _run_cli(directory, "--top", "3")
    self.assertEqual(result.stdout, live.summary(top=3))


class OutOfMemoryHintsTest(chex.TestCase, parameterized.TestCase):
  """Out-of-memory messages list what fills the tile, largest first, and the fitting remedy."""

  def _message(self, fn, *args):
    import ipu_jax
    one_tile = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(fn, target=one_tile).lower(*args)
    return str(caught.exception)

  def _listed_bytes(self, message):
    block = message.split("at its peak:\n", 1)[1].split("What may help:", 1)[0]
    return [int(line.split(" B ", 1)[0].replace(",", "")) for line in block.splitlines()
            if line.strip()]

  def _hints(self, message):
    return [line.strip() for line in message.split("What may help:\n", 1)[1].splitlines()]

  def test_optimizer_state_points_at_offloading_it(self):
    import jax.numpy as jnp

    def update(params, opt_state, grads):
      mu = {k: 0.9 * opt_state["mu"][k] + 0.1 * g for k, g in grads.items()}
      nu = {k: 0.99 * opt_state["nu"][k] + 0.01 * g * g for k, g in grads.items()}
      new = {k: params[k] - 1e-3 * mu[k] / (jnp.sqrt(nu[k]) + 1e-8) for k in params}
      return new, {"mu": mu, "nu": nu}

    leaf = lambda: jnp.ones((20_000,), jnp.float32)
    message = self._message(update, {"w": leaf()}, {"mu": {"w": leaf()}, "nu": {"w": leaf()}},
                            {"w": leaf()})
    self.assertIn("opt_state/mu/w", message)
    listed = self._listed_bytes(message)
    self.assertEqual(listed, sorted(listed, reverse=True))
    hints = self._hints(message)
    self.assertTrue(hints[0].startswith("- optimizer state: 160,000 B"), hints)
    for field in ("streaming.offload_optimizer_state", "streaming.replicated_tensor_sharding",
                  "memory.allow_out_of_memory"):
      self.assertIn(field, message)

  def test_kept_activations_point_at_recomputation(self):
    import jax
    import jax.numpy as jnp

    def loss(x):
      for _ in range(6):
        x = jnp.tanh(x) * 1.5
      return jnp.sum(x)

    message = self._message(jax.grad(loss), jnp.ones((40_000,), jnp.float32))
    listed = self._listed_bytes(message)
    self.assertEqual(listed, sorted(listed, reverse=True))
    hints = self._hints(message)
    self.assertTrue(hints[0].startswith("- activations:"), hints)
    self.assertIn("pipelining.recomputation", hints[0])
    self.assertNotIn("optimizer state", message)

  @parameterized.named_parameters(
      ("optimizer_state", "opt_state/0/mu/dense/kernel", "variables", "", "optimizer state",
       "streaming.offload_optimizer_state"),
      ("matmul_partials", "dot_general/partials", "temporaries", "dot_general",
       "matmul working memory", "matmuls.available_memory_proportion"),
      ("convolution", "working memory of step conv", "temporaries", "conv_general_dilated",
       "convolution working memory", "convolutions.available_memory_proportion"),
      ("activation", "tanh", "temporaries", "tanh", "activations", "pipelining.recomputation"),
      ("weights", "params/dense/kernel", "variables", "", "weights and inputs", None),
  )
  def test_each_kind_names_its_config_field(self, name, category, op, kind, field):
    from ipu_jax.lowering import memory_hints
    holding = memory_hints.Holding(name, category, 50_000, op)
    self.assertEqual(holding.kind, kind)
    lines = memory_hints.hint_lines([holding], over_by=1_000)
    if field is None:
      self.assertLen(lines, 1)  # only the fallbacks
    else:
      self.assertIn(field, lines[0])
      self.assertIn("50,000 B on this tile (more than the 1,000 B over)", lines[0])
    self.assertIn("memory.allow_out_of_memory", lines[-1])

  def test_optimizer_state_first_when_moving_it_alone_fits(self):
    from ipu_jax.lowering import memory_hints
    held = [memory_hints.Holding("tanh", "temporaries", 500_000, "tanh"),
            memory_hints.Holding("opt_state/mu/w", "variables", 40_000)]
    self.assertIn("optimizer state", memory_hints.hint_lines(held, over_by=20_000)[0])
    self.assertIn("activations", memory_hints.hint_lines(held, over_by=60_000)[0])


class BadArgumentsTest(chex.TestCase):
  """Paths and counts a user gets wrong are named, not OSErrors or slices."""

  def test_paths(self):
    report = report_lib.Report(_make_profile())
    a_file = self.create_tempfile(content="not json").full_path
    with self.assertRaisesRegex(ValueError, rf"Report.save: {a_file} is .* a file, not a "
                                            r"directory"):
      report.save(a_file, plots=False, html=False)
    with self.assertRaisesRegex(ValueError, rf"IPUConfig.report.directory: {a_file} is"):
      report_lib.maybe_auto_save(report, a_file)
    with self.assertRaisesRegex(ValueError, rf"{a_file} is not an ipu-jax report: it is not "
                                            r"JSON"):
      report_lib.load_report(a_file)

  def test_counts(self):
    report = report_lib.Report(_make_profile())
    # largest_tensors(-3) used to drop the last three; top=-1 printed "(-1 of 1)".
    for call, message in ((lambda: report.largest_tensors(-3), "largest_tensors: count"),
                          (lambda: report.summary(top="x"), "summary: top"),
                          (lambda: report_lib.compare_reports(report, report, top=-1),
                           "compare_reports: top")):
      with self.assertRaisesRegex(ValueError, message):
        call()


class AutoSaveTest(chex.TestCase):

  def test_none_directory_does_nothing(self):
    self.assertIsNone(report_lib.maybe_auto_save(
        report_lib.Report(_make_profile()), None))

  def test_unique_folders(self):
    root = self.create_tempdir().full_path
    report = report_lib.Report(_make_profile(name="train/step"))
    paths = [report_lib.maybe_auto_save(report, root) for _ in range(3)]
    self.assertLen(set(paths), 3)
    self.assertEqual([os.path.basename(p) for p in paths],
                     ["train_step-0", "train_step-1", "train_step-2"])
    for path in paths:
      self.assertEqual(os.path.dirname(path), root)
      self.assertTrue(os.path.isfile(os.path.join(path, "report.json")))
    os.rename(paths[0], os.path.join(root, "train_step-7"))
    self.assertEqual(
        os.path.basename(report_lib.maybe_auto_save(report, root)),
        "train_step-8")


if __name__ == "__main__":
  absltest.main()
