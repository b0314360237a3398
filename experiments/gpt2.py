r"""GPT-2 for language-model training, in Flax NNX, laid out over IPUs as Graphcore ran it.

The model is GPT-2 (Radford et al., 2019) as Hugging Face's
``GPT2LMHeadModel`` builds it and Graphcore's PopTorch example
(``graphcore/examples`` ``nlp/gpt2/pytorch``: ``train_gpt2.py``,
``model/optimized_gpt2_attn.py``) trains it:

* ``wte``: the token table (looked up, serialised over the vocabulary as the
  example's tied gather is when ``embedding_serialization`` > 1);
* ``wpe``: the learned positions, added to the tokens, then dropout
  (``embd_pdrop``); the example begins IPU 1's block here;
* ``layers_i``: pre-norm blocks: ``ln_1``, causal multi-head self-attention
  (scores scaled by ``1 / sqrt(head)``, the causal mask subtracted as
  ``1e4 (1 - mask)`` as the example's optimised attention does, softmax,
  dropout ``attn_pdrop``), its projection and dropout added to the residual;
  ``ln_2``, a GELU MLP of width ``4 hidden`` and dropout added to the
  residual. A recomputation checkpoint on each block's output (the example's
  ``--recompute-checkpoint-every-layer``);
* ``ln_f``: the final layer norm (in the last layers' block, as in PopTorch,
  where a block runs until the next ``BeginBlock``);
* ``lm_head``: the logits of every position, **tied** to ``wte``
  (``h @ wte.T``, no bias), serialised over the vocabulary
  (``embedding_serialization``: the example's ``SerializedLinear`` in
  ``OutputChannels`` mode, one product per piece of the table, contracting
  the table as it lies: :class:`LMHead`), back on IPU 0 beside ``wte``.

:func:`lm_loss` is the example's sequence-serialised cross entropy
(``--enable-sequence-serialized``): the ``[B S, V]`` logits are cut into
chunks of ``loss_serialization`` rows, each chunk's summed cross entropy
added up, divided by the labelled positions (labels ``< 0`` are ignored).
The example's ``--remap-logit`` custom op relays each chunk's logits for its
accuracy output only (detached from the loss); no accuracy is computed here,
so it has no counterpart.

:func:`layout` gives the ``stage_assignment`` and ``device_mapping`` of the
example's ``--layers-per-ipu``: ``wte`` on IPU 0, ``wpe`` on IPU 1, block
``i`` on its IPU, ``lm_head`` and the loss on IPU 0; consecutive blocks on
one IPU make one stage (PopTorch's ``AutoStage.AutoIncrement``), so GPT-2
small's ``[0, 4, 4, 4]`` is five stages on IPUs ``[0, 1, 2, 3, 0]``.

Sizes (:data:`SIZES`, the example's ``config/*.json``): small 12 x 768, 12
heads; medium 24 x 1024, 16 heads; large 36 x 1280, 20 heads; vocabulary
50,272 (GPT-2's 50,257 padded), 1,024 positions (large: 512).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ipu_jax

__all__ = ["GPT2Config", "GPT2", "SIZES", "gpt2_config", "lm_loss", "make_loss", "layout",
           "synthetic_batches"]


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """A GPT-2's sizes and the example's layout options.

  Attributes:
    vocab_size, hidden, layers, heads, max_positions: the model's sizes.
    dropout: ``embd_pdrop`` and ``resid_pdrop`` (0: no dropout layers drawn).
    attention_dropout: ``attn_pdrop``.
    embedding_serialization: pieces of the vocabulary the tied lookup and
      ``lm_head`` are cut into (must divide ``vocab_size``).
    loss_serialization: rows of the ``[B S, V]`` logits each cross-entropy
      chunk takes (the example's ``--serialized-seq-len``); 0: one chunk.
    dtype: weights and activations.
  """
  vocab_size: int = 50272
  hidden: int = 768
  layers: int = 12
  heads: int = 12
  max_positions: int = 1024
  dropout: float = 0.0
  attention_dropout: float = 0.0
  embedding_serialization: int = 1
  loss_serialization: int = 0
  layer_norm_eps: float = 1e-5
  dtype: type = jnp.float32

  def __post_init__(self):
    for name in ("vocab_size", "hidden", "layers", "heads", "max_positions",
                 "embedding_serialization"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GPT2Config.{name} must be an int >= 1; got {value!r}.")
    if self.hidden % self.heads:
      raise ValueError(f"GPT2Config.heads={self.heads} must divide hidden={self.hidden}.")
    if self.vocab_size % self.embedding_serialization:
      raise ValueError(f"GPT2Config.embedding_serialization={self.embedding_serialization} "
                       f"must divide vocab_size={self.vocab_size:,d}.")
    if not isinstance(self.loss_serialization, int) or self.loss_serialization < 0:
      raise ValueError(f"GPT2Config.loss_serialization must be an int >= 0 (0: one chunk); "
                       f"got {self.loss_serialization!r}.")
    for name in ("dropout", "attention_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"GPT2Config.{name} must be in [0, 1); got {getattr(self, name)!r}.")


# The example's config/config.json, config_medium.json, config_large.json.
SIZES = {
    "tiny": dict(vocab_size=512, hidden=64, layers=4, heads=4, max_positions=128),
    "small": dict(hidden=768, layers=12, heads=12),
    "medium": dict(hidden=1024, layers=24, heads=16),
    "large": dict(hidden=1280, layers=36, heads=20, max_positions=512),
}


def gpt2_config(size: str, **overrides) -> GPT2Config:
  """The named size's ``GPT2Config`` (:data:`SIZES`), fields overridden.

  Raises:
    ValueError: an unknown size, naming the valid ones.
  """
  if size not in SIZES:
    raise ValueError(f"Unknown GPT-2 size {size!r}; valid: {', '.join(SIZES)}.")
  return GPT2Config(**{**SIZES[size], **overrides})


def _dense(din: int, dout: int, cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.Linear:
  # GPT-2 initialises its weights from a normal of std 0.02 (initializer_range).
  return nnx.Linear(din, dout, kernel_init=jax.nn.initializers.normal(0.02), dtype=cfg.dtype,
                    param_dtype=cfg.dtype, rngs=rngs)


def _norm(cfg: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.hidden, epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                       param_dtype=cfg.dtype, rngs=rngs)


class TokenEmbedding(nnx.Module):
  """The token table ``[V, H]``, looked up (and read by the tied ``lm_head``)."""

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.table = nnx.Param(jax.nn.initializers.normal(0.02)(
        rngs.params(), (cfg.vocab_size, cfg.hidden), cfg.dtype))
    self.serialization = cfg.embedding_serialization

  def __call__(self, ids):
    if self.serialization > 1:
      return ipu_jax.ops.embedding_lookup(self.table[...], ids,
                                          serialization_factor=self.serialization)
    return jnp.take(self.table[...], ids, axis=0)


class PositionEmbedding(nnx.Module):
  """Learned positions added to the tokens, then dropout (IPU 1's first block)."""

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.table = nnx.Param(jax.nn.initializers.normal(0.02)(
        rngs.params(), (cfg.max_positions, cfg.hidden), cfg.dtype))
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)

  def __call__(self, tokens, deterministic: bool):
    seq = tokens.shape[-2]
    return self.dropout(tokens + self.table[...][:seq], deterministic=deterministic)


class Block(nnx.Module):
  """Pre-norm causal self-attention and GELU MLP, GPT-2's block."""

  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.heads = cfg.heads
    self.ln_1 = _norm(cfg, rngs)
    self.qkv = _dense(cfg.hidden, 3 * cfg.hidden, cfg, rngs)
    self.attention_out = _dense(cfg.hidden, cfg.hidden, cfg, rngs)
    self.ln_2 = _norm(cfg, rngs)
    self.mlp_in = _dense(cfg.hidden, 4 * cfg.hidden, cfg, rngs)
    self.mlp_out = _dense(4 * cfg.hidden, cfg.hidden, cfg, rngs)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.attention_dropout = nnx.Dropout(cfg.attention_dropout, rngs=rngs)

  def _attention(self, h, deterministic: bool):
    b, s, w = h.shape
    q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
    heads = lambda t: t.reshape(b, s, self.heads, w // self.heads).transpose(0, 2, 1, 3)
    # A Python float keeps the scores in the model's dtype.
    scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) * float(1.0 / np.sqrt(w // self.heads))
    # The example's optimised attention subtracts 1e4 where a key lies ahead.
    ahead = (1.0 - np.tril(np.ones((s, s), np.float32))) * 1e4
    scores = scores - jnp.asarray(ahead, scores.dtype)
    probs = ipu_jax.ops.softmax(scores, axis=-1)  # popnn's, as PopTorch runs it
    probs = self.attention_dropout(probs, deterministic=deterministic)
    return (probs @ heads(v)).transpose(0, 2, 1, 3).reshape(b, s, w)

  def __call__(self, h, deterministic: bool):
    a = self.attention_out(self._attention(self.ln_1(h), deterministic))
    h = h + self.dropout(a, deterministic=deterministic)
    m = self.mlp_out(ipu_jax.ops.gelu(self.mlp_in(self.ln_2(h))))  # popnn's GELU
    h = h + self.dropout(m, deterministic=deterministic)
    # Only these values wait for the backward pass when recomputation is on.
    return ipu_jax.ops.recomputation_checkpoint(h)


class FinalNorm(nnx.Module):
  def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
    self.norm = _norm(cfg, rngs)

  def __call__(self, h):
    return self.norm(h)


class LMHead(nnx.Module):
  """Logits of every position from the tied token table, serialised over the vocabulary.

  Each of the ``embedding_serialization`` pieces of the ``[V, H]`` table is
  one product contracting ``H`` with the table as it lies, run one after
  another (the pieces' logits concatenated): PopTorch's ``SerializedLinear``
  in ``OutputChannels`` mode multiplies by ``weight.t()``, a transposed view
  that PopART does not copy, so neither the product nor its gradient here
  reads or writes a transposed copy of the table (``table.T`` would be one
  in the tile program: a ``[H, V]`` copy held for the backward pass, and
  the table's gradient transposed back).
  """

  def __init__(self, cfg: GPT2Config):
    self.serialization = cfg.embedding_serialization

  def __call__(self, h, table):
    rows = h.reshape(-1, h.shape[-1])
    pieces = jnp.split(table, self.serialization, axis=0)
    contract_h = (((1,), (1,)), ((), ()))
    logits = [jax.lax.dot_general(rows, piece, contract_h) for piece in pieces]
    return logits[0] if len(logits) == 1 else jnp.concatenate(logits, axis=1)


class GPT2(nnx.Module):
  """GPT-2 with its tied LM head: the ``[B S, V]`` logits of every position."""

  def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wte = TokenEmbedding(cfg, rngs)
    self.wpe = PositionEmbedding(cfg, rngs)
    self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
    self.ln_f = FinalNorm(cfg, rngs)
    self.lm_head = LMHead(cfg)

  def __call__(self, batch: dict, deterministic: bool = True):
    """Args: ``batch["input_ids"]`` ``[B, S]`` (``S <= max_positions``)."""
    h = self.wpe(self.wte(batch["input_ids"]), deterministic)
    for layer in self.layers:
      h = layer(h, deterministic)
    return self.lm_head(self.ln_f(h), self.wte.table[...])


def lm_loss(logits, batch: dict, chunk: int = 0):
  """Mean cross entropy of the labelled positions, summed chunk by chunk.

  Each chunk's cross entropy is taken in the logits' dtype and its sum cast
  to float32, as the example computes it (float16 under its ``.half()``).

  Args:
    logits: ``[B S, V]``.
    batch: ``batch["labels"]`` ``[B, S]``; a label below 0 is not counted.
    chunk: rows of ``logits`` a chunk takes (0: all).
  """
  labels = batch["labels"].reshape(-1)
  rows = logits.shape[0]
  step = min(chunk or rows, rows)
  sizes = [step] * (rows // step) + ([rows % step] if rows % step else [])
  # One split, not a slice per chunk: its gradient concatenates the chunks'
  # (a slice's would pad each chunk's to the whole [B S, V] and add them up).
  pieces = jax.lax.split(logits, sizes, axis=0)
  total = 0.0
  for piece, wanted in zip(pieces, jax.lax.split(labels, sizes, axis=0)):
    counted = wanted >= 0
    # In the logits' dtype, the chunk's sum then float32, as the example's
    # CrossEntropyLoss(reduction="sum")(logit, label).to(torch.float32).
    ce = optax.softmax_cross_entropy_with_integer_labels(piece, jnp.where(counted, wanted, 0))
    total = total + jnp.sum(jnp.where(counted, ce, 0)).astype(jnp.float32)
  return total / jnp.maximum(jnp.sum(labels >= 0).astype(jnp.float32), 1.0)


def make_loss(model: GPT2, dropout: bool = False):
  """``(loss_fn, params)`` for a Pipeline or ``jax.grad`` (:func:`lm_loss` of the
  model's logits; :func:`experiments.nnx_losses.pure_loss`): with dropout the
  loss takes a key, ``loss_fn(params, batch, rng)``."""
  from experiments import nnx_losses
  chunk = model.cfg.loss_serialization
  return nnx_losses.pure_loss(model, lambda logits, batch: lm_loss(logits, batch, chunk),
                              dropout)


def layout(layers_per_ipu: Sequence[int]):
  """``(stage_assignment, device_mapping)`` of the example's ``--layers-per-ipu``.

  ``wte`` on IPU 0, ``wpe`` on IPU 1, block ``i`` on its IPU (``ln_f`` with
  the last), ``lm_head`` on IPU 0; consecutive blocks on one IPU share a stage.

  Raises:
    ValueError: fewer than two IPUs (``wpe`` sits on IPU 1), an entry below
      0, or an IPU past the first with no blocks.
  """
  counts = [int(n) for n in layers_per_ipu]
  if len(counts) < 2 or any(n < 0 for n in counts) or any(n == 0 for n in counts[1:]):
    raise ValueError(f"layers_per_ipu must list >= 0 blocks for IPU 0 and >= 1 for each of "
                     f"at least one more IPU (the positions sit on IPU 1); got "
                     f"{list(layers_per_ipu)!r}.")
  blocks = [("wte", 0), ("wpe", 1)]
  first = 0
  for ipu, n in enumerate(counts):
    blocks += [(f"layers_{i}", ipu) for i in range(first, first + n)]
    first += n
  blocks += [("ln_f", blocks[-1][1]), ("lm_head", 0)]
  assignment, mapping = {}, []
  for name, ipu in blocks:
    if not mapping or mapping[-1] != ipu:
      mapping.append(ipu)
    assignment[name] = len(mapping) - 1
  return assignment, mapping


def synthetic_batches(cfg: GPT2Config, num: int, micro_batch: int, seq: int,
                      seed: int = 0) -> dict:
  """``num`` stacked micro-batches of generated text (numpy, int32), as the
  example's ``--dataset generated``: uniform token ids, each position's label
  the next token, the last position unlabelled (-1)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, cfg.vocab_size, size=(num, micro_batch, seq + 1)).astype(np.int32)
  labels = ids[..., 1:].copy()
  labels[..., -1] = -1
  return {"input_ids": ids[..., :-1].copy(), "labels": labels}
