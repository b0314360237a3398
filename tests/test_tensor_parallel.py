"""Tensor parallelism (ipu_jax.parallel): Megatron-style split layers, replica
groups of a (dp, tp) layout, and their IPU-Link collectives.

A tiny functional transformer (2 blocks, width 128, 4 heads, a vocabulary
split over the group) runs under ``parallel.spmd`` for tp = 2 and 4 (and with
dp = 2 on 8 IPUs) and is compared with the unsplit model under plain
``jax.jit``: loss, gradients and the weights after 3 SGD steps. The
all-reduces are counted by hand (bytes and ring cycles over a POD16's links).
"""

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import parallel
from ipu_jax.kernels import collectives as C
from ipu_jax.kernels.systems import system_preset

WIDTH, HEADS, FFN, VOCAB, SEQ, BATCH, LAYERS = 128, 4, 256, 64, 8, 2, 2
LR = 0.1
# One IPU-Link, one direction (docs/systems.md#links: poplibs' IPUModel,
# 128 Gibit/s at 0.85 efficiency); the ladder's rails have 2 links.
LINK = 128 * 2**30 / 8 * 0.85


def _target(system=None):
  return ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16, system=system)


# ---------------------------------------------------------------------------
# The model: one function, either split (parallel ops, heads / tp per shard)
# or unsplit (plain ops, all heads).
# ---------------------------------------------------------------------------

def _plain_linear(x, w, b=None):
  y = x @ w
  return y if b is None else y + b


