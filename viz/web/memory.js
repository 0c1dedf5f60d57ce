// 2. Memory over the step: per rank, the predicted live bytes (static +
// activations, step by step), the arena the plan places, the budget, and
// the measured timeline(s) scaled onto the predicted step; the check's
// verdict; the buffers live at the peak.
"use strict";
MP.views.memory = (section, data) => {
  const plots = section.querySelector(".plots");
  const measured = data.measured ? data.measured.ranks : [];
  const maxBytes = Math.max(...data.memory.map((m) => m.reserved), ...measured.map((m) => m.peak));
  const unit = MP.unitFor(maxBytes);
  if (data.downsampled) {
    plots.append(MP.el("div", { class: "note", text: `Long timelines are down-sampled to ${data.max_points} points ` +
      "per rank, each point the maximum of the steps it stands for: peaks are kept, dips may be hidden." }));
  }
  if (data.measured) {
    plots.append(MP.el("div", { class: "note", text: `Measured: ${data.measured.backend} backend, ` +
      `${data.measured.allocator} allocator; ` + (data.measured.allocator === "eager"
        ? "the eager run's live bytes are drawn step by step on the plan's clock, its first divergence from the plan marked."
        : "its clock is scaled so that its timeline spans the predicted step.") }));
  }
  const verdicts = new Map();
  for (const c of (data.check ? data.check.ranks : [])) verdicts.set(`${c.pp_rank}/${c.dp_rank ?? 0}`, c);
  for (const m of data.memory) {
    const [t, live] = m.predicted;
    const stepEnd = m.step_s || (t.length ? t[t.length - 1] : 1);
    const xs = t.slice(), cols = [];
    const series = [{ label: "t (ms)", value: (u, v) => (v == null ? "--" : (v * 1e3).toFixed(3)) }];
    const add = (label, color, ys, opts = {}) => { series.push(Object.assign({ label, stroke: color, width: 1.5,
      value: (u, v) => (v == null ? "-" : v.toFixed(3) + " " + unit.name) }, opts)); cols.push(ys); };
    add("predicted live", "#4c78a8", live.map((v) => v / unit.div), { fill: "rgba(76,120,168,0.12)", paths: uPlot.paths.stepped({ align: 1 }) });
    add("planned arena (reserved)", "#111", t.map(() => m.reserved / unit.div), { dash: [6, 4] });
    // The budget net of what lies outside the framework (CUDA context,
    // NCCL): the line these bytes must stay under.
    const rank = data.ranks[m.pp_rank];
    const net = rank.budget - rank.runtime;
    if (rank.budget > 0 && net <= 1.5 * maxBytes) {
      add(rank.runtime > 0 ? `budget less ${MP.fmtBytes(rank.runtime)} outside the framework` : "budget", "#d62728",
          t.map(() => net / unit.div));
    }
    // Measured timelines of every replica of this pipeline rank, each
    // scaled onto [0, predicted step] and merged on one x axis.
    const mine = measured.filter((r) => r.pp_rank === m.pp_rank);
    const extra = [];
    for (const r of mine) {
      if (r.eager) {  // eager: step by step on the plan's clock, no scaling
        extra.push({ label: `eager dp${r.dp_rank}`, color: "#f58518", t: r.eager[0], y: r.eager[1].map((v) => v / unit.div) });
        const c = r.eager_check;
        if (c && c.t != null) {
          extra.push({ label: `first divergence dp${r.dp_rank} (step ${c.step})`, color: "#d62728", t: [c.t],
                       y: [c.bytes / unit.div], points: { show: true, size: 9 } });
        }
        continue;
      }
      const [mt, mb] = r.allocated;
      if (!mt.length) continue;
      const t0 = mt[0], span = Math.max(1e-12, mt[mt.length - 1] - t0);
      extra.push({ label: `measured dp${r.dp_rank}`, color: "#e45756", t: mt.map((v) => ((v - t0) / span) * stepEnd),
                   y: mb.map((v) => v / unit.div) });
      if (r.cupti && r.cupti[0].length) {  // CUPTI's records, on the same clock as the allocator's
        extra.push({ label: `CUPTI dp${r.dp_rank}`, color: "#8c564b", t: r.cupti[0].map((v) => ((v - t0) / span) * stepEnd),
                     y: r.cupti[1].map((v) => v / unit.div) });
      }
    }
    let x = xs, ys = cols;
    if (extra.length) {
      // One x axis: the union of every timeline's points (uPlot aligns series on x).
      const all = [...new Set([...xs, ...extra.flatMap((e) => e.t)])].sort((a, b) => a - b);
      const at = (tx, ty) => { const out = new Array(all.length).fill(null); const idx = new Map(all.map((v, i) => [v, i]));
        tx.forEach((v, i) => { out[idx.get(v)] = ty[i]; }); return out; };
      ys = cols.map((c) => at(xs, c));
      for (const e of extra) {
        series.push(Object.assign({ label: e.label, stroke: e.color, width: 1.2, spanGaps: true, paths: uPlot.paths.stepped({ align: 1 }),
          value: (u, v) => (v == null ? "-" : v.toFixed(3) + " " + unit.name) }, e.points ? { points: e.points, paths: () => null } : {}));
        ys.push(at(e.t, e.y));
      }
      for (let i = 1; i < series.length; ++i) series[i].spanGaps = true;
      x = all;
    }
    // One peak figure, the table's: the placed arena; the live bytes' own
    // maximum is the lower bound, named as such.
    let title = `pp rank ${m.pp_rank}: peak ${MP.fmtBytes(rank.peak)} (placed arena, as in the table); ` +
      `lower bound ${MP.fmtBytes(m.peak_bytes)} (live bytes at step ${m.peak_step} of ${m.steps})`;
    const box = MP.plot(plots, title, {
      height: 220, cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false }, y: { range: MP.fromZero } },
      axes: [{ label: "time in the step (ms, predicted)", values: MP.msTicks }, { label: unit.name, size: 60 }],
      series,
    }, [x, ...ys]).root.parentElement;
    const checks = mine.map((r) => verdicts.get(`${r.pp_rank}/${r.dp_rank}`) || verdicts.get(`${r.pp_rank}/0`)).filter(Boolean);
    for (const r of mine.filter((x) => x.eager_check)) {
      const c = r.eager_check;
      box.append(MP.el("div", {}, [MP.el("span", { class: "verdict " + (c.pass ? "pass" : "fail"),
        text: `eager timeline dp${r.dp_rank}: ${c.pass ? "pass" : "FAIL"}` }),
        ` — step by step against the plan's program${c.moved ? `, ${c.moved} copy-timed lifetimes moved` : ""}: ${c.verdict}`]));
    }
    for (const c of checks) {
      box.append(MP.el("div", {}, [MP.el("span", { class: "verdict " + (c.pass ? "pass" : "fail"),
        text: `check${c.dp_rank != null ? " dp" + c.dp_rank : ""}: ${c.pass ? "pass" : "FAIL"}` }),
        ` — predicted ${MP.fmtBytes(c.predicted_peak)}, measured ${MP.fmtBytes(c.measured_peak)}: ${c.verdict}`]));
    }
    // What is live at the peak, by name and policy.
    const details = MP.el("details", {}, [MP.el("summary", { text: `live at the peak: ${m.live_at_peak_count} buffers ` +
      `(+ ${MP.fmtBytes(m.transient_at_peak)} of block buffers), the largest ${m.live_at_peak.length}` })]);
    box.append(details);
    MP.table(details, [
      { name: "tensor", key: (b) => b.name, text: true }, { name: "mb", key: (b) => b.mb },
      { name: "owner rank", key: (b) => b.owner }, { name: "policy", key: (b) => b.policy, text: true },
      { name: "part", key: (b) => b.part, text: true }, { name: "bytes", key: (b) => b.bytes, fmt: MP.fmtBytes },
    ], m.live_at_peak, { sortable: true });
  }
};
