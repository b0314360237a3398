"""Cycles and bytes of PopSparse's on-tile work: sparse x dense block products.

The structure follows poplibs' published estimators for popsparse's
sparse-dense vertices (``lib/popsparse/PerformanceEstimation.hpp``:
``sparseDenseElementwiseMultiply`` for 1x1 "blocks" and
``sparseDenseBlockMultiply`` for the AMP block vertices), as the popsparse
planner calls them (``lib/popsparse/FullyConnectedPlan.cpp``, the on-tile
cost of its ``Forward`` and ``ForwardAMPBlock`` methods). Vocabulary: a
product ``out[X, Z] = S[X, Y] @ D[Y, Z]`` with ``S`` sparse; a tile holds
some non-zero blocks of ``S`` and a column range of ``Z``.

* **Block vertices (4x4, 8x8, 16x16).** The supervisor walks the tile's
  blocks, loading each block's coefficients 64 bits a cycle plus a fixed
  per-block cost; the workers share the ``Z`` columns (``ceil(Z / workers)``
  each) and pay, per block, a fixed inner overhead and then a number of
  cycles per ``Z`` column set by the block's AMP passes (a 16x16 fp16 block
  is one full AMP pass of 4 cycles per column; smaller blocks use the AMP
  partially, so their MACs per cycle are lower). Workers issue round-robin,
  so tile cycles are the busiest worker's times the worker count, plus the
  supervisor's.
* **Element-wise vertex (1x1).** Workers share the non-zeros; each
  non-zero is multiplied into its row's partials ``Z`` columns at a time in
  vectors (3 cycles a vector of 8 halves or 4 floats),
  plus a per-row overhead. There is no AMP: this is why block size pays.
* **Meta-information** (which block row and column each non-zero block is):
  a header per tile, a row entry per non-empty block row and a column entry
  per non-zero block, 16-bit words (an estimate after popsparse's meta-info
  layout; poplibs does not publish its sizes as a formula).
* **Dynamic buckets.** A tile scans each bucket that passes it: the
  sub-groups not for it cost a fixed skip each, the one for it the search
  and the products (``supervisorCyclesWithBucketsNotForPN`` /
  ``...ForPN`` terms of the same estimators; the block vertices' supervisor
  has its own: 33 a skip and 46 + 56 for the sub-group found, against the
  element-wise vertex's 32 and 47 + 46).

Figures are poplibs' where the estimator publishes them and are named in
:data:`ipu_jax.kernels.cost_model.FIGURE_SOURCES` as ``kernels.popsparse.*``.
"""

from __future__ import annotations

import numpy as np

from ipu_jax.kernels.target import IPUTarget

__all__ = ["BLOCK_SIZES", "block_product_cycles", "element_product_cycles",
           "sparse_product_cycles", "meta_info_words", "META_WORD_BYTES",
           "bucket_scan_cycles", "zero_partials_cycles"]

#: Square block sizes PopSparse has vertices for (1 is the element-wise vertex).
BLOCK_SIZES = (1, 4, 8, 16)

# Block AMP vertex (sparseDenseBlockMultiply), keyed by (block, input itemsize):
# worker cycles per Z column of one block, and the inner-loop overhead per
# block (float partials). 16x16 fp32 needs two weight loads per block
# (8 conv units), so its per-column and overhead figures are doubled.
_BLOCK_PER_Z = {(4, 2): 2, (4, 4): 4, (8, 2): 4, (8, 4): 8, (16, 2): 4, (16, 4): 8}
_BLOCK_INNER = {(4, 2): 19, (4, 4): 14, (8, 2): 23, (8, 4): 23, (16, 2): 24, (16, 4): 48}
_BLOCK_WORKER_ENTRY = 26
_BLOCK_SUPERVISOR_ENTRY = 40
# Per block on the supervisor: 3 + 12 per weight load, besides the coefficients.
_BLOCK_SUPERVISOR_PER_BLOCK = 15
_COEFF_BYTES_PER_CYCLE = 8

# Element-wise vertex (sparseDenseElementwiseMultiply): cycles per 64-bit
# vector of Z columns per non-zero, vector width in elements, per-row
# overhead, worker and supervisor entries.
_ELEMENT_CYCLES_PER_VECTOR = 3
_ELEMENT_VECTOR = {2: 8, 4: 4}
_ELEMENT_ROW_OVERHEAD = 13
_ELEMENT_WORKER_ENTRY = 30
_ELEMENT_SUPERVISOR_ENTRY = 30

