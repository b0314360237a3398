"""Where each figure of the cost model comes from, and the model's version.

Reports record :data:`COST_MODEL_VERSION` (so numbers from different versions
are not compared unknowingly) and say which target figures are *calibrated*
(checked against a published measurement or a vendor figure by
``experiments/calibration.py``) and which are *estimates* (round numbers in a
plausible range with no published measurement behind them).

Kinds of provenance, strongest first:

* ``datasheet``: a vendor figure (Graphcore datasheets, the PCIe
  specification) used as given.
* ``poplibs``: taken from Graphcore's published cycle estimators (poplibs,
  ``lib/poplin/PerformanceEstimation.hpp`` and ``lib/popops``), which Graphcore
  fits to hardware cycle counts, or from the figures poplibs' planners use.
* ``estimate``: not backed by a published figure.

``calibrated`` figures are the ``datasheet`` and ``poplibs`` ones.
"""

from __future__ import annotations

import dataclasses

__all__ = ["COST_MODEL_VERSION", "FigureSource", "FIGURE_SOURCES", "calibrated_figures",
           "estimated_figures", "cost_model_json"]

# Bump when a change to an estimator or a preset figure changes cycle counts.
# 2: one AMP estimator for every matmul path (poplin's 1x1 conv-partials
#    structure; no per-output write term on top of the MACs); fp16/fp32
#    elementwise ops from popops' UnaryOp1D/BinaryOp1D estimators; the host
#    link at PCIe 4.0 x16 per direction (31.5 GB/s, was 64 GB/s).
# 3: reductions, casts, fills, scaled adds and dynamic slices/updates from
#    popops' Reduce, Cast1D, Fill, ScaledAddSupervisor and DynamicSlice1D
#    estimators (kernels/reduce.py, kernels/popops.py); on-chip sync 90 cycles
#    (was 150) and a fixed 100 cycles per exchange (was 30), poplibs' planner
#    figures.
# 4: one cost for one sync: a multi-IPU program's cross-IPU supersteps and a
#    pipeline's slots pay ``IPUTarget.ipu_sync_cycles``: the on-chip sync
#    plus poplibs' IPUModel global sync signal with its whole-number hops
#    (2 IPUs at 1.33 GHz: 90 + 40 = 130 cycles; programs paid the 1,500-cycle
#    external estimate, pipelines 60 alone); host and streaming-memory syncs
#    keep the estimate as ``sync_cycles_host``; max/min/mul reductions follow poplibs' op-specific
#    Reduce estimates (no accumulators: 64-bit vectors, their own loop post).
# 5: a fused elementwise compute set pays the cheapest, per tile, of one
#    map-expression codelet (each input loaded and each result stored once
#    per vector, the members' ALU cycles, the fixed overheads once), popops'
#    ScaledAdd / ScaledSubtract / aXPlusbY / aXMinusbY vertex where the chain
#    is that pattern, and its members' vertices in turn (version 4's only
#    figure); lowering/fused_cost.py.
# 6: constant folding: equations whose operands are all compile-time
#    constants (converted literals, jax.random.uniform's bounds, sqrt(d_head))
#    are computed on the host, as XLA and PopART's ConstExpr pass fold them,
#    and no longer cost a superstep on one tile each (~200-250 cycles: sync,
#    exchange, vertex); lowering/constant_folding.py. Hardware dropout on
#    [1024, 1024] float16 at 1,472 tiles: 3 steps, 1,809 cycles -> 1 step,
#    1,065 (compute 979 -> 517, poprand's Dropout alone).
# 7: PopSparse's dynamic block vertices scan buckets with sparseDenseBlockMultiply's
#    supervisor figures (33 a sub-group skipped, 46 + 56 for the one found) instead
#    of the element-wise vertex's (32, 47 + 46); kernels/popsparse.py. Only dynamic
#    sparse products with blocks of 4, 8 or 16 move (a few cycles per propagation step).
# 8: float32 sums of float16 values as popnn's batch norm runs them (popops::reduceMany):
#    a widening cast / square read only by a reduce_sum is folded into its first stage
#    (float16 in, float32 partials; SQUARE_ADD), and two sums' stages on one layout share
#    a compute set; lowering/reduce_many.py, kernels/reduce.py. A [20, 56, 56, 256] batch
#    norm's statistics at 1,472 tiles: 41,266 -> 12,588 cycles. Only such sums move.
# 9: float16 products with float32 partials run 8 AMP units on IPU2 / Bow, half the
#    half-partials rate (poplibs' fp16InFp32OutConvUnitsPerTile; kernels/amp.py); only
#    2-byte matmuls and convolutions with float32 partials move (their AMP passes double).
# 10: a replicated pipeline's weight-update collectives are one collective of every IPU's
#    gradients at once over the links they share (PopART's merged collectives, as the MLPerf
#    BERT runs set them), not each IPU's group alone; a Grouped pipeline's ramp slots run
#    every stage's inter-IPU copies (PopART PopPrograms::addPipelineCycle, TF-IPU's grouped
#    visitor); ipu_jax/pipelining/throughput.py. Only replicated / pipelined steps move.
# 11: the partials of a split contraction (matmul, convolution) are summed by poplin's
#    ReduceAdd vertex (lib/poplin/ConvReduce.cpp; getReduceCycleEstimate in
#    lib/poplin/PerformanceEstimation.hpp), not popops' Reduce: kernels/estimators.py
#    partials_reduce_cycles. Only products with gk > 1 move (BERT-Large's layer matmuls
#    at proportion 1.0: 1.553 M -> 1.492 M cycles a layer's forward + backward).
# 12: a floating-point division by a constant (``x / 8.0``, attention's 1/sqrt(d_head)
#    scale) costs popops' MULTIPLY, not DIVIDE: XLA's algebraic simplifier
#    (HandleDivide, ``A / Const => A * (1 / Const)``) rewrites it before TensorFlow's IPU
#    backend sees it; lowering/rules/elementwise.py. BERT-Large's scores scale at
#    [3, 16, 512, 512] float16, 1,472 Bow tiles: 51,575 -> 6,597 compute cycles (with
#    the mask add, fused). Only divisions by constants move.
# 13: ipu_jax.ops.softmax, popnn's softmaxImpl / softmaxInputGradientImpl (the sums'
#    reciprocal then a MULTIPLY, not a full-size DIVIDE), used by experiments/bert.py's
#    attention: a BERT-Large layer's softmax forward + backward at [3, 16, 512, 512] float16 on
#    a Bow IPU 232,594 -> 119,373 cycles; only models calling the op move.
# 14: ipu_jax.ops.gelu, popnn's GELU: one NonLinearity1DInPlace<GELU> vertex forward and one
#    NonLinearityGrad1D<GELU> backward (5 cycles a vector of 4 halves, 10 a float pair;
#    popnn's estimators, kernels/popops.py nonlinearity_cycles) instead of jax.nn.gelu's
#    dozen-primitive chain priced as popops map expressions; used by experiments/bert.py.
#    A BERT-Large layer's FFN bias + GELU forward + backward at [3, 512, 4096] float16 on
#    a Bow IPU: 90,191 -> 45,712 cycles; only models calling the op move.
# 15: an elementwise operand with size-1 axes (LayerNorm's per-row mean and inverse
#    deviation, batch norm's per-channel scale) is read broadcast, as popops' vertices read
#    it: no full-size popops::Copy step nor temporary; each tile receives only the small
#    operand's elements it reads; a scalar per region is popops' BroadcastScalar1D/2D
#    (the cheaper, as binaryOpBroadcastScalar picks; kernels/popops.py
#    broadcast_scalar_cycles), other broadcasts the binary vertex or map reading in place.
# 16: a pipelined step pays the host's fixed time per execution of the device program
#    (IPUSystem.execution_overhead_seconds, 53 ms, measured from MLPerf v2.0's Bow Pod BERT
#    evaluation gaps; docs/published_bert.md#the-evaluation-gaps) over the weight updates an
#    execution runs (``steps_per_execution``; one by default, PopART's batches_per_step 1 in
#    every MLPerf BERT run); ipu_jax/pipelining/throughput.py. Only system-level throughput
#    moves (a BERT POD step +53 ms; the MLPerf ResNet presets' executions of a fifth of an
#    epoch, 25-133 updates, 0.4-2.1 ms a step).
# 17: exchange-bus sharing of matmul inputs, as poplin's planner prices it: a product's grid
#    starts on an even tile with its N split innermost, so the bus pair (2j, 2j + 1) needs the
#    same A block, which both receive at twice the rate (ExchangeCost.bus_shared_in); the
#    planner halves A's exchange when the N split is even (lowering/matmul_cost.py).
# 18: a broadcast_in_dim read only by elementwise ops (JAX's transpose of a reduce_sum: a
#    LayerNorm's or softmax's backward) is a view of its operand, read in place as 15 reads
#    an operand with size-1 axes (Poplar's Tensor::broadcast is a view; popops reads it):
#    no full-size popops::Copy step nor temporary; lowering/lower.py. A fused member reading
#    a broadcast operand from another layout receives only the elements its tiles read
#    (lowering/fusion.py), not the whole operand on every tile. BERT-Large layer forward +
#    backward (float16 [3, 512, 1024], Bow): 1,837,882 -> 1,816,043 cycles.
# 19: exchange-bus sharing of convolution inputs, as 17 for matmuls (poplin prices a conv
#    partition's input elements with the same ExchangeEstimator, lib/poplin/ConvModel.cpp
#    addExchangeCycleEstimates): a conv grid starts on an even tile with its feature split
#    innermost (linearizeConvIndices), bus pairs receive their common input window together,
#    and the planner halves the window's exchange when the feature split within a group is
#    even (lowering/conv_plan.py). ResNet-50 (mlperf_v2_bow_pod16, one micro-batch's seven
#    stage programs): conv cycles 9,891,845 -> 9,078,517, their exchange 2.96 M -> 2.31 M.
# 20: JAX's add_any (the backward pass's sum of cotangents) is popops' ADD, as the forward
#    add is (BinaryOp1D, or BroadcastScalar for a scalar-per-region operand), not the generic
#    elementwise figure; lowering/rules/elementwise.py. A reduction over size-1 axes only (a
#    keepdims mean's cotangent) is a view, as XLA's HandleReduce and popops' reduceWithMap
#    leave it: no Reduce step; lowering/rules/reduction.py. Only backward passes move.
# 21: the AMP block (kernels/amp.py amp_block_cycles) is poplin's ConvPartial1x1 estimate
#    case for case (poplibs 7eac0f2 lib/poplin/PerformanceEstimation.hpp, "PE"): the 7-cycle
#    retention saving per worker pass, paid once per vertex (PE:478, 599-601); 38 not 37 on
#    passes after the first input group (PE:470); the 14-cycle tag when the rows split
#    evenly (PE:488); each worker's own rows (ceil or floor, PE's 1- and 2-row entries) and
#    code path (half-float / 16-unit half-half, 8-unit half-half, float with its zeroing in
#    the worker). Matmul blocks were 1.6-4.9 % dearer than PE. BERT-Large layer forward +
#    backward (float16 [3, 512, 1024], Bow): 1,700,014.5 -> 1,673,122.0 cycles, its 18
#    matmul passes equal to PE's (1.027 -> 1.000). Also: an argmax / argmin over a size-1
#    axis is a constant index 0 (XLA's simplifier leaves the reshape of a one-element iota),
#    no Reduce step; lowering/rules/reduction.py.
# 22: a matmul's reduce-scatter of 16 or more partials runs in poplin's stages
#    (lib/poplin/ConvReducePlan.cpp 20-57: two stages from a depth of 16, three from 125;
#    the sections as lib/poplin/ConvReduce.cpp 145-180 cuts them), a superstep each with its
#    exchange, ReduceAdd (PerformanceEstimation.hpp estimateConvReduceCycles' stages) and
#    sync, priced the same by the planner (lowering/matmul_cost.py, lowering/matmul_stages.py).
#    BERT-Large layer forward + backward: 1,673,122.0 -> 1,673,205.0 cycles: the two gk = 18
#    grids (FFN-out forward, FFN-in dX) would pay +8,994 each and the planner moves them to
#    k13 / k6 grids instead.
#    Also in 22: static sparse products (popsparse::static_) are priced with static_'s own
#    vertices (StaticSparseDenseMatMulBlock / StaticSparseDenseElementWise:
#    StaticMatMulPartitioner.cpp matmulComputeCycles and zeroingCycles on its planner's work
#    split, tileWorkSplit) and keep partials of the data type, half for float16
#    (StaticMatMul.cpp: partialsType = inputType); kernels/popsparse.py. fp16 static rate at
#    density 1/16 (model / measured): block 4 0.87 -> 1.50, block 8 0.62 -> 1.14. Only static
#    sparse products move.
#    Also in 22: a static sparse product's result moves to popsparse::static_'s layout (`out`
#    linear over all tiles, StaticMatMul.cpp:543-546, written by popops::reduceMany at :793)
#    in one copy step, planned as a sync and a tile's chunk of exchange (static_'s planner's
#    moveFinalOutput, StaticMatMulPartitioner.cpp:714-720); kernels/popsparse.py
#    static_output_chunk. fp16 block 16, 1/16, n = 1024: plan 69,798 -> 71,420 cycles;
#    static rate (model / measured) 1.11-1.58 -> 1.08-1.56 at block 16.
# 23: a convolution's split contraction reduces 16 or more partials per output block in
#    poplin's stages, as 22 made matmuls do (poplin plans a convolution's reduction with the
#    same ConvReducePlan.cpp / ConvReduce.cpp: a matmul is a convolution there);
#    lowering/conv_plan.py prices the stages with the matmul's staged figures,
#    lowering/conv_partials.py emits them (lowering/matmul_stages.py emit_stages). ResNet-50
#    mlperf_v1_1_pod16: 39 of its 125 split convolutions reduce in two or three stages;
#    31,573 -> 31,415 images/s (ramp 77.23 -> 77.74 ms). Only convolutions of gk >= 16 move.
# 24: memory only. An elementwise step's result takes the memory of a temporary operand it
#    reads last, of its layout, dtype and shape (popops::mapInPlace and the *InPlace map
#    functions; PopART's Inplace pattern, TF-IPU's InplaceFinder pass choose them where the
#    operand dies), decided on the fused program (lowering/analysis.py _in_place_results), and
#    a fused chain's intermediates by the same rule (lowering/fusion.py); an update of a base
#    tensor (dynamic_update_slice, scatter, scatter-add: popops' dynamicUpdate, multiUpdate,
#    multiUpdateAdd write into their base) takes a dying base's memory too. No cycle moves.
#    TF2 BERT-Large phase 1 on a Bow Pod16 (tf2_phase1_pod16): IPU 0's fullest tile, in stage
#    0's update, 734,840 -> 583,320 B (its streamed embedding moments are updated in the
#    buffers they were loaded into): the configuration now fits, as it ran.
COST_MODEL_VERSION = "24"


