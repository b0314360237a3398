"""Model-scale training steps for the ``scale`` benchmark suite.

Each row is a pure adam training step (forward, ``jax.grad``, update) built
with :func:`experiments.models.make_train_step`, so ``ipu_jax.jit`` and
``jax.jit`` compile the same function:

* the transformer encoder of ``experiments.transformer`` at several
  (layers, width, sequence, batch) sizes, and at BERT-base geometry (12
  layers, width 768, 12 heads, MLP 3072, sequence 128, vocabulary 30,522);
* a ResNet-18 layout CNN (7x7/2 stem, 3x3/2 max pool, four stages of two
  basic blocks with 64/128/256/512 channels, global average pool, 1000
  classes; He et al. 2016, table 1) on 64x64 RGB inputs, with group norm in
  place of batch norm (the pure step has no running statistics).
"""

from __future__ import annotations

import dataclasses

__all__ = ["ScaleRow", "ROWS", "row", "workload"]


@dataclasses.dataclass(frozen=True)
class ScaleRow:
  """One row of the ``scale`` suite.

  Attributes:
    name: row name (``--rows`` picks rows by it).
    model: ``"transformer"`` or ``"resnet18"``.
    layers, width, heads, seq, vocab: transformer geometry.
    batch: micro-batch.
    image: input side for the CNN.
    target: ``(preset, num_ipus)`` of the emulated system (of one replica).
    replicas: replicas of the step (data parallel, ``replication_factor``):
      each replica runs the step on its own ``target`` and the gradients are
      averaged across them (``ipu_jax.ops.cross_replica_mean``, an all-reduce
      over the IPU-Links), so ``replicas x num_ipus`` IPUs in all.
    tiles_per_ipu: tiles of each IPU (0: the preset's). More than the chip
      has makes a hypothetical IPU (a measurement row, no real system).
  """

  name: str
  model: str
  batch: int
  layers: int = 0
  width: int = 0
  heads: int = 4
  seq: int = 0
  vocab: int = 256
  image: int = 0
  target: tuple = ("ipu2", 1)
  replicas: int = 1
  tiles_per_ipu: int = 0

  def ipu_target(self):
    """The :class:`ipu_jax.IPUTarget` a replica of the row lowers for."""
    import ipu_jax
    preset, num_ipus = self.target
    target = ipu_jax.IPUTarget.preset(preset, num_ipus=num_ipus)
    # ``replace``, not the preset's ``tiles_per_ipu`` (which refuses more
    # tiles than the chip has): each tile stays the preset's.
    return target.replace(tiles_per_ipu=self.tiles_per_ipu) if self.tiles_per_ipu else target

  @property
  def target_name(self) -> str:
    """``bowx4``, ``ipu2x1 (5888 tiles)``, ``bowx1 x16 replicas``: the target as tables show it."""
    name = f"{self.target[0]}x{self.target[1]}"
    if self.tiles_per_ipu:
      name += f" ({self.tiles_per_ipu} tiles)"
    return name + (f" x{self.replicas} replicas" if self.replicas > 1 else "")


ROWS = (
    ScaleRow("enc-2x64", "transformer", batch=8, layers=2, width=64, seq=32),
    ScaleRow("enc-4x128", "transformer", batch=8, layers=4, width=128, seq=64),
    ScaleRow("enc-8x256", "transformer", batch=8, layers=8, width=256, seq=128),
    ScaleRow("enc-2x768", "transformer", batch=4, layers=2, width=768, heads=12, seq=128),
    # Adam's moments triple the 110 M weights: on 4 Bow IPUs the step needs
    # 645,600 B on its fullest tile (1 % over), so the row runs on 8.
    ScaleRow("bert-base", "transformer", batch=2, layers=12, width=768, heads=12, seq=128,
             vocab=30522, target=("bow", 8)),
    # BERT-base with 2 of its 12 layers, on the same target: lowering time per
    # equation against depth, all else equal.
    ScaleRow("bert-2layers", "transformer", batch=2, layers=2, width=768, heads=12, seq=128,
             vocab=30522, target=("bow", 8)),
    ScaleRow("resnet18-64", "resnet18", batch=4, image=64),
    # The 8-layer step on four Bow IPUs (one program over their 5,888 tiles):
    # lowering time against the IPU count, the work being enc-8x256's.
    ScaleRow("enc-8x256-bow4", "transformer", batch=8, layers=8, width=256, seq=128,
             target=("bow", 4)),
    # The same step on one hypothetical IPU of as many tiles as the four (no
    # IPU-Links): of the four-IPU row's lowering time over one IPU's, the part
    # the tile count alone makes (docs/performance.md#lowering-on-several-ipus).
    ScaleRow("enc-8x256-t5888", "transformer", batch=8, layers=8, width=256, seq=128,
             tiles_per_ipu=5888),
    # Lowering time per equation, one IPU against sixteen: the same step on one
    # Bow IPU, and replicated over 16 (one IPU each, gradients all-reduced).
    ScaleRow("enc-4x128-bow1", "transformer", batch=8, layers=4, width=128, seq=64,
             target=("bow", 1)),
    ScaleRow("enc-4x128-bow1x16", "transformer", batch=8, layers=4, width=128, seq=64,
             target=("bow", 1), replicas=16),
)


