"""JAX's own ``lax`` operator records run through ``ipu_jax.jit`` (slow).

JAX keeps a catalogue of operator test cases, one ``Harness`` per primitive
and parameter combination (``jax._src.internal_test_util.test_harnesses``,
5,594 records in JAX 0.10.2: every dtype, shape, dimension number and
padding the jax2tf converters are tested on). Each record is run here through
``ipu_jax.jit`` at 16 tiles and compared with ``jax.jit`` on the same
inputs, and classified:

* ``pass``: same results (float outputs within the tolerance of their dtype,
  everything else exact);
* ``unsupported``: ``ipu_jax.LoweringError`` before anything runs (the clear
  error a user sees for a primitive or a parameter with no tile lowering);
* ``out_of_memory``: ``ipu_jax.OutOfMemoryError`` before anything runs, naming
  the tile and the bytes (e.g. one matrix of a linear-algebra record larger
  than a tile's SRAM, which real IPU programs cannot hold either);
* ``wrong``: results differ from ``jax.jit``;
* ``crash``: any other exception.

Records ``jax.jit`` itself cannot run on this host (CPU limitations the
record lists, or a reference that raises) are left out of the count.

The full catalogue takes long on a 2-core host (about 0.3-20 s a record), so
the slow test runs a stratified sample: up to ``_PER_GROUP`` records from
every group (primitive), spread evenly over the group's list (670 records,
about 18 minutes on the shared 2-core host). The catalogue's pass fraction is
estimated by weighting each group's sample by the group's size. The test
asserts no wrong numbers and no crashes (but ``KNOWN_FAILURES``) and an
estimated pass fraction of at least 98 % without ``IN_PROGRESS_GROUPS``. The
script mode prints the table the unsupported list of docs/tile_program.md
comes from::

    python tests/test_lax_records.py --summary            # the sample
    python tests/test_lax_records.py --summary --all      # every record
"""

from __future__ import annotations

import collections
import sys
import time

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import numpy as np
import pytest

import ipu_jax

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_PER_GROUP = 6
_PASS_FRACTION = 0.98

# Relative and absolute tolerance per result dtype: JAX's test defaults for
# floats widened to the accumulation-order differences a tile program has in
# reductions, matmuls and convolutions (partials per tile, then a tree).
_TOLERANCE = {
    np.dtype("float32"): 1e-5,
    np.dtype("float16"): 2e-3,
    np.dtype(jax.numpy.bfloat16): 2e-2,
    np.dtype("complex64"): 1e-5,
}

# Record groups left out of the pass fraction while their lowering is being
# written (group -> why): their records still run and must fail with the clear
# unsupported error, nothing else. None today.
IN_PROGRESS_GROUPS: dict[str, str] = {}

# Records allowed wrong numbers or a crash, each with the reason and the fix
# under way (record fullname -> reason). None today.
KNOWN_FAILURES: dict[str, str] = {}


def _records(everything: bool = False):
  """The harnesses to run: all of them, or the stratified sample."""
  from jax._src.internal_test_util import test_harnesses
  groups = collections.defaultdict(list)
  for harness in test_harnesses.all_harnesses:
    if harness.filter("cpu"):
      groups[harness.group_name].append(harness)
  chosen = []
  for _, members in sorted(groups.items()):
    if everything or len(members) <= _PER_GROUP:
      chosen.extend(members)
    else:
      picks = np.unique(np.linspace(0, len(members) - 1, _PER_GROUP).round().astype(int))
      chosen.extend(members[i] for i in picks)
  return chosen


def _leaves(tree):
  out = []
  for leaf in jax.tree_util.tree_leaves(tree):
    if jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.extended):
      leaf = jax.random.key_data(leaf)
    out.append(np.asarray(leaf))
  return out


def _compare(got, want):
  """None when ``got`` matches ``want``, else what differs."""
  if jax.tree_util.tree_structure(got) != jax.tree_util.tree_structure(want):
    return f"result structure {jax.tree_util.tree_structure(got)} != {jax.tree_util.tree_structure(want)}"
  for g, w in zip(_leaves(got), _leaves(want)):
    if g.shape != w.shape or g.dtype != w.dtype:
      return f"result {g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
    tol = _TOLERANCE.get(w.dtype)
    try:
      if tol is None:
        np.testing.assert_array_equal(g, w)
      else:
        np.testing.assert_allclose(g.astype(np.complex128 if w.dtype.kind == "c" else np.float64),
                                   w.astype(np.complex128 if w.dtype.kind == "c" else np.float64),
                                   rtol=tol, atol=tol, equal_nan=True)
    except AssertionError as e:
      return " ".join(str(e).split())[:300]
  return None


