// The report page: tile memory map, liveness, execution lanes, tile balance
// and the operations table, drawn from REPORT (see ipu_jax/report/html.py).
"use strict";

const T = REPORT.target, M = REPORT.memory, S = REPORT.steps;
const NUM_STEPS = S.name.length;

function stepLabel(i) {
  return S.name[i] || S.op[i] || `step ${i}`;
}

function tileName(tile) {
  return T.num_ipus > 1 ? `tile ${tile} (IPU ${Math.floor(tile / T.tiles_per_ipu)})` : `tile ${tile}`;
}

// Bytes a tensor holds on `tile`, from its run-length placement.
function bytesOnTile(tensor, tile) {
  for (const [first, count, bytes] of tensor.placement || []) {
    if (tile >= first && tile < first + count) return bytes;
  }
  return 0;
}

// The first cards: the step as the system runs it (host I/O included where the
// program streams data each iteration), then the device-only cycles beside it.
function stepCards(totals) {
  const step = totals.step_cycles === undefined ? totals.cycles : totals.step_cycles;
  const seconds = totals.step_seconds === undefined ? totals.estimated_seconds : totals.step_seconds;
  const time = `${(seconds * 1e6).toFixed(2)} µs`;
  if (!totals.step_includes_host_io) {
    return [["Step cycles (device only, no data streamed each iteration)", fmtInt(step)],
            ["Estimated step time", time]];
  }
  return [["Step cycles (host I/O included)", fmtInt(step)],
          ["Device cycles (host I/O excluded)", fmtInt(totals.cycles)],
          ["Estimated step time (host I/O included)", time]];
}

function renderHeader() {
  const totals = REPORT.totals;
  document.getElementById("title").textContent =
    `${REPORT.name} — ${T.name}, ${T.num_ipus} IPU(s), ${fmtInt(T.num_tiles)} tiles`;
  const cards = [
    ...stepCards(totals),
    ["Device compute / exchange / sync", `${fmtPct(totals.compute_cycles, totals.cycles)} / ` +
      `${fmtPct(totals.exchange_cycles, totals.cycles)} / ${fmtPct(totals.sync_cycles, totals.cycles)}`],
    ["Peak tile (bytes at its own peak)", `${tileName(totals.peak_tile)}: ${fmtBytes(totals.peak_tile_bytes)}`],
    ["SRAM per tile", fmtBytes(M.tile_limit)],
    ["Device peak (live at one superstep)", fmtBytes(Math.max(0, ...REPORT.liveness.not_always_live) + REPORT.liveness.always_live_bytes)],
    ["Sum of tile peaks (each tile at its own peak)", fmtBytes(totals.memory_bytes)],
    ["Tiles used", `${fmtInt(totals.tiles_used)} / ${fmtInt(T.num_tiles)}`],
    ["Supersteps", `${fmtInt(totals.num_supersteps)} (${fmtInt(totals.num_supersteps_executed)} executed)`],
    ["FLOPs", fmtInt(totals.flops)],
  ];
  document.getElementById("cards").innerHTML = cards.map(([k, v]) =>
    `<div class="card">${escapeHtml(k)}<b>${escapeHtml(v)}</b></div>`).join("");
}

// ---------------------------------------------------------------------------
// Memory: the tile map and the tile panel.
// ---------------------------------------------------------------------------

