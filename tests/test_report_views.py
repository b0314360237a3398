"""The report's program tree, time axis (timeline, trace.json), vertex types
and per-step tile runs, on programs lowered from JAX with loops and
conditionals."""

import json
import os

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.lowering import program as P
from ipu_jax.lowering.control_tree import control_tree
from ipu_jax.report import trace as trace_lib
from ipu_jax.report.data import expand_runs

_ROWS = 12


def _looped(x, w):
  """A scan of 5 trips, a nested fori_loop of 3, then a cond."""

  def trip(carry, _):
    def inner(_, c):
      return jnp.tanh(c @ w)
    return jax.lax.fori_loop(0, 3, inner, carry) * 0.5, None

  carry, _ = jax.lax.scan(trip, x, None, length=5)
  total = jax.lax.cond(carry.sum() > 0, lambda c: c * 2.0, lambda c: c - 1.0,
                       carry)
  return total.sum()


def _report(fn=_looped, num_ipus=1):
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  cfg.auto_select_ipus = num_ipus
  rng = np.random.default_rng(0)
  args = (rng.standard_normal((_ROWS, 20)).astype(np.float32),
          rng.standard_normal((20, 20)).astype(np.float32) / 5)
  return ipu_jax.jit(fn, config=cfg).lower(*args).report


def _nodes(node):
  yield node
  for child in node.get("children", []):
    yield from _nodes(child)


def _weighted(report):
  steps = report.data.steps
  return steps.weighted_cycles


def _step(name):
  return P.Superstep(name=name, op=name, reads=(), writes=(), fn=lambda: ())


class ControlTreeTest(parameterized.TestCase):
  """The shape the lowering records, on every kind of control program."""

  def test_every_control_kind_over_contiguous_step_ranges(self):
    program = P.Sequence(
        _step("a"),
        P.Sequence(_step("b"), _step("c")),  # merged into the parent
        P.Repeat(3, P.Sequence(_step("d"), _step("e"))),
        P.RepeatWhileTrue(_step("cond"), None, _step("body")),
        P.Switch(None, [(0, _step("zero")), (2, P.Sequence(_step("t1"), _step("t2")))],
                 _step("other")),
        P.If(None, _step("then")),
        P.Replicated(_step("r"), (("replica", 4),)))
    tree = control_tree(program)
    leaves = [node.name for node, _, _ in P.iter_steps(program)]
    self.assertEqual(tree["count"], len(leaves))
    kinds = [(n["kind"], n.get("branch"), n["first"], n["count"])
             for n in tree["children"]]
    self.assertEqual(kinds, [("steps", None, 0, 3), ("repeat", None, 3, 2),
                             ("repeat_while", None, 5, 2), ("switch", None, 7, 4),
                             ("if", None, 11, 1), ("replicated", None, 12, 1)])
    repeat, loop, switch, cond, replicated = tree["children"][1:]
    self.assertEqual(repeat["iterations"], 3)
    self.assertEqual([c.get("branch") for c in loop["children"]],
                     ["condition", "body"])
    self.assertEqual([(c.get("branch"), c["kind"], c["first"], c["count"])
                      for c in switch["children"]],
                     [("case 0", "steps", 7, 1), ("case 2", "steps", 8, 2),
                      ("default", "steps", 10, 1)])
    self.assertEqual([c.get("branch") for c in cond["children"]], ["then"])
    self.assertEqual(replicated["replicas"], 4)
    self.assertEqual(leaves[3:5], ["d", "e"])

  def test_rejects_what_is_not_a_program(self):
    with self.assertRaisesRegex(TypeError, "not a tile program"):
      control_tree(P.Sequence(object()))


class ProgramTreeTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.report = _report()

  def test_loops_carry_their_repeat_counts_nested(self):
    tree = self.report.program_tree()
    repeats = [n for n in _nodes(tree) if n["kind"] == "repeat"]
    self.assertEqual([n["iterations"] for n in repeats], [5, 3])
    outer, inner = repeats
    self.assertIn(inner, list(_nodes(outer)))
    self.assertEqual(outer["label"], "repeat ×5")
    # The inner loop runs once per trip of the outer one; its steps 15 times.
    self.assertEqual(inner["executions"], 5)
    executions = self.report.data.steps.executions
    first, last = inner["steps"]
    self.assertTrue(np.all(executions[first:last + 1] == 15))

  def test_conditional_has_both_branches(self):
    tree = self.report.program_tree()
    branches = [n for n in _nodes(tree) if n["kind"] in ("if", "switch")]
    self.assertLen(branches, 1)
    roles = sorted(c.get("branch") for c in branches[0]["children"])
    self.assertEqual(roles, ["case 0", "default"] if branches[0]["kind"] == "switch"
                     else ["else", "then"])

  def test_cycles_add_up_to_the_report_total(self):
    tree = self.report.program_tree()
    weighted = _weighted(self.report)
    self.assertAlmostEqual(tree["total_cycles"], self.report.total_cycles)
    for node in _nodes(tree):
      first, last = node["steps"] if node["steps"] else (0, -1)
      self.assertAlmostEqual(node["total_cycles"],
                             float(weighted[first:last + 1].sum()))
      children = node.get("children", [])
      if children:
        self.assertAlmostEqual(node["total_cycles"],
                               sum(c["total_cycles"] for c in children))
    # Every step is in exactly one run; self cycles over all nodes add up.
    runs = [n for n in _nodes(tree) if n["kind"] == "steps"]
    covered = sorted(i for n in runs for i in range(n["steps"][0], n["steps"][1] + 1))
    self.assertEqual(covered, list(range(self.report.num_supersteps)))
    self.assertAlmostEqual(sum(n["self_cycles"] for n in _nodes(tree)
                               if n["kind"] != "steps"),
                           self.report.total_cycles)

  def test_saved_report_has_the_same_tree_and_json_is_plain(self):
    directory = self.create_tempdir().full_path
    self.report.save(directory, plots=False, html=False)
    with open(os.path.join(directory, "report.json")) as f:
      document = json.load(f)
    self.assertEqual(document["program_tree"], self.report.program_tree())
    self.assertEqual(ipu_jax.load_report(directory).program_tree(),
                     self.report.program_tree())

  def test_a_profile_without_a_shape_gets_a_flat_tree(self):
    profile = self.report.profile
    control, profile.control = profile.control, None
    try:
      flat = ipu_jax.Report(profile).program_tree()
    finally:
      profile.control = control
    self.assertEqual([c["kind"] for c in flat["children"]], ["steps"])
    self.assertAlmostEqual(flat["total_cycles"], self.report.total_cycles)


class TimelineTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.report = _report()

  @parameterized.parameters(1, 2, 4, 10)
  def test_spans_are_end_to_end_and_end_at_the_total(self, unroll):
    layout = self.report.timeline(unroll=unroll)
    cycles = self.report.data.steps.cycles_per_execution
    ends = [s + cycles[i] * r for i, s, r in
            zip(layout.step, layout.start, layout.repeat)]
    # Each span starts where the last one (or a summary) ended.
    summaries = {round(s["start"], 6): s["cycles"] for s in layout.summaries}
    for end, start in zip(ends, layout.start[1:]):
      while round(end, 6) in summaries:
        end += summaries.pop(round(end, 6))
      self.assertAlmostEqual(end, start)
    self.assertAlmostEqual(layout.total_cycles, self.report.total_cycles)

  def test_loops_unroll_up_to_the_limit_and_summarise_the_rest(self):
    tree = self.report.program_tree()
    inner = [n for n in _nodes(tree) if n["kind"] == "repeat"][1]
    step = inner["steps"][0]
    for unroll, shown in ((2, 2 * 2), (3, 3 * 3), (10, 5 * 3)):
      layout = self.report.timeline(unroll=unroll)
      self.assertEqual(layout.step.count(step), shown, unroll)
      outer = [l for l in layout.loops if l["iterations"] == 5]
      self.assertLen(outer, 1)
      self.assertEqual(outer[0]["unrolled"], min(unroll, 5))
      rest = [s for s in layout.summaries if s["iterations"] == 5 - unroll]
      self.assertLen(rest, 1 if unroll < 5 else 0)

  def test_unroll_must_be_positive(self):
    with self.assertRaisesRegex(ValueError, "unroll must be at least 1"):
      self.report.timeline(unroll=0)


