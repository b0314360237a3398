"""IPU hardware targets for the user: :class:`IPUTarget`, :class:`IPUSystem` and their presets.

The targets are cost figures, so they live on the bottom floor
(:mod:`ipu_jax.kernels.target`); this module is the user's name for them.
"""

from ipu_jax.kernels.systems import SYSTEM_PRESETS, IPUSystem
from ipu_jax.kernels.target import PRESETS, IPUTarget

__all__ = ["IPUTarget", "PRESETS", "IPUSystem", "SYSTEM_PRESETS"]
