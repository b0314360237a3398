r"""Decoder-only language models in Flax NNX, one tensor-parallel shard each.

Three families, as Graphcore's PopXL examples build them
(``experiments.llm_presets`` cites the files):

* ``"gptj"`` -- GPT-J: rotary position embedding on the first ``rotary_dim``
  features of each head, one layer norm feeding attention AND the MLP in
  parallel (``x + attn(ln(x)) + mlp(ln(x))``), GELU MLP, biased LM head.
* ``"gpt3"`` -- GPT-3 / GPT-2: learned positions added to the token
  embedding, sequential pre-norm blocks (``x + attn(ln1(x))``, then
  ``+ mlp(ln2(x))``), GELU MLP.
* ``"llama2"`` -- Llama-2: RMSNorm, rotary over the whole head, SwiGLU MLP
  (``down(silu(gate(x)) * up(x))``), no biases; :meth:`DecoderBlock.decode`
  runs one token against a KV cache (inference, one token a step).

Every module holds ONE shard of a tensor-parallel group of ``tp`` IPUs
(Megatron's split, Shoeybi et al. 2019, through ``ipu_jax.parallel``'s
functional TP ops): the query / key / value projections and the first MLP
matmul(s) are column-split (each IPU holds ``heads / tp`` heads and
``ffn / tp`` features), the attention output and the last MLP matmul are
row-split and all-reduced over ``"tp"``, the token embedding is split over
the vocabulary and the LM head's logits and cross entropy too. So one class
serves any ``tp`` (``tp=1``: the unsplit model), and the functions must run
with the ``"tp"`` axis bound (``ipu_jax.parallel.spmd``, or ``jax.vmap``
with ``axis_name="tp"``).

:func:`phase_functions` cuts a model into its phases -- the embedding, one
per decoder block, the head (which returns the loss) -- as pure functions of
each phase's weights, the shape ``ipu_jax.phased.Phase`` takes. Identical
blocks share one function, so a phased estimate lowers one block program.
:func:`shard_state` / :func:`unshard_state` turn an unsplit model's weights
into the ``[tp, ...]`` stack of shards and back (the split of each weight is
named by its path: :func:`split_kind`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["LLMConfig", "Embedding", "DecoderBlock", "Head", "DecoderLM", "phase_functions",
           "split_kind", "shard_state", "unshard_state", "parameter_count",
           "FAMILIES"]

FAMILIES = ("gptj", "gpt3", "llama2")


def _parallel():
  """``ipu_jax.parallel``, imported when a model runs (engineer A's package)."""
  from ipu_jax import parallel
  return parallel


@dataclasses.dataclass(frozen=True)
class LLMConfig:
  """A decoder-only model's sizes, family and tensor-parallel degree.

  Attributes:
    family: ``"gptj"``, ``"gpt3"`` or ``"llama2"``.
    vocab_size, hidden, layers, heads, ffn: the model's sizes.
    max_positions: rows of GPT-3's learned position table (the longest
      sequence); unused by the rotary families.
    rotary_dim: features of each head that rotary embedding turns (GPT-J 64,
      Llama-2 the whole head); 0 for GPT-3.
    tp: IPUs of a tensor-parallel group; must divide heads, hidden, ffn and
      the vocabulary.
    dtype: weights' and activations' dtype.
    norm_eps: the layer / RMS norm's epsilon.
    sequence_parallel: Megatron's sequence parallelism (Korthikanti et al.
      2022, ``ipu_jax.parallel.sequence``): between the split matmuls (norms,
      residual adds) each IPU holds ``S / tp`` positions, so a block's input
      and output -- what a phase stores and loads -- are this IPU's block of
      the sequence; the reduce-scatter / all-gather pairs replace the
      all-reduces. Training only (one decoded token has no sequence to split).
  """
  family: str = "gpt3"
  vocab_size: int = 256
  hidden: int = 128
  layers: int = 4
  heads: int = 4
  ffn: int = 512
  max_positions: int = 16
  rotary_dim: int = 0
  tp: int = 1
  dtype: Any = jnp.float32
  norm_eps: float = 1e-5
  sequence_parallel: bool = False

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(f"LLMConfig.family must be one of {list(FAMILIES)}; "
                       f"got {self.family!r}.")
    for name in ("vocab_size", "hidden", "layers", "heads", "ffn", "max_positions", "tp"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"LLMConfig.{name} must be an int >= 1; got {value!r}.")
    if self.hidden % self.heads:
      raise ValueError(f"LLMConfig.hidden={self.hidden} must be a multiple of "
                       f"LLMConfig.heads={self.heads}.")
    if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
      raise ValueError(f"LLMConfig.rotary_dim={self.rotary_dim} must be even and at most "
                       f"the head size {self.head_dim}.")
    for name, size in (("ffn", self.ffn),):
      if size % self.tp:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ValueError(f"tensor_parallel={self.tp} does not divide {name}={size}; "
                         f"valid values: {divisors}.")

  @property
  def head_dim(self) -> int:
    return self.hidden // self.heads


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02) -> nnx.Param:
  # GPT-2/3's and GPT-J's initialiser: normal of std 0.02.
  return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _zeros(shape, dtype) -> nnx.Param:
  return nnx.Param(jnp.zeros(shape, dtype))