def classify(harness, seed: int = 0):
  """Runs one record; returns ``(outcome, detail)``.

  ``outcome`` is one of ``pass``, ``unsupported``, ``out_of_memory``, ``wrong``, ``crash`` or
  ``reference_fails`` (``jax.jit`` cannot run it here).
  """
  args = harness.dyn_args_maker(np.random.RandomState(seed))
  try:
    want = jax.jit(harness.dyn_fun)(*args)
    jax.block_until_ready(want)
  except Exception as e:  # pylint: disable=broad-except
    return "reference_fails", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  try:
    got = ipu_jax.jit(harness.dyn_fun, target=_T16)(*args)
    jax.block_until_ready(got)
  except ipu_jax.LoweringError as e:
    return "unsupported", str(e).splitlines()[0]
  except ipu_jax.OutOfMemoryError as e:
    return "out_of_memory", str(e).splitlines()[0]
  except Exception as e:  # pylint: disable=broad-except
    return "crash", f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
  difference = _compare(got, want)
  return ("wrong", difference) if difference else ("pass", "")


def group_sizes():
  """Records per group that run on CPU (the weights of the sample)."""
  return collections.Counter(h.group_name for h in _records(everything=True))


def run_records(everything: bool = False, stream=None):
  """Classifies every chosen record.

  Returns:
    ``{fullname: (group, outcome, detail)}``.
  """
  results = {}
  for harness in _records(everything):
    start = time.perf_counter()
    results[harness.fullname] = (harness.group_name,) + classify(harness)
    jax.clear_caches()
    if stream is not None:
      _, outcome, detail = results[harness.fullname]
      print(f"{outcome:16s} {time.perf_counter() - start:6.2f}s {harness.fullname} {detail[:160]}",
            file=stream, flush=True)
  return results


def estimated_pass_fraction(results, exclude=()) -> float:
  """The catalogue's pass fraction estimated from a (stratified) sample.

  Each group's pass fraction in the sample is weighted by the group's size
  in the whole catalogue; with every record run this is the plain fraction.
  """
  sizes = group_sizes()
  passed = collections.defaultdict(list)
  for group, outcome, _ in results.values():
    if outcome != "reference_fails" and group not in exclude:
      passed[group].append(outcome == "pass")
  total = sum(sizes[g] for g in passed)
  return sum(sizes[g] * np.mean(v) for g, v in passed.items()) / max(total, 1)


def summary_table(results) -> str:
  """Counts per outcome, the estimated pass fraction, every failing group."""
  counts = collections.Counter(outcome for _, outcome, _ in results.values())
  counted = sum(n for outcome, n in counts.items() if outcome != "reference_fails")
  lines = [f"{len(results)} records run; {counted} counted (jax.jit runs them on this host)"]
  for outcome in ("pass", "unsupported", "out_of_memory", "wrong", "crash", "reference_fails"):
    share = f" ({100 * counts[outcome] / max(counted, 1):.1f} %)" if outcome != "reference_fails" else ""
    lines.append(f"  {outcome:16s} {counts[outcome]:5d}{share}")
  lines.append(f"estimated pass fraction of all {sum(group_sizes().values())} records: "
               f"{100 * estimated_pass_fraction(results):.1f} %; without the groups being "
               f"set aside: {100 * estimated_pass_fraction(results, IN_PROGRESS_GROUPS):.1f} %")
  by_group = collections.defaultdict(list)
  for name, (group, outcome, detail) in sorted(results.items()):
    if outcome not in ("pass", "reference_fails"):
      by_group[(outcome, group)].append((name, detail))
  sizes = group_sizes()
  lines.append("")
  lines.append("| outcome | group | failing / run (of all) | first message |")
  lines.append("|---|---|---:|---|")
  for (outcome, group), members in sorted(by_group.items()):
    run = sum(g == group for g, _, _ in results.values())
    lines.append(f"| {outcome} | {group} | {len(members)} / {run} ({sizes[group]}) | "
                 f"{members[0][1][:110]} |")
  return "\n".join(lines)


@pytest.mark.slow
class LaxRecordsTest(chex.TestCase, parameterized.TestCase):

  def test_lax_records_pass_or_clearly_unsupported(self):
    results = run_records()
    table = summary_table(results)
    # Every record either passes or fails with the clear unsupported error.
    bad = {name: detail for name, (_, outcome, detail) in results.items()
           if outcome in ("wrong", "crash") and name not in KNOWN_FAILURES}
    self.assertEqual(bad, {}, msg=table)
    self.assertGreaterEqual(estimated_pass_fraction(results, IN_PROGRESS_GROUPS),
                            _PASS_FRACTION, msg=table)


if __name__ == "__main__":
  if "--summary" in sys.argv:
    jax.config.update("jax_enable_x64", False)
    table = summary_table(run_records("--all" in sys.argv, stream=sys.stderr))
    print(table)
  else:
    absltest.main()
