r"""pyscf-ipu's nanoDFT on the emulated IPU: energies against PySCF, cycles per SCF iteration.

Runs the user's own pyscf-ipu source (graphcore-research/pyscf-ipu, never copied into this
repository: give its checkout with ``--pyscf_ipu_src`` or ``$PYSCF_IPU_SRC``) unchanged:

* ``--backend ipu`` (default): ``nanoDFT(mol, opts)`` with ``opts.backend = "ipu"``, the path
  written for the IPU. ``ipu_jax.tessellate.install_alias()`` makes ``import tessellate_ipu``
  (``ipu_eigh``, ``create_ipu_tile_primitive``, ``tile_map``...) resolve to the emulator's
  TessellateIPU API, nanoDFT's ``jax.pmap(..., backend="ipu")`` SCF program is lowered by
  ``ipu_jax.jit`` (one replica), the ``jax.jit(..., backend="ipu")`` ERI index function it calls
  inside is lowered as part of that program, and pyscf-ipu's C++ vertex file
  ``nanoDFT/compute_indices.cpp`` is compiled from the user's checkout by ``ipu_jax.cpp_codelets``
  (docs/pyscf_ipu.md#status).
* ``--backend cpu``: nanoDFT's CPU path (``jnp.linalg.eigh``, the ERI indices computed with
  ``jax.vmap``), its ``jax.pmap(..., backend="cpu")`` program lowered through ``ipu_jax.jit``
  instead. No TessellateIPU call is made: this is what ipu-jax could run before the alias.

Both compare the final energy with PySCF's RKS (the same molecule, basis, functional and grid
level: ``docs/pyscf_ipu.md#the-reference``) and read the lowered program's report for the
cycles of one SCF iteration and where they go (ERI contraction and its vertices, eigh, the XC
grid, DIIS, the rest).

Usage::

    python -m experiments.pyscf_ipu --molecule=h2o --backend=cpu --pyscf_ipu_src=/path/to/pyscf-ipu
    python -m experiments.pyscf_ipu --molecule=benzene --backend=cpu --json_out=/tmp/benzene.json
    python -m experiments.pyscf_ipu --molecule=h2o --backend=cpu --tiles=64
    python -m experiments.pyscf_ipu --molecule=h2o    # the IPU path (all 1,472 tiles)

(the last three take the checkout from ``$PYSCF_IPU_SRC``).

JSON (``--json_out``): molecule, basis, backend, tiles, iterations, ``energy_hartree`` (nanoDFT,
last iteration), ``reference_hartree`` (PySCF), ``error_hartree``, ``tolerance_hartree``,
``energies_hartree`` (every iteration), ``cycles`` (``total``, ``per_iteration``,
``by_part`` per iteration, ``vertices``), ``wall_seconds``.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import io
import json
import os
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from absl import app
from absl import flags

from experiments import entry

SRC_ENV = "PYSCF_IPU_SRC"
NANODFT_MODULE = "pyscf_ipu.nanoDFT.nanoDFT"
# Files of the user's checkout the IPU path reads (nanoDFT.py imports the first; the second is
# the vertex file sparse_symmetric_ERI.py hands to create_ipu_tile_primitive).
REQUIRED_FILES = ("pyscf_ipu/nanoDFT/nanoDFT.py", "pyscf_ipu/nanoDFT/compute_indices.cpp")
# sparse_symmetric_ERI.ipu_ijkl places its vertices on tiles 1..1471 ((1472 - 1) * 6 shards).
IPU_PATH_TILES = 1472
# Water at its experimental gas-phase geometry (r(OH) = 0.9572 A, HOH = 104.52 degrees; NIST
# CCCBDB). Benzene is nanoDFT's own geometry (pyscf_ipu.nanoDFT.utils.process_mol_str).
H2O = "O 0.0000 0.0000 0.0000; H 0.0000 0.7570 0.5858; H 0.0000 -0.7570 0.5858"
MOLECULES = ("h2o", "benzene")
# Acceptance of issue 41: float32 nanoDFT against PySCF.
TOLERANCE_HARTREE = {"h2o": 1e-4, "benzene": 1e-3}
# nanoDFT's B3LYP uses VWN5 (pyscf_ipu/exchange_correlation/vwn.py's parameters), which PySCF
# >= 2.3 names "b3lyp5" (PySCF 2.2.1, which pyscf-ipu pins, called it "b3lyp").
REFERENCE_XC = "b3lyp5"


class NanoDFTSourceError(RuntimeError):
  """The pyscf-ipu checkout is missing or incomplete."""


class IPUPathUnavailable(RuntimeError):
  """The TessellateIPU alias does not answer what nanoDFT's IPU path calls."""


