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
  the function itself as JAX exports it (StableHLO, ``jax.export``, field
  by field), with the tile storages of the program's constants
  and the profile (NumPy arrays and the project's dataclasses).
  ``ipu_jax/cached_program.py`` turns a ``Lowered`` into an entry and back.
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
way.

Nothing read from the cache can run code: the payload is an ``.npz``
archive read with ``allow_pickle=False`` (no object arrays), holding a JSON
document and plain arrays (:class:`EntryCodec`). Objects are rebuilt only as
the types the codec is given (a whitelist of the project's dataclasses, by
name, and a few explicit converters), never by a name the file gives. Entries
of format 1 were pickles; they are ignored with a warning, never unpickled
(anyone able to write the directory could otherwise run code in every
process reading it). Writes go to a temporary file in the same directory, then
``os.replace``: readers see the old file or the new one, never a part, and
processes writing the same entry at once leave one of theirs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import logging
import os
import sys
import tempfile
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from ipu_jax.lowering import jax_compat
from ipu_jax.lowering.jax_compat import physical_value

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "CacheWarning", "Converter", "EntryCodec",
           "cache_directory", "program_key", "library_versions", "enable_compilation_cache",
           "disable_compilation_cache", "load", "store", "entry_path"]

CACHE_ENV = "IPU_JAX_EXECUTABLE_CACHE"
# 1: a pickle (never loaded now); 2: an .npz of a JSON document and plain arrays.
FORMAT_VERSION = 2
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
    value = physical_value(const)
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
  jax_compat.compilation_cache.reset_cache()


def entry_path(directory: str, key: str) -> str:
  return os.path.join(directory, "programs", key + _SUFFIX)


def _ignore(path: str, why: str) -> None:
  warnings.warn(f"executable cache: ignoring {path}: {why}; the program is lowered "
                "again and the entry replaced.", CacheWarning, stacklevel=3)


class Converter:
  """How one non-dataclass type goes into an entry and back.

  Args:
    kind: its tag in the entry's document (unique within a codec).
    cls: the type (instances of exactly this type use the converter).
    encode: ``value -> plain value`` (lists, tuples, dicts, numbers, strings,
      arrays, whitelisted dataclasses), stored like any other.
    decode: the plain value read back -> the object.
  """

  def __init__(self, kind: str, cls: type, encode: Callable[[Any], Any],
               decode: Callable[[Any], Any]):
    self.kind, self.cls, self.encode, self.decode = kind, cls, encode, decode


class _Arrays:
  """The arrays of an entry being written, each stored once (by identity).

  They are packed into one flat array per dtype: an ``.npz`` member costs
  tens of microseconds to read, and a large profile holds tens of thousands
  of small per-tile arrays.
  """

  def __init__(self):
    self.stored: list = []
    self._index: dict = {}
    self._keep: list = []  # the values whose ids are keys (ids stay theirs)

  def index_of(self, value, array: np.ndarray) -> int:
    if isinstance(value, np.ndarray) and id(value) in self._index:
      return self._index[id(value)]
    if array.dtype.isbuiltin == 2:
      array = array.view(f"u{array.dtype.itemsize}")
    self.stored.append(array)
    if isinstance(value, np.ndarray):
      self._index[id(value)] = len(self.stored) - 1
      self._keep.append(value)
    return len(self.stored) - 1

  def pack(self) -> tuple:
    """``(table, groups)``: per array ``[group, offset, shape]``; group name -> flat array."""
    names: dict = {}
    parts: dict = {}
    sizes: dict = {}
    table = []
    for array in self.stored:
      name = names.setdefault(array.dtype.str, f"g{len(names)}")
      parts.setdefault(name, []).append(np.ravel(array))
      table.append([name, sizes.get(name, 0), list(array.shape)])
      sizes[name] = sizes.get(name, 0) + array.size
    return table, {name: np.concatenate(group) for name, group in parts.items()}


def _unpack(table: list, groups: dict) -> list:
  """The arrays :meth:`_Arrays.pack` packed (views of the groups)."""
  arrays = []
  for name, offset, shape in table:
    group = groups[str(name)]
    size = int(np.prod(shape, dtype=np.int64))
    if not 0 <= offset <= offset + size <= group.size:
      raise ValueError(f"an array of the entry lies outside its group {name!r}")
    arrays.append(group[offset:offset + size].reshape(shape))
  return arrays


_SCALARS = (type(None), bool, int, float, str)
_RESERVED = ("tuple", "dict", "array", "scalar", "dtype")


