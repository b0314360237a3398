"""Phased execution (issue 39): serial and ping-pong phases with remote weights and
optimizer state, replicated tensor sharding over replicas, batch serialisation; the
estimate's streaming figures counted by hand; bad input refused before anything runs."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized

import ipu_jax
from ipu_jax import phased
from ipu_jax import parallel
from ipu_jax.parallel import Mesh
import testing_utils

T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)

# -- a small GPT, written functionally: embedding, decoder layers, head ---------------------
# One definition, unsplit (plain ops, all heads) or tensor-parallel (ipu_jax.parallel's
# column / row / vocabulary-parallel ops on one shard, heads / tp heads a shard).

WIDTH, HEADS, VOCAB, SEQ = 128, 4, 256, 16


def _plain_linear(x, w):
  return x @ w


def _plain_xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def ln(x, g):
  m = x.mean(-1, keepdims=True); v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) * jax.lax.rsqrt(v + 1e-5) * g


def gpt_applies(tp=None):
  """``(embed, decoder, head)`` phase applies: unsplit (``tp=None``) or one TP shard's."""
  if tp is None:
    col, row, heads = _plain_linear, _plain_linear, HEADS
    lookup, xent = (lambda ids, t: t[ids]), _plain_xent
  else:
    col, row, heads = parallel.column_linear, parallel.row_linear, HEADS // tp
    lookup, xent = parallel.vocab_embedding, parallel.vocab_cross_entropy
  hd = WIDTH // HEADS

  def embed(p, ids):
    return lookup(ids, p["tok"]) + p["pos"][None]

  def decoder(p, x):
    b, s, _ = x.shape
    # qkv's columns are (head, q/k/v, head_dim): a column split gives whole heads.
    qkv = col(ln(x, p["ln1"]), p["qkv"]).reshape(b, s, heads, 3, hd)
    q, k, v = (qkv[:, :, :, i].transpose(0, 2, 1, 3) for i in range(3))
    att = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    mask = jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), -1)
    o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, heads * hd)
    x = x + row(o, p["proj"])
    return x + row(jax.nn.gelu(col(ln(x, p["ln2"]), p["fc1"])), p["fc2"])

  def head(p, x, labels):
    return xent(col(ln(x, p["lnf"]), p["out"]), labels)
  return embed, decoder, head


embed, decoder, head = gpt_applies()
# How each weight is split over tp shards (the rest is replicated: tp copies).
_SPLIT = {"tok": parallel.shard_vocab, "qkv": parallel.shard_columns,
          "fc1": parallel.shard_columns, "out": parallel.shard_columns,
          "proj": parallel.shard_rows, "fc2": parallel.shard_rows}


def tp_split(ps, tp):
  """Each phase's weights as stacked ``[tp, ...]`` shards (replicated leaves copied)."""
  def one(path, w):
    cut = _SPLIT.get(path[-1].key)
    return cut(w, tp) if cut else jnp.broadcast_to(w, (tp,) + w.shape)
  return [jax.tree_util.tree_map_with_path(one, p) for p in ps]


def gpt_params(seed=0, layers=4):
  k = iter(jax.random.split(jax.random.key(seed), 4 * layers + 4))
  n = lambda *s: 0.05 * jax.random.normal(next(k), s)
  ps = [{"tok": n(VOCAB, WIDTH), "pos": n(SEQ, WIDTH)}]
  for _ in range(layers):
    ps.append({"ln1": jnp.ones(WIDTH), "qkv": n(WIDTH, 3 * WIDTH), "proj": n(WIDTH, WIDTH),
               "ln2": jnp.ones(WIDTH), "fc1": n(WIDTH, 4 * WIDTH), "fc2": n(4 * WIDTH, WIDTH)})
  ps.append({"lnf": jnp.ones(WIDTH), "out": n(WIDTH, VOCAB)})
  return ps


def gpt_model(ps, applies=None):
  embed_fn, decoder_fn, head_fn = applies or (embed, decoder, head)
  names = ["embed"] + [f"layer{i}" for i in range(len(ps) - 2)] + ["head"]
  fns = [embed_fn] + [decoder_fn] * (len(ps) - 2) + [head_fn]
  return phased.PhasedModel([phased.Phase(n, a, p) for n, a, p in zip(names, fns, ps)])

