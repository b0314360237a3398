"""The pod suite's measured rows, its ratios and the calibration table / plot built from them."""

import json
import math
import os
import subprocess
import sys
import tempfile

import chex
from absl.testing import absltest, parameterized

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(name, rate, step, breakdown, sequences=None, fits=True):
  """What a runner's ``--json_out`` holds, as the suite records it."""
  from experiments import benchmark_pod
  result = {"samples_per_second": rate, "step_seconds": step, "breakdown": breakdown,
            "fits": fits, "per_ipu_peak_bytes": 1, "lower_seconds": 1.0,
            "peak_rss_bytes": 2**30, "system": "bow-pod16"}
  if sequences is not None:
    result["sequences_per_second"] = sequences
  return benchmark_pod.row_result(name, result, wall=10.0)


def _synthetic_rows():
  """A BERT row 20 % slow (compute-bound), a ResNet row 10 % fast, a BERT-Base row 5 % slow."""
  from experiments import benchmark_pod
  bert = "table_bert_large_ph1_bow_pod16"
  resnet = "table_resnet_bow_pod16"
  base = "table_bert_base_ph1_bow_pod16"
  return [
      # Sequences/s is what a BERT row compares: samples/s (packs) is half of it here.
      _result(bert, 0.4 * benchmark_pod.MEASURED[bert], 1.0,
              {"steady_state": 0.7, "recomputation": 0.25, "ramp": 0.05},
              sequences=0.8 * benchmark_pod.MEASURED[bert]),
      _result(resnet, 1.1 * benchmark_pod.MEASURED[resnet], 0.1,
              {"ramp": 0.08, "recomputation": 0.015, "gradient_reduction": 0.005}),
      _result(base, 0.95 * benchmark_pod.MEASURED[base], 2.0,
              {"steady_state": 1.5, "recomputation": 0.5},
              sequences=0.95 * benchmark_pod.MEASURED[base], fits=False),
  ]


class PodSuiteRatioTest(chex.TestCase):

  def test_bert_rows_compare_sequences_per_second(self):
    from experiments import benchmark_pod
    text = benchmark_pod.table(_synthetic_rows())
    self.assertIn("| table_bert_large_ph1_bow_pod16 | BERT-Large | 3,622 | 4,527 | sequences/s "
                  "| 0.800 |", text)
    self.assertIn("| table_resnet_bow_pod16 | ResNet-50 | 46,232 | 42,029 | images/s | 1.100 |",
                  text)
    geomean = math.exp((math.log(0.8) + math.log(1.1) + math.log(0.95)) / 3)
    self.assertIn(f"geometric-mean ratio {geomean:.3f}, worst 0.800 (3 measured rows)", text)
    self.assertIn("  ResNet-50: geometric-mean ratio 1.100, worst 1.100 (1 rows)", text)

  def test_every_measured_row_runs_a_known_preset_on_a_known_system(self):
    from experiments import benchmark_pod, bert_presets, resnet_presets
    from ipu_jax.kernels.systems import SYSTEM_PRESETS
    self.assertLessEqual(set(benchmark_pod.MEASURED), set(benchmark_pod.ROWS))
    # The MLPerf v1.1 / v2.0 BERT presets are another change's (bert_presets.py).
    pending = {"mlperf_v1_1_pod16", "mlperf_v1_1_pod64", "mlperf_v1_1_pod128",
               "mlperf_v2_bow_pod16", "mlperf_v2_bow_pod64", "mlperf_v2_bow_pod128",
               "mlperf_v2_bow_pod256"}
    for name in benchmark_pod.MEASURED:
      args = dict(a.lstrip("-").split("=", 1) for a in benchmark_pod.ROWS[name])
      runner = benchmark_pod.RUNNERS.get(name, "experiments.bert_pretraining")
      presets = (resnet_presets if runner == "experiments.resnet_training"
                 else bert_presets).PRESETS
      if args["config"] in pending and args["config"] not in presets:
        continue
      self.assertIn(args["config"], presets, name)
      if "system" in args:
        self.assertIn(args["system"], SYSTEM_PRESETS, name)
    self.assertEqual({benchmark_pod.family(n) for n in benchmark_pod.MEASURED},
                     {"BERT-Large", "BERT-Base", "ResNet-50"})


def _runner_flags(args):
  """The BERT runner's flags for a row's arguments, its preset applied."""
  from absl import flags
  from experiments import bert_pretraining
  f = bert_pretraining.define_flags(flags.FlagValues())
  f(["bert_pretraining", *args])
  bert_pretraining.apply_preset(f)
  return f


