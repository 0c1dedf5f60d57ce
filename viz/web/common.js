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

// Every category drawn in one chart gets its own hue (a qualitative palette
// after Tableau 10 and Okabe-Ito): the static parts in dark and muted hues,
// the activation policies in bright ones, memory outside the framework in
// grey. MP.paletteCheck (below) measures how far apart they are; the
// browser test holds every pair at CIE76 delta E >= 20.
MP.policyColors = {
  keep: "#e8743b", recompute: "#d62728", fp8: "#2ca02c", offload_host: "#9467bd",
  offload_remote: "#e377c2", "fp8+offload_host": "#17becf", "fp8+offload_remote": "#bcbd22",
};
MP.staticColors = { weights: "#1f4e79", grads: "#5b8fc9", optimizer: "#8c564b", buffers: "#c9b28f" };
MP.outsideColor = "#7f7f7f";
MP.queueColors = { F: "#4c78a8", B: "#f58518", d2h: "#b279a2", h2d: "#54a24b", link: "#e45756" };

// sRGB hex -> CIE L*a*b* (D65).
MP.lab = (hex) => {
  const c = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16) / 255)
    .map((v) => (v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4));
  const xyz = [0.4124 * c[0] + 0.3576 * c[1] + 0.1805 * c[2], 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2],
               0.0193 * c[0] + 0.1192 * c[1] + 0.9505 * c[2]];
  const f = (t) => (t > 216 / 24389 ? Math.cbrt(t) : (24389 / 27 * t + 16) / 116);
  const [fx, fy, fz] = [xyz[0] / 0.95047, xyz[1], xyz[2] / 1.08883].map(f);
  return [116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)];
};
// WCAG relative luminance contrast of two sRGB hex colours (>= 1).
MP.contrast = (a, b) => {
  const lum = (hex) => [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16) / 255)
    .map((v) => (v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4))
    .reduce((acc, v, i) => acc + v * [0.2126, 0.7152, 0.0722][i], 0);
  const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p);
  return (x + 0.05) / (y + 0.05);
};
// The smallest CIE76 distance between any two of `colors`, and the pair.
MP.paletteCheck = (colors) => {
  let min = Infinity, pair = "";
  for (let i = 0; i < colors.length; ++i) {
    for (let j = i + 1; j < colors.length; ++j) {
      const [p, q] = [MP.lab(colors[i]), MP.lab(colors[j])];
      const d = Math.hypot(p[0] - q[0], p[1] - q[1], p[2] - q[2]);
      if (d < min) { min = d; pair = `${colors[i]}/${colors[j]}`; }
    }
  }
  return { min, pair };
};
// A y scale from 0 to a little above the largest value.
MP.fromZero = (u, min, max) => [0, max > 0 ? max * 1.06 : 1];

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
    if (more) {
      more.hidden = rows.length <= limit && !expanded;
      more.textContent = expanded ? `show the first ${collapsed} rows` : `show all ${rows.length} rows`;
    }
  }
  // collapsed: the rows shown until "show all" is pressed (the page stays
  // short with hundreds of rows).
  let expanded = false;
  const collapsed = Number.isFinite(limit) ? limit : Infinity;
  const more = Number.isFinite(limit) ? MP.el("button", { class: "more", type: "button", onclick: () => {
    expanded = !expanded;
    limit = expanded ? Infinity : collapsed;
    fill();
  } }) : null;
  fill();
  parent.append(caption ? MP.el("div", { class: "note", text: caption }) : "", table, note, more || "");
  return { set(newRows) { rows = newRows; fill(); } };
};

// Seconds on an axis, in milliseconds.
MP.msTicks = (u, ticks) => ticks.map((t) => +(t * 1e3).toPrecision(4));

// A glob as policy annotations write them ("*" any run, "?" one character).
MP.globRegex = (glob) => new RegExp("^" + glob.split("").map((ch) => (ch === "*" ? ".*" : ch === "?" ? "."
  : ch.replace(/[.+^${}()|[\]\\]/g, "\\$&"))).join("") + "$");
