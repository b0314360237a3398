"""Find the vertex classes of a C++ codelet file and their fields' names.

A small parser for the declarations Poplar vertex code uses, not a C++
front end. What it reads:

* comments and string/character literals are blanked first (their length
  kept, so offsets stay valid);
* a vertex class is ``class`` or ``struct`` NAME (``[[...]]`` attributes and
  ``final`` allowed) whose base list names ``Vertex``, ``SupervisorVertex``
  or ``MultiVertex`` (with or without ``poplar::``), at file scope or inside
  named namespaces (the class name is then qualified with them);
* a class template (``template <typename T> class X : public Vertex``) is a
  vertex class for each explicit instantiation the file makes,
  ``template class X<float>;``, named ``X<float>`` (arguments joined by
  ``,``, as Poplar's ``templateVertex`` names them);
* its fields are the non-static data members declared at the class body's
  top level, in order: ``TYPE name;``, ``TYPE a, b;``, with or without a
  default initialiser. Member functions (anything with a parameter list),
  nested types, ``using``/``typedef``, ``static``/``constexpr`` members,
  ``friend`` and access specifiers are skipped.

What a field is (input, output, scalar, vector, list, dtype) is not parsed
here: the compiler reports it from the declared type (``build.py``'s
describe functions), so aliases, macros and template arguments resolve as
C++ resolves them.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["ParsedClass", "parse_vertex_classes", "strip_comments"]

_BASES = ("Vertex", "SupervisorVertex", "MultiVertex")
_SKIP_WORDS = {"using", "typedef", "static", "friend", "template", "enum", "constexpr",
               "class", "struct", "union", "static_assert", "operator"}


@dataclasses.dataclass(frozen=True)
class ParsedClass:
  """A vertex class found in the source.

  Attributes:
    name: the name Poplar would use (``SumVertex``, ``X<float>``).
    cpp_name: the C++ type as written in ``scope`` (a template instance as its
      instantiation spells it).
    scope: the namespace (``a::b``, or ``""``) where ``cpp_name`` names the
      class: the class's own, or that of its explicit instantiation.
    base: ``"Vertex"``, ``"SupervisorVertex"`` or ``"MultiVertex"``.
    fields: the data members' names in declaration order.
    line: the line of the class declaration (1-based).
  """

  name: str
  cpp_name: str
  scope: str
  base: str
  fields: tuple
  line: int


def strip_comments(source: str) -> str:
  """``source`` with comments and literals blanked (same length, newlines kept)."""
  out = []
  i, n = 0, len(source)
  while i < n:
    c = source[i]
    two = source[i:i + 2]
    if two == "//":
      j = source.find("\n", i)
      j = n if j < 0 else j
      out.append(" " * (j - i))
      i = j
    elif two == "/*":
      j = source.find("*/", i + 2)
      j = n if j < 0 else j + 2
      out.append(re.sub(r"[^\n]", " ", source[i:j]))
      i = j
    elif c in "\"'":
      j = i + 1
      while j < n and source[j] != c:
        j += 2 if source[j] == "\\" else 1
      j = min(j + 1, n)
      out.append(c + " " * max(j - i - 2, 0) + (c if j - i >= 2 else ""))
      i = j
    else:
      out.append(c)
      i += 1
  return "".join(out)


def _match_brace(text: str, open_at: int) -> int:
  """Index of the ``}`` closing the ``{`` at ``open_at`` (or len(text))."""
  depth = 0
  for i in range(open_at, len(text)):
    if text[i] == "{":
      depth += 1
    elif text[i] == "}":
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def _split_top(text: str, sep: str = ",") -> list:
  """``text`` split at ``sep`` outside (), <>, [] and {}."""
  parts, depth, start = [], 0, 0
  for i, c in enumerate(text):
    if c in "(<[{":
      depth += 1
    elif c in ")>]}":
      depth -= 1
    elif c == sep and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return parts


def _namespaces(text: str) -> list:
  """``(start, end, name)`` of every named namespace block."""
  spans = []
  for m in re.finditer(r"\bnamespace\s+([A-Za-z_][\w:]*)\s*\{", text):
    spans.append((m.end() - 1, _match_brace(text, m.end() - 1), m.group(1)))
  return spans


def _statements(body: str) -> list:
  """Top-level declarations of a class body (function bodies and nested types skipped)."""
  statements, current, i = [], [], 0
  while i < len(body):
    c = body[i]
    if c == "{":
      end = _match_brace(body, i)
      head = "".join(current)
      if "(" in head or re.search(r"\b(class|struct|union|enum)\b", head):
        # A function body or a nested type: drop it (and its trailing ';').
        current = []
        i = end + 1
        continue
      current.append(body[i:end + 1])  # a brace initialiser
      i = end + 1
      continue
    if c == ";":
      statements.append("".join(current))
      current = []
    else:
      current.append(c)
    i += 1
  return statements


def _field_names(statement: str) -> list:
  """The data members a statement declares (``[]`` if it declares none)."""
  text = re.sub(r"\b(public|private|protected)\s*:", " ", statement)
  text = re.sub(r"\[\[.*?\]\]", " ", text, flags=re.S).strip()
  if not text:
    return []
  words = set(re.findall(r"[A-Za-z_]\w*", text))
  if words & _SKIP_WORDS:
    return []
  if "(" in re.sub(r"\{.*\}", "", text, flags=re.S).split("=")[0]:
    return []  # a member function declaration or a constructor
  names = []
  for i, part in enumerate(_split_top(text)):
    decl = re.split(r"[={]", part, maxsplit=1)[0].strip()
    m = re.search(r"([A-Za-z_]\w*)\s*$", decl)
    if m is None or (i == 0 and decl == m.group(1)):
      return []  # no type before the name: not a declaration
    names.append(m.group(1))
  return names


def _scope(spaces, position: int) -> str:
  return "::".join(name for start, end, name in spaces if start < position < end)


def _instantiations(text: str, spaces) -> dict:
  """Template name -> ``(name as written, arguments, scope)`` of its explicit instantiations."""
  found = {}
  for m in re.finditer(r"\btemplate\s+(?:class|struct)\s+([A-Za-z_][\w:]*)\s*<", text):
    depth, j = 1, m.end()
    while j < len(text) and depth:
      depth += {"<": 1, ">": -1}.get(text[j], 0)
      j += 1
    args = [re.sub(r"\s+", " ", a).strip() for a in _split_top(text[m.end():j - 1])]
    found.setdefault(m.group(1).split("::")[-1], []).append(
        (m.group(1), args, _scope(spaces, m.start())))
  return found


_CLASS = re.compile(
    r"(?P<template>\btemplate\s*<(?P<tparams>[^{};]*?)>\s*)?"
    r"\b(?:class|struct)\s+(?:\[\[.*?\]\]\s*)?(?P<name>[A-Za-z_]\w*)\s*(?:final\s*)?"
    r":(?P<bases>[^{;]*)\{", re.S)


def parse_vertex_classes(source: str) -> list:
  """The vertex classes ``source`` defines, as :class:`ParsedClass` es."""
  text = strip_comments(source)
  spaces = _namespaces(text)
  instances = _instantiations(text, spaces)
  classes = []
  for m in _CLASS.finditer(text):
    base = next((b for b in reversed(_BASES)
                 if re.search(rf"(?:^|[\s:,]){b}\b", m.group("bases"))), None)
    if base is None:
      continue
    open_at = m.end() - 1
    fields = tuple(n for s in _statements(text[open_at + 1:_match_brace(text, open_at)])
                   for n in _field_names(s))
    line = text.count("\n", 0, m.start("name")) + 1
    if m.group("template") is None:
      classes.append(ParsedClass(m.group("name"), m.group("name"), _scope(spaces, m.start()),
                                 base, fields, line))
      continue
    for written, args, scope in instances.get(m.group("name"), []):
      classes.append(ParsedClass(f"{m.group('name')}<{','.join(args)}>",
                                 f"{written}<{', '.join(args)}>", scope, base, fields, line))
  return classes
