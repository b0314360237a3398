"""The errors ipu-jax raises before (or while) a program runs.

They are raised by the lowering (:mod:`ipu_jax.lowering.errors`); this module is
the user's name for them.
"""

from ipu_jax.lowering.errors import FloatingPointException, LoweringError, OutOfMemoryError

__all__ = ["LoweringError", "OutOfMemoryError", "FloatingPointException"]
