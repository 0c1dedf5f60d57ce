// 5. Trade-off: the --sweep curve (budget against the step time the plan
// adds); PP balance: the bytes each rank parks in each other rank.
"use strict";
MP.views.tradeoff = (section, data) => {
  const plots = section.querySelector(".plots"), tables = section.querySelector(".tables");
  if (data.sweep && data.sweep.length) {
    const pts = data.sweep.slice().sort((a, b) => a.budget - b.budget);
    const unit = MP.unitFor(Math.max(...pts.map((p) => p.budget)));
    // A budget that does not fit has no step to draw: it is shaded as a
    // band over its budgets, with a tick per point, and no y value.
    const bad = pts.filter((p) => !p.fits).map((p) => p.budget / unit.div);
    const xs = pts.map((p) => p.budget / unit.div);
    const half = xs.length > 1 ? (xs[xs.length - 1] - xs[0]) / (xs.length - 1) / 2 : 0.5;
    const shade = (u) => {
      if (!bad.length) return;
      const ctx = u.ctx, top = u.bbox.top, height = u.bbox.height;
      ctx.save();
      ctx.fillStyle = "rgba(214,39,40,0.12)";
      ctx.strokeStyle = "#d62728";
      ctx.lineWidth = 2 * devicePixelRatio;
      for (const x of bad) {
        const a = u.valToPos(Math.max(xs[0], x - half), "x", true), b = u.valToPos(Math.min(xs[xs.length - 1], x + half), "x", true);
        ctx.fillRect(a, top, Math.max(1, b - a), height);
        const at = u.valToPos(x, "x", true);
        ctx.beginPath(); ctx.moveTo(at, top); ctx.lineTo(at, top + 10 * devicePixelRatio); ctx.stroke();
      }
      ctx.fillStyle = "#b3261e";
      ctx.font = `${12 * devicePixelRatio}px system-ui, sans-serif`;
      ctx.fillText("does not fit", u.valToPos(bad[0], "x", true) + 4 * devicePixelRatio, top + 24 * devicePixelRatio);
      ctx.restore();
    };
    section.dataset.infeasible = String(bad.length);
    MP.plot(plots, `budget against added step time (memplan plan --sweep; ${unit.name})`, {
      height: 240, scales: { x: { time: false }, y: { range: MP.fromZero } },
      axes: [{ label: `budget (${unit.name})` }, { label: "added (ms)", size: 60 }],
      series: [{ label: "budget" }, { label: "added ms (fits)", stroke: "#4c78a8", width: 2, points: { show: true, size: 7 } }],
      hooks: { draw: [shade] },
    }, [xs, pts.map((p) => (p.fits ? p.added_s * 1e3 : null))]);
    if (bad.length) {
      plots.append(MP.el("div", { class: "note infeasible", text: `${bad.length} of ${pts.length} budgets do not fit ` +
        "(shaded): no plan stays under them, so they have no step time to draw." }));
    }
  } else {
    plots.append(MP.el("div", { class: "note", text: "No trade-off curve: plan with memplan plan --sweep to draw it." }));
  }
  const n = data.ranks.length;
  const parked = data.ranks.map(() => new Array(n).fill(0));
  for (const r of data.ranks) for (const o of r.remote_offload) parked[r.pp_rank][o.to_pp_rank] += o.bytes;
  const total = parked.flat().reduce((a, b) => a + b, 0);
  if (!total) {
    tables.append(MP.el("div", { class: "note", text: "PP balance: no rank parks bytes in another (no offload_remote)." }));
    return;
  }
  const max = Math.max(...parked.flat());
  const head = MP.el("tr", {}, [MP.el("th", { text: "from \\ to" }), ...parked.map((_, j) => MP.el("th", { text: "pp" + j }))]);
  const rows = parked.map((row, i) => MP.el("tr", {}, [MP.el("th", { text: "pp" + i }), ...row.map((b) => MP.el("td", {
    class: "cell", text: b ? MP.fmtBytes(b) : "·", style: b ? `background: rgba(228,87,86,${0.15 + 0.6 * b / max})` : "" }))]));
  tables.append(MP.el("div", { class: "note", text: "PP balance: largest bytes each rank holds in another's memory at once" }),
                MP.el("table", { class: "heat" }, [MP.el("thead", {}, head), MP.el("tbody", {}, rows)]));
};
