"""Offloaded state for ``ipu_jax.jit`` users: arguments kept in streaming memory.

``ipu_jax.jit(step, offload_argnums=1, offload_outputs=1)`` keeps every leaf
of positional argument 1 in streaming memory instead of in tile memory, and
writes every leaf of output 1 (an element of the returned tuple) back there.
The k-th offloaded argument pairs with the k-th offloaded output: a leaf and
its new value share one remote buffer (a variable updated in place, as
TensorFlow-IPU's ``offload_weight_update_variables`` keeps optimizer state).
Each leaf is streamed onto its tiles just before its first use and back just
after its last, inside the innermost loop body holding every use (see
``lowering/remote.py``). Numbers are unchanged; the report's always-live
memory falls by the leaves' bytes, the copies are their own supersteps.

As in TensorFlow-IPU, only what is worth streaming is offloaded: leaves below
:data:`MIN_OFFLOAD_BYTES` (step counters) stay on tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax

from ipu_jax.lowering.errors import LoweringError
from ipu_jax.lowering import remote

__all__ = ["MIN_OFFLOAD_BYTES", "offloaded_input_leaves", "offload_program", "out_paths_of"]

# TensorFlow-IPU offloads weight-update variables of at least 128 bytes
# (its ``minimum_remote_tensor_size`` default).
MIN_OFFLOAD_BYTES = 128


def _top_index(path):
  """Index of the tuple/list element a pytree path starts in (None at a leaf)."""
  if not path:
    return None
  key = path[0]
  return getattr(key, "idx", getattr(key, "key", None))


def offloaded_input_leaves(with_paths, argnums: Sequence[int], dyn_positions: Sequence[int]):
  """Which flat leaves of the dynamic ``(args, kwargs)`` are offloaded.

  Args:
    with_paths: ``tree_flatten_with_path`` of ``(dyn_args, dyn_kwargs)``.
    argnums: offloaded positional argument numbers (of the full call).
    dyn_positions: full argument number of each dynamic positional argument.

  Returns:
    ``[(leaf index, group)]``: ``group`` is the rank of the argument among the
    offloaded ones (pairs it with an output).
  """
  rank = {num: k for k, num in enumerate(argnums)}
  picked = []
  for i, (path, _) in enumerate(with_paths):
    if _top_index(path) != 0 or len(path) < 2:
      continue  # keyword arguments are not offloaded by number
    position = dyn_positions[_top_index(path[1:])]
    if position in rank:
      picked.append((i, rank[position]))
  return picked


@dataclasses.dataclass
class _OffloadPlan:
  """What is offloaded, built group by group.

  Attributes:
    tensors: tensor id -> ``[tensor, buffer, copy_in, copy_out]``, the
      entries :func:`ipu_jax.lowering.remote.offload_tensors` takes.
    new_inputs, new_outputs: flat input / output position -> its remote buffer.
  """

  tensors: dict = dataclasses.field(default_factory=dict)
  new_inputs: dict = dataclasses.field(default_factory=dict)
  new_outputs: dict = dataclasses.field(default_factory=dict)


def _buffer_for(tensor, label):
  return remote.RemoteBuffer(name=label, shape=(1,) + tuple(tensor.shape),
                             dtype=tensor.dtype, source=tensor.source, scope=tensor.scope)


def _check_outputs_returned(out_paths, out_groups, name) -> None:
  returned = {_top_index(p) for p in out_paths}
  missing = [pos for pos in out_groups if pos not in returned]
  if missing:
    raise LoweringError(
        f"ipu_jax.jit('{name}'): offload_outputs={tuple(out_groups)} but the function "
        f"returns no output {missing[0]} (it returns {len(returned)} top-level "
        "element(s)).")


def _leaves_by_group(in_leaves, out_paths, out_groups):
  """``(inputs, outputs)``: per pairing group, its flat leaf positions in order."""
  out_rank = {pos: k for k, pos in enumerate(out_groups)}
  in_by_group, out_by_group = {}, {}
  for i, group in in_leaves:
    in_by_group.setdefault(group, []).append(i)
  for j, path in enumerate(out_paths):
    group = out_rank.get(_top_index(path))
    if group is not None:
      out_by_group.setdefault(group, []).append(j)
  return in_by_group, out_by_group


def _offload_arguments(plan: _OffloadPlan, inputs, outputs, ins, outs, paired: bool) -> None:
  """Stream the group's argument leaves in; when paired, their new values out."""
  for k, i in enumerate(ins):
    tensor = inputs[i]
    if tensor.nbytes < MIN_OFFLOAD_BYTES:
      continue
    entry = plan.tensors.setdefault(
        tensor.id, [tensor, _buffer_for(tensor, tensor.name), False, False])
    entry[2] = True
    plan.new_inputs[i] = entry[1]
    if not paired:
      continue
    j = outs[k]
    out = outputs[j]
    if out.id == tensor.id:
      entry[3] = True
    elif out.category in ("constants",) or out.id in {t.id for t in inputs}:
      continue  # returned unchanged or a constant: nothing to write back
    elif out.id in plan.tensors:
      continue
    else:
      plan.tensors[out.id] = [out, entry[1], False, True]
    plan.new_outputs[j] = entry[1]