def _ones(shape, dtype) -> nnx.Param:
  return nnx.Param(jnp.ones(shape, dtype))


class Norm(nnx.Module):
  """Layer norm (GPT-J, GPT-3) or RMSNorm (Llama-2), replicated on every shard."""

  def __init__(self, cfg: LLMConfig):
    self.rms = cfg.family == "llama2"
    self.sequence_parallel = cfg.sequence_parallel
    self.eps = cfg.norm_eps
    self.scale = _ones((cfg.hidden,), cfg.dtype)
    if not self.rms:
      self.bias = _zeros((cfg.hidden,), cfg.dtype)

  def _weight(self, w):
    # On a sequence block the weight's gradient is partial: summed over "tp".
    return _parallel().copy_to_group(w) if self.sequence_parallel else w

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    scale = self._weight(self.scale[...])
    if self.rms:
      y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
      return (y.astype(x.dtype) * scale)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
    return y * scale + self._weight(self.bias[...])


def _linear(din: int, dout: int, split: str, cfg: LLMConfig, rngs: nnx.Rngs,
            bias: bool = True) -> nnx.Module:
  """One shard of a tensor-parallel matmul (``ipu_jax.parallel``'s layers).

  ``"column"``: ``kernel[:, shard]`` and its bias's shard, the output is this
  IPU's slice of the features; ``"row"``: ``kernel[shard, :]``, the partial
  products all-reduced over ``"tp"`` and the (replicated) bias added once.
  """
  parallel = _parallel()
  layer = parallel.ColumnParallelLinear if split == "column" else parallel.RowParallelLinear
  return layer(din, dout, cfg.tp, use_bias=bias, dtype=cfg.dtype,
               sequence_parallel=cfg.sequence_parallel, rngs=rngs)


def _rotary(x, positions, rotary_dim: int):
  """Rotary position embedding on the first ``rotary_dim`` features of each head.

  ``x``: ``[B, S, heads, head_dim]``; ``positions``: ``[S]`` (Su et al.
  2021, the half-rotation form Llama uses; GPT-J pairs neighbouring features,
  a fixed permutation of the same rotation).
  """
  if rotary_dim == 0:
    return x
  half = rotary_dim // 2
  freqs = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
  angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [S, half]
  cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
  sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
  rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
  x1, x2 = rot[..., :half], rot[..., half:]
  turned = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return jnp.concatenate([turned, rest], axis=-1)


