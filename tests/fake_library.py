"""A stand-in for a library's jitted helper (like ``jnp.linalg``'s).

``tests/test_jit_surface.py`` registers this file as a library path, so JAX
finds no user frame in the equations traced here, as for JAX's own helpers.
"""

import jax
from jax.extend import core as jcore
from jax.interpreters import mlir

# A primitive with no tile lowering.
opaque_p = jcore.Primitive("opaque_inside_helper")
opaque_p.def_impl(lambda x: x + 1)
opaque_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(opaque_p, mlir.lower_fun(lambda x: x + 1, multiple_results=False))


@jax.jit
def helper(x):
  return opaque_p.bind(x * 2)
