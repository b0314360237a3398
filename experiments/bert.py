r"""BERT for pre-training, in Flax NNX, laid out over IPUs as Graphcore ran it.

The model is the BERT of Devlin et al. (2019) as Graphcore's public
pre-training examples build it:

* ``embeddings``: word, position and token-type tables, summed, layer norm,
  dropout;
* ``encoder/layers_i``: post-norm layers of multi-head self-attention and a
  GELU feed-forward block, a recomputation checkpoint on each layer's output
  (``ipu_jax.ops.recomputation_checkpoint``: with pipelining recomputation on,
  only these values wait for the backward pass) and, for the layers listed in
  ``BertConfig.attention_checkpoints``, on its attention block's output too;
* ``pooler``: a tanh dense layer on the first ([CLS]) position;
* ``mlm_head``: a dense + GELU + layer-norm transform of the masked positions
  only (the examples gather the ``max_predictions`` masked positions before
  the head, so the vocabulary projection runs on them alone), then the
  decoder projection, **tied** to the word embedding (``h @ word.T + bias``),
  optionally serialised (``decoder_serialization``: PopTorch's
  ``serializedMatMul`` over output channels, TF-IPU's ``serialized_matmul``);
  with ``BertConfig.head_checkpoints`` the masked rows, the projection and
  the biased logits are recomputation checkpoints;
* ``nsp_head``: next-sentence prediction, a dense layer on the pooled output.

:func:`pretraining_loss` is the masked-LM cross entropy over the masked
positions (weighted) plus the NSP cross entropy. :func:`layout` gives the
``stage_assignment`` and ``device_mapping`` of a pipeline from the layers per
IPU: the embeddings and the first layers on IPU 0, the remaining layers over
the other IPUs, and the pooler and both heads back on **IPU 0** (so the tied
decoder sits with the embedding it shares) -- BERT-Large's
``layers_per_ipu = [3, 7, 7, 7]`` makes five stages on four IPUs,
``device_mapping = [0, 1, 2, 3, 0]``. :func:`placement_layout` lays it out as
Graphcore's MLPerf v1.1 / v2.0 runs did (``att_ffn_placement``): the
embeddings alone on stage 0, then stages of attention and feed-forward blocks
placed separately (each layer's two sub-blocks are scopes of their own,
``layers_<i>/attention_block`` and ``layers_<i>/ffn_block``), so a layer's
attention may run on one IPU and its feed-forward block on the next.
:func:`popart_checkpoints` gives the checkpoints Graphcore's MLPerf v1.1 /
v2.0 PopART code marks (``bert_model.py``'s ``should_checkpoint_att`` and
``projection()``): every attention output of the last stage and the MLM
projection's three, so that stage is recomputed between them under
``pipelining.last_stage_recomputation = "checkpoints"`` (PopART's
``RecomputationType::Pipeline``, docs/multi_ipu.md#the-last-stage).

Sizes (``BertConfig``): BERT-Large 24 x 1024, 16 heads, FFN 4096, vocabulary
30,522; BERT-Base 12 x 768, 12 heads, FFN 3072 (Devlin et al., Table 1 and
the released checkpoints' ``bert_config.json``).
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

__all__ = ["BertConfig", "Bert", "bert_large", "bert_base", "pretraining_loss",
           "make_loss", "layout", "placement_layout", "popart_checkpoints",
           "synthetic_batches",
           "ATTENTION_BLOCK", "FFN_BLOCK", "SCORES", "SOFTMAX", "CONTEXT"]

# The scopes of an encoder layer's two sub-blocks (module paths
# ``layers_<i>/attention_block``, ``layers_<i>/ffn_block``).
ATTENTION_BLOCK = "attention_block"
FFN_BLOCK = "ffn_block"
# Scopes inside the attention block (the layer_costs runner groups steps by them).
SCORES = "scores"
SOFTMAX = "softmax"
CONTEXT = "context"


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """BERT's sizes and the IPU-specific options of its layers.

  Attributes:
    vocab_size, hidden, layers, heads, ffn: the model's sizes.
    max_positions: rows of the position table (the longest sequence).
    type_vocab: rows of the token-type table.
    dropout: dropout rate of embeddings, attention output and FFN output.
    attention_dropout: dropout rate of the attention probabilities (the
      softmax's output, before they weight the values), as BERT's reference
      applies it (``attention_probs_dropout_prob``) and Graphcore's MLPerf
      v2.0 runs did (``no_attn_dropout: false``, PopART ``bert_model.py``);
      0 turns it off, as Graphcore's TensorFlow 2 and PyTorch examples and
      the v1.0 / v1.1 MLPerf runs set it.
    layer_norm_eps: BERT's 1e-12.
    decoder_serialization: the MLM decoder projection's serialisation factor
      over its output channels (the vocabulary); 1 = one matmul.
    embedding_serialization: the word-embedding lookup's serialisation factor
      (TF-IPU ``embedding_lookup(serialization_factor=)``).
    dtype: the parameters' and activations' dtype.
    attention_checkpoints: the layers whose attention block's output is a
      recomputation checkpoint (every layer's output is one);
      :func:`popart_checkpoints` gives Graphcore's MLPerf choice.
    head_checkpoints: the MLM head's masked rows, its vocabulary projection
      and the biased logits are recomputation checkpoints (Graphcore's
      MLPerf ``projection()``).
  """
  vocab_size: int = 30522
  hidden: int = 1024
  layers: int = 24
  heads: int = 16
  ffn: int = 4096
  max_positions: int = 512
  type_vocab: int = 2
  dropout: float = 0.1
  attention_dropout: float = 0.0
  layer_norm_eps: float = 1e-12
  decoder_serialization: int = 1
  embedding_serialization: int = 1
  dtype: object = jnp.float32
  attention_checkpoints: tuple = ()
  head_checkpoints: bool = False

  def __post_init__(self):
    for name in ("vocab_size", "hidden", "layers", "heads", "ffn", "max_positions",
                 "type_vocab", "decoder_serialization", "embedding_serialization"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"BertConfig.{name} must be an int >= 1; got {value!r}.")
    if self.hidden % self.heads:
      raise ValueError(f"BertConfig.hidden={self.hidden} must be a multiple of "
                       f"BertConfig.heads={self.heads}.")
    for name in ("dropout", "attention_dropout"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"BertConfig.{name} must be in [0, 1); got {getattr(self, name)!r}.")
    layers = self.attention_checkpoints
    if (not isinstance(layers, tuple)
        or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.layers
               for i in layers)):
      raise ValueError(f"BertConfig.attention_checkpoints must be a tuple of layer indices in "
                       f"[0, {self.layers}); got {layers!r}.")


def bert_large(**overrides) -> BertConfig:
  """BERT-Large: 24 layers, width 1024, 16 heads, FFN 4096, vocabulary 30,522."""
  return BertConfig(**overrides)


def bert_base(**overrides) -> BertConfig:
  """BERT-Base: 12 layers, width 768, 12 heads, FFN 3072, vocabulary 30,522."""
  return dataclasses.replace(BertConfig(hidden=768, layers=12, heads=12, ffn=3072),
                             **overrides)


def _dense(din: int, dout: int, cfg: BertConfig, rngs: nnx.Rngs) -> nnx.Linear:
  # BERT initialises every weight from a truncated normal of std 0.02.
  init = jax.nn.initializers.truncated_normal(0.02)
  return nnx.Linear(din, dout, kernel_init=init, dtype=cfg.dtype, param_dtype=cfg.dtype,
                    rngs=rngs)


def _norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.hidden, epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                       param_dtype=cfg.dtype, rngs=rngs)


class Embeddings(nnx.Module):
  """Word + position + token-type embeddings, layer norm, dropout."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    init = jax.nn.initializers.truncated_normal(0.02)
    table = lambda n: nnx.Param(init(rngs.params(), (n, cfg.hidden), cfg.dtype))
    self.word = table(cfg.vocab_size)
    self.position = table(cfg.max_positions)
    self.token_type = table(cfg.type_vocab)
    self.norm = _norm(cfg, rngs)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.serialization = cfg.embedding_serialization

  def __call__(self, ids, token_types, deterministic: bool):
    if self.serialization > 1:
      words = ipu_jax.ops.embedding_lookup(self.word[...], ids,
                                           serialization_factor=self.serialization)
    else:
      words = jnp.take(self.word[...], ids, axis=0)
    seq = ids.shape[-1]
    h = words + self.position[...][:seq] + jnp.take(self.token_type[...], token_types, axis=0)
    return self.dropout(self.norm(h), deterministic=deterministic)


class EncoderLayer(nnx.Module):
  """Post-norm self-attention and feed-forward block, BERT's layer."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs, checkpoint_attention: bool = False):
    self.heads = cfg.heads
    self.checkpoint_attention = checkpoint_attention
    self.qkv = _dense(cfg.hidden, 3 * cfg.hidden, cfg, rngs)
    self.attention_out = _dense(cfg.hidden, cfg.hidden, cfg, rngs)
    self.attention_norm = _norm(cfg, rngs)
    self.ffn_in = _dense(cfg.hidden, cfg.ffn, cfg, rngs)
    self.ffn_out = _dense(cfg.ffn, cfg.hidden, cfg, rngs)
    self.ffn_norm = _norm(cfg, rngs)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    # Only when on, so a model without it keeps the module tree it had.
    self.attention_dropout = (nnx.Dropout(cfg.attention_dropout, rngs=rngs)
                              if cfg.attention_dropout else None)

  def _attention(self, h, mask_bias, deterministic: bool):
    b, s, w = h.shape
    q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
    heads = lambda t: t.reshape(b, s, self.heads, w // self.heads).transpose(0, 2, 1, 3)
    # The scores, softmax and context open scopes of their own so a report (and
    # experiments/layer_costs.py) can tell their steps apart; costs are unchanged.
    with jax.named_scope(SCORES):
      # A Python float keeps the scores in the model's dtype (a NumPy float64
      # scalar would promote half-precision scores to float32).
      scores = heads(q) @ heads(k).transpose(0, 1, 3, 2) / float(np.sqrt(w // self.heads))
      scores = scores + mask_bias
    with jax.named_scope(SOFTMAX):
      probs = ipu_jax.ops.softmax(scores, axis=-1)  # popnn's, as PopART runs it
    if self.attention_dropout is not None:
      probs = self.attention_dropout(probs, deterministic=deterministic)
    with jax.named_scope(CONTEXT):
      return (probs @ heads(v)).transpose(0, 2, 1, 3).reshape(b, s, w)

  def __call__(self, h, mask_bias, deterministic: bool):
    # The two sub-blocks open scopes of their own, so a stage_assignment can
    # put a layer's attention and its feed-forward block on different
    # pipeline stages (Graphcore's att_ffn_placement, :func:`placement_layout`).
    with jax.named_scope(ATTENTION_BLOCK):
      a = self.dropout(self.attention_out(self._attention(h, mask_bias, deterministic)),
                       deterministic=deterministic)
      h = self.attention_norm(h + a)
      if self.checkpoint_attention:
        h = ipu_jax.ops.recomputation_checkpoint(h)
    with jax.named_scope(FFN_BLOCK):
      f = self.ffn_out(ipu_jax.ops.gelu(self.ffn_in(h)))  # popnn's GELU, as PopART's Gelu
      h = self.ffn_norm(h + self.dropout(f, deterministic=deterministic))
      # Only these values wait for the backward pass when recomputation is on.
      return ipu_jax.ops.recomputation_checkpoint(h)


class Encoder(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    marked = set(cfg.attention_checkpoints)
    self.layers = nnx.List([EncoderLayer(cfg, rngs, i in marked) for i in range(cfg.layers)])

  def __call__(self, h, mask_bias, deterministic: bool):
    for layer in self.layers:
      h = layer(h, mask_bias, deterministic)
    return h


class MaskedLMHead(nnx.Module):
  """Transform of the masked positions and the decoder tied to the word table."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.transform = _dense(cfg.hidden, cfg.hidden, cfg, rngs)
    self.norm = _norm(cfg, rngs)
    self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), cfg.dtype))
    self.serialization = cfg.decoder_serialization
    self.checkpoints = cfg.head_checkpoints

  def _mark(self, x):
    return ipu_jax.ops.recomputation_checkpoint(x) if self.checkpoints else x

  def __call__(self, h, word_table):
    h = self.norm(ipu_jax.ops.gelu(self.transform(self._mark(h))))  # popnn's GELU
    # The decoder sees the masked positions as one [B P, H] matrix, so the
    # word table's gradient is one [H, B P] x [B P, V] product: a batched
    # [B, H, P] x [B, P, V] one would hold a [B, H, V] table gradient per
    # sample (BERT-Base's micro-batch of 32: 750 M values) before summing.
    rows = h.reshape(-1, h.shape[-1])
    if self.serialization > 1:
      # PopTorch serializedMatMul(OutputChannels): the vocabulary in pieces.
      logits = ipu_jax.ops.serialized_matmul(rows, word_table.T, self.serialization,
                                             "output_channels")
    else:
      logits = rows @ word_table.T
    logits = self._mark(self._mark(logits) + self.bias[...])
    return logits.reshape(h.shape[:-1] + logits.shape[-1:])


