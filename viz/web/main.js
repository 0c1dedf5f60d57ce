// Reads the report's data, renders every view and records for the tests
// (and for anyone curious) what happened: each view's status, any error,
// any request the page tried (there must be none), each chart's ink.
"use strict";
(() => {
  const status = { errors: [], blocked: 0 };
  window.addEventListener("error", (e) => status.errors.push(String(e.message)));
  document.addEventListener("securitypolicyviolation", () => { status.blocked += 1; });
  const t0 = performance.now();
  const data = JSON.parse(document.getElementById("memplan-data").textContent);
  document.body.dataset.parseMs = String(Math.round(performance.now() - t0));
  document.getElementById("title").textContent = `memplan report: ${data.name}`;
  const par = data.parallel || {};
  document.getElementById("subtitle").textContent = `plan ${data.digest.slice(0, 19)}… by ${data.generator}, ` +
    `${data.solver} solver; ${data.ranks.length} pipeline ranks` +
    (data.measured ? `; ${data.measured.ranks.length} ranks measured on ${data.measured.backend}` : "") +
    (data.trace ? "; with TRACE.json" : "") +
    (data.throughput ? `; steps and throughput modelled (${data.throughput.source}), not measured` : "");
  // The facts a reader looks for first: step and throughput (modelled),
  // batch, layout, hardware, dtypes, storage kinds.
  const train = data.train || {}, hw = data.hardware || {};
  const tokens = (train.micro_batch || 0) * (train.microbatches || 0) * (par.dp || 1);
  const facts = [
    ["step", data.overhead && data.overhead.step_s != null ? `${(1e3 * data.overhead.step_s).toFixed(1)} ms (modelled)` : "–"],
    ["tokens/s per GPU", data.throughput ? `${Math.round(data.throughput.tokens_per_s_per_gpu)} (MFU ` +
      `${(100 * data.throughput.mfu).toFixed(1)} %)` : "–"],
    ["global batch", `${tokens} sequences × ${train.seq_len} tokens (micro-batch ${train.micro_batch} × ${train.microbatches} × dp ${par.dp})`],
    ["layout", `tp ${par.tp}${par.sp ? "+sp" : ""} · pp ${par.pp}×vp ${par.vp} · cp ${par.cp} · ep ${par.ep} · dp ${par.dp} · ZeRO-${par.zero}`],
    ["hardware", `${hw.preset} · ${MP.fmtBytes(hw.device_memory || 0)} per GPU · host ${MP.fmtBytes(hw.host_memory || 0)}`],
    ["dtypes", `act ${train.act_dtype} · params ${train.param_dtype} · grads ${train.grad_dtype} · ${train.optimizer}`],
    ["storage", (data.storage || []).join(", ") + (data.target && data.target !== "memplan" ? ` (target ${data.target})` : "")],
  ];
  document.getElementById("facts").append(...facts.map(([k, v]) =>
    MP.el("div", { "data-fact": k }, [MP.el("dt", { text: k }), MP.el("dd", { text: v })])));
  const banners = document.getElementById("banners");
  for (const w of data.warnings) banners.append(MP.el("div", { class: "banner", text: "Warning: " + w }));
  if (data.check) {
    const failed = data.check.ranks.filter((r) => !r.pass).length;
    banners.append(MP.el("div", { class: "banner" + (failed ? " error" : ""), text: failed
      ? `check: ${failed} of ${data.check.ranks.length} ranks outside the plan's bounds`
      : `check: every rank within the plan's bounds (tolerance ${(100 * data.check.tolerance).toFixed(2)} %)` }));
  }
  // #only=VIEW shows one view (the documentation's screenshots).
  const only = (location.hash.match(/only=(\w+)/) || [])[1];
  if (only) { document.body.classList.add("only"); document.getElementById(only)?.classList.add("shown"); }
  const drawn = [];  // [section, its charts]
  for (const [name, render] of Object.entries(MP.views)) {
    const section = document.getElementById(name);
    try {
      const before = MP.charts.length, t0 = performance.now();
      render(section, data);
      section.dataset.ms = String(Math.round(performance.now() - t0));
      section.dataset.charts = String(MP.charts.length - before);
      drawn.push([section, MP.charts.slice(before)]);
      section.dataset.rendered = "ok";
    } catch (e) {
      section.dataset.rendered = "error";
      section.append(MP.el("div", { class: "banner error", text: `This view failed: ${e.message}` }));
      status.errors.push(`${name}: ${e.message}`);
    }
  }
  document.getElementById("footer").textContent = "memplan viz: one self-contained file (uPlot 1.6.32, MIT, inline; " +
    "no network).";
  // Opened at a view (REPORT.html#memory): that view comes first, right
  // under the header, and the page stays at its top. (The browser's jump
  // to the anchor happens before the views are drawn, and headless
  // Chromium's screenshots show nothing of a scrolled page: the view came
  // out blank.) Links inside the page still scroll as usual.
  const anchor = (location.hash.match(/^#(\w+)$/) || [])[1];
  const target = anchor && document.getElementById(anchor);
  if (target && target.classList.contains("view")) {
    target.parentElement.prepend(target);
    const top = () => window.scrollTo(0, 0);
    top();
    window.addEventListener("load", top, { once: true });
  }
  // After the charts painted: ink per view (non-blank canvas pixels).
  requestAnimationFrame(() => requestAnimationFrame(() => {
    if (target) window.scrollTo(0, 0);
    for (const section of document.querySelectorAll(".view")) {
      let ink = 0;
      for (const c of section.querySelectorAll("canvas")) {
        if (!c.width || !c.height) continue;
        const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
        for (let i = 3; i < px.length; i += 4 * 7) ink += px[i] > 0 ? 1 : 0;
      }
      section.dataset.ink = String(ink);
      section.dataset.rows = String(section.querySelectorAll("tbody tr").length);
    }
    if (target) {
      document.body.dataset.anchorTop = String(Math.round(target.getBoundingClientRect().top));
      document.body.dataset.scrollY = String(Math.round(window.scrollY));
    }
    // Where each chart's y axis starts (the browser test: at 0).
    for (const [section, charts] of drawn) {
      const lows = charts.map((u) => u.scales.y && u.scales.y.min).filter((v) => v != null);
      if (lows.length) section.dataset.yMin = String(Math.min(...lows));
    }
    document.body.dataset.pageHeight = String(document.documentElement.scrollHeight);
    document.body.dataset.requests = String(performance.getEntriesByType("resource").length);
    document.body.dataset.blocked = String(status.blocked);
    document.body.dataset.errors = String(status.errors.length);
    document.body.dataset.errorText = status.errors.join(" | ");
    document.body.dataset.done = "1";
  }));
})();
