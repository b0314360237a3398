"""Built-in lowering rules, one module per family of primitives.

Importing this package registers every rule (``ipu_jax.lowering`` imports it).
"""

from ipu_jax.lowering.rules import (control, convolution, dot, elementwise, indexing,  # noqa: F401
                                    ipu_ops, misc, parallel, random, reduction, shape, window)