class Bert(nnx.Module):
  """BERT with its pre-training heads: ``(mlm_logits, nsp_logits)``."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embeddings = Embeddings(cfg, rngs)
    self.encoder = Encoder(cfg, rngs)
    self.pooler = _dense(cfg.hidden, cfg.hidden, cfg, rngs)
    self.mlm_head = MaskedLMHead(cfg, rngs)
    self.nsp_head = _dense(cfg.hidden, 2, cfg, rngs)

  def __call__(self, batch: dict, deterministic: bool = True):
    """Logits of the masked positions ``[B, P, V]`` and of NSP ``[B, 2]``.

    Args:
      batch: ``input_ids``, ``token_type_ids``, ``attention_mask`` ([B, S];
        1 = attend), ``masked_lm_positions`` ([B, P]).
      deterministic: no dropout (evaluation) when True.
    """
    h = self.embeddings(batch["input_ids"], batch["token_type_ids"], deterministic)
    mask = batch["attention_mask"].astype(h.dtype)
    mask_bias = ((1.0 - mask) * -10000.0)[:, None, None, :]
    h = self.encoder(h, mask_bias, deterministic)
    pooled = jnp.tanh(self.pooler(h[:, 0]))
    masked = jnp.take_along_axis(h, batch["masked_lm_positions"][..., None], axis=1)
    mlm = self.mlm_head(masked, self.embeddings.word[...])
    return mlm, self.nsp_head(pooled)


def pretraining_loss(mlm_logits, nsp_logits, batch: dict):
  """Masked-LM cross entropy (weighted mean over masked positions) + NSP's."""
  mlm = optax.softmax_cross_entropy_with_integer_labels(
      mlm_logits.astype(jnp.float32), batch["masked_lm_ids"])
  weights = batch["masked_lm_weights"].astype(jnp.float32)
  mlm = jnp.sum(mlm * weights) / jnp.maximum(jnp.sum(weights), 1.0)
  nsp = optax.softmax_cross_entropy_with_integer_labels(
      nsp_logits.astype(jnp.float32), batch["next_sentence_labels"]).mean()
  return mlm + nsp


