"""One program for every point of a ``(dp, tp)`` mesh: :func:`spmd`.

The function is lowered ONCE by ``ipu_jax.jit`` on one shard's shapes with
the ``"replicas"`` (data-parallel) and ``"tp"`` (tensor-parallel) axes bound
around it, so its collectives lower to IPU-Link collectives priced over the
replica groups those axes make (``lowering/rules/parallel.py``:
``replica_layout``). It runs on every mesh point by nested ``jax.vmap`` of the
lowered program, as the training layer runs data-parallel replicas
(``ipu_jax/keras/replication.py``): the collectives compute the real
cross-shard values.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from ipu_jax import config as config_lib
from ipu_jax.jit import jit as ipu_jit
from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering.rules.parallel import binding_axes
from ipu_jax.parallel.groups import DP_AXIS, TP_AXIS
from ipu_jax.parallel.mesh import Mesh

__all__ = ["spmd", "SPMDFunction", "IN_KINDS", "OUT_KINDS"]

# Leading axes each input kind carries: replicated (none), [tp, ...],
# [dp, ...], [dp, tp, ...].
IN_KINDS = {"replicated": (), "tp_sharded": (TP_AXIS,), "dp_sharded": (DP_AXIS,),
            "sharded": (DP_AXIS, TP_AXIS)}
OUT_KINDS = ("replicated", "stacked")


def _kinds(kinds, count: int, valid, what: str) -> list:
  kinds = [kinds] * count if isinstance(kinds, str) else list(kinds)
  if len(kinds) != count:
    raise ValueError(f"spmd: {what} has {len(kinds)} entries for {count} "
                     f"{'arguments' if what == 'in_kinds' else 'outputs'}.")
  for i, kind in enumerate(kinds):
    if kind not in valid:
      raise ValueError(f"spmd: {what}[{i}] is {kind!r}; valid kinds are {list(valid)}.")
  return kinds


def _resolve_target(target, config):
  if isinstance(target, IPUTarget):
    return target
  if isinstance(target, str):
    return IPUTarget.preset(target)
  config = config if config is not None else config_lib.get_default_config()
  return config.to_target()


class SPMDFunction:
  """``fn`` on every point of ``mesh`` (see :func:`spmd`)."""

  def __init__(self, fn: Callable, mesh: Mesh, in_kinds, out_kinds, target=None, config=None):
    if not isinstance(mesh, Mesh):
      raise TypeError(f"spmd: mesh must be an ipu_jax.parallel.Mesh, got {type(mesh).__name__}.")
    self.fn, self.mesh = fn, mesh
    self.in_kinds, self.out_kinds = in_kinds, out_kinds
    self.target = _resolve_target(target, config)
    self.config = config
    mesh.check_fits(self.target)  # before anything is traced
    self._jitted = ipu_jit(fn, target=self.target, config=config)
    self._programs = {}

  # -- shapes ------------------------------------------------------------------

  def _shard_args(self, args) -> list:
    """One shard's abstract arguments (the leading mesh axes stripped)."""
    kinds = _kinds(self.in_kinds, len(args), IN_KINDS, "in_kinds")
    sizes = {DP_AXIS: self.mesh.dp, TP_AXIS: self.mesh.tp}
    out = []
    for i, (arg, kind) in enumerate(zip(args, kinds)):
      lead = tuple(sizes[a] for a in IN_KINDS[kind])

      def one(leaf, i=i, kind=kind, lead=lead):
        shape, dtype = np.shape(leaf), getattr(leaf, "dtype", np.asarray(leaf).dtype)
        if tuple(shape[:len(lead)]) != lead:
          raise ValueError(
              f"spmd: argument {i} is {kind!r}, so each of its arrays needs leading axes "
              f"{lead} ({' x '.join(IN_KINDS[kind])}); got shape {tuple(shape)}.")
        return jax.ShapeDtypeStruct(tuple(shape[len(lead):]), dtype)
      out.append(jax.tree.map(one, arg))
    return out

  def lower(self, *args):
    """The ``ipu_jax`` ``Lowered`` of one shard (report, profile), lowered
    once per argument shapes with both axes bound."""
    return self._program(args)[0]

  def _program(self, args):
    shard_args = self._shard_args(args)
    key = str(jax.tree.structure(shard_args)) + str(
        [(a.shape, str(a.dtype)) for a in jax.tree.leaves(shard_args)])
    if key not in self._programs:
      with binding_axes(self.mesh.axes):
        lowered = self._jitted.lower(*shard_args)
      self._programs[key] = (lowered, self._runner(lowered, args))
    return self._programs[key]

  # -- running -----------------------------------------------------------------

  def _runner(self, lowered, args):
    kinds = _kinds(self.in_kinds, len(args), IN_KINDS, "in_kinds")
    leaf_kinds = [k for a, k in zip(args, kinds) for _ in jax.tree.leaves(a)]
    out_kinds = self._out_leaf_kinds(lowered.out_tree)

    def point(state, *flat):
      outs, new_state = lowered.apply_with_state(state, *flat)
      return jax.tree.leaves(outs), new_state

    tp_axes = [0 if TP_AXIS in IN_KINDS[k] else None for k in leaf_kinds]
    dp_axes = [0 if DP_AXIS in IN_KINDS[k] else None for k in leaf_kinds]
    inner = jax.vmap(point, in_axes=[None] + tp_axes, axis_name=TP_AXIS,
                     axis_size=self.mesh.tp)
    outer = jax.vmap(inner, in_axes=[None] + dp_axes, axis_name=DP_AXIS,
                     axis_size=self.mesh.dp)

    def run(state, *flat):
      outs, new_state = outer(state, *flat)
      outs = [o[0, 0] if k == "replicated" else o for o, k in zip(outs, out_kinds)]
      # Point (0, 0)'s generators carry on, as replica 0's do in training.
      return outs, [s[0, 0] for s in new_state]

    return jax.jit(run)

  def _out_leaf_kinds(self, out_tree) -> list:
    """The kind of each output leaf (``out_kinds`` is per top-level output)."""
    n = out_tree.num_leaves
    if isinstance(self.out_kinds, str):
      return _kinds(self.out_kinds, n, OUT_KINDS, "out_kinds")
    top = jax.tree_util.tree_unflatten(out_tree, list(range(n)))
    tops = list(top) if isinstance(top, (tuple, list)) else [top]
    per_top = _kinds(self.out_kinds, len(tops), OUT_KINDS, "out_kinds")
    return [k for t, k in zip(tops, per_top) for _ in jax.tree.leaves(t)]

  def __call__(self, *args):
    lowered, runner = self._program(args)
    outs, state = runner(lowered.device_state, *jax.tree.leaves(list(args)))
    if state:
      lowered.set_device_state(state)
    return jax.tree_util.tree_unflatten(lowered.out_tree, outs)


