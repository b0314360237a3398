r"""Lowering time of the benchmark's ``scale`` rows alone, several lowerings per process.

The scale suite (``python -m experiments.benchmark --suite=scale``) measures a
row's lowering once, beside its compile and steps; comparing two states of the
code needs the lowering alone, repeated, in CPU seconds (``time.process_time``:
on a shared machine wall time includes waiting for a core). Each lowering is a
fresh ``ipu_jax.jit`` of the row's step, the rows lowered in turn, round by
round (:func:`measure_alternating`: the machine's speed drifts within minutes,
and rows measured at the same moments compare the code). The line printed per
row gives the CPU and wall seconds of each (with the kernel's share of the CPU seconds and the
page faults), the equations, the CPU ms an equation of the fastest and the
figures' fingerprint (``program_figures.figures_sha1``: a speed change must
leave it unchanged), and how many values its per-tile figures would take held
as runs or as classes of tiles (``program_figures.figure_compression``: how far
the redesign of ``docs/performance.md#lowering-on-several-ipus`` could take the
tile count out of the lowering's work), then each row's time over the first
row's (:func:`over`)::

    python -m experiments.lowering_time --rows=enc-8x256,enc-8x256-bow4 --repeats=3

Adding ``enc-8x256-t5888`` (the same step on one IPU of the four's 5,888
tiles) parts the four-IPU row's time over one IPU's into what the tile count
makes and what the IPU-Links add.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import sys
import time
from typing import Callable, Sequence

from absl import app, flags

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class _Row:
  """A scale row ready to lower: its step, arguments, target and config."""

  name: str
  fn: Callable
  args: tuple
  target: object
  config: object


def _prepare(name: str) -> _Row:
  """Scale row ``name``'s step and arguments, built once for all its lowerings."""
  import ipu_jax
  from experiments import scale_workloads
  r = scale_workloads.row(name)
  fn, args = scale_workloads.workload(r)
  target = r.ipu_target()
  cfg = ipu_jax.IPUConfig()
  cfg.replication_factor = r.replicas
  return _Row(name, fn, args, target, cfg)


def _lower_once(row: _Row) -> tuple:
  """``(cpu s, wall s, kernel s, page faults, lowered)`` of one fresh lowering."""
  import ipu_jax
  emulated = ipu_jax.jit(row.fn, config=row.config, target=row.target, verbose=0)
  usage = resource.getrusage(resource.RUSAGE_SELF)
  start_cpu, start_wall = time.process_time(), time.perf_counter()
  lowered = emulated.lower(*row.args)
  cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
  # Part of the CPU time is the kernel's, mostly zeroing the pages a
  # lowering touches first (the first lowering in a process most).
  after = resource.getrusage(resource.RUSAGE_SELF)
  return cpu, wall, after.ru_stime - usage.ru_stime, after.ru_minflt - usage.ru_minflt, lowered


def _summary(name: str, samples: list, lowered) -> dict:
  """A row's result from its lowerings' times (``samples``) and its last program."""
  from experiments.program_figures import figure_compression, figures_sha1, iter_eqns
  cpu, wall, system, faults = (list(column) for column in zip(*samples))
  equations = sum(1 for _ in iter_eqns(lowered.jaxpr.jaxpr))
  return {"row": name, "cpu_s": cpu, "wall_s": wall, "system_s": system,
          "page_faults": faults, "equations": equations,
          "cpu_ms_per_equation": 1000 * min(cpu) / equations,
          "figures_sha1": figures_sha1(lowered.report.profile),
          "figure_compression": figure_compression(lowered.program)}


def measure(name: str, repeats: int) -> dict:
  """Lower scale row ``name`` ``repeats`` times; its CPU and wall seconds and fingerprint."""
  return measure_alternating([name], repeats)[0]


def measure_alternating(names: Sequence[str], repeats: int) -> list:
  """:func:`measure` of several rows, lowered in turn, ``repeats`` rounds.

  The machine's speed drifts within minutes; rows lowered in turn are
  measured at the same moments, so the ratio of round ``k``'s times
  compares the code, not the minute (the first round pays the process's
  first lowering: take the median over rounds). Only each row's last
  program is kept: a lowered program holds its plans, hundreds of MB at
  this size.
  """
  rows = [_prepare(name) for name in names]
  samples = [[] for _ in rows]
  last = [None for _ in rows]
  for _ in range(repeats):
    for k, row in enumerate(rows):
      last[k] = None  # the previous program goes before the next is lowered
      *figures, last[k] = _lower_once(row)
      samples[k].append(figures)
  return [_summary(row.name, kept, lowered)
          for row, kept, lowered in zip(rows, samples, last)]


def over(row: dict, base: dict) -> dict:
  """``row``'s lowering CPU time over ``base``'s, two rows of one :func:`measure_alternating`.

  ``fastest``: fastest over fastest; ``rounds``: the median of the rounds'
  own ratios (each round lowers both rows within the same minutes).
  """
  rounds = [r / b for r, b in zip(row["cpu_s"], base["cpu_s"])]
  return {"fastest": min(row["cpu_s"]) / min(base["cpu_s"]),
          "rounds": statistics.median(rounds)}


_DEFAULT_ROWS = ["enc-8x256", "enc-8x256-bow4"]


def main(argv):
  del argv
  from experiments import entry
  entry.quiet_backend_probe()
  f = flags.FLAGS
  measured = measure_alternating(f.rows or _DEFAULT_ROWS, f.repeats)
  for m in measured:
    name = m["row"]
    print(f"{name}: CPU s {[round(t, 2) for t in m['cpu_s']]}, wall s "
          f"{[round(t, 2) for t in m['wall_s']]}, of the CPU s in the kernel "
          f"{[round(t, 2) for t in m['system_s']]} ({m['page_faults']} page faults), "
          f"{m['equations']} equations, "
          f"{m['cpu_ms_per_equation']:.3f} CPU ms an equation, figures {m['figures_sha1']}",
          flush=True)
    c = m["figure_compression"]
    print(f"  its per-tile figures: {c['figures']} arrays of {c['tiles']} tiles; as runs "
          f"{c['runs_share']:.1%} of their values ({c['median_runs']:.0f} runs an array at the "
          f"median, {c['p90_runs']:.0f} at the 90th percentile); as {c['classes']} classes of "
          f"tiles over {c['steps']} steps ({c['median_classes']:.0f} a step at the median, "
          f"{c['p90_classes']:.0f} at the 90th percentile)", flush=True)
  for m in measured[1:]:  # each row against the first, as the speed suite's lowering row
    ratio = over(m, measured[0])
    print(f"{m['row']} / {measured[0]['row']}: {ratio['fastest']:.2f}x fastest to fastest, "
          f"{ratio['rounds']:.2f}x the rounds' median", flush=True)


if __name__ == "__main__":
  # The benchmark runner defines --rows and --repeats (on import); this runner
  # takes them with the same meaning (default rows: enc-8x256, enc-8x256-bow4).
  from experiments import benchmark  # noqa: F401
  app.run(main)
