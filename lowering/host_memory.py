"""Handing freed host memory back to the operating system after a lowering.

Lowering a model allocates and frees millions of small NumPy arrays (per-tile
cost arrays, plans). glibc keeps freed small blocks in its heap, scattered
between live ones, so after lowering BERT-base about 1.5 GB of the process's
resident memory was free heap that the compiled step's large buffers could
not reuse. ``malloc_trim`` returns those pages. Elsewhere (other C libraries,
other systems) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_memory"]


@functools.lru_cache(maxsize=1)
def _malloc_trim():
  name = ctypes.util.find_library("c")
  try:
    trim = ctypes.CDLL(name).malloc_trim if name else None
  except (OSError, AttributeError):  # not glibc
    return None
  if trim is not None:
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return trim


def release_free_memory() -> bool:
  """Return the free pages of the C heap to the system; whether it could try.

  (glibc's own answer, whether any page went back, is not what callers need.)

  >>> isinstance(release_free_memory(), bool)
  True
  """
  trim = _malloc_trim()
  if trim is None:
    return False
  trim(0)
  return True