def spmd(fn: Callable, mesh: Mesh, in_kinds, out_kinds, target=None, config=None) -> SPMDFunction:
  """``fn`` run on every point of a ``(dp, tp)`` mesh from ONE lowered program.

  Args:
    fn: one shard's function; it may use the tensor-parallel ops
      (:mod:`ipu_jax.parallel.ops`) and any collective over ``"tp"`` /
      ``"replicas"``.
    mesh: the :class:`Mesh`.
    in_kinds: per positional argument (or one for all): ``"replicated"`` (the
      same on every point), ``"tp_sharded"`` (leading ``[tp, ...]``),
      ``"dp_sharded"`` (leading ``[dp, ...]``), ``"sharded"`` (``[dp, tp, ...]``).
    out_kinds: per top-level output (or one for all): ``"replicated"`` (point
      ``(0, 0)``'s value) or ``"stacked"`` (``[dp, tp, ...]``).
    target: the target of ONE shard (an ``IPUTarget`` or preset name; its
      ``system`` prices the IPU-Link collectives); default the config's.
    config: an ``ipu_jax.IPUConfig`` to lower with.

  Returns:
    A callable; ``.lower(*args)`` gives the ``ipu_jax`` ``Lowered`` (report,
    profile: the tensor-parallel all-reduces are its collective steps).

  Raises:
    ValueError: the mesh needs more IPUs than the target's system has
      (naming the counts), bad kinds, or arguments without the leading axes
      their kind needs -- before anything is traced.
  """
  return SPMDFunction(fn, mesh, in_kinds, out_kinds, target=target, config=config)
