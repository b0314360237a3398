"""report.html and the comparison page, opened in headless Chromium.

Each test saves the report of a real program lowered on a small target, loads
its HTML from disk in Chromium (driven by Selenium and Debian's
chromium-driver), clicks what a user clicks -- a tile of the memory map, a
superstep of the liveness and execution charts, a table header -- and checks
that the panels show the program's own numbers (read back from report.json).
A screenshot of every page lands in the test's temp dir.

The browser tests skip, saying why, only when Chromium, chromedriver or
Selenium is missing; ``.ci/run`` installs them.
"""

import json
import os
import shutil
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.report import html as html_lib

try:
  from selenium import webdriver
  from selenium.webdriver.chrome.service import Service
  from selenium.webdriver.common.action_chains import ActionChains
  from selenium.webdriver.common.by import By
  from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - reported by _browser_missing
  webdriver = None

_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_CHROMEDRIVER = shutil.which("chromedriver")


def _browser_missing():
  if webdriver is None:
    return "selenium is not installed (pip install ipu-jax[test])"
  if not _CHROMIUM or not _CHROMEDRIVER:
    return ("Chromium and chromedriver are not installed "
            "(apt-get install chromium chromium-driver; .ci/run does it)")
  if html_lib.plotly_js() is None:
    return "plotly is not installed (pip install ipu-jax[plots])"
  return None


def _mlp(x, w1, w2):
  with jax.named_scope("MLP"):
    with jax.named_scope("hidden"):
      hidden = jnp.tanh(x @ w1)
    with jax.named_scope("out"):
      return jnp.sum((hidden @ w2) ** 2, axis=1)


_SMALL = ((37, 50), (50, 70), (70, 11))
# Large enough that available_memory_proportion changes the matmul plans.
_WIDE = ((128, 384), (384, 512), (512, 64))


def _lowered_report(num_ipus=1, tiles_per_ipu=16, proportion=None,
                    shapes=_SMALL):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = tiles_per_ipu
  cfg.auto_select_ipus = num_ipus
  if proportion is not None:
    cfg.matmuls.available_memory_proportion = proportion
  rng = np.random.default_rng(0)
  args = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  return ipu_jax.jit(_mlp, config=cfg).lower(*args).report


_WINDOW_SIZE = (1400, 3400)
_browser = {}  # the module's one Chromium: {"driver": ..., "windows": {url: handle}}


def _start_browser():
  options = webdriver.ChromeOptions()
  options.binary_location = _CHROMIUM
  for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--window-size=%d,%d" % _WINDOW_SIZE):
    options.add_argument(flag)
  options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
  return webdriver.Chrome(service=Service(_CHROMEDRIVER), options=options)


def tearDownModule():
  if "driver" in _browser:
    _browser.pop("driver").quit()


