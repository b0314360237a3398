"""``popsparse::static_``'s planner cycle figures, written out case by case: a reference.

The emulator prices a static sparse product's on-tile work with vectorised
models (``kernels/popsparse.py``: ``static_product_cycles``,
``static_zero_partials_cycles``). These are the same figures transcribed a
second time, scalar and branch by branch, from poplibs at commit
7eac0f266ced5b064b3284a3cd90d491745b387c, file
``lib/popsparse/StaticMatMulPartitioner.cpp`` (``SMP`` below), so that a test
can hold one against the other:

* ``matmulComputeCycles`` (SMP:195-281): the vertex of one tile, given the
  per-worker work split the planner makes (``tileWorkSplit``, SMP:655-667).
* ``zeroingCycles`` (SMP:183-190) and when the planner charges it
  (SMP:698-703).
* The layout of static_'s result ``out`` (``lib/popsparse/StaticMatMul.cpp``,
  ``SM`` below, SM:543-546: ``[m / b, nPadded, b]`` mapped linearly over all
  tiles in grains of ``nGrainSize * mGrainSize``), into which
  ``popops::reduceMany`` (SM:793) copies or reduces the products, and which the
  emulator's final-output step moves the result to (``output_chunk_elements``).

static_ takes partials of the data type (``options.partialsType = inputType``,
``lib/popsparse/StaticMatMul.cpp:931, 948, 1196, 1239, 1415``); its vertices
exist only as ``<half, half>`` and ``<float, float>``
(``lib/popsparse/codelets/StaticSparseDenseMatMulBlock.cpp:154-159``,
``StaticSparseDenseElementWise.cpp:75-76``).
"""

from __future__ import annotations

_SMP = "poplibs 7eac0f2 lib/popsparse/StaticMatMulPartitioner.cpp"

# Target::getDataPathWidth() of an IPU: 64 bits.
DATA_PATH_WIDTH_BITS = 64


def _ceildiv(a: int, b: int) -> int:
  return -(-a // b)


def matmul_compute_cycles(num_workers: int, m: int, k: int, n: int, block: int,
                          half: bool) -> int:
  """SMP:195-281, ``matmulComputeCycles(target, m, k, n, blockLength, dataType)``.

  ``m``, ``k``, ``n`` are the planner's ``mWorker``, ``kWorker``, ``nWorker``.
  """
  if block == 1:
    if half:
      if n == 4:                                                    # SMP:209-210
        cycles = 31 + m * (7 + (k - 1) * 2)
      elif n == 8:                                                  # SMP:211-212
        cycles = 31 + m * (8 + (k - 1) * 3)
      else:                                                         # SMP:213-215
        cycles = 33 + m * (11 + ((n // 8) * (14 + (k - 1) * 3))
                           + (int(n % 8 != 0) * (9 + (k - 1) * 2)))
    else:
      if n == 2:                                                    # SMP:218-219
        cycles = 29 + m * (5 + (k - 1) * 2)
      elif n == 4:                                                  # SMP:220-221
        cycles = 30 + m * (6 + (k - 1) * 3)
      else:                                                         # SMP:222-224
        cycles = 31 + m * (12 + ((n // 4) * (10 + (k - 1) * 3))
                           + (int(n % 4 != 0) * (10 + (k - 1) * 2)))
    return cycles * num_workers                                     # SMP:227
  if block == 4:
    if half:                                                        # SMP:236-243
      header, x_retained = 17, 1
      y = 7 + n if n <= 2 else 13 + n
    else:                                                           # SMP:244-248
      header, x_retained = 13, 1
      y = 12 + (n - 1) * 4
  elif block == 8:
    if half:                                                        # SMP:250-253
      header, x_retained, y = 13, 1, 14 + (n - 1) * 2
    else:                                                           # SMP:254-257
      header, x_retained, y = 13, 4, 19 + (n - 1) * 8
  elif block == 16:
    if half:                                                        # SMP:260-263
      header, x_retained, y = 13, 1, 19 + (n - 1) * 4
    else:                                                           # SMP:264-271
      header, x_retained = 16, 4
      y = 29 * 2 if n == 1 else (37 + (n - 1) * 8) * 2
  else:
    raise ValueError(f"static_ has no {block}x{block} block vertex")
  type_size = 2 if half else 4
  coeff_load = block * block * type_size // 8                       # SMP:201-204
  return (30 + header * num_workers                                 # SMP:276-278
          + m * (x_retained * num_workers + 17 + k * (16 + coeff_load + y * num_workers)))


def tile_work_split(num_workers: int, m_sparse: int, nz_blocks: int, n: int,
                    block: int) -> tuple:
  """SMP:655-667: ``(mWorker, kWorker, nWorker)`` of a tile's ``nz_blocks`` in ``m_sparse`` rows."""
  if block == 1:
    return _ceildiv(m_sparse, num_workers), _ceildiv(nz_blocks, m_sparse), n
  return m_sparse, _ceildiv(nz_blocks, m_sparse), _ceildiv(n, num_workers)


def tile_vertex_cycles(num_workers: int, m_sparse: int, nz_blocks: int, n: int, block: int,
                       half: bool) -> int:
  """The planner's ``mmComputeCycles`` of a tile (SMP:695-697)."""
  m, k, nw = tile_work_split(num_workers, m_sparse, nz_blocks, n, block)
  return matmul_compute_cycles(num_workers, m, k, nw, block, half)


def zeroing_cycles(num_workers: int, rows: int, n: int, block: int, partials_bytes: int) -> int:
  """SMP:698-703 and SMP:183-190: the planner's ``mmPartialsZeroingCycles``.

  ``rows``: block rows (``mSparse``); none for element-wise, half partials, or
  float partials of 4x4 blocks.
  """
  if block == 1 or partials_bytes == 2 or block == 4:
    return 0
  to_zero = rows * block * n * partials_bytes
  per_worker = _ceildiv(to_zero * 8 // DATA_PATH_WIDTH_BITS, num_workers)
  return (12 + per_worker) * num_workers


def vector_width(type_size: int) -> int:
  """``Target::getVectorWidth(type)``: elements of ``type_size`` bytes in the 64-bit data path."""
  return DATA_PATH_WIDTH_BITS // 8 // type_size


def output_chunk_elements(num_tiles: int, m: int, n: int, block: int, type_size: int) -> int:
  """Elements of static_'s result ``out`` a tile holds (the last tile holding any, fewer).

  SM:543-546: ``nPadded = alignNext(n, nGrainSize)``; ``out`` is ``[m / b, nPadded,
  b]``, ``mapTensorLinearly(graph, out, 0, nGrainSize * mGrainSize)``, with
  ``nGrainSize = getVectorWidth(type)`` (SMP:78-80) and ``mGrainSize`` 1 for
  element-wise, else ``nGrainSize`` (SMP:398-401). poputil's linear mapping
  (``lib/poputil/TileMapping.cpp:80-90`` -> ``splitRegions``,
  ``lib/poputil/Util.cpp:143-147``) gives each tile ``ceil(grains / tiles)`` grains.
  """
  n_grain = vector_width(type_size)
  grain = n_grain if block == 1 else n_grain * n_grain
  n_padded = _ceildiv(n, n_grain) * n_grain
  grains = _ceildiv(m * n_padded, grain)
  return _ceildiv(grains, num_tiles) * grain
