"""Errors users catch: lowering failures, tile out-of-memory, trapped FP exceptions."""

from __future__ import annotations

__all__ = ["LoweringError", "OutOfMemoryError", "FloatingPointException"]


class LoweringError(Exception):
  """A JAX operation cannot be turned into a tile program.

  Raised before anything runs; the message names the primitive, its operand
  shapes and dtypes and the user's source line.
  """


class OutOfMemoryError(MemoryError):
  """A tile needs more SRAM than it has.

  Attributes:
    tile: the first tile over its limit.
    bytes_needed: that tile's peak bytes.
    bytes_available: the tile's SRAM.
    over_tiles: every tile over the limit.
    report: the :class:`ipu_jax.Report` of the program, so the memory view can
      still be read.
  """

  def __init__(self, message: str, *, tile: int, bytes_needed: int,
               bytes_available: int, over_tiles=(), report=None):
    super().__init__(message)
    self.tile = tile
    self.bytes_needed = bytes_needed
    self.bytes_available = bytes_available
    self.over_tiles = tuple(int(t) for t in over_tiles)
    self.report = report


class FloatingPointException(FloatingPointError):
  """A floating-point exception the program trapped (``floating_point_behaviour``
  ``inv``, ``div0`` or ``oflo``; see ``lowering/fp_exceptions.py``).

  A ``FloatingPointError``: ``except FloatingPointError`` catches it too.

  Attributes:
    kind: ``"inv"``, ``"div0"`` or ``"oflo"``.
    op: the operation (primitive name) that raised it.
    source: the user's ``file:line`` of that operation.
    step_index: the superstep's index in program order.
    step_name: the superstep's name (as in the report).
    iteration: the innermost loop iteration it happened in, or None.
    replica: the replica that raised it (replicated programs), or None.
  """

  def __init__(self, message: str, *, kind: str, op: str, source: str, step_index: int,
               step_name: str, iteration=None, replica=None):
    super().__init__(message)
    self.kind = kind
    self.op = op
    self.source = source
    self.step_index = step_index
    self.step_name = step_name
    self.iteration = iteration
    self.replica = replica
