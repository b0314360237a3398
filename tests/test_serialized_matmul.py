"""Serialised matmuls and embeddings: numbers, gradients, vmap, the tile program, bad input."""

from absl.testing import absltest, parameterized
import chex
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import nnx_serialized
from ipu_jax.ops import embedding_lookup, serialized_matmul, serialized_matmul_p
import testing_utils
from testing_utils import T16, random_array

# (mode, a shape, b shape): every TF-IPU and PopTorch name, odd sizes.
_CASES = (
    ("a_columns", (6, 5), (5, 7)),
    ("input_channels", (2, 4, 5), (5, 3)),
    ("a_rows_b_columns", (3, 6), (6, 5)),
    ("ReducingDim", (2, 3, 6), (2, 6, 5)),
    ("b_rows", (3, 5), (5, 8)),
    ("OutputChannels", (2, 3, 5), (1, 5, 4)),
)


def _steps(fn, *args, target=T16):
  return ipu_jax.jit(fn, target=target).lower(*args).report.profile.steps


def _working_bytes(profile, result_shape) -> int:
  """The busiest tile's working memory over the program: each step's own
  temporaries (exchange buffers, scratch) plus the temporaries live across it,
  the result excepted."""
  best = 0
  for i, step in enumerate(profile.steps):
    per_tile = np.zeros(profile.target.num_tiles, np.int64)
    if step.temporary_bytes is not None:
      per_tile += np.asarray(step.temporary_bytes, np.int64)
    for t in profile.tensors:
      if (t.category == "temporaries" and t.live_from <= i <= t.live_to
          and tuple(t.shape) != tuple(result_shape)):
        np.add.at(per_tile, t.tiles, np.asarray(t.bytes_on_tile, np.int64))
    best = max(best, int(per_tile.max()))
  return best


def _proportion_config(proportion, tiles=None):
  """An ipu2 config with ``proportion`` for matmuls (``tiles`` per IPU, or the chip's)."""
  cfg = ipu_jax.IPUConfig()
  cfg.device.version = "ipu2"
  if tiles is not None:
    cfg.device.tiles_per_ipu = tiles
  cfg.matmuls.available_memory_proportion = proportion
  return cfg


# The reference of test_grad_of_a_matrix_shared_by_a_batch, one jitted function
# for every case: compiled once per shape and dtype, not once per case.
_SHARED_MATRIX_REFERENCE = jax.jit(jax.grad(
    lambda x, y: jnp.sum(jnp.tanh(jnp.matmul(x, y).astype(jnp.float32))), argnums=(0, 1)))


