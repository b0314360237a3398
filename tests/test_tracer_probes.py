"""``ipu_jax.cheap_tracer_probes``: NNX's attribute probes of tracers walk nothing.

Flax NNX probes ``value.sharding`` on every ``Variable`` assignment; in the
pinned JAX each probe of a tracer walked every equation traced so far to
build an error message nobody reads (ipu_jax/tracer_probes.py). The block
must answer every probe as JAX does, trace the same programs, and walk
nothing; ``ipu_jax.jit`` and ``Pipeline`` trace inside it.
"""

import contextlib
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
import ipu_jax.pipelining.split
import ipu_jax.stages
from ipu_jax.lowering.jax_compat import core, partial_eval

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)


class _Net(nnx.Module):
  """Layers whose initialisation steps an Rngs count per parameter, and dropout."""

  def __init__(self, width: int, layers: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = jax.nn.relu(layer(x))
    return self.dropout(self.norm(x))


class _Walks:
  """Counts the walks JAX's origin messages take over the traced equations."""

  def __init__(self):
    self.count = 0
    self._walk = partial_eval.JaxprStackFrame.find_progenitors

  def __enter__(self):
    def counted(frame, tracer):
      self.count += 1
      return self._walk(frame, tracer)
    self._patch = mock.patch.object(partial_eval.JaxprStackFrame, "find_progenitors", counted)
    self._patch.start()
    return self

  def __exit__(self, *exc):
    self._patch.stop()


def _functional(model):
  """``(params, merged)``: ``merged(params, key)`` is ``model`` with those weights
  and its random streams keyed by ``key``. Called under a trace, the model's
  dropout steps its Rngs count: a Variable assignment, which NNX follows with
  a probe of the new value's sharding."""
  graphdef, params, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)

  def merged(params, key):
    keys = jax.tree.map(
        lambda v: key if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v, rng_state)
    return nnx.merge(graphdef, params, keys, rest)

  return params, merged


def _probe_answers(x):
  """What each probe of a traced value gives: hasattr, getattr's default, the error."""
  y = x * 2
  answers = []
  for name in ("sharding", "device"):
    answers.append((name, hasattr(y, name), getattr(y, name, "absent")))
    try:
      getattr(y, name)
    except AttributeError as e:
      answers.append((name, type(e).__name__, str(e)))
  return y, answers


class CheapTracerProbesTest(chex.TestCase, parameterized.TestCase):

  def test_probes_answer_as_jax_does(self):
    seen = {}

    def f(x, where):
      y, seen[where] = _probe_answers(x)
      return y

    jax.make_jaxpr(lambda x: f(x, "outside"))(1.0)
    with ipu_jax.cheap_tracer_probes():
      jax.make_jaxpr(lambda x: f(x, "inside"))(1.0)
    self.assertEqual(seen["inside"], seen["outside"])
    # A tracer has neither attribute; sharding's message points at jax.typeof.
    self.assertEqual(seen["outside"][0], ("sharding", False, "absent"))
    self.assertIn("jax.typeof", seen["outside"][1][2])

  @parameterized.named_parameters(("two_layers", 2), ("twelve_layers", 12))
  def test_an_abstract_model_walks_nothing_and_is_the_same(self, layers):
    make = lambda: _Net(24, layers, rngs=nnx.Rngs(0))  # noqa: E731
    plain = nnx.state(nnx.eval_shape(make))
    with _Walks() as walks, ipu_jax.cheap_tracer_probes():
      cheap = nnx.state(nnx.eval_shape(make))
    self.assertEqual(walks.count, 0)
    self.assertEqual(jax.tree.structure(cheap), jax.tree.structure(plain))
    for a, b in zip(jax.tree.leaves(cheap), jax.tree.leaves(plain)):
      self.assertEqual((a.shape, a.dtype), (b.shape, b.dtype))

  def test_nested_blocks_restore_jax_properties_even_after_an_error(self):
    before = {name: core.Tracer.__dict__.get(name) for name in ("sharding", "device")}
    with self.assertRaisesRegex(ValueError, "inner"):
      with ipu_jax.cheap_tracer_probes():
        with ipu_jax.cheap_tracer_probes():
          pass
        self.assertIsNot(core.Tracer.__dict__.get("sharding"), before["sharding"])
        raise ValueError("inner")
    self.assertEqual({name: core.Tracer.__dict__.get(name) for name in before}, before)

  def test_jit_traces_an_nnx_loss_without_walks_and_equals_jax_jit(self):
    params, merged = _functional(_Net(13, 3, rngs=nnx.Rngs(1)))

    def loss(params, key, x):
      return jnp.mean(merged(params, key)(x) ** 2)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 13), np.float32))
    key, grad = jax.random.key(7), jax.grad(loss)
    with _Walks() as walks:
      lowered = ipu_jax.jit(grad, target=_T16).lower(params, key, x)
    self.assertEqual(walks.count, 0)
    got = lowered.compile()(params, key, x)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got),
                                jax.tree.map(np.asarray, jax.jit(grad)(params, key, x)),
                                rtol=1e-5, atol=1e-6)
    # The same lowering without the block walks the trace (the pinned JAX).
    with _Walks() as walks, mock.patch.object(ipu_jax.stages, "cheap_tracer_probes",
                                              contextlib.nullcontext):
      ipu_jax.jit(grad, target=_T16).lower(params, key, x)
    self.assertGreater(walks.count, 0)

  def test_pipeline_traces_without_walks(self):
    params, merged = _functional(_Net(8, 2, rngs=nnx.Rngs(2)))

    def loss(params, batch):
      m = merged(params, jax.random.key(3))
      h = ipu_jax.ops.pipeline_stage(jax.nn.relu(m.layers[0](batch)), 1)
      return jnp.mean(m.dropout(m.norm(m.layers[1](h))) ** 2)

    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    cfg.auto_select_ipus = 2
    cfg.training.gradient_accumulation_steps = 4
    batches = jnp.asarray(np.random.default_rng(3).standard_normal((4, 4, 8), np.float32))

    def lower():
      pipe = ipu_jax.pipelining.Pipeline(loss, optax.sgd(0.1), config=cfg)
      pipe.lower(params, batches)
      return pipe

    with _Walks() as walks:
      pipe = lower()
    self.assertEqual(walks.count, 0)
    self.assertLen(pipe.stages, 2)
    with _Walks() as walks, mock.patch.object(ipu_jax.pipelining.split, "cheap_tracer_probes",
                                              contextlib.nullcontext):
      lower()
    self.assertGreater(walks.count, 0)


if __name__ == "__main__":
  absltest.main()
