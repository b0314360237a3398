"""Random numbers: PRNG keys, ``random_bits``, ``split``, ``fold_in``, threefry,
``rng_bit_generator``.

PRNG key arrays (the extended dtype ``key<impl>``) are held in tile memory as
their ``uint32`` key data: shape ``keys.shape + impl.key_shape``. Wrapping and
unwrapping keys therefore moves nothing: the result is the operand's tensor.

Tile plan of the generators (``random_seed``, ``random_split``,
``random_fold_in``, ``random_bits``): the result is mapped linearly over the
tiles; each tile runs threefry vertices for the words it holds (a counter-based
generator needs nothing but the key and the element's position), so the
exchange is the key data (and fold-in messages) sent to every tile that holds a
result made from them: a multicast of one key to all result tiles, or of each
key of a batch to its results' tiles. Compute is costed as an elementwise
threefry per 32-bit word generated. The vertex body re-wraps the key data
with the key's implementation and binds the JAX primitive itself, so the
numbers are exactly those of ``jax.jit``.

``rng_bit_generator`` (``lax.rng_bit_generator``: XLA's stateless
generator, which JAX's ``rbg`` and ``unsafe_rbg`` PRNG implementations call
inside their ``random_bits``) has the same plan: the ``uint32[4]`` key is
multicast to the tiles of the linearly mapped bits, each tile runs the
algorithm's counter-based blocks for the words it holds (Philox4x32-10 for
``RNG_DEFAULT`` and ``RNG_PHILOX``, as XLA:CPU expands the default, and
Threefry2x32-20 for ``RNG_THREE_FRY``; a block's counter is the key's
counter plus the block's position), and the tile holding the key writes the
new key (the counter advanced past the blocks used) in place. The vertex body
binds the primitive itself, so the bits and the new key are ``jax.jit``'s.

``random_gamma`` (``jax.random.gamma`` / ``loggamma`` / ``beta`` /
``dirichlet``) makes each sample on the tile of its ``alpha``: the keys (one,
or one per leading index under ``vmap``) are multicast to their samples'
tiles, and each tile runs the rejection sampler for the samples it holds,
costed as one expected Marsaglia-Tsang attempt per sample.

With ``random.mode = "hardware"`` (``LoweringOptions.random_mode``)
``random_bits`` draws its bits from the tiles' hardware generators instead,
as poprand's vertices do: one xoroshiro128aox stream per (tile, worker)
(``kernels/xoroshiro.py``), the per-tile state the program shares with
stochastic rounding (:func:`prng_state`: the same generators on the chip),
seeded by ``floating_point_behaviour.seed`` and perturbed by the replica
index, so each replica draws its own numbers. The key is not read: the
generator's state advances with every draw. The bits land linearly mapped;
each tile fills its own with a ``Uniform<int>`` vertex (raw 32-bit words),
priced by PopLibs' estimator (``kernels/poprand.py``). ``uniform``,
``bernoulli``, ``normal``, ``truncated_normal`` and dropout, all built on
``random_bits``, follow: the fusion pass joins the bits to the elementwise
chain that turns them into samples and prices the group as the one poprand
vertex that draws and converts in one pass (``Uniform``, ``Bernoulli``,
``Normal``, ``TruncatedNormal``, ``Dropout``: ``lowering/fused_cost.py``).
See docs/number_formats.md#random-numbers.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from ipu_jax.lowering.jax_compat import config, prng, random_core, threefry2x32
from ipu_jax.kernels import estimators, poprand
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import (add_costs, broadcast_cost, elementwise,
                                       logical, storage, worker_vertices)
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.exchange import movement_cost
from ipu_jax.lowering.lower import is_key_dtype
from ipu_jax.lowering.registry import register_lowering
from ipu_jax.lowering.tile_generators import (HARDWARE_BITS_VERTEX, WORKERS, draw_tile_words,
                                              mix_replica, prng_state)

__all__ = ["key_impl_of", "note_key_avals"]

# The key implementation of tensors made by these rules, by tensor id (an
# alias made by a reshape keeps the id, so it keeps its impl too).
_KEY_IMPLS: dict = {}


def _default_impl():
  name = config.default_prng_impl.value
  return prng.prngs[name]


def key_impl_of(ctx, tensor: P.Tensor, operand_index: int = 0):
  """The PRNG implementation of the key data in ``tensor``.

  Uses the equation's operand aval (``ctx.in_avals``) when it is a key type,
  else the impl recorded when the key was made here, else the default
  implementation (or the only one whose key shape fits).
  """
  in_avals = ctx.in_avals
  if operand_index < len(in_avals):
    aval = in_avals[operand_index]
    if is_key_dtype(aval.dtype):
      return aval.dtype._impl  # pylint: disable=protected-access
  impl = _KEY_IMPLS.get(tensor.id)
  if impl is not None:
    return impl
  default = _default_impl()
  shape = tuple(tensor.shape)
  ks = tuple(default.key_shape)
  if shape[len(shape) - len(ks):] == ks:
    return default
  for impl in prng.prngs.values():
    ks = tuple(impl.key_shape)
    if shape[len(shape) - len(ks):] == ks:
      return impl
  raise NotImplementedError(f"cannot tell the PRNG implementation of key data {shape}")


def note_key_avals(avals, tensors) -> None:
  """Remember the PRNG impl of every key-typed ``aval``'s tensor.

  Rules that lower a nested jaxpr (calls, loops, branches) see its input
  avals; recording the key impls there lets ``random_bits`` on those
  tensors use the right implementation.
  """
  for aval, tensor in zip(avals, tensors):
    if is_key_dtype(getattr(aval, "dtype", None)) and tensor is not None:
      _KEY_IMPLS.setdefault(tensor.id, aval.dtype._impl)  # pylint: disable=protected-access


def _record(tensor: P.Tensor, impl) -> P.Tensor:
  _KEY_IMPLS[tensor.id] = impl
  return tensor


def _wrap(data, impl):
  return prng.random_wrap_p.bind(data, impl=impl)


def _unwrap(keys):
  return prng.random_unwrap_p.bind(keys)


# -- cost ---------------------------------------------------------------------


def _fanout_cost(ctx, tensor: P.Tensor, members: np.ndarray, out: P.Tensor,
                 group_size: int):
  """Send the elements each output group needs to the tiles holding it.

  Args:
    tensor: the operand (key data or messages).
    members: ``[num_groups, k]`` flat elements of ``tensor`` that output group
      ``g`` is made from.
    out: the result; its element ``e`` belongs to group ``e // group_size``.
  """
  if tensor.size == 0 or out.size == 0:
    return None
  members = np.asarray(members, np.int64)
  if members.shape[0] == 0:
    return None
  if (members == members[:1]).all():
    # Every group uses the same elements: one multicast to all result tiles.
    if members.shape[1] == tensor.size:
      return broadcast_cost(ctx, tensor, out.mapping.tiles)
  # Pairs (group, result row) in element order: both never decrease for a
  # linear result, so consecutive duplicates are all the duplicates.
  omap = out.mapping
  group = np.arange(out.size, dtype=np.int64) // max(group_size, 1)
  row = omap.element_row
  keep = np.ones(out.size, bool)
  keep[1:] = (group[1:] != group[:-1]) | (row[1:] != row[:-1])
  if not omap.is_linear:
    pair = np.unique(group * omap.num_rows + row)
    g, r = pair // omap.num_rows, pair % omap.num_rows
  else:
    g, r = group[keep], row[keep]
  dst = omap.tiles[r]
  ids = members[g]  # [pairs, k]
  src = tensor.mapping.element_tile[ids]
  k = ids.shape[1]
  return movement_cost(ctx.target, src.reshape(-1), np.repeat(dst, k), tensor.itemsize,
                       element_id=ids.reshape(-1))


def _emit_generator(ctx, name: str, fn, operands: Sequence[P.Tensor],
                    members: Sequence[np.ndarray], out_shape, out_dtype,
                    group_size: int, words_per_element: float = 1.0,
                    cost_op: str = "threefry2x32") -> P.Tensor:
  """A result mapped linearly, made on its tiles from the operands' groups."""
  out = ctx.new_tensor(out_shape, out_dtype, name=name)
  target = ctx.target
  elements = out.mapping.elements_per_tile(target.num_tiles)
  words = np.ceil(elements * words_per_element).astype(np.int64)
  compute = estimators.elementwise_cycles(target, words, cost_op, 4)
  cost = add_costs(*[_fanout_cost(ctx, t, m, out, group_size)
                     for t, m in zip(operands, members)])
  tensors = tuple(operands)

  def step(*storages):
    args = [logical(s, t) for s, t in zip(storages, tensors)]
    return (storage(fn(*args), out),)

  if out.size:
    ctx.emit(P.Superstep(name=name, op=ctx.op, reads=tensors, writes=(out,), fn=step,
                         compute_cycles=compute, exchange=cost,
                         vertices=worker_vertices(ctx, words),
                         codelets=(vocab.vertex(vocab.RANDOM, cost_op),)))
  return out


