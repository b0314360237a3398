"""Tests of IPUConfig: strict nested options, targets and lowering options."""

import os
import pathlib
import pickle
import threading
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp

import ipu_jax
from ipu_jax import config as config_lib
from ipu_jax.config import IPUConfig, LoweringOptions
from ipu_jax.target import IPUTarget

_DEFAULTS = {
    "device.version": "ipu2",
    "device.tiles_per_ipu": 0,
    "auto_select_ipus": 1,
    "replication_factor": 1,
    "matmuls.available_memory_proportion": 0.6,
    "matmuls.partials_type": "float32",
    "convolutions.available_memory_proportion": 0.6,
    "memory.allow_out_of_memory": False,
    "report.directory": None,
    "training.gradient_accumulation_reduction": "sum",
    "training.replica_reduction": "sum",
    "training.gradient_accumulation_steps": 1,
    "executor.mode": "batched",
    "random_seed": None,
}


def _get(cfg, path):
  for part in path.split("."):
    cfg = getattr(cfg, part)
  return cfg


def _set(cfg, path, value):
  *groups, leaf = path.split(".")
  for part in groups:
    cfg = getattr(cfg, part)
  setattr(cfg, leaf, value)


class _CleanEnvironmentTest(chex.TestCase, parameterized.TestCase):
  """Runs each test without the report-directory variable, restoring the
  environment after it: tests must not depend on the environment they run in."""

  def setUp(self):
    super().setUp()
    patcher = mock.patch.dict(os.environ)
    patcher.start()
    self.addCleanup(patcher.stop)
    os.environ.pop(config_lib.REPORT_DIR_ENV, None)


