"""Built-in lowering rules, one module per family of primitives.

Importing this package registers every rule (``ipu_jax.lowering`` imports it).
"""

from ipu_jax.lowering.rules import (control, convolution, cumulative, dot,  # noqa: F401
                                    dynamic_slice, elementwise, fft, gather,
                                    linalg, misc, parallel, random,
                                    reduction, scatter, shape, sort, window)
