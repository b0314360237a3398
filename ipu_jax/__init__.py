"""ipu-jax: a functional emulator of the Graphcore IPU, written in JAX."""

from ipu_jax.errors import LoweringError, OutOfMemoryError
from ipu_jax.target import IPUTarget

__version__ = "0.1.0"
