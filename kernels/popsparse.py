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
* **Static vertices** (``popsparse::static_``: ``StaticSparseDenseMatMulBlock``
  4x4 / 8x8 / 16x16 and ``StaticSparseDenseElementWise``, data and partials
  of one type, ``lib/popsparse/codelets/StaticSparseDenseMatMulBlock.cpp:154-159``,
  ``StaticSparseDenseElementWise.cpp:75-76``). Priced with static_'s own
  planner figures (``lib/popsparse/StaticMatMulPartitioner.cpp``,
  ``matmulComputeCycles`` and ``zeroingCycles``, poplibs commit 7eac0f26), on
  the work split its planner uses (``tileWorkSplit``, same file): the block
  vertex runs every row of the tile on every worker with ``Z / workers``
  columns each; the element-wise one splits the rows over the workers. The
  static block vertex zeroes its half partials as it goes, so only float
  partials of 8x8 and 16x16 blocks pay a zeroing pass.
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
           "bucket_scan_cycles", "zero_partials_cycles", "static_block_product_cycles",
           "static_element_product_cycles", "static_product_cycles",
           "static_zero_partials_cycles", "static_output_grain", "static_output_chunk"]

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


# -- popsparse::static_'s own vertices -------------------------------------------
# poplibs lib/popsparse/StaticMatMulPartitioner.cpp (commit 7eac0f26), matmulComputeCycles.
# Block vertices, keyed by (block, input itemsize): headerRetainedCycles,
# xRetainedCycles (both per worker) and yCycles(n) per block per worker for n
# columns a worker (lines 235-272).
_STATIC_HEADER = {(4, 2): 17, (4, 4): 13, (8, 2): 13, (8, 4): 13, (16, 2): 13, (16, 4): 16}
_STATIC_X_RETAINED = {(4, 2): 1, (4, 4): 1, (8, 2): 1, (8, 4): 4, (16, 2): 1, (16, 4): 4}
# Lines 276-278: 30 on entry, per row 17 (besides xRetained), per block 16 plus
# the coefficients' load at 8 bytes a cycle (cweiLoadBytesPerCycle, line 201).
_STATIC_ENTRY = 30
_STATIC_PER_ROW = 17
_STATIC_PER_BLOCK = 16
_STATIC_COEFF_BYTES_PER_CYCLE = 8


def _static_y_cycles(n, key) -> np.ndarray:
  """yCycles: a block's cycles on one worker with ``n`` columns (lines 235-272)."""
  n = np.asarray(n, np.int64)
  if key == (4, 2):
    return np.where(n <= 2, 7 + n, 13 + n)               # lines 239-243
  if key == (4, 4):
    return 12 + (n - 1) * 4                               # line 247
  if key == (8, 2):
    return 14 + (n - 1) * 2                               # line 253
  if key == (8, 4):
    return 19 + (n - 1) * 8                               # line 257
  if key == (16, 2):
    return 19 + (n - 1) * 4                               # line 263
  return np.where(n == 1, 29 * 2, (37 + (n - 1) * 8) * 2)  # lines 267-271 (16x16 float)


def static_block_product_cycles(target: IPUTarget, rows, blocks, z, block: int,
                                itemsize: int) -> np.ndarray:
  """Cycles of ``StaticSparseDenseMatMulBlock``: ``blocks`` in ``rows`` block rows times ``z``.

  As static_'s planner splits a tile's work (``tileWorkSplit``): every worker
  walks all ``rows`` with ``ceil(blocks / rows)`` blocks each and
  ``ceil(z / workers)`` columns (StaticMatMulPartitioner.cpp:661-663), then
  ``matmulComputeCycles`` (lines 276-278).

  Args:
    target: the IPU target (worker count).
    rows: non-empty block rows on the tile (array).
    blocks: non-zero blocks on the tile (array, broadcast with ``rows``).
    z: dense columns the tile computes (array).
    block: 4, 8 or 16.
    itemsize: input bytes (2 or 4); partials are of the same type.
  """
  key = (int(block), 2 if itemsize <= 2 else 4)
  w = target.worker_contexts
  blocks = np.asarray(blocks, np.int64)
  rows = np.maximum(np.asarray(rows, np.int64), 1)
  per_row = _ceil(blocks, rows)
  n = np.maximum(_ceil(z, w), 1)
  coeff = block * block * key[1] // _STATIC_COEFF_BYTES_PER_CYCLE
  cycles = (_STATIC_ENTRY + _STATIC_HEADER[key] * w
            + rows * (_STATIC_X_RETAINED[key] * w + _STATIC_PER_ROW
                      + per_row * (_STATIC_PER_BLOCK + coeff + _static_y_cycles(n, key) * w)))
  return np.where((blocks > 0) & (np.asarray(z) > 0), cycles, 0).astype(np.float64)


