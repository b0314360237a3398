"""Checks an installed (non-editable) ipu-jax: run by .ci/wheel_check in a fresh venv.

Imports every subpackage and module from the installed copy (not the source
tree), finds the report page's assets beside the installed package, and runs
the README's "A taste" example as printed, which saves a report.
"""

import importlib
import importlib.resources
import os
import pathlib
import pkgutil
import re
import sys


def import_everything(package) -> list[str]:
  """Imports each module below ``package``; returns their names."""
  names = [info.name for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]
  for name in names:
    importlib.import_module(name)
  return names


def taste_example(readme: pathlib.Path) -> str:
  """The first Python block of the README's "A taste" section."""
  section = readme.read_text().split("## A taste", 1)[1]
  return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def main(repo: pathlib.Path) -> None:
  import ipu_jax  # pylint: disable=import-outside-toplevel
  installed = pathlib.Path(ipu_jax.__file__).resolve().parent
  if repo in installed.parents:
    sys.exit(f"ipu_jax was imported from the source tree ({installed}), not the wheel")
  names = import_everything(ipu_jax)
  for required in ("ipu_jax.sparse", "ipu_jax.lowering.rules", "ipu_jax.kernels.target"):
    if required not in names:
      sys.exit(f"{required} is missing from the installed package")
  assets = importlib.resources.files("ipu_jax.report") / "assets"
  missing = [f for f in ("report.html", "report.js", "views.js", "report.css")
             if not (assets / f).is_file()]
  if missing:
    sys.exit(f"report assets missing from the installed package: {missing}")
  exec(compile(taste_example(repo / "README.md"), "README.md: A taste", "exec"), {})  # pylint: disable=exec-used
  page = pathlib.Path("reports/tanh/report.html")
  if not page.is_file() or page.stat().st_size < 1000:
    found = sorted(str(p) for p in pathlib.Path(".").rglob("*") if p.is_file())
    sys.exit(f"the taste example saved no report.html in {os.getcwd()}; found {found[:20]}")
  print(f"wheel check: {len(names)} modules import from {installed}; assets present; "
        f"the README's taste example ran and saved {page} ({page.stat().st_size:,} bytes)")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  main(pathlib.Path(sys.argv[1]).resolve())
