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

fp32, fp16 and fp16+SR run a second time at ``--small_learning_rate``
(0.002, for ``--small_steps``, 600), where most SGD updates are below half
an fp16 ulp of their weight:
round-to-nearest drops them (the weight never moves), stochastic rounding
keeps them in expectation. Prints a table (final loss, the share of weights
that end where they started, cycles per step, peak memory per tile, loss scale), plots
the loss curves (one panel per learning rate) and the FP8 run's scale
distributions (weights, activations, gradients; from its report), and saves
every run's report with its number-format telemetry::

    python -m experiments.low_precision --steps 60 --out_dir reports/low_precision
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
from absl import app, flags

if __package__ in (None, ""):
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import entry  # noqa: E402


def _define(define, name, default, help_text, **kwargs):
  # The shared runner flags (experiments/common.py) may already be defined
  # in this process; then theirs are used and None means this runner's default.
  if name not in flags.FLAGS:
    define(name, default, help_text, **kwargs)


_define(flags.DEFINE_integer, "steps", 60, "SGD steps of every variant at --learning_rate.",
        lower_bound=1)
_define(flags.DEFINE_integer, "batch_size", 16, "Sequences per step.", lower_bound=1)
_define(flags.DEFINE_float, "learning_rate", 0.05, "SGD learning rate of every variant.")
_define(flags.DEFINE_float, "small_learning_rate", 0.002,
        "A second run of fp32 / fp16 / fp16+SR at this learning rate, where most updates are "
        "below half an fp16 ulp of their weight (0 skips it).")
_define(flags.DEFINE_integer, "small_steps", 600,
        "SGD steps of the small-learning-rate run (its progress per step is small).",
        lower_bound=1)
_define(flags.DEFINE_integer, "tiles_per_ipu", 64, "Tiles of the emulated ipu21.", lower_bound=1)
_define(flags.DEFINE_string, "out_dir", "reports/low_precision",
        "Where the plots, JSON and each run's report go.")
_define(flags.DEFINE_list, "variants", "fp32,fp16,fp16+SR,fp8", "Variants to run.")

VOCAB, WIDTH, HEADS, SEQ = 64, 32, 4, 16
VARIANTS = ("fp32", "fp16", "fp16+SR", "fp8")
# What the small-learning-rate run compares: round-to-nearest fp16 against
# stochastic rounding, with fp32 as the reference.
SMALL_UPDATE_VARIANTS = ("fp32", "fp16", "fp16+SR")


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


@dataclasses.dataclass
class _Variant:
  """One number format's model, split for a pure training step."""

  name: str
  model: object      # the NNX model (FP8 telemetry is read back into it)
  graphdef: object
  params: object     # initial weights (fp16 for the fp16 variants)
  probes: object     # FP8 gradient amax probes
  stats: object      # FP8 per-tensor statistics

  @property
  def half(self) -> bool:
    return self.name.startswith("fp16")


