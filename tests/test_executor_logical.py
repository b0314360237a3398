"""The executor's logical state: steps' logical forms and what XLA is left to run.

Between steps the executor keeps tensors as logical arrays and runs a step's
logical form where it has one (``Superstep.logical``). These tests
check each form against its step's storage function, the whole program
against the storage path (which a trapping run takes), and that a training
step then needs no more XLA temporary memory than ``jax.jit``'s, and that
reductions and their outputs leave XLA no gathers.
"""

import collections
import re

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering.exchange import to_flat, to_storage
from experiments import scale_workloads
from testing_utils import T16, executor_config, random_array, supersteps_with_members

_IPU2 = ipu_jax.IPUTarget.preset("ipu2")


def _attention_block(x, w, b):
  """Elementwise chains, a transpose, a reshape, matmuls, a broadcast read, a reduction."""
  h = jnp.tanh(x @ w + b)
  scores = h @ h.T / 3.0
  p = jax.nn.softmax(scores, axis=-1)
  y = (p @ h).reshape(h.shape[0], 2, -1).transpose(1, 0, 2)
  return jnp.concatenate([y.sum(axis=0), x[:, :3] * 2.0], axis=1)


def _args():
  return (random_array((24, 10), seed=1), random_array((10, 12), seed=2),
          random_array((12,), seed=3))


def _carries_through(step) -> bool:
  """Whether ``step``'s logical form carries the whole result through a
  tensor only the logical forms of its own operation read (a reduction's
  partials, a scan's pieces), where ``fn`` holds each tile's share: there
  the forms agree on the operation's result, not per step."""
  return any(t.name.endswith(("/partials", "/local", "/totals"))
             for t in step.reads + step.writes)


def _compiled_hlo(fn, *args, target=T16) -> str:
  """The executor's compiled XLA program for ``fn`` (batched mode), as text."""
  lowered = ipu_jax.jit(fn, target=target).lower(*args)
  return lowered.compile().lower_executor(jax.tree_util.tree_leaves(args)).compile().as_text()


def _gathers(hlo: str) -> int:
  return len(re.findall(r"\bgather\(", hlo))


def _lowered_ops(text: str) -> collections.Counter:
  """Operations of a StableHLO module's text by kind (``stablehlo.pad``: ...)."""
  return collections.Counter(re.findall(r"=\s*\"?(stablehlo\.[a-z_]+)", text))


def _executor_ops(fn, *args, target=T16) -> collections.Counter:
  """Operations of the executor's XLA program for ``fn`` as it is handed to XLA."""
  lowered = ipu_jax.jit(fn, target=target).lower(*args)
  return _lowered_ops(
      lowered.compile().lower_executor(jax.tree_util.tree_leaves(args)).as_text())


def _tiny_transformer():
  row = scale_workloads.ScaleRow("tiny", "transformer", batch=2, layers=1, width=32, heads=2,
                                 seq=16, vocab=64)
  return scale_workloads.workload(row)


