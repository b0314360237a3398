"""Errors users catch: lowering failures and tile out-of-memory."""

from __future__ import annotations

__all__ = ["LoweringError", "OutOfMemoryError"]


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
