"""What crossing IPUs costs: IPU-Link copies and syncs across IPUs.

Facts (docs/hardware.md#between-ipus-ipu-links-the-m2000-ladder-and-syncs:
Graphcore's multi-IPU IPUModel set-up in the open-source poplibs,
``addGlobalExchangeConstraints`` in lib/poplibs_test/Util.cpp, and the
IPU-M2000 datasheet): one IPU-Link moves 128 Gibit/s per direction at about
0.85 efficiency. The IPU-Machine is a ladder whose rungs are the IPU pairs
``(2i, 2i + 1)``; each IPU's 10 links are

* ``pair``: 4 links to its paired IPU, used by copies between the pair;
* ``cross``: 2 more links to its paired IPU, used by copies to another rung
  that must change side of the ladder first;
* ``rail``: 2 links up (to IPU ``+ 2``) and 2 down (to IPU ``- 2``), the
  ladder's sides, used by copies to other rungs.

A copy from ``a`` to ``b`` in another rung crosses its own rung (``cross``)
when ``a`` and ``b`` are on different sides (``a % 2 != b % 2``), then climbs
the side rung by rung. The plan of one slot's copies:

* :func:`route` gives each copy its hops, ``(Link, direction)``: a link
  group between two IPUs, direction +1 from the lower IPU to the higher, -1
  back (links are full duplex: each direction has the whole rate).
* :func:`slot_copy_cycles` loads every (link, direction) with the bytes of
  all copies that use it (IPUModel's global exchange constraints: a link
  group's bandwidth is shared by every flow routed over it). A copy ends when
  the most loaded link on its route has moved its load, plus one exchange
  latency per hop (an estimate: IPUModel gives no per-hop figure); the
  slot's copies take as long as the copy that ends last. So two copies over
  one link cost the sum of their bytes, copies over different links the
  longer of the two. Copies within one IPU cost nothing.

A sync across IPUs costs :meth:`IPUTarget.ipu_sync_cycles` (IPUModel's
figure), the same function a multi-IPU program's cross-IPU supersteps are
costed with.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Sequence

from ipu_jax.kernels import collectives
from ipu_jax.kernels.target import IPUTarget

__all__ = ["LINK_BYTES_PER_SECOND", "LINKS_PER_GROUP", "Link", "route", "links_between",
           "link_bytes_per_second", "slot_copy_cycles", "copy_cycles", "all_reduce_cycles"]

# One IPU-Link, one direction, at the efficiency IPUModel assumes.
LINK_BYTES_PER_SECOND = 128 * 2**30 / 8 * 0.85

# Links in each group of the ladder (poplibs' IPUModel: numIntraIpuLinks,
# numCrossRoutingLinks, numUpLinks / numDownLinks).
LINKS_PER_GROUP = {"pair": 4, "cross": 2, "rail": 2}


class Link(NamedTuple):
  """A group of IPU-Links between IPUs ``low < high``: ``kind`` in LINKS_PER_GROUP."""

  kind: str
  low: int
  high: int

  @property
  def count(self) -> int:
    return LINKS_PER_GROUP[self.kind]


def _check_ipu(name: str, ipu) -> None:
  if isinstance(ipu, bool) or not isinstance(ipu, numbers.Integral) or ipu < 0:
    raise ValueError(f"{name} must be an IPU number (an int >= 0); got {ipu!r}.")


def _hop(kind: str, a: int, b: int) -> tuple:
  return Link(kind, min(a, b), max(a, b)), 1 if b > a else -1


def route(src: int, dst: int) -> list:
  """The hops of a copy from IPU ``src`` to IPU ``dst`` on the M2000 ladder.

  Returns:
    ``[(Link, direction), ...]`` in order; empty when ``src == dst``.

  Raises:
    ValueError: an IPU is not an int >= 0.
  """
  _check_ipu("src", src)
  _check_ipu("dst", dst)
  if src == dst:
    return []
  if src // 2 == dst // 2:
    return [_hop("pair", src, dst)]
  hops, at = [], src
  if at % 2 != dst % 2:
    partner = at + 1 if at % 2 == 0 else at - 1
    hops.append(_hop("cross", at, partner))
    at = partner
  step = 2 if dst > at else -2
  while at != dst:
    hops.append(_hop("rail", at, at + step))
    at += step
  return hops


def links_between(src: int, dst: int) -> int:
  """IPU-Links a copy from ``src`` to ``dst`` has at its narrowest hop
  (4 to the paired IPU, else 2)."""
  hops = route(src, dst)
  return min((link.count for link, _ in hops), default=0)


def link_bytes_per_second(src: int, dst: int) -> float:
  """The rate of one copy from ``src`` to ``dst`` with the links to itself."""
  return links_between(src, dst) * LINK_BYTES_PER_SECOND


def slot_copy_cycles(target: IPUTarget, copies: Sequence) -> float:
  """Cycles of the copies one slot makes at once (see the module docstring).

  Args:
    target: gives the clock and the exchange latency.
    copies: ``(src_ipu, dst_ipu, nbytes)`` triples; copies within one IPU and
      of no bytes cost nothing.

  Returns:
    When the last copy has arrived: over the copies, the most loaded
    (link, direction) on the copy's route, at the group's rate, plus one
    exchange latency per hop.
  """
  routes, load = [], {}
  for src, dst, nbytes in copies:
    if src == dst or nbytes <= 0:
      continue
    hops = route(src, dst)
    routes.append(hops)
    for hop in hops:
      load[hop] = load.get(hop, 0) + nbytes
  seconds = {hop: nbytes / (hop[0].count * LINK_BYTES_PER_SECOND) for hop, nbytes in load.items()}
  return max((max(seconds[h] for h in hops) * target.clock_hz
              + len(hops) * target.exchange_latency_cycles for hops in routes), default=0.0)


def copy_cycles(target: IPUTarget, src: int, dst: int, nbytes: int) -> float:
  """Cycles to copy ``nbytes`` from IPU ``src`` to IPU ``dst`` with the links
  to itself (0 if same IPU)."""
  return slot_copy_cycles(target, [(src, dst, nbytes)])


def all_reduce_cycles(target: IPUTarget, replicas: int, nbytes: int, ipu: int = 0,
                      ipus_per_replica: int | None = None) -> float:
  """A ring all-reduce of ``nbytes`` over ``replicas`` IPUs (one per replica).

  Each IPU sends and receives ``2 (R - 1) / R`` of the data over the 2 links
  to its ring neighbour, in ``2 (R - 1)`` steps, each ending in a sync.
  With ``target.system`` set, the all-reduce between IPU ``ipu`` of every
  replica (each of ``ipus_per_replica`` IPUs, default ``target.num_ipus``)
  is priced over the system's links instead
  (:func:`ipu_jax.kernels.collectives.all_reduce`).
  """
  if replicas <= 1 or nbytes <= 0:
    return 0.0
  if target.system is not None:
    groups = collectives.replica_groups(target.system, replicas,
                                        ipus_per_replica or target.num_ipus, [ipu])
    return collectives.all_reduce(target, groups, nbytes).cycles
  steps = 2 * (replicas - 1)
  moved = nbytes * steps / replicas
  per_step = target.exchange_latency_cycles + target.ipu_sync_cycles(replicas)
  return moved / (2 * LINK_BYTES_PER_SECOND) * target.clock_hz + steps * per_step
