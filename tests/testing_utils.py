"""Helpers shared by the tests: inputs, executor configs, the comparison of
an IPU run against ``jax.jit``, and the small models and graphs several
files build.

Each test file used to carry its own copy of these; one copy keeps the
tolerance rules the same everywhere.
"""

import collections
import contextlib

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
    values = rng.randint(-int_bound, int_bound, size=shape)
  elif jnp.issubdtype(dtype, jnp.complexfloating):
    values = rng.randn(*shape) + 1j * rng.randn(*shape)
  else:
    values = rng.randn(*shape)
  return on_device(values, dtype)


def on_device(values, dtype=None):
  """NumPy values on the device as ``dtype`` (JAX's canonical form of it).

  Converted by NumPy and placed with ``jax.device_put``: in JAX 0.10
  ``jnp.asarray`` of a NumPy array compiles a small XLA program per shape and
  dtype, which thousands of test shapes pay for. The values equal
  ``jnp.asarray``'s.
  """
  values = np.asarray(values)
  dtype = jax.dtypes.canonicalize_dtype(values.dtype if dtype is None else dtype)
  return jax.device_put(values.astype(dtype))


def numpy_weights(tree, seed: int = 0):
  """Concrete values, drawn with NumPy, for an abstract model's state.

  ``tree`` is what ``nnx.split(nnx.eval_shape(make_model))`` (or a loss
  builder given such a model) leaves: shapes and dtypes without values.
  Matrices and kernels are LeCun-normal (variance 1 / fan-in, the product of
  all axes but the last) as Flax draws them, norm scales and running
  variances ones, other floats and integers zeros, random keys ``seed``'s.
  Tests that need equal weights on two sides, not Flax's particular ones,
  use it instead of building the model eagerly: Flax's initialisers compile
  a ``jax.random`` sampler per weight shape (0.7 CPU s or so each).
  """
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    # The variable's name, past the ``.value`` of an nnx.State's variables.
    name = [n for n in (str(getattr(k, "key", getattr(k, "name", k))) for k in path)
            if n != "value"][-1]
    if jnp.issubdtype(leaf.dtype, jnp.floating) and name in ("scale", "var"):
      return np.ones(leaf.shape, leaf.dtype)
    if not jnp.issubdtype(leaf.dtype, jnp.floating) or len(leaf.shape) < 2:
      return np.zeros(leaf.shape, leaf.dtype)
    std = 1.0 / np.sqrt(np.prod(leaf.shape[:-1]))
    return (rng.normal(size=leaf.shape) * std).astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, tree)


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


# Safety factor of the "typical" sum bound: about 4x the largest ratio
# |error| / (u sqrt(n) (||t||_2 + |sum t|)) measured (an estimate, not a
# theorem) over sequential, reversed and pairwise float32 sums of 10 to 20,000
# products of normal values with means 0 to 5, 20,000 to 200,000 sums each:
# 1.03 at most.
TYPICAL_SUM_SAFETY = 4.0
SUM_BOUND_KINDS = ("typical", "probabilistic", "worst")


