"""experiments.gpt2_training: GPT-2 as Graphcore's PopTorch example laid it out.

A tiny GPT-2 on 16 tiles trains through the pipeline against plain JAX; the
presets (1,472 tiles, GPT-2 small to large) are checked for what a run needs
before lowering, and run by hand (docs/published_tables.md).
"""

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from absl.testing import absltest, parameterized
from flax import nnx

_TINY = ["--tiles_per_ipu=16", "--seq=32", "--layers_per_ipu=0,2,2",
         "--matmul_proportion=0.3,0.3,0.3", "--replicas=1"]


def _flags(*argv):
  from experiments import gpt2_training
  fv = gpt2_training.define_flags(flags.FlagValues())
  fv(["gpt2_training"] + list(argv))
  return fv


class GPT2ModelTest(chex.TestCase, parameterized.TestCase):
  """The model's loss against a plain cross entropy of an unserialised head."""

  @parameterized.parameters((0, 1), (8, 2), (24, 4), (100, 1))
  def test_serialised_head_and_loss_equal_the_plain_ones(self, chunk, pieces):
    # Chunks that divide the rows (8), that do not (24: 64 rows = 24 + 24 + 16),
    # more than the rows (100) and one chunk (0).
    from experiments import gpt2
    cfg = gpt2.gpt2_config("tiny", max_positions=32, embedding_serialization=pieces,
                           loss_serialization=chunk)
    model = gpt2.GPT2(cfg, rngs=nnx.Rngs(0))
    batch = {k: v[0] for k, v in gpt2.synthetic_batches(cfg, 1, 2, 32, seed=3).items()}
    loss_fn, params = gpt2.make_loss(model)
    got = jax.jit(loss_fn)(params, batch)

    plain = gpt2.GPT2(gpt2.gpt2_config("tiny", max_positions=32), rngs=nnx.Rngs(0))
    logits = plain(batch)
    labels = batch["labels"].reshape(-1)
    counted = labels >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, np.where(counted, labels, 0))
    want = np.sum(np.where(counted, ce, 0.0)) / np.sum(counted)
    self.assertEqual(int(np.sum(~counted)), 2)  # each sequence's last position
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-5)

  def test_generated_labels_are_the_next_tokens(self):
    from experiments import gpt2
    cfg = gpt2.gpt2_config("tiny")
    batch = gpt2.synthetic_batches(cfg, 3, 2, 16, seed=1)
    self.assertEqual(batch["input_ids"].shape, (3, 2, 16))
    np.testing.assert_array_equal(batch["labels"][..., :-1], batch["input_ids"][..., 1:])
    np.testing.assert_array_equal(batch["labels"][..., -1], -1)

  @parameterized.named_parameters(
      ("small", [0, 4, 4, 4], [0, 1, 2, 3, 0]),
      # Block 0 on IPU 0 sits between the positions (IPU 1) and block 1.
      ("large_512", [1, 5, 5, 5, 5, 5, 5, 5], [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 0]),
  )
  def test_layout_places_blocks_as_poptorch_does(self, layers, mapping):
    from experiments import gpt2
    assignment, got = gpt2.layout(layers)
    self.assertEqual(got, mapping)
    self.assertEqual(assignment["wte"], 0)
    self.assertEqual(assignment["wpe"], 1)
    self.assertEqual(assignment["lm_head"], len(mapping) - 1)
    self.assertEqual(assignment["ln_f"], assignment[f"layers_{sum(layers) - 1}"])
    self.assertEqual(mapping[assignment["layers_0"]], 0 if layers[0] else 1)

  @parameterized.parameters([[4]], [[0, 0, 4]], [[2, -1, 3]])
  def test_layout_refuses_a_split_it_cannot_place(self, layers):
    from experiments import gpt2
    with self.assertRaisesRegex(ValueError, "layers_per_ipu must list"):
      gpt2.layout(layers)