class _BrowserTestCase(chex.TestCase, parameterized.TestCase):
  """Drives the module's one headless Chromium (started by the first class
  that needs it: each start costs seconds)."""

  driver = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    missing = _browser_missing()
    if missing:
      raise absltest.SkipTest(missing)
    if "driver" not in _browser:
      _browser["driver"] = _start_browser()
      _browser["windows"] = {}
    cls.driver = _browser["driver"]

  def _open(self, path):
    """Shows the page at ``path``, each page loaded once, in a window of its own.

    Loading plotly.js takes seconds; the tests of one page share it (each
    test's clicks replace the panels it reads), also when tests of another
    page ran in between.
    """
    url = "file://" + os.path.abspath(path)
    windows = _browser["windows"]
    if url in windows:
      self.driver.switch_to.window(windows[url])
      return
    if windows:
      self.driver.switch_to.new_window("window")
      self.driver.set_window_size(*_WINDOW_SIZE)
    windows[url] = self.driver.current_window_handle
    self.driver.get(url)
    WebDriverWait(self.driver, 60).until(
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute(
            "data-ready") == "true")

  def _screenshot(self, name):
    path = os.path.join(self.create_tempdir().full_path, name)
    self.driver.save_screenshot(path)
    self.assertGreater(os.path.getsize(path), 10_000)

  def _click_plot(self, div_id, x, y, axis="yaxis"):
    """Clicks the point (x, y) in data coordinates of a plotly chart."""
    div = self.driver.find_element(By.ID, div_id)
    offset = self.driver.execute_script(
        """const gd = document.getElementById(arguments[0]);
        const fl = gd._fullLayout, r = gd.getBoundingClientRect();
        const ya = fl[arguments[3]];
        const y = arguments[2] === null ? ya._offset + ya._length / 2
                                        : ya._offset + ya.l2p(arguments[2]);
        return [fl.xaxis._offset + fl.xaxis.l2p(arguments[1]) - r.width / 2,
                y - r.height / 2];""", div_id, x, y, axis)
    ActionChains(self.driver).move_to_element_with_offset(
        div, int(round(offset[0])), int(round(offset[1]))).click().perform()

  def _click_plot_at(self, div_id, x, category):
    """Clicks the point (x, category) of a chart with a category y axis."""
    div = self.driver.find_element(By.ID, div_id)
    offset = self.driver.execute_script(
        """const fl = document.getElementById(arguments[0])._fullLayout;
        const r = document.getElementById(arguments[0]).getBoundingClientRect();
        const ya = fl.yaxis;
        return [fl.xaxis._offset + fl.xaxis.l2p(arguments[1]) - r.width / 2,
                ya._offset + ya.l2p(ya.d2l(arguments[2])) - r.height / 2];""",
        div_id, x, category)
    ActionChains(self.driver).move_to_element_with_offset(
        div, int(round(offset[0])), int(round(offset[1]))).click().perform()

  def _text(self, element_id):
    return self.driver.find_element(By.ID, element_id).text

  def _assert_no_console_errors(self):
    errors = [entry["message"] for entry in self.driver.get_log("browser")
              if entry["level"] == "SEVERE"]
    self.assertEmpty(errors)

  def _choose_tile(self, tile):
    box = self.driver.find_element(By.ID, "tile-input")
    box.clear()
    box.send_keys(str(tile))
    box.send_keys("\t")  # the change event

  def _drawn_tile_liveness(self):
    """The chosen tile's stacked bytes per step, summed over the categories."""
    return self.driver.execute_script(
        """const traces = document.getElementById('tile-liveness-chart').data;
        return traces[0].y.map((_, s) => traces.reduce((sum, t) => sum + t.y[s], 0));""")

  def _assert_source_fits_its_panel(self, element_id, panel_id):
    """The whole file:line is laid out inside the panel, with no sideways scroll."""
    fits = self.driver.execute_script(
        """const el = document.getElementById(arguments[0]);
        const panel = document.getElementById(arguments[1]);
        const a = el.getBoundingClientRect(), p = panel.getBoundingClientRect();
        return [a.left >= p.left - 1, a.right <= p.right + 1,
                panel.scrollWidth <= panel.clientWidth + 1, window.innerWidth];""",
        element_id, panel_id)
    self.assertEqual(fits[:3], [True, True, True])
    self.assertEqual(fits[3], 1400)