def sum_error_bound(op, *operands, dtype=np.float32, n=None, out_dtype=None, kind="typical",
                    failure_probability=1e-9):
  """Elementwise bound on the rounding error of ``op(*operands)`` computed in
  ``dtype`` (round to nearest, in an order the caller does not know).

  ``op`` is a sum of products of its operands with non-negative weights (a
  matmul, ``np.sum``, ``np.cumsum``, a convolution, an einsum), evaluated here
  on float64 copies. For each result element ``s = sum_i t_i`` of ``n``
  terms summed in ``dtype`` (unit roundoff ``u = eps / 2``), with
  ``sum |t|`` given by ``op(|a|, |b|, ...)`` and ``||t||_2`` by
  ``sqrt(op(a^2, b^2, ...))``:

  * ``"worst"``: ``gamma_n sum |t|``, ``gamma_n = n u / (1 - n u)`` (Higham,
    "Accuracy and Stability of Numerical Algorithms", 2nd ed., SIAM 2002,
    §3.1: Lemma 3.1 and the inner-product bound built on it). It holds for
    every order on every machine.
  * ``"probabilistic"``: Higham & Mary, "A New Approach to Probabilistic
    Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019: with rounding
    errors independent and of mean zero,
    ``gamma~_n(lam) sum |t|``, ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 /
    (1 - u)) - 1`` (about ``lam sqrt(n) u``), holds with probability at least
    ``1 - 2 n exp(-lam^2 (1 - u)^2 / 2)``; ``lam`` makes that failure
    probability ``failure_probability`` per element. Any order, sorted terms
    included.
  * ``"typical"`` (default): ``TYPICAL_SUM_SAFETY u sqrt(n) (||t||_2 +
    |s|)``. Each addition rounds a partial sum; in an order unrelated to the
    terms' signs the partial sums stay within about ``|s| + ||t||_2`` (the
    drift to the total plus a random walk), and ``n`` such roundings of
    random sign add up as ``sqrt(n)``. Without the ``|s|`` term, terms of one
    sign (partial sums growing like ``k``) would exceed it by ``sqrt(n)``.
    An estimate with a stated safety factor; terms summed in sorted order
    can exceed it: use ``"probabilistic"`` there.

  Each is capped by ``"worst"``, which always holds.

  Args:
    op: the computation as a function of float64 arrays.
    *operands: its inputs, exactly as the computation under test read them.
    dtype: the dtype the sum accumulates in (the partials type).
    n: roundings on each element's path, broadcastable to the result; by
      default the number of terms, ``op(1, 1, ...)``. For chained products
      pass the sum of their contraction lengths.
    out_dtype: the result's dtype when it is narrower than ``dtype``: adds
      that one final rounding.
    kind: one of ``SUM_BOUND_KINDS``.
    failure_probability: per element, for ``"probabilistic"``.

  Returns:
    The float64 bound, shaped like ``op``'s result.
  """
  if kind not in SUM_BOUND_KINDS:
    raise ValueError(f"sum_error_bound: kind must be one of {SUM_BOUND_KINDS}, got {kind!r}.")
  wide = [np.asarray(x, np.float64) for x in operands]
  exact = np.abs(np.asarray(op(*wide), np.float64))
  magnitude = np.asarray(op(*[np.abs(x) for x in wide]), np.float64)
  if n is None:
    n = op(*[np.ones_like(x) for x in wide])
  n = np.maximum(np.asarray(n, np.float64), 1.0)
  u = float(jnp.finfo(dtype).eps) / 2
  nu = n * u
  bound = np.where(nu < 1, nu / np.maximum(1 - nu, u), np.inf) * magnitude
  if kind == "probabilistic":
    lam = np.sqrt(2 * np.log(2 * n / failure_probability)) / (1 - u)
    bound = np.minimum(bound, np.expm1(lam * np.sqrt(n) * u + n * u * u / (1 - u)) * magnitude)
  elif kind == "typical":
    norm2 = np.sqrt(np.asarray(op(*[x * x for x in wide]), np.float64))
    bound = np.minimum(bound, TYPICAL_SUM_SAFETY * u * np.sqrt(n) * (norm2 + exact))
  if out_dtype is not None and jnp.finfo(out_dtype).eps > jnp.finfo(dtype).eps:
    # The computed sum, not the exact one, is rounded once more.
    bound = bound + float(jnp.finfo(out_dtype).eps) / 2 * (exact + bound)
  return bound


