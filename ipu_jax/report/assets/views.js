// The report page's PopVision-like views: program tree, execution trace on a
// time axis, per-tile liveness, vertex types and exchanges. Drawn from REPORT
// (ipu_jax/report/html.py); report.js's main() calls the render functions.
"use strict";

// Expands [first, count, value] runs over tiles into one tile's value.
function runValue(runs, tile) {
  for (const [first, count, value] of runs || []) {
    if (tile >= first && tile < first + count) return value;
  }
  return 0;
}

function cyclesOf(step) {
  return REPORT.steps.sync[step] + REPORT.steps.exchange[step] + REPORT.steps.compute[step];
}

function goToStep(step) {
  showStep(step);
  document.getElementById("step-panel").scrollIntoView({block: "nearest"});
}

// ---------------------------------------------------------------------------
// Program tree: nested <details>, each node with self and total cycles.
// ---------------------------------------------------------------------------

function treeNodeHtml(node, total, depth) {
  const share = fmtPct(node.total_cycles, total);
  const steps = node.steps.length ? `steps ${node.steps[0]}–${node.steps[1]}` : "no steps";
  const label = (node.branch ? `<i>${escapeHtml(node.branch)}:</i> ` : "") + escapeHtml(node.label);
  const figures = `<span class="tree-figures">${fmtInt(node.total_cycles)} cycles (${share})` +
    ` · self ${fmtInt(node.self_cycles)} · ×${fmtInt(node.executions)} per run · ${steps}</span>`;
  const attrs = `class="tree-node tree-${node.kind}" data-kind="${node.kind}"` +
    (node.iterations !== undefined ? ` data-iterations="${node.iterations}"` : "") +
    (node.steps.length ? ` data-first="${node.steps[0]}" data-last="${node.steps[1]}"` : "");
  const open = depth < 2 ? " open" : "";
  if (node.kind === "steps") {
    return `<details ${attrs}><summary>${label} ${figures}</summary><div class="tree-steps"></div></details>`;
  }
  const children = (node.children || []).map((c) => treeNodeHtml(c, total, depth + 1)).join("");
  return `<details ${attrs}${open}><summary><b>${label}</b> ${figures}</summary>${children}</details>`;
}

// A run's steps are listed when it is opened (a program may have thousands).
function fillStepRun(details) {
  const box = details.querySelector(".tree-steps");
  if (!box || box.dataset.filled) return;
  box.dataset.filled = "true";
  const first = Number(details.dataset.first), last = Number(details.dataset.last);
  const rows = [];
  for (let i = first; i <= last; i++) {
    rows.push(`<li><a href="#execution" data-step="${i}">${i}: ${escapeHtml(stepLabel(i))}</a> ` +
      `<span class="tree-figures">${fmtInt(cyclesOf(i))} cycles × ${fmtInt(REPORT.steps.executions[i])}` +
      ` · <span class="src">${escapeHtml(REPORT.steps.source[i] || "")}</span></span></li>`);
  }
  box.innerHTML = `<ol start="${first}">${rows.join("")}</ol>`;
  box.querySelectorAll("a[data-step]").forEach((a) => a.addEventListener("click", (event) => {
    event.preventDefault();
    goToStep(Number(a.dataset.step));
  }));
}

function renderProgramTree() {
  const tree = REPORT.program_tree;
  const box = document.getElementById("program-tree");
  if (!tree) { box.innerHTML = "<p class='hint'>No program tree in this report.</p>"; return; }
  box.innerHTML = treeNodeHtml(tree, tree.total_cycles || 1, 0);
  box.querySelectorAll("details.tree-steps, details.tree-node").forEach((d) => {
    if (d.dataset.kind === "steps") d.addEventListener("toggle", () => { if (d.open) fillStepRun(d); });
  });
}

// ---------------------------------------------------------------------------
// Execution trace: the steps at their cycle offsets, one lane per IPU.
// ---------------------------------------------------------------------------

const PHASE_COLOURS = [["sync", "#7f7f7f"], ["exchange", "#2ca02c"], ["compute", "#1f77b4"]];

