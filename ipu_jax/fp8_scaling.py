"""Per-tensor FP8 scaling from amax (FP8-AMAX, Perez et al. 2023), for Flax.

"Training and inference of large language models using 8-bit floating point"
(Perez, Zhang, Briggs, Blake, Levy-Kramer, Balanca, Luschi, Barlow, Fitzgibbon,
2023) trains LLMs with every matmul in FP8: weights and activations in F143,
gradients in F152, each tensor cast with its own power-of-two scale computed
from its largest magnitude just before the cast, so its values use the
format's range:

    log2_scale = floor(log2(format_max / amax)) - margin,  clipped to [-32, 31]

This module gives:

* :func:`amax_log2_scale`: that rule;
* :func:`fp8_dense`: ``x @ W (+ b)`` with ``x`` and ``W`` cast to F143 by their
  own scales, the FP8 matmul (:func:`ipu_jax.ops.fp8_matmul`, fp32
  accumulation), and in the backward pass the output gradient cast to F152 by
  *its* amax scale for both gradient matmuls (``custom_vjp``);
* :class:`FP8Linear`: a drop-in for ``nnx.Linear`` doing :func:`fp8_dense`,
  which keeps an amax history and the last scales of its input and weight
  (``FP8Stats`` variables, state not parameters) for telemetry;
  :func:`fp8_linear_from` converts an existing ``nnx.Linear``;
* :func:`collect_telemetry` / :func:`plot_scales`: the histories of a model's
  FP8 layers and a plot of their scale distributions per tensor kind (the
  paper's figures, for the user's own model); the output gradients' amax
  comes back through :class:`FP8GradAmax` (:func:`apply_gradient_telemetry`).
  A report records them per step with
  ``report.add_number_format_telemetry(step, model=model)``
  (:class:`ipu_jax.report.NumberFormatTelemetry`).
"""

from __future__ import annotations

import functools


import jax
import jax.numpy as jnp
import numpy as np

from ipu_jax.kernels.number_formats import F143, F152, fp8_format
from ipu_jax.ops.fp8 import cast_to_fp8, fp8_matmul

__all__ = ["amax_log2_scale", "fp8_dense", "FP8Linear", "FP8Stats", "FP8GradAmax",
           "fp8_linear_from", "collect_telemetry", "apply_gradient_telemetry", "scale_of_amax",
           "plot_scales"]


def amax_log2_scale(x, fmt="F143", margin: int = 0):
  """The FP8-AMAX scale of ``x``: ``floor(log2(max / amax(x))) - margin``.

  An all-zero (or non-finite) tensor gets scale 0.
  """
  f = fp8_format(fmt)
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if x.size else jnp.float32(0)
  ok = jnp.isfinite(amax) & (amax > 0)
  raw = jnp.floor(jnp.log2(jnp.float32(f.max) / jnp.where(ok, amax, 1.0)))
  scale = jnp.where(ok, raw, 0.0).astype(jnp.int32) - margin
  return jnp.clip(scale, -32, 31)


def _matmul_fp8(a, b, fa, fb, margin, out_dtype):
  sa, sb = amax_log2_scale(a, fa, margin), amax_log2_scale(b, fb, margin)
  return fp8_matmul(cast_to_fp8(a, fa, sa), cast_to_fp8(b, fb, sb), sa, sb,
                    out_dtype=out_dtype), sa, sb


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x2, w, grad_amax, margin):
  del grad_amax  # only its cotangent matters: see _dense_bwd
  y, _, _ = _matmul_fp8(x2, w, F143, F143, margin, jnp.float32)
  return y


def _dense_fwd(x2, w, grad_amax, margin):
  return _dense(x2, w, grad_amax, margin), (x2, w, grad_amax)


def _dense_bwd(margin, res, g):
  x2, w, grad_amax = res
  # Gradients in F152 (more range), each operand with its own amax scale.
  dx, _, _ = _matmul_fp8(g, w.T, F152, F143, margin, jnp.float32)
  dw, _, _ = _matmul_fp8(x2.T, g, F143, F152, margin, jnp.float32)
  # The gradient amax is only known here; it leaves as the "gradient" of the
  # history (Flax's overwrite-with-gradient convention): the new history.
  amax = jnp.max(jnp.abs(g)).astype(jnp.float32) if g.size else jnp.float32(0)
  history = jnp.roll(grad_amax, -1).at[-1].set(amax)
  return dx.astype(x2.dtype), dw.astype(w.dtype), history


_dense.defvjp(_dense_fwd, _dense_bwd)


