"""Floating-point behaviour: stochastic rounding and overflow, as the chip does it.

TF-IPU's ``floating_point_behaviour`` (``esr``: ``OFF``/``ON``/
``REPLICA_IDENTICAL_ONLY``, ``nanoo``) and PopTorch's
``enableStochasticRounding`` change how the IPU rounds every float32 result it
writes in a narrower type. ipu-jax models that by a rewrite of the traced
program (:func:`apply_floating_point_behaviour`, run by ``ipu_jax.jit`` before
lowering when the config asks for it): every equation that *rounds* to
float16 or to an FP8 format --

* a cast from float32 (``convert_element_type``),
* a matmul or convolution with a float16/FP8 result (now accumulated to a
  float32 result, as the AMP's partials are, then rounded once),
* a float16 elementwise result of ``add``, ``sub``, ``mul``, ``div`` and the
  transcendental functions (now computed in float32 from the exactly widened
  operands, then rounded once; ``w - lr * g`` of an fp16 weight is such a
  result, so weight updates round stochastically) --

becomes its float32 computation followed by :data:`hw_round_p`, the chip's
rounding. With stochastic rounding on, its random bits come from the tiles'
hardware generators: one xoroshiro128aox stream per (tile, worker) seeded from
``floating_point_behaviour.seed`` (``kernels/xoroshiro.py``), whose state
persists through the program, so every rounding (in a loop too) draws fresh
bits, and two runs with one seed give the same bits. The state is the
executable's device state, as on the chip, where the seed is set once and the
generators advance: each call of a program compiled by ``ipu_jax.jit``
continues the streams where the previous call left them (two training steps
draw different bits), and ``Lowered.set_seed`` / ``IPUFunction.set_seed``
restart them (a new compile starts from ``floating_point_behaviour.seed``,
so a whole script is reproducible). With ``ON`` each replica
perturbs its generators by its replica index; with
``REPLICA_IDENTICAL_ONLY`` only values that do not vary over the replica axis
(shard_map's typing) round stochastically, with equal bits on all replicas,
so replicated weights stay bit-identical; the rest round to nearest.
``nanoo=False`` saturates float16 results at +-65504 instead of inf.

With ``esr="OFF"`` and ``nanoo=True`` (the defaults) nothing is rewritten and
results stay bit-exact with ``jax.jit``.

Tile plan of ``hw_round``: elementwise on the operand's tiles (the result has
the operand's mapping); tile ``t``'s worker ``w`` draws 64 bits per round from
its stream and rounds two elements with them (element ``j`` of the tile's row
uses round ``j // 12``, worker ``(j // 2) % 6``, half ``j % 2``); costed as the
cast plus one random draw per element. The generator state is a 96-byte
per-tile tensor of the program (hardware registers on the chip).

Known differences from the chip: a float16 sum computed in float32 is exact
only when the operands' exponents differ by less than 14, so the stochastic
rounding of far-apart sums sees the float32-rounded value; ``Lowered.apply``
(the traceable form the training layer runs under replication) is pure, so it
reads the generators' state without advancing it between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import ad

from ipu_jax.kernels import xoroshiro
from ipu_jax.lowering.jax_compat import core as jcore_src
from ipu_jax.kernels.number_formats import is_fp8
from ipu_jax.ops.primitive import shaped_like, define_primitive
from ipu_jax.ops.collectives import REPLICA_AXIS
from ipu_jax.ops.stochastic_round import round_with_bits
from ipu_jax.kernels import estimators
from ipu_jax.kernels import vocabulary as vocab
from ipu_jax.lowering import program as P
from ipu_jax.lowering.builders import worker_vertices
from ipu_jax.lowering.context import RuleContext
from ipu_jax.lowering.registry import register_lowering
# The tiles' generators and their per-tile state are shared with the hardware
# mode of random_bits (the same generators on the chip), so they live below.
from ipu_jax.lowering.tile_generators import WORKERS, draw_tile_words, mix_replica, prng_state

__all__ = ["ESR_MODES", "hw_round_p", "hw_round", "apply_floating_point_behaviour",
           "round_tile_rows", "needs_rewrite"]

ESR_MODES = ("OFF", "ON", "REPLICA_IDENTICAL_ONLY")

hw_round_p = jcore.Primitive("hw_round")


def _rounds_to(dtype) -> bool:
  dtype = np.dtype(dtype)
  return dtype == np.dtype(jnp.float16) or is_fp8(dtype)


def _saturate(x, dtype):
  big = float(jnp.finfo(dtype).max) if dtype == np.dtype(jnp.float16) else None
  if big is None:
    return x
  return jnp.where(jnp.isnan(x), x, jnp.clip(x, -big, big))


def round_tile_rows(x_rows, states, dtype, *, saturate: bool, replica_identical: bool):
  """Round ``[rows, E]`` float32 stochastically with per-row generator streams.

  Args:
    x_rows: ``[rows, E]`` float32, one tile's elements per row.
    states: ``[rows, WORKERS, 4]`` uint32 xoroshiro128aox states of those tiles.
    dtype: float16 or an FP8 dtype.
    saturate: clip float16 overflow to +-65504 first (``nanoo=False``).
    replica_identical: draw equal bits on every replica.

  Returns:
    ``(rounded [rows, E], new states)``.
  """
  e = x_rows.shape[1]
  if not replica_identical:
    states = mix_replica(states)
  bits, states = draw_tile_words(states, e)
  x = _saturate(x_rows, dtype) if saturate else x_rows
  return round_with_bits(x, bits, dtype), states


def _round_nearest(x, dtype, saturate):
  x = _saturate(x, dtype) if saturate else x
  return x.astype(dtype)


def _hw_round_impl(x, *, dtype, stochastic, saturate, replica_identical, seed, site):
  """Reference semantics outside the tile program: the flat array as one tile."""
  if not stochastic:
    return _round_nearest(x, dtype, saturate)
  flat = x.reshape(1, -1).astype(jnp.float32)
  states = jnp.asarray(xoroshiro.seed_states(seed * 1_000_003 + site,
                                             np.arange(WORKERS))[None])
  out, _ = round_tile_rows(flat, states, dtype, saturate=saturate,
                           replica_identical=replica_identical)
  return out.reshape(x.shape)


def _hw_round_abstract_eval(x, *, dtype, **_):
  return shaped_like(x.shape, dtype, x)


def _hw_round_jvp(primals, tangents, **params):
  (x,), (tx,) = primals, tangents
  out = hw_round_p.bind(x, **params)
  if type(tx) is ad.Zero:
    return out, ad.Zero.from_primal_value(out)
  return out, tx.astype(params["dtype"])  # straight-through


def _hw_round_batch(args, dims, **params):
  return hw_round_p.bind(args[0], **params), dims[0]


define_primitive(hw_round_p, _hw_round_impl, _hw_round_abstract_eval, jvp=_hw_round_jvp,
                 batch=_hw_round_batch)


def hw_round(x, dtype, *, stochastic=True, saturate=False, replica_identical=False,
             seed=0, site=0):
  """Round float32 ``x`` to ``dtype`` the way the chip does under its FP behaviour.

  Args:
    x: float32 array.
    dtype: ``jnp.float16`` or an FP8 dtype.
    stochastic: stochastic rounding (else round to nearest even).
    saturate: float16 overflow saturates at +-65504 (``nanoo=False``).
    replica_identical: equal random bits on every replica.
    seed: generator seed (``floating_point_behaviour.seed``).
    site: distinguishes roundings outside the tile program (where no
      generator state persists); the tile program's state makes it unneeded.
  """
  dtype = np.dtype(dtype)
  if not _rounds_to(dtype):
    raise ValueError(f"hw_round: dtype must be float16 or an FP8 dtype, got {dtype}.")
  x = jnp.asarray(x, jnp.float32)
  return hw_round_p.bind(x, dtype=dtype, stochastic=bool(stochastic), saturate=bool(saturate),
                         replica_identical=bool(replica_identical), seed=int(seed),
                         site=int(site))


# ---------------------------------------------------------------------------
# The rewrite
# ---------------------------------------------------------------------------

_WIDENED = {"add", "sub", "mul", "div", "exp", "exp2", "log", "log1p", "expm1", "tanh",
            "logistic", "sqrt", "rsqrt", "pow", "integer_pow", "sin", "cos", "tan",
            "atan2", "erf"}
_ACCUMULATED = {"dot_general", "conv_general_dilated"}
_CAST = "convert_element_type"


def needs_rewrite(options) -> bool:
  """Whether ``options`` (``LoweringOptions``) change any rounding."""
  return (getattr(options, "stochastic_rounding", "OFF") != "OFF"
          or not getattr(options, "nanoo", True))


@dataclasses.dataclass
class _Rewriter:
  esr: str
  seed: int
  nanoo: bool
  sites: int = 0

  def closed(self, closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    return jcore.ClosedJaxpr(self.jaxpr(closed.jaxpr), closed.consts)

  def param(self, value: Any) -> Any:
    if isinstance(value, jcore.ClosedJaxpr):
      return self.closed(value)
    if isinstance(value, jcore.Jaxpr):
      return self.jaxpr(value)
    if isinstance(value, tuple) and value and all(
        isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)) for v in value):
      return tuple(self.param(v) for v in value)
    return value

  def _site(self, eqn) -> bool:
    name = eqn.primitive.name
    if len(eqn.outvars) != 1 or not (name in _WIDENED or name in _ACCUMULATED or name == _CAST):
      return False
    out = eqn.outvars[0].aval
    if not hasattr(out, "dtype") or not _rounds_to(out.dtype):
      return False
    if name == _CAST:
      src = eqn.invars[0].aval.dtype
      # Only a narrowing from a wider float rounds.
      if not (jnp.issubdtype(src, jnp.floating) and np.dtype(src).itemsize >= 4):
        return False
    return True

  def jaxpr(self, jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    eqns = []
    for eqn in jaxpr.eqns:
      params = {k: self.param(v) for k, v in eqn.params.items()}
      eqn = eqn.replace(params=params)
      if not self._site(eqn):
        eqns.append(eqn)
        continue
      eqns.extend(self._rounded(eqn))
    return jaxpr.replace(eqns=eqns)

  def _rounded(self, eqn):
    """``eqn`` computed in float32, then rounded by ``hw_round``."""
    out = eqn.outvars[0]
    aval = out.aval
    name = eqn.primitive.name
    new = []
    if name == _CAST:
      wide_in = eqn.invars[0]
      if np.dtype(wide_in.aval.dtype) != np.dtype(np.float32):
        wide_in = self._convert(eqn, wide_in, new)
      wide = wide_in
    else:
      ins = []
      for v in eqn.invars:
        dt = getattr(v.aval, "dtype", None)
        if name in _WIDENED and dt is not None and jnp.issubdtype(dt, jnp.floating) and \
            np.dtype(dt).itemsize < 4:
          v = self._convert(eqn, v, new)
        ins.append(v)
      wide = jcore_src.Var(aval.update(dtype=np.dtype(np.float32), weak_type=False))
      params = dict(eqn.params)
      if name in _ACCUMULATED:
        params["preferred_element_type"] = np.dtype(np.float32)
      new.append(eqn.replace(invars=ins, outvars=[wide], params=params))
    stochastic = self.esr != "OFF"
    replica_identical = self.esr == "REPLICA_IDENTICAL_ONLY"
    if replica_identical and REPLICA_AXIS in _varying(aval):
      stochastic = False  # varies over replicas: round to nearest
    saturate = (not self.nanoo) and np.dtype(aval.dtype) == np.dtype(jnp.float16)
    self.sites += 1
    params = dict(dtype=np.dtype(aval.dtype), stochastic=stochastic, saturate=saturate,
                  replica_identical=replica_identical, seed=self.seed, site=self.sites)
    new.append(jcore.new_jaxpr_eqn([wide], [out], hw_round_p, params, jcore.no_effects,
                                   eqn.source_info, eqn.ctx))
    return new

  @staticmethod
  def _convert(eqn, v, new):
    wide = jcore_src.Var(v.aval.update(dtype=np.dtype(np.float32), weak_type=False))
    new.append(jcore.new_jaxpr_eqn(
        [v], [wide], lax.convert_element_type_p,
        dict(new_dtype=np.dtype(np.float32), weak_type=False, sharding=None),
        jcore.no_effects, eqn.source_info, eqn.ctx))
    return wide


def _varying(aval) -> frozenset:
  mat = getattr(aval, "mat", None)
  vma = getattr(aval, "vma", None)
  return frozenset(getattr(mat, "varying", None) or vma or ())


def apply_floating_point_behaviour(closed: jcore.ClosedJaxpr, options) -> jcore.ClosedJaxpr:
  """``closed`` with every rounding to float16/FP8 made the chip's (see module doc).

  Args:
    closed: the traced program.
    options: ``LoweringOptions`` (``stochastic_rounding``, ``rounding_seed``,
      ``nanoo``).

  Returns:
    ``closed`` itself when the options change nothing, else the rewritten
    program (same inputs and outputs).
  """
  if not needs_rewrite(options):
    return closed
  rewriter = _Rewriter(options.stochastic_rounding, options.rounding_seed, options.nanoo)
  return rewriter.closed(closed)


# ---------------------------------------------------------------------------
# The tile rule
# ---------------------------------------------------------------------------
# Tile rule of ``hw_round``: the chip's rounding under its FP behaviour.
#
# Tile plan: elementwise on the operand's tiles, the result keeps the operand's
# mapping. With stochastic rounding each tile rounds its elements with bits from
# its own six xoroshiro128aox streams (one per worker), whose state is a
# ``[tiles, 6, 4]`` uint32 tensor of the program: created once per program from
# the configured seed, read and advanced by every stochastic rounding, so each
# rounding, in loops too, draws new bits. ``ipu_jax.jit`` keeps its final value
# as the executable's device state: the next run starts where this one ended
# (``Lowered.set_seed`` resets it). Costed as a cast plus one random draw
# per element (the hardware produces 64 random bits per cycle per tile).
# See :mod:`ipu_jax.rounding`.


# As ``stochastic_round``: the cast plus a 32-bit random draw per element.
_SR_CYCLES_PER_VECTOR = 3


@register_lowering(hw_round_p)
def _hw_round_rule(ctx: RuleContext, x, *, dtype, stochastic, saturate, replica_identical, seed,
                   site):
  del site  # the persistent per-tile state gives every rounding new bits
  target = ctx.target
  out = ctx.new_tensor(x.shape, dtype, x.mapping, name="hw_round")
  if x.size == 0:
    return [out]
  elements = x.mapping.elements_per_tile(target.num_tiles)
  if not stochastic:
    ctx.emit(P.Superstep(
        name="hw_round/nearest", op=ctx.op, reads=(x,), writes=(out,),
        fn=lambda x_s: (_round_nearest(x_s, dtype, saturate),),
        compute_cycles=estimators.elementwise_cycles(target, elements, "convert_element_type",
                                                     x.itemsize, dtype=dtype, in_dtype=x.dtype),
        vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST,),
        flops=int(x.size)))
    return [out]
  state = prng_state(ctx, seed)
  row_tiles = np.asarray(x.mapping.tiles, np.int64)
  n = target.num_tiles

  def fn(x_s, st_s):
    st = st_s.reshape(n, WORKERS, 4)
    rounded, new = round_tile_rows(x_s, st[row_tiles], dtype, saturate=saturate,
                                   replica_identical=replica_identical)
    st = st.at[row_tiles].set(new)
    return rounded, st.reshape(st_s.shape)

  ctx.emit(P.Superstep(
      name="hw_round/stochastic", op=ctx.op, reads=(x, state), writes=(out, state), fn=fn,
      compute_cycles=estimators.worker_split_cycles(target, elements, _SR_CYCLES_PER_VECTOR,
                                                    x.itemsize),
      vertices=worker_vertices(ctx, elements), codelets=(vocab.CAST_STOCHASTIC_ROUND,),
      flops=int(x.size)))
  return [out]