function renderTrace() {
  const div = document.getElementById("trace-chart");
  const tl = REPORT.timeline, S_ = REPORT.steps, nIpus = REPORT.target.num_ipus;
  if (!tl || !tl.step.length) { div.innerHTML = "<p class='hint'>No supersteps.</p>"; return Promise.resolve(); }
  const lanes = [];
  for (let ipu = 0; ipu < nIpus; ipu++) lanes.push(`IPU ${ipu}`);
  const data = [];
  for (const [phase, colour] of PHASE_COLOURS) {
    const x = [], base = [], y = [], ids = [], text = [];
    tl.step.forEach((step, k) => {
      const repeat = tl.repeat[k];
      const sync = S_.sync[step] * repeat, exchange = S_.exchange[step] * repeat;
      for (const ipu of S_.ipus[step]) {
        const length = phase === "sync" ? sync : phase === "exchange" ? exchange
          : S_.compute_per_ipu[step][ipu] * repeat;
        if (!(length > 0)) continue;
        const offset = phase === "sync" ? 0 : phase === "exchange" ? sync : sync + exchange;
        x.push(length); base.push(tl.start[k] + offset); y.push(lanes[ipu]); ids.push(step);
        text.push(`${step}: ${stepLabel(step)}` + (repeat > 1 ? ` ×${repeat}` : ""));
      }
    });
    data.push({type: "bar", orientation: "h", name: phase, x: x, base: base, y: y, customdata: ids,
      hovertext: text, marker: {color: colour}, width: 0.7,
      hovertemplate: `%{hovertext}<br>${phase}: %{x:,} cycles from cycle %{base:,}<extra>%{y}</extra>`});
  }
  if (tl.summaries.length || tl.loops.length) {
    const loops = tl.loops.concat(tl.summaries.map((s) => Object.assign({summary: true}, s)));
    data.push({type: "bar", orientation: "h", name: "loops (summarised trips hatched)",
      x: loops.map((l) => l.cycles), base: loops.map((l) => l.start), y: loops.map(() => "loops"),
      customdata: loops.map((l) => l.steps[0]), hovertext: loops.map((l) => l.label), width: 0.6,
      marker: {color: loops.map((l) => (l.summary ? "#c5b0d5" : "rgba(148,103,189,0.25)")),
               pattern: {shape: loops.map((l) => (l.summary ? "/" : ""))}},
      hovertemplate: "%{hovertext}<br>%{x:,} cycles from cycle %{base:,}<extra></extra>"});
  }
  const layout = {
    height: 200 + 60 * (nIpus + 1), barmode: "overlay", hovermode: "closest",
    margin: {l: 70, r: 10, t: 40, b: 90},
    title: {x: 0.01, xanchor: "left", font: {size: 13},
      text: `Supersteps on a time axis (${fmtInt(tl.total_cycles)} cycles per run; each loop's first trips drawn, the rest summarised)`},
    legend: {orientation: "h", x: 0, xanchor: "left", y: -0.55, yanchor: "top"},
    xaxis: {title: {text: "cycles"}, tickformat: ",d", rangeslider: {thickness: 0.08}},
    yaxis: {type: "category", categoryorder: "array", categoryarray: ["loops"].concat(lanes),
            fixedrange: true, autorange: "reversed"},
  };
  return Plotly.newPlot(div, data, layout, PLOT_CONFIG).then(() => {
    div.on("plotly_click", (event) => goToStep(Number(event.points[0].customdata)));
  });
}

// ---------------------------------------------------------------------------
// Per-tile liveness: bytes on one tile at every superstep, by category.
// ---------------------------------------------------------------------------

// {category key: bytes per step} on `tile`, and the tensors placed on it.
function tileLiveness(tile) {
  const n = REPORT.steps.name.length, M_ = REPORT.memory, TE = REPORT.tile_exchange;
  const series = {};
  for (const c of M_.categories) {
    if (c.always_live) series[c.key] = new Array(n).fill(c.bytes[tile]);
  }
  const temporaries = new Array(n + 1).fill(0), tensors = [];
  for (const t of REPORT.tensors) {
    const bytes = bytesOnTile(t, tile);
    if (!(bytes > 0)) continue;
    tensors.push([t, bytes]);
    const category = M_.categories.find((c) => c.key === t.category);
    if (category && category.always_live) continue;
    temporaries[Math.max(0, t.live_from)] += bytes;
    temporaries[Math.min(n, t.live_to + 1)] -= bytes;
  }
  let running = 0;
  const temps = [], exchange = [];
  for (let s = 0; s < n; s++) {
    running += temporaries[s];
    temps.push(running + (TE ? runValue(TE.scratch[s], tile) : 0));
    exchange.push(TE ? runValue(TE.bytes_in[s], tile) : 0);
  }
  series.temporaries = temps;
  series.exchange_buffers = exchange;
  return {series, tensors};
}

