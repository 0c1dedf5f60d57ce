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
    `${data.solver} solver; pp ${par.pp} × vp ${par.vp} × dp ${par.dp} × ep ${par.ep} × tp ${par.tp} × cp ${par.cp}; ` +
    `${data.ranks.length} pipeline ranks` + (data.measured ? `; ${data.measured.ranks.length} ranks measured on ${data.measured.backend}` : "") +
    (data.trace ? "; with TRACE.json" : "") +
    (data.throughput ? `; step ${(1e3 * data.overhead.step_s).toFixed(1)} ms, modelled ` +
      `${Math.round(data.throughput.tokens_per_s_per_gpu)} tokens/s per GPU, MFU ${(100 * data.throughput.mfu).toFixed(1)} % ` +
      `(${data.throughput.source})` : "");
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
  for (const [name, render] of Object.entries(MP.views)) {
    const section = document.getElementById(name);
    try {
      const before = MP.charts.length, t0 = performance.now();
      render(section, data);
      section.dataset.ms = String(Math.round(performance.now() - t0));
      section.dataset.charts = String(MP.charts.length - before);
      section.dataset.rendered = "ok";
    } catch (e) {
      section.dataset.rendered = "error";
      section.append(MP.el("div", { class: "banner error", text: `This view failed: ${e.message}` }));
      status.errors.push(`${name}: ${e.message}`);
    }
  }
  document.getElementById("footer").textContent = "memplan viz: one self-contained file (uPlot 1.6.32, MIT, inline; " +
    "no network).";
  // After the charts painted: ink per view (non-blank canvas pixels).
  requestAnimationFrame(() => requestAnimationFrame(() => {
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
    document.body.dataset.requests = String(performance.getEntriesByType("resource").length);
    document.body.dataset.blocked = String(status.blocked);
    document.body.dataset.errors = String(status.errors.length);
    document.body.dataset.errorText = status.errors.join(" | ");
    document.body.dataset.done = "1";
  }));
})();
