"""The pipeline split search (ipu_jax.pipelining.search).

A small BERT (6 encoder layers of width 128) over 3 IPUs of 16 tiles: few
enough tiles that most splits run out of memory, so the choice matters. The
search's answer is checked against lowering every candidate of its space as a
real Pipeline; a space where nothing fits gets the shortfall, named and true.
"""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest, parameterized
import chex
import jax
import numpy as np
import optax

import ipu_jax
from ipu_jax.lowering import plan_cache
from ipu_jax.pipelining import candidates, shared_stages, split_search
from experiments import bert, bert_split
import testing_utils

_LIMIT_TILES = 16


def _small_bert():
  mcfg = bert.BertConfig(vocab_size=1000, hidden=128, layers=6, heads=4, ffn=512,
                         max_positions=64, dropout=0.0)
  return bert_split.layered_model(mcfg, micro_batch=4, seq=32, max_predictions=4)


def _config():
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = _LIMIT_TILES
  cfg.auto_select_ipus = 3
  cfg.training.gradient_accumulation_steps = 8
  return cfg


# Compositions of 6 layers with at most 3 per IPU, recomputation on: 8 candidates.
_SPACE = ipu_jax.pipelining.SearchSpace(proportions=(0.6,), recomputation=(True,),
                                        max_layers_per_ipu=3)


class SplitSearchTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = _small_bert()
    cls.optimizer = optax.sgd(1e-3)
    cls.result = ipu_jax.pipelining.search(cls.model, _config(), cls.optimizer, _SPACE,
                                           baseline={"layers_per_ipu": [1, 2, 3],
                                                     "available_memory_proportion": [0.6] * 3,
                                                     "recomputation": True})

  def test_answer_is_the_best_of_every_candidate_lowered(self):
    result = self.result
    self.assertTrue(result.fits)
    self.assertTrue(result.confirmed)
    lowered = {}
    for comp in _SPACE.compositions(6, 3):
      cand = candidates.Candidate(comp, (0.6,) * 3, True, 1)
      estimate = split_search.confirm(self.model, _config(), self.optimizer,
                                      result.estimate(cand.config))
      lowered[comp] = estimate
      # The composed figures agree with the lowered pipeline's. IPU 0's first
      # block and layers are composed as an upper bound (with gradients added
      # into their accumulators as they are ready, a stage's peak grows less
      # than linearly in its layers, so up to ~8 % high); the others within 5 %.
      self.assertLess(estimate.step_error, 0.02, comp)
      composed = np.asarray(estimate.ipu_peak_bytes)
      lowered_peak = np.asarray(estimate.lowered_peak_bytes)
      self.assertGreaterEqual(composed[0], lowered_peak[0], comp)
      np.testing.assert_allclose(composed[0], lowered_peak[0], rtol=0.10, err_msg=str(comp))
      np.testing.assert_allclose(composed[1:], lowered_peak[1:], rtol=0.05, err_msg=str(comp))
    fits = {c: e for c, e in lowered.items() if e.lowered_fits}
    # The choice matters: some splits run out of memory, and the fitting ones differ.
    self.assertNotEmpty(fits)
    self.assertLess(len(fits), len(lowered))
    best = max(fits, key=lambda c: fits[c].lowered_samples_per_second)
    self.assertEqual(tuple(result.config["layers_per_ipu"]), best)
    self.assertTrue(result.chosen.lowered_fits)
    self.assertAlmostEqual(result.chosen.lowered_samples_per_second,
                           fits[best].lowered_samples_per_second, delta=1e-6)
    # The estimate judged every candidate's fit as lowering does.
    est_fits = {c for c, e in lowered.items() if max(e.ipu_peak_bytes) <= e.bytes_per_tile}
    self.assertEqual(est_fits, set(fits))

  def test_result_holds_the_chosen_split_as_lowered(self):
    # The confirmation's pipeline is kept for a caller estimating that split
    # (the BERT runner), so it need not be lowered a second time.
    result = self.result
    pipe = result.lowered.pipeline
    self.assertGreater(result.lowered.seconds, 0)
    self.assertEqual(float(pipe.timeline.total_cycles), result.chosen.lowered_step_cycles)
    self.assertLen({s.ipu for s in pipe.stages}, len(result.config["layers_per_ipu"]))
    cfg = pipe.config
    self.assertEqual(list(cfg.matmuls.available_memory_proportion),
                     list(result.config["available_memory_proportion"]))
    self.assertEqual(cfg.pipelining.recomputation, result.config["recomputation"])

  def test_config_json_table_plot(self):
    result = self.result
    self.assertEqual(set(result.config), {"layers_per_ipu", "available_memory_proportion",
                                          "recomputation", "serialization_factor"})
    self.assertEqual(sum(result.config["layers_per_ipu"]), 6)
    out = json.loads(json.dumps(result.to_json()))
    self.assertEqual(out["split"], result.config)
    search = out["search"]
    self.assertEqual(search["scored"], 8)
    self.assertEqual(search["confirmed"], 1)
    # One probe per setting plus the confirming lowerings.
    self.assertEqual(search["lowered"], 1 + len([e for e in result.top
                                                 if e.lowered_step_cycles is not None]))
    self.assertGreater(search["seconds"], 0)
    table = result.table()
    chosen_row = [line for line in table.splitlines() if line.startswith("*")]
    self.assertLen(chosen_row, 1)
    self.assertIn(str(result.config["layers_per_ipu"]), chosen_row[0])
    self.assertIn("B ", table)  # the baseline's row
    self.assertGreaterEqual(result.chosen.samples_per_second,
                            result.baseline.samples_per_second)
    with tempfile.TemporaryDirectory() as tmp:
      path = result.plot(os.path.join(tmp, "split.png"),
                         baseline={"layers_per_ipu": [2, 1, 3],
                                   "available_memory_proportion": [0.6] * 3})
      with open(path, "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

  def test_nothing_fits_names_the_shortfall_and_ipu(self):
    # Without recomputation no split of this model fits 16 tiles per IPU.
    space = ipu_jax.pipelining.SearchSpace(proportions=(0.6,), recomputation=(False,),
                                           max_layers_per_ipu=3)
    result = ipu_jax.pipelining.search(self.model, _config(), self.optimizer, space)
    self.assertFalse(result.fits)
    self.assertIsNone(result.config)
    short = result.shortfall
    self.assertGreater(short.bytes_over, 0)
    message = result.message()
    self.assertIn(f"short on IPU {short.ipu}", message)
    self.assertIn(f"{short.bytes_over:,d} bytes", message)
    out = result.to_json()
    self.assertIsNone(out["split"])
    self.assertEqual(out["shortfall"]["ipu"], short.ipu)
    self.assertEqual(out["search"]["confirmed"], 0)
    # The named IPU is short by about that much when the split is lowered.
    lowered = split_search.confirm(self.model, _config(), self.optimizer,
                                   result.estimate(short.candidate.config))
    real_over = lowered.lowered_peak_bytes[short.ipu] - lowered.bytes_per_tile
    self.assertGreater(real_over, 0)
    self.assertAlmostEqual(real_over, short.bytes_over, delta=0.05 * lowered.bytes_per_tile)


  def test_probes_build_each_model_once(self):
    # Probes of two proportions (and the one-layer probe of a second
    # serialisation) ask for the same small models; each is built once, and
    # the 0.6 probe made from the 0.5 probe's model prices the baseline as
    # the class's search (0.6 only, its own model) did.
    built = []

    def build(num_layers, serialization):
      built.append((num_layers, serialization))
      return self.model.build(num_layers, serialization)

    model = dataclasses.replace(self.model, build=build)
    space = ipu_jax.pipelining.SearchSpace(proportions=(0.5, 0.6), recomputation=(True,),
                                           serialization=(1, 2), max_layers_per_ipu=3)
    result = ipu_jax.pipelining.search(model, _config(), self.optimizer, space, confirm_top=0,
                                       baseline={"layers_per_ipu": [1, 2, 3],
                                                 "available_memory_proportion": [0.6] * 3,
                                                 "recomputation": True})
    self.assertEqual(result.counts["probes"], 4)
    self.assertEqual(sorted(built), [(1, 2), (3, 1)])
    want, got = self.result.baseline, result.baseline
    self.assertEqual(got.step_cycles, want.step_cycles)
    self.assertEqual(got.ipu_peak_bytes, want.ipu_peak_bytes)
    self.assertEqual(got.ipu_busy_cycles, want.ipu_busy_cycles)

  def test_other_serialization_relowers_only_the_last_block(self):
    cfg = _config()
    base, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 1)
    full, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 2)
    partial, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 2, known=base)
    self.assertIs(partial["layer2"], base["layer2"])
    # The last block of a one-layer probe costs what the full probe's does.
    for name in ("forward", "backward", "update"):
      self.assertEqual(getattr(partial["last"], name), getattr(full["last"], name))
    np.testing.assert_array_equal(partial["last"].backward_peak, full["last"].backward_peak)
    np.testing.assert_array_equal(partial["last"].stash, full["last"].stash)
    # ... and differs from the unserialised decoder's.
    self.assertNotEqual(full["last"].forward, base["last"].forward)

  def test_search_computes_each_plan_once_with_the_figures_of_no_cache(self):
    # The probes of one proportion, the confirmations and the baseline meet
    # the same layers' layouts: one plan session holds them for the search.
    baseline = {"layers_per_ipu": [1, 2, 3], "available_memory_proportion": [0.6] * 3,
                "recomputation": True}
    with testing_utils.counting_plans() as computed:
      result = ipu_jax.pipelining.search(self.model, _config(), self.optimizer, _SPACE,
                                         baseline=baseline)
    self.assertTrue(computed)
    self.assertEqual(sorted({table for (table, _), n in computed.items() if n > 1}), [])
    with plan_cache.disabled():
      fresh = ipu_jax.pipelining.search(self.model, _config(), self.optimizer, _SPACE,
                                        baseline=baseline)
    self.assertEqual(result.config, fresh.config)
    for ours, theirs in zip(result.top + [result.baseline], fresh.top + [fresh.baseline]):
      self.assertEqual(ours.step_cycles, theirs.step_cycles)
      self.assertEqual(ours.ipu_peak_bytes, theirs.ipu_peak_bytes)
      self.assertEqual(ours.lowered_peak_bytes, theirs.lowered_peak_bytes)
      self.assertEqual(ours.lowered_step_cycles, theirs.lowered_step_cycles)

  def test_probes_of_one_search_lower_each_stage_once(self):
    cfg = _config()
    shared = shared_stages.SharedLowerings()
    base, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 1, shared=shared)
    self.assertEqual(shared.stages.lowerings, 4)  # first block, one layer, two layers, last
    partial, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 2, known=base,
                                    shared=shared)
    # The one-layer probe's first block was lowered by the first probe; its
    # layer (which passes the heads a value more) and serialised last block are new ...
    self.assertEqual(shared.stages.lowerings, 6)
    alone, _ = split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 2, known=base)
    # ... and the figures are those of the probe lowered on its own.
    for name in ("forward", "backward", "update"):
      self.assertEqual(getattr(partial["last"], name), getattr(alone["last"], name))
    np.testing.assert_array_equal(partial["last"].backward_peak, alone["last"].backward_peak)
    # Without recomputation the blocks are new but the last (never recomputed) is not.
    split_search.probe(self.model, cfg, self.optimizer, 0.6, False, 1, shared=shared)
    self.assertEqual(shared.stages.lowerings, 9)

  def test_probes_of_another_proportion_share_the_weight_updates(self):
    cfg = _config()
    first = shared_stages.SharedLowerings()
    split_search.probe(self.model, cfg, self.optimizer, 0.6, True, 1, shared=first)
    lowered = first.updates.lowerings
    self.assertGreater(lowered, 0)
    # Another proportion plans every stage afresh, but SGD's update holds no
    # matmul: the same programs serve, lowered under 0.6 ...
    then = shared_stages.SharedLowerings(first.updates)
    shared, _ = split_search.probe(self.model, cfg, self.optimizer, 0.3, True, 1, shared=then)
    self.assertEqual(then.stages.lowerings, 4)
    self.assertEqual(first.updates.lowerings, lowered)
    # ... with the figures of the probe lowered on its own under 0.3.
    alone, _ = split_search.probe(self.model, cfg, self.optimizer, 0.3, True, 1)
    self.assertEqual(shared.keys(), alone.keys())
    for body in alone:
      self.assertEqual(shared[body].update, alone[body].update, body)

  def test_an_update_with_a_matmul_is_lowered_under_each_proportion(self):
    def update(grads, state, params=None):
      del params
      # A matrix's step through a product of it (a preconditioner's shape):
      # its plan reads the proportion.
      return jax.tree.map(lambda g: -1e-3 * (g @ (g.T @ g) if g.ndim == 2 else g), grads), state

    optimizer = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    cfg = _config()
    first = shared_stages.SharedLowerings()
    split_search.probe(self.model, cfg, optimizer, 0.6, True, 1, shared=first)
    lowered = first.updates.lowerings
    split_search.probe(self.model, cfg, optimizer, 0.3, True, 1,
                       shared=shared_stages.SharedLowerings(first.updates))
    self.assertEqual(first.updates.lowerings, 2 * lowered)


