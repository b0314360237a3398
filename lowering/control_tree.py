"""The control program's shape, as the report's program tree shows it.

A tile program is a tree of control programs (``Sequence``, ``Repeat``,
``RepeatWhileTrue``, ``If``, ``Switch``, ``Replicated``) over leaves
(supersteps, stream copies, printed tensors). The profile flattens the leaves
into ``ProgramProfile.steps`` in :func:`~ipu_jax.lowering.program.iter_steps`
order, so every control node covers one contiguous range of step indices.
:func:`control_tree` records that shape -- kinds, repeat counts, branches and
step ranges, no cycles -- as a JSON-able dict; the report adds the cycles
(``Report.program_tree()``).

Node keys: ``kind`` (``"sequence"``, ``"repeat"``, ``"repeat_while"``,
``"if"``, ``"switch"``, ``"replicated"`` or ``"steps"``, a run of consecutive
leaves), ``first`` and ``count`` (the steps it covers), ``children`` (control
nodes only), ``iterations`` (``repeat``), ``replicas`` (``replicated``) and
``branch`` (a child's role in its parent: ``"condition"``, ``"body"``,
``"then"``, ``"else"``, ``"case <value>"``, ``"default"``). Nested sequences
are merged into their parent: they change nothing the chip does.
"""

from __future__ import annotations

from typing import Optional

from ipu_jax.lowering import program as P

__all__ = ["control_tree"]

_LEAVES = (P.Superstep, P.StreamCopy, P.PrintTensor)


class _Builder:
  """Walks a program in ``iter_steps`` order, numbering its leaves."""

  def __init__(self):
    self.next_step = 0

  def node(self, kind: str, parts, **extra) -> dict:
    first = self.next_step
    children = []
    for branch, part in parts:
      children.extend(self.items(part, branch))
    return dict(kind=kind, first=first, count=self.next_step - first,
                children=children, **extra)

  def items(self, program, branch: Optional[str] = None) -> list:
    """The nodes ``program`` contributes to its parent's children."""
    if program is None:
      return []
    if isinstance(program, _LEAVES):
      self.next_step += 1
      return [self._tag({"kind": "steps", "first": self.next_step - 1,
                         "count": 1}, branch)]
    if isinstance(program, P.Sequence):
      nodes = []
      for part in program.programs:
        nodes.extend(self.items(part))
      return _merge_runs(nodes) if branch is None else [
          self._tag(self._wrap(nodes), branch)]
    return [self._tag(self._control(program), branch)]

  def _control(self, program) -> dict:
    if isinstance(program, P.Repeat):
      return self.node("repeat", [(None, program.body)],
                       iterations=int(program.count))
    if isinstance(program, P.Replicated):
      return self.node("replicated", [(None, program.body)],
                       replicas=int(program.num_replicas))
    if isinstance(program, P.RepeatWhileTrue):
      return self.node("repeat_while", [("condition", program.condition),
                                                 ("body", program.body)])
    if isinstance(program, P.If):
      return self.node("if", [("then", program.then),
                                       ("else", program.else_)])
    if isinstance(program, P.Switch):
      parts = [(f"case {value}", case) for value, case in program.cases]
      return self.node("switch", parts + [("default", program.default)])
    raise TypeError(f"not a tile program: {program!r}")

  @staticmethod
  def _wrap(nodes: list) -> dict:
    """A branch holding several nodes: one sequence node around them."""
    nodes = _merge_runs(nodes)
    if len(nodes) == 1:
      return nodes[0]
    first = nodes[0]["first"] if nodes else 0
    count = sum(n["count"] for n in nodes)
    return {"kind": "sequence", "first": first, "count": count,
            "children": nodes}

  @staticmethod
  def _tag(node: dict, branch: Optional[str]) -> dict:
    if branch is not None:
      node["branch"] = branch
    return node


def _merge_runs(nodes: list) -> list:
  """Consecutive untagged step runs become one run."""
  merged = []
  for node in nodes:
    previous = merged[-1] if merged else None
    if (previous is not None and node["kind"] == "steps"
        and previous["kind"] == "steps" and "branch" not in node
        and "branch" not in previous
        and previous["first"] + previous["count"] == node["first"]):
      previous["count"] += node["count"]
    else:
      merged.append(node)
  return merged


def control_tree(program: P.Program) -> dict:
  """The shape of ``program``'s control flow over its step indices.

  Args:
    program: a tile program.

  Returns:
    The root node (see the module docstring): always a ``sequence``, whose
    ``count`` equals the number of leaves ``iter_steps`` yields.
  """
  builder = _Builder()
  nodes = builder.items(program)
  return {"kind": "sequence", "first": 0, "count": builder.next_step,
          "children": _merge_runs(nodes)}
