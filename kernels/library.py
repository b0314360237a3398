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

from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.kernels.codelet import Codelet
from ipu_jax.kernels.estimators import ELEMENTWISE_COST, WORKER_OVERHEAD
from ipu_jax.target import IPUTarget

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


@functools.lru_cache(maxsize=None)
def unary(op: str) -> Codelet:
  """``y = op(x)`` elementwise."""
  fn = _UNARY[op]
  cost = ELEMENTWISE_COST.get(op, 1)
  return Codelet(vocab.vertex(vocab.ELEMENTWISE, op), fn, ("x",), ("y",),
                 cycles=lambda x, y: vector_cycles(x.size, x.dtype.itemsize, cost),
                 flops=lambda x, y: x.size)


@functools.lru_cache(maxsize=None)
def binary(op: str) -> Codelet:
  """``z = op(x, y)`` elementwise."""
  fn = _BINARY[op]
  cost = ELEMENTWISE_COST.get(op, 1)
  return Codelet(vocab.vertex(vocab.ELEMENTWISE, op), fn, ("x", "y"), ("z",),
                 cycles=lambda x, y, z: vector_cycles(x.size, x.dtype.itemsize, cost),
                 flops=lambda x, y, z: x.size)


# Fields: inputs (y, scale), then the in-out x; ``x += scale * y``.
scaled_add = Codelet(
    vocab.SCALED_ADD, lambda y, scale, x: x + scale * y, ("y", "scale"), (),
    inouts=("x",),
    cycles=lambda y, scale, x: vector_cycles(x.size, x.dtype.itemsize, 2),
    flops=lambda y, scale, x: 2 * x.size)

partial_reduce = Codelet(
    vocab.REDUCE_PARTIAL, lambda x: jnp.sum(x, axis=-1), ("x",), ("partials",),
    cycles=lambda x, p: vector_cycles(x.size, x.dtype.itemsize, 1) + 2 * p.size,
    flops=lambda x, p: x.size)

final_reduce = Codelet(
    vocab.vertex(vocab.REDUCE, "add"), lambda partials: jnp.sum(partials, axis=0),
    ("partials",), ("out",),
    cycles=lambda p, o: vector_cycles(p.size, p.dtype.itemsize, 1) + 2 * o.size,
    flops=lambda p, o: p.size)

dot_product = Codelet(
    vocab.DOT, lambda a, b: jnp.dot(a, b, precision="highest"), ("a", "b"), ("out",),
    cycles=lambda a, b, o: vector_cycles(a.size, a.dtype.itemsize, 1) + 4,
    flops=lambda a, b, o: 2 * a.size)


@functools.lru_cache(maxsize=None)
def matmul_block(dtype) -> Codelet:
  """``c = a @ b`` for one tile's block, at the AMP rate for the dtype."""
  itemsize = np.dtype(dtype).itemsize

  def cycles(a, b, c):
    macs = a.shape[0] * a.shape[1] * b.shape[1]
    rate = _DEFAULT.fp16_flops_per_cycle if itemsize <= 2 else _DEFAULT.fp32_flops_per_cycle
    # The AMP unit is shared by the workers: per-worker cycles = total / 6.
    return int(WORKER_OVERHEAD + -(-2 * macs // (rate * _DEFAULT.worker_contexts)))

  return Codelet(vocab.vertex(vocab.MATMUL_BLOCK, np.dtype(dtype)),
                 lambda a, b: jnp.matmul(a, b, precision="highest"), ("a", "b"), ("c",),
                 cycles=cycles, flops=lambda a, b, c: 2 * a.shape[0] * a.shape[1] * b.shape[1])


copy = Codelet(vocab.COPY, lambda x: x, ("x",), ("y",),
               cycles=lambda x, y: vector_cycles(x.size, x.dtype.itemsize, 1))

fill = Codelet(vocab.FILL, lambda value, x: jnp.full_like(x, value), ("value",), (),
               inouts=("x",),
               cycles=lambda value, x: vector_cycles(x.size, x.dtype.itemsize, 1))