def make_loss(model: Bert, dropout: bool = False):
  """``(loss_fn, params)`` for a Pipeline or ``jax.grad``: :func:`pretraining_loss`
  of the model's outputs (:func:`experiments.nnx_losses.pure_loss`).

  Without dropout, ``loss_fn(params, batch)``; with it, ``loss_fn(params,
  batch, rng)``: every random stream of the model (its dropout layers) starts
  from ``rng``. The model's calls open named scopes of their module paths, so
  a ``stage_assignment`` by module path (:func:`layout`) places them on
  pipeline stages.
  """
  from experiments import nnx_losses
  return nnx_losses.pure_loss(model, lambda out, batch: pretraining_loss(*out, batch), dropout)


def layout(layers_per_ipu: Sequence[int]):
  """``(stage_assignment, device_mapping)`` of BERT over ``len(layers_per_ipu)`` IPUs.

  Stage k < N holds the encoder layers of IPU k (stage 0 also the
  embeddings); stage N, back on IPU 0, holds the pooler and both heads, so the
  tied decoder shares IPU 0 with the word embedding it reads.

  Args:
    layers_per_ipu: encoder layers on each IPU, e.g. ``[3, 7, 7, 7]``.

  Raises:
    ValueError: an entry below 0, or IPU 0 with no layers and embeddings only
      is fine but a later IPU with none is not (its stage would be empty).
  """
  counts = [int(n) for n in layers_per_ipu]
  if not counts or any(n < 0 for n in counts) or any(n == 0 for n in counts[1:]):
    raise ValueError(f"layers_per_ipu must list >= 0 layers for IPU 0 and >= 1 for each "
                     f"other IPU; got {list(layers_per_ipu)!r}.")
  assignment = {"embeddings": 0}
  first = 0
  for ipu, n in enumerate(counts):
    for i in range(first, first + n):
      assignment[f"layers_{i}"] = ipu
    first += n
  heads_stage = len(counts)
  assignment.update({"pooler": heads_stage, "mlm_head": heads_stage, "nsp_head": heads_stage})
  return assignment, list(range(len(counts))) + [0]


