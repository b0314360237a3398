"""``search``: find a pipeline split that fits every IPU and runs fastest.

Graphcore's users find a model's split by hand -- compile, read the memory
view, move a layer, compile again (BERT-Large's ``layers_per_ipu [3, 7, 7,
7]`` with ``matmul_proportion [0.15, 0.25, 0.25, 0.25]``). This searches it
against the emulator's own memory and cycle model, cheaply by construction:

1. *Probe*: for each (available memory proportion, recomputation,
   serialisation) setting, lower a three-layer model of the
   :class:`~ipu_jax.pipelining.candidates.LayeredModel` as a four-stage
   pipeline ``[first], [layer], [layer, layer], [last]`` and read each
   body's figures; a stage of n layers is composed from those of one and
   two (:mod:`~ipu_jax.pipelining.compose`). Another serialisation factor
   of the same setting changes only the last block's matmul: a one-layer
   model is lowered for its figures alone.
2. *Score*: per IPU and setting, compose its stages' peak memory (its own
   stash depth from the schedule) -- independent of the other IPUs, so
   cached -- and keep, per IPU, the proportions that fit and are not slower
   in every pass than another that fits. Candidates are taken in order of a
   lower bound of their step (``G`` x the busiest IPU's passes); each is laid
   out by the schedule (:func:`~ipu_jax.pipelining.schedule.simulate`) until
   the bound passes the ``top``-th best step found.
3. *Confirm*: the best candidates are lowered as real
   :class:`~ipu_jax.pipelining.Pipeline` s of the full model, in order, until
   one fits every IPU and its step is within ``tolerance`` of the estimate.

Throughput is :func:`score`: samples per second of the step's timeline,
``G x micro-batch x replicas / step seconds``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import numbers
import time
from typing import Optional

import jax
import numpy as np

from ipu_jax.lowering import plan_cache
from ipu_jax.pipelining import compose, links, schedule as schedule_lib
from ipu_jax.pipelining.candidates import Candidate, LayeredModel, SearchSpace
from ipu_jax.pipelining.search_result import Estimate, LoweredSplit, SearchResult, Shortfall
from ipu_jax.pipelining.shared_stages import SharedLowerings
from ipu_jax.pipelining.split import PipelineError

__all__ = ["Candidate", "LayeredModel", "SearchResult", "SearchSpace", "confirm",
           "lower_candidate", "probe", "score", "search"]


def score(step_cycles: float, clock_hz: float, accumulation: int, samples: int,
          replicas: int) -> float:
  """Samples per second of a step of ``step_cycles`` (G micro-batches per replica)."""
  return accumulation * samples * replicas * clock_hz / step_cycles if step_cycles else 0.0


def _stacked(micro_batch, count: int):
  # A stack of one micro-batch, without copying (Pipeline.lower reads shapes only).
  return jax.tree_util.tree_map(
      lambda x: np.broadcast_to(np.asarray(x), (count,) + np.shape(x)), micro_batch)


def _key(model: LayeredModel) -> dict:
  """``Pipeline.lower``'s key argument for a model whose loss takes one (its value is
  not read: lowering needs its shape only)."""
  import jax
  return {"rng": jax.random.key(0)} if model.rng else {}


def _pipeline_config(config, num_ipus: int, proportions, recomputation: bool):
  cfg = config.copy()
  cfg.auto_select_ipus = num_ipus
  cfg.pipelining.recomputation = bool(recomputation)
  cfg.matmuls.available_memory_proportion = [float(p) for p in proportions]
  cfg.memory.allow_out_of_memory = True  # fits are judged here, per IPU
  return cfg


def _lower_probe(model: LayeredModel, config, optimizer, proportion: float,
                 recomputation: bool, serialization: int, layers_per_ipu, shared=None):
  from ipu_jax.pipelining.pipeline import Pipeline
  loss_fn, params = model.build(sum(layers_per_ipu), serialization)
  num_ipus = len(layers_per_ipu)
  cfg = _pipeline_config(config, num_ipus, [proportion] * num_ipus, recomputation)
  # The replicas stay: with replicated tensor sharding each copy's weight
  # update works on its 1 / R shard of the state, a quarter of the cycles and
  # of the update's memory on 4 replicas.
  cfg.training.gradient_accumulation_steps = 1
  cfg.pipelining.schedule = "Sequential"  # any G; the figures do not depend on it
  assignment, mapping = model.layout(layers_per_ipu)
  pipe = Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                  stage_assignment=assignment, rng=model.rng)
  pipe.shared_lowerings = shared
  return pipe.lower(params, _stacked(model.micro_batch, cfg.replication_factor),
                    **_key(model))


def probe(model: LayeredModel, config, optimizer, proportion: float, recomputation: bool,
          serialization: int, known: Optional[dict] = None, shared=None):
  """``({'first', 'layer1', 'layer2', 'last'}: BodyFigures, target)`` of one setting.

  ``layer1`` is a stage of one layer, ``layer2`` one of two. With ``known``
  (the figures of the same proportion and recomputation at another
  serialisation factor, which only the last block's matmul takes) only a
  one-layer model is lowered and only its last block's figures are new.
  ``shared``: a :class:`~ipu_jax.pipelining.shared_stages.SharedLowerings`
  the probes of one search share (stages met before are not lowered again).
  """
  if known is not None:
    pipe = _lower_probe(model, config, optimizer, proportion, recomputation, serialization,
                        [0, 1], shared)
    return {**known, "last": compose.body_figures(pipe, 2)}, pipe.target
  pipe = _lower_probe(model, config, optimizer, proportion, recomputation, serialization,
                      [0, 1, 2], shared)
  figures = {name: compose.body_figures(pipe, k)
             for k, name in enumerate(("first", "layer1", "layer2", "last"))}
  return figures, pipe.target


@dataclasses.dataclass
class _Scorer:
  """Composes candidates from the probes' figures (per-IPU results cached)."""

  figures: dict           # (proportion, recomputation, serialization) -> {body: BodyFigures}
  target: object
  num_ipus: int
  schedule: str
  accumulation: int
  replicas: int
  samples: int

  def __post_init__(self):
    n = self.num_ipus + 1
    self.slots = schedule_lib.slots(self.schedule, n, self.accumulation)
    self.depths = schedule_lib.stash_depths(self.slots, n)
    self.mapping = list(range(self.num_ipus)) + [0]
    self.limit = self.target.bytes_per_tile
    self._ipu = functools.lru_cache(maxsize=None)(self._ipu_figures)

  def _ipu_figures(self, ipu: int, layers: int, p: float, r: bool, s: int):
    """``(stages, peak bytes, peak tile)`` of IPU ``ipu`` (stage 0 + last on IPU 0)."""
    body = self.figures[(p, r, s)]
    block = [compose.layers(body["layer1"], body["layer2"], layers)] if layers else []
    if ipu == 0:
      stages = [compose.compose_stage([body["first"]] + block),
                compose.compose_stage([body["last"]])]
      depths = [self.depths[0], self.depths[-1]]
    else:
      stages = [compose.compose_stage(block)]
      depths = [self.depths[ipu]]
    peak = compose.ipu_peak(stages, depths)
    tile = int(np.argmax(peak))
    return stages, int(peak[tile]), tile

  def options(self, ipu: int, layers: int, proportions, r: bool, s: int):
    """Proportions that fit IPU ``ipu`` and that no other fitting one beats.

    One beats another when none of its passes is slower and its peak is no
    higher; of proportions with equal figures the smallest is kept.
    """
    fits = []
    for p in sorted(proportions):
      stages, peak, _ = self._ipu(ipu, layers, p, r, s)
      if peak <= self.limit:
        fits.append((p, np.array([c for st in stages
                                  for c in (st.forward, st.backward, st.update)] + [peak])))
    keep = []
    for i, (p, figures) in enumerate(fits):
      beaten = any(np.all(other <= figures) and (np.any(other < figures) or j < i)
                   for j, (_, other) in enumerate(fits) if j != i)
      if not beaten:
        keep.append(p)
    return keep

  def shortfall(self, ipu: int, layers: int, proportions, r: bool, s: int):
    """``(bytes over, proportion, tile)`` of the IPU's least-over proportion."""
    over = [(self._ipu(ipu, layers, p, r, s)[1] - self.limit, p,
             self._ipu(ipu, layers, p, r, s)[2]) for p in proportions]
    return min(over)

  def stages(self, cand: Candidate) -> list:
    out = [None] * (self.num_ipus + 1)
    for ipu, (n, p) in enumerate(zip(cand.layers_per_ipu, cand.proportions)):
      stages = self._ipu(ipu, n, p, cand.recomputation, cand.serialization)[0]
      out[ipu] = stages[0]
      if ipu == 0:
        out[-1] = stages[1]
    return out

  def lower_bound(self, cand: Candidate) -> float:
    stages = self.stages(cand)
    busy = np.zeros(self.num_ipus)
    for ipu, st in zip(self.mapping, stages):
      busy[ipu] += st.forward + st.backward
    return float(self.accumulation * busy.max())

  def estimate(self, cand: Candidate) -> Estimate:
    """The candidate's timeline, throughput and per-IPU peaks."""
    stages = self.stages(cand)
    timeline = self._simulate(cand, stages)
    peaks = [self._ipu(i, n, p, cand.recomputation, cand.serialization)[1]
             for i, (n, p) in enumerate(zip(cand.layers_per_ipu, cand.proportions))]
    busiest = int(np.argmax(timeline.busy_cycles))
    return Estimate(
        candidate=cand, step_cycles=float(timeline.total_cycles),
        samples_per_second=score(timeline.total_cycles, self.target.clock_hz,
                                 self.accumulation, self.samples, self.replicas),
        ipu_peak_bytes=peaks, ipu_busy_cycles=[float(c) for c in timeline.busy_cycles],
        bottleneck_ipu=busiest,
        bottleneck_stages=[k for k, i in enumerate(self.mapping) if i == busiest],
        bytes_per_tile=self.limit)

  def _copies(self, cand: Candidate, stages) -> tuple:
    n = self.num_ipus
    fwd, bwd = [[] for _ in stages], [[] for _ in stages]
    for k in range(n):
      p = cand.proportions[k]
      body = self.figures[(p, cand.recomputation, cand.serialization)]
      if cand.layers_per_ipu[k] == 0:
        sent = body["first"].sends
      else:
        sent = body["layer2"].sends if k + 1 == n else body["layer1"].sends
      back_body = self.figures[(cand.proportions[(k + 1) % n], cand.recomputation,
                                cand.serialization)]
      back = back_body["last"].returns if k + 1 == n else back_body["layer2"].returns
      fwd[k].append((self.mapping[k], self.mapping[k + 1], sent))
      bwd[k + 1].append((self.mapping[k + 1], self.mapping[k], back))
    return fwd, bwd

  def _simulate(self, cand: Candidate, stages):
    fwd, bwd = self._copies(cand, stages)
    return schedule_lib.simulate(
        self.slots, self.mapping,
        forward=[s.forward for s in stages], backward=[s.backward for s in stages],
        copies_forward=fwd, copies_backward=bwd,
        sync=self.target.ipu_sync_cycles(self.num_ipus),
        weight_update=[s.update for s in stages],
        all_reduce=[links.all_reduce_cycles(self.target, self.replicas, s.weight_bytes, ipu,
                                            self.num_ipus)
                    for s, ipu in zip(stages, self.mapping)],
        copy_cost=functools.partial(links.slot_copy_cycles, self.target),
        with_spans=False)  # the estimate reads the totals only


def _feasible(scorer: _Scorer, space: SearchSpace, compositions) -> tuple:
  """``(candidates that fit, the closest miss)``; each IPU's fit judged once."""
  fitting, closest = [], None
  for r, s in itertools.product(space.recomputation, space.serialization):
    for comp in compositions:
      options = [scorer.options(ipu, n, space.proportions, r, s) for ipu, n in enumerate(comp)]
      if all(options):
        fitting += [Candidate(comp, combo, r, s) for combo in itertools.product(*options)]
        continue
      misses = [(scorer.shortfall(ipu, n, space.proportions, r, s), ipu)
                for ipu, n in enumerate(comp)]
      (over, _, tile), ipu = max(misses)
      if closest is None or over < closest.bytes_over:
        least = tuple(m[0][1] for m in misses)
        closest = Shortfall(Candidate(comp, least, r, s), ipu, tile, int(over), scorer.limit)
  return fitting, closest


def _rank(scorer: _Scorer, candidates: list, top: int) -> tuple:
  """``(best estimates, timelines laid out)``: by lower bound, until it passes the top-th."""
  order = sorted(((scorer.lower_bound(c), i) for i, c in enumerate(candidates)))
  best, simulated = [], 0
  for bound, i in order:
    if len(best) >= top and bound > -best[0][0]:
      break
    estimate = scorer.estimate(candidates[i])
    simulated += 1
    heapq.heappush(best, (-estimate.step_cycles, i, estimate))
    if len(best) > top:
      heapq.heappop(best)
  ranked = sorted((e for _, _, e in best), key=lambda e: e.step_cycles)
  return ranked, simulated


def lower_candidate(model: LayeredModel, config, optimizer, cand: Candidate, shared=None):
  """The full model's :class:`Pipeline` for ``cand``, lowered (fits not enforced).

  ``shared``: as :func:`probe` takes it.
  """
  from ipu_jax.pipelining.pipeline import Pipeline
  loss_fn, params = model.build(model.num_layers, cand.serialization)
  cfg = _pipeline_config(config, len(cand.layers_per_ipu), cand.proportions,
                         cand.recomputation)
  assignment, mapping = model.layout(cand.layers_per_ipu)
  pipe = Pipeline(loss_fn, optimizer, config=cfg, device_mapping=mapping,
                  stage_assignment=assignment, rng=model.rng)
  pipe.shared_lowerings = shared
  count = cfg.training.gradient_accumulation_steps * cfg.replication_factor
  return pipe.lower(params, _stacked(model.micro_batch, count), **_key(model))


def confirm(model: LayeredModel, config, optimizer, estimate: Estimate) -> Estimate:
  """Lower ``estimate``'s split and record its real step and per-IPU peaks."""
  return _confirmed(model, config, optimizer, estimate)[0]


def _confirmed(model: LayeredModel, config, optimizer, estimate: Estimate) -> tuple:
  """:func:`confirm`, and the lowered :class:`Pipeline` with its lowering seconds."""
  from ipu_jax.pipelining import layout
  start = time.time()
  pipe = lower_candidate(model, config, optimizer, estimate.candidate)
  seconds = time.time() - start
  memory = layout.ipu_memory(pipe.stages)
  estimate.lowered_peak_bytes = [int(memory[i].peak.max()) for i in sorted(memory)]
  estimate.lowered_step_cycles = float(pipe.timeline.total_cycles)
  estimate.lowered_busy_cycles = [float(c) for c in pipe.timeline.busy_cycles]
  estimate.lowered_samples_per_second = score(
      pipe.timeline.total_cycles, pipe.target.clock_hz, pipe.accumulation, model.samples(),
      pipe.replicas)
  return estimate, LoweredSplit(pipe, seconds)


def _confirm_best(model, config, optimizer, ranked: list, attempts: int, tolerance: float):
  """``(chosen, confirmed, pipelines lowered, chosen's LoweredSplit or None)``: the first
  of ``ranked`` that fits when lowered and matches its estimate; else the lowered one that
  fits and runs fastest. Only the lowered pipeline that may yet be chosen is held (a
  BERT-Large pipeline holds gigabytes of plans and figures)."""
  lowered, best = 0, (None, None)
  for estimate in ranked[:attempts]:
    estimate, split = _confirmed(model, config, optimizer, estimate)
    lowered += 1
    if estimate.lowered_fits and estimate.step_error <= tolerance:
      return estimate, True, lowered, split
    if estimate.lowered_fits and (best[0] is None or estimate.lowered_samples_per_second
                                  > best[0].lowered_samples_per_second):
      best = (estimate, split)
    del split  # freed before the next lowering unless it is the best so far
  if best[0] is not None:
    return best[0], False, lowered, best[1]
  return (ranked[0] if attempts == 0 else None), False, lowered, None


def _check_search(model: LayeredModel, space: SearchSpace, compositions: list, num_ipus: int,
                  top, confirm_top, tolerance, baseline) -> None:
  """The search's arguments, checked before any probe is lowered.

  Raises:
    PipelineError: a count or tolerance out of range, a space with no split
      of the model's layers over the IPUs, or a baseline split that is not
      one of them (each used to surface after the probes, or as an empty
      result whose table failed).
  """
  for name, value, least in (("top", top, 1), ("confirm_top", confirm_top, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
      raise PipelineError(f"search: {name} must be an int >= {least}; got {value!r}.")
  if not (isinstance(tolerance, numbers.Real) and 0.0 <= float(tolerance) < float("inf")):
    raise PipelineError(f"search: tolerance (a confirmed split's relative step-cycle error) "
                        f"must be a number >= 0; got {tolerance!r}.")
  if not compositions:
    raise PipelineError(f"search: no split of {model.num_layers} layers over {num_ipus} IPUs "
                        f"(IPU 0 >= 0 layers, every other >= 1) is in the space "
                        f"(max_layers_per_ipu={space.max_layers_per_ipu}); widen it, or use "
                        f"fewer IPUs (auto_select_ipus).")
  if baseline is not None:
    try:
      cand = _as_candidate(baseline)
    except (KeyError, TypeError, ValueError) as e:
      raise PipelineError(f"search: baseline must be a Candidate or a dict with "
                          f"'layers_per_ipu' and 'available_memory_proportion' (and "
                          f"optionally 'recomputation', 'serialization_factor'); {e!r} in "
                          f"{baseline!r}.") from None
    if len(cand.layers_per_ipu) != num_ipus or sum(cand.layers_per_ipu) != model.num_layers:
      raise PipelineError(f"search: the baseline {cand.config} must give {num_ipus} IPUs "
                          f"{model.num_layers} layers in all.")


def _as_candidate(split) -> Candidate:
  if isinstance(split, Candidate):
    return split
  return Candidate(tuple(int(n) for n in split["layers_per_ipu"]),
                   tuple(float(p) for p in split["available_memory_proportion"]),
                   bool(split.get("recomputation", True)),
                   int(split.get("serialization_factor", 1)))


def search(model: LayeredModel, config=None, optimizer=None, space: Optional[SearchSpace] = None,
           *, top: int = 5, confirm_top: int = 3, tolerance: float = 0.1, baseline=None,
           log=None) -> SearchResult:
  """Find the split of ``model`` with the highest estimated throughput that fits.

  Args:
    model: the :class:`LayeredModel` (its layers, first and last blocks).
    config: the :class:`ipu_jax.IPUConfig` of the run: ``auto_select_ipus``
      IPUs per replica, ``replication_factor``, ``device`` (tiles),
      ``training.gradient_accumulation_steps`` (G), ``pipelining.schedule``,
      streaming and precision options; the search sets the proportions and
      recomputation. Default: the active default config.
    optimizer: the optax optimizer the pipeline updates with (None: no update).
    space: the :class:`SearchSpace` (default proportions 0.15..0.45,
      recomputation on and off, serialisation 1).
    top: estimates kept for the table.
    confirm_top: the best estimates lowered, in order, until one is confirmed.
    tolerance: the relative step-cycle error a confirmed split may have.
    baseline: a split (the runner's keys, or a :class:`Candidate`) to
      estimate beside the chosen one (e.g. Graphcore's published one).
    log: ``log(str)`` for progress (e.g. ``print``).

  Returns:
    A :class:`SearchResult`: ``.config`` (None and ``.shortfall`` naming the
    closest miss when nothing fits), ``.table()``, ``.to_json()``, ``.plot()``,
    and ``.lowered``: the chosen split's pipeline as its confirmation lowered it.
  """
  from ipu_jax import config as config_lib
  start = time.time()
  config = (config if config is not None else config_lib.get_default_config()).copy()
  space = space if space is not None else SearchSpace()
  num_ipus = config.auto_select_ipus
  compositions = space.compositions(model.num_layers, num_ipus)  # enumerated once
  _check_search(model, space, compositions, num_ipus, top, confirm_top, tolerance, baseline)
  # One plan session for the probes, the confirmations and the baseline: the
  # probes' layers and the full model's share layouts (plan keys hold every
  # figure they depend on -- layouts, shapes, target -- not the program).
  with plan_cache.lowering_session():
    probes = _Probes(model, config, optimizer, log or (lambda message: None))
    for setting in itertools.product(space.proportions, space.recomputation, space.serialization):
      probes.ensure(*setting)
    probed = time.time()
    scorer = _Scorer(probes.figures, probes.targets[0], num_ipus, config.pipelining.schedule,
                     config.training.gradient_accumulation_steps, config.replication_factor,
                     model.samples())
    estimator = functools.partial(_estimate, model, num_ipus, probes, scorer)
    fitting, closest = _feasible(scorer, space, compositions)
    probes.log(f"{len(fitting):,d} candidates fit; ranking")
    ranked, simulated = _rank(scorer, fitting, max(top, confirm_top))
    ranked_at = time.time()
    chosen, confirmed, lowered, split = (None, False, 0, None)
    if ranked:
      probes.release()  # the probes' programs go before the full model's are lowered
      chosen, confirmed, lowered, split = _confirm_best(model, config, optimizer, ranked,
                                                        confirm_top, tolerance)
    base = estimator(baseline) if baseline is not None else None
  counts = {"space": space.size(model.num_layers, num_ipus),
            "scored": space.size(model.num_layers, num_ipus), "simulated": simulated,
            "probes": len(probes.figures), "lowered": len(probes.figures) + lowered,
            "confirmed": int(confirmed), "probe_seconds": probed - start,
            "rank_seconds": ranked_at - probed, "confirm_seconds": time.time() - ranked_at}
  if chosen is None and closest is None and ranked:
    closest = _lowered_shortfall(ranked[:confirm_top], scorer.limit)
  return SearchResult(chosen=chosen, top=ranked[:top], shortfall=None if chosen else closest,
                      baseline=base, confirmed=confirmed, counts=counts,
                      seconds=time.time() - start, estimator=estimator, lowered=split)


class _Probes:
  """The probe figures of each (proportion, recomputation, serialisation), lowered once."""

  def __init__(self, model: LayeredModel, config, optimizer, log):
    # Probes of other proportions and recomputation settings build the same
    # small models: each (layers, serialisation) is built once (BERT-Large's
    # phase-1 search: 16 probes, two distinct models, about half a second each).
    self._built, self._model_build = {}, model.build
    self.model = dataclasses.replace(model, build=self._build)
    self.config, self.optimizer, self.log = config, optimizer, log
    self.figures, self.targets = {}, []
    # The probes of one proportion share the programs of stages alike (the
    # heads, never recomputed, of every probe; the first block of a last-block
    # probe). Stage programs lowered under another proportion never match, so
    # only the current proportion's are held (the heads are large); weight
    # updates with no matmul match under every proportion and are kept.
    self.shared, self._proportion = None, None

  def _build(self, num_layers: int, serialization: int):
    """``model.build``, once per argument pair: it depends on nothing else."""
    key = (num_layers, serialization)
    if key not in self._built:
      self._built[key] = self._model_build(num_layers, serialization)
    return self._built[key]

  def release(self) -> None:
    """Drops the programs and models the probes shared (a later probe makes them afresh)."""
    self.shared, self._proportion = None, None
    self._built = {}

  def ensure(self, p, r, s) -> None:
    """Probes the setting unless known; a known (p, r) needs only the last block again."""
    if (p, r, s) in self.figures:
      return
    known = next((f for (q, rr, _), f in self.figures.items() if (q, rr) == (p, r)), None)
    self.log(f"probe: proportion {p}, recomputation {r}, serialization {s}"
             + (" (last block only)" if known else ""))
    if p != self._proportion:
      updates = None if self.shared is None else self.shared.updates
      self.shared, self._proportion = SharedLowerings(updates), p
    self.figures[(p, r, s)], target = probe(self.model, self.config, self.optimizer, p, r, s,
                                            known, self.shared)
    self.targets.append(target)


def _estimate(model: LayeredModel, num_ipus: int, probes: _Probes, scorer: _Scorer,
              split) -> Estimate:
  """The estimate of ``split`` (a :class:`Candidate` or the runner's keys), probing as needed."""
  cand = _as_candidate(split)
  if len(cand.layers_per_ipu) != num_ipus or sum(cand.layers_per_ipu) != model.num_layers:
    raise ValueError(f"The split {cand.config} must give {num_ipus} IPUs "
                     f"{model.num_layers} layers in all.")
  for p in set(cand.proportions):
    probes.ensure(p, cand.recomputation, cand.serialization)
  return scorer.estimate(cand)


def _lowered_shortfall(confirmed: list, limit: int) -> Shortfall:
  """Every candidate fitted by estimate but none when lowered: the closest lowered one."""
  e = min(confirmed, key=lambda e: max(e.lowered_peak_bytes))
  ipu = int(np.argmax(e.lowered_peak_bytes))
  return Shortfall(e.candidate, ipu, -1, int(max(e.lowered_peak_bytes)) - limit, limit)
