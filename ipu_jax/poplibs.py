"""Library functions over the graph API, after poplibs' popops and poplin.

They build vertices and compute sets on a :class:`ipu_jax.graph.Graph`, as
the real libraries do, so their cost shows in the engine's report::

    from ipu_jax import graph as g, poplibs
    prog = g.Sequence()
    v3 = poplibs.add(gr, v1, v2, prog, "Add")
"""

from __future__ import annotations

import numpy as np

from ipu_jax import graph as g
from ipu_jax.kernels import library
from ipu_jax.lowering.mapping import linear_chunk

__all__ = ["add", "sub", "mul", "map_elementwise", "matmul"]


def map_elementwise(graph: g.Graph, codelet, inputs, prog: g.Sequence,
                    name: str = "") -> g.GraphTensor:
  """Apply an elementwise codelet; the result is mapped like ``inputs[0]``.

  One vertex per tile holding output elements, each reading the matching
  elements of every input (exchanged in when they live elsewhere).
  """
  shape = inputs[0].shape
  for x in inputs[1:]:
    if x.shape != shape:
      raise ValueError(f"{codelet.name}: shapes differ: {[t.shape for t in inputs]}")
  out = graph.clone(inputs[0], name or codelet.name)
  cs = graph.add_compute_set(name or codelet.name)
  tiles = graph._element_tiles(out.index).reshape(-1)
  order = np.argsort(tiles, kind="stable")
  boundaries = np.flatnonzero(np.diff(tiles[order])) + 1
  flat_out = out.flatten()
  flat_in = [x.flatten() for x in inputs]
  for positions in np.split(order, boundaries):
    if positions.size == 0:
      continue
    fields = {f: x[positions] for f, x in zip(codelet.inputs, flat_in)}
    fields[codelet.outputs[0]] = flat_out[positions]
    graph.add_vertex(cs, codelet, tile=int(tiles[positions[0]]), **fields)
  prog.add(g.Execute(cs))
  return out


def add(graph, a, b, prog, name: str = "add"):
  """``a + b`` (popops::add)."""
  return map_elementwise(graph, library.binary("add"), [a, b], prog, name)


def sub(graph, a, b, prog, name: str = "sub"):
  """``a - b`` (popops::sub)."""
  return map_elementwise(graph, library.binary("sub"), [a, b], prog, name)


def mul(graph, a, b, prog, name: str = "mul"):
  """``a * b`` (popops::mul)."""
  return map_elementwise(graph, library.binary("mul"), [a, b], prog, name)


def matmul(graph: g.Graph, a: g.GraphTensor, b: g.GraphTensor, prog: g.Sequence,
           name: str = "matmul") -> g.GraphTensor:
  """``a @ b`` for 2-D ``a [M, K]`` and ``b [K, N]`` (poplin::matMul).

  The output is cut into a grid of blocks, one per tile, chosen so the blocks
  are as square as the tile count allows; each tile's vertex multiplies its
  rows of ``a`` by its columns of ``b``, which the exchange brings in.
  """
  (m, k), (k2, n) = a.shape, b.shape
  if k != k2:
    raise ValueError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
  tiles = graph.target.num_tiles
  grid_m, grid_n = _grid(m, n, tiles)
  block_m, block_n = -(-m // grid_m), -(-n // grid_n)
  out = graph.add_variable(a.dtype, (m, n), name)
  cs = graph.add_compute_set(name)
  codelet = library.matmul_block(a.dtype)
  tile = 0
  for i in range(0, m, block_m):
    for j in range(0, n, block_n):
      rows, cols = slice(i, min(i + block_m, m)), slice(j, min(j + block_n, n))
      graph.set_tile_mapping(out[rows, cols], tile)
      graph.add_vertex(cs, codelet, tile=tile, a=a[rows], b=b[:, cols], c=out[rows, cols])
      tile += 1
  prog.add(g.Execute(cs))
  return out


def _grid(m: int, n: int, tiles: int):
  """Blocks along M and N: at most ``tiles`` blocks, as square as possible."""
  best = (1, 1)
  best_cost = None
  for grid_m in range(1, min(m, tiles) + 1):
    grid_n = max(1, min(n, tiles // grid_m))
    bm, bn = -(-m // grid_m), -(-n // grid_n)
    # Per tile work is bm*bn*K; exchange is (bm + bn)*K: minimise both.
    cost = (bm * bn, bm + bn)
    if best_cost is None or cost < best_cost:
      best, best_cost = (grid_m, grid_n), cost
  return best


del linear_chunk