def full_loss(ps, ids, labels):
  x = embed(ps[0], ids)
  for p in ps[1:-1]:
    x = decoder(p, x)
  return head(ps[-1], x, labels)

def token_losses(ps, ids, labels):
  """Each token's loss (``full_loss`` is their mean)."""
  x = embed(ps[0], ids)
  for p in ps[1:-1]:
    x = decoder(p, x)
  logits = ln(x, ps[-1]["lnf"]) @ ps[-1]["out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


_grad = jax.jit(jax.grad(full_loss))
# Per-token gradients, |.| summed: how large the terms of each gradient element's sum are.
_abs_terms = jax.jit(lambda ps, ids, labels: jax.tree.map(
    lambda j: jnp.sum(jnp.abs(j), axis=(0, 1)), jax.jacrev(token_losses)(ps, ids, labels)))


def accumulated_reference(ps, opt, batches, micro, dp=1):
  """Plain JAX (``jax.jit``) gradient accumulation, in the phased step's order.

  Each of the ``dp`` replicas sums the gradients of its G micro-batches in
  turn, the replicas' sums are added (the all-reduce) and scaled by
  1 / (dp G), as the phase programs do: the only order left to differ from
  the emulator's is inside each micro-batch's gradient (the tiles sum matmul
  partials in their own order, not XLA's).

  Returns:
    ``(weights, tolerance)``: the weights after the steps, and per weight
    element the first-order bound on how far rounding can move them
    (:func:`adam_rounding_tolerance`).
  """
  state = opt.init(ps)
  adam = AdamRoundingBound(ps)
  # The sums in NumPy (float32 adds round as XLA's do) and the update as one
  # jax.jit program: eager jnp ops would compile a program per operation and shape.
  @jax.jit
  def update(g, state, ps):
    up, state = opt.update(g, state, ps)
    return optax.apply_updates(ps, up), state

  host = lambda tree: jax.tree.map(np.asarray, tree)  # noqa: E731
  for ids, labels in batches:
    n = ids.shape[0] // micro
    g_per = n // dp
    mbs = [(ids[i*micro:(i+1)*micro], labels[i*micro:(i+1)*micro]) for i in range(n)]
    sums = []
    for r in range(dp):
      gs = [host(_grad(ps, *mbs[r * g_per + i])) for i in range(g_per)]
      sums.append(functools.reduce(lambda a, b: jax.tree.map(np.add, a, b), gs))
    g = jax.tree.map(lambda *a: functools.reduce(np.add, a) * np.float32(1.0 / n), *sums)
    terms = jax.tree.map(lambda *a: sum(a) / (n * micro * SEQ),
                         *[host(_abs_terms(ps, *mb)) for mb in mbs])
    adam.step(g, terms, n * micro * SEQ)
    ps, state = update(g, state, ps)
  return ps, adam.tolerance


class AdamRoundingBound:
  """How far float32 rounding of the gradients can move Adam's weights (first order).

  Each token's loss reaches back over up to SEQ positions (attention), so a
  gradient element is a sum of ``N = tokens x SEQ`` terms, summed in an order
  the emulator's tile plans choose, not XLA's. Its rounding error is taken
  as ``testing_utils.sum_error_bound``'s "typical" rule,
  ``dg = TYPICAL_SUM_SAFETY u sqrt(N) (sum |t| + |g|)`` (u = 2^-24; ``sum |t|``
  from the per-token gradients). Adam's update ``lr m / (sqrt(v) + eps)``
  turns ``dg`` into ``lr (dm / (sqrt(v) + eps) + |m| dv / (2 sqrt(v)
  (sqrt(v) + eps)^2))`` (m, v bias-corrected; ``dm``, ``dv`` their moving
  averages of ``dg`` and ``2 |g| dg``), at most twice the largest update
  ``lr R_t`` (Cauchy-Schwarz: ``|m| / sqrt(v) <= R_t = sqrt(sum_i a_i^2 / b_i)``
  for Adam's weights a_i, b_i of step i's gradient in m and v). Where a
  gradient cancels to near zero (|g| << sum |t|), 1 / sqrt(v) magnifies its
  rounding into a visible weight difference -- with the default eps 1 of
  65,536 elements differs by ~1e-6 absolute, so a fixed atol would only record
  one machine's rounding. Elsewhere the bound is far below rtol 1e-5, so a
  wrong gradient still fails. optax.adam's defaults.
  """

  def __init__(self, ps, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
    self.lr, self.b1, self.b2, self.eps, self.t = lr, b1, b2, eps, 0
    zeros = lambda: jax.tree.map(lambda a: np.zeros(np.shape(a)), ps)  # noqa: E731
    self.m, self.v, self.dm, self.dv, self.tolerance = (zeros() for _ in range(5))

  def _largest_ratio(self) -> float:
    b1, b2, t = self.b1, self.b2, self.t
    a = np.array([(1 - b1) * b1 ** (t - i) / (1 - b1**t) for i in range(1, t + 1)])
    b = np.array([(1 - b2) * b2 ** (t - i) / (1 - b2**t) for i in range(1, t + 1)])
    return float(np.sqrt(np.sum(a * a / b)))

  def step(self, g, terms, n):
    """One step: gradient ``g``, ``terms`` (sum |per-token gradient|, same scale), n tokens."""
    self.t += 1
    u = np.finfo(np.float32).eps / 2
    b1, b2, t = self.b1, self.b2, self.t
    cap = 2 * self.lr * self._largest_ratio()

    def one(g, a, m, v, dm, dv, tol):
      g, a = np.asarray(g, np.float64), np.asarray(a, np.float64)
      dg = testing_utils.TYPICAL_SUM_SAFETY * u * np.sqrt(n * SEQ) * (a + np.abs(g))
      m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
      dm, dv = b1 * dm + (1 - b1) * dg, b2 * dv + (1 - b2) * (2 * np.abs(g) * dg + dg * dg)
      mh, vh, dmh, dvh = m / (1 - b1**t), v / (1 - b2**t), dm / (1 - b1**t), dv / (1 - b2**t)
      root = np.sqrt(vh)
      du = dmh / (root + self.eps) + np.abs(mh) * dvh / (
          2 * np.maximum(root, 1e-30) * (root + self.eps) ** 2)
      return m, v, dm, dv, tol + np.minimum(self.lr * du, cap)
    out = jax.tree.map(one, g, terms, self.m, self.v, self.dm, self.dv, self.tolerance)
    pick = lambda k: jax.tree.map(lambda o: o[k], out, is_leaf=lambda o: isinstance(o, tuple))  # noqa: E731
    self.m, self.v, self.dm, self.dv, self.tolerance = (pick(k) for k in range(5))


def assert_within_rounding(got, want, tolerance, rtol=1e-5):
  """``got`` equals ``want`` to ``rtol`` plus each element's rounding tolerance."""
  for path, g in jax.tree_util.tree_leaves_with_path(got):
    w = np.asarray(functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx],
                                    path, want))
    tol = functools.reduce(lambda t, k: t[k.key if hasattr(k, "key") else k.idx], path,
                           tolerance)
    excess = np.abs(np.asarray(g, np.float64) - w) - (rtol * np.abs(w) + tol)
    if (excess > 0).any():
      i = np.unravel_index(np.argmax(excess), excess.shape)
      raise AssertionError(
          f"{jax.tree_util.keystr(path)}: {int((excess > 0).sum())} of {excess.size} elements "
          f"differ by more than rtol {rtol} + the rounding bound; worst at {i}: got {g[i]!r}, "
          f"want {w[i]!r}, bound {rtol * abs(w[i]) + tol[i]!r}")


