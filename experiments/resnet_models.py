r"""ResNet-50 v1.5 in Flax NNX, as Graphcore's CNN training examples build it.

The network is He et al. (2016), "Deep Residual Learning for Image
Recognition", Table 1 (50-layer column), in the v1.5 variant that MLPerf's
reference and Graphcore's TensorFlow examples train: the stride 2 of a
down-sampling bottleneck sits on its 3x3 convolution, not on the first 1x1
(``github.com/mlcommons/training_results_v1.0``, commit ``50619b5d``,
``Graphcore/benchmarks/resnet/implementations/tensorflow/Models/
resnet_base.py``: ``block3`` puts ``stride`` on its 3x3 convolution; units are
named ``b<stage>/<unit from 0>``, which :func:`stage_assignment` reads).
Layout NHWC, as the examples:

* ``stem``: 7x7 convolution, 64 channels, stride 2, batch norm, ReLU, then a
  3x3 max pool, stride 2;
* ``stage{s}_unit{u}`` (s = 1..4, units 3, 4, 6, 3): bottlenecks 1x1 -> 3x3
  -> 1x1 of width 64, 128, 256, 512 (x 4 out), batch norm after each
  convolution, a projection shortcut (1x1 convolution + batch norm) on the
  first unit of each stage, ReLU after the residual add;
* ``head``: global average pool and a 1,000-way dense layer.

Batch normalisation uses each replica's own micro-batch statistics in
training and keeps running averages (``nnx.BatchStat``) updated on the stage
that runs the layer; the examples' MLPerf configs take statistics over 2
replicas (``BN_span: 2``), see docs/published_resnet.md. It is
:class:`FusedBatchNorm`: ``nnx.BatchNorm``'s parameters and numbers, computed as
the examples' ``tf.nn.fused_batch_norm`` runs on the IPU (float32 statistics,
float16 whitening and gradient, no float32 copy of an activation kept for the
backward); ``ResNetConfig.fused_batch_norm=False`` gives Flax's own.

:func:`make_loss` turns a model into ``loss_fn(params, batch, state) ->
(loss, new_state)`` (softmax cross entropy with label smoothing, the
examples' 0.1) for :class:`ipu_jax.pipelining.Pipeline` with
``mutable=True`` or ``jax.value_and_grad(..., has_aux=True)``;
:func:`stage_assignment` places units on the pipeline stages of the
examples' ``pipeline_splits``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import ipu_jax

__all__ = ["ResNetConfig", "ResNet", "FusedBatchNorm", "fused_batch_norm", "resnet50",
           "tiny_resnet", "make_loss",
           "stage_assignment", "unit_names", "synthetic_batches"]


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  """A ResNet's sizes.

  Attributes:
    units: bottleneck units of each stage (ResNet-50: 3, 4, 6, 3).
    width: channels of the stem and of stage 1's bottleneck (64); stage s
      has ``width x 2^(s-1)`` and puts out 4x that.
    classes: outputs of the final dense layer.
    label_smoothing: of the cross entropy (the examples' 0.1).
    dtype: weights' and activations' dtype (the examples' precision 16.16:
      float16 both).
    fused_batch_norm: batch norm as the IPU runs TensorFlow's fused one
      (:class:`FusedBatchNorm`); False: Flax's ``nnx.BatchNorm``.
  """
  units: tuple = (3, 4, 6, 3)
  width: int = 64
  classes: int = 1000
  label_smoothing: float = 0.1
  dtype: object = jnp.float32
  fused_batch_norm: bool = True


def resnet50(dtype=jnp.float32) -> ResNetConfig:
  return ResNetConfig(dtype=dtype)


def tiny_resnet(dtype=jnp.float32) -> ResNetConfig:
  """Two stages of one unit each, width 4, 10 classes: a test-sized ResNet."""
  return ResNetConfig(units=(1, 1), width=4, classes=10, dtype=dtype)


def _conv(cin, cout, k, stride, dtype, rngs):
  return nnx.Conv(cin, cout, (k, k), strides=(stride, stride), padding="SAME",
                  use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)


def _channel_sums(*tensors):
  """Per-channel float32 sums of NHWC tensors (the statistics' accumulation)."""
  return [jnp.sum(t, axis=(0, 1, 2), dtype=jnp.float32) for t in tensors]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused_batch_norm(x, scale, bias, epsilon: float):
  """``(y, mean, var)``: training batch norm of NHWC ``x`` over N, H and W.

  As TensorFlow's ``tf.nn.fused_batch_norm`` on the IPU (popnn's
  ``batchNormalise`` / ``batchNormGradients``, what Graphcore's MLPerf
  ``Models/batch_norm.py`` calls): the statistics accumulate in float32, the
  whitening and its gradient run in ``x``'s dtype as one scale and offset a
  channel, and the backward keeps only ``x`` and the per-channel statistics.
  Flax's ``nnx.BatchNorm`` computes in float32 instead and its VJP keeps
  float32 copies of the activations (``x - mean``, ``x * scale``) alive from the
  recomputed forward to the backward: twice the float16 activation's bytes
  each. ``mean`` and ``var`` (biased, as Flax's) feed only the running
  averages; their cotangents are not propagated.
  """
  return _fused_forward(x, scale, bias, epsilon)[0]


def _fused_forward(x, scale, bias, epsilon):
  n = x.size // x.shape[-1]
  total, squares = _channel_sums(x, jnp.square(x.astype(jnp.float32)))
  mean = total / n
  var = jnp.maximum(squares / n - jnp.square(mean), 0.0)
  inv = jax.lax.rsqrt(var + epsilon)
  a = scale.astype(jnp.float32) * inv
  b = bias.astype(jnp.float32) - mean * a
  y = x * a.astype(x.dtype) + b.astype(x.dtype)
  return (y, mean, var), (x, mean, inv, scale, bias)


def _fused_backward(epsilon, residuals, cotangents):
  del epsilon  # in the residuals' inverse deviation
  x, mean, inv, scale, bias = residuals
  dy = cotangents[0]
  n = x.size // x.shape[-1]
  sum_dy, sum_dy_x = _channel_sums(dy, (dy * x).astype(jnp.float32))
  sum_dy_xhat = inv * (sum_dy_x - mean * sum_dy)  # d scale
  k = scale.astype(jnp.float32) * inv
  c_x = -k * inv * sum_dy_xhat / n
  c_0 = -k * sum_dy / n - c_x * mean
  dx = dy * k.astype(x.dtype) + x * c_x.astype(x.dtype) + c_0.astype(x.dtype)
  return dx, sum_dy_xhat.astype(scale.dtype), sum_dy.astype(bias.dtype)


fused_batch_norm.defvjp(_fused_forward, _fused_backward)


class FusedBatchNorm(nnx.BatchNorm):
  """``nnx.BatchNorm`` (same parameters and statistics) whose training call is
  :func:`fused_batch_norm`; with running averages it is Flax's."""

  def __call__(self, x, use_running_average=None, *, mask=None):
    running = self.use_running_average if use_running_average is None else use_running_average
    if running or mask is not None or self.axis not in (-1, x.ndim - 1):
      return super().__call__(x, use_running_average=use_running_average, mask=mask)
    y, mean, var = fused_batch_norm(x.astype(self.dtype or x.dtype), self.scale[...],
                                    self.bias[...], self.epsilon)
    self.mean[...] = jax.lax.stop_gradient(self.momentum * self.mean[...]
                                           + (1 - self.momentum) * mean)
    self.var[...] = jax.lax.stop_gradient(self.momentum * self.var[...]
                                          + (1 - self.momentum) * var)
    return y


def _norm(c, dtype, rngs, fused=True):
  # The examples' BN_decay 0.9 and resnet_base.py's norm(): epsilon 1e-5.
  cls = FusedBatchNorm if fused else nnx.BatchNorm
  return cls(c, momentum=0.9, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Bottleneck(nnx.Module):
  """1x1 -> 3x3 (stride here: v1.5) -> 1x1, each with batch norm; shortcut."""

  def __init__(self, cin: int, width: int, stride: int, dtype, rngs: nnx.Rngs,
               fused: bool = True):
    cout = 4 * width
    norm = lambda c: _norm(c, dtype, rngs, fused)
    self.conv1, self.bn1 = _conv(cin, width, 1, 1, dtype, rngs), norm(width)
    self.conv2, self.bn2 = _conv(width, width, 3, stride, dtype, rngs), norm(width)
    self.conv3, self.bn3 = _conv(width, cout, 1, 1, dtype, rngs), norm(cout)
    self.project = cin != cout or stride != 1
    if self.project:
      self.short = _conv(cin, cout, 1, stride, dtype, rngs)
      self.short_bn = norm(cout)

  def __call__(self, x, train: bool):
    h = jax.nn.relu(self.bn1(self.conv1(x), use_running_average=not train))
    h = jax.nn.relu(self.bn2(self.conv2(h), use_running_average=not train))
    h = self.bn3(self.conv3(h), use_running_average=not train)
    s = self.short_bn(self.short(x), use_running_average=not train) if self.project else x
    return jax.nn.relu(h + s)


class Stem(nnx.Module):
  def __init__(self, width: int, dtype, rngs: nnx.Rngs, fused: bool = True):
    self.conv, self.bn = _conv(3, width, 7, 2, dtype, rngs), _norm(width, dtype, rngs, fused)

  def __call__(self, x, train: bool):
    h = jax.nn.relu(self.bn(self.conv(x), use_running_average=not train))
    return nnx.max_pool(h, (3, 3), strides=(2, 2), padding="SAME")


class Head(nnx.Module):
  def __init__(self, cin: int, classes: int, dtype, rngs: nnx.Rngs):
    self.dense = nnx.Linear(cin, classes, dtype=dtype, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.dense(jnp.mean(x, axis=(1, 2)))


def unit_names(cfg: ResNetConfig) -> list:
  """The bottlenecks' attribute names in order: ``stage1_unit1``, ..."""
  return [f"stage{s + 1}_unit{u + 1}" for s, n in enumerate(cfg.units) for u in range(n)]


class ResNet(nnx.Module):
  """ResNet v1.5 (see the module docstring); ``model(images, train)`` -> logits."""

  def __init__(self, cfg: ResNetConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.stem = Stem(cfg.width, cfg.dtype, rngs, cfg.fused_batch_norm)
    cin = cfg.width
    for s, n in enumerate(cfg.units):
      width = cfg.width * 2 ** s
      for u in range(n):
        stride = 2 if (u == 0 and s > 0) else 1
        setattr(self, f"stage{s + 1}_unit{u + 1}",
                Bottleneck(cin, width, stride, cfg.dtype, rngs, cfg.fused_batch_norm))
        cin = 4 * width
    self.head = Head(cin, cfg.classes, cfg.dtype, rngs)

  def __call__(self, images, train: bool = True):
    h = self.stem(images.astype(self.cfg.dtype), train)
    for name in unit_names(self.cfg):
      h = getattr(self, name)(h, train)
    return self.head(h)


def make_loss(model: ResNet):
  """``(loss_fn, params, state)``: ``loss_fn(params, batch, state) -> (loss, new_state)``.

  ``state`` holds the batch norms' running statistics; the loss is the mean
  label-smoothed softmax cross entropy of the micro-batch, in float32. The
  model's calls open named scopes of their module paths, so
  :func:`stage_assignment` places them.
  """
  graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
  smoothing, classes = model.cfg.label_smoothing, model.cfg.classes

  def loss_fn(params, batch, state):
    # The statistics travel as a pure dict of arrays: the module's own
    # Variables must not leave the trace that updates them.
    current = jax.tree_util.tree_map(lambda v: v, stats)
    nnx.replace_by_pure_dict(current, state)
    module = nnx.merge(graphdef, params, current, rest)
    with ipu_jax.nnx_scopes.module_scopes(module):
      logits = module(batch["images"], train=True)
    labels = optax.smooth_labels(jax.nn.one_hot(batch["labels"], classes), smoothing)
    loss = jnp.mean(optax.softmax_cross_entropy(logits.astype(jnp.float32), labels))
    return loss, nnx.state(module, nnx.BatchStat).to_pure_dict()

  return loss_fn, params, stats.to_pure_dict()


def stage_assignment(cfg: ResNetConfig, splits: Sequence[str]) -> dict:
  """``{module path: stage}``: a new stage begins after each unit named in ``splits``.

  ``splits`` name units after their last ReLU as the v2.0 examples'
  ``pipeline_splits`` do (``stage1/unit1/relu``, or ``stage1_unit1``; v1.x's
  ``b1/0/relu`` is the same unit); the stem is on stage 0, the head on the
  last stage.

  Raises:
    ValueError: a split naming no unit of this model, or out of order.
  """
  names = unit_names(cfg)
  cut = []
  for split in splits:
    name = split.replace("/relu", "")
    old_style = re.fullmatch(r"b(\d+)/(\d+)", name)  # v1.x: unit counted from 0
    if old_style:
      name = f"stage{old_style[1]}/unit{int(old_style[2]) + 1}"
    name = name.replace("/", "_")
    if name not in names:
      raise ValueError(f"pipeline split {split!r} names no unit of this ResNet; valid units "
                       f"are {names}.")
    cut.append(names.index(name))
  if cut != sorted(set(cut)):
    raise ValueError(f"pipeline splits {list(splits)} must name distinct units in order.")
  assignment, stage = {"stem": 0}, 0
  for i, name in enumerate(names):
    assignment[name] = stage
    stage += i in cut
  assignment["head"] = stage
  return assignment


def synthetic_batches(cfg: ResNetConfig, num: int, micro_batch: int, image_size: int,
                      seed: int = 0) -> dict:
  """``num`` stacked micro-batches of random uint8 images (the examples'
  ``eight_bit_io``: images cross the host link as bytes) and int32 labels."""
  rng = np.random.default_rng(seed)
  return {"images": rng.integers(0, 256, (num, micro_batch, image_size, image_size, 3),
                                 dtype=np.uint8),
          "labels": rng.integers(0, cfg.classes, (num, micro_batch), dtype=np.int32)}
