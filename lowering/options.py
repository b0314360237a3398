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
from typing import Any, Callable, Optional

__all__ = ["BOOL", "LOWERING_KINDS", "LoweringOptions", "OPTIONAL_PATH", "OptionKind",
           "PROPORTION", "integer", "one_of"]


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


def integer(minimum: Optional[int] = None, allow_none: bool = False) -> OptionKind:
  """An int, at least ``minimum`` when given (``None`` too if ``allow_none``)."""
  description = "an int" if minimum is None else f"an int >= {minimum}"
  if allow_none:
    description += " or None"
  return OptionKind(description, (numbers.Integral,),
                    lambda value: minimum is None or value >= minimum, int,
                    allow_none)


# `0 < value` is False for NaN, so NaN is rejected too.
PROPORTION = OptionKind("a number in (0, 1]", (numbers.Real,),
                        lambda value: 0 < value <= 1, float)
BOOL = OptionKind("a bool", (bool,))
OPTIONAL_PATH = OptionKind("a str (or path) or None", (str, os.PathLike),
                           convert=os.fspath, allow_none=True)


@dataclasses.dataclass(frozen=True)
class LoweringOptions:
  """What lowering needs from an ``IPUConfig``; a hashable cache key.

  ``IPUConfig`` declares the options these come from with the defaults and
  kinds given here, so ``LoweringOptions()`` equals a default config's. Values
  are checked on construction.

  Attributes:
    available_memory_proportion: ``matmuls.available_memory_proportion``.
    conv_available_memory_proportion:
      ``convolutions.available_memory_proportion``.
    partials_type: ``matmuls.partials_type``.
    allow_out_of_memory: ``memory.allow_out_of_memory``.
    report_directory: ``report.directory``, else ``$IPU_JAX_REPORT_DIR``.
    executor_mode: ``executor.mode``.
    stochastic_rounding, rounding_seed, nanoo:
      ``floating_point_behaviour.esr``, ``.seed``, ``.nanoo``.
    inv, div0, oflo: ``floating_point_behaviour.inv``, ``.div0``,
      ``.oflo`` (exceptions the executor traps).
    fuse_elementwise: ``fusion.elementwise``.
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

  def __post_init__(self):
    for name, kind in LOWERING_KINDS.items():
      object.__setattr__(self, name, kind.check(f"LoweringOptions.{name}", getattr(self, name)))

  @classmethod
  def default(cls, name: str) -> Any:
    """The default of field ``name``."""
    return cls.__dataclass_fields__[name].default


# The kind of value each LoweringOptions field accepts.
LOWERING_KINDS = {
    "available_memory_proportion": PROPORTION,
    "conv_available_memory_proportion": PROPORTION,
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
}
