"""Helpers shared by the tests: inputs, executor configs, the comparison of
an IPU run against ``jax.jit``, and the small models and graphs several
files build.

Each test file used to carry its own copy of these; one copy keeps the
tolerance rules the same everywhere.
"""

import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax

T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
MODES = ("batched", "per_tile")


def executor_config(mode="batched", **sections):
  """An ``IPUConfig`` that runs the executor in ``mode``.

  Each keyword names an option group and maps option names to values, e.g.
  ``matmuls={"partials_type": "half"}``; ``None`` values keep the default.
  """
  cfg = ipu_jax.IPUConfig()
  cfg.executor.mode = mode
  for section, options in sections.items():
    for option, value in options.items():
      if value is not None:
        setattr(getattr(cfg, section), option, value)
  return cfg


def random_array(shape, dtype=jnp.float32, seed=0, int_bound=50):
  """Seeded normal values; integers uniform in ``[-int_bound, int_bound)``,
  complex values with independent normal real and imaginary parts."""
  rng = np.random.RandomState(seed)
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(rng.randint(-int_bound, int_bound, size=shape), dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return jnp.asarray(rng.randn(*shape) + 1j * rng.randn(*shape), dtype)
  return jnp.asarray(rng.randn(*shape), dtype)


def assert_matches_jit(fn, *args, rtol=1e-5, atol=1e-6, exact=False, modes=MODES, target=T16,
                       config=executor_config):
  """``fn`` on the emulated IPU equals ``jax.jit(fn)`` in every executor mode.

  ``fn`` may return ``{"close": ..., "exact": ...}`` to compare part of its
  results to a tolerance and part exactly. ``config(mode)`` builds the
  ``IPUConfig`` of each run.
  """
  want = jax.jit(fn)(*args)
  for mode in modes:
    got = ipu_jax.jit(fn, target=target, config=config(mode))(*args)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    if isinstance(want, dict) and set(want) == {"close", "exact"}:
      chex.assert_trees_all_close(got["close"], want["close"], rtol=rtol, atol=atol)
      jax.tree.map(np.testing.assert_array_equal, got["exact"], want["exact"])
    elif exact:
      jax.tree.map(np.testing.assert_array_equal, got, want)
    else:
      chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)
  return want


def assert_sums_match_jit(fn, *args, target=T16, modes=MODES, rtol=1e-5, config=executor_config):
  """``fn`` on the IPU (each executor mode) against ``jax.jit``, for results
  that are sums (matmuls, convolutions).

  Sums in another order differ by rounding relative to the terms' size, so
  the absolute tolerance scales with the largest result. Returns what
  ``jax.jit`` gave.
  """
  want = jax.jit(fn)(*args)
  is_complex = any(jnp.iscomplexobj(x) for x in jax.tree.leaves(want))
  wide_dtype = np.complex128 if is_complex else np.float64
  wide = lambda tree: jax.tree.map(lambda x: np.asarray(x, wide_dtype), tree)
  scale = max([1.0] + [float(np.abs(x).max(initial=0)) for x in jax.tree.leaves(wide(want))])
  for mode in modes:
    got = ipu_jax.jit(fn, target=target, config=config(mode))(*args)
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_trees_all_close(wide(got), wide(want), rtol=rtol, atol=rtol * scale)
  return want


def spread_vectors(graph, names, length=4):
  """fp32 vectors of ``length``, element ``i`` of each on tile ``i`` (the
  layout the Poplar tutorials start from)."""
  vectors = [graph.add_variable("float32", (length,), name) for name in names]
  for i in range(length):
    for vector in vectors:
      graph.set_tile_mapping(vector[i], i)
  return vectors


def chained_matmul_graph(target):
  """The tut4 program: ``(a @ b) @ c`` for 900x600, 600x300 and 300x200
  operands, each mapped linearly. Returns ``(graph, (a, b, c), program, abc)``."""
  from ipu_jax import graph as g  # pylint: disable=import-outside-toplevel
  from ipu_jax import poplibs  # pylint: disable=import-outside-toplevel
  gr = g.Graph(target)
  a = gr.add_variable("float32", (900, 600), "a")
  b = gr.add_variable("float32", (600, 300), "b")
  c = gr.add_variable("float32", (300, 200), "c")
  for t in (a, b, c):
    gr.map_tensor_linearly(t)
  prog = g.Sequence()
  abc = poplibs.matmul(gr, poplibs.matmul(gr, a, b, prog, "ab"), c, prog, "abc")
  return gr, (a, b, c), prog, abc


def assert_trees_match(got, want, exact=True, rtol=1e-6, atol=1e-6):
  """``got`` has ``want``'s structure, shapes and dtypes, and its values:
  bit for bit where ``exact``, else to ``rtol``/``atol``."""
  chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
  if exact:
    chex.assert_trees_all_equal(got, want)
  else:
    chex.assert_trees_all_close(got, want, rtol=rtol, atol=atol)


class TwoLayerMLP(nnx.Module):
  """``second(tanh(first(x)))``: the small model the training tests fit.

  The layer names matter to tests that assign layers to pipeline stages.
  """

  def __init__(self, sizes=(8, 16, 4), *, rngs):
    n_in, n_hidden, n_out = sizes
    self.first = nnx.Linear(n_in, n_hidden, rngs=rngs)
    self.second = nnx.Linear(n_hidden, n_out, rngs=rngs)

  def __call__(self, x):
    return self.second(jnp.tanh(self.first(x)))


def supersteps_with_members(program):
  """Every superstep of ``program``, fused ones followed by their members."""
  from ipu_jax.lowering import fp_exceptions  # pylint: disable=import-outside-toplevel
  from ipu_jax.lowering import program as P  # pylint: disable=import-outside-toplevel
  if isinstance(program, P.Superstep):
    yield program
    yield from fp_exceptions.fused_members(program)
    return
  for child in P.children(program):
    yield from supersteps_with_members(child)


def chain_data(stages, g, width=16, rows=8, seed=0, scale=0.3):
  """Weights of a chain of ``stages`` ``[width, width]`` layers (normal, times
  ``scale``) and ``g`` micro-batches of ``{"x", "y"}`` (``[rows, width]``
  each): the pipeline tests' model."""
  rng = np.random.default_rng(seed)
  params = [jnp.asarray(rng.normal(size=(width, width)) * scale, jnp.float32)
            for _ in range(stages)]
  batches = {"x": jnp.asarray(rng.normal(size=(g, rows, width)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(g, rows, width)), jnp.float32)}
  return params, batches
