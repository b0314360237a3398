// Runs report.html's (or the comparison page's) scripts under node with a stub DOM and Plotly.
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const data = html.match(/<script type="application\/json" id="report-data">([\s\S]*?)<\/script>/)[1];
const scripts = [...html.matchAll(/<script>\n([\s\S]*?)\n<\/script>/g)].map((m) => m[1]);
const elements = {};
function element(id) {
  if (!elements[id]) {
    elements[id] = {id, innerHTML: "", textContent: id === "report-data" ? data : "", hidden: false,
      dataset: {}, addEventListener() {}, on() {}, querySelector() { return element(id + ">q"); },
      querySelectorAll() { return []; }, tBodies: [{rows: []}]};
  }
  return elements[id];
}
const plots = [];
global.document = {getElementById: element, body: element("body")};
global.Plotly = {newPlot(div, traces, layout) { plots.push({div: typeof div === "string" ? div : div.id, traces, layout}); return Promise.resolve(); }, react() { return Promise.resolve(); }};
const page = scripts[scripts.length - 1];
new Function(page)();
setTimeout(() => {
  const out = {ready: element("body").dataset.ready === "true", plots: plots.map((p) => ({div: p.div, traces: p.traces.map((t) => ({type: t.type, name: t.name, x: t.x, y: t.y})), title: p.layout.title && p.layout.title.text})),
    hidden: {section: element("number-formats").hidden, link: element("number-formats-link").hidden},
    table: element("fp8-tensors-table").innerHTML, cards: element("cards").innerHTML,
    comparisonTable: element("number-formats-table").innerHTML};
  console.log(JSON.stringify(out));
}, 50);