class SerializedMatmulTest(parameterized.TestCase):

  @parameterized.parameters(*_CASES)
  def test_equals_matmul(self, mode, a_shape, b_shape):
    a, b = random_array(a_shape, seed=1), random_array(b_shape, seed=2)
    testing_utils.assert_matches_jit(lambda x, y: serialized_matmul(x, y, 2 if mode not in (
        "a_columns",) else 3, mode), a, b)
    got = ipu_jax.jit(lambda x, y: serialized_matmul(x, y, 2 if mode != "a_columns" else 3,
                                                     mode), target=T16)(a, b)
    chex.assert_trees_all_close(np.asarray(got), np.asarray(jnp.matmul(a, b)), rtol=1e-5,
                                atol=1e-5)

  @parameterized.parameters(
      ("a_columns", (0, 4), (4, 6)), ("a_rows_b_columns", (4, 0), (0, 6)),
      ("b_rows", (4, 4), (4, 0)), ("b_rows", (4, 0), (0, 6)))
  def test_empty(self, mode, a_shape, b_shape):
    a, b = jnp.ones(a_shape), jnp.ones(b_shape)
    got = ipu_jax.jit(lambda x, y: serialized_matmul(x, y, 2, mode), target=T16)(a, b)
    chex.assert_trees_all_equal(np.asarray(got), np.asarray(a @ b))

  @parameterized.parameters(jnp.float16, jnp.bfloat16)
  def test_half_types(self, dtype):
    a, b = random_array((4, 8), dtype, seed=3), random_array((8, 6), dtype, seed=4)
    want = np.asarray(jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)))
    eps = float(jnp.finfo(dtype).eps)
    for mode in ("a_columns", "a_rows_b_columns", "b_rows"):
      got = ipu_jax.jit(lambda x, y: serialized_matmul(x, y, 2, mode), target=T16)(a, b)
      self.assertEqual(got.dtype, dtype)
      # Rounding of the result, and for the K split of the pieces and their sum.
      chex.assert_trees_all_close(np.asarray(got, np.float32), want, rtol=4 * eps,
                                  atol=4 * eps * float(np.abs(want).max()))

  @parameterized.parameters("a_columns", "a_rows_b_columns", "b_rows")
  def test_grad_equals_and_is_serialised(self, mode):
    a, b = random_array((4, 6), seed=5), random_array((6, 8), seed=6)

    def loss(fn):
      return lambda x, y: jnp.sum(jnp.tanh(fn(x, y)))

    got = ipu_jax.jit(jax.grad(loss(lambda x, y: serialized_matmul(x, y, 2, mode)),
                               argnums=(0, 1)), target=T16)(a, b)
    want = jax.jit(jax.grad(loss(jnp.matmul), argnums=(0, 1)))(a, b)
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, got), want, rtol=1e-5,
                                atol=1e-6)
    # The transposed products are serialised on the same problem dimension
    # (TF-IPU's grad_a_fn / grad_b_fn); no plain product is left.
    jaxpr = jax.make_jaxpr(jax.grad(loss(lambda x, y: serialized_matmul(x, y, 2, mode)),
                                    argnums=(0, 1)))(a, b)
    axes = [e.params["axis"] for e in jaxpr.jaxpr.eqns if e.primitive is serialized_matmul_p]
    self.assertNotIn("dot_general", [e.primitive.name for e in jaxpr.jaxpr.eqns])
    expected = {"a_columns": ["m", "m", "k"], "a_rows_b_columns": ["k", "n", "m"],
                "b_rows": ["n", "k", "n"]}[mode]
    self.assertEqual(sorted(axes), sorted(expected))

  @parameterized.product(mode=("a_columns", "a_rows_b_columns", "b_rows", "ipu_matmul"),
                          shared=("a", "b"), dtype=(jnp.float32, jnp.float16))
  def test_grad_of_a_matrix_shared_by_a_batch(self, mode, shared, dtype):
    # A decoder weight applied to a batch of sequences: its gradient sums the
    # batch's, as one product whose contraction runs over the batch too.
    a, b = random_array((3, 4, 6), seed=5), random_array((6, 8), seed=6)
    if shared == "a":
      a, b = random_array((4, 6), seed=5), random_array((3, 1, 6, 8), seed=6)
    a, b = a.astype(dtype), b.astype(dtype)

    def loss(fn):
      return lambda x, y: jnp.sum(jnp.tanh(fn(x, y).astype(jnp.float32)))

    product = ((lambda x, y: ipu_jax.ops.matmul(x, y)) if mode == "ipu_matmul"
               else (lambda x, y: serialized_matmul(x, y, 2, mode)))  # the same transposes
    grad = jax.grad(loss(product), argnums=(0, 1))
    got = ipu_jax.jit(grad, target=T16)(a, b)
    want = _SHARED_MATRIX_REFERENCE(a, b)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    chex.assert_trees_all_close(jax.tree_util.tree_map(np.asarray, got), want, rtol=tol,
                                atol=tol)
    # No [batch, ...] stack of the shared matrix's gradients is made and summed.
    eqns = jax.make_jaxpr(grad)(a, b).jaxpr.eqns
    products = [e.outvars[0].aval.shape for e in eqns
                if e.primitive in (serialized_matmul_p, ipu_jax.ops.matmul_p)]
    self.assertIn((a if shared == "a" else b).shape, products)
    self.assertEqual([e.primitive.name for e in eqns].count("reduce_sum"), 1)  # the loss's

  @parameterized.parameters("a", "b")
  def test_shared_matrix_gradient_memory_is_the_flat_problems(self, shared):
    # Half precision, as BERT-Large's tied decoder: [8, 4, 32] x [32, 512]
    # split over the vocabulary. Its weight gradient takes the memory of the
    # same problem with the batch flattened into the rows, not 8 stacked
    # float32 copies of the weight's gradient.
    batched = jax.ShapeDtypeStruct((8, 4, 32), jnp.float16)
    flat = jax.ShapeDtypeStruct((32, 32), jnp.float16)
    weight = jax.ShapeDtypeStruct((32, 512), jnp.float16)

    def peak(x_shape):
      def loss(x, w):
        return jnp.sum(serialized_matmul(x, w, 2, "output_channels").astype(jnp.float32))
      if shared == "a":  # the transposed problem: the shared matrix on the left
        x_shape = jax.ShapeDtypeStruct(x_shape.shape[:-2] + x_shape.shape[-1:][::-1]
                                       + x_shape.shape[-2:-1], x_shape.dtype)
        w_t = jax.ShapeDtypeStruct(weight.shape[::-1], weight.dtype)
        fn = jax.grad(lambda w, x: jnp.sum(serialized_matmul(w, x, 2, "a_columns")
                                           .astype(jnp.float32)))
        lowered = ipu_jax.jit(fn, target=T16).lower(w_t, x_shape)
      else:
        lowered = ipu_jax.jit(jax.grad(loss, argnums=1), target=T16).lower(x_shape, weight)
      return int(lowered.profile.memory.peak.max())

    self.assertLessEqual(peak(batched), 1.25 * peak(flat))

  @parameterized.parameters("a_columns", "a_rows_b_columns", "b_rows")
  def test_vmap(self, mode):
    a, b = random_array((3, 4, 6), seed=7), random_array((6, 8), seed=8)
    bb = random_array((3, 6, 8), seed=9)
    for fn, args, want in (
        (jax.vmap(lambda x, y: serialized_matmul(x, y, 2, mode), (0, None)), (a, b), a @ b),
        (jax.vmap(lambda x, y: serialized_matmul(x, y, 2, mode), (None, 0)), (a[0], bb),
         a[0] @ bb),
        (jax.vmap(lambda x, y: serialized_matmul(x, y, 2, mode)), (a, bb), a @ bb)):
      chex.assert_trees_all_close(np.asarray(ipu_jax.jit(fn, target=T16)(*args)),
                                  np.asarray(want), rtol=1e-5, atol=1e-5)

  @parameterized.parameters(("a_columns", "serial mx"), ("b_rows", "serial nx"))
  def test_row_and_column_splits_are_serial_passes(self, mode, label):
    a, b = random_array((8, 16), seed=1), random_array((16, 12), seed=2)
    steps = [s.name for s in _steps(lambda x, y: serialized_matmul(x, y, 4, mode), a, b)]
    passes = [n for n in steps if "/matmul " in n]
    self.assertLen(passes, 4)
    self.assertTrue(all(label + "4" in n for n in passes), steps)
    self.assertIn("pass 4/4", passes[-1])

  def test_contraction_split_is_pieces_summed(self):
    a, b = random_array((8, 16), seed=1), random_array((16, 12), seed=2)
    profile = ipu_jax.jit(lambda x, y: serialized_matmul(x, y, 4, "reducing_dim"),
                          target=T16).lower(a, b).report.profile
    names = [s.name for s in profile.steps]
    self.assertLen([n for n in names if "/matmul " in n], 4)
    # Each piece is added as it comes (not gathered by fusion after the last
    # one): no more than the running sum, the next piece and their sum are live.
    self.assertEqual(names[-1], "serialized_matmul/accumulate")
    self.assertLen([n for n in names if n == "serialized_matmul/accumulate"], 3)
    products = [t for t in profile.tensors if tuple(t.shape) == (8, 12)]
    most_live = max(sum(t.live_from <= i <= t.live_to for t in products)
                    for i in range(len(profile.steps)))
    self.assertLessEqual(most_live, 3)

  def test_cycles_rise(self):
    a, b = random_array((32, 64), seed=1), random_array((64, 96), seed=2)

    def cycles(fn):
      return sum(s.total_cycles for s in _steps(fn, a, b))

    plain = cycles(jnp.matmul)
    for mode in ("a_columns", "a_rows_b_columns", "b_rows"):
      self.assertGreater(cycles(lambda x, y: serialized_matmul(x, y, 2, mode)), plain, mode)

  def test_decoder_projection_working_memory_falls(self):
    """BERT-Large's MLM decoder, [160, 1024] x [1024, 30522] (8 sequences x 20
    masked tokens) on one full IPU, serialised over the vocabulary 2 ways."""
    target = ipu_jax.IPUTarget.preset("ipu2")
    a = jax.ShapeDtypeStruct((160, 1024), jnp.float32)
    b = jax.ShapeDtypeStruct((1024, 30522), jnp.float32)
    figures = {}
    for name, fn in (("plain", jnp.matmul),
                     ("serial", lambda x, y: serialized_matmul(x, y, 2, "output_channels"))):
      profile = ipu_jax.jit(fn, target=target).lower(a, b).report.profile
      figures[name] = (_working_bytes(profile, (160, 30522)),
                       sum(s.total_cycles for s in profile.steps))
    self.assertGreaterEqual(figures["plain"][0] / figures["serial"][0], 1.6, figures)
    self.assertGreater(figures["serial"][1], figures["plain"][1], figures)

  def test_serialising_lowers_the_fullest_tile_where_the_plan_needs_passes(self):
    # [64, 128] x [128, 4096] fp16 on 16 tiles needs serial passes at 0.15
    # already (the BERT decoder's character on a full IPU): serialising over
    # the vocabulary must still cut the fullest tile, not stop at the passes
    # the plain plan takes.
    a, b = random_array((64, 128), jnp.float16, seed=1), random_array((128, 4096), jnp.float16,
                                                                      seed=2)
    cfg = _proportion_config(0.15, tiles=16)
    serial = lambda x, y: serialized_matmul(x, y, 2, "output_channels")
    peak = {name: int(ipu_jax.jit(fn, config=cfg).lower(a, b).report.profile.memory.peak.max())
            for name, fn in (("plain", jnp.matmul), ("serial", serial))}
    self.assertLess(peak["serial"], peak["plain"], peak)
    got = ipu_jax.jit(serial, config=cfg)(a, b)
    want = jax.jit(jnp.matmul)(a, b)
    chex.assert_trees_all_close(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                rtol=2e-2, atol=2e-2)

  def test_plain_plan_is_not_slower_than_a_serialised_one(self):
    """The BERT decoder's [1024, 1024] x [1024, 30522] fp16 on one IPU at 0.6:
    the planner's own plan needs serial passes, and must not be slower than
    the M or N passes a serialised matmul takes (plans it could have picked)."""
    a = jax.ShapeDtypeStruct((1024, 1024), jnp.float16)
    b = jax.ShapeDtypeStruct((1024, 30522), jnp.float16)
    cfg = _proportion_config(0.6)

    def cycles(fn):
      return sum(s.total_cycles for s in ipu_jax.jit(fn, config=cfg).lower(a, b).report
                 .profile.steps)

    plain = cycles(jnp.matmul)
    for mode, factor in (("b_rows", 2), ("a_columns", 2), ("a_columns", 4)):
      serial = cycles(lambda x, y: serialized_matmul(x, y, factor, mode))
      self.assertLessEqual(plain, serial, (mode, factor))

  @parameterized.named_parameters(
      ("not_dividing", 4, "b_rows", ValueError,
       r"factor 4 does not divide the columns N of b \(b.shape\[-1\]\).* = 6; its divisors: "
       r"1, 2, 3, 6"),
      ("zero", 0, "b_rows", ValueError, "must be >= 1, got 0"),
      ("not_int", 2.0, "b_rows", TypeError, "must be an int"),
      ("mode", 2, "columns", ValueError,
       "unknown mode 'columns'; valid modes: 'a_columns', .*'OutputChannels'"),
  )
  def test_bad_input(self, factor, mode, error, message):
    a, b = jnp.ones((4, 6)), jnp.ones((6, 6))
    with self.assertRaisesRegex(error, message):
      ipu_jax.jit(lambda x, y: serialized_matmul(x, y, factor, mode), target=T16).lower(a, b)