def gpt_data(steps, batch, seed=1):
  r = np.random.RandomState(seed)
  return [(r.randint(0, VOCAB, (batch, SEQ)), r.randint(0, VOCAB, (batch, SEQ))) for _ in range(steps)]


# optax.adam with its defaults (eps 1e-8): the comparison's tolerance is Adam's own
# rounding bound (AdamRoundingBound). One instance, so trainers of one model share programs.
ADAM = optax.adam(1e-3)


def _adam():
  return ADAM


@functools.lru_cache(maxsize=None)
def shared_reference(dp, g, micro, steps=3):
  """``accumulated_reference`` of ``gpt_params()`` under ``ADAM`` on ``gpt_data(steps,
  dp g micro)``: the same weights and bound for every test of that layout (the
  per-token gradients of the bound are the costly part), computed once. Read only."""
  return accumulated_reference(gpt_params(), ADAM, gpt_data(steps, dp * g * micro), micro, dp)


class PhasedTrainingTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ("serial_g4", "serial", 1, False, 4),
      ("ping_pong_rts2_g4", "ping_pong", 2, True, 4),
      ("serial_rts2_g4", "serial", 2, True, 4))
  def test_three_steps_equal_plain_jax_gradient_accumulation(self, mode, dp, rts, g):
    ps = gpt_params()
    opt = _adam()
    layout = phased.PhasedLayout(mode=mode, batch_serialisation=g, rts=rts,
                                 mesh=Mesh(dp=dp, tp=1))
    trainer = phased.PhasedTrainer(gpt_model(ps), opt, layout, T16)
    micro = 2
    batches = gpt_data(3, dp * g * micro)
    losses = [trainer.step(b) for b in batches]
    self.assertTrue(all(np.isfinite(losses)))
    expected, tolerance = shared_reference(dp, g, micro)
    assert_within_rounding(trainer.params, expected, tolerance)
    # The report: per-phase loads/stores, streaming bytes and the overlap.
    estimate = trainer.estimate()
    self.assertEqual([(p.name, p.direction) for p in estimate.phases],
                     [("embed", "forward")] + [(f"layer{i}", "forward") for i in range(4)]
                     + [("head", "backward")]
                     + [(f"layer{i}", "backward") for i in (3, 2, 1, 0)]
                     + [("embed", "backward")])
    # One forward, one backward and one update program (and with RTS one load) for the
    # four identical decoder layers; the embedding and the head have their own.
    self.assertEqual(estimate.programs_lowered, 11 if rts else 8)
    text = estimate.summary()
    self.assertIn(f"Phases ({mode}, G={g}", text)
    self.assertIn("exposed streaming", text)
    d = estimate.to_dict()
    self.assertEqual(d["streaming_bytes_per_step"],
                     sum(r["load_bytes"] + r["store_bytes"] for r in d["phases"]))
    self.assertTrue(d["fits"])
    self.assertEqual(d["num_ipus"], dp * (2 if mode == "ping_pong" else 1))
    exposed = estimate.breakdown["streaming"]
    if mode == "ping_pong":
      # One group's loads and stores under the other's compute: most is hidden.
      self.assertLess(exposed, 0.5 * estimate.streaming_cycles)
    else:
      self.assertAlmostEqual(exposed, estimate.streaming_cycles, delta=1e-6 * exposed)


