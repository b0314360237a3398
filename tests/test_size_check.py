"""Programs too large for the target's SRAM are refused before planning (lowering/size_check.py)."""

import json
import os
import subprocess
import sys
import textwrap

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from testing_utils import T16, random_array

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SRAM16 = 16 * T16.bytes_per_tile

# The three programs on a whole ipu2 (940,572,672 B of SRAM). The
# convolution "256 x 256 x 1024 x 1024" read as a batch of 256 images of
# 256 x 256 pixels, 1024 channels in and 1024 out (NCHW [256, 1024, 256, 256],
# a 3 x 3 kernel OIHW [1024, 1024, 3, 3]). Each case: the program, its
# argument shapes, and the tensor the message must name with its bytes.
_CHILD = textwrap.dedent("""
    import json, resource, sys, time

    def peak_rss_bytes():
      # VmHWM is this program's own high-water mark: ru_maxrss is not reset
      # by exec, so it would report the (large) test worker this child was
      # forked from.
      try:
        with open("/proc/self/status") as status:
          for line in status:
            if line.startswith("VmHWM:"):
              return int(line.split()[1]) * 1024
      except OSError:
        pass
      return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # A runaway plan fails at 6 GB of address space instead of filling the
    # machine (before the size check, the transpose took 4.5 GB).
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
    import jax, jax.numpy as jnp
    from jax import lax
    import ipu_jax
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    CASES = {
        "transpose_140000": (lambda a: (a.T + 1).reshape(-1, 7), [S((140000, 140000), f32)]),
        "transpose_30000": (lambda a: a.T, [S((30000, 30000), f32)]),
        "conv_256x256x1024x1024": (
            lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
            [S((256, 1024, 256, 256), f32), S((1024, 1024, 3, 3), f32)]),
    }
    for name in sys.argv[1:]:
      fn, args = CASES[name]
      start = time.perf_counter()
      try:
        ipu_jax.jit(fn, target="ipu2").lower(*args)
        kind, message = "none", ""
      except Exception as e:  # the test reads which
        kind, message = type(e).__name__, str(e)
      print(json.dumps({"case": name, "kind": kind, "message": message[:4000],
                        "seconds": time.perf_counter() - start,
                        "peak_rss_bytes": peak_rss_bytes()}), flush=True)
""")

_CASES = {
    "transpose_140000": ("argument a (float32[140000,140000])", 140000 * 140000 * 4),
    "transpose_30000": ("argument a (float32[30000,30000])", 30000 * 30000 * 4),
    "conv_256x256x1024x1024": ("argument x (float32[256,1024,256,256])",
                               256 * 1024 * 256 * 256 * 4),
}


def _lower_in_child(cases) -> dict:
  """Each case's result, lowered in one fresh process (its own peak RSS)."""
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             JAX_PLATFORMS="cpu", IPU_JAX_PROGRESS="0")
  proc = subprocess.run([sys.executable, "-c", _CHILD, *cases], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  results = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      record = json.loads(line)
      results[record["case"]] = record
  results["stderr"] = proc.stderr[-3000:]
  return results


class TooLargeForTheTargetTest(parameterized.TestCase):
  """Issue 42 item 7: refused in under 2 s and 1 GB of host memory."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.results = _lower_in_child(list(_CASES))

  @parameterized.parameters(*_CASES)
  def test_refused_before_planning(self, case):
    record = self.results.get(case)
    self.assertIsNotNone(record, f"{case} did not finish: {self.results['stderr']}")
    tensor, nbytes = _CASES[case]
    self.assertEqual(record["kind"], "OutOfMemoryError", record["message"][:2000])
    self.assertIn("found before planning", record["message"])
    self.assertIn(f"{tensor}: {nbytes:,d} bytes", record["message"])
    self.assertIn("940,572,672", record["message"])  # the SRAM of all 1,472 tiles
    self.assertLess(record["seconds"], 2.0)
    self.assertLess(record["peak_rss_bytes"], 1 << 30)


class SizeCheckTest(chex.TestCase):
  """The early check on 16 tiles (10,223,616 B of SRAM)."""

  def test_intermediate_named_with_its_source_line(self):
    def f(x):
      return jnp.broadcast_to(x, (2048, 2048)).sum(axis=0)  # 16,777,216 B

    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(f, target=T16).lower(jax.ShapeDtypeStruct((2048,), jnp.float32))
    message = str(caught.exception)
    self.assertIn("found before planning", message)
    line = f.__code__.co_firstlineno + 1
    self.assertIn(f"the result of broadcast_in_dim (float32[2048,2048] at {__file__}:{line}): "
                  "16,777,216 bytes", message)
    self.assertIn("a smaller batch or smaller shapes", message)
    self.assertIn("at least 2 IPU(s)", message)
    error = caught.exception
    self.assertEqual((error.tile, error.bytes_needed, error.bytes_available),
                     (0, -(-16_777_216 // 16), T16.bytes_per_tile))

  def test_arguments_together_over_the_sram(self):
    # Each 4 MB argument fits 16 tiles; the three, live for the whole
    # program, do not.
    args = {name: jax.ShapeDtypeStruct((1_000_000,), jnp.float32) for name in "abc"}
    with self.assertRaises(ipu_jax.OutOfMemoryError) as caught:
      ipu_jax.jit(lambda p: p["a"] + p["b"] * p["c"], target=T16).lower(args)
    message = str(caught.exception)
    self.assertIn("found before planning", message)
    self.assertIn("arguments and constants, live for the whole program", message)
    for name in "abc":
      self.assertRegex(message, rf"argument \S*{name}\S* \(float32\[1000000\]\): 4,000,000 bytes")
    self.assertIn("offload_argnums", message)
    self.assertEqual(caught.exception.bytes_needed, -(-12_000_000 // 16))

  def test_allow_out_of_memory_still_lowers(self):
    cfg = ipu_jax.IPUConfig()
    cfg.memory.allow_out_of_memory = True
    x = jnp.ones(3_000_000, jnp.float32)  # 12 MB: over the SRAM of 16 tiles
    lowered = ipu_jax.jit(lambda v: v * 2, target=T16, config=cfg).lower(x)
    self.assertTrue(lowered.out_of_memory)
    self.assertGreater(len(lowered.report.over_limit_tiles), 0)

  def test_fitting_program_unchanged(self):
    x = random_array((512, 1024))  # 2 MB: an eighth of what 16 tiles hold, five times
    f = lambda v: (jnp.tanh(v.T) + 1).reshape(-1, 8).sum(axis=1)
    chex.assert_trees_all_close(np.asarray(ipu_jax.jit(f, target=T16)(x)),
                                np.asarray(jax.jit(f)(x)), rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
