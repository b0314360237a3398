"""The program tree: the control program with each node's cycles.

PopVision Graph Analyser's "program tree" shows the control program -- loops,
repeats, conditionals -- down to its compute sets. Here it is the shape the
lowering recorded (:func:`~ipu_jax.lowering.control_tree.control_tree`, kept
as ``ReportData.control``) with the report's cycles added:

* ``total_cycles``: every step the node covers, each step's cycles times its
  executions per program run (so the root's total is the report's total);
* ``self_cycles``: the part spent in steps directly in the node, not inside a
  nested control program (a ``steps`` run's self equals its total);
* ``steps``: ``[first, last]`` step indices (into ``report.json["steps"]``),
  or ``[]`` for a node without steps;
* ``executions``: times the node itself runs per program run (a loop body
  node runs once per trip of its enclosing loops);
* ``label``: what a reader sees, e.g. ``"repeat ×8"``, ``"steps 3–40"``.

A ``repeat_while`` loop's trip count is unknown when compiling: its steps are
counted once, as the totals count them. Both branches of an ``if`` or
``switch`` are counted, as the totals count them (the cost model does not know
which runs).

Reports without a recorded shape (a pipeline's slot profile, reports saved
before the tree was recorded) get a flat tree: one ``steps`` run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ipu_jax.report.data import ReportData

__all__ = ["program_tree", "control_shape"]


def control_shape(data: ReportData) -> dict:
  """The recorded shape of the control program, or a flat one."""
  num_steps = len(data.steps)
  if data.control is not None and data.control.get("count") == num_steps:
    return data.control
  children = [{"kind": "steps", "first": 0, "count": num_steps}] if num_steps else []
  return {"kind": "sequence", "first": 0, "count": num_steps, "children": children}


def _label(node: dict) -> str:
  kind, first, count = node["kind"], node["first"], node["count"]
  if kind == "steps":
    return f"step {first}" if count == 1 else f"steps {first}–{first + count - 1}"
  if kind == "repeat":
    return f"repeat ×{node['iterations']:,}"
  if kind == "repeat_while":
    return "repeat while true (trip count unknown: counted once)"
  if kind == "replicated":
    return f"replicated ×{node['replicas']:,} (one replica's program)"
  return kind


def _with_cycles(node: dict, weighted: np.ndarray, runs: int) -> dict:
  """``node`` with its cycles; ``runs``: times it runs per program run."""
  first, count = int(node["first"]), int(node["count"])
  total = float(weighted[first:first + count].sum())
  out = {"kind": node["kind"], "label": _label(node)}
  for key in ("branch", "iterations", "replicas"):
    if key in node:
      out[key] = node[key]
  out.update(steps=[first, first + count - 1] if count else [],
             executions=int(runs), total_cycles=total)
  if node["kind"] == "steps":
    out["self_cycles"] = total
    return out
  inner = runs * int(node["iterations"]) if node["kind"] == "repeat" else runs
  children = [_with_cycles(c, weighted, inner) for c in node.get("children", [])]
  out["self_cycles"] = float(sum(c["total_cycles"] for c in children
                                 if c["kind"] == "steps"))
  out["children"] = children
  return out


def program_tree(data: ReportData, root: Optional[dict] = None) -> dict:
  """The program tree of a report (see the module docstring).

  Args:
    data: the report's data.
    root: a control shape to use instead of the recorded one.

  Returns:
    The root node, a JSON-serialisable dict.
  """
  steps = data.steps
  shape = root if root is not None else control_shape(data)
  tree = _with_cycles(shape, steps.weighted_cycles, 1)
  tree["label"] = f"program {data.name}"
  return tree