class Attention(nnx.Module):
  """Causal self-attention over this shard's ``heads / tp`` heads."""

  def __init__(self, cfg: LLMConfig, rngs: nnx.Rngs):
    bias = cfg.family == "gpt3"
    self.q = _linear(cfg.hidden, cfg.hidden, "column", cfg, rngs, bias=bias)
    # No key bias: it adds the same score to every key of a query, which the
    # softmax cancels (its gradient is zero), as Llama and GPT-J have none.
    self.k = _linear(cfg.hidden, cfg.hidden, "column", cfg, rngs, bias=False)
    self.v = _linear(cfg.hidden, cfg.hidden, "column", cfg, rngs, bias=bias)
    self.out = _linear(cfg.hidden, cfg.hidden, "row", cfg, rngs, bias=bias)
    self.heads = cfg.heads // cfg.tp
    self.head_dim = cfg.head_dim
    self.rotary_dim = cfg.rotary_dim
    self.sequence_parallel = cfg.sequence_parallel

  def _project(self, h, positions, gathered=False):
    b, s, _ = h.shape
    split = lambda t: t.reshape(b, s, self.heads, self.head_dim)
    q = _rotary(split(self.q(h, gathered)), positions, self.rotary_dim)
    k = _rotary(split(self.k(h, gathered)), positions, self.rotary_dim)
    return q, k, split(self.v(h, gathered))

  def _attend(self, q, k, v, mask):
    # q [B, S, h, d], k/v [B, T, h, d]; mask [S, T] (True = attend). A Python
    # float keeps half-precision scores in their dtype.
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / float(np.sqrt(self.head_dim))
    scores = jnp.where(mask[None, None], scores, jnp.asarray(-1e4, scores.dtype))
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhst,bthd->bshd", probs, v)
    b, s = out.shape[:2]
    return self.out(out.reshape(b, s, self.heads * self.head_dim))

  def __call__(self, h, gathered=False):
    """``h`` [B, S, H] (sequence parallel: this IPU's block, or with
    ``gathered`` the whole sequence from ``gather_sequence``)."""
    h, gathered = _gather_once(h, gathered, self.sequence_parallel)
    s = h.shape[1]
    positions = jnp.arange(s)
    q, k, v = self._project(h, positions, gathered)
    return self._attend(q, k, v, jnp.tril(jnp.ones((s, s), bool)))

  def decode(self, h, cache_k, cache_v, position):
    """One new token ``h`` [B, 1, H] at ``position`` against the KV cache.

    ``cache_k`` / ``cache_v``: ``[B, T, heads / tp, head_dim]``, this
    shard's heads; the token's key and value are written at ``position`` and
    it attends to positions ``<= position``. Returns ``(out, cache_k,
    cache_v)``.
    """
    if self.sequence_parallel:
      raise ValueError("LLMConfig.sequence_parallel=True is for training: one decoded token "
                       "has no sequence to split (use sequence_parallel=False).")
    q, k, v = self._project(h, jnp.reshape(position, (1,)))
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), position, 1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), position, 1)
    mask = (jnp.arange(cache_k.shape[1]) <= position)[None, :]
    return self._attend(q, cache_k, cache_v, mask), cache_k, cache_v


def _gather_once(h, gathered: bool, sequence_parallel: bool):
  """``(h, gathered)``: a sequence block all-gathered ONCE for the column-
  parallel linears that share it (their ``f`` is the gather's backward)."""
  if sequence_parallel and not gathered:
    return _parallel().gather_sequence(h), True
  return h, gathered


class MLP(nnx.Module):
  """GELU MLP (GPT-J, GPT-3) or SwiGLU (Llama-2): column then row split."""

  def __init__(self, cfg: LLMConfig, rngs: nnx.Rngs):
    self.swiglu = cfg.family == "llama2"
    bias = not self.swiglu
    self.up = _linear(cfg.hidden, cfg.ffn, "column", cfg, rngs, bias=bias)
    if self.swiglu:
      self.gate = _linear(cfg.hidden, cfg.ffn, "column", cfg, rngs, bias=False)
    self.down = _linear(cfg.ffn, cfg.hidden, "row", cfg, rngs, bias=bias)
    self.sequence_parallel = cfg.sequence_parallel

  def __call__(self, h, gathered=False):
    h, gathered = _gather_once(h, gathered, self.sequence_parallel)
    if self.swiglu:
      return self.down(jax.nn.silu(self.gate(h, gathered)) * self.up(h, gathered))
    return self.down(jax.nn.gelu(self.up(h, gathered), approximate=True))


