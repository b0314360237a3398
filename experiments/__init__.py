"""Runners of ipu-jax experiments (absl flags): ``python -m experiments.mnist``,
``experiments.cifar_cnn``, ``experiments.transformer``. Shared flags live in
:mod:`experiments.common`."""