class TensorParallelPhasedTest(parameterized.TestCase):
  """TP + phases + DP on 8 IPUs (issue 39's acceptance): dp=2 replicas of a model split
  over tp=4 IPUs, each phase's matmuls column/row-split (heads split across the group),
  the embedding and the head vocabulary-parallel; remote weights and optimizer state,
  RTS over the 2 replicas, G=4."""

  @parameterized.named_parameters(("serial", "serial"), ("ping_pong", "ping_pong"))
  def test_three_steps_equal_unsplit_gradient_accumulation(self, mode):
    dp, tp, g, micro = 2, 4, 4, 2
    ps = gpt_params()
    opt = _adam()
    layout = phased.PhasedLayout(mode=mode, batch_serialisation=g, rts=True,
                                 mesh=Mesh(dp=dp, tp=tp))
    trainer = phased.PhasedTrainer(gpt_model(tp_split(ps, tp), gpt_applies(tp)), opt, layout,
                                   T16)
    batches = gpt_data(3, dp * g * micro)
    losses = [trainer.step(b) for b in batches]
    self.assertTrue(all(np.isfinite(losses)))
    expected, tolerance = shared_reference(dp, g, micro)
    assert_within_rounding(trainer.params, tp_split(expected, tp), tp_split(tolerance, tp))
    estimate = trainer.estimate()
    self.assertEqual(estimate.programs_lowered, 11)
    self.assertEqual(estimate.to_dict()["num_ipus"], dp * tp * (2 if mode == "ping_pong" else 1))
    # The tensor-parallel all-reduces (and the RTS gathers / reduce-scatters) are priced.
    self.assertTrue(all(p.collective_cycles > 0 for p in estimate.phases))


