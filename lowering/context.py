"""The lowering contexts: what a rule uses to create tensors and emit steps.

Two classes, as JAX's own lowering has a ``ModuleContext`` and a per-equation
``LoweringRuleContext`` (``jax/_src/interpreters/mlir.py``):

* :class:`LoweringContext` (also :data:`ModuleContext`): the state of one
  lowering. One context lowers one jaxpr (and the jaxprs nested in it) into
  one tile program. It knows the target, options and replication factor,
  spreads small tensors over tiles, and stamps every tensor and step with the
  JAX operation, the user source line and the module path (name stack) it
  came from, so reports and errors can point at the user's code and group
  costs by layer. Every attribute is set in its constructor or by one of its
  own methods (``at``, ``dying``, ``sub_program``, ``named_axes``).
* :class:`RuleContext`: what one equation's rule receives as its first
  argument: the module context, the primitive, the equation's input and
  output avals, its source line and name stack. It is slotted and immutable;
  it forwards the module state and operations rules use (``target``,
  ``options``, ``emit``, ``new_tensor``, ``like``, ``constant``,
  ``sub_program``, ``claim_tiles``, ...) so a rule body reads
  ``ctx.new_tensor(...)`` whichever it holds. Nested jaxprs
  (control flow, ``pjit``, custom derivatives) are lowered into
  ``ctx.module``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import numpy as np

from ipu_jax.lowering.options import LoweringOptions, proportion_for
from ipu_jax.lowering import program as P
from ipu_jax.lowering.mapping import TileMapping
from ipu_jax.lowering.scopes import join_scopes, module_path
from ipu_jax.kernels.target import IPUTarget

__all__ = ["LoweringContext", "LoweringOptions", "ModuleContext", "RuleContext"]


class LoweringContext:
  """State of one lowering: target, options, tensors and the program so far.

  Attributes:
    target: the IPU target.
    options: the :class:`LoweringOptions`.
    replication_factor: replicas of the program (a ``cross_replica_*`` op
      outside any named axis spans this many; collectives cost a ring over
      them).
    op: name of the primitive being lowered (stamped on tensors and steps).
    source: user ``file:line`` of the equation being lowered.
    scope: module path of the equation being lowered (its name stack
      without transformations, joined to the enclosing equations'), e.g.
      ``"Encoder/layers_0/attention"``.
    dying_ids: ids of the current equation's operands that nothing reads
      afterwards (None at the top level, before any equation).
    donated_ids: ids of the program arguments the caller donated
      (``ipu_jax.jit(donate_argnums=)``): a result may take their memory.
    tensors: every tensor created or emitted, by id.
    constants: the constant tensors (program inputs held on chip).
  """

  # Declared attributes only: nothing outside the class adds state to it.
  __slots__ = ("_target", "_options", "_replication_factor", "op", "source", "scope",
               "dying_ids", "donated_ids", "tensors", "constants", "_program_stack",
               "_next_start_tile", "_local_stack", "_constant_cache", "_mesh_axes",
               "_program_state", "_proportions_read")

  def __init__(self, target: IPUTarget, options: Optional[LoweringOptions] = None,
               replication_factor: int = 1):
    if int(replication_factor) < 1:
      raise ValueError(f"replication_factor must be >= 1, got {replication_factor}")
    self._target = target
    self._options = options if options is not None else LoweringOptions()
    self._replication_factor = int(replication_factor)
    self.op = ""
    self.source = ""
    self.scope = ""
    self.dying_ids: Optional[frozenset] = None
    self.donated_ids: frozenset = frozenset()
    self.tensors: dict = {}
    self.constants: list = []
    self._program_stack = [P.Sequence()]
    self._next_start_tile = 0
    self._local_stack = []
    self._constant_cache = {}
    self._program_state = {}
    self._mesh_axes: dict = {}
    self._proportions_read: set = set()

  @property
  def target(self) -> IPUTarget:
    return self._target

  @property
  def options(self) -> LoweringOptions:
    return self._options

  @property
  def replication_factor(self) -> int:
    return self._replication_factor

  def memory_proportion(self, option: str) -> float:
    """The per-IPU memory proportion ``option`` for a plan over the program's IPUs.

    ``option`` names a :class:`LoweringOptions` field
    (``"available_memory_proportion"``, ``"conv_available_memory_proportion"``).
    A plan may spread over every IPU of the program, so it takes the tightest
    of theirs. Rules read the proportions only through here, which notes
    each one read (:attr:`proportions_read`).
    """
    self._proportions_read.add(option)
    return proportion_for(getattr(self._options, option), range(self._target.num_ipus))

  @property
  def proportions_read(self) -> frozenset:
    """The memory proportions the lowering planned with so far.

    A program that read none is the same under any value of them: a split
    search's probes, which differ in the proportions, share the weight
    updates that hold no matmul (``ipu_jax/pipelining/weight_update.py``).
    """
    return frozenset(self._proportions_read)

  # -- the program --------------------------------------------------------

  @property
  def program(self) -> P.Sequence:
    return self._program_stack[0]

  def detach_program(self) -> P.Sequence:
    """The program so far; the context lets go of it and starts an empty one.

    Callers that rewrite the finished program (fusion builds a new tree)
    detach it first, so the original can be freed once rewritten.
    """
    if len(self._program_stack) != 1:
      raise RuntimeError("detach_program() inside a sub_program(): the program is not finished")
    program, self._program_stack = self._program_stack[0], [P.Sequence()]
    return program

  def emit(self, node, into: "P.Sequence | None" = None) -> None:
    """Append a step or control program to the current sequence.

    Args:
      node: the step or control program.
      into: append to this (already closed) sequence instead, e.g. the end of
        a branch body whose result copies are known only after lowering it.
    """
    if isinstance(node, P.Superstep):
      if not node.source:
        node.source = self.source
      if not node.op:
        node.op = self.op
      if not node.scope:
        node.scope = self.scope
      for tensor in node.reads + node.writes:
        self.tensors.setdefault(tensor.id, tensor)
    (self._program_stack[-1] if into is None else into).add(node)

  @contextlib.contextmanager
  def sub_program(self):
    """Collect emitted steps into a new Sequence (a loop or branch body).

    Yields ``(sequence, locals)``: ``locals`` gets the ids of tensors created
    inside, which live only within the body.
    """
    seq = P.Sequence()
    local_ids = set()
    self._program_stack.append(seq)
    self._local_stack.append(local_ids)
    # A body runs again: nothing from outside it dies inside it.
    saved_dying, self.dying_ids = self.dying_ids, frozenset()
    try:
      yield seq, local_ids
    finally:
      self.dying_ids = saved_dying
      self._program_stack.pop()
      self._local_stack.pop()
      # Made inside a nested body means made inside every enclosing body.
      if self._local_stack:
        self._local_stack[-1].update(local_ids)

  @contextlib.contextmanager
  def at(self, op: str, source: str, name_stack=None):
    """Stamp what is created inside with ``op``, ``source`` and a module path.

    Args:
      op: the primitive's name.
      source: the user's ``file:line``.
      name_stack: the equation's ``source_info.name_stack``; it is relative
        to the enclosing equation (a loop body's, a nested jit's), so it
        extends the current scope. ``None`` keeps the current scope.
    """
    saved = self.op, self.source, self.scope
    self.op, self.source = op, source
    if name_stack is not None:
      self.scope = join_scopes(self.scope, module_path(name_stack))
    try:
      yield
    finally:
      self.op, self.source, self.scope = saved

  @property
  def mesh_axes(self) -> dict:
    """Mesh axes of the ``shard_map``/``pmap`` bodies being lowered: ``{name: size}``."""
    return dict(self._mesh_axes)

  @contextlib.contextmanager
  def named_axes(self, axes: dict):
    """Bind mesh axes (``{name: size}``) while a replicated body is lowered."""
    saved = self._mesh_axes
    self._mesh_axes = {**saved, **axes}
    try:
      yield
    finally:
      self._mesh_axes = saved

  @contextlib.contextmanager
  def dying(self, tensor_ids):
    """Mark ``tensor_ids`` as read by nothing after the equation being lowered."""
    saved, self.dying_ids = self.dying_ids, frozenset(tensor_ids)
    try:
      yield
    finally:
      self.dying_ids = saved

  def updatable_in_place(self, tensor: P.Tensor) -> bool:
    """Whether a rule may write its result into ``tensor``'s memory.

    True for a program variable (an argument, always live) that no later
    operation reads: a loop carrying it updates it in place, as Poplar
    programs update their variables, instead of holding a second copy.
    """
    return (tensor.category == "variables" and tensor.size > 0
            and self.dying_ids is not None and tensor.id in self.dying_ids)


  def donate(self, tensors) -> None:
    """Mark program arguments the caller donated (``ipu_jax.jit(donate_argnums=)``):
    an elementwise result may take the memory of one that dies at it."""
    self.donated_ids = frozenset(t.id for t in tensors)

  def donated_and_dying(self, tensor: P.Tensor) -> bool:
    """Whether ``tensor`` is a donated argument that no later operation reads.

    Its memory may then hold a result, as XLA reuses a donated buffer and a
    Poplar variable is updated in place (docs/cost_model.md#the-memory-model).
    """
    return tensor.id in self.donated_ids and self.updatable_in_place(tensor)

  # -- tensors ------------------------------------------------------------

  @property
  def next_start_tile(self) -> int:
    """Where the next small tensor will start (see :meth:`claim_tiles`)."""
    return self._next_start_tile

  def claim_tiles(self, count: int, align: int = 1) -> int:
    """Start tile for something spanning ``count`` consecutive tiles.

    Anything smaller than the whole chip starts where the previous one ended,
    so many small tensors and grids spread over the tiles instead of all
    landing on tile 0. ``align``: the start is rounded up to a multiple of it
    (a matmul grid starts on an exchange-bus pair's first tile, as poplin's
    plans do), or wraps to tile 0. Returns the start tile.
    """
    start = self._next_start_tile
    if 0 < count < self.target.num_tiles:
      start = -(-start // align) * align
      if start >= self.target.num_tiles:
        start = 0
      self._next_start_tile = (start + count) % self.target.num_tiles
    return start

  def linear_mapping(self, shape, dtype, max_tiles: Optional[int] = None) -> TileMapping:
    """A linear mapping, starting where the last small tensor ended.

    Tensors too small to cover every tile start on a rotating tile, so many
    small tensors (biases, scalars) do not all pile onto tile 0.
    """
    size = int(np.prod(shape, dtype=np.int64))
    num_tiles = self.target.num_tiles
    mapping = TileMapping.linear(size, num_tiles, np.dtype(dtype).itemsize,
                                 max_tiles=max_tiles)
    if 0 < mapping.num_rows < num_tiles:
      start = self.claim_tiles(mapping.num_rows)
      mapping = TileMapping.blocks(size, mapping.chunk, num_tiles, start)
    return mapping

  def new_tensor(self, shape, dtype, mapping: Optional[TileMapping] = None,
                 name: str = "", category: str = "temporaries") -> P.Tensor:
    """A new tensor (linearly mapped unless ``mapping`` is given)."""
    shape = tuple(int(d) for d in shape)
    if mapping is None:
      mapping = self.linear_mapping(shape, dtype)
    tensor = P.Tensor(name or self.op or "t", shape, np.dtype(dtype), mapping,
                      category=category, op=self.op, source=self.source, scope=self.scope)
    self.tensors[tensor.id] = tensor
    if self._local_stack and category == "temporaries":
      self._local_stack[-1].add(tensor.id)
    return tensor

  def like(self, tensor: P.Tensor, dtype=None, name: str = "") -> P.Tensor:
    """A new tensor with ``tensor``'s shape and mapping."""
    return self.new_tensor(tensor.shape, dtype or tensor.dtype, tensor.mapping, name)

  def constant(self, value, dtype=None, name: str = "") -> P.Tensor:
    """A constant tensor holding ``value`` (cached for small values)."""
    value = np.asarray(value, dtype=dtype)
    key = None
    if value.size <= 16:
      key = (value.dtype.str, value.shape, value.tobytes())
      cached = self._constant_cache.get(key)
      if cached is not None:
        return cached
    tensor = P.Tensor(name or "constant", value.shape, value.dtype,
                      self.linear_mapping(value.shape, value.dtype),
                      category="constants", value=value, op=self.op,
                      source=self.source, scope=self.scope)
    self.tensors[tensor.id] = tensor
    self.constants.append(tensor)
    if key is not None:
      self._constant_cache[key] = tensor
    return tensor


  def program_state(self, key, make: Callable[[], P.Tensor]) -> P.Tensor:
    """A tensor that lives for the whole program, made by ``make()`` on first use.

    For state that every equation of the program shares and updates, such as
    the hardware random generators' per-tile state: one tensor per ``key``
    for the whole lowering.
    """
    tensor = self._program_state.get(key)
    if tensor is None:
      tensor = self._program_state[key] = make()
    return tensor

  @property
  def program_states(self) -> dict:
    """The tensors :meth:`program_state` made, by key (a copy)."""
    return dict(self._program_state)


#: The module-level context (JAX's name for it); the same class.
ModuleContext = LoweringContext


def _forward(name: str, doc: str) -> property:
  """A read-only property of :class:`RuleContext`: the module's ``name``."""
  return property(lambda self: getattr(self.module, name), doc=f"{doc} (``ctx.module.{name}``)")


class RuleContext:
  """What a lowering rule receives: one equation and the module it lowers into.

  Built by :func:`~ipu_jax.lowering.lower.lower_jaxpr` for every equation
  (JAX's ``LoweringRuleContext``). Immutable; :meth:`replace` makes a copy
  with other avals, e.g. to call another primitive's rule for a part of the
  work.

  Attributes:
    module: the :class:`LoweringContext` (lower nested jaxprs into it).
    primitive: the equation's ``Primitive``.
    in_avals: the avals of the equation's operands.
    out_avals: the avals of its results.
    source: the user's ``file:line`` of the equation ('' when unknown).
    name_stack: the equation's ``source_info.name_stack`` (None when
      unknown).
  """

  __slots__ = ("module", "primitive", "in_avals", "out_avals", "source", "name_stack")

  def __init__(self, module: LoweringContext, primitive, in_avals: Sequence,
               out_avals: Sequence, source: str = "", name_stack=None):
    if not isinstance(module, LoweringContext):
      raise TypeError(f"RuleContext needs the LoweringContext it lowers into, got "
                      f"{type(module).__name__}")
    for name, value in (("module", module), ("primitive", primitive),
                        ("in_avals", tuple(in_avals)), ("out_avals", tuple(out_avals)),
                        ("source", source), ("name_stack", name_stack)):
      object.__setattr__(self, name, value)

  def __setattr__(self, name, value):
    raise AttributeError(f"RuleContext is immutable (tried to set {name!r}); use replace()")

  def replace(self, **changes) -> "RuleContext":
    """A copy with some fields changed (e.g. ``out_avals``)."""
    fields = {name: getattr(self, name) for name in self.__slots__}
    unknown = set(changes) - set(fields)
    if unknown:
      raise TypeError(f"RuleContext has no field(s) {sorted(unknown)}; fields: "
                      f"{list(self.__slots__)}")
    fields.update(changes)
    return RuleContext(**fields)

  def __repr__(self) -> str:
    return (f"RuleContext({getattr(self.primitive, 'name', self.primitive)!r}, "
            f"in_avals={list(self.in_avals)}, out_avals={list(self.out_avals)}, "
            f"source={self.source!r})")

  # -- the module's state and operations, forwarded (declared, read-only) --

  target = _forward("target", "The IPU target.")
  options = _forward("options", "The :class:`LoweringOptions`.")
  replication_factor = _forward("replication_factor", "Replicas of the program.")
  memory_proportion = _forward("memory_proportion", ":meth:`LoweringContext.memory_proportion`.")
  mesh_axes = _forward("mesh_axes", "Mesh axes in scope: ``{name: size}``.")
  op = _forward("op", "Name stamped on what is created now (the module's current op).")
  next_start_tile = _forward("next_start_tile", "Where the next small tensor starts.")
  emit = _forward("emit", ":meth:`LoweringContext.emit`.")
  sub_program = _forward("sub_program", ":meth:`LoweringContext.sub_program`.")
  named_axes = _forward("named_axes", ":meth:`LoweringContext.named_axes`.")
  updatable_in_place = _forward("updatable_in_place",
                                ":meth:`LoweringContext.updatable_in_place`.")
  donated_and_dying = _forward("donated_and_dying",
                               ":meth:`LoweringContext.donated_and_dying`.")
  claim_tiles = _forward("claim_tiles", ":meth:`LoweringContext.claim_tiles`.")
  linear_mapping = _forward("linear_mapping", ":meth:`LoweringContext.linear_mapping`.")
  new_tensor = _forward("new_tensor", ":meth:`LoweringContext.new_tensor`.")
  like = _forward("like", ":meth:`LoweringContext.like`.")
  constant = _forward("constant", ":meth:`LoweringContext.constant`.")