def assert_within_sum_bound(got, op, *operands, against=None, **bound_options):
  """``got`` is ``op(*operands)`` to within its rounding-error bound.

  The reference is ``op`` on float64 copies of the operands and the
  tolerance each element's ``sum_error_bound(op, *operands, **bound_options)``,
  so the check holds whatever order a machine (or a tile plan) sums in; a
  fixed ``atol`` only records one machine's rounding. ``against`` is another
  computation of the same sum in the same dtype (``jax.jit``'s): both lie
  within the bound of the exact sum, so they differ by at most twice it.
  Returns the float64 reference.
  """
  exact = np.asarray(op(*[np.asarray(x, np.float64) for x in operands]), np.float64)
  bound = sum_error_bound(op, *operands, **bound_options)
  _assert_within(np.asarray(got, np.float64), exact, bound, "the exact sum", bound_options)
  if against is not None:
    _assert_within(np.asarray(got, np.float64), np.asarray(against, np.float64), 2 * bound,
                   "the other computation", bound_options)
  return exact


def _assert_within(got, want, bound, what, bound_options):
  np.testing.assert_equal(got.shape, want.shape)
  excess = np.abs(got - want) - bound
  if excess.size and not (excess <= 0).all():
    worst = np.unravel_index(np.argmax(np.where(np.isnan(excess), np.inf, excess)), excess.shape)
    raise AssertionError(
        f"{int(np.sum(~(excess <= 0)))} of {excess.size} elements differ from {what} by more "
        f"than the rounding-error bound ({bound_options or 'typical, float32'}); worst at "
        f"{tuple(int(i) for i in worst)}: got {got[worst]!r}, want {want[worst]!r}, "
        f"bound {bound[worst]!r}")


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


def accumulated_gradients(loss_fn, params, batches, count, key=None):
  """Plain gradient accumulation, the pipelines' reference: ``loss_fn``'s
  gradients summed over the ``count`` micro-batches stacked on ``batches``'
  leading axis, and each micro-batch's loss, as ``jax.jit`` computes them.
  With ``key``, micro-batch ``m`` is given ``micro_batch_key(key, m)`` (the key
  a pipeline gives it). Returns ``(summed gradients, [losses])``."""
  from ipu_jax.pipelining import micro_batch_key  # pylint: disable=g-import-not-at-top
  grad = jax.jit(jax.value_and_grad(loss_fn))
  acc, losses = jax.tree_util.tree_map(jnp.zeros_like, params), []
  for m in range(count):
    batch = jax.tree_util.tree_map(lambda b: b[m], batches)  # pylint: disable=cell-var-from-loop
    value, g = grad(params, batch) if key is None else grad(params, batch,
                                                             micro_batch_key(key, m))
    acc, losses = jax.tree_util.tree_map(jnp.add, acc, g), losses + [value]
  return acc, losses


def sgd_after(params, gradients, learning_rate):
  """``params`` after one SGD step on ``gradients``."""
  return jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, gradients)


def chain_layers(params, h):
  """The pipeline tests' model: one stage per weight, each ``tanh(tanh(h @ w) @ w.T)``
  with its middle value a recomputation checkpoint."""
  from ipu_jax.ops import pipeline_stage, recomputation_checkpoint  # pylint: disable=g-import-not-at-top
  for k, w in enumerate(params):
    if k:
      h = pipeline_stage(h, k)
    h = recomputation_checkpoint(jnp.tanh(h @ w))
    h = jnp.tanh(h @ w.T)
  return h


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


@contextlib.contextmanager
def counting_plans():
  """Counts, per ``(table name, key)``, how often a plan-cache entry is computed.

  Yields a ``collections.Counter``: a count above 1 is a plan computed again,
  what a shared plan session exists to avoid.
  """
  from unittest import mock  # pylint: disable=g-import-not-at-top
  from ipu_jax.lowering import plan_cache  # pylint: disable=g-import-not-at-top
  computed = collections.Counter()
  original = plan_cache.PlanCache.get_or_compute

  def recording(cache, key, compute):
    def counted():
      computed[(cache.name, key)] += 1
      return compute()
    return original(cache, key, counted)

  with mock.patch.object(plan_cache.PlanCache, "get_or_compute", recording):
    yield computed
