"""experiments.resnet_training: the ResNet runner's estimate, its flag errors and a real step.

A tiny ResNet on 16 tiles only; the MLPerf presets (1,472 tiles) are run by
hand or by the benchmark's pod suite (docs/published_resnet.md).
"""

import json
import os

import chex
import jax
import numpy as np
from absl import app, flags
from absl.testing import absltest, parameterized

import testing_utils


def _flags(*argv):
  from experiments import resnet_training
  fv = resnet_training.define_flags(flags.FlagValues())
  fv(["resnet_training"] + list(argv))
  return fv


class ResNetRunnerTest(chex.TestCase, parameterized.TestCase):

  def test_estimate_writes_the_pod_runners_keys(self):
    from experiments import resnet_training
    # Into a directory not there yet: made before the run (it used to fail
    # there, after the estimate).
    out = os.path.join(self.create_tempdir().full_path, "new", "tiny.json")
    resnet_training.run(_flags("--config=tiny_check", "--estimate_only", f"--json_out={out}"))
    with open(out) as f:
      result = json.load(f)
    for key in ("samples_per_second", "step_seconds", "breakdown", "fits",
                "per_ipu_peak_bytes", "lower_seconds", "peak_rss_bytes"):
      self.assertIn(key, result)
    self.assertTrue(result["fits"])
    self.assertLen(result["per_ipu_peak_bytes"], 1)  # one IPU a replica
    # G x R x micro-batch images a step.
    self.assertAlmostEqual(result["samples_per_second"] * result["step_seconds"], 2 * 2 * 2,
                           places=6)
    self.assertAlmostEqual(sum(result["breakdown"].values()), result["step_seconds"],
                           delta=1e-9 + 1e-6 * result["step_seconds"])
    self.assertGreater(result["breakdown"]["gradient_reduction"], 0.0)
    # One update an execution by default (PopTorch's device_iterations 1):
    # the host's 53 ms an execution on the tiny_check preset's pod4.
    self.assertAlmostEqual(result["breakdown"]["execution_overhead"], 53e-3, places=12)

  def test_updates_per_execution_share_the_hosts_time(self):
    from experiments import resnet_training
    one = resnet_training.run(_flags("--config=tiny_check", "--estimate_only"))
    many = resnet_training.run(_flags("--config=tiny_check", "--estimate_only",
                                      "--updates_per_execution=100"))
    self.assertAlmostEqual(many["breakdown"]["execution_overhead"], 53e-5, places=12)
    self.assertAlmostEqual(one["step_seconds"] - many["step_seconds"], 0.99 * 53e-3, places=9)

  def test_more_replicas_on_a_pod_cost_more_reduction(self):
    # The all-reduce over the system's links grows with the replicas.
    from experiments import resnet_training
    small = resnet_training.run(_flags("--config=tiny_check", "--estimate_only",
                                       "--replicas=2", "--system=pod16"))
    large = resnet_training.run(_flags("--config=tiny_check", "--estimate_only",
                                       "--replicas=16", "--system=pod16"))
    self.assertGreater(large["breakdown"]["gradient_reduction"],
                       small["breakdown"]["gradient_reduction"])

  @parameterized.named_parameters(
      ("system", ["--system=pod17"], r"--system='pod17' is not valid; valid values are \[.*"
                                     r"'bow-pod16'"),
      ("dtype", ["--dtype=bfloat16"], r"--dtype='bfloat16' .* valid values are "
                                      r"\['float32', 'float16'\]"),
      ("optimizer", ["--optimizer=adam"], r"--optimizer='adam' .* \['momentum', 'lars', 'sgd'\]"),
      ("config", ["--config=pod16"], r"--config='pod16' is not a preset; valid presets are "
                                     r"\[.*'mlperf_v1_1_pod16'"),
      ("replicas", ["--config=tiny_check", "--system=pod4", "--replicas=8"], r"--system=pod4"),
      ("split", ["--config=tiny_check", "--pipeline_splits=stage9/unit1/relu"],
       r"'stage9/unit1/relu' names no unit .* valid units are \['stage1_unit1', "
       r"'stage2_unit1'\]"),
      ("image", ["--config=tiny_check", "--image_size=8"], r"--image_size=8 .* >= 16"),
      ("conv_proportion", ["--config=tiny_check", "--conv_proportion=0"],
       r"--conv_proportion=0.0 must be in \(0, 1\]"),
      ("updates", ["--config=tiny_check", "--updates_per_execution=0"],
       r"--updates_per_execution=0 must be >= 1"),
      ("partials", ["--config=tiny_check", "--partials_type=half"],
       r"--partials_type='half' .* \['float32', 'float16'\]"),
      ("json_out", ["--config=tiny_check", "--json_out=/"], r"--json_out=/ is a directory"),
      ("report_dir", ["--config=tiny_check", f"--report_dir={os.path.abspath(__file__)}"],
       r"--report_dir=.*test_resnet_runner.py: .* is a file, not a directory"),
  )
  def test_bad_flag_names_the_field_and_valid_values(self, argv, message):
    from experiments import resnet_training
    with self.assertRaisesRegex(app.UsageError, message):
      resnet_training.run(_flags(*argv, "--estimate_only"))

  def test_one_training_step_equals_plain_jit(self):
    # One real step of the tiny ResNet (2 replicas x G 2, batch norm, momentum)
    # against plain jax.jit accumulation of the same micro-batches.
    from experiments import resnet_training
    result = resnet_training.run(_flags("--config=tiny_check", "--check"))
    self.assertLess(result["max_relative_difference"], 1e-5)
    trained, stats = result["trained"]
    self.assertTrue(all(np.all(np.isfinite(np.asarray(x)))
                        for x in jax.tree_util.tree_leaves((trained, stats))))
    # The batch-norm statistics moved away from their initial zeros and ones.
    means = [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(stats)
             if "mean" in jax.tree_util.keystr(path)]
    self.assertGreater(max(float(np.max(np.abs(m))) for m in means), 1e-4)


