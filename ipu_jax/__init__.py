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
from ipu_jax.target import IPUTarget

__version__ = "0.1.0"

__all__ = [
    "IPUConfig", "IPUFunction", "IPUTarget", "Lowered", "LoweringError",
    "LoweringOptions", "OutOfMemoryError", "Report", "SavedReport",
    "compare_reports", "default_config", "get_default_config", "jit",
    "load_report", "ops", "register_lowering",
]