def row(name: str) -> ScaleRow:
  for r in ROWS:
    if r.name == name:
      return r
  raise ValueError(f"unknown scale row {name!r}; valid: {', '.join(r.name for r in ROWS)}")


def _resnet18(classes: int = 1000, seed: int = 0):
  import jax
  from flax import nnx

  def _norm(channels, rngs):
    # Group norm (32 groups) in place of batch norm: the pure training step
    # carries no running statistics to update, and the per-group reductions
    # and broadcasts are the same kind of work.
    return nnx.GroupNorm(channels, num_groups=32, rngs=rngs)

  class Block(nnx.Module):
    def __init__(self, cin, cout, stride, rngs):
      self.conv1 = nnx.Conv(cin, cout, (3, 3), strides=stride, padding=1, use_bias=False, rngs=rngs)
      self.bn1 = _norm(cout, rngs)
      self.conv2 = nnx.Conv(cout, cout, (3, 3), padding=1, use_bias=False, rngs=rngs)
      self.bn2 = _norm(cout, rngs)
      if stride != 1 or cin != cout:  # projection shortcut
        self.down = nnx.Conv(cin, cout, (1, 1), strides=stride, use_bias=False, rngs=rngs)
        self.down_bn = _norm(cout, rngs)
      else:
        self.down = None

    def __call__(self, x):
      y = jax.nn.relu(self.bn1(self.conv1(x)))
      y = self.bn2(self.conv2(y))
      skip = x if self.down is None else self.down_bn(self.down(x))
      return jax.nn.relu(y + skip)

  class ResNet18(nnx.Module):
    def __init__(self, rngs):
      self.stem = nnx.Conv(3, 64, (7, 7), strides=2, padding=3, use_bias=False, rngs=rngs)
      self.stem_bn = _norm(64, rngs)
      blocks, cin = [], 64
      for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [Block(cin, cout, stride, rngs), Block(cout, cout, 1, rngs)]
        cin = cout
      self.blocks = nnx.List(blocks)
      self.head = nnx.Linear(512, classes, rngs=rngs)

    def __call__(self, x):
      x = jax.nn.relu(self.stem_bn(self.stem(x)))
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
      for block in self.blocks:
        x = block(x)
      return self.head(x.mean(axis=(1, 2)))

  return ResNet18(nnx.Rngs(seed))


def workload(r: ScaleRow, seed: int = 0):
  """``(step_fn, args)``: the adam training step of row ``r`` and its inputs."""
  import jax
  import optax
  from experiments import models, transformer
  k_x, k_y, k_drop = jax.random.split(jax.random.key(seed), 3)
  if r.model == "transformer":
    model = transformer.make_model(seed, vocab=r.vocab, width=r.width, heads=r.heads,
                                   layers=r.layers, seq_len=r.seq)
    x = jax.random.randint(k_x, (r.batch, r.seq), 0, r.vocab)
    y = jax.random.randint(k_y, (r.batch, r.seq), 0, r.vocab)
  elif r.model == "resnet18":
    model = _resnet18(seed=seed)
    x = jax.random.normal(k_x, (r.batch, r.image, r.image, 3))
    y = jax.random.randint(k_y, (r.batch,), 0, 1000)
  else:
    raise ValueError(f"unknown model {r.model!r}; valid: 'transformer', 'resnet18'")
  optimizer = optax.adam(1e-3)
  reduce_grads = None
  if r.replicas > 1:
    from ipu_jax.ops import cross_replica_mean
    reduce_grads = cross_replica_mean
  step, params = models.make_train_step(model, optimizer, reduce_grads=reduce_grads)
  return step, (params, optimizer.init(params), x, y, k_drop)


def num_params(params) -> int:
  import jax
  import numpy as np
  return int(sum(np.size(p) for p in jax.tree_util.tree_leaves(params)))