@dataclasses.dataclass(frozen=True)
class FigureSource:
  """The provenance of one :class:`~ipu_jax.kernels.target.IPUTarget` figure."""

  kind: str          # "datasheet", "poplibs", "measurement" or "estimate"
  source: str        # where the value comes from


_GC = "Graphcore datasheets (GC2 / GC200 / Bow IPU)"
FIGURE_SOURCES = {
    "tiles_per_ipu": FigureSource("datasheet", _GC),
    "bytes_per_tile": FigureSource("datasheet", _GC),
    "worker_contexts": FigureSource("datasheet", _GC + "; Jia et al. 2019, arXiv:1912.03413"),
    "clock_hz": FigureSource("datasheet", _GC),
    "fp16_flops_per_cycle": FigureSource(
        "datasheet", "peak fp16 FLOPS / (tiles x clock): 124.5 T (GC2), 250 T (GC200), 350 T (Bow)"),
    "fp32_flops_per_cycle": FigureSource(
        "datasheet", "peak fp32 FLOPS / (tiles x clock): 31.1 T (GC2), 62.5 T (GC200)"),
    "exchange_bytes_per_cycle": FigureSource(
        "datasheet", "GC200 all-to-all exchange 8 TB/s = 1,472 tiles x 4 B x 1.33 GHz; "
        "Poplar IPUModel exchangeBytesPerCycle"),
    "supervisor_overhead_cycles": FigureSource(
        "poplibs", "poplin ConvPartial1x1 estimator: supervisor non-loop overhead 50 cycles"),
    "ipu_link_bytes_per_second": FigureSource("datasheet", "GC200: 320 GB/s IPU-Links per IPU"),
    "host_link_bytes_per_second": FigureSource(
        "datasheet", "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s per direction"),
    "vector_width_bytes": FigureSource(
        "estimate", "64-bit loads per worker per cycle; poplibs' popops estimators use "
        "64-bit vectors for most elementwise codelets"),
    "tiles_per_exchange_bus": FigureSource(
        "poplibs", "lib/poplin/ExchangeEstimator.hpp ExchangeEstimator (constructor, "
        "getInputElementCycles): when target.supportsExchangeBusSharing() and the plan's "
        "linearizeTileOrder is STANDARD, input (activation) elements are received at "
        "exchangeBytesPerCycle x 2 if outChanSplit.parallel % getTilesPerSharedExchangeBus() "
        "== 0, since linearizeConvIndices (lib/poplin/Convolution.cpp) puts the output-channel "
        "split innermost and plans start on an even tile; lib/popops/ExchangeEstimator.cpp and "
        "lib/popsparse/FullyConnectedPlan.cpp assert getTilesPerSharedExchangeBus() == 2. "
        "lib/poplin/ConvModel.cpp addExchangeCycleEstimates prices each partition's input "
        "elements (less the 1/outChanSplit in place) with getInputElementCycles and its "
        "weights and partials with getCycles (never shared): here a matmul's A block and a "
        "convolution's input window (lowering/matmul_emit.py, lowering/rules/convolution.py; "
        "feature split within a group even, conv groups being a split of their own)"),
    "exchange_latency_cycles": FigureSource(
        "poplibs", "popnn CTC-loss planner (lib/popnn/CTCLossPlan.cpp): fixed 100 cycles per "
        "exchange on top of bytes / exchangeBytesPerCycle (a planner constant, not a "
        "measurement)"),
    "sync_cycles_internal": FigureSource(
        "poplibs", "popnn CTC-loss planner (lib/popnn/CTCLossPlan.cpp): ~90 cycles for the "
        "sync before each exchange (a planner constant, not a measurement)"),
    "ipu_sync_seconds_per_hop": FigureSource(
        "poplibs", "IPUModel set-up for multi-IPU systems (lib/poplibs_test/Util.cpp, "
        "setGlobalSyncLatency): 15 ns per hop each way, hops = 1 + (IPUs / 2) / 2 in whole "
        "numbers; IPUTarget.ipu_sync_cycles adds it to the on-chip sync, for cross-IPU "
        "supersteps and pipeline slots alike"),
    "sync_cycles_host": FigureSource(
        "estimate", "a sync with the host or streaming memory (stream copies, remote-buffer "
        "copies); neither poplibs, the Poplar/GCL documentation nor a published measurement "
        "prices it; Jia et al. 2019 (arXiv:1912.03413) measured syncs on a GC2 but their "
        "tables could not be obtained"),
    "code_bytes_per_codelet": FigureSource("estimate", "no published code sizes"),
    "vertex_state_bytes": FigureSource("estimate", "no published vertex-state sizes"),
}
"""Provenance of every preset figure (``num_ipus``, ``name``, ``system`` and
``io_tiles_per_ipu`` are not figures), and
of the kernel figures named ``kernels.<module>.<NAME>`` (not target fields: the
report's calibrated / estimated lists hold target figures only)."""