@dataclasses.dataclass(frozen=True)
class Result:
  """One nanoDFT run against PySCF."""

  molecule: str
  basis: str
  backend: str
  tiles: int
  iterations: int
  energy_hartree: float
  reference_hartree: float
  energies_hartree: list
  cycles: dict
  wall_seconds: dict

  @property
  def error_hartree(self) -> float:
    return abs(self.energy_hartree - self.reference_hartree)

  def to_json(self) -> dict:
    row = dataclasses.asdict(self)
    row["error_hartree"] = self.error_hartree
    row["tolerance_hartree"] = TOLERANCE_HARTREE.get(self.molecule)
    return row


def source_path(path: Optional[str]) -> str:
  """The pyscf-ipu checkout: ``path``, else ``$PYSCF_IPU_SRC``, checked.

  Raises:
    NanoDFTSourceError: no path given, or a file the IPU path needs is not there.
  """
  path = path or os.environ.get(SRC_ENV, "")
  how = (f"clone graphcore-research/pyscf-ipu and pass --pyscf_ipu_src=DIR or set {SRC_ENV}=DIR "
         "(the user's code is run from its checkout, not copied into ipu-jax)")
  if not path:
    raise NanoDFTSourceError(f"No pyscf-ipu source given: {how}.")
  path = os.path.abspath(os.path.expanduser(path))
  missing = [f for f in REQUIRED_FILES if not os.path.isfile(os.path.join(path, f))]
  if missing:
    raise NanoDFTSourceError(f"{path} is not a pyscf-ipu checkout (missing {', '.join(missing)}): "
                             f"{how}.")
  return path


def load_nanodft(src: str, backend: str):
  """Imports pyscf-ipu's nanoDFT module from ``src`` (the alias first, for the IPU path).

  The alias must be in place before pyscf-ipu is imported: its modules apply
  ``jax.jit(..., backend="ipu")`` as decorators and import ``tessellate_ipu`` when loaded.
  """
  if backend == "ipu":
    from ipu_jax import tessellate
    tessellate.install_alias()
  if src not in sys.path:
    sys.path.insert(0, src)
  module = importlib.import_module(NANODFT_MODULE)
  where = os.path.abspath(module.__file__)
  if not where.startswith(src + os.sep):
    raise NanoDFTSourceError(f"{NANODFT_MODULE} was imported from {where}, not from {src}: "
                             "another pyscf_ipu is on the path.")
  return module


def check_ipu_path() -> None:
  """Checks that ``jax.pmap(..., backend="ipu")``, nanoDFT's outer program, reaches ipu-jax.

  Run after ``install_alias()``: a one-element pmap, so that a missing answer (JAX's own
  ``jax.pmap`` back in place, e.g. another patch over the alias's) is a clear error before nanoDFT
  builds its integrals, not JAX's "Unknown backend ipu" at the end.

  Raises:
    IPUPathUnavailable: JAX is asked for an "ipu" backend it does not have.
  """
  import jax
  try:
    jax.pmap(lambda x: x, backend="ipu")(np.zeros(1, np.float32))
  except RuntimeError as error:
    if "Unknown backend" not in str(error):
      raise
    raise IPUPathUnavailable(
        "nanoDFT runs its SCF program as jax.pmap(..., backend=\"ipu\"), which reached JAX "
        "instead of ipu_jax.tessellate.install_alias()'s pmap: is jax.pmap patched by something "
        "else? See docs/pyscf_ipu.md#status; --backend=cpu runs nanoDFT's CPU path through "
        "ipu_jax.jit.") from error


