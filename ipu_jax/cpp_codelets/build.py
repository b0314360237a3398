"""Compile a C++ codelet file into a shared library of XLA FFI handlers.

``compile_codelets`` parses the file's vertex classes (``parse.py``),
generates one translation unit that includes ipu-jax's runner
(``include/ipu_jax/glue.hpp``), then the codelet file, then per vertex class
a describe function and an FFI handler, and compiles it with
``g++ -O2 -shared -fPIC`` against the package's Poplar-compatible headers
(``include/``) and XLA's FFI headers (``jax.ffi.include_dir()``). The library
is cached in ``$IPU_JAX_CACHE`` (or ``~/.cache/ipu_jax/codelets``), keyed
by a hash of the preprocessed codelet file (so every header it includes
counts), the flags, the generated code, the compiler's version and
``HEADER_VERSION``; each handler is registered with
``jax.ffi.register_ffi_target`` once per process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import pathlib
import re
import subprocess
import tempfile
import threading
from typing import Sequence

import jax

from ipu_jax.cpp_codelets import parse

__all__ = ["CodeletCompileError", "CodeletLibrary", "Field", "VertexClass",
           "compile_codelets", "HEADER_VERSION", "INCLUDE_DIR"]

# Bumped whenever the shipped headers or the generated code change meaning.
HEADER_VERSION = "1"
INCLUDE_DIR = pathlib.Path(__file__).parent / "include"
# -ffp-contract=off: a*b+c is two roundings, as an XLA elementwise program
# computes it (no fused multiply-adds the source did not ask for).
# -fno-semantic-interposition: functions of the library are its own (so the
# always_inline helpers codelets declare can be inlined under -fPIC).
# -Wno-attributes: Poplar's attributes ([[poplar::constraint(...)]]) mean
# nothing on the host.
_CXXFLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fno-semantic-interposition",
             "-Wno-attributes", "-ffp-contract=off")
_LOCK = threading.Lock()
# g++'s messages in plain ASCII (no locale quotes), whatever the user's locale.
_GXX_ENV = {**os.environ, "LC_ALL": "C"}
_LOADED: dict = {}  # cache key -> CodeletLibrary (one per process)


class CodeletCompileError(RuntimeError):
  """g++ refused a codelet file: ``file:line: message``, then g++'s output."""


@dataclasses.dataclass(frozen=True)
class Field:
  """A vertex field as its declared C++ type says.

  Attributes:
    name: the member's name.
    kind: ``"in"`` (Input, or a plain member), ``"out"`` (Output) or ``"inout"``.
    shape: ``"scalar"`` (one element), ``"vector"`` (a span) or
      ``"vector_list"`` (a list of spans: ``VectorList`` or a ``Vector`` of
      fields).
    dtype: the element's NumPy dtype name (``half`` is ``"float16"``).
    attribute: a plain member (vertex state set once, Poplar's
      ``setInitialValue``) rather than a connected field.
  """

  name: str
  kind: str
  shape: str
  dtype: str
  attribute: bool = False

  @property
  def read(self) -> bool:
    return self.kind in ("in", "inout")

  @property
  def written(self) -> bool:
    return self.kind in ("out", "inout")


@dataclasses.dataclass(frozen=True)
class VertexClass:
  """A compiled vertex class: its fields, base class and FFI target.

  Attributes:
    name: Poplar's name for it (``SumVertex``, ``X<float>``).
    fields: :class:`Field` s in declaration order.
    supervisor: a ``SupervisorVertex`` or ``MultiVertex`` (drives the
      tile's workers; costed as the tile's cycles).
    base: the base class's name.
    target: the registered XLA FFI target name.
    line: where the class is declared in its file.
  """

  name: str
  fields: tuple
  supervisor: bool
  base: str
  target: str
  line: int

  def field(self, name: str) -> Field:
    for f in self.fields:
      if f.name == name:
        return f
    raise KeyError(name)


