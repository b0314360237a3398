"""Refuse a program that cannot fit the target's SRAM before planning anything.

Planning a tensor costs host memory and time in proportion to its elements
(tile maps, copy plans, runs of a layout): a 140,000² float32 transpose asks
for tables of tens of gigabytes before the out-of-memory check after
planning (:func:`ipu_jax.lowering.analysis.check_memory`) could say it does
not fit. This pass reads only the jaxpr's avals (shapes and dtypes, no
mappings) and raises :class:`~ipu_jax.OutOfMemoryError` when a lower bound
on the program's tile memory exceeds the target's SRAM in all
(``num_tiles × bytes_per_tile``, the compute tiles every memory check sees).

Two lower bounds, each exact about what the memory model counts
(docs/cost_model.md#the-memory-model), so nothing that fits is refused:

* **every single tensor**: each argument, constant and equation result, in
  nested jaxprs too, is laid out whole on the tiles at some point (a fused
  intermediate as its step's scratch, see docs/fusion.md);
* **the always-live ones together**: arguments and captured constants are
  allocated for the whole program, as Poplar's variables are.

Leaves kept in streaming memory (``ipu_jax.jit(offload_argnums=,
offload_outputs=)``) count against neither: their remote buffers hold no
tile memory. Sums of tensors live at once beyond these (an equation's
operands and results) are left to the full check: views and in-place
updates share memory there, and only lowering knows which.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable, Iterator, Sequence

import jax
from jax.extend import core as jcore

from ipu_jax.kernels.target import IPUTarget
from ipu_jax.lowering import memory_hints
from ipu_jax.lowering.jax_compat import physical_nbytes
from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.lowering.lower import source_of

__all__ = ["check_program_size", "offloaded_leaves", "aval_bytes"]

# Arguments named in the message when their sum does not fit, and tensors
# named when each is too large.
_NAMED_ARGUMENTS = 8
_NAMED_TENSORS = 8


@dataclasses.dataclass(frozen=True)
class _Sized:
  """One tensor of the jaxpr and its bytes on the tiles."""

  bytes: int
  aval: object
  name: str
  category: str
  op: str = ""
  eqn: object = None  # its source line is read only when it is reported

  def holding(self) -> memory_hints.Holding:
    source = source_of(self.eqn) if self.eqn is not None else ""
    return memory_hints.Holding(self.name, self.category, self.bytes, self.op, source)

  def describe(self) -> str:
    holding = self.holding()
    where = f" at {holding.source}" if holding.source else ""
    name = f"argument {self.name}" if self.category == "variables" else self.name
    return f"{name} ({_short(self.aval)}{where}): {self.bytes:,d} bytes"


def aval_bytes(aval) -> int:
  """Bytes of a value of ``aval`` on the tiles (a PRNG key as its key data)."""
  return physical_nbytes(aval)


def offloaded_leaves(offload, out_shape) -> dict:
  """The flat leaves ``ipu_jax.jit``'s ``offload`` keeps in streaming memory.

  Args:
    offload: ``None`` or ``(input leaves [(leaf, group)], output positions)``
      as ``ipu_jax/offload.py`` numbers them.
    out_shape: the traced function's output pytree.

  Returns:
    ``{"offloaded_inputs": ..., "offloaded_outputs": ...}``: flat indices.
  """
  if offload is None:
    return {"offloaded_inputs": (), "offloaded_outputs": ()}
  positions = set(offload[1])
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
  outputs = tuple(j for j, path in enumerate(paths) if path and _top_index(path) in positions)
  return {"offloaded_inputs": tuple(i for i, _ in offload[0]), "offloaded_outputs": outputs}


def _top_index(path):
  key = path[0]
  return getattr(key, "idx", getattr(key, "key", None))


def check_program_size(closed_jaxpr, target: IPUTarget, *, arg_names: Sequence[str] = (),
                       offloaded_inputs: Iterable[int] = (),
                       offloaded_outputs: Iterable[int] = (), what: str = "program") -> None:
  """Raise :class:`OutOfMemoryError` if the program cannot fit ``target``'s SRAM.

  Reads avals only: time and memory in proportion to the equations, not to
  the tensors' elements.

  Args:
    closed_jaxpr: the program (a ``ClosedJaxpr``) about to be lowered.
    target: the IPU target (one replica's IPUs).
    arg_names: each flat argument's name (its pytree path).
    offloaded_inputs, offloaded_outputs: flat argument / output indices kept
      in streaming memory (see :func:`offloaded_leaves`).
    what: the program's name in the message.

  Raises:
    OutOfMemoryError: a single tensor, or the arguments and constants
      together, exceed the SRAM of all the target's tiles. As nothing is
      placed yet, ``tile`` is 0 (the first tile of an even spread),
      ``bytes_needed`` the even share per tile of those bytes (a lower bound
      on the fullest tile's), ``bytes_available`` a tile's SRAM.
  """
  sram = int(target.num_tiles) * int(target.bytes_per_tile)
  jaxpr = closed_jaxpr.jaxpr
  streamed = {jaxpr.invars[i] for i in offloaded_inputs if i < len(jaxpr.invars)}
  streamed |= {jaxpr.outvars[j] for j in offloaded_outputs if j < len(jaxpr.outvars)
               if not isinstance(jaxpr.outvars[j], jcore.Literal)}
  persistent = [
      _Sized(aval_bytes(v.aval), v.aval, arg_names[i] if i < len(arg_names) else f"arg{i}",
             "variables")
      for i, v in enumerate(jaxpr.invars) if v not in streamed]
  persistent += [_Sized(aval_bytes(v.aval), v.aval, f"constant {k}", "constants")
                 for k, v in enumerate(jaxpr.constvars)]
  too_large = [t for t in itertools.chain(persistent, _results(jaxpr, streamed))
               if t.bytes > sram]
  if too_large:
    _refuse_tensors(too_large, target, sram, what)
  total = sum(t.bytes for t in persistent)
  if total > sram:
    _refuse_arguments(persistent, total, target, sram, what)


def _results(jaxpr, streamed) -> Iterator[_Sized]:
  """Every equation result of ``jaxpr`` and of the jaxprs nested in it (their
  arguments are the outer equation's operands), but those in ``streamed``."""
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      if v not in streamed and not isinstance(v, jcore.DropVar):
        yield _Sized(aval_bytes(v.aval), v.aval, f"the result of {eqn.primitive.name}",
                     "temporaries", eqn.primitive.name, eqn)
    for inner in _nested_jaxprs(eqn.params.values()):
      yield from _results(inner, streamed)


def _nested_jaxprs(values) -> Iterator:
  for value in values:
    if isinstance(value, jcore.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jcore.Jaxpr):
      yield value
    elif isinstance(value, (tuple, list)):
      yield from _nested_jaxprs(value)


def _short(aval) -> str:
  return getattr(aval, "str_short", lambda: str(aval))()


def _ipus_for(bytes_needed: int, target: IPUTarget) -> int:
  return -(-bytes_needed // (int(target.tiles_per_ipu) * int(target.bytes_per_tile)))


def _header(what: str, target: IPUTarget, sram: int, needed: int) -> str:
  """The message's first line, in the full check's words: a tile and its bytes.

  However the bytes are laid out, some tile holds at least an even share of
  them; spread evenly from tile 0 (the linear layout arguments get), tile 0
  holds that share and is over its SRAM.
  """
  share = -(-needed // int(target.num_tiles))
  return (f"Out of memory on tile 0 of {what}, found before planning: spread evenly over all "
          f"{target.num_tiles:,d} tiles ({target.num_ipus} IPU(s) x {target.tiles_per_ipu:,d}), "
          f"it needs at least {share:,d} bytes on each but has {target.bytes_per_tile:,d} "
          f"({needed:,d} bytes against {sram:,d} of SRAM in all), so no tile mapping can "
          "hold it.")


def _error(message: str, target: IPUTarget, needed: int) -> OutOfMemoryError:
  return OutOfMemoryError(message, tile=0, bytes_needed=-(-needed // int(target.num_tiles)),
                          bytes_available=int(target.bytes_per_tile))


def _refuse_tensors(too_large: list, target: IPUTarget, sram: int, what: str):
  """Tensors each larger than every tile's SRAM together (largest first, then
  in program order)."""
  too_large = sorted(too_large, key=lambda t: -t.bytes)
  largest = too_large[0]
  listed = [f"  {t.describe()}" for t in too_large[:_NAMED_TENSORS]]
  more = len(too_large) - len(listed)
  message = (
      _header(what, target, sram, largest.bytes) + "\n"
      f"Tensors larger than the SRAM of all the tiles ({len(too_large)}), largest first:\n"
      + "\n".join(listed) + (f"\n  ... and {more} more" if more > 0 else "")
      + "\nWhat may help:\n"
      + "\n".join(memory_hints.size_hint_lines(
          [t.holding() for t in too_large[:_NAMED_TENSORS]], largest.bytes - sram,
          _ipus_for(largest.bytes, target))))
  raise _error(message, target, largest.bytes)


def _refuse_arguments(persistent: list, total: int, target: IPUTarget, sram: int, what: str):
  """Arguments and constants (live for the whole program) over the SRAM."""
  named = sorted(persistent, key=lambda t: (-t.bytes, t.name))[:_NAMED_ARGUMENTS]
  lines = [f"  {t.describe()}" for t in named]
  message = (
      _header(what, target, sram, total) + "\n"
      "Its arguments and constants, live for the whole program, need those bytes "
      "together; the largest:\n" + "\n".join(lines) + "\nWhat may help:\n"
      + "\n".join(memory_hints.size_hint_lines(
          [t.holding() for t in persistent], total - sram, _ipus_for(total, target))))
  raise _error(message, target, total)
