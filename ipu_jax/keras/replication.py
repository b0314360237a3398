"""Data-parallel replicas of one tile program.

Every replica runs the SAME compiled tile program (``Lowered.apply``) on its
own micro-batches; the gradients meet in the cross-replica all-reduce
(``ipu_jax.ops.cross_replica_sum`` / ``cross_replica_mean``, named axis
``"replicas"``), which the lowering costs as a ring all-reduce over IPU-Links.
Where the replicas run:

* one replica: the program is called directly;
* as many JAX devices as replicas (``XLA_FLAGS=--xla_force_host_platform_device_count=N``,
  or several processes joined by ``jax.distributed``): ``jax.shard_map`` over a
  one-axis mesh named ``"replicas"``, one replica per device;
* otherwise (one process): ``jax.vmap(..., axis_name="replicas")``.

Across processes the replication factor of the config counts the replicas of
this process (as PopDist's local replicas do); the run has
``replication_factor x jax.process_count()`` replicas in all, replica
``process_index * replication_factor + i`` being this process's ``i``-th.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# One meaning per name: the replica axis and its all-reduces are the IPU ops'
# (arrays or pytrees, over ``REPLICA_AXIS`` unless told otherwise).
from ipu_jax.ops.collectives import REPLICA_AXIS, cross_replica_mean, cross_replica_sum

__all__ = ["REPLICA_AXIS", "Replication", "cross_replica_sum", "cross_replica_mean",
           "initialize_distributed"]

# Input kinds: "replicated" (the same on every replica) or "sharded" (a
# leading replica axis). Output kinds: "replicated" (equal on every replica,
# replica 0's is returned), "summed" (added over replicas) or "gathered"
# (stacked along a leading replica axis).
REPLICATED, SHARDED, SUMMED, GATHERED = "replicated", "sharded", "summed", "gathered"


def initialize_distributed(coordinator_address: str, num_processes: int,
                           process_id: int, local_device_count: int = 0):
  """Joins a multi-process run with JAX's own distributed runtime.

  Uses CPU collectives (gloo) so replicas in different processes can
  all-reduce on a host without accelerators. Call it before anything touches
  a JAX backend.

  Args:
    coordinator_address: ``host:port`` of process 0.
    num_processes: processes in the run.
    process_id: this process's index.
    local_device_count: CPU devices this process exposes (one per local
      replica); 0 leaves JAX's default.
  """
  if local_device_count:
    jax.config.update("jax_num_cpu_devices", int(local_device_count))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)


class Replication:
  """How the ``local_replicas`` replicas of this process run.

  Attributes:
    local_replicas: replicas held by this process.
    num_replicas: replicas in the whole run (all processes).
    first_replica: global index of this process's first replica.
    mode: ``"single"``, ``"devices"`` (shard_map) or ``"vmap"``.
    mesh: the device mesh (``"devices"`` mode only).
  """

  def __init__(self, local_replicas: int):
    if local_replicas < 1:
      raise ValueError(f"replication_factor must be >= 1; got {local_replicas}.")
    self.local_replicas = int(local_replicas)
    self.num_processes = jax.process_count()
    self.num_replicas = self.local_replicas * self.num_processes
    self.first_replica = jax.process_index() * self.local_replicas
    self.mesh = None
    if self.num_replicas == 1:
      self.mode = "single"
      return
    by_process = {}
    for device in jax.devices():
      by_process.setdefault(device.process_index, []).append(device)
    enough = all(len(by_process.get(p, [])) >= self.local_replicas
                 for p in range(self.num_processes))
    if enough:
      self.mode = "devices"
      devices = [d for p in range(self.num_processes)
                 for d in sorted(by_process[p], key=lambda d: d.id)[:self.local_replicas]]
      self.mesh = Mesh(np.array(devices), (REPLICA_AXIS,))
    elif self.num_processes == 1:
      self.mode = "vmap"
    else:
      counts = {p: len(v) for p, v in sorted(by_process.items())}
      raise ValueError(
          f"{self.num_processes} processes with replication_factor="
          f"{self.local_replicas} need {self.local_replicas} JAX devices in each "
          f"process; they have {counts}. Start each process with "
          f"XLA_FLAGS=--xla_force_host_platform_device_count={self.local_replicas} "
          "(or jax.config.update('jax_num_cpu_devices', n) before JAX starts).")

  def __repr__(self):
    return (f"Replication(local_replicas={self.local_replicas}, "
            f"num_replicas={self.num_replicas}, mode={self.mode!r})")

  @property
  def replica_ids(self) -> np.ndarray:
    """Global indices of this process's replicas."""
    return np.arange(self.first_replica, self.first_replica + self.local_replicas,
                     dtype=np.int32)

  # -- placing and fetching ---------------------------------------------------

  def replicate(self, tree):
    """Puts a pytree (equal on every process) on the replicas' devices."""
    if self.mode != "devices":
      # device_put, not jnp.asarray: that compiles a program per batch shape.
      # A JAX array stays where it is (a device_put of it does nothing but
      # costs microseconds per leaf: a fifth of a one-execution fit's call).
      return jax.tree.map(
          lambda x: x if isinstance(x, jax.Array) else jax.device_put(x), tree)
    sharding = NamedSharding(self.mesh, P())

    def put(x):
      if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
      if self.num_processes > 1 and isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x
      x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
      if self.num_processes == 1:
        return jax.device_put(x, sharding)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = self.replicate(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
      return jax.make_array_from_process_local_data(sharding, np.asarray(x), x.shape)

    return jax.tree.map(put, tree)

  def shard(self, tree):
    """Places arrays with a leading axis of this process's replicas."""
    if self.mode != "devices":
      # device_put, not jnp.asarray: that compiles a program per batch shape.
      return jax.tree.map(jax.device_put, tree)
    sharding = NamedSharding(self.mesh, P(REPLICA_AXIS))

    def put(x):
      x = np.asarray(x)
      global_shape = (self.num_replicas,) + x.shape[1:]
      if self.num_processes == 1:
        return jax.device_put(x, sharding)
      return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return jax.tree.map(put, tree)

  def feed(self, tree):
    """One execution's batch for the program: :meth:`shard` across devices; on one
    device the host arrays as they are (the jitted program's dispatch copies them
    in, where a Python ``device_put`` per array was a tenth of a one-epoch fit)."""
    return self.shard(tree) if self.mode == "devices" else tree

  def fetch(self, tree):
    """A pytree of replicated arrays as host NumPy arrays."""
    def get(x):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
      if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return x
      return np.asarray(x)
    return jax.tree.map(get, tree)

  def local(self, tree):
    """Replicated arrays as arrays of this process (usable outside the run)."""
    def get(x):
      if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
      return x
    return jax.tree.map(get, tree)

  def fetch_gathered(self, x) -> np.ndarray:
    """A ``gathered`` output as ``[num_replicas, ...]`` on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)

  # -- running ------------------------------------------------------------------

  def build(self, fn: Callable, in_kinds: Sequence[str], out_kinds: Sequence[str]):
    """Runs ``fn`` (flat leaves in, flat list out, one replica) on every replica.

    Args:
      fn: the per-replica function of flat arrays.
      in_kinds: for each input, ``"replicated"`` or ``"sharded"`` (the caller
        passes it with a leading axis of this process's replicas).
      out_kinds: for each output, ``"replicated"``, ``"summed"`` or
        ``"gathered"``.

    Returns:
      A jitted function of the flat inputs giving the flat outputs.
    """
    in_kinds, out_kinds = list(in_kinds), list(out_kinds)

    if self.mode == "single":
      def single(*args):
        args = [a[0] if k == SHARDED else a for a, k in zip(args, in_kinds)]
        outs = list(fn(*args))
        return [o[None] if k == GATHERED else o for o, k in zip(outs, out_kinds)]
      return jax.jit(single)

    if self.mode == "vmap":
      mapped = jax.vmap(lambda *a: list(fn(*a)),
                        in_axes=[0 if k == SHARDED else None for k in in_kinds],
                        out_axes=0, axis_name=REPLICA_AXIS,
                        axis_size=self.local_replicas)

      def vmapped(*args):
        outs = mapped(*args)
        result = []
        for o, k in zip(outs, out_kinds):
          if k == REPLICATED:
            o = o[0]
          elif k == SUMMED:
            o = jnp.sum(o, axis=0)
          result.append(o)
        return result
      return jax.jit(vmapped)

    def per_device(*args):
      args = [a[0] if k == SHARDED else a for a, k in zip(args, in_kinds)]
      outs = list(fn(*args))
      result = []
      for o, k in zip(outs, out_kinds):
        if k == SUMMED:
          o = jax.lax.psum(o, REPLICA_AXIS)  # host-side gathering of metrics
        elif k == GATHERED:
          o = o[None]
        result.append(o)
      return result

    mapped = jax.shard_map(
        per_device, mesh=self.mesh,
        in_specs=tuple(P(REPLICA_AXIS) if k == SHARDED else P() for k in in_kinds),
        out_specs=[P(REPLICA_AXIS) if k == GATHERED else P() for k in out_kinds],
        check_vma=False)
    return jax.jit(lambda *args: mapped(*args))
