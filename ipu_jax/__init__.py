"""ipu-jax: a functional emulator of the Graphcore IPU, written in JAX.

The public API. README.md is the user's guide; the details (the tile program,
training semantics, hardware facts and their sources) are in docs/.
"""

from ipu_jax.config import (IPUConfig, LoweringOptions, default_config,
                            get_default_config)
from ipu_jax.errors import FloatingPointException, LoweringError, OutOfMemoryError
from ipu_jax.jit import IPUFunction, jit
from ipu_jax.compiled import Compiled
from ipu_jax.stages import Lowered, Traced
from ipu_jax.nnx_jit import NNXFunction, nnx_jit
from ipu_jax.lowering.registry import register_lowering
from ipu_jax import ops
from ipu_jax.report import NumberFormatTelemetry, Report, SavedReport, compare_reports, load_report
from ipu_jax.strategy import IPUStrategy
from ipu_jax.target import IPUSystem, IPUTarget
from ipu_jax import offload  # streaming memory for ipu_jax.jit users (offload_argnums)
from ipu_jax import io_tiles  # I/O tile sizing (suggest_num_io_tiles)
from ipu_jax.tracer_probes import cheap_tracer_probes

__version__ = "0.1.0"


# Documented submodules that are not imported above; each is loaded on first
# attribute access (ipu_jax.keras pulls in Flax and optax, so it is not loaded
# up front), so ``import ipu_jax; ipu_jax.graph.Graph(...)`` works.
_LAZY_SUBMODULES = ("graph", "poplibs", "keras", "kernels", "lowering", "remote_buffers",
                    "number_formats", "rounding", "fp8_scaling", "pipelining", "sparse",
                    "parallel", "phased", "cpp_codelets", "tessellate")


def __getattr__(name):
  if name in _LAZY_SUBMODULES:
    import importlib
    return importlib.import_module(f"ipu_jax.{name}")
  raise AttributeError(f"module 'ipu_jax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY_SUBMODULES))

__all__ = [
    "Compiled", "FloatingPointException", "IPUConfig", "IPUFunction", "NNXFunction", "IPUStrategy",
    "IPUSystem", "cheap_tracer_probes", "IPUTarget", "Lowered", "LoweringError",
    "LoweringOptions", "OutOfMemoryError", "Report", "SavedReport",
    "NumberFormatTelemetry", "compare_reports", "default_config", "get_default_config", "jit", "Traced",
    "graph", "keras", "kernels", "load_report", "lowering", "nnx_jit", "ops", "pipelining", "poplibs",
    "register_lowering", "number_formats", "rounding", "fp8_scaling", "offload", "remote_buffers",
    "sparse", "parallel", "phased", "cpp_codelets", "tessellate",
]
