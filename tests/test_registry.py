"""The rule registry: keyed by the Primitive object, strict, with a public face."""

import ast
import importlib
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
from jax import lax
from jax.extend import core as jcore
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import lowering
from ipu_jax.lowering import builders

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def primitive_lookups_by_name(sources: dict) -> list:
  """``path:line`` of every ``getattr(module, name)`` whose name is spelled like a
  primitive's (``f"{name}_p"`` or ``"exp_p"``): rule tables name the ``Primitive``
  objects themselves, so a table cannot drift from what it registers."""
  found = []
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text)):
      if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
          and len(node.args) >= 2):
        name = node.args[1]
        tail = name.values[-1] if isinstance(name, ast.JoinedStr) and name.values else name
        if isinstance(tail, ast.Constant) and str(tail.value).endswith("_p"):
          found.append(f"{path}:{node.lineno}")
  return found


def _primitive(name, impl):
  prim = jcore.Primitive(name)
  prim.def_impl(impl)
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  return prim


class RegistryTest(chex.TestCase, parameterized.TestCase):

  def test_user_primitive_named_like_a_builtin_gets_its_own_rule(self):
    # A user's "add" that means x + 10: lax.add_p's rule must be untouched.
    my_add = _primitive("add", lambda x: x + 10)

    @lowering.register_lowering(my_add)
    def _rule(ctx, x):
      return builders.elementwise(ctx, lambda v: v + 10, [x])

    self.assertIs(lowering.get_lowering(my_add), _rule)
    self.assertIsNot(lowering.get_lowering(lax.add_p), _rule)
    f = ipu_jax.jit(lambda x, y: my_add.bind(x + y), target=_T16)
    x, y = jnp.arange(7.0), jnp.ones(7)
    np.testing.assert_array_equal(f(x, y), np.arange(7.0) + 1 + 10)

  def test_registering_twice_is_an_error_unless_override(self):
    prim = _primitive("twice", lambda x: x * 2)
    first = lambda ctx, x: builders.elementwise(ctx, lambda v: v * 2, [x])
    second = lambda ctx, x: builders.elementwise(ctx, lambda v: v + v, [x])
    lowering.register_lowering(prim, first)
    with self.assertRaisesRegex(ValueError, "'twice' already has a tile lowering.*override=True"):
      lowering.register_lowering(prim, second)
    self.assertIs(lowering.get_lowering(prim), first)
    lowering.register_lowering(prim, second, override=True)
    self.assertIs(lowering.get_lowering(prim), second)

  def test_builtin_rule_cannot_be_replaced_by_accident(self):
    with self.assertRaisesRegex(ValueError, "'add' already has a tile lowering"):
      lowering.register_lowering(lax.add_p, lambda ctx, x, y: [x])

  def test_a_name_is_not_a_primitive(self):
    with self.assertRaisesRegex(TypeError, "takes a jax.extend.core.Primitive"):
      lowering.register_lowering("add", lambda ctx, x, y: [x])

  def test_rule_tables_name_primitives_not_strings(self):
    sources = {str(p.relative_to(_ROOT)): p.read_text()
               for p in sorted((_ROOT / "lowering").rglob("*.py"))}
    self.assertEqual(primitive_lookups_by_name(sources), [])
    fake = 'for _name in ("cumsum",):\n  _prim = getattr(loops, f"{_name}_p")\n'
    self.assertEqual(primitive_lookups_by_name({"fake.py": fake}), ["fake.py:2"])

  def test_builtin_rules_are_registered_on_import(self):
    names = {p.name for p in lowering.registered_primitives()}
    for name in ("add", "dot_general", "conv_general_dilated", "scan", "while", "cond",
                 "reduce_sum", "gather", "scatter-add", "threefry2x32", "jit"):
      self.assertIn(name, names)
    self.assertIsNotNone(lowering.get_lowering(lax.add_p))

  @parameterized.parameters(
      ("ipu_jax", "register_lowering"),
      ("ipu_jax.lowering", "register_lowering"),
      ("ipu_jax.lowering", "get_lowering"),
      ("ipu_jax.lowering", "registered_primitives"),
      ("ipu_jax.lowering", "LoweringContext"),
      ("ipu_jax.lowering", "Tensor"),
      ("ipu_jax.lowering", "Superstep"),
      ("ipu_jax.lowering", "TileMapping"),
      ("ipu_jax.lowering.registry", "register_lowering"),
      ("ipu_jax.lowering.context", "LoweringContext"),
      ("ipu_jax.lowering.program", "Superstep"),
      ("ipu_jax.lowering.builders", "elementwise"),
  )
  def test_documented_import_paths(self, module, name):
    self.assertTrue(hasattr(importlib.import_module(module), name), f"{module}.{name}")

  def test_public_register_lowering_is_the_registry_one(self):
    self.assertIs(ipu_jax.register_lowering, lowering.register_lowering)


if __name__ == "__main__":
  absltest.main()
