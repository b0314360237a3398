"""The host side of an on-device loop: I/O tiles, overlapped transfers, output modes.

A program that loops on the device over data from the host (``lax.scan``
over arguments: a Keras execution of ``steps_per_execution`` steps, its
gradient-accumulation loop, a jitted training loop) loads each iteration's
slice of those arguments over the host link and stores each iteration's
stacked results back (see ``docs/host_side.md#io-tiles``):

* Without I/O tiles the transfers land on the compute tiles and hold them:
  an iteration costs ``load + compute + store``.
* With ``io_tiles.num_io_tiles`` I/O tiles (``IPUTarget.io_tiles_per_ipu``)
  the transfers land on those tiles and reach the compute tiles in one
  on-chip exchange (priced by the exchange model). Under PopART's
  ``ExchangeStrategy`` semantics ``JustInTime`` still runs load, compute and
  store in turn; ``OverlapInnerLoop`` loads iteration i + 1 and stores
  iteration i - 1 while iteration i computes, inside the innermost loop (its
  first load and last store are not overlapped, at every outer iteration);
  ``OverlapLoops`` overlaps across the loop nest too, so only the
  execution's first load and last store are not. An overlapped iteration
  costs ``max(compute, load + store) + the I/O exchange``.

The loop is found in the jaxpr (:func:`find_host_loop`): the first top-level
``scan`` whose scanned operands are the program's arguments (through
reshapes and casts), and inside its body a ``scan`` over those slices (the
inner loop). Output modes (:func:`apply_output_mode`) select which of that
loop's stacked outputs go back to the host, as PopTorch's ``OutputMode``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
import numpy as np

from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering import program as P
from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.lowering.exchange import ExchangeCost, exchange_cycles
from ipu_jax.lowering.jax_compat import is_extended_dtype, physical_nbytes

__all__ = ["MAX_IO_TILES", "OUTPUT_MODES", "IO_STRATEGIES", "HostLoop", "HostIOProfile",
           "check_num_io_tiles", "landing_cycles", "suggest_num_io_tiles_for", "find_host_loop", "select_outputs", "apply_output_mode", "host_io_profile",
           "check_io_memory"]

# TF-IPU's poplar_compiler refuses more than 192 I/O tiles per IPU.
MAX_IO_TILES = 192
OUTPUT_MODES = ("all", "final", "sum", "every_n")
IO_STRATEGIES = ("JustInTime", "OverlapInnerLoop", "OverlapLoops")
# Primitives that pass an argument on to the loop unchanged in bytes.
_PASS_THROUGH = {"reshape", "squeeze", "convert_element_type", "copy", "copy_p",
                 "expand_dims"}


def check_num_io_tiles(count: int, tiles_per_ipu: int) -> int:
  """``io_tiles.num_io_tiles`` checked against an IPU of ``tiles_per_ipu`` tiles.

  Raises:
    ValueError: the count is negative, odd, over 192 or over half the tiles.
  """
  name = "IPUConfig.io_tiles.num_io_tiles"
  if isinstance(count, bool) or not isinstance(count, (int, np.integer)):
    raise TypeError(f"{name} must be an int; got {count!r}.")
  count = int(count)
  if count < 0:
    raise ValueError(f"{name} must be 0 or a positive even count; got {count}.")
  if count % 2:
    raise ValueError(f"{name} must be even (I/O tiles are set aside in pairs, as TF-IPU "
                     f"and GCL require); got {count}. Use {count - 1} or {count + 1}.")
  limit = min(MAX_IO_TILES, tiles_per_ipu // 2 // 2 * 2)
  if count > limit:
    raise ValueError(
        f"{name}={count} leaves too few compute tiles: an IPU of {tiles_per_ipu} tiles "
        f"takes at most {limit} I/O tiles (at most half its tiles, and at most "
        f"{MAX_IO_TILES} as TF-IPU allows), so that {tiles_per_ipu - limit} or more compute.")
  return count


def suggest_num_io_tiles_for(nbytes: float, bytes_per_tile: float) -> int:
  """PopART's rule: overlapped bytes / SRAM per tile, up to a power of two (>= 2)."""
  tiles = max(math.ceil(nbytes / bytes_per_tile), 1) if nbytes > 0 else 0
  return 0 if tiles == 0 else max(2, 1 << (tiles - 1).bit_length())


# -- the loop ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostLoop:
  """A program's on-device loop over host data.

  Attributes:
    outer: iterations of the top-level loop.
    inner: iterations of the loop inside it over the same data (1: none).
    input_bytes: bytes loaded from the host per (innermost) iteration.
    output_bytes: stacked results stored to the host per outer iteration
      (mode 'all'): the outer loop stacks them.
    stacked_outputs: indices of the program's outputs that are the loop's
      stacked results (leading axis ``outer``).
    input_args: indices of the program's arguments the loop streams.
  """

  outer: int
  inner: int
  input_bytes: int
  output_bytes: int
  stacked_outputs: tuple
  input_args: tuple

  @property
  def iterations(self) -> int:
    return self.outer * self.inner