class EmbeddingLookupTest(parameterized.TestCase):

  @parameterized.parameters(1, 2, 5)
  def test_equals_take(self, factor):
    table = random_array((10, 3), seed=1)
    ids = jnp.array([[0, 9, 5, 4], [3, 3, 7, 1]], jnp.int32)
    fn = lambda t, i: embedding_lookup(t, i, factor)
    want = jax.jit(fn)(table, ids)
    # Each mode's run equals jax.jit's and the table's rows (run once each:
    # the batched run is the one a plain ipu_jax.jit makes).
    for mode in testing_utils.MODES:
      got = ipu_jax.jit(fn, target=T16, config=testing_utils.executor_config(mode))(table, ids)
      chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
      chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
      chex.assert_trees_all_close(np.asarray(got), np.asarray(table)[np.asarray(ids)])

  def test_grad(self):
    table, ids = random_array((12, 4), seed=2), jnp.array([0, 11, 5, 5, 6], jnp.int32)
    fn = lambda t: jnp.sum(jnp.sin(embedding_lookup(t, ids, 3)))
    want = jax.jit(jax.grad(lambda t: jnp.sum(jnp.sin(t[ids]))))(table)  # one program, not eager ops
    chex.assert_trees_all_close(np.asarray(ipu_jax.jit(jax.grad(fn), target=T16)(table)),
                                np.asarray(want), rtol=1e-6)
    # The pieces' gradients are concatenated into one table, not padded to
    # the table's size and summed.
    names = [e.primitive.name for e in jax.make_jaxpr(jax.grad(fn))(table).jaxpr.eqns]
    self.assertIn("concatenate", names)
    self.assertNotIn("pad", names)

  def test_one_gather_per_piece(self):
    table, ids = random_array((12, 4), seed=2), jnp.array([0, 11, 5], jnp.int32)
    ops = [s.op for s in _steps(lambda t: embedding_lookup(t, ids, 3), table)]
    self.assertEqual(ops.count("gather"), 3)

  def test_bad_factor(self):
    with self.assertRaisesRegex(ValueError, r"factor 4 does not divide the vocabulary "
                                r"\(table.shape\[0\]\) = 10; its divisors: 1, 2, 5, 10"):
      embedding_lookup(jnp.ones((10, 2)), jnp.zeros(3, jnp.int32), 4)


