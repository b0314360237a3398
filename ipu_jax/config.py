"""A strict, nested configuration in the manner of Graphcore's ``IPUConfig``.

Example:

>>> import ipu_jax
>>> cfg = ipu_jax.IPUConfig()
>>> cfg.device.tiles_per_ipu = 16
>>> cfg.matmuls.available_memory_proportion = 0.3
>>> cfg.to_target().num_tiles                 # an IPUTarget
16
>>> options = cfg.lowering_options()          # a hashable LoweringOptions
>>> cfg.matmuls.partials_type = "half"
Traceback (most recent call last):
...
ValueError: matmuls.partials_type must be one of 'float32', 'float16'; got 'half'.

Each option is declared once, as an :class:`_Option` descriptor carrying its
default, the values it accepts and its documentation. A misspelt name or a bad
value fails where it is assigned and names the full dotted option, rather than
being silently ignored when a program is compiled.

(Longer than the ~600 lines a module usually keeps to: it is the one place
every option is declared, so a user or reviewer reads the whole option tree,
its defaults and its documentation in one file; most of its length is that
per-option documentation, and the descriptor machinery at its top is small.)
"""

from __future__ import annotations

import contextlib
import contextvars
import copy as copy_lib
import dataclasses
import difflib
import functools
import numbers
import os
import textwrap
from typing import Any, Callable, Iterator, Mapping, Optional

from ipu_jax.kernels.systems import SYSTEM_PRESETS, check_capacity, system_preset
from ipu_jax.kernels.target import PRESETS, IPUTarget
from ipu_jax.lowering.host_io import check_num_io_tiles
from ipu_jax.lowering.options import (BOOL, LOWERING_KINDS, MEMORY_PROPORTIONS, OPTIONAL_PATH,
                                      PROPORTION, LoweringOptions, OptionKind, check_per_ipu,
                                      integer, one_of, proportion_for)

__all__ = [
    "IPUConfig",
    "LoweringOptions",
    "REPORT_DIR_ENV",
    "default_config",
    "get_default_config",
]

# Like POPLAR_ENGINE_OPTIONS='{"autoReport.directory": ...}': reports can be
# switched on for a whole run without touching the code.
REPORT_DIR_ENV = "IPU_JAX_REPORT_DIR"

# The largest seed both consumers take: jax.random.key converts it to a C long.
SEED_MAX = 2**63 - 1
SEED_KIND = integer(minimum=0, maximum=SEED_MAX, allow_none=True)


# The checked kinds of value are the lowering's (ipu_jax.lowering.options),
# so an option the lowering reads is checked the same way in both places.
def _lowering_option(field: str, doc: str) -> "_Option":
  """An option the lowering reads: its kind and default are LoweringOptions'."""
  return _Option(LOWERING_KINDS[field], LoweringOptions.default(field), doc)


# Counts the options set on any IPUConfig: what is derived from a config
# (ipu_jax.jit's per-call settings) is reused while it has not moved.
_generation = 0


def generation() -> int:
  """A number that changes whenever an option of any :class:`IPUConfig` is set."""
  return _generation


class _Option:
  """A data descriptor declaring one option: what it accepts, default, doc."""

  def __init__(self, kind: OptionKind, default: Any, doc: str):
    self.kind = kind
    self.default = default
    self.__doc__ = doc
    self.name = ""

  def __set_name__(self, owner: type, name: str):
    self.name = name

  def __get__(self, group: Optional[_Group], owner: Optional[type] = None):
    if group is None:
      return self
    return group._values[self.name]

  def __set__(self, group: _Group, value: Any):
    global _generation
    group._values[self.name] = self.kind.check(group._qualify(self.name), value)
    _generation += 1

  def explain(self, heading: str) -> str:
    """``heading`` followed by the doc, accepted values and default."""
    body = (f"{self.__doc__} Accepts {self.kind.description}; "
            f"default {self.default!r}.")
    return heading + "\n" + textwrap.fill(
        body, width=80, initial_indent="    ", subsequent_indent="    ")


