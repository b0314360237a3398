"""The flat namespace ``tessellate_ipu`` and ``tessellate_ipu.core`` name under the alias.

Everything TessellateIPU's top-level and ``core`` packages export, from this
package's modules (see :mod:`ipu_jax.tessellate.alias`).
"""

from ipu_jax.tessellate import lax, linalg  # noqa: F401
from ipu_jax.tessellate.barrier import tile_barrier, tile_data_barrier  # noqa: F401
from ipu_jax.tessellate.cycle_count import (ipu_cycle_count, ipu_cycle_count_overhead,  # noqa: F401
                                            ipu_hw_cycle_count)
from ipu_jax.tessellate.device import IpuDevice, IpuTargetType, is_ipu_model  # noqa: F401
from ipu_jax.tessellate.random import tile_random_normal, tile_random_uniform  # noqa: F401
from ipu_jax.tessellate.tile_array import (TileShardedArray,  # noqa: F401
                                           check_tile_array_multi_slice)
from ipu_jax.tessellate.tile_gather import tile_gather  # noqa: F401
from ipu_jax.tessellate.tile_map import tile_map  # noqa: F401
from ipu_jax.tessellate.tile_put import (tile_constant_replicated,  # noqa: F401
                                         tile_constant_sharded, tile_put_replicated,
                                         tile_put_sharded)
from ipu_jax.tessellate.vertex import (create_ipu_tile_primitive,  # noqa: F401
                                       declare_ipu_tile_primitive, register_ipu_tile_primitive)

from ipu_jax.tessellate.equations import *  # noqa: F401,F403  (TessellateIPU's core exports them)
from ipu_jax.tessellate.ipu_types import (from_ipu_type_to_numpy_dtype,  # noqa: F401
                                          from_numpy_dtype_to_ipu_type, get_ipu_type_name,
                                          make_ipu_shaped_array)
from ipu_jax.tessellate.worklists import (make_ipu_vector1d_worker_offsets,  # noqa: F401
                                          make_ipu_vector1d_worker_offsets_and_sizes)

__version__ = "0.1+ipu_jax"