class DecoderBlock(nnx.Module):
  """One decoder block: parallel (GPT-J) or sequential (GPT-3, Llama-2)."""

  def __init__(self, cfg: LLMConfig, rngs: nnx.Rngs):
    self.parallel = cfg.family == "gptj"
    self.norm1 = Norm(cfg)
    self.attention = Attention(cfg, rngs)
    if not self.parallel:
      self.norm2 = Norm(cfg)
    self.mlp = MLP(cfg, rngs)
    self.sequence_parallel = cfg.sequence_parallel

  def __call__(self, x):
    if self.parallel:
      # GPT-J: attention and MLP share the normed input (one gather).
      h, gathered = _gather_once(self.norm1(x), False, self.sequence_parallel)
      return x + self.attention(h, gathered) + self.mlp(h, gathered)
    x = x + self.attention(self.norm1(x))
    return x + self.mlp(self.norm2(x))

  def decode(self, x, cache_k, cache_v, position):
    """One token through the block with a KV cache: ``(x, cache_k, cache_v)``."""
    h = self.norm1(x)
    a, cache_k, cache_v = self.attention.decode(h, cache_k, cache_v, position)
    if self.parallel:
      return x + a + self.mlp(h), cache_k, cache_v
    x = x + a
    return x + self.mlp(self.norm2(x)), cache_k, cache_v


class Embedding(nnx.Module):
  """Vocabulary-sharded token embedding (+ GPT-3's replicated learned positions)."""

  def __init__(self, cfg: LLMConfig, rngs: nnx.Rngs):
    self.word = _parallel().VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, cfg.tp,
                                                   dtype=cfg.dtype,
                                                   sequence_parallel=cfg.sequence_parallel,
                                                   rngs=rngs)
    self.sequence_parallel = cfg.sequence_parallel
    self.learned_positions = cfg.family == "gpt3"
    if self.learned_positions:
      self.position = _init(rngs, (cfg.max_positions, cfg.hidden), cfg.dtype, std=0.01)

  def __call__(self, ids, position=None):
    """``ids`` [B, S] -> ``[B, S, H]``; ``position``: the first token's position (decode).

    Sequence parallel: ``[B, S / tp, H]``, this IPU's block of positions.
    """
    h = self.word(ids)
    if self.learned_positions:
      s = h.shape[1]
      start = 0 if position is None else position
      table = self.position[...]
      if self.sequence_parallel:
        parallel = _parallel()
        start = start + parallel.sequence_shard_start(ids.shape[1])
        table = parallel.copy_to_group(table)  # each IPU's rows' gradient, summed
      h = h + jax.lax.dynamic_slice_in_dim(table, start, s, 0)[None]
    return h


class Head(nnx.Module):
  """Final norm, vocabulary-sharded LM head and its cross entropy across shards."""

  def __init__(self, cfg: LLMConfig, rngs: nnx.Rngs):
    self.norm = Norm(cfg)
    self.lm_head = _linear(cfg.hidden, cfg.vocab_size, "column", cfg, rngs,
                           bias=cfg.family == "gptj")

  def logits(self, x):
    """This shard's slice of the vocabulary's logits ``[B, S, V / tp]``."""
    return self.lm_head(self.norm(x))

  def __call__(self, x, labels):
    """Mean next-token cross entropy (float32) over ``labels`` [B, S]."""
    logits = self.logits(x).astype(jnp.float32)
    return _parallel().vocab_cross_entropy(logits, labels)


