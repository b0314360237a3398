"""Built-in lowering rules, one module per family of primitives.

Importing this package registers every rule (``ipu_jax.lowering`` imports it).
"""

from ipu_jax.lowering.rules import (control, convolution, dot, elementwise, fft,  # noqa: F401
                                    indexing, ipu_ops, linalg, misc, parallel, random,
                                    pipeline, reduction, shape, window)
