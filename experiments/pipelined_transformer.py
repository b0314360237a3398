r"""A transformer too big for one IPU at its settings, pipelined over 4 IPUs.

A pre-norm encoder (token and position embeddings, ``--layers`` layers of
self-attention and a GELU MLP, a linear read-out) in plain JAX, with one
``ipu_jax.ops.pipeline_stage`` mark per layer group so that stage k holds
layers of group k (the embeddings join stage 0, the read-out the last
stage). It learns the synthetic ``shift`` task (output t = input t - 1).

The runner first lowers one unpipelined training micro-step on a single IPU
of ``--tiles_per_ipu`` tiles and reports its OutOfMemoryError, then trains
the pipelined model (``--schedule``, ``--accumulation`` micro-batches per
step, optional ``--recomputation``) and writes the pipeline report
(``pipeline.json``, ``pipeline_trace.json``, ``pipeline_schedule.png``) and
each stage program's report to ``--report_dir``::

    python -m experiments.pipelined_transformer --report_dir reports/pipelined
"""

from __future__ import annotations

import os
import time

import numpy as np
from absl import app, flags

from experiments import entry

_FLAGS = flags.FLAGS
flags.DEFINE_integer("tiles_per_ipu", 16, "Tiles per IPU (small: a fast emulation).", lower_bound=1)
flags.DEFINE_integer("stages", 4, "Pipeline stages, one IPU each.", lower_bound=1)
flags.DEFINE_integer("layers", 4, "Encoder layers (a multiple of --stages).", lower_bound=1)
flags.DEFINE_integer("width", 192, "Model width.", lower_bound=1)
flags.DEFINE_integer("seq", 16, "Sequence length.", lower_bound=1)
flags.DEFINE_integer("vocab", 64, "Vocabulary.", lower_bound=1)
flags.DEFINE_integer("micro_batch", 2, "Samples per micro-batch.", lower_bound=1)
flags.DEFINE_integer("accumulation", 8, "Micro-batches per step (G).", lower_bound=1)
flags.DEFINE_enum("schedule", "Grouped", ["Grouped", "Interleaved", "Sequential"],
                  "Pipeline schedule.")
flags.DEFINE_boolean("recomputation", False, "Recompute stages in the backward pass.")
flags.DEFINE_integer("steps", 3, "Training steps.", lower_bound=1)
flags.DEFINE_float("learning_rate", 0.05, "SGD learning rate.")
flags.DEFINE_string("report_dir", None, "Where to write the reports.")


def init_params(rng, layers, width, vocab, seq):
  def dense(shape):
    return (rng.normal(size=shape) / np.sqrt(shape[0])).astype(np.float32)
  params = {"embed": dense((vocab, width)) * 4, "pos": dense((seq, width)),
            "out": dense((width, vocab))}
  for i in range(layers):
    params[f"layer{i}"] = {"qkv": dense((width, 3 * width)), "proj": dense((width, width)),
                           "up": dense((width, 2 * width)), "down": dense((2 * width, width))}
  return params


def make_loss(layers, stages, heads=4):
  import jax
  import jax.numpy as jnp
  from ipu_jax.ops import pipeline_stage, recomputation_checkpoint

  def norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

  def layer(p, x):
    b, s, w = x.shape
    q, k, v = jnp.split(norm(x) @ p["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(b, s, heads, w // heads).transpose(0, 2, 1, 3)
    att = jax.nn.softmax(split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(w // heads))
    x = x + (att @ split(v)).transpose(0, 2, 1, 3).reshape(b, s, w) @ p["proj"]
    x = recomputation_checkpoint(x)
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]

  per_stage = layers // stages

  def loss(params, batch):
    x = params["embed"][batch["x"]] + params["pos"]
    for i in range(layers):
      if i and i % per_stage == 0:
        x = pipeline_stage(x, i // per_stage)
      x = layer(params[f"layer{i}"], x)
    logits = norm(x) @ params["out"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))

  return loss


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  import jax
  import jax.numpy as jnp
  import optax
  import ipu_jax

  f = _FLAGS
  if f.layers % f.stages:
    raise app.UsageError(f"--layers={f.layers} must be a multiple of --stages={f.stages}.")
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(jnp.asarray, init_params(rng, f.layers, f.width, f.vocab,
                                                           f.seq))
  loss = make_loss(f.layers, f.stages)

  def batches(step):
    r = np.random.default_rng(step)
    x = r.integers(1, f.vocab, size=(f.accumulation, f.micro_batch, f.seq)).astype(np.int32)
    y = np.concatenate([np.zeros_like(x[..., :1]), x[..., :-1]], axis=-1)
    return {"x": jnp.asarray(x), "y": jnp.asarray(y)}

  one = ipu_jax.IPUConfig()
  one.device.tiles_per_ipu = f.tiles_per_ipu
  micro = jax.tree_util.tree_map(lambda b: b[0], batches(0))
  try:
    ipu_jax.jit(jax.grad(loss), config=one).lower(params, micro)
    print("Unpipelined micro-step fits one IPU.")
  except ipu_jax.OutOfMemoryError as e:
    print(f"Unpipelined micro-step on one IPU: OutOfMemoryError ({e.bytes_needed:,d} B needed "
          f"on tile {e.tile}, {e.bytes_available:,d} B available).")

  cfg = ipu_jax.IPUConfig()
  cfg.device.tiles_per_ipu = f.tiles_per_ipu
  cfg.auto_select_ipus = f.stages
  cfg.training.gradient_accumulation_steps = f.accumulation
  cfg.training.gradient_accumulation_reduction = "mean"
  cfg.pipelining.schedule = f.schedule
  cfg.pipelining.recomputation = f.recomputation
  pipe = ipu_jax.pipelining.Pipeline(loss, optax.sgd(f.learning_rate), config=cfg)
  state = pipe.init(params, batches(0))
  for step in range(f.steps):
    start = time.time()
    out = pipe.step(params, state, batches(step))
    params, state, value = out.params, out.opt_state, out.loss
    print(f"step {step}: loss {float(value):.4f} ({time.time() - start:.1f} s on the host)")
  print(pipe.report.summary())
  if f.recomputation:
    # Less than 1: the segments' output matmuls and residual adds are not rerun.
    ratios = [s.recompute_cycles / s.forward.profile.total_cycles for s in pipe.stages]
    print("recompute / forward cycles per stage: " + ", ".join(f"{r:.2f}" for r in ratios)
          + " (docs/multi_ipu.md#what-is-recomputed)")
  if f.report_dir:
    pipe.report.save(f.report_dir)
    for name, report in pipe.report.stage_reports.items():
      report.save(os.path.join(f.report_dir, name.replace("/", "_")))
    print(f"Reports written to {f.report_dir}")


if __name__ == "__main__":
  app.run(main)