def _origins(jaxpr) -> dict:
  """Variable -> the jaxpr input it is a reshape/cast of (through such chains)."""
  origin = {v: v for v in jaxpr.invars}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _PASS_THROUGH and len(eqn.invars) == 1:
      src = eqn.invars[0]
      if not isinstance(src, jcore.Literal) and src in origin:
        origin[eqn.outvars[0]] = origin[src]
  return origin


def _scanned(eqn, origin) -> list:
  """The jaxpr inputs a scan's scanned operands come from."""
  start = eqn.params["num_consts"] + eqn.params["num_carry"]
  return [origin[v] for v in eqn.invars[start:]
          if not isinstance(v, jcore.Literal) and v in origin]


def _inner_length(eqn) -> int:
  """Iterations of a scan in ``eqn``'s body over the body's scanned slices (1: none)."""
  body = eqn.params["jaxpr"].jaxpr
  start = eqn.params["num_consts"] + eqn.params["num_carry"]
  slices = set(body.invars[start:])
  origin = {k: v for k, v in _origins(body).items() if v in slices}
  for inner in body.eqns:
    if inner.primitive.name == "scan" and _scanned(inner, origin):
      return int(inner.params["length"])
  return 1


def find_host_loop(closed) -> Optional[HostLoop]:
  """The first top-level ``scan`` over the program's arguments, or None."""
  jaxpr = closed.jaxpr
  origin = _origins(jaxpr)
  position = {v: i for i, v in enumerate(jaxpr.invars)}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "scan":
      continue
    sources = _scanned(eqn, origin)
    if not sources:
      continue
    outer = int(eqn.params["length"])
    inner = _inner_length(eqn)
    args = tuple(sorted({position[v] for v in sources}))
    input_bytes = sum(physical_nbytes(jaxpr.invars[i].aval) for i in args)
    ys = set(eqn.outvars[eqn.params["num_carry"]:])
    stacked = tuple(i for i, v in enumerate(jaxpr.outvars)
                    if not isinstance(v, jcore.Literal) and v in ys)
    output_bytes = sum(physical_nbytes(jaxpr.outvars[i].aval) for i in stacked)
    n = max(outer * inner, 1)
    return HostLoop(outer=outer, inner=inner, input_bytes=math.ceil(input_bytes / n),
                    output_bytes=math.ceil(output_bytes / max(outer, 1)),
                    stacked_outputs=stacked,
                    input_args=args)
  return None


# -- output modes --------------------------------------------------------------


def select_outputs(value, mode: str, period: int, axis: int = 0, xp=jnp):
  """What output ``mode`` keeps of ``value`` stacked along ``axis`` (``xp``:
  ``jnp`` on the device, ``np`` for the same selection on the host)."""
  index = [slice(None)] * axis
  if mode == "final":
    return value[tuple(index + [-1])]
  if mode == "sum":
    return xp.sum(value, axis=axis, dtype=value.dtype)
  if mode == "every_n":
    return value[tuple(index + [slice(period - 1, None, period)])]
  return value


def apply_output_mode(closed, loop: Optional[HostLoop], mode: str, period: int):
  """``closed`` with its loop's stacked outputs reduced as ``mode`` says.

  ``'all'`` returns ``closed`` itself. The selection runs on the device, so
  the host receives only what the mode keeps.

  Raises:
    ValueError: naming ``outputs.mode`` when the program has no on-device
      loop over its arguments, or ``outputs.return_period`` when it does not
      divide the loop's iterations.
  """
  if mode not in OUTPUT_MODES:
    raise ValueError(f"IPUConfig.outputs.mode must be one of "
                     f"{', '.join(map(repr, OUTPUT_MODES))}; got {mode!r}.")
  if mode == "all":
    return closed
  if loop is None:
    raise ValueError(
        f"IPUConfig.outputs.mode={mode!r} selects among the stacked outputs of an on-device "
        f"loop (a top-level lax.scan over the function's arguments), and this program has "
        f"none; use mode 'all' or loop over the data inside the function.")
  if not loop.stacked_outputs:  # results summed on the device already (a Keras fit)
    return closed
  if mode == "every_n" and loop.outer % period:
    raise ValueError(
        f"IPUConfig.outputs.return_period={period} must divide the loop's {loop.outer} "
        f"iterations (mode 'every_n').")
  stacked = set(loop.stacked_outputs)
  if mode == "sum":
    _refuse_summed_keys(closed, loop.stacked_outputs)

  def selected(*args):
    outs = jcore.jaxpr_as_fun(closed)(*args)
    return [select_outputs(v, mode, period) if i in stacked else v for i, v in enumerate(outs)]

  return jax.make_jaxpr(selected)(*[v.aval for v in closed.jaxpr.invars])