def _conv_working_bytes(pipe) -> int:
  """The most working memory any convolution step of the pipeline needs on a tile."""
  return max(bytes_ for report in pipe.report.stage_reports.values()
             for op, bytes_ in report.temporary_memory_by_op().items() if "conv" in op)


class ResNetOptionsTest(chex.TestCase, parameterized.TestCase):
  """Where the examples' proportion and partials go (ipu_config's sources)."""

  @parameterized.named_parameters(
      # MLPerf TF: available_memory_proportion -> convolutions only,
      # enable_half_partials -> convolutions and matmuls.
      ("mlperf_v1_pod16", "mlperf_v1_pod16", 0.15, 0.6, "float16"),
      ("mlperf_v1_pod64", "mlperf_v1_pod64", 0.14, 0.6, "float16"),
      ("mlperf_v2_bow_pod256", "mlperf_v2_bow_pod256", 0.15, 0.6, "float16"),
      # PopTorch: setAvailableMemoryProportion covers both; half_partial.
      ("poptorch_pod16", "poptorch_pod16", 0.16, 0.16, "float16"),
  )
  def test_presets_set_the_examples_proportions_and_partials(self, preset, conv, matmul,
                                                             partials):
    from experiments import resnet_training
    f = _flags(f"--config={preset}", "--estimate_only")
    resnet_training.apply_preset(f)
    cfg = resnet_training.ipu_config(f)
    self.assertEqual(cfg.convolutions.available_memory_proportion, conv)
    self.assertEqual(cfg.matmuls.available_memory_proportion, matmul)
    self.assertEqual(cfg.matmuls.partials_type, partials)

  def test_conv_proportion_plans_the_convolutions_and_matmul_proportion_does_not(self):
    from experiments import resnet_models, resnet_training

    def conv_bytes(*argv):
      f = _flags("--config=tiny_check", "--estimate_only", "--image_size=32", *argv)
      resnet_training.apply_preset(f)
      resnet_training.check_flags(f)
      mcfg = resnet_training.model_config(f)
      pipe, _, _, params, state = resnet_training.build_pipeline(f, mcfg)
      result = resnet_training.estimate(f, pipe, params, state, mcfg)
      self.assertGreater(result["samples_per_second"], 0.0)
      return _conv_working_bytes(pipe)

    default = conv_bytes()
    self.assertLess(conv_bytes("--conv_proportion=0.002"), default)
    self.assertEqual(conv_bytes("--matmul_proportion=0.002"), default)


def _tiny_float16_estimate(fused: bool) -> dict:
  """The tiny ResNet's float16 estimate with the fused or Flax's batch norm."""
  import dataclasses
  from experiments import resnet_training
  f = _flags("--config=tiny_check", "--estimate_only", "--dtype=float16", "--image_size=32",
             "--micro_batch=4")
  resnet_training.apply_preset(f)
  mcfg = dataclasses.replace(resnet_training.model_config(f), fused_batch_norm=fused)
  pipe, _, _, params, state = resnet_training.build_pipeline(f, mcfg)
  return resnet_training.estimate(f, pipe, params, state, mcfg)