class IPUConfigTest(_CleanEnvironmentTest):

  def _assert_rejected(self, error, path, value):
    """Setting ``path`` to ``value`` raises ``error`` naming the field and
    leaves the default in place."""
    cfg = IPUConfig()
    with self.assertRaisesRegex(error, path.replace(".", r"\.")):
      _set(cfg, path, value)
    self.assertEqual(_get(cfg, path), _DEFAULTS[path])

  @parameterized.parameters(*_DEFAULTS.items())
  def test_default(self, path, expected):
    self.assertEqual(_get(IPUConfig(), path), expected)

  @parameterized.parameters(
      ("device.version", "bow"),
      ("device.tiles_per_ipu", 16),
      ("auto_select_ipus", 4),
      ("replication_factor", 8),
      ("matmuls.available_memory_proportion", 1.0),
      ("matmuls.partials_type", "float16"),
      ("convolutions.available_memory_proportion", 0.1),
      ("memory.allow_out_of_memory", True),
      ("report.directory", "/tmp/reports"),
      ("training.gradient_accumulation_reduction", "running_mean"),
      ("training.replica_reduction", "mean"),
      ("training.gradient_accumulation_steps", 4),
      ("executor.mode", "per_tile"),
      ("random_seed", 1234),
  )
  def test_set_then_get(self, path, value):
    cfg = IPUConfig()
    _set(cfg, path, value)
    self.assertEqual(_get(cfg, path), value)
    # Only that option changed.
    for other, default in _DEFAULTS.items():
      if other != path:
        self.assertEqual(_get(cfg, other), default)

  def test_configs_do_not_share_state(self):
    a, b = IPUConfig(), IPUConfig()
    a.device.version = "ipu1"
    self.assertEqual(b.device.version, "ipu2")

  @parameterized.named_parameters(
      ("top_level", "", "replicaton_factor", "'replication_factor'"),
      ("nested", "device", "tiles_per_ipus", "'tiles_per_ipu'"),
      ("nested_deeper_name", "training", "gradient_accumulation_step",
       "'gradient_accumulation_steps'"),
      ("wrong_level", "", "available_memory_proportion",
       "'matmuls.available_memory_proportion'"),
  )
  def test_unknown_option_suggests(self, group, name, suggestion):
    cfg = IPUConfig()
    target = _get(cfg, group) if group else cfg
    with self.assertRaisesRegex(AttributeError,
                                f"Did you mean {suggestion}") as set_error:
      setattr(target, name, 1)
    with self.assertRaisesRegex(AttributeError, f"Did you mean {suggestion}"):
      getattr(target, name)
    self.assertIn("valid options are", str(set_error.exception).lower())

  def test_unknown_option_error_lists_valid_names(self):
    with self.assertRaises(AttributeError) as error:
      IPUConfig().device.colour = "blue"
    self.assertIn("version, tiles_per_ipu", str(error.exception))

  def test_group_cannot_be_replaced(self):
    cfg = IPUConfig()
    with self.assertRaisesRegex(AttributeError, "device"):
      cfg.device = IPUConfig().device

  @parameterized.named_parameters(
      ("negative_tiles", "device.tiles_per_ipu", -1),
      ("unknown_version", "device.version", "ipu3"),
      ("zero_ipus", "auto_select_ipus", 0),
      ("zero_replicas", "replication_factor", 0),
      ("amp_zero", "matmuls.available_memory_proportion", 0),
      ("amp_above_one", "matmuls.available_memory_proportion", 1.5),
      ("amp_nan", "matmuls.available_memory_proportion", float("nan")),
      ("conv_amp_above_one", "convolutions.available_memory_proportion", 1.5),
      ("partials", "matmuls.partials_type", "half"),
      ("reduction", "training.gradient_accumulation_reduction", "max"),
      ("replica_reduction", "training.replica_reduction", "running_mean"),
      ("accumulation_steps", "training.gradient_accumulation_steps", 0),
      ("executor", "executor.mode", "sequential"),
      ("negative_seed", "random_seed", -1),
      ("seed_past_c_long", "random_seed", 2**63),
  )
  def test_bad_value_raises_value_error_naming_field(self, path, value):
    self._assert_rejected(ValueError, path, value)

  def test_model_seed_is_checked_before_anything_runs(self):
    # A negative seed used to pass here and fail inside NumPy at the first
    # fit's shuffle, naming no field.
    from flax import nnx  # pylint: disable=g-import-not-at-top
    from ipu_jax import keras  # pylint: disable=g-import-not-at-top
    module = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with self.assertRaisesRegex(ValueError, r"Model\(seed=\.\.\.\) must be an int in \[0, "):
      keras.Model(module, seed=-1)
    self.assertEqual(keras.Model(module, seed=2**40).seed, 2**40)

  def test_value_error_states_valid_values(self):
    with self.assertRaisesRegex(ValueError, r"random_seed must be an int in \[0, \d+\] or None"):
      IPUConfig().random_seed = -1
    with self.assertRaisesRegex(ValueError, "'ipu1', 'ipu2', 'bow'"):
      IPUConfig().device.version = "ipu3"
    with self.assertRaisesRegex(ValueError, r"\(0, 1\]"):
      IPUConfig().matmuls.available_memory_proportion = 1.5
    with self.assertRaisesRegex(ValueError, ">= 0"):
      IPUConfig().device.tiles_per_ipu = -1

  @parameterized.named_parameters(
      ("str_for_int", "device.tiles_per_ipu", "16"),
      ("float_for_int", "replication_factor", 2.0),
      ("bool_for_int", "device.tiles_per_ipu", True),
      ("bool_for_optional_int", "random_seed", False),
      ("int_for_bool", "memory.allow_out_of_memory", 1),
      ("str_for_bool", "memory.allow_out_of_memory", "yes"),
      ("bool_for_float", "matmuls.available_memory_proportion", True),
      ("str_for_float", "matmuls.available_memory_proportion", "0.5"),
      ("int_for_str", "device.version", 2),
      ("none_for_str", "executor.mode", None),
      ("int_for_directory", "report.directory", 3),
  )
  def test_wrong_type_raises_type_error_naming_field(self, path, value):
    self._assert_rejected(TypeError, path, value)

  def test_int_accepted_for_float(self):
    cfg = IPUConfig()
    cfg.matmuls.available_memory_proportion = 1
    self.assertEqual(cfg.matmuls.available_memory_proportion, 1.0)
    self.assertIsInstance(cfg.matmuls.available_memory_proportion, float)

  def test_path_accepted_for_report_directory(self):
    cfg = IPUConfig()
    cfg.report.directory = pathlib.Path("/tmp/reports")
    self.assertEqual(cfg.report.directory, "/tmp/reports")
    cfg.report.directory = None
    self.assertIsNone(cfg.report.directory)

  @parameterized.parameters(
      ("ipu1", 1216, 262_144),
      ("ipu2", 1472, 638_976),
      ("bow", 1472, 638_976),
  )
  def test_to_target_full_chip(self, version, tiles, bytes_per_tile):
    cfg = IPUConfig()
    cfg.device.version = version
    target = cfg.to_target()
    self.assertIsInstance(target, IPUTarget)
    self.assertEqual(target.name, version)
    self.assertEqual(target.num_ipus, 1)
    self.assertEqual(target.tiles_per_ipu, tiles)
    self.assertEqual(target.num_tiles, tiles)
    self.assertEqual(target.bytes_per_tile, bytes_per_tile)
    self.assertEqual(target, IPUTarget.preset(version))

  @parameterized.parameters("ipu1", "ipu2", "bow")
  def test_to_target_fewer_tiles_more_ipus(self, version):
    cfg = IPUConfig()
    cfg.device.version = version
    cfg.device.tiles_per_ipu = 16
    cfg.auto_select_ipus = 2
    target = cfg.to_target()
    self.assertEqual(target.tiles_per_ipu, 16)
    self.assertEqual(target.num_ipus, 2)
    self.assertEqual(target.num_tiles, 32)

  def test_to_target_ignores_replication(self):
    cfg = IPUConfig()
    cfg.replication_factor = 4
    self.assertEqual(cfg.to_target().num_ipus, 1)

  def test_too_many_tiles_rejected_at_to_target(self):
    cfg = IPUConfig()
    cfg.device.tiles_per_ipu = 1472  # Fine for the default ipu2.
    self.assertEqual(cfg.to_target().tiles_per_ipu, 1472)
    cfg.device.version = "ipu1"  # Accepted: the check waits for to_target.
    with self.assertRaisesRegex(ValueError,
                                r"device\.tiles_per_ipu.*1216") as error:
      cfg.to_target()
    self.assertIn("ipu1", str(error.exception))
    cfg.device.tiles_per_ipu = 1216
    self.assertEqual(cfg.to_target().tiles_per_ipu, 1216)

  def test_to_dict_from_dict_round_trip(self):
    cfg = IPUConfig()
    cfg.device.version = "ipu1"
    cfg.replication_factor = 2
    cfg.matmuls.available_memory_proportion = 0.3
    cfg.report.directory = "/tmp/r"
    cfg.training.gradient_accumulation_reduction = "mean"
    cfg.random_seed = 7
    as_dict = cfg.to_dict()
    self.assertEqual(as_dict["device"], {"version": "ipu1", "tiles_per_ipu": 0})
    self.assertEqual(as_dict["replication_factor"], 2)
    restored = IPUConfig.from_dict(as_dict)
    self.assertEqual(restored, cfg)
    self.assertEqual(restored.to_dict(), as_dict)
    self.assertNotEqual(restored, IPUConfig())

  def test_from_dict_partial_and_checked(self):
    cfg = IPUConfig.from_dict({"matmuls": {"partials_type": "float16"}})
    self.assertEqual(cfg.matmuls.partials_type, "float16")
    self.assertEqual(cfg.device.version, "ipu2")
    with self.assertRaisesRegex(AttributeError, "'tiles_per_ipu'"):
      IPUConfig.from_dict({"device": {"tiles_per_ipus": 4}})
    with self.assertRaisesRegex(ValueError, r"device\.tiles_per_ipu"):
      IPUConfig.from_dict({"device": {"tiles_per_ipu": -1}})
    with self.assertRaisesRegex(TypeError, "device"):
      IPUConfig.from_dict({"device": "ipu1"})

  @parameterized.parameters("copy", "pickle")
  def test_copy_is_independent(self, how):
    cfg = IPUConfig()
    cfg.device.version = "ipu1"
    if how == "copy":
      clone = cfg.copy()
    else:
      clone = pickle.loads(pickle.dumps(cfg))
    self.assertEqual(clone, cfg)
    clone.device.version = "bow"
    self.assertEqual(cfg.device.version, "ipu1")
    # The clone stays strict and still names full paths.
    with self.assertRaisesRegex(ValueError, r"device\.tiles_per_ipu"):
      clone.device.tiles_per_ipu = -1

  def test_repr_shows_changed_options(self):
    cfg = IPUConfig()
    self.assertEqual(repr(cfg), "IPUConfig()")
    cfg.replication_factor = 2
    cfg.device.version = "ipu1"
    self.assertEqual(repr(cfg),
                     "IPUConfig(device.version='ipu1', replication_factor=2)")

  def test_every_option_documented(self):
    description = IPUConfig().describe()
    for path in _DEFAULTS:
      self.assertIn(path, description)
      doc = IPUConfig.help(path)
      self.assertIn(path, doc)
      self.assertIn("default", doc)
      self.assertGreater(len(doc), len(path) + 40)

  def test_help(self):
    doc = IPUConfig.help("matmuls.available_memory_proportion")
    self.assertIn("availableMemoryProportion", doc)
    self.assertIn("(0, 1]", doc)
    self.assertIn("0.6", doc)
    group_doc = IPUConfig.help("device")
    self.assertIn("device.version", group_doc)
    self.assertIn("device.tiles_per_ipu", group_doc)
    with self.assertRaisesRegex(AttributeError, "'partials_type'"):
      IPUConfig.help("matmuls.partial_type")

  def test_describe_shows_current_values(self):
    cfg = IPUConfig()
    cfg.executor.mode = "per_tile"
    self.assertIn("executor.mode = 'per_tile'", cfg.describe())
    self.assertIn("device.version = 'ipu2'", cfg.device.describe())
    self.assertNotIn("executor", cfg.device.describe())