function renderTileLiveness(tile) {
  const div = document.getElementById("tile-liveness-chart");
  const n = REPORT.steps.name.length;
  if (!n) return Promise.resolve();
  const {series, tensors} = tileLiveness(tile);
  const steps = [...Array(n).keys()];
  const data = REPORT.memory.categories.filter((c) => series[c.key]).map((c) => ({
    type: "scatter", mode: "lines", stackgroup: "bytes", name: c.label, x: steps, y: series[c.key],
    line: {width: 0.5, color: c.colour, shape: "hv"},
    hovertemplate: `${escapeHtml(c.label)}: %{y:,} B at superstep %{x}<extra></extra>`}));
  const totals = steps.map((s) => data.reduce((sum, d) => sum + d.y[s], 0));
  const peakStep = totals.indexOf(Math.max(...totals));
  const peak = totals[peakStep];
  const limit = REPORT.memory.tile_limit;
  const layout = {
    title: {x: 0.01, xanchor: "left", font: {size: 13},
      text: `${tileName(tile)}: bytes at every superstep (its peak ${fmtBytes(peak)} at superstep ${peakStep})`},
    height: 340, margin: {l: 80, r: 10, t: 40, b: 90}, hovermode: "x",
    legend: {orientation: "h", x: 0, xanchor: "left", y: -0.3, yanchor: "top"},
    xaxis: {title: {text: "superstep"}, ...integerTicks()},
    yaxis: {title: {text: "bytes on this tile"}, tickformat: ",d", fixedrange: true},
    shapes: [{type: "line", xref: "x", x0: peakStep, x1: peakStep, yref: "paper", y0: 0, y1: 1,
              line: {dash: "dot", color: "#d62728"}}],
  };
  if (peak > 0.5 * limit) {
    layout.shapes.push({type: "line", xref: "paper", x0: 0, x1: 1, y0: limit, y1: limit, line: {color: "red"}});
  }
  // Tensors on this tile live at its peak superstep (always-live ones too).
  const atPeak = tensors.filter(([t]) => {
    const c = REPORT.memory.categories.find((k) => k.key === t.category);
    return (c && c.always_live) || (t.live_from <= peakStep && peakStep <= t.live_to);
  }).sort((a, b) => b[1] - a[1]);
  const table = document.getElementById("tile-peak-tensors");
  table.innerHTML = `<h3 id="tile-peak-heading">Tensors on ${escapeHtml(tileName(tile))} at its peak ` +
    `(superstep ${peakStep}: ${escapeHtml(stepLabel(peakStep))}), ${atPeak.length}</h3>` +
    tableHtml("tile-peak-tensors-table", [{label: "Tensor"}, {label: "Category"}, {label: "Bytes here", num: true},
      {label: "Live"}, {label: "Source"}],
    atPeak.map(([t, bytes]) => [cell(escapeHtml(t.name), t.name), cell(escapeHtml(t.category)), numCell(bytes),
      cell(`${t.live_from}–${t.live_to}`, t.live_from), cell(`<span class="src">${escapeHtml(t.source)}</span>`, t.source)]));
  if (!REPORT.tile_exchange) {
    table.innerHTML += "<p class='hint'>This page leaves out the steps' own scratch and exchange buffers per tile " +
      "(too many to embed, or a report saved before they were recorded): the curve shows tensors only.</p>";
  }
  table.querySelectorAll("table").forEach(makeSortable);
  return Plotly.react(div, data, layout, PLOT_CONFIG);
}

// ---------------------------------------------------------------------------
// Vertex types and exchanges.
// ---------------------------------------------------------------------------

function renderCodelets() {
  const rows = REPORT.codelets || [];
  const wrap = document.getElementById("codelets-table");
  if (!rows.length) { wrap.innerHTML = "<p class='hint'>This report has no vertex types (saved before they were recorded).</p>"; return; }
  const compute = REPORT.totals.compute_cycles;
  const columns = [{label: "Vertex type (codelet)"}, {label: "Compute sets", num: true}, {label: "Executions", num: true},
    {label: "Cycles", num: true}, {label: "% of compute", num: true}, {label: "Vertices", num: true},
    {label: "Tiles", num: true}, {label: "Code bytes", num: true}, {label: "Vertex state bytes", num: true}];
  wrap.innerHTML = tableHtml("codelets", columns, rows.map((r) => [cell(`<span class="src">${escapeHtml(r.codelet)}</span>`, r.codelet),
    numCell(r.compute_sets), numCell(r.executions), numCell(r.cycles), cell(fmtPct(r.cycles, compute), r.cycles),
    cell(Number.isInteger(r.vertices) ? fmtInt(r.vertices) : r.vertices.toFixed(2), r.vertices),
    numCell(r.tiles), numCell(r.code_bytes), numCell(r.vertex_state_bytes)]));
  makeSortable(wrap.querySelector("table"));
}