@dataclasses.dataclass(frozen=True)
class CodeletLibrary:
  """The vertex classes of one compiled codelet file.

  Attributes:
    vertex_classes: ``{name: VertexClass}``.
    path: the shared library.
    source_name: the codelet file (or ``"<source>"``).
  """

  vertex_classes: dict
  path: str
  source_name: str

  def __getitem__(self, name: str) -> VertexClass:
    key = normalise_name(name)
    for cls_name, cls in self.vertex_classes.items():
      if normalise_name(cls_name) == key:
        return cls
    raise KeyError(f"no vertex class {name!r} in {self.source_name}; it defines "
                   f"{sorted(self.vertex_classes)}")


def normalise_name(name: str) -> str:
  """A class name with the spaces around ``<``, ``>`` and ``,`` removed."""
  return re.sub(r"\s*([<>,])\s*", r"\1", name.strip())


def cache_dir() -> pathlib.Path:
  root = os.environ.get("IPU_JAX_CACHE")
  path = pathlib.Path(root) / "codelets" if root else pathlib.Path.home() / ".cache/ipu_jax/codelets"
  path.mkdir(parents=True, exist_ok=True)
  return path


def _source(path_or_source) -> tuple:
  """``(text, file name for messages, directory of the file or None)``."""
  if isinstance(path_or_source, os.PathLike) or (
      isinstance(path_or_source, str) and "\n" not in path_or_source
      and re.search(r"\.(cpp|cc|cxx|C|c\+\+)$", path_or_source)):
    path = pathlib.Path(path_or_source).resolve()
    if not path.is_file():
      raise FileNotFoundError(f"codelet file {path} does not exist")
    return path.read_text(), str(path), str(path.parent)
  if not isinstance(path_or_source, str):
    raise TypeError("compile_codelets takes a path to a .cpp file or C++ source text")
  return path_or_source, "<source>", None


def _flags(include_dirs, defines, source_dir) -> list:
  flags = [f"-I{INCLUDE_DIR}"] + [f"-I{d}" for d in include_dirs]
  if source_dir:
    flags.append(f"-I{source_dir}")
  for d in defines:
    if isinstance(d, (tuple, list)):
      d = f"{d[0]}={d[1]}"
    flags.append(f"-D{d}")
  return flags


def compile_codelets(path_or_source, *, include_dirs: Sequence[str] = (),
                     defines: Sequence = ()) -> CodeletLibrary:
  """Compile a codelet file (a path, or C++ source text) for this host.

  Args:
    path_or_source: a ``.cpp`` path, or the source itself.
    include_dirs: more ``-I`` directories (the file's own directory is one).
    defines: ``-D`` macros: ``"NAME"``, ``"NAME=VALUE"`` or ``(NAME, VALUE)``.

  Returns:
    The :class:`CodeletLibrary`, its handlers registered with XLA.

  Raises:
    CodeletCompileError: g++ failed; the message starts with the first
      error's ``file:line`` and text, then g++'s whole output.
  """
  text, name, source_dir = _source(path_or_source)
  classes = parse.parse_vertex_classes(text)
  flags = _flags(include_dirs, defines, source_dir)
  work = cache_dir()
  source_file = _materialise_source(work, text, name)
  glue = _glue(source_file, classes)
  key = _cache_key(source_file, glue, flags)
  with _LOCK:
    if key in _LOADED:
      return _LOADED[key]
    library = work / f"{key}.so"
    if not library.exists():
      _compile(work, glue, flags, library, name)
    loaded = _load(library, key, classes, name)
    _LOADED[key] = loaded
    return loaded


def _materialise_source(work: pathlib.Path, text: str, name: str) -> str:
  """The file the generated code includes: the user's, or the source text saved."""
  if name != "<source>":
    return name
  digest = hashlib.sha256(text.encode()).hexdigest()[:16]
  path = work / f"source-{digest}.cpp"
  if not path.exists():
    _atomic_write(path, f'#line 1 "<source>"\n{text}')
  return str(path)