class LoweringOptionsTest(_CleanEnvironmentTest):

  def test_defaults_match_config(self):
    self.assertEqual(LoweringOptions(), IPUConfig().lowering_options())

  def test_reflects_settings(self):
    cfg = IPUConfig()
    cfg.matmuls.available_memory_proportion = 0.25
    cfg.convolutions.available_memory_proportion = 0.5
    cfg.matmuls.partials_type = "float16"
    cfg.memory.allow_out_of_memory = True
    cfg.report.directory = "/tmp/reports"
    cfg.executor.mode = "per_tile"
    self.assertEqual(
        cfg.lowering_options(),
        LoweringOptions(available_memory_proportion=0.25,
                        conv_available_memory_proportion=0.5,
                        partials_type="float16", allow_out_of_memory=True,
                        report_directory="/tmp/reports",
                        executor_mode="per_tile"))

  def test_hashable_cache_key(self):
    cfg = IPUConfig()
    cache = {cfg.lowering_options(): "compiled"}
    self.assertIn(IPUConfig().lowering_options(), cache)
    cfg.matmuls.available_memory_proportion = 0.3
    self.assertNotIn(cfg.lowering_options(), cache)

  def test_frozen(self):
    options = LoweringOptions()
    with self.assertRaises(AttributeError):
      options.executor_mode = "per_tile"

  def test_checked(self):
    with self.assertRaisesRegex(ValueError, "available_memory_proportion"):
      LoweringOptions(available_memory_proportion=0)
    with self.assertRaisesRegex(ValueError, "partials_type"):
      LoweringOptions(partials_type="half")

  def test_report_directory_from_environment(self):
    os.environ[config_lib.REPORT_DIR_ENV] = "/tmp/from_env"
    cfg = IPUConfig()
    self.assertIsNone(cfg.report.directory)
    self.assertEqual(cfg.lowering_options().report_directory, "/tmp/from_env")
    cfg.report.directory = "/tmp/explicit"  # An explicit setting wins.
    self.assertEqual(cfg.lowering_options().report_directory, "/tmp/explicit")

  def test_no_report_directory_without_environment(self):
    self.assertIsNone(IPUConfig().lowering_options().report_directory)
    os.environ[config_lib.REPORT_DIR_ENV] = ""
    self.assertIsNone(IPUConfig().lowering_options().report_directory)