class _Section:
  """A data descriptor holding a nested group of options."""

  def __init__(self, group_type: type[_Group]):
    self.group_type = group_type
    self.__doc__ = group_type.__doc__
    self.name = ""

  def __set_name__(self, owner: type, name: str):
    self.name = name

  def __get__(self, group: Optional[_Group], owner: Optional[type] = None):
    if group is None:
      return self
    return group._values[self.name]

  def __set__(self, group: _Group, value: Any):
    path = group._qualify(self.name)
    first = next(iter(self.group_type._options))
    raise AttributeError(
        f"IPUConfig.{path} is a group of options and cannot be replaced; set "
        f"its options instead, e.g. cfg.{path}.{first} = ...")


class _Group:
  """Base of option groups: attributes are exactly the declared options."""

  _options: dict[str, _Option | _Section] = {}

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    cls._options = {name: spec for name, spec in vars(cls).items()
                    if isinstance(spec, (_Option, _Section))}

  def __init__(self, _path: str = ""):
    object.__setattr__(self, "_path", _path)
    object.__setattr__(self, "_values", {})
    for name, spec in self._options.items():
      if isinstance(spec, _Section):
        self._values[name] = spec.group_type(_path=self._qualify(name))
      else:
        self._values[name] = spec.default

  def _qualify(self, name: str) -> str:
    return f"{self._path}.{name}" if self._path else name

  def __setattr__(self, name: str, value: Any):
    if name not in self._options:
      raise self._no_option(self._path, name)
    object.__setattr__(self, name, value)

  def __getattr__(self, name: str) -> Any:
    # Reached only when normal lookup fails. Private names are answered plainly
    # because copy, pickle and IPython probe them, on half-built objects too.
    if name.startswith("_"):
      raise AttributeError(name)
    raise self._no_option(self._path, name)

  @classmethod
  def _leaf_paths(cls) -> Iterator[tuple[str, _Option]]:
    """(dotted path relative to this group, option) for every nested option."""
    for name, spec in cls._options.items():
      if isinstance(spec, _Section):
        for path, option in spec.group_type._leaf_paths():
          yield f"{name}.{path}", option
      else:
        yield name, spec

  @classmethod
  def _no_option(cls, where: str, name: str) -> AttributeError:
    hint = ""
    close = difflib.get_close_matches(name, list(cls._options), n=1)
    if not close:
      # Also catch an option set at the wrong level, e.g. cfg.partials_type
      # meant as cfg.matmuls.partials_type.
      nested = [path for path, _ in cls._leaf_paths() if "." in path]
      leaf = difflib.get_close_matches(
          name, {path.rpartition(".")[2] for path in nested}, n=1)
      close = [path for path in nested if path.rpartition(".")[2] in leaf]
    if close:
      hint = " Did you mean " + " or ".join(map(repr, close)) + "?"
    owner = f"IPUConfig.{where}" if where else "IPUConfig"
    return AttributeError(f"{owner} has no option {name!r}.{hint} Valid "
                          f"options are: {', '.join(cls._options)}.")

  def _walk(self) -> Iterator[tuple[str, _Option, Any]]:
    """(relative dotted path, option, current value) for every option."""
    for path, option in self._leaf_paths():
      value = functools.reduce(getattr, path.split("."), self)
      yield path, option, value

  def to_dict(self) -> dict[str, Any]:
    """The settings as nested plain dicts, one level per group."""
    return {name: value.to_dict() if isinstance(value, _Group) else value
            for name, value in self._values.items()}

  def _update(self, values: Mapping[str, Any]):
    if not isinstance(values, Mapping):
      owner = f"IPUConfig.{self._path}" if self._path else "IPUConfig"
      raise TypeError(f"{owner} must be set from a dict of its options; got "
                      f"{values!r} of type {type(values).__name__}.")
    for name, value in values.items():
      if isinstance(self._options.get(name), _Section):
        getattr(self, name)._update(value)
      else:
        setattr(self, name, value)

  def describe(self) -> str:
    """Every option in this group: its value, documentation and valid values."""
    return "\n".join(
        option.explain(f"{self._qualify(path)} = {value!r}")
        for path, option, value in self._walk())

  def copy(self):
    """An independent deep copy."""
    return copy_lib.deepcopy(self)

  def __repr__(self) -> str:
    changed = [f"{path}={value!r}" for path, option, value in self._walk()
               if value != option.default]
    owner = f"IPUConfig.{self._path}" if self._path else "IPUConfig"
    return f"{owner}({', '.join(changed)})"

  def __eq__(self, other: Any) -> bool:
    if type(other) is not type(self):
      return NotImplemented
    return self.to_dict() == other.to_dict()

  __hash__ = None  # Mutable; freeze it with lowering_options() for a key.


