"""What the lowering needs from the user's configuration.

:class:`LoweringOptions` is the part of an ``IPUConfig`` that changes a
lowered program (a hashable cache key), and :class:`OptionKind` the checked
kinds of value an option accepts. Both live here, below the user's API, so the
lowering never reaches up for ``ipu_jax.config``: the config declares its
lowering options with the kinds and defaults defined here (one source for
each default and each check).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping
from typing import Any, Callable, Optional

__all__ = ["BOOL", "LOWERING_KINDS", "LoweringOptions", "MEMORY_PROPORTIONS", "OPTIONAL_PATH",
           "OptionKind", "PER_IPU_PROPORTION", "PROPORTION", "check_per_ipu", "integer",
           "is_per_ipu", "one_of", "proportion_for"]


@dataclasses.dataclass(frozen=True)
class OptionKind:
  """The values an option accepts.

  Attributes:
    description: the accepted values in words, quoted in error messages.
    types: accepted Python types. ``bool`` passes only when listed itself:
      ``True`` is an ``int`` to Python but hardly ever meant as one.
    is_valid: range check, applied once the type is right.
    convert: turns an accepted value into its stored form.
    allow_none: whether ``None`` is accepted.
  """

  description: str
  types: tuple[type, ...]
  is_valid: Callable[[Any], bool] = lambda value: True
  convert: Callable[[Any], Any] = lambda value: value
  allow_none: bool = False

  def check(self, name: str, value: Any) -> Any:
    """Returns ``value`` in stored form, or raises an error naming ``name``."""
    if value is None and self.allow_none:
      return None
    if ((isinstance(value, bool) and bool not in self.types) or
        not isinstance(value, self.types)):
      raise TypeError(f"{name} must be {self.description}; got {value!r} of "
                      f"type {type(value).__name__}.")
    if not self.is_valid(value):
      raise ValueError(f"{name} must be {self.description}; got {value!r}.")
    return self.convert(value)


def one_of(*choices: str) -> OptionKind:
  """A string among ``choices``."""
  return OptionKind("one of " + ", ".join(map(repr, choices)), (str,),
                    lambda value: value in choices)


def integer(minimum: Optional[int] = None, allow_none: bool = False,
            maximum: Optional[int] = None) -> OptionKind:
  """An int in ``[minimum, maximum]`` where given (``None`` too if ``allow_none``)."""
  if minimum is not None and maximum is not None:
    description = f"an int in [{minimum}, {maximum}]"
  elif minimum is not None:
    description = f"an int >= {minimum}"
  elif maximum is not None:
    description = f"an int <= {maximum}"
  else:
    description = "an int"
  if allow_none:
    description += " or None"
  return OptionKind(description, (numbers.Integral,),
                    lambda value: ((minimum is None or value >= minimum) and
                                   (maximum is None or value <= maximum)), int,
                    allow_none)


# `0 < value` is False for NaN, so NaN is rejected too.
PROPORTION = OptionKind("a number in (0, 1]", (numbers.Real,),
                        lambda value: 0 < value <= 1, float)
BOOL = OptionKind("a bool", (bool,))


def _proportion_ok(value) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and 0 < value <= 1)


def _ipu_key(key):
  """An IPU number from an int or PopTorch's ``"IPU<k>"`` key; None if neither."""
  if isinstance(key, numbers.Integral) and not isinstance(key, bool):
    return int(key) if key >= 0 else None
  if isinstance(key, str) and key.startswith("IPU") and key[3:].isdigit():
    return int(key[3:])
  return None


def _pairs_as_dict(value):
  """A dict with its keys as IPU numbers; the stored form of a dict (sorted
  ``(ipu, value)`` pairs) back as a dict."""
  if (isinstance(value, (list, tuple)) and value
      and all(isinstance(v, (list, tuple)) and len(v) == 2 for v in value)):
    return dict((k, v) for k, v in value)  # also as JSON gives it back: lists
  if isinstance(value, Mapping):
    return {(_ipu_key(k) if _ipu_key(k) is not None else k): v for k, v in value.items()}
  return value


def _per_ipu_ok(value) -> bool:
  value = _pairs_as_dict(value)
  if isinstance(value, (list, tuple)):
    return len(value) > 0 and all(_proportion_ok(v) for v in value)
  if isinstance(value, Mapping):
    return len(value) > 0 and all(
        isinstance(k, int) and not isinstance(k, bool) and k >= 0
        and _proportion_ok(v) for k, v in value.items())
  return _proportion_ok(value)


def _per_ipu_convert(value):
  """A float; a tuple of floats (a list: one per IPU); or sorted ``(ipu, float)``
  pairs (a dict)."""
  value = _pairs_as_dict(value)
  if isinstance(value, (list, tuple)):
    return tuple(float(v) for v in value)
  if isinstance(value, Mapping):
    return tuple(sorted((int(k), float(v)) for k, v in value.items()))
  return float(value)


# An available memory proportion for every IPU, or one per IPU of a replica.
PER_IPU_PROPORTION = OptionKind(
    "a number in (0, 1], a non-empty list of such numbers (one per IPU of a replica) or a "
    "dict {ipu: number in (0, 1]} with keys IPU numbers or PopTorch's 'IPU<k>' (IPUs it "
    "leaves out get the default, 0.6)",
    (numbers.Real, list, tuple, Mapping), _per_ipu_ok, _per_ipu_convert)


def is_per_ipu(value) -> bool:
  """Whether a stored proportion gives values per IPU (not one float)."""
  return isinstance(value, tuple)


