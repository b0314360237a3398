"""IPU systems: IPU-Machines, IPU-PODs and PODs joined by GW-Links.

An :class:`IPUSystem` says how many IPUs a system has, how they are grouped
(4 IPUs to a machine, machines to a POD, PODs joined by GW-Links directly or
through switches) and which links join any two of them, with each link
class's rate and latency. Sources and readings: docs/systems.md.

The topology, as ipu-jax models it:

* **Inside a machine** (IPU-M2000, Bow-2000) the 4 IPUs are poplibs'
  IPUModel ladder (:mod:`ipu_jax.pipelining.links`): IPUs ``2i, 2i + 1`` are a
  rung (``pair``: 4 links, ``cross``: 2 more), neighbouring rungs are joined
  on each side by 2 links (``rail``). Link class ``"ipu_link"``.
* **Inside a POD** the ladder goes on through the machines: the rails of the
  top rung of machine ``m`` run over IPU-Link cables to the bottom rung of
  machine ``m + 1`` (``cable``, 2 links, the 8 IPU-Link ports on each
  machine's front panel: 2 per IPU). In a POD of several machines the top
  machine is cabled back to the bottom one, so each side of the ladder is a
  ring (the ring GCL's collectives need). Link class ``"ipu_link_cable"``.
* **Between PODs** each machine's gateway has 2 GW-Links (100 Gbps each).
  ``directly attached``: machine ``m`` of a POD is joined to machine ``m`` of
  its neighbouring PODs (the PODs in a ring; with two PODs both GW-Links join
  the pair). ``switched``: every machine's GW-Links go to a switch and reach
  any machine of another POD through it. Link class ``"gw_link"``.

IPUs are numbered POD-major, then machine, then IPU within the machine:
IPU ``i`` is in POD ``i // ipus_per_pod``, machine ``i // 4``.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple

__all__ = ["IPUSystem", "SYSTEM_PRESETS", "LinkGroup", "LINK_CLASSES", "system_preset",
           "check_capacity"]

# One IPU-Link, one direction: 128 Gibit/s at 0.85 efficiency (poplibs'
# IPUModel, lib/poplibs_test/Util.cpp addGlobalExchangeConstraints).
_IPU_LINK = 128 * 2**30 / 8 * 0.85
# One GW-Link, one direction: 100 Gbps line rate (IPU-M2000 / Bow-2000
# datasheets: 2 x 100 Gbps GW-Links); no published payload efficiency.
_GW_LINK = 100e9 / 8
# Estimates (nothing published prices them): one GW-Link hop (gateway to
# gateway over 100 GbE RoCE), and one pass through an Ethernet switch.
_GW_LATENCY = 2e-6
_SWITCH_LATENCY = 1e-6
# The host's fixed time per execution of the device program (one call that
# runs ``steps_per_execution`` micro-batches: PopART's ``session.run`` with
# its input and result streams and the training script's host work around
# it). Measured, not estimated: MLPerf Training v2.0's Graphcore BERT runs on
# Bow Pod16 / 64 / 128 / 256 (PopART, SDK 2.5.1) evaluate between training
# blocks with forward-only runs (``implicitPipeliningFwdOnly``) of the
# training batch's shape; the gaps the logs show (1,515 / 549 / 285 / 208 ms,
# medians of 10 runs) fit ``n x (F + (G + 8) x c)`` for n runs of G
# micro-batches through the 9-stage pipeline with residuals under 7 ms, at
# F = 53 ms and c = 1.235 ms (docs/published_bert.md#the-evaluation-gaps). The
# same value is assumed for IPU-M2000 PODs (same host servers, PopART; not
# measured there).
_EXECUTION_OVERHEAD = 53e-3

LINK_CLASSES = ("ipu_link", "ipu_link_cable", "gw_link")

# Links in each group: the ladder's (poplibs' IPUModel) and the machine's 2
# GW-Links (to its switch, or to one neighbouring POD; both when there are 2).
_GROUP_CLASS = {"pair": "ipu_link", "cross": "ipu_link", "rail": "ipu_link",
                "cable": "ipu_link_cable", "gw": "gw_link", "gw_switch": "gw_link"}


class LinkGroup(NamedTuple):
  """Links between ``low < high`` of one ``kind``.

  For ``pair``/``cross``/``rail``/``cable`` the ends are IPUs; for ``gw``
  they are machines (direct GW-Links); for ``gw_switch`` ``low`` is a machine
  and ``high`` is -1 (the machine's links to its switch).
  """

  kind: str
  low: int
  high: int

  @property
  def link_class(self) -> str:
    return _GROUP_CLASS[self.kind]


def _is_int(value, low: int) -> bool:
  return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= low


@dataclasses.dataclass(frozen=True)
class IPUSystem:
  """A system of IPU-Machines (see the module docstring).

  Attributes:
    name: the preset's name (``"pod16"``, ``"bow-pod64"``, ...).
    chip: the :class:`~ipu_jax.kernels.target.IPUTarget` preset of its IPUs
      (``"ipu2"`` in IPU-M2000s, ``"bow"`` in Bow-2000s).
    machine: ``"IPU-M2000"`` or ``"Bow-2000"``.
    machines_per_pod: IPU-Machines joined by IPU-Links (1, 4 or 16).
    pods: PODs joined by GW-Links (1 for a single POD).
    gw_switched: whether the PODs' GW-Links go through switches.
    ipus_per_machine: 4 in both machines.
    ipu_link_bytes_per_second: one IPU-Link, one direction.
    gw_link_bytes_per_second: one GW-Link, one direction.
    gw_links_per_machine: 2 (datasheets).
    gw_latency_seconds: one GW-Link hop (*estimate*).
    switch_latency_seconds: one pass through a GW-Link switch (*estimate*).
    execution_overhead_seconds: the host's fixed time per execution of the
      device program (measured on Bow Pods, see ``_EXECUTION_OVERHEAD``):
      a step's share is this over the steps an execution runs.
  """

  name: str
  chip: str
  machine: str
  machines_per_pod: int
  pods: int = 1
  gw_switched: bool = False
  ipus_per_machine: int = 4
  ipu_link_bytes_per_second: float = _IPU_LINK
  gw_link_bytes_per_second: float = _GW_LINK
  gw_links_per_machine: int = 2
  gw_latency_seconds: float = _GW_LATENCY
  switch_latency_seconds: float = _SWITCH_LATENCY
  execution_overhead_seconds: float = _EXECUTION_OVERHEAD

  def __post_init__(self):
    for field in ("machines_per_pod", "pods", "ipus_per_machine", "gw_links_per_machine"):
      if not _is_int(getattr(self, field), 1):
        raise ValueError(f"IPUSystem.{field} must be a positive integer, got "
                         f"{getattr(self, field)!r}.")
    if self.ipus_per_machine % 2:
      raise ValueError(f"IPUSystem.ipus_per_machine must be even (rungs of 2 IPUs), got "
                       f"{self.ipus_per_machine}.")
    for field in ("ipu_link_bytes_per_second", "gw_link_bytes_per_second"):
      if not isinstance(getattr(self, field), (int, float)) or getattr(self, field) <= 0:
        raise ValueError(f"IPUSystem.{field} must be a positive number, got "
                         f"{getattr(self, field)!r}.")
    for field in ("gw_latency_seconds", "switch_latency_seconds",
                  "execution_overhead_seconds"):
      if not isinstance(getattr(self, field), (int, float)) or getattr(self, field) < 0:
        raise ValueError(f"IPUSystem.{field} must be a non-negative number, got "
                         f"{getattr(self, field)!r}.")

  # -- sizes and where an IPU is ----------------------------------------------

  @property
  def ipus_per_pod(self) -> int:
    return self.machines_per_pod * self.ipus_per_machine

  @property
  def num_machines(self) -> int:
    return self.machines_per_pod * self.pods

  @property
  def num_ipus(self) -> int:
    return self.ipus_per_pod * self.pods

  def check_ipu(self, name: str, ipu) -> int:
    """``ipu`` as an int, or ``ValueError`` naming ``name`` and the valid range."""
    if not _is_int(ipu, 0) or ipu >= self.num_ipus:
      raise ValueError(f"{name} must be an IPU of the {self.name} system, an int in "
                       f"0..{self.num_ipus - 1}; got {ipu!r}.")
    return int(ipu)

  def machine_of(self, ipu: int) -> int:
    """The machine (numbered across the system) that holds ``ipu``."""
    return self.check_ipu("ipu", ipu) // self.ipus_per_machine

  def pod_of(self, ipu: int) -> int:
    """The POD that holds ``ipu``."""
    return self.check_ipu("ipu", ipu) // self.ipus_per_pod

  def link_class(self, a: int, b: int) -> str | None:
    """The class of link that joins IPUs ``a`` and ``b`` (``None``: same IPU):
    ``"ipu_link"`` inside a machine, ``"ipu_link_cable"`` between machines of
    a POD, ``"gw_link"`` between PODs."""
    a, b = self.check_ipu("a", a), self.check_ipu("b", b)
    if a == b:
      return None
    if self.pod_of(a) != self.pod_of(b):
      return "gw_link"
    return "ipu_link" if self.machine_of(a) == self.machine_of(b) else "ipu_link_cable"

  # -- link groups --------------------------------------------------------------

  def links_in(self, group: LinkGroup) -> int:
    """Links in ``group`` (poplibs' ladder groups; the machine's GW-Links)."""
    if group.kind == "pair":
      return 4
    if group.kind in ("cross", "rail", "cable"):
      return 2
    if group.kind == "gw" and self.pods == 2:
      return self.gw_links_per_machine  # both GW-Links join the pair of PODs
    if group.kind == "gw":
      return max(1, self.gw_links_per_machine // 2)  # one to each neighbouring POD
    return self.gw_links_per_machine  # gw_switch

  def group_bytes_per_second(self, group: LinkGroup) -> float:
    """One direction of ``group``: its links at their class's rate."""
    rate = (self.gw_link_bytes_per_second if group.link_class == "gw_link"
            else self.ipu_link_bytes_per_second)
    return self.links_in(group) * rate

  def hop_latency_seconds(self, group: LinkGroup) -> float:
    """Latency of one hop over ``group`` beyond the exchange's own (GW-Links
    only; IPU-Link hops pay the target's exchange latency)."""
    if group.kind == "gw":
      return self.gw_latency_seconds
    if group.kind == "gw_switch":
      return self.gw_latency_seconds / 2 + self.switch_latency_seconds / 2
    return 0.0

  # -- routes -------------------------------------------------------------------

  def route(self, src: int, dst: int) -> list:
    """The hops of a copy from IPU ``src`` to IPU ``dst``: ``[(LinkGroup,
    direction), ...]``, direction +1 from ``low`` to ``high``, -1 back.

    Inside a POD: the ladder route (across the rung first when the sides
    differ, then along the side the short way round). Between PODs: the
    GW-Links of ``src``'s machine to the machine in the same place of the
    next POD on the way (or through the switch straight to ``dst``'s
    machine), landing on the IPU in ``src``'s place, then on inside that POD.
    """
    src, dst = self.check_ipu("src", src), self.check_ipu("dst", dst)
    hops, at = [], src
    while self.pod_of(at) != self.pod_of(dst):
      at = self._gw_hop(at, dst, hops)
    return hops + self._ladder_route(at, dst)

  def _gw_hop(self, at: int, dst: int, hops: list) -> int:
    per_pod, per_machine = self.ipus_per_pod, self.ipus_per_machine
    pod, target_pod = at // per_pod, dst // per_pod
    if self.gw_switched:
      src_m, dst_m = at // per_machine, dst // per_machine
      hops.append((LinkGroup("gw_switch", src_m, -1), 1))
      hops.append((LinkGroup("gw_switch", dst_m, -1), -1))
      return dst_m * per_machine + at % per_machine
    forward = (target_pod - pod) % self.pods
    step = 1 if forward <= self.pods - forward else -1
    nxt = (pod + step) % self.pods
    landing = at + (nxt - pod) * per_pod
    a, b = at // per_machine, landing // per_machine
    hops.append((LinkGroup("gw", min(a, b), max(a, b)), 1 if b > a else -1))
    return landing

  def _ladder_route(self, src: int, dst: int) -> list:
    if src == dst:
      return []
    if src // 2 == dst // 2:
      return [self._hop("pair", src, dst)]
    hops, at = [], src
    if at % 2 != dst % 2:
      partner = at ^ 1
      hops.append(self._hop("cross", at, partner))
      at = partner
    base = at - at % self.ipus_per_pod
    rungs = self.ipus_per_pod // 2
    rung, target = (at - base) // 2, (dst - base) // 2
    up = (target - rung) % rungs
    wraps = self.machines_per_pod > 1
    step = 1 if (not wraps and target > rung) or (wraps and up <= rungs - up) else -1
    while rung != target:
      nxt = (rung + step) % rungs
      a, b = base + 2 * rung + at % 2, base + 2 * nxt + at % 2
      kind = "rail" if a // self.ipus_per_machine == b // self.ipus_per_machine else "cable"
      hops.append(self._hop(kind, a, b))
      rung = nxt
    return hops

  @staticmethod
  def _hop(kind: str, a: int, b: int) -> tuple:
    return LinkGroup(kind, min(a, b), max(a, b)), 1 if b > a else -1

  def replace(self, **changes: Any) -> "IPUSystem":
    return dataclasses.replace(self, **changes)

  @classmethod
  def preset(cls, name: str) -> "IPUSystem":
    return system_preset(name)


def _m2000(name, machines, pods=1, switched=False):
  return IPUSystem(name=name, chip="ipu2", machine="IPU-M2000", machines_per_pod=machines,
                   pods=pods, gw_switched=switched)


def _bow(name, machines, pods=1, switched=False):
  return IPUSystem(name=name, chip="bow", machine="Bow-2000", machines_per_pod=machines,
                   pods=pods, gw_switched=switched)


SYSTEM_PRESETS: dict = {s.name: s for s in (
    _m2000("m2000", 1), _m2000("pod4", 1), _m2000("pod16", 4), _m2000("pod64", 16),
    _m2000("pod128", 16, pods=2), _m2000("pod256", 16, pods=4),
    _m2000("pod256-switched", 16, pods=4, switched=True),
    _bow("bow-2000", 1), _bow("bow-pod4", 1), _bow("bow-pod16", 4), _bow("bow-pod64", 16),
    _bow("bow-pod128", 16, pods=2), _bow("bow-pod256", 16, pods=4, switched=True),
    _bow("bow-pod256-direct", 16, pods=4),
)}
"""The systems by name. POD256s are switched in the Bow line (the switched
GW-Links note describes Bow Pod256 and larger) and directly attached for
IPU-M2000s; the other wiring of each is named with a suffix."""


def system_preset(name) -> IPUSystem:
  """The system called ``name`` (an :class:`IPUSystem` is returned as is).

  Raises:
    ValueError: an unknown name, listing the valid ones.
  """
  if isinstance(name, IPUSystem):
    return name
  if name not in SYSTEM_PRESETS:
    raise ValueError(f"Unknown IPU system {name!r}; valid systems are "
                     f"{sorted(SYSTEM_PRESETS)}.")
  return SYSTEM_PRESETS[name]


def check_capacity(system: IPUSystem, replicas: int, ipus_per_replica: int,
                   replicas_field: str = "replication_factor",
                   ipus_field: str = "auto_select_ipus") -> None:
  """Raise ``ValueError`` if ``replicas x ipus_per_replica`` IPUs do not fit ``system``.

  The message names the fields the counts came from.
  """
  needed = replicas * ipus_per_replica
  if needed > system.num_ipus:
    raise ValueError(
        f"The {system.name} system has {system.num_ipus} IPUs, too few for "
        f"{replicas_field}={replicas} x {ipus_field}={ipus_per_replica} = {needed} IPUs; "
        f"use a larger system (valid systems: {sorted(SYSTEM_PRESETS)}) or fewer replicas.")