class _DeviceOptions(_Group):
  """The emulated IPU chip."""

  version = _Option(
      one_of("ipu1", "ipu2", "bow", "ipu21"), "ipu2",
      "IPU generation to emulate: 'ipu1' (GC2, 1216 tiles x 256 KiB), 'ipu2' "
      "(GC200, 1472 tiles x 624 KiB), 'bow' (the GC200 die at 1.85 GHz) or "
      "'ipu21' (the C600's Mk2 IPU with FP8 units).")
  tiles_per_ipu = _Option(
      integer(0), 0,
      "Tiles to use on each IPU; 0 means every tile of device.version. Fewer "
      "tiles make small tests and studies fast. The chip's limit is checked by "
      "to_target(), since device.version may be set afterwards.")


class _MatmulOptions(_Group):
  """How matrix multiplications are planned."""

  available_memory_proportion = _lowering_option(
      "available_memory_proportion",
      "Fraction of each tile's memory a matmul may use for temporaries "
      "(Poplar's availableMemoryProportion); lower values trade cycles for "
      "memory. Per IPU: a list with one value per IPU of a replica, or a "
      "dict {ipu: value}; a pipeline stage plans under its IPU's value, a "
      "program over several IPUs under the smallest of theirs.")
  partials_type = _lowering_option(
      "partials_type",
      "Type of matmul partial sums: 'float32' is more accurate, 'float16' "
      "halves their memory for half-precision inputs.")


class _ConvolutionOptions(_Group):
  """How convolutions are planned."""

  available_memory_proportion = _lowering_option(
      "conv_available_memory_proportion",
      "Fraction of each tile's memory a convolution may use for temporaries "
      "(Poplar's availableMemoryProportion); lower values trade cycles for "
      "memory. Per IPU as matmuls.available_memory_proportion.")


class _MemoryOptions(_Group):
  """What to do when tiles run out of memory."""

  allow_out_of_memory = _lowering_option(
      "allow_out_of_memory",
      "Lower programs whose tiles exceed their memory instead of raising "
      "OutOfMemoryError, so their report can still be read (Poplar's "
      "debug.allowOutOfMemory).")


class _ReportOptions(_Group):
  """Where compilation reports go, and whether slow compiles show progress."""

  directory = _lowering_option(
      "report_directory",
      "Directory where a report of every compiled program is saved. None "
      f"saves none, unless the {REPORT_DIR_ENV} environment variable names a "
      "directory.")
  progress = _Option(
      BOOL, True,
      "Show the progress of compiles that take over 2 s (tracing, lowering "
      "n/N equations, planning, memory check, compiling); False silences it "
      "like verbose=0.")


class _TrainingOptions(_Group):
  """How gradients are accumulated and reduced when training."""

  gradient_accumulation_reduction = _Option(
      one_of("sum", "mean", "running_mean"), "sum",
      "How the gradients of accumulated micro-batches are combined: 'sum' "
      "(the Keras-on-IPU default), 'mean' (what optax.MultiSteps gives) or "
      "'running_mean' (a mean kept while accumulating, which stays in range "
      "in float16).")
  replica_reduction = _Option(
      one_of("sum", "mean"), "sum",
      "How gradients are combined across replicas: 'sum' of the per-replica "
      "gradients (Keras on IPU) or their 'mean' (PopTorch).")
  gradient_accumulation_steps = _Option(
      integer(1), 1,
      "Micro-batches whose gradients are accumulated before each weight "
      "update.")