_POPOPS = "poplibs lib/popops/"
FIGURE_SOURCES.update({
    "kernels.popops.scaled_arithmetic_cycles": FigureSource(
        "poplibs", _POPOPS + "PerformanceEstimation.cpp getScaledArithmeticSupervisorCycleEstimate "
        "(ScaledAdd/ScaledSubtract/aXPlusbY/aXMinusbY supervisor vertices, ONE_PTR operands, "
        "not memory-constrained): 3 cycles a 64-bit vector per worker"),
    "kernels.popops.map_expression_cycles": FigureSource(
        "poplibs", _POPOPS + "ExpressionGenerator.cpp: the generated map MultiVertex loads each "
        "non-scalar input and stores the result once per vector (half4 / float2; scalar when a "
        "value is not half/float/bool, is cast, or a unary op has no vector form), workers take "
        "vectors in turn, the last one the remainder"),
    "kernels.popops.map_member_element_cycles": FigureSource(
        "poplibs", _POPOPS + "popopsCycleEstimators.cpp unaryOpPerfInfo / binaryOpPerfInfo, less "
        "the loads and stores of unrolled entries (one cycle per 64-bit word, an estimate)"),
    "kernels.popops.elementwise_overheads": FigureSource(
        "poplibs", _POPOPS + "popopsCycleEstimators.cpp UnaryOp1D / BinaryOp1D worker entry and "
        "supervisor cycles, Cast1D's; paid once by a fused chain (the largest of its members')"),
    "kernels.popops.NONLINEARITY": FigureSource(
        "poplibs", "lib/popnn/PerformanceEstimation.hpp getNonLinearityOpCycles / "
        "getNonLinearityGradOpCycles (GELU: 5 cycles a half vector, 10 float) in "
        "lib/popnn/popnnCycleEstimators.cpp's NonLinearity1DInPlace and NonLinearityGrad1D "
        "estimators (9 supervisor cycles, 20 per worker, the longest worker's vectors, the "
        "remainder's 32/16-bit steps); poplibs marks the GELU figures 'should be verified'"),
    "kernels.popops.broadcast_scalar_cycles": FigureSource(
        "poplibs", _POPOPS + "popopsCycleEstimators.cpp broadcastArithmetic1DCycleEstimate "
        "(BroadcastScalar1D MultiVertex per region) and broadcastArithmeticCycleEstimate "
        "(BroadcastScalar2D, non-uniform scalar), broadcastOpPerfInfo; the cheaper per tile, "
        "as ElementWise.cpp binaryOpBroadcastScalar picks; the 2D regions' split between "
        "workers is an estimate"),
    "kernels.popops.BINARY": FigureSource(
        "poplibs", _POPOPS + "popopsCycleEstimators.cpp BinaryOp1D estimator and "
        "binaryOpPerfInfo: workers * (29 float / 26 half + ceil(ceil(n / workers) / vector) * "
        "(cycles + 2 for the assembly ADD/SUB/MUL, + 5 otherwise)) + 11 "
        "(basicOpSupervisorOverhead); JAX's add_any (the backward's cotangent sums, an XLA "
        "add) is priced as ADD, as the forward add is"),
    "lowering.rules.reduction.size_one_views": FigureSource(
        "poplibs", _POPOPS + "reduction/Reduction.cpp canReduceWithMap / reduceWithMap: a "
        "reduce whose reduced dimensions all have size 1 runs no Reduce vertex (a cast, a copy "
        "when the types agree, on the input's own mapping); XLA's AlgebraicSimplifier "
        "HandleReduce makes it a reshape first (jax.jit's compile shows a bitcast), so it "
        "costs 0 cycles, a view"),
    "kernels.popops.MAP_LOOP_CYCLES": FigureSource(
        "estimate", "one brnzdec per vector for the generated loop's count and branch"),
    "kernels.estimators.ELEMENTWISE_COST.philox4x32": FigureSource(
        "estimate", "48 cycles a 32-bit word for lax.rng_bit_generator's Philox4x32-10: "
        "threefry2x32's 40 scaled by instruction count (about 240 integer instructions per four "
        "words against threefry's 100 per two); no published Philox vertex"),
    "kernels.popops.MAP_WORDS_PER_CYCLE": FigureSource(
        "estimate", "one 64-bit load or store a cycle per worker (poplar's 64-bit data path); "
        "no co-issue with the ALU assumed for generated C++ codelets"),
})

