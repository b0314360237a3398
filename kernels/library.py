"""The built-in codelets, each a JAX function with its cycle estimator.

These are the vertex types the lowering and `ipu_jax.poplibs` use: elementwise
unary and binary ops, scaled add, partial and final reduce, dot product, a
matmul block, copy and fill. Estimators see operand shapes and dtypes; names
come from :mod:`ipu_jax.kernels.vocabulary`, the same the lowering rules use.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels import popops
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.kernels.amp import amp_block_cycles
from ipu_jax.kernels.codelet import Codelet
from ipu_jax.kernels.estimators import WORKER_OVERHEAD, elementwise_cycles
from ipu_jax.kernels.reduce import reduce_vertex_cycles
from ipu_jax.kernels.target import IPUTarget

__all__ = ["unary", "binary", "scaled_add", "partial_reduce", "final_reduce",
           "dot_product", "matmul_block", "copy", "fill", "vector_cycles"]

_DEFAULT = IPUTarget()


def vector_cycles(elements: int, itemsize: int, cost_per_vector: float) -> int:
  """Cycles for one worker to stream ``elements`` at ``cost_per_vector``."""
  per_vector = max(1, _DEFAULT.vector_width_bytes // max(1, itemsize))
  return int(WORKER_OVERHEAD + -(-elements // per_vector) * cost_per_vector)


_UNARY = {
    "neg": jnp.negative, "exp": jnp.exp, "log": jnp.log, "tanh": jnp.tanh,
    "sqrt": jnp.sqrt, "abs": jnp.abs, "relu": lambda x: jnp.maximum(x, 0),
}
_BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
    "div": jnp.divide, "max": jnp.maximum, "min": jnp.minimum,
}


def _elementwise_tile_cycles(op: str):
  """Tile cycles of a popops elementwise supervisor vertex: the lowering's estimator."""
  def cycles(target, x, *rest):
    return int(elementwise_cycles(target, np.array([x.size]), op, x.dtype.itemsize,
                                  dtype=x.dtype)[0])
  return cycles


@functools.lru_cache(maxsize=None)
def unary(op: str) -> Codelet:
  """``y = op(x)`` elementwise (a supervisor vertex, costed as the lowering costs it)."""
  fn = _UNARY[op]
  return Codelet(vocab.vertex(vocab.ELEMENTWISE, op), fn, ("x",), ("y",),
                 cycles=_elementwise_tile_cycles(op),
                 flops=lambda x, y: x.size, supervisor=True)


@functools.lru_cache(maxsize=None)
def binary(op: str) -> Codelet:
  """``z = op(x, y)`` elementwise (a supervisor vertex, costed as the lowering costs it)."""
  fn = _BINARY[op]
  return Codelet(vocab.vertex(vocab.ELEMENTWISE, op), fn, ("x", "y"), ("z",),
                 cycles=_elementwise_tile_cycles(op),
                 flops=lambda x, y, z: x.size, supervisor=True)


# Fields: inputs (y, scale), then the in-out x; ``x += scale * y``.
# popops' ScaledAddSupervisor: a supervisor vertex, costed by the same
# estimator as the lowering's scaled adds.
scaled_add = Codelet(
    vocab.SCALED_ADD, lambda y, scale, x: x + scale * y, ("y", "scale"), (),
    inouts=("x",),
    cycles=lambda target, y, scale, x: int(popops.scaled_add_cycles(
        target, np.array([x.size]), x.dtype, y.dtype)[0]),
    flops=lambda y, scale, x: 2 * x.size, supervisor=True)

# popops' Reduce vertices (worker vertices): the lowering's reduce estimator
# for one vertex.
partial_reduce = Codelet(
    vocab.REDUCE_PARTIAL, lambda x: jnp.sum(x, axis=-1), ("x",), ("partials",),
    cycles=lambda x, p: reduce_vertex_cycles(_DEFAULT, p.size, x.size // max(p.size, 1), x.dtype),
    flops=lambda x, p: x.size)

final_reduce = Codelet(
    vocab.vertex(vocab.REDUCE, "add"), lambda partials: jnp.sum(partials, axis=0),
    ("partials",), ("out",),
    cycles=lambda p, o: reduce_vertex_cycles(_DEFAULT, o.size, p.size // max(o.size, 1), p.dtype),
    flops=lambda p, o: p.size)

dot_product = Codelet(
    vocab.DOT, lambda a, b: jnp.dot(a, b, precision="highest"), ("a", "b"), ("out",),
    cycles=lambda a, b, o: vector_cycles(a.size, a.dtype.itemsize, 1) + 4,
    flops=lambda a, b, o: 2 * a.size)


@functools.lru_cache(maxsize=None)
def matmul_block(dtype) -> Codelet:
  """``c = a @ b`` for one tile's block on the AMP unit.

  A supervisor vertex: its cycles are the shared AMP estimator's
  (:func:`ipu_jax.kernels.amp.amp_block_cycles`), the same cycles the
  ``dot_general`` rule charges for the same block.
  """
  itemsize = np.dtype(dtype).itemsize

  def cycles(target, a, b, c):
    return int(amp_block_cycles(target, a.shape[0], a.shape[1], b.shape[1], itemsize))

  return Codelet(vocab.vertex(vocab.MATMUL_BLOCK, np.dtype(dtype)),
                 lambda a, b: jnp.matmul(a, b, precision="highest"), ("a", "b"), ("c",),
                 cycles=cycles, flops=lambda a, b, c: 2 * a.shape[0] * a.shape[1] * b.shape[1],
                 supervisor=True)


copy = Codelet(vocab.COPY, lambda x: x, ("x",), ("y",),
               cycles=lambda x, y: vector_cycles(x.size, x.dtype.itemsize, 1))

# popops' Fill (a worker vertex), as the lowering's fills.
fill = Codelet(vocab.FILL, lambda value, x: jnp.full_like(x, value), ("value",), (),
               inouts=("x",),
               cycles=lambda value, x: int(popops.fill_vertex_cycles(
                   _DEFAULT, x.size, x.dtype.itemsize)))
