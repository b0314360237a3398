"""The executable cache (ipu_jax/executable_cache.py, cached_program.py),
recompilation reasons (recompilation.py) and the report's "Host side".

Where a new process matters (XLA's compile skipped, writers racing) the
program runs in subprocesses; the rest runs here with a fresh
``ipu_jax.jit`` object, which has nothing in memory and reads the disk.
"""

import contextlib
import hashlib
import io
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
from unittest import mock
import warnings

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import cached_program
from ipu_jax import compile_progress
from ipu_jax import executable_cache
from ipu_jax.lowering.replica_axis import REPLICA_AXIS
from ipu_jax.report.html import report_html

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny program in a new process: prints its result and host record as JSON.
_SCRIPT = """
import json, sys
import jax.numpy as jnp, numpy as np, ipu_jax
cfg = ipu_jax.IPUConfig()
cfg.device.tiles_per_ipu = 16
cfg.executable_cache_dir = sys.argv[1]
scale = float(sys.argv[2])
f = ipu_jax.jit(lambda x, w: jnp.tanh(x @ w * scale).sum(0), config=cfg)
x = jnp.linspace(-1, 1, 7 * 9, dtype=jnp.float32).reshape(7, 9)
w = jnp.linspace(0, 1, 9 * 5, dtype=jnp.float32).reshape(9, 5)
y = np.asarray(f(x, w))
print(json.dumps({"y": y.tolist(), "host": f.lower(x, w).host.as_dict()}))
"""


def _start(cache_dir, scale=1.0):
  env = dict(os.environ, PYTHONPATH=_ROOT, JAX_PLATFORMS="cpu")
  env.pop(executable_cache.CACHE_ENV, None)
  # The suite's own XLA cache (tests/conftest.py) would serve the second
  # process's compile: these processes use the one the executable cache sets up.
  for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
               "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"):
    env.pop(name, None)
  return subprocess.Popen([sys.executable, "-c", _SCRIPT, cache_dir, str(scale)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=_ROOT)


def _finish(process):
  out, err = process.communicate(timeout=300)
  if process.returncode:
    raise AssertionError(f"subprocess failed:\n{err[-3000:]}")
  return json.loads(out.strip().splitlines()[-1])


def _expected(scale=1.0):
  x = jnp.linspace(-1, 1, 7 * 9, dtype=jnp.float32).reshape(7, 9)
  w = jnp.linspace(0, 1, 9 * 5, dtype=jnp.float32).reshape(9, 5)
  return np.asarray(jax.jit(lambda x, w: jnp.tanh(x @ w * scale).sum(0))(x, w))


def _config(cache_dir):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.executable_cache_dir = cache_dir
  return cfg


def _program(x, w):
  return jax.nn.relu(x @ w) * 2.0 - 1.0


def _args():
  x = jnp.asarray(np.random.RandomState(0).normal(size=(6, 11)), jnp.float32)
  w = jnp.asarray(np.random.RandomState(1).normal(size=(11, 3)), jnp.float32)
  return x, w


def _run(cache_dir, fn=_program, args=None):
  """A fresh ``ipu_jax.jit`` of ``fn`` called once: ``(its Lowered, the result)``."""
  args = _args() if args is None else args
  f = ipu_jax.jit(fn, config=_config(cache_dir))
  result = np.asarray(f(*args))
  return f.lower(*args), result


def _entries(cache_dir):
  folder = os.path.join(cache_dir, "programs")
  return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".ipuexe"))


def _rewrite_payload(path, payload, versions=None):
  """Replace the entry at ``path`` by ``payload`` under a valid header (checksum
  and length right), with ``versions`` in it (default: the entry's own)."""
  with open(path, "rb") as f:
    magic, header = f.readline(), json.loads(f.readline())
  header.update(length=len(payload), sha256=hashlib.sha256(payload).hexdigest())
  if versions is not None:
    header["versions"] = versions
  with open(path, "wb") as f:
    f.write(magic + json.dumps(header).encode() + b"\n" + payload)


