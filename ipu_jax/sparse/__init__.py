"""PopSparse on the emulated IPU: block-sparse formats and sparse matmuls.

* :class:`BlockCSR`: a block-sparse matrix (CSR of ``bm x bk`` blocks, 1x1,
  4x4, 8x8 or 16x16), a pytree whose pattern is static and whose values are
  its leaf.
* :func:`static_matmul`: sparse x dense or dense x sparse with the pattern
  known when lowering (``popsparse::static_``).
* :func:`dynamic_matmul`: sparse x dense with the pattern known only at run
  time, up to ``max_non_zeros`` blocks (``popsparse::dynamic``): a
  :class:`DynamicLayout` (:func:`dynamic_layout`) sizes the buckets,
  :func:`encode` deals a pattern into them on the host.
"""

import os as _os

from ipu_jax.lowering.jax_compat import source_info_util as _source_info_util
_source_info_util.register_exclusion(_os.path.dirname(__file__))

from ipu_jax.sparse.formats import BlockCSR, SparsityPattern

__all__ = ["BlockCSR", "SparsityPattern"]
from ipu_jax.sparse.static import static_matmul, static_sparse_matmul_p
from ipu_jax.sparse import static_rule as _static_rule  # registers the tile rule

__all__ += ["static_matmul", "static_sparse_matmul_p"]
from ipu_jax.sparse.buckets import (BucketOverflowError, DynamicLayout, DynamicSparse,
                                    dynamic_layout, encode)
from ipu_jax.sparse.dynamic import dynamic_matmul, dynamic_sparse_matmul_p
from ipu_jax.sparse import dynamic_rule as _dynamic_rule  # registers the tile rule

__all__ += ["BucketOverflowError", "DynamicLayout", "DynamicSparse", "dynamic_layout", "encode",
            "dynamic_matmul", "dynamic_sparse_matmul_p"]
