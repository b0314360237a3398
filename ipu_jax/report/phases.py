"""The report's "Phases" section: a phased step's per-phase loads, stores and overlap.

Reads an :class:`ipu_jax.phased.PhasedEstimate` (phase executions in step
order); ``phases_summary`` gives the text, ``phases_dict`` a JSON-able dict
(the same figures).
"""

from __future__ import annotations

__all__ = ["phases_summary", "phases_dict"]


def _row(p) -> dict:
  t = p.traffic
  return {
      "phase": p.name, "index": p.index, "direction": p.direction, "ipu_group": p.group,
      "kind": p.kind,
      "load_bytes": int(p.load_bytes), "store_bytes": int(p.store_bytes),
      "loads": {"weights": t.weights_load, "optimizer_state": t.optimizer_load,
                "activations": t.activations_load},
      "stores": {"weights": t.weights_store, "optimizer_state": t.optimizer_store,
                 "activations": t.activations_store},
      "compute_cycles": float(p.compute_cycles),
      "collective_cycles": float(p.collective_cycles),
      "streaming_cycles": float(p.streaming_cycles),
      "exposed_streaming_cycles": float(p.exposed_streaming_cycles),
      "overlapped_streaming_cycles": float(p.overlapped_streaming_cycles),
      "sync_cycles": float(p.sync_cycles),
      "peak_bytes_per_ipu": int(p.peak_bytes_per_ipu),
  }


def phases_dict(estimate) -> dict:
  """The section as a JSON-able dict."""
  layout = estimate.layout
  return {
      "mode": layout.mode, "batch_serialisation": layout.batch_serialisation,
      "dp": layout.dp, "tp": layout.tp, "rts": layout.rts, "num_ipus": layout.num_ipus,
      "remote": {"weights": layout.remote_weights,
                 "optimizer_state": layout.remote_optimizer_state,
                 "activations": layout.remote_activations},
      "step_cycles": estimate.step_cycles, "step_seconds": estimate.step_seconds,
      "samples_per_second": estimate.samples_per_second,
      "breakdown": estimate.breakdown,
      "streaming_bytes_per_step": estimate.streaming_bytes_per_step,
      "streaming_cycles": estimate.streaming_cycles,
      "per_ipu_peak_bytes": int(estimate.per_ipu_peak_bytes),
      "streaming_memory_bytes_per_ipu": int(estimate.streaming_memory_bytes_per_ipu),
      "streaming_memory_capacity_per_ipu": int(estimate.target.streaming_memory_bytes),
      "fits": bool(estimate.fits),
      "programs_lowered": estimate.programs_lowered,
      "lower_seconds": estimate.lower_seconds,
      "phases": [_row(p) for p in estimate.phases],
  }


def _mib(n) -> str:
  return f"{n / 2**20:,.2f} MiB"


def phases_summary(estimate) -> str:
  """The section as text: one line per phase execution, then the totals."""
  d = phases_dict(estimate)
  lines = [
      f"Phases ({d['mode']}, G={d['batch_serialisation']}, dp={d['dp']} tp={d['tp']}"
      f"{' RTS' if d['rts'] else ''}, {d['num_ipus']} IPUs; bytes per IPU per step)",
      f"  {'phase':<16}{'dir':<5}{'grp':>4}{'load':>14}{'store':>14}{'compute':>12}"
      f"{'collect.':>10}{'stream':>12}{'exposed':>12}{'overlap':>8}"]
  for r in d["phases"]:
    share = (r["overlapped_streaming_cycles"] / r["streaming_cycles"]
             if r["streaming_cycles"] else 0.0)
    lines.append(
        f"  {r['phase']:<16}{r['direction'][:3]:<5}{r['ipu_group']:>4}"
        f"{r['load_bytes']:>14,d}{r['store_bytes']:>14,d}{r['compute_cycles']:>12,.0f}"
        f"{r['collective_cycles']:>10,.0f}{r['streaming_cycles']:>12,.0f}"
        f"{r['exposed_streaming_cycles']:>12,.0f}{share:>8.0%}")
  b = d["breakdown"]
  lines += [
      f"  step: {d['step_cycles']:,.0f} cycles ({d['step_seconds'] * 1e3:.3f} ms): compute "
      f"{b['compute']:,.0f}, collectives {b['collectives']:,.0f}, exposed streaming "
      f"{b['streaming']:,.0f} of {d['streaming_cycles']:,.0f}, sync {b['sync']:,.0f}",
      f"  streaming per IPU per step: {d['streaming_bytes_per_step']:,d} bytes; Streaming "
      f"Memory held {_mib(d['streaming_memory_bytes_per_ipu'])} of "
      f"{_mib(d['streaming_memory_capacity_per_ipu'])} per IPU",
      f"  In-Processor Memory peak {_mib(d['per_ipu_peak_bytes'])} per IPU; "
      f"fits: {d['fits']}; {d['programs_lowered']} programs lowered in "
      f"{d['lower_seconds']:.1f} s"]
  return "\n".join(lines)
