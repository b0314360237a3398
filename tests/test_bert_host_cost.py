"""What BERT's pre-training heads give the lowering to plan (issue 27's host budget).

The MLM decoder is serialised over the vocabulary; its word-table gradient
must be one ``[H, B P] x [B P, V]`` product. A batched ``[B, H, P] x [B, P, V]``
one (the decoder applied to ``[B, P, H]``) held a ``[B, H, V]`` table gradient
per sample before summing: 750 M values for BERT-Base's phase-1 micro-batch,
18.5 GiB of host memory to plan.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from experiments import bert
from ipu_jax.ops.serialized_matmul import serialized_matmul_p
import testing_utils

_B, _P, _H, _V = 3, 5, 16, 96


def _model(serialization):
  """A one-layer BERT whose weights are drawn with NumPy.

  The checks read the program's structure and the head's own weights, not
  Flax's particular values: an abstract model filled by NumPy skips Flax's
  eager initialisers (a sampler compiled per weight shape, ~5 s of CPU).
  """
  cfg = bert.BertConfig(vocab_size=_V, hidden=_H, layers=1, heads=2, ffn=32,
                        max_positions=16, dropout=0.0, decoder_serialization=serialization)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: bert.Bert(cfg, rngs=nnx.Rngs(0))))
  return cfg, nnx.merge(graphdef, testing_utils.numpy_weights(state, seed=0))


def _equations(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.core.jaxprs_in_params(eqn.params):
      yield from _equations(sub)


class DecoderGradientTest(parameterized.TestCase):

  def test_table_gradient_is_one_product_over_all_masked_positions(self):
    cfg, model = _model(2)
    loss_fn, params = bert.make_loss(model)
    batch = jax.tree_util.tree_map(lambda b: b[0],
                                   bert.synthetic_batches(cfg, 1, _B, 12, _P, seed=0))
    closed = jax.make_jaxpr(jax.grad(loss_fn))(params, batch)
    sizes = [int(np.prod(v.aval.shape)) for e in _equations(closed.jaxpr)
             if e.primitive is serialized_matmul_p for v in e.outvars]
    self.assertLen(sizes, 3)  # the decoder, its two gradients
    # Logits [B P, V], the hidden gradient [B P, H], the table's [H, V]: none per sample.
    self.assertLessEqual(max(sizes), max(_B * _P * _V, _H * _V))
    self.assertNotIn(_B * _H * _V, sizes)

  @parameterized.parameters(1, 2)
  def test_logits_are_the_masked_positions_times_the_table(self, serialization):
    _, model = _model(serialization)
    head = model.mlm_head
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(_B, _P, _H)), jnp.float32)
    table = jnp.asarray(rng.normal(size=(_V, _H)), jnp.float32)
    got = np.asarray(head(h, table))
    transformed = head.norm(jax.nn.gelu(head.transform(h), approximate=True))
    want = np.asarray(jnp.einsum("bph,vh->bpv", transformed, table) + head.bias[...])
    self.assertEqual(got.shape, (_B, _P, _V))
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  absltest.main()
