"""Cycles of popops' elementwise vertices, from poplibs' published estimators.

For the common unary and binary operations on fp16 and fp32, the cost of a
tile follows the structure and per-operation figures of poplibs'
``UnaryOp1D`` / ``BinaryOp1D`` supervisor-vertex estimators
(``lib/popops/popopsCycleEstimators.{hpp,cpp}``, ``unaryOpPerfInfo`` and
``binaryOpPerfInfo``; Graphcore benchmarked or simulated each entry):

* the elements are split evenly over the worker contexts; each worker pays a
  fixed entry cost (unary 17 cycles, 33 for ``exp``; binary 29 for fp32, 26
  otherwise) plus its inner loop;
* the inner loop is either vectorised at the natural width (64 bits: 4 fp16
  or 2 fp32 per vector; per vector the table's cycles plus a load/store and
  loop overhead: 4 for unary ops, 2 for the binary ops with assembly codelets
  and 5 for the others), or unrolled by the table's factor at the table's
  cycles per unrolled group;
* the tile pays ``workers x worker cycles`` plus the supervisor's overhead
  (11 cycles, and 9 more for unary ops).

Operations or types not in the table keep the generic model of
``estimators.worker_split_cycles``; :func:`popops_elementwise_cycles` returns
``None`` for them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["UNARY", "BINARY", "popops_elementwise_cycles"]

# (cycles per loop, natural vector width?, unroll factor) by op and width
# (2: fp16, 4: fp32), after poplibs' unaryOpPerfInfo / binaryOpPerfInfo.
UNARY = {
    "exp": {2: (4, False, 4), 4: (6, False, 2)},
    "exp2": {2: (4, False, 4), 4: (6, False, 2)},
    "log": {2: (4, False, 4), 4: (12, False, 2)},
    "tanh": {2: (4, False, 4), 4: (12, False, 2)},
    "logistic": {2: (6, False, 4), 4: (12, False, 2)},
    "sqrt": {2: (23, False, 4), 4: (10, False, 2)},
    "rsqrt": {2: (19, False, 4), 4: (8, False, 2)},
    "neg": {2: (2, False, 4), 4: (2, False, 2)},
    "abs": {2: (1, False, 0), 4: (1, False, 0)},
    "floor": {2: (2, True, 0), 4: (2, True, 0)},
    "ceil": {2: (2, True, 0), 4: (2, True, 0)},
    "round": {2: (2, True, 0), 4: (2, True, 0)},
    "sign": {2: (5, True, 0), 4: (5, True, 0)},
    "erf": {2: (13, False, 1), 4: (41, False, 1)},
    "expm1": {2: (5, True, 0), 4: (4, False, 0)},
    "log1p": {2: (18, True, 0), 4: (18, True, 0)},
}
BINARY = {
    "add": {2: (1, True, 0), 4: (1, True, 0)},
    "sub": {2: (1, True, 0), 4: (1, True, 0)},
    "mul": {2: (1, True, 0), 4: (1, True, 0)},
    "div": {2: (21, False, 4), 4: (10, False, 2)},
    "max": {2: (4, False, 4), 4: (3, False, 2)},
    "min": {2: (4, False, 4), 4: (3, False, 2)},
}
# Binary ops with hand-written assembly codelets: a cheaper loop overhead.
_ASSEMBLY_BINARY = ("add", "sub", "mul")
_SUPERVISOR = 11
_UNARY_SUPERVISOR_EXTRA = 9


def _inner_unary(n, entry, vector):
  cycles, natural, unroll = entry
  if not natural and unroll > 0:
    return -(-n // unroll) * cycles
  width = vector if natural else 1
  return -(-n // width) * (cycles + 4)


def _inner_binary(op, n, entry, vector):
  cycles, natural, unroll = entry
  if natural:
    overhead = 2 if op in _ASSEMBLY_BINARY else 5
    return -(-n // vector) * (cycles + overhead)
  return -(-n // max(unroll, 1)) * cycles


def popops_elementwise_cycles(target, elements, op_name: str, dtype):
  """Tile cycles of popops' vertex for ``op_name`` on ``elements`` per tile.

  Args:
    target: the IPU target (worker contexts, vector width).
    elements: ``[num_tiles]`` elements each tile computes.
    op_name: the JAX primitive name (``"add"``, ``"exp"``...).
    dtype: the element type.

  Returns:
    ``[num_tiles]`` float64 cycles (0 where a tile has no elements), or
    ``None`` when the operation or type has no poplibs figure here.
  """
  dtype = np.dtype(dtype)
  if dtype.kind != "f" or dtype.itemsize not in (2, 4):
    return None
  width = dtype.itemsize
  if op_name in UNARY:
    entry, unary = UNARY[op_name][width], True
  elif op_name in BINARY:
    entry, unary = BINARY[op_name][width], False
  else:
    return None
  elements = np.asarray(elements, np.int64)
  w = target.worker_contexts
  per_worker = -(-elements // w)
  vector = max(1, target.vector_width_bytes // width)
  if unary:
    start = 33 if op_name == "exp" else 17
    worker = start + _inner_unary(per_worker, entry, vector)
    cycles = w * worker + _SUPERVISOR + _UNARY_SUPERVISOR_EXTRA
  else:
    start = 29 if width == 4 else 26
    worker = start + _inner_binary(op_name, per_worker, entry, vector)
    cycles = w * worker + _SUPERVISOR
  return np.where(elements > 0, cycles, 0).astype(np.float64)