class NNXSerializedTest(chex.TestCase):

  def test_linear_and_tied_embedding(self):
    linear = nnx.Linear(6, 10, rngs=nnx.Rngs(0))
    embed = nnx.Embed(12, 6, rngs=nnx.Rngs(1))
    s_linear = nnx_serialized.serialize(linear, 2)
    s_embed = nnx_serialized.serialize(embed, 3)
    self.assertIs(s_embed.layer.embedding, embed.embedding)  # still the same weight
    x, ids = random_array((4, 6), seed=3), jnp.array([0, 11, 5, 7], jnp.int32)
    run = lambda fn, *args: np.asarray(ipu_jax.nnx_jit(fn, target=T16)(*args))
    chex.assert_trees_all_close(run(lambda m, v: m(v), s_linear, x), np.asarray(linear(x)),
                                rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(run(lambda m, i: m(i), s_embed, ids), np.asarray(embed(ids)))
    chex.assert_trees_all_close(run(lambda m, q: m.attend(q), s_embed, x),
                                np.asarray(embed.attend(x)), rtol=1e-5, atol=1e-6)

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, "factor 4 does not divide out_features = 10"):
      nnx_serialized.serialize(nnx.Linear(6, 10, rngs=nnx.Rngs(0)), 4)
    with self.assertRaisesRegex(TypeError, "expected an nnx.Linear or nnx.Embed"):
      nnx_serialized.serialize(nnx.LayerNorm(4, rngs=nnx.Rngs(0)), 2)


if __name__ == "__main__":
  absltest.main()