# The tiles' hardware generators (random.mode = "hardware"): kernels/poprand.py.
_POPRAND = "poplibs lib/poprand/poprandCycleEstimators.cpp MAKE_PERF_ESTIMATOR_NAME"
FIGURE_SOURCES.update({
    "kernels.poprand.uniform_int_bits_cycles": FigureSource(
        "poplibs", _POPRAND + "(Uniform), type INT, scale 0: 4 + 22 x workers + out / 2 (one "
        "st64 of two random words a cycle); what random_bits costs in hardware mode"),
    "kernels.poprand.uniform_cycles": FigureSource(
        "poplibs", _POPRAND + "(Uniform), float / half: 4 cycles a 64-bit vector, 22 / 24 x "
        "workers"),
    "kernels.poprand.bernoulli_cycles": FigureSource(
        "poplibs", _POPRAND + "(Bernoulli): 1 cycle a vector, 21 (half) / 23 x workers"),
    "kernels.poprand.normal_cycles": FigureSource(
        "poplibs", _POPRAND + "(Normal): 4 cycles a vector, 22 (float) / 24 x workers"),
    "kernels.poprand.truncated_normal_cycles": FigureSource(
        "poplibs", _POPRAND + "(TruncatedNormal): (11 or 12 x iterations + 5) a vector"),
    "kernels.poprand.dropout_cycles": FigureSource(
        "poplibs", _POPRAND + "(Dropout): 6 + 24 x workers + 2 cycles a vector"),
    "kernels.poprand.set_seed_cycles": FigureSource(
        "poplibs", _POPRAND + "(SetSeed): 14 + 27 x workers"),
    "kernels.poprand.truncated_normal_iterations": FigureSource(
        "poplibs", "lib/poprand/RandomGen.cpp poprand::truncatedNormal: ceil(-4 / log10(erfc("
        "alpha / sqrt 2))) rounds (3 at alpha = 2, the cut a hardware-mode truncated normal "
        "is priced at: an estimate, the bounds being traced values)"),
})