class _ExecutorOptions(_Group):
  """How the emulator runs programs on the host."""

  mode = _lowering_option(
      "executor_mode",
      "Which form of each superstep the host runs: 'batched' its form on "
      "logical arrays (the arithmetic jax.jit would run, as fewer, larger "
      "operations), 'per_tile' what the tiles do, vertex by vertex. Results "
      "and per-tile accounting are identical; only host speed differs.")


# -- Floating-point behaviour (TF-IPU's floating_point_behaviour; ipu_jax/rounding.py) --
class _FloatingPointOptions(_Group):
  """How the chip rounds and overflows in reduced precision (ipu_jax/rounding.py),
  and which floating-point exceptions stop a program (lowering/fp_exceptions.py)."""

  esr = _lowering_option(
      "stochastic_rounding",
      "Stochastic rounding of every float32 -> float16/FP8 rounding the chip "
      "does (casts, matmul and convolution results, elementwise results, so "
      "weight updates): 'OFF' rounds to nearest (bit-exact with jax.jit), 'ON' "
      "rounds stochastically with bits from each tile's xoroshiro128aox "
      "generator (different on each replica), 'REPLICA_IDENTICAL_ONLY' only "
      "values identical on all replicas, with equal bits on every replica "
      "(TF-IPU's ESR modes; PopTorch's enableStochasticRounding is 'ON').")
  seed = _lowering_option(
      "rounding_seed",
      "Seed of the tiles' hardware random generators (Poplar's setSeed); "
      "the same seed gives the same stochastic roundings.")
  nanoo = _lowering_option(
      "nanoo",
      "Not-a-number on overflow: True lets float16 results overflow to "
      "inf (and NaN), as jax.jit does; False saturates them to +-65504.")
  inv = _lowering_option(
      "inv",
      "Trap invalid operations (IEEE 754: 0/0, inf - inf, 0 * inf, sqrt or "
      "log of a negative, ...): a compute step producing a NaN from non-NaN "
      "inputs stops the program with ipu_jax.FloatingPointException naming "
      "the operation, the source line and the step (Poplar's "
      "FloatingPointBehaviour.inv; off by default, as in TF-IPU's IPUConfig).")
  div0 = _lowering_option(
      "div0",
      "Trap division by zero: an infinity produced from finite inputs by an "
      "operation with a pole (x/0, log(0), rsqrt(0), ...) stops the program "
      "with ipu_jax.FloatingPointException (Poplar's "
      "FloatingPointBehaviour.div0; off by default).")
  oflo = _lowering_option(
      "oflo",
      "Trap overflow: an infinity produced from finite inputs by arithmetic "
      "(exp, sums, products, matmuls, float32 -> float16 casts beyond 65504) "
      "stops the program with ipu_jax.FloatingPointException (Poplar's "
      "FloatingPointBehaviour.oflo; off by default).")


# -- Streaming memory (ipu_jax/keras/offload.py) ------------------------


class _StreamingOptions(_Group):
  """What the training layer keeps in streaming memory, and how replicas share it."""

  offload_optimizer_state = _Option(
      BOOL, False,
      "Keep the optimizer state in streaming memory (IPU-Machine DDR), streamed "
      "onto the tiles for each weight update and back after it, as "
      "TensorFlow-IPU's offload_weight_update_variables does. Numbers are "
      "unchanged; tile memory falls by the state's bytes, the copies cost "
      "cycles at the streaming-memory bandwidth.")
  replicated_tensor_sharding = _Option(
      BOOL, False,
      "With replication_factor R > 1, each replica holds 1/R of the optimizer "
      "state: gradients are reduce-scattered, each replica updates its shard "
      "of the weights, and the new weights are all-gathered (TensorFlow-IPU's "
      "replicated_optimizer_state_sharding, PopTorch's "
      "useReplicatedTensorSharding). The optimizer's update runs on the shards "
      "(ipu_jax/sharded_optimizer.py): elementwise work per shard, norms over a "
      "whole weight (LAMB, global-norm clipping) reduced across the replicas; "
      "an update that mixes elements otherwise is refused before anything runs. "
      "Applies to the Keras-like fit and to ipu_jax.pipelining.Pipeline.")