class TraceTest(parameterized.TestCase):

  @parameterized.parameters(1, 2)
  def test_trace_lays_out_trips_and_summaries_per_ipu(self, num_ipus):
    report = _report(num_ipus=num_ipus)
    events = report.trace()["traceEvents"]
    us_per_cycle = 1e6 / report.target.clock_hz
    layout = report.timeline()
    spans = [e for e in events if e["ph"] == "X" and e["tid"] != 3]
    # One span per laid-out step execution and phase, on the step's IPUs.
    steps = report.data.steps
    compute = [e for e in spans if e["tid"] == 2]
    self.assertLen(compute, sum(
        1 for i in layout.step for ipu in steps.ipus[i]
        if steps.compute_per_ipu[i, ipu] > 0))
    self.assertEqual([e["args"]["step"] for e in compute],
                     [i for i in layout.step for ipu in steps.ipus[i]
                      if steps.compute_per_ipu[i, ipu] > 0])
    end = max(e["ts"] + e["dur"] for e in events if e["ph"] == "X")
    self.assertAlmostEqual(end, report.total_cycles * us_per_cycle, places=3)
    program = [e for e in events if e["ph"] == "X" and e["tid"] == 3]
    loops = [e for e in program if e["cat"] == "loop"]
    summaries = [e for e in program if e["cat"] == "summary"]
    self.assertEqual({e["pid"] for e in program}, set(range(num_ipus)))
    self.assertIn("repeat ×5", {e["name"] for e in loops})
    self.assertIn("1 more iteration of repeat ×5", {e["name"] for e in summaries})
    threads = {e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    self.assertEqual(threads, {"sync", "exchange", "compute", "program"})
    # The live-memory counter follows the laid-out steps.
    counters = [e for e in events if e["ph"] == "C"]
    self.assertLen(counters, len(layout.step))
    self.assertEqual(trace_lib.trace_events(report.data), events)


class CodeletAndExchangeTest(chex.TestCase):

  def test_codelets_add_up_to_compute_cycles_and_code_memory(self):
    report = _report()
    rows = report.codelets()
    self.assertNotEmpty(rows)
    self.assertAlmostEqual(sum(r["cycles"] for r in rows), report.compute_cycles)
    code = report.memory_by_category["code"]
    self.assertEqual(sum(r["code_bytes"] for r in rows), int(code.sum()))
    vertex_state = report.memory_by_category["vertex_state"]
    self.assertEqual(sum(r["vertex_state_bytes"] for r in rows),
                     int(vertex_state.sum()))
    names = [r["codelet"] for r in rows]
    self.assertTrue(any("MatMul" in name for name in names), names)

  def test_per_step_tile_runs_round_trip_through_report_json(self):
    report = _report(num_ipus=2)
    directory = self.create_tempdir().full_path
    report.save(directory, plots=False, html=False)
    with open(os.path.join(directory, "report.json")) as f:
      document = json.load(f)
    n = report.target.num_tiles
    for row, step in zip(document["steps"], report.profile.steps):
      np.testing.assert_array_equal(
          expand_runs(row["exchange_bytes_in_tiles"], n), step.exchange_bytes_in)
      np.testing.assert_array_equal(
          expand_runs(row["exchange_bytes_out_tiles"], n), step.exchange_bytes_out)
      scratch = expand_runs(row["scratch_bytes_tiles"], n)
      np.testing.assert_array_equal(
          scratch + step.exchange_bytes_in,
          step.temporary_bytes if step.temporary_bytes is not None
          else step.exchange_bytes_in)
    loaded = ipu_jax.load_report(directory)
    self.assertEqual(loaded.codelets(), report.codelets())


  def test_summary_names_both_memory_totals(self):
    report = _report()
    summary = report.summary()
    live = report.live_over_program
    step = int(np.argmax(live))
    self.assertIn(f"Device peak:           {int(live[step]):,} B", summary)
    self.assertIn(f"live on all tiles at superstep {step} ", summary)
    total = int(report.memory_per_tile.sum())
    self.assertRegex(summary, rf"Total over device: +{total:,} B.*: the sum of "
                     r"each tile's own peak")
    self.assertGreater(total, int(live[step]))

  def test_page_leaves_out_tile_runs_past_its_budget(self):
    from unittest import mock
    from ipu_jax.report import html as html_lib
    report = _report()
    payload = html_lib.report_payload(report)
    runs = sum(len(step) for column in payload["tile_exchange"].values()
               for step in column)
    self.assertGreater(runs, 0)
    with mock.patch.object(html_lib, "HTML_MAX_TILE_RUNS", runs - 1):
      self.assertIsNone(html_lib.report_payload(report)["tile_exchange"])
    with mock.patch.object(html_lib, "HTML_MAX_TILE_RUNS", runs):
      self.assertIsNotNone(html_lib.report_payload(report)["tile_exchange"])


if __name__ == "__main__":
  absltest.main()
