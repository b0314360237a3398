"""The ``ipu_jax.jit`` surface as ``jax.jit`` users expect it.

Arguments are validated when ``jit`` is called (or, for what only a call can
tell, before anything runs); a lowered program checks what it is called with;
any callable can be wrapped; and every error or report row names the user's
line, also for equations inside JAX's own jitted helpers.
"""

import functools
import inspect

from absl.testing import absltest
from absl.testing import parameterized
import chex
from flax import nnx
import jax
from jax._src import source_info_util
import jax.numpy as jnp
import numpy as np

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)

import fake_library  # pylint: disable=g-bad-import-order

# Frames in fake_library.py count as a library's, like JAX's own helpers'.
source_info_util.register_exclusion(fake_library.__file__)


def _line_of(marker: str) -> int:
  lines = inspect.getsource(inspect.getmodule(_line_of)).splitlines()
  return next(i + 1 for i, line in enumerate(lines) if marker in line)


def _normal(seed, shape, dtype=jnp.float32):
  # Test inputs drawn on the host: jax.random would compile a sampler per shape.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


class LoweredCallChecksTest(chex.TestCase):
  """Item 4: ``Lowered.__call__`` checks its arguments like ``Compiled``."""

  def setUp(self):
    super().setUp()
    self.a34, self.b42 = _normal(0, (3, 4)), _normal(1, (4, 2))
    self.lowered = ipu_jax.jit(lambda a, b: a @ b, target=_T16).lower(self.a34, self.b42)

  def test_same_arguments_run(self):
    chex.assert_trees_all_close(self.lowered(self.a34, self.b42), self.a34 @ self.b42,
                                rtol=1e-6)

  def test_other_shape_of_same_size_is_refused(self):
    with self.assertRaisesRegex(TypeError, r"args\[0\] was lowered as f32\[3,4\] and is now "
                                r"f32\[4,3\]"):
      self.lowered(self.a34.T, self.b42)

  def test_missing_argument_is_refused(self):
    with self.assertRaisesRegex(TypeError, "1 positional arguments where it was lowered for 2"):
      self.lowered(self.a34)

  def test_extra_keyword_is_refused(self):
    with self.assertRaisesRegex(TypeError, "keyword arguments"):
      self.lowered(self.a34, self.b42, c=1.0)

  def test_wrong_dtype_is_refused_not_cast(self):
    with self.assertRaisesRegex(TypeError, r"args\[1\] was lowered as f32\[4,2\] and is now "
                                r"i32\[4,2\]"):
      self.lowered(self.a34, jnp.ones((4, 2), jnp.int32))

  def test_wrong_size_is_refused(self):
    with self.assertRaisesRegex(TypeError, r"args\[0\].*f32\[5,4\]"):
      self.lowered(jnp.ones((5, 4)), self.b42)

  def test_pytree_structure_and_paths(self):
    f = ipu_jax.jit(lambda p, x: p["w"] * x + p["b"], target=_T16)
    p, x = {"w": jnp.ones(3), "b": jnp.zeros(3)}, jnp.arange(3.0)
    lowered = f.lower(p, x)
    chex.assert_trees_all_close(lowered(p, x), x)
    with self.assertRaisesRegex(TypeError, r"args\[0\]\['w'\] was lowered as f32\[3\]"):
      lowered({"w": jnp.ones(4), "b": jnp.zeros(3)}, x)
    with self.assertRaisesRegex(TypeError, "structured as"):
      lowered({"w": jnp.ones(3)}, x)

  def test_weak_types_are_not_compared(self):
    # As jax.stages.Compiled: a Python scalar stands for a 0-d array of its dtype.
    f = ipu_jax.jit(lambda x, s: x * s, target=_T16)
    lowered = f.lower(jnp.ones(3), jnp.float32(2.0))
    chex.assert_trees_all_close(lowered(jnp.ones(3), 3.0), jnp.full(3, 3.0))
    with self.assertRaisesRegex(TypeError, r"args\[1\].*i32\[\]"):
      lowered(jnp.ones(3), 3)

  def test_keyword_arguments_and_static_args_left_out(self):
    f = ipu_jax.jit(lambda x, n, *, scale: x * n * scale, target=_T16, static_argnums=1)
    lowered = f.lower(jnp.ones(2), 3, scale=jnp.float32(2.0))
    chex.assert_trees_all_close(lowered(jnp.ones(2), scale=jnp.float32(1.0)), jnp.full(2, 3.0))
    chex.assert_trees_all_close(f(jnp.ones(2), 3, scale=jnp.float32(2.0)), jnp.full(2, 6.0))