# -- Pipelining (ipu_jax/pipelining/) ----------------------------------------------


class _PipeliningOptions(_Group):
  """How ipu_jax.pipelining.Pipeline runs a model split into stages."""

  schedule = _Option(
      one_of("Grouped", "Interleaved", "Sequential"), "Grouped",
      "Pipeline schedule (TF-IPU's PipelineSchedule): 'Grouped' (forward "
      "passes grouped, then backward passes), 'Interleaved' (one pass per IPU "
      "per slot, fewer activations stashed) or 'Sequential' (sharded: one "
      "stage at a time). The number of micro-batches per step is "
      "training.gradient_accumulation_steps.")
  recomputation = _Option(
      BOOL, False,
      "Recompute each stage's forward pass in its backward pass, stashing "
      "only the stage's inputs and the values marked with "
      "ipu_jax.ops.recomputation_checkpoint (TF-IPU's recomputation_mode "
      "RecomputeThenBackpropagate). As in TF-IPU the last stage is not "
      "recomputed: its forward and backward passes run back to back "
      "(pipelining.last_stage_recomputation changes that).")
  last_stage_recomputation = _Option(
      one_of("none", "checkpoints"), "none",
      "With pipelining.recomputation, what the last stage (the loss's) "
      "recomputes. 'none': nothing, as TF-IPU's recomputation pass (its "
      "whole forward's activations wait for its backward). 'checkpoints': "
      "PopART's RecomputationType::Pipeline (Pipeline::"
      "setFinalFwdStageRecomputation): the stage is cut at its "
      "ipu_jax.ops.recomputation_checkpoint values, the segments up to the "
      "last checkpoint are recomputed one at a time right before their "
      "gradients, the tail after the last checkpoint (up to the loss) is not. "
      "A last stage without checkpoint marks is never recomputed either way.")


# -- Fusion (lowering/fusion.py) -----------------------------------------------------


class _FusionOptions(_Group):
  """Which operations lowering fuses into one compute set."""

  elementwise = _lowering_option(
      "fuse_elementwise",
      "Fuse chains of elementwise operations on the same tile layout into "
      "one compute set (one sync, one vertex per tile), as popops map "
      "expressions and XLA fusion do; False gives every operation its own "
      "superstep. Results are identical either way.")


# -- Random numbers (lowering/rules/random.py) ----------------------------------------


class _RandomOptions(_Group):
  """How ``jax.random``'s bits are made (docs/number_formats.md#random-numbers)."""

  mode = _lowering_option(
      "random_mode",
      "'jax': jax.random's bits exactly as jax.jit draws them (threefry, priced "
      "as its integer arithmetic on the tiles); 'hardware': drawn from the "
      "tiles' xoroshiro128aox generators as poprand does (the same "
      "distributions, other numbers; seeded by floating_point_behaviour.seed, "
      "each replica its own stream; priced by PopLibs' poprand estimators).")


# -- Host I/O: I/O tiles and output modes (lowering/host_io.py) ---------------------


