"""Number formats of the IPU (FP8 formats and their scales), for the user.

Formats are facts a cost or a cast needs, so they live on the bottom floor
(:mod:`ipu_jax.kernels.number_formats`); this module is the user's name for them.
"""

from ipu_jax.kernels.number_formats import (F143, F152, FP8_FORMATS, LOG2_SCALE_RANGE,
                                            FP8Format, check_log2_scale, fp8_format, is_fp8)

__all__ = ["FP8Format", "F143", "F152", "FP8_FORMATS", "LOG2_SCALE_RANGE",
           "fp8_format", "is_fp8", "check_log2_scale"]
