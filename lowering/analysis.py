"""Cost and memory analysis of a tile program, and the out-of-memory check.

Runs at compile time on NumPy arrays indexed by tile; nothing here executes
the program. Produces a :class:`~ipu_jax.lowering.profile.ProgramProfile`.

Memory is allocated statically, as Poplar does: variables, constants, vertex
state and code are always live; temporaries are live from the first step that
touches them to the last, and exchange buffers and per-step scratch only
during their step. A value touched inside a loop lives for the whole loop,
unless it is local to that loop (made in its body, written before it is read
in every iteration): then its memory is reused between iterations and it
lives only from its first to its last step within the body. A training loop
thus holds one step's temporaries, not every step's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from ipu_jax.lowering.errors import OutOfMemoryError
from ipu_jax.lowering import memory_hints
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.control_tree import control_tree
from ipu_jax.lowering.exchange import exchange_cycles
from ipu_jax.lowering.remote import is_remote, streaming_profile
from ipu_jax.lowering.profile import (ALWAYS_LIVE_CATEGORIES, MEMORY_CATEGORIES,
                                      MemoryProfile, ProgramProfile, StepProfile,
                                      TensorProfile)
from ipu_jax.kernels.target import IPUTarget

__all__ = ["profile_program", "check_memory"]


def _tensor_bytes(tensor: P.Tensor, num_tiles: int):
  mapping = tensor.mapping
  if mapping is None or mapping.num_elements == 0:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  return mapping.tiles, mapping.counts * tensor.itemsize


@functools.lru_cache(maxsize=16)
def _zeros(num_tiles: int, dtype) -> np.ndarray:
  """A shared read-only ``[num_tiles]`` zeros (steps without compute or exchange)."""
  zeros = np.zeros(num_tiles, dtype)
  zeros.flags.writeable = False
  return zeros


def _sync_cycles(target, touched_tiles: np.ndarray, crosses: bool) -> float:
  per = target.tiles_per_ipu
  if target.num_ipus > 1 and (crosses or (touched_tiles.size and
                              touched_tiles.min() // per != touched_tiles.max() // per)):
    return target.ipu_sync_cycles()
  return float(target.sync_cycles_internal)


def _step_profile(target: IPUTarget, node, executions: int) -> StepProfile:
  own = getattr(node, "step_profile", None)  # remote copies cost themselves
  if own is not None:
    return own(target, executions)
  t = target.num_tiles
  if isinstance(node, P.Superstep):
    # The step's own arrays (held in their narrowest exact dtype, see
    # Superstep), shared rather than copied: one set per step, not two.
    compute = _zeros(t, np.float32) if node.compute_cycles is None else node.compute_cycles
    ex = node.exchange
    bytes_in = _zeros(t, np.int32) if ex is None else ex.bytes_in
    bytes_out = _zeros(t, np.int32) if ex is None else ex.bytes_out
    link = 0 if ex is None else int(ex.link_bytes_out.sum())
    touched = np.nonzero((compute > 0) | (bytes_in > 0) | (bytes_out > 0))[0]
    vertices = (node.vertices if node.vertices is not None
                else _zeros(t, np.int32) if node.compute_cycles is None
                else (compute > 0).astype(np.int32))
    temporary = bytes_in if node.scratch_bytes is None else P.narrowed(
        bytes_in.astype(np.int64) + node.scratch_bytes)
    return StepProfile(
        name=node.name, op=node.op, source=node.source, compute_cycles=compute,
        exchange_bytes_in=bytes_in, exchange_bytes_out=bytes_out,
        exchange_cycles=exchange_cycles(target, ex),
        sync_cycles=_sync_cycles(target, touched, link > 0),
        ipu_link_bytes=link, flops=int(node.flops), vertices=vertices,
        executions=executions, temporary_bytes=temporary,
        notes=tuple(node.notes),
        scope=node.scope, fused_ops=tuple(node.fused_ops),
        codelets=_codelet_names(node), flops_dtype=_step_flops_dtype(node))
  # Host transfers: stream copies and printed tensors cross the host link.
  tensor = node.tensor
  tiles, nbytes = _tensor_bytes(tensor, t)
  per_tile = np.zeros(t, np.int64)
  per_tile[tiles] += nbytes  # a mapping's rows are on distinct tiles
  to_device = isinstance(node, P.StreamCopy) and node.stream.to_device
  total = int(per_tile.sum())
  host_cycles = total / (target.host_link_bytes_per_second / target.clock_hz)
  busiest = per_tile.max(initial=0) / target.exchange_bytes_per_cycle
  name = (f"stream {node.stream.name}" if isinstance(node, P.StreamCopy)
          else f"print {node.title}")
  op = "StreamCopy" if isinstance(node, P.StreamCopy) else "PrintTensor"
  return StepProfile(
      name=name, op=op, source=tensor.source, compute_cycles=np.zeros(t, np.float64),
      exchange_bytes_in=per_tile if to_device else np.zeros(t, np.int64),
      exchange_bytes_out=np.zeros(t, np.int64) if to_device else per_tile,
      exchange_cycles=float(max(host_cycles, busiest) + target.exchange_latency_cycles) if total else 0.0,
      sync_cycles=float(target.sync_cycles_host),
      executions=executions, host_bytes=total,
      vertices=np.zeros(t, np.int64), scope=tensor.scope)


def _step_flops_dtype(node: P.Superstep) -> str:
  """The dtype whose peak a step's FLOPs run at ('' for a step without FLOPs).

  The one its rule costed them at (a matmul's operand type), else its widest
  floating-point operand, not counting a result it adds into (a matmul's
  later pass reads its float32 sum), else its widest floating-point result.
  """
  if not node.flops:
    return ""
  if node.flops_dtype is not None:
    return np.dtype(node.flops_dtype).name
  written = {t.id for t in node.writes}
  for tensors in ([t for t in node.reads if t.id not in written], node.writes):
    # jnp.issubdtype: NumPy does not count bfloat16 and the FP8 types as floating.
    floating = [np.dtype(t.dtype) for t in tensors if jnp.issubdtype(t.dtype, jnp.inexact)]
    if floating:
      return max(floating, key=lambda d: d.itemsize).name
  return ""


def _codelet_names(node: P.Superstep) -> tuple:
  """The vertex types a step's compute set runs, as code memory counts them."""
  if node.compute_cycles is None:
    return ()
  return tuple(dict.fromkeys(vocab.identity(c) for c in (node.codelets or (node.op,))))


def _leaf_tensors(node):
  if isinstance(node, P.Superstep):
    return list(node.reads) + list(node.writes)
  if isinstance(node, (P.StreamCopy, P.PrintTensor)):
    return [node.tensor]
  return []


# -- profile_program: a planned pass ------------------------------------------
#
# Lifetimes (first/last step of each tensor) -> placement (static bytes by
# category, and the sparse liveness changes of temporaries) -> vertex state and
# code -> one pass over the steps for each tile's peak -> the profile.


@dataclasses.dataclass(frozen=True)
class _Lifetimes:
  """Every tensor the program holds, and the steps it is live over.

  Attributes:
    tensors: tensor id -> tensor, in first-seen order (tile memory only:
      remote buffers are split off into ``remote_buffers``).
    first: tensor id -> first step it is live at.
    last: tensor id -> last step it is live at.
    remote_buffers: remote buffers, which streaming memory accounts for.
  """

  tensors: dict
  first: dict
  last: dict
  remote_buffers: list


@dataclasses.dataclass(frozen=True)
class _Placement:
  """Where the tensors' bytes go.

  Attributes:
    static: ``[num_tiles]`` bytes of variables and of constants (always live).
    allocs: step -> ``[(tiles, bytes)]`` liveness changes of temporaries:
      allocated at a tensor's first step, freed after its last. Sparse, so
      memory is O(tensors + tiles), not O(steps x tiles).
    profiles: one :class:`TensorProfile` per tensor.
  """

  static: dict
  allocs: dict
  profiles: list


def _loop_spans(leaves) -> dict:
  """``id(loop) -> (first step, last step)`` of every loop the leaves are in."""
  loop_span = {}
  for i, (_, _, loops) in enumerate(leaves):
    for loop in loops:
      lo, hi = loop_span.get(id(loop), (i, i))
      loop_span[id(loop)] = (min(lo, i), max(hi, i))
  return loop_span


def _lifetimes(program: P.Program, leaves, persistent, live_to_end) -> _Lifetimes:
  """First and last step touching each tensor.

  A loop stretches both to cover the whole loop, since the value must survive
  every iteration -- unless the tensor is local to that loop (made and
  consumed in one iteration).
  """
  n_steps = len(leaves)
  loop_span = _loop_spans(leaves)
  tensors, first, last = {}, {}, {}
  for i, (node, _, loops) in enumerate(leaves):
    for tensor in _leaf_tensors(node):
      lo, hi = i, i
      for loop in loops:
        if tensor.id not in loop.local_ids:
          span = loop_span[id(loop)]
          lo, hi = min(lo, span[0]), max(hi, span[1])
      tensors[tensor.id] = tensor
      first[tensor.id] = min(first.get(tensor.id, lo), lo)
      last[tensor.id] = max(last.get(tensor.id, hi), hi)
  for tensor in P.control_tensors(program):
    tensors.setdefault(tensor.id, tensor)
    first.setdefault(tensor.id, 0)
    last[tensor.id] = max(last.get(tensor.id, 0), n_steps - 1)
  for tensor in persistent:
    tensors.setdefault(tensor.id, tensor)
  for tensor in live_to_end:
    tensors.setdefault(tensor.id, tensor)
    first.setdefault(tensor.id, max(n_steps - 1, 0))
    last[tensor.id] = max(n_steps - 1, 0)
  # Remote buffers hold no tile memory: streaming memory accounts for them.
  remote_buffers = [tt for tt in tensors.values() if is_remote(tt)]
  for buffer in remote_buffers:
    del tensors[buffer.id]
  return _Lifetimes(tensors, first, last, remote_buffers)


def _in_place_results(leaves, lifetimes: _Lifetimes, live_to_end) -> dict:
  """``operand id -> result id`` for results written over a dying operand.

  Poplar's map operations have in-place forms that write the result into an
  operand (``popops::mapInPlace`` and the ``*InPlace`` functions), and the
  frameworks choose them wherever the operand is read by nothing later
  (PopART's inplacing transform, TensorFlow-IPU's in-place HLO pass): the
  result then takes the operand's memory instead of a second buffer. This is
  decided here, on the fused program, not while lowering: a fused chain's
  intermediates are already elided, and only what a (fused or single)
  elementwise step reads from memory and writes back can share it. The
  result must be a temporary first written at that step, and the operand a
  temporary (not an output) last read there, with the result's layout
  (``TileMapping.same_as``), dtype and shape: their bytes on every tile are
  then the same, so sharing lowers that step's live bytes and changes no
  other step's (docs/cost_model.md#the-memory-model). An update of a base
  tensor (``Superstep.updates_base``: popops' ``dynamicUpdate``,
  ``multiUpdate`` and ``multiUpdateAdd`` write into their base) may take its
  base's memory by the same rule.
  """
  tensors, first, last = lifetimes.tensors, lifetimes.first, lifetimes.last
  outputs = {t.id for t in live_to_end}
  pairs = {}
  for i, (node, _, _) in enumerate(leaves):
    if not isinstance(node, P.Superstep):
      continue
    if node.elementwise is not None:
      operands = node.reads
    elif node.updates_base and len(node.writes) == 1:
      operands = node.reads[:1]  # popops' dynamicUpdate / multiUpdate(Add): over the base
    else:
      continue
    written = {t.id for t in node.writes}
    dying = {a.id: a for a in operands
             if a.id in tensors and a.category == "temporaries" and a.mapping is not None
             and last[a.id] == i and first[a.id] < i
             and a.id not in written and a.id not in outputs}
    for b in {t.id: t for t in node.writes}.values():  # a result listed twice takes one
      if (b.id not in tensors or b.category != "temporaries" or b.mapping is None
          or first.get(b.id) != i):
        continue
      a = next((a for a in dying.values() if a.dtype == b.dtype
                and tuple(a.shape) == tuple(b.shape) and a.mapping.same_as(b.mapping)), None)
      if a is not None:
        pairs[a.id] = b.id
        del dying[a.id]
  return pairs


def _place_tensors(lifetimes: _Lifetimes, n_steps: int, num_tiles: int,
                   in_place=None) -> _Placement:
  """Static bytes by category, temporaries' liveness changes, tensor profiles.

  ``in_place`` (``operand id -> result id``, :func:`_in_place_results`): the
  result is not allocated and the operand not freed at the step that writes
  over it; the operand's profile ends the step before, where the result's
  begins, so the profiles' live ranges add up to the same bytes.
  """
  in_place = in_place or {}
  taking = set(in_place.values())
  static = {c: np.zeros(num_tiles, np.float64) for c in ("variables", "constants")}
  allocs, profiles = {}, []
  # Tensors of one layout share their bytes-per-tile array (thousands of
  # tensors, a handful of layouts at BERT size).
  shared_bytes = {}
  for tensor in lifetimes.tensors.values():
    tiles, nbytes = _tensor_bytes(tensor, num_tiles)
    if tensor.mapping is not None:
      key = (id(tensor.mapping.counts), tensor.itemsize)
      if key not in shared_bytes:
        nbytes = P.narrowed(nbytes)
        nbytes.flags.writeable = False
        shared_bytes[key] = nbytes
      nbytes = shared_bytes[key]
    category = tensor.category
    if category in ("variables", "constants") or n_steps == 0:
      # A mapping's rows are on distinct tiles: indexed adds are exact (and
      # far faster than ``np.add.at``).
      static[category if category != "temporaries" else "variables"][tiles] += nbytes
      lo, hi = 0, max(n_steps - 1, 0)
    else:
      lo, hi = lifetimes.first.get(tensor.id, 0), lifetimes.last.get(tensor.id, 0)
      if tensor.id not in taking:
        allocs.setdefault(lo, []).append((tiles, nbytes))
      if tensor.id in in_place:
        hi -= 1  # its memory holds the result from its last step on
      else:
        allocs.setdefault(hi + 1, []).append((tiles, -nbytes))
    profiles.append(TensorProfile(
        name=tensor.name, shape=tensor.shape, dtype=tensor.dtype.name,
        category=category, tiles=tiles, bytes_on_tile=nbytes, op=tensor.op,
        source=tensor.source, live_from=lo, live_to=hi, scope=tensor.scope))
  return _Placement(static, allocs, profiles)


def _vertex_state_and_code(target: IPUTarget, leaves) -> tuple:
  """``[num_tiles]`` bytes of vertex state and of code.

  Vertex state per vertex, and code once per vertex type per tile: keyed by
  the type's identity, so a type reached from several steps is charged once.
  """
  t = target.num_tiles
  vertex_state = np.zeros(t, np.float64)
  code = np.zeros(t, np.float64)
  code_tiles = {}
  for node, _, _ in leaves:
    if isinstance(node, P.Superstep) and node.compute_cycles is not None:
      vertices = node.vertices if node.vertices is not None else (node.compute_cycles > 0)
      vertex_state += np.asarray(vertices, np.float64) * target.vertex_state_bytes
      for codelet in (node.codelets or (node.op,)):
        mask = code_tiles.setdefault(vocab.identity(codelet), np.zeros(t, bool))
        mask |= np.asarray(vertices) > 0
  for mask in code_tiles.values():
    code += mask * target.code_bytes_per_codelet
  return vertex_state, code


# The vertices of a data movement: on-tile copies and fills (lowering/rules/shape.py).
_MOVEMENT_CODELETS = frozenset(vocab.identity(c) for c in (vocab.COPY, vocab.FILL))


def _exchange_buffers(node, bytes_in: np.ndarray) -> np.ndarray:
  """``[num_tiles]`` bytes a step's exchange needs beside the tensors already counted.

  A compute step receives its operands into copies laid out for its vertices
  (temporary memory of the step: its exchange buffers). A data movement (a
  transpose, a relayout, a concatenation: no compute set, or only
  ``popops::Copy`` / ``Fill`` vertices for the elements already on the
  tile) receives straight into the tensors it writes, which are live at that
  step already: a Poplar ``Copy`` program's exchange writes the destination
  variable's memory, so those bytes are not counted a second time
  (docs/cost_model.md#the-memory-model).
  """
  received = bytes_in.astype(np.float64)
  if not (isinstance(node, P.Superstep) and node.writes
          and set(_codelet_names(node)) <= _MOVEMENT_CODELETS):
    return received
  written = np.zeros(received.size, np.float64)
  for tensor in {t.id: t for t in node.writes}.values():
    tiles, nbytes = _tensor_bytes(tensor, received.size)
    written[tiles] += nbytes  # a mapping's rows are on distinct tiles
  return np.maximum(received - written, 0.0)


def _peak_live(leaves, steps, allocs, num_tiles: int) -> tuple:
  """``(temporaries, exchange buffers, live sums)`` at each tile's peak.

  One pass over the steps: the running temporaries, and per tile the step
  where live bytes peak (the first, as ``argmax`` would pick); ``live sums``
  are the live bytes (all tiles) of each step.
  """
  running = np.zeros(num_tiles, np.float64)
  best = np.full(num_tiles, -np.inf)
  peak_temp = np.zeros(num_tiles, np.float64)
  peak_exchange = np.zeros(num_tiles, np.float64)
  live_sums = np.zeros(len(leaves), np.float64)
  for i, (node, _, _) in enumerate(leaves):
    # Byte counts are whole numbers: float64 sums of them are exact in any
    # order, so they are added in place (a mapping's rows are on distinct tiles).
    for tiles, nbytes in allocs.get(i) or ():
      running[tiles] += nbytes
    temporaries = running
    if isinstance(node, P.Superstep) and node.scratch_bytes is not None:
      temporaries = running + node.scratch_bytes
    exchange = _exchange_buffers(node, steps[i].exchange_bytes_in)
    live = temporaries + exchange
    live_sums[i] = live.sum()
    higher = live > best
    if higher.any():
      np.copyto(best, live, where=higher)
      np.copyto(peak_temp, temporaries, where=higher)
      np.copyto(peak_exchange, exchange, where=higher)
  return peak_temp, peak_exchange, live_sums


def profile_program(program: P.Program, target: IPUTarget, *, persistent=(),
                    live_to_end=(), name: str = "program",
                    host_round_trips: int = 1) -> ProgramProfile:
  """Cycles and per-tile memory of ``program``.

  Args:
    program: the control program.
    target: the IPU target.
    persistent: tensors allocated for the whole program even if the program
      never touches them (graph variables and constants).
    live_to_end: temporaries that must survive to the end (outputs).
    name: the program's name in reports.
    host_round_trips: host calls per execution of the program.
  """
  t = target.num_tiles
  leaves = list(P.iter_steps(program))
  steps = [_step_profile(target, node, ex) for node, ex, _ in leaves]
  n_steps = len(steps)
  lifetimes = _lifetimes(program, leaves, persistent, live_to_end)
  streaming = streaming_profile(target, lifetimes.remote_buffers, leaves, steps)
  placement = _place_tensors(lifetimes, n_steps, t,
                             _in_place_results(leaves, lifetimes, live_to_end))
  vertex_state, code = _vertex_state_and_code(target, leaves)
  by_category = dict(placement.static, vertex_state=vertex_state, code=code)
  always = sum(by_category[c] for c in ALWAYS_LIVE_CATEGORIES)
  if n_steps:
    temporaries, exchange, live_sums = _peak_live(leaves, steps, placement.allocs, t)
    live_over_program = always.sum() + live_sums
  else:
    temporaries, exchange = np.zeros(t, np.float64), np.zeros(t, np.float64)
    live_over_program = np.zeros(0)
  by_category.update(temporaries=temporaries, exchange_buffers=exchange)
  peak = always + temporaries + exchange
  memory = MemoryProfile(
      by_category={k: by_category[k].astype(np.int64) for k in MEMORY_CATEGORIES},
      peak=peak.astype(np.int64), live_over_program=live_over_program,
      tile_limit=target.bytes_per_tile)
  return ProgramProfile(target=target, steps=steps, tensors=placement.profiles,
                        memory=memory, name=name,
                        host_round_trips=host_round_trips, streaming=streaming,
                        control=control_tree(program))


def _holdings_at_peak(profile: ProgramProfile, tile: int) -> list:
  """What ``tile`` holds at its peak step: tensors live there and that step's working memory.

  Always-live tensors (variables, constants) count at every step; a
  temporary from its first to its last use. The peak step is the one with
  the most of these bytes on the tile.
  """
  n_steps = len(profile.steps)
  held = []  # (holding, live_from, live_to)
  for tensor in profile.tensors:
    hit = np.nonzero(tensor.tiles == tile)[0]
    if not hit.size:
      continue
    nbytes = int(tensor.bytes_on_tile[hit].sum())
    always = tensor.category in ALWAYS_LIVE_CATEGORIES
    lo, hi = (0, n_steps - 1) if always else (tensor.live_from, tensor.live_to)
    held.append((memory_hints.Holding(tensor.name, tensor.category, nbytes, tensor.op or "",
                                      tensor.source or ""), max(lo, 0), min(hi, n_steps - 1)))
  if not n_steps:
    return [h for h, _, _ in held]
  # A step's own working memory (a fused chain's intermediates, a matmul's
  # partials) belongs to no tensor.
  working = np.asarray([0 if s.temporary_bytes is None else
                        int(s.temporary_bytes[tile]) - int(s.exchange_bytes_in[tile])
                        for s in profile.steps], np.int64)
  delta = np.zeros(n_steps + 1, np.int64)
  for holding, lo, hi in held:
    if lo <= hi:
      delta[lo] += holding.bytes
      delta[hi + 1] -= holding.bytes
  peak = int(np.argmax(np.cumsum(delta[:n_steps]) + np.maximum(working, 0)))
  out = [h for h, lo, hi in held if lo <= peak <= hi]
  if working[peak] > 0:
    step = profile.steps[peak]
    ops = ", ".join(f.op for f in step.fused_ops) or step.op
    out.append(memory_hints.Holding(f"working memory of step {step.name} ({ops})",
                                    "temporaries", int(working[peak]), step.op, step.source))
  return out


def check_memory(profile: ProgramProfile, *, allow_out_of_memory: bool = False,
                 report=None, what: str = "program") -> None:
  """Raise :class:`OutOfMemoryError` if a tile exceeds its SRAM.

  The message names the fullest tile, its bytes by category, the largest
  tensors it holds at its peak (largest first) and what would free them
  (:mod:`ipu_jax.lowering.memory_hints`).
  """
  memory = profile.memory
  over = memory.over_limit_tiles
  if over.size == 0 or allow_out_of_memory:
    return
  worst = int(over[np.argmax(memory.peak[over])])
  needed = int(memory.peak[worst])
  limit = memory.tile_limit
  holdings = _holdings_at_peak(profile, worst)
  lines = [f"  {h.bytes:>12,d} B  {h.name} ({h.category}"
           f"{', ' + h.op if h.op and h.op not in h.name else ''}"
           f"{', ' + h.source if h.source else ''})"
           for h in memory_hints.largest(holdings)]
  categories = ", ".join(f"{k} {int(v[worst]):,d}" for k, v in memory.by_category.items() if v[worst])
  message = (
      f"Out of memory on tile {worst} of {what}: it needs {needed:,d} bytes but has "
      f"{limit:,d} ({len(over)} tile(s) over the limit: "
      f"{', '.join(str(int(x)) for x in over[:8])}{' ...' if len(over) > 8 else ''}).\n"
      f"By category on tile {worst}: {categories}.\n"
      f"Largest tensors on tile {worst} at its peak:\n" + "\n".join(lines) + "\n"
      "What may help:\n"
      + "\n".join(memory_hints.hint_lines(holdings, needed - limit)))
  raise OutOfMemoryError(message, tile=worst, bytes_needed=needed,
                         bytes_available=limit, over_tiles=over, report=report)
