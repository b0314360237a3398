"""Typed PRNG keys (the extended dtype ``key<impl>``) through every pass.

A key array is held as its ``uint32`` key data (``key<fry>[n]`` as
``uint32[n, 2]``), so every pass that reads an aval's bytes or dtype (the
host-loop finder, the memory analysis, remote buffers, the executor) must
see the physical form. Each case carries keys through a control construct
(scan, while, cond, a named replica axis, a pipeline) and compares the result
with ``jax.jit``; the last runs Flax's ``nnx.scan`` MLP example (a scanned
stack of layers with ``nnx.Rngs`` and dropout) under ``ipu_jax.nnx_jit``.
"""

import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import ipu_jax
from ipu_jax import executable_cache
from ipu_jax.pipelining import Pipeline
from ipu_jax.ops import pipeline_stage
import testing_utils

T16 = testing_utils.T16


def _keys(count=4, seed=0):
  return jax.random.split(jax.random.key(seed), count)


def _scan_draws(keys):
  """Sums one normal draw per key, the keys being the scanned values."""
  return lax.scan(lambda c, k: (c + jax.random.normal(k), None), 0., keys)[0]


def _scan_carrying_key(key):
  """Splits the carried key every step and returns the draws and the last key."""
  def body(k, _):
    k, sub = jax.random.split(k)
    return k, jax.random.uniform(sub, (3,))
  last, draws = lax.scan(body, key, None, length=5)
  return draws, jax.random.key_data(last)


def _while_carrying_key(key):
  """A while loop whose carry holds a key, split each trip."""
  def body(state):
    i, k, total = state
    k, sub = jax.random.split(k)
    return i + 1, k, total + jax.random.normal(sub, (2,))
  _, k, total = lax.while_loop(lambda s: s[0] < 3, body, (0, key, jnp.zeros(2)))
  return total, jax.random.key_data(k)


def _cond_on_key(key, flag):
  """Branches that take a key operand and return a key."""
  k = lax.cond(flag > 0, lambda k: jax.random.fold_in(k, 1), lambda k: jax.random.split(k)[0],
               key)
  return jax.random.normal(k, (3,)), jax.random.key_data(k)


class KeysThroughControlTest(parameterized.TestCase):
  """Keys as scanned values, carries and branch operands, read back."""

  @parameterized.parameters(*testing_utils.MODES)
  def test_scan_over_keys(self, mode):
    testing_utils.assert_matches_jit(_scan_draws, _keys(), modes=(mode,))

  def test_scan_over_keys_has_a_host_loop_of_key_bytes(self):
    # The scan over the argument is the program's on-device loop; its input
    # per iteration is one key's data: two uint32 words.
    lowered = ipu_jax.jit(_scan_draws, target=T16).lower(_keys())
    self.assertIsNotNone(lowered.host_loop)
    self.assertEqual(lowered.host_loop.input_bytes, 2 * 4)
    np.testing.assert_allclose(np.asarray(lowered(_keys())), jax.jit(_scan_draws)(_keys()),
                               rtol=1e-5)

  def test_scan_carrying_a_key(self):
    testing_utils.assert_matches_jit(_scan_carrying_key, jax.random.key(1))

  def test_while_loop_carrying_a_key(self):
    testing_utils.assert_matches_jit(_while_carrying_key, jax.random.key(2))

  @parameterized.parameters(1, -1)
  def test_cond_on_a_key(self, flag):
    testing_utils.assert_matches_jit(_cond_on_key, jax.random.key(3), jnp.int32(flag))

  def test_keys_returned_from_a_scan(self):
    def f(key):
      return lax.scan(lambda k, _: (jax.random.fold_in(k, 7), k), key, None, length=3)[1]
    want = jax.jit(f)(jax.random.key(4))
    got = ipu_jax.jit(f, target=T16)(jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)),
                                  np.asarray(jax.random.key_data(want)))

  def test_memory_counts_key_data(self):
    # Four keys are 32 bytes of variables (uint32[4, 2]) on the tiles.
    lowered = ipu_jax.jit(_scan_draws, target=T16).lower(_keys())
    self.assertGreaterEqual(int(lowered.profile.memory.by_category["variables"].sum()), 32)


_CLOSED_OVER = jax.random.split(jax.random.key(8), 3)


def _stacked_keys(keys):
  """A scan over the argument keys stacking a key per step (the host loop's output)."""
  return lax.scan(lambda c, k: (c + jax.random.normal(k), jax.random.fold_in(k, 1)), 0., keys)


def _key_data_of(tree):
  return jax.tree.map(lambda x: np.asarray(jax.random.key_data(x)
                                           if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
                                           else x), tree)


def _config(**sections):
  cfg = testing_utils.executor_config(**sections)
  cfg.device.tiles_per_ipu = 32
  return cfg


