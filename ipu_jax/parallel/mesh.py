"""The replica layout of tensor and data parallelism: :class:`Mesh`."""

from __future__ import annotations

import dataclasses
import numbers

from ipu_jax.parallel.groups import DP_AXIS, TP_AXIS, ReplicaGrouping

__all__ = ["Mesh"]


@dataclasses.dataclass(frozen=True)
class Mesh:
  """``dp`` data-parallel replicas of a model split over ``tp`` IPUs.

  Attributes:
    dp: data-parallel replicas (the ``"replicas"`` axis, outermost).
    tp: tensor-parallel shards of one replica (the ``"tp"`` axis).
  """

  dp: int = 1
  tp: int = 1

  def __post_init__(self):
    for field in ("dp", "tp"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"Mesh.{field} must be a positive integer, got {value!r}.")

  @property
  def num_replicas(self) -> int:
    """Points of the mesh: one replica of the lowered program each."""
    return self.dp * self.tp

  @property
  def axes(self) -> tuple:
    """``((DP_AXIS, dp), (TP_AXIS, tp))``: outermost first, as they are bound."""
    return ((DP_AXIS, self.dp), (TP_AXIS, self.tp))

  @property
  def tp_grouping(self) -> ReplicaGrouping:
    """The tensor-parallel groups: ``tp`` consecutive replicas."""
    return ReplicaGrouping(self.tp, 1)

  @property
  def dp_grouping(self) -> ReplicaGrouping:
    """The data-parallel groups: ``dp`` replicas ``tp`` apart."""
    return ReplicaGrouping(self.dp, self.tp)

  def num_ipus_for(self, ipus_per_replica: int = 1) -> int:
    return self.num_replicas * int(ipus_per_replica)

  @property
  def num_ipus(self) -> int:
    """IPUs of the layout with one IPU per shard (``dp * tp``)."""
    return self.num_replicas

  def check_fits(self, target) -> None:
    """``ValueError`` when the target's system has too few IPUs for the mesh.

    Each mesh point runs the program on ``target.num_ipus`` IPUs; the message
    names the counts (``dp``, ``tp``, IPUs per shard, the system's IPUs).
    """
    system = getattr(target, "system", None)
    if system is None:
      return
    needed = self.num_replicas * target.num_ipus
    if needed > system.num_ipus:
      raise ValueError(
          f"Mesh(dp={self.dp}, tp={self.tp}) with {target.num_ipus} IPU(s) per shard needs "
          f"dp x tp x ipus = {self.dp} x {self.tp} x {target.num_ipus} = {needed} IPUs; the "
          f"{system.name} system has {system.num_ipus}. Use a larger system or a smaller "
          f"mesh.")