class DecoderLM(nnx.Module):
  """Embedding, ``layers`` decoder blocks and the head; one TP shard of it."""

  def __init__(self, cfg: LLMConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embedding = Embedding(cfg, rngs)
    self.blocks = nnx.List([DecoderBlock(cfg, rngs) for _ in range(cfg.layers)])
    self.head = Head(cfg, rngs)

  def __call__(self, ids, labels):
    """The micro-batch's loss: ``ids``, ``labels`` [B, S] (labels: next tokens)."""
    x = self.embedding(ids)
    for block in self.blocks:
      x = block(x)
    return self.head(x, labels)


# -- Phases -------------------------------------------------------------------

def _pure(graphdef, method: str | None = None) -> Callable:
  """``fn(params, *args)`` calling the module rebuilt from ``params``."""

  def apply(params, *args):
    # Runs with "tp" bound (ipu_jax.phased binds it, as a group of one when
    # tp = 1; ipu_jax.parallel.spmd binds it for a TP group).
    module = nnx.merge(graphdef, params)
    return (module if method is None else getattr(module, method))(*args)

  return apply


def phase_functions(model: DecoderLM, inference: bool = False) -> list:
  """``[(name, apply, params)]``: the embedding, each block and the head.

  ``apply(params, x, *extras)`` is pure; the blocks share ONE function object
  (one graphdef: identical blocks), so a phased runner lowers one block
  program for all of them. Training: the head's apply takes the labels and
  returns the loss. Inference (``inference=True``): a block's apply is
  :meth:`DecoderBlock.decode` (``x, cache_k, cache_v, position``) and the
  head's returns this shard's logits.
  """
  phases = []
  graphdef, params = nnx.split(model.embedding)
  phases.append(("embedding", _pure(graphdef), params))
  block_fn = None
  for i, block in enumerate(model.blocks):
    graphdef, params = nnx.split(block)
    if block_fn is None:
      block_fn = _pure(graphdef, "decode" if inference else None)
    phases.append((f"block{i}", block_fn, params))
  graphdef, params = nnx.split(model.head)
  phases.append(("head", _pure(graphdef, "logits" if inference else None), params))
  return phases


# -- Shards -------------------------------------------------------------------

def split_kind(path: tuple) -> str:
  """How the weight at ``path`` (its names, outermost first) splits over TP.

  ``"columns"`` (column-split kernels and their biases), ``"rows"`` (row-split
  kernels), ``"vocab"`` (the token embedding's rows) or ``"replicated"``
  (norms, row-split biases, GPT-3's positions).
  """
  names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
  leaf = names[-1] if names[-1] != "value" else names[-2]
  owner = [n for n in names if n in ("q", "k", "v", "out", "up", "gate", "down", "lm_head",
                                      "word")]
  if not owner:
    return "replicated"
  if owner[-1] == "word":
    return "vocab"
  row = owner[-1] in ("out", "down")
  if leaf == "kernel":
    return "rows" if row else "columns"
  return "replicated" if row else "columns"


def _shard_leaf(kind: str, leaf, tp: int):
  leaf = np.asarray(leaf)
  if kind == "replicated":
    return np.broadcast_to(leaf, (tp,) + leaf.shape).copy()
  axis = {"columns": leaf.ndim - 1, "rows": 0, "vocab": 0}[kind]
  return np.stack(np.split(leaf, tp, axis=axis))


def _unshard_leaf(kind: str, stacked):
  stacked = np.asarray(stacked)
  if kind == "replicated":
    return stacked[0]
  axis = {"columns": stacked.ndim - 2, "rows": 0, "vocab": 0}[kind]
  return np.concatenate(list(stacked), axis=axis)


def shard_state(state, tp: int):
  """The unsplit weights ``state`` (a pytree) as ``[tp, ...]`` stacks of shards."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _shard_leaf(split_kind(path), leaf, tp), state)


def unshard_state(stacked):
  """The ``[tp, ...]`` stacks of shards back as unsplit weights."""
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _unshard_leaf(split_kind(path), leaf), stacked)


def parameter_count(cfg: LLMConfig) -> dict:
  """Weights of the unsplit model by part: ``embedding``, ``block``, ``head``, ``total``."""
  h, f, v = cfg.hidden, cfg.ffn, cfg.vocab_size
  norm = h if cfg.family == "llama2" else 2 * h
  if cfg.family == "llama2":
    block = 4 * h * h + 3 * h * f + 2 * norm
  elif cfg.family == "gptj":
    block = 4 * h * h + 2 * h * f + f + h + norm
  else:
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 2 * norm
  embedding = v * h + (cfg.max_positions * h if cfg.family == "gpt3" else 0)
  head = norm + h * v + (v if cfg.family == "gptj" else 0)
  return {"embedding": embedding, "block": block, "head": head,
          "total": embedding + cfg.layers * block + head}