def molecule_and_options(nd, molecule: str, basis: str, backend: str, iterations: int,
                         level: int):
  """nanoDFT's options (its own ``nanoDFT_options``, float32) and the PySCF molecule.

  ``nanoDFT_options`` resolves molecule names other than its built-in ones through PubChem (a
  network lookup), so it is given benzene's name and water's geometry is built here.
  """
  opts, benzene = nd.nanoDFT_options(its=iterations, mol_str="benzene", float32=True,
                                     basis=basis, backend=backend, level=level,
                                     molecule_name=molecule)
  atoms = benzene if molecule == "benzene" else H2O
  return opts, nd.build_mol(atoms, basis)


@contextlib.contextmanager
def cpu_path_through_ipu_jax():
  """Inside: ``jax.pmap(f, backend="cpu", ...)`` is lowered by ``ipu_jax.jit``.

  nanoDFT's CPU path runs its whole SCF program as ``jax.pmap(..., backend="cpu")`` (one
  replica, ``psum`` over axis "p"); ipu-jax lowers a pmap inside ``ipu_jax.jit`` as IPU replicas,
  so the same program is emulated. Other backends are left to JAX.
  """
  import jax
  import ipu_jax
  plain_pmap = jax.pmap

  def pmap(fun, *args, backend=None, **kwargs):
    if backend == "cpu":
      return ipu_jax.jit(plain_pmap(fun, *args, **kwargs))
    return plain_pmap(fun, *args, backend=backend, **kwargs)

  jax.pmap = pmap
  try:
    yield
  finally:
    jax.pmap = plain_pmap


def _quiet_user_prints(verbose: bool):
  """nanoDFT prints its arrays' shapes and icecream's ``ic`` lines; shown with --verbose only."""
  if verbose:
    return contextlib.nullcontext()
  try:
    from icecream import ic
    ic.disable()
  except ImportError:
    pass
  return contextlib.redirect_stdout(io.StringIO())


def run_nanodft(nd, mol, opts, tiles: int, report_dir: str, verbose: bool = False):
  """Runs ``nanoDFT(mol, opts)`` under an ``ipu_jax`` config of ``tiles`` tiles.

  Every program ``ipu_jax.jit`` lowers on the way saves its report under ``report_dir``.

  Returns:
    ``(energies_hartree, seconds)``: the energy after each SCF iteration, and the wall time.
  """
  import ipu_jax
  config = ipu_jax.IPUConfig()
  config.device.tiles_per_ipu = tiles
  config.report.directory = report_dir
  path = cpu_path_through_ipu_jax() if opts.backend == "cpu" else contextlib.nullcontext()
  started = time.perf_counter()
  with ipu_jax.default_config(config), path, _quiet_user_prints(verbose):
    energies_ev = nd.nanoDFT(mol, opts)[0]
  seconds = time.perf_counter() - started
  return [float(e) / nd.HARTREE_TO_EV for e in energies_ev[:, 0]], seconds


def reference_energy(mol, level: int) -> float:
  """PySCF's converged RKS energy: nanoDFT's functional (B3LYP with VWN5) and grid level."""
  from pyscf import dft
  mf = dft.RKS(mol)
  mf.xc = REFERENCE_XC
  mf.grids.level = level
  mf.verbose = 0
  return float(mf.kernel())


# -- Where the cycles go --------------------------------------------------------