def _variant(name: str) -> _Variant:
  """The model of variant ``name`` from the shared seed, its weights cast as the variant keeps them."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from ipu_jax.fp8_scaling import FP8GradAmax

  model = make_model(fp8=name == "fp8")
  graphdef, params, probes, stats = nnx.split(model, nnx.Param, FP8GradAmax, ...)
  if name.startswith("fp16"):
    params = jax.tree.map(lambda p: p.astype(jnp.float16), params)
  return _Variant(name, model, graphdef, params, probes, stats)


def _optimizer(v: _Variant, lr):
  """SGD; the fp16 variants under dynamic loss scaling (Keras's defaults but the start)."""
  import optax
  from ipu_jax.keras.loss_scaling import LossScaleOptimizer
  opt = optax.sgd(lr)
  return LossScaleOptimizer(opt, 2.0 ** 12, dynamic=True, growth_steps=20) if v.half else opt


def _training_step(v: _Variant):
  """The pure step ``(params, probes, stats, opt_state, x, y, lr) -> (..., loss)``."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  from ipu_jax.fp8_scaling import FP8Stats, apply_gradient_telemetry

  def step(params, probes, stats, opt_state, x, y, lr):
    scale = getattr(opt_state, "loss_scale", None)
    # fp16 weights take fp16 updates: -lr * g rounds to fp16, then w + u does.
    lr = lr.astype(jnp.float16) if v.half else lr

    def loss_fn(p, probes):
      m = nnx.merge(v.graphdef, p, probes, stats, copy=True)
      logits = m(x).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      scaled = loss * scale if scale is not None else loss
      return scaled.astype(jnp.float16 if v.half else jnp.float32), (loss, nnx.state(m, FP8Stats))

    (_, (loss, new_stats)), (grads, probe_grads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, probes)
    updates, opt_state = _optimizer(v, lr).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    stats = nnx.merge_state(stats, new_stats) if jax.tree.leaves(new_stats) else stats
    return params, apply_gradient_telemetry(probes, probe_grads), stats, opt_state, loss

  return step


def _config(v: _Variant, tiles: int):
  import ipu_jax
  cfg = ipu_jax.IPUConfig()
  cfg.device.version = "ipu21"
  cfg.device.tiles_per_ipu = tiles
  if v.name == "fp16+SR":
    cfg.floating_point_behaviour.esr = "ON"
  return cfg


def _train(v: _Variant, lowered, opt_state, data, batch: int, lr: float, steps: int):
  """``steps`` steps at ``lr`` from the initial weights: (params, opt_state, losses, telemetry)."""
  import ipu_jax
  from flax import nnx
  xs, ys = data
  params, probes, stats = v.params, v.probes, v.stats
  telemetry = ipu_jax.NumberFormatTelemetry()
  losses = []
  for i in range(steps):
    lo = (i * batch) % (len(xs) - batch)
    params, probes, stats, opt_state, loss = lowered(
        params, probes, stats, opt_state, xs[lo:lo + batch], ys[lo:lo + batch], np.float32(lr))
    losses.append(float(loss))
    if v.name == "fp8":
      nnx.update(v.model, probes, stats)
      telemetry.record(i + 1, model=v.model)
    telemetry.record(i + 1, opt_state=opt_state)
  return params, opt_state, losses, telemetry


def _unchanged_share(params, initial) -> float:
  """The share of weights that end exactly where they started."""
  import jax
  before = jax.tree.leaves(initial)
  same = sum(int(np.sum(np.asarray(w) == np.asarray(w0)))
             for w, w0 in zip(jax.tree.leaves(params), before))
  return same / sum(np.size(w0) for w0 in before)


def run_variant(variant: str, data, runs, batch: int, tiles: int, out_dir: str) -> list:
  """Trains ``variant`` from the same initial weights once per ``(learning rate, steps)``.

  The learning rate is an argument of the compiled step, so one tile program
  serves every rate. Each run's report (with its number-format telemetry:
  the loss scale of the fp16 variants, every FP8 tensor's scale and amax,
  gradients included) is saved to ``out_dir/reports/<variant>-lr<rate>``.

  Args:
    variant: one of VARIANTS.
    data: ``(inputs, targets)`` from :func:`make_data`; steps cycle through it.
    runs: ``[(learning_rate, steps), ...]``.
    batch: sequences per step.
    tiles: tiles of the emulated ipu21.
    out_dir: where the reports go.

  Returns:
    One dict per run: losses, cycles and memory per step, the
    share of weights that end where they started (``weights_unchanged``),
    the report path and telemetry.
  """
  import ipu_jax
  from ipu_jax.keras.loss_scaling import scaling_logs

  v = _variant(variant)
  xs, ys = data
  opt_state0 = _optimizer(v, runs[0][0]).init(v.params)
  start = time.perf_counter()
  lowered = ipu_jax.jit(_training_step(v), config=_config(v, tiles)).lower(
      v.params, v.probes, v.stats, opt_state0, xs[:batch], ys[:batch], np.float32(runs[0][0]))
  compile_s = time.perf_counter() - start
  report = lowered.report
  results = []
  for lr, steps in runs:
    start = time.perf_counter()
    params, opt_state, losses, telemetry = _train(v, lowered, opt_state0, data, batch, lr, steps)
    run_s = time.perf_counter() - start
    report.number_formats = telemetry
    report_dir = os.path.join(out_dir, "reports", f"{variant}-lr{lr:g}")
    report.save(report_dir)
    out = {"variant": variant, "learning_rate": lr, "losses": losses,
           "final_loss": float(np.mean(losses[-5:])),
           "loss_drop": float(np.mean(losses[:5]) - np.mean(losses[-5:])),
           "weights_unchanged": _unchanged_share(params, v.params),
           "cycles_per_step": float(report.total_cycles),
           "peak_bytes_per_tile": int(np.max(report.memory_per_tile)),
           "compile_seconds": compile_s, "run_seconds": run_s,
           "report": report_dir, "number_formats": telemetry.to_json()}
    out.update(scaling_logs(opt_state))
    results.append(out)
  return results


COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def plot(results, out_dir):
  """loss_curves.png: one panel per learning rate, the variants side by side."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rates = sorted({r["learning_rate"] for r in results}, reverse=True)
  fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 3.8), squeeze=False)
  for ax, lr in zip(axes[0], rates):
    for r, colour in zip([r for r in results if r["learning_rate"] == lr], COLOURS):
      losses, label = np.asarray(r["losses"]), (f"{r['variant']} ({100 * r['weights_unchanged']:.0f}"
                                                 "% of weights unchanged)")
      steps = np.arange(1, len(losses) + 1)
      if len(losses) > 100:
        # Each step's batch loss is noisy against a slow trend: a thin line
        # for the steps, the mean of the last 20 on top.
        ax.plot(steps, losses, lw=0.5, alpha=0.3, color=colour)
        window = np.ones(20) / 20
        ax.plot(steps[19:], np.convolve(losses, window, mode="valid"), lw=1.5, color=colour,
                label=label + ", mean of 20 steps")
      else:
        ax.plot(steps, losses, lw=1.2, color=colour, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Tiny LM on ipu21, SGD lr {lr:g}")
    ax.legend(fontsize=8)
  fig.tight_layout()
  path = os.path.join(out_dir, "loss_curves.png")
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  f = flags.FLAGS
  os.makedirs(f.out_dir, exist_ok=True)
  for v in f.variants:
    if v not in VARIANTS:
      raise app.UsageError(f"--variants: unknown {v!r}; valid: {', '.join(VARIANTS)}")
  if f.small_learning_rate is not None and f.small_learning_rate < 0:
    raise app.UsageError(f"--small_learning_rate must be >= 0, got {f.small_learning_rate}")
  batch, lr, tiles = f.batch_size or 16, f.learning_rate or 0.05, f.tiles_per_ipu or 64
  small = 0.002 if f.small_learning_rate is None else f.small_learning_rate
  small_steps = f.small_steps or 600
  data = make_data(max(f.steps * batch, 256))
  results = []
  for v in f.variants:
    runs = [(lr, f.steps)] + ([(small, small_steps)] if small and v in SMALL_UPDATE_VARIANTS
                              else [])
    print(f"-- {v}: " + ", ".join(f"{s} steps at lr {r:g}" for r, s in runs), flush=True)
    results += run_variant(v, data, runs, batch, tiles, f.out_dir)
  print("\n| variant | lr | steps | loss (first) | loss (last 5) | weights unchanged | cycles/step |"
        " peak bytes/tile | loss scale | skipped |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in sorted(results, key=lambda r: -r["learning_rate"]):
    print(f"| {r['variant']} | {r['learning_rate']:g} | {len(r['losses'])} | {r['losses'][0]:.3f} | "
          f"{r['final_loss']:.3f} | {100 * r['weights_unchanged']:.1f}% | "
          f"{r['cycles_per_step']:,.0f} | {r['peak_bytes_per_tile']:,} | "
          f"{r.get('loss_scale', '-')} | {r.get('skipped_steps', '-')} |")
  paths = [plot(results, f.out_dir)]
  fp8 = [r for r in results if r["variant"] == "fp8"]
  if fp8:
    # The report's own figure of the FP8 run: Perez et al.'s scale distributions.
    from ipu_jax.report.precision import NUMBER_FORMATS_PLOT_FILE
    import shutil
    paths.append(shutil.copyfile(os.path.join(fp8[0]["report"], NUMBER_FORMATS_PLOT_FILE),
                                 os.path.join(f.out_dir, "fp8_scales.png")))
  with open(os.path.join(f.out_dir, "results.json"), "w") as fh:
    json.dump(results, fh, indent=1)
  print("wrote", ", ".join(paths), "and each run's report under",
        os.path.join(f.out_dir, "reports"))


if __name__ == "__main__":
  app.run(main)
