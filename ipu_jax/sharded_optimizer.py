"""An optimizer's update run on replica shards: replicated tensor sharding of any program.

With replicated tensor sharding (RTS) each of R replicas holds one R-th of every
weight's optimizer state and updates one R-th of the weight. An elementwise
optimizer (SGD, Adam) can simply be applied to each shard, but many cannot:
LAMB's trust ratio divides by ``||w||`` and ``||update||`` of the *whole*
weight, and global-norm clipping by the norm of all the gradients. Applied to a
shard they would use the shard's norm, a different number on every replica.

So the update is sharded *as a program*: ``optimizer.update`` followed by
``optax.apply_updates`` is traced on full-size leaves to a jaxpr, and
:class:`ShardedUpdate` runs that jaxpr on shards with a small SPMD interpreter.
Each value is one of

* replicated: a full array, the same on every replica (step counts, norms,
  learning rates);
* a splat: a scalar broadcast to a full shape (``jnp.ones_like(w)``), kept as
  the scalar until it meets a shard;
* sharded: this replica's ``[n]`` elements ``[r n, (r + 1) n)`` of the leaf
  flattened in row-major order and zero-padded to ``R n`` elements
  (``n = ceil(size / R)``), with the leaf's full shape.

The interpreter's rules:

* elementwise primitives apply to the shards; replicated scalars broadcast,
  splats become shard-sized broadcasts, a replicated full array is cut to this
  replica's shard;
* shape changes that keep the row-major order (``reshape``, ``squeeze``, a
  broadcast that only adds unit axes) change only the full shape;
* a reduction over *every* axis of a sharded value reduces the shard's valid
  elements (the padding masked by the reduction's identity), then combines the
  R partial results across the replicas: a sum with
  :func:`ipu_jax.ops.cross_replica_sum` (a scalar all-reduce: small, latency
  bound, costed by its tile rule as the collective it is), max / min / and /
  or by all-gathering the R partials
  (:func:`ipu_jax.ops.cross_replica_all_gather`) and reducing them;
* ``jit`` / ``pjit`` and ``custom_jvp`` / ``custom_vjp`` calls are interpreted
  through their bodies; a ``cond`` / ``switch`` on a replicated index runs its
  branches interpreted (an output sharded in one branch is sharded in all), as
  ``optax.MultiSteps`` and ``optax.apply_if_finite`` need;
* anything else that reads a sharded value (a transpose, a partial
  reduction, a dot, a gather, a sort, a loop ...) mixes elements of
  different shards: :class:`ShardedOptimizerError` names the primitive, the
  optimizer and the source line, raised while the program is traced, before
  anything runs.

Which leaves are sharded: every weight and optimizer-state leaf with at least
one axis; scalar leaves (step counts, a scalar weight and its moments) are
replicated and updated whole on every replica.

Used by ``ipu_jax/keras/offload.py`` (the Keras-like ``fit``) and
``ipu_jax/pipelining/weight_update.py`` (``Pipeline``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ipu_jax.lowering.jax_compat import source_info_util
from ipu_jax.lowering.lower import source_of
from ipu_jax.ops.collectives import REPLICA_AXIS, cross_replica_sum
from ipu_jax.ops.sharded_collectives import cross_replica_all_gather

__all__ = ["ShardedOptimizerError", "ShardedUpdate", "shard_length", "is_sharded_leaf",
           "shard_leaf", "gather_leaf", "shard_tree", "sharded_bytes"]


class ShardedOptimizerError(ValueError):
  """The optimizer's update cannot be run on replica shards."""


# -- the layout of a shard ---------------------------------------------------------