class _IOTilesOptions(_Group):
  """Tiles set aside to receive host data while the others compute (lowering/host_io.py)."""

  num_io_tiles = _Option(
      OptionKind("0 or a positive even int (I/O tiles come in pairs, as TF-IPU and "
                 "GCL require)", (numbers.Integral,),
                 lambda value: value >= 0 and value % 2 == 0, int), 0,
      "Tiles of each IPU reserved for host I/O (TF-IPU's io_tiles.num_io_tiles, "
      "PopART's numIOTiles): 0, or an even count of at most 192 (TF-IPU's limit) "
      "and at most half of the IPU's tiles. Every plan, memory figure and "
      "out-of-memory check then sees only the other tiles; host transfers land "
      "on the I/O tiles and reach the compute tiles in one on-chip exchange. "
      "ipu_jax.io_tiles.suggest_num_io_tiles sizes it by PopART's rule.")
  strategy = _lowering_option(
      "io_exchange_strategy",
      "When the I/O tiles load the next iteration of an on-device loop "
      "(PopART's ExchangeStrategy): 'JustInTime' (load, compute, store in "
      "turn: no overlap), 'OverlapInnerLoop' (the next iteration's load and "
      "this one's store overlap the compute inside the innermost loop; its "
      "first load and last store do not) or 'OverlapLoops' (across the loop "
      "nest too: only the execution's first load and last store do not "
      "overlap). Matters only with num_io_tiles > 0.")
  available_memory_proportion = _lowering_option(
      "io_available_memory_proportion",
      "Fraction of each I/O tile's memory that may hold streamed data, the "
      "rest being code (TF-IPU's io_tiles.available_memory_proportion); "
      "data that does not fit raises OutOfMemoryError.")


class _OutputOptions(_Group):
  """How much of an on-device loop's stacked results goes back to the host."""

  mode = _lowering_option(
      "output_mode",
      "Which iterations' outputs of an on-device loop return to the host "
      "(PopTorch's OutputMode, TF-IPU's outfeed mode): 'all' every "
      "iteration's, 'final' the last one's only, 'sum' their sum, 'every_n' "
      "every return_period-th (the return_period-th, 2 x return_period-th, "
      "...). Applies to predict's outputs, the per-step loss and metric sums "
      "fit and evaluate log (weights never change), and the stacked outputs of "
      "a jitted function's top-level lax.scan.")
  return_period = _lowering_option(
      "output_return_period",
      "N of mode 'every_n' (PopTorch's output_return_period); must divide "
      "the loop's iteration count.")


