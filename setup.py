"""The package list, found on disk so that no subpackage can be left out.

Everything else is declared in setup.cfg. ``lowering/`` and ``kernels/`` are
installed as ``ipu_jax.lowering`` and ``ipu_jax.kernels`` (setup.cfg's
``package_dir``), which ``packages = find:`` cannot express: it names packages
by their folders. A hand-kept list once left ``ipu_jax.sparse`` out of the
wheel, so a non-editable install could not import it.
"""

import setuptools

# Folders installed under another name: folder -> package (setup.cfg's package_dir).
REMAPPED = {"lowering": "ipu_jax.lowering", "kernels": "ipu_jax.kernels"}


def packages() -> list[str]:
  """``ipu_jax`` and every subpackage on disk, the remapped folders renamed."""
  found = setuptools.find_packages(include=["ipu_jax", "ipu_jax.*"])
  for folder, package in REMAPPED.items():
    found.append(package)
    found += [f"{package}.{name}" for name in setuptools.find_packages(folder)]
  return sorted(found)


if __name__ == "__main__":
  setuptools.setup(packages=packages())
