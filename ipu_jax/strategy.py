"""``ipu_jax.IPUStrategy``: the TensorFlow IPUStrategy of ipu-jax.

::

    cfg = ipu_jax.IPUConfig()
    cfg.device.tiles_per_ipu = 16
    strategy = ipu_jax.IPUStrategy(cfg)
    with strategy.scope():                 # cfg is the default config inside
      model = ipu_jax.keras.Model(module)  # built and compiled for cfg
      model.compile(...)
      model.fit(...)
    y = strategy.run(fn, args=(x,))        # fn as a tile program on the emulated IPU
    print(strategy.last_report.summary())

Inside ``scope()`` every ``ipu_jax.jit`` without an explicit config, and
every :class:`ipu_jax.keras.Model` built or compiled there, uses the
strategy's config.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import weakref
from typing import Callable, Iterator, Optional

import jax
import jax.numpy as jnp

from ipu_jax import config as config_lib

__all__ = ["IPUStrategy", "get_strategy"]

_CURRENT: contextvars.ContextVar[Optional["IPUStrategy"]] = contextvars.ContextVar(
    "ipu_jax_strategy", default=None)


def get_strategy() -> Optional["IPUStrategy"]:
  """The strategy of the innermost active ``scope()``, or None."""
  return _CURRENT.get()


class IPUStrategy:
  """Runs computations on the emulated IPU system a config describes.

  Args:
    config: an :class:`ipu_jax.IPUConfig` (default: a default config). It is
      checked now: a bad target raises ``ValueError`` here, not later.

  Attributes:
    config: the config (the object itself: changes made to it are seen by
      programs compiled afterwards).
    last_report: the report of the program last run by :meth:`run`.
  """

  def __init__(self, config: Optional[config_lib.IPUConfig] = None):
    if config is None:
      config = config_lib.IPUConfig()
    if not isinstance(config, config_lib.IPUConfig):
      raise TypeError(f"IPUStrategy expects an ipu_jax.IPUConfig; got {config!r} of "
                      f"type {type(config).__name__}.")
    config.to_target()  # validates the target now
    self.config = config
    self.last_report = None
    self._functions: "weakref.WeakKeyDictionary|dict" = weakref.WeakKeyDictionary()
    self._strong: dict = {}
    self._replications: dict = {}
    # Jitted replicated runners by program, under the IPUFunction that holds
    # the program: they go when the function does.
    self._runners: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

  def __repr__(self):
    return f"IPUStrategy({self.config!r})"

  @property
  def num_replicas_in_sync(self) -> int:
    """Replicas of the whole run: replication_factor x processes."""
    return self.config.replication_factor * jax.process_count()

  @contextlib.contextmanager
  def scope(self) -> Iterator["IPUStrategy"]:
    """Makes this strategy's config the default inside the ``with`` block."""
    token = _CURRENT.set(self)
    try:
      with config_lib.default_config(self.config):
        yield self
    finally:
      _CURRENT.reset(token)

  def _function(self, fn: Callable):
    import ipu_jax

    def call(args, kwargs):
      return fn(*args, **kwargs)

    call.__name__ = getattr(fn, "__name__", "fn")
    try:
      cache = self._functions.setdefault(fn, {})
    except TypeError:  # not weak-referenceable
      cache = self._strong.setdefault(fn, {})
    key = (self.config.replication_factor * jax.process_count(),
           repr(self.config.to_dict()))
    if key not in cache:
      cfg = self.config.copy()
      cfg.replication_factor = key[0]
      cache[key] = ipu_jax.jit(call, config=cfg)
    return cache[key]

  def run(self, fn: Callable, args=(), kwargs: Optional[dict] = None):
    """Runs ``fn(*args, **kwargs)`` as a tile program on the emulated IPU.

    With one replica the result is ``fn``'s output. With R replicas
    (``replication_factor`` > 1) every replica runs the same program on the
    same arguments (``ipu_jax.ops.replica_index()`` tells them apart, and
    ``ipu_jax.ops.cross_replica_sum`` combines them), and each output gains
    a leading axis of the replicas, as TensorFlow's ``PerReplica`` values;
    :meth:`reduce` combines them.

    Lowered programs are cached per function and argument shapes.
    """
    if not isinstance(args, (tuple, list)):
      # An array would be unpacked row by row into fn's arguments.
      raise TypeError(f"IPUStrategy.run: args must be a tuple of fn's positional arguments, "
                      f"e.g. args=(x,); got {type(args).__name__}.")
    kwargs = dict(kwargs or {})
    args = tuple(args)
    ipu_fn = self._function(fn)
    replicas = self.num_replicas_in_sync
    lowered = ipu_fn.lower(args, kwargs)
    self.last_report = lowered.report
    if replicas == 1:
      return lowered(args, kwargs)
    from ipu_jax.keras.replication import GATHERED, REPLICATED, Replication
    rep = self._replications.get(self.config.replication_factor)
    if rep is None:
      rep = self._replications[self.config.replication_factor] = Replication(
          self.config.replication_factor)
    flat, _ = jax.tree_util.tree_flatten([args, kwargs])
    out_tree = lowered.out_tree
    # The device state (the stochastic rounding generators) goes in and out,
    # so the next run continues the streams as a single-replica call does;
    # replica 0's carries on (with esr "ON" each replica perturbs it by its
    # index when it draws).
    num_state = len(lowered.device_state)
    # One jitted runner per program and replication: building it per call
    # traced and compiled the replicated step again on every run. The runner
    # holds ``lowered``, so its id stays unique while the entry lives.
    runners = self._runners.setdefault(ipu_fn, {})
    key = (id(lowered), self.config.replication_factor)
    runner = runners.get(key)
    if runner is None:
      def per_replica(*leaves):
        out, state = lowered.apply_with_state(leaves[:num_state], *leaves[num_state:])
        return jax.tree_util.tree_leaves(out) + list(state)

      runner = runners[key] = rep.build(
          per_replica, [REPLICATED] * (num_state + len(flat)),
          [GATHERED] * out_tree.num_leaves + [REPLICATED] * num_state)
    outs = runner(*rep.replicate(lowered.device_state), *rep.replicate(flat))
    if num_state:
      lowered.set_device_state(outs[len(outs) - num_state:])
      outs = outs[:len(outs) - num_state]
    outs = [rep.fetch_gathered(o) if rep.num_processes > 1 else o for o in outs]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  def set_seed(self, seed: Optional[int] = None) -> None:
    """Reseeds the tiles' generators of every program :meth:`run` compiled.

    Between runs the stochastic rounding generators continue where the last
    run of that program ended, as on the chip; after ``set_seed`` the next
    run of each draws the bits its first run drew with that seed
    (:meth:`ipu_jax.Lowered.set_seed`, Poplar's ``setSeed``).

    Args:
      seed: an int >= 0; None: ``floating_point_behaviour.seed`` of the config
        each program was compiled with.

    Raises:
      TypeError / ValueError: ``seed`` is not an int >= 0 (checked even before
        any program was compiled).
    """
    if seed is not None:
      if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"IPUStrategy.set_seed: seed must be an int >= 0 or None; got "
                        f"{seed!r}.")
      if seed < 0:
        raise ValueError(f"IPUStrategy.set_seed: seed must be an int >= 0 or None; got {seed}.")
    for cache in (*self._functions.values(), *self._strong.values()):
      for ipu_fn in cache.values():
        ipu_fn.set_seed(seed)

  def reduce(self, reduce_op: str, value, axis: Optional[int] = 0):
    """Combines per-replica values (a leading replica axis) by ``"sum"`` or ``"mean"``."""
    op = str(getattr(reduce_op, "name", reduce_op)).lower()
    if op not in ("sum", "mean"):
      raise ValueError(f"reduce_op must be 'sum' or 'mean'; got {reduce_op!r}.")
    if self.num_replicas_in_sync == 1 or axis is None:
      return value
    fn = jnp.sum if op == "sum" else jnp.mean
    return jax.tree.map(lambda v: fn(v, axis=axis), value)
