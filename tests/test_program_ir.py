"""The tile program IR: typed nodes, a superstep's two forms, the executor's choice.

A rule builds each step's ``fn`` (what the tiles do) and, where its values
can be computed on logical arrays, its ``logical`` form; the executor, not
the rule, picks which runs (``lowering/executor.py``). These tests check
that no rule reads the executor mode, that each mode runs the form it
names, and that ``Program`` names every node type the walkers accept.
"""

import ast
import dataclasses
import pathlib
import typing

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import fp_exceptions
from ipu_jax.lowering import program as P
from ipu_jax.lowering import remote
from testing_utils import T16, executor_config, random_array, supersteps_with_members

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# Where the mode may be named: its declaration, the user config, and the
# lowering stage that hands it to the executor.
_MAY_NAME_THE_MODE = {"lowering/options.py", "ipu_jax/config.py", "ipu_jax/stages.py"}

def mode_readers(sources: dict) -> list:
  """``path:line`` of every read of ``executor_mode`` (an attribute, or the
  name as a string, as ``getattr`` would take it) in ``sources``."""
  found = []
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text)):
      if ((isinstance(node, ast.Attribute) and node.attr == "executor_mode")
          or (isinstance(node, ast.Constant) and node.value == "executor_mode")):
        found.append(f"{path}:{node.lineno}")
  return found


def _sources() -> dict:
  out = {}
  for folder in ("lowering", "ipu_jax"):
    for path in sorted((_ROOT / folder).rglob("*.py")):
      rel = path.relative_to(_ROOT).as_posix()
      if rel not in _MAY_NAME_THE_MODE:
        out[rel] = path.read_text()
  return out


def _block(x, w, idx, table):
  """Kinds of step with both forms: matmul, reductions, a scan, a gather, a
  pad with a computed value, a convolution, a pooling window."""
  h = jnp.tanh(x @ w)
  soft = jax.nn.softmax(h, axis=-1)
  scan = jnp.cumsum(h, axis=0)
  rows = table[idx] * 2.0
  padded = jnp.pad(h, 1, constant_values=h[0, 0])
  img = h[None, :, :, None]
  conv = jax.lax.conv_general_dilated(img, jnp.ones((3, 3, 1, 2)), (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  pool = jax.lax.reduce_window(img, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 1, 1, 1), "VALID")
  return soft.sum(), scan, rows, padded, jnp.argmax(h, axis=0), conv, pool


def _args():
  return (random_array((13, 7), seed=1), random_array((7, 9), seed=2),
          jnp.array([4, 0, 12, 3, 400], jnp.int32), random_array((512, 16), seed=3))


def _refuse(step):
  def form(*_):
    raise AssertionError(f"logical form of {step.name} ran")
  return form


class ModeTest(chex.TestCase, parameterized.TestCase):

  def test_no_rule_reads_the_executor_mode(self):
    self.assertEqual(mode_readers(_sources()), [])

  def test_a_rule_reading_the_mode_is_caught(self):
    fake = {"lowering/rules/fake.py": (
        "def rule(ctx):\n"
        "  if ctx.options.executor_mode == 'per_tile':\n"
        "    return 1\n"
        "  return getattr(ctx.options, 'executor_mode')\n")}
    self.assertEqual(mode_readers(fake), ["lowering/rules/fake.py:2",
                                          "lowering/rules/fake.py:4"])

  def test_rules_build_both_forms_whatever_the_mode(self):
    names = {}
    for mode in ("batched", "per_tile"):
      lowered = ipu_jax.jit(_block, target=T16, config=executor_config(mode)).lower(*_args())
      names[mode] = sorted(s.name for s in supersteps_with_members(lowered.program) if s.logical is not None)
    self.assertEqual(names["batched"], names["per_tile"])
    for kind in ("reduce_sum", "reduce_max", "cumsum", "gather", "pad", "argmax",
                 "conv_general_dilated", "reduce_window_max", "dot_general", "tanh"):
      self.assertTrue(any(n.startswith(kind) for n in names["per_tile"]),
                      (kind, names["per_tile"]))

  @parameterized.parameters("per_tile", "batched")
  def test_each_mode_runs_the_form_it_names(self, mode):
    # Every logical form replaced by one that fails: the per-tile executor
    # never calls them, the batched one does.
    args = _args()
    lowered = ipu_jax.jit(_block, target=T16, config=executor_config(mode)).lower(*args)
    for step in supersteps_with_members(lowered.program):
      if step.logical is not None:
        step.logical = _refuse(step)
    if mode == "batched":
      with self.assertRaisesRegex(AssertionError, "logical form of .* ran"):
        lowered(*args)
    else:
      chex.assert_trees_all_close(lowered(*args), jax.jit(_block)(*args), rtol=2e-5, atol=1e-5)

  @parameterized.parameters("per_tile", "batched")
  def test_trapping_runs_storage_forms_with_the_same_numbers(self, mode):
    # With traps every step's storages are checked: the batched executor
    # runs the logical forms between storages, the per-tile one ``fn``.
    args = _args()
    cfg = executor_config(mode)
    cfg.floating_point_behaviour.inv = True
    got = ipu_jax.jit(_block, target=T16, config=cfg)(*args)
    plain = ipu_jax.jit(_block, target=T16, config=executor_config(mode))(*args)
    chex.assert_trees_all_close(got, plain, rtol=2e-5, atol=1e-5)
    chex.assert_trees_all_close(got, jax.jit(_block)(*args), rtol=2e-5, atol=1e-5)


class TypedProgramTest(chex.TestCase):

  def test_program_names_every_node_type(self):
    members = set(typing.get_args(P.Program))
    self.assertEqual(members, {P.Superstep, P.Sequence, P.Repeat, P.RepeatWhileTrue, P.If,
                               P.Switch, P.Replicated, P.StreamCopy, P.PrintTensor})
    self.assertTrue(issubclass(remote.RemoteCopy, P.Superstep))
    # Each one is a node the walkers accept.
    t = P.Tensor("t", (), np.float32)
    step = P.Superstep("s", "s", (), (t,), lambda: ())
    nodes = [step, P.Sequence(step), P.Repeat(2, step), P.RepeatWhileTrue(step, t, step),
             P.If(t, step), P.Switch(t, [(0, step)]), P.Replicated(step, (("i", 2),)),
             P.StreamCopy(P.HostStream("h", np.float32, 1), t), P.PrintTensor("p", t)]
    self.assertEqual({type(n) for n in nodes}, members)
    for node in nodes:
      list(P.iter_steps(node))
    with self.assertRaisesRegex(TypeError, "not a tile program"):
      list(P.iter_steps(object()))

  def test_logical_form_is_a_declared_field(self):
    fields = {f.name: f for f in dataclasses.fields(P.Superstep)}
    self.assertIn("logical", fields)
    self.assertIsNone(fields["logical"].default)
    # Fused members keep their forms through the field (dataclasses.replace),
    # and the fused step carries them in its own.
    lowered = ipu_jax.jit(lambda x: jnp.tanh(x * 2.0 + 1.0).sum(), target=T16).lower(
        random_array((40,), seed=3))
    fused = [s for s in supersteps_with_members(lowered.program)
             if fp_exceptions.fused_members(s)]
    self.assertTrue(fused)
    for step in fused:
      self.assertTrue(all(m.logical is not None
                          for m in fp_exceptions.fused_members(step)))
      # The fused step's own form is its members' forms in order.
      self.assertIsNotNone(step.logical)


if __name__ == "__main__":
  absltest.main()