class ReportPageTest(_BrowserTestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.directories = {}
    for num_ipus in (1, 2):
      directory = os.path.join(absltest.get_default_test_tmpdir(),
                               f"report-{num_ipus}-ipu")
      _lowered_report(num_ipus=num_ipus).save(directory)
      cls.directories[num_ipus] = directory

  def _document(self, num_ipus):
    with open(os.path.join(self.directories[num_ipus], "report.json")) as f:
      return json.load(f)

  @parameterized.parameters(1, 2)
  def test_clicking_the_peak_tile_shows_its_bytes_and_tensors(self, num_ipus):
    document = self._document(num_ipus)
    self._open(os.path.join(self.directories[num_ipus], "report.html"))
    tile = document["totals"]["peak_tile"]
    per_ipu = document["target"]["tiles_per_ipu"]
    columns = self.driver.execute_script("return REPORT.grid.columns;")
    rows = self.driver.execute_script("return REPORT.grid.rows;")
    ipu, local = divmod(tile, per_ipu)
    self._click_plot("tile-map", local % columns,
                     ipu * (rows + 1) + local // columns)
    heading = self._text("tile-heading")
    self.assertTrue(heading.startswith(f"tile {tile}"), heading)
    if num_ipus > 1:
      self.assertIn(f"(IPU {ipu})", heading)
    peak_bytes = document["totals"]["peak_tile_bytes"]
    self.assertIn(f"{peak_bytes:,} B", self._text("tile-peak-bytes"))
    panel = self._text("tile-panel")
    self.assertIn(f"{document['memory']['tile_limit']:,} B", panel)
    peak_step = document["memory"]["peak_step"][tile]
    self.assertIn(f"{peak_step}: {document['steps'][peak_step]['name']}",
                  panel)
    on_tile = [t["name"] for t in document["tensors"]
               if any(first <= tile < first + count and nbytes > 0
                      for first, count, nbytes in t["placement"])]
    self.assertNotEmpty(on_tile)
    for name in on_tile:
      self.assertIn(name, panel)
    self._screenshot(f"report-{num_ipus}-ipu.png")

  def test_clicking_a_superstep_lists_the_tensors_live_there(self):
    document = self._document(1)
    self._open(os.path.join(self.directories[1], "report.html"))
    always = sum(sum(document["memory"]["categories"][c])
                 for c in document["memory"]["always_live_categories"]
                 if c in document["memory"]["categories"])
    live = np.asarray(document["live_over_program"]) - always
    step = int(np.argmax(live))
    self._click_plot("liveness-chart", step, None)
    self.assertTrue(self._text("live-heading").startswith(
        f"Superstep {step}: {document['steps'][step]['name']}"))
    panel = self._text("liveness-panel")
    self.assertIn(f"{int(live[step]):,} B", panel)
    live_here = [t["name"] for t in document["tensors"]
                 if t["category"] not in document["memory"][
                     "always_live_categories"]
                 and t["live_from"] <= step <= t["live_to"]]
    self.assertNotEmpty(live_here)
    self.assertIn(f"Tensors live here ({len(live_here)})", panel)
    for name in live_here:
      self.assertIn(name, panel)

  @parameterized.parameters(1, 2)
  def test_execution_has_a_lane_per_ipu_and_shows_a_step(self, num_ipus):
    document = self._document(num_ipus)
    self._open(os.path.join(self.directories[num_ipus], "report.html"))
    chart = self._text("execution-chart")
    for ipu in range(num_ipus):
      self.assertIn(f"IPU {ipu}", chart)
    self.assertNotIn(f"IPU {num_ipus}", chart)
    steps = document["steps"]
    step = min(1, len(steps) - 1)
    self._click_plot("execution-chart", step, None)
    self.assertEqual(self._text("step-heading"), f"Superstep {step}")
    panel = self._text("step-panel")
    row = steps[step]
    cycles = row["sync_cycles"] + row["exchange_cycles"] + row["compute_cycles_max"]
    self.assertIn(f"{cycles:,.0f} (sync {row['sync_cycles']:,.0f}", panel)
    self.assertIn(f"{row['flops']:,}", panel)
    self.assertIn(f"Tile balance of superstep {step}",
                  self._text("balance-chart"))

  @parameterized.parameters(1, 2)
  def test_trace_has_a_lane_per_ipu_on_a_cycle_axis(self, num_ipus):
    document = self._document(num_ipus)
    self._open(os.path.join(self.directories[num_ipus], "report.html"))
    drawn = self.driver.execute_script(
        """const gd = document.getElementById('trace-chart');
        const phases = gd.data.filter((t) => ['sync', 'exchange', 'compute'].includes(t.name));
        return [phases.map((t) => t.y).flat(),
                Math.max(...phases.map((t) => t.x.map((x, i) => x + t.base[i])).flat()),
                gd.layout.xaxis.title.text];""")
    self.assertEqual(sorted(set(drawn[0])), [f"IPU {i}" for i in range(num_ipus)])
    self.assertAlmostEqual(drawn[1], document["totals"]["cycles"], places=3)
    self.assertEqual(drawn[2], "cycles")
    steps = document["steps"]
    # The last step ends at the last cycle: click its middle, see its details.
    last = len(steps) - 1
    row = steps[last]
    length = (row["sync_cycles"] + row["exchange_cycles"]
              + row["compute_cycles_max"]) * row["executions"]
    middle = document["totals"]["cycles"] - length / 2
    lane = row["ipus"][0]
    self._click_plot_at("trace-chart", middle, f"IPU {lane}")
    self.assertEqual(self._text("step-heading"), f"Superstep {last}")
    self._assert_no_console_errors()

  @parameterized.parameters(1, 2)
  def test_choosing_a_tile_shows_its_liveness_up_to_its_peak(self, num_ipus):
    document = self._document(num_ipus)
    self._open(os.path.join(self.directories[num_ipus], "report.html"))
    peak = document["memory"]["peak"]
    # A tile that is not the peak tile, holding bytes.
    tile = max((t for t in range(len(peak))
                if t != document["totals"]["peak_tile"] and peak[t] > 0),
               key=lambda t: (peak[t], t))
    self._choose_tile(tile)
    WebDriverWait(self.driver, 10).until(
        lambda d: d.find_element(By.ID, "tile-heading").text.startswith(
            f"tile {tile}"))
    curve = self._drawn_tile_liveness()
    self.assertLen(curve, len(document["steps"]))
    # The curve is the memory model's own: its top is the tile's peak, at
    # the step the report records.
    self.assertEqual(max(curve), peak[tile])
    self.assertEqual(int(np.argmax(curve)), document["memory"]["peak_step"][tile])
    heading = self._text("tile-peak-heading")
    self.assertIn(f"tile {tile}", heading)
    marked = self.driver.execute_script(
        """const gd = document.getElementById('tile-map');
        const find = (name) => gd.data.find((t) => t.name === name).customdata[0];
        return [find('selected tile'), find('peak tile')];""")
    self.assertEqual(marked, [tile, document["totals"]["peak_tile"]])
    # Every tile's number is written in its cell (16 tiles per IPU).
    numbers = self.driver.execute_script(
        """return Array.from(document.querySelectorAll('#tile-map .heatmaplayer text'))
            .map((t) => t.textContent).filter((t) => t !== '');""")
    self.assertEqual(sorted(int(n) for n in numbers), list(range(len(peak))))
    self._assert_no_console_errors()

  def test_vertex_table_and_exchange_heatmap(self):
    document = self._document(2)
    self._open(os.path.join(self.directories[2], "report.html"))
    rows = self.driver.find_elements(By.CSS_SELECTOR, "#codelets tbody tr")
    self.assertLen(rows, len(document["codelets"]))
    self.assertSequenceAlmostEqual(
        sorted(float(r.find_elements(By.TAG_NAME, "td")[3].get_attribute(
            "data-value")) for r in rows),
        sorted(r["cycles"] for r in document["codelets"]))
    drawn = self.driver.execute_script(
        """const t = document.getElementById('exchange-heatmap').data[0];
        return [t.y, t.z.map((row) => row.reduce((a, b) => a + b, 0))];""")
    exchanged = [i for i, s in enumerate(document["steps"])
                 if s["exchange_bytes_in"] or s["exchange_bytes_out"]
                 or s["ipu_link_bytes"]]
    self.assertEqual(drawn[0], [str(i) for i in exchanged])
    self.assertEqual(drawn[1], [document["steps"][i]["exchange_bytes_out"]
                                for i in exchanged])
    links = self.driver.find_elements(
        By.CSS_SELECTOR, "#exchanges tbody tr td:nth-child(5)")
    self.assertEqual(sum(int(c.get_attribute("data-value")) for c in links),
                     sum(s["ipu_link_bytes"] for s in document["steps"]))
    self._assert_no_console_errors()

  def test_detail_panels_show_a_whole_file_line_at_1400px(self):
    document = self._document(1)
    self._open(os.path.join(self.directories[1], "report.html"))
    step = max(range(len(document["steps"])),
               key=lambda i: len(document["steps"][i]["source"]))
    self.driver.execute_script("showStep(arguments[0]);", step)
    source = document["steps"][step]["source"]
    self.assertRegex(source, r":\d+$")
    self.assertEqual(self._text("step-source"), source)
    self._assert_source_fits_its_panel("step-source", "step-panel")

  def test_section_anchors_land_below_the_sticky_header(self):
    self._open(os.path.join(self.directories[1], "report.html"))
    for section in ("vertices", "exchanges", "memory"):
      self.driver.find_element(
          By.CSS_SELECTOR, f"header nav a[href='#{section}']").click()
      gap = self.driver.execute_script(
          """const h = document.querySelector('header').getBoundingClientRect();
          const s = document.querySelector('#' + arguments[0] + ' h2').getBoundingClientRect();
          return s.top - h.bottom;""", section)
      self.assertGreaterEqual(gap, 0, section)

  def test_operations_table_sorts_by_any_column(self):
    report = ipu_jax.Report.load(self.directories[1])
    self._open(os.path.join(self.directories[1], "report.html"))
    header = self.driver.find_element(
        By.XPATH, "//table[@id='operations']//th[text()='FLOPs']")
    header.click()
    cells = self.driver.find_elements(
        By.CSS_SELECTOR, "#operations tbody tr td:nth-child(11)")
    shown = [int(c.get_attribute("data-value")) for c in cells]
    expected = sorted((row["flops"] for row in report.cycles_by_operation()),
                      reverse=True)
    self.assertEqual(shown, expected)
    header.click()
    shown = [int(c.get_attribute("data-value")) for c in self.driver.find_elements(
        By.CSS_SELECTOR, "#operations tbody tr td:nth-child(11)")]
    self.assertEqual(shown, expected[::-1])
    self.assertIn(f"{report.total_cycles:,.0f}", self._text("cards"))

  def test_operations_table_has_a_module_path_column(self):
    report = ipu_jax.Report.load(self.directories[1])
    self._open(os.path.join(self.directories[1], "report.html"))
    headers = [h.text for h in self.driver.find_elements(
        By.CSS_SELECTOR, "#operations thead th")]
    self.assertEqual(headers[:3], ["Operation", "Source", "Module path"])
    shown = {c.text for c in self.driver.find_elements(
        By.CSS_SELECTOR, "#operations tbody tr td:nth-child(3)")}
    self.assertLessEqual({"MLP/hidden", "MLP/out"}, shown)
    self.assertEqual(shown, {row["scope"] or "(no scope)"
                             for row in report.cycles_by_operation()})

  def test_a_loaded_report_renders_the_same_page(self):
    directory = self.create_tempdir().full_path
    ipu_jax.Report.load(self.directories[1]).save(directory, plots=False)
    self._open(os.path.join(directory, "report.html"))
    self.driver.find_element(By.ID, "show-peak-tile").click()
    document = self._document(1)
    self.assertIn(f"{document['totals']['peak_tile_bytes']:,} B",
                  self._text("tile-peak-bytes"))


class ComparisonPageTest(_BrowserTestCase):

  def test_shows_memory_and_cycle_differences(self):
    root = self.create_tempdir().full_path
    reports = {}
    for proportion in (0.6, 0.1):
      reports[proportion] = _lowered_report(tiles_per_ipu=64,
                                            proportion=proportion,
                                            shapes=_WIDE)
      reports[proportion].save(os.path.join(root, str(proportion)),
                               plots=False, html=False)
    a, b = reports[0.6], reports[0.1]
    self.assertNotEqual(a.temporary_memory_by_op(), b.temporary_memory_by_op())
    out = os.path.join(root, "compare.html")
    subprocess.run([sys.executable, "-m", "ipu_jax.report",
                    os.path.join(root, "0.6"), os.path.join(root, "0.1"),
                    "--html", out], check=True, capture_output=True)
    self._open(out)
    totals = self.driver.find_element(By.ID, "totals")
    for label, value_a, value_b in (
        ("Total cycles", a.total_cycles, b.total_cycles),
        ("Peak tile bytes", a.memory_per_tile.max(), b.memory_per_tile.max())):
      row = totals.find_element(By.XPATH, f".//tr[td[1][text()='{label}']]")
      cells = row.find_elements(By.TAG_NAME, "td")
      self.assertEqual(cells[1].text, f"{value_a:,.0f}")
      self.assertEqual(cells[2].text, f"{value_b:,.0f}")
      delta = value_b - value_a
      self.assertEqual(cells[3].text, f"{delta:+,.0f}" if delta else "0")
      if delta:
        self.assertIn("worse" if delta > 0 else "better",
                      cells[3].get_attribute("class"))
    memory_a, memory_b = (a.temporary_memory_by_op()["dot_general"],
                          b.temporary_memory_by_op()["dot_general"])
    row = self.driver.find_element(
        By.XPATH, "//table[@id='operations']//tr[td[1][text()='dot_general']]")
    cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
    self.assertEqual(cells[5:8], [f"{memory_a:,}", f"{memory_b:,}",
                                  f"{memory_b - memory_a:+,}"])
    self.assertIn("Bytes at each tile's peak", self._text("memory-per-tile"))
    self._screenshot("compare.png")


class MainJobPageTest(_BrowserTestCase):
  """The README's main job, run as a user runs it, then its page opened."""

  def test_main_job_starts_quietly_and_its_page_shows_its_numbers(self):
    root = self.create_tempdir().full_path
    report_dir = os.path.join(root, "mnist")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.mnist", "--tiles_per_ipu=16",
         "--epochs=1", "--verbose=2", f"--report_dir={report_dir}"],
        cwd=repository, env=env, capture_output=True, text=True,
        timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    for probe in ("Unable to initialize backend", "libtpu", "CUDA"):
      self.assertNotIn(probe, proc.stdout + proc.stderr)
    with open(os.path.join(report_dir, "report.json")) as f:
      document = json.load(f)
    self._open(os.path.join(report_dir, "report.html"))
    totals = document["totals"]
    cards = self._text("cards")
    self.assertIn(f"{totals['cycles']:,.0f}", cards)
    self.assertIn(f"tile {totals['peak_tile']}: "
                  f"{totals['peak_tile_bytes']:,} B", cards)
    # The three views drew the report's own numbers.
    drawn = self.driver.execute_script(
        """const get = (id) => document.getElementById(id).data;
        return [get('tile-map')[0].z.flat().filter((v) => v !== null),
                get('liveness-chart')[0].y,
                get('execution-chart').length];""")
    self.assertEqual(sorted(drawn[0]), sorted(document["memory"]["peak"]))
    self.assertLen(drawn[1], len(document["steps"]))
    self.assertEqual(drawn[2], 3)  # sync, exchange, compute of one IPU lane
    self._check_main_job_views(document)
    self._screenshot("mnist.png")

  def _check_main_job_views(self, document):
    """The PopVision-like views of the main job's page (issue 31)."""
    # The program tree lists the training loop with its repeat count: one
    # trip per weight update of an execution, its steps the matmuls.
    updates = document["run_setup"]["weight_updates_per_execution"]
    loops = self.driver.find_elements(
        By.CSS_SELECTOR, "#program-tree details[data-kind='repeat']")
    self.assertLen(loops, 1)
    loop = loops[0]
    self.assertEqual(loop.get_attribute("data-iterations"), str(updates))
    self.assertIn(f"repeat ×{updates}", loop.text)
    first, last = (int(loop.get_attribute(k)) for k in ("data-first", "data-last"))
    ops = [s["op"] for s in document["steps"][first:last + 1]]
    self.assertGreaterEqual(ops.count("dot_general"), 6)  # 3 layers, fwd + bwd
    # Opening the loop's run of steps lists them; clicking one shows it.
    run = loop.find_element(By.CSS_SELECTOR, "details[data-kind='steps']")
    run.find_element(By.TAG_NAME, "summary").click()
    # The page fills a run's list when it opens: wait for it (a fresh CI
    # machine once looked before the list was there).
    link = WebDriverWait(self.driver, 10).until(
        lambda d: run.find_element(By.CSS_SELECTOR, f"a[data-step='{first + 1}']"))
    link.click()
    self.assertEqual(self._text("step-heading"), f"Superstep {first + 1}")
    # The trace: one lane per IPU on a cycle axis, the loop's later trips
    # summarised, ending at the total.
    trace = self.driver.execute_script(
        """const gd = document.getElementById('trace-chart');
        const phases = gd.data.filter((t) => ['sync', 'exchange', 'compute'].includes(t.name));
        const loops = gd.data.find((t) => t.name.startsWith('loops'));
        return [[...new Set(phases.map((t) => t.y).flat())], gd.layout.xaxis.title.text,
                loops.hovertext, loops.x];""")
    self.assertEqual(trace[0], ["IPU 0"])
    self.assertEqual(trace[1], "cycles")
    # The loop's span lasts as long as the program tree says the loop does.
    tree_loop = [n for n in document["program_tree"]["children"]
                 if n["kind"] == "repeat"][0]
    span = trace[2].index(f"repeat ×{updates}")
    self.assertAlmostEqual(trace[3][span], tree_loop["total_cycles"], places=3)
    self.assertIn(f"{updates - 4} more iterations of repeat ×{updates}", trace[2])
    # Choosing a tile shows its liveness curve, whose top is its peak.
    tile = 5
    self._choose_tile(tile)
    WebDriverWait(self.driver, 10).until(
        lambda d: d.find_element(By.ID, "tile-heading").text.startswith(
            f"tile {tile}"))
    self.assertEqual(max(self._drawn_tile_liveness()),
                     document["memory"]["peak"][tile])
    # The vertex table and the exchange heatmap.
    self.assertLen(self.driver.find_elements(By.CSS_SELECTOR, "#codelets tbody tr"),
                   len(document["codelets"]))
    self.assertNotEmpty(document["codelets"])
    heatmap = self.driver.execute_script(
        "return document.getElementById('exchange-heatmap').data[0].type;")
    self.assertEqual(heatmap, "heatmap")
    # A detail panel keeps a whole file:line in view at 1400 px.
    self.assertRegex(self._text("step-source"), r"\.py:\d+$")
    self._assert_source_fits_its_panel("step-source", "step-panel")
    self._assert_no_console_errors()


class WithoutBrowserTest(chex.TestCase):
  """What needs no browser: the page's file and its fallbacks."""

  def test_page_is_self_contained(self):
    if html_lib.plotly_js() is None:
      self.skipTest("plotly is not installed")
    directory = self.create_tempdir().full_path
    _lowered_report().save(directory, plots=False)
    with open(os.path.join(directory, "report.html"), encoding="utf-8") as f:
      page = f.read()
    # Nothing is fetched: no external scripts, styles or frames.
    for loader in ("<script src=", "<link ", "<iframe"):
      self.assertNotIn(loader, page)
    self.assertIn('id="report-data"', page)

  def test_without_plotly_save_says_how_to_get_the_html(self):
    directory = self.create_tempdir().full_path
    with absltest.mock.patch.object(html_lib, "plotly_js", return_value=None):
      files = _lowered_report().save(directory, plots=False)
    names = sorted(os.path.basename(f) for f in files)
    self.assertEqual(names, ["HTML_MISSING.txt", "report.json", "trace.json"])
    with open(os.path.join(directory, "HTML_MISSING.txt")) as f:
      self.assertIn("pip install ipu-jax[plots]", f.read())


if __name__ == "__main__":
  absltest.main()
