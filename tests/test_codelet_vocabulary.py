"""The codelet vocabulary: one name per vertex type, code memory once per type."""

import ast
import pathlib

from absl.testing import absltest, parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import library
from ipu_jax.kernels import vocabulary as vocab

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config():
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  return cfg


class VocabularyTest(parameterized.TestCase):

  def test_names_are_distinct_and_namespaced(self):
    names = [getattr(vocab, n) for n in vocab.__all__ if n.isupper()]
    self.assertLen(set(names), len(names))
    for name in names:
      self.assertRegex(name, r"^(popops|poplin|poprand|ipu_jax)::[A-Z][A-Za-z]*$")

  @parameterized.parameters(
      ((vocab.FILL,), "popops::Fill"),
      ((vocab.FILL, "int"), "popops::Fill<int>"),
      ((vocab.MATMUL_BLOCK, np.dtype(np.float16), np.dtype(np.float32)),
       "poplin::MatMulBlock<float16,float32>"),
  )
  def test_vertex_instances(self, args, expected):
    self.assertEqual(vocab.vertex(*args), expected)

  def test_identity_of_library_codelet_is_its_vocabulary_name(self):
    self.assertEqual(vocab.identity(library.fill), vocab.FILL)
    self.assertEqual(vocab.identity(library.copy), vocab.COPY)
    self.assertEqual(vocab.identity(library.binary("add")),
                     vocab.vertex(vocab.ELEMENTWISE, "add"))

  def test_identity_refuses_other_objects(self):
    with self.assertRaisesRegex(TypeError, "vertex type names"):
      vocab.identity(3)

  def test_lowering_names_codelets_only_through_the_vocabulary(self):
    # Any string literal given as a codelet name in the lowering is a second
    # spelling waiting to happen: they must come from kernels/vocabulary.py.
    # Template arguments of vocabulary.vertex(NAME, "int") are not names.
    offenders = []
    for path in sorted((_ROOT / "lowering").rglob("*.py")):
      tree = ast.parse(path.read_text())
      for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg in ("codelet", "codelets"):
          allowed = {id(arg) for call in ast.walk(node.value)
                     if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                     and call.func.attr == "vertex" for arg in call.args[1:]}
          for sub in ast.walk(node.value):
            literal = isinstance(sub, ast.JoinedStr) or (
                isinstance(sub, ast.Constant) and isinstance(sub.value, str))
            if literal and id(sub) not in allowed:
              offenders.append(f"{path.relative_to(_ROOT)}:{node.value.lineno}")
    self.assertEqual(offenders, [])


class CodeMemoryTest(chex.TestCase):

  def test_a_codelet_reached_by_several_paths_is_charged_once(self):
    # Three rules fill a result: jnp.dot and ipu_jax.ops.matmul of an empty
    # contraction, and a sum over an empty axis. They run one vertex type.
    def fills(a, b, x):
      return jnp.dot(a, b), ipu_jax.ops.matmul(a, b), jnp.sum(x, axis=2)

    # Results big enough that every tile holds part of each.
    a = np.zeros((48, 0), np.float32)
    b = np.zeros((0, 40), np.float32)
    x = np.zeros((48, 40, 0), np.float32)
    profile = ipu_jax.jit(fills, config=_config()).lower(a, b, x).profile
    steps = [s for s in profile.steps if s.vertices is not None]
    self.assertLen(steps, 3)
    fill_steps_per_tile = sum((np.asarray(s.vertices) > 0).astype(int) for s in steps)
    self.assertGreater(fill_steps_per_tile.max(), 1)  # some tile is reached twice
    per_codelet = profile.target.code_bytes_per_codelet
    chex.assert_trees_all_equal(profile.memory.by_category["code"],
                                per_codelet * (fill_steps_per_tile > 0))


if __name__ == "__main__":
  absltest.main()