class JitArgumentsTest(chex.TestCase, parameterized.TestCase):
  """Item 7: ``ipu_jax.jit`` validates its arguments as ``jax.jit`` does."""

  def test_donate_argnums_int(self):
    f = ipu_jax.jit(lambda x: x + 1, target=_T16, donate_argnums=0)
    chex.assert_trees_all_close(f(jnp.ones(3)), jnp.full(3, 2.0))
    self.assertEqual(f.donate_argnums, (0,))

  def test_target_preset_name(self):
    f = ipu_jax.jit(lambda x: x * 2, target="ipu1")
    self.assertEqual(f.lower(jnp.ones(3)).target.num_tiles, 1216)

  def test_unknown_target_name_lists_presets(self):
    with self.assertRaisesRegex(ValueError, r"'ipu9'.*valid presets.*bow.*ipu1.*ipu2"):
      ipu_jax.jit(lambda x: x, target="ipu9")

  def test_target_of_wrong_type(self):
    with self.assertRaisesRegex(TypeError, "target must be an ipu_jax.IPUTarget or a preset"):
      ipu_jax.jit(lambda x: x, target=16)

  def test_config_of_wrong_type(self):
    with self.assertRaisesRegex(TypeError, "config must be an ipu_jax.IPUConfig, got str"):
      ipu_jax.jit(lambda x: x, config="x")

  @parameterized.parameters(2, -3, ((0, 5),))
  def test_static_argnums_out_of_range(self, nums):
    with self.assertRaisesRegex(ValueError, r"static_argnums=.* takes 2 positional arguments"):
      ipu_jax.jit(lambda x, y: x + y, static_argnums=nums)

  def test_static_argnums_out_of_range_at_call_for_varargs(self):
    f = ipu_jax.jit(lambda *xs: sum(xs), target=_T16, static_argnums=2)
    with self.assertRaisesRegex(ValueError, "called with only 2 positional arguments"):
      f(jnp.ones(2), jnp.ones(2))

  def test_negative_static_argnum(self):
    f = ipu_jax.jit(lambda x, n: x * n, target=_T16, static_argnums=-1)
    chex.assert_trees_all_close(f(jnp.ones(2), 4), jnp.full(2, 4.0))

  def test_static_argnames(self):
    f = ipu_jax.jit(lambda x, mode="add": x + 1 if mode == "add" else x - 1, target=_T16,
                    static_argnames="mode")
    chex.assert_trees_all_close(f(jnp.zeros(2), mode="sub"), jnp.full(2, -1.0))
    chex.assert_trees_all_close(f(jnp.zeros(2), "sub"), jnp.full(2, -1.0))
    with self.assertRaisesRegex(ValueError, r"static_argnames \['nope'\] are not parameters"):
      ipu_jax.jit(lambda x: x, static_argnames="nope")

  def test_non_hashable_static_argument(self):
    f = ipu_jax.jit(lambda x, shape: x.reshape(shape), target=_T16, static_argnums=1)
    with self.assertRaisesRegex(ValueError, "Non-hashable static argument 1"):
      f(jnp.ones(4), [2, 2])

  @parameterized.parameters("static_argnums", "donate_argnums")
  def test_argnums_of_wrong_type(self, name):
    with self.assertRaisesRegex(TypeError, f"{name} must be an int or a sequence of ints"):
      ipu_jax.jit(lambda x: x, **{name: "0"})

  def test_not_callable(self):
    with self.assertRaisesRegex(TypeError, "expects a callable, got int"):
      ipu_jax.jit(3)


class _Scale:
  def __init__(self, factor):
    self.factor = factor

  def __call__(self, x):
    return x * self.factor

  def apply(self, x):
    return x + self.factor


