"""Test set-up: absl flags parsed, x64 off, a fixed small host device count."""

from absl import flags

flags.FLAGS.mark_as_parsed()