class IPUConfig(_Group):
  """Configuration of an emulated IPU system, like Graphcore's ``IPUConfig``.

  Options are nested attributes, checked when assigned::

    cfg = IPUConfig()
    cfg.replication_factor = 2
    cfg.matmuls.available_memory_proportion = 0.3

  An unknown name raises ``AttributeError`` with a suggestion; a value of the
  wrong type raises ``TypeError`` and one out of range ``ValueError``, both
  naming the dotted option and what it accepts. ``cfg.describe()`` lists every
  option; ``IPUConfig.help("device.version")`` explains one.
  """

  device = _Section(_DeviceOptions)
  auto_select_ipus = _Option(
      integer(1), 1,
      "IPUs each replica spans; the target has this many IPUs.")
  replication_factor = _Option(
      integer(1), 1,
      "Data-parallel replicas of the program, each on its own "
      "auto_select_ipus IPUs.")
  system = _Option(
      OptionKind("one of " + ", ".join(map(repr, sorted(SYSTEM_PRESETS))) + " or None", (str,),
                 lambda value: value in SYSTEM_PRESETS, allow_none=True), None,
      "The IPU system the replicas run on (docs/systems.md): 'm2000', 'pod16', "
      "'pod64', 'pod128', 'bow-pod16', 'bow-pod64', 'bow-pod256', ... Collectives "
      "between replicas are then priced over its links (IPU-Links inside a POD, "
      "GW-Links between PODs) and its IPUs are the system's chip (device.version "
      "may be left at its default or must name that chip). None: the flat "
      "model, one IPU-Link rate for everything.")
  matmuls = _Section(_MatmulOptions)
  convolutions = _Section(_ConvolutionOptions)
  memory = _Section(_MemoryOptions)
  report = _Section(_ReportOptions)
  training = _Section(_TrainingOptions)
  executor = _Section(_ExecutorOptions)
  floating_point_behaviour = _Section(_FloatingPointOptions)
  streaming = _Section(_StreamingOptions)
  pipelining = _Section(_PipeliningOptions)
  fusion = _Section(_FusionOptions)
  random = _Section(_RandomOptions)
  io_tiles = _Section(_IOTilesOptions)
  outputs = _Section(_OutputOptions)
  # NumPy's generators (a fit's shuffling) take only non-negative seeds and
  # jax.random.key a C long, so the seed is refused here, naming the field,
  # rather than deep inside the first fit.
  random_seed = _Option(
      SEED_KIND, None,
      "Seed for the random state of programs run with this config, for "
      "reproducible runs; None fixes no seed.")
  executable_cache_dir = _Option(
      OPTIONAL_PATH, None,
      "Directory of the executable cache: programs lowered and compiled once "
      "are loaded by later processes instead (docs/host_side.md). None caches "
      "nothing, unless the IPU_JAX_EXECUTABLE_CACHE environment variable "
      "names a directory.")

  @classmethod
  def from_dict(cls, values: Mapping[str, Any]) -> IPUConfig:
    """A config from nested dicts as ``to_dict`` gives; missing keys default.

    Every value is checked as if assigned, so unknown names and bad values
    raise the same errors.
    """
    cfg = cls()
    cfg._update(values)
    return cfg

  @classmethod
  def help(cls, path: str) -> str:
    """Documentation of the option or group at dotted ``path``.

    Example: ``IPUConfig.help("matmuls.available_memory_proportion")``.
    """
    group_type, where = cls, ""
    for part in path.split("."):
      spec = group_type._options.get(part)
      if spec is None:
        raise group_type._no_option(where, part)
      where = f"{where}.{part}" if where else part
      if isinstance(spec, _Option):
        if where != path:
          raise AttributeError(f"IPUConfig.{where} is an option, not a group; "
                               f"it has no {path[len(where) + 1:]!r}.")
        return spec.explain(path)
      group_type = spec.group_type
    return f"{path}: {group_type.__doc__}\n" + "\n".join(
        option.explain(f"{path}.{leaf}")
        for leaf, option in group_type._leaf_paths())

  def to_target(self) -> IPUTarget:
    """The :class:`IPUTarget` of one replica: ``auto_select_ipus`` IPUs.

    With ``system`` set the target carries that :class:`IPUSystem` and its
    IPUs are the system's chip.

    Raises:
      ValueError: ``device.tiles_per_ipu`` exceeds the tiles of
        ``device.version``; ``device.version`` names another chip than the
        system's; the system has fewer IPUs than ``replication_factor`` x
        ``auto_select_ipus``.
    """
    version, tiles = self._chip(), self.device.tiles_per_ipu
    available = PRESETS[version]["tiles_per_ipu"]
    if tiles > available:
      raise ValueError(
          f"device.tiles_per_ipu={tiles} exceeds the {available} tiles of a "
          f"{version} IPU (device.version={version!r}); valid values are 0 "
          f"(every tile) or 1..{available}.")
    io = check_num_io_tiles(self.io_tiles.num_io_tiles, tiles or available)
    return IPUTarget.preset(version, num_ipus=self.auto_select_ipus,
                            tiles_per_ipu=(tiles or available) - io, io_tiles_per_ipu=io,
                            system=self.system)

  def _chip(self) -> str:
    """``device.version``, or the system's chip when a system is set."""
    version = self.device.version
    if self.system is None:
      return version
    system = system_preset(self.system)
    default = type(self.device)._options["version"].default
    if version not in (default, system.chip):
      raise ValueError(
          f"system={self.system!r} is made of {system.chip!r} IPUs ({system.machine}) but "
          f"device.version={version!r}; set device.version={system.chip!r} or leave it at "
          f"its default.")
    check_capacity(system, self.replication_factor, self.auto_select_ipus)
    return system.chip

  def lowering_options(self) -> LoweringOptions:
    """The options that change how programs are lowered, frozen and hashable.

    ``report_directory`` falls back to the ``IPU_JAX_REPORT_DIR`` environment
    variable, read now, when ``report.directory`` is None.
    """
    values = {name: functools.reduce(getattr, path.split("."), self)
              for name, path in _LOWERING_SOURCES.items()}
    if values["report_directory"] is None:
      values["report_directory"] = os.environ.get(REPORT_DIR_ENV) or None
    for name in _PER_IPU_FIELDS:
      check_per_ipu(_LOWERING_SOURCES[name], values[name], self.auto_select_ipus)
    return LoweringOptions(**values)

  def for_ipu(self, ipu: int) -> "IPUConfig":
    """A copy whose per-IPU options hold IPU ``ipu``'s value as one number.

    What a program lowered for that one IPU (a pipeline stage) plans under.

    Raises:
      ValueError: ``ipu`` is not an IPU of the replica, or a per-IPU
        option does not suit ``auto_select_ipus``.
    """
    if not 0 <= int(ipu) < self.auto_select_ipus:
      raise ValueError(f"IPUConfig.for_ipu: IPU {ipu} is not one of the replica's IPUs "
                       f"0..{self.auto_select_ipus - 1}.")
    cfg = self.copy()
    for name in _PER_IPU_FIELDS:
      path = _LOWERING_SOURCES[name]
      value = functools.reduce(getattr, path.split("."), self)
      check_per_ipu(path, value, self.auto_select_ipus)
      group, option = path.split(".")
      setattr(getattr(cfg, group), option, proportion_for(value, [ipu]))
    return cfg