const MAX_HEATMAP_ROWS = 400;

function exchangeSteps() {
  const S_ = REPORT.steps, out = [];
  for (let i = 0; i < S_.name.length; i++) {
    if (S_.bytes_in[i] > 0 || S_.bytes_out[i] > 0 || S_.ipu_link_bytes[i] > 0) out.push(i);
  }
  return out;
}

function renderExchanges() {
  const S_ = REPORT.steps, TE = REPORT.tile_exchange;
  const steps = exchangeSteps();
  const wrap = document.getElementById("exchanges-table");
  const columns = [{label: "Superstep", num: true}, {label: "Name"}, {label: "Bytes sent", num: true},
    {label: "Bytes received", num: true}, {label: "IPU-Link bytes", num: true}, {label: "Sending tiles", num: true},
    {label: "Receiving tiles", num: true}, {label: "Exchange cycles", num: true}, {label: "Executions", num: true}];
  const tiles = (runs) => (runs || []).reduce((sum, r) => sum + r[1], 0);
  wrap.innerHTML = tableHtml("exchanges", columns, steps.map((i) => [numCell(i), cell(escapeHtml(stepLabel(i))),
    numCell(S_.bytes_out[i]), numCell(S_.bytes_in[i]), numCell(S_.ipu_link_bytes[i]),
    numCell(TE ? tiles(TE.bytes_out[i]) : 0), numCell(TE ? tiles(TE.bytes_in[i]) : 0),
    numCell(S_.exchange[i]), numCell(S_.executions[i])]));
  makeSortable(wrap.querySelector("table"));
  const div = document.getElementById("exchange-heatmap");
  if (!TE || !steps.length) {
    div.innerHTML = "<p class='hint'>No per-tile exchange bytes in this report.</p>";
    return Promise.resolve();
  }
  const which = document.getElementById("exchange-direction").value;
  const nTiles = REPORT.target.num_tiles;
  // Rows x tiles cells: past MAX_HEATMAP_ROWS exchanges, the ones moving the
  // most bytes (in program order), as the title says.
  let shown = steps;
  if (steps.length > MAX_HEATMAP_ROWS) {
    const heaviest = new Set([...steps].sort((a, b) => (S_.bytes_out[b] + S_.bytes_in[b]) -
      (S_.bytes_out[a] + S_.bytes_in[a])).slice(0, MAX_HEATMAP_ROWS));
    shown = steps.filter((i) => heaviest.has(i));
  }
  const z = shown.map((i) => {
    // Tiles moving nothing stay blank (null), apart from the ones moving a little.
    const row = new Array(nTiles).fill(null);
    for (const [first, count, value] of TE[which === "sent" ? "bytes_out" : "bytes_in"][i]) {
      for (let k = 0; k < count; k++) row[first + k] = value;
    }
    return row;
  });
  const trace = {type: "heatmap", z: z, x: [...Array(nTiles).keys()], y: shown.map((i) => `${i}`),
    colorscale: "YlOrRd", reversescale: true, hoverongaps: false, zmin: 0,
    hovertemplate: `superstep %{y}<br>tile %{x}: %{z:,} B ${which}<extra></extra>`,
    colorbar: {title: {text: `bytes ${which}`}, tickformat: ",d"}};
  const layout = {
    title: {x: 0.01, xanchor: "left", font: {size: 13},
      text: `Bytes ${which} per tile in each exchange (${shown.length < steps.length ?
        `the ${shown.length} moving the most bytes of ` : ""}${steps.length} exchanges)`},
    height: Math.min(720, 160 + 14 * shown.length), margin: {l: 70, r: 10, t: 40, b: 50},
    xaxis: {title: {text: "tile"}}, yaxis: {title: {text: "superstep"}, type: "category", autorange: "reversed"},
  };
  return Plotly.react(div, [trace], layout, PLOT_CONFIG).then(() => {
    if (!div.dataset.clickable) {
      div.dataset.clickable = "true";
      div.on("plotly_click", (event) => goToStep(Number(event.points[0].y)));
    }
  });
}

function renderViews() {
  renderProgramTree();
  renderCodelets();
  document.getElementById("exchange-direction").addEventListener("change", renderExchanges);
  return Promise.all([renderTrace(), renderExchanges()]);
}