def _key_members(num_keys: int, key_words: int) -> np.ndarray:
  """``[num_keys, key_words]``: the words of each key in the key data."""
  return (np.arange(num_keys, dtype=np.int64)[:, None] * key_words
          + np.arange(key_words, dtype=np.int64)[None, :])


# -- rules --------------------------------------------------------------------


def _random_seed(ctx: RuleContext, seeds, *, impl):
  ks = tuple(impl.key_shape)
  kw = int(np.prod(ks, dtype=np.int64))
  out = _emit_generator(
      ctx, "random_seed", lambda s: _unwrap(prng.random_seed_p.bind(s, impl=impl)),
      [seeds], [np.arange(seeds.size, dtype=np.int64)[:, None]],
      tuple(seeds.shape) + ks, np.uint32, kw, cost_op="random_seed")
  return [_record(out, impl)]


def _random_split(ctx: RuleContext, keys, *, shape):
  impl = ctx.out_avals[0].dtype._impl  # pylint: disable=protected-access
  ks = tuple(impl.key_shape)
  kw = int(np.prod(ks, dtype=np.int64))
  batch = tuple(keys.shape[:len(keys.shape) - len(ks)])
  num_keys = int(np.prod(batch, dtype=np.int64))
  per_key = int(np.prod(shape, dtype=np.int64)) * kw
  out = _emit_generator(
      ctx, "random_split",
      lambda d: _unwrap(prng.random_split_p.bind(_wrap(d, impl), shape=tuple(shape))),
      [keys], [_key_members(num_keys, kw)], batch + tuple(shape) + ks, np.uint32,
      max(per_key, 1))
  return [_record(out, impl)]