class TableRowsRunTheirExamplesTest(parameterized.TestCase):
  """Each BERT table row runs the configuration of the example that measured it.

  The figures are the examples' (graphcore/examples, commit 3cc8f81f;
  docs/published_tables.md): TensorFlow 2 ``nlp/bert/tensorflow2/configs/*.json``
  (``matmul_available_memory_proportion_per_pipeline_stage``,
  ``replicated_tensor_sharding``, ``bert_config.vocab_size``,
  ``embedding_serialization_factor``, else ``utilities/options.py``'s 2;
  ``optimizer_state_offchip`` True; ``keras_extensions/optimization.py``'s
  LAMB: m and v float32, debiased) and PyTorch ``configs_pretraining.yml``
  ``pretrain_large_512`` / ``_POD64`` (``matmul_proportion``,
  ``replicated_tensor_sharding`` True, vocabulary 30,522,
  ``embedding_serialization_factor`` 2, ``optimizer_state_offchip`` True;
  ``optimization.py``'s LAMB: m and v float32, bias-corrected).
  """

  @parameterized.named_parameters(
      ("tf2_large_pod16", "table_bert_large_ph1_bow_pod16", [0.10, 0.19, 0.20, 0.25], False,
       30400, 2, 2040),
      ("tf2_large_pod64", "table_bert_large_ph1_bow_pod64", [0.10, 0.19, 0.20, 0.20], True,
       30400, 5, 520),
      ("tf2_base_pod16", "table_bert_base_ph1_bow_pod16", [0.28, 0.26, 0.28, 0.28], False,
       30400, 2, 510),
      ("pytorch_ph2_pod16", "table_bert_large_ph2_bow_pod16", [0.10, 0.15, 0.15, 0.15], True,
       30522, 2, 510),
      ("pytorch_ph2_pod64", "table_bert_large_ph2_bow_pod64", [0.13, 0.19, 0.19, 0.19], True,
       30522, 2, 130),
  )
  def test_row_runs_its_examples_config(self, row, proportions, rts, vocab, serialization,
                                        accumulation):
    import jax
    import numpy as np
    from experiments import benchmark_pod, bert_pretraining
    f = _runner_flags(benchmark_pod.ROWS[row])
    mcfg = bert_pretraining.model_config(f.model, f.dropout, f.decoder_serialization, f.dtype,
                                         f.vocab_size, f.attention_dropout)
    _, mapping = bert_pretraining.stage_layout(f, mcfg.layers)
    bert_pretraining.check_flags(f, mcfg.layers)
    cfg = bert_pretraining.ipu_config(f, bert_pretraining.num_ipus(mapping))
    self.assertEqual(list(cfg.matmuls.available_memory_proportion), proportions)
    self.assertEqual((cfg.streaming.replicated_tensor_sharding,
                      cfg.streaming.offload_optimizer_state), (rts, True))
    self.assertEqual((mcfg.vocab_size, mcfg.decoder_serialization, f.accumulation),
                     (vocab, serialization, accumulation))
    self.assertEqual((cfg.matmuls.partials_type, mcfg.dropout, mcfg.attention_dropout),
                     ("float16", 0.1, 0.0))
    # LAMB as both examples build it: m and v float32, bias-corrected.
    state = bert_pretraining.make_optimizer(f).init({"w": np.zeros((4, 8), f.dtype)})[0]
    self.assertEqual({np.dtype(x.dtype).name for x in jax.tree.leaves((state.mu, state.nu))},
                     {"float32"})
    self.assertTrue(f.lamb_bias_correction)


class CalibrationTableTest(parameterized.TestCase):

  def _run(self, rows, *extra):
    tmp = tempfile.mkdtemp()
    results = os.path.join(tmp, "pod.json")
    with open(results, "w") as f:
      json.dump({"suite": "pod", "results": rows + [{"workload": "phase1_pod16",
                                                      "error": "boom"}]}, f)
    proc = subprocess.run([sys.executable, "-m", "experiments.calibration_table",
                           f"--results={results}", *extra], capture_output=True, text=True,
                          cwd=_ROOT, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
    return proc.stdout, tmp

  def test_table_rows_ratios_and_the_largest_part(self):
    out, tmp = self._run(_synthetic_rows(), "--plot=" + os.path.join(
        tempfile.gettempdir(), "unused.png"))
    lines = out.splitlines()
    bert = next(line for line in lines if "table_bert_large_ph1_bow_pod16" in line)
    # 20 % slow over a 1 s step: 200 ms over; the ramp (50 ms) cannot hold it, the two
    # largest parts must.
    self.assertIn("| BERT-Large |", bert)
    self.assertIn("| bow-pod16 | 4,527 sequences/s | 3,622 | 0.800 (outside ±15 %) |", bert)
    self.assertIn("200.0 ms over (20% of the step): in steady_state + recomputation (950.0 ms); "
                  "the other parts hold 50.0 ms", bert)
    resnet = next(line for line in lines if "table_resnet_bow_pod16" in line)
    self.assertIn("| 1.100 |", resnet)
    self.assertIn("estimate 10.0 ms short of the measured step (10%): time no part shows "
                  "(the parts outside the micro-batches' compute hold 5.0 ms); largest part "
                  "ramp 80.0 ms (80% of the step)", resnet)
    base = next(line for line in lines if "table_bert_base_ph1_bow_pod16" in line)
    self.assertIn("| 0.950 (does not fit) |", base)
    geomean = math.exp((math.log(0.8) + math.log(1.1) + math.log(0.95)) / 3)
    self.assertIn(f"geometric-mean ratio {geomean:.3f}, worst 0.800 (3 measured rows)", out)
    self.assertNotIn("phase1_pod16 |", out)  # the failed row is left out

  def test_writes_the_markdown_and_a_png(self):
    tmp = tempfile.mkdtemp()
    png, md = os.path.join(tmp, "plot.png"), os.path.join(tmp, "table.md")
    out, _ = self._run(_synthetic_rows(), f"--plot={png}", f"--markdown_out={md}")
    self.assertIn(f"wrote {png}", out)
    with open(png, "rb") as f:
      self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    with open(md) as f:
      self.assertIn("| family | configuration | system | measured | estimate | ratio "
                    "| largest part of the difference |", f.read())

  def test_no_measured_rows_is_a_usage_error(self):
    tmp = tempfile.mkdtemp()
    results = os.path.join(tmp, "pod.json")
    with open(results, "w") as f:
      json.dump({"results": [{"workload": "phase1_pod16", "error": "boom"}]}, f)
    proc = subprocess.run([sys.executable, "-m", "experiments.calibration_table",
                           f"--results={results}"], capture_output=True, text=True, cwd=_ROOT,
                          timeout=300)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("No measured rows without an error", proc.stderr)


if __name__ == "__main__":
  absltest.main()