class FusedBatchNormTest(chex.TestCase):
  """The IPU's fused batch norm: Flax's numbers, float16 residuals only."""

  def test_loss_gradients_and_statistics_equal_flax_batch_norm(self):
    import dataclasses
    from flax import nnx
    from experiments import resnet_models
    results = []
    for fused in (True, False):
      cfg = dataclasses.replace(resnet_models.tiny_resnet(), fused_batch_norm=fused)
      # An abstract model with NumPy-drawn weights: both sides get the same
      # values without Flax's eager initialisers (a truncated-normal sampler
      # compiled per kernel shape, ~7 s of CPU); the check needs equal weights,
      # not Flax's particular ones.
      loss_fn, params, state = resnet_models.make_loss(
          nnx.eval_shape(lambda: resnet_models.ResNet(cfg, rngs=nnx.Rngs(0))))
      params, state = (testing_utils.numpy_weights(params, seed=0),
                       testing_utils.numpy_weights(state, seed=0))
      batch = jax.tree_util.tree_map(lambda b: b[0],
                                     resnet_models.synthetic_batches(cfg, 1, 4, 16, seed=1))
      (loss, stats), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
          params, batch, state)
      results.append(jax.tree_util.tree_map(np.asarray, (loss, stats, grads)))
    chex.assert_trees_all_close(results[0], results[1], rtol=1e-4, atol=1e-5)
    # Weights that give real gradients (all-zero ones would make both sides agree trivially).
    largest = max(float(np.abs(g).max()) for g in jax.tree_util.tree_leaves(results[0][2]))
    self.assertGreater(largest, 0.1)

  def test_float16_backward_needs_less_memory_than_flax_batch_norm(self):
    # Flax's float32 copies of the activations live from the recomputed
    # forward to the backward; the fused one keeps x (float16) and statistics.
    fused, flax_bn = _tiny_float16_estimate(True), _tiny_float16_estimate(False)
    self.assertLess(fused["per_ipu_peak_bytes"][0], 0.8 * flax_bn["per_ipu_peak_bytes"][0])
    self.assertGreater(fused["samples_per_second"], 0.0)


class ResNetLayoutTest(chex.TestCase):

  def test_mlperf_splits_make_seven_stages_in_either_naming(self):
    # v1.x names units b<stage>/<unit from 0>, v2.0 stage<s>/unit<u from 1>.
    from experiments import resnet_models, resnet_presets
    cfg = resnet_models.resnet50()
    v2 = resnet_models.stage_assignment(cfg, resnet_presets.SPLITS)
    v1 = resnet_models.stage_assignment(cfg, ["b1/0/relu", "b1/2/relu", "b2/0/relu",
                                              "b2/2/relu", "b3/0/relu", "b3/3/relu"])
    self.assertEqual(v1, v2)
    self.assertEqual(v2["stem"], 0)
    self.assertEqual(v2["head"], 6)
    self.assertEqual(v2["stage2_unit4"], v2["stage3_unit1"])


class PodSuiteTest(chex.TestCase):

  def test_resnet_rows_run_presets_and_print_ratios(self):
    from experiments import benchmark_pod, resnet_presets
    resnet_rows = [name for name in benchmark_pod.ROWS if "resnet" in name]
    self.assertLen(resnet_rows, 13)
    for name in resnet_rows:
      self.assertEqual(benchmark_pod.RUNNERS[name], "experiments.resnet_training")
      preset = benchmark_pod.ROWS[name][0].split("=", 1)[1]
      self.assertIn(preset, resnet_presets.PRESETS)
    self.assertLessEqual(set(benchmark_pod.MEASURED), set(benchmark_pod.ROWS))
    # The BERT rows still run the BERT runner.
    self.assertNotIn("mlperf_v1_pod16", benchmark_pod.RUNNERS)
    rows = [dict(workload=name, wall_s=1.0, lower_seconds=1.0, peak_rss_bytes=2**30, fits=True,
                 samples_per_second=value * scale, step_seconds=0.1, within_budget=True,
                 measured_samples_per_second=value, ratio=scale, error=None)
            for (name, value), scale in zip(sorted(benchmark_pod.MEASURED.items())[:2],
                                            (0.5, 2.0))]
    text = benchmark_pod.table(rows)
    self.assertIn("| 0.500 |", text)
    self.assertIn("geometric-mean ratio 1.000, worst 0.500 (2 measured rows)", text)


if __name__ == "__main__":
  absltest.main()