class AdamWTest(chex.TestCase):

  def test_weights_dtypes_and_bias_correction_give_optax_numbers(self):
    from experiments import adamw
    params = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)}
    grads = {"w": np.cos(np.arange(12, dtype=np.float32)).reshape(3, 4)}
    ours, theirs = adamw.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
    a, b = ours.init(params), theirs.init(params)
    for _ in range(3):
      ua, a = ours.update(grads, a, params)
      ub, b = theirs.update(grads, b, params)
      chex.assert_trees_all_close(ua, ub, rtol=1e-6)

  def test_moments_keep_their_own_dtypes(self):
    from experiments import adamw
    params = {"w": np.ones((2, 3), np.float16)}
    opt = adamw.adamw(1e-3, mu_dtype="float16", nu_dtype="float32", bias_correction=False)
    state = opt.init(params)
    _, state = opt.update({"w": np.full((2, 3), 0.5, np.float16)}, state, params)
    adam_state = state[0]
    self.assertEqual(adam_state.mu["w"].dtype, jnp.float16)
    self.assertEqual(adam_state.nu["w"].dtype, jnp.float32)
    # No bias correction: m = (1 - b1) g, read as it is.
    np.testing.assert_allclose(np.asarray(adam_state.mu["w"], np.float32), 0.05, rtol=1e-3)