_SYS = "docs/systems.md; "
FIGURE_SOURCES.update({
    "kernels.systems.IPUSystem.ipu_link_bytes_per_second": FigureSource(
        "poplibs", _SYS + "one IPU-Link, one direction: 128 Gibit/s at 0.85 efficiency (poplibs "
        "lib/poplibs_test/Util.cpp addGlobalExchangeConstraints); the same for the IPU-Link "
        "cables between machines (Bow-2000 datasheet: IPU-Link 512 Gbps a port = 2 links x "
        "128 Gbps x 2 directions)"),
    "kernels.systems.IPUSystem.gw_link_bytes_per_second": FigureSource(
        "datasheet", _SYS + "IPU-M2000 and Bow-2000 datasheets: 2 x 100 Gbps GW-Links a "
        "machine; 100 Gbps line rate a direction, no payload efficiency published"),
    "kernels.systems.IPUSystem.gw_links_per_machine": FigureSource(
        "datasheet", _SYS + "2 GW-Link ports on each IPU-M2000 / Bow-2000 front panel"),
    "kernels.systems.IPUSystem.gw_latency_seconds": FigureSource(
        "estimate", _SYS + "2 us a GW-Link hop (gateway to gateway over 100 GbE RoCE); "
        "nothing published"),
    "kernels.systems.IPUSystem.switch_latency_seconds": FigureSource(
        "estimate", _SYS + "1 us through a GW-Link switch; nothing published"),
    "kernels.systems.IPUSystem.execution_overhead_seconds": FigureSource(
        "measurement", _SYS + "53 ms an execution: the forward-only evaluation runs of "
        "MLPerf Training v2.0's Graphcore BERT on Bow Pod16 / 64 / 128 / 256 (PopART, SDK "
        "2.5.1; mlcommons/training_results_v2.0 logs, the gaps between training blocks), "
        "fitted as n x (F + (G + 8) x c), docs/published_bert.md#the-evaluation-gaps; "
        "assumed the same on IPU-M2000 PODs"),
    "kernels.systems.ladder_wraps_in_pod": FigureSource(
        "estimate", _SYS + "a POD's IPU-Link ladder closes into rings (top machine cabled to "
        "the bottom one), read from GCL's need for rings (Memory and Performance Optimisation "
        "guide, section 7: replicas in powers of two for the ring structure); the cabling "
        "itself is not quoted"),
    "kernels.collectives.sync_per_ring_step": FigureSource(
        "estimate", _SYS + "each ring step ends in a sync across the group's IPUs "
        "(IPUTarget.ipu_sync_cycles); a step over GW-Links adds a GW-Link latency each way"),
})