class EntryCodec:
  """Entries as one ``.npz`` payload (a JSON document plus plain arrays), and back.

  Only what the codec is given can come back: JSON scalars, lists, tuples,
  dicts (any keys), NumPy arrays and scalars of non-object dtypes, dtypes,
  the dataclasses listed in ``classes`` (rebuilt field by field, no ``__init__`` run:
  the values are the ones the writing process held) and the types of the
  ``converters``. A document naming anything else is refused.

  Args:
    classes: the dataclass types an entry may hold; their class names are
      their tags, so they must be distinct.
    converters: :class:`Converter` s for the other types.
  """

  def __init__(self, classes: Sequence[type], converters: Sequence[Converter] = ()):
    self._classes = {cls.__name__: cls for cls in classes}
    self._fields = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in classes}
    self._converters = {c.kind: c for c in converters}
    self._by_type = {c.cls: c for c in converters}
    clashes = (set(self._classes) & set(self._converters)) | (
        (set(self._classes) | set(self._converters)) & set(_RESERVED))
    if len(self._classes) != len(classes) or clashes:
      raise ValueError(f"EntryCodec: type tags must be distinct ({sorted(clashes)} clash).")

  # -- writing ----------------------------------------------------------------

  def dumps(self, entry: Any) -> bytes:
    """``entry`` as the bytes of an ``.npz`` archive.

    Raises:
      TypeError: a value of a type the codec does not know (named, with
        where it is in the entry).
    """
    arrays = _Arrays()
    document = self._encode(entry, arrays, "entry")
    table, groups = arrays.pack()
    text = json.dumps({"entry": document, "arrays": table})
    buffer = io.BytesIO()
    np.savez(buffer, document=np.frombuffer(text.encode(), np.uint8), **groups)
    return buffer.getvalue()

  def _encode(self, value, arrays: "_Arrays", where: str):
    kind = type(value)
    if kind in _SCALARS:
      return value
    if kind is list:
      return [self._encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
      return {"$": "tuple", "items": self._encode(list(value), arrays, where)}
    if kind is dict:
      return {"$": "dict", "items": [[self._encode(k, arrays, f"{where} key"),
                                      self._encode(v, arrays, f"{where}[{k!r}]")]
                                     for k, v in value.items()]}
    if isinstance(value, (np.ndarray, np.generic)):
      return self._encode_array(value, arrays, where)
    if isinstance(value, np.dtype):
      # A user-defined type (ml_dtypes) by its name; NumPy's own by their code.
      return {"$": "dtype", "name": value.name if value.isbuiltin == 2 else value.str}
    if kind in self._by_type:
      converter = self._by_type[kind]
      return {"$": converter.kind, "value": self._encode(converter.encode(value), arrays, where)}
    if self._classes.get(kind.__name__) is kind:
      return {"$": kind.__name__, "fields": {
          name: self._encode(getattr(value, name), arrays, f"{where}.{name}")
          for name in self._fields[kind]}}
    raise TypeError(f"the executable cache cannot store {where} of type "
                    f"{kind.__module__}.{kind.__qualname__}; add it to the entry's codec "
                    "(ipu_jax/cached_program.py) if it belongs in an entry.")

  @staticmethod
  def _encode_array(value, arrays: "_Arrays", where: str) -> dict:
    array = np.asarray(value)
    if array.dtype.hasobject:
      raise TypeError(f"the executable cache cannot store {where}: an array of Python "
                      "objects (dtype object).")
    node = {"$": "scalar" if isinstance(value, np.generic) else "array"}
    if array.dtype.isbuiltin == 2:
      # bfloat16, float8...: stored as their bits (.npz has no name for them).
      node["dtype"] = array.dtype.name
    # An array the entry holds in several places (a profile shares per-tile
    # figures between its parts) is stored once, and read back as one array.
    node["index"] = arrays.index_of(value, array)
    return node

  # -- reading ----------------------------------------------------------------

  def loads(self, payload: bytes) -> Any:
    """The entry in ``payload`` (from :meth:`dumps`).

    Raises:
      ValueError: the payload is not such an archive, holds object arrays,
        or its document names a type the codec does not know.
    """
    archive = np.load(io.BytesIO(payload), allow_pickle=False)
    if not isinstance(archive, np.lib.npyio.NpzFile):
      raise ValueError("the payload is not an .npz archive")
    with archive:
      groups = {name: archive[name] for name in archive.files}
    document = json.loads(groups.pop("document").tobytes())
    return self._decode(document["entry"], _unpack(document["arrays"], groups))

  def _decode(self, node, arrays: list):
    if type(node) in _SCALARS:
      return node
    if type(node) is list:
      return [self._decode(v, arrays) for v in node]
    if type(node) is not dict:
      raise ValueError(f"unexpected {type(node).__name__} in the entry's document")
    kind = node.get("$")
    if kind == "tuple":
      return tuple(self._decode(node["items"], arrays))
    if kind == "dict":
      return {_hashable(self._decode(k, arrays)): self._decode(v, arrays)
              for k, v in node["items"]}
    if kind in ("array", "scalar"):
      array = arrays[int(node["index"])]
      if "dtype" in node:
        array = array.view(_ml_dtype(node["dtype"]))
      return array[()] if kind == "scalar" else array
    if kind == "dtype":
      return _dtype(node["name"])
    if kind in self._converters:
      return self._converters[kind].decode(self._decode(node["value"], arrays))
    if kind in self._classes:
      return self._decode_dataclass(self._classes[kind], node["fields"], arrays)
    raise ValueError(f"the entry names a type the executable cache does not load: {kind!r}")

  def _decode_dataclass(self, cls: type, fields: dict, arrays: list):
    names = self._fields[cls]
    if len(names) != len(fields) or not all(name in fields for name in names):
      raise ValueError(f"{cls.__name__}'s fields differ from the entry's ({sorted(fields)})")
    value = object.__new__(cls)
    for name in names:
      # object.__setattr__: frozen dataclasses too, as their __init__ does.
      object.__setattr__(value, name, self._decode(fields[name], arrays))
    return value


def _hashable(key):
  if isinstance(key, list):  # JSON has no tuples; a dict key was never a list
    raise ValueError("a dict key in the entry's document is a list")
  return key


def _dtype(name: str) -> np.dtype:
  """A dtype by name, ml_dtypes' (bfloat16, float8...) included; never object."""
  try:
    dtype = np.dtype(name)
  except TypeError:
    dtype = _ml_dtype(name)
  if dtype.hasobject:
    raise ValueError("the entry names an object dtype")
  return dtype


def _ml_dtype(name: str) -> np.dtype:
  """One of ml_dtypes' scalar types by name (what NumPy has no name for)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  scalar = getattr(ml_dtypes, str(name), None)
  if not (isinstance(scalar, type) and issubclass(scalar, np.generic)):
    raise ValueError(f"the entry names an unknown dtype {name!r}")
  return np.dtype(scalar)


def load(directory: str, key: str, codec: EntryCodec) -> Optional[Any]:
  """The entry stored under ``key``, or None (missing, or ignored with a warning).

  Args:
    directory: the cache directory.
    key: the program's key (:func:`program_key`).
    codec: what the entry may hold (the same the writer used).
  """
  path = entry_path(directory, key)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None
  except OSError as error:
    _ignore(path, f"cannot be read ({error})")
    return None
  try:
    header, payload = _checked_payload(data)
  except (ValueError, KeyError, TypeError) as error:
    _ignore(path, str(error))
    return None
  why = _version_mismatch(header.get("versions"))
  if why:
    _ignore(path, why)
    return None
  try:
    return codec.loads(payload)
  except Exception as error:  # pylint: disable=broad-except
    _ignore(path, f"does not load ({type(error).__name__}: {error})")
    return None


def _checked_payload(data: bytes) -> tuple:
  """``(header, payload)`` of a file's bytes, its length and checksum checked."""
  stream = io.BytesIO(data)
  if stream.readline() != _MAGIC:
    raise ValueError("not an executable cache file")
  header = json.loads(stream.readline())
  payload = stream.read()
  if len(payload) != header["length"]:
    raise ValueError(f"truncated ({len(payload)} of {header['length']} bytes)")
  if hashlib.sha256(payload).hexdigest() != header["sha256"]:
    raise ValueError("its checksum does not match (corrupt)")
  return header, payload


def _version_mismatch(theirs) -> Optional[str]:
  """Why an entry written with versions ``theirs`` is not used (None: it is)."""
  ours = library_versions()
  if theirs == ours:
    return None
  theirs = theirs if isinstance(theirs, dict) else {}
  if theirs.get("format", 1) < 2:
    return (f"it is in the old pickle format (format {theirs.get('format', 1)!r}, now "
            f"{FORMAT_VERSION}), which is never loaded: unpickling a file can run code")
  changed = ", ".join(f"{k} {theirs.get(k)!r} (now {ours[k]!r})" for k in ours
                      if theirs.get(k) != ours[k])
  return f"written by another version: {changed}"


def store(directory: str, key: str, entry: Any, codec: EntryCodec) -> str:
  """Write ``entry`` under ``key`` atomically; returns the file's path.

  Raises:
    TypeError: ``entry`` holds a value ``codec`` cannot store (nothing is
      written).
  """
  payload = codec.dumps(entry)
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
