// The comparison page of two reports: totals, memory and cycles side by
// side, with every change highlighted (B - A: red grew, green shrank).
"use strict";

const A = REPORT.a, B = REPORT.b;

function change(a, b) {
  if (a === b) return "0.0%";
  if (a === 0) return "new";
  return `${b > a ? "+" : ""}${(100 * (b - a) / Math.abs(a)).toFixed(1)}%`;
}

// Lower is better for everything compared here (bytes, cycles, time).
function deltaClass(a, b) {
  return b > a ? "worse" : b < a ? "better" : "";
}

function deltaCells(a, b, formatter) {
  const fmt = formatter || fmtInt;
  const cls = deltaClass(a, b);
  return [numCell(a, fmt), numCell(b, fmt),
          cell(`${b - a > 0 ? "+" : ""}${fmt(b - a)}`, b - a, cls), cell(change(a, b), b - a, cls)];
}

function categoryTotals(report, reduce) {
  const out = {};
  for (const c of report.memory.categories) out[c.label] = reduce(c.bytes);
  return out;
}

const sum = (values) => values.reduce((x, y) => x + y, 0);
const max = (values) => values.reduce((x, y) => Math.max(x, y), 0);

function renderTotals() {
  document.getElementById("title").textContent =
    `A: ${A.name} (${A.target.name}, ${fmtInt(A.target.num_tiles)} tiles) vs ` +
    `B: ${B.name} (${B.target.name}, ${fmtInt(B.target.num_tiles)} tiles)`;
  const metrics = [
    ["Step cycles (host I/O included where streamed)", "step_cycles"],
    ["Total cycles", "cycles"], ["Compute cycles", "compute_cycles"], ["Exchange cycles", "exchange_cycles"],
    ["Sync cycles", "sync_cycles"], ["Supersteps executed", "num_supersteps_executed"], ["FLOPs", "flops"],
    ["Memory over device (bytes)", "memory_bytes"], ["Peak tile bytes", "peak_tile_bytes"],
    ["Tiles used", "tiles_used"],
  ];
  const rows = metrics.map(([label, key]) => [cell(label), ...deltaCells(A.totals[key], B.totals[key])]);
  rows.push([cell("Estimated time (µs)"), ...deltaCells(A.totals.estimated_seconds * 1e6,
    B.totals.estimated_seconds * 1e6, (v) => v.toFixed(3))]);
  const columns = [{label: ""}, {label: "A", num: true}, {label: "B", num: true},
                   {label: "Delta (B−A)", num: true}, {label: "Change", num: true}];
  const wrap = document.getElementById("totals-table");
  wrap.innerHTML = tableHtml("totals", columns, rows);
}

function groupedBars(div, title, labels, valuesA, valuesB, yTitle) {
  const deltas = labels.map((_, i) => valuesB[i] - valuesA[i]);
  return Plotly.newPlot(div, [
    {type: "bar", name: `A: ${A.name}`, x: labels, y: valuesA, marker: {color: "#1f77b4"}},
    {type: "bar", name: `B: ${B.name}`, x: labels, y: valuesB, marker: {color: "#ff7f0e"},
     text: deltas.map((d, i) => d ? `${d > 0 ? "+" : ""}${fmtInt(d)} (${change(valuesA[i], valuesB[i])})` : ""),
     textposition: "outside", hovertemplate: "%{x}: %{y:,}<br>%{text}<extra>B</extra>"},
  ], {title: {x: 0.01, xanchor: "left", text: title, font: {size: 13}}, barmode: "group", height: 440,
      margin: {l: 80, r: 10, t: 40, b: 140}, yaxis: {title: {text: yTitle}, tickformat: ",d"},
      xaxis: {automargin: true},
      // Below the axis, clear of plotly's toolbar at the top right.
      legend: {orientation: "h", y: 0, yref: "container", yanchor: "bottom", x: 0, xanchor: "left"}}, PLOT_CONFIG);
}

