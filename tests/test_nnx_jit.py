"""ipu_jax.nnx_jit: a Flax NNX script ports by swapping the decorator, and trains.

The script below follows the Flax NNX MNIST tutorial (a CNN, nnx.Optimizer,
nnx.MultiMetric, train_step/eval_step under ``@nnx.jit``), shrunk to 10x10
images so it runs on a 16-tile IPU in seconds.
"""

import difflib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

import ipu_jax
import sys

nnx_jit_lib = sys.modules["ipu_jax.nnx_jit"]

TUTORIAL = '''
from functools import partial
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


class CNN(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.conv2 = nnx.Conv(4, 8, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(200, 32, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.linear1(x))
    return self.linear2(x)


model = CNN(rngs=nnx.Rngs(0))
optimizer = nnx.Optimizer(model, optax.adamw(0.02, 0.9), wrt=nnx.Param)
metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def loss_fn(model, batch):
  logits = model(batch["image"])
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"]).mean()
  return loss, logits


@nnx.jit
def train_step(model, optimizer, metrics, batch):
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


rng = np.random.default_rng(0)
templates = rng.normal(size=(10, 10, 10, 1)).astype(np.float32)
labels = rng.integers(0, 10, 32 * 4).astype(np.int32)
images = templates[labels] + 0.3 * rng.normal(size=(labels.size, 10, 10, 1)).astype(np.float32)
batches = [{"image": images[i:i + 32], "label": labels[i:i + 32]}
           for i in range(0, labels.size, 32)]

history = []
for epoch in range(2):
  for batch in batches:
    train_step(model, optimizer, metrics, batch)
  for metric, value in metrics.compute().items():
    history.append((metric, float(value)))
  metrics.reset()
losses = [v for k, v in history if k == "loss"]
'''

PORT = (TUTORIAL.replace("from flax import nnx\n", "from flax import nnx\nimport ipu_jax\n")
        .replace("@nnx.jit\n", "@ipu_jax.nnx_jit\n"))


def small_config():
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  return cfg


def changed_lines(a: str, b: str) -> int:
  diff = difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)
  return sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))


class Counter(nnx.Module):

  def __init__(self):
    self.count = nnx.Variable(jnp.zeros((), jnp.int32))
    self.total = nnx.Variable(jnp.zeros((3,), jnp.float32))