class _WritesMarker:
  """Unpickling it creates the file ``marker`` (what an attacker's code would do)."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (open, (self.marker, "w"))


def _npz(**arrays):
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  return buffer.getvalue()


def _document(document):
  return np.frombuffer(json.dumps(document).encode(), np.uint8)


class _Test(chex.TestCase, parameterized.TestCase):

  @contextlib.contextmanager
  def _cache_dir(self):
    """A directory that lives until the test ends (after its last compile)."""
    yield self.create_tempdir().full_path

  def tearDown(self):
    # The cache directories are temporary: JAX's compilation cache must not
    # stay pointed at one that is gone.
    executable_cache.disable_compilation_cache()
    super().tearDown()


class NewProcessTest(_Test):

  def test_second_process_loads_instead_of_lowering_and_compiling(self):
    with self._cache_dir() as cache_dir:
      first = _finish(_start(cache_dir))
      second = _finish(_start(cache_dir))
      changed = _finish(_start(cache_dir, scale=0.5))
    chex.assert_trees_all_close(np.asarray(first["y"]), _expected(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(second["y"]), np.asarray(first["y"]))
    self.assertEqual(first["host"]["cache"], "stored")
    self.assertGreater(first["host"]["lowering_seconds"], 0)
    self.assertEqual(first["host"]["compile_cache_hits"], 0)
    # The second process: no lowering, XLA's executable loaded, not compiled.
    self.assertEqual(second["host"]["cache"], "hit")
    self.assertEqual(second["host"]["lowering_seconds"], 0)
    self.assertGreaterEqual(second["host"]["compile_cache_hits"], 1)
    # A changed program (another constant) misses, and computes its own numbers.
    self.assertEqual(changed["host"]["cache"], "stored")
    chex.assert_trees_all_close(np.asarray(changed["y"]), _expected(0.5), rtol=1e-5, atol=1e-6)

  def test_two_processes_writing_at_once_leave_a_valid_cache(self):
    with self._cache_dir() as cache_dir:
      racers = [_start(cache_dir), _start(cache_dir)]
      results = [_finish(p) for p in racers]
      for result in results:
        chex.assert_trees_all_close(np.asarray(result["y"]), _expected(), rtol=1e-5, atol=1e-6)
      folder = os.path.join(cache_dir, "programs")
      self.assertEqual([n for n in os.listdir(folder) if n.startswith(".tmp-")], [])
      self.assertLen(_entries(cache_dir), 1)
      with warnings.catch_warnings():
        warnings.simplefilter("error", executable_cache.CacheWarning)
        key = os.path.basename(_entries(cache_dir)[0])[:-len(".ipuexe")]
        self.assertIsNotNone(executable_cache.load(cache_dir, key, cached_program.ENTRY_CODEC))


class SameProcessTest(_Test):

  def _lower_twice(self, cache_dir, fn=_program):
    first, want = _run(cache_dir, fn)
    second, got = _run(cache_dir, fn)  # a new jit object: nothing in memory
    return first, second, want, got

  def test_hit_gives_same_numbers_report_and_tile_program(self):
    with self._cache_dir() as cache_dir:
      stored, loaded, want, got = self._lower_twice(cache_dir)
    x, w = _args()
    chex.assert_trees_all_close(got, np.asarray(jax.jit(_program)(x, w)), rtol=1e-5,
                                atol=1e-6)
    np.testing.assert_array_equal(got, want)
    self.assertEqual((stored.host.cache, loaded.host.cache), ("stored", "hit"))
    self.assertEqual(loaded.report.total_cycles, stored.report.total_cycles)
    self.assertEqual(loaded.num_supersteps, stored.num_supersteps)
    # A hit has no tile program (reading it lowers nothing); lower_uncached gives it.
    self.assertIsNone(loaded.program)
    self.assertIsNone(loaded.inputs)
    full = loaded.lower_uncached()
    self.assertEqual([t.shape for t in full.inputs], [t.shape for t in stored.inputs])
    self.assertEqual(type(full.program), type(stored.program))
    self.assertEqual(full.report.total_cycles, loaded.report.total_cycles)

  def test_another_call_site_hits(self):
    # Source lines are not in the key: an edited script still loads.
    x, w = _args()
    with self._cache_dir() as cache_dir:
      _run(cache_dir)
      f = ipu_jax.jit(_program, config=_config(cache_dir))
      got = np.asarray(f(x, w))
      self.assertEqual(f.lower(x, w).host.cache, "hit")
    chex.assert_trees_all_close(got, np.asarray(jax.jit(_program)(x, w)), rtol=1e-5, atol=1e-6)

  def test_loaded_program_runs_with_the_replica_axis_bound(self):
    with self._cache_dir() as cache_dir:
      _, loaded, _, _ = self._lower_twice(cache_dir, lambda x, w: x @ w)
      x, w = _args()
      xs = jnp.stack([x, 2 * x])
      got = jax.vmap(lambda xi: loaded.apply(xi, w), axis_name=REPLICA_AXIS)(xs)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(jnp.stack([x @ w, 2 * x @ w])),
                                rtol=1e-5, atol=1e-5)

  def test_results_fed_back_compile_nothing_new(self):
    # An exported call returns committed arrays; uncommitted first arguments
    # would make the second call a second XLA program.
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    step = lambda x: jnp.tanh(x) * 0.5
    x = np.linspace(-1, 1, 33, dtype=np.float32)
    with self._cache_dir() as cache_dir:
      for expected_cache in ("stored", "hit"):
        lowered, y = _run(cache_dir, step, (x,))
        self.assertEqual(lowered.host.cache, expected_cache)
        y = jnp.asarray(y)
        del compiles[:]
        z = np.asarray(lowered(lowered(y)))
        self.assertEqual(compiles, [])
        chex.assert_trees_all_close(z, np.tanh(np.tanh(np.tanh(x) * 0.5) * 0.5) * 0.5,
                                    rtol=1e-5, atol=1e-6)

  def test_loaded_program_keeps_traps_and_rounding_state(self):
    # Trapped exceptions (the record's table is in the entry) and stochastic
    # rounding (the generators are device state among the constants).
    def config(cache_dir):
      cfg = _config(cache_dir)
      cfg.floating_point_behaviour.inv = True
      cfg.floating_point_behaviour.esr = "ON"
      return cfg
    fn = lambda x: (jnp.log(x) * 1.001).astype(jnp.float16)
    x = np.linspace(0.5, 2, 40, dtype=np.float32)
    results = []
    with self._cache_dir() as cache_dir:
      for _ in range(2):
        f = ipu_jax.jit(fn, config=config(cache_dir))
        results.append(np.asarray(f(x)))
        with self.assertRaises(ipu_jax.FloatingPointException):
          np.asarray(f(-x))
        lowered = f.lower(x)
        self.assertLen(lowered.device_state, 1)
    self.assertEqual(lowered.host.cache, "hit")
    np.testing.assert_array_equal(results[0], results[1])  # same seed, same bits

  @parameterized.parameters("truncated", "garbage", "version")
  def test_bad_entry_is_ignored_with_a_warning(self, damage):
    x, w = _args()
    with self._cache_dir() as cache_dir:
      _run(cache_dir)
      [path] = _entries(cache_dir)
      with open(path, "rb") as f:
        data = f.read()
      if damage == "truncated":
        data = data[:len(data) // 2]
      elif damage == "garbage":
        data = b"not a cache file\n" + data[40:]
      else:
        data = data.replace(f'"ipu_jax": "{ipu_jax.__version__}"'.encode(),
                            b'"ipu_jax": "0.0.0-old"')
      with open(path, "wb") as f:
        f.write(data)
      with self.assertWarns(executable_cache.CacheWarning) as caught:
        again, got = _run(cache_dir)
      expected = {"truncated": "truncated", "garbage": "not an executable cache file",
                  "version": "another version: ipu_jax '0.0.0-old'"}[damage]
      self.assertIn(expected, str(caught.warning))
      self.assertEqual(again.host.cache, "stored")  # lowered and replaced
      self.assertEqual(_run(cache_dir)[0].host.cache, "hit")
    chex.assert_trees_all_close(got, np.asarray(jax.jit(_program)(x, w)), rtol=1e-5, atol=1e-6)

  @parameterized.named_parameters(
      # NumPy refuses these (allow_pickle=False), in words of its own version.
      ("pickle_current_header", "pickle", False, "does not load (ValueError: "),
      ("pickle_format_1", "pickle", True, "old pickle format (format 1, now 2)"),
      ("object_array_in_npz", "object_array", False, "does not load (ValueError: "),
      ("unknown_type_named", "unknown_type", False,
       "names a type the executable cache does not load: 'Popen'"))
  def test_entry_that_would_run_code_is_never_loaded(self, attack, old_format, expected):
    # Whoever can write the cache directory must not run code in its readers:
    # nothing is unpickled and no class is looked up by a name in the file.
    x, w = _args()
    with self._cache_dir() as cache_dir:
      marker = os.path.join(cache_dir, "marker")
      _run(cache_dir)
      [path] = _entries(cache_dir)
      payload = {
          "pickle": lambda: pickle.dumps({"profile": _WritesMarker(marker)}),
          "object_array": lambda: _npz(
              document=_document({"entry": {"$": "array", "index": 0},
                                  "arrays": [["g0", 0, [1]]]}),
              g0=np.array([_WritesMarker(marker)], dtype=object)),
          "unknown_type": lambda: _npz(document=_document(
              {"entry": {"$": "Popen", "fields": {"args": ["touch", marker]}},
               "arrays": []})),
      }[attack]()
      versions = dict(executable_cache.library_versions(), format=1) if old_format else None
      _rewrite_payload(path, payload, versions)
      with self.assertWarns(executable_cache.CacheWarning) as caught:
        again, got = _run(cache_dir)
      self.assertFalse(os.path.exists(marker))
      self.assertIn(expected, str(caught.warning))
      self.assertEqual(again.host.cache, "stored")  # lowered and replaced
      self.assertEqual(_run(cache_dir)[0].host.cache, "hit")
    chex.assert_trees_all_close(got, np.asarray(jax.jit(_program)(x, w)), rtol=1e-5, atol=1e-6)

  def test_bfloat16_program_with_constants_hits(self):
    # Arrays NumPy has no name for (bfloat16) and constants go through the entry.
    table = jnp.asarray(np.linspace(-2, 2, 33), jnp.bfloat16)
    fn = lambda x: (x.astype(jnp.bfloat16) * table + table[::-1]).astype(jnp.float32)
    x = np.linspace(-1, 1, 33, dtype=np.float32)
    with self._cache_dir() as cache_dir:
      stored, want = _run(cache_dir, fn, (x,))
      loaded, got = _run(cache_dir, fn, (x,))
    self.assertEqual((stored.host.cache, loaded.host.cache), ("stored", "hit"))
    np.testing.assert_array_equal(got, want)
    chex.assert_trees_all_close(got, np.asarray(jax.jit(fn)(x)), rtol=1e-2, atol=1e-2)
    self.assertEqual(loaded.report.to_dict()["totals"], stored.report.to_dict()["totals"])

  def test_unwritable_directory_is_a_clear_error_before_lowering(self):
    with tempfile.NamedTemporaryFile() as blocker:
      bad = os.path.join(blocker.name, "cache")
      f = ipu_jax.jit(_program, config=_config(bad))
      with self.assertRaisesRegex(ValueError, r"IPUConfig\.executable_cache_dir=.*cannot be "
                                  r"written"):
        f(*_args())
      self.assertEqual(f.cache_size, 0)
      os.environ[executable_cache.CACHE_ENV] = bad
      try:
        g = ipu_jax.jit(_program, config=_config(None))
        with self.assertRaisesRegex(ValueError, executable_cache.CACHE_ENV):
          g(*_args())
      finally:
        del os.environ[executable_cache.CACHE_ENV]

  def test_environment_variable_turns_the_cache_on(self):
    with self._cache_dir() as cache_dir:
      os.environ[executable_cache.CACHE_ENV] = cache_dir
      try:
        lowered, _ = _run(None)
      finally:
        del os.environ[executable_cache.CACHE_ENV]
      self.assertEqual(lowered.host.cache, "stored")
      self.assertLen(_entries(cache_dir), 1)

  def test_program_with_a_host_callback_runs_uncached(self):
    def printing(x, w):
      jax.debug.callback(lambda v: None, x.sum())
      return x @ w
    x, w = _args()
    with self._cache_dir() as cache_dir:
      lowered, got = _run(cache_dir, printing)
      cache = lowered.host.cache
      self.assertEqual(os.listdir(os.path.join(cache_dir, "programs")), [])
    chex.assert_trees_all_close(got, np.asarray(x @ w), rtol=1e-5, atol=1e-5)
    self.assertStartsWith(cache, "not cached: NotImplementedError: serialization of host_callbacks")


class HitLineTest(_Test):
  """A hit says so in one line, where compile progress is printed (stderr)."""

  def _hit(self, cache_dir, verbose=None, progress=True):
    x, w = _args()
    _run(cache_dir)
    cfg = _config(cache_dir)
    cfg.report.progress = progress
    f = ipu_jax.jit(_program, config=cfg, verbose=verbose)
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
      got = np.asarray(f(x, w))
    self.assertEqual(f.lower(x, w).host.cache, "hit")
    chex.assert_trees_all_close(got, np.asarray(jax.jit(_program)(x, w)), rtol=1e-5,
                                atol=1e-6)
    return err.getvalue() + out.getvalue()

  def test_hit_prints_one_line(self):
    with self._cache_dir() as cache_dir:
      text = self._hit(cache_dir)
    self.assertRegex(text, r"^Compiling '_program': loaded from the executable cache in "
                     r"\d+\.\d{3}s \(entry [0-9a-f]{12}\), not lowered\n$")

  @parameterized.named_parameters(("verbose_0", "verbose"), ("config", "config"),
                                  ("environment", "environment"), ("scope", "scope"))
  def test_quiet_switch_silences_it(self, switch):
    with self._cache_dir() as cache_dir, contextlib.ExitStack() as stack:
      if switch == "environment":
        stack.enter_context(mock.patch.dict(os.environ,
                                            {compile_progress.PROGRESS_ENV: "0"}))
      if switch == "scope":
        stack.enter_context(compile_progress.verbosity(0))
      text = self._hit(cache_dir, verbose=0 if switch == "verbose" else None,
                       progress=switch != "config")
    self.assertEqual(text, "")


class RecompilationTest(_Test):

  def test_new_shape_is_logged_with_the_argument(self):
    f = ipu_jax.jit(_program, config=_config(None))
    x, w = _args()
    f(x, w)
    with self.assertLogs("ipu_jax.jit", logging.INFO) as logs:
      f(x[:4], w)
    self.assertIn("x: float32[6,11] -> float32[4,11]", "\n".join(logs.output))
    self.assertEqual(f.lower(x, w).host.compiled_because, "first call")
    self.assertIn("new argument shape/dtype", f.lower(x[:4], w).host.compiled_because)

  def test_new_static_value_is_named(self):
    f = ipu_jax.jit(lambda x, n: x * n, config=_config(None), static_argnums=1)
    f(jnp.ones(3), 2)
    with self.assertLogs("ipu_jax.jit", logging.INFO) as logs:
      f(jnp.ones(3), 3)
    self.assertIn("new static value: 1: 2 -> 3", "\n".join(logs.output))


class HostSideReportTest(_Test):

  def test_report_json_summary_and_saved_report(self):
    x, w = _args()
    f = ipu_jax.jit(_program, config=_config(None))
    f(x, w)
    f(x, w)
    report = f.lower(x, w).report
    host = report.to_dict()["host_side"]
    self.assertEqual(host["modelled"]["argument_bytes"], (6 * 11 + 11 * 3) * 4)
    self.assertEqual(host["modelled"]["result_bytes"], 6 * 3 * 4)
    self.assertAlmostEqual(host["modelled"]["transfer_seconds_per_run"],
                           (6 * 11 + 11 * 3 + 6 * 3) * 4
                           / report.target.host_link_bytes_per_second)
    measured = host["measured_on_this_machine"]
    self.assertEqual((measured["cache"], measured["calls"]), ("off", 1))
    self.assertGreater(measured["lowering_seconds"], 0)
    self.assertGreater(measured["first_call_seconds"], 0)
    self.assertIn("Host side (model: the emulated host link; this machine: measured here",
                  report.summary())
    try:
      page = report_html(report)
    except ImportError:  # plotly missing: no page to check
      page = None
    if page is not None:
      self.assertIn('<section id="host-side">', page)
      self.assertIn("<td>Executable cache</td><td>off</td>", page)
    with tempfile.TemporaryDirectory() as directory:
      report.save(directory, plots=False, html=False)
      saved = ipu_jax.Report.load(directory)
      self.assertEqual(saved.to_dict()["host_side"], host)
      self.assertIn("Lowering (this machine):", saved.summary())


if __name__ == "__main__":
  absltest.main()
