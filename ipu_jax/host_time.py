"""Host time of a program, measured on this machine.

What a program costs on the host, apart from the emulated device's cycles:
tracing, lowering and planning, the executable cache, XLA's compile, and
the wall time of each call (dispatch, argument conversion, and the run
itself, which here is the emulation on this machine's CPU; on an IPU it
would be the device's time). Each :class:`ipu_jax.Lowered` holds one
:class:`HostTimes`; the report's "Host side" section shows it beside the
modelled host-link figures (``ipu_jax/report/host_side.py``).

XLA's compile time and persistent-cache hits come from JAX's monitoring
events (``jax.monitoring``), attributed to the program whose first call
is being measured (:func:`measuring`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import threading
import time
from typing import Iterator

import jax

__all__ = ["HostSide", "HostTimes", "measuring", "peak_rss_bytes", "timer"]

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_HLO_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_CACHE_LOAD_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


@dataclasses.dataclass
class HostTimes:
  """Seconds spent on the host for one program (this machine's wall clock).

  Attributes:
    tracing_seconds: tracing the function to a jaxpr.
    lowering_seconds: lowering, fusion, cost and memory analysis, building
      the executor (0 when the executable cache supplied the program).
    cache: the executable cache's part: "off", "hit" (loaded), "stored"
      (missed, lowered and written), or "not cached: <why>".
    cache_seconds: reading (hit) or writing (stored) the cache entry,
      exporting the executor included.
    hlo_seconds: turning the first call's jitted program into HLO (JAX's
      lowering to StableHLO; an exported executor is read back here).
    compile_seconds: XLA's backend compile at the first call, or loading
      the executable when it came from JAX's persistent cache.
    compile_cache_hits: compiled executables loaded from JAX's persistent
      cache during the first call.
    first_call_seconds: the first call's wall time (compile + first run).
    calls: runs after the first.
    call_seconds: their total wall time (dispatch + the emulation's run).
    compiled_because: why this program was compiled rather than reused
      ("first call", or what changed: a shape, dtype or static value).
  """

  tracing_seconds: float = 0.0
  lowering_seconds: float = 0.0
  cache: str = "off"
  cache_seconds: float = 0.0
  hlo_seconds: float = 0.0
  compile_seconds: float = 0.0
  compile_cache_hits: int = 0
  first_call_seconds: float = 0.0
  calls: int = 0
  call_seconds: float = 0.0
  compiled_because: str = "first call"

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class HostSide:
  """What the report's "Host side" section reads from a program's profile.

  Attributes:
    times: the host time measured on this machine.
    argument_bytes: bytes of the program's arguments (sent each run).
    result_bytes: bytes of its results (returned each run).
  """

  times: HostTimes
  argument_bytes: int = 0
  result_bytes: int = 0


@contextlib.contextmanager
def timer() -> Iterator[list]:
  """``with timer() as t:`` ... ``t[0]`` is the block's wall seconds after it."""
  box = [0.0]
  start = time.perf_counter()
  try:
    yield box
  finally:
    box[0] = time.perf_counter() - start


_local = threading.local()
_listening = False


def _on_duration(event: str, duration: float, **_) -> None:
  record = getattr(_local, "record", None)
  if record is not None and event == _COMPILE_EVENT:
    record.compile_seconds += float(duration)
  elif record is not None and event == _HLO_EVENT:
    record.hlo_seconds += float(duration)


def _on_event(event: str, **_) -> None:
  record = getattr(_local, "record", None)
  if record is not None and event == _CACHE_HIT_EVENT:
    record.compile_cache_hits += 1


def _listen() -> None:
  global _listening
  if not _listening:
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    _listening = True


@contextlib.contextmanager
def measuring(record: HostTimes, first: bool) -> Iterator[None]:
  """Time one call of the program ``record`` belongs to.

  Args:
    record: where the time goes.
    first: the first call (compile + run): XLA's compile events during it
      are attributed to ``record``; later calls count as runs.
  """
  if first:
    _listen()
  outer = getattr(_local, "record", None)
  _local.record = record if first else outer
  start = time.perf_counter()
  try:
    yield
  finally:
    _local.record = outer
  # Only calls that returned count (a call refused while tracing ran nothing).
  elapsed = time.perf_counter() - start
  if first:
    record.first_call_seconds += elapsed
  else:
    record.calls += 1
    record.call_seconds += elapsed


def peak_rss_bytes() -> int:
  """This process's own peak resident memory, in bytes.

  Linux's ``VmHWM``, the high-water mark of this program's memory: a runner
  started from a larger process (the benchmark, after lowering programs of
  its own) reports its own peak. ``getrusage``'s ``ru_maxrss`` keeps the
  parent's across ``exec``; it is the fallback where ``/proc`` has no such
  line.
  """
  try:
    with open("/proc/self/status") as status:
      for line in status:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) * 1024  # kB
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
