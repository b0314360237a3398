"""The typed lowering contexts: a declared module context, a slotted rule context.

A rule gets a :class:`RuleContext` describing its equation (primitive, avals,
source line, name stack) and the :class:`LoweringContext` it lowers into;
neither grows attributes from outside.
"""

import os
import re

from absl.testing import absltest
import chex
import jax
from jax.extend import core as jcore
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import lowering
from ipu_jax.lowering import builders

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _primitive(name):
  prim = jcore.Primitive(name)
  prim.def_impl(lambda x: x * 3)
  prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
  return prim


class RuleContextTest(chex.TestCase):

  def test_a_rule_sees_its_equation(self):
    prim = _primitive("triple")
    seen = []

    @lowering.register_lowering(prim)
    def _rule(ctx, x):
      seen.append(ctx)
      return builders.elementwise(ctx, lambda v: v * 3, [x])

    def fn(x):
      with jax.named_scope("block"):
        return prim.bind(x + 1.0)

    x = jnp.arange(5.0)
    config = ipu_jax.IPUConfig()
    config.replication_factor = 2
    f = ipu_jax.jit(fn, target=_T16, config=config)
    np.testing.assert_array_equal(f(x), (np.arange(5.0) + 1) * 3)
    ctx, = seen
    self.assertIsInstance(ctx, lowering.RuleContext)
    self.assertIsInstance(ctx.module, lowering.LoweringContext)
    self.assertIs(ctx.primitive, prim)
    self.assertEqual([a.shape for a in ctx.in_avals], [(5,)])
    self.assertEqual([a.dtype for a in ctx.out_avals], [jnp.float32])
    self.assertRegex(ctx.source, r"test_rule_context\.py:\d+$")
    self.assertIn("block", str(ctx.name_stack))
    self.assertEqual(ctx.replication_factor, 2)
    self.assertIs(ctx.target, _T16)

  def test_contexts_take_no_attributes_from_outside(self):
    module = lowering.LoweringContext(_T16, replication_factor=3)
    self.assertEqual(module.replication_factor, 3)
    with self.assertRaises(AttributeError):
      module.replication_factor = 4
    with self.assertRaises(AttributeError):
      module.out_avals = []  # not a field of the module context
    ctx = lowering.RuleContext(module, _primitive("p"), [], [])
    with self.assertRaisesRegex(AttributeError, "immutable"):
      ctx.out_avals = []
    other = ctx.replace(out_avals=[jax.core.ShapedArray((2,), jnp.float32)])
    self.assertEqual(other.out_avals[0].shape, (2,))
    self.assertEqual(ctx.out_avals, ())
    with self.assertRaisesRegex(TypeError, "no field"):
      ctx.replace(outavals=[])
    with self.assertRaisesRegex(ValueError, "replication_factor"):
      lowering.LoweringContext(_T16, replication_factor=0)

  def test_nested_jaxprs_lower_into_the_module(self):
    with self.assertRaisesRegex(TypeError, "ctx.module"):
      module = lowering.LoweringContext(_T16)
      ctx = lowering.RuleContext(module, _primitive("q"), [], [])
      closed = jax.make_jaxpr(lambda v: v + 1)(1.0)
      lowering.lower_closed_jaxpr(ctx, closed, [module.new_tensor((), np.float32)])

  def test_rules_read_no_undeclared_context_fields(self):
    # Every field a rule reads is declared (no defensive getattr(ctx, ...)),
    # and nothing assigns ctx attributes.
    pattern = re.compile(r"getattr\(ctx\b|\bctx\.\w+\s*=[^=]")
    found = []
    for folder in ("lowering", "ipu_jax"):
      for where, _, files in os.walk(os.path.join(_ROOT, folder)):
        for name in files:
          if name.endswith(".py"):
            path = os.path.join(where, name)
            with open(path, encoding="utf-8") as f:
              for number, line in enumerate(f, 1):
                if pattern.search(line):
                  found.append(f"{os.path.relpath(path, _ROOT)}:{number}: {line.strip()}")
    self.assertEmpty(found, "\n".join(found))



class SourceLineTest(chex.TestCase):

  def test_a_loops_equations_name_their_line_found_once(self):
    # Each pass of the loop traces equations with equal tracebacks: their
    # line is found once and looked up after.
    from ipu_jax.lowering import lower

    def f(x):
      for _ in range(3):
        x = jnp.sin(x) * 2.0  # the line every pass names
      return x
    line = f.__code__.co_firstlineno + 2
    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    lower._source_of_traceback.cache_clear()
    sources = [lower.source_of(e) for e in eqns]
    self.assertEqual(set(sources), {f"{os.path.abspath(__file__)}:{line}"})
    self.assertEqual(lower._source_of_traceback.cache_info().misses, 2)  # sin, mul


if __name__ == "__main__":
  absltest.main()
