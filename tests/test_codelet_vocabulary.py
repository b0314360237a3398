"""The codelet vocabulary: one name per vertex type, code memory once per type."""

import ast
import pathlib
import re

from absl.testing import absltest, parameterized
import chex
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax.kernels import library
from ipu_jax.kernels import vocabulary as vocab

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config():
  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = 16
  return cfg


# Where the built-in vertex types are named: rules, builders, kernels, the graph API.
_SCANNED = ("lowering", "kernels", "ipu_jax")
# Parameters that take vertex type names, wherever they are declared.
_NAME_PARAMS = frozenset({"codelet", "codelets"})
# Callables whose positional parameter takes a name, besides those declared
# with a parameter in _NAME_PARAMS: vocabulary.vertex's template name and a
# Codelet's name.
_KNOWN_POSITIONS = {"vertex": {0}, "Codelet": {0}}
_KNOWN_KEYWORDS = {"Codelet": {"name"}}
# A vertex type name spelled out: ``library::Vertex``.
_SPELLED = re.compile(r"\b(popops|poplin|poprand|poputil|poplar|ipu_jax)::[A-Z]")


def _callee(call: ast.Call) -> str:
  func = call.func
  return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _name_positions(trees) -> dict:
  """Callable name -> positions of its parameters that take vertex type names."""
  positions = {k: set(v) for k, v in _KNOWN_POSITIONS.items()}
  for tree in trees:
    for node in ast.walk(tree):
      if isinstance(node, ast.ClassDef):
        fields = [s.target.id for s in node.body
                  if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        positions.setdefault(node.name, set()).update(
            i for i, f in enumerate(fields) if f in _NAME_PARAMS)
        for method in node.body:
          if isinstance(method, ast.FunctionDef):
            params = [a.arg for a in method.args.posonlyargs + method.args.args][1:]
            name = node.name if method.name == "__init__" else method.name
            positions.setdefault(name, set()).update(
                i for i, p in enumerate(params) if p in _NAME_PARAMS)
      elif isinstance(node, ast.FunctionDef):
        params = [a.arg for a in node.args.posonlyargs + node.args.args]
        positions.setdefault(node.name, set()).update(
            i for i, p in enumerate(params) if p in _NAME_PARAMS)
  return positions


def _literals(expr):
  """String literals of ``expr`` that would be names themselves: not empty, not
  a subscript's key, not an argument of a call inside it (what a call makes
  of its arguments, such as ``vertex(REDUCE, "add")``'s template argument or
  ``library.binary("add")``'s op, is checked where the call names it)."""
  skipped = set()
  for node in ast.walk(expr):
    if isinstance(node, ast.Call):
      skipped.update(id(n) for arg in node.args + node.keywords for n in ast.walk(arg))
    elif isinstance(node, ast.Subscript):
      skipped.update(id(n) for n in ast.walk(node.slice))
    elif isinstance(node, ast.JoinedStr):
      skipped.update(id(n) for n in ast.walk(node) if n is not node)
  for node in ast.walk(expr):
    literal = isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value)
    if literal and id(node) not in skipped:
      yield node


def _docstrings(tree) -> set:
  ids = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        ids.add(id(body[0].value))
  return ids