function renderTileMap() {
  const {columns, rows} = REPORT.grid;
  const z = [], ids = [], tickvals = [], ticktext = [];
  for (let ipu = 0; ipu < T.num_ipus; ipu++) {
    if (ipu > 0) { z.push(new Array(columns).fill(null)); ids.push(new Array(columns).fill(null)); }
    tickvals.push(z.length + (rows - 1) / 2);
    ticktext.push(`IPU ${ipu}`);
    for (let r = 0; r < rows; r++) {
      const zr = [], ir = [];
      for (let c = 0; c < columns; c++) {
        const local = r * columns + c;
        const tile = ipu * T.tiles_per_ipu + local;
        zr.push(local < T.tiles_per_ipu ? M.peak[tile] : null);
        ir.push(local < T.tiles_per_ipu ? tile : null);
      }
      z.push(zr); ids.push(ir);
    }
  }
  const maxPeak = Math.max(1, ...M.peak);
  // Tile numbers: in each cell where they fit, else the first tile of each row.
  const numbered = T.tiles_per_ipu <= 256;
  const trace = {
    type: "heatmap", z: z, customdata: ids, colorscale: "Viridis", zmin: 0, zmax: maxPeak,
    xgap: 1, ygap: 1, hoverongaps: false,
    hovertemplate: "tile %{customdata}<br>%{z:,} B at peak<extra></extra>",
    colorbar: {title: {text: "bytes"}, tickformat: ",d"},
  };
  if (numbered) {
    // Heatmap text templates read `text`, not `customdata`.
    const text = ids.map((row) => row.map((tile) => (tile === null ? "" : String(tile))));
    Object.assign(trace, {text: text, texttemplate: "%{text}", textfont: {size: 9, color: "#fff"}});
  }
  const layout = {
    title: {x: 0.01, xanchor: "left", text: `Bytes at each tile's peak (max ${fmtBytes(maxPeak)}; SRAM ${fmtBytes(M.tile_limit)} per tile)`,
            font: {size: 13}},
    height: Math.min(760, 140 + z.length * (T.num_tiles > 256 ? 14 : 36)),
    margin: {l: 60, r: 10, t: 40, b: 20},
    xaxis: {showticklabels: false, showgrid: false, zeroline: false},
    yaxis: {autorange: "reversed", tickvals: tickvals, ticktext: ticktext, showgrid: false, zeroline: false},
    hovermode: "closest",
    legend: {orientation: "h", x: 0, xanchor: "left", y: -0.02, yanchor: "top"},
  };
  if (!numbered) {
    // Each row labelled with its first tile; columns with the offset in the row.
    layout.yaxis.tickvals = [], layout.yaxis.ticktext = [];
    for (let ipu = 0; ipu < T.num_ipus; ipu++) {
      for (let r = 0; r < rows; r += Math.max(1, Math.ceil(rows / 10))) {
        layout.yaxis.tickvals.push(ipu * (rows + 1) + r);
        layout.yaxis.ticktext.push(`${r === 0 && T.num_ipus > 1 ? `IPU ${ipu}: ` : ""}tile ${ipu * T.tiles_per_ipu + r * columns}`);
      }
    }
    layout.xaxis = {showticklabels: true, title: {text: "column (tile = the row's first tile + column)"},
                    showgrid: false, zeroline: false, dtick: 10};
    layout.margin.b = 90;
    layout.height += 70;
    layout.legend.y = -0.16;
    layout.margin.l = 110;
  }
  const over = [];
  M.peak.forEach((bytes, tile) => { if (bytes > M.tile_limit) over.push(tile); });
  const data = [trace];
  if (over.length) {
    data.push({type: "scatter", mode: "markers", name: "over the SRAM limit",
      x: over.map((t) => (t % T.tiles_per_ipu) % columns),
      y: over.map((t) => Math.floor(t / T.tiles_per_ipu) * (rows + 1) +
                         Math.floor((t % T.tiles_per_ipu) / columns)),
      customdata: over, marker: {symbol: "x", color: "red", size: 8},
      hovertemplate: "tile %{customdata} over the limit<extra></extra>"});
  }
  data.push(tileMarker("peak tile", REPORT.totals.peak_tile, "star", "#d62728"));
  data.push(tileMarker("selected tile", -1, "square-open", "#ff00ff"));
  const div = document.getElementById("tile-map");
  return Plotly.newPlot(div, data, layout, PLOT_CONFIG).then(() => {
    div.on("plotly_click", (event) => {
      const tile = event.points[0].customdata;
      if (tile !== null && tile !== undefined) showTile(Number(tile));
    });
  });
}

