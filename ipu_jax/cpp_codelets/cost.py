"""Cycles of C++ vertices: the author's figure, or an estimate from the work done.

In order of preference, a vertex's cycles come from

1. ``Graph.set_perf_estimate(vertex, cycles)`` (Poplar's ``setPerfEstimate``);
2. the estimate function the codelet's author gives, ``cycles=`` at
   ``Graph.add_codelets`` (one function for every class, or a dict by class
   name) or at ``Graph.add_vertex``: ``cycles(fields) -> int`` where
   ``fields`` maps each field name to its shape and dtype (``.shape``,
   ``.dtype``, ``.size``): a ``Vertex``'s cycles on its worker, a
   ``SupervisorVertex``'s or ``MultiVertex``'s cycles of the whole tile;
3. otherwise :func:`work_cycles`, an *estimate* from the elements the vertex
   reads and writes. The compute set's step then carries a note saying so
   (shown by the report), and a ``UserWarning`` names the vertex class.
"""

from __future__ import annotations

import warnings

import numpy as np

__all__ = ["CYCLES_PER_ELEMENT", "VERTEX_OVERHEAD_CYCLES", "work_cycles", "work_estimate_notes"]

# Estimate: a compiled scalar loop on a worker issues about a load, an
# operation and a store per element (one instruction per worker cycle);
# two cycles per element read or written is that budget split between the
# two sides. Not calibrated against a published figure.
CYCLES_PER_ELEMENT = 2
# Estimate: the call, field pointer loads and return of a vertex.
VERTEX_OVERHEAD_CYCLES = 20


def work_cycles(vclass, specs: dict, worker_contexts: int = 6) -> int:
  """The estimate of one vertex's cycles from its elements read and written.

  Args:
    vclass: the :class:`~ipu_jax.cpp_codelets.VertexClass`.
    specs: field name -> its connection's shape/dtype (``.size``).
    worker_contexts: workers per tile (a MultiVertex splits its work over them).

  Returns:
    A ``Vertex``'s worker cycles; a ``SupervisorVertex``'s or
    ``MultiVertex``'s tile cycles (a worker's cycles times the contexts, as
    the tile interleaves them).
  """
  elements = sum(int(specs[f.name].size) * (int(f.read) + int(f.written)) for f in vclass.fields
                 if not f.attribute)
  if vclass.base == "MultiVertex":
    per_worker = VERTEX_OVERHEAD_CYCLES + CYCLES_PER_ELEMENT * -(-elements // worker_contexts)
    return int(per_worker * worker_contexts)
  cycles = VERTEX_OVERHEAD_CYCLES + CYCLES_PER_ELEMENT * elements
  return int(cycles * worker_contexts) if vclass.supervisor else int(cycles)


def work_estimate_notes(codelet, vertices) -> tuple:
  """Notes (and a warning) when vertices of ``codelet`` are priced by :func:`work_cycles`."""
  if not getattr(codelet, "work_estimate", False):
    return ()
  if all(v.perf_estimate is not None for v in vertices):
    return ()
  message = (f"C++ vertex class {codelet.name}: no perf estimate (set_perf_estimate or "
             f"cycles=); its cycles are an estimate from the elements it reads and writes "
             f"({CYCLES_PER_ELEMENT} cycles each + {VERTEX_OVERHEAD_CYCLES})")
  warnings.warn(message, UserWarning, stacklevel=2)
  return (f"{codelet.name}: cycles are an estimate from the work done (no perf estimate given)",)


class FieldSpec:
  """A field's shape and dtype, as estimate functions see it."""

  def __init__(self, shape, dtype):
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  def __repr__(self):
    return f"FieldSpec(shape={self.shape}, dtype={self.dtype.name})"
