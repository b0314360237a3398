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
"""

# pylint: disable=unused-import
from jax._src import ad_checkpoint
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
    "ad_checkpoint", "ad_internal", "add_jaxvals_p", "config", "control_flow",
    "control_flow_loops", "core", "custom_derivatives", "debugging", "dispatch", "lax_internal",
    "lax_linalg", "lax_parallel", "lax_special", "partial_eval", "pjit", "prng", "random_core",
    "shard_map", "source_info_util", "threefry2x32", "windowed_reductions",
]