def _check_placement(placement, num_layers: int) -> list:
  """``placement`` as ``[(ipu, attention blocks, ffn blocks)]``, checked.

  Raises:
    ValueError: naming ``att_ffn_placement``: an entry not ``[ipu, [a, f]]``
      of ints >= 0, a stage with no block, counts not adding up to
      ``num_layers``, a layer's feed-forward block placed before its
      attention, or IPU ids not ``0 .. N-1``.
  """
  what = (f"att_ffn_placement must list stages [ipu, [attention blocks, feed-forward "
          f"blocks]], e.g. [[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], [0, [4, 5]]]; got "
          f"{placement!r}")
  try:
    stages = [(int(ipu), int(a), int(f)) for ipu, (a, f) in placement]
  except (TypeError, ValueError):
    raise ValueError(f"{what}.") from None
  if not stages or any(min(s) < 0 for s in stages):
    raise ValueError(f"{what}.")
  for k, (ipu, a, f) in enumerate(stages):
    if a + f == 0:
      raise ValueError(f"att_ffn_placement stage {k + 1} (IPU {ipu}) holds no block; its "
                       f"pipeline stage would be empty.")
  attention = np.cumsum([a for _, a, _ in stages])
  ffn = np.cumsum([f for _, _, f in stages])
  if attention[-1] != num_layers or ffn[-1] != num_layers:
    raise ValueError(f"att_ffn_placement places {attention[-1]} attention and {ffn[-1]} "
                     f"feed-forward blocks; the model has {num_layers} layers of each.")
  behind = np.flatnonzero(ffn > attention)
  if behind.size:
    raise ValueError(f"att_ffn_placement stage {behind[0] + 1} places feed-forward block "
                     f"{attention[behind[0]]} before its layer's attention block.")
  ipus = sorted({ipu for ipu, _, _ in stages} | {0})
  if ipus != list(range(len(ipus))):
    raise ValueError(f"att_ffn_placement uses IPUs {ipus}; a replica's IPUs are 0 .. N-1, "
                     f"each used.")
  return stages


