"""The stages of a compile (ipu_jax/stages.py): Traced -> Lowered -> Compiled.

Each stage is a small typed value: ``trace`` gives the jaxpr and avals,
``lower`` the tile program, profile and report, ``compile`` the executor and
its device state; their results equal ``jax.jit``'s. Also the contract that
keeps them small: ``Lowered`` and ``Compiled`` declare at most eight
attributes and have no ``__dict__``, and no module of the three floors
writes another object's private attribute.
"""

import ast
import dataclasses
import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import chex
import jax
import jax.numpy as jnp
import numpy as np

import ipu_jax
from ipu_jax import executable_cache
from ipu_jax import graph as g

_T16 = ipu_jax.IPUTarget.preset("ipu2", tiles_per_ipu=16)
_ROOT = pathlib.Path(__file__).resolve().parent.parent
_FLOORS = ("ipu_jax", "lowering", "kernels")
_MAX_ATTRIBUTES = 8


def _step(w, x, *, scale):
  return {"y": jnp.tanh(x @ w) * scale, "norm": jnp.sum(w * w)}


def _args():
  rng = np.random.default_rng(0)
  return (rng.standard_normal((8, 4)).astype(np.float32),
          rng.standard_normal((3, 8)).astype(np.float32))


def _declared_attributes(cls) -> tuple:
  """The attributes ``cls`` declares: its dataclass fields, else its ``__slots__``."""
  if dataclasses.is_dataclass(cls):
    return tuple(f.name for f in dataclasses.fields(cls))
  return tuple(getattr(cls, "__slots__", ()))