def _random_fold_in(ctx: RuleContext, keys, msgs):
  impl = ctx.out_avals[0].dtype._impl  # pylint: disable=protected-access
  ks = tuple(impl.key_shape)
  kw = int(np.prod(ks, dtype=np.int64))
  key_batch = tuple(keys.shape[:len(keys.shape) - len(ks)])
  out_batch = tuple(ctx.out_avals[0].shape)

  def index_in(batch_shape):
    """Which key / message each result key is folded from (broadcasting)."""
    size = int(np.prod(batch_shape, dtype=np.int64))
    ids = np.arange(size, dtype=np.int64).reshape(batch_shape)
    ids = ids.reshape((1,) * (len(out_batch) - len(batch_shape)) + tuple(batch_shape))
    return np.broadcast_to(ids, out_batch).reshape(-1)

  key_of = index_in(key_batch)
  msg_of = index_in(tuple(msgs.shape))
  out = _emit_generator(
      ctx, "random_fold_in",
      lambda d, m: _unwrap(prng.random_fold_in_p.bind(_wrap(d, impl), m)),
      [keys, msgs], [_key_members(1, kw)[0][None, :] + key_of[:, None] * kw,
                     msg_of[:, None]],
      out_batch + ks, np.uint32, kw)
  return [_record(out, impl)]