def check_per_ipu(name: str, value, num_ipus: int) -> None:
  """A per-IPU proportion must name the replica's IPUs: a list has one entry
  per IPU, a dict's keys are IPUs ``0 .. num_ipus - 1``."""
  if not is_per_ipu(value):
    return
  if value and isinstance(value[0], tuple):
    bad = [ipu for ipu, _ in value if ipu >= num_ipus]
    if bad:
      raise ValueError(f"{name}: IPU {bad[0]} is out of range; a replica has IPUs 0.."
                       f"{num_ipus - 1} (auto_select_ipus={num_ipus}); got {dict(value)!r}.")
  elif len(value) != num_ipus:
    raise ValueError(f"{name}: a list needs one value per IPU of a replica "
                     f"(auto_select_ipus={num_ipus}), got {len(value)}: {list(value)!r}.")


def proportion_for(value, ipus, default: float = 0.6) -> float:
  """The proportion for a plan on ``ipus``: the smallest of theirs.

  Every tile of a plan holds blocks of one size, so a plan spread over
  several IPUs must fit the tightest of their budgets.
  """
  if not is_per_ipu(value):
    return float(value)
  if value and isinstance(value[0], tuple):
    table = dict(value)
    return min(table.get(int(i), default) for i in ipus)
  return min(value[int(i)] for i in ipus)
OPTIONAL_PATH = OptionKind("a str (or path) or None", (str, os.PathLike),
                           convert=os.fspath, allow_none=True)


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
  """What lowering needs from an ``IPUConfig``; a hashable cache key.

  ``IPUConfig`` declares the options these come from with the defaults and
  kinds given here, so ``LoweringOptions()`` equals a default config's. Values
  are checked on construction.

  Attributes:
    available_memory_proportion: ``matmuls.available_memory_proportion``:
      a float, or per IPU (a tuple of floats, or sorted ``(ipu, float)``
      pairs); :func:`proportion_for` gives a plan's.
    conv_available_memory_proportion:
      ``convolutions.available_memory_proportion`` (the same forms).
    partials_type: ``matmuls.partials_type``.
    allow_out_of_memory: ``memory.allow_out_of_memory``.
    report_directory: ``report.directory``, else ``$IPU_JAX_REPORT_DIR``.
    executor_mode: ``executor.mode``.
    stochastic_rounding, rounding_seed, nanoo:
      ``floating_point_behaviour.esr``, ``.seed``, ``.nanoo``.
    inv, div0, oflo: ``floating_point_behaviour.inv``, ``.div0``,
      ``.oflo`` (exceptions the executor traps).
    fuse_elementwise: ``fusion.elementwise``.
    random_mode: ``random.mode``: ``"jax"`` draws ``jax.random``'s bits as
      ``jax.jit`` does (threefry), ``"hardware"`` from the tiles' generators
      (``lowering/rules/random.py``).
    io_exchange_strategy, io_available_memory_proportion: ``io_tiles.strategy``,
      ``io_tiles.available_memory_proportion`` (how host transfers overlap
      compute on the I/O tiles, ``lowering/host_io.py``).
    output_mode, output_return_period: ``outputs.mode``,
      ``outputs.return_period`` (which of a loop's stacked outputs go back to
      the host, ``lowering/host_io.py``).
  """

  available_memory_proportion: float = 0.6
  conv_available_memory_proportion: float = 0.6
  partials_type: str = "float32"
  allow_out_of_memory: bool = False
  report_directory: Optional[str] = None
  executor_mode: str = "batched"
  stochastic_rounding: str = "OFF"
  rounding_seed: int = 0
  nanoo: bool = True
  inv: bool = False
  div0: bool = False
  oflo: bool = False
  fuse_elementwise: bool = True
  random_mode: str = "jax"
  # -- host I/O (lowering/host_io.py) --
  io_exchange_strategy: str = "OverlapLoops"
  io_available_memory_proportion: float = 0.9
  output_mode: str = "all"
  output_return_period: int = 1

  def __post_init__(self):
    for name, kind in LOWERING_KINDS.items():
      object.__setattr__(self, name, kind.check(f"LoweringOptions.{name}", getattr(self, name)))

  @classmethod
  def default(cls, name: str) -> Any:
    """The default of field ``name``."""
    return cls.__dataclass_fields__[name].default


# The LoweringOptions fields that bound a plan's temporary memory, each a
# proportion or one per IPU of a replica; rules read them through
# LoweringContext.memory_proportion, which notes the reads.
MEMORY_PROPORTIONS = ("available_memory_proportion", "conv_available_memory_proportion")

# The kind of value each LoweringOptions field accepts.
LOWERING_KINDS = {
    "available_memory_proportion": PER_IPU_PROPORTION,
    "conv_available_memory_proportion": PER_IPU_PROPORTION,
    "partials_type": one_of("float32", "float16"),
    "allow_out_of_memory": BOOL,
    "report_directory": OPTIONAL_PATH,
    "executor_mode": one_of("batched", "per_tile"),
    "stochastic_rounding": one_of("OFF", "ON", "REPLICA_IDENTICAL_ONLY"),
    "rounding_seed": integer(0),
    "nanoo": BOOL,
    "inv": BOOL,
    "div0": BOOL,
    "oflo": BOOL,
    "fuse_elementwise": BOOL,
    "random_mode": one_of("jax", "hardware"),
    # -- host I/O (lowering/host_io.py) --
    "io_exchange_strategy": one_of("JustInTime", "OverlapInnerLoop", "OverlapLoops"),
    "io_available_memory_proportion": PROPORTION,
    "output_mode": one_of("all", "final", "sum", "every_n"),
    "output_return_period": integer(1),
}
