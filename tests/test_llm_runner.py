"""experiments.llm: the LLM runner's estimate, its bounds, --check and its errors.

Small configurations only (16 tiles an IPU); the GPT-J / GPT-3 / Llama-2
presets are run by hand (docs/llm.md).
"""

import json
import os
import subprocess
import sys

import chex
from absl import flags
from absl.testing import absltest, parameterized

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(*argv):
  from experiments import llm
  fv = llm.define_flags(flags.FlagValues())
  fv(["llm"] + list(argv))
  return fv


class LLMRunnerTest(chex.TestCase, parameterized.TestCase):

  def test_estimate_json_keys_and_bounds(self):
    from experiments import llm
    out = os.path.join(self.create_tempdir().full_path, "tiny.json")
    llm.run(_flags("--config=tiny_check", "--estimate_only", f"--json_out={out}"))
    with open(out) as f:
      result = json.load(f)
    for key in ("samples_per_second", "step_seconds", "breakdown", "fits",
                "per_ipu_peak_bytes", "lower_seconds", "peak_rss_bytes", "tokens_per_second",
                "streaming_bytes_per_step", "bounds", "closest_bound"):
      self.assertIn(key, result)
    self.assertIn("streaming", result["breakdown"])
    self.assertTrue(result["fits"])
    self.assertGreater(result["streaming_bytes_per_step"], 0)
    bounds = result["bounds"]
    # The estimate can be no faster than the IPUs' peak FLOPs nor their
    # Streaming Memory bandwidth allow.
    self.assertLess(result["tokens_per_second"], bounds["peak_flops_tokens_per_second"])
    self.assertLess(result["tokens_per_second"], bounds["streaming_tokens_per_second"])
    self.assertAlmostEqual(result["tokens_per_second"],
                           result["tokens_per_step"] / result["step_seconds"], delta=1e-6 *
                           result["tokens_per_second"])

  def test_shared_overriding_flags(self):
    # --replicas and --gradient_accumulation, as the BERT and ResNet runners take them.
    from experiments import llm
    result = llm.run(_flags("--config=tiny_check", "--replicas=1", "--gradient_accumulation=3",
                            "--estimate_only"))
    self.assertEqual((result["replicas"], result["gradient_accumulation"],
                      result["micro_batch"]), (1, 3, 2))
    self.assertEqual(result["tokens_per_step"], 3 * 1 * 2 * 16)  # G x replicas x micro x seq
    self.assertAlmostEqual(result["samples_per_second"] * result["step_seconds"], 6.0)
    from absl import app
    with self.assertRaisesRegex(app.UsageError, "--global_batch=8 and --gradient_accumulation=3"):
      llm.run(_flags("--config=tiny_check", "--global_batch=8", "--gradient_accumulation=3",
                     "--estimate_only"))

  def test_inference_estimate_below_bounds(self):
    from experiments import llm
    result = llm.run(_flags("--model=llama2", "--mode=inference", "--rotary_dim=32",
                            "--tensor_parallel=2", "--data_parallel=1", "--micro_batch=1",
                            "--global_batch=1", "--layers=2", "--estimate_only"))
    bounds = result["bounds"]
    self.assertLess(result["tokens_per_second"], bounds["peak_flops_tokens_per_second"])
    self.assertLess(result["tokens_per_second"], bounds["streaming_tokens_per_second"])
    self.assertGreater(result["breakdown"]["streaming"], 0.0)

  @parameterized.named_parameters(
      ("gpt3", "gpt3_175b_pretrain_pod256", 0.1), ("gptj", "gptj_6b_finetune_pod16", 0.2),
      ("llama_pod2", "llama2_7b_inference_pod2", 0.1))
  def test_preset_plans_matmuls_under_published_memory_proportion(self, config, expected):
    # PopXL's configs set execution.available_memory_proportion; without it
    # GPT-3's head backward planned its matmul partials under Poplar's 0.6
    # and overflowed (docs/llm.md#gpt-3-175b).
    from experiments import llm
    fv = _flags(f"--config={config}", "--estimate_only")
    llm.apply_preset(fv)
    self.assertEqual(llm.ipu_config(fv).matmuls.available_memory_proportion, expected)

  def test_check_passes_and_can_fail(self):
    from experiments import llm
    good = llm.run(_flags("--config=tiny_check", "--check", "--steps=2"))
    self.assertTrue(good["check_passed"], good["max_relative_difference"])
    self.assertLess(good["max_relative_difference"], 1e-5)
    # The same comparison against a plain-JAX run with another learning rate fails.
    bad = llm.run(_flags("--config=tiny_check", "--check", "--steps=1", "--check_perturb=0.5"))
    self.assertFalse(bad["check_passed"])

  @parameterized.named_parameters(
      ("tp_heads", ["--config=tiny_check", "--tensor_parallel=3", "--estimate_only"],
       "--tensor_parallel"),
      ("batch", ["--config=tiny_check", "--global_batch=6", "--estimate_only"],
       "--global_batch"),
      # These three were tracebacks from LLMConfig / IPUConfig, naming their fields.
      ("heads", ["--config=tiny_check", "--heads=3", "--tensor_parallel=1", "--estimate_only"],
       "--hidden=128 must be a multiple of --heads=3"),
      ("rotary", ["--config=tiny_check", "--model=gptj", "--rotary_dim=7", "--estimate_only"],
       "--rotary_dim=7 must be even and at most the head size --hidden / --heads = 32"),
      ("proportion", ["--config=tiny_check", "--available_memory_proportion=1.5",
                      "--estimate_only"], r"--available_memory_proportion=1.5 must be in \(0, 1\]"))
  def test_bad_flag_names_the_field(self, argv, field):
    from absl import app
    from experiments import llm
    with self.assertRaisesRegex(app.UsageError, field) as ctx:
      llm.run(_flags(*argv))
    if field == "--tensor_parallel":
      self.assertIn("1, 2, 4", str(ctx.exception))  # the valid values: divisors

  @parameterized.named_parameters(
      ("without_phases", ["--nophased", "--tensor_parallel=1"], "--phased"),
      # Phased but unsplit: a preset-shaped width whose block overflows 16 tiles.
      ("without_tp", ["--tensor_parallel=1", "--hidden=512", "--ffn=2048", "--seq=64",
                      "--max_positions=64"], "tensor parallelism"))
  def test_without_tp_or_phases_reports_out_of_memory(self, argv, remedy):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.llm", "--config=tiny_check", "--estimate_only"]
        + argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    self.assertEqual(proc.returncode, 1, proc.stderr[-2000:])
    self.assertIn("OutOfMemoryError", proc.stderr)
    self.assertIn("IPU 0", proc.stderr)
    self.assertIn(remedy, proc.stderr)
    self.assertNotIn("Traceback", proc.stderr)