function renderMemory() {
  const sameTiles = A.target.num_tiles === B.target.num_tiles;
  const traces = [
    {type: "scatter", mode: "lines", name: `A: ${A.name}`, y: A.memory.peak, line: {shape: "hvh", color: "#1f77b4"}},
    {type: "scatter", mode: "lines", name: `B: ${B.name}`, y: B.memory.peak, line: {shape: "hvh", color: "#ff7f0e"}},
  ];
  const layout = {title: {x: 0.01, xanchor: "left", text: "Bytes at each tile's peak" +
                          (sameTiles ? ", and B − A per tile (bars: red grew, green shrank)" : ""), font: {size: 13}},
                  height: 460, margin: {l: 80, r: 10, t: 40, b: 80}, hovermode: "x",
                  xaxis: {title: {text: "tile"}}, yaxis: {title: {text: "bytes"}, tickformat: ",d"},
                  legend: {orientation: "h", y: 0, yref: "container", yanchor: "bottom", x: 0, xanchor: "left"}};
  if (sameTiles) {
    const delta = A.memory.peak.map((a, i) => B.memory.peak[i] - a);
    traces.push({type: "bar", name: "B − A", y: delta, yaxis: "y2",
                 marker: {color: delta.map((d) => d > 0 ? "#d62728" : "#2ca02c")}});
    layout.yaxis.domain = [0.4, 1];
    layout.yaxis2 = {domain: [0, 0.32], title: {text: "B − A"}, tickformat: ",d"};
    // Whole bytes only: a flat zero line would otherwise tick at ±0.5 shown as ±1.
    if (delta.every((d) => d === 0)) Object.assign(layout.yaxis2, {range: [-1, 1], dtick: 1});
  }
  const labels = Array.from(new Set([...A.memory.categories, ...B.memory.categories].map((c) => c.label)));
  const totalsA = categoryTotals(A, sum), totalsB = categoryTotals(B, sum);
  const peakTileA = A.totals.peak_tile, peakTileB = B.totals.peak_tile;
  const onPeakA = {}, onPeakB = {};
  for (const c of A.memory.categories) onPeakA[c.label] = c.bytes[peakTileA];
  for (const c of B.memory.categories) onPeakB[c.label] = c.bytes[peakTileB];
  return Promise.all([
    Plotly.newPlot("memory-per-tile", traces, layout, PLOT_CONFIG),
    groupedBars("memory-categories", "Memory by category, summed over tiles (each tile at its own peak)", labels,
                labels.map((l) => totalsA[l] || 0), labels.map((l) => totalsB[l] || 0), "bytes"),
    groupedBars("memory-peak-tile", `Memory by category on the peak tile (A: tile ${peakTileA}, B: tile ${peakTileB})`,
                labels, labels.map((l) => onPeakA[l] || 0), labels.map((l) => onPeakB[l] || 0), "bytes"),
  ]);
}

function opsByName(report) {
  const out = {};
  for (const row of report.operations) {
    const entry = out[row.op] ||= {cycles: 0, memory: 0};
    entry.cycles += row.cycles;
    entry.memory = Math.max(entry.memory, row.memory);
  }
  return out;
}