PARTS = ("eri", "eigh", "grid", "diis", "other")
PART_NAMES = {
    "eri": "ERI contraction (J/K: index vertices, gather, scatter-add)",
    "eigh": "eigh (Fock matrix and DIIS's pinv)",
    "grid": "XC on the grid (density, B3LYP, V_xc)",
    "diis": "DIIS (without its eigh)",
    "other": "the rest (Fock update, density matrix, energy log)",
}
# nanoDFT.py's functions and the part of an SCF iteration each is.
NANODFT_FUNCTIONS = {"exchange_correlation": "grid", "get_JK": "eri", "linalg_eigh": "eigh",
                     "pinv0": "eigh", "DIIS": "diis"}
# pyscf-ipu's C++ vertex classes on the ERI path (nanoDFT/compute_indices.cpp).
ERI_VERTICES = ("IndicesIJKL",)


def main_report(report_dir: str):
  """The report of nanoDFT's SCF program among those saved under ``report_dir``.

  Raises:
    RuntimeError: no program named after ``_nanoDFT`` was lowered.
  """
  import ipu_jax
  reports = [ipu_jax.load_report(os.path.join(report_dir, name))
             for name in sorted(os.listdir(report_dir))
             if os.path.isfile(os.path.join(report_dir, name, "report.json"))]
  scf = [r for r in reports if "nanoDFT" in r.name]
  if not scf:
    raise RuntimeError(f"No nanoDFT program was lowered by ipu_jax (reports: "
                       f"{[r.name for r in reports]}): the run did not go through ipu_jax.")
  return max(scf, key=lambda r: r.total_cycles)