def fp8_dense(x, kernel, bias=None, margin: int = 0, grad_amax=None):
  """``x @ kernel + bias`` with FP8 matmuls and per-tensor amax scales.

  Args:
    x: ``[..., in]`` float array.
    kernel: ``[in, out]``.
    bias: ``[out]`` or None (added in float32).
    margin: extra headroom in powers of two (the paper uses 0).
    grad_amax: optional float32 ``[history]`` amax history of the output
      gradient. Its gradient is that history with the new amax appended
      (dropping the oldest): differentiate with respect to it and keep the
      result to record gradient amax (what :class:`FP8Linear` does through
      :class:`FP8GradAmax`).

  Returns:
    ``[..., out]`` in ``x``'s dtype.
  """
  lead = x.shape[:-1]
  history = (jnp.zeros((1,), jnp.float32) if grad_amax is None
             else jnp.asarray(grad_amax, jnp.float32).reshape(-1))
  y = _dense(x.reshape(-1, x.shape[-1]).astype(jnp.float32),
             kernel.astype(jnp.float32), history, int(margin))
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.reshape(lead + (kernel.shape[-1],)).astype(x.dtype)


def _nnx():
  from flax import nnx
  return nnx


try:
  from flax import nnx as _flax_nnx

  class FP8Stats(_flax_nnx.Variable):
    """Telemetry of an FP8 layer: amax history and last scale (not trained)."""

  class FP8GradAmax(_flax_nnx.Variable):
    """The output-gradient amax history of an :class:`FP8Linear` (not trained).

    Its *gradient* is its next value (the history with this step's gradient
    amax appended): a training step that differentiates with respect to
    ``FP8GradAmax`` variables too and writes those gradients back records the
    gradients' scales (:func:`apply_gradient_telemetry`). Left out of
    differentiation, it stays zero and telemetry has no gradients.
    """

  class FP8Linear(_flax_nnx.Module):
    """``nnx.Linear`` whose matmul runs in FP8 with per-tensor amax scales.

    Attributes:
      kernel, bias: as ``nnx.Linear``'s (float32 master weights).
      input_amax, weight_amax: ``FP8Stats`` ``[history]`` of the latest amax
        values (newest last), updated on every call.
      input_scale, weight_scale: ``FP8Stats`` the last log2 scales.
      grad_amax: ``FP8GradAmax`` ``[history]`` of the output gradient's amax,
        updated through its gradient (see :class:`FP8GradAmax`).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 history: int = 16, margin: int = 0, rngs=None, kernel=None, bias=None):
      nnx = _flax_nnx
      if kernel is None:
        init = nnx.initializers.lecun_normal()
        kernel = init(rngs.params(), (in_features, out_features), jnp.float32)
      self.kernel = nnx.Param(jnp.asarray(kernel))
      self.bias = (nnx.Param(jnp.zeros((out_features,), jnp.float32) if bias is None
                             else jnp.asarray(bias)) if use_bias else None)
      self.margin = int(margin)
      self.input_amax = FP8Stats(jnp.zeros((history,), jnp.float32))
      self.weight_amax = FP8Stats(jnp.zeros((history,), jnp.float32))
      self.input_scale = FP8Stats(jnp.zeros((), jnp.int32))
      self.weight_scale = FP8Stats(jnp.zeros((), jnp.int32))
      self.grad_amax = FP8GradAmax(jnp.zeros((history,), jnp.float32))

    def __call__(self, x):
      kernel = self.kernel[...]
      bias = self.bias[...] if self.bias is not None else None
      sx = jax.lax.stop_gradient(x)
      sw = jax.lax.stop_gradient(kernel)
      self.input_amax[...] = jnp.roll(self.input_amax[...], -1).at[-1].set(
          jnp.max(jnp.abs(sx)).astype(jnp.float32))
      self.weight_amax[...] = jnp.roll(self.weight_amax[...], -1).at[-1].set(
          jnp.max(jnp.abs(sw)).astype(jnp.float32))
      self.input_scale[...] = amax_log2_scale(sx, F143, self.margin)
      self.weight_scale[...] = amax_log2_scale(sw, F143, self.margin)
      return fp8_dense(x, kernel, bias, self.margin, grad_amax=self.grad_amax[...])

except ImportError:  # pragma: no cover - flax is a dependency of the training layer
  FP8Stats = FP8GradAmax = FP8Linear = None


def fp8_linear_from(linear, history: int = 16, margin: int = 0):
  """An :class:`FP8Linear` with the weights of an ``nnx.Linear``."""
  return FP8Linear(linear.in_features, linear.out_features, use_bias=linear.bias is not None,
                   history=history, margin=margin, kernel=linear.kernel[...],
                   bias=None if linear.bias is None else linear.bias[...])


_FIELDS = ("input_amax", "weight_amax", "input_scale", "weight_scale", "grad_amax")


def collect_telemetry(model) -> dict:
  """Each FP8 layer's amax histories and scales, by layer path.

  Args:
    model: an NNX module holding :class:`FP8Linear` layers, or an
      ``nnx.State`` of them (e.g. ``Model.state`` of ``ipu_jax.keras``).

  Returns:
    ``{layer path: {"input_amax", "weight_amax", "grad_amax" (histories,
    newest last), "input_scale", "weight_scale", "grad_scale"}}`` as NumPy
    arrays. ``grad_scale`` is the F152 scale of the newest gradient amax (the
    backward pass computes it and keeps nothing else); from a State, the
    layer's margin is read off its input scale.
  """
  nnx = _nnx()
  if isinstance(model, nnx.State):
    layers = {}
    for path, leaf in nnx.to_flat_state(model):
      if path and path[-1] in _FIELDS:
        layer = "/".join(str(p) for p in path[:-1]) or "<root>"
        layers.setdefault(layer, {})[path[-1]] = np.asarray(
            leaf.get_value() if hasattr(leaf, "get_value") else leaf)
    out = {}
    for name, fields in layers.items():
      if {"input_amax", "input_scale", "weight_amax", "weight_scale"} <= set(fields):
        # margin = the unclipped scale of the newest input amax - the recorded one.
        margin = int(scale_of_amax(fields["input_amax"][-1])) - int(fields["input_scale"])
        out[name] = _with_grad_scale(fields, margin if fields["input_amax"][-1] > 0 else 0)
    return out
  if not isinstance(model, nnx.Module):
    raise TypeError(f"collect_telemetry expects an nnx.Module or nnx.State, got "
                    f"{type(model).__name__}.")
  out = {}
  for path, module in nnx.iter_graph(model):
    if FP8Linear is not None and isinstance(module, FP8Linear):
      name = "/".join(str(p) for p in path) or "<root>"
      out[name] = _with_grad_scale({k: np.asarray(getattr(module, k)[...]) for k in _FIELDS},
                                   module.margin)
  return out


def _with_grad_scale(fields: dict, margin: int) -> dict:
  grad = fields.get("grad_amax")
  if grad is not None:
    fields["grad_scale"] = scale_of_amax(grad[-1] if np.size(grad) else 0.0, F152, margin)
  return fields


def apply_gradient_telemetry(state, grads):
  """``state`` with its :class:`FP8GradAmax` leaves replaced by their gradients.

  Args:
    state: an ``nnx.State`` holding ``FP8GradAmax`` variables (e.g. from
      ``nnx.split(model, nnx.Param, FP8GradAmax, ...)``).
    grads: the gradients of the loss with respect to ``state``.

  Returns:
    The new state: each gradient-amax history with this step's amax.
  """
  return jax.tree.map(lambda old, new: new.astype(old.dtype), state, grads)


def scale_of_amax(amax, fmt="F143", margin: int = 0) -> np.ndarray:
  """NumPy form of :func:`amax_log2_scale` for recorded amax values."""
  f = fp8_format(fmt)
  amax = np.asarray(amax, np.float64)
  ok = np.isfinite(amax) & (amax > 0)
  s = np.where(ok, np.floor(np.log2(f.max / np.where(ok, amax, 1.0))), 0) - margin
  return np.clip(s, -32, 31).astype(np.int32)


def plot_scales(records: dict, path: str, title: str = "FP8 per-tensor scales") -> str:
  """Histogram of log2 scales per tensor kind over recorded steps; writes a PNG.

  Args:
    records: ``{kind: [log2 scales ...]}``, e.g. ``{"weights": [...],
      "activations": [...], "gradients": [...]}``.
    path: the PNG to write.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  values = [np.asarray(v).ravel() for v in records.values() if np.size(v)]
  if values:
    lo, hi = int(min(v.min() for v in values)), int(max(v.max() for v in values))
    bins = np.arange(lo - 0.5, hi + 1.5)
    for kind, v in records.items():
      if np.size(v):
        ax.hist(np.asarray(v).ravel(), bins=bins, alpha=0.6, label=kind)
  ax.set_xlabel("log2 scale")
  ax.set_ylabel("tensors x steps")
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