function renderCycles() {
  const phases = ["compute_cycles", "exchange_cycles", "sync_cycles", "cycles"];
  const opsA = opsByName(A), opsB = opsByName(B);
  const ops = Array.from(new Set([...Object.keys(opsA), ...Object.keys(opsB)]))
    .sort((x, y) => Math.max((opsB[y] || {}).cycles || 0, (opsA[y] || {}).cycles || 0) -
                    Math.max((opsB[x] || {}).cycles || 0, (opsA[x] || {}).cycles || 0));
  const top = ops.slice(0, 15);
  return Promise.all([
    groupedBars("cycles-phases", "Cycles by phase", ["compute", "exchange", "sync", "total"],
                phases.map((p) => A.totals[p]), phases.map((p) => B.totals[p]), "cycles"),
    groupedBars("cycles-operations", `Cycles by operation (top ${top.length} of ${ops.length})`, top,
                top.map((op) => (opsA[op] || {}).cycles || 0), top.map((op) => (opsB[op] || {}).cycles || 0),
                "cycles"),
  ]).then(() => {
    const columns = [{label: "Operation"}, {label: "Cycles A", num: true}, {label: "Cycles B", num: true},
      {label: "Cycles Δ", num: true}, {label: "Cycles change", num: true},
      {label: "Working memory A", num: true}, {label: "Working memory B", num: true},
      {label: "Working memory Δ", num: true}, {label: "Working memory change", num: true}];
    const rows = ops.map((op) => {
      const a = opsA[op] || {cycles: 0, memory: 0}, b = opsB[op] || {cycles: 0, memory: 0};
      return [cell(escapeHtml(op), op), ...deltaCells(a.cycles, b.cycles), ...deltaCells(a.memory, b.memory)];
    });
    const wrap = document.getElementById("operations-table");
    wrap.innerHTML = tableHtml("operations", columns, rows);
    makeSortable(wrap.querySelector("table"));
  });
}

// Loss scale and FP8 scales of A and B (the section shows when either has them).
function renderNumberFormats() {
  const nf = REPORT.number_formats;
  if (!nf) return Promise.resolve();
  document.getElementById("number-formats").hidden = false;
  document.getElementById("number-formats-link").hidden = false;
  const columns = [{label: ""}, {label: "A", num: true}, {label: "B", num: true},
                   {label: "Delta (B−A)", num: true}, {label: "Change", num: true}];
  const rows = nf.rows.map((row) => row.map((text) => cell(escapeHtml(text), text)));
  document.getElementById("number-formats-table").innerHTML = tableHtml("number-formats", columns, rows);
  const runs = [["A", A, "#1f77b4"], ["B", B, "#ff7f0e"]];
  const plots = [];
  const lossTraces = runs.filter(([, r]) => r.number_formats && r.number_formats.loss_scaling).map(
    ([label, r, colour]) => ({type: "scatter", mode: "lines+markers", line: {shape: "hv", color: colour},
      name: `${label}: ${r.name}`, x: r.number_formats.loss_scaling.steps, y: r.number_formats.loss_scaling.scale}));
  if (lossTraces.length) {
    plots.push(Plotly.newPlot("loss-scale-chart", lossTraces, {
      title: {x: 0.01, xanchor: "left", text: "Loss scale", font: {size: 13}}, height: 360,
      margin: {l: 70, r: 10, t: 40, b: 40}, xaxis: {title: {text: "step"}},
      yaxis: {title: {text: "loss scale"}, type: "log", exponentformat: "power"}}, PLOT_CONFIG));
  } else {
    document.getElementById("loss-scale-chart").innerHTML = "<p class='hint'>No loss scaling recorded.</p>";
  }
  const fp8Traces = runs.filter(([, r]) => r.number_formats && (r.number_formats.fp8_tensors || []).length).map(
    ([label, r, colour]) => ({type: "histogram", name: `${label}: ${r.name}`, opacity: 0.6, xbins: {size: 1},
      marker: {color: colour}, x: r.number_formats.fp8_tensors.flatMap((t) => t.log2_scale)}));
  if (fp8Traces.length) {
    plots.push(Plotly.newPlot("fp8-scales-chart", fp8Traces, {
      title: {x: 0.01, xanchor: "left", text: "FP8 per-tensor log2 scales (tensors × steps)", font: {size: 13}},
      barmode: "overlay", height: 360, margin: {l: 60, r: 10, t: 40, b: 40},
      xaxis: {title: {text: "log2 scale"}, dtick: 1}, yaxis: {title: {text: "tensors × steps"}}}, PLOT_CONFIG));
  } else {
    document.getElementById("fp8-scales-chart").innerHTML = "<p class='hint'>No FP8 tensors recorded.</p>";
  }
  return Promise.all(plots);
}

renderTotals();
Promise.all([renderMemory(), renderCycles(), renderNumberFormats()]).then(() => {
  document.body.dataset.ready = "true";
});