@functools.lru_cache(maxsize=None)
def _functions(path: str) -> tuple:
  """``(first_line, last_line, name)`` of every function defined in the file at ``path``."""
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
  except (OSError, SyntaxError):
    return ()
  return tuple((node.lineno, node.end_lineno, node.name) for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def function_at(source: str) -> str:
  """The innermost function around ``path:line`` ('' when none or unknown)."""
  path, _, line = source.rpartition(":")
  if not line.isdigit():
    return ""
  around = [(last - first, name) for first, last, name in _functions(path)
            if first <= int(line) <= last]
  return min(around)[1] if around else ""


def step_part(step: dict, src: str) -> str:
  """Which part of an SCF iteration a superstep of the report belongs to (``PARTS``)."""
  if any(vertex in codelet for codelet in step.get("codelets") or () for vertex in ERI_VERTICES):
    return "eri"
  source = step.get("source") or ""
  path = source.rpartition(":")[0]
  if step.get("op") == "eigh" or f"tessellate{os.sep}linalg" in path:
    return "eigh"
  if not path.startswith(src + os.sep):
    return "other"
  if path.endswith("sparse_symmetric_ERI.py"):
    return "eri"
  if f"{os.sep}exchange_correlation{os.sep}" in path:
    return "grid"
  if path.endswith("nanoDFT.py"):
    return NANODFT_FUNCTIONS.get(function_at(source), "other")
  return "other"


def scf_loop(tree: dict, iterations: int) -> dict:
  """The program tree's node of the SCF ``fori_loop``: the outermost repeat of ``iterations``."""
  level = [tree]
  while level:
    loops = [n for n in level if n.get("kind") == "repeat" and n.get("iterations") == iterations]
    if loops:
      return max(loops, key=lambda n: n["total_cycles"])
    level = [c for n in level for c in n.get("children", ())]
  raise RuntimeError(f"No loop of {iterations} iterations in the nanoDFT program.")


def _step_cycles(steps: list) -> np.ndarray:
  return np.array([(s["compute_cycles_max"] + s["exchange_cycles"] + s["sync_cycles"])
                   * s["executions"] for s in steps], dtype=np.float64)


def _vertex_cycles(steps: list, iterations: int, count: int = 8) -> dict:
  """Compute cycles per SCF iteration by vertex type (a compute set's shared equally)."""
  by_vertex = {}
  for step in steps:
    codelets = step.get("codelets") or [step.get("op", "?")]
    share = step["compute_cycles_max"] * step["executions"] / len(codelets) / iterations
    for codelet in codelets:
      by_vertex[codelet] = by_vertex.get(codelet, 0.0) + share
  top = sorted(by_vertex.items(), key=lambda kv: -kv[1])[:count]
  return {name: round(cycles) for name, cycles in top}


def breakdown(report, iterations: int, src: str) -> dict:
  """Cycles of the program and of one SCF iteration, by part and by vertex type."""
  document = report.to_dict()
  loop = scf_loop(report.program_tree(), iterations)
  first, last = loop["steps"]
  steps = document["steps"][first:last + 1]
  cycles = _step_cycles(steps)
  parts = np.array([step_part(s, src) for s in steps])
  return {
      "total": float(report.total_cycles),
      "per_iteration": float(loop["total_cycles"]) / iterations,
      "by_part": {p: float(cycles[parts == p].sum()) / iterations for p in PARTS},
      "vertices": _vertex_cycles(steps, iterations),
      "clock_hz": float(report.target.clock_hz),
      "program": report.name,
  }


def format_breakdown(cycles: dict) -> list:
  """The summary's lines on cycles."""
  per = cycles["per_iteration"]
  lines = [f"  cycles:    {cycles['total']:,.0f} per run, {per:,.0f} per SCF iteration "
           f"({per / cycles['clock_hz'] * 1e3:.3f} ms at {cycles['clock_hz'] / 1e9:.3f} GHz)"]
  for part in PARTS:
    share = cycles["by_part"][part]
    lines.append(f"    {PART_NAMES[part]:<56} {share:>14,.0f}  {share / per:6.1%}")
  lines.append("  compute cycles per SCF iteration by vertex type (top):")
  for name, value in cycles["vertices"].items():
    lines.append(f"    {value:>14,}  {name[:90]}")
  return lines


def run(molecule: str, src: Optional[str] = None, basis: str = "sto-3g", backend: str = "ipu",
        tiles: int = IPU_PATH_TILES, iterations: int = 20, level: int = 0,
        report_dir: Optional[str] = None, verbose: bool = False) -> Result:
  """nanoDFT on ``molecule`` through ipu-jax, against PySCF, with its cycles.

  Raises:
    NanoDFTSourceError: no usable pyscf-ipu checkout.
    IPUPathUnavailable: the alias does not answer nanoDFT's IPU path.
    ValueError: an unknown molecule or backend, or too few tiles for the IPU path.
  """
  if molecule not in MOLECULES:
    raise ValueError(f"--molecule={molecule!r}: one of {', '.join(MOLECULES)}.")
  if backend not in ("ipu", "cpu"):
    raise ValueError(f"--backend={backend!r}: 'ipu' (TessellateIPU path) or 'cpu'.")
  if backend == "ipu" and tiles < IPU_PATH_TILES:
    raise ValueError(f"--tiles={tiles}: pyscf-ipu's IPU path places vertices on tiles 1..1471 "
                     "(nanoDFT/sparse_symmetric_ERI.py, ipu_ijkl: (1472 - 1) * 6 shards); use "
                     f"--tiles={IPU_PATH_TILES} (or --backend=cpu for fewer tiles).")
  src = source_path(src)
  nd = load_nanodft(src, backend)
  if backend == "ipu":
    check_ipu_path()
  with _quiet_user_prints(verbose):
    opts, mol = molecule_and_options(nd, molecule, basis, backend, iterations, level)
  with contextlib.ExitStack() as stack:
    if report_dir is None:
      report_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="pyscf_ipu_"))
    energies, seconds = run_nanodft(nd, mol, opts, tiles, report_dir, verbose)
    report = main_report(report_dir)
    cycles = breakdown(report, iterations, src)
  started = time.perf_counter()
  reference = reference_energy(mol, level)
  return Result(molecule=molecule, basis=basis, backend=backend, tiles=tiles,
                iterations=iterations, energy_hartree=energies[-1], reference_hartree=reference,
                energies_hartree=energies, cycles=cycles,
                wall_seconds={"nanodft": seconds, "pyscf": time.perf_counter() - started})


