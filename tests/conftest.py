"""Test set-up: absl flags parsed, one XLA compilation cache per run, the slow marks, RSS budget."""

import os
import shutil
import sys
import tempfile

from absl import flags

flags.FLAGS.mark_as_parsed()


# One XLA compilation cache for the whole run. Many tests build the same XLA
# program (a model's reference step, an emulated program a runner subprocess
# compiles again, a file's repeated shapes): JAX's persistent compilation cache
# in a fresh temporary directory, shared by the xdist workers and the
# subprocesses they start (they inherit the environment), compiles each once.
# A hit is the executable XLA compiled for the same program and options, so
# nothing a test checks changes; the suite took 7-14 % less CPU time
# (docs/performance_history.md, the test suite's time).
# A cache the user set (JAX_COMPILATION_CACHE_DIR) is used as it is;
# IPU_JAX_TEST_XLA_CACHE=0 runs without one.
_XLA_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}
_XLA_CACHE_DIR = "JAX_COMPILATION_CACHE_DIR"
_created_cache = []


def pytest_configure(config):
  if hasattr(config, "workerinput") or os.environ.get(_XLA_CACHE_DIR):
    return  # an xdist worker (it inherited the controller's) or the user's own
  if os.environ.get("IPU_JAX_TEST_XLA_CACHE", "1") == "0":
    return
  directory = tempfile.mkdtemp(prefix="ipu_jax_tests_xla_")
  _created_cache.append(directory)
  os.environ[_XLA_CACHE_DIR] = directory
  os.environ.update(_XLA_CACHE_SETTINGS)
  if "jax" in sys.modules:  # imported before this hook (a plugin): JAX read its env already
    import jax
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_unconfigure(config):
  del config
  for directory in _created_cache:
    shutil.rmtree(directory, ignore_errors=True)


# The longest end-to-end runs (about a minute of CPU each on the 2-core CI
# machine) run with `-m slow`, beside the fuzz and operator-record runs, so
# the default suite stays within CI's 15 minutes. Each is covered in the
# default run by a smaller test of the same path (the mnist runner and help
# examples, the 2-layer training-step checks). Poplar's tut4 on 1,472 tiles
# is back in the default run since its graph lowering plans on runs (about
# 5 s of CPU, 12 s before).
_LONG_RUNS = (
    "test_experiments_help.py::HelpExamplesTest::test_example_runs_cifar_cnn_0",
    "test_experiments_help.py::HelpExamplesTest::test_example_runs_transformer_0",
    "test_experiments.py::test_cifar_cnn_runner",
    "test_experiments.py::test_transformer_runner",
    "test_models_e2e.py::TrainingStepTest::test_training_step_matches_jax2",
    "test_models_e2e.py::TrainingStepTest::test_training_step_matches_jax3",
    "test_lowering_surface.py::SurfaceTest::test_gamma_beta_dirichlet0",
    "test_lowering_surface.py::SurfaceTest::test_gamma_beta_dirichlet1",
    "test_report_scopes.py::MainJobTest::test_main_job_fit_costs_carry_scopes",
    # Each beside a smaller default test of the same path: the Sequential
    # BERT pipeline (Grouped runs in test_pipelining), the other two
    # sequence-parallel families, phased ping-pong with TP and serial with
    # RTS, the TP model at tp=4, LAMB sharded in a pipeline
    # (test_sharded_optimizers), dropout in pipelines (PipelineRngTest), the
    # fused batch norm against Flax's, the transformer step at 1,472 tiles,
    # the pipelined fit's first fit.
    "test_bert_pipeline.py::BertPipelineTest::test_weights_equal_plain_accumulation0",
    "test_bert_pipeline.py::BertDropoutPipelineTest::"
    "test_dropout_is_reproducible_and_equals_plain_accumulation",
    "test_llm_runner.py::SequenceParallelModelTest::test_loss_and_gradients_equal_the_unsplit_model0",
    "test_llm_runner.py::LLMRunnerTest::test_check_passes_and_can_fail",
    "test_phased.py::PhasedTrainingTest::"
    "test_three_steps_equal_plain_jax_gradient_accumulation_ping_pong_rts2_g4",
    "test_phased.py::TensorParallelPhasedTest::test_three_steps_equal_unsplit_gradient_accumulation_serial",
    "test_tensor_parallel.py::TensorParallelTransformerTest::test_equals_unsplit_model0",
    "test_pipelined_fit.py::ShardedStatePipelinedFitTest::"
    "test_trains_what_the_unsharded_fit_trains_and_resumes_from_its_shards",
    "test_pipelined_fit.py::KerasPipelinedFitTest::test_a_second_fit_goes_on",
    "test_resnet_runner.py::ResNetRunnerTest::test_one_training_step_equals_plain_jit",
    "test_models_e2e.py::TrainingStepTest::test_training_step_matches_jax4",
    # The Sequential BERT pipeline against plain accumulation (BERT's weights
    # against plain accumulation stay in PopartLastStageTest, split layers in
    # AttentionFfnPlacementTest) and the split search's exhaustive check of
    # every candidate (its composed figures stay in ComposedFiguresTest, the
    # search itself in the other SplitSearchTest tests and AutoSplitTest).
    "test_bert_pipeline.py::BertPipelineTest::test_weights_equal_plain_accumulation1",
    "test_split_search.py::SplitSearchTest::test_answer_is_the_best_of_every_candidate_lowered",
    # Runs in a subprocess beside in-process runs of the same runner and flags
    # (test_experiments.py: LayerCostsRunnerTest, the mnist script with
    # replicas and accumulation; the help texts still list the examples), and
    # the serial phased step without RTS beside the one with it (and ping-pong
    # with TP).
    "test_experiments_help.py::LayerCostsHelpTest::test_examples_run",
    "test_experiments_help.py::HelpExamplesTest::test_example_runs_mnist_1",
    "test_phased.py::PhasedTrainingTest::test_three_steps_equal_plain_jax_gradient_accumulation_serial_g4",
)