def _offload_unpaired_outputs(plan: _OffloadPlan, outputs, outs) -> None:
  """Outputs with no matching argument: each gets a buffer of its own."""
  for j in outs:
    out = outputs[j]
    if out.nbytes < MIN_OFFLOAD_BYTES or out.id in plan.tensors or out.category == "constants":
      continue
    plan.tensors[out.id] = [out, _buffer_for(out, f"output {j}"), False, True]
    plan.new_outputs[j] = plan.tensors[out.id][1]


def _check_not_on_tile(plan: _OffloadPlan, outputs, name) -> None:
  on_tile_outputs = {t.id for j, t in enumerate(outputs) if j not in plan.new_outputs}
  for tensor, _, copy_in, _ in plan.tensors.values():
    if copy_in and tensor.id in on_tile_outputs:
      raise LoweringError(
          f"ipu_jax.jit('{name}'): argument leaf {tensor.name!r} is offloaded to "
          "streaming memory but also returned as an on-tile output; offload that "
          "output too (offload_outputs) or do not offload the argument.")


def offload_program(program, inputs: list, outputs: list, in_leaves, out_paths,
                    out_groups: Sequence[int], name: str):
  """Rewrite the lowered program so the chosen leaves live in streaming memory.

  Args:
    program: the lowered program (its sequences are rewritten in place).
    inputs, outputs: the program's flat input / output tensors.
    in_leaves: :func:`offloaded_input_leaves`.
    out_paths: pytree paths of the flat outputs.
    out_groups: offloaded output positions (elements of the returned tuple),
      in pairing order.
    name: the function's name, for errors.

  Returns:
    ``(program, inputs, outputs)``: the rewritten program, and the flat
    inputs and outputs with remote buffers in place of the offloaded tile
    tensors.

  Raises:
    LoweringError: an offloaded output index the function does not return,
      or an offloaded argument also returned on tiles.
  """
  outputs = list(outputs)
  inputs = list(inputs)
  _check_outputs_returned(out_paths, out_groups, name)
  in_by_group, out_by_group = _leaves_by_group(in_leaves, out_paths, out_groups)
  plan = _OffloadPlan()
  for group in sorted(set(in_by_group) | set(out_by_group)):
    ins, outs = in_by_group.get(group, []), out_by_group.get(group, [])
    # An argument pairs leaf by leaf with an output of the same structure.
    paired = len(ins) == len(outs) and all(
        inputs[i].shape == outputs[j].shape and inputs[i].dtype == outputs[j].dtype
        for i, j in zip(ins, outs))
    _offload_arguments(plan, inputs, outputs, ins, outs, paired)
    if not paired:
      _offload_unpaired_outputs(plan, outputs, outs)
  _check_not_on_tile(plan, outputs, name)
  program = remote.offload_tensors(program, [tuple(p) for p in plan.tensors.values()])
  for i, buffer in plan.new_inputs.items():
    inputs[i] = buffer
  for j, buffer in plan.new_outputs.items():
    outputs[j] = buffer
  return program, inputs, outputs


def out_paths_of(out_shape):
  """Pytree paths of a traced function's flat outputs."""
  return [path for path, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
