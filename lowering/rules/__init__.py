"""Built-in lowering rules, one module per family of primitives.

Importing this package registers every rule (``ipu_jax.lowering`` imports it).
"""

from ipu_jax.lowering.rules import (control, convolution, dot, elementwise, fft,  # noqa: F401
                                    indexing, ipu_matmul, linalg, misc, parallel, pipeline,
                                    print_tensor, random, reduction, rounding, shape, sharding,
                                    stochastic_round, tile_map, window)