def _random_bits(ctx: RuleContext, keys, *, bit_width, shape):
  if ctx.options.random_mode == "hardware":
    return [_hardware_bits(ctx, bit_width)]
  impl = key_impl_of(ctx, keys)
  ks = tuple(impl.key_shape)
  kw = int(np.prod(ks, dtype=np.int64))
  batch = tuple(keys.shape[:len(keys.shape) - len(ks)])
  num_keys = int(np.prod(batch, dtype=np.int64))
  per_key = int(np.prod(shape, dtype=np.int64))
  out_aval = ctx.out_avals[0]
  out = _emit_generator(
      ctx, "random_bits",
      lambda d: prng.random_bits_p.bind(_wrap(d, impl), bit_width=bit_width,
                                        shape=tuple(shape)),
      [keys], [_key_members(num_keys, kw)], tuple(out_aval.shape), np.dtype(out_aval.dtype),
      max(per_key, 1), words_per_element=bit_width / 32)
  return [out]


def _random_wrap(ctx: RuleContext, data, *, impl):
  del ctx
  return [_record(data, impl)]


def _random_unwrap(ctx: RuleContext, keys):
  del ctx
  return [keys]


def _random_clone(ctx: RuleContext, keys):
  impl = ctx.out_avals[0].dtype._impl if is_key_dtype(ctx.out_avals[0].dtype) else None
  if impl is not None:
    _record(keys, impl)
  return [keys]


def _threefry2x32(ctx: RuleContext, *operands):
  def body(*arrays):
    shape = next((a.shape for a in arrays if a.ndim), ())
    return tuple(threefry2x32.threefry2x32_p.bind(*[jnp.broadcast_to(a, shape) for a in arrays]))

  return elementwise(ctx, body, list(operands), cost_op="threefry2x32",
                     flops_per_element=0)


def _iota_2x32_shape(ctx: RuleContext, *, shape):
  shape = tuple(int(d) for d in shape)
  hi = ctx.new_tensor(shape, np.uint32, name="iota_hi")
  lo = ctx.new_tensor(shape, np.uint32, hi.mapping, name="iota_lo")
  target = ctx.target
  elements = hi.mapping.elements_per_tile(target.num_tiles)

  def step():
    h, l = prng.iota_2x32_shape_p.bind(shape=shape)
    return storage(h, hi), storage(l, lo)

  if hi.size:
    ctx.emit(P.Superstep(name="iota_2x32", op=ctx.op, reads=(), writes=(hi, lo), fn=step,
                         compute_cycles=2 * estimators.fill_cycles(target, elements, 4),
                         vertices=worker_vertices(ctx, elements), codelets=(vocab.vertex(vocab.IOTA, "uint"),)))
  return [hi, lo]


# ``rng_bit_generator``'s algorithms: the cost op of a 32-bit word (see
# ``estimators.ELEMENTWISE_COST``). XLA:CPU expands RNG_DEFAULT as Philox.
_RBG_COST_OPS = {
    lax.RandomAlgorithm.RNG_DEFAULT: "philox4x32",
    lax.RandomAlgorithm.RNG_PHILOX: "philox4x32",
    lax.RandomAlgorithm.RNG_THREE_FRY: "threefry2x32",
}


