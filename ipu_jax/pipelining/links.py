"""What crossing IPUs costs: IPU-Link copies and syncs across IPUs.

Facts (docs/hardware.md#between-ipus-ipu-links-the-m2000-ladder-and-syncs:
Graphcore's multi-IPU IPUModel set-up in the open-source poplibs,
lib/poplibs_test/Util.cpp, and the IPU-M2000 datasheet): one IPU-Link moves 128 Gibit/s per
direction at about 0.85 efficiency; the M2000 ladder gives each IPU 4 links
to its paired IPU (IPUs 2i and 2i+1) and 2 links to each other neighbour, so
a copy to the paired IPU moves ~58 GB/s and to another IPU ~29 GB/s -- a
pipeline's inter-stage copy is not costed at the 320 GB/s aggregate. A sync
across IPUs costs :meth:`IPUTarget.ipu_sync_cycles` (IPUModel's figure), the
same function a multi-IPU program's cross-IPU supersteps are costed with.
"""

from __future__ import annotations

from ipu_jax.kernels.target import IPUTarget

__all__ = ["LINK_BYTES_PER_SECOND", "links_between", "link_bytes_per_second",
           "copy_cycles", "all_reduce_cycles"]

# One IPU-Link, one direction, at the efficiency IPUModel assumes.
LINK_BYTES_PER_SECOND = 128 * 2**30 / 8 * 0.85


def links_between(src: int, dst: int) -> int:
  """IPU-Links between two IPUs of an M2000 ladder (4 to the pair, else 2)."""
  return 4 if src // 2 == dst // 2 else 2


def link_bytes_per_second(src: int, dst: int) -> float:
  return links_between(src, dst) * LINK_BYTES_PER_SECOND


def copy_cycles(target: IPUTarget, src: int, dst: int, nbytes: int) -> float:
  """Cycles to copy ``nbytes`` from IPU ``src`` to IPU ``dst`` (0 if same IPU).

  Copies further along the ladder pass through one IPU per rung, each adding
  an exchange latency.
  """
  if src == dst or nbytes <= 0:
    return 0.0
  hops = max(1, abs(src // 2 - dst // 2))
  seconds = nbytes / link_bytes_per_second(src, dst)
  return seconds * target.clock_hz + hops * target.exchange_latency_cycles


def all_reduce_cycles(target: IPUTarget, replicas: int, nbytes: int) -> float:
  """A ring all-reduce of ``nbytes`` over ``replicas`` IPUs (one per replica).

  Each IPU sends and receives ``2 (R - 1) / R`` of the data over the 2 links
  to its ring neighbour, in ``2 (R - 1)`` steps, each ending in a sync.
  """
  if replicas <= 1 or nbytes <= 0:
    return 0.0
  steps = 2 * (replicas - 1)
  moved = nbytes * steps / replicas
  per_step = target.exchange_latency_cycles + target.ipu_sync_cycles(replicas)
  return moved / (2 * LINK_BYTES_PER_SECOND) * target.clock_hz + steps * per_step