# Bucket scanning (dynamic sparsity), keyed by vertex kind (element-wise, block):
# skipping a sub-group not for this tile, and finding and starting the one that
# is (one sub-group per bucket: (0 + 1) * 47 + 46 element-wise, (0 + 1) * 46 + 56
# for the block vertices; sparseDenseElementwiseMultiply / sparseDenseBlockMultiply).
_SKIP_SUBGROUP = {False: 32, True: 33}
_FOR_TILE_SUBGROUP = {False: 93, True: 102}

#: Bytes of one meta-information word.
META_WORD_BYTES = 2
# Words of a tile's meta-information header (counts, offsets): an estimate.
_META_HEADER_WORDS = 4


def _ceil(a, b):
  return -(-np.asarray(a, np.int64) // np.asarray(b, np.int64))


def block_product_cycles(target: IPUTarget, blocks, z, block: int, itemsize: int) -> np.ndarray:
  """Cycles of a tile's block-AMP vertex: ``blocks`` ``block x block`` non-zeros times ``z`` columns.

  Args:
    target: the IPU target (worker count).
    blocks: non-zero blocks on the tile (array).
    z: dense columns the tile computes (array, broadcast with ``blocks``).
    block: 4, 8 or 16.
    itemsize: input bytes (2 or 4).
  """
  key = (int(block), 2 if itemsize <= 2 else 4)
  blocks = np.asarray(blocks, np.int64)
  w = target.worker_contexts
  z_worker = _ceil(z, w)
  worker = _BLOCK_WORKER_ENTRY + blocks * (_BLOCK_INNER[key] + z_worker * _BLOCK_PER_Z[key])
  coeff = block * block * key[1] // _COEFF_BYTES_PER_CYCLE
  supervisor = _BLOCK_SUPERVISOR_ENTRY + blocks * (coeff + _BLOCK_SUPERVISOR_PER_BLOCK)
  return np.where(blocks > 0, worker * w + supervisor, 0).astype(np.float64)


def element_product_cycles(target: IPUTarget, nonzeros, rows, z, itemsize: int) -> np.ndarray:
  """Cycles of a tile's element-wise vertex: ``nonzeros`` in ``rows`` rows times ``z`` columns."""
  nonzeros = np.asarray(nonzeros, np.int64)
  rows = np.asarray(rows, np.int64)
  w = target.worker_contexts
  vector = _ELEMENT_VECTOR[2 if itemsize <= 2 else 4]
  per_nonzero = _ELEMENT_CYCLES_PER_VECTOR * _ceil(z, vector)
  worker = (_ELEMENT_WORKER_ENTRY + _ceil(rows, w) * _ELEMENT_ROW_OVERHEAD
            + _ceil(nonzeros, w) * per_nonzero)
  return np.where(nonzeros > 0, worker * w + _ELEMENT_SUPERVISOR_ENTRY, 0).astype(np.float64)


def sparse_product_cycles(target: IPUTarget, blocks, rows, z, block: int,
                          itemsize: int) -> np.ndarray:
  """A tile's sparse x dense vertex, element-wise for ``block == 1`` else the block AMP one.

  ``rows``: block rows holding those blocks (the element-wise vertex's rows).
  """
  if int(block) == 1:
    return element_product_cycles(target, blocks, rows, z, itemsize)
  return block_product_cycles(target, blocks, z, block, itemsize)


def meta_info_words(blocks, rows) -> np.ndarray:
  """16-bit words of a tile's meta-information: header, one per block row, one per block."""
  blocks = np.asarray(blocks, np.int64)
  rows = np.asarray(rows, np.int64)
  return np.where(blocks > 0, _META_HEADER_WORDS + 2 * rows + blocks, 0)


def bucket_scan_cycles(buckets_seen, buckets_for_tile, block: int = 1) -> np.ndarray:
  """Supervisor cycles of scanning buckets: skips plus the ones holding this tile's work.

  ``block``: 1 for the element-wise vertex, else a block vertex (whose
  supervisor walks a bucket's sub-groups with its own figures).
  """
  seen = np.asarray(buckets_seen, np.int64)
  mine = np.asarray(buckets_for_tile, np.int64)
  kind = int(block) > 1
  return ((seen - mine) * _SKIP_SUBGROUP[kind]
          + mine * _FOR_TILE_SUBGROUP[kind]).astype(np.float64)


def zero_partials_cycles(target: IPUTarget, elements, p_itemsize: int) -> np.ndarray:
  """Zeroing a tile's partials before the products: 64-bit stores split over workers."""
  elements = np.asarray(elements, np.int64)
  per_vector = 8 // int(p_itemsize)
  return np.where(elements > 0, 10 + _ceil(_ceil(elements, per_vector), target.worker_contexts)
                  * target.worker_contexts, 0).astype(np.float64)