def _atomic_write(path: pathlib.Path, text: str) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _glue(source_file: str, classes) -> str:
  """The translation unit: runner, codelet file, then one entry line per class."""
  lines = ['#include "ipu_jax/glue.hpp"', f'#include "{source_file}"', ""]
  for i, cls in enumerate(classes):
    alias = f"IpuJaxV{i}"
    opened = "".join(f"namespace {n} {{ " for n in cls.scope.split("::") if n)
    closed = "}" * (opened.count("{") + 1)
    lines.append(f"{opened}namespace {{ using {alias} = {cls.cpp_name}; {closed}")
    alias = "::".join(filter(None, [cls.scope, alias]))
    members = "".join(f", &{alias}::{f}" for f in cls.fields)
    lines.append(f'IPU_JAX_VERTEX({i}, "{cls.name}", "{" ".join(cls.fields)}", {alias}{members})')
  return "\n".join(lines) + "\n"


def _compiler_version() -> str:
  try:
    return subprocess.run(["g++", "--version"], capture_output=True, text=True,
                          check=True, env=_GXX_ENV).stdout.splitlines()[0]
  except (OSError, subprocess.CalledProcessError) as e:
    raise CodeletCompileError(f"g++ is needed to compile C++ codelets and could not run: {e}")


def _cache_key(source_file: str, glue: str, flags) -> str:
  """Hash of the preprocessed codelet file, the generated code, flags and versions."""
  pre = subprocess.run(["g++", "-E", "-P", *_CXXFLAGS[:1], *flags, "-x", "c++", source_file],
                       capture_output=True, text=True, env=_GXX_ENV)
  if pre.returncode:
    raise CodeletCompileError(_error_message(pre.stderr, source_file))
  h = hashlib.sha256()
  for part in (pre.stdout, glue, " ".join((*_CXXFLAGS, *flags)), _compiler_version(),
               HEADER_VERSION, jax.__version__,
               (INCLUDE_DIR / "ipu_jax" / "glue.hpp").read_text()):
    h.update(part.encode())
    h.update(b"\0")
  return h.hexdigest()[:24]


def _compile(work: pathlib.Path, glue: str, flags, library: pathlib.Path, name: str) -> None:
  glue_path = library.with_suffix(".cpp")
  _atomic_write(glue_path, glue)
  fd, tmp = tempfile.mkstemp(dir=work, suffix=".so.tmp")
  os.close(fd)
  cmd = ["g++", *_CXXFLAGS, *flags, "-isystem", jax.ffi.include_dir(), str(glue_path), "-o", tmp]
  result = subprocess.run(cmd, capture_output=True, text=True, env=_GXX_ENV)
  if result.returncode:
    os.unlink(tmp)
    raise CodeletCompileError(_error_message(result.stderr, name))
  os.replace(tmp, library)


_ERROR = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):(?:\d+:)?\s*(?:fatal )?error:\s*(?P<msg>.*)$",
                    re.M)


def _error_message(stderr: str, name: str) -> str:
  """``file:line: message`` of the first error, then g++'s output."""
  m = _ERROR.search(stderr)
  head = (f"{m.group('file')}:{m.group('line')}: {m.group('msg')}" if m
          else f"{name}: g++ failed")
  return f"compiling C++ codelets {name}: {head}\n\ng++ said:\n{stderr.strip()}"


_REGISTERED: set = set()


def _load(library: pathlib.Path, key: str, classes, name: str) -> CodeletLibrary:
  lib = ctypes.CDLL(str(library))
  vertex_classes = {}
  for i, cls in enumerate(classes):
    describe = getattr(lib, f"ipu_jax_describe_{i}")
    describe.restype = ctypes.c_char_p
    fields = _fields(describe().decode(), cls, name)
    target = f"ipu_jax_cpp_{key}_{i}"
    if target not in _REGISTERED:
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, f"ipu_jax_run_{i}")),
                                  platform="cpu")
      _REGISTERED.add(target)
    vertex_classes[cls.name] = VertexClass(cls.name, fields, cls.base != "Vertex", cls.base,
                                           target, cls.line)
  return CodeletLibrary(vertex_classes, str(library), name)


def _fields(described: str, cls, name: str) -> tuple:
  fields = []
  for item in filter(None, described.split(";")):
    fname, kind, shape, dtype, attribute = item.split()
    if dtype == "unsupported":
      raise CodeletCompileError(f"{name}:{cls.line}: vertex {cls.name}: field {fname!r} has an "
                                "element type ipu-jax cannot hold in a tensor")
    fields.append(Field(fname, kind, shape, dtype, attribute == "1"))
  return tuple(fields)