def summary(result: Result) -> str:
  """The lines the runner prints."""
  row = result.to_json()
  lines = [
      f"nanoDFT {result.molecule}/{result.basis}, backend={result.backend}, "
      f"{result.tiles} tiles, {result.iterations} SCF iterations (float32)",
      f"  energy:    {result.energy_hartree:.8f} Ha (last iteration)",
      f"  PySCF:     {result.reference_hartree:.8f} Ha (RKS {REFERENCE_XC}, converged)",
      f"  |error|:   {result.error_hartree:.2e} Ha (tolerance {row['tolerance_hartree']:.0e})",
  ]
  lines += format_breakdown(result.cycles)
  lines.append(f"  wall time: nanoDFT {result.wall_seconds['nanodft']:.1f} s (lowering, XLA "
               f"compile and run), PySCF {result.wall_seconds['pyscf']:.1f} s")
  return "\n".join(lines)


def define_flags(fv=None):
  """Defines the runner's flags (when it runs, not on import: other runners share names)."""
  fv = flags.FLAGS if fv is None else fv
  global _MOLECULE, _BASIS, _TILES, _JSON_OUT, _SRC, _BACKEND, _ITS, _LEVEL, _REPORT_DIR, _VERBOSE
  _MOLECULE = flags.DEFINE_enum("molecule", "h2o", MOLECULES, "Molecule.", flag_values=fv)
  _BASIS = flags.DEFINE_string("basis", "sto-3g", "Gaussian basis set (PySCF's names).",
                               flag_values=fv)
  _TILES = flags.DEFINE_integer("tiles", IPU_PATH_TILES,
                                "Tiles per IPU (ipu2); the IPU path needs all 1,472.",
                                lower_bound=1, flag_values=fv)
  _JSON_OUT = flags.DEFINE_string("json_out", "", "Where to write the result as JSON.",
                                  flag_values=fv)
  _SRC = flags.DEFINE_string("pyscf_ipu_src", None,
                             f"pyscf-ipu checkout (default: ${SRC_ENV}).", flag_values=fv)
  _BACKEND = flags.DEFINE_enum("backend", "ipu", ["ipu", "cpu"],
                               "nanoDFT's backend: its IPU (TessellateIPU) path or its CPU path; "
                               "both lowered by ipu_jax.", flag_values=fv)
  _ITS = flags.DEFINE_integer("its", 20, "SCF iterations (nanoDFT's default).", lower_bound=1,
                              flag_values=fv)
  _LEVEL = flags.DEFINE_integer("level", 0, "Grid level (nanoDFT's default 0).", lower_bound=0,
                                flag_values=fv)
  _REPORT_DIR = flags.DEFINE_string("report_dir", None,
                                    "Keep the lowered programs' reports here.", flag_values=fv)
  _VERBOSE = flags.DEFINE_bool("verbose", False, "Show nanoDFT's own prints.", flag_values=fv)
  return fv


def main(argv):
  del argv
  entry.quiet_backend_probe()
  try:
    result = run(_MOLECULE.value, _SRC.value, basis=_BASIS.value, backend=_BACKEND.value,
                 tiles=_TILES.value, iterations=_ITS.value, level=_LEVEL.value,
                 report_dir=_REPORT_DIR.value, verbose=_VERBOSE.value)
  except (NanoDFTSourceError, IPUPathUnavailable, ValueError) as error:
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    return 1
  print(summary(result))
  if _JSON_OUT.value:
    os.makedirs(os.path.dirname(_JSON_OUT.value) or ".", exist_ok=True)
    with open(_JSON_OUT.value, "w") as f:
      json.dump(result.to_json(), f, indent=1)
    print(f"json: {_JSON_OUT.value}")
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(entry.reporting_errors(main))