_POPSPARSE = "poplibs lib/popsparse/PerformanceEstimation.hpp "
FIGURE_SOURCES.update({
    "kernels.popsparse.block_product_cycles": FigureSource(
        "poplibs", _POPSPARSE + "sparseDenseBlockMultiply (float partials): per-block worker "
        "overhead and cycles per Z column by block size and input type, 64-bit coefficient "
        "loads and 3 + 12 cycles a block on the supervisor; Z split over workers as "
        "FullyConnectedPlan.cpp's ForwardAMPBlock method does"),
    "kernels.popsparse.element_product_cycles": FigureSource(
        "poplibs", _POPSPARSE + "sparseDenseElementwiseMultiply: 3 cycles per vector of 8 "
        "halves / 4 floats of Z per non-zero, per-row and entry overheads"),
    "kernels.popsparse.bucket_scan_cycles": FigureSource(
        "poplibs", _POPSPARSE + "supervisorCyclesWithBucketsNotForPN and ...ForPN, one "
        "sub-group a bucket: sparseDenseElementwiseMultiply 32 a sub-group skipped and "
        "47 + 46 for the one found; sparseDenseBlockMultiply (4x4, 8x8, 16x16) 33 and 46 + 56"),
    "kernels.popsparse.meta_info_words": FigureSource(
        "estimate", "16-bit words: a 4-word tile header, 2 per non-empty block row, 1 per "
        "non-zero block (after popsparse's meta-info layout; no published size formula)"),
    "kernels.popsparse.zero_partials_cycles": FigureSource(
        "poplibs", _POPSPARSE + "zeroPartialsCycles: 10 cycles then 64-bit stores per worker"),
    "kernels.popsparse.static_product_cycles": FigureSource(
        "poplibs", "lib/popsparse/StaticMatMulPartitioner.cpp matmulComputeCycles "
        "(StaticSparseDenseMatMulBlock 4x4 / 8x8 / 16x16 and StaticSparseDenseElementWise, "
        "data and partials of one type) on the planner's work split, tileWorkSplit"),
    "kernels.popsparse.static_output_chunk": FigureSource(
        "poplibs", "lib/popsparse/StaticMatMul.cpp:543-546 (out mapped linearly in grains of "
        "nGrainSize * mGrainSize: StaticMatMulPartitioner.cpp:78-80, 398-401) and "
        "lib/poputil/Util.cpp:143-147 (ceil(grains / tiles) grains a tile)"),
    "kernels.popsparse.static_zero_partials_cycles": FigureSource(
        "poplibs", "lib/popsparse/StaticMatMulPartitioner.cpp zeroingCycles (12 a worker, then "
        "64-bit stores), charged only for float partials of 8x8 and 16x16 blocks, as its "
        "planner does"),
    "kernels.estimators.partials_reduce_cycles": FigureSource(
        "poplibs", "lib/poplin/PerformanceEstimation.hpp getReduceCycleEstimate (poplin's "
        "ReduceAdd, single-input and supervisor variants; the single-input choice after "
        "ConvReducePlan.hpp checkPartialsSizeForSingleInputReduce, memory-element rounding "
        "left out)"),
})