class _Model:
  @functools.partial(ipu_jax.jit, static_argnums=0)
  def double(self, x):
    return 2 * x


class WrapAnyCallableTest(chex.TestCase, parameterized.TestCase):
  """Item 8: wrapping other transforms and callables works."""

  @parameterized.named_parameters(
      ("jax_jit", jax.jit(lambda x: jnp.sin(x) * 2)),
      ("nnx_jit", nnx.jit(lambda x: jnp.sin(x) * 2)),
      ("partial", functools.partial(lambda x, k: jnp.sin(x) * k, k=2.0)),
      ("callable_object", _Scale(2.0)),
      ("bound_method", _Scale(2.0).apply),
  )
  def test_wrap(self, fn):
    x = jnp.linspace(-1.0, 1.0, 7)
    f = ipu_jax.jit(fn, target=_T16)
    chex.assert_trees_all_close(f(x), jax.jit(fn)(x), rtol=1e-6)
    self.assertTrue(callable(f.lower))
    self.assertIs(f.__wrapped__, fn)

  def test_wrapper_keeps_name_and_doc(self):
    def loss(x):
      """The doc."""
      return x
    f = ipu_jax.jit(loss)
    self.assertEqual((f.__name__, f.__doc__), ("loss", "The doc."))

  def test_pmap_wraps(self):
    # Whether a pmapped body lowers is the collective rules' business; wrapping
    # must not break on the pmapped function's own attributes (e.g. `lower`).
    f = ipu_jax.jit(jax.pmap(lambda x: x * 2), target=_T16)
    self.assertTrue(callable(f.lower))
    self.assertEqual(f.static_argnums, ())

  def test_decorated_method(self):
    chex.assert_trees_all_close(_Model().double(jnp.ones(3)), jnp.full(3, 2.0))


class SourceLinesTest(chex.TestCase):
  """Item 13: equations inside JAX's jitted helpers name the user's line."""

  def test_unsupported_primitive_inside_helper_names_user_line(self):
    f = ipu_jax.jit(lambda x: fake_library.helper(x) * 3, target=_T16)  # helper-call-line
    with self.assertRaisesRegex(ipu_jax.LoweringError,
                                rf"opaque_inside_helper.*test_jit_surface.py:"
                                rf"{_line_of('# helper-call-line')}"):
      f.lower(jnp.ones(3))

  def test_report_rows_inside_jnp_helpers_name_user_line(self):
    def f(x):
      return jnp.cumsum(jnp.clip(x, -1.0, 1.0))  # helpers-line

    x = _normal(1, (37,))
    lowered = ipu_jax.jit(f, target=_T16).lower(x)
    chex.assert_trees_all_close(lowered(x), f(x), rtol=1e-6)
    where = f"test_jit_surface.py:{_line_of('# helpers-line')}"
    sources = {step.source.rsplit("/", 1)[-1] for step in lowered.profile.steps}
    self.assertEqual(sources, {where})


class CallSiteTest(chex.TestCase):

  def test_wrapped_transform_names_the_calling_line(self):
    # The inner jax.jit's equations carry no frame of this file: they belong
    # to the line that lowered the function.
    f = ipu_jax.jit(jax.jit(jnp.tanh), target=_T16)
    lowered = f.lower(jnp.ones(8))  # call-site-line
    where = f"test_jit_surface.py:{_line_of('# call-site-line')}"
    self.assertEqual({s.source.rsplit("/", 1)[-1] for s in lowered.profile.steps}, {where})


class NNXArgumentsTest(chex.TestCase):

  def test_module_argument_points_to_nnx_jit(self):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    f = ipu_jax.jit(lambda m, x: m(x), target=_T16)
    with self.assertRaisesRegex(TypeError, r"NNX objects \(args\[0\]\).*ipu_jax.nnx_jit"):
      f(model, jnp.ones(3))

  def test_variable_state_is_plain_data(self):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    f = ipu_jax.jit(lambda s, x: nnx.merge(graphdef, s)(x), target=_T16)
    chex.assert_trees_all_close(f(state, jnp.ones(3)), model(jnp.ones(3)), rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
