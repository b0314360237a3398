r"""Does a tiny language model still train in fp16 / FP8 on the IPU, and what does it save?

A one-layer causal transformer LM (vocabulary 64, width 32, 4 heads, sequences
of 16) learns next-token prediction on synthetic arithmetic sequences
(``x[t+1] = x[t] + step mod V``, a random start and step per sequence: the
model must attend to earlier tokens to find the step). The same steps of SGD
from the same initial weights run in four number formats, each compiled with
``ipu_jax.jit`` for the ``ipu21`` target (the C600's Mk2 IPU with FP8 units):

* ``fp32``: float32 weights and arithmetic;
* ``fp16``: float16 weights, activations and gradients, dynamic loss scaling
  (``LossScaleOptimizer``), round to nearest;
* ``fp16+SR``: the same with ``floating_point_behaviour.esr = "ON"``: every
  fp16 rounding (weight updates included) stochastic;
* ``fp8``: float32 master weights, every dense layer's matmul in FP8 with
  per-tensor amax scales (``FP8Linear``: F143 forward, F152 gradients).

Prints a table (final loss, cycles per step, peak memory per tile), plots the
loss curves side by side and the FP8 scale distributions::

    python -m experiments.low_precision --steps 60 --out_dir reports/low_precision
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _define(define, name, default, help_text):
  # The shared runner flags (experiments/common.py) may already be defined
  # in this process; then theirs are used and None means this runner's default.
  if name not in flags.FLAGS:
    define(name, default, help_text)


_define(flags.DEFINE_integer, "steps", 60, "SGD steps per variant.")
_define(flags.DEFINE_integer, "batch_size", 16, "Sequences per step.")
_define(flags.DEFINE_float, "learning_rate", 0.05,
        "SGD learning rate (small updates stall fp16 without stochastic rounding).")
_define(flags.DEFINE_integer, "tiles_per_ipu", 64, "Tiles of the emulated ipu21.")
_define(flags.DEFINE_string, "out_dir", "reports/low_precision", "Where the plots and JSON go.")
_define(flags.DEFINE_list, "variants", "fp32,fp16,fp16+SR,fp8", "Variants to run.")

VOCAB, WIDTH, HEADS, SEQ = 64, 32, 4, 16
VARIANTS = ("fp32", "fp16", "fp16+SR", "fp8")


def make_data(num: int, seed: int = 0):
  """Arithmetic sequences mod VOCAB: inputs x[:-1], targets x[1:]."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, size=(num, 1))
  step = rng.integers(1, 8, size=(num, 1))
  seq = (start + step * np.arange(SEQ + 1)[None]) % VOCAB
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def make_model(fp8: bool, seed: int = 0):
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from ipu_jax.fp8_scaling import FP8Linear

  def dense(i, o, rngs):
    return FP8Linear(i, o, rngs=rngs) if fp8 else nnx.Linear(i, o, rngs=rngs)

  class LM(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
      self.position = nnx.Param(jax.random.normal(rngs.params(), (SEQ, WIDTH)) * 0.02)
      self.norm1 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.qkv = dense(WIDTH, 3 * WIDTH, rngs)
      self.proj = dense(WIDTH, WIDTH, rngs)
      self.norm2 = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.mlp_in = dense(WIDTH, 4 * WIDTH, rngs)
      self.mlp_out = dense(4 * WIDTH, WIDTH, rngs)
      self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
      self.head = dense(WIDTH, VOCAB, rngs)

    def __call__(self, tokens):
      b, t = tokens.shape
      x = self.embed(tokens) + self.position[...][None, :t].astype(self.embed.embedding.dtype)
      q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
      heads = lambda a: a.reshape(b, t, HEADS, WIDTH // HEADS)
      scores = jnp.einsum("bqhd,bkhd->bhqk", heads(q), heads(k)) / np.sqrt(WIDTH // HEADS)
      mask = np.tril(np.ones((t, t), bool))
      scores = jnp.where(mask, scores.astype(jnp.float32), -1e9)
      attn = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
      ctx = jnp.einsum("bhqk,bkhd->bqhd", attn, heads(v)).reshape(b, t, WIDTH)
      x = x + self.proj(ctx)
      x = x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(x))))
      return self.head(self.norm(x))

  return LM(nnx.Rngs(seed))