def _static_element_worker(m, k, n, itemsize: int) -> np.ndarray:
  """One worker's cycles for ``m`` rows of ``k`` non-zeros times ``n`` columns (lines 206-226)."""
  if itemsize <= 2:
    general = 33 + m * (11 + (n // 8) * (14 + (k - 1) * 3)
                        + (n % 8 != 0) * (9 + (k - 1) * 2))   # lines 213-215
    return np.select([n == 4, n == 8],
                     [31 + m * (7 + (k - 1) * 2),            # line 210
                      31 + m * (8 + (k - 1) * 3)], general)  # line 212
  general = 31 + m * (12 + (n // 4) * (10 + (k - 1) * 3)
                      + (n % 4 != 0) * (10 + (k - 1) * 2))     # lines 223-224
  return np.select([n == 2, n == 4],
                   [29 + m * (5 + (k - 1) * 2),              # line 219
                    30 + m * (6 + (k - 1) * 3)], general)    # line 221


def static_element_product_cycles(target: IPUTarget, nonzeros, rows, z,
                                  itemsize: int) -> np.ndarray:
  """Cycles of ``StaticSparseDenseElementWise``: ``nonzeros`` in ``rows`` rows times ``z`` columns.

  static_'s planner gives each worker ``ceil(rows / workers)`` rows of
  ``ceil(nonzeros / rows)`` non-zeros over all ``z`` columns
  (StaticMatMulPartitioner.cpp:657-659) and counts every worker alike
  (``cycles *= numWorkers``, line 227).
  """
  w = target.worker_contexts
  nonzeros = np.asarray(nonzeros, np.int64)
  rows = np.maximum(np.asarray(rows, np.int64), 1)
  m = _ceil(rows, w)
  k = _ceil(nonzeros, rows)
  n = np.asarray(z, np.int64)
  cycles = _static_element_worker(m, k, n, itemsize) * w
  return np.where((nonzeros > 0) & (n > 0), cycles, 0).astype(np.float64)


def static_product_cycles(target: IPUTarget, blocks, rows, z, block: int,
                          itemsize: int) -> np.ndarray:
  """A tile's ``popsparse::static_`` vertex: element-wise for ``block == 1``, else the block one.

  Same arguments as :func:`sparse_product_cycles` (``rows``: the tile's
  non-empty block rows).
  """
  if int(block) == 1:
    return static_element_product_cycles(target, blocks, rows, z, itemsize)
  return static_block_product_cycles(target, rows, blocks, z, block, itemsize)


# zeroingCycles (StaticMatMulPartitioner.cpp:183-190): 12 per worker, then the
# partials' bytes over the 64-bit data path (Target::getDataPathWidth) split over the workers.
_STATIC_ZERO_ENTRY = 12
_DATA_PATH_BYTES = 8


def static_zero_partials_cycles(target: IPUTarget, elements, block: int,
                                p_itemsize: int) -> np.ndarray:
  """Zeroing a static product's partials (``elements`` of ``p_itemsize`` bytes) before its vertex.

  static_'s planner charges none for the element-wise vertex, for half
  partials and for float partials of 4x4 blocks (those vertices zero as they
  write, StaticMatMulPartitioner.cpp:698-703); else ``zeroingCycles``.
  """
  elements = np.asarray(elements, np.int64)
  if int(block) == 1 or int(p_itemsize) <= 2 or int(block) == 4:
    return np.zeros(elements.shape, np.float64)
  w = target.worker_contexts
  # bytes * 8 / dataPathWidth rounds down before the split over workers (line 187).
  per_worker = _ceil(elements * int(p_itemsize) // _DATA_PATH_BYTES, w)
  return np.where(elements > 0, (_STATIC_ZERO_ENTRY + per_worker) * w, 0).astype(np.float64)


def static_output_grain(target: IPUTarget, itemsize: int, block: int) -> int:
  """Elements per grain of ``popsparse::static_``'s result layout.

  static_ maps its result ``out`` linearly over the tiles in grains of
  ``nGrainSize * mGrainSize`` elements (``lib/popsparse/StaticMatMul.cpp:543-546``):
  ``nGrainSize`` is the type's vector width (``getNGrainSize``,
  ``StaticMatMulPartitioner.cpp:78-80``: 4 halves or 2 floats in 64 bits) and
  ``mGrainSize`` is 1 for the element-wise vertex, else the same
  (``getMGrainSize``, ``StaticMatMulPartitioner.cpp:398-401``).
  """
  vector = max(int(target.vector_width_bytes) // int(itemsize), 1)
  return vector if int(block) == 1 else vector * vector


def static_output_chunk(target: IPUTarget, rows: int, columns: int, itemsize: int,
                        block: int) -> int:
  """Elements of ``popsparse::static_``'s ``[rows, columns]`` result on each tile (the last less).

  ``poputil::mapTensorLinearly`` gives each tile ``ceil(grains / tiles)`` grains
  (``lib/poputil/Util.cpp:143-147``) of the result padded to whole column
  grains (``nPadded``, ``StaticMatMul.cpp:543``).
  """
  grain = static_output_grain(target, itemsize, block)
  vector = max(int(target.vector_width_bytes) // int(itemsize), 1)
  padded = int(rows) * int(_ceil(columns, vector)) * vector
  grains = int(_ceil(padded, grain))
  return int(_ceil(grains, target.num_tiles)) * grain
