"""Test set-up: absl flags parsed, x64 off, a fixed small host device count."""

from absl import flags

flags.FLAGS.mark_as_parsed()


# The longest end-to-end runs (about a minute of CPU each on the 2-core CI
# machine) run with `-m slow`, beside the fuzz and operator-record runs, so
# the default suite stays within CI's 15 minutes. Each is covered in the
# default run by a smaller test of the same path (the mnist runner and help
# examples, the 2-layer training-step checks, the other Poplar tutorials).
_LONG_RUNS = (
    "test_graph_tutorials.py::Tutorial4Test::test_tut4",
    "test_experiments_help.py::HelpExamplesTest::test_example_runs_cifar_cnn_0",
    "test_experiments_help.py::HelpExamplesTest::test_example_runs_transformer_0",
    "test_experiments.py::test_cifar_cnn_runner",
    "test_experiments.py::test_transformer_runner",
    "test_models_e2e.py::TrainingStepTest::test_training_step_matches_jax2",
    "test_models_e2e.py::TrainingStepTest::test_training_step_matches_jax3",
    "test_lowering_surface.py::SurfaceTest::test_gamma_beta_dirichlet0",
    "test_lowering_surface.py::SurfaceTest::test_gamma_beta_dirichlet1",
)


def pytest_collection_modifyitems(config, items):
  del config
  import pytest
  for item in items:
    if item.nodeid.split("tests/")[-1] in _LONG_RUNS:
      item.add_marker(pytest.mark.slow)
