"""Compile progress of ipu_jax.jit and Model.fit: shown when slow, silenced on request.

The display waits ``DEFAULT_DELAY_SECONDS`` (2 s) before printing; the tests
set it to 0 so a small program counts as slow.
"""

import contextlib
import io
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import compile_progress

_STAGES = ("tracing", "lowering", "planning", "memory check",
           "building the executor")


def _config(progress=True):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.report.progress = progress
  return cfg


def _model(x, w):
  return jnp.sum(jnp.tanh(x @ w) * 2.0, axis=0)


def _args():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((9, 13)).astype(np.float32),
          rng.standard_normal((13, 5)).astype(np.float32))


def _run(fn, *args, delay=0.0):
  """Calls ``fn(*args)``; returns what it wrote to stderr."""
  err = io.StringIO()
  with mock.patch.object(compile_progress, "DEFAULT_DELAY_SECONDS", delay), \
      contextlib.redirect_stderr(err):
    fn(*args)
  return err.getvalue()


class JitProgressTest(chex.TestCase, parameterized.TestCase):

  def test_slow_compile_shows_every_stage(self):
    f = ipu_jax.jit(_model, config=_config())
    text = _run(f, *_args())
    lines = text.splitlines()
    for stage in _STAGES:
      self.assertTrue(any(f"Compiling '_model': {stage}" in line
                          for line in lines), (stage, text))
    lowering = [line for line in lines if ": lowering" in line]
    num_equations = len(f.lower(*_args()).jaxpr.jaxpr.eqns)
    self.assertIn(f" {num_equations}/{num_equations} equations "
                  "[==============================]", lowering[-1])
    self.assertIn("compiled in", text)
    self.assertIn("compiling (XLA)", text)
    # Logs get a line per quarter of the equations, not one per equation.
    self.assertLessEqual(len(lowering), 5)

  def test_the_results_are_unchanged(self):
    f = ipu_jax.jit(_model, config=_config())
    out = io.StringIO()
    with mock.patch.object(compile_progress, "DEFAULT_DELAY_SECONDS", 0.0), \
        contextlib.redirect_stderr(out):
      result = f(*_args())
    chex.assert_trees_all_close(result, _model(*_args()), rtol=1e-5)

  def test_quick_compile_prints_nothing(self):
    text = _run(ipu_jax.jit(_model, config=_config()), *_args(), delay=600.0)
    self.assertEqual(text, "")

  @parameterized.named_parameters(
      ("verbose_0", dict(verbose=0), True),
      ("config_option", dict(), False))
  def test_silenced(self, jit_kwargs, progress_option):
    f = ipu_jax.jit(_model, config=_config(progress_option), **jit_kwargs)
    self.assertEqual(_run(f, *_args()), "")

  def test_verbosity_scope_silences(self):
    f = ipu_jax.jit(_model, config=_config())
    with compile_progress.verbosity(0):
      self.assertEqual(_run(f, *_args()), "")

  def test_terminal_gets_one_line_rewritten_in_place(self):
    class Terminal(io.StringIO):

      def isatty(self):
        return True

    stream = Terminal()
    with compile_progress.CompileProgress("net", verbose=1, stream=stream,
                                          delay=0.0) as progress:
      progress.stage("lowering")
      for done in range(4):
        progress.equations(done, 3)
      progress.stage("planning")
    text = stream.getvalue()
    self.assertEqual(text.count("\n"), 1)           # only the summary ends
    self.assertIn("\rCompiling 'net': lowering 3/3 equations "
                  "[==============================]", text)
    self.assertRegex(text, r"compiled in [\d.]+s \(lowering [\d.]+s, "
                           r"planning [\d.]+s\)\s*\n$")

  def test_failed_compile_ends_the_line(self):
    stream = io.StringIO()
    with self.assertRaises(ValueError):
      with compile_progress.CompileProgress("net", verbose=1, stream=stream,
                                            delay=0.0) as progress:
        progress.stage("lowering")
        raise ValueError("bad")
    self.assertIn("stopped after", stream.getvalue())


class FitProgressTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters(0, 2)
  def test_fit_verbose(self, verbose):
    from flax import nnx  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top

    x = np.random.default_rng(0).random((32, 6)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 32)
    with ipu_jax.IPUStrategy(_config()).scope():
      model = ipu_jax.keras.Model(nnx.Linear(6, 3, rngs=nnx.Rngs(0)))
      model.compile(optimizer=optax.sgd(0.1),
                    loss="sparse_categorical_crossentropy",
                    steps_per_execution=4)
      stdout = io.StringIO()
      with contextlib.redirect_stdout(stdout):
        text = _run(lambda: model.fit(x, y, batch_size=8, epochs=1,
                                      verbose=verbose))
    if verbose:
      self.assertIn("Compiling '", text)
      self.assertIn("Epoch 1/1", stdout.getvalue())
    else:
      self.assertEqual(text, "")
      self.assertEqual(stdout.getvalue(), "")


if __name__ == "__main__":
  absltest.main()