class LogicalFormTest(chex.TestCase, parameterized.TestCase):

  def test_every_logical_form_equals_its_storage_function(self):
    lowered = ipu_jax.jit(_attention_block, target=T16).lower(*_args())
    checked = set()
    rng = np.random.default_rng(0)
    for step in supersteps_with_members(lowered.program):
      form = step.logical
      if form is None or _carries_through(step):
        continue
      values = [jnp.asarray(rng.standard_normal(t.shape).astype(t.dtype)) for t in step.reads]
      want = step.fn(*[to_storage(v.reshape(-1), t.mapping)
                       for v, t in zip(values, step.reads)])
      got = form(*values)
      self.assertLen(got, len(step.writes))
      # A matmul's fn multiplies each tile's blocks (at HIGHEST precision, in
      # the tiles' order), its form the whole product: the same maths, so
      # equal to rounding; every other form equals its fn bit for bit.
      products = step.name.startswith(("dot_general", "conv_general_dilated"))
      for g, w, t in zip(got, want, step.writes):
        self.assertEqual(tuple(g.shape), tuple(t.shape), step.name)
        got_v = np.asarray(g, t.dtype)
        want_v = np.asarray(to_flat(w, t.mapping).astype(t.dtype)).reshape(t.shape)
        if products:
          np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-5, err_msg=step.name)
        else:
          np.testing.assert_array_equal(got_v, want_v, err_msg=step.name)
      checked.add(step.name.split("/")[0])
      if any(1 < t.size < step.writes[0].size for t in step.reads):
        checked.add("read broadcast")   # softmax's x - max: [24, 1] read as [24, 24]
    # The forms this program's kinds of step carry were all exercised.
    for kind in ("tanh", "dot_general", "transpose", "read broadcast", "slice", "concatenate"):
      self.assertTrue(any(name.startswith(kind) for name in checked), (kind, sorted(checked)))

  def test_per_tile_mode_runs_no_logical_form(self):
    # The rules build both forms; the per-tile executor runs ``fn`` only
    # (tests/test_program_ir.py replaces the forms by failing ones).
    lowered = ipu_jax.jit(_attention_block, target=T16,
                          config=executor_config("per_tile")).lower(*_args())
    self.assertTrue([s.name for s in supersteps_with_members(lowered.program) if s.logical is not None])
    chex.assert_trees_all_close(lowered(*_args()), jax.jit(_attention_block)(*_args()),
                                rtol=1e-5, atol=1e-6)

  def test_logical_path_is_jax_jit_and_storage_path_agrees_to_rounding(self):
    # Without traps the logical forms run: XLA gets the program jax.jit
    # gets, and here gives the same bits. With floating-point traps every
    # step runs its storage function (the executor checks each step's
    # storage), which XLA fuses differently: equal to rounding.
    args = _args()
    want = jax.jit(_attention_block)(*args)
    logical = ipu_jax.jit(_attention_block, target=T16)(*args)
    np.testing.assert_array_equal(np.asarray(logical), np.asarray(want))
    cfg = executor_config()
    cfg.floating_point_behaviour.inv = True
    storage = ipu_jax.jit(_attention_block, target=T16, config=cfg)(*args)
    chex.assert_trees_all_close(storage, want, rtol=1e-5, atol=1e-6)

  def test_training_step_needs_no_more_temporary_memory_than_jax_jit(self):
    # Tensors kept in tile storage between steps cost padded copies and
    # relayouts around every matmul and reduction (BERT-base: 1,183 MiB of
    # XLA temporaries against jax.jit's 31 MiB); logical state costs none.
    fn, args = _tiny_transformer()
    lowered = ipu_jax.jit(fn, target=T16).lower(*args)
    flat = jax.tree_util.tree_leaves(args)
    emulated = lowered.compile().lower_executor(flat).compile()
    plain = jax.jit(fn).lower(*args).compile()
    temp = emulated.memory_analysis().temp_size_in_bytes
    plain_temp = plain.memory_analysis().temp_size_in_bytes
    self.assertLessEqual(temp, 1.1 * plain_temp + 16384, (temp, plain_temp))
    chex.assert_trees_all_close(lowered(*args), jax.jit(fn)(*args), rtol=2e-4, atol=2e-5)

  @parameterized.named_parameters(
      ("sum_rows_16", "sum", (0,), 16), ("sum_middle_16", "sum", (1,), 16),
      ("sum_last_16", "sum", (2,), 16), ("sum_outer_16", "sum", (0, 2), 16),
      ("sum_all_16", "sum", (0, 1, 2), 16), ("sum_rows_1472", "sum", (0,), 1472),
      ("sum_middle_1472", "sum", (1,), 1472), ("sum_last_1472", "sum", (2,), 1472),
      ("max_middle_16", "max", (1,), 16), ("max_last_1472", "max", (2,), 1472),
      ("argmax_middle_16", "argmax", (1,), 16), ("argmax_last_1472", "argmax", (2,), 1472))
  def test_reduction_compiles_without_gathers(self, op, axes, tiles):
    # A reduction's two compute sets carry the result through the partials
    # (the logical forms compute it once, by the primitive): placing it
    # and taking it back cost one gather per reduction (30 in a small
    # transformer step's program against jax.jit's 2), and an output of
    # irregular layout two more (to its storage and back).
    fns = dict(sum=lambda x: jnp.sum(x, axis=axes), max=lambda x: jnp.max(x, axis=axes),
               argmax=lambda x: jnp.argmax(x, axis=axes[0]))
    fn = fns[op]
    x = random_array((37, 19, 3), seed=4)
    target = T16 if tiles == 16 else _IPU2
    self.assertEqual(_gathers(_compiled_hlo(fn, x, target=target)), 0)
    got = ipu_jax.jit(fn, target=target)(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(x)))

  # exp of these values (seed 62 of the slow fuzz suite): XLA's CPU backend
  # computes jax.jit's exp on a lone f32[7] by a libm call and exp in a loop
  # over padded tile rows by its own vectorised polynomial; they are an ulp
  # apart on x[1] (libm's is the correctly rounded one).
  _ULP_APART = np.array([-1.272868, 1.1594185, 2.5564365, 0.08180993, 2.2436993, 1.960323,
                         -1.5855207], np.float32)

  @parameterized.named_parameters(
      ("switch", lambda x, i: jax.lax.switch(i, [jnp.sin, lambda a: a * 3.0, jnp.exp], x)),
      ("cond", lambda x, i: jax.lax.cond(i > 1, jnp.exp, jnp.sin, x)),
      ("cond_closure", lambda x, i: jax.lax.cond(i > 1, lambda: jnp.exp(x), lambda: x)))
  def test_branch_computes_on_logical_arrays_as_jax_jit(self, fn):
    # A branch took its operands from tile storage (program inputs were held
    # padded) and put its results into it: conversions XLA cannot cancel
    # across the conditional, so it ran exp over padded rows, an ulp away
    # from jax.jit's exp. Inputs and carries are now held logical.
    x, index = self._ULP_APART, np.int32(2)
    padded = jax.jit(lambda v: jnp.exp(jnp.pad(v, (0, 25)))[:7])(x)
    self.assertFalse(np.array_equal(np.asarray(padded), np.asarray(jnp.exp(x))))
    got = ipu_jax.jit(fn, target=T16)(x, index)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(x, index)))

  @parameterized.named_parameters(
      ("exp", jnp.exp, False),
      ("transpose", lambda a: a.T * 2.0, False),
      ("cond", lambda a, i: jax.lax.cond(i > 1, jnp.exp, jnp.sin, a), True))
  def test_arguments_read_logically_cost_no_storage_round_trip(self, fn, indexed):
    # Every argument was built into its padded tile storage and read back
    # (a pad, reshapes and a slice each), and a branch's result copied
    # through storage, although every step here reads logical arrays: XLA
    # compiled a larger program than jax.jit's for nothing.
    x = random_array((37, 19), seed=5)
    args = (x, np.int32(2)) if indexed else (x,)
    ops = _executor_ops(fn, *args)
    self.assertEqual((ops["stablehlo.pad"], ops["stablehlo.slice"]), (0, 0), ops)
    if not indexed:
      self.assertEqual(ops, _lowered_ops(jax.jit(fn).lower(*args).as_text()))
    got = ipu_jax.jit(fn, target=T16)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(*args)))

  @parameterized.named_parameters(
      ("take_along_axis", lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)),
      ("its_gradient", lambda a, i: jax.grad(
          lambda b: jnp.sum(jnp.take_along_axis(b, i[:, None], axis=1) ** 2))(a)))
  def test_lookups_and_their_gradients_cost_no_storage_round_trip(self, fn):
    # A general gather (a loss's pick of each row's label) and its gradient's
    # scatter-add ran from tile storage: their operands padded into it and
    # their results sliced back out, around the same primitive on the same
    # values.
    x = random_array((37, 19), seed=6)
    labels = np.random.default_rng(6).integers(0, 19, size=37).astype(np.int32)
    ops = _executor_ops(fn, x, labels)
    reference = _lowered_ops(jax.jit(fn).lower(x, labels).as_text())
    self.assertEqual(ops["stablehlo.pad"], 0, ops)
    self.assertEqual(ops["stablehlo.slice"], reference["stablehlo.slice"], ops)
    got = ipu_jax.jit(fn, target=T16)(x, labels)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(x, labels)))


if __name__ == "__main__":
  absltest.main()
