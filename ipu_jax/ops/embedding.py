"""``embedding_lookup``: rows of a table by id, optionally serialised over the vocabulary.

TF-IPU's ``ipu.embedding_ops.embedding_lookup(params, ids,
serialization_factor=)``: with a factor above 1 the lookup "will be broken up
into serialization_factor smaller lookups, serialized along the 0th
dimension" (its docstring): the table is cut into ``factor`` pieces of
``V / factor`` rows; each piece is gathered with the ids shifted into its
range (ids outside it read row 0 and are masked to zero) and the pieces'
results are added, so each output row is exactly its table row (one piece
contributes it, the others add zeros). PopTorch's BERT and DALL-E examples
build the same thing by hand (``SerializedEmbedding``).

There is no new primitive: the pieces are ordinary ``lax`` ops (one split,
gathers, selects and adds), so every executor, ``grad`` and ``vmap`` take them as they
are, and the lowering plans each piece's gather as its own step (the
pieces of the table are copies here; in Poplar they are views:
docs/serialization.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from ipu_jax.ops.serialized_matmul import check_factor

__all__ = ["embedding_lookup"]


def embedding_lookup(table, ids, serialization_factor: int = 1):
  """``table[ids]``, the table optionally cut into ``serialization_factor`` pieces.

  Args:
    table: ``[V, ...]`` the embedding table.
    ids: integer ids in ``[0, V)``, any shape.
    serialization_factor: pieces the vocabulary ``V`` is cut into, looked up
      one after another; must divide ``V``.

  Returns:
    ``ids.shape + table.shape[1:]`` rows of the table. Ids outside ``[0, V)``
    give zeros with a factor above 1 (no piece holds them) and, with factor
    1, what ``jnp.take``'s default mode gives.

  Raises:
    ValueError: a factor below 1 or not dividing ``V`` (the message lists the
      divisors), a table of rank 0, non-integer ids.
  """
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim < 1:
    raise ValueError(f"embedding_lookup: the table must have rank >= 1, got shape {table.shape}.")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"embedding_lookup: ids must be integers, got {ids.dtype}.")
  vocab = int(table.shape[0])
  factor = check_factor(serialization_factor, vocab, "the vocabulary (table.shape[0])",
                        op="embedding_lookup")
  if factor == 1:
    return jnp.take(table, ids, axis=0)
  size = vocab // factor
  total = None
  # One split (not factor slices): its gradient is one concatenation of the
  # pieces' gradients, where slices' would be factor zero-padded tables summed.
  for i, piece in enumerate(jnp.split(table, factor, axis=0)):
    local = ids - i * size
    inside = (local >= 0) & (local < size)
    rows = jnp.take(piece, jnp.where(inside, local, 0), axis=0)
    rows = jnp.where(inside.reshape(inside.shape + (1,) * (table.ndim - 1)), rows,
                     jnp.zeros((), table.dtype))
    total = rows if total is None else total + rows
  return total