def _rng_bit_generator(ctx: RuleContext, key, *, shape, dtype, algorithm, **unused):
  """``lax.rng_bit_generator``: ``(new_key, bits)``, both ``jax.jit``'s.

  The bits are mapped linearly and made on their tiles from the key,
  multicast to them; the new key is written where the key lies (a constant
  key's on the default mapping).
  """
  del unused  # out_sharding: one IPU program has no sharding of its own
  dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
  cost_op = _RBG_COST_OPS.get(algorithm)
  if cost_op is None:
    raise NotImplementedError(f"rng_bit_generator: algorithm {algorithm} (known: "
                              f"{', '.join(a.name for a in _RBG_COST_OPS)})")
  target = ctx.target
  key_mapping = key.mapping if key.category != "constants" else None
  new_key = ctx.new_tensor(key.shape, key.dtype, key_mapping, name="rng_bit_generator/key")
  bits = ctx.new_tensor(shape, dtype, name="rng_bit_generator")
  # 32-bit words per tile: the algorithm's blocks cover the result's bytes.
  words = np.ceil(bits.mapping.elements_per_tile(target.num_tiles) * dtype.itemsize / 4)
  words = words.astype(np.int64)
  compute = estimators.elementwise_cycles(target, words, cost_op, 4)
  # The new key: the counter advanced, on the key's tiles (a few adds).
  key_words = new_key.mapping.elements_per_tile(target.num_tiles)
  compute = compute + estimators.elementwise_cycles(target, key_words, "add", 4)
  cost = _fanout_cost(ctx, key, _key_members(1, key.size), bits, max(bits.size, 1))
  if key_mapping is None:
    cost = add_costs(cost, movement_cost(target, key.mapping.element_tile,
                                         new_key.mapping.element_tile, key.itemsize))

  def step(key_storage):
    made_key, made_bits = lax.rng_bit_generator_p.bind(
        logical(key_storage, key), shape=shape, dtype=dtype, algorithm=algorithm,
        out_sharding=None)
    return storage(made_key, new_key), storage(made_bits, bits)

  ctx.emit(P.Superstep(
      name=f"rng_bit_generator {algorithm.name}", op=ctx.op, reads=(key,),
      writes=(new_key, bits), fn=step, compute_cycles=compute, exchange=cost,
      vertices=worker_vertices(ctx, words + key_words),
      codelets=(vocab.vertex(vocab.RANDOM, cost_op),)))
  return [new_key, bits]


# Cycles per vector of samples of one Marsaglia-Tsang attempt of
# ``random_gamma``: two normals and a uniform from threefry words (about four
# 40-cycle words), a log, a cube and a compare. An attempt is accepted with
# probability above 0.95 for every alpha, so one attempt is the expected cost.
_GAMMA_CYCLES_PER_VECTOR = 4 * 40 + 20


