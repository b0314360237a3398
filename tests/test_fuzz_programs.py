"""Random programs through ``ipu_jax.jit`` against ``jax.jit`` (fuzz test).

``program_generator.generate(seed)`` builds one random program per seed
(elementwise chains, integer ops, casts, reductions, shape ops, gather and
scatter, einsum/dot, bfloat16/float16 dot_general with batch dimensions
that are not leading, convolutions with strides, padding, dilations and
groups, pooling, cumulative ops, sorts and top_k, scan/while/cond/switch,
random bits; maybe followed by an elementwise tail, or under ``jax.vmap`` or
``jax.grad``; maybe with dead code beside it, which must be removed before
lowering: counted in ``Lowered.dead_code``, never refused). Each runs at 16 tiles in both executor modes (``batched`` and
``per_tile``) and is compared with ``jax.jit`` on the same inputs:

* ``exact`` programs bit for bit (NaNs included). This includes most
  programs XLA rewrites (``a * b + c`` becomes a fused multiply-add,
  ``x / 3`` ``x * (1/3)``): the tile program is compiled by XLA as one
  function too and gets the same rewrites.
* ``ulp`` programs, whose last operation divides by a broadcast operand, a
  constant array or a square root, within 3 ulps: XLA rewrites
  ``x / broadcast(y)`` into ``x * broadcast(1/y)``, ``x / c`` into
  ``x * (1/c)`` (each up to 1 ulp from the quotient) and ``x / sqrt(y)``
  into ``x * rsqrt(y)`` (up to 3 ulps); the tile program, where the pattern
  is split by an exchange or a constant lives in tile memory, divides. The
  only budget: every other XLA rewrite measured (fused multiply-add,
  ``log(exp(x))``, ``exp(a) * exp(b)``, division by a literal) gives bits
  identical to the tile program's, which XLA compiles as one function too.
* ``rounding`` programs (sums, dots, convolutions, loops, gradients) within
  ``rtol = atol = 2e-5`` of the result's scale for float32 (float16 2e-3,
  bfloat16 2e-2): a different accumulation order, not different maths.
* in ``per_tile`` mode, ``exact`` programs computing ``exp`` or ``log``
  within 1 ulp: XLA's CPU backend emits these either as its own vectorised
  polynomial or as a libm call, by the shape of the loop computing them, and
  a per-tile vertex computes on its tile's padded row, a loop of another
  shape than ``jax.jit``'s (``test_per_tile_exp_loop_shape``). The batched
  mode computes on the logical arrays ``jax.jit`` has: bit for bit.

CI runs ``_CI_SEEDS`` (every family twice); ``-m slow`` runs
``_SLOW_SEEDS`` more. ``KNOWN_FAILURES`` lists the seeds that fail in code
another engineer is changing now, with the reason.
"""

from __future__ import annotations

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import ipu_jax
import program_generator

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_CI_SEEDS = range(2 * len(program_generator.FAMILIES))  # every family twice
_SLOW_SEEDS = range(len(_CI_SEEDS), len(_CI_SEEDS) + 240)
# Division by a broadcast, a constant or a square root: XLA multiplies by
# the reciprocal (1 ulp) or by rsqrt (3 ulps).
_ULP_BUDGET = 3
_RTOL = {np.dtype("float32"): 2e-5, np.dtype("float16"): 2e-3,
         np.dtype(jnp.bfloat16): 2e-2}
# XLA's CPU backend emits exp and log either as its own vectorised
# polynomial or as a call to libm's expf/logf, by the shape of the loop
# computing them: a lone f32[7] exp is one 7-wide vector operation, lowered
# to libm; exp in the pad-and-slice fusion of a padded tile row, or in a
# loop of 8 or 32 elements, is the polynomial. The two are 1 ulp apart on 9 %
# (exp) and 12 % (log) of float32 inputs (measured: 140,000 normal(0, 3)
# inputs, f32[7] kernels against rows of 32, JAX 0.10.2 on x86-64), never
# more. The per-tile executor runs each vertex on its tile's padded row, so a
# per-tile result of a program with exp or log is held to that 1 ulp; the
# batched executor computes on jax.jit's logical arrays and gives its bits.
_LOOP_SHAPE_DEPENDENT = frozenset({"exp", "log"})
_LOOP_SHAPE_ULPS = 1

# seed -> why it fails now (the fix is in another engineer's files).
KNOWN_FAILURES: dict[int, str] = {}


def _config(mode):
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  return cfg


def _as_numpy(leaf):
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
    leaf = jax.random.key_data(leaf)
  return np.asarray(leaf)


def _ordered_bits(x):
  """Float bits as integers that count ulps across zero (-0.0 == +0.0)."""
  width = 8 * x.dtype.itemsize
  bits = x.view({16: np.int16, 32: np.int32}[width]).astype(np.int64)
  magnitude = bits & ((1 << (width - 1)) - 1)
  return np.where(bits < 0, -magnitude, magnitude)


