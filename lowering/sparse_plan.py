"""Planning sparse x dense products over tiles, as PopSparse's planners do.

Vocabulary (popsparse's): the product is ``out[X, Z] = S[X, Y] @ D[Y, Z]``,
``S`` block-sparse with ``b x b`` blocks (``Xb = X / b`` block rows, ``Yb``
block columns), ``D`` dense. A dense x sparse product is planned as its
transpose (``out^T = S^T @ D^T``), so one planner serves both.

**Partition.** A grid of ``px * py * pz`` tiles: ``X`` is cut into ``px``
bands of whole block rows, ``Y`` into ``py`` bands of whole block columns and
``Z`` into ``pz`` column ranges. Tile ``(x, y, z)`` holds the non-zero blocks
of cell ``(x, y)``, receives ``D``'s rows of band ``y`` and columns of range
``z``, and computes the partial ``out[x band, z range]`` of band ``y``. When
``py > 1`` the ``py`` partials of each ``(x, z)`` are then reduce-scattered:
each of the cell's ``py`` tiles sums one piece (``lib/popsparse``'s static
and fully-connected planners have the same X/Y/Z partitions and a partials
reduction across Y).
A static product's result then moves to ``popsparse::static_``'s layout
(linear over all tiles; :func:`static_output_cycles`), once per product.

**Choice.** As poplibs' planner does (``FullyConnectedPlan.cpp``), the grid
is chosen on a *uniform* pattern of the same density: every cell holds
``nnz * (rows / Xb) * (cols / Yb)`` blocks. Each candidate is costed from the
vertex work (:mod:`ipu_jax.kernels.popsparse`: block AMP or element-wise
products, zeroing partials; a static plan with ``popsparse::static_``'s own
vertices and its partials type, :func:`static_partials_dtype`), the exchange of ``D``'s slices and of the
sparse blocks to the ``z > 0`` tiles, the reduction (``popops`` Reduce
vertices) and the syncs; candidates whose temporaries exceed the available
memory proportion of a tile are dropped (the least-memory one is kept if
none fits). The lowering then costs the chosen grid on the real pattern.

**Rotating static plan.** A second kind of static candidate, for grids with
``pz > 1``: instead of copying each cell's blocks to all of its ``pz`` tiles,
the cell's blocks are cut into ``pz`` groups of (within one) equal counts,
group ``j`` placed once on tile ``(x, y, j)`` with its own meta-information,
and the groups rotate along Z in ``pz`` supersteps (two buffers per tile),
as dynamic's buckets do in its propagation phase: at step ``s`` tile
``(x, y, z)`` multiplies group ``(z + s) % pz`` into its partials. Unlike a
bucket, a group holds exactly its cell's blocks (no oversize, no other
cells' entries to scan, no spill phase) and its meta-information is exact.
It trades ``pz - 1`` more syncs and per-step vertex overheads for
``1 / pz`` of the replicated plan's block memory and block exchange; both
kinds are costed and the cheaper fitting one chosen.

When no replicated grid fits, a static product may be split into serial
passes over Z (each pass a grid over ``z / passes`` columns, passes of equal
width, run one after another, cycles summed), as poplin serialises matmuls;
the cheapest fitting plan among the one-pass ones (a rotating plan may fit)
and the serial ones is taken.

**Dynamic sparsity** (:func:`plan_dynamic`): the pattern is not known, only
``max_non_zeros``. The same grid; every tile holds a *bucket* of
``ceil(max_nnz / tiles * (1 + oversize))`` blocks with their meta-information.
A cell's non-zeros are dealt over the buckets of its ``pz`` tiles; the
buckets rotate ``pz`` times along Z so each tile meets all of its cell's
(propagation phase 1). What a cell's buckets cannot hold goes forward along
the ring of cells to the first free room, so any pattern of at most
``max_nnz`` blocks fits; at run time the program runs one more phase per
cell the farthest spill moved (buckets moved one cell on, then rotated along
Z), as PopSparse's propagation loop runs as far as its partitioner's
overflow information says. Each step exchanges whole buckets (two buffers
per tile) and scans them. The estimate (as PopSparse's planner, on a uniform
pattern) counts phase 1 and, when there is more than one cell, one further
phase that scans and skips; :attr:`SparsePlan.phase_cycles` is what each
further phase adds.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ipu_jax.kernels import estimators
from ipu_jax.kernels import popsparse
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.matmul_cost import split_candidates
from ipu_jax.lowering.matmul_plan import partials_dtype as _partials_rule

__all__ = ["SparsePlan", "plan_static", "plan_dynamic", "bucket_capacity", "DEFAULT_OVERSIZE",
           "reduce_piece_elements", "static_partials_dtype", "static_output_cycles"]

#: Extra bucket room over a uniform spread of ``max_non_zeros`` (popsparse's default).
DEFAULT_OVERSIZE = 0.3
# Bytes of a bucket entry's meta-information: its block row and column (16-bit words each).
_ENTRY_META_WORDS = 2
# Split counts tried per axis.
_MAX_CANDIDATES = 32


def _ceil(a, b):
  return -(-np.asarray(a, np.int64) // np.maximum(np.asarray(b, np.int64), 1))


@dataclasses.dataclass(frozen=True)
class SparsePlan:
  """How a sparse x dense product is cut over tiles (see the module docstring).

  Attributes:
    x, y, z: the product's sizes in elements (``S`` is ``[x, y]``, ``D`` ``[y, z]``).
    block: the block size ``b``.
    dtype, partials_dtype: operand and partials type names.
    grid: ``(px, py, pz)``.
    band: ``(block rows per X band, block columns per Y band, Z columns per range)``.
    compute_cycles, exchange_cycles, reduce_cycles, sync_cycles: the estimate
      on a uniform pattern (the lowering re-costs the real one).
    output_cycles: moving the result to its final layout (static only: once per
      product, after the last pass; :func:`static_output_cycles`).
    temp_bytes: temporaries per tile; memory_limit: what the proportion allows.
    fits: whether ``temp_bytes <= memory_limit``.
    candidates: grids evaluated.
    dynamic: buckets and propagation (dynamic sparsity) or a fixed pattern.
    bucket_blocks: blocks a bucket holds (dynamic only).
    phases: propagation phases costed (dynamic only): 1, or 2 when the grid has
      more than one cell (phase 1 and one run-time phase).
    phase_cycles: cycles of one run-time propagation phase (dynamic only): ``pz``
      bucket exchanges, skips of a bucket scan and syncs.
  """

  x: int
  y: int
  z: int
  block: int
  dtype: str
  partials_dtype: str
  grid: tuple
  band: tuple
  compute_cycles: float
  exchange_cycles: float
  reduce_cycles: float
  sync_cycles: float
  temp_bytes: int
  memory_limit: int
  fits: bool
  candidates: int
  dynamic: bool = False
  bucket_blocks: int = 0
  phases: int = 0
  phase_cycles: float = 0.0
  serial: int = 1
  rotate: bool = False
  output_cycles: float = 0.0

  @property
  def pass_z(self) -> int:
    """Dense columns of one serial pass (the last may be narrower)."""
    return -(-self.z // self.serial)

  @property
  def num_tiles(self) -> int:
    px, py, pz = self.grid
    return px * py * pz

  @property
  def cycles(self) -> float:
    return (self.compute_cycles + self.exchange_cycles + self.reduce_cycles + self.sync_cycles
            + self.output_cycles)

  @property
  def steps(self) -> int:
    """Propagation steps (dynamic): ``pz`` per phase."""
    if self.dynamic:
      return self.grid[2] * self.phases
    return self.grid[2] if self.rotate else 1

  def describe(self) -> str:
    px, py, pz = self.grid
    kind = (f"dynamic, buckets of {self.bucket_blocks} blocks, {self.phases} propagation "
            f"phase(s) of {pz} step(s) costed, {self.phase_cycles:,.0f} cycles per further "
            f"phase a pattern's spills need" if self.dynamic
            else f"static, block groups rotating in {pz} steps" if self.rotate else "static")
    serial = f" in {self.serial} serial passes over Z" if self.serial > 1 else ""
    return (f"sparse [{self.x}x{self.y}] x dense [{self.y}x{self.z}] {self.dtype} block "
            f"{self.block} ({kind}): grid x{px}.y{py}.z{pz}{serial}; cycles {self.cycles:,.0f} = compute "
            f"{self.compute_cycles:,.0f} + exchange {self.exchange_cycles:,.0f} + reduce "
            f"{self.reduce_cycles:,.0f} + sync {self.sync_cycles:,.0f}"
            f"{f' + final output {self.output_cycles:,.0f}' if self.output_cycles else ''}; temporaries "
            f"{self.temp_bytes:,d} B per tile of {self.memory_limit:,d} B"
            f"{'' if self.fits else ' (does not fit)'}.")


def _axis_candidates(extent: int, limit: int) -> np.ndarray:
  """Split counts worth trying for an axis of ``extent`` units (the matmul planner's)."""
  return split_candidates(max(int(extent), 1), max(int(limit), 1), budget=_MAX_CANDIDATES)


def _candidates(target, xb, yb, z, max_tiles):
  grids = np.meshgrid(_axis_candidates(xb, max_tiles), _axis_candidates(yb, max_tiles),
                      _axis_candidates(z, max_tiles), indexing="ij")
  px, py, pz = (g.reshape(-1) for g in grids)
  keep = px * py * pz <= max_tiles
  return px[keep], py[keep], pz[keep]


def _exchange_cycles(target: IPUTarget, nbytes) -> np.ndarray:
  nbytes = np.asarray(nbytes, np.float64)
  return np.where(nbytes > 0, nbytes / target.exchange_bytes_per_cycle
                  + target.exchange_latency_cycles, 0.0)


def reduce_piece_elements(region_elements, py) -> np.ndarray:
  """Elements of the largest piece when a region's ``py`` partials are reduce-scattered."""
  return _ceil(region_elements, py)


def _reduce_cost(target, region, py, p_itemsize, out_itemsize):
  """Cycles and bytes per tile of reduce-scattering ``py`` partials of ``region`` elements."""
  piece = reduce_piece_elements(region, py)
  received = (py - 1) * piece * p_itemsize
  cycles = (target.sync_cycles_internal + _exchange_cycles(target, received)
            + estimators.reduce_cycles(target, py * piece, p_itemsize, outputs=piece))
  cycles = np.where(py > 1, cycles, 0.0)
  temp = np.where(py > 1, py * piece * p_itemsize + piece * out_itemsize, 0)
  return cycles, temp


@dataclasses.dataclass(frozen=True)
class _Shape:
  x: int
  y: int
  z: int
  block: int
  itemsize: int
  p_itemsize: int

  @property
  def xb(self) -> int:
    return self.x // self.block

  @property
  def yb(self) -> int:
    return self.y // self.block


def _bands(s: _Shape, px, py, pz):
  rx, cy, fz = _ceil(s.xb, px), _ceil(s.yb, py), _ceil(s.z, pz)
  return rx, cy, fz


def _static_costs(target, s: _Shape, nnz: int, px, py, pz, rotate: bool = False) -> dict:
  """Per-candidate costs of a static plan on a uniform pattern of ``nnz`` blocks.

  ``rotate``: the rotating plan (a cell's blocks in ``pz`` groups passed along Z)
  instead of the replicated one (every Z tile receives all of its cell's blocks).
  """
  rx, cy, fz = _bands(s, px, py, pz)
  cells = max(s.xb * s.yb, 1)
  blocks = _ceil(nnz * rx * cy, cells)
  b, item = s.block, s.itemsize
  partial = rx * b * fz
  # popsparse::static_'s own vertices and zeroing rule (kernels/popsparse.py).
  zero = popsparse.static_zero_partials_cycles(target, partial, b, s.p_itemsize)
  dense_in = cy * b * fz * item
  reduce, reduce_temp = _reduce_cost(target, partial, py, s.p_itemsize, item)
  if rotate:
    # Each step a group of a pz-th of the cell's blocks, with its own meta-information.
    group = _ceil(blocks, pz)
    g_rows = np.minimum(rx, group)
    g_bytes = (group * b * b * item
               + popsparse.meta_info_words(group, g_rows) * popsparse.META_WORD_BYTES)
    compute = pz * popsparse.static_product_cycles(target, group, g_rows, fz, b, item) + zero
    exchange = (_exchange_cycles(target, dense_in)
                + (pz - 1) * _exchange_cycles(target, g_bytes))
    temp = np.maximum(dense_in + 2 * g_bytes + partial * s.p_itemsize, reduce_temp)
    sync = pz * float(target.sync_cycles_internal)
  else:
    rows = np.minimum(rx, blocks)
    compute = popsparse.static_product_cycles(target, blocks, rows, fz, b, item) + zero
    block_bytes = blocks * b * b * item
    exchange = _exchange_cycles(target, dense_in + np.where(pz > 1, block_bytes, 0))
    meta = popsparse.meta_info_words(blocks, rows) * popsparse.META_WORD_BYTES
    temp = np.maximum(dense_in + np.where(pz > 1, block_bytes, 0) + partial * s.p_itemsize
                      + meta, reduce_temp)
    sync = float(target.sync_cycles_internal)
  return dict(compute=compute, exchange=exchange, reduce=reduce,
              sync=np.broadcast_to(np.asarray(sync, np.float64), px.shape), temp=temp,
              rotate=np.full(px.shape, rotate),
              output=np.full(px.shape, static_output_cycles(target, s.x, s.z, s.block, s.itemsize)))


def static_output_cycles(target: IPUTarget, x: int, z: int, block: int, itemsize: int) -> float:
  """The superstep moving a static product's ``[x, z]`` result to ``popsparse::static_``'s layout.

  static_ writes its result into ``out``, mapped linearly over all the tiles
  (``lib/popsparse/StaticMatMul.cpp:543-546``), through ``popops::reduceMany``
  (``StaticMatMul.cpp:793``), which copies a single band's partials there
  (``lib/popops/reduction/Reduction.cpp:707-713``) or reduces into it; the
  emulator reduces onto the grid and then copies. On a uniform pattern each
  tile receives its whole chunk of the result (an estimate: what already lies
  on the tile is not subtracted): a sync and that chunk's exchange, the same
  for every grid.
  """
  chunk = popsparse.static_output_chunk(target, x, z, itemsize, block)
  return float(target.sync_cycles_internal + _exchange_cycles(target, chunk * itemsize))


def _static_candidates(target, s: _Shape, nnz: int, px, py, pz, rotate=None) -> tuple:
  """Both static plan kinds over the grids (rotating ones only where ``pz > 1``), or
  only one kind when ``rotate`` is a bool (and it has a candidate)."""
  flat = _static_costs(target, s, nnz, px, py, pz)
  turn = pz > 1
  if rotate is False or (rotate and not turn.any()):
    return (px, py, pz), flat
  grids = (px[turn], py[turn], pz[turn])
  rotating = _static_costs(target, s, nnz, *grids, rotate=True)
  if rotate:
    return grids, rotating
  costs = {k: np.concatenate([flat[k], rotating[k]]) for k in flat}
  return tuple(np.concatenate([a, b]) for a, b in zip((px, py, pz), grids)), costs


def bucket_capacity(max_nnz: int, tiles: int, oversize: float) -> int:
  """Blocks a bucket holds: a uniform spread of ``max_nnz`` over ``tiles`` plus the oversize."""
  if max_nnz <= 0:
    return 0
  return int(np.ceil(max_nnz / tiles * (1.0 + oversize)))


def _run_time_phases(px, py):
  """1 when the grid has more than one cell (a propagation ring), else 0."""
  return np.where(px * py > 1, 1, 0)


def _dynamic_costs(target, s: _Shape, max_nnz: int, oversize: float, px, py, pz) -> dict:
  """Per-candidate costs of a dynamic plan for ``max_nnz`` blocks."""
  rx, cy, fz = _bands(s, px, py, pz)
  tiles = px * py * pz
  cap = np.ceil(max_nnz / tiles * (1.0 + oversize)).astype(np.int64)
  b, item = s.block, s.itemsize
  # A full bucket's share for this tile: a cell's non-zeros over its pz buckets.
  per_step = _ceil(max_nnz * rx * cy, max(s.xb * s.yb, 1) * pz)
  rows = np.minimum(rx, per_step)
  phases = 1 + _run_time_phases(px, py)
  steps = pz * phases
  bucket_bytes = cap * (b * b * item + _ENTRY_META_WORDS * popsparse.META_WORD_BYTES)
  partial = rx * b * fz
  # Phase 1 multiplies the cell's entries; the run-time phase costed only scans
  # (a uniform pattern spills nothing) but still moves and scans every bucket.
  work = popsparse.sparse_product_cycles(target, per_step, rows, fz, b, item)
  scan = popsparse.bucket_scan_cycles(1, 1, b)
  skip = popsparse.bucket_scan_cycles(1, 0, b)
  compute = (pz * (work + scan) + (phases - 1) * pz * skip
             + popsparse.zero_partials_cycles(target, partial, s.p_itemsize))
  dense_in = cy * b * fz * item
  exchange = _exchange_cycles(target, dense_in) + (steps - 1) * _exchange_cycles(target,
                                                                                 bucket_bytes)
  reduce, reduce_temp = _reduce_cost(target, partial, py, s.p_itemsize, item)
  temp = np.maximum(2 * bucket_bytes + dense_in + partial * s.p_itemsize, reduce_temp)
  sync = steps * float(target.sync_cycles_internal)
  # One run-time phase: pz steps, each a bucket exchange, a scan that skips, a sync.
  phase = _run_time_phases(px, py) * pz * (skip + _exchange_cycles(target, bucket_bytes)
                                           + target.sync_cycles_internal)
  return dict(compute=compute, exchange=exchange, reduce=reduce, sync=sync, temp=temp, cap=cap,
              phases=phases, phase=phase)


def _choose(costs: dict, limit: int) -> int:
  total = (costs["compute"] + costs["exchange"] + costs["reduce"] + costs["sync"]
           + costs.get("output", 0.0))
  fits = costs["temp"] <= limit
  if fits.any():
    return int(np.argmin(np.where(fits, total, np.inf)))
  return int(np.argmin(costs["temp"]))


# Serial pass counts tried when no single-pass static grid fits.
_SERIAL_COUNTS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _plan(target, s: _Shape, dtype, partials_dtype, nnz, proportion, max_tiles, dynamic,
          oversize, rotate=None) -> SparsePlan:
  plan = _plan_pass(target, s, dtype, partials_dtype, nnz, proportion, max_tiles, dynamic,
                    oversize, rotate)
  if dynamic or (plan.fits and not plan.rotate):
    return plan
  # A rotating one-pass plan may fit where a replicated one does not, at many
  # steps' cost: weigh it against serial passes (each pass either kind).
  serial = [_serial_plan(target, s, dtype, partials_dtype, nnz, proportion, max_tiles, rotate,
                         count) for count in _SERIAL_COUNTS if s.z % count == 0]
  fitting = [p for p in [plan] + serial if p.fits]
  return min(fitting, key=lambda p: p.cycles) if fitting else plan


def _serial_plan(target, s: _Shape, dtype, partials_dtype, nnz, proportion, max_tiles, rotate,
                 count) -> SparsePlan:
  """``count`` equal serial passes over Z (each tile then holds one equal piece per pass)."""
  passed = _plan_pass(target, dataclasses.replace(s, z=s.z // count), dtype, partials_dtype, nnz,
                      proportion, max_tiles, False, 0.0, rotate)
  return dataclasses.replace(
      passed, z=s.z, serial=count, compute_cycles=passed.compute_cycles * count,
      exchange_cycles=passed.exchange_cycles * count,
      reduce_cycles=passed.reduce_cycles * count, sync_cycles=passed.sync_cycles * count,
      output_cycles=static_output_cycles(target, s.x, s.z, s.block, s.itemsize))  # once, whole result


def _plan_pass(target, s: _Shape, dtype, partials_dtype, nnz, proportion, max_tiles, dynamic,
               oversize, rotate=None) -> SparsePlan:
  limit = int(proportion * target.bytes_per_tile)
  tiles = max(1, min(int(max_tiles), target.num_tiles))
  px, py, pz = _candidates(target, s.xb, s.yb, s.z, tiles)
  if dynamic:
    costs = _dynamic_costs(target, s, nnz, oversize, px, py, pz)
  else:
    (px, py, pz), costs = _static_candidates(target, s, nnz, px, py, pz, rotate)
  i = _choose(costs, limit)
  grid = (int(px[i]), int(py[i]), int(pz[i]))
  rx, cy, fz = (int(v) for v in _bands(s, *[np.int64(g) for g in grid]))
  pick = {k: (v[i] if np.ndim(v) else v) for k, v in costs.items()}
  return SparsePlan(
      s.x, s.y, s.z, s.block, np.dtype(dtype).name, np.dtype(partials_dtype).name, grid,
      (rx, cy, fz), float(pick["compute"]), float(pick["exchange"]), float(pick["reduce"]),
      float(pick["sync"]), int(pick["temp"]), limit, bool(pick["temp"] <= limit), int(px.size),
      dynamic=dynamic, bucket_blocks=int(pick.get("cap", 0)), phases=int(pick.get("phases", 0)),
      phase_cycles=float(pick.get("phase", 0.0)), rotate=bool(pick.get("rotate", False)),
      output_cycles=float(pick.get("output", 0.0)))


def static_partials_dtype(dtype) -> np.dtype:
  """The partials type ``popsparse::static_`` keeps: the data type's for 2-byte floats.

  static_ sets its partials type to the input type (poplibs
  ``lib/popsparse/StaticMatMul.cpp:931, 948, 1196, 1239, 1415``) and has its
  vertices only as ``<half, half>`` and ``<float, float>``
  (``codelets/StaticSparseDenseMatMulBlock.cpp:154-159``,
  ``StaticSparseDenseElementWise.cpp:75-76``); through the one partials rule
  (:func:`ipu_jax.lowering.matmul_plan.partials_dtype`) that is half partials
  for float16 (bfloat16 for bfloat16) and float32 otherwise.
  """
  return _partials_rule(dtype, dtype, "float16")


@functools.lru_cache(maxsize=256)
def plan_static(target: IPUTarget, x: int, y: int, z: int, block: int, nnz_blocks: int,
                dtype, partials_dtype=None, available_memory_proportion: float = 0.6,
                max_tiles: int | None = None, rotate: bool | None = None) -> SparsePlan:
  """The grid of a static sparse ``[x, y]`` (``nnz_blocks`` blocks of ``block``) times dense ``[y, z]``.

  ``partials_dtype``: None takes ``popsparse::static_``'s, the data type's
  (half for float16: poplibs ``lib/popsparse/StaticMatMul.cpp:931`` sets
  ``options.partialsType = inputType``), through the one partials rule.
  ``rotate``: None chooses the replicated or the rotating plan by cost; a bool
  keeps to that kind (where it has a candidate: rotating needs ``pz > 1``).
  """
  if partials_dtype is None:
    partials_dtype = static_partials_dtype(dtype)
  s = _Shape(int(x), int(y), int(z), int(block), np.dtype(dtype).itemsize,
             np.dtype(partials_dtype).itemsize)
  return _plan(target, s, dtype, partials_dtype, int(nnz_blocks),
               float(available_memory_proportion),
               target.num_tiles if max_tiles is None else max_tiles, False, 0.0, rotate)


@functools.lru_cache(maxsize=256)
def plan_dynamic(target: IPUTarget, x: int, y: int, z: int, block: int, max_nnz_blocks: int,
                 dtype, partials_dtype=np.float32, available_memory_proportion: float = 0.6,
                 oversize: float = DEFAULT_OVERSIZE, max_tiles: int | None = None) -> SparsePlan:
  """The grid and buckets of a dynamic sparse product of at most ``max_nnz_blocks`` blocks."""
  s = _Shape(int(x), int(y), int(z), int(block), np.dtype(dtype).itemsize,
             np.dtype(partials_dtype).itemsize)
  return _plan(target, s, dtype, partials_dtype, int(max_nnz_blocks),
               float(available_memory_proportion),
               target.num_tiles if max_tiles is None else max_tiles, True, float(oversize))
