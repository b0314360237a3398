"""pytest plugin: run TessellateIPU's own tests against ``ipu_jax.tessellate``.

Loaded with ``-p tessellate_plugin`` by ``test_tessellate_ipu_suite.py``: it
installs the alias (``import tessellate_ipu`` and ``jax.jit(...,
backend="ipu")`` answered by the emulator) before TessellateIPU's test modules
are imported, and sets the IPU-model tile count TessellateIPU's CI uses.
"""

import os

os.environ.setdefault("JAX_IPU_USE_MODEL", "true")
os.environ.setdefault("JAX_IPU_MODEL_NUM_TILES", "16")


def _jax_03_names():
  """Names TessellateIPU's tests take from JAX 0.3 that later JAX moved.

  ``jax.core.Primitive`` moved to ``jax.extend.core.Primitive``: JAX-version
  drift, not part of the emulator, so the shim lives in this runner only.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from jax.extend import core as jcore  # pylint: disable=import-outside-toplevel
  if not hasattr(jax.core, "Primitive"):
    jax.core.Primitive = jcore.Primitive


def pytest_configure(config):
  del config
  from ipu_jax.tessellate import install_alias  # pylint: disable=import-outside-toplevel
  _jax_03_names()
  install_alias()