// A marker on one tile of the map (the peak tile, the selected tile).
function tilePosition(tile) {
  const {columns, rows} = REPORT.grid;
  const local = tile % T.tiles_per_ipu;
  return [local % columns, Math.floor(tile / T.tiles_per_ipu) * (rows + 1) + Math.floor(local / columns)];
}

function tileMarker(name, tile, symbol, colour) {
  const [x, y] = tile >= 0 ? tilePosition(tile) : [null, null];
  return {type: "scatter", mode: "markers", name: name, x: [x], y: [y], customdata: [tile],
    marker: {symbol: symbol, color: colour, size: 12, line: {width: 2, color: colour}},
    hovertemplate: `${name}: tile %{customdata}<extra></extra>`};
}

function markSelectedTile(tile) {
  const div = document.getElementById("tile-map");
  if (!div.data) return;
  const index = div.data.findIndex((t) => t.name === "selected tile");
  const [x, y] = tilePosition(tile);
  Plotly.restyle(div, {x: [[x]], y: [[y]], customdata: [[tile]]}, [index]);
}

function showTile(tile) {
  if (!(tile >= 0 && tile < T.num_tiles)) return;
  markSelectedTile(tile);
  renderTileLiveness(tile);
  const peak = M.peak[tile];
  const step = M.peak_step[tile];
  const overLimit = peak > M.tile_limit;
  let html = `<h3 id="tile-heading">${escapeHtml(tileName(tile))}</h3><div class="key">` +
    `<span>Peak bytes</span><span class="${overLimit ? "over" : ""}" id="tile-peak-bytes">${fmtBytes(peak)}</span>` +
    `<span>SRAM limit</span><span>${fmtBytes(M.tile_limit)} (${fmtPct(peak, M.tile_limit)} used)</span>` +
    `<span>Peak superstep</span><span>${step >= 0 ? `${step}: ${escapeHtml(stepLabel(step))}` +
      (S.source[step] ? ` <small class="src">${escapeHtml(S.source[step])}</small>` : "") : "always-live only"}</span></div>`;
  html += "<h3>By category (at the tile's peak)</h3>" + tableHtml("tile-categories",
    [{label: "Category"}, {label: "Bytes", num: true}, {label: "% of SRAM", num: true}],
    M.categories.map((c) => [cell(escapeHtml(c.label) + (c.always_live ? "" : " <small>(not always live)</small>"), c.label),
                             numCell(c.bytes[tile]), cell(fmtPct(c.bytes[tile], M.tile_limit), c.bytes[tile])]));
  const tensors = [];
  for (const tensor of REPORT.tensors) {
    const bytes = bytesOnTile(tensor, tile);
    if (bytes > 0) tensors.push([tensor, bytes]);
  }
  tensors.sort((a, b) => b[1] - a[1]);
  const byCategory = {};
  for (const [tensor, bytes] of tensors) (byCategory[tensor.category] ||= []).push([tensor, bytes]);
  const anyPlacement = REPORT.tensors.some((t) => t.placement);
  if (!anyPlacement) {
    html += "<p class='hint'>This report predates tensor placement (version 1); save it again to see tensors per tile.</p>";
  }
  for (const c of M.categories) {
    const list = byCategory[c.key];
    if (!list) continue;
    html += `<h3>${escapeHtml(c.label)} on this tile (${list.length})</h3>` + tableHtml(`tile-tensors-${c.key}`,
      [{label: "Tensor"}, {label: "Bytes here", num: true}, {label: "Live", sortable: false},
       {label: "At peak", sortable: false}, {label: "Op"}, {label: "Source"}],
      list.map(([t, bytes]) => {
        const alwaysLive = c.always_live;
        const atPeak = alwaysLive || (step >= t.live_from && step <= t.live_to);
        return [cell(`${escapeHtml(t.name)} <small>${escapeHtml(t.dtype)}[${t.shape.join(",")}]</small>`, t.name),
                numCell(bytes), cell(alwaysLive ? "always" : `${t.live_from}–${t.live_to}`, t.live_from),
                cell(atPeak ? "✓" : ""), cell(escapeHtml(t.op)), cell(`<small class="src">${escapeHtml(t.source)}</small>`, t.source)];
      }));
  }
  const panel = document.getElementById("tile-panel");
  panel.innerHTML = html;
  panel.querySelectorAll("table").forEach(makeSortable);
  document.getElementById("tile-input").value = tile;
}

