"""IPU targets: immutable descriptions of the emulated hardware.

Every figure the cost and memory models use lives here, so a what-if study is a
``dataclasses.replace`` away::

    t = IPUTarget.preset("ipu2")
    big = t.replace(bytes_per_tile=2 * t.bytes_per_tile)

Sources for the presets: Graphcore datasheets (tiles, SRAM, clock, peak FLOPS,
all-to-all exchange and IPU-Link bandwidth), the PCIe 4.0 specification (host
link), poplibs' published cycle estimators (supervisor overhead) and
planner figures (on-chip sync, fixed exchange cost), "Dissecting
the Graphcore IPU Architecture via Microbenchmarking" (Jia et al., 2019). The
provenance of every figure is in :data:`ipu_jax.kernels.cost_model.FIGURE_SOURCES`;
figures marked *estimate* have no published measurement behind them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["IPUTarget", "PRESETS"]


# --- calibrated figures (provenance in ipu_jax.kernels.cost_model) --------
# PCIe 4.0 x16, one direction: 16 GT/s x 16 lanes x 128/130 / 8 bits.
_PCIE4_X16 = 16e9 * 16 * 128 / 130 / 8
# Graphcore's own planning figures for an on-chip BSP step (poplibs, popnn's
# CTC-loss planner, lib/popnn/CTCLossPlan.cpp): about 90 cycles for the sync
# before each exchange and a fixed 100 cycles of overhead per exchange on
# top of bytes / exchangeBytesPerCycle. Planner constants, not measurements:
# Jia et al. (2019) measured sync and tile-to-tile latencies on a GC2, but
# their tables could not be obtained for this project.
_ONCHIP_SYNC_CYCLES = 90
_EXCHANGE_FIXED_CYCLES = 100
# poplibs' IPUModel set-up for multi-IPU systems (lib/poplibs_test/Util.cpp,
# setGlobalSyncLatency): a global sync signal takes 15 ns per hop each way.
_IPU_SYNC_SECONDS_PER_HOP = 15e-9
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IPUTarget:
  """An emulated IPU system: ``num_ipus`` chips of ``tiles_per_ipu`` tiles.

  Attributes:
    name: preset name this target came from (``"ipu1"``, ``"ipu2"``, ``"bow"``).
    num_ipus: IPUs in the system; tiles are numbered IPU-major.
    tiles_per_ipu: tiles on each IPU.
    bytes_per_tile: SRAM per tile in bytes.
    worker_contexts: hardware worker threads per tile (issued round-robin).
    clock_hz: tile clock frequency.
    fp16_flops_per_cycle: peak fp16 FLOP per cycle per tile (AMP units).
    fp32_flops_per_cycle: peak fp32 FLOP per cycle per tile.
    vector_width_bytes: bytes a worker loads per cycle for elementwise work.
    exchange_bytes_per_cycle: bytes a tile sends or receives per cycle.
    exchange_latency_cycles: fixed cost of an exchange phase (poplibs'
      planner figure, 100 cycles).
    tiles_per_exchange_bus: tiles sharing one exchange bus (a "super tile":
      tiles ``2j`` and ``2j + 1``); bytes both receive together arrive at
      that many times a tile's rate (poplin's ExchangeEstimator; poplibs
      asserts Poplar's getTilesPerSharedExchangeBus() is 2). 1: no sharing.
    sync_cycles_internal: cost of a sync among the tiles of one IPU (poplibs'
      planner figure, 90 cycles).
    ipu_sync_seconds_per_hop: latency of a sync signal across one hop
      between IPUs, one way (poplibs' IPUModel, 15 ns); a sync spanning
      several IPUs costs :meth:`ipu_sync_cycles`.
    sync_cycles_host: cost of a sync with the host or streaming memory (a
      stream copy, a remote-buffer copy) (*estimate*: nothing published
      prices host and gateway syncs).
    supervisor_overhead_cycles: per compute set per tile, launching workers
      (poplibs' supervisor non-loop overhead).
    ipu_link_bytes_per_second: IPU-Link bandwidth per IPU (all links).
    host_link_bytes_per_second: host-link bandwidth in one direction (a
      stream copy moves data one way): PCIe 4.0 x16, 31.5 GB/s.
    code_bytes_per_codelet: code size charged once per distinct codelet on a
      tile (*estimate*).
    vertex_state_bytes: bytes of vertex state per vertex plus per connection
      (*estimate*).
    fp8_flops_per_cycle: peak FP8 (F143/F152) FLOP per cycle per tile; 0 for
      chips without FP8 AMP units, whose FP8 matmuls run (and are costed) at
      the fp16 rate, as poplin's fallback widens them to half.
    streaming_memory_bytes: Streaming Memory (IPU-Machine DDR) each IPU
      addresses, holding remote buffers and offloaded state.
    streaming_memory_bytes_per_second: bandwidth between one IPU's tiles and
      its Streaming Memory, through the IPU-Machine's gateway (*estimate*).
    system: the :class:`~ipu_jax.kernels.systems.IPUSystem` the IPUs are part
      of (a preset name such as ``"pod16"`` is looked up), or ``None``: the
      flat model (one IPU-Link rate for everything, the M2000 ladder for
      pipelines). With a system, collectives between replicas are priced over
      its links (:mod:`ipu_jax.kernels.collectives`).
    io_tiles_per_ipu: tiles of each IPU set aside for host I/O (PopART's
      ``numIOTiles``, TF-IPU's ``io_tiles.num_io_tiles``), beyond the
      ``tiles_per_ipu`` compute tiles every plan and memory check sees; 0
      (the default) sets none aside. A setting, not a hardware figure
      (``lowering/host_io.py`` costs them).
  """

  name: str = "ipu2"
  num_ipus: int = 1
  tiles_per_ipu: int = 1472
  bytes_per_tile: int = 638_976
  worker_contexts: int = 6
  clock_hz: float = 1.33e9
  fp16_flops_per_cycle: int = 128
  fp32_flops_per_cycle: int = 32
  vector_width_bytes: int = 8
  exchange_bytes_per_cycle: int = 4
  exchange_latency_cycles: int = _EXCHANGE_FIXED_CYCLES
  tiles_per_exchange_bus: int = 2
  sync_cycles_internal: int = _ONCHIP_SYNC_CYCLES
  ipu_sync_seconds_per_hop: float = _IPU_SYNC_SECONDS_PER_HOP
  sync_cycles_host: int = 1500
  supervisor_overhead_cycles: int = 50
  ipu_link_bytes_per_second: float = 320e9
  host_link_bytes_per_second: float = _PCIE4_X16
  code_bytes_per_codelet: int = 256
  vertex_state_bytes: int = 8
  # FP8 units (0 = none).
  fp8_flops_per_cycle: int = 0

  # -- Streaming memory (see lowering/remote.py) -----------------------------
  # Each IPU's share of the IPU-Machine's DDR and the rate tiles reach it at
  # through the gateway. Sources: the IPU-M2000 and Bow-2000 datasheets
  # (256 GB of DDR4 Streaming Memory for 4 IPUs as shipped, i.e. 64 GiB-class
  # per IPU; larger DIMMs reach about 112 GB per IPU, 448 GB per machine);
  # each IPU reaches the gateway over PCIe Gen4 x8 (15.75 GB/s per direction
  # at most), and Graphcore's "Memory and Performance Optimisation" guide says
  # Streaming Memory is 3x to 20x slower than IPU-Links depending on the links
  # used. 8 GB/s per IPU is an *estimate* in the 6-9 GB/s effective range that
  # guide implies.
  streaming_memory_bytes: int = 64_000_000_000
  streaming_memory_bytes_per_second: float = 8e9
  # Host I/O tiles (a setting; lowering/host_io.py).
  io_tiles_per_ipu: int = 0

  # -- The system the IPUs are part of (docs/systems.md) -----------------------
  system: Any = None

  def __post_init__(self):
    self._check_system()
    positive_ints = ("num_ipus", "tiles_per_ipu", "bytes_per_tile",
                     "worker_contexts", "fp16_flops_per_cycle",
                     "fp32_flops_per_cycle", "vector_width_bytes",
                     "exchange_bytes_per_cycle", "tiles_per_exchange_bus")
    for field in positive_ints:
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"IPUTarget.{field} must be a positive integer, got {value!r}.")
    if self.tiles_per_exchange_bus not in (1, 2):
      # Poplibs' estimators assert a shared bus holds two tiles; the exchange
      # model pairs tiles (2j, 2j + 1) (lowering/exchange.py shift_cost).
      raise ValueError(f"IPUTarget.tiles_per_exchange_bus must be 1 (no sharing) or 2 "
                       f"(tiles 2j and 2j + 1 share a bus), got {self.tiles_per_exchange_bus!r}.")
    non_negative = ("exchange_latency_cycles", "sync_cycles_internal",
                    "sync_cycles_host", "supervisor_overhead_cycles",
                    "code_bytes_per_codelet", "vertex_state_bytes",
                    "fp8_flops_per_cycle", "streaming_memory_bytes",
                    "io_tiles_per_ipu")
    for field in non_negative:
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"IPUTarget.{field} must be a non-negative integer, got {value!r}.")
    for field in ("clock_hz", "ipu_link_bytes_per_second", "ipu_sync_seconds_per_hop",
                  "host_link_bytes_per_second", "streaming_memory_bytes_per_second"):
      value = getattr(self, field)
      if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(
            f"IPUTarget.{field} must be a positive number, got {value!r}.")

  def _check_system(self) -> None:
    if self.system is None:
      return
    from ipu_jax.kernels.systems import IPUSystem, system_preset
    if isinstance(self.system, str):
      object.__setattr__(self, "system", system_preset(self.system))
    if not isinstance(self.system, IPUSystem):
      raise ValueError(f"IPUTarget.system must be an IPUSystem, a system preset name or None, "
                       f"got {self.system!r}.")
    if self.name != self.system.chip:
      raise ValueError(
          f"IPUTarget.name={self.name!r} but the {self.system.name} system is made of "
          f"{self.system.chip!r} IPUs ({self.system.machine}); use IPUTarget.preset("
          f"{self.system.chip!r}, system={self.system.name!r}).")
    if isinstance(self.num_ipus, int) and self.num_ipus > self.system.num_ipus:
      raise ValueError(f"IPUTarget.num_ipus={self.num_ipus} exceeds the "
                       f"{self.system.num_ipus} IPUs of the {self.system.name} system.")

  @property
  def num_tiles(self) -> int:
    """Tiles in the whole system: ``num_ipus * tiles_per_ipu``."""
    return self.num_ipus * self.tiles_per_ipu

  @property
  def total_memory_bytes(self) -> int:
    return self.num_tiles * self.bytes_per_tile

  @property
  def ipu_link_bytes_per_cycle(self) -> float:
    """IPU-Link bandwidth expressed in bytes per tile-clock cycle."""
    return self.ipu_link_bytes_per_second / self.clock_hz

  @property
  def streaming_bytes_per_cycle(self) -> float:
    """Streaming-memory bandwidth of one IPU in bytes per tile-clock cycle."""
    return self.streaming_memory_bytes_per_second / self.clock_hz

  def ipu_sync_cycles(self, num_ipus: int | None = None) -> float:
    """Cycles of one sync across ``num_ipus`` IPUs (default: all of them).

    The tiles of every IPU sync on chip (``sync_cycles_internal``, all IPUs
    at once), then the sync signal goes between the IPUs and back: poplibs'
    IPUModel figure (``setGlobalSyncLatency``),
    ``ceil(ipu_sync_seconds_per_hop * clock_hz * hops * 2)`` with
    ``hops = 1 + (num_ipus // 2) // 2`` -- 40 cycles for 2 IPUs at 1.33 GHz,
    so 90 + 40 = 130 in all: a sync across IPUs never costs less than one
    within an IPU. A multi-IPU program's cross-IPU supersteps and a
    pipeline's slot boundaries both pay it. 0 for one IPU (no sync crosses).
    """
    n = self.num_ipus if num_ipus is None else int(num_ipus)
    if n <= 1:
      return 0.0
    hops = 1 + (n // 2) // 2
    signal = math.ceil(self.ipu_sync_seconds_per_hop * self.clock_hz * hops * 2)
    return float(self.sync_cycles_internal + signal)

  def ipu_of_tile(self, tile):
    """The IPU index that holds ``tile`` (works on NumPy arrays too)."""
    return tile // self.tiles_per_ipu

  def flops_per_cycle(self, dtype) -> int:
    """Peak FLOP per cycle per tile for matmul-like work in ``dtype``."""
    import numpy as np
    if self.has_fp8(dtype):
      return self.fp8_flops_per_cycle
    itemsize = np.dtype(dtype).itemsize
    return self.fp16_flops_per_cycle if itemsize <= 2 else self.fp32_flops_per_cycle

  def has_fp8(self, dtype) -> bool:
    """Whether matmuls of ``dtype`` run on FP8 AMP units of this target."""
    from ipu_jax.kernels.number_formats import is_fp8
    return self.fp8_flops_per_cycle > 0 and is_fp8(dtype)

  def cycles_to_seconds(self, cycles: float) -> float:
    return float(cycles) / self.clock_hz

  def replace(self, **changes: Any) -> "IPUTarget":
    """A copy with ``changes`` applied (validated like the constructor)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def preset(cls, name: str, num_ipus: int = 1,
             tiles_per_ipu: int | None = None, **overrides: Any) -> "IPUTarget":
    """A target for a known IPU generation.

    Args:
      name: one of ``"ipu1"`` (GC2), ``"ipu2"`` (GC200) or ``"bow"``.
      num_ipus: how many IPUs the system has.
      tiles_per_ipu: use fewer tiles than the chip has (``None`` = all), handy
        for fast tests and small studies.
      **overrides: any other field of :class:`IPUTarget`.

    Example::

      t = IPUTarget.preset("ipu2", tiles_per_ipu=16)
      assert t.num_tiles == 16
    """
    if name not in PRESETS:
      raise ValueError(
          f"Unknown IPU preset {name!r}; valid presets are {sorted(PRESETS)}.")
    fields = dict(PRESETS[name])
    fields["num_ipus"] = num_ipus
    if tiles_per_ipu is not None:
      if isinstance(tiles_per_ipu, bool) or not isinstance(tiles_per_ipu, int) or tiles_per_ipu <= 0:
        raise ValueError(
            f"IPUTarget.tiles_per_ipu must be a positive integer or None, got {tiles_per_ipu!r}.")
      if tiles_per_ipu > fields["tiles_per_ipu"]:
        raise ValueError(
            f"IPUTarget.tiles_per_ipu={tiles_per_ipu} exceeds the {fields['tiles_per_ipu']} "
            f"tiles of a {name} IPU; valid values are 1..{fields['tiles_per_ipu']}.")
      fields["tiles_per_ipu"] = tiles_per_ipu
    fields.update(overrides)
    return cls(**fields)


PRESETS: dict[str, dict[str, Any]] = {
    # GC2: 1,216 tiles x 256 KiB (~300 MB), 124.5 TFLOPS fp16 at ~1.6 GHz.
    "ipu1": dict(name="ipu1", tiles_per_ipu=1216, bytes_per_tile=262_144,
                 worker_contexts=6, clock_hz=1.6e9, fp16_flops_per_cycle=64,
                 fp32_flops_per_cycle=16, ipu_link_bytes_per_second=320e9,
                 host_link_bytes_per_second=_PCIE4_X16,
                 # C2 PCIe cards have no IPU-Machine DDR: no Streaming Memory.
                 streaming_memory_bytes=0),
    # GC200: 1,472 tiles x 624 KiB (~900 MB), 250 TFLOPS fp16 at 1.33 GHz.
    "ipu2": dict(name="ipu2", tiles_per_ipu=1472, bytes_per_tile=638_976,
                 worker_contexts=6, clock_hz=1.33e9, fp16_flops_per_cycle=128,
                 fp32_flops_per_cycle=32, ipu_link_bytes_per_second=320e9,
                 host_link_bytes_per_second=_PCIE4_X16,
                 # IPU-M2000: 256 GB DDR4 for 4 IPUs (datasheet).
                 streaming_memory_bytes=64_000_000_000,
                 streaming_memory_bytes_per_second=8e9),
}
# Bow: the GC200 die with wafer-on-wafer power delivery, 1.85 GHz. The
# Bow-2000 ships 256 GB DDR4 for 4 IPUs (datasheet; 128-256 GB configurations)
# with the M2000's gateway links, so only the clock differs from "ipu2".
PRESETS["bow"] = dict(PRESETS["ipu2"], name="bow", clock_hz=1.85e9)

# --- ipu21: the Mk2 IPU with FP8 support -----------------------------------
# C600 PCIe card (Graphcore C600 datasheet, docs.graphcore.ai/projects/
# C600-datasheet): the GC200's 1,472 tiles and 900 MB, "Mk2 IPU with FP8
# support", 185 W; 280 TFLOPS fp16 and 560 TFLOPS FP8 (Graphcore's C600
# announcement, 2022). 280e12 / (1472 tiles x 128 FLOP/cycle) gives the clock,
# 1.486 GHz; FP8 runs at twice the fp16 AMP rate. PCIe Gen4 x16 to the host
# (one direction, as the other presets); IPU-Link figures as the GC200 (*estimate*).
PRESETS["ipu21"] = dict(name="ipu21", tiles_per_ipu=1472, bytes_per_tile=638_976,
                        worker_contexts=6, clock_hz=280e12 / (1472 * 128),
                        fp16_flops_per_cycle=128, fp32_flops_per_cycle=32,
                        fp8_flops_per_cycle=256, ipu_link_bytes_per_second=320e9,
                        host_link_bytes_per_second=_PCIE4_X16,
                        # A PCIe card: no IPU-Machine DDR, so no Streaming Memory.
                        streaming_memory_bytes=0)