def shard_length(size: int, replicas: int) -> int:
  """Elements of one replica's shard of a leaf of ``size`` elements."""
  return -(-int(size) // replicas)


def is_sharded_leaf(x) -> bool:
  """Whether a weight or state leaf is sharded (it has an axis) or replicated (a scalar)."""
  return len(np.shape(x)) > 0


def _flat_padded(x, replicas: int):
  flat = jnp.reshape(x, (-1,))
  return jnp.pad(flat, (0, shard_length(flat.size, replicas) * replicas - flat.size))


def _shard(x, replica, replicas: int):
  n = shard_length(np.size(x), replicas)
  return lax.dynamic_slice_in_dim(_flat_padded(x, replicas), replica * n, n)


# Concrete leaves are cut by one compiled program per shape for every replica,
# not by the three eager operations (each compiled per shape) ``_shard`` runs.
_shard_concrete = jax.jit(_shard, static_argnums=2)


def shard_leaf(x, replica, replicas: int):
  """Replica ``replica``'s ``[n]`` shard of ``x`` (traceable in ``replica``)."""
  if isinstance(x, jax.ShapeDtypeStruct):  # shapes only (an --estimate_only lowering)
    return jax.ShapeDtypeStruct((shard_length(int(np.prod(x.shape)), replicas),), x.dtype)
  if isinstance(x, jax.core.Tracer) or isinstance(replica, jax.core.Tracer):
    return _shard(x, replica, replicas)
  return _shard_concrete(x, replica, replicas)


def shard_tree(tree, replica, replicas: int):
  """Every sharded leaf of ``tree`` cut to the replica's shard; scalars kept whole."""
  return jax.tree.map(
      lambda x: shard_leaf(x, replica, replicas) if is_sharded_leaf(x) else x, tree)


def gather_leaf(full_flat, like):
  """The all-gathered ``[R n]`` vector of a leaf back in ``like``'s shape and dtype."""
  return jnp.reshape(full_flat[:np.size(like)], np.shape(like)).astype(like.dtype)


def sharded_bytes(tree, replicas: int) -> int:
  """Bytes of the sharded leaves of ``tree`` with their padding (all R shards)."""
  return int(sum(shard_length(np.size(x), replicas) * replicas * np.dtype(x.dtype).itemsize
                 for x in jax.tree.leaves(tree) if is_sharded_leaf(x)))


# -- values of the interpreter ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Sharded:
  """This replica's shard of a value of full shape ``shape``."""
  shard: Any
  shape: tuple


@dataclasses.dataclass(frozen=True)
class _Splat:
  """A scalar broadcast to ``shape``."""
  scalar: Any
  shape: tuple


# Pytrees (the array a child, the full shape static), so a branch of a ``cond``
# can take and return them.
for _kind, _field in ((_Sharded, "shard"), (_Splat, "scalar")):
  jax.tree_util.register_dataclass(_kind, data_fields=[_field], meta_fields=["shape"])


_ELEMENTWISE = frozenset({
    lax.neg_p, lax.sign_p, lax.floor_p, lax.ceil_p, lax.round_p, lax.is_finite_p, lax.exp_p,
    lax.exp2_p, lax.log_p, lax.log1p_p, lax.expm1_p, lax.tanh_p, lax.logistic_p, lax.sin_p,
    lax.cos_p, lax.sqrt_p, lax.rsqrt_p, lax.cbrt_p, lax.abs_p, lax.not_p, lax.erf_p,
    lax.square_p, lax.integer_pow_p, lax.convert_element_type_p, lax.reduce_precision_p,
    lax.real_p, lax.conj_p, lax.copy_p, lax.add_p, lax.sub_p, lax.mul_p, lax.div_p, lax.rem_p,
    lax.pow_p, lax.max_p, lax.min_p, lax.atan2_p, lax.and_p, lax.or_p, lax.xor_p, lax.eq_p,
    lax.ne_p, lax.lt_p, lax.le_p, lax.gt_p, lax.ge_p, lax.select_n_p, lax.clamp_p,
    lax.nextafter_p,
})

# Reductions: the jnp function that reduces a shard, and the dtype the
# partial results cross the replicas in (booleans as int32).
_REDUCTIONS = {
    lax.reduce_sum_p: jnp.sum, lax.reduce_max_p: jnp.max, lax.reduce_min_p: jnp.min,
    lax.reduce_and_p: jnp.all, lax.reduce_or_p: jnp.any,
}

_ORDER_KEEPING = frozenset({lax.reshape_p, lax.squeeze_p, lax.broadcast_in_dim_p})


def _identity(prim, dtype):
  """The element a reduction ignores (what the zero padding is replaced by)."""
  if prim is lax.reduce_sum_p:
    return np.zeros((), dtype)
  if prim in (lax.reduce_and_p, lax.reduce_or_p):
    return np.asarray(prim is lax.reduce_and_p)
  big = prim is lax.reduce_min_p
  if jnp.issubdtype(dtype, jnp.floating):
    return np.asarray(np.inf if big else -np.inf, dtype)
  info = np.iinfo(dtype)
  return np.asarray(info.max if big else info.min, dtype)


def _call_jaxpr(eqn):
  """The closed body of a call-like equation (jit, custom_jvp/vjp), else None."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    body = eqn.params.get(key)
    if isinstance(body, jcore.ClosedJaxpr):
      return body
    if isinstance(body, jcore.Jaxpr):
      return jcore.ClosedJaxpr(body, ())
  return None


# -- the interpreter --------------------------------------------------------------------


@dataclasses.dataclass
class _Interpreter:
  """Runs a jaxpr on this replica's shards (see the module docstring).

  Attributes:
    replica: this replica's index (a traced int32 scalar).
    replicas: R.
    optimizer_name: for errors.
    calls: the call equations being interpreted, outermost first (for errors).
  """
  replica: Any
  replicas: int
  optimizer_name: str
  calls: list = dataclasses.field(default_factory=list)

  def run(self, closed: jcore.ClosedJaxpr, args: Sequence[Any]) -> list:
    env = {}

    def read(v):
      return v.val if isinstance(v, jcore.Literal) else env[v]

    for var, value in zip(closed.jaxpr.constvars, closed.consts):
      env[var] = value
    for var, value in zip(closed.jaxpr.invars, args):
      env[var] = value
    for eqn in closed.jaxpr.eqns:
      # Keep the equation's source line on what it becomes (the report's lines).
      with source_info_util.user_context(eqn.source_info.traceback,
                                         name_stack=eqn.source_info.name_stack):
        outs = self.equation(eqn, [read(v) for v in eqn.invars])
      for var, value in zip(eqn.outvars, outs):
        env[var] = value
    return [read(v) for v in closed.jaxpr.outvars]

  # -- helpers -------------------------------------------------------------------

  def _fail(self, eqn, why: str):
    # Equations inside a jitted helper (jnp.linalg.norm) may carry no line:
    # then the line of the call that holds them.
    lines = [source_of(e) for e in [eqn] + self.calls[::-1]]
    where = next((line for line in lines if line), "an unknown line")
    raise ShardedOptimizerError(
        f"Replicated tensor sharding cannot run the optimizer {self.optimizer_name} on "
        f"shards: its update applies '{eqn.primitive.name}' to a sharded value ({why}) at "
        f"{where}. Sharded updates take elementwise operations, reshapes and reductions "
        "over whole weights (norms); turn off streaming.replicated_tensor_sharding or use "
        "an optimizer built from those.")

  def _length(self, shape) -> int:
    return shard_length(int(np.prod(shape, dtype=np.int64)), self.replicas)

  def materialize(self, value):
    """A replicated full array of a splat (other values unchanged)."""
    if isinstance(value, _Splat):
      return jnp.broadcast_to(value.scalar, value.shape)
    return value

  def as_shard(self, value, shape):
    """``value`` (of full shape ``shape``) as this replica's shard."""
    if isinstance(value, _Sharded):
      return value.shard
    if isinstance(value, _Splat):
      return jnp.broadcast_to(value.scalar, (self._length(shape),))
    if np.ndim(value) == 0:
      return value  # rank-0 operands broadcast in lax's elementwise ops
    return shard_leaf(value, self.replica, self.replicas)

  def gathered(self, value: _Sharded):
    """The full array of a sharded value (an all-gather)."""
    full = cross_replica_all_gather(value.shard, self.replicas, REPLICA_AXIS)
    size = int(np.prod(value.shape, dtype=np.int64))
    return jnp.reshape(full[:size], value.shape)

  # -- equations -----------------------------------------------------------------

  def equation(self, eqn, values):
    body = _call_jaxpr(eqn)
    if body is not None and any(isinstance(v, (_Sharded, _Splat)) for v in values):
      inner = values[len(values) - len(body.jaxpr.invars):]
      self.calls.append(eqn)
      try:
        return self.run(body, inner)
      finally:
        self.calls.pop()
    sharded = [v for v in values if isinstance(v, _Sharded)]
    prim = eqn.primitive
    if prim in _ELEMENTWISE:
      return [self.elementwise(eqn, values, sharded)]
    if prim in _REDUCTIONS and sharded:
      return [self.reduction(eqn, values[0])]
    if prim in _ORDER_KEEPING:
      return [self.reshaped(eqn, values[0])]
    if prim is lax.cond_p and any(isinstance(v, (_Sharded, _Splat)) for v in values[1:]):
      return self.cond(eqn, values)
    if sharded:
      self._fail(eqn, "it is neither elementwise, nor a reshape keeping the element "
                 "order, nor a reduction over the whole value")
    return self.replicated(eqn, values)

  def cond(self, eqn, values):
    """``cond`` / ``switch`` on a replicated index: each branch interpreted on shards.

    The branches must agree on every output's layout: an output sharded in one
    branch is cut to shards in the others.
    """
    index, operands = values[0], list(values[1:])
    if isinstance(index, _Sharded):
      self._fail(eqn, "a branch chosen by a sharded value")
    leaves, tree = jax.tree.flatten(operands)
    branches = eqn.params["branches"]

    def interpreted(branch):
      return lambda *flat: self.run(branch, jax.tree.unflatten(tree, flat))

    laid_out = [jax.eval_shape(interpreted(b), *leaves) for b in branches]
    outs = []
    for k, var in enumerate(eqn.outvars):
      kinds = [type(branch_outs[k]) for branch_outs in laid_out]
      outs.append(_Sharded if _Sharded in kinds else
                  _Splat if all(kind is _Splat for kind in kinds) else None)

    def canonical(branch):
      def run(*flat):
        got = interpreted(branch)(*flat)
        return [self.laid_out(v, kind, tuple(var.aval.shape))
                for v, kind, var in zip(got, outs, eqn.outvars)]
      return run

    return lax.switch(self.materialize(index), [canonical(b) for b in branches], *leaves)

  def laid_out(self, value, kind, shape):
    """``value`` as a ``kind`` (``_Sharded``, ``_Splat`` or None: replicated)."""
    if kind is _Sharded:
      return _Sharded(self.as_shard(value, shape), shape)
    if kind is _Splat:
      return value
    return self.materialize(value)

  def replicated(self, eqn, values):
    params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*[self.materialize(v) for v in values], **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]

  def elementwise(self, eqn, values, sharded):
    shape = tuple(eqn.outvars[0].aval.shape)
    if not sharded:
      if shape and all(isinstance(v, _Splat) or np.ndim(v) == 0 for v in values):
        scalars = [v.scalar if isinstance(v, _Splat) else v for v in values]
        return _Splat(eqn.primitive.bind(*scalars, **eqn.params), shape)
      return self.replicated(eqn, values)[0]
    if any(v.shape != shape for v in sharded):
      self._fail(eqn, "its operands have different shapes")
    shards = [self.as_shard(v, shape) for v in values]
    return _Sharded(eqn.primitive.bind(*shards, **eqn.params), shape)

  def reshaped(self, eqn, value):
    shape = tuple(eqn.outvars[0].aval.shape)
    if isinstance(value, _Splat):
      return _Splat(value.scalar, shape)
    size = int(np.prod(shape, dtype=np.int64))
    if (not isinstance(value, _Sharded)):
      if eqn.primitive is lax.broadcast_in_dim_p and np.size(value) == 1 and size != 1:
        return _Splat(jnp.reshape(value, ()), shape)  # a splat of a replicated value
      return self.replicated(eqn, [value])[0]
    if eqn.params.get("dimensions") is not None:
      self._fail(eqn, "a reshape that transposes")
    if size != int(np.prod(value.shape, dtype=np.int64)):
      self._fail(eqn, f"a broadcast of shape {value.shape} to {shape}")
    return _Sharded(value.shard, shape)

  def reduction(self, eqn, value: _Sharded):
    axes = tuple(eqn.params["axes"])
    if sorted(axes) != list(range(len(value.shape))):
      self._fail(eqn, f"a reduction over axes {axes} of a value of shape {value.shape}, "
                 "not over all of them")
    prim = eqn.primitive
    shard = value.shard
    size = int(np.prod(value.shape, dtype=np.int64))
    n = self._length(value.shape)
    if n * self.replicas != size:  # mask the zero padding of the last shard(s)
      valid = lax.iota(np.int32, n) + self.replica * n < size
      shard = jnp.where(valid, shard, _identity(prim, shard.dtype))
    local = _REDUCTIONS[prim](shard).astype(eqn.outvars[0].aval.dtype)
    if prim is lax.reduce_sum_p:
      return cross_replica_sum(local, REPLICA_AXIS)
    # One partial per replica, gathered, then reduced on every replica.
    wire = local.astype(np.int32) if local.dtype == np.bool_ else local
    partials = cross_replica_all_gather(jnp.reshape(wire, (1,)), self.replicas, REPLICA_AXIS)
    return _REDUCTIONS[prim](partials).astype(local.dtype)


