"""How a compiled program is run: the setup a report records beside its costs.

A tile program's cycles mean little without knowing what one execution of it
is: how many replicas run it, how many micro-batches it loops over, how large
they are, at what precision. The Keras-like ``Model`` fills a
:class:`RunSetup` for each program it compiles (train, eval, predict) and
attaches it to the program's ``ProgramProfile.run_setup``, where reports read
it (their summary header and their JSON).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["RunSetup"]


@dataclasses.dataclass(frozen=True)
class RunSetup:
  """What one execution of a compiled program does.

  Attributes:
    program: ``"train"``, ``"eval"`` or ``"predict"`` (or a user's name).
    target: the target's name (``"ipu2"``).
    num_ipus: IPUs per replica.
    tiles_per_ipu: tiles of each IPU.
    replicas: data-parallel replicas running the program.
    gradient_accumulation_steps: micro-batches per weight update per replica
      (1 for eval / predict).
    gradient_accumulation_reduction: ``"sum"``, ``"mean"`` or ``"running_mean"``.
    replica_reduction: how gradients are combined over replicas.
    steps_per_execution: micro-batch steps (over all replicas) per execution.
    micro_batch: samples in one micro-batch of one replica.
    global_batch: samples per weight update over all replicas
      (micro_batch x G x R); for eval / predict, per step over all replicas.
    weight_updates_per_execution: S / (G R) (0 for eval / predict).
    param_dtypes: the parameters' dtypes (sorted names).
    matmul_partials_type: ``matmuls.partials_type``.
    matmul_available_memory_proportion: ``matmuls.available_memory_proportion``.
    conv_available_memory_proportion: ``convolutions.available_memory_proportion``.
  """

  program: str
  target: str
  num_ipus: int
  tiles_per_ipu: int
  replicas: int
  gradient_accumulation_steps: int
  gradient_accumulation_reduction: str
  replica_reduction: str
  steps_per_execution: int
  micro_batch: int
  global_batch: int
  weight_updates_per_execution: int = 0
  param_dtypes: tuple = ()
  matmul_partials_type: str = "float32"
  matmul_available_memory_proportion: Optional[float] = None
  conv_available_memory_proportion: Optional[float] = None

  def as_dict(self) -> dict:
    """Plain JSON-ready values."""
    data = dataclasses.asdict(self)
    data["param_dtypes"] = list(self.param_dtypes)
    return data

  def summary_lines(self) -> list:
    """The lines a text summary prints under its title."""
    lines = [
        f"Program: {self.program} step, {self.target}, {self.num_ipus} IPU(s) x "
        f"{self.tiles_per_ipu:,} tiles per replica, {self.replicas} replica(s)",
        f"One execution: {self.steps_per_execution} micro-batch step(s) of "
        f"{self.micro_batch} sample(s) over all replicas",
    ]
    if self.program == "train":
      lines.append(
          f"Gradient accumulation: {self.gradient_accumulation_steps} "
          f"({self.gradient_accumulation_reduction}), replica reduction "
          f"{self.replica_reduction}; global batch {self.global_batch}, "
          f"{self.weight_updates_per_execution} weight update(s) per execution")
    precision = f"Precision: parameters {', '.join(self.param_dtypes) or 'none'}"
    precision += f", matmul partials {self.matmul_partials_type}"
    if self.matmul_available_memory_proportion is not None:
      precision += (f"; available memory proportion: matmuls "
                    f"{self.matmul_available_memory_proportion}, convolutions "
                    f"{self.conv_available_memory_proportion}")
    lines.append(precision)
    return lines