class NNXJitTest(chex.TestCase, parameterized.TestCase):

  def test_tutorial_port_is_a_three_line_diff_and_trains(self):
    self.assertLessEqual(changed_lines(TUTORIAL, PORT), 3)
    reference, ported = {}, {}
    exec(compile(TUTORIAL, "tutorial.py", "exec"), reference)  # noqa: S102
    with ipu_jax.default_config(small_config()):
      exec(compile(PORT, "port.py", "exec"), ported)  # noqa: S102
    losses = ported["losses"]
    self.assertLess(losses[-1], 0.7 * losses[0])
    # The port trains exactly as nnx.jit does (matmuls and convolutions to rounding).
    np.testing.assert_allclose(losses, reference["losses"], rtol=2e-4)
    chex.assert_trees_all_close(nnx.state(ported["model"], nnx.Param),
                                nnx.state(reference["model"], nnx.Param),
                                rtol=2e-3, atol=2e-5)

  def test_updates_in_place_and_returns_outputs(self):
    counter = Counter()

    @ipu_jax.nnx_jit(config=small_config())
    def bump(c, x, scale=1.0):
      c.count[...] += 1
      c.total[...] = c.total[...] + x * scale
      return {"mean": jnp.mean(c.total[...])}

    x = jnp.asarray([1.0, 2.0, 4.5])
    out = bump(counter, x)
    out = bump(counter, x, scale=2.0)
    self.assertEqual(int(counter.count[...]), 2)
    chex.assert_trees_all_close(counter.total[...], 3 * x)
    chex.assert_trees_all_close(out["mean"], jnp.mean(3 * x))

  def test_nodes_nested_in_pytrees_and_shared(self):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    before = np.asarray(model.kernel[...])

    @ipu_jax.nnx_jit(config=small_config())
    def scale_both(pair):
      pair["a"].kernel[...] = pair["a"].kernel[...] * 2.0
      return pair["b"].kernel[...]  # the same module: sees the update

    seen = scale_both({"a": model, "b": model})
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), 2.0 * before)
    np.testing.assert_array_equal(np.asarray(seen), 2.0 * before)

  def test_structure_change_raises(self):
    counter = Counter()

    @ipu_jax.nnx_jit(config=small_config())
    def grow(c):
      c.extra = nnx.Variable(jnp.ones(()))

    with self.assertRaisesRegex(TypeError, "changed the structure"):
      grow(counter)

  def test_returning_a_module_raises(self):
    @ipu_jax.nnx_jit(config=small_config())
    def identity(c):
      return c

    with self.assertRaisesRegex(TypeError, "returned Flax NNX objects"):
      identity(Counter())

  def test_plain_jit_check_names_the_argument(self):
    with self.assertRaisesRegex(TypeError, r"args\[1\].*ipu_jax.nnx_jit"):
      nnx_jit_lib.reject_graph_nodes((jnp.ones(2), Counter()), "step")
    self.assertFalse(nnx_jit_lib.has_graph_nodes((jnp.ones(2), {"a": 1.0})))

  def test_dropout_streams_and_shared_variables_carry_over_as_in_nnx_jit(self):
    # Each call draws new masks from the module's Rngs (its counter is written
    # back), and a Variable shared by two modules is one Variable after the call.

    class Tied(nnx.Module):

      def __init__(self, rngs):
        self.a = nnx.Linear(6, 6, rngs=rngs)
        self.b = nnx.Linear(6, 6, rngs=rngs)
        self.b.kernel = self.a.kernel
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def step(model, x):
      model.a.kernel[...] = model.a.kernel[...] * 0.5 + 0.25
      return model.drop(model.b(model.a(x)))

    x = np.random.default_rng(0).normal(size=(5, 6)).astype(np.float32)
    emulated, reference = Tied(nnx.Rngs(3)), Tied(nnx.Rngs(3))
    ipu_step, jax_step = ipu_jax.nnx_jit(step, config=small_config()), nnx.jit(step)
    for _ in range(3):
      got, want = ipu_step(emulated, x), jax_step(reference, x)
      chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(np.asarray(emulated.a.kernel[...]),
                                np.asarray(reference.a.kernel[...]))
    self.assertIs(emulated.b.kernel, emulated.a.kernel)
    self.assertEqual(int(emulated.drop.rngs.count[...]),
                     int(reference.drop.rngs.count[...]))
    self.assertEqual(int(emulated.drop.rngs.count[...]), 3)

  def test_a_variable_argument_is_updated(self):
    total = nnx.Variable(jnp.zeros((4,), jnp.float32))

    @ipu_jax.nnx_jit(config=small_config())
    def add(v, x):
      v[...] = v[...] + x

    add(total, jnp.arange(4.0))
    add(total, jnp.ones(4))
    np.testing.assert_array_equal(np.asarray(total[...]), np.arange(4.0) + 1.0)

  def test_metadata_change_raises(self):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    @ipu_jax.nnx_jit(config=small_config())
    def tag(m):
      m.kernel.set_metadata("frozen", True)

    with self.assertRaisesRegex(TypeError, "changed their metadata"):
      tag(model)

  def test_lower_gives_the_report(self):
    model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
    step = ipu_jax.nnx_jit(lambda m, x: m(x), config=small_config())
    lowered = step.lower(model, jnp.ones((7, 5)))
    self.assertGreater(lowered.report.total_cycles, 0)
    chex.assert_trees_all_close(step(model, jnp.ones((7, 5))), model(jnp.ones((7, 5))),
                                rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
