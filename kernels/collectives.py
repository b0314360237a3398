"""Collectives between replicas priced over an IPU system's links.

Pure functions of an :class:`~ipu_jax.kernels.target.IPUTarget` (clock,
exchange latency, sync) and an :class:`~ipu_jax.kernels.systems.IPUSystem`
(routes, link rates). Sources and readings: docs/systems.md#collectives.

The plan of a collective over *groups* (each a list of IPUs, one per
replica; a replica of ``k`` IPUs has ``k`` groups, one per IPU of the
replica, all run at once, as each IPU reduces the tensors it holds):

* **Inside one POD**, a ring: the group's IPUs in ladder order (up one side,
  down the other), each sending to the next over its route. A reduce-scatter
  of ``B`` bytes over ``L`` members is ``L - 1`` steps in which every member
  sends ``B / L`` to the next; an all-gather the same; an all-reduce both.
* **Across PODs** (the same number of members in each), hierarchical: a
  reduce-scatter inside each POD (``L - 1`` steps of ``B / L``), then over the
  GW-Links, the members holding the same ``1 / L`` of the data form a ring of
  the ``P`` PODs (a reduce-scatter: ``P - 1`` steps of ``B / (L P)``); an
  all-gather is the reverse, an all-reduce both. Members unevenly spread over
  PODs form one ring over all of them.
* **Broadcast** of ``B`` bytes from a group's first IPU: the root sends each
  member its ``1 / R`` (one step, the root's links shared), then an
  all-gather.

A step's transfers happen at once: each (link group, direction) carries the
bytes of every transfer routed over it (contention), a transfer ends when
the most loaded group on its route has moved its load (at the group's links
and their class's rate), plus one exchange latency per hop and a GW-Link's
latency per GW hop; the step lasts until its last transfer ends, then the
IPUs sync (``IPUTarget.ipu_sync_cycles`` over every IPU taking part; a step
over GW-Links also pays a GW-Link latency each way for the sync signal,
an *estimate*). Every step of a ring moves the same pattern, so each is
priced once.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np

from ipu_jax.kernels.systems import LINK_CLASSES, IPUSystem, check_capacity
from ipu_jax.kernels.target import IPUTarget

__all__ = ["CollectiveCost", "transfer_cycles", "ReplicaGrouping", "axis_groups", "ipu_groups",
           "replica_groups", "ring_order", "all_reduce", "reduce_scatter", "all_gather",
           "broadcast", "KINDS", "collective"]

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  """What one collective costs.

  Attributes:
    cycles: the whole collective: every step's transfers and syncs.
    link_cycles: per link class, the transfer time of the steps whose
      slowest transfer was held up by a link of that class.
    sync_cycles: the syncs ending the steps.
    link_bytes: per link class, the bytes carried by its links (a transfer
      over two hops of one class counts twice).
    steps: the steps (each ending in a sync).
  """

  cycles: float
  link_cycles: dict
  sync_cycles: float
  link_bytes: dict
  steps: int

  @staticmethod
  def zero() -> "CollectiveCost":
    return CollectiveCost(0.0, {c: 0.0 for c in LINK_CLASSES}, 0.0,
                          {c: 0 for c in LINK_CLASSES}, 0)


@dataclasses.dataclass(frozen=True)
class _Round:
  """``count`` identical steps of ``transfers`` ``(src, dst, nbytes)``."""

  count: int
  transfers: tuple


def transfer_cycles(target: IPUTarget, system: IPUSystem, transfers: Sequence) -> tuple:
  """Concurrent transfers over ``system``'s links (see the module docstring).

  Args:
    target: the clock and the exchange latency per hop.
    system: routes and link rates.
    transfers: ``(src_ipu, dst_ipu, nbytes)``; same IPU or no bytes: free.

  Returns:
    ``(cycles, bottleneck_class, bytes_by_class)``: when the last transfer
    ends, the link class holding it up (``None`` if nothing moves), and the
    bytes each class's links carry.
  """
  routes, load = [], {}
  moved = {c: 0 for c in LINK_CLASSES}
  for src, dst, nbytes in transfers:
    if src == dst or nbytes <= 0:
      continue
    hops = system.route(src, dst)
    routes.append(hops)
    for hop in hops:
      load[hop] = load.get(hop, 0) + nbytes
      moved[hop[0].link_class] += nbytes
  clock = target.clock_hz
  seconds = {hop: n / system.group_bytes_per_second(hop[0]) for hop, n in load.items()}
  worst, worst_class = 0.0, None
  for hops in routes:
    slowest = max(hops, key=lambda h: seconds[h])
    latency = sum(target.exchange_latency_cycles + system.hop_latency_seconds(h[0]) * clock
                  for h in hops)
    cycles = seconds[slowest] * clock + latency
    if cycles > worst:
      worst, worst_class = cycles, slowest[0].link_class
  return worst, worst_class, moved


def _check_group(system: IPUSystem, group) -> list:
  group = list(group)
  for ipu in group:
    system.check_ipu("a group's IPU", ipu)
  if len(set(group)) != len(group):
    raise ValueError(f"A collective group names an IPU twice: {group}.")
  return group


@dataclasses.dataclass(frozen=True)
class ReplicaGrouping:
  """Which replicas a collective (or a variable) groups, as PopXL's
  ``Ir.replica_grouping(stride, group_size)``.

  ``group_size`` replicas form a group, consecutive members ``stride``
  replicas apart; groups are numbered as PopXL's ``assignment`` numbers them
  (PopXL user guide, "Replica grouping", and API reference
  ``popxl.ReplicaGrouping``; docs/tensor_parallel.md#replica-groups). In a
  ``(dp, tp)`` layout the tensor-parallel group is ``ReplicaGrouping(tp)``
  and the data-parallel group ``ReplicaGrouping(dp, stride=tp)``.

  Attributes:
    group_size: replicas in each group (>= 1).
    stride: replica index difference between two members of a group (>= 1).
  """

  group_size: int
  stride: int = 1

  def __post_init__(self):
    for field in ("group_size", "stride"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"ReplicaGrouping.{field} must be a positive integer, got {value!r}.")

  def _check(self, num_replicas: int) -> None:
    span = self.group_size * self.stride
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, numbers.Integral) or (
        num_replicas < 1 or num_replicas % span):
      raise ValueError(
          f"ReplicaGrouping(group_size={self.group_size}, stride={self.stride}) needs a "
          f"number of replicas that is a multiple of group_size x stride = {span}; got "
          f"num_replicas={num_replicas!r}.")

  def groups(self, num_replicas: int) -> list:
    """The groups of ``num_replicas`` replicas: a list of lists of replica indices.

    Raises:
      ValueError: ``num_replicas`` is not a multiple of ``group_size * stride``.
    """
    self._check(num_replicas)
    span = self.group_size * self.stride
    ids = np.arange(num_replicas).reshape(num_replicas // span, self.group_size, self.stride)
    return ids.transpose(0, 2, 1).reshape(-1, self.group_size).tolist()

  def assignment(self, num_replicas: int) -> list:
    """The group of each replica (PopXL's ``ReplicaGrouping.assignment``)."""
    out = np.zeros(num_replicas, np.int64)
    for g, members in enumerate(self.groups(num_replicas)):
      out[members] = g
    return out.tolist()

  def num_groups(self, num_replicas: int) -> int:
    self._check(num_replicas)
    return num_replicas // self.group_size


def axis_groups(layout: Sequence, names: Sequence) -> list:
  """The replica groups of a collective over the axes ``names`` of ``layout``.

  Args:
    layout: ``[(axis_name, size), ...]``, outermost axis first: replica
      ``r`` is the mixed-radix number of its axis indices (the last axis
      varies fastest), as nested ``vmap``s or a device mesh number them.
    names: the axes the collective spans (a subset of ``layout``'s).

  Returns:
    One list of replica indices per group: the replicas that agree on every
    axis not in ``names`` (in increasing order). A single axis spanning every
    replica is one group ``[0 .. R - 1]``; in a ``(dp, tp)`` layout the
    ``tp`` axis gives ``ReplicaGrouping(tp)``'s groups and the ``dp`` axis
    ``ReplicaGrouping(dp, stride=tp)``'s.

  Raises:
    ValueError: a name not in the layout.
  """
  axes = [str(n) for n, _ in layout]
  sizes = [int(s) for _, s in layout]
  picked = [axes.index(str(n)) if str(n) in axes else -1 for n in names]
  if -1 in picked:
    missing = [n for n, i in zip(names, picked) if i < 0]
    raise ValueError(f"Collective axes {missing} are not replica axes of the layout {layout}.")
  others = [i for i in range(len(axes)) if i not in picked]
  ids = np.arange(int(np.prod(sizes, dtype=np.int64))).reshape(sizes)
  group_size = int(np.prod([sizes[i] for i in picked], dtype=np.int64))
  return ids.transpose(others + sorted(picked)).reshape(-1, group_size).tolist()


def ipu_groups(system: IPUSystem, groups: Sequence, num_replicas: int,
               ipus_per_replica: int, ipus: Sequence[int] | None = None) -> list:
  """The IPU groups of a collective between the replica ``groups``.

  Replica ``r`` holds IPUs ``r * ipus_per_replica ...`` (replicas are laid
  out in order, as Poplar numbers them); IPU ``j`` of every replica of a
  replica group forms one IPU group; all groups run at once. ``ipus`` picks
  the replica's IPUs taking part (default: all).

  Raises:
    ValueError: the system is too small for ``num_replicas`` replicas
      (naming the counts), or an IPU of ``ipus`` is not one of the replica's.
  """
  check_capacity(system, num_replicas, ipus_per_replica, "replicas", "ipus_per_replica")
  ipus = range(ipus_per_replica) if ipus is None else ipus
  for j in ipus:
    if not (0 <= j < ipus_per_replica):
      raise ValueError(f"IPU {j} is not one of a replica's {ipus_per_replica} IPUs.")
  return [[r * ipus_per_replica + j for r in group] for group in groups for j in ipus]


def replica_groups(system: IPUSystem, replicas: int, ipus_per_replica: int,
                   ipus: Sequence[int] | None = None) -> list:
  """The groups of a collective spanning all of ``replicas`` replicas.

  IPU ``j`` of every replica forms group ``j`` (:func:`ipu_groups` with one
  replica group of every replica). ``ipus`` picks the replica's IPUs taking
  part (default: all).

  Raises:
    ValueError: the system is too small (naming the counts), or an IPU of
      ``ipus`` is not one of the replica's.
  """
  return ipu_groups(system, [list(range(replicas))], replicas, ipus_per_replica, ipus)


def ring_order(system: IPUSystem, group: Sequence[int]) -> list:
  """``group``'s IPUs in ring order: by POD, then up one side of the ladder
  and down the other."""
  def key(ipu):
    local = ipu % system.ipus_per_pod
    rung, side = local // 2, local % 2
    return ipu // system.ipus_per_pod, side, rung if side == 0 else -rung
  return sorted(group, key=key)


def _ring_steps(rings: list, chunk: float) -> tuple:
  """One step of every ring: each member sends ``chunk`` to the next."""
  return tuple((ring[i], ring[(i + 1) % len(ring)], chunk)
               for ring in rings if len(ring) > 1 for i in range(len(ring)))


def _layout(system: IPUSystem, group: list):
  """``(pod_rings, members_per_pod)``: the group's ring in each POD, or
  ``([ring over all], None)`` when the PODs hold different numbers."""
  order = ring_order(system, group)
  by_pod = {}
  for ipu in order:
    by_pod.setdefault(ipu // system.ipus_per_pod, []).append(ipu)
  sizes = {len(m) for m in by_pod.values()}
  if len(sizes) != 1:
    return [order], None
  return list(by_pod.values()), sizes.pop()


def _half_rounds(system: IPUSystem, groups: list, nbytes: list, gather: bool) -> list:
  """Rounds of a reduce-scatter (``gather=False``) or all-gather of
  ``nbytes[g]`` over each group ``g``."""
  inner, outer = [], []
  for group, b in zip(groups, nbytes):
    rings, per_pod = _layout(system, group)
    if per_pod is None or len(rings) == 1:
      inner.append((len(rings[0]), rings, b / len(rings[0])))
      continue
    inner.append((per_pod, rings, b / per_pod))
    # Across PODs: member i of every POD's ring, in POD order.
    cross = [[ring[i] for ring in rings] for i in range(per_pod)]
    outer.append((len(rings), cross, b / (per_pod * len(rings))))
  rounds = []
  for phase in (inner, outer):
    counts = sorted({n for n, _, _ in phase if n > 1})
    # Groups with equal ring sizes step together; rings of other sizes take
    # their own steps (their count differs).
    for n in counts:
      rings_n = [(rings, chunk) for m, rings, chunk in phase if m == n]
      transfers = tuple(t for rings, chunk in rings_n for t in _ring_steps(rings, chunk))
      rounds.append(_Round(n - 1, transfers))
  return rounds[::-1] if gather else rounds


def _normalise(target: IPUTarget, groups, nbytes, system) -> tuple:
  system = target.system if system is None else system
  if not isinstance(system, IPUSystem):
    raise ValueError("A collective priced by topology needs an IPUSystem: pass system= or use "
                     "a target with IPUTarget.system set.")
  groups = [_check_group(system, g) for g in groups]
  if isinstance(nbytes, numbers.Real):
    nbytes = [nbytes] * len(groups)
  nbytes = [float(b) for b in nbytes]
  if len(nbytes) != len(groups) or any(b < 0 for b in nbytes):
    raise ValueError(f"nbytes must be one count >= 0 or one per group ({len(groups)}); "
                     f"got {nbytes}.")
  return system, groups, nbytes


def _price(target: IPUTarget, system: IPUSystem, rounds: list, ipus: int) -> CollectiveCost:
  link_cycles = {c: 0.0 for c in LINK_CLASSES}
  link_bytes = {c: 0 for c in LINK_CLASSES}
  sync_total, steps = 0.0, 0
  for rnd in rounds:
    cycles, bottleneck, moved = transfer_cycles(target, system, rnd.transfers)
    if bottleneck is None:
      continue
    sync = target.ipu_sync_cycles(ipus)
    if moved["gw_link"]:
      sync += 2 * system.gw_latency_seconds * target.clock_hz
    link_cycles[bottleneck] += rnd.count * cycles
    for c in LINK_CLASSES:
      link_bytes[c] += int(round(rnd.count * moved[c]))
    sync_total += rnd.count * sync
    steps += rnd.count
  return CollectiveCost(sum(link_cycles.values()) + sync_total, link_cycles, sync_total,
                        link_bytes, steps)


def _ipus(groups: list) -> int:
  return len({ipu for g in groups for ipu in g})


def reduce_scatter(target: IPUTarget, groups, nbytes, system: IPUSystem | None = None):
  """A reduce-scatter of ``nbytes`` (per group, or one count for all) over
  each group at once; each member ends with ``1 / len(group)`` of the sum."""
  system, groups, nbytes = _normalise(target, groups, nbytes, system)
  return _price(target, system, _half_rounds(system, groups, nbytes, False), _ipus(groups))


def all_gather(target: IPUTarget, groups, nbytes, system: IPUSystem | None = None):
  """An all-gather into ``nbytes`` (the gathered size) over each group at once."""
  system, groups, nbytes = _normalise(target, groups, nbytes, system)
  return _price(target, system, _half_rounds(system, groups, nbytes, True), _ipus(groups))


def all_reduce(target: IPUTarget, groups, nbytes, system: IPUSystem | None = None):
  """An all-reduce of ``nbytes`` over each group at once: a reduce-scatter
  then an all-gather."""
  system, groups, nbytes = _normalise(target, groups, nbytes, system)
  rounds = (_half_rounds(system, groups, nbytes, False)
            + _half_rounds(system, groups, nbytes, True))
  return _price(target, system, rounds, _ipus(groups))


def broadcast(target: IPUTarget, groups, nbytes, system: IPUSystem | None = None):
  """``nbytes`` from each group's first IPU to the others: the root scatters
  ``1 / R`` to each member, then an all-gather."""
  system, groups, nbytes = _normalise(target, groups, nbytes, system)
  scatter = tuple((g[0], m, b / len(g)) for g, b in zip(groups, nbytes) for m in g[1:])
  rounds = [_Round(1, scatter)] + _half_rounds(system, groups, nbytes, True)
  return _price(target, system, rounds, _ipus(groups))


_BY_KIND = {"all_reduce": all_reduce, "reduce_scatter": reduce_scatter,
            "all_gather": all_gather, "broadcast": broadcast}


def collective(kind: str, target: IPUTarget, groups, nbytes,
               system: IPUSystem | None = None) -> CollectiveCost:
  """The collective ``kind`` (one of :data:`KINDS`)."""
  if kind not in _BY_KIND:
    raise ValueError(f"Unknown collective {kind!r}; valid kinds are {list(KINDS)}.")
  return _BY_KIND[kind](target, groups, nbytes, system)
