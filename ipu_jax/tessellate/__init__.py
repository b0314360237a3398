"""The TessellateIPU API on the emulated IPU (``ipu_jax.tessellate``).

TessellateIPU (graphcore-research/tessellate-ipu) programs the IPU tile by
tile from JAX: arrays sharded over tiles (:class:`TileShardedArray`), placed
with :func:`tile_put_sharded` / :func:`tile_put_replicated` /
:func:`tile_gather`, computed with :func:`tile_map` (one vertex per tile: a
JAX primitive or a vertex primitive from :func:`create_ipu_tile_primitive`),
measured with :func:`ipu_cycle_count`. Here those functions build
``ipu_jax.jit`` tile programs, priced per tile. ``install_alias()`` makes
``import tessellate_ipu`` resolve to this package (docs/tessellate.md).
"""

from ipu_jax.tessellate.tile_array import TileShardedArray, check_tile_array_multi_slice
from ipu_jax.tessellate.tile_put import (tile_constant_replicated, tile_constant_sharded,
                                         tile_put_replicated, tile_put_sharded)
from ipu_jax.tessellate.tile_gather import tile_gather
from ipu_jax.tessellate.barrier import tile_barrier, tile_data_barrier
from ipu_jax.tessellate.tile_map import tile_map
from ipu_jax.tessellate.vertex import (create_ipu_tile_primitive, declare_ipu_tile_primitive,
                                       register_ipu_tile_primitive)
from ipu_jax.tessellate.cycle_count import ipu_cycle_count, ipu_cycle_count_overhead
from ipu_jax.tessellate.random import (tile_get_hw_seeds, tile_random_normal,
                                       tile_random_uniform, tile_set_hw_seeds)
from ipu_jax.tessellate import linalg
from ipu_jax.tessellate.alias import install_alias

__all__ = [
    "TileShardedArray", "check_tile_array_multi_slice", "tile_put_sharded",
    "tile_put_replicated", "tile_constant_sharded", "tile_constant_replicated", "tile_gather",
    "tile_data_barrier", "tile_barrier", "tile_map", "create_ipu_tile_primitive",
    "declare_ipu_tile_primitive", "register_ipu_tile_primitive", "ipu_cycle_count",
    "ipu_cycle_count_overhead", "tile_random_uniform", "tile_random_normal",
    "tile_get_hw_seeds", "tile_set_hw_seeds", "linalg", "install_alias",
]