class DefaultConfigTest(chex.TestCase):

  def test_fresh_default_when_unset(self):
    first = config_lib.get_default_config()
    self.assertEqual(first, IPUConfig())
    first.replication_factor = 4  # Changing it affects nothing else.
    self.assertEqual(config_lib.get_default_config().replication_factor, 1)

  def test_nests_and_restores(self):
    outer, inner = IPUConfig(), IPUConfig()
    outer.replication_factor = 2
    inner.replication_factor = 4
    with config_lib.default_config(outer) as entered:
      self.assertIs(entered, outer)
      self.assertIs(config_lib.get_default_config(), outer)
      with config_lib.default_config(inner):
        self.assertIs(config_lib.get_default_config(), inner)
      self.assertIs(config_lib.get_default_config(), outer)
    self.assertEqual(config_lib.get_default_config(), IPUConfig())

  def test_restores_after_exception(self):
    cfg = IPUConfig()
    cfg.device.version = "ipu1"
    with self.assertRaises(RuntimeError):
      with config_lib.default_config(cfg):
        raise RuntimeError("boom")
    self.assertEqual(config_lib.get_default_config().device.version, "ipu2")

  def test_other_threads_unaffected(self):
    cfg = IPUConfig()
    cfg.device.version = "bow"
    seen = []
    with config_lib.default_config(cfg):
      thread = threading.Thread(
          target=lambda: seen.append(config_lib.get_default_config()))
      thread.start()
      thread.join()
    self.assertEqual(seen[0].device.version, "ipu2")

  def test_rejects_non_config(self):
    with self.assertRaises(TypeError):
      with config_lib.default_config({"replication_factor": 2}):
        pass