def _name_arguments(tree, positions):
  """Expressions given where a vertex type name is taken (arguments, defaults)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      callee = _callee(node)
      for i in positions.get(callee, ()):
        if i < len(node.args) and not isinstance(node.args[i], ast.Starred):
          yield node.args[i]
      for kw in node.keywords:
        if kw.arg in _NAME_PARAMS or kw.arg in _KNOWN_KEYWORDS.get(callee, ()):
          yield kw.value
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      args = node.args
      positional = args.posonlyargs + args.args
      pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
      pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
      yield from (d for a, d in pairs if a.arg in _NAME_PARAMS)


def codelet_name_bypasses(sources: dict) -> list:
  """``path:line`` of every vertex type name not taken from kernels/vocabulary.py.

  Two ways a name bypasses the vocabulary: a string literal given where a
  vertex type name is taken (a ``codelet``/``codelets`` argument, keyword or
  positional, of any function or dataclass declaring one; the name of
  ``vertex(...)`` or ``Codelet(...)``; a parameter's default), and any
  string literal spelled like one (``"popops::ReduceAdd"``) outside
  docstrings, wherever it then goes (a table, a variable).
  """
  trees = {path: ast.parse(text) for path, text in sources.items()}
  positions = _name_positions(trees.values())
  found = set()
  for path, tree in trees.items():
    docstrings = _docstrings(tree)
    for expr in _name_arguments(tree, positions):
      found.update((path, lit.lineno) for lit in _literals(expr))
    for node in ast.walk(tree):
      if (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings and _SPELLED.search(node.value)):
        found.add((path, node.lineno))
  return [f"{path}:{line}" for path, line in sorted(found)]


class VocabularyTest(parameterized.TestCase):

  def test_names_are_distinct_and_namespaced(self):
    names = [getattr(vocab, n) for n in vocab.__all__ if n.isupper()]
    self.assertLen(set(names), len(names))
    for name in names:
      self.assertRegex(name, r"^(popops|poplin|popsparse|poprand|ipu_jax)::[A-Z][A-Za-z0-9]*$")

  @parameterized.parameters(
      ((vocab.FILL,), "popops::Fill"),
      ((vocab.FILL, "int"), "popops::Fill<int>"),
      ((vocab.MATMUL_BLOCK, np.dtype(np.float16), np.dtype(np.float32)),
       "poplin::MatMulBlock<float16,float32>"),
  )
  def test_vertex_instances(self, args, expected):
    self.assertEqual(vocab.vertex(*args), expected)

  def test_identity_of_library_codelet_is_its_vocabulary_name(self):
    self.assertEqual(vocab.identity(library.fill), vocab.FILL)
    self.assertEqual(vocab.identity(library.copy), vocab.COPY)
    self.assertEqual(vocab.identity(library.binary("add")),
                     vocab.vertex(vocab.ELEMENTWISE, "add"))

  def test_identity_refuses_other_objects(self):
    with self.assertRaisesRegex(TypeError, "vertex type names"):
      vocab.identity(3)

  def test_built_in_code_names_codelets_only_through_the_vocabulary(self):
    # Any vertex type name spelled out in the package is a second spelling
    # waiting to happen (and, spelled differently, code memory charged twice).
    sources = {str(path.relative_to(_ROOT)): path.read_text()
               for folder in _SCANNED for path in sorted((_ROOT / folder).rglob("*.py"))
               if path != _ROOT / "kernels" / "vocabulary.py"}
    self.assertGreater(len(sources), 50)
    self.assertEqual(codelet_name_bypasses(sources), [])

  @parameterized.named_parameters(
      ("keyword", """
def rule(ctx):
  ctx.emit(P.Superstep(name="x", codelets=("popops::Exp",)))
"""),
      ("keyword_without_library", """
def rule(ctx):
  ctx.emit(P.Superstep(name="x", codelets=(vocab.COPY, f"exp<{ctx.op}>")))
"""),
      ("template_name", """
CODE = vocab.vertex("popops::Fill", "int")
"""),
      ("positional_into_a_helper", """
def _emit(ctx, x, out, fn, compute=None, codelet=None):
  pass

def rule(ctx, x, out):
  _emit(ctx, x, out, None, 3, "ReduceAdd")
"""),
      ("positional_into_a_method", """
class Plan:
  def emit(self, fn, out, codelet):
    pass

def rule(plan, out):
  plan.emit(None, out, "Gather")
"""),
      ("positional_into_a_dataclass", """
@dataclasses.dataclass(frozen=True)
class Spec:
  core_ndim: int
  codelet: str

SPECS = {lax_linalg.lu_p: Spec(2, "LU")}
"""),
      ("codelet_object", """
fill = Codelet("Fill", lambda x: x, ("x",), ("y",))
"""),
      ("parameter_default", """
def emit(ctx, codelet="poplin::Dot"):
  pass
"""),
      ("spelled_in_a_table", """
_COMBINE = {"sum": (lax.psum, "add", "popops::ReduceAdd")}
"""),
  )
  def test_a_bypass_is_found(self, source):
    found = codelet_name_bypasses({"fake.py": source})
    self.assertLen(found, 1, found)
    self.assertStartsWith(found[0], "fake.py:")

  def test_vocabulary_names_and_their_templates_are_not_bypasses(self):
    source = """
\"\"\"Adds what arrives (``popops::ReduceAdd`` in poplibs' words).\"\"\"

def _emit(ctx, x, codelet=""):
  \"\"\"Docstrings may say ``poplin::ReduceAdd``.\"\"\"

def rule(ctx, x, kind):
  _emit(ctx, x, vocab.vertex(vocab.REDUCE_ADD, "float32", x.dtype))
  _emit(ctx, x, codelet=_TABLE["sum"])
  ctx.emit(P.Superstep(name="add", codelets=(vocab.vertex(vocab.REDUCE, kind),)))
  fill = Codelet(vocab.FILL, lambda x: x, ("x",), ("y",))
"""
    self.assertEqual(codelet_name_bypasses({"fake.py": source}), [])


class CodeMemoryTest(chex.TestCase, parameterized.TestCase):

  def test_a_codelet_reached_by_several_paths_is_charged_once(self):
    # Three rules fill a result: jnp.dot and ipu_jax.ops.matmul of an empty
    # contraction, and a sum over an empty axis. They run one vertex type.
    def fills(a, b, x):
      return jnp.dot(a, b), ipu_jax.ops.matmul(a, b), jnp.sum(x, axis=2)

    # Results big enough that every tile holds part of each.
    a = np.zeros((48, 0), np.float32)
    b = np.zeros((0, 40), np.float32)
    x = np.zeros((48, 40, 0), np.float32)
    profile = ipu_jax.jit(fills, config=_config()).lower(a, b, x).profile
    steps = [s for s in profile.steps if s.vertices is not None]
    self.assertLen(steps, 3)
    fill_steps_per_tile = sum((np.asarray(s.vertices) > 0).astype(int) for s in steps)
    self.assertGreater(fill_steps_per_tile.max(), 1)  # some tile is reached twice
    per_codelet = profile.target.code_bytes_per_codelet
    chex.assert_trees_all_equal(profile.memory.by_category["code"],
                                per_codelet * (fill_steps_per_tile > 0))

  @parameterized.parameters((np.float32, 0), (np.float16, 1))
  def test_a_reduce_scatter_adds_with_the_matmul_partials_vertex(self, dtype, new_types):
    # A reduce-scatter adds what arrives with the vertex a matmul adds its
    # partials with (poplin::ReduceAdd<partials, out>): after a float32 matmul
    # whose partials are added on every tile, it costs no code memory of its
    # own; a float16 one adds float32 partials, another template instance.
    def matmul(a, w):
      return (a @ w).reshape(-1)

    def then_reduce_scatter(a, w):
      return ipu_jax.ops.cross_replica_reduce_scatter(matmul(a, w), 4)

    a = np.ones((16, 2048), dtype)
    w = np.ones((2048, 12), dtype)
    profiles = [ipu_jax.jit(f, config=_config()).lower(a, w).profile
                for f in (matmul, then_reduce_scatter)]
    code = [np.asarray(p.memory.by_category["code"]) for p in profiles]
    self.assertTrue(np.all(code[0] > 0))  # every tile adds partials
    per_codelet = profiles[0].target.code_bytes_per_codelet
    chex.assert_trees_all_equal(code[1] - code[0], np.full(16, new_types * per_codelet))


if __name__ == "__main__":
  absltest.main()