class SequenceParallelModelTest(chex.TestCase, parameterized.TestCase):
  """``LLMConfig.sequence_parallel``: the models' numbers, and the runner's
  phases storing each IPU's block of the sequence."""

  @parameterized.parameters("gpt3", "gptj", "llama2")
  def test_loss_and_gradients_equal_the_unsplit_model(self, family):
    import dataclasses
    import jax
    import numpy as np
    from flax import nnx
    from experiments import llm_models
    tp = 2
    cfg = llm_models.LLMConfig(family=family, vocab_size=64, hidden=32, layers=2, heads=4,
                               ffn=64, max_positions=8, rotary_dim=4 if family != "gpt3" else 0)
    whole = llm_models.DecoderLM(cfg, rngs=nnx.Rngs(0))
    _, state = nnx.split(whole)
    graphdef, _ = nnx.split(llm_models.DecoderLM(
        dataclasses.replace(cfg, tp=tp, sequence_parallel=True), rngs=nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    labels = jax.random.randint(jax.random.key(2), (2, 8), 0, 64)

    def loss(gdef):
      return lambda params: nnx.merge(gdef, params)(ids, labels)
    # Jitted: run eagerly, vmap would compile each operation of the models on its own.
    want_loss, want_grads = jax.jit(jax.vmap(jax.value_and_grad(loss(nnx.split(whole)[0])),
                                             axis_name="tp"))(
        jax.tree.map(lambda a: a[None], state))
    got_loss, got_grads = jax.jit(jax.vmap(jax.value_and_grad(loss(graphdef)), axis_name="tp"))(
        llm_models.shard_state(state, tp))
    np.testing.assert_allclose(np.asarray(got_loss), np.asarray(want_loss[0]).repeat(tp),
                               rtol=1e-5)
    got = jax.tree.leaves(llm_models.unshard_state(got_grads))
    for g, w in zip(got, jax.tree.leaves(jax.tree.map(lambda a: a[0], want_grads))):
      w = np.asarray(w)
      np.testing.assert_allclose(np.asarray(g), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
    # Replicated weights (norms) get the same, full gradient on every shard.
    def same_on_shards(path, leaf):
      if llm_models.split_kind(path) == "replicated":
        np.testing.assert_allclose(np.asarray(leaf[1]), np.asarray(leaf[0]), rtol=1e-6)
    jax.tree_util.tree_map_with_path(same_on_shards, got_grads)

  def test_phases_stream_the_sequence_block(self):
    from experiments import llm
    base = ["--config=tiny_check", "--estimate_only", "--data_parallel=1", "--global_batch=4"]
    plain = llm.run(_flags(*base, "--norts_activations"))
    sp = llm.run(_flags(*base, "--sequence_parallel", "--norts_activations"))
    rts = llm.run(_flags(*base, "--rts_activations"))
    # A phase's input and output are [B, S / tp, H] an IPU: the same bytes
    # as RTS's 1/tp shard of [B, S, H], fewer than plain TP's whole one.
    self.assertEqual(sp["streaming_bytes_per_step"], rts["streaming_bytes_per_step"])
    self.assertLess(sp["streaming_bytes_per_step"], plain["streaming_bytes_per_step"])

  @parameterized.named_parameters(
      ("with_rts_activations", ["--rts_activations"], "--rts_activations"),
      ("seq_not_divisible", ["--seq=15", "--tensor_parallel=4"], "--seq=15"))
  def test_bad_sequence_parallel_flags(self, extra, field):
    from absl import app
    from experiments import llm
    with self.assertRaisesRegex(app.UsageError, field):
      llm.run(_flags("--config=tiny_check", "--estimate_only", "--sequence_parallel", *extra))


if __name__ == "__main__":
  absltest.main()
