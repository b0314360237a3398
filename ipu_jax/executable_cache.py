"""The executable cache on disk: lowered programs kept between processes.

``IPUConfig.executable_cache_dir`` (or the ``IPU_JAX_EXECUTABLE_CACHE``
environment variable) names a directory; like PopTorch's
``enableExecutableCaching`` and TF-IPU's executable cache, a program lowered
once is loaded by every later process that runs the same program, instead of
being lowered and compiled again. See docs/host_side.md#executable-cache.

Two halves, two mechanisms:

* **The lowered program** (what :class:`ipu_jax.Lowered` keeps after
  lowering: the executor function, its constants, the profile the report is
  made from) is one file, ``programs/<key>.ipuexe``. The executor function is
  made of the rules' closures, which cannot be pickled; what is stored is
  the function itself as JAX exports it (StableHLO, ``jax.export``), with the
  tile storages of the program's constants and the profile, both plain
  NumPy and dataclasses. ``ipu_jax/cached_program.py`` turns a ``Lowered``
  into an entry and back.
* **The compiled executable** is XLA's: JAX's persistent compilation cache is
  pointed at ``<dir>/xla`` with its thresholds at zero, so every program is
  kept; a new process whose jitted program is the same HLO loads the
  executable instead of compiling it.

The key is a SHA-256 of the traced jaxpr as text (equations, shapes, dtypes,
static values, names of its scopes), the bytes of its constants, the
argument names the report shows, the target, the lowering options (all but
the report directory) and the replica setting. Source lines are not in it
(editing a script above its model should not miss): a loaded report shows
the lines of the process that stored the entry. The
library's version (``ipu_jax.__version__``, a fingerprint of its source, the
cost model's version, JAX's and jaxlib's) is written in each file's header
instead: an entry from another version is found, ignored with a warning,
and replaced. A file that is truncated or does not parse is ignored the same
way. Writes go to a temporary file in the same directory, then
``os.replace``: readers see the old file or the new one, never a part, and
processes writing the same entry at once leave one of theirs.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import pickle
import sys
import tempfile
import warnings
from typing import Any, Optional

import jax
import numpy as np

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "CacheWarning", "cache_directory", "program_key",
           "library_versions", "enable_compilation_cache", "disable_compilation_cache",
           "load", "store", "entry_path"]

CACHE_ENV = "IPU_JAX_EXECUTABLE_CACHE"
FORMAT_VERSION = 1
_MAGIC = b"IPU-JAX-EXECUTABLE\n"
_SUFFIX = ".ipuexe"

logger = logging.getLogger("ipu_jax.executable_cache")


class CacheWarning(UserWarning):
  """An executable cache entry that could not be used (and was ignored)."""


def cache_directory(configured: Optional[str]) -> Optional[str]:
  """The cache directory: ``configured``, else ``$IPU_JAX_EXECUTABLE_CACHE``, else None.

  The directory is created and checked writable (once per process and path).

  Raises:
    ValueError: it cannot be created or written, naming the field it came from.
  """
  field = "IPUConfig.executable_cache_dir"
  if configured is None:
    configured = os.environ.get(CACHE_ENV) or None
    field = f"the {CACHE_ENV} environment variable"
  if configured is None:
    return None
  path = os.path.abspath(os.path.expanduser(os.fspath(configured)))
  _check_writable(path, field)
  return path


@functools.lru_cache(maxsize=None)
def _check_writable(path: str, field: str) -> None:
  try:
    os.makedirs(os.path.join(path, "programs"), exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=os.path.join(path, "programs"), prefix=".probe-"):
      pass
  except OSError as error:
    raise ValueError(
        f"{field}={path!r}: the executable cache directory cannot be written "
        f"({error.strerror or error}); give a writable directory, or None to "
        "cache nothing.") from None


@functools.lru_cache(maxsize=None)
def library_versions() -> dict:
  """What an entry is only valid for: the library, its source, JAX, Python."""
  import jaxlib
  import ipu_jax
  from ipu_jax.kernels import cost_model
  return {"format": FORMAT_VERSION, "ipu_jax": ipu_jax.__version__,
          "source": _source_fingerprint(), "cost_model": cost_model.COST_MODEL_VERSION,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "python": ".".join(map(str, sys.version_info[:3]))}


def _source_fingerprint() -> str:
  """SHA-256 of the library's Python source (all three floors).

  ``__version__`` does not move with every change of a working copy; a
  rule edited since an entry was written must not load the old program.
  """
  import ipu_jax
  from ipu_jax import kernels, lowering
  digest = hashlib.sha256()
  for package in (ipu_jax, lowering, kernels):
    root = os.path.dirname(package.__file__)
    for folder, dirs, files in os.walk(root):
      dirs.sort()
      for name in sorted(files):
        if name.endswith(".py"):
          path = os.path.join(folder, name)
          digest.update(os.path.relpath(path, root).encode())
          with open(path, "rb") as f:
            digest.update(f.read())
  return digest.hexdigest()[:16]


def _jaxpr_text(closed) -> str:
  """The jaxpr as text, with each equation's scope (the report's names)."""
  lines = [str(closed)]
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      lines.append(str(eqn.source_info.name_stack))
      for param in eqn.params.values():
        for sub in (param if isinstance(param, (tuple, list)) else (param,)):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)
  walk(closed.jaxpr)
  return "\n".join(lines)


def program_key(closed, **parts: Any) -> str:
  """The entry's key: the jaxpr (text, scopes, constants) and ``parts``' reprs.

  Args:
    closed: the traced ``ClosedJaxpr``.
    **parts: everything else the program depends on (target, options,
      argument names...), each with a deterministic ``repr``.
  """
  digest = hashlib.sha256(_jaxpr_text(closed).encode())
  for const in closed.consts:
    value = np.asarray(const)
    digest.update(f"{value.dtype}{value.shape}".encode())
    digest.update(np.ascontiguousarray(value).tobytes())
  for name in sorted(parts):
    digest.update(f"\n{name}={parts[name]!r}".encode())
  return digest.hexdigest()


def enable_compilation_cache(directory: str) -> None:
  """Point JAX's persistent compilation cache at ``<directory>/xla``, keeping all.

  JAX's thresholds (a second of compile time, a minimum size) would leave
  small programs out; here every compiled program is kept. A cache directory
  the user set for JAX already is left alone.
  """
  global _xla_directory
  wanted = os.path.join(directory, "xla")
  current = jax.config.jax_compilation_cache_dir
  if current == wanted or (current and current != _xla_directory):
    return  # already ours, or the user's own
  _set_compilation_cache(wanted, 0.0, -1)
  _xla_directory = wanted


def disable_compilation_cache() -> None:
  """Undo :func:`enable_compilation_cache` (JAX's defaults again); for tests."""
  global _xla_directory
  if _xla_directory and jax.config.jax_compilation_cache_dir == _xla_directory:
    _set_compilation_cache(None, *_JAX_DEFAULTS)
  _xla_directory = None


# JAX's own thresholds (jax/_src/config.py), restored by disable_compilation_cache.
_JAX_DEFAULTS = (jax.config.jax_persistent_cache_min_compile_time_secs,
                 jax.config.jax_persistent_cache_min_entry_size_bytes)
_xla_directory: Optional[str] = None


def _set_compilation_cache(path, min_seconds, min_bytes) -> None:
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", min_bytes)
  # The cache is set up once per process, at the first compile: one that
  # ran before this directory was named would otherwise leave it unused.
  from jax._src import compilation_cache  # pylint: disable=g-import-not-at-top
  compilation_cache.reset_cache()


def entry_path(directory: str, key: str) -> str:
  return os.path.join(directory, "programs", key + _SUFFIX)


def _ignore(path: str, why: str) -> None:
  warnings.warn(f"executable cache: ignoring {path}: {why}; the program is lowered "
                "again and the entry replaced.", CacheWarning, stacklevel=3)


def load(directory: str, key: str) -> Optional[dict]:
  """The entry stored under ``key``, or None (missing, or ignored with a warning)."""
  path = entry_path(directory, key)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None
  except OSError as error:
    _ignore(path, f"cannot be read ({error})")
    return None
  stream = io.BytesIO(data)
  try:
    if stream.readline() != _MAGIC:
      raise ValueError("not an executable cache file")
    header = json.loads(stream.readline())
    payload = stream.read()
    if len(payload) != header["length"]:
      raise ValueError(f"truncated ({len(payload)} of {header['length']} bytes)")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
      raise ValueError("its checksum does not match (corrupt)")
  except (ValueError, KeyError, TypeError) as error:
    _ignore(path, str(error))
    return None
  if header.get("versions") != library_versions():
    theirs, ours = header.get("versions") or {}, library_versions()
    changed = ", ".join(f"{k} {theirs.get(k)!r} (now {ours[k]!r})" for k in ours
                        if theirs.get(k) != ours[k])
    _ignore(path, f"written by another version: {changed}")
    return None
  try:
    return pickle.loads(payload)
  except Exception as error:  # pylint: disable=broad-except
    _ignore(path, f"does not load ({type(error).__name__}: {error})")
    return None


def store(directory: str, key: str, entry: dict) -> str:
  """Write ``entry`` under ``key`` atomically; returns the file's path."""
  payload = pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)
  header = {"versions": library_versions(), "length": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest()}
  path = entry_path(directory, key)
  folder = os.path.dirname(path)
  handle, temp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=_SUFFIX)
  try:
    with os.fdopen(handle, "wb") as f:
      f.write(_MAGIC)
      f.write(json.dumps(header, sort_keys=True).encode() + b"\n")
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    os.replace(temp, path)
  except BaseException:
    if os.path.exists(temp):
      os.remove(temp)
    raise
  return path