def placement_layout(att_ffn_placement, num_layers: int):
  """``(stage_assignment, device_mapping)`` of Graphcore's MLPerf ``att_ffn_placement``.

  The layout of Graphcore's MLPerf Training v1.1 / v2.0 BERT
  (``bert_model.py``'s ``init_device_placement`` with
  ``encoder_start_pipeline_stage: 1``): stage 0 holds the embeddings alone on
  IPU 0; each entry ``[ipu, [a, f]]`` is the next stage, on IPU ``ipu``,
  holding the next ``a`` layers' attention blocks and the next ``f`` layers'
  feed-forward blocks, so a layer's attention may sit on one IPU and its
  feed-forward block on the next; the pooler and heads join the last stage
  when it is on IPU 0 (the tied decoder beside the word embedding), else a
  stage of their own on IPU 0 follows.

  Args:
    att_ffn_placement: ``[[ipu, [attention blocks, ffn blocks]], ...]`` in
      pipeline order, e.g. ``[[1, [7, 6]], [2, [6, 7]], [3, [7, 6]], [0, [4, 5]]]``.
    num_layers: the model's encoder layers.

  Raises:
    ValueError: a placement :func:`_check_placement` refuses.
  """
  stages = _check_placement(att_ffn_placement, num_layers)
  assignment = {"embeddings": 0}
  next_attention = next_ffn = 0
  for stage, (_, a, f) in enumerate(stages, start=1):
    for i in range(next_attention, next_attention + a):
      assignment[f"layers_{i}/{ATTENTION_BLOCK}"] = stage
    for i in range(next_ffn, next_ffn + f):
      assignment[f"layers_{i}/{FFN_BLOCK}"] = stage
    next_attention, next_ffn = next_attention + a, next_ffn + f
  mapping = [0] + [ipu for ipu, _, _ in stages]
  if mapping[-1] != 0:
    mapping.append(0)
  heads = len(mapping) - 1
  assignment.update({"pooler": heads, "mlm_head": heads, "nsp_head": heads})
  return assignment, mapping