class PerIPUProportionTest(_CleanEnvironmentTest):
  """``available_memory_proportion`` per IPU of a replica (a list or a dict)."""

  def _config(self, value, ipus=4, path="matmuls.available_memory_proportion"):
    cfg = IPUConfig()
    cfg.auto_select_ipus = ipus
    _set(cfg, path, value)
    return cfg

  @parameterized.parameters("matmuls.available_memory_proportion",
                            "convolutions.available_memory_proportion")
  def test_list_and_dict(self, path):
    cfg = self._config([0.15, 0.25, 0.25, 0.3], path=path)
    self.assertEqual([_get(cfg.for_ipu(i), path) for i in range(4)], [0.15, 0.25, 0.25, 0.3])
    cfg = self._config({0: 0.15, 3: 0.3}, path=path)
    # IPUs the dict leaves out keep the default.
    self.assertEqual([_get(cfg.for_ipu(i), path) for i in range(4)], [0.15, 0.6, 0.6, 0.3])
    # PopTorch's Options.setAvailableMemoryProportion keys.
    self.assertEqual(self._config({"IPU0": 0.15, "IPU3": 0.3}, path=path), cfg)
    hash(cfg.lowering_options())  # still a cache key
    import json  # reports save the config as JSON: pairs come back as lists
    self.assertEqual(IPUConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))), cfg)

  @parameterized.named_parameters(
      ("short_list", [0.1, 0.2], 4, ValueError,
       r"matmuls.available_memory_proportion: a list needs one value per IPU of a replica "
       r"\(auto_select_ipus=4\), got 2"),
      ("ipu_out_of_range", {4: 0.2}, 4, ValueError,
       r"matmuls.available_memory_proportion: IPU 4 is out of range; a replica has IPUs 0..3"),
  )
  def test_shape_checked_before_anything_runs(self, value, ipus, error, message):
    cfg = self._config(value, ipus)
    with self.assertRaisesRegex(error, message):
      cfg.lowering_options()
    import jax.numpy as jnp
    import ipu_jax
    with self.assertRaisesRegex(error, message):
      ipu_jax.jit(lambda x: x @ x, config=cfg).lower(jnp.ones((4, 4)))

  @parameterized.named_parameters(
      ("above_one", [0.2, 1.5]), ("zero", {0: 0.0}), ("negative_key", {-1: 0.2}),
      ("bool_key", {True: 0.2}), ("empty", []), ("nan", [float("nan")]),
      ("bad_name", {"GPU0": 0.2}))
  def test_values_checked_where_assigned(self, value):
    cfg = IPUConfig()
    with self.assertRaisesRegex(ValueError, r"matmuls.available_memory_proportion must be a "
                                r"number in \(0, 1\], a non-empty list"):
      cfg.matmuls.available_memory_proportion = value

  def test_for_ipu_out_of_range(self):
    with self.assertRaisesRegex(ValueError, "IPU 4 is not one of the replica's IPUs 0..3"):
      self._config(0.3).for_ipu(4)

  def test_program_over_several_ipus_plans_under_the_smallest(self):
    import jax.numpy as jnp
    import ipu_jax

    def names(value):
      cfg = self._config(value, ipus=2)
      cfg.device.tiles_per_ipu = 16
      lowered = ipu_jax.jit(lambda x, w: x @ w, config=cfg).lower(jnp.ones((64, 256)),
                                                                  jnp.ones((256, 256)))
      return [s.name for s in lowered.report.profile.steps]

    self.assertEqual(names([0.6, 0.05]), names(0.05))
    self.assertEqual(names({1: 0.05}), names(0.05))
    self.assertNotEqual(names(0.05), names(0.6))

  @parameterized.named_parameters(
      ("elementwise", lambda x, w: jnp.tanh(x) * 2.0, ()),
      ("matmul", lambda x, w: x @ w, ("available_memory_proportion",)),
      ("convolution", lambda x, w: jax.lax.conv(x[None, None], w[None, None], (1, 1), "SAME"),
       ("conv_available_memory_proportion",)),
      ("reduction_of_a_matmul", lambda x, w: jnp.sum(jnp.tanh(x @ w)),
       ("available_memory_proportion",)))
  def test_a_program_names_the_proportions_its_plans_read(self, fn, read):
    # A program that read none is the same under any: a split search's probes
    # share such weight updates across proportions (test_split_search.py).
    cfg = self._config(0.3, ipus=1)
    cfg.device.tiles_per_ipu = 16
    lowered = ipu_jax.jit(fn, config=cfg).lower(jnp.ones((8, 8)), jnp.ones((8, 8)))
    self.assertEqual(lowered.tile.proportions_read, frozenset(read))

  def test_pipeline_stage_plans_under_its_ipu(self):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import ipu_jax
    from ipu_jax.lowering.matmul_plan import plan_matmul
    from ipu_jax.ops import pipeline_stage
    from ipu_jax.pipelining import Pipeline

    def loss(params, batch):
      h = jnp.tanh(batch["x"] @ params[0])
      h = pipeline_stage(h, 1)
      return jnp.mean(jnp.tanh(h @ params[1]) ** 2)

    cfg = self._config([0.05, 0.6], ipus=2)
    cfg.device.tiles_per_ipu = 16
    cfg.training.gradient_accumulation_steps = 4
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(256, 256)) * 0.1, jnp.float32) for _ in range(2)]
    batches = {"x": jnp.asarray(rng.normal(size=(4, 64, 256)), jnp.float32)}
    pipe = Pipeline(loss, config=cfg, device_mapping=[1, 0]).lower(params, batches)
    target = IPUTarget.preset("ipu2", tiles_per_ipu=16)
    for stage in pipe.stages:
      amp = [0.05, 0.6][stage.ipu]
      label = plan_matmul(target, 1, 64, 256, 256, np.float32, np.float32, amp).label
      steps = [s.name for s in stage.forward.report.profile.steps if "/matmul " in s.name]
      self.assertTrue(steps and all(label in n for n in steps), (stage.ipu, label, steps))
    # The two IPUs' plans differ, so each stage's shows its own IPU's value.
    self.assertNotEqual(*[plan_matmul(target, 1, 64, 256, 256, np.float32, np.float32, a).label
                          for a in (0.05, 0.6)])


if __name__ == "__main__":
  absltest.main()
