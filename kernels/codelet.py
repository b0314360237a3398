"""Codelets: the vertex bodies a compute set runs on one tile.

A codelet is a pure JAX function over one tile's operands plus a cycle
estimator. Users write their own with :func:`codelet`::

    @codelet(inputs=("x",), outputs=("y",), cycles=lambda x: 20)
    def sum_vertex(x):
      return x.sum(keepdims=True)

The function takes the inputs (and in-outs) in declared order and returns the
outputs then the new in-out values (a single array when there is one). The
estimator takes the same operands as shape/dtype descriptions
(``jax.ShapeDtypeStruct``) and returns cycles for one vertex.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

__all__ = ["Codelet", "codelet"]


@dataclasses.dataclass(frozen=True, eq=False)
class Codelet:
  """A vertex type: a JAX function for one tile plus its cycle estimate.

  Attributes:
    name: the vertex type name shown in reports.
    fn: the body; ``fn(*inputs, *inouts) -> outputs + new inouts``.
    inputs: names of read-only fields.
    outputs: names of write-only fields.
    inouts: names of read-write fields.
    cycles: ``cycles(*operand_specs) -> int``, cycles of one vertex on one
      worker; ``None`` means use the graph's ``set_perf_estimate`` or 0.
    flops: optional ``flops(*operand_specs) -> int`` for the report.
    supervisor: a supervisor vertex (like poplin's AMP vertices) drives all
      the tile's workers itself: its ``cycles(target, *operand_specs)``
      returns the tile's cycles for the vertex, overheads included, and
      supervisor vertices on a tile run one after another.
  """

  name: str
  fn: Callable
  inputs: tuple = ()
  outputs: tuple = ()
  inouts: tuple = ()
  cycles: Optional[Callable] = None
  flops: Optional[Callable] = None
  supervisor: bool = False

  @property
  def fields(self) -> tuple:
    return tuple(self.inputs) + tuple(self.inouts) + tuple(self.outputs)

  @property
  def read_fields(self) -> tuple:
    return tuple(self.inputs) + tuple(self.inouts)

  @property
  def written_fields(self) -> tuple:
    return tuple(self.outputs) + tuple(self.inouts)

  def __call__(self, *operands):
    return self.fn(*operands)

  def estimate(self, *specs, target=None) -> int:
    """Cycles of one vertex on ``specs`` (``target`` for supervisor vertices)."""
    if self.cycles is None:
      return 0
    if self.supervisor:
      from ipu_jax.kernels.target import IPUTarget
      cycles = self.cycles(target if target is not None else IPUTarget(), *specs)
    else:
      cycles = self.cycles(*specs)
    try:  # a NumPy or 0-d array number is fine; a string or a negative count is not
      ok = not isinstance(cycles, (str, bytes, bool)) and float(cycles) >= 0
    except (TypeError, ValueError):
      ok = False
    if not ok:
      raise ValueError(f"codelet {self.name!r}: its cycles function must return a number >= 0 "
                       f"(the vertex's cycles); it returned {cycles!r}.")
    return int(cycles)


def codelet(inputs: Sequence[str] = (), outputs: Sequence[str] = (),
            inouts: Sequence[str] = (), cycles: Optional[Callable] = None,
            flops: Optional[Callable] = None, name: Optional[str] = None):
  """Decorator turning a JAX function into a :class:`Codelet`.

  Args:
    inputs: read-only field names, in the order ``fn`` takes them.
    outputs: write-only field names, in the order ``fn`` returns them.
    inouts: read-write fields; ``fn`` takes them after the inputs and returns
      their new values after the outputs.
    cycles: the cycle estimator (operand specs -> cycles), or an int.
    flops: optional FLOP count (operand specs -> int).
    name: vertex type name; defaults to the function's name.
  """
  if isinstance(cycles, int):
    constant = cycles
    cycles = lambda *_: constant  # noqa: E731

  def wrap(fn):
    return Codelet(name or fn.__name__, fn, tuple(inputs), tuple(outputs),
                   tuple(inouts), cycles, flops)

  return wrap