class StagesTest(chex.TestCase, parameterized.TestCase):

  def tearDown(self):
    # JAX's compilation cache must not stay pointed at a removed directory.
    executable_cache.disable_compilation_cache()
    super().tearDown()

  def test_trace_lower_compile_equal_jax_jit(self):
    w, x = _args()
    f = ipu_jax.jit(_step, target=_T16)
    traced = f.trace(w, x, scale=2.0)
    self.assertIsInstance(traced, ipu_jax.Traced)
    self.assertEqual([a.shape for a in traced.signature.in_avals], [(8, 4), (3, 8), ()])
    lowered = traced.lower()
    self.assertIsInstance(lowered, ipu_jax.Lowered)
    self.assertGreater(lowered.report.total_cycles, 0)
    compiled = lowered.compile()
    self.assertIsInstance(compiled, ipu_jax.Compiled)
    self.assertIs(lowered.compile(), compiled)  # one Compiled per Lowered
    want = jax.jit(_step, static_argnames="scale")(w, x, scale=2.0)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, compiled(w, x, scale=2.0)),
                                jax.tree.map(np.asarray, want), rtol=1e-5, atol=1e-6)
    # f.lower(...) gives the same program as the explicit stages.
    self.assertEqual(f.lower(w, x, scale=2.0).report.total_cycles,
                     lowered.report.total_cycles)

  def test_constants_are_laid_out_on_the_host(self):
    # A program's constants (of sizes no other test uses; the matmul's on
    # its block grid) are laid out as tile storage with NumPy and placed on
    # the device as they are: with nothing to fold, lowering builds no JAX
    # program of its own, where laying them out with JAX ops (even
    # jnp.asarray of a NumPy array) lowered and compiled one per shape.
    rng = np.random.default_rng(3)
    c1, c2, w = (rng.standard_normal(s).astype(np.float32)
                 for s in ((37, 53), (37, 53), (53, 29)))
    fn = lambda x: (x * c1 + c2, x @ w)  # noqa: E731
    x = rng.standard_normal((37, 53)).astype(np.float32)
    traced = ipu_jax.jit(fn, target=_T16).trace(x)
    events = []
    listener = lambda event, duration, **_: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
      lowered = traced.lower()
    finally:
      jax.monitoring.unregister_event_duration_listener(listener)
    self.assertNotIn("/jax/core/compile/jaxpr_to_mlir_module_duration", events)
    self.assertLen(lowered.tile.constants, 3)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, lowered.compile()(x)),
                                jax.tree.map(np.asarray, jax.jit(fn)(x)), rtol=1e-5, atol=1e-5)

  def test_lowered_is_immutable(self):
    w, x = _args()
    lowered = ipu_jax.jit(_step, target=_T16).lower(w, x, scale=1.0)
    with self.assertRaises(dataclasses.FrozenInstanceError):
      lowered.profile = None

  @parameterized.parameters(ipu_jax.Lowered, ipu_jax.Compiled)
  def test_declares_at_most_eight_attributes(self, cls):
    declared = _declared_attributes(cls)
    self.assertTrue(declared, f"{cls.__name__} declares no attributes")
    self.assertLessEqual(len(declared), _MAX_ATTRIBUTES, f"{cls.__name__}: {declared}")
    self.assertFalse(hasattr(cls, "__getattr__"), f"{cls.__name__} computes attributes")

  def test_instances_have_no_dict(self):
    w, x = _args()
    lowered = ipu_jax.jit(_step, target=_T16).lower(w, x, scale=1.0)
    for value in (lowered, lowered.compile()):
      self.assertFalse(hasattr(value, "__dict__"), type(value).__name__)

  def test_lowered_surface_runs_its_compiled_program(self):
    # Calling the Lowered, its device state and seed go to one Compiled.
    cfg = ipu_jax.IPUConfig()
    cfg.floating_point_behaviour.esr = "ON"
    fn = lambda x: (x * 1.001).astype(jnp.float16)
    x = np.linspace(0.5, 2, 40, dtype=np.float32)
    lowered = ipu_jax.jit(fn, target=_T16, config=cfg).lower(x)
    first = np.asarray(lowered(x))
    self.assertLen(lowered.device_state, 1)
    lowered.set_seed()
    np.testing.assert_array_equal(np.asarray(lowered.compile()(x)), first)
    chex.assert_trees_all_close(first.astype(np.float32), np.asarray(fn(x), np.float32),
                                rtol=1e-3)

  def test_cache_hit_reseeds_without_the_tile_program(self):
    # A loaded program has no tile program; set_seed lays the generators'
    # state out from the entry, lowering nothing.
    def config(cache_dir):
      cfg = ipu_jax.IPUConfig()
      cfg.executable_cache_dir = cache_dir
      cfg.report.progress = False
      cfg.floating_point_behaviour.esr = "ON"
      return cfg
    fn = lambda x: (x * 1.001).astype(jnp.float16)
    x = np.linspace(0.5, 2, 40, dtype=np.float32)
    cache_dir = self.create_tempdir().full_path
    results = []
    for _ in range(2):
      lowered = ipu_jax.jit(fn, target=_T16, config=config(cache_dir)).lower(x)
      np.asarray(lowered(x))  # advances the generators; read so its errors surface
      lowered.set_seed(7)
      results.append(np.asarray(lowered(x)))
    self.assertEqual(lowered.host.cache, "hit")
    self.assertIsNone(lowered.program)
    np.testing.assert_array_equal(results[0], results[1])

  def test_graph_engine_runs_through_the_stages(self):
    graph = g.Graph(_T16)
    v = graph.add_variable("float32", (4,), "v")
    graph.map_tensor_linearly(v)
    cs = graph.add_compute_set("double")

    @g.codelet(inputs=("x",), outputs=("y",), cycles=lambda x, target: 10)
    def double(x):
      return 2 * x

    graph.add_vertex(cs, double, tile=0, x=v, y=v)
    engine = g.Engine(graph, [g.Sequence([g.Execute(cs)])])
    engine.write_tensor(v, [1, 2, 3, 4])
    engine.run(0)
    engine.run(0)
    np.testing.assert_array_equal(engine.read_tensor(v), [4, 8, 12, 16])
    self.assertIs(engine.report(0).profile, engine.profiles[0])