def run_variant(variant: str, data, steps: int, batch: int, lr: float, tiles: int) -> dict:
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  import ipu_jax
  from ipu_jax.fp8_scaling import FP8Stats, collect_telemetry
  from ipu_jax.keras.loss_scaling import LossScaleOptimizer, scaling_logs

  half = variant.startswith("fp16")
  model = make_model(fp8=variant == "fp8")
  graphdef, params, stats = nnx.split(model, nnx.Param, ...)
  if half:
    params = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  opt = optax.sgd(lr)
  if half:
    opt = LossScaleOptimizer(opt, 2.0 ** 12, dynamic=True, growth_steps=20)
  opt_state = opt.init(params)

  def step(params, stats, opt_state, x, y):
    scale = getattr(opt_state, "loss_scale", None)

    def loss_fn(p):
      m = nnx.merge(graphdef, p, stats, copy=True)
      logits = m(x).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      scaled = loss * scale if scale is not None else loss
      return scaled.astype(jnp.float16 if half else jnp.float32), (loss, nnx.state(m, FP8Stats))

    (_, (loss, new_stats)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    stats = nnx.merge_state(stats, new_stats) if jax.tree.leaves(new_stats) else stats
    return params, stats, opt_state, loss

  cfg = ipu_jax.IPUConfig()
  cfg.device.version = "ipu21"
  cfg.device.tiles_per_ipu = tiles
  if variant == "fp16+SR":
    cfg.floating_point_behaviour.esr = "ON"
  xs, ys = data
  fn = ipu_jax.jit(step, config=cfg)
  start = time.perf_counter()
  lowered = fn.lower(params, stats, opt_state, xs[:batch], ys[:batch])
  compile_s = time.perf_counter() - start
  losses, scales = [], {"weights": [], "activations": []}
  start = time.perf_counter()
  for i in range(steps):
    lo = (i * batch) % (len(xs) - batch)
    params, stats, opt_state, loss = lowered(params, stats, opt_state,
                                             xs[lo:lo + batch], ys[lo:lo + batch])
    losses.append(float(loss))
    if variant == "fp8":
      nnx.update(model, stats)
      for t in collect_telemetry(model).values():
        scales["activations"].append(int(t["input_scale"]))
        scales["weights"].append(int(t["weight_scale"]))
  run_s = time.perf_counter() - start
  report = lowered.report
  out = {"variant": variant, "losses": losses, "final_loss": float(np.mean(losses[-5:])),
         "cycles_per_step": float(report.total_cycles),
         "peak_bytes_per_tile": int(np.max(report.memory_per_tile)),
         "compile_seconds": compile_s, "run_seconds": run_s}
  out.update(scaling_logs(opt_state))
  if variant == "fp8":
    out["fp8_scales"] = scales
  return out


def plot(results, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for r in results:
    ax.plot(r["losses"], label=r["variant"])
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title("Tiny LM on ipu21: number formats")
  ax.legend()
  fig.tight_layout()
  path = os.path.join(out_dir, "loss_curves.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def main(argv):
  del argv
  f = flags.FLAGS
  os.makedirs(f.out_dir, exist_ok=True)
  for v in f.variants:
    if v not in VARIANTS:
      raise app.UsageError(f"--variants: unknown {v!r}; valid: {', '.join(VARIANTS)}")
  batch, lr, tiles = f.batch_size or 16, f.learning_rate or 0.05, f.tiles_per_ipu or 64
  data = make_data(max(f.steps * batch, 256))
  results = []
  for v in f.variants:
    print(f"-- {v}", flush=True)
    results.append(run_variant(v, data, f.steps, batch, lr, tiles))
  print(f"\n| variant | loss (first) | loss (last 5) | cycles/step | peak bytes/tile |"
        f" loss scale | skipped |")
  print("|---|---|---|---|---|---|---|")
  for r in results:
    print(f"| {r['variant']} | {r['losses'][0]:.3f} | {r['final_loss']:.3f} | "
          f"{r['cycles_per_step']:,.0f} | {r['peak_bytes_per_tile']:,} | "
          f"{r.get('loss_scale', '-')} | {r.get('skipped_steps', '-')} |")
  paths = [plot(results, f.out_dir)]
  fp8 = [r for r in results if "fp8_scales" in r]
  if fp8:
    from ipu_jax.fp8_scaling import plot_scales
    paths.append(plot_scales(fp8[0]["fp8_scales"], os.path.join(f.out_dir, "fp8_scales.png")))
  with open(os.path.join(f.out_dir, "results.json"), "w") as fh:
    json.dump(results, fh, indent=1)
  print("wrote", ", ".join(paths))


if __name__ == "__main__":
  app.run(main)