def _primitive_names(jaxpr):
  """Names of the primitives of ``jaxpr`` and of every jaxpr nested in it."""
  for eqn in jaxpr.eqns:
    yield eqn.primitive.name
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = sub.jaxpr if isinstance(sub, jax_core.ClosedJaxpr) else sub
        if isinstance(sub, jax_core.Jaxpr):
          yield from _primitive_names(sub)


def _comparison(program, mode):
  """``(compare, ulp budget)`` of ``program``'s results in executor ``mode``."""
  if (mode == "per_tile" and program.compare == "exact"
      and not _LOOP_SHAPE_DEPENDENT.isdisjoint(
          _primitive_names(jax.make_jaxpr(program.fn)(*program.args).jaxpr))):
    return "ulp", _LOOP_SHAPE_ULPS
  return program.compare, _ULP_BUDGET


def assert_same_numbers(got, want, compare, what="", ulps=_ULP_BUDGET):
  """Asserts ``got`` equals ``want`` under the program's comparison class."""
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    g, w = _as_numpy(g), _as_numpy(w)
    rtol = _RTOL.get(w.dtype)
    if compare == "exact" or rtol is None:
      np.testing.assert_array_equal(g, w, err_msg=what)
    elif compare == "ulp":
      np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=what)
      apart = np.abs(_ordered_bits(g) - _ordered_bits(w))[~np.isnan(w)]
      assert apart.size == 0 or apart.max() <= ulps, (
          f"{what}: {apart.max()} ulps apart (budget {ulps})")
    else:
      finite = np.isfinite(w.astype(np.float32))
      scale = float(np.max(np.abs(w.astype(np.float32))[finite], initial=1.0))
      np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=rtol,
                                 atol=rtol * scale, equal_nan=True, err_msg=what)


def check_program(seed):
  """Runs the program of ``seed`` in both executor modes and compares."""
  program = program_generator.generate(seed)
  want = jax.jit(program.fn)(*program.args)
  for mode in ("batched", "per_tile"):
    lowered = ipu_jax.jit(program.fn, target=_T16, config=_config(mode)).lower(*program.args)
    got = lowered(*program.args)
    compare, ulps = _comparison(program, mode)
    assert_same_numbers(got, want, compare, what=f"{program.name} [{mode}]", ulps=ulps)
    # Each kind of dead code added is at least one equation not lowered.
    assert lowered.dead_code.equations >= len(program.dead_code), (
        f"{program.name}: {lowered.dead_code} removed")


def _run(test, seed):
  if seed in KNOWN_FAILURES:
    test.skipTest(f"known failure: {KNOWN_FAILURES[seed]}")
  check_program(seed)
  jax.clear_caches()


class FuzzProgramsTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(*_CI_SEEDS)
  def test_random_program(self, seed):
    _run(self, seed)

  def test_generator_covers_every_family_in_ci(self):
    families = {program_generator.generate(s).family for s in _CI_SEEDS}
    self.assertEqual(families, set(program_generator.FAMILIES))

  def test_per_tile_exp_loop_shape(self):
    # Seed 62's switch ends in exp of x (f32[7]). XLA computes jax.jit's lone
    # f32[7] exp by libm's expf (the correctly rounded value here) and exp in
    # the per-tile vertex's loop over its padded row by its own polynomial,
    # an ulp above: the per-tile result is the padded loop's bits.
    x = np.array([-1.272868, 1.1594185, 2.5564365, 0.08180993, 2.2436993, 1.960323,
                  -1.5855207], np.float32)
    lone = np.asarray(jax.jit(jnp.exp)(x))
    padded = np.asarray(jax.jit(lambda v: jnp.exp(jnp.pad(v, (0, 25)))[:7])(x))
    self.assertEqual(np.flatnonzero(lone != padded).tolist(), [1])
    self.assertEqual(int(padded.view(np.int32)[1] - lone.view(np.int32)[1]), 1)
    self.assertEqual(lone[1], np.float32(np.exp(np.float64(x[1]))))
    per_tile = ipu_jax.jit(jnp.exp, target=_T16, config=_config("per_tile"))(x)
    np.testing.assert_array_equal(np.asarray(per_tile), padded)
    np.testing.assert_array_equal(np.asarray(ipu_jax.jit(jnp.exp, target=_T16)(x)), lone)
    assert_same_numbers(per_tile, lone, "ulp", ulps=_LOOP_SHAPE_ULPS)
    program = program_generator.generate(62)
    self.assertEqual(_comparison(program, "per_tile"), ("ulp", _LOOP_SHAPE_ULPS))
    self.assertEqual(_comparison(program, "batched"), ("exact", _ULP_BUDGET))

  def test_generator_is_deterministic(self):
    first, again = program_generator.generate(7), program_generator.generate(7)
    self.assertEqual(first.name, again.name)
    chex.assert_trees_all_equal(first.args, again.args)


# The mark is on the class: pytest does not see marks on the methods absl's
# parameterized generates.
@pytest.mark.slow
class FuzzProgramsLongTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(*_SLOW_SEEDS)
  def test_random_program_long(self, seed):
    _run(self, seed)


if __name__ == "__main__":
  absltest.main()
