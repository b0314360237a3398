"""Split a loss function into pipeline stages at its ``pipeline_stage`` marks.

The function is traced once; every equation gets the stage of the values it
reads (a ``pipeline_stage(x, k)`` mark starts stage ``k``). Equations that
read only weights, batch values or constants (a transposed weight, a mask)
join the first stage that uses their result. Each stage then becomes a
function of its own weights, the batch values it reads and the values that
earlier stages send it; evaluating the stages in order gives the same
numbers as the whole function, since they are the same equations.

Batch values enter on stage 0, as a pipeline's infeed does: what is
computed from them alone (a one-hot of the labels) runs there and travels
with the activations.

Per-micro-batch values that are not infeed (a micro-batch's random key, the
state a stage holds) are *free* batch values: they carry no stage, and each
stage that needs them reads them itself. What is computed from them alone (a
key folded or split) runs again on every stage that uses it, so no key
crosses an IPU-Link and random bits are drawn on the stage that uses them. A loss function with
auxiliary outputs (``has_aux``) returns them from the stages that compute
them (:class:`AuxOutput`).

Rules checked here, before anything is compiled or run, each with the user's
source line: stage ids increase along the forward pass (a ``pipeline_stage``
mark also leaves no gap; an operation placed by module path may read values
of any earlier stage), and the loss is computed by the last stage.

A weight may be read by several stages (a tied embedding and output
projection). Each weight has one owner, the first stage that reads it: the
owner holds the weight, its gradient accumulator and optimizer state and
updates it once; the other readers add their gradient contributions into the
owner's accumulator (``Stage.owned``, ``StagedFunction.weight_reads``). The
:class:`~ipu_jax.pipelining.Pipeline` allows this only when the readers sit
on one IPU (:mod:`~ipu_jax.pipelining.layout`).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from ipu_jax.lowering.jax_compat import core, source_info_util
from ipu_jax.lowering.lower import source_of
from ipu_jax.lowering.scopes import module_path
from ipu_jax.ops.pipeline_stage import pipeline_stage_p
from ipu_jax.tracer_probes import cheap_tracer_probes

__all__ = ["AuxOutput", "Stage", "StagedFunction", "PipelineError", "split_stages", "stage"]

# The named scope ``stage(k)`` opens; the innermost one on an equation wins.
_SCOPE_PREFIX = "ipu_pipeline_stage_"
_SCOPE = re.compile(rf"(?:^|/){_SCOPE_PREFIX}(\d+)(?=/|$)")


def stage(k: int):
  """``with stage(k):`` runs the operations traced inside on pipeline stage ``k``.

  The context-manager form of :func:`ipu_jax.ops.pipeline_stage` (PopTorch's
  ``BeginBlock``, TF-IPU's ``PipelineStage``), handy around Flax layers: it
  opens a ``jax.named_scope``, so it needs no value to mark, and values made
  inside cross to the next stage where a later block reads them.

  Raises:
    ValueError: ``k`` is not an int >= 0.
  """
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
    raise ValueError(f"pipelining.stage: the stage must be an int >= 0; got {k!r}.")
  return jax.named_scope(f"{_SCOPE_PREFIX}{int(k)}")


def _scope_stage(eqn, assignment, used):
  """The stage a ``stage(k)`` block or the module-path assignment gives ``eqn``."""
  found = _SCOPE.findall(str(eqn.source_info.name_stack))
  if found:
    return int(found[-1]), f"inside pipelining.stage({int(found[-1])})"
  if not assignment:
    return None, ""
  path = "/" + module_path(eqn.source_info.name_stack) + "/"
  matches = [key for key in assignment if f"/{key.strip('/')}/" in path]
  if not matches:
    return None, ""
  key = max(matches, key=len)  # the innermost module named wins
  used.add(key)
  return assignment[key], f"in module {key!r} (stage_assignment: stage {assignment[key]})"


def _check_assignment(assignment) -> dict:
  if assignment is None:
    return {}
  if not isinstance(assignment, Mapping):
    raise PipelineError(f"stage_assignment must map module paths to stage ids, e.g. "
                        f"{{'Dense_1': 1}}; got {type(assignment).__name__}.")
  for key, k in assignment.items():
    if not isinstance(key, str) or not key.strip("/"):
      raise PipelineError(f"stage_assignment key {key!r} is not a module path.")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
      raise PipelineError(f"stage_assignment[{key!r}]={k!r}: stage ids are ints >= 0.")
  return dict(assignment)


class PipelineError(ValueError):
  """A model or pipeline setting that cannot be pipelined as given."""


@dataclasses.dataclass
class Stage:
  """One pipeline stage: its equations and what flows in and out.

  Attributes:
    index: the stage id.
    eqns: the stage's equations, in program order.
    params: indices (into the flat weights) of the weights it reads.
    batch: indices (into the flat batch) of the batch values it reads.
    inputs: variables computed by earlier stages that it reads.
    outputs: variables it computes that later stages (or the loss) read.
    consts: the traced function's constants it reads (variable -> value).
    param_vars, batch_vars: the traced variables of ``params`` and ``batch``.
    owned: indices of the weights it owns (it is their first reader): it
      holds them and their optimizer state and runs their update; a subset
      of ``params``.
  """

  index: int
  eqns: list
  params: list
  batch: list
  inputs: list
  outputs: list
  consts: dict
  param_vars: list = dataclasses.field(default_factory=list)
  batch_vars: list = dataclasses.field(default_factory=list)
  owned: list = dataclasses.field(default_factory=list)

  def __call__(self, params: Sequence[Any], batch: Sequence[Any],
               inputs: Sequence[Any]) -> list:
    """Evaluate the stage: flat weights, batch values and inputs in order."""
    env = dict(self.consts)
    env.update(zip(self.param_vars, params))
    env.update(zip(self.batch_vars, batch))
    env.update(zip(self.inputs, inputs))

    def read(v):
      return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in self.eqns:
      if eqn.primitive is pipeline_stage_p:
        env[eqn.outvars[0]] = read(eqn.invars[0])
        continue
      params_ = eqn.primitive.get_bind_params(eqn.params)
      # Keep the user's line and module path on what is traced again.
      with source_info_util.user_context(eqn.source_info.traceback,
                                         name_stack=eqn.source_info.name_stack):
        out = eqn.primitive.bind(*map(read, eqn.invars), **params_)
      outs = out if eqn.primitive.multiple_results else [out]
      for v, value in zip(eqn.outvars, outs):
        if not isinstance(v, jcore.DropVar):
          env[v] = value
    return [read(v) for v in self.outputs]


@dataclasses.dataclass
class StagedFunction:
  """A loss function split into stages.

  Attributes:
    stages: the stages in forward order.
    param_tree, batch_tree: tree structures of the weights and of one
      micro-batch.
    param_names: a readable path for each flat weight.
    loss_var: the variable holding the loss.
    weight_reads: flat weight index -> ``{stage: source line of its first
      read there}``, for every weight some stage reads.
    aux: where each leaf of the auxiliary output comes from (``has_aux``).
    aux_tree: the auxiliary output's tree structure (``None`` without aux).
  """

  stages: list
  param_tree: Any
  batch_tree: Any
  param_names: list
  loss_var: Any
  weight_reads: dict = dataclasses.field(default_factory=dict)

  def owner(self, param: int) -> int:
    """The stage that owns weight ``param``: the first stage reading it."""
    return min(self.weight_reads[param])

  aux: list = dataclasses.field(default_factory=list)
  aux_tree: Any = None

  @property
  def num_stages(self) -> int:
    return len(self.stages)

  def producer(self, var) -> int:
    """The stage that computes ``var``."""
    for stage in self.stages:
      if var in stage.outputs:
        return stage.index
    raise KeyError(var)


@dataclasses.dataclass(frozen=True)
class AuxOutput:
  """Where one leaf of the loss function's auxiliary output comes from.

  Attributes:
    kind: ``"stage"`` (a stage's forward pass computes it), ``"param"``,
      ``"batch"`` (a flat weight or batch value passed through) or
      ``"const"`` (a value the trace fixed).
    where: the stage (for ``"stage"``), the flat index, or the value.
    position: for ``"stage"``, its index among that stage's outputs.
  """

  kind: str
  where: Any
  position: int = -1


def _where(eqn) -> str:
  return source_of(eqn) or "an unknown source line"


def _label(jaxpr, num_params: int, assignment=None, free=()) -> list:
  """The stage of each equation (forward propagation, then unplaced ones).

  Batch values enter on stage 0 (as a pipeline's infeed does); weights,
  constants and the free batch values (flat indices ``free``) have no stage
  of their own.
  """
  used, free = set(), set(free)
  label = {v: 0 for i, v in enumerate(jaxpr.invars[num_params:]) if i not in free}
  stages = []
  for eqn in jaxpr.eqns:
    seen = [label[v] for v in eqn.invars
            if not isinstance(v, jcore.Literal) and label.get(v) is not None]
    here = max(seen) if seen else None
    if eqn.primitive is pipeline_stage_p:
      if eqn.params["backward"]:
        raise PipelineError(
            f"The function given to the pipeline already takes gradients through a "
            f"pipeline_stage mark (at {_where(eqn)}); give the pipeline the loss "
            "function itself: it differentiates each stage where it runs.")
      k = eqn.params["stage"]
      before = here if here is not None else 0
      if k <= before:
        raise PipelineError(
            f"pipeline_stage({k}) at {_where(eqn)} follows values of stage {before}: stage "
            "ids must increase along the forward pass.")
      if k > before + 1:
        raise PipelineError(
            f"pipeline_stage({k}) at {_where(eqn)} follows stage {before}: stage ids must "
            f"not skip a stage (expected pipeline_stage({before + 1})).")
      here = k
    scoped, how = _scope_stage(eqn, assignment, used)
    if scoped is not None and eqn.primitive is not pipeline_stage_p:
      before = here if here is not None else 0
      if scoped < before:
        raise PipelineError(
            f"An operation at {_where(eqn)} {how} reads values of stage {before}: stage ids "
            "must increase along the forward pass.")
      # A later stage may read values of any earlier one (a layer converting
      # the embeddings' attention mask): they go straight to it, as skip
      # connections do, and their gradients straight back.
      here = scoped
    for v in eqn.outvars:
      label[v] = here
    stages.append(here)
  unused = sorted(set(assignment or ()) - used)
  if unused:
    paths = sorted({module_path(e.source_info.name_stack) for e in jaxpr.eqns} - {""})
    raise PipelineError(
        f"stage_assignment names module path(s) {unused} that no operation of the loss "
        f"function runs in; the module paths are: {paths[:20]}. (Flax linen names its "
        "modules; wrap NNX calls in ipu_jax.nnx_scopes.module_scopes(model).)")
  # An equation of weights/constants only joins its first consumer's stage.
  consumers = {}
  for index, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        consumers.setdefault(v, []).append(index)
  for index in range(len(jaxpr.eqns) - 1, -1, -1):
    if stages[index] is None:
      # A mark starting stage k takes its input from stage k - 1.
      users = [stages[j] - (jaxpr.eqns[j].primitive is pipeline_stage_p)
               for v in jaxpr.eqns[index].outvars
               for j in consumers.get(v, []) if stages[j] is not None]
      stages[index] = min(users) if users else 0
  return stages


def _free_copies(jaxpr, labels: list, num_params: int, free) -> dict:
  """``{equation index: stages}``: equations of free batch values alone, run on
  every stage that uses them.

  An equation that reads only free values (a micro-batch's key, counters),
  constants or other such equations' results -- folding a key, splitting it --
  is computed again on each stage that needs its result, so no key crosses an
  IPU-Link and each stage derives and draws its own. Its label (the first
  such stage) stays its home for outputs of the whole function. Equations
  with effects are left where they are (run once).
  """
  free_vars = {jaxpr.invars[num_params + i] for i in free}
  derived, index_of = set(), {}
  for i, eqn in enumerate(jaxpr.eqns):
    reads = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if eqn.effects or eqn.primitive is pipeline_stage_p:
      continue
    if all(v in free_vars or v in jaxpr.constvars or index_of.get(v) in derived for v in reads):
      derived.add(i)
      index_of.update({v: i for v in eqn.outvars})
  consumers: dict = {}
  for j, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal) and v in index_of:
        consumers.setdefault(index_of[v], set()).add(j)
  copies: dict = {}
  for i in sorted(derived, reverse=True):  # consumers come later in program order
    needed = set()
    for j in consumers.get(i, ()):
      needed |= copies[j] if j in derived else {labels[j]}
    copies[i] = needed | {labels[i]}
  return copies


def split_stages(fn: Callable, params, batch, assignment=None, *, free=(),
                 has_aux: bool = False) -> StagedFunction:
  """Trace ``fn(params, batch) -> loss`` and split it at its stage marks.

  Args:
    fn: the loss function; the loss must be a scalar computed by the last
      stage.
    params: the weights (a pytree of arrays).
    batch: one micro-batch (a pytree of arrays).
    assignment: optional ``{module path: stage}`` (Keras-on-IPU's
      ``set_pipeline_stage_assignment``): operations traced inside a module
      whose path contains the key (``"Dense_1"``, ``"Encoder/layers_2"``)
      run on that stage; the longest matching key wins.
    free: flat indices of batch values that are not infeed (random keys,
      stage-held state): each stage that needs them reads them itself.
    has_aux: ``fn`` returns ``(loss, aux)``; each leaf of ``aux`` comes out
      of the stage that computes it.

  Returns:
    The :class:`StagedFunction`.

  Raises:
    PipelineError: stage marks that do not increase by one along the forward
      pass, a loss not computed by the last stage, or a mark inside a nested
      ``jax.jit``. (A weight read by several stages is allowed here; the
      pipeline refuses it when those stages are on different IPUs.)
  """
  with_paths, param_tree = jax.tree_util.tree_flatten_with_path(params)
  flat_params = [leaf for _, leaf in with_paths]
  param_names = [jax.tree_util.keystr(path) or "params" for path, _ in with_paths]
  _check_float_params(param_names, flat_params)
  closed, batch_tree, aux_tree = _trace(fn, param_tree, flat_params, batch, has_aux)
  jaxpr = closed.jaxpr
  _reject_nested_marks(jaxpr)
  labels = _label(jaxpr, len(flat_params), _check_assignment(assignment), free)
  copies = _free_copies(jaxpr, labels, len(flat_params), free)
  num_stages = max(labels, default=0) + 1
  produced_by = {v: k for eqn, k in zip(jaxpr.eqns, labels) for v in eqn.outvars}
  loss_var = jaxpr.outvars[0]
  _check_loss_stage(loss_var, produced_by, num_stages)
  traced = _Traced(jaxpr, labels, len(flat_params), param_names,
                   dict(zip(jaxpr.constvars, closed.consts)), produced_by, copies)
  stages = [traced.stage(k) for k in range(num_stages)]
  for stage in stages:
    if not stage.eqns:
      raise PipelineError(f"Pipeline stage {stage.index} has no operations.")
  # A value goes out of the stage that made it when a later stage reads it.
  for stage in stages:
    for v in stage.inputs:
      source = stages[produced_by[v]]
      if v not in source.outputs:
        source.outputs.append(v)
  aux = [_aux_source(v, traced, stages) for v in jaxpr.outvars[1:]]
  stages[-1].outputs = [v for v in stages[-1].outputs if v is not loss_var] + [loss_var]
  weight_reads = {traced.param_index[v]: {k: _where(eqn) for k, eqn in reads.items()}
                  for v, reads in traced.param_reads.items()}
  for stage in stages:
    stage.owned = [i for i in stage.params if min(weight_reads[i]) == stage.index]
  aux = [AuxOutput(a.kind, a.where, stages[a.where].outputs.index(v)) if a.kind == "stage" else a
         for a, v in zip(aux, jaxpr.outvars[1:])]
  return StagedFunction(stages, param_tree, batch_tree, param_names, loss_var, weight_reads,
                        aux, aux_tree)


def _aux_source(v, traced: "_Traced", stages: list) -> AuxOutput:
  """Where auxiliary output ``v`` comes from; a computed one becomes an output
  of the stage that computes it (the host reads it after that forward pass)."""
  if isinstance(v, jcore.Literal):
    return AuxOutput("const", v.val)
  if v in traced.produced_by:
    source = stages[traced.produced_by[v]]
    if v not in source.outputs:
      source.outputs.append(v)
    return AuxOutput("stage", source.index)
  if v in traced.param_index:
    return AuxOutput("param", traced.param_index[v])
  if v in traced.batch_index:
    return AuxOutput("batch", traced.batch_index[v])
  return AuxOutput("const", traced.consts[v])


def _check_float_params(names: Sequence[str], flat_params: list) -> None:
  """The trained weights are floating point (an integer one has no gradient:
  JAX's ``float0`` error would surface inside the update)."""
  for name, leaf in zip(names, flat_params):
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
      where = name if name == "params" else f"params{name}"
      raise PipelineError(f"Pipeline trains floating-point weights; {where} is {dtype}. "
                          f"Pass integer values (counts, indices) in the batch, or as state "
                          f"with Pipeline(..., mutable=True).")


def _trace(fn: Callable, param_tree, flat_params: list, batch, has_aux: bool = False):
  """``fn(params, batch)`` traced on flat weights then flat batch values.

  With ``has_aux`` the traced function returns the loss, then the flat
  leaves of ``aux``.

  Returns:
    ``(closed jaxpr, batch treedef, aux treedef or None)``.

  Raises:
    PipelineError: the loss is not a scalar (or, with ``has_aux``, not a pair).
  """
  flat_batch, batch_tree = jax.tree_util.tree_flatten(batch)

  def flat_fn(*flat):
    p = jax.tree_util.tree_unflatten(param_tree, flat[:len(flat_params)])
    b = jax.tree_util.tree_unflatten(batch_tree, flat[len(flat_params):])
    out = fn(p, b)
    if not has_aux:
      return out
    if not isinstance(out, (tuple, list)) or len(out) != 2:
      raise PipelineError("With has_aux=True the pipelined loss function must return "
                          f"(loss, aux); it returned {type(out).__name__}.")
    aux_leaves, aux_tree[:] = jax.tree_util.tree_flatten(out[1])[0], [
        jax.tree_util.tree_structure(out[1])]
    return (out[0], *aux_leaves)

  aux_tree = []
  with cheap_tracer_probes():  # NNX's sharding probes (ipu_jax/tracer_probes.py)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_params, *flat_batch)
  loss_shape = out_shape[0] if has_aux else out_shape
  if not isinstance(loss_shape, jax.ShapeDtypeStruct) or loss_shape.shape != ():
    raise PipelineError(f"The pipelined loss function must return a scalar loss; it "
                        f"returned {jax.tree_util.tree_map(lambda s: s.shape, loss_shape)}.")
  if not jnp.issubdtype(loss_shape.dtype, jnp.floating):
    # As jax.grad refuses it: a count or a comparison has no gradient, and the
    # weights would stay as they are, step after step.
    raise PipelineError(f"The pipelined loss function must return a floating-point loss to "
                        f"differentiate; it returned {loss_shape.dtype} (cast it, e.g. "
                        f"loss.astype(jnp.float32), if it is meant as one).")
  return closed, batch_tree, (aux_tree[0] if has_aux else None)


def _check_loss_stage(loss_var, produced_by: dict, num_stages: int) -> None:
  """The loss must be computed, and by the last stage."""
  if isinstance(loss_var, jcore.Literal) or loss_var not in produced_by:
    raise PipelineError("The pipelined loss does not depend on any computation.")
  if produced_by[loss_var] != num_stages - 1:
    raise PipelineError(
        f"The loss is computed on stage {produced_by[loss_var]}, but the last stage is "
        f"{num_stages - 1}: the loss must be computed by the last stage.")


class _Traced:
  """The traced loss with its equations' stage labels; builds the stages in order.

  ``param_reads`` remembers, per weight, the stages reading it and the
  equation of each stage's first read (for ownership and error messages).
  """

  def __init__(self, jaxpr, labels, num_params: int, param_names, consts, produced_by,
               copies=None):
    self.jaxpr, self.labels, self.param_names = jaxpr, labels, param_names
    self.consts, self.produced_by = consts, produced_by
    self.param_vars = jaxpr.invars[:num_params]
    self.batch_vars = jaxpr.invars[num_params:]
    self.param_index = {v: i for i, v in enumerate(self.param_vars)}
    self.batch_index = {v: i for i, v in enumerate(self.batch_vars)}
    self.param_reads = {}
    self.copies = copies or {}

  def stage(self, k: int) -> Stage:
    """Stage ``k``: its equations and the weights, batch values, constants and
    earlier stages' values they read."""
    copies = self.copies
    eqns = [e for i, (e, lab) in enumerate(zip(self.jaxpr.eqns, self.labels))
            if lab == k or k in copies.get(i, ())]
    local = {v for i in copies if k in copies[i] for v in self.jaxpr.eqns[i].outvars}
    params_k, batch_k, inputs_k, consts_k = [], [], [], {}
    for eqn in eqns:
      for v in eqn.invars:
        if isinstance(v, jcore.Literal):
          continue
        if v in self.param_index:
          self.param_reads.setdefault(v, {}).setdefault(k, eqn)
          if self.param_index[v] not in params_k:
            params_k.append(self.param_index[v])
        elif v in self.batch_index:
          if self.batch_index[v] not in batch_k:
            batch_k.append(self.batch_index[v])
        elif v in self.consts:
          consts_k[v] = self.consts[v]
        elif self.produced_by.get(v) != k and v not in local and v not in inputs_k:
          inputs_k.append(v)
    params_k, batch_k = sorted(params_k), sorted(batch_k)
    return Stage(k, eqns, params_k, batch_k, inputs_k, [], consts_k,
                 [self.param_vars[i] for i in params_k],
                 [self.batch_vars[i] for i in batch_k])


def _reject_nested_marks(jaxpr) -> None:
  for eqn in jaxpr.eqns:
    for sub in core.jaxprs_in_params(eqn.params):
      for inner in sub.eqns:
        if inner.primitive is pipeline_stage_p:
          raise PipelineError(
              f"pipeline_stage at {_where(inner)} is inside '{eqn.primitive.name}' (a nested "
              "jax.jit, loop or remat region): put stage marks at the top level of the loss "
              "function.")
      _reject_nested_marks(sub)