// ---------------------------------------------------------------------------
// Liveness.
// ---------------------------------------------------------------------------

// Superstep axes tick whole steps (plotly would put ticks at 0.5 for a few).
function integerTicks() {
  return NUM_STEPS <= 20 ? {tick0: 0, dtick: 1} : {};
}

function renderLiveness() {
  const live = REPORT.liveness.not_always_live;
  const div = document.getElementById("liveness-chart");
  if (!live.length) { div.innerHTML = "<p class='hint'>No supersteps.</p>"; return Promise.resolve(); }
  const steps = live.map((_, i) => i);
  const trace = {type: "bar", x: steps, y: live, marker: {color: "#ff7f0e"},
    customdata: steps.map((i) => stepLabel(i)),
    hovertemplate: "superstep %{x}: %{customdata}<br>%{y:,} B not always live<extra></extra>"};
  const layout = {
    title: {x: 0.01, xanchor: "left", font: {size: 13},
            text: "Not-always-live bytes on the device (all tiles) per superstep" +
                  `<br><sub>always-live bytes on top of these: ${fmtBytes(REPORT.liveness.always_live_bytes)}</sub>`},
    height: 380, margin: {l: 80, r: 10, t: 55, b: 40}, bargap: 0,
    xaxis: {title: {text: "superstep"}, rangeslider: {thickness: 0.12}, ...integerTicks()},
    yaxis: {title: {text: "bytes"}, tickformat: ",d", fixedrange: true}, hovermode: "x",
  };
  return Plotly.newPlot(div, [trace], layout, PLOT_CONFIG).then(() => {
    div.on("plotly_click", (event) => showLive(event.points[0].x));
  });
}

function showLive(step) {
  const live = REPORT.liveness.not_always_live;
  const rows = REPORT.tensors.filter((t) => {
    const category = M.categories.find((c) => c.key === t.category);
    return !(category && category.always_live) && t.live_from <= step && step <= t.live_to;
  }).sort((a, b) => b.total_bytes - a.total_bytes);
  let html = `<h3 id="live-heading">Superstep ${step}: ${escapeHtml(stepLabel(step))}</h3><div class="key">` +
    `<span>Not always live</span><span>${fmtBytes(live[step])}</span>` +
    `<span>Step's working memory</span><span>${fmtBytes(S.working_memory[step])} on its busiest tile</span>` +
    `<span>Source</span><span class="src">${escapeHtml(S.source[step] || "?")}</span></div>`;
  html += `<h3>Tensors live here (${rows.length})</h3>` + tableHtml("live-tensors",
    [{label: "Tensor"}, {label: "Bytes", num: true}, {label: "Live", num: true}, {label: "Op"}, {label: "Source"}],
    rows.map((t) => [cell(`${escapeHtml(t.name)} <small>${escapeHtml(t.dtype)}[${t.shape.join(",")}]</small>`, t.name),
                     numCell(t.total_bytes), cell(`${t.live_from}–${t.live_to}`, t.live_from),
                     cell(escapeHtml(t.op)), cell(`<small class="src">${escapeHtml(t.source)}</small>`, t.source)]));
  const panel = document.getElementById("liveness-panel");
  panel.innerHTML = html;
  panel.querySelectorAll("table").forEach(makeSortable);
}

// ---------------------------------------------------------------------------
// Execution: lanes per IPU, tile balance, step details.
// ---------------------------------------------------------------------------

