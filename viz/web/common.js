// Shared by the views: formatting, elements, colours, uPlot charts and
// sortable tables. Every view is a function MP.views.NAME(section, data).
"use strict";
const MP = { views: {} };

MP.MiB = 1024 * 1024;
MP.GiB = 1024 * MP.MiB;
// Bytes in MiB below a GiB, else GiB (axis and table unit chosen per report).
MP.unitFor = (maxBytes) => (maxBytes >= MP.GiB ? { name: "GiB", div: MP.GiB } : { name: "MiB", div: MP.MiB });
MP.fmt = (bytes, unit, digits = 2) => (bytes / unit.div).toFixed(digits);
MP.fmtBytes = (b) => (b >= MP.GiB ? (b / MP.GiB).toFixed(2) + " GiB" : b >= MP.MiB ? (b / MP.MiB).toFixed(2) + " MiB"
                      : b >= 1024 ? (b / 1024).toFixed(1) + " KiB" : b + " B");

MP.el = (tag, attrs = {}, children = []) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") e.textContent = v;
    else if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of [].concat(children)) if (c != null) e.append(c);
  return e;
};

// One colour per storage policy (compositions take their last policy's).
MP.policyColors = {
  keep: "#4c78a8", recompute: "#f58518", fp8: "#54a24b", offload_host: "#b279a2",
  offload_remote: "#e45756", "fp8+offload_host": "#9d755d", "fp8+offload_remote": "#eeca3b",
};
MP.staticColors = { weights: "#1f3b63", grads: "#3e6a9c", optimizer: "#7ea3cc", buffers: "#c0d3e8" };
MP.queueColors = { F: "#4c78a8", B: "#f58518", d2h: "#b279a2", h2d: "#54a24b", link: "#e45756" };

// A uPlot chart in `parent`, as wide as the section.
MP.plot = (parent, title, opts, data) => {
  const box = MP.el("div", { class: "plot" }, title ? [MP.el("h3", { text: title })] : []);
  parent.append(box);
  const width = Math.max(480, Math.min(1400, parent.clientWidth || 1100) - 8);
  const u = new uPlot(Object.assign({ width, height: 260 }, opts), data, box);
  MP.charts.push(u);
  return u;
};
MP.charts = [];

// A table with numeric or text columns; `sortable` re-sorts on a header click.
// columns: [{name, key(row) -> value, text?: bool, fmt?(value) -> string}]
MP.table = (parent, columns, rows, { sortable = false, limit = Infinity, caption = null } = {}) => {
  const table = MP.el("table");
  let order = { col: -1, dir: 1 };
  const head = MP.el("tr", {}, columns.map((c, i) => MP.el("th", {
    class: (c.text ? "text " : "") + (sortable ? "sortable" : ""), text: c.name,
    onclick: () => { if (!sortable) return; order = { col: i, dir: order.col === i ? -order.dir : (c.text ? 1 : -1) }; fill(); },
  })));
  const body = MP.el("tbody");
  const note = MP.el("div", { class: "note" });
  table.append(MP.el("thead", {}, head), body);
  function fill() {
    let shown = rows.slice();
    if (order.col >= 0) {
      const key = columns[order.col].key;
      shown.sort((a, b) => { const x = key(a), y = key(b); return (x < y ? -1 : x > y ? 1 : 0) * order.dir; });
    }
    body.replaceChildren(...shown.slice(0, limit).map((r) => MP.el("tr", {}, columns.map((c) => {
      const v = c.key(r);
      return MP.el("td", { class: c.text ? "text" : "", text: c.fmt ? c.fmt(v, r) : String(v ?? "") });
    }))));
    note.textContent = rows.length > limit ? `showing ${limit} of ${rows.length} rows` : `${rows.length} rows`;
  }
  fill();
  parent.append(caption ? MP.el("div", { class: "note", text: caption }) : "", table, note);
  return { set(newRows) { rows = newRows; fill(); } };
};

// Seconds on an axis, in milliseconds.
MP.msTicks = (u, ticks) => ticks.map((t) => +(t * 1e3).toPrecision(4));

// A glob as policy annotations write them ("*" any run, "?" one character).
MP.globRegex = (glob) => new RegExp("^" + glob.split("").map((ch) => (ch === "*" ? ".*" : ch === "?" ? "."
  : ch.replace(/[.+^${}()|[\]\\]/g, "\\$&"))).join("") + "$");