def _dense(p, x):
  return x @ p["w"]


def _dense_loss(p, x, y):
  return jnp.mean((x @ p["w"] - y) ** 2)


def _two_dense(width=128, dtype=jnp.float32, concrete=False):
  shape = lambda: ({"w": jnp.ones((width, width), dtype)} if concrete  # noqa: E731
                   else {"w": jax.ShapeDtypeStruct((width, width), dtype)})
  return phased.PhasedModel([phased.Phase("layer0", _dense, shape()),
                             phased.Phase("layer1", _dense_loss, shape())])


class StreamingBytesTest(parameterized.TestCase):

  def test_hand_counted_bytes_and_cycles(self):
    # 2 layers of one [128, 128] fp32 kernel, Adam, G=2, RTS over 2 replicas,
    # micro-batch 2: per IPU W = 128*128*4 / 2 = 32,768 B; Adam's mu and nu
    # 2 x 32,768 = 65,536 B (its int32 count, 4 B, stays on the tiles: under
    # 128 B); one micro-batch's activation 2*128*4 = 1,024 B, G of them 2,048 B.
    layout = phased.PhasedLayout(batch_serialisation=2, rts=True, mesh=Mesh(dp=2))
    trainer = phased.PhasedTrainer(_two_dense(), optax.adam(1e-3), layout, T16)
    batch = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    est = trainer.estimate((batch, batch))
    w, o, a = 32_768, 65_536, 2_048
    rows = {(p.name, p.direction): p for p in est.phases}
    fwd0, bwd1, bwd0 = rows["layer0", "forward"], rows["layer1", "backward"], rows["layer0", "backward"]
    self.assertEqual((fwd0.traffic.weights_load, fwd0.traffic.activations_load,
                      fwd0.store_bytes), (w, 0, a))   # data from the host; stores its output
    self.assertEqual((bwd1.traffic.weights_load, bwd1.traffic.optimizer_load,
                      bwd1.traffic.activations_load), (w, o, a))  # its stored input
    self.assertEqual((bwd1.traffic.weights_store, bwd1.traffic.optimizer_store,
                      bwd1.traffic.activations_store), (w, o, a))  # dx for layer0
    self.assertEqual((bwd0.load_bytes, bwd0.store_bytes), (w + o + a, w + o))
    self.assertEqual(est.streaming_bytes_per_step, (w + a) + 2 * (w + o + a) + (w + o + a)
                     + (w + o))
    rate = T16.streaming_memory_bytes_per_second / T16.clock_hz  # bytes per cycle
    for p in est.phases:
      self.assertAlmostEqual(p.streaming_cycles, (p.load_bytes + p.store_bytes) / rate,
                             places=6)
    # Streaming Memory held per IPU: W and O of both layers and layer1's stored input.
    self.assertEqual(est.streaming_memory_bytes_per_ipu, 2 * (w + o) + a + a)
    # The update program's own remote buffers are the counted W and O (the IR's
    # streaming memory, ipu_jax.jit's offload).
    programs = phased.programs.lower_programs(
        phased.programs.PhaseKind("last", _dense_loss, _two_dense().phases[1].params,
                                  jax.ShapeDtypeStruct((2, 128), jnp.float32),
                                  (jax.ShapeDtypeStruct((2, 128), jnp.float32),)),
        trainer.optimizer, layout, trainer.target, None, True)
    self.assertEqual(programs.update.profile.streaming.total_bytes, w + o)

  def test_estimate_lowers_each_distinct_program_once(self):
    # 2 or 8 identical decoder layers: the same programs, so the same lowering work.
    counts = []
    for layers in (2, 8):
      ps = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        gpt_params(layers=layers))
      trainer = phased.PhasedTrainer(gpt_model(ps), _adam(), phased.PhasedLayout(), T16)
      ids = jax.ShapeDtypeStruct((2, SEQ), jnp.int32)
      est = trainer.estimate((ids, ids))
      counts.append(est.programs_lowered)
      self.assertLen(est.phases, 2 * (layers + 2) - 1)
    self.assertEqual(counts, [8, 8])


  def test_tiles_hold_one_micro_batch_of_activations(self):
    # Batch serialisation keeps each micro-batch's activations in Streaming Memory and
    # streams them per micro-batch inside the phase: the In-Processor peak does not grow
    # with G, while the compute and the activation traffic grow G-fold.
    ps = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), gpt_params())
    est = {}
    for g in (2, 8):
      trainer = phased.PhasedTrainer(gpt_model(ps), _adam(),
                                     phased.PhasedLayout(batch_serialisation=g), T16)
      ids = jax.ShapeDtypeStruct((2 * g, SEQ), jnp.int32)
      est[g] = trainer.estimate((ids, ids))
    self.assertEqual(est[2].per_ipu_peak_bytes, est[8].per_ipu_peak_bytes)
    fwd = {g: {(p.name, p.direction): p for p in e.phases}["layer1", "forward"]
           for g, e in est.items()}
    self.assertEqual(fwd[8].traffic.activations_load, 4 * fwd[2].traffic.activations_load)
    self.assertAlmostEqual(fwd[8].compute_cycles, 4 * fwd[2].compute_cycles,
                           delta=1e-9 * fwd[8].compute_cycles)
    # A host sync per micro-batch's activation copy each way, one for the weights.
    self.assertAlmostEqual(fwd[8].sync_cycles, (1 + 2 * 8) * T16.sync_cycles_host)


  def test_rts_on_activations_over_the_tp_group(self):
    # GPT-J's README, "RTS on activations": over a TP group of 2 each IPU stores and
    # loads half of every micro-batch's activation (2*128*4 / 2 = 512 B, G = 2) and the
    # group all-gathers it after each load over the IPU-Links.
    shard = {"w": jax.ShapeDtypeStruct((2, 128, 128), jnp.float32)}  # [tp, ...] shards
    model = phased.PhasedModel([phased.Phase("layer0", _dense, shard),
                                phased.Phase("layer1", _dense_loss, shard)])
    batch = jax.ShapeDtypeStruct((4, 128), jnp.float32)
    rows = {}
    for sharded in (False, True):
      layout = phased.PhasedLayout(batch_serialisation=2, mesh=Mesh(dp=1, tp=2),
                                   rts_activations=sharded)
      est = phased.PhasedTrainer(model, optax.sgd(0.1), layout, T16).estimate((batch, batch))
      rows[sharded] = {(p.name, p.direction): p for p in est.phases}
    plain, split = rows[False]["layer1", "backward"], rows[True]["layer1", "backward"]
    self.assertEqual((plain.traffic.activations_load, split.traffic.activations_load),
                     (2 * 1_024, 2 * 512))
    gather = 512 * 2 / T16.ipu_link_bytes_per_cycle + 2 * T16.ipu_sync_cycles(2)
    self.assertAlmostEqual(split.collective_cycles - plain.collective_cycles, gather, places=3)
    with self.assertRaisesRegex(ValueError, "rts_activations=True .* remote_activations=True"):
      phased.PhasedLayout(rts_activations=True, remote_activations=False)


