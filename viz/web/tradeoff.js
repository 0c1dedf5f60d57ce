// 5. Trade-off: the --sweep curve (budget against the step time the plan
// adds); PP balance: the bytes each rank parks in each other rank.
"use strict";
MP.views.tradeoff = (section, data) => {
  const plots = section.querySelector(".plots"), tables = section.querySelector(".tables");
  if (data.sweep && data.sweep.length) {
    const pts = data.sweep.slice().sort((a, b) => a.budget - b.budget);
    const unit = MP.unitFor(Math.max(...pts.map((p) => p.budget)));
    MP.plot(plots, `budget against added step time (memplan plan --sweep; ${unit.name})`, {
      height: 240, scales: { x: { time: false } },
      axes: [{ label: `budget (${unit.name})` }, { label: "added (ms)", size: 60 }],
      series: [{ label: "budget" }, { label: "added ms (fits)", stroke: "#4c78a8", width: 2, points: { show: true, size: 7 } },
               { label: "added ms (does not fit)", stroke: "#d62728", width: 0, points: { show: true, size: 7 }, paths: () => null }],
    }, [pts.map((p) => p.budget / unit.div), pts.map((p) => (p.fits ? p.added_s * 1e3 : null)),
        pts.map((p) => (p.fits ? null : p.added_s * 1e3))]);
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