function renderExecution() {
  const div = document.getElementById("execution-chart");
  if (!NUM_STEPS) { div.innerHTML = "<p class='hint'>No supersteps.</p>"; return Promise.resolve(); }
  const steps = S.name.map((_, i) => i);
  const lanes = T.num_ipus;
  const gap = 0.04, height = (1 - gap * (lanes - 1)) / lanes;
  const data = [], layout = {
    height: 220 + 170 * lanes, barmode: "stack", bargap: 0, hovermode: "x",
    margin: {l: 80, r: 10, t: 40, b: 90},
    title: {x: 0.01, xanchor: "left", text: "Cycles per superstep × executions (by superstep index; the trace above is on a time axis)", font: {size: 13}},
    legend: {orientation: "h", x: 0, xanchor: "left", y: -0.12, yanchor: "top"},
    xaxis: {title: {text: "superstep"}, rangeslider: {thickness: 0.08}, ...integerTicks()},
  };
  const phases = [["sync", "#7f7f7f"], ["exchange", "#2ca02c"], ["compute", "#1f77b4"]];
  for (let ipu = 0; ipu < lanes; ipu++) {
    const axis = ipu === 0 ? "y" : `y${ipu + 1}`;
    const top = 1 - ipu * (height + gap);
    layout[ipu === 0 ? "yaxis" : `yaxis${ipu + 1}`] = {
      domain: [Math.max(0, top - height), top], title: {text: `IPU ${ipu}`}, tickformat: ",d", fixedrange: true};
    for (const [phase, colour] of phases) {
      const y = steps.map((i) => {
        const runsHere = S.ipus[i].includes(ipu);
        const cycles = phase === "compute" ? S.compute_per_ipu[i][ipu] : runsHere ? S[phase][i] : 0;
        return cycles * S.executions[i];
      });
      data.push({type: "bar", name: phase, x: steps, y: y, yaxis: axis, marker: {color: colour},
        legendgroup: phase, showlegend: ipu === 0, customdata: steps.map((i) => stepLabel(i)),
        hovertemplate: `IPU ${ipu} ${phase}: %{y:,} cycles<br>%{customdata}<extra></extra>`});
    }
  }
  return Plotly.newPlot(div, data, layout, PLOT_CONFIG).then(() => {
    div.on("plotly_click", (event) => showStep(event.points[0].x));
  });
}

function stepTileCycles(step) {
  if (!REPORT.tile_cycles) return null;
  const cycles = new Array(T.num_tiles).fill(0);
  for (const [first, count, value] of REPORT.tile_cycles[step]) {
    for (let k = 0; k < count; k++) cycles[first + k] = value;
  }
  return cycles;
}

function showStep(step) {
  const cycles = stepTileCycles(step);
  const balance = document.getElementById("balance-chart");
  if (cycles) {
    const tiles = cycles.map((_, i) => i);
    Plotly.react(balance, [{type: "bar", x: tiles, y: cycles, marker: {color: "#1f77b4"},
      hovertemplate: "tile %{x}: %{y:,} cycles<extra></extra>"}], {
      title: {x: 0.01, xanchor: "left", text: `Tile balance of superstep ${step} (${escapeHtml(stepLabel(step))})`, font: {size: 13}},
      height: 320, margin: {l: 70, r: 10, t: 40, b: 40}, bargap: 0,
      xaxis: {title: {text: "tile"}}, yaxis: {title: {text: "compute cycles"}, tickformat: ",d"},
      shapes: [{type: "line", xref: "paper", x0: 0, x1: 1, y0: S.compute_mean[step], y1: S.compute_mean[step],
                line: {dash: "dot", color: "#d62728"}}],
      annotations: [{xref: "paper", x: 1, y: S.compute_mean[step], xanchor: "right", yanchor: "bottom",
                     text: `mean ${fmtInt(S.compute_mean[step])}`, showarrow: false, font: {color: "#d62728"}}],
    }, PLOT_CONFIG);
  } else {
    balance.innerHTML = "<p class='hint'>This report has no per-tile cycles (saved before version 2).</p>";
  }
  const executions = S.executions[step];
  const total = S.sync[step] + S.exchange[step] + S.compute[step];
  const balanceRatio = S.compute[step] ? S.compute_mean[step] / S.compute[step] : 1;
  const rows = [
    ["Name", `<span class="src">${escapeHtml(stepLabel(step))}</span>`], ["Operation", escapeHtml(S.op[step])],
    ["Vertex types", `<span class="src">${escapeHtml((S.codelets[step] || []).join(", ") || "none")}</span>`],
    ["Source", `<span class="src" id="step-source">${escapeHtml(S.source[step] || "?")}</span>`], ["IPUs", S.ipus[step].join(", ")],
    ["Executions", fmtInt(executions)],
    ["Cycles per execution", `${fmtInt(total)} (sync ${fmtInt(S.sync[step])}, exchange ${fmtInt(S.exchange[step])}, compute ${fmtInt(S.compute[step])})`],
    ["Compute, slowest / mean tile", `${fmtInt(S.compute[step])} / ${fmtInt(S.compute_mean[step])} (balance ${(100 * balanceRatio).toFixed(1)}%)`],
    ["Tiles busy", `${fmtInt(S.tiles_busy[step])} / ${fmtInt(T.num_tiles)}`],
    ["Vertices", fmtInt(S.vertices[step])], ["FLOPs", fmtInt(S.flops[step])],
    ["Exchange bytes in / out", `${fmtInt(S.bytes_in[step])} / ${fmtInt(S.bytes_out[step])}`],
    ["IPU-Link bytes", fmtInt(S.ipu_link_bytes[step])],
    ["Working memory, busiest tile", fmtBytes(S.working_memory[step])],
  ];
  document.getElementById("step-panel").innerHTML =
    `<h3 id="step-heading">Superstep ${step}</h3><div class="key">` +
    rows.map(([k, v]) => `<span>${k}</span><span>${v}</span>`).join("") + "</div>";
}