def _refuse_summed_keys(closed, stacked_outputs) -> None:
  """Typed PRNG keys have no sum: refuse mode 'sum' on a stacked key output."""
  outvars = closed.jaxpr.outvars
  keys = [i for i in stacked_outputs if is_extended_dtype(outvars[i].aval.dtype)]
  if keys:
    raise ValueError(
        f"IPUConfig.outputs.mode='sum' adds up the loop's stacked outputs, and output(s) "
        f"{keys} ({', '.join(outvars[i].aval.str_short() for i in keys)}) are PRNG keys, "
        f"which have no sum; use mode 'all', 'final' or 'every_n', or return "
        f"jax.random.key_data of the keys.")


def _stores(loop: HostLoop, mode: str, period: int) -> tuple:
  """(bytes of one store in the loop, stores in the loop, bytes stored once after it)."""
  if not loop.output_bytes:
    return 0, 0, 0
  if mode == "all":
    return loop.output_bytes, loop.outer, 0
  if mode == "every_n":
    return loop.output_bytes, loop.outer // period, 0
  # 'final' and 'sum': one outer iteration's worth, after the loop.
  return 0, 0, loop.output_bytes


# -- the cost ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HostIOProfile:
  """What host transfers add to one execution of a looping program.

  Cycles are per replica. ``step_cycles`` is the execution with its
  transfers, as the strategy schedules them; ``serial_cycles`` the same
  execution with every transfer in turn with compute (what it costs without
  I/O tiles, on these compute tiles).

  Attributes:
    num_io_tiles: I/O tiles per IPU (0: transfers land on compute tiles).
    strategy: the exchange strategy (``'none'`` without I/O tiles).
    outer, inner: loop iterations (see :class:`HostLoop`).
    load_cycles: one iteration's load from the host.
    store_cycles: one store to the host (``stores`` of them in the loop, one
      per outer iteration the output mode keeps).
    io_exchange_cycles: an iteration's exchanges between the I/O and compute
      tiles (its load's, and its share of the stores').
    compute_cycles: the program's device cycles per iteration.
    overlapped_iterations: iterations whose transfers overlap compute.
    serial_cycles / step_cycles: the execution, see above.
    overlapped_fraction: fraction of compute time with I/O running beside it.
    host_bytes_in / host_bytes_out: bytes over the host link per execution.
    output_mode: which stacked outputs return (``outputs.mode``).
    io_tile_bytes: bytes each I/O tile holds (double buffered when overlapped).
  """

  num_io_tiles: int
  strategy: str
  outer: int
  inner: int
  load_cycles: float
  store_cycles: float
  stores: int
  io_exchange_cycles: float
  compute_cycles: float
  overlapped_iterations: int
  serial_cycles: float
  step_cycles: float
  overlapped_fraction: float
  host_bytes_in: int
  host_bytes_out: int
  output_mode: str
  io_tile_bytes: int = 0

  def as_dict(self) -> dict:
    """Plain JSON-ready values (``report.json["host_io"]``)."""
    return {k: (float(v) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()}


def _transfer_cycles(target: IPUTarget, nbytes: int) -> float:
  """A host transfer: the host link's rate, or the landing tiles' exchange
  rate when the few I/O tiles receive slower than the link delivers."""
  if nbytes <= 0:
    return 0.0
  rate = target.host_link_bytes_per_second / target.clock_hz
  if target.io_tiles_per_ipu:
    rate = min(rate, target.io_tiles_per_ipu * target.num_ipus
               * target.exchange_bytes_per_cycle)
  return nbytes / rate + target.sync_cycles_host


def _io_exchange(target: IPUTarget, nbytes: int, received: Optional[np.ndarray]) -> float:
  """One iteration's ``nbytes`` from the I/O tiles to the compute tiles.

  ``received`` is the compute tiles' share per tile (the streamed arguments'
  mapping), else the bytes spread evenly. Priced on the whole chip's tiles,
  I/O tiles last on each IPU.
  """
  io, compute = target.io_tiles_per_ipu, target.tiles_per_ipu
  if io == 0 or nbytes <= 0:
    return 0.0
  chip = target.replace(tiles_per_ipu=compute + io, io_tiles_per_ipu=0)
  cost = ExchangeCost.zeros(chip)
  tiles = np.arange(chip.num_tiles)
  is_io = tiles % chip.tiles_per_ipu >= compute
  cost.bytes_out[is_io] = math.ceil(nbytes / (io * target.num_ipus))
  if received is None:
    received = np.full(target.num_tiles, math.ceil(nbytes / target.num_tiles), np.int64)
  cost.bytes_in[~is_io] = received
  return exchange_cycles(chip, cost) + target.sync_cycles_internal


def _overlapped(loop: HostLoop, strategy: str, io: int) -> int:
  """Iterations whose load/store overlap a neighbour's compute."""
  if io == 0 or strategy == "JustInTime":
    return 0
  if strategy == "OverlapLoops" or loop.inner < 2:
    # PopART: a loop of fewer than 2 iterations is absent, so the outer loop
    # is then the innermost.
    return max(loop.iterations - 1, 0)
  return loop.outer * (loop.inner - 1)


def landing_cycles(program, profile, streamed: set) -> float:
  """Cycles of the loop's copies of each iteration's slice out of the stacked
  arguments (``scan/slice`` steps reading them, and inner loops' slices of
  those slices): on the chip each iteration's data lands from the host where
  it is used, so the host transfer replaces them (0 if the steps do not
  line up with the profile's)."""
  nodes = list(P.iter_steps(program))
  if len(nodes) != len(profile.steps):
    return 0.0
  streamed, total = set(streamed), 0.0
  for (node, _, _), step in zip(nodes, profile.steps):
    if (isinstance(node, P.Superstep) and node.name == "scan/slice"
        and any(t.id in streamed for t in node.reads)):
      streamed.update(t.id for t in node.writes)
      total += step.total_cycles * step.executions
  return total


def host_io_profile(loop: HostLoop, target: IPUTarget, device_cycles: float, strategy: str,
                    output_mode: str = "all", period: int = 1,
                    received: Optional[np.ndarray] = None) -> HostIOProfile:
  """The cost of ``loop``'s host transfers beside ``device_cycles`` of compute."""
  n = max(loop.iterations, 1)
  per_store, stores, after = _stores(loop, output_mode, period)
  load = _transfer_cycles(target, loop.input_bytes)
  store = _transfer_cycles(target, per_store)
  exchange = (_io_exchange(target, loop.input_bytes, received)
              + stores * _io_exchange(target, per_store, None) / n)
  compute = device_cycles / n
  final = _transfer_cycles(target, after) + _io_exchange(target, after, None)
  # Stores are spread over the iterations they overlap.
  io_time = load + stores * store / n
  serial = device_cycles + n * (io_time + exchange) + final
  k = _overlapped(loop, strategy, target.io_tiles_per_ipu)
  # Each overlapped pair replaces compute + io by max(compute, io).
  step = serial - k * min(compute, io_time)
  fraction = (k * min(compute, io_time) / device_cycles) if device_cycles else 0.0
  double = 2 if k else 1
  io_bytes = (math.ceil(double * (loop.input_bytes + max(per_store, after))
                        / (target.io_tiles_per_ipu * target.num_ipus))
              if target.io_tiles_per_ipu else 0)
  return HostIOProfile(
      num_io_tiles=target.io_tiles_per_ipu,
      strategy=strategy if target.io_tiles_per_ipu else "none",
      outer=loop.outer, inner=loop.inner, load_cycles=load, store_cycles=store, stores=stores,
      io_exchange_cycles=exchange, compute_cycles=compute, overlapped_iterations=k,
      serial_cycles=serial, step_cycles=step, overlapped_fraction=fraction,
      host_bytes_in=loop.input_bytes * n, host_bytes_out=per_store * stores + after,
      output_mode=output_mode, io_tile_bytes=io_bytes)


def check_io_memory(profile: HostIOProfile, target: IPUTarget, proportion: float,
                    allow_out_of_memory: bool = False, what: str = "the program") -> None:
  """Raises ``OutOfMemoryError`` when the I/O tiles cannot hold an iteration's data."""
  if not profile.num_io_tiles:
    return
  budget = int(target.bytes_per_tile * proportion)
  if profile.io_tile_bytes > budget and not allow_out_of_memory:
    need = suggest_num_io_tiles_for(profile.io_tile_bytes * profile.num_io_tiles
                                    * target.num_ipus, target.bytes_per_tile * proportion)
    raise OutOfMemoryError(
        f"{what}: each of the {profile.num_io_tiles} I/O tiles per IPU must hold "
        f"{profile.io_tile_bytes:,} bytes of streamed data, over its budget of {budget:,} "
        f"(io_tiles.available_memory_proportion={proportion} of {target.bytes_per_tile:,}); "
        f"set io_tiles.num_io_tiles to {need} or more, or raise the proportion.",
        tile=target.tiles_per_ipu, bytes_needed=profile.io_tile_bytes, bytes_available=budget)