class ComposedFiguresTest(chex.TestCase):
  """The composed figures of splits the exhaustive test does not reach."""

  _SPLIT = {"layers_per_ipu": [1, 1, 4], "available_memory_proportion": [0.6] * 3,
            "recomputation": True}
  _SPACE = ipu_jax.pipelining.SearchSpace(proportions=(0.6,), recomputation=(True,),
                                          layers_per_ipu=((1, 1, 4),))

  def _estimate(self, cfg, optimizer):
    model = _small_bert()
    result = ipu_jax.pipelining.search(model, cfg, optimizer, self._SPACE, confirm_top=0)
    return split_search.confirm(model, cfg, optimizer, result.estimate(self._SPLIT))

  def test_replicated_sharded_update(self):
    # The probes were lowered with one replica, so with replicated tensor
    # sharding their weight updates ran on the whole state, not the 1 / R
    # shard: 10 % more busy cycles here, 4x the updates of BERT-Large on POD16.
    cfg = _config()
    cfg.device.tiles_per_ipu = 64
    cfg.replication_factor = 2
    cfg.streaming.offload_optimizer_state = True
    cfg.streaming.replicated_tensor_sharding = True
    estimate = self._estimate(cfg, optax.lamb(1e-3))
    np.testing.assert_allclose(estimate.ipu_busy_cycles, estimate.lowered_busy_cycles,
                               rtol=0.02)
    self.assertLess(estimate.step_error, 0.02)
    composed = np.asarray(estimate.ipu_peak_bytes)
    lowered = np.asarray(estimate.lowered_peak_bytes)
    self.assertGreaterEqual(composed[0], lowered[0])  # IPU 0: an upper bound
    np.testing.assert_allclose(composed, lowered, rtol=0.05)

  def test_on_chip_optimizer_state_is_held_beside_every_program(self):
    # Adam's m and v kept on chip live through the forward and backward
    # programs: the composed peaks count them as the lowered pipeline does,
    # above the peaks with the state offloaded (IPU 1, one layer, by ~25 KB).
    peaks = {}
    for offload in (False, True):
      cfg = _config()
      cfg.device.tiles_per_ipu = 64
      cfg.streaming.offload_optimizer_state = offload
      estimate = self._estimate(cfg, optax.adam(1e-3))
      peaks[offload] = np.asarray(estimate.ipu_peak_bytes)
      lowered = np.asarray(estimate.lowered_peak_bytes)
      self.assertGreaterEqual(peaks[offload][0], lowered[0])  # IPU 0: an upper bound
      self.assertEqual(peaks[offload][1], lowered[1])  # one layer: the probe's own stage
      np.testing.assert_allclose(peaks[offload][2], lowered[2], rtol=0.05)
    self.assertTrue(np.all(peaks[False] > peaks[True]), peaks)

  def test_long_stage_on_many_tiles(self):
    # On 1,024 tiles the tile mapper puts the second layer's tensors on the
    # tiles the first left empty; adding the second layer's per-tile bytes
    # twice more onto the same tiles made IPU 2's four layers 25 % high.
    cfg = _config()
    cfg.device.tiles_per_ipu = 1024
    estimate = self._estimate(cfg, optax.sgd(1e-3))
    self.assertLess(estimate.step_error, 0.02)
    np.testing.assert_allclose(estimate.ipu_peak_bytes[1:], estimate.lowered_peak_bytes[1:],
                               rtol=0.10)


