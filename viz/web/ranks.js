// 1. Ranks at a glance: stacked bars per pipeline rank (static parts, then
// the activations at the peak by policy), the peak, the lower bounds and the
// budget as marks; a table with fits / does not fit and added time.
"use strict";
MP.views.ranks = (section, data) => {
  const ranks = data.ranks;
  const policies = [...new Set(ranks.flatMap((r) => Object.keys(r.activations_by_policy)))].sort();
  const maxBytes = Math.max(...ranks.map((r) => Math.max(r.peak + r.runtime, r.keep_all_lower_bound + r.runtime)));
  const unit = MP.unitFor(maxBytes);
  // Layers bottom to top; each rank's activations at the peak are split by
  // the share of its per-microbatch device bytes each policy holds.
  const layers = ["weights", "grads", "optimizer", "buffers"].map((k) => ({ name: k, color: MP.staticColors[k],
    value: (r) => r[k] }));
  // Memory outside the framework (CUDA context, NCCL communicators): under
  // the framework's bytes, so the bar's top is what the GPU holds.
  const outside = ranks.some((r) => r.runtime > 0);
  if (outside) layers.unshift({ name: "outside the framework", color: MP.outsideColor, value: (r) => r.runtime });
  for (const p of policies) {
    layers.push({ name: "activations: " + p, color: MP.policyColors[p] || "#999", value: (r) => {
      const total = Object.values(r.activations_by_policy).reduce((a, b) => a + b, 0);
      return total > 0 ? r.activations_peak * (r.activations_by_policy[p] || 0) / total : 0;
    } });
  }
  const xs = ranks.map((r) => r.pp_rank);
  // Drawn top layer first: each lower (shorter) cumulative bar paints over it.
  const cumulative = [];
  let acc = ranks.map(() => 0);
  for (const l of layers) { acc = acc.map((a, i) => a + l.value(ranks[i])); cumulative.push(acc.map((v) => v / unit.div)); }
  const bars = uPlot.paths.bars({ size: [0.55, 120] });
  // Every category's colour apart from the others and from the page
  // (recorded for the browser test; docs/viz.md).
  const drawn = layers.map((l) => l.color);
  const check = MP.paletteCheck(drawn);
  section.dataset.colors = String(drawn.length);
  section.dataset.minDeltaE = check.min === Infinity ? "100" : check.min.toFixed(1);
  section.dataset.closestPair = check.pair;
  section.dataset.minContrast = Math.min(...drawn.map((c) => MP.contrast(c, "#ffffff"))).toFixed(2);
  const series = [{ label: "pp rank" }];
  const values = [xs];
  for (let i = layers.length - 1; i >= 0; --i) {
    series.push({ label: layers[i].name, fill: layers[i].color, stroke: "#ffffff", width: 1, paths: bars, points: { show: false },
      value: (u, v, si, idx) => (idx == null ? "" : (layers[i].value(ranks[idx]) / unit.div).toFixed(2)) });
    values.push(cumulative[i]);
  }
  // Marks on the bars' scale: with the outside items under them.
  const marks = [["peak", (r) => r.peak + r.runtime, "#111"], ["lower bound", (r) => r.lower_bound + r.runtime, "#2ca02c"],
                 ["any-plan lower bound", (r) => r.any_plan_lower_bound + r.runtime, "#9467bd"]];
  const budgetInRange = ranks.some((r) => r.budget > 0 && r.budget <= 1.5 * maxBytes);
  if (budgetInRange) marks.push(["budget", (r) => r.budget, "#d62728"]);
  for (const [name, f, color] of marks) {
    series.push({ label: name, stroke: color, width: 0, paths: () => null,
      points: { show: true, size: 12, width: 2, stroke: color, fill: "#fff" } });
    values.push(ranks.map((r) => f(r) / unit.div));
  }
  MP.plot(section.querySelector(".plots"), `device memory per rank (${unit.name})`, {
    scales: { x: { time: false, range: [-0.6, ranks.length - 0.4] }, y: { range: MP.fromZero } },
    axes: [{ label: "pp rank", values: (u, ticks) => ticks.map((t) => (Number.isInteger(t) ? t : "")) },
           { label: unit.name, size: 60 }],
    series,
  }, values);
  if (!budgetInRange) {
    section.querySelector(".plots").append(MP.el("div", { class: "note",
      text: `budget ${MP.fmtBytes(ranks[0].budget)} per rank is off this scale (every rank fits far below it)` }));
  }
  if (outside) {
    const items = Object.entries(ranks[0].runtime_detail).map(([k, v]) => `${k} ${MP.fmtBytes(v)}`).join(", ");
    section.querySelector(".plots").append(MP.el("div", { class: "note runtime-items",
      text: `outside the framework, per GPU (the bars' grey base; fits: peak + these <= budget): ${items}` }));
  }
  // Host memory at its peak (offloaded activations, host gradient
  // partitions), apart, against the pinned host memory per GPU.
  if (ranks.some((r) => r.host_peak > 0)) {
    const limit = (data.hardware || {}).host_memory || 0;
    const top = Math.max(...ranks.map((r) => r.host_peak));
    const hu = MP.unitFor(Math.max(top, limit <= 1.5 * top ? limit : 0));
    const hs = [{}, { label: "host_peak", fill: "#8c6d31", stroke: "#8c6d31", paths: bars, points: { show: false } }];
    const hv = [xs, ranks.map((r) => r.host_peak / hu.div)];
    if (limit > 0 && limit <= 1.5 * top) {
      hs.push({ label: "host memory per GPU (hardware.host_memory)", stroke: "#d62728", width: 2, dash: [6, 4],
                points: { show: false } });
      hv.push(ranks.map(() => limit / hu.div));
    }
    MP.plot(section.querySelector(".plots"), `host memory per GPU at its peak (${hu.name}): ranks[].host_peak`, {
      height: 160, scales: { x: { time: false, range: [-0.6, ranks.length - 0.4] }, y: { range: MP.fromZero } },
      axes: [{ label: "pp rank", values: (u, t) => t.map((v) => (Number.isInteger(v) ? v : "")) }, { label: hu.name, size: 60 }],
      series: hs,
    }, hv);
    if (limit > 0) {
      section.querySelector(".plots").append(MP.el("div", { class: "note host-limit", text:
        `pinned host memory per GPU: ${MP.fmtBytes(limit)} (hardware.host_memory, --host-memory); the largest ` +
        `rank uses ${(100 * top / limit).toFixed(1)} %` + (limit > 1.5 * top ? " (the limit is off this scale)" : "") }));
    }
  }
  const f = (v) => MP.fmt(v, unit);
  MP.table(section.querySelector(".tables"), [
    { name: "pp rank", key: (r) => r.pp_rank },
    { name: `static (${unit.name})`, key: (r) => r.static, fmt: f },
    { name: `activations (${unit.name})`, key: (r) => r.activations_peak, fmt: f },
    { name: `peak (${unit.name})`, key: (r) => r.peak, fmt: f },
    { name: `outside the framework (${unit.name})`, key: (r) => r.runtime, fmt: f },
    { name: `lower bound (${unit.name})`, key: (r) => r.lower_bound, fmt: f },
    { name: `any-plan (${unit.name})`, key: (r) => r.any_plan_lower_bound, fmt: f },
    { name: `keep-all (${unit.name})`, key: (r) => r.keep_all_lower_bound, fmt: f },
    { name: `budget (${unit.name})`, key: (r) => r.budget, fmt: f },
    { name: "fits", key: (r) => (r.fits ? "yes" : "NO"), text: true },
    { name: `host peak (${unit.name})`, key: (r) => r.host_peak, fmt: f },
    { name: "added (ms)", key: (r) => r.added_ms, fmt: (v) => v.toFixed(2) },
  ], ranks);
};