def popart_checkpoints(att_ffn_placement, num_layers: int) -> tuple:
  """The attention blocks Graphcore's MLPerf v1.1 / v2.0 BERT checkpoints.

  ``bert_model.py``'s ``should_checkpoint_att`` (github.com/mlcommons/
  training_results_v1.1 and _v2.0, ``Graphcore/benchmarks/bert/
  implementations/popart/``) marks an attention block's output with
  ``checkpointOutput`` iff the block is on the last pipeline stage ("Checkpoint
  the output of attention layers on the last stage"); every feed-forward
  output is one already here (each layer's output), as ``should_checkpoint_ffn``
  marks all but an IPU's last one, whose value leaves the stage anyway.

  Args:
    att_ffn_placement, num_layers: as :func:`placement_layout` takes them.

  Returns:
    The layers whose attention block sits on the pipeline's last stage (none
    when the heads have a stage of their own).
  """
  assignment, mapping = placement_layout(att_ffn_placement, num_layers)
  last = len(mapping) - 1
  return tuple(i for i in range(num_layers)
               if assignment[f"layers_{i}/{ATTENTION_BLOCK}"] == last)


def synthetic_batches(cfg: BertConfig, num: int, micro_batch: int, seq: int,
                      max_predictions: int, seed: int = 0) -> dict:
  """``num`` stacked micro-batches of synthetic masked-LM data (numpy, int32).

  Token ids are uniform over the vocabulary past the 4 special ids; the last
  quarter of each sequence is padding (``attention_mask`` 0); masked positions
  are distinct positions of the unpadded part, with weight 1 for all but the
  last prediction of odd samples (so the weighted mean is exercised).
  """
  if max_predictions > seq:
    raise ValueError(f"max_predictions={max_predictions} exceeds the sequence {seq}.")
  rng = np.random.default_rng(seed)
  shape = (num, micro_batch, seq)
  ids = rng.integers(4, cfg.vocab_size, size=shape).astype(np.int32)
  length = max(max_predictions, seq - seq // 4)
  mask = (np.arange(seq) < length).astype(np.int32) * np.ones(shape, np.int32)
  types = (np.arange(seq) >= length // 2).astype(np.int32) * mask
  keys = rng.random((num, micro_batch, length))
  positions = np.argsort(keys, axis=-1)[..., :max_predictions].astype(np.int32)
  labels = np.take_along_axis(ids, positions, axis=-1)
  weights = np.ones(positions.shape, np.float32)
  weights[:, 1::2, -1] = 0.0
  return {"input_ids": ids, "token_type_ids": types.astype(np.int32), "attention_mask": mask,
          "masked_lm_positions": positions, "masked_lm_ids": labels.astype(np.int32),
          "masked_lm_weights": weights,
          "next_sentence_labels": rng.integers(0, 2, size=(num, micro_batch)).astype(np.int32)}
