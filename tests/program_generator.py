"""A seeded generator of random JAX programs for the fuzz test.

``generate(seed)`` returns a :class:`Program`: a function, the arguments to
call it with and how its results must compare with ``jax.jit``'s. The seed
picks one of the operation families below, then random shapes (odd sizes that
do not divide the tile count, scalars, empty axes), dtypes and parameters
(axes, strides, padding, dilation, groups, index modes), and then maybe one
transformation on top: a tail of elementwise operations on the result,
``jax.vmap`` over a new leading axis or ``jax.grad`` of a scalar loss. Half
the programs then compute values they drop (``_with_dead_code``: a dot, an
elementwise tail, a loop, a JVP through a ``custom_vjp``; at the top level or
in a jitted helper), drawn from a stream of their own so the rest of the
seed's program is unchanged.

Comparison classes (``Program.compare``):

* ``"exact"``: bit-identical results (NaNs included). Elementwise maths, shape
  and data movement, gathers, sorts, casts, max/min reductions and pooling:
  each tile applies the same XLA operation to the same values.
* ``"ulp"``: at most 3 ulps apart, NaNs in the same places. Programs whose
  last operation divides by a constant array, by a broadcast operand (a
  scalar or size-1 axes) or by a square root: XLA rewrites
  ``x / broadcast(y)`` into ``x * broadcast(1/y)``, ``x / c`` (once it has
  folded the constant) into ``x * (1/c)`` and ``x / sqrt(y)`` into
  ``x * rsqrt(y)``. Measured over 4 million float32 pairs: the reciprocal
  forms are at most 1 ulp from the correctly rounded quotient (10-26 % of
  results off by one), the rsqrt form at most 3 ulps (39 % differ). The tile
  program may not give XLA the same pattern: it broadcasts the divisor by an
  exchange, holds a constant in tile memory (an input of the compiled
  function), or has an exchange between the square root and the division,
  and then it divides. Where more operations follow such a division the
  program compares as ``"rounding"``.
* ``"rounding"``: ``rtol = atol = 2e-5`` (float16: 2e-3, bfloat16: 2e-2) of the
  result's scale. Sums, products, dots, convolutions, cumulative sums,
  scatter-add with repeated indices, loops and gradients: a tile program
  accumulates in a different order (partials per tile, then a tree) than
  XLA's single loop, so results agree to rounding, not bit for bit.

Other XLA rewrites need no budget: the tile program is itself compiled by
XLA as one function, and XLA applies the same algebraic rewrites there
(``a * b + c`` -> fused multiply-add, ``x / sqrt(y)`` -> ``x * rsqrt(y)``,
``log(exp(x))`` -> ``x``, ``exp(a) * exp(b)`` -> ``exp(a + b)``, division by
a literal scalar), so those programs stay bit-exact.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

__all__ = ["Program", "generate", "FAMILIES"]

_SIZES = (1, 2, 3, 5, 7, 13, 17, 33)


@dataclasses.dataclass
class Program:
  """One random program.

  Attributes:
    name: the seed, the family and the choices made (readable, reproducible).
    fn: the function to run under ``ipu_jax.jit`` and ``jax.jit``.
    args: its positional arguments (NumPy arrays).
    compare: ``"exact"``, ``"ulp"`` or ``"rounding"`` (see the module
      docstring).
    family: the operation family.
  """
  name: str
  fn: Callable
  args: tuple
  compare: str
  family: str
  dead_code: tuple = ()  # kinds of dead code added (``_with_dead_code``)


@dataclasses.dataclass
class _Case:
  """What a family builds: ``fn`` and a maker of fresh arguments."""
  desc: str
  fn: Callable
  make_args: Callable[[np.random.Generator], tuple]
  compare: str
  float_first_arg: bool = True  # grad can differentiate w.r.t. argument 0
  float_result: bool = True  # a float result the tail and grad can use


def _shape(rng, rank=None, allow_empty=True, max_rank=3):
  rank = int(rng.integers(0, max_rank + 1)) if rank is None else rank
  shape = [int(rng.choice(_SIZES)) for _ in range(rank)]
  if allow_empty and rank and rng.random() < 0.08:
    shape[int(rng.integers(rank))] = 0
  return tuple(shape)


def _array(rng, shape, dtype, low=-3.0, high=3.0):
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.random(shape) > 0.5
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -50), min(info.max, 50) + 1, size=shape).astype(dtype)
  return rng.uniform(low, high, size=shape).astype(dtype)


def _float_dtype(rng):
  """float32 three times in five, else float16 or bfloat16."""
  return np.dtype([np.float32, np.float32, np.float32, np.float16, jnp.bfloat16][
      int(rng.integers(5))])


# ----------------------------------------------------------------- families

_UNARY = {
    "neg": lax.neg, "abs": lax.abs, "exp": jnp.exp, "tanh": jnp.tanh, "sin": jnp.sin,
    "logistic": jax.nn.sigmoid, "log1p_abs": lambda x: jnp.log1p(jnp.abs(x)),
    "sqrt_abs": lambda x: jnp.sqrt(jnp.abs(x)), "floor": jnp.floor, "round": jnp.round,
    "square": jnp.square, "relu": jax.nn.relu, "gelu": jax.nn.gelu, "erf": lax.erf,
    "rsqrt": lambda x: lax.rsqrt(jnp.abs(x) + 0.5), "sign": jnp.sign,
}
_BINARY = {
    "add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lambda a, b: a / (jnp.abs(b) + 0.5),
    "max": lax.max, "min": lax.min, "pow": lambda a, b: jnp.abs(a) ** b,
    "atan2": lax.atan2, "rem": lambda a, b: lax.rem(a, jnp.abs(b) + 0.5),
    "where_gt": lambda a, b: jnp.where(a > b, a, b * 2),
    "fma": lambda a, b: a * b + 1.5, "div_const": lambda a, b: a / 3.0 - b,
    "div_sqrt": lambda a, b: a / jnp.sqrt(jnp.abs(b) + 1),
}

def _elementwise(rng):
  dtype = _float_dtype(rng)
  shape = _shape(rng, max_rank=3)
  # The second operand broadcasts along random size-1 axes.
  other = tuple(1 if rng.random() < 0.3 else d for d in shape)
  steps = [("u", str(rng.choice(list(_UNARY)))) if rng.random() < 0.5 else
           ("b", str(rng.choice(list(_BINARY)))) for _ in range(int(rng.integers(1, 5)))]

  # Sometimes the chain ends dividing by an array closed over by the
  # function: a compile-time constant to jax.jit (which XLA turns into a
  # multiplication by its reciprocal), a runtime tile tensor to the emulator.
  divisor = (_array(rng, other, dtype, 0.5, 3.0) * np.where(rng.random(other) < 0.5, -1, 1)
             ).astype(dtype) if rng.random() < 0.2 else None

  def fn(x, y):
    for kind, name in steps:
      x = _UNARY[name](x) if kind == "u" else _BINARY[name](x, y)
    return x if divisor is None else x / divisor

  # XLA turns a division by a broadcast operand into a multiplication by the
  # broadcast reciprocal; the tile program broadcasts the divisor by an
  # exchange first and divides. Up to 1 ulp apart when the division is the
  # last step; later steps carry that difference on, to rounding.
  # Likewise ``x / sqrt(y)`` becomes ``x * rsqrt(y)`` where XLA sees both
  # (it does not when an exchange sits between them).
  divides_broadcast = any(n == "div_sqrt" or (n == "div" and other != shape) for _, n in steps)
  last = steps[-1][1]
  if divisor is not None or (divides_broadcast and (
      last == "div_sqrt" or (last == "div" and other != shape))):
    compare = "ulp"
  elif divides_broadcast:
    compare = "rounding"
  else:
    compare = "exact"
  return _Case(f"elementwise {[n for _, n in steps]}{' / constant' if divisor is not None else ''} "
               f"{dtype.name}{list(shape)} with {list(other)}", fn,
               lambda r: (_array(r, shape, dtype), _array(r, other, dtype)), compare)


def _integer_ops(rng):
  dtype = np.dtype(rng.choice(["int32", "int8", "uint8", "int16"]))
  shape = _shape(rng)
  ops = [str(rng.choice(["add", "mul", "max", "and", "xor", "shl", "div", "rem", "not"]))
         for _ in range(int(rng.integers(1, 4)))]
  table = {
      "add": lax.add, "mul": lax.mul, "max": lax.max, "and": lax.bitwise_and,
      "xor": lax.bitwise_xor, "shl": lambda a, b: lax.shift_left(a, b % 5),
      "div": lambda a, b: lax.div(a, jnp.where(b == 0, 1, b).astype(a.dtype)),
      "rem": lambda a, b: lax.rem(a, jnp.where(b == 0, 1, b).astype(a.dtype)),
      "not": lambda a, b: lax.bitwise_not(a),
  }

  def fn(x, y):
    for name in ops:
      x = table[name](x, y)
    return x

  return _Case(f"integer {ops} {dtype.name}{list(shape)}", fn,
               lambda r: (_array(r, shape, dtype), _array(r, shape, dtype)), "exact",
               float_first_arg=False, float_result=False)


def _casts(rng):
  chain = [np.dtype(d) for d in rng.choice(
      ["float32", "float16", "bfloat16", "int32", "int8", "uint8", "bool", "int16"],
      size=int(rng.integers(1, 4)))]
  chain = [np.dtype(jnp.bfloat16) if d.name == "bfloat16" else d for d in chain]
  shape = _shape(rng)

  def fn(x):
    for dtype in chain:
      x = x.astype(dtype)
    return x

  # Values stay inside every integer range (float -> int of an out-of-range
  # value is implementation-defined).
  return _Case(f"casts {[d.name for d in chain]} {list(shape)}", fn,
               lambda r: (_array(r, shape, np.float32, -100, 100),), "exact",
               float_result=chain[-1].kind == "f")


def _reductions(rng):
  dtype = _float_dtype(rng)
  shape = _shape(rng, rank=int(rng.integers(1, 4)))
  axes = tuple(int(a) for a in np.flatnonzero(rng.random(len(shape)) < 0.6)) or (0,)
  op = str(rng.choice(["sum", "max", "min", "prod", "mean", "argmax", "argmin",
                       "logsumexp", "any", "var"]))
  nonempty = 0 not in shape
  if op in ("argmax", "argmin"):
    axes = (axes[0],)
    if shape[axes[0]] == 0:
      shape = shape[:axes[0]] + (3,) + shape[axes[0] + 1:]
  if op in ("max", "min") and not nonempty:
    shape = tuple(d or 2 for d in shape)
  table = {
      "sum": lambda x: jnp.sum(x, axes), "max": lambda x: jnp.max(x, axes),
      "min": lambda x: jnp.min(x, axes), "prod": lambda x: jnp.prod(x * 0.4, axes),
      "mean": lambda x: jnp.mean(x, axes), "argmax": lambda x: jnp.argmax(x, axes[0]),
      "argmin": lambda x: jnp.argmin(x, axes[0]),
      "logsumexp": lambda x: jax.nn.logsumexp(x, axes), "any": lambda x: jnp.any(x > 1, axes),
      "var": lambda x: jnp.var(x, axes),
  }
  exact = op in ("max", "min", "argmax", "argmin", "any")
  return _Case(f"reduce {op} axes {axes} {dtype.name}{list(shape)}", table[op],
               lambda r: (_array(r, shape, dtype),), "exact" if exact else "rounding",
               float_result=op not in ("argmax", "argmin", "any"))


def _shape_ops(rng):
  shape = _shape(rng, rank=int(rng.integers(1, 4)))
  rank = len(shape)
  op = str(rng.choice(["transpose", "reshape", "slice", "pad", "concat", "rev", "broadcast",
                       "dynamic_slice", "dynamic_update_slice", "squeeze_expand", "roll"]))
  perm = tuple(int(p) for p in rng.permutation(rank))
  starts = [int(rng.integers(0, d + 1)) for d in shape]
  limits = [int(rng.integers(s, d + 1)) for s, d in zip(starts, shape)]
  strides = [int(rng.integers(1, 3)) for _ in shape]
  pads = [(int(rng.integers(-1, 3)), int(rng.integers(-1, 3)), int(rng.integers(0, 2)))
          for _ in shape]
  pads = [(lo if d > 1 else max(lo, 0), hi if d > 1 else max(hi, 0), it) for (lo, hi, it), d
          in zip(pads, shape)]
  sizes = [int(rng.integers(0, d + 1)) for d in shape]
  axis = int(rng.integers(rank))
  table = {
      "transpose": lambda x: jnp.transpose(x, perm),
      "reshape": lambda x: x.reshape(-1, shape[-1]) if 0 not in shape else x.reshape(shape[::-1]),
      "slice": lambda x: lax.slice(x, starts, limits, strides),
      "pad": lambda x: lax.pad(x, jnp.asarray(-7, x.dtype), pads),
      "concat": lambda x: jnp.concatenate([x, x * 2, x[..., :1]], axis=rank - 1),
      "rev": lambda x: lax.rev(x, tuple(i for i in range(rank) if i != axis)),
      "broadcast": lambda x: jnp.broadcast_to(x[None], (3,) + shape),
      "dynamic_slice": lambda x: lax.dynamic_slice(x, [jnp.int32(s - 1) for s in starts], sizes),
      "dynamic_update_slice": lambda x: lax.dynamic_update_slice(
          x, jnp.ones(sizes, x.dtype) * 5, [jnp.int32(s + 1) for s in starts]),
      "squeeze_expand": lambda x: jnp.squeeze(jnp.expand_dims(x, (0, rank)), 0),
      "roll": lambda x: jnp.roll(x, 3, axis=axis),
  }
  dtype = np.dtype(rng.choice(["float32", "int32", "float16"]))
  params = {"transpose": perm, "slice": (starts, limits, strides), "pad": pads,
            "dynamic_slice": (starts, sizes), "dynamic_update_slice": (starts, sizes)}
  return _Case(f"shape {op} {params.get(op, axis)} {dtype.name}{list(shape)}", table[op],
               lambda r: (_array(r, shape, dtype),), "exact",
               float_first_arg=dtype.kind == "f", float_result=dtype.kind == "f")


def _gather_scatter(rng):
  rows, cols = int(rng.choice(_SIZES[1:])), int(rng.choice(_SIZES))
  n = int(rng.choice((1, 4, 9, 37)))
  op = str(rng.choice(["take", "take_clip", "take_fill", "take_along", "set", "add", "max",
                       "min", "mul", "row_gather", "segment_sum"]))
  mode_low = -rows - 2 if op in ("take_clip", "take_fill") else -rows

  def make(r):
    x = _array(r, (rows, cols), np.float32)
    idx = r.integers(mode_low, rows + (2 if op in ("take_clip", "take_fill") else 0),
                     size=(n,)).astype(np.int32)
    upd = _array(r, (n, cols), np.float32)
    return x, idx, upd

  table = {
      "take": lambda x, i, u: x[i],
      "take_clip": lambda x, i, u: jnp.take(x, i, axis=0, mode="clip"),
      "take_fill": lambda x, i, u: jnp.take(x, i, axis=0, mode="fill", fill_value=-1.0),
      "take_along": lambda x, i, u: jnp.take_along_axis(
          x, jnp.abs(i[:, None] % rows) * jnp.ones((1, cols), jnp.int32), axis=0),
      "set": lambda x, i, u: x.at[i].set(u),
      "add": lambda x, i, u: x.at[i].add(u),
      "max": lambda x, i, u: x.at[i].max(u),
      "min": lambda x, i, u: x.at[i].min(u),
      "mul": lambda x, i, u: x.at[i].multiply(u),
      "row_gather": lambda x, i, u: x[i % rows, jnp.abs(i) % max(cols, 1)] if cols else x[i],
      "segment_sum": lambda x, i, u: jax.ops.segment_sum(u, jnp.abs(i) % rows, rows),
  }
  # Repeated indices make scatter-add/multiply order-dependent; "set" with
  # repeats picks an unspecified writer, so its indices are made unique.
  if op == "set":
    n = min(n, rows)

    def make(r):  # noqa: F811 (unique indices for set)
      x = _array(r, (rows, cols), np.float32)
      idx = r.permutation(rows)[:n].astype(np.int32)
      return x, idx, _array(r, (n, cols), np.float32)

  compare = "rounding" if op in ("add", "mul", "segment_sum") else "exact"
  return _Case(f"gather/scatter {op} table [{rows}, {cols}] indices {n}", table[op], make,
               compare)


_EINSUMS = ("ij,jk->ik", "bij,bjk->bik", "ij,kj->ik", "i,i->", "bi,ij->bj", "ijk,k->ij",
            "bij,jk->bik", "ij,ij->i", "i,j->ij")


def _dots(rng):
  spec = str(rng.choice(_EINSUMS))
  lhs, rest = spec.split(",")
  rhs = rest.split("->")[0]
  sizes = {c: int(rng.choice(_SIZES)) for c in "bijk"}
  if rng.random() < 0.05:
    sizes[str(rng.choice(list("ijk")))] = 0
  dtype = np.dtype(np.float32)
  lhs_shape = tuple(sizes[c] for c in lhs)
  rhs_shape = tuple(sizes[c] for c in rhs)
  fn = lambda a, b: jnp.einsum(spec, a, b, precision=lax.Precision.HIGHEST)
  return _Case(f"einsum {spec} {lhs_shape} x {rhs_shape}", fn,
               lambda r: (_array(r, lhs_shape, dtype), _array(r, rhs_shape, dtype)),
               "rounding")


def _half_batched_dots(rng):
  """A bfloat16 (sometimes float16) ``dot_general`` laid out as attention's
  gradients are: batch dims not all leading.

  The lhs is ``[batch..., contract, free]`` (a transposed lhs, as the
  backward pass's products are), the rhs's axes are in a random order with a
  batch dim out of place (the batch dims' order differs from the lhs's, or a
  batch dim comes later). This is the pairing XLA:CPU
  cannot run as a bfloat16 x bfloat16 -> float32 product once a batch element
  has more than about a hundred multiply-adds (``jax.jit`` runs it with a
  bfloat16 result), so the sizes are kept above that, but for an occasional
  empty free dim. Other layouts of such products are the einsum family's.
  """
  dtype = np.dtype(jnp.float16 if rng.random() < 0.25 else jnp.bfloat16)
  nb = int(rng.integers(1, 3))
  batch = [int(rng.choice((2, 3))) for _ in range(nb)]
  free = [int(rng.choice((7, 13, 16))) for _ in range(2)]
  if rng.random() < 0.05:
    free[int(rng.integers(2))] = 0
  contract = int(rng.choice((8, 13, 16)))
  bs = [("b", i) for i in range(nb)]
  size_of = {**dict(zip(bs, batch)), "c": contract, "f": free[0], "g": free[1]}
  lhs_order = bs + ["c", "f"]
  rhs_axes = bs + ["c", "g"]
  rhs_order = rhs_axes
  while rhs_order[:nb] == bs:
    rhs_order = [rhs_axes[i] for i in rng.permutation(len(rhs_axes))]
  dn = (((nb,), (rhs_order.index("c"),)),
        (tuple(lhs_order.index(b) for b in bs), tuple(rhs_order.index(b) for b in bs)))
  # jax.jit cannot run bf16 x bf16 -> f32 with such batch dims: not offered.
  preferred = [None, dtype] + ([np.dtype(np.float32)] if dtype == np.float16 else [])
  pet = preferred[int(rng.integers(len(preferred)))]
  lhs_shape = tuple(size_of[a] for a in lhs_order)
  rhs_shape = tuple(size_of[a] for a in rhs_order)
  fn = lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=pet)
  return _Case(f"dot_general {dtype.name} {lhs_shape} x {rhs_shape} {dn} -> {pet}", fn,
               lambda r: (_array(r, lhs_shape, dtype), _array(r, rhs_shape, dtype)),
               "rounding")


def _convolutions(rng):
  groups = int(rng.choice([1, 1, 2, 3]))
  batch = int(rng.choice([1, 2, 3]))
  cin = groups * int(rng.choice([1, 2, 3]))
  cout = groups * int(rng.choice([1, 2]))
  spatial = int(rng.choice([1, 2]))
  sizes = [int(rng.choice([5, 7, 9, 12])) for _ in range(spatial)]
  window = [int(rng.choice([1, 2, 3])) for _ in range(spatial)]
  strides = [int(rng.choice([1, 1, 2])) for _ in range(spatial)]
  rhs_dil = [int(rng.choice([1, 1, 2])) for _ in range(spatial)]
  lhs_dil = [int(rng.choice([1, 1, 2])) for _ in range(spatial)]
  padding = [(int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(spatial)]
  layout = {1: ("NCH", "OIH", "NCH"), 2: ("NCHW", "OIHW", "NCHW")}[spatial]
  if rng.random() < 0.5:
    layout = {1: ("NHC", "HIO", "NHC"), 2: ("NHWC", "HWIO", "NHWC")}[spatial]
  lhs_shape = (batch, cin, *sizes) if layout[0][1] == "C" else (batch, *sizes, cin)
  rhs_shape = ((cout, cin // groups, *window) if layout[1][0] == "O"
               else (*window, cin // groups, cout))

  def fn(x, w):
    return lax.conv_general_dilated(x, w, strides, padding, lhs_dilation=lhs_dil,
                                    rhs_dilation=rhs_dil, dimension_numbers=layout,
                                    feature_group_count=groups,
                                    precision=lax.Precision.HIGHEST)

  return _Case(f"conv {layout} lhs {lhs_shape} rhs {rhs_shape} strides {strides} pad "
               f"{padding} lhs_dil {lhs_dil} rhs_dil {rhs_dil} groups {groups}", fn,
               lambda r: (_array(r, lhs_shape, np.float32), _array(r, rhs_shape, np.float32)),
               "rounding")


def _pooling(rng):
  shape = (int(rng.choice([1, 2])), int(rng.choice([5, 7, 10])), int(rng.choice([5, 6, 9])),
           int(rng.choice([1, 3])))
  window = (1, int(rng.choice([1, 2, 3])), int(rng.choice([2, 3])), 1)
  strides = (1, int(rng.choice([1, 2])), int(rng.choice([1, 2, 3])), 1)
  padding = str(rng.choice(["VALID", "SAME"])) if rng.random() < 0.7 else (
      (0, 0), (1, 0), (0, 2), (0, 0))
  dilation = (1, int(rng.choice([1, 2])), 1, 1)
  op = str(rng.choice(["max", "sum", "avg", "min"]))
  table = {
      "max": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding,
                                         window_dilation=dilation),
      "min": lambda x: lax.reduce_window(x, jnp.inf, lax.min, window, strides, padding,
                                         window_dilation=dilation),
      "sum": lambda x: lax.reduce_window(x, 0.0, lax.add, window, strides, padding,
                                         window_dilation=dilation),
      "avg": lambda x: lax.reduce_window(x, 0.0, lax.add, window, strides, padding) / float(
          np.prod(window)),
  }
  return _Case(f"pool {op} {list(shape)} window {window} strides {strides} pad {padding} "
               f"dilation {dilation}", table[op],
               lambda r: (_array(r, shape, np.float32),),
               "exact" if op in ("max", "min") else "rounding")


def _scans_sorts(rng):
  shape = _shape(rng, rank=int(rng.integers(1, 3)))
  axis = int(rng.integers(len(shape)))
  op = str(rng.choice(["cumsum", "cumprod", "cummax", "cumlogsumexp", "sort", "sort_desc",
                       "argsort", "sort_pairs", "top_k"]))
  k = int(rng.integers(0, shape[-1] + 1))
  table = {
      "cumsum": lambda x: jnp.cumsum(x, axis), "cumprod": lambda x: jnp.cumprod(x * 0.5, axis),
      "cummax": lambda x: lax.cummax(x, axis),
      "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis),
      "sort": lambda x: jnp.sort(x, axis), "sort_desc": lambda x: -jnp.sort(-x, axis),
      "argsort": lambda x: jnp.argsort(jnp.round(x), axis, stable=True),
      "sort_pairs": lambda x: lax.sort((jnp.round(x), x), dimension=axis, num_keys=1),
      "top_k": lambda x: lax.top_k(x, k),
  }
  exact = op in ("cummax", "sort", "sort_desc", "argsort", "sort_pairs", "top_k")
  return _Case(f"{op} axis {axis} k {k} float32{list(shape)}", table[op],
               lambda r: (_array(r, shape, np.float32),), "exact" if exact else "rounding",
               float_result=op not in ("argsort", "top_k", "sort_pairs"))


def _control(rng):
  shape = _shape(rng, rank=int(rng.integers(0, 3)), allow_empty=False)
  length = int(rng.integers(0, 6))
  op = str(rng.choice(["scan", "fori", "while", "cond", "switch", "scan_reverse"]))

  def body(c, x):
    c = jnp.tanh(c * 0.9 + x)
    return c, c * 2

  table = {
      "scan": lambda c, xs: lax.scan(body, c, xs),
      "scan_reverse": lambda c, xs: lax.scan(body, c, xs, reverse=True),
      "fori": lambda c, xs: lax.fori_loop(0, length, lambda i, v: body(v, xs[i])[0], c),
      "while": lambda c, xs: lax.while_loop(
          lambda s: jnp.logical_and(s[0] < length, jnp.all(jnp.abs(s[1]) < 50)),
          lambda s: (s[0] + 1, s[1] * 1.5 + 0.25), (jnp.int32(0), c)),
      "cond": lambda c, xs: lax.cond(jnp.sum(c) > 0, lambda a: jnp.sin(a) * 2,
                                     lambda a: a - 1, c),
      "switch": lambda c, xs: lax.switch(jnp.clip(jnp.int32(jnp.sum(jnp.round(c))), -1, 3),
                                         [jnp.sin, jnp.cos, lambda a: a * 3, jnp.exp], c),
  }
  if op in ("fori",) and length == 0:
    length = 1
  xs_len = max(length, 1)
  return _Case(f"control {op} length {length} float32{list(shape)}", table[op],
               lambda r: (_array(r, shape, np.float32), _array(r, (xs_len,) + shape, np.float32)),
               "exact" if op in ("cond", "switch") else "rounding",
               float_result=op != "while")


def _random_bits(rng):
  shape = _shape(rng)
  op = str(rng.choice(["uniform", "normal", "bits", "randint", "split_uniform", "bernoulli"]))
  table = {
      "uniform": lambda k: jax.random.uniform(jax.random.key(k), shape),
      "normal": lambda k: jax.random.normal(jax.random.key(k), shape),
      "bits": lambda k: jax.random.bits(jax.random.key(k), shape),
      "randint": lambda k: jax.random.randint(jax.random.key(k), shape, -5, 7),
      "split_uniform": lambda k: jax.random.uniform(jax.random.split(jax.random.key(k))[1],
                                                    shape),
      "bernoulli": lambda k: jax.random.bernoulli(jax.random.key(k), 0.3, shape),
  }
  return _Case(f"random {op} {list(shape)}", table[op],
               lambda r: (np.uint32(r.integers(0, 2**31)),), "exact", float_first_arg=False,
               float_result=op in ("uniform", "normal", "split_uniform"))


FAMILIES: dict[str, Callable[[np.random.Generator], _Case]] = {
    "elementwise": _elementwise, "integer": _integer_ops, "casts": _casts,
    "reductions": _reductions, "shape": _shape_ops, "gather_scatter": _gather_scatter,
    "dot": _dots, "conv": _convolutions, "pooling": _pooling, "scans_sorts": _scans_sorts,
    "control": _control, "random": _random_bits, "half_batched_dot": _half_batched_dots,
}


# ---------------------------------------------------------- transformations

def _first_float_leaf(tree):
  leaves = [l for l in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(l), jnp.floating)]
  return leaves[0]


def _with_tail(case, rng):
  """Elementwise ops applied to the result (exact stays exact)."""
  names = [str(rng.choice(["tanh", "square", "relu", "sin", "neg", "abs"]))
           for _ in range(int(rng.integers(1, 3)))]

  def fn(*args):
    out = _first_float_leaf(case.fn(*args))
    for name in names:
      out = _UNARY[name](out)
    return out

  return dataclasses.replace(case, desc=f"{case.desc} then {names}", fn=fn)


def _with_grad(case):
  """``jax.grad`` of a scalar loss of the result w.r.t. the first argument."""

  def loss(first, *rest):
    out = _first_float_leaf(case.fn(first, *rest)).astype(jnp.float32)
    return jnp.sum(jnp.sin(out) * out)

  return dataclasses.replace(case, desc=f"grad of ({case.desc})", fn=jax.grad(loss),
                             compare="rounding")


def _with_vmap(case, batch):
  """``jax.vmap`` over a new leading axis of every argument."""

  def make(r):
    sets = [case.make_args(r) for _ in range(batch)]
    return tuple(np.stack(parts) for parts in zip(*sets))

  return dataclasses.replace(case, desc=f"vmap[{batch}] of ({case.desc})",
                             fn=jax.vmap(case.fn), make_args=make)


# ------------------------------------------------------------------ dead code


@jax.custom_vjp
def _custom_sin(x):
  return jnp.sin(x)


_custom_sin.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (cos * g,))


def _dead_value(kind, x, out):
  """A value of ``kind`` computed from an argument ``x`` and the result ``out``."""
  v = jnp.ravel(x)[:64].astype(jnp.float32)
  if kind == "dot":
    return jnp.dot(v, v) + jnp.outer(v, v)
  if kind == "tail":
    return jnp.tanh(jnp.asarray(out, jnp.float32)) * 3 + 1
  if kind == "loop":
    return lax.fori_loop(0, 3, lambda i, a: a * 2 + jnp.sin(a), v)
  # JVP through a custom_vjp: a custom_lin, which only a dead one may be.
  return jax.jvp(_custom_sin, (v,), (jnp.ones_like(v),))


def _with_dead_code(case, rng):
  """Values computed and dropped (``jax.jit`` never runs them): at the top
  level or inside a jitted helper whose output is unused. Results unchanged."""
  kinds = tuple(str(k) for k in rng.choice(["dot", "tail", "loop", "custom_lin"],
                                           size=int(rng.integers(1, 3)), replace=False))
  nested = bool(rng.random() < 0.4)

  def dead(args, out):
    first = _first_float_leaf(args) if any(
        jnp.issubdtype(jnp.result_type(a), jnp.floating) for a in args) else args[0]
    leaf = jax.tree_util.tree_leaves(out)[0]
    return [_dead_value(kind, first, leaf) for kind in kinds]

  def with_dead(*args):
    out = case.fn(*args)
    return out, dead(args, out)

  def fn(*args):
    return (jax.jit(with_dead) if nested else with_dead)(*args)[0]

  where = " in a jitted helper" if nested else ""
  return dataclasses.replace(case, desc=f"{case.desc} + dead {list(kinds)}{where}", fn=fn), kinds


def generate(seed: int, families: Sequence[str] | None = None) -> Program:
  """The random program of ``seed`` (deterministic)."""
  rng = np.random.default_rng(seed)
  names = list(families or FAMILIES)
  family = names[seed % len(names)]
  case = FAMILIES[family](rng)
  transform = rng.random()
  if transform < 0.15 and case.float_result and case.compare != "ulp":
    case = _with_tail(case, rng)
  elif transform < 0.3 and case.float_first_arg and case.float_result:
    case = _with_grad(case)
  elif transform < 0.45 and family not in ("random",):
    case = _with_vmap(case, int(rng.choice([1, 3])))
  # Its own stream, so adding dead code leaves every other choice of the seed as it was.
  dead_rng, kinds = np.random.default_rng((seed, 0xDEAD)), ()
  if dead_rng.random() < 0.5:
    case, kinds = _with_dead_code(case, dead_rng)
  args = case.make_args(rng)
  return Program(f"seed {seed}: {case.desc}", case.fn, tuple(args), case.compare, family,
                 kinds)