# -- the traced update ----------------------------------------------------------------


def _optimizer_name(optimizer) -> str:
  update = getattr(optimizer, "update", None)
  qual = getattr(update, "__qualname__", "") or type(optimizer).__name__
  return qual.split(".<locals>")[0] if qual else repr(optimizer)


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tree)


class ShardedUpdate:
  """``optimizer.update`` + ``optax.apply_updates`` as a program run on replica shards.

  Traced once on full-size leaves (the shapes of ``params`` and of
  ``optimizer.init(params)``); :meth:`__call__` interprets it on one
  replica's shards inside that replica's program.

  Args:
    optimizer: an optax ``GradientTransformation``.
    params: the weights (arrays or ``ShapeDtypeStruct``), full size.
    replicas: R.
  """

  def __init__(self, optimizer, params, replicas: int):
    import optax

    self.optimizer = optimizer
    self.replicas = int(replicas)
    self.name = _optimizer_name(optimizer)
    self.params = _abstract(params)
    self.state = jax.eval_shape(optimizer.init, self.params)

    def update(grads, state, p):
      updates, state = optimizer.update(grads, state, p)
      return optax.apply_updates(p, updates), state

    self.closed, self._out_shape = jax.make_jaxpr(update, return_shape=True)(
        self.params, self.state, self.params)
    self._param_tree = jax.tree.structure(self.params)
    self._state_tree = jax.tree.structure(self.state)

  def init(self, params, replica):
    """Replica ``replica``'s optimizer state: the full state's shards."""
    return shard_tree(self.optimizer.init(params), replica, self.replicas)

  def check(self) -> None:
    """Raise :class:`ShardedOptimizerError` now if the update cannot be sharded.

    Interprets the update abstractly on replica 0's shards (nothing runs).
    """
    shards = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: (jax.ShapeDtypeStruct((shard_length(np.prod(a.shape, dtype=np.int64),
                                                      self.replicas),), a.dtype)
                   if is_sharded_leaf(a) else a), tree)
    jax.eval_shape(lambda g, s, p: self(g, s, p, jnp.int32(0)),
                   shards(self.params), shards(self.state), shards(self.params))

  def _wrap(self, leaves, like):
    return [_Sharded(x, tuple(a.shape)) if is_sharded_leaf(a) else x
            for x, a in zip(leaves, like)]

  def _unwrap(self, interp: _Interpreter, value, like):
    """An output in its slot's layout: a shard for a sharded leaf, else whole."""
    if is_sharded_leaf(like):
      return interp.as_shard(value, tuple(like.shape)).astype(like.dtype)
    if isinstance(value, _Sharded):
      return interp.gathered(value).astype(like.dtype)
    return jnp.asarray(interp.materialize(value)).astype(like.dtype)

  def __call__(self, grad_shards, state_shards, param_shards, replica):
    """One update of this replica's shards.

    Args:
      grad_shards: the reduced gradients: the replica's ``[n]`` shard of
        each sharded leaf (as a reduce-scatter gives it), scalars whole.
      state_shards: the replica's optimizer state (:meth:`init`'s layout).
      param_shards: the weights in the same layout as ``grad_shards``.
      replica: this replica's index (a traced int32 scalar).

    Returns:
      ``(new param shards, new state shards)`` in the same layouts.
    """
    interp = _Interpreter(replica, self.replicas, self.name)
    p_like = jax.tree.leaves(self.params)
    s_like = jax.tree.leaves(self.state)
    args = (self._wrap(jax.tree.leaves(grad_shards), p_like)
            + self._wrap(jax.tree.leaves(state_shards), s_like)
            + self._wrap(jax.tree.leaves(param_shards), p_like))
    outs = interp.run(self.closed, args)
    like = p_like + s_like
    outs = [self._unwrap(interp, v, a) for v, a in zip(outs, like)]
    return (jax.tree.unflatten(self._param_tree, outs[:len(p_like)]),
            jax.tree.unflatten(self._state_tree, outs[len(p_like):]))
