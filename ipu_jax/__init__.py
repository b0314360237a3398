"""ipu-jax: a functional emulator of the Graphcore IPU, written in JAX.

The public API; see DESIGN.md section 9 and the README.
"""

from ipu_jax.config import (IPUConfig, LoweringOptions, default_config,
                            get_default_config)
from ipu_jax.errors import LoweringError, OutOfMemoryError
from ipu_jax.jit import IPUFunction, Lowered, jit
from ipu_jax.lowering.registry import register_lowering
from ipu_jax import ops
from ipu_jax.report import Report, SavedReport, compare_reports, load_report
from ipu_jax.strategy import IPUStrategy
from ipu_jax.target import IPUTarget

__version__ = "0.1.0"


def __getattr__(name):
  # ipu_jax.keras pulls in Flax; load it on first use only.
  if name == "keras":
    import importlib
    return importlib.import_module("ipu_jax.keras")
  raise AttributeError(f"module 'ipu_jax' has no attribute {name!r}")

__all__ = [
    "IPUConfig", "IPUFunction", "IPUStrategy", "IPUTarget", "Lowered", "LoweringError",
    "LoweringOptions", "OutOfMemoryError", "Report", "SavedReport",
    "compare_reports", "default_config", "get_default_config", "jit",
    "keras", "load_report", "ops", "register_lowering",
]