def _plain_xent(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


PLAIN = (_plain_linear, _plain_linear, lambda ids, t: jnp.take(t, ids, axis=0), _plain_xent)
SPLIT = (parallel.column_linear, parallel.row_linear, parallel.vocab_embedding,
         parallel.vocab_cross_entropy)


def _layer_norm(x, g, b):
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
  return (x - mu) * lax.rsqrt(var + 1e-5) * g + b


def _attention(qkv, heads):
  """Causal attention; ``qkv``'s columns are (head, q/k/v, head_dim)."""
  b, s, _ = qkv.shape
  qkv = qkv.reshape(b, s, heads, 3, WIDTH // HEADS)
  q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(WIDTH // HEADS)
  mask = jnp.tril(jnp.ones((s, s), bool))
  scores = jnp.where(mask, scores, -1e9)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
  return out.reshape(b, s, heads * (WIDTH // HEADS))


def loss_fn(rep, sh, ids, labels, ops, heads):
  col, row, embed, xent = ops
  x = embed(ids, sh["emb"])
  for lr_, ls in zip(rep["layers"], sh["layers"]):
    h = _layer_norm(x, lr_["ln1_g"], lr_["ln1_b"])
    # Heads split across the group: QKV column-split, output row-split.
    x = x + row(_attention(col(h, ls["wqkv"], ls["bqkv"]), heads), ls["wo"], lr_["bo"])
    h = _layer_norm(x, lr_["ln2_g"], lr_["ln2_b"])
    x = x + row(jax.nn.gelu(col(h, ls["w1"], ls["b1"])), ls["w2"], lr_["b2"])
  x = _layer_norm(x, rep["lnf_g"], rep["lnf_b"])
  return xent(col(x, sh["head"]), labels)


def init_params(seed=0):
  # NumPy's generator: jax.random would compile a sampler for every weight shape.
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale: jnp.asarray(  # noqa: E731
      scale * rng.standard_normal(shape, np.float32))
  rep = {"lnf_g": 1 + normal((WIDTH,), 0.1), "lnf_b": normal((WIDTH,), 0.1), "layers": []}
  sh = {"emb": normal((VOCAB, WIDTH), 1.0), "head": normal((WIDTH, VOCAB), 0.1), "layers": []}
  for _ in range(LAYERS):
    rep["layers"].append({"ln1_g": 1 + normal((WIDTH,), 0.1), "ln1_b": normal((WIDTH,), 0.1),
                          "ln2_g": 1 + normal((WIDTH,), 0.1), "ln2_b": normal((WIDTH,), 0.1),
                          "bo": normal((WIDTH,), 0.1), "b2": normal((WIDTH,), 0.1)})
    sh["layers"].append({"wqkv": normal((WIDTH, 3 * WIDTH), 0.09),
                         "bqkv": normal((3 * WIDTH,), 0.1),
                         "wo": normal((WIDTH, WIDTH), 0.09), "w1": normal((WIDTH, FFN), 0.09),
                         "b1": normal((FFN,), 0.1), "w2": normal((FFN, WIDTH), 0.06)})
  return rep, sh


# How each split weight is cut (shard) and joined back (axis).
_ROWS = ("wo", "w2")


def _cut(path, leaf, tp):
  name = path[-1].key
  if name == "emb":
    return parallel.shard_vocab(leaf, tp)
  return parallel.shard_rows(leaf, tp) if name in _ROWS else parallel.shard_columns(leaf, tp)


def _join(path, leaf):
  name = path[-1].key
  axis = 0 if name == "emb" else (-2 if name in _ROWS else -1)
  return jnp.concatenate(list(leaf), axis=axis)


def split(sh, tp):
  return jax.tree_util.tree_map_with_path(lambda p, w: _cut(p, w, tp), sh)


def join(sh_split):
  return jax.tree_util.tree_map_with_path(_join, sh_split)


def _sgd(params, grads):
  return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def plain_step(rep, sh, ids, labels):
  loss, (g_rep, g_sh) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      rep, sh, ids, labels, PLAIN, HEADS)
  return loss, g_rep, g_sh, _sgd(rep, g_rep), _sgd(sh, g_sh)


def make_split_step(tp):
  def step(rep, sh, ids, labels):
    loss, grads = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        rep, sh, ids, labels, SPLIT, HEADS // tp)
    # Data-parallel replicas average (a no-op with dp = 1).
    loss, (g_rep, g_sh) = lax.pmean((loss, grads), parallel.DP_AXIS)
    return loss, g_rep, g_sh, _sgd(rep, g_rep), _sgd(sh, g_sh)
  return step


def batch(dp, seed=1):
  rng = np.random.default_rng(seed)
  ids, labels = (jnp.asarray(rng.integers(0, VOCAB, (dp, BATCH, SEQ)), jnp.int32)
                 for _ in range(2))
  return ids, labels


def spmd_step(dp, tp, target=None):
  return parallel.spmd(make_split_step(tp), parallel.Mesh(dp=dp, tp=tp),
                       ["replicated", "tp_sharded", "dp_sharded", "dp_sharded"],
                       ["replicated", "replicated", "stacked", "replicated", "stacked"],
                       target=target or _target())


def _close(got, want):
  chex.assert_trees_all_close(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want),
                              rtol=1e-5, atol=1e-6)


class TensorParallelTransformerTest(chex.TestCase, parameterized.TestCase):
  """Loss, gradients and 3 SGD steps of the split model equal the unsplit one."""

  def _check(self, dp, tp):
    rep, sh = init_params()
    ids, labels = batch(dp)
    step = spmd_step(dp, tp)
    ref = jax.jit(plain_step)
    t_rep, t_sh = rep, split(sh, tp)
    r_rep, r_sh = rep, sh
    flat_ids, flat_labels = ids.reshape(-1, SEQ), labels.reshape(-1, SEQ)
    for i in range(3):
      loss, g_rep, g_sh, t_rep, t_sh = step(t_rep, t_sh, ids, labels)
      r_loss, r_g_rep, r_g_sh, r_rep, r_sh = ref(r_rep, r_sh, flat_ids, flat_labels)
      t_sh = jax.tree.map(lambda a: a[0], t_sh)  # dp point 0: [tp, ...]
      if i == 0:  # forward loss and gradients
        _close(loss, r_loss)
        _close(g_rep, r_g_rep)
        _close(join(jax.tree.map(lambda a: a[0], g_sh)), r_g_sh)
        if dp > 1:  # every data-parallel replica holds the same shards
          _close(jax.tree.map(lambda a: a[1], g_sh), jax.tree.map(lambda a: a[0], g_sh))
    _close(t_rep, r_rep)
    _close(join(t_sh), r_sh)
    return step.lower(rep, split(sh, tp), ids, labels)

  @parameterized.parameters(2, 4)
  def test_equals_unsplit_model(self, tp):
    lowered = self._check(1, tp)
    # Megatron's pattern: per block, one all-reduce forward and one backward
    # for attention and for the MLP (4); the vocabulary-split embedding (1
    # forward), head (1 backward) and cross-entropy (max, sum-exp, label: 3).
    reduces = [s.name for s in lowered.profile.steps if s.name.startswith("all_reduce")
               and s.name.endswith(f"x{tp}")]
    self.assertLen(reduces, 4 * LAYERS + 1 + 1 + 3)

  def test_tensor_and_data_parallel_on_8_ipus(self):
    lowered = self._check(2, 4)
    names = [s.name for s in lowered.profile.steps if s.name.startswith("all_reduce")]
    self.assertIn("all_reduce<sum>x2", names)  # the data-parallel gradient mean
    self.assertIn("all_reduce<sum>x4", names)


# ---------------------------------------------------------------------------
# Sequence parallelism: the same model, its norm / residual regions split
# along the sequence (Korthikanti et al. 2022).
# ---------------------------------------------------------------------------

def _sum_norm_grads(rep):
  """The norms' weights, used on a sequence block: their gradients summed over
  the group (``copy_to_group``); ``row_linear`` does so for its bias."""
  return jax.tree_util.tree_map_with_path(
      lambda p, w: parallel.copy_to_group(w) if "ln" in p[-1].key else w, rep)


def sp_loss_fn(rep, sh, ids, labels, heads):
  """``loss_fn`` with sequence parallelism: ``x`` is this shard's ``SEQ / tp`` positions."""
  rep = _sum_norm_grads(rep)
  x = parallel.vocab_embedding(ids, sh["emb"], sequence_parallel=True)
  for lr_, ls in zip(rep["layers"], sh["layers"]):
    h = _layer_norm(x, lr_["ln1_g"], lr_["ln1_b"])
    qkv = parallel.column_linear(h, ls["wqkv"], ls["bqkv"], sequence_parallel=True)
    x = x + parallel.row_linear(_attention(qkv, heads), ls["wo"], lr_["bo"],
                                sequence_parallel=True)
    h = _layer_norm(x, lr_["ln2_g"], lr_["ln2_b"])
    up = parallel.column_linear(h, ls["w1"], ls["b1"], sequence_parallel=True)
    x = x + parallel.row_linear(jax.nn.gelu(up), ls["w2"], lr_["b2"], sequence_parallel=True)
  x = _layer_norm(x, rep["lnf_g"], rep["lnf_b"])
  logits = parallel.column_linear(x, sh["head"], sequence_parallel=True)
  return parallel.vocab_cross_entropy(logits, labels)


def make_sp_step(tp):
  def step(rep, sh, ids, labels):
    loss, (g_rep, g_sh) = jax.value_and_grad(sp_loss_fn, argnums=(0, 1))(
        rep, sh, ids, labels, HEADS // tp)
    return loss, g_rep, g_sh, _sgd(rep, g_rep), _sgd(sh, g_sh)
  return step


def sp_spmd_step(tp, target=None):
  return parallel.spmd(make_sp_step(tp), parallel.Mesh(tp=tp),
                       ["replicated", "tp_sharded", "dp_sharded", "dp_sharded"],
                       ["replicated", "replicated", "stacked", "replicated", "stacked"],
                       target=target or _target())


def _block_grad(sequence_parallel, tp):
  """Gradient of one block's output (sum) w.r.t. its input and weights, one shard."""
  def fn(rep, sh, x):
    def block(rep, sh, x):
      if sequence_parallel:
        rep = _sum_norm_grads(rep)
      col = lambda h, w, b: parallel.column_linear(h, w, b, sequence_parallel=sequence_parallel)
      row = lambda h, w, b: parallel.row_linear(h, w, b, sequence_parallel=sequence_parallel)
      x = x + row(_attention(col(_layer_norm(x, rep["ln1_g"], rep["ln1_b"]), sh["wqkv"],
                                 sh["bqkv"]), HEADS // tp), sh["wo"], rep["bo"])
      h = _layer_norm(x, rep["ln2_g"], rep["ln2_b"])
      return jnp.sum(x + row(jax.nn.gelu(col(h, sh["w1"], sh["b1"])), sh["w2"], rep["b2"]))
    return jax.grad(block, argnums=(0, 1, 2))(rep, sh, x)
  # Sequence parallel: x is [tp, B, S / tp, H], shard i's block of positions.
  x_kind = "tp_sharded" if sequence_parallel else "replicated"
  return parallel.spmd(fn, parallel.Mesh(tp=tp), ["replicated", "tp_sharded", x_kind],
                       "stacked", target=_target())


class SequenceParallelTest(chex.TestCase, parameterized.TestCase):
  """Sequence parallelism: the unsplit model's numbers, reduce-scatters and
  all-gathers in place of the activations' all-reduces, less activation memory."""

  @parameterized.parameters(2, 4)
  def test_equals_unsplit_model(self, tp):
    rep, sh = init_params()
    ids, labels = batch(1)
    step = sp_spmd_step(tp)
    ref = jax.jit(plain_step)
    t_rep, t_sh, r_rep, r_sh = rep, split(sh, tp), rep, sh
    for i in range(3):
      # Every shard gets all the labels: the head gathers the sequence and
      # scores all positions against its slice of the vocabulary.
      loss, g_rep, g_sh, t_rep, t_sh = step(t_rep, t_sh, ids, labels)
      r_loss, r_g_rep, r_g_sh, r_rep, r_sh = ref(r_rep, r_sh, ids[0], labels[0])
      t_sh = jax.tree.map(lambda a: a[0], t_sh)
      if i == 0:
        _close(loss, r_loss)
        _close(g_rep, r_g_rep)
        _close(join(jax.tree.map(lambda a: a[0], g_sh)), r_g_sh)
    _close(t_rep, r_rep)
    _close(join(t_sh), r_sh)
    lowered = step.lower(rep, split(sh, tp), ids, labels)
    names = [s.name for s in lowered.profile.steps]
    # Per block: 2 gathers (before QKV and the MLP) and 2 reduce-scatters
    # (after the attention output and the MLP down) forward, their conjugates
    # backward; the embedding scatters (its gradient gathers) and the head
    # gathers (its gradient scatters).
    self.assertEqual(names.count(f"all_gather x{tp}"), 4 * LAYERS + 2)
    self.assertEqual(names.count(f"reduce_scatter x{tp}"), 4 * LAYERS + 2)
    # No activation is all-reduced: what remains are the replicated weights'
    # gradients ([WIDTH] vectors) and the cross-entropy's [B, S] statistics.
    for st in lowered.profile.steps:
      if st.name.startswith("all_reduce"):
        self.assertLessEqual(st.ipu_link_bytes, 2 * WIDTH * 4, st.name)

  def test_plain_tp_all_reduces_the_activations(self):
    # The contrast of the test above: plain TP all-reduces [B, S, H].
    rep, sh = init_params()
    ids, labels = batch(1)
    lowered = spmd_step(1, 2).lower(rep, split(sh, 2), ids, labels)
    biggest = max(s.ipu_link_bytes for s in lowered.profile.steps
                  if s.name.startswith("all_reduce"))
    self.assertGreaterEqual(biggest, BATCH * SEQ * WIDTH * 4 // 2)

  def test_block_activation_memory_falls_by_the_sequence_split(self):
    tp, seq = 4, 64
    rep, sh = init_params()
    rep, sh = rep["layers"][0], split(sh["layers"][0], tp)
    x = jax.random.normal(jax.random.key(5), (BATCH, seq, WIDTH), jnp.float32)
    x_blocks = jnp.stack(jnp.split(x, tp, axis=1))  # [tp, B, S / tp, H]
    plain_fn, sp_fn = _block_grad(False, tp), _block_grad(True, tp)

    def activations(fn, x):
      # Tensors at each tile's peak (the profile's variables and temporaries;
      # code, vertex state and exchange buffers are the same program's).
      memory = fn.lower(rep, sh, x).profile.memory
      return int(memory.by_category["variables"].sum() + memory.by_category["temporaries"].sum())
    # The block's input, residual stream and norms: [B, S / tp, H] a shard
    # instead of [B, S, H]; the matmuls' gathered inputs and the attention
    # scores stay whole (measured: 1,211,520 -> 881,792 bytes, -27%).
    plain_bytes, sp_bytes = activations(plain_fn, x), activations(sp_fn, x_blocks)
    self.assertLess(sp_bytes, 0.8 * plain_bytes)
    # And the numbers agree: the weights' gradients, and the input's, whose
    # blocks are the shards' (a sum over 16,384 outputs: within 1e-5 of each
    # gradient's scale).
    g_plain, g_sp = plain_fn(rep, sh, x), sp_fn(rep, sh, x_blocks)
    got = (jax.tree.map(lambda a: a[0, 0], g_sp[0]), g_sp[1],
           jnp.concatenate(list(g_sp[2][0]), axis=1))
    want = (jax.tree.map(lambda a: a[0, 0], g_plain[0]), g_plain[1], g_plain[2][0, 0])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      b = np.asarray(b)
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())

  def test_sequence_not_divisible_names_the_sizes(self):
    fn = parallel.spmd(lambda v: parallel.scatter_sequence(v), parallel.Mesh(tp=4),
                       "replicated", "stacked", target=_target())
    with self.assertRaisesRegex(ValueError, r"sequence length 6.*group size 4"):
      fn.lower(jnp.ones((2, 6, 8)))


class ReplicaGroupsTest(chex.TestCase, parameterized.TestCase):

  # PopXL's API reference, popxl.ReplicaGrouping.assignment, replication factor 8.
  @parameterized.parameters(
      (1, 8, [0, 0, 0, 0, 0, 0, 0, 0]), (1, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
      (1, 2, [0, 0, 1, 1, 2, 2, 3, 3]), (2, 2, [0, 1, 0, 1, 2, 3, 2, 3]),
      (1, 4, [0, 0, 0, 0, 1, 1, 1, 1]), (2, 4, [0, 1, 0, 1, 0, 1, 0, 1]))
  def test_popxl_assignments(self, stride, group_size, assignment):
    self.assertEqual(parallel.ReplicaGrouping(group_size, stride).assignment(8), assignment)

  def test_mesh_axes_are_the_popxl_groupings(self):
    mesh = parallel.Mesh(dp=2, tp=4)
    self.assertEqual(mesh.num_ipus, 8)
    tp_groups = parallel.axis_groups(mesh.axes, [parallel.TP_AXIS])
    dp_groups = parallel.axis_groups(mesh.axes, [parallel.DP_AXIS])
    self.assertEqual(tp_groups, [[0, 1, 2, 3], [4, 5, 6, 7]])
    self.assertEqual(dp_groups, [[0, 4], [1, 5], [2, 6], [3, 7]])
    self.assertEqual(tp_groups, mesh.tp_grouping.groups(8))
    self.assertEqual(dp_groups, mesh.dp_grouping.groups(8))

  def test_bad_grouping_names_the_counts(self):
    with self.assertRaisesRegex(ValueError, r"multiple of group_size x stride = 6.*7"):
      parallel.ReplicaGrouping(3, 2).groups(7)


class TensorParallelCollectiveCostTest(chex.TestCase, parameterized.TestCase):
  """One all-reduce counted by hand over a POD16's IPU-Links."""

  def _reduce_step(self, lowered, name):
    steps = [s for s in lowered.profile.steps if s.name == name]
    self.assertLen(steps, 1)
    return steps[0]

  def test_tp_all_reduce_bytes_and_cycles(self):
    b, s, h, tp = 2, 16, 64, 4
    target = _target(system_preset("pod16"))
    fn = parallel.spmd(lambda x, w: parallel.row_linear(x, w), parallel.Mesh(tp=tp),
                       ["tp_sharded", "tp_sharded"], "replicated", target=target)
    x = jnp.ones((tp, b, s, 32), jnp.float32)
    w = jnp.ones((tp, 32, h), jnp.float32)
    lowered = fn.lower(x, w)
    step = self._reduce_step(lowered, "all_reduce<sum>x4")
    # The report shows it as a collective step over the system's links.
    self.assertIn("replica all-reduce priced over the pod16 system's links "
                  "(docs/systems.md#collectives)", step.notes)
    self.assertIn("IPU-Link traffic", lowered.report.summary())
    nbytes = b * s * h * 4
    # Each IPU sends 2 (tp - 1) / tp of the [B, S, H] fp32 activation it holds.
    self.assertEqual(step.ipu_link_bytes, int(np.ceil(2 * (tp - 1) / tp * nbytes)))
    # The ring inside one IPU-M2000 (0 -> 2 -> 3 -> 1): 2 (tp - 1) steps, each
    # member sending nbytes / tp, the rails (2 links) slowest, one hop's
    # latency and a sync of the 4 IPUs each step.
    ring_step = nbytes / tp / (2 * LINK) * target.clock_hz + target.exchange_latency_cycles
    links = 2 * (tp - 1) * (ring_step + target.ipu_sync_cycles(tp))
    busiest = max(step.exchange_bytes_in.max(), step.exchange_bytes_out.max())
    on_ipu = busiest / target.exchange_bytes_per_cycle + target.exchange_latency_cycles
    self.assertAlmostEqual(step.exchange_cycles, on_ipu + links, places=2)
    np.testing.assert_allclose(np.asarray(fn(x, w)), np.full((b, s, h), 32.0 * tp))

  @parameterized.named_parameters(
      ("psum", lambda v: lax.psum(v, parallel.DP_AXIS)),
      ("ipu_op", lambda v: ipu_jax.ops.cross_replica_sum(v, parallel.DP_AXIS)))
  def test_dp_all_reduce_is_priced_over_stride_tp_groups(self, reduce):
    target = _target(system_preset("pod16"))
    mesh = parallel.Mesh(dp=2, tp=4)
    fn = parallel.spmd(reduce, mesh, "sharded", "stacked", target=target)
    v = jnp.arange(2 * 4 * 1024, dtype=jnp.float32).reshape(2, 4, 1024)
    step = self._reduce_step(fn.lower(v), "all_reduce<sum>x2")
    nbytes = 1024 * 4
    strided = C.all_reduce(target, [[0, 4], [1, 5], [2, 6], [3, 7]], nbytes).cycles
    contiguous = C.all_reduce(target, [[0, 1], [2, 3], [4, 5], [6, 7]], nbytes).cycles
    busiest = max(step.exchange_bytes_in.max(), step.exchange_bytes_out.max())
    on_ipu = busiest / target.exchange_bytes_per_cycle + target.exchange_latency_cycles
    self.assertAlmostEqual(step.exchange_cycles, on_ipu + strided, places=2)
    # Pairs 4 IPUs apart cross a machine boundary (a rail and a cable, all
    # four pairs on the two sides' links); consecutive pairs are rungs (4 links).
    self.assertGreater(strided, contiguous * 1.5)
    got = np.asarray(fn(v))
    np.testing.assert_allclose(got, np.broadcast_to(v.sum(0), (2, 4, 1024)))


  def test_one_function_lowered_under_two_tp_sizes_prices_each(self):
    # A psum's jaxpr names its axis, not its size: the jit's cache (and the
    # executable cache's key) hold the bound axes, or tp=4 would reuse tp=2's.
    from ipu_jax.lowering.rules.parallel import binding_axes
    f = ipu_jax.jit(lambda v: lax.psum(v * 2.0, parallel.TP_AXIS), target=_target())
    v = jnp.ones((64, 33), jnp.float32)
    cycles = {}
    for tp in (2, 4):
      with binding_axes([(parallel.TP_AXIS, tp)]):
        step = self._reduce_step(f.lower(v), f"all_reduce<sum>x{tp}")
      cycles[tp] = step.exchange_cycles
    self.assertGreater(cycles[4], cycles[2])


class TensorParallelErrorsTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(
      (3, dict(heads=4, hidden=128), r"tensor_parallel=3 does not divide heads=4, hidden=128.*"
                                     r"\[1, 2, 4\]"),
      (8, dict(heads=4, hidden=128, vocab=64), r"tensor_parallel=8 does not divide heads=4.*"
                                               r"\[1, 2, 4\]"),
      (2, dict(heads=4, hidden=128, vocab=51), r"does not divide vocab=51.*\[1\]"))
  def test_tp_not_dividing_names_field_and_divisors(self, tp, sizes, message):
    with self.assertRaisesRegex(ValueError, message):
      parallel.check_tensor_parallel(tp, **sizes)

  def test_check_passes_and_names_other_fields(self):
    self.assertEqual(parallel.check_tensor_parallel(4, heads=4, hidden=128, vocab=64), 4)
    with self.assertRaisesRegex(ValueError, r"llm\.tp=3 does not divide"):
      parallel.check_tensor_parallel(3, heads=4, field="llm.tp")

  def test_mesh_larger_than_system_names_the_counts(self):
    with self.assertRaisesRegex(ValueError, r"Mesh\(dp=4, tp=8\).*4 x 8 x 1 = 32 IPUs.*"
                                            r"pod16 system has 16"):
      parallel.spmd(lambda v: v, parallel.Mesh(dp=4, tp=8), "replicated", "replicated",
                    target=_target(system_preset("pod16")))

  def test_shard_helpers_name_the_divisors(self):
    with self.assertRaisesRegex(ValueError, r"shard_columns.*100 entries.*tp=3.*\[1, 2, 4, 5"):
      parallel.shard_columns(jnp.ones((4, 100)), 3)
    with self.assertRaisesRegex(ValueError, r"out_features=100 is not divisible by tp=3"):
      from flax import nnx
      parallel.ColumnParallelLinear(8, 100, 3, rngs=nnx.Rngs(0))

  def test_arguments_without_mesh_axes_are_refused(self):
    fn = parallel.spmd(lambda v: v, parallel.Mesh(tp=2), ["tp_sharded"], "replicated",
                       target=_target())
    with self.assertRaisesRegex(ValueError, r"argument 0 is 'tp_sharded'.*\(2,\).*\(3, 4\)"):
      fn.lower(jnp.ones((3, 4)))


class ShardModulesTest(chex.TestCase):
  """The NNX shard modules equal the unsplit layers they were cut from."""

  def test_mlp_and_vocab_modules(self):
    from flax import nnx
    tp, width, ffn, vocab = 2, 16, 32, 8
    keys = jax.random.split(jax.random.key(3), 4)
    w1 = jax.random.normal(keys[0], (width, ffn)) * 0.2
    w2 = jax.random.normal(keys[1], (ffn, width)) * 0.2
    table = jax.random.normal(keys[2], (vocab, width))
    ids = jax.random.randint(keys[3], (3, 5), 0, vocab)

    def build():
      rngs = nnx.Rngs(0)
      return (parallel.VocabParallelEmbedding(vocab, width, tp, rngs=rngs),
              parallel.ColumnParallelLinear(width, ffn, tp, use_bias=False, rngs=rngs),
              parallel.RowParallelLinear(ffn, width, tp, use_bias=False, rngs=rngs))
    shards = (parallel.shard_vocab(table, tp), parallel.shard_columns(w1, tp),
              parallel.shard_rows(w2, tp))
    states = []
    for i in range(tp):  # shard i's modules, holding its cut of the weights
      emb, up, down = build()
      emb.embedding[...], up.kernel[...], down.kernel[...] = (w[i] for w in shards)
      graphdef, state = nnx.split((emb, up, down))
      states.append(state)
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)

    def fn(state, ids):
      emb, up, down = nnx.merge(graphdef, state)
      return emb.attend(down(jnp.tanh(up(emb(ids)))))

    got = parallel.spmd(fn, parallel.Mesh(tp=tp), ["tp_sharded", "replicated"], "stacked",
                        target=_target())(stacked, ids)
    want = jnp.tanh(table[ids] @ w1) @ w2 @ table.T
    _close(jnp.concatenate(list(np.asarray(got)[0]), -1), want)


if __name__ == "__main__":
  absltest.main()
