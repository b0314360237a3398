"""Every reach into JAX's private ``jax._src`` modules, in one place.

ipu-jax lowers jaxprs equation by equation, so it needs the ``Primitive``
objects of every primitive it has a rule for, and a few internals that have no
public spelling. Public JAX (``jax.lax``, ``jax.extend.core``) exposes most
``lax`` primitives but not these; everything else in the package imports them
from here, so a JAX upgrade that moves one breaks this module alone. Tested
with the JAX range pinned in ``setup.cfg`` (jax 0.10.2).

What is reached, and why:

* ``source_info_util``: user frames of an equation's traceback (the source
  line in reports and errors), name-stack ``Scope`` entries (module paths),
  and ``register_exclusion`` so the frames of ``ipu_jax.ops`` count as
  library frames.
* ``core``, ``pjit``, ``custom_derivatives``, ``ad_checkpoint``,
  ``dispatch``, ``debugging``: the primitives of calls, custom derivatives,
  remat, identities (``device_put``, ``pvary``, sharding constraints, names,
  optimization barriers) and debug callbacks/prints, and the ordered debug
  effect ``ipu_jax.ops.print_tensor`` declares.
* ``ad_util.add_jaxvals_p``: ``add_any``, the sum of cotangents.
* ``lax.lax`` (``lax_internal``): primitives without a public name (``copy``,
  ``empty``, ``stack``, ``unstack``, ``tile``, reductions' internals) and
  shape helpers.
* ``lax.control_flow`` (and its ``loops``): ``scan``/``while``/``cond``,
  ``linear_solve``, ``platform_index``, the cumulative reductions.
* ``lax.special``, ``lax.linalg``, ``lax.windowed_reductions``,
  ``lax.parallel``: those families' primitives.
* ``random.prng``, ``random.core``, ``random.threefry2x32``, ``config``: the
  PRNG key primitives, key implementations and the default implementation.
* ``shard_map``: ``shard_map_p`` (lowered as IPU replicas).
* ``interpreters.partial_eval`` (``partial_eval``): ``dce_jaxpr``, JAX's
  dead-code elimination with its rules for calls, loops, branches and custom
  derivatives (``lowering/dead_code.py``); no public spelling.
* ``interpreters.ad`` (``ad_internal``): ``custom_lin_p``, the tangent
  ``jax.jvp`` leaves through a ``custom_vjp`` (refused by name when live).
* ``prng.KeyTy`` and ``prng.prngs``: a typed PRNG key's dtype from its
  implementation's name (:func:`dtype_of_plain`, for the executable cache).
* ``compilation_cache.reset_cache``: the persistent compilation cache is set
  up once per process; ``ipu_jax/executable_cache.py`` resets it when it
  names a directory after a first compile (no public spelling).
* ``core.Tracer``: its ``sharding`` and ``device`` properties, swapped for
  the duration of :func:`ipu_jax.cheap_tracer_probes` (``ipu_jax/tracer_probes.py``:
  the pinned JAX walks the whole trace to build a message nobody sees).
* ``core.physical_element_aval``: what one element of an extended dtype (a
  typed PRNG key, ``key<fry>``) is held as (``uint32[2]``), for
  :func:`physical_shape_dtype`, the one conversion every pass reading an
  aval's bytes or dtype uses; JAX has no public spelling of it.
* ``core.trace_state_clean``: whether a call is made outside every JAX
  transformation (:func:`outside_transformations`: ``ipu_jax.jit`` lets a
  loop's repeat calls go straight to ``jax.jit``'s dispatcher only there).
"""

# pylint: disable=unused-import
import jax
import numpy as np

from jax._src import ad_checkpoint
from jax._src import compilation_cache
from jax._src import config
from jax._src import core
from jax._src import custom_derivatives
from jax._src import debugging
from jax._src import dispatch
from jax._src import pjit
from jax._src import shard_map
from jax._src import source_info_util
from jax._src.ad_util import add_jaxvals_p
from jax._src.interpreters import ad as ad_internal
from jax._src.interpreters import partial_eval
from jax._src.lax import control_flow
from jax._src.lax import lax as lax_internal
from jax._src.lax import linalg as lax_linalg
from jax._src.lax import parallel as lax_parallel
from jax._src.lax import special as lax_special
from jax._src.lax import windowed_reductions
from jax._src.lax.control_flow import loops as control_flow_loops
from jax._src.random import core as random_core
from jax._src.random import prng
from jax._src.random import threefry2x32

__all__ = [
    "ad_checkpoint", "ad_internal", "add_jaxvals_p", "compilation_cache", "config", "control_flow",
    "control_flow_loops", "core", "custom_derivatives", "debugging", "dispatch", "lax_internal",
    "lax_linalg", "lax_parallel", "lax_special", "partial_eval", "pjit", "prng", "random_core",
    "shard_map", "source_info_util", "threefry2x32", "windowed_reductions",
    "is_extended_dtype", "physical_shape_dtype", "physical_nbytes", "physical_value",
    "dtype_plain", "dtype_of_plain", "outside_transformations",
]


def outside_transformations() -> bool:
  """Whether nothing is being traced (no ``jit``, ``vmap``, ``grad``, ``shard_map`` around)."""
  return core.trace_state_clean()


def is_extended_dtype(dtype) -> bool:
  """Whether ``dtype`` is one of JAX's extended dtypes (a typed PRNG key)."""
  return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def physical_shape_dtype(aval) -> tuple:
  """``(shape, numpy dtype)`` an array of ``aval`` is held as on the tiles and host.

  An extended dtype is no NumPy dtype: a typed PRNG key array
  ``key<fry>[n]`` is held as its key data ``uint32[n, 2]`` (the element's
  physical axes last, as ``jax.random.key_data`` gives), so byte counts,
  tensors and storage all see the physical form.

  Args:
    aval: anything with ``shape`` and ``dtype`` (an aval, an array, a
      ``jax.ShapeDtypeStruct``).
  """
  if is_extended_dtype(aval.dtype):
    element = core.physical_element_aval(aval.dtype)
    return (tuple(int(d) for d in aval.shape) + tuple(int(d) for d in element.shape),
            np.dtype(element.dtype))
  return tuple(int(d) for d in aval.shape), np.dtype(aval.dtype)


def physical_nbytes(aval) -> int:
  """Bytes of an array of ``aval`` as held (:func:`physical_shape_dtype`)."""
  shape, dtype = physical_shape_dtype(aval)
  return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize



def physical_value(value) -> np.ndarray:
  """``value`` as a NumPy array of what is held (:func:`physical_shape_dtype`).

  NumPy refuses typed PRNG key arrays, so a key array (a constant the
  function closed over) gives its key data.
  """
  if is_extended_dtype(getattr(value, "dtype", None)):
    value = jax.random.key_data(value)
  return np.asarray(value)


_KEY_PREFIX = "key:"


def dtype_plain(dtype):
  """``dtype`` as a file can hold it: a NumPy dtype, or ``"key:<impl>"`` for a PRNG key."""
  if is_extended_dtype(dtype):
    return _KEY_PREFIX + dtype._impl.name  # pylint: disable=protected-access
  return np.dtype(dtype)


def dtype_of_plain(plain):
  """The dtype :func:`dtype_plain` gave ``plain`` for."""
  if isinstance(plain, str) and plain.startswith(_KEY_PREFIX):
    return prng.KeyTy(prng.prngs[plain[len(_KEY_PREFIX):]])
  return np.dtype(plain)