class KeysThroughHostSideTest(parameterized.TestCase):
  """Keys as constants, through I/O tiles, output modes and the executable cache."""

  def test_closed_over_keys(self):
    # The keys become constants of the program (held as key data).
    testing_utils.assert_matches_jit(lambda x: x + _scan_draws(_CLOSED_OVER), jnp.float32(1))

  def test_io_tiles(self):
    got = ipu_jax.jit(_stacked_keys, config=_config(io_tiles={"num_io_tiles": 2}))(_keys())
    chex.assert_trees_all_close(_key_data_of(got), _key_data_of(jax.jit(_stacked_keys)(_keys())),
                                rtol=1e-5)

  @parameterized.parameters(("final", 1), ("every_n", 2))
  def test_output_modes_select_keys(self, mode, period):
    cfg = _config(outputs={"mode": mode, "return_period": period})
    got = ipu_jax.jit(_stacked_keys, config=cfg)(_keys())
    total, keys = jax.jit(_stacked_keys)(_keys())
    want = (total, keys[-1] if mode == "final" else keys[period - 1::period])
    chex.assert_trees_all_close(_key_data_of(got), _key_data_of(want), rtol=1e-5)

  def test_output_mode_sum_refuses_keys(self):
    f = ipu_jax.jit(_stacked_keys, config=_config(outputs={"mode": "sum"}))
    with self.assertRaisesRegex(ValueError, r"outputs.mode='sum'.*\[1\].*key<fry>.*key_data"):
      f.lower(_keys())

  def test_executable_cache_with_keys(self):
    def fn(keys):
      return _scan_draws(keys) + _scan_draws(_CLOSED_OVER)
    want = np.asarray(jax.jit(fn)(_keys()))
    with tempfile.TemporaryDirectory() as cache_dir:
      runs = []
      cfg = _config()
      cfg.executable_cache_dir = cache_dir
      for _ in range(2):  # a new jit each time: the second loads the stored entry
        f = ipu_jax.jit(fn, config=cfg)
        runs.append((np.asarray(f(_keys())), f.lower(_keys()).host.cache))
      # The directory goes: JAX's compilation cache must not stay pointed at it.
      executable_cache.disable_compilation_cache()
    self.assertEqual([cache for _, cache in runs], ["stored", "hit"])
    for got, _ in runs:
      np.testing.assert_allclose(got, want, rtol=1e-5)

  def test_suggest_num_io_tiles_counts_key_data(self):
    cfg = _config()
    self.assertEqual(ipu_jax.io_tiles.suggest_num_io_tiles(_keys(), cfg),
                     ipu_jax.io_tiles.suggest_num_io_tiles(jax.random.key_data(_keys()), cfg))


class KeysOverReplicasTest(parameterized.TestCase):
  """Keys under a named axis: pmap on this process's one device, and vmap."""

  def test_pmap_over_keys(self):
    f = jax.pmap(lambda k: _scan_draws(jax.random.split(k, 3)), axis_name="i")
    keys = _keys(1, seed=5)
    chex.assert_trees_all_close(ipu_jax.jit(f, target=T16)(keys), f(keys), rtol=1e-5)

  def test_vmap_with_axis_name_over_keys(self):
    def f(keys):
      return jax.vmap(lambda k: lax.psum(_scan_draws(jax.random.split(k, 3)), "i"),
                      axis_name="i")(keys)
    testing_utils.assert_matches_jit(f, _keys(2, seed=6))


def _loss_with_scanned_dropout(params, batch, rng):
  """Two stages; each draws its dropout masks in a scan over split keys."""
  h = batch["x"]
  for k, w in enumerate(params):
    if k:
      h = pipeline_stage(h, k)
    keys = jax.random.split(jax.random.fold_in(rng, k), 2)
    h = lax.scan(lambda x, key: (jnp.where(jax.random.bernoulli(key, 0.5, x.shape),
                                           2.0 * jnp.tanh(x @ w), 0.0), None), h, keys)[0]
  return jnp.mean((h - batch["y"]) ** 2)


class KeysThroughPipelineTest(chex.TestCase):

  def test_pipeline_with_keys_in_a_scan(self):
    params, batches = testing_utils.chain_data(2, 4, width=8, rows=4)
    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.auto_select_ipus = 2
    cfg.training.gradient_accumulation_steps = 4
    key = jax.random.key(7)
    pipe = Pipeline(_loss_with_scanned_dropout, optax.sgd(0.1), config=cfg, rng=True)
    grads, loss = pipe.gradients(params, batches, rng=key)
    acc, losses = testing_utils.accumulated_gradients(_loss_with_scanned_dropout, params,
                                                      batches, 4, key=key)
    chex.assert_trees_all_close(grads, acc, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), np.mean(losses), rtol=1e-5)


class Block(nnx.Module):
  """One layer of Flax's ``nnx.scan`` example: linear, dropout, relu."""

  def __init__(self, features: int, rngs: nnx.Rngs):
    self.linear = nnx.Linear(features, features, rngs=rngs)
    self.dropout = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.dropout(self.linear(x)))


class ScannedMLP(nnx.Module):
  """Flax's example: layers made with ``nnx.vmap`` and applied with ``nnx.scan``."""

  def __init__(self, features: int, num_layers: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create_block(rngs: nnx.Rngs):
      return Block(features, rngs=rngs)

    self.blocks = create_block(rngs)
    self.num_layers = num_layers

  def __call__(self, x):
    # Each block holds its own dropout key (split when it was made): the scan
    # runs over the stacked keys with the weights.
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block: Block):
      return block(x)

    return forward(x, self.blocks)


class NNXScanTest(chex.TestCase):

  def test_scanned_mlp_with_rngs_equals_nnx_jit(self):
    x = testing_utils.random_array((3, 8), seed=1)
    ipu_model = ScannedMLP(8, 3, rngs=nnx.Rngs(0))
    ref_model = ScannedMLP(8, 3, rngs=nnx.Rngs(0))
    ipu_step = ipu_jax.nnx_jit(lambda m, x: m(x), target=T16)
    ref_step = nnx.jit(lambda m, x: m(x))
    for _ in range(2):  # the second call draws from the advanced Rngs counts
      got, want = ipu_step(ipu_model, x), ref_step(ref_model, x)
      chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # The Rngs' counts were carried back as nnx.jit carries them.
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(ipu_model, nnx.RngCount)),
                                jax.tree.map(np.asarray, nnx.state(ref_model, nnx.RngCount)))


if __name__ == "__main__":
  absltest.main()
