"""``python -m ipu_jax.report``; see :mod:`ipu_jax.report.cli`."""

import sys

from ipu_jax.report.cli import main

if __name__ == "__main__":
  sys.exit(main())
