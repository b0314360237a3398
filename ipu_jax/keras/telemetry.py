"""What ``fit`` records of its number formats after each execution.

The loss scale of a :class:`~ipu_jax.keras.LossScaleOptimizer` (with its
skipped steps and overflows) and the scales of FP8 layers
(:mod:`ipu_jax.fp8_scaling`) go into a
:class:`~ipu_jax.report.precision.NumberFormatTelemetry`, which the train
report shows (docs/number_formats.md). Plain and pipelined ``fit`` record
through ``Model.record_number_formats``.
"""

from __future__ import annotations

from typing import Callable

import jax

from ipu_jax.fp8_scaling import FP8Stats, collect_telemetry
from ipu_jax.report.precision import NumberFormatTelemetry

__all__ = ["record_number_formats"]


def _fp8_scales(module_state) -> dict:
  """The FP8 layers' amax histories and scales in the module state ({} without any)."""
  if any(isinstance(leaf, FP8Stats) for leaf in jax.tree.leaves(
      module_state, is_leaf=lambda x: isinstance(x, FP8Stats))):
    return collect_telemetry(module_state)
  return {}


def record_number_formats(telemetry: NumberFormatTelemetry, step: Callable[[], int],
                          module_state, logs: dict, report) -> NumberFormatTelemetry:
  """Records one execution's scales at weight update ``step()``; returns the telemetry.

  A step not after the last recorded one (an earlier checkpoint restored)
  starts a new history, which is returned in place of ``telemetry``.

  Args:
    telemetry: the history so far.
    step: the weight updates made so far (read only when there is something
      to record: it waits for the device).
    module_state: the module's non-trainable state (FP8 layers' statistics).
    logs: the execution's logs (``loss_scale``, ``skipped_steps``,
      ``overflows`` with loss scaling).
    report: the train report that shows the telemetry, or ``None``.
  """
  fp8 = _fp8_scales(module_state)
  if "loss_scale" not in logs and not fp8:
    return telemetry
  now = step()
  if telemetry.last_step is not None and now <= telemetry.last_step:
    telemetry = NumberFormatTelemetry()
  if "loss_scale" in logs:
    telemetry.record_loss_scale(now, logs["loss_scale"], logs["skipped_steps"],
                                logs["overflows"])
  if fp8:
    telemetry.record_fp8(now, fp8)
  if report is not None:
    report.number_formats = telemetry
  return telemetry