# Options that may give one value per IPU of a replica.
_PER_IPU_FIELDS = MEMORY_PROPORTIONS

# Each LoweringOptions field and the IPUConfig option it comes from; the
# option supplies its default and its check.
_LOWERING_SOURCES = {
    "available_memory_proportion": "matmuls.available_memory_proportion",
    "conv_available_memory_proportion":
        "convolutions.available_memory_proportion",
    "partials_type": "matmuls.partials_type",
    "allow_out_of_memory": "memory.allow_out_of_memory",
    "report_directory": "report.directory",
    "executor_mode": "executor.mode",
    "stochastic_rounding": "floating_point_behaviour.esr",
    "rounding_seed": "floating_point_behaviour.seed",
    "nanoo": "floating_point_behaviour.nanoo",
    "inv": "floating_point_behaviour.inv",
    "div0": "floating_point_behaviour.div0",
    "oflo": "floating_point_behaviour.oflo",
    "fuse_elementwise": "fusion.elementwise",
    "random_mode": "random.mode",
    "io_exchange_strategy": "io_tiles.strategy",
    "io_available_memory_proportion": "io_tiles.available_memory_proportion",
    "output_mode": "outputs.mode",
    "output_return_period": "outputs.return_period",
}


_DEFAULT_CONFIG: contextvars.ContextVar[Optional[IPUConfig]] = (
    contextvars.ContextVar("ipu_jax_default_config", default=None))


def active_config() -> Optional[IPUConfig]:
  """The config set by the innermost :func:`default_config`, or None if none is."""
  return _DEFAULT_CONFIG.get()


def get_default_config() -> IPUConfig:
  """The config set by the innermost :func:`default_config`, else a new one.

  A fresh default ``IPUConfig`` is returned each time none is set, so changing
  it affects nothing else.
  """
  cfg = _DEFAULT_CONFIG.get()
  return IPUConfig() if cfg is None else cfg


@contextlib.contextmanager
def default_config(cfg: IPUConfig) -> Iterator[IPUConfig]:
  """Makes ``cfg`` the default config inside the ``with`` block.

  Nests, and restores the previous default on exit, exceptions included. The
  setting is per context (``contextvars``), so other threads are unaffected.
  The config itself, not a copy, is installed: changes made inside the block
  are seen by what is compiled after them.

  Args:
    cfg: the config to install.

  Yields:
    ``cfg``.
  """
  if not isinstance(cfg, IPUConfig):
    raise TypeError(f"default_config expects an IPUConfig; got {cfg!r} of "
                    f"type {type(cfg).__name__}.")
  token = _DEFAULT_CONFIG.set(cfg)
  try:
    yield cfg
  finally:
    _DEFAULT_CONFIG.reset(token)
