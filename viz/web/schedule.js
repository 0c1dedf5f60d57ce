// 3. The schedule: lanes per rank (compute, then the d2h, h2d and link copy
// queues) with the plan's passes and simulated copies as bars; TRACE.json's
// spans in a second chart, a lane per (process, thread). uPlot draws the
// axes and scales; the bars are drawn in its draw hook.
"use strict";
MP.gantt = (parent, title, lanes, bars, xLabel, legend) => {
  // bars: [lane, x0, x1, color, label]
  if (!bars.length) return null;
  // A loop, not Math.min(...bars): a K3-scale plan has more bars than the
  // engine's argument limit.
  let x0 = Infinity, x1 = -Infinity;
  for (const b of bars) { x0 = Math.min(x0, b[1]); x1 = Math.max(x1, b[2]); }
  const draw = (u) => {
    const ctx = u.ctx;
    ctx.save();
    const laneH = Math.max(2, Math.abs(u.valToPos(0, "y", true) - u.valToPos(1, "y", true)) * 0.7);
    for (const [lane, a, b, color] of bars) {
      const xa = u.valToPos(a, "x", true), xb = u.valToPos(b, "x", true);
      const yc = u.valToPos(lane, "y", true);
      ctx.fillStyle = color;
      ctx.fillRect(xa, yc - laneH / 2, Math.max(1, xb - xa), laneH);
    }
    ctx.restore();
  };
  const u = MP.plot(parent, title, {
    height: Math.min(900, 90 + 26 * lanes.length),
    cursor: { drag: { x: true, y: false }, points: { show: false } },
    legend: { show: false },
    scales: { x: { time: false, range: [x0, x1] }, y: { range: [-0.5, lanes.length - 0.5], dir: -1 } },
    axes: [{ label: xLabel, values: MP.msTicks }, { size: 150, splits: () => lanes.map((_, i) => i), values: (u, t) => t.map((i) => lanes[i] ?? "") }],
    series: [{}, { label: "lanes", paths: () => null, points: { show: false } }],
    hooks: { draw: [draw] },
  }, [[x0, x1], [null, null]]);
  if (legend) parent.append(MP.el("div", { class: "note" }, legend));
  // Hover: the bar under the cursor.
  const tip = MP.el("div", { class: "note", text: "hover a bar" });
  parent.append(tip);
  u.over.addEventListener("mousemove", (e) => {
    const x = u.posToVal(e.offsetX, "x"), lane = Math.round(u.posToVal(e.offsetY, "y"));
    const hit = bars.find((b) => b[0] === lane && b[1] <= x && x <= b[2]);
    tip.textContent = hit ? `${lanes[lane]}: ${hit[4]} (${(hit[1] * 1e3).toFixed(3)} to ${(hit[2] * 1e3).toFixed(3)} ms)`
      : "hover a bar";
  });
  return u;
};

MP.views.schedule = (section, data) => {
  const plots = section.querySelector(".plots");
  const lanes = [], bars = [];
  const queues = ["d2h", "h2d", "link"];
  for (const s of data.schedule) {
    const base = lanes.length;
    lanes.push(`pp${s.pp_rank} compute`);
    const used = queues.filter((q) => s.copies.some((c) => c[0] === q));
    used.forEach((q) => lanes.push(`pp${s.pp_rank} ${q}`));
    for (const [kind, mb, chunk, a, b] of s.passes) {
      bars.push([base, a, b, chunk % 2 ? (kind === "F" ? "#72a0cf" : "#f7a85a") : MP.queueColors[kind],
                 `${kind === "F" ? "forward" : "backward"} mb ${mb} chunk ${chunk}`]);
    }
    for (const [q, a, b, t, mb] of s.copies) {
      bars.push([base + 1 + used.indexOf(q), a, b, MP.queueColors[q], `${q} ${s.tensors[t]} mb ${mb}`]);
    }
  }
  const legend = Object.entries({ forward: "F", backward: "B", d2h: "d2h", h2d: "h2d", link: "link" }).map(([n, k]) =>
    MP.el("span", {}, [MP.el("span", { class: "swatch", style: `background:${MP.queueColors[k]}` }), n + "  "]));
  MP.gantt(plots, "plan: passes and copy queues (pipeline time; lighter: odd chunks)", lanes, bars, "time (ms, predicted)", legend);
  if (data.trace) {
    const tl = [], tb = [];
    let t0 = Infinity;
    for (const p of data.trace) for (const s of p.spans) t0 = Math.min(t0, s[3]);
    for (const p of data.trace) {
      const tids = [...new Set(p.spans.map((s) => s[2]))].sort((a, b) => a - b);
      const base = tl.length;
      tids.forEach((tid) => tl.push(`pid ${p.pid} ${p.threads[String(tid)] || "tid " + tid}`));
      for (const [name, cat, tid, ts, dur] of p.spans) {
        const color = /d2h/.test(cat + name) ? MP.queueColors.d2h : /h2d/.test(cat + name) ? MP.queueColors.h2d
          : /link|remote/.test(cat + name) ? MP.queueColors.link : /bwd/.test(name) ? MP.queueColors.B : MP.queueColors.F;
        tb.push([base + tids.indexOf(tid), (ts - t0) * 1e-6, (ts - t0 + dur) * 1e-6, color, name]);
      }
    }
    MP.gantt(plots, "TRACE.json: measured spans (from the first span)", tl, tb, "time (ms, measured)");
  }
};