# Whole classes: a small BERT on a POD64 (its set-up alone is a minute; the
# POD16 pipeline tests and the throughput tests of test_pipeline_costs stay).
_LONG_CLASSES = (
    "test_bert_pretraining.py::SmallBertOnAPodTest::",
)


def pytest_collection_modifyitems(config, items):
  del config
  import pytest
  for item in items:
    nodeid = item.nodeid.split("tests/")[-1]
    if nodeid in _LONG_RUNS or nodeid.startswith(_LONG_CLASSES):
      item.add_marker(pytest.mark.slow)


# Host memory of the suite. A new user's first run may be on a small machine,
# so each test process's peak resident set is measured (the kernel's own
# high-water mark, ru_maxrss) and held to a budget. Every process records the
# tests during which its high-water mark rose; under pytest-xdist the workers
# hand their records to the controller (workeroutput), which prints them and
# fails the run when a process went over the budget.
_RSS_BUDGET_ENV = "IPU_JAX_TEST_RSS_BUDGET_GB"
_RSS_BUDGET_GB = 4.0
_RSS_SHOWN = 8


def pytest_runtest_teardown(item, nextitem):
  """After a test file's last test, its compiled programs are let go.

  JAX keeps every compiled executable of a process in its caches; the next
  file does not run them again, so clearing them keeps a test process's
  memory to the file it is running. What survives the collection (imported
  modules, earlier files' module globals) is frozen out of the cyclic
  collector: each later collection, this one and Python's own, then walks
  only what was made since, where it walked every survivor of the run so far
  (0.29 s a file, 0.03 s frozen, over 40 files). A frozen object left in a
  cycle later is kept to the process's end; the RSS budget below still
  bounds each process.
  """
  if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
    import gc
    import jax
    jax.clear_caches()
    gc.collect()
    gc.freeze()


def _peak_rss_bytes():
  import resource
  import sys
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024  # Linux: KiB


class _RssRecorder:
  """Peak RSS of this process and the tests that raised it."""

  def __init__(self):
    self.rises = []          # (nodeid, peak after the test, rise during it)
    self.peak = _peak_rss_bytes()

  def after(self, nodeid):
    peak = _peak_rss_bytes()
    if peak > self.peak:
      self.rises.append((nodeid, peak, peak - self.peak))
      self.peak = peak

  def record(self):
    largest = sorted(self.rises, key=lambda r: -r[2])[:_RSS_SHOWN]
    return {"peak": self.peak, "largest_rises": largest}


_RECORDER = _RssRecorder()
_PROCESS_RECORDS = {}


def _rss_budget_bytes():
  import os
  return float(os.environ.get(_RSS_BUDGET_ENV, _RSS_BUDGET_GB)) * 1e9


def pytest_runtest_logfinish(nodeid, location):
  del location
  _RECORDER.after(nodeid)


def pytest_sessionfinish(session, exitstatus):
  del exitstatus
  workeroutput = getattr(session.config, "workeroutput", None)
  if workeroutput is not None:     # an xdist worker: hand the record over
    import json
    workeroutput["ipu_jax_rss"] = json.dumps(_RECORDER.record())
  elif not _PROCESS_RECORDS:       # no workers: this process ran the tests
    _PROCESS_RECORDS["main"] = _RECORDER.record()
  if any(r["peak"] > _rss_budget_bytes() for r in _PROCESS_RECORDS.values()):
    session.exitstatus = 1


def pytest_testnodedown(node, error):
  del error
  import json
  record = getattr(node, "workeroutput", {}).get("ipu_jax_rss")
  if record is not None:
    _PROCESS_RECORDS[node.gateway.id] = json.loads(record)


def pytest_terminal_summary(terminalreporter):
  if not _PROCESS_RECORDS:
    return
  budget = _rss_budget_bytes()
  write = terminalreporter.write_line
  terminalreporter.section("peak RSS per test process")
  for name, record in sorted(_PROCESS_RECORDS.items()):
    verdict = "over the budget" if record["peak"] > budget else "within"
    write(f"{name}: {record['peak'] / 1e9:.2f} GB ({verdict} {budget / 1e9:.1f} GB, "
          f"{_RSS_BUDGET_ENV})")
    for nodeid, peak, rise in record["largest_rises"]:
      if rise < 1e7:   # under 10 MB: noise
        continue
      write(f"    +{rise / 1e9:.2f} GB to {peak / 1e9:.2f} GB  {nodeid}")
  if any(r["peak"] > budget for r in _PROCESS_RECORDS.values()):
    write(f"A test process went over {budget / 1e9:.1f} GB of peak RSS: the run fails "
          "(the tests above raised it most).", red=True, bold=True)