class BadInputTest(parameterized.TestCase):

  def test_layout_fields(self):
    with self.assertRaisesRegex(ValueError, r"PhasedLayout.mode must be one of \['serial', "
                                r"'ping_pong'\], got 'parallel'"):
      phased.PhasedLayout(mode="parallel")
    with self.assertRaisesRegex(ValueError, "PhasedLayout.batch_serialisation must be a "
                                "positive integer, got 0"):
      phased.PhasedLayout(batch_serialisation=0)
    with self.assertRaisesRegex(ValueError, "rts=True .* mesh.dp=1"):
      phased.PhasedLayout(rts=True)

  def test_phase_assignment(self):
    layers = {n: phased.Phase(n, _dense, {"w": jnp.ones((4, 4))}) for n in ("a", "b", "c")}
    with self.assertRaisesRegex(ValueError, r"leaves layer\(s\) \['c'\] out"):
      phased.PhasedModel.from_layers(layers, [["a"], ["b"]])
    with self.assertRaisesRegex(ValueError, r"unknown layer\(s\) \['d'\]"):
      phased.PhasedModel.from_layers(layers, [["a"], ["b", "c", "d"]])
    model = phased.PhasedModel.from_layers(layers, [["a", "b"], ["c"]], names=["ab", "c"])
    self.assertEqual([p.name for p in model.phases], ["ab", "c"])

  def test_batch_not_divisible_by_g(self):
    layout = phased.PhasedLayout(batch_serialisation=4, mesh=Mesh(dp=2))
    trainer = phased.PhasedTrainer(_two_dense(8, concrete=True), optax.sgd(0.1), layout, T16)
    x = np.ones((12, 8), np.float32)
    with self.assertRaisesRegex(ValueError, r"batch size 12 is not divisible by mesh.dp x "
                                r"PhasedLayout.batch_serialisation = 2 x 4 = 8"):
      trainer.step((x, x))

  def test_batch_loss_and_arguments_are_checked_before_a_step(self):
    trainer = phased.PhasedTrainer(_two_dense(8, concrete=True), optax.sgd(0.1),
                                   phased.PhasedLayout(), "ipu2")  # a preset name, as jit
    x = np.ones((4, 8), np.float32)
    # No samples: the step used to return NaN and count itself.
    with self.assertRaisesRegex(ValueError, "batch size 0: the batch has no samples"):
      trainer.step((x[:0], x[:0]))
    with self.assertRaisesRegex(TypeError, r"takes batch = \(inputs, \*extras\)"):
      trainer.step(x)
    self.assertEqual(trainer.steps, 0)
    # A loss that is not a floating-point scalar used to train silently.
    for loss, got in ((lambda p, x, y: (x @ p["w"] - y) ** 2, r"float32\[4, 8\]"),
                      (lambda p, x, y: jnp.sum(x @ p["w"] > y), r"int32\[\]")):
      model = phased.PhasedModel([phased.Phase("a", _dense, {"w": jnp.ones((8, 8))}),
                                  phased.Phase("b", loss, {"w": jnp.ones((8, 8))})])
      bad = phased.PhasedTrainer(model, optax.sgd(0.1), phased.PhasedLayout(), T16)
      with self.assertRaisesRegex(ValueError, rf"last phase \('b'\) must return .* "
                                              rf"floating-point scalar; it returned {got}"):
        bad.step((x, x))
    with self.assertRaisesRegex(TypeError, r"mesh must be ipu_jax.parallel.Mesh.*got \(2, 1\)"):
      phased.PhasedLayout(mesh=(2, 1))
    with self.assertRaisesRegex(TypeError, "optimizer must be an optax GradientTransformation"):
      phased.PhasedTrainer(_two_dense(8), "sgd", phased.PhasedLayout(), T16)
    with self.assertRaisesRegex(TypeError, "model must be a PhasedModel"):
      phased.PhasedTrainer(list(_two_dense(8).phases), optax.sgd(0.1), phased.PhasedLayout(),
                           T16)

  def test_streaming_memory_overflow(self):
    small = T16.replace(streaming_memory_bytes=100_000)
    with self.assertRaises(phased.PhaseOutOfMemoryError) as caught:
      phased.PhasedTrainer(_two_dense(), optax.adam(1e-3), phased.PhasedLayout(), small)
    message = str(caught.exception)
    # W + Adam's mu and nu, two layers: 2 x 3 x 65,536 B on IPU 0.
    self.assertIn("Streaming memory of IPU 0", message)
    self.assertIn("393,216 bytes", message)
    self.assertIn("100,000 per IPU", message)
    self.assertIn("replicated tensor sharding", message)
    self.assertEqual(caught.exception.ipu, 0)
    self.assertIsInstance(caught.exception, ipu_jax.OutOfMemoryError)


if __name__ == "__main__":
  absltest.main()
