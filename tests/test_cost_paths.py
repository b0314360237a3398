"""One cost for one piece of work: every matmul path charges the AMP estimator.

The same per-tile product is written six ways (tile_map of the built-in
matmul_block codelet, a batched einsum through ``dot_general``,
``ipu_jax.ops.matmul``, ``ipu_jax.poplibs.matmul`` and a hand-built graph
compute set, and a 1x1 convolution) and each must cost the compute cycles of
:func:`ipu_jax.kernels.amp.amp_block_cycles` for that block, within 5 %
(issue 12's acceptance).
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import graph as g
from ipu_jax import ops
from ipu_jax import poplibs
from ipu_jax.kernels import library
from ipu_jax.kernels.amp import amp_block_cycles

TOL = 0.05


def _jit(fn, target):
  return ipu_jax.jit(fn, target=target, verbose=0)


def _matmul_step_cycles(lowered, prefix):
  steps = [s for s in lowered.profile.steps if s.name.startswith(prefix)]
  assert steps, [s.name for s in lowered.profile.steps]
  return float(steps[0].compute_cycles.max())


class CostPathsTest(chex.TestCase):

  @parameterized.parameters(
      ("bow", jnp.float16, 2048, 16, 16),   # the example, on 8 tiles
      ("ipu2", jnp.float32, 64, 24, 40),    # padded groups, fp32 rate
      ("ipu1", jnp.float16, 37, 50, 16),    # odd rows, the IPU1's 8 AMP units
  )
  def test_tile_map_and_dot_general_cost_the_same(self, preset, dtype, m, k, n):
    target = ipu_jax.IPUTarget.preset(preset, tiles_per_ipu=8)
    tiles = target.num_tiles
    a = jnp.ones((tiles, m, k), dtype)
    b = jnp.ones((tiles, k, n), dtype)
    codelet = library.matmul_block(np.dtype(dtype))
    by_codelet = _jit(lambda a, b: ops.tile_map(codelet, a, b), target).lower(a, b)
    by_einsum = _jit(lambda a, b: jnp.einsum("tnk,tkm->tnm", a, b,
                                             preferred_element_type=dtype), target).lower(a, b)
    expected = float(amp_block_cycles(target, m, k, n, np.dtype(dtype).itemsize))
    got_codelet = _matmul_step_cycles(by_codelet, "tile_map")
    got_einsum = _matmul_step_cycles(by_einsum, "dot_general")
    self.assertAlmostEqual(got_codelet / expected, 1.0, delta=TOL,
                           msg=f"tile_map {got_codelet} vs AMP estimate {expected}")
    self.assertAlmostEqual(got_einsum / got_codelet, 1.0, delta=TOL,
                           msg=f"dot_general {got_einsum} vs tile_map {got_codelet}")

  def test_all_single_tile_paths_agree(self):
    # One tile, so every path gives the tile the whole [m, k] x [k, n] block.
    target = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=1)
    m, k, n = 96, 32, 16
    a = jnp.ones((m, k), jnp.float16)
    b = jnp.ones((k, n), jnp.float16)
    expected = float(amp_block_cycles(target, m, k, n, 2))
    got = {
        "dot_general": _matmul_step_cycles(_jit(jnp.matmul, target).lower(a, b), "dot_general"),
        "ops.matmul": _matmul_step_cycles(_jit(ops.matmul, target).lower(a, b), "matmul"),
    }
    # A 1x1 convolution: m positions, k input and n output channels.
    conv = lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"))
    got["conv"] = _matmul_step_cycles(
        _jit(conv, target).lower(a[None], b[None]), "conv_general_dilated")
    gr = g.Graph(target)
    ga = gr.add_variable("float16", (m, k), "a")
    gb = gr.add_variable("float16", (k, n), "b")
    gr.map_tensor_linearly(ga)
    gr.map_tensor_linearly(gb)
    prog = g.Sequence()
    poplibs.matmul(gr, ga, gb, prog, "ab")
    engine = g.Engine(gr, [prog])
    got["poplibs.matmul"] = max(float(s.compute_cycles.max())
                                for s in engine.profiles[0].steps)
    for path, cycles in got.items():
      self.assertAlmostEqual(cycles / expected, 1.0, delta=TOL,
                             msg=f"{path}: {cycles} cycles vs AMP estimate {expected} ({got})")


if __name__ == "__main__":
  absltest.main()