function busiestStep() {
  let best = 0, bestCycles = -1;
  for (let i = 0; i < NUM_STEPS; i++) {
    const c = (S.sync[i] + S.exchange[i] + S.compute[i]) * S.executions[i];
    if (c > bestCycles) { best = i; bestCycles = c; }
  }
  return best;
}

// ---------------------------------------------------------------------------
// Operations table.
// ---------------------------------------------------------------------------

function renderOperations() {
  const total = REPORT.totals.cycles;
  const columns = [{label: "Operation"}, {label: "Source"}, {label: "Module path"}, {label: "Steps", num: true},
    {label: "Executions", num: true}, {label: "Cycles", num: true}, {label: "% total", num: true},
    {label: "Compute", num: true}, {label: "Exchange", num: true}, {label: "Sync", num: true},
    {label: "FLOPs", num: true}, {label: "Working memory / tile", num: true}];
  const rows = REPORT.operations.map((r) => [cell(escapeHtml(r.op), r.op),
    cell(`<small>${escapeHtml(r.source || "?")}</small>`, r.source),
    cell(`<small>${escapeHtml(r.scope || "(no scope)")}</small>`, r.scope || ""), numCell(r.steps), numCell(r.executions),
    numCell(r.cycles), cell(fmtPct(r.cycles, total), r.cycles), numCell(r.compute), numCell(r.exchange),
    numCell(r.sync), numCell(r.flops), numCell(r.memory)]);
  const wrap = document.getElementById("operations-table");
  wrap.innerHTML = tableHtml("operations", columns, rows);
  makeSortable(wrap.querySelector("table"));
}

// ---------------------------------------------------------------------------
// Number formats: FP8 scale distributions per kind, loss scale over steps.
// ---------------------------------------------------------------------------

const KIND_COLOURS = {weights: "#1f77b4", activations: "#ff7f0e", gradients: "#2ca02c"};