class GPT2RunnerTest(chex.TestCase, parameterized.TestCase):

  def test_estimate_is_the_runs_figures_and_the_run_trains_as_plain_jax(self):
    from experiments import gpt2_training
    out = os.path.join(self.create_tempdir().full_path, "new", "gpt2.json")
    argv = [*_TINY, "--system=pod16", "--replicas=2", "--updates_per_execution=8",
            "--dropout=0.1", "--attention_dropout=0.1"]
    estimated = gpt2_training.run(_flags(*argv, "--estimate_only", f"--json_out={out}"))
    with open(out) as f:
      written = json.load(f)
    for key in ("samples_per_second", "step_seconds", "breakdown", "fits",
                "per_ipu_peak_bytes", "lower_seconds", "peak_rss_bytes"):
      self.assertIn(key, written)
    self.assertEqual(written["device_mapping"], [0, 1, 2, 0])
    self.assertLen(written["per_ipu_peak_bytes"], 3)
    self.assertTrue(written["fits"])
    # G x R x micro-batch sequences a step; the host's 53 ms an execution
    # shared by its 8 updates.
    self.assertAlmostEqual(written["samples_per_second"] * written["step_seconds"], 8 * 2 * 1,
                           places=6)
    self.assertAlmostEqual(written["breakdown"]["execution_overhead"], 53e-3 / 8, places=12)
    # A real run (weights, masks, two replicas) trains as plain JAX
    # accumulation does, and its pipeline costs what the abstract one did.
    ran = gpt2_training.run(_flags(*argv, "--steps=1", "--check"))
    self.assertLess(ran["max_relative_difference"], 1e-4)
    self.assertTrue(np.isfinite(ran["final_loss"]))
    self.assertAlmostEqual(ran["step_seconds"], estimated["step_seconds"], places=12)
    self.assertEqual(ran["per_ipu_peak_bytes"], estimated["per_ipu_peak_bytes"])

  def test_auto_split_finds_a_faster_split_that_keeps_ipu0_for_the_head(self):
    from experiments import gpt2_training
    out = os.path.join(self.create_tempdir().full_path, "split.json")
    result = gpt2_training.run(_flags(
        *_TINY, "--replicas=2", "--layers_per_ipu=0,1,3", "--auto_split", "--estimate_only",
        "--split_serialization=1,2,3", "--split_proportions=0.2,0.4", f"--json_out={out}"))
    with open(out) as f:
      self.assertEqual(json.load(f)["split"], result["split"])
    split = result["split"]
    self.assertEqual(split["layers_per_ipu"][0], 0)  # IPU 0: the table, head and loss
    self.assertEqual(sum(split["layers_per_ipu"]), 4)
    self.assertIn(split["serialization_factor"], (1, 2))  # 3 does not divide 512 words
    self.assertTrue(result["fits"])
    self.assertEqual(result["split_baseline"]["layers_per_ipu"], [0, 1, 3])
    self.assertGreater(result["split_estimate"]["samples_per_second"],
                       result["split_baseline"]["samples_per_second"])
    # The runner lowered the example's layout of the chosen split (positions
    # on IPU 1, not with the table as in the search): the same split's figures
    # but for that table's placement.
    self.assertEqual(result["device_mapping"], [0, 1, 2, 0])
    self.assertAlmostEqual(result["samples_per_second"],
                           result["split_estimate"]["samples_per_second"], delta=
                           0.01 * result["samples_per_second"])

  def test_auto_split_refuses_a_search_too_large_to_score_before_lowering(self):
    # GPT-2 large on 16 IPUs: 92 M ways to place 36 blocks even when balanced.
    from experiments import gpt2_training
    with self.assertRaisesRegex(app.UsageError, r"92,348,750 ways to place 36 blocks on IPUs 1 "
                                                r"to 15 .* give fewer --split_proportions"):
      gpt2_training.run(_flags("--config=large_pod16", "--auto_split", "--estimate_only"))
    # GPT-2 large at 512 positions: the example's split puts a block on IPU 0
    # (11 stages, G 4,092); the searched splits have 9 stages.
    with self.assertRaisesRegex(app.UsageError, r"--layers_per_ipu=1,5,5,5,5,5,5,5 with "
                                                r"--accumulation=4092 is not one. Give one, e.g. "
                                                r"--layers_per_ipu=0,5,5,5,5,5,5,6 "
                                                r"--accumulation=4086 \(a multiple of 18\)"):
      gpt2_training.run(_flags("--config=large_sl512_pod16", "--auto_split", "--estimate_only"))

  @parameterized.parameters(
      (["--layers_per_ipu=0,2,1"], r"--layers_per_ipu \[0, 2, 1\] adds up to 3 blocks; GPT-2 "
                                   r"tiny has 4"),
      (["--layers_per_ipu=4"], "--layers_per_ipu=4: layers_per_ipu must list"),
      (["--embedding_serialization=3"], r"--embedding_serialization=3 does not divide the "
                                        r"vocabulary of 512 words .* factors that do: \[1, 2, 4"),
      (["--accumulation=6"], "--accumulation=6 does not suit the Grouped schedule over 4 "
                             "stages: it must be a positive multiple of 8"),
      (["--matmul_proportion=0.3,0.3"], "gives 2 proportions; the split has 3 IPUs"),
      (["--dropout=1.0"], r"--dropout=1.0 must be in \[0, 1\)"),
      (["--system=pod16", "--replicas=8"], "--system=pod16"),
      (["--check", "--dropout=0.1", "--random_mode=hardware"], "--check compares with plain"),
  )
  def test_bad_flags_are_named_before_anything_is_built(self, extra, message):
    from experiments import gpt2_training
    with self.assertRaisesRegex(app.UsageError, message):
      gpt2_training.run(_flags(*_TINY, *extra))

  def test_every_preset_passes_the_checks_a_run_makes_first(self):
    from experiments import gpt2, gpt2_presets, gpt2_training
    for name in gpt2_presets.PRESETS:
      f = _flags(f"--config={name}", "--estimate_only")
      gpt2_training.apply_preset(f)
      gpt2_training.check_flags(f)  # layers, proportions, G, the system's capacity
      mcfg = gpt2_training.model_config(f)
      self.assertEqual(mcfg.vocab_size % f.embedding_serialization, 0, name)
      self.assertEqual(mcfg.max_positions, f.seq, name)
      self.assertEqual(sum(int(v) for v in f.layers_per_ipu), gpt2.SIZES[f.model]["layers"])


class GPT2PodRowsTest(absltest.TestCase):

  def test_every_preset_is_a_pod_row_without_a_measurement(self):
    from experiments import benchmark_pod, gpt2_presets
    rows = {name: args for name, args in benchmark_pod.ROWS.items() if name.startswith("gpt2_")}
    self.assertEqual(sorted(args[0].split("=", 1)[1] for args in rows.values()),
                     sorted(gpt2_presets.PRESETS))
    for name in rows:
      self.assertEqual(benchmark_pod.RUNNERS[name], "experiments.gpt2_training")
      self.assertEqual(benchmark_pod.family(name), "GPT-2")
      self.assertNotIn(name, benchmark_pod.MEASURED)


if __name__ == "__main__":
  absltest.main()