def _random_gamma(ctx: RuleContext, keys, alpha, *, log_space):
  """Gamma samples made on the tiles of ``alpha``, each from its key.

  ``keys`` has a prefix of ``alpha``'s shape (one key for all samples, or one
  per leading index under ``vmap``): each key's words are multicast to the
  tiles that hold the samples made from it. The sampler is a rejection loop
  per element; its cost is one (expected) attempt.
  """
  impl = key_impl_of(ctx, keys)
  ks = tuple(impl.key_shape)
  kw = int(np.prod(ks, dtype=np.int64))
  num_keys = int(np.prod(keys.shape[:len(keys.shape) - len(ks)], dtype=np.int64))
  mapping = alpha.mapping if alpha.category != "constants" and alpha.size else None
  out = ctx.new_tensor(alpha.shape, alpha.dtype, mapping, name="random_gamma")
  if out.size == 0:
    return [out]
  target = ctx.target
  costs = [_fanout_cost(ctx, keys, _key_members(num_keys, kw), out,
                        out.size // max(num_keys, 1))]
  if mapping is None:
    costs.append(movement_cost(target, alpha.mapping.element_tile,
                               out.mapping.element_tile, alpha.itemsize))
  elements = out.mapping.elements_per_tile(target.num_tiles)

  def step(key_data, alpha_storage):
    value = random_core.random_gamma_p.bind(
        _wrap(logical(key_data, keys), impl), logical(alpha_storage, alpha),
        log_space=log_space)
    return (storage(value, out),)

  ctx.emit(P.Superstep(
      name="random_gamma", op=ctx.op, reads=(keys, alpha), writes=(out,), fn=step,
      compute_cycles=estimators.worker_split_cycles(
          target, elements, _GAMMA_CYCLES_PER_VECTOR, out.itemsize),
      exchange=add_costs(*costs), vertices=worker_vertices(ctx, elements),
      codelets=(vocab.vertex(vocab.RANDOM, "gamma"),), flops=out.size * 20))
  return [out]


# -- hardware mode: the tiles' generators (lowering/tile_generators.py) -------


def _words_as(words, dtype: np.dtype):
  """``[rows, n]`` uint32 words as ``[rows, n * 4 // itemsize]`` of ``dtype``."""
  rows = words.shape[0]
  if dtype.itemsize == 4:
    return words.astype(dtype)
  if dtype.itemsize > 4:
    pairs = words.reshape(rows, -1, dtype.itemsize // 4)
    return lax.bitcast_convert_type(pairs, dtype)
  return lax.bitcast_convert_type(words, dtype).reshape(rows, -1)


def _hardware_bits(ctx: RuleContext, bit_width: int) -> P.Tensor:
  """``random_bits`` from the tiles' generators: each tile fills its own bits."""
  out_aval = ctx.out_avals[0]
  dtype = np.dtype(out_aval.dtype)
  out = ctx.new_tensor(tuple(out_aval.shape), dtype, name="random_bits/hardware")
  if out.size == 0:
    return out
  target = ctx.target
  state = prng_state(ctx, ctx.options.rounding_seed)
  rows, row_size = out.mapping.storage_shape
  row_words = -(-row_size * bit_width // 32)
  row_tiles = np.asarray(out.mapping.tiles, np.int64)
  n = target.num_tiles

  def fn(st_s):
    st = st_s.reshape(n, WORKERS, 4)
    words, new = draw_tile_words(mix_replica(st[row_tiles]), row_words)
    st = st.at[row_tiles].set(mix_replica(new))
    return _words_as(words, dtype)[:, :row_size], st.reshape(st_s.shape)

  elements = out.mapping.elements_per_tile(n)
  words = -(-elements * bit_width // 32)
  ctx.emit(P.Superstep(
      name="random_bits/hardware", op=ctx.op, reads=(state,), writes=(out, state), fn=fn,
      compute_cycles=poprand.uniform_int_bits_cycles(words, target.worker_contexts),
      vertices=worker_vertices(ctx, words), codelets=(HARDWARE_BITS_VERTEX,),
      # Elementwise work on the bits' layout, so fusion can join the bits to
      # the chain that turns them into samples (poprand's one vertex); it
      # never moves to another layout (no cost op).
      elementwise=P.ElementwiseWork(out.mapping, (None,), "", dtype.itemsize, dtype)))
  return out


def _register():
  rules = [
      (prng.random_seed_p, _random_seed),
      (prng.random_split_p, _random_split),
      (prng.random_fold_in_p, _random_fold_in),
      (prng.random_bits_p, _random_bits),
      (prng.random_wrap_p, _random_wrap),
      (prng.random_unwrap_p, _random_unwrap),
      (random_core.random_clone_p, _random_clone),
      (random_core.random_gamma_p, _random_gamma),
      (threefry2x32.threefry2x32_p, _threefry2x32),
      (prng.iota_2x32_shape_p, _iota_2x32_shape),
      (lax.rng_bit_generator_p, _rng_bit_generator),
  ]
  for prim, rule in rules:
    register_lowering(prim, rule)


_register()