def _private_writes(tree: ast.AST) -> list:
  """``(line, text)`` of every write of another object's private attribute.

  A write is ``x._name = ...`` (also augmented, annotated or unpacked),
  ``setattr(x, "_name", ...)`` or ``object.__setattr__(x, "_name", ...)``
  where ``x`` is not ``self`` or ``cls``. A class's own methods may write
  the attributes that class declares (``self._name = ...`` in its body, its
  ``__slots__``) on other instances of itself, and any attribute of an
  instance they have just made (``x = cls(...)``).
  """
  found = []

  def targets_of(node):
    if isinstance(node, ast.Assign):
      stack = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      stack = [node.target]
    else:
      return
    while stack:
      target = stack.pop()
      if isinstance(target, (ast.Tuple, ast.List)):
        stack.extend(target.elts)
      elif isinstance(target, ast.Starred):
        stack.append(target.value)
      elif isinstance(target, ast.Attribute):
        yield target.value, target.attr, ast.unparse(target)

  def calls_of(node):
    if not isinstance(node, ast.Call) or len(node.args) < 2:
      return
    func, name = node.func, node.args[1]
    is_setattr = (isinstance(func, ast.Name) and func.id == "setattr") or (
        isinstance(func, ast.Attribute) and func.attr == "__setattr__")
    if is_setattr and isinstance(name, ast.Constant) and isinstance(name.value, str):
      yield node.args[0], name.value, ast.unparse(node)

  def own(value) -> bool:
    return isinstance(value, ast.Name) and value.id in ("self", "cls")

  def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")

  def declared(cls_node) -> set:
    names = set()
    for node in ast.walk(cls_node):
      for value, name, _ in targets_of(node) or ():
        if own(value):
          names.add(name)
      if isinstance(node, ast.Assign) and any(
          isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
        names.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
    return names

  def made_here(function, class_name) -> set:
    """Names a method binds to a new instance of its class (``x = cls(...)``)."""
    names = set()
    for node in ast.walk(function):
      if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
          and isinstance(node.value.func, ast.Name)
          and node.value.func.id in ("cls", class_name)):
        names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names

  def visit(node, allowed, made, class_name):
    if isinstance(node, ast.ClassDef):
      allowed, class_name = allowed | declared(node), node.name
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and class_name:
      made = made | made_here(node, class_name)
    writes = list(targets_of(node) or ()) + list(calls_of(node) or ())
    for value, name, text in writes:
      fresh = isinstance(value, ast.Name) and value.id in made
      if private(name) and not own(value) and not fresh and name not in allowed:
        found.append((node.lineno, text))
    for child in ast.iter_child_nodes(node):
      visit(child, allowed, made, class_name)

  visit(tree, frozenset(), frozenset(), None)
  return found


class PrivateAttributeTest(absltest.TestCase):

  def test_no_module_writes_another_objects_private_attribute(self):
    offenders = []
    for floor in _FLOORS:
      for path in sorted((_ROOT / floor).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(_ROOT)
        offenders += [f"{where}:{line}: {text}" for line, text in _private_writes(tree)]
    self.assertEqual(offenders, [], "private attributes written from outside their class "
                     "(give the class a constructor or method that sets them):\n  "
                     + "\n  ".join(offenders))

  def test_the_check_catches_each_kind_of_write(self):
    source = (
        "class A:\n"
        "  def __init__(self):\n"
        "    self._mine = 1\n"
        "  def copy(self, other):\n"
        "    other._mine = 2\n"                        # its own attribute: allowed
        "  @classmethod\n"
        "  def make(cls):\n"
        "    new = cls()\n"
        "    new._other = 1\n"                         # a new instance of its own: allowed
        "def f(a, b):\n"
        "  a._x = 1\n"
        "  a._y, b._z = 1, 2\n"
        "  a._w += 1\n"
        "  setattr(a, '_v', 1)\n"
        "  object.__setattr__(a, '_u', 1)\n"
        "  a.public = 1\n"
        "  a._mine = 3\n")                              # outside class A: caught
    texts = [text for _, text in _private_writes(ast.parse(source))]
    self.assertLen(texts, 7, texts)
    for name in ("_x", "_y", "_z", "_w", "_v", "_u", "_mine"):
      self.assertTrue(any(name in t for t in texts), name)


if __name__ == "__main__":
  absltest.main()
