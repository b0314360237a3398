"""experiments/calibration.py: the sourced cases pass, the explained ones say why."""

from absl.testing import absltest
from absl.testing import parameterized
import chex

from experiments import calibration


def _case(name):
  return next(c for c in calibration.all_cases() if c.name == name)


class CalibrationTest(chex.TestCase, parameterized.TestCase):

  @parameterized.parameters("reduce/float32/64x100", "reduce/float16/64x96",
                            "reduce/float32/64x99", "reduce/float32/4096",
                            "reduce/float16/4096", "reduce_max/float32/64x100",
                            "reduce_max/float16/64x96", "reduce_min/float32/4096",
                            "reduce_max/float16/4095", "reduce_mul/float32/64x99",
                            "exchange/latency/4B", "sync/on_chip", "sync/2_ipus")
  def test_sourced_case_within_tolerance(self, name):
    row = calibration.run_case(_case(name), tolerance=0.15)
    self.assertTrue(row["passed"], row)
    self.assertEqual(row["kind"], "poplibs")

  def test_congestion_is_explained_not_tuned(self):
    row = calibration.run_case(_case("exchange/congestion"), tolerance=0.15)
    # The static model has no congestion term: a full-load exchange of one
    # word per tile costs what one word between two tiles costs.
    self.assertEqual(row["estimate"], 1.0)
    self.assertFalse(row["passed"])
    self.assertIn("no congestion", row["note"])

  def test_every_case_has_a_source(self):
    for case in calibration.all_cases():
      self.assertTrue(case.source, case.name)
      self.assertIn(case.kind, ("poplibs", "datasheet", "measured", "unavailable"), case.name)


if __name__ == "__main__":
  absltest.main()