# C++ vertices with neither Graph.set_perf_estimate nor the author's cycles
# function (ipu_jax/cpp_codelets/cost.py): the report marks them estimates.
FIGURE_SOURCES.update({
    "ipu_jax.cpp_codelets.cost.CYCLES_PER_ELEMENT": FigureSource(
        "estimate", "2 cycles per element a C++ vertex reads or writes (a compiled scalar "
        "loop's load, operation and store per element on a worker); not calibrated"),
    "ipu_jax.cpp_codelets.cost.VERTEX_OVERHEAD_CYCLES": FigureSource(
        "estimate", "20 cycles a C++ vertex call (entry, field pointers, return); not "
        "calibrated"),
})


def _figures() -> list:
  """Every IPUTarget field that is a hardware figure."""
  from ipu_jax.kernels.target import IPUTarget
  return [f.name for f in dataclasses.fields(IPUTarget)
          if f.name not in ("name", "num_ipus", "system", "io_tiles_per_ipu")]


def calibrated_figures() -> list:
  """Names of the figures backed by a datasheet or poplibs, sorted."""
  return sorted(k for k in _figures()
                if k in FIGURE_SOURCES and FIGURE_SOURCES[k].kind != "estimate")


def estimated_figures() -> list:
  """Names of the figures that are estimates (or have no recorded source), sorted."""
  return sorted(k for k in _figures()
                if k not in FIGURE_SOURCES or FIGURE_SOURCES[k].kind == "estimate")


def cost_model_json() -> dict:
  """The ``cost_model`` block of ``report.json``."""
  return {
      "version": COST_MODEL_VERSION,
      "calibrated": calibrated_figures(),
      "estimates": estimated_figures(),
  }