function renderNumberFormats() {
  const nf = REPORT.number_formats;
  if (!nf) return Promise.resolve();
  document.getElementById("number-formats").hidden = false;
  document.getElementById("number-formats-link").hidden = false;
  const plots = [];
  const tensors = nf.fp8_tensors || [];
  if (tensors.length) {
    const byKind = {};
    for (const t of tensors) (byKind[t.kind] = byKind[t.kind] || []).push(...t.log2_scale);
    const data = Object.entries(byKind).map(([kind, scales]) => ({
      type: "histogram", name: kind, x: scales, xbins: {size: 1}, opacity: 0.7,
      marker: {color: KIND_COLOURS[kind]},
      hovertemplate: `${kind}: log2 scale %{x}: %{y} tensor-steps<extra></extra>`}));
    plots.push(Plotly.newPlot("fp8-scales-chart", data, {
      title: {x: 0.01, xanchor: "left", text: "FP8 per-tensor log2 scales (tensors × steps)", font: {size: 13}},
      barmode: "overlay", height: 360, margin: {l: 60, r: 10, t: 40, b: 40},
      xaxis: {title: {text: "log2 scale"}, dtick: 1}, yaxis: {title: {text: "tensors × steps"}}}, PLOT_CONFIG));
    const columns = [{label: "Tensor"}, {label: "Kind"}, {label: "Format"}, {label: "Steps", num: true},
      {label: "First scale", num: true}, {label: "Last scale", num: true}, {label: "Min", num: true},
      {label: "Max", num: true}, {label: "Last amax", num: true}];
    const last = (a) => a[a.length - 1];
    const rows = tensors.map((t) => [cell(escapeHtml(t.name), t.name), cell(t.kind), cell(t.format),
      numCell(t.steps.length), numCell(t.log2_scale[0]), numCell(last(t.log2_scale)),
      numCell(Math.min(...t.log2_scale)), numCell(Math.max(...t.log2_scale)),
      numCell(last(t.amax), (v) => Number(v).toPrecision(3))]);
    const wrap = document.getElementById("fp8-tensors-table");
    wrap.innerHTML = tableHtml("fp8-tensors", columns, rows);
    makeSortable(wrap.querySelector("table"));
  } else {
    document.getElementById("fp8-scales-chart").innerHTML = "<p class='hint'>No FP8 tensors recorded.</p>";
  }
  const ls = nf.loss_scaling;
  if (ls) {
    const data = [{type: "scatter", mode: "lines+markers", line: {shape: "hv", color: "#9467bd"},
      name: "loss scale", x: ls.steps, y: ls.scale, customdata: ls.skipped_steps,
      hovertemplate: "step %{x}: scale %{y:,}<br>%{customdata} skipped so far<extra></extra>"}];
    const skipped = ls.steps.filter((_, i) => ls.skipped_steps[i] > (i ? ls.skipped_steps[i - 1] : 0));
    if (skipped.length) {
      data.push({type: "scatter", mode: "markers", name: "steps skipped", x: skipped,
        y: skipped.map((s) => ls.scale[ls.steps.indexOf(s)]), marker: {color: "red", symbol: "triangle-down", size: 9}});
    }
    plots.push(Plotly.newPlot("loss-scale-chart", data, {
      title: {x: 0.01, xanchor: "left", font: {size: 13},
              text: `Loss scale (${fmtInt(last_(ls.skipped_steps))} skipped, ${fmtInt(last_(ls.overflows))} overflows)`},
      height: 360, margin: {l: 70, r: 10, t: 40, b: 40}, showlegend: skipped.length > 0,
      xaxis: {title: {text: "step"}}, yaxis: {title: {text: "loss scale"}, type: "log", exponentformat: "power"}},
      PLOT_CONFIG));
  } else {
    document.getElementById("loss-scale-chart").innerHTML = "<p class='hint'>No loss scaling recorded.</p>";
  }
  return Promise.all(plots);
}

function last_(values) {
  return values.length ? values[values.length - 1] : 0;
}

function main() {
  renderHeader();
  renderOperations();
  document.getElementById("show-peak-tile").addEventListener("click", () => showTile(REPORT.totals.peak_tile));
  document.getElementById("tile-input").addEventListener("change", (e) => showTile(Number(e.target.value)));
  Promise.all([renderTileMap(), renderLiveness(), renderExecution(), renderNumberFormats(), renderViews()]).then(() => {
    if (NUM_STEPS) showStep(busiestStep());
    showTile(REPORT.totals.peak_tile);
    document.body.dataset.ready = "true";
  });
}

main();
