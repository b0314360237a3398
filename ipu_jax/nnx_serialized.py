"""Serialised Flax NNX layers: ``serialize(module, factor, mode)``.

What Graphcore's PopTorch models do by hand (``SerializedLinear`` for the
BERT decoder, ``SerializedEmbedding``; TF-IPU's Keras ``SerialDense`` and
``Embedding(serialization_factor=)``) as one call that wraps an existing
layer, keeping its parameters (the same ``nnx.Param`` objects, so a weight
tied elsewhere stays tied)::

  model.decoder = ipu_jax.nnx_serialized.serialize(model.decoder, 2)   # nnx.Linear
  model.embed = ipu_jax.nnx_serialized.serialize(model.embed, 2)       # nnx.Embed
  logits = model.embed.attend(h)   # the tied projection, serialised too

* ``nnx.Linear`` -> :class:`SerializedLinear`: ``x @ kernel`` as
  :func:`ipu_jax.ops.serialized_matmul` (default mode ``"output_channels"``,
  PopTorch's choice for the decoder), then the bias.
* ``nnx.Embed`` -> :class:`SerializedEmbed`: the lookup as
  :func:`ipu_jax.ops.embedding_lookup` with ``serialization_factor``, and
  ``attend(q)`` (``q @ embedding.T``, the tied decoder) serialised over the
  vocabulary (``mode``, default ``"output_channels"``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ipu_jax.ops.embedding import embedding_lookup
from ipu_jax.ops.serialized_matmul import canonical_mode, check_factor, serialized_matmul

__all__ = ["SerializedLinear", "SerializedEmbed", "serialize"]


class SerializedLinear(nnx.Module):
  """An ``nnx.Linear`` whose product is serialised (its parameters are the layer's).

  Attributes:
    layer: the wrapped ``nnx.Linear`` (its ``kernel`` and ``bias``).
    factor, mode: the serialisation (:func:`ipu_jax.ops.serialized_matmul`).
  """

  def __init__(self, layer: nnx.Linear, factor: int, mode="output_channels"):
    # An M split cuts the inputs' rows, known only when called.
    axis = canonical_mode(mode)
    if axis == "k":
      check_factor(factor, layer.in_features, "in_features", op="SerializedLinear")
    elif axis == "n":
      check_factor(factor, layer.out_features, "out_features", op="SerializedLinear")
    else:
      check_factor(factor, factor, "the factor", op="SerializedLinear")
    self.layer, self.factor, self.mode = layer, int(factor), mode

  def __call__(self, inputs):
    layer = self.layer
    bias = layer.bias[...] if layer.bias is not None else None
    inputs, kernel, bias = layer.promote_dtype((inputs, layer.kernel[...], bias),
                                               dtype=layer.dtype)
    y = serialized_matmul(inputs, kernel, self.factor, self.mode)
    if bias is not None:
      y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class SerializedEmbed(nnx.Module):
  """An ``nnx.Embed`` whose lookup and ``attend`` are serialised over the vocabulary.

  Attributes:
    layer: the wrapped ``nnx.Embed`` (its ``embedding`` table).
    factor: pieces the vocabulary is cut into.
    mode: how ``attend`` serialises ``q @ embedding.T``.
  """

  def __init__(self, layer: nnx.Embed, factor: int, mode="output_channels"):
    axis = canonical_mode(mode)
    check_factor(factor, layer.num_embeddings, "num_embeddings", op="SerializedEmbed")
    if axis == "k":
      check_factor(factor, layer.features, "features", op="SerializedEmbed")
    self.layer, self.factor, self.mode = layer, int(factor), mode

  def __call__(self, inputs):
    layer = self.layer
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = layer.promote_dtype((layer.embedding[...],), dtype=layer.dtype, inexact=False)
    return embedding_lookup(table, inputs, serialization_factor=self.factor)

  def attend(self, query):
    layer = self.layer
    query, table = layer.promote_dtype((query, layer.embedding[...]), dtype=layer.dtype)
    return serialized_matmul(query, table.T, self.factor, self.mode)


def serialize(module, factor: int, mode="output_channels"):
  """``module`` (an ``nnx.Linear`` or ``nnx.Embed``) serialised ``factor`` ways.

  Raises:
    TypeError: another kind of module.
    ValueError: an unknown mode, a factor below 1 or not dividing the
      dimension it splits (named, with its divisors).
  """
  if isinstance(module, nnx.Linear):
    return SerializedLinear(module, factor, mode)
  if isinstance(module, nnx.Embed):
    return SerializedEmbed(module, factor, mode)
  raise TypeError(f"serialize: expected an nnx.Linear or nnx.Embed, got "
                  f"{type(module).__name__}.")
