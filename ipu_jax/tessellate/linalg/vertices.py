"""Vertex primitives of the linear-algebra tile programs, with their cycle counts.

Each vertex is a JAX body on one tile's operands plus the tile's cycles for
it (these vertices split their work over the six workers themselves), mapped with :func:`~ipu_jax.tessellate.tile_map` like any vertex
primitive. Cycle sources (TessellateIPU, graphcore-research/tessellate-ipu,
``tessellate_ipu/linalg/*.py`` and ``tests/linalg/*.py``):

* ``JacobiSymSchur2``: 200 cycles, the ``perf_estimate`` the vertex declares.
* Column updates (``JacobiUpdateFirstStep``, ``JacobiUpdateSecondStep``,
  ``JacobiUpdateEigenvectors``, the QR/Hessenberg Householder updates and
  ``DotProduct1d``): an estimate, ``fixed + per_element * N``, chosen to sit
  under the hardware bounds TessellateIPU's benchmark tests assert (first
  step at N=256 <= 1,550 cycles; eigenvector update at N=512 <= 1,550
  cycles; Householder row update at N=1,024 <= 2,100 cycles), the cycle
  count's own overhead included.
"""

from __future__ import annotations

from typing import Callable

from jax.extend import core as jcore

from ipu_jax.tessellate.tile_map import VertexSpec, register_vertex

__all__ = ["linalg_vertex", "SCHUR2_CYCLES", "column_cycles"]

#: TessellateIPU's declared perf_estimate of JacobiSymSchur2 (tile_linalg_jacobi.py).
SCHUR2_CYCLES = 200


def column_cycles(fixed: int, per_element: float) -> Callable:
  """An estimate ``fixed + per_element * n`` for a vertex over ``n``-element columns."""
  def cycles(avals, attrs):
    del attrs
    n = max(int(a.shape[-1]) if a.shape else 1 for a in avals)
    return int(fixed + per_element * n)
  return cycles


def _with_attributes(body: Callable, params: dict) -> Callable:
  """``body`` with the tile_map attributes (static vertex fields) bound."""
  return (lambda *xs: body(*xs, **params)) if params else body


def linalg_vertex(vertex_name: str, body: Callable, cycles: Callable):
  """A vertex primitive running ``body`` on one tile, priced by ``cycles(avals, attrs)``."""
  p = jcore.Primitive(vertex_name)
  register_vertex(p, VertexSpec(vertex_name=lambda avals: vertex_name,
                                perf_estimate=cycles,
                                body=lambda prim, params: _with_attributes(body, params),
                                supervisor=True))
  return p