class HalfPrecisionBertTest(absltest.TestCase):

  def test_half_bert_splits_with_a_layer_per_stage(self):
    # The attention scale was a NumPy float64 that promoted half scores to
    # float32; the mask's conversion then read only stage-0 values inside a
    # later stage's layer, which the split refused as a skipped stage.
    mcfg = bert.BertConfig(vocab_size=1000, hidden=128, layers=3, heads=4, ffn=512,
                           max_positions=64, dropout=0.0, dtype=np.float16)
    model = bert_split.layered_model(mcfg, micro_batch=2, seq=32, max_predictions=4)
    loss_fn, params = model.build(3, 1)
    assignment, _ = model.layout([1, 1, 1])
    staged = ipu_jax.pipelining.split_stages(loss_fn, params, model.micro_batch, assignment)
    self.assertEqual(staged.num_stages, 4)


class SearchSpaceTest(parameterized.TestCase):

  def test_compositions(self):
    comps = candidates.layer_compositions(6, 3)
    self.assertLen(comps, 15)  # IPU 0 takes 0..4 layers, the others at least 1
    self.assertIn((0, 3, 3), comps)
    self.assertNotIn((3, 3, 0), comps)
    self.assertTrue(all(sum(c) == 6 for c in comps))
    self.assertEqual(candidates.layer_compositions(6, 3, max_per_ipu=2), [(2, 2, 2)])
    self.assertLen(candidates.layer_compositions(24, 4), 2024)  # C(24, 3)

  @parameterized.parameters(
      (dict(proportions=(1.5,)), "proportions"),
      (dict(proportions=()), "proportions"),
      (dict(serialization=(0,)), "serialization"),
      (dict(layers_per_ipu=((2, 2, 1),)), "layers_per_ipu"),
      (dict(layers_per_ipu=((3, 3, 0),)), "layers_per_ipu"),
      # A scalar, a string and "no" (read as on) used to pass or fail deep inside.
      (dict(proportions=0.5), "proportions must be a sequence"),
      (dict(proportions=("a",)), r"proportions: 'a' is not a number"),
      (dict(recomputation=("no",)), r"recomputation: 'no' is not True or False"),
      (dict(max_layers_per_ipu=0), "max_layers_per_ipu must be an int >= 1"))
  def test_bad_space(self, kwargs, name):
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError, name):
      ipu_jax.pipelining.SearchSpace(**kwargs).compositions(6, 3)

  def test_search_arguments_are_checked_before_any_probe(self):
    def model(layers):
      return ipu_jax.pipelining.LayeredModel(build=None, num_layers=layers, micro_batch={},
                                             layer_path=str, first=("embeddings",),
                                             last=("head",))
    cfg = ipu_jax.IPUConfig()
    cfg.auto_select_ipus = 3
    # Nothing is built (build=None would fail): each is refused up front. An
    # empty space used to give a result whose table() raised AttributeError.
    for layers, kwargs, message in (
        (1, dict(), "no split of 1 layers over 3 IPUs"),
        (4, dict(top=0), "top must be an int >= 1"),
        (4, dict(tolerance=-1), "tolerance .* must be a number >= 0"),
        (4, dict(baseline={"layers": [0, 2, 2]}), "baseline must be a Candidate or a dict"),
        (4, dict(baseline={"layers_per_ipu": [1, 1], "available_memory_proportion": [.3, .3]}),
         "the baseline .* must give 3 IPUs 4 layers")):
      with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError, message):
        ipu_jax.pipelining.search(model(layers), cfg, **kwargs)
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError,
                                "samples_per_micro_batch must be an int >= 1"):
      ipu_jax.pipelining.LayeredModel(build=None, num_layers=6, micro_batch={},
                                      layer_path=str, first=("embeddings",), last=("head",),
                                      samples_per_micro_batch=0)

  def test_bad_model(self):
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError, "LayeredModel.first"):
      ipu_jax.pipelining.LayeredModel(build=None, num_layers=6, micro_batch={},
                                      layer_path=str, first="embeddings", last=("head",))
    with self.assertRaisesRegex(ipu_jax.pipelining.PipelineError, "LayeredModel.rng"):
      ipu_jax.pipelining.LayeredModel(build=None, num_layers=6, micro_batch={},
                                      layer_path=str, first=("embeddings",), last=("head",),
                                      rng="dropout")

  def test_score(self):
    # 8 micro-batches of 2 samples on 2 replicas in 1.33e6 cycles at 1.33 GHz: 32 / 1 ms.
    self.assertAlmostEqual(split_search.score(1.33e6, 1.33e9, 8, 2, 2), 32000.0)


if __name__ == "__main__":
  absltest.main()
