// Formatting and table helpers shared by the report and comparison pages.
"use strict";

const REPORT = JSON.parse(document.getElementById("report-data").textContent);

function fmtInt(value) {
  return Math.round(Number(value)).toLocaleString("en-US");
}

function fmtBytes(value) {
  const n = Math.round(Number(value));
  for (const [unit, scale] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (Math.abs(n) >= scale) return `${fmtInt(n)} B (${(n / scale).toFixed(2)} ${unit})`;
  }
  return `${fmtInt(n)} B`;
}

function fmtPct(part, whole) {
  return whole ? `${(100 * part / whole).toFixed(1)}%` : "0.0%";
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({
    "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

// Builds <table> markup. columns: [{label, num, sortKey}]; rows: arrays of
// {html, value} cells (value sorts; html shows).
function tableHtml(id, columns, rows) {
  const head = columns.map((c, i) =>
    `<th data-col="${i}" class="${c.num ? "num" : ""}${c.sortable === false ? "" : " sortable"}">` +
    `${escapeHtml(c.label)}</th>`).join("");
  const body = rows.map((row) => "<tr>" + row.map((cell, i) =>
    `<td class="${columns[i].num ? "num" : ""} ${cell.cls || ""}" data-value="${
      escapeHtml(cell.value)}">${cell.html}</td>`).join("") + "</tr>").join("");
  return `<table id="${id}"><thead><tr>${head}</tr></thead><tbody>${body}</tbody></table>`;
}

// Clicking a header sorts the table by that column (numbers numerically),
// descending first, then toggling.
function makeSortable(table) {
  table.querySelectorAll("th.sortable").forEach((th) => {
    th.addEventListener("click", () => {
      const col = Number(th.dataset.col);
      const numeric = th.classList.contains("num");
      const order = th.dataset.order === "desc" ? "asc" : "desc";
      table.querySelectorAll("th").forEach((h) => delete h.dataset.order);
      th.dataset.order = order;
      const body = table.tBodies[0];
      const rows = Array.from(body.rows);
      rows.sort((r1, r2) => {
        let v1 = r1.cells[col].dataset.value, v2 = r2.cells[col].dataset.value;
        if (numeric) { v1 = Number(v1); v2 = Number(v2); }
        const cmp = v1 < v2 ? -1 : v1 > v2 ? 1 : 0;
        return order === "desc" ? -cmp : cmp;
      });
      rows.forEach((r) => body.appendChild(r));
    });
  });
}

function cell(html, value, cls) {
  return {html: html, value: value === undefined ? html : value, cls: cls};
}

function numCell(value, formatter) {
  return cell((formatter || fmtInt)(value), value);
}

const PLOT_CONFIG = {responsive: true, displaylogo: false};
