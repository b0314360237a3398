"""What fills an out-of-memory tile, and which option would empty it.

An out-of-memory message is only useful if it says what to change. The bytes
on the tile that overflows are sorted into kinds, each with the settings that
shrink it (names of :class:`ipu_jax.IPUConfig` fields):

* **optimizer state** (an argument whose name starts with ``opt_state`` or
  ``optimizer_state``, as the Keras-like ``fit`` names it): keep it in
  streaming memory (``streaming.offload_optimizer_state``; ``offload_argnums``
  of ``ipu_jax.jit`` for a step of one's own) or shard it over replicas
  (``streaming.replicated_tensor_sharding``);
* **matmul / convolution working memory** (a step's operand blocks and
  partial sums, the ``partials`` tensors): lower
  ``matmuls.available_memory_proportion`` /
  ``convolutions.available_memory_proportion``, or serialise the matmul
  into pieces (``serialized_matmul`` of ``ipu_jax.ops``);
* **activations** (other temporaries live at the tile's peak, chiefly what
  the forward pass keeps for the backward pass): recompute them
  (``pipelining.recomputation`` with ``ipu_jax.ops.recomputation_checkpoint``,
  or ``jax.checkpoint``) or split the model over IPUs (``ipu_jax.pipelining``).

Hints come costliest kind first (optimizer state first when moving it alone
would fit: it leaves the tiles whole, where the others only shrink), each with
its bytes on the tile against the bytes over the limit. Both the error raised before anything
runs (:func:`ipu_jax.lowering.analysis.check_memory`) and a report's summary
use them. A program refused before planning because a tensor (or its
arguments together) exceeds every tile's SRAM (``lowering/size_check.py``)
gets :func:`size_hint_lines` instead: only what shrinks or moves whole
tensors helps there.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

__all__ = ["Holding", "classify", "hint_lines", "size_hint_lines", "OPTIMIZER_STATE_NAMES",
           "MATMUL_OPS"]

# First path component of an argument that is optimizer state: the
# TrainState field of the Keras-like fit, and the usual names of one's own.
OPTIMIZER_STATE_NAMES = ("opt_state", "optimizer_state")
MATMUL_OPS = ("dot_general", "conv_general_dilated")

OPTIMIZER_STATE, MATMUL, CONVOLUTION, ACTIVATIONS, WEIGHTS, OTHER = (
    "optimizer state", "matmul working memory", "convolution working memory",
    "activations", "weights and inputs", "other")

_ADVICE = {
    OPTIMIZER_STATE: (
        "keep it in streaming memory (streaming.offload_optimizer_state = True; for your own "
        "step, ipu_jax.jit(..., offload_argnums=...)), or shard it over replicas "
        "(streaming.replicated_tensor_sharding = True with replication_factor > 1)"),
    MATMUL: (
        "lower matmuls.available_memory_proportion (fewer operand blocks and partials per "
        "tile, more steps), or serialise the matmul into pieces (`ipu_jax.ops.serialized_matmul`)"),
    CONVOLUTION: (
        "lower convolutions.available_memory_proportion (fewer operand blocks and partials "
        "per tile)"),
    ACTIVATIONS: (
        "recompute activations in the backward pass instead of keeping them "
        "(pipelining.recomputation = True with ipu_jax.ops.recomputation_checkpoint marks, "
        "or jax.checkpoint around a layer), or split the model over IPUs (ipu_jax.pipelining, "
        "auto_select_ipus)"),
}


@dataclasses.dataclass(frozen=True)
class Holding:
  """Bytes one tensor (or one step's working memory) holds on the tile.

  Attributes:
    name: the tensor's name, or ``working memory of step <name>``.
    category: its memory category (``variables``, ``temporaries``...).
    bytes: bytes on the tile.
    op: the operation that made it ('' for arguments).
    source: the user's ``file:line``.
  """

  name: str
  category: str
  bytes: int
  op: str = ""
  source: str = ""

  @property
  def kind(self) -> str:
    return classify(self)


def classify(holding: Holding) -> str:
  """Which kind of memory ``holding`` is (see the module docstring)."""
  root = holding.name.split("/", 1)[0]
  if root in OPTIMIZER_STATE_NAMES:
    return OPTIMIZER_STATE
  if holding.op == "conv_general_dilated" and holding.category != "variables":
    return CONVOLUTION
  if holding.op in MATMUL_OPS and holding.category != "variables":
    return MATMUL
  if holding.category == "variables":
    return WEIGHTS
  if holding.category in ("temporaries", "exchange_buffers"):
    return ACTIVATIONS
  return OTHER


def largest(holdings: Iterable[Holding], count: int = 8) -> list:
  """The ``count`` largest holdings, largest first (ties by name)."""
  return sorted(holdings, key=lambda h: (-h.bytes, h.name))[:count]


def hint_lines(holdings: Sequence[Holding], over_by: int, indent: str = "  ") -> list:
  """One line per kind of memory with a remedy, most bytes first.

  Args:
    holdings: what the tile holds at its peak (tensors and working memory).
    over_by: bytes the tile needs beyond its SRAM.
    indent: the lines' indent.

  Returns:
    Lines such as ``- optimizer state: 38,704 B on this tile (more than the
    19,568 B over): keep it in streaming memory
    (streaming.offload_optimizer_state = True ...``, then the fallbacks (more
    tiles or IPUs, ``memory.allow_out_of_memory``).
  """
  totals = {}
  for holding in holdings:
    kind = holding.kind
    if kind in _ADVICE and holding.bytes > 0:
      totals[kind] = totals.get(kind, 0) + int(holding.bytes)
  # Optimizer state moves off the tiles whole, where activations and working
  # memory only shrink: when moving it alone would fit, it comes first.
  def rank(item):
    kind, held = item
    return (not (kind == OPTIMIZER_STATE and held >= over_by), -held, kind)

  lines = []
  for kind, held in sorted(totals.items(), key=rank):
    than = "more" if held >= over_by else "less"
    lines.append(f"{indent}- {kind}: {held:,} B on this tile ({than} than the {over_by:,} B "
                 f"over): {_ADVICE[kind]}")
  lines.append(f"{indent}- or use more tiles or IPUs (device.tiles_per_ipu, auto_select_ipus), "
               "spread large tensors over more tiles (graph API: Graph.map_tensor_linearly), "
               "or set memory.allow_out_of_memory = True to lower anyway and read the report")
  return lines


def size_hint_lines(holdings: Sequence[Holding], over_by: int, ipus_needed: int,
                    indent: str = "  ") -> list:
  """Remedies for tensors too large for all the tiles' SRAM together.

  Tile layouts, available memory proportions and recomputation cannot help a
  tensor that exceeds the SRAM of every tile: it must move to streaming
  memory, shrink, or get more IPUs.

  Args:
    holdings: the tensors over the limit (arguments: category
      ``variables``).
    over_by: bytes beyond the SRAM.
    ipus_needed: IPUs whose SRAM would at least hold those bytes.
    indent: the lines' indent.
  """
  kinds = {holding.kind for holding in holdings}
  lines = []
  if kinds & {OPTIMIZER_STATE, WEIGHTS}:
    lines.append(f"{indent}- keep arguments in streaming memory: ipu_jax.jit(..., "
                 "offload_argnums=..., offload_outputs=...), or "
                 "streaming.offload_optimizer_state = True for the Keras-like fit's state")
  if kinds - {OPTIMIZER_STATE, WEIGHTS}:
    lines.append(f"{indent}- a smaller batch or smaller shapes ({over_by:,} B over the SRAM of "
                 "all the tiles together)")
  lines.append(f"{indent}- or at least {ipus_needed} IPU(s) of this kind (auto_select_ipus, "
               "the target's num_ipus), splitting the model over them (ipu_jax.pipelining)")
  return lines
