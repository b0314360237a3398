"""ipu-jax's tests: a regular package, so an installed top-level ``tests`` (icecream,
of the pyscf extra, ships one) cannot shadow it as it would a namespace package."""
