r"""One BERT encoder layer's cycles, part by part: forward alone and forward + backward.

Lowers ``experiments.bert.EncoderLayer`` (the sum of its output, in float32,
as the loss; ``jax.grad`` over the parameters and the input) and groups the
profile's steps by the layer's parts: the QKV, attention output and FFN
in / out products (each with its bias and bias gradient), the attention
scores (scale and mask included) and context products, softmax, layer norm,
GELU, residual adds (and the backward's cotangent sums outside a part),
dropout, casts / copies (dtype casts, the heads' transposes, splits), the
loss's own steps, other. A step's part comes from its scopes (the module
paths ``ipu_jax.nnx_scopes`` opens, and ``experiments.bert``'s
``scores`` / ``softmax`` / ``context`` scopes), then its primitive; a fused
compute set counts under the part most of its members belong to (the later
member's on a tie: the chain's result). Forward and backward steps are told
apart by the ``loss`` scope (its backward is ``loss/grad``,
``ipu_jax.lowering.scopes``).

For a matmul in one pass, poplin's own ``ConvPartial1x1`` estimate of the
tile's block (``experiments.poplibs_reference.poplibs_amp_matmul_cycles``,
float32 or half partials as the pass's vertex says, on the units poplin takes
for them) stands beside the busiest tile's compute cycles, and the text
output sums them. The defaults are docs/calibration.md's settings
(BERT-Large, float16 ``[3, 512, 1024]``, 1,472 Bow tiles, proportion 1.0,
half partials); the second example is a 2-head width-64 layer on 16 tiles,
float32 partials::

    python -m experiments.layer_costs --json_out layer_costs.json
    python -m experiments.layer_costs --hidden 64 --heads 2 --ffn 256 --seq 32 --micro_batch 1 --tiles_per_ipu 16 --partials float32

JSON (``"schema": "ipu-jax-layer-costs", "version": 1``): ``settings``,
``cost_model``, and per program (``forward``, ``forward_backward``)
``total_cycles``, ``peak_tile_bytes``, ``lower_seconds`` and ``passes``:
per pass (``forward`` / ``backward``) per part ``cycles`` and ``steps``
(per step name its ``cycles`` and ``count``; matmul passes their
``poplin_reference`` rows: ``block``, ``partials_bytes``, ``conv_units``,
``estimate_compute_cycles``, ``poplin_cycles``, ``step``).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import sys
import time
from typing import Optional

from absl import app, flags

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import entry  # noqa: E402

SCHEMA = {"schema": "ipu-jax-layer-costs", "version": 1}
LOSS_SCOPE = "loss"
GRADIENT = "grad"
_CASTS = ("convert_element_type", "transpose", "reshape", "broadcast_in_dim", "copy", "split",
          "concatenate", "squeeze", "slice", "expand_dims")


@dataclasses.dataclass(frozen=True)
class Part:
  """One part of the layer and how its steps are recognised.

  Attributes:
    name: the part's key in the output.
    scopes: scope names (module paths' components) whose steps belong to it.
    ops: primitives whose steps belong to it, in any scope no earlier part
      claimed.
  """

  name: str
  scopes: tuple = ()
  ops: tuple = ()

  def claims(self, components: frozenset, op: str) -> bool:
    """Whether an operation of these scope names and this primitive is this part's."""
    return bool(components.intersection(self.scopes)) or any(op.startswith(o) for o in self.ops)


# In order: the first part that claims a step gets it.
PARTS = (
    Part("loss"),  # steps scoped "loss" or "loss/grad" alone: the loss's sum and seed
    Part("dropout", scopes=("dropout", "attention_dropout")),
    Part("qkv_matmul", scopes=("qkv",)),
    Part("attention_output_matmul", scopes=("attention_out",)),
    Part("ffn_in_matmul", scopes=("ffn_in",)),
    Part("ffn_out_matmul", scopes=("ffn_out",)),
    Part("layer_norm", scopes=("attention_norm", "ffn_norm")),
    Part("softmax", scopes=("softmax",), ops=("ipu_softmax",)),
    Part("gelu", ops=("ipu_gelu",)),
    Part("attention_scores", scopes=("scores",)),
    Part("attention_context", scopes=("context",)),
    Part("residual_adds", ops=("add",)),  # add and add_any (cotangent sums)
    Part("casts_copies", ops=_CASTS),
    Part("other"),
)
PART_NAMES = tuple(p.name for p in PARTS)


def _components(scope: str) -> frozenset:
  return frozenset(c for c in (scope or "").split("/") if c)


def part_of(scope: str, op: str) -> str:
  """The part of one operation, from its module path and primitive."""
  if scope in (LOSS_SCOPE, f"{LOSS_SCOPE}/{GRADIENT}"):
    return "loss"
  components = _components(scope)
  for part in PARTS[1:-1]:
    if part.claims(components, op):
      return part.name
  return "other"


def step_part(step) -> str:
  """A step's part; a fused compute set's is its members' most common (later on a tie)."""
  if not step.fused_ops:
    return part_of(step.scope, step.op)
  members = [part_of(m.scope, m.op) for m in step.fused_ops]
  votes = collections.Counter(members)
  last = {part: i for i, part in enumerate(members)}
  return max(votes, key=lambda p: (votes[p], last[p]))


def pass_of(scope: str) -> str:
  """``"backward"`` for a step under ``loss/grad``, else ``"forward"``."""
  parts = (scope or "").split("/")
  return "backward" if parts[:2] == [LOSS_SCOPE, GRADIENT] else "forward"


# The block (bb, bm, bn, bk) is in the plan's label at the end of the step's
# name (``lowering.matmul_plan.MatmulPlan.label``): neither the step nor its
# profile carries it in a field of its own.
_BLOCKS = re.compile(r"blocks (\d+)x(\d+)x(\d+)x(\d+)$")


def _partials_itemsize(step) -> Optional[int]:
  """Bytes of a matmul pass's partials, from its vertex type.

  The pass runs ``vertex(MATMUL_BLOCK, operand dtype, partials dtype)``
  (``kernels.vocabulary``): its second template argument is the partials
  type the lowering chose (``lowering.matmul_plan.partials_dtype``), which
  is float32 for a product with a float32 result whatever ``--partials``
  says.
  """
  import jax.numpy as jnp
  from ipu_jax.kernels import vocabulary as vocab
  prefix = vocab.MATMUL_BLOCK + "<"
  for codelet in step.codelets:
    if codelet.startswith(prefix) and codelet.endswith(">"):
      return jnp.dtype(codelet[len(prefix):-1].split(",")[-1]).itemsize
  return None


def poplin_reference(step, target) -> Optional[dict]:
  """poplin's ConvPartial1x1 estimate beside a matmul pass's busiest tile, where it applies.

  The block is read from the plan's label in the step's name, the partials
  type from its vertex; the reference covers one-pass plans with float32 or
  half partials (serial passes and tree reductions have none), with the
  units poplin's planner takes for them (``kernels.amp.amp_geometry``:
  IPU2's 8 half-float, 16 half-half).
  """
  import jax.numpy as jnp
  from experiments.poplibs_reference import poplibs_amp_matmul_cycles
  from ipu_jax.kernels.amp import amp_geometry
  match = _BLOCKS.search(step.name)
  partials_itemsize = _partials_itemsize(step)
  if step.op != "dot_general" or match is None or partials_itemsize is None:
    return None
  bb, bm, bn, bk = (int(g) for g in match.groups())
  itemsize = jnp.dtype(step.flops_dtype).itemsize if step.flops_dtype else 4
  units = amp_geometry(target, itemsize, partials_itemsize).conv_units
  float_partials = partials_itemsize >= 4
  # A batched block is bb products of their own operands: conv groups of one
  # vertex (PE's numConvGroups); poplin's planner may swap the operands
  # (ConvTransform::swapOperands), so the cheaper orientation, as the
  # emulator's kernels/amp.py takes.
  reference = min(
      poplibs_amp_matmul_cycles(rows, bk, cols, itemsize == 2, units, target.worker_contexts,
                                float_partials=float_partials, groups=bb)
      for rows, cols in ((bm, bn), (bn, bm)))
  return {"block": [bb, bm, bn, bk], "partials_bytes": partials_itemsize,
          "conv_units": units, "estimate_compute_cycles": float(step.compute_cycles.max()),
          "poplin_cycles": float(reference)}


def group_steps(profile, target) -> dict:
  """``{pass: {part: {"cycles", "steps": {name: {"cycles", "count"}}, ...}}}`` of a profile."""
  passes = {}
  for step in profile.steps:
    cycles = float(step.total_cycles) * step.executions
    part = passes.setdefault(pass_of(step.scope), {}).setdefault(
        step_part(step), {"cycles": 0.0, "steps": {}})
    part["cycles"] += cycles
    entry_ = part["steps"].setdefault(step.name, {"cycles": 0.0, "count": 0})
    entry_["cycles"] += cycles
    entry_["count"] += step.executions
    reference = poplin_reference(step, target)
    if reference is not None:
      part.setdefault("poplin_reference", []).append(dict(reference, step=step.name))
  return {p: dict(sorted(parts.items(), key=lambda kv: PART_NAMES.index(kv[0])))
          for p, parts in passes.items()}


def model_config(settings: dict):
  """The BERT configuration of ``settings``: ``model`` with width, heads, FFN overridden."""
  import jax.numpy as jnp
  from experiments import bert
  make = {"large": bert.bert_large, "base": bert.bert_base}[settings["model"]]
  overrides = {k: settings[k] for k in ("hidden", "heads", "ffn") if settings.get(k)}
  return make(dtype=jnp.dtype(settings["dtype"]), dropout=settings["dropout"], **overrides)


def layer_programs(settings: dict):
  """``(loss, grad of loss, args)``: one encoder layer's two programs and their arguments."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from experiments import bert
  from ipu_jax.nnx_scopes import module_scopes
  cfg = model_config(settings)
  layer = bert.EncoderLayer(cfg, nnx.Rngs(0))
  gdef, params, rng_state, rest = nnx.split(layer, nnx.Param, nnx.RngState, ...)
  shape = (settings["micro_batch"], settings["seq"], cfg.hidden)
  h = jax.ShapeDtypeStruct(shape, cfg.dtype)
  mask = jax.ShapeDtypeStruct((shape[0], 1, 1, shape[1]), cfg.dtype)
  deterministic = settings["dropout"] == 0.0

  def loss(params, h, mask, rng):
    # Dropout's streams start from ``rng`` (an argument, as experiments.bert's
    # make_loss does): a generator state closed over cannot advance in a trace.
    streams = jax.tree_util.tree_map(
        lambda v: rng if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v, rng_state)
    model = nnx.merge(gdef, params, streams, rest)
    # "loss" is a scope whose backward is "loss/grad": the passes apart.
    with jax.named_scope(LOSS_SCOPE), module_scopes(model):
      return jnp.sum(model(h, mask, deterministic=deterministic).astype(jnp.float32))

  return loss, jax.grad(loss, argnums=(0, 1)), (params, h, mask, jax.random.key(0))


def _config(settings: dict):
  import ipu_jax
  conf = ipu_jax.IPUConfig()
  conf.matmuls.available_memory_proportion = settings["proportion"]
  conf.matmuls.partials_type = settings["partials"]
  conf.random.mode = settings["random"]
  return conf


def _first_pass(name: str) -> bool:
  """Whether a step is a product's (first) AMP pass: one per product."""
  return name.startswith("dot_general/matmul") and (" pass " not in name
                                                    or " pass 1/" in name)


def measure(fn, args, settings: dict) -> dict:
  """Lowers ``fn`` on the settings' target: totals, peak tile bytes and the parts."""
  import ipu_jax
  target = ipu_jax.IPUTarget.preset(settings["system"],
                                    **({"tiles_per_ipu": settings["tiles_per_ipu"]}
                                       if settings["tiles_per_ipu"] else {}))
  start = time.perf_counter()
  profile = ipu_jax.jit(fn, target=target, config=_config(settings), verbose=0).lower(
      *args).report.profile
  seconds = time.perf_counter() - start
  products = [s for s in profile.steps if s.op == "dot_general"]
  return {"total_cycles": float(profile.total_cycles),
          # Every matmul's steps (its AMP pass and its partials' reduction),
          # whichever part holds them: the products docs/calibration.md counts.
          "matmul_cycles": float(sum(s.total_cycles * s.executions for s in products)),
          "matmuls": sum(_first_pass(s.name) for s in products),
          "peak_tile_bytes": int(profile.memory.peak.max()),
          "lower_seconds": round(seconds, 1),
          "passes": group_steps(profile, target)}


def run(settings: dict) -> dict:
  """Both programs of one layer at ``settings``; the JSON the runner writes."""
  from ipu_jax.kernels.cost_model import COST_MODEL_VERSION
  loss, grad, args = layer_programs(settings)
  return dict(SCHEMA, settings=settings, cost_model=COST_MODEL_VERSION,
              forward=measure(loss, args, settings),
              forward_backward=measure(grad, args, settings))


def reference_summary(program: dict) -> Optional[str]:
  """The matmul passes' busiest-tile cycles against poplin's estimates, in one line."""
  refs = [r for parts in program["passes"].values() for part in parts.values()
          for r in part.get("poplin_reference", [])]
  if not refs:
    return None
  ours = sum(r["estimate_compute_cycles"] for r in refs)
  theirs = sum(r["poplin_cycles"] for r in refs)
  ratios = [r["estimate_compute_cycles"] / r["poplin_cycles"] for r in refs]
  return (f"  {len(refs)} matmul passes beside poplin's ConvPartial1x1 estimate: "
          f"{ours:,.0f} against {theirs:,.0f} cycles ({ours / theirs:.3f}; "
          f"each {min(ratios):.3f}-{max(ratios):.3f})")


def table(results: dict) -> str:
  """The parts as text: cycles forward alone, then forward and backward of the full program."""
  fwd, both = results["forward"]["passes"], results["forward_backward"]["passes"]
  rows = [f"{'part':26s} {'forward alone':>14s} {'fwd (f+b)':>12s} {'backward':>12s}"]
  for name in PART_NAMES:
    cells = [d.get(name, {}).get("cycles") for d in
             (fwd.get("forward", {}), both.get("forward", {}), both.get("backward", {}))]
    if any(c is not None for c in cells):
      rows.append(f"{name:26s} " + " ".join(
          f"{(c or 0):{w},.0f}" for c, w in zip(cells, (14, 12, 12))))
  for key in ("forward", "forward_backward"):
    r = results[key]
    rows.append(f"{key}: {r['total_cycles']:,.1f} cycles ({r['matmuls']} matmuls "
                f"{r['matmul_cycles']:,.1f}), peak tile {r['peak_tile_bytes']:,d} B, "
                f"lowered in {r['lower_seconds']} s")
    summary = reference_summary(r)
    if summary:
      rows.append(summary)
  rows.append(f"cost model {results['cost_model']}")
  return "\n".join(rows)


def define_flags(fv=flags.FLAGS):
  from ipu_jax.kernels.target import PRESETS
  d = {"flag_values": fv}
  flags.DEFINE_enum("model", "large", ["large", "base"], "BERT-Large or BERT-Base's layer.", **d)
  flags.DEFINE_integer("hidden", 0, "Width; 0 = the model's.", lower_bound=0, **d)
  flags.DEFINE_integer("heads", 0, "Attention heads; 0 = the model's.", lower_bound=0, **d)
  flags.DEFINE_integer("ffn", 0, "Feed-forward width; 0 = the model's.", lower_bound=0, **d)
  flags.DEFINE_integer("seq", 512, "Sequence length.", lower_bound=1, **d)
  flags.DEFINE_integer("micro_batch", 3, "Sequences in the micro-batch.", lower_bound=1, **d)
  flags.DEFINE_enum("dtype", "float16", ["float16", "float32", "bfloat16"],
                    "Parameters' and activations' dtype.", **d)
  flags.DEFINE_enum("system", "bow", sorted(PRESETS), "IPU target preset.", **d)
  flags.DEFINE_integer("tiles_per_ipu", 0, "Tiles per IPU; 0 = the preset's.", lower_bound=0, **d)
  flags.DEFINE_float("proportion", 1.0, "Matmuls' available_memory_proportion.", **d)
  flags.DEFINE_enum("partials", "float16", ["float16", "float32"], "Matmuls' partials type.",
                    **d)
  flags.DEFINE_float("dropout", 0.0, "Dropout rate (0: the layer runs deterministic).", **d)
  flags.DEFINE_enum("random", "jax", ["jax", "hardware"], "cfg.random.mode: how dropout's "
                    "bits are made.", **d)
  flags.DEFINE_string("json_out", None, "Write the figures to this JSON file.", **d)
  return fv


_SETTINGS = ("model", "hidden", "heads", "ffn", "seq", "micro_batch", "dtype", "system",
             "tiles_per_ipu", "proportion", "partials", "dropout", "random")


@entry.reporting_errors
def main(argv):
  del argv
  entry.quiet_backend_probe()
  f = flags.FLAGS
  try:
    entry.prepare_outputs(files=[("--json_out", f.json_out)])
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  results = run({k: getattr(f, k) for k in _SETTINGS})
  print(table(results))
  if f.json_out:
    with open(f.json_out, "w") as out:
      json.dump(results, out, indent=1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
